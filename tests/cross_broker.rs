//! One consumer, three brokers: the same payment callbacks arrive through Kafka, RabbitMQ
//! and RocketMQ (a provider that retries on every channel it knows), one handler and one
//! PostgreSQL store serve all three sources at once, and each payment is applied once.
//!
//! Needs the servers of `scripts/servers.sh` (`eval "$(scripts/servers.sh env)"`); skipped
//! without them unless `IDEMQ_REQUIRE_SERVERS=1`.
#![cfg(all(
    feature = "kafka",
    feature = "rabbitmq",
    feature = "rocketmq",
    feature = "postgres"
))]

use idemq::kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use idemq::kafka::rdkafka::client::DefaultClientContext;
use idemq::kafka::rdkafka::ClientConfig;
use idemq::kafka::{KafkaProducerConfig, KafkaPublisher, KafkaSource, KafkaSourceConfig};
use idemq::rabbitmq::{QueueType, RabbitPublisher, RabbitSource, RabbitSourceConfig};
use idemq::rocketmq::{RocketPublisher, RocketPublisherConfig, RocketSource, RocketSourceConfig};
use idemq::sql::{PgStore, SqlStoreOptions, TableName};
use idemq::{
    BrokerKind, ClaimedMessage, ConsumerConfig, HandlerError, IdempotentConsumer, KeyStrategy,
    OutgoingMessage, Publisher, Source,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The four servers, or `None` when the test must not run (`idemq_core::testkit::servers`).
fn servers() -> Option<[String; 4]> {
    use idemq_core::testkit::servers::server_url;
    Some([
        server_url("IDEMQ_TEST_KAFKA_BROKERS")?,
        server_url("IDEMQ_TEST_AMQP_URL")?,
        server_url("IDEMQ_TEST_ROCKETMQ_NAMESRV")?,
        server_url("IDEMQ_TEST_POSTGRES_URL")?,
    ])
}

fn unique(what: &str) -> String {
    format!("idemq_x_{what}_{:08x}", rand::random::<u32>())
}

async fn create_topic(brokers: &str, topic: &str) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .expect("admin client");
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(20)));
    let created = admin
        .create_topics(
            [&NewTopic::new(topic, 2, TopicReplication::Fixed(1))],
            &opts,
        )
        .await
        .expect("create_topics");
    for r in created {
        r.unwrap_or_else(|(name, code)| panic!("create topic {name}: {code}"));
    }
}

const PAYMENTS: usize = 60;

fn callback(destination: &str, i: usize) -> OutgoingMessage {
    OutgoingMessage::new(
        destination,
        format!(
            "{{\"payment_id\":\"pay-{i:03}\",\"amount_cents\":{}}}",
            100 + i
        ),
    )
    .with_dedup_key(format!("pay-{i:03}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_payment_delivered_through_kafka_rabbitmq_and_rocketmq_is_applied_once() {
    let Some([kafka, amqp, namesrv, postgres]) = servers() else {
        return;
    };
    let (topic, queue, rtopic) = (unique("pay"), unique("pay"), unique("pay"));
    create_topic(&kafka, &topic).await;

    // The RabbitMQ queue is declared by its source, so that source comes first; the Kafka
    // and RocketMQ groups are new and read their topics from the beginning.
    let rabbit_cfg = RabbitSourceConfig::new(&amqp, &queue)
        .declare(QueueType::Quorum)
        .prefetch(32);
    let rabbit = RabbitSource::connect(rabbit_cfg)
        .await
        .expect("rabbit source");

    // The provider retries every callback on every channel it knows, and on Kafka twice.
    let kp = KafkaPublisher::connect(&KafkaProducerConfig::idempotent(&kafka))
        .await
        .expect("kafka");
    let rp = RabbitPublisher::connect(&amqp).await.expect("rabbitmq");
    let mp = RocketPublisher::connect(RocketPublisherConfig::new(&namesrv, unique("provider")))
        .await
        .expect("rocketmq");
    let mut published = 0u64;
    for i in 0..PAYMENTS {
        kp.publish(callback(&topic, i))
            .await
            .expect("kafka publish");
        rp.publish(callback(&queue, i))
            .await
            .expect("rabbit publish");
        mp.publish(callback(&rtopic, i))
            .await
            .expect("rocket publish");
        published += 3;
        if i % 4 == 0 {
            kp.publish(callback(&topic, i)).await.expect("kafka resend");
            published += 1;
        }
    }

    let kafka_cfg = {
        let mut c = KafkaSourceConfig::new(&kafka, &unique("billing"), &[topic.as_str()])
            .set("session.timeout.ms", "6000")
            .set("heartbeat.interval.ms", "500");
        c.commit_interval = Duration::from_millis(500);
        c
    };
    let sources: Vec<Box<dyn Source>> = vec![
        Box::new(KafkaSource::connect(kafka_cfg).await.expect("kafka source")),
        Box::new(rabbit),
        Box::new(
            RocketSource::connect(RocketSourceConfig::new(
                &namesrv,
                unique("billing"),
                &rtopic,
            ))
            .await
            .expect("rocketmq source"),
        ),
    ];

    let table = TableName::new(&unique("dd")).expect("table name");
    let store = PgStore::connect(&postgres, SqlStoreOptions::with_table(table))
        .await
        .expect("store");
    let applied: Arc<Mutex<HashMap<String, Vec<BrokerKind>>>> = Arc::default();
    let ledger = applied.clone();
    let consumer = IdempotentConsumer::new(
        Arc::new(store.clone()),
        KeyStrategy::dedup_header("billing").expect("strategy"),
        move |m: ClaimedMessage| {
            let ledger = ledger.clone();
            async move {
                // The effect: one ledger row per application, without a unique constraint.
                ledger
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .entry(m.key.as_str().to_string())
                    .or_default()
                    .push(m.envelope.broker);
                Ok::<_, HandlerError>(None)
            }
        },
    )
    .with_config(ConsumerConfig {
        max_batch: 32,
        in_flight_delay_max: Duration::from_millis(500),
        ..ConsumerConfig::default()
    });

    let watcher = consumer.clone();
    let all_seen = async move {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
        loop {
            let s = watcher.stats();
            if s.processed + s.duplicates >= published || tokio::time::Instant::now() > deadline {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    consumer
        .run_all(sources, all_seen)
        .await
        .expect("the three loops ran");

    let stats = consumer.stats();
    let applied = applied.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let doubles: Vec<_> = applied.iter().filter(|(_, v)| v.len() > 1).collect();
    assert!(doubles.is_empty(), "applied more than once: {doubles:?}");
    assert_eq!(applied.len(), PAYMENTS, "every payment applied: {stats:?}");
    assert_eq!(stats.processed, PAYMENTS as u64, "{stats:?}");
    assert_eq!(
        stats.processed + stats.duplicates,
        published,
        "every delivery was seen: {stats:?}"
    );
    // The payments really came through every broker: each one won somewhere.
    let mut winners: HashMap<BrokerKind, usize> = HashMap::new();
    for brokers in applied.values() {
        *winners.entry(brokers[0]).or_default() += 1;
    }
    eprintln!("first delivery that applied each payment, by broker: {winners:?}; {stats:?}");
    let _ = drop_tables(&store).await;
}

/// Drops the store's tables (a table per run keeps runs apart on a shared server).
async fn drop_tables(store: &PgStore) -> Result<(), sqlx::Error> {
    for t in store.tables() {
        sqlx::query(&format!("DROP TABLE IF EXISTS {t}"))
            .execute(store.pool())
            .await?;
    }
    Ok(())
}
