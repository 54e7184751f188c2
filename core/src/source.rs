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
    /// Acks.
    pub async fn ack(mut self) -> Result<(), SourceError> {
        match self.settle.take() {
            Some(mut s) => s.ack().await,
            None => Ok(()),
        }
    }
    /// Asks for redelivery after `redeliver_after`.
    pub async fn nack(mut self, redeliver_after: Duration) -> Result<(), SourceError> {
        match self.settle.take() {
            Some(mut s) => s.nack(redeliver_after).await,
            None => Ok(()),
        }
    }
    /// Dead-letters with a reason. If the broker cannot take the reject (say, the DLQ
    /// produce fails), the message is nacked instead, so it is not lost.
    pub async fn reject(mut self, reason: &str) -> Result<(), SourceError> {
        match self.settle.take() {
            Some(mut s) => match s.reject(reason).await {
                Ok(()) => Ok(()),
                Err(e) => {
                    tracing::warn!(error = %e, "reject failed; nacking instead so the message is kept");
                    s.nack(std::time::Duration::from_secs(1))
                        .await
                        .map_err(|_| e)
                }
            },
            None => Ok(()),
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
}
