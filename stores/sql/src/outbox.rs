//! The transactional outbox: "write to the database and send a message" exactly once,
//! without a distributed transaction.
//!
//! 1. **Enqueue in the business transaction.** [`Outbox::enqueue`] inserts the outgoing
//!    message into the outbox table on the caller's connection, inside the caller's
//!    transaction: the effect and the message commit together or not at all. Every message
//!    gets a stable dedup key (the caller's [`OutgoingMessage::dedup_key`], or a random
//!    UUID-like one), stored with the row, so every resend carries the same key.
//! 2. **Relay.** An [`OutboxRelay`] claims due rows in id order under a lease (one short
//!    transaction: `FOR UPDATE SKIP LOCKED` on PostgreSQL and MySQL/MariaDB, `BEGIN IMMEDIATE`
//!    on SQLite, whose single writer serializes relays), publishes them through any
//!    [`Publisher`] and marks them sent only after the broker's durable confirm.
//! 3. **Crash anywhere.** A crash after commit and before the relay: the row is pending and
//!    the next relay publishes it. A crash after the publish and before the row is marked
//!    sent: the lease ends, another relay publishes it *again with the same dedup key*, and
//!    the consumer's [`IdempotentConsumer`](idemq_core::IdempotentConsumer) (key strategy
//!    [`KeyStrategy::dedup_header`](idemq_core::KeyStrategy::dedup_header)) drops the copy.
//!    At-least-once publishing + consumer dedup = exactly-once effects.
//!
//! Row lifecycle: `pending` → `sent` (confirmed; purged after a retention) or `failed` (a
//! non-retryable [`PublishError`], or retryable errors beyond
//! [`RelayOptions::retry`]`.max_attempts`: kept with its error text and attempt count,
//! listed by [`Outbox::list`], put back by [`Outbox::retry_failed`]). Retryable errors
//! (ambiguous, disconnected) back the row off by [`RelayOptions::retry`].
//!
//! **Order.** Rows of one *lane* — the same destination and ordering key
//! ([`OutgoingMessage::ordering_key`], else [`OutgoingMessage::key`], as Kafka partitions) —
//! are published in id order, one after another: a row waits while an earlier row of its
//! lane is pending, leased by another relay, backing off, or (by default,
//! [`RelayOptions::failed_blocks_lane`]) failed. Messages with neither key are unordered.
//! Ids follow insertion, so order within a lane follows commit order when the transactions
//! enqueuing for one lane are serialized (they lock the same entity row, as per-entity
//! ordering requires anyway). Times are the relay's clock (`now_ms`); keep relay hosts'
//! clocks roughly in sync, and the lease well above a publish's latency.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use idemq_core::broker::MemoryBroker;
//! use idemq_core::OutgoingMessage;
//! use idemq_sql::sqlx::sqlite::SqlitePool;
//! use idemq_sql::{Outbox, OutboxOptions};
//!
//! let pool = SqlitePool::connect("sqlite://app.db?mode=rwc").await?;
//! let outbox = Outbox::from_pool(pool.clone(), OutboxOptions::default()).await?;
//!
//! let mut tx = pool.begin().await?;
//! // ... the business writes on `tx` ...
//! outbox
//!     .enqueue(&mut tx, OutgoingMessage::new("payments", "{}").with_dedup_key("pay-42"))
//!     .await?;
//! tx.commit().await?;
//!
//! let relay = outbox.relay(MemoryBroker::new());
//! relay.drain().await?; // or `relay.run(shutdown)` in a task
//! # Ok(()) }
//! ```

use crate::backend::{
    error_class, map_sqlx_error, Dialect, ErrorClass, Kind, Row, SqlBackend, Val,
};
use crate::claimed::PooledTx;
use crate::ident::{TableName, MAX_IDENT_LEN};
use crate::migrate;
use bytes::Bytes;
use idemq_core::store::duration_ms;
use idemq_core::{
    now_ms, Headers, OutgoingMessage, PublishError, Publisher, RetryPolicy, StoreError,
};
use rand::Rng;
use sqlx::Pool;
use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

/// The default outbox table: `idemq_outbox`.
pub const DEFAULT_OUTBOX_TABLE: &str = "idemq_outbox";

/// The longest outbox table name, in bytes: index names append up to 12 bytes and must stay
/// within PostgreSQL's 63.
pub const MAX_OUTBOX_TABLE_LEN: usize = MAX_IDENT_LEN - 12;

/// The longest dedup key an outbox row accepts, in bytes.
pub const MAX_OUTBOX_DEDUP_KEY_BYTES: usize = 1024;

/// The most error text kept per row, in bytes.
const MAX_ERROR_BYTES: usize = 2000;

/// How often a mark statement is retried at once after a deadlock.
const MARK_ATTEMPTS: u32 = 5;

/// Why an outbox call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum OutboxError {
    /// The database cannot be reached, timed out, or hit a deadlock: back off and retry
    /// (in a business transaction: roll back and retry the transaction).
    #[error("outbox database unavailable: {0}")]
    Unavailable(String),
    /// The database answered with an error retrying will not fix as is.
    #[error("outbox database error: {0}")]
    Backend(String),
    /// The outbox is misconfigured (table name, schema).
    #[error("outbox misconfigured: {0}")]
    Config(String),
    /// The message cannot be stored (empty destination, oversize dedup key).
    #[error("invalid outgoing message: {0}")]
    InvalidMessage(String),
}

impl OutboxError {
    /// Whether retrying the same call later may succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(self, OutboxError::Unavailable(_))
    }
}

impl From<StoreError> for OutboxError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Unavailable(m) => OutboxError::Unavailable(m),
            StoreError::Config(m) => OutboxError::Config(m),
            StoreError::Backend(m) => OutboxError::Backend(m),
            other => OutboxError::Backend(other.to_string()),
        }
    }
}

fn db_err<DB: SqlBackend>(op: &str, e: sqlx::Error) -> OutboxError {
    map_sqlx_error::<DB>(&format!("outbox {op}"), e).into()
}

/// Where a row is in its lifecycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OutboxStatus {
    /// Waiting to be published (or being published under a lease, or backing off).
    Pending,
    /// Published and confirmed by the broker.
    Sent,
    /// Given up on: a non-retryable publish error, or retryable ones beyond the attempt
    /// limit. Kept with its error until [`Outbox::retry_failed`] or a purge.
    Failed,
}

impl OutboxStatus {
    fn code(self) -> i64 {
        match self {
            OutboxStatus::Pending => 0,
            OutboxStatus::Sent => 1,
            OutboxStatus::Failed => 2,
        }
    }
    fn from_code(c: i64) -> Option<Self> {
        match c {
            0 => Some(OutboxStatus::Pending),
            1 => Some(OutboxStatus::Sent),
            2 => Some(OutboxStatus::Failed),
            _ => None,
        }
    }
}

/// Options of an [`Outbox`].
///
/// ```
/// use idemq_sql::{OutboxOptions, TableName};
/// let opts = OutboxOptions::with_table(TableName::new("billing_outbox")?);
/// assert!(opts.migrate);
/// # Ok::<(), idemq_core::StoreError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxOptions {
    /// The outbox table (default `idemq_outbox`; at most [`MAX_OUTBOX_TABLE_LEN`] bytes; it
    /// must not share a name with a dedup table).
    pub table: TableName,
    /// Create / upgrade the table when the outbox opens (default `true`).
    pub migrate: bool,
}

impl Default for OutboxOptions {
    fn default() -> Self {
        Self {
            table: TableName::new(DEFAULT_OUTBOX_TABLE).expect("the default name is valid"),
            migrate: true,
        }
    }
}

impl OutboxOptions {
    /// Default options for the outbox table `table`.
    pub fn with_table(table: TableName) -> Self {
        Self {
            table,
            ..Self::default()
        }
    }
}

/// What [`Outbox::enqueue`] stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Enqueued {
    /// The row id (publish order within a lane).
    pub id: i64,
    /// The dedup key every publish of this row carries.
    pub dedup_key: String,
}

/// One outbox row, for inspection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxEntry {
    /// The row id.
    pub id: i64,
    /// The message as it will be (or was) published, dedup key included.
    pub message: OutgoingMessage,
    /// Lifecycle state.
    pub status: OutboxStatus,
    /// Publish attempts started so far (a relay crash mid-publish counts too).
    pub attempts: u32,
    /// Not published before this time (unix ms): the back-off of a retryable error.
    pub available_ms: i64,
    /// When it was enqueued (unix ms).
    pub created_ms: i64,
    /// Last change (unix ms): for a sent row, when it was confirmed.
    pub updated_ms: i64,
    /// The last publish error, if any.
    pub last_error: Option<String>,
}

/// Row counts by status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OutboxCounts {
    /// Waiting to be published.
    pub pending: u64,
    /// Published, not yet purged.
    pub sent: u64,
    /// Given up on, waiting for an operator.
    pub failed: u64,
}

/// The statements of one outbox table, built once.
#[derive(Debug)]
struct OutboxSql {
    insert: String,
    claim_blocking_failed: String,
    claim_skipping_failed: String,
    get: String,
    list: String,
    counts: String,
    retry_failed: String,
    purge_sent: String,
    mark_retry: String,
    mark_failed: String,
    probe: String,
}

const COLS: &str = "id, destination, msg_key, ordering_key, lane, headers, payload, dedup_key, \
                    status, attempts, available_ms, created_ms, updated_ms, last_error";
/// The kinds of [`COLS`], in order.
const ROW_KINDS: [Kind; 14] = [
    Kind::I64,
    Kind::Text,
    Kind::Bytes,
    Kind::Bytes,
    Kind::I64,
    Kind::Bytes,
    Kind::Bytes,
    Kind::Text,
    Kind::I64,
    Kind::I64,
    Kind::I64,
    Kind::I64,
    Kind::I64,
    Kind::Text,
];
const COL_KINDS: &[Kind] = &ROW_KINDS;
/// [`COL_KINDS`] plus the claim's count of unsent rows ahead in the lane (one list, so the two
/// cannot drift apart).
const CLAIM_KINDS: &[Kind] = &{
    let mut kinds = [Kind::I64; 15];
    let mut i = 0;
    while i < ROW_KINDS.len() {
        kinds[i] = ROW_KINDS[i];
        i += 1;
    }
    kinds
};

impl OutboxSql {
    fn new(d: Dialect, t: &TableName) -> Self {
        let p = |s: String| d.placeholders(s);
        let returning = match d {
            Dialect::MySql => "",
            Dialect::Postgres | Dialect::Sqlite => " RETURNING id",
        };
        let lock = match d {
            Dialect::Postgres => " FOR UPDATE OF o SKIP LOCKED",
            Dialect::MySql => " FOR UPDATE SKIP LOCKED",
            Dialect::Sqlite => "",
        };
        let ocols = COLS
            .split(", ")
            .map(|c| format!("o.{c}"))
            .collect::<Vec<_>>()
            .join(", ");
        // `ahead`: unsent rows earlier in the lane, read in the same statement as the
        // candidates, so a row another relay holds (skipped by SKIP LOCKED) still counts.
        let claim = |blocking: &str| {
            p(format!(
                "SELECT {ocols}, {} FROM {t} o WHERE o.status = 0 AND o.available_ms <= ? \
                 AND o.lease_until_ms <= ? ORDER BY o.id LIMIT ?{lock}",
                d.cast_i64(&format!(
                    "(SELECT COUNT(*) FROM {t} p WHERE p.lane = o.lane AND p.id < o.id \
                     AND p.status IN ({blocking}))"
                ))
            ))
        };
        let purge_sent = match d {
            Dialect::MySql => {
                format!("DELETE FROM {t} WHERE status = 1 AND updated_ms < ? ORDER BY updated_ms LIMIT ?")
            }
            Dialect::Postgres => format!(
                "WITH doomed AS (SELECT id FROM {t} WHERE status = 1 AND updated_ms < ? \
                 ORDER BY updated_ms LIMIT ? FOR UPDATE SKIP LOCKED) \
                 DELETE FROM {t} AS t USING doomed WHERE t.id = doomed.id"
            ),
            Dialect::Sqlite => format!(
                "DELETE FROM {t} WHERE id IN (SELECT id FROM {t} WHERE status = 1 \
                 AND updated_ms < ? ORDER BY updated_ms LIMIT ?)"
            ),
        };
        Self {
            insert: p(format!(
                "INSERT INTO {t} (destination, msg_key, ordering_key, lane, headers, payload, \
                 dedup_key, status, attempts, available_ms, lease_until_ms, created_ms, updated_ms) \
                 VALUES (?, ?, ?, ?, ?, ?, ?, 0, 0, ?, 0, ?, ?){returning}"
            )),
            claim_blocking_failed: claim("0, 2"),
            claim_skipping_failed: claim("0"),
            get: p(format!("SELECT {COLS} FROM {t} WHERE id = ?")),
            list: p(format!(
                "SELECT {COLS} FROM {t} WHERE status = ? AND id > ? ORDER BY id LIMIT ?"
            )),
            counts: format!(
                "SELECT status, {} FROM {t} GROUP BY status",
                d.cast_i64("COUNT(*)")
            ),
            retry_failed: p(format!(
                "UPDATE {t} SET status = 0, available_ms = ?, lease_until_ms = 0, \
                 lease_token = NULL, updated_ms = ? WHERE id = ? AND status = 2"
            )),
            purge_sent: p(purge_sent),
            mark_retry: p(format!(
                "UPDATE {t} SET lease_until_ms = 0, lease_token = NULL, available_ms = ?, \
                 last_error = ?, updated_ms = ? WHERE id = ? AND lease_token = ?"
            )),
            mark_failed: p(format!(
                "UPDATE {t} SET status = 2, lease_until_ms = 0, lease_token = NULL, \
                 last_error = ?, updated_ms = ? WHERE id = ? AND lease_token = ?"
            )),
            probe: format!("SELECT {COLS} FROM {t} WHERE 1 = 0"),
        }
    }
}

/// `id IN (…)` for `ids` in dialect `d`: placeholders and their arguments, to follow the
/// statement's other `?`s.
fn id_set(d: Dialect, ids: &[i64]) -> (String, Vec<Val>) {
    match d {
        Dialect::Postgres => ("id = ANY(?)".to_owned(), vec![Val::I64Array(ids.to_vec())]),
        Dialect::MySql | Dialect::Sqlite => {
            let marks = vec!["?"; ids.len()].join(", ");
            (
                format!("id IN ({marks})"),
                ids.iter().map(|i| Val::I64(Some(*i))).collect(),
            )
        }
    }
}

/// A transactional outbox on one table. Cloning is cheap (the pool is shared).
///
/// Use the pool your business code writes with, so [`Outbox::enqueue`] joins its
/// transactions. The guarantees are in docs/stores-sql.md, "Transactional outbox".
///
/// ```no_run
/// # async fn demo(pool: idemq_sql::sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// use idemq_core::OutgoingMessage;
/// use idemq_sql::{Outbox, OutboxOptions};
///
/// let outbox = Outbox::from_pool(pool.clone(), OutboxOptions::default()).await?;
/// let mut tx = pool.begin().await?;
/// idemq_sql::sqlx::query("UPDATE orders SET status = 'PAID' WHERE id = 42")
///     .execute(&mut *tx)
///     .await?;
/// let sent = outbox
///     .enqueue(&mut tx, OutgoingMessage::new("order-events", r#"{"id":42}"#).with_key("42"))
///     .await?;
/// tx.commit().await?;
/// println!("dedup key {}", sent.dedup_key);
/// # Ok(()) }
/// ```
pub struct Outbox<DB: SqlBackend> {
    pool: Pool<DB>,
    table: TableName,
    sql: Arc<OutboxSql>,
}

impl<DB: SqlBackend> Clone for Outbox<DB> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            table: self.table.clone(),
            sql: self.sql.clone(),
        }
    }
}

impl<DB: SqlBackend> fmt::Debug for Outbox<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Outbox")
            .field("backend", &DB::DIALECT.name())
            .field("table", &self.table.as_str())
            .finish_non_exhaustive()
    }
}

impl<DB: SqlBackend> Outbox<DB> {
    /// Opens the outbox on `pool`, creating / upgrading its table unless
    /// [`OutboxOptions::migrate`] is off, and checks the table has the outbox's columns.
    pub async fn from_pool(pool: Pool<DB>, options: OutboxOptions) -> Result<Self, OutboxError> {
        if options.table.as_str().len() > MAX_OUTBOX_TABLE_LEN {
            return Err(OutboxError::Config(format!(
                "outbox table name `{}` is longer than {MAX_OUTBOX_TABLE_LEN} bytes \
                 (its index names must fit the 63-byte identifier limit)",
                options.table
            )));
        }
        let outbox = Self {
            sql: Arc::new(OutboxSql::new(DB::DIALECT, &options.table)),
            pool,
            table: options.table,
        };
        if options.migrate {
            outbox.migrate().await?;
        }
        let mut conn = outbox.acquire().await?;
        DB::fetch(&mut conn, &outbox.sql.probe, vec![], COL_KINDS)
            .await
            .map_err(|e| {
                OutboxError::Config(format!(
                    "table `{}` is not an idemq outbox table ({e}); run the migrations or \
                     pick a table name no dedup table uses",
                    outbox.table
                ))
            })?;
        Ok(outbox)
    }

    /// Creates or upgrades the outbox table; returns the schema version now applied. Safe
    /// to run concurrently from many processes.
    pub async fn migrate(&self) -> Result<i64, OutboxError> {
        let set = migrate::outbox_migrations(DB::DIALECT);
        Ok(migrate::run_set::<DB>(&self.pool, set, &self.table, &self.table).await?)
    }

    /// The pool.
    pub fn pool(&self) -> &Pool<DB> {
        &self.pool
    }

    /// The outbox table.
    pub fn table(&self) -> &TableName {
        &self.table
    }

    async fn acquire(&self) -> Result<sqlx::pool::PoolConnection<DB>, OutboxError> {
        self.pool
            .acquire()
            .await
            .map_err(|e| db_err::<DB>("acquire connection", e))
    }

    /// Stores `msg` on `conn` — pass the caller's open transaction (`&mut tx`), so the
    /// message commits or rolls back with the business writes. The dedup key is the
    /// message's own or a new random one; the answer says which.
    ///
    /// Errors: [`OutboxError::InvalidMessage`] for an empty destination or a dedup key
    /// empty or over [`MAX_OUTBOX_DEDUP_KEY_BYTES`]; database errors as
    /// [`OutboxError::Unavailable`] (roll back, retry the transaction) or `Backend`.
    pub async fn enqueue(
        &self,
        conn: &mut DB::Connection,
        msg: OutgoingMessage,
    ) -> Result<Enqueued, OutboxError> {
        let dedup_key = match msg.dedup_key {
            Some(k) => k,
            None => random_dedup_key(),
        };
        if msg.destination.is_empty() {
            return Err(OutboxError::InvalidMessage(
                "empty destination: name the topic, exchange or queue".into(),
            ));
        }
        if dedup_key.is_empty() || dedup_key.len() > MAX_OUTBOX_DEDUP_KEY_BYTES {
            return Err(OutboxError::InvalidMessage(format!(
                "dedup key of {} bytes: use 1 to {MAX_OUTBOX_DEDUP_KEY_BYTES} bytes",
                dedup_key.len()
            )));
        }
        let headers = encode_headers(&msg.headers)?;
        let lane = lane_of(
            &msg.destination,
            msg.ordering_key.as_deref().or(msg.key.as_deref()),
        );
        let now = now_ms();
        let args = vec![
            Val::Text(Some(msg.destination)),
            Val::Bytes(msg.key.map(|k| k.to_vec())),
            Val::Bytes(msg.ordering_key.map(|k| k.to_vec())),
            Val::I64(lane),
            Val::Bytes(Some(headers)),
            Val::Bytes(Some(msg.payload.to_vec())),
            Val::Text(Some(dedup_key.clone())),
            Val::I64(Some(now)),
            Val::I64(Some(now)),
            Val::I64(Some(now)),
        ];
        let err = |e| db_err::<DB>("enqueue", e);
        let id = match DB::DIALECT {
            Dialect::MySql => {
                DB::execute(conn, &self.sql.insert, args)
                    .await
                    .map_err(err)?;
                let rows = DB::fetch(
                    conn,
                    "SELECT CAST(LAST_INSERT_ID() AS SIGNED)",
                    vec![],
                    &[Kind::I64],
                )
                .await
                .map_err(err)?;
                first_i64(&rows, "LAST_INSERT_ID()")?
            }
            Dialect::Postgres | Dialect::Sqlite => {
                let rows = DB::fetch(conn, &self.sql.insert, args, &[Kind::I64])
                    .await
                    .map_err(err)?;
                first_i64(&rows, "RETURNING id")?
            }
        };
        tracing::debug!(table = %self.table, id, dedup_key = %dedup_key, "outbox: enqueued");
        Ok(Enqueued { id, dedup_key })
    }

    /// [`Outbox::enqueue`] for each message, in order (their ids increase in that order).
    pub async fn enqueue_many(
        &self,
        conn: &mut DB::Connection,
        msgs: impl IntoIterator<Item = OutgoingMessage>,
    ) -> Result<Vec<Enqueued>, OutboxError> {
        let mut out = Vec::new();
        for m in msgs {
            out.push(self.enqueue(&mut *conn, m).await?);
        }
        Ok(out)
    }

    /// A relay publishing this outbox through `publisher`, with default [`RelayOptions`].
    pub fn relay<P: Publisher>(&self, publisher: P) -> OutboxRelay<DB, P> {
        OutboxRelay::new(self.clone(), publisher, RelayOptions::default())
    }

    /// One row by id.
    pub async fn entry(&self, id: i64) -> Result<Option<OutboxEntry>, OutboxError> {
        let mut conn = self.acquire().await?;
        let rows = DB::fetch(
            &mut conn,
            &self.sql.get,
            vec![Val::I64(Some(id))],
            COL_KINDS,
        )
        .await
        .map_err(|e| db_err::<DB>("entry", e))?;
        rows.first()
            .map(|r| decode_entry(r).map_err(|reason| corrupt(&self.table, id, &reason)))
            .transpose()
    }

    /// Up to `limit` rows in `status` with an id above `after` (0 for the first page), in
    /// id order: e.g. the failed messages waiting for an operator.
    pub async fn list(
        &self,
        status: OutboxStatus,
        after: i64,
        limit: usize,
    ) -> Result<Vec<OutboxEntry>, OutboxError> {
        let mut conn = self.acquire().await?;
        let rows = DB::fetch(
            &mut conn,
            &self.sql.list,
            vec![
                Val::I64(Some(status.code())),
                Val::I64(Some(after)),
                Val::I64(Some(limit_i64(limit))),
            ],
            COL_KINDS,
        )
        .await
        .map_err(|e| db_err::<DB>("list", e))?;
        rows.iter()
            .map(|r| {
                decode_entry(r).map_err(|reason| {
                    corrupt(
                        &self.table,
                        r.opt_i64(0).ok().flatten().unwrap_or(0),
                        &reason,
                    )
                })
            })
            .collect()
    }

    /// Row counts by status.
    pub async fn counts(&self) -> Result<OutboxCounts, OutboxError> {
        let mut conn = self.acquire().await?;
        let rows = DB::fetch(&mut conn, &self.sql.counts, vec![], &[Kind::I64, Kind::I64])
            .await
            .map_err(|e| db_err::<DB>("counts", e))?;
        let mut c = OutboxCounts::default();
        for r in &rows {
            let n = u64::try_from(r.i64(1).unwrap_or(0)).unwrap_or(0);
            match r.i64(0).ok().and_then(OutboxStatus::from_code) {
                Some(OutboxStatus::Pending) => c.pending = n,
                Some(OutboxStatus::Sent) => c.sent = n,
                Some(OutboxStatus::Failed) => c.failed = n,
                None => {}
            }
        }
        Ok(c)
    }

    /// Puts a failed row back to pending, due now (its attempt count and last error are
    /// kept). `false` when the row is not failed.
    pub async fn retry_failed(&self, id: i64) -> Result<bool, OutboxError> {
        let mut conn = self.acquire().await?;
        let now = now_ms();
        let n = DB::execute(
            &mut conn,
            &self.sql.retry_failed,
            vec![Val::I64(Some(now)), Val::I64(Some(now)), Val::I64(Some(id))],
        )
        .await
        .map_err(|e| db_err::<DB>("retry_failed", e))?;
        if n > 0 {
            tracing::info!(table = %self.table, id, "outbox: failed message put back to pending");
        }
        Ok(n > 0)
    }

    /// Deletes up to `limit` sent rows confirmed more than `age` ago; returns how many.
    /// Pending and failed rows are never purged.
    pub async fn purge_sent_older_than(
        &self,
        age: Duration,
        limit: usize,
    ) -> Result<u64, OutboxError> {
        if limit == 0 {
            return Ok(0);
        }
        let cutoff = now_ms().saturating_sub(duration_ms(age));
        let mut conn = self.acquire().await?;
        let n = DB::execute(
            &mut conn,
            &self.sql.purge_sent,
            vec![Val::I64(Some(cutoff)), Val::I64(Some(limit_i64(limit)))],
        )
        .await
        .map_err(|e| db_err::<DB>("purge_sent", e))?;
        if n > 0 {
            tracing::debug!(table = %self.table, purged = n, "outbox: purged sent messages");
        }
        Ok(n)
    }
}

fn limit_i64(limit: usize) -> i64 {
    i64::try_from(limit).unwrap_or(i64::MAX)
}

fn first_i64(rows: &[Row], what: &str) -> Result<i64, OutboxError> {
    rows.first()
        .and_then(|r| r.opt_i64(0).ok().flatten())
        .ok_or_else(|| OutboxError::Backend(format!("outbox enqueue: {what} returned no id")))
}

fn corrupt(table: &TableName, id: i64, reason: &str) -> OutboxError {
    OutboxError::Backend(format!("outbox row {table}/{id} is malformed: {reason}"))
}

/// A random key shaped like a UUID v4 (`xxxxxxxx-xxxx-4xxx-yxxx-xxxxxxxxxxxx`).
fn random_dedup_key() -> String {
    let mut b: [u8; 16] = rand::thread_rng().gen();
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// The lane of a message: a stable FNV-1a hash of destination and ordering key, `None`
/// when it has no ordering key. Collisions only serialize two lanes.
fn lane_of(destination: &str, ordering: Option<&[u8]>) -> Option<i64> {
    let ordering = ordering?;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in destination
        .as_bytes()
        .iter()
        .chain(std::iter::once(&0u8))
        .chain(ordering)
    {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    Some(h as i64)
}

/// Headers as `1, count:u32, (name_len:u32, name, value_len:u32, value)*`, big-endian:
/// order, repeated names and binary values survive.
fn encode_headers(h: &Headers) -> Result<Vec<u8>, OutboxError> {
    let len32 = |n: usize| {
        u32::try_from(n).map_err(|_| OutboxError::InvalidMessage("a header exceeds 4 GiB".into()))
    };
    let mut out = vec![1u8];
    out.extend_from_slice(&len32(h.len())?.to_be_bytes());
    for (name, value) in h.iter() {
        out.extend_from_slice(&len32(name.len())?.to_be_bytes());
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(&len32(value.len())?.to_be_bytes());
        out.extend_from_slice(value);
    }
    Ok(out)
}

fn decode_headers(b: &[u8]) -> Result<Headers, String> {
    fn take<'a>(b: &mut &'a [u8], n: usize) -> Result<&'a [u8], String> {
        if b.len() < n {
            return Err("headers truncated".into());
        }
        let (head, rest) = b.split_at(n);
        *b = rest;
        Ok(head)
    }
    fn u32_at(b: &mut &[u8]) -> Result<usize, String> {
        let raw = take(b, 4)?;
        let arr: [u8; 4] = raw.try_into().map_err(|_| "headers truncated".to_owned())?;
        Ok(u32::from_be_bytes(arr) as usize)
    }
    let mut b = b;
    match take(&mut b, 1)? {
        [1] => {}
        v => return Err(format!("unknown headers encoding {v:?}")),
    }
    let count = u32_at(&mut b)?;
    let mut h = Headers::new();
    for _ in 0..count {
        let n = u32_at(&mut b)?;
        let name = std::str::from_utf8(take(&mut b, n)?)
            .map_err(|e| format!("header name not UTF-8: {e}"))?
            .to_owned();
        let n = u32_at(&mut b)?;
        let value = Bytes::copy_from_slice(take(&mut b, n)?);
        h.insert(name, value);
    }
    if !b.is_empty() {
        return Err("trailing bytes after headers".into());
    }
    Ok(h)
}

fn decode_message(r: &Row) -> Result<OutgoingMessage, String> {
    let headers = decode_headers(r.opt_bytes(5)?.unwrap_or_default())?;
    Ok(OutgoingMessage {
        destination: r.text(1)?.to_owned(),
        key: r.opt_bytes(2)?.map(Bytes::copy_from_slice),
        ordering_key: r.opt_bytes(3)?.map(Bytes::copy_from_slice),
        headers,
        payload: Bytes::copy_from_slice(r.opt_bytes(6)?.unwrap_or_default()),
        dedup_key: Some(r.text(7)?.to_owned()),
    })
}

fn decode_entry(r: &Row) -> Result<OutboxEntry, String> {
    let status = r.i64(8)?;
    Ok(OutboxEntry {
        id: r.i64(0)?,
        message: decode_message(r)?,
        status: OutboxStatus::from_code(status)
            .ok_or_else(|| format!("unknown status {status}"))?,
        attempts: u32::try_from(r.i64(9)?.max(0)).unwrap_or(u32::MAX),
        available_ms: r.i64(10)?,
        created_ms: r.i64(11)?,
        updated_ms: r.i64(12)?,
        last_error: r.opt_text(13)?.map(str::to_owned),
    })
}

/// Cuts `s` to at most `max` bytes at a character boundary.
fn bounded(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Settings of an [`OutboxRelay`].
///
/// ```
/// use idemq_sql::RelayOptions;
/// use std::time::Duration;
/// let opts = RelayOptions { batch: 50, lease: Duration::from_secs(10), ..Default::default() };
/// assert!(opts.failed_blocks_lane);
/// ```
#[derive(Debug, Clone)]
pub struct RelayOptions {
    /// Rows claimed per round (default 100).
    pub batch: usize,
    /// How long a claim holds its rows (default 60 s). Another relay republishes rows whose
    /// lease ended without a mark: keep it well above a batch's publish time.
    pub lease: Duration,
    /// Sleep of [`OutboxRelay::run`] when nothing was due (default 200 ms).
    pub poll_interval: Duration,
    /// Back-off of a row after a retryable publish error, by attempt; past `max_attempts`
    /// (default `None`: retry forever) the row is marked failed.
    pub retry: RetryPolicy,
    /// A failed row holds back the later rows of its lane until an operator retries it
    /// (default `true`: order over progress). `false` lets them go past it.
    pub failed_blocks_lane: bool,
    /// [`OutboxRelay::run`]: back-off after a database error, doubling up to 30 s
    /// (default 100 ms).
    pub error_backoff: Duration,
    /// [`OutboxRelay::run`]: purge sent rows older than this, once a minute (default
    /// `Some(7 days)`; `None` keeps them).
    pub retention: Option<Duration>,
}

impl Default for RelayOptions {
    fn default() -> Self {
        Self {
            batch: 100,
            lease: Duration::from_secs(60),
            poll_interval: Duration::from_millis(200),
            retry: RetryPolicy {
                max_attempts: None,
                ..RetryPolicy::default()
            },
            failed_blocks_lane: true,
            error_backoff: Duration::from_millis(100),
            retention: Some(Duration::from_secs(7 * 86_400)),
        }
    }
}

/// What one relay round (or a drain) did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RelayReport {
    /// Rows claimed.
    pub claimed: u64,
    /// Published, confirmed and marked sent.
    pub sent: u64,
    /// Retryable publish errors: backed off.
    pub retried: u64,
    /// Marked failed (non-retryable error, attempts exhausted or a malformed row).
    pub failed: u64,
    /// Claimed but not attempted, because an earlier row of their lane was not sent:
    /// given back.
    pub released: u64,
    /// Published but the lease was lost before the mark (another relay took the row over
    /// and will publish it again, with the same dedup key).
    pub lease_lost: u64,
}

impl RelayReport {
    fn add(&mut self, o: &RelayReport) {
        self.claimed += o.claimed;
        self.sent += o.sent;
        self.retried += o.retried;
        self.failed += o.failed;
        self.released += o.released;
        self.lease_lost += o.lease_lost;
    }
}

/// A claimed row.
struct Claimed {
    id: i64,
    lane: Option<i64>,
    attempts: u32,
    msg: OutgoingMessage,
}

/// Publishes an [`Outbox`]'s rows through a [`Publisher`] (docs/stores-sql.md,
/// "Transactional outbox").
/// Any number of relays may run on one table, in any processes.
///
/// ```no_run
/// # async fn demo(outbox: idemq_sql::Outbox<idemq_sql::sqlx::Sqlite>) -> Result<(), idemq_sql::OutboxError> {
/// use idemq_core::broker::MemoryBroker;
/// use idemq_sql::{OutboxRelay, RelayOptions};
///
/// let relay = OutboxRelay::new(outbox, MemoryBroker::new(), RelayOptions::default());
/// let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
/// let task = tokio::spawn(async move { relay.run(async { let _ = stopped.await; }).await });
/// // ... later:
/// let _ = stop.send(());
/// # let _ = task.await;
/// # Ok(()) }
/// ```
pub struct OutboxRelay<DB: SqlBackend, P> {
    outbox: Outbox<DB>,
    publisher: P,
    opts: RelayOptions,
}

impl<DB: SqlBackend, P> fmt::Debug for OutboxRelay<DB, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OutboxRelay")
            .field("outbox", &self.outbox)
            .field("opts", &self.opts)
            .finish_non_exhaustive()
    }
}

impl<DB: SqlBackend, P: Publisher> OutboxRelay<DB, P> {
    /// A relay of `outbox` through `publisher` (`batch` of 0 is taken as 1).
    pub fn new(outbox: Outbox<DB>, publisher: P, mut opts: RelayOptions) -> Self {
        opts.batch = opts.batch.max(1);
        Self {
            outbox,
            publisher,
            opts,
        }
    }

    /// The settings.
    pub fn options(&self) -> &RelayOptions {
        &self.opts
    }

    /// The publisher.
    pub fn publisher(&self) -> &P {
        &self.publisher
    }

    /// Rounds of [`OutboxRelay::relay_once`] until one claims nothing (nothing due, or all
    /// due rows held back by their lane); the sum of the rounds.
    pub async fn drain(&self) -> Result<RelayReport, OutboxError> {
        let mut total = RelayReport::default();
        loop {
            let r = self.relay_once().await?;
            total.add(&r);
            if r.claimed == 0 {
                return Ok(total);
            }
        }
    }

    /// Relays until `shutdown` resolves: rounds back to back while rows are due, a
    /// [`RelayOptions::poll_interval`] sleep when none are, a doubling back-off after a
    /// database error (never skipping a row), and the retention purge once a minute. A
    /// round in progress is finished before returning. Returns an error only for a
    /// misconfiguration.
    pub async fn run(&self, shutdown: impl Future<Output = ()>) -> Result<(), OutboxError> {
        tokio::pin!(shutdown);
        let mut backoff =
            RetryPolicy::backoff(self.opts.error_backoff, Duration::from_secs(30)).waits();
        let mut next_purge = tokio::time::Instant::now();
        loop {
            let pause = match self.relay_once().await {
                Ok(r) if r.claimed > 0 => {
                    backoff.reset();
                    None
                }
                Ok(_) => {
                    backoff.reset();
                    Some(self.opts.poll_interval)
                }
                Err(OutboxError::Config(e)) => return Err(OutboxError::Config(e)),
                Err(e) => {
                    let b = backoff.next_delay();
                    tracing::warn!(table = %self.outbox.table, error = %e, backoff_ms = b.as_millis() as u64, "outbox relay: round failed; backing off");
                    Some(b)
                }
            };
            if let Some(age) = self.opts.retention {
                if tokio::time::Instant::now() >= next_purge {
                    next_purge = tokio::time::Instant::now() + Duration::from_secs(60);
                    if let Err(e) = self.outbox.purge_sent_older_than(age, 10_000).await {
                        tracing::warn!(table = %self.outbox.table, error = %e, "outbox relay: purge failed");
                    }
                }
            }
            let pause = pause.unwrap_or(Duration::ZERO);
            tokio::select! {
                biased;
                _ = &mut shutdown => return Ok(()),
                _ = tokio::time::sleep(pause) => {}
            }
        }
    }

    /// One round: claim up to [`RelayOptions::batch`] due rows, publish them, mark them.
    pub async fn relay_once(&self) -> Result<RelayReport, OutboxError> {
        let (token, rows, corrupt_rows) = self.claim().await?;
        let mut report = RelayReport {
            claimed: (rows.len() + corrupt_rows.len()) as u64,
            ..RelayReport::default()
        };
        for (id, reason) in corrupt_rows {
            tracing::error!(table = %self.outbox.table, id, reason = %reason, "outbox relay: malformed row marked failed");
            self.mark_failed(id, token, &format!("malformed row: {reason}"))
                .await?;
            report.failed += 1;
        }
        if rows.is_empty() {
            return Ok(report);
        }
        let waves = into_waves(rows);
        let mut stopped: HashSet<i64> = HashSet::new();
        let mut leftovers: Vec<i64> = Vec::new();
        for wave in waves {
            let (go, hold): (Vec<Claimed>, Vec<Claimed>) = wave
                .into_iter()
                .partition(|c| c.lane.is_none_or(|l| !stopped.contains(&l)));
            leftovers.extend(hold.iter().map(|c| c.id));
            if go.is_empty() {
                continue;
            }
            self.publish_wave(go, token, &mut stopped, &mut report)
                .await?;
        }
        if !leftovers.is_empty() {
            report.released += self.release_unattempted(&leftovers, token).await?;
        }
        tracing::debug!(table = %self.outbox.table, ?report, "outbox relay: round done");
        Ok(report)
    }

    async fn publish_wave(
        &self,
        go: Vec<Claimed>,
        token: i64,
        stopped: &mut HashSet<i64>,
        report: &mut RelayReport,
    ) -> Result<(), OutboxError> {
        let results = self
            .publisher
            .publish_batch(go.iter().map(|c| c.msg.clone()).collect())
            .await;
        let mut sent = Vec::new();
        for (i, c) in go.iter().enumerate() {
            let res = results.get(i).cloned().unwrap_or_else(|| {
                Err(PublishError::Ambiguous(
                    "publisher returned fewer results than messages".into(),
                ))
            });
            match res {
                Ok(_) => sent.push(c.id),
                Err(e) => {
                    if let Some(l) = c.lane {
                        stopped.insert(l);
                    }
                    let text = e.to_string();
                    let exhausted = self
                        .opts
                        .retry
                        .max_attempts
                        .is_some_and(|max| c.attempts >= max);
                    if e.is_retryable() && !exhausted {
                        let delay = self.opts.retry.delay(c.attempts);
                        tracing::warn!(table = %self.outbox.table, id = c.id, dedup_key = c.msg.dedup_key.as_deref().unwrap_or(""), attempts = c.attempts, delay_ms = delay.as_millis() as u64, error = %e, "outbox relay: publish failed; will retry");
                        self.mark_retry(c.id, token, delay, &text).await?;
                        report.retried += 1;
                    } else {
                        tracing::error!(table = %self.outbox.table, id = c.id, dedup_key = c.msg.dedup_key.as_deref().unwrap_or(""), attempts = c.attempts, error = %e, "outbox relay: publish failed for good; row marked failed");
                        self.mark_failed(c.id, token, &text).await?;
                        report.failed += 1;
                    }
                }
            }
        }
        if !sent.is_empty() {
            let marked = self.mark_sent(&sent, token).await?;
            report.sent += marked;
            let lost = sent.len() as u64 - marked.min(sent.len() as u64);
            if lost > 0 {
                report.lease_lost += lost;
                // Which rows lost their lease is not known: stop all of this wave's lanes,
                // their later rows are given back and follow the new owner's order.
                stopped.extend(go.iter().filter_map(|c| c.lane));
                tracing::warn!(table = %self.outbox.table, lost, "outbox relay: lease lost before marking sent; another relay republishes (same dedup key)");
            }
        }
        Ok(())
    }

    /// Claims due rows under a fresh lease token; malformed rows come back separately.
    #[allow(clippy::type_complexity)]
    async fn claim(&self) -> Result<(i64, Vec<Claimed>, Vec<(i64, String)>), OutboxError> {
        let d = DB::DIALECT;
        let err = |e| db_err::<DB>("claim", e);
        let token = rand::thread_rng().gen_range(1..i64::MAX);
        let now = now_ms();
        // A PooledTx, not a sqlx::Transaction: a relay_once cancelled between sending BEGIN
        // and reading its answer must not hand the pool a connection inside a transaction.
        let pool = &self.outbox.pool;
        let mut tx = match d {
            Dialect::Sqlite => PooledTx::begin_with(pool, "BEGIN IMMEDIATE").await,
            Dialect::Postgres | Dialect::MySql => PooledTx::begin(pool).await,
        }
        .map_err(err)?;
        let sql = if self.opts.failed_blocks_lane {
            &self.outbox.sql.claim_blocking_failed
        } else {
            &self.outbox.sql.claim_skipping_failed
        };
        let rows = DB::fetch(
            &mut tx,
            sql,
            vec![
                Val::I64(Some(now)),
                Val::I64(Some(now)),
                Val::I64(Some(limit_i64(self.opts.batch))),
            ],
            CLAIM_KINDS,
        )
        .await
        .map_err(err)?;
        let (claimed, corrupt_rows) = eligible(&rows);
        let mut ids: Vec<i64> = claimed.iter().map(|c| c.id).collect();
        ids.extend(corrupt_rows.iter().map(|(id, _)| *id));
        if ids.is_empty() {
            tx.rollback().await.map_err(err)?;
            return Ok((token, claimed, corrupt_rows));
        }
        let (set, set_args) = id_set(d, &ids);
        let mut args = vec![
            Val::I64(Some(now.saturating_add(duration_ms(self.opts.lease)))),
            Val::I64(Some(token)),
            Val::I64(Some(now)),
        ];
        args.extend(set_args);
        DB::execute(
            &mut tx,
            &d.placeholders(format!(
                "UPDATE {} SET lease_until_ms = ?, lease_token = ?, attempts = attempts + 1, \
                 updated_ms = ? WHERE {set}",
                self.outbox.table
            )),
            args,
        )
        .await
        .map_err(err)?;
        tx.commit().await.map_err(err)?;
        // The claim counted an attempt.
        let claimed = claimed
            .into_iter()
            .map(|mut c| {
                c.attempts = c.attempts.saturating_add(1);
                c
            })
            .collect();
        Ok((token, claimed, corrupt_rows))
    }

    async fn mark_sent(&self, ids: &[i64], token: i64) -> Result<u64, OutboxError> {
        let d = DB::DIALECT;
        let (set, set_args) = id_set(d, ids);
        let sql = d.placeholders(format!(
            "UPDATE {} SET status = 1, lease_until_ms = 0, lease_token = NULL, last_error = NULL, \
             updated_ms = ? WHERE lease_token = ? AND {set}",
            self.outbox.table
        ));
        self.exec_mark("mark_sent", &sql, || {
            let mut a = vec![Val::I64(Some(now_ms())), Val::I64(Some(token))];
            a.extend(set_args.iter().cloned());
            a
        })
        .await
    }

    async fn mark_retry(
        &self,
        id: i64,
        token: i64,
        delay: Duration,
        error: &str,
    ) -> Result<u64, OutboxError> {
        let error = bounded(error, MAX_ERROR_BYTES).to_owned();
        self.exec_mark("mark_retry", &self.outbox.sql.mark_retry, || {
            let now = now_ms();
            vec![
                Val::I64(Some(now.saturating_add(duration_ms(delay)))),
                Val::Text(Some(error.clone())),
                Val::I64(Some(now)),
                Val::I64(Some(id)),
                Val::I64(Some(token)),
            ]
        })
        .await
    }

    async fn mark_failed(&self, id: i64, token: i64, error: &str) -> Result<u64, OutboxError> {
        let error = bounded(error, MAX_ERROR_BYTES).to_owned();
        self.exec_mark("mark_failed", &self.outbox.sql.mark_failed, || {
            vec![
                Val::Text(Some(error.clone())),
                Val::I64(Some(now_ms())),
                Val::I64(Some(id)),
                Val::I64(Some(token)),
            ]
        })
        .await
    }

    /// Gives back rows claimed but not attempted (their claim's attempt is taken back).
    async fn release_unattempted(&self, ids: &[i64], token: i64) -> Result<u64, OutboxError> {
        let d = DB::DIALECT;
        let (set, set_args) = id_set(d, ids);
        let sql = d.placeholders(format!(
            "UPDATE {} SET lease_until_ms = 0, lease_token = NULL, attempts = attempts - 1 \
             WHERE lease_token = ? AND {set}",
            self.outbox.table
        ));
        self.exec_mark("release", &sql, || {
            let mut a = vec![Val::I64(Some(token))];
            a.extend(set_args.iter().cloned());
            a
        })
        .await
    }

    /// Runs an autocommit mark statement, retried at once after a deadlock (a lost mark
    /// means a republish later).
    async fn exec_mark(
        &self,
        op: &str,
        sql: &str,
        args: impl Fn() -> Vec<Val>,
    ) -> Result<u64, OutboxError> {
        let mut conn = self.outbox.acquire().await?;
        let mut attempt = 0;
        loop {
            match DB::execute(&mut conn, sql, args()).await {
                Ok(n) => return Ok(n),
                Err(e)
                    if attempt + 1 < MARK_ATTEMPTS
                        && error_class::<DB>(&e) == ErrorClass::RetryNow =>
                {
                    attempt += 1;
                    tokio::time::sleep(Duration::from_millis(2 << attempt)).await;
                }
                Err(e) => return Err(db_err::<DB>(op, e)),
            }
        }
    }
}

/// Picks the claimable rows of a claim's candidates (in id order): an unordered row always;
/// a laned row only when every unsent row ahead of it in its lane is one of ours and
/// claimable (`ahead` counts them all, whoever holds them). Malformed rows come back apart.
fn eligible(rows: &[Row]) -> (Vec<Claimed>, Vec<(i64, String)>) {
    let mut ours_in_lane: BTreeMap<i64, i64> = BTreeMap::new();
    let mut out = Vec::new();
    let mut bad = Vec::new();
    for r in rows {
        let Ok(id) = r.i64(0) else { continue };
        let lane = r.opt_i64(4).ok().flatten();
        if let Some(l) = lane {
            let ahead = r.opt_i64(14).ok().flatten().unwrap_or(i64::MAX);
            let ours = ours_in_lane.entry(l).or_insert(0);
            if ahead != *ours {
                continue;
            }
            *ours += 1;
        }
        match (decode_message(r), r.i64(9)) {
            (Ok(msg), Ok(attempts)) => out.push(Claimed {
                id,
                lane,
                attempts: u32::try_from(attempts.max(0)).unwrap_or(u32::MAX),
                msg,
            }),
            (Err(reason), _) | (_, Err(reason)) => bad.push((id, reason)),
        }
    }
    (out, bad)
}

/// Splits claimed rows into publish waves: wave `i` holds the `i`-th row of every lane;
/// unordered rows all go in the first wave. Within a wave no two rows share a lane.
fn into_waves(rows: Vec<Claimed>) -> Vec<Vec<Claimed>> {
    let mut depth: BTreeMap<i64, usize> = BTreeMap::new();
    let mut waves: Vec<Vec<Claimed>> = Vec::new();
    for c in rows {
        let i = match c.lane {
            None => 0,
            Some(l) => {
                let d = depth.entry(l).or_insert(0);
                *d += 1;
                *d - 1
            }
        };
        if waves.len() <= i {
            waves.resize_with(i + 1, Vec::new);
        }
        waves[i].push(c);
    }
    waves
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_with_order_repeats_and_binary_values() {
        let h = Headers::new()
            .with("a", "1")
            .with("a", "2")
            .with("bin", Bytes::from_static(&[0, 255, 10]))
            .with("", "");
        let enc = encode_headers(&h).unwrap();
        assert_eq!(decode_headers(&enc).unwrap(), h);
        assert_eq!(
            decode_headers(&encode_headers(&Headers::new()).unwrap()).unwrap(),
            Headers::new()
        );
        assert!(decode_headers(&enc[..enc.len() - 1]).is_err());
        assert!(decode_headers(&[2, 0, 0, 0, 0]).is_err());
        assert!(decode_headers(&[]).is_err());
    }

    #[test]
    fn generated_keys_look_like_uuids_and_differ() {
        let a = random_dedup_key();
        let b = random_dedup_key();
        assert_ne!(a, b);
        assert_eq!(a.len(), 36);
        assert_eq!(&a[14..15], "4");
        assert_eq!(a.matches('-').count(), 4);
    }

    #[test]
    fn lanes_are_stable_and_separate_destinations() {
        assert_eq!(lane_of("t", None), None);
        assert_eq!(lane_of("t", Some(b"k")), lane_of("t", Some(b"k")));
        assert_ne!(lane_of("t", Some(b"k")), lane_of("u", Some(b"k")));
        assert_ne!(lane_of("t", Some(b"k")), lane_of("tk", Some(b"")));
        // Pinned: the hash is stored, it must never change.
        assert_eq!(
            lane_of("", Some(b"")),
            Some(0xaf63_bd4c_8601_b7df_u64 as i64)
        );
    }

    fn row(id: i64, lane: Option<i64>, ahead: i64) -> Row {
        Row(vec![
            Val::I64(Some(id)),
            Val::Text(Some("d".into())),
            Val::Bytes(None),
            Val::Bytes(None),
            Val::I64(lane),
            Val::Bytes(Some(encode_headers(&Headers::new()).unwrap())),
            Val::Bytes(Some(b"p".to_vec())),
            Val::Text(Some(format!("k{id}"))),
            Val::I64(Some(0)),
            Val::I64(Some(0)),
            Val::I64(Some(0)),
            Val::I64(Some(0)),
            Val::I64(Some(0)),
            Val::Text(None),
            Val::I64(Some(ahead)),
        ])
    }

    #[test]
    fn a_lane_row_is_claimed_only_behind_its_own_claimed_rows() {
        // Lane 7: rows 1, 2 ours in order. Lane 8: row 3 has a foreign row ahead (held by
        // another relay), so row 5 behind it is held back too. Unordered row 4 always goes.
        let rows = vec![
            row(1, Some(7), 0),
            row(2, Some(7), 1),
            row(3, Some(8), 1),
            row(4, None, 0),
            row(5, Some(8), 2),
        ];
        let (ok, bad) = eligible(&rows);
        assert!(bad.is_empty());
        let ids: Vec<i64> = ok.iter().map(|c| c.id).collect();
        assert_eq!(ids, vec![1, 2, 4]);
        let waves = into_waves(ok);
        let w: Vec<Vec<i64>> = waves
            .iter()
            .map(|w| w.iter().map(|c| c.id).collect())
            .collect();
        assert_eq!(w, vec![vec![1, 4], vec![2]]);
    }

    #[test]
    fn long_table_names_are_refused_before_sql() {
        let t = TableName::new(&"o".repeat(MAX_OUTBOX_TABLE_LEN + 1)).unwrap();
        assert!(t.as_str().len() > MAX_OUTBOX_TABLE_LEN);
        assert!(bounded("héllo", 2) == "h");
    }
}
