//! A panic in a listener call (one of the client's consume threads, converting a message and
//! waiting for its settlement) must not go unnoticed: the client would keep its thread or
//! lose it, the message would come back or not, and `poll` would wait for deliveries that
//! stopped coming. [`guarded`] catches it and keeps it in a [`ListenerPanic`]; from then on
//! [`poll_or_fatal`] (the source's `poll`) returns it as an error and later listener calls
//! answer "later" without delivering.

use idemq_core::adapter::ChannelSource;
use idemq_core::source::{Delivery, Source, SourceError};
use rocketmq_model::common::message::message_ext::MessageExt;
use std::sync::Mutex;
use tokio::sync::Notify;

/// The panic of a listener call, once one panicked; shared by the listeners and the source.
#[derive(Debug, Default)]
pub(crate) struct ListenerPanic {
    why: Mutex<Option<String>>,
    kept: Notify,
}

impl ListenerPanic {
    /// Why the source stopped, if a listener call panicked.
    pub(crate) fn why(&self) -> Option<String> {
        self.why.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// Runs one listener call, `call`, for `m`. A panic in it (a bug, or a client library that
/// panics on what a producer sent) is caught and kept in `panicked`, and the call answers
/// `later()` (the message goes back to the broker, nothing is lost); once a panic is kept,
/// later calls answer `later()` at once, without delivering.
pub(crate) fn guarded<T>(
    panicked: &ListenerPanic,
    m: &MessageExt,
    later: impl FnOnce() -> T,
    call: impl FnOnce() -> T,
) -> T {
    if panicked.why().is_some() {
        return later();
    }
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(call)) {
        Ok(v) => v,
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".to_string());
            tracing::error!(topic = %m.topic(), queue_id = m.queue_id(), queue_offset = m.queue_offset(), panic = %what, "a rocketmq listener call panicked: the source stops");
            *panicked.why.lock().unwrap_or_else(|e| e.into_inner()) =
                Some(format!("a listener call panicked: {what}"));
            panicked.kept.notify_waiters();
            later()
        }
    }
}

/// The next deliveries from `inner`, or the kept panic: as soon as one is kept, and from
/// then on. Cancel-safe (the channel's receive is; the panic is read again on every call).
pub(crate) async fn poll_or_fatal(
    inner: &mut ChannelSource,
    panicked: &ListenerPanic,
    max: usize,
) -> Result<Option<Vec<Delivery>>, SourceError> {
    loop {
        let kept = panicked.kept.notified();
        tokio::pin!(kept);
        // Registered before the check, so a panic kept right after it still wakes this.
        kept.as_mut().enable();
        if let Some(why) = panicked.why() {
            return Err(SourceError::Broker(why));
        }
        tokio::select! {
            got = inner.poll(max) => {
                // The panicking call may have been the last holder of the sender: the channel
                // then reads as closed at the same moment the panic is kept, and the panic,
                // not a clean end, is what the caller must hear.
                if matches!(got, Ok(None) | Err(_)) {
                    if let Some(why) = panicked.why() {
                        return Err(SourceError::Broker(why));
                    }
                }
                return got;
            }
            _ = &mut kept => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use idemq_core::adapter::channel_source;
    use std::sync::Arc;
    use std::time::Duration;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_panic_in_a_listener_call_makes_poll_fail() {
        let (tx, mut inner) = channel_source(4);
        let panicked = Arc::new(ListenerPanic::default());
        // One of the client's listener threads, in the call that converts a message, with
        // the bridge's sender alive (as it is while the consumer runs).
        let listener = std::thread::spawn({
            let panicked = panicked.clone();
            move || {
                guarded(
                    &panicked,
                    &MessageExt::default(),
                    || "later",
                    || {
                        let _sender = &tx;
                        panic!("injected: a property the conversion could not take")
                    },
                )
            }
        });
        let polled = tokio::time::timeout(
            Duration::from_secs(30),
            poll_or_fatal(&mut inner, &panicked, 10),
        )
        .await;
        match polled {
            Err(_) => panic!("poll still waits 30 s after a listener call panicked"),
            Ok(Ok(None)) => {
                panic!("poll ended the source as if it had been closed: the panic went unnoticed")
            }
            Ok(Ok(Some(got))) => panic!("poll returned {got:?}"),
            Ok(Err(e)) => assert!(
                e.to_string()
                    .contains("a listener call panicked: injected: a property"),
                "{e}"
            ),
        }
        let answer = tokio::task::spawn_blocking(move || listener.join())
            .await
            .expect("join")
            .expect("the guard caught the panic");
        assert_eq!(
            answer, "later",
            "the message goes back to the broker, not lost"
        );
        // From then on nothing more is delivered, and poll keeps failing.
        let next = guarded(
            &panicked,
            &MessageExt::default(),
            || "later",
            || panic!("a later listener call must not deliver"),
        );
        assert_eq!(next, "later");
        assert!(poll_or_fatal(&mut inner, &panicked, 10).await.is_err());
    }
}
