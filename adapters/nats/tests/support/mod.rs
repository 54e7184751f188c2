//! What the NATS tests share: the server (or a skip), a fresh stream per test, sources and
//! publishers with test settings, a reader of a stream's messages, and an effect tally.
#![allow(dead_code)]

use idemq_core::Envelope;
use idemq_nats::async_nats;
use idemq_nats::{NatsPublisher, NatsPublisherConfig, NatsSource, NatsSourceConfig};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// `IDEMQ_TEST_NATS_URL`; `None` skips the test unless `IDEMQ_REQUIRE_SERVERS=1`.
pub fn nats_url() -> Option<String> {
    idemq_core::testkit::servers::server_url("IDEMQ_TEST_NATS_URL")
}

/// One test's stream: its name, the subjects it captures (`<root>.>`), a subject to publish
/// to and a durable consumer name, all unique to this run.
#[derive(Debug, Clone)]
pub struct Names {
    pub stream: String,
    pub root: String,
    pub subject: String,
    pub durable: String,
}

impl Names {
    pub fn fresh(what: &str) -> Self {
        let tag = format!("{:08x}", rand::random::<u32>());
        Names {
            stream: format!(
                "IDEMQ_TEST_{}_{tag}",
                what.replace(['.', ' ', '*', '>'], "_")
            ),
            root: format!("idemq-test.{what}.{tag}"),
            subject: format!("idemq-test.{what}.{tag}.orders"),
            durable: format!("{what}-{tag}"),
        }
    }
}

/// Test settings: the stream declared on first use, short AckWait (a crashed source's
/// messages come back within seconds), small batches, quick pull renewals.
pub fn config(url: &str, n: &Names) -> NatsSourceConfig {
    let mut c = NatsSourceConfig::new(url, &n.stream, &n.durable);
    c.subjects = vec![format!("{}.>", n.root)];
    c.declare_stream = true;
    c.batch = 32;
    c.ack_wait = Duration::from_secs(5);
    c.fetch_wait = Duration::from_secs(1);
    c
}

pub async fn source(cfg: NatsSourceConfig) -> NatsSource {
    let what = format!("{}/{}", cfg.stream, cfg.durable);
    NatsSource::connect(cfg)
        .await
        .unwrap_or_else(|e| panic!("consume {what}: {e}"))
}

pub async fn publisher(url: &str) -> NatsPublisher {
    NatsPublisher::connect(NatsPublisherConfig::new(url))
        .await
        .expect("publisher")
}

/// A JetStream context of its own (for reading and deleting streams).
pub async fn jetstream(url: &str) -> Option<async_nats::jetstream::Context> {
    let client = async_nats::connect(url).await.ok()?;
    Some(async_nats::jetstream::new(client))
}

/// Every message `stream` holds now, as envelopes; `None` when the server cannot be
/// reached or the stream does not exist (yet).
pub async fn read_stream(url: &str, stream: &str) -> Option<Vec<Envelope>> {
    let js = jetstream(url).await?;
    let mut s = js.get_stream(stream).await.ok()?;
    let state = s.info().await.ok()?.state.clone();
    let mut out = Vec::new();
    if state.messages == 0 {
        return Some(out);
    }
    for seq in state.first_sequence..=state.last_sequence {
        // A deleted sequence in between is skipped.
        if let Ok(m) = s.get_raw_message(seq).await {
            out.push(idemq_nats::stored_to_envelope(m, None));
        }
    }
    Some(out)
}

/// Deletes the streams of a test (best effort).
pub async fn delete_streams(url: &str, streams: &[String]) {
    if let Some(js) = jetstream(url).await {
        for s in streams {
            let _ = js.delete_stream(s).await;
        }
    }
}

/// How often the effect of each dedup key ran.
#[derive(Clone, Default)]
pub struct Tally(Arc<Mutex<HashMap<String, u32>>>);

impl Tally {
    pub fn count(&self, key: &str) {
        *self
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(key.to_string())
            .or_default() += 1;
    }
    /// Keys applied at least once.
    pub fn applied(&self) -> usize {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
    /// (keys applied more than once, keys of `expected` never applied).
    pub fn doubles_and_lost(&self, expected: &[String]) -> (Vec<String>, Vec<String>) {
        let t = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let doubles = t
            .iter()
            .filter(|(_, n)| **n > 1)
            .map(|(k, _)| k.clone())
            .collect();
        let lost = expected
            .iter()
            .filter(|k| !t.contains_key(*k))
            .cloned()
            .collect();
        (doubles, lost)
    }
}
