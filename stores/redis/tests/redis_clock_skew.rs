//! Leases are decided on the Redis server's clock (`TIME` inside the scripts): a client whose
//! clock is an hour ahead or behind neither takes over a live lease nor sees a dead one as
//! live. One test per binary: the client skew is process-wide.

mod support;

use idemq_core::testkit::clock_skew::skewed_clients_agree_on_leases;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_skewed_client_agrees_with_redis_on_leases() {
    for hash_tag in [false, true] {
        let prefix = support::unique_prefix("skew");
        let Some(s) = support::store(&prefix, hash_tag).await else {
            return;
        };
        assert!(!s.fast_claims(), "the default claims through the script");
        skewed_clients_agree_on_leases(&s, if hash_tag { "tagged" } else { "plain" }).await;
    }
}
