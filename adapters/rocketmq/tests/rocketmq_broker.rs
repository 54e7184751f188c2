#![recursion_limit = "512"]
//! Scenarios on the real (rocketmq-rust) broker: seed 000's payment callback (a producer
//! retry and a redelivery after RECONSUME_LATER, each with a new msgId, one payment), a
//! duplicate storm with a consumer dropped mid-run, and transactional messages checked back
//! from the dedup store.

mod support;

use support::wait_until;

use idemq_core::engine::ConsumerConfig;
use idemq_core::publish::{OutgoingMessage, Publisher};
use idemq_core::source::Source;
use idemq_core::store::{ClaimOutcome, ClaimRequest, DedupStore};
use idemq_core::{
    ClaimedMessage, ConsumerGroup, DedupKey, HandlerError, IdempotentConsumer, KeyStrategy,
    MemoryStore,
};
use idemq_rocketmq::{
    LocalOutcome, RocketSourceConfig, StoreCheckBack, TransactionalPublisher, OFFSET_MSG_ID,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

type Effects = Arc<Mutex<HashMap<String, u32>>>;

fn count(effects: &Effects, key: &str) {
    *effects
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(key.to_string())
        .or_default() += 1;
}

fn snapshot(effects: &Effects) -> HashMap<String, u32> {
    effects.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Seed 000: the payment callback is sent three times (producer retries: three msgIds and
/// three UNIQ_KEYs), and its first delivery fails (the nack is held in the listener and the
/// same message handed over again, its delivery count grown: a nack spends none of the
/// broker's reconsume budget). The dedup key in KEYS / the dedup property makes it one
/// payment.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_payment_callback_sent_three_times_and_redelivered_pays_once() {
    let Some(ns) = support::namesrv() else { return };
    let topic = support::unique("payments");
    let group = support::unique("billing");
    let publisher = support::publisher(&ns).await;
    let mut uniq_keys = Vec::new();
    for _ in 0..3 {
        let m = OutgoingMessage::new(&topic, r#"{"payment_id":"pay-000","amount":100}"#)
            .with_key("order-000")
            .with_dedup_key("pay-000");
        let r = publisher.publish(m).await.expect("SEND_OK");
        uniq_keys.push(r.message_id.expect("UNIQ_KEY"));
    }
    uniq_keys.dedup();
    assert_eq!(uniq_keys.len(), 3, "three sends, three broker ids");

    let effects: Effects = Arc::default();
    // Every delivery passes the key strategy, duplicates too: record what the broker sent.
    let offset_ids = Arc::new(Mutex::new(Vec::<(String, String, u32)>::new()));
    let seen_by_keys = offset_ids.clone();
    let keys = KeyStrategy::custom("billing", move |env| {
        seen_by_keys
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((
                env.headers.get_str(OFFSET_MSG_ID).unwrap_or("").to_string(),
                env.message_id.clone().unwrap_or_default(),
                env.delivery_count.unwrap_or(0),
            ));
        Ok(env
            .headers
            .get_str(idemq_core::DEDUP_HEADER)
            .unwrap_or("")
            .to_string())
    })
    .expect("group");
    let failed_once = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (e, failed) = (effects.clone(), failed_once.clone());
    let consumer = IdempotentConsumer::new(
        Arc::new(MemoryStore::new()),
        keys,
        move |_m: ClaimedMessage| {
            let (e, failed) = (e.clone(), failed.clone());
            async move {
                if !failed.swap(true, std::sync::atomic::Ordering::SeqCst) {
                    return Err(HandlerError::retryable("payment gateway timeout"));
                }
                count(&e, "pay-000");
                Ok(None)
            }
        },
    );
    let src = support::source(RocketSourceConfig::new(&ns, &group, &topic)).await;
    let (stop_tx, run) = support::run_until_stopped(consumer, src);
    // The failed delivery comes back after the retry policy's delay; the two producer
    // copies are duplicates of the same key.
    let redelivered = |seen: &[(String, String, u32)]| {
        seen.iter()
            .skip(1)
            .any(|(_, uniq, _)| seen.first().is_some_and(|f| f.1 == *uniq))
    };
    let progressed = wait_until(Duration::from_secs(90), || {
        redelivered(&offset_ids.lock().unwrap_or_else(|p| p.into_inner()))
            && !snapshot(&effects).is_empty()
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let _ = stop_tx.send(());
    let _ = run.await;
    assert!(progressed, "the callback must be paid once within 90 s");
    assert_eq!(
        snapshot(&effects).get("pay-000"),
        Some(&1),
        "exactly one payment"
    );
    let seen = offset_ids.lock().unwrap_or_else(|p| p.into_inner()).clone();
    // The redelivered copy has the same UNIQ_KEY as the failed one, and a grown count.
    let first = &seen[0];
    let again = seen
        .iter()
        .skip(1)
        .find(|(_, uniq, _)| *uniq == first.1)
        .unwrap_or_else(|| panic!("the failed delivery was not redelivered: {seen:?}"));
    assert!(again.2 > first.2, "delivery count grows: {seen:?}");
}

/// Producer duplicates (every key sent twice) consumed by two members of one group; the first
/// is dropped mid-run (a crash: nothing closed); every key is applied exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_duplicate_storm_with_a_consumer_dropped_mid_run_is_exactly_once() {
    let Some(ns) = support::namesrv() else { return };
    let topic = support::unique("storm");
    let group = support::unique("stormcg");
    let publisher = support::publisher(&ns).await;
    let keys: Vec<String> = (0..80).map(|i| format!("storm-{i:03}")).collect();
    for k in keys.iter().chain(keys.iter()) {
        let m =
            OutgoingMessage::new(&topic, format!("{{\"id\":\"{k}\"}}")).with_dedup_key(k.clone());
        publisher.publish(m).await.expect("SEND_OK");
    }
    let store: Arc<dyn DedupStore> = Arc::new(MemoryStore::new());
    let effects: Effects = Arc::default();
    let make = |slow: bool| {
        let e = effects.clone();
        let pause = Duration::from_millis(if slow { 50 } else { 0 });
        let handler = move |m: ClaimedMessage| {
            let e = e.clone();
            async move {
                tokio::time::sleep(pause).await;
                count(
                    &e,
                    m.envelope
                        .headers
                        .get_str(idemq_core::DEDUP_HEADER)
                        .unwrap_or(""),
                );
                Ok::<_, HandlerError>(None)
            }
        };
        let keys = KeyStrategy::dedup_header("storm").expect("group");
        let cfg = ConsumerConfig {
            lease: Duration::from_secs(5),
            ..ConsumerConfig::default()
        };
        IdempotentConsumer::new(store.clone(), keys, handler).with_config(cfg)
    };
    let first = make(true);
    let mut src1 = support::source(RocketSourceConfig::new(&ns, &group, &topic)).await;
    let crashed = tokio::spawn(async move {
        let _ = first.run(&mut src1, std::future::pending()).await;
    });
    let second = make(false);
    let src2 = support::source(RocketSourceConfig::new(&ns, &group, &topic)).await;
    let (stop_tx, survivor) = support::run_until_stopped(second, src2);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    crashed.abort(); // drops the source mid-batch: no close, nothing settled
    let _ = crashed.await;
    let n = keys.len();
    let done = wait_until(Duration::from_secs(150), || snapshot(&effects).len() >= n).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let _ = stop_tx.send(());
    let _ = survivor.await;
    let effects = snapshot(&effects);
    let doubles: Vec<_> = effects.iter().filter(|(_, c)| **c > 1).collect();
    let lost: Vec<_> = keys.iter().filter(|k| !effects.contains_key(*k)).collect();
    assert!(
        done && doubles.is_empty() && lost.is_empty(),
        "double_effects={} lost={} ({doubles:?} {lost:?})",
        doubles.len(),
        lost.len()
    );
}

/// Transactional messages: a committed one is delivered once, a rolled-back one never, and
/// one whose producer "crashed" after its local commit (outcome unknown) is committed by the
/// check-back, which finds the key completed in the store — and delivered once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transactional_messages_are_checked_back_from_the_store() {
    let Some(ns) = support::namesrv() else { return };
    let topic = support::unique("orders");
    // Create the topic (the transactional producer sends to an existing route).
    let publisher = support::publisher(&ns).await;
    publisher
        .publish(OutgoingMessage::new(&topic, "warm-up").with_dedup_key("warm-up"))
        .await
        .expect("SEND_OK");
    let store: Arc<dyn DedupStore> = Arc::new(MemoryStore::new());
    let group = ConsumerGroup::new("orders").expect("group");
    let check = StoreCheckBack::new(store.clone(), "orders").expect("check-back");
    let tx =
        TransactionalPublisher::connect(&ns, &support::unique("txpg"), vec![topic.clone()], check)
            .await
            .expect("transactional producer");

    // The local transaction: record the order's key in the store (the business effect and
    // its dedup record, as one unit), then report the outcome.
    let local = |key: &str, outcome: LocalOutcome| {
        let store = store.clone();
        let key = DedupKey::new(&group, key).expect("key");
        async move {
            if outcome == LocalOutcome::Rollback {
                return LocalOutcome::Rollback;
            }
            let lease = match store
                .claim(&ClaimRequest::new(key.clone(), Duration::from_secs(30)))
                .await
            {
                Ok(ClaimOutcome::Acquired(l)) => l,
                other => panic!("claim: {other:?}"),
            };
            store
                .complete(&key, lease.token, None, Duration::from_secs(3600))
                .await
                .expect("complete");
            outcome
        }
    };
    let send = |key: &str| {
        OutgoingMessage::new(&topic, format!("{{\"order\":\"{key}\"}}")).with_dedup_key(key)
    };
    for (key, decided) in [
        ("order-commit", LocalOutcome::Commit),
        ("order-rollback", LocalOutcome::Rollback),
        ("order-crashed", LocalOutcome::Unknown),
    ] {
        let (_, outcome) = tx
            .send_in_transaction(send(key), local(key, decided))
            .await
            .unwrap_or_else(|e| panic!("half message {key}: {e}"));
        assert_eq!(outcome, decided, "{key}");
    }

    let reader = support::Collector::start(&ns, &topic).await;
    let arrived = wait_until(Duration::from_secs(90), || {
        let seen = reader.snapshot();
        ["order-commit", "order-crashed"].iter().all(|k| {
            seen.iter()
                .any(|e| e.headers.get_str(idemq_core::DEDUP_HEADER) == Some(k))
        })
    })
    .await;
    // Give a second check-back (or a late rollback) time to show itself.
    tokio::time::sleep(Duration::from_secs(12)).await;
    let seen = reader.snapshot();
    let times = |k: &str| {
        seen.iter()
            .filter(|e| e.headers.get_str(idemq_core::DEDUP_HEADER) == Some(k))
            .count()
    };
    assert!(arrived, "committed messages must arrive: {seen:?}");
    assert_eq!(
        times("order-commit"),
        1,
        "a committed message is delivered once"
    );
    assert_eq!(
        times("order-crashed"),
        1,
        "the check-back commits from the store, once"
    );
    assert_eq!(
        times("order-rollback"),
        0,
        "a rolled-back message is never delivered"
    );
    tx.shutdown().await;
    let _ = reader;
}

/// Closing a source while a listener waits for its settlement answers RECONSUME_LATER at
/// once: nothing blocks, and the delivery reports stale.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn close_releases_a_waiting_listener() {
    let Some(ns) = support::namesrv() else { return };
    let topic = support::unique("close");
    let publisher = support::publisher(&ns).await;
    publisher
        .publish(OutgoingMessage::new(&topic, "x").with_dedup_key("close-1"))
        .await
        .expect("SEND_OK");
    let mut src = support::source(RocketSourceConfig::new(
        &ns,
        support::unique("closecg"),
        &topic,
    ))
    .await;
    let got = tokio::time::timeout(Duration::from_secs(60), src.poll(1))
        .await
        .expect("a delivery within 60 s")
        .expect("poll")
        .expect("open");
    let started = Instant::now();
    tokio::time::timeout(Duration::from_secs(15), src.close())
        .await
        .expect("close does not block")
        .expect("close");
    assert!(started.elapsed() < Duration::from_secs(15));
    assert!(
        got.iter().all(|d| d.is_stale()),
        "held deliveries are stale after close"
    );
}
