//! The broker restarts mid-run: the source reconnects with back-off, deliveries of the old
//! channel go stale, and every message changes the world once; messages parked in a retry
//! tier come back after the restart. Its own test binary, because it restarts the shared
//! broker (`IDEMQ_TEST_RABBITMQ_RESTART_CMD`); its tests take turns.

mod support;

use idemq_core::{ConsumerConfig, MemoryStore, OutgoingMessage, Publisher, Source};
use idemq_rabbitmq::QueueType;
use std::sync::Arc;
use std::time::Duration;

/// One broker restart at a time.
static RESTARTS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The broker's URL, its restart command and this test's turn to restart it; `None` (the
/// test is skipped) without a broker or without `IDEMQ_TEST_RABBITMQ_RESTART_CMD`, as
/// `idemq_core::testkit::servers::server_url` decides (a panic under `IDEMQ_REQUIRE_SERVERS=1`,
/// whose environment exports the command with the URL).
async fn restart_turn() -> Option<(String, String, tokio::sync::MutexGuard<'static, ()>)> {
    let url = support::amqp_url()?;
    let restart = idemq_core::testkit::servers::server_url("IDEMQ_TEST_RABBITMQ_RESTART_CMD")?;
    Some((url, restart, RESTARTS.lock().await))
}

async fn restart_broker(cmd: &str) {
    let out = tokio::process::Command::new("sh")
        .arg("-c")
        .arg(cmd)
        .output()
        .await
        .expect("run the restart command");
    assert!(
        out.status.success(),
        "restart failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

async fn publish_range(p: &dyn Publisher, q: &str, range: std::ops::Range<u32>) {
    for i in range {
        let k = format!("order-{i:03}");
        let m = OutgoingMessage::new(q, "{}").with_dedup_key(k.clone());
        // Across the restart a publish may fail or be ambiguous: resend with the same key.
        let mut tries = 0;
        while let Err(e) = p.publish(m.clone()).await {
            tries += 1;
            assert!(tries < 100, "publish {k} kept failing: {e}");
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_broker_restart_mid_run_loses_nothing_and_applies_nothing_twice() {
    let Some((url, restart, _turn)) = restart_turn().await else {
        return;
    };
    let q = support::fresh_queue("restart");
    let src = support::source(support::config(&url, &q, QueueType::Quorum).prefetch(100)).await;
    let p = support::publisher(&url).await;
    publish_range(&p, &q, 0..100).await;

    let effects = support::Effects::default();
    // Slow enough that the restart finds deliveries in flight.
    let work = Duration::from_millis(20);
    let store = Arc::new(MemoryStore::new());
    let consumer =
        support::counting_consumer(store, "shipping", effects.clone(), work, Default::default())
            .with_config(ConsumerConfig {
                max_batch: 20,
                ..ConsumerConfig::default()
            });
    let progress = effects.clone();
    let url2 = url.clone();
    let q2 = q.clone();
    let driver = tokio::spawn(async move {
        while support::applied(&progress) < 10 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let t = std::time::Instant::now();
        restart_broker(&restart).await;
        eprintln!("broker restarted in {:?}", t.elapsed());
        let p = support::publisher(&url2).await;
        publish_range(&p, &q2, 100..150).await;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
        while support::applied(&progress) < 150 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    });
    let mut src = src;
    let stop = async {
        let _ = (&mut { driver }).await;
    };
    consumer.run(&mut src, stop).await.expect("run");
    let expected: Vec<String> = (0..150).map(|i| format!("order-{i:03}")).collect();
    let (doubles, lost) = support::double_and_lost(&effects, &expected);
    assert_eq!(
        (doubles, lost),
        (0, 0),
        "double_effects={doubles} lost={lost}"
    );
    support::delete_queues(&url, &[q.clone(), format!("{q}.dlq")]).await;
}

/// Nacked messages wait in a retry tier; the broker restarts while they do, and their TTL ends
/// during the restart. They come back to the queue, all of them: a tier dead-letters at least
/// once (a classic tier's default at-most-once dead-lettering dropped what it expired while
/// the quorum queue was still recovering — docs/reliability.md). Not at once: the broker's
/// dead-letter worker does not find the exchange right after the restart and tries again
/// after `dead_letter_worker_publisher_confirm_timeout` (3 min by default), hence the wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_parked_in_a_retry_tier_come_back_after_a_broker_restart() {
    let Some((url, restart, _turn)) = restart_turn().await else {
        return;
    };
    let q = support::fresh_queue("parked-restart");
    let mut src = support::source(support::config(&url, &q, QueueType::Quorum)).await;
    let p = support::publisher(&url).await;
    let keys: Vec<String> = (0..20).map(|i| format!("parked-{i:02}")).collect();
    for k in &keys {
        p.publish(OutgoingMessage::new(q.clone(), "{}").with_dedup_key(k.clone()))
            .await
            .expect("publish");
    }
    let mut parked = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while parked < keys.len() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "only {parked} delivered"
        );
        let Ok(Ok(Some(batch))) =
            tokio::time::timeout(Duration::from_secs(5), src.poll(keys.len())).await
        else {
            continue;
        };
        for d in batch {
            // The 2 s tier: shorter than the restart, so every TTL ends while it runs.
            d.nack(Duration::from_secs(2)).await.expect("park");
            parked += 1;
        }
    }
    src.close().await.expect("close");
    restart_broker(&restart).await;
    let mut back: Vec<String> = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(270);
    while back.len() < keys.len() && tokio::time::Instant::now() < deadline {
        // The queue may still be electing its leader: a failed look is retried.
        let got =
            tokio::time::timeout(Duration::from_secs(10), support::try_take_all(&url, &q)).await;
        for env in got.ok().flatten().unwrap_or_default() {
            if let Some(k) = env.message_id {
                back.push(k);
            }
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    back.sort();
    assert_eq!(
        back, keys,
        "the parked messages that came back after the restart"
    );
    let tiers = [2_000].map(|t| idemq_rabbitmq::retry_queue_name(&q, t));
    let mut queues = vec![q.clone(), format!("{q}.dlq")];
    queues.extend(tiers);
    support::delete_queues(&url, &queues).await;
}

/// The stream URL, a fresh stream, the broker's restart command and this test's turn to run
/// it, and a publisher to the stream whose confirms time out after 2 s (the ones left
/// unanswered by the restart fail fast); `None` (the test is skipped) without a stream
/// broker or without `IDEMQ_TEST_RABBITMQ_RESTART_CMD`.
#[cfg(feature = "streams")]
async fn stream_restart_turn(
    what: &str,
) -> Option<(
    String,
    String,
    String,
    tokio::sync::MutexGuard<'static, ()>,
    idemq_rabbitmq::stream::StreamPublisher,
)> {
    use idemq_rabbitmq::stream::{StreamPublisher, StreamPublisherConfig};
    let (_, restart, turn) = restart_turn().await?;
    let url = support::stream_url()?;
    let stream = support::fresh_queue(what);
    let mut cfg = StreamPublisherConfig::new(&url, &stream);
    cfg.confirm_timeout = Duration::from_secs(2);
    let publisher = StreamPublisher::connect(cfg)
        .await
        .expect("stream publisher");
    Some((url, stream, restart, turn, publisher))
}

/// A stream publisher publishes again after a broker restart, without being rebuilt. The
/// stream client neither marks its producer closed when the connection drops nor answers
/// the confirms it was waiting for: before the publisher opened a new producer after a
/// failed send or an unanswered confirm, every publish after a restart timed out, for good.
#[cfg(feature = "streams")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_publisher_publishes_again_after_a_broker_restart() {
    use idemq_rabbitmq::stream::{delete_stream, read_stream};
    let Some((url, stream, restart, _turn, p)) = stream_restart_turn("stream-restart").await else {
        return;
    };
    publish_range(&p, &stream, 0..10).await;
    restart_broker(&restart).await;
    // Each key until confirmed (publish_range gives up after 100 tries).
    publish_range(&p, &stream, 10..20).await;
    let mut stored: Vec<String> = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while stored.len() < 20 && tokio::time::Instant::now() < deadline {
        // The stream may still be electing its leader: a failed read is retried.
        if let Ok(all) = read_stream(&url, &stream, Duration::from_secs(1)).await {
            stored = all.into_iter().filter_map(|e| e.message_id).collect();
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    stored.sort();
    stored.dedup();
    let expected: Vec<String> = (0..20).map(|i| format!("order-{i:03}")).collect();
    assert_eq!(stored, expected, "what the stream holds after the restart");
    let _ = delete_stream(&url, &stream).await;
}

/// A stream source dead-letters again after a broker restart. Its dead-letter producer is
/// opened at the first reject and, like the publisher's, is never marked closed by the stream
/// client: it is dropped after a failed send or an unanswered confirm (the reject becomes a
/// nack, so the message comes back) and the next reject opens a new one.
#[cfg(feature = "streams")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_source_dead_letters_again_after_a_broker_restart() {
    use idemq_rabbitmq::stream::{delete_stream, StreamSource, StreamSourceConfig};
    let Some((url, stream, restart, _turn, publisher)) =
        stream_restart_turn("stream-dlq-restart").await
    else {
        return;
    };
    let mut cfg = StreamSourceConfig::new(&url, &stream, "dlq-restart");
    cfg.confirm_timeout = Duration::from_secs(2);
    let mut src = StreamSource::connect(cfg).await.expect("stream source");
    // The first reject opens the dead-letter producer; the restart kills its connection.
    publish_range(&publisher, &stream, 0..1).await;
    reject_until_dead_lettered(&mut src, &url, &stream, "order-000").await;
    restart_broker(&restart).await;
    publish_range(&publisher, &stream, 1..2).await;
    reject_until_dead_lettered(&mut src, &url, &stream, "order-001").await;
    src.close().await.expect("close");
    for s in [stream.clone(), format!("{stream}.dlq")] {
        let _ = delete_stream(&url, &s).await;
    }
}

/// Rejects `key` whenever the source delivers it, until the dead-letter stream holds it.
#[cfg(feature = "streams")]
async fn reject_until_dead_lettered(
    src: &mut idemq_rabbitmq::stream::StreamSource,
    url: &str,
    stream: &str,
    key: &str,
) {
    let dlq = format!("{stream}.dlq");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{key} never reached {dlq}"
        );
        if let Ok(Ok(Some(batch))) =
            tokio::time::timeout(Duration::from_secs(5), src.poll(10)).await
        {
            for d in batch {
                // An earlier key read again from the stored offset after the restart: done.
                if d.envelope.message_id.as_deref() != Some(key) {
                    let _ = d.ack().await;
                    continue;
                }
                // A failed reject nacks instead: the message comes back for another try.
                if let Err(e) = d.reject("rejected by the test").await {
                    eprintln!("reject of {key} failed (it comes back): {e}");
                }
            }
        }
        if let Ok(all) =
            idemq_rabbitmq::stream::read_stream(url, &dlq, Duration::from_millis(500)).await
        {
            if all.iter().any(|e| e.message_id.as_deref() == Some(key)) {
                return;
            }
        }
    }
}
