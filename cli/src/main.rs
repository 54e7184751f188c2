//! The `idemq` command line: the embedded demo, store operations, benchmarks and (feature
//! `kafka`) `idemq kafka check-config`.
// The RocketMQ client's futures are deep: proving them Send needs more than 128 levels.
#![recursion_limit = "512"]
// The doc comments of the arguments are the `--help` text (clap), written for a terminal:
// `[,HOST:PORT]` there is usage syntax, not a link.
#![allow(rustdoc::broken_intra_doc_links)]

mod bench;
mod consume;
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
    /// Consume a Kafka topic, RabbitMQ queue or RocketMQ topic idempotently and print each
    /// message processed as a JSON line (duplicates are skipped).
    ///
    /// stdout is at-least-once after a crash: printing a line is the effect, and it comes
    /// before the message is recorded done, so a run killed in between prints that line
    /// again when restarted, with "takeover": true (a line with "takeover": true may repeat
    /// one an earlier run printed). A store outage that outlasts the completion's patience
    /// (5 min) prints a line again the same way; otherwise each message is printed once.
    ///
    /// stderr says what the consumer waits for (a Kafka consumer: partitions from the group
    /// coordinator), reports dead-lettered messages (count and last reason, at most every
    /// 10 s) and ends with the counts.
    ///
    /// Example: idemq consume --broker kafka://127.0.0.1:9092/payments
    /// --store sqlite://dedup.db?mode=rwc --key json:/payment_id --idle-exit 5
    Consume(consume::ConsumeArgs),
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
    /// Count the records by state: in progress, abandoned (lease ended), completed, rolled
    /// back, expired.
    Stats,
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
    /// Show one record: status, lease, attempts, worker, retention, stored result.
    #[command(visible_alias = "get")]
    Inspect {
        /// The full dedup key, `<group>:<key>`.
        key: String,
        /// Print the record's every field (Rust debug form) instead of the summary.
        #[arg(long)]
        raw: bool,
    },
    /// Give up an in-progress claim now (its worker is known dead), so the next delivery
    /// is processed without waiting for the lease to end. A completed record is left alone
    /// (`forget` makes a completed message run again).
    Release {
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
        Command::Consume(args) => consume::run(args).await,
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
        StoreOp::Stats => {
            let s = store.stats().await?;
            println!("in progress: {} (live leases)", s.in_progress);
            println!(
                "abandoned:   {} (lease ended; the next delivery takes over, `stuck` lists them)",
                s.abandoned
            );
            println!(
                "completed:   {} (duplicates are acked without running)",
                s.completed
            );
            println!(
                "rolled back: {} (given up for good: claims are refused until retention ends)",
                s.rolled_back
            );
            println!(
                "expired:     {} (past retention; `purge` deletes them)",
                s.expired
            );
            println!("total:       {}", s.total());
        }
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
        StoreOp::Inspect { key, raw } => {
            let key = idemq::DedupKey::from_stored(key);
            match store.get(&key).await? {
                Some(r) if raw => println!("{r:#?}"),
                Some(r) => print!("{}", describe(&r, now_ms())),
                None => {
                    println!("no record for {key}");
                    return Ok(ExitCode::from(1));
                }
            }
        }
        StoreOp::Release { key } => {
            let key = idemq::DedupKey::from_stored(key);
            let Some(r) = store.get(&key).await? else {
                println!("no record for {key}");
                return Ok(ExitCode::from(1));
            };
            if r.status == idemq::RecordStatus::Completed {
                println!(
                    "{key} is completed, not in progress: nothing to release (`idemq store forget` makes it run again)"
                );
                return Ok(ExitCode::from(1));
            }
            match store.release(&key, r.token).await? {
                idemq::ReleaseOutcome::Released => {
                    println!(
                        "released {key} (held by {}); the next delivery runs it",
                        r.worker.as_deref().unwrap_or("an unnamed worker")
                    )
                }
                idemq::ReleaseOutcome::Fenced => {
                    println!("{key} changed hands while releasing (its worker completed or another took it over); nothing released");
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

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// A record as an operator reads it: times relative to now (this machine's clock; the
/// store's may differ by its skew), the stored result as text when it is UTF-8.
fn describe(r: &idemq::DedupRecord, now: i64) -> String {
    let ago = |ms: i64| {
        let d = now - ms;
        if d >= 0 {
            format!("{:.1}s ago", d as f64 / 1000.0)
        } else {
            format!("in {:.1}s", -d as f64 / 1000.0)
        }
    };
    let mut out = format!("key:         {}\n", r.key);
    match r.status {
        idemq::RecordStatus::Completed => {
            out += "status:      completed (duplicates are acked without running)\n";
            if let Some(c) = r.completed_ms {
                out += &format!("completed:   {}\n", ago(c));
            }
            match r.expires_ms {
                Some(e) => {
                    out += &format!(
                        "expires:     {} (then purged; a later copy runs again)\n",
                        ago(e)
                    )
                }
                None => out += "expires:     never\n",
            }
        }
        idemq::RecordStatus::RolledBack => {
            out += "status:      rolled back (its message was dropped: claims are refused)\n";
            if let Some(c) = r.completed_ms {
                out += &format!("rolled back: {}\n", ago(c));
            }
            if let Some(e) = r.expires_ms {
                out += &format!(
                    "expires:     {} (then the key is claimable afresh)\n",
                    ago(e)
                );
            }
        }
        idemq::RecordStatus::InProgress if r.is_released() => {
            out += "status:      released (the next delivery claims it)\n";
        }
        idemq::RecordStatus::InProgress => {
            let live = r.lease_until_ms > now;
            out += &format!(
                "status:      in progress, lease {} {}\n",
                if live { "ends" } else { "ended" },
                ago(r.lease_until_ms)
            );
            if !live {
                out += "             (abandoned: the next delivery takes it over; `release` does it now)\n";
            }
        }
    }
    out += &format!("attempts:    {}\n", r.attempts);
    out += &format!("first seen:  {}\n", ago(r.first_seen_ms));
    out += &format!("worker:      {}\n", r.worker.as_deref().unwrap_or("-"));
    out += &format!("token:       {}\n", r.token.0);
    match &r.result {
        None => {}
        Some(b) => match std::str::from_utf8(b) {
            Ok(t) => out += &format!("result:      {t}\n"),
            Err(_) => out += &format!("result:      {} bytes (binary)\n", b.len()),
        },
    }
    out
}
