//! [`LeaseWatchdog`]: keeps a lease alive while a long handler runs (Redisson's watchdog).

use idemq_core::{now_ms, DedupKey, DedupStore, ExtendOutcome, FencingToken, Lease};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Why a watched lease is no longer held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LeaseLost {
    /// The store says the token no longer owns the key (taken over, released or forgotten).
    Fenced,
    /// Renewals kept failing (store unreachable) until the lease ended: another worker may
    /// take the key over at any moment.
    Expired,
}

/// The state a [`LeaseWatchdog`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LeaseState {
    /// Held until `until_ms` (ms since the Unix epoch) unless renewed again.
    Held {
        /// End of the lease as last extended.
        until_ms: i64,
    },
    /// No longer held: stop the work, do not complete (completion would be fenced anyway).
    Lost(LeaseLost),
}

/// Extends a lease every `lease / 3` until dropped, like Redisson's lock watchdog.
///
/// Works with any [`DedupStore`]. The handler can poll [`LeaseWatchdog::state`] or await
/// [`LeaseWatchdog::lost`] (e.g. in `tokio::select!`) to abort work whose key was taken
/// over. Dropping the watchdog stops the renewals; the lease then ends on its own unless the
/// key is completed or released.
///
/// ```
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// use idemq_core::{ClaimOutcome, ClaimRequest, ConsumerGroup, DedupKey, DedupStore, MemoryStore};
/// use idemq_layered::{LeaseState, LeaseWatchdog};
/// use std::{sync::Arc, time::Duration};
/// let store: Arc<dyn DedupStore> = Arc::new(MemoryStore::new());
/// let key = DedupKey::new(&ConsumerGroup::new("g").unwrap(), "job-1").unwrap();
/// let lease_len = Duration::from_millis(300);
/// let ClaimOutcome::Acquired(lease) = store.claim(&ClaimRequest::new(key.clone(), lease_len)).await.unwrap()
/// else { panic!() };
/// let dog = LeaseWatchdog::spawn(store.clone(), key.clone(), lease, lease_len);
/// tokio::time::sleep(Duration::from_millis(700)).await; // longer than the lease
/// assert!(matches!(dog.state(), LeaseState::Held { .. }));
/// drop(dog);
/// # });
/// ```
#[derive(Debug)]
pub struct LeaseWatchdog {
    state: watch::Receiver<LeaseState>,
    task: JoinHandle<()>,
}

impl LeaseWatchdog {
    /// Starts renewing `lease` on `key`, extending by `lease_len` every `lease_len / 3`.
    /// Must be called inside a Tokio runtime.
    pub fn spawn(
        store: Arc<dyn DedupStore>,
        key: DedupKey,
        lease: Lease,
        lease_len: Duration,
    ) -> Self {
        let every = (lease_len / 3).max(Duration::from_millis(5));
        Self::spawn_with_interval(store, key, lease, lease_len, every)
    }

    /// Like [`LeaseWatchdog::spawn`] with an explicit renewal interval (keep it well below
    /// `lease_len`: a renewal must land before the lease ends, despite store latency).
    pub fn spawn_with_interval(
        store: Arc<dyn DedupStore>,
        key: DedupKey,
        lease: Lease,
        lease_len: Duration,
        every: Duration,
    ) -> Self {
        let (tx, rx) = watch::channel(LeaseState::Held {
            until_ms: lease.until_ms,
        });
        let task = tokio::spawn(renew(
            store,
            key,
            lease.token,
            lease.until_ms,
            lease_len,
            every,
            tx,
        ));
        Self { state: rx, task }
    }

    /// The latest known state.
    pub fn state(&self) -> LeaseState {
        *self.state.borrow()
    }

    /// Resolves when the lease is lost (never, while renewals succeed).
    pub async fn lost(&mut self) -> LeaseLost {
        loop {
            if let LeaseState::Lost(why) = *self.state.borrow_and_update() {
                return why;
            }
            if self.state.changed().await.is_err() {
                // The task ended without reporting a loss: only after a stop, so the
                // lease is no longer renewed.
                return match *self.state.borrow() {
                    LeaseState::Lost(why) => why,
                    LeaseState::Held { .. } => LeaseLost::Expired,
                };
            }
        }
    }

    /// Stops renewing (same as dropping).
    pub fn stop(self) {}
}

impl Drop for LeaseWatchdog {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn renew(
    store: Arc<dyn DedupStore>,
    key: DedupKey,
    token: FencingToken,
    mut until_ms: i64,
    lease_len: Duration,
    every: Duration,
    tx: watch::Sender<LeaseState>,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await; // the first tick is immediate
    loop {
        tick.tick().await;
        match store.extend(&key, token, lease_len).await {
            Ok(ExtendOutcome::Extended { until_ms: u }) => {
                until_ms = u;
                tx.send_replace(LeaseState::Held { until_ms });
            }
            Ok(ExtendOutcome::Fenced) => {
                tracing::warn!(%key, "lease lost: token fenced");
                tx.send_replace(LeaseState::Lost(LeaseLost::Fenced));
                return;
            }
            Err(e) => {
                if now_ms() >= until_ms {
                    tracing::warn!(%key, error = %e, "lease lost: renewals failed until it ended");
                    tx.send_replace(LeaseState::Lost(LeaseLost::Expired));
                    return;
                }
                tracing::debug!(%key, error = %e, "lease renewal failed; retrying");
            }
        }
    }
}
