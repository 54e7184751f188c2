//! RabbitMQ **Streams** (feature `streams`, client `rabbitmq-stream-client`): an append-only
//! log on the broker, read by offset, with server-side offset storage per consumer name and
//! broker-side deduplication of named producers.
//!
//! **What the broker guarantees.** A stream keeps every message (until retention) at an
//! offset; a consumer reads from an offset it chooses and settles nothing per message. A
//! *named* consumer can store an offset on the broker (`store_offset`) and read it back after
//! a restart. A *named* producer sends each message with a publishing id; the broker keeps
//! the highest id it stored per producer name and stream and drops (while still confirming)
//! any message whose id is not higher — so a resend after a lost confirm, or after the
//! producer process restarted, is stored once. Ids must therefore grow: take them from
//! something monotonic in your data (an outbox row id, a sequence), not from a clock or a
//! hash. Unnamed producers do not deduplicate.
//!
//! **How settlements map** ([`StreamSource`]): streams have offsets, not acks. Every delivery
//! is tracked in the core's [`OffsetTracker`](idemq_core::adapter::OffsetTracker); after a
//! batch the source stores, for its consumer name, the last offset of the *contiguous*
//! settled prefix (the convention of RabbitMQ's clients: the stored offset is the last one
//! processed, a restart reads from the next). An ack settles; a nack holds the message
//! locally and redelivers it after its delay, handing out nothing newer meanwhile (stream
//! order kept, like a Kafka partition); a reject publishes a confirmed copy to the
//! dead-letter stream (`<stream>.dlq`) with [`DLQ_REASON`](crate::DLQ_REASON), then settles;
//! a dropped delivery is redelivered at once. Whatever was read past the stored offset is
//! read again after a crash, and the dedup store recognises what was done.
//!
//! **Publishing** ([`StreamPublisher`]): confirmed publishes; with a producer name, the
//! publishing id comes from the message's [`PUBLISHING_ID_HEADER`], and
//! [`StreamPublisher::last_publishing_id`] says where the broker's sequence stands (where to
//! resume after a restart). The dedup key goes into the AMQP 1.0 `message-id` and the
//! [`DEDUP_HEADER`](idemq_core::DEDUP_HEADER) application property, so consumer-side dedup
//! works as on queues.

mod producer;
mod source;

pub use producer::{
    last_publishing_id, StreamPublisher, StreamPublisherConfig, PUBLISHING_ID_HEADER,
};
pub use source::{read_stream, StreamSource, StreamSourceConfig, StreamStart, DLQ_OFFSET};

/// Re-export of the stream client this module is built on.
pub use rabbitmq_stream_client;

use crate::RabbitError;
use idemq_core::envelope::props;
use idemq_core::{Envelope, Headers, OutgoingMessage, Position};
use rabbitmq_stream_client::types::{Message, ResponseCode, SimpleValue};
use rabbitmq_stream_client::{Client, ClientOptions, Environment};

/// Where the stream port of a broker is, from `rabbitmq-stream://user:pass@host:port/vhost`
/// (port 5552 when absent, vhost `/` when absent; `%2f` for `/`).
#[derive(Clone, PartialEq, Eq)]
pub struct StreamEndpoint {
    /// Host name or address.
    pub host: String,
    /// Stream protocol port.
    pub port: u16,
    /// User name.
    pub user: String,
    /// Password.
    pub password: String,
    /// Virtual host.
    pub vhost: String,
}

impl std::fmt::Debug for StreamEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamEndpoint")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("user", &self.user)
            .field("vhost", &self.vhost)
            .finish_non_exhaustive()
    }
}

impl StreamEndpoint {
    /// Parses a `rabbitmq-stream://` URL.
    pub fn parse(url: &str) -> Result<Self, RabbitError> {
        let u = url::Url::parse(url)
            .map_err(|e| RabbitError::Config(format!("stream url {url:?}: {e}")))?;
        if u.scheme() != "rabbitmq-stream" {
            return Err(RabbitError::Config(format!(
                "stream url must start with rabbitmq-stream:// (got {:?})",
                u.scheme()
            )));
        }
        let decode = |s: &str| {
            url::form_urlencoded::parse(s.as_bytes())
                .map(|(k, v)| {
                    if v.is_empty() {
                        k
                    } else {
                        format!("{k}={v}").into()
                    }
                })
                .collect::<String>()
        };
        let user = if u.username().is_empty() {
            "guest".to_string()
        } else {
            decode(u.username())
        };
        let vhost = match u.path().trim_start_matches('/') {
            "" => "/".to_string(),
            p => decode(p),
        };
        Ok(Self {
            host: u.host_str().unwrap_or("localhost").to_string(),
            port: u.port().unwrap_or(5552),
            password: decode(u.password().unwrap_or("guest")),
            user,
            vhost,
        })
    }

    /// An environment (the client's factory of producers and consumers) for this endpoint.
    pub async fn environment(&self) -> Result<Environment, RabbitError> {
        Environment::builder()
            .host(&self.host)
            .port(self.port)
            .username(&self.user)
            .password(&self.password)
            .virtual_host(&self.vhost)
            .build()
            .await
            .map_err(|e| {
                RabbitError::Connect(format!("stream port {}:{}: {e}", self.host, self.port))
            })
    }

    /// One protocol client, for queries (stored offsets, publisher sequences).
    pub(crate) async fn client(&self) -> Result<Client, RabbitError> {
        let opts = ClientOptions::builder()
            .host(&self.host)
            .port(self.port)
            .user(&self.user)
            .password(&self.password)
            .v_host(&self.vhost)
            .build();
        Client::connect(opts).await.map_err(|e| {
            RabbitError::Connect(format!("stream port {}:{}: {e}", self.host, self.port))
        })
    }
}

/// Creates `stream` unless it exists.
pub async fn create_stream(env: &Environment, stream: &str) -> Result<(), RabbitError> {
    match env.stream_creator().create(stream).await {
        Ok(()) => Ok(()),
        Err(rabbitmq_stream_client::error::StreamCreateError::Create {
            status: ResponseCode::StreamAlreadyExists,
            ..
        }) => Ok(()),
        Err(e) => Err(RabbitError::Declare {
            queue: stream.to_string(),
            reason: e.to_string(),
        }),
    }
}

/// Deletes `stream` (and everything in it); a missing stream is not an error.
pub async fn delete_stream(url: &str, stream: &str) -> Result<(), RabbitError> {
    let env = StreamEndpoint::parse(url)?.environment().await?;
    match env.delete_stream(stream).await {
        Ok(()) => Ok(()),
        Err(rabbitmq_stream_client::error::StreamDeleteError::Delete {
            status: ResponseCode::StreamDoesNotExist,
            ..
        }) => Ok(()),
        Err(e) => Err(RabbitError::Declare {
            queue: stream.to_string(),
            reason: e.to_string(),
        }),
    }
}

/// An application property value as header bytes.
fn value_bytes(v: &SimpleValue) -> Option<Vec<u8>> {
    Some(match v {
        SimpleValue::String(s) => s.as_bytes().to_vec(),
        SimpleValue::Binary(b) => b.clone(),
        SimpleValue::Symbol(s) => s.as_bytes().to_vec(),
        SimpleValue::Boolean(b) => b.to_string().into_bytes(),
        SimpleValue::Ubyte(n) => n.to_string().into_bytes(),
        SimpleValue::Ushort(n) => n.to_string().into_bytes(),
        SimpleValue::Uint(n) => n.to_string().into_bytes(),
        SimpleValue::Ulong(n) => n.to_string().into_bytes(),
        SimpleValue::Byte(n) => n.to_string().into_bytes(),
        SimpleValue::Short(n) => n.to_string().into_bytes(),
        SimpleValue::Int(n) => n.to_string().into_bytes(),
        SimpleValue::Long(n) => n.to_string().into_bytes(),
        _ => return None,
    })
}

/// A stream message as an envelope: the AMQP 1.0 `message-id` as message id and key,
/// application properties as headers, `correlation-id`, `reply-to`, `content-type` and
/// `content-encoding` under the reserved [`props`] names, the offset as position.
pub fn stream_envelope(stream: &str, offset: u64, m: &Message) -> Envelope {
    let payload = bytes::Bytes::copy_from_slice(m.data().unwrap_or_default());
    let mut env = Envelope::new(crate::RABBITMQ, stream, payload);
    env.source.position = Some(Position::Offset(i64::try_from(offset).unwrap_or(i64::MAX)));
    if let Some(p) = m.properties() {
        if let Some(mid) = p.message_id.as_ref().map(message_id_string) {
            env.key = Some(bytes::Bytes::copy_from_slice(mid.as_bytes()));
            env.message_id = Some(mid);
        }
        let named = [
            (
                props::CORRELATION_ID,
                p.correlation_id.as_ref().map(message_id_string),
            ),
            (props::REPLY_TO, p.reply_to.clone()),
            (
                props::CONTENT_TYPE,
                p.content_type.as_ref().map(|s| s.to_string()),
            ),
            (
                props::CONTENT_ENCODING,
                p.content_encoding.as_ref().map(|s| s.to_string()),
            ),
        ];
        for (name, value) in named {
            if let Some(v) = value {
                env.headers.insert(name, v);
            }
        }
    }
    if let Some(app) = m.application_properties() {
        for (k, v) in app.iter() {
            if let Some(b) = value_bytes(v) {
                env.headers.insert(k.clone(), b);
            }
        }
    }
    env
}

/// A `message-id` / `correlation-id` as text (the client does not export its type: it is
/// taken apart through its conversions).
fn message_id_string<T>(id: &T) -> String
where
    T: Clone + std::fmt::Debug,
    String: TryFrom<T>,
    u64: TryFrom<T>,
    i64: TryFrom<T>,
{
    if let Ok(s) = String::try_from(id.clone()) {
        return s;
    }
    if let Ok(n) = u64::try_from(id.clone()) {
        return n.to_string();
    }
    if let Ok(n) = i64::try_from(id.clone()) {
        return n.to_string();
    }
    format!("{id:?}")
}

/// An outgoing message as a stream message (publishing id set by the caller): payload as
/// body, the dedup key (or the key) as `message-id`, reserved properties as AMQP 1.0
/// properties, every other header as an application property.
pub(crate) fn stream_message(msg: &OutgoingMessage, publishing_id: Option<u64>) -> Message {
    let wire: Headers = msg.wire_headers();
    let mut b = Message::builder().body(msg.payload.to_vec());
    if let Some(id) = publishing_id {
        b = b.publising_id(id); // sic: the 0.4 protocol crate spells it so
    }
    let id = msg.dedup_key.clone().or_else(|| {
        msg.key
            .as_ref()
            .and_then(|k| std::str::from_utf8(k).ok().map(str::to_string))
    });
    let mut p = b.properties();
    if let Some(id) = id {
        p = p.message_id(id);
    }
    if let Some(v) = msg.headers.get_str(props::CORRELATION_ID) {
        p = p.correlation_id(v.to_string());
    }
    if let Some(v) = msg.headers.get_str(props::REPLY_TO) {
        p = p.reply_to(v.to_string());
    }
    let mut app = p.message_builder().application_properties();
    for (name, value) in wire.iter() {
        if name.starts_with(props::PREFIX) {
            continue;
        }
        app = match std::str::from_utf8(value) {
            Ok(s) => app.insert(name.to_string(), s.to_string()),
            Err(_) => app.insert(name.to_string(), SimpleValue::Binary(value.to_vec())),
        };
    }
    app.message_builder().build()
}

/// What a stream confirm callback reports (the client's own status type is not exported).
pub(crate) type Confirmed = Result<(), ConfirmFailure>;

/// Why a stream publish was not confirmed.
#[derive(Debug, Clone)]
pub(crate) enum ConfirmFailure {
    /// The broker answered with an error status.
    Refused(String),
    /// The connection failed after the message was handed over.
    Lost(String),
}

/// The confirm channel of one message: the callback given to the client's `send` posts
/// into it.
pub(crate) fn confirm_channel() -> (
    tokio::sync::mpsc::Sender<Confirmed>,
    tokio::sync::mpsc::Receiver<Confirmed>,
) {
    tokio::sync::mpsc::channel(1)
}

/// The confirm callback handed to the client's `send`, posting into `$tx` (a macro: the
/// closure must stand at the call, where its argument's type — not exported by the client —
/// is inferred).
macro_rules! confirm_callback {
    ($tx:expr) => {{
        let tx = $tx;
        move |status| {
            let tx = tx.clone();
            let out: $crate::stream::Confirmed = match status {
                Ok(s) if s.confirmed() => Ok(()),
                Ok(s) => Err($crate::stream::ConfirmFailure::Refused(format!(
                    "publishing id {} refused: {:?}",
                    s.publishing_id(),
                    s.status()
                ))),
                Err(e) => Err($crate::stream::ConfirmFailure::Lost(e.to_string())),
            };
            async move {
                let _ = tx.send(out).await;
            }
        }
    }};
}
pub(crate) use confirm_callback;

#[cfg(test)]
mod conversion_tests {
    use super::*;
    use crate::fields::arbitrary::{bytes, text};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// An application property value of the kinds a producer sends.
    fn simple(rng: &mut StdRng) -> SimpleValue {
        match rng.gen_range(0..7) {
            0 => SimpleValue::String(text(rng, 2_000)),
            1 => SimpleValue::Binary(bytes(rng)),
            2 => SimpleValue::Long(rng.gen()),
            3 => SimpleValue::Ulong(rng.gen()),
            4 => SimpleValue::Boolean(rng.gen()),
            5 => SimpleValue::Int(rng.gen()),
            _ => SimpleValue::Null,
        }
    }

    #[test]
    fn every_stream_message_becomes_an_envelope_whatever_it_holds() {
        for seed in 0..3_000u64 {
            let mut rng = StdRng::seed_from_u64(seed);
            let body = bytes(&mut rng);
            let id = rng.gen_bool(0.7).then(|| text(&mut rng, 300));
            let correlation = rng.gen_bool(0.3).then(|| text(&mut rng, 300));
            let mut b = Message::builder().body(body.clone()).properties();
            if let Some(id) = &id {
                b = b.message_id(id.clone());
            }
            if let Some(c) = &correlation {
                b = b.correlation_id(c.clone());
            }
            let mut app = b.message_builder().application_properties();
            let mut sent = Vec::new();
            for _ in 0..rng.gen_range(0..8) {
                let (k, v) = (text(&mut rng, 300), simple(&mut rng));
                sent.push((k.clone(), v.clone()));
                app = app.insert(k, v);
            }
            let m = app.message_builder().build();
            let offset = rng.gen();
            let env = stream_envelope("s", offset, &m);
            assert_eq!(&env.payload[..], &body[..], "seed {seed}");
            assert_eq!(env.message_id, id, "seed {seed}");
            assert_eq!(env.key.as_deref(), id.as_deref().map(str::as_bytes));
            assert_eq!(
                env.headers.get_str(props::CORRELATION_ID),
                correlation.as_deref()
            );
            assert_eq!(
                env.source.position,
                Some(Position::Offset(i64::try_from(offset).unwrap_or(i64::MAX)))
            );
            // The last value of a repeated name is the one the message holds.
            for (i, (k, v)) in sent.iter().enumerate() {
                if sent[i + 1..].iter().any(|(later, _)| later == k) {
                    continue;
                }
                let want = value_bytes(v);
                let got = env
                    .headers
                    .iter()
                    .find(|(n, _)| *n == k.as_str())
                    .map(|(_, b)| b.to_vec());
                assert_eq!(got, want, "seed {seed}: property {k:?}");
            }
        }
    }
}
