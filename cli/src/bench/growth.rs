//! Cost growth: claims/s of fresh keys while the store retains 0, 1M, 10M completed keys.
//!
//! The retained keys are loaded in the store's own format without going through the
//! claim path: one real key is claimed and completed through the store (the template),
//! then the server copies it under new keys (PostgreSQL: `INSERT … SELECT` over
//! `generate_series` with the template row's every column; Redis: a Lua loop `SET`ting the
//! template's value). The local layer is filled through its own claim + complete.

use super::sizes::Sizes;
use super::stores::{self, KeySeq, Phase};
use idemq::DedupStore;
use serde_json::{json, Value};
use std::time::Instant;

/// Claims per call in the growth scenarios.
pub(crate) const GROWTH_BATCH: usize = 100;

/// Rows loaded per PostgreSQL statement.
const CHUNK: usize = 250_000;
/// Keys loaded per Redis script (a script blocks the server while it runs: ~50 ms each).
const REDIS_CHUNK: usize = 50_000;

/// The retained-key counts, each followed by its claims/s.
async fn ladder<F, Fut>(
    store: &dyn DedupStore,
    sizes: &Sizes,
    chunk: usize,
    mut load: F,
) -> anyhow::Result<Vec<Value>>
where
    F: FnMut(usize, usize) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    let mut seq = KeySeq::new("g")?;
    // Warm up (connections, allocator, caches) so the empty store is not measured cold.
    claims_rate(store, &mut seq, sizes.phase_secs).await?;
    let mut loaded = 0usize;
    let mut points = Vec::new();
    for &target in &sizes.retained {
        let t = Instant::now();
        while loaded < target {
            let n = chunk.min(target - loaded);
            load(loaded, n).await?;
            loaded += n;
        }
        let load_secs = t.elapsed().as_secs_f64();
        let mut best: Option<Value> = None;
        for _ in 0..sizes.rounds {
            let r = claims_rate(store, &mut seq, sizes.phase_secs * 2.0).await?;
            if best
                .as_ref()
                .is_none_or(|b| r["rate"].as_f64() > b["rate"].as_f64())
            {
                best = Some(r);
            }
        }
        let mut point = best.unwrap_or(Value::Null);
        point["retained"] = json!(target);
        point["load_secs"] = json!(load_secs);
        points.push(point);
    }
    Ok(points)
}

/// PostgreSQL: rows copied from a template row by `generate_series`.
#[cfg(feature = "postgres")]
pub async fn postgres(sizes: &Sizes) -> anyhow::Result<Value> {
    use idemq::sql::sqlx;
    let b = stores::postgres().await?;
    let store = b.sql_store().clone();
    let table = store.options().table.as_str().to_owned();
    let mut tseq = KeySeq::new("grow")?;
    let template = tseq.claims(1)?;
    stores::claim_complete(store.as_ref(), &template).await?;
    let template_key = template[0].key.as_str().to_owned();
    let prefix = format!("{}:grow-x", tseq.group().as_str());
    let cols: Vec<String> = sqlx::query_scalar(
        "SELECT column_name::text FROM information_schema.columns \
         WHERE table_name = $1 ORDER BY ordinal_position",
    )
    .bind(&table)
    .fetch_all(store.pool())
    .await?;
    anyhow::ensure!(
        cols.iter().any(|c| c == "dedup_key"),
        "no dedup_key column in {table}: {cols:?}"
    );
    let select: Vec<String> = cols
        .iter()
        .map(|c| {
            if c == "dedup_key" {
                "$1 || g::text".to_owned()
            } else {
                format!("t.{c}")
            }
        })
        .collect();
    let insert = format!(
        "INSERT INTO {table} ({}) SELECT {} FROM {table} t, generate_series($2::bigint, $3::bigint) g \
         WHERE t.dedup_key = $4",
        cols.join(", "),
        select.join(", ")
    );
    let pool = store.pool().clone();
    let points = ladder(store.as_ref(), sizes, CHUNK, |from, n| {
        let (pool, insert, prefix, template_key, table) = (
            pool.clone(),
            insert.clone(),
            prefix.clone(),
            template_key.clone(),
            table.clone(),
        );
        async move {
            let done = sqlx::query(&insert)
                .bind(prefix)
                .bind(from as i64)
                .bind((from + n) as i64 - 1)
                .bind(template_key)
                .execute(&pool)
                .await?
                .rows_affected();
            anyhow::ensure!(done == n as u64, "loaded {done} of {n} rows");
            sqlx::query(&format!("ANALYZE {table}"))
                .execute(&pool)
                .await?;
            Ok(())
        }
    })
    .await?;
    let server = stores::StoreBench::server(&b).await.unwrap_or_default();
    stores::StoreBench::cleanup(&b).await?;
    Ok(json!({
        "store": "postgres",
        "server": server,
        "batch": GROWTH_BATCH,
        "how": "rows copied server-side from a completed template row (INSERT … SELECT … generate_series), then ANALYZE",
        "points": points,
    }))
}

/// Redis: the template record's value `SET` under new keys by a Lua loop.
#[cfg(feature = "redis")]
pub async fn redis(sizes: &Sizes) -> anyhow::Result<Value> {
    use idemq::redis::redis;
    let b = stores::Redis::open(&stores::env_url("IDEMQ_TEST_REDIS_URL")?).await?;
    let store = b.redis_store().clone();
    let mut tseq = KeySeq::new("grow")?;
    let template = tseq.claims(1)?;
    stores::claim_complete(store.as_ref(), &template).await?;
    let tkey = store.redis_key(&template[0].key);
    // Key names of the copies: the template's name with its sequence number replaced.
    let probe = idemq::DedupKey::new(tseq.group(), "grow-x12345")?;
    let probe_name = store.redis_key(&probe);
    let name_prefix = probe_name
        .strip_suffix("12345")
        .ok_or_else(|| anyhow::anyhow!("unexpected Redis key layout {probe_name}"))?
        .to_owned();
    let mut con = b.connection();
    let value: Vec<u8> = redis::cmd("GET").arg(&tkey).query_async(&mut con).await?;
    anyhow::ensure!(!value.is_empty(), "template record {tkey} not found");
    let script = redis::Script::new(
        "for i = tonumber(ARGV[2]), tonumber(ARGV[3]) do \
           redis.call('SET', ARGV[1] .. i, ARGV[4], 'PX', ARGV[5]) end return 1",
    );
    let del = redis::Script::new(
        "for i = tonumber(ARGV[2]), tonumber(ARGV[3]) do \
           redis.call('UNLINK', ARGV[1] .. i) end return 1",
    );
    // Long enough for the run; the loaded keys are deleted at the end anyway.
    let ttl_ms: u64 = 3_600_000;
    let points = {
        let (script, name_prefix, value) = (&script, &name_prefix, &value);
        let con = con.clone();
        ladder(store.as_ref(), sizes, REDIS_CHUNK, move |from, n| {
            let mut con = con.clone();
            async move {
                let _: i64 = script
                    .arg(name_prefix)
                    .arg(from)
                    .arg(from + n - 1)
                    .arg(value.as_slice())
                    .arg(ttl_ms)
                    .invoke_async(&mut con)
                    .await?;
                Ok(())
            }
        })
        .await?
    };
    let total = sizes.retained.iter().copied().max().unwrap_or(0);
    let mut from = 0;
    while from < total {
        let n = REDIS_CHUNK.min(total - from);
        let _: i64 = del
            .arg(&name_prefix)
            .arg(from)
            .arg(from + n - 1)
            .invoke_async(&mut con)
            .await?;
        from += n;
    }
    let server = stores::StoreBench::server(&b).await.unwrap_or_default();
    Ok(json!({
        "store": "redis",
        "server": server,
        "batch": GROWTH_BATCH,
        "how": "the template record's value SET under new keys by a Lua loop (PX 1 h), deleted afterwards",
        "points": points,
    }))
}

/// The local layer over a primary that keeps nothing, filled through claim + complete.
#[cfg(feature = "layered")]
pub async fn local(sizes: &Sizes) -> anyhow::Result<Value> {
    use idemq::layered::LayeredStore;
    use std::sync::Arc;
    let total = sizes.retained.iter().copied().max().unwrap_or(0);
    let layer = LayeredStore::builder(Arc::new(stores::NullStore))
        .cache(
            total as u64 + 1_000_000,
            std::time::Duration::from_secs(3600),
        )
        .build()?;
    let rss0 = stores::rss_bytes();
    let points = {
        let layer = &layer;
        ladder(layer, sizes, CHUNK, |from, n| async move {
            let mut seq = KeySeq::new(&format!("r{from}"))?;
            stores::fill(layer, &mut seq, n).await
        })
        .await?
    };
    let rss1 = stores::rss_bytes();
    Ok(json!({
        "store": "local",
        "batch": GROWTH_BATCH,
        "how": "LayeredStore over a primary that keeps nothing, filled by claim + complete; claims of fresh keys pass the layer",
        "rss_growth_bytes": rss1.saturating_sub(rss0),
        "points": points,
    }))
}

/// Claims of fresh keys at [`GROWTH_BATCH`] per call, for `secs`: the growth measure.
pub(crate) async fn claims_rate(
    store: &dyn DedupStore,
    seq: &mut KeySeq,
    secs: f64,
) -> anyhow::Result<Value> {
    let mut p = Phase::default();
    while p.more(secs) {
        let reqs = seq.claims(GROWTH_BATCH)?;
        let t = Instant::now();
        let out = store.claim_batch(&reqs).await?;
        p.record(GROWTH_BATCH, t.elapsed());
        stores::completions(&reqs, out)?;
    }
    Ok(p.json())
}
