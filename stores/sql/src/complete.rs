//! Completions: the engine's (one statement per chunk, then a probe of the keys it did not
//! complete) and in the caller's transaction (through the fence table on PostgreSQL and
//! MySQL), and the folding of in-transaction completions into the dedup rows.

use crate::backend::{map_sqlx_error, Kind, SqlBackend, Val};
use crate::exec::{check_key, first_then, retry_now};
use crate::queries::{CompleteRow, FenceQueries, Stmt, FENCE_COMPLETION};
use crate::store::SqlStore;
use bytes::Bytes;
use idemq_core::store::duration_ms;
use idemq_core::{CompleteOutcome, Completion, DedupKey, FencingToken, RecordStatus, StoreError};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Set once any store of this process completed in a transaction through a fence table.
/// From then on the engine's completions keep the result of an in-transaction completion of
/// the same token (one fence-table lookup per completed row, ~20–40% of the completion
/// statement's server time on PostgreSQL); before, nothing can be there to keep. The
/// in-transaction completion is made by the lease holder, i.e. in the process whose engine
/// completes the key after it. (If it was made elsewhere, the engine's result is stored
/// instead; the fence itself never depends on this.)
static IN_TX_COMPLETIONS: AtomicBool = AtomicBool::new(false);

impl<DB: SqlBackend> SqlStore<DB> {
    /// Completes `key` inside the caller's transaction, fenced by `token`, so the business
    /// effect and the completion commit (or roll back) together.
    ///
    /// Answers [`CompleteOutcome::Fenced`] when `token` no longer owns the key (its lease
    /// was taken over, it was released or purged): roll the transaction back. Answers
    /// [`CompleteOutcome::AlreadyCompleted`] when this token completed the key before — an
    /// earlier transaction of this claim committed, though its caller may have seen an
    /// error (a COMMIT whose reply was lost): this transaction repeats that effect, so roll
    /// it back too and treat the message as done.
    ///
    /// On PostgreSQL and MySQL the completion does not touch the dedup row, which the
    /// engine's heartbeat keeps rewriting: it is *inserted* into the fence table under
    /// `(key, token)`, so the business transaction may run at any isolation level
    /// (REPEATABLE READ, SERIALIZABLE, MariaDB's snapshot isolation) and for longer than a
    /// heartbeat. A takeover of the key tombstones the old token first, waiting for this
    /// transaction: if it commits, the takeover answers `Duplicate` instead; once the
    /// tombstone is in, this call answers `Fenced` (or, at snapshot isolation, fails with a
    /// retryable serialization error, after which it answers `Fenced`). The engine's
    /// completion after the commit, [`DedupStore::get`](idemq_core::DedupStore::get) and
    /// the next claim fold it into the dedup row. On SQLite the completion updates the dedup row (SQLite has one writer and
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
    /// answer is in order; [`CompleteOutcome::AlreadyCompleted`] says what it says for
    /// [`SqlStore::complete_in_tx`] (roll back: an earlier transaction committed). Unlike [`SqlStore::complete_in_tx`] it updates the dedup rows
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
            return Ok(CompleteOutcome::AlreadyCompleted);
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
                CompleteOutcome::AlreadyCompleted
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
            CompleteOutcome::AlreadyCompleted
        } else {
            CompleteOutcome::Fenced
        })
    }

    /// Whether completions must keep the result of an in-transaction completion.
    fn fold_completions(&self) -> bool {
        self.q.fence.is_some() && IN_TX_COMPLETIONS.load(Ordering::Relaxed)
    }

    /// Folds the in-transaction completion of `key` (if any) into its dedup row.
    pub(crate) async fn fold_one(
        &self,
        conn: &mut DB::Connection,
        key: &DedupKey,
    ) -> Result<(), StoreError> {
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
        // Without RETURNING (MySQL) only the count of rows this statement completed is known.
        let mut matched: Option<u64> = None;
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
            let n = retry_now!("complete_batch", DB::execute(conn, &sql, args()))?;
            // Keys are distinct here, so every item matched iff the count says so.
            if n == idx.len() as u64 {
                for &i in idx {
                    out[i] = Some(CompleteOutcome::Completed);
                }
            }
            matched = Some(n);
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
        let done_by_token = |i: &usize| {
            let c = &items[*i];
            state.get(c.key.as_str()) == Some(&(c.token.0, RecordStatus::Completed.code()))
        };
        // Completed by this token: by this statement, or before it. With RETURNING the
        // statement's own are decided already; without, the count tells them apart when
        // it is all or none of them.
        let done_now = match matched {
            None | Some(0) => false,
            Some(n) if n == undecided.iter().filter(|i| done_by_token(i)).count() as u64 => true,
            Some(_) => {
                return Err(StoreError::Backend(
                    "a batch completion mixed keys completed before with new ones and the \
                     database cannot say which are which; complete them one at a time"
                        .into(),
                ))
            }
        };
        for i in undecided {
            out[i] = Some(match (done_by_token(&i), done_now) {
                (true, true) => CompleteOutcome::Completed,
                (true, false) => CompleteOutcome::AlreadyCompleted,
                (false, _) => CompleteOutcome::Fenced,
            });
        }
        Ok(())
    }
}

impl<DB: SqlBackend> SqlStore<DB> {
    // The store operation behind [`DedupStore`]; `store::detached` runs it on its own task.
    pub(crate) async fn complete_batch_here(
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

    pub(crate) async fn complete_here(
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
}
