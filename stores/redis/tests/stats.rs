//! `stats()` counts records by state on Redis (standalone and Cluster), under a prefix of
//! its own.

mod support;

use idemq_core::DedupStore;
use std::sync::Arc;
use support::{cluster_url, connect, redis_url, unique_prefix};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_counts_records_by_state() {
    let Some(url) = redis_url() else { return };
    let s: Arc<dyn DedupStore> = Arc::new(connect(&url, &unique_prefix("stats"), false).await);
    idemq_core::testkit::store::stats_count_records_by_state(&s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_cluster_counts_records_of_every_master() {
    let Some(url) = cluster_url() else { return };
    let s: Arc<dyn DedupStore> = Arc::new(connect(&url, &unique_prefix("stats"), false).await);
    idemq_core::testkit::store::stats_count_records_by_state(&s).await;
}
