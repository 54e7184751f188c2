//! `idemq consume` against the real Kafka broker: producer duplicates are skipped and each
//! message processed is printed once as a JSON line.
#![cfg(all(feature = "cli", feature = "kafka", feature = "sqlite"))]

mod support;

use idemq::kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use idemq::kafka::rdkafka::client::DefaultClientContext;
use idemq::kafka::rdkafka::ClientConfig;
use idemq::kafka::{KafkaProducerConfig, KafkaPublisher};
use idemq::{OutgoingMessage, Publisher};
use std::collections::BTreeSet;
use std::time::Duration;
use support::server_url;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consume_prints_each_kafka_message_once_and_skips_the_resends() {
    let Some(brokers) = server_url("IDEMQ_TEST_KAFKA_BROKERS") else {
        return;
    };
    let topic = format!("idemq_cli_consume_{:08x}", rand::random::<u32>());
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .create()
        .expect("admin");
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(20)));
    for r in admin
        .create_topics(
            [&NewTopic::new(&topic, 2, TopicReplication::Fixed(1))],
            &opts,
        )
        .await
        .expect("create topic")
    {
        r.expect("topic created");
    }
    let publisher =
        KafkaPublisher::new(&KafkaProducerConfig::idempotent(&brokers)).expect("publisher");
    // 20 payments, the first 5 resent by the provider with the same payment id.
    let batch = (0..20)
        .chain(0..5)
        .map(|i| {
            OutgoingMessage::new(
                &topic,
                format!("{{\"payment_id\":\"pay-{i}\",\"amount\":{i}}}"),
            )
        })
        .collect();
    for r in publisher.publish_batch(batch).await {
        r.expect("confirmed");
    }
    let dir = std::env::temp_dir().join(format!("idemq-cli-consume-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let store = format!("sqlite://{}?mode=rwc", dir.join("dedup.db").display());
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_idemq"))
        .args([
            "consume",
            "--broker",
            &format!("kafka://{brokers}/{topic}"),
            "--store",
            &store,
            "--key",
            "json:/payment_id",
            "--group",
            &format!("{topic}-g"),
            "--idle-exit",
            "10",
        ])
        .output();
    let out = tokio::time::timeout(Duration::from_secs(120), out)
        .await
        .expect("consume exits when idle")
        .expect("run idemq consume");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let lines: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    let keys: BTreeSet<&str> = lines.iter().filter_map(|v| v["key"].as_str()).collect();
    assert_eq!(lines.len(), 20, "one line per payment:\n{stdout}\n{stderr}");
    assert_eq!(keys.len(), 20, "{stdout}");
    assert!(
        lines.iter().all(|v| v["source"] == topic.as_str()),
        "{stdout}"
    );
    assert!(
        stderr.contains("processed=20 duplicates_skipped=5"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
