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
use crate::store::{ClaimMode, DedupRecord, FencingToken};
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
    /// What a handler's own transaction settled for each message ([`Settled`] as a byte):
    /// the engine then skips the completion round trip it would make.
    settled: Vec<std::sync::atomic::AtomicU8>,
    notify: tokio::sync::Notify,
}

/// What a handler's transaction settled for a message, before the handler returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Settled {
    /// Nothing: the engine completes the message itself.
    No = 0,
    /// The effect and the dedup record committed together.
    Completed = 1,
    /// The key was already recorded: nothing was applied.
    Duplicate = 2,
}

impl LeaseFlags {
    pub(crate) fn new(n: usize) -> std::sync::Arc<Self> {
        std::sync::Arc::new(Self {
            lost: (0..n).map(|_| Default::default()).collect(),
            settled: (0..n).map(|_| Default::default()).collect(),
            notify: tokio::sync::Notify::new(),
        })
    }
    pub(crate) fn settled(&self, index: usize) -> Settled {
        match self
            .settled
            .get(index)
            .map(|f| f.load(std::sync::atomic::Ordering::Acquire))
        {
            Some(1) => Settled::Completed,
            Some(2) => Settled::Duplicate,
            _ => Settled::No,
        }
    }
    fn set_settled(&self, index: usize, how: Settled) {
        if let Some(f) = self.settled.get(index) {
            f.store(how as u8, std::sync::atomic::Ordering::Release);
        }
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
    /// Resolves when any of `watches` (of one batch) is lost.
    pub(crate) async fn any_lost(watches: &[LeaseWatch]) {
        let Some(first) = watches.first() else {
            return std::future::pending().await;
        };
        loop {
            let notified = first.flags.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if watches.iter().any(LeaseWatch::is_lost) {
                return;
            }
            notified.await;
        }
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
    /// Which run of the handler this is: 1 the first time, one more after each run that
    /// failed or was cut off (a takeover counts the crashed run). Claims given back without
    /// a run (a lane held behind a failing message, a late claim) do not count.
    pub attempt: u32,
    /// True when an earlier attempt may have started effects: a crashed worker's expired
    /// lease was taken over, an earlier run here was cut off (panic, `handler_timeout`,
    /// lost lease) and its lease left to expire, or this message is rerun alone after its
    /// batch's call failed (an error does not prove the batch applied nothing: a COMMIT
    /// whose reply was lost reports one). A run after a clean failure of a single message
    /// (the handler returned an error; the key was released) says false. Handlers with
    /// external effects should check before repeating them.
    pub takeover: bool,
    /// How long the completed record is kept: what an in-transaction completion
    /// (`idemq_sql`'s `complete_in_tx`) must store, the consumer's own setting.
    pub retention: std::time::Duration,
    /// Whether this worker still holds the key (see [`LeaseWatch`]).
    pub lease: LeaseWatch,
    /// Where the key was claimed: [`ClaimMode::Lease`] (the store holds a lease for
    /// `token`), or [`ClaimMode::InEffectTransaction`] (nothing is recorded yet: the
    /// handler's transaction inserts the key with the effect).
    pub claim_mode: ClaimMode,
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
            claim_mode: ClaimMode::Lease,
        }
    }

    /// Sets where the key was claimed (builder form; engines set it from the store).
    pub fn with_claim_mode(mut self, mode: ClaimMode) -> Self {
        self.claim_mode = mode;
        self
    }

    /// The payload parsed from JSON as `T`; a payload that does not parse is a permanent
    /// failure ([`MalformedPayload`], naming the type and serde's reason), so `?` in a
    /// handler dead-letters the message instead of retrying it forever.
    ///
    /// ```
    /// use idemq_core::{BrokerKind, ClaimedMessage, DedupKey, Envelope, FencingToken};
    /// use idemq_core::handler::LeaseWatch;
    /// # use std::sync::Arc;
    /// #[derive(serde::Deserialize)]
    /// struct Payment { amount: i64 }
    /// let env = Arc::new(Envelope::new(BrokerKind::MEMORY, "payments", r#"{"amount":5}"#));
    /// let key = DedupKey::from_stored("payments:p-1");
    /// let msg = ClaimedMessage::new(env, key, FencingToken(1), 1, false, LeaseWatch::pair().1);
    /// assert_eq!(msg.json::<Payment>().unwrap().amount, 5);
    /// ```
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T, HandlerError> {
        serde_json::from_slice(&self.envelope.payload).map_err(|source| {
            HandlerError::permanent(MalformedPayload {
                type_name: std::any::type_name::<T>(),
                source,
            })
        })
    }

    /// Says that the handler's own transaction committed this message's effect together
    /// with its dedup record (a store's in-transaction batch completion calls it after the
    /// commit): the engine acks without a completion round trip of its own. Call it only
    /// after the commit succeeded.
    pub fn mark_completed(&self) {
        self.lease
            .flags
            .set_settled(self.lease.index, Settled::Completed);
    }

    /// Says that the handler's own transaction found this message's key already recorded
    /// ([`ClaimMode::InEffectTransaction`]) and applied nothing for it: the engine acks it
    /// as a duplicate. Call it only after the transaction that found the key ended.
    pub fn mark_duplicate(&self) {
        self.lease
            .flags
            .set_settled(self.lease.index, Settled::Duplicate);
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

    /// The batch form of this handler, if it has one (see [`BatchHandler`] and
    /// [`batched`]): the engine then hands it all claimed messages of a batch at once and
    /// calls [`Handler::handle`] only to isolate a failure. `None` by default.
    fn as_batch(&self) -> Option<&dyn BatchHandler> {
        None
    }

    /// Whether this handler inserts each key in its effect's transaction, so it may run
    /// over a store whose claims happen there ([`ClaimMode::InEffectTransaction`], the
    /// unique-index strategy). False by default: the engine refuses to run a handler that
    /// does not over such a store, since nothing would record the keys.
    fn claims_in_transaction(&self) -> bool {
        false
    }

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

/// Performs the effects of many messages at once: what a hand-written consumer does with a
/// multi-row statement, with the engine's dedup, retries and dead-letters around it.
///
/// The engine claims a polled batch's keys in one round trip and hands every acquired
/// message to [`BatchHandler::handle_batch`] in one call, in delivery order (so messages of
/// one partition or ordering key keep their order within the call). When the call
/// succeeds, every message in it is completed (in one round trip, or by the handler's own
/// transaction: see [`ClaimedMessage::mark_completed`]) and acked. When it fails, panics,
/// times out or loses a lease, the batch is not retried whole: each of its messages runs
/// again alone (a call with one message, in lane order), so only the one at fault is
/// retried or dead-lettered by the [`RetryPolicy`](crate::RetryPolicy) and the others
/// complete once. A batch handler must therefore leave no effect behind when it fails
/// (one transaction per call, as the store's batch transactions give), or apply effects
/// that are idempotent on their own.
///
/// Wrap it with [`batched`] (or write a closure with [`batch`]) to hand it to
/// [`IdempotentConsumer::new`](crate::IdempotentConsumer::new).
///
/// ```
/// use idemq_core::{async_trait, BatchHandler, ClaimedMessage, HandlerError};
/// use std::sync::Mutex;
///
/// struct Ledger(Mutex<Vec<String>>);
/// #[async_trait]
/// impl BatchHandler for Ledger {
///     async fn handle_batch(&self, msgs: Vec<ClaimedMessage>) -> Result<(), HandlerError> {
///         // One statement for the whole batch in a real handler.
///         let rows = msgs.iter().map(|m| m.key.to_string());
///         self.0.lock().unwrap().extend(rows);
///         Ok(())
///     }
/// }
/// let handler = idemq_core::handler::batched(Ledger(Mutex::default()));
/// # let _ = handler;
/// ```
#[async_trait]
pub trait BatchHandler: Send + Sync + 'static {
    /// Applies the effects of `msgs` (at least one) together; an error fails the call, and
    /// the engine then runs each message alone to find the one at fault.
    async fn handle_batch(&self, msgs: Vec<ClaimedMessage>) -> Result<(), HandlerError>;

    /// As [`Handler::on_duplicate`].
    async fn on_duplicate(&self, _envelope: &Envelope, _record: &DedupRecord) {}

    /// As [`Handler::on_dead_letter`].
    async fn on_dead_letter(&self, _envelope: &Envelope, _reason: &str) {}

    /// As [`Handler::claims_in_transaction`].
    fn claims_in_transaction(&self) -> bool {
        false
    }
}

/// A [`BatchHandler`] as a [`Handler`] the engine runs batch-wise; made by [`batched`].
#[derive(Debug, Clone)]
pub struct Batched<B>(pub B);

/// Makes a [`BatchHandler`] a handler for [`IdempotentConsumer`](crate::IdempotentConsumer):
/// the engine calls it once per polled batch, and with one message at a time to isolate a
/// failure.
pub fn batched<B: BatchHandler>(handler: B) -> Batched<B> {
    Batched(handler)
}

#[async_trait]
impl<B: BatchHandler> Handler for Batched<B> {
    async fn handle(&self, msg: ClaimedMessage) -> HandlerResult {
        self.0.handle_batch(vec![msg]).await.map(|()| None)
    }
    fn as_batch(&self) -> Option<&dyn BatchHandler> {
        Some(&self.0)
    }
    fn claims_in_transaction(&self) -> bool {
        self.0.claims_in_transaction()
    }
    async fn on_duplicate(&self, envelope: &Envelope, record: &DedupRecord) {
        self.0.on_duplicate(envelope, record).await
    }
    async fn on_dead_letter(&self, envelope: &Envelope, reason: &str) {
        self.0.on_dead_letter(envelope, reason).await
    }
}

/// A batch handler from a closure with shared state; made by [`batch`].
pub struct BatchFn<S, F> {
    state: S,
    f: F,
}

/// A batch handler from a closure that gets a clone of `state` and the claimed messages
/// of a batch (see [`BatchHandler`] for what the engine does with it). Read typed payloads
/// with [`ClaimedMessage::json`]: a malformed one fails the call, and the engine then
/// dead-letters that message alone.
///
/// ```
/// use idemq_core::handler::batch;
/// use std::sync::{Arc, atomic::{AtomicUsize, Ordering}};
///
/// #[derive(serde::Deserialize)]
/// struct Payment { amount: i64 }
///
/// let total = Arc::new(AtomicUsize::new(0));
/// let handler = batch(total.clone(), |total, msgs| async move {
///     for m in &msgs {
///         let p: Payment = m.json()?;
///         total.fetch_add(p.amount as usize, Ordering::Relaxed);
///     }
///     Ok(())
/// });
/// # let _ = handler;
/// ```
pub fn batch<S, F, Fut>(state: S, f: F) -> Batched<BatchFn<S, F>>
where
    S: Clone + Send + Sync + 'static,
    F: Fn(S, Vec<ClaimedMessage>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), HandlerError>> + Send + 'static,
{
    Batched(BatchFn { state, f })
}

#[async_trait]
impl<S, F, Fut> BatchHandler for BatchFn<S, F>
where
    S: Clone + Send + Sync + 'static,
    F: Fn(S, Vec<ClaimedMessage>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), HandlerError>> + Send + 'static,
{
    async fn handle_batch(&self, msgs: Vec<ClaimedMessage>) -> Result<(), HandlerError> {
        (self.f)(self.state.clone(), msgs).await
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
