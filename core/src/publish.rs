//! Producing, broker-neutral: the [`Publisher`] contract every adapter implements.
//!
//! A publish succeeds only after the broker's *durable* confirmation (Kafka `acks=all` with
//! idempotence, an AMQP publisher confirm of a persistent message, RocketMQ `SEND_OK`).
//! Anything short of that is an error that says whether a resend is safe:
//!
//! | error | stored? | resend |
//! |---|---|---|
//! | [`PublishError::Ambiguous`] | maybe (timeout, lost confirm, flush/slave timeout) | only with the *same* dedup key: the consumer drops the copy |
//! | [`PublishError::Rejected`] | no (broker refused: size, ACL, nack) | after fixing the cause |
//! | [`PublishError::Unroutable`] | no (no queue bound, unknown topic) | after routing exists |
//! | [`PublishError::Disconnected`] | no (never left the client) | yes |
//! | [`PublishError::Busy`] | no (the broker's flow control turned it away) | yes, after a pause |
//! | [`PublishError::Fenced`] | no (another producer owns the transactional id) | never from this producer: stop it |
//! | [`PublishError::Config`] | no | after fixing the configuration |
//!
//! Every adapter writes [`OutgoingMessage::dedup_key`] into the well-known header
//! [`DEDUP_HEADER`] *and* into the broker's native slot (for example AMQP `message_id`, or
//! RocketMQ `KEYS`), so a message relayed from one broker to another keeps its key, and
//! [`KeySource::DedupHeader`](crate::key::KeySource::DedupHeader) reads it back on any
//! broker from the [`DedupSlot`](crate::DedupSlot)s its adapter declares.

use crate::envelope::{Headers, Position};
use async_trait::async_trait;
use bytes::Bytes;

pub use crate::envelope::DEDUP_HEADER;

/// A message to publish.
///
/// ```
/// use idemq_core::publish::{OutgoingMessage, DEDUP_HEADER};
/// let m = OutgoingMessage::new("payments", r#"{"payment_id":"p-1"}"#)
///     .with_key("order-42")
///     .with_dedup_key("p-1");
/// assert_eq!(m.wire_headers().get_str(DEDUP_HEADER), Some("p-1"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutgoingMessage {
    /// Kafka topic; RabbitMQ `exchange/routing-key` (or a queue name on the default
    /// exchange); RocketMQ topic (`topic:tags` is not parsed: set tags as a header).
    pub destination: String,
    /// The message key (Kafka record key; RocketMQ keys besides the dedup key).
    pub key: Option<Bytes>,
    /// What orders it among others: Kafka partitions by [`OutgoingMessage::key`] unless
    /// this is set; RocketMQ selects the queue by it (orderly topics).
    pub ordering_key: Option<Bytes>,
    /// Headers / user properties.
    pub headers: Headers,
    /// The body.
    pub payload: Bytes,
    /// The business key the consumer dedups on; stays the same across resends.
    pub dedup_key: Option<String>,
}

impl OutgoingMessage {
    /// A message to `destination` with `payload`.
    pub fn new(destination: impl Into<String>, payload: impl Into<Bytes>) -> Self {
        Self {
            destination: destination.into(),
            key: None,
            ordering_key: None,
            headers: Headers::new(),
            payload: payload.into(),
            dedup_key: None,
        }
    }
    /// Sets the message key.
    pub fn with_key(mut self, key: impl Into<Bytes>) -> Self {
        self.key = Some(key.into());
        self
    }
    /// Sets the ordering key.
    pub fn with_ordering_key(mut self, key: impl Into<Bytes>) -> Self {
        self.ordering_key = Some(key.into());
        self
    }
    /// Adds a header.
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<Bytes>) -> Self {
        self.headers.insert(name, value);
        self
    }
    /// Sets the W3C trace context ([`crate::envelope::TRACEPARENT_HEADER`]) of the trace that
    /// sends this message, so the consumer's spans (and a duplicate's) link back to it.
    pub fn with_traceparent(self, traceparent: impl Into<Bytes>) -> Self {
        self.with_header(crate::envelope::TRACEPARENT_HEADER, traceparent)
    }
    /// Sets the dedup key (written to [`DEDUP_HEADER`] and the broker's native slot).
    pub fn with_dedup_key(mut self, key: impl Into<String>) -> Self {
        self.dedup_key = Some(key.into());
        self
    }
    /// The headers as they go on the wire: the user's, minus any stale [`DEDUP_HEADER`],
    /// plus [`DEDUP_HEADER`] set to the dedup key. Reserved `idemq.` names (the envelope's
    /// view of native properties) are not copied: they describe a delivery, not a message.
    pub fn wire_headers(&self) -> Headers {
        let mut h = Headers::new();
        for (name, value) in self.headers.iter() {
            if name == DEDUP_HEADER || name.starts_with(crate::envelope::props::PREFIX) {
                continue;
            }
            h.insert(name, value.clone());
        }
        if let Some(k) = &self.dedup_key {
            h.insert(DEDUP_HEADER, Bytes::copy_from_slice(k.as_bytes()));
        }
        h
    }
}

/// Where the broker put a confirmed message.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PublishReceipt {
    /// Topic / exchange it went to.
    pub destination: String,
    /// Kafka partition or RocketMQ queue id.
    pub partition: Option<i32>,
    /// Offset, when the broker reports one.
    pub position: Option<Position>,
    /// The broker's message id (RocketMQ `UNIQ_KEY`), when it assigns one.
    pub message_id: Option<String>,
}

/// Why a publish was not confirmed; see the module docs for what a resend does.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PublishError {
    /// The outcome is unknown: the broker may have stored the message.
    #[error("publish outcome unknown ({0}): the broker may have stored it; resend only with the same dedup key, the consumer drops the copy")]
    Ambiguous(String),
    /// The broker refused the message; it was not stored.
    #[error("broker rejected the message ({0}); not stored: fix the cause before resending")]
    Rejected(String),
    /// Nothing would receive it (no queue bound, unknown topic); it was not stored.
    #[error("message unroutable ({0}); not stored: declare or bind the destination, then resend")]
    Unroutable(String),
    /// The client could not reach the broker; the message did not leave.
    #[error("broker unreachable ({0}); not sent: resending is safe")]
    Disconnected(String),
    /// The broker turned the message away under load (flow control, RocketMQ
    /// `SYSTEM_BUSY`); it was not stored. `RocketPublisher` asks again within its send
    /// timeout before it answers this; RocketMQ's transactional publisher answers it at
    /// once (the half message was not stored and the local transaction never ran).
    #[error("broker busy ({0}); not stored: resend after a pause")]
    Busy(String),
    /// Another producer instance took over this producer's transactional identity.
    #[error("producer fenced ({0}): another instance owns this transactional id; stop this producer, do not resend from it")]
    Fenced(String),
    /// The publisher is misconfigured.
    #[error("publisher misconfigured: {0}")]
    Config(String),
}

impl PublishError {
    /// The broker may hold the message although the publish failed.
    pub fn may_be_stored(&self) -> bool {
        matches!(self, PublishError::Ambiguous(_))
    }
    /// A resend of the same message (same dedup key) from this publisher can succeed
    /// without operator action; an ambiguous one may then be stored twice, which the
    /// consumer's dedup absorbs.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            PublishError::Ambiguous(_) | PublishError::Disconnected(_) | PublishError::Busy(_)
        )
    }
}

/// Publishes messages to one broker; each result comes after the broker's durable confirm.
#[async_trait]
pub trait Publisher: Send + Sync {
    /// Publishes one message and waits for the broker's durable confirmation.
    async fn publish(&self, msg: OutgoingMessage) -> Result<PublishReceipt, PublishError>;

    /// Publishes many; one result per message, in order. The default publishes one at a
    /// time; adapters pipeline (confirms and acks arrive for the whole window).
    async fn publish_batch(
        &self,
        msgs: Vec<OutgoingMessage>,
    ) -> Vec<Result<PublishReceipt, PublishError>> {
        let mut out = Vec::with_capacity(msgs.len());
        for m in msgs {
            out.push(self.publish(m).await);
        }
        out
    }
}

#[async_trait]
impl<P: Publisher + ?Sized> Publisher for std::sync::Arc<P> {
    async fn publish(&self, msg: OutgoingMessage) -> Result<PublishReceipt, PublishError> {
        (**self).publish(msg).await
    }
    async fn publish_batch(
        &self,
        msgs: Vec<OutgoingMessage>,
    ) -> Vec<Result<PublishReceipt, PublishError>> {
        (**self).publish_batch(msgs).await
    }
}
