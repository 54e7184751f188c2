//! NATS JetStream in the broker benchmark (async-nats 0.52 on nats-server 2.15).
//!
//! Every run reads a fresh file-storage stream through a fresh durable pull consumer with
//! explicit acks:
//!
//! - **bare**: async-nats's own pull consumer (`Consumer::stream`, up to the batch size per
//!   pull request), one `ack` per message as it arrives;
//! - **hand-written**: the same consumer taking what has arrived (up to the batch size),
//!   writing the batch's effect rows with one `INSERT … ON CONFLICT DO NOTHING` (key from the
//!   dedup header), then acking each message of the batch;
//! - **idemq**: [`NatsSource`] under the engine (batch fetches, a double ack, confirmed by
//!   the server, once a message's dedup record is durable).

use super::broker::{bench_key, bench_payload, BrokerBench, EffectSink};
use futures::{FutureExt, StreamExt};
use idemq::nats::async_nats::{self, jetstream};
use idemq::nats::{NatsSource, NatsSourceConfig};
use idemq::{async_trait, Source, DEDUP_HEADER};
use std::time::{Duration, Instant};

/// The longest one measured run may take before the run fails.
const RUN_LIMIT: Duration = Duration::from_secs(600);

/// Benchmark streams drop messages older than this (a failed run leaves little behind).
const STREAM_MAX_AGE: Duration = Duration::from_secs(15 * 60);

/// Publishes in flight before their acks are awaited, when filling a stream.
const FILL_WINDOW: usize = 2000;

/// The NATS side of `idemq bench --brokers nats`.
pub struct NatsBench {
    url: String,
    batch: usize,
}

impl NatsBench {
    /// The server at `IDEMQ_TEST_NATS_URL` (what `scripts/servers.sh env` exports); the
    /// pull requests and the hand-written consumer's batches follow `batch`.
    pub fn from_env(batch: usize) -> anyhow::Result<Self> {
        let url = super::stores::env_url("IDEMQ_TEST_NATS_URL")?;
        Ok(Self {
            url,
            batch: batch.max(1),
        })
    }

    async fn context(&self) -> anyhow::Result<jetstream::Context> {
        let client = async_nats::connect(&self.url).await?;
        Ok(jetstream::new(client))
    }

    /// A fresh durable pull consumer on `stream`, explicit acks.
    async fn consumer(
        &self,
        js: &jetstream::Context,
        stream: &str,
    ) -> anyhow::Result<jetstream::consumer::PullConsumer> {
        let durable = format!("bench-{:08x}", rand::random::<u32>());
        let cfg = jetstream::consumer::pull::Config {
            durable_name: Some(durable),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ack_wait: Duration::from_secs(60),
            max_ack_pending: -1,
            ..Default::default()
        };
        Ok(js.create_consumer_on_stream(cfg, stream).await?)
    }

    /// async-nats's continuous pull: up to a batch per request, the next one asked for
    /// before this one is used up.
    async fn messages(
        &self,
        consumer: &jetstream::consumer::PullConsumer,
    ) -> anyhow::Result<jetstream::consumer::pull::Stream> {
        Ok(consumer
            .stream()
            .max_messages_per_batch(self.batch)
            .messages()
            .await?)
    }
}

async fn next_message(
    messages: &mut jetstream::consumer::pull::Stream,
    what: &str,
    got: usize,
    n: usize,
) -> anyhow::Result<jetstream::Message> {
    tokio::time::timeout(RUN_LIMIT, messages.next())
        .await
        .map_err(|_| anyhow::anyhow!("{what}: stuck after {got} of {n}"))?
        .ok_or_else(|| anyhow::anyhow!("{what}: the message stream ended after {got}"))?
        .map_err(|e| anyhow::anyhow!("{what}: {e}"))
}

#[async_trait]
impl BrokerBench for NatsBench {
    fn name(&self) -> &'static str {
        "nats"
    }

    async fn fill(&self, n: usize) -> anyhow::Result<String> {
        let js = self.context().await?;
        let stream = format!("idemq_bench_{:08x}", rand::random::<u32>());
        let subject = format!("idemq-bench.{stream}");
        js.create_stream(jetstream::stream::Config {
            name: stream.clone(),
            subjects: vec![subject.clone()],
            max_age: STREAM_MAX_AGE,
            ..Default::default()
        })
        .await?;
        let mut pending = Vec::with_capacity(FILL_WINDOW);
        for i in 0..n {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert(DEDUP_HEADER, bench_key(i).as_str());
            let ack = js
                .publish_with_headers(subject.clone(), headers, bench_payload(i).into())
                .await?;
            pending.push(ack);
            if pending.len() >= FILL_WINDOW {
                for ack in pending.drain(..) {
                    ack.await?;
                }
            }
        }
        for ack in pending {
            ack.await?;
        }
        Ok(stream)
    }

    async fn bare(&self, dest: &str, n: usize) -> anyhow::Result<Duration> {
        let t = Instant::now();
        let js = self.context().await?;
        let consumer = self.consumer(&js, dest).await?;
        let mut messages = self.messages(&consumer).await?;
        let mut got = 0;
        while got < n {
            let m = next_message(&mut messages, "bare consumer", got, n).await?;
            m.ack().await.map_err(|e| anyhow::anyhow!("ack: {e}"))?;
            got += 1;
        }
        let elapsed = t.elapsed();
        drop(messages);
        js.delete_stream(dest).await?;
        Ok(elapsed)
    }

    async fn handwritten(
        &self,
        dest: &str,
        n: usize,
        sink: &EffectSink,
    ) -> anyhow::Result<Duration> {
        let t = Instant::now();
        let js = self.context().await?;
        let consumer = self.consumer(&js, dest).await?;
        let mut messages = self.messages(&consumer).await?;
        let mut got = 0;
        while got < n {
            // Wait for one message, then take what has already arrived, up to a batch.
            let first = next_message(&mut messages, "hand-written consumer", got, n).await?;
            let mut batch = vec![first];
            while batch.len() < self.batch {
                match messages.next().now_or_never() {
                    Some(Some(m)) => batch.push(m.map_err(|e| anyhow::anyhow!("{e}"))?),
                    _ => break,
                }
            }
            let rows: Vec<(String, String)> = batch
                .iter()
                .map(|m| {
                    let key = m
                        .headers
                        .as_ref()
                        .and_then(|h| h.get(DEDUP_HEADER))
                        .map(|v| v.as_str().to_string());
                    let payload = String::from_utf8_lossy(&m.payload).into_owned();
                    (key.unwrap_or_default(), payload)
                })
                .collect();
            sink.insert_batch(&rows).await?;
            for m in &batch {
                m.ack().await.map_err(|e| anyhow::anyhow!("ack: {e}"))?;
            }
            got += batch.len();
        }
        let elapsed = t.elapsed();
        drop(messages);
        js.delete_stream(dest).await?;
        Ok(elapsed)
    }

    async fn source(&self, dest: &str) -> anyhow::Result<Box<dyn Source>> {
        let durable = format!("idemq-{:08x}", rand::random::<u32>());
        let mut cfg = NatsSourceConfig::new(&self.url, dest, durable);
        cfg.batch = self.batch;
        Ok(Box::new(NatsSource::connect(cfg).await?))
    }
}
