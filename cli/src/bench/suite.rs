//! `idemq bench suite`: every scenario in a process of its own (`idemq bench scenario NAME`,
//! which prints one JSON object), collected into one results file with the machine and the
//! server versions, then rendered into `docs/performance.md` and its plots
//! ([`super::report`]).

use super::sizes::Sizes;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

/// How much each scenario measures.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Profile {
    /// Seconds in all: tiny sizes, for CI (proves the suite runs, not the figures).
    Smoke,
    /// The figures of docs/performance.md (some minutes).
    Full,
}

impl Profile {
    /// The name written into the results.
    pub fn name(self) -> &'static str {
        match self {
            Profile::Smoke => "smoke",
            Profile::Full => "full",
        }
    }

    /// The sizes of this profile.
    pub fn sizes(self) -> Sizes {
        match self {
            Profile::Smoke => Sizes {
                phase_secs: 0.03,
                rounds: 1,
                batches: vec![1, 10, 100, 1000],
                local_keys: vec![1_000, 20_000],
                storm_keys: 2_000,
                storm_store_sample: 1_000,
                retained: vec![0, 2_000, 10_000],
                broker_messages: 300,
                kafka_messages: 300,
                broker_rounds: 1,
                producer_messages: 300,
                producer_rounds: 1,
                engine_messages: 5_000,
            },
            Profile::Full => Sizes {
                phase_secs: 1.0,
                rounds: 2,
                batches: vec![1, 10, 100, 1000],
                local_keys: vec![1_000, 100_000, 1_000_000],
                storm_keys: 500_000,
                storm_store_sample: 50_000,
                retained: vec![0, 1_000_000, 10_000_000],
                broker_messages: 20_000,
                kafka_messages: 100_000,
                broker_rounds: 2,
                producer_messages: 1_000_000,
                producer_rounds: 5,
                engine_messages: 200_000,
            },
        }
    }
}

/// Every scenario, in the order the suite runs them.
pub const SCENARIOS: &[&str] = &[
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
    "broker-kafka",
    "broker-rocketmq",
    "broker-nats",
    "kafka-producer",
    "kafka-group",
];

/// Scenarios the smoke profile leaves out (each needs many seconds of group joins and
/// rebalances whatever the message count); `--scenarios` can still name them.
const NOT_IN_SMOKE: &[&str] = &["broker-kafka", "broker-rocketmq", "kafka-group"];

/// Options of `idemq bench suite`.
#[derive(clap::Args, Debug)]
pub struct SuiteArgs {
    /// How much to measure.
    #[arg(long, value_enum, default_value_t = Profile::Full)]
    pub profile: Profile,
    /// The results file (JSON). Default: docs/perf/results.json for the full profile,
    /// target/bench-smoke/results.json for the smoke profile (which must not replace the
    /// committed figures).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// The report to write; its plots go to `perf/` beside it. Default:
    /// docs/performance.md (full), target/bench-smoke/performance.md (smoke).
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Only these scenarios (comma-separated; default: all of the profile).
    #[arg(long, value_delimiter = ',')]
    pub scenarios: Vec<String>,
    /// Update this results file instead of starting a new one: the scenarios run now
    /// replace their earlier entries (each entry keeps the time it was measured at), the
    /// others stay as they were. For re-measuring a scenario that failed.
    #[arg(long)]
    pub merge: Option<PathBuf>,
    /// Longest one scenario may run before it is killed and reported as failed.
    #[arg(long, default_value_t = 1800)]
    pub scenario_timeout_secs: u64,
}

/// Options of `idemq bench scenario` (what the suite runs in each child process).
#[derive(clap::Args, Debug)]
pub struct ScenarioArgs {
    /// The scenario (see `idemq bench suite --help`).
    pub name: String,
    /// How much to measure.
    #[arg(long, value_enum, default_value_t = Profile::Full)]
    pub profile: Profile,
}

/// Options of `idemq bench report`.
#[derive(clap::Args, Debug)]
pub struct ReportArgs {
    /// The results file of a suite run.
    #[arg(default_value = "docs/perf/results.json")]
    pub results: PathBuf,
    /// The report to write; its plots go to `perf/` beside it.
    #[arg(long, default_value = "docs/performance.md")]
    pub report: PathBuf,
}

/// Runs the suite: one child process per scenario, then the results file and the report.
pub async fn run(args: SuiteArgs) -> anyhow::Result<()> {
    let dir = match args.profile {
        Profile::Full => Path::new("docs"),
        Profile::Smoke => Path::new("target/bench-smoke"),
    };
    let out = args.out.clone().unwrap_or_else(|| {
        dir.join(if args.profile == Profile::Full {
            "perf/results.json"
        } else {
            "results.json"
        })
    });
    let report = args
        .report
        .clone()
        .unwrap_or_else(|| dir.join("performance.md"));
    let names: Vec<String> = if args.scenarios.is_empty() {
        SCENARIOS
            .iter()
            .filter(|s| args.profile == Profile::Full || !NOT_IN_SMOKE.contains(s))
            .map(|s| s.to_string())
            .collect()
    } else {
        for s in &args.scenarios {
            anyhow::ensure!(
                SCENARIOS.contains(&s.as_str()),
                "unknown scenario {s:?} (known: {})",
                SCENARIOS.join(", ")
            );
        }
        args.scenarios.clone()
    };
    let exe = std::env::current_exe()?;
    let started = Instant::now();
    let bar = indicatif::ProgressBar::new(names.len() as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{elapsed_precise} [{bar:30}] {pos}/{len} scenarios  {msg}",
        )?
        .progress_chars("=> "),
    );
    bar.enable_steady_tick(Duration::from_millis(250));
    let mut results = Vec::new();
    for name in &names {
        bar.set_message(name.clone());
        // The machine is shared: what else ran is part of the figure.
        let load1 = std::fs::read_to_string("/proc/loadavg").ok().and_then(|l| {
            l.split_whitespace()
                .next()
                .and_then(|v| v.parse::<f64>().ok())
        });
        let t = Instant::now();
        let outcome = child(
            &exe,
            name,
            args.profile,
            Duration::from_secs(args.scenario_timeout_secs),
        )
        .await;
        let secs = t.elapsed().as_secs_f64();
        let at = utc_now();
        let mut entry = match outcome {
            Ok(result) => {
                json!({"name": name, "ok": true, "secs": secs, "at": at, "result": result})
            }
            Err(e) => {
                bar.println(format!("{name}: not measured: {e:#}"));
                json!({"name": name, "ok": false, "secs": secs, "at": at, "error": format!("{e:#}")})
            }
        };
        entry["load1_before"] = json!(load1);
        results.push(entry);
        bar.inc(1);
    }
    bar.finish_with_message("done");
    if let Some(earlier) = &args.merge {
        let text = std::fs::read_to_string(earlier)
            .map_err(|e| anyhow::anyhow!("read {}: {e}", earlier.display()))?;
        let old: Value = serde_json::from_str(&text)?;
        let mut merged: Vec<Value> = old["scenarios"].as_array().cloned().unwrap_or_default();
        for r in results {
            match merged.iter_mut().find(|m| m["name"] == r["name"]) {
                Some(slot) => *slot = r,
                None => merged.push(r),
            }
        }
        let rank = |v: &Value| {
            SCENARIOS
                .iter()
                .position(|s| v["name"] == *s)
                .unwrap_or(usize::MAX)
        };
        merged.sort_by_key(rank);
        results = merged;
    }
    let servers = servers_of(&results);
    let doc = json!({
        "idemq_bench": 1,
        "profile": args.profile.name(),
        "generated_utc": utc_now(),
        "commit": command_line("git", &["rev-parse", "--short", "HEAD"]),
        "wall_secs": started.elapsed().as_secs_f64(),
        "sizes": format!("{:?}", args.profile.sizes()),
        "machine": machine(),
        "servers": servers,
        "scenarios": results,
    });
    write(&out, &serde_json::to_string_pretty(&doc)?)?;
    super::report::render(&doc, &report)?;
    let ok = doc["scenarios"].as_array().map_or(0, |a| {
        a.iter()
            .filter(|s| s["ok"] == true && names.iter().any(|n| s["name"] == n.as_str()))
            .count()
    });
    println!(
        "{ok}/{} scenarios measured in {:.0} s; results in {}, report in {}",
        names.len(),
        started.elapsed().as_secs_f64(),
        out.display(),
        report.display()
    );
    Ok(())
}

/// Re-renders the report from a results file, measuring nothing.
pub fn report(args: ReportArgs) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(&args.results)
        .map_err(|e| anyhow::anyhow!("read {}: {e}", args.results.display()))?;
    let doc: Value = serde_json::from_str(&text)?;
    super::report::render(&doc, &args.report)?;
    println!("report in {}", args.report.display());
    Ok(())
}

/// Runs one scenario in this process and prints its JSON object on stdout.
pub async fn scenario(args: ScenarioArgs) -> anyhow::Result<()> {
    let v = super::scenarios::run(&args.name, &args.profile.sizes()).await?;
    println!("{}", serde_json::to_string(&v)?);
    Ok(())
}

fn write(path: &Path, text: &str) -> anyhow::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(path, text).map_err(|e| anyhow::anyhow!("write {}: {e}", path.display()))
}

/// Runs `idemq bench scenario NAME` and parses the last line of its stdout.
async fn child(exe: &Path, name: &str, profile: Profile, limit: Duration) -> anyhow::Result<Value> {
    let mut cmd = tokio::process::Command::new(exe);
    cmd.args(["bench", "scenario", name, "--profile", profile.name()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let out = match tokio::time::timeout(limit, cmd.output()).await {
        Ok(out) => out?,
        Err(_) => anyhow::bail!("killed after {} s", limit.as_secs()),
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = stderr.lines().rev().take(3).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        anyhow::bail!("{} ({})", tail.join(" / ").trim(), out.status);
    }
    let last = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .ok_or_else(|| anyhow::anyhow!("the scenario printed no JSON object"))?;
    Ok(serde_json::from_str(last)?)
}

/// Server versions the scenarios reported (`"server"` fields), by store or broker.
fn servers_of(results: &[Value]) -> Value {
    let mut m = serde_json::Map::new();
    for r in results {
        let res = &r["result"];
        let who = res["store"]
            .as_str()
            .or_else(|| res["broker"].as_str())
            .unwrap_or_default();
        if let Some(v) = res["server"].as_str().filter(|v| !v.is_empty()) {
            if !who.is_empty() && !m.contains_key(who) {
                m.insert(who.to_owned(), Value::String(v.to_owned()));
            }
        }
    }
    Value::Object(m)
}

fn command_line(cmd: &str, args: &[&str]) -> String {
    std::process::Command::new(cmd)
        .args(args)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_else(|| "unknown".into())
}

fn file_field(path: &str, prefix: &str) -> Option<String> {
    std::fs::read_to_string(path).ok().and_then(|t| {
        t.lines().find_map(|l| l.strip_prefix(prefix)).map(|v| {
            v.trim()
                .trim_start_matches(':')
                .trim()
                .trim_matches('"')
                .to_owned()
        })
    })
}

/// The machine the suite ran on.
fn machine() -> Value {
    let mem_kib = file_field("/proc/meminfo", "MemTotal:")
        .and_then(|v| v.trim_end_matches("kB").trim().parse::<f64>().ok());
    json!({
        "cpus": std::thread::available_parallelism().map_or(0, |n| n.get()),
        "cpu_model": file_field("/proc/cpuinfo", "model name").unwrap_or_else(|| "unknown".into()),
        "memory_gib": mem_kib.map(|k| (k / 1024.0 / 1024.0 * 10.0).round() / 10.0),
        "kernel": std::fs::read_to_string("/proc/sys/kernel/osrelease").map_or_else(|_| "unknown".into(), |s| s.trim().to_owned()),
        "os": file_field("/etc/os-release", "PRETTY_NAME=").unwrap_or_else(|| "unknown".into()),
        "rustc": command_line("rustc", &["--version"]),
    })
}

/// Now as `YYYY-MM-DDTHH:MM:SSZ`.
fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}
