//! The idempotent consumer engine: one loop over any [`Source`] and any [`DedupStore`].
//!
//! Each polled batch goes through five named stages (see `batch.rs`):
//! 1. **keys** — derive keys; a message without a usable key is rejected (dead-lettered)
//!    with the reason; later copies of a key in the batch wait for the first one's fate; a
//!    copy with another payload is sent back, and with an ordering it holds its lane (the
//!    lane's later messages in the batch go back with it, unrun);
//! 2. **claim** — claim all keys in one round trip (retried with back-off while the store is
//!    down; if it stays down the batch is nacked, never acked; one key at a time if the
//!    store refuses the batch);
//! 3. **dispatch** — run handlers for the acquired keys, at most `max_concurrency` at a
//!    time, in order within a lane when [`DeliveryOrder`] asks for it, each lease kept alive
//!    by the batch's heartbeat and watched by the handler;
//! 4. **complete** — complete each successful message as soon as its handler is done, those
//!    that finish together in one round trip bounded by count and bytes (one key at a time
//!    when a batch fails, so one bad completion cannot hold the others); a crash mid-batch
//!    then re-runs only the effects whose completion was in flight, not a whole batch's;
//! 5. **settle** — ack only what is durable; nack or reject the rest.
//!
//! | claim / handler outcome | store | broker |
//! |---|---|---|
//! | duplicate | – | ack |
//! | in flight elsewhere | – | nack, redeliver after the other lease |
//! | payload conflict | – | reject with reason |
//! | handler ok, completion durable | complete | ack |
//! | handler ok, lease lost (fenced) | – | nack |
//! | handler retryable error | release | nack after the retry policy's delay; reject once attempts are exhausted |
//! | handler panic / timeout / lease lost (cut off: its effect may be half done) | – (the lease runs out, so the next run is a takeover with `takeover == true`) | as above |
//! | handler permanent error | release | reject with reason |
//! | key function panicked | – | reject with the panic message |
//! | `on_duplicate` / `on_dead_letter` panicked or overran `hook_timeout` | – | as without the hook (logged, counted) |
//! | copy of a key with another payload in the same batch | – | nack (later messages of its lane too, unrun) |
//! | delivery gone stale (partition revoked) | release | – (the settle is ignored) |
//! | store unavailable | – | nack after back-off |

mod batch;
mod config;
mod health;
mod lease;

pub use config::{Backoff, ConsumerConfig, DeliveryOrder, RetryPolicy};
use health::LoopHealth;
pub use health::{Health, HealthReport, HealthState, KEYLESS_RUN};
pub use lease::{LeaseKeepAlive, LeaseState, LossCause};

use crate::envelope::Envelope;
use crate::handler::Handler;
use crate::key::{DedupKey, KeyStrategy};
use crate::source::{Source, SourceError};
use crate::store::DedupStore;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The text of a caught panic (what `panic!` was given), for logs and dead-letter reasons.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_string()
    }
}

/// The message's dedup key, or the reason to dead-letter it. The key strategy may run a
/// user's function: a panic in it is this message's problem (its reason, with the panic
/// message), not the consumer's, so it is caught, logged and counted here. Every consumer
/// that derives keys goes through this one function.
pub fn derive_key(keys: &KeyStrategy, envelope: &Envelope) -> Result<DedupKey, String> {
    derive_key_or_kind(keys, envelope).map_err(|(reason, _)| reason)
}

/// [`derive_key`], with the failure's kind ([`KeyError::kind`](crate::KeyError::kind), or
/// `key_function_panic`) beside its reason.
pub(crate) fn derive_key_or_kind(
    keys: &KeyStrategy,
    envelope: &Envelope,
) -> Result<DedupKey, (String, &'static str)> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| keys.derive(envelope))) {
        Ok(Ok(key)) => Ok(key),
        Ok(Err(e)) => Err((format!("no usable dedup key: {e}"), e.kind())),
        Err(panic) => {
            let why = panic_message(panic.as_ref());
            tracing::error!(panic = %why, "the key function panicked");
            metrics::counter!(
                crate::metrics::HOOK_FAILURES,
                "hook" => "key_function",
                "failure" => "panic"
            )
            .increment(1);
            Err((
                format!("no usable dedup key: the key function panicked: {why}"),
                "key_function_panic",
            ))
        }
    }
}

/// Counters of one engine (also exported through `metrics`).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) processed: AtomicU64,
    pub(crate) duplicates: AtomicU64,
    pub(crate) in_flight: AtomicU64,
    pub(crate) retried: AtomicU64,
    pub(crate) rejected: AtomicU64,
    pub(crate) fenced: AtomicU64,
    pub(crate) store_unavailable: AtomicU64,
    pub(crate) takeovers: AtomicU64,
    pub(crate) deferred: AtomicU64,
    pub(crate) stale: AtomicU64,
    pub(crate) settle_failures: AtomicU64,
    pub(crate) batch_splits: AtomicU64,
    /// Messages in a row dead-lettered because no key could be derived.
    pub(crate) keyless_in_row: AtomicU64,
    /// Readiness, shared by clones of the engine.
    pub(crate) health: Health,
    /// Per broker kind and outcome: counted but not yet reported to `metrics` (reported
    /// once per batch, not once per message: a labelled metric costs allocations).
    pub(crate) unflushed: BrokerTallies,
}

/// How many outcome labels the engine counts.
pub(crate) const OUTCOME_KINDS: usize = 10;

/// Outcome counts of one broker kind, by its label.
#[derive(Debug)]
pub(crate) struct BrokerTally {
    pub(crate) broker: crate::envelope::BrokerKind,
    pub(crate) outcomes: [AtomicU64; OUTCOME_KINDS],
}

/// One [`BrokerTally`] per broker kind the engine has seen, keyed by the kind's name (the
/// core knows no broker list: adapters name their own). A consumer sees one broker, two
/// when it bridges, so a linear scan under a read lock is the whole lookup; the write lock
/// is taken once per new kind, and rows are never removed.
#[derive(Debug, Default)]
pub(crate) struct BrokerTallies(std::sync::RwLock<Vec<BrokerTally>>);

impl BrokerTallies {
    /// Adds `n` to `broker`'s count of the outcome at `index`.
    pub(crate) fn add(&self, broker: crate::envelope::BrokerKind, index: usize, n: u64) {
        {
            let rows = self
                .0
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if let Some(row) = rows.iter().find(|r| r.broker == broker) {
                row.outcomes[index].fetch_add(n, Ordering::Relaxed);
                return;
            }
        }
        let mut rows = self
            .0
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Another thread may have added the row between the two locks.
        if let Some(row) = rows.iter().find(|r| r.broker == broker) {
            row.outcomes[index].fetch_add(n, Ordering::Relaxed);
            return;
        }
        let row = BrokerTally {
            broker,
            outcomes: std::array::from_fn(|_| AtomicU64::new(0)),
        };
        row.outcomes[index].fetch_add(n, Ordering::Relaxed);
        rows.push(row);
    }

    /// Takes every non-zero count, with its broker and outcome index, leaving zeros.
    pub(crate) fn drain(&self, mut report: impl FnMut(crate::envelope::BrokerKind, usize, u64)) {
        let rows = self
            .0
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for row in rows.iter() {
            for (i, count) in row.outcomes.iter().enumerate() {
                let n = count.swap(0, Ordering::Relaxed);
                if n > 0 {
                    report(row.broker, i, n);
                }
            }
        }
    }
}

/// A snapshot of an engine's counters (deliveries, not distinct messages).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConsumerStats {
    /// Handler ran and the record is durable; acked.
    pub processed: u64,
    /// Skipped as duplicates (store or in-batch); acked.
    pub duplicates: u64,
    /// Held by another worker; nacked for later.
    pub in_flight: u64,
    /// Handler failed; released and nacked.
    pub retried: u64,
    /// Dead-lettered.
    pub rejected: u64,
    /// Lease lost before completion; nacked.
    pub fenced: u64,
    /// Not settled as done because the store was down; nacked.
    pub store_unavailable: u64,
    /// Expired leases taken over.
    pub takeovers: u64,
    /// Sent back unrun because an earlier message of their lane was (ordered modes).
    pub deferred: u64,
    /// Gone stale before their handler ran (partition revoked); claims given back.
    pub stale: u64,
    /// Settlements the broker refused (the message will be redelivered).
    pub settle_failures: u64,
    /// Batch handler calls that failed and were split: each of their messages ran alone.
    pub batch_splits: u64,
}

impl ConsumerStats {
    /// Deliveries sent back for redelivery, whatever the reason.
    pub fn redelivered(&self) -> u64 {
        self.in_flight + self.retried + self.fenced + self.store_unavailable + self.deferred
    }
}

/// Why the engine stopped.
#[derive(Debug, thiserror::Error)]
pub enum ConsumerError {
    /// The source cannot work as configured.
    #[error("source failed: {0}")]
    Source(#[from] SourceError),
    /// The engine settings are unsafe.
    #[error("invalid consumer configuration: {0}")]
    Config(String),
}

/// Runs a [`Handler`] over a [`Source`] so that each message's effect happens once.
///
/// ```
/// use idemq_core::{IdempotentConsumer, KeyStrategy, MemoryStore, ClaimedMessage, HandlerError};
/// use idemq_core::broker::MemoryBroker;
/// use idemq_core::{Envelope, BrokerKind};
/// use std::sync::{Arc, atomic::{AtomicU32, Ordering}};
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// let broker = MemoryBroker::new();
/// let msg = Envelope::new(BrokerKind::MEMORY, "orders", "{}").with_header("x-idempotency-key", "o-1");
/// broker.publish(msg.clone());
/// broker.publish(msg); // the producer retried
///
/// let effects = Arc::new(AtomicU32::new(0));
/// let seen = effects.clone();
/// let consumer = IdempotentConsumer::new(
///     Arc::new(MemoryStore::new()),
///     KeyStrategy::header("orders-svc", "x-idempotency-key").unwrap(),
///     move |_m: ClaimedMessage| {
///         let seen = seen.clone();
///         async move { seen.fetch_add(1, Ordering::SeqCst); Ok::<_, HandlerError>(None) }
///     },
/// );
/// let mut source = broker.subscribe();
/// consumer.run_until_idle(&mut source).await.unwrap();
/// assert_eq!(effects.load(Ordering::SeqCst), 1);
/// assert_eq!(consumer.stats().duplicates, 1);
/// # });
/// ```
pub struct IdempotentConsumer<H> {
    store: Arc<dyn DedupStore>,
    keys: KeyStrategy,
    handler: Arc<H>,
    cfg: ConsumerConfig,
    counters: Arc<Counters>,
}

impl<H> Clone for IdempotentConsumer<H> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            keys: self.keys.clone(),
            handler: self.handler.clone(),
            cfg: self.cfg.clone(),
            counters: self.counters.clone(),
        }
    }
}

impl<H: Handler> IdempotentConsumer<H> {
    /// An engine with default settings.
    pub fn new(store: Arc<dyn DedupStore>, keys: KeyStrategy, handler: H) -> Self {
        Self {
            store,
            keys,
            handler: Arc::new(handler),
            cfg: ConsumerConfig::default(),
            counters: Arc::default(),
        }
    }

    /// Replaces the settings (values of 0 for batch or concurrency are taken as 1).
    pub fn with_config(mut self, mut cfg: ConsumerConfig) -> Self {
        cfg.max_batch = cfg.max_batch.max(1);
        cfg.max_concurrency = cfg.max_concurrency.max(1);
        self.cfg = cfg;
        self
    }

    /// The settings.
    pub fn config(&self) -> &ConsumerConfig {
        &self.cfg
    }

    /// Counters so far (shared by clones of this engine).
    pub fn stats(&self) -> ConsumerStats {
        let c = &self.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ConsumerStats {
            processed: l(&c.processed),
            duplicates: l(&c.duplicates),
            in_flight: l(&c.in_flight),
            retried: l(&c.retried),
            rejected: l(&c.rejected),
            fenced: l(&c.fenced),
            store_unavailable: l(&c.store_unavailable),
            takeovers: l(&c.takeovers),
            deferred: l(&c.deferred),
            stale: l(&c.stale),
            settle_failures: l(&c.settle_failures),
            batch_splits: l(&c.batch_splits),
        }
    }

    /// The consumer's readiness (store and broker answering), for a health endpoint: a
    /// handle shared by clones of this engine and every loop of [`IdempotentConsumer::run_all`].
    pub fn health(&self) -> Health {
        self.counters.health.clone()
    }

    /// Polls and processes until `shutdown` resolves or the source ends, then closes the
    /// source. A batch in progress is finished (settled) before returning.
    pub async fn run<S: Source + ?Sized>(
        &self,
        source: &mut S,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), ConsumerError> {
        self.cfg.validate().map_err(ConsumerError::Config)?;
        if self.store.claim_mode() == crate::store::ClaimMode::InEffectTransaction
            && !self.handler.claims_in_transaction()
        {
            return Err(ConsumerError::Config(
                "the store claims keys in the effect's transaction (unique-index strategy), but \
                 the handler does not insert them there: nothing would record the keys. Use the \
                 store's transactional handler (e.g. idemq_sql's `SqlStore::batch_handler`), or \
                 give this handler a store with leases"
                    .into(),
            ));
        }
        let running = lease::RunningLoop::start(self.cfg.pipeline_depth);
        let result = self.poll_loop(source, shutdown).await;
        drop(running);
        close_after_run(source, result).await
    }

    async fn poll_loop<S: Source + ?Sized>(
        &self,
        source: &mut S,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), ConsumerError> {
        let backoff = self.cfg.store_backoff_policy();
        drive_source_reporting(
            source,
            self.cfg.max_batch,
            self.cfg.pipeline_depth,
            backoff,
            &self.counters.health,
            shutdown,
            |batch| self.process_batch(batch),
        )
        .await
    }

    /// Runs this engine over several sources at once (Kafka topics, RabbitMQ queues,
    /// RocketMQ topics, in any mix): one poll loop per source, one handler, one store, one
    /// set of counters, one shutdown. A message is processed once whichever broker brought
    /// it, because the dedup key is the business key, not a broker's message id.
    ///
    /// Returns when `shutdown` resolves or every source has ended; each source is closed.
    /// When one loop fails (a source's configuration error), the others are shut down too
    /// and that first error is returned. For settings of its own per source, see
    /// [`IdempotentConsumer::run_each`].
    ///
    /// ```
    /// use idemq_core::broker::MemoryBroker;
    /// use idemq_core::{BrokerKind, ClaimedMessage, Envelope, HandlerError, IdempotentConsumer,
    ///     KeyStrategy, MemoryStore, Source};
    /// use std::sync::{Arc, atomic::{AtomicU32, Ordering}};
    ///
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// // The same payment callback arrives through two brokers.
    /// let (a, b) = (MemoryBroker::new(), MemoryBroker::new());
    /// let callback = Envelope::new(BrokerKind::MEMORY, "payments", "{}")
    ///     .with_header("x-idempotency-key", "pay-1");
    /// a.publish(callback.clone());
    /// b.publish(callback);
    ///
    /// let effects = Arc::new(AtomicU32::new(0));
    /// let seen = effects.clone();
    /// let consumer = IdempotentConsumer::new(
    ///     Arc::new(MemoryStore::new()),
    ///     KeyStrategy::header("payments", "x-idempotency-key").unwrap(),
    ///     move |_m: ClaimedMessage| {
    ///         let seen = seen.clone();
    ///         async move { seen.fetch_add(1, Ordering::SeqCst); Ok::<_, HandlerError>(None) }
    ///     },
    /// );
    /// let sources: Vec<Box<dyn Source>> = vec![Box::new(a.subscribe()), Box::new(b.subscribe())];
    /// consumer.run_all(sources, std::future::pending()).await.unwrap();
    /// assert_eq!(effects.load(Ordering::SeqCst), 1);
    /// assert_eq!(consumer.stats().duplicates, 1);
    /// # });
    /// ```
    pub async fn run_all(
        &self,
        sources: Vec<Box<dyn Source>>,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), ConsumerError> {
        let runs = sources.into_iter().map(|s| (self.clone(), s)).collect();
        Self::run_each(runs, shutdown).await
    }

    /// [`IdempotentConsumer::run_all`] with an engine per source: pass clones of one engine
    /// with settings of their own (`engine.clone().with_config(…)`: a clone shares the
    /// handler, the store and the counters), e.g. per-partition order for a Kafka topic and
    /// a larger batch for a RabbitMQ queue.
    pub async fn run_each(
        runs: Vec<(IdempotentConsumer<H>, Box<dyn Source>)>,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), ConsumerError> {
        use futures::stream::{FuturesUnordered, StreamExt};
        // Every loop stops on the caller's shutdown, or when another loop failed.
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let mut loops: FuturesUnordered<_> = runs
            .into_iter()
            .enumerate()
            .map(|(i, (engine, mut source))| {
                let mut stopped = stopped.clone();
                async move {
                    let shutdown = async move {
                        let _ = stopped.wait_for(|s| *s).await;
                    };
                    (i, engine.run(source.as_mut(), shutdown).await)
                }
            })
            .collect();
        tokio::pin!(shutdown);
        let mut first_error = None;
        let mut asked = false;
        loop {
            tokio::select! {
                _ = &mut shutdown, if !asked => {
                    asked = true;
                    let _ = stop.send(true);
                }
                done = loops.next() => match done {
                    None => break,
                    Some((i, Err(e))) => {
                        tracing::error!(source = i, error = %e, "a source's loop failed; stopping the others");
                        let _ = stop.send(true);
                        first_error.get_or_insert(e);
                    }
                    Some((_, Ok(()))) => {}
                },
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Runs until the source ends (for sources that end, such as a closed memory broker).
    pub async fn run_until_idle<S: Source + ?Sized>(
        &self,
        source: &mut S,
    ) -> Result<(), ConsumerError> {
        self.run(source, std::future::pending()).await
    }
}

/// Closes `source` after a poll loop ended with `result` (a consumer mode's `run` calls it
/// once [`drive_source`] returns): the loop's error wins; a failed close is logged and
/// returned.
pub async fn close_after_run<S: Source + ?Sized>(
    source: &mut S,
    result: Result<(), ConsumerError>,
) -> Result<(), ConsumerError> {
    let closed = source.close().await;
    match (result, closed) {
        (Err(e), _) => Err(e),
        (Ok(()), Err(e)) => {
            tracing::warn!(error = %e, "closing the source failed; its unsettled messages will be redelivered");
            Err(e.into())
        }
        (Ok(()), Ok(())) => Ok(()),
    }
}

/// The poll loop every consumer mode shares: poll up to `max_batch` deliveries, hand them
/// to `process` (which settles each one and answers whether it met an outage), tell the
/// source the batch is done ([`Source::after_batch`]), back off after an outage, and stop
/// when `shutdown` resolves (between batches: a batch in progress is finished) or the
/// source ends. Configuration errors of the source end the loop; other poll and commit
/// errors are logged and retried after the back-off. The caller closes the source.
///
/// [`IdempotentConsumer`] runs on it (through [`drive_source_reporting`]); it is public for
/// consumers built outside the core, so they poll, commit and back off alike. Batches run
/// one after another; [`drive_source_pipelined`] overlaps them.
pub async fn drive_source<S, F, Fut>(
    source: &mut S,
    max_batch: usize,
    backoff: RetryPolicy,
    shutdown: impl Future<Output = ()>,
    process: F,
) -> Result<(), ConsumerError>
where
    S: Source + ?Sized,
    F: FnMut(Vec<crate::source::Delivery>) -> Fut,
    Fut: Future<Output = bool>,
{
    drive_source_pipelined(source, max_batch, 1, backoff, shutdown, process).await
}

/// [`drive_source_pipelined`] reporting to `health`: each poll's and each batch's outcome
/// (a batch that met an outage marks the store unavailable until one that did not).
pub async fn drive_source_reporting<S, F, Fut>(
    source: &mut S,
    max_batch: usize,
    depth: usize,
    backoff: RetryPolicy,
    health: &Health,
    shutdown: impl Future<Output = ()>,
    process: F,
) -> Result<(), ConsumerError>
where
    S: Source + ?Sized,
    F: FnMut(Vec<crate::source::Delivery>) -> Fut,
    Fut: Future<Output = bool>,
{
    let mut reporter = health.loop_started(source.readiness());
    drive(
        source,
        max_batch,
        depth,
        backoff,
        Some(&mut reporter),
        shutdown,
        process,
    )
    .await
}

/// [`drive_source`] with up to `depth` batches in progress at once: while one batch waits
/// on its store (a transaction's commit, an fsync), the next is polled and started, so the
/// broker's and the database's latencies overlap instead of adding up.
///
/// Batches may then finish out of order, so messages of one partition or key are no longer
/// processed strictly one after another across batches; a mode that promises order must
/// pass `depth` 1. Each finished batch is followed by [`Source::after_batch`], which commits
/// only what is settled (sources track settled offsets, never "the last batch"). A pending
/// poll is dropped (sources' `poll` is cancel-safe) when a batch finishes, so the commit is
/// not held back until the next message arrives. On shutdown the batches in progress are
/// finished and committed; none is abandoned.
pub async fn drive_source_pipelined<S, F, Fut>(
    source: &mut S,
    max_batch: usize,
    depth: usize,
    backoff: RetryPolicy,
    shutdown: impl Future<Output = ()>,
    process: F,
) -> Result<(), ConsumerError>
where
    S: Source + ?Sized,
    F: FnMut(Vec<crate::source::Delivery>) -> Fut,
    Fut: Future<Output = bool>,
{
    drive(source, max_batch, depth, backoff, None, shutdown, process).await
}

/// The poll loop of [`drive_source_pipelined`] and [`drive_source_reporting`]; `health`
/// (when someone watches) hears each poll's and each batch's outcome.
async fn drive<S, F, Fut>(
    source: &mut S,
    max_batch: usize,
    depth: usize,
    backoff: RetryPolicy,
    mut health: Option<&mut LoopHealth>,
    shutdown: impl Future<Output = ()>,
    mut process: F,
) -> Result<(), ConsumerError>
where
    S: Source + ?Sized,
    F: FnMut(Vec<crate::source::Delivery>) -> Fut,
    Fut: Future<Output = bool>,
{
    use futures::stream::{FuturesUnordered, StreamExt};

    /// What woke the loop.
    enum Event {
        Shutdown,
        Finished(bool),
        Polled(Result<Option<Vec<crate::source::Delivery>>, SourceError>),
        Rested,
    }

    let depth = depth.max(1);
    let max_batch = max_batch.max(1);
    tokio::pin!(shutdown);
    let mut in_progress = FuturesUnordered::new();
    let mut rests = backoff.waits();
    // After an outage, no polling until this instant (batches in progress still run).
    let mut resting_until: Option<tokio::time::Instant> = None;
    let mut stopping = false;
    loop {
        if stopping && in_progress.is_empty() {
            return Ok(());
        }
        let may_poll = !stopping && resting_until.is_none() && in_progress.len() < depth;
        let event = {
            let rest = async {
                match resting_until {
                    Some(t) => tokio::time::sleep_until(t).await,
                    None => std::future::pending().await,
                }
            };
            let poll = async {
                if may_poll {
                    source.poll(max_batch).await
                } else {
                    std::future::pending().await
                }
            };
            tokio::select! {
                biased;
                _ = &mut shutdown, if !stopping => Event::Shutdown,
                Some(outage) = in_progress.next(), if !in_progress.is_empty() => Event::Finished(outage),
                _ = rest => Event::Rested,
                p = poll => Event::Polled(p),
            }
        };
        match event {
            Event::Shutdown => stopping = true,
            Event::Rested => resting_until = None,
            Event::Finished(outage) => {
                if let Some(h) = health.as_deref_mut() {
                    h.batch_finished(outage);
                }
                let committed = source.after_batch().await;
                if let Err(e) = &committed {
                    tracing::warn!(error = %e, "source could not commit after a batch; it will redeliver");
                }
                if let Err(SourceError::Config(e)) = committed {
                    return Err(SourceError::Config(e).into());
                }
                if outage {
                    // Give the store or broker time before polling again.
                    resting_until = Some(tokio::time::Instant::now() + rests.next_delay());
                } else {
                    rests.reset();
                }
            }
            Event::Polled(Ok(Some(batch))) => {
                if let Some(h) = health.as_deref_mut() {
                    h.poll_ok();
                }
                in_progress.push(process(batch))
            }
            Event::Polled(Ok(None)) => stopping = true,
            Event::Polled(Err(SourceError::Config(e))) => {
                // Finish what is in progress (its settlements are already decided) first.
                while let Some(_outage) = in_progress.next().await {}
                let _ = source.after_batch().await;
                return Err(SourceError::Config(e).into());
            }
            Event::Polled(Err(e)) => {
                tracing::warn!(error = %e, "poll failed; backing off");
                if let Some(h) = health.as_deref_mut() {
                    h.poll_failed(&e);
                }
                resting_until = Some(tokio::time::Instant::now() + rests.next_delay());
            }
        }
    }
}
