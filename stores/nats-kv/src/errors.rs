//! async-nats errors as [`StoreError`]s.
//!
//! The rule: whatever may be an outage (no answer, no responders, a stream without a
//! leader, a broken connection, an unknown failure of a request) is
//! [`StoreError::Unavailable`], so the engine acks nothing and backs off; only what
//! retrying cannot fix as is (a value over the server's limit, a missing bucket, an
//! invalid subject) is `Backend` or `Config`. A store never guesses an outcome.

use async_nats::jetstream::context::{PublishError, PublishErrorKind, RequestError};
use async_nats::jetstream::stream::{LastRawMessageError, LastRawMessageErrorKind};
use async_nats::jetstream::ErrorCode;
use idemq_core::StoreError;

/// A JetStream API error answer.
pub(crate) fn api_err(what: &str, e: &async_nats::jetstream::Error) -> StoreError {
    let code = e.error_code();
    if code == ErrorCode::STREAM_NOT_FOUND {
        return StoreError::Config(format!(
            "cannot {what}: the KV bucket's stream does not exist (deleted?): {e}"
        ));
    }
    if code == ErrorCode::JETSTREAM_NOT_ENABLED
        || code == ErrorCode::JETSTREAM_NOT_ENABLED_FOR_ACCOUNT
    {
        return StoreError::Config(format!(
            "cannot {what}: JetStream is not enabled on this NATS server or account (start nats-server with -js): {e}"
        ));
    }
    // 503 / 408 and "cluster not available" are the answers of a cluster electing a leader
    // or without quorum; anything unknown is treated as transient too (never acked).
    StoreError::Unavailable(format!("cannot {what}: {e}"))
}

/// A JetStream API request that got no usable answer.
pub(crate) fn request_err(what: &str, e: RequestError) -> StoreError {
    use async_nats::jetstream::context::RequestErrorKind as K;
    match e.kind() {
        K::InvalidSubject => StoreError::Config(format!("cannot {what}: {e}")),
        K::NoResponders | K::TimedOut | K::Other => {
            StoreError::Unavailable(format!("cannot {what}: NATS did not answer: {e}"))
        }
    }
}

/// A publish that failed for another reason than its revision check (the caller handles
/// `WrongLastSequence` first).
pub(crate) fn publish_err(what: &str, e: PublishError) -> StoreError {
    match e.kind() {
        PublishErrorKind::MaxPayloadExceeded => StoreError::Backend(format!(
            "cannot {what}: the record exceeds the server's max_payload (a stored result too large?): {e}"
        )),
        PublishErrorKind::StreamNotFound => StoreError::Unavailable(format!(
            "cannot {what}: no JetStream stream answered (bucket deleted, or no server holds it now): {e}"
        )),
        _ => StoreError::Unavailable(format!("cannot {what}: {e}")),
    }
}

/// A failed message get other than "no message".
pub(crate) fn get_err(e: LastRawMessageError) -> StoreError {
    match e.kind() {
        LastRawMessageErrorKind::JetStream(api) => api_err("read a record", &api),
        LastRawMessageErrorKind::InvalidSubject => {
            StoreError::Config(format!("cannot read a record: invalid subject: {e}"))
        }
        _ => StoreError::Unavailable(format!("cannot read a record: {e}")),
    }
}
