//! Leases are decided on the database's clock: a client whose clock is an hour ahead or
//! behind neither takes over a live lease nor sees a dead one as live.
//! One test per binary: the client skew is process-wide (`set_test_clock_skew_ms`), so the
//! backends run one after the other.

mod support;

use idemq_core::testkit::clock_skew::skewed_clients_agree_on_leases;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_skewed_client_agrees_with_the_database_on_leases() {
    #[cfg(feature = "sqlite")]
    {
        let dir = support::TempDir::new();
        let s = idemq_sql::SqliteStore::connect(
            &dir.sqlite_url("skew.db"),
            support::options("idemq_skew", 2),
        )
        .await
        .expect("open sqlite store");
        skewed_clients_agree_on_leases(&s, "sqlite").await;
    }
    #[cfg(feature = "postgres")]
    if let Some(url) = support::postgres_url() {
        let s = idemq_sql::PgStore::connect(&url, support::options("idemq_skew", 2))
            .await
            .expect("connect to postgres");
        skewed_clients_agree_on_leases(&s, "postgres").await;
    }
    #[cfg(feature = "mysql")]
    if let Some(url) = support::mysql_url() {
        let s = idemq_sql::MySqlStore::connect(&url, support::options("idemq_skew", 2))
            .await
            .expect("connect to mysql");
        skewed_clients_agree_on_leases(&s, "mysql").await;
    }
}
