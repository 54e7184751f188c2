//! What the RabbitMQ tests share: the broker URL (or a skip), fresh queue names, sources,
//! publishers, and a reader for a queue's messages.
#![allow(dead_code)]

use idemq_core::Envelope;
use idemq_rabbitmq::lapin::options::{BasicGetOptions, QueueDeleteOptions};
use idemq_rabbitmq::lapin::{Connection, ConnectionProperties};
use idemq_rabbitmq::{QueueType, RabbitPublisher, RabbitSource, RabbitSourceConfig};

/// `IDEMQ_TEST_AMQP_URL`; `None` skips the test unless `IDEMQ_REQUIRE_SERVERS=1`.
pub fn amqp_url() -> Option<String> {
    env_url("IDEMQ_TEST_AMQP_URL")
}

/// `IDEMQ_TEST_RABBITMQ_STREAM_URL`; `None` skips the test unless `IDEMQ_REQUIRE_SERVERS=1`.
pub fn stream_url() -> Option<String> {
    env_url("IDEMQ_TEST_RABBITMQ_STREAM_URL")
}

fn env_url(var: &str) -> Option<String> {
    idemq_core::testkit::servers::server_url(var)
}

/// A queue name of this run only.
pub fn fresh_queue(what: &str) -> String {
    format!("idemq-test.{what}.{:08x}", rand::random::<u32>())
}

/// Settings for tests: small prefetch, quick reconnects.
pub fn config(url: &str, queue: &str, kind: QueueType) -> RabbitSourceConfig {
    let mut c = RabbitSourceConfig::new(url, queue)
        .declare(kind)
        .prefetch(32);
    c.reconnect_max = std::time::Duration::from_secs(1);
    c
}

pub async fn source(cfg: RabbitSourceConfig) -> RabbitSource {
    let q = cfg.queue.clone();
    RabbitSource::connect(cfg)
        .await
        .unwrap_or_else(|e| panic!("consume {q}: {e}"))
}

pub async fn publisher(url: &str) -> RabbitPublisher {
    RabbitPublisher::connect(url).await.expect("publisher")
}

pub async fn connection(url: &str) -> Connection {
    try_connection(url).await.expect("test connection")
}

/// A connection, or why the broker cannot be reached (e.g. while it restarts).
pub async fn try_connection(url: &str) -> Result<Connection, idemq_rabbitmq::lapin::Error> {
    let props = ConnectionProperties::default()
        .with_executor(tokio_executor_trait::Tokio::current())
        .with_reactor(tokio_reactor_trait::Tokio);
    Connection::connect(url, props).await
}

/// Takes every message now in `queue` (`basic.get`, auto-ack).
pub async fn take_all(url: &str, queue: &str) -> Vec<Envelope> {
    try_take_all(url, queue)
        .await
        .expect("connect and open a channel to take messages")
}

/// [`take_all`], `None` when the broker cannot be reached (e.g. while it restarts).
pub async fn try_take_all(url: &str, queue: &str) -> Option<Vec<Envelope>> {
    let conn = try_connection(url).await.ok()?;
    let ch = conn.create_channel().await.ok()?;
    let mut out = Vec::new();
    let opts = BasicGetOptions { no_ack: true };
    while let Ok(Some(m)) = ch.basic_get(queue, opts).await {
        out.push(idemq_rabbitmq::to_envelope(queue, &m.delivery));
    }
    let _ = conn.close(200, "done").await;
    Some(out)
}

/// Deletes queues left by a test.
pub async fn delete_queues(url: &str, queues: &[String]) {
    let conn = connection(url).await;
    let ch = conn.create_channel().await.expect("channel");
    for q in queues {
        let _ = ch.queue_delete(q, QueueDeleteOptions::default()).await;
    }
    let _ = conn.close(200, "done").await;
}

/// How often each dedup key's effect ran.
pub type Effects = std::sync::Arc<std::sync::Mutex<std::collections::HashMap<String, u32>>>;

/// Keys with an effect so far.
pub fn applied(effects: &Effects) -> usize {
    effects.lock().unwrap_or_else(|e| e.into_inner()).len()
}

/// An idempotent consumer (memory store, dedup-header keys in `group`) whose effect is
/// counting its key in `effects`, after `work` of pretend processing. Once `halt` is set,
/// new handlers hang at their start: the process is going down. (The engine completes a
/// batch's keys together once every handler of the batch is done, so a crash that splits a
/// batch would rightly run the finished handlers' effects again: effects that must survive
/// that belong in the store's transaction. Tests run a whole batch at once.)
pub fn counting_consumer(
    store: std::sync::Arc<idemq_core::MemoryStore>,
    group: &str,
    effects: Effects,
    work: std::time::Duration,
    halt: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> idemq_core::IdempotentConsumer<impl idemq_core::Handler> {
    let keys = idemq_core::KeyStrategy::dedup_header(group).expect("group");
    let effect = move |m: idemq_core::ClaimedMessage| {
        let effects = effects.clone();
        let halt = halt.clone();
        async move {
            if halt.load(std::sync::atomic::Ordering::SeqCst) {
                std::future::pending::<()>().await;
            }
            tokio::time::sleep(work).await;
            let key = m.envelope.headers.get_str(idemq_core::DEDUP_HEADER);
            let key = key.unwrap_or_default().to_owned();
            let mut tally = effects.lock().unwrap_or_else(|e| e.into_inner());
            *tally.entry(key).or_default() += 1;
            Ok::<_, idemq_core::HandlerError>(None)
        }
    };
    idemq_core::IdempotentConsumer::new(store, keys, effect)
}

/// (double effects, lost keys) among `expected`.
pub fn double_and_lost(effects: &Effects, expected: &[String]) -> (usize, usize) {
    let tally = effects.lock().unwrap_or_else(|e| e.into_inner());
    let doubles = tally.values().filter(|n| **n > 1).count();
    let lost = expected.iter().filter(|k| !tally.contains_key(*k)).count();
    (doubles, lost)
}
