//! SIGKILL of the node that leads the KV bucket's stream on the 3-node cluster (an R3
//! bucket), once during a claim storm and once during a wave of completions; the killed
//! node is started again afterwards (same data directory: it rejoins). What must hold:
//! no key completed twice, no handler run twice, no acknowledged claim or completion lost;
//! every store error during the election is retryable (the engine acks nothing then).
//! Prints the figures docs/reliability.md reports. Alone in its binary: it kills servers.

mod support;

use idemq_core::testkit::ready::{poll_until, wait_ready};
use idemq_core::testkit::servers::server_url;
use idemq_core::testkit::storm::{engine_storm, storm};
use idemq_core::{
    ClaimOutcome, ClaimRequest, CompleteOutcome, ConsumerGroup, DedupKey, DedupStore, RecordStatus,
};
use idemq_nats_kv::async_nats;
use idemq_nats_kv::NatsKvStore;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::*;

const BUCKET: &str = "idemq_failover";

/// The tests of this binary kill nodes: one at a time.
static TOPOLOGY: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

struct Cluster {
    kill: String,
    restart: String,
    /// The client ports of the nodes, from the cluster URL.
    ports: Vec<String>,
}

fn cluster() -> Option<(String, Cluster)> {
    let url = cluster_url()?;
    let kill = server_url("IDEMQ_TEST_NATS_CLUSTER_KILL_NODE_CMD")?;
    let restart = server_url("IDEMQ_TEST_NATS_CLUSTER_RESTART_NODE_CMD")?;
    let ports = url
        .trim_start_matches("nats://")
        .split(',')
        .filter_map(|host| host.rsplit_once(':').map(|(_, p)| p.to_string()))
        .collect();
    Some((
        url,
        Cluster {
            kill,
            restart,
            ports,
        },
    ))
}

/// Bound of a wait for a node: a restarted node catches up on the bucket in seconds; 90 s
/// means it will not.
const READY_WITHIN: Duration = Duration::from_secs(90);

async fn stores(url: &str, prefix: &str) -> Vec<Arc<dyn DedupStore>> {
    let mut v: Vec<Arc<dyn DedupStore>> = Vec::new();
    for _ in 0..4 {
        v.push(Arc::new(store(url, options(BUCKET, prefix, 3)).await));
    }
    v
}

/// The client port of the node leading the bucket's stream (servers are named
/// `idemq-n<port>` by scripts/servers.sh).
async fn leader_port(s: &NatsKvStore) -> String {
    let leader = poll_until(Duration::from_secs(60), || async {
        match s.stream_leader().await {
            Ok(Some(name)) => Ok(name),
            Ok(None) => Err("no leader".to_string()),
            Err(e) => Err(e.to_string()),
        }
    })
    .await;
    let name = match leader {
        Ok((name, _)) => name,
        Err(last) => panic!(
            "the stream {} has no leader within 60 s; last answer: {last}",
            s.stream_name()
        ),
    };
    match name.strip_prefix("idemq-n") {
        Some(port) => port.to_string(),
        None => {
            panic!("unexpected server name {name}: scripts/servers.sh names nodes idemq-n<port>")
        }
    }
}

/// A store connected to each node of the cluster alone, by port, opened before any kill:
/// after one, the others tell when writes are accepted again (a client of the killed node
/// would first wait out its own reconnect).
async fn node_probes(url: &str) -> Vec<(String, NatsKvStore)> {
    let mut v = Vec::new();
    for host in url.trim_start_matches("nats://").split(',') {
        let port = host
            .rsplit_once(':')
            .map(|(_, p)| p.to_string())
            .unwrap_or_default();
        let mut o = options(BUCKET, &unique_prefix("probe"), 3);
        o.request_timeout = Duration::from_millis(500);
        v.push((port, store(&format!("nats://{host}"), o).await));
    }
    v
}

/// Time from `killed_at` until a node other than `killed` accepts a claim (a write at the
/// stream leader: a new one was elected), polled every 50 ms.
async fn writes_again_after(
    probes: &[(String, NatsKvStore)],
    killed: &str,
    killed_at: Instant,
) -> Duration {
    let g = ConsumerGroup::new("probe").unwrap();
    let mut i = 0u64;
    loop {
        for (_, s) in probes.iter().filter(|(p, _)| p != killed) {
            i += 1;
            let k = DedupKey::new(&g, &format!("after-kill-{i}")).unwrap();
            if let Ok(ClaimOutcome::Acquired(_)) =
                s.claim(&ClaimRequest::new(k, Duration::from_secs(1))).await
            {
                return killed_at.elapsed();
            }
        }
        assert!(
            killed_at.elapsed() < Duration::from_secs(90),
            "no write accepted 90 s after killing :{killed}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until the stream is whole ([`wait_whole`]: a node restarted by an earlier test may
/// still be catching up, and killing the leader then leaves no quorum), finds the stream's
/// leader now and SIGKILLs it; returns its port, when, and the guard that starts it again.
async fn kill_leader(c: &Cluster, probe: &NatsKvStore) -> (String, Instant, Revive) {
    wait_whole(c, probe, "before the kill").await;
    let port = leader_port(probe).await;
    let at = Instant::now();
    let revive = Revive {
        cmd: c.restart.clone(),
        port: port.clone(),
        done: false,
    };
    kill(c, &port).await;
    (port, at, revive)
}

/// SIGKILLs the node on `port`.
async fn kill(c: &Cluster, port: &str) {
    let (cmd, p) = (c.kill.clone(), port.to_string());
    tokio::task::spawn_blocking(move || run_cmd(&cmd, &[&p]))
        .await
        .expect("kill task");
    eprintln!("killed the stream leader on :{port}");
}

/// Starts a killed node again: by [`Revive::now`], or when dropped (a failing test must
/// not leave the cluster short of a node).
struct Revive {
    cmd: String,
    port: String,
    done: bool,
}

impl Revive {
    async fn now(mut self) {
        let (cmd, p) = (self.cmd.clone(), self.port.clone());
        tokio::task::spawn_blocking(move || run_cmd(&cmd, &[&p]))
            .await
            .expect("restart task");
        self.done = true;
    }
}

impl Drop for Revive {
    fn drop(&mut self) {
        if !self.done {
            eprintln!("restarting :{} after a failure", self.port);
            let _ = std::process::Command::new("sh")
                .arg("-c")
                .arg(format!("{} {}", self.cmd, self.port))
                .status();
        }
    }
}

/// `Ok` when the node on `port` answers a JetStream request for `stream` (asked of that
/// node alone) and the stream it reports has a leader and all `replicas` other replicas
/// current and online; otherwise what it answered.
async fn stream_whole_at(port: &str, stream: &str, replicas: usize) -> Result<(), String> {
    let client = async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_millis(500))
        .request_timeout(Some(Duration::from_millis(500)))
        .connect(format!("nats://127.0.0.1:{port}"))
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let info = async_nats::jetstream::new(client)
        .get_stream(stream)
        .await
        .map_err(|e| format!("stream info of {stream}: {e}"))?
        .cached_info()
        .clone();
    let cluster = info
        .cluster
        .ok_or_else(|| format!("stream info of {stream} without cluster info"))?;
    let whole = cluster.leader.is_some()
        && cluster.replicas.len() == replicas
        && cluster.replicas.iter().all(|r| r.current && !r.offline);
    if whole {
        return Ok(());
    }
    let peers: Vec<String> = cluster
        .replicas
        .iter()
        .map(|r| {
            format!(
                "{} current={} offline={} lag={:?}",
                r.name, r.current, r.offline, r.lag
            )
        })
        .collect();
    Err(format!(
        "leader {:?}, replicas [{}]",
        cluster.leader,
        peers.join(", ")
    ))
}

/// Waits until every node answers JetStream requests and the stream has a leader and all
/// its other replicas current, so that a kill meets a whole cluster (a leader killed while
/// a replica still catches up leaves no quorum) and the next test, or another engineer's,
/// meets one too. `when` says at which step, for the failure message.
async fn wait_whole(c: &Cluster, s: &NatsKvStore, when: &str) {
    let stream = s.stream_name();
    let replicas = c.ports.len().saturating_sub(1);
    for port in &c.ports {
        let node = format!("NATS cluster node :{port} ({when}, stream {stream})");
        wait_ready(&node, READY_WITHIN, || {
            stream_whole_at(port, &stream, replicas)
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killing_the_kv_leader_during_a_claim_storm_loses_nothing_and_runs_nothing_twice() {
    let Some((url, c)) = cluster() else { return };
    let _one_at_a_time = TOPOLOGY.lock().await;
    let prefix = unique_prefix("storm");
    let handles = stores(&url, &prefix).await;
    let probe = store(&url, options(BUCKET, &prefix, 3)).await;
    let probes = node_probes(&url).await;
    let killed = Mutex::new(None);
    let report = storm(&handles, &prefix, 3000, 16, || async {
        *killed.lock().unwrap() = Some(kill_leader(&c, &probe).await);
    })
    .await;
    let (port, killed_at, revive) = killed.lock().unwrap().take().expect("killed");
    let elected = writes_again_after(&probes, &port, killed_at).await;
    revive.now().await;
    wait_whole(&c, &probe, &format!("after restarting :{port}")).await;
    eprintln!(
        "FAILOVER claim-storm (R3, leader :{port} SIGKILLed): writes accepted again after {elected:?}; {report:?}"
    );
    assert_eq!(report.reruns, 0);
    assert!(report.errors_during > 0, "the kill was seen: {report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killing_the_kv_leader_during_completions_loses_none_and_completes_none_twice() {
    let Some((url, c)) = cluster() else { return };
    let _one_at_a_time = TOPOLOGY.lock().await;
    let prefix = unique_prefix("complete");
    let handles = stores(&url, &prefix).await;
    let probe = store(&url, options(BUCKET, &prefix, 3)).await;
    let probes = node_probes(&url).await;
    let g = ConsumerGroup::new(&prefix).unwrap();
    let n = 2000;
    let keys: Vec<DedupKey> = (0..n)
        .map(|i| DedupKey::new(&g, &format!("c-{i}")).unwrap())
        .collect();
    // Claim everything first (long leases: the completions, not the claims, meet the kill).
    let mut leases = Vec::with_capacity(n);
    for chunk in keys.chunks(100) {
        let reqs: Vec<ClaimRequest> = chunk
            .iter()
            .map(|k| ClaimRequest::new(k.clone(), Duration::from_secs(120)))
            .collect();
        for o in handles[0]
            .claim_batch(&reqs)
            .await
            .expect("claim before the kill")
        {
            match o {
                ClaimOutcome::Acquired(l) => leases.push(l),
                o => panic!("fresh key: {o:?}"),
            }
        }
    }
    let next = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    let errors = Arc::new(AtomicUsize::new(0));
    // Completions of the second half wait for the kill: it must meet completions in flight.
    let killed = Arc::new(tokio::sync::Notify::new());
    let confirmed = Arc::new(Mutex::new(vec![0usize; n]));
    let successes = Arc::new(Mutex::new(Vec::<(Instant, Instant)>::new()));
    let keys = Arc::new(keys);
    let leases = Arc::new(leases);
    let mut tasks = Vec::new();
    for w in 0..16 {
        let s = handles[w % handles.len()].clone();
        let (next, done, errors, killed, confirmed, successes, keys, leases) = (
            next.clone(),
            done.clone(),
            errors.clone(),
            killed.clone(),
            confirmed.clone(),
            successes.clone(),
            keys.clone(),
            leases.clone(),
        );
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    return;
                }
                if i == n / 2 {
                    killed.notified().await;
                }
                // Until answered, with the same token (what the engine does).
                loop {
                    let issued = Instant::now();
                    match s
                        .complete(&keys[i], leases[i].token, None, Duration::from_secs(3600))
                        .await
                    {
                        // Already completed: an earlier try that errored had landed.
                        Ok(CompleteOutcome::Completed | CompleteOutcome::AlreadyCompleted) => {
                            confirmed.lock().unwrap()[i] += 1;
                            successes.lock().unwrap().push((issued, Instant::now()));
                            break;
                        }
                        Ok(o @ (CompleteOutcome::Fenced | CompleteOutcome::Unknown)) => {
                            panic!("c-{i}: the owner's completion answered {o:?} (nobody took it over)")
                        }
                        Err(e) => {
                            assert!(e.is_retryable(), "non-retryable during failover: {e}");
                            errors.fetch_add(1, Ordering::Relaxed);
                            tokio::time::sleep(Duration::from_millis(25)).await;
                        }
                    }
                }
                done.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(3)).await;
            }
        }));
    }
    let t0 = Instant::now();
    while done.load(Ordering::Relaxed) < n / 3 {
        assert!(t0.elapsed() < Duration::from_secs(120), "no progress");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (port, killed_at, revive) = kill_leader(&c, &probe).await;
    killed.notify_one();
    let kill_done = Instant::now();
    let elected = writes_again_after(&probes, &port, killed_at).await;
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(180), t)
            .await
            .expect("completions finish after the failover")
            .expect("worker panicked");
    }
    revive.now().await;
    wait_whole(&c, &probe, &format!("after restarting :{port}")).await;
    let confirmed = confirmed.lock().unwrap().clone();
    assert!(
        confirmed.iter().all(|c| *c == 1),
        "each completion answered once"
    );
    // Nothing lost, nothing twice: every key is completed with its owner's token, and a
    // new claim of any of them is a duplicate.
    let mut dup = 0;
    for (i, k) in keys.iter().enumerate() {
        let r = handles[1].get(k).await.expect("get").expect("record");
        assert_eq!(r.status, RecordStatus::Completed, "c-{i}");
        assert_eq!(r.token, leases[i].token, "c-{i} completed by its owner");
        assert_eq!(r.attempts, 1, "c-{i} never taken over");
        if matches!(
            handles[2]
                .claim(&ClaimRequest::new(k.clone(), Duration::from_secs(5)))
                .await
                .expect("claim"),
            ClaimOutcome::Duplicate(_)
        ) {
            dup += 1;
        }
    }
    assert_eq!(dup, n, "every completed key answers Duplicate");
    let errors = errors.load(Ordering::Relaxed);
    assert!(errors > 0, "the failover was seen by the workers");
    // Time to recover: the first answer to a completion issued after the node was dead.
    let recovered = successes
        .lock()
        .unwrap()
        .iter()
        .filter(|(issued, _)| *issued >= kill_done)
        .map(|(_, answered)| answered.duration_since(killed_at))
        .min();
    eprintln!(
        "FAILOVER completions (R3, leader :{port} SIGKILLed): writes accepted again after {elected:?}; keys {n}, \
         completions answered {n}, errors {errors}, recovered after {recovered:?}, lost 0, double 0"
    );
}

/// Keys of the engine storm (`IDEMQ_FAILOVER_KEYS` overrides, as for the Redis Cluster
/// failover test it mirrors).
fn storm_keys() -> usize {
    std::env::var("IDEMQ_FAILOVER_KEYS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000)
}

/// The engine storm (`idemq_core::testkit::storm::engine_storm`, as the Redis Cluster test
/// runs it) on the R3 bucket: six `IdempotentConsumer`s, the stream leader SIGKILLed once
/// a third of the effects happened. No double effect, no lost effect, and the workers saw
/// the outage (asserted).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_engine_storm_over_an_r3_bucket_survives_the_leaders_sigkill() {
    let Some((url, c)) = cluster() else { return };
    let _one_at_a_time = TOPOLOGY.lock().await;
    let prefix = unique_prefix("engine");
    let mut stores: Vec<Arc<dyn DedupStore>> = Vec::new();
    for _ in 0..6 {
        // Short timeouts, as the Redis test: a request stuck on the killed node gives up
        // (no ack) within a second and the client reconnects to another node.
        let mut o = options(BUCKET, &prefix, 3);
        o.request_timeout = Duration::from_secs(1);
        stores.push(Arc::new(store(&url, o).await));
    }
    let probe = store(&url, options(BUCKET, &prefix, 3)).await;
    let probes = node_probes(&url).await;
    let (c, probe_ref, probes) = (&c, &probe, &probes);
    let (report, (port, elected)) =
        engine_storm(&stores, &prefix, storm_keys(), move |progress| async move {
            let (port, killed_at, revive) = kill_leader(c, probe_ref).await;
            progress.hit();
            let elected = writes_again_after(probes, &port, killed_at).await;
            revive.now().await;
            (port, elected)
        })
        .await;
    wait_whole(c, &probe, &format!("after restarting :{port}")).await;
    let summary = format!(
        "FAILOVER engine storm (R3, leader :{port} SIGKILLed, consumers=6): \
         writes_again_after={elected:?} {report}"
    );
    eprintln!("{summary}");
    assert_eq!(report.double_effects, 0, "{summary}");
    assert_eq!(report.lost, 0, "{summary}");
    // The engine retries store calls within its budget, so a worker can ride out the
    // election without giving a message back (`store_unavailable` 0); its health still
    // went from ready to store-unavailable, and that says it saw the kill.
    assert!(
        report.outages > 0,
        "the workers saw the failover: {summary}"
    );
}
