//! Restarts the single NATS node (`scripts/servers.sh restart-nats`: stop, start, same
//! JetStream directory) while workers claim and complete a stream of keys: no completed
//! key lost, none completed twice, no handler run twice, every error during the outage
//! retryable. Alone in its binary: the restart must not disturb other tests.

mod support;

use idemq_core::testkit::servers::server_url;
use idemq_core::testkit::storm::storm;
use idemq_core::DedupStore;
use std::sync::Arc;
use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_nats_restart_mid_stream_loses_nothing_and_completes_nothing_twice() {
    let Some(url) = single_url() else { return };
    let Some(cmd) = server_url("IDEMQ_TEST_NATS_RESTART_CMD") else {
        return;
    };
    let prefix = unique_prefix("restart");
    let mut stores: Vec<Arc<dyn DedupStore>> = Vec::new();
    for _ in 0..4 {
        stores.push(Arc::new(
            store(&url, options("idemq_restart", &prefix, 1)).await,
        ));
    }
    // The restart is proven by the server's id (a new one at each start), not by errors: a
    // quick restart can pass unseen, every call answered after the client reconnects.
    let probe = store(&url, options("idemq_restart", &prefix, 1)).await;
    let before = probe.client().server_info().server_id;
    let report = storm(&stores, &prefix, 3000, 8, || async {
        tokio::task::spawn_blocking(move || run_cmd(&cmd, &[]))
            .await
            .expect("restart task");
    })
    .await;
    let t0 = std::time::Instant::now();
    while probe.client().server_info().server_id == before {
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(60),
            "the server was not restarted (same server id {before})"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    eprintln!("RESTART single node: {report:?}");
    assert_eq!(report.reruns, 0);
}
