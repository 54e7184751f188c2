//! Readiness of a running consumer, for an application's health endpoint.
//!
//! A consumer whose store is down acks nothing and backs off (it never "processes anyway"),
//! so from the outside it looks idle. [`Health`] says why: the poll loops record each
//! store call's and each poll's outcome, and [`Health::report`] answers what a readiness
//! probe needs (ready or not, since when, the last error) without touching the store.

use crate::source::{Readiness, ReadinessProbe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::SystemTime;

/// What a consumer is doing, as its health endpoint shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum HealthState {
    /// No poll loop has started yet.
    Starting,
    /// Polling, and the last store call and poll succeeded.
    Ready,
    /// The dedup store does not answer: nothing is acked, the loop backs off.
    StoreUnavailable,
    /// A source's poll failed (broker unreachable, channel lost); the loop backs off.
    BrokerUnavailable,
    /// Polling, but a source says it cannot deliver what its broker holds for it
    /// ([`Source::readiness`](crate::Source::readiness): waiting for a partition assignment,
    /// or a window filled behind a held message); the report's `last_error` says what it
    /// waits for. Read from the sources when the report is made, and every
    /// `SOURCE_RECHECK` (a second) while a loop runs, for the ready gauge.
    SourceWaiting,
    /// Polling, but the last [`KEYLESS_RUN`] messages or more in a row were dead-lettered
    /// because no dedup key could be derived from them: the key strategy does not match
    /// what the producers send. Not ready: nothing is processed until it is fixed.
    Degraded,
    /// Every poll loop has returned.
    Stopped,
}

impl HealthState {
    /// The state's name (`ready`, `store_unavailable`, …), for a JSON health body or a gauge.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Starting => "starting",
            Self::Ready => "ready",
            Self::StoreUnavailable => "store_unavailable",
            Self::BrokerUnavailable => "broker_unavailable",
            Self::SourceWaiting => "source_waiting",
            Self::Degraded => "degraded",
            Self::Stopped => "stopped",
        }
    }
}

impl std::fmt::Display for HealthState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A snapshot of [`Health`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct HealthReport {
    /// The current state.
    pub state: HealthState,
    /// When the consumer entered it.
    pub since: SystemTime,
    /// The error that made it unhealthy, while it is (store or source error text; URLs in
    /// it are the stores' own, with passwords already hidden).
    pub last_error: Option<String>,
    /// How many times the consumer went from ready to unavailable so far.
    pub outages: u64,
}

impl HealthReport {
    /// True when the consumer is polling with a working store and broker: what a readiness
    /// probe should answer 200 for.
    pub fn is_ready(&self) -> bool {
        self.state == HealthState::Ready
    }
}

#[derive(Debug)]
struct Since {
    state: HealthState,
    since: SystemTime,
    last_error: Option<String>,
}

/// How many messages in a row without a derivable key turn a consumer
/// [`HealthState::Degraded`].
pub const KEYLESS_RUN: u64 = 5;

/// How often a running loop's sources are asked again whether they can deliver, so that
/// [`HealthState::SourceWaiting`] reaches the ready gauge without a report being asked for:
/// well within a metrics scrape interval, and a probe is cheap (a flag, a short lock).
pub(crate) const SOURCE_RECHECK: std::time::Duration = std::time::Duration::from_secs(1);

#[derive(Debug)]
struct Inner {
    /// Poll loops running now.
    loops: AtomicUsize,
    /// Poll loops whose last poll failed.
    sources_down: AtomicUsize,
    store_down: AtomicBool,
    /// The last [`KEYLESS_RUN`] messages or more had no derivable key.
    keyless: AtomicBool,
    outages: AtomicU64,
    shown: Mutex<Since>,
    /// The readiness probes of the sources of running loops, by loop.
    sources: Mutex<Vec<(u64, ReadinessProbe)>>,
    next_loop: AtomicU64,
}

/// A consumer's readiness: cheap to clone, shared by clones of the engine, read from any
/// task (a health endpoint's handler).
///
/// ```
/// use idemq_core::broker::MemoryBroker;
/// use idemq_core::engine::HealthState;
/// use idemq_core::{ClaimedMessage, HandlerError, IdempotentConsumer, KeyStrategy, MemoryStore};
/// use std::sync::Arc;
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// let consumer = IdempotentConsumer::new(
///     Arc::new(MemoryStore::new()),
///     KeyStrategy::header("orders", "x-idempotency-key").unwrap(),
///     |_m: ClaimedMessage| async { Ok::<_, HandlerError>(None) },
/// );
/// let health = consumer.health(); // hand this to the readiness endpoint
/// assert_eq!(health.report().state, HealthState::Starting);
/// let broker = MemoryBroker::new(); // nothing pending: the run ends at once
/// consumer.run_until_idle(&mut broker.subscribe()).await.unwrap();
/// assert_eq!(health.report().state, HealthState::Stopped);
/// assert!(!health.report().is_ready());
/// # });
/// ```
#[derive(Debug, Clone)]
pub struct Health(Arc<Inner>);

impl Default for Health {
    fn default() -> Self {
        Self(Arc::new(Inner {
            loops: AtomicUsize::new(0),
            sources_down: AtomicUsize::new(0),
            store_down: AtomicBool::new(false),
            keyless: AtomicBool::new(false),
            outages: AtomicU64::new(0),
            shown: Mutex::new(Since {
                state: HealthState::Starting,
                since: SystemTime::now(),
                last_error: None,
            }),
            sources: Mutex::new(Vec::new()),
            next_loop: AtomicU64::new(0),
        }))
    }
}

impl Health {
    /// A fresh handle (state [`HealthState::Starting`]).
    pub fn new() -> Self {
        Self::default()
    }

    /// The state now. A consumer otherwise ready whose source says it cannot deliver (a
    /// probe asked now) is [`HealthState::SourceWaiting`], with what it waits for. The
    /// `idemq_consumer_ready` gauge is updated from the same evaluation, so the two agree.
    pub fn report(&self) -> HealthReport {
        self.refresh(None);
        let shown = self.shown();
        HealthReport {
            state: shown.state,
            since: shown.since,
            last_error: shown.last_error.clone(),
            outages: self.0.outages.load(Ordering::Relaxed),
        }
    }

    /// Shorthand for `report().is_ready()`.
    pub fn is_ready(&self) -> bool {
        self.report().is_ready()
    }

    fn shown(&self) -> MutexGuard<'_, Since> {
        // A panic while holding this lock cannot leave it half-written: take it anyway.
        self.0.shown.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// What the sources of the running loops say, when one of them cannot deliver.
    fn source_waiting(&self) -> Option<String> {
        let probes: Vec<ReadinessProbe> = self
            .0
            .sources
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|(_, p)| p.clone())
            .collect();
        // Asked outside the lock: a probe is the source's code.
        probes.iter().find_map(|p| match p.check() {
            Readiness::Waiting(why) => Some(why),
            Readiness::Ready(_) => None,
        })
    }

    /// Recomputes the shown state from the flags and the sources' probes, and moves the
    /// ready gauge with it: the one place readiness is decided. `error` replaces the last
    /// error when the state is unhealthy.
    fn refresh(&self, error: Option<String>) {
        let i = &self.0;
        // The sources are asked before the flags are read, so that the flags (set before
        // each call here) are the newest ones when the state is decided.
        let waiting = self.source_waiting();
        let mut shown = self.shown();
        let state = if i.loops.load(Ordering::SeqCst) == 0 {
            // No loop running: none started yet, or every one returned.
            if shown.state == HealthState::Starting {
                HealthState::Starting
            } else {
                HealthState::Stopped
            }
        } else if i.store_down.load(Ordering::SeqCst) {
            HealthState::StoreUnavailable
        } else if i.sources_down.load(Ordering::SeqCst) > 0 {
            HealthState::BrokerUnavailable
        } else if i.keyless.load(Ordering::SeqCst) {
            HealthState::Degraded
        } else if waiting.is_some() {
            HealthState::SourceWaiting
        } else {
            HealthState::Ready
        };
        let unavailable = matches!(
            state,
            HealthState::StoreUnavailable | HealthState::BrokerUnavailable
        );
        let unhealthy = unavailable || state == HealthState::Degraded;
        if shown.state != state {
            // A waiting source still polls with a working store and broker: leaving it for
            // an outage counts as leaving ready.
            let was_up = matches!(shown.state, HealthState::Ready | HealthState::SourceWaiting);
            if unavailable && was_up {
                i.outages.fetch_add(1, Ordering::Relaxed);
            }
            tracing::info!(from = %shown.state, to = %state, "consumer health changed");
            // The gauge counts the ready consumers of the process: each one adds itself on
            // becoming ready and takes itself off on leaving, so two consumers do not
            // overwrite each other's state.
            if state == HealthState::Ready {
                metrics::gauge!(crate::metrics::READY).increment(1.0);
            } else if shown.state == HealthState::Ready {
                metrics::gauge!(crate::metrics::READY).decrement(1.0);
            }
            shown.state = state;
            shown.since = SystemTime::now();
        }
        if state == HealthState::SourceWaiting {
            // What it waits for now (it may change while it waits).
            shown.last_error = waiting.map(|why| format!("source waiting: {why}"));
        } else if unhealthy {
            if let Some(e) = error {
                shown.last_error = Some(e);
            }
        } else {
            shown.last_error = None;
        }
    }

    /// A store call succeeded.
    pub(crate) fn store_ok(&self) {
        if self.0.store_down.swap(false, Ordering::SeqCst) {
            self.refresh(None);
        }
    }

    /// A store call failed with a retryable error (the store is down or overloaded).
    pub(crate) fn store_failed(&self, op: &str, error: &dyn std::fmt::Display) {
        self.0.store_down.store(true, Ordering::SeqCst);
        self.refresh(Some(format!("dedup store ({op}): {error}")));
    }

    /// [`KEYLESS_RUN`] messages in a row had no derivable key; `error` says the last one's
    /// reason and where the strategy looks.
    pub(crate) fn keys_failing(&self, error: String) {
        self.0.keyless.store(true, Ordering::SeqCst);
        self.refresh(Some(error));
    }

    /// A key was derived again.
    pub(crate) fn keys_ok(&self) {
        if self.0.keyless.swap(false, Ordering::SeqCst) {
            self.refresh(None);
        }
    }

    /// A poll loop started over a source whose readiness `probe` tells; the returned guard
    /// tracks that loop's source.
    pub(crate) fn loop_started(&self, probe: ReadinessProbe) -> LoopHealth {
        let id = self.0.next_loop.fetch_add(1, Ordering::Relaxed);
        self.0
            .sources
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((id, probe));
        self.0.loops.fetch_add(1, Ordering::SeqCst);
        self.refresh(None);
        LoopHealth {
            health: self.clone(),
            source_down: false,
            id,
            rechecks: self.spawn_rechecks(),
        }
    }

    /// Asks the sources again every [`SOURCE_RECHECK`]: a source starts or stops waiting
    /// without the loop hearing of it (its poll just blocks), and the gauge must follow
    /// even when nobody asks for a report. Outside a Tokio runtime there is nothing to run
    /// it on; the report then still asks the sources itself.
    fn spawn_rechecks(&self) -> Option<tokio::task::AbortHandle> {
        let rt = tokio::runtime::Handle::try_current().ok()?;
        // Weak: the task must not keep a dropped consumer's health alive.
        let health = Arc::downgrade(&self.0);
        let task = rt.spawn(async move {
            let mut tick = tokio::time::interval(SOURCE_RECHECK);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            // The first tick is immediate; the loop was just evaluated.
            tick.tick().await;
            loop {
                tick.tick().await;
                match health.upgrade() {
                    Some(inner) => Health(inner).refresh(None),
                    None => return,
                }
            }
        });
        Some(task.abort_handle())
    }
}

/// One poll loop's share of a [`Health`]: its source's state; dropping it marks the loop
/// ended. [`drive_source_reporting`](super::drive_source_reporting) holds one for its loop:
/// the engine's `run` and `run_all` report through it.
#[derive(Debug)]
pub(crate) struct LoopHealth {
    health: Health,
    source_down: bool,
    id: u64,
    /// The task that asks the sources again while the loop runs.
    rechecks: Option<tokio::task::AbortHandle>,
}

impl LoopHealth {
    /// The loop's last poll succeeded.
    pub(crate) fn poll_ok(&mut self) {
        if std::mem::take(&mut self.source_down) {
            self.health.0.sources_down.fetch_sub(1, Ordering::SeqCst);
            self.health.refresh(None);
        }
    }

    /// The loop's last poll failed.
    pub(crate) fn poll_failed(&mut self, error: &dyn std::fmt::Display) {
        if !std::mem::replace(&mut self.source_down, true) {
            self.health.0.sources_down.fetch_add(1, Ordering::SeqCst);
        }
        self.health.refresh(Some(format!("source poll: {error}")));
    }

    /// A batch finished; `outage` says whether it met an unavailable store.
    pub(crate) fn batch_finished(&mut self, outage: bool) {
        if outage {
            if !self.health.0.store_down.swap(true, Ordering::SeqCst) {
                self.health
                    .refresh(Some("dedup store unavailable: batch nacked".into()));
            }
        } else {
            self.health.store_ok();
        }
    }
}

impl Drop for LoopHealth {
    fn drop(&mut self) {
        if let Some(task) = self.rechecks.take() {
            task.abort();
        }
        if self.source_down {
            self.health.0.sources_down.fetch_sub(1, Ordering::SeqCst);
        }
        self.health
            .0
            .sources
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|(id, _)| *id != self.id);
        self.health.0.loops.fetch_sub(1, Ordering::SeqCst);
        self.health.refresh(None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
    use std::sync::atomic::AtomicBool;

    /// `idemq_consumer_ready` as the recorder holds it now.
    fn ready_gauge(snapshotter: &Snapshotter) -> f64 {
        snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .find(|(key, _, _, _)| key.key().name() == crate::metrics::READY)
            .map(|(_, _, _, value)| match value {
                DebugValue::Gauge(v) => v.into_inner(),
                _ => f64::NAN,
            })
            .unwrap_or(0.0)
    }

    /// A running loop whose source starts waiting (no partitions assigned, a window full
    /// behind a held message) while nobody asks for a report: the gauge a dashboard reads
    /// drops to 0 with the report, and comes back to 1 when the source can deliver again.
    #[test]
    fn the_ready_gauge_follows_a_source_that_says_it_is_waiting() {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        // A local recorder, so that other tests' consumers do not move this gauge; the
        // current-thread runtime runs the loop's tasks on this thread, where it applies.
        metrics::with_local_recorder(&recorder, || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .start_paused(true)
                .build()
                .expect("runtime");
            rt.block_on(async {
                let health = Health::new();
                let waiting = Arc::new(AtomicBool::new(false));
                let w = waiting.clone();
                let probe = ReadinessProbe::new(move || {
                    if w.load(Ordering::SeqCst) {
                        Readiness::Waiting(
                            "partitions of payments from the group coordinator".into(),
                        )
                    } else {
                        Readiness::Ready("assigned payments[0]".into())
                    }
                });
                let running = health.loop_started(probe);
                let ready = ready_gauge(&snapshotter);
                assert_eq!(ready, 1.0, "a polling loop with a deliverable source");

                waiting.store(true, Ordering::SeqCst);
                // Virtual time (the clock is paused): past a recheck of the sources.
                tokio::time::sleep(SOURCE_RECHECK * 2).await;
                let waiting_gauge = ready_gauge(&snapshotter);
                let report = health.report();
                assert!(
                    waiting_gauge == 0.0 && report.state == HealthState::SourceWaiting,
                    "the source waits: gauge {waiting_gauge} (want 0), report {report:?}"
                );

                waiting.store(false, Ordering::SeqCst);
                tokio::time::sleep(SOURCE_RECHECK * 2).await;
                let back = ready_gauge(&snapshotter);
                assert!(
                    back == 1.0 && health.is_ready(),
                    "the source delivers again: gauge {back} (want 1), report {:?}",
                    health.report()
                );
                drop(running);
                assert_eq!(ready_gauge(&snapshotter), 0.0, "the loop ended");
            });
        });
    }
}
