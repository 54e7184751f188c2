//! RocketMQ in the broker benchmark (rocketmq-client-rust 1.0 on the rocketmq-rust servers).
//!
//! Every consumer is a push consumer of a fresh group, from the first offset, with the same
//! listener parallelism ([`CONSUME_THREADS`]) and the client's default listener batch of one
//! message (what a RocketMQ team writes by default; the adapter's source uses one message
//! per listener call too, so a mixed batch never resends an acked message):
//!
//! - **bare**: the listener counts the message and answers `CONSUME_SUCCESS`;
//! - **hand-written**: the listener writes the message's effect row
//!   (`INSERT … ON CONFLICT DO NOTHING`, the key read from `KEYS`) and then answers
//!   `CONSUME_SUCCESS` (`RECONSUME_LATER` if the insert failed);
//! - **idemq**: [`RocketSource`] with the same thread count, under the engine.

use super::broker::{bench_key, bench_payload, BrokerBench, EffectSink};
use anyhow::Result;
use idemq::rocketmq::rocketmq_client_rust::{
    ClientResult, ConsumeConcurrentlyContext, ConsumeConcurrentlyStatus, DefaultMQPushConsumer,
    MQPushConsumer, MessageListenerConcurrently,
};
use idemq::rocketmq::rocketmq_model::common::consumer::consume_from_where::ConsumeFromWhere;
use idemq::rocketmq::rocketmq_model::common::message::message_ext::MessageExt;
use idemq::rocketmq::rocketmq_model::common::message::MessageConst;
use idemq::rocketmq::{
    client_config, client_runtime, RocketPublisher, RocketPublisherConfig, RocketSource,
    RocketSourceConfig,
};
use idemq::{async_trait, KeyStrategy, OutgoingMessage, Publisher, Source};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{Notify, OnceCell};

/// Listener threads of every consumer measured (the bare and hand-written consumers' thread
/// pool, the adapter source's `consume_threads`).
pub const CONSUME_THREADS: u32 = 32;

/// Producers filling a topic side by side.
const FILLERS: usize = 8;

/// The longest one measured run may take before the run fails.
const RUN_LIMIT: Duration = Duration::from_secs(600);

/// The RocketMQ side of `idemq bench --brokers rocketmq`.
pub struct RocketBench {
    namesrv: String,
    fillers: OnceCell<Vec<Arc<RocketPublisher>>>,
}

impl RocketBench {
    /// The name server from `IDEMQ_TEST_ROCKETMQ_NAMESRV` (what `scripts/servers.sh env`
    /// exports).
    pub fn from_env() -> anyhow::Result<Self> {
        let namesrv = std::env::var("IDEMQ_TEST_ROCKETMQ_NAMESRV").map_err(|_| {
            anyhow::anyhow!(
                "IDEMQ_TEST_ROCKETMQ_NAMESRV is not set (eval \"$(scripts/servers.sh env)\")"
            )
        })?;
        Ok(Self {
            namesrv,
            fillers: OnceCell::new(),
        })
    }

    async fn fillers(&self) -> anyhow::Result<Vec<Arc<RocketPublisher>>> {
        let fillers = self
            .fillers
            .get_or_try_init(|| async {
                let mut v = Vec::with_capacity(FILLERS);
                for i in 0..FILLERS {
                    let group = format!("idemq_bench_fill_{i}_{:08x}", rand::random::<u32>());
                    v.push(Arc::new(
                        RocketPublisher::connect(RocketPublisherConfig::new(&self.namesrv, group))
                            .await?,
                    ));
                }
                Ok::<_, anyhow::Error>(v)
            })
            .await?;
        Ok(fillers.clone())
    }

    /// A started push consumer of a fresh group on `topic` with `listener`.
    async fn push_consumer(
        &self,
        topic: &str,
        listener: impl MessageListenerConcurrently + 'static,
    ) -> anyhow::Result<DefaultMQPushConsumer> {
        let mut consumer = DefaultMQPushConsumer::builder(client_runtime()?)
            .client_config(client_config(&self.namesrv)?)
            .consumer_group(fresh_group("bare"))
            .consume_from_where(ConsumeFromWhere::ConsumeFromFirstOffset)
            .consume_message_batch_max_size(1)
            .consume_thread_min(CONSUME_THREADS)
            .consume_thread_max(CONSUME_THREADS)
            .build();
        consumer
            .subscribe(topic, "*")
            .await
            .map_err(|e| anyhow::anyhow!("subscribe {topic}: {e}"))?;
        consumer.register_message_listener_concurrently(listener);
        consumer
            .start()
            .await
            .map_err(|e| anyhow::anyhow!("push consumer on {topic}: {e}"))?;
        Ok(consumer)
    }

    /// Starts a consumer with `listener`, waits until `count` reached `n`, stops it.
    async fn timed(
        &self,
        topic: &str,
        n: usize,
        count: Arc<Count>,
        listener: impl MessageListenerConcurrently + 'static,
    ) -> anyhow::Result<Duration> {
        let mut consumer = self.push_consumer(topic, listener).await?;
        let t = Instant::now();
        let reached = tokio::time::timeout(RUN_LIMIT, count.reached(n)).await;
        let elapsed = t.elapsed();
        consumer.shutdown().await;
        reached.map_err(|_| {
            anyhow::anyhow!(
                "{} of {n} messages consumed from {topic} within {RUN_LIMIT:?}",
                count.done.load(Ordering::Acquire)
            )
        })?;
        Ok(elapsed)
    }
}

fn fresh_group(what: &str) -> String {
    format!("idemq_bench_{what}_{:08x}", rand::random::<u32>())
}

/// Messages a listener finished, and a wake-up for the one waiting for `n` of them.
#[derive(Default)]
struct Count {
    done: AtomicUsize,
    changed: Notify,
}

impl Count {
    fn add(&self, k: usize) {
        self.done.fetch_add(k, Ordering::AcqRel);
        self.changed.notify_one();
    }

    async fn reached(&self, n: usize) {
        while self.done.load(Ordering::Acquire) < n {
            self.changed.notified().await;
        }
    }
}

/// The bare listener: counts, answers success.
struct Bare(Arc<Count>);

impl MessageListenerConcurrently for Bare {
    fn consume_message(
        &self,
        msgs: &[&MessageExt],
        _ctx: &ConsumeConcurrentlyContext,
    ) -> ClientResult<ConsumeConcurrentlyStatus> {
        self.0.add(msgs.len());
        Ok(ConsumeConcurrentlyStatus::ConsumeSuccess)
    }
}

/// The hand-written listener: the batch's effect rows with one `ON CONFLICT` insert, then
/// success. The listener is synchronous (a client blocking thread): the insert runs on the
/// benchmark's runtime and the thread waits for it.
struct HandWritten {
    count: Arc<Count>,
    sink: EffectSink,
    runtime: tokio::runtime::Handle,
}

/// The first of `KEYS` (the dedup key, as the adapter's publisher writes it).
fn first_key(m: &MessageExt) -> String {
    m.properties()
        .get(MessageConst::PROPERTY_KEYS)
        .and_then(|k| {
            k.as_str()
                .split(MessageConst::KEY_SEPARATOR)
                .next()
                .map(str::to_string)
        })
        .unwrap_or_default()
}

impl MessageListenerConcurrently for HandWritten {
    fn consume_message(
        &self,
        msgs: &[&MessageExt],
        _ctx: &ConsumeConcurrentlyContext,
    ) -> ClientResult<ConsumeConcurrentlyStatus> {
        let rows: Vec<(String, String)> = msgs
            .iter()
            .map(|m| {
                (
                    first_key(m),
                    String::from_utf8_lossy(m.body_slice()).into_owned(),
                )
            })
            .collect();
        let sink = self.sink.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        self.runtime.spawn(async move {
            let _ = tx.send(sink.insert_batch(&rows).await);
        });
        match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(Ok(())) => {
                self.count.add(msgs.len());
                Ok(ConsumeConcurrentlyStatus::ConsumeSuccess)
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "hand-written insert failed");
                Ok(ConsumeConcurrentlyStatus::ReconsumeLater)
            }
            Err(_) => Ok(ConsumeConcurrentlyStatus::ReconsumeLater),
        }
    }
}

#[async_trait]
impl BrokerBench for RocketBench {
    fn name(&self) -> &'static str {
        "rocketmq"
    }

    async fn fill(&self, n: usize) -> anyhow::Result<String> {
        let topic = fresh_group("topic");
        let fillers = self.fillers().await?;
        let dest = topic.clone();
        let message = move |i: usize| {
            OutgoingMessage::new(dest.clone(), bench_payload(i)).with_dedup_key(bench_key(i))
        };
        // The first send creates the topic; the rest go out from every filler at once.
        if n > 0 {
            fillers[0].publish(message(0)).await?;
        }
        let mut sends = tokio::task::JoinSet::new();
        for (f, filler) in fillers.into_iter().enumerate() {
            let message = message.clone();
            sends.spawn(async move {
                for i in (1..n).filter(|i| i % FILLERS == f) {
                    filler.publish(message(i)).await?;
                }
                Ok::<_, anyhow::Error>(())
            });
        }
        while let Some(r) = sends.join_next().await {
            r??;
        }
        Ok(topic)
    }

    async fn bare(&self, dest: &str, n: usize) -> anyhow::Result<Duration> {
        let count = Arc::new(Count::default());
        self.timed(dest, n, count.clone(), Bare(count)).await
    }

    async fn handwritten(&self, dest: &str, n: usize, sink: &EffectSink) -> Result<Duration> {
        let count = Arc::new(Count::default());
        let listener = HandWritten {
            count: count.clone(),
            sink: sink.clone(),
            runtime: tokio::runtime::Handle::current(),
        };
        self.timed(dest, n, count, listener).await
    }

    /// A key namespace of its own per run: the PostgreSQL store outlives runs and rounds
    /// (and is shared with other brokers' benchmarks), so the harness's fixed `bench`
    /// namespace would find every key of a later run completed and run no handler.
    fn keys(&self) -> anyhow::Result<KeyStrategy> {
        Ok(KeyStrategy::dedup_header(&fresh_group("keys"))?)
    }

    async fn source(&self, dest: &str) -> anyhow::Result<Box<dyn Source>> {
        let mut cfg = RocketSourceConfig::new(&self.namesrv, fresh_group("idemq"), dest);
        cfg.consume_threads = CONSUME_THREADS;
        Ok(Box::new(RocketSource::connect(cfg).await?))
    }
}
