//! Shared fixtures of idemq-sql's integration tests.
//!
//! Server URLs come from the environment (`eval "$(scripts/servers.sh env)"`):
//! `IDEMQ_TEST_POSTGRES_URL`, `IDEMQ_TEST_MYSQL_URL`. When one is unset the test is skipped
//! or fails, as `idemq_core::testkit::servers` says.
#![allow(dead_code)]

use idemq_core::{ClaimOutcome, ClaimRequest, DedupKey, DedupStore, FencingToken};
use idemq_sql::{SqlStoreOptions, TableName};
use std::path::PathBuf;
use std::sync::Arc;

/// The URL in `var`, or `None` when the test must not run: see
/// [`idemq_core::testkit::servers`] for which `None` is a recorded skip and which a panic.
pub fn server_url(var: &str) -> Option<String> {
    idemq_core::testkit::servers::server_url(var)
}

pub fn postgres_url() -> Option<String> {
    server_url("IDEMQ_TEST_POSTGRES_URL")
}

pub fn mysql_url() -> Option<String> {
    server_url("IDEMQ_TEST_MYSQL_URL")
}

/// A random suffix for table names, so parallel tests and reruns never collide.
pub fn unique(prefix: &str) -> String {
    format!(
        "{prefix}_{:012x}",
        FencingToken::random().0 & 0xffff_ffff_ffff
    )
}

/// Claims `k` with a 30 s lease and returns the token: a fresh key must be acquired.
pub async fn claim(store: &dyn DedupStore, k: &DedupKey) -> FencingToken {
    match store
        .claim(&ClaimRequest::new(
            k.clone(),
            std::time::Duration::from_secs(30),
        ))
        .await
        .expect("claim")
    {
        ClaimOutcome::Acquired(l) => l.token,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

/// Store options on table `table`, with a small pool (many pools race in the tests).
pub fn options(table: &str, max_connections: u32) -> SqlStoreOptions {
    SqlStoreOptions {
        table: TableName::new(table).expect("valid test table"),
        max_connections,
        ..Default::default()
    }
}

/// A fresh directory under cargo's scratch dir for tests (`target/tmp`), removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new() -> Self {
        let p = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(unique("idemq-sql-test"));
        std::fs::create_dir_all(&p).expect("create temp dir");
        Self(p)
    }
    /// A `sqlite://` URL for a file in this directory.
    pub fn sqlite_url(&self, name: &str) -> String {
        format!("sqlite://{}?mode=rwc", self.0.join(name).display())
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `n` handles to one SQLite file, each with its own pool. The directory lives as long as
/// the returned guard.
#[cfg(feature = "sqlite")]
pub async fn sqlite_handles(n: usize) -> (TempDir, Vec<Arc<dyn DedupStore>>) {
    let dir = TempDir::new();
    let url = dir.sqlite_url("dedup.db");
    let mut v: Vec<Arc<dyn DedupStore>> = Vec::new();
    for _ in 0..n {
        let s = idemq_sql::SqliteStore::connect(&url, options("idemq_kit", 4))
            .await
            .expect("open sqlite store");
        v.push(Arc::new(s));
    }
    (dir, v)
}

/// `n` handles (separate pools) to the PostgreSQL test server, or `None` to skip.
#[cfg(feature = "postgres")]
pub async fn postgres_handles(n: usize) -> Option<Vec<Arc<dyn DedupStore>>> {
    let url = postgres_url()?;
    let mut v: Vec<Arc<dyn DedupStore>> = Vec::new();
    for _ in 0..n {
        let s = idemq_sql::PgStore::connect(&url, options("idemq_kit", 3))
            .await
            .expect("connect to postgres");
        v.push(Arc::new(s));
    }
    Some(v)
}

/// `n` handles (separate pools) to the MySQL/MariaDB test server, or `None` to skip.
#[cfg(feature = "mysql")]
pub async fn mysql_handles(n: usize) -> Option<Vec<Arc<dyn DedupStore>>> {
    let url = mysql_url()?;
    let mut v: Vec<Arc<dyn DedupStore>> = Vec::new();
    for _ in 0..n {
        let s = idemq_sql::MySqlStore::connect(&url, options("idemq_kit", 3))
            .await
            .expect("connect to mysql");
        v.push(Arc::new(s));
    }
    Some(v)
}

/// Like [`mysql_handles`], on pools whose sessions run MariaDB's `SIMULTANEOUS_ASSIGNMENT`
/// mode (a caller's `from_pool` may bring any `sql_mode`); `None` when the server is not
/// MariaDB or not configured.
#[cfg(feature = "mysql")]
pub async fn mysql_handles_simultaneous(n: usize) -> Option<Vec<Arc<dyn DedupStore>>> {
    use idemq_sql::sqlx::{self, mysql::MySqlPoolOptions, Executor};
    let url = mysql_url()?;
    let mut v: Vec<Arc<dyn DedupStore>> = Vec::new();
    for _ in 0..n {
        let pool = MySqlPoolOptions::new()
            .max_connections(3)
            .after_connect(|conn, _| {
                Box::pin(async move {
                    conn.execute(
                        "SET SESSION sql_mode = CONCAT(@@sql_mode, ',SIMULTANEOUS_ASSIGNMENT')",
                    )
                    .await?;
                    Ok(())
                })
            })
            .connect(&url)
            .await
            .expect("connect to mysql");
        let (version,): (String,) = sqlx::query_as("SELECT VERSION()")
            .fetch_one(&pool)
            .await
            .expect("version");
        if !version.to_ascii_lowercase().contains("mariadb") {
            eprintln!("skipping: SIMULTANEOUS_ASSIGNMENT is MariaDB-only (server {version})");
            return None;
        }
        let s = idemq_sql::MySqlStore::from_pool(pool, options("idemq_kit_sa", 3))
            .await
            .expect("open store");
        v.push(Arc::new(s));
    }
    Some(v)
}

/// Keeps a test's resources (a SQLite temp dir) alive.
pub struct Guard(#[allow(dead_code)] Option<TempDir>);

/// A SQLite store on a fresh file (8-connection pool).
#[cfg(feature = "sqlite")]
pub async fn sqlite_store() -> Option<(Guard, idemq_sql::SqliteStore)> {
    let dir = TempDir::new();
    let s =
        idemq_sql::SqliteStore::connect(&dir.sqlite_url("scenario.db"), options("idemq_dedup", 8))
            .await
            .expect("open sqlite store");
    Some((Guard(Some(dir)), s))
}

/// A PostgreSQL store on the test server (16-connection pool), or `None` to skip.
#[cfg(feature = "postgres")]
pub async fn postgres_store() -> Option<(Guard, idemq_sql::PgStore)> {
    let url = postgres_url()?;
    let s = idemq_sql::PgStore::connect(&url, options("idemq_scenarios", 16))
        .await
        .expect("connect to postgres");
    Some((Guard(None), s))
}

/// A MySQL/MariaDB store on the test server (16-connection pool), or `None` to skip.
#[cfg(feature = "mysql")]
pub async fn mysql_store() -> Option<(Guard, idemq_sql::MySqlStore)> {
    let url = mysql_url()?;
    let s = idemq_sql::MySqlStore::connect(&url, options("idemq_scenarios", 16))
        .await
        .expect("connect to mysql");
    Some((Guard(None), s))
}
