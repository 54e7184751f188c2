#![recursion_limit = "512"]
//! The broker's reconsume budget on the real (rocketmq-rust) broker: with
//! `max_reconsume_times = 1`, a dedup-store outage that outlasts the broker's first reconsume
//! level (~10 s) must not send the waiting message to `%DLQ%<group>` — nacks that are not
//! handler failures spend none of it — and a message whose handler keeps failing is
//! dead-lettered by the engine's retry policy, with its reason.

mod support;

use idemq_core::engine::{ConsumerConfig, RetryPolicy};
use idemq_core::publish::{OutgoingMessage, Publisher};
use idemq_core::testkit::switchable::SwitchableStore;
use idemq_core::{ClaimedMessage, HandlerError, IdempotentConsumer, KeyStrategy, MemoryStore};
use idemq_rocketmq::{RocketSourceConfig, DLQ_REASON};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;
use support::wait_until;
use tokio::time::Instant;

/// A store outage longer than the broker's first reconsume level, with a reconsume budget of
/// one: the payment waits and is applied once when the store is back, never dead-lettered;
/// the poison message beside it (its handler always fails) is dead-lettered by the engine's
/// retry policy, with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_store_outage_does_not_dead_letter_and_a_failing_handler_does_with_its_reason() {
    let Some(ns) = support::namesrv() else { return };
    let topic = support::unique("budget");
    let group = support::unique("budgetcg");
    let mut cfg = RocketSourceConfig::new(&ns, &group, &topic);
    cfg.max_reconsume_times = 1;
    let dlq = support::Collector::start(&ns, &cfg.dead_letter_topic()).await;
    let publisher = support::publisher(&ns).await;
    for key in ["pay-1", "poison-1"] {
        publisher
            .publish(
                OutgoingMessage::new(&topic, format!("{{\"id\":\"{key}\"}}")).with_dedup_key(key),
            )
            .await
            .expect("SEND_OK");
    }

    let store = Arc::new(SwitchableStore::new(Arc::new(MemoryStore::new())));
    store.set_down(true);
    let applied = Arc::new(AtomicU32::new(0));
    let (counter, failures) = (applied.clone(), Arc::new(AtomicU32::new(0)));
    let failed = failures.clone();
    let consumer = IdempotentConsumer::new(
        store.clone(),
        KeyStrategy::dedup_header(&group).expect("keys"),
        move |m: ClaimedMessage| {
            let (counter, failed) = (counter.clone(), failed.clone());
            async move {
                if m.key.business_key().starts_with("poison") {
                    failed.fetch_add(1, Ordering::SeqCst);
                    return Err(HandlerError::retryable("test: this message always fails"));
                }
                counter.fetch_add(1, Ordering::SeqCst);
                Ok(None)
            }
        },
    )
    .with_config(ConsumerConfig {
        store_backoff: Duration::from_millis(200),
        store_backoff_max: Duration::from_secs(1),
        store_retries: 1,
        retry: RetryPolicy::fixed(Duration::from_millis(300)).with_max_attempts(3),
        ..ConsumerConfig::default()
    });
    let src = support::source(cfg).await;
    let (stop, run) = support::run_until_stopped(consumer.clone(), src);

    // The outage: the messages arrived and were nacked (store down) for longer than the
    // broker's first reconsume level; with RECONSUME_LATER they would be in %DLQ% by now.
    let outage = Instant::now();
    let nacked = wait_until(Duration::from_secs(90), || {
        consumer.stats().store_unavailable >= 2
    })
    .await;
    assert!(
        nacked,
        "the messages arrived and met the outage: {:?}",
        consumer.stats()
    );
    while outage.elapsed() < Duration::from_secs(15) {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let dead_early: Vec<String> = dlq.snapshot().iter().map(support::dedup_key_of).collect();
    store.set_down(false);

    let settled = wait_until(Duration::from_secs(60), || {
        applied.load(Ordering::SeqCst) >= 1
            && dlq
                .snapshot()
                .iter()
                .any(|e| support::dedup_key_of(e) == "poison-1")
    })
    .await;
    // Time for a late copy (a second application, a dead-lettered payment) to show itself.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let _ = stop.send(());
    let _ = run.await;
    let dead = dlq.snapshot();
    let dead_keys: Vec<String> = dead.iter().map(support::dedup_key_of).collect();
    assert!(
        dead_early.is_empty(),
        "dead-lettered during the store outage (no handler ran): {dead_early:?}; stats {:?}",
        consumer.stats()
    );
    assert!(
        settled,
        "the payment applied and the poison dead-lettered within 60 s of the store's return: \
         applied {}, dead letters {dead_keys:?}, stats {:?}",
        applied.load(Ordering::SeqCst),
        consumer.stats()
    );
    assert_eq!(
        applied.load(Ordering::SeqCst),
        1,
        "the payment applied once"
    );
    assert!(
        !dead_keys.iter().any(|k| k == "pay-1"),
        "the payment was dead-lettered: {dead_keys:?}"
    );
    let poison = dead
        .iter()
        .find(|e| support::dedup_key_of(e) == "poison-1")
        .expect("the poison message dead-lettered");
    let reason = poison.headers.get_str(DLQ_REASON).unwrap_or("");
    assert!(
        reason.contains("always fails"),
        "the dead-lettered poison message carries the engine's reason, got {reason:?}"
    );
    assert_eq!(
        failures.load(Ordering::SeqCst),
        3,
        "the handler failed max_attempts times, then the engine gave up"
    );
}
