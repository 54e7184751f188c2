//! The benchmark suite's smoke profile, end to end, so the one command that regenerates
//! docs/performance.md cannot rot: `idemq bench suite --profile smoke` against the servers
//! `scripts/test.sh` started, into a temporary directory (the committed report is left
//! alone), then checks of the results file, the report's text and its plots, and that
//! `idemq bench report` re-renders the same report from the results.

use serde_json::Value;
use std::path::Path;
use std::process::Command;

/// The scenarios of the smoke profile (everything but the group-join-bound Kafka and
/// RocketMQ consumer comparisons).
const SMOKE: &[&str] = &[
    "engine",
    "store-memory",
    "store-layered",
    "store-sqlite",
    "store-postgres",
    "store-mysql",
    "store-redis",
    "store-nats-kv",
    "local-layer",
    "storm",
    "growth-postgres",
    "growth-redis",
    "growth-local",
    "broker-rabbitmq",
    "broker-nats",
    "kafka-producer",
];

fn idemq(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_idemq"))
        .args(args)
        .output()
        .expect("run the idemq binary")
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()))
}

fn rate(v: &Value) -> f64 {
    v["rate"].as_f64().unwrap_or(0.0)
}

#[test]
fn smoke_profile_writes_results_report_and_plots() {
    for var in [
        "IDEMQ_TEST_POSTGRES_URL",
        "IDEMQ_TEST_MYSQL_URL",
        "IDEMQ_TEST_REDIS_URL",
        "IDEMQ_TEST_AMQP_URL",
        "IDEMQ_TEST_KAFKA_BROKERS",
    ] {
        if idemq_core::testkit::servers::server_url(var).is_none() {
            return;
        }
    }
    let committed = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/performance.md");
    let committed_before = std::fs::read_to_string(&committed).ok();
    let dir = std::env::temp_dir().join(format!("idemq-bench-suite-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (results, report) = (dir.join("results.json"), dir.join("performance.md"));
    let started = std::time::Instant::now();
    let out = idemq(&[
        "bench",
        "suite",
        "--profile",
        "smoke",
        "--out",
        results.to_str().expect("utf-8 path"),
        "--report",
        report.to_str().expect("utf-8 path"),
    ]);
    let took = started.elapsed();
    assert!(
        out.status.success(),
        "suite failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("smoke profile took {:.1} s", took.as_secs_f64());

    let doc: Value = serde_json::from_str(&read(&results)).expect("results are JSON");
    assert_eq!(doc["profile"], "smoke");
    assert!(doc["machine"]["cpus"].as_u64().unwrap_or(0) >= 1, "{doc}");
    let scenarios = doc["scenarios"].as_array().expect("scenarios");
    let names: Vec<&str> = scenarios
        .iter()
        .filter_map(|s| s["name"].as_str())
        .collect();
    assert_eq!(names, SMOKE, "the smoke profile's scenarios, in order");
    for s in scenarios {
        assert_eq!(s["ok"], true, "scenario failed: {s}");
    }
    let result = |name: &str| {
        &scenarios
            .iter()
            .find(|s| s["name"] == name)
            .expect("scenario present")["result"]
    };
    for store in [
        "memory", "layered", "sqlite", "postgres", "mysql", "redis", "nats-kv",
    ] {
        let r = result(&format!("store-{store}"));
        let points = r["points"].as_array().expect("points");
        let batches: Vec<u64> = points.iter().filter_map(|p| p["batch"].as_u64()).collect();
        assert_eq!(batches, [1, 10, 100, 1000], "{store}");
        for p in points {
            for phase in ["raw", "claim", "claim_complete"] {
                let ph = &p[phase];
                assert!(rate(ph) > 0.0, "{store} {phase}: {p}");
                let (p50, p99) = (
                    ph["p50_ms"].as_f64().unwrap_or(-1.0),
                    ph["p99_ms"].as_f64().unwrap_or(-1.0),
                );
                assert!(p50 > 0.0 && p99 >= p50, "{store} {phase} percentiles: {ph}");
                assert!(
                    ph["keys"].as_u64().unwrap_or(0) >= 3,
                    "{store} {phase}: {ph}"
                );
            }
        }
    }
    for store in ["postgres", "mysql", "redis"] {
        let server = result(&format!("store-{store}"))["server"]
            .as_str()
            .unwrap_or("");
        assert!(!server.is_empty(), "{store} reported no server version");
        assert_eq!(doc["servers"][store], server, "servers table");
    }
    for p in result("local-layer")["points"].as_array().expect("points") {
        assert_eq!(
            p["hit_ratio"], 1.0,
            "every retained key is a cached duplicate: {p}"
        );
        assert!(p["checks_per_sec"].as_f64().unwrap_or(0.0) > 0.0);
    }
    let storm = result("storm");
    assert!(
        storm["cache_hits"].as_u64().unwrap_or(0) >= storm["messages"].as_u64().unwrap_or(1),
        "the local layer answered the replay: {storm}"
    );
    for g in ["growth-postgres", "growth-redis", "growth-local"] {
        let retained: Vec<u64> = result(g)["points"]
            .as_array()
            .expect("points")
            .iter()
            .filter_map(|p| p["retained"].as_u64())
            .collect();
        assert_eq!(retained, [0, 2_000, 10_000], "{g}");
    }
    for broker in ["rabbitmq", "nats"] {
        let r = result(&format!("broker-{broker}"));
        for k in [
            "bare",
            "memory",
            "handwritten",
            "bound3",
            "unique_keyed",
            "unique",
            "batch_redis",
            "batch_postgres",
            "postgres",
            "redis",
        ] {
            assert!(r[k].as_f64().unwrap_or(0.0) > 0.0, "{broker} {k}: {r}");
        }
    }
    let intervals: Vec<u64> = result("kafka-producer")["intervals"]
        .as_array()
        .expect("intervals")
        .iter()
        .filter_map(|r| r["interval_ms"].as_u64())
        .collect();
    assert_eq!(intervals, [10, 100, 1000]);

    let md = read(&report);
    assert!(md.starts_with("# Performance"), "{md}");
    assert!(
        md.contains("**smoke**") && md.contains("Smoke profile"),
        "{md}"
    );
    let ratios = md
        .split("## Ratios and targets")
        .nth(1)
        .and_then(|rest| rest.split("\n## ").next())
        .expect("a ratios section");
    for (row, figure) in [
        (
            "PostgreSQL: claim + complete / raw multi-row INSERT",
            "x** (",
        ),
        ("PostgreSQL: batched claims / raw multi-row INSERT", "x** ("),
        ("Redis: batched claims / raw pipelined SET NX PX", "x** ("),
        (
            "resident bytes per retained key (20k keys)",
            " B | ≤ 64 B |",
        ),
        ("one key per call, 1k retained keys", " /s | > 21,000,000 /s"),
        (
            "PostgreSQL: claims/s with 10k retained keys / with none",
            "x** (",
        ),
        (
            "Kafka: transactional producer, commit every 100 ms / idempotent",
            "x** (",
        ),
        (
            "rabbitmq: unique-keyed (batch handler, unique index, keyed effect rows",
            "x** (",
        ),
        (
            "rabbitmq: batch-redis (batch handler + Redis store",
            "x** (",
        ),
        (
            "rabbitmq: batch-postgres (batch handler + PostgreSQL dedup table with leases) / bound3",
            "x** (",
        ),
    ] {
        let line = ratios
            .lines()
            .find(|l| l.contains(row))
            .unwrap_or_else(|| panic!("no ratio row {row:?} in\n{ratios}"));
        assert!(
            line.contains("**met**") || line.contains("**missed**"),
            "row without a verdict: {line}"
        );
        assert!(line.contains(figure), "row without its figure: {line}");
    }
    // Scenarios left out of the smoke profile are said to be unmeasured, not invented.
    let kafka_row = ratios
        .lines()
        .find(|l| l.contains("kafka: idemq + memory store / bare consumer"))
        .expect("kafka consumer row");
    assert!(kafka_row.contains("not measured"), "{kafka_row}");
    assert!(md.contains("## Machine and servers"), "{md}");
    let pg_version = doc["servers"]["postgres"].as_str().unwrap_or("?");
    assert!(md.contains(pg_version), "server version in the report");
    for plot in [
        "stores-claims.svg",
        "stores-claim-complete.svg",
        "latency-postgres.svg",
        "latency-redis.svg",
        "local-layer.svg",
        "growth.svg",
        "kafka-producer.svg",
    ] {
        let svg = read(&dir.join("perf").join(plot));
        assert!(
            svg.starts_with("<svg") && svg.contains("<polyline"),
            "{plot}: {svg}"
        );
        assert!(
            md.contains(&format!("(perf/{plot})")),
            "the report links {plot}"
        );
    }

    // `bench report` renders the same report from the results alone.
    let again = dir.join("again").join("performance.md");
    let out = idemq(&[
        "bench",
        "report",
        results.to_str().expect("utf-8 path"),
        "--report",
        again.to_str().expect("utf-8 path"),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(read(&again), md, "re-rendered report differs");

    assert_eq!(
        std::fs::read_to_string(&committed).ok(),
        committed_before,
        "the committed docs/performance.md was left alone"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
