//! What the RocketMQ tests share: the name server (or a skip), names of this run, sources,
//! publishers, and a reader that collects a topic (the dead-letter topic) in the background.
#![allow(dead_code)]

use idemq_core::source::Source;
use idemq_core::Envelope;
use idemq_rocketmq::{RocketPublisher, RocketPublisherConfig, RocketSource, RocketSourceConfig};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

/// `IDEMQ_TEST_ROCKETMQ_NAMESRV`; `None` skips unless `IDEMQ_REQUIRE_SERVERS=1`.
pub fn namesrv() -> Option<String> {
    idemq_core::testkit::servers::server_url("IDEMQ_TEST_ROCKETMQ_NAMESRV")
}

/// `IDEMQ_TEST_POSTGRES_URL`; `None` skips unless `IDEMQ_REQUIRE_SERVERS=1`.
pub fn postgres_url() -> Option<String> {
    idemq_core::testkit::servers::server_url("IDEMQ_TEST_POSTGRES_URL")
}

/// The dedup key a delivery carries (`""` without one).
pub fn dedup_key_of(envelope: &Envelope) -> String {
    envelope
        .headers
        .get_str(idemq_core::DEDUP_HEADER)
        .unwrap_or("")
        .to_string()
}

/// Polls `done` every 200 ms until it holds or `within` has passed; its last answer.
pub async fn wait_until(within: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if done() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    done()
}

/// A topic / group name used by this run only (RocketMQ names: letters, digits, `_`, `-`).
pub fn unique(what: &str) -> String {
    format!("idemq_{what}_{:08x}", rand::random::<u32>())
}

pub async fn source(cfg: RocketSourceConfig) -> RocketSource {
    let what = format!("{} on {}", cfg.group, cfg.topic);
    match RocketSource::connect(cfg).await {
        Ok(s) => s,
        Err(e) => panic!("consumer {what}: {e}"),
    }
}

pub async fn publisher(namesrv: &str) -> RocketPublisher {
    let group = unique("pg");
    match RocketPublisher::connect(RocketPublisherConfig::new(namesrv, group)).await {
        Ok(p) => p,
        Err(e) => panic!("producer: {e}"),
    }
}

/// Everything a topic receives from now on, acked as read, kept in `seen`.
pub struct Collector {
    pub seen: Arc<Mutex<Vec<Envelope>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Collector {
    pub async fn start(namesrv: &str, topic: &str) -> Self {
        let cfg = RocketSourceConfig::new(namesrv, unique("reader"), topic);
        let mut src = source(cfg).await;
        let seen = Arc::new(Mutex::new(Vec::new()));
        let sink = seen.clone();
        let task = tokio::spawn(async move {
            while let Ok(Some(batch)) = src.poll(32).await {
                for d in batch {
                    sink.lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(d.envelope.clone());
                    let _ = d.ack().await;
                }
            }
        });
        Self { seen, task }
    }

    pub fn snapshot(&self) -> Vec<Envelope> {
        self.seen.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Runs `consumer` over `src` in a task until the returned sender fires (or is dropped).
pub fn run_until_stopped<H: idemq_core::Handler>(
    consumer: idemq_core::IdempotentConsumer<H>,
    mut src: RocketSource,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
) {
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(async move {
        let _ = consumer
            .run(&mut src, async {
                let _ = stop_rx.await;
            })
            .await;
    });
    (stop_tx, run)
}
