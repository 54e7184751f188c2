//! Hostile bucket names and prefixes are refused before any connection; any dedup key,
//! whatever bytes it holds, gets a KV key of its own (encoded, never refused, never
//! colliding with another).

mod support;

use bytes::Bytes;
use idemq_core::{
    ClaimOutcome, ClaimRequest, CompleteOutcome, ConsumerGroup, DedupKey, DedupStore, StoreError,
};
use idemq_nats_kv::{NatsKvOptions, NatsKvStore};
use rand::SeedableRng;
use std::collections::{HashMap, HashSet};
use std::time::Duration;
use support::*;

#[tokio::test]
async fn hostile_bucket_names_and_prefixes_are_config_errors_before_any_connection() {
    // Nothing listens on port 1: a name error must come first, naming what is wrong.
    let long = "b".repeat(65);
    for bad in [
        "", "a.b", "a b", "x*", ">", "a>b", "a\nb", "$KV", "a/b", &long,
    ] {
        for (what, opts) in [
            (
                "bucket",
                NatsKvOptions {
                    bucket: bad.to_string(),
                    ..NatsKvOptions::default()
                },
            ),
            (
                "prefix",
                NatsKvOptions {
                    prefix: bad.to_string(),
                    ..NatsKvOptions::default()
                },
            ),
        ] {
            let e = NatsKvStore::connect("nats://127.0.0.1:1", opts)
                .await
                .expect_err("hostile name accepted");
            match e {
                StoreError::Config(msg) => assert!(
                    msg.contains(what) && msg.contains(&format!("{bad:?}")),
                    "{what} {bad:?}: {msg}"
                ),
                other => panic!("{what} {bad:?}: expected Config, got {other:?}"),
            }
        }
    }
    // The same through a nats-kv:// URL.
    for url in [
        "nats-kv://127.0.0.1:1/a.b",
        "nats-kv://127.0.0.1:1/ok?prefix=x*",
    ] {
        let e = NatsKvStore::connect(url, NatsKvOptions::default())
            .await
            .expect_err(url);
        assert!(matches!(e, StoreError::Config(_)), "{url}: {e:?}");
    }
    // A refused connection at start-up names the server.
    let e = NatsKvStore::connect(
        "nats://127.0.0.1:1",
        NatsKvOptions {
            connect_timeout: Duration::from_millis(300),
            ..NatsKvOptions::default()
        },
    )
    .await
    .expect_err("nothing listens on port 1");
    assert!(e.to_string().contains("127.0.0.1:1"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_of_any_bytes_get_distinct_records() {
    let Some(url) = single_url() else { return };
    let s = store(&url, options("idemq_test", &unique_prefix("keys"), 1)).await;
    let g = ConsumerGroup::new(&unique_prefix("g")).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    // Keys that differ only where an encoding could merge them, and random text.
    let mut names: Vec<String> = [
        "",
        ".",
        "..",
        "a.b",
        "a=2Eb",
        "a b",
        "a\u{0}b",
        "*",
        ">",
        "a.*.>",
        "=",
        "==",
        "=H",
        "a/b",
        "a\\b",
        "é",
        "\u{1F600}",
        "a\tb",
        "a\nb",
        "$KV.x.y",
        "-",
        "_",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    names.extend((0..150).map(|_| idemq_core::testkit::fuzz::text(&mut rng, 40)));
    names.push("x".repeat(300)); // hashed by DedupKey::new
    let mut seen = HashSet::new();
    let keys: Vec<DedupKey> = names
        .iter()
        .filter_map(|n| DedupKey::new(&g, n).ok())
        .filter(|k| seen.insert(k.clone()))
        .collect();
    assert!(keys.len() > 150, "{} keys", keys.len());
    let kv: HashSet<String> = keys.iter().map(|k| s.kv_key(k)).collect();
    assert_eq!(kv.len(), keys.len(), "two dedup keys share a KV key");
    let reqs: Vec<ClaimRequest> = keys
        .iter()
        .map(|k| ClaimRequest::new(k.clone(), Duration::from_secs(60)))
        .collect();
    let mut tokens = HashMap::new();
    for (k, o) in keys
        .iter()
        .zip(s.claim_batch(&reqs).await.expect("claim_batch"))
    {
        match o {
            ClaimOutcome::Acquired(l) => {
                tokens.insert(k.clone(), l.token);
            }
            o => panic!("{k:?}: a distinct key must be fresh, got {o:?}"),
        }
    }
    for k in &keys {
        let result = Bytes::from(k.as_str().as_bytes().to_vec());
        assert_eq!(
            s.complete(k, tokens[k], Some(result), Duration::from_secs(60))
                .await
                .expect("complete"),
            CompleteOutcome::Completed
        );
    }
    for k in &keys {
        let r = s.get(k).await.expect("get").expect("record");
        assert_eq!(&r.key, k);
        assert_eq!(r.result.as_deref(), Some(k.as_str().as_bytes()), "{k:?}");
    }
    // A scan of the prefix finds each of them once.
    let st = s.stats().await.expect("stats");
    assert_eq!(
        (st.completed, st.total()),
        (keys.len() as u64, keys.len() as u64),
        "{st:?}"
    );
}
