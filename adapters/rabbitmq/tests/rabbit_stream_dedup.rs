//! Broker-side deduplication of a named stream producer (feature `streams`): the same
//! publishing id sent twice is stored once — by one producer, and after the producer
//! *process* restarts (a new process with the same name resends ids the broker already
//! stored; one of them SIGKILLed mid-send). An unnamed producer, as a control, stores both.

mod support;

use idemq_core::testkit::process::{child_role, ChildProcess};
use idemq_core::{OutgoingMessage, Publisher};
use idemq_rabbitmq::stream::{
    delete_stream, last_publishing_id, read_stream, StreamPublisher, StreamPublisherConfig,
    PUBLISHING_ID_HEADER,
};
use std::collections::BTreeMap;
use std::time::Duration;

const ROLE: &str = "IDEMQ_RABBIT_STREAM_PRODUCER_CHILD";
const TEST: &str = "a_named_producer_stores_each_publishing_id_once_across_process_restarts";

fn message(stream: &str, id: u64) -> OutgoingMessage {
    OutgoingMessage::new(stream, format!("{{\"order\":{id}}}"))
        .with_dedup_key(format!("order-{id}"))
        .with_header(PUBLISHING_ID_HEADER, id.to_string())
}

async fn named(url: &str, stream: &str, name: &str) -> StreamPublisher {
    StreamPublisher::connect(StreamPublisherConfig::new(url, stream).named(name))
        .await
        .expect("named stream producer")
}

/// The child: a producer process that resends `from..=to` one at a time (each confirmed),
/// saying first where the broker's sequence stands.
async fn child(arg: &str) -> ! {
    let f: Vec<&str> = arg.split('|').collect();
    let (stream, name) = (f[0], f[1]);
    let (from, to): (u64, u64) = (f[2].parse().expect("from"), f[3].parse().expect("to"));
    let url = support::stream_url().expect("stream url in the child");
    let p = named(&url, stream, name).await;
    let last = p.last_publishing_id().await.expect("last publishing id");
    eprintln!("child: broker's last publishing id {last:?}; sending {from}..={to}");
    for id in from..=to {
        p.publish(message(stream, id)).await.expect("publish");
    }
    std::process::exit(0)
}

/// Stored messages of `stream` per publishing id.
async fn stored(url: &str, stream: &str) -> BTreeMap<u64, usize> {
    let mut out = BTreeMap::new();
    for e in read_stream(url, stream, Duration::from_secs(1))
        .await
        .expect("read stream")
    {
        let id = e.headers.get_str(PUBLISHING_ID_HEADER).expect("id header");
        *out.entry(id.parse::<u64>().expect("id")).or_default() += 1;
        assert_eq!(e.message_id, Some(format!("order-{id}")));
    }
    out
}

fn run_child(stream: &str, name: &str, from: u64, to: u64) -> String {
    let arg = format!("{stream}|{name}|{from}|{to}");
    let mut c = ChildProcess::spawn_self(TEST, ROLE, &arg).expect("spawn producer");
    let status = c.wait_or_kill(Duration::from_secs(120)).expect("wait");
    let err = c.stderr_tail(4000);
    assert!(
        status.success(),
        "producer {from}..={to} failed ({status}):\n{err}"
    );
    err
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_named_producer_stores_each_publishing_id_once_across_process_restarts() {
    if let Some(arg) = child_role(ROLE) {
        child(&arg).await;
    }
    let Some(url) = support::stream_url() else {
        return;
    };
    let stream = support::fresh_queue("stream-dedup");
    let name = format!("{stream}.producer");

    // One producer: the same publishing id twice, one at a time and within a batch.
    let p = named(&url, &stream, &name).await;
    assert_eq!(p.last_publishing_id().await.expect("sequence"), None);
    for id in [1, 1, 2] {
        p.publish(message(&stream, id)).await.expect("publish");
    }
    let batch = [3, 2, 4, 3].map(|id| message(&stream, id)).to_vec();
    for r in p.publish_batch(batch).await {
        r.expect("a resent id is still confirmed");
    }
    assert_eq!(p.last_publishing_id().await.expect("sequence"), Some(4));
    drop(p);

    // Producer processes: each starts where its data says, resending ids already stored.
    let err = run_child(&stream, &name, 3, 60);
    assert!(err.contains("last publishing id Some(4)"), "{err}");
    let err = run_child(&stream, &name, 30, 100);
    assert!(err.contains("last publishing id Some(60)"), "{err}");

    // One killed mid-send, then restarted from the same point.
    let arg = format!("{stream}|{name}|101|100000");
    let mut c = ChildProcess::spawn_self(TEST, ROLE, &arg).expect("spawn producer");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let reached = loop {
        // Asked by name, without declaring a second live producer of that name.
        let seq = last_publishing_id(&url, &stream, &name)
            .await
            .ok()
            .flatten();
        if seq.is_some_and(|s| s >= 150) || std::time::Instant::now() > deadline {
            break seq;
        }
        if let Ok(Some(status)) = c.try_wait() {
            panic!(
                "the producer exited early ({status}):\n{}",
                c.stderr_tail(4000)
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    c.kill().expect("SIGKILL");
    eprintln!("producer killed after the broker stored publishing id {reached:?}");
    assert!(
        reached.is_some_and(|s| s >= 150),
        "the producer made no progress"
    );
    let err = run_child(&stream, &name, 101, 300);
    assert!(err.contains("last publishing id Some("), "{err}");

    let got = stored(&url, &stream).await;
    let twice: Vec<_> = got.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        twice.is_empty(),
        "publishing ids stored more than once: {twice:?}"
    );
    let highest = *got.keys().last().expect("something stored");
    assert!(highest >= 300, "highest stored id {highest}");
    let missing: Vec<u64> = (1..=300).filter(|id| !got.contains_key(id)).collect();
    assert!(missing.is_empty(), "ids lost: {missing:?}");
    eprintln!(
        "{} messages stored for ids 1..={highest}, each once, after resends by 3 producer processes and one SIGKILL",
        got.values().sum::<usize>()
    );

    // Control: an unnamed producer does not deduplicate.
    let control = support::fresh_queue("stream-nodedup");
    let p = StreamPublisher::connect(StreamPublisherConfig::new(&url, &control))
        .await
        .expect("unnamed producer");
    for _ in 0..2 {
        p.publish(message(&control, 1)).await.expect("publish");
    }
    assert_eq!(stored(&url, &control).await.get(&1), Some(&2));
    drop(p);
    for s in [&stream, &control] {
        let _ = delete_stream(&url, s).await;
    }
}
