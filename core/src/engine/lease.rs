//! The one lease keep-alive of idemq: the heartbeat that renews a batch's leases in the
//! engine, and [`LeaseKeepAlive`], the same heartbeat over one lease for code that claims
//! keys itself (a long job outside the engine).
//!
//! Every extend is bounded by a timeout, and a lease is declared lost on this process's
//! monotonic clock: when no extend has succeeded by the time the lease, counted from the
//! start of the last successful claim or extend, would end (less a safety margin of one
//! beat). A store that hangs cannot keep a lease looking held, and the store's own clock
//! (its `until_ms`) is never compared with ours.

use crate::handler::{LeaseFlags, LeaseWatch};
use crate::key::DedupKey;
use crate::metrics as m;
use crate::store::{DedupStore, ExtendOutcome, FencingToken, Lease};
use std::sync::atomic::{AtomicI64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Where one slot's lease stands (the values of [`Slot::state`]).
mod slot_state {
    /// Held and renewed every beat.
    pub(super) const RENEWING: u8 = 0;
    /// Its completion is in flight: still renewed (the completion may retry for a while),
    /// but a `Fenced` answer now most likely means the completion landed first.
    pub(super) const COMPLETING: u8 = 1;
    /// Completed or given back: no longer ours to renew.
    pub(super) const SETTLED: u8 = 2;
    /// Lost: the store answered `Fenced`.
    pub(super) const LOST_FENCED: u8 = 3;
    /// Lost: its end passed on our clock while renewals failed or hung.
    pub(super) const LOST_EXPIRED: u8 = 4;
}
use slot_state::*;

struct Slot {
    key: DedupKey,
    token: FencingToken,
    /// When the lease surely still runs, on this process's monotonic clock: milliseconds
    /// after [`LiveLeases::base`], counted from the *start* of the call that granted or
    /// extended it (the store's grant cannot begin earlier). The store's own `until_ms` is
    /// on the store's clock and is not compared with ours.
    deadline_ms: AtomicI64,
    /// One of [`slot_state`]'s values.
    state: AtomicU8,
}

impl Slot {
    /// Moves from `from` to `to`; false when the slot was elsewhere.
    fn shift(&self, from: u8, to: u8) -> bool {
        self.state
            .compare_exchange(from, to, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    fn renewable(&self) -> bool {
        matches!(self.state.load(Ordering::Acquire), RENEWING | COMPLETING)
    }
}

/// The leases a batch holds, one slot per item of the batch (empty for items not acquired),
/// from the claim until their completion is durable or they are given back. One heartbeat
/// renews all of them; each handler watches its own slot's lost flag.
///
/// While a batch lives its keys are also listed in [`held_here`], so that a copy of one of
/// them meeting `InFlight` in another engine of this process comes back soon (the holder is
/// next door and usually done in milliseconds) instead of after the whole lease.
pub(crate) struct LiveLeases {
    slots: Vec<Option<Slot>>,
    /// Whether the keys were listed in [`held_here`] (only while several engines run).
    listed: bool,
    flags: Arc<LeaseFlags>,
    /// When the claim that acquired these leases started.
    base: tokio::time::Instant,
}

/// Keys held by live batches of this process, with a count (two engines may hold the same
/// key one after the other within one batch's life).
fn held_here_map() -> std::sync::MutexGuard<'static, std::collections::HashMap<DedupKey, u32>> {
    static HELD: std::sync::OnceLock<std::sync::Mutex<std::collections::HashMap<DedupKey, u32>>> =
        std::sync::OnceLock::new();
    HELD.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

/// Batches that may be in progress at once in this process: the sum over the running poll
/// loops (`IdempotentConsumer::run`) of their `pipeline_depth`. Keys are listed in
/// [`held_here`] only while it exceeds one: a lone batch meets no local holder, and the
/// listing costs two map updates per message.
static RUNNING_LOOPS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Counts a running poll loop's batches for as long as it lives.
pub(crate) struct RunningLoop(usize);

impl RunningLoop {
    /// A loop with up to `batches` batches in progress at once (its validated
    /// `pipeline_depth`, at least 1).
    pub(crate) fn start(batches: usize) -> Self {
        RUNNING_LOOPS.fetch_add(batches, Ordering::Relaxed);
        RunningLoop(batches)
    }
}

impl Drop for RunningLoop {
    fn drop(&mut self) {
        RUNNING_LOOPS.fetch_sub(self.0, Ordering::Relaxed);
    }
}

fn several_loops() -> bool {
    RUNNING_LOOPS.load(Ordering::Relaxed) > 1
}

/// True when another live batch of this process (another engine's, or this loop's next one)
/// holds `key`.
pub(crate) fn held_here(key: &DedupKey) -> bool {
    several_loops() && held_here_map().contains_key(key)
}

impl Drop for LiveLeases {
    fn drop(&mut self) {
        if !self.listed {
            return;
        }
        let mut held = held_here_map();
        for s in self.slots.iter().flatten() {
            if let Some(n) = held.get_mut(&s.key) {
                *n -= 1;
                if *n == 0 {
                    held.remove(&s.key);
                }
            }
        }
    }
}

impl LiveLeases {
    /// Slots for a batch: `Some((key, token))` for each acquired item, by index, with leases
    /// of `lease` granted by a claim that started at `claimed_at`.
    pub(crate) fn new(
        acquired: Vec<Option<(DedupKey, FencingToken)>>,
        claimed_at: tokio::time::Instant,
        lease: Duration,
    ) -> Self {
        Self::build(acquired, claimed_at, lease, several_loops())
    }

    /// Like [`LiveLeases::new`]; `listed`: whether to list the keys in [`held_here`].
    fn build(
        acquired: Vec<Option<(DedupKey, FencingToken)>>,
        claimed_at: tokio::time::Instant,
        lease: Duration,
        listed: bool,
    ) -> Self {
        let first_deadline = crate::store::duration_ms(lease);
        let flags = LeaseFlags::new(acquired.len());
        if listed {
            let mut held = held_here_map();
            for (key, _) in acquired.iter().flatten() {
                *held.entry(key.clone()).or_default() += 1;
            }
        }
        let slots = acquired
            .into_iter()
            .map(|a| {
                a.map(|(key, token)| Slot {
                    key,
                    token,
                    deadline_ms: AtomicI64::new(first_deadline),
                    state: AtomicU8::new(RENEWING),
                })
            })
            .collect();
        Self {
            slots,
            listed,
            flags,
            base: claimed_at,
        }
    }

    /// When the claim that acquired these leases started.
    pub(crate) fn base(&self) -> tokio::time::Instant {
        self.base
    }

    /// The watch a handler of item `index` sees.
    pub(crate) fn watch(&self, index: usize) -> LeaseWatch {
        self.flags.watch(index)
    }

    /// What the handler's own transaction settled for item `index`.
    pub(crate) fn settled(&self, index: usize) -> crate::handler::Settled {
        self.flags.settled(index)
    }

    fn slot(&self, index: usize) -> Option<&Slot> {
        self.slots.get(index).and_then(Option::as_ref)
    }

    /// Item `index` is completed or given back: its lease is no longer renewed, and a
    /// renewal answered after this is no news.
    pub(crate) fn remove(&self, index: usize) {
        if let Some(s) = self.slot(index) {
            if !s.shift(RENEWING, SETTLED) {
                s.shift(COMPLETING, SETTLED);
            }
        }
    }

    /// Item `index`'s completion is about to be sent: its lease is still renewed until the
    /// answer, but a `Fenced` renewal meanwhile is the completion landing first (or, if the
    /// key really was taken over, the completion is fenced too and says so).
    pub(crate) fn completing(&self, index: usize) {
        if let Some(s) = self.slot(index) {
            s.shift(RENEWING, COMPLETING);
        }
    }

    fn renewable(&self) -> impl Iterator<Item = (usize, &Slot)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.as_ref().filter(|s| s.renewable()).map(|s| (i, s)))
    }

    /// The store answered `Fenced` for item `index`.
    fn fenced(&self, index: usize) {
        let Some(s) = self.slot(index) else { return };
        if s.shift(RENEWING, LOST_FENCED) {
            tracing::warn!(key = %s.key, "lease lost (heartbeat fenced): another worker took the key over");
            self.flags.mark_lost(index);
        } else if s.shift(COMPLETING, SETTLED) {
            tracing::debug!(key = %s.key, "heartbeat fenced while the key's completion was in flight: the completion landed first (or is fenced too)");
        }
    }

    /// Item `index`'s lease ran out on our clock.
    fn expired(&self, index: usize) {
        let Some(s) = self.slot(index) else { return };
        if s.shift(RENEWING, LOST_EXPIRED) || s.shift(COMPLETING, LOST_EXPIRED) {
            tracing::warn!(key = %s.key, "lease ran out while heartbeats failed; treating it as lost");
            self.flags.mark_lost(index);
        }
    }
}

/// Aborts a task when dropped (the batch's heartbeat ends with the batch, however it ends).
pub(crate) struct AbortOnDrop(pub(crate) tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Extends every lease of a batch every `beat` until aborted, or until none is left to
/// renew. Each round trip is bounded by `timeout`; a lease whose end passes while heartbeats
/// fail or hang is marked lost (the store may already have handed it to another worker), as
/// is one the store answers `Fenced`. "Passes" is judged on this process's monotonic clock
/// from the start of the last successful grant, never by comparing the store's clock with
/// ours (they may be skewed by any amount).
pub(crate) async fn heartbeat(
    store: Arc<dyn DedupStore>,
    live: Arc<LiveLeases>,
    lease: Duration,
    beat: Duration,
    timeout: Duration,
) {
    // Beats count from the claim, not from this task's start (it starts late on purpose).
    let mut tick = tokio::time::interval_at(live.base + beat, beat);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // A lease is given up one beat before its end: the next beat might come too late.
    let margin_ms = crate::store::duration_ms(beat).min(crate::store::duration_ms(lease) / 2);
    loop {
        // Between beats, and while a beat's round trip hangs, leases are still given up on
        // time: a hung store cannot delay the lease watch.
        expiring(&live, margin_ms, tick.tick()).await;
        let due: Vec<(usize, &Slot)> = live.renewable().collect();
        if due.is_empty() {
            // Every lease is settled or lost, and slots never come back: nothing left to do.
            return;
        }
        let leases: Vec<(DedupKey, FencingToken)> =
            due.iter().map(|(_, s)| (s.key.clone(), s.token)).collect();
        // One round trip for the whole batch, bounded: a store that hangs counts as down.
        let renewed_deadline = crate::store::duration_ms(live.base.elapsed() + lease);
        let call = extend_bounded(store.as_ref(), &leases, lease, timeout);
        match expiring(&live, margin_ms, call).await {
            Ok(outs) if outs.len() == due.len() => {
                let mut unknown = 0usize;
                for ((i, slot), out) in due.iter().zip(outs) {
                    match out {
                        ExtendOutcome::Extended { .. } => {
                            slot.deadline_ms.store(renewed_deadline, Ordering::Relaxed)
                        }
                        ExtendOutcome::Fenced => live.fenced(*i),
                        // Its part of the call failed: as after an error, the lease keeps
                        // its last end and is given up when that passes.
                        ExtendOutcome::Unknown => unknown += 1,
                    }
                }
                if unknown > 0 {
                    metrics::counter!(m::STORE_ERRORS, "op" => "extend").increment(1);
                    tracing::warn!(
                        leases = unknown,
                        of = due.len(),
                        "heartbeat: part of the store did not answer for some leases"
                    );
                }
            }
            Ok(outs) => {
                metrics::counter!(m::STORE_ERRORS, "op" => "extend").increment(1);
                tracing::warn!(
                    got = outs.len(),
                    want = due.len(),
                    "heartbeat answered with the wrong number of outcomes"
                );
            }
            Err(why) => {
                metrics::counter!(m::STORE_ERRORS, "op" => "extend").increment(1);
                tracing::warn!(leases = due.len(), "heartbeat failed: {why}");
            }
        }
        live.mark_expired(margin_ms);
    }
}

/// One extend round trip bounded by `timeout`. A store that fails, hangs or panics counts
/// as down for this beat (the error says which); it never ends the heartbeat, which must go
/// on to declare the leases lost on time.
async fn extend_bounded(
    store: &dyn DedupStore,
    leases: &[(DedupKey, FencingToken)],
    lease: Duration,
    timeout: Duration,
) -> Result<Vec<ExtendOutcome>, String> {
    use futures::FutureExt;
    let call = std::panic::AssertUnwindSafe(store.extend_batch(leases, lease)).catch_unwind();
    match tokio::time::timeout(timeout, call).await {
        Ok(Ok(Ok(outs))) => Ok(outs),
        Ok(Ok(Err(e))) => Err(e.to_string()),
        Ok(Err(panic)) => Err(format!(
            "the store panicked: {}",
            super::panic_message(panic.as_ref())
        )),
        Err(_) => Err(format!("no answer within {timeout:?}")),
    }
}

/// Awaits `fut`, marking leases lost as their ends (less `margin_ms`) pass meanwhile.
async fn expiring<F: std::future::Future>(live: &LiveLeases, margin_ms: i64, fut: F) -> F::Output {
    tokio::pin!(fut);
    loop {
        let next = live
            .next_expiry(margin_ms)
            .unwrap_or_else(|| tokio::time::Instant::now() + Duration::from_secs(3600));
        tokio::select! {
            out = &mut fut => return out,
            _ = tokio::time::sleep_until(next) => live.mark_expired(margin_ms),
        }
    }
}

impl LiveLeases {
    /// When the first renewable lease must be given up.
    fn next_expiry(&self, margin_ms: i64) -> Option<tokio::time::Instant> {
        self.renewable()
            .map(|(_, s)| s.deadline_ms.load(Ordering::Relaxed) - margin_ms)
            .min()
            .map(|ms| self.base + Duration::from_millis(ms.max(0) as u64))
    }

    /// Marks lost every lease whose end (less `margin_ms`) has passed on our clock.
    fn mark_expired(&self, margin_ms: i64) {
        let now = crate::store::duration_ms(self.base.elapsed());
        let expired: Vec<usize> = self
            .renewable()
            .filter(|(_, s)| s.deadline_ms.load(Ordering::Relaxed) - margin_ms <= now)
            .map(|(i, _)| i)
            .collect();
        for i in expired {
            self.expired(i);
        }
    }
}

/// Why a [`LeaseKeepAlive`]'s lease is no longer held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LossCause {
    /// The store says the token no longer owns the key (taken over, released or forgotten).
    Fenced,
    /// No renewal succeeded (the store failed, refused or hung) before the lease's end,
    /// counted on this process's clock: another worker may take the key over at any moment.
    Expired,
}

/// What a [`LeaseKeepAlive`] knows of its lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LeaseState {
    /// Held: the lease surely runs until `until` on this process's monotonic clock (counted
    /// from the start of the last successful claim or renewal). It is reported lost up to
    /// one renewal interval before then if no renewal succeeds meanwhile.
    Held {
        /// The end of the lease as last granted, on this process's clock.
        until: tokio::time::Instant,
    },
    /// No longer held: stop the work and do not complete (a completion would be fenced).
    Lost(LossCause),
}

/// Keeps one claimed lease alive while long work runs, with the engine's own heartbeat
/// (Redisson's lock watchdog, for code that claims keys itself; the consumer engine keeps
/// its batches' leases with the same heartbeat).
///
/// It extends the lease every interval (`lease / 3` by default), each extend bounded by a
/// timeout, and declares the lease lost on this process's monotonic clock: when no extend
/// has succeeded by one interval before the lease's end, counted from the *start* of the
/// last successful claim or extend. So a store that hangs or is down never leaves the
/// lease looking held past its end, and the store's clock is never compared with ours.
/// A `Fenced` answer (the key was taken over) is a loss at once.
///
/// Watch it with [`state`](Self::state), [`lost`](Self::lost) (e.g. in `tokio::select!`)
/// or a [`LeaseWatch`] from [`watch`](Self::watch). Dropping it stops the renewals; the
/// lease then ends on its own unless the key is completed or released.
///
/// ```
/// # // Tokio's paused clock: a stalled test machine cannot make a renewal look late.
/// # tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build().unwrap().block_on(async {
/// use idemq_core::{ClaimOutcome, ClaimRequest, ConsumerGroup, DedupKey, DedupStore, MemoryStore};
/// use idemq_core::engine::{LeaseKeepAlive, LeaseState};
/// use std::{sync::Arc, time::Duration};
/// use tokio::time::Instant;
/// let store: Arc<dyn DedupStore> = Arc::new(MemoryStore::new());
/// let key = DedupKey::new(&ConsumerGroup::new("g").unwrap(), "job-1").unwrap();
/// let lease_len = Duration::from_millis(600);
/// let claimed_at = Instant::now(); // before the claim: the lease cannot start earlier
/// let ClaimOutcome::Acquired(lease) = store.claim(&ClaimRequest::new(key.clone(), lease_len)).await.unwrap()
/// else { panic!() };
/// let alive = LeaseKeepAlive::spawn(store.clone(), key.clone(), &lease, lease_len, claimed_at);
/// tokio::time::sleep(Duration::from_millis(1000)).await; // longer than the lease
/// assert!(matches!(alive.state(), LeaseState::Held { .. }));
/// drop(alive);
/// # });
/// ```
pub struct LeaseKeepAlive {
    live: Arc<LiveLeases>,
    _renewals: AbortOnDrop,
}

impl std::fmt::Debug for LeaseKeepAlive {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseKeepAlive")
            .field("state", &self.state())
            .finish_non_exhaustive()
    }
}

impl LeaseKeepAlive {
    /// Starts renewing `lease` on `key` by `lease_len` every `lease_len / 3`, each extend
    /// bounded by the same. `claimed_at` is when the claim that granted `lease` started,
    /// on this process's clock (take `Instant::now()` before calling `claim`). Must be
    /// called inside a Tokio runtime.
    pub fn spawn(
        store: Arc<dyn DedupStore>,
        key: DedupKey,
        lease: &Lease,
        lease_len: Duration,
        claimed_at: tokio::time::Instant,
    ) -> Self {
        let every = (lease_len / 3).max(Duration::from_millis(5));
        Self::spawn_with(store, key, lease, lease_len, claimed_at, every, every)
    }

    /// Like [`spawn`](Self::spawn) with an explicit renewal interval `every` (keep it well
    /// below `lease_len`: the lease is reported lost one interval before its end unless a
    /// renewal succeeded) and a bound on each extend's round trip.
    pub fn spawn_with(
        store: Arc<dyn DedupStore>,
        key: DedupKey,
        lease: &Lease,
        lease_len: Duration,
        claimed_at: tokio::time::Instant,
        every: Duration,
        timeout: Duration,
    ) -> Self {
        let every = every.max(Duration::from_millis(1));
        let timeout = timeout.max(Duration::from_millis(1));
        let live = Arc::new(LiveLeases::build(
            vec![Some((key, lease.token))],
            claimed_at,
            lease_len,
            false,
        ));
        let renewals = tokio::spawn(heartbeat(store, live.clone(), lease_len, every, timeout));
        Self {
            live,
            _renewals: AbortOnDrop(renewals),
        }
    }

    /// The latest known state.
    pub fn state(&self) -> LeaseState {
        let Some(slot) = self.live.slot(0) else {
            return LeaseState::Lost(LossCause::Expired);
        };
        match slot.state.load(Ordering::Acquire) {
            LOST_FENCED => LeaseState::Lost(LossCause::Fenced),
            LOST_EXPIRED => LeaseState::Lost(LossCause::Expired),
            _ => LeaseState::Held {
                until: self.live.base
                    + Duration::from_millis(slot.deadline_ms.load(Ordering::Relaxed).max(0) as u64),
            },
        }
    }

    /// Resolves when the lease is lost (never, while renewals succeed).
    pub async fn lost(&self) -> LossCause {
        self.live.watch(0).lost().await;
        match self.state() {
            LeaseState::Lost(why) => why,
            // Only a lost slot wakes the watch.
            LeaseState::Held { .. } => LossCause::Expired,
        }
    }

    /// A watch that flips when the lease is lost, to hand to the code doing the work.
    pub fn watch(&self) -> LeaseWatch {
        self.live.watch(0)
    }

    /// Stops renewing (same as dropping).
    pub fn stop(self) {}
}
