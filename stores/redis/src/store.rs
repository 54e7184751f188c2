//! [`RedisStore`]: the claim contract as Lua scripts over one Redis string per key.
//!
//! This file holds the store, its accessors and its [`DedupStore`] impl; the work is in
//! `builder` (settings, connecting), `pipeline` (sending, replies, slots), `claim`,
//! `complete` and `scan`.

use crate::codec::decode_record;
use crate::conn::StoreConn;
use crate::errors::store_err;
use crate::incarnation::Incarnation;
use crate::lua;
use async_trait::async_trait;
use idemq_core::store::duration_ms;
use idemq_core::{
    ClaimOutcome, ClaimRequest, CompleteOutcome, Completion, DedupKey, DedupRecord, DedupStore,
    ExtendOutcome, FencingToken, ReleaseOutcome, RollbackOutcome, StoreError, StoreStats,
};
use redis::aio::ConnectionManager;
use redis::cluster_async::ClusterConnection;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Longest duration passed to Redis (1000 years): keeps every timestamp exact in Lua's
/// doubles and far from `i64` overflow.
const MAX_MS: i64 = 1000 * 365 * 24 * 3600 * 1000;

pub(crate) fn clamp_ms(d: Duration) -> i64 {
    duration_ms(d).clamp(0, MAX_MS)
}

#[derive(Debug)]
pub(crate) struct Settings {
    pub(crate) prefix: String,
    pub(crate) pattern: String,
    pub(crate) hash_tag: bool,
    pub(crate) in_progress_grace_ms: i64,
    pub(crate) completed_grace_ms: i64,
    pub(crate) max_keys_per_script: usize,
    pub(crate) scan_count: usize,
    pub(crate) purge_scan_budget: usize,
    pub(crate) wait_replicas: Option<(u32, i64)>,
}

/// A [`DedupStore`] on Redis: each record is one string at `<prefix>:<dedup key>` (or
/// `<prefix>:{<group>}:<key>` with [hash tags](crate::RedisStoreBuilder::hash_tag)). A record is
/// only ever created by `SET NX` and only ever changed by a Lua script, so every
/// read-decide-write is atomic.
///
/// - **claim** (batch = one round trip): one claim script call per batch (per hash-tag
///   group), which applies [`idemq_core::evaluate_claim`]'s rules atomically in Lua at the
///   server's `TIME`: `SET NX` for new keys, takeover of an ended lease (attempt + 1), a
///   fresh lifecycle after retention, else duplicate / in flight / conflict. With the opt-in
///   [`fast_claims(true)`](crate::RedisStoreBuilder::fast_claims) on Redis >= 7.0, a pipelined
///   `SET key record NX GET PX ttl` per key answers first (nil = acquired fresh; an existing
///   record is judged by `evaluate_claim` locally) and only rewrites go through the script.
/// - **complete**: compare-token-and-set, idempotent for the owning token, else `Fenced`;
///   **release**: compare-token, lease set to 0; **extend**: compare-token, new lease.
///   Batches are one script call per group with hash tags, in one pipeline.
/// - **TTL**: an in-progress key lives `lease + in_progress_grace`, a completed key
///   `retention + completed_grace`. Claims go by the stored timestamps, so a completed key
///   is claimable afresh exactly when its retention ends; the grace only keeps it around
///   for `get` / `purge_expired`. Redis deletes it by itself afterwards, so purging is
///   optional on Redis.
/// - **time**: milliseconds since the epoch on the **server's clock**: every script reads
///   `TIME` itself, so consumers whose clocks disagree (by an hour, say) still agree on who
///   holds a lease, and lease ends ([`Lease::until_ms`](idemq_core::Lease)) are server
///   times. The opt-in fast path is the exception: it writes fresh leases by this process's
///   clock (see [`RedisStoreBuilder::fast_claims`](crate::RedisStoreBuilder::fast_claims)).
/// - **errors**: connection refused, IO and timeouts are [`StoreError::Unavailable`]; the
///   [`ConnectionManager`] reconnects in the background after a restart, and scripts are
///   reloaded after `NOSCRIPT`. A reply lost in a crash can leave a claim made and
///   unanswered: the key then answers `InFlight` until its lease ends and is taken over —
///   late, never lost, never doubled.
/// - **durability**: as durable as the server's persistence. Without AOF a restart forgets
///   leases and completed records; with `appendfsync everysec` a crash (not a shutdown) can
///   lose the last second of completions, whose messages may then run again; use
///   `appendfsync always` where that matters. Run with `maxmemory-policy noeviction`.
/// - **scope**: one standalone Redis (or a proxy), or a Redis Cluster
///   (`redis+cluster://host:port,host:port/`): commands go to the master of their key's
///   slot, a batch as one pipeline per slot (all slots at once), every script call keeps its
///   keys in one slot, `purge_expired` and `list_stuck` scan every master, and the
///   incarnation marker is kept on every master. With
///   [`wait_replicas`](crate::RedisStoreBuilder::wait_replicas) durable writes wait for replicas.
///
/// ```no_run
/// # async fn demo() -> Result<(), idemq_core::StoreError> {
/// use idemq_redis::RedisStore;
/// let store = RedisStore::builder("redis://127.0.0.1:6379/")
///     .prefix("payments")
///     .hash_tag(true)
///     .connect()
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisStore {
    pub(crate) conn: StoreConn,
    pub(crate) cfg: Arc<Settings>,
    pub(crate) fast_claims: bool,
    /// Where the next `purge_expired` resumes its `SCAN`: the position of the node among
    /// the masters (0 on a standalone server) and the node's cursor.
    pub(crate) purge_cursor: Arc<Mutex<(usize, u64)>>,
    pub(crate) incarnation: Arc<Incarnation>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.cfg.prefix)
            .field("hash_tag", &self.cfg.hash_tag)
            .field("fast_claims", &self.fast_claims)
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// The server's clock (`TIME`), in milliseconds since the Unix epoch: the clock leases
    /// are decided on.
    pub(crate) async fn server_now_ms(&self) -> Result<i64, StoreError> {
        let (secs, micros): (i64, i64) = self.conn.query_one(&redis::cmd("TIME")).await?;
        Ok(secs.saturating_mul(1000).saturating_add(micros / 1000))
    }

    /// Whether fresh claims use the `SET NX GET` fast path (see
    /// [`RedisStoreBuilder::fast_claims`](crate::RedisStoreBuilder::fast_claims)).
    pub fn fast_claims(&self) -> bool {
        self.fast_claims
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.cfg.prefix
    }

    /// The Redis key of the store's (first) incarnation marker (`<prefix>.incarnation`;
    /// on a cluster `<prefix>.incarnation{<tag>}`, one per master: see
    /// [`RedisStore::incarnation_keys`]).
    pub fn incarnation_key(&self) -> &str {
        self.incarnation
            .markers
            .first()
            .map_or("", |m| m.key.as_str())
    }

    /// The Redis keys of the store's incarnation markers: one on a standalone server, one
    /// per master (as the cluster was when the store connected) on a Redis Cluster.
    pub fn incarnation_keys(&self) -> Vec<&str> {
        self.incarnation
            .markers
            .iter()
            .map(|m| m.key.as_str())
            .collect()
    }

    /// Whether the store runs on a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        matches!(self.conn, StoreConn::Cluster(_))
    }

    /// The replicas every durable write waits for, and how long (see
    /// [`RedisStoreBuilder::wait_replicas`](crate::RedisStoreBuilder::wait_replicas)).
    pub fn wait_replicas(&self) -> Option<(u32, Duration)> {
        self.cfg
            .wait_replicas
            .map(|(n, t)| (n, Duration::from_millis(u64::try_from(t).unwrap_or(0))))
    }

    /// Whether the store has seen its dataset lost (its incarnation marker gone or
    /// replaced) since it connected or since [`RedisStore::acknowledge_data_loss`]: claims
    /// and completions acknowledged before may be gone, so messages may run again. Checked
    /// in the background every
    /// [`RedisStoreOptions::incarnation_check_interval`](crate::RedisStoreOptions::incarnation_check_interval)
    /// and by [`RedisStore::check_incarnation`]; each loss also counts
    /// `idemq_redis_incarnation_lost_total` and logs an error.
    pub fn incarnation_lost(&self) -> bool {
        self.incarnation.lost.load(Ordering::Acquire)
    }

    /// Checks the incarnation marker now. `Ok(())` while the dataset is the one the store
    /// connected to; a [`StoreError::Backend`] naming the marker once it was lost (and
    /// until [`RedisStore::acknowledge_data_loss`]); [`StoreError::Unavailable`] when Redis
    /// cannot be asked.
    pub async fn check_incarnation(&self) -> Result<(), StoreError> {
        self.incarnation.check().await?;
        if self.incarnation_lost() {
            return Err(self.incarnation.lost_error());
        }
        Ok(())
    }

    /// Clears the [`RedisStore::incarnation_lost`] state (an operator has dealt with the
    /// loss); the marker written after the loss is the store's incarnation from now on.
    pub fn acknowledge_data_loss(&self) {
        self.incarnation.lost.store(false, Ordering::Release);
    }

    /// The connection (cheap to clone; shares the socket), e.g. for a
    /// [`RedisBloomFilter`](crate::RedisBloomFilter) on the same server. A
    /// [`StoreError::Config`] on a Redis Cluster, which has no single connection (see
    /// [`RedisStore::cluster_connection`]); the bloom filter is standalone-only.
    pub fn connection(&self) -> Result<ConnectionManager, StoreError> {
        match &self.conn {
            StoreConn::Single(c) => Ok(c.clone()),
            StoreConn::Cluster(_) => Err(StoreError::Config(
                "this RedisStore is on a Redis Cluster: it has no single-server connection \
                 (use cluster_connection()), and RedisBloomFilter is standalone-only"
                    .into(),
            )),
        }
    }

    /// The Redis Cluster connection (cheap to clone), or `None` on a standalone server.
    pub fn cluster_connection(&self) -> Option<ClusterConnection> {
        match &self.conn {
            StoreConn::Cluster(h) => Some(h.get()),
            StoreConn::Single(_) => None,
        }
    }

    /// The Redis key holding `key`'s record.
    pub fn redis_key(&self, key: &DedupKey) -> String {
        let mut out = Vec::with_capacity(self.cfg.prefix.len() + key.as_str().len() + 3);
        self.write_redis_key(&mut out, key);
        // Prefix and key are UTF-8, and only ASCII is added.
        String::from_utf8(out)
            .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
    }

    pub(crate) fn write_redis_key(&self, out: &mut Vec<u8>, key: &DedupKey) {
        out.extend_from_slice(self.cfg.prefix.as_bytes());
        out.push(b':');
        if self.cfg.hash_tag {
            if let Some((group, rest)) = key.as_str().split_once(':') {
                out.push(b'{');
                out.extend_from_slice(group.as_bytes());
                out.extend_from_slice(b"}:");
                out.extend_from_slice(rest.as_bytes());
                return;
            }
        }
        out.extend_from_slice(key.as_str().as_bytes());
    }

    /// The dedup key stored at a Redis key of this store's keyspace.
    pub fn dedup_key_of(&self, redis_key: &[u8]) -> Option<DedupKey> {
        let s = std::str::from_utf8(redis_key).ok()?;
        let rest = s
            .strip_prefix(self.cfg.prefix.as_str())?
            .strip_prefix(':')?;
        if self.cfg.hash_tag {
            if let Some(tagged) = rest.strip_prefix('{') {
                if let Some((group, key)) = tagged.split_once("}:") {
                    return Some(DedupKey::from_stored(format!("{group}:{key}")));
                }
            }
        }
        Some(DedupKey::from_stored(rest))
    }

    /// Releases `key` if `token` holds it; `unrun` takes back the attempt its claim counted.
    async fn give_back(
        &self,
        key: &DedupKey,
        token: FencingToken,
        unrun: bool,
    ) -> Result<ReleaseOutcome, StoreError> {
        let rk = self.redis_key(key);
        let mut c = redis::cmd("EVALSHA");
        c.arg(&lua::RELEASE.sha)
            .arg(1)
            .arg(&rk)
            .arg(0)
            .arg(token.0)
            .arg(self.cfg.in_progress_grace_ms)
            .arg(if unrun { "1" } else { "0" });
        // Not waited for: a release lost in a failover only delays the key to its lease end.
        let v = self
            .eval_many(
                &lua::RELEASE,
                std::slice::from_ref(&c),
                &[self.slot_of(rk.as_bytes())],
                false,
            )
            .await?;
        match v.first().map(Self::int).transpose()? {
            Some(1) => Ok(ReleaseOutcome::Released),
            Some(0) => Ok(ReleaseOutcome::Fenced),
            _ => Err(Self::corrupt(key, "not an idemq record")),
        }
    }
}

#[async_trait]
impl DedupStore for RedisStore {
    async fn claim_batch(&self, reqs: &[ClaimRequest]) -> Result<Vec<ClaimOutcome>, StoreError> {
        self.claim_all(reqs).await
    }

    async fn complete_batch(
        &self,
        items: &[Completion],
    ) -> Result<Vec<CompleteOutcome>, StoreError> {
        self.complete_all(items).await
    }

    async fn release(
        &self,
        key: &DedupKey,
        token: FencingToken,
    ) -> Result<ReleaseOutcome, StoreError> {
        self.give_back(key, token, false).await
    }

    async fn release_unrun(
        &self,
        key: &DedupKey,
        token: FencingToken,
    ) -> Result<ReleaseOutcome, StoreError> {
        self.give_back(key, token, true).await
    }

    async fn roll_back(
        &self,
        key: &DedupKey,
        token: FencingToken,
        retention: Duration,
    ) -> Result<RollbackOutcome, StoreError> {
        let rk = self.redis_key(key);
        let mut c = redis::cmd("EVALSHA");
        c.arg(&lua::ROLL_BACK.sha)
            .arg(1)
            .arg(&rk)
            .arg(0)
            .arg(token.0)
            .arg(duration_ms(retention))
            .arg(self.cfg.completed_grace_ms);
        // Waited for, as a completion is: a roll-back lost in a failover would let a late
        // claim apply the effect of a dropped message.
        let v = self
            .eval_many(
                &lua::ROLL_BACK,
                std::slice::from_ref(&c),
                &[self.slot_of(rk.as_bytes())],
                true,
            )
            .await?;
        match v.first().map(Self::int).transpose()? {
            Some(1) => Ok(RollbackOutcome::RolledBack),
            Some(0) => Ok(RollbackOutcome::Fenced),
            _ => Err(Self::corrupt(key, "not an idemq record")),
        }
    }

    async fn extend(
        &self,
        key: &DedupKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<ExtendOutcome, StoreError> {
        let mut out = self.extend_batch(&[(key.clone(), token)], lease).await?;
        out.pop()
            .ok_or_else(|| Self::corrupt(key, "no answer to extend"))
    }

    /// One pipelined round trip per master for the whole batch (the heartbeat's call).
    async fn extend_batch(
        &self,
        leases: &[(DedupKey, FencingToken)],
        lease: Duration,
    ) -> Result<Vec<ExtendOutcome>, StoreError> {
        let mut cmds = Vec::with_capacity(leases.len());
        let mut slots = Vec::with_capacity(leases.len());
        for (key, token) in leases {
            let rk = self.redis_key(key);
            let mut c = redis::cmd("EVALSHA");
            c.arg(&lua::EXTEND.sha)
                .arg(1)
                .arg(&rk)
                .arg(0)
                .arg(token.0)
                .arg(clamp_ms(lease))
                .arg(self.cfg.in_progress_grace_ms);
            slots.push(self.slot_of(rk.as_bytes()));
            cmds.push(c);
        }
        // Waited for: an extension lost in a failover would let another worker take the
        // key over while this one still works on it.
        let vals = self.eval_many(&lua::EXTEND, &cmds, &slots, true).await?;
        if vals.len() != leases.len() {
            return Err(StoreError::Backend(format!(
                "extend_batch: {} answers for {} leases",
                vals.len(),
                leases.len()
            )));
        }
        vals.iter()
            .zip(leases)
            .map(|(v, (key, _))| match Self::int(v)? {
                0 => Ok(ExtendOutcome::Fenced),
                until_ms if until_ms > 0 => Ok(ExtendOutcome::Extended { until_ms }),
                _ => Err(Self::corrupt(key, "not an idemq record")),
            })
            .collect()
    }

    async fn get(&self, key: &DedupKey) -> Result<Option<DedupRecord>, StoreError> {
        let mut con = self.conn.clone();
        let v: Option<Vec<u8>> = redis::cmd("GET")
            .arg(self.redis_key(key))
            .query_async(&mut con)
            .await
            .map_err(store_err)?;
        v.map(|b| decode_record(key.clone(), &b).map_err(|e| Self::corrupt(key, e)))
            .transpose()
    }

    /// Redis drops expired records by itself (TTL = retention + completed grace); this
    /// deletes the ones still inside their grace. Bounded: a call stops after `limit`
    /// deletions, at the end of a sweep, or after `purge_scan_budget` slots, and the next
    /// call resumes the `SCAN` where it stopped (re-reading a chunk cut short by `limit`).
    /// 0 from a call that ran a whole sweep means nothing expired was left.
    async fn purge_expired(&self, limit: usize) -> Result<u64, StoreError> {
        self.purge_scanned(limit).await
    }

    async fn list_stuck(
        &self,
        stale_for: Duration,
        limit: usize,
    ) -> Result<Vec<DedupRecord>, StoreError> {
        self.scan_stuck(stale_for, limit).await
    }

    async fn stats(&self) -> Result<StoreStats, StoreError> {
        self.scan_stats().await
    }

    async fn forget(&self, key: &DedupKey) -> Result<bool, StoreError> {
        let mut con = self.conn.clone();
        let n: i64 = redis::cmd("DEL")
            .arg(self.redis_key(key))
            .query_async(&mut con)
            .await
            .map_err(store_err)?;
        Ok(n > 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_are_clamped_to_exact_lua_numbers() {
        assert_eq!(clamp_ms(Duration::MAX), MAX_MS);
        assert!((MAX_MS as f64 + 2e12) < 9.007e15, "fits a double exactly");
        assert_eq!(clamp_ms(Duration::from_millis(5)), 5);
    }
}
