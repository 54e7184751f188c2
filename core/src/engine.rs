//! The idempotent consumer engine: one loop over any [`Source`] and any [`DedupStore`].
//!
//! For each polled batch:
//! 1. derive keys; a message without a usable key is rejected (dead-lettered) with the reason;
//! 2. dedup within the batch: later copies of a key wait for the first one's fate;
//! 3. claim all keys in one round trip (retried with back-off while the store is down; if it
//!    stays down the batch is nacked, never acked);
//! 4. run handlers for the acquired keys, at most `max_concurrency` at a time, each with a
//!    heartbeat extending its lease;
//! 5. complete the successful ones in one round trip, and only then ack them.
//!
//! | claim / handler outcome | store | broker |
//! |---|---|---|
//! | duplicate | – | ack |
//! | in flight elsewhere | – | nack, redeliver after the other lease |
//! | payload conflict | – | reject with reason |
//! | handler ok, completion durable | complete | ack |
//! | handler ok, lease lost (fenced) | – | nack |
//! | handler retryable error / panic | release | nack after `retry_delay` |
//! | handler permanent error | release | reject with reason |
//! | store unavailable | – | nack after back-off |

use crate::handler::{ClaimedMessage, Handler, HandlerError};
use crate::key::{DedupKey, KeyStrategy};
use crate::metrics as m;
use crate::source::{Delivery, Source, SourceError};
use crate::store::{
    now_ms, ClaimOutcome, ClaimRequest, CompleteOutcome, Completion, DedupStore, ExtendOutcome,
    FencingToken, Lease, PayloadHash, StoreError,
};
use futures::FutureExt;
use std::collections::HashMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::Instrument;

/// Engine settings. Defaults suit handlers that take up to a few seconds.
#[derive(Debug, Clone)]
pub struct ConsumerConfig {
    /// Most deliveries taken per poll (and claimed per round trip).
    pub max_batch: usize,
    /// Most handlers running at once.
    pub max_concurrency: usize,
    /// Lease per claim; a crashed worker's keys are taken over after it.
    pub lease: Duration,
    /// Heartbeat period extending leases of running handlers (`None` = lease / 3).
    pub heartbeat: Option<Duration>,
    /// How long completed keys are remembered (duplicates skipped).
    pub retention: Duration,
    /// Redelivery delay after a handler failure or a lost lease.
    pub retry_delay: Duration,
    /// Longest wait before redelivering a message another worker holds.
    pub in_flight_delay_max: Duration,
    /// First back-off after a store error; doubles up to `store_backoff_max`.
    pub store_backoff: Duration,
    /// Longest back-off after store errors.
    pub store_backoff_max: Duration,
    /// Store retries of a claim before the batch is nacked.
    pub store_retries: u32,
    /// How long to keep retrying a completion after the handlers succeeded (the effects
    /// happened; nacking would run them again). Leases are kept alive meanwhile.
    pub complete_patience: Duration,
    /// Longest a handler may run; on expiry it is cancelled, its key released and the
    /// message redelivered. `None`: no limit (the heartbeat keeps the lease).
    pub handler_timeout: Option<Duration>,
    /// Compare payload hashes: the same key with another payload is rejected, not skipped.
    pub payload_check: bool,
    /// This worker's id, kept in records for audit.
    pub worker_id: String,
}

impl Default for ConsumerConfig {
    fn default() -> Self {
        Self {
            max_batch: 100,
            max_concurrency: 16,
            lease: Duration::from_secs(30),
            heartbeat: None,
            retention: Duration::from_secs(7 * 24 * 3600),
            retry_delay: Duration::from_secs(1),
            in_flight_delay_max: Duration::from_secs(5),
            store_backoff: Duration::from_millis(100),
            store_backoff_max: Duration::from_secs(10),
            store_retries: 4,
            complete_patience: Duration::from_secs(300),
            handler_timeout: None,
            payload_check: true,
            worker_id: format!(
                "pid{}-{:06x}",
                std::process::id(),
                rand::random::<u32>() & 0xff_ffff
            ),
        }
    }
}

impl ConsumerConfig {
    /// The time budget of claim retries: `store_retries` doublings of the back-off.
    fn store_retries_budget(&self) -> Duration {
        let mut total = Duration::ZERO;
        let mut b = self.store_backoff;
        for _ in 0..self.store_retries {
            total += b;
            b = (b * 2).min(self.store_backoff_max);
        }
        total + Duration::from_millis(1)
    }

    /// Checks combinations that would break the guarantees, and says what to change.
    ///
    /// ```
    /// use idemq_core::ConsumerConfig;
    /// use std::time::Duration;
    /// let bad = ConsumerConfig { lease: Duration::from_secs(5), heartbeat: Some(Duration::from_secs(10)), ..Default::default() };
    /// assert!(bad.validate().unwrap_err().contains("heartbeat"));
    /// ```
    pub fn validate(&self) -> Result<(), String> {
        if self.lease < Duration::from_millis(50) {
            return Err(format!(
                "lease {:?} is too short to cover a claim round trip: use at least 50ms (seconds in production)",
                self.lease
            ));
        }
        if let Some(h) = self.heartbeat {
            if h.is_zero() || h >= self.lease {
                return Err(format!(
                    "heartbeat {h:?} must be shorter than the lease {:?} (lease / 3 is a good value), or the lease lapses between beats",
                    self.lease
                ));
            }
        }
        if self.in_flight_delay_max < MIN_REDELIVERY_DELAY {
            return Err(format!(
                "in_flight_delay_max {:?} is below the {MIN_REDELIVERY_DELAY:?} floor: redeliveries would spin",
                self.in_flight_delay_max
            ));
        }
        if self.store_backoff.is_zero() || self.store_backoff_max < self.store_backoff {
            return Err("store_backoff must be > 0 and store_backoff_max ≥ store_backoff, or a store outage becomes a hot retry loop".into());
        }
        if self.handler_timeout.is_some_and(|t| t.is_zero()) {
            return Err("handler_timeout 0 cancels every handler: use None for no limit".into());
        }
        if self.retention.is_zero() {
            return Err("retention 0 forgets keys at once: every redelivery would run again; use the broker's redelivery horizon (days)".into());
        }
        if self.worker_id.is_empty() || self.worker_id.len() > 255 || self.worker_id.contains('\0')
        {
            return Err(
                "worker_id must be 1 to 255 bytes without NUL: it is kept in records for audit"
                    .into(),
            );
        }
        Ok(())
    }
}

/// Counters of one engine (also exported through `metrics`).
#[derive(Debug, Default)]
struct Counters {
    processed: AtomicU64,
    duplicates: AtomicU64,
    in_flight: AtomicU64,
    retried: AtomicU64,
    rejected: AtomicU64,
    fenced: AtomicU64,
    store_unavailable: AtomicU64,
    takeovers: AtomicU64,
}

/// A snapshot of an engine's counters (deliveries, not distinct messages).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
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
}

impl ConsumerStats {
    /// Deliveries sent back for redelivery, whatever the reason.
    pub fn redelivered(&self) -> u64 {
        self.in_flight + self.retried + self.fenced + self.store_unavailable
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
/// let msg = Envelope::new(BrokerKind::Memory, "orders", "{}").with_header("x-idempotency-key", "o-1");
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

/// One primary delivery of a key and the in-batch copies that wait on it.
struct Item {
    delivery: Delivery,
    key: DedupKey,
    hash: Option<PayloadHash>,
    followers: Vec<Delivery>,
}

#[derive(Clone, Copy)]
enum Settlement<'a> {
    Ack,
    Nack(Duration),
    Reject(&'a str),
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
        }
    }

    /// Polls and processes until `shutdown` resolves or the source ends. A batch in progress
    /// is finished (settled) before returning.
    pub async fn run<S: Source + ?Sized>(
        &self,
        source: &mut S,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), ConsumerError> {
        self.cfg.validate().map_err(ConsumerError::Config)?;
        tokio::pin!(shutdown);
        let mut backoff = self.cfg.store_backoff;
        loop {
            let polled = tokio::select! {
                biased;
                _ = &mut shutdown => return Ok(()),
                p = source.poll(self.cfg.max_batch) => p,
            };
            match polled {
                Ok(Some(batch)) => {
                    let store_down = self.process_batch(batch).await;
                    if store_down {
                        // The batch was nacked; give the store time before polling again.
                        tokio::select! {
                            _ = &mut shutdown => return Ok(()),
                            _ = tokio::time::sleep(backoff) => {}
                        }
                        backoff = (backoff * 2).min(self.cfg.store_backoff_max);
                    } else {
                        backoff = self.cfg.store_backoff;
                    }
                }
                Ok(None) => return Ok(()),
                Err(SourceError::Config(e)) => return Err(SourceError::Config(e).into()),
                Err(e) => {
                    tracing::warn!(error = %e, "poll failed; backing off");
                    tokio::select! {
                        _ = &mut shutdown => return Ok(()),
                        _ = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(self.cfg.store_backoff_max);
                }
            }
        }
    }

    /// Runs until the source ends (for sources that end, such as a closed memory broker).
    pub async fn run_until_idle<S: Source + ?Sized>(
        &self,
        source: &mut S,
    ) -> Result<(), ConsumerError> {
        self.run(source, std::future::pending()).await
    }

    /// Processes one batch and settles every delivery in it. Returns true when the store
    /// was unavailable (the affected deliveries were nacked).
    pub async fn process_batch(&self, batch: Vec<Delivery>) -> bool {
        let span = tracing::debug_span!("idemq.batch", size = batch.len(), group = %self.keys.group().as_str());
        self.process_batch_inner(batch).instrument(span).await
    }

    async fn process_batch_inner(&self, batch: Vec<Delivery>) -> bool {
        let group = self.keys.group().as_str().to_string();
        let mut items: Vec<Item> = Vec::with_capacity(batch.len());
        let mut index: HashMap<DedupKey, usize> = HashMap::new();
        for d in batch {
            let key = match self.keys.derive(&d.envelope) {
                Ok(k) => k,
                Err(e) => {
                    let reason = format!("no usable dedup key: {e}");
                    tracing::warn!(source = %d.envelope.source.name, %reason, "rejecting message");
                    self.count(&self.counters.rejected, m::outcome::REJECTED, &d, 1);
                    settle(d, Settlement::Reject(&reason)).await;
                    continue;
                }
            };
            let hash = self
                .cfg
                .payload_check
                .then(|| PayloadHash::of(&d.envelope.payload));
            match index.get(&key) {
                Some(&i) if items[i].hash == hash => items[i].followers.push(d),
                Some(_) => {
                    // Same key, other payload, same batch: let it meet the stored record
                    // on its own, where a conflict is reported.
                    self.count(&self.counters.in_flight, m::outcome::IN_FLIGHT, &d, 1);
                    settle(d, Settlement::Nack(self.cfg.retry_delay)).await;
                }
                None => {
                    index.insert(key.clone(), items.len());
                    items.push(Item {
                        delivery: d,
                        key,
                        hash,
                        followers: Vec::new(),
                    });
                }
            }
        }
        if items.is_empty() {
            return false;
        }

        let reqs: Vec<ClaimRequest> = items
            .iter()
            .map(|it| ClaimRequest {
                key: it.key.clone(),
                lease: self.cfg.lease,
                payload_hash: it.hash,
                worker: Some(self.cfg.worker_id.clone()),
                // One token per message per batch, kept across retries of the claim, so a
                // retry after a lost reply gets back the lease it already holds.
                token: Some(FencingToken::random()),
            })
            .collect();
        let outcomes: Vec<Result<ClaimOutcome, StoreError>> = match self
            .with_store_retries("claim", self.cfg.store_retries_budget(), || {
                self.timed_claim(&reqs, &group)
            })
            .await
        {
            Ok(o) if o.len() == items.len() => o.into_iter().map(Ok).collect(),
            Ok(o) => {
                tracing::error!(
                    got = o.len(),
                    want = items.len(),
                    "store answered a batch claim with the wrong number of outcomes"
                );
                self.nack_items(items, self.cfg.store_backoff).await;
                return true;
            }
            Err(e) if e.is_retryable() => {
                self.nack_items(items, self.cfg.store_backoff).await;
                return true;
            }
            Err(e) => {
                // One bad key must not block the batch forever: claim one by one and deal
                // with the key the store refuses on its own.
                tracing::warn!(error = %e, "batch claim refused; claiming one by one");
                let mut v = Vec::with_capacity(reqs.len());
                for r in &reqs {
                    v.push(
                        self.timed_claim(std::slice::from_ref(r), &group)
                            .await
                            .and_then(|mut o| {
                                o.pop().ok_or_else(|| {
                                    StoreError::Backend("claim returned no outcome".into())
                                })
                            }),
                    );
                }
                v
            }
        };

        // Leases of this batch live from the claim until their completion is durable (or
        // they are released): one heartbeat keeps all of them, including handlers still
        // waiting for a concurrency slot and finished ones waiting for the batch.
        let live = Arc::new(LiveLeases::default());
        let beat = self
            .cfg
            .heartbeat
            .unwrap_or(self.cfg.lease / 3)
            .max(Duration::from_millis(10));
        let _heartbeat = AbortOnDrop(tokio::spawn(heartbeat(
            self.store.clone(),
            live.clone(),
            self.cfg.lease,
            beat,
        )));

        // Dispatch.
        let half_lease_ms = crate::store::duration_ms(self.cfg.lease) / 2;
        let semaphore = Arc::new(tokio::sync::Semaphore::new(self.cfg.max_concurrency));
        let mut running = tokio::task::JoinSet::new();
        let mut acquired: HashMap<usize, (Item, Lease)> = HashMap::new();
        for (i, (item, outcome)) in items.into_iter().zip(outcomes).enumerate() {
            let outcome = match outcome {
                Ok(o) => o,
                Err(e) => {
                    self.store_refused(item, &e).await;
                    continue;
                }
            };
            match outcome {
                ClaimOutcome::Acquired(lease)
                    if lease.until_ms.saturating_sub(now_ms()) < half_lease_ms =>
                {
                    // The claim sat blocked (a row lock, a slow store) until most of its lease
                    // was gone: another worker could take it over mid-handler. Give it back.
                    tracing::warn!(key = %item.key, "claim answered with less than half its lease left; releasing and redelivering");
                    self.release(&item.key, lease.token).await;
                    self.settle_all(
                        item,
                        Settlement::Nack(self.cfg.store_backoff),
                        &self.counters.store_unavailable,
                        m::outcome::STORE_UNAVAILABLE,
                    )
                    .await;
                }
                ClaimOutcome::Acquired(lease) => {
                    if lease.takeover {
                        self.counters.takeovers.fetch_add(1, Ordering::Relaxed);
                        metrics::counter!(m::LEASE_TAKEOVERS, "group" => group.clone())
                            .increment(1);
                        tracing::info!(key = %item.key, attempt = lease.attempt, "took over an expired lease");
                    }
                    live.insert(item.key.clone(), lease.token);
                    let msg = ClaimedMessage {
                        envelope: item.delivery.envelope.clone(),
                        key: item.key.clone(),
                        token: lease.token,
                        attempt: lease.attempt,
                        takeover: lease.takeover,
                    };
                    let handler = self.handler.clone();
                    let sem = semaphore.clone();
                    let limit = self.cfg.handler_timeout;
                    let span = tracing::info_span!("idemq.handle", broker = %msg.envelope.broker, source = %msg.envelope.source.name, key = %msg.key, attempt = msg.attempt);
                    running.spawn(
                        async move {
                            let _permit = sem.acquire_owned().await;
                            let work = AssertUnwindSafe(handler.handle(msg)).catch_unwind();
                            let res = match limit {
                                Some(t) => match tokio::time::timeout(t, work).await {
                                    Ok(r) => r.map_err(|_| HandlerFailure::Panicked),
                                    Err(_) => Err(HandlerFailure::TimedOut(t)),
                                },
                                None => work.await.map_err(|_| HandlerFailure::Panicked),
                            };
                            (i, res)
                        }
                        .instrument(span),
                    );
                    acquired.insert(i, (item, lease));
                }
                ClaimOutcome::Duplicate(record) => {
                    let n = 1 + item.followers.len() as u64;
                    metrics::counter!(m::DUPLICATES, "topic" => item.delivery.envelope.source.name.clone(), "group" => group.clone()).increment(n);
                    tracing::debug!(key = %item.key, "duplicate skipped");
                    self.handler
                        .on_duplicate(&item.delivery.envelope, &record)
                        .await;
                    self.settle_all(
                        item,
                        Settlement::Ack,
                        &self.counters.duplicates,
                        m::outcome::DUPLICATE,
                    )
                    .await;
                }
                ClaimOutcome::InFlight { until_ms } => {
                    metrics::counter!(m::IN_FLIGHT_CONFLICTS, "group" => group.clone())
                        .increment(1);
                    let wait =
                        Duration::from_millis(until_ms.saturating_sub(now_ms()).max(0) as u64)
                            .min(self.cfg.in_flight_delay_max)
                            .max(MIN_REDELIVERY_DELAY);
                    self.settle_all(
                        item,
                        Settlement::Nack(wait),
                        &self.counters.in_flight,
                        m::outcome::IN_FLIGHT,
                    )
                    .await;
                }
                ClaimOutcome::PayloadConflict(rec) => {
                    metrics::counter!(m::PAYLOAD_CONFLICTS, "group" => group.clone()).increment(1);
                    let reason = format!(
                        "payload conflict: key `{}` was first seen with a different payload (status {:?}, attempts {}); fix the producer's key",
                        item.key, rec.status, rec.attempts
                    );
                    tracing::warn!(key = %item.key, "{reason}");
                    self.settle_all(
                        item,
                        Settlement::Reject(&reason),
                        &self.counters.rejected,
                        m::outcome::REJECTED,
                    )
                    .await;
                }
            }
        }

        // Collect handler results.
        let mut done: Vec<(Item, Completion)> = Vec::new();
        while let Some(joined) = running.join_next().await {
            let (i, res) = match joined {
                Ok(r) => r,
                Err(e) => {
                    // Only cancellation gets here (panics are caught in the task).
                    tracing::error!(error = %e, "handler task ended abnormally");
                    continue;
                }
            };
            let Some((item, lease)) = acquired.remove(&i) else {
                continue;
            };
            match res {
                Ok(Ok(result)) => {
                    let c = Completion {
                        key: item.key.clone(),
                        token: lease.token,
                        result,
                        retention: self.cfg.retention,
                    };
                    done.push((item, c));
                }
                Ok(Err(HandlerError::Permanent(e))) => {
                    let reason = format!("handler failed permanently: {e}");
                    self.give_back(&live, item, lease, Settlement::Reject(&reason))
                        .await;
                }
                Ok(Err(HandlerError::Retryable(e))) => {
                    tracing::warn!(key = %item.key, error = %e, "handler failed; will retry");
                    self.give_back(&live, item, lease, Settlement::Nack(self.cfg.retry_delay))
                        .await;
                }
                Err(failure) => {
                    tracing::error!(key = %item.key, %failure, "handler did not finish; will retry");
                    self.give_back(&live, item, lease, Settlement::Nack(self.cfg.retry_delay))
                        .await;
                }
            }
        }
        // Anything left (a cancelled task) goes back to the broker.
        for (_, (item, lease)) in acquired.drain() {
            self.give_back(&live, item, lease, Settlement::Nack(self.cfg.retry_delay))
                .await;
        }
        if done.is_empty() {
            return false;
        }

        // Complete in one round trip, then ack: never ack before the record is durable.
        // The effects already happened, so keep trying (the heartbeat keeps the leases)
        // rather than nack and run them again.
        let completions: Vec<Completion> = done.iter().map(|(_, c)| c.clone()).collect();
        let result = self
            .with_store_retries("complete", self.cfg.complete_patience, || {
                self.store.complete_batch(&completions)
            })
            .await;
        drop(_heartbeat);
        match result {
            Ok(outs) if outs.len() == done.len() => {
                for ((mut item, _), out) in done.into_iter().zip(outs) {
                    match out {
                        CompleteOutcome::Completed => {
                            let followers = std::mem::take(&mut item.followers);
                            self.count(
                                &self.counters.processed,
                                m::outcome::PROCESSED,
                                &item.delivery,
                                1,
                            );
                            if !followers.is_empty() {
                                metrics::counter!(m::DUPLICATES, "topic" => item.delivery.envelope.source.name.clone(), "group" => group.clone()).increment(followers.len() as u64);
                            }
                            settle(item.delivery, Settlement::Ack).await;
                            for f in followers {
                                self.count(&self.counters.duplicates, m::outcome::DUPLICATE, &f, 1);
                                settle(f, Settlement::Ack).await;
                            }
                        }
                        CompleteOutcome::Fenced => {
                            metrics::counter!(m::FENCED_COMPLETIONS, "group" => group.clone())
                                .increment(1);
                            tracing::warn!(key = %item.key, "completion fenced: the lease was taken over; redelivering");
                            self.settle_all(
                                item,
                                Settlement::Nack(self.cfg.retry_delay),
                                &self.counters.fenced,
                                m::outcome::FENCED,
                            )
                            .await;
                        }
                    }
                }
                false
            }
            _ => {
                // Not durable: no ack. The leases expire and the redelivery finds the keys
                // claimable (or completed, if the write landed after all).
                tracing::error!(
                    count = done.len(),
                    "completions not durable after {:?}; nacking (their handlers may run again)",
                    self.cfg.complete_patience
                );
                for (item, _) in done {
                    self.settle_all(
                        item,
                        Settlement::Nack(self.cfg.store_backoff),
                        &self.counters.store_unavailable,
                        m::outcome::STORE_UNAVAILABLE,
                    )
                    .await;
                }
                true
            }
        }
    }

    async fn timed_claim(
        &self,
        reqs: &[ClaimRequest],
        group: &str,
    ) -> Result<Vec<ClaimOutcome>, StoreError> {
        let started = Instant::now();
        let r = self.store.claim_batch(reqs).await;
        if r.is_ok() {
            metrics::histogram!(m::CLAIM_SECONDS, "group" => group.to_string())
                .record(started.elapsed().as_secs_f64());
        }
        r
    }

    /// The store cannot answer for this key (a retryable error) or refuses it for good.
    async fn store_refused(&self, item: Item, e: &StoreError) {
        match e {
            StoreError::KeyTooLong { .. } | StoreError::Corrupt { .. } => {
                let reason = format!("dedup store refused the key: {e}");
                tracing::warn!(key = %item.key, %reason, "rejecting message");
                self.settle_all(
                    item,
                    Settlement::Reject(&reason),
                    &self.counters.rejected,
                    m::outcome::REJECTED,
                )
                .await;
            }
            _ => {
                tracing::warn!(key = %item.key, error = %e, "claim failed; redelivering later");
                self.settle_all(
                    item,
                    Settlement::Nack(self.cfg.store_backoff),
                    &self.counters.store_unavailable,
                    m::outcome::STORE_ERROR,
                )
                .await;
            }
        }
    }

    async fn nack_items(&self, items: Vec<Item>, delay: Duration) {
        for it in items {
            self.settle_all(
                it,
                Settlement::Nack(delay),
                &self.counters.store_unavailable,
                m::outcome::STORE_UNAVAILABLE,
            )
            .await;
        }
    }

    /// Retries retryable store errors with back-off for at most `patience`.
    async fn with_store_retries<T, F, Fut>(
        &self,
        op: &'static str,
        patience: Duration,
        mut call: F,
    ) -> Result<T, StoreError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, StoreError>>,
    {
        let started = Instant::now();
        let mut backoff = self.cfg.store_backoff;
        let mut attempt = 0u32;
        loop {
            match call().await {
                Ok(v) => return Ok(v),
                Err(e) => {
                    metrics::counter!(m::STORE_ERRORS, "op" => op).increment(1);
                    attempt += 1;
                    if !e.is_retryable() || started.elapsed() + backoff > patience {
                        tracing::error!(op, error = %e, attempt, "dedup store call failed; not acking");
                        return Err(e);
                    }
                    tracing::warn!(op, error = %e, attempt, "dedup store call failed; backing off");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(self.cfg.store_backoff_max);
                }
            }
        }
    }

    /// A handler failed: stop heartbeating the key, release it, and reject or nack.
    async fn give_back(&self, live: &LiveLeases, item: Item, lease: Lease, how: Settlement<'_>) {
        live.remove(&item.key);
        self.release(&item.key, lease.token).await;
        let (counter, outcome) = match how {
            Settlement::Reject(_) => (&self.counters.rejected, m::outcome::REJECTED),
            _ => (&self.counters.retried, m::outcome::RETRIED),
        };
        self.settle_all(item, how, counter, outcome).await;
    }

    async fn release(&self, key: &DedupKey, token: FencingToken) {
        // Best effort: if it fails the lease simply expires and the key is taken over.
        if let Err(e) = self.store.release(key, token).await {
            metrics::counter!(m::STORE_ERRORS, "op" => "release").increment(1);
            tracing::warn!(%key, error = %e, "release failed; the key frees up when its lease ends");
        }
    }

    fn count(&self, c: &AtomicU64, outcome: &'static str, d: &Delivery, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
        metrics::counter!(m::MESSAGES, "outcome" => outcome, "broker" => d.envelope.broker.as_str(), "group" => self.keys.group().as_str().to_string()).increment(n);
    }

    async fn settle_all(
        &self,
        item: Item,
        how: Settlement<'_>,
        c: &AtomicU64,
        outcome: &'static str,
    ) {
        self.count(c, outcome, &item.delivery, 1 + item.followers.len() as u64);
        for f in item.followers {
            settle(f, how).await;
        }
        settle(item.delivery, how).await;
    }
}

async fn settle(d: Delivery, how: Settlement<'_>) {
    let source = d.envelope.source.name.clone();
    let r = match how {
        Settlement::Ack => d.ack().await,
        Settlement::Nack(delay) => d.nack(delay).await,
        Settlement::Reject(reason) => d.reject(reason).await,
    };
    if let Err(e) = r {
        // The broker will redeliver; the dedup record makes that harmless.
        tracing::warn!(%source, error = %e, "settling a delivery failed");
    }
}

/// A floor on redelivery delays, so a broker without delayed redelivery doesn't spin.
const MIN_REDELIVERY_DELAY: Duration = Duration::from_millis(50);

/// Why a handler produced no result.
#[derive(Debug)]
enum HandlerFailure {
    Panicked,
    TimedOut(Duration),
}

impl std::fmt::Display for HandlerFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HandlerFailure::Panicked => f.write_str("handler panicked"),
            HandlerFailure::TimedOut(t) => write!(f, "handler exceeded its {t:?} timeout"),
        }
    }
}

/// The leases a batch holds, and whether each is still ours.
#[derive(Default)]
struct LiveLeases(std::sync::Mutex<HashMap<DedupKey, (FencingToken, bool)>>);

impl LiveLeases {
    fn insert(&self, key: DedupKey, token: FencingToken) {
        if let Ok(mut m) = self.0.lock() {
            m.insert(key, (token, true));
        }
    }
    fn remove(&self, key: &DedupKey) {
        if let Ok(mut m) = self.0.lock() {
            m.remove(key);
        }
    }
    fn owned(&self) -> Vec<(DedupKey, FencingToken)> {
        self.0
            .lock()
            .map(|m| {
                m.iter()
                    .filter(|(_, (_, ours))| *ours)
                    .map(|(k, (t, _))| (k.clone(), *t))
                    .collect()
            })
            .unwrap_or_default()
    }
    fn lost(&self, key: &DedupKey) {
        if let Ok(mut m) = self.0.lock() {
            if let Some(e) = m.get_mut(key) {
                e.1 = false;
            }
        }
    }
}

/// Aborts a task when dropped (the batch's heartbeat ends with the batch, however it ends).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Extends every lease of a batch every `beat` until aborted.
async fn heartbeat(
    store: Arc<dyn DedupStore>,
    live: Arc<LiveLeases>,
    lease: Duration,
    beat: Duration,
) {
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + beat, beat);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        for (key, token) in live.owned() {
            match store.extend(&key, token, lease).await {
                Ok(ExtendOutcome::Extended { .. }) => {}
                Ok(ExtendOutcome::Fenced) => {
                    tracing::warn!(%key, "lease lost (heartbeat fenced): another worker took the key over");
                    live.lost(&key);
                }
                Err(e) => {
                    metrics::counter!(m::STORE_ERRORS, "op" => "extend").increment(1);
                    tracing::warn!(%key, error = %e, "heartbeat failed");
                }
            }
        }
    }
}
