//! The readiness a consumer reports while its store or its broker is down, and after.

use async_trait::async_trait;
use idemq_core::broker::MemoryBroker;
use idemq_core::{
    BrokerKind, ClaimOutcome, ClaimRequest, ClaimedMessage, CompleteOutcome, Completion,
    ConsumerConfig, DedupKey, DedupRecord, DedupStore, Delivery, Envelope, ExtendOutcome,
    FencingToken, HandlerError, HealthState, IdempotentConsumer, KeyStrategy, MemoryStore,
    ReleaseOutcome, RetryPolicy, Source, SourceError, StoreError,
};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The memory store behind a switch: while `down`, every call is `Unavailable`.
#[derive(Default)]
struct SwitchedStore {
    inner: MemoryStore,
    down: AtomicBool,
}

impl SwitchedStore {
    fn check(&self) -> Result<(), StoreError> {
        if self.down.load(Ordering::SeqCst) {
            Err(StoreError::Unavailable(
                "connect to 127.0.0.1:5432: connection refused".into(),
            ))
        } else {
            Ok(())
        }
    }
}

#[async_trait]
impl DedupStore for SwitchedStore {
    async fn claim_batch(&self, reqs: &[ClaimRequest]) -> Result<Vec<ClaimOutcome>, StoreError> {
        self.check()?;
        self.inner.claim_batch(reqs).await
    }
    async fn complete_batch(&self, cs: &[Completion]) -> Result<Vec<CompleteOutcome>, StoreError> {
        self.check()?;
        self.inner.complete_batch(cs).await
    }
    async fn release(&self, k: &DedupKey, t: FencingToken) -> Result<ReleaseOutcome, StoreError> {
        self.check()?;
        self.inner.release(k, t).await
    }
    async fn extend(
        &self,
        k: &DedupKey,
        t: FencingToken,
        l: Duration,
    ) -> Result<ExtendOutcome, StoreError> {
        self.check()?;
        self.inner.extend(k, t, l).await
    }
    async fn get(&self, k: &DedupKey) -> Result<Option<DedupRecord>, StoreError> {
        self.check()?;
        self.inner.get(k).await
    }
    async fn purge_expired(&self, limit: usize) -> Result<u64, StoreError> {
        self.check()?;
        self.inner.purge_expired(limit).await
    }
    async fn list_stuck(
        &self,
        older_than: Duration,
        limit: usize,
    ) -> Result<Vec<DedupRecord>, StoreError> {
        self.check()?;
        self.inner.list_stuck(older_than, limit).await
    }
    async fn forget(&self, k: &DedupKey) -> Result<bool, StoreError> {
        self.check()?;
        self.inner.forget(k).await
    }
}

/// The memory broker's subscription, waiting when empty (as a real consumer does) instead
/// of ending, and failing its polls while `down`.
struct SwitchedSource {
    inner: idemq_core::broker::MemorySource,
    down: Arc<AtomicBool>,
}

#[async_trait]
impl Source for SwitchedSource {
    async fn poll(&mut self, max: usize) -> Result<Option<Vec<Delivery>>, SourceError> {
        loop {
            if self.down.load(Ordering::SeqCst) {
                return Err(SourceError::Disconnected(
                    "broker 127.0.0.1:9092: connection refused".into(),
                ));
            }
            match self.inner.poll(max).await? {
                Some(batch) if !batch.is_empty() => return Ok(Some(batch)),
                _ => tokio::time::sleep(Duration::from_millis(5)).await,
            }
        }
    }
}

fn config() -> ConsumerConfig {
    ConsumerConfig {
        lease: Duration::from_secs(5),
        retry: RetryPolicy::fixed(Duration::from_millis(5)),
        store_backoff: Duration::from_millis(10),
        store_backoff_max: Duration::from_millis(40),
        complete_patience: Duration::from_millis(50),
        ..ConsumerConfig::default()
    }
}

fn payment(i: u32) -> Envelope {
    Envelope::new(BrokerKind::MEMORY, "payments", format!("{{\"n\":{i}}}"))
        .with_header("x-idempotency-key", format!("pay-{i}"))
}

async fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting: {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn a_store_outage_is_unready_acks_nothing_and_recovers_without_loss() {
    let broker = MemoryBroker::new();
    let store = Arc::new(SwitchedStore::default());
    let effects = Arc::new(AtomicU32::new(0));
    let seen = effects.clone();
    let consumer = IdempotentConsumer::new(
        store.clone(),
        KeyStrategy::header("billing", "x-idempotency-key").expect("keys"),
        move |_m: ClaimedMessage| {
            let seen = seen.clone();
            async move {
                seen.fetch_add(1, Ordering::SeqCst);
                Ok::<_, HandlerError>(None)
            }
        },
    )
    .with_config(config());
    let health = consumer.health();
    assert_eq!(health.report().state, HealthState::Starting);

    let mut source = SwitchedSource {
        inner: broker.subscribe(),
        down: Arc::default(),
    };
    let stop = Arc::new(tokio::sync::Notify::new());
    let stopped = stop.clone();
    let run = tokio::spawn(async move { consumer.run(&mut source, stopped.notified()).await });

    for i in 0..5 {
        broker.publish(payment(i));
    }
    wait_for("5 effects", || effects.load(Ordering::SeqCst) == 5).await;
    wait_for("ready", || health.is_ready()).await;
    assert_eq!(health.report().outages, 0);

    // The store goes down; new payments arrive.
    store.down.store(true, Ordering::SeqCst);
    let acked_before = broker.acked();
    for i in 5..10 {
        broker.publish(payment(i));
    }
    wait_for("store unavailable", || {
        health.report().state == HealthState::StoreUnavailable
    })
    .await;
    let report = health.report();
    assert!(!report.is_ready());
    let error = report.last_error.expect("the reason is reported");
    assert!(error.contains("connection refused"), "{error}");
    assert!(error.contains("dedup store"), "{error}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        broker.acked(),
        acked_before,
        "nothing acked while the store is down"
    );
    assert_eq!(
        effects.load(Ordering::SeqCst),
        5,
        "no handler ran unclaimed"
    );
    assert_eq!(
        health.report().state,
        HealthState::StoreUnavailable,
        "still unready while it stays down"
    );

    // It comes back: ready again, and every payment applied once.
    store.down.store(false, Ordering::SeqCst);
    wait_for("10 effects", || effects.load(Ordering::SeqCst) == 10).await;
    wait_for("ready again", || health.is_ready()).await;
    let report = health.report();
    assert_eq!(report.outages, 1);
    assert_eq!(report.last_error, None);

    stop.notify_one();
    run.await.expect("join").expect("run");
    assert_eq!(health.report().state, HealthState::Stopped);
    assert_eq!(effects.load(Ordering::SeqCst), 10, "each payment once");
}

#[tokio::test]
async fn a_failing_poll_is_broker_unavailable_until_a_poll_succeeds() {
    let broker = MemoryBroker::new();
    let consumer = IdempotentConsumer::new(
        Arc::new(MemoryStore::new()),
        KeyStrategy::header("billing", "x-idempotency-key").expect("keys"),
        |_m: ClaimedMessage| async { Ok::<_, HandlerError>(None) },
    )
    .with_config(config());
    let health = consumer.health();
    let down = Arc::new(AtomicBool::new(true));
    let mut source = SwitchedSource {
        inner: broker.subscribe(),
        down: down.clone(),
    };
    let stop = Arc::new(tokio::sync::Notify::new());
    let stopped = stop.clone();
    let run = tokio::spawn(async move { consumer.run(&mut source, stopped.notified()).await });

    wait_for("broker unavailable", || {
        health.report().state == HealthState::BrokerUnavailable
    })
    .await;
    let error = health.report().last_error.expect("reason");
    assert!(error.contains("127.0.0.1:9092"), "{error}");

    down.store(false, Ordering::SeqCst);
    broker.publish(payment(1));
    wait_for("ready", || health.is_ready()).await;
    wait_for("acked", || broker.acked() == 1).await;
    stop.notify_one();
    run.await.expect("join").expect("run");
    assert_eq!(health.report().state, HealthState::Stopped);
}

/// Counts of `idemq_key_errors_total` by `reason`, from a recorder installed once for this
/// test binary (the other tests' metrics land there too; only this counter is read).
fn key_errors(reason: &str) -> u64 {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
    use std::sync::OnceLock;
    static SNAPSHOTTER: OnceLock<Snapshotter> = OnceLock::new();
    let snapshotter = SNAPSHOTTER.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder
            .install()
            .expect("the only recorder of this test binary");
        snapshotter
    });
    snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(key, _, _, _)| {
            key.key().name() == idemq_core::metrics::KEY_ERRORS
                && key
                    .key()
                    .labels()
                    .any(|l| l.key() == "reason" && l.value() == reason)
        })
        .map(|(_, _, _, value)| match value {
            DebugValue::Counter(n) => n,
            _ => 0,
        })
        .sum()
}

#[tokio::test]
async fn messages_the_key_strategy_cannot_read_turn_the_consumer_degraded_with_a_reason() {
    key_errors("missing_field");
    let broker = MemoryBroker::new();
    let consumer = IdempotentConsumer::new(
        Arc::new(MemoryStore::new()),
        KeyStrategy::json_pointer("billing", "/payment_id").expect("keys"),
        |_m: ClaimedMessage| async { Ok::<_, HandlerError>(None) },
    )
    .with_config(config());
    let health = consumer.health();
    let mut source = SwitchedSource {
        inner: broker.subscribe(),
        down: Arc::default(),
    };
    let stop = Arc::new(tokio::sync::Notify::new());
    let stopped = stop.clone();
    let run = tokio::spawn(async move { consumer.run(&mut source, stopped.notified()).await });

    // The producers send `id`, the strategy reads `payment_id`.
    for i in 0..idemq_core::engine::KEYLESS_RUN {
        broker.publish(Envelope::new(
            BrokerKind::MEMORY,
            "payments",
            format!("{{\"id\":{i}}}"),
        ));
    }
    wait_for("degraded", || {
        health.report().state == HealthState::Degraded
    })
    .await;
    let report = health.report();
    assert!(!report.is_ready());
    let reason = report.last_error.expect("a reason");
    assert!(
        reason.contains("/payment_id") && reason.contains("dead-lettered"),
        "{reason}"
    );
    assert_eq!(
        broker.dead_letters().len() as u64,
        idemq_core::engine::KEYLESS_RUN
    );
    assert!(key_errors("missing_field") >= idemq_core::engine::KEYLESS_RUN);

    // One message with the key: ready again.
    broker.publish(Envelope::new(
        BrokerKind::MEMORY,
        "payments",
        r#"{"payment_id":"p-1"}"#,
    ));
    wait_for("ready", || health.is_ready()).await;
    assert_eq!(health.report().last_error, None);
    stop.notify_one();
    run.await.expect("join").expect("run");
}

/// A source that polls fine but says it cannot deliver what its broker holds (a window
/// filled behind a held message, no partitions assigned): the consumer is not ready, and
/// says why, read from the source when the report is made.
#[tokio::test]
async fn a_source_that_says_it_is_waiting_makes_the_consumer_not_ready() {
    struct WaitingSource {
        inner: SwitchedSource,
        waiting: Arc<AtomicBool>,
    }
    #[async_trait]
    impl Source for WaitingSource {
        async fn poll(&mut self, max: usize) -> Result<Option<Vec<Delivery>>, SourceError> {
            self.inner.poll(max).await
        }
        fn readiness(&self) -> idemq_core::source::ReadinessProbe {
            let waiting = self.waiting.clone();
            idemq_core::source::ReadinessProbe::new(move || {
                if waiting.load(Ordering::SeqCst) {
                    idemq_core::source::Readiness::Waiting(
                        "the server's window is full behind a held message on subject a".into(),
                    )
                } else {
                    idemq_core::source::Readiness::Ready("subscribed".into())
                }
            })
        }
    }
    let broker = MemoryBroker::new();
    let consumer = IdempotentConsumer::new(
        Arc::new(MemoryStore::new()),
        KeyStrategy::header("billing", "x-idempotency-key").expect("keys"),
        |_m: ClaimedMessage| async { Ok::<_, HandlerError>(None) },
    )
    .with_config(config());
    let health = consumer.health();
    let waiting = Arc::new(AtomicBool::new(false));
    let mut source = WaitingSource {
        inner: SwitchedSource {
            inner: broker.subscribe(),
            down: Arc::default(),
        },
        waiting: waiting.clone(),
    };
    let stop = Arc::new(tokio::sync::Notify::new());
    let stopped = stop.clone();
    let run = tokio::spawn(async move { consumer.run(&mut source, stopped.notified()).await });
    broker.publish(payment(1));
    wait_for("acked", || broker.acked() == 1).await;
    wait_for("ready", || health.is_ready()).await;
    waiting.store(true, Ordering::SeqCst);
    let report = health.report();
    assert_eq!(report.state, HealthState::SourceWaiting);
    let why = report.last_error.expect("what it waits for");
    assert!(why.contains("window is full"), "{why}");
    waiting.store(false, Ordering::SeqCst);
    assert!(health.is_ready());
    stop.notify_one();
    run.await.expect("join").expect("run");
    assert_eq!(health.report().state, HealthState::Stopped);
}
