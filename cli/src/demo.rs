//! `idemq demo`: the embedded main job.
//!
//! An in-memory broker feeds two SQLite-backed idempotent consumers a storm of payment
//! messages with the failures real brokers and consumers produce:
//! - producer retries (the same payment published 2–3 times),
//! - lost acks (the broker redelivers a message the consumer acked),
//! - handler failures (a downstream timeout on the first attempt),
//! - consumer crashes *between the effect and the ack* (the process dies after its database
//!   transaction committed) and crashes *mid-handler* (before it committed; the lease is
//!   taken over once it expires).
//!
//! Each payment's effect is a row in `demo_ledger`, written in the same SQLite transaction
//! that completes its dedup record (`complete_in_tx`). The ledger has no unique constraint,
//! so a double effect would show up there: the verdict is counted from the ledger,
//! independently of the dedup store.

use anyhow::Context;
use bytes::Bytes;
use idemq::broker::{Faults, MemoryBroker};
use idemq::sql::{SqlStoreOptions, SqliteStore};
use idemq::{
    BrokerKind, ClaimedMessage, ConsumerConfig, ConsumerStats, DedupStore, Envelope, Handler,
    HandlerError, HandlerResult, IdempotentConsumer, KeyStrategy,
};
use indicatif::{ProgressBar, ProgressStyle};
use rand::{Rng, SeedableRng};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use std::collections::HashSet;
use std::process::ExitCode;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Options of `idemq demo`.
#[derive(clap::Args, Debug)]
pub struct DemoArgs {
    /// Distinct payments to publish.
    #[arg(long, default_value_t = 5000)]
    messages: usize,
    /// Concurrent consumers (each with its own broker subscription).
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// SQLite database file (default: a fresh file in a temporary directory).
    #[arg(long)]
    db: Option<std::path::PathBuf>,
    /// Seed for the injected faults.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Consumer crashes to inject, each way (after commit, mid-handler).
    #[arg(long, default_value_t = 3)]
    crashes: usize,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
}

/// Which messages misbehave, and which misbehaviours already happened.
struct Plan {
    fail_first_attempt: HashSet<usize>,
    crash_after_commit: HashSet<usize>,
    crash_mid_handler: HashSet<usize>,
    crashed: Mutex<HashSet<usize>>,
}

impl Plan {
    /// True the first time only.
    fn crash_now(&self, idx: usize) -> bool {
        self.crashed
            .lock()
            .map(|mut c| c.insert(idx))
            .unwrap_or(false)
    }
}

struct PaymentHandler {
    store: Arc<SqliteStore>,
    plan: Arc<Plan>,
    crash: mpsc::Sender<()>,
    applied: Arc<AtomicU64>,
    retention: Duration,
}

fn payment_index(env: &Envelope) -> Result<usize, HandlerError> {
    let v: serde_json::Value =
        serde_json::from_slice(&env.payload).map_err(HandlerError::permanent)?;
    v.get("seq")
        .and_then(serde_json::Value::as_u64)
        .map(|n| n as usize)
        .ok_or_else(|| HandlerError::permanent("payment has no numeric `seq`"))
}

#[async_trait::async_trait]
impl Handler for PaymentHandler {
    async fn handle(&self, m: ClaimedMessage) -> HandlerResult {
        let idx = payment_index(&m.envelope)?;
        if self.plan.fail_first_attempt.contains(&idx) && m.attempt == 1 {
            return Err(HandlerError::retryable("simulated downstream timeout"));
        }
        if self.plan.crash_mid_handler.contains(&idx) && self.plan.crash_now(idx) {
            // The process dies before its transaction: nothing written, lease still held.
            let _ = self.crash.send(()).await;
            std::future::pending::<()>().await;
        }
        let receipt = format!("receipt-{idx}");
        let mut tx = self
            .store
            .pool()
            .begin()
            .await
            .map_err(HandlerError::retryable)?;
        sqlx::query("INSERT INTO demo_ledger (payment_id, amount, attempt) VALUES (?, ?, ?)")
            .bind(format!("pay-{idx:06}"))
            .bind(10_i64)
            .bind(i64::from(m.attempt))
            .execute(&mut *tx)
            .await
            .map_err(HandlerError::retryable)?;
        let done = self
            .store
            .complete_in_tx(
                &mut *tx,
                &m.key,
                m.token,
                Some(receipt.as_bytes()),
                self.retention,
            )
            .await
            .map_err(HandlerError::retryable)?;
        match done {
            idemq::CompleteOutcome::Completed => {}
            idemq::CompleteOutcome::AlreadyCompleted => {
                // An earlier transaction of this claim committed the effect (its reply was
                // lost): this one repeats it. Roll back; the message is done.
                tx.rollback().await.map_err(HandlerError::retryable)?;
                return Ok(Some(Bytes::from(receipt)));
            }
            _ => {
                // Our lease was taken over: roll the effect back; the owner applies it.
                tx.rollback().await.map_err(HandlerError::retryable)?;
                return Err(HandlerError::retryable("lease lost before commit"));
            }
        }
        tx.commit().await.map_err(HandlerError::retryable)?;
        self.applied.fetch_add(1, Ordering::Relaxed);
        if self.plan.crash_after_commit.contains(&idx) && self.plan.crash_now(idx) {
            // The process dies after the effect committed and before the ack.
            let _ = self.crash.send(()).await;
            std::future::pending::<()>().await;
        }
        Ok(Some(Bytes::from(receipt)))
    }
}

#[derive(Default)]
struct Totals {
    stats: Mutex<ConsumerStats>,
    crashes: AtomicU64,
}

impl Totals {
    fn add(&self, s: ConsumerStats) {
        if let Ok(mut t) = self.stats.lock() {
            t.processed += s.processed;
            t.duplicates += s.duplicates;
            t.in_flight += s.in_flight;
            t.retried += s.retried;
            t.rejected += s.rejected;
            t.fenced += s.fenced;
            t.store_unavailable += s.store_unavailable;
            t.takeovers += s.takeovers;
        }
    }
}

async fn open_db(path: &std::path::Path) -> anyhow::Result<SqliteStore> {
    // WAL + synchronous=NORMAL: durable across process crashes (what the demo injects),
    // not across power loss; use FULL for that.
    let opts = SqliteConnectOptions::from_str(&format!("sqlite://{}", path.display()))?
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Normal)
        .busy_timeout(Duration::from_secs(10));
    let pool = SqlitePoolOptions::new()
        .max_connections(8)
        .connect_with(opts)
        .await
        .with_context(|| format!("opening {}", path.display()))?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS demo_ledger (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            payment_id TEXT NOT NULL,
            amount INTEGER NOT NULL,
            attempt INTEGER NOT NULL)",
    )
    .execute(&pool)
    .await?;
    Ok(SqliteStore::from_pool(pool, SqlStoreOptions::default()).await?)
}

/// Runs the demo; exit code 1 when an effect was doubled or lost.
pub async fn run(args: DemoArgs) -> anyhow::Result<ExitCode> {
    let n = args.messages.max(1);
    let tmp;
    let db_path = match &args.db {
        Some(p) => p.clone(),
        None => {
            tmp = TempDir::new()?;
            tmp.path().join("idemq-demo.db")
        }
    };
    let store = Arc::new(open_db(&db_path).await?);

    // Plan the faults.
    let mut rng = rand::rngs::StdRng::seed_from_u64(args.seed);
    let mut picks = (0..n).collect::<Vec<_>>();
    for i in (1..picks.len()).rev() {
        picks.swap(i, rng.gen_range(0..=i));
    }
    let crashes = args.crashes.min(n / 4);
    let failing = (n / 40).max(1).min(n - 2 * crashes);
    let plan = Arc::new(Plan {
        crash_after_commit: picks[..crashes].iter().copied().collect(),
        crash_mid_handler: picks[crashes..2 * crashes].iter().copied().collect(),
        fail_first_attempt: picks[2 * crashes..2 * crashes + failing]
            .iter()
            .copied()
            .collect(),
        crashed: Mutex::default(),
    });

    // Publish with producer retries.
    let broker = MemoryBroker::with_seed(args.seed);
    broker.set_faults(Faults {
        lost_ack_rate: 0.05,
        ..Faults::default()
    });
    let mut published = 0usize;
    for i in 0..n {
        let copies = match rng.gen_range(0..100) {
            0..=9 => 2,
            10..=12 => 3,
            _ => 1,
        };
        let payload = format!(r#"{{"payment_id":"pay-{i:06}","seq":{i},"amount":10}}"#);
        for _ in 0..copies {
            broker.publish(Envelope::new(
                BrokerKind::MEMORY,
                "payments",
                payload.clone(),
            ));
            published += 1;
        }
    }

    let keys = KeyStrategy::json_pointer("demo-billing", "/payment_id")?;
    let cfg = ConsumerConfig {
        max_batch: 64,
        max_concurrency: 8,
        lease: Duration::from_secs(1),
        retry: idemq_core::engine::RetryPolicy::fixed(Duration::from_millis(50)),
        in_flight_delay_max: Duration::from_millis(300),
        ..ConsumerConfig::default()
    };
    let applied = Arc::new(AtomicU64::new(0));
    let totals = Arc::new(Totals::default());
    let bar = if args.quiet {
        ProgressBar::hidden()
    } else {
        let b = ProgressBar::new(n as u64);
        b.set_style(
            ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} effects  {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        b
    };
    let started = Instant::now();
    let mut slots = Vec::new();
    for _ in 0..args.workers.max(1) {
        let (broker, store, plan, keys, cfg, applied, totals) = (
            broker.clone(),
            store.clone(),
            plan.clone(),
            keys.clone(),
            cfg.clone(),
            applied.clone(),
            totals.clone(),
        );
        slots.push(tokio::spawn(async move {
            // A supervisor: restarts the consumer after each simulated crash.
            loop {
                let (crash_tx, mut crash_rx) = mpsc::channel(1);
                let handler = PaymentHandler {
                    store: store.clone(),
                    plan: plan.clone(),
                    crash: crash_tx,
                    applied: applied.clone(),
                    retention: cfg.retention,
                };
                let dyn_store: Arc<dyn DedupStore> = store.clone();
                let consumer = IdempotentConsumer::new(dyn_store, keys.clone(), handler)
                    .with_config(cfg.clone());
                let observer = consumer.clone();
                let mut source = broker.subscribe();
                let mut run =
                    tokio::spawn(async move { consumer.run_until_idle(&mut source).await });
                tokio::select! {
                    r = &mut run => {
                        totals.add(observer.stats());
                        return r.map_err(anyhow::Error::from)?.map_err(anyhow::Error::from);
                    }
                    _ = crash_rx.recv() => {
                        // Kill the consumer: in-flight handlers die, unacked deliveries return
                        // to the queue, leases stay in the store until they expire.
                        run.abort();
                        let _ = run.await;
                        totals.add(observer.stats());
                        totals.crashes.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }));
    }
    let ticker = {
        let (bar, applied, broker) = (bar.clone(), applied.clone(), broker.clone());
        tokio::spawn(async move {
            loop {
                bar.set_position(applied.load(Ordering::Relaxed));
                bar.set_message(format!("{} pending in broker", broker.pending()));
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    for s in slots {
        s.await??;
    }
    ticker.abort();
    bar.set_position(applied.load(Ordering::Relaxed));
    bar.finish_and_clear();
    let elapsed = started.elapsed();

    // The verdict, from the ledger alone.
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT payment_id, COUNT(*) FROM demo_ledger GROUP BY payment_id")
            .fetch_all(store.pool())
            .await?;
    let double_effects = rows.iter().filter(|(_, c)| *c > 1).count();
    let seen: HashSet<&str> = rows.iter().map(|(p, _)| p.as_str()).collect();
    let lost = (0..n)
        .filter(|i| !seen.contains(format!("pay-{i:06}").as_str()))
        .count();
    let t = totals.stats.lock().map(|s| *s).unwrap_or_default();
    let dead = broker.dead_letters().len();
    println!(
        "published={published} distinct={n} lost_acks_injected=~5% handler_failures={failing} crashes={} restarts={} takeovers={} dead_lettered={dead} store=sqlite:{} elapsed={:.1}s",
        // Crash points reached. Two reached by one consumer together kill it once, so the
        // restarts can be fewer.
        plan.crashed.lock().map(|c| c.len()).unwrap_or_default(),
        totals.crashes.load(Ordering::Relaxed),
        t.takeovers,
        db_path.display(),
        elapsed.as_secs_f64()
    );
    println!(
        "processed={} duplicates_skipped={} retried={} double_effects={double_effects} lost={lost}",
        seen.len(),
        t.duplicates,
        t.redelivered(),
    );
    Ok(if double_effects == 0 && lost == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// A temporary directory removed on drop (the demo's default database lives there).
struct TempDir(std::path::PathBuf);

impl TempDir {
    fn new() -> std::io::Result<Self> {
        let p = std::env::temp_dir().join(format!(
            "idemq-demo-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&p)?;
        Ok(Self(p))
    }
    fn path(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
