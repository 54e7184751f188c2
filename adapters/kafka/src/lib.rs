//! # idemq-kafka: Apache Kafka for idemq (rdkafka)
//!
//! **What Kafka guarantees.** A partition is an ordered log; a consumer group hands each
//! partition to one member at a time and remembers, per partition, one committed offset:
//! "everything before N is done". Delivery is at least once: records after the last commit
//! are delivered again after a crash or a rebalance. An idempotent producer
//! (`enable.idempotence`, `acks=all`, at most 5 requests in flight) stores each send once per
//! partition despite its own retries; it does not stop an application that sends the same
//! business message twice — that is what the dedup key is for.
//!
//! **How settlements map onto offsets** ([`KafkaSource`], through the core's
//! [`OffsetTracker`](idemq_core::adapter::OffsetTracker)):
//!
//! | settle | effect |
//! |---|---|
//! | `ack` | the offset is settled; the committed offset advances over the *contiguous* settled prefix only (after each batch and every `commit_interval`), never past a record still running |
//! | `nack(delay)` | the record is held locally ([`DelayedRedelivery`](idemq_core::adapter::DelayedRedelivery), lane = partition) and redelivered after the delay; later records of that partition wait behind it, so order holds; its offset stays uncommitted |
//! | `reject(reason)` | the record is produced to the dead-letter topic (`<topic>.dlq` by default) with [`DLQ_REASON`], [`DLQ_TOPIC`], [`DLQ_PARTITION`], [`DLQ_OFFSET`] headers; only after the broker confirms it is the offset settled. A failed produce fails the reject (the engine then nacks) |
//! | dropped unsettled | treated as a nack without delay |
//!
//! **What is fenced.** Every assignment of a partition is an epoch. When a rebalance revokes a
//! partition, its settled prefix is committed synchronously before the revoke completes, its
//! buffered and held records are dropped, and every delivery still in flight from it goes
//! stale: [`Settle::is_stale`](idemq_core::Settle::is_stale) is true (the engine gives the
//! claim back instead of running the handler) and its settlements are ignored — the new owner
//! consumes from the committed offset and the dedup store absorbs the repeat. Offsets are
//! only ever committed for partitions this consumer owns (`enable.auto.commit=false`).
//!
//! **Back-pressure.** A background thread keeps polling librdkafka, so a slow batch never
//! exceeds `max.poll.interval.ms`; a partition whose local buffer is full is paused and
//! resumed once drained. A panic on that thread is caught and returned by every later
//! `poll` as an error, instead of leaving `poll` waiting for records that never come.
//!
//! **Every record becomes an envelope** ([`to_envelope`], never a panic): key, payload and
//! header values are bytes taken as they are; a header name that is not UTF-8 (the broker
//! does not check) is carried under [`escape_header_name`]'s spelling; a record whose
//! headers librdkafka cannot parse is dead-lettered by the source with the reason
//! ([`UNREADABLE_HEADERS`]) instead of reaching a handler.
//!
//! **Kafka → Kafka exactly once.** [`TransactionalProcessor`] consumes `read_committed`, produces
//! a batch's outputs and `send_offsets_to_transaction` in one transaction; a failure aborts and
//! rewinds to the committed offsets, a fenced producer stops with [`TxnError::Fenced`].
//! With [`TxnOptions::dedup`] it also drops business duplicates (the same dedup key at a new
//! offset): the keys seen live in a compacted changelog topic written in the same transaction
//! ([`BusinessDedup`]).
//!
//! **Kafka → database exactly once** (Flow 3, with idemq-sql's `LogToDatabase`). Each
//! record's effect, its dedup record and its partition's next offset (greatest wins) commit
//! in **one database transaction**; a source configured with
//! [`KafkaSourceConfig::offsets_from`] (an
//! [`OffsetStore`](idemq_core::adapter::OffsetStore), here the flow's
//! `offset_store()`) starts every assigned partition at the offset stored in the database,
//! set on the assignment inside the rebalance callback, not at Kafka's committed offset. A
//! crash anywhere loses nothing (the position only moves with the effect) and repeats
//! nothing (the effect only commits with its dedup record and position), with no Kafka
//! transaction; Kafka commits remain as an advisory copy for lag monitoring. The flow's
//! engine refuses any ordering but `DeliveryOrder::PerPartition` (a partition's records must
//! commit in offset order); the source redelivers a partition's sent-back records in offset
//! order. This crate depends on no store: the flow lives in idemq-sql, and any
//! [`OffsetStore`](idemq_core::adapter::OffsetStore) works here.
//!
//! **Producing.** [`KafkaProducerConfig`] keeps librdkafka's keys as they are and adds
//! [`KafkaProducerConfig::idempotent`] and [`KafkaProducerConfig::transactional`] with a
//! validator that names each unsafe combination and its fix. [`KafkaPublisher`] implements
//! the core [`Publisher`](idemq_core::Publisher): the dedup key travels in
//! [`DEDUP_HEADER`](idemq_core::publish::DEDUP_HEADER), and a result comes only after the
//! delivery report.
//!
//! ```no_run
//! # async fn demo() -> Result<(), idemq_kafka::KafkaSourceError> {
//! use idemq_kafka::{KafkaSource, KafkaSourceConfig};
//! let source = KafkaSource::connect(
//!     KafkaSourceConfig::new("127.0.0.1:9092", "billing", &["payments"]).cluster("eu-1"),
//! )
//! .await?;
//! # Ok(()) }
//! ```

#![warn(missing_docs)]

mod commit;
mod config;
mod envelope;
pub mod metrics;
mod publisher;
mod source;
mod transactional;

pub use commit::commit_transaction;
pub use config::{
    ConfigError, ConfigProblem, KafkaProducerConfig, ProducerMode, Rule, RuleVerdict,
    DEFAULT_BROKER_MAX_TRANSACTION_TIMEOUT, MAX_IDEMPOTENT_IN_FLIGHT,
};
pub use envelope::{escape_header_name, to_envelope, NULL_HEADER_TYPE, UNREADABLE_HEADERS};

/// Kafka's [`BrokerKind`](idemq_core::BrokerKind), stamped on every envelope this adapter
/// builds: the `broker` label `kafka`. Its only dedup slot is idemq's
/// [`DEDUP_HEADER`](idemq_core::DEDUP_HEADER): a record key is an entity key (every event
/// of order 42 shares it, for partitioning), never a per-message dedup key.
pub const KAFKA: idemq_core::BrokerKind = idemq_core::BrokerKind::new(
    "kafka",
    &[idemq_core::DedupSlot::Header(idemq_core::DEDUP_HEADER)],
);
pub use publisher::{partition_of, publish_error, KafkaPublisher};
pub use source::{
    KafkaSource, KafkaSourceConfig, DLQ_OFFSET, DLQ_PARTITION, DLQ_REASON, DLQ_TOPIC,
};
pub use transactional::{BusinessDedup, TransactionalProcessor, TxnError, TxnOptions};

/// Re-export of the rdkafka version this crate is built on.
pub use rdkafka;

/// Why a Kafka client could not be created.
#[derive(Debug, thiserror::Error)]
pub enum KafkaSourceError {
    /// The settings are incomplete or contradictory: fix them.
    #[error("kafka misconfigured: {0}")]
    Config(String),
    /// The producer settings are unsafe: fix them.
    #[error(transparent)]
    Producer(#[from] ConfigError),
    /// librdkafka refused to create or subscribe the client.
    #[error("kafka client error: {0}")]
    Client(String),
}
