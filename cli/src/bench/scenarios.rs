//! The scenarios of `idemq bench suite`, each run by `idemq bench scenario NAME` in a
//! process of its own and answered as one JSON object.

use super::sizes::Sizes;
use super::stores::env_url;
#[cfg(feature = "postgres")]
use super::stores::postgres;
use super::stores::{self, KeySeq};
use idemq::{DedupStore, MemoryStore};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Deliveries per poll in the engine scenarios (the engine's claims per round trip).
const ENGINE_BATCH: usize = 256;

#[allow(dead_code)]
fn not_built(feature: &str) -> anyhow::Error {
    anyhow::anyhow!(
        "this binary was built without the `{feature}` feature (build with --all-features)"
    )
}

/// Runs scenario `name`.
pub async fn run(name: &str, sizes: &Sizes) -> anyhow::Result<Value> {
    match name {
        "engine" => engine(sizes).await,
        "store-memory" => stores::sweep("memory", &stores::InProcess::memory(), sizes).await,
        "store-layered" => {
            #[cfg(feature = "layered")]
            return stores::sweep("layered", &stores::InProcess::layered()?, sizes).await;
            #[cfg(not(feature = "layered"))]
            return Err(not_built("layered"));
        }
        "store-sqlite" => {
            use idemq::sql::{sqlx::Sqlite, SqliteStore};
            let dir = std::env::temp_dir().join(format!("idemq-bench-{}", std::process::id()));
            std::fs::create_dir_all(&dir)?;
            let url = format!("sqlite://{}?mode=rwc", dir.join("bench.db").display());
            let opts = stores::Sql::<Sqlite>::options()?;
            let b = stores::Sql::<Sqlite>::open(SqliteStore::connect(&url, opts)).await?;
            let out = stores::sweep("sqlite", &b, sizes).await;
            drop(b);
            let _ = std::fs::remove_dir_all(&dir);
            out
        }
        "store-postgres" => {
            #[cfg(feature = "postgres")]
            {
                let b = postgres().await?;
                return stores::sweep("postgres", &b, sizes).await;
            }
            #[cfg(not(feature = "postgres"))]
            return Err(not_built("postgres"));
        }
        "store-mysql" => {
            #[cfg(feature = "mysql")]
            {
                use idemq::sql::{sqlx::MySql, MySqlStore};
                let url = env_url("IDEMQ_TEST_MYSQL_URL")?;
                let opts = stores::Sql::<MySql>::options()?;
                let b = stores::Sql::<MySql>::open(MySqlStore::connect(&url, opts)).await?;
                return stores::sweep("mysql", &b, sizes).await;
            }
            #[cfg(not(feature = "mysql"))]
            return Err(not_built("mysql"));
        }
        "store-redis" => {
            #[cfg(feature = "redis")]
            {
                let b = stores::Redis::open(&env_url("IDEMQ_TEST_REDIS_URL")?).await?;
                return stores::sweep("redis", &b, sizes).await;
            }
            #[cfg(not(feature = "redis"))]
            return Err(not_built("redis"));
        }
        "store-nats-kv" => {
            #[cfg(feature = "nats-kv")]
            {
                let b = stores::NatsKv::open(&env_url("IDEMQ_TEST_NATS_URL")?).await?;
                return stores::sweep("nats-kv", &b, sizes).await;
            }
            #[cfg(not(feature = "nats-kv"))]
            return Err(not_built("nats-kv"));
        }
        "local-layer" => {
            #[cfg(feature = "layered")]
            return stores::local_layer(sizes).await;
            #[cfg(not(feature = "layered"))]
            return Err(not_built("layered"));
        }
        "storm" => {
            #[cfg(all(feature = "layered", feature = "postgres"))]
            return storm(sizes).await;
            #[cfg(not(all(feature = "layered", feature = "postgres")))]
            return Err(not_built("layered and postgres"));
        }
        "growth-postgres" => {
            #[cfg(feature = "postgres")]
            return super::growth::postgres(sizes).await;
            #[cfg(not(feature = "postgres"))]
            return Err(not_built("postgres"));
        }
        "growth-redis" => {
            #[cfg(feature = "redis")]
            return super::growth::redis(sizes).await;
            #[cfg(not(feature = "redis"))]
            return Err(not_built("redis"));
        }
        "growth-local" => {
            #[cfg(feature = "layered")]
            return super::growth::local(sizes).await;
            #[cfg(not(feature = "layered"))]
            return Err(not_built("layered"));
        }
        "broker-rabbitmq" | "broker-kafka" | "broker-rocketmq" | "broker-nats"
        | "kafka-producer" | "kafka-group" => super::brokers_json(name, sizes).await,
        other => anyhow::bail!("unknown scenario {other:?}"),
    }
}

/// The engine over the memory store and over SQLite against the bare poll+ack consumer of
/// the in-memory broker, best of `rounds` interleaved rounds.
async fn engine(sizes: &Sizes) -> anyhow::Result<Value> {
    let n = sizes.engine_messages;
    let (mut base, mut mem) = (Duration::MAX, Duration::MAX);
    for _ in 0..sizes.rounds.max(2) {
        base = base.min(super::baseline(n, ENGINE_BATCH).await?);
        mem = mem.min(super::engine(Arc::new(MemoryStore::new()), n, ENGINE_BATCH).await?);
    }
    let rate = |d: Duration| n as f64 / d.as_secs_f64().max(1e-9);
    Ok(json!({
        "messages": n,
        "batch": ENGINE_BATCH,
        "bare_rate": rate(base),
        "memory_rate": rate(mem),
    }))
}

/// Replays `n` messages (`m-0` … under `group`, all completed before) through the engine
/// over `store`; every one must be answered as a duplicate.
pub(crate) async fn replay(
    store: Arc<dyn DedupStore>,
    group: &str,
    n: usize,
) -> anyhow::Result<Duration> {
    let (el, s) = super::engine_stats(store, group, n, ENGINE_BATCH).await?;
    anyhow::ensure!(
        s.duplicates == n as u64 && s.processed == 0,
        "the replay was not all duplicates: {s:?}"
    );
    Ok(el)
}

/// Seed 002's duplicate storm, scaled: `storm_keys` messages already processed (completed
/// in PostgreSQL through the layered store) are replayed after an offset reset. The local
/// layer answers them; the PostgreSQL store alone replays a sample; the bare poll+ack of
/// the same messages is the ceiling.
#[cfg(all(feature = "layered", feature = "postgres"))]
async fn storm(sizes: &Sizes) -> anyhow::Result<Value> {
    use idemq::layered::LayeredStore;
    let n = sizes.storm_keys;
    let pg = postgres().await?;
    let primary: Arc<dyn DedupStore> = pg.sql_store().clone();
    let layered = Arc::new(
        LayeredStore::builder(primary.clone())
            .cache(n as u64 + 1000, Duration::from_secs(3600))
            .build()?,
    );
    let mut seq = KeySeq::new("m")?;
    let group = seq.group().as_str().to_owned();
    let t = Instant::now();
    stores::fill(layered.as_ref(), &mut seq, n).await?;
    let fill_secs = t.elapsed().as_secs_f64();
    let (mut bare, mut local, mut remote) = (Duration::MAX, Duration::MAX, Duration::MAX);
    let sample = sizes.storm_store_sample.min(n).max(1);
    for _ in 0..sizes.rounds {
        bare = bare.min(super::baseline(n, ENGINE_BATCH).await?);
        local = local.min(replay(layered.clone(), &group, n).await?);
        remote = remote.min(replay(primary.clone(), &group, sample).await?);
    }
    let hits = layered.stats().cache_hits;
    let server = stores::StoreBench::server(&pg).await.unwrap_or_default();
    stores::StoreBench::cleanup(&pg).await?;
    let rate = |k: usize, d: Duration| k as f64 / d.as_secs_f64().max(1e-9);
    Ok(json!({
        "messages": n,
        "store_sample": sample,
        "fill_secs": fill_secs,
        "bare_rate": rate(n, bare),
        "layered_rate": rate(n, local),
        "postgres_rate": rate(sample, remote),
        "cache_hits": hits,
        "server": server,
        "store": "postgres",
    }))
}
