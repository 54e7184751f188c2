//! # idemq-sql
//!
//! idemq's SQL stores (sqlx): SQLite (feature `sqlite`, the embedded default), PostgreSQL 12+
//! (`postgres`) and MariaDB 10.6+ / MySQL 8.0.4+ (`mysql`), one implementation behind three
//! aliases: [`SqliteStore`], [`PgStore`], [`MySqlStore`].
//!
//! Strategies (see `docs/stores-sql.md`):
//! - **dedup table** — [`SqlStore`] implements [`idemq_core::DedupStore`]: a status row per
//!   key with lease, fencing token, attempts, payload hash, stored result and retention.
//!   Claims, batched or not, are one atomic statement per batch.
//! - **batch effects in one transaction** — [`SqlStore::batch_handler`]: the engine hands a
//!   polled batch's claimed messages to one closure; their effect rows and their dedup
//!   records commit together (one transaction per batch).
//! - **unique index in the business transaction** — [`SqlStore::unique_index`] as the
//!   consumer's store: the claim is the key's insert in the batch's transaction (one write
//!   per message); [`SqlStore::insert_key_in_tx`] for a transaction of your own, and
//!   [`SqlStore::complete_in_tx`] to commit a dedup-table completion with the effect.
//! - **optimistic lock** — [`VersionedEntity`]: apply only if the message's version is
//!   newer, or compare-and-set on an expected version; one row per entity.
//! - **state machine** — [`StateMachine`]: `UPDATE … SET status = to WHERE id = ? AND
//!   status IN (from…)`, answering applied / already there / illegal / not found.
//! - **transactional outbox** — [`Outbox`] enqueues outgoing messages in the business
//!   transaction; [`OutboxRelay`] publishes them through any `Publisher` with stable dedup keys.
//! - **offsets in the database** — [`SourceOffsets`] keeps a consumer's next offset per
//!   partition in a table written in the business transaction, so a log consumer (Kafka)
//!   restarts from what committed with its effects, not from the broker's commits
//!   ([`SourceOffsets::for_group`] is the [`OffsetStore`](idemq_core::adapter::OffsetStore)
//!   the source reads on assignment). [`LogToDatabase`] is that flow whole (Kafka's flow 3):
//!   its [`OffsetTx`] is a [`MessageTx`] that also records the message's offset.
//!
//! Table and column names are [`Ident`]s, validated before they reach SQL text.
//!
//! Module order (each uses only modules before it): `sniff`, `ident`, `backend` → `errors`,
//! `queries`, `migrate`, `exec`, `options`, `entity`, `offsets` → `store` (the [`SqlStore`]
//! struct, accessors, the `DedupStore` impl) → `complete`, `claim`, `lease`, `scan`, `keys`,
//! `connect`, `claimed`, `unique` → `outbox`, `batch`, `log_flow`. The modules from
//! `complete` to `connect` add `impl SqlStore` blocks; the `DedupStore` impl calls their
//! methods without importing them.
//!
//! ```no_run
//! # async fn demo() -> Result<(), idemq_core::StoreError> {
//! use idemq_core::{ClaimOutcome, ClaimRequest, ConsumerGroup, DedupKey, DedupStore};
//! use idemq_sql::{SqlStoreOptions, SqliteStore};
//! use std::time::Duration;
//!
//! let store = SqliteStore::connect("sqlite://idemq.db", SqlStoreOptions::default()).await?;
//! let key = DedupKey::new(&ConsumerGroup::new("billing").unwrap(), "order-42").unwrap();
//! if let ClaimOutcome::Acquired(lease) =
//!     store.claim(&ClaimRequest::new(key.clone(), Duration::from_secs(30))).await?
//! {
//!     // ... the effect, then in the same transaction as the effect:
//!     let mut tx = store.pool().begin().await.map_err(|e| idemq_core::StoreError::Unavailable(e.to_string()))?;
//!     let done = store.complete_in_tx(&mut tx, &key, lease.token, None, Duration::from_secs(86_400)).await?;
//!     // Commit only a fresh completion: `AlreadyCompleted` means an earlier transaction of
//!     // this claim committed the effect, `Fenced` that the lease was lost.
//!     if done == idemq_core::CompleteOutcome::Completed {
//!         tx.commit().await.map_err(|e| idemq_core::StoreError::Unavailable(e.to_string()))?;
//!     }
//! }
//! # Ok(()) }
//! ```
#![warn(missing_docs)]
// With no driver feature (the facade built for Redis or a broker only), the driver-neutral
// parts stay compiled for their types but nothing calls the connect-time helpers.
#![cfg_attr(
    not(any(feature = "sqlite", feature = "postgres", feature = "mysql")),
    allow(dead_code, unused_imports)
)]

mod backend;
pub mod batch;
mod claim;
mod claimed;
mod complete;
mod connect;
mod entity;
mod errors;
mod exec;
mod ident;
mod keys;
mod lease;
mod log_flow;
pub mod migrate;
mod offsets;
mod options;
mod outbox;
mod queries;
mod scan;
// Who answers on a port: only the network backends probe at startup.
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod sniff;
mod store;
pub mod unique;
pub use unique::UniqueIndexStore;

pub use backend::{map_sqlx_error, Dialect, SqlBackend};
#[doc(hidden)]
pub use backend::{ErrorClass, Kind, Row, Val};
pub use batch::{KeyedTxFuture, TxBatchHandler, TxFuture};
pub use claim::MAX_WORKER_BYTES;
pub use claimed::{LeaseLost, MessageTx, PooledTx};
pub use entity::{EntityId, StateMachine, Transition, VersionOutcome, VersionedEntity};
pub use errors::{handler_error, is_retryable_sqlx_error, SqlResultExt};
pub use ident::{is_valid_ident, ColumnName, Ident, TableName, DEFAULT_TABLE, MAX_IDENT_LEN};
pub use keys::KeyInsert;
pub use log_flow::{check_log_ordering, LogToDatabase, NoLogPosition, OffsetTx};
pub use offsets::{
    offsets_migrations, GroupOffsets, SourceOffsets, StoredOffset, DEFAULT_OFFSETS_TABLE,
    MAX_OFFSETS_NAME_BYTES,
};
pub use options::{SqlStoreOptions, SqliteSynchronous};
pub use outbox::{
    Enqueued, Outbox, OutboxCounts, OutboxEntry, OutboxError, OutboxOptions, OutboxRelay,
    OutboxStatus, RelayOptions, RelayReport, DEFAULT_OUTBOX_TABLE, MAX_OUTBOX_DEDUP_KEY_BYTES,
    MAX_OUTBOX_TABLE_LEN,
};
pub use store::SqlStore;

/// The SQLite store (feature `sqlite`).
#[cfg(feature = "sqlite")]
pub type SqliteStore = SqlStore<sqlx::Sqlite>;

/// The PostgreSQL store (feature `postgres`).
#[cfg(feature = "postgres")]
pub type PgStore = SqlStore<sqlx::Postgres>;

/// The MySQL / MariaDB store (feature `mysql`).
#[cfg(feature = "mysql")]
pub type MySqlStore = SqlStore<sqlx::MySql>;

/// Re-export of sqlx, so callers use the same version for pools and transactions.
pub use sqlx;
