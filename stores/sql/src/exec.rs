//! What every statement shares: the key-length check, the immediate retry after a deadlock
//! or serialization failure ([`retry_now!`]), and statement arguments rebuilt for a retry.

use crate::backend::Val;
use idemq_core::key::MAX_DEDUP_KEY_BYTES;
use idemq_core::{DedupKey, RetryPolicy, StoreError};
use std::time::Duration;

/// How many times a statement is retried at once after a deadlock or serialization failure.
pub(crate) const RETRY_NOW_ATTEMPTS: u32 = 8;

/// Rejects keys longer than the key columns hold.
pub(crate) fn check_key(key: &DedupKey) -> Result<(), StoreError> {
    let len = key.as_str().len();
    if len > MAX_DEDUP_KEY_BYTES {
        return Err(StoreError::KeyTooLong {
            len,
            max: MAX_DEDUP_KEY_BYTES,
        });
    }
    Ok(())
}

pub(crate) fn limit_i64(limit: usize) -> i64 {
    i64::try_from(limit).unwrap_or(i64::MAX)
}

/// The wait before retrying a statement the database rolled back (a deadlock, a
/// serialization failure): short, doubling, with full jitter so the two sides of a deadlock
/// do not meet again.
pub(crate) async fn backoff(attempt: u32) {
    let policy =
        RetryPolicy::backoff(Duration::from_millis(2), Duration::from_millis(256)).with_jitter(1.0);
    tokio::time::sleep(policy.delay(attempt)).await;
}

/// Statement arguments that move into the first attempt; a retry (rare: a deadlock or a
/// serialization failure) rebuilds them.
pub(crate) fn first_then(
    first: Vec<Val>,
    rebuild: impl Fn() -> Vec<Val>,
) -> impl FnMut() -> Vec<Val> {
    let mut first = Some(first);
    move || first.take().unwrap_or_else(&rebuild)
}

/// Runs an autocommit statement, retrying at once (with jitter) after a deadlock or
/// serialization failure, which roll back only that statement.
/// (Paths are absolute so that any module can use it; `DB` is the caller's backend.)
macro_rules! retry_now {
    ($op:expr, $call:expr) => {{
        let mut attempt = 0u32;
        loop {
            match $call.await {
                Ok(v) => break Ok(v),
                Err(e)
                    if attempt < $crate::exec::RETRY_NOW_ATTEMPTS
                        && $crate::backend::error_class::<DB>(&e)
                            == $crate::backend::ErrorClass::RetryNow =>
                {
                    attempt += 1;
                    tracing::debug!(op = $op, attempt, error = %e, "retrying after deadlock/serialization failure");
                    $crate::exec::backoff(attempt).await;
                }
                Err(e) => break Err($crate::backend::map_sqlx_error::<DB>($op, e)),
            }
        }
    }};
}
pub(crate) use retry_now;
