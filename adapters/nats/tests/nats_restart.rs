//! The NATS server restarts while a consumer runs (`IDEMQ_TEST_NATS_RESTART_CMD`: stop and
//! start, JetStream data kept): the client reconnects, acks and settlements lost in the
//! outage come back as redeliveries the dedup store absorbs, and every message changes the
//! world once. Its own test binary, because it restarts the shared server.

mod support;

use idemq_core::{
    ClaimedMessage, ConsumerConfig, HandlerError, IdempotentConsumer, KeyStrategy, MemoryStore,
    OutgoingMessage, Publisher, DEDUP_HEADER,
};
use std::sync::Arc;
use std::time::Duration;

/// Runs the restart command; its output is shown when it fails.
async fn restart_server(cmd: &str) {
    let took = std::time::Instant::now();
    let run = tokio::process::Command::new("sh")
        .args(["-c", cmd])
        .output()
        .await;
    match run {
        Ok(o) if o.status.success() => eprintln!("nats restarted in {:?}", took.elapsed()),
        Ok(o) => panic!(
            "`{cmd}` exited {}: {}",
            o.status,
            String::from_utf8_lossy(&o.stderr)
        ),
        Err(e) => panic!("cannot run `{cmd}`: {e}"),
    }
}

/// Publishes `order-<i>` for `range`, each until a `PubAck` says it is stored: across the
/// restart a publish may fail or be ambiguous, and a resend with the same key is stored once.
async fn publish_until_stored(p: &dyn Publisher, subject: &str, range: std::ops::Range<u32>) {
    let keys = range.map(|i| format!("order-{i:03}"));
    for (key, mut attempt) in keys.zip(std::iter::repeat(0u32)) {
        let m = OutgoingMessage::new(subject, "{}").with_dedup_key(key.as_str());
        loop {
            match p.publish(m.clone()).await {
                Ok(_) => break,
                Err(e) if attempt >= 200 => panic!("{key} never stored: {e}"),
                Err(_) => attempt += 1,
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_server_restart_mid_run_loses_nothing_and_applies_nothing_twice() {
    let Some(url) = support::nats_url() else {
        return;
    };
    let Some(restart) = idemq_core::testkit::servers::server_url("IDEMQ_TEST_NATS_RESTART_CMD")
    else {
        return;
    };
    let names = support::Names::fresh("restart");
    let mut src = support::source(support::config(&url, &names)).await;
    let p = support::publisher(&url).await;
    publish_until_stored(&p, &names.subject, 0..100).await;

    let tally = support::Tally::default();
    let effect = {
        let tally = tally.clone();
        move |m: ClaimedMessage| {
            let tally = tally.clone();
            async move {
                // Slow enough that the restart finds deliveries in flight.
                tokio::time::sleep(Duration::from_millis(20)).await;
                tally.count(m.envelope.headers.get_str(DEDUP_HEADER).unwrap_or_default());
                Ok::<_, HandlerError>(None)
            }
        }
    };
    let consumer = IdempotentConsumer::new(
        Arc::new(MemoryStore::new()),
        KeyStrategy::dedup_header("shipping").expect("group"),
        effect,
    )
    .with_config(ConsumerConfig {
        max_batch: 20,
        ..ConsumerConfig::default()
    });
    let driver = {
        let (tally, url, subject) = (tally.clone(), url.clone(), names.subject.clone());
        tokio::spawn(async move {
            while tally.applied() < 10 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            restart_server(&restart).await;
            // The publisher from before the restart reconnects by itself.
            let p = support::publisher(&url).await;
            publish_until_stored(&p, &subject, 100..150).await;
            let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
            while tally.applied() < 150 && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            // Redeliveries of acks lost in the outage come after AckWait: let them arrive,
            // so a double effect would show.
            tokio::time::sleep(Duration::from_secs(6)).await;
        })
    };
    let stop = async {
        let _ = driver.await;
    };
    consumer.run(&mut src, stop).await.expect("run");
    let expected: Vec<String> = (0..150).map(|i| format!("order-{i:03}")).collect();
    let (doubles, lost) = tally.doubles_and_lost(&expected);
    assert!(
        doubles.is_empty() && lost.is_empty(),
        "double_effects={} lost={} (doubles {doubles:?}, lost {lost:?})",
        doubles.len(),
        lost.len()
    );
    // The publisher's resends across the restart were stored once each.
    let stored = support::read_stream(&url, &names.stream)
        .await
        .expect("read the stream after the restart");
    assert_eq!(stored.len(), 150, "messages stored: one per key");
    let dlq = support::config(&url, &names).dead_letter_stream_name();
    support::delete_streams(&url, &[names.stream, dlq]).await;
}
