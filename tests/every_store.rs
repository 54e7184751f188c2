//! One consumer, every store: the same storm (producer duplicates, lost acks, handler
//! failures, three competing consumers) changes the world once per message whichever store
//! backs the engine. Server-backed stores come from `scripts/servers.sh` (env URLs).

use idemq::broker::{Faults, MemoryBroker};
use idemq::{
    BrokerKind, ClaimedMessage, ConsumerConfig, Envelope, HandlerError, IdempotentConsumer,
    KeyStrategy,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

mod support;
#[allow(unused_imports)]
use support::server_url;

async fn storm(url: &str) {
    let store = idemq::open_store(url).await.expect("open store");
    let group = format!("storm-{:08x}", rand::random::<u32>());
    let keys = KeyStrategy::header(&group, "x-idempotency-key").expect("keys");
    let broker = MemoryBroker::with_seed(11);
    broker.set_faults(Faults {
        lost_ack_rate: 0.1,
        ..Faults::default()
    });
    let n = 500;
    for i in 0..n {
        let env = Envelope::new(BrokerKind::MEMORY, "orders", format!("order {i}"))
            .with_header("x-idempotency-key", format!("order-{i}"));
        broker.publish(env.clone());
        if i % 4 == 0 {
            broker.publish(env);
        }
    }
    let effects: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
    let e2 = effects.clone();
    let handler = move |m: ClaimedMessage| {
        let e = e2.clone();
        async move {
            let k = m.key.to_string();
            if m.attempt == 1 && k.ends_with('7') {
                return Err(HandlerError::retryable(
                    "first attempt of keys ending in 7 fails",
                ));
            }
            *e.lock().expect("lock").entry(k).or_default() += 1;
            Ok(None)
        }
    };
    let consumer = IdempotentConsumer::new(store, keys, handler).with_config(ConsumerConfig {
        max_batch: 50,
        lease: Duration::from_secs(10),
        retry: idemq_core::engine::RetryPolicy::fixed(Duration::from_millis(20)),
        in_flight_delay_max: Duration::from_millis(100),
        ..ConsumerConfig::default()
    });
    let mut tasks = Vec::new();
    for _ in 0..3 {
        let c = consumer.clone();
        let mut src = broker.subscribe();
        tasks.push(tokio::spawn(
            async move { c.run_until_idle(&mut src).await },
        ));
    }
    for t in tasks {
        t.await.expect("join").expect("run");
    }
    let e = effects.lock().expect("lock").clone();
    assert_eq!(e.len(), n, "{url}: every order applied");
    assert!(e.values().all(|&c| c == 1), "{url}: no order applied twice");
    let st = consumer.stats();
    assert_eq!(st.processed, n as u64, "{url}: {st:?}");
    assert!(st.duplicates >= 125, "{url}: duplicates skipped {st:?}");
    assert_eq!(
        st.retried, 50,
        "{url}: one retry per key ending in 7 {st:?}"
    );
    assert!(broker.dead_letters().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn storm_on_memory() {
    storm("memory://").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn storm_on_sqlite() {
    let dir = std::env::temp_dir().join(format!("idemq-storm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    storm(&format!("sqlite://{}?mode=rwc", dir.join("s.db").display())).await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn storm_on_postgres() {
    if let Some(u) = server_url("IDEMQ_TEST_POSTGRES_URL") {
        storm(&u).await;
    }
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn storm_on_mariadb() {
    if let Some(u) = server_url("IDEMQ_TEST_MYSQL_URL") {
        storm(&u).await;
    }
}

#[cfg(feature = "nats-kv")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn storm_on_nats_kv() {
    if let Some(u) = server_url("IDEMQ_TEST_NATS_URL") {
        // The same server, as a store URL: nats-kv://host:port/bucket.
        let host = u.trim_start_matches("nats://").trim_end_matches('/');
        storm(&format!("nats-kv://{host}/idemq_every_store")).await;
    }
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn storm_on_redis() {
    if let Some(u) = server_url("IDEMQ_TEST_REDIS_URL") {
        storm(&u).await;
    }
}
