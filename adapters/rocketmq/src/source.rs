//! The push-consumer source: RocketMQ's synchronous listener bridged to the async engine
//! through the core's channel source.
//!
//! A listener call (one message: the batch size is 1, so a mixed outcome never resends an
//! acked or dead-lettered message) makes one [`SettleRecorder`], blocking-sends the delivery
//! into the [`ChannelSource`], and waits for the engine's settlement:
//!
//! | settlement | concurrently | orderly |
//! |---|---|---|
//! | ack | `CONSUME_SUCCESS` | `SUCCESS` |
//! | nack(d) | `RECONSUME_LATER` (broker levels: ~10 s, ~30 s, …) | `SUSPEND_CURRENT_QUEUE_A_MOMENT` for d |
//! | reject(reason) | copy to the DLQ topic with the reason, then success | same |
//! | dropped / source closed | `RECONSUME_LATER` | suspend |

use crate::client::{env, own_client};
use crate::fields::{dead_letter_copy, to_envelope};
use crate::publisher::RocketPublisher;
use crate::RocketError;
use async_trait::async_trait;
use futures::future::{select, Either};
use idemq_core::adapter::{
    channel_source, ChannelSender, ChannelSource, SettleRecorder, Settlement,
};
use idemq_core::source::{Capabilities, Delivery, Settle, Source, SourceError};
use rocketmq_client_rust::{
    ClientResult, ConsumeConcurrentlyContext, ConsumeConcurrentlyStatus, ConsumeOrderlyContext,
    ConsumeOrderlyStatus, DefaultMQPushConsumer, MQConsumerInner, MQPushConsumer,
    MessageListenerConcurrently, MessageListenerOrderly,
};
use rocketmq_model::common::consumer::consume_from_where::ConsumeFromWhere;
use rocketmq_model::common::message::message_ext::MessageExt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{watch, Mutex, Notify};

/// The broker's first reconsume level after `RECONSUME_LATER` (level 3 of
/// `1s 5s 10s 30s 1m …`): the least a concurrently consumed nack waits.
pub const MIN_RECONSUME_DELAY: Duration = Duration::from_secs(10);

/// How long an orderly queue pauses after a delivery was dropped unsettled or its source
/// closed (concurrently consumed ones go through the broker's reconsume levels).
const ABANDONED_RETRY: Duration = Duration::from_secs(1);

/// How the consumer group consumes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConsumeMode {
    /// Many messages at a time, any order; nacks go through the retry topic.
    Concurrently,
    /// One message per queue at a time, in queue order (queues are locked on the broker);
    /// a nack suspends the queue and retries the same message.
    Orderly,
}

/// Source settings.
#[derive(Debug, Clone)]
pub struct SourceConfig {
    /// Name server address, `host:port`.
    pub name_server: String,
    /// Consumer group.
    pub group: String,
    /// Topic to subscribe.
    pub topic: String,
    /// Tag expression (`*`, `TagA || TagB`).
    pub tags: String,
    /// Concurrently or orderly.
    pub mode: ConsumeMode,
    /// Dead-letter topic for rejects; `None` = `%DLQ%<group>`, where the broker also puts
    /// messages that exhausted `max_reconsume_times`.
    pub dlq_topic: Option<String>,
    /// Consume threads (listener calls that may wait for settlements at once).
    pub consume_threads: u32,
    /// Broker-side reconsume attempts before `%DLQ%<group>` (the engine's retry policy
    /// usually rejects earlier, with a reason).
    pub max_reconsume_times: i32,
    /// Deliveries buffered between the listener threads and the engine.
    pub buffer: usize,
    /// A new group starts at the first offset (else at the last).
    pub from_first_offset: bool,
    /// Least time between two persists of the consume offsets after batches (default 1 s).
    /// A persist waits for the listener threads to hand the batch's answers to the client
    /// and costs a broker round trip; after every batch it bounded a consumer to one batch
    /// per ~12 ms. Offsets not yet persisted when a process dies are redelivered and skipped
    /// as duplicates; `close` persists them all.
    pub offset_persist_interval: Duration,
}

impl SourceConfig {
    /// Concurrent consumption of `topic` by `group`, from the first offset.
    pub fn new(
        name_server: impl Into<String>,
        group: impl Into<String>,
        topic: impl Into<String>,
    ) -> Self {
        Self {
            name_server: name_server.into(),
            group: group.into(),
            topic: topic.into(),
            tags: "*".into(),
            mode: ConsumeMode::Concurrently,
            dlq_topic: None,
            consume_threads: 16,
            max_reconsume_times: 16,
            buffer: 64,
            from_first_offset: true,
            offset_persist_interval: Duration::from_secs(1),
        }
    }
    /// Orderly consumption.
    pub fn orderly(mut self) -> Self {
        self.mode = ConsumeMode::Orderly;
        self
    }
    /// The dead-letter topic for rejects.
    pub fn dead_letter_topic(&self) -> String {
        self.dlq_topic
            .clone()
            .unwrap_or_else(|| format!("%DLQ%{}", self.group))
    }
}

/// What the listener thread waits on: the settlements, or the source closing.
struct Bridge {
    tx: ChannelSender,
    closed: watch::Receiver<bool>,
    active: Arc<AtomicUsize>,
    idle: Arc<Notify>,
    dlq: Arc<DeadLetters>,
    progress: Arc<Progress>,
}

/// Settlements handed to listener threads, and listener calls that took theirs back to the
/// client: `after_batch` waits until the second catches up with the first before it
/// persists the consume offsets.
#[derive(Default)]
struct Progress {
    settled: AtomicU64,
    answered: AtomicU64,
}

/// One message's outcome as the listener answers it.
enum Verdict {
    Done,
    Later(Duration),
}

impl Bridge {
    /// Delivers one message and waits (on this blocking listener thread) for its settlement.
    fn consume(&self, m: &MessageExt) -> Verdict {
        self.active.fetch_add(1, Ordering::SeqCst);
        let v = self.consume_inner(m);
        if self.active.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.idle.notify_waiters();
        }
        v
    }

    fn consume_inner(&self, m: &MessageExt) -> Verdict {
        if *self.closed.borrow() {
            return Verdict::Later(ABANDONED_RETRY);
        }
        let (recorder, outcome) = SettleRecorder::new();
        let settle = RocketSettle {
            recorder,
            dlq: self.dlq.clone(),
            message: m.clone(),
            progress: self.progress.clone(),
        };
        let d = Delivery::new(to_envelope(m), Box::new(settle));
        if self.tx.blocking_send(d).is_err() {
            return Verdict::Later(ABANDONED_RETRY);
        }
        let mut closed = self.closed.clone();
        let settled = futures::executor::block_on(async move {
            let closing = Box::pin(async move {
                let _ = closed.wait_for(|c| *c).await;
            });
            match select(outcome, closing).await {
                Either::Left((Ok(s), _)) => Some(s),
                Either::Left((Err(_), _)) => None,
                // Closing: a settlement that made it in still counts; later ones fail.
                Either::Right((_, mut outcome)) => outcome.try_recv().ok(),
            }
        });
        if settled.is_some() {
            self.progress.answered.fetch_add(1, Ordering::SeqCst);
        }
        match settled {
            Some(Settlement::Ack) => Verdict::Done,
            Some(Settlement::Nack(d)) => Verdict::Later(d),
            // Rejects were dead-lettered (then acked) by RocketSettle; a recorded reject
            // means that failed and the message must be kept.
            Some(Settlement::Reject(_)) | Some(Settlement::Abandoned) | None => {
                Verdict::Later(ABANDONED_RETRY)
            }
        }
    }
}

struct Concurrent(Arc<Bridge>);

impl MessageListenerConcurrently for Concurrent {
    fn consume_message(
        &self,
        msgs: &[&MessageExt],
        _ctx: &ConsumeConcurrentlyContext,
    ) -> ClientResult<ConsumeConcurrentlyStatus> {
        // Batch size 1; a longer batch is all-or-nothing, so every message must be done.
        let mut all_done = true;
        for m in msgs {
            if let Verdict::Later(_) = self.0.consume(m) {
                all_done = false;
            }
        }
        Ok(if all_done {
            ConsumeConcurrentlyStatus::ConsumeSuccess
        } else {
            metrics::counter!("idemq_rocketmq_reconsume_later_total").increment(1);
            ConsumeConcurrentlyStatus::ReconsumeLater
        })
    }
}

struct Orderly(Arc<Bridge>);

impl MessageListenerOrderly for Orderly {
    fn consume_message(
        &self,
        msgs: &[&MessageExt],
        ctx: &mut ConsumeOrderlyContext,
    ) -> ClientResult<ConsumeOrderlyStatus> {
        let mut suspend: Option<Duration> = None;
        for m in msgs {
            if let Verdict::Later(d) = self.0.consume(m) {
                suspend = Some(suspend.map_or(d, |s| s.max(d)));
            }
        }
        Ok(match suspend {
            None => ConsumeOrderlyStatus::Success,
            Some(d) => {
                let ms = i64::try_from(d.as_millis()).unwrap_or(i64::MAX).max(10);
                ctx.set_suspend_current_queue_time_millis(ms);
                ConsumeOrderlyStatus::SuspendCurrentQueueAMoment
            }
        })
    }
}

/// Where rejects go: a producer for the dead-letter topic.
struct DeadLetters {
    topic: String,
    publisher: RocketPublisher,
}

/// A settlement that dead-letters rejects itself (on the engine's side, async), then acks.
struct RocketSettle {
    recorder: SettleRecorder,
    dlq: Arc<DeadLetters>,
    message: MessageExt,
    progress: Arc<Progress>,
}

impl RocketSettle {
    fn counted(&self, sent: Result<(), SourceError>) -> Result<(), SourceError> {
        if sent.is_ok() {
            self.progress.settled.fetch_add(1, Ordering::SeqCst);
        }
        sent
    }
}

#[async_trait]
impl Settle for RocketSettle {
    async fn ack(&mut self) -> Result<(), SourceError> {
        let sent = self.recorder.ack().await;
        self.counted(sent)
    }
    async fn nack(&mut self, redeliver_after: Duration) -> Result<(), SourceError> {
        let sent = self.recorder.nack(redeliver_after).await;
        self.counted(sent)
    }
    async fn reject(&mut self, reason: &str) -> Result<(), SourceError> {
        if self.recorder.is_stale() {
            return Err(SourceError::Disconnected(
                "the listener stopped waiting for this message".into(),
            ));
        }
        let copy = dead_letter_copy(&self.message, &self.dlq.topic, reason)
            .map_err(|e| SourceError::Broker(format!("dead-letter copy: {e}")))?;
        self.dlq
            .publisher
            .send_raw(copy, None)
            .await
            .map_err(|e| SourceError::Broker(format!("dead-letter to {}: {e}", self.dlq.topic)))?;
        metrics::counter!("idemq_rocketmq_dead_lettered_total").increment(1);
        let sent = self.recorder.ack().await;
        self.counted(sent)
    }
    fn abandon(&mut self) {
        self.recorder.abandon();
    }
    fn is_stale(&self) -> bool {
        self.recorder.is_stale()
    }
}

/// A [`Source`] over a RocketMQ push consumer.
pub struct RocketSource {
    inner: ChannelSource,
    consumer: Arc<Mutex<Option<DefaultMQPushConsumer>>>,
    dlq: Arc<DeadLetters>,
    closing: watch::Sender<bool>,
    active: Arc<AtomicUsize>,
    idle: Arc<Notify>,
    progress: Arc<Progress>,
    /// `progress.settled` when the offsets were last persisted.
    persisted_at: u64,
    /// When they were last persisted, and the least time between two persists.
    last_persist: Option<tokio::time::Instant>,
    persist_every: Duration,
    closed: bool,
}

impl RocketSource {
    /// Joins the consumer group and starts consuming.
    pub async fn connect(cfg: SourceConfig) -> Result<Self, RocketError> {
        let env = env()?;
        let dlq_group = format!("{}-dlq", cfg.group.replace('%', "_"));
        let dlq = Arc::new(DeadLetters {
            topic: cfg.dead_letter_topic(),
            publisher: RocketPublisher::connect(crate::PublisherConfig::new(
                cfg.name_server.clone(),
                dlq_group,
            ))
            .await?,
        });
        let (tx, inner) = channel_source(cfg.buffer);
        let (closing, closed) = watch::channel(false);
        let active = Arc::new(AtomicUsize::new(0));
        let idle = Arc::new(Notify::new());
        let progress = Arc::new(Progress::default());
        let bridge = Arc::new(Bridge {
            tx,
            closed,
            active: active.clone(),
            idle: idle.clone(),
            dlq: dlq.clone(),
            progress: progress.clone(),
        });
        let threads = cfg.consume_threads.max(1);
        let client_config = own_client(&cfg.name_server)?;
        let mut consumer = DefaultMQPushConsumer::builder(env.client.clone())
            .client_config(client_config)
            .consumer_group(cfg.group.clone())
            .consume_from_where(if cfg.from_first_offset {
                ConsumeFromWhere::ConsumeFromFirstOffset
            } else {
                ConsumeFromWhere::ConsumeFromLastOffset
            })
            .consume_message_batch_max_size(1)
            .consume_thread_min(threads)
            .consume_thread_max(threads)
            .max_reconsume_times(cfg.max_reconsume_times)
            .build();
        consumer
            .subscribe(cfg.topic.as_str(), cfg.tags.as_str())
            .await
            .map_err(|e| RocketError::Client(format!("subscribe {}: {e}", cfg.topic)))?;
        match cfg.mode {
            ConsumeMode::Concurrently => {
                consumer.register_message_listener_concurrently(Concurrent(bridge))
            }
            ConsumeMode::Orderly => consumer.register_message_listener_orderly(Orderly(bridge)),
        }
        consumer
            .start()
            .await
            .map_err(|e| RocketError::Client(format!("consumer {}: {e}", cfg.group)))?;
        tracing::info!(group = %cfg.group, topic = %cfg.topic, mode = ?cfg.mode, "rocketmq consumer started");
        let inner = inner.with_capabilities(Capabilities {
            delayed_redelivery: true,
            min_redelivery_delay: match cfg.mode {
                ConsumeMode::Concurrently => MIN_RECONSUME_DELAY,
                ConsumeMode::Orderly => Duration::from_millis(10),
            },
            dead_letter: true,
            ordered: cfg.mode == ConsumeMode::Orderly,
            transactional: true,
        });
        Ok(Self {
            inner,
            consumer: Arc::new(Mutex::new(Some(consumer))),
            dlq,
            closing,
            active,
            idle,
            progress,
            persisted_at: 0,
            last_persist: None,
            persist_every: cfg.offset_persist_interval,
            closed: false,
        })
    }
}

/// Tells the listener threads to stop waiting, and waits (bounded) until they answered.
async fn release_listeners(closing: &watch::Sender<bool>, active: &AtomicUsize, idle: &Notify) {
    let _ = closing.send(true);
    let wait = async {
        loop {
            let notified = idle.notified();
            if active.load(Ordering::SeqCst) == 0 {
                break;
            }
            notified.await;
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(5), wait).await;
}

async fn shut_down(consumer: Arc<Mutex<Option<DefaultMQPushConsumer>>>, dlq: Arc<DeadLetters>) {
    if let Some(mut c) = consumer.lock().await.take() {
        c.shutdown().await;
    }
    dlq.publisher.shutdown().await;
}

#[async_trait]
impl Source for RocketSource {
    async fn poll(&mut self, max: usize) -> Result<Option<Vec<Delivery>>, SourceError> {
        self.inner.poll(max).await
    }

    /// Persists the consume offsets once the batch's settlements reached the client (the
    /// client commits the lowest unsettled offset of each queue: the contiguous prefix), at
    /// most once per `offset_persist_interval`.
    async fn after_batch(&mut self) -> Result<(), SourceError> {
        let settled = self.progress.settled.load(Ordering::SeqCst);
        if settled == self.persisted_at
            || self
                .last_persist
                .is_some_and(|t| t.elapsed() < self.persist_every)
        {
            return Ok(());
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
        while self.progress.answered.load(Ordering::SeqCst) < settled
            && tokio::time::Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        // The client updates its offset table right after the listener returns.
        tokio::time::sleep(Duration::from_millis(10)).await;
        if let Some(c) = self.consumer.lock().await.as_ref() {
            if let Some(inner) = c.default_mq_push_consumer_impl() {
                inner.persist_consumer_offset().await;
            }
        }
        self.persisted_at = settled;
        self.last_persist = Some(tokio::time::Instant::now());
        Ok(())
    }

    /// Pending listener calls answer "later", the consumer persists its offsets and
    /// leaves the group.
    async fn close(&mut self) -> Result<(), SourceError> {
        if self.closed {
            return Ok(());
        }
        self.closed = true;
        release_listeners(&self.closing, &self.active, &self.idle).await;
        self.inner.close().await?;
        let env = env().map_err(|e| SourceError::Broker(e.to_string()))?;
        // On our bridge runtime: the client must not depend on the caller's runtime.
        env.bridge
            .spawn(shut_down(self.consumer.clone(), self.dlq.clone()))
            .await
            .map_err(|e| SourceError::Broker(format!("consumer shutdown: {e}")))
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
}

impl Drop for RocketSource {
    /// A source dropped without `close` (a crash in tests) still leaves the group, so its
    /// unsettled messages go to the next member instead of bouncing through the retry topic.
    fn drop(&mut self) {
        if self.closed {
            return;
        }
        let _ = self.closing.send(true);
        if let Ok(env) = env() {
            env.bridge
                .spawn(shut_down(self.consumer.clone(), self.dlq.clone()));
        }
    }
}
