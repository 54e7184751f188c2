//! Ordering, the retry policy, isolated completions and lost leases, over the in-memory
//! broker and store.

use async_trait::async_trait;
use idemq_core::broker::MemoryBroker;
use idemq_core::{
    BrokerKind, Bytes, ClaimOutcome, ClaimRequest, ClaimedMessage, CompleteOutcome, Completion,
    ConsumerConfig, DedupKey, DedupRecord, DedupStore, DeliveryOrder, Envelope, ExtendOutcome,
    FencingToken, HandlerError, IdempotentConsumer, KeyStrategy, MemoryStore, ReleaseOutcome,
    RetryPolicy, StoreError,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

fn quick() -> ConsumerConfig {
    ConsumerConfig {
        max_batch: 100,
        max_concurrency: 16,
        lease: Duration::from_secs(5),
        retry: RetryPolicy::fixed(Duration::from_millis(5)),
        in_flight_delay_max: Duration::from_millis(100),
        store_backoff: Duration::from_millis(10),
        store_backoff_max: Duration::from_millis(50),
        ..ConsumerConfig::default()
    }
}

fn keys() -> KeyStrategy {
    KeyStrategy::header("orders", "x-idempotency-key").expect("strategy")
}

/// A deterministic ~7% failure of first attempts, spread over keys.
fn flaky(key: &str, attempt: u32) -> bool {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    key.hash(&mut h);
    attempt == 1 && h.finish() % 100 < 7
}

async fn versions_apply_in_order(mode: DeliveryOrder) {
    const ENTITIES: u32 = 1000;
    const VERSIONS: u32 = 10;
    let broker = MemoryBroker::new();
    broker.set_ordering(mode);
    // Blocks of 10 entities × all their versions: a batch of 100 holds several versions of
    // one key (the engine's lanes order them), and later batches depend on earlier ones (the
    // broker's lanes hold them while a version waits for its retry).
    for block in 0..ENTITIES / 10 {
        for v in 0..VERSIONS {
            for e in block * 10..block * 10 + 10 {
                broker.publish(
                    Envelope::new(BrokerKind::MEMORY, "stock", format!("{v}"))
                        .with_partition((e % 8) as i32)
                        .with_ordering_key(format!("entity-{e}"))
                        .with_header("x-idempotency-key", format!("entity-{e}-v{v}")),
                );
            }
        }
    }
    let applied: Arc<Mutex<HashMap<String, Vec<u32>>>> = Arc::default();
    let failures = Arc::new(AtomicU32::new(0));
    let (seen, failed) = (applied.clone(), failures.clone());
    let consumer = IdempotentConsumer::new(
        Arc::new(MemoryStore::new()),
        keys(),
        move |m: ClaimedMessage| {
            let (seen, failed) = (seen.clone(), failed.clone());
            async move {
                if flaky(m.key.as_str(), m.attempt) {
                    failed.fetch_add(1, Ordering::Relaxed);
                    return Err(HandlerError::retryable("injected failure"));
                }
                let entity =
                    String::from_utf8_lossy(m.envelope.ordering_key.as_deref().unwrap_or_default())
                        .to_string();
                let v: u32 = std::str::from_utf8(&m.envelope.payload)
                    .ok()
                    .and_then(|s| s.parse().ok())
                    .unwrap_or(u32::MAX);
                // Yield so that concurrently running handlers really interleave.
                tokio::task::yield_now().await;
                seen.lock()
                    .expect("lock")
                    .entry(entity)
                    .or_default()
                    .push(v);
                Ok(None)
            }
        },
    )
    .with_config(ConsumerConfig {
        ordering: mode,
        ..quick()
    });
    let mut src = broker.subscribe();
    tokio::time::timeout(Duration::from_secs(120), consumer.run_until_idle(&mut src))
        .await
        .expect("finishes")
        .expect("run");
    let applied = applied.lock().expect("lock");
    assert_eq!(applied.len(), ENTITIES as usize);
    let want: Vec<u32> = (0..VERSIONS).collect();
    for (entity, versions) in applied.iter() {
        assert_eq!(
            versions, &want,
            "{entity}: versions applied out of order or not once ({mode:?})"
        );
    }
    assert!(
        failures.load(Ordering::Relaxed) > 100,
        "the test must inject failures"
    );
    assert!(
        consumer.stats().deferred > 0,
        "failures must hold later versions back"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn per_key_order_holds_for_1000_keys_x_10_versions_with_failures() {
    versions_apply_in_order(DeliveryOrder::PerKey).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn per_partition_order_holds_for_1000_keys_x_10_versions_with_failures() {
    versions_apply_in_order(DeliveryOrder::PerPartition).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_message_that_always_fails_is_dead_lettered_after_max_attempts_and_the_rest_flow() {
    let broker = MemoryBroker::new();
    broker.publish(
        Envelope::new(BrokerKind::MEMORY, "orders", "poison")
            .with_header("x-idempotency-key", "poison"),
    );
    for i in 0..50 {
        broker.publish(
            Envelope::new(BrokerKind::MEMORY, "orders", "ok")
                .with_header("x-idempotency-key", format!("ok-{i}")),
        );
    }
    let attempts = Arc::new(AtomicU32::new(0));
    let done = Arc::new(AtomicU32::new(0));
    let dead_hook: Arc<Mutex<Vec<String>>> = Arc::default();
    struct H {
        attempts: Arc<AtomicU32>,
        done: Arc<AtomicU32>,
        dead: Arc<Mutex<Vec<String>>>,
    }
    #[async_trait]
    impl idemq_core::Handler for H {
        async fn handle(&self, m: ClaimedMessage) -> idemq_core::HandlerResult {
            if &m.envelope.payload[..] == b"poison" {
                self.attempts.fetch_add(1, Ordering::SeqCst);
                return Err(HandlerError::retryable("downstream says 500"));
            }
            self.done.fetch_add(1, Ordering::SeqCst);
            Ok(None)
        }
        async fn on_dead_letter(&self, _e: &Envelope, reason: &str) {
            self.dead.lock().expect("lock").push(reason.to_string());
        }
    }
    let consumer = IdempotentConsumer::new(
        Arc::new(MemoryStore::new()),
        keys(),
        H {
            attempts: attempts.clone(),
            done: done.clone(),
            dead: dead_hook.clone(),
        },
    )
    .with_config(ConsumerConfig {
        retry: RetryPolicy {
            initial_delay: Duration::from_millis(5),
            max_delay: Duration::from_millis(40),
            multiplier: 2.0,
            jitter: 0.2,
            max_attempts: Some(4),
        },
        ..quick()
    });
    let mut src = broker.subscribe();
    tokio::time::timeout(Duration::from_secs(30), consumer.run_until_idle(&mut src))
        .await
        .expect("a poison message must not keep the consumer busy forever")
        .expect("run");
    assert_eq!(
        attempts.load(Ordering::SeqCst),
        4,
        "exactly max_attempts runs"
    );
    assert_eq!(
        done.load(Ordering::SeqCst),
        50,
        "the messages behind it flow"
    );
    let dead = broker.dead_letters();
    assert_eq!(dead.len(), 1);
    assert!(
        dead[0].reason.contains("gave up after 4 attempts"),
        "{}",
        dead[0].reason
    );
    assert!(
        dead[0].reason.contains("downstream says 500"),
        "{}",
        dead[0].reason
    );
    assert_eq!(
        dead_hook.lock().expect("lock").as_slice(),
        [dead[0].reason.clone()]
    );
}

async fn run_with_poison_completion(poison_alone: bool) -> (HashMap<String, u32>, MemoryBroker) {
    let broker = MemoryBroker::new();
    for k in ["a", "b", "poison", "c", "d"] {
        broker.publish(
            Envelope::new(BrokerKind::MEMORY, "orders", k).with_header("x-idempotency-key", k),
        );
    }
    let runs: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
    let seen = runs.clone();
    let consumer = IdempotentConsumer::new(
        Arc::new(Faulty {
            poison_completions: Some(poison_alone),
            ..Faulty::default()
        }),
        keys(),
        move |m: ClaimedMessage| {
            let seen = seen.clone();
            async move {
                *seen
                    .lock()
                    .expect("lock")
                    .entry(m.key.to_string())
                    .or_default() += 1;
                Ok(None)
            }
        },
    )
    .with_config(ConsumerConfig {
        retry: RetryPolicy::fixed(Duration::from_millis(5)).with_max_attempts(3),
        // A refused completion's key waits out its lease (its effect ran: the retry is a
        // takeover), so keep the lease short.
        lease: Duration::from_millis(300),
        ..quick()
    });
    let mut src = broker.subscribe();
    tokio::time::timeout(Duration::from_secs(20), consumer.run_until_idle(&mut src))
        .await
        .expect("one bad completion must not keep the batch looping")
        .expect("run");
    let runs = runs.lock().expect("lock").clone();
    (runs, broker)
}

#[tokio::test]
async fn one_bad_completion_does_not_rerun_the_rest_of_the_batch() {
    let (runs, broker) = run_with_poison_completion(false).await;
    for k in ["a", "b", "poison", "c", "d"] {
        assert_eq!(
            runs.get(&format!("orders:{k}")),
            Some(&1),
            "{k} ran {:?} times",
            runs.get(&format!("orders:{k}"))
        );
    }
    assert!(broker.dead_letters().is_empty());
    assert_eq!(broker.pending(), 0);
}

#[tokio::test]
async fn a_completion_the_store_always_refuses_is_dead_lettered_after_max_attempts() {
    let (runs, broker) = run_with_poison_completion(true).await;
    for k in ["a", "b", "c", "d"] {
        assert_eq!(
            runs.get(&format!("orders:{k}")),
            Some(&1),
            "{k} must run once"
        );
    }
    assert_eq!(
        runs.get("orders:poison"),
        Some(&3),
        "the refused key gets the retry policy"
    );
    let dead = broker.dead_letters();
    assert_eq!(dead.len(), 1);
    assert!(
        dead[0].reason.contains("refused its completion"),
        "{}",
        dead[0].reason
    );
}

/// A handler of 1.5 s on a 400 ms lease whose heartbeats meet `store`'s fault: returns (times
/// the first attempt's lease watch fired, effects applied).
async fn slow_handler_under_heartbeat_fault(
    store: Faulty,
    heartbeat_timeout: Duration,
) -> (u32, u32) {
    let broker = MemoryBroker::new();
    broker.publish(
        Envelope::new(BrokerKind::MEMORY, "orders", "slow")
            .with_header("x-idempotency-key", "slow"),
    );
    let effects = Arc::new(AtomicU32::new(0));
    let told = Arc::new(AtomicU32::new(0));
    let (e2, t2) = (effects.clone(), told.clone());
    let consumer = IdempotentConsumer::new(Arc::new(store), keys(), move |m: ClaimedMessage| {
        let (effects, told) = (e2.clone(), t2.clone());
        async move {
            if m.attempt == 1 {
                let lease = m.lease.clone();
                let watcher = tokio::spawn(async move {
                    lease.lost().await;
                    told.fetch_add(1, Ordering::SeqCst);
                });
                tokio::time::sleep(Duration::from_millis(1500)).await;
                watcher.abort();
            }
            effects.fetch_add(1, Ordering::SeqCst);
            Ok(None)
        }
    })
    .with_config(ConsumerConfig {
        lease: Duration::from_millis(400),
        heartbeat: Some(Duration::from_millis(100)),
        heartbeat_timeout,
        ..quick()
    });
    let mut src = broker.subscribe();
    tokio::time::timeout(Duration::from_secs(20), consumer.run_until_idle(&mut src))
        .await
        .expect("finishes")
        .expect("run");
    (told.load(Ordering::SeqCst), effects.load(Ordering::SeqCst))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_whose_lease_runs_out_is_told_and_cancelled_before_its_effect() {
    // Longer than the lease; heartbeats fail meanwhile.
    let store = Faulty {
        extends_fail: true,
        ..Faulty::default()
    };
    let (told, effects) =
        slow_handler_under_heartbeat_fault(store, ConsumerConfig::default().heartbeat_timeout)
            .await;
    assert_eq!(told, 1, "the handler's lease watch must fire");
    assert_eq!(
        effects, 1,
        "the first attempt is cut off before its effect; the retry applies it once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_are_split_by_bytes_as_well_as_count() {
    // 64 results of 60 KiB (under max_result_bytes) are 3.8 MiB: more than one round trip
    // may carry (1 MiB), fewer than the batch's count limit.
    let broker = MemoryBroker::new();
    for i in 0..64 {
        broker.publish(
            Envelope::new(BrokerKind::MEMORY, "orders", format!("o-{i}"))
                .with_header("x-idempotency-key", format!("o-{i}")),
        );
    }
    let store = Arc::new(Faulty::default());
    let consumer =
        IdempotentConsumer::new(store.clone(), keys(), |_m: ClaimedMessage| async move {
            Ok::<_, HandlerError>(Some(Bytes::from(vec![b'r'; 60 * 1024])))
        })
        .with_config(ConsumerConfig {
            max_batch: 64,
            ..quick()
        });
    let mut src = broker.subscribe();
    tokio::time::timeout(Duration::from_secs(20), consumer.run_until_idle(&mut src))
        .await
        .expect("finishes")
        .expect("run");
    assert_eq!(consumer.stats().processed, 64);
    let calls = store.completion_calls.lock().expect("calls").clone();
    assert_eq!(calls.iter().map(|(n, _)| n).sum::<usize>(), 64, "{calls:?}");
    assert!(
        calls.iter().all(|(_, bytes)| *bytes <= 1 << 20),
        "no round trip carries more than 1 MiB: {calls:?}"
    );
    assert!(
        calls.len() >= 4,
        "3.8 MiB needs at least 4 round trips: {calls:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heartbeat_hanging_on_the_store_does_not_delay_the_lease_watch() {
    // The heartbeat's own bound (60 s) is far past the handler: only a watch on its own
    // timer cuts the first attempt off before its effect.
    let store = Faulty {
        extends_hang: true,
        ..Faulty::default()
    };
    let (told, effects) = slow_handler_under_heartbeat_fault(store, Duration::from_secs(60)).await;
    assert_eq!(told, 1, "the lease watch fires while the heartbeat hangs");
    assert_eq!(
        effects, 1,
        "the first attempt is cut off before its effect; the retry applies it"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_heartbeat_marks_the_lease_lost_and_cuts_the_handler_off() {
    let store = Faulty {
        extends_fenced: true,
        ..Faulty::default()
    };
    let (told, effects) = slow_handler_under_heartbeat_fault(store, Duration::from_secs(5)).await;
    assert_eq!(told, 1, "a Fenced heartbeat is a lost lease");
    assert_eq!(
        effects, 1,
        "the fenced attempt is cut off before its effect"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_timeout_the_redelivery_says_takeover_and_after_a_clean_failure_it_does_not() {
    let broker = MemoryBroker::new();
    for k in ["timed-out", "failed-cleanly"] {
        broker.publish(
            Envelope::new(BrokerKind::MEMORY, "orders", k).with_header("x-idempotency-key", k),
        );
    }
    let seen: Arc<Mutex<Vec<(String, u32, bool)>>> = Arc::default();
    let s2 = seen.clone();
    let consumer = IdempotentConsumer::new(
        Arc::new(MemoryStore::new()),
        keys(),
        move |m: ClaimedMessage| {
            let seen = s2.clone();
            async move {
                let k = String::from_utf8_lossy(&m.envelope.payload).to_string();
                seen.lock()
                    .expect("lock")
                    .push((k.clone(), m.attempt, m.takeover));
                if m.attempt == 1 {
                    if k == "timed-out" {
                        // Cut off mid-effect by the handler timeout.
                        tokio::time::sleep(Duration::from_secs(5)).await;
                    } else {
                        return Err(HandlerError::retryable("clean failure, nothing done"));
                    }
                }
                Ok(None)
            }
        },
    )
    .with_config(ConsumerConfig {
        lease: Duration::from_millis(400),
        handler_timeout: Some(Duration::from_millis(100)),
        ..quick()
    });
    let mut src = broker.subscribe();
    tokio::time::timeout(Duration::from_secs(20), consumer.run_until_idle(&mut src))
        .await
        .expect("finishes")
        .expect("run");
    let seen = seen.lock().expect("lock").clone();
    let second = |k: &str| {
        seen.iter()
            .find(|(key, a, _)| key == k && *a == 2)
            .map(|(_, _, t)| *t)
    };
    assert_eq!(
        second("timed-out"),
        Some(true),
        "a cut-off attempt may have half-done effects: the retry must say takeover ({seen:?})"
    );
    assert_eq!(
        second("failed-cleanly"),
        Some(false),
        "a clean failure released the key: no takeover ({seen:?})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_times_leases_on_its_own_clock_not_the_stores() {
    let broker = MemoryBroker::new();
    for i in 0..20 {
        broker.publish(
            Envelope::new(BrokerKind::MEMORY, "orders", "x")
                .with_header("x-idempotency-key", format!("skew-{i}")),
        );
    }
    let effects = Arc::new(AtomicU32::new(0));
    let e2 = effects.clone();
    let consumer = IdempotentConsumer::new(
        Arc::new(Faulty {
            clock_behind_ms: HOUR_MS,
            ..Faulty::default()
        }),
        keys(),
        move |_m: ClaimedMessage| {
            let effects = e2.clone();
            async move {
                // Outlives a heartbeat: the lease watch must not fire on a skewed clock.
                tokio::time::sleep(Duration::from_millis(250)).await;
                effects.fetch_add(1, Ordering::SeqCst);
                Ok(None)
            }
        },
    )
    .with_config(ConsumerConfig {
        lease: Duration::from_millis(600),
        heartbeat: Some(Duration::from_millis(100)),
        ..quick()
    });
    let mut src = broker.subscribe();
    tokio::time::timeout(Duration::from_secs(20), consumer.run_until_idle(&mut src))
        .await
        .expect("a store an hour behind must not stall the consumer")
        .expect("run");
    assert_eq!(effects.load(Ordering::SeqCst), 20);
    let stats = consumer.stats();
    assert_eq!(stats.processed, 20);
    assert_eq!(
        stats.store_unavailable + stats.retried,
        0,
        "no claim given back for a skewed lease end: {stats:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finished_handler_is_completed_without_waiting_for_the_rest_of_its_batch() {
    let broker = MemoryBroker::new();
    for k in ["fast", "slow"] {
        broker.publish(
            Envelope::new(BrokerKind::MEMORY, "orders", k).with_header("x-idempotency-key", k),
        );
    }
    let store = Arc::new(MemoryStore::new());
    let effects: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
    let slow_blocks = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let make = || {
        let (effects, slow_blocks) = (effects.clone(), slow_blocks.clone());
        IdempotentConsumer::new(store.clone(), keys(), move |m: ClaimedMessage| {
            let (effects, slow_blocks) = (effects.clone(), slow_blocks.clone());
            async move {
                let k = String::from_utf8_lossy(&m.envelope.payload).to_string();
                if k == "slow" && slow_blocks.load(Ordering::SeqCst) {
                    std::future::pending::<()>().await;
                }
                *effects.lock().expect("lock").entry(k).or_default() += 1;
                Ok(None)
            }
        })
        .with_config(ConsumerConfig {
            lease: Duration::from_millis(300),
            ..quick()
        })
    };
    let first = make();
    let mut src = broker.subscribe();
    let running = tokio::spawn(async move {
        let _ = first.run_until_idle(&mut src).await;
    });
    // "fast" has made its effect while "slow" still runs in the same batch: the process dies.
    while effects.lock().expect("lock").get("fast").is_none() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    running.abort();
    let _ = running.await;
    slow_blocks.store(false, Ordering::SeqCst);
    let second = make();
    let mut src = broker.subscribe();
    tokio::time::timeout(Duration::from_secs(20), second.run_until_idle(&mut src))
        .await
        .expect("finishes")
        .expect("run");
    let effects = effects.lock().expect("lock").clone();
    assert_eq!(
        effects.get("fast"),
        Some(&1),
        "the finished effect was completed at once, not re-run after the crash: {effects:?}"
    );
    assert_eq!(effects.get("slow"), Some(&1));
}

const HOUR_MS: i64 = 3_600_000;

/// The memory store with the faults these scenarios need, one knob each.
#[derive(Default)]
struct Faulty {
    inner: MemoryStore,
    /// A batch completion holding the poison key fails; `Some(true)`: alone too.
    poison_completions: Option<bool>,
    /// Every heartbeat fails (the lease runs out while a handler works).
    extends_fail: bool,
    /// Every heartbeat hangs: the store never answers it.
    extends_hang: bool,
    /// Every heartbeat answers `Fenced` (another worker took the key over).
    extends_fenced: bool,
    /// (completions, bytes of keys and results) of every `complete_batch` call.
    completion_calls: std::sync::Mutex<Vec<(usize, usize)>>,
    /// The store's clock runs this far behind ours: every lease end it reports is earlier.
    clock_behind_ms: i64,
}

fn is_poison(c: &Completion) -> bool {
    c.key.as_str().ends_with(":poison")
}

#[async_trait]
impl DedupStore for Faulty {
    async fn claim_batch(&self, reqs: &[ClaimRequest]) -> Result<Vec<ClaimOutcome>, StoreError> {
        let outs = self.inner.claim_batch(reqs).await?;
        Ok(outs
            .into_iter()
            .map(|o| match o {
                ClaimOutcome::Acquired(mut l) => {
                    l.until_ms -= self.clock_behind_ms;
                    ClaimOutcome::Acquired(l)
                }
                other => other,
            })
            .collect())
    }
    async fn complete_batch(&self, cs: &[Completion]) -> Result<Vec<CompleteOutcome>, StoreError> {
        let bytes = cs
            .iter()
            .map(|c| c.key.as_str().len() + c.result.as_ref().map_or(0, |r| r.len()))
            .sum();
        if let Ok(mut calls) = self.completion_calls.lock() {
            calls.push((cs.len(), bytes));
        }
        if let Some(alone) = self.poison_completions {
            if cs.iter().any(is_poison) && (cs.len() > 1 || alone) {
                return Err(StoreError::Backend(
                    "value too long for column `result`".into(),
                ));
            }
        }
        self.inner.complete_batch(cs).await
    }
    async fn release(&self, k: &DedupKey, t: FencingToken) -> Result<ReleaseOutcome, StoreError> {
        self.inner.release(k, t).await
    }
    async fn extend(
        &self,
        k: &DedupKey,
        t: FencingToken,
        l: Duration,
    ) -> Result<ExtendOutcome, StoreError> {
        if self.extends_fail {
            return Err(StoreError::Unavailable("connection reset".into()));
        }
        if self.extends_hang {
            return std::future::pending().await;
        }
        if self.extends_fenced {
            return Ok(ExtendOutcome::Fenced);
        }
        Ok(match self.inner.extend(k, t, l).await? {
            ExtendOutcome::Extended { until_ms } => ExtendOutcome::Extended {
                until_ms: until_ms - self.clock_behind_ms,
            },
            other => other,
        })
    }
    async fn get(&self, k: &DedupKey) -> Result<Option<DedupRecord>, StoreError> {
        self.inner.get(k).await
    }
    async fn purge_expired(&self, limit: usize) -> Result<u64, StoreError> {
        self.inner.purge_expired(limit).await
    }
    async fn list_stuck(
        &self,
        older_than: Duration,
        limit: usize,
    ) -> Result<Vec<DedupRecord>, StoreError> {
        self.inner.list_stuck(older_than, limit).await
    }
    async fn forget(&self, k: &DedupKey) -> Result<bool, StoreError> {
        self.inner.forget(k).await
    }
}

/// The memory broker's subscription, but waiting when it is empty (as a broker's consumer
/// does) instead of ending, and counting commits ([`Source::after_batch`]).
struct WaitingSource {
    inner: idemq_core::broker::MemorySource,
    commits: Arc<AtomicU32>,
}

#[async_trait]
impl idemq_core::Source for WaitingSource {
    async fn poll(
        &mut self,
        max: usize,
    ) -> Result<Option<Vec<idemq_core::Delivery>>, idemq_core::SourceError> {
        match self.inner.poll(max).await? {
            Some(batch) if !batch.is_empty() => Ok(Some(batch)),
            _ => std::future::pending().await,
        }
    }
    async fn after_batch(&mut self) -> Result<(), idemq_core::SourceError> {
        self.commits.fetch_add(1, Ordering::SeqCst);
        self.inner.after_batch().await
    }
}

fn waiting_source(messages: usize) -> (MemoryBroker, WaitingSource, Arc<AtomicU32>) {
    let broker = MemoryBroker::new();
    for i in 0..messages {
        broker.publish(Envelope::new(BrokerKind::MEMORY, "t", format!("m{i}")));
    }
    let commits = Arc::new(AtomicU32::new(0));
    let source = WaitingSource {
        inner: broker.subscribe(),
        commits: commits.clone(),
    };
    (broker, source, commits)
}

const NO_BACKOFF: idemq_core::RetryPolicy = idemq_core::RetryPolicy {
    initial_delay: Duration::from_millis(1),
    max_delay: Duration::from_millis(1),
    multiplier: 1.0,
    jitter: 0.0,
    max_attempts: None,
};

#[tokio::test]
async fn a_pipelined_loop_runs_two_batches_at_once_and_commits_each() {
    use idemq_core::engine::drive_source_pipelined;
    let (_broker, mut source, commits) = waiting_source(4);
    // Each batch waits until both are in progress: one batch at a time would never finish.
    let both_started = Arc::new(tokio::sync::Barrier::new(2));
    let acked = Arc::new(AtomicU32::new(0));
    let stop = Arc::new(tokio::sync::Notify::new());
    let run = drive_source_pipelined(&mut source, 2, 2, NO_BACKOFF, stop.notified(), |batch| {
        let (both_started, acked, stop) = (both_started.clone(), acked.clone(), stop.clone());
        async move {
            both_started.wait().await;
            for d in batch {
                d.ack().await.expect("ack");
                if acked.fetch_add(1, Ordering::SeqCst) + 1 == 4 {
                    stop.notify_one();
                }
            }
            false
        }
    });
    tokio::time::timeout(Duration::from_secs(10), run)
        .await
        .expect("two batches ran at once")
        .expect("loop");
    assert_eq!(acked.load(Ordering::SeqCst), 4);
    assert_eq!(
        commits.load(Ordering::SeqCst),
        2,
        "one commit per finished batch"
    );
}

#[tokio::test]
async fn a_finished_batch_is_committed_while_the_poll_waits_for_more() {
    use idemq_core::engine::drive_source_pipelined;
    let (_broker, mut source, commits) = waiting_source(3);
    let watched = commits.clone();
    // Shut down only once the commit happened: the source has nothing more, so a loop that
    // commits only after its next poll would never get there.
    let committed = async move {
        while watched.load(Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    let run = drive_source_pipelined(&mut source, 10, 4, NO_BACKOFF, committed, |batch| async {
        for d in batch {
            d.ack().await.expect("ack");
        }
        false
    });
    tokio::time::timeout(Duration::from_secs(10), run)
        .await
        .expect("committed without a new message")
        .expect("loop");
    assert_eq!(commits.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn shutdown_finishes_and_commits_the_batches_in_progress() {
    use idemq_core::engine::drive_source_pipelined;
    let (_broker, mut source, commits) = waiting_source(6);
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let started = Arc::new(AtomicU32::new(0));
    let acked = Arc::new(AtomicU32::new(0));
    let (g, s) = (gate.clone(), started.clone());
    // Shutdown comes while two batches are held at the gate; the gate opens after it.
    let shutdown = async move {
        while s.load(Ordering::SeqCst) < 2 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        g.add_permits(2);
    };
    let run = drive_source_pipelined(&mut source, 3, 2, NO_BACKOFF, shutdown, |batch| {
        let (gate, started, acked) = (gate.clone(), started.clone(), acked.clone());
        async move {
            started.fetch_add(1, Ordering::SeqCst);
            let _permit = gate.acquire().await.expect("gate");
            for d in batch {
                d.ack().await.expect("ack");
                acked.fetch_add(1, Ordering::SeqCst);
            }
            false
        }
    });
    tokio::time::timeout(Duration::from_secs(10), run)
        .await
        .expect("shutdown returned")
        .expect("loop");
    assert_eq!(
        started.load(Ordering::SeqCst),
        2,
        "no batch started after shutdown"
    );
    assert_eq!(
        acked.load(Ordering::SeqCst),
        6,
        "both batches finished, none abandoned"
    );
    assert_eq!(commits.load(Ordering::SeqCst), 2);
}
