//! Shared fixtures of the NATS KV store tests: server URLs (skip when unset), stores on a
//! bucket of their own with a fresh key prefix, the cluster's kill/restart commands.
#![allow(dead_code)]

use idemq_core::testkit::servers::server_url;
use idemq_core::DedupStore;
use idemq_nats_kv::{NatsKvOptions, NatsKvStore};
use std::sync::Arc;
use std::time::Duration;

/// The single node, or `None` (skip) when IDEMQ_TEST_NATS_URL is unset.
pub fn single_url() -> Option<String> {
    server_url("IDEMQ_TEST_NATS_URL")
}

/// The 3-node cluster, or `None` (skip) when IDEMQ_TEST_NATS_CLUSTER_URL is unset.
pub fn cluster_url() -> Option<String> {
    server_url("IDEMQ_TEST_NATS_CLUSTER_URL")
}

/// A key prefix no other test run uses.
pub fn unique_prefix(what: &str) -> String {
    format!("{what}-{:012x}", rand_u64() & 0xffff_ffff_ffff)
}

fn rand_u64() -> u64 {
    idemq_core::FencingToken::random().0 as u64
}

/// Options for tests: a bucket of the tests' own, the given prefix and replicas.
pub fn options(bucket: &str, prefix: &str, replicas: usize) -> NatsKvOptions {
    NatsKvOptions {
        bucket: bucket.into(),
        prefix: prefix.into(),
        replicas,
        request_timeout: Duration::from_secs(5),
        ..NatsKvOptions::default()
    }
}

/// One store (its own connection).
pub async fn store(url: &str, opts: NatsKvOptions) -> NatsKvStore {
    NatsKvStore::connect(url, opts)
        .await
        .unwrap_or_else(|e| panic!("connect to NATS KV at {url}: {e}"))
}

/// `n` handles to one bucket and prefix, each with its own connection.
pub async fn handles(
    url: Option<String>,
    n: usize,
    bucket: &str,
    prefix: &str,
    replicas: usize,
) -> Option<Vec<Arc<dyn DedupStore>>> {
    let url = url?;
    let mut v: Vec<Arc<dyn DedupStore>> = Vec::new();
    for _ in 0..n {
        v.push(Arc::new(
            store(&url, options(bucket, prefix, replicas)).await,
        ));
    }
    Some(v)
}

/// Runs a shell command line (a kill or restart command from scripts/servers.sh) with
/// extra arguments; panics with its output when it fails.
pub fn run_cmd(cmd: &str, args: &[&str]) {
    let line = format!("{cmd} {}", args.join(" "));
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(&line)
        .output()
        .unwrap_or_else(|e| panic!("run `{line}`: {e}"));
    assert!(
        out.status.success(),
        "`{line}` failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
