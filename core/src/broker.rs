//! An in-process broker with RabbitMQ-like semantics and fault injection, for the embedded
//! demo and for engine tests.
//!
//! Deliveries stay unacked until settled; when a subscriber is dropped (a consumer crash)
//! its unacked deliveries go back to the queue marked redelivered, as RabbitMQ does when a
//! channel closes. [`Faults`] inject what real brokers do to consumers: lost acks (the broker
//! redelivers a message the consumer acked).
//!
//! With [`MemoryBroker::set_ordering`] it keeps order per lane (partition or ordering key, as
//! the engine's [`DeliveryOrder`]): a message sent back returns to its original place, and
//! the lane's later messages wait while it is delayed or held by another subscriber, as a
//! Kafka partition or a RocketMQ orderly queue would.
//!
//! It is also a [`Publisher`]: the dedup key goes into the [`DEDUP_HEADER`](crate::DEDUP_HEADER)
//! header and `message_id`, like the AMQP adapter does.

use crate::engine::DeliveryOrder;
use crate::envelope::{BrokerKind, Envelope, Position};
use crate::publish::{OutgoingMessage, PublishError, PublishReceipt, Publisher};
use crate::source::{Delivery, Settle, Source, SourceError};
use async_trait::async_trait;
use rand::{Rng, SeedableRng};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;

/// Faults the broker injects.
#[derive(Debug, Clone, Copy, Default)]
pub struct Faults {
    /// Probability that an ack is lost and the message redelivered anyway.
    pub lost_ack_rate: f64,
    /// Probability that a publish is stored twice (a producer retry after a lost publish
    /// confirm).
    pub duplicate_publish_rate: f64,
}

/// A dead-lettered message and why.
#[derive(Debug, Clone)]
pub struct DeadLetter {
    /// The message.
    pub envelope: Envelope,
    /// The reason given to `reject`.
    pub reason: String,
}

struct Stored {
    envelope: Envelope,
    deliveries: u32,
    /// Publish order: an ordered broker puts a message back at this place.
    seq: u64,
    lane: Option<Vec<u8>>,
}

struct State {
    ready: VecDeque<Stored>,
    delayed: Vec<(Instant, Stored)>,
    unacked: HashMap<u64, (u64, Stored)>,
    dead: Vec<DeadLetter>,
    next_tag: u64,
    next_offset: i64,
    next_seq: u64,
    next_session: u64,
    acked: u64,
    faults: Faults,
    ordering: DeliveryOrder,
    rng: rand::rngs::StdRng,
}

impl State {
    fn lane_of(&self, env: &Envelope) -> Option<Vec<u8>> {
        match self.ordering {
            DeliveryOrder::Unordered => None,
            DeliveryOrder::PerPartition => Some(
                format!("{}/{}", env.source.name, env.source.partition.unwrap_or(0)).into_bytes(),
            ),
            DeliveryOrder::PerKey => env.effective_ordering_key().map(|k| {
                let mut l = env.source.name.as_bytes().to_vec();
                l.push(0);
                l.extend_from_slice(k);
                l
            }),
        }
    }

    fn store(&mut self, envelope: Envelope) {
        let lane = self.lane_of(&envelope);
        self.next_seq += 1;
        self.ready.push_back(Stored {
            envelope,
            deliveries: 0,
            seq: self.next_seq,
            lane,
        });
    }

    /// Back to ready: at its original place when ordered, else at the end.
    fn requeue(&mut self, s: Stored) {
        if self.ordering == DeliveryOrder::Unordered {
            self.ready.push_back(s);
        } else {
            let at = self.ready.partition_point(|r| r.seq < s.seq);
            self.ready.insert(at, s);
        }
    }

    /// Whether `s` must wait: an earlier message of its lane is delayed, or held by another
    /// subscriber, or still ready ahead of it.
    fn lane_blocked(
        &self,
        s: &Stored,
        session: u64,
        blocked: &std::collections::HashSet<Vec<u8>>,
    ) -> bool {
        let Some(lane) = &s.lane else { return false };
        blocked.contains(lane)
            || self
                .delayed
                .iter()
                .any(|(_, d)| d.lane.as_ref() == Some(lane))
            || self
                .unacked
                .values()
                .any(|(sess, u)| *sess != session && u.lane.as_ref() == Some(lane))
    }
}
struct Shared {
    state: Mutex<State>,
    notify: Notify,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding this lock leaves plain data behind; keep going.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The in-process broker: one queue, any number of subscribers.
#[derive(Clone)]
pub struct MemoryBroker {
    shared: Arc<Shared>,
}

impl Default for MemoryBroker {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryBroker {
    /// An empty broker.
    pub fn new() -> Self {
        Self::with_seed(0x1dea)
    }

    /// An empty broker whose fault injection follows `seed`.
    pub fn with_seed(seed: u64) -> Self {
        Self {
            shared: Arc::new(Shared {
                state: Mutex::new(State {
                    ready: VecDeque::new(),
                    delayed: Vec::new(),
                    unacked: HashMap::new(),
                    dead: Vec::new(),
                    next_tag: 1,
                    next_offset: 0,
                    next_seq: 0,
                    next_session: 1,
                    acked: 0,
                    faults: Faults::default(),
                    ordering: DeliveryOrder::Unordered,
                    rng: rand::rngs::StdRng::seed_from_u64(seed),
                }),
                notify: Notify::new(),
            }),
        }
    }

    /// Sets the faults to inject from now on.
    pub fn set_faults(&self, faults: Faults) {
        self.shared.lock().faults = faults;
    }

    /// Keeps order per lane from now on (see the module docs); `Unordered` (the default)
    /// redelivers sent-back messages at the end of the queue.
    pub fn set_ordering(&self, ordering: DeliveryOrder) {
        self.shared.lock().ordering = ordering;
    }

    /// Enqueues a message (its broker kind becomes `Memory`, its position the next offset,
    /// which is returned).
    pub fn publish(&self, mut envelope: Envelope) -> i64 {
        let mut st = self.shared.lock();
        envelope.broker = BrokerKind::MEMORY;
        let offset = st.next_offset;
        envelope.source.position = Some(Position::Offset(offset));
        st.next_offset += 1;
        let rate = st.faults.duplicate_publish_rate.clamp(0.0, 1.0);
        if rate > 0.0 && st.rng.gen_bool(rate) {
            let mut copy = envelope.clone();
            copy.source.position = Some(Position::Offset(st.next_offset));
            st.next_offset += 1;
            st.store(copy);
        }
        st.store(envelope);
        drop(st);
        self.shared.notify.notify_waiters();
        offset
    }

    /// A new subscriber (a consumer connection).
    pub fn subscribe(&self) -> MemorySource {
        let mut st = self.shared.lock();
        let session = st.next_session;
        st.next_session += 1;
        MemorySource {
            shared: self.shared.clone(),
            session,
        }
    }

    /// Messages not yet acked or dead-lettered (ready, delayed or unacked).
    pub fn pending(&self) -> usize {
        let st = self.shared.lock();
        st.ready.len() + st.delayed.len() + st.unacked.len()
    }

    /// Messages stored so far, injected duplicates included.
    pub fn published(&self) -> u64 {
        self.shared.lock().next_offset as u64
    }

    /// Acks received (including lost ones).
    pub fn acked(&self) -> u64 {
        self.shared.lock().acked
    }

    /// Dead-lettered messages.
    pub fn dead_letters(&self) -> Vec<DeadLetter> {
        self.shared.lock().dead.clone()
    }
}

#[async_trait]
impl Publisher for MemoryBroker {
    /// Stores the message at once (the broker is in-process: a confirm cannot be lost).
    async fn publish(&self, msg: OutgoingMessage) -> Result<PublishReceipt, PublishError> {
        if msg.destination.is_empty() {
            return Err(PublishError::Unroutable(
                "empty destination: name the queue".into(),
            ));
        }
        let mut env = Envelope::new(
            BrokerKind::MEMORY,
            msg.destination.clone(),
            msg.payload.clone(),
        );
        env.headers = msg.wire_headers();
        env.key = msg.key.clone();
        env.ordering_key = msg.ordering_key.clone();
        env.message_id = msg.dedup_key.clone();
        env.timestamp_ms = Some(crate::store::now_ms());
        let offset = MemoryBroker::publish(self, env);
        Ok(PublishReceipt {
            destination: msg.destination,
            partition: None,
            position: Some(Position::Offset(offset)),
            message_id: None,
        })
    }
}

/// A subscription to a [`MemoryBroker`]. Dropping or closing it requeues its unacked
/// deliveries (their settlements then do nothing).
pub struct MemorySource {
    shared: Arc<Shared>,
    session: u64,
}

impl MemorySource {
    fn requeue_mine(&self) {
        let mut st = self.shared.lock();
        let mut mine: Vec<u64> = st
            .unacked
            .iter()
            .filter(|(_, (s, _))| *s == self.session)
            .map(|(t, _)| *t)
            .collect();
        // Newest first, each pushed to the front: the oldest ends up first.
        mine.sort_unstable_by(|a, b| b.cmp(a));
        for tag in mine {
            if let Some((_, stored)) = st.unacked.remove(&tag) {
                if st.ordering == DeliveryOrder::Unordered {
                    st.ready.push_front(stored);
                } else {
                    st.requeue(stored);
                }
            }
        }
        drop(st);
        self.shared.notify.notify_waiters();
    }
}

impl Drop for MemorySource {
    fn drop(&mut self) {
        self.requeue_mine();
    }
}

#[async_trait]
impl Source for MemorySource {
    /// Waits for ready messages; returns `None` only when nothing is pending at all
    /// (ready, delayed or unacked anywhere), which ends `run_until_idle`.
    async fn poll(&mut self, max: usize) -> Result<Option<Vec<Delivery>>, SourceError> {
        loop {
            let notified = self.shared.notify.notified();
            let wait_until = {
                let mut st = self.shared.lock();
                let now = Instant::now();
                let mut i = 0;
                while i < st.delayed.len() {
                    if st.delayed[i].0 <= now {
                        let (_, s) = st.delayed.swap_remove(i);
                        st.requeue(s);
                    } else {
                        i += 1;
                    }
                }
                let mut out = Vec::new();
                let mut skipped: Vec<Stored> = Vec::new();
                let mut blocked = std::collections::HashSet::new();
                while out.len() < max.max(1) {
                    let Some(mut s) = st.ready.pop_front() else {
                        break;
                    };
                    if st.lane_blocked(&s, self.session, &blocked) {
                        // Everything after it in its lane waits too.
                        if let Some(l) = &s.lane {
                            blocked.insert(l.clone());
                        }
                        skipped.push(s);
                        continue;
                    }
                    s.deliveries += 1;
                    let tag = st.next_tag;
                    st.next_tag += 1;
                    let mut env = s.envelope.clone();
                    env.delivery_count = Some(s.deliveries);
                    env.redelivered = s.deliveries > 1;
                    st.unacked.insert(tag, (self.session, s));
                    out.push(Delivery::new(
                        env,
                        Box::new(MemorySettle {
                            shared: self.shared.clone(),
                            tag,
                        }),
                    ));
                }
                for s in skipped.into_iter().rev() {
                    st.ready.push_front(s);
                }
                if !out.is_empty() {
                    return Ok(Some(out));
                }
                if st.ready.is_empty() && st.delayed.is_empty() && st.unacked.is_empty() {
                    return Ok(None);
                }
                st.delayed.iter().map(|(t, _)| *t).min()
            };
            // Wake on publish/settle, at the next delayed message, or after a while anyway.
            let until = wait_until.unwrap_or_else(|| Instant::now() + Duration::from_millis(200));
            tokio::select! {
                _ = notified => {}
                _ = tokio::time::sleep_until(until) => {}
            }
        }
    }

    /// Requeues this subscriber's unsettled deliveries. The subscription stays usable (a
    /// later poll is a reconnect), which tests that run an engine twice rely on.
    async fn close(&mut self) -> Result<(), SourceError> {
        self.requeue_mine();
        Ok(())
    }
}

struct MemorySettle {
    shared: Arc<Shared>,
    tag: u64,
}

impl MemorySettle {
    /// The delivery, unless it went stale (its subscriber closed and it was requeued, or it
    /// was settled already): then `None`, and the settlement does nothing.
    fn take(&self, st: &mut State) -> Option<Stored> {
        st.unacked.remove(&self.tag).map(|(_, s)| s)
    }
}

#[async_trait]
impl Settle for MemorySettle {
    async fn ack(&mut self) -> Result<(), SourceError> {
        let mut st = self.shared.lock();
        let Some(s) = self.take(&mut st) else {
            return Ok(());
        };
        st.acked += 1;
        let rate = st.faults.lost_ack_rate.clamp(0.0, 1.0);
        let lose = rate > 0.0 && st.rng.gen_bool(rate);
        if lose {
            st.requeue(s);
        }
        drop(st);
        self.shared.notify.notify_waiters();
        Ok(())
    }

    async fn nack(&mut self, redeliver_after: Duration) -> Result<(), SourceError> {
        let mut st = self.shared.lock();
        let Some(s) = self.take(&mut st) else {
            return Ok(());
        };
        st.delayed.push((Instant::now() + redeliver_after, s));
        drop(st);
        self.shared.notify.notify_waiters();
        Ok(())
    }

    async fn reject(&mut self, reason: &str) -> Result<(), SourceError> {
        let mut st = self.shared.lock();
        let Some(s) = self.take(&mut st) else {
            return Ok(());
        };
        st.dead.push(DeadLetter {
            envelope: s.envelope,
            reason: reason.to_string(),
        });
        drop(st);
        self.shared.notify.notify_waiters();
        Ok(())
    }

    fn abandon(&mut self) {
        let mut st = self.shared.lock();
        if let Some(s) = self.take(&mut st) {
            st.requeue(s);
        }
        drop(st);
        self.shared.notify.notify_waiters();
    }

    fn is_stale(&self) -> bool {
        !self.shared.lock().unacked.contains_key(&self.tag)
    }
}
