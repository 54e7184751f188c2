//! `SCAN`-based operations: records read a chunk at a time on every master, the bounded
//! purge sweep, stuck leases and the record counts.

use crate::cluster::{self, Master};
use crate::codec::decode_record;
use crate::conn::StoreConn;
use crate::errors::store_err;
use crate::lua;
use crate::store::RedisStore;
use idemq_core::store::duration_ms;
use idemq_core::{DedupRecord, RecordStatus, StoreError, StoreStats};
use redis::aio::ConnectionLike;
use redis::Cmd;
use std::time::Duration;

impl RedisStore {
    /// One `SCAN` step over the records, on `node` of a cluster (`None`: the server).
    async fn scan_chunk(
        &self,
        node: Option<&Master>,
        cursor: u64,
    ) -> Result<(u64, Vec<Vec<u8>>), StoreError> {
        let mut cmd = redis::cmd("SCAN");
        cmd.arg(cursor)
            .arg("MATCH")
            .arg(&self.cfg.pattern)
            .arg("COUNT")
            .arg(self.cfg.scan_count);
        let v = match (&self.conn, node) {
            (StoreConn::Cluster(h), Some(node)) => {
                h.call(|mut c| async move { c.route_command(&cmd, node.routing()).await })
                    .await
            }
            (conn, _) => conn.clone().req_packed_command(&cmd).await,
        }
        .map_err(store_err)?;
        redis::from_owned_redis_value(v).map_err(store_err)
    }

    /// Every record under the prefix, on every master, handed to `each` (one SCAN chunk and
    /// one MGET at a time; on a cluster MGET is split per slot by the client). A key that
    /// expired between SCAN and MGET is simply gone; an unreadable value is logged and
    /// skipped.
    async fn scan_records(&self, mut each: impl FnMut(DedupRecord)) -> Result<(), StoreError> {
        let mut con = self.conn.clone();
        for node in self.scan_nodes().await? {
            let mut cursor = 0u64;
            loop {
                let (next, keys) = self.scan_chunk(node.as_ref(), cursor).await?;
                if !keys.is_empty() {
                    let vals: Vec<Option<Vec<u8>>> = redis::cmd("MGET")
                        .arg(&keys)
                        .query_async(&mut con)
                        .await
                        .map_err(store_err)?;
                    for (k, v) in keys.iter().zip(vals) {
                        let (Some(dk), Some(v)) = (self.dedup_key_of(k), v) else {
                            continue;
                        };
                        match decode_record(dk.clone(), &v) {
                            Ok(r) => each(r),
                            Err(e) => {
                                tracing::warn!(key = %dk, error = %e, "skipping unreadable record")
                            }
                        }
                    }
                }
                cursor = next;
                if next == 0 {
                    break;
                }
            }
        }
        Ok(())
    }

    /// The nodes a scan must visit: every master of a cluster, asked now (a failover
    /// moves them); `[None]` on a standalone server.
    async fn scan_nodes(&self) -> Result<Vec<Option<Master>>, StoreError> {
        match &self.conn {
            StoreConn::Single(_) => Ok(vec![None]),
            StoreConn::Cluster(h) => Ok(cluster::masters(h).await?.into_iter().map(Some).collect()),
        }
    }

    /// Deletes the expired records among `keys` (scanned from one node), at most `limit`:
    /// one purge script per slot on a cluster, in waves of at most `limit` keys, so the
    /// scripts running at once cannot delete more than `limit` together.
    async fn purge_keys(&self, keys: &[Vec<u8>], limit: u64) -> Result<u64, StoreError> {
        let mut by_slot: Vec<(u16, Vec<&[u8]>)> = Vec::new();
        for k in keys {
            let slot = self.slot_of(k);
            match by_slot.iter_mut().find(|(s, _)| *s == slot) {
                Some((_, v)) => v.push(k),
                None => by_slot.push((slot, vec![k])),
            }
        }
        let mut purged = 0u64;
        let mut rest = by_slot.as_slice();
        while !rest.is_empty() && purged < limit {
            let room = limit - purged;
            // At least one slot per wave; more while their keys fit in what is left.
            let mut take = 1;
            let mut n = rest[0].1.len() as u64;
            while take < rest.len() && n + rest[take].1.len() as u64 <= room {
                n += rest[take].1.len() as u64;
                take += 1;
            }
            let (wave, later) = rest.split_at(take);
            rest = later;
            let cmds: Vec<Cmd> = wave
                .iter()
                .map(|(_, ks)| {
                    let mut c = redis::cmd("EVALSHA");
                    c.arg(&lua::PURGE.sha).arg(ks.len());
                    for k in ks {
                        c.arg(*k);
                    }
                    c.arg(0).arg(room);
                    c
                })
                .collect();
            let slots: Vec<u16> = wave.iter().map(|w| w.0).collect();
            for v in self.eval_many(&lua::PURGE, &cmds, &slots, false).await? {
                purged += u64::try_from(Self::int(&v)?).unwrap_or(0);
            }
        }
        Ok(purged)
    }

    /// [`DedupStore::purge_expired`](idemq_core::DedupStore::purge_expired).
    pub(crate) async fn purge_scanned(&self, limit: usize) -> Result<u64, StoreError> {
        let limit = limit as u64;
        let mut purged = 0u64;
        let mut examined = 0usize;
        let nodes = self.scan_nodes().await?;
        let (mut node, mut cursor) = *self
            .purge_cursor
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if node >= nodes.len() {
            // The cluster shrank since the last call: start a new sweep.
            (node, cursor) = (0, 0);
        }
        while purged < limit && examined < self.cfg.purge_scan_budget {
            let (next, keys) = self.scan_chunk(nodes[node].as_ref(), cursor).await?;
            examined = examined.saturating_add(self.cfg.scan_count);
            if !keys.is_empty() {
                purged += self.purge_keys(&keys, limit - purged).await?;
            }
            if purged >= limit {
                // The script may have stopped inside this chunk: re-read it next time.
                break;
            }
            cursor = next;
            if next == 0 {
                node += 1;
                if node == nodes.len() {
                    node = 0;
                    break; // a sweep ended; the next call starts a new one
                }
            }
        }
        *self
            .purge_cursor
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = (node, cursor);
        tracing::debug!(purged, examined, prefix = %self.cfg.prefix, "purged expired redis records");
        Ok(purged)
    }

    /// [`DedupStore::list_stuck`](idemq_core::DedupStore::list_stuck).
    pub(crate) async fn scan_stuck(
        &self,
        stale_for: Duration,
        limit: usize,
    ) -> Result<Vec<DedupRecord>, StoreError> {
        // Leases end on the server's clock: ask it.
        let cutoff = self
            .server_now_ms()
            .await?
            .saturating_sub(duration_ms(stale_for));
        let mut found: Vec<DedupRecord> = Vec::new();
        let order = |a: &DedupRecord, b: &DedupRecord| {
            (a.lease_until_ms, &a.key).cmp(&(b.lease_until_ms, &b.key))
        };
        self.scan_records(|r| {
            if r.status == RecordStatus::InProgress && r.lease_until_ms <= cutoff {
                found.push(r);
                // Bounded memory on a large keyspace: keep the oldest `limit` as we go.
                if found.len() > limit.saturating_mul(2).max(1024) {
                    found.sort_by(order);
                    found.truncate(limit);
                }
            }
        })
        .await?;
        found.sort_by(order);
        found.truncate(limit);
        Ok(found)
    }

    /// [`DedupStore::stats`](idemq_core::DedupStore::stats).
    pub(crate) async fn scan_stats(&self) -> Result<StoreStats, StoreError> {
        let now = self.server_now_ms().await?;
        let mut stats = StoreStats::default();
        self.scan_records(|r| stats.count(&r, now)).await?;
        Ok(stats)
    }
}
