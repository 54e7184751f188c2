//! docs/performance.md and its plots, rendered from a suite's results file: the ratios
//! against the baselines measured in the same run first, each next to its target (met or
//! missed), then each scenario's figures, the plots, and the machine and servers.

use super::svg::{self, Axes, Series};
use serde_json::Value;
use std::fmt::Write as _;
use std::path::Path;

/// The brokers of the `broker-<name>` scenarios, in the report's order.
const BROKERS: [&str; 4] = ["rabbitmq", "kafka", "rocketmq", "nats"];

/// Where the plots go, relative to the report.
const PLOTS: &str = "perf";

/// The command that regenerates the report (as README states it).
pub const COMMAND: &str = "scripts/bench.sh";

struct Doc<'a>(&'a Value);

impl<'a> Doc<'a> {
    fn entry(&self, name: &str) -> Option<&'a Value> {
        self.0["scenarios"]
            .as_array()?
            .iter()
            .find(|s| s["name"] == name)
    }

    /// The result of a scenario that ran.
    fn result(&self, name: &str) -> Option<&'a Value> {
        self.entry(name)
            .filter(|e| e["ok"] == true)
            .map(|e| &e["result"])
    }

    /// Writes a section's heading, and returns the scenario's result; without one, says why
    /// under the heading instead.
    fn section(&self, md: &mut String, heading: &str, name: &str) -> Option<&'a Value> {
        let _ = writeln!(md, "## {heading}\n");
        let r = self.result(name);
        if r.is_none() {
            let _ = writeln!(md, "{}\n", self.missing(name));
        }
        r
    }

    /// Why a scenario has no figures.
    fn missing(&self, name: &str) -> String {
        match self.entry(name) {
            None => format!("not measured: `{name}` was not part of this run"),
            Some(e) if e["ok"] == true => "not measured".into(),
            Some(e) => format!(
                "not measured: `{name}` failed ({})",
                e["error"].as_str().unwrap_or("no reason").replace('|', "/")
            ),
        }
    }
}

/// `12,345,678` for rates, two decimals under 100.
fn num(v: f64) -> String {
    if !v.is_finite() {
        return "-".into();
    }
    if v.abs() < 100.0 {
        return format!("{v:.2}");
    }
    let s = format!("{:.0}", v);
    let (sign, digits) = s.strip_prefix('-').map_or(("", s.as_str()), |d| ("-", d));
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    format!("{sign}{out}")
}

/// A count: `10,000,000`.
fn int(v: &Value) -> String {
    v.as_f64()
        .map_or("-".into(), |x| if x == 0.0 { "0".into() } else { num(x) })
}

fn f(v: &Value) -> Option<f64> {
    v.as_f64()
}

/// A target: the ratio (or value) must be at least / at most `bound`.
#[derive(Clone, Copy)]
enum Target {
    AtLeast(f64),
    AtMost(f64),
    /// A figure from earlier measurements to beat (higher is better).
    Beat(f64),
    None,
}

impl Target {
    fn text(self, unit: &str) -> String {
        match self {
            Target::AtLeast(b) => format!("≥ {}{unit}", trim(b)),
            Target::AtMost(b) => format!("≤ {}{unit}", trim(b)),
            Target::Beat(b) => format!("> {}{unit} (earlier figure)", trim(b)),
            Target::None => "none set".into(),
        }
    }

    fn status(self, v: f64) -> &'static str {
        let met = match self {
            Target::AtLeast(b) => v >= b,
            Target::AtMost(b) => v <= b,
            Target::Beat(b) => v > b,
            Target::None => return "—",
        };
        if met {
            "**met**"
        } else {
            "**missed**"
        }
    }
}

fn trim(v: f64) -> String {
    if v >= 1000.0 {
        num(v)
    } else {
        let s = format!("{v:.2}");
        s.trim_end_matches('0').trim_end_matches('.').to_owned()
    }
}

/// The rows of the first table.
struct Ratios(String);

impl Ratios {
    fn row(
        &mut self,
        what: &str,
        ours: Option<(f64, f64)>,
        unit: &str,
        target: Target,
        why_not: &str,
    ) {
        // `ours` is (value, baseline) for a ratio; baseline NaN for an absolute value.
        match ours {
            Some((v, b)) if b.is_nan() => {
                let _ = writeln!(
                    self.0,
                    "| {what} | {}{unit} | {} | {} |",
                    num(v),
                    target.text(unit),
                    target.status(v)
                );
            }
            Some((v, b)) => {
                let r = v / b;
                let _ = writeln!(
                    self.0,
                    "| {what} | **{r:.2}x** ({} / {}) | {} | {} |",
                    num(v),
                    num(b),
                    target.text("x"),
                    target.status(r)
                );
            }
            None => {
                let _ = writeln!(
                    self.0,
                    "| {what} | {why_not} | {} | — |",
                    target.text(if unit.is_empty() { "x" } else { unit })
                );
            }
        }
    }
}

/// The point of a store sweep at the largest batch.
fn top_point(r: &Value) -> Option<&Value> {
    r["points"]
        .as_array()?
        .iter()
        .max_by_key(|p| p["batch"].as_u64().unwrap_or(0))
}

fn ratio_at_top(r: Option<&Value>, ours: &str) -> Option<(f64, f64)> {
    let p = top_point(r?)?;
    Some((f(&p[ours]["rate"])?, f(&p["raw"]["rate"])?))
}

/// The lowest ratio of `ours` to raw over the sweep's batches of at least `min_batch` keys,
/// with its batch size.
fn ratio_lowest(r: Option<&Value>, ours: &str, min_batch: u64) -> Option<(f64, f64, u64)> {
    r?["points"]
        .as_array()?
        .iter()
        .filter(|p| p["batch"].as_u64().is_some_and(|b| b >= min_batch))
        .filter_map(|p| {
            Some((
                f(&p[ours]["rate"])?,
                f(&p["raw"]["rate"])?,
                p["batch"].as_u64()?,
            ))
        })
        .min_by(|a, b| (a.0 / a.1).total_cmp(&(b.0 / b.1)))
}

fn growth_pair(r: Option<&Value>) -> Option<(f64, f64, u64)> {
    let pts = r?["points"].as_array()?;
    let empty = pts.iter().find(|p| p["retained"] == 0)?;
    let most = pts
        .iter()
        .max_by_key(|p| p["retained"].as_u64().unwrap_or(0))?;
    Some((
        f(&most["rate"])?,
        f(&empty["rate"])?,
        most["retained"].as_u64()?,
    ))
}

fn local_at(r: Option<&Value>, keys: Option<u64>) -> Option<&Value> {
    let pts = r?["points"].as_array()?;
    match keys {
        Some(k) => pts.iter().find(|p| p["keys"] == k),
        None => pts.iter().max_by_key(|p| p["keys"].as_u64().unwrap_or(0)),
    }
}

/// Writes the report and its plots.
pub fn render(doc: &Value, report: &Path) -> anyhow::Result<()> {
    let d = Doc(doc);
    let dir = report
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let plots = dir.join(PLOTS);
    std::fs::create_dir_all(&plots)?;
    let mut md = String::new();
    let profile = doc["profile"].as_str().unwrap_or("?");
    let _ = writeln!(md, "# Performance\n");
    let ats: Vec<&str> = doc["scenarios"]
        .as_array()
        .map(|a| a.iter().filter_map(|s| s["at"].as_str()).collect())
        .unwrap_or_default();
    let when = match (ats.iter().min(), ats.iter().max()) {
        (Some(a), Some(b)) if a != b => format!("scenarios measured from {a} to {b}"),
        _ => doc["generated_utc"].as_str().unwrap_or("?").to_owned(),
    };
    let _ = writeln!(
        md,
        "Generated by `{COMMAND}` from the results of `idemq bench suite` (profile **{profile}**, \
         {when}, commit `{}`); do not edit by hand. Every ratio divides two figures measured by \
         the same scenario process, side by side, on the same machine (2 shared cores: absolute \
         figures are noisy, ratios less so). Results: [`{PLOTS}/results.json`]({PLOTS}/results.json) \
         when written to the default place.\n",
        doc["commit"].as_str().unwrap_or("?"),
    );
    if profile != "full" {
        let _ = writeln!(
            md,
            "> **Smoke profile**: tiny sizes that prove the suite runs; its figures are not the \
             project's performance.\n"
        );
    }
    ratios(&d, &mut md);
    machine(doc, &mut md);
    stores(&d, &mut md, &plots)?;
    local_layer(&d, &mut md, &plots)?;
    storm(&d, &mut md);
    growth(&d, &mut md, &plots)?;
    brokers(&d, &mut md);
    producer(&d, &mut md, &plots)?;
    group(&d, &mut md);
    // Observations written by hand about a run (dated there), kept beside the plots so a
    // regenerated report keeps them; they are not figures and the suite never writes them.
    if let Ok(notes) = std::fs::read_to_string(plots.join("notes.md")) {
        let _ = writeln!(
            md,
            "## Notes on the figures (by hand)\n\n{}\n",
            notes.trim()
        );
    }
    let _ = writeln!(
        md,
        "## How it is measured\n\n\
         - Each scenario runs in a process of its own (`idemq bench scenario NAME --profile P`), \
           one after the other, against the servers of `scripts/servers.sh`.\n\
         - Store sweeps: one client; each call is timed alone (key building outside the clock); \
           rate = keys / summed call time; p50/p99 are of one call (one round trip of `batch` \
           keys). Raw, claim and claim+complete phases interleave; the best of the rounds is kept.\n\
         - Broker comparisons: best of interleaved rounds; fresh topics/queues per run; the \
           consumers' clocks start at their first record.\n\
         - Growth: retained keys loaded server-side in the store's own record format (copied \
           from a real completed record), then claims/s of fresh keys at batch 100.\n"
    );
    std::fs::write(report, md).map_err(|e| anyhow::anyhow!("write {}: {e}", report.display()))?;
    Ok(())
}

fn ratios(d: &Doc<'_>, md: &mut String) {
    let _ = writeln!(md, "## Ratios and targets\n");
    let _ = writeln!(
        md,
        "Ours / the baseline measured in the same run. Store ratios are at the largest batch \
         measured (1000 keys per round trip), one client.\n"
    );
    let _ = writeln!(
        md,
        "| what | measured | target | status |\n|---|---|---|---|"
    );
    let mut t = Ratios(String::new());
    let pg = d.result("store-postgres");
    let why = |n: &str| d.missing(n);
    t.row(
        "PostgreSQL: batched claims / raw multi-row INSERT … ON CONFLICT",
        ratio_at_top(pg, "claim"),
        "",
        Target::Beat(0.70),
        &why("store-postgres"),
    );
    t.row(
        "PostgreSQL: claim + complete / raw multi-row INSERT",
        ratio_at_top(pg, "claim_complete"),
        "",
        Target::AtLeast(0.50),
        &why("store-postgres"),
    );
    let lowest = ratio_lowest(pg, "claim_complete", 10);
    t.row(
        &format!(
            "PostgreSQL: claim + complete / raw multi-row INSERT, lowest over batches 10 to 1000{}",
            lowest
                .map(|l| format!(" (batch {})", l.2))
                .unwrap_or_default()
        ),
        lowest.map(|l| (l.0, l.1)),
        "",
        Target::AtLeast(0.25),
        &why("store-postgres"),
    );
    t.row(
        "Redis: batched claims / raw pipelined SET NX PX",
        ratio_at_top(d.result("store-redis"), "claim"),
        "",
        Target::Beat(0.83),
        &why("store-redis"),
    );
    t.row(
        "NATS KV: batched claims / raw KV creates",
        ratio_at_top(d.result("store-nats-kv"), "claim"),
        "",
        Target::None,
        &why("store-nats-kv"),
    );
    for (store, name) in [("store-mysql", "MariaDB"), ("store-sqlite", "SQLite")] {
        t.row(
            &format!("{name}: batched claims / raw multi-row insert"),
            ratio_at_top(d.result(store), "claim"),
            "",
            Target::None,
            &why(store),
        );
    }
    let local = d.result("local-layer");
    for (keys, target) in [
        (1_000u64, Target::Beat(21e6)),
        (100_000, Target::Beat(3.3e6)),
        (1_000_000, Target::None),
    ] {
        t.row(
            &format!(
                "local layer: duplicate checks/s on one core, one key per call, {} retained keys",
                svg::short(keys as f64)
            ),
            local_at(local, Some(keys))
                .and_then(|p| f(&p["checks_per_sec"]))
                .map(|v| (v, f64::NAN)),
            " /s",
            target,
            &why("local-layer"),
        );
    }
    t.row(
        "local layer: duplicate checks/s on one core, a batch per call (as the engine's claims ask), 1M retained keys",
        local_at(local, Some(1_000_000))
            .and_then(|p| f(&p["batched_checks_per_sec"]))
            .map(|v| (v, f64::NAN)),
        " /s",
        Target::AtLeast(5e6),
        &why("local-layer"),
    );
    let biggest = local_at(local, None);
    t.row(
        &format!(
            "local layer: resident bytes per retained key ({} keys)",
            biggest
                .and_then(|p| p["keys"].as_f64())
                .map_or("largest".into(), svg::short)
        ),
        biggest
            .and_then(|p| f(&p["bytes_per_key"]))
            .map(|v| (v, f64::NAN)),
        " B",
        Target::AtMost(64.0),
        &why("local-layer"),
    );
    let engine = d.result("engine");
    t.row(
        "engine + memory store / bare poll+ack (in-memory broker)",
        engine.and_then(|e| Some((f(&e["memory_rate"])?, f(&e["bare_rate"])?))),
        "",
        Target::Beat(0.10),
        &why("engine"),
    );
    for (scenario, name) in [
        ("growth-postgres", "PostgreSQL"),
        ("growth-redis", "Redis"),
        ("growth-local", "local layer"),
    ] {
        let g = growth_pair(d.result(scenario));
        let label = g.map_or("most".into(), |(_, _, n)| svg::short(n as f64));
        t.row(
            &format!("{name}: claims/s with {label} retained keys / with none"),
            g.map(|(a, b, _)| (a, b)),
            "",
            Target::AtLeast(0.80),
            &why(scenario),
        );
    }
    let storm = d.result("storm");
    t.row(
        "duplicate storm: replay through the local layer / bare poll+ack",
        storm.and_then(|s| Some((f(&s["layered_rate"])?, f(&s["bare_rate"])?))),
        "",
        Target::None,
        &why("storm"),
    );
    t.row(
        "duplicate storm: replay through the local layer / PostgreSQL store alone",
        storm.and_then(|s| Some((f(&s["layered_rate"])?, f(&s["postgres_rate"])?))),
        "",
        Target::None,
        &why("storm"),
    );
    for b in BROKERS {
        let name = format!("broker-{b}");
        let r = d.result(&name);
        let pair = |ours: &str, base: &str| r.and_then(|r| Some((f(&r[ours])?, f(&r[base])?)));
        t.row(
            &format!("{b}: idemq + memory store / bare consumer"),
            pair("memory", "bare"),
            "",
            Target::None,
            &why(&name),
        );
        // The one engine with batch handlers, against the hand-written consumer (one row
        // written per message), except the dedup table with leases: it writes three rows
        // per message (claim, effect, completion), so its target is against the same three
        // statements written raw by the hand-written consumer (bound3).
        let hw = "hand-written ON CONFLICT consumer";
        for (what, ours, base, target) in [
            (
                "unique-keyed (batch handler, unique index, keyed effect rows: the default for effect rows)",
                "unique_keyed",
                "handwritten",
                Target::AtLeast(1.0),
            ),
            (
                "unique (batch handler, unique index: keys table + effect rows)",
                "unique",
                "handwritten",
                Target::None,
            ),
            (
                "batch-redis (batch handler + Redis store, effect rows in PostgreSQL)",
                "batch_redis",
                "handwritten",
                Target::AtLeast(0.80),
            ),
            (
                "batch-postgres (batch handler + PostgreSQL dedup table with leases)",
                "batch_postgres",
                "bound3",
                Target::AtLeast(0.80),
            ),
            (
                "bound3 (hand-written claim + effect + completion, raw)",
                "bound3",
                "handwritten",
                Target::None,
            ),
            (
                "batch-postgres (batch handler + PostgreSQL dedup table with leases)",
                "batch_postgres",
                "handwritten",
                Target::None,
            ),
            (
                "postgres (per-message handler + PostgreSQL store)",
                "postgres",
                "handwritten",
                Target::None,
            ),
            (
                "redis (per-message handler + Redis store)",
                "redis",
                "handwritten",
                Target::None,
            ),
        ] {
            let of = match base {
                "bound3" => "bound3",
                _ => hw,
            };
            t.row(
                &format!("{b}: {what} / {of}"),
                pair(ours, base),
                "",
                target,
                &why(&name),
            );
        }
    }
    let producer = d.result("kafka-producer");
    for ms in [10u64, 100, 1000] {
        let row = producer.and_then(|p| {
            p["intervals"]
                .as_array()?
                .iter()
                .find(|r| r["interval_ms"] == ms)
        });
        t.row(
            &format!("Kafka: transactional producer, commit every {ms} ms / idempotent producer"),
            row.and_then(|r| Some((f(&r["transactional_rate"])?, f(&r["idempotent_rate"])?))),
            "",
            if ms == 100 {
                Target::AtLeast(0.85)
            } else {
                Target::None
            },
            &why("kafka-producer"),
        );
    }
    let grp = d.result("kafka-group");
    for c in [2u64, 4] {
        let rate = |n: u64| {
            grp.and_then(|g| {
                g["points"]
                    .as_array()?
                    .iter()
                    .find(|p| p["consumers"] == n)
                    .and_then(|p| f(&p["rate"]))
            })
        };
        t.row(
            &format!("Kafka: {c} idempotent consumers in one group / 1 consumer"),
            rate(c).zip(rate(1)),
            "",
            Target::None,
            &why("kafka-group"),
        );
    }
    md.push_str(&t.0);
    md.push('\n');
}

fn machine(doc: &Value, md: &mut String) {
    let m = &doc["machine"];
    let _ = writeln!(md, "## Machine and servers\n");
    let _ = writeln!(
        md,
        "- {} CPUs ({}), {} GiB memory, {} (kernel {}), {}",
        m["cpus"],
        m["cpu_model"].as_str().unwrap_or("?"),
        m["memory_gib"],
        m["os"].as_str().unwrap_or("?"),
        m["kernel"].as_str().unwrap_or("?"),
        m["rustc"].as_str().unwrap_or("?"),
    );
    let loads: Vec<f64> = doc["scenarios"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| s["load1_before"].as_f64())
                .collect()
        })
        .unwrap_or_default();
    if let (Some(lo), Some(hi)) = (
        loads.iter().copied().reduce(f64::min),
        loads.iter().copied().reduce(f64::max),
    ) {
        let _ = writeln!(
            md,
            "- 1-minute load average when the scenarios started: {lo:.1} to {hi:.1} (other work \
             shares these cores; see each scenario's `load1_before` in the results)"
        );
    }
    if let Some(servers) = doc["servers"].as_object() {
        for (k, v) in servers {
            let _ = writeln!(md, "- {k}: {}", v.as_str().unwrap_or("?"));
        }
    }
    let _ = writeln!(
        md,
        "- other servers (RabbitMQ, RocketMQ): as `scripts/servers.sh` installs them; their \
         versions are not queried by the suite\n"
    );
}

fn stores(d: &Doc<'_>, md: &mut String, plots: &Path) -> anyhow::Result<()> {
    let _ = writeln!(md, "## Stores: claims/s and latency by batch size\n");
    let names = [
        ("memory", "memory"),
        ("layered", "layered (over memory)"),
        ("sqlite", "SQLite"),
        ("postgres", "PostgreSQL"),
        ("mysql", "MariaDB"),
        ("redis", "Redis"),
        ("nats-kv", "NATS KV"),
    ];
    let mut claims = Vec::new();
    let mut both = Vec::new();
    for (i, (key, label)) in names.iter().enumerate() {
        let name = format!("store-{key}");
        let Some(r) = d.result(&name) else {
            let _ = writeln!(md, "- {label}: {}\n", d.missing(&name));
            continue;
        };
        let pts = r["points"].as_array().cloned().unwrap_or_default();
        let series = |phase: &str| -> Vec<(f64, f64)> {
            pts.iter()
                .filter_map(|p| Some((p["batch"].as_f64()?, f(&p[phase]["rate"])?)))
                .collect()
        };
        claims.push(Series {
            name: format!("{label} claims"),
            points: series("claim"),
            color: i,
            dashed: false,
        });
        claims.push(Series {
            name: format!("{label} raw"),
            points: series("raw"),
            color: i,
            dashed: true,
        });
        both.push(Series {
            name: format!("{label} claim+complete"),
            points: series("claim_complete"),
            color: i,
            dashed: false,
        });
        let server = r["server"].as_str().filter(|s| !s.is_empty());
        let _ = writeln!(
            md,
            "### {label}\n\nBaseline: {}{}.\n",
            r["baseline"].as_str().unwrap_or("?"),
            server.map_or(String::new(), |s| format!(" ({s})"))
        );
        let _ = writeln!(
            md,
            "| batch | raw keys/s | claims/s | claims / raw | claim+complete keys/s | c+c / raw | claim p50 / p99 ms | claim+complete p50 / p99 ms | raw p50 / p99 ms |\n|---|---|---|---|---|---|---|---|---|"
        );
        for p in &pts {
            let rate = |ph: &str| f(&p[ph]["rate"]).unwrap_or(f64::NAN);
            let lat = |ph: &str| {
                format!(
                    "{:.3} / {:.3}",
                    f(&p[ph]["p50_ms"]).unwrap_or(f64::NAN),
                    f(&p[ph]["p99_ms"]).unwrap_or(f64::NAN)
                )
            };
            let _ = writeln!(
                md,
                "| {} | {} | {} | {:.2}x | {} | {:.2}x | {} | {} | {} |",
                p["batch"],
                num(rate("raw")),
                num(rate("claim")),
                rate("claim") / rate("raw"),
                num(rate("claim_complete")),
                rate("claim_complete") / rate("raw"),
                lat("claim"),
                lat("claim_complete"),
                lat("raw"),
            );
        }
        let file = format!("latency-{key}.svg");
        let lat_series = |phase: &str, pct: &str| -> Vec<(f64, f64)> {
            pts.iter()
                .filter_map(|p| Some((p["batch"].as_f64()?, f(&p[phase][pct])?)))
                .collect()
        };
        let mut ls = Vec::new();
        for (j, (phase, plabel)) in [
            ("claim", "claim"),
            ("claim_complete", "claim+complete"),
            ("raw", "raw"),
        ]
        .iter()
        .enumerate()
        {
            for (pct, dashed) in [("p50_ms", false), ("p99_ms", true)] {
                ls.push(Series {
                    name: format!("{plabel} {}", &pct[..3]),
                    points: lat_series(phase, pct),
                    color: j,
                    dashed,
                });
            }
        }
        std::fs::write(
            plots.join(&file),
            svg::line_chart(
                &Axes {
                    title: &format!("{label}: latency of one call (p50 solid, p99 dashed)"),
                    x_label: "keys per call (batch)",
                    y_label: "ms per call",
                    log_x: true,
                    log_y: true,
                },
                &ls,
            ),
        )?;
        let _ = writeln!(md, "\n![{label} latency]({PLOTS}/{file})\n");
    }
    if !claims.is_empty() {
        std::fs::write(
            plots.join("stores-claims.svg"),
            svg::line_chart(
                &Axes {
                    title: "Claims/s by batch size (dashed: the raw server operation)",
                    x_label: "keys per call (batch)",
                    y_label: "keys/s",
                    log_x: true,
                    log_y: true,
                },
                &claims,
            ),
        )?;
        std::fs::write(
            plots.join("stores-claim-complete.svg"),
            svg::line_chart(
                &Axes {
                    title: "Claim + complete keys/s by batch size",
                    x_label: "keys per call (batch)",
                    y_label: "keys/s",
                    log_x: true,
                    log_y: true,
                },
                &both,
            ),
        )?;
        let _ = writeln!(
            md,
            "![claims/s by batch]({PLOTS}/stores-claims.svg)\n\n![claim+complete by batch]({PLOTS}/stores-claim-complete.svg)\n"
        );
    }
    Ok(())
}

fn local_layer(d: &Doc<'_>, md: &mut String, plots: &Path) -> anyhow::Result<()> {
    let Some(r) = d.section(md, "Local layer", "local-layer") else {
        return Ok(());
    };
    let _ = writeln!(md, "{}.\n", r["what"].as_str().unwrap_or(""));
    let _ = writeln!(
        md,
        "| retained keys | checks/s (one core, one key per call) | checks/s (a batch per call) | hit ratio | bytes per key |\n|---|---|---|---|---|"
    );
    let pts = r["points"].as_array().cloned().unwrap_or_default();
    for p in &pts {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {:.3} | {:.1} |",
            int(&p["keys"]),
            num(f(&p["checks_per_sec"]).unwrap_or(f64::NAN)),
            f(&p["batched_checks_per_sec"]).map_or("–".into(), num),
            f(&p["hit_ratio"]).unwrap_or(f64::NAN),
            f(&p["bytes_per_key"]).unwrap_or(f64::NAN),
        );
    }
    let series = vec![
        Series {
            name: "checks/s, one key per call".into(),
            points: pts
                .iter()
                .filter_map(|p| Some((f(&p["keys"])?, f(&p["checks_per_sec"])?)))
                .collect(),
            color: 0,
            dashed: false,
        },
        Series {
            name: "checks/s, a batch per call".into(),
            points: pts
                .iter()
                .filter_map(|p| Some((f(&p["keys"])?, f(&p["batched_checks_per_sec"])?)))
                .collect(),
            color: 1,
            dashed: true,
        },
    ];
    std::fs::write(
        plots.join("local-layer.svg"),
        svg::line_chart(
            &Axes {
                title: "Local layer: duplicate checks/s on one core",
                x_label: "retained keys",
                y_label: "checks/s",
                log_x: true,
                log_y: true,
            },
            &series,
        ),
    )?;
    let _ = writeln!(md, "\n![local layer]({PLOTS}/local-layer.svg)\n");
    Ok(())
}

fn storm(d: &Doc<'_>, md: &mut String) {
    let Some(r) = d.section(md, "Duplicate storm (seed 002, scaled)", "storm") else {
        return;
    };
    let _ = writeln!(
        md,
        "Seed 002 replayed 20M messages after an offset reset; here {} already-processed \
         messages (completed in PostgreSQL through the layered store, {:.1} s to load) are \
         replayed through the engine over the in-memory broker, batch 256. The PostgreSQL \
         store alone replays {} of them.\n",
        int(&r["messages"]),
        f(&r["fill_secs"]).unwrap_or(0.0),
        int(&r["store_sample"]),
    );
    let _ = writeln!(
        md,
        "| consumer | messages/s |\n|---|---|\n| bare poll+ack (ceiling) | {} |\n| idemq + local layer over PostgreSQL | {} |\n| idemq + PostgreSQL store alone | {} |\n\nCache hits of the local layer: {}.\n",
        num(f(&r["bare_rate"]).unwrap_or(f64::NAN)),
        num(f(&r["layered_rate"]).unwrap_or(f64::NAN)),
        num(f(&r["postgres_rate"]).unwrap_or(f64::NAN)),
        int(&r["cache_hits"]),
    );
}

fn growth(d: &Doc<'_>, md: &mut String, plots: &Path) -> anyhow::Result<()> {
    let _ = writeln!(md, "## Cost growth with retained keys\n");
    let mut series = Vec::new();
    for (i, (scenario, label)) in [
        ("growth-postgres", "PostgreSQL"),
        ("growth-redis", "Redis"),
        ("growth-local", "local layer"),
    ]
    .iter()
    .enumerate()
    {
        let Some(r) = d.result(scenario) else {
            let _ = writeln!(md, "- {label}: {}\n", d.missing(scenario));
            continue;
        };
        let _ = writeln!(
            md,
            "### {label}\n\n{}; claims of fresh keys, batch {}.\n\n| retained keys | claims/s | / empty | p50 / p99 ms | load s |\n|---|---|---|---|---|",
            r["how"].as_str().unwrap_or(""),
            r["batch"]
        );
        let pts = r["points"].as_array().cloned().unwrap_or_default();
        let empty = pts
            .iter()
            .find(|p| p["retained"] == 0)
            .and_then(|p| f(&p["rate"]))
            .unwrap_or(f64::NAN);
        for p in &pts {
            let rate = f(&p["rate"]).unwrap_or(f64::NAN);
            let _ = writeln!(
                md,
                "| {} | {} | {:.2}x | {:.3} / {:.3} | {:.1} |",
                int(&p["retained"]),
                num(rate),
                rate / empty,
                f(&p["p50_ms"]).unwrap_or(f64::NAN),
                f(&p["p99_ms"]).unwrap_or(f64::NAN),
                f(&p["load_secs"]).unwrap_or(0.0),
            );
        }
        md.push('\n');
        series.push(Series {
            name: (*label).into(),
            points: pts
                .iter()
                .filter_map(|p| Some((f(&p["retained"])?, f(&p["rate"])? / empty)))
                .collect(),
            color: i,
            dashed: false,
        });
    }
    if !series.is_empty() {
        std::fs::write(
            plots.join("growth.svg"),
            svg::line_chart(
                &Axes {
                    title: "Claims/s relative to the empty store",
                    x_label: "retained keys",
                    y_label: "rate / empty-store rate",
                    log_x: false,
                    log_y: false,
                },
                &series,
            ),
        )?;
        let _ = writeln!(md, "![growth]({PLOTS}/growth.svg)\n");
    }
    Ok(())
}

fn brokers(d: &Doc<'_>, md: &mut String) {
    let _ = writeln!(
        md,
        "## Brokers: idempotent consumers against the consumers users would write\n"
    );
    let depth = BROKERS
        .iter()
        .find_map(|b| d.result(&format!("broker-{b}"))?["pipeline_depth"].as_u64())
        .map_or("a few".into(), |p| p.to_string());
    let _ = writeln!(
        md,
        "Messages/s, best of interleaved rounds. *bare*: the broker's own consumer, manual \
         ack/commit, no dedup. *hand-written*: the same writing each batch's effect rows with one \
         `INSERT … ON CONFLICT DO NOTHING` on PostgreSQL (one row written per message). \
         *bound3*: the same writing, per batch, what a dedup table with leases writes, raw: a \
         multi-row `INSERT … ON CONFLICT DO NOTHING` of the claims into a table shaped like the \
         dedup table (autocommit), then one transaction with the effect rows and one `UPDATE` \
         completing the claims (three rows per message).\n\n\
         The idemq consumers are the one engine (`IdempotentConsumer`, {depth} batches at once: \
         `ConsumerConfig::pipeline_depth`, recorded in each result) writing the same effect \
         rows. With a batch handler: *unique-keyed*, the default for effect rows in the store's \
         own database: `SqlStore::keyed_batch_handler` over `SqlStore::unique_index`, the \
         effect rows carry the dedup key in their unique column, one \
         `INSERT … ON CONFLICT DO NOTHING RETURNING` per batch (one write per message); \
         *unique*: `SqlStore::batch_handler` over the unique index (the keys table, then the \
         effect rows: two writes per message); *batch-redis*: `handler::batch` writing the \
         batch's effect rows with one multi-row insert, claims and completions in Redis; \
         *batch-postgres*: `SqlStore::batch_handler` over the PostgreSQL dedup table with \
         leases (claims in one round trip, then the effect rows and the fenced completions in \
         one transaction: three writes per message), compared with *bound3*. The SQL batch \
         handlers run one transaction at a time (pipelined batches overlap their polling, \
         claims and acks). Per message, for comparison: *postgres*, *redis*, a handler \
         inserting one effect row per message over each store.\n"
    );
    let _ = writeln!(
        md,
        "| broker | messages | bare | idemq + memory | hand-written | unique-keyed | unique | batch-redis | bound3 | batch-postgres | postgres (per message) | redis (per message) |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for b in BROKERS {
        let name = format!("broker-{b}");
        match d.result(&name) {
            Some(r) => {
                let cells: Vec<String> = [
                    "bare",
                    "memory",
                    "handwritten",
                    "unique_keyed",
                    "unique",
                    "batch_redis",
                    "bound3",
                    "batch_postgres",
                    "postgres",
                    "redis",
                ]
                .iter()
                .map(|k| f(&r[*k]).map_or("-".into(), num))
                .collect();
                let _ = writeln!(md, "| {b} | {} | {} |", r["messages"], cells.join(" | "));
            }
            None => {
                let _ = writeln!(md, "| {b} | {} | | | | | | | | | | |", d.missing(&name));
            }
        }
    }
    md.push('\n');
}

fn producer(d: &Doc<'_>, md: &mut String, plots: &Path) -> anyhow::Result<()> {
    let Some(r) = d.section(
        md,
        "Kafka: transactional against idempotent producer",
        "kafka-producer",
    ) else {
        return Ok(());
    };
    let _ = writeln!(
        md,
        "{} records of ~64 bytes per run, best of {} interleaved rounds.\n\n| commit interval | idempotent records/s | transactional records/s | ratio |\n|---|---|---|---|",
        r["records"], r["rounds"]
    );
    let rows = r["intervals"].as_array().cloned().unwrap_or_default();
    for row in &rows {
        let (i, t) = (
            f(&row["idempotent_rate"]).unwrap_or(f64::NAN),
            f(&row["transactional_rate"]).unwrap_or(f64::NAN),
        );
        let _ = writeln!(
            md,
            "| {} ms | {} | {} | {:.2}x |",
            row["interval_ms"],
            num(i),
            num(t),
            t / i
        );
    }
    let pick = |k: &str| -> Vec<(f64, f64)> {
        rows.iter()
            .filter_map(|r| Some((f(&r["interval_ms"])?, f(&r[k])?)))
            .collect()
    };
    std::fs::write(
        plots.join("kafka-producer.svg"),
        svg::line_chart(
            &Axes {
                title: "Kafka producer records/s by commit interval",
                x_label: "commit interval, ms",
                y_label: "records/s",
                log_x: true,
                log_y: false,
            },
            &[
                Series {
                    name: "transactional".into(),
                    points: pick("transactional_rate"),
                    color: 0,
                    dashed: false,
                },
                Series {
                    name: "idempotent".into(),
                    points: pick("idempotent_rate"),
                    color: 1,
                    dashed: true,
                },
            ],
        ),
    )?;
    let _ = writeln!(md, "\n![kafka producer]({PLOTS}/kafka-producer.svg)\n");
    Ok(())
}

fn group(d: &Doc<'_>, md: &mut String) {
    let Some(r) = d.section(md, "Kafka: 1, 2, 4 consumers in one group", "kafka-group") else {
        return;
    };
    let _ = writeln!(
        md,
        "{} messages over 4 partitions, idempotent consumers sharing one PostgreSQL store; \
         timed from the consumers' creation (group joins and rebalances included).\n\n| consumers | messages/s |\n|---|---|",
        r["messages"]
    );
    for p in r["points"].as_array().cloned().unwrap_or_default() {
        let _ = writeln!(
            md,
            "| {} | {} |",
            p["consumers"],
            num(f(&p["rate"]).unwrap_or(f64::NAN))
        );
    }
    md.push('\n');
}
