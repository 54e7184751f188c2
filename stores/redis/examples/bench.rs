//! Throughput benchmark (not a test): run in release against a real server.
//!
//! ```text
//! eval "$(scripts/servers.sh env)"
//! cargo run --release -p idemq-redis --example bench -- [keys] [depth] [clients]
//! ```
//!
//! Prints, in one run against the same server:
//! 1. fresh-key claims/s through `RedisStore::claim_batch` (batches of `depth` keys: one
//!    pipeline of `SET NX GET`, the default) vs raw pipelined `SET key token NX PX ttl`
//!    with the same pipeline depth, same number of concurrent clients, each on its own
//!    connection; their ratio; the server CPU per key of each; and, for reference, the
//!    single-script mode (`fast_claims(false)`: one `EVALSHA` over the batch);
//! 2. local-layer duplicate checks/s on one thread (`LayeredStore` cache hits): the bare
//!    `is_cached_duplicate`, `check_local` (with the record), and the full async `claim`,
//!    for a hot set of 1000 keys and for 100 000 keys cycling (memory-bound);
//! 3. when `IDEMQ_REDIS_CLUSTER_URL` is set (`redis+cluster://...`, `servers.sh env`), the
//!    same on the Redis Cluster, in one run: `RedisStore::claim_batch` (fast claims) vs raw
//!    pipelined `SET NX PX` with the keys of each batch grouped per master, one pipeline per
//!    master on a connection of its own, all masters at once (what a hand-written client
//!    does); vs raw per-slot pipelines through the `redis` crate's cluster client (what it
//!    allows); and the store with `wait_replicas(1, ..)` (`WAIT 1` after each pipeline)
//!    as a ratio of the store without it.

use idemq_core::{
    ClaimOutcome, ClaimRequest, ConsumerGroup, DedupKey, DedupStore, FencingToken, MemoryStore,
};
use idemq_layered::LayeredStore;
use idemq_redis::redis;
use idemq_redis::RedisStore;
use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

const LEASE: Duration = Duration::from_secs(30);
const GRACE: Duration = Duration::from_secs(10);

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// Redis server CPU seconds (user + sys) so far, from `INFO cpu`.
async fn server_cpu(url: &str) -> Res<f64> {
    let mut con = raw_client(url).await?;
    let info: String = redis::cmd("INFO").arg("cpu").query_async(&mut con).await?;
    let mut total = 0.0;
    for line in info.lines() {
        if let Some(v) = line
            .strip_prefix("used_cpu_user:")
            .or_else(|| line.strip_prefix("used_cpu_sys:"))
        {
            total += v.trim().parse::<f64>()?;
        }
    }
    Ok(total)
}

fn arg(i: usize, default: usize) -> usize {
    std::env::args()
        .nth(i)
        .and_then(|a| a.parse().ok())
        .unwrap_or(default)
}

async fn raw_client(url: &str) -> Res<redis::aio::MultiplexedConnection> {
    Ok(redis::Client::open(url)?
        .get_multiplexed_async_connection()
        .await?)
}

/// Raw `SET NX PX` in pipelines of `depth`: keys/s.
async fn bench_raw(url: &str, run: &str, keys: usize, depth: usize, clients: usize) -> Res<f64> {
    let per = keys / clients;
    let ttl = (LEASE + GRACE).as_millis() as u64;
    let mut tasks = Vec::new();
    let start = Instant::now();
    for c in 0..clients {
        let mut con = raw_client(url).await?;
        let run = run.to_string();
        tasks.push(tokio::spawn(async move {
            let mut i = 0;
            let mut acquired = 0usize;
            while i < per {
                let n = depth.min(per - i);
                let mut pipe = redis::pipe();
                for j in 0..n {
                    pipe.cmd("SET")
                        .arg(format!("bench-raw-{run}:g:{c}-{}", i + j))
                        .arg(FencingToken::random().0)
                        .arg("NX")
                        .arg("PX")
                        .arg(ttl);
                }
                let replies: Vec<Option<String>> = pipe.query_async(&mut con).await?;
                acquired += replies.iter().filter(|r| r.is_some()).count();
                i += n;
            }
            Ok::<usize, redis::RedisError>(acquired)
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await??;
    }
    let secs = start.elapsed().as_secs_f64();
    assert_eq!(total, per * clients, "every raw SET NX acquired");
    Ok(total as f64 / secs)
}

/// `RedisStore::claim_batch` of `depth` fresh keys per call: claims/s. `wait`: the
/// store's `wait_replicas`.
async fn bench_store(
    url: &str,
    run: &str,
    keys: usize,
    depth: usize,
    clients: usize,
    fast: bool,
    wait: Option<(u32, Duration)>,
) -> Res<f64> {
    let per = keys / clients;
    let group = ConsumerGroup::new("g")?;
    let mut tasks = Vec::new();
    let start_barrier = Arc::new(tokio::sync::Barrier::new(clients + 1));
    for c in 0..clients {
        let mut builder = RedisStore::builder(url)
            .prefix(format!("bench-store-{run}"))
            .in_progress_grace(GRACE)
            .max_keys_per_script(depth.max(1))
            .fast_claims(fast);
        if let Some((n, timeout)) = wait {
            builder = builder.wait_replicas(n, timeout);
        }
        let store = builder.connect().await?;
        let group = group.clone();
        let barrier = start_barrier.clone();
        tasks.push(tokio::spawn(async move {
            // Keys are built before the clock starts, as the raw bench builds its strings
            // inside; the store builds its Redis keys inside too.
            let all: Vec<ClaimRequest> = (0..per)
                .map(|i| {
                    let k = DedupKey::new(&group, &format!("{c}-{i}")).expect("key");
                    ClaimRequest::new(k, LEASE)
                })
                .collect();
            barrier.wait().await;
            let mut acquired = 0usize;
            for chunk in all.chunks(depth) {
                let out = store.claim_batch(chunk).await?;
                acquired += out
                    .iter()
                    .filter(|o| matches!(o, ClaimOutcome::Acquired(_)))
                    .count();
            }
            Ok::<usize, idemq_core::StoreError>(acquired)
        }));
    }
    start_barrier.wait().await;
    let start = Instant::now();
    let mut total = 0;
    for t in tasks {
        total += t.await??;
    }
    let secs = start.elapsed().as_secs_f64();
    assert_eq!(total, per * clients, "every fresh key acquired");
    Ok(total as f64 / secs)
}

/// The masters of a cluster (`host:port`) and the master of each slot, from `CLUSTER
/// SLOTS` asked of the first seed of `url` (`redis+cluster://h:p,h:p/`).
async fn cluster_map(url: &str) -> Res<(Vec<String>, Vec<usize>)> {
    let first = url
        .trim_start_matches("redis+cluster://")
        .trim_end_matches('/')
        .split(',')
        .next()
        .ok_or("a cluster URL names its nodes")?
        .to_owned();
    let mut con = raw_client(&format!("redis://{first}/")).await?;
    let rows: Vec<redis::Value> = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query_async(&mut con)
        .await?;
    let mut masters: Vec<String> = Vec::new();
    let mut of_slot = vec![0usize; 16384];
    for row in rows {
        let redis::Value::Array(f) = row else {
            return Err("unexpected CLUSTER SLOTS row".into());
        };
        let (start, end): (usize, usize) = (
            redis::from_redis_value(&f[0])?,
            redis::from_redis_value(&f[1])?,
        );
        let node: Vec<redis::Value> = redis::from_redis_value(&f[2])?;
        let (host, port): (String, u16) = (
            redis::from_redis_value(&node[0])?,
            redis::from_redis_value(&node[1])?,
        );
        let addr = format!("{host}:{port}");
        let m = match masters.iter().position(|a| *a == addr) {
            Some(m) => m,
            None => {
                masters.push(addr);
                masters.len() - 1
            }
        };
        of_slot[start..=end].fill(m);
    }
    Ok((masters, of_slot))
}

/// Raw `SET NX PX` on a cluster, batches of `depth` keys: with `per_node`, each batch's
/// keys grouped per master, one pipeline per master on a connection of its own; else one
/// pipeline per slot through the `redis` crate's cluster client. All pipelines of a batch
/// at once. Keys/s.
async fn bench_raw_cluster(
    url: &str,
    run: &str,
    keys: usize,
    depth: usize,
    clients: usize,
    per_node: bool,
) -> Res<f64> {
    let (masters, of_slot) = cluster_map(url).await?;
    let of_slot = Arc::new(of_slot);
    let per = keys / clients;
    let ttl = (LEASE + GRACE).as_millis() as u64;
    let seeds = idemq_redis::cluster_seed_urls(url)?;
    let mut tasks = Vec::new();
    let barrier = Arc::new(tokio::sync::Barrier::new(clients + 1));
    for c in 0..clients {
        let mut nodes = Vec::new();
        for m in &masters {
            nodes.push(raw_client(&format!("redis://{m}/")).await?);
        }
        let cluster = redis::cluster::ClusterClient::new(seeds.clone())?
            .get_async_connection()
            .await?;
        let (run, of_slot, barrier) = (run.to_string(), of_slot.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            let keys: Vec<String> = (0..per)
                .map(|i| format!("bench-raw-{run}:g:{c}-{i}"))
                .collect();
            barrier.wait().await;
            let mut acquired = 0usize;
            for chunk in keys.chunks(depth) {
                // Group: per master, or per slot.
                let mut groups: Vec<(usize, u16, redis::Pipeline)> = Vec::new();
                for k in chunk {
                    let slot = idemq_redis::key_slot(k.as_bytes());
                    let id = if per_node {
                        of_slot[usize::from(slot)]
                    } else {
                        usize::from(slot)
                    };
                    let at = match groups.iter().position(|g| g.0 == id) {
                        Some(at) => at,
                        None => {
                            groups.push((id, slot, redis::pipe()));
                            groups.len() - 1
                        }
                    };
                    groups[at]
                        .2
                        .cmd("SET")
                        .arg(k)
                        .arg(FencingToken::random().0)
                        .arg("NX")
                        .arg("PX")
                        .arg(ttl);
                }
                let sends = groups.iter().map(|(id, slot, pipe)| {
                    let (mut node, mut cluster) = (
                        nodes[if per_node { *id } else { 0 }].clone(),
                        cluster.clone(),
                    );
                    let route = redis::cluster_routing::SingleNodeRoutingInfo::SpecificNode(
                        redis::cluster_routing::Route::new(
                            *slot,
                            redis::cluster_routing::SlotAddr::Master,
                        ),
                    );
                    async move {
                        let n = pipe.cmd_iter().count();
                        if per_node {
                            use redis::aio::ConnectionLike;
                            node.req_packed_commands(pipe, 0, n).await
                        } else {
                            cluster.route_pipeline(pipe, 0, n, route).await
                        }
                    }
                });
                for replies in futures::future::join_all(sends).await {
                    acquired += replies?.iter().filter(|v| **v != redis::Value::Nil).count();
                }
            }
            Ok::<usize, redis::RedisError>(acquired)
        }));
    }
    barrier.wait().await;
    let start = Instant::now();
    let mut total = 0;
    for t in tasks {
        total += t.await??;
    }
    let secs = start.elapsed().as_secs_f64();
    assert_eq!(total, per * clients, "every raw SET NX acquired");
    Ok(total as f64 / secs)
}

/// The cluster section: store vs raw per-node and per-slot pipelines, and the cost of
/// `WAIT 1`, alternating, best of three rounds each.
async fn bench_cluster(url: &str, run: &str, keys: usize, depth: usize, clients: usize) -> Res<()> {
    let wait = Some((1, Duration::from_secs(2)));
    // Warm up every path.
    bench_raw_cluster(url, &format!("{run}cw"), 20_000, depth, clients, true).await?;
    bench_raw_cluster(url, &format!("{run}cv"), 20_000, depth, clients, false).await?;
    bench_store(url, &format!("{run}cw"), 20_000, depth, clients, true, None).await?;
    bench_store(url, &format!("{run}cx"), 20_000, depth, clients, true, wait).await?;
    let (mut node, mut slot, mut store, mut waited) = (0f64, 0f64, 0f64, 0f64);
    for r in 0..3 {
        node = node
            .max(bench_raw_cluster(url, &format!("{run}cn{r}"), keys, depth, clients, true).await?);
        slot = slot.max(
            bench_raw_cluster(url, &format!("{run}cs{r}"), keys, depth, clients, false).await?,
        );
        store = store.max(
            bench_store(
                url,
                &format!("{run}cst{r}"),
                keys,
                depth,
                clients,
                true,
                None,
            )
            .await?,
        );
        waited = waited.max(
            bench_store(
                url,
                &format!("{run}cwt{r}"),
                keys,
                depth,
                clients,
                true,
                wait,
            )
            .await?,
        );
    }
    println!("cluster {url}");
    println!("  raw SET NX PX, pipeline per master : {node:>12.0} keys/s");
    println!(
        "  raw SET NX PX, pipeline per slot   : {slot:>12.0} keys/s (redis crate cluster client)"
    );
    println!(
        "  RedisStore::claim_batch            : {store:>12.0} claims/s = {:.1} % of per-master raw (target >= 70 %), {:.1} % of per-slot raw",
        100.0 * store / node,
        100.0 * store / slot
    );
    println!(
        "  with wait_replicas(1, 2 s)         : {waited:>12.0} claims/s = {:.1} % of the store without WAIT",
        100.0 * waited / store
    );
    Ok(())
}

/// Local-layer duplicate checks on one thread:
/// (is_cached_duplicate/s, sync check_local/s, async claim/s).
fn bench_local(n_keys: usize, rounds: usize) -> Res<(f64, f64, f64)> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let layered = LayeredStore::new(Arc::new(MemoryStore::new()));
        let group = ConsumerGroup::new("hot")?;
        let keys: Vec<DedupKey> = (0..n_keys)
            .map(|i| DedupKey::new(&group, &format!("order-{i}")))
            .collect::<Result<_, _>>()?;
        let reqs: Vec<ClaimRequest> = keys
            .iter()
            .map(|k| ClaimRequest::new(k.clone(), LEASE).with_worker("w1"))
            .collect();
        for chunk in reqs.chunks(1000) {
            let out = layered.claim_batch(chunk).await?;
            let items: Vec<idemq_core::Completion> = chunk
                .iter()
                .zip(out)
                .filter_map(|(r, o)| match o {
                    ClaimOutcome::Acquired(l) => Some(idemq_core::Completion {
                        key: r.key.clone(),
                        token: l.token,
                        result: Some("ok".into()),
                        retention: Duration::from_secs(3600),
                    }),
                    _ => None,
                })
                .collect();
            layered.complete_batch(&items).await?;
        }
        // The bare check: is this key a known duplicate?
        let start = Instant::now();
        let mut known = 0usize;
        for _ in 0..rounds {
            for k in &keys {
                known += usize::from(black_box(layered.is_cached_duplicate(black_box(k))));
            }
        }
        let check_rate = known as f64 / start.elapsed().as_secs_f64();
        assert_eq!(known, rounds * keys.len(), "all cached");
        // Sync: the cache lookup that answers a duplicate, with its record.
        let start = Instant::now();
        let mut hits = 0usize;
        for _ in 0..rounds {
            for k in &keys {
                hits += usize::from(black_box(layered.check_local(black_box(k), None)).is_some());
            }
        }
        let sync_rate = hits as f64 / start.elapsed().as_secs_f64();
        assert_eq!(hits, rounds * keys.len(), "all cached");
        // Async: the full DedupStore::claim path on a cache hit.
        let start = Instant::now();
        let mut dups = 0usize;
        for _ in 0..rounds {
            for r in &reqs {
                if let ClaimOutcome::Duplicate(_) = layered.claim(black_box(r)).await? {
                    dups += 1;
                }
            }
        }
        let async_rate = dups as f64 / start.elapsed().as_secs_f64();
        assert_eq!(dups, rounds * reqs.len(), "all duplicates");
        Ok((check_rate, sync_rate, async_rate))
    })
}

fn main() -> Res<()> {
    let keys = arg(1, 200_000);
    let depth = arg(2, 64);
    let clients = arg(3, 4);
    let url = std::env::var("IDEMQ_TEST_REDIS_URL")
        .unwrap_or_else(|_| "redis://127.0.0.1:22379/".to_string());
    let run = format!("{:08x}", FencingToken::random().0 & 0xffff_ffff);
    println!(
        "server {url}, {keys} fresh keys per round, pipeline depth {depth}, {clients} clients"
    );

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let (raw, store, scripted) = rt.block_on(async {
        // Warm up both paths (connections, script cache, allocator).
        bench_raw(&url, &format!("{run}w"), 20_000, depth, clients).await?;
        bench_store(&url, &format!("{run}w"), 20_000, depth, clients, true, None).await?;
        // Alternate the three, three rounds each, keep the best of each; also measure the
        // server's CPU time per key (what bounds throughput when the server saturates).
        let (mut raw, mut store, mut scripted) = (0f64, 0f64, 0f64);
        let (mut raw_cpu, mut store_cpu) = (0f64, 0f64);
        for r in 0..3 {
            let c0 = server_cpu(&url).await?;
            raw = raw.max(bench_raw(&url, &format!("{run}r{r}"), keys, depth, clients).await?);
            let c1 = server_cpu(&url).await?;
            store = store.max(
                bench_store(
                    &url,
                    &format!("{run}s{r}"),
                    keys,
                    depth,
                    clients,
                    true,
                    None,
                )
                .await?,
            );
            let c2 = server_cpu(&url).await?;
            scripted = scripted.max(
                bench_store(
                    &url,
                    &format!("{run}l{r}"),
                    keys,
                    depth,
                    clients,
                    false,
                    None,
                )
                .await?,
            );
            raw_cpu += c1 - c0;
            store_cpu += c2 - c1;
        }
        let per_key = |cpu: f64| 1e6 * cpu / (3 * keys) as f64;
        println!(
            "server CPU per key             : raw {:.2} us, store {:.2} us",
            per_key(raw_cpu),
            per_key(store_cpu)
        );
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>((raw, store, scripted))
    })?;
    println!("raw pipelined SET NX PX        : {:>12.0} keys/s", raw);
    println!("RedisStore::claim_batch        : {:>12.0} claims/s", store);
    println!(
        "ratio store / raw              : {:>11.1} %  (target >= 70 %)",
        100.0 * store / raw
    );
    println!(
        "single-script claims (fast_claims(false)): {:>9.0} claims/s ({:.1} % of raw)",
        scripted,
        100.0 * scripted / raw
    );
    if let Ok(cluster) = std::env::var("IDEMQ_REDIS_CLUSTER_URL") {
        rt.block_on(bench_cluster(&cluster, &run, keys, depth, clients))?;
    }
    drop(rt);

    // A replay storm hits a small hot set; 100k distinct keys cycling is the memory-bound case.
    for (n_keys, rounds) in [(1_000, 2_000), (100_000, 20)] {
        let (check_rate, sync_rate, async_rate) = bench_local(n_keys, rounds)?;
        println!(
            "local layer, {n_keys:>6} keys      : is_cached_duplicate {check_rate:>9.0}/s, \
             check_local {sync_rate:>9.0}/s, claim() {async_rate:>9.0}/s (one thread; target >= 5M/s)"
        );
    }
    Ok(())
}
