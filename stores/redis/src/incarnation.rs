//! The incarnation marker: how a store sees that its dataset was lost.

use crate::conn::StoreConn;
use crate::errors::store_err;
use idemq_core::{FencingToken, StoreError};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// Writes the incarnation marker unless it exists; answers the marker's value.
const ENSURE_MARKER: &str = r#"
local v = redis.call('GET', KEYS[1])
if v then return v end
redis.call('SET', KEYS[1], ARGV[1])
return ARGV[1]
"#;

/// The store's incarnation marker: a key holding a random id, written when the first store
/// on a dataset connects. A dataset that lost it (a restart without persistence, a failover
/// to a replica that never had it, a `FLUSHALL`, an eviction) lost acknowledged claims and
/// completions too.
///
/// On a Redis Cluster there is one marker per master (a key whose hash tag puts it in a
/// slot of that master), so a master whose dataset is lost is seen whichever it is.
pub(crate) struct Incarnation {
    pub(crate) conn: StoreConn,
    pub(crate) markers: Vec<Marker>,
    pub(crate) lost: AtomicBool,
}

/// One incarnation marker key and the id last read from it.
pub(crate) struct Marker {
    pub(crate) key: String,
    pub(crate) id: Mutex<String>,
}

/// Writes the marker `key` unless it exists; answers its id.
pub(crate) async fn ensure_marker(conn: &StoreConn, key: &str) -> Result<String, StoreError> {
    let mut con = conn.clone();
    redis::Script::new(ENSURE_MARKER)
        .key(key)
        .arg(FencingToken::random().to_string())
        .invoke_async(&mut con)
        .await
        .map_err(store_err)
}

impl Incarnation {
    /// Checks every marker; on a loss records it (sticky flag, metric, error log) and adopts
    /// the new marker, so the next loss is seen too. Answers whether one was lost.
    pub(crate) async fn check(&self) -> Result<bool, StoreError> {
        let mut any = false;
        for m in &self.markers {
            let now = ensure_marker(&self.conn, &m.key).await?;
            let mut id =
                m.id.lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
            if *id == now {
                continue;
            }
            metrics::counter!("idemq_redis_incarnation_lost_total").increment(1);
            tracing::error!(
                marker = %m.key,
                "redis dataset lost: the dedup store's incarnation marker is missing or \
                 replaced; claims and completions acknowledged before may be gone, and their \
                 messages may run again"
            );
            *id = now;
            self.lost.store(true, Ordering::Release);
            any = true;
        }
        Ok(any)
    }

    pub(crate) fn lost_error(&self) -> StoreError {
        let keys: Vec<&str> = self.markers.iter().map(|m| m.key.as_str()).collect();
        StoreError::Backend(format!(
            "redis dataset lost: an incarnation marker ({}) disappeared or changed (a restart \
             without persistence, a failover to a replica behind, a FLUSHALL, an eviction); \
             claims and completions acknowledged before may be gone",
            keys.join(", ")
        ))
    }
}
