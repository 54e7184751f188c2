//! Kafka → PostgreSQL exactly once, with no Kafka transaction (Kafka's "flow 3", idemq-sql's
//! `LogToDatabase`): each record's effect (a row in the payments table), its dedup record
//! and its partition's next offset commit in **one PostgreSQL transaction**
//! (`flow.begin(&msg)`, the effect through `&mut *tx`, `tx.commit()`), and the source starts
//! every assigned partition at the offset stored in the database, not at Kafka's committed
//! one. A crash anywhere loses nothing (the position only moves with the effect) and
//! repeats nothing (the effect only commits with its dedup record and position).
//!
//! The example publishes 200 payments on a 3-partition topic with an idempotent
//! `KafkaPublisher` (dedup key = payment id, record key = account), then resends 40 of them
//! (a producer that resent after a timeout: the same dedup key at a new offset). The
//! consumer applies 200 payments and skips the 40 copies; then the effect table (no unique
//! constraint, so a double would show) holds each payment once, and the offsets stored in
//! PostgreSQL are, per partition, one past the last effect's offset.
//!
//! Servers: Kafka (`IDEMQ_TEST_KAFKA_BROKERS`) and PostgreSQL (`IDEMQ_TEST_POSTGRES_URL`).
//! The topic, consumer group and effect table carry a random suffix; the topic and the
//! effect table are removed at the end (the dedup records and stored offsets stay in the
//! shared `idemq_dedup` and `idemq_source_offsets` tables, under this run's group).
//!
//! ```sh
//! scripts/servers.sh start postgres kafka
//! eval "$(scripts/servers.sh env)"
//! cargo run --example kafka_to_postgres --features kafka,postgres
//! ```
//!
//! It ends with one line such as
//! `kafka->postgres: published=240 payments=200 effects=200 distinct=200 duplicates_skipped=40 stored_offsets={0: 60, 1: 105, 2: 35}`
//! and fails unless each payment took effect exactly once.

use idemq::kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use idemq::kafka::rdkafka::client::DefaultClientContext;
use idemq::kafka::rdkafka::ClientConfig;
use idemq::kafka::{KafkaProducerConfig, KafkaPublisher, KafkaSource, KafkaSourceConfig};
use idemq::sql::{sqlx, LogToDatabase, PgStore, SqlResultExt, SqlStoreOptions};
use idemq::{ConsumerConfig, DeliveryOrder, OutgoingMessage, Publisher};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

/// Distinct payments.
const PAYMENTS: usize = 200;
/// Every `RESEND_EVERY`-th payment is sent twice.
const RESEND_EVERY: usize = 5;
/// Partitions of the topic.
const PARTITIONS: i32 = 3;
/// How long consuming may take before the example gives up.
const PATIENCE: Duration = Duration::from_secs(120);

/// A payment callback's body.
#[derive(serde::Deserialize)]
struct Payment {
    payment_id: String,
    amount: i64,
}

/// A server address that is not set. `main` returns it, and Rust prints a returned error with
/// `Debug`: this one prints its text as written (a `String` error would come out quoted).
struct NotSet(String);

impl std::fmt::Debug for NotSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::fmt::Display for NotSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for NotSet {}

/// The value of `name`, or an error saying how to get the servers and their addresses.
fn env_var(name: &str) -> Result<String, NotSet> {
    match std::env::var(name) {
        Ok(v) if !v.trim().is_empty() => Ok(v),
        _ => Err(NotSet(format!(
            "{name} is not set: start the servers with `scripts/servers.sh start postgres kafka`, \
             then `eval \"$(scripts/servers.sh env)\"`"
        ))),
    }
}

fn payment(topic: &str, i: usize) -> OutgoingMessage {
    OutgoingMessage::new(
        topic,
        format!(r#"{{"payment_id":"pay-{i:04}","amount":{}}}"#, 100 + i),
    )
    .with_key(format!("acct-{}", i % 17)) // one account's payments stay on one partition
    .with_dedup_key(format!("pay-{i:04}"))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let brokers = env_var("IDEMQ_TEST_KAFKA_BROKERS")?;
    let pg_url = env_var("IDEMQ_TEST_POSTGRES_URL")?;
    let run = format!("{:08x}", rand::random::<u32>());
    let topic = format!("idemq-example-payments-{run}");
    let group = format!("billing-{run}");
    let effects = format!("example_k2pg_payments_{run}");

    // --- The topic and the database. ---
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .create()?;
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    let new_topic = NewTopic::new(&topic, PARTITIONS, TopicReplication::Fixed(1));
    for r in admin.create_topics([&new_topic], &opts).await? {
        r.map_err(|(name, code)| format!("create topic {name}: {code}"))?;
    }
    let store = PgStore::connect(&pg_url, SqlStoreOptions::default()).await?;
    sqlx::query(&format!(
        "CREATE TABLE {effects} (payment_id TEXT NOT NULL, amount BIGINT NOT NULL, \
         part INT NOT NULL, off BIGINT NOT NULL)" // no unique constraint: a double would show
    ))
    .execute(store.pool())
    .await?;

    // --- The producer: every payment once, then a resend of every fifth. ---
    let publisher = KafkaPublisher::connect(&KafkaProducerConfig::idempotent(&brokers)).await?;
    let mut published = 0;
    let first: Vec<OutgoingMessage> = (0..PAYMENTS).map(|i| payment(&topic, i)).collect();
    let resent: Vec<OutgoingMessage> = (0..PAYMENTS)
        .step_by(RESEND_EVERY)
        .map(|i| payment(&topic, i))
        .collect();
    for batch in [first, resent] {
        for r in publisher.publish_batch(batch).await {
            r?; // acks=all: stored on the broker
            published += 1;
        }
    }

    // --- Flow 3: effect + dedup record + offset in one PostgreSQL transaction. ---
    let flow = LogToDatabase::new(store.clone(), &group).await?;
    let mut source = KafkaSource::connect(
        KafkaSourceConfig::new(&brokers, &group, &[&topic]).offsets_from(flow.offset_store()?),
    )
    .await?;
    let insert: Arc<str> =
        format!("INSERT INTO {effects} (payment_id, amount, part, off) VALUES ($1, $2, $3, $4)")
            .into();
    let handler = idemq::handler::json(
        (flow.clone(), insert),
        |(flow, insert), msg, p: Payment| async move {
            let mut tx = flow.begin(&msg).await?;
            let (_, part, off) = tx.position();
            sqlx::query(&insert)
                .bind(p.payment_id)
                .bind(p.amount)
                .bind(part)
                .bind(off)
                .execute(&mut *tx)
                .await
                .classify()?;
            tx.commit().await // the dedup record and the partition's next offset, then COMMIT
        },
    );
    // Flow 3 refuses any ordering but PerPartition: the stored offset means "everything
    // before it is done", so a partition's records must commit in offset order.
    let consumer = flow.consumer(
        handler,
        ConsumerConfig {
            ordering: DeliveryOrder::PerPartition,
            ..ConsumerConfig::default()
        },
    )?;
    let watch = consumer.clone();
    let expected = published as u64;
    let settled = async move {
        let deadline = tokio::time::Instant::now() + PATIENCE;
        loop {
            let s = watch.stats();
            if s.processed + s.duplicates >= expected || tokio::time::Instant::now() > deadline {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    consumer.run(&mut source, settled).await?;
    let stats = consumer.stats();

    // --- Exactly once, checked in the database. ---
    let (rows, distinct): (i64, i64) = sqlx::query_as(&format!(
        "SELECT COUNT(*), COUNT(DISTINCT payment_id) FROM {effects}"
    ))
    .fetch_one(store.pool())
    .await?;
    let after_last_effect: BTreeMap<i32, i64> = sqlx::query_as::<_, (i32, i64)>(&format!(
        "SELECT part, MAX(off) + 1 FROM {effects} GROUP BY part"
    ))
    .fetch_all(store.pool())
    .await?
    .into_iter()
    .collect();
    let stored: BTreeMap<i32, i64> = flow
        .offsets()
        .load_group(&group)
        .await?
        .into_iter()
        .filter(|s| s.topic == topic)
        .map(|s| (s.partition, s.next_offset))
        .collect();

    // --- Clean up the topic and the effect table. ---
    for r in admin.delete_topics(&[topic.as_str()], &opts).await? {
        r.map_err(|(name, code)| format!("delete topic {name}: {code}"))?;
    }
    sqlx::query(&format!("DROP TABLE {effects}"))
        .execute(store.pool())
        .await?;

    assert_eq!(
        stats.processed + stats.duplicates,
        expected,
        "every record settled within {PATIENCE:?}: {stats:?}"
    );
    assert_eq!(
        (rows, distinct),
        (PAYMENTS as i64, PAYMENTS as i64),
        "each payment applied exactly once"
    );
    assert_eq!(
        stats.duplicates,
        (published - PAYMENTS) as u64,
        "every resend skipped"
    );
    assert_eq!(
        stored, after_last_effect,
        "the stored offsets moved with the effects, in the same transactions"
    );
    println!(
        "kafka->postgres: published={published} payments={PAYMENTS} effects={rows} distinct={distinct} duplicates_skipped={} stored_offsets={stored:?}",
        stats.duplicates
    );
    Ok(())
}
