//! The engine's heartbeat (`extend_batch`) must not wait for a connection
//! behind handler transactions. Every connection of the store's main pool is held by an
//! open transaction (handlers doing their business work); the heartbeat still renews the
//! leases, on the store's own heartbeat pool (`SqlStoreOptions::heartbeat_connections`).
//! Before that pool existed, `extend` queued for a main-pool connection and failed with the
//! pool's acquire timeout.

mod support;

use idemq_core::{
    ClaimOutcome, ClaimRequest, ConsumerGroup, DedupKey, DedupStore, ExtendOutcome, FencingToken,
};
use idemq_sql::{SqlBackend, SqlStore, SqlStoreOptions};
use std::time::Duration;

const POOL: u32 = 3;

fn options() -> SqlStoreOptions {
    SqlStoreOptions {
        // Short, so a heartbeat queued behind the handlers fails instead of hanging.
        acquire_timeout: Duration::from_secs(1),
        ..support::options(&support::unique("idemq_hb"), POOL)
    }
}

async fn heartbeat_outlives_a_starved_pool<DB: SqlBackend>(store: SqlStore<DB>) {
    let g = ConsumerGroup::new(&format!("hb-{}", FencingToken::random())).expect("group");
    let keys: Vec<DedupKey> = (0..4)
        .map(|i| DedupKey::new(&g, &format!("k{i}")).expect("key"))
        .collect();
    let reqs: Vec<ClaimRequest> = keys
        .iter()
        .map(|k| ClaimRequest::new(k.clone(), Duration::from_secs(30)))
        .collect();
    let leases: Vec<(DedupKey, FencingToken)> = store
        .claim_batch(&reqs)
        .await
        .expect("claim")
        .into_iter()
        .zip(&keys)
        .map(|(o, k)| match o {
            ClaimOutcome::Acquired(l) => (k.clone(), l.token),
            other => panic!("expected Acquired, got {other:?}"),
        })
        .collect();
    // Every main-pool connection is in an open handler transaction.
    let mut handlers = Vec::new();
    for _ in 0..POOL {
        handlers.push(store.pool().begin().await.expect("handler tx"));
    }
    assert!(
        store.pool().try_acquire().is_none(),
        "the main pool should be exhausted"
    );
    let got = store
        .extend_batch(&leases, Duration::from_secs(30))
        .await
        .expect("the heartbeat must not wait behind handler transactions");
    assert_eq!(got.len(), leases.len());
    for (o, (k, _)) in got.iter().zip(&leases) {
        assert!(
            matches!(o, ExtendOutcome::Extended { .. }),
            "{k}: expected Extended, got {o:?}"
        );
    }
    // A single extend too, and the handlers can still finish.
    let (k, t) = &leases[0];
    assert!(matches!(
        store
            .extend(k, *t, Duration::from_secs(30))
            .await
            .expect("extend"),
        ExtendOutcome::Extended { .. }
    ));
    for tx in handlers {
        tx.commit().await.expect("commit");
    }
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_heartbeat_extends_while_handlers_hold_the_pool() {
    let Some(url) = support::postgres_url() else {
        return;
    };
    let store = idemq_sql::PgStore::connect(&url, options())
        .await
        .expect("connect");
    heartbeat_outlives_a_starved_pool(store).await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_heartbeat_extends_while_handlers_hold_the_pool() {
    let Some(url) = support::mysql_url() else {
        return;
    };
    let store = idemq_sql::MySqlStore::connect(&url, options())
        .await
        .expect("connect");
    heartbeat_outlives_a_starved_pool(store).await;
}

/// `from_pool` (the application's own pool) gets a heartbeat pool too.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_from_pool_gets_its_own_heartbeat_pool() {
    let Some(url) = support::postgres_url() else {
        return;
    };
    let pool = idemq_sql::sqlx::postgres::PgPoolOptions::new()
        .max_connections(POOL)
        .acquire_timeout(Duration::from_secs(1))
        .connect(&url)
        .await
        .expect("pool");
    let store = idemq_sql::PgStore::from_pool(pool, options())
        .await
        .expect("store");
    heartbeat_outlives_a_starved_pool(store).await;
}
