//! Claim throughput of the SQL stores, against one server, in one run:
//!
//! 1. per-message: claim + complete one key at a time, from N concurrent tasks;
//! 2. batched: `claim_batch` + `complete_batch` of B keys, from the same tasks;
//! 3. raw baseline: a multi-row `INSERT … ON CONFLICT DO NOTHING` (MySQL: `INSERT IGNORE`)
//!    of B rows per statement into a scratch table with the same key column;
//!
//! then the ratios batched/per-message and batched/raw. Not a test: numbers depend on the
//! machine (fsync rate above all).
//!
//! ```text
//! cargo run --release -p idemq-sql --all-features --example bench -- postgres://postgres@127.0.0.1:25432/idemq
//! cargo run --release -p idemq-sql --all-features --example bench -- mysql://idemq:idemq@127.0.0.1:23306/idemq --batch 500
//! options: --tasks N (8)  --batch B (500)  --single M (per-message keys, 4000)
//!          --batched K (batched keys and raw rows, 100000)
//! ```

use idemq_core::{
    ClaimOutcome, ClaimRequest, CompleteOutcome, Completion, ConsumerGroup, DedupKey, DedupStore,
    FencingToken,
};
use idemq_sql::{SqlBackend, SqlStore, SqlStoreOptions, TableName, Val};
use std::sync::Arc;
use std::time::{Duration, Instant};

const LEASE: Duration = Duration::from_secs(60);
const RETAIN: Duration = Duration::from_secs(3600);

struct Args {
    url: String,
    tasks: usize,
    batch: usize,
    single: usize,
    batched: usize,
}

fn parse_args() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let mut a = Args {
        url: String::new(),
        tasks: 8,
        batch: 500,
        single: 4000,
        batched: 100_000,
    };
    while let Some(arg) = it.next() {
        let mut num = |name: &str| -> Result<usize, String> {
            it.next()
                .and_then(|v| v.parse().ok())
                .filter(|n| *n > 0)
                .ok_or_else(|| format!("{name} needs a positive number"))
        };
        match arg.as_str() {
            "--tasks" => a.tasks = num("--tasks")?,
            "--batch" => a.batch = num("--batch")?,
            "--single" => a.single = num("--single")?,
            "--batched" => a.batched = num("--batched")?,
            "-h" | "--help" => return Err(String::new()),
            u if !u.starts_with('-') && a.url.is_empty() => a.url = u.to_owned(),
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    if a.url.is_empty() {
        return Err("give a database URL (postgres://…, mysql://…, sqlite://…)".into());
    }
    Ok(a)
}

fn options(a: &Args) -> SqlStoreOptions {
    SqlStoreOptions {
        table: TableName::new("idemq_bench").expect("valid name"),
        max_connections: u32::try_from(a.tasks + 2).unwrap_or(64),
        max_batch: a.batch.max(1),
        ..Default::default()
    }
}

fn keys(g: &ConsumerGroup, prefix: &str, n: usize) -> Vec<DedupKey> {
    (0..n)
        .map(|i| DedupKey::new(g, &format!("{prefix}-{i:09}")).expect("key"))
        .collect()
}

/// CPU seconds used by this process so far (Linux; 0 elsewhere).
fn cpu_secs() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    // Fields after the command name (which is in parentheses): utime is the 12th, stime 13th.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

/// Runs a phase, printing its rate and the client CPU it used.
async fn phase<F: std::future::Future<Output = f64>>(label: &str, unit: &str, f: F) -> f64 {
    let c0 = cpu_secs();
    let t0 = Instant::now();
    let rate = f.await;
    let wall = t0.elapsed().as_secs_f64();
    println!(
        "{label:<27}: {rate:>10.0} {unit}   (wall {wall:.2} s, client CPU {:.2} s)",
        cpu_secs() - c0
    );
    rate
}

/// Splits `v` into `parts` nearly equal owned parts.
fn split<T: Clone>(v: &[T], parts: usize) -> Vec<Vec<T>> {
    let per = v.len().div_ceil(parts.max(1)).max(1);
    v.chunks(per).map(<[T]>::to_vec).collect()
}

async fn per_message<DB: SqlBackend>(
    store: &Arc<SqlStore<DB>>,
    a: &Args,
    g: &ConsumerGroup,
) -> f64 {
    let all = keys(g, "single", a.single);
    let start = Instant::now();
    let mut tasks = Vec::new();
    for part in split(&all, a.tasks) {
        let s = store.clone();
        tasks.push(tokio::spawn(async move {
            for k in part {
                let ClaimOutcome::Acquired(l) = s
                    .claim(&ClaimRequest::new(k.clone(), LEASE))
                    .await
                    .expect("claim")
                else {
                    panic!("fresh key not acquired")
                };
                let done = s
                    .complete(&k, l.token, None, RETAIN)
                    .await
                    .expect("complete");
                assert_eq!(done, CompleteOutcome::Completed);
            }
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    a.single as f64 / start.elapsed().as_secs_f64()
}

async fn batched<DB: SqlBackend>(
    store: &Arc<SqlStore<DB>>,
    a: &Args,
    g: &ConsumerGroup,
    complete: bool,
) -> f64 {
    let all = keys(g, if complete { "batch" } else { "claim" }, a.batched);
    let batches: Vec<Vec<DedupKey>> = all.chunks(a.batch).map(<[DedupKey]>::to_vec).collect();
    let start = Instant::now();
    let mut tasks = Vec::new();
    for part in split(&batches, a.tasks) {
        let s = store.clone();
        tasks.push(tokio::spawn(async move {
            let (mut in_claim, mut in_complete) = (Duration::ZERO, Duration::ZERO);
            for batch in part {
                let reqs: Vec<ClaimRequest> = batch
                    .iter()
                    .map(|k| ClaimRequest::new(k.clone(), LEASE))
                    .collect();
                let t0 = Instant::now();
                let out = s.claim_batch(&reqs).await.expect("claim_batch");
                in_claim += t0.elapsed();
                let items: Vec<Completion> = reqs
                    .iter()
                    .zip(out)
                    .map(|(r, o)| match o {
                        ClaimOutcome::Acquired(l) => Completion {
                            key: r.key.clone(),
                            token: l.token,
                            result: None,
                            retention: RETAIN,
                        },
                        other => panic!("fresh key not acquired: {other:?}"),
                    })
                    .collect();
                if complete {
                    let t1 = Instant::now();
                    let done = s.complete_batch(&items).await.expect("complete_batch");
                    in_complete += t1.elapsed();
                    assert!(done.iter().all(|d| *d == CompleteOutcome::Completed));
                }
            }
            (in_claim, in_complete)
        }));
    }
    let (mut in_claim, mut in_complete) = (Duration::ZERO, Duration::ZERO);
    for t in tasks {
        let (c, d) = t.await.expect("task");
        in_claim += c;
        in_complete += d;
    }
    let rate = a.batched as f64 / start.elapsed().as_secs_f64();
    let total = (in_claim + in_complete).as_secs_f64().max(1e-9);
    println!(
        "  (time in claim_batch {:.0}%, in complete_batch {:.0}%)",
        100.0 * in_claim.as_secs_f64() / total,
        100.0 * in_complete.as_secs_f64() / total
    );
    rate
}

/// The raw baseline: multi-row `INSERT … ON CONFLICT DO NOTHING` of fresh keys. With
/// `full_row`, into a copy of the dedup table with the same row a claim writes (12 columns,
/// its indexes), which separates what the row costs from what the claim logic costs.
async fn raw<DB: SqlBackend>(
    store: &Arc<SqlStore<DB>>,
    a: &Args,
    g: &ConsumerGroup,
    full_row: bool,
) -> f64 {
    let d = DB::DIALECT;
    let key_type = match d.name() {
        "postgres" => "VARCHAR(257) COLLATE \"C\"",
        "mysql" => "VARBINARY(257)",
        _ => "TEXT",
    };
    let mut conn = store.pool().acquire().await.expect("connection");
    DB::execute(&mut conn, "DROP TABLE IF EXISTS idemq_bench_raw", vec![])
        .await
        .expect("drop");
    let create = match (full_row, d.name()) {
        (true, "postgres") => {
            "CREATE TABLE idemq_bench_raw (LIKE idemq_bench INCLUDING ALL)".to_string()
        }
        (true, _) => "CREATE TABLE idemq_bench_raw LIKE idemq_bench".to_string(),
        (false, _) => format!(
            "CREATE TABLE idemq_bench_raw (k {key_type} NOT NULL PRIMARY KEY, v BIGINT NOT NULL)"
        ),
    };
    DB::execute(&mut conn, &create, vec![])
        .await
        .expect("create scratch table");
    drop(conn);
    let all = keys(g, "raw", a.batched);
    let batches: Vec<Vec<DedupKey>> = all.chunks(a.batch).map(<[DedupKey]>::to_vec).collect();
    let start = Instant::now();
    let mut tasks = Vec::new();
    for part in split(&batches, a.tasks) {
        let s = store.clone();
        tasks.push(tokio::spawn(async move {
            let mut conn = s.pool().acquire().await.expect("connection");
            for batch in part {
                let ignore = if d.name() == "mysql" { "IGNORE " } else { "" };
                let (cols, row, key_col) = if full_row {
                    (
                        "(dedup_key, status, token, lease_until_ms, attempts, took_over, \
                         payload_hash, result, first_seen_ms, completed_ms, expires_ms, worker)",
                        "(?, 0, ?, ?, 1, 0, NULL, NULL, ?, NULL, NULL, ?)",
                        "dedup_key",
                    )
                } else {
                    ("(k, v)", "(?, ?)", "k")
                };
                let mut sql = format!("INSERT {ignore}INTO idemq_bench_raw {cols} VALUES ");
                let mut args = Vec::with_capacity(batch.len() * 5);
                for (i, k) in batch.iter().enumerate() {
                    if i > 0 {
                        sql.push_str(", ");
                    }
                    sql.push_str(row);
                    args.push(Val::Key(k.as_str().to_owned()));
                    args.push(Val::I64(Some(FencingToken::random().0)));
                    if full_row {
                        args.push(Val::I64(Some(i64::MAX / 2)));
                        args.push(Val::I64(Some(1)));
                        args.push(Val::Text(Some("bench-worker".to_owned())));
                    }
                }
                if d.name() != "mysql" {
                    sql.push_str(&format!(" ON CONFLICT ({key_col}) DO NOTHING"));
                }
                let n = DB::execute(&mut conn, &d.placeholders(sql), args)
                    .await
                    .expect("insert");
                assert_eq!(n as usize, batch.len());
            }
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    let rate = a.batched as f64 / start.elapsed().as_secs_f64();
    let mut conn = store.pool().acquire().await.expect("connection");
    DB::execute(&mut conn, "DROP TABLE idemq_bench_raw", vec![])
        .await
        .expect("drop");
    rate
}

async fn run<DB: SqlBackend>(store: SqlStore<DB>, a: &Args) {
    let store = Arc::new(store);
    {
        let mut conn = store.pool().acquire().await.expect("connection");
        DB::execute(&mut conn, "DELETE FROM idemq_bench", vec![])
            .await
            .expect("clear");
    }
    let g = ConsumerGroup::new(&format!(
        "bench-{:08x}",
        FencingToken::random().0 & 0xffff_ffff
    ))
    .expect("group");
    println!(
        "backend={} tasks={} batch={} per-message keys={} batched keys={}",
        DB::DIALECT.name(),
        a.tasks,
        a.batch,
        a.single,
        a.batched
    );
    let single = phase(
        "per-message claim+complete",
        "msg/s",
        per_message(&store, a, &g),
    )
    .await;
    // The machine is shared and the servers warm up: interleave the batched phases with
    // the raw baseline over three rounds and keep each one's best.
    let (mut claims, mut batch, mut raw_best, mut row_best) = (0f64, 0f64, 0f64, 0f64);
    for round in 1..=3 {
        println!("round {round}");
        let rg = ConsumerGroup::new(&format!("{}-r{round}", g.as_str())).expect("group");
        raw_best =
            raw_best.max(phase("raw multi-row insert", "rows/s", raw(&store, a, &rg, false)).await);
        if DB::DIALECT.name() != "sqlite" {
            let rg2 = ConsumerGroup::new(&format!("{}-row", rg.as_str())).expect("group");
            row_best = row_best.max(
                phase(
                    "raw insert, dedup row shape",
                    "rows/s",
                    raw(&store, a, &rg2, true),
                )
                .await,
            );
        }
        claims = claims.max(
            phase(
                "batched claims (claim_batch only)",
                "claims/s",
                batched(&store, a, &rg, false),
            )
            .await,
        );
        batch = batch.max(
            phase(
                "batched claim+complete",
                "msg/s",
                batched(&store, a, &rg, true),
            )
            .await,
        );
    }
    let raw = raw_best;
    println!(
        "best of 3: raw {raw:.0} rows/s, batched claims {claims:.0} claims/s, batched claim+complete {batch:.0} msg/s, per-message {single:.0} msg/s"
    );
    println!(
        "ratios: batched/per-message = {:.1}x   batched claims/raw = {:.0}%   batched claim+complete/raw = {:.0}%",
        batch / single,
        100.0 * claims / raw,
        100.0 * batch / raw
    );
    if row_best > 0.0 {
        println!(
            "        batched claims/raw insert of the same rows ({row_best:.0} rows/s) = {:.0}%",
            100.0 * claims / row_best
        );
    }
}

#[tokio::main]
async fn main() {
    let a = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("error: {e}");
            }
            eprintln!("usage: bench <url> [--tasks N] [--batch B] [--single M] [--batched K]");
            std::process::exit(2);
        }
    };
    let scheme = a
        .url
        .split(':')
        .next()
        .unwrap_or_default()
        .to_ascii_lowercase();
    let opts = options(&a);
    match scheme.as_str() {
        #[cfg(feature = "postgres")]
        "postgres" | "postgresql" => {
            run(
                idemq_sql::PgStore::connect(&a.url, opts)
                    .await
                    .expect("connect"),
                &a,
            )
            .await
        }
        #[cfg(feature = "mysql")]
        "mysql" | "mariadb" => {
            run(
                idemq_sql::MySqlStore::connect(&a.url, opts)
                    .await
                    .expect("connect"),
                &a,
            )
            .await
        }
        #[cfg(feature = "sqlite")]
        "sqlite" => {
            run(
                idemq_sql::SqliteStore::connect(&a.url, opts)
                    .await
                    .expect("connect"),
                &a,
            )
            .await
        }
        other => {
            eprintln!(
                "error: unsupported or disabled scheme `{other}` (build with --all-features)"
            );
            std::process::exit(2);
        }
    }
}
