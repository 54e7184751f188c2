//! The leases a batch holds and their heartbeat.

use crate::handler::{LeaseFlags, LeaseWatch};
use crate::key::DedupKey;
use crate::metrics as m;
use crate::store::{DedupStore, ExtendOutcome, FencingToken};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

struct Slot {
    key: DedupKey,
    token: FencingToken,
    /// When the lease surely still runs, on this process's monotonic clock: milliseconds
    /// after [`LiveLeases::base`], counted from the *start* of the call that granted or
    /// extended it (the store's grant cannot begin earlier). The store's own `until_ms` is
    /// on the store's clock and is not compared with ours.
    deadline_ms: AtomicI64,
    /// Still ours to renew: cleared when the key is completed or given back.
    held: AtomicBool,
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
        let first_deadline = crate::store::duration_ms(lease);
        let flags = LeaseFlags::new(acquired.len());
        let listed = several_loops();
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
                    held: AtomicBool::new(true),
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

    /// Item `index` no longer needs its lease renewed.
    pub(crate) fn remove(&self, index: usize) {
        if let Some(Some(s)) = self.slots.get(index) {
            s.held.store(false, Ordering::Relaxed);
        }
    }

    fn renewable(&self) -> impl Iterator<Item = (usize, &Slot)> {
        self.slots.iter().enumerate().filter_map(|(i, s)| {
            s.as_ref()
                .filter(|s| s.held.load(Ordering::Relaxed) && !self.flags.is_lost(i))
                .map(|s| (i, s))
        })
    }
}

/// Aborts a task when dropped (the batch's heartbeat ends with the batch, however it ends).
pub(crate) struct AbortOnDrop(pub(crate) tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Extends every lease of a batch every `beat` until aborted. Each round trip is bounded by
/// `timeout`; a lease whose end passes while heartbeats fail is marked lost (the store may
/// already have handed it to another worker), as is one the store answers `Fenced`. "Passes"
/// is judged on this process's monotonic clock from the start of the last successful grant,
/// never by comparing the store's clock with ours (they may be skewed by any amount).
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
        if !due.is_empty() {
            let leases: Vec<(DedupKey, FencingToken)> =
                due.iter().map(|(_, s)| (s.key.clone(), s.token)).collect();
            // One round trip for the whole batch, bounded: a store that hangs counts as down.
            let started = live.base.elapsed();
            let renewed_deadline = crate::store::duration_ms(started + lease);
            let call = tokio::time::timeout(timeout, store.extend_batch(&leases, lease));
            match expiring(&live, margin_ms, call).await {
                Ok(Ok(outs)) if outs.len() == due.len() => {
                    for ((i, slot), out) in due.iter().zip(outs) {
                        match out {
                            ExtendOutcome::Extended { .. } => {
                                slot.deadline_ms.store(renewed_deadline, Ordering::Relaxed)
                            }
                            ExtendOutcome::Fenced => {
                                tracing::warn!(key = %slot.key, "lease lost (heartbeat fenced): another worker took the key over");
                                live.flags.mark_lost(*i);
                            }
                        }
                    }
                }
                Ok(Ok(outs)) => {
                    metrics::counter!(m::STORE_ERRORS, "op" => "extend").increment(1);
                    tracing::warn!(
                        got = outs.len(),
                        want = due.len(),
                        "heartbeat answered with the wrong number of outcomes"
                    );
                }
                Ok(Err(e)) => {
                    metrics::counter!(m::STORE_ERRORS, "op" => "extend").increment(1);
                    tracing::warn!(error = %e, leases = due.len(), "heartbeat failed");
                }
                Err(_) => {
                    metrics::counter!(m::STORE_ERRORS, "op" => "extend").increment(1);
                    tracing::warn!(?timeout, leases = due.len(), "heartbeat timed out");
                }
            }
        }
        live.mark_expired(margin_ms);
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
            if let Some(Some(s)) = self.slots.get(i) {
                tracing::warn!(key = %s.key, "lease ran out while heartbeats failed; treating it as lost");
            }
            self.flags.mark_lost(i);
        }
    }
}
