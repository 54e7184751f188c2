//! A Kafka exactly-once pipeline (consume-transform-produce): payments in, invoices out, in
//! one Kafka transaction per batch with the consumed offsets (`TransactionalProcessor`).
//! A provider's resend of a payment (the same dedup key at a new offset) is dropped by the
//! business dedup kept in a compacted changelog topic written in the same transaction, so a
//! `read_committed` reader sees exactly one invoice per payment.
//!
//! Needs Kafka: `scripts/servers.sh start kafka`, then `eval "$(scripts/servers.sh env)"`:
//!
//! ```sh
//! cargo run --example kafka_pipeline --features kafka
//! ```

use idemq::kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use idemq::kafka::rdkafka::client::DefaultClientContext;
use idemq::kafka::rdkafka::consumer::{BaseConsumer, Consumer};
use idemq::kafka::rdkafka::{ClientConfig, Message};
use idemq::kafka::{
    BusinessDedup, KafkaProducerConfig, KafkaPublisher, TransactionalProcessor, TxnOptions,
};
use idemq::{KeyStrategy, OutgoingMessage, Publisher};
use std::collections::HashMap;
use std::time::{Duration, Instant};

const PAYMENTS: usize = 100;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let brokers = std::env::var("IDEMQ_TEST_KAFKA_BROKERS").map_err(|_| {
        "IDEMQ_TEST_KAFKA_BROKERS is not set: start Kafka with scripts/servers.sh start kafka, \
         then eval \"$(scripts/servers.sh env)\""
    })?;
    let run = format!("{:08x}", rand::random::<u32>());
    let (payments, invoices) = (format!("payments-{run}"), format!("invoices-{run}"));
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .create()?;
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(20)));
    let topics = [
        NewTopic::new(&payments, 2, TopicReplication::Fixed(1)),
        NewTopic::new(&invoices, 2, TopicReplication::Fixed(1)),
    ];
    for r in admin.create_topics(&topics, &opts).await? {
        r.map_err(|(topic, code)| format!("create topic {topic}: {code}"))?;
    }

    // The payments, and the provider resending the first 20 (same payment id, new offset).
    // The record key is the payment id too, so every copy lands on the same partition.
    let publisher = KafkaPublisher::connect(&KafkaProducerConfig::idempotent(&brokers)).await?;
    let batch = (0..PAYMENTS)
        .chain(0..20)
        .map(|i| {
            OutgoingMessage::new(&payments, format!(r#"{{"payment_id":"pay-{i}"}}"#))
                .with_key(format!("pay-{i}"))
                .with_dedup_key(format!("pay-{i}"))
        })
        .collect();
    for r in publisher.publish_batch(batch).await {
        r?;
    }

    // --- idemq: a transactional processor with business dedup (4 lines) ---
    let group = format!("invoicing-{run}");
    let producer = KafkaProducerConfig::transactional(&brokers, &format!("invoicing-{run}-0"));
    let dedup = BusinessDedup::new(KeyStrategy::dedup_header(&group)?);
    let mut pipeline = TransactionalProcessor::with_options(
        &producer,
        &group,
        &[payments.as_str()],
        TxnOptions::default().dedup(dedup),
    )
    .await?;
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut consumed = 0;
    while consumed < PAYMENTS + 20 && Instant::now() < deadline {
        consumed += pipeline
            .process_batch(50, Duration::from_secs(2), |payment| {
                let id = payment
                    .headers
                    .get_str(idemq::DEDUP_HEADER)
                    .ok_or("a payment without its dedup key")?
                    .to_string();
                Ok(vec![OutgoingMessage::new(
                    &invoices,
                    format!("invoice for {id}"),
                )
                .with_key(id.clone())
                .with_dedup_key(id)])
            })
            .await?;
    }

    // What a read_committed reader of the output sees.
    let reader: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("group.id", format!("auditor-{run}"))
        .set("auto.offset.reset", "earliest")
        .set("isolation.level", "read_committed")
        .create()?;
    reader.subscribe(&[invoices.as_str()])?;
    let mut per_payment: HashMap<String, u32> = HashMap::new();
    let until = Instant::now() + Duration::from_secs(30);
    while per_payment.len() < PAYMENTS && Instant::now() < until {
        if let Some(m) = reader.poll(Duration::from_millis(500)) {
            let m = m?;
            let key = String::from_utf8_lossy(m.key().unwrap_or_default()).into_owned();
            *per_payment.entry(key).or_default() += 1;
        }
    }
    let twice = per_payment.values().filter(|&&n| n > 1).count();
    println!(
        "kafka pipeline: consumed={consumed} invoices={} distinct={} twice={twice} \
         business_duplicates_dropped={}",
        per_payment.values().sum::<u32>(),
        per_payment.len(),
        pipeline.duplicates()
    );
    assert_eq!(
        (per_payment.len(), twice),
        (PAYMENTS, 0),
        "one invoice per payment"
    );
    let _ = admin.delete_topics(&[&payments, &invoices], &opts).await;
    Ok(())
}
