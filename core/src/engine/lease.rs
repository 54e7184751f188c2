//! The leases a batch holds, their heartbeat, and the lease watch handlers see.

use crate::handler::LeaseWatch;
use crate::key::DedupKey;
use crate::metrics as m;
use crate::store::{now_ms, DedupStore, ExtendOutcome, FencingToken};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

struct Held {
    token: FencingToken,
    /// End of the lease as last confirmed by the store.
    until_ms: i64,
    lost: tokio::sync::watch::Sender<bool>,
}

/// The leases a batch holds, from the claim until their completion is durable or they are
/// given back. One heartbeat renews all of them.
#[derive(Default)]
pub(crate) struct LiveLeases(std::sync::Mutex<HashMap<DedupKey, Held>>);

impl LiveLeases {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<DedupKey, Held>> {
        // The map holds plain data: a panic elsewhere leaves it usable.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts tracking a lease; the returned watch flips when it is lost.
    pub(crate) fn insert(&self, key: DedupKey, token: FencingToken, until_ms: i64) -> LeaseWatch {
        let (lost, watch) = LeaseWatch::pair();
        self.map().insert(
            key,
            Held {
                token,
                until_ms,
                lost,
            },
        );
        watch
    }

    pub(crate) fn remove(&self, key: &DedupKey) {
        self.map().remove(key);
    }

    fn owned(&self) -> Vec<(DedupKey, FencingToken)> {
        self.map()
            .iter()
            .filter(|(_, h)| !*h.lost.borrow())
            .map(|(k, h)| (k.clone(), h.token))
            .collect()
    }

    fn extended(&self, key: &DedupKey, until_ms: i64) {
        if let Some(h) = self.map().get_mut(key) {
            h.until_ms = until_ms;
        }
    }

    fn mark_lost(&self, key: &DedupKey) {
        if let Some(h) = self.map().get(key) {
            h.lost.send_replace(true);
        }
    }

    /// Keys whose lease end has passed on this clock (heartbeats failed meanwhile): someone
    /// else may hold them now.
    fn expired(&self, now: i64, margin_ms: i64) -> Vec<DedupKey> {
        self.map()
            .iter()
            .filter(|(_, h)| !*h.lost.borrow() && h.until_ms - margin_ms <= now)
            .map(|(k, _)| k.clone())
            .collect()
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
/// already have handed it to another worker), as is one the store answers `Fenced`.
pub(crate) async fn heartbeat(
    store: Arc<dyn DedupStore>,
    live: Arc<LiveLeases>,
    lease: Duration,
    beat: Duration,
    timeout: Duration,
) {
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + beat, beat);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // A lease is given up one beat before its end: the next beat might come too late.
    let margin_ms = crate::store::duration_ms(beat).min(crate::store::duration_ms(lease) / 2);
    loop {
        tick.tick().await;
        for (key, token) in live.owned() {
            match tokio::time::timeout(timeout, store.extend(&key, token, lease)).await {
                Ok(Ok(ExtendOutcome::Extended { until_ms })) => live.extended(&key, until_ms),
                Ok(Ok(ExtendOutcome::Fenced)) => {
                    tracing::warn!(%key, "lease lost (heartbeat fenced): another worker took the key over");
                    live.mark_lost(&key);
                }
                Ok(Err(e)) => {
                    metrics::counter!(m::STORE_ERRORS, "op" => "extend").increment(1);
                    tracing::warn!(%key, error = %e, "heartbeat failed");
                }
                Err(_) => {
                    metrics::counter!(m::STORE_ERRORS, "op" => "extend").increment(1);
                    tracing::warn!(%key, ?timeout, "heartbeat timed out");
                }
            }
        }
        for key in live.expired(now_ms(), margin_ms) {
            tracing::warn!(%key, "lease ran out while heartbeats failed; treating it as lost");
            live.mark_lost(&key);
        }
    }
}
