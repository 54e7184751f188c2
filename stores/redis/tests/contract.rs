//! The contract kit and Redis-specific behaviour of `RedisStore`, on the real server.

mod support;

use bytes::Bytes;
use idemq_core::{
    evaluate_claim, ClaimOutcome, ClaimRequest, ClaimVerdict, CompleteOutcome, Completion,
    ConsumerGroup, DedupKey, DedupRecord, DedupStore, ExtendOutcome, FencingToken, PayloadHash,
    RecordStatus, ReleaseOutcome, StoreError,
};
use idemq_redis::codec::encode_record;
use idemq_redis::RedisStore;
use redis::AsyncCommands;
use std::sync::Arc;
use std::time::Duration;
use support::*;

mod plain_keys {
    use super::*;
    idemq_core::store_contract_tests!(async { handles(4, &unique_prefix("kit"), false).await });
}

mod hash_tagged_keys {
    use super::*;
    idemq_core::store_contract_tests!(async { handles(4, &unique_prefix("kit-tag"), true).await });
}

/// Every claim through the claim script (what Redis < 7.0 gets).
mod scripted_claims {
    use super::*;
    idemq_core::store_contract_tests!(async {
        let p = unique_prefix("kit-lua");
        handles_with(4, |b| b.prefix(&p).hash_tag(true).fast_claims(false)).await
    });
}

const LONG: Duration = Duration::from_secs(60);

#[tokio::test]
async fn hostile_prefixes_are_config_errors_before_any_connection() {
    // No server needed: the prefix is checked before connecting (the port is closed).
    for bad in [
        "a b",
        "x*",
        "{",
        "}",
        "a\nb",
        "",
        "a:b",
        "pre?fix",
        "[abc]",
        &"p".repeat(65),
    ] {
        let err = RedisStore::builder("redis://127.0.0.1:1/")
            .prefix(bad)
            .connect()
            .await
            .expect_err("hostile prefix accepted");
        match err {
            StoreError::Config(msg) => assert!(msg.contains("prefix"), "{msg}"),
            other => panic!("{bad:?}: expected Config, got {other:?}"),
        }
    }
    let err = RedisStore::builder("not a url")
        .connect()
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Config(_)), "{err:?}");
}

/// At startup a refused connection is a configuration error naming the host and port (a
/// typo in the URL must not look like an outage to retry); see tests/store_urls.rs.
#[tokio::test]
async fn a_refused_connection_at_startup_names_host_and_port() {
    let err = RedisStore::builder("redis://127.0.0.1:1/")
        .connect_timeout(Duration::from_millis(300))
        .reconnect_retries(0)
        .connect()
        .await
        .expect_err("nothing listens on port 1");
    assert!(matches!(err, StoreError::Config(_)), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("127.0.0.1:1") && msg.contains("connection refused"),
        "{msg}"
    );
    assert!(!err.is_retryable());
}

#[tokio::test]
async fn keys_are_laid_out_under_the_prefix_with_optional_hash_tag() {
    let Some(url) = redis_url() else { return };
    let prefix = unique_prefix("layout");
    let g = ConsumerGroup::new("billing").unwrap();
    let key = DedupKey::new(&g, "order:42 {x}").unwrap();
    let plain = connect(&url, &prefix, false).await;
    let tagged = connect(&url, &prefix, true).await;
    assert_eq!(
        plain.redis_key(&key),
        format!("{prefix}:billing:order:42 {{x}}")
    );
    assert_eq!(
        tagged.redis_key(&key),
        format!("{prefix}:{{billing}}:order:42 {{x}}")
    );
    for s in [&plain, &tagged] {
        let rk = s.redis_key(&key);
        assert_eq!(s.dedup_key_of(rk.as_bytes()), Some(key.clone()));
    }
    let ClaimOutcome::Acquired(_) = tagged
        .claim(&ClaimRequest::new(key.clone(), LONG))
        .await
        .unwrap()
    else {
        panic!("fresh key")
    };
    let mut raw = raw(&url).await;
    let exists: bool = raw.exists(tagged.redis_key(&key)).await.unwrap();
    assert!(exists, "record stored at the hash-tagged key");
    tagged.forget(&key).await.unwrap();
}

#[tokio::test]
async fn ttls_outlive_the_lease_and_the_retention_by_the_grace() {
    let Some(url) = redis_url() else { return };
    let s = RedisStore::builder(&url)
        .prefix(unique_prefix("ttl"))
        .in_progress_grace(Duration::from_secs(100))
        .completed_grace(Duration::from_secs(20))
        .connect()
        .await
        .unwrap();
    let k = fresh_key("ttl");
    let mut raw = raw(&url).await;
    let ClaimOutcome::Acquired(l) = s
        .claim(&ClaimRequest::new(k.clone(), Duration::from_secs(10)))
        .await
        .unwrap()
    else {
        panic!()
    };
    let pttl: i64 = raw.pttl(s.redis_key(&k)).await.unwrap();
    assert!(
        (105_000..=110_000).contains(&pttl),
        "in progress: lease + grace, got {pttl}"
    );
    s.complete(&k, l.token, None, Duration::from_secs(1000))
        .await
        .unwrap();
    let pttl: i64 = raw.pttl(s.redis_key(&k)).await.unwrap();
    assert!(
        (1_015_000..=1_020_000).contains(&pttl),
        "completed: retention + grace, got {pttl}"
    );
}

/// The claim script applies exactly `evaluate_claim`'s rules, for every shape of record.
#[tokio::test]
async fn the_claim_script_matches_evaluate_claim_for_every_record_shape() {
    let Some(url) = redis_url() else { return };
    for fast in [true, false] {
        let s = RedisStore::builder(&url)
            .prefix(unique_prefix("rules"))
            .fast_claims(fast)
            .connect()
            .await
            .unwrap();
        assert_eq!(s.fast_claims(), fast);
        claims_match_evaluate_claim(&url, &s).await;
    }
}

async fn claims_match_evaluate_claim(url: &str, s: &RedisStore) {
    let mut raw = raw(url).await;
    let a = PayloadHash::of(b"a");
    let b = PayloadHash::of(b"b");
    let now = idemq_core::now_ms();
    let hour = 3_600_000;
    // (status, lease_until, expires)
    let shapes = [
        ("live lease", RecordStatus::InProgress, now + hour, None),
        ("expired lease", RecordStatus::InProgress, now - hour, None),
        ("released", RecordStatus::InProgress, 0, None),
        (
            "completed",
            RecordStatus::Completed,
            now - hour,
            Some(now + hour),
        ),
        (
            "retention over",
            RecordStatus::Completed,
            now - 2 * hour,
            Some(now - hour),
        ),
    ];
    let mut cases = 0;
    for (name, status, lease_until_ms, expires_ms) in shapes {
        for stored in [None, Some(a)] {
            for given in [None, Some(a), Some(b)] {
                let k = fresh_key(name);
                let rec = DedupRecord {
                    key: k.clone(),
                    status,
                    token: FencingToken::random(),
                    lease_until_ms,
                    attempts: 3,
                    payload_hash: stored,
                    result: Some(Bytes::from_static(b"r\x00")),
                    first_seen_ms: now - 3 * hour,
                    completed_ms: expires_ms.map(|_| now - hour),
                    expires_ms,
                    worker: Some("w".into()),
                };
                let _: () = raw
                    .set_ex(s.redis_key(&k), encode_record(&rec), 60)
                    .await
                    .unwrap();
                let mut req = ClaimRequest::new(k.clone(), LONG).with_worker("me");
                req.payload_hash = given;
                let got = s.claim(&req).await.unwrap();
                let want = evaluate_claim(Some(&rec), given.as_ref(), idemq_core::now_ms());
                let ctx = format!("{name}, stored {stored:?}, given {given:?}");
                match (want, &got) {
                    (ClaimVerdict::AcquireFresh, ClaimOutcome::Acquired(l)) => {
                        assert_eq!((l.attempt, l.takeover), (1, false), "{ctx}");
                        let r = s.get(&k).await.unwrap().unwrap();
                        assert_eq!(r.first_seen_ms, l.until_ms - 60_000, "{ctx}: new lifecycle");
                    }
                    (ClaimVerdict::TakeOver, ClaimOutcome::Acquired(l)) => {
                        assert_eq!(l.attempt, 4, "{ctx}");
                        assert_eq!(l.takeover, lease_until_ms > 0, "{ctx}");
                        let r = s.get(&k).await.unwrap().unwrap();
                        assert_eq!(r.first_seen_ms, rec.first_seen_ms, "{ctx}: same lifecycle");
                        assert_eq!(r.payload_hash, given, "{ctx}");
                        assert_eq!(r.worker.as_deref(), Some("me"), "{ctx}");
                        assert_eq!(r.result, None, "{ctx}");
                    }
                    (ClaimVerdict::Answer(w), g) => assert_eq!(&w, g, "{ctx}"),
                    (w, g) => panic!("{ctx}: evaluate_claim says {w:?}, script answered {g:?}"),
                }
                cases += 1;
            }
        }
    }
    assert_eq!(cases, 30);
}

#[tokio::test]
async fn a_foreign_value_is_corrupt_and_the_rest_of_the_batch_is_released() {
    let Some(url) = redis_url() else { return };
    for fast in [true, false] {
        let s = RedisStore::builder(&url)
            .prefix(unique_prefix("corrupt"))
            .fast_claims(fast)
            .connect()
            .await
            .unwrap();
        foreign_values_are_corrupt(&url, &s).await;
    }
}

async fn foreign_values_are_corrupt(url: &str, s: &RedisStore) {
    let mut raw = raw(url).await;
    let bad = fresh_key("bad");
    let wrong_type = fresh_key("hash");
    let good = fresh_key("good");
    let _: () = raw.set_ex(s.redis_key(&bad), "hello", 60).await.unwrap();
    let _: () = raw.hset(s.redis_key(&wrong_type), "f", "v").await.unwrap();
    for k in [&bad, &wrong_type] {
        let reqs = [
            ClaimRequest::new(good.clone(), LONG),
            ClaimRequest::new(k.clone(), LONG),
        ];
        match s.claim_batch(&reqs).await {
            Err(StoreError::Corrupt { key, .. }) => assert_eq!(key, k.to_string()),
            other => panic!("expected Corrupt, got {other:?}"),
        }
        // The good key's lease was given back: claimable at once, not InFlight.
        let ClaimOutcome::Acquired(l) = s.claim(&reqs[0]).await.unwrap() else {
            panic!("the batch's other lease must have been released")
        };
        assert_eq!(
            s.release(&good, l.token).await.unwrap(),
            ReleaseOutcome::Released
        );
        assert!(matches!(
            s.get(k).await,
            Err(StoreError::Corrupt { .. }) | Err(StoreError::Backend(_))
        ));
        let c = Completion {
            key: k.clone(),
            token: l.token,
            result: None,
            retention: LONG,
        };
        assert!(matches!(
            s.complete_batch(&[c]).await,
            Err(StoreError::Corrupt { .. })
        ));
        assert!(matches!(
            s.release(k, l.token).await,
            Err(StoreError::Corrupt { .. })
        ));
        assert!(matches!(
            s.extend(k, l.token, LONG).await,
            Err(StoreError::Corrupt { .. })
        ));
    }
    let _: () = raw
        .del(&[s.redis_key(&bad), s.redis_key(&wrong_type)])
        .await
        .unwrap();
}

/// After `SCRIPT FLUSH` (what a restart does to the script cache) every operation reloads
/// its script and answers normally, including a pipelined multi-group batch.
#[tokio::test]
async fn operations_survive_a_flushed_script_cache() {
    let Some(url) = redis_url() else { return };
    let s = RedisStore::builder(&url)
        .prefix(unique_prefix("noscript"))
        .hash_tag(true)
        .fast_claims(false)
        .max_keys_per_script(3)
        .connect()
        .await
        .unwrap();
    let mut raw = raw(&url).await;
    let keys: Vec<DedupKey> = (0..10).map(|i| fresh_key(&format!("k{i}"))).collect();
    let reqs: Vec<ClaimRequest> = keys
        .iter()
        .map(|k| ClaimRequest::new(k.clone(), LONG))
        .collect();
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut raw)
        .await
        .unwrap();
    let out = s.claim_batch(&reqs).await.unwrap();
    let items: Vec<Completion> = out
        .iter()
        .zip(&keys)
        .map(|(o, k)| match o {
            ClaimOutcome::Acquired(l) => Completion {
                key: k.clone(),
                token: l.token,
                result: None,
                retention: LONG,
            },
            o => panic!("{o:?}"),
        })
        .collect();
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert!(s
        .complete_batch(&items)
        .await
        .unwrap()
        .iter()
        .all(|o| *o == CompleteOutcome::Completed));
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(
        s.release(&keys[0], items[0].token).await.unwrap(),
        ReleaseOutcome::Fenced
    );
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(
        s.extend(&keys[0], items[0].token, LONG).await.unwrap(),
        ExtendOutcome::Fenced
    );
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(s.purge_expired(10).await.unwrap(), 0);
    assert!(matches!(
        s.claim(&reqs[0]).await.unwrap(),
        ClaimOutcome::Duplicate(_)
    ));
}

/// Batches larger than one script, and spanning several groups, answer like single claims.
#[tokio::test]
async fn large_multi_group_batches_answer_in_order() {
    let Some(url) = redis_url() else { return };
    for (hash_tag, fast) in [(false, true), (true, true), (false, false), (true, false)] {
        let s = RedisStore::builder(&url)
            .prefix(unique_prefix("big"))
            .hash_tag(hash_tag)
            .fast_claims(fast)
            .max_keys_per_script(7)
            .connect()
            .await
            .unwrap();
        let groups: Vec<ConsumerGroup> = (0..3)
            .map(|i| ConsumerGroup::new(&format!("grp{i}-{:x}", FencingToken::random().0)).unwrap())
            .collect();
        let keys: Vec<DedupKey> = (0..100)
            .map(|i| DedupKey::new(&groups[i % 3], &format!("k{i}")).unwrap())
            .collect();
        // Complete every third key first.
        for k in keys.iter().step_by(3) {
            let ClaimOutcome::Acquired(l) =
                s.claim(&ClaimRequest::new(k.clone(), LONG)).await.unwrap()
            else {
                panic!()
            };
            s.complete(k, l.token, Some(Bytes::from(k.to_string())), LONG)
                .await
                .unwrap();
        }
        let reqs: Vec<ClaimRequest> = keys
            .iter()
            .map(|k| ClaimRequest::new(k.clone(), LONG))
            .collect();
        let out = s.claim_batch(&reqs).await.unwrap();
        assert_eq!(out.len(), keys.len());
        for (i, (k, o)) in keys.iter().zip(&out).enumerate() {
            match o {
                ClaimOutcome::Duplicate(r) if i % 3 == 0 => {
                    assert_eq!(&r.key, k);
                    assert_eq!(r.result.as_deref(), Some(k.as_str().as_bytes()));
                }
                ClaimOutcome::Acquired(l) if i % 3 != 0 => assert_eq!(l.attempt, 1),
                o => panic!("key {i} ({k}): {o:?}"),
            }
        }
    }
}

/// Worker names, results and keys with separators and binary bytes survive the encoding.
#[tokio::test]
async fn odd_bytes_round_trip() {
    let Some(url) = redis_url() else { return };
    let s = connect(&url, &unique_prefix("bytes"), true).await;
    let g = ConsumerGroup::new("odd").unwrap();
    let k = DedupKey::new(&g, &format!("a|b:{{c}}\n* {:x}", FencingToken::random().0)).unwrap();
    let req = ClaimRequest::new(k.clone(), LONG)
        .with_worker("host|1:ü")
        .with_payload_hash(PayloadHash::of(b"p"));
    let ClaimOutcome::Acquired(l) = s.claim(&req).await.unwrap() else {
        panic!()
    };
    let result = Bytes::from_static(b"|-+\x00\xff\n");
    s.complete(&k, l.token, Some(result.clone()), LONG)
        .await
        .unwrap();
    let r = s.get(&k).await.unwrap().unwrap();
    assert_eq!(r.result, Some(result));
    assert_eq!(r.worker.as_deref(), Some("host|1:ü"));
    assert_eq!(r.payload_hash, Some(PayloadHash::of(b"p")));
    assert!(s.forget(&k).await.unwrap());
}

#[tokio::test]
async fn handles_share_one_keyspace_and_prefixes_isolate() {
    let Some(url) = redis_url() else { return };
    let p1 = unique_prefix("iso");
    let a: Arc<dyn DedupStore> = Arc::new(connect(&url, &p1, false).await);
    let b: Arc<dyn DedupStore> = Arc::new(connect(&url, &p1, false).await);
    let other: Arc<dyn DedupStore> = Arc::new(connect(&url, &unique_prefix("iso"), false).await);
    let k = fresh_key("shared");
    let req = ClaimRequest::new(k.clone(), LONG);
    assert!(matches!(
        a.claim(&req).await.unwrap(),
        ClaimOutcome::Acquired(_)
    ));
    assert!(matches!(
        b.claim(&req).await.unwrap(),
        ClaimOutcome::InFlight { .. }
    ));
    assert!(matches!(
        other.claim(&req).await.unwrap(),
        ClaimOutcome::Acquired(_)
    ));
}

/// `purge_expired` examines a bounded number of keys per call and resumes where it stopped.
#[tokio::test]
async fn purge_is_bounded_and_resumes_its_scan() {
    let Some(url) = redis_url() else { return };
    // A database of its own: SCAN work follows the database's size.
    let url = with_db(&url, 9);
    assert!(url.ends_with(":22379/9") || url.ends_with("/9"), "{url}");
    let s = RedisStore::builder(&url)
        .prefix(unique_prefix("purge"))
        .scan_count(10)
        .purge_scan_budget(10)
        .connect()
        .await
        .unwrap();
    let keys: Vec<DedupKey> = (0..60).map(|i| fresh_key(&format!("p{i}"))).collect();
    let reqs: Vec<ClaimRequest> = keys
        .iter()
        .map(|k| ClaimRequest::new(k.clone(), LONG))
        .collect();
    let items: Vec<Completion> = s
        .claim_batch(&reqs)
        .await
        .unwrap()
        .into_iter()
        .zip(&keys)
        .map(|(o, k)| match o {
            ClaimOutcome::Acquired(l) => Completion {
                key: k.clone(),
                token: l.token,
                result: None,
                retention: Duration::from_millis(50),
            },
            o => panic!("{o:?}"),
        })
        .collect();
    s.complete_batch(&items).await.unwrap();
    tokio::time::sleep(Duration::from_millis(150)).await;
    let (mut total, mut calls) = (0, 0);
    while total < 60 {
        let n = s.purge_expired(1000).await.unwrap();
        assert!(n <= 40, "a call examines ~10 slots, deleted {n}");
        total += n;
        calls += 1;
        assert!(calls < 200, "purge makes no progress ({total} of 60)");
    }
    assert_eq!(total, 60);
    assert!(calls > 1, "the work was split over several calls");
    for k in &keys {
        assert!(s.get(k).await.unwrap().is_none());
    }
}
