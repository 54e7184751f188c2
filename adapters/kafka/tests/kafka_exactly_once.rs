//! Effects exactly once through the core engine on the real broker: a rebalance mid-run, and
//! a storm of producer duplicates with a consumer dropped mid-run.

mod support;

use idemq_core::engine::{ConsumerConfig, RetryPolicy};
use idemq_core::publish::{OutgoingMessage, Publisher};
use idemq_core::{ClaimedMessage, HandlerError, IdempotentConsumer, KeyStrategy, MemoryStore};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

type Effects = Arc<Mutex<HashMap<String, Vec<&'static str>>>>;

/// Set when the process is "going down": handlers that start now never reach their effect.
/// The engine records completions per batch, so handlers of the crashed batch that did
/// finish their effect are never completed and are taken over after their lease: the
/// handler checks on `ClaimedMessage::takeover`, as the engine's docs ask of handlers whose
/// effect is not committed together with the dedup record.
type Crashing = Arc<std::sync::atomic::AtomicBool>;

fn engine(
    store: Arc<MemoryStore>,
    effects: Effects,
    who: &'static str,
    work: Duration,
    crashing: Crashing,
) -> IdempotentConsumer<impl idemq_core::Handler> {
    IdempotentConsumer::new(
        store,
        KeyStrategy::dedup_header("kafka-eo").expect("group"),
        move |m: ClaimedMessage| {
            let effects = effects.clone();
            let crashing = crashing.clone();
            async move {
                tokio::time::sleep(work).await;
                if crashing.load(std::sync::atomic::Ordering::SeqCst) {
                    std::future::pending::<()>().await;
                }
                let k = m
                    .envelope
                    .headers
                    .get_str(idemq_core::publish::DEDUP_HEADER)
                    .unwrap_or_default()
                    .to_string();
                let mut effects = effects.lock().unwrap_or_else(|e| e.into_inner());
                let done = effects.entry(k).or_default();
                // The documented duty of a handler whose effect is not committed with its
                // dedup record: after a takeover, check whether the crashed worker got as far
                // as the effect. Only a takeover may skip; any other repeat is a double.
                if !m.takeover || done.is_empty() {
                    done.push(who);
                }
                Ok::<_, HandlerError>(None)
            }
        },
    )
    .with_config(ConsumerConfig {
        max_batch: 50,
        max_concurrency: 8,
        lease: Duration::from_secs(3),
        retry: RetryPolicy::fixed(Duration::from_millis(200)),
        ..ConsumerConfig::default()
    })
}

async fn publish(brokers: &str, topic: &str, keys: &[String], duplicate_every: usize) {
    let p = support::publisher(brokers).await;
    let mut msgs: Vec<OutgoingMessage> = Vec::new();
    for (i, k) in keys.iter().enumerate() {
        let m = OutgoingMessage::new(topic, format!("{{\"n\":{i}}}"))
            .with_key(format!("entity-{}", i % 37))
            .with_dedup_key(k.clone());
        if duplicate_every > 0 && i % duplicate_every == 0 {
            // A producer retry after a lost ack: same business key, new offset.
            msgs.push(m.clone());
        }
        msgs.push(m);
    }
    for r in p.publish_batch(msgs).await {
        r.expect("publish");
    }
}

async fn wait_for(effects: &Effects, n: usize, within: Duration) {
    let deadline = Instant::now() + within;
    while effects.lock().unwrap_or_else(|e| e.into_inner()).len() < n && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn verdict(effects: &Effects, keys: &[String]) -> (usize, usize) {
    let e = effects.lock().unwrap_or_else(|e| e.into_inner());
    let doubles = e.values().filter(|v| v.len() > 1).count();
    let lost = keys.iter().filter(|k| !e.contains_key(*k)).count();
    (doubles, lost)
}

/// Two consumers in one group on a 4-partition topic; the second joins mid-run and takes
/// partitions over. Nothing is lost, nothing applied twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_consumer_joining_mid_run_takes_partitions_without_loss_or_double_effects() {
    let Some(brokers) = support::brokers() else {
        return;
    };
    let topic = support::unique("rebalance");
    support::create_topic(&brokers, &topic, 4).await;
    let keys: Vec<String> = (0..1000).map(|i| format!("{topic}-{i:04}")).collect();
    publish(&brokers, &topic, &keys, 0).await;

    let store = Arc::new(MemoryStore::new());
    let effects: Effects = Arc::default();
    let group = format!("{topic}-group");
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let run = |who: &'static str| {
        let consumer = engine(
            store.clone(),
            effects.clone(),
            who,
            // Slow enough that the first consumer is still busy when the second joins.
            Duration::from_millis(30),
            Crashing::default(),
        );
        let (brokers, group, topic) = (brokers.clone(), group.clone(), topic.clone());
        let mut stop = stop_rx.clone();
        tokio::spawn(async move {
            let mut src = support::subscribe(&brokers, &group, &topic).await;
            consumer
                .run(&mut src, async move {
                    let _ = stop.wait_for(|s| *s).await;
                })
                .await
                .expect("run");
        })
    };
    let a = run("a");
    wait_for(&effects, 100, Duration::from_secs(30)).await;
    let b = run("b");
    wait_for(&effects, keys.len(), Duration::from_secs(90)).await;
    // Let stragglers (redeliveries after the rebalance) arrive, then stop both.
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop_tx.send(true).expect("stop");
    a.await.expect("consumer a");
    b.await.expect("consumer b");

    let (doubles, lost) = verdict(&effects, &keys);
    assert_eq!(
        (doubles, lost),
        (0, 0),
        "double_effects={doubles} lost={lost}"
    );
    let by_b = effects
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .values()
        .filter(|v| v.contains(&"b"))
        .count();
    assert!(by_b > 0, "the second consumer never got a partition");
}

/// Every third message sent twice by the producer (same dedup key, new offset), a consumer
/// dropped mid-run without closing, a second one finishing: every key applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn producer_duplicates_and_a_consumer_dropped_mid_run_apply_each_key_once() {
    let Some(brokers) = support::brokers() else {
        return;
    };
    let topic = support::unique("storm");
    support::create_topic(&brokers, &topic, 4).await;
    let keys: Vec<String> = (0..600).map(|i| format!("{topic}-{i:04}")).collect();
    publish(&brokers, &topic, &keys, 3).await;

    let store = Arc::new(MemoryStore::new());
    let effects: Effects = Arc::default();
    let group = format!("{topic}-group");

    let crashing = Crashing::default();
    let first = engine(
        store.clone(),
        effects.clone(),
        "first",
        Duration::from_millis(3),
        crashing.clone(),
    );
    let mut src = support::subscribe(&brokers, &group, &topic).await;
    let crashed = tokio::spawn(async move {
        let _ = first.run(&mut src, std::future::pending()).await;
    });
    wait_for(&effects, 200, Duration::from_secs(30)).await;
    crashing.store(true, std::sync::atomic::Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(300)).await;
    crashed.abort(); // dropped mid-batch: no close, deliveries abandoned
    let _ = crashed.await;

    let second = engine(
        store.clone(),
        effects.clone(),
        "second",
        Duration::ZERO,
        Crashing::default(),
    );
    let mut src = support::subscribe(&brokers, &group, &topic).await;
    let progress = effects.clone();
    let n = keys.len();
    second
        .run(&mut src, async move {
            wait_for(&progress, n, Duration::from_secs(90)).await;
            tokio::time::sleep(Duration::from_secs(1)).await;
        })
        .await
        .expect("run");

    let (doubles, lost) = verdict(&effects, &keys);
    let sample: Vec<_> = effects
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter(|(_, v)| v.len() > 1)
        .take(5)
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    assert_eq!(
        (doubles, lost),
        (0, 0),
        "double_effects={doubles} lost={lost} {sample:?}"
    );
    let stats = second.stats();
    assert!(
        stats.duplicates > 0,
        "the producer duplicates must be seen and skipped: {stats:?}"
    );
}
