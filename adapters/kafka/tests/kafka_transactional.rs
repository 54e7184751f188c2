//! Kafka → Kafka exactly once (Flow 2) on the real broker: an aborted transaction's outputs
//! are never seen by read_committed readers, and the rewound input is processed once; a
//! processor *process* killed with SIGKILL mid-transaction (and at a random point), with
//! injected aborts, leaves each input's output exactly once; a zombie with the same
//! transactional id is fenced and the live instance goes on; a business duplicate at a new
//! offset produces no second output (seen keys in a changelog topic written in the same
//! transaction).

mod support;

use idemq_core::publish::{OutgoingMessage, Publisher, DEDUP_HEADER};
use idemq_core::testkit::process::{child_role, ChildProcess};
use idemq_core::KeyStrategy;
use idemq_kafka::{
    BusinessDedup, KafkaProducerConfig, TransactionalProcessor, TxnError, TxnOptions,
};
use std::collections::{HashMap, HashSet};
use std::time::Duration;
use tokio::time::Instant;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aborted_batch_is_invisible_and_its_inputs_are_output_once() {
    let Some(brokers) = support::brokers() else {
        return;
    };
    let input = support::unique("ctp-in");
    let output = support::unique("ctp-out");
    support::create_topic(&brokers, &input, 2).await;
    support::create_topic(&brokers, &output, 1).await;
    let keys: Vec<String> = (0..30).map(|i| format!("{input}-{i:02}")).collect();
    let p = support::publisher(&brokers).await;
    for k in &keys {
        p.publish(OutgoingMessage::new(&input, k.clone()).with_dedup_key(k.clone()))
            .await
            .expect("publish");
    }

    let cfg = KafkaProducerConfig::transactional(&brokers, &support::unique("ctp-txn"));
    let mut proc = TransactionalProcessor::new(&cfg, &format!("{input}-g"), &[input.as_str()])
        .await
        .expect("processor");
    let poison = keys[13].clone();
    let mut failed_once = false;
    let mut aborts = 0;
    let mut done = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while done < keys.len() && tokio::time::Instant::now() < deadline {
        let out = output.clone();
        let r = proc
            .process_batch(10, Duration::from_secs(2), |env| {
                let k = env
                    .headers
                    .get_str(DEDUP_HEADER)
                    .unwrap_or_default()
                    .to_string();
                if k == poison && !failed_once {
                    failed_once = true;
                    return Err(format!("injected failure at {k}"));
                }
                Ok(vec![
                    OutgoingMessage::new(out.clone(), format!("out:{k}")).with_dedup_key(k)
                ])
            })
            .await;
        match r {
            Ok(n) => done += n,
            Err(TxnError::Aborted(_)) => aborts += 1,
            Err(e) => panic!("unexpected transactional failure: {e}"),
        }
    }
    assert_eq!(
        aborts, 1,
        "the injected failure must abort exactly one batch"
    );

    let committed = support::read_all(&brokers, &output, Duration::from_secs(2)).await;
    let mut counts: HashMap<String, u32> = HashMap::new();
    for e in &committed {
        *counts
            .entry(
                e.headers
                    .get_str(DEDUP_HEADER)
                    .unwrap_or_default()
                    .to_string(),
            )
            .or_default() += 1;
    }
    let doubles: Vec<_> = counts.iter().filter(|(_, c)| **c > 1).collect();
    let lost: Vec<_> = keys.iter().filter(|k| !counts.contains_key(*k)).collect();
    assert!(
        doubles.is_empty() && lost.is_empty(),
        "read_committed output: doubles {doubles:?} lost {lost:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zombie_with_the_same_transactional_id_is_fenced() {
    let Some(brokers) = support::brokers() else {
        return;
    };
    let input = support::unique("zombie-in");
    let output = support::unique("zombie-out");
    support::create_topic(&brokers, &input, 1).await;
    support::create_topic(&brokers, &output, 1).await;
    let p = support::publisher(&brokers).await;
    for i in 0..4 {
        p.publish(OutgoingMessage::new(&input, format!("{i}")))
            .await
            .expect("publish");
    }
    let cfg = KafkaProducerConfig::transactional(&brokers, &support::unique("zombie-txn"));
    let group = format!("{input}-g");
    let mut old = TransactionalProcessor::new(&cfg, &group, &[input.as_str()])
        .await
        .expect("old");
    // The new instance takes the id over: the old one is now a zombie.
    let mut new = TransactionalProcessor::new(&cfg, &format!("{group}-new"), &[input.as_str()])
        .await
        .expect("new");
    let mut seen = HashSet::new();
    let out = output.clone();
    let r = loop {
        let r = old
            .process_batch(10, Duration::from_secs(5), |env| {
                seen.insert(env.payload.clone());
                Ok(vec![OutgoingMessage::new(out.clone(), env.payload.clone())])
            })
            .await;
        if !matches!(r, Ok(0)) {
            break r;
        }
    };
    assert!(
        matches!(r, Err(TxnError::Fenced(_))),
        "the zombie must be fenced: {r:?}"
    );
    let visible = support::read_all(&brokers, &output, Duration::from_secs(2)).await;
    assert!(
        visible.is_empty(),
        "a fenced zombie's outputs must stay invisible"
    );
    // The live instance goes on: it consumes the input and commits each output once.
    let mut done = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while done < 4 && tokio::time::Instant::now() < deadline {
        let out = output.clone();
        done += new
            .process_batch(10, Duration::from_secs(2), |env| {
                Ok(vec![OutgoingMessage::new(out.clone(), env.payload.clone())])
            })
            .await
            .expect("the live instance is not fenced");
    }
    assert_eq!(done, 4, "the live instance consumed the input");
    let mut payloads: Vec<_> = support::read_all(&brokers, &output, Duration::from_secs(2))
        .await
        .into_iter()
        .map(|e| e.payload)
        .collect();
    payloads.sort();
    assert_eq!(
        payloads,
        ["0", "1", "2", "3"].map(|p| bytes::Bytes::from(p.as_bytes())),
        "the live instance's outputs, once each"
    );
}

/// Publishes `keys` with the dedup key as the record key (so every copy of a key lands on
/// one input partition, as business dedup requires).
async fn publish_keys(brokers: &str, topic: &str, keys: &[String]) {
    let p = support::publisher(brokers).await;
    let msgs: Vec<OutgoingMessage> = keys
        .iter()
        .map(|k| {
            OutgoingMessage::new(topic, format!("in:{k}"))
                .with_key(k.clone())
                .with_dedup_key(k.clone())
        })
        .collect();
    for r in p.publish_batch(msgs).await {
        r.expect("publish");
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

/// Per key, how many committed outputs `topic` holds.
async fn committed_outputs(brokers: &str, topic: &str) -> HashMap<String, u32> {
    let mut counts: HashMap<String, u32> = HashMap::new();
    for e in support::read_all(brokers, topic, Duration::from_secs(3)).await {
        *counts
            .entry(
                e.headers
                    .get_str(DEDUP_HEADER)
                    .unwrap_or_default()
                    .to_string(),
            )
            .or_default() += 1;
    }
    counts
}

fn dedup(group: &str) -> TxnOptions {
    TxnOptions::default()
        .consumer_property("session.timeout.ms", "6000")
        .consumer_property("heartbeat.interval.ms", "500")
        .dedup({
            let mut d = BusinessDedup::new(KeyStrategy::dedup_header(group).expect("key strategy"));
            d.restore_timeout = Duration::from_secs(20);
            d
        })
}

/// The same business key at new input offsets — in the same batch, in a later batch, after
/// an aborted batch, and after a restart (a new instance restores the seen keys from the
/// changelog) — produces one committed output.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_business_duplicate_at_a_new_offset_produces_no_second_output() {
    let Some(brokers) = support::brokers() else {
        return;
    };
    let input = support::unique("bdup-in");
    let output = support::unique("bdup-out");
    support::create_topic(&brokers, &input, 2).await;
    support::create_topic(&brokers, &output, 1).await;
    let keys: Vec<String> = (0..20).map(|i| format!("{input}-{i:02}")).collect();
    // The originals, then copies of 0..5 at new offsets (some in the same batch).
    publish_keys(&brokers, &input, &keys).await;
    publish_keys(&brokers, &input, &keys[..5]).await;
    let group = format!("{input}-g");
    let cfg = KafkaProducerConfig::transactional(&brokers, &support::unique("bdup-txn"));
    let mut first =
        TransactionalProcessor::with_options(&cfg, &group, &[input.as_str()], dedup(&group))
            .await
            .expect("processor");
    let poison = keys[7].clone();
    let mut failed_once = false;
    let (mut done, mut aborts) = (0, 0);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while done < 25 && tokio::time::Instant::now() < deadline {
        let out = output.clone();
        match first
            .process_batch(8, Duration::from_secs(2), |env| {
                if env.headers.get_str(DEDUP_HEADER) == Some(poison.as_str()) && !failed_once {
                    failed_once = true;
                    return Err("injected failure".into());
                }
                Ok(output_of(&out, env))
            })
            .await
        {
            Ok(n) => done += n,
            Err(TxnError::Aborted(_)) => aborts += 1,
            Err(e) => panic!("unexpected: {e}"),
        }
    }
    assert_eq!((done, aborts), (25, 1), "all inputs consumed, one abort");
    assert_eq!(first.duplicates(), 5, "the five copies are dropped");
    drop(first);

    // Later copies of 5..10 (their originals were committed by the first instance) and one
    // new key, consumed by a new instance: it restores the seen keys from the changelog.
    let late = format!("{input}-20");
    let mut more = keys[5..10].to_vec();
    more.push(late.clone());
    publish_keys(&brokers, &input, &more).await;
    let cfg = KafkaProducerConfig::transactional(&brokers, &support::unique("bdup-txn"));
    let mut second =
        TransactionalProcessor::with_options(&cfg, &group, &[input.as_str()], dedup(&group))
            .await
            .expect("second processor");
    let mut done = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while done < 6 && tokio::time::Instant::now() < deadline {
        let out = output.clone();
        done += second
            .process_batch(8, Duration::from_secs(2), |env| Ok(output_of(&out, env)))
            .await
            .expect("second batch");
    }
    assert_eq!(done, 6);
    assert_eq!(
        second.duplicates(),
        5,
        "copies of keys committed before the restart"
    );

    let counts = committed_outputs(&brokers, &output).await;
    let mut all = keys.clone();
    all.push(late);
    let wrong: Vec<_> = all
        .iter()
        .filter(|k| counts.get(*k) != Some(&1))
        .map(|k| (k, counts.get(k)))
        .collect();
    assert!(
        wrong.is_empty(),
        "each key's output exactly once: {wrong:?}"
    );
    assert_eq!(counts.len(), all.len(), "no other outputs: {counts:?}");
}

const TXN_CHILD: &str = "IDEMQ_KAFKA_TXN_CHILD";
const KILL_TEST: &str = "a_processor_killed_mid_transaction_leaves_each_input_output_once";

/// The child: a transactional processor with business dedup (the same transactional id in
/// every child, as one instance restarted), aborting the first try of every 40th key, and
/// hanging inside the open transaction at `hang` (if given) until it is killed.
async fn txn_child(arg: &str) -> ! {
    let f: Vec<&str> = arg.split('|').collect();
    let (brokers, input, output, group, txn_id, hang) = (f[0], f[1], f[2], f[3], f[4], f[5]);
    let cfg = KafkaProducerConfig::transactional(brokers, txn_id);
    let mut proc = TransactionalProcessor::with_options(&cfg, group, &[input], dedup(group))
        .await
        .expect("child processor");
    let mut failed: HashSet<String> = HashSet::new();
    let mut total = 0;
    loop {
        let out = output.to_string();
        let r = proc
            .process_batch(40, Duration::from_secs(1), |env| {
                let k = env.headers.get_str(DEDUP_HEADER).unwrap_or_default();
                if k == hang {
                    // Earlier inputs' outputs and changelog records are in the open
                    // transaction: the parent kills us here.
                    eprintln!("HANG {k}");
                    loop {
                        std::thread::sleep(Duration::from_secs(60));
                    }
                }
                let n: usize = k
                    .rsplit('-')
                    .next()
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(0);
                if n % 40 == 7 && failed.insert(k.to_string()) {
                    return Err(format!("injected failure at {k}"));
                }
                Ok(output_of(&out, env))
            })
            .await;
        match r {
            Ok(n) => {
                total += n;
                if n > 0 {
                    eprintln!("COMMITTED {total}");
                }
            }
            Err(TxnError::Aborted(why)) => eprintln!("ABORTED {why}"),
            Err(e) => {
                eprintln!("STOPPED {e}");
                std::process::exit(3);
            }
        }
    }
}

fn committed_total(child: &ChildProcess) -> usize {
    child
        .stderr_tail(4096)
        .lines()
        .filter_map(|l| l.strip_prefix("COMMITTED "))
        .filter_map(|n| n.trim().parse().ok())
        .next_back()
        .unwrap_or(0)
}

/// Flow 2 with real process kills: a child killed (SIGKILL) while its transaction is open
/// (outputs and changelog records sent, not committed), a second one killed at a random
/// point, injected aborts in every child, a producer resending keys at new offsets before,
/// between and after the kills; a last child finishes. The read_committed output then holds
/// each input key's output exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_processor_killed_mid_transaction_leaves_each_input_output_once() {
    if let Some(arg) = child_role(TXN_CHILD) {
        txn_child(&arg).await;
    }
    let Some(brokers) = support::brokers() else {
        return;
    };
    const N: usize = 400;
    const PARTS: i32 = 3;
    let input = support::unique("ctpkill-in");
    let output = support::unique("ctpkill-out");
    support::create_topic(&brokers, &input, PARTS).await;
    support::create_topic(&brokers, &output, 1).await;
    let key = |i: usize| format!("{input}-{i:04}");
    let keys: Vec<String> = (0..N).map(key).collect();
    publish_keys(&brokers, &input, &keys).await;
    // A producer resending every 5th key at a new offset.
    let resent: Vec<String> = keys.iter().step_by(5).cloned().collect();
    publish_keys(&brokers, &input, &resent).await;
    let group = format!("{input}-g");
    let txn_id = support::unique("ctpkill-txn");
    let arg = |hang: &str| format!("{brokers}|{input}|{output}|{group}|{txn_id}|{hang}");

    // 1. Killed inside an open transaction.
    let hang = key(N / 2);
    let mut child = ChildProcess::spawn_self(KILL_TEST, TXN_CHILD, &arg(&hang)).expect("child");
    let deadline = Instant::now() + Duration::from_secs(120);
    while !child.stderr_tail(4096).contains("HANG") {
        assert!(
            Instant::now() < deadline,
            "child 1 never reached {hang}: {}",
            child.stderr_tail(4000)
        );
        if let Ok(Some(s)) = child.try_wait() {
            panic!("child 1 exited: {s}: {}", child.stderr_tail(4000));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let committed_1 = committed_total(&child);
    // Every child's log: the injected failures may all fall to the earlier children (the
    // last one may only see keys that are done), so the aborts are looked for in all.
    let mut logs = child.stderr_tail(64_000);
    child.kill().expect("SIGKILL");
    eprintln!("child 1 killed mid-transaction at {hang} after {committed_1} committed inputs");
    publish_keys(&brokers, &input, &keys[..30]).await;

    // 2. Killed at a random point.
    let mut child = ChildProcess::spawn_self(KILL_TEST, TXN_CHILD, &arg("-")).expect("child");
    let target = 40 + (std::process::id() as usize % 80);
    let deadline = Instant::now() + Duration::from_secs(120);
    while committed_total(&child) < target {
        assert!(
            Instant::now() < deadline,
            "child 2 made no progress: {}",
            child.stderr_tail(4000)
        );
        if let Ok(Some(s)) = child.try_wait() {
            panic!("child 2 exited: {s}: {}", child.stderr_tail(4000));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(u64::from(std::process::id() % 200))).await;
    child.kill().expect("SIGKILL");
    logs.push_str(&child.stderr_tail(64_000));
    eprintln!(
        "child 2 killed after {} committed inputs",
        committed_total(&child)
    );
    publish_keys(&brokers, &input, &keys[N - 30..]).await;

    // 3. The last one runs until the group's committed offsets reach the end of the input.
    let ends = support::high_watermarks(&brokers, &input, PARTS);
    assert_eq!(ends.iter().sum::<i64>() as usize, N + resent.len() + 60);
    let mut child = ChildProcess::spawn_self(KILL_TEST, TXN_CHILD, &arg("-")).expect("child");
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let now = support::committed_offsets(&brokers, &group, &input, PARTS);
        if now == ends {
            break;
        }
        if Instant::now() > deadline {
            panic!(
                "the last child did not finish: committed {now:?}, ends {ends:?}\n{}",
                child.stderr_tail(8000)
            );
        }
        if let Ok(Some(s)) = child.try_wait() {
            panic!("child 3 exited: {s}: {}", child.stderr_tail(8000));
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    logs.push_str(&child.stderr_tail(64_000));
    child.kill().expect("stop the last child");
    assert!(logs.contains("ABORTED"), "the injected aborts ran: {logs}");

    let counts = committed_outputs(&brokers, &output).await;
    let wrong: Vec<_> = keys
        .iter()
        .filter(|k| counts.get(*k) != Some(&1))
        .map(|k| (k.clone(), counts.get(k).copied()))
        .take(10)
        .collect();
    assert!(
        wrong.is_empty(),
        "each input's output exactly once in the read_committed output: {wrong:?}"
    );
    assert_eq!(counts.len(), N, "no other outputs");
}
