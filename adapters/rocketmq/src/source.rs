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
//! | nack(d) | held on the listener thread for d, then handed to the engine again | same |
//! | reject(reason) | copy to the DLQ topic with the reason, then success | same |
//! | dropped unsettled | held `ABANDONED_RETRY` (1 s), then handed over again | same |
//! | source closing | `RECONSUME_LATER` (broker levels: ~10 s, ~30 s, …) | `SUSPEND_CURRENT_QUEUE_A_MOMENT` |
//!
//! **Why a nack is held here.** Every `RECONSUME_LATER` (and every orderly suspend) spends
//! one of `max_reconsume_times`, after which the broker moves the message to `%DLQ%<group>`
//! without a reason. The engine nacks for reasons that are not failures (another worker
//! holds the key, the store is down, an earlier message of the lane went back), and the
//! settlement does not say which: a store outage of a few hours would dead-letter messages
//! that never ran. So no nack reaches the broker: the engine's retry policy, which counts
//! handler failures only (the store's attempt count), is the one budget, and its give-up is
//! a reject with a reason. Only a source that closes with a message in hand gives it back
//! (one broker attempt). The price: a held message keeps its listener thread and holds back
//! its queue's committed offset (the client pulls on up to `consume_concurrently_max_span`,
//! 2000, past it) until the engine acks or rejects it.

use crate::client::{env, own_client};
use crate::fields::{dead_letter_copy, to_envelope};
use crate::listener_guard::{guarded, poll_or_fatal, ListenerPanic};
use crate::publisher::RocketPublisher;
use crate::RocketError;
use async_trait::async_trait;
use futures::future::{select, Either};
use idemq_core::adapter::{channel_source, ChannelSender, ChannelSource, SettleRecorder};
use idemq_core::source::{Delivery, Settle, Settlement, Source, SourceError};
use rocketmq_client_rust::{
    ClientResult, ConsumeConcurrentlyContext, ConsumeConcurrentlyStatus, ConsumeOrderlyContext,
    ConsumeOrderlyStatus, DefaultMQPushConsumer, MQConsumerInner, MQPushConsumer,
    MessageListenerConcurrently, MessageListenerOrderly,
};
use rocketmq_model::common::consumer::consume_from_where::ConsumeFromWhere;
use rocketmq_model::common::message::message_ext::MessageExt;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{watch, Mutex, Notify};

/// The broker's first reconsume level after `RECONSUME_LATER` (level 3 of
/// `1s 5s 10s 30s 1m …`): the least a message given back by a closing source waits (nacks
/// are held in the listener for their own delay; see the module doc).
pub const MIN_RECONSUME_DELAY: Duration = Duration::from_secs(10);

/// How long a delivery dropped unsettled (a cancelled batch) is held before it is handed to
/// the engine again, and how long an orderly queue pauses when its source closes.
const ABANDONED_RETRY: Duration = Duration::from_secs(1);

/// Failed dead-letter sends of one message after which the listener stops holding it and gives
/// it back to the broker: a dead-letter topic that stays unreachable would otherwise keep the
/// message (and its listener thread, and in orderly mode its queue) here for good. Given back,
/// the broker's own reconsume levels bound it and end in `%DLQ%<group>`, without our reason
/// but not lost.
const DEAD_LETTER_ATTEMPTS: u32 = 3;

/// The client's `consume_timeout`, in minutes: a message in a listener call longer than that
/// is sent back by the client (one broker attempt). Messages are held in listener calls
/// while the engine nacks them, so the bound is far off (the engine's retry policy bounds a
/// failing message; a long store outage holds them as long as it lasts).
const CONSUME_TIMEOUT_MINUTES: u64 = 7 * 24 * 60;

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
pub struct RocketSourceConfig {
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
    /// Broker-side reconsume attempts before `%DLQ%<group>` (without a reason). Nacks do
    /// not spend them (they are held in the listener; the engine's retry policy gives up
    /// with a reason); only a source closed with a message in hand gives it back, one each.
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

impl RocketSourceConfig {
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
    /// Timers of the held nacks (the listener threads are not on a runtime of ours).
    timers: tokio::runtime::Handle,
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
    /// A listener call's panic, once one panicked: `poll` returns it.
    panicked: ListenerPanic,
}

/// One message's outcome as the listener answers it.
enum Verdict {
    Done,
    Later(Duration),
}

/// What a listener call does with its message once the engine settled it (or not).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// Acked, or dead-lettered with its reason by `RocketSettle`: answer success.
    Done,
    /// Keep the message on this listener thread and hand it to the engine again after the
    /// delay: the broker hears nothing, so no reconsume attempt is spent.
    Hold(Duration),
    /// The source is closing: give the message back to the broker.
    GiveBack(Duration),
}

/// The listener's next step for a settlement (`None`: none arrived), the source closing or
/// not. Only a closing source gives a message back to the broker; every nack — a handler
/// failure, another worker's lease, a store outage, a deferred lane — is held here.
fn step(settled: Option<&Settlement>, closing: bool) -> Step {
    match settled {
        Some(Settlement::Ack) => Step::Done,
        Some(Settlement::Nack(d)) if closing => Step::GiveBack(*d),
        _ if closing => Step::GiveBack(ABANDONED_RETRY),
        Some(Settlement::Nack(d)) => Step::Hold(*d),
        // Rejects were dead-lettered (then acked) by RocketSettle; a recorded reject means
        // that failed and the message must be kept. A dropped delivery is not a failure.
        Some(Settlement::Reject(_)) | Some(Settlement::Abandoned) | None => {
            Step::Hold(ABANDONED_RETRY)
        }
    }
}

impl Bridge {
    /// Delivers one message and waits (on this blocking listener thread) for its settlement.
    fn consume(&self, m: &MessageExt) -> Verdict {
        self.active.fetch_add(1, Ordering::SeqCst);
        let later = || Verdict::Later(ABANDONED_RETRY);
        let v = guarded(&self.progress.panicked, m, later, || self.consume_inner(m));
        if self.active.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.idle.notify_waiters();
        }
        v
    }

    fn consume_inner(&self, m: &MessageExt) -> Verdict {
        // Hand-overs of this message by this listener call after the first (held nacks).
        let mut held = 0u32;
        let dlq_failures = Arc::new(AtomicU32::new(0));
        loop {
            if *self.closed.borrow() {
                return Verdict::Later(ABANDONED_RETRY);
            }
            let Some(settled) = self.deliver(m, held, &dlq_failures) else {
                return Verdict::Later(ABANDONED_RETRY);
            };
            // Read apart from the match: a `watch::Ref` kept for the match would hold the
            // channel's read lock while the arm waits, and `close` / drop could never send.
            let closing = *self.closed.borrow();
            match step(settled.as_ref(), closing) {
                Step::Done => return Verdict::Done,
                Step::GiveBack(d) => return Verdict::Later(d),
                Step::Hold(_) if dlq_failures.load(Ordering::SeqCst) >= DEAD_LETTER_ATTEMPTS => {
                    tracing::error!(
                        topic = %self.dlq.topic,
                        attempts = DEAD_LETTER_ATTEMPTS,
                        "the dead-letter topic refused this message every time: giving it back \
                         to the broker (its reconsume levels, then %DLQ%<group>)"
                    );
                    metrics::counter!("idemq_rocketmq_dead_letters_given_back_total").increment(1);
                    return Verdict::Later(ABANDONED_RETRY);
                }
                Step::Hold(d) => {
                    metrics::counter!("idemq_rocketmq_nacks_held_total").increment(1);
                    if !self.hold(d) {
                        return Verdict::Later(ABANDONED_RETRY);
                    }
                    held = held.saturating_add(1);
                }
            }
        }
    }

    /// Hands the message to the engine and waits for its settlement. `None`: the source is
    /// gone; `Some(None)`: no settlement (closing).
    fn deliver(
        &self,
        m: &MessageExt,
        held: u32,
        dlq_failures: &Arc<AtomicU32>,
    ) -> Option<Option<Settlement>> {
        let (recorder, outcome) = SettleRecorder::new();
        let settle = RocketSettle {
            recorder,
            dlq: self.dlq.clone(),
            message: m.clone(),
            progress: self.progress.clone(),
            dlq_failures: dlq_failures.clone(),
        };
        let mut envelope = to_envelope(m);
        if held > 0 {
            // The broker's count does not see hand-overs from here: add them.
            let first = envelope.delivery_count.unwrap_or(1);
            envelope.delivery_count = Some(first.saturating_add(held));
            envelope.redelivered = true;
        }
        let d = Delivery::new(envelope, Box::new(settle));
        if self.tx.blocking_send(d).is_err() {
            return None;
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
        Some(settled)
    }

    /// Waits `d` on this listener thread; false when the source started closing meanwhile.
    fn hold(&self, d: Duration) -> bool {
        let sleep = {
            let _timers = self.timers.enter();
            Box::pin(tokio::time::sleep(d))
        };
        let mut closed = self.closed.clone();
        futures::executor::block_on(async move {
            let closing = Box::pin(async move {
                let _ = closed.wait_for(|c| *c).await;
            });
            matches!(select(sleep, closing).await, Either::Left(_))
        })
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
    /// Failed dead-letter sends of this message, across the listener call's hand-overs.
    dlq_failures: Arc<AtomicU32>,
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
        let sent = match dead_letter_copy(&self.message, &self.dlq.topic, reason) {
            Ok(copy) => self
                .dlq
                .publisher
                .send_raw(copy, None)
                .await
                .map(|_| ())
                .map_err(|e| {
                    SourceError::Broker(format!("dead-letter to {}: {e}", self.dlq.topic))
                }),
            Err(e) => Err(SourceError::Broker(format!("dead-letter copy: {e}"))),
        };
        if let Err(e) = sent {
            self.dlq_failures.fetch_add(1, Ordering::SeqCst);
            return Err(e);
        }
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
    pub async fn connect(cfg: RocketSourceConfig) -> Result<Self, RocketError> {
        let env = env()?;
        let dlq_group = format!("{}-dlq", cfg.group.replace('%', "_"));
        let dlq = Arc::new(DeadLetters {
            topic: cfg.dead_letter_topic(),
            publisher: RocketPublisher::connect(crate::RocketPublisherConfig::new(
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
            timers: env.bridge.clone(),
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
            .consume_timeout(CONSUME_TIMEOUT_MINUTES)
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
        poll_or_fatal(&mut self.inner, &self.progress.panicked, max).await
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

#[cfg(test)]
mod retry_budget_tests {
    //! What a nack costs: the listener calls of both modes driven the way the client calls
    //! them (on a blocking thread, one message), the real engine settling over the channel
    //! source, no broker. A nack that is not a handler failure must not reach the broker as
    //! RECONSUME_LATER / a suspend, each of which spends one of `max_reconsume_times`.

    use super::*;
    use cheetah_string::CheetahString;
    use idemq_core::engine::{ConsumerConfig, RetryPolicy};
    use idemq_core::publish::DEDUP_HEADER;
    use idemq_core::store::{ClaimOutcome, ClaimRequest, DedupStore};
    use idemq_core::testkit::switchable::SwitchableStore;
    use idemq_core::{
        ClaimedMessage, ConsumerGroup, DedupKey, HandlerError, IdempotentConsumer, KeyStrategy,
        MemoryStore,
    };
    use rocketmq_model::common::message::message_queue::MessageQueue;
    use rocketmq_model::common::message::MessageTrait;
    use std::sync::atomic::AtomicU32;
    use std::thread::JoinHandle;

    const GROUP: &str = "billing";

    /// A message as the broker hands it over: first delivery, the dedup key in its property.
    fn message(key: &str) -> MessageExt {
        let mut m = MessageExt::default();
        m.set_topic(CheetahString::from_static_str("payments"));
        m.set_body(bytes::Bytes::from_static(br#"{"amount":100}"#));
        m.put_property(
            CheetahString::from_static_str(DEDUP_HEADER),
            CheetahString::from_string(key.to_string()),
        );
        m
    }

    /// A bridge like `RocketSource::connect` builds, without a consumer; its dead-letter
    /// producer is never used here (nothing is rejected).
    async fn bridge() -> (Arc<Bridge>, ChannelSource, watch::Sender<bool>) {
        let dlq = Arc::new(DeadLetters {
            topic: format!("%DLQ%{GROUP}"),
            publisher: RocketPublisher::connect(crate::RocketPublisherConfig::new(
                "127.0.0.1:9",
                "budget-test-dlq",
            ))
            .await
            .expect("an unconnected dead-letter producer"),
        });
        let (tx, inner) = channel_source(8);
        let (closing, closed) = watch::channel(false);
        let bridge = Arc::new(Bridge {
            timers: tokio::runtime::Handle::current(),
            tx,
            closed,
            active: Arc::new(AtomicUsize::new(0)),
            idle: Arc::new(Notify::new()),
            dlq,
            progress: Arc::new(Progress::default()),
        });
        (bridge, inner, closing)
    }

    fn quick_config() -> ConsumerConfig {
        ConsumerConfig {
            store_backoff: Duration::from_millis(20),
            store_backoff_max: Duration::from_millis(50),
            store_retries: 1,
            retry: RetryPolicy::fixed(Duration::from_millis(50)),
            ..ConsumerConfig::default()
        }
    }

    /// Calls the concurrent listener on a blocking thread, as the client does.
    fn concurrently(bridge: &Arc<Bridge>, m: MessageExt) -> JoinHandle<ConsumeConcurrentlyStatus> {
        let listener = Concurrent(bridge.clone());
        std::thread::spawn(move || {
            let ctx = ConsumeConcurrentlyContext::new(MessageQueue::default());
            listener
                .consume_message(&[&m], &ctx)
                .expect("listener status")
        })
    }

    /// Calls the orderly listener on a blocking thread, as the client does.
    fn orderly(bridge: &Arc<Bridge>, m: MessageExt) -> JoinHandle<ConsumeOrderlyStatus> {
        let listener = Orderly(bridge.clone());
        std::thread::spawn(move || {
            let mut ctx = ConsumeOrderlyContext::new(MessageQueue::default());
            listener
                .consume_message(&[&m], &mut ctx)
                .expect("listener status")
        })
    }

    async fn until(what: &str, within: Duration, done: impl Fn() -> bool) {
        let deadline = tokio::time::Instant::now() + within;
        while !done() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{what} within {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The store is down for a while: the engine nacks the message again and again (store
    /// unavailable), and the listener must keep it instead of answering the broker; once the
    /// store is back, the message is applied once and the listener answers success.
    /// Only a closing source gives a message back to the broker; every nack is held.
    #[test]
    fn only_a_closing_source_gives_a_message_back() {
        let d = Duration::from_secs(3);
        let nack = Settlement::Nack(d);
        let failed_dlq = Settlement::Reject("the dead-letter send failed".into());
        assert_eq!(step(Some(&Settlement::Ack), false), Step::Done);
        assert_eq!(step(Some(&Settlement::Ack), true), Step::Done);
        assert_eq!(step(Some(&nack), false), Step::Hold(d));
        assert_eq!(step(Some(&failed_dlq), false), Step::Hold(ABANDONED_RETRY));
        assert_eq!(
            step(Some(&Settlement::Abandoned), false),
            Step::Hold(ABANDONED_RETRY)
        );
        assert_eq!(step(None, false), Step::Hold(ABANDONED_RETRY));
        assert_eq!(step(Some(&nack), true), Step::GiveBack(d));
        assert_eq!(
            step(Some(&Settlement::Abandoned), true),
            Step::GiveBack(ABANDONED_RETRY)
        );
        assert_eq!(step(None, true), Step::GiveBack(ABANDONED_RETRY));
    }

    /// A message the engine dead-letters while the dead-letter topic cannot be reached (here
    /// the dead-letter producer's name server does not exist): each failed reject comes back
    /// as a nack, and the listener must not hold it for good; after a few failed sends it
    /// gives the message back to the broker, whose reconsume levels bound it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dead_letter_that_cannot_be_sent_goes_back_to_the_broker_not_held_for_good() {
        let (bridge, mut source, _closing) = bridge().await;
        let runs = Arc::new(AtomicU32::new(0));
        let counter = runs.clone();
        let consumer = IdempotentConsumer::new(
            Arc::new(MemoryStore::new()),
            KeyStrategy::dedup_header(GROUP).expect("keys"),
            move |_m: ClaimedMessage| {
                let counter = counter.clone();
                async move {
                    counter.fetch_add(1, Ordering::SeqCst);
                    Err::<Option<bytes::Bytes>, _>(HandlerError::permanent("a malformed payment"))
                }
            },
        )
        .with_config(quick_config());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let engine = consumer.clone();
        let run = tokio::spawn(async move {
            let _ = engine
                .run(&mut source, async move {
                    let _ = stopped.await;
                })
                .await;
        });
        let listener = concurrently(&bridge, message("pay-poison"));
        until(
            "the listener gives the message back",
            Duration::from_secs(120),
            || listener.is_finished(),
        )
        .await;
        assert_eq!(
            listener.join().expect("listener"),
            ConsumeConcurrentlyStatus::ReconsumeLater,
            "given back to the broker, not acked: the message was never dead-lettered"
        );
        assert!(
            runs.load(Ordering::SeqCst) >= 1,
            "the handler ran before the dead-letter was tried"
        );
        let _ = stop.send(());
        let _ = run.await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_store_outage_spends_none_of_the_reconsume_budget() {
        for mode in [ConsumeMode::Concurrently, ConsumeMode::Orderly] {
            let store = Arc::new(SwitchableStore::new(Arc::new(MemoryStore::new())));
            store.set_down(true);
            let (bridge, mut source, _closing) = bridge().await;
            let applied = Arc::new(AtomicU32::new(0));
            let counter = applied.clone();
            let consumer = IdempotentConsumer::new(
                store.clone(),
                KeyStrategy::dedup_header(GROUP).expect("keys"),
                move |_m: ClaimedMessage| {
                    let counter = counter.clone();
                    async move {
                        counter.fetch_add(1, Ordering::SeqCst);
                        Ok::<_, HandlerError>(None)
                    }
                },
            )
            .with_config(quick_config());
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let engine = consumer.clone();
            let run = tokio::spawn(async move {
                let _ = engine
                    .run(&mut source, async move {
                        let _ = stopped.await;
                    })
                    .await;
            });
            let (concurrent, ordered) = match mode {
                ConsumeMode::Concurrently => (Some(concurrently(&bridge, message("pay-1"))), None),
                ConsumeMode::Orderly => (None, Some(orderly(&bridge, message("pay-1")))),
            };
            let answered = || {
                concurrent.as_ref().is_some_and(|t| t.is_finished())
                    || ordered.as_ref().is_some_and(|t| t.is_finished())
            };
            until(
                "three store-outage nacks, or an answer to the broker",
                Duration::from_secs(30),
                || consumer.stats().store_unavailable >= 3 || answered(),
            )
            .await;
            if answered() {
                let status = match (concurrent, ordered) {
                    (Some(t), _) => format!("{:?}", t.join().expect("listener")),
                    (_, Some(t)) => format!("{:?}", t.join().expect("listener")),
                    _ => unreachable!(),
                };
                panic!(
                    "{mode:?}: the listener answered {status} after {} store-outage nack(s): \
                     the broker counts that as one of max_reconsume_times, so an outage long \
                     enough sends an unprocessed message to %DLQ% without a reason",
                    consumer.stats().store_unavailable
                );
            }
            assert_eq!(
                applied.load(Ordering::SeqCst),
                0,
                "nothing ran while the store was down"
            );
            store.set_down(false);
            until("the listener answers", Duration::from_secs(30), answered).await;
            match (concurrent, ordered) {
                (Some(t), _) => assert_eq!(
                    t.join().expect("listener"),
                    ConsumeConcurrentlyStatus::ConsumeSuccess
                ),
                (_, Some(t)) => {
                    assert_eq!(t.join().expect("listener"), ConsumeOrderlyStatus::Success)
                }
                _ => unreachable!(),
            }
            assert_eq!(
                applied.load(Ordering::SeqCst),
                1,
                "{mode:?}: applied once after the outage"
            );
            let _ = stop.send(());
            let _ = run.await;
        }
    }

    /// The source closes (as `close` and a drop do) while the listener holds a nacked
    /// message: the close goes through at once and the listener gives the message back.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn closing_while_a_message_is_held_gives_it_back_at_once() {
        let store = Arc::new(SwitchableStore::new(Arc::new(MemoryStore::new())));
        store.set_down(true);
        let (bridge, mut source, closing) = bridge().await;
        let consumer = IdempotentConsumer::new(
            store.clone(),
            KeyStrategy::dedup_header(GROUP).expect("keys"),
            |_m: ClaimedMessage| async { Ok::<_, HandlerError>(None) },
        )
        .with_config(ConsumerConfig {
            // The store-outage nack waits this long: the listener is holding when it closes.
            store_backoff: Duration::from_secs(5),
            store_backoff_max: Duration::from_secs(5),
            store_retries: 0,
            ..quick_config()
        });
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let engine = consumer.clone();
        let run = tokio::spawn(async move {
            let _ = engine
                .run(&mut source, async move {
                    let _ = stopped.await;
                })
                .await;
        });
        let listener = concurrently(&bridge, message("pay-3"));
        until("a store-outage nack", Duration::from_secs(30), || {
            consumer.stats().store_unavailable >= 1
        })
        .await;
        assert!(!listener.is_finished(), "the nacked message is held");
        // From a thread of its own: a close that blocks must fail the test, not hang it.
        let (sent_tx, sent) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = closing.send(true);
            let _ = sent_tx.send(());
        });
        let closed =
            tokio::task::spawn_blocking(move || sent.recv_timeout(Duration::from_secs(10)))
                .await
                .expect("waiting thread");
        assert!(
            closed.is_ok(),
            "closing the source blocked while the listener held a message"
        );
        until("the listener answers", Duration::from_secs(10), || {
            listener.is_finished()
        })
        .await;
        assert_eq!(
            listener.join().expect("listener"),
            ConsumeConcurrentlyStatus::ReconsumeLater,
            "a closing source gives the message back"
        );
        let _ = stop.send(());
        let _ = run.await;
    }

    /// Another worker holds the key (a live lease elsewhere): the engine nacks "in flight";
    /// the listener keeps the message, and once the other worker completed the key the copy
    /// is acked as a duplicate, never given back to the broker.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_message_in_flight_elsewhere_is_kept_not_given_back() {
        let store = Arc::new(MemoryStore::new());
        let key = DedupKey::new(&ConsumerGroup::new(GROUP).expect("group"), "pay-2").expect("key");
        let other = match store
            .claim(&ClaimRequest::new(key.clone(), Duration::from_secs(30)))
            .await
        {
            Ok(ClaimOutcome::Acquired(l)) => l,
            o => panic!("the other worker's claim: {o:?}"),
        };
        let (bridge, mut source, _closing) = bridge().await;
        let applied = Arc::new(AtomicU32::new(0));
        let counter = applied.clone();
        let consumer = IdempotentConsumer::new(
            store.clone(),
            KeyStrategy::dedup_header(GROUP).expect("keys"),
            move |_m: ClaimedMessage| {
                let counter = counter.clone();
                async move {
                    counter.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, HandlerError>(None)
                }
            },
        )
        .with_config(ConsumerConfig {
            in_flight_delay_max: Duration::from_millis(100),
            ..quick_config()
        });
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let engine = consumer.clone();
        let run = tokio::spawn(async move {
            let _ = engine
                .run(&mut source, async move {
                    let _ = stopped.await;
                })
                .await;
        });
        let listener = concurrently(&bridge, message("pay-2"));
        until(
            "two in-flight nacks, or an answer to the broker",
            Duration::from_secs(30),
            || consumer.stats().in_flight >= 2 || listener.is_finished(),
        )
        .await;
        assert!(
            !listener.is_finished(),
            "the listener answered {:?} after {} in-flight nack(s): the broker counts each as \
             one of max_reconsume_times",
            listener.join().expect("listener"),
            consumer.stats().in_flight
        );
        store
            .complete(&key, other.token, None, Duration::from_secs(3600))
            .await
            .expect("the other worker completes");
        until("the listener answers", Duration::from_secs(30), || {
            listener.is_finished()
        })
        .await;
        assert_eq!(
            listener.join().expect("listener"),
            ConsumeConcurrentlyStatus::ConsumeSuccess
        );
        assert_eq!(
            applied.load(Ordering::SeqCst),
            0,
            "a duplicate: not run here"
        );
        assert!(consumer.stats().duplicates >= 1);
        let _ = stop.send(());
        let _ = run.await;
    }
}
