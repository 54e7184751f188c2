//! Leases are decided on the NATS server's clock (the stream leader's time, carried on the
//! monotonic clock): a client whose wall clock is an hour ahead or behind neither takes
//! over a live lease nor sees a dead one as live. One test per binary: the client skew is
//! process-wide.

mod support;

use idemq_core::testkit::clock_skew::skewed_clients_agree_on_leases;
use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_skewed_client_agrees_with_the_nats_server_on_leases() {
    let Some(url) = single_url() else { return };
    let s = store(&url, options("idemq_test", &unique_prefix("skew"), 1)).await;
    skewed_clients_agree_on_leases(&s, "nats-kv").await;
}
