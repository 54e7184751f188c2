//! The user's handler: an async function from a claimed message to a result.
//!
//! Dedup, heartbeats, metrics and tracing wrap it (the engine); the handler itself only
//! performs the effect. Any `Fn(ClaimedMessage) -> impl Future<Output = HandlerResult>`
//! closure is a handler.

use crate::envelope::Envelope;
use crate::key::DedupKey;
use crate::store::{DedupRecord, FencingToken};
use async_trait::async_trait;
use bytes::Bytes;
use std::future::Future;

/// Any error a handler wants to report.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// What a handler returns: an optional result to store and replay to duplicates.
pub type HandlerResult = Result<Option<Bytes>, HandlerError>;

/// A message whose key the caller now owns.
#[derive(Debug, Clone)]
pub struct ClaimedMessage {
    /// The delivery.
    pub envelope: Envelope,
    /// Its dedup key.
    pub key: DedupKey,
    /// Proof of ownership: pass it to a store's in-transaction completion so the effect and
    /// the dedup record commit together (see `idemq_sql`'s `complete_in_tx`).
    pub token: FencingToken,
    /// 1 on the first acquisition, more after failures and takeovers.
    pub attempt: u32,
    /// True when a crashed worker's lease was taken over: the effect may be half done, so
    /// handlers with external effects should check before repeating them.
    pub takeover: bool,
}

/// Why a handler failed, which decides what happens to the message.
#[derive(Debug, thiserror::Error)]
pub enum HandlerError {
    /// Try again later: the key is released and the message redelivered.
    #[error("handler failed (will retry): {0}")]
    Retryable(#[source] BoxError),
    /// Retrying will not help: the key is released and the message dead-lettered.
    #[error("handler failed permanently (dead-lettered): {0}")]
    Permanent(#[source] BoxError),
}

impl HandlerError {
    /// A retryable failure.
    pub fn retryable(e: impl Into<BoxError>) -> Self {
        Self::Retryable(e.into())
    }
    /// A permanent failure.
    pub fn permanent(e: impl Into<BoxError>) -> Self {
        Self::Permanent(e.into())
    }
}

/// Performs the effect of one message.
#[async_trait]
pub trait Handler: Send + Sync + 'static {
    /// Handles one claimed message.
    async fn handle(&self, msg: ClaimedMessage) -> HandlerResult;

    /// Called for a message the store knows as completed, before it is acked, with the
    /// stored record (its `result` is what `handle` returned). Request/reply consumers answer
    /// the duplicate from it. The default does nothing.
    async fn on_duplicate(&self, _envelope: &Envelope, _record: &DedupRecord) {}
}

#[async_trait]
impl<F, Fut> Handler for F
where
    F: Fn(ClaimedMessage) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = HandlerResult> + Send + 'static,
{
    async fn handle(&self, msg: ClaimedMessage) -> HandlerResult {
        (self)(msg).await
    }
}
