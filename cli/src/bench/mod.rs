//! `idemq bench`: the engine's cost against the bare broker consumer, measured in one run.
//!
//! The baseline polls the in-memory broker and acks every delivery (no dedup at all). The
//! same messages then go through the idempotent consumer over the memory store and over a
//! SQLite file. Figures are printed as msgs/s and as a ratio to the baseline, since absolute
//! numbers on a shared machine mean little.

#[cfg(all(
    feature = "postgres",
    any(
        feature = "kafka",
        feature = "rabbitmq",
        feature = "rocketmq",
        feature = "nats"
    )
))]
pub mod broker;
#[cfg(all(feature = "postgres", feature = "kafka"))]
pub mod kafka;
#[cfg(all(feature = "postgres", feature = "nats"))]
mod nats;
#[cfg(all(feature = "postgres", feature = "rabbitmq"))]
mod rabbitmq;
#[cfg(all(feature = "postgres", feature = "rocketmq"))]
mod rocketmq;
#[cfg(feature = "postgres")]
mod unique;

// The suite's scenarios against servers compile with their stores' and brokers' features
// only; in a lighter build (the CLI alone) the helpers they share go unused.
#[cfg_attr(
    not(all(feature = "postgres", feature = "redis", feature = "layered")),
    allow(dead_code, unused_imports)
)]
mod growth;
mod report;
#[cfg_attr(
    not(all(feature = "postgres", feature = "redis", feature = "layered")),
    allow(dead_code, unused_imports)
)]
mod scenarios;
#[cfg_attr(
    not(all(feature = "postgres", feature = "redis", feature = "layered")),
    allow(dead_code)
)]
mod sizes;
#[cfg_attr(
    not(all(feature = "postgres", feature = "redis", feature = "layered")),
    allow(dead_code, unused_imports)
)]
mod stores;
#[cfg_attr(not(all(feature = "postgres", feature = "kafka")), allow(dead_code))]
pub mod suite;
mod svg;

use idemq::broker::MemoryBroker;
use idemq::sql::{SqlStoreOptions, SqliteStore};
use idemq::{
    BrokerKind, ClaimedMessage, ConsumerConfig, DedupStore, Envelope, HandlerError,
    IdempotentConsumer, KeyStrategy, MemoryStore, Source,
};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Options of `idemq bench`.
#[derive(clap::Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BenchArgs {
    /// The suite and its report (without one, the single engine/broker comparison below).
    #[command(subcommand)]
    op: Option<BenchOp>,
    /// Messages per run.
    #[arg(long, default_value_t = 50_000)]
    messages: usize,
    /// Deliveries per poll (and claims per round trip).
    #[arg(long, default_value_t = 256)]
    batch: usize,
    /// Interleaved rounds (baseline, then each store); the best time of each is reported.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Stores to run the engine over (comma-separated: memory, sqlite; with the postgres
    /// feature also `postgres` (the dedup table with leases: effect + completion in the
    /// handler's transaction), `postgres-unique` (the unique-index strategy, one effect
    /// statement per message in the batch's transaction) and `postgres-unique-batch` (the
    /// same with one multi-row effect statement per batch), compared with each other).
    #[arg(long, default_value = "memory,sqlite", value_delimiter = ',')]
    stores: Vec<String>,
    /// Benchmark these brokers instead (comma-separated: kafka, rabbitmq, rocketmq), each
    /// against its bare consumer and a hand-written `INSERT … ON CONFLICT` consumer. Needs
    /// the servers of `scripts/servers.sh` and a build with the brokers' features.
    #[arg(long, value_delimiter = ',')]
    brokers: Vec<String>,
    /// PostgreSQL for the broker benchmarks' effect table and store.
    #[arg(long, env = "IDEMQ_TEST_POSTGRES_URL")]
    postgres_url: Option<String>,
    /// Redis for the broker benchmarks' Redis store (the engine over it is skipped without).
    #[arg(long, env = "IDEMQ_TEST_REDIS_URL")]
    redis_url: Option<String>,
    /// The broker benchmarks' idempotent consumers run this many batches at once
    /// (`ConsumerConfig::pipeline_depth`; 1 is the default consumer).
    #[arg(long, default_value_t = 1)]
    pipeline_depth: usize,
    /// The broker benchmarks measure only these consumers (comma-separated: bare, memory,
    /// handwritten, bound3, unique-keyed, unique, batch-redis, batch-postgres, postgres,
    /// redis, and producer for Kafka's producer comparison; all by default). For profiling
    /// one consumer alone; a ratio needs its baseline in the list too.
    #[arg(long, value_delimiter = ',')]
    consumers: Vec<String>,
}

/// `idemq bench suite | scenario | report`.
#[derive(clap::Subcommand, Debug)]
enum BenchOp {
    /// Run every scenario (one process each) against the local servers, write the results
    /// (JSON) and regenerate docs/performance.md with its plots.
    ///
    /// Example: eval "$(scripts/servers.sh env)"; idemq bench suite --profile full
    Suite(suite::SuiteArgs),
    /// Run one scenario in this process and print its JSON object (what the suite runs).
    Scenario(suite::ScenarioArgs),
    /// Regenerate the report and plots from a results file, measuring nothing.
    Report(suite::ReportArgs),
}

fn fill(n: usize) -> MemoryBroker {
    let broker = MemoryBroker::new();
    for i in 0..n {
        broker.publish(
            Envelope::new(BrokerKind::MEMORY, "bench", format!("payload {i}"))
                .with_header("k", format!("m-{i}")),
        );
    }
    broker
}

async fn baseline(n: usize, batch: usize) -> anyhow::Result<Duration> {
    let broker = fill(n);
    let mut src = broker.subscribe();
    let t = Instant::now();
    while let Some(ds) = src.poll(batch).await? {
        for d in ds {
            d.ack().await?;
        }
    }
    Ok(t.elapsed())
}

async fn engine(store: Arc<dyn DedupStore>, n: usize, batch: usize) -> anyhow::Result<Duration> {
    let group = format!("bench-{:08x}", rand::random::<u32>());
    let (el, stats) = engine_stats(store, &group, n, batch).await?;
    anyhow::ensure!(
        stats.processed == n as u64,
        "bench lost messages: {stats:?}"
    );
    Ok(el)
}

/// The idempotent consumer over `store` (keys under `group`, no-op handler) draining `n`
/// fresh messages of the in-memory broker: its time and its counts.
async fn engine_stats(
    store: Arc<dyn DedupStore>,
    group: &str,
    n: usize,
    batch: usize,
) -> anyhow::Result<(Duration, idemq::ConsumerStats)> {
    let broker = fill(n);
    let c = IdempotentConsumer::new(
        store,
        KeyStrategy::header(group, "k")?,
        |_m: ClaimedMessage| async move { Ok::<_, HandlerError>(None) },
    )
    .with_config(ConsumerConfig {
        max_batch: batch,
        ..ConsumerConfig::default()
    });
    let t = Instant::now();
    c.run_until_idle(&mut broker.subscribe()).await?;
    Ok((t.elapsed(), c.stats()))
}

/// A newcomer's first-hour run: 400 payments with ~15% producer duplicates (455 messages)
/// over two consumers of one store, handlers of 2 ms. A duplicate that meets the other
/// consumer's in-flight claim used to wait out `in_flight_delay_max` (5 s).
async fn duplicates_meeting_local_claims() -> anyhow::Result<(Duration, u64)> {
    let broker = MemoryBroker::with_seed(455);
    broker.set_faults(idemq::broker::Faults {
        duplicate_publish_rate: 0.1375,
        ..Default::default()
    });
    for i in 0..400 {
        broker.publish(
            Envelope::new(BrokerKind::MEMORY, "payments", format!("payment {i}"))
                .with_header("k", format!("p-{i}")),
        );
    }
    let published = broker.published();
    let store: Arc<dyn DedupStore> = Arc::new(MemoryStore::new());
    let effects = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let make = || {
        let effects = effects.clone();
        IdempotentConsumer::new(
            store.clone(),
            KeyStrategy::header("first-hour", "k").expect("valid strategy"),
            move |_m: ClaimedMessage| {
                let effects = effects.clone();
                async move {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    effects.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    Ok::<_, HandlerError>(None)
                }
            },
        )
        .with_config(ConsumerConfig {
            max_batch: 32,
            ..ConsumerConfig::default()
        })
    };
    let (a, b) = (make(), make());
    let (mut sa, mut sb) = (broker.subscribe(), broker.subscribe());
    let t = Instant::now();
    let (ra, rb) = tokio::join!(a.run_until_idle(&mut sa), b.run_until_idle(&mut sb));
    ra?;
    rb?;
    let elapsed = t.elapsed();
    let applied = effects.load(std::sync::atomic::Ordering::Relaxed);
    anyhow::ensure!(applied == 400, "expected 400 effects, got {applied}");
    Ok((elapsed, published))
}

/// Runs the benchmark and prints one line per configuration.
pub async fn run(args: BenchArgs) -> anyhow::Result<ExitCode> {
    match args.op {
        Some(BenchOp::Suite(a)) => return suite::run(a).await.map(|()| ExitCode::SUCCESS),
        Some(BenchOp::Scenario(a)) => return suite::scenario(a).await.map(|()| ExitCode::SUCCESS),
        Some(BenchOp::Report(a)) => return suite::report(a).map(|()| ExitCode::SUCCESS),
        None => {}
    }
    if !args.brokers.is_empty() {
        return run_brokers(&args).await;
    }
    let n = args.messages.max(1);
    let rounds = args.rounds.max(1);
    let rate = |d: Duration| n as f64 / d.as_secs_f64().max(1e-9);
    let wants = |s: &str| args.stores.iter().any(|w| w == s);
    let sqlite_dir = std::env::temp_dir().join(format!("idemq-bench-{}", std::process::id()));
    let sqlite = if wants("sqlite") {
        std::fs::create_dir_all(&sqlite_dir)?;
        let url = format!(
            "sqlite://{}?mode=rwc",
            sqlite_dir.join("bench.db").display()
        );
        Some(Arc::new(
            SqliteStore::connect(&url, SqlStoreOptions::default()).await?,
        ))
    } else {
        None
    };
    // Rounds interleave the baseline with each configuration and keep the best time of
    // each: on a shared machine, noise only ever slows a run down.
    let (mut base, mut mem, mut sql) = (Duration::MAX, Duration::MAX, Duration::MAX);
    #[cfg_attr(not(feature = "postgres"), allow(unused_mut))]
    let (mut pg_table, mut pg_unique, mut pg_batch) = (Duration::MAX, Duration::MAX, Duration::MAX);
    for _ in 0..rounds {
        #[cfg(feature = "postgres")]
        if wants("postgres") || wants("postgres-unique") || wants("postgres-unique-batch") {
            let url = args.postgres_url.as_deref().ok_or_else(|| {
                anyhow::anyhow!(
                    "--stores postgres needs --postgres-url (or IDEMQ_TEST_POSTGRES_URL)"
                )
            })?;
            if wants("postgres") {
                pg_table = pg_table.min(unique::dedup_table(url, n, args.batch).await?);
            }
            if wants("postgres-unique") {
                pg_unique = pg_unique.min(unique::unique_index(url, n, args.batch).await?);
            }
            if wants("postgres-unique-batch") {
                pg_batch = pg_batch.min(unique::unique_index_batched(url, n, args.batch).await?);
            }
        }
        base = base.min(baseline(n, args.batch).await?);
        if wants("memory") {
            mem = mem.min(engine(Arc::new(MemoryStore::new()), n, args.batch).await?);
        }
        if let Some(store) = &sqlite {
            sql = sql.min(engine(store.clone(), n, args.batch).await?);
        }
    }
    let _ = std::fs::remove_dir_all(&sqlite_dir);
    let (first_hour, published) = duplicates_meeting_local_claims().await?;
    println!(
        "first-hour run: {published} messages (400 payments + producer duplicates), two consumers, 2 ms handlers: {:.2}s",
        first_hour.as_secs_f64()
    );
    println!(
        "best of {rounds} interleaved rounds, {n} messages, batch {}",
        args.batch
    );
    println!(
        "bare consumer (poll + ack)         {:>12.0} msgs/s  1.00x",
        rate(base)
    );
    for (name, t) in [("memory store", mem), ("SQLite store", sql)] {
        if t != Duration::MAX {
            println!(
                "idempotent consumer, {name}  {:>12.0} msgs/s  {:.2}x of bare",
                rate(t),
                base.as_secs_f64() / t.as_secs_f64()
            );
        }
    }
    for (name, t) in [
        (
            "PostgreSQL, dedup table + effect in the handler's transaction",
            pg_table,
        ),
        (
            "PostgreSQL, unique index, batch handler (one effect statement per message)",
            pg_unique,
        ),
        (
            "PostgreSQL, unique index, batch handler (one effect statement per batch)",
            pg_batch,
        ),
    ] {
        if t != Duration::MAX {
            println!("{name}: {:.0} msgs/s", rate(t));
        }
    }
    for (name, t) in [
        ("unique index", pg_unique),
        ("unique index, batch handler", pg_batch),
    ] {
        if pg_table != Duration::MAX && t != Duration::MAX {
            println!(
                "{name} vs dedup table on PostgreSQL: {:.2}x",
                pg_table.as_secs_f64() / t.as_secs_f64()
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(all(
    feature = "postgres",
    any(
        feature = "kafka",
        feature = "rabbitmq",
        feature = "rocketmq",
        feature = "nats"
    )
))]
async fn run_brokers(args: &BenchArgs) -> anyhow::Result<ExitCode> {
    let run = broker::BrokerRun {
        messages: args.messages,
        batch: args.batch,
        rounds: args.rounds,
        postgres_url: args.postgres_url.clone(),
        redis_url: args.redis_url.clone(),
        pipeline_depth: args.pipeline_depth.max(1),
        consumers: broker::Consumers::parse(&args.consumers)?,
    };
    for name in &args.brokers {
        let bench = make_broker(name, args.batch).await?;
        broker::measure(bench.as_ref(), &run).await?;
        #[cfg(feature = "kafka")]
        if name == "kafka" && run.consumers.has("producer") {
            kafka::producer_comparison(&run).await?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The benchmark of broker `name`.
#[cfg(all(
    feature = "postgres",
    any(
        feature = "kafka",
        feature = "rabbitmq",
        feature = "rocketmq",
        feature = "nats"
    )
))]
async fn make_broker(name: &str, batch: usize) -> anyhow::Result<Box<dyn broker::BrokerBench>> {
    // Each broker module adds its arm here.
    let bench: Option<Box<dyn broker::BrokerBench>> = match name {
        #[cfg(feature = "rabbitmq")]
        "rabbitmq" => Some(Box::new(rabbitmq::RabbitBench::from_env(batch)?)),
        #[cfg(feature = "rocketmq")]
        "rocketmq" => Some(Box::new(rocketmq::RocketBench::from_env()?)),
        #[cfg(feature = "kafka")]
        "kafka" => Some(Box::new(kafka::KafkaBench::from_env(batch).await?)),
        #[cfg(feature = "nats")]
        "nats" => Some(Box::new(nats::NatsBench::from_env(batch)?)),
        _ => None,
    };
    let _ = batch;
    bench.ok_or_else(|| {
        anyhow::anyhow!(
            "unknown broker {name:?} (built with: {})",
            built_brokers().join(", ")
        )
    })
}

/// The broker scenarios of the suite: `broker-<name>` (every consumer of
/// [`broker::measure`]), `kafka-producer` (transactional at 10, 100, 1000 ms against
/// idempotent), `kafka-group` (1, 2, 4 consumers of one group).
#[cfg(all(
    feature = "postgres",
    any(
        feature = "kafka",
        feature = "rabbitmq",
        feature = "rocketmq",
        feature = "nats"
    )
))]
async fn brokers_json(name: &str, sizes: &sizes::Sizes) -> anyhow::Result<serde_json::Value> {
    use serde_json::json;
    const BATCH: usize = 256;
    // `ConsumerConfig::pipeline_depth` of the idempotent consumers.
    const SUITE_PIPELINE_DEPTH: usize = 4;
    let n = if name == "broker-kafka" {
        sizes.kafka_messages
    } else {
        sizes.broker_messages
    }
    .max(1);
    let postgres_url = stores::env_url("IDEMQ_TEST_POSTGRES_URL")?;
    match name {
        #[cfg(feature = "kafka")]
        "kafka-producer" => {
            let intervals = [10, 100, 1000].map(Duration::from_millis);
            let rows = kafka::producer_intervals(
                sizes.producer_messages,
                sizes.producer_rounds,
                &intervals,
            )
            .await?;
            let rows: Vec<serde_json::Value> = rows
                .into_iter()
                .map(|(iv, idem, txn)| {
                    json!({"interval_ms": iv.as_millis() as u64, "idempotent_rate": idem, "transactional_rate": txn})
                })
                .collect();
            Ok(
                json!({"broker": "kafka", "records": sizes.producer_messages, "rounds": sizes.producer_rounds, "intervals": rows}),
            )
        }
        #[cfg(feature = "kafka")]
        "kafka-group" => {
            let rows = kafka::group_scaling(&postgres_url, n * 2, &[1, 2, 4], BATCH).await?;
            let rows: Vec<serde_json::Value> = rows
                .into_iter()
                .map(|(c, rate)| json!({"consumers": c, "rate": rate}))
                .collect();
            Ok(json!({"broker": "kafka", "messages": n * 2, "store": "postgres", "points": rows}))
        }
        _ => {
            let broker_name = name.trim_start_matches("broker-");
            let bench = make_broker(broker_name, BATCH).await?;
            let run = broker::BrokerRun {
                messages: n,
                batch: BATCH,
                rounds: sizes.broker_rounds,
                postgres_url: Some(postgres_url),
                redis_url: stores::env_url("IDEMQ_TEST_REDIS_URL").ok(),
                // Remote stores: batches overlap their round trips.
                pipeline_depth: SUITE_PIPELINE_DEPTH,
                consumers: broker::Consumers::all(),
            };
            let f = broker::measure(bench.as_ref(), &run).await?;
            let rate = |d: Option<Duration>| d.map(|d| n as f64 / d.as_secs_f64().max(1e-9));
            Ok(json!({
                "broker": broker_name,
                "server": if broker_name == "kafka" { kafka_version() } else { String::new() },
                "messages": n,
                "batch": BATCH,
                "pipeline_depth": SUITE_PIPELINE_DEPTH,
                "rounds": sizes.broker_rounds,
                "bare": rate(f.bare),
                "memory": rate(f.memory),
                "handwritten": rate(f.handwritten),
                "bound3": rate(f.bound3),
                "unique_keyed": rate(f.unique_keyed),
                "unique": rate(f.unique),
                "batch_redis": rate(f.batch_redis),
                "batch_postgres": rate(f.batch_postgres),
                "postgres": rate(f.postgres),
                "redis": rate(f.redis),
            }))
        }
    }
}

/// The Kafka server's version, from the jars `scripts/servers.sh` runs it from
/// (`IDEMQ_KAFKA_LIBS/kafka_<scala>-<version>.jar`), or "" when unknown.
#[cfg(all(
    feature = "postgres",
    any(
        feature = "kafka",
        feature = "rabbitmq",
        feature = "rocketmq",
        feature = "nats"
    )
))]
fn kafka_version() -> String {
    let Some(dir) = std::env::var_os("IDEMQ_KAFKA_LIBS") else {
        return String::new();
    };
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .find_map(|n| {
            let rest = n.strip_prefix("kafka_")?.strip_suffix(".jar")?;
            let (_, version) = rest.split_once('-')?;
            Some(format!(
                "Apache Kafka {version} (from the jars the server runs)"
            ))
        })
        .unwrap_or_default()
}

#[cfg(not(all(
    feature = "postgres",
    any(
        feature = "kafka",
        feature = "rabbitmq",
        feature = "rocketmq",
        feature = "nats"
    )
)))]
async fn brokers_json(_name: &str, _sizes: &sizes::Sizes) -> anyhow::Result<serde_json::Value> {
    anyhow::bail!("the broker scenarios need a build with the postgres feature and the broker's (--all-features)")
}

#[cfg(not(all(
    feature = "postgres",
    any(
        feature = "kafka",
        feature = "rabbitmq",
        feature = "rocketmq",
        feature = "nats"
    )
)))]
async fn run_brokers(_args: &BenchArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!(
        "--brokers needs a build with the postgres feature and a broker's feature, e.g. \
         cargo run --release --features postgres,kafka -- bench --brokers kafka"
    )
}

#[cfg(all(
    feature = "postgres",
    any(
        feature = "kafka",
        feature = "rabbitmq",
        feature = "rocketmq",
        feature = "nats"
    )
))]
fn built_brokers() -> Vec<&'static str> {
    [
        cfg!(feature = "kafka").then_some("kafka"),
        cfg!(feature = "rabbitmq").then_some("rabbitmq"),
        cfg!(feature = "rocketmq").then_some("rocketmq"),
        cfg!(feature = "nats").then_some("nats"),
    ]
    .into_iter()
    .flatten()
    .collect()
}
