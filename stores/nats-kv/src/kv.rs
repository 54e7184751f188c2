//! The three KV operations the store is made of: read a key's latest entry from the stream
//! leader, write it only at a revision (compare-and-set), purge it only at a revision.
//!
//! Reads go through `STREAM.MSG.GET`, which only the stream leader answers, never
//! through the bucket's direct get (any replica answers that, possibly behind): a claim
//! judged on a stale replica could not be wrong (every write is checked against the
//! revision it read) but would answer `InFlight` for a key already completed.
//! Writes are publishes with `Nats-Expected-Last-Subject-Sequence`: the leader stores the
//! message only if the key's latest revision is the one given (0: the key has no entry),
//! and answers "wrong last sequence" otherwise.

use crate::codec::decode_record;
use crate::errors::{get_err, publish_err};
use async_nats::jetstream::context::{PublishError, PublishErrorKind};
use async_nats::jetstream::stream::{LastRawMessageErrorKind, Stream};
use async_nats::jetstream::Context;
use async_nats::jetstream::ErrorCode;
use async_nats::HeaderMap;
use bytes::Bytes;
use idemq_core::{DedupRecord, StoreError};
use std::time::Duration;

const EXPECTED_LAST_SUBJECT_SEQUENCE: &str = "Nats-Expected-Last-Subject-Sequence";
const TTL: &str = "Nats-TTL";
const KV_OPERATION: &str = "KV-Operation";
const ROLLUP: &str = "Nats-Rollup";
const MARKER_REASON: &str = "Nats-Marker-Reason";

/// A key's latest entry: its revision (0: none) and the record it holds, if any (a delete
/// or purge marker, or a marker the server left when a TTL ran out, holds none).
#[derive(Debug, Clone)]
pub(crate) struct Slot {
    pub revision: u64,
    pub record: Option<DedupRecord>,
}

/// A bucket's stream, seen as the store uses it.
#[derive(Clone)]
pub(crate) struct Bucket {
    /// The bucket handle (for `keys()`).
    pub kv: async_nats::jetstream::kv::Store,
    pub js: Context,
    pub stream: Stream,
    /// `$KV.<bucket>.`
    pub subject_prefix: String,
    /// Whether the bucket's stream takes `Nats-TTL`.
    pub ttl: bool,
}

/// The whole seconds `Nats-TTL` takes (at least 1, rounded up).
pub(crate) fn ttl_secs(d: Duration) -> u64 {
    d.as_secs()
        .saturating_add(u64::from(d.subsec_nanos() > 0))
        .max(1)
}

impl Bucket {
    /// The latest entry of `key` (a KV key, without the `$KV.<bucket>.` prefix).
    pub(crate) async fn read(&self, key: &str) -> Result<Slot, StoreError> {
        let subject = format!("{}{}", self.subject_prefix, key);
        let msg = match self.stream.get_last_raw_message_by_subject(&subject).await {
            Ok(m) => m,
            Err(e) => {
                let none = match e.kind() {
                    LastRawMessageErrorKind::NoMessageFound => true,
                    LastRawMessageErrorKind::JetStream(api) => {
                        api.error_code() == ErrorCode::NO_MESSAGE_FOUND
                    }
                    _ => false,
                };
                if none {
                    return Ok(Slot {
                        revision: 0,
                        record: None,
                    });
                }
                return Err(get_err(e));
            }
        };
        let marker = msg.headers.get(MARKER_REASON).is_some()
            || msg
                .headers
                .get(KV_OPERATION)
                .is_some_and(|op| op.as_str() != "PUT");
        let record = if marker || msg.payload.is_empty() {
            None
        } else {
            Some(decode_record(key, &msg.payload)?)
        };
        Ok(Slot {
            revision: msg.sequence,
            record,
        })
    }

    /// Writes `value` at `key` if its latest revision is still `expected`: `Some(new
    /// revision)`, or `None` when another write came first.
    pub(crate) async fn write(
        &self,
        key: &str,
        value: Bytes,
        expected: u64,
        ttl: Option<Duration>,
    ) -> Result<Option<u64>, StoreError> {
        let mut headers = HeaderMap::new();
        headers.insert(
            EXPECTED_LAST_SUBJECT_SEQUENCE,
            expected.to_string().as_str(),
        );
        if let (true, Some(ttl)) = (self.ttl, ttl) {
            headers.insert(TTL, format!("{}s", ttl_secs(ttl)).as_str());
        }
        self.publish(key, headers, value, "write a record").await
    }

    /// Removes `key`'s record if its latest revision is still `expected` (a purge marker
    /// replaces every revision; with TTLs it leaves after `marker_ttl`). `false` when
    /// another write came first.
    pub(crate) async fn purge(
        &self,
        key: &str,
        expected: u64,
        marker_ttl: Duration,
    ) -> Result<bool, StoreError> {
        let mut headers = HeaderMap::new();
        headers.insert(
            EXPECTED_LAST_SUBJECT_SEQUENCE,
            expected.to_string().as_str(),
        );
        headers.insert(KV_OPERATION, "PURGE");
        headers.insert(ROLLUP, "sub");
        if self.ttl {
            headers.insert(TTL, format!("{}s", ttl_secs(marker_ttl)).as_str());
        }
        Ok(self
            .publish(key, headers, Bytes::new(), "purge a record")
            .await?
            .is_some())
    }

    async fn publish(
        &self,
        key: &str,
        headers: HeaderMap,
        value: Bytes,
        what: &str,
    ) -> Result<Option<u64>, StoreError> {
        let subject = format!("{}{}", self.subject_prefix, key);
        let ack = self
            .js
            .publish_with_headers(subject, headers, value)
            .await
            .map_err(|e| publish_err(what, e))?;
        match ack.await {
            Ok(ack) => Ok(Some(ack.sequence)),
            Err(e) if is_wrong_last_sequence(&e) => Ok(None),
            Err(e) => Err(publish_err(what, e)),
        }
    }
}

/// Whether a publish was refused for its revision check. A single server answers error
/// code 10071 ("wrong last sequence: N"), which async-nats 0.52 maps to
/// `WrongLastSequence`; a clustered stream leader answers 10164 ("wrong last sequence",
/// when another write to the key is still being replicated), which it reports as `Other`.
/// Both mean another write came first.
fn is_wrong_last_sequence(e: &PublishError) -> bool {
    e.kind() == PublishErrorKind::WrongLastSequence
        || std::error::Error::source(e)
            .and_then(|s| s.downcast_ref::<async_nats::jetstream::Error>())
            .is_some_and(|api| {
                api.error_code() == ErrorCode::STREAM_WRONG_LAST_SEQUENCE
                    || api.error_code() == ErrorCode::STREAM_WRONG_LAST_SEQUENCE_CONSTANT
            })
}
