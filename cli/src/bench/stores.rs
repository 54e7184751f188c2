//! Store scenarios of `idemq bench suite`: every store's claims/s and claim latency at
//! several batch sizes, next to the raw server operation measured in the same process (a
//! multi-row `INSERT … ON CONFLICT DO NOTHING` into a scratch table keyed like the dedup
//! table, pipelined `SET NX PX`, or a locked `HashMap` insert for the in-process stores),
//! and the local layer's checks/s and bytes per key.
//!
//! Every phase runs for a fixed time (the profile's `phase_secs`) on one client, timing
//! each call alone (key building is outside the clock); the rate is keys over the summed
//! call times, the percentiles are of one call's latency (one round trip of `batch` keys).
//! Rounds interleave raw, claim and claim+complete; the best round of each is kept (noise
//! on a shared machine only slows a run down).

use super::sizes::Sizes;
use idemq::{
    async_trait, ClaimOutcome, ClaimRequest, CompleteOutcome, Completion, ConsumerGroup, DedupKey,
    DedupRecord, DedupStore, ExtendOutcome, FencingToken, Lease, MemoryStore, ReleaseOutcome,
    StoreError,
};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Lease of the benchmark's claims.
const LEASE: Duration = Duration::from_secs(120);
/// Retention of the benchmark's completions (short: Redis records expire on their own).
const RETAIN: Duration = Duration::from_secs(600);
/// A phase stops after this many calls even when its time is not up.
const MAX_CALLS: usize = 200_000;

/// One timed phase: keys done, time spent inside the calls, each call's latency.
#[derive(Default)]
pub(crate) struct Phase {
    keys: usize,
    busy: Duration,
    lat: Vec<Duration>,
    started: Option<Instant>,
}

impl Phase {
    /// Whether to make another call: at least three, then until `secs` have passed.
    pub(crate) fn more(&mut self, secs: f64) -> bool {
        let started = *self.started.get_or_insert_with(Instant::now);
        self.lat.len() < MAX_CALLS && (self.lat.len() < 3 || started.elapsed().as_secs_f64() < secs)
    }

    /// Records one call of `keys` keys that took `took`.
    pub(crate) fn record(&mut self, keys: usize, took: Duration) {
        self.keys += keys;
        self.busy += took;
        self.lat.push(took);
    }

    /// Keys per second inside the calls.
    pub(crate) fn rate(&self) -> f64 {
        self.keys as f64 / self.busy.as_secs_f64().max(1e-9)
    }

    fn percentile_ms(sorted: &[Duration], p: f64) -> f64 {
        if sorted.is_empty() {
            return 0.0;
        }
        let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
        sorted[i].as_secs_f64() * 1e3
    }

    /// `{rate, p50_ms, p99_ms, calls, keys}`.
    pub(crate) fn json(&self) -> Value {
        let mut sorted = self.lat.clone();
        sorted.sort_unstable();
        json!({
            "rate": self.rate(),
            "p50_ms": Self::percentile_ms(&sorted, 0.50),
            "p99_ms": Self::percentile_ms(&sorted, 0.99),
            "calls": self.lat.len(),
            "keys": self.keys,
        })
    }
}

/// Keeps the faster of two phases.
fn best(slot: &mut Option<Phase>, p: Phase) {
    if slot.as_ref().is_none_or(|s| p.rate() > s.rate()) {
        *slot = Some(p);
    }
}

/// A store under test and its raw baseline.
#[async_trait]
pub(crate) trait StoreBench: Send + Sync {
    /// The store (claims and completions go through it).
    fn store(&self) -> Arc<dyn DedupStore>;
    /// What the raw baseline is, for the report.
    fn baseline(&self) -> &'static str;
    /// The raw operation on `keys` (fresh): insert each unless present, in one round trip.
    async fn raw(&self, keys: &[String]) -> anyhow::Result<()>;
    /// The server's version string ("" for in-process stores).
    async fn server(&self) -> anyhow::Result<String>;
    /// Drops what the run created on the server.
    async fn cleanup(&self) -> anyhow::Result<()>;
}

/// Fresh keys `b-<seq>` under `group`.
pub(crate) struct KeySeq {
    group: ConsumerGroup,
    prefix: String,
    next: usize,
}

impl KeySeq {
    pub(crate) fn new(prefix: &str) -> anyhow::Result<Self> {
        Ok(Self {
            group: ConsumerGroup::new(&format!("bench-{:08x}", rand::random::<u32>()))?,
            prefix: prefix.to_owned(),
            next: 0,
        })
    }

    pub(crate) fn group(&self) -> &ConsumerGroup {
        &self.group
    }

    pub(crate) fn keys(&mut self, n: usize) -> anyhow::Result<Vec<DedupKey>> {
        let out = (self.next..self.next + n)
            .map(|i| DedupKey::new(&self.group, &format!("{}-{i}", self.prefix)))
            .collect::<Result<Vec<_>, _>>()?;
        self.next += n;
        Ok(out)
    }

    pub(crate) fn claims(&mut self, n: usize) -> anyhow::Result<Vec<ClaimRequest>> {
        Ok(self
            .keys(n)?
            .into_iter()
            .map(|k| ClaimRequest::new(k, LEASE).with_worker("bench"))
            .collect())
    }
}

/// The completions of a batch's acquired claims; fails if a fresh key was not acquired.
pub(crate) fn completions(
    reqs: &[ClaimRequest],
    out: Vec<ClaimOutcome>,
) -> anyhow::Result<Vec<Completion>> {
    anyhow::ensure!(
        out.len() == reqs.len(),
        "claim_batch answered {} of {}",
        out.len(),
        reqs.len()
    );
    reqs.iter()
        .zip(out)
        .map(|(r, o)| match o {
            ClaimOutcome::Acquired(l) => Ok(Completion {
                key: r.key.clone(),
                token: l.token,
                result: None,
                retention: RETAIN,
            }),
            other => Err(anyhow::anyhow!(
                "fresh key {} not acquired: {other:?}",
                r.key
            )),
        })
        .collect()
}

/// Claims and completes `reqs` through `store` (what a consumer's batch costs).
pub(crate) async fn claim_complete(
    store: &dyn DedupStore,
    reqs: &[ClaimRequest],
) -> anyhow::Result<()> {
    let out = store.claim_batch(reqs).await?;
    let items = completions(reqs, out)?;
    let done = store.complete_batch(&items).await?;
    anyhow::ensure!(
        done.iter().all(|d| *d == CompleteOutcome::Completed),
        "a fresh completion was fenced"
    );
    Ok(())
}

/// Runs the batch-size sweep on one store: raw, claim, claim+complete at each batch size.
pub(crate) async fn sweep(name: &str, b: &dyn StoreBench, sizes: &Sizes) -> anyhow::Result<Value> {
    let store = b.store();
    let mut seq = KeySeq::new("b")?;
    let mut points = Vec::new();
    for &batch in &sizes.batches {
        let (mut raw, mut claim, mut both) = (None, None, None);
        for _ in 0..sizes.rounds {
            let mut p = Phase::default();
            while p.more(sizes.phase_secs) {
                let keys: Vec<String> = seq
                    .keys(batch)?
                    .into_iter()
                    .map(|k| k.as_str().to_owned())
                    .collect();
                let t = Instant::now();
                b.raw(&keys).await?;
                p.record(batch, t.elapsed());
            }
            best(&mut raw, p);
            let mut p = Phase::default();
            while p.more(sizes.phase_secs) {
                let reqs = seq.claims(batch)?;
                let t = Instant::now();
                let out = store.claim_batch(&reqs).await?;
                p.record(batch, t.elapsed());
                completions(&reqs, out)?;
            }
            best(&mut claim, p);
            let mut p = Phase::default();
            while p.more(sizes.phase_secs) {
                let reqs = seq.claims(batch)?;
                let t = Instant::now();
                claim_complete(store.as_ref(), &reqs).await?;
                p.record(batch, t.elapsed());
            }
            best(&mut both, p);
        }
        let j = |p: Option<Phase>| p.map_or(Value::Null, |p| p.json());
        points.push(json!({
            "batch": batch,
            "raw": j(raw),
            "claim": j(claim),
            "claim_complete": j(both),
        }));
    }
    let server = b
        .server()
        .await
        .unwrap_or_else(|e| format!("unknown ({e})"));
    b.cleanup().await?;
    Ok(json!({
        "store": name,
        "baseline": b.baseline(),
        "clients": 1,
        "server": server,
        "points": points,
    }))
}

/// The in-process stores' baseline: a `HashMap` insert-if-absent under a `Mutex`.
#[derive(Default)]
struct LockedMap(Mutex<HashMap<String, i64>>);

impl LockedMap {
    fn insert_all(&self, keys: &[String]) -> anyhow::Result<()> {
        let mut m = self
            .0
            .lock()
            .map_err(|_| anyhow::anyhow!("baseline map poisoned"))?;
        for k in keys {
            m.entry(k.clone())
                .or_insert_with(|| FencingToken::random().0);
        }
        Ok(())
    }
}

/// An in-process store ([`MemoryStore`], or the layered store over it).
pub(crate) struct InProcess {
    store: Arc<dyn DedupStore>,
    map: LockedMap,
}

impl InProcess {
    pub(crate) fn memory() -> Self {
        Self {
            store: Arc::new(MemoryStore::new()),
            map: LockedMap::default(),
        }
    }

    #[cfg(feature = "layered")]
    pub(crate) fn layered() -> anyhow::Result<Self> {
        let store = idemq::layered::LayeredStore::builder(Arc::new(MemoryStore::new()))
            .cache(10_000_000, Duration::from_secs(3600))
            .build()?;
        Ok(Self {
            store: Arc::new(store),
            map: LockedMap::default(),
        })
    }
}

#[async_trait]
impl StoreBench for InProcess {
    fn store(&self) -> Arc<dyn DedupStore> {
        self.store.clone()
    }
    fn baseline(&self) -> &'static str {
        "std HashMap insert-if-absent under a Mutex, same keys per call"
    }
    async fn raw(&self, keys: &[String]) -> anyhow::Result<()> {
        self.map.insert_all(keys)
    }
    async fn server(&self) -> anyhow::Result<String> {
        Ok(String::new())
    }
    async fn cleanup(&self) -> anyhow::Result<()> {
        Ok(())
    }
}

/// A SQL store and a scratch table `(k <key type> PRIMARY KEY, v BIGINT)` for the raw
/// multi-row insert.
pub(crate) struct Sql<DB: idemq::sql::SqlBackend> {
    store: Arc<idemq::sql::SqlStore<DB>>,
    scratch: String,
    version_sql: &'static str,
}

impl<DB: idemq::sql::SqlBackend> Sql<DB>
where
    idemq::sql::SqlStore<DB>: DedupStore,
{
    /// A fresh store table and scratch table on `url`.
    pub(crate) async fn open(
        connect: impl std::future::Future<Output = Result<idemq::sql::SqlStore<DB>, StoreError>>,
    ) -> anyhow::Result<Self> {
        let store = Arc::new(connect.await?);
        let d = DB::DIALECT.name();
        let key_type = match d {
            "postgres" => "VARCHAR(257) COLLATE \"C\"",
            "mysql" => "VARBINARY(257)",
            _ => "TEXT",
        };
        let scratch = format!("bench_raw_{:08x}", rand::random::<u32>());
        let mut conn = store.pool().acquire().await?;
        DB::execute(
            &mut conn,
            &format!(
                "CREATE TABLE {scratch} (k {key_type} NOT NULL PRIMARY KEY, v BIGINT NOT NULL)"
            ),
            vec![],
        )
        .await?;
        let version_sql = match d {
            "sqlite" => "SELECT 'SQLite ' || sqlite_version()",
            _ => "SELECT version()",
        };
        Ok(Self {
            store,
            scratch,
            version_sql,
        })
    }

    /// Options for a store with a table of its own and batches up to 1000.
    pub(crate) fn options() -> anyhow::Result<idemq::sql::SqlStoreOptions> {
        Ok(idemq::sql::SqlStoreOptions {
            table: idemq::sql::TableName::new(&format!("bench_s_{:08x}", rand::random::<u32>()))?,
            max_batch: 1000,
            ..idemq::sql::SqlStoreOptions::default()
        })
    }

    /// The store.
    pub(crate) fn sql_store(&self) -> &Arc<idemq::sql::SqlStore<DB>> {
        &self.store
    }
}

#[async_trait]
impl<DB: idemq::sql::SqlBackend> StoreBench for Sql<DB>
where
    idemq::sql::SqlStore<DB>: DedupStore,
{
    fn store(&self) -> Arc<dyn DedupStore> {
        self.store.clone()
    }
    fn baseline(&self) -> &'static str {
        match DB::DIALECT.name() {
            "mysql" => "multi-row INSERT IGNORE (k, v) into a scratch table keyed like the dedup table",
            _ => "multi-row INSERT (k, v) … ON CONFLICT DO NOTHING into a scratch table keyed like the dedup table",
        }
    }
    async fn raw(&self, keys: &[String]) -> anyhow::Result<()> {
        use idemq::sql::Val;
        let mysql = DB::DIALECT.name() == "mysql";
        let mut sql = format!(
            "INSERT {}INTO {} (k, v) VALUES ",
            if mysql { "IGNORE " } else { "" },
            self.scratch
        );
        let mut args = Vec::with_capacity(keys.len() * 2);
        for (i, k) in keys.iter().enumerate() {
            sql.push_str(if i == 0 { "(?, ?)" } else { ", (?, ?)" });
            args.push(Val::Key(k.clone()));
            args.push(Val::I64(Some(FencingToken::random().0)));
        }
        if !mysql {
            sql.push_str(" ON CONFLICT DO NOTHING");
        }
        let sql = DB::DIALECT.placeholders(sql);
        let mut conn = self.store.pool().acquire().await?;
        DB::execute(&mut conn, &sql, args).await?;
        Ok(())
    }
    async fn server(&self) -> anyhow::Result<String> {
        let mut conn = self.store.pool().acquire().await?;
        let rows = DB::fetch(
            &mut conn,
            self.version_sql,
            vec![],
            &[idemq::sql::Kind::Text],
        )
        .await?;
        let row = rows
            .first()
            .ok_or_else(|| anyhow::anyhow!("no version row"))?;
        Ok(row.text(0).map_err(anyhow::Error::msg)?.to_owned())
    }
    async fn cleanup(&self) -> anyhow::Result<()> {
        let mut conn = self.store.pool().acquire().await?;
        let mut tables = vec![self.scratch.clone()];
        tables.extend(self.store.tables().iter().map(|t| t.to_string()));
        for t in tables {
            DB::execute(&mut conn, &format!("DROP TABLE IF EXISTS {t}"), vec![]).await?;
        }
        Ok(())
    }
}

/// The Redis store and raw pipelined `SET key token NX PX ttl` on its own connection.
#[cfg(feature = "redis")]
pub(crate) struct Redis {
    store: Arc<idemq::redis::RedisStore>,
    raw: idemq::redis::redis::aio::MultiplexedConnection,
    run: String,
}

#[cfg(feature = "redis")]
impl Redis {
    pub(crate) async fn open(url: &str) -> anyhow::Result<Self> {
        let run = format!("{:08x}", rand::random::<u32>());
        let store = idemq::redis::RedisStore::builder(url)
            .prefix(format!("bench-{run}"))
            .max_keys_per_script(1000)
            .connect()
            .await?;
        let raw = idemq::redis::redis::Client::open(url)?
            .get_multiplexed_async_connection()
            .await?;
        Ok(Self {
            store: Arc::new(store),
            raw,
            run,
        })
    }

    /// The store.
    pub(crate) fn redis_store(&self) -> &Arc<idemq::redis::RedisStore> {
        &self.store
    }

    /// A connection of its own.
    pub(crate) fn connection(&self) -> idemq::redis::redis::aio::MultiplexedConnection {
        self.raw.clone()
    }
}

#[cfg(feature = "redis")]
#[async_trait]
impl StoreBench for Redis {
    fn store(&self) -> Arc<dyn DedupStore> {
        self.store.clone()
    }
    fn baseline(&self) -> &'static str {
        "pipelined SET key token NX PX ttl, one pipeline per call"
    }
    async fn raw(&self, keys: &[String]) -> anyhow::Result<()> {
        let ttl = u64::try_from(LEASE.as_millis()).unwrap_or(u64::MAX);
        let mut pipe = idemq::redis::redis::pipe();
        for k in keys {
            pipe.cmd("SET")
                .arg(format!("bench-raw-{}:{k}", self.run))
                .arg(FencingToken::random().0)
                .arg("NX")
                .arg("PX")
                .arg(ttl);
        }
        let mut con = self.raw.clone();
        let replies: Vec<Option<String>> = pipe.query_async(&mut con).await?;
        anyhow::ensure!(
            replies.iter().all(Option::is_some),
            "a fresh raw SET NX was refused"
        );
        Ok(())
    }
    async fn server(&self) -> anyhow::Result<String> {
        let mut con = self.raw.clone();
        let info: String = idemq::redis::redis::cmd("INFO")
            .arg("server")
            .query_async(&mut con)
            .await?;
        Ok(info
            .lines()
            .find_map(|l| l.strip_prefix("redis_version:"))
            .map(|v| format!("Redis {}", v.trim()))
            .unwrap_or_default())
    }
    async fn cleanup(&self) -> anyhow::Result<()> {
        // Raw keys expire with their PX, records with their lease or retention.
        Ok(())
    }
}

/// The NATS JetStream KV store (a fresh bucket, one node) and raw KV `create`s of fresh
/// keys on the same bucket, all of a call in flight at once (KV has no multi-key write).
#[cfg(feature = "nats-kv")]
pub(crate) struct NatsKv {
    store: Arc<idemq::nats_kv::NatsKvStore>,
    raw: idemq::nats_kv::async_nats::jetstream::kv::Store,
    js: idemq::nats_kv::async_nats::jetstream::Context,
    bucket: String,
}

#[cfg(feature = "nats-kv")]
impl NatsKv {
    pub(crate) async fn open(url: &str) -> anyhow::Result<Self> {
        use idemq::nats_kv::{async_nats, NatsKvOptions, NatsKvStore};
        let bucket = format!("idemq_bench_{:08x}", rand::random::<u32>());
        let options = NatsKvOptions {
            bucket: bucket.clone(),
            ..NatsKvOptions::default()
        };
        let store = NatsKvStore::connect(url, options).await?;
        let js = async_nats::jetstream::new(store.client().clone());
        let raw = js.get_key_value(&bucket).await?;
        Ok(Self {
            store: Arc::new(store),
            raw,
            js,
            bucket,
        })
    }
}

#[cfg(feature = "nats-kv")]
#[async_trait]
impl StoreBench for NatsKv {
    fn store(&self) -> Arc<dyn DedupStore> {
        self.store.clone()
    }
    fn baseline(&self) -> &'static str {
        "KV create of each fresh key (revision 0), all of a call in flight at once"
    }
    async fn raw(&self, keys: &[String]) -> anyhow::Result<()> {
        let creates = keys.iter().map(|k| {
            let value = FencingToken::random().0.to_be_bytes().to_vec();
            // KV keys allow `-/_=.` besides letters and digits: the group's `:` becomes `=`.
            self.raw
                .create(format!("raw.{}", k.replace(':', "=")), value.into())
        });
        for r in futures::future::join_all(creates).await {
            r?;
        }
        Ok(())
    }
    async fn server(&self) -> anyhow::Result<String> {
        let info = self.store.client().server_info();
        Ok(format!("nats-server {}", info.version))
    }
    async fn cleanup(&self) -> anyhow::Result<()> {
        self.js.delete_key_value(&self.bucket).await?;
        Ok(())
    }
}

/// A primary that keeps nothing: every claim acquires, every completion succeeds. Under
/// the layered store it isolates the local layer's own cost (time and memory).
pub(crate) struct NullStore;

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

#[async_trait]
impl DedupStore for NullStore {
    async fn claim_batch(&self, reqs: &[ClaimRequest]) -> Result<Vec<ClaimOutcome>, StoreError> {
        let now = now_ms();
        Ok(reqs
            .iter()
            .map(|r| {
                ClaimOutcome::Acquired(Lease {
                    token: r.token.unwrap_or_else(FencingToken::random),
                    until_ms: now + i64::try_from(r.lease.as_millis()).unwrap_or(i64::MAX / 2),
                    attempt: 1,
                    takeover: false,
                })
            })
            .collect())
    }
    async fn complete_batch(
        &self,
        items: &[Completion],
    ) -> Result<Vec<CompleteOutcome>, StoreError> {
        Ok(vec![CompleteOutcome::Completed; items.len()])
    }
    async fn release(
        &self,
        _key: &DedupKey,
        _token: FencingToken,
    ) -> Result<ReleaseOutcome, StoreError> {
        Ok(ReleaseOutcome::Released)
    }
    async fn extend(
        &self,
        _key: &DedupKey,
        _token: FencingToken,
        lease: Duration,
    ) -> Result<ExtendOutcome, StoreError> {
        Ok(ExtendOutcome::Extended {
            until_ms: now_ms() + i64::try_from(lease.as_millis()).unwrap_or(i64::MAX / 2),
        })
    }
    async fn get(&self, _key: &DedupKey) -> Result<Option<DedupRecord>, StoreError> {
        Ok(None)
    }
    async fn purge_expired(&self, _limit: usize) -> Result<u64, StoreError> {
        Ok(0)
    }
    async fn list_stuck(
        &self,
        _stale_for: Duration,
        _limit: usize,
    ) -> Result<Vec<DedupRecord>, StoreError> {
        Ok(Vec::new())
    }
    async fn forget(&self, _key: &DedupKey) -> Result<bool, StoreError> {
        Ok(false)
    }
}

/// Resident set size of this process, bytes (Linux; 0 elsewhere).
pub(crate) fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| {
            s.split_whitespace()
                .nth(1)
                .and_then(|v| v.parse::<u64>().ok())
        })
        .map_or(0, |pages| pages * 4096)
}

/// Claims and completes `n` keys of `seq` through `store`, 1000 at a time.
pub(crate) async fn fill(store: &dyn DedupStore, seq: &mut KeySeq, n: usize) -> anyhow::Result<()> {
    let mut left = n;
    while left > 0 {
        let k = left.min(1000);
        let reqs = seq.claims(k)?;
        claim_complete(store, &reqs).await?;
        left -= k;
    }
    Ok(())
}

/// Keys per call of the local layer's batched checks: a polled batch of the engine's
/// default configuration (`ConsumerConfig::max_batch`).
#[cfg(feature = "layered")]
const LOCAL_CHECK_BATCH: usize = 100;

/// The local layer alone (over [`NullStore`]): duplicate checks/s on one core for each
/// retained-key count, and resident bytes per retained key.
#[cfg(feature = "layered")]
pub(crate) async fn local_layer(sizes: &Sizes) -> anyhow::Result<Value> {
    use idemq::layered::LayeredStore;
    use std::hint::black_box;
    let mut points = Vec::new();
    for &n in &sizes.local_keys {
        // Read before the layer is built: its table is allocated then, whatever it holds.
        let before = rss_bytes();
        let layer = LayeredStore::builder(Arc::new(NullStore))
            .cache(n as u64 + 1000, Duration::from_secs(3600))
            .build()?;
        let mut seq = KeySeq::new("l")?;
        fill(&layer, &mut seq, n).await?;
        let after = rss_bytes();
        // The check loop's keys, built after the memory reading (the layer holds its own).
        let mut again = KeySeq {
            group: seq.group.clone(),
            prefix: seq.prefix.clone(),
            next: 0,
        };
        let keys = again.keys(n)?;
        let mut hits = 0usize;
        let mut checks = 0usize;
        let start = Instant::now();
        while checks == 0 || start.elapsed().as_secs_f64() < sizes.phase_secs * 2.0 {
            for k in &keys {
                hits += usize::from(black_box(layer.is_cached_duplicate(black_box(k))));
            }
            checks += keys.len();
        }
        let secs = start.elapsed().as_secs_f64();
        // The same checks as the engine's claims ask them: a batch at a time.
        let mut batched = 0usize;
        let mut batched_hits = 0usize;
        let start = Instant::now();
        while batched == 0 || start.elapsed().as_secs_f64() < sizes.phase_secs * 2.0 {
            for chunk in keys.chunks(LOCAL_CHECK_BATCH) {
                let found = black_box(layer.cached_duplicates(black_box(chunk)));
                batched_hits += found.iter().filter(|h| **h).count();
            }
            batched += keys.len();
        }
        let batched_secs = start.elapsed().as_secs_f64();
        points.push(json!({
            "keys": n,
            "checks_per_sec": checks as f64 / secs.max(1e-9),
            "batched_checks_per_sec": batched as f64 / batched_secs.max(1e-9),
            "batched_hit_ratio": batched_hits as f64 / batched.max(1) as f64,
            "check_batch": LOCAL_CHECK_BATCH,
            "hit_ratio": hits as f64 / checks.max(1) as f64,
            "bytes_per_key": after.saturating_sub(before) as f64 / n.max(1) as f64,
            "rss_before": before,
            "rss_after": after,
        }));
        drop(keys);
        drop(layer);
    }
    Ok(json!({
        "what": "LayeredStore::is_cached_duplicate (one key per call) and LayeredStore::cached_duplicates (100 keys per call, as the engine's claims ask the cache at its default batch size) on one thread over a primary that keeps nothing, cache sized for the keys + 1000; bytes = resident set growth from before the layer was built to after filling / keys",
        "points": points,
    }))
}

/// A server URL from the environment (`eval "$(scripts/servers.sh env)"`).
pub(crate) fn env_url(var: &str) -> anyhow::Result<String> {
    std::env::var(var)
        .ok()
        .filter(|v| !v.is_empty())
        .ok_or_else(|| anyhow::anyhow!("{var} is not set (eval \"$(scripts/servers.sh env)\")"))
}

/// The PostgreSQL store of the store sweep and the storm.
#[cfg(feature = "postgres")]
pub(crate) async fn postgres() -> anyhow::Result<Sql<idemq::sql::sqlx::Postgres>> {
    use idemq::sql::{sqlx::Postgres, PgStore};
    let url = env_url("IDEMQ_TEST_POSTGRES_URL")?;
    let opts = Sql::<Postgres>::options()?;
    Sql::<Postgres>::open(PgStore::connect(&url, opts)).await
}
