//! `LayeredStore` over `RedisStore`, and the RedisBloom pre-filter, on the real server.
#![cfg(feature = "bloom")]

mod support;

use idemq_core::testkit::switchable::SwitchableStore;
use idemq_core::{
    ClaimOutcome, ClaimRequest, CompleteOutcome, Completion, DedupKey, DedupStore, MemoryStore,
};
use idemq_layered::{FallbackGate, LayeredStore, LocalBloom, Novelty, PreFilter};
use idemq_redis::{redisbloom_loaded, RedisBloomFilter, RedisStore};
use redis::AsyncCommands;
use std::sync::Arc;
use std::time::Duration;
use support::*;

const LONG: Duration = Duration::from_secs(60);

mod kit_layers_over_redis {
    use super::*;
    idemq_core::store_contract_tests!(async {
        let prefix = unique_prefix("lay");
        let stores = handles(4, &prefix, true).await?;
        Some(
            stores
                .into_iter()
                .map(|s| Arc::new(LayeredStore::new(s)) as Arc<dyn DedupStore>)
                .collect(),
        )
    });
}

mod kit_shared_layer_with_redisbloom_and_fallback {
    use super::*;
    idemq_core::store_contract_tests!(async {
        let prefix = unique_prefix("lay-bf");
        let stores = handles(4, &prefix, false).await?;
        let filter = filter_for(&stores_conn(&prefix).await, &prefix).await;
        let mut out: Vec<Arc<dyn DedupStore>> = Vec::new();
        let fallback: Arc<dyn DedupStore> = Arc::new(MemoryStore::new());
        for s in stores {
            let l = LayeredStore::builder(s)
                .prefilter(filter.clone())
                .fallback(fallback.clone(), FallbackGate::NeverSeenKeys)
                .reconcile_after_outage(true)
                .build()
                .expect("config");
            out.push(Arc::new(l));
        }
        Some(out)
    });
}

async fn stores_conn(prefix: &str) -> RedisStore {
    let url = redis_url().expect("url checked by handles()");
    connect(&url, prefix, false).await
}

/// The RedisBloom filter when the module is loaded, a local bloom otherwise.
async fn filter_for(store: &RedisStore, name: &str) -> Arc<dyn PreFilter> {
    let conn = store.connection().expect("standalone store");
    if redisbloom_loaded(&conn).await.expect("MODULE LIST") {
        Arc::new(
            RedisBloomFilter::open(conn, name, 10_000, 0.001)
                .await
                .expect("open filter"),
        )
    } else {
        eprintln!("RedisBloom not loaded: using a local bloom");
        Arc::new(LocalBloom::new(10_000, 0.001))
    }
}

/// The RedisBloom filter, or `None` (skip, with a note) when the server lacks the module.
async fn redisbloom(
    store: &RedisStore,
    name: &str,
    capacity: u64,
    rate: f64,
) -> Option<RedisBloomFilter> {
    let conn = store.connection().expect("standalone store");
    if !redisbloom_loaded(&conn).await.expect("MODULE LIST") {
        eprintln!("skipping: the Redis server has no RedisBloom module (scripts/servers.sh loads it when it can)");
        return None;
    }
    Some(
        RedisBloomFilter::open(conn, name, capacity, rate)
            .await
            .expect("open filter"),
    )
}

#[tokio::test]
async fn the_module_is_detected_not_assumed() {
    let Some(url) = redis_url() else { return };
    let s = connect(&url, &unique_prefix("mod"), false).await;
    let mut raw = raw(&url).await;
    let listed: redis::Value = redis::cmd("MODULE")
        .arg("LIST")
        .query_async(&mut raw)
        .await
        .unwrap();
    let has_bf = format!("{listed:?}").contains("bf");
    assert_eq!(
        redisbloom_loaded(&s.connection().expect("standalone store"))
            .await
            .unwrap(),
        has_bf
    );
    eprintln!("RedisBloom loaded: {has_bf}");
}

#[tokio::test]
async fn redisbloom_answers_never_seen_only_for_new_keys() {
    let Some(url) = redis_url() else { return };
    let prefix = unique_prefix("bf");
    let s = connect(&url, &prefix, false).await;
    let Some(f) = redisbloom(&s, &prefix, 10_000, 0.001).await else {
        return;
    };
    let keys: Vec<DedupKey> = (0..500).map(|i| fresh_key(&format!("k{i}"))).collect();
    let first = f.insert(&keys).await.unwrap();
    assert!(
        first.iter().filter(|n| n.is_never_seen()).count() >= 495,
        "fresh keys are new"
    );
    assert!(f
        .insert(&keys)
        .await
        .unwrap()
        .iter()
        .all(|n| *n == Novelty::MaybeSeen));
    assert!(f
        .check(&keys)
        .await
        .unwrap()
        .iter()
        .all(|n| *n == Novelty::MaybeSeen));
    let others: Vec<DedupKey> = (0..2000).map(|i| fresh_key(&format!("o{i}"))).collect();
    let fp = f
        .check(&others)
        .await
        .unwrap()
        .iter()
        .filter(|n| !n.is_never_seen())
        .count();
    assert!(fp < 40, "false positives {fp}/2000 at 0.1%");
    // Reopening by name finds the same filter.
    let again = redisbloom(&s, &prefix, 10_000, 0.001).await.unwrap();
    assert!(again
        .check(&keys[..10])
        .await
        .unwrap()
        .iter()
        .all(|n| *n == Novelty::MaybeSeen));
}

/// A filter lost with its data (what a restart without persistence does) is an error, not
/// "every key never seen"; an insert does not silently recreate it.
#[tokio::test]
async fn a_lost_redisbloom_filter_fails_instead_of_calling_every_key_new() {
    let Some(url) = redis_url() else { return };
    let prefix = unique_prefix("bf-lost");
    let s = connect(&url, &prefix, false).await;
    let Some(f) = redisbloom(&s, &prefix, 1000, 0.01).await else {
        return;
    };
    let k = vec![fresh_key("seen")];
    f.insert(&k).await.unwrap();
    let mut raw = raw(&url).await;
    let _: () = raw.del(f.filter_key()).await.unwrap();
    assert!(f.check(&k).await.is_err());
    assert!(f.insert(&k).await.is_err());
    let exists: bool = raw.exists(f.filter_key()).await.unwrap();
    assert!(!exists, "insert must not recreate a lost filter");
    // Opening again refuses too, until the marker is removed on purpose.
    let conn = s.connection().expect("standalone store");
    assert!(RedisBloomFilter::open(conn.clone(), &prefix, 1000, 0.01)
        .await
        .is_err());
    let _: () = raw.del(format!("{{{prefix}}}:incarnation")).await.unwrap();
    let fresh = RedisBloomFilter::open(conn, &prefix, 1000, 0.01)
        .await
        .unwrap();
    assert!(fresh.check(&k).await.unwrap()[0].is_never_seen());
}

/// A saturated RedisBloom filter (every probe positive) never skips a fresh message.
#[tokio::test]
async fn a_saturated_redisbloom_filter_never_skips_a_fresh_message() {
    let Some(url) = redis_url() else { return };
    let prefix = unique_prefix("bf-sat");
    let redis_store = connect(&url, &prefix, true).await;
    let Some(f) = redisbloom(&redis_store, &prefix, 1000, 0.01).await else {
        return;
    };
    // Saturate: dump the filter (BF.SCANDUMP), set every bit of its data chunks, load it back.
    // (RedisBloom scales into new sub-filters instead of filling one up, so inserting
    // items would never get there.)
    let mut raw = raw(&url).await;
    let mut chunks: Vec<(i64, Vec<u8>)> = Vec::new();
    let mut it = 0i64;
    loop {
        let (next, data): (i64, Vec<u8>) = redis::cmd("BF.SCANDUMP")
            .arg(f.filter_key())
            .arg(it)
            .query_async(&mut raw)
            .await
            .unwrap();
        if next == 0 {
            break;
        }
        chunks.push((next, data));
        it = next;
    }
    assert!(chunks.len() >= 2, "header chunk and data chunks");
    for (_, data) in chunks.iter_mut().skip(1) {
        data.iter_mut().for_each(|b| *b = 0xff);
    }
    let _: () = raw.del(f.filter_key()).await.unwrap();
    for (i, data) in &chunks {
        let _: () = redis::cmd("BF.LOADCHUNK")
            .arg(f.filter_key())
            .arg(*i)
            .arg(data.as_slice())
            .query_async(&mut raw)
            .await
            .unwrap();
    }
    let probes: Vec<DedupKey> = (0..300).map(|i| fresh_key(&format!("probe{i}"))).collect();
    assert!(
        f.check(&probes)
            .await
            .unwrap()
            .iter()
            .all(|p| *p == Novelty::MaybeSeen),
        "every probe of a saturated filter is positive"
    );
    let primary = Arc::new(SwitchableStore::new(Arc::new(redis_store)));
    let s = LayeredStore::builder(primary.clone())
        .prefilter(Arc::new(f))
        .fallback(Arc::new(MemoryStore::new()), FallbackGate::NeverSeenKeys)
        .build()
        .unwrap();
    for k in &probes[..150] {
        match s.claim(&ClaimRequest::new(k.clone(), LONG)).await.unwrap() {
            ClaimOutcome::Acquired(l) => {
                s.complete(k, l.token, None, LONG).await.unwrap();
            }
            o => panic!("fresh {k} with a saturated filter: {o:?}"),
        }
    }
    primary.set_down(true);
    let reqs: Vec<ClaimRequest> = probes[150..]
        .iter()
        .map(|k| ClaimRequest::new(k.clone(), LONG))
        .collect();
    for o in s.claim_batch(&reqs).await.unwrap() {
        assert!(
            matches!(o, ClaimOutcome::InFlight { .. }),
            "outage: refuse, never skip: {o:?}"
        );
    }
    primary.set_down(false);
    for o in s.claim_batch(&reqs).await.unwrap() {
        assert!(matches!(o, ClaimOutcome::Acquired(_)), "{o:?}");
    }
}

/// The cache answers duplicates without a round trip to Redis; fresh keys always go there.
#[tokio::test]
async fn the_cache_spares_round_trips_for_duplicates_only() {
    let Some(url) = redis_url() else { return };
    let redis_store: Arc<dyn DedupStore> =
        Arc::new(connect(&url, &unique_prefix("lay-c"), false).await);
    let s = LayeredStore::new(redis_store.clone());
    let keys: Vec<DedupKey> = (0..200).map(|i| fresh_key(&format!("c{i}"))).collect();
    let reqs: Vec<ClaimRequest> = keys
        .iter()
        .map(|k| ClaimRequest::new(k.clone(), LONG))
        .collect();
    let out = s.claim_batch(&reqs).await.unwrap();
    let items: Vec<Completion> = out
        .iter()
        .zip(&keys)
        .map(|(o, k)| match o {
            ClaimOutcome::Acquired(l) => Completion {
                key: k.clone(),
                token: l.token,
                result: Some("r".into()),
                retention: LONG,
            },
            o => panic!("{o:?}"),
        })
        .collect();
    assert!(s
        .complete_batch(&items)
        .await
        .unwrap()
        .iter()
        .all(|o| *o == CompleteOutcome::Completed));
    let before = s.stats();
    for _ in 0..5 {
        for o in s.claim_batch(&reqs).await.unwrap() {
            assert!(
                matches!(o, ClaimOutcome::Duplicate(ref r) if r.result.as_deref() == Some(&b"r"[..]))
            );
        }
    }
    let after = s.stats();
    assert_eq!(
        after.primary_claims, before.primary_claims,
        "no round trip for cached duplicates"
    );
    assert_eq!(after.cache_hits - before.cache_hits, 1000);
    // A redelivery seen by another process's layer gets its answer from Redis, then caches it.
    let other = LayeredStore::new(redis_store);
    assert!(matches!(
        other.claim(&reqs[0]).await.unwrap(),
        ClaimOutcome::Duplicate(_)
    ));
    assert!(other.is_cached_duplicate(&keys[0]));
}
