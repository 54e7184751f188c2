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
//! Attempts: the keys table holds only keys whose effect committed, so the retry policy's
//! count lives in the store's attempts table ([`SqlStore::attempts_table`]): a run of the
//! handler that failed and a claim given back without a run (held behind a failing message
//! of its lane, a claim answered late, a stale delivery) are each counted there, durably and
//! for every consumer of the group. A claim reads it only for a redelivery (the broker's
//! delivery count above 1), so a first delivery costs no round trip; its attempt is the
//! deliveries less the claims given back unrun (a run cut short by a crash counts, as it may
//! have applied its effect before the rollback), and at least one more than the failures
//! counted. A broker that counts no deliveries across restarts (Kafka: the count is the
//! source's own) starts a message that comes back after a restart at its first attempt.
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
use std::time::Duration;

/// A [`SqlStore`]'s keys table as the consumer's store: the unique-index strategy (see the
/// module docs). Made by [`SqlStore::unique_index`]; run it with the store's
/// [`batch_handler`](SqlStore::batch_handler) (the engine refuses any handler that does not
/// insert the keys in its transaction).
pub struct UniqueIndexStore<DB: SqlBackend> {
    store: SqlStore<DB>,
    retention: Duration,
}

impl<DB: SqlBackend> Clone for UniqueIndexStore<DB> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            retention: self.retention,
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

    /// The (failures, unrun) counts of `keys` that have any.
    async fn counts(&self, keys: &[&DedupKey]) -> Result<HashMap<String, (i64, i64)>, StoreError> {
        let marks = vec!["?"; keys.len()].join(", ");
        let sql = DB::DIALECT.placeholders(format!(
            "SELECT dedup_key, failures, unrun FROM {} WHERE dedup_key IN ({marks})",
            self.store.attempts_table()
        ));
        let args = keys
            .iter()
            .map(|k| Val::Key(k.as_str().to_owned()))
            .collect();
        let mut conn = self.store.acquire().await?;
        let rows = DB::fetch(&mut conn, &sql, args, &[Kind::Text, Kind::I64, Kind::I64])
            .await
            .map_err(|e| map_sqlx_error::<DB>("read attempts", e))?;
        let mut out = HashMap::with_capacity(rows.len());
        for r in &rows {
            if let (Ok(k), Ok(f), Ok(u)) = (r.text(0), r.i64(1), r.i64(2)) {
                out.insert(k.to_owned(), (f, u));
            }
        }
        Ok(out)
    }

    /// Adds one failed run (`ran`) or one claim given back unrun to `key`'s counts.
    async fn count(&self, key: &DedupKey, ran: bool) -> Result<(), StoreError> {
        let a = self.store.attempts_table();
        let upsert = match DB::DIALECT {
            Dialect::MySql => format!(
                "INSERT INTO {a} (dedup_key, failures, unrun, updated_ms) VALUES (?, ?, ?, {now}) \
                 ON DUPLICATE KEY UPDATE failures = failures + VALUES(failures), \
                 unrun = unrun + VALUES(unrun), updated_ms = VALUES(updated_ms)",
                now = DB::DIALECT.now_ms_sql()
            ),
            Dialect::Postgres | Dialect::Sqlite => format!(
                "INSERT INTO {a} (dedup_key, failures, unrun, updated_ms) VALUES (?, ?, ?, {now}) \
                 ON CONFLICT (dedup_key) DO UPDATE SET failures = {a}.failures + excluded.failures, \
                 unrun = {a}.unrun + excluded.unrun, updated_ms = excluded.updated_ms",
                now = DB::DIALECT.now_ms_sql()
            ),
        };
        let (failures, unrun) = if ran { (1, 0) } else { (0, 1) };
        let mut conn = self.store.acquire().await?;
        DB::execute(
            &mut conn,
            &DB::DIALECT.placeholders(upsert),
            vec![
                Val::Key(key.as_str().to_owned()),
                Val::I64(Some(failures)),
                Val::I64(Some(unrun)),
            ],
        )
        .await
        .map_err(|e| map_sqlx_error::<DB>("count attempt", e))?;
        Ok(())
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

    /// Hands every key out: the handler's transaction claims it. A first delivery costs no
    /// round trip; the attempt counts of redeliveries are read in one (module docs).
    async fn claim_batch(&self, reqs: &[ClaimRequest]) -> Result<Vec<ClaimOutcome>, StoreError> {
        let redelivered: Vec<&DedupKey> = reqs
            .iter()
            .filter(|r| r.deliveries.is_some_and(|n| n > 1))
            .map(|r| &r.key)
            .collect();
        let counts = match redelivered.is_empty() {
            true => HashMap::new(),
            false => self.counts(&redelivered).await?,
        };
        let until_ms = now_ms();
        Ok(reqs
            .iter()
            .map(|r| {
                let (failures, unrun) = counts.get(r.key.as_str()).copied().unwrap_or((0, 0));
                let runs = i64::from(r.deliveries.unwrap_or(1)) - unrun;
                let attempt = runs.max(failures + 1).clamp(1, i64::from(u32::MAX));
                ClaimOutcome::Acquired(Lease {
                    token: r.token.unwrap_or_else(FencingToken::random),
                    until_ms: until_ms.saturating_add(r.lease.as_millis() as i64),
                    attempt: u32::try_from(attempt).unwrap_or(u32::MAX),
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

    /// Counts a failed run of `key` in the attempts table (nothing else is held).
    async fn release(
        &self,
        key: &DedupKey,
        _token: FencingToken,
    ) -> Result<ReleaseOutcome, StoreError> {
        self.count(key, true).await?;
        Ok(ReleaseOutcome::Released)
    }

    /// Counts a claim given back without a run, so the next attempt is not raised by it.
    async fn release_unrun(
        &self,
        key: &DedupKey,
        _token: FencingToken,
    ) -> Result<ReleaseOutcome, StoreError> {
        self.count(key, false).await?;
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

    /// Deletes up to `limit` keys older than the retention, and the attempt counts last
    /// changed before it.
    async fn purge_expired(&self, limit: usize) -> Result<u64, StoreError> {
        let sql = DB::DIALECT.placeholders(format!(
            "DELETE FROM {} WHERE updated_ms < {} - ?",
            self.store.attempts_table(),
            DB::DIALECT.now_ms_sql()
        ));
        let mut conn = self.store.acquire().await?;
        DB::execute(
            &mut conn,
            &sql,
            vec![Val::I64(Some(idemq_core::store::duration_ms(
                self.retention,
            )))],
        )
        .await
        .map_err(|e| map_sqlx_error::<DB>("purge attempts", e))?;
        drop(conn);
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

    /// Deletes the key and its attempt counts.
    async fn forget(&self, key: &DedupKey) -> Result<bool, StoreError> {
        let counts = DB::DIALECT.placeholders(format!(
            "DELETE FROM {} WHERE dedup_key = ?",
            self.store.attempts_table()
        ));
        let sql = self.key_sql("DELETE FROM {t} WHERE dedup_key = ?");
        let mut conn = self.store.acquire().await?;
        DB::execute(&mut conn, &counts, vec![Val::Key(key.as_str().to_owned())])
            .await
            .map_err(|e| map_sqlx_error::<DB>("forget", e))?;
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
