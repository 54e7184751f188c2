//! The `idemq` command line: the embedded demo, store operations, benchmarks and (feature
//! `kafka`) `idemq kafka check-config`.
// The RocketMQ client's futures are deep: proving them Send needs more than 128 levels.
#![recursion_limit = "512"]

mod bench;
mod demo;
#[cfg(feature = "kafka")]
mod kafka_cli;

use clap::{Parser, Subcommand};
use std::process::ExitCode;
use std::time::Duration;

#[derive(Parser)]
#[command(
    name = "idemq",
    version,
    about = "Exactly-once effects for at-least-once message consumers"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the embedded demo: an in-memory broker with injected duplicates, redeliveries,
    /// handler failures and consumer crashes, feeding a SQLite-backed idempotent consumer.
    Demo(demo::DemoArgs),
    /// Measure the engine against the bare broker consumer (ratios, same run).
    Bench(bench::BenchArgs),
    /// Kafka tools (build with feature `kafka`).
    #[cfg(feature = "kafka")]
    Kafka {
        #[command(subcommand)]
        op: kafka_cli::KafkaOp,
    },
    /// Operate a dedup store.
    Store {
        /// Store URL: sqlite://file.db, postgres://…, mysql://…, redis://…, memory://
        #[arg(long, env = "IDEMQ_STORE_URL")]
        url: String,
        #[command(subcommand)]
        op: StoreOp,
    },
}

#[derive(Subcommand)]
enum StoreOp {
    /// Create or upgrade the store's tables (opening a store migrates it).
    Migrate,
    /// Delete completed records past their retention, in chunks.
    Purge {
        /// Rows per chunk.
        #[arg(long, default_value_t = 1000)]
        chunk: usize,
    },
    /// List in-progress records whose lease ended long ago (abandoned work).
    Stuck {
        /// Only leases that ended at least this many seconds ago.
        #[arg(long, default_value_t = 60)]
        stale_secs: u64,
        /// At most this many rows.
        #[arg(long, default_value_t = 100)]
        limit: usize,
    },
    /// Show one record.
    Get {
        /// The full dedup key, `<group>:<key>`.
        key: String,
    },
    /// Delete one record by hand, so the next delivery processes the message again.
    Forget {
        /// The full dedup key, `<group>:<key>`.
        key: String,
    },
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("IDEMQ_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("error")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Demo(args) => demo::run(args).await,
        Command::Bench(args) => bench::run(args).await,
        Command::Store { url, op } => store_op(&url, op).await,
        #[cfg(feature = "kafka")]
        Command::Kafka { op } => kafka_cli::run(op),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}

async fn store_op(url: &str, op: StoreOp) -> anyhow::Result<ExitCode> {
    let store = idemq::open_store(url).await?;
    match op {
        StoreOp::Migrate => println!("store at {} is migrated", redact(url)),
        StoreOp::Purge { chunk } => {
            let mut total = 0;
            loop {
                let n = store.purge_expired(chunk.max(1)).await?;
                total += n;
                if n == 0 {
                    break;
                }
            }
            println!("purged {total} expired records");
        }
        StoreOp::Stuck { stale_secs, limit } => {
            let rows = store
                .list_stuck(Duration::from_secs(stale_secs), limit)
                .await?;
            for r in &rows {
                println!(
                    "{}\tattempts={}\tlease_until_ms={}\tworker={}",
                    r.key,
                    r.attempts,
                    r.lease_until_ms,
                    r.worker.as_deref().unwrap_or("-")
                );
            }
            println!("{} stuck records", rows.len());
        }
        StoreOp::Get { key } => {
            let key = idemq::DedupKey::from_stored(key);
            match store.get(&key).await? {
                Some(r) => println!("{r:#?}"),
                None => {
                    println!("no record for {key}");
                    return Ok(ExitCode::from(1));
                }
            }
        }
        StoreOp::Forget { key } => {
            let key = idemq::DedupKey::from_stored(key);
            if store.forget(&key).await? {
                println!("forgot {key}");
            } else {
                println!("no record for {key}");
                return Ok(ExitCode::from(1));
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

use idemq::core::secrets::redact_url as redact;
