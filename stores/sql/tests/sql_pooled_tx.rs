//! `PooledTx` on the real databases: a transaction dropped before its commit, or a `BEGIN`
//! cut off at any point, never leaves a pooled connection inside a transaction. (A
//! connection handed back to the pool after a cut-off `BEGIN` would run every later
//! autocommit statement inside a transaction nobody commits, holding its locks.)

mod support;

use idemq_sql::{sqlx, PooledTx};
use std::time::Duration;

#[cfg(feature = "mysql")]
async fn mysql_pool() -> Option<sqlx::MySqlPool> {
    let url = support::mysql_url()?;
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await
        .expect("connect to MariaDB");
    Some(pool)
}

/// The server's id of the pool's connection, and whether it is inside a transaction.
#[cfg(feature = "mysql")]
async fn mysql_session(pool: &sqlx::MySqlPool) -> (u64, u64) {
    sqlx::query_as::<_, (u64, u64)>("SELECT CONNECTION_ID(), @@in_transaction")
        .fetch_one(pool)
        .await
        .expect("session")
}

#[cfg(feature = "mysql")]
#[tokio::test]
async fn a_transaction_dropped_open_closes_its_connection_on_mariadb() {
    let Some(pool) = mysql_pool().await else {
        return;
    };
    let mut tx = PooledTx::begin(&pool).await.expect("begin");
    let (inside, in_tx) =
        sqlx::query_as::<_, (u64, u64)>("SELECT CONNECTION_ID(), @@in_transaction")
            .fetch_one(&mut *tx)
            .await
            .expect("inside");
    assert_eq!(in_tx, 1, "BEGIN took");
    drop(tx);
    let (next, in_tx) = mysql_session(&pool).await;
    assert_ne!(
        next, inside,
        "the connection dropped mid-transaction went back to the pool"
    );
    assert_eq!(in_tx, 0);

    // Committed: the connection goes back to the pool, outside any transaction.
    let mut tx = PooledTx::begin(&pool).await.expect("begin");
    let (inside, _) = sqlx::query_as::<_, (u64, u64)>("SELECT CONNECTION_ID(), @@in_transaction")
        .fetch_one(&mut *tx)
        .await
        .expect("inside");
    tx.commit().await.expect("commit");
    drop(tx);
    assert_eq!(
        mysql_session(&pool).await,
        (inside, 0),
        "a committed one is reused"
    );
}

#[cfg(feature = "mysql")]
#[tokio::test]
async fn a_begin_cut_off_anywhere_leaves_no_pooled_connection_in_a_transaction() {
    let Some(pool) = mysql_pool().await else {
        return;
    };
    // Cut off after 0, 5, 10 … µs: before the connection is taken, while BEGIN is on its
    // way, before its answer is read, or after it is done (then dropped open). With a plain
    // pooled connection under the BEGIN (what `begin_for` and Flow 3 did), 18 cuts of 400
    // here, all between 0.7 and 0.9 ms, left the next user of the connection inside the
    // cut-off transaction.
    for step in 0..600u64 {
        let cut = Duration::from_micros(step * 5);
        let _ = tokio::time::timeout(cut, PooledTx::begin(&pool)).await;
        let (_, in_tx) = mysql_session(&pool).await;
        assert_eq!(
            in_tx, 0,
            "a BEGIN cut off after {cut:?} left its connection in a transaction"
        );
    }
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn a_transaction_dropped_open_closes_its_connection_on_postgres() {
    let Some(url) = support::postgres_url() else {
        return;
    };
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await
        .expect("connect to PostgreSQL");
    let session = "SELECT pg_backend_pid(), now() = statement_timestamp()";
    let mut tx = PooledTx::begin(&pool).await.expect("begin");
    // Inside a transaction now() is its start, earlier than the statement's own clock.
    sqlx::query("SELECT pg_sleep(0.01)")
        .execute(&mut *tx)
        .await
        .expect("sleep");
    let (inside, outside_tx) = sqlx::query_as::<_, (i32, bool)>(session)
        .fetch_one(&mut *tx)
        .await
        .expect("inside");
    assert!(!outside_tx, "BEGIN took");
    drop(tx);
    let next: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&pool)
        .await
        .expect("next");
    assert_ne!(
        next, inside,
        "the connection dropped mid-transaction went back to the pool"
    );
}

#[cfg(feature = "sqlite")]
#[tokio::test]
async fn begin_immediate_takes_sqlites_write_lock_and_a_dropped_one_gives_it_back() {
    use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
    let dir = std::env::temp_dir().join(format!("idemq-pooled-tx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let options = SqliteConnectOptions::new()
        .filename(dir.join("lock.db"))
        .create_if_missing(true)
        // A writer that finds the lock taken fails at once instead of waiting.
        .busy_timeout(Duration::ZERO);
    let pool = SqlitePoolOptions::new()
        .max_connections(2)
        .connect_with(options)
        .await
        .expect("open SQLite");
    sqlx::query("CREATE TABLE IF NOT EXISTS t (v INTEGER)")
        .execute(&pool)
        .await
        .expect("create");

    let held = PooledTx::begin_with(&pool, "BEGIN IMMEDIATE")
        .await
        .expect("first BEGIN IMMEDIATE");
    let second = PooledTx::begin_with(&pool, "BEGIN IMMEDIATE").await;
    let err = second.expect_err("a second writer got in while the first held the lock");
    assert!(
        err.to_string().contains("locked"),
        "expected SQLITE_BUSY, got: {err}"
    );
    // A plain BEGIN is deferred: it takes no lock until it writes.
    let mut reader = PooledTx::begin(&pool).await.expect("deferred BEGIN");
    let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM t")
        .fetch_one(&mut *reader)
        .await
        .expect("read under the writer's lock");
    assert_eq!(rows, 0);
    reader.rollback().await.expect("rollback");
    drop(reader);

    // Dropped open: its connection is closed (on a task of the pool's, so not at once),
    // which rolls back and frees the lock.
    drop(held);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut next = loop {
        match PooledTx::begin_with(&pool, "BEGIN IMMEDIATE").await {
            Ok(tx) => break tx,
            Err(e) if e.to_string().contains("locked") => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the dropped transaction kept the write lock"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err(e) => panic!("BEGIN IMMEDIATE: {e}"),
        }
    };
    sqlx::query("INSERT INTO t (v) VALUES (1)")
        .execute(&mut *next)
        .await
        .expect("write");
    next.commit().await.expect("commit");
    drop(next);
    pool.close().await;
    std::fs::remove_dir_all(&dir).expect("clean up");
}
