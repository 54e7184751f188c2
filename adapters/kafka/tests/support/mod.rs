//! Shared fixtures for the Kafka tests: the broker address, fresh topics, consumers, and a
//! dead-letter reader. Every test gets its own topics and consumer groups, so tests run in
//! parallel against one broker.
#![allow(dead_code)]

use idemq_core::envelope::Envelope;
use idemq_kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use idemq_kafka::rdkafka::client::DefaultClientContext;
use idemq_kafka::rdkafka::consumer::{BaseConsumer, Consumer};
use idemq_kafka::rdkafka::{ClientConfig, Offset, TopicPartitionList};
use idemq_kafka::{KafkaProducerConfig, KafkaPublisher, KafkaSource, KafkaSourceConfig};
use std::time::Duration;

/// The test broker, or `None` to skip; panics when `IDEMQ_REQUIRE_SERVERS=1` demands one.
pub fn brokers() -> Option<String> {
    idemq_core::testkit::servers::server_url("IDEMQ_TEST_KAFKA_BROKERS")
}

/// A name no other test run uses.
pub fn unique(prefix: &str) -> String {
    format!("{prefix}-{:08x}", rand_u32())
}

fn rand_u32() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default(),
    );
    h.finish() as u32
}

/// Creates `topic` with `partitions` partitions (replication 1) and waits for it.
pub async fn create_topic(brokers: &str, topic: &str, partitions: i32) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .expect("admin client");
    let t = NewTopic::new(topic, partitions, TopicReplication::Fixed(1));
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(20)));
    let res = admin
        .create_topics([&t], &opts)
        .await
        .expect("create_topics");
    for r in res {
        if let Err((name, code)) = r {
            if code != idemq_kafka::rdkafka::types::RDKafkaErrorCode::TopicAlreadyExists {
                panic!("create topic {name}: {code}");
            }
        }
    }
}

/// An idempotent publisher.
pub async fn publisher(brokers: &str) -> KafkaPublisher {
    KafkaPublisher::connect(&KafkaProducerConfig::idempotent(brokers))
        .await
        .expect("publisher")
}

/// Source settings tuned for tests: fast group joins and commits.
pub fn source_config(brokers: &str, group: &str, topic: &str) -> KafkaSourceConfig {
    let mut c = KafkaSourceConfig::new(brokers, group, &[topic])
        .cluster("test")
        .set("session.timeout.ms", "6000")
        .set("heartbeat.interval.ms", "500")
        .set("topic.metadata.refresh.interval.ms", "1000");
    c.commit_interval = Duration::from_millis(500);
    c
}

/// A subscribed source.
pub async fn subscribe(brokers: &str, group: &str, topic: &str) -> KafkaSource {
    KafkaSource::connect(source_config(brokers, group, topic))
        .await
        .expect("source")
}

/// Every record of `topic` (all partitions) as envelopes, read from the beginning until
/// `quiet` passes without a new one.
pub async fn read_all(brokers: &str, topic: &str, quiet: Duration) -> Vec<Envelope> {
    let brokers = brokers.to_string();
    let topic = topic.to_string();
    tokio::task::spawn_blocking(move || {
        let c: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .set("group.id", unique("reader"))
            .set("enable.auto.commit", "false")
            .set("isolation.level", "read_committed")
            .create()
            .expect("reader");
        let md = c
            .fetch_metadata(Some(&topic), Duration::from_secs(10))
            .expect("metadata");
        let mut tpl = TopicPartitionList::new();
        for t in md.topics().iter().filter(|t| t.name() == topic) {
            for p in t.partitions() {
                tpl.add_partition_offset(&topic, p.id(), Offset::Beginning)
                    .expect("tpl");
            }
        }
        c.assign(&tpl).expect("assign");
        let mut out = Vec::new();
        let mut last = std::time::Instant::now();
        while last.elapsed() < quiet {
            if let Some(Ok(m)) = c.poll(Duration::from_millis(100)) {
                out.push(idemq_kafka::to_envelope(&m, None));
                last = std::time::Instant::now();
            }
        }
        out
    })
    .await
    .expect("reader thread")
}

/// `group`'s committed offsets on partitions `0..partitions` of `topic` (0 where none).
pub fn committed_offsets(brokers: &str, group: &str, topic: &str, partitions: i32) -> Vec<i64> {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("isolation.level", "read_committed")
        .create()
        .expect("offsets client");
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition(topic, p);
    }
    match c.committed_offsets(tpl, Duration::from_secs(10)) {
        Ok(t) => t
            .elements()
            .iter()
            .map(|e| match e.offset() {
                Offset::Offset(o) => o,
                _ => 0,
            })
            .collect(),
        Err(_) => vec![0; partitions as usize],
    }
}

/// The end (high watermark) of partitions `0..partitions` of `topic`.
pub fn high_watermarks(brokers: &str, topic: &str, partitions: i32) -> Vec<i64> {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .expect("watermark client");
    (0..partitions)
        .map(|p| {
            c.fetch_watermarks(topic, p, Duration::from_secs(10))
                .expect("watermarks")
                .1
        })
        .collect()
}
