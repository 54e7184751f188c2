//! The user's handler: an async function from a claimed message to a result.
//!
//! Dedup, heartbeats, metrics and tracing wrap it (the engine); the handler itself only
//! performs the effect. Any `Fn(ClaimedMessage) -> impl Future<Output = HandlerResult>`
//! closure is a handler.
//!
//! Struct handlers implement [`Handler`] with the re-exported [`macro@async_trait`] attribute; no
//! dependency of your own is needed:
//!
//! ```
//! use idemq_core::{async_trait, Bytes, ClaimedMessage, Handler, HandlerResult};
//! struct Receipts;
//! #[async_trait]
//! impl Handler for Receipts {
//!     async fn handle(&self, msg: ClaimedMessage) -> HandlerResult {
//!         Ok(Some(Bytes::from(format!("receipt for {}", msg.key))))
//!     }
//! }
//! ```

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

/// The state of a claimed message's lease, as the handler can watch it.
///
/// The engine's heartbeat extends the lease while the handler runs. When the lease is lost
/// (another worker took the key over after a heartbeat was fenced, or heartbeats failed until
/// the lease's end passed on this clock), the watch flips: a handler with external effects
/// should stop before its next one. The engine also cancels the handler at that point
/// (its future is dropped at the next `.await`), so a handler that never looks is still cut
/// off; effects already made are not undone, which is why `takeover` exists.
///
/// ```
/// use idemq_core::handler::LeaseWatch;
/// let (loss, watch) = LeaseWatch::pair();
/// assert!(!watch.is_lost());
/// loss.mark_lost();
/// assert!(watch.is_lost());
/// ```
#[derive(Debug, Clone)]
pub struct LeaseWatch {
    flags: std::sync::Arc<LeaseFlags>,
    index: usize,
}

/// The lost flags of a batch's leases, and the wake-up for watchers.
#[derive(Debug)]
pub(crate) struct LeaseFlags {
    lost: Vec<std::sync::atomic::AtomicBool>,
    notify: tokio::sync::Notify,
}

impl LeaseFlags {
    pub(crate) fn new(n: usize) -> std::sync::Arc<Self> {
        std::sync::Arc::new(Self {
            lost: (0..n).map(|_| Default::default()).collect(),
            notify: tokio::sync::Notify::new(),
        })
    }
    pub(crate) fn is_lost(&self, index: usize) -> bool {
        self.lost
            .get(index)
            .is_some_and(|f| f.load(std::sync::atomic::Ordering::Acquire))
    }
    pub(crate) fn mark_lost(&self, index: usize) {
        if let Some(f) = self.lost.get(index) {
            f.store(true, std::sync::atomic::Ordering::Release);
            self.notify.notify_waiters();
        }
    }
    pub(crate) fn watch(self: &std::sync::Arc<Self>, index: usize) -> LeaseWatch {
        LeaseWatch {
            flags: self.clone(),
            index,
        }
    }
}

/// Marks a [`LeaseWatch`] made by [`LeaseWatch::pair`] lost.
#[derive(Debug, Clone)]
pub struct LeaseLoss(LeaseWatch);

impl LeaseLoss {
    /// The lease is lost from now on.
    pub fn mark_lost(&self) {
        self.0.flags.mark_lost(self.0.index);
    }
}

impl LeaseWatch {
    /// A watch and the handle that marks it lost (for tests of handlers).
    pub fn pair() -> (LeaseLoss, Self) {
        let w = LeaseFlags::new(1).watch(0);
        (LeaseLoss(w.clone()), w)
    }
    /// True once the lease is lost.
    pub fn is_lost(&self) -> bool {
        self.flags.is_lost(self.index)
    }
    /// Resolves when the lease is lost; never, if it is kept until the batch ends.
    pub async fn lost(&self) {
        loop {
            let notified = self.flags.notify.notified();
            tokio::pin!(notified);
            // Registered before the check, so a loss between the two is not missed.
            notified.as_mut().enable();
            if self.is_lost() {
                return;
            }
            notified.await;
        }
    }
}

/// A message whose key the caller now owns.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ClaimedMessage {
    /// The delivery (shared, not copied: read it as `msg.envelope.payload`).
    pub envelope: std::sync::Arc<Envelope>,
    /// Its dedup key.
    pub key: DedupKey,
    /// Proof of ownership: pass it to a store's in-transaction completion so the effect and
    /// the dedup record commit together (see `idemq_sql`'s `complete_in_tx`).
    pub token: FencingToken,
    /// 1 on the first acquisition, more after failures and takeovers.
    pub attempt: u32,
    /// True when an earlier attempt may have started effects: a crashed worker's expired
    /// lease was taken over, or an earlier run here was cut off (panic, `handler_timeout`,
    /// lost lease) and its lease left to expire. A run after a clean failure (the handler
    /// returned an error; the key was released) says false. Handlers with external effects
    /// should check before repeating them.
    pub takeover: bool,
    /// How long the completed record is kept: what an in-transaction completion
    /// (`idemq_sql`'s `complete_in_tx`) must store, the consumer's own setting.
    pub retention: std::time::Duration,
    /// Whether this worker still holds the key (see [`LeaseWatch`]).
    pub lease: LeaseWatch,
}

impl ClaimedMessage {
    /// A claimed message (engines build these; tests of handlers too).
    pub fn new(
        envelope: std::sync::Arc<Envelope>,
        key: DedupKey,
        token: FencingToken,
        attempt: u32,
        takeover: bool,
        lease: LeaseWatch,
    ) -> Self {
        Self {
            envelope,
            key,
            token,
            attempt,
            takeover,
            retention: std::time::Duration::from_secs(7 * 24 * 3600),
            lease,
        }
    }

    /// Sets the retention an in-transaction completion stores (builder form).
    pub fn with_retention(mut self, retention: std::time::Duration) -> Self {
        self.retention = retention;
        self
    }
}

/// Why a handler failed, which decides what happens to the message.
///
/// A retryable failure follows the consumer's [`RetryPolicy`](crate::engine::RetryPolicy):
/// redelivered after a growing delay, dead-lettered once `max_attempts` is reached.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HandlerError {
    /// Try again later: the key is released and the message redelivered.
    #[error("handler failed (will retry): {0}")]
    Retryable(#[source] BoxError),
    /// Try again after this delay (a rate limit's `Retry-After`), instead of the policy's.
    #[error("handler failed (will retry after {delay:?}): {source}")]
    RetryAfter {
        /// How long to wait.
        delay: std::time::Duration,
        /// Why.
        #[source]
        source: BoxError,
    },
    /// Retrying will not help: the key is released and the message dead-lettered.
    #[error("handler failed permanently (dead-lettered): {0}")]
    Permanent(#[source] BoxError),
}

impl From<crate::store::StoreError> for HandlerError {
    /// A store the handler uses that is down is worth retrying; a refused or malformed
    /// record is not.
    fn from(e: crate::store::StoreError) -> Self {
        if e.is_retryable() {
            Self::Retryable(e.into())
        } else {
            Self::Permanent(e.into())
        }
    }
}

impl HandlerError {
    /// Retry after `delay` (overrides the retry policy's delay for this attempt).
    pub fn retry_after(delay: std::time::Duration, e: impl Into<BoxError>) -> Self {
        Self::RetryAfter {
            delay,
            source: e.into(),
        }
    }
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

    /// Called for a message the engine is about to dead-letter (no usable key, payload
    /// conflict, permanent failure, retries exhausted), with the reason it gives the broker.
    /// The default does nothing (the engine logs a warning either way).
    async fn on_dead_letter(&self, _envelope: &Envelope, _reason: &str) {}
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

/// A closure handler with shared state, made by [`with_state`].
pub struct StateHandler<S, F> {
    state: S,
    f: F,
}

/// A handler from a closure that gets a clone of `state` with each message, so shared
/// state (a pool, a client, a counter) needs no outer-and-inner clone dance:
///
/// ```
/// use idemq_core::handler::with_state;
/// use std::sync::{Arc, atomic::{AtomicU64, Ordering}};
///
/// let applied = Arc::new(AtomicU64::new(0));
/// let handler = with_state(applied.clone(), |applied, _msg| async move {
///     applied.fetch_add(1, Ordering::Relaxed);
///     Ok(None)
/// });
/// # let _ = handler;
/// ```
pub fn with_state<S, F, Fut>(state: S, f: F) -> StateHandler<S, F>
where
    S: Clone + Send + Sync + 'static,
    F: Fn(S, ClaimedMessage) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = HandlerResult> + Send + 'static,
{
    StateHandler { state, f }
}

#[async_trait]
impl<S, F, Fut> Handler for StateHandler<S, F>
where
    S: Clone + Send + Sync + 'static,
    F: Fn(S, ClaimedMessage) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = HandlerResult> + Send + 'static,
{
    async fn handle(&self, msg: ClaimedMessage) -> HandlerResult {
        (self.f)(self.state.clone(), msg).await
    }
}

/// A payload that is not the JSON its handler declared: the message is dead-lettered with
/// this reason (resending it cannot help).
#[derive(Debug, thiserror::Error)]
#[error("payload is not a valid `{type_name}` (JSON): {source}")]
pub struct MalformedPayload {
    /// The Rust type the handler asked for.
    pub type_name: &'static str,
    /// What serde said.
    #[source]
    pub source: serde_json::Error,
}

/// A handler of typed JSON payloads, made by [`json`].
pub struct JsonHandler<T, S, F> {
    state: S,
    f: F,
    _payload: std::marker::PhantomData<fn() -> T>,
}

/// A handler from a closure that gets a clone of `state`, the message, and its payload
/// parsed from JSON as `T`. A payload that does not parse as `T` never reaches the closure:
/// it is a permanent failure ([`MalformedPayload`], naming the type and serde's reason), so
/// the engine dead-letters it instead of retrying it forever. Pass `()` when there is no
/// state.
///
/// ```
/// use idemq_core::handler::json;
///
/// #[derive(serde::Deserialize)]
/// struct Payment { payment_id: String, amount: i64 }
///
/// let handler = json((), |(), msg, p: Payment| async move {
///     assert!(p.amount > 0, "{} for {}", p.payment_id, msg.key);
///     Ok(None)
/// });
/// # let _ = handler;
/// ```
pub fn json<T, S, F, Fut>(state: S, f: F) -> JsonHandler<T, S, F>
where
    T: serde::de::DeserializeOwned + Send + 'static,
    S: Clone + Send + Sync + 'static,
    F: Fn(S, ClaimedMessage, T) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = HandlerResult> + Send + 'static,
{
    JsonHandler {
        state,
        f,
        _payload: std::marker::PhantomData,
    }
}

#[async_trait]
impl<T, S, F, Fut> Handler for JsonHandler<T, S, F>
where
    T: serde::de::DeserializeOwned + Send + 'static,
    S: Clone + Send + Sync + 'static,
    F: Fn(S, ClaimedMessage, T) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = HandlerResult> + Send + 'static,
{
    async fn handle(&self, msg: ClaimedMessage) -> HandlerResult {
        let payload: T = serde_json::from_slice(&msg.envelope.payload).map_err(|source| {
            HandlerError::permanent(MalformedPayload {
                type_name: std::any::type_name::<T>(),
                source,
            })
        })?;
        (self.f)(self.state.clone(), msg, payload).await
    }
}

/// A bridge handler, made by [`forward`]: each message is published to another broker (or
/// another destination) with its business key carried on as the dedup key.
pub struct Forward {
    publisher: std::sync::Arc<dyn crate::publish::Publisher>,
    route: Box<dyn Fn(&Envelope) -> String + Send + Sync>,
}

impl std::fmt::Debug for Forward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Forward").finish_non_exhaustive()
    }
}

/// A handler that forwards every message to `publisher`, at the destination `route` picks,
/// with the same payload, key, ordering key and headers, and the consumed message's business
/// key ([`DedupKey::business_key`]) as the outgoing dedup key: a migration from one broker to
/// another (RabbitMQ to Kafka, say) without double effects downstream.
///
/// The handler succeeds only on the target's confirm, so a message is acked on the source
/// after its copy is durable on the target. A consumer that dies between the two republishes
/// on redelivery: the target may then hold two copies with the same dedup key, which the
/// consumers on that side drop (that is the point of carrying the key). A retryable publish
/// failure (unreachable, outcome unknown) is retried; a refused or unroutable message is
/// dead-lettered with the reason.
///
/// ```
/// use idemq_core::handler::forward;
/// use idemq_core::Publisher;
/// use std::sync::Arc;
///
/// fn bridge(kafka: Arc<dyn Publisher>) -> impl idemq_core::Handler {
///     // Every queue's messages go to the Kafka topic of the same name.
///     forward(kafka, |envelope| envelope.source.name.clone())
/// }
/// ```
pub fn forward(
    publisher: std::sync::Arc<dyn crate::publish::Publisher>,
    route: impl Fn(&Envelope) -> String + Send + Sync + 'static,
) -> Forward {
    Forward {
        publisher,
        route: Box::new(route),
    }
}

impl Forward {
    /// The message `msg` becomes on the target.
    pub fn outgoing(&self, msg: &ClaimedMessage) -> crate::publish::OutgoingMessage {
        let env = &msg.envelope;
        let mut out = crate::publish::OutgoingMessage::new((self.route)(env), env.payload.clone())
            .with_dedup_key(msg.key.business_key());
        out.key = env.key.clone();
        out.ordering_key = env.ordering_key.clone();
        // `wire_headers` drops the envelope's `idemq.` properties and re-adds the dedup
        // header from the dedup key.
        out.headers = env.headers.clone();
        out
    }
}

#[async_trait]
impl Handler for Forward {
    async fn handle(&self, msg: ClaimedMessage) -> HandlerResult {
        let out = self.outgoing(&msg);
        match self.publisher.publish(out).await {
            Ok(_) => Ok(None),
            Err(e) if e.is_retryable() => Err(HandlerError::retryable(e)),
            Err(e) => Err(HandlerError::permanent(e)),
        }
    }
}

/// This worker's lease on a key ended before its effect and completion committed together
/// (another worker took the key over after the lease expired, or it was released): nothing
/// of the attempt was kept. Stores that complete inside the effect's own transaction
/// (`idemq_sql::MessageTx::commit`, `idemq_redis::RedisStore::complete_with`) return it as
/// the source of a [`HandlerError::Retryable`]; the redelivery meets the key's current
/// owner (a duplicate once that owner completes).
#[derive(Debug, Clone, thiserror::Error)]
#[error(
    "lease on `{key}` lost before the effect committed (taken over by another worker after \
     it expired, or released): nothing of this attempt kept; the redelivery goes to the \
     key's current owner"
)]
pub struct LeaseLost {
    /// The key.
    pub key: DedupKey,
}
