//! Storms over a store while a disruption (a restart, a leader killed) hits its server:
//!
//! - [`storm`]: a stream of keys delivered like a broker would (redelivered until
//!   acknowledged) by workers that claim and complete; then the checks every such test
//!   makes: no key lost, none completed twice, no handler run twice, every acknowledged key
//!   completed in the store.
//! - [`engine_storm`]: the same through the whole engine: `IdempotentConsumer`s drain a
//!   memory broker that duplicates publishes and loses acks, and the handler counts its
//!   effects in a ledger outside the store.

use crate::{ClaimOutcome, ClaimRequest, CompleteOutcome, DedupKey, DedupStore, StoreError};
use std::collections::VecDeque;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const LEASE: Duration = Duration::from_secs(2);
const RETAIN: Duration = Duration::from_secs(3600);

#[derive(Default, Clone, Copy, Debug)]
struct Tally {
    handler_runs: usize,
    commits: usize,
    ambiguous_completes: usize,
    duplicate_acks: usize,
    acked_at: Option<Instant>,
}

#[derive(Default)]
struct Stats {
    ops: AtomicUsize,
    errors: AtomicUsize,
    in_flight: AtomicUsize,
    fenced: AtomicUsize,
    done: AtomicUsize,
    /// (issued, answered) of every answered store call.
    successes: Mutex<Vec<(Instant, Instant)>>,
    first_error: Mutex<Option<String>>,
}

impl Stats {
    fn ok(&self, issued: Instant) {
        self.ops.fetch_add(1, Ordering::Relaxed);
        self.successes
            .lock()
            .unwrap()
            .push((issued, Instant::now()));
    }
    fn err(&self, e: &crate::StoreError) {
        assert!(e.is_retryable(), "unexpected non-retryable error: {e}");
        self.errors.fetch_add(1, Ordering::Relaxed);
        self.first_error
            .lock()
            .unwrap()
            .get_or_insert_with(|| e.to_string());
    }
}

async fn backoff() {
    tokio::time::sleep(Duration::from_millis(25)).await;
}

/// What a storm measured.
#[derive(Debug)]
pub struct Report {
    /// Keys delivered (each acknowledged exactly once).
    pub keys: usize,
    /// Store calls answered (claims and completions).
    pub ops: usize,
    /// Store errors met (all retryable, all retried).
    pub errors: usize,
    /// Of them, from the disruption on.
    pub errors_during: usize,
    /// The first of them.
    pub first_error: Option<String>,
    /// Claims answered InFlight (a claim whose reply was lost waits for its lease).
    pub in_flight_waits: usize,
    /// Completions answered Fenced (redelivered).
    pub fenced: usize,
    /// Handler runs beyond one per key (must be 0).
    pub reruns: usize,
    /// From the disruption's start to the first answer of a store call issued after the
    /// disruption was done (the server killed or restarted): the time to recover.
    pub recovered_after: Duration,
    /// The longest time without any answered store call, from the disruption on.
    pub longest_stall: Duration,
    /// Keys acknowledged before the disruption was over.
    pub acked_before_disruption_done: usize,
}

/// Delivers `key` until it is acknowledged, like a broker redelivering an unacked message.
async fn deliver(
    store: &dyn DedupStore,
    key: &DedupKey,
    tally: &Mutex<Vec<Tally>>,
    i: usize,
    stats: &Stats,
) {
    let req = ClaimRequest::new(key.clone(), LEASE).with_worker("storm");
    loop {
        let issued = Instant::now();
        match store.claim(&req).await {
            Err(e) => {
                // Store down: no ack, back off, redeliver. Never "skip".
                stats.err(&e);
                backoff().await;
            }
            Ok(ClaimOutcome::InFlight { .. }) => {
                stats.ok(issued);
                // A claim whose reply was lost: its lease must run out first.
                stats.in_flight.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Ok(ClaimOutcome::PayloadConflict(r)) => panic!("no payload hashes here: {r:?}"),
            Ok(ClaimOutcome::RolledBack(r)) => panic!("nothing is rolled back here: {r:?}"),
            Ok(ClaimOutcome::Duplicate(_)) => {
                stats.ok(issued);
                let mut t = tally.lock().unwrap();
                assert!(
                    t[i].commits + t[i].ambiguous_completes > 0,
                    "{key} answered Duplicate but no completion of it was ever attempted"
                );
                t[i].duplicate_acks += 1;
                t[i].acked_at = Some(Instant::now());
                return;
            }
            Ok(ClaimOutcome::Acquired(lease)) => {
                stats.ok(issued);
                tally.lock().unwrap()[i].handler_runs += 1;
                // Complete with the same token until the store answers.
                loop {
                    let issued = Instant::now();
                    match store
                        .complete(key, lease.token, Some("done".into()), RETAIN)
                        .await
                    {
                        Ok(CompleteOutcome::Completed | CompleteOutcome::AlreadyCompleted) => {
                            stats.ok(issued);
                            let mut t = tally.lock().unwrap();
                            t[i].commits += 1;
                            t[i].acked_at = Some(Instant::now());
                            return;
                        }
                        Ok(CompleteOutcome::Fenced) => {
                            stats.ok(issued);
                            stats.fenced.fetch_add(1, Ordering::Relaxed);
                            break;
                        }
                        Ok(CompleteOutcome::Unknown) => {
                            // A single completion answers or fails; counted as a failure.
                            stats.err(&StoreError::Backend("unknown outcome".into()));
                            tally.lock().unwrap()[i].ambiguous_completes += 1;
                            backoff().await;
                        }
                        Err(e) => {
                            stats.err(&e);
                            tally.lock().unwrap()[i].ambiguous_completes += 1;
                            backoff().await;
                        }
                    }
                }
            }
        }
    }
}

/// (time to recover, longest stall): see [`Report`].
fn recovery(
    successes: &[(Instant, Instant)],
    from: Instant,
    done: Instant,
) -> (Duration, Duration) {
    let recovered = successes
        .iter()
        .filter(|(issued, _)| *issued >= done)
        .map(|(_, answered)| answered.duration_since(from))
        .min()
        .unwrap_or(Duration::MAX);
    let mut after: Vec<Instant> = successes
        .iter()
        .map(|(_, a)| *a)
        .filter(|t| *t >= from)
        .collect();
    after.sort();
    let mut longest = after
        .first()
        .map_or(Duration::MAX, |t| t.duration_since(from));
    for w in after.windows(2) {
        longest = longest.max(w[1].duration_since(w[0]));
    }
    (recovered, longest)
}

/// Runs `n` keys through `workers` workers over `stores`; once `n / 3` keys are done,
/// runs `disrupt` (a blocking kill or restart), then checks the outcome.
pub async fn storm<F, Fut>(
    stores: &[Arc<dyn DedupStore>],
    group: &str,
    n: usize,
    workers: usize,
    disrupt: F,
) -> Report
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = ()>,
{
    let g = crate::ConsumerGroup::new(group).unwrap();
    let keys: Arc<Vec<DedupKey>> = Arc::new(
        (0..n)
            .map(|i| DedupKey::new(&g, &format!("m-{i}")).unwrap())
            .collect(),
    );
    let queue = Arc::new(Mutex::new((0..n).collect::<VecDeque<usize>>()));
    let tally = Arc::new(Mutex::new(vec![Tally::default(); n]));
    let stats = Arc::new(Stats::default());
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for w in 0..workers {
        let store = stores[w % stores.len()].clone();
        let (keys, queue, tally, stats, stop) = (
            keys.clone(),
            queue.clone(),
            tally.clone(),
            stats.clone(),
            stop.clone(),
        );
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let Some(i) = queue.lock().unwrap().pop_front() else {
                    break;
                };
                deliver(store.as_ref(), &keys[i], &tally, i, &stats).await;
                stats.done.fetch_add(1, Ordering::Relaxed);
                // Pace the stream so the disruption lands in the middle of it.
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }));
    }
    let t0 = Instant::now();
    while stats.done.load(Ordering::Relaxed) < n / 3 {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "workers made no progress"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let errors_before = stats.errors.load(Ordering::Relaxed);
    let disrupted_at = Instant::now();
    disrupt().await;
    let disruption_done = Instant::now();

    let deadline = Instant::now() + Duration::from_secs(180);
    for t in tasks {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, t).await {
            Ok(r) => r.expect("worker panicked"),
            Err(_) => {
                stop.store(true, Ordering::Relaxed);
                panic!(
                    "workers did not finish: {} of {n} done",
                    stats.done.load(Ordering::Relaxed)
                );
            }
        }
    }

    let tally = tally.lock().unwrap().clone();
    let acked_before_disruption_done = tally
        .iter()
        .filter(|t| t.acked_at.is_some_and(|a| a < disruption_done))
        .count();
    let mut runs = 0;
    for (i, t) in tally.iter().enumerate() {
        let acks = t.commits + t.duplicate_acks;
        assert_eq!(acks, 1, "key m-{i} acknowledged {acks} times: {t:?}");
        assert!(t.commits <= 1, "key m-{i} completed twice: {t:?}");
        assert_eq!(t.handler_runs, 1, "key m-{i} processed twice: {t:?}");
        runs += t.handler_runs;
    }
    let errors = stats.errors.load(Ordering::Relaxed);
    let errors_during = errors - errors_before;
    // Every acknowledged key is completed in the store after the disruption.
    let check = stores[0].clone();
    for (i, k) in keys.iter().enumerate() {
        let rec = loop {
            match check.get(k).await {
                Ok(r) => break r,
                Err(e) if e.is_retryable() => backoff().await,
                Err(e) => panic!("get m-{i}: {e}"),
            }
        };
        let rec = rec.unwrap_or_else(|| panic!("acknowledged key m-{i} lost"));
        assert_eq!(rec.status, crate::RecordStatus::Completed, "m-{i}");
    }
    let (recovered_after, longest_stall) = recovery(
        &stats.successes.lock().unwrap(),
        disrupted_at,
        disruption_done,
    );
    let first_error = stats.first_error.lock().unwrap().clone();
    Report {
        keys: n,
        ops: stats.ops.load(Ordering::Relaxed),
        errors,
        errors_during,
        first_error,
        in_flight_waits: stats.in_flight.load(Ordering::Relaxed),
        fenced: stats.fenced.load(Ordering::Relaxed),
        reruns: runs - n,
        recovered_after,
        longest_stall,
        acked_before_disruption_done,
    }
}

/// Settings of [`engine_storm`]'s consumers: leases longer than an election or a
/// promotion plus the rejoin of the killed node, short store back-off, and completions that
/// wait out a long outage (a completion given up would mean a redelivery, not a loss).
fn engine_storm_config() -> crate::ConsumerConfig {
    crate::ConsumerConfig {
        max_batch: 64,
        max_concurrency: 64,
        lease: Duration::from_secs(20),
        retry: crate::engine::RetryPolicy::fixed(Duration::from_millis(20)),
        in_flight_delay_max: Duration::from_millis(500),
        store_backoff: Duration::from_millis(50),
        store_backoff_max: Duration::from_millis(500),
        complete_patience: Duration::from_secs(120),
        ..crate::ConsumerConfig::default()
    }
}

type Ledger = Arc<Mutex<std::collections::HashMap<String, u32>>>;

/// What the disruption of an [`engine_storm`] sees and does.
#[derive(Clone)]
pub struct StormProgress {
    ledger: Ledger,
    hit: Arc<tokio::sync::watch::Sender<bool>>,
}

impl StormProgress {
    /// Keys whose effect happened so far.
    pub fn effects(&self) -> usize {
        self.ledger.lock().unwrap().len()
    }

    /// Says the server was hit: the handlers held past the first third go on. Call it right
    /// after the kill, so the storm meets the outage with work in flight (unheld, a fast run
    /// could drain the stream before the kill lands). The storm calls it when the disruption
    /// returns, if the disruption did not.
    pub fn hit(&self) {
        self.hit.send_replace(true);
    }
}

/// What an [`engine_storm`] measured.
#[derive(Debug)]
pub struct EngineReport {
    /// Keys published (each once, plus the broker's duplicates).
    pub keys: usize,
    /// Messages the broker delivered into the stream, duplicates included.
    pub published: u64,
    /// Effects beyond one per key.
    pub double_effects: u32,
    /// Keys whose effect never happened.
    pub lost: usize,
    /// Times a consumer's health went from ready to unavailable: the outage as the
    /// consumers saw it, whether or not their store retries rode it out.
    pub outages: u64,
    /// Messages given back because the store did not answer.
    pub store_unavailable: u64,
    /// Expired leases taken over.
    pub takeovers: u64,
    /// Deliveries answered as duplicates.
    pub duplicates: u64,
    /// Completions refused because the lease had passed to another consumer.
    pub fenced: u64,
    /// From the consumers' start to the end of the last one.
    pub total: Duration,
}

impl std::fmt::Display for EngineReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "keys={} published={} total={:?} outages={} store_unavailable={} takeovers={} \
             fenced={} duplicates={} double_effects={} lost={}",
            self.keys,
            self.published,
            self.total,
            self.outages,
            self.store_unavailable,
            self.takeovers,
            self.fenced,
            self.duplicates,
            self.double_effects,
            self.lost
        )
    }
}

/// Runs `n` payments through one `IdempotentConsumer` per store (each store its own
/// connection; settings for a failover: 20 s leases, completions patient for 120 s), on a memory broker that duplicates 30 % of publishes and loses 5 % of acks;
/// once a third of the effects happened, handlers wait and `disrupt` runs (it kills or
/// restarts the server and calls [`StormProgress::hit`] once the server is down); then every
/// consumer drains the stream and the effects are counted. Asserts nothing: the caller
/// decides what its store guarantees (`double_effects == 0` needs replicated writes).
pub async fn engine_storm<F, Fut, T>(
    stores: &[Arc<dyn DedupStore>],
    prefix: &str,
    n: usize,
    disrupt: F,
) -> (EngineReport, T)
where
    F: FnOnce(StormProgress) -> Fut,
    Fut: Future<Output = T>,
{
    use crate::broker::{Faults, MemoryBroker};
    use crate::{
        BrokerKind, ClaimedMessage, Envelope, HandlerError, IdempotentConsumer, KeyStrategy,
    };
    let broker = MemoryBroker::with_seed(17);
    broker.set_faults(Faults {
        lost_ack_rate: 0.05,
        duplicate_publish_rate: 0.3,
    });
    for i in 0..n {
        broker.publish(Envelope::new(
            BrokerKind::MEMORY,
            "payments",
            format!(r#"{{"payment_id":"p{i}"}}"#),
        ));
    }
    let ledger: Ledger = Arc::default();
    let (hit, held) = tokio::sync::watch::channel(false);
    let progress = StormProgress {
        ledger: ledger.clone(),
        hit: Arc::new(hit),
    };
    let group = format!("fo-{prefix}");
    let config = engine_storm_config();
    let consumers: Vec<_> = stores
        .iter()
        .map(|store| {
            let (ledger, held) = (ledger.clone(), held.clone());
            IdempotentConsumer::new(
                store.clone(),
                KeyStrategy::json_pointer(&group, "/payment_id").unwrap(),
                move |m: ClaimedMessage| {
                    let (ledger, mut held) = (ledger.clone(), held.clone());
                    async move {
                        if ledger.lock().unwrap().len() >= n / 3 {
                            // Err only once the storm is gone: nothing to wait for then.
                            let _ = held.wait_for(|hit| *hit).await;
                        }
                        let id = m.key.as_str().to_owned();
                        *ledger.lock().unwrap().entry(id).or_default() += 1;
                        Ok::<_, HandlerError>(None)
                    }
                },
            )
            .with_config(config.clone())
        })
        .collect();
    let started = Instant::now();
    let tasks: Vec<_> = consumers
        .iter()
        .map(|c| {
            let (c, mut src) = (c.clone(), broker.subscribe());
            tokio::spawn(async move { c.run_until_idle(&mut src).await.unwrap() })
        })
        .collect();
    while progress.effects() < n / 3 {
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "no progress: {} effects of {n}",
            progress.effects()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let disrupted = disrupt(progress.clone()).await;
    progress.hit();
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(300), t)
            .await
            .expect("the storm ends")
            .expect("consumer task");
    }
    let total = started.elapsed();
    let counts = ledger.lock().unwrap().clone();
    let mut report = EngineReport {
        keys: n,
        published: broker.published(),
        double_effects: counts.values().map(|c| c.saturating_sub(1)).sum(),
        lost: (0..n)
            .filter(|i| !counts.contains_key(&format!("{group}:p{i}")))
            .count(),
        outages: 0,
        store_unavailable: 0,
        takeovers: 0,
        duplicates: 0,
        fenced: 0,
        total,
    };
    for c in &consumers {
        let s = c.stats();
        report.outages += c.health().report().outages;
        report.store_unavailable += s.store_unavailable;
        report.takeovers += s.takeovers;
        report.duplicates += s.duplicates;
        report.fenced += s.fenced;
    }
    (report, disrupted)
}
