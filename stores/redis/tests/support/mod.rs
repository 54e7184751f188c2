//! Shared fixtures of the Redis integration tests.
//!
//! `IDEMQ_TEST_REDIS_URL` names the server (`eval "$(scripts/servers.sh env)"`). When it is
//! unset the tests are skipped with a note on stderr, unless `IDEMQ_REQUIRE_SERVERS=1`
//! (CI), which turns the missing server into a failure.
#![allow(dead_code)]

use idemq_core::{
    ClaimOutcome, ClaimRequest, Completion, ConsumerGroup, DedupKey, DedupStore, FencingToken,
};
use idemq_redis::{RedisStore, RedisStoreBuilder};
use std::path::PathBuf;
use std::sync::Arc;

/// The Redis URL, or `None` (skip) when none is configured and servers are not required.
pub fn redis_url() -> Option<String> {
    env_url("IDEMQ_TEST_REDIS_URL")
}

/// The Redis Cluster URL (`IDEMQ_REDIS_CLUSTER_URL`, `redis+cluster://...`), or `None`
/// (skip) when none is configured and servers are not required.
pub fn cluster_url() -> Option<String> {
    env_url("IDEMQ_REDIS_CLUSTER_URL")
}

/// The URL in `var`, or `None` when the test must not run (`idemq_core::testkit::servers`).
fn env_url(var: &str) -> Option<String> {
    idemq_core::testkit::servers::server_url(var)
}

/// A unique key prefix per test run, so parallel tests and leftovers never meet.
pub fn unique_prefix(tag: &str) -> String {
    format!(
        "t-{tag}-{:012x}",
        FencingToken::random().0 & 0xffff_ffff_ffff
    )
}

/// A store with its own connection manager.
pub async fn store(prefix: &str, hash_tag: bool) -> Option<RedisStore> {
    let url = redis_url()?;
    Some(connect(&url, prefix, hash_tag).await)
}

/// Connects, failing the test with the reason if the configured server does not answer.
pub async fn connect(url: &str, prefix: &str, hash_tag: bool) -> RedisStore {
    RedisStore::builder(url)
        .prefix(prefix)
        .hash_tag(hash_tag)
        .connect()
        .await
        .unwrap_or_else(|e| panic!("cannot connect to the configured Redis {url}: {e}"))
}

/// `n` handles on one keyspace, each with its own connection manager.
pub async fn handles(n: usize, prefix: &str, hash_tag: bool) -> Option<Vec<Arc<dyn DedupStore>>> {
    handles_with(n, |b| b.prefix(prefix).hash_tag(hash_tag)).await
}

/// `n` handles configured by `f`, each with its own connection manager.
pub async fn handles_with(
    n: usize,
    f: impl Fn(RedisStoreBuilder) -> RedisStoreBuilder,
) -> Option<Vec<Arc<dyn DedupStore>>> {
    Some(handles_at(&redis_url()?, n, f).await)
}

/// `n` handles on one keyspace of the Redis Cluster, each with its own cluster connection.
pub async fn cluster_handles_with(
    n: usize,
    f: impl Fn(RedisStoreBuilder) -> RedisStoreBuilder,
) -> Option<Vec<Arc<dyn DedupStore>>> {
    Some(handles_at(&cluster_url()?, n, f).await)
}

/// `n` handles on `url` configured by `f`; fails the test if the server does not answer.
pub async fn handles_at(
    url: &str,
    n: usize,
    f: impl Fn(RedisStoreBuilder) -> RedisStoreBuilder,
) -> Vec<Arc<dyn DedupStore>> {
    let mut v: Vec<Arc<dyn DedupStore>> = Vec::with_capacity(n);
    for _ in 0..n {
        let s = f(RedisStore::builder(url))
            .connect()
            .await
            .unwrap_or_else(|e| panic!("cannot connect to the configured Redis {url}: {e}"));
        v.push(Arc::new(s));
    }
    v
}

/// A key in a fresh random group.
pub fn fresh_key(name: &str) -> DedupKey {
    let g = ConsumerGroup::new(&format!("g-{:016x}", FencingToken::random().0)).expect("group");
    DedupKey::new(&g, name).expect("key")
}

/// The workspace root, from this crate's manifest dir (`stores/redis`).
pub fn repo_root() -> PathBuf {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    here.ancestors()
        .nth(2)
        .map(PathBuf::from)
        .expect("stores/redis has a workspace root two levels up")
}

/// Restarts the real redis-server through `scripts/servers.sh restart-redis`.
pub fn restart_redis() {
    let script = repo_root().join("scripts").join("servers.sh");
    let out = std::process::Command::new(&script)
        .arg("restart-redis")
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
    assert!(
        out.status.success(),
        "{} restart-redis failed: {}\n{}",
        script.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A raw connection for poking at the keyspace.
pub async fn raw(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .expect("url")
        .get_multiplexed_async_connection()
        .await
        .expect("raw connection")
}

/// The same server with another logical database (`/db`), for tests that need a keyspace
/// of their own (a `SCAN` walks the whole database).
pub fn with_db(url: &str, db: u8) -> String {
    let base = url.trim_end_matches('/');
    let base = match base.rsplit_once('/') {
        Some((head, tail))
            if !tail.is_empty()
                && tail.bytes().all(|b| b.is_ascii_digit())
                && head.ends_with(|c: char| c != '/') =>
        {
            head
        }
        _ => base,
    };
    format!("{base}/{db}")
}

/// Completions of every request of a batch, each with the token its claim acquired
/// (panics naming the key when one was not acquired).
pub fn completions_of(
    reqs: &[ClaimRequest],
    got: &[ClaimOutcome],
    retention: std::time::Duration,
) -> Vec<Completion> {
    reqs.iter()
        .zip(got)
        .map(|(r, o)| match o {
            ClaimOutcome::Acquired(l) => Completion {
                key: r.key.clone(),
                token: l.token,
                result: None,
                retention,
            },
            other => panic!("{}: expected Acquired, got {other:?}", r.key),
        })
        .collect()
}

/// The seed node URLs of a `redis+cluster://h:p,h:p/` URL (`redis://h:p/` each).
pub fn cluster_seeds(url: &str) -> Vec<String> {
    idemq_redis::cluster_seed_urls(url).expect("a valid cluster URL")
}

/// A claimed message for `name` (a fresh key claimed on `store` with `lease`), as the engine
/// hands a handler: for tests of in-script completions.
pub async fn claimed(
    store: &RedisStore,
    name: &str,
    lease: std::time::Duration,
) -> idemq_core::ClaimedMessage {
    let key = fresh_key(name);
    let lease_of = match store
        .claim(&ClaimRequest::new(key.clone(), lease))
        .await
        .expect("claim")
    {
        ClaimOutcome::Acquired(l) => l,
        other => panic!("claim: {other:?}"),
    };
    let (_loss, watch) = idemq_core::LeaseWatch::pair();
    idemq_core::ClaimedMessage::new(
        Arc::new(idemq_core::Envelope::new(
            idemq_core::BrokerKind::MEMORY,
            "t",
            "{}",
        )),
        key,
        lease_of.token,
        lease_of.attempt,
        false,
        watch,
    )
}

/// `RPUSH list v`: an effect command whose every application shows.
pub fn rpush(list: &str, v: &str) -> redis::Cmd {
    let mut c = redis::cmd("RPUSH");
    c.arg(list).arg(v);
    c
}
