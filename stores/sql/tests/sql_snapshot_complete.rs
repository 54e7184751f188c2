//! A business transaction at snapshot isolation (PostgreSQL REPEATABLE READ
//! and SERIALIZABLE, MariaDB with `innodb_snapshot_isolation=ON`) that outlives a heartbeat
//! must still complete in-transaction. The heartbeat's `extend` rewrites the dedup row after
//! the transaction's snapshot; an in-transaction `UPDATE` of that row failed with 40001 /
//! 1020, so the completion is inserted into the fence table instead (docs/stores-sql.md,
//! "Snapshot isolation").

mod support;

use support::claim;

use idemq_core::{
    ClaimOutcome, ClaimRequest, CompleteOutcome, ConsumerGroup, DedupKey, DedupStore, FencingToken,
    RecordStatus,
};
use std::time::Duration;

fn key() -> DedupKey {
    let g = ConsumerGroup::new(&format!("snap-{}", FencingToken::random())).expect("group");
    DedupKey::new(&g, "order-1").expect("key")
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn postgres_snapshot_tx_outliving_a_heartbeat_completes_in_tx() {
    use idemq_sql::sqlx::Executor;
    let Some(url) = support::postgres_url() else {
        return;
    };
    let store = idemq_sql::PgStore::connect(&url, support::options("idemq_snap", 4))
        .await
        .expect("connect");
    for level in ["REPEATABLE READ", "SERIALIZABLE"] {
        let k = key();
        let token = claim(&store, &k).await;
        let mut conn = store.pool().acquire().await.expect("conn");
        conn.execute(format!("BEGIN ISOLATION LEVEL {level}").as_str())
            .await
            .expect("begin");
        // The business work takes the snapshot...
        conn.execute("SELECT count(*) FROM idemq_snap")
            .await
            .expect("read");
        // ...the engine's heartbeat renews the lease meanwhile...
        store
            .extend(&k, token, Duration::from_secs(30))
            .await
            .expect("heartbeat");
        // ...and the completion must still commit with the business writes.
        let done = store
            .complete_in_tx(&mut conn, &k, token, None, Duration::from_secs(60))
            .await
            .unwrap_or_else(|e| panic!("{level}: complete_in_tx after a heartbeat: {e}"));
        assert_eq!(done, CompleteOutcome::Completed, "{level}");
        conn.execute("COMMIT").await.expect("commit");
        let rec = store.get(&k).await.expect("get").expect("record");
        assert_eq!(rec.status, RecordStatus::Completed, "{level}");
    }
}

#[cfg(feature = "mysql")]
#[tokio::test]
async fn mariadb_snapshot_tx_outliving_a_heartbeat_completes_in_tx() {
    use idemq_sql::sqlx::Executor;
    let Some(url) = support::mysql_url() else {
        return;
    };
    let store = idemq_sql::MySqlStore::connect(&url, support::options("idemq_snap", 4))
        .await
        .expect("connect");
    let k = key();
    let token = claim(&store, &k).await;
    let mut conn = store.pool().acquire().await.expect("conn");
    if conn
        .execute("SET SESSION innodb_snapshot_isolation = ON")
        .await
        .is_err()
    {
        eprintln!("skipping: the server has no innodb_snapshot_isolation (not MariaDB >= 10.6.18)");
        return;
    }
    conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .await
        .expect("level");
    conn.execute("START TRANSACTION WITH CONSISTENT SNAPSHOT")
        .await
        .expect("begin");
    conn.execute("SELECT count(*) FROM idemq_snap")
        .await
        .expect("read");
    store
        .extend(&k, token, Duration::from_secs(30))
        .await
        .expect("heartbeat");
    let done = store
        .complete_in_tx(&mut conn, &k, token, None, Duration::from_secs(60))
        .await;
    let _ = conn
        .execute("SET SESSION innodb_snapshot_isolation = OFF")
        .await;
    let done = done.unwrap_or_else(|e| panic!("complete_in_tx after a heartbeat: {e}"));
    assert_eq!(done, CompleteOutcome::Completed);
    conn.execute("COMMIT").await.expect("commit");
    let rec = store.get(&k).await.expect("get").expect("record");
    assert_eq!(rec.status, RecordStatus::Completed);
}

/// The fence's two sides, on each server with a fence table: a takeover waits for an open
/// in-transaction completion of the old token and then answers `Duplicate` (it committed)
/// or takes over (it rolled back); a snapshot transaction whose token was taken over after
/// its snapshot can never complete.
macro_rules! fence_suite {
    ($modname:ident, $feature:literal, $db:ty, $store:ty, $url:path, $snapshot:expr) => {
        #[cfg(feature = $feature)]
        mod $modname {
            use super::*;
            use idemq_core::StoreError;
            use idemq_sql::sqlx::{Executor, Pool};

            type Db = $db;

            async fn store() -> Option<$store> {
                let url = $url()?;
                let table = support::unique("idemq_fence");
                Some(
                    <$store>::connect(&url, support::options(&table, 4))
                        .await
                        .expect("connect"),
                )
            }

            async fn claim_short(store: &$store, k: &DedupKey) -> FencingToken {
                match store
                    .claim(&ClaimRequest::new(k.clone(), Duration::from_millis(50)))
                    .await
                    .expect("claim")
                {
                    ClaimOutcome::Acquired(l) => l.token,
                    other => panic!("expected Acquired, got {other:?}"),
                }
            }

            /// Opens the business transaction at the backend's snapshot level and takes
            /// its snapshot.
            async fn begin_snapshot(pool: &Pool<Db>) -> idemq_sql::sqlx::pool::PoolConnection<Db> {
                let mut conn = pool.acquire().await.expect("conn");
                for stmt in $snapshot {
                    conn.execute(stmt).await.expect(stmt);
                }
                conn.execute("SELECT 1").await.expect("snapshot");
                conn
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_takeover_waits_for_an_open_in_tx_completion() {
                let Some(store) = store().await else { return };
                for commit in [true, false] {
                    let k = key();
                    let old = claim_short(&store, &k).await;
                    let mut tx = store.pool().begin().await.expect("begin");
                    assert_eq!(
                        store
                            .complete_in_tx(&mut *tx, &k, old, Some(b"r1"), Duration::from_secs(60))
                            .await
                            .expect("complete_in_tx"),
                        CompleteOutcome::Completed
                    );
                    // The lease ends while the business transaction is still open; a
                    // takeover must wait for it to end, whichever way it ends.
                    tokio::time::sleep(Duration::from_millis(150)).await;
                    let s2 = store.clone();
                    let k2 = k.clone();
                    let claim = tokio::spawn(async move {
                        s2.claim(&ClaimRequest::new(k2, Duration::from_secs(30)))
                            .await
                    });
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    if commit {
                        tx.commit().await.expect("commit");
                    } else {
                        tx.rollback().await.expect("rollback");
                    }
                    let got = claim.await.expect("join").expect("claim");
                    if commit {
                        match got {
                            ClaimOutcome::Duplicate(r) => {
                                assert_eq!(r.token, old);
                                assert_eq!(r.result.as_deref(), Some(&b"r1"[..]));
                            }
                            other => panic!("after the commit: expected Duplicate, got {other:?}"),
                        }
                        let rec = store.get(&k).await.expect("get").expect("record");
                        assert_eq!(rec.status, RecordStatus::Completed);
                        assert_eq!(rec.token, old);
                    } else {
                        let new = match got {
                            ClaimOutcome::Acquired(l) => {
                                assert!(l.takeover, "an ended lease is a takeover");
                                assert_eq!(l.attempt, 2);
                                l.token
                            }
                            other => panic!("after the rollback: expected Acquired, got {other:?}"),
                        };
                        // The old token is fenced for good, the new one completes.
                        let mut tx = store.pool().begin().await.expect("begin");
                        assert_eq!(
                            store
                                .complete_in_tx(&mut *tx, &k, old, None, Duration::from_secs(60))
                                .await
                                .expect("complete_in_tx"),
                            CompleteOutcome::Fenced
                        );
                        tx.rollback().await.expect("rollback");
                        assert_eq!(
                            store
                                .complete(&k, new, None, Duration::from_secs(60))
                                .await
                                .expect("complete"),
                            CompleteOutcome::Completed
                        );
                    }
                }
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_snapshot_tx_taken_over_after_its_snapshot_never_completes() {
                let Some(store) = store().await else { return };
                let k = key();
                let old = claim_short(&store, &k).await;
                let mut conn = begin_snapshot(store.pool()).await;
                tokio::time::sleep(Duration::from_millis(150)).await;
                let new = match store
                    .claim(&ClaimRequest::new(k.clone(), Duration::from_secs(30)))
                    .await
                    .expect("takeover")
                {
                    ClaimOutcome::Acquired(l) => l.token,
                    other => panic!("expected a takeover, got {other:?}"),
                };
                // The snapshot still shows the old token as the owner: the tombstone fences
                // it (`Fenced`, or a retryable serialization failure at snapshot isolation).
                match store
                    .complete_in_tx(&mut conn, &k, old, Some(b"old"), Duration::from_secs(60))
                    .await
                {
                    Ok(CompleteOutcome::Fenced) | Err(StoreError::Unavailable(_)) => {}
                    other => panic!("a taken-over token completed in a snapshot tx: {other:?}"),
                }
                let _ = conn.execute("ROLLBACK").await;
                drop(conn);
                assert_eq!(
                    store
                        .complete(
                            &k,
                            new,
                            Some(idemq_core::Bytes::from_static(b"new")),
                            Duration::from_secs(60)
                        )
                        .await
                        .expect("complete"),
                    CompleteOutcome::Completed
                );
                let rec = store.get(&k).await.expect("get").expect("record");
                assert_eq!(rec.token, new);
                assert_eq!(rec.result.as_deref(), Some(&b"new"[..]));
            }
        }
    };
}

fence_suite!(
    postgres_fence,
    "postgres",
    idemq_sql::sqlx::Postgres,
    idemq_sql::PgStore,
    support::postgres_url,
    ["BEGIN ISOLATION LEVEL REPEATABLE READ"]
);
fence_suite!(
    mariadb_fence,
    "mysql",
    idemq_sql::sqlx::MySql,
    idemq_sql::MySqlStore,
    support::mysql_url,
    [
        "SET SESSION innodb_snapshot_isolation = ON",
        "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ",
        "START TRANSACTION WITH CONSISTENT SNAPSHOT"
    ]
);
