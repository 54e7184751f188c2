//! `stats()` counts records by state on each SQL backend, on a table of its own.

mod support;

use idemq_core::DedupStore;
use std::sync::Arc;

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_counts_records_by_state() {
    let dir = support::TempDir::new();
    let s: Arc<dyn DedupStore> = Arc::new(
        idemq_sql::SqliteStore::connect(
            &dir.sqlite_url("stats.db"),
            support::options("idemq_stats", 2),
        )
        .await
        .expect("sqlite store"),
    );
    idemq_core::testkit::store::stats_count_records_by_state(&s).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_counts_records_by_state() {
    let Some(url) = support::postgres_url() else {
        return;
    };
    let store = idemq_sql::PgStore::connect(&url, support::options(&support::unique("stats"), 2))
        .await
        .expect("postgres store");
    let s: Arc<dyn DedupStore> = Arc::new(store.clone());
    idemq_core::testkit::store::stats_count_records_by_state(&s).await;
    for t in store.tables() {
        let _ = idemq_sql::sqlx::query(&format!("DROP TABLE IF EXISTS {t}"))
            .execute(store.pool())
            .await;
    }
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_counts_records_by_state() {
    let Some(url) = support::mysql_url() else {
        return;
    };
    let store =
        idemq_sql::MySqlStore::connect(&url, support::options(&support::unique("stats"), 2))
            .await
            .expect("mysql store");
    let s: Arc<dyn DedupStore> = Arc::new(store.clone());
    idemq_core::testkit::store::stats_count_records_by_state(&s).await;
    for t in store.tables() {
        let _ = idemq_sql::sqlx::query(&format!("DROP TABLE IF EXISTS {t}"))
            .execute(store.pool())
            .await;
    }
}
