//! [`RedisStore`]: the claim contract as Lua scripts over one Redis string per key.

use crate::cluster::{self, ClusterHandle, Master};
use crate::codec::{claim_identity, decode_record, result_field, write_identity};
use crate::lua::{self, Lua};
use async_trait::async_trait;
use bytes::Bytes;
use idemq_core::store::{check_distinct_keys, duration_ms};
use idemq_core::{
    evaluate_claim_request, now_ms, ClaimOutcome, ClaimRequest, ClaimVerdict, ClaimedMessage,
    CompleteOutcome, Completion, DedupKey, DedupRecord, DedupStore, ExtendOutcome, FencingToken,
    HandlerError, HandlerResult, Lease, LeaseLost, RecordStatus, ReleaseOutcome, StoreError,
    StoreStats,
};
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{
    MultipleNodeRoutingInfo, ResponsePolicy, Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr,
};
use redis::{Cmd, Pipeline, RedisError, RedisFuture, Value};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The key prefix used unless configured.
pub const DEFAULT_PREFIX: &str = "idemq";
/// The longest key prefix accepted.
pub const MAX_PREFIX_LEN: usize = 64;
/// How long an in-progress record stays in Redis after its lease ends (so a crashed
/// worker's key can be taken over with its attempt count and shows in `list_stuck`).
pub const DEFAULT_IN_PROGRESS_GRACE: Duration = Duration::from_secs(24 * 3600);
/// How long a completed record stays in Redis after its retention ends (visible to
/// `get` and deleted by `purge_expired`; Redis drops it by itself afterwards).
pub const DEFAULT_COMPLETED_GRACE: Duration = Duration::from_secs(600);
/// Keys per script invocation; larger batches become several invocations in one pipeline.
pub const DEFAULT_MAX_KEYS_PER_SCRIPT: usize = 512;

/// Longest duration passed to Redis (1000 years): keeps every timestamp exact in Lua's
/// doubles and far from `i64` overflow.
const MAX_MS: i64 = 1000 * 365 * 24 * 3600 * 1000;

/// Appends effect commands to a script call: their count, then each one's length and
/// words. Cursor commands (SCAN …) and empty commands are refused: not effects.
fn push_effects(c: &mut Cmd, effects: &[Cmd]) -> Result<(), HandlerError> {
    c.arg(effects.len());
    for (i, effect) in effects.iter().enumerate() {
        let mut args: Vec<&[u8]> = Vec::new();
        for a in effect.args_iter() {
            match a {
                redis::Arg::Simple(b) => args.push(b),
                redis::Arg::Cursor => {
                    return Err(HandlerError::Permanent(
                        format!(
                            "effect command {} is a cursor command (SCAN …): not an effect",
                            i + 1
                        )
                        .into(),
                    ))
                }
            }
        }
        if args.is_empty() {
            return Err(HandlerError::Permanent(
                format!("effect command {} is empty", i + 1).into(),
            ));
        }
        c.arg(args.len());
        for a in args {
            c.arg(a);
        }
    }
    Ok(())
}

fn clamp_ms(d: Duration) -> i64 {
    duration_ms(d).clamp(0, MAX_MS)
}

/// Checks a key prefix: 1 to 64 characters of `A-Z a-z 0-9 _ . -`.
///
/// Anything else could break the `SCAN MATCH <prefix>:*` pattern (`*`, `?`, `[`), the hash
/// tag (`{`, `}`), or the key layout (`:`, spaces, newlines).
///
/// ```
/// use idemq_redis::validate_prefix;
/// assert!(validate_prefix("idemq.payments-v2").is_ok());
/// for bad in ["", "a b", "x*", "{", "a\nb", "a:b"] {
///     assert!(validate_prefix(bad).is_err());
/// }
/// ```
pub fn validate_prefix(prefix: &str) -> Result<(), StoreError> {
    let ok = !prefix.is_empty()
        && prefix.len() <= MAX_PREFIX_LEN
        && prefix
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(StoreError::Config(format!(
            "invalid Redis key prefix {prefix:?}: use 1 to {MAX_PREFIX_LEN} characters from A-Z a-z 0-9 _ . -"
        )))
    }
}

/// Maps a Redis client error: connection, IO, timeout and transient server states are
/// [`StoreError::Unavailable`] (back off, retry, never ack); the rest is
/// [`StoreError::Backend`].
pub fn map_redis_error(e: &RedisError) -> StoreError {
    use redis::ErrorKind as K;
    let transient = e.is_io_error()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || matches!(
            e.kind(),
            K::BusyLoadingError
                | K::TryAgain
                | K::ClusterDown
                | K::MasterDown
                | K::ReadOnly
                | K::ClusterConnectionNotFound
                // A slot moving (resharding) or a failover in progress: the client has
                // followed the redirections it could; later the map is settled.
                | K::Moved
                | K::Ask
        )
        // MISCONF: persistence failing, writes refused until it recovers; NOREPLICAS:
        // min-replicas-to-write not met.
        || matches!(
            e.code(),
            Some("OOM" | "LOADING" | "BUSY" | "MISCONF" | "NOREPLICAS")
        );
    if transient {
        StoreError::Unavailable(format!("redis: {e}"))
    } else {
        StoreError::Backend(format!("redis: {e}"))
    }
}

/// The same script call as `EVAL <source>` instead of `EVALSHA <sha>`.
fn with_source(cmd: &Cmd, s: &Lua) -> Cmd {
    let mut c = redis::cmd("EVAL");
    c.arg(&s.src);
    for a in cmd.args_iter().skip(2) {
        if let redis::Arg::Simple(bytes) = a {
            c.arg(bytes);
        }
    }
    c
}

fn store_err(e: RedisError) -> StoreError {
    map_redis_error(&e)
}

/// The settings of a [`RedisStore`] (see the [`RedisStoreBuilder`] methods for each).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisStoreOptions {
    /// Key prefix (default [`DEFAULT_PREFIX`]); validated by [`validate_prefix`].
    pub prefix: String,
    /// Hash-tag the consumer group (default `false`).
    pub hash_tag: bool,
    /// How long in-progress records outlive their lease (default [`DEFAULT_IN_PROGRESS_GRACE`]).
    pub in_progress_grace: Duration,
    /// How long completed records outlive their retention (default [`DEFAULT_COMPLETED_GRACE`]).
    pub completed_grace: Duration,
    /// Timeout of each connection attempt (default 2 s).
    pub connect_timeout: Duration,
    /// Timeout of each request (default 5 s).
    pub response_timeout: Duration,
    /// Reconnection attempts before a request fails while Redis is down (default 2).
    pub reconnect_retries: usize,
    /// Keys per script invocation (default [`DEFAULT_MAX_KEYS_PER_SCRIPT`]).
    pub max_keys_per_script: usize,
    /// `COUNT` hint of the `SCAN`s (default 1000).
    pub scan_count: usize,
    /// `SCAN` work one `purge_expired` call may do, in slots examined (each `SCAN` counts
    /// its `COUNT`); default unlimited: one full sweep at most per call.
    pub purge_scan_budget: usize,
    /// `SET NX GET` claim fast path on Redis >= 7.0 (default `false`: it writes lease ends
    /// from this process's clock; see [`RedisStoreBuilder::fast_claims`]).
    pub fast_claims: bool,
    /// How often a background task checks the store's incarnation marker (default 1 s;
    /// zero: only [`RedisStore::check_incarnation`] checks). See
    /// [`RedisStore::incarnation_lost`].
    pub incarnation_check_interval: Duration,
    /// `Some((n, timeout))`: after every durable write (claim, complete, extend) send
    /// `WAIT n timeout` on the same connection and fail the call (retryable, so no ack)
    /// when fewer than `n` replicas acknowledged it (default `None`). See
    /// [`RedisStoreBuilder::wait_replicas`].
    pub wait_replicas: Option<(u32, Duration)>,
    /// Treat a `redis://` URL (whose host part may list `host:port,host:port`) as the seed
    /// nodes of a Redis Cluster (default `false`; a `redis+cluster://` URL always is one).
    pub cluster: bool,
}

impl Default for RedisStoreOptions {
    fn default() -> Self {
        Self {
            prefix: DEFAULT_PREFIX.into(),
            hash_tag: false,
            in_progress_grace: DEFAULT_IN_PROGRESS_GRACE,
            completed_grace: DEFAULT_COMPLETED_GRACE,
            connect_timeout: Duration::from_secs(2),
            response_timeout: Duration::from_secs(5),
            reconnect_retries: 2,
            max_keys_per_script: DEFAULT_MAX_KEYS_PER_SCRIPT,
            scan_count: 1000,
            purge_scan_budget: usize::MAX,
            fast_claims: false,
            incarnation_check_interval: Duration::from_secs(1),
            wait_replicas: None,
            cluster: false,
        }
    }
}

/// Configures and connects a [`RedisStore`].
#[derive(Debug, Clone)]
pub struct RedisStoreBuilder {
    url: String,
    opts: RedisStoreOptions,
}

impl RedisStoreBuilder {
    /// Replaces every setting at once.
    pub fn options(mut self, opts: RedisStoreOptions) -> Self {
        self.opts = opts;
        self
    }

    /// Key prefix (default [`DEFAULT_PREFIX`]); validated by [`validate_prefix`] at connect.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.opts.prefix = prefix.into();
        self
    }

    /// Put the consumer group in a hash tag, `<prefix>:{<group>}:<key>`, so a Redis Cluster
    /// keeps a group's keys in one slot (default off: `<prefix>:<group>:<key>`). Batches
    /// are then split per group, one script per group, still in one round trip.
    pub fn hash_tag(mut self, on: bool) -> Self {
        self.opts.hash_tag = on;
        self
    }

    /// How long in-progress records outlive their lease (default
    /// [`DEFAULT_IN_PROGRESS_GRACE`]; at least 1 ms).
    pub fn in_progress_grace(mut self, d: Duration) -> Self {
        self.opts.in_progress_grace = d;
        self
    }

    /// How long completed records outlive their retention (default
    /// [`DEFAULT_COMPLETED_GRACE`]; at least 1 ms). Claims treat them as gone as soon as
    /// the retention ends; the grace only keeps them visible to `get` and `purge_expired`.
    pub fn completed_grace(mut self, d: Duration) -> Self {
        self.opts.completed_grace = d;
        self
    }

    /// Timeout of each connection attempt (default 2 s).
    pub fn connect_timeout(mut self, d: Duration) -> Self {
        self.opts.connect_timeout = d;
        self
    }

    /// Timeout of each request (default 5 s); a timeout is [`StoreError::Unavailable`].
    pub fn response_timeout(mut self, d: Duration) -> Self {
        self.opts.response_timeout = d;
        self
    }

    /// Reconnection attempts before a request fails while Redis is down (default 2; the
    /// next request starts a new round). Keep it small: the caller retries anyway.
    pub fn reconnect_retries(mut self, n: usize) -> Self {
        self.opts.reconnect_retries = n;
        self
    }

    /// Keys per script invocation (default [`DEFAULT_MAX_KEYS_PER_SCRIPT`]).
    pub fn max_keys_per_script(mut self, n: usize) -> Self {
        self.opts.max_keys_per_script = n.max(1);
        self
    }

    /// Claim fresh keys with a pipelined `SET key record NX GET PX ttl` (default `true`,
    /// used only when the server is Redis 7.0 or newer): fresh, duplicate, in-flight and
    /// conflict answers then cost what a raw `SET NX` costs, in one round trip; the keys
    /// whose record must be rewritten (takeover after a crash, retention over) go through
    /// the claim script in a second round trip. `false` (the default): every batch is one
    /// script call, always one round trip, about 1.5x the server CPU per key.
    ///
    /// The fast path writes a fresh record, lease end included, before the server can be
    /// asked the time, so its leases end by **this process's clock**, and it judges the
    /// records it finds by that clock too; the scripts decide on the server's `TIME`. Turn it
    /// on only where every consumer's clock is synchronised well within
    /// `lease − heartbeat interval`: a consumer whose clock runs behind by more writes leases
    /// that others see as already ended.
    pub fn fast_claims(mut self, on: bool) -> Self {
        self.opts.fast_claims = on;
        self
    }

    /// `COUNT` hint of the `SCAN`s behind `purge_expired`, `list_stuck` (default 1000).
    pub fn scan_count(mut self, n: usize) -> Self {
        self.opts.scan_count = n.max(1);
        self
    }

    /// Bounds the `SCAN` work of one `purge_expired` call, in slots examined (each `SCAN`
    /// counts its `COUNT`; default unlimited, i.e. at most one full sweep per call); the
    /// next call resumes the sweep where this one stopped. `SCAN MATCH` walks the whole
    /// database, so the cost follows the database's size, not the prefix's.
    pub fn purge_scan_budget(mut self, n: usize) -> Self {
        self.opts.purge_scan_budget = n.max(1);
        self
    }

    fn settings(&self) -> Result<Settings, StoreError> {
        validate_prefix(&self.opts.prefix)?;
        Ok(Settings {
            prefix: self.opts.prefix.clone(),
            pattern: format!("{}:*", self.opts.prefix),
            hash_tag: self.opts.hash_tag,
            in_progress_grace_ms: clamp_ms(self.opts.in_progress_grace).max(1),
            completed_grace_ms: clamp_ms(self.opts.completed_grace).max(1),
            max_keys_per_script: self.opts.max_keys_per_script,
            scan_count: self.opts.scan_count,
            purge_scan_budget: self.opts.purge_scan_budget.max(1),
            wait_replicas: self
                .opts
                .wait_replicas
                .map(|(n, t)| (n, clamp_ms(t).max(1))),
        })
    }

    /// After every durable write (claim, complete, extend), `WAIT replicas timeout` on the
    /// same connection (in the same pipeline, so a reconnection cannot split the two): a
    /// call whose writes fewer than `replicas` replicas acknowledged within `timeout` fails
    /// with [`StoreError::Unavailable`], so its message is not acknowledged and comes back.
    /// Without it a failover can lose writes that were acknowledged (Redis replicates
    /// asynchronously); with it, only a failover that promotes a replica which had not
    /// acknowledged them can (see docs/stores-redis.md). Costs a replica round trip per
    /// call (measured in the `bench` example).
    pub fn wait_replicas(mut self, replicas: u32, timeout: Duration) -> Self {
        self.opts.wait_replicas = Some((replicas, timeout));
        self
    }

    /// Treat a `redis://host:port[,host:port...]/` URL as a Redis Cluster's seed nodes
    /// (a `redis+cluster://` URL always is one).
    pub fn cluster(mut self, on: bool) -> Self {
        self.opts.cluster = on;
        self
    }

    /// How often the incarnation marker is checked in the background (default 1 s; zero
    /// turns the background check off). See [`RedisStore::incarnation_lost`].
    pub fn incarnation_check_interval(mut self, d: Duration) -> Self {
        self.opts.incarnation_check_interval = d;
        self
    }

    /// Validates the configuration, connects (a [`ConnectionManager`] of its own, which
    /// reconnects after a Redis restart) and loads the scripts.
    ///
    /// `redis+cluster://host:port,host:port/` (or [`RedisStoreBuilder::cluster`]) connects
    /// to a Redis Cluster instead: a seed that is a standalone server, or a malformed list
    /// of nodes, is a [`StoreError::Config`].
    ///
    /// Startup fails at once with a [`StoreError::Config`] naming what to fix on a scheme
    /// other than `redis://`, `rediss://`, `redis+unix://`, `unix://`; on `rediss://` when
    /// the `redis` crate was built without TLS (the message names the cargo feature); on a
    /// refused connection (host and port named); on a port where PostgreSQL or MySQL
    /// answers (named); on a refused login. A first `PING` on a connection of its own
    /// checks all this before the reconnecting manager is built.
    ///
    /// ```
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// let err = idemq_redis::RedisStore::builder("reddis://localhost/").connect().await.unwrap_err();
    /// assert!(err.to_string().contains("use redis://"));
    /// # });
    /// ```
    pub async fn connect(self) -> Result<RedisStore, StoreError> {
        let settings = self.settings()?;
        if self.opts.cluster || cluster::is_cluster_url(&self.url) {
            let seeds = cluster::seed_urls(&self.url, self.opts.cluster)?;
            let retries = u32::try_from(self.opts.reconnect_retries).unwrap_or(u32::MAX);
            let conn = ClusterHandle::open(
                seeds,
                self.opts.connect_timeout,
                self.opts.response_timeout,
                retries,
            )
            .await?;
            return RedisStore::from_parts(
                StoreConn::Cluster(Arc::new(conn)),
                settings,
                &self.opts,
            )
            .await;
        }
        let client = crate::errors::open_client(&self.url)?;
        crate::errors::probe(
            &client,
            &self.url,
            self.opts.connect_timeout,
            self.opts.response_timeout,
        )
        .await?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(self.opts.connect_timeout)
            .set_response_timeout(self.opts.response_timeout)
            .set_number_of_retries(self.opts.reconnect_retries)
            .set_factor(50)
            .set_max_delay(250);
        let conn = ConnectionManager::new_with_config(client, config)
            .await
            .map_err(store_err)?;
        RedisStore::from_parts(StoreConn::Single(conn), settings, &self.opts).await
    }

    /// Like [`RedisStoreBuilder::connect`] over an existing connection (shared with other
    /// users; its own timeouts and reconnection apply). The URL is ignored.
    pub async fn with_connection(self, conn: ConnectionManager) -> Result<RedisStore, StoreError> {
        let settings = self.settings()?;
        RedisStore::from_parts(StoreConn::Single(conn), settings, &self.opts).await
    }

    /// Like [`RedisStoreBuilder::connect`] over an existing Redis Cluster connection. The
    /// URL is ignored.
    pub async fn with_cluster_connection(
        self,
        conn: ClusterConnection,
    ) -> Result<RedisStore, StoreError> {
        let settings = self.settings()?;
        let retries = u32::try_from(self.opts.reconnect_retries).unwrap_or(u32::MAX);
        // Without seeds: this connection is never replaced, only bounded in time.
        let handle = ClusterHandle::wrap(
            conn,
            Vec::new(),
            self.opts.connect_timeout,
            self.opts.response_timeout,
            retries,
        );
        RedisStore::from_parts(StoreConn::Cluster(Arc::new(handle)), settings, &self.opts).await
    }
}

/// The store's connection: one server (reconnecting) or a Redis Cluster (routing each
/// command by its key's slot, following `MOVED`/`ASK`, refreshing the slot map).
// Not boxed: the connection is cloned for every request, and a boxed manager would be an
// allocation per clone; one store holds one of these.
#[allow(clippy::large_enum_variant)]
#[derive(Clone)]
pub(crate) enum StoreConn {
    Single(ConnectionManager),
    Cluster(Arc<ClusterHandle>),
}

impl ConnectionLike for StoreConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Single(c) => c.req_packed_command(cmd),
            Self::Cluster(h) => Box::pin(async move {
                h.call(|mut c| async move { c.req_packed_command(cmd).await })
                    .await
            }),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Single(c) => c.req_packed_commands(cmd, offset, count),
            Self::Cluster(h) => Box::pin(async move {
                h.call(|mut c| async move { c.req_packed_commands(cmd, offset, count).await })
                    .await
            }),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(c) => c.get_db(),
            Self::Cluster(_) => 0,
        }
    }
}

impl StoreConn {
    /// A keyless command (`TIME`, `INFO`, `CONFIG GET`) answered by one node: on a cluster
    /// any node, not the aggregate of all of them.
    async fn query_one<T: redis::FromRedisValue>(&self, cmd: &Cmd) -> Result<T, StoreError> {
        let v = match self {
            Self::Single(c) => c.clone().req_packed_command(cmd).await,
            Self::Cluster(h) => {
                h.call(|mut c| async move {
                    c.route_command(cmd, RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random))
                        .await
                })
                .await
            }
        }
        .map_err(store_err)?;
        redis::from_owned_redis_value(v).map_err(store_err)
    }
}

/// Where a pipeline goes.
#[derive(Clone, PartialEq, Eq, Hash)]
enum Target {
    /// The standalone server.
    Server,
    /// The master of a slot, through the cluster client.
    Slot(u16),
    /// A master (`host:port`), on the store's own connection to it.
    Node(String),
}

/// Commands for one [`Target`], with the slot of each.
struct Batch {
    target: Target,
    pipe: Pipeline,
    slots: Vec<u16>,
}

/// One command's answer in [`RedisStore::send`].
enum Reply {
    Value(Value),
    /// `NOSCRIPT`: the script was not run.
    NoScript,
    Failed(StoreError),
    /// Run on the master, but `WAIT` saw too few replicas acknowledge it: the call must
    /// fail (the error), and what it acquired may be given back (the value says what).
    Unreplicated(Value, StoreError),
}

fn reply_of(v: Value) -> Reply {
    match v {
        Value::ServerError(e) => match e.code() {
            "NOSCRIPT" => Reply::NoScript,
            // A key of another type: the caller names the key (`Corrupt`).
            "WRONGTYPE" => Reply::Value(Value::ServerError(e)),
            _ => Reply::Failed(store_err(e.into())),
        },
        v => Reply::Value(v),
    }
}

/// The error for a `WAIT` reply (`acked`: replicas that acknowledged) short of `replicas`.
fn wait_shortfall(acked: Option<Value>, replicas: u32, timeout_ms: i64) -> Option<StoreError> {
    let got = match acked {
        Some(Value::Int(n)) => n,
        Some(Value::ServerError(e)) => return Some(store_err(e.into())),
        other => {
            return Some(StoreError::Backend(format!(
                "unexpected WAIT reply {other:?}"
            )))
        }
    };
    if got >= i64::from(replicas) {
        return None;
    }
    metrics::counter!("idemq_redis_wait_shortfall_total").increment(1);
    tracing::warn!(
        acked = got,
        replicas,
        timeout_ms,
        "redis write acknowledged by too few replicas: failing the call (no ack)"
    );
    Some(StoreError::Unavailable(format!(
        "WAIT {replicas} {timeout_ms}: only {got} replica(s) acknowledged the write in time; \
         it may not survive a failover, so the call fails and is retried"
    )))
}

/// The same failure for another command of a failed pipeline.
fn same_failure(e: &StoreError) -> StoreError {
    match e {
        StoreError::Unavailable(m) => StoreError::Unavailable(m.clone()),
        StoreError::Backend(m) => StoreError::Backend(m.clone()),
        StoreError::Config(m) => StoreError::Config(m.clone()),
        StoreError::Corrupt { key, reason } => StoreError::Corrupt {
            key: key.clone(),
            reason: reason.clone(),
        },
        StoreError::KeyTooLong { len, max } => StoreError::KeyTooLong {
            len: *len,
            max: *max,
        },
    }
}

#[derive(Debug)]
struct Settings {
    prefix: String,
    pattern: String,
    hash_tag: bool,
    in_progress_grace_ms: i64,
    completed_grace_ms: i64,
    max_keys_per_script: usize,
    scan_count: usize,
    purge_scan_budget: usize,
    wait_replicas: Option<(u32, i64)>,
}

/// A [`DedupStore`] on Redis: each record is one string at `<prefix>:<dedup key>` (or
/// `<prefix>:{<group>}:<key>` with [hash tags](RedisStoreBuilder::hash_tag)). A record is
/// only ever created by `SET NX` and only ever changed by a Lua script, so every
/// read-decide-write is atomic.
///
/// - **claim** (batch = one round trip): one claim script call per batch (per hash-tag
///   group), which applies [`idemq_core::evaluate_claim`]'s rules atomically in Lua at the
///   server's `TIME`: `SET NX` for new keys, takeover of an ended lease (attempt + 1), a
///   fresh lifecycle after retention, else duplicate / in flight / conflict. With the opt-in
///   [`fast_claims(true)`](RedisStoreBuilder::fast_claims) on Redis >= 7.0, a pipelined
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
///   clock (see [`RedisStoreBuilder::fast_claims`]).
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
///   [`wait_replicas`](RedisStoreBuilder::wait_replicas) durable writes wait for replicas.
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
    conn: StoreConn,
    cfg: Arc<Settings>,
    fast_claims: bool,
    /// Where the next `purge_expired` resumes its `SCAN`: the position of the node among
    /// the masters (0 on a standalone server) and the node's cursor.
    purge_cursor: Arc<Mutex<(usize, u64)>>,
    incarnation: Arc<Incarnation>,
}

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
struct Incarnation {
    conn: StoreConn,
    markers: Vec<Marker>,
    lost: AtomicBool,
}

/// One incarnation marker key and the id last read from it.
struct Marker {
    key: String,
    id: Mutex<String>,
}

/// Writes the marker `key` unless it exists; answers its id.
async fn ensure_marker(conn: &StoreConn, key: &str) -> Result<String, StoreError> {
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
    async fn check(&self) -> Result<bool, StoreError> {
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

    fn lost_error(&self) -> StoreError {
        let keys: Vec<&str> = self.markers.iter().map(|m| m.key.as_str()).collect();
        StoreError::Backend(format!(
            "redis dataset lost: an incarnation marker ({}) disappeared or changed (a restart \
             without persistence, a failover to a replica behind, a FLUSHALL, an eviction); \
             claims and completions acknowledged before may be gone",
            keys.join(", ")
        ))
    }
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

/// One decoded claim answer, before errors are settled for the whole batch.
type ClaimAnswer = Result<ClaimOutcome, StoreError>;

impl RedisStore {
    /// A builder for `url` (`redis://[user:password@]host:port/db`).
    pub fn builder(url: impl Into<String>) -> RedisStoreBuilder {
        RedisStoreBuilder {
            url: url.into(),
            opts: RedisStoreOptions::default(),
        }
    }

    /// Connects to `url` with `options` (`RedisStoreOptions::default()` for the defaults).
    pub async fn connect(url: &str, options: RedisStoreOptions) -> Result<Self, StoreError> {
        Self::builder(url).options(options).connect().await
    }

    /// Every idemq key carries a TTL, so any `volatile-*` or `allkeys-*` eviction policy may
    /// drop a live lease under memory pressure (a second worker then acquires it) or a
    /// completed record (a duplicate runs again). Warn unless the server says `noeviction`;
    /// servers that refuse `CONFIG` (managed Redis) are not checked.
    async fn check_eviction_policy(&self) {
        let reply: Result<Vec<String>, StoreError> = self
            .conn
            .query_one(redis::cmd("CONFIG").arg("GET").arg("maxmemory-policy"))
            .await;
        match reply {
            Ok(kv) => match kv.get(1).map(String::as_str) {
                Some("noeviction") | None => {}
                Some(policy) => tracing::warn!(
                    policy,
                    "Redis maxmemory-policy is not noeviction: under memory pressure it may evict \
                     live leases or completed records, and a message could then be processed twice; \
                     set maxmemory-policy noeviction for the dedup store"
                ),
            },
            Err(e) => tracing::debug!(error = %e, "cannot read maxmemory-policy (CONFIG refused)"),
        }
    }

    async fn from_parts(
        conn: StoreConn,
        cfg: Settings,
        opts: &RedisStoreOptions,
    ) -> Result<Self, StoreError> {
        let fast_claims = opts.fast_claims;
        // Outside the records' pattern (`<prefix>:*`), so scans never meet them.
        let marker = format!("{}.incarnation", cfg.prefix);
        let marker_keys = match &conn {
            StoreConn::Single(_) => vec![marker],
            StoreConn::Cluster(h) => {
                h.load_slot_map().await?;
                let masters = cluster::masters(h).await?;
                masters
                    .iter()
                    .filter_map(|m| m.ranges.first())
                    .map(|r| format!("{marker}{{{}}}", cluster::tag_for_slot(r.0)))
                    .collect()
            }
        };
        let mut markers = Vec::with_capacity(marker_keys.len());
        for key in marker_keys {
            let id = ensure_marker(&conn, &key).await?;
            markers.push(Marker {
                key,
                id: Mutex::new(id),
            });
        }
        let incarnation = Arc::new(Incarnation {
            conn: conn.clone(),
            markers,
            lost: AtomicBool::new(false),
        });
        if !opts.incarnation_check_interval.is_zero() {
            // Holds a weak reference: ends when the last clone of the store is dropped.
            let weak = Arc::downgrade(&incarnation);
            let every = opts.incarnation_check_interval;
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(every).await;
                    let Some(inc) = weak.upgrade() else { break };
                    if let Err(e) = inc.check().await {
                        tracing::debug!(error = %e, "incarnation check failed");
                    }
                }
            });
        }
        let mut store = Self {
            conn,
            cfg: Arc::new(cfg),
            fast_claims: false,
            purge_cursor: Arc::new(Mutex::new((0, 0))),
            incarnation,
        };
        store.check_eviction_policy().await;
        for s in lua::all() {
            store.load(s).await?;
        }
        if fast_claims {
            // `SET ... NX GET` needs Redis 7.0.
            let version = store.server_version().await?;
            store.fast_claims = version >= (7, 0);
            if !store.fast_claims {
                tracing::info!(
                    ?version,
                    "redis older than 7.0: every claim goes through the claim script"
                );
            }
        }
        tracing::debug!(
            prefix = %store.cfg.prefix,
            hash_tag = store.cfg.hash_tag,
            fast_claims = store.fast_claims,
            "redis dedup store ready"
        );
        Ok(store)
    }

    /// The server's clock (`TIME`), in milliseconds since the Unix epoch: the clock leases
    /// are decided on.
    async fn server_now_ms(&self) -> Result<i64, StoreError> {
        let (secs, micros): (i64, i64) = self.conn.query_one(&redis::cmd("TIME")).await?;
        Ok(secs.saturating_mul(1000).saturating_add(micros / 1000))
    }

    async fn server_version(&self) -> Result<(u32, u32), StoreError> {
        let info: String = self
            .conn
            .query_one(redis::cmd("INFO").arg("server"))
            .await?;
        let v = info
            .lines()
            .find_map(|l| l.strip_prefix("redis_version:"))
            .unwrap_or("0.0");
        let mut it = v.trim().split('.').map(|p| p.parse::<u32>().unwrap_or(0));
        Ok((it.next().unwrap_or(0), it.next().unwrap_or(0)))
    }

    /// Whether fresh claims use the `SET NX GET` fast path (see
    /// [`RedisStoreBuilder::fast_claims`]).
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
    /// [`RedisStoreBuilder::wait_replicas`]).
    pub fn wait_replicas(&self) -> Option<(u32, Duration)> {
        self.cfg
            .wait_replicas
            .map(|(n, t)| (n, Duration::from_millis(u64::try_from(t).unwrap_or(0))))
    }

    /// Whether the store has seen its dataset lost (its incarnation marker gone or
    /// replaced) since it connected or since [`RedisStore::acknowledge_data_loss`]: claims
    /// and completions acknowledged before may be gone, so messages may run again. Checked
    /// in the background every [`RedisStoreOptions::incarnation_check_interval`] and by
    /// [`RedisStore::check_incarnation`]; each loss also counts
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

    fn write_redis_key(&self, out: &mut Vec<u8>, key: &DedupKey) {
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

    /// Applies `effects` (Redis commands: the message's effect on data in this Redis) and
    /// completes `msg` in **one server-side script**, so the effect and the dedup record
    /// commit together or not at all — the Redis counterpart of `idemq_sql`'s
    /// `begin_for` … `commit`. A crash before the script leaves neither; after it, both.
    /// Returns what a handler returns (`Ok(result)`, `result` stored for duplicates).
    ///
    /// - The lease was lost (taken over after it expired, or released): nothing is applied,
    ///   and the error is [`HandlerError::Retryable`] with [`LeaseLost`] as its source.
    /// - Completed earlier by this very claim (a retried call whose reply was lost): nothing
    ///   is applied again.
    /// - A command fails (e.g. `WRONGTYPE`): [`HandlerError::Permanent`] naming it. A script
    ///   is atomic but not transactional: **the commands before it stay applied** and the
    ///   record stays in progress, so keep effects to commands that cannot fail on your
    ///   keys.
    /// - In a Redis Cluster every key the commands touch must live on the record's node:
    ///   give them the record's hash tag (`{<group>}`, with
    ///   [`RedisStoreBuilder::hash_tag`]), or the server refuses the script.
    ///
    /// ```no_run
    /// use idemq_core::{ClaimedMessage, HandlerResult};
    /// use idemq_redis::{redis, RedisStore};
    ///
    /// async fn apply(store: &RedisStore, msg: ClaimedMessage) -> HandlerResult {
    ///     let mut credit = redis::cmd("HINCRBY");
    ///     credit.arg("balances").arg("account-7").arg(100);
    ///     store.complete_with(&msg, &[credit], None).await
    /// }
    /// ```
    pub async fn complete_with(
        &self,
        msg: &ClaimedMessage,
        effects: &[Cmd],
        result: Option<Bytes>,
    ) -> HandlerResult {
        let record = self.redis_key(&msg.key);
        let mut c = redis::cmd("EVALSHA");
        c.arg(&lua::COMPLETE_WITH.sha)
            .arg(1)
            .arg(&record)
            .arg(0)
            .arg(self.cfg.completed_grace_ms)
            .arg(msg.token.0)
            .arg(clamp_ms(msg.retention))
            .arg(result_field(result.as_ref()));
        push_effects(&mut c, effects)?;
        let slot = self.partition(std::iter::once(&msg.key))[0].0;
        let reply = self
            .eval_many(&lua::COMPLETE_WITH, &[c], &[slot], true)
            .await?
            .pop()
            .ok_or_else(|| StoreError::Backend("missing complete_with reply".into()))?;
        let parts = match reply {
            Value::Array(v) if !v.is_empty() => v,
            other => {
                return Err(StoreError::Backend(format!(
                    "unexpected complete_with reply {other:?}"
                ))
                .into())
            }
        };
        match Self::int(&parts[0])? {
            1 | 2 => Ok(result),
            0 => Err(HandlerError::Retryable(
                LeaseLost {
                    key: msg.key.clone(),
                }
                .into(),
            )),
            3 => {
                let which = parts.get(1).map(Self::int).transpose()?.unwrap_or(0);
                let why = Self::reply_text(parts.get(2));
                Err(HandlerError::Permanent(
                    format!(
                        "effect command {which} of `{}` failed: {why} (the commands before it \
                         were applied; the record stays in progress)",
                        msg.key
                    )
                    .into(),
                ))
            }
            _ => Err(Self::corrupt(&msg.key, "not an idemq record").into()),
        }
    }

    /// [`RedisStore::complete_with`] for a batch: applies `effects` and completes every
    /// message of `msgs` in **one server-side script**, then marks them completed so the
    /// engine acks without a completion round trip (the Redis counterpart of `idemq_sql`'s
    /// `batch_handler`). Call it from a [`BatchHandler`](idemq_core::BatchHandler) with the
    /// claimed messages it was given.
    ///
    /// Every lease is checked before anything is written: if one was lost, nothing is
    /// applied and the error is [`HandlerError::Retryable`] with [`LeaseLost`] naming that
    /// key (the engine then runs the batch's messages one by one). A retried call whose
    /// reply was lost applies nothing again. A failing command is as in `complete_with`:
    /// the commands before it stay applied and no record is completed. In a Redis Cluster
    /// the records and the keys the commands touch must share one slot: give the store a
    /// hash tag ([`RedisStoreBuilder::hash_tag`]) so a group's records do.
    ///
    /// ```no_run
    /// use idemq_core::{ClaimedMessage, HandlerError};
    /// use idemq_redis::{redis, RedisStore};
    ///
    /// async fn apply(store: &RedisStore, msgs: Vec<ClaimedMessage>) -> Result<(), HandlerError> {
    ///     let mut credit = redis::cmd("HINCRBY");
    ///     credit.arg("{payments}:balances").arg("account-7").arg(100 * msgs.len() as i64);
    ///     store.complete_batch_with(&msgs, &[credit]).await
    /// }
    /// ```
    pub async fn complete_batch_with(
        &self,
        msgs: &[ClaimedMessage],
        effects: &[Cmd],
    ) -> Result<(), HandlerError> {
        if msgs.is_empty() {
            return Ok(());
        }
        let parts = self.partition(msgs.iter().map(|m| &m.key));
        let slot = parts.first().map_or(0, |p| p.0);
        if parts.iter().any(|p| p.0 != slot) {
            return Err(HandlerError::Permanent(
                "the batch's records live on several Redis Cluster slots: give the store a \
                 hash tag (RedisStoreBuilder::hash_tag) so one script can complete them"
                    .into(),
            ));
        }
        let mut c = redis::cmd("EVALSHA");
        c.arg(&lua::COMPLETE_BATCH_WITH.sha).arg(msgs.len());
        for m in msgs {
            c.arg(self.redis_key(&m.key));
        }
        c.arg(0).arg(self.cfg.completed_grace_ms);
        for m in msgs {
            c.arg(m.token.0).arg(clamp_ms(m.retention));
        }
        push_effects(&mut c, effects)?;
        let reply = self
            .eval_many(&lua::COMPLETE_BATCH_WITH, &[c], &[slot], true)
            .await?
            .pop()
            .ok_or_else(|| StoreError::Backend("missing complete_batch_with reply".into()))?;
        let parts = match reply {
            Value::Array(v) if !v.is_empty() => v,
            other => {
                return Err(StoreError::Backend(format!(
                    "unexpected complete_batch_with reply {other:?}"
                ))
                .into())
            }
        };
        let at = |i: usize| -> Result<i64, StoreError> {
            parts
                .get(i)
                .map(Self::int)
                .transpose()
                .map(Option::unwrap_or_default)
        };
        let key_at = |i: i64| {
            usize::try_from(i - 1)
                .ok()
                .and_then(|i| msgs.get(i))
                .map(|m| m.key.clone())
        };
        match at(0)? {
            1 | 2 => {
                for m in msgs {
                    m.mark_completed();
                }
                Ok(())
            }
            0 => {
                let key = key_at(at(1)?).unwrap_or_else(|| msgs[0].key.clone());
                Err(HandlerError::Retryable(LeaseLost { key }.into()))
            }
            3 => {
                let which = at(1)?;
                let why = Self::reply_text(parts.get(2));
                Err(HandlerError::Permanent(
                    format!(
                        "effect command {which} of a batch of {} failed: {why} (the commands \
                         before it were applied; no record was completed)",
                        msgs.len()
                    )
                    .into(),
                ))
            }
            _ => {
                let key = key_at(at(1)?).unwrap_or_else(|| msgs[0].key.clone());
                Err(Self::corrupt(&key, "not an idemq record").into())
            }
        }
    }

    async fn load(&self, s: &Lua) -> Result<(), StoreError> {
        let mut cmd = redis::cmd("SCRIPT");
        cmd.arg("LOAD").arg(&s.src);
        let v = match &self.conn {
            StoreConn::Single(c) => c.clone().req_packed_command(&cmd).await,
            // Every master: replicas get it when promoted, from the NOSCRIPT fallback.
            StoreConn::Cluster(h) => {
                let all = RoutingInfo::MultiNode((
                    MultipleNodeRoutingInfo::AllMasters,
                    Some(ResponsePolicy::AllSucceeded),
                ));
                h.call(|mut c| async move { c.route_command(&cmd, all).await })
                    .await
            }
        }
        .map_err(store_err)?;
        let sha: String = redis::from_owned_redis_value(v).map_err(store_err)?;
        if sha != s.sha {
            return Err(StoreError::Backend(format!(
                "SCRIPT LOAD of {} returned {sha}, expected {}",
                s.name, s.sha
            )));
        }
        Ok(())
    }

    /// Runs `EVALSHA` commands, `cmds[i]` on the keys of slot `slots[i]` (0 on a
    /// standalone server), in one round trip (one pipeline per slot on a cluster, all at
    /// once). Commands answered `NOSCRIPT` (a restarted or flushed server, a promoted
    /// replica) are re-sent once as `EVAL` with the source, which works whatever the script
    /// cache holds and caches the script again. `durable`: the calls write what must
    /// survive a failover (see [`RedisStoreBuilder::wait_replicas`]).
    async fn eval_many(
        &self,
        s: &Lua,
        cmds: &[Cmd],
        slots: &[u16],
        durable: bool,
    ) -> Result<Vec<Value>, StoreError> {
        let all: Vec<usize> = (0..cmds.len()).collect();
        let mut out: Vec<Option<Value>> = vec![None; cmds.len()];
        let mut noscript = Vec::new();
        let (groups, order) = self.groups(cmds, slots, &all);
        for (i, r) in order.into_iter().zip(self.send(&groups, durable).await) {
            match r {
                Reply::Value(v) => out[i] = Some(v),
                Reply::NoScript => noscript.push(i),
                Reply::Failed(e) | Reply::Unreplicated(_, e) => return Err(e),
            }
        }
        if !noscript.is_empty() {
            tracing::info!(
                script = s.name,
                "redis lost its script cache (restart, failover or SCRIPT FLUSH); sending the source"
            );
            let by_source: Vec<Cmd> = cmds.iter().map(|c| with_source(c, s)).collect();
            let (groups, order) = self.groups(&by_source, slots, &noscript);
            let again = self.send(&groups, durable).await;
            for (i, r) in order.into_iter().zip(again) {
                match r {
                    Reply::Value(v) => out[i] = Some(v),
                    Reply::NoScript => {
                        return Err(StoreError::Backend(format!(
                            "EVAL of script {} answered NOSCRIPT",
                            s.name
                        )))
                    }
                    Reply::Failed(e) | Reply::Unreplicated(_, e) => return Err(e),
                }
            }
        }
        out.into_iter()
            .map(|v| v.ok_or_else(|| StoreError::Backend("missing script reply".into())))
            .collect()
    }

    /// The commands `which` (positions in `cmds`) as pipelines: one in all on a standalone
    /// server; on a cluster one per master (by the slot map) or, while the map is unknown,
    /// one per slot. Also answers the positions in the order the pipelines send them (the
    /// order of [`RedisStore::send`]'s replies).
    fn groups(&self, cmds: &[Cmd], slots: &[u16], which: &[usize]) -> (Vec<Batch>, Vec<usize>) {
        let map = match &self.conn {
            StoreConn::Cluster(h) => h.slot_map(),
            StoreConn::Single(_) => None,
        };
        let target = |slot: u16| match (&self.conn, &map) {
            (StoreConn::Single(_), _) => Target::Server,
            (StoreConn::Cluster(_), Some(m)) => m
                .master_of(slot)
                .map_or(Target::Slot(slot), |a| Target::Node(a.to_owned())),
            (StoreConn::Cluster(_), None) => Target::Slot(slot),
        };
        let mut members: Vec<(Target, Vec<usize>)> = Vec::new();
        let mut at: std::collections::HashMap<Target, usize> = std::collections::HashMap::new();
        for &i in which {
            let t = target(slots[i]);
            let g = match at.get(&t) {
                Some(&g) => g,
                None => {
                    at.insert(t.clone(), members.len());
                    members.push((t, Vec::new()));
                    members.len() - 1
                }
            };
            members[g].1.push(i);
        }
        let mut order = Vec::with_capacity(which.len());
        let batches = members
            .into_iter()
            .map(|(target, idx)| {
                let mut pipe = redis::pipe();
                for &i in &idx {
                    pipe.add_command(cmds[i].clone());
                }
                let batch = Batch {
                    target,
                    pipe,
                    slots: idx.iter().map(|&i| slots[i]).collect(),
                };
                order.extend(idx);
                batch
            })
            .collect();
        (batches, order)
    }

    /// Sends each batch (all at once) and answers one [`Reply`] per command, batch after
    /// batch. With `durable` and `wait_replicas`, each pipeline ends with `WAIT n timeout`,
    /// on the same connection as its writes; a pipeline whose writes fewer replicas
    /// acknowledged answers [`StoreError::Unavailable`] for each of its commands.
    async fn send(&self, batches: &[Batch], durable: bool) -> Vec<Reply> {
        let wait = if durable {
            self.cfg.wait_replicas
        } else {
            None
        };
        futures::future::join_all(batches.iter().map(|b| self.send_batch(b, wait)))
            .await
            .into_iter()
            .flatten()
            .collect()
    }

    /// One batch; on a master's own connection, the commands answered with a redirection
    /// (not run) go once more to the node it names, one pipeline per node.
    async fn send_batch(&self, b: &Batch, wait: Option<(u32, i64)>) -> Vec<Reply> {
        let n = b.slots.len();
        let (vals, shortfall) = match self.send_pipeline(&b.target, &b.pipe, n, wait).await {
            Ok(sent) => sent,
            Err(failed) => return failed,
        };
        let redirected: Vec<(usize, cluster::Redirect)> = match b.target {
            Target::Node(_) => vals
                .iter()
                .enumerate()
                .filter_map(|(i, v)| cluster::redirect(v).map(|r| (i, r)))
                .collect(),
            _ => Vec::new(),
        };
        let mut out: Vec<Reply> = vals
            .into_iter()
            .map(|v| match &shortfall {
                Some(e) => Reply::Unreplicated(v, same_failure(e)),
                None => reply_of(v),
            })
            .collect();
        if redirected.is_empty() {
            return out;
        }
        if let StoreConn::Cluster(h) = &self.conn {
            h.refresh_slot_map();
        }
        // Not run where they went: once more to the node named, one pipeline per node
        // (`ASKING` before each command of an `ASK`).
        let cmds: Vec<&Cmd> = b.pipe.cmd_iter().collect();
        let mut by_node: Vec<(cluster::Redirect, Pipeline, Vec<usize>)> = Vec::new();
        for (i, r) in redirected {
            if r == cluster::Redirect::Later {
                out[i] = Reply::Failed(StoreError::Unavailable(
                    "redis cluster: slot not served right now (TRYAGAIN/CLUSTERDOWN)".into(),
                ));
                continue;
            }
            let g = match by_node.iter().position(|g| g.0 == r) {
                Some(g) => g,
                None => {
                    by_node.push((r, redis::pipe(), Vec::new()));
                    by_node.len() - 1
                }
            };
            if let cluster::Redirect::Ask(_) = by_node[g].0 {
                by_node[g].1.cmd("ASKING");
            }
            by_node[g].1.add_command(cmds[i].clone());
            by_node[g].2.push(i);
        }
        let again = by_node.iter().map(|(to, pipe, idx)| async move {
            let (addr, asking) = match to {
                cluster::Redirect::Moved(a) => (a.clone(), false),
                cluster::Redirect::Ask(a) => (a.clone(), true),
                cluster::Redirect::Later => (String::new(), false),
            };
            let n = pipe.cmd_iter().count();
            let sent = self
                .send_pipeline(&Target::Node(addr), pipe, n, wait)
                .await
                .map(|(vals, shortfall)| {
                    // Drop the `ASKING` replies: every other one.
                    let vals: Vec<Value> = if asking {
                        vals.into_iter().skip(1).step_by(2).collect()
                    } else {
                        vals
                    };
                    (vals, shortfall)
                })
                .map_err(|failed| {
                    if asking {
                        failed.into_iter().skip(1).step_by(2).collect()
                    } else {
                        failed
                    }
                });
            (idx, sent)
        });
        for (idx, sent) in futures::future::join_all(again).await {
            match sent {
                Ok((vals, shortfall)) => {
                    for (&i, v) in idx.iter().zip(vals) {
                        out[i] = match (&shortfall, cluster::redirect(&v)) {
                            (Some(e), None) => Reply::Unreplicated(v, same_failure(e)),
                            (Some(e), Some(_)) => Reply::Failed(same_failure(e)),
                            // Moved again: the map is being read; the caller retries later.
                            (None, Some(_)) => Reply::Failed(StoreError::Unavailable(
                                "redis cluster: slot moving (redirected twice)".into(),
                            )),
                            (None, None) => reply_of(v),
                        };
                    }
                }
                Err(failed) => {
                    for (&i, r) in idx.iter().zip(failed) {
                        out[i] = r;
                    }
                }
            }
        }
        out
    }

    /// Sends one pipeline of `n` commands (then `WAIT` when `wait`) to `target`: its `n`
    /// replies and the `WAIT` shortfall, or the replies of a pipeline that failed whole.
    async fn send_pipeline(
        &self,
        target: &Target,
        pipe: &Pipeline,
        n: usize,
        wait: Option<(u32, i64)>,
    ) -> Result<(Vec<Value>, Option<StoreError>), Vec<Reply>> {
        let with_wait: Pipeline;
        let pipe = match wait {
            Some((replicas, timeout)) => {
                let mut p = pipe.clone();
                p.cmd("WAIT").arg(replicas).arg(timeout);
                with_wait = p;
                &with_wait
            }
            None => pipe,
        };
        let total = n + usize::from(wait.is_some());
        let sent = match (&self.conn, target) {
            (StoreConn::Single(c), _) => c.clone().req_packed_commands(pipe, 0, total).await,
            (StoreConn::Cluster(h), Target::Node(addr)) => h.node_pipeline(addr, pipe, total).await,
            (StoreConn::Cluster(h), t) => {
                let slot = match t {
                    Target::Slot(slot) => *slot,
                    _ => 0,
                };
                let to = SingleNodeRoutingInfo::SpecificNode(Route::new(slot, SlotAddr::Master));
                h.call(|mut c| async move { c.route_pipeline(pipe, 0, total, to).await })
                    .await
            }
        };
        let all = |r: &dyn Fn() -> Reply| (0..n).map(|_| r()).collect::<Vec<Reply>>();
        let mut vals = match sent {
            Ok(v) if v.len() == total => v,
            Ok(v) => {
                let e = StoreError::Backend(format!(
                    "redis answered {} replies to {total} commands",
                    v.len()
                ));
                return Err(all(&|| Reply::Failed(same_failure(&e))));
            }
            // Through the cluster client one error reply fails the whole pipeline: a script
            // missing there is missing for every call in it.
            Err(e) if e.kind() == redis::ErrorKind::NoScriptError => {
                return Err(all(&|| Reply::NoScript))
            }
            Err(e) => {
                let e = store_err(e);
                return Err(all(&|| Reply::Failed(same_failure(&e))));
            }
        };
        let shortfall = match wait {
            Some((replicas, timeout)) => wait_shortfall(vals.pop(), replicas, timeout),
            None => None,
        };
        Ok((vals, shortfall))
    }

    /// The cluster slot of a Redis key (0 on a standalone server).
    fn slot_of(&self, redis_key: &[u8]) -> u16 {
        if self.is_cluster() {
            cluster::key_slot(redis_key)
        } else {
            0
        }
    }

    /// Splits keys into script invocations: per slot on a cluster (computed from the whole
    /// Redis key, so keys without a hash tag, or with a `{...}` of their own, are grouped
    /// right too), per group with hash tags on a standalone server, and at most
    /// `max_keys_per_script` keys each. Returns the slot and positions in `keys`, in order.
    fn partition<'a>(&self, keys: impl Iterator<Item = &'a DedupKey>) -> Vec<(u16, Vec<usize>)> {
        let max = self.cfg.max_keys_per_script;
        let mut parts: Vec<(u16, &str, Vec<usize>)> = Vec::new();
        let mut buf = Vec::with_capacity(128);
        for (i, k) in keys.enumerate() {
            let (slot, g) = if self.is_cluster() {
                buf.clear();
                self.write_redis_key(&mut buf, k);
                (cluster::key_slot(&buf), "")
            } else if self.cfg.hash_tag {
                (0, k.group())
            } else {
                (0, "")
            };
            match parts
                .iter_mut()
                .rev()
                .find(|(ps, pg, v)| *ps == slot && *pg == g && v.len() < max)
            {
                Some((_, _, v)) => v.push(i),
                None => parts.push((slot, g, vec![i])),
            }
        }
        parts.into_iter().map(|(s, _, v)| (s, v)).collect()
    }

    fn corrupt(key: &DedupKey, reason: impl std::fmt::Display) -> StoreError {
        StoreError::Corrupt {
            key: key.to_string(),
            reason: reason.to_string(),
        }
    }

    fn decode(key: &DedupKey, v: &Value) -> Result<DedupRecord, StoreError> {
        match v {
            Value::BulkString(b) => {
                decode_record(key.clone(), b).map_err(|e| Self::corrupt(key, e))
            }
            other => Err(Self::corrupt(
                key,
                format!("unexpected script reply {other:?}"),
            )),
        }
    }

    /// A script's error text (a failed effect command's reply), for the error it becomes.
    fn reply_text(v: Option<&Value>) -> String {
        match v {
            Some(Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
            Some(Value::SimpleString(s)) => s.clone(),
            other => format!("{other:?}"),
        }
    }

    fn int(v: &Value) -> Result<i64, StoreError> {
        match v {
            Value::Int(i) => Ok(*i),
            other => Err(StoreError::Backend(format!(
                "unexpected script reply {other:?}, expected an integer"
            ))),
        }
    }

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

    /// The fast path, one round trip: `SET key record NX GET PX ttl` per key, pipelined.
    /// A nil reply is a fresh acquisition; an existing record is judged by
    /// [`idemq_core::evaluate_claim`] itself. Returns the keys whose record must be rewritten
    /// (takeover, retention over), which go through the claim script.
    async fn claim_fast(
        &self,
        reqs: &[ClaimRequest],
        tokens: &[FencingToken],
        leases: &[i64],
        answers: &mut [Option<ClaimAnswer>],
    ) -> Result<Vec<usize>, StoreError> {
        let now = now_ms();
        let mut cmds = Vec::with_capacity(reqs.len());
        let mut slots = Vec::with_capacity(reqs.len());
        // One scratch buffer for every key and record: the commands copy the bytes.
        let (mut k, mut v) = (Vec::with_capacity(128), Vec::with_capacity(256));
        for (i, r) in reqs.iter().enumerate() {
            use std::io::Write;
            k.clear();
            self.write_redis_key(&mut k, &r.key);
            v.clear();
            write_identity(
                &mut v,
                tokens[i],
                r.payload_hash.as_ref(),
                r.worker.as_deref(),
            );
            // Writing into a Vec cannot fail.
            let _ = write!(v, "{}|1|{now}|||-", now + leases[i]);
            let mut c = redis::cmd("SET");
            c.arg(&k[..])
                .arg(&v[..])
                .arg("NX")
                .arg("GET")
                .arg("PX")
                .arg(leases[i] + self.cfg.in_progress_grace_ms);
            cmds.push(c);
            slots.push(self.slot_of(&k));
        }
        let all: Vec<usize> = (0..reqs.len()).collect();
        let (groups, order) = self.groups(&cmds, &slots, &all);
        let replies = self.send(&groups, true).await;
        if replies.len() != reqs.len() {
            return Err(StoreError::Backend(format!(
                "redis answered {} replies to {} claims",
                replies.len(),
                reqs.len()
            )));
        }
        let mut scripted = Vec::new();
        let mut unreplicated = None;
        for (i, reply) in order.into_iter().zip(replies) {
            let r = &reqs[i];
            let v = match reply {
                Reply::Value(v) => v,
                Reply::Unreplicated(v, e) => {
                    // Decoded like the others, so the batch's failure gives back what it
                    // acquired at once instead of leaving it to its lease end.
                    unreplicated = Some(e);
                    v
                }
                Reply::NoScript => {
                    answers[i] = Some(Err(StoreError::Backend("SET answered NOSCRIPT".into())));
                    continue;
                }
                Reply::Failed(e) => {
                    answers[i] = Some(Err(e));
                    continue;
                }
            };
            answers[i] = match v {
                Value::Nil => Some(Ok(ClaimOutcome::Acquired(Lease {
                    token: tokens[i],
                    until_ms: now + leases[i],
                    attempt: 1,
                    takeover: false,
                }))),
                Value::BulkString(b) => match decode_record(r.key.clone(), &b) {
                    Ok(rec) => match evaluate_claim_request(Some(&rec), r, now) {
                        ClaimVerdict::Answer(o) => Some(Ok(o)),
                        ClaimVerdict::AcquireFresh | ClaimVerdict::TakeOver => {
                            scripted.push(i);
                            None
                        }
                    },
                    Err(e) => Some(Err(Self::corrupt(&r.key, e))),
                },
                Value::ServerError(e) if e.code() == "WRONGTYPE" => Some(Err(Self::corrupt(
                    &r.key,
                    "not an idemq record (wrong type)",
                ))),
                Value::ServerError(e) => Some(Err(store_err(e.into()))),
                other => Some(Err(StoreError::Backend(format!(
                    "unexpected SET reply {other:?}"
                )))),
            };
        }
        match unreplicated {
            Some(e) => Err(e),
            None => Ok(scripted),
        }
    }

    /// The claim script over the keys `idx`: the whole decision and write, atomically.
    async fn claim_scripted(
        &self,
        reqs: &[ClaimRequest],
        tokens: &[FencingToken],
        leases: &[i64],
        idx: &[usize],
        answers: &mut [Option<ClaimAnswer>],
    ) -> Result<(), StoreError> {
        let parts: Vec<(u16, Vec<usize>)> = self
            .partition(idx.iter().map(|&i| &reqs[i].key))
            .into_iter()
            .map(|(slot, p)| (slot, p.into_iter().map(|j| idx[j]).collect()))
            .collect();
        let slots: Vec<u16> = parts.iter().map(|p| p.0).collect();
        let cmds: Vec<Cmd> = parts
            .iter()
            .map(|(_, part)| {
                let mut c = redis::cmd("EVALSHA");
                c.arg(&lua::CLAIM.sha).arg(part.len());
                for &i in part {
                    c.arg(self.redis_key(&reqs[i].key));
                }
                // ARGV[1] is unused: the script reads the server's `TIME`.
                c.arg(0).arg(self.cfg.in_progress_grace_ms);
                for &i in part {
                    let r = &reqs[i];
                    c.arg(leases[i]).arg(claim_identity(
                        tokens[i],
                        r.payload_hash.as_ref(),
                        r.worker.as_deref(),
                    ));
                }
                c
            })
            .collect();
        let replies = self.eval_many(&lua::CLAIM, &cmds, &slots, true).await?;
        for ((_, part), reply) in parts.iter().zip(&replies) {
            // The reply starts with the server's time: the leases acquired end there.
            let (now, vals) = match reply {
                Value::Array(v) if v.len() % 3 == 1 => match Self::int(&v[0]) {
                    Ok(now) => (now, &v[1..]),
                    Err(e) => {
                        for &i in part {
                            answers[i] = Some(Err(StoreError::Backend(format!(
                                "claim reply without the server's time: {e}"
                            ))));
                        }
                        continue;
                    }
                },
                other => {
                    for &i in part {
                        answers[i] = Some(Err(StoreError::Backend(format!(
                            "unexpected claim reply {other:?}"
                        ))));
                    }
                    continue;
                }
            };
            let lease = |i: usize, attempt: u32, takeover: bool| {
                ClaimOutcome::Acquired(Lease {
                    token: tokens[i],
                    until_ms: now + leases[i],
                    attempt,
                    takeover,
                })
            };
            // Every key not named in the reply was acquired fresh (attempt 1).
            for &i in part {
                answers[i] = Some(Ok(lease(i, 1, false)));
            }
            for t in vals.chunks_exact(3) {
                let pos = match Self::int(&t[0]).map(usize::try_from) {
                    Ok(Ok(p)) if (1..=part.len()).contains(&p) => p,
                    _ => {
                        return Err(StoreError::Backend(format!(
                            "claim reply names no key of the call: {:?}",
                            t[0]
                        )))
                    }
                };
                let i = part[pos - 1];
                let key = &reqs[i].key;
                let (code, payload) = (&t[1], &t[2]);
                answers[i] = Some((|| {
                    Ok(match Self::int(code)? {
                        c @ (1 | 2) => {
                            let attempt = u32::try_from(Self::int(payload)?)
                                .map_err(|_| Self::corrupt(key, "attempt out of range"))?;
                            lease(i, attempt, c == 2)
                        }
                        3 => ClaimOutcome::Duplicate(Self::decode(key, payload)?),
                        4 => ClaimOutcome::InFlight {
                            until_ms: Self::int(payload)?,
                        },
                        5 => ClaimOutcome::PayloadConflict(Self::decode(key, payload)?),
                        6 => {
                            let rec = Self::decode(key, payload)?;
                            ClaimOutcome::Acquired(Lease {
                                token: rec.token,
                                until_ms: rec.lease_until_ms,
                                attempt: rec.attempts,
                                takeover: false,
                            })
                        }
                        9 => {
                            let why = match payload {
                                Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
                                other => format!("{other:?}"),
                            };
                            return Err(Self::corrupt(key, why));
                        }
                        c => return Err(StoreError::Backend(format!("unknown claim code {c}"))),
                    })
                })());
            }
        }
        Ok(())
    }

    /// A batch failed part-way: give back what it acquired so far, answer `err`.
    async fn fail_batch(
        &self,
        reqs: &[ClaimRequest],
        answers: Vec<Option<ClaimAnswer>>,
        err: StoreError,
    ) -> StoreError {
        let got: Vec<ClaimAnswer> = answers
            .into_iter()
            .map(|a| a.unwrap_or_else(|| Err(StoreError::Backend("unanswered".into()))))
            .collect();
        self.release_all(reqs, &got).await;
        err
    }

    /// Gives back the leases a failed batch acquired, so its keys do not wait for expiry.
    async fn release_all(&self, reqs: &[ClaimRequest], answers: &[ClaimAnswer]) {
        for (r, a) in reqs.iter().zip(answers) {
            if let Ok(ClaimOutcome::Acquired(l)) = a {
                if let Err(e) = self.release(&r.key, l.token).await {
                    tracing::warn!(key = %r.key, error = %e, "could not release a lease of a failed batch");
                }
            }
        }
    }
}

#[async_trait]
impl DedupStore for RedisStore {
    async fn claim_batch(&self, reqs: &[ClaimRequest]) -> Result<Vec<ClaimOutcome>, StoreError> {
        check_distinct_keys(reqs)?;
        if reqs.is_empty() {
            return Ok(Vec::new());
        }
        let tokens: Vec<FencingToken> = reqs
            .iter()
            .map(|r| r.token.unwrap_or_else(FencingToken::random))
            .collect();
        let leases: Vec<i64> = reqs.iter().map(|r| clamp_ms(r.lease)).collect();
        let mut answers: Vec<Option<ClaimAnswer>> = (0..reqs.len()).map(|_| None).collect();
        let scripted: Vec<usize> = if self.fast_claims {
            match self.claim_fast(reqs, &tokens, &leases, &mut answers).await {
                Ok(s) => s,
                Err(e) => return Err(self.fail_batch(reqs, answers, e).await),
            }
        } else {
            (0..reqs.len()).collect()
        };
        if !scripted.is_empty() {
            if let Err(e) = self
                .claim_scripted(reqs, &tokens, &leases, &scripted, &mut answers)
                .await
            {
                return Err(self.fail_batch(reqs, answers, e).await);
            }
        }
        let answers: Vec<ClaimAnswer> = answers
            .into_iter()
            .map(|a| a.unwrap_or_else(|| Err(StoreError::Backend("no answer for key".into()))))
            .collect();
        if let Some(pos) = answers.iter().position(Result::is_err) {
            // Settle the whole batch as failed; leases it acquired are given back.
            self.release_all(reqs, &answers).await;
            let mut answers = answers;
            let err = answers.swap_remove(pos).err();
            return Err(err.unwrap_or_else(|| StoreError::Backend("claim failed".into())));
        }
        Ok(answers.into_iter().filter_map(Result::ok).collect())
    }

    async fn complete_batch(
        &self,
        items: &[Completion],
    ) -> Result<Vec<CompleteOutcome>, StoreError> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let parts = self.partition(items.iter().map(|c| &c.key));
        let slots: Vec<u16> = parts.iter().map(|p| p.0).collect();
        let cmds: Vec<Cmd> = parts
            .iter()
            .map(|(_, idx)| {
                let mut c = redis::cmd("EVALSHA");
                c.arg(&lua::COMPLETE.sha).arg(idx.len());
                for &i in idx {
                    c.arg(self.redis_key(&items[i].key));
                }
                c.arg(0).arg(self.cfg.completed_grace_ms);
                for &i in idx {
                    let it = &items[i];
                    c.arg(it.token.0)
                        .arg(clamp_ms(it.retention))
                        .arg(result_field(it.result.as_ref()));
                }
                c
            })
            .collect();
        let replies = self.eval_many(&lua::COMPLETE, &cmds, &slots, true).await?;
        let mut out = vec![CompleteOutcome::Fenced; items.len()];
        for ((_, idx), reply) in parts.iter().zip(&replies) {
            let vals = match reply {
                Value::Array(v) if v.len() == idx.len() => v,
                other => {
                    return Err(StoreError::Backend(format!(
                        "unexpected complete reply {other:?}"
                    )))
                }
            };
            for (&i, v) in idx.iter().zip(vals) {
                out[i] = match Self::int(v)? {
                    1 => CompleteOutcome::Completed,
                    0 => CompleteOutcome::Fenced,
                    _ => return Err(Self::corrupt(&items[i].key, "not an idemq record")),
                };
            }
        }
        Ok(out)
    }

    async fn release(
        &self,
        key: &DedupKey,
        token: FencingToken,
    ) -> Result<ReleaseOutcome, StoreError> {
        let rk = self.redis_key(key);
        let mut c = redis::cmd("EVALSHA");
        c.arg(&lua::RELEASE.sha)
            .arg(1)
            .arg(&rk)
            .arg(0)
            .arg(token.0)
            .arg(self.cfg.in_progress_grace_ms);
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

    async fn list_stuck(
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

    async fn stats(&self) -> Result<StoreStats, StoreError> {
        let now = self.server_now_ms().await?;
        let mut stats = StoreStats::default();
        self.scan_records(|r| stats.count(&r, now)).await?;
        Ok(stats)
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

    #[test]
    fn hostile_prefixes_are_config_errors() {
        for bad in [
            "",
            "a b",
            "x*",
            "{",
            "}",
            "a\nb",
            "a:b",
            "?",
            "[x]",
            &"p".repeat(65),
        ] {
            assert!(
                matches!(validate_prefix(bad), Err(StoreError::Config(_))),
                "{bad:?} accepted"
            );
        }
        assert!(validate_prefix(&"p".repeat(64)).is_ok());
    }
}
