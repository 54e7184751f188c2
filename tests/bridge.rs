//! A migration bridge under SIGKILL: RabbitMQ → Kafka with the business key carried across.
//!
//! Payment callbacks go into a RabbitMQ quorum queue with producer duplicates (every fifth
//! sent twice with the same dedup key) and a replay of the first tenth. Two bridge
//! **processes** consume the queue through the idempotent consumer (dedup records in
//! PostgreSQL) and forward every message to a Kafka topic with [`idemq::handler::forward`]
//! (idempotent producer, dedup key in the `idemq-dedup-key` header). The parent SIGKILLs a
//! bridge three times at moments spread over the run and starts a new one.
//!
//! A bridge killed between the Kafka confirm and the RabbitMQ ack republishes on
//! redelivery, so the topic may hold a key twice: that is the documented contract of
//! `forward`. What the Kafka side must see is each key's **effect** once: the parent runs
//! the Kafka-side idempotent consumer (dedup header key) and counts its effects per key,
//! and requires all keys, each exactly once (`double_effects=0 lost=0`), printing how many
//! raw copies the topic held.
//!
//! Needs the servers of `scripts/servers.sh` (`eval "$(scripts/servers.sh env)"`); skipped
//! without them unless `IDEMQ_REQUIRE_SERVERS=1`.
#![cfg(all(feature = "kafka", feature = "rabbitmq", feature = "postgres"))]

mod support;

use idemq::core::testkit::process::{child_role, ChildProcess};
use idemq::engine::RetryPolicy;
use idemq::handler::forward;
use idemq::kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use idemq::kafka::rdkafka::client::DefaultClientContext;
use idemq::kafka::rdkafka::consumer::{BaseConsumer, Consumer};
use idemq::kafka::rdkafka::ClientConfig;
use idemq::kafka::{KafkaProducerConfig, KafkaPublisher, KafkaSource, KafkaSourceConfig};
use idemq::rabbitmq::{QueueType, RabbitPublisher, RabbitSource, RabbitSourceConfig};
use idemq::sql::{sqlx, PgStore, SqlStoreOptions, TableName};
use idemq::{
    ClaimedMessage, ConsumerConfig, DedupStore, HandlerError, IdempotentConsumer, KeyStrategy,
    MemoryStore, OutgoingMessage, Publisher, Source,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::server_url;

const CHILD: &str = "IDEMQ_BRIDGE_CHILD";
const PARTITIONS: i32 = 4;
const KILLS: usize = 3;

fn unique(what: &str) -> String {
    format!("idemq_bridge_{what}_{:08x}", rand::random::<u32>())
}

/// What a bridge process is told: queue, topic, group, dedup table.
struct Plan {
    queue: String,
    topic: String,
    group: String,
    table: String,
}

impl Plan {
    fn encode(&self) -> String {
        [&self.queue, &self.topic, &self.group, &self.table]
            .map(|s| s.as_str())
            .join(" ")
    }
    fn decode(s: &str) -> Self {
        let p: Vec<&str> = s.split(' ').collect();
        assert_eq!(p.len(), 4, "bad {CHILD}: {s}");
        Self {
            queue: p[0].into(),
            topic: p[1].into(),
            group: p[2].into(),
            table: p[3].into(),
        }
    }
}

/// A bridge process: RabbitMQ queue → Kafka topic, until killed.
async fn bridge_child(arg: &str) {
    let plan = Plan::decode(arg);
    let amqp = server_url("IDEMQ_TEST_AMQP_URL").expect("amqp url");
    let kafka = server_url("IDEMQ_TEST_KAFKA_BROKERS").expect("kafka brokers");
    let pg = server_url("IDEMQ_TEST_POSTGRES_URL").expect("postgres url");
    let store = PgStore::connect(
        &pg,
        SqlStoreOptions::with_table(TableName::new(&plan.table).expect("table")),
    )
    .await
    .expect("store");
    let publisher: Arc<dyn Publisher> = Arc::new(
        KafkaPublisher::connect(&KafkaProducerConfig::idempotent(&kafka))
            .await
            .expect("kafka publisher"),
    );
    let topic = plan.topic.clone();
    let consumer = IdempotentConsumer::new(
        Arc::new(store),
        KeyStrategy::dedup_header(&plan.group).expect("group"),
        forward(publisher, move |_| topic.clone()),
    )
    .with_config(ConsumerConfig {
        max_batch: 64,
        lease: Duration::from_secs(3),
        in_flight_delay_max: Duration::from_millis(500),
        retry: RetryPolicy::fixed(Duration::from_millis(200)),
        ..ConsumerConfig::default()
    });
    let mut source = RabbitSource::connect(
        RabbitSourceConfig::new(&amqp, &plan.queue)
            .declare(QueueType::Quorum)
            .prefetch(64),
    )
    .await
    .expect("rabbitmq source");
    eprintln!(
        "bridge {} forwarding {} to {}",
        std::process::id(),
        plan.queue,
        plan.topic
    );
    let r = consumer.run(&mut source, std::future::pending()).await;
    panic!("the bridge stopped: {r:?}");
}

async fn create_topic(brokers: &str, topic: &str) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .expect("admin client");
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(20)));
    for r in admin
        .create_topics(
            [&NewTopic::new(
                topic,
                PARTITIONS,
                TopicReplication::Fixed(1),
            )],
            &opts,
        )
        .await
        .expect("create_topics")
    {
        r.unwrap_or_else(|(name, code)| panic!("create topic {name}: {code}"));
    }
}

/// Every key once, every fifth twice, then the first tenth again. Returns the count sent.
async fn publish_callbacks(amqp: &str, queue: &str, keys: usize) -> usize {
    // The queue must exist before the first publish: its source declares it.
    let mut s =
        RabbitSource::connect(RabbitSourceConfig::new(amqp, queue).declare(QueueType::Quorum))
            .await
            .expect("declare queue");
    s.close().await.expect("close the declaring source");
    let publisher = RabbitPublisher::connect(amqp)
        .await
        .expect("rabbitmq publisher");
    let order: Vec<usize> = (0..keys)
        .flat_map(|i| if i % 5 == 0 { vec![i, i] } else { vec![i] })
        .chain(0..keys / 10)
        .collect();
    for chunk in order.chunks(500) {
        let batch = chunk
            .iter()
            .map(|i| {
                OutgoingMessage::new(queue, format!("{{\"payment\":\"p-{i:06}\"}}"))
                    .with_key(format!("p-{i:06}"))
                    .with_dedup_key(format!("p-{i:06}"))
            })
            .collect();
        for r in publisher.publish_batch(batch).await {
            r.expect("confirmed publish");
        }
    }
    publisher.close().await.expect("close the publisher");
    order.len()
}

/// A client that reads the topic's watermarks (its group never joins, consumes nothing).
fn watermark_client(brokers: &str) -> BaseConsumer {
    ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", unique("watermarks"))
        .create()
        .expect("watermark consumer")
}

/// Records on the topic: the sum of the partitions' high watermarks.
fn records_on(c: &BaseConsumer, topic: &str) -> i64 {
    (0..PARTITIONS)
        .map(|p| {
            let (low, high) = c
                .fetch_watermarks(topic, p, Duration::from_secs(10))
                .expect("watermarks");
            high - low
        })
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_bridge_killed_mid_run_lands_each_key_once_on_the_kafka_side() {
    if let Some(arg) = child_role(CHILD) {
        bridge_child(&arg).await;
        return;
    }
    let (Some(amqp), Some(kafka), Some(pg)) = (
        server_url("IDEMQ_TEST_AMQP_URL"),
        server_url("IDEMQ_TEST_KAFKA_BROKERS"),
        server_url("IDEMQ_TEST_POSTGRES_URL"),
    ) else {
        return;
    };
    let keys = 2000;
    let plan = Plan {
        queue: unique("callbacks"),
        topic: unique("payments"),
        group: unique("bridge"),
        table: unique("dedup"),
    };
    create_topic(&kafka, &plan.topic).await;
    let published = publish_callbacks(&amqp, &plan.queue, keys).await;

    // The Kafka side: the idempotent consumer a team would run there, counting effects.
    let effects: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
    let kafka_side = {
        let effects = effects.clone();
        let mut cfg = KafkaSourceConfig::new(&kafka, &unique("ledger"), &[plan.topic.as_str()]);
        cfg.commit_interval = Duration::from_millis(500);
        let mut source = KafkaSource::connect(cfg).await.expect("kafka source");
        let store: Arc<dyn DedupStore> = Arc::new(MemoryStore::new());
        let consumer = IdempotentConsumer::new(
            store,
            KeyStrategy::dedup_header("ledger").expect("group"),
            move |m: ClaimedMessage| {
                let effects = effects.clone();
                async move {
                    let key = m.key.business_key().to_string();
                    *effects
                        .lock()
                        .map_err(|_| HandlerError::permanent("ledger lock poisoned"))?
                        .entry(key)
                        .or_default() += 1;
                    Ok::<_, HandlerError>(None)
                }
            },
        );
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let r = consumer
                .run(&mut source, async {
                    let _ = stopped.await;
                })
                .await;
            source.close().await.expect("close the kafka source");
            r
        });
        (stop, task)
    };
    let distinct = || effects.lock().map(|m| m.len()).unwrap_or(0);

    let spawn = || {
        ChildProcess::spawn_self(
            "a_bridge_killed_mid_run_lands_each_key_once_on_the_kafka_side",
            CHILD,
            &plan.encode(),
        )
        .expect("spawn a bridge")
    };
    // The kills are timed by what the bridges have forwarded (the topic's records), not by
    // the Kafka side's effects: that consumer joins its group seconds late and then catches
    // up at once, so a run timed by it could end before the first kill (seen in CI).
    let watermarks = watermark_client(&kafka);
    let forwarded = || tokio::task::block_in_place(|| records_on(&watermarks, &plan.topic));
    let mut bridges = vec![spawn(), spawn()];
    let started = Instant::now();
    let limit = Duration::from_secs(300);
    let (mut killed, mut tails) = (0, Vec::new());
    while distinct() < keys && started.elapsed() < limit {
        tokio::time::sleep(Duration::from_millis(25)).await;
        let progress = forwarded() as f64 / keys as f64;
        if killed < KILLS && progress >= (killed + 1) as f64 / (KILLS + 2) as f64 {
            let i = killed % bridges.len();
            bridges[i].kill().expect("SIGKILL");
            tails.push(bridges[i].stderr_tail(1500));
            bridges[i] = spawn();
            killed += 1;
            eprintln!(
                "bridge: SIGKILL {killed} at {} forwarded of {keys}",
                forwarded()
            );
        }
        for b in bridges.iter_mut() {
            if let Ok(Some(status)) = b.try_wait() {
                tails.push(format!("[{status}] {}", b.stderr_tail(1500)));
                *b = spawn();
            }
        }
    }
    // Late redeliveries of a killed bridge's unacked messages land meanwhile.
    tokio::time::sleep(Duration::from_secs(5)).await;
    for mut b in bridges {
        let _ = b.kill();
    }
    let (stop, task) = kafka_side;
    let _ = stop.send(());
    task.await
        .expect("kafka side task")
        .expect("kafka side consumer");

    let effects = effects.lock().expect("ledger").clone();
    let raw = forwarded();
    let double_effects: u32 = effects.values().map(|n| n - 1).sum();
    let lost = keys - effects.len();
    println!(
        "bridge rabbitmq→kafka: keys={keys} published={published} sigkills={killed} \
         kafka_records={raw} double_effects={double_effects} lost={lost} in {:.0?}",
        started.elapsed()
    );
    assert_eq!(killed, KILLS, "the run ended before every planned kill");
    assert_eq!(
        (double_effects, lost),
        (0, 0),
        "the Kafka side applied {} keys of {keys}; bridges said:\n{}",
        effects.len(),
        tails.join("\n---\n")
    );
    assert!(
        raw >= keys as i64,
        "the topic holds {raw} records for {keys} keys"
    );
    let store = PgStore::connect(
        &pg,
        SqlStoreOptions::with_table(TableName::new(&plan.table).expect("table")),
    )
    .await
    .expect("store");
    for t in store.tables() {
        let _ = sqlx::query(&format!("DROP TABLE IF EXISTS {t}"))
            .execute(store.pool())
            .await;
    }
}
