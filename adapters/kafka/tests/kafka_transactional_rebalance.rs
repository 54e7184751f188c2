//! Kafka → Kafka exactly once (Flow 2) under rebalances, on the real broker: two
//! transactional processors with business dedup run throughout while a third one joins the
//! group and leaves it again, several times, as input keeps arriving (with producer
//! duplicates of business keys at new offsets). Every join and every leave moves partitions
//! between processors mid-flow; a processor must never transform or commit records of a
//! partition it no longer owns. Read back `read_committed`, the output holds each business
//! key exactly once, none missing. This is the scenario Kafka Streams' exactly-once suite is
//! built around. A processor stalled in mid-batch past `max.poll.interval.ms` is put out of
//! the group with its transaction open: its commit is refused, it aborts and rejoins, and
//! each key is still output once.

mod support;

use idemq_core::publish::{OutgoingMessage, Publisher, DEDUP_HEADER};
use idemq_core::KeyStrategy;
use idemq_kafka::{
    BusinessDedup, KafkaProducerConfig, TransactionalProcessor, TxnError, TxnOptions,
};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// Input partitions.
const PARTS: i32 = 8;
/// How many times the third processor joins and leaves.
const CYCLES: usize = 3;
/// New business keys published at least (the feeder goes on until the churn is over).
const MIN_KEYS: usize = 2_000;
/// New business keys published at most (then only duplicates keep the input flowing).
const MAX_KEYS: usize = 5_000;
/// How long each batch's transform takes at least.
const SLOW_BATCH: Duration = Duration::from_millis(100);

/// `max_poll_ms` is also the classic protocol's rebalance timeout: a member that stopped
/// polling holds a rebalance up for this long at most.
fn options(group: &str, max_poll_ms: u64) -> TxnOptions {
    TxnOptions::default()
        .consumer_property("session.timeout.ms", "6000")
        .consumer_property("heartbeat.interval.ms", "250")
        .consumer_property("max.poll.interval.ms", &max_poll_ms.to_string())
        .dedup({
            let mut d = BusinessDedup::new(KeyStrategy::dedup_header(group).expect("key strategy"));
            d.restore_timeout = Duration::from_secs(20);
            d
        })
}

/// One processor running batches in a task until told to stop.
struct Worker {
    name: String,
    stop: Arc<AtomicBool>,
    /// Inputs committed so far (duplicates included).
    committed: Arc<AtomicUsize>,
    /// Batches aborted so far.
    aborts: Arc<AtomicUsize>,
    task: JoinHandle<Result<WorkerStats, String>>,
}

#[derive(Debug, Default)]
struct WorkerStats {
    aborts: usize,
    /// Business duplicates dropped.
    duplicates: u64,
    /// Records dropped because their partition was revoked before their batch ran.
    revoked: u64,
}

struct Setup {
    brokers: String,
    input: String,
    output: String,
    group: String,
}

async fn start(s: &Setup, name: &str) -> Worker {
    start_with(s, name, 20_000, None).await
}

/// A worker whose next batch with records stalls for `stall.1` once `stall.0` is set.
async fn start_with(
    s: &Setup,
    name: &str,
    max_poll_ms: u64,
    stall: Option<(Arc<AtomicBool>, Duration)>,
) -> Worker {
    let cfg = KafkaProducerConfig::transactional(&s.brokers, &support::unique(name));
    let mut proc = TransactionalProcessor::with_options(
        &cfg,
        &s.group,
        &[s.input.as_str()],
        options(&s.group, max_poll_ms),
    )
    .await
    .unwrap_or_else(|e| panic!("processor {name}: {e}"));
    let stop = Arc::new(AtomicBool::new(false));
    let committed = Arc::new(AtomicUsize::new(0));
    let aborts = Arc::new(AtomicUsize::new(0));
    let (stop2, committed2, aborts2, out, who) = (
        stop.clone(),
        committed.clone(),
        aborts.clone(),
        s.output.clone(),
        name.to_string(),
    );
    let task = tokio::spawn(async move {
        let mut stats = WorkerStats::default();
        let mut failure = None;
        while !stop2.load(Ordering::Relaxed) {
            let mut first = true;
            match proc
                .process_batch(300, Duration::from_millis(200), |env| {
                    // A transform that takes its time (I/O, say): a batch lasts long
                    // enough for the rest of the group to finish a rebalance meanwhile.
                    if std::mem::take(&mut first) {
                        std::thread::sleep(SLOW_BATCH);
                        if let Some((flag, how_long)) = &stall {
                            if flag.swap(false, Ordering::Relaxed) {
                                eprintln!("{who}: stalling for {how_long:?} inside a batch");
                                std::thread::sleep(*how_long);
                            }
                        }
                    }
                    Ok(output_of(&out, env))
                })
                .await
            {
                Ok(n) => {
                    committed2.fetch_add(n, Ordering::Relaxed);
                }
                Err(TxnError::Aborted(why)) => {
                    stats.aborts += 1;
                    aborts2.fetch_add(1, Ordering::Relaxed);
                    eprintln!("{who}: batch aborted and rewound: {why}");
                }
                Err(e) => {
                    eprintln!("{who} stopped: {e}");
                    failure = Some(format!("{who} stopped: {e}"));
                    break;
                }
            }
        }
        stats.duplicates = proc.duplicates();
        stats.revoked = proc.revoked();
        // Dropping closes the consumer: it leaves the group (blocking, hence the thread).
        tokio::task::spawn_blocking(move || drop(proc))
            .await
            .map_err(|e| format!("{who}: closing the processor panicked: {e}"))?;
        match failure {
            Some(f) => Err(f),
            None => Ok(stats),
        }
    });
    Worker {
        name: name.to_string(),
        stop,
        committed,
        aborts,
        task,
    }
}

impl Worker {
    /// Stops the worker and waits until its processor has left the group.
    async fn finish(self) -> WorkerStats {
        self.stop.store(true, Ordering::Relaxed);
        match tokio::time::timeout(Duration::from_secs(60), self.task).await {
            Err(_) => panic!("{} did not stop within 60 s", self.name),
            Ok(Err(e)) => panic!("{} panicked: {e}", self.name),
            Ok(Ok(Err(e))) => panic!("{e}"),
            Ok(Ok(Ok(stats))) => stats,
        }
    }

    fn committed(&self) -> usize {
        self.committed.load(Ordering::Relaxed)
    }

    /// Fails the test at once if the worker stopped on its own (fenced, fatal error).
    fn check_alive(&self) {
        if self.task.is_finished() {
            panic!(
                "{} stopped on its own (fenced or fatal error: see its 'stopped' line above)",
                self.name
            );
        }
    }
}

fn output_of(out: &str, env: &idemq_core::Envelope) -> Vec<OutgoingMessage> {
    let k = env
        .headers
        .get_str(DEDUP_HEADER)
        .unwrap_or_default()
        .to_string();
    vec![OutgoingMessage::new(out.to_string(), format!("out:{k}")).with_dedup_key(k)]
}

/// Waits until `done` holds, checking the running workers; panics with `what` at the
/// deadline.
async fn wait_until(
    what: &str,
    within: Duration,
    workers: &[&Worker],
    mut done: impl FnMut() -> bool,
) {
    let deadline = Instant::now() + within;
    while !done() {
        for w in workers {
            w.check_alive();
        }
        assert!(Instant::now() < deadline, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn key(topic: &str, i: usize) -> String {
    format!("{topic}-{i:05}")
}

/// Publishes `keys` with the dedup key as the record key (every copy of a key on one input
/// partition, as business dedup requires).
async fn publish(p: &idemq_kafka::KafkaPublisher, topic: &str, keys: impl Iterator<Item = String>) {
    let msgs: Vec<OutgoingMessage> = keys
        .map(|k| {
            OutgoingMessage::new(topic, format!("in:{k}"))
                .with_key(k.clone())
                .with_dedup_key(k)
        })
        .collect();
    for r in p.publish_batch(msgs).await {
        r.expect("publish input");
    }
}

async fn setup(prefix: &str, parts: i32) -> Option<Setup> {
    let brokers = support::brokers()?;
    let input = support::unique(&format!("{prefix}-in"));
    let s = Setup {
        output: support::unique(&format!("{prefix}-out")),
        group: format!("{input}-g"),
        input,
        brokers,
    };
    support::create_topic(&s.brokers, &s.input, parts).await;
    support::create_topic(&s.brokers, &s.output, 1).await;
    Some(s)
}

/// Waits until the group's committed offsets reach the end of every input partition, which
/// must hold `records` records.
async fn drained(s: &Setup, parts: i32, records: usize, workers: &[&Worker]) {
    let ends = support::high_watermarks(&s.brokers, &s.input, parts);
    assert_eq!(
        ends.iter().sum::<i64>() as usize,
        records,
        "the input holds every published record"
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        for w in workers {
            w.check_alive();
        }
        let now = support::committed_offsets(&s.brokers, &s.group, &s.input, parts);
        if now == ends {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the processors did not drain the input within 60 s: committed {now:?}, ends {ends:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Reads the output `read_committed` and checks it holds keys `0..keys` once each, nothing
/// else.
async fn assert_each_key_once(s: &Setup, keys: usize) {
    let mut counts: HashMap<String, usize> = HashMap::new();
    for e in support::read_all(&s.brokers, &s.output, Duration::from_secs(3)).await {
        let k = e
            .headers
            .get_str(DEDUP_HEADER)
            .unwrap_or_default()
            .to_string();
        *counts.entry(k).or_default() += 1;
    }
    let expected: Vec<String> = (0..keys).map(|i| key(&s.input, i)).collect();
    let doubles: BTreeMap<&String, usize> = expected
        .iter()
        .filter_map(|k| counts.get(k).filter(|c| **c > 1).map(|c| (k, *c)))
        .collect();
    let missing: Vec<&String> = expected
        .iter()
        .filter(|k| !counts.contains_key(*k))
        .collect();
    let extra = counts.len() - (expected.len() - missing.len());
    assert!(
        doubles.is_empty() && missing.is_empty() && extra == 0,
        "read_committed output of {keys} keys: {} doubled (first: {:?}), {} missing (first: \
         {:?}), {extra} unexpected keys",
        doubles.len(),
        doubles.iter().take(10).collect::<Vec<_>>(),
        missing.len(),
        missing.iter().take(10).collect::<Vec<_>>(),
    );
}

/// Two processors throughout, a third joining and leaving `CYCLES` times while the feeder
/// publishes new keys and resends earlier ones (every copy of a key keyed alike, so on one
/// partition); then the output holds each key exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_third_processor_joining_and_leaving_mid_flow_leaves_each_key_output_once() {
    let Some(s) = setup("ctpreb", PARTS).await else {
        return;
    };
    // The feeder: every 40 ms, 10 new keys and 3 copies of earlier ones (a recent one, likely
    // still in flight, and two older ones, likely committed long ago), until the churn is
    // over and at least MIN_KEYS keys are out.
    let churn_done = Arc::new(AtomicBool::new(false));
    let published = Arc::new(AtomicUsize::new(0));
    let feeder = {
        let (brokers, topic, churn_done, published) = (
            s.brokers.clone(),
            s.input.clone(),
            churn_done.clone(),
            published.clone(),
        );
        tokio::spawn(async move {
            let p = support::publisher(&brokers).await;
            let (mut n, mut copies, mut tick) = (0usize, 0usize, 0usize);
            let started = Instant::now();
            while n < MIN_KEYS || !churn_done.load(Ordering::Relaxed) {
                assert!(
                    started.elapsed() < Duration::from_secs(120),
                    "the feeder ran for 120 s: the churn never finished"
                );
                let fresh = n..(n + 10).min(MAX_KEYS);
                n = fresh.end;
                let again = [
                    n - 1 - tick % n.min(7),
                    (tick * 7919) % n,
                    (tick * 104_729 + 13) % n,
                ];
                copies += again.len();
                publish(&p, &topic, fresh.chain(again).map(|i| key(&topic, i))).await;
                published.store(n, Ordering::Relaxed);
                tick += 1;
                tokio::time::sleep(Duration::from_millis(40)).await;
            }
            (n, copies)
        })
    };

    let started = Instant::now();
    let first = start(&s, "p1").await;
    let second = start(&s, "p2").await;
    wait_until(
        "the two processors committed their first inputs",
        Duration::from_secs(30),
        &[&first, &second],
        || first.committed() > 0 && second.committed() > 0,
    )
    .await;
    let mut third_stats = Vec::new();
    for cycle in 0..CYCLES {
        let third = start(&s, &format!("p3-{cycle}")).await;
        // Joined: the rebalance gave it partitions and it committed inputs of them.
        wait_until(
            &format!("cycle {cycle}: the third processor committed inputs after joining"),
            Duration::from_secs(30),
            &[&first, &second, &third],
            || third.committed() > 50,
        )
        .await;
        let (a, b) = (first.committed(), second.committed());
        third_stats.push(third.finish().await);
        // Left: the next rebalance handed its partitions back and both went on.
        wait_until(
            &format!("cycle {cycle}: both processors committed inputs after the third left"),
            Duration::from_secs(30),
            &[&first, &second],
            || first.committed() > a && second.committed() > b,
        )
        .await;
        eprintln!(
            "cycle {cycle} done at {:?}: {} keys published",
            started.elapsed(),
            published.load(Ordering::Relaxed)
        );
    }
    churn_done.store(true, Ordering::Relaxed);
    let (keys, copies) = tokio::time::timeout(Duration::from_secs(60), feeder)
        .await
        .expect("the feeder did not finish within 60 s of the churn")
        .expect("feeder");
    drained(&s, PARTS, keys + copies, &[&first, &second]).await;
    let mut stats = vec![first.finish().await, second.finish().await];
    stats.extend(third_stats);
    eprintln!(
        "{keys} keys + {copies} copies over {PARTS} partitions, {CYCLES} join/leave cycles, \
         drained after {:?}; per processor (p1, p2, p3-0..): {stats:?}",
        started.elapsed()
    );
    assert_each_key_once(&s, keys).await;
    let dropped: u64 = stats.iter().map(|s| s.duplicates).sum();
    assert!(dropped > 0, "business duplicates were dropped: {stats:?}");
}

/// How long the stalling processor's batch lasts: well past its `max.poll.interval.ms`.
const STALL: Duration = Duration::from_secs(9);
/// The stalling processor's `max.poll.interval.ms` (librdkafka wants it >= the session
/// timeout, 6 s here).
const STALL_MAX_POLL_MS: u64 = 6_000;

/// One of two processors stalls inside a batch (its transaction open, outputs and changelog
/// keys sent) past `max.poll.interval.ms`: librdkafka puts it out of the group and the other
/// processor takes its partitions over, records of the stalled batch included. The stalled
/// batch's offsets are then refused, so its transaction aborts and the input is rewound; the
/// processor rejoins (restoring its partitions' keys anew) and goes on. The output holds each
/// key exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_processor_stalled_past_max_poll_interval_aborts_and_each_key_is_output_once() {
    const STALL_PARTS: i32 = 4;
    const KEYS: usize = 400;
    let Some(s) = setup("ctpstall", STALL_PARTS).await else {
        return;
    };
    let stall = Arc::new(AtomicBool::new(false));
    let stalling = start_with(
        &s,
        "stalling",
        STALL_MAX_POLL_MS,
        Some((stall.clone(), STALL)),
    )
    .await;
    let other = start(&s, "other").await;
    // The first half, and copies of every 10th key, all consumed.
    let p = support::publisher(&s.brokers).await;
    let first_half = (0..KEYS / 2).chain((0..KEYS / 2).step_by(10));
    publish(&p, &s.input, first_half.map(|i| key(&s.input, i))).await;
    let first_records = KEYS / 2 + KEYS / 20;
    wait_until(
        "the first half consumed",
        Duration::from_secs(30),
        &[&stalling, &other],
        || stalling.committed() + other.committed() >= first_records,
    )
    .await;
    // The stalling processor's next batch with records stalls: the second half (and copies)
    // gives it some.
    stall.store(true, Ordering::Relaxed);
    publish(
        &p,
        &s.input,
        (KEYS / 2..KEYS)
            .chain((0..KEYS).step_by(7))
            .map(|i| key(&s.input, i)),
    )
    .await;
    wait_until(
        "the stalled batch aborted (a member put out of the group must not commit)",
        Duration::from_secs(60),
        &[&stalling, &other],
        || stalling.aborts.load(Ordering::Relaxed) > 0,
    )
    .await;
    let records = KEYS / 2 + KEYS / 20 + KEYS / 2 + KEYS.div_ceil(7);
    drained(&s, STALL_PARTS, records, &[&stalling, &other]).await;
    let stats = [stalling.finish().await, other.finish().await];
    eprintln!("per processor (stalling, other): {stats:?}");
    assert_each_key_once(&s, KEYS).await;
}
