//! Leases: release, and extension (the heartbeat's call) on the heartbeat's own pool.

use crate::backend::{map_sqlx_error, Dialect, Kind, Row, SqlBackend, Val};
use crate::exec::{check_key, retry_now};
use crate::store::SqlStore;
use idemq_core::store::duration_ms;
use idemq_core::{
    DedupKey, ExtendOutcome, FencingToken, RecordStatus, ReleaseOutcome, RollbackOutcome,
    StoreError,
};
use std::collections::HashMap;
use std::time::Duration;

/// Leases per `extend_batch` statement: two parameters each, far below SQLite's 32766 and
/// MySQL's 65535 placeholders.
const EXTEND_CHUNK: usize = 500;

/// `(dedup_key, lease_until_ms)` rows of an extension into `out`.
fn collect_extended(rows: &[Row], out: &mut HashMap<String, i64>) -> Result<(), StoreError> {
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

impl<DB: SqlBackend> SqlStore<DB> {
    // The store operation behind [`DedupStore`]; `store::detached` runs it on its own task.
    // `unrun`: the handler did not run, so the claim's attempt is taken back.
    pub(crate) async fn release_here(
        &self,
        key: &DedupKey,
        token: FencingToken,
        unrun: bool,
    ) -> Result<ReleaseOutcome, StoreError> {
        check_key(key)?;
        let mut conn = self.acquire().await?;
        let sql = match unrun {
            true => &self.q.release_unrun,
            false => &self.q.release,
        };
        let n = retry_now!(
            "release",
            DB::execute(
                &mut conn,
                sql,
                vec![Val::Key(key.as_str().to_owned()), Val::I64(Some(token.0))],
            )
        )?;
        Ok(if n > 0 {
            ReleaseOutcome::Released
        } else {
            ReleaseOutcome::Fenced
        })
    }

    pub(crate) async fn roll_back_here(
        &self,
        key: &DedupKey,
        token: FencingToken,
        retention: Duration,
    ) -> Result<RollbackOutcome, StoreError> {
        check_key(key)?;
        let mut conn = self.acquire().await?;
        let n = retry_now!(
            "roll_back",
            DB::execute(
                &mut conn,
                &self.q.roll_back,
                vec![
                    Val::I64(Some(duration_ms(retention))),
                    Val::Key(key.as_str().to_owned()),
                    Val::I64(Some(token.0)),
                ],
            )
        )?;
        if n > 0 {
            return Ok(RollbackOutcome::RolledBack);
        }
        // Not in progress under this token: rolled back by it before (a retry whose first
        // reply was lost), or fenced.
        let rows = retry_now!(
            "roll_back probe",
            DB::fetch(
                &mut conn,
                &self.q.probe,
                vec![Val::Key(key.as_str().to_owned())],
                &[Kind::I64, Kind::I64],
            )
        )?;
        let ours = rows.first().is_some_and(|r| {
            r.i64(0).ok() == Some(token.0) && r.i64(1).ok() == Some(RecordStatus::RolledBack.code())
        });
        Ok(match ours {
            true => RollbackOutcome::RolledBack,
            false => RollbackOutcome::Fenced,
        })
    }

    pub(crate) async fn extend_here(
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
    pub(crate) async fn extend_batch_here(
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
}
