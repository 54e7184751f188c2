//! SIGKILL of the node that leads the KV bucket's stream on the 3-node cluster (an R3
//! bucket), once during a claim storm and once during a wave of completions; the killed
//! node is started again afterwards (same data directory: it rejoins). What must hold:
//! no key completed twice, no handler run twice, no acknowledged claim or completion lost;
//! every store error during the election is retryable (the engine acks nothing then).
//! Prints the figures docs/reliability.md reports. Alone in its binary: it kills servers.

mod support;

use idemq_core::testkit::servers::server_url;
use idemq_core::{
    ClaimOutcome, ClaimRequest, CompleteOutcome, ConsumerGroup, DedupKey, DedupStore, RecordStatus,
};
use idemq_nats_kv::NatsKvStore;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::storm::storm;
use support::*;

const BUCKET: &str = "idemq_failover";

struct Cluster {
    kill: String,
    restart: String,
}

fn cluster() -> Option<(String, Cluster)> {
    let url = cluster_url()?;
    let kill = server_url("IDEMQ_TEST_NATS_CLUSTER_KILL_NODE_CMD")?;
    let restart = server_url("IDEMQ_TEST_NATS_CLUSTER_RESTART_NODE_CMD")?;
    Some((url, Cluster { kill, restart }))
}

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
    let t0 = Instant::now();
    loop {
        if let Ok(Some(name)) = s.stream_leader().await {
            if let Some(port) = name.strip_prefix("idemq-n") {
                return port.to_string();
            }
            panic!("unexpected server name {name}: scripts/servers.sh names nodes idemq-n<port>");
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the stream has no leader"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// How long after `killed` (wall clock, same machine as the servers) the stream's current
/// leader took over, by its `leader_since`.
async fn election_time(s: &NatsKvStore, killed: std::time::SystemTime) -> Option<Duration> {
    let js = idemq_nats_kv::async_nats::jetstream::new(s.client().clone());
    let stream = js.get_stream(s.stream_name()).await.ok()?;
    let since = stream.cached_info().cluster.as_ref()?.leader_since?;
    let since = std::time::UNIX_EPOCH
        + Duration::from_nanos(u64::try_from(since.unix_timestamp_nanos()).ok()?);
    since.duration_since(killed).ok()
}

/// SIGKILLs the node on `port`.
async fn kill(c: &Cluster, port: &str) {
    let (cmd, p) = (c.kill.clone(), port.to_string());
    tokio::task::spawn_blocking(move || run_cmd(&cmd, &[&p]))
        .await
        .expect("kill task");
    eprintln!("killed the stream leader on :{port}");
}

async fn restart(c: &Cluster, port: &str) {
    let (cmd, p) = (c.restart.clone(), port.to_string());
    tokio::task::spawn_blocking(move || run_cmd(&cmd, &[&p]))
        .await
        .expect("restart task");
}

/// Waits until the stream has a leader and all three replicas are current again, so the
/// next test (or another engineer's) meets a whole cluster.
async fn wait_whole(s: &NatsKvStore) {
    let js = idemq_nats_kv::async_nats::jetstream::new(s.client().clone());
    let t0 = Instant::now();
    loop {
        if let Ok(stream) = js.get_stream(s.stream_name()).await {
            if let Some(c) = &stream.cached_info().cluster {
                if c.leader.is_some()
                    && c.replicas.len() == 2
                    && c.replicas.iter().all(|r| r.current && !r.offline)
                {
                    return;
                }
            }
        }
        assert!(
            t0.elapsed() < Duration::from_secs(90),
            "the cluster did not heal"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killing_the_kv_leader_during_a_claim_storm_loses_nothing_and_runs_nothing_twice() {
    let Some((url, c)) = cluster() else { return };
    let prefix = unique_prefix("storm");
    let handles = stores(&url, &prefix).await;
    let probe = store(&url, options(BUCKET, &prefix, 3)).await;
    let port = leader_port(&probe).await;
    let killed = Mutex::new(std::time::SystemTime::now());
    let report = storm(&handles, &prefix, 3000, 16, || async {
        *killed.lock().unwrap() = std::time::SystemTime::now();
        kill(&c, &port).await
    })
    .await;
    let killed = *killed.lock().unwrap();
    let elected = election_time(&probe, killed).await;
    restart(&c, &port).await;
    wait_whole(&probe).await;
    eprintln!(
        "FAILOVER claim-storm (R3, leader :{port} SIGKILLed): new leader after {elected:?}; {report:?}"
    );
    assert_eq!(report.reruns, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killing_the_kv_leader_during_completions_loses_none_and_completes_none_twice() {
    let Some((url, c)) = cluster() else { return };
    let prefix = unique_prefix("complete");
    let handles = stores(&url, &prefix).await;
    let probe = store(&url, options(BUCKET, &prefix, 3)).await;
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
    let port = leader_port(&probe).await;
    let next = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    let errors = Arc::new(AtomicUsize::new(0));
    let confirmed = Arc::new(Mutex::new(vec![0usize; n]));
    let successes = Arc::new(Mutex::new(Vec::<Instant>::new()));
    let keys = Arc::new(keys);
    let leases = Arc::new(leases);
    let mut tasks = Vec::new();
    for w in 0..16 {
        let s = handles[w % handles.len()].clone();
        let (next, done, errors, confirmed, successes, keys, leases) = (
            next.clone(),
            done.clone(),
            errors.clone(),
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
                // Until answered, with the same token (what the engine does).
                loop {
                    match s
                        .complete(&keys[i], leases[i].token, None, Duration::from_secs(3600))
                        .await
                    {
                        Ok(CompleteOutcome::Completed) => {
                            confirmed.lock().unwrap()[i] += 1;
                            successes.lock().unwrap().push(Instant::now());
                            break;
                        }
                        Ok(CompleteOutcome::Fenced) => {
                            panic!("c-{i}: the owner's completion was fenced (nobody took it over)")
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
    let killed_at = Instant::now();
    let killed_wall = std::time::SystemTime::now();
    kill(&c, &port).await;
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(180), t)
            .await
            .expect("completions finish after the failover")
            .expect("worker panicked");
    }
    let elected = election_time(&probe, killed_wall).await;
    restart(&c, &port).await;
    wait_whole(&probe).await;
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
    let mut after: Vec<Instant> = successes
        .lock()
        .unwrap()
        .iter()
        .copied()
        .filter(|t| *t >= killed_at)
        .collect();
    after.sort();
    let first = after.first().map(|t| t.duration_since(killed_at));
    let longest = after
        .windows(2)
        .map(|w| w[1].duration_since(w[0]))
        .max()
        .unwrap_or_default()
        .max(first.unwrap_or_default());
    eprintln!(
        "FAILOVER completions (R3, leader :{port} SIGKILLed): new leader after {elected:?}; keys {n}, \
         completions answered {n}, errors {errors}, first answer after kill {first:?}, longest stall \
         {longest:?}, lost 0, double 0"
    );
}
