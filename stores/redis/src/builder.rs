//! [`RedisStoreBuilder`] and [`RedisStoreOptions`]: the settings, their validation
//! ([`validate_prefix`]) and the connection steps that build a [`RedisStore`] (incarnation
//! markers, scripts loaded, the eviction policy checked).

use crate::cluster::{self, ClusterHandle};
use crate::conn::StoreConn;
use crate::errors::store_err;
use crate::incarnation::{ensure_marker, Incarnation, Marker};
use crate::lua;
use crate::store::{clamp_ms, RedisStore, Settings};
use idemq_core::StoreError;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use std::sync::atomic::AtomicBool;
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
}

#[cfg(test)]
mod tests {
    use super::*;

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
