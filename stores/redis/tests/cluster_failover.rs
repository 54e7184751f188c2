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

use idemq_core::testkit::ready::{poll_until, retry_transient, wait_ready};
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

/// Starts the killed node on `port` again, then waits for the whole cluster (see
/// [`cluster_whole`]): the node rejoins as a replica and resyncs, answering `LOADING` until
/// it has loaded what its master sent, and the next test must not meet it half-ready.
async fn restart_node(ports: &[u16], port: u16) {
    let script = repo_root().join("scripts").join("servers.sh");
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(&script)
            .args(["restart-redis-cluster-node", &port.to_string()])
            .output()
            .expect("servers.sh")
    })
    .await
    .expect("restart task");
    assert!(
        out.status.success(),
        "restart-redis-cluster-node {port}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    wait_cluster_whole(ports, &format!("after restarting 127.0.0.1:{port}")).await;
}

/// Bound of a wait for a node: a replica's full resync after a storm takes seconds, a
/// minute means it is stuck.
const READY_WITHIN: Duration = Duration::from_secs(60);

/// One `redis-cli` command on the node at `port`: its reply, or the error reply (`-e` makes
/// an error reply fail the command, `LOADING ...` included) or why the node was not reached.
fn cli(port: u16, args: &[String]) -> Result<String, String> {
    let out = std::process::Command::new("redis-cli")
        .args(["-e", "-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .output()
        .map_err(|e| format!("cannot run redis-cli: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if out.status.success() {
        return Ok(stdout);
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    Err(format!("{stdout} {}", stderr.trim()).trim().to_string())
}

/// [`cli`] on a blocking thread: the waits poll it from the test's runtime, whose workers
/// also drive the storm.
async fn cli_async(port: u16, args: &[&str]) -> Result<String, String> {
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    tokio::task::spawn_blocking(move || cli(port, &args))
        .await
        .map_err(|e| format!("redis-cli task: {e}"))?
}

/// The value of `field` in an `INFO` reply.
fn info_field<'a>(info: &'a str, field: &str) -> Option<&'a str> {
    info.lines()
        .find_map(|l| l.trim().strip_prefix(field)?.strip_prefix(':'))
}

/// `Ok` with its `INFO replication` when the node at `port` answers `PING`, has loaded its
/// dataset and, as a replica, is in sync with its master (link up, no sync in progress):
/// a replica that is not cannot take over, by `CLUSTER FAILOVER` or after a kill.
async fn node_in_sync(port: u16) -> Result<String, String> {
    let pong = cli_async(port, &["ping"]).await?;
    if pong != "PONG" {
        return Err(format!("PING: {pong}"));
    }
    let persistence = cli_async(port, &["info", "persistence"]).await?;
    for field in ["loading", "async_loading"] {
        match info_field(&persistence, field) {
            Some("0") => {}
            None if field == "async_loading" => {}
            v => return Err(format!("{field}:{}", v.unwrap_or("(missing)"))),
        }
    }
    let replication = cli_async(port, &["info", "replication"]).await?;
    if info_field(&replication, "role") == Some("slave") {
        let link = info_field(&replication, "master_link_status");
        let syncing = info_field(&replication, "master_sync_in_progress");
        if link != Some("up") || syncing != Some("0") {
            return Err(format!(
                "replica of {}: master_link_status:{} master_sync_in_progress:{}",
                info_field(&replication, "master_port").unwrap_or("?"),
                link.unwrap_or("(missing)"),
                syncing.unwrap_or("(missing)")
            ));
        }
    }
    Ok(replication)
}

/// `Ok` when every node is in sync ([`node_in_sync`]), sees `cluster_state:ok` with all of
/// `ports` known, and every master has its replicas online: the state in which a master
/// may be killed or a failover asked (its replica can take over), and the state a test
/// leaves behind. Otherwise what each node that is not ready answered, by node.
async fn cluster_whole(ports: &[u16]) -> Result<(), String> {
    let mut not_ready = Vec::new();
    for &p in ports {
        if let Err(e) = node_whole(p, ports.len()).await {
            not_ready.push(format!("node 127.0.0.1:{p}: {e}"));
        }
    }
    if not_ready.is_empty() {
        Ok(())
    } else {
        Err(not_ready.join("; "))
    }
}

/// One node's part of [`cluster_whole`], in a cluster of `nodes` nodes.
async fn node_whole(port: u16, nodes: usize) -> Result<(), String> {
    let replication = node_in_sync(port).await?;
    let info = cli_async(port, &["cluster", "info"]).await?;
    let state = info_field(&info, "cluster_state");
    let known = info_field(&info, "cluster_known_nodes");
    if state != Some("ok") || known != Some(nodes.to_string().as_str()) {
        return Err(format!(
            "cluster_state:{} cluster_known_nodes:{} (of {nodes})",
            state.unwrap_or("(missing)"),
            known.unwrap_or("(missing)"),
        ));
    }
    if info_field(&replication, "role") == Some("master") {
        // Every master of this cluster has a replica (3 + 3): none online means the one
        // that rejoins has not synced yet.
        let replicas: Vec<&str> = replication
            .lines()
            .map(str::trim)
            .filter(|l| l.starts_with("slave") && l.contains("ip="))
            .collect();
        if replicas.is_empty() || !replicas.iter().all(|r| r.contains("state=online")) {
            return Err(format!("master with replicas {replicas:?}"));
        }
    }
    Ok(())
}

/// Waits for [`cluster_whole`] (`when` says at which step, for the failure message).
async fn wait_cluster_whole(ports: &[u16], when: &str) {
    let name = format!("the redis cluster {ports:?} ({when})");
    wait_ready(&name, READY_WITHIN, || cluster_whole(ports)).await;
}

/// [`master_of_slot0`] on a blocking thread (redis-cli blocks).
async fn master_of_slot0_async(ports: &[u16]) -> Option<u16> {
    let ports = ports.to_vec();
    tokio::task::spawn_blocking(move || master_of_slot0(&ports))
        .await
        .ok()
        .flatten()
}

/// The storm's report and a line saying what was killed and when.
async fn storm(url: &str, wait: bool) -> (EngineReport, String) {
    let prefix = unique_prefix(if wait { "fo-wait" } else { "fo-nowait" });
    let ports = cluster_ports(url);
    // The previous storm's killed node may still be resyncing: its master could not be
    // failed over, and the stores' connections could meet `LOADING`.
    wait_cluster_whole(&ports, "before the storm").await;
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
    let (report, (victim, promoted, failover, before_restart)) =
        engine_storm(&dyn_stores, &prefix, keys(), |progress| async move {
            // Only a master whose replica is in sync can be failed over.
            wait_cluster_whole(&ports, "before the kill").await;
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
            restart_node(&ports, victim).await;
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

/// How long a manual failover may take once accepted: Redis gives up on one after 5 s
/// (the replica did not catch up, or the election failed); then it is asked again.
const FAILOVER_WITHIN: Duration = Duration::from_secs(15);

/// `CLUSTER FAILOVER` asked of the in-sync replica on `replica`, until it serves slot 0.
/// Asked again while the node answers `LOADING` or a state that passes (its master not
/// reachable yet, the node restarting), and when an accepted failover did not happen.
async fn failover_to(ports: &[u16], replica: u16) {
    let node = format!("redis cluster node 127.0.0.1:{replica} (replica of slot 0's master)");
    wait_ready(&node, READY_WITHIN, || async {
        node_in_sync(replica).await.map(drop)
    })
    .await;
    let transient = |answer: &str| {
        answer.starts_with("LOADING")
            || answer.starts_with("Could not connect")
            || answer.contains("Master is down or failed")
            || answer.contains("my master is unknown to me")
    };
    for attempt in 1..=3 {
        let ok = retry_transient(
            &node,
            "CLUSTER FAILOVER",
            READY_WITHIN,
            || cli_async(replica, &["cluster", "failover"]),
            transient,
        )
        .await;
        assert_eq!(ok, "OK", "CLUSTER FAILOVER on {node}");
        match poll_until(FAILOVER_WITHIN, || async {
            match master_of_slot0_async(ports).await {
                Some(p) if p == replica => Ok(()),
                p => Err(format!("slot 0 served by {p:?}")),
            }
        })
        .await
        {
            Ok(_) => return,
            Err(last) if attempt < 3 => {
                eprintln!("{node}: no failover {FAILOVER_WITHIN:?} after OK ({last}); asking again")
            }
            Err(last) => panic!(
                "{node}: no failover after {attempt} CLUSTER FAILOVER answered OK, \
                 {FAILOVER_WITHIN:?} each; last answer: {last}"
            ),
        }
    }
}

/// A graceful `CLUSTER FAILOVER` moves slot 0's master while a store holds a slot map that
/// says otherwise: its per-master pipelines get `MOVED` for those keys, which are sent again
/// through the cluster client; nothing fails, nothing acquired before is forgotten.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_slot_map_is_followed_through_moved() {
    let Some(url) = cluster_url() else { return };
    let _one_at_a_time = TOPOLOGY.lock().await;
    let ports = cluster_ports(&url);
    // A node restarted by an earlier test may still be loading what its master sent it.
    wait_cluster_whole(&ports, "before the test").await;
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

    let master = master_of_slot0(&ports).expect("slot 0 served");
    let replica = replica_of(&ports, master).expect("slot 0's master has a replica");
    failover_to(&ports, replica).await;
    // Let every node agree: the old master is a replica of the new one (it answers MOVED)
    // and in sync with it.
    let old = format!("redis cluster node 127.0.0.1:{master} (old master of slot 0)");
    wait_ready(&old, READY_WITHIN, || async {
        let role = node_in_sync(master).await?;
        match info_field(&role, "master_port") {
            Some(p) if p == replica.to_string() => Ok(()),
            p => Err(format!(
                "role:{} master_port:{}",
                info_field(&role, "role").unwrap_or("?"),
                p.unwrap_or("(none)")
            )),
        }
    })
    .await;
    wait_cluster_whole(&ports, "after the failover").await;

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
