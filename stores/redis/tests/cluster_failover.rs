//! A storm over the Redis Cluster of `scripts/servers.sh` with a master killed (SIGKILL by
//! pid) mid-run: its replica is promoted, the claims resume, and the killed node is started
//! again (it rejoins as a replica) so later tests find a whole cluster. Alone in its test
//! binary: the kill must not disturb other tests.
//!
//! The engine storm of `idemq_core::testkit::storm::engine_storm`: six
//! `IdempotentConsumer`s (each with its own cluster connection) drain a memory broker that
//! duplicates publishes and loses acks; the effects are counted by the handler in a ledger
//! of its own, not in Redis.
//! - With `wait_replicas(1, ..)`: no double effect, no lost effect (asserted).
//! - Without it: no lost effect (asserted: nothing is acked before the store answered);
//!   double effects are possible (writes acknowledged by the killed master but not yet
//!   replicated are lost) and only measured and printed.

mod support;

use idemq_core::testkit::storm::{engine_storm, EngineReport};
use idemq_core::DedupStore;
use idemq_redis::RedisStore;
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::*;

/// Keys of the storm (`IDEMQ_FAILOVER_KEYS` overrides, e.g. for a slow machine).
fn keys() -> usize {
    std::env::var("IDEMQ_FAILOVER_KEYS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50_000)
}
const CONSUMERS: usize = 6;

/// The port of the master serving slot 0, asked of any node that answers.
fn master_of_slot0(ports: &[u16]) -> Option<u16> {
    for p in ports {
        let out = std::process::Command::new("redis-cli")
            .args(["-h", "127.0.0.1", "-p", &p.to_string(), "cluster", "slots"])
            .output()
            .ok()?;
        let text = String::from_utf8_lossy(&out.stdout);
        let lines: Vec<&str> = text.lines().collect();
        // Rows: start, end, host, port, id, (replica host, port, id)...
        for (i, l) in lines.iter().enumerate() {
            if l.trim() == "0" && i + 3 < lines.len() {
                if let Ok(port) = lines[i + 3].trim().parse() {
                    return Some(port);
                }
            }
        }
    }
    None
}

fn cluster_ports(url: &str) -> Vec<u16> {
    url.trim_start_matches("redis+cluster://")
        .trim_end_matches('/')
        .split(',')
        .filter_map(|n| n.rsplit_once(':').and_then(|(_, p)| p.parse().ok()))
        .collect()
}

fn kill_node(port: u16) {
    let dir = std::env::var("IDEMQ_TEST_REDIS_CLUSTER_DIR")
        .expect("IDEMQ_TEST_REDIS_CLUSTER_DIR (eval \"$(scripts/servers.sh env)\")");
    let pid_file = format!("{dir}/node-{port}/redis.pid");
    let pid = std::fs::read_to_string(&pid_file)
        .unwrap_or_else(|e| panic!("cannot read {pid_file}: {e}"));
    let ok = std::process::Command::new("kill")
        .args(["-KILL", pid.trim()])
        .status()
        .expect("kill")
        .success();
    assert!(ok, "kill -KILL {} failed", pid.trim());
}

fn restart_node(port: u16) {
    let script = repo_root().join("scripts").join("servers.sh");
    let out = std::process::Command::new(&script)
        .args(["restart-redis-cluster-node", &port.to_string()])
        .output()
        .expect("servers.sh");
    assert!(
        out.status.success(),
        "restart-redis-cluster-node {port}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The storm's report and a line saying what was killed and when.
async fn storm(url: &str, wait: bool) -> (EngineReport, String) {
    let prefix = unique_prefix(if wait { "fo-wait" } else { "fo-nowait" });
    let mut stores = Vec::new();
    for _ in 0..CONSUMERS {
        // Short timeouts: a request stuck on the killed node gives up (no ack) within
        // 1.5 s and the connection is rebuilt.
        let mut b = RedisStore::builder(url)
            .prefix(&prefix)
            .fast_claims(true)
            .connect_timeout(Duration::from_millis(500))
            .response_timeout(Duration::from_secs(1));
        if wait {
            b = b.wait_replicas(1, Duration::from_millis(500));
        }
        stores.push(Arc::new(b.connect().await.expect("connect")));
    }
    let dyn_stores: Vec<Arc<dyn DedupStore>> = stores
        .iter()
        .map(|s| s.clone() as Arc<dyn DedupStore>)
        .collect();
    // Kill the master of slot 0 once a third of the effects happened.
    let ports = cluster_ports(url);
    let (report, (victim, promoted, failover, before_restart)) =
        engine_storm(&dyn_stores, &prefix, keys(), |progress| async move {
            let victim = master_of_slot0(&ports).expect("a master serves slot 0");
            let killed_at = Instant::now();
            kill_node(victim);
            progress.hit();
            let others: Vec<u16> = ports.iter().copied().filter(|p| *p != victim).collect();
            let promoted = loop {
                match master_of_slot0(&others) {
                    Some(p) if p != victim => break p,
                    _ => tokio::time::sleep(Duration::from_millis(100)).await,
                }
                assert!(
                    killed_at.elapsed() < Duration::from_secs(60),
                    "no failover 60 s after killing {victim}"
                );
            };
            let failover = killed_at.elapsed();
            let before_restart = progress.effects();
            // Start the killed node again: it rejoins as the replica of the promoted one.
            tokio::task::spawn_blocking(move || restart_node(victim))
                .await
                .expect("restart");
            (victim, promoted, failover, before_restart)
        })
        .await;
    let lost_markers = stores.iter().filter(|s| s.incarnation_lost()).count();
    let summary = format!(
        "[wait_replicas={}] consumers={CONSUMERS} killed={victim} promoted={promoted} \
         failover={failover:?} effects_before_restart={before_restart} \
         incarnation_lost_seen_by={lost_markers}/{CONSUMERS} {report}",
        if wait { "1" } else { "off" },
    );
    (report, summary)
}

/// The tests of this binary change the topology: one at a time.
static TOPOLOGY: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Both storms in one test: they must not kill masters at the same time.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_master_killed_mid_storm_with_and_without_wait() {
    let Some(url) = cluster_url() else { return };
    let _one_at_a_time = TOPOLOGY.lock().await;
    let (with_wait, summary) = storm(&url, true).await;
    eprintln!("{summary}");
    assert_eq!(with_wait.double_effects, 0, "{summary}");
    assert_eq!(with_wait.lost, 0, "{summary}");

    let (without, summary) = storm(&url, false).await;
    eprintln!("{summary}");
    // Guaranteed either way: nothing is acknowledged before the store answered.
    assert_eq!(without.lost, 0, "{summary}");
}

/// The replica (port) of the master `master`, from `ROLE` on each node.
fn replica_of(ports: &[u16], master: u16) -> Option<u16> {
    ports.iter().copied().find(|p| {
        let out = std::process::Command::new("redis-cli")
            .args(["-h", "127.0.0.1", "-p", &p.to_string(), "role"])
            .output();
        out.is_ok_and(|o| {
            let role = String::from_utf8_lossy(&o.stdout).into_owned();
            let lines: Vec<&str> = role.lines().map(str::trim).collect();
            lines.first() == Some(&"slave") && lines.get(2) == Some(&master.to_string().as_str())
        })
    })
}

/// A graceful `CLUSTER FAILOVER` moves slot 0's master while a store holds a slot map that
/// says otherwise: its per-master pipelines get `MOVED` for those keys, which are sent again
/// through the cluster client; nothing fails, nothing acquired before is forgotten.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_slot_map_is_followed_through_moved() {
    let Some(url) = cluster_url() else { return };
    let _one_at_a_time = TOPOLOGY.lock().await;
    let store = RedisStore::builder(&url)
        .prefix(unique_prefix("moved"))
        .fast_claims(true)
        .connect()
        .await
        .expect("connect");
    let g = idemq_core::ConsumerGroup::new("moved").expect("group");
    let batch = |from: usize| -> Vec<idemq_core::ClaimRequest> {
        (from..from + 300)
            .map(|i| {
                idemq_core::ClaimRequest::new(
                    idemq_core::DedupKey::new(&g, &format!("k{i}")).expect("key"),
                    Duration::from_secs(60),
                )
            })
            .collect()
    };
    let before = batch(0);
    let got = store.claim_batch(&before).await.expect("claims");
    store
        .complete_batch(&completions_of(&before, &got, Duration::from_secs(600)))
        .await
        .expect("completes");

    let ports = cluster_ports(&url);
    let master = master_of_slot0(&ports).expect("slot 0 served");
    let replica = replica_of(&ports, master).expect("slot 0's master has a replica");
    let out = std::process::Command::new("redis-cli")
        .args([
            "-h",
            "127.0.0.1",
            "-p",
            &replica.to_string(),
            "cluster",
            "failover",
        ])
        .output()
        .expect("redis-cli");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("OK"),
        "{out:?}"
    );
    let asked = Instant::now();
    while master_of_slot0(&ports) != Some(replica) {
        assert!(
            asked.elapsed() < Duration::from_secs(30),
            "no failover to {replica}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Let every node agree (the old master becomes a replica and answers MOVED).
    tokio::time::sleep(Duration::from_millis(500)).await;

    let after = batch(300);
    let got = store
        .claim_batch(&after)
        .await
        .expect("claims after the failover");
    let outcomes = store
        .complete_batch(&completions_of(&after, &got, Duration::from_secs(600)))
        .await
        .expect("completes after the failover");
    assert!(outcomes
        .iter()
        .all(|o| *o == idemq_core::CompleteOutcome::Completed));
    // Graceful failover loses nothing: what was completed before is a duplicate.
    for o in store.claim_batch(&before).await.expect("claims again") {
        assert!(matches!(o, idemq_core::ClaimOutcome::Duplicate(_)), "{o:?}");
    }
}
