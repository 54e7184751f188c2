//! Reading and deleting records outside the claim path: `get`, `forget`, `purge_expired`,
//! `list_stuck` and `stats`.

use crate::backend::{Kind, SqlBackend, Val};
use crate::exec::{check_key, limit_i64, retry_now};
use crate::queries::{decode_record, RECORD_KINDS};
use crate::store::SqlStore;
use idemq_core::store::duration_ms;
use idemq_core::{DedupKey, DedupRecord, StoreError, StoreStats};
use std::time::Duration;

impl<DB: SqlBackend> SqlStore<DB> {
    // The store operation behind [`DedupStore`]; `store::detached` runs it on its own task.
    pub(crate) async fn get_here(&self, key: &DedupKey) -> Result<Option<DedupRecord>, StoreError> {
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

    pub(crate) async fn purge_expired_here(&self, limit: usize) -> Result<u64, StoreError> {
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

    pub(crate) async fn list_stuck_here(
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

    pub(crate) async fn stats_here(&self) -> Result<StoreStats, StoreError> {
        let mut conn = self.acquire().await?;
        let rows = retry_now!(
            "stats",
            DB::fetch(&mut conn, &self.q.stats, vec![], &[Kind::I64; 5])
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
        stats.rolled_back = count(4)?;
        Ok(stats)
    }

    pub(crate) async fn forget_here(&self, key: &DedupKey) -> Result<bool, StoreError> {
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
