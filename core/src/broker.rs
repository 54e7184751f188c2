//! An in-process broker with RabbitMQ-like semantics and fault injection, for the embedded
//! demo and for engine tests.
//!
//! Deliveries stay unacked until settled; when a subscriber is dropped (a consumer crash)
//! its unacked deliveries go back to the queue marked redelivered, as RabbitMQ does when a
//! channel closes. [`Faults`] inject what real brokers do to consumers: lost acks (the broker
//! redelivers a message the consumer acked).

use crate::envelope::{BrokerKind, Envelope, Position};
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
}

struct State {
    ready: VecDeque<Stored>,
    delayed: Vec<(Instant, Stored)>,
    unacked: HashMap<u64, (u64, Stored)>,
    dead: Vec<DeadLetter>,
    next_tag: u64,
    next_offset: i64,
    next_session: u64,
    acked: u64,
    faults: Faults,
    rng: rand::rngs::StdRng,
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
                    next_session: 1,
                    acked: 0,
                    faults: Faults::default(),
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

    /// Enqueues a message (its broker kind becomes `Memory`, its position the next offset).
    pub fn publish(&self, mut envelope: Envelope) {
        let mut st = self.shared.lock();
        envelope.broker = BrokerKind::Memory;
        envelope.source.position = Some(Position::Offset(st.next_offset));
        st.next_offset += 1;
        let rate = st.faults.duplicate_publish_rate.clamp(0.0, 1.0);
        if rate > 0.0 && st.rng.gen_bool(rate) {
            let mut copy = envelope.clone();
            copy.source.position = Some(Position::Offset(st.next_offset));
            st.next_offset += 1;
            st.ready.push_back(Stored {
                envelope: copy,
                deliveries: 0,
            });
        }
        st.ready.push_back(Stored {
            envelope,
            deliveries: 0,
        });
        drop(st);
        self.shared.notify.notify_waiters();
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

/// A subscription to a [`MemoryBroker`]. Dropping it requeues its unacked deliveries.
pub struct MemorySource {
    shared: Arc<Shared>,
    session: u64,
}

impl Drop for MemorySource {
    fn drop(&mut self) {
        let mut st = self.shared.lock();
        let mine: Vec<u64> = st
            .unacked
            .iter()
            .filter(|(_, (s, _))| *s == self.session)
            .map(|(t, _)| *t)
            .collect();
        for tag in mine {
            if let Some((_, stored)) = st.unacked.remove(&tag) {
                st.ready.push_front(stored);
            }
        }
        drop(st);
        self.shared.notify.notify_waiters();
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
                        st.ready.push_back(s);
                    } else {
                        i += 1;
                    }
                }
                if !st.ready.is_empty() {
                    let n = max.max(1).min(st.ready.len());
                    let mut out = Vec::with_capacity(n);
                    for _ in 0..n {
                        let Some(mut s) = st.ready.pop_front() else {
                            break;
                        };
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
                    return Ok(Some(out));
                }
                if st.delayed.is_empty() && st.unacked.is_empty() {
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
}

struct MemorySettle {
    shared: Arc<Shared>,
    tag: u64,
}

impl MemorySettle {
    fn take(&self, st: &mut State) -> Result<Stored, SourceError> {
        st.unacked.remove(&self.tag).map(|(_, s)| s).ok_or_else(|| {
            SourceError::Broker(format!(
                "unknown delivery tag {} (already settled or requeued)",
                self.tag
            ))
        })
    }
}

#[async_trait]
impl Settle for MemorySettle {
    async fn ack(&mut self) -> Result<(), SourceError> {
        let mut st = self.shared.lock();
        let s = self.take(&mut st)?;
        st.acked += 1;
        let rate = st.faults.lost_ack_rate.clamp(0.0, 1.0);
        let lose = rate > 0.0 && st.rng.gen_bool(rate);
        if lose {
            st.ready.push_back(s);
        }
        drop(st);
        self.shared.notify.notify_waiters();
        Ok(())
    }

    async fn nack(&mut self, redeliver_after: Duration) -> Result<(), SourceError> {
        let mut st = self.shared.lock();
        let s = self.take(&mut st)?;
        st.delayed.push((Instant::now() + redeliver_after, s));
        drop(st);
        self.shared.notify.notify_waiters();
        Ok(())
    }

    async fn reject(&mut self, reason: &str) -> Result<(), SourceError> {
        let mut st = self.shared.lock();
        let s = self.take(&mut st)?;
        st.dead.push(DeadLetter {
            envelope: s.envelope,
            reason: reason.to_string(),
        });
        drop(st);
        self.shared.notify.notify_waiters();
        Ok(())
    }
}
