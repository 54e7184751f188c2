//! Waiting for a server node to be ready before a test acts on it. A node that was just
//! started, or that resyncs from another, accepts connections well before it can do what a
//! test asks: a Redis replica answers `LOADING` while it loads the dataset its master sent
//! it, a JetStream replica is not current until it has caught up. A test that asks such a
//! node for a failover, or kills the node it depends on, fails for a reason unrelated to
//! what it tests; these bounded polls wait instead, and when the node never gets ready they
//! fail naming it and its last answer.
//!
//! ```no_run
//! use idemq_core::testkit::ready::{retry_transient, wait_ready};
//! use std::time::Duration;
//!
//! async fn failover(port: u16) {
//!     let node = format!("redis node 127.0.0.1:{port}");
//!     let ping = || async { Ok::<(), String>(()) }; // e.g. PING answered PONG
//!     wait_ready(&node, Duration::from_secs(60), ping).await;
//!     let ask = || async { Ok::<&str, String>("OK") }; // e.g. CLUSTER FAILOVER
//!     retry_transient(&node, "CLUSTER FAILOVER", Duration::from_secs(60), ask, |e| {
//!         e.starts_with("LOADING")
//!     })
//!     .await;
//! }
//! ```

use std::future::Future;
use std::time::{Duration, Instant};

/// Pause between two probes: short next to a node's load or resync, long enough not to
/// load it with probes.
const POLL: Duration = Duration::from_millis(100);

/// Polls `probe` until it answers `Ok`, for at most `within`. `Err(answer)` means "not yet"
/// and says what the node answered (an error reply, the field that is not as wanted). A
/// probe that hangs counts as not answering: it is given what is left of `within`. Returns
/// the value and the time waited, or the last answer when `within` ran out.
pub async fn poll_until<T, F, Fut>(within: Duration, probe: F) -> Result<(T, Duration), String>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    poll(within, probe)
        .await
        .map(|polled| (polled.value, polled.waited))
}

/// What [`poll`] got: the value, the time it took, and the first "not yet" answer when
/// the first probe was not the one that succeeded.
struct Polled<T> {
    value: T,
    waited: Duration,
    first: Option<String>,
}

async fn poll<T, F, Fut>(within: Duration, mut probe: F) -> Result<Polled<T>, String>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    let t0 = Instant::now();
    let mut first = None;
    loop {
        let left = within.saturating_sub(t0.elapsed()).max(POLL);
        let last = match tokio::time::timeout(left, probe()).await {
            Ok(Ok(value)) => {
                return Ok(Polled {
                    value,
                    waited: t0.elapsed(),
                    first,
                })
            }
            Ok(Err(answer)) => answer,
            Err(_) => format!("no answer within {left:?}"),
        };
        if t0.elapsed() >= within {
            return Err(last);
        }
        first.get_or_insert(last);
        tokio::time::sleep(POLL).await;
    }
}

/// Waits until `probe` says `node` is ready (see [`poll_until`]); panics naming `node`, the
/// bound and the last answer when it is not within `within`. A wait that was needed is
/// printed (stderr) with the node's first answer, so a slow node shows in the test's
/// output. Returns the time waited.
pub async fn wait_ready<F, Fut>(node: &str, within: Duration, probe: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(), String>>,
{
    match poll(within, probe).await {
        Ok(polled) => {
            if let Some(first) = polled.first {
                eprintln!(
                    "{node}: ready after {:?} (first answer: {first})",
                    polled.waited
                );
            }
            polled.waited
        }
        Err(last) => panic!("{node} not ready within {within:?}; last answer: {last}"),
    }
}

/// Runs the action `op` on `node` until it succeeds, again while it fails with an answer
/// `transient` accepts (the node still loading, a connection refused while it restarts),
/// for at most `within`. Panics naming `node`, `what` and the answer at the first other
/// failure, or with the last answer when `within` ran out.
pub async fn retry_transient<T, F, Fut>(
    node: &str,
    what: &str,
    within: Duration,
    mut op: F,
    transient: impl Fn(&str) -> bool,
) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    let result = poll(within, || {
        let attempt = op();
        let transient = &transient;
        async move {
            match attempt.await {
                Ok(v) => Ok(Ok(v)),
                Err(answer) if transient(&answer) => Err(answer),
                Err(answer) => Ok(Err(answer)),
            }
        }
    })
    .await;
    match result {
        Ok(Polled {
            value: Ok(v),
            waited,
            first,
        }) => {
            if let Some(first) = first {
                eprintln!(
                    "{node}: {what} done after {waited:?} of retries (first answer: {first})"
                );
            }
            v
        }
        Ok(Polled {
            value: Err(answer), ..
        }) => panic!("{what} on {node} failed: {answer}"),
        Err(last) => panic!("{what} on {node} still failing after {within:?}; last answer: {last}"),
    }
}
