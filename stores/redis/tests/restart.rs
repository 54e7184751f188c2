//! Restarts the real redis-server (`scripts/servers.sh restart-redis`) while workers claim
//! and complete a stream of keys. Alone in its test binary: the restart must not disturb
//! other tests.
//!
//! The scripts run Redis with an append-only file, as a dedup store should run, and the
//! restart is a `SHUTDOWN` (which fsyncs the AOF): leases and completed records survive it.
//! What must hold:
//! - every key is acknowledged exactly once (none lost);
//! - every handler runs exactly once (nothing processed twice), and no key gets two
//!   confirmed completions;
//! - an error during the outage is retried, never taken for "not a duplicate" or "done";
//! - keys acknowledged before the restart are still completed after it.

mod support;

use idemq_core::{ClaimOutcome, ClaimRequest, CompleteOutcome, DedupKey, DedupStore};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::*;

const KEYS: usize = 3000;
const WORKERS: usize = 8;
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
    errors: AtomicUsize,
    in_flight: AtomicUsize,
    fenced: AtomicUsize,
    done: AtomicUsize,
}

async fn backoff() {
    tokio::time::sleep(Duration::from_millis(25)).await;
}

/// Delivers `key` until it is acknowledged, like a broker redelivering an unacked message.
async fn deliver(
    store: &dyn DedupStore,
    key: &DedupKey,
    tally: &Mutex<Vec<Tally>>,
    i: usize,
    stats: &Stats,
) {
    let req = ClaimRequest::new(key.clone(), LEASE).with_worker("restart-test");
    loop {
        match store.claim(&req).await {
            Err(e) => {
                // Store down: no ack, back off, redeliver. Never "skip".
                assert!(e.is_retryable(), "unexpected non-retryable error: {e}");
                stats.errors.fetch_add(1, Ordering::Relaxed);
                backoff().await;
            }
            Ok(ClaimOutcome::InFlight { .. }) => {
                // A claim whose reply was lost in the crash: its lease must run out first.
                stats.in_flight.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Ok(ClaimOutcome::PayloadConflict(r)) => panic!("no payload hashes here: {r:?}"),
            Ok(ClaimOutcome::Duplicate(_)) => {
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
                tally.lock().unwrap()[i].handler_runs += 1;
                // Complete with the same token until the store answers.
                loop {
                    match store
                        .complete(key, lease.token, Some("done".into()), RETAIN)
                        .await
                    {
                        Ok(CompleteOutcome::Completed) => {
                            let mut t = tally.lock().unwrap();
                            t[i].commits += 1;
                            t[i].acked_at = Some(Instant::now());
                            return;
                        }
                        Ok(CompleteOutcome::Fenced) => {
                            // The record vanished (wiped by the restart): redeliver.
                            stats.fenced.fetch_add(1, Ordering::Relaxed);
                            break;
                        }
                        Err(e) => {
                            assert!(e.is_retryable(), "unexpected non-retryable error: {e}");
                            stats.errors.fetch_add(1, Ordering::Relaxed);
                            tally.lock().unwrap()[i].ambiguous_completes += 1;
                            backoff().await;
                        }
                    }
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redis_restart_mid_stream_loses_nothing_and_completes_nothing_twice() {
    let Some(url) = redis_url() else { return };
    let prefix = unique_prefix("restart");
    let stores: Vec<Arc<dyn DedupStore>> = handles(4, &prefix, true).await.expect("url is set");
    let group = fresh_key("x").group().to_string();
    let g = idemq_core::ConsumerGroup::new(&group).unwrap();
    let keys: Arc<Vec<DedupKey>> = Arc::new(
        (0..KEYS)
            .map(|i| DedupKey::new(&g, &format!("m-{i}")).unwrap())
            .collect(),
    );
    let queue = Arc::new(Mutex::new((0..KEYS).collect::<VecDeque<usize>>()));
    let tally = Arc::new(Mutex::new(vec![Tally::default(); KEYS]));
    let stats = Arc::new(Stats::default());
    let stop = Arc::new(AtomicBool::new(false));

    let mut workers = Vec::new();
    for w in 0..WORKERS {
        let store = stores[w % stores.len()].clone();
        let (keys, queue, tally, stats, stop) = (
            keys.clone(),
            queue.clone(),
            tally.clone(),
            stats.clone(),
            stop.clone(),
        );
        workers.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let Some(i) = queue.lock().unwrap().pop_front() else {
                    break;
                };
                deliver(store.as_ref(), &keys[i], &tally, i, &stats).await;
                stats.done.fetch_add(1, Ordering::Relaxed);
                // Pace the stream so the restart lands in the middle of it.
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }));
    }

    // Restart once a third of the stream is through.
    let t0 = Instant::now();
    while stats.done.load(Ordering::Relaxed) < KEYS / 3 {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "workers made no progress"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let done_before = stats.done.load(Ordering::Relaxed);
    let errors_before = stats.errors.load(Ordering::Relaxed);
    tokio::task::spawn_blocking(restart_redis)
        .await
        .expect("restart task");
    let restarted_at = Instant::now();
    let done_at_restart = stats.done.load(Ordering::Relaxed);
    eprintln!(
        "redis restarted after {done_before} keys ({} during the restart)",
        done_at_restart - done_before
    );

    let deadline = Instant::now() + Duration::from_secs(180);
    for w in workers {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, w).await {
            Ok(r) => r.expect("worker panicked"),
            Err(_) => {
                stop.store(true, Ordering::Relaxed);
                panic!(
                    "workers did not finish: {} of {KEYS} done",
                    stats.done.load(Ordering::Relaxed)
                );
            }
        }
    }

    let tally = tally.lock().unwrap().clone();
    let mut acked = 0;
    let mut runs = 0;
    for (i, t) in tally.iter().enumerate() {
        let acks = t.commits + t.duplicate_acks;
        assert_eq!(acks, 1, "key m-{i} acknowledged {acks} times: {t:?}");
        assert!(t.commits <= 1, "key m-{i} completed twice: {t:?}");
        assert_eq!(
            t.handler_runs, 1,
            "key m-{i} processed {} times: {t:?}",
            t.handler_runs
        );
        acked += acks;
        runs += t.handler_runs;
    }
    assert_eq!(acked, KEYS, "no key lost");
    let errors = stats.errors.load(Ordering::Relaxed);
    assert!(
        errors > errors_before,
        "the outage was seen by the workers (errors {errors})"
    );

    // Every acknowledged key is durable in the restarted server, before and after.
    let check = stores[0].clone();
    let mut verified = 0;
    let mut before_restart = 0;
    for (i, t) in tally.iter().enumerate() {
        if t.acked_at.is_some_and(|a| a < restarted_at) {
            before_restart += 1;
        }
        {
            let rec = check
                .get(&keys[i])
                .await
                .unwrap()
                .unwrap_or_else(|| panic!("m-{i} missing"));
            assert_eq!(rec.status, idemq_core::RecordStatus::Completed);
            verified += 1;
        }
    }
    assert_eq!(
        verified, KEYS,
        "every acknowledged key is completed after the restart"
    );
    assert!(
        before_restart >= KEYS / 3,
        "the restart came after a third of the stream ({before_restart})"
    );
    eprintln!(
        "keys {KEYS}, handler runs {runs} (re-runs: {}), store errors retried {errors}, \
         in-flight waits {}, fenced completions {}, verified after restart {verified}",
        runs - KEYS,
        stats.in_flight.load(Ordering::Relaxed),
        stats.fenced.load(Ordering::Relaxed),
    );
    let _ = url;
}
