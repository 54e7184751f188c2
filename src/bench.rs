//! `idemq bench`: the engine's cost against the bare broker consumer, measured in one run.
//!
//! The baseline polls the in-memory broker and acks every delivery (no dedup at all). The
//! same messages then go through the idempotent consumer over the memory store and over a
//! SQLite file. Figures are printed as msgs/s and as a ratio to the baseline, since absolute
//! numbers on a shared machine mean little.

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
pub struct BenchArgs {
    /// Messages per run.
    #[arg(long, default_value_t = 50_000)]
    messages: usize,
    /// Deliveries per poll (and claims per round trip).
    #[arg(long, default_value_t = 256)]
    batch: usize,
    /// Interleaved rounds (baseline, then each store); the best time of each is reported.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Stores to run the engine over (comma-separated: memory, sqlite).
    #[arg(long, default_value = "memory,sqlite", value_delimiter = ',')]
    stores: Vec<String>,
}

fn fill(n: usize) -> MemoryBroker {
    let broker = MemoryBroker::new();
    for i in 0..n {
        broker.publish(
            Envelope::new(BrokerKind::Memory, "bench", format!("payload {i}"))
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
    let broker = fill(n);
    let group = format!("bench-{:08x}", rand::random::<u32>());
    let c = IdempotentConsumer::new(
        store,
        KeyStrategy::header(&group, "k")?,
        |_m: ClaimedMessage| async move { Ok::<_, HandlerError>(None) },
    )
    .with_config(ConsumerConfig {
        max_batch: batch,
        max_concurrency: 64,
        ..ConsumerConfig::default()
    });
    let t = Instant::now();
    c.run_until_idle(&mut broker.subscribe()).await?;
    let el = t.elapsed();
    anyhow::ensure!(
        c.stats().processed == n as u64,
        "bench lost messages: {:?}",
        c.stats()
    );
    Ok(el)
}

/// Runs the benchmark and prints one line per configuration.
pub async fn run(args: BenchArgs) -> anyhow::Result<ExitCode> {
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
    for _ in 0..rounds {
        base = base.min(baseline(n, args.batch).await?);
        if wants("memory") {
            mem = mem.min(engine(Arc::new(MemoryStore::new()), n, args.batch).await?);
        }
        if let Some(store) = &sqlite {
            sql = sql.min(engine(store.clone(), n, args.batch).await?);
        }
    }
    let _ = std::fs::remove_dir_all(&sqlite_dir);
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
    Ok(ExitCode::SUCCESS)
}
