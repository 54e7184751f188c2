//! Engine scenarios over the in-memory broker and store.

use idemq_core::adapter::SettleRecorder;
use idemq_core::broker::{Faults, MemoryBroker};
use idemq_core::Settlement;
use idemq_core::{
    BrokerKind, ClaimedMessage, ConsumerConfig, DedupSlot, DedupStore, Envelope, HandlerError,
    IdempotentConsumer, KeyStrategy, MemoryStore,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

type Effects = Arc<Mutex<HashMap<String, u32>>>;

fn payment(id: &str) -> Envelope {
    Envelope::new(
        BrokerKind::MEMORY,
        "payments",
        format!(r#"{{"payment_id":"{id}","amount":10}}"#),
    )
}

fn keys() -> KeyStrategy {
    KeyStrategy::json_pointer("billing", "/payment_id").expect("valid strategy")
}

fn fast() -> ConsumerConfig {
    ConsumerConfig {
        max_batch: 16,
        lease: Duration::from_millis(500),
        retry: idemq_core::engine::RetryPolicy::fixed(Duration::from_millis(20)),
        in_flight_delay_max: Duration::from_millis(100),
        store_backoff: Duration::from_millis(10),
        store_backoff_max: Duration::from_millis(50),
        store_retries: 1,
        ..ConsumerConfig::default()
    }
}

/// A handler that records each effect by payment id.
fn recording(
    effects: Effects,
) -> impl Fn(
    ClaimedMessage,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = idemq_core::HandlerResult> + Send>>
       + Send
       + Sync
       + 'static {
    move |m: ClaimedMessage| {
        let effects = effects.clone();
        Box::pin(async move {
            let id = m.key.as_str().to_string();
            *effects.lock().expect("lock").entry(id).or_default() += 1;
            Ok(None)
        })
    }
}

/// A broker (seeded) holding `n` payments published with 30% producer duplicates, losing
/// `lost_ack_rate` of acks; and how many duplicate copies it holds.
fn faulty_payments(seed: u64, lost_ack_rate: f64, n: usize) -> (MemoryBroker, u64) {
    let broker = MemoryBroker::with_seed(seed);
    broker.set_faults(Faults {
        lost_ack_rate,
        duplicate_publish_rate: 0.3,
    });
    for i in 0..n {
        broker.publish(payment(&format!("p{i}")));
    }
    let copies = broker.published() - n as u64;
    (broker, copies)
}

fn counts(e: &Effects) -> HashMap<String, u32> {
    e.lock().expect("lock").clone()
}

/// Each of the `n` payments applied exactly once, every producer copy skipped as a
/// duplicate, nothing left on the broker or dead-lettered.
fn each_applied_once(
    effects: &Effects,
    st: &idemq_core::ConsumerStats,
    broker: &MemoryBroker,
    n: usize,
    copies: u64,
) {
    let e = counts(effects);
    assert_eq!(e.len(), n, "every payment applied (none lost)");
    assert!(e.values().all(|&k| k == 1), "no payment applied twice");
    assert_eq!(st.processed, n as u64, "{st:?}");
    assert!(
        st.duplicates >= copies,
        "producer duplicates skipped: {st:?}"
    );
    assert_eq!(broker.pending(), 0);
    assert!(broker.dead_letters().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn producer_duplicates_and_lost_acks_change_the_world_once_across_two_consumers() {
    let (broker, copies) = faulty_payments(7, 0.2, 300);
    assert!(
        copies > 50,
        "the broker injected producer duplicates ({copies})"
    );
    let store: Arc<dyn DedupStore> = Arc::new(MemoryStore::new());
    let effects: Effects = Arc::default();
    let c = IdempotentConsumer::new(store, keys(), recording(effects.clone())).with_config(fast());
    let (c1, c2) = (c.clone(), c.clone());
    let (mut s1, mut s2) = (broker.subscribe(), broker.subscribe());
    let a = tokio::spawn(async move { c1.run_until_idle(&mut s1).await });
    let b = tokio::spawn(async move { c2.run_until_idle(&mut s2).await });
    a.await.expect("join").expect("run");
    b.await.expect("join").expect("run");
    each_applied_once(&effects, &c.stats(), &broker, 300, copies);
}

#[tokio::test]
async fn a_message_without_a_key_is_dead_lettered_with_the_reason_and_not_processed() {
    let broker = MemoryBroker::new();
    broker.publish(Envelope::new(
        BrokerKind::MEMORY,
        "payments",
        "{\"amount\":1}",
    ));
    broker.publish(Envelope::new(
        BrokerKind::MEMORY,
        "payments",
        "not json at all",
    ));
    broker.publish(payment("ok"));
    let effects: Effects = Arc::default();
    let c = IdempotentConsumer::new(
        Arc::new(MemoryStore::new()),
        keys(),
        recording(effects.clone()),
    )
    .with_config(fast());
    c.run_until_idle(&mut broker.subscribe())
        .await
        .expect("run");
    let dead = broker.dead_letters();
    assert_eq!(
        dead.len(),
        2,
        "both keyless messages kept in the dead-letter queue"
    );
    assert!(dead[0].reason.contains("/payment_id"), "{}", dead[0].reason);
    assert!(
        dead[1].reason.contains("not valid JSON"),
        "{}",
        dead[1].reason
    );
    assert_eq!(dead[1].envelope.payload.as_ref(), b"not json at all");
    assert_eq!(counts(&effects).len(), 1);
    assert_eq!(c.stats().rejected, 2);
}

#[tokio::test]
async fn a_store_outage_means_no_ack_and_processing_resumes_after_it() {
    let broker = MemoryBroker::new();
    for i in 0..10 {
        broker.publish(payment(&format!("p{i}")));
    }
    let store = Arc::new(MemoryStore::new());
    let effects: Effects = Arc::default();
    let c = IdempotentConsumer::new(store.clone(), keys(), recording(effects.clone()))
        .with_config(fast());
    let mut src = broker.subscribe();
    store.set_available(false);
    let batch = idemq_core::Source::poll(&mut src, 100)
        .await
        .expect("poll")
        .expect("batch");
    assert!(c.process_batch(batch).await, "reports the store as down");
    assert_eq!(broker.acked(), 0, "nothing acked while the store is down");
    assert_eq!(broker.pending(), 10, "nothing lost");
    assert!(
        counts(&effects).is_empty(),
        "no handler ran without a claim"
    );
    assert_eq!(c.stats().store_unavailable, 10);
    store.set_available(true);
    c.run_until_idle(&mut src).await.expect("run");
    assert_eq!(counts(&effects).len(), 10);
    assert_eq!(broker.acked(), 10);
}

#[tokio::test]
async fn a_store_outage_after_the_effect_is_waited_out_and_the_effect_is_not_repeated() {
    // The handler applies its effect, then the store goes down for 300ms before completion.
    let broker = MemoryBroker::new();
    broker.publish(payment("p1"));
    let store = Arc::new(MemoryStore::new());
    let effects: Effects = Arc::default();
    let (s2, e2) = (store.clone(), effects.clone());
    let handler = move |m: ClaimedMessage| {
        let (store, effects) = (s2.clone(), e2.clone());
        async move {
            *effects
                .lock()
                .expect("lock")
                .entry(m.key.to_string())
                .or_default() += 1;
            store.set_available(false);
            let back = store.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(300)).await;
                back.set_available(true);
            });
            Ok::<_, HandlerError>(None)
        }
    };
    let c = IdempotentConsumer::new(store.clone(), keys(), handler).with_config(fast());
    let mut src = broker.subscribe();
    let batch = idemq_core::Source::poll(&mut src, 10)
        .await
        .expect("poll")
        .expect("batch");
    assert!(
        !c.process_batch(batch).await,
        "the completion landed once the store returned"
    );
    assert_eq!(broker.acked(), 1, "acked after the completion was durable");
    assert_eq!(
        counts(&effects).values().copied().collect::<Vec<_>>(),
        vec![1]
    );
    let key = keys().derive(&payment("p1")).expect("key");
    let rec = store.get(&key).await.expect("get").expect("record");
    assert_eq!(rec.status, idemq_core::RecordStatus::Completed);
}

#[tokio::test]
async fn a_store_that_stays_down_after_the_effect_means_no_ack() {
    let broker = MemoryBroker::new();
    broker.publish(payment("p1"));
    let store = Arc::new(MemoryStore::new());
    let s2 = store.clone();
    let handler = move |_m: ClaimedMessage| {
        let store = s2.clone();
        async move {
            store.set_available(false);
            Ok::<_, HandlerError>(None)
        }
    };
    let c = IdempotentConsumer::new(store.clone(), keys(), handler).with_config(ConsumerConfig {
        complete_patience: Duration::from_millis(150),
        ..fast()
    });
    let mut src = broker.subscribe();
    let batch = idemq_core::Source::poll(&mut src, 10)
        .await
        .expect("poll")
        .expect("batch");
    assert!(c.process_batch(batch).await, "reports the store as down");
    assert_eq!(
        broker.acked(),
        0,
        "not acked: the completion was not durable"
    );
    assert_eq!(broker.pending(), 1, "nothing lost");
    assert_eq!(c.stats().store_unavailable, 1);
}

#[tokio::test]
async fn a_handler_over_its_timeout_is_cancelled_and_retried_as_a_takeover() {
    let broker = MemoryBroker::new();
    broker.publish(payment("hangs-once"));
    let effects: Effects = Arc::default();
    let e2 = effects.clone();
    let handler = move |m: ClaimedMessage| {
        let e = e2.clone();
        async move {
            if m.attempt == 1 {
                std::future::pending::<()>().await;
            }
            *e.lock()
                .expect("lock")
                .entry(m.key.to_string())
                .or_default() += 1;
            Ok::<_, HandlerError>(None)
        }
    };
    let c = IdempotentConsumer::new(Arc::new(MemoryStore::new()), keys(), handler).with_config(
        ConsumerConfig {
            handler_timeout: Some(Duration::from_millis(100)),
            ..fast()
        },
    );
    c.run_until_idle(&mut broker.subscribe())
        .await
        .expect("run");
    assert_eq!(
        counts(&effects).values().copied().collect::<Vec<_>>(),
        vec![1]
    );
    assert_eq!(c.stats().retried, 1);
    assert_eq!(
        c.stats().takeovers,
        1,
        "cut off mid-effect: its lease is left to expire, so the retry is a takeover"
    );
}

#[tokio::test]
async fn a_duplicate_is_answered_from_the_stored_result() {
    struct Replier(Arc<Mutex<Vec<String>>>);
    #[async_trait::async_trait]
    impl idemq_core::Handler for Replier {
        async fn handle(&self, m: ClaimedMessage) -> idemq_core::HandlerResult {
            Ok(Some(format!("receipt for {}", m.key).into()))
        }
        async fn on_duplicate(&self, _e: &Envelope, r: &idemq_core::DedupRecord) {
            let text = String::from_utf8_lossy(r.result.as_deref().unwrap_or_default()).to_string();
            self.0.lock().expect("lock").push(text);
        }
    }
    let broker = MemoryBroker::new();
    broker.publish(payment("p9"));
    let replies = Arc::new(Mutex::new(Vec::new()));
    let c = IdempotentConsumer::new(
        Arc::new(MemoryStore::new()),
        keys(),
        Replier(replies.clone()),
    )
    .with_config(fast());
    let mut src = broker.subscribe();
    c.run_until_idle(&mut src).await.expect("run");
    broker.publish(payment("p9"));
    c.run_until_idle(&mut src).await.expect("run");
    assert_eq!(
        *replies.lock().expect("lock"),
        vec!["receipt for billing:p9".to_string()]
    );
}

#[tokio::test]
async fn a_failed_handler_releases_the_key_and_the_retry_succeeds_once() {
    let broker = MemoryBroker::new();
    broker.publish(payment("flaky"));
    let effects: Effects = Arc::default();
    let e2 = effects.clone();
    let handler = move |m: ClaimedMessage| {
        let e = e2.clone();
        async move {
            if m.attempt == 1 {
                return Err(HandlerError::retryable("downstream timeout"));
            }
            *e.lock()
                .expect("lock")
                .entry(m.key.to_string())
                .or_default() += 1;
            Ok(None)
        }
    };
    let store = Arc::new(MemoryStore::new());
    let c = IdempotentConsumer::new(store.clone(), keys(), handler).with_config(fast());
    c.run_until_idle(&mut broker.subscribe())
        .await
        .expect("run");
    assert_eq!(
        counts(&effects).values().copied().collect::<Vec<_>>(),
        vec![1]
    );
    assert_eq!(c.stats().retried, 1);
    let rec = store
        .get(&keys().derive(&payment("flaky")).expect("key"))
        .await
        .expect("get")
        .expect("record");
    assert_eq!(rec.attempts, 2);
}

#[tokio::test]
async fn a_permanent_failure_is_dead_lettered_and_a_panic_is_retried() {
    let broker = MemoryBroker::new();
    broker.publish(payment("poison"));
    broker.publish(payment("panicky"));
    let effects: Effects = Arc::default();
    let e2 = effects.clone();
    let handler = move |m: ClaimedMessage| {
        let e = e2.clone();
        async move {
            if m.key.as_str().ends_with("poison") {
                return Err(HandlerError::permanent("amount is negative"));
            }
            if m.attempt == 1 {
                panic!("handler bug on first attempt");
            }
            *e.lock()
                .expect("lock")
                .entry(m.key.to_string())
                .or_default() += 1;
            Ok(None)
        }
    };
    let c =
        IdempotentConsumer::new(Arc::new(MemoryStore::new()), keys(), handler).with_config(fast());
    c.run_until_idle(&mut broker.subscribe())
        .await
        .expect("run");
    let dead = broker.dead_letters();
    assert_eq!(dead.len(), 1);
    assert!(dead[0].reason.contains("amount is negative"));
    assert_eq!(
        counts(&effects).len(),
        1,
        "the panicking message was retried"
    );
    assert_eq!(c.stats().retried, 1);
}

#[tokio::test]
async fn the_same_key_with_another_payload_is_rejected_as_a_conflict() {
    let (broker, c) = one_payment(fast());
    let mut src = broker.subscribe();
    c.run_until_idle(&mut src).await.expect("run");
    broker.publish(Envelope::new(
        BrokerKind::MEMORY,
        "payments",
        r#"{"payment_id":"p1","amount":999}"#,
    ));
    c.run_until_idle(&mut src).await.expect("run");
    let dead = broker.dead_letters();
    assert_eq!(dead.len(), 1);
    assert!(
        dead[0].reason.contains("payload conflict"),
        "{}",
        dead[0].reason
    );
}

#[tokio::test]
async fn copies_in_one_batch_are_claimed_once() {
    let broker = MemoryBroker::new();
    for _ in 0..5 {
        broker.publish(payment("same"));
    }
    let effects: Effects = Arc::default();
    let c = IdempotentConsumer::new(
        Arc::new(MemoryStore::new()),
        keys(),
        recording(effects.clone()),
    )
    .with_config(fast());
    let mut src = broker.subscribe();
    let batch = idemq_core::Source::poll(&mut src, 10)
        .await
        .expect("poll")
        .expect("batch");
    assert_eq!(batch.len(), 5);
    c.process_batch(batch).await;
    assert_eq!(
        counts(&effects).values().copied().collect::<Vec<_>>(),
        vec![1]
    );
    let st = c.stats();
    assert_eq!((st.processed, st.duplicates), (1, 4));
    assert_eq!(broker.acked(), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_consumer_crash_mid_handler_is_recovered_by_lease_takeover() {
    let broker = MemoryBroker::new();
    broker.publish(payment("crash-me"));
    let store: Arc<dyn DedupStore> = Arc::new(MemoryStore::new());
    // First consumer: the handler hangs forever (a stuck or dying process).
    let stuck = IdempotentConsumer::new(store.clone(), keys(), |_m: ClaimedMessage| async move {
        std::future::pending::<()>().await;
        Ok::<_, HandlerError>(None)
    })
    .with_config(fast());
    let mut s1 = broker.subscribe();
    let task = tokio::spawn(async move { stuck.run_until_idle(&mut s1).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    task.abort(); // the process dies; its subscription closes and the broker requeues
    let _ = task.await;
    let effects: Effects = Arc::default();
    let rescuer = IdempotentConsumer::new(store.clone(), keys(), recording(effects.clone()))
        .with_config(fast());
    rescuer
        .run_until_idle(&mut broker.subscribe())
        .await
        .expect("run");
    assert_eq!(
        counts(&effects).values().copied().collect::<Vec<_>>(),
        vec![1]
    );
    let st = rescuer.stats();
    assert!(
        st.in_flight >= 1,
        "waited for the dead worker's lease: {st:?}"
    );
    assert_eq!(st.takeovers, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_heartbeat_keeps_a_long_handler_from_being_taken_over() {
    let broker = MemoryBroker::new();
    broker.publish(payment("slow"));
    broker.publish(payment("slow"));
    let store: Arc<dyn DedupStore> = Arc::new(MemoryStore::new());
    let effects: Effects = Arc::default();
    let e2 = effects.clone();
    let handler = move |m: ClaimedMessage| {
        let e = e2.clone();
        async move {
            // Three leases long.
            tokio::time::sleep(Duration::from_millis(600)).await;
            *e.lock()
                .expect("lock")
                .entry(m.key.to_string())
                .or_default() += 1;
            Ok::<_, HandlerError>(None)
        }
    };
    let cfg = ConsumerConfig {
        lease: Duration::from_millis(200),
        heartbeat: Some(Duration::from_millis(50)),
        max_batch: 1,
        ..fast()
    };
    let c = IdempotentConsumer::new(store, keys(), handler).with_config(cfg);
    let (c1, c2) = (c.clone(), c.clone());
    let (mut s1, mut s2) = (broker.subscribe(), broker.subscribe());
    let a = tokio::spawn(async move { c1.run_until_idle(&mut s1).await });
    let b = tokio::spawn(async move { c2.run_until_idle(&mut s2).await });
    a.await.expect("join").expect("run");
    b.await.expect("join").expect("run");
    assert_eq!(
        counts(&effects).values().copied().collect::<Vec<_>>(),
        vec![1]
    );
    assert_eq!(c.stats().takeovers, 0, "the live worker kept its lease");
}

#[tokio::test]
async fn unsafe_settings_are_refused_before_consuming_anything() {
    let (broker, err) = refused(ConsumerConfig {
        lease: Duration::from_secs(1),
        heartbeat: Some(Duration::from_secs(2)),
        ..fast()
    })
    .await;
    assert!(err.contains("heartbeat"), "{err}");
    assert_eq!(broker.pending(), 1, "nothing consumed");
    assert_eq!(broker.acked(), 0);
}

#[tokio::test]
async fn an_in_flight_delay_below_the_floor_is_refused() {
    let (_, err) = refused(ConsumerConfig {
        in_flight_delay_max: Duration::from_millis(1),
        ..fast()
    })
    .await;
    assert!(err.contains("in_flight_delay_max"), "{err}");
}

/// A broker holding one payment, and a consumer with `cfg` over a fresh memory store.
fn one_payment(
    cfg: ConsumerConfig,
) -> (MemoryBroker, IdempotentConsumer<impl idemq_core::Handler>) {
    let broker = MemoryBroker::new();
    broker.publish(payment("p1"));
    let c = IdempotentConsumer::new(
        Arc::new(MemoryStore::new()),
        keys(),
        recording(Arc::default()),
    )
    .with_config(cfg);
    (broker, c)
}

/// Runs a consumer with `cfg` over a broker holding one payment; returns the broker and
/// the error the run must fail with.
async fn refused(cfg: ConsumerConfig) -> (MemoryBroker, String) {
    let (broker, c) = one_payment(cfg);
    let err = match c.run_until_idle(&mut broker.subscribe()).await {
        Ok(()) => panic!("the settings were accepted"),
        Err(e) => e.to_string(),
    };
    (broker, err)
}

/// A store whose claims answer only after most of the lease is gone (a blocked row lock).
struct SlowClaims(MemoryStore, Duration);

#[async_trait::async_trait]
impl DedupStore for SlowClaims {
    async fn claim_batch(
        &self,
        reqs: &[idemq_core::ClaimRequest],
    ) -> Result<Vec<idemq_core::ClaimOutcome>, idemq_core::StoreError> {
        let out = self.0.claim_batch(reqs).await;
        tokio::time::sleep(self.1).await;
        out
    }
    async fn complete_batch(
        &self,
        items: &[idemq_core::Completion],
    ) -> Result<Vec<idemq_core::CompleteOutcome>, idemq_core::StoreError> {
        self.0.complete_batch(items).await
    }
    async fn release(
        &self,
        key: &idemq_core::DedupKey,
        token: idemq_core::FencingToken,
    ) -> Result<idemq_core::ReleaseOutcome, idemq_core::StoreError> {
        self.0.release(key, token).await
    }
    async fn extend(
        &self,
        key: &idemq_core::DedupKey,
        token: idemq_core::FencingToken,
        lease: Duration,
    ) -> Result<idemq_core::ExtendOutcome, idemq_core::StoreError> {
        self.0.extend(key, token, lease).await
    }
    async fn get(
        &self,
        key: &idemq_core::DedupKey,
    ) -> Result<Option<idemq_core::DedupRecord>, idemq_core::StoreError> {
        self.0.get(key).await
    }
    async fn purge_expired(&self, limit: usize) -> Result<u64, idemq_core::StoreError> {
        self.0.purge_expired(limit).await
    }
    async fn list_stuck(
        &self,
        stale_for: Duration,
        limit: usize,
    ) -> Result<Vec<idemq_core::DedupRecord>, idemq_core::StoreError> {
        self.0.list_stuck(stale_for, limit).await
    }
    async fn forget(&self, key: &idemq_core::DedupKey) -> Result<bool, idemq_core::StoreError> {
        self.0.forget(key).await
    }
}

#[tokio::test]
async fn a_claim_answered_with_most_of_its_lease_gone_is_given_back_not_run() {
    let broker = MemoryBroker::new();
    broker.publish(payment("p1"));
    let store = Arc::new(SlowClaims(MemoryStore::new(), Duration::from_millis(400)));
    let effects: Effects = Arc::default();
    let c = IdempotentConsumer::new(store.clone(), keys(), recording(effects.clone()))
        .with_config(fast()); // lease 500ms
    let mut src = broker.subscribe();
    let batch = idemq_core::Source::poll(&mut src, 10)
        .await
        .expect("poll")
        .expect("batch");
    c.process_batch(batch).await;
    assert!(
        counts(&effects).is_empty(),
        "no handler ran on a nearly expired lease"
    );
    assert_eq!(broker.acked(), 0);
    assert_eq!(broker.pending(), 1, "redelivered later, not lost");
    let rec = store
        .get(&keys().derive(&payment("p1")).expect("key"))
        .await
        .expect("get")
        .expect("record");
    assert!(rec.is_released(), "the key was given back at once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pipeline_of_batches_overlaps_and_still_changes_the_world_once() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let (broker, copies) = faulty_payments(11, 0.1, 200);
    let effects: Effects = Arc::default();
    let (running, peak) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let handler = {
        let (effects, running, peak) = (effects.clone(), running.clone(), peak.clone());
        move |m: ClaimedMessage| {
            let (effects, running, peak) = (effects.clone(), running.clone(), peak.clone());
            async move {
                let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                peak.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(10)).await;
                *effects
                    .lock()
                    .expect("lock")
                    .entry(m.key.as_str().to_string())
                    .or_default() += 1;
                running.fetch_sub(1, Ordering::SeqCst);
                Ok::<_, HandlerError>(None)
            }
        }
    };
    // Claims that take a while, as a remote store's do: the next batches start meanwhile.
    let store = SlowClaims(MemoryStore::new(), Duration::from_millis(5));
    let c = IdempotentConsumer::new(Arc::new(store), keys(), handler).with_config(ConsumerConfig {
        max_batch: 8,
        pipeline_depth: 4,
        ..fast()
    });
    c.run_until_idle(&mut broker.subscribe())
        .await
        .expect("run");
    each_applied_once(&effects, &c.stats(), &broker, 200, copies);
    let peak = peak.load(Ordering::SeqCst);
    assert!(
        peak > 8,
        "handlers of several batches ran at once (peak {peak}, one batch holds 8)"
    );
}

#[tokio::test]
async fn a_pipeline_depth_above_one_is_refused_with_an_ordering_and_zero_always() {
    for (cfg, says) in [
        (
            ConsumerConfig {
                pipeline_depth: 2,
                ordering: idemq_core::DeliveryOrder::PerKey,
                ..fast()
            },
            "out of order",
        ),
        (
            ConsumerConfig {
                pipeline_depth: 0,
                ..fast()
            },
            "never poll",
        ),
    ] {
        let (broker, err) = refused(cfg).await;
        assert!(
            err.contains("pipeline_depth") && err.contains(says),
            "{err}"
        );
        assert_eq!(broker.pending(), 1, "nothing consumed");
    }
}

/// Runs `consumer` over `broker` until the broker is drained, on a task of its own so that a
/// panic escaping the engine shows as a dead consumer rather than a failed test thread.
async fn run_to_idle<H: idemq_core::Handler>(
    consumer: IdempotentConsumer<H>,
    broker: &MemoryBroker,
) -> IdempotentConsumer<H> {
    let mut src = broker.subscribe();
    let run = tokio::spawn(async move {
        let out =
            tokio::time::timeout(Duration::from_secs(120), consumer.run_until_idle(&mut src)).await;
        (consumer, out)
    });
    match run.await {
        Ok((consumer, Ok(Ok(())))) => consumer,
        Ok((_, Ok(Err(e)))) => panic!("the consumer stopped with an error: {e}"),
        Ok((_, Err(_))) => panic!("the consumer hung: the broker was not drained in 120 s"),
        Err(e) => panic!("the consumer died: {e}"),
    }
}

/// A handler whose hooks misbehave as asked; `handle` records effects, and fails
/// permanently on a payload of `poison`.
#[derive(Default)]
struct BadHooks {
    effects: Effects,
    panic_on_duplicate: bool,
    panic_on_dead_letter: bool,
    hang_on_duplicate: bool,
}

#[async_trait::async_trait]
impl idemq_core::Handler for BadHooks {
    async fn handle(&self, m: ClaimedMessage) -> idemq_core::HandlerResult {
        if m.envelope.payload.as_ref() == b"poison" {
            return Err(HandlerError::permanent("a poison message"));
        }
        *self
            .effects
            .lock()
            .expect("lock")
            .entry(m.key.as_str().to_string())
            .or_default() += 1;
        Ok(None)
    }
    async fn on_duplicate(&self, _e: &Envelope, _r: &idemq_core::DedupRecord) {
        if self.panic_on_duplicate {
            panic!("on_duplicate exploded");
        }
        if self.hang_on_duplicate {
            std::future::pending::<()>().await;
        }
    }
    async fn on_dead_letter(&self, _e: &Envelope, _reason: &str) {
        if self.panic_on_dead_letter {
            panic!("on_dead_letter exploded");
        }
    }
}

fn header_keyed(key: &str, payload: &str) -> Envelope {
    Envelope::new(BrokerKind::MEMORY, "orders", payload.to_string())
        .with_header("k", key.to_string())
}

fn header_keys() -> KeyStrategy {
    KeyStrategy::header("orders", "k").expect("strategy")
}

#[tokio::test]
async fn a_panicking_key_function_dead_letters_its_message_and_the_consumer_goes_on() {
    let broker = MemoryBroker::new();
    for p in ["boom", "p1", "p2"] {
        broker.publish(Envelope::new(BrokerKind::MEMORY, "orders", p));
    }
    let keys = KeyStrategy::custom("orders", |e: &Envelope| {
        if e.payload.as_ref() == b"boom" {
            panic!("key function exploded");
        }
        Ok(String::from_utf8_lossy(&e.payload).into_owned())
    })
    .expect("strategy");
    let effects: Effects = Arc::default();
    let c = IdempotentConsumer::new(
        Arc::new(MemoryStore::new()),
        keys,
        recording(effects.clone()),
    )
    .with_config(ConsumerConfig {
        max_batch: 1,
        ..fast()
    });
    let c = run_to_idle(c, &broker).await;
    let dead = broker.dead_letters();
    assert_eq!(
        dead.len(),
        1,
        "the message whose key function panicked is dead-lettered"
    );
    assert!(
        dead[0].reason.contains("key function exploded"),
        "the panic message is the reason: {}",
        dead[0].reason
    );
    assert_eq!(dead[0].envelope.payload.as_ref(), b"boom");
    let e = counts(&effects);
    assert_eq!(e.len(), 2, "the next messages are processed: {e:?}");
    assert!(e.values().all(|&n| n == 1), "{e:?}");
    assert_eq!(c.stats().rejected, 1);
    assert_eq!(broker.pending(), 0);
}

#[tokio::test]
async fn a_panicking_on_duplicate_still_acks_the_duplicate_and_the_consumer_goes_on() {
    let broker = MemoryBroker::new();
    broker.publish(header_keyed("o-1", "a"));
    broker.publish(header_keyed("o-1", "a")); // the producer retried
    broker.publish(header_keyed("o-2", "b"));
    let effects: Effects = Arc::default();
    let handler = BadHooks {
        effects: effects.clone(),
        panic_on_duplicate: true,
        ..BadHooks::default()
    };
    let c = IdempotentConsumer::new(Arc::new(MemoryStore::new()), header_keys(), handler)
        .with_config(ConsumerConfig {
            max_batch: 1,
            ..fast()
        });
    let c = run_to_idle(c, &broker).await;
    let e = counts(&effects);
    assert_eq!(e.get("orders:o-1"), Some(&1), "no double effect: {e:?}");
    assert_eq!(
        e.get("orders:o-2"),
        Some(&1),
        "the next message is processed: {e:?}"
    );
    assert_eq!(c.stats().duplicates, 1, "{:?}", c.stats());
    assert!(
        broker.dead_letters().is_empty(),
        "the duplicate is acked, not dead-lettered"
    );
    assert_eq!(broker.pending(), 0, "nothing left unsettled");
}

#[tokio::test]
async fn a_panicking_on_dead_letter_still_dead_letters_and_the_consumer_goes_on() {
    let broker = MemoryBroker::new();
    broker.publish(header_keyed("o-1", "poison"));
    broker.publish(header_keyed("o-2", "b"));
    let effects: Effects = Arc::default();
    let handler = BadHooks {
        effects: effects.clone(),
        panic_on_dead_letter: true,
        ..BadHooks::default()
    };
    let c = IdempotentConsumer::new(Arc::new(MemoryStore::new()), header_keys(), handler)
        .with_config(ConsumerConfig {
            max_batch: 1,
            ..fast()
        });
    let c = run_to_idle(c, &broker).await;
    let dead = broker.dead_letters();
    assert_eq!(dead.len(), 1, "the poison message is still dead-lettered");
    assert!(
        dead[0].reason.contains("a poison message"),
        "{}",
        dead[0].reason
    );
    let e = counts(&effects);
    assert_eq!(
        e.get("orders:o-2"),
        Some(&1),
        "the next message is processed: {e:?}"
    );
    assert_eq!(c.stats().rejected, 1);
    assert_eq!(broker.pending(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_hanging_on_duplicate_is_cut_off_and_the_duplicate_still_acked() {
    let broker = MemoryBroker::new();
    broker.publish(header_keyed("o-1", "a"));
    broker.publish(header_keyed("o-1", "a"));
    broker.publish(header_keyed("o-2", "b"));
    let effects: Effects = Arc::default();
    let handler = BadHooks {
        effects: effects.clone(),
        hang_on_duplicate: true,
        ..BadHooks::default()
    };
    let c = IdempotentConsumer::new(Arc::new(MemoryStore::new()), header_keys(), handler)
        .with_config(ConsumerConfig {
            max_batch: 1,
            ..fast()
        });
    let c = run_to_idle(c, &broker).await;
    let e = counts(&effects);
    assert_eq!(e.get("orders:o-1"), Some(&1), "{e:?}");
    assert_eq!(
        e.get("orders:o-2"),
        Some(&1),
        "the next message is processed: {e:?}"
    );
    assert_eq!(c.stats().duplicates, 1);
    assert_eq!(broker.pending(), 0);
}

/// What the engine ran and dead-lettered, in order: `run:<payload>` and `dead:<payload>`.
#[derive(Clone, Default)]
struct Journal(Arc<Mutex<Vec<String>>>);

#[async_trait::async_trait]
impl idemq_core::Handler for Journal {
    async fn handle(&self, m: ClaimedMessage) -> idemq_core::HandlerResult {
        let p = String::from_utf8_lossy(&m.envelope.payload).into_owned();
        self.0.lock().expect("lock").push(format!("run:{p}"));
        Ok(None)
    }
    async fn on_dead_letter(&self, e: &Envelope, _reason: &str) {
        let p = String::from_utf8_lossy(&e.payload).into_owned();
        self.0.lock().expect("lock").push(format!("dead:{p}"));
    }
}

async fn a_conflicting_copy_in_the_batch_holds_its_lane(mode: idemq_core::DeliveryOrder) {
    let broker = MemoryBroker::new();
    broker.set_ordering(mode);
    // One partition, one ordering key: offsets 0..3 of one lane. Offset 1 repeats offset
    // 0's key with another payload (a producer bug); offset 2 must not overtake it.
    for (key, payload) in [("a", "a-x"), ("a", "a-y"), ("b", "b")] {
        broker.publish(
            header_keyed(key, payload)
                .with_partition(0)
                .with_ordering_key("entity-1"),
        );
    }
    let journal = Journal::default();
    let c = IdempotentConsumer::new(Arc::new(MemoryStore::new()), header_keys(), journal.clone())
        .with_config(ConsumerConfig {
            ordering: mode,
            redelivery_delay: Duration::from_millis(50),
            ..fast()
        });
    let c = run_to_idle(c, &broker).await;
    let seen = journal.0.lock().expect("lock").clone();
    let at = |what: &str| {
        seen.iter()
            .position(|s| s == what)
            .unwrap_or_else(|| panic!("{what} missing from {seen:?}"))
    };
    assert!(at("run:a-x") < at("dead:a-y"), "{mode:?}: {seen:?}");
    assert!(
        at("dead:a-y") < at("run:b"),
        "{mode:?}: offset 2 ran before offset 1 of its lane was settled: {seen:?}"
    );
    assert_eq!(
        seen.len(),
        3,
        "each ran or was dead-lettered once: {seen:?}"
    );
    assert_eq!(broker.pending(), 0);
    assert_eq!(c.stats().processed, 2);
}

#[tokio::test]
async fn per_partition_a_conflicting_copy_in_the_batch_holds_its_partition() {
    a_conflicting_copy_in_the_batch_holds_its_lane(idemq_core::DeliveryOrder::PerPartition).await;
}

#[tokio::test]
async fn per_key_a_conflicting_copy_in_the_batch_holds_its_key() {
    a_conflicting_copy_in_the_batch_holds_its_lane(idemq_core::DeliveryOrder::PerKey).await;
}

/// The memory store, noting the keys whose completion it answered and every extend of such
/// a key afterwards.
#[derive(Default)]
struct ExtendsAfterCompletion {
    inner: MemoryStore,
    completed: Mutex<std::collections::HashSet<String>>,
    late_extends: Mutex<Vec<String>>,
}

#[async_trait::async_trait]
impl DedupStore for ExtendsAfterCompletion {
    async fn claim_batch(
        &self,
        reqs: &[idemq_core::ClaimRequest],
    ) -> Result<Vec<idemq_core::ClaimOutcome>, idemq_core::StoreError> {
        self.inner.claim_batch(reqs).await
    }
    async fn complete_batch(
        &self,
        items: &[idemq_core::Completion],
    ) -> Result<Vec<idemq_core::CompleteOutcome>, idemq_core::StoreError> {
        let outs = self.inner.complete_batch(items).await?;
        let mut done = self.completed.lock().expect("lock");
        for (c, o) in items.iter().zip(&outs) {
            if o.is_done() {
                done.insert(c.key.as_str().to_string());
            }
        }
        Ok(outs)
    }
    async fn release(
        &self,
        key: &idemq_core::DedupKey,
        token: idemq_core::FencingToken,
    ) -> Result<idemq_core::ReleaseOutcome, idemq_core::StoreError> {
        self.inner.release(key, token).await
    }
    async fn extend(
        &self,
        key: &idemq_core::DedupKey,
        token: idemq_core::FencingToken,
        lease: Duration,
    ) -> Result<idemq_core::ExtendOutcome, idemq_core::StoreError> {
        if self.completed.lock().expect("lock").contains(key.as_str()) {
            self.late_extends
                .lock()
                .expect("lock")
                .push(key.as_str().to_string());
        }
        self.inner.extend(key, token, lease).await
    }
    async fn get(
        &self,
        key: &idemq_core::DedupKey,
    ) -> Result<Option<idemq_core::DedupRecord>, idemq_core::StoreError> {
        self.inner.get(key).await
    }
    async fn purge_expired(&self, limit: usize) -> Result<u64, idemq_core::StoreError> {
        self.inner.purge_expired(limit).await
    }
    async fn list_stuck(
        &self,
        stale_for: Duration,
        limit: usize,
    ) -> Result<Vec<idemq_core::DedupRecord>, idemq_core::StoreError> {
        self.inner.list_stuck(stale_for, limit).await
    }
    async fn forget(&self, key: &idemq_core::DedupKey) -> Result<bool, idemq_core::StoreError> {
        self.inner.forget(key).await
    }
}

/// The message of every warning or error the code under test logs.
#[derive(Clone, Default)]
struct Warnings(Arc<Mutex<Vec<String>>>);

struct MessageOf<'a>(&'a mut String);

impl tracing::field::Visit for MessageOf<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            *self.0 = format!("{value:?}");
        }
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Warnings {
    fn on_event(
        &self,
        event: &tracing::Event<'_>,
        _ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        if *event.metadata().level() <= tracing::Level::WARN {
            let mut message = String::new();
            event.record(&mut MessageOf(&mut message));
            self.0.lock().expect("lock").push(message);
        }
    }
}

#[tokio::test(start_paused = true)]
async fn a_completed_key_gets_no_further_heartbeat_and_no_false_lease_loss() {
    use tracing_subscriber::layer::SubscriberExt;
    let warnings = Warnings::default();
    let _log =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(warnings.clone()));
    let broker = MemoryBroker::new();
    broker.publish(header_keyed("quick", "q"));
    broker.publish(header_keyed("slow", "s"));
    let store = Arc::new(ExtendsAfterCompletion::default());
    // The quick handler finishes at once; the slow one for many beats of the same batch.
    let c = IdempotentConsumer::new(
        store.clone(),
        header_keys(),
        |m: ClaimedMessage| async move {
            if m.envelope.payload.as_ref() == b"s" {
                tokio::time::sleep(Duration::from_millis(600)).await;
            }
            Ok::<_, HandlerError>(None)
        },
    )
    .with_config(ConsumerConfig {
        lease: Duration::from_millis(300),
        heartbeat: Some(Duration::from_millis(50)),
        ..fast()
    });
    let c = run_to_idle(c, &broker).await;
    assert_eq!(c.stats().processed, 2, "{:?}", c.stats());
    assert_eq!(c.stats().fenced, 0);
    let late = store.late_extends.lock().expect("lock").clone();
    assert!(
        late.is_empty(),
        "keys extended after their completion: {late:?}"
    );
    let lost: Vec<String> = warnings
        .0
        .lock()
        .expect("lock")
        .iter()
        .filter(|w| w.contains("lease lost") || w.contains("lease ran out"))
        .cloned()
        .collect();
    assert!(lost.is_empty(), "false lease losses reported: {lost:?}");
}

/// `idemq_messages_total` by its `broker` and `outcome` labels, from the recorder's snapshot.
fn messages_by_broker_and_outcome(
    snapshotter: &metrics_util::debugging::Snapshotter,
) -> HashMap<(String, String), u64> {
    use metrics_util::debugging::DebugValue;
    let mut tally = HashMap::new();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let key = key.key();
        if key.name() != idemq_core::metrics::MESSAGES {
            continue;
        }
        let label = |name: &str| {
            key.labels()
                .find(|l| l.key() == name)
                .map(|l| l.value().to_string())
                .unwrap_or_default()
        };
        if let DebugValue::Counter(n) = value {
            *tally
                .entry((label("broker"), label("outcome")))
                .or_default() += n;
        }
    }
    tally
}

/// A broker the core has never heard of: its adapter names it and says where its producers
/// put a dedup key (JetStream's `Nats-Msg-Id`), and the engine needs nothing more.
const NATS: BrokerKind = BrokerKind::new("nats", &[DedupSlot::Header("Nats-Msg-Id")]);

fn nats_batch(
    ids: &[Option<&str>],
) -> (
    Vec<idemq_core::Delivery>,
    Vec<tokio::sync::oneshot::Receiver<Settlement>>,
) {
    ids.iter()
        .map(|id| {
            let mut env = Envelope::new(NATS, "ORDERS", "{}");
            if let Some(id) = id {
                env = env.with_header("Nats-Msg-Id", id.to_string());
            }
            let (settle, outcome) = SettleRecorder::new();
            (idemq_core::Delivery::new(env, Box::new(settle)), outcome)
        })
        .unzip()
}

#[tokio::test]
async fn a_broker_unknown_to_the_core_is_keyed_by_its_own_slot_and_counted_under_its_own_label() {
    let recorder = metrics_util::debugging::DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    // A current-thread test: the engine's metrics are recorded on this thread.
    let _local = metrics::set_default_local_recorder(&recorder);
    let effects: Effects = Arc::default();
    let c = IdempotentConsumer::new(
        Arc::new(MemoryStore::new()),
        KeyStrategy::dedup_header("orders").expect("strategy"),
        recording(effects.clone()),
    )
    .with_config(fast());

    let (batch, first) = nats_batch(&[Some("o-1"), Some("o-2"), None]);
    c.process_batch(batch).await;
    // JetStream redelivers o-1 (its ack was lost).
    let (batch, second) = nats_batch(&[Some("o-1")]);
    c.process_batch(batch).await;

    let mut settled = Vec::new();
    for rx in first.into_iter().chain(second) {
        settled.push(rx.await.expect("settled"));
    }
    assert_eq!(settled[..2], [Settlement::Ack, Settlement::Ack]);
    match &settled[2] {
        Settlement::Reject(reason) => assert!(
            reason.contains("Nats-Msg-Id"),
            "the reason names the adapter's slot: {reason}"
        ),
        other => panic!("a keyless message must be dead-lettered, not {other:?}"),
    }
    assert_eq!(settled[3], Settlement::Ack);
    let applied = counts(&effects);
    assert_eq!(
        applied,
        HashMap::from([("orders:o-1".to_string(), 1), ("orders:o-2".to_string(), 1)])
    );

    let tally = messages_by_broker_and_outcome(&snapshotter);
    let want = HashMap::from([
        (("nats".to_string(), "processed".to_string()), 2),
        (("nats".to_string(), "duplicate".to_string()), 1),
        (("nats".to_string(), "rejected".to_string()), 1),
    ]);
    assert_eq!(
        tally, want,
        "every outcome counted under the broker's own label"
    );
}

/// A message held behind a failing one of its lane is given back unrun each round; its
/// attempts count its own runs, so its first real failure is attempt 1, not the number of
/// rounds it waited (which dead-lettered it: "gave up after 3 attempts" after one run).
#[tokio::test]
async fn messages_held_behind_a_failing_one_keep_their_retry_budget() {
    let broker = MemoryBroker::new();
    broker.set_ordering(idemq_core::DeliveryOrder::PerKey);
    for id in ["first", "second"] {
        broker.publish(payment(id).with_ordering_key("acct-1"));
    }
    let runs: Arc<Mutex<Vec<(String, u32)>>> = Arc::default();
    let seen = runs.clone();
    let consumer = IdempotentConsumer::new(
        Arc::new(MemoryStore::new()),
        keys(),
        move |msg: ClaimedMessage| {
            let seen = seen.clone();
            async move {
                let id = msg
                    .key
                    .as_str()
                    .rsplit(':')
                    .next()
                    .unwrap_or("")
                    .to_string();
                let ran_before = {
                    let mut r = seen.lock().expect("runs");
                    let n = r.iter().filter(|(k, _)| *k == id).count();
                    r.push((id.clone(), msg.attempt));
                    n
                };
                match (id.as_str(), ran_before) {
                    // Fails twice: the lane is held behind it for two rounds.
                    ("first", 0 | 1) => Err(HandlerError::retryable("downstream busy")),
                    // Fails on its own first run.
                    ("second", 0) => Err(HandlerError::retryable("downstream busy")),
                    _ => Ok(None),
                }
            }
        },
    )
    .with_config(ConsumerConfig {
        ordering: idemq_core::DeliveryOrder::PerKey,
        retry: idemq_core::RetryPolicy::fixed(Duration::from_millis(10)).with_max_attempts(3),
        ..fast()
    });
    tokio::time::timeout(
        Duration::from_secs(20),
        consumer.run_until_idle(&mut broker.subscribe()),
    )
    .await
    .expect("the run ends")
    .expect("run");
    let runs = runs.lock().expect("runs").clone();
    let of = |id: &str| -> Vec<u32> {
        runs.iter()
            .filter(|(k, _)| k == id)
            .map(|(_, a)| *a)
            .collect()
    };
    assert!(
        broker.dead_letters().is_empty(),
        "{:?}",
        broker.dead_letters()
    );
    assert_eq!(of("first"), vec![1, 2, 3], "{runs:?}");
    assert_eq!(
        of("second"),
        vec![1, 2],
        "attempts count runs of the handler, not claims: {runs:?}"
    );
    assert_eq!(broker.acked(), 2);
}

/// A delivery whose key a transactional check-back recorded rolled back (its message was
/// dropped) is not run and not acked unseen: it is dead-lettered with the reason.
#[tokio::test]
async fn a_key_recorded_rolled_back_is_dead_lettered_not_run() {
    let store = Arc::new(MemoryStore::new());
    let key = keys()
        .derive(&payment("dropped"))
        .expect("the payment's dedup key");
    let idemq_core::ClaimOutcome::Acquired(check) = store
        .claim(&idemq_core::ClaimRequest::new(
            key.clone(),
            Duration::from_secs(30),
        ))
        .await
        .expect("claim")
    else {
        panic!("the check-back's claim of a fresh key")
    };
    store
        .roll_back(&key, check.token, Duration::from_secs(3600))
        .await
        .expect("roll_back");
    let broker = MemoryBroker::new();
    broker.publish(payment("dropped"));
    broker.publish(payment("kept"));
    let effects: Effects = Arc::default();
    let e2 = effects.clone();
    let handler = move |m: ClaimedMessage| {
        let e = e2.clone();
        async move {
            *e.lock()
                .expect("lock")
                .entry(m.key.to_string())
                .or_default() += 1;
            Ok(None)
        }
    };
    let c = IdempotentConsumer::new(store, keys(), handler).with_config(fast());
    c.run_until_idle(&mut broker.subscribe())
        .await
        .expect("run");
    let dead = broker.dead_letters();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert!(dead[0].reason.contains("rolled back"), "{}", dead[0].reason);
    let ran = counts(&effects);
    assert_eq!(ran.len(), 1, "only the other payment ran: {ran:?}");
    assert!(!ran.keys().any(|k| k.ends_with("dropped")), "{ran:?}");
}
