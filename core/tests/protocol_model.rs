//! A model of the claim / lease / heartbeat / complete / release protocol, checked with
//! [`stateright`], and two smaller models beside it: the RocketMQ transactional check-back
//! (ROLLBACK only after fencing the local transaction's key) and Kafka Flow 2's
//! revoked-partition rule (records polled before a revocation are dropped); each is
//! described where it is defined, below the claim protocol's tests.
//!
//! # What is modelled
//!
//! * **One store** holding one record per key (one key, or two for the batch model), deciding
//!   every claim with the rules of `evaluate_claim` *on the store's own clock*: no record →
//!   acquire (attempt 1); completed → `Duplicate`; in progress with an ended or released lease
//!   → take over (attempt + 1, `takeover` true unless it was released, as the memory store
//!   answers); otherwise `InFlight`. `complete`, `extend` and `release` are fenced by the token
//!   (`token == attempt`, unique per acquisition within a lifecycle; retention never ends in
//!   the model). A lease that ended but was not taken over still belongs to its token.
//! * **Two workers** running the engine's stages: poll (a batch of one copy of every queued
//!   key) → claim (one round trip) → handlers → complete (one round trip; per key when the batch
//!   is refused) → ack. `InFlight` and `Fenced` nack; a lost reply to a claim or a completion
//!   (the store applied it, the worker saw an error) nacks; a handler failure releases the key
//!   and nacks, or dead-letters once `max_attempts` acquisitions were used (the retry policy
//!   reads the store's attempt); a handler cancelled because its lease is lost gets the same
//!   retry policy but leaves its lease to expire (so the next run is a takeover); so does a
//!   key whose completion the store refuses (its effect ran).
//! * **A broker** that delivers at least once: every copy is acked, nacked (redelivered),
//!   rejected (dead-lettered), or redelivered when the worker holding it crashes; a
//!   `Duplicate` fault adds a copy at any moment (a producer retry or a lost ack).
//! * **Faults, each from a bounded budget**: a worker crash at every step (between poll and
//!   claim, mid-handler, between the effect and the completion, between the completion and
//!   the ack), a lost claim or completion reply, a failed heartbeat extend, a duplicate
//!   delivery. A handler may stall for as long as the scheduler likes (it is just not
//!   scheduled while time passes).
//! * **Time.** One tick is one heartbeat period; a lease is `LEASE` = 3 beats (the default: lease / 3) and the engine
//!   gives a lease up `MARGIN` = 1 beat before its end (the real engine: `min(beat, lease/2)`).
//!   Times are kept *relative* to the store's clock (remaining beats), so the clock itself is
//!   unbounded but the state space is finite. A tick ends every lease one beat closer, then
//!   runs each worker's heartbeat: every lease it holds (handler running, or done and waiting
//!   for its completion) is extended (the store answers `Extended` or `Fenced`) or the extend
//!   fails (budget). Then the lease watch of `lease.rs`: a lease whose end is within the
//!   margin is marked lost. The worker times that end on its own monotonic clock from the
//!   start of the call that granted or extended the lease, never by reading the store's lease
//!   end against its wall clock, so a wall-clock skew between worker and store plays no part
//!   and is not modelled (the SQL and Redis stores' tests skew the client an hour each way).
//!   The watch runs in the same step as the tick: it has its own timer, so a heartbeat
//!   hanging on the store does not delay it (`core/tests/foundation.rs`).
//!   A tick that changes nothing is not an action, so a quiet system has no successor.
//!
//! # Properties
//!
//! * always — *at most one completion commits per key*: at most one token is ever answered
//!   `Completed`;
//! * always — *no message is acked before its key's record is durable*;
//! * always — *no effect after the lease was taken over*: a handler never performs its
//!   external effect once its token has been superseded at the store (two handlers never
//!   overlap on one key);
//! * always — *a repeated effect is signalled*: an effect on a key that already had one is
//!   performed by an acquisition with `attempt > 1` (so the handler was told an earlier attempt
//!   may have started the effect);
//! * eventually — *every message is acked or dead-lettered* (bounded liveness, below).
//!
//! And, as a documented **non-property** (a `sometimes` that the checker must *find*): an
//! external effect CAN run twice, even in the fixed protocol — a crash, a lost lease or a
//! refused completion between the effect and its durable completion makes the next attempt
//! run the effect again. Only effects written in the same transaction as the completion
//! (`complete_in_tx`, the outbox) are fenced; external effects are only *signalled*
//! (`attempt > 1`, `takeover`, the lease watch). A second `sometimes` shows what `takeover`
//! covers: it says whether the *previous* attempt may have started effects (its lease
//! expired: crash, stall, cut off, refused completion, none of which releases the key). An
//! attempt whose handler failed cleanly releases the key, so the attempt after it says
//! `takeover == false` even when an attempt before that one ran the effect and crashed; only
//! `attempt > 1` signals every repeat.
//!
//! What the lease watch buys: without it (variant [`Variant::HandlerNotCancelled`], bug 2) a
//! stalled handler whose extends fail outlives its lease, the key is taken over,
//! and both handlers perform the effect: the checker finds that counterexample. With the
//! handler cancelled when its lease is lost, that state is unreachable.
//!
//! # Why this liveness formulation
//!
//! `stateright` checks an `eventually` property at *terminal* states only (states with no
//! successor) and does not report cycles. So the model is built so that every run that a
//! fair scheduler could produce is finite, and every infinite run is unfair:
//!
//! * every fault comes from a finite budget;
//! * every acquisition increments the store's attempt counter, and a key cannot be polled
//!   again once it reached `horizon` acquisitions without completing: the model's horizon.
//!   A protocol that loops (bug 1: one refused batch completion re-runs the batch forever)
//!   therefore *ends* at the horizon with the message neither acked nor dead-lettered, which
//!   is a terminal state the checker reports;
//! * a tick that changes nothing is not an action.
//!
//! What is left are cycles that need an unfair scheduler: a handler that never finishes while
//! its heartbeat keeps succeeding, or a duplicate copy that keeps meeting `InFlight` while that
//! handler stalls. `stateright` neither reports nor is misled by those. The property checked is
//! therefore *bounded* liveness: "in every run that ends (every fair run, given the fault
//! budget), every message is acked or dead-lettered within `horizon` acquisitions". The
//! predicate is monotone (a settled message stays settled), so `stateright`'s BFS, which keeps
//! one visit per state, cannot lose a violation at a join of two paths.
//!
//! Run with `cargo test --test protocol_model -- --nocapture` to see the state counts.

use stateright::{Checker, HasDiscoveries, Model, Property};
use std::collections::BTreeSet;
use std::time::Instant;

/// A lease, in heartbeat periods.
const LEASE: i8 = 3;
/// How long before its end (by the worker's clock) the lease watch gives a lease up.
const MARGIN: i8 = 1;
/// Worker count.
const WORKERS: usize = 2;

/// Which protocol the model runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Variant {
    /// Today's protocol: per-key completion fallback, handlers cancelled on lease loss.
    Fixed,
    /// Bug 1 put back: a refused batch completion nacks the whole batch (no per-key fallback,
    /// no retry policy for the refused key).
    NoCompletionFallback,
    /// Bug 2 put back: the heartbeat still notices the lost lease, but the handler is never
    /// told and runs on.
    HandlerNotCancelled,
}

#[derive(Clone, Debug)]
struct ProtocolModel {
    variant: Variant,
    /// Keys (one message each): 1, or 2 for the batch model.
    keys: u8,
    /// A key whose completion the store refuses (a result over `max_allowed_packet`): in a
    /// batch of more than one, and alone.
    poison: Option<u8>,
    crashes: u8,
    lost_replies: u8,
    extend_failures: u8,
    duplicates: u8,
    /// The retry policy's `max_attempts`.
    max_attempts: u8,
    /// The most acquisitions of one key the model allows (its horizon).
    horizon: u8,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Status {
    InProgress,
    Completed,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Record {
    status: Status,
    /// Token of the latest acquisition; equal to the attempt count.
    token: u8,
    /// Beats left on the lease by the store's clock (`<= 0`: ended).
    lease_rem: i8,
    released: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Phase {
    /// Delivered, not claimed yet.
    Polled,
    /// Acquired; the handler has not made its effect yet.
    Running,
    /// The handler made its effect and succeeded; waiting for the completion.
    Effected,
    /// Completion durable; the ack is not sent yet.
    Acking,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Slot {
    key: u8,
    phase: Phase,
    token: u8,
    takeover: bool,
    /// Lease end as last confirmed by the store, in beats from the store's now.
    known_rem: i8,
    lost: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Worker {
    slots: Vec<Slot>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
struct Msg {
    /// Copies the broker will deliver.
    queued: u8,
    acked: bool,
    dead: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct State {
    store: Vec<Option<Record>>,
    workers: Vec<Worker>,
    broker: Vec<Msg>,
    /// External effects per key (saturating at 3).
    effects: Vec<u8>,
    /// Bit `t`: token `t` was answered `Completed`.
    committed: Vec<u16>,
    early_ack: bool,
    stale_effect: bool,
    unsignalled_repeat: bool,
    repeat_without_takeover: bool,
    crashes: u8,
    lost_replies: u8,
    extend_failures: u8,
    duplicates: u8,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Action {
    Poll(usize),
    Claim {
        w: usize,
        reply_lost: bool,
    },
    Effect {
        w: usize,
        slot: usize,
    },
    HandlerFails {
        w: usize,
        slot: usize,
    },
    Cancel {
        w: usize,
        slot: usize,
    },
    Complete {
        w: usize,
        reply_lost: bool,
    },
    Ack {
        w: usize,
        slot: usize,
    },
    Crash(usize),
    Duplicate(u8),
    /// One heartbeat period; bit `i` of `failing`: the `i`-th held lease's extend fails.
    Tick {
        failing: u8,
    },
}

fn complete_one(s: &mut State, key: u8, token: u8) -> bool {
    match &mut s.store[key as usize] {
        Some(r) if r.token == token && r.status == Status::InProgress && !r.released => {
            r.status = Status::Completed;
            s.committed[key as usize] |= 1 << token;
            true
        }
        Some(r) if r.token == token && r.status == Status::Completed => {
            s.committed[key as usize] |= 1 << token;
            true
        }
        _ => false,
    }
}

fn release(s: &mut State, key: u8, token: u8) {
    if let Some(r) = &mut s.store[key as usize] {
        if r.token == token && r.status == Status::InProgress && !r.released {
            r.released = true;
            r.lease_rem = 0;
        }
    }
}

impl ProtocolModel {
    fn fixed_one_key() -> Self {
        Self {
            variant: Variant::Fixed,
            keys: 1,
            poison: None,
            crashes: 2,
            lost_replies: 1,
            extend_failures: 2,
            duplicates: 2,
            max_attempts: 2,
            horizon: 0,
        }
        .with_horizon()
    }

    /// The horizon: `max_attempts` acquisitions, one more per fault that can end an
    /// acquisition without a verdict of the retry policy (a crash, a lost reply, a lease lost
    /// to a failed extend and then fenced), and one to spare. A protocol that needs more
    /// acquisitions than that to settle a message does not settle it.
    fn with_horizon(mut self) -> Self {
        self.horizon =
            self.max_attempts + self.crashes + self.lost_replies + self.extend_failures + 1;
        self
    }

    fn batch_with_poison(variant: Variant) -> Self {
        Self {
            variant,
            keys: 2,
            poison: Some(1),
            crashes: 1,
            lost_replies: 1,
            extend_failures: 0,
            duplicates: 0,
            max_attempts: 2,
            horizon: 0,
        }
        .with_horizon()
    }

    /// Nack a delivery: the broker redelivers it.
    fn nack(s: &mut State, key: u8) {
        s.broker[key as usize].queued += 1;
    }

    /// Settle an acquisition whose effects may have started (cut off, or its completion
    /// refused) by the retry policy, leaving its lease to expire: the next run is a takeover.
    fn settle_unreleased(&self, s: &mut State, slot: Slot) {
        if slot.token >= self.max_attempts {
            s.broker[slot.key as usize].dead = true;
        } else {
            Self::nack(s, slot.key);
        }
    }

    /// Settle a cleanly failed acquisition (no effect kept) by the retry policy, releasing
    /// its key (the attempt is the token).
    fn give_back(&self, s: &mut State, slot: Slot) {
        release(s, slot.key, slot.token);
        if slot.token >= self.max_attempts {
            s.broker[slot.key as usize].dead = true;
        } else {
            Self::nack(s, slot.key);
        }
    }

    fn ack(s: &mut State, key: u8) {
        let durable = matches!(s.store[key as usize], Some(r) if r.status == Status::Completed);
        if !durable {
            s.early_ack = true;
        }
        s.broker[key as usize].acked = true;
    }

    fn pollable(&self, s: &State, key: u8) -> bool {
        s.broker[key as usize].queued > 0
            && match s.store[key as usize] {
                Some(r) => r.status == Status::Completed || r.token < self.horizon,
                None => true,
            }
    }

    /// Heartbeated leases: (worker, slot).
    fn held(s: &State) -> Vec<(usize, usize)> {
        let mut v = Vec::new();
        for (w, wk) in s.workers.iter().enumerate() {
            for (i, sl) in wk.slots.iter().enumerate() {
                if matches!(sl.phase, Phase::Running | Phase::Effected) && !sl.lost {
                    v.push((w, i));
                }
            }
        }
        v
    }
}

impl Model for ProtocolModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let k = self.keys as usize;
        let mut out = Vec::new();
        {
            out.push(State {
                store: vec![None; k],
                workers: (0..WORKERS).map(|_| Worker { slots: Vec::new() }).collect(),
                broker: vec![
                    Msg {
                        queued: 1,
                        ..Msg::default()
                    };
                    k
                ],
                effects: vec![0; k],
                committed: vec![0; k],
                early_ack: false,
                stale_effect: false,
                unsignalled_repeat: false,
                repeat_without_takeover: false,
                crashes: self.crashes,
                lost_replies: self.lost_replies,
                extend_failures: self.extend_failures,
                duplicates: self.duplicates,
            });
        }
        out
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        for (w, wk) in s.workers.iter().enumerate() {
            if wk.slots.is_empty() {
                if (0..self.keys).any(|k| self.pollable(s, k)) {
                    actions.push(Action::Poll(w));
                }
                continue;
            }
            if s.crashes > 0 {
                actions.push(Action::Crash(w));
            }
            if wk.slots.iter().all(|sl| sl.phase == Phase::Polled) {
                actions.push(Action::Claim {
                    w,
                    reply_lost: false,
                });
                if s.lost_replies > 0 {
                    actions.push(Action::Claim {
                        w,
                        reply_lost: true,
                    });
                }
                continue;
            }
            for (slot, sl) in wk.slots.iter().enumerate() {
                match sl.phase {
                    Phase::Running => {
                        let cancels = sl.lost && self.variant != Variant::HandlerNotCancelled;
                        if cancels {
                            actions.push(Action::Cancel { w, slot });
                        } else {
                            actions.push(Action::Effect { w, slot });
                            actions.push(Action::HandlerFails { w, slot });
                        }
                    }
                    Phase::Acking => actions.push(Action::Ack { w, slot }),
                    _ => {}
                }
            }
            let handlers_done = wk
                .slots
                .iter()
                .all(|sl| matches!(sl.phase, Phase::Effected | Phase::Acking));
            if handlers_done && wk.slots.iter().any(|sl| sl.phase == Phase::Effected) {
                actions.push(Action::Complete {
                    w,
                    reply_lost: false,
                });
                if s.lost_replies > 0 {
                    actions.push(Action::Complete {
                        w,
                        reply_lost: true,
                    });
                }
            }
        }
        if s.duplicates > 0 {
            for k in 0..self.keys {
                actions.push(Action::Duplicate(k));
            }
        }
        let held = Self::held(s).len();
        for failing in 0..(1u8 << held) {
            if failing.count_ones() as u8 <= s.extend_failures {
                actions.push(Action::Tick { failing });
            }
        }
    }

    fn next_state(&self, s: &State, action: Action) -> Option<State> {
        let mut n = s.clone();
        match action {
            Action::Poll(w) => {
                for k in 0..self.keys {
                    if self.pollable(s, k) {
                        n.broker[k as usize].queued -= 1;
                        n.workers[w].slots.push(Slot {
                            key: k,
                            phase: Phase::Polled,
                            token: 0,
                            takeover: false,
                            known_rem: 0,
                            lost: false,
                        });
                    }
                }
            }
            Action::Claim { w, reply_lost } => {
                if reply_lost {
                    n.lost_replies -= 1;
                }
                let slots = std::mem::take(&mut n.workers[w].slots);
                for mut sl in slots {
                    let k = sl.key as usize;
                    // `evaluate_claim`, on the store's clock.
                    let acquired = match n.store[k] {
                        None => Some((1, false)),
                        Some(r) if r.status == Status::Completed => None,
                        Some(r) if r.released || r.lease_rem <= 0 => {
                            Some((r.token + 1, !r.released))
                        }
                        Some(_) => None,
                    };
                    if let Some((token, takeover)) = acquired {
                        n.store[k] = Some(Record {
                            status: Status::InProgress,
                            token,
                            lease_rem: LEASE,
                            released: false,
                        });
                        sl.token = token;
                        sl.takeover = takeover;
                        sl.known_rem = LEASE;
                        sl.phase = Phase::Running;
                    }
                    if reply_lost {
                        // The store applied the claim; the worker saw an error: nack.
                        Self::nack(&mut n, sl.key);
                    } else if acquired.is_some() {
                        n.workers[w].slots.push(sl);
                    } else if matches!(n.store[k], Some(r) if r.status == Status::Completed) {
                        Self::ack(&mut n, sl.key); // Duplicate
                    } else {
                        Self::nack(&mut n, sl.key); // InFlight
                    }
                }
            }
            Action::Effect { w, slot } => {
                let sl = n.workers[w].slots[slot];
                let k = sl.key as usize;
                if n.effects[k] > 0 {
                    if sl.token <= 1 {
                        n.unsignalled_repeat = true;
                    }
                    if !sl.takeover {
                        n.repeat_without_takeover = true;
                    }
                }
                if !matches!(n.store[k], Some(r) if r.token == sl.token) {
                    n.stale_effect = true;
                }
                n.effects[k] = (n.effects[k] + 1).min(3);
                n.workers[w].slots[slot].phase = Phase::Effected;
            }
            Action::HandlerFails { w, slot } => {
                let sl = n.workers[w].slots.remove(slot);
                self.give_back(&mut n, sl);
            }
            Action::Cancel { w, slot } => {
                // A handler cut off by its lost lease: the lease is left to expire (so the
                // next run is a takeover), and the retry policy settles the delivery.
                let sl = n.workers[w].slots.remove(slot);
                self.settle_unreleased(&mut n, sl);
            }
            Action::Complete { w, reply_lost } => {
                let slots = std::mem::take(&mut n.workers[w].slots);
                let batch: Vec<Slot> = slots
                    .iter()
                    .copied()
                    .filter(|sl| sl.phase == Phase::Effected)
                    .collect();
                let mut keep: Vec<Slot> = slots
                    .into_iter()
                    .filter(|sl| sl.phase != Phase::Effected)
                    .collect();
                let refused = self
                    .poison
                    .is_some_and(|p| batch.iter().any(|sl| sl.key == p));
                if reply_lost && !refused {
                    n.lost_replies -= 1;
                    for sl in &batch {
                        complete_one(&mut n, sl.key, sl.token);
                        Self::nack(&mut n, sl.key);
                    }
                } else if !refused {
                    for mut sl in batch {
                        if complete_one(&mut n, sl.key, sl.token) {
                            sl.phase = Phase::Acking;
                            keep.push(sl);
                        } else {
                            Self::nack(&mut n, sl.key); // Fenced
                        }
                    }
                } else if reply_lost {
                    return None;
                } else if self.variant == Variant::NoCompletionFallback {
                    // Bug 1: the whole batch is nacked; leases run out; taken over; again.
                    for sl in &batch {
                        Self::nack(&mut n, sl.key);
                    }
                } else {
                    // One key at a time; the refused key gets the retry policy.
                    for mut sl in batch {
                        if Some(sl.key) == self.poison {
                            // Its effect ran: not released, so the next run is a takeover.
                            self.settle_unreleased(&mut n, sl);
                        } else if complete_one(&mut n, sl.key, sl.token) {
                            sl.phase = Phase::Acking;
                            keep.push(sl);
                        } else {
                            Self::nack(&mut n, sl.key);
                        }
                    }
                }
                n.workers[w].slots = keep;
            }
            Action::Ack { w, slot } => {
                let sl = n.workers[w].slots.remove(slot);
                Self::ack(&mut n, sl.key);
            }
            Action::Crash(w) => {
                n.crashes -= 1;
                for sl in std::mem::take(&mut n.workers[w].slots) {
                    Self::nack(&mut n, sl.key); // the broker redelivers what was unsettled
                }
            }
            Action::Duplicate(k) => {
                n.duplicates -= 1;
                Self::nack(&mut n, k);
            }
            Action::Tick { failing } => {
                let held = Self::held(s);
                for r in n.store.iter_mut().flatten() {
                    if r.status == Status::InProgress && !r.released && r.lease_rem > 0 {
                        r.lease_rem -= 1;
                    }
                }
                for wk in &mut n.workers {
                    for sl in &mut wk.slots {
                        if matches!(sl.phase, Phase::Running | Phase::Effected) {
                            sl.known_rem = (sl.known_rem - 1).max(-LEASE);
                        }
                    }
                }
                // The heartbeat.
                for (i, &(w, slot)) in held.iter().enumerate() {
                    if failing & (1 << i) != 0 {
                        n.extend_failures -= 1;
                        continue;
                    }
                    let sl = &mut n.workers[w].slots[slot];
                    match &mut n.store[sl.key as usize] {
                        Some(r)
                            if r.token == sl.token
                                && r.status == Status::InProgress
                                && !r.released =>
                        {
                            r.lease_rem = LEASE;
                            sl.known_rem = LEASE;
                        }
                        _ => sl.lost = true, // Fenced
                    }
                }
                // The lease watch: the end, timed on the worker's monotonic clock from the
                // start of the grant (never the store's lease end against the worker's wall
                // clock, so the skew plays no part), is within the margin.
                for &(w, slot) in &held {
                    let sl = &mut n.workers[w].slots[slot];
                    if sl.known_rem <= MARGIN {
                        sl.lost = true;
                    }
                }
                if n == *s {
                    return None;
                }
            }
        }
        Some(n)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(AT_MOST_ONE_COMMIT, |_, s: &State| {
                s.committed.iter().all(|c| c.count_ones() <= 1)
            }),
            Property::always(NO_EARLY_ACK, |_, s: &State| !s.early_ack),
            Property::always(NO_STALE_EFFECT, |_, s: &State| !s.stale_effect),
            Property::always(REPEAT_SIGNALLED, |_, s: &State| !s.unsignalled_repeat),
            Property::eventually(SETTLED, |_, s: &State| {
                s.broker.iter().all(|m| m.acked || m.dead)
            }),
            Property::sometimes(EFFECT_TWICE, |_, s: &State| {
                s.effects.iter().any(|&e| e >= 2)
            }),
            Property::sometimes(REPEAT_WITHOUT_TAKEOVER, |_, s: &State| {
                s.repeat_without_takeover
            }),
        ]
    }
}

const AT_MOST_ONE_COMMIT: &str = "at most one completion commits per key";
const NO_EARLY_ACK: &str = "no message is acked before its key's record is durable";
const NO_STALE_EFFECT: &str = "no effect after the lease was taken over";
const REPEAT_SIGNALLED: &str = "a repeated effect is signalled (attempt > 1)";
const SETTLED: &str = "every message is eventually acked or dead-lettered";
const EFFECT_TWICE: &str = "an external effect runs twice (documented non-property)";
const REPEAT_WITHOUT_TAKEOVER: &str = "a repeated effect with takeover == false";

fn check(
    name: &str,
    model: ProtocolModel,
    stop_at: &[&'static str],
) -> impl Checker<ProtocolModel> {
    let started = Instant::now();
    let mut builder = model.checker().threads(2);
    if !stop_at.is_empty() {
        let wanted: BTreeSet<&'static str> = stop_at.iter().copied().collect();
        builder = builder.finish_when(HasDiscoveries::AllOf(wanted));
    }
    let checker = builder.spawn_bfs().join();
    println!(
        "protocol model [{name}]: {} unique states ({} generated), max depth {}, {:.2?}",
        checker.unique_state_count(),
        checker.state_count(),
        checker.max_depth(),
        started.elapsed()
    );
    assert!(checker.unique_state_count() > 0);
    checker
}

fn show(checker: &impl Checker<ProtocolModel>, property: &'static str) {
    let path = checker
        .discovery(property)
        .unwrap_or_else(|| panic!("expected a discovery for `{property}`"));
    println!(
        "  `{property}`: {} steps",
        path.clone().into_actions().len()
    );
    for a in path.clone().into_actions() {
        println!("    {a:?}");
    }
    println!("    final: {:?}", path.last_state());
}

#[test]
fn fixed_protocol_one_key_holds_every_property() {
    let checker = check("fixed, 1 key", ProtocolModel::fixed_one_key(), &[]);
    for p in [
        AT_MOST_ONE_COMMIT,
        NO_EARLY_ACK,
        NO_STALE_EFFECT,
        REPEAT_SIGNALLED,
        SETTLED,
    ] {
        checker.assert_no_discovery(p);
    }
    // The documented non-properties are reachable: the model does exercise them. A second
    // run that stops at them gives short example paths.
    assert!(checker.discovery(EFFECT_TWICE).is_some());
    assert!(checker.discovery(REPEAT_WITHOUT_TAKEOVER).is_some());
    let examples = check(
        "fixed, 1 key: examples of the non-properties",
        ProtocolModel::fixed_one_key(),
        &[EFFECT_TWICE, REPEAT_WITHOUT_TAKEOVER],
    );
    show(&examples, EFFECT_TWICE);
    show(&examples, REPEAT_WITHOUT_TAKEOVER);
}

#[test]
fn fixed_protocol_two_key_batch_with_a_poison_completion_settles_everything() {
    let checker = check(
        "fixed, 2-key batch, poison completion",
        ProtocolModel::batch_with_poison(Variant::Fixed),
        &[],
    );
    for p in [
        AT_MOST_ONE_COMMIT,
        NO_EARLY_ACK,
        NO_STALE_EFFECT,
        REPEAT_SIGNALLED,
        SETTLED,
    ] {
        checker.assert_no_discovery(p);
    }
}

#[test]
fn bug1_no_per_key_completion_fallback_never_settles() {
    let checker = check(
        "bug 1: no per-key completion fallback",
        ProtocolModel::batch_with_poison(Variant::NoCompletionFallback),
        &[SETTLED],
    );
    show(&checker, SETTLED);
    let path = checker.discovery(SETTLED).unwrap();
    let last = path.last_state();
    assert!(last.broker.iter().any(|m| !m.acked && !m.dead));
}

#[test]
fn bug2_handler_not_cancelled_on_lease_loss_runs_the_effect_twice() {
    let model = ProtocolModel {
        variant: Variant::HandlerNotCancelled,
        ..ProtocolModel::fixed_one_key()
    };
    let checker = check(
        "bug 2: handler not cancelled on lease loss",
        model,
        &[NO_STALE_EFFECT, REPEAT_SIGNALLED],
    );
    show(&checker, NO_STALE_EFFECT);
    show(&checker, REPEAT_SIGNALLED);
    let path = checker.discovery(REPEAT_SIGNALLED).unwrap();
    assert!(path.last_state().effects[0] >= 2, "two effects for one key");
}

/// Runs a BFS over any model and prints its state count in the line format of [`check`].
fn check_any<M>(name: &str, model: M, stop_at: &[&'static str]) -> impl Checker<M>
where
    M: Model + Send + Sync + 'static,
    M::State: Send + Sync + std::hash::Hash + Eq + std::fmt::Debug + Clone,
    M::Action: Send + Sync + std::fmt::Debug + Clone + PartialEq,
{
    let started = Instant::now();
    let mut builder = model.checker().threads(2);
    if !stop_at.is_empty() {
        let wanted: BTreeSet<&'static str> = stop_at.iter().copied().collect();
        builder = builder.finish_when(HasDiscoveries::AllOf(wanted));
    }
    let checker = builder.spawn_bfs().join();
    println!(
        "protocol model [{name}]: {} unique states ({} generated), max depth {}, {:.2?}",
        checker.unique_state_count(),
        checker.state_count(),
        checker.max_depth(),
        started.elapsed()
    );
    assert!(checker.unique_state_count() > 0);
    checker
}

/// Prints the path a checker found for `property` ("counterexample" lines).
fn show_any<M>(checker: &impl Checker<M>, property: &'static str)
where
    M: Model,
    M::State: std::fmt::Debug + Clone + PartialEq + std::hash::Hash,
    M::Action: std::fmt::Debug + Clone + PartialEq,
{
    let path = checker
        .discovery(property)
        .unwrap_or_else(|| panic!("expected a discovery for `{property}`"));
    println!(
        "  counterexample for `{property}`: {} steps",
        path.clone().into_actions().len()
    );
    for a in path.clone().into_actions() {
        println!("    {a:?}");
    }
    println!("    final: {:?}", path.last_state());
}

// ---------------------------------------------------------------------------------------
// RocketMQ transactional check-back
// ---------------------------------------------------------------------------------------
//
// One half message and its local transaction, whose effect and completion commit together
// (`complete_in_tx`: the effect is applied iff the completion's token still owns the key).
// The producer: claim (first thing in the local transaction) → write the effect in its open
// database transaction → complete-and-commit (or `Fenced` → roll back) → tell the broker its
// outcome (a message that can be lost). It may crash at any step (its open transaction rolls
// back) or stall for as long as the scheduler likes while its lease ends on the store's clock
// (`Expire`), then carry on: a paused process, or a slow one in a process whose bound did not
// cancel it. The broker checks the half message back any number of times while it is
// pending, from any producer of the group — also before the local transaction has claimed
// its key (after the broker's transaction timeout, from another producer of the group, while
// the transaction's own process stalls before its claim); nothing can fence a transaction
// that holds no token yet, so the record the check-back leaves must refuse its late claim.
//
// The check-back rules:
// * `Read` (the first version): a read of the record; an ended lease (by the producer's
//   clock, which may also run ahead of the store's) or no record answers ROLLBACK, the store
//   unchanged — the stalled transaction's completion still owns the key.
// * `FencedRelease` (the second): the check-back claims the key; only a claim the store
//   grants (no record, a released key, an ended lease taken over: a new token) answers
//   ROLLBACK, and the key is released; completed → COMMIT; a live lease → UNKNOWN. A
//   transaction that had not claimed yet claims the released key afterwards.
// * `FencedRolledBack` (today's): as `FencedRelease`, but the granted key is recorded rolled
//   back (terminal): a late claim is refused, and a check-back that finds the record answers
//   ROLLBACK again.

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum CheckRule {
    Read,
    FencedRelease,
    FencedRolledBack,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum TxRecord {
    InProgress { token: u8, live: bool },
    Completed,
    RolledBack,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum LocalPhase {
    /// The half message is sent; the local transaction is about to claim.
    Started,
    /// Claimed with `token`.
    Claimed(u8),
    /// The effect is written in the open database transaction.
    Written(u8),
    /// Finished: its outcome, not yet told to the broker.
    Finished(Outcome2),
    /// Told (or the message was lost), or crashed.
    Gone,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Outcome2 {
    Commit,
    Unknown,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Half {
    Pending,
    Committed,
    RolledBack,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct CheckState {
    record: Option<TxRecord>,
    /// Tokens handed out so far (the next claim gets `tokens + 1`).
    tokens: u8,
    local: LocalPhase,
    /// The business effect is committed.
    effect: bool,
    half: Half,
    crashes: u8,
    lost_ends: u8,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum CheckAction {
    Claim,
    Write,
    CompleteAndCommit,
    TellBroker {
        lost: bool,
    },
    Crash,
    /// The lease ends on the store's clock (the transaction is stalled or dead).
    Expire,
    /// A check-back; `clock_ahead`: the producer's clock runs ahead of the store's (the
    /// `Read` rule compares the two).
    CheckBack {
        clock_ahead: bool,
    },
}

#[derive(Clone, Debug)]
struct CheckBackModel {
    rule: CheckRule,
    /// The producer's clock may run ahead of the store's (matters to the `Read` rule only).
    clock_skew: bool,
}

const CHECK_LOSS: &str = "effect applied, message never delivered";
const CHECK_PHANTOM: &str = "message delivered without its effect";
const CHECK_RESOLVED: &str = "every half message is eventually committed or rolled back";
const CHECK_ROLLED_BACK: &str = "a half message is rolled back (reachable)";
const CHECK_COMMITTED: &str = "a half message is committed (reachable)";

impl CheckBackModel {
    /// The check-back's answer, and the store after it.
    fn check_back(&self, s: &CheckState, clock_ahead: bool) -> (Option<Half>, CheckState) {
        let mut n = s.clone();
        let answer = match (self.rule, s.record) {
            (_, Some(TxRecord::Completed)) => Some(Half::Committed),
            (_, Some(TxRecord::RolledBack)) => Some(Half::RolledBack),
            (CheckRule::Read, Some(TxRecord::InProgress { live, .. })) => {
                if live && !clock_ahead {
                    None
                } else {
                    Some(Half::RolledBack)
                }
            }
            (CheckRule::Read, None) => Some(Half::RolledBack),
            (_, Some(TxRecord::InProgress { live: true, .. })) => None,
            (CheckRule::FencedRelease, Some(TxRecord::InProgress { live: false, .. }) | None) => {
                // Granted: a new token (a takeover fences the old one), then released.
                n.tokens += 1;
                n.record = Some(TxRecord::InProgress {
                    token: n.tokens,
                    live: false,
                });
                Some(Half::RolledBack)
            }
            (
                CheckRule::FencedRolledBack,
                Some(TxRecord::InProgress { live: false, .. }) | None,
            ) => {
                // Granted (a new token fences the old one), then recorded rolled back.
                n.tokens += 1;
                n.record = Some(TxRecord::RolledBack);
                Some(Half::RolledBack)
            }
        };
        (answer, n)
    }
}

impl Model for CheckBackModel {
    type State = CheckState;
    type Action = CheckAction;

    fn init_states(&self) -> Vec<CheckState> {
        vec![CheckState {
            record: None,
            tokens: 0,
            local: LocalPhase::Started,
            effect: false,
            half: Half::Pending,
            crashes: 1,
            lost_ends: 1,
        }]
    }

    fn actions(&self, s: &CheckState, actions: &mut Vec<CheckAction>) {
        match s.local {
            LocalPhase::Started => actions.push(CheckAction::Claim),
            LocalPhase::Claimed(_) => actions.push(CheckAction::Write),
            LocalPhase::Written(_) => actions.push(CheckAction::CompleteAndCommit),
            LocalPhase::Finished(_) => {
                actions.push(CheckAction::TellBroker { lost: false });
                if s.lost_ends > 0 {
                    actions.push(CheckAction::TellBroker { lost: true });
                }
            }
            LocalPhase::Gone => {}
        }
        if s.crashes > 0 && !matches!(s.local, LocalPhase::Gone) {
            actions.push(CheckAction::Crash);
        }
        if matches!(s.record, Some(TxRecord::InProgress { live: true, .. })) {
            actions.push(CheckAction::Expire);
        }
        // The broker asks only while the half message is pending, before the local
        // transaction's claim too (see the header).
        if s.half == Half::Pending {
            actions.push(CheckAction::CheckBack { clock_ahead: false });
            if self.rule == CheckRule::Read && self.clock_skew {
                actions.push(CheckAction::CheckBack { clock_ahead: true });
            }
        }
    }

    fn next_state(&self, s: &CheckState, action: CheckAction) -> Option<CheckState> {
        let mut n = s.clone();
        match action {
            CheckAction::Claim => {
                n.local = match s.record {
                    None | Some(TxRecord::InProgress { live: false, .. }) => {
                        n.tokens += 1;
                        n.record = Some(TxRecord::InProgress {
                            token: n.tokens,
                            live: true,
                        });
                        LocalPhase::Claimed(n.tokens)
                    }
                    // Duplicate (done before) / InFlight / RolledBack: nothing written, let
                    // the check-back decide.
                    _ => LocalPhase::Finished(Outcome2::Unknown),
                };
            }
            CheckAction::Write => {
                if let LocalPhase::Claimed(t) = s.local {
                    n.local = LocalPhase::Written(t);
                }
            }
            CheckAction::CompleteAndCommit => {
                let LocalPhase::Written(t) = s.local else {
                    return None;
                };
                // `complete_in_tx`: completes (and the effect commits) only if the token
                // still owns the key; an ended lease not taken over still belongs to it.
                let owns =
                    matches!(s.record, Some(TxRecord::InProgress { token, .. }) if token == t);
                if owns {
                    n.record = Some(TxRecord::Completed);
                    n.effect = true;
                    n.local = LocalPhase::Finished(Outcome2::Commit);
                } else {
                    n.local = LocalPhase::Finished(Outcome2::Unknown);
                }
            }
            CheckAction::TellBroker { lost } => {
                let LocalPhase::Finished(outcome) = s.local else {
                    return None;
                };
                n.local = LocalPhase::Gone;
                if lost {
                    n.lost_ends -= 1;
                } else if outcome == Outcome2::Commit && s.half == Half::Pending {
                    n.half = Half::Committed;
                }
            }
            CheckAction::Crash => {
                n.crashes -= 1;
                n.local = LocalPhase::Gone; // an open database transaction rolls back
            }
            CheckAction::Expire => {
                if let Some(TxRecord::InProgress { token, .. }) = s.record {
                    n.record = Some(TxRecord::InProgress { token, live: false });
                }
            }
            CheckAction::CheckBack { clock_ahead } => {
                let (answer, after) = self.check_back(s, clock_ahead);
                n = after;
                if let Some(h) = answer {
                    n.half = h;
                }
            }
        }
        (n != *s).then_some(n)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(CHECK_LOSS, |_, s: &CheckState| {
                !(s.effect && s.half == Half::RolledBack)
            }),
            Property::always(CHECK_PHANTOM, |_, s: &CheckState| {
                s.half != Half::Committed || s.effect
            }),
            Property::eventually(CHECK_RESOLVED, |_, s: &CheckState| s.half != Half::Pending),
            Property::sometimes(CHECK_ROLLED_BACK, |_, s: &CheckState| {
                s.half == Half::RolledBack
            }),
            Property::sometimes(CHECK_COMMITTED, |_, s: &CheckState| {
                s.half == Half::Committed
            }),
        ]
    }
}

#[test]
fn rocketmq_check_back_rolls_back_only_after_fencing_and_records_it() {
    let checker = check_any(
        "rocketmq check-back, fenced rule recording the roll-back",
        CheckBackModel {
            rule: CheckRule::FencedRolledBack,
            clock_skew: true,
        },
        &[],
    );
    checker.assert_no_discovery(CHECK_LOSS);
    checker.assert_no_discovery(CHECK_PHANTOM);
    checker.assert_no_discovery(CHECK_RESOLVED);
    assert!(checker.discovery(CHECK_ROLLED_BACK).is_some());
    assert!(checker.discovery(CHECK_COMMITTED).is_some());
}

#[test]
fn rocketmq_check_back_releasing_the_key_lets_a_late_claim_apply_a_dropped_message() {
    let checker = check_any(
        "rocketmq check-back, fenced rule releasing the key (before the fix)",
        CheckBackModel {
            rule: CheckRule::FencedRelease,
            clock_skew: false,
        },
        &[CHECK_LOSS],
    );
    show_any(&checker, CHECK_LOSS);
    let path = checker.discovery(CHECK_LOSS).expect("a loss");
    let last = path.last_state();
    assert!(last.effect && last.half == Half::RolledBack);
    let actions = path.into_actions();
    let check = actions
        .iter()
        .position(|a| matches!(a, CheckAction::CheckBack { .. }))
        .expect("a check-back");
    let claim = actions
        .iter()
        .position(|a| *a == CheckAction::Claim)
        .expect("a claim");
    assert!(
        check < claim,
        "the check-back came before the late claim: {actions:?}"
    );
}

#[test]
fn rocketmq_check_back_rolling_back_on_a_read_loses_the_message() {
    // Same clocks: the read of a lease that ended while the transaction stalled.
    // Then a producer clock ahead of the store's: the read of a lease still live.
    for (name, clock_skew) in [
        (
            "rocketmq check-back, read rule (before the fix), one clock",
            false,
        ),
        (
            "rocketmq check-back, read rule (before the fix), producer clock ahead",
            true,
        ),
    ] {
        let checker = check_any(
            name,
            CheckBackModel {
                rule: CheckRule::Read,
                clock_skew,
            },
            &[CHECK_LOSS],
        );
        show_any(&checker, CHECK_LOSS);
        let path = checker.discovery(CHECK_LOSS).expect("a loss");
        let last = path.last_state();
        assert!(last.effect && last.half == Half::RolledBack);
        if !clock_skew {
            // Without skew the read answers ROLLBACK only for a lease that ended or for a
            // key not claimed yet.
            let actions = path.into_actions();
            let check = actions
                .iter()
                .position(|a| matches!(a, CheckAction::CheckBack { .. }));
            let claim = actions.iter().position(|a| *a == CheckAction::Claim);
            assert!(
                actions.contains(&CheckAction::Expire) || check < claim,
                "without skew the loss needs the lease to end first, or a check-back before \
                 the claim: {actions:?}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------
// Kafka Flow 2 (consume-transform-produce): the revoked-partition rule
// ---------------------------------------------------------------------------------------
//
// One input partition holding one record, two consumers of one group with transactional
// producers. A consumer polls the record into its buffer; a rebalance (from a finite budget)
// moves the partition to the other consumer and starts a new group generation, which both
// members join (the old owner stays in the group, with no partition). A consumer whose
// partition is assigned fetches its committed offset *stable* (KIP-447: not while a
// transaction holding offsets for it is open) and polls from there. A transform opens a
// transaction: the output, and the offset past the record sent with the consumer's group
// metadata (its generation). The group coordinator accepts the offsets if that generation is
// current (it checks generation and member, not who owns the partition); otherwise the
// transaction aborts (the output is never visible) and the consumer rewinds.
//
// Without the rule, the old owner transforms what it polled before the revocation with its
// new (current) generation and commits; the new owner fetched the old offset before that
// transaction opened, polls the record again, and commits a second output. The rule: records
// of a partition revoked after their poll (the assignment they were polled under has ended)
// are dropped, neither transformed nor committed.

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum RevokeRule {
    Unchecked,
    DropRevoked,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
struct Member {
    /// Owns the partition now.
    assigned: bool,
    /// Assignments of the partition to this member so far (the epoch).
    epoch: u8,
    /// Fetch position: `None` until the committed offset is fetched after an assignment.
    position: Option<u8>,
    /// The polled record's epoch (the assignment it was polled under).
    buffer: Option<u8>,
    /// An open transaction: the generation its offsets carry.
    txn: Option<u8>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct FlowState {
    members: [Member; 2],
    generation: u8,
    committed: u8,
    /// Committed outputs for the record (saturating at 3).
    outputs: u8,
    rebalances: u8,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum FlowAction {
    Fetch(usize),
    Poll(usize),
    Transform(usize),
    Commit(usize),
    Rebalance,
}

#[derive(Clone, Debug)]
struct RevokeModel {
    rule: RevokeRule,
}

const FLOW_ONE_OUTPUT: &str = "at most one committed output per input record";
const FLOW_DONE: &str = "the record's output is eventually committed";

impl RevokeModel {
    fn open_txn(s: &FlowState) -> bool {
        s.members.iter().any(|m| m.txn.is_some())
    }
}

impl Model for RevokeModel {
    type State = FlowState;
    type Action = FlowAction;

    fn init_states(&self) -> Vec<FlowState> {
        let owner = Member {
            assigned: true,
            epoch: 1,
            ..Member::default()
        };
        vec![FlowState {
            members: [owner, Member::default()],
            generation: 1,
            committed: 0,
            outputs: 0,
            rebalances: 2,
        }]
    }

    fn actions(&self, s: &FlowState, actions: &mut Vec<FlowAction>) {
        for (i, m) in s.members.iter().enumerate() {
            if m.assigned && m.position.is_none() && !Self::open_txn(s) {
                actions.push(FlowAction::Fetch(i));
            }
            if m.assigned && m.position == Some(0) && m.buffer.is_none() && m.txn.is_none() {
                actions.push(FlowAction::Poll(i));
            }
            if m.buffer.is_some() && m.txn.is_none() {
                actions.push(FlowAction::Transform(i));
            }
            if m.txn.is_some() {
                actions.push(FlowAction::Commit(i));
            }
        }
        if s.rebalances > 0 {
            actions.push(FlowAction::Rebalance);
        }
    }

    fn next_state(&self, s: &FlowState, action: FlowAction) -> Option<FlowState> {
        let mut n = s.clone();
        match action {
            FlowAction::Fetch(i) => n.members[i].position = Some(s.committed),
            FlowAction::Poll(i) => {
                n.members[i].buffer = Some(s.members[i].epoch);
                n.members[i].position = Some(1);
            }
            FlowAction::Transform(i) => {
                let m = s.members[i];
                let polled_under = m.buffer?;
                let revoked = !m.assigned || polled_under != m.epoch;
                if revoked && self.rule == RevokeRule::DropRevoked {
                    n.members[i].buffer = None;
                } else {
                    // Output and offsets in one transaction, with this member's generation.
                    n.members[i].txn = Some(s.generation);
                }
            }
            FlowAction::Commit(i) => {
                let m = s.members[i];
                let generation = m.txn?;
                n.members[i].txn = None;
                n.members[i].buffer = None;
                if generation == s.generation {
                    n.outputs = (n.outputs + 1).min(3);
                    n.committed = 1;
                } else if m.assigned {
                    // Aborted (stale generation): rewind to the committed offset.
                    n.members[i].position = None;
                }
            }
            FlowAction::Rebalance => {
                n.rebalances -= 1;
                n.generation += 1;
                for m in &mut n.members {
                    if m.assigned {
                        m.assigned = false;
                        m.position = None;
                    } else {
                        m.assigned = true;
                        m.epoch += 1;
                        m.position = None;
                    }
                }
            }
        }
        Some(n)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(FLOW_ONE_OUTPUT, |_, s: &FlowState| s.outputs <= 1),
            Property::eventually(FLOW_DONE, |_, s: &FlowState| s.outputs >= 1),
        ]
    }
}

#[test]
fn kafka_flow2_drops_records_of_a_revoked_partition_and_commits_one_output() {
    let checker = check_any(
        "kafka flow 2, revoked-partition rule",
        RevokeModel {
            rule: RevokeRule::DropRevoked,
        },
        &[],
    );
    checker.assert_no_discovery(FLOW_ONE_OUTPUT);
    checker.assert_no_discovery(FLOW_DONE);
}

#[test]
fn kafka_flow2_without_the_rule_a_second_owner_commits_a_second_output() {
    let checker = check_any(
        "kafka flow 2, records of a revoked partition transformed (no rule)",
        RevokeModel {
            rule: RevokeRule::Unchecked,
        },
        &[FLOW_ONE_OUTPUT],
    );
    show_any(&checker, FLOW_ONE_OUTPUT);
    let path = checker.discovery(FLOW_ONE_OUTPUT).expect("a second output");
    assert!(path.last_state().outputs >= 2);
}
