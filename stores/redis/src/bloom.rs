//! [`RedisBloomFilter`]: a shared never-seen-only pre-filter on the RedisBloom module.

use crate::builder::validate_prefix;
use crate::errors::map_redis_error;
use async_trait::async_trait;
use idemq_core::{DedupKey, FencingToken, StoreError};
use idemq_layered::{Novelty, PreFilter};
use redis::aio::ConnectionManager;
use redis::Value;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Items per script call (Lua's `unpack` has a bounded stack).
const CHUNK: usize = 1000;

/// Creates the filter once and records its incarnation next to it.
const OPEN: &str = r#"
local inc = redis.call('GET', KEYS[2])
local exists = redis.call('EXISTS', KEYS[1]) == 1
if inc then
  if exists then return inc end
  return redis.error_reply('IDEMQ_FILTER_LOST filter data is gone but its incarnation marker remains')
end
if not exists then redis.call('BF.RESERVE', KEYS[1], ARGV[1], ARGV[2]) end
redis.call('SET', KEYS[2], ARGV[3])
return ARGV[3]
"#;

/// `BF.MEXISTS` / `BF.MADD` guarded by the incarnation, so a filter wiped by a restart
/// (which `BF.MEXISTS` would report as "nothing seen") is an error, never "never seen".
const GUARDED: &str = r#"
if redis.call('GET', KEYS[2]) ~= ARGV[1] or redis.call('EXISTS', KEYS[1]) == 0 then
  return redis.error_reply('IDEMQ_FILTER_RESET the filter was recreated or lost since it was opened')
end
return redis.call(ARGV[2], KEYS[1], unpack(ARGV, 3))
"#;

/// The server's `run_id` from an `INFO server` reply (a new one on every start of a server
/// process, and another server's after a failover).
pub(crate) fn run_id(info: &str) -> Option<&str> {
    info.lines()
        .find_map(|l| l.strip_prefix("run_id:"))
        .map(str::trim)
        .filter(|v| !v.is_empty())
}

async fn server_run_id(conn: &ConnectionManager) -> Result<String, StoreError> {
    let mut con = conn.clone();
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut con)
        .await
        .map_err(|e| map_redis_error(&e))?;
    run_id(&info)
        .map(str::to_owned)
        .ok_or_else(|| StoreError::Backend("INFO server has no run_id".into()))
}

/// Refuses a Redis Cluster node: the filter is one key on one server, and its restart
/// detection compares one server's `run_id`.
async fn require_standalone(conn: &ConnectionManager) -> Result<(), StoreError> {
    let mut con = conn.clone();
    let info: String = redis::cmd("INFO")
        .arg("cluster")
        .query_async(&mut con)
        .await
        .map_err(|e| map_redis_error(&e))?;
    if info.lines().any(|l| l.trim() == "cluster_enabled:1") {
        return Err(StoreError::Config(
            "RedisBloomFilter is standalone-only: this server is a Redis Cluster node; \
             open the filter on a standalone Redis (or use idemq_layered::LocalBloom)"
                .into(),
        ));
    }
    Ok(())
}

/// Whether the server has the RedisBloom module loaded (`MODULE LIST` names `bf`).
pub async fn redisbloom_loaded(conn: &ConnectionManager) -> Result<bool, StoreError> {
    let mut con = conn.clone();
    let v: Value = redis::cmd("MODULE")
        .arg("LIST")
        .query_async(&mut con)
        .await
        .map_err(|e| map_redis_error(&e))?;
    fn text(v: &Value) -> Option<String> {
        match v {
            Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
            Value::SimpleString(s) => Some(s.clone()),
            _ => None,
        }
    }
    let modules = match v {
        Value::Array(m) | Value::Set(m) => m,
        _ => return Ok(false),
    };
    for m in modules {
        let pairs: Vec<(Value, Value)> = match m {
            Value::Array(kv) => kv
                .chunks(2)
                .filter_map(|c| match c {
                    [k, v] => Some((k.clone(), v.clone())),
                    _ => None,
                })
                .collect(),
            Value::Map(kv) => kv,
            _ => continue,
        };
        for (k, v) in pairs {
            if text(&k).as_deref() == Some("name")
                && matches!(text(&v).as_deref(), Some("bf" | "bloom" | "ReBloom"))
            {
                return Ok(true);
            }
        }
    }
    Ok(false)
}

/// A bloom filter shared by every worker, kept in Redis by the RedisBloom module
/// (`BF.RESERVE`, `BF.MADD`, `BF.MEXISTS`). Implements
/// [`PreFilter`]: it can only prove that a key was *never* inserted.
///
/// [`RedisBloomFilter::open`] refuses a server without the module (detected with
/// `MODULE LIST`). Next to the filter it keeps an incarnation marker; every call checks it,
/// so a filter lost in a restart (`BF.MEXISTS` on a missing filter says "absent" for
/// everything) fails instead of calling every key new. A filter only covers keys inserted
/// since it was created: create it no later than the records of the store it guards.
///
/// For gating a fallback ([`FallbackGate::NeverSeenKeys`](idemq_layered::FallbackGate)),
/// put the filter on a different server than the primary store: if both are down
/// together, every key counts as "maybe seen" and nothing goes to the fallback.
///
/// **Restarts.** A filter that survived a restart may still be *older* than the keys it
/// was given: restored from a snapshot, or an AOF written with `appendfsync everysec` that
/// lost its last second in a crash. It would then answer "never seen" for keys it has
/// seen, and the incarnation marker, restored with it, cannot tell. So the filter records
/// the server's `run_id` when it opens and sends `INFO server` in the same pipeline as
/// every call: once another server process answers (a restart, a failover), every call
/// fails with [`StoreError::Backend`] (`IDEMQ_FILTER_RESTARTED`), which a
/// [`LayeredStore`](idemq_layered::LayeredStore) takes as "stop trusting the filter". To
/// use a filter again after a restart, open a new one (a new name, or delete the old one
/// and its marker): it covers keys inserted from then on.
#[derive(Clone)]
pub struct RedisBloomFilter {
    conn: ConnectionManager,
    filter_key: String,
    marker_key: String,
    incarnation: String,
    run_id: String,
    restarted: Arc<AtomicBool>,
}

impl std::fmt::Debug for RedisBloomFilter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisBloomFilter")
            .field("filter_key", &self.filter_key)
            .field("incarnation", &self.incarnation)
            .finish_non_exhaustive()
    }
}

impl RedisBloomFilter {
    /// Opens (creating if needed) the filter `name` (same character rules as a key
    /// prefix), sized for `capacity` items at `error_rate` (RedisBloom scales it beyond).
    ///
    /// Errors: [`StoreError::Config`] on a Redis Cluster node (standalone-only), if the
    /// server lacks RedisBloom or the arguments are
    /// invalid; [`StoreError::Backend`] if the filter's data was lost while its marker
    /// remains (delete `{name}:incarnation` to start a new filter knowingly).
    pub async fn open(
        conn: ConnectionManager,
        name: &str,
        capacity: u64,
        error_rate: f64,
    ) -> Result<Self, StoreError> {
        validate_prefix(name)?;
        if !(error_rate > 0.0 && error_rate < 1.0) || capacity == 0 {
            return Err(StoreError::Config(format!(
                "bloom filter needs 0 < error_rate < 1 and capacity > 0 (got {error_rate}, {capacity})"
            )));
        }
        require_standalone(&conn).await?;
        if !redisbloom_loaded(&conn).await? {
            return Err(StoreError::Config(
                "the Redis server has no RedisBloom module (MODULE LIST has no `bf`): \
                 load redisbloom.so or use idemq_layered::LocalBloom"
                    .into(),
            ));
        }
        let filter_key = format!("{{{name}}}:bf");
        let marker_key = format!("{{{name}}}:incarnation");
        let mut con = conn.clone();
        let incarnation: String = redis::Script::new(OPEN)
            .key(&filter_key)
            .key(&marker_key)
            .arg(error_rate)
            .arg(capacity)
            .arg(FencingToken::random().to_string())
            .invoke_async(&mut con)
            .await
            .map_err(|e| map_redis_error(&e))?;
        let run_id = server_run_id(&conn).await?;
        tracing::debug!(filter = %filter_key, %incarnation, %run_id, "redisbloom filter opened");
        Ok(Self {
            conn,
            filter_key,
            marker_key,
            incarnation,
            run_id,
            restarted: Arc::new(AtomicBool::new(false)),
        })
    }

    /// Whether a server other than the one the filter was opened on has answered (a
    /// restart or a failover): every call fails from then on.
    pub fn restart_seen(&self) -> bool {
        self.restarted.load(Ordering::Acquire)
    }

    fn restart_error(&self) -> StoreError {
        StoreError::Backend(format!(
            "IDEMQ_FILTER_RESTARTED the Redis server of filter {} restarted or failed over \
             since the filter was opened: it may have been rolled back and can no longer \
             prove that a key was never seen",
            self.filter_key
        ))
    }

    /// The Redis key of the filter.
    pub fn filter_key(&self) -> &str {
        &self.filter_key
    }

    async fn guarded(&self, command: &str, keys: &[DedupKey]) -> Result<Vec<Novelty>, StoreError> {
        if self.restart_seen() {
            return Err(self.restart_error());
        }
        let mut out = Vec::with_capacity(keys.len());
        let mut con = self.conn.clone();
        // BF.MADD: 1 = newly added (was absent). BF.MEXISTS: 1 = maybe present.
        let added_means_new = command == "BF.MADD";
        for chunk in keys.chunks(CHUNK) {
            // `INFO server` in the same pipeline, on the same connection: both replies come
            // from one server process, whose `run_id` must be the one the filter opened on.
            let mut pipe = redis::pipe();
            let eval = pipe
                .cmd("EVAL")
                .arg(GUARDED)
                .arg(2)
                .arg(&self.filter_key)
                .arg(&self.marker_key)
                .arg(&self.incarnation)
                .arg(command);
            for k in chunk {
                eval.arg(k.as_str());
            }
            pipe.cmd("INFO").arg("server");
            let (bits, info): (Vec<i64>, String) = pipe
                .query_async(&mut con)
                .await
                .map_err(|e| map_redis_error(&e))?;
            if run_id(&info) != Some(self.run_id.as_str()) {
                if !self.restarted.swap(true, Ordering::AcqRel) {
                    tracing::error!(
                        filter = %self.filter_key,
                        "redisbloom filter's server restarted or failed over: the filter is no longer trusted"
                    );
                }
                return Err(self.restart_error());
            }
            if bits.len() != chunk.len() {
                return Err(StoreError::Backend(format!(
                    "{command} answered {} items for {}",
                    bits.len(),
                    chunk.len()
                )));
            }
            out.extend(bits.into_iter().map(|b| match (added_means_new, b) {
                (true, 1) | (false, 0) => Novelty::NeverSeen,
                _ => Novelty::MaybeSeen,
            }));
        }
        Ok(out)
    }
}

#[async_trait]
impl PreFilter for RedisBloomFilter {
    async fn insert(&self, keys: &[DedupKey]) -> Result<Vec<Novelty>, StoreError> {
        self.guarded("BF.MADD", keys).await
    }

    async fn check(&self, keys: &[DedupKey]) -> Result<Vec<Novelty>, StoreError> {
        self.guarded("BF.MEXISTS", keys).await
    }

    fn describe(&self) -> String {
        format!("redisbloom {}", self.filter_key)
    }
}
