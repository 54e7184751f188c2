//! The JetStream publisher: the dedup key in `Nats-Msg-Id`, a result only after the
//! stream's `PubAck`, and whether the stream found the message a duplicate.

use crate::envelope::outgoing_headers;
use crate::link::{connect, Link};
use crate::{NatsError, MSG_ID_HEADER};
use async_nats::jetstream;
use async_nats::jetstream::context::{PublishAckFuture, PublishErrorKind};
use async_nats::jetstream::message::PublishMessage as Publish;
use async_nats::jetstream::publish::PublishAck;
use async_trait::async_trait;
use idemq_core::envelope::Position;
use idemq_core::publish::{OutgoingMessage, PublishError, PublishReceipt, Publisher};
use std::time::Duration;

/// Settings of a [`NatsPublisher`] (`Debug` shows the URL without its credentials).
#[derive(Clone)]
pub struct NatsPublisherConfig {
    /// `nats://HOST:PORT`, several separated by commas; credentials as user info.
    pub url: String,
    /// Longest wait for the first connection.
    pub connect_timeout: Duration,
    /// Longest wait for a `PubAck` after the message was sent; past it the outcome is
    /// [`PublishError::Ambiguous`].
    pub ack_timeout: Duration,
}

impl std::fmt::Debug for NatsPublisherConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsPublisherConfig")
            .field("url", &crate::redact(&self.url))
            .field("connect_timeout", &self.connect_timeout)
            .field("ack_timeout", &self.ack_timeout)
            .finish()
    }
}

impl NatsPublisherConfig {
    /// Publishes through the servers of `url`; `PubAck`s awaited 10 s at most.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            connect_timeout: Duration::from_secs(5),
            ack_timeout: Duration::from_secs(10),
        }
    }
}

/// A publish the stream acknowledged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NatsPublished {
    /// What [`Publisher::publish`] returns: the subject, the stream sequence as position
    /// ([`Position::Sequence`]) and `Nats-Msg-Id` as message id.
    pub receipt: PublishReceipt,
    /// The stream that stored it.
    pub stream: String,
    /// The stream found a message with the same `Nats-Msg-Id` within its duplicate window
    /// and did not store this one; the sequence is the stored message's.
    pub duplicate: bool,
}

/// Publishes to JetStream; see [`Publisher`] for what each error means for a resend.
///
/// [`OutgoingMessage::destination`] is the subject (a stream must capture it). The dedup
/// key goes into `Nats-Msg-Id` and [`DEDUP_HEADER`](idemq_core::DEDUP_HEADER), the key into
/// [`KEY_HEADER`](crate::KEY_HEADER); `ordering_key` has no NATS counterpart (order is per
/// subject). A header NATS cannot carry as it is fails the publish as `Rejected`, naming it.
pub struct NatsPublisher {
    link: Link,
    js: jetstream::Context,
}

impl std::fmt::Debug for NatsPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsPublisher")
            .field("servers", &self.link.servers)
            .finish_non_exhaustive()
    }
}

/// The core's error for a JetStream publish that failed before (`sent` false) or after the
/// message left.
pub(crate) fn publish_error(
    e: &jetstream::context::PublishError,
    subject: &str,
    sent: bool,
) -> PublishError {
    let text = format!("{subject}: {e}");
    match e.kind() {
        PublishErrorKind::StreamNotFound => PublishError::Unroutable(format!(
            "{subject}: no stream captures this subject (create one, e.g. `nats stream add --subjects '{subject}'`)"
        )),
        PublishErrorKind::MaxPayloadExceeded => PublishError::Rejected(text),
        PublishErrorKind::WrongLastMessageId | PublishErrorKind::WrongLastSequence => {
            PublishError::Rejected(text)
        }
        PublishErrorKind::MaxAckPending => PublishError::Busy(text),
        PublishErrorKind::TimedOut | PublishErrorKind::BrokenPipe if sent => {
            PublishError::Ambiguous(text)
        }
        PublishErrorKind::TimedOut | PublishErrorKind::BrokenPipe => {
            PublishError::Disconnected(text)
        }
        // An answer from the stream: it refused the message. 503 is JetStream saying it is
        // not available right now (a leader election): worth a resend after a pause.
        PublishErrorKind::Other => match std::error::Error::source(e)
            .and_then(|s| s.downcast_ref::<jetstream::Error>())
        {
            Some(js) if js.code() == 503 => {
                PublishError::Busy(text)
            }
            Some(_) => PublishError::Rejected(text),
            None if sent => PublishError::Ambiguous(text),
            None => PublishError::Rejected(text),
        },
    }
}

/// Sends `publish` to `subject` and waits for its `PubAck`.
pub(crate) async fn send_and_confirm(
    js: &jetstream::Context,
    subject: String,
    publish: Publish,
) -> Result<PublishAck, PublishError> {
    let ack = js
        .send_publish(subject.clone(), publish)
        .await
        .map_err(|e| publish_error(&e, &subject, false))?;
    ack.await.map_err(|e| publish_error(&e, &subject, true))
}

impl NatsPublisher {
    /// Connects to the servers of `cfg.url`. Fails naming the servers (without credentials)
    /// when none answers or the login is refused.
    pub async fn connect(cfg: NatsPublisherConfig) -> Result<Self, NatsError> {
        let link = connect(
            &cfg.url,
            "idemq-publisher",
            cfg.connect_timeout,
            cfg.ack_timeout,
        )
        .await?;
        let js = jetstream::ContextBuilder::new()
            .timeout(cfg.ack_timeout)
            .build(link.client.clone());
        Ok(Self { link, js })
    }

    /// Publishes `msg` and waits for the stream's `PubAck`, which says whether the stream
    /// took it as a duplicate of an earlier publish with the same dedup key.
    pub async fn publish_acked(
        &self,
        msg: &OutgoingMessage,
    ) -> Result<NatsPublished, PublishError> {
        let outcome = match self.dispatch(msg).await {
            Ok((id, ack)) => confirmed(msg, id, ack).await,
            Err(e) => Err(e),
        };
        count(&outcome);
        outcome
    }

    /// Sends `msg` without waiting for its `PubAck`: its `Nats-Msg-Id` and the ack to await.
    async fn dispatch(
        &self,
        msg: &OutgoingMessage,
    ) -> Result<(Option<String>, PublishAckFuture), PublishError> {
        let headers = outgoing_headers(msg)
            .map_err(|why| PublishError::Rejected(format!("{}: {why}", msg.destination)))?;
        // While the client is cut off it would queue the message and send it after the
        // reconnect: say so now instead, when a resend is known to be safe.
        if !self.link.is_up() {
            return Err(PublishError::Disconnected(self.link.unreachable()));
        }
        let message_id = headers.get(MSG_ID_HEADER).map(|v| v.as_str().to_string());
        let publish = Publish::build()
            .payload(msg.payload.clone())
            .headers(headers);
        let ack = self
            .js
            .send_publish(msg.destination.clone(), publish)
            .await
            .map_err(|e| publish_error(&e, &msg.destination, false))?;
        Ok((message_id, ack))
    }
}

/// Waits for the `PubAck` of `msg`, sent with `message_id`.
async fn confirmed(
    msg: &OutgoingMessage,
    message_id: Option<String>,
    ack: PublishAckFuture,
) -> Result<NatsPublished, PublishError> {
    let ack = ack
        .await
        .map_err(|e| publish_error(&e, &msg.destination, true))?;
    Ok(NatsPublished {
        receipt: PublishReceipt {
            destination: msg.destination.clone(),
            partition: None,
            position: Some(Position::Sequence(ack.sequence)),
            message_id,
        },
        stream: ack.stream,
        duplicate: ack.duplicate,
    })
}

/// Counts a publish by its outcome ([`crate::metrics::PUBLISHED`]).
fn count(outcome: &Result<NatsPublished, PublishError>) {
    let label = match outcome {
        Ok(p) if p.duplicate => "duplicate",
        Ok(_) => "stored",
        Err(_) => "failed",
    };
    metrics::counter!(crate::metrics::PUBLISHED, "outcome" => label).increment(1);
}

#[async_trait]
impl Publisher for NatsPublisher {
    async fn publish(&self, msg: OutgoingMessage) -> Result<PublishReceipt, PublishError> {
        self.publish_acked(&msg).await.map(|p| p.receipt)
    }

    /// Pipelined: every message is sent first, then the `PubAck`s are awaited in order.
    async fn publish_batch(
        &self,
        msgs: Vec<OutgoingMessage>,
    ) -> Vec<Result<PublishReceipt, PublishError>> {
        let mut sent = Vec::with_capacity(msgs.len());
        for m in &msgs {
            sent.push(self.dispatch(m).await);
        }
        let mut out = Vec::with_capacity(msgs.len());
        for (m, s) in msgs.iter().zip(sent) {
            let outcome = match s {
                Ok((id, ack)) => confirmed(m, id, ack).await,
                Err(e) => Err(e),
            };
            count(&outcome);
            out.push(outcome.map(|p| p.receipt));
        }
        out
    }
}
