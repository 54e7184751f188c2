//! Configuring an exactly-once Kafka producer with idemq-kafka.
//!
//! ```text
//! cargo run --example kafka_exactly_once_producer --features kafka            # config only
//! IDEMQ_KAFKA_BROKERS=127.0.0.1:19092 \
//!   cargo run --example kafka_exactly_once_producer --features kafka          # and produce
//! ```
//!
//! 1. `KafkaProducerConfig::transactional` sets the safe combination (idempotence, acks=all,
//!    at most 5 requests in flight, a stable `transactional.id` per instance);
//! 2. the validator refuses an override that silently loses the guarantee, naming the key and
//!    the fix (the same rules `idemq kafka check-config producer.properties` prints);
//! 3. with a broker, the producer fences older instances of its id (`init_transactions`) and
//!    writes two records atomically: a `read_committed` reader sees both or neither.

use idemq::kafka::rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use idemq::kafka::{commit_transaction, KafkaProducerConfig, RuleVerdict};
use std::time::Duration;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let brokers = std::env::var("IDEMQ_KAFKA_BROKERS").ok();
    let bootstrap = brokers.as_deref().unwrap_or("127.0.0.1:9092");

    // One transactional.id per producer instance, stable across its restarts: the restarted
    // instance fences the old one (a zombie that still holds a transaction).
    let cfg = KafkaProducerConfig::transactional(bootstrap, "payments-relay-0")
        // librdkafka keys as they are; the validator knows the unsafe ones.
        .set("transaction.timeout.ms", "30000")
        .set("linger.ms", "5");
    cfg.validate()?;
    for (rule, verdict) in cfg.explain() {
        let v = match verdict {
            RuleVerdict::Holds => "ok".to_string(),
            RuleVerdict::NotApplicable(why) => format!("- ({why})"),
            RuleVerdict::Broken(p) => format!("FAIL {p:?}"),
        };
        println!("{:<70} {v}", rule.describe());
    }

    // An override that breaks idempotence is refused before any client exists.
    let unsafe_cfg = cfg.clone().set("acks", "1");
    match unsafe_cfg.client_config() {
        Err(e) => println!("refused: {e}"),
        Ok(_) => unreachable!("acks=1 with a transactional producer must be refused"),
    }

    let Some(_) = brokers else {
        println!("set IDEMQ_KAFKA_BROKERS to produce a transaction");
        return Ok(());
    };
    let producer: FutureProducer = cfg.client_config()?.create()?;
    let p = producer.clone();
    tokio::task::spawn_blocking(move || p.init_transactions(Duration::from_secs(30))).await??;
    producer.begin_transaction()?;
    let debit = producer.send(
        FutureRecord::to("ledger").key("acct-1").payload("-1999"),
        Duration::from_secs(5),
    );
    let credit = producer.send(
        FutureRecord::to("ledger").key("acct-2").payload("+1999"),
        Duration::from_secs(5),
    );
    for r in [debit.await, credit.await] {
        r.map_err(|(e, _)| e)?;
    }
    let p = producer.clone();
    // idemq's commit waits for the deliveries itself: rdkafka's own commit_transaction
    // blocks at least 100 ms whenever a record is still in flight.
    tokio::task::spawn_blocking(move || commit_transaction(&p, Duration::from_secs(30))).await??;
    println!("committed one transaction of two records to topic ledger");
    Ok(())
}
