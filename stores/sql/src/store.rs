//! The dedup-table store ([`SqlStore`]) and the unique-index helper, one implementation for
//! SQLite, PostgreSQL and MySQL/MariaDB.

use crate::backend::{error_class, map_sqlx_error, Dialect, ErrorClass, Kind, SqlBackend, Val};
use crate::ident::TableName;
use crate::migrate;
use crate::queries::{
    decode_record, ClaimRow, CompleteRow, FenceQueries, Queries, Stmt, StoredRecord, TakeoverRow,
    ACQUIRED_KINDS, FENCE_COMPLETION, READ_BACK_KINDS, RECORD_KINDS,
};
use async_trait::async_trait;
use bytes::Bytes;
use idemq_core::key::MAX_DEDUP_KEY_BYTES;
use idemq_core::store::{check_distinct_keys, duration_ms};
use idemq_core::{
    evaluate_claim, ClaimOutcome, ClaimRequest, ClaimVerdict, CompleteOutcome, Completion,
    DedupKey, DedupRecord, DedupStore, ExtendOutcome, FencingToken, Lease, RecordStatus,
    ReleaseOutcome, StoreError, StoreStats,
};
use sqlx::Pool;
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Set once any store of this process completed in a transaction through a fence table.
/// From then on the engine's completions keep the result of an in-transaction completion of
/// the same token (one fence-table lookup per completed row, ~20–40% of the completion
/// statement's server time on PostgreSQL); before, nothing can be there to keep. The
/// in-transaction completion is made by the lease holder, i.e. in the process whose engine
/// completes the key after it. (If it was made elsewhere, the engine's result is stored
/// instead; the fence itself never depends on this.)
static IN_TX_COMPLETIONS: AtomicBool = AtomicBool::new(false);

/// How many times a claim re-runs for keys whose row changed between the atomic write and
/// the read-back (another worker completed, released or deleted it in between).
const CLAIM_ROUNDS: usize = 8;
/// How many times a statement is retried at once after a deadlock or serialization failure.
const RETRY_NOW_ATTEMPTS: u32 = 8;

/// SQLite's `synchronous` setting for stores opened by [`SqlStore::connect`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SqliteSynchronous {
    /// Every commit is fsynced: a completed record survives power loss (the default).
    #[default]
    Full,
    /// In WAL mode, commits survive a crash of the process but the last ones may be lost
    /// on power loss; much faster on slow disks.
    Normal,
}

/// Options of a SQL store.
///
/// ```
/// use idemq_sql::{SqlStoreOptions, TableName};
/// let opts = SqlStoreOptions {
///     table: TableName::new("payments_dedup")?,
///     ..Default::default()
/// };
/// assert_eq!(opts.keys_table()?.as_str(), "payments_dedup_keys");
/// # Ok::<(), idemq_core::StoreError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SqlStoreOptions {
    /// The dedup table (default `idemq_dedup`).
    pub table: TableName,
    /// The unique-index table used by [`SqlStore::insert_key_in_tx`]
    /// (default `<table>_keys`).
    pub keys_table: Option<TableName>,
    /// Create / upgrade the tables when the store opens (default `true`). Turn off when
    /// the schema is managed elsewhere (`idemq store migrate`, your own tooling).
    pub migrate: bool,
    /// Pool size for [`SqlStore::connect`] (default 10; an in-memory SQLite database always
    /// uses one connection, since each connection would otherwise see its own database).
    pub max_connections: u32,
    /// How long to wait for a pooled connection before answering
    /// [`StoreError::Unavailable`] (default 10 s).
    pub acquire_timeout: Duration,
    /// SQLite only: how long a statement waits for another writer's lock (default 5 s).
    pub busy_timeout: Duration,
    /// PostgreSQL and MySQL: how long [`SqlStore::connect`]'s first connection may take
    /// before startup fails (default 5 s). A refused connection fails at once, naming the
    /// host and port, whatever this says.
    pub connect_timeout: Duration,
    /// SQLite only: durability of commits (default [`SqliteSynchronous::Full`]).
    pub sqlite_synchronous: SqliteSynchronous,
    /// The most keys written by one statement; larger batches are split (default 500).
    pub max_batch: usize,
    /// PostgreSQL and MySQL: the fence table of in-transaction completions and takeover
    /// tombstones (default `<table>_fence`; see [`SqlStore::complete_in_tx`]).
    pub fence_table: Option<TableName>,
    /// PostgreSQL and MySQL: connections of the heartbeat's own pool (default 2), used by
    /// [`DedupStore::extend`] / [`DedupStore::extend_batch`] only, so renewing leases never
    /// waits for a connection behind handler transactions holding the main pool. `0` shares
    /// the main pool. SQLite always shares it (a pool given to
    /// [`SqlStore::from_pool`] may be an in-memory database, of which every new connection
    /// would be a different, empty one; and SQLite's single writer makes a heartbeat wait
    /// for a handler's write transaction whatever pool it comes from).
    pub heartbeat_connections: u32,
}

impl Default for SqlStoreOptions {
    fn default() -> Self {
        Self {
            table: TableName::default(),
            keys_table: None,
            migrate: true,
            max_connections: 10,
            acquire_timeout: Duration::from_secs(10),
            busy_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
            sqlite_synchronous: SqliteSynchronous::Full,
            max_batch: 500,
            fence_table: None,
            heartbeat_connections: 2,
        }
    }
}

impl SqlStoreOptions {
    /// Default options for the dedup table `table`.
    pub fn with_table(table: TableName) -> Self {
        Self {
            table,
            ..Self::default()
        }
    }

    /// The unique-index table: [`SqlStoreOptions::keys_table`] or `<table>_keys`
    /// (an error when that would exceed the identifier limit: set it explicitly).
    pub fn keys_table(&self) -> Result<TableName, StoreError> {
        match &self.keys_table {
            Some(k) => Ok(k.clone()),
            None => self.table.with_suffix("_keys").map_err(|_| {
                StoreError::Config(format!(
                    "dedup table name `{}` is too long to derive the keys table `{}_keys`: \
                     set SqlStoreOptions::keys_table explicitly",
                    self.table, self.table
                ))
            }),
        }
    }
}

impl SqlStoreOptions {
    /// The fence table: [`SqlStoreOptions::fence_table`] or `<table>_fence` (an error when
    /// that would exceed the identifier limit: set it explicitly).
    pub fn fence_table(&self) -> Result<TableName, StoreError> {
        match &self.fence_table {
            Some(f) => Ok(f.clone()),
            None => self.table.with_suffix("_fence").map_err(|_| {
                StoreError::Config(format!(
                    "dedup table name `{}` is too long to derive the fence table `{}_fence`: \
                     set SqlStoreOptions::fence_table explicitly",
                    self.table, self.table
                ))
            }),
        }
    }
}

/// The answer of [`SqlStore::insert_key_in_tx`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyInsert {
    /// The key is new: go on with the business writes, then commit.
    Inserted,
    /// The key was inserted before (or by a concurrent transaction that committed): skip
    /// the business writes. The caller's transaction is still usable.
    Duplicate,
}

/// A dedup store on a SQL database: the dedup-table strategy (status row, lease, fencing
/// token, stored result, retention) behind [`DedupStore`], plus the unique-index strategy
/// ([`SqlStore::insert_key_in_tx`]) and in-transaction completion
/// ([`SqlStore::complete_in_tx`]).
///
/// Use the aliases [`SqliteStore`](crate::SqliteStore), [`PgStore`](crate::PgStore) and
/// [`MySqlStore`](crate::MySqlStore). Cloning is cheap (the pool is shared).
///
/// Every claim is one atomic statement per batch (`INSERT … ON CONFLICT … DO UPDATE … WHERE
/// … RETURNING` on SQLite/PostgreSQL, `INSERT … ON DUPLICATE KEY UPDATE` with guarded
/// assignments on MySQL): a key is written only if it is new, its lease has ended or its
/// retention has passed. Keys the statement did not take are read back and classified with
/// [`evaluate_claim`], the same rules as every other store.
pub struct SqlStore<DB: SqlBackend> {
    pool: Pool<DB>,
    /// The heartbeat's pool ([`SqlStoreOptions::heartbeat_connections`]); the main pool
    /// when shared.
    heartbeat_pool: Pool<DB>,
    q: Arc<Queries>,
    options: Arc<SqlStoreOptions>,
    keys_table: TableName,
    fence_table: TableName,
}

impl<DB: SqlBackend> Clone for SqlStore<DB> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            heartbeat_pool: self.heartbeat_pool.clone(),
            q: self.q.clone(),
            options: self.options.clone(),
            keys_table: self.keys_table.clone(),
            fence_table: self.fence_table.clone(),
        }
    }
}

impl<DB: SqlBackend> fmt::Debug for SqlStore<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqlStore")
            .field("backend", &DB::DIALECT.name())
            .field("table", &self.options.table.as_str())
            .field("keys_table", &self.keys_table.as_str())
            .finish_non_exhaustive()
    }
}

/// Rejects keys longer than the key columns hold.
fn check_key(key: &DedupKey) -> Result<(), StoreError> {
    let len = key.as_str().len();
    if len > MAX_DEDUP_KEY_BYTES {
        return Err(StoreError::KeyTooLong {
            len,
            max: MAX_DEDUP_KEY_BYTES,
        });
    }
    Ok(())
}

/// The longest worker id stored, in bytes (longer ones are cut at a character boundary).
pub const MAX_WORKER_BYTES: usize = 255;

fn bounded_worker(w: &str) -> &str {
    if w.len() <= MAX_WORKER_BYTES {
        return w;
    }
    let mut end = MAX_WORKER_BYTES;
    while !w.is_char_boundary(end) {
        end -= 1;
    }
    &w[..end]
}

/// Marks `Acquired` the requests whose row a claim statement returned with their token.
fn take_acquired(
    returned: &[crate::backend::Row],
    tokens: &HashMap<&str, (usize, FencingToken)>,
    out: &mut [Option<ClaimOutcome>],
) -> Result<(), StoreError> {
    for row in returned {
        let decoded = (|| -> Result<_, String> {
            Ok((
                row.text(0)?,
                row.i64(1)?,
                row.i64(2)?,
                row.i64(3)?,
                row.i64(4)?,
            ))
        })();
        let (key, token, until, attempts, took_over) =
            decoded.map_err(|reason| StoreError::Corrupt {
                key: "?".into(),
                reason,
            })?;
        if let Some(&(i, ours)) = tokens.get(key) {
            if ours.0 == token {
                out[i] = Some(ClaimOutcome::Acquired(Lease {
                    token: ours,
                    until_ms: until,
                    attempt: u32::try_from(attempts).unwrap_or(u32::MAX),
                    takeover: took_over != 0,
                }));
            }
        }
    }
    Ok(())
}

fn limit_i64(limit: usize) -> i64 {
    i64::try_from(limit).unwrap_or(i64::MAX)
}

async fn backoff(attempt: u32) {
    use rand::Rng;
    let cap_ms = 2u64.saturating_pow(attempt.min(8)).max(2);
    let ms = rand::thread_rng().gen_range(1..=cap_ms);
    tokio::time::sleep(Duration::from_millis(ms)).await;
}

/// Runs an autocommit statement, retrying at once (with jitter) after a deadlock or
/// serialization failure, which roll back only that statement.
/// Statement arguments that move into the first attempt; a retry (rare: a deadlock or a
/// serialization failure) rebuilds them.
fn first_then(first: Vec<Val>, rebuild: impl Fn() -> Vec<Val>) -> impl FnMut() -> Vec<Val> {
    let mut first = Some(first);
    move || first.take().unwrap_or_else(&rebuild)
}

macro_rules! retry_now {
    ($op:expr, $call:expr) => {{
        let mut attempt = 0u32;
        loop {
            match $call.await {
                Ok(v) => break Ok(v),
                Err(e)
                    if attempt < RETRY_NOW_ATTEMPTS
                        && error_class::<DB>(&e) == ErrorClass::RetryNow =>
                {
                    attempt += 1;
                    tracing::debug!(op = $op, attempt, error = %e, "retrying after deadlock/serialization failure");
                    backoff(attempt).await;
                }
                Err(e) => break Err(map_sqlx_error::<DB>($op, e)),
            }
        }
    }};
}

impl<DB: SqlBackend> SqlStore<DB> {
    /// Wraps an existing pool (your application's), running the migrations unless
    /// [`SqlStoreOptions::migrate`] is off.
    pub async fn from_pool(pool: Pool<DB>, options: SqlStoreOptions) -> Result<Self, StoreError> {
        let keys_table = options.keys_table()?;
        if keys_table == options.table {
            return Err(StoreError::Config(format!(
                "the keys table must differ from the dedup table (`{keys_table}`)"
            )));
        }
        let fence_table = options.fence_table()?;
        if fence_table == options.table || fence_table == keys_table {
            return Err(StoreError::Config(format!(
                "the fence table must differ from the dedup and keys tables (`{fence_table}`)"
            )));
        }
        let mariadb = if DB::DIALECT == Dialect::MySql {
            let mut conn = pool
                .acquire()
                .await
                .map_err(|e| map_sqlx_error::<DB>("acquire connection", e))?;
            let v = DB::fetch(&mut conn, "SELECT VERSION()", vec![], &[Kind::Text])
                .await
                .map_err(|e| map_sqlx_error::<DB>("server version", e))?;
            v.first()
                .and_then(|r| r.opt_text(0).ok().flatten())
                .is_some_and(|v| v.contains("MariaDB"))
        } else {
            false
        };
        let q = Arc::new(Queries::new(
            DB::DIALECT,
            mariadb,
            &options.table,
            &keys_table,
            // SQLite needs no fence table: see `complete_in_tx`.
            (DB::DIALECT != Dialect::Sqlite).then_some(&fence_table),
        ));
        let heartbeat_pool = if DB::DIALECT == Dialect::Sqlite || options.heartbeat_connections == 0
        {
            pool.clone()
        } else {
            // Same server and credentials as the main pool; connections open on first use.
            sqlx::pool::PoolOptions::<DB>::new()
                .max_connections(options.heartbeat_connections)
                .acquire_timeout(options.acquire_timeout)
                .connect_lazy_with((*pool.connect_options()).clone())
        };
        let store = Self {
            pool,
            heartbeat_pool,
            q,
            options: Arc::new(options),
            keys_table,
            fence_table,
        };
        if store.options.migrate {
            store.migrate().await?;
        }
        Ok(store)
    }

    /// The connection pool (share it with your business code for in-transaction helpers).
    pub fn pool(&self) -> &Pool<DB> {
        &self.pool
    }

    /// The options the store was opened with.
    pub fn options(&self) -> &SqlStoreOptions {
        &self.options
    }

    /// The dedup table.
    pub fn table(&self) -> &TableName {
        &self.options.table
    }

    /// The unique-index table of [`SqlStore::insert_key_in_tx`].
    pub fn keys_table(&self) -> &TableName {
        &self.keys_table
    }

    /// The fence table of in-transaction completions (PostgreSQL, MySQL; SQLite has none).
    pub fn fence_table(&self) -> Option<&TableName> {
        self.q.fence.as_ref().map(|_| &self.fence_table)
    }

    /// Every table the store keeps its records in (the dedup table, the keys table, the
    /// fence table where there is one), e.g. to drop a store made for one test or benchmark.
    pub fn tables(&self) -> Vec<&TableName> {
        let mut all = vec![self.table(), self.keys_table()];
        all.extend(self.fence_table());
        all
    }

    /// The heartbeat's pool ([`SqlStoreOptions::heartbeat_connections`]; the main pool when
    /// shared).
    pub fn heartbeat_pool(&self) -> &Pool<DB> {
        &self.heartbeat_pool
    }

    /// The SQL dialect.
    pub fn dialect(&self) -> Dialect {
        DB::DIALECT
    }

    /// Creates or upgrades the tables; returns the schema version now applied. Safe to run
    /// concurrently from many processes.
    pub async fn migrate(&self) -> Result<i64, StoreError> {
        migrate::run::<DB>(
            &self.pool,
            &self.options.table,
            &self.keys_table,
            &self.fence_table,
        )
        .await
    }

    /// The schema version recorded for this store's table, `None` before any migration.
    pub async fn schema_version(&self) -> Result<Option<i64>, StoreError> {
        let mut conn = self.acquire().await?;
        let sql = DB::DIALECT.placeholders(format!(
            "SELECT version FROM {} WHERE dedup_table = ?",
            migrate::SCHEMA_VERSION_TABLE
        ));
        let rows = DB::fetch(
            &mut conn,
            &sql,
            vec![Val::Text(Some(self.options.table.as_str().to_owned()))],
            &[Kind::I64],
        )
        .await
        .map_err(|e| map_sqlx_error::<DB>("schema_version", e))?;
        Ok(rows.first().and_then(|r| r.opt_i64(0).ok().flatten()))
    }

    pub(crate) async fn acquire(&self) -> Result<sqlx::pool::PoolConnection<DB>, StoreError> {
        self.pool
            .acquire()
            .await
            .map_err(|e| map_sqlx_error::<DB>("acquire connection", e))
    }

    /// Completes `key` inside the caller's transaction, fenced by `token`, so the business
    /// effect and the completion commit (or roll back) together.
    ///
    /// Answers [`CompleteOutcome::Fenced`] when `token` no longer owns the key (its lease
    /// was taken over, it was released or purged): roll the transaction back. Completing
    /// twice with the owning token answers `Completed`.
    ///
    /// On PostgreSQL and MySQL the completion does not touch the dedup row, which the
    /// engine's heartbeat keeps rewriting: it is *inserted* into the fence table under
    /// `(key, token)`, so the business transaction may run at any isolation level
    /// (REPEATABLE READ, SERIALIZABLE, MariaDB's snapshot isolation) and for longer than a
    /// heartbeat. A takeover of the key tombstones the old token first, waiting for this
    /// transaction: if it commits, the takeover answers `Duplicate` instead; once the
    /// tombstone is in, this call answers `Fenced` (or, at snapshot isolation, fails with a
    /// retryable serialization error, after which it answers `Fenced`). The engine's
    /// completion after the commit, [`DedupStore::get`] and the next claim fold it into the
    /// dedup row. On SQLite the completion updates the dedup row (SQLite has one writer and
    /// snapshots the whole database: a fence table would not help; see docs/stores-sql.md).
    pub async fn complete_in_tx(
        &self,
        conn: &mut DB::Connection,
        key: &DedupKey,
        token: FencingToken,
        result: Option<&[u8]>,
        retention: Duration,
    ) -> Result<CompleteOutcome, StoreError> {
        check_key(key)?;
        let done = match &self.q.fence {
            None => self.complete_one(conn, key, token, result, retention).await,
            Some(fq) => {
                self.complete_fenced(conn, fq, key, token, result, retention)
                    .await
            }
        };
        done.map_err(|e| map_sqlx_error::<DB>("complete_in_tx", e))
    }

    /// Completes many claimed keys inside the caller's transaction, one statement per
    /// chunk of keys (sorted, so concurrent transactions lock them in one order); the
    /// answer is in order. Unlike [`SqlStore::complete_in_tx`] it updates the dedup rows
    /// themselves, so the transaction should run at READ COMMITTED (the default) and be
    /// short: it holds those rows' locks (and the heartbeat's renewal of them waits) until
    /// it ends. A takeover waits for it too, then finds the keys completed. The batch
    /// handler of [`SqlStore::batch_handler`](crate::SqlStore::batch_handler) uses it.
    pub async fn complete_batch_in_tx(
        &self,
        conn: &mut DB::Connection,
        items: &[Completion],
    ) -> Result<Vec<CompleteOutcome>, StoreError> {
        for c in items {
            check_key(&c.key)?;
        }
        let mut out: Vec<Option<CompleteOutcome>> = vec![None; items.len()];
        for chunk in self.sorted_chunks(items.iter().map(|c| &c.key)) {
            self.complete_chunk(conn, items, &chunk, &mut out).await?;
        }
        out.into_iter()
            .map(|o| {
                o.ok_or_else(|| StoreError::Backend("completion left a key unanswered".into()))
            })
            .collect()
    }

    /// [`SqlStore::complete_in_tx`] with a fence table.
    async fn complete_fenced(
        &self,
        conn: &mut DB::Connection,
        fq: &FenceQueries,
        key: &DedupKey,
        token: FencingToken,
        result: Option<&[u8]>,
        retention: Duration,
    ) -> Result<CompleteOutcome, sqlx::Error> {
        // A plain read: at snapshot isolation it sees the row as of the snapshot, which is
        // enough — a takeover since then has tombstoned the token (checked by the insert).
        let row = DB::fetch(
            conn,
            &fq.own_row,
            vec![Val::Key(key.as_str().to_owned())],
            &[Kind::I64, Kind::I64, Kind::I64],
        )
        .await?;
        let Some(row) = row.first() else {
            return Ok(CompleteOutcome::Fenced);
        };
        let (Ok(owner), Ok(status), Ok(until)) = (row.i64(0), row.i64(1), row.i64(2)) else {
            return Ok(CompleteOutcome::Fenced);
        };
        if owner != token.0 {
            return Ok(CompleteOutcome::Fenced);
        }
        if status == RecordStatus::Completed.code() {
            return Ok(CompleteOutcome::Completed);
        }
        if until <= 0 {
            // Released.
            return Ok(CompleteOutcome::Fenced);
        }
        IN_TX_COMPLETIONS.store(true, Ordering::Relaxed);
        let inserted = DB::execute(
            conn,
            &fq.complete,
            vec![
                Val::Key(key.as_str().to_owned()),
                Val::I64(Some(token.0)),
                Val::Bytes(result.map(<[u8]>::to_vec)),
                Val::I64(Some(duration_ms(retention))),
            ],
        )
        .await?;
        if inserted > 0 {
            return Ok(CompleteOutcome::Completed);
        }
        // The pair exists: our own completion (idempotent) or a takeover's tombstone. A row
        // this transaction cannot see (MySQL at snapshot isolation) answers `Fenced`.
        let kind = DB::fetch(
            conn,
            &fq.kind,
            vec![Val::Key(key.as_str().to_owned()), Val::I64(Some(token.0))],
            &[Kind::I64],
        )
        .await?;
        Ok(
            if kind.first().and_then(|r| r.i64(0).ok()) == Some(FENCE_COMPLETION) {
                CompleteOutcome::Completed
            } else {
                CompleteOutcome::Fenced
            },
        )
    }

    async fn complete_one(
        &self,
        conn: &mut DB::Connection,
        key: &DedupKey,
        token: FencingToken,
        result: Option<&[u8]>,
        retention: Duration,
    ) -> Result<CompleteOutcome, sqlx::Error> {
        let args = vec![
            Val::Bytes(result.map(<[u8]>::to_vec)),
            Val::I64(Some(duration_ms(retention))),
            Val::Key(key.as_str().to_owned()),
            Val::I64(Some(token.0)),
        ];
        let sql = if self.fold_completions() {
            &self.q.complete_one_fold
        } else {
            &self.q.complete_one
        };
        if DB::execute(conn, sql, args).await? > 0 {
            return Ok(CompleteOutcome::Completed);
        }
        // Not in progress under this token: already completed by it (idempotent), or fenced.
        let rows = DB::fetch(
            conn,
            &self.q.probe,
            vec![Val::Key(key.as_str().to_owned())],
            &[Kind::I64, Kind::I64],
        )
        .await?;
        let owned_and_done = rows.first().is_some_and(|r| {
            r.i64(0).ok() == Some(token.0) && r.i64(1).ok() == Some(RecordStatus::Completed.code())
        });
        Ok(if owned_and_done {
            CompleteOutcome::Completed
        } else {
            CompleteOutcome::Fenced
        })
    }

    /// The unique-index strategy: inserts `key` into the keys table inside the caller's
    /// transaction. [`KeyInsert::Duplicate`] means it was processed (committed) before; the
    /// statement never raises on a duplicate, so the transaction stays usable (PostgreSQL
    /// would otherwise abort it). If another open transaction holds the same key, this waits
    /// for it to commit or roll back.
    ///
    /// Keys stay until [`SqlStore::purge_keys_older_than`] removes them.
    pub async fn insert_key_in_tx(
        &self,
        conn: &mut DB::Connection,
        key: &DedupKey,
    ) -> Result<KeyInsert, StoreError> {
        check_key(key)?;
        let n = DB::execute(
            conn,
            &self.q.insert_key,
            vec![Val::Key(key.as_str().to_owned())],
        )
        .await
        .map_err(|e| map_sqlx_error::<DB>("insert_key_in_tx", e))?;
        Ok(if n > 0 {
            KeyInsert::Inserted
        } else {
            KeyInsert::Duplicate
        })
    }

    /// Deletes up to `limit` unique-index keys inserted more than `age` ago; returns how
    /// many. A redelivery of a purged key is processed again: keep `age` above the longest
    /// redelivery horizon of your brokers.
    pub async fn purge_keys_older_than(
        &self,
        age: Duration,
        limit: usize,
    ) -> Result<u64, StoreError> {
        if limit == 0 {
            return Ok(0);
        }
        let mut conn = self.acquire().await?;
        retry_now!(
            "purge_keys",
            DB::execute(
                &mut conn,
                &self.q.purge_keys,
                vec![
                    Val::I64(Some(duration_ms(age))),
                    Val::I64(Some(limit_i64(limit))),
                ],
            )
        )
    }

    /// Claims the keys `idx` (indices into `reqs`, sorted by key) with one statement per
    /// round, filling `out`.
    async fn claim_chunk(
        &self,
        conn: &mut DB::Connection,
        reqs: &[ClaimRequest],
        idx: &[usize],
        out: &mut [Option<ClaimOutcome>],
    ) -> Result<(), StoreError> {
        let mut pending: Vec<usize> = idx.to_vec();
        let mut fresh_first = self.q.mariadb;
        for round in 0..CLAIM_ROUNDS {
            let rows: Vec<ClaimRow<'_>> = pending
                .iter()
                .map(|&i| {
                    let r = &reqs[i];
                    ClaimRow {
                        key: &r.key,
                        token: r.token.unwrap_or_else(FencingToken::random),
                        lease_ms: duration_ms(r.lease),
                        payload_hash: r.payload_hash.as_ref(),
                        worker: r.worker.as_deref().map(bounded_worker),
                    }
                })
                .collect();
            let tokens: HashMap<&str, (usize, FencingToken)> = pending
                .iter()
                .zip(&rows)
                .map(|(&i, row)| (reqs[i].key.as_str(), (i, row.token)))
                .collect();
            if fresh_first {
                // MariaDB: new keys via `INSERT IGNORE … RETURNING`, no read-back; the keys
                // that exist already take the general path below, with fresh tokens.
                fresh_first = false;
                let Stmt { sql, args } = self.q.claim_fresh_mariadb(&rows);
                let mut args = first_then(args, || self.q.claim_fresh_mariadb(&rows).args);
                let returned = retry_now!("claim", DB::fetch(conn, &sql, args(), ACQUIRED_KINDS))?;
                take_acquired(&returned, &tokens, out)?;
                pending.retain(|&i| out[i].is_none());
                if pending.is_empty() {
                    return Ok(());
                }
                continue;
            }
            let Stmt { sql, args } = self.q.claim(&rows);
            let mut args = first_then(args, || self.q.claim(&rows).args);
            if self.q.claim_returns_rows() {
                let returned = retry_now!("claim", DB::fetch(conn, &sql, args(), ACQUIRED_KINDS))?;
                take_acquired(&returned, &tokens, out)?;
            } else {
                retry_now!("claim", DB::execute(conn, &sql, args()))?;
            }

            let rest: Vec<usize> = pending
                .iter()
                .copied()
                .filter(|&i| out[i].is_none())
                .collect();
            if rest.is_empty() {
                return Ok(());
            }
            let Stmt { sql, args } = self.q.read_back(rest.iter().map(|&i| &reqs[i].key));
            let mut args = first_then(args, || {
                self.q.read_back(rest.iter().map(|&i| &reqs[i].key)).args
            });
            let rows = retry_now!(
                "claim read-back",
                DB::fetch(conn, &sql, args(), READ_BACK_KINDS)
            )?;
            drop(args);
            // The rows come with the database's clock: the records are judged by
            // `evaluate_claim` at the store's time, like the statement that skipped them.
            let mut now = None;
            let mut found: HashMap<String, StoredRecord> = HashMap::with_capacity(rows.len());
            for row in &rows {
                let s = decode_record(row)?;
                now = Some(
                    row.i64(RECORD_KINDS.len())
                        .map_err(|reason| StoreError::Corrupt {
                            key: s.rec.key.as_str().to_owned(),
                            reason,
                        })?,
                );
                found.insert(s.rec.key.as_str().to_owned(), s);
            }
            // No row at all: every key was deleted in between, and a missing record is
            // claimed afresh whatever the time.
            let now = now.unwrap_or(0);
            let mut retry = Vec::new();
            let mut takeovers = Vec::new();
            for i in rest {
                let req = &reqs[i];
                let ours = tokens.get(req.key.as_str()).map(|t| t.1);
                let stored = found.get(req.key.as_str());
                match stored {
                    Some(s)
                        if Some(s.rec.token) == ours
                            && s.rec.status == RecordStatus::InProgress =>
                    {
                        out[i] = Some(ClaimOutcome::Acquired(Lease {
                            token: s.rec.token,
                            until_ms: s.rec.lease_until_ms,
                            attempt: s.rec.attempts,
                            takeover: s.took_over,
                        }));
                    }
                    _ => {
                        match evaluate_claim(stored.map(|s| &s.rec), req.payload_hash.as_ref(), now)
                        {
                            ClaimVerdict::Answer(o) => out[i] = Some(o),
                            // With a fence table the claim statement leaves ended leases
                            // alone: the takeover fences the old token first.
                            ClaimVerdict::TakeOver if self.q.fence.is_some() => takeovers.push(i),
                            // The row changed between the write and the read: claim again.
                            ClaimVerdict::AcquireFresh | ClaimVerdict::TakeOver => retry.push(i),
                        }
                    }
                }
            }
            if let (Some(fq), false) = (&self.q.fence, takeovers.is_empty()) {
                self.take_over(conn, fq, reqs, &found, &takeovers, &tokens, out, &mut retry)
                    .await?;
            }
            if retry.is_empty() {
                return Ok(());
            }
            tracing::debug!(
                table = %self.options.table,
                round,
                keys = retry.len(),
                "claim raced with concurrent changes; claiming again"
            );
            pending = retry;
        }
        tracing::warn!(
            table = %self.options.table,
            keys = pending.len(),
            "claim kept racing with concurrent changes"
        );
        Err(StoreError::Unavailable(format!(
            "{} claim: {} key(s) changed concurrently {CLAIM_ROUNDS} times in a row; retry later",
            DB::DIALECT.name(),
            pending.len()
        )))
    }

    /// Takes over the ended leases `idx` (indices into `reqs`, in key order; `found` holds
    /// the records the read-back saw): tombstones each old token in the fence table — which
    /// waits for an open transaction's completion of it —, folds the keys whose old token
    /// completed in a transaction after all (pushed to `retry`: the next read-back answers
    /// `Duplicate`), and rewrites the others to the new token while they still hold what
    /// the read-back saw. Keys that changed meanwhile are pushed to `retry`.
    #[allow(clippy::too_many_arguments)]
    async fn take_over(
        &self,
        conn: &mut DB::Connection,
        fq: &FenceQueries,
        reqs: &[ClaimRequest],
        found: &HashMap<String, StoredRecord>,
        idx: &[usize],
        tokens: &HashMap<&str, (usize, FencingToken)>,
        out: &mut [Option<ClaimOutcome>],
        retry: &mut Vec<usize>,
    ) -> Result<(), StoreError> {
        let mut seen = Vec::with_capacity(idx.len());
        for &i in idx {
            match found.get(reqs[i].key.as_str()) {
                Some(s) => seen.push((i, s)),
                None => retry.push(i),
            }
        }
        let pairs: Vec<(&DedupKey, i64)> = seen
            .iter()
            .map(|(i, s)| (&reqs[*i].key, s.rec.token.0))
            .collect();
        if pairs.is_empty() {
            return Ok(());
        }
        let Stmt { sql, args } = self.q.tombstones(&fq.table, &pairs);
        let mut args = first_then(args, || self.q.tombstones(&fq.table, &pairs).args);
        retry_now!("claim tombstones", DB::execute(conn, &sql, args()))?;
        drop(args);
        let Stmt { sql, args } = self.q.fence_rows(&fq.table, pairs.iter().map(|p| p.0));
        let mut args = first_then(args, || {
            self.q.fence_rows(&fq.table, pairs.iter().map(|p| p.0)).args
        });
        let rows = retry_now!(
            "claim fence read",
            DB::fetch(conn, &sql, args(), &[Kind::Text, Kind::I64, Kind::I64])
        )?;
        drop(args);
        let mut completed: HashSet<(&str, i64)> = HashSet::new();
        for r in &rows {
            if let (Ok(k), Ok(t), Ok(FENCE_COMPLETION)) = (r.text(0), r.i64(1), r.i64(2)) {
                if let Some((key, tok)) = pairs.iter().find(|p| p.0.as_str() == k && p.1 == t) {
                    completed.insert((key.as_str(), *tok));
                }
            }
        }
        let (done, take): (Vec<_>, Vec<_>) = seen
            .into_iter()
            .partition(|(i, s)| completed.contains(&(reqs[*i].key.as_str(), s.rec.token.0)));
        if !done.is_empty() {
            // The old token's transaction committed its completion: fold it into the row.
            let Stmt { sql, args } = self
                .q
                .fold(&fq.table, done.iter().map(|(i, _)| &reqs[*i].key));
            let mut args = first_then(args, || {
                self.q
                    .fold(&fq.table, done.iter().map(|(i, _)| &reqs[*i].key))
                    .args
            });
            retry_now!("claim fold", DB::execute(conn, &sql, args()))?;
            retry.extend(done.iter().map(|(i, _)| *i));
        }
        if take.is_empty() {
            return Ok(());
        }
        let rows: Vec<TakeoverRow<'_>> = take
            .iter()
            .map(|&(i, s)| {
                let r = &reqs[i];
                TakeoverRow {
                    key: &r.key,
                    old_token: s.rec.token.0,
                    old_until: s.rec.lease_until_ms,
                    attempts: i64::from(s.rec.attempts).saturating_add(1),
                    took_over: s.rec.lease_until_ms > 0,
                    token: tokens
                        .get(r.key.as_str())
                        .map_or_else(FencingToken::random, |t| t.1),
                    lease_ms: duration_ms(r.lease),
                    payload_hash: r.payload_hash.as_ref(),
                    worker: r.worker.as_deref().map(bounded_worker),
                }
            })
            .collect();
        let Stmt { sql, args } = self.q.takeover(&rows);
        let mut args = first_then(args, || self.q.takeover(&rows).args);
        if self.q.dialect == Dialect::MySql {
            retry_now!("claim takeover", DB::execute(conn, &sql, args()))?;
            drop(args);
            // No `UPDATE … RETURNING`: read the rows back by token.
            let Stmt { sql, args } = self.q.read_back(rows.iter().map(|r| r.key));
            let mut args = first_then(args, || self.q.read_back(rows.iter().map(|r| r.key)).args);
            let back = retry_now!(
                "claim takeover read-back",
                DB::fetch(conn, &sql, args(), READ_BACK_KINDS)
            )?;
            for row in &back {
                let s = decode_record(row)?;
                if let Some(&(i, ours)) = tokens.get(s.rec.key.as_str()) {
                    if s.rec.token == ours && s.rec.status == RecordStatus::InProgress {
                        out[i] = Some(ClaimOutcome::Acquired(Lease {
                            token: ours,
                            until_ms: s.rec.lease_until_ms,
                            attempt: s.rec.attempts,
                            takeover: s.took_over,
                        }));
                    }
                }
            }
        } else {
            let returned = retry_now!(
                "claim takeover",
                DB::fetch(conn, &sql, args(), ACQUIRED_KINDS)
            )?;
            take_acquired(&returned, tokens, out)?;
        }
        retry.extend(take.iter().map(|(i, _)| *i).filter(|&i| out[i].is_none()));
        Ok(())
    }

    /// Whether completions must keep the result of an in-transaction completion.
    fn fold_completions(&self) -> bool {
        self.q.fence.is_some() && IN_TX_COMPLETIONS.load(Ordering::Relaxed)
    }

    /// Folds the in-transaction completion of `key` (if any) into its dedup row.
    async fn fold_one(&self, conn: &mut DB::Connection, key: &DedupKey) -> Result<(), StoreError> {
        if let Some(fq) = &self.q.fence {
            let keys = [key.clone()];
            let Stmt { sql, args } = self.q.fold(&fq.table, keys.iter());
            let mut args = first_then(args, || self.q.fold(&fq.table, keys.iter()).args);
            retry_now!("fold", DB::execute(conn, &sql, args()))?;
        }
        Ok(())
    }

    async fn complete_chunk(
        &self,
        conn: &mut DB::Connection,
        items: &[Completion],
        idx: &[usize],
        out: &mut [Option<CompleteOutcome>],
    ) -> Result<(), StoreError> {
        let rows: Vec<CompleteRow<'_>> = idx
            .iter()
            .map(|&i| {
                let c = &items[i];
                CompleteRow {
                    key: &c.key,
                    token: c.token,
                    result: c.result.as_deref(),
                    retention_ms: duration_ms(c.retention),
                }
            })
            .collect();
        let fold = self.fold_completions();
        let Stmt { sql, args } = self.q.complete_batch(&rows, fold);
        let mut args = first_then(args, || self.q.complete_batch(&rows, fold).args);
        if self.q.complete_returns_rows() {
            let done = retry_now!(
                "complete_batch",
                DB::fetch(conn, &sql, args(), &[Kind::Text, Kind::I64])
            )?;
            let mut set = HashSet::with_capacity(done.len());
            for r in &done {
                if let (Ok(k), Ok(t)) = (r.text(0), r.i64(1)) {
                    set.insert((k.to_owned(), t));
                }
            }
            for &i in idx {
                let c = &items[i];
                if set.contains(&(c.key.as_str().to_owned(), c.token.0)) {
                    out[i] = Some(CompleteOutcome::Completed);
                }
            }
        } else {
            let matched = retry_now!("complete_batch", DB::execute(conn, &sql, args()))?;
            // Keys are distinct here, so every item matched iff the count says so.
            if matched == idx.len() as u64 {
                for &i in idx {
                    out[i] = Some(CompleteOutcome::Completed);
                }
            }
        }
        let undecided: Vec<usize> = idx.iter().copied().filter(|&i| out[i].is_none()).collect();
        if undecided.is_empty() {
            return Ok(());
        }
        // Not completed by this statement: completed before by the same token, or fenced.
        let Stmt { sql, args } = self.q.probe_many(undecided.iter().map(|&i| &items[i].key));
        let mut args = first_then(args, || {
            self.q
                .probe_many(undecided.iter().map(|&i| &items[i].key))
                .args
        });
        let rows = retry_now!(
            "complete_batch probe",
            DB::fetch(conn, &sql, args(), &[Kind::Text, Kind::I64, Kind::I64])
        )?;
        drop(args);
        let mut state: HashMap<String, (i64, i64)> = HashMap::with_capacity(rows.len());
        for r in &rows {
            if let (Ok(k), Ok(t), Ok(s)) = (r.text(0), r.i64(1), r.i64(2)) {
                state.insert(k.to_owned(), (t, s));
            }
        }
        for i in undecided {
            let c = &items[i];
            out[i] = Some(
                if state.get(c.key.as_str()) == Some(&(c.token.0, RecordStatus::Completed.code())) {
                    CompleteOutcome::Completed
                } else {
                    CompleteOutcome::Fenced
                },
            );
        }
        Ok(())
    }

    fn sorted_chunks<'a>(&self, keys: impl Iterator<Item = &'a DedupKey>) -> Vec<Vec<usize>> {
        let mut order: Vec<(usize, &str)> = keys.map(|k| k.as_str()).enumerate().collect();
        // Byte order: every backend locks in the order rows are written, so concurrent
        // batches over overlapping keys acquire their row locks in the same order.
        order.sort_by(|a, b| a.1.as_bytes().cmp(b.1.as_bytes()));
        order
            .chunks(self.options.max_batch.max(1))
            .map(|c| c.iter().map(|(i, _)| *i).collect())
            .collect()
    }
}

/// The store operations themselves; [`DedupStore`] runs each on its own task ([`detached`]).
impl<DB: SqlBackend> SqlStore<DB> {
    async fn claim_batch_here(
        &self,
        reqs: &[ClaimRequest],
    ) -> Result<Vec<ClaimOutcome>, StoreError> {
        check_distinct_keys(reqs)?;
        for r in reqs {
            check_key(&r.key)?;
        }
        if reqs.is_empty() {
            return Ok(Vec::new());
        }
        let mut out: Vec<Option<ClaimOutcome>> = vec![None; reqs.len()];
        let mut conn = self.acquire().await?;
        for chunk in self.sorted_chunks(reqs.iter().map(|r| &r.key)) {
            if let Err(e) = self.claim_chunk(&mut conn, reqs, &chunk, &mut out).await {
                // The caller gets an error and never learns the tokens: give back what this
                // call acquired, or those keys wait a whole lease for a spurious takeover.
                drop(conn);
                for (r, o) in reqs.iter().zip(&out) {
                    if let Some(ClaimOutcome::Acquired(l)) = o {
                        if let Err(re) = self.release(&r.key, l.token).await {
                            tracing::warn!(key = %r.key, error = %re, "could not release a claim of a failed batch");
                        }
                    }
                }
                return Err(e);
            }
        }
        out.into_iter()
            .map(|o| o.ok_or_else(|| StoreError::Backend("claim left a key unanswered".into())))
            .collect()
    }

    async fn complete_batch_here(
        &self,
        items: &[Completion],
    ) -> Result<Vec<CompleteOutcome>, StoreError> {
        for c in items {
            check_key(&c.key)?;
        }
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let mut conn = self.acquire().await?;
        let distinct: HashSet<&str> = items.iter().map(|c| c.key.as_str()).collect();
        if distinct.len() < items.len() {
            // A key named twice (e.g. a stale and a current token): answer item by item, in
            // order, exactly as single completions would.
            let mut out = Vec::with_capacity(items.len());
            for c in items {
                out.push(retry_now!(
                    "complete",
                    self.complete_one(&mut conn, &c.key, c.token, c.result.as_deref(), c.retention)
                )?);
            }
            return Ok(out);
        }
        let mut out: Vec<Option<CompleteOutcome>> = vec![None; items.len()];
        for chunk in self.sorted_chunks(items.iter().map(|c| &c.key)) {
            self.complete_chunk(&mut conn, items, &chunk, &mut out)
                .await?;
        }
        out.into_iter()
            .map(|o| {
                o.ok_or_else(|| StoreError::Backend("completion left a key unanswered".into()))
            })
            .collect()
    }

    async fn complete_here(
        &self,
        key: &DedupKey,
        token: FencingToken,
        result: Option<Bytes>,
        retention: Duration,
    ) -> Result<CompleteOutcome, StoreError> {
        check_key(key)?;
        let mut conn = self.acquire().await?;
        retry_now!(
            "complete",
            self.complete_one(&mut conn, key, token, result.as_deref(), retention)
        )
    }

    async fn release_here(
        &self,
        key: &DedupKey,
        token: FencingToken,
    ) -> Result<ReleaseOutcome, StoreError> {
        check_key(key)?;
        let mut conn = self.acquire().await?;
        let n = retry_now!(
            "release",
            DB::execute(
                &mut conn,
                &self.q.release,
                vec![Val::Key(key.as_str().to_owned()), Val::I64(Some(token.0))],
            )
        )?;
        Ok(if n > 0 {
            ReleaseOutcome::Released
        } else {
            ReleaseOutcome::Fenced
        })
    }

    async fn extend_here(
        &self,
        key: &DedupKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<ExtendOutcome, StoreError> {
        // The batch statement with one lease: one code path for a heartbeat of any size.
        self.extend_batch_here(&[(key.clone(), token)], lease)
            .await?
            .pop()
            .ok_or_else(|| StoreError::Backend("extend: no answer".into()))
    }

    /// One statement per chunk of leases (the heartbeat's call): PostgreSQL joins the keys
    /// and tokens as arrays, SQLite and MySQL match `(dedup_key, token)` row values. MySQL,
    /// without `UPDATE … RETURNING`, binds the end read from its clock and reads back which
    /// rows carry it.
    async fn extend_batch_here(
        &self,
        leases: &[(DedupKey, FencingToken)],
        lease: Duration,
    ) -> Result<Vec<ExtendOutcome>, StoreError> {
        for (key, _) in leases {
            check_key(key)?;
        }
        let lease_ms = duration_ms(lease);
        let mut conn = self
            .heartbeat_pool
            .acquire()
            .await
            .map_err(|e| map_sqlx_error::<DB>("acquire heartbeat connection", e))?;
        let t = &self.q.table;
        let mut extended: HashMap<String, i64> = HashMap::with_capacity(leases.len());
        // Chunks keep every statement far below SQLite's and MySQL's parameter limits.
        for chunk in leases.chunks(EXTEND_CHUNK) {
            match self.q.dialect {
                Dialect::Postgres => {
                    let sql = format!(
                        "UPDATE {t} SET lease_until_ms = {now} + $1 \
                         FROM UNNEST($2::text[], $3::bigint[]) AS v(k, tok) \
                         WHERE {t}.dedup_key = v.k AND {t}.token = v.tok AND {t}.status = 0 \
                         AND {t}.lease_until_ms > 0 RETURNING {t}.dedup_key, {t}.lease_until_ms",
                        now = self.q.dialect.now_ms_sql()
                    );
                    let args = vec![
                        Val::I64(Some(lease_ms)),
                        Val::TextArray(
                            chunk
                                .iter()
                                .map(|(k, _)| Some(k.as_str().to_owned()))
                                .collect(),
                        ),
                        Val::I64Array(chunk.iter().map(|(_, tok)| tok.0).collect()),
                    ];
                    let rows = retry_now!(
                        "extend_batch",
                        DB::fetch(&mut conn, &sql, args.clone(), &[Kind::Text, Kind::I64])
                    )?;
                    collect_extended(&rows, &mut extended)?;
                }
                Dialect::Sqlite => {
                    let pairs = vec!["(?, ?)"; chunk.len()].join(", ");
                    let sql = format!(
                        "UPDATE {t} SET lease_until_ms = {now} + ? WHERE status = 0 \
                         AND lease_until_ms > 0 AND (dedup_key, token) IN (VALUES {pairs}) \
                         RETURNING dedup_key, lease_until_ms",
                        now = self.q.dialect.now_ms_sql()
                    );
                    let mut args = vec![Val::I64(Some(lease_ms))];
                    for (k, tok) in chunk {
                        args.push(Val::Key(k.as_str().to_owned()));
                        args.push(Val::I64(Some(tok.0)));
                    }
                    let rows = retry_now!(
                        "extend_batch",
                        DB::fetch(&mut conn, &sql, args.clone(), &[Kind::Text, Kind::I64])
                    )?;
                    collect_extended(&rows, &mut extended)?;
                }
                Dialect::MySql => {
                    let now = retry_now!(
                        "extend clock",
                        DB::fetch(&mut conn, &self.q.now, vec![], &[Kind::I64])
                    )?
                    .first()
                    .map(|r| r.i64(0))
                    .transpose()
                    .map_err(|e| StoreError::Backend(format!("mysql clock: {e}")))?
                    .ok_or_else(|| StoreError::Backend("mysql clock: no row".into()))?;
                    let until_ms = now.saturating_add(lease_ms);
                    let pairs = vec!["(?, ?)"; chunk.len()].join(", ");
                    let update = format!(
                        "UPDATE {t} SET lease_until_ms = ? WHERE status = 0 AND lease_until_ms > 0 \
                         AND (dedup_key, token) IN ({pairs})"
                    );
                    let mut args = vec![Val::I64(Some(until_ms))];
                    for (k, tok) in chunk {
                        args.push(Val::Key(k.as_str().to_owned()));
                        args.push(Val::I64(Some(tok.0)));
                    }
                    retry_now!(
                        "extend_batch",
                        DB::execute(&mut conn, &update, args.clone())
                    )?;
                    // Which of them now carry this end under their token: those were extended
                    // (a row another worker owns, or completed, does not match the token).
                    let read = format!(
                        "SELECT dedup_key, lease_until_ms FROM {t} WHERE status = 0 \
                         AND lease_until_ms = ? AND (dedup_key, token) IN ({pairs})"
                    );
                    let rows = retry_now!(
                        "extend_batch read-back",
                        DB::fetch(&mut conn, &read, args.clone(), &[Kind::Text, Kind::I64])
                    )?;
                    collect_extended(&rows, &mut extended)?;
                }
            }
        }
        Ok(leases
            .iter()
            .map(|(k, _)| match extended.get(k.as_str()) {
                Some(&until_ms) => ExtendOutcome::Extended { until_ms },
                None => ExtendOutcome::Fenced,
            })
            .collect())
    }

    async fn get_here(&self, key: &DedupKey) -> Result<Option<DedupRecord>, StoreError> {
        check_key(key)?;
        let mut conn = self.acquire().await?;
        // A committed in-transaction completion not folded yet is shown (and kept) folded.
        self.fold_one(&mut conn, key).await?;
        let rows = retry_now!(
            "get",
            DB::fetch(
                &mut conn,
                &self.q.get,
                vec![Val::Key(key.as_str().to_owned())],
                RECORD_KINDS,
            )
        )?;
        rows.first()
            .map(|r| decode_record(r).map(|s| s.rec))
            .transpose()
    }

    async fn purge_expired_here(&self, limit: usize) -> Result<u64, StoreError> {
        if limit == 0 {
            return Ok(0);
        }
        let mut conn = self.acquire().await?;
        let n = retry_now!(
            "purge_expired",
            DB::execute(
                &mut conn,
                &self.q.purge,
                vec![Val::I64(Some(limit_i64(limit)))],
            )
        )?;
        if n > 0 {
            tracing::debug!(table = %self.options.table, purged = n, "purged expired dedup records");
        }
        if let Some(fq) = &self.q.fence {
            // Completions past retention and tombstones past `TOMBSTONE_TTL_MS`.
            let f = retry_now!(
                "purge_expired fence",
                DB::execute(&mut conn, &fq.purge, vec![Val::I64(Some(limit_i64(limit)))])
            )?;
            if f > 0 {
                tracing::debug!(table = %fq.table, purged = f, "purged expired fence rows");
            }
        }
        Ok(n)
    }

    async fn list_stuck_here(
        &self,
        stale_for: Duration,
        limit: usize,
    ) -> Result<Vec<DedupRecord>, StoreError> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let mut conn = self.acquire().await?;
        let rows = retry_now!(
            "list_stuck",
            DB::fetch(
                &mut conn,
                &self.q.list_stuck,
                vec![
                    Val::I64(Some(duration_ms(stale_for))),
                    Val::I64(Some(limit_i64(limit))),
                ],
                RECORD_KINDS,
            )
        )?;
        rows.iter()
            .map(|r| decode_record(r).map(|s| s.rec))
            .collect()
    }

    async fn stats_here(&self) -> Result<StoreStats, StoreError> {
        let mut conn = self.acquire().await?;
        let rows = retry_now!(
            "stats",
            DB::fetch(&mut conn, &self.q.stats, vec![], &[Kind::I64; 4])
        )?;
        let row = rows
            .first()
            .ok_or_else(|| StoreError::Backend("stats: no row".into()))?;
        let count = |i: usize| -> Result<u64, StoreError> {
            let n = row
                .i64(i)
                .map_err(|e| StoreError::Backend(format!("stats: {e}")))?;
            Ok(u64::try_from(n).unwrap_or(0))
        };
        let mut stats = StoreStats::default();
        stats.in_progress = count(0)?;
        stats.abandoned = count(1)?;
        stats.completed = count(2)?;
        stats.expired = count(3)?;
        Ok(stats)
    }

    async fn forget_here(&self, key: &DedupKey) -> Result<bool, StoreError> {
        check_key(key)?;
        let mut conn = self.acquire().await?;
        let k = || vec![Val::Key(key.as_str().to_owned())];
        if let Some(fq) = &self.q.fence {
            // Fence the current token first: a transaction still completing it must not
            // commit after the record is gone (a fresh claim would run the effect again).
            retry_now!(
                "forget tombstone",
                DB::execute(&mut conn, &fq.forget_tombstone, k())
            )?;
            retry_now!(
                "forget completions",
                DB::execute(&mut conn, &fq.forget_completions, k())
            )?;
        }
        let n = retry_now!(
            "forget",
            DB::execute(
                &mut conn,
                &self.q.forget,
                vec![Val::Key(key.as_str().to_owned())],
            )
        )?;
        Ok(n > 0)
    }
}

/// Runs a store operation on its own task and waits for it. A caller that stops waiting (a
/// timed-out heartbeat, a handler cut off when its lease is lost, a shutdown) then never
/// drops a statement in flight: the operation finishes on its connection, which goes back to
/// the pool in step with the server. sqlx cannot resume a MySQL connection whose query
/// future was dropped mid-exchange (launchbadge/sqlx#563): returned to the pool, the next
/// caller could read another statement's answer. Outside a runtime it runs in place.
async fn detached<T: Send + 'static>(
    work: impl std::future::Future<Output = Result<T, StoreError>> + Send + 'static,
) -> Result<T, StoreError> {
    match tokio::runtime::Handle::try_current() {
        Ok(rt) => rt
            .spawn(work)
            .await
            .map_err(|e| StoreError::Backend(format!("store operation failed: {e}")))?,
        Err(_) => work.await,
    }
}

#[async_trait]
impl<DB: SqlBackend> DedupStore for SqlStore<DB> {
    async fn claim_batch(&self, reqs: &[ClaimRequest]) -> Result<Vec<ClaimOutcome>, StoreError> {
        let (this, reqs) = (self.clone(), reqs.to_vec());
        detached(async move { this.claim_batch_here(&reqs).await }).await
    }

    async fn complete_batch(
        &self,
        items: &[Completion],
    ) -> Result<Vec<CompleteOutcome>, StoreError> {
        let (this, items) = (self.clone(), items.to_vec());
        detached(async move { this.complete_batch_here(&items).await }).await
    }

    async fn complete(
        &self,
        key: &DedupKey,
        token: FencingToken,
        result: Option<Bytes>,
        retention: Duration,
    ) -> Result<CompleteOutcome, StoreError> {
        let (this, key) = (self.clone(), key.clone());
        detached(async move { this.complete_here(&key, token, result, retention).await }).await
    }

    async fn release(
        &self,
        key: &DedupKey,
        token: FencingToken,
    ) -> Result<ReleaseOutcome, StoreError> {
        let (this, key) = (self.clone(), key.clone());
        detached(async move { this.release_here(&key, token).await }).await
    }

    async fn extend(
        &self,
        key: &DedupKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<ExtendOutcome, StoreError> {
        let (this, key) = (self.clone(), key.clone());
        detached(async move { this.extend_here(&key, token, lease).await }).await
    }

    async fn extend_batch(
        &self,
        leases: &[(DedupKey, FencingToken)],
        lease: Duration,
    ) -> Result<Vec<ExtendOutcome>, StoreError> {
        let (this, leases) = (self.clone(), leases.to_vec());
        detached(async move { this.extend_batch_here(&leases, lease).await }).await
    }

    async fn get(&self, key: &DedupKey) -> Result<Option<DedupRecord>, StoreError> {
        let (this, key) = (self.clone(), key.clone());
        detached(async move { this.get_here(&key).await }).await
    }

    async fn purge_expired(&self, limit: usize) -> Result<u64, StoreError> {
        let this = self.clone();
        detached(async move { this.purge_expired_here(limit).await }).await
    }

    async fn list_stuck(
        &self,
        stale_for: Duration,
        limit: usize,
    ) -> Result<Vec<DedupRecord>, StoreError> {
        let this = self.clone();
        detached(async move { this.list_stuck_here(stale_for, limit).await }).await
    }

    async fn stats(&self) -> Result<StoreStats, StoreError> {
        let this = self.clone();
        detached(async move { this.stats_here().await }).await
    }

    async fn forget(&self, key: &DedupKey) -> Result<bool, StoreError> {
        let (this, key) = (self.clone(), key.clone());
        detached(async move { this.forget_here(&key).await }).await
    }
}

#[cfg(feature = "sqlite")]
mod sqlite_connect {
    use super::*;
    use sqlx::sqlite::{
        Sqlite, SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions,
        SqliteSynchronous as Sync,
    };
    use std::str::FromStr;

    impl SqlStore<Sqlite> {
        /// Opens a SQLite database (`sqlite://path.db`, `sqlite://path.db?mode=rwc`,
        /// `sqlite::memory:`), creating the file if the URL sets no `mode`. File databases
        /// use WAL journaling and [`SqlStoreOptions::busy_timeout`]; migrations run unless
        /// disabled.
        pub async fn connect(url: &str, options: SqlStoreOptions) -> Result<Self, StoreError> {
            crate::errors::check_scheme(url, "SqliteStore", &["sqlite"], OTHER_STORES)?;
            let mut co = SqliteConnectOptions::from_str(url).map_err(|e| {
                StoreError::Config(format!("invalid SQLite URL `{url}`: {e} (expected e.g. sqlite://idemq.db or sqlite::memory:)"))
            })?;
            let memory = url.contains(":memory:") || url.contains("mode=memory");
            if !url.contains("mode=") {
                co = co.create_if_missing(true);
            }
            co = co.busy_timeout(options.busy_timeout).synchronous(
                match options.sqlite_synchronous {
                    SqliteSynchronous::Full => Sync::Full,
                    SqliteSynchronous::Normal => Sync::Normal,
                },
            );
            if !memory {
                co = co.journal_mode(SqliteJournalMode::Wal);
            }
            let mut po = SqlitePoolOptions::new()
                .max_connections(options.max_connections.max(1))
                .acquire_timeout(options.acquire_timeout);
            if memory {
                // One connection, kept forever: the database lives and dies with it.
                po = po
                    .max_connections(1)
                    .min_connections(1)
                    .idle_timeout(None)
                    .max_lifetime(None);
            }
            let pool = po
                .connect_with(co)
                .await
                .map_err(|e| map_sqlx_error::<Sqlite>(&format!("connect to {url}"), e))?;
            Self::from_pool(pool, options).await
        }
    }
}

#[cfg(feature = "postgres")]
mod postgres_connect {
    use super::*;
    use crate::errors::{check_scheme, probe};
    use crate::sniff::{endpoint, Server};
    use sqlx::postgres::{PgConnectOptions, PgPoolOptions, Postgres};
    use std::str::FromStr;

    impl SqlStore<Postgres> {
        /// Connects to PostgreSQL (`postgres://user:pass@host:port/db`, or `postgresql://`)
        /// and runs the migrations unless disabled.
        ///
        /// Startup fails at once, with a [`StoreError::Config`] naming what to fix, on
        /// another scheme, on a refused connection (host and port named), on a port where
        /// another server answers (named), and on a refused login; a server that accepts the
        /// connection but does not answer within [`SqlStoreOptions::connect_timeout`] is
        /// [`StoreError::Unavailable`].
        ///
        /// ```
        /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
        /// let err = idemq_sql::PgStore::connect("postgress://localhost/db", Default::default())
        ///     .await
        ///     .unwrap_err();
        /// assert!(err.to_string().contains("postgres:// or postgresql://"));
        /// # });
        /// ```
        pub async fn connect(url: &str, options: SqlStoreOptions) -> Result<Self, StoreError> {
            check_scheme(url, "PgStore", &["postgres", "postgresql"], OTHER_STORES)?;
            let co = PgConnectOptions::from_str(url).map_err(|e| {
                StoreError::Config(format!("invalid PostgreSQL URL `{}`: {e}", redact(url)))
            })?;
            let ep = endpoint(url, 5432);
            probe::<Postgres>(&co, ep.as_ref(), Server::Postgres, options.connect_timeout).await?;
            let pool = PgPoolOptions::new()
                .max_connections(options.max_connections.max(1))
                .acquire_timeout(options.acquire_timeout)
                .connect_with(co)
                .await
                .map_err(|e| {
                    map_sqlx_error::<Postgres>(&format!("connect to {}", redact(url)), e)
                })?;
            Self::from_pool(pool, options).await
        }
    }
}

#[cfg(feature = "mysql")]
mod mysql_connect {
    use super::*;
    use crate::errors::{check_scheme, probe};
    use crate::sniff::{endpoint, Server};
    use sqlx::mysql::{MySql, MySqlConnectOptions, MySqlPoolOptions};
    use std::str::FromStr;

    impl SqlStore<MySql> {
        /// Connects to MySQL or MariaDB (`mysql://user:pass@host:port/db`; `mariadb://` is
        /// accepted too) and runs the migrations unless disabled.
        ///
        /// Startup errors name what to fix, as for [`SqlStore::<Postgres>::connect`]:
        /// another scheme, a refused connection, another server on the port (a MySQL
        /// client waits for a greeting a PostgreSQL or Redis server never sends, so that
        /// case takes [`SqlStoreOptions::connect_timeout`]), a refused login.
        ///
        /// ```
        /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
        /// let err = idemq_sql::MySqlStore::connect("postgres://localhost/db", Default::default())
        ///     .await
        ///     .unwrap_err();
        /// assert!(err.to_string().contains("mysql:// or mariadb://"));
        /// # });
        /// ```
        pub async fn connect(url: &str, options: SqlStoreOptions) -> Result<Self, StoreError> {
            check_scheme(url, "MySqlStore", &["mysql", "mariadb"], OTHER_STORES)?;
            let url = match url.split_once("://") {
                Some((s, rest)) if s.eq_ignore_ascii_case("mariadb") => format!("mysql://{rest}"),
                _ => url.to_owned(),
            };
            let co = MySqlConnectOptions::from_str(&url).map_err(|e| {
                StoreError::Config(format!("invalid MySQL URL `{}`: {e}", redact(&url)))
            })?;
            let ep = endpoint(&url, 3306);
            probe::<MySql>(&co, ep.as_ref(), Server::MySql, options.connect_timeout).await?;
            let pool = MySqlPoolOptions::new()
                .max_connections(options.max_connections.max(1))
                .acquire_timeout(options.acquire_timeout)
                .connect_with(co)
                .await
                .map_err(|e| map_sqlx_error::<MySql>(&format!("connect to {}", redact(&url)), e))?;
            Self::from_pool(pool, options).await
        }
    }
}

/// The stores to use for other URLs, for scheme errors.
#[allow(dead_code)]
const OTHER_STORES: &str = "PostgreSQL: PgStore with postgres://, MySQL/MariaDB: MySqlStore \
     with mysql://, SQLite: SqliteStore with sqlite://, Redis: idemq-redis";

#[cfg(any(feature = "postgres", feature = "mysql"))]
use idemq_core::secrets::redact_url as redact;

/// Leases per `extend_batch` statement: two parameters each, far below SQLite's 32766 and
/// MySQL's 65535 placeholders.
const EXTEND_CHUNK: usize = 500;

/// `(dedup_key, lease_until_ms)` rows of an extension into `out`.
fn collect_extended(
    rows: &[crate::backend::Row],
    out: &mut HashMap<String, i64>,
) -> Result<(), StoreError> {
    for r in rows {
        let key = r
            .text(0)
            .map_err(|e| StoreError::Backend(format!("extend_batch: {e}")))?;
        let until = r
            .i64(1)
            .map_err(|e| StoreError::Backend(format!("extend_batch: {e}")))?;
        out.insert(key.to_owned(), until);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_keys_table_must_fit() {
        let long = TableName::new(&"t".repeat(60)).unwrap();
        let err = SqlStoreOptions::with_table(long).keys_table().unwrap_err();
        assert!(err.to_string().contains("keys_table"), "{err}");
    }
}
