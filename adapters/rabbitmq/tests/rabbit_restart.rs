//! The broker restarts mid-run: the source reconnects with back-off, deliveries of the old
//! channel go stale, and every message changes the world once. Its own test binary, because
//! it restarts the shared broker (`IDEMQ_TEST_RABBITMQ_RESTART_CMD`).

mod support;

use idemq_core::{ConsumerConfig, MemoryStore, OutgoingMessage, Publisher};
use idemq_rabbitmq::QueueType;
use std::sync::Arc;
use std::time::Duration;

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
    let Some(url) = support::amqp_url() else {
        return;
    };
    let Ok(restart) = std::env::var("IDEMQ_TEST_RABBITMQ_RESTART_CMD") else {
        eprintln!("skipped: IDEMQ_TEST_RABBITMQ_RESTART_CMD is not set");
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
        let out = tokio::process::Command::new("sh")
            .arg("-c")
            .arg(&restart)
            .output()
            .await
            .expect("run the restart command");
        assert!(
            out.status.success(),
            "restart failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
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
