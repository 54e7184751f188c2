//! `idemq kafka …`: Kafka tooling (feature `kafka`).

use idemq::kafka::{KafkaProducerConfig, ProducerMode, RuleVerdict};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

/// `idemq kafka` subcommands.
#[derive(clap::Subcommand, Debug)]
pub enum KafkaOp {
    /// Check a producer configuration against every rule of the validator (idempotence,
    /// transactions, timeouts): prints each rule's verdict with its message and exits 1 when
    /// the configuration is unsafe, 0 when it is safe.
    ///
    /// The mode follows the properties: transactional when `transactional.id` is set,
    /// idempotent when `enable.idempotence=true`.
    CheckConfig(CheckConfigArgs),
}

/// Options of `idemq kafka check-config`.
#[derive(clap::Args, Debug)]
pub struct CheckConfigArgs {
    /// A producer `.properties` file (`key=value` or `key: value` lines, `#`/`!` comments).
    file: Option<PathBuf>,
    /// A librdkafka property, `key=value` (repeatable; overrides the file).
    #[arg(short = 'X', value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// The broker's `transaction.max.timeout.ms` (Kafka's default: 900000).
    #[arg(long, value_name = "MS")]
    broker_max_transaction_timeout_ms: Option<u64>,
}

/// Runs a `kafka` subcommand.
pub fn run(op: KafkaOp) -> anyhow::Result<ExitCode> {
    match op {
        KafkaOp::CheckConfig(args) => check_config(args),
    }
}

fn check_config(args: CheckConfigArgs) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        args.file.is_some() || !args.set.is_empty(),
        "nothing to check: give a properties FILE and/or -X key=value"
    );
    let mut text = match &args.file {
        Some(path) => std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", path.display()))?,
        None => String::new(),
    };
    for kv in &args.set {
        let (k, v) = kv
            .split_once('=')
            .filter(|(k, _)| !k.trim().is_empty())
            .ok_or_else(|| anyhow::anyhow!("-X {kv:?} is not key=value"))?;
        text.push_str(&format!("\n{}={}", k.trim(), v.trim()));
    }
    let cfg = match KafkaProducerConfig::from_properties(&text) {
        Ok(c) => c,
        Err(e) => {
            for p in &e.problems {
                println!("  FAIL  properties: {p}");
            }
            println!("unsafe: the properties could not be read");
            return Ok(ExitCode::from(1));
        }
    };
    let cfg = match args.broker_max_transaction_timeout_ms {
        Some(ms) => cfg.broker_max_transaction_timeout(Duration::from_millis(ms)),
        None => cfg,
    };
    let mode = match cfg.mode() {
        ProducerMode::Plain => "plain (neither idempotent nor transactional)".to_string(),
        ProducerMode::Idempotent => "idempotent".to_string(),
        ProducerMode::Transactional => format!(
            "transactional (transactional.id={})",
            cfg.get("transactional.id").unwrap_or_default()
        ),
    };
    println!("producer configuration: {mode}");
    let mut broken = 0;
    for (rule, verdict) in cfg.explain() {
        match verdict {
            RuleVerdict::Holds => println!("  ok    {}", rule.describe()),
            RuleVerdict::NotApplicable(why) => println!("  -     {} ({why})", rule.describe()),
            RuleVerdict::Broken(problems) => {
                for p in problems {
                    broken += 1;
                    println!("  FAIL  {}: {p}", rule.describe());
                }
            }
        }
    }
    if broken == 0 {
        if cfg.mode() == ProducerMode::Plain {
            println!("safe, but plain: no idempotence, so producer retries may duplicate (build it with enable.idempotence=true)");
        } else {
            println!("safe");
        }
        Ok(ExitCode::SUCCESS)
    } else {
        println!("unsafe: {broken} problem(s); fix each key as its message says");
        Ok(ExitCode::from(1))
    }
}
