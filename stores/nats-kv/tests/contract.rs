//! The store kit on NATS JetStream KV: on the single node (an R1 bucket) and on the 3-node
//! cluster (an R3 bucket), plus `stats()` on a prefix of its own on each.

mod support;

use idemq_core::DedupStore;
use std::sync::Arc;
use support::*;

mod single_node {
    use super::*;
    idemq_core::store_contract_tests!(async {
        handles(single_url(), 4, "idemq_test", &unique_prefix("kit"), 1).await
    });
}

mod r3_cluster {
    use super::*;
    idemq_core::store_contract_tests!(async {
        handles(cluster_url(), 4, "idemq_test_r3", &unique_prefix("kit"), 3).await
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_kv_counts_records_by_state() {
    let Some(url) = single_url() else { return };
    let s: Arc<dyn DedupStore> =
        Arc::new(store(&url, options("idemq_test", &unique_prefix("stats"), 1)).await);
    idemq_core::testkit::store::stats_count_records_by_state(&s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_r3_bucket_counts_records_by_state() {
    let Some(url) = cluster_url() else { return };
    let s: Arc<dyn DedupStore> =
        Arc::new(store(&url, options("idemq_test_r3", &unique_prefix("stats"), 3)).await);
    idemq_core::testkit::store::stats_count_records_by_state(&s).await;
}
