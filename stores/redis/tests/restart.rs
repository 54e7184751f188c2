//! Restarts the real redis-server (`scripts/servers.sh restart-redis`) while workers claim
//! and complete a stream of keys. Alone in its test binary: the restart must not disturb
//! other tests.
//!
//! The scripts run Redis with an append-only file, as a dedup store should run, and the
//! restart is a `SHUTDOWN` (which fsyncs the AOF): leases and completed records survive it.
//! What must hold:
//! - every key is acknowledged exactly once (none lost);
//! - every handler runs exactly once (nothing processed twice), and no key gets two
//!   confirmed completions;
//! - an error during the outage is retried, never taken for "not a duplicate" or "done";
//! - keys acknowledged before the restart are still completed after it.

mod support;

use idemq_core::testkit::storm::storm;
use idemq_core::DedupStore;
use std::sync::Arc;
use support::*;

const KEYS: usize = 3000;
const WORKERS: usize = 8;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redis_restart_mid_stream_loses_nothing_and_completes_nothing_twice() {
    let Some(url) = redis_url() else { return };
    let prefix = unique_prefix("restart");
    let stores: Vec<Arc<dyn DedupStore>> = handles(4, &prefix, true).await.expect("url is set");
    let group = fresh_key("x").group().to_string();
    // The storm checks every key: acknowledged once, handled once, completed once, and
    // completed in the restarted server.
    let report = storm(&stores, &group, KEYS, WORKERS, || async {
        tokio::task::spawn_blocking(restart_redis)
            .await
            .expect("restart task");
    })
    .await;
    assert!(
        report.errors_during > 0,
        "the outage was seen by the workers (errors {})",
        report.errors
    );
    assert!(
        report.acked_before_disruption_done >= KEYS / 3,
        "the restart came after a third of the stream ({})",
        report.acked_before_disruption_done
    );
    eprintln!("{report:?}");
    let _ = url;
}
