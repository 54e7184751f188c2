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
//! | nack(d) | held on the listener thread for d, then handed to the engine again; past `max_held_nacks` held at once, sent back to the broker's retry topic (delay level ≥ d) | held, always |
//! | reject(reason) | copy to the DLQ topic with the reason, then success | same |
//! | dropped unsettled | held `ABANDONED_RETRY` (1 s), then handed over again (same bound) | same |
//! | source closing | `RECONSUME_LATER` (broker levels: ~10 s, ~30 s, …) | `SUSPEND_CURRENT_QUEUE_A_MOMENT` |
//!
//! **Why a nack is held here.** Every `RECONSUME_LATER` or send-back (and every orderly
//! suspend) spends one of `max_reconsume_times`, after which the broker moves the message to
//! `%DLQ%<group>` without a reason. The engine nacks for reasons that are not failures
//! (another worker holds the key, the store is down, an earlier message of the lane went
//! back), and the settlement does not say which: a store outage of a few hours would
//! dead-letter messages that never ran. So a held nack does not reach the broker: the
//! engine's retry policy, which counts handler failures only (the store's attempt count), is
//! the budget, and its give-up is a reject with a reason. The price: a held message keeps
//! its listener thread and holds back its queue's committed offset (the client pulls on up
//! to `consume_concurrently_max_span`, 2000, past it) until the engine acks or rejects it.
//!
//! **Why only a few.** Held through back-offs of up to minutes, failing messages would take
//! every consume thread and the consumer would stop taking healthy ones. In concurrent mode a
//! source holds at most `max_held_nacks` messages in back-off at once; a nack past that is
//! sent back to the broker's retry topic (`%RETRY%<group>`) with a delay level no shorter
//! than the nack's delay nor than the broker's own level for its next reconsume, and the
//! listener answers success at once, freeing its thread. That one spends a reconsume. In
//! orderly mode nothing is bounded: the queue waits behind its message anyway.

use crate::client::{env, own_client};
use crate::fields::{dead_letter_copy, to_envelope};
use crate::listener_guard::{guarded, poll_or_fatal, ListenerPanic};
use crate::publisher::RocketPublisher;
use crate::RocketError;
use async_trait::async_trait;
use futures::future::BoxFuture;
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
use rocketmq_model::common::message::message_queue::MessageQueue;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
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

/// The broker's delay levels (its default `messageDelayLevel`, `1s 5s 10s 30s 1m 2m 3m 4m 5m
/// 6m 7m 8m 9m 10m 20m 30m 1h 2h`), level 1 first.
const DELAY_LEVELS: [Duration; 18] = [
    Duration::from_secs(1),
    Duration::from_secs(5),
    Duration::from_secs(10),
    Duration::from_secs(30),
    Duration::from_secs(60),
    Duration::from_secs(2 * 60),
    Duration::from_secs(3 * 60),
    Duration::from_secs(4 * 60),
    Duration::from_secs(5 * 60),
    Duration::from_secs(6 * 60),
    Duration::from_secs(7 * 60),
    Duration::from_secs(8 * 60),
    Duration::from_secs(9 * 60),
    Duration::from_secs(10 * 60),
    Duration::from_secs(20 * 60),
    Duration::from_secs(30 * 60),
    Duration::from_secs(60 * 60),
    Duration::from_secs(2 * 60 * 60),
];

/// The level the broker picks itself for a message reconsumed `reconsume_times` times so far
/// (`RECONSUME_LATER`: 10 s, then 30 s, 1 min, …).
const BROKER_FIRST_LEVEL: i32 = 3;

/// Longest a listener waits for a send-back to the retry topic (the client's own request
/// timeout is 5 s, and it then tries a plain send of the retry message).
const SEND_BACK_TIMEOUT: Duration = Duration::from_secs(15);

/// The delay level a nack of `delay` is sent back with: the first level not shorter than the
/// delay (so the engine's back-off holds), and never below the level the broker would pick
/// itself (so a run of short nacks, a store outage, spends `max_reconsume_times` no faster
/// than the broker's own schedule would).
fn delay_level(delay: Duration, reconsume_times: i32) -> i32 {
    let covering = DELAY_LEVELS
        .iter()
        .position(|l| *l >= delay)
        .unwrap_or(DELAY_LEVELS.len() - 1);
    let covering = i32::try_from(covering)
        .unwrap_or(i32::MAX)
        .saturating_add(1);
    let brokers = BROKER_FIRST_LEVEL.saturating_add(reconsume_times.max(0));
    let last = i32::try_from(DELAY_LEVELS.len()).unwrap_or(i32::MAX);
    covering.max(brokers).min(last)
}

/// The client's `consume_timeout`, in minutes: a message in a listener call longer than that
/// is sent back by the client (one broker attempt). Messages are held in listener calls
/// while the engine nacks them, so the bound is far off (the engine's retry policy bounds a
/// failing message; a long store outage holds them as long as it lasts).
const CONSUME_TIMEOUT_MINUTES: u64 = 7 * 24 * 60;

/// [`CONSUME_TIMEOUT_MINUTES`] as a duration: also the budget of one listener call on the
/// client's blocking lane (see `client::build`).
pub(crate) const CONSUME_TIMEOUT: Duration = Duration::from_secs(CONSUME_TIMEOUT_MINUTES * 60);

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
    /// Concurrent mode: nacked messages this source keeps on listener threads through their
    /// back-off at once (default 4; at most `consume_threads - 1`, so one thread is always
    /// left for healthy messages). A nack past it goes to the broker's retry topic with a
    /// delay level covering its delay, and its thread is freed at once; that spends one of
    /// `max_reconsume_times`. 0 sends every nack to the broker. Orderly mode holds every
    /// nack (its queue waits behind the message anyway).
    pub max_held_nacks: u32,
    /// Broker-side reconsume attempts before `%DLQ%<group>` (without a reason). The broker
    /// counts the times a message came back through its retry topic: nacks held in the
    /// listener do not spend them; a nack sent back past `max_held_nacks`, and a source
    /// closed with a message in hand, spend one each. The engine's attempt count (the
    /// store's, handler runs) is kept apart and survives the round trip, so keep this above
    /// the retry policy's `max_attempts` for the engine to dead-letter first, with a reason.
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
            max_held_nacks: 4,
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

/// Sends a message back to the broker's retry topic with a delay level (the push consumer's
/// own send-back, as `RECONSUME_LATER` does, but with a level of ours: the listener's context
/// cannot set one).
type SendBack = Box<
    dyn Fn(MessageExt, i32, MessageQueue) -> BoxFuture<'static, Result<(), String>> + Send + Sync,
>;

/// What the listener thread waits on: the settlements, or the source closing.
struct Bridge {
    /// Timers of the held nacks and the send-backs' runtime (the listener threads are not
    /// on a runtime of ours).
    timers: tokio::runtime::Handle,
    tx: ChannelSender,
    closed: watch::Receiver<bool>,
    active: Arc<AtomicUsize>,
    idle: Arc<Notify>,
    dlq: Arc<DeadLetters>,
    progress: Arc<Progress>,
    /// Listener calls holding a nack through its back-off (concurrent mode's bound).
    holds: HoldSlots,
    /// Set once the consumer started; until then a nack past the bound answers "later".
    send_back: OnceLock<SendBack>,
    /// The consumer's `max_reconsume_times`: a send-back of a message that spent them all
    /// lands in `%DLQ%<group>`.
    max_reconsume_times: i32,
}

/// Listener calls that hold a nacked message through its back-off, and how many may at once.
struct HoldSlots {
    taken: AtomicUsize,
    max: usize,
}

impl HoldSlots {
    fn new(max: usize) -> Self {
        Self {
            taken: AtomicUsize::new(0),
            max,
        }
    }

    /// A slot for one back-off, or `None` when all are taken.
    fn take(&self) -> Option<HoldSlot<'_>> {
        self.taken
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < self.max).then_some(n + 1)
            })
            .ok()
            .map(|_| HoldSlot(self))
    }
}

/// One back-off's slot, given back when dropped.
struct HoldSlot<'a>(&'a HoldSlots);

impl Drop for HoldSlot<'_> {
    fn drop(&mut self) {
        self.0.taken.fetch_sub(1, Ordering::SeqCst);
    }
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
    /// Success: acked, dead-lettered with its reason, or stored in the retry topic by
    /// `Bridge::send_back`.
    Done,
    /// Give it back to the broker (`RECONSUME_LATER`, or an orderly suspend of that long).
    Later(Duration),
}

/// What a listener call does with its message once the engine settled it (or not).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// Acked, or dead-lettered with its reason by `RocketSettle`: answer success.
    Done,
    /// Keep the message on this listener thread and hand it to the engine again after the
    /// delay: the broker hears nothing, so no reconsume attempt is spent. Past the hold
    /// bound (concurrent mode), send it to the broker's retry topic instead.
    Hold(Duration),
    /// The source is closing: give the message back to the broker.
    GiveBack(Duration),
}

/// The listener's next step for a settlement (`None`: none arrived), the source closing or
/// not. A closing source gives the message back to the broker; every nack — a handler
/// failure, another worker's lease, a store outage, a deferred lane — is to be held (within
/// the hold bound: see `Bridge::consume_inner`).
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
    /// `queue`: the message's queue when a nack past the hold bound may be sent back to the
    /// broker's retry topic (concurrent mode); `None` holds every nack (orderly).
    fn consume(&self, m: &MessageExt, queue: Option<&MessageQueue>) -> Verdict {
        self.active.fetch_add(1, Ordering::SeqCst);
        let later = || Verdict::Later(ABANDONED_RETRY);
        let v = guarded(&self.progress.panicked, m, later, || {
            self.consume_inner(m, queue)
        });
        if self.active.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.idle.notify_waiters();
        }
        v
    }

    fn consume_inner(&self, m: &MessageExt, queue: Option<&MessageQueue>) -> Verdict {
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
                    // The slot is kept through the back-off only, not while the engine runs
                    // the message again: it bounds threads that wait, not threads that work.
                    let slot = match queue {
                        Some(q) => match self.holds.take() {
                            Some(slot) => Some(slot),
                            None => return self.send_back(m, d, q),
                        },
                        None => None,
                    };
                    metrics::counter!("idemq_rocketmq_nacks_held_total").increment(1);
                    let waited = self.hold(d);
                    drop(slot);
                    if !waited {
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

    /// Sends `m`, nacked for `delay` while every hold slot is taken, to the broker's retry
    /// topic with a delay level covering the delay, so this listener thread is free at once.
    /// `Done` once the broker stored it there (the listener answers success: the client
    /// removes the message from its queue, as after its own send-back); `Later` when the
    /// send-back failed or the consumer is not started yet (`RECONSUME_LATER`: the client
    /// tries its own send-back at the broker's level, and if that fails too it consumes the
    /// message again itself after a few seconds).
    fn send_back(&self, m: &MessageExt, delay: Duration, queue: &MessageQueue) -> Verdict {
        let Some(send) = self.send_back.get() else {
            return Verdict::Later(delay);
        };
        let level = delay_level(delay, m.reconsume_times());
        if m.reconsume_times() >= self.max_reconsume_times {
            // The broker's count, not the engine's: only send-backs spent it.
            tracing::warn!(
                topic = %m.topic(),
                reconsume_times = m.reconsume_times(),
                max_reconsume_times = self.max_reconsume_times,
                "a nacked message past the hold bound has no reconsume left: the broker moves \
                 it to %DLQ%<group> without a reason"
            );
        }
        let sent = send(m.clone(), level, queue.clone());
        let task = self
            .timers
            .spawn(async move { tokio::time::timeout(SEND_BACK_TIMEOUT, sent).await });
        let why = match futures::executor::block_on(task) {
            Ok(Ok(Ok(()))) => {
                metrics::counter!("idemq_rocketmq_nacks_sent_back_total").increment(1);
                tracing::debug!(
                    topic = %m.topic(),
                    queue_offset = m.queue_offset(),
                    level,
                    held = self.holds.max,
                    "every hold slot is taken: nacked message sent to the retry topic"
                );
                return Verdict::Done;
            }
            Ok(Ok(Err(e))) => e,
            Ok(Err(_)) => format!("no answer within {SEND_BACK_TIMEOUT:?}"),
            Err(e) => format!("send-back task: {e}"),
        };
        // A send-back that timed out may still have been stored: the second copy the client's
        // own give-back makes is skipped by the store as a duplicate of the same key.
        tracing::warn!(topic = %m.topic(), level, error = %why, "sending a nacked message to the retry topic failed: answering RECONSUME_LATER");
        Verdict::Later(delay)
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
        ctx: &ConsumeConcurrentlyContext,
    ) -> ClientResult<ConsumeConcurrentlyStatus> {
        // Batch size 1; a longer batch is all-or-nothing, so every message must be done.
        let mut all_done = true;
        for m in msgs {
            if let Verdict::Later(_) = self.0.consume(m, Some(ctx.get_message_queue())) {
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
            if let Verdict::Later(d) = self.0.consume(m, None) {
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
        let threads = cfg.consume_threads.max(1);
        let max_held = cfg.max_held_nacks.min(threads - 1);
        let bridge = Arc::new(Bridge {
            timers: env.bridge.clone(),
            tx,
            closed,
            active: active.clone(),
            idle: idle.clone(),
            dlq: dlq.clone(),
            progress: progress.clone(),
            holds: HoldSlots::new(usize::try_from(max_held).unwrap_or(usize::MAX)),
            send_back: OnceLock::new(),
            // The client reads -1 as its default, 16, and sends that to the broker.
            max_reconsume_times: if cfg.max_reconsume_times == -1 {
                16
            } else {
                cfg.max_reconsume_times
            },
        });
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
                consumer.register_message_listener_concurrently(Concurrent(bridge.clone()))
            }
            ConsumeMode::Orderly => {
                consumer.register_message_listener_orderly(Orderly(bridge.clone()))
            }
        }
        consumer
            .start()
            .await
            .map_err(|e| RocketError::Client(format!("consumer {}: {e}", cfg.group)))?;
        if let Some(inner) = consumer.default_mq_push_consumer_impl() {
            // Weak: the consumer holds the listener, which holds the bridge.
            let inner = Arc::downgrade(inner);
            let send_back: SendBack = Box::new(move |mut m, level, queue| {
                let inner = inner.clone();
                Box::pin(async move {
                    let Some(inner) = inner.upgrade() else {
                        return Err("the consumer was shut down".to_string());
                    };
                    inner
                        .send_message_back(&mut m, level, &queue)
                        .await
                        .map_err(|e| e.to_string())
                })
            });
            let _ = bridge.send_back.set(send_back);
        } else {
            tracing::warn!(group = %cfg.group, "the started consumer has no push-consumer core: nacks past the hold bound answer RECONSUME_LATER (the broker's levels)");
        }
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
    //! source, no broker. A nack within the hold bound must not reach the broker as
    //! RECONSUME_LATER / a suspend, each of which spends one of `max_reconsume_times`; past
    //! the bound (concurrent mode) it goes to the retry topic and frees its thread.

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
        bridge_holding(4).await
    }

    /// The same, holding at most `max_held` nacks at once.
    async fn bridge_holding(max_held: usize) -> (Arc<Bridge>, ChannelSource, watch::Sender<bool>) {
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
            holds: HoldSlots::new(max_held),
            send_back: OnceLock::new(),
            max_reconsume_times: 16,
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

    /// A handler that always fails, and an engine that nacks each failure for `backoff`.
    fn always_failing(backoff: Duration) -> IdempotentConsumer<impl idemq_core::Handler> {
        IdempotentConsumer::new(
            Arc::new(MemoryStore::new()),
            KeyStrategy::dedup_header(GROUP).expect("keys"),
            |_m: ClaimedMessage| async {
                Err::<Option<bytes::Bytes>, _>(HandlerError::retryable("test: always fails"))
            },
        )
        .with_config(ConsumerConfig {
            retry: RetryPolicy::fixed(backoff),
            ..quick_config()
        })
    }

    #[test]
    fn a_send_back_level_covers_the_nack_and_never_undercuts_the_brokers_own() {
        // The broker's own level for a first reconsume (10 s) is the floor.
        assert_eq!(delay_level(Duration::ZERO, 0), 3);
        assert_eq!(delay_level(Duration::from_secs(1), 0), 3);
        assert_eq!(delay_level(Duration::from_secs(10), 0), 3);
        // The first level not shorter than the delay: 1 min, 2 min, 5 min.
        assert_eq!(delay_level(Duration::from_secs(60), 0), 5);
        assert_eq!(delay_level(Duration::from_secs(61), 0), 6);
        assert_eq!(delay_level(Duration::from_secs(300), 0), 9);
        // Longer than the last level (2 h): the last.
        assert_eq!(delay_level(Duration::from_secs(3 * 3600), 0), 18);
        // After 5 reconsumes the broker itself would wait 3 min (level 8).
        assert_eq!(delay_level(Duration::from_secs(1), 5), 8);
        assert_eq!(delay_level(Duration::from_secs(1), 40), 18);
    }

    /// One hold slot: the first failing message is held through its minute of back-off; the
    /// second, nacked while the slot is taken, goes to the retry topic at the level covering
    /// the minute and its listener answers success at once (its thread is free); a third whose
    /// send-back fails answers RECONSUME_LATER (the client's own give-back). Closing releases
    /// the held one.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn past_the_hold_bound_a_nack_goes_to_the_retry_topic_and_frees_its_thread() {
        let backoff = Duration::from_secs(60);
        let (bridge, mut source, closing) = bridge_holding(1).await;
        let sent: Arc<std::sync::Mutex<Vec<(String, i32)>>> = Arc::default();
        let refuse = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (record, refusing) = (sent.clone(), refuse.clone());
        let fake: SendBack = Box::new(move |m: MessageExt, level, _queue| {
            let key = m
                .get_user_property(DEDUP_HEADER)
                .map(|k| k.to_string())
                .unwrap_or_default();
            record
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((key, level));
            let refused = refusing.load(Ordering::SeqCst);
            Box::pin(async move {
                if refused {
                    Err("test: the broker refused the send-back".to_string())
                } else {
                    Ok(())
                }
            })
        });
        assert!(bridge.send_back.set(fake).is_ok());
        let consumer = always_failing(backoff);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let engine = consumer.clone();
        let run = tokio::spawn(async move {
            let _ = engine
                .run(&mut source, async move {
                    let _ = stopped.await;
                })
                .await;
        });

        let held = concurrently(&bridge, message("pay-held"));
        until("the first failure", Duration::from_secs(30), || {
            consumer.stats().retried >= 1
        })
        .await;
        let given = concurrently(&bridge, message("pay-given"));
        until(
            "the second listener answers",
            Duration::from_secs(30),
            || given.is_finished(),
        )
        .await;
        assert_eq!(
            given.join().expect("listener"),
            ConsumeConcurrentlyStatus::ConsumeSuccess,
            "stored in the retry topic by the send-back: the client must not send it again"
        );
        assert_eq!(
            sent.lock().unwrap_or_else(|e| e.into_inner()).clone(),
            vec![("pay-given".to_string(), 5)],
            "sent back once, at level 5 (1 min), which covers the back-off"
        );
        assert!(
            !held.is_finished(),
            "the first is held through its back-off"
        );

        refuse.store(true, Ordering::SeqCst);
        let refused = concurrently(&bridge, message("pay-refused"));
        until(
            "the third listener answers",
            Duration::from_secs(30),
            || refused.is_finished(),
        )
        .await;
        assert_eq!(
            refused.join().expect("listener"),
            ConsumeConcurrentlyStatus::ReconsumeLater,
            "a failed send-back falls back to the client's own give-back"
        );

        let _ = closing.send(true);
        until("the held listener answers", Duration::from_secs(10), || {
            held.is_finished()
        })
        .await;
        assert_eq!(
            held.join().expect("listener"),
            ConsumeConcurrentlyStatus::ReconsumeLater
        );
        assert_eq!(
            bridge.holds.taken.load(Ordering::SeqCst),
            0,
            "the slot is free again"
        );
        let _ = stop.send(());
        let _ = run.await;
    }

    /// Orderly mode holds every nack, bound or not: its queue waits behind the message
    /// anyway, and a suspend would spend a reconsume.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn orderly_mode_holds_every_nack_whatever_the_bound() {
        let (bridge, mut source, closing) = bridge_holding(0).await;
        let consumer = always_failing(Duration::from_secs(60));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let engine = consumer.clone();
        let run = tokio::spawn(async move {
            let _ = engine
                .run(&mut source, async move {
                    let _ = stopped.await;
                })
                .await;
        });
        let listener = orderly(&bridge, message("pay-ordered"));
        until("the first failure", Duration::from_secs(30), || {
            consumer.stats().retried >= 1
        })
        .await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!listener.is_finished(), "held on its listener thread");
        let _ = closing.send(true);
        until("the listener answers", Duration::from_secs(10), || {
            listener.is_finished()
        })
        .await;
        assert_eq!(
            listener.join().expect("listener"),
            ConsumeOrderlyStatus::SuspendCurrentQueueAMoment
        );
        let _ = stop.send(());
        let _ = run.await;
    }
}
