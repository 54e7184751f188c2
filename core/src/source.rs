//! Where deliveries come from: the one trait every broker adapter implements.
//!
//! A [`Source`] yields batches of [`Delivery`]s; each delivery is settled exactly once with
//! [`Delivery::ack`], [`Delivery::nack`] (redeliver later) or [`Delivery::reject`] (dead-letter,
//! no redelivery). The engine settles every delivery it receives, and acks only after the
//! dedup record is durable. How a broker maps the three is the adapter's business:
//!
//! - Kafka commits one offset per partition: the adapter commits only the contiguous prefix
//!   of acked offsets, and a nack seeks the partition back so the message is polled again.
//! - RabbitMQ acks each delivery tag; nack requeues (after the delay, to avoid a hot loop);
//!   reject goes to the queue's dead-letter exchange.
//!   After a seek the adapter filters out offsets it already settled.
//! - RocketMQ's listener returns one status per batch: the adapter waits for every delivery
//!   of the batch and answers `RECONSUME_LATER` if any was nacked; a reject is a send to the
//!   group's DLQ topic followed by success for that message.
//!
//! A failed settlement must leave the message redeliverable (Kafka: seek back; RabbitMQ: the
//! channel closes and requeues). `nack` must return promptly and schedule the delay itself.
//! Dropping a [`Delivery`] unsettled calls [`Settle::abandon`], which adapters implement as a
//! nack without delay, since on a live connection the broker would otherwise wait forever.
//!
//! **Staleness.** A delivery goes stale when the source can no longer settle it for real: its
//! Kafka partition was revoked (another consumer now owns it), its AMQP channel was reopened
//! (the delivery tag now names another message, or none). [`Settle::is_stale`] says so; the
//! engine checks it before running the handler and gives the claim back instead, and settling
//! a stale delivery is harmless by contract (ignored, never applied to another message).
//!
//! **Lifecycle.** [`Source::close`] ends a subscription cleanly (final offset commit, leave the
//! group, cancel the consumer); the engine calls it when `run` ends. [`Source::after_batch`]
//! tells the source that every delivery of a batch is settled (Kafka commits offsets or a
//! transaction there).
//!
//! **Readiness.** A source can be connected and still have nothing to deliver for reasons
//! that are not "no messages": a Kafka consumer waits for the group coordinator to assign it
//! partitions, which after a crash of a group member lasts until that member's session
//! times out. [`Source::readiness`] hands out a [`ReadinessProbe`] that says which: a tool
//! that stops when idle (`idemq consume --idle-exit`) starts its idle clock only once the
//! source is ready, and can say what it is waiting for.

use crate::envelope::Envelope;
use async_trait::async_trait;
use std::time::Duration;

/// A failure to receive or settle: the adapter says whether retrying makes sense.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// The connection to the broker is gone; back off and reconnect.
    #[error("broker connection lost: {0}")]
    Disconnected(String),
    /// The broker refused the operation.
    #[error("broker error: {0}")]
    Broker(String),
    /// The source is misconfigured.
    #[error("source misconfigured: {0}")]
    Config(String),
}

/// The broker-side half of a delivery: how to settle it.
#[async_trait]
pub trait Settle: Send + Sync {
    /// The message is done; the broker may forget it.
    async fn ack(&mut self) -> Result<(), SourceError>;
    /// Not done; deliver it again, no sooner than `redeliver_after` where the broker can wait.
    async fn nack(&mut self, redeliver_after: Duration) -> Result<(), SourceError>;
    /// Never deliver it again here; dead-letter it with `reason` where the broker can.
    async fn reject(&mut self, reason: &str) -> Result<(), SourceError>;
    /// The delivery was dropped unsettled (a cancelled batch): make it redeliverable without
    /// blocking. The default does nothing, for brokers that redeliver on disconnect anyway.
    fn abandon(&mut self) {}
    /// The source can no longer settle this delivery for real (partition revoked, channel
    /// reopened): the engine must not run its handler. Settling it anyway does nothing.
    fn is_stale(&self) -> bool {
        false
    }
    /// The delivery's envelope, handed back just before [`Settle::nack`], [`Settle::reject`]
    /// or [`Settle::abandon`] (never before an ack). A source that redelivers or dead-letters
    /// from its own memory (Kafka, RabbitMQ streams) keeps it, instead of a copy of every
    /// envelope made when the delivery was handed out; the default drops it.
    fn take_back(&mut self, _envelope: Envelope) {}
}

/// Whether a source can deliver what its broker holds for it ([`Source::readiness`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    /// Subscribed and holding what it consumes (a Kafka source: an assignment from the group
    /// coordinator, possibly empty when the group has more members than partitions). The
    /// text says what it holds, e.g. `assigned 2 partitions: payments[0], payments[1]`.
    Ready(String),
    /// Not yet: the text says what it waits for, e.g. `partitions of payments from the group
    /// coordinator of billing`.
    Waiting(String),
}

impl Readiness {
    /// True for [`Readiness::Ready`].
    pub fn is_ready(&self) -> bool {
        matches!(self, Readiness::Ready(_))
    }
}

/// A cheap, cloneable view of one source's [`Readiness`], readable from another task while
/// the engine owns (and polls) the source.
#[derive(Clone)]
pub struct ReadinessProbe(Option<std::sync::Arc<dyn Fn() -> Readiness + Send + Sync>>);

impl ReadinessProbe {
    /// Always ready: a source that can deliver as soon as it is connected (what
    /// [`Source::readiness`] answers by default).
    pub fn connected() -> Self {
        Self(None)
    }
    /// A probe that asks `check` each time.
    pub fn new(check: impl Fn() -> Readiness + Send + Sync + 'static) -> Self {
        Self(Some(std::sync::Arc::new(check)))
    }
    /// The source's readiness now.
    pub fn check(&self) -> Readiness {
        match &self.0 {
            None => Readiness::Ready("connected".to_string()),
            Some(check) => check(),
        }
    }
}

impl std::fmt::Debug for ReadinessProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("ReadinessProbe")
            .field(&self.check())
            .finish()
    }
}

/// What becomes of a delivery: the engine's decision, and what a [`Settle`] reports back to
/// clients that deliver through callbacks ([`SettleRecorder`](crate::adapter::SettleRecorder)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settlement {
    /// Done: the broker may forget it.
    Ack,
    /// Redeliver no sooner than the delay.
    Nack(Duration),
    /// Dead-letter with the reason.
    Reject(String),
    /// Dropped unsettled: the broker redelivers it (a nack without delay, at the broker's
    /// pace).
    Abandoned,
}

impl Settlement {
    /// Its name in logs and metric labels.
    pub fn as_str(&self) -> &'static str {
        match self {
            Settlement::Ack => "ack",
            Settlement::Nack(_) => "nack",
            Settlement::Reject(_) => "reject",
            Settlement::Abandoned => "abandon",
        }
    }
}

/// One received message and the means to settle it.
pub struct Delivery {
    /// The message.
    pub envelope: Envelope,
    settle: Option<Box<dyn Settle>>,
}

impl std::fmt::Debug for Delivery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Delivery")
            .field("envelope", &self.envelope)
            .finish_non_exhaustive()
    }
}

impl Delivery {
    /// Pairs an envelope with its settlement handle.
    pub fn new(envelope: Envelope, settle: Box<dyn Settle>) -> Self {
        Self {
            envelope,
            settle: Some(settle),
        }
    }
    /// Settles it as `how` says: [`ack`](Self::ack), [`nack`](Self::nack),
    /// [`reject`](Self::reject), or drops it unsettled ([`Settlement::Abandoned`]).
    pub async fn settle(self, how: Settlement) -> Result<(), SourceError> {
        match how {
            Settlement::Ack => self.ack().await,
            Settlement::Nack(delay) => self.nack(delay).await,
            Settlement::Reject(reason) => self.reject(&reason).await,
            Settlement::Abandoned => {
                drop(self);
                Ok(())
            }
        }
    }
    /// Acks.
    pub async fn ack(mut self) -> Result<(), SourceError> {
        match self.settle.take() {
            Some(mut s) => s.ack().await,
            None => Ok(()),
        }
    }
    /// True when the source can no longer settle this delivery (see [`Settle::is_stale`]).
    pub fn is_stale(&self) -> bool {
        self.settle.as_ref().is_some_and(|s| s.is_stale())
    }
    /// Asks for redelivery after `redeliver_after`.
    pub async fn nack(mut self, redeliver_after: Duration) -> Result<(), SourceError> {
        match self.settle.take() {
            Some(mut s) => {
                s.take_back(self.take_envelope());
                s.nack(redeliver_after).await
            }
            None => Ok(()),
        }
    }
    /// Moves the envelope out, leaving an empty one (no allocation) behind.
    fn take_envelope(&mut self) -> Envelope {
        let empty = Envelope::new(self.envelope.broker, String::new(), bytes::Bytes::new());
        std::mem::replace(&mut self.envelope, empty)
    }
    /// Dead-letters with a reason. If the broker cannot take the reject (say, the DLQ
    /// produce fails), the message is nacked instead, so it is not lost.
    pub async fn reject(mut self, reason: &str) -> Result<(), SourceError> {
        let Some(mut s) = self.settle.take() else {
            return Ok(());
        };
        s.take_back(self.take_envelope());
        match s.reject(reason).await {
            Ok(()) => Ok(()),
            Err(e) => {
                tracing::warn!(error = %e, "reject failed; nacking instead so the message is kept");
                s.nack(std::time::Duration::from_secs(1))
                    .await
                    .map_err(|_| e)
            }
        }
    }
}

impl Drop for Delivery {
    fn drop(&mut self) {
        if let Some(mut s) = self.settle.take() {
            tracing::warn!(
                source = %self.envelope.source.name,
                "delivery dropped unsettled; abandoning it for redelivery"
            );
            s.take_back(self.take_envelope());
            s.abandon();
        }
    }
}

/// A stream of deliveries from one broker subscription.
#[async_trait]
pub trait Source: Send {
    /// Waits for at least one delivery and returns up to `max`; `Ok(None)` when the source
    /// has ended (closed queue, shutdown).
    ///
    /// Must be cancel-safe: the engine drops a pending `poll` on shutdown, and no delivery
    /// may be lost by that (keep received messages buffered in the source, not the future).
    async fn poll(&mut self, max: usize) -> Result<Option<Vec<Delivery>>, SourceError>;

    /// Every delivery of a polled batch has been settled: commit what can be committed
    /// (Kafka offsets, a stream's stored offset). The default does nothing.
    ///
    /// A pipelined consumer ([`drive_source_pipelined`](crate::engine::drive_source_pipelined))
    /// calls it when any one of its batches is done while later ones are still in progress,
    /// so commit only what is settled (the contiguous settled prefix), never "everything
    /// polled so far".
    async fn after_batch(&mut self) -> Result<(), SourceError> {
        Ok(())
    }

    /// Ends the subscription cleanly: final commit, leave the group, cancel the consumer.
    /// Unsettled deliveries become redeliverable. Called once by the engine when `run` ends;
    /// polling after it is an error. The default does nothing.
    async fn close(&mut self) -> Result<(), SourceError> {
        Ok(())
    }

    /// A probe of whether the source can deliver yet (see [`Readiness`]). The default says
    /// ready: a source that returns from its constructor connected and subscribed
    /// (RabbitMQ, RocketMQ, the memory broker). A Kafka source is ready once the group
    /// coordinator has assigned it partitions.
    fn readiness(&self) -> ReadinessProbe {
        ReadinessProbe::connected()
    }
}

#[async_trait]
impl<S: Source + ?Sized> Source for Box<S> {
    async fn poll(&mut self, max: usize) -> Result<Option<Vec<Delivery>>, SourceError> {
        (**self).poll(max).await
    }
    async fn after_batch(&mut self) -> Result<(), SourceError> {
        (**self).after_batch().await
    }
    async fn close(&mut self) -> Result<(), SourceError> {
        (**self).close().await
    }
    fn readiness(&self) -> ReadinessProbe {
        (**self).readiness()
    }
}
