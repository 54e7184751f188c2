//! Redis losing data, or restarting where a lost write cannot be ruled
//! out, must be noticed.
//!
//! - The store's incarnation marker: a dataset that lost the store's keys (a restart
//!   without persistence, a failover to a replica that never had them, a `FLUSHALL`) is
//!   reported — `check_incarnation` errs, `incarnation_lost` is set by the background
//!   check too — while a restart that kept everything (AOF) is not.
//! - The RedisBloom filter: after a real restart it can no longer prove "never seen" (a
//!   snapshot or a lost last second could have rolled it back, marker included), so it
//!   errs, and a layered store's fallback gate stops trusting it.
//!
//! Restarts the real redis-server (`scripts/servers.sh restart-redis`): alone in its test
//! binary, one test function, so nothing else here runs during the restart.

mod support;

use idemq_core::{ClaimOutcome, ClaimRequest, DedupStore, MemoryStore, StoreError};
use idemq_layered::{FallbackGate, LayeredStore, PreFilter};
use idemq_redis::{redisbloom_loaded, RedisBloomFilter, RedisStore};
use redis::AsyncCommands;
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::*;

const LEASE: Duration = Duration::from_secs(30);
const RETAIN: Duration = Duration::from_secs(3600);

async fn complete_one(store: &dyn DedupStore, name: &str) {
    let k = fresh_key(name);
    let ClaimOutcome::Acquired(l) = store
        .claim(&ClaimRequest::new(k.clone(), LEASE))
        .await
        .expect("claim")
    else {
        panic!("expected Acquired");
    };
    store
        .complete(&k, l.token, None, RETAIN)
        .await
        .expect("complete");
}

/// Waits (bounded) until Redis answers again after a restart.
async fn until_up(store: &RedisStore) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match store.get(&fresh_key("ping")).await {
            Ok(_) => return,
            Err(e) if Instant::now() < deadline => {
                eprintln!("waiting for redis: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("redis did not come back: {e}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_data_loss_and_restarts_are_detected() {
    let Some(url) = redis_url() else { return };

    // ---- a lost dataset is reported ------------------------------------------------------
    let prefix = unique_prefix("inc");
    let store = RedisStore::builder(&url)
        .prefix(&prefix)
        .connect()
        .await
        .expect("connect");
    let watcher = RedisStore::builder(&url)
        .prefix(&prefix)
        .incarnation_check_interval(Duration::from_millis(50))
        .connect()
        .await
        .expect("connect");
    complete_one(&store, "before-loss").await;
    store.check_incarnation().await.expect("nothing lost yet");
    assert!(!store.incarnation_lost() && !watcher.incarnation_lost());
    // A layered store over the watcher, whose fallback gate follows its health.
    let gated = {
        let w = watcher.clone();
        LayeredStore::builder(Arc::new(watcher.clone()))
            .prefilter(Arc::new(idemq_layered::LocalBloom::new(1000, 0.01)))
            .fallback(Arc::new(MemoryStore::new()), FallbackGate::NeverSeenKeys)
            .distrust_filter_when(move || w.incarnation_lost())
            .build()
            .expect("layered")
    };
    assert!(gated.filter_trusted());
    // The loss of this store's keyspace, as a failover to a replica that never had it
    // would look (a FLUSHALL would also hit the other tests sharing the server).
    let mut raw = raw(&url).await;
    let mut doomed: Vec<String> = raw.keys(format!("{prefix}:*")).await.expect("KEYS");
    doomed.push(store.incarnation_key().to_owned());
    let _: () = raw.del(&doomed).await.expect("DEL");
    match store.check_incarnation().await {
        Err(StoreError::Backend(msg)) => assert!(msg.contains("dataset lost"), "{msg}"),
        other => panic!("a lost dataset must be reported, got {other:?}"),
    }
    assert!(store.incarnation_lost());
    // Sticky until acknowledged; the other handle's background check sees it too.
    assert!(store.check_incarnation().await.is_err());
    let deadline = Instant::now() + Duration::from_secs(10);
    while !watcher.incarnation_lost() {
        assert!(
            Instant::now() < deadline,
            "the background check never noticed the loss"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        !gated.filter_trusted(),
        "the fallback gate still trusts negative answers after a data loss"
    );
    store.acknowledge_data_loss();
    store
        .check_incarnation()
        .await
        .expect("acknowledged: the new marker is the incarnation");

    // ---- a real restart: data kept (AOF), the bloom filter is no longer trusted ----------
    let conn = store.connection().expect("standalone store");
    let bloom = if redisbloom_loaded(&conn).await.expect("MODULE LIST") {
        Some(Arc::new(
            RedisBloomFilter::open(conn, &unique_prefix("bf"), 10_000, 0.001)
                .await
                .expect("open filter"),
        ))
    } else {
        eprintln!("RedisBloom not loaded: only the store's marker is checked");
        None
    };
    let layered = bloom.as_ref().map(|f| {
        LayeredStore::builder(Arc::new(store.clone()))
            .prefilter(f.clone() as Arc<dyn PreFilter>)
            .fallback(Arc::new(MemoryStore::new()), FallbackGate::NeverSeenKeys)
            .build()
            .expect("layered")
    });
    if let Some(l) = &layered {
        complete_one(l, "before-restart").await;
        assert!(l.filter_trusted());
    }
    restart_redis();
    until_up(&store).await;
    store
        .check_incarnation()
        .await
        .expect("an AOF restart keeps the marker: no loss");
    assert!(!store.incarnation_lost());
    if let (Some(f), Some(l)) = (&bloom, &layered) {
        // Before: the restored filter answered "never seen" as if nothing had happened.
        match f.insert(&[fresh_key("after-restart")]).await {
            Err(StoreError::Backend(msg)) => {
                assert!(msg.contains("IDEMQ_FILTER_RESTARTED"), "{msg}")
            }
            other => panic!("a filter across a restart must not answer, got {other:?}"),
        }
        assert!(f.restart_seen());
        // The layered store's gate: its next filter insert fails, and from then on no key
        // counts as "never seen" for the fallback.
        complete_one(l, "after-restart").await;
        assert!(
            !l.filter_trusted(),
            "the fallback gate still trusts the filter"
        );
    }
}
