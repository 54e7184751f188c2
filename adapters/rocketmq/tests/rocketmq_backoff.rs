#![recursion_limit = "512"]
//! Failing messages in back-off on the real (rocketmq-rust) broker, concurrent mode: more
//! always-failing messages than consume threads, each nacked for a minute, must not take
//! every consume thread. The source holds at most `max_held_nacks` of them through the
//! back-off and sends the rest to the broker's retry topic; healthy messages published while
//! they wait are consumed at once, and every failing message still comes back after its
//! delay (held, or from the retry topic) and ends dead-lettered by the engine's retry policy,
//! with its reason: none is lost.

mod support;

use idemq_core::engine::{ConsumerConfig, RetryPolicy};
use idemq_core::publish::{OutgoingMessage, Publisher};
use idemq_core::{ClaimedMessage, HandlerError, IdempotentConsumer, KeyStrategy, MemoryStore};
use idemq_rocketmq::{RocketSourceConfig, DLQ_REASON, OFFSET_MSG_ID};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use support::wait_until;
use tokio::time::Instant;

const THREADS: u32 = 4;
const HELD: u32 = 2;
/// Three times the consume threads.
const POISON: usize = 12;
const HEALTHY: usize = 8;
/// The engine's back-off after each failure: far longer than a healthy message may wait.
const BACKOFF: Duration = Duration::from_secs(60);

/// Per key: each handler run's offset message id (a new one means the broker stored the
/// message again, in its retry topic).
type Runs = Arc<Mutex<HashMap<String, Vec<String>>>>;

fn runs_of(runs: &Runs) -> HashMap<String, Vec<String>> {
    runs.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failing_messages_in_back_off_leave_consume_threads_for_healthy_ones() {
    let Some(ns) = support::namesrv() else { return };
    let topic = support::unique("backoff");
    let group = support::unique("backoffcg");
    let mut cfg = RocketSourceConfig::new(&ns, &group, &topic);
    cfg.consume_threads = THREADS;
    cfg.max_held_nacks = HELD;
    let dlq = support::Collector::start(&ns, &cfg.dead_letter_topic()).await;
    let publisher = support::publisher(&ns).await;
    let poison: Vec<String> = (0..POISON).map(|i| format!("poison-{i}")).collect();
    let healthy: Vec<String> = (0..HEALTHY).map(|i| format!("healthy-{i}")).collect();
    for key in &poison {
        publisher
            .publish(
                OutgoingMessage::new(&topic, format!("{{\"id\":\"{key}\"}}"))
                    .with_dedup_key(key.clone()),
            )
            .await
            .expect("SEND_OK");
    }

    let runs: Runs = Arc::default();
    let seen = runs.clone();
    let consumer = IdempotentConsumer::new(
        Arc::new(MemoryStore::new()),
        KeyStrategy::dedup_header(&group).expect("keys"),
        move |m: ClaimedMessage| {
            let seen = seen.clone();
            async move {
                let key = m.key.business_key().to_string();
                let offset_id = m
                    .envelope
                    .headers
                    .get_str(OFFSET_MSG_ID)
                    .unwrap_or("")
                    .to_string();
                seen.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .entry(key.clone())
                    .or_default()
                    .push(offset_id);
                if key.starts_with("poison") {
                    return Err(HandlerError::retryable("test: this message always fails"));
                }
                Ok(None)
            }
        },
    )
    .with_config(ConsumerConfig {
        retry: RetryPolicy::fixed(BACKOFF).with_max_attempts(2),
        ..ConsumerConfig::default()
    });
    let src = support::source(cfg).await;
    let (stop, run) = support::run_until_stopped(consumer.clone(), src);

    // As many failing messages in back-off as there are consume threads: a consumer that
    // keeps each on its thread for the back-off has none left.
    let failing = wait_until(Duration::from_secs(90), || {
        consumer.stats().retried >= u64::from(THREADS)
    })
    .await;
    assert!(
        failing,
        "the failing messages arrived and failed: {:?}",
        consumer.stats()
    );
    for key in &healthy {
        publisher
            .publish(
                OutgoingMessage::new(&topic, format!("{{\"id\":\"{key}\"}}"))
                    .with_dedup_key(key.clone()),
            )
            .await
            .expect("SEND_OK");
    }
    let published = Instant::now();
    // Healthy messages take well under a second here; 20 s is a third of the back-off, so
    // only a consumer stalled behind the failing ones misses it.
    let healthy_done = wait_until(Duration::from_secs(20), || {
        let runs = runs_of(&runs);
        healthy.iter().all(|k| runs.contains_key(k))
    })
    .await;
    let waited = published.elapsed();
    let in_back_off = runs_of(&runs);
    assert!(
        healthy_done,
        "healthy messages were not all consumed within {waited:?} while failing ones were in \
         back-off (the consume threads are held): ran {:?}, stats {:?}",
        in_back_off.keys().collect::<Vec<_>>(),
        consumer.stats()
    );

    // Nothing lost: every failing message comes back after its back-off (held, or through
    // the broker's retry topic), fails its second attempt and is dead-lettered with the
    // engine's reason.
    let all_dead = wait_until(Duration::from_secs(240), || {
        let dead: Vec<String> = dlq.snapshot().iter().map(support::dedup_key_of).collect();
        poison.iter().all(|k| dead.contains(k))
    })
    .await;
    // Time for a late copy (a third run, a healthy message run twice) to show itself.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let _ = stop.send(());
    let _ = run.await;
    let dead = dlq.snapshot();
    let dead_keys: Vec<String> = dead.iter().map(support::dedup_key_of).collect();
    let runs = runs_of(&runs);
    assert!(
        all_dead,
        "every failing message dead-lettered after its retries: dead letters {dead_keys:?}, \
         runs {runs:?}, stats {:?}",
        consumer.stats()
    );
    for key in &healthy {
        assert_eq!(
            runs.get(key).map(Vec::len),
            Some(1),
            "{key} ran once: {runs:?}"
        );
        assert!(!dead_keys.contains(key), "{key} was dead-lettered");
    }
    for key in &poison {
        assert_eq!(
            runs.get(key).map(Vec::len),
            Some(2),
            "{key} ran max_attempts times: {runs:?}"
        );
        assert_eq!(
            dead_keys.iter().filter(|k| *k == key).count(),
            1,
            "{key} dead-lettered once: {dead_keys:?}"
        );
        let letter = dead
            .iter()
            .find(|e| support::dedup_key_of(e) == *key)
            .expect("dead-lettered");
        let reason = letter.headers.get_str(DLQ_REASON).unwrap_or("");
        assert!(
            reason.contains("always fails"),
            "{key} carries the engine's reason, got {reason:?}"
        );
    }
    // A second run with the first run's offset id was held on its listener thread; one with
    // a new offset id came back from the retry topic. Held at once: at most HELD, and their
    // back-offs all overlapped.
    let held: Vec<&String> = poison
        .iter()
        .filter(|k| runs.get(*k).is_some_and(|r| r.len() == 2 && r[0] == r[1]))
        .collect();
    assert!(
        held.len() <= HELD as usize,
        "{} failing messages held through the back-off, more than max_held_nacks {HELD}: \
         {held:?}",
        held.len()
    );
    assert!(
        !held.is_empty(),
        "none was held through its back-off on its listener thread: {runs:?}"
    );
    assert!(
        held.len() < poison.len(),
        "none went through the retry topic: {runs:?}"
    );
}
