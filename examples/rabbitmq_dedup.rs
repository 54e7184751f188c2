//! RabbitMQ, two ways to keep a producer resend from becoming a second effect:
//!
//! 1. **A queue, deduplicated by the consumer.** `RabbitPublisher` sends 50 payment
//!    callbacks, persistent and confirmed, each with its dedup key (the payment id) in the
//!    AMQP `message_id`, the `x-deduplication-header` and the `idemq-dedup-key` header; 10 of
//!    them are sent again (a producer that resends after a lost confirm). An
//!    `IdempotentConsumer` over a `RabbitSource` (manual acks), keyed by
//!    `KeyStrategy::dedup_header`, applies each payment once and acks the copies as
//!    duplicates.
//! 2. **A stream, deduplicated by the broker.** A *named* `StreamPublisher`
//!    (`idemq::rabbitmq::stream`) appends 50 ledger entries with growing publishing ids; the
//!    producer then "restarts" and resends its last 10 from an old checkpoint: the broker
//!    confirms them and stores none (`last_publishing_id` says where its sequence stands).
//!    A `StreamSource` (offsets stored on the broker under the consumer name) reads 50
//!    entries through the same idempotent consumer.
//!
//! Servers: RabbitMQ with its stream port (`IDEMQ_TEST_AMQP_URL`,
//! `IDEMQ_TEST_RABBITMQ_STREAM_URL`). Queue, stream and consumer names carry a random
//! suffix; the queues and streams are deleted at the end.
//!
//! ```sh
//! scripts/servers.sh start rabbitmq
//! eval "$(scripts/servers.sh env)"
//! cargo run --example rabbitmq_dedup --features rabbitmq-streams
//! ```
//!
//! It ends with one line such as
//! `rabbitmq: queue published=60 applied=50 duplicates_skipped=10; stream sent=60 stored=50 broker_dropped=10 applied=50`
//! and fails unless every payment and every ledger entry took effect exactly once. (The
//! dedup store here is the in-memory one, enough for one process; use a durable store,
//! e.g. `idemq::sql::PgStore`, when consumers restart.)

use idemq::rabbitmq::lapin::options::QueueDeleteOptions;
use idemq::rabbitmq::stream::{
    delete_stream, read_stream, StreamPublisher, StreamPublisherConfig, StreamSource,
    StreamSourceConfig, PUBLISHING_ID_HEADER,
};
use idemq::rabbitmq::{
    QueueType, RabbitPublisher, RabbitSource, RabbitSourceConfig, PLUGIN_DEDUP_HEADER,
};
use idemq::{
    ClaimedMessage, ConsumerStats, Handler, HandlerError, IdempotentConsumer, KeyStrategy,
    MemoryStore, OutgoingMessage, Publisher, Source, DEDUP_HEADER,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Distinct business messages per part.
const MESSAGES: u64 = 50;
/// How many of them the producer sends again.
const RESENT: u64 = 10;
/// How long a part may take before the example gives up.
const PATIENCE: Duration = Duration::from_secs(60);

/// Effects per business key, and keys whose AMQP `message_id` was not their dedup key.
#[derive(Clone, Default)]
struct Ledger {
    applied: Arc<Mutex<HashMap<String, u32>>>,
    id_mismatches: Arc<Mutex<Vec<String>>>,
}

impl Ledger {
    fn applied(&self) -> HashMap<String, u32> {
        self.applied
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// The handler both parts share: the effect is counting the business key once. It also
/// checks where the key travelled: the `idemq-dedup-key` header and the message id, plus
/// (AMQP queues) the dedup plugin's `x-deduplication-header`.
fn apply(ledger: Ledger, plugin_header: bool) -> impl Handler {
    idemq::handler::with_state(ledger, move |ledger, msg: ClaimedMessage| async move {
        let key = msg.key.business_key().to_owned();
        let headers = &msg.envelope.headers;
        if headers.get_str(DEDUP_HEADER) != Some(key.as_str())
            || msg.envelope.message_id.as_deref() != Some(key.as_str())
            || (plugin_header && headers.get_str(PLUGIN_DEDUP_HEADER) != Some(key.as_str()))
        {
            ledger
                .id_mismatches
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(key.clone());
        }
        *ledger
            .applied
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(key)
            .or_default() += 1;
        Ok::<_, HandlerError>(None)
    })
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
            "{name} is not set: start the servers with `scripts/servers.sh start rabbitmq`, \
             then `eval \"$(scripts/servers.sh env)\"`"
        ))),
    }
}

/// Runs `consumer` over `source` until it has settled `deliveries` messages (effects plus
/// duplicates), or `PATIENCE` has passed.
async fn consume<H: Handler, S: Source>(
    consumer: &IdempotentConsumer<H>,
    source: &mut S,
    deliveries: u64,
) -> Result<ConsumerStats, Box<dyn std::error::Error>> {
    let watch = consumer.clone();
    let settled = async move {
        let deadline = tokio::time::Instant::now() + PATIENCE;
        loop {
            let s = watch.stats();
            if s.processed + s.duplicates >= deliveries || tokio::time::Instant::now() > deadline {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    consumer.run(source, settled).await?;
    let stats = consumer.stats();
    if stats.processed + stats.duplicates < deliveries {
        return Err(format!(
            "only {} of {deliveries} deliveries settled within {PATIENCE:?}: {stats:?}",
            stats.processed + stats.duplicates
        )
        .into());
    }
    Ok(stats)
}

fn payment(destination: &str, i: u64) -> OutgoingMessage {
    OutgoingMessage::new(
        destination,
        format!(r#"{{"payment_id":"pay-{i:03}","cents":{}}}"#, 1000 + i),
    )
    .with_dedup_key(format!("pay-{i:03}"))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let amqp = env_var("IDEMQ_TEST_AMQP_URL")?;
    let stream_url = env_var("IDEMQ_TEST_RABBITMQ_STREAM_URL")?;
    let run = format!("{:08x}", rand::random::<u32>());

    // --- 1. A queue: consumer-side dedup on the carried key. ---
    let queue = format!("idemq-example.payments.{run}");
    // The source declares the queue (and its dead-letter queue) before anything is sent.
    let mut source = RabbitSource::connect(
        RabbitSourceConfig::new(&amqp, &queue)
            .declare(QueueType::Classic)
            .prefetch(50),
    )
    .await?;
    let publisher = RabbitPublisher::connect(&amqp).await?;
    let mut queue_sent = 0;
    for i in 0..MESSAGES {
        publisher.publish(payment(&queue, i)).await?; // confirmed, persistent
        queue_sent += 1;
    }
    for i in (0..MESSAGES).step_by((MESSAGES / RESENT) as usize) {
        // The resend of a publish whose confirm was lost: the same dedup key.
        publisher.publish(payment(&queue, i)).await?;
        queue_sent += 1;
    }
    publisher.close().await?;

    let queue_ledger = Ledger::default();
    let queue_consumer = IdempotentConsumer::new(
        Arc::new(MemoryStore::new()),
        KeyStrategy::dedup_header(&format!("billing-{run}"))?,
        apply(queue_ledger.clone(), true),
    );
    let queue_stats = consume(&queue_consumer, &mut source, queue_sent).await?;

    // --- 2. A stream: broker-side dedup of a named producer. ---
    let stream = format!("idemq-example.ledger.{run}");
    let producer_name = format!("{stream}.producer");
    let entry = |id: u64| {
        OutgoingMessage::new(&stream, format!(r#"{{"entry":{id}}}"#))
            .with_dedup_key(format!("entry-{id:03}"))
            .with_header(PUBLISHING_ID_HEADER, id.to_string()) // grows: 1, 2, 3, …
    };
    let producer = StreamPublisher::connect(
        StreamPublisherConfig::new(&stream_url, &stream).named(&producer_name),
    )
    .await?;
    let mut stream_sent = 0;
    for r in producer
        .publish_batch((1..=MESSAGES).map(entry).collect())
        .await
    {
        r?;
        stream_sent += 1;
    }
    drop(producer);
    // The producer process restarts from an old checkpoint and resends its last entries.
    let restarted = StreamPublisher::connect(
        StreamPublisherConfig::new(&stream_url, &stream).named(&producer_name),
    )
    .await?;
    let last = restarted.last_publishing_id().await?;
    if last != Some(MESSAGES) {
        return Err(format!(
            "the broker's sequence for {producer_name} is {last:?}, not {MESSAGES}"
        )
        .into());
    }
    for id in (MESSAGES - RESENT + 1)..=MESSAGES {
        restarted.publish(entry(id)).await?; // confirmed, and not stored again
        stream_sent += 1;
    }
    drop(restarted);
    let stored = read_stream(&stream_url, &stream, Duration::from_secs(1))
        .await?
        .len() as u64;

    let stream_ledger = Ledger::default();
    let stream_consumer = IdempotentConsumer::new(
        Arc::new(MemoryStore::new()),
        KeyStrategy::dedup_header(&format!("ledger-{run}"))?,
        apply(stream_ledger.clone(), false),
    );
    let mut stream_source = StreamSource::connect(StreamSourceConfig::new(
        &stream_url,
        &stream,
        format!("ledger-reader-{run}"),
    ))
    .await?;
    let stream_stats = consume(&stream_consumer, &mut stream_source, stored).await?;

    // --- Clean up what this run declared. ---
    let conn = idemq::rabbitmq::connect(&amqp, "idemq-example-cleanup").await?;
    let ch = conn.create_channel().await?;
    for q in [queue.clone(), format!("{queue}.dlq")] {
        ch.queue_delete(&q, QueueDeleteOptions::default()).await?;
    }
    conn.close(200, "done").await?;
    delete_stream(&stream_url, &stream).await?;
    delete_stream(&stream_url, &format!("{stream}.dlq")).await?;

    // --- Exactly once per business key. ---
    let paid = queue_ledger.applied();
    let entries = stream_ledger.applied();
    let twice = |m: &HashMap<String, u32>| m.values().filter(|n| **n > 1).count();
    assert_eq!(paid.len() as u64, MESSAGES, "every payment applied");
    assert_eq!(twice(&paid), 0, "no payment applied twice: {paid:?}");
    assert_eq!(queue_stats.duplicates, RESENT, "every resend dropped");
    assert_eq!(
        stored, MESSAGES,
        "the broker stored each publishing id once"
    );
    assert_eq!(entries.len() as u64, MESSAGES, "every ledger entry applied");
    assert_eq!(twice(&entries), 0, "no entry applied twice: {entries:?}");
    for (what, l) in [("queue", &queue_ledger), ("stream", &stream_ledger)] {
        let bad = l
            .id_mismatches
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        assert!(
            bad.is_empty(),
            "{what}: message_id is not the dedup key for {bad:?}"
        );
    }
    println!(
        "rabbitmq: queue published={queue_sent} applied={} duplicates_skipped={}; stream sent={stream_sent} stored={stored} broker_dropped={} applied={}",
        queue_stats.processed,
        queue_stats.duplicates,
        stream_sent - stored,
        stream_stats.processed
    );
    Ok(())
}
