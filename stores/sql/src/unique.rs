//! The unique-index strategy: the claim *is* the key's insert in the effect's transaction.
//!
//! The dedup table with leases ([`SqlStore`] itself as the consumer's store) claims a key,
//! runs the handler, then completes the record: three writes per message (batched), and a
//! lease protocol that works for any effect, including ones outside the database. When the
//! effect is rows in the *same* database, a unique index does the whole job with one write:
//! insert the key in the transaction that writes the effect, commit, then ack.
//!
//! [`UniqueIndexStore`] (from [`SqlStore::unique_index`]) is that strategy as a store of
//! the one engine, [`idemq_core::IdempotentConsumer`]: its claims only hand the keys out
//! ([`ClaimMode::InEffectTransaction`]), and the store's batch handler
//! ([`SqlStore::batch_handler`]) inserts them with one statement in the batch's transaction
//! (`INSERT … ON CONFLICT DO NOTHING RETURNING`, sorted, so two consumers lock keys in one
//! order), writes the effects of the keys that were new, and commits. Keys that were
//! already there are acked as duplicates; nothing is acked before the commit. The engine's
//! batching, retries, dead-letters, pipeline, metrics and stats are the same as for every
//! other store.
//!
//! Why no lease is needed: a concurrent consumer inserting the same key waits on the row
//! lock of the uncommitted insert (PostgreSQL, MariaDB; SQLite has a single writer), then
//! sees it committed (a duplicate: skip) or rolled back (its own insert wins). A crash
//! before the commit leaves nothing; a crash after it leaves a key whose redelivery is a
//! duplicate. A commit whose answer was lost is settled the same way: nacked, and the
//! redelivery finds the key if the commit happened.
//!
//! What it cannot do: effects outside this database (an HTTP call, a publish) are not in
//! the transaction — give the consumer the [`SqlStore`] itself (leases) for those. There is
//! no stored result to replay to duplicates (`on_duplicate` is not called), and no "in
//! flight elsewhere" answer (a duplicate waits for the other transaction instead). Keys
//! live in [`SqlStore::keys_table`]; [`DedupStore::purge_expired`] deletes those older than
//! the store's retention.
//!
//! ```no_run
//! use idemq_core::{IdempotentConsumer, KeyStrategy};
//! use idemq_sql::{sqlx, PgStore, SqlResultExt};
//! use std::sync::Arc;
//!
//! # async fn run(store: PgStore, mut source: idemq_core::broker::MemorySource) -> Result<(), Box<dyn std::error::Error>> {
//! let keys = KeyStrategy::json_pointer("payments", "/payment_id")?;
//! let handler = store.batch_handler(|tx, msgs| Box::pin(async move {
//!     let ids: Vec<&str> = msgs.iter().map(|m| m.key.as_str()).collect();
//!     sqlx::query("INSERT INTO ledger (payment_id) SELECT * FROM UNNEST($1::text[])")
//!         .bind(ids)
//!         .execute(&mut *tx)
//!         .await
//!         .classify()?;
//!     Ok(())
//! }));
//! let consumer = IdempotentConsumer::new(Arc::new(store.unique_index()), keys, handler);
//! consumer.run_until_idle(&mut source).await?;
//! # Ok(()) }
//! ```

use crate::backend::{map_sqlx_error, Dialect, Kind, SqlBackend, Val};
use crate::store::SqlStore;
use async_trait::async_trait;
use idemq_core::{
    now_ms, ClaimMode, ClaimOutcome, ClaimRequest, CompleteOutcome, Completion, DedupKey,
    DedupRecord, DedupStore, ExtendOutcome, FencingToken, Lease, RecordStatus, ReleaseOutcome,
    StoreError,
};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Failed attempts remembered per key before the map is cleared (then the broker's
/// delivery count is what remains).
const MAX_REMEMBERED_FAILURES: usize = 100_000;

/// A [`SqlStore`]'s keys table as the consumer's store: the unique-index strategy (see the
/// module docs). Made by [`SqlStore::unique_index`]; run it with the store's
/// [`batch_handler`](SqlStore::batch_handler) (the engine refuses any handler that does not
/// insert the keys in its transaction).
pub struct UniqueIndexStore<DB: SqlBackend> {
    store: SqlStore<DB>,
    retention: Duration,
    /// Failed attempts per key, for the retry policy: no record counts them across
    /// deliveries (the engine also takes the broker's delivery count when it has one).
    failures: Arc<Mutex<HashMap<DedupKey, u32>>>,
}

impl<DB: SqlBackend> Clone for UniqueIndexStore<DB> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            retention: self.retention,
            failures: self.failures.clone(),
        }
    }
}

impl<DB: SqlBackend> std::fmt::Debug for UniqueIndexStore<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UniqueIndexStore")
            .field("keys_table", &self.store.keys_table().as_str())
            .field("retention", &self.retention)
            .finish_non_exhaustive()
    }
}

impl<DB: SqlBackend> SqlStore<DB> {
    /// This store's keys table as a consumer's store: the claim is the key's insert in the
    /// effect's transaction (the unique-index strategy, one write per message instead of
    /// three). Run it with [`SqlStore::batch_handler`]. Keys are kept 7 days (see
    /// [`UniqueIndexStore::with_retention`]).
    pub fn unique_index(&self) -> UniqueIndexStore<DB> {
        UniqueIndexStore {
            store: self.clone(),
            retention: Duration::from_secs(7 * 24 * 3600),
            failures: Arc::default(),
        }
    }
}

impl<DB: SqlBackend> UniqueIndexStore<DB> {
    /// How long keys are kept ([`DedupStore::purge_expired`] deletes older ones). A
    /// redelivery of a purged key is processed again: keep it above the longest redelivery
    /// horizon of your brokers.
    pub fn with_retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// The SQL store whose keys table this is.
    pub fn sql_store(&self) -> &SqlStore<DB> {
        &self.store
    }

    fn failed_before(&self, key: &DedupKey) -> u32 {
        let seen = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        match seen.is_empty() {
            true => 0,
            false => seen.get(key).copied().unwrap_or(0),
        }
    }

    fn key_sql(&self, sql: &str) -> String {
        DB::DIALECT.placeholders(sql.replace("{t}", self.store.keys_table().as_str()))
    }
}

#[async_trait]
impl<DB: SqlBackend> DedupStore for UniqueIndexStore<DB> {
    fn claim_mode(&self) -> ClaimMode {
        ClaimMode::InEffectTransaction
    }

    /// Hands every key out (no round trip): the handler's transaction claims it.
    async fn claim_batch(&self, reqs: &[ClaimRequest]) -> Result<Vec<ClaimOutcome>, StoreError> {
        let until_ms = now_ms();
        Ok(reqs
            .iter()
            .map(|r| {
                ClaimOutcome::Acquired(Lease {
                    token: r.token.unwrap_or_else(FencingToken::random),
                    until_ms: until_ms.saturating_add(r.lease.as_millis() as i64),
                    attempt: self.failed_before(&r.key) + 1,
                    takeover: false,
                })
            })
            .collect())
    }

    /// Refused: completions happen in the effect's transaction.
    async fn complete_batch(
        &self,
        _items: &[Completion],
    ) -> Result<Vec<CompleteOutcome>, StoreError> {
        Err(StoreError::Config(
            "the unique-index store completes keys in the effect's transaction (the store's \
             batch_handler), not afterwards"
                .into(),
        ))
    }

    /// Counts a failed attempt of `key` (nothing is stored to give back).
    async fn release(
        &self,
        key: &DedupKey,
        _token: FencingToken,
    ) -> Result<ReleaseOutcome, StoreError> {
        let mut seen = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        if seen.len() >= MAX_REMEMBERED_FAILURES {
            seen.clear();
        }
        *seen.entry(key.clone()).or_default() += 1;
        Ok(ReleaseOutcome::Released)
    }

    /// Nothing to extend: no lease is held (the transaction's row locks are the hold).
    async fn extend(
        &self,
        _key: &DedupKey,
        _token: FencingToken,
        lease: Duration,
    ) -> Result<ExtendOutcome, StoreError> {
        Ok(ExtendOutcome::Extended {
            until_ms: now_ms().saturating_add(lease.as_millis() as i64),
        })
    }

    /// The key as a completed record when the keys table holds it.
    async fn get(&self, key: &DedupKey) -> Result<Option<DedupRecord>, StoreError> {
        let sql = self.key_sql("SELECT created_ms FROM {t} WHERE dedup_key = ?");
        let mut conn = self.store.acquire().await?;
        let rows = DB::fetch(
            &mut conn,
            &sql,
            vec![Val::Key(key.as_str().to_owned())],
            &[Kind::I64],
        )
        .await
        .map_err(|e| map_sqlx_error::<DB>("get", e))?;
        Ok(rows.first().map(|r| {
            let created = r.i64(0).unwrap_or_default();
            let retention = self.retention.as_millis() as i64;
            DedupRecord {
                key: key.clone(),
                status: RecordStatus::Completed,
                token: FencingToken(0),
                lease_until_ms: created,
                attempts: 1,
                payload_hash: None,
                result: None,
                first_seen_ms: created,
                completed_ms: Some(created),
                expires_ms: Some(created.saturating_add(retention)),
                worker: None,
            }
        }))
    }

    /// Deletes up to `limit` keys older than the retention.
    async fn purge_expired(&self, limit: usize) -> Result<u64, StoreError> {
        self.store
            .purge_keys_older_than(self.retention, limit)
            .await
    }

    /// None: no key is ever held outside a transaction.
    async fn list_stuck(
        &self,
        _stale_for: Duration,
        _limit: usize,
    ) -> Result<Vec<DedupRecord>, StoreError> {
        Ok(Vec::new())
    }

    async fn forget(&self, key: &DedupKey) -> Result<bool, StoreError> {
        let sql = self.key_sql("DELETE FROM {t} WHERE dedup_key = ?");
        let mut conn = self.store.acquire().await?;
        let n = DB::execute(&mut conn, &sql, vec![Val::Key(key.as_str().to_owned())])
            .await
            .map_err(|e| map_sqlx_error::<DB>("forget", e))?;
        Ok(n > 0)
    }
}

/// The batch key insert of one dialect.
pub(crate) struct InsertSql {
    dialect: Dialect,
    table: String,
}

impl InsertSql {
    pub(crate) fn new(dialect: Dialect, table: &str) -> Self {
        Self {
            dialect,
            table: table.to_owned(),
        }
    }

    /// Inserts `keys` (sorted by the caller); answers the ones that were new.
    pub(crate) async fn insert<DB: SqlBackend>(
        &self,
        conn: &mut DB::Connection,
        keys: &[&str],
    ) -> Result<HashSet<String>, sqlx::Error> {
        let (t, now) = (&self.table, self.dialect.now_ms_sql());
        let (sql, args) = match self.dialect {
            // One array parameter, whatever the batch size.
            Dialect::Postgres => (
                format!(
                    "INSERT INTO {t} (dedup_key, created_ms) SELECT u, {now} FROM UNNEST(?::text[]) AS u \
                     ON CONFLICT (dedup_key) DO NOTHING RETURNING dedup_key"
                ),
                vec![Val::TextArray(
                    keys.iter().map(|k| Some((*k).to_owned())).collect(),
                )],
            ),
            Dialect::Sqlite | Dialect::MySql => {
                let rows = vec![format!("(?, {now})"); keys.len()].join(", ");
                let sql = if self.dialect == Dialect::MySql {
                    // MariaDB: IGNORE skips existing keys (after waiting for an uncommitted
                    // insert of the same key), RETURNING lists the rows written.
                    format!("INSERT IGNORE INTO {t} (dedup_key, created_ms) VALUES {rows} RETURNING dedup_key")
                } else {
                    format!(
                        "INSERT INTO {t} (dedup_key, created_ms) VALUES {rows} \
                         ON CONFLICT (dedup_key) DO NOTHING RETURNING dedup_key"
                    )
                };
                let args = keys.iter().map(|k| Val::Key((*k).to_owned())).collect();
                (sql, args)
            }
        };
        let sql = self.dialect.placeholders(sql);
        let rows = DB::fetch(conn, &sql, args, &[Kind::Text]).await?;
        rows.iter()
            .map(|r| {
                r.text(0)
                    .map(str::to_owned)
                    .map_err(|e| sqlx::Error::Decode(e.into()))
            })
            .collect()
    }
}
