//! The store contract kit and the cluster-specific behaviour of `RedisStore` on the real
//! Redis Cluster of `scripts/servers.sh` (3 masters + 3 replicas, `IDEMQ_REDIS_CLUSTER_URL`).

mod support;

use idemq_core::{
    ClaimOutcome, ClaimRequest, CompleteOutcome, ConsumerGroup, DedupKey, DedupStore, FencingToken,
    StoreError,
};
use idemq_redis::{key_slot, RedisStore};
use std::collections::HashSet;
use std::time::Duration;
use support::*;

/// Keys without a hash tag: every key in a slot of its own, batches spread over all masters.
mod plain_keys {
    use super::*;
    idemq_core::store_contract_tests!(async {
        let p = unique_prefix("ckit");
        cluster_handles_with(4, |b| b.prefix(&p)).await
    });
}

/// A group's keys in one slot (`{group}`): one script call per group.
mod hash_tagged_keys {
    use super::*;
    idemq_core::store_contract_tests!(async {
        let p = unique_prefix("ckit-tag");
        cluster_handles_with(4, |b| b.prefix(&p).hash_tag(true)).await
    });
}

/// The `SET NX GET` fast path, pipelined per slot.
mod fast_claims {
    use super::*;
    idemq_core::store_contract_tests!(async {
        let p = unique_prefix("ckit-fast");
        cluster_handles_with(4, |b| b.prefix(&p).fast_claims(true)).await
    });
}

/// Every durable write followed by `WAIT 1`.
mod wait_one_replica {
    use super::*;
    idemq_core::store_contract_tests!(async {
        let p = unique_prefix("ckit-wait");
        cluster_handles_with(4, |b| {
            b.prefix(&p)
                .fast_claims(true)
                .wait_replicas(1, Duration::from_secs(2))
        })
        .await
    });
}

const LONG: Duration = Duration::from_secs(60);

async fn cluster_store(prefix: &str, hash_tag: bool) -> Option<RedisStore> {
    let url = cluster_url()?;
    Some(
        RedisStore::builder(&url)
            .prefix(prefix)
            .hash_tag(hash_tag)
            .fast_claims(true)
            .connect()
            .await
            .unwrap_or_else(|e| panic!("cannot connect to the Redis Cluster {url}: {e}")),
    )
}

/// The masters' slot ranges, from `CLUSTER SLOTS` through the store's own connection.
async fn master_of_slot(store: &RedisStore) -> impl Fn(u16) -> u16 {
    let mut con = store.cluster_connection().expect("a cluster store");
    let slots: Vec<(u16, u16, (String, u16))> = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query_async::<Vec<redis::Value>>(&mut con)
        .await
        .expect("CLUSTER SLOTS")
        .into_iter()
        .map(|r| match r {
            // start, end, [host, port, id, ...], replicas...
            redis::Value::Array(f) if f.len() >= 3 => {
                let node: Vec<redis::Value> = redis::from_redis_value(&f[2]).expect("node");
                (
                    redis::from_redis_value(&f[0]).expect("start"),
                    redis::from_redis_value(&f[1]).expect("end"),
                    (
                        redis::from_redis_value(&node[0]).expect("host"),
                        redis::from_redis_value(&node[1]).expect("port"),
                    ),
                )
            }
            other => panic!("unexpected CLUSTER SLOTS row {other:?}"),
        })
        .collect();
    move |slot| {
        slots
            .iter()
            .find(|(a, b, _)| (*a..=*b).contains(&slot))
            .map(|(_, _, (_, port))| *port)
            .expect("every slot is served")
    }
}

#[tokio::test]
async fn malformed_cluster_urls_are_config_errors_naming_the_form() {
    for bad in [
        "redis+cluster://",
        "redis+cluster://127.0.0.1",
        "redis+cluster://127.0.0.1:x/",
        "redis+cluster://127.0.0.1:1,/",
        "redis+cluster://127.0.0.1:1/2",
    ] {
        match RedisStore::builder(bad).connect().await {
            Err(StoreError::Config(m)) => assert!(m.contains("redis+cluster://"), "{bad}: {m}"),
            other => panic!("{bad}: expected a Config error, got {other:?}"),
        }
    }
}

#[tokio::test]
async fn hostile_prefixes_are_refused_before_connecting_to_a_cluster() {
    for bad in ["{", "}", "a{b}", "x*", "a:b", ""] {
        // Port 1: nothing listens, so only the prefix check can answer.
        match RedisStore::builder("redis+cluster://127.0.0.1:1/")
            .prefix(bad)
            .connect()
            .await
        {
            Err(StoreError::Config(m)) => assert!(m.contains("prefix"), "{bad:?}: {m}"),
            other => panic!("{bad:?}: expected a Config error, got {other:?}"),
        }
    }
}

#[tokio::test]
async fn a_standalone_server_behind_a_cluster_url_is_a_config_error() {
    let Some(url) = redis_url() else { return };
    let hostport = url
        .trim_start_matches("redis://")
        .trim_end_matches('/')
        .to_owned();
    match RedisStore::builder(format!("redis+cluster://{hostport}/"))
        .connect()
        .await
    {
        Err(StoreError::Config(m)) => {
            assert!(
                m.contains("cluster_enabled:0") && m.contains("redis://"),
                "{m}"
            )
        }
        other => panic!("expected a Config error, got {other:?}"),
    }
}

#[tokio::test]
async fn a_cluster_store_has_no_single_connection_and_no_bloom_filter() {
    let Some(store) = cluster_store(&unique_prefix("conn"), false).await else {
        return;
    };
    assert!(store.is_cluster());
    match store.connection() {
        Err(StoreError::Config(m)) => assert!(m.contains("standalone-only"), "{m}"),
        Ok(_) => panic!("a cluster store answered a single-server connection"),
        Err(other) => panic!("expected a Config error, got {other:?}"),
    }
    // A RedisBloomFilter opened on one cluster node says it is standalone-only.
    let url = cluster_url().expect("set");
    let first = url
        .trim_start_matches("redis+cluster://")
        .split(',')
        .next()
        .expect("a node")
        .trim_end_matches('/');
    let client = redis::Client::open(format!("redis://{first}/")).expect("node url");
    let conn = client
        .get_connection_manager()
        .await
        .expect("node connection");
    match idemq_redis::RedisBloomFilter::open(conn, "cbf", 1000, 0.01).await {
        Err(StoreError::Config(m)) => assert!(m.contains("standalone-only"), "{m}"),
        other => panic!(
            "expected a Config error, got {:?}",
            other.map(|_| "a filter")
        ),
    }
}

/// Keys whose user part carries braces (a hash tag of their own), keys without any tag,
/// and hash-tagged groups: one batch spans many slots and all masters, and each key is
/// acquired, completed and then a duplicate.
#[tokio::test]
async fn batches_over_every_master_and_keys_with_braces_keep_the_contract() {
    for hash_tag in [false, true] {
        let Some(store) = cluster_store(&unique_prefix("spread"), hash_tag).await else {
            return;
        };
        let node_of = master_of_slot(&store).await;
        // 24 random groups: with hash tags each is one slot, and all 24 on two masters of
        // three has a probability of 3 * (2/3)^24, about 2e-5.
        let groups: Vec<ConsumerGroup> = (0..24)
            .map(|g| ConsumerGroup::new(&format!("g{g}-{:x}", FencingToken::random().0)).unwrap())
            .collect();
        let keys: Vec<DedupKey> = (0..600)
            .map(|i| {
                let name = match i % 3 {
                    0 => format!("order-{i}"),
                    1 => format!("order{{{}}}-{i}", i % 7),
                    _ => format!("{{}}x{{y}}{i}"),
                };
                DedupKey::new(&groups[i % groups.len()], &name).unwrap()
            })
            .collect();
        let nodes: HashSet<u16> = keys
            .iter()
            .map(|k| node_of(key_slot(store.redis_key(k).as_bytes())))
            .collect();
        assert_eq!(nodes.len(), 3, "the keys must span all three masters");
        let reqs: Vec<ClaimRequest> = keys
            .iter()
            .map(|k| ClaimRequest::new(k.clone(), LONG))
            .collect();
        let got = store.claim_batch(&reqs).await.expect("claims");
        let done = completions_of(&reqs, &got, LONG);
        let outcomes = store.complete_batch(&done).await.expect("completes");
        assert!(outcomes.iter().all(|o| *o == CompleteOutcome::Completed));
        let again = store.claim_batch(&reqs).await.expect("claims again");
        for (k, o) in keys.iter().zip(&again) {
            assert!(
                matches!(o, ClaimOutcome::Duplicate(_)),
                "{k} (hash_tag {hash_tag}): {o:?}"
            );
        }
    }
}

/// `list_stuck` and `purge_expired` scan every master (a `SCAN` of one node would find a
/// third of the keys), without CROSSSLOT errors.
#[tokio::test]
async fn list_stuck_and_purge_visit_every_master() {
    let Some(store) = cluster_store(&unique_prefix("scan"), false).await else {
        return;
    };
    let node_of = master_of_slot(&store).await;
    let g = ConsumerGroup::new("scan").unwrap();
    let keys: Vec<DedupKey> = (0..300)
        .map(|i| DedupKey::new(&g, &format!("k{i}")).unwrap())
        .collect();
    let reqs: Vec<ClaimRequest> = keys
        .iter()
        .map(|k| ClaimRequest::new(k.clone(), Duration::from_millis(1)))
        .collect();
    let got = store.claim_batch(&reqs).await.expect("claims");
    assert!(got.iter().all(|o| matches!(o, ClaimOutcome::Acquired(_))));
    tokio::time::sleep(Duration::from_millis(50)).await;
    let stuck = store
        .list_stuck(Duration::ZERO, 10_000)
        .await
        .expect("list_stuck");
    let found: HashSet<String> = stuck.iter().map(|r| r.key.to_string()).collect();
    for k in &keys {
        assert!(found.contains(&k.to_string()), "{k} not listed");
    }
    let nodes: HashSet<u16> = stuck
        .iter()
        .map(|r| node_of(key_slot(store.redis_key(&r.key).as_bytes())))
        .collect();
    assert_eq!(nodes.len(), 3, "stuck records come from every master");
    // Complete them with a retention already over: purge then deletes every one of them,
    // a bounded number per call.
    let done = completions_of(&reqs, &got, Duration::from_millis(1));
    store.complete_batch(&done).await.expect("completes");
    tokio::time::sleep(Duration::from_millis(50)).await;
    let first = store.purge_expired(100).await.expect("purge");
    assert!(first <= 100, "purged {first} with a limit of 100");
    let mut total = first;
    for _ in 0..20 {
        let n = store.purge_expired(100).await.expect("purge");
        assert!(n <= 100);
        total += n;
        if total >= 300 {
            break;
        }
    }
    assert_eq!(total, 300, "every expired record of every master is purged");
    for k in &keys {
        assert!(store.get(k).await.expect("get").is_none(), "{k} left");
    }
}

/// `WAIT 2` where each master has one replica: every durable write fails, retryably (no
/// ack), and nothing is reported acquired or completed.
#[tokio::test]
async fn too_few_replicas_fail_durable_writes_retryably() {
    let Some(url) = cluster_url() else { return };
    let store = RedisStore::builder(&url)
        .prefix(unique_prefix("wait2"))
        .fast_claims(true)
        .wait_replicas(2, Duration::from_millis(50))
        .connect()
        .await
        .expect("connect");
    let key = fresh_key("k");
    let err = store
        .claim(&ClaimRequest::new(key.clone(), LONG))
        .await
        .expect_err("WAIT 2 cannot be met");
    assert!(
        matches!(err, StoreError::Unavailable(ref m) if m.contains("WAIT 2")),
        "{err:?}"
    );
    assert!(err.is_retryable());
    // What the failed call acquired on the master was given back: the key is claimable at
    // once (not in flight until its lease ends).
    let plain = RedisStore::builder(&url)
        .prefix(store.prefix())
        .connect()
        .await
        .expect("connect");
    let again = plain
        .claim(&ClaimRequest::new(key.clone(), LONG))
        .await
        .expect("claim without WAIT");
    // (A released key's next claim counts as its second attempt.)
    assert!(matches!(again, ClaimOutcome::Acquired(_)), "{again:?}");
    // Through the claim script too.
    let scripted = RedisStore::builder(&url)
        .prefix(store.prefix())
        .wait_replicas(2, Duration::from_millis(50))
        .connect()
        .await
        .expect("connect");
    let err = scripted
        .claim(&ClaimRequest::new(fresh_key("s"), LONG))
        .await
        .expect_err("WAIT 2 cannot be met");
    assert!(err.is_retryable(), "{err:?}");
}

#[tokio::test]
async fn every_master_carries_an_incarnation_marker() {
    let Some(store) = cluster_store(&unique_prefix("inc"), false).await else {
        return;
    };
    let node_of = master_of_slot(&store).await;
    let keys = store.incarnation_keys();
    let nodes: HashSet<u16> = keys
        .iter()
        .map(|k| node_of(key_slot(k.as_bytes())))
        .collect();
    assert_eq!(nodes.len(), 3, "{keys:?}");
    store.check_incarnation().await.expect("markers intact");
    // Delete one master's marker: the loss is seen.
    let mut con = store.cluster_connection().expect("cluster");
    let _: i64 = redis::cmd("DEL")
        .arg(keys[1])
        .query_async(&mut con)
        .await
        .expect("DEL");
    assert!(store.check_incarnation().await.is_err());
    assert!(store.incarnation_lost());
}

/// A store over a cluster connection the application made (no seeds, so no connections of
/// its own: batches go through the cluster client, one pipeline per slot).
#[tokio::test]
async fn a_store_over_an_existing_cluster_connection_keeps_the_contract() {
    let Some(url) = cluster_url() else { return };
    let conn = redis::cluster::ClusterClient::new(cluster_seeds(&url))
        .expect("client")
        .get_async_connection()
        .await
        .expect("cluster connection");
    let store = RedisStore::builder("ignored")
        .prefix(unique_prefix("own-conn"))
        .fast_claims(true)
        .wait_replicas(1, Duration::from_secs(2))
        .with_cluster_connection(conn)
        .await
        .expect("store");
    let g = ConsumerGroup::new("own").unwrap();
    let reqs: Vec<ClaimRequest> = (0..100)
        .map(|i| ClaimRequest::new(DedupKey::new(&g, &format!("k{i}")).unwrap(), LONG))
        .collect();
    let got = store.claim_batch(&reqs).await.expect("claims");
    let done = completions_of(&reqs, &got, LONG);
    let outcomes = store.complete_batch(&done).await.expect("completes");
    assert!(outcomes.iter().all(|o| *o == CompleteOutcome::Completed));
    for o in store.claim_batch(&reqs).await.expect("claims again") {
        assert!(matches!(o, ClaimOutcome::Duplicate(_)), "{o:?}");
    }
}
