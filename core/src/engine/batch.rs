//! One batch, stage by stage: keys → claim → dispatch → complete → settle.

use super::config::{DeliveryOrder, RetryPolicy, MIN_REDELIVERY_DELAY};
use super::lease::{heartbeat, AbortOnDrop, LiveLeases};
use super::IdempotentConsumer;
use crate::envelope::Envelope;
use crate::handler::{ClaimedMessage, Handler, HandlerError, HandlerResult, LeaseWatch, Settled};
use crate::key::DedupKey;
use crate::metrics as m;
use crate::source::{Delivery, Settlement};
use crate::store::{
    now_ms, ClaimMode, ClaimOutcome, ClaimRequest, CompleteOutcome, Completion, DedupRecord,
    FencingToken, Lease, PayloadHash, StoreError,
};
use bytes::Bytes;
use futures::FutureExt;
use std::collections::HashMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::Instrument;

/// Most bytes of results (and keys) sent in one completion round trip: well under MariaDB's
/// default `max_allowed_packet` and PostgreSQL's message limits.
const MAX_COMPLETION_BYTES: usize = 1 << 20;

/// Messages that must run one after another (see [`DeliveryOrder`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Lane {
    Partition(Option<String>, String, Option<i32>),
    Key(String, Bytes),
}

/// One primary delivery of a key and the in-batch copies that wait on it. Boxed: it moves
/// through every stage, and a delivery is a few hundred bytes.
type Item = Box<ItemData>;

/// The contents of an [`Item`].
struct ItemData {
    /// Position in the batch's item list (its lease slot).
    index: usize,
    delivery: Delivery,
    key: DedupKey,
    hash: Option<PayloadHash>,
    lane: Option<Lane>,
    followers: Vec<Delivery>,
}

/// Why a handler produced no result.
#[derive(Debug)]
enum HandlerFailure {
    Panicked(String),
    TimedOut(Duration),
    LeaseLost,
}

impl std::fmt::Display for HandlerFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HandlerFailure::Panicked(why) => write!(f, "handler panicked: {why}"),
            HandlerFailure::TimedOut(t) => write!(f, "handler exceeded its {t:?} timeout"),
            HandlerFailure::LeaseLost => {
                f.write_str("lease lost while the handler ran; it was cancelled")
            }
        }
    }
}

/// What became of one acquired message in the dispatch stage.
enum Verdict {
    /// The handler succeeded: complete, then ack.
    Done(Option<Bytes>),
    /// The handler failed: give the key back and settle so.
    Failed(Settlement, String),
    /// The handler was cut off (panic, timeout, lost lease): its effect may be half done.
    /// The key is not released, so the next run is a takeover and says so (`takeover`).
    CutOff(Settlement, String),
    /// Not run: an earlier message of its lane was sent back with this delay.
    NotRun(Duration),
}

/// An acquired item, its lease, and its envelope while lent to the handler.
type Acquired = (Item, Lease, Arc<Envelope>);

/// The jobs of one lane, in order (most lanes hold one job: no allocation for it).
struct LaneJobs {
    first: Job,
    rest: Vec<Job>,
}

/// A handler to run: the index of its item and the message it sees.
struct Job {
    index: usize,
    msg: ClaimedMessage,
}

/// What stage 3a lines up over a batch: the handlers to run, by lane, and the lanes that
/// had a message sent back.
struct Lineup {
    /// Lanes with a message sent back in this batch, and the delay it was sent back with:
    /// the lane's later messages go back unrun with the same delay.
    held: HashMap<Lane, Duration>,
    lanes: Vec<LaneJobs>,
    /// Where each lane's jobs are in `lanes`.
    lane_slot: HashMap<Lane, usize>,
    /// The acquired items by index, each with the envelope lent to its handler.
    acquired: Vec<Option<Acquired>>,
}

impl Lineup {
    fn new(items: usize) -> Self {
        let mut acquired: Vec<Option<Acquired>> = Vec::new();
        acquired.resize_with(items, || None);
        Lineup {
            held: HashMap::new(),
            lanes: Vec::new(),
            lane_slot: HashMap::new(),
            acquired,
        }
    }

    /// The delay the lane's earlier message was sent back with, if one was.
    fn held_for(&self, lane: Option<&Lane>) -> Option<Duration> {
        lane.and_then(|l| self.held.get(l)).copied()
    }

    /// Holds the lane for the rest of the batch (the first delay sent back stays).
    fn hold(&mut self, lane: Lane, delay: Duration) {
        self.held.entry(lane).or_insert(delay);
    }

    /// Queues a handler behind the earlier ones of its lane (an unordered message is a
    /// lane of its own).
    fn push(&mut self, job: Job, lent: Acquired) {
        let index = job.index;
        let lane = lent.0.lane.as_ref();
        match lane.and_then(|l| self.lane_slot.get(l)) {
            Some(&slot) => self.lanes[slot].rest.push(job),
            None => {
                if let Some(l) = lane {
                    self.lane_slot.insert(l.clone(), self.lanes.len());
                }
                self.lanes.push(LaneJobs {
                    first: job,
                    rest: Vec::new(),
                });
            }
        }
        self.acquired[index] = Some(lent);
    }

    fn into_parts(self) -> (Vec<Option<Acquired>>, Vec<LaneJobs>) {
        (self.acquired, self.lanes)
    }
}

/// Why an acquired key goes back without its handler running.
enum Unrun {
    /// An earlier message of its lane was sent back with this delay.
    LaneHeld(Duration),
    /// The claim came back with less than half its lease left.
    LateClaim,
    /// The source can no longer settle the delivery.
    Stale,
}

impl<H: Handler> IdempotentConsumer<H> {
    /// Processes one batch and settles every delivery in it. Returns true when the store
    /// was unavailable (the affected deliveries were nacked).
    pub async fn process_batch(&self, batch: Vec<Delivery>) -> bool {
        let span = tracing::debug_span!("idemq.batch", size = batch.len(), group = %self.keys.group().as_str());
        let store_down = self.run_stages(batch).instrument(span).await;
        self.flush_metrics();
        store_down
    }

    /// Reports the batch's outcome counts to `metrics`, one call per label set.
    fn flush_metrics(&self) {
        let group = self.keys.group().as_str();
        self.counters.unflushed.drain(|broker, i, n| {
            let outcome = Outcome::ALL[i].label;
            metrics::counter!(m::MESSAGES, "outcome" => outcome, "broker" => broker.as_str(), "group" => group.to_string()).increment(n);
        });
    }

    /// Counts a message without a derivable key; at [`KEYLESS_RUN`](super::health::KEYLESS_RUN)
    /// in a row the consumer turns degraded with a warning saying where the strategy looks.
    fn keyless(&self, reason: &str, kind: &'static str) {
        metrics::counter!(m::KEY_ERRORS, "group" => self.keys.group().as_str().to_string(), "reason" => kind).increment(1);
        let in_row = self.counters.keyless_in_row.fetch_add(1, Ordering::Relaxed) + 1;
        if in_row == super::health::KEYLESS_RUN {
            let what = format!(
                "the last {in_row} messages in a row had no usable dedup key and were \
                 dead-lettered: group `{}` reads its keys from {}, which these messages do \
                 not carry (last: {reason}); fix the key strategy or the producers",
                self.keys.group().as_str(),
                self.keys.describe_source()
            );
            tracing::warn!(group = %self.keys.group().as_str(), "{what}");
            self.counters.health.keys_failing(what);
        }
    }

    async fn run_stages(&self, batch: Vec<Delivery>) -> bool {
        let items = self.stage_keys(batch).await;
        if items.is_empty() {
            return false;
        }
        let claimed_at = tokio::time::Instant::now();
        let Some(outcomes) = self.stage_claim(&items).await else {
            for it in items {
                self.settle_item(
                    it,
                    Settlement::Nack(self.cfg.store_backoff),
                    Outcome::STORE_DOWN,
                )
                .await;
            }
            return true;
        };
        // Leases of this batch live from the claim until their completion is durable (or
        // they are given back): one heartbeat keeps all of them, including handlers still
        // waiting for a concurrency slot and finished ones waiting for the batch.
        let live = Arc::new(LiveLeases::new(
            items
                .iter()
                .zip(&outcomes)
                .map(|(it, o)| match o {
                    Ok(ClaimOutcome::Acquired(l)) => Some((it.key.clone(), l.token)),
                    _ => None,
                })
                .collect(),
            claimed_at,
            self.cfg.lease,
        ));
        let stages = async {
            let (acquired, lanes) = self
                .stage_dispatch(items, outcomes, &live, claimed_at)
                .await;
            self.stage_run_and_finish(acquired, lanes, &live).await
        };
        if self.store.claim_mode() == ClaimMode::InEffectTransaction {
            // No lease was taken: the handler's transaction holds the keys.
            return stages.await;
        }
        let keep_alive = self.keep_leases_alive(live.clone());
        tokio::select! {
            biased;
            store_down = stages => store_down,
            never = keep_alive => match never {},
        }
    }

    /// Renews the batch's leases until dropped (with the batch). Most batches end within
    /// milliseconds, long before their first renewal is due, so the heartbeat task starts
    /// only half a beat after the claim: a task per batch, spawned and aborted at once,
    /// cost two cross-thread wake-ups per batch (about 5% of the engine's time over the
    /// memory store). Once started it runs on its own task, so a handler that hogs this
    /// task's thread cannot starve it.
    async fn keep_leases_alive(&self, live: Arc<LiveLeases>) -> std::convert::Infallible {
        let beat = self.cfg.beat();
        tokio::time::sleep_until(live.base() + beat / 2).await;
        let _heartbeat = AbortOnDrop(tokio::spawn(heartbeat(
            self.store.clone(),
            live,
            self.cfg.lease,
            beat,
            self.cfg.heartbeat_timeout,
        )));
        std::future::pending().await
    }

    /// Stages 3b–5: run the handlers, and finish each message as soon as its handler is done
    /// (give back, or complete then ack), coalescing those that finish together into one
    /// completion round trip. A crash then loses at most the completions in flight, not a
    /// whole batch of finished effects. Returns true when the store was unavailable.
    async fn stage_run_and_finish(
        &self,
        mut acquired: Vec<Option<Acquired>>,
        lanes: Vec<LaneJobs>,
        live: &LiveLeases,
    ) -> bool {
        let (verdicts, mut finished) = tokio::sync::mpsc::unbounded_channel();
        let run = self.run_lanes(lanes, verdicts);
        let finish = async {
            let mut store_down = false;
            while let Some(first) = finished.recv().await {
                let mut ready = vec![first];
                while let Ok(v) = finished.try_recv() {
                    ready.push(v);
                }
                let ran: Vec<(Item, Lease, Verdict)> = ready
                    .into_iter()
                    .filter_map(|(index, verdict)| {
                        let (mut item, lease, envelope) =
                            acquired.get_mut(index).and_then(Option::take)?;
                        // The handler has dropped its share unless it kept a clone.
                        item.delivery.envelope =
                            Arc::try_unwrap(envelope).unwrap_or_else(|shared| (*shared).clone());
                        Some((item, lease, verdict))
                    })
                    .collect();
                let done = self.stage_give_back(ran, live).await;
                if !done.is_empty() {
                    store_down |= self.stage_complete(done, live).await;
                }
            }
            store_down
        };
        let ((), store_down) = tokio::join!(run, finish);
        store_down
    }

    /// Stage 1: keys. Rejects messages without a usable key; folds in-batch copies of a key
    /// into its first delivery. A copy with another payload is sent back (it meets the
    /// stored record on its own, where the conflict is reported), and it holds its lane:
    /// the lane's later messages in this batch go back with it, unrun, so that none is
    /// settled ahead of it (a database that stores the offset with the effect would
    /// otherwise store one past it).
    async fn stage_keys(&self, batch: Vec<Delivery>) -> Vec<Item> {
        let mut items: Vec<Item> = Vec::with_capacity(batch.len());
        let mut index: HashMap<DedupKey, usize, foldhash::fast::RandomState> =
            HashMap::with_capacity_and_hasher(batch.len(), Default::default());
        // Lanes with a message sent back in this stage, and the delay it went back with.
        let mut held: HashMap<Lane, Duration> = HashMap::new();
        for d in batch {
            let lane = self.lane_of(&d);
            if let Some(&delay) = lane.as_ref().and_then(|l| held.get(l)) {
                self.count(&Outcome::DEFERRED, &d, 1);
                self.settle(d, Settlement::Nack(delay)).await;
                continue;
            }
            let key = match super::derive_key_or_kind(&self.keys, &d.envelope) {
                Ok(k) => {
                    if self.counters.keyless_in_row.swap(0, Ordering::Relaxed) > 0 {
                        self.counters.health.keys_ok();
                    }
                    k
                }
                Err((reason, kind)) => {
                    tracing::warn!(source = %d.envelope.source.name, %reason, "rejecting message");
                    self.keyless(&reason, kind);
                    self.call_hook(
                        "on_dead_letter",
                        self.handler.on_dead_letter(&d.envelope, &reason),
                    )
                    .await;
                    self.count(&Outcome::REJECTED, &d, 1);
                    self.settle(d, Settlement::Reject(reason)).await;
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
                    let delay = self.cfg.redelivery_delay;
                    if let Some(lane) = lane {
                        held.insert(lane, delay);
                    }
                    self.count(&Outcome::IN_FLIGHT, &d, 1);
                    self.settle(d, Settlement::Nack(delay)).await;
                }
                None => {
                    index.insert(key.clone(), items.len());
                    items.push(Box::new(ItemData {
                        index: items.len(),
                        delivery: d,
                        key,
                        hash,
                        lane,
                        followers: Vec::new(),
                    }));
                }
            }
        }
        items
    }

    /// Runs one of the user's hooks (`on_duplicate`, `on_dead_letter`) isolated like the
    /// handler: a panic, or a hook still running after `hook_timeout`, is logged and
    /// counted, and the message is settled as it would have been anyway.
    async fn call_hook(&self, hook: &'static str, call: impl Future<Output = ()>) {
        let guarded = AssertUnwindSafe(call).catch_unwind();
        let failure = match tokio::time::timeout(self.cfg.hook_timeout, guarded).await {
            Ok(Ok(())) => return,
            Ok(Err(panic)) => {
                let why = super::panic_message(panic.as_ref());
                tracing::error!(hook, panic = %why, "a user hook panicked; the message is settled as it would be anyway");
                "panic"
            }
            Err(_) => {
                tracing::error!(hook, timeout = ?self.cfg.hook_timeout, "a user hook overran hook_timeout and was cut off; the message is settled as it would be anyway");
                "timeout"
            }
        };
        metrics::counter!(m::HOOK_FAILURES, "hook" => hook, "failure" => failure).increment(1);
    }

    fn lane_of(&self, d: &Delivery) -> Option<Lane> {
        let s = &d.envelope.source;
        match self.cfg.ordering {
            DeliveryOrder::Unordered => None,
            DeliveryOrder::PerPartition => Some(Lane::Partition(
                s.cluster.clone(),
                s.name.clone(),
                s.partition,
            )),
            DeliveryOrder::PerKey => d
                .envelope
                .effective_ordering_key()
                .map(|k| Lane::Key(s.name.clone(), k.clone())),
        }
    }

    /// Stage 2: claim every key in one round trip. `None` when the store stayed down (the
    /// caller nacks the batch).
    async fn stage_claim(&self, items: &[Item]) -> Option<Vec<Result<ClaimOutcome, StoreError>>> {
        let group = self.keys.group().as_str();
        let worker: Arc<str> = Arc::from(self.cfg.worker_id.as_str());
        let reqs: Vec<ClaimRequest> = items
            .iter()
            .map(|it| ClaimRequest {
                key: it.key.clone(),
                lease: self.cfg.lease,
                payload_hash: it.hash,
                worker: Some(worker.clone()),
                // One token per message per batch, kept across retries of the claim, so a
                // retry after a lost reply gets back the lease it already holds.
                token: Some(FencingToken::random()),
                deliveries: it.delivery.envelope.delivery_count,
            })
            .collect();
        match self
            .with_store_retries("claim", self.cfg.store_retries_budget(), || {
                self.timed_claim(&reqs, group)
            })
            .await
        {
            Ok(o) if o.len() == items.len() => Some(o.into_iter().map(Ok).collect()),
            Ok(o) => {
                tracing::error!(
                    got = o.len(),
                    want = items.len(),
                    "store answered a batch claim with the wrong number of outcomes"
                );
                None
            }
            Err(e) if e.is_retryable() => None,
            Err(e) => {
                // One bad key must not block the batch forever: claim one by one and deal
                // with the key the store refuses on its own.
                tracing::warn!(error = %e, "batch claim refused; claiming one by one");
                let mut v = Vec::with_capacity(reqs.len());
                for r in &reqs {
                    v.push(
                        self.timed_claim(std::slice::from_ref(r), group)
                            .await
                            .and_then(|mut o| {
                                o.pop().ok_or_else(|| {
                                    StoreError::Backend("claim returned no outcome".into())
                                })
                            }),
                    );
                }
                Some(v)
            }
        }
    }

    /// Stage 3a: settle what needs no handler, and line up the handlers of acquired keys in
    /// lanes (in order within a lane). Returns the acquired items by index, each with the
    /// envelope lent to its handler, and the lanes to run.
    async fn stage_dispatch(
        &self,
        items: Vec<Item>,
        outcomes: Vec<Result<ClaimOutcome, StoreError>>,
        live: &Arc<LiveLeases>,
        claimed_at: tokio::time::Instant,
    ) -> (Vec<Option<Acquired>>, Vec<LaneJobs>) {
        let mut lineup = Lineup::new(outcomes.len());
        let mode = self.store.claim_mode();
        for (index, (item, outcome)) in items.into_iter().zip(outcomes).enumerate() {
            let lane = item.lane.clone();
            let held_for = lineup.held_for(lane.as_ref());
            let sent_back = match outcome {
                Err(e) => self.store_refused(item, &e).await,
                Ok(ClaimOutcome::Acquired(lease)) => {
                    match self.reason_not_to_run(&item, held_for, claimed_at) {
                        Some(why) => {
                            self.give_back_unrun(index, item, lease.token, why, live)
                                .await
                        }
                        None => {
                            self.note_takeover(&item, &lease);
                            let (job, lent) = self.lend_to_handler(index, item, lease, live, mode);
                            lineup.push(job, lent);
                            None
                        }
                    }
                }
                Ok(ClaimOutcome::Duplicate(record)) => {
                    self.skip_duplicate(item, record).await;
                    None
                }
                Ok(ClaimOutcome::InFlight { until_ms }) => {
                    Some(self.send_back_in_flight(item, until_ms, held_for).await)
                }
                Ok(ClaimOutcome::PayloadConflict(rec)) => {
                    self.reject_payload_conflict(item, rec).await;
                    None
                }
                Ok(ClaimOutcome::RolledBack(rec)) => {
                    self.reject_rolled_back(item, rec).await;
                    None
                }
            };
            // A message sent back holds its lane for the rest of the batch.
            if let (Some(delay), Some(lane)) = (sent_back, lane) {
                lineup.hold(lane, delay);
            }
        }
        lineup.into_parts()
    }

    /// Whether an acquired key must go back without its handler running, and why.
    fn reason_not_to_run(
        &self,
        item: &Item,
        held_for: Option<Duration>,
        claimed_at: tokio::time::Instant,
    ) -> Option<Unrun> {
        if let Some(delay) = held_for {
            return Some(Unrun::LaneHeld(delay));
        }
        // On our own clock: the store's `until_ms` is on the store's.
        if claimed_at.elapsed() > self.cfg.lease / 2 {
            return Some(Unrun::LateClaim);
        }
        item.delivery.is_stale().then_some(Unrun::Stale)
    }

    /// Gives back an acquired key whose handler will not run in this batch: stops renewing
    /// its lease, releases it, and nacks. Returns the delay when the message holds its lane
    /// from here on (a held lane is held already, and a stale delivery's lane has a new
    /// owner).
    async fn give_back_unrun(
        &self,
        index: usize,
        item: Item,
        token: FencingToken,
        why: Unrun,
        live: &LiveLeases,
    ) -> Option<Duration> {
        let (delay, outcome, holds_lane) = match why {
            Unrun::LaneHeld(delay) => (delay, Outcome::DEFERRED, false),
            Unrun::LateClaim => {
                // The claim sat blocked (a row lock, a slow store) until most of its lease
                // was gone: another worker could take it over mid-handler.
                tracing::warn!(key = %item.key, "claim answered with less than half its lease left; releasing and redelivering");
                (self.cfg.store_backoff, Outcome::STORE_DOWN, true)
            }
            Unrun::Stale => {
                // The source can no longer settle it (partition revoked): its new owner
                // will run it.
                tracing::info!(key = %item.key, "delivery went stale before its handler ran; giving the claim back");
                (self.cfg.redelivery_delay, Outcome::STALE, false)
            }
        };
        live.remove(index);
        self.release(&item.key, token, false).await;
        self.settle_item(item, Settlement::Nack(delay), outcome)
            .await;
        holds_lane.then_some(delay)
    }

    /// Counts and logs a claim that took over an expired lease (a handler cut off or a
    /// worker gone before completing).
    fn note_takeover(&self, item: &Item, lease: &Lease) {
        if lease.takeover {
            self.counters.takeovers.fetch_add(1, Ordering::Relaxed);
            metrics::counter!(m::LEASE_TAKEOVERS, "group" => self.keys.group().as_str().to_string())
                .increment(1);
            tracing::info!(key = %item.key, attempt = lease.attempt, "took over an expired lease");
        }
    }

    /// Builds the handler's job for an acquired key. The envelope is lent to the handler,
    /// not copied, and taken back after it (see `stage_run_and_finish`).
    fn lend_to_handler(
        &self,
        index: usize,
        mut item: Item,
        lease: Lease,
        live: &LiveLeases,
        mode: ClaimMode,
    ) -> (Job, Acquired) {
        let watch = live.watch(index);
        let placeholder = Envelope::new(item.delivery.envelope.broker, "", Bytes::new());
        let envelope = Arc::new(std::mem::replace(&mut item.delivery.envelope, placeholder));
        let msg = ClaimedMessage::new(
            envelope.clone(),
            item.key.clone(),
            lease.token,
            lease.attempt,
            lease.takeover,
            watch,
        )
        .with_retention(self.cfg.retention)
        .with_claim_mode(mode);
        (Job { index, msg }, (item, lease, envelope))
    }

    /// A key completed before: acks the message and its copies after the `on_duplicate`
    /// hook, in a span of its own.
    async fn skip_duplicate(&self, item: Item, record: DedupRecord) {
        let n = 1 + item.followers.len() as u64;
        metrics::counter!(m::DUPLICATES, "topic" => item.delivery.envelope.source.name.clone(), "group" => self.keys.group().as_str().to_string()).increment(n);
        // The duplicate's own trace context: a producer resend carries the
        // original's, so the trace shows the resend next to the first run.
        let span = tracing::info_span!("idemq.duplicate", key = %item.key, traceparent = tracing::field::Empty, first_worker = record.worker.as_deref().unwrap_or("-"), attempts = record.attempts);
        // Reading the header costs a scan per message: only for a span that records.
        if let Some(tp) = (!span.is_disabled())
            .then(|| item.delivery.envelope.traceparent())
            .flatten()
        {
            span.record("traceparent", tp);
        }
        async {
            tracing::debug!("duplicate skipped");
            let hook = self.handler.on_duplicate(&item.delivery.envelope, &record);
            self.call_hook("on_duplicate", hook).await;
        }
        .instrument(span)
        .await;
        self.settle_item(item, Settlement::Ack, Outcome::DUPLICATE)
            .await;
    }

    /// Another worker holds the key: nacks the message to come back about when that lease
    /// ends (never sooner than its lane's hold). Returns the delay it went back with.
    async fn send_back_in_flight(
        &self,
        item: Item,
        until_ms: i64,
        held_for: Option<Duration>,
    ) -> Duration {
        metrics::counter!(m::IN_FLIGHT_CONFLICTS, "group" => self.keys.group().as_str().to_string())
            .increment(1);
        let wait = if super::lease::held_here(&item.key) {
            // Held by another engine of this process: it is usually done within
            // milliseconds, so come back soon, backing off per redelivery.
            let n = item
                .delivery
                .envelope
                .delivery_count
                .unwrap_or(1)
                .clamp(1, 16);
            (MIN_REDELIVERY_DELAY * (1 << (n - 1))).min(self.cfg.in_flight_delay_max)
        } else {
            Duration::from_millis(until_ms.saturating_sub(now_ms()).max(0) as u64)
                .min(self.cfg.in_flight_delay_max)
                .max(MIN_REDELIVERY_DELAY)
        };
        let wait = wait.max(held_for.unwrap_or_default());
        self.settle_item(item, Settlement::Nack(wait), Outcome::IN_FLIGHT)
            .await;
        wait
    }

    /// The key was first seen with another payload: a producer reuses keys, so no retry
    /// can succeed; dead-letters the message.
    async fn reject_payload_conflict(&self, item: Item, rec: DedupRecord) {
        metrics::counter!(m::PAYLOAD_CONFLICTS, "group" => self.keys.group().as_str().to_string())
            .increment(1);
        let reason = format!(
            "payload conflict: key `{}` was first seen with a different payload (status {:?}, attempts {}); fix the producer's key",
            item.key, rec.status, rec.attempts
        );
        tracing::warn!(key = %item.key, "{reason}");
        self.dead_letter(item, reason).await;
    }

    /// A delivery whose key's operation was given up for good (a transactional message's
    /// check-back dropped it and recorded the key rolled back): running it would apply an
    /// effect the rest of the system was told never happened, and acking it unseen would lose
    /// it silently, so it goes to the dead-letter queue with the reason.
    async fn reject_rolled_back(&self, item: Item, rec: DedupRecord) {
        let reason = format!(
            "rolled back: key `{}` was recorded as given up ({}); a new attempt of the operation              needs a new key, or `forget` the record",
            item.key,
            match rec.worker.as_deref() {
                Some(w) => format!("by {w}"),
                None => "by a check-back".to_string(),
            }
        );
        tracing::warn!(key = %item.key, "{reason}");
        self.dead_letter(item, reason).await;
    }
}

impl<H: Handler> IdempotentConsumer<H> {
    /// Runs each lane's jobs one after another (an unordered message is a lane of its own),
    /// on at most `max_concurrency` workers that take lanes from one queue. A job whose lane
    /// had a message sent back is not run.
    ///
    /// The workers are futures polled together on the consumer's task (as
    /// `StreamExt::for_each_concurrent` does), not spawned tasks: handlers wait on I/O
    /// concurrently without a task and a cross-thread wake-up per message. CPU-heavy work in
    /// a handler belongs in `spawn_blocking`; run several consumers for more cores.
    async fn run_lanes(
        &self,
        lanes: Vec<LaneJobs>,
        verdicts: tokio::sync::mpsc::UnboundedSender<(usize, Verdict)>,
    ) {
        let lanes = match self.handler.as_batch() {
            Some(batch) if lanes.len() > 1 || lanes.first().is_some_and(|l| !l.rest.is_empty()) => {
                match self.run_batch_call(batch, lanes, &verdicts).await {
                    Some(lanes) => lanes,
                    None => return,
                }
            }
            _ => lanes,
        };
        let workers = self.cfg.max_concurrency.min(lanes.len());
        let queue = std::sync::Mutex::new(lanes);
        let handler = &*self.handler;
        let limit = self.cfg.handler_timeout;
        let retry = &self.cfg.retry;
        let max_result = self.cfg.max_result_bytes;
        let worker = || async {
            // A send fails only when the finisher is gone, i.e. the batch was dropped.
            let out = |v: (usize, Verdict)| {
                let _ = verdicts.send(v);
            };
            loop {
                // Lanes are taken from the back; their order across lanes is free.
                let next = queue.lock().unwrap_or_else(|p| p.into_inner()).pop();
                let Some(LaneJobs { first, rest }) = next else {
                    break;
                };
                let mut hold: Option<Duration> = None;
                for Job { index, msg } in std::iter::once(first).chain(rest) {
                    if let Some(d) = hold {
                        out((index, Verdict::NotRun(d)));
                        continue;
                    }
                    let attempt = msg.attempt;
                    let span = tracing::info_span!("idemq.handle", broker = %msg.envelope.broker, source = %msg.envelope.source.name, key = %msg.key, attempt, traceparent = tracing::field::Empty);
                    if let Some(tp) = (!span.is_disabled())
                        .then(|| msg.envelope.traceparent())
                        .flatten()
                    {
                        span.record("traceparent", tp);
                    }
                    let res = run_handler(handler, msg, limit).instrument(span).await;
                    let v = verdict(res, attempt, retry, max_result);
                    if let Verdict::Failed(Settlement::Nack(d), _)
                    | Verdict::CutOff(Settlement::Nack(d), _) = &v
                    {
                        hold = Some(*d);
                    }
                    out((index, v));
                }
            }
        };
        futures::future::join_all((0..workers).map(|_| worker())).await;
        // `verdicts` drops here: the finisher ends once it has taken the last one.
    }

    /// Runs a batch handler over every job of the batch in one call (lanes one after
    /// another, each in order). `None` when it succeeded (every job's verdict is sent);
    /// otherwise the lanes come back to be run one message at a time, so that the message
    /// at fault is found and only it is retried or dead-lettered. Every rerun says
    /// `takeover`: a call that was cut off (panic, timeout, lost lease) may have left its
    /// effects half done, and one that returned an error may have committed them — a
    /// transaction whose COMMIT reply was lost reports an error although it committed.
    async fn run_batch_call(
        &self,
        batch: &dyn crate::handler::BatchHandler,
        mut lanes: Vec<LaneJobs>,
        verdicts: &tokio::sync::mpsc::UnboundedSender<(usize, Verdict)>,
    ) -> Option<Vec<LaneJobs>> {
        let jobs = || {
            lanes
                .iter()
                .flat_map(|l| std::iter::once(&l.first).chain(&l.rest))
        };
        let msgs: Vec<ClaimedMessage> = jobs().map(|j| j.msg.clone()).collect();
        let watches: Vec<LeaseWatch> = msgs.iter().map(|m| m.lease.clone()).collect();
        let span = tracing::info_span!("idemq.handle_batch", size = msgs.len());
        let res = run_bounded(
            batch.handle_batch(msgs),
            self.cfg.handler_timeout,
            LeaseWatch::any_lost(&watches),
        )
        .instrument(span)
        .await;
        match res {
            Ok(Ok(())) => {
                for j in jobs() {
                    let _ = verdicts.send((j.index, Verdict::Done(None)));
                }
                return None;
            }
            Ok(Err(e)) => {
                tracing::info!(error = %e, messages = watches.len(), "batch handler failed; running each message alone to isolate the failure (as takeovers: an error does not prove nothing was applied)");
            }
            Err(failure) => {
                tracing::warn!(error = %failure, messages = watches.len(), "batch handler cut off; running each message alone (as takeovers: its effects may be half done)");
            }
        };
        self.counters.batch_splits.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(m::BATCH_SPLITS, "group" => self.keys.group().as_str().to_string())
            .increment(1);
        for l in &mut lanes {
            for j in std::iter::once(&mut l.first).chain(&mut l.rest) {
                j.msg.takeover = true;
            }
        }
        Some(lanes)
    }

    /// Stage 4a: failed handlers give their keys back; the successes go on to completion.
    async fn stage_give_back(
        &self,
        ran: Vec<(Item, Lease, Verdict)>,
        live: &LiveLeases,
    ) -> Vec<(Item, Lease, Completion)> {
        let mut done = Vec::with_capacity(ran.len());
        let in_tx = self.store.claim_mode() == ClaimMode::InEffectTransaction;
        for (item, lease, verdict) in ran {
            match verdict {
                Verdict::Done(_) if live.settled(item.index) == Settled::Duplicate => {
                    // The handler's transaction found the key already recorded.
                    live.remove(item.index);
                    let n = 1 + item.followers.len() as u64;
                    metrics::counter!(m::DUPLICATES, "topic" => item.delivery.envelope.source.name.clone(), "group" => self.keys.group().as_str().to_string()).increment(n);
                    tracing::debug!(key = %item.key, "duplicate found in the effect's transaction");
                    self.settle_item(item, Settlement::Ack, Outcome::DUPLICATE)
                        .await;
                }
                Verdict::Done(_) if live.settled(item.index) == Settled::Completed => {
                    // Completed in the effect's own transaction: durable, nothing to send.
                    self.settle_completed(live, item, CompleteOutcome::Completed)
                        .await;
                }
                Verdict::Done(_) if in_tx => {
                    // Nothing recorded the key: acking would lose its dedup.
                    let why = "the handler returned without recording the key in its transaction (a store that claims in the effect's transaction needs a handler that does)".to_string();
                    tracing::error!(key = %item.key, "{why}");
                    self.give_back(
                        live,
                        item,
                        Some(lease.token),
                        Settlement::Nack(self.cfg.store_backoff),
                    )
                    .await;
                }
                Verdict::Done(result) => {
                    let c = Completion {
                        key: item.key.clone(),
                        token: lease.token,
                        result,
                        retention: self.cfg.retention,
                    };
                    done.push((item, lease, c));
                }
                Verdict::Failed(how, why) => {
                    tracing::warn!(key = %item.key, attempt = lease.attempt, error = %why, "handler failed");
                    self.give_back(live, item, Some(lease.token), how).await;
                }
                Verdict::CutOff(how, why) => {
                    tracing::warn!(key = %item.key, attempt = lease.attempt, error = %why, "handler cut off; its lease is left to expire so the next run is a takeover");
                    // Without a lease there is nothing to expire: the release only counts
                    // the attempt.
                    let token = in_tx.then_some(lease.token);
                    self.give_back(live, item, token, how).await;
                }
                Verdict::NotRun(delay) => {
                    live.remove(item.index);
                    self.release(&item.key, lease.token, false).await;
                    self.settle_item(item, Settlement::Nack(delay), Outcome::DEFERRED)
                        .await;
                }
            }
        }
        done
    }

    /// Stage 4b + 5: complete in round trips bounded by count and bytes, then ack what is
    /// durable. Returns true when the store was unavailable.
    async fn stage_complete(
        &self,
        done: Vec<(Item, Lease, Completion)>,
        live: &LiveLeases,
    ) -> bool {
        let mut store_down = false;
        for chunk in chunk_completions(done, self.cfg.max_batch, MAX_COMPLETION_BYTES) {
            if store_down {
                // The effects happened, but the store stayed down past our patience: no ack.
                for (item, _, _) in chunk {
                    self.not_durable(live, item).await;
                }
                continue;
            }
            store_down = self.complete_chunk(chunk, live).await;
        }
        store_down
    }

    /// Completes one round trip's worth. Returns true when the store was unavailable.
    async fn complete_chunk(
        &self,
        chunk: Vec<(Item, Lease, Completion)>,
        live: &LiveLeases,
    ) -> bool {
        // Split, not cloned: the completions go to the store as one slice, and the items
        // wait beside them in the same order.
        let (held, completions): (Vec<(Item, Lease)>, Vec<Completion>) =
            chunk.into_iter().map(|(i, l, c)| ((i, l), c)).unzip();
        for (item, _) in &held {
            live.completing(item.index);
        }
        // The effects already happened, so a single completion keeps trying (the heartbeat
        // keeps the lease) rather than nack and run them again. A batch tries briefly, then
        // falls back to one key at a time so that one bad completion cannot hold the rest.
        let patience = if held.len() > 1 {
            self.cfg.store_retries_budget()
        } else {
            self.cfg.complete_patience
        };
        let batch = self
            .with_store_retries("complete", patience, || {
                self.store.complete_batch(&completions)
            })
            .await;
        match batch {
            Ok(outs) if outs.len() == held.len() => {
                // Answered: none of these leases needs renewing while the acks go out —
                // except those whose part of the call failed, which are asked again alone.
                let mut unknown = Vec::new();
                for (((item, lease), out), c) in held.into_iter().zip(outs).zip(completions) {
                    match out {
                        CompleteOutcome::Unknown => unknown.push(((item, lease), c)),
                        out => {
                            live.remove(item.index);
                            self.settle_completed(live, item, out).await;
                        }
                    }
                }
                if unknown.is_empty() {
                    return false;
                }
                tracing::warn!(
                    count = unknown.len(),
                    "part of a batch completion failed; completing those keys one at a time"
                );
                let (held, completions): (Vec<(Item, Lease)>, Vec<Completion>) =
                    unknown.into_iter().unzip();
                return self.complete_one_by_one(held, &completions, live).await;
            }
            Ok(outs) => tracing::error!(
                got = outs.len(),
                want = held.len(),
                "store answered a batch completion with the wrong number of outcomes"
            ),
            Err(e) if held.len() == 1 => {
                let Some((item, lease)) = held.into_iter().next() else {
                    return false;
                };
                return self.completion_failed(item, lease, &e, live).await;
            }
            Err(e) => {
                tracing::warn!(error = %e, count = held.len(), "batch completion failed; completing one key at a time")
            }
        }
        self.complete_one_by_one(held, &completions, live).await
    }

    /// The fallback for a batch completion the store did not answer in full: each key on
    /// its own, so one bad completion cannot hold the rest. Once the store stays down the
    /// remaining effects are not acked. Returns true when the store was unavailable.
    async fn complete_one_by_one(
        &self,
        held: Vec<(Item, Lease)>,
        completions: &[Completion],
        live: &LiveLeases,
    ) -> bool {
        let mut store_down = false;
        for ((item, lease), c) in held.into_iter().zip(completions) {
            if store_down {
                self.not_durable(live, item).await;
                continue;
            }
            let one = std::slice::from_ref(c);
            match self
                .with_store_retries("complete", self.cfg.complete_patience, || {
                    self.store.complete_batch(one)
                })
                .await
            {
                Ok(mut outs) if outs.len() == 1 => {
                    if let Some(out) = outs.pop() {
                        self.settle_completed(live, item, out).await;
                    }
                }
                Ok(_) => {
                    let e = StoreError::Backend("completion returned no outcome".into());
                    store_down = self.completion_failed(item, lease, &e, live).await;
                }
                Err(e) => store_down = self.completion_failed(item, lease, &e, live).await,
            }
        }
        store_down
    }

    /// A completion that failed on its own. A store that stays down means no ack (returns
    /// true); a store that refuses this one key gives it the retry policy, like a failed
    /// handler, so it ends in the dead-letter instead of looping.
    async fn completion_failed(
        &self,
        item: Item,
        lease: Lease,
        e: &StoreError,
        live: &LiveLeases,
    ) -> bool {
        if e.is_retryable() {
            tracing::error!(key = %item.key, error = %e, "completion not durable; nacking (the handler may run again)");
            self.not_durable(live, item).await;
            return true;
        }
        let how = retry_or_give_up(
            &self.cfg.retry,
            lease.attempt,
            self.cfg.retry.delay(lease.attempt),
            &format!("the dedup store refused its completion: {e}"),
        );
        tracing::warn!(key = %item.key, error = %e, "completion refused for this key");
        // Its effect ran: the key is not released, so the next run is a takeover and says so.
        self.give_back(live, item, None, how).await;
        false
    }

    /// An effect whose completion the store did not make durable: no ack. Its lease is
    /// left to run out, so the redelivery is a takeover.
    async fn not_durable(&self, live: &LiveLeases, item: Item) {
        live.remove(item.index);
        self.settle_item(
            item,
            Settlement::Nack(self.cfg.store_backoff),
            Outcome::STORE_DOWN,
        )
        .await;
    }

    /// Settles a message the store answered a completion for. Its lease is done with
    /// either way: completed, or fenced (another worker owns the key now).
    async fn settle_completed(&self, live: &LiveLeases, mut item: Item, out: CompleteOutcome) {
        live.remove(item.index);
        match out {
            // Already completed by this token: a completion retried after its reply was
            // lost, or the handler's transaction found its own earlier commit.
            CompleteOutcome::Completed | CompleteOutcome::AlreadyCompleted => {
                let followers = std::mem::take(&mut item.followers);
                self.count(&Outcome::PROCESSED, &item.delivery, 1);
                if !followers.is_empty() {
                    metrics::counter!(m::DUPLICATES, "topic" => item.delivery.envelope.source.name.clone(), "group" => self.keys.group().as_str().to_string()).increment(followers.len() as u64);
                }
                self.settle(item.delivery, Settlement::Ack).await;
                for f in followers {
                    self.count(&Outcome::DUPLICATE, &f, 1);
                    self.settle(f, Settlement::Ack).await;
                }
            }
            CompleteOutcome::Unknown => {
                // Callers retry these before settling; should one get here, no ack.
                self.not_durable(live, item).await;
            }
            CompleteOutcome::Fenced => {
                metrics::counter!(m::FENCED_COMPLETIONS, "group" => self.keys.group().as_str().to_string())
                    .increment(1);
                tracing::warn!(key = %item.key, "completion fenced: the lease was taken over; redelivering");
                self.settle_item(
                    item,
                    Settlement::Nack(self.cfg.redelivery_delay),
                    Outcome::FENCED,
                )
                .await;
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
    /// Returns the delay when the message was sent back.
    async fn store_refused(&self, item: Item, e: &StoreError) -> Option<Duration> {
        match e {
            StoreError::KeyTooLong { .. } | StoreError::Corrupt { .. } => {
                let reason = format!("dedup store refused the key: {e}");
                tracing::warn!(key = %item.key, %reason, "rejecting message");
                self.dead_letter(item, reason).await;
                None
            }
            _ => {
                tracing::warn!(key = %item.key, error = %e, "claim failed; redelivering later");
                let d = self.cfg.store_backoff;
                self.settle_item(item, Settlement::Nack(d), Outcome::STORE_ERROR)
                    .await;
                Some(d)
            }
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
        let mut backoff = self.cfg.store_backoff_policy().waits();
        let mut attempt = 0u32;
        loop {
            match call().await {
                Ok(v) => {
                    self.counters.health.store_ok();
                    return Ok(v);
                }
                Err(e) => {
                    metrics::counter!(m::STORE_ERRORS, "op" => op).increment(1);
                    if e.is_retryable() {
                        self.counters.health.store_failed(op, &e);
                    }
                    attempt += 1;
                    if !e.is_retryable() || started.elapsed() + backoff.peek_nominal() > patience {
                        tracing::error!(op, error = %e, attempt, "dedup store call failed; not acking");
                        return Err(e);
                    }
                    tracing::warn!(op, error = %e, attempt, "dedup store call failed; backing off");
                    tokio::time::sleep(backoff.next_delay()).await;
                }
            }
        }
    }

    /// A failed message: stop heartbeating its key, release it (unless `token` is `None`:
    /// a cut-off handler's key waits out its lease), and reject or nack.
    async fn give_back(
        &self,
        live: &LiveLeases,
        item: Item,
        token: Option<FencingToken>,
        how: Settlement,
    ) {
        live.remove(item.index);
        if let Some(token) = token {
            self.release(&item.key, token, true).await;
        }
        match how {
            Settlement::Reject(reason) => self.dead_letter(item, reason).await,
            other => self.settle_item(item, other, Outcome::RETRIED).await,
        }
    }

    async fn dead_letter(&self, item: Item, reason: String) {
        let hook = self
            .handler
            .on_dead_letter(&item.delivery.envelope, &reason);
        self.call_hook("on_dead_letter", hook).await;
        self.settle_item(item, Settlement::Reject(reason), Outcome::REJECTED)
            .await;
    }

    /// Gives a key back. One whose handler did not run (`ran` false) has its claim's
    /// attempt taken back, so attempts count runs of the handler.
    async fn release(&self, key: &DedupKey, token: FencingToken, ran: bool) {
        let released = match ran {
            true => self.store.release(key, token).await,
            false => self.store.release_unrun(key, token).await,
        };
        // Best effort: if it fails the lease simply expires and the key is taken over (a
        // takeover counts an attempt: it cannot know whether the handler ran).
        if let Err(e) = released {
            metrics::counter!(m::STORE_ERRORS, "op" => "release").increment(1);
            tracing::warn!(%key, error = %e, "release failed; the key frees up when its lease ends");
        }
    }

    fn count(&self, outcome: &Outcome, d: &Delivery, n: u64) {
        (outcome.counter)(&self.counters).fetch_add(n, Ordering::Relaxed);
        self.counters
            .unflushed
            .add(d.envelope.broker, outcome.index, n);
    }

    /// Settles a message and its in-batch copies the same way.
    async fn settle_item(&self, item: Item, how: Settlement, outcome: Outcome) {
        self.count(&outcome, &item.delivery, 1 + item.followers.len() as u64);
        for f in item.followers {
            self.settle(f, how.clone()).await;
        }
        self.settle(item.delivery, how).await;
    }

    async fn settle(&self, d: Delivery, how: Settlement) {
        let broker = d.envelope.broker.as_str();
        let what = how.as_str();
        if let Err(e) = d.settle(how).await {
            // The broker will redeliver; the dedup record makes that harmless.
            self.counters
                .settle_failures
                .fetch_add(1, Ordering::Relaxed);
            metrics::counter!(m::SETTLE_FAILURES, "broker" => broker, "settlement" => what)
                .increment(1);
            tracing::warn!(broker, error = %e, settlement = what, "settling a delivery failed");
        }
    }
}

/// Which counter and metric label an outcome feeds.
struct Outcome {
    label: &'static str,
    /// Its place in [`Outcome::ALL`].
    index: usize,
    counter: fn(&super::Counters) -> &AtomicU64,
}

impl Outcome {
    const ALL: [Outcome; super::OUTCOME_KINDS] = [
        Self::PROCESSED,
        Self::DUPLICATE,
        Self::IN_FLIGHT,
        Self::RETRIED,
        Self::REJECTED,
        Self::FENCED,
        Self::STORE_DOWN,
        Self::STORE_ERROR,
        Self::DEFERRED,
        Self::STALE,
    ];
    const PROCESSED: Outcome = Outcome {
        index: 0,
        label: m::outcome::PROCESSED,
        counter: |c| &c.processed,
    };
    const DUPLICATE: Outcome = Outcome {
        index: 1,
        label: m::outcome::DUPLICATE,
        counter: |c| &c.duplicates,
    };
    const IN_FLIGHT: Outcome = Outcome {
        index: 2,
        label: m::outcome::IN_FLIGHT,
        counter: |c| &c.in_flight,
    };
    const RETRIED: Outcome = Outcome {
        index: 3,
        label: m::outcome::RETRIED,
        counter: |c| &c.retried,
    };
    const REJECTED: Outcome = Outcome {
        index: 4,
        label: m::outcome::REJECTED,
        counter: |c| &c.rejected,
    };
    const FENCED: Outcome = Outcome {
        index: 5,
        label: m::outcome::FENCED,
        counter: |c| &c.fenced,
    };
    const STORE_DOWN: Outcome = Outcome {
        index: 6,
        label: m::outcome::STORE_UNAVAILABLE,
        counter: |c| &c.store_unavailable,
    };
    const STORE_ERROR: Outcome = Outcome {
        index: 7,
        label: m::outcome::STORE_ERROR,
        counter: |c| &c.store_unavailable,
    };
    const DEFERRED: Outcome = Outcome {
        index: 8,
        label: m::outcome::DEFERRED,
        counter: |c| &c.deferred,
    };
    const STALE: Outcome = Outcome {
        index: 9,
        label: m::outcome::STALE,
        counter: |c| &c.stale,
    };
}

/// Runs one handler under its timeout and its lease.
async fn run_handler<H: Handler>(
    handler: &H,
    msg: ClaimedMessage,
    limit: Option<Duration>,
) -> Result<HandlerResult, HandlerFailure> {
    let lease: LeaseWatch = msg.lease.clone();
    run_bounded(handler.handle(msg), limit, lease.lost()).await
}

/// Runs a handler call (one message or a batch) caught if it panics, cut off after
/// `limit`, and cancelled when `lost` resolves (a lease of the call was lost).
async fn run_bounded<T>(
    call: impl Future<Output = T>,
    limit: Option<Duration>,
    lost: impl Future<Output = ()>,
) -> Result<T, HandlerFailure> {
    let work = AssertUnwindSafe(call).catch_unwind();
    let panicked = |p: Box<dyn std::any::Any + Send>| {
        HandlerFailure::Panicked(super::panic_message(p.as_ref()))
    };
    let bounded = async {
        match limit {
            Some(t) => match tokio::time::timeout(t, work).await {
                Ok(r) => r.map_err(panicked),
                Err(_) => Err(HandlerFailure::TimedOut(t)),
            },
            None => work.await.map_err(panicked),
        }
    };
    tokio::select! {
        r = bounded => r,
        _ = lost => Err(HandlerFailure::LeaseLost),
    }
}

/// What a handler's result means for its message.
fn verdict(
    res: Result<HandlerResult, HandlerFailure>,
    attempt: u32,
    retry: &RetryPolicy,
    max_result: usize,
) -> Verdict {
    match res {
        Ok(Ok(Some(r))) if r.len() > max_result => {
            let why = format!(
                "handler returned a {}-byte result, over max_result_bytes ({max_result}): store a reference, not the document",
                r.len()
            );
            Verdict::Failed(Settlement::Reject(why.clone()), why)
        }
        Ok(Ok(r)) => Verdict::Done(r),
        Ok(Err(HandlerError::Permanent(e))) => {
            let why = format!("handler failed permanently: {e}");
            Verdict::Failed(Settlement::Reject(why.clone()), why)
        }
        Ok(Err(HandlerError::RetryAfter { delay, source })) => {
            let why = source.to_string();
            Verdict::Failed(retry_or_give_up(retry, attempt, delay, &why), why)
        }
        Ok(Err(e)) => {
            let why = e.to_string();
            Verdict::Failed(
                retry_or_give_up(retry, attempt, retry.delay(attempt), &why),
                why,
            )
        }
        Err(failure) => {
            let why = failure.to_string();
            Verdict::CutOff(
                retry_or_give_up(retry, attempt, retry.delay(attempt), &why),
                why,
            )
        }
    }
}

/// Nack after `delay`, or dead-letter once the policy's attempts are used up.
fn retry_or_give_up(retry: &RetryPolicy, attempt: u32, delay: Duration, why: &str) -> Settlement {
    if retry.exhausted(attempt) {
        Settlement::Reject(format!(
            "gave up after {attempt} attempts (retry.max_attempts); last failure: {why}"
        ))
    } else {
        Settlement::Nack(delay.max(MIN_REDELIVERY_DELAY))
    }
}

/// Splits completions into round trips of at most `max_count` items and `max_bytes` of
/// keys and results (a single larger item still goes alone).
fn chunk_completions(
    done: Vec<(Item, Lease, Completion)>,
    max_count: usize,
    max_bytes: usize,
) -> Vec<Vec<(Item, Lease, Completion)>> {
    let mut chunks = Vec::new();
    let mut cur: Vec<(Item, Lease, Completion)> = Vec::new();
    let mut bytes = 0usize;
    for entry in done {
        let size = entry.2.key.as_str().len() + entry.2.result.as_ref().map_or(0, |r| r.len());
        if !cur.is_empty() && (cur.len() >= max_count.max(1) || bytes + size > max_bytes) {
            chunks.push(std::mem::take(&mut cur));
            bytes = 0;
        }
        bytes += size;
        cur.push(entry);
    }
    if !cur.is_empty() {
        chunks.push(cur);
    }
    chunks
}
