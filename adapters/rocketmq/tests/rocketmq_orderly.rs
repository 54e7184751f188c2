#![recursion_limit = "512"]
//! Orderly consumption at a scale that means something, on the real (rocketmq-rust) broker:
//! 200 keys × 10 versions (every seventh version sent twice, as a producer retry would),
//! spread over the topic's queues by sharding key (half of it as pipelined batches),
//! consumed orderly with dedup on and injected handler failures (some versions fail once,
//! some twice), while a second member joins the group and the first leaves (two
//! rebalances). Every key's versions are applied
//! in order, each exactly once.

mod support;

use idemq_core::engine::{ConsumerConfig, DeliveryOrder, RetryPolicy};
use idemq_core::publish::{OutgoingMessage, Publisher};
use idemq_core::{ClaimedMessage, HandlerError, IdempotentConsumer, KeyStrategy, MemoryStore};
use idemq_rocketmq::RocketSourceConfig;
use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use support::wait_until;

const KEYS: usize = 200;
const VERSIONS: u32 = 10;
const PUBLISHERS: usize = 4;

fn account(k: usize) -> String {
    format!("acct-{k:03}")
}

/// How many times version `v` of key `k` fails before it succeeds (about one in eight).
fn injected_failures(k: usize, v: u32) -> u32 {
    match (k * 31 + v as usize * 7) % 17 {
        0 => 2,
        1 => 1,
        _ => 0,
    }
}

/// What the handler saw.
#[derive(Default)]
struct Ledger {
    /// Versions applied per key, in the order they were applied.
    applied: HashMap<String, Vec<u32>>,
    /// Attempts per `key:version`.
    attempts: HashMap<String, u32>,
    /// Out-of-order or repeated applications.
    violations: Vec<String>,
    /// Queues the messages came from.
    queues: BTreeSet<i32>,
    failures: u32,
}

fn lock(l: &Mutex<Ledger>) -> std::sync::MutexGuard<'_, Ledger> {
    l.lock().unwrap_or_else(|e| e.into_inner())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn orderly_consumption_keeps_per_key_order_with_dedup_and_injected_failures() {
    let Some(ns) = support::namesrv() else { return };
    let topic = support::unique("orderly");
    let group = support::unique("orderlycg");
    // Each publisher sends its keys' versions in order; the sharding key picks the queue.
    let mut sends = Vec::new();
    for p in 0..PUBLISHERS {
        let publisher = support::publisher(&ns).await;
        let topic = topic.clone();
        sends.push(tokio::spawn(async move {
            let mut copies_sent = 0usize;
            let mut batch = Vec::new();
            for v in 1..=VERSIONS {
                for k in (p..KEYS).step_by(PUBLISHERS) {
                    let copies = match (k + v as usize) % 7 {
                        0 => 2,
                        _ => 1,
                    };
                    for _ in 0..copies {
                        let m = OutgoingMessage::new(
                            &topic,
                            format!("{{\"account\":\"{}\",\"version\":{v}}}", account(k)),
                        )
                        .with_ordering_key(account(k))
                        .with_dedup_key(format!("{}:v{v}", account(k)));
                        // Half the publishers send one at a time, half as one pipelined
                        // batch of all their keys' versions (many sends in flight, one
                        // key's never at once).
                        if p % 2 == 0 {
                            publisher.publish(m).await.expect("SEND_OK");
                        } else {
                            batch.push(m);
                        }
                        copies_sent += 1;
                    }
                }
            }
            for r in publisher.publish_batch(batch).await {
                r.expect("SEND_OK in the batch");
            }
            publisher.shutdown().await;
            copies_sent
        }));
    }
    let mut sent = 0;
    for s in sends {
        sent += s.await.expect("publisher task");
    }
    let expected = KEYS * VERSIONS as usize;

    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let seen = ledger.clone();
    let handler = move |m: ClaimedMessage| {
        let seen = seen.clone();
        async move {
            let dedup = support::dedup_key_of(&m.envelope);
            let (key, v) = dedup
                .split_once(":v")
                .and_then(|(k, v)| Some((k.to_string(), v.parse::<u32>().ok()?)))
                .ok_or_else(|| HandlerError::permanent(format!("bad dedup key {dedup:?}")))?;
            let k: usize = key
                .trim_start_matches("acct-")
                .parse()
                .map_err(|_| HandlerError::permanent(format!("bad key {key:?}")))?;
            let mut l = lock(&seen);
            if let Some(q) = m.envelope.source.partition {
                l.queues.insert(q);
            }
            let attempt = {
                let a = l.attempts.entry(dedup.clone()).or_default();
                *a += 1;
                *a
            };
            if attempt <= injected_failures(k, v) {
                l.failures += 1;
                return Err(HandlerError::retryable(format!(
                    "injected failure {attempt} of {dedup}"
                )));
            }
            let applied = l.applied.entry(key.clone()).or_default();
            let last = applied.last().copied().unwrap_or(0);
            applied.push(v);
            if v != last + 1 {
                l.violations
                    .push(format!("{key}: v{v} applied after v{last}"));
            }
            Ok(None)
        }
    };
    let store = Arc::new(MemoryStore::new());
    let cfg = ConsumerConfig {
        ordering: DeliveryOrder::PerKey,
        retry: RetryPolicy::fixed(Duration::from_millis(100)),
        max_batch: 64,
        ..ConsumerConfig::default()
    };
    // A member of the group, stopped (gracefully) by its sender.
    let member = || {
        let consumer = IdempotentConsumer::new(
            store.clone(),
            KeyStrategy::dedup_header(&group).expect("group"),
            handler.clone(),
        )
        .with_config(cfg.clone());
        let config = RocketSourceConfig::new(&ns, &group, &topic).orderly();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let run = tokio::spawn(async move {
            let mut src = support::source(config).await;
            let r = consumer
                .run(&mut src, async {
                    let _ = stop_rx.await;
                })
                .await;
            (r, consumer.stats())
        });
        (stop_tx, run)
    };
    let applied = |l: &Ledger| l.applied.values().map(Vec::len).sum::<usize>();
    let reached = |share: usize| {
        let ledger = ledger.clone();
        move || applied(&lock(&ledger)) >= share
    };
    // Rebalances mid-run: a second member joins after a third of the versions (the queues
    // are split between two live members), the first leaves after two thirds.
    let (stop_first, first) = member();
    let joined = wait_until(Duration::from_secs(120), reached(expected / 3)).await;
    let (stop_second, second) = member();
    let left = wait_until(Duration::from_secs(120), reached(expected * 2 / 3)).await;
    let _ = stop_first.send(());
    let (first_result, first_stats) = first.await.expect("first member");
    let done = wait_until(Duration::from_secs(300), reached(expected)).await;
    // Anything applied twice would show up now.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let _ = stop_second.send(());
    let (second_result, second_stats) = second.await.expect("second member");
    first_result.expect("the first member ran without error");
    second_result.expect("the second member ran without error");
    let duplicates = first_stats.duplicates + second_stats.duplicates;
    let stats = [first_stats, second_stats];

    let l = lock(&ledger);
    let wrong: Vec<String> = (0..KEYS)
        .filter_map(|k| {
            let got = l.applied.get(&account(k)).cloned().unwrap_or_default();
            let want: Vec<u32> = (1..=VERSIONS).collect();
            (got != want).then(|| format!("{}: {got:?}", account(k)))
        })
        .collect();
    let injected: u32 = (0..KEYS)
        .flat_map(|k| (1..=VERSIONS).map(move |v| injected_failures(k, v)))
        .sum();
    assert!(
        joined && left && done && wrong.is_empty() && l.violations.is_empty(),
        "{} of {expected} applied; {} keys wrong (first: {:?}); violations: {:?}; stats {stats:?}",
        applied(&l),
        wrong.len(),
        wrong.iter().take(5).collect::<Vec<_>>(),
        l.violations.iter().take(10).collect::<Vec<_>>()
    );
    assert!(
        l.queues.len() > 1,
        "the keys spread over several queues: {:?}",
        l.queues
    );
    assert_eq!(l.failures, injected, "every injected failure happened");
    assert!(
        duplicates as usize >= sent - expected,
        "{} producer duplicates, {duplicates} dropped as duplicates: {stats:?}",
        sent - expected,
    );
    eprintln!(
        "{sent} messages, {expected} applied in order over queues {:?}, {} injected failures, {stats:?}",
        l.queues, l.failures
    );
}
