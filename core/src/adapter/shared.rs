//! State shared by a source and its deliveries, and the settlement shape of sources that
//! keep their own offsets and redeliver locally (Kafka, RabbitMQ streams).

use crate::source::{Settle, SourceError};
use async_trait::async_trait;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::futures::Notified;
use tokio::sync::Notify;

/// A source's state behind a lock, with a wake-up for its `poll` when a settlement (a nack,
/// a redelivery coming due, a close) changes what it can hand out.
///
/// The lock does not poison: every update under it is a single step, so a panic in one
/// handler's settlement must not make every later settlement panic too.
///
/// ```
/// use idemq_core::adapter::SharedState;
///
/// let shared = SharedState::new(Vec::<u64>::new());
/// shared.lock().push(7);
/// shared.wake_one();
/// assert_eq!(*shared.lock(), vec![7]);
/// ```
#[derive(Debug, Default)]
pub struct SharedState<S> {
    state: Mutex<S>,
    wake: Notify,
}

impl<S> SharedState<S> {
    /// Wraps `state`.
    pub fn new(state: S) -> Self {
        Self {
            state: Mutex::new(state),
            wake: Notify::new(),
        }
    }

    /// Locks the state (never poisoned).
    pub fn lock(&self) -> MutexGuard<'_, S> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wakes the one waiting `poll` (or the next one to wait).
    pub fn wake_one(&self) {
        self.wake.notify_one();
    }

    /// Wakes every task waiting now.
    pub fn wake_all(&self) {
        self.wake.notify_waiters();
    }

    /// A future that completes at the next wake-up.
    pub fn woken(&self) -> Notified<'_> {
        self.wake.notified()
    }
}

/// The settlement of one delivery from a source that tracks its own offsets and holds
/// nacked deliveries locally: what differs per broker, with [`HeldSettle`] mapping it onto
/// [`Settle`] the same way for all of them.
///
/// Every method must be harmless on a stale delivery (its partition revoked, its
/// subscription replaced, the source closed): the new owner reads the message again.
#[async_trait]
pub trait LocallyHeld: Send + Sync {
    /// The delivery is done for good: its offset may be committed.
    fn settled(&mut self);

    /// Hands the delivery out again after `delay`, its offset kept outstanding meanwhile
    /// (so nothing past it is committed).
    fn hold(&mut self, delay: Duration);

    /// Copies the delivery to the dead-letter destination with `reason`, confirmed.
    /// Returns `Ok(())` without copying when the delivery is stale.
    async fn dead_letter(&mut self, reason: &str) -> Result<(), SourceError>;

    /// Whether the delivery has gone stale.
    fn is_stale(&self) -> bool;
    /// The delivery's envelope, back from the engine before `hold` or `dead_letter` (see
    /// [`Settle::take_back`]): keep it for them. The default drops it.
    fn take_back(&mut self, _envelope: crate::Envelope) {}
}

/// [`Settle`] for a [`LocallyHeld`] delivery: ack settles, nack and abandon hold it locally,
/// reject dead-letters it and then settles it (a failed dead-letter settles nothing, so the
/// message is not lost).
#[derive(Debug)]
pub struct HeldSettle<T>(pub T);

#[async_trait]
impl<T: LocallyHeld> Settle for HeldSettle<T> {
    async fn ack(&mut self) -> Result<(), SourceError> {
        self.0.settled();
        Ok(())
    }

    async fn nack(&mut self, redeliver_after: Duration) -> Result<(), SourceError> {
        self.0.hold(redeliver_after);
        Ok(())
    }

    async fn reject(&mut self, reason: &str) -> Result<(), SourceError> {
        self.0.dead_letter(reason).await?;
        self.0.settled();
        Ok(())
    }

    fn abandon(&mut self) {
        self.0.hold(Duration::ZERO);
    }

    fn is_stale(&self) -> bool {
        self.0.is_stale()
    }
    fn take_back(&mut self, envelope: crate::Envelope) {
        self.0.take_back(envelope);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Log {
        calls: Vec<String>,
        dead_letter_fails: bool,
    }

    #[async_trait]
    impl LocallyHeld for Log {
        fn settled(&mut self) {
            self.calls.push("settled".into());
        }
        fn hold(&mut self, delay: Duration) {
            self.calls.push(format!("hold {}ms", delay.as_millis()));
        }
        async fn dead_letter(&mut self, reason: &str) -> Result<(), SourceError> {
            if self.dead_letter_fails {
                return Err(SourceError::Broker("dlq down".into()));
            }
            self.calls.push(format!("dead_letter {reason}"));
            Ok(())
        }
        fn is_stale(&self) -> bool {
            false
        }
    }

    #[tokio::test]
    async fn each_settlement_maps_onto_the_local_hold() {
        let mut s = HeldSettle(Log::default());
        s.ack().await.expect("ack");
        s.nack(Duration::from_millis(5)).await.expect("nack");
        s.abandon();
        s.reject("bad").await.expect("reject");
        assert_eq!(
            s.0.calls,
            [
                "settled",
                "hold 5ms",
                "hold 0ms",
                "dead_letter bad",
                "settled"
            ]
        );
    }

    #[tokio::test]
    async fn a_failed_dead_letter_settles_nothing() {
        let mut s = HeldSettle(Log {
            dead_letter_fails: true,
            ..Log::default()
        });
        assert!(s.reject("bad").await.is_err());
        assert!(s.0.calls.is_empty(), "{:?}", s.0.calls);
    }
}
