//! Redis Cluster support: the `redis+cluster://` URL, the connection, the master nodes and
//! the slots they serve.

use crate::errors::map_redis_error;
use idemq_core::StoreError;
use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::Value;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// The URL scheme of a Redis Cluster: `redis+cluster://host:port,host:port/`.
pub const CLUSTER_SCHEME: &str = "redis+cluster";

/// The number of hash slots of a Redis Cluster.
pub(crate) const SLOTS: u16 = 16384;

/// The slot Redis Cluster stores `key` in (CRC16 of the key, or of its `{hash tag}`).
pub fn key_slot(key: &[u8]) -> u16 {
    redis::cluster_routing::get_slot(key)
}

/// Whether `url` names a Redis Cluster (`redis+cluster://`).
pub(crate) fn is_cluster_url(url: &str) -> bool {
    url.split_once("://")
        .is_some_and(|(s, _)| s.eq_ignore_ascii_case(CLUSTER_SCHEME))
}

/// The seed node URLs (`redis://[user:password@]host:port/`, one per node) of a
/// `redis+cluster://[user:password@]host:port[,host:port...][/]` URL; a
/// [`StoreError::Config`] naming the expected form when it is malformed.
///
/// ```
/// let seeds = idemq_redis::cluster_seed_urls("redis+cluster://a:7000,b:7001/").unwrap();
/// assert_eq!(seeds, ["redis://a:7000/", "redis://b:7001/"]);
/// assert!(idemq_redis::cluster_seed_urls("redis+cluster://a/").is_err());
/// ```
pub fn cluster_seed_urls(url: &str) -> Result<Vec<String>, StoreError> {
    seed_urls(url, false)
}

/// The seed node URLs (`redis://[user:password@]host:port/`) of a cluster URL:
/// `redis+cluster://[user:password@]host:port[,host:port...][/]`, or with `plain_ok`, a
/// `redis://` URL whose host part may list several `host:port`.
pub(crate) fn seed_urls(url: &str, plain_ok: bool) -> Result<Vec<String>, StoreError> {
    let bad = |why: &str| {
        StoreError::Config(format!(
            "invalid Redis Cluster URL {url:?}: {why} (expected \
             redis+cluster://[user:password@]host:port,host:port/)"
        ))
    };
    let (scheme, rest) = url.split_once("://").ok_or_else(|| bad("no scheme"))?;
    let tls = if scheme.eq_ignore_ascii_case(CLUSTER_SCHEME)
        || (plain_ok && scheme.eq_ignore_ascii_case("redis"))
    {
        false
    } else if plain_ok && scheme.eq_ignore_ascii_case("rediss") {
        true
    } else {
        return Err(bad("the scheme must be redis+cluster://"));
    };
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    if !(path.is_empty() || path == "0") {
        return Err(bad(
            "a cluster has only database 0: leave the path empty or `/0`",
        ));
    }
    let (auth, hosts) = match authority.rsplit_once('@') {
        Some((a, h)) => (Some(a), h),
        None => (None, authority),
    };
    let mut out = Vec::new();
    for node in hosts.split(',') {
        let (host, port) = node
            .rsplit_once(':')
            .ok_or_else(|| bad(&format!("node {node:?} has no port")))?;
        if host.is_empty() || host.contains(['/', '@', '?', '#', ' ']) {
            return Err(bad(&format!("node {node:?} has no valid host")));
        }
        let port: u16 = port
            .parse()
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| bad(&format!("node {node:?} has no valid port")))?;
        let scheme = if tls { "rediss" } else { "redis" };
        let auth = auth.map(|a| format!("{a}@")).unwrap_or_default();
        out.push(format!("{scheme}://{auth}{host}:{port}/"));
    }
    Ok(out)
}

/// Refuses a seed node that is a standalone server: the cluster client's own error
/// (`CLUSTER SLOTS` refused) does not say what to fix.
async fn require_cluster_mode(
    seed: &str,
    connect_timeout: Duration,
    response_timeout: Duration,
) -> Result<(), StoreError> {
    let client = crate::errors::open_client(seed)?;
    crate::errors::probe(&client, seed, connect_timeout, response_timeout).await?;
    let cfg = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(connect_timeout)
        .set_response_timeout(response_timeout);
    let mut con = client
        .get_multiplexed_async_connection_with_config(&cfg)
        .await
        .map_err(|e| map_redis_error(&e))?;
    let info: String = redis::cmd("INFO")
        .arg("cluster")
        .query_async(&mut con)
        .await
        .map_err(|e| map_redis_error(&e))?;
    if info.lines().any(|l| l.trim() == "cluster_enabled:1") {
        Ok(())
    } else {
        Err(StoreError::Config(format!(
            "{seed} is a standalone Redis (cluster_enabled:0), not a Redis Cluster node: use \
             redis://host:port/ for a standalone server, or point redis+cluster:// at the \
             cluster's nodes"
        )))
    }
}

/// Connects to the cluster through the first seed that answers as a cluster node.
pub(crate) async fn connect(
    seeds: &[String],
    connect_timeout: Duration,
    response_timeout: Duration,
    retries: u32,
) -> Result<ClusterConnection, StoreError> {
    let mut last = None;
    for seed in seeds {
        match require_cluster_mode(seed, connect_timeout, response_timeout).await {
            Ok(()) => {
                last = None;
                break;
            }
            // A standalone server is a configuration error whatever the other seeds are.
            Err(e @ StoreError::Config(_)) if e.to_string().contains("cluster_enabled:0") => {
                return Err(e)
            }
            Err(e) => last = Some(e),
        }
    }
    if let Some(e) = last {
        return Err(e);
    }
    let client = ClusterClientBuilder::new(seeds.to_vec())
        .connection_timeout(connect_timeout)
        .response_timeout(response_timeout)
        .retries(retries)
        .min_retry_wait(50)
        .max_retry_wait(500)
        .build()
        .map_err(|e| StoreError::Config(format!("invalid Redis Cluster settings: {e}")))?;
    client
        .get_async_connection()
        .await
        .map_err(|e| map_redis_error(&e))
}

/// The cluster connection of a store, replaced by a fresh one when it stops answering.
///
/// The `redis` 0.27 cluster client was seen to hang every request for good after a master
/// was killed (`MOVED` to the dead node, then no answer even once the node was back): each
/// request here is bounded by `connect_timeout + response_timeout`, and a timeout or a
/// connection error has a new connection built from the seeds (at most once a second) in
/// the background. The failed request itself answers [`StoreError::Unavailable`]: no ack,
/// back off, retry.
///
/// Batches do not go through the cluster client's per-slot pipelines (one request per
/// slot: a batch of 64 keys without hash tags was 64 requests) but through a connection of
/// our own to each master, one pipeline per master, keyed by a slot map of our own; a key
/// answered `MOVED`/`ASK` there (not run) is sent again to the node named (after `ASKING`
/// for `ASK`), and the map is read again. (The cluster client was seen to hang on a
/// pipeline answered `MOVED` too, so it is not asked to follow them.)
pub(crate) struct ClusterHandle {
    conn: std::sync::RwLock<ClusterConnection>,
    seeds: Vec<String>,
    connect_timeout: Duration,
    response_timeout: Duration,
    retries: u32,
    /// When the last rebuild started (none yet: `None`).
    rebuilt: std::sync::Mutex<Option<std::time::Instant>>,
    /// The master of each slot as last read (`None`: unknown, use the cluster client).
    slot_map: std::sync::RwLock<Option<Arc<SlotMap>>>,
    /// When the slot map was last asked for.
    map_asked: std::sync::Mutex<Option<std::time::Instant>>,
    /// Our own connection to each master, by `host:port`.
    nodes: std::sync::Mutex<HashMap<String, MultiplexedConnection>>,
}

/// The master (`host:port`) of every slot.
pub(crate) struct SlotMap {
    masters: Vec<String>,
    of_slot: Vec<u16>,
}

impl SlotMap {
    fn new(masters: &[Master]) -> Self {
        let mut of_slot = vec![u16::MAX; usize::from(SLOTS)];
        for (i, m) in masters.iter().enumerate() {
            for &(a, b) in &m.ranges {
                for slot in a..=b.min(SLOTS - 1) {
                    of_slot[usize::from(slot)] = u16::try_from(i).unwrap_or(u16::MAX);
                }
            }
        }
        Self {
            masters: masters.iter().map(|m| m.to_string()).collect(),
            of_slot,
        }
    }

    /// The master serving `slot` (`None`: no master known for it).
    pub fn master_of(&self, slot: u16) -> Option<&str> {
        let i = *self.of_slot.get(usize::from(slot))?;
        self.masters.get(usize::from(i)).map(String::as_str)
    }
}

/// A reply saying the command was not run because of the cluster's topology (so it is
/// safe to send again).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Redirect {
    /// `MOVED <slot> <host:port>`: the slot lives there now.
    Moved(String),
    /// `ASK <slot> <host:port>`: this key is being migrated there; ask it after `ASKING`.
    Ask(String),
    /// `TRYAGAIN`, `CLUSTERDOWN`, or a redirection without an address: later.
    Later,
}

/// The redirection a reply is, if it is one.
pub(crate) fn redirect(v: &Value) -> Option<Redirect> {
    let Value::ServerError(e) = v else {
        return None;
    };
    let to = || {
        e.details()
            .and_then(|d| d.split_whitespace().nth(1))
            .map(str::to_owned)
    };
    match e.code() {
        "MOVED" => Some(to().map_or(Redirect::Later, Redirect::Moved)),
        "ASK" => Some(to().map_or(Redirect::Later, Redirect::Ask)),
        "TRYAGAIN" | "CLUSTERDOWN" => Some(Redirect::Later),
        _ => None,
    }
}

impl ClusterHandle {
    /// Connects (see [`connect`]).
    pub async fn open(
        seeds: Vec<String>,
        connect_timeout: Duration,
        response_timeout: Duration,
        retries: u32,
    ) -> Result<Self, StoreError> {
        let conn = connect(&seeds, connect_timeout, response_timeout, retries).await?;
        Ok(Self::wrap(
            conn,
            seeds,
            connect_timeout,
            response_timeout,
            retries,
        ))
    }

    /// An existing connection; without seeds it is never rebuilt.
    pub fn wrap(
        conn: ClusterConnection,
        seeds: Vec<String>,
        connect_timeout: Duration,
        response_timeout: Duration,
        retries: u32,
    ) -> Self {
        Self {
            conn: std::sync::RwLock::new(conn),
            seeds,
            connect_timeout,
            response_timeout,
            retries,
            rebuilt: std::sync::Mutex::new(None),
            slot_map: std::sync::RwLock::new(None),
            map_asked: std::sync::Mutex::new(None),
            nodes: std::sync::Mutex::new(HashMap::new()),
        }
    }

    /// The slot map, if known and if this handle may open connections of its own (it has
    /// seeds to take the credentials from).
    pub fn slot_map(&self) -> Option<Arc<SlotMap>> {
        if self.seeds.is_empty() {
            return None;
        }
        self.slot_map
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Reads the slot map now.
    pub async fn load_slot_map(self: &Arc<Self>) -> Result<(), StoreError> {
        let masters = masters(self).await?;
        *self
            .slot_map
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) =
            Some(Arc::new(SlotMap::new(&masters)));
        Ok(())
    }

    /// Reads the slot map again in the background (at most every 100 ms): a redirection
    /// or a lost node says it changed.
    pub fn refresh_slot_map(self: &Arc<Self>) {
        if self.seeds.is_empty() {
            return;
        }
        {
            let mut last = self
                .map_asked
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if last.is_some_and(|t| t.elapsed() < Duration::from_millis(100)) {
                return;
            }
            *last = Some(std::time::Instant::now());
        }
        let this = Arc::clone(self);
        tokio::spawn(async move {
            if let Err(e) = this.load_slot_map().await {
                tracing::debug!(error = %e, "cannot refresh the redis cluster slot map");
            }
        });
    }

    /// The URL of node `addr` (`host:port`) with the seeds' scheme and credentials.
    fn node_url(&self, addr: &str) -> Option<String> {
        let seed = self.seeds.first()?;
        let (scheme, rest) = seed.split_once("://")?;
        let auth = rest.rsplit_once('@').map_or("", |(a, _)| a);
        let at = if auth.is_empty() { "" } else { "@" };
        Some(format!("{scheme}://{auth}{at}{addr}/"))
    }

    /// Sends `pipe` (`count` commands) to the master `addr` on our own connection to it,
    /// within the time bound. A failed connection is dropped (the next call opens a new
    /// one) and the slot map is refreshed.
    pub async fn node_pipeline(
        self: &Arc<Self>,
        addr: &str,
        pipe: &redis::Pipeline,
        count: usize,
    ) -> redis::RedisResult<Vec<Value>> {
        let bound = self.connect_timeout + self.response_timeout;
        let attempt = async {
            let cached = self
                .nodes
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .get(addr)
                .cloned();
            let mut con = match cached {
                Some(c) => c,
                None => {
                    let url = self.node_url(addr).ok_or_else(|| {
                        redis::RedisError::from((
                            redis::ErrorKind::ClientError,
                            "no seed URL to connect to a cluster node with",
                        ))
                    })?;
                    let cfg = redis::AsyncConnectionConfig::new()
                        .set_connection_timeout(self.connect_timeout)
                        .set_response_timeout(self.response_timeout);
                    let c = redis::Client::open(url)?
                        .get_multiplexed_async_connection_with_config(&cfg)
                        .await?;
                    self.nodes
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .insert(addr.to_owned(), c.clone());
                    c
                }
            };
            con.req_packed_commands(pipe, 0, count).await
        };
        let res = match tokio::time::timeout(bound, attempt).await {
            Ok(r) => r,
            Err(_) => Err(redis::RedisError::from(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("redis cluster node {addr}: no answer within {bound:?}"),
            ))),
        };
        if res.is_err() {
            self.nodes
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .remove(addr);
            self.refresh_slot_map();
        }
        res
    }

    /// The current connection (cheap to clone).
    pub fn get(&self) -> ClusterConnection {
        self.conn
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Runs `request` on the current connection within the time bound; rebuilds the
    /// connection after a timeout or a connection-level error.
    pub async fn call<T, F>(
        self: &Arc<Self>,
        request: impl FnOnce(ClusterConnection) -> F,
    ) -> redis::RedisResult<T>
    where
        F: std::future::Future<Output = redis::RedisResult<T>>,
    {
        let bound = self.connect_timeout + self.response_timeout;
        match tokio::time::timeout(bound, request(self.get())).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => {
                if e.is_io_error()
                    || e.is_connection_dropped()
                    || e.is_connection_refusal()
                    || matches!(
                        e.kind(),
                        redis::ErrorKind::Moved | redis::ErrorKind::ClusterConnectionNotFound
                    )
                {
                    self.rebuild();
                }
                Err(e)
            }
            Err(_) => {
                self.rebuild();
                Err(redis::RedisError::from(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("redis cluster: no answer within {bound:?}"),
                )))
            }
        }
    }

    /// Builds a new connection in the background (at most once a second) and swaps it in.
    fn rebuild(self: &Arc<Self>) {
        if self.seeds.is_empty() {
            return;
        }
        {
            let mut last = self
                .rebuilt
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if last.is_some_and(|t| t.elapsed() < Duration::from_secs(1)) {
                return;
            }
            *last = Some(std::time::Instant::now());
        }
        let this = Arc::clone(self);
        tokio::spawn(async move {
            let fresh = connect(
                &this.seeds,
                this.connect_timeout,
                this.response_timeout,
                this.retries,
            );
            match tokio::time::timeout(this.connect_timeout * 4, fresh).await {
                Ok(Ok(conn)) => {
                    *this
                        .conn
                        .write()
                        .unwrap_or_else(std::sync::PoisonError::into_inner) = conn;
                    metrics::counter!("idemq_redis_cluster_reconnects_total").increment(1);
                    tracing::info!("redis cluster connection rebuilt");
                }
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "cannot rebuild the redis cluster connection")
                }
                Err(_) => tracing::warn!("rebuilding the redis cluster connection timed out"),
            }
        });
    }
}

/// One master node: its address and the slot ranges it serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Master {
    pub host: String,
    pub port: u16,
    pub ranges: Vec<(u16, u16)>,
}

impl Master {
    /// A route to this node for commands without keys (`SCAN`, `INFO`).
    pub fn routing(&self) -> RoutingInfo {
        RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
            host: self.host.clone(),
            port: self.port,
        })
    }
}

impl std::fmt::Display for Master {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.host, self.port)
    }
}

/// The masters and their slots, from `CLUSTER SLOTS`, ordered by their first slot.
pub(crate) async fn masters(handle: &Arc<ClusterHandle>) -> Result<Vec<Master>, StoreError> {
    let cmd = redis::cmd("CLUSTER").arg("SLOTS").clone();
    let v: Value = handle
        .call(|mut c| async move {
            c.route_command(&cmd, RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random))
                .await
        })
        .await
        .map_err(|e| map_redis_error(&e))?;
    parse_slots(&v)
}

fn parse_slots(v: &Value) -> Result<Vec<Master>, StoreError> {
    let bad = || StoreError::Backend(format!("unexpected CLUSTER SLOTS reply {v:?}"));
    let Value::Array(ranges) = v else {
        return Err(bad());
    };
    let mut out: Vec<Master> = Vec::new();
    for r in ranges {
        let Value::Array(r) = r else {
            return Err(bad());
        };
        let (Some(Value::Int(start)), Some(Value::Int(end)), Some(Value::Array(node))) =
            (r.first(), r.get(1), r.get(2))
        else {
            return Err(bad());
        };
        let (Some(host), Some(Value::Int(port))) = (node.first(), node.get(1)) else {
            return Err(bad());
        };
        let host = match host {
            Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
            Value::SimpleString(s) => s.clone(),
            _ => return Err(bad()),
        };
        let (Ok(start), Ok(end), Ok(port)) = (
            u16::try_from(*start),
            u16::try_from(*end),
            u16::try_from(*port),
        ) else {
            return Err(bad());
        };
        match out.iter_mut().find(|m| m.host == host && m.port == port) {
            Some(m) => m.ranges.push((start, end)),
            None => out.push(Master {
                host,
                port,
                ranges: vec![(start, end)],
            }),
        }
    }
    for m in &mut out {
        m.ranges.sort_unstable();
    }
    out.sort_by_key(|m| m.ranges.first().map_or(SLOTS, |r| r.0));
    Ok(out)
}

/// A hash tag whose keys land in `slot`: `<prefix>.incarnation{<tag>}` then lives on the
/// node serving that slot. Found by trying short tags (16384 slots: a few thousand CRCs).
pub(crate) fn tag_for_slot(slot: u16) -> String {
    (0u64..)
        .map(|i| format!("{i:x}"))
        .find(|t| key_slot(t.as_bytes()) == slot)
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_urls_become_seed_urls() {
        assert_eq!(
            seed_urls("redis+cluster://u:p@h1:7000,10.0.0.2:7001/", false).unwrap(),
            vec!["redis://u:p@h1:7000/", "redis://u:p@10.0.0.2:7001/"]
        );
        assert_eq!(
            seed_urls("redis+cluster://h:1", false).unwrap(),
            vec!["redis://h:1/"]
        );
        assert_eq!(
            seed_urls("redis://a:1,b:2/", true).unwrap(),
            vec!["redis://a:1/", "redis://b:2/"]
        );
    }

    #[test]
    fn malformed_cluster_urls_are_config_errors() {
        for bad in [
            "redis+cluster://",
            "redis+cluster://h",
            "redis+cluster://h:x",
            "redis+cluster://h:0",
            "redis+cluster://h:1,/",
            "redis+cluster://:1/",
            "redis+cluster://h:1/3",
            "redis+cluster//h:1",
            "redis://h:1/",
        ] {
            match seed_urls(bad, false) {
                Err(StoreError::Config(m)) => assert!(m.contains("redis+cluster://"), "{m}"),
                other => panic!("{bad:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn tags_land_in_their_slot() {
        for slot in [0, 1, 5460, 5461, 10922, 16383] {
            let tag = tag_for_slot(slot);
            assert_eq!(key_slot(format!("p.incarnation{{{tag}}}").as_bytes()), slot);
        }
    }

    #[test]
    fn slots_are_grouped_per_master() {
        let node = |p: i64| {
            Value::Array(vec![
                Value::BulkString(b"127.0.0.1".to_vec()),
                Value::Int(p),
                Value::BulkString(b"id".to_vec()),
            ])
        };
        let v = Value::Array(vec![
            Value::Array(vec![Value::Int(5461), Value::Int(10922), node(2)]),
            Value::Array(vec![Value::Int(0), Value::Int(5460), node(1)]),
            Value::Array(vec![Value::Int(10923), Value::Int(16383), node(1)]),
        ]);
        let m = parse_slots(&v).unwrap();
        assert_eq!(m.len(), 2);
        assert_eq!(
            (m[0].port, m[0].ranges.clone()),
            (1, vec![(0, 5460), (10923, 16383)])
        );
        assert_eq!(m[1].port, 2);
        assert!(parse_slots(&Value::Nil).is_err());
    }
}
