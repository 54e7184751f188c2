//! # idemq
//!
//! Exactly-once effects for at-least-once message consumers. Brokers redeliver: a lost ack, a
//! rebalance, a producer retry. idemq derives a business key from each message, claims it in a
//! durable dedup store, runs your handler once, records completion, and only then acks.
//!
//! This facade re-exports the pieces by feature flag, like `sqlx`:
//!
//! | feature | brings |
//! |---|---|
//! | `sqlite` (default) | `sql::SqliteStore`, the embedded default |
//! | `postgres`, `mysql` | `sql::PgStore`, `sql::MySqlStore` (MySQL and MariaDB) |
//! | `redis` | `redis::RedisStore` (standalone or Redis Cluster) |
//! | `layered` | `layered::LayeredStore` (local cache + bloom pre-filter in front of a store) |
//! | `nats-kv` | `nats_kv::NatsKvStore` (NATS JetStream key-value bucket, R1 or R3) |
//! | `kafka` | `kafka`: source, typed producer config and validator, publisher, exactly-once flows (builds librdkafka) |
//! | `rabbitmq`, `rabbitmq-streams` | `rabbitmq`: source, confirmed publisher; `rabbitmq::stream` |
//! | `rocketmq` | `rocketmq`: push source, publisher, transactional messages |
//! | `nats` | `nats`: JetStream durable pull-consumer source, publisher with `Nats-Msg-Id` dedup |
//! | `testkit` | the store and source contract kits |
//!
//! The `idemq` command line is its own crate, `idemq-cli` (`cli/` in the repository).
//!
//! A library takes `default-features = false` and the features it uses; with none of
//! `sqlite`, `postgres`, `mysql` it does not depend on `idemq-sql` (or sqlx) at all.
//!
//! ```
//! use idemq::{IdempotentConsumer, KeyStrategy, MemoryStore, ClaimedMessage, HandlerError};
//! use idemq::broker::MemoryBroker;
//! use std::sync::Arc;
//!
//! let consumer = IdempotentConsumer::new(
//!     Arc::new(MemoryStore::new()),
//!     KeyStrategy::json_pointer("billing", "/payment_id").unwrap(),
//!     |msg: ClaimedMessage| async move {
//!         // apply the payment described by msg.envelope.payload
//!         Ok::<_, HandlerError>(None)
//!     },
//! );
//! # let _ = consumer;
//! ```

#![warn(missing_docs)]

pub use idemq_core::*;

/// The core crate, by name.
pub use idemq_core as core;

/// SQL stores (sqlx).
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub use idemq_sql as sql;

/// The Redis store.
#[cfg(feature = "redis")]
pub use idemq_redis as redis;

/// The layered store.
#[cfg(feature = "layered")]
pub use idemq_layered as layered;

/// The NATS JetStream KV store (a store crate of its own: an adapter never depends on a store).
#[cfg(feature = "nats-kv")]
pub use idemq_nats_kv as nats_kv;

/// The Kafka adapter: consumer-group source, producer configs, publisher.
#[cfg(feature = "kafka")]
pub use idemq_kafka as kafka;

/// The RabbitMQ adapter: manual-ack source, confirmed dedup-header publisher.
#[cfg(feature = "rabbitmq")]
pub use idemq_rabbitmq as rabbitmq;

/// The RocketMQ adapter: push-consumer source, keyed publisher, transactional messages
/// checked back from the dedup store.
#[cfg(feature = "rocketmq")]
pub use idemq_rocketmq as rocketmq;

/// The NATS JetStream adapter: durable pull-consumer source, publisher deduplicated by
/// `Nats-Msg-Id`.
#[cfg(feature = "nats")]
pub use idemq_nats as nats;

mod open;
pub use open::{open_store, OpenStoreError, SUPPORTED_SCHEMES};
