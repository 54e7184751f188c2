//! Claims: one atomic statement per chunk of keys, the read-back of the keys it did not
//! take, and the takeover of ended leases through the fence table.

use crate::backend::{Dialect, Kind, Row, SqlBackend};
use crate::exec::{check_key, first_then, retry_now};
use crate::queries::{
    decode_record, ClaimRow, FenceQueries, Stmt, StoredRecord, TakeoverRow, ACQUIRED_KINDS,
    FENCE_COMPLETION, READ_BACK_KINDS, RECORD_KINDS,
};
use crate::store::SqlStore;
use idemq_core::store::{check_distinct_keys, duration_ms};
use idemq_core::{
    evaluate_claim, ClaimOutcome, ClaimRequest, ClaimVerdict, DedupKey, DedupStore, FencingToken,
    Lease, RecordStatus, StoreError,
};
use std::collections::{HashMap, HashSet};

/// How many times a claim re-runs for keys whose row changed between the atomic write and
/// the read-back (another worker completed, released or deleted it in between).
const CLAIM_ROUNDS: usize = 8;

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
    returned: &[Row],
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

impl<DB: SqlBackend> SqlStore<DB> {
    // The store operation behind [`DedupStore`]; `store::detached` runs it on its own task.
    pub(crate) async fn claim_batch_here(
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
                        // Our token, from an earlier try of this claim whose reply was lost:
                        // the same lease while it is live. Released (a batch claim that
                        // failed part-way gives back what it acquired) or ended, it is not
                        // ours to hand out, and taking it over with the same token would be
                        // fenced by its own tombstone: in flight, so the redelivery claims
                        // afresh.
                        out[i] = Some(if s.rec.lease_until_ms > now {
                            ClaimOutcome::Acquired(Lease {
                                token: s.rec.token,
                                until_ms: s.rec.lease_until_ms,
                                attempt: s.rec.attempts,
                                takeover: s.took_over,
                            })
                        } else {
                            ClaimOutcome::InFlight {
                                until_ms: s.rec.lease_until_ms,
                            }
                        });
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
}
