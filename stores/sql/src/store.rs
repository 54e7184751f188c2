//! The dedup-table store ([`SqlStore`]): the struct, its accessors and its [`DedupStore`]
//! impl, one implementation for SQLite, PostgreSQL and MySQL/MariaDB. The operations are in
//! `claim`, `complete`, `lease` (release, extend on the heartbeat pool) and `scan` (get,
//! forget, purge, stuck listing, stats); opening and migrating in `connect`.

use crate::backend::{map_sqlx_error, Dialect, SqlBackend};
use crate::ident::TableName;
use crate::options::SqlStoreOptions;
use crate::queries::Queries;
use async_trait::async_trait;
use bytes::Bytes;
use idemq_core::{
    ClaimOutcome, ClaimRequest, CompleteOutcome, Completion, DedupKey, DedupRecord, DedupStore,
    ExtendOutcome, FencingToken, ReleaseOutcome, RollbackOutcome, StoreError, StoreStats,
};
use sqlx::Pool;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

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
/// [`evaluate_claim`](idemq_core::evaluate_claim), the same rules as every other store.
pub struct SqlStore<DB: SqlBackend> {
    pub(crate) pool: Pool<DB>,
    /// The heartbeat's pool ([`SqlStoreOptions::heartbeat_connections`]); the main pool
    /// when shared.
    pub(crate) heartbeat_pool: Pool<DB>,
    pub(crate) q: Arc<Queries>,
    pub(crate) options: Arc<SqlStoreOptions>,
    pub(crate) keys_table: TableName,
    pub(crate) fence_table: TableName,
    pub(crate) attempts_table: TableName,
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
            attempts_table: self.attempts_table.clone(),
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

impl<DB: SqlBackend> SqlStore<DB> {
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

    /// The unique-index strategy's attempt counts (see [`SqlStore::unique_index`]).
    pub fn attempts_table(&self) -> &TableName {
        &self.attempts_table
    }

    /// Every table the store keeps its records in (the dedup table, the keys table, the
    /// fence table where there is one, the attempts table), e.g. to drop a store made for
    /// one test or benchmark.
    pub fn tables(&self) -> Vec<&TableName> {
        let mut all = vec![self.table(), self.keys_table()];
        all.extend(self.fence_table());
        all.push(self.attempts_table());
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

    pub(crate) async fn acquire(&self) -> Result<sqlx::pool::PoolConnection<DB>, StoreError> {
        self.pool
            .acquire()
            .await
            .map_err(|e| map_sqlx_error::<DB>("acquire connection", e))
    }

    pub(crate) fn sorted_chunks<'a>(
        &self,
        keys: impl Iterator<Item = &'a DedupKey>,
    ) -> Vec<Vec<usize>> {
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
        detached(async move { this.release_here(&key, token, false).await }).await
    }

    async fn release_unrun(
        &self,
        key: &DedupKey,
        token: FencingToken,
    ) -> Result<ReleaseOutcome, StoreError> {
        let (this, key) = (self.clone(), key.clone());
        detached(async move { this.release_here(&key, token, true).await }).await
    }

    async fn roll_back(
        &self,
        key: &DedupKey,
        token: FencingToken,
        retention: Duration,
    ) -> Result<RollbackOutcome, StoreError> {
        let (this, key) = (self.clone(), key.clone());
        detached(async move { this.roll_back_here(&key, token, retention).await }).await
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
