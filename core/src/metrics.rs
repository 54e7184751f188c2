//! Metric names and labels, through the `metrics` facade (install any recorder).
//!
//! | name | kind | labels |
//! |---|---|---|
//! | `idemq_messages_total` | counter | `outcome` (see [`outcome`]), `broker`, `group` |
//! | `message_duplicate_count` | counter | `topic`, `group` (seed 002's name) |
//! | `idemq_claim_seconds` | histogram | `group` (one observation per batch claim) |
//! | `idemq_in_flight_conflicts_total` | counter | `group` |
//! | `idemq_lease_takeovers_total` | counter | `group` |
//! | `idemq_fenced_completions_total` | counter | `group` |
//! | `idemq_store_errors_total` | counter | `op` (claim, complete, release, extend) |
//! | `idemq_payload_conflicts_total` | counter | `group` |
//! | `idemq_settle_failures_total` | counter | `broker`, `settlement` (ack, nack, reject) |
//! | `idemq_hook_failures_total` | counter | `hook` (on_duplicate, on_dead_letter, key_function), `failure` (panic, timeout) |
//! | `idemq_batch_splits_total` | counter | `group` (batch calls split into per-message runs) |
//! | `idemq_transaction_retries_total` | counter | `reason` (deadlock, serialization) |
//! | `idemq_key_errors_total` | counter | `group`, `reason` ([`KeyError::kind`](crate::KeyError::kind)): messages dead-lettered because no dedup key could be derived |
//! | `idemq_consumer_ready` | gauge | – (consumers of this process whose [`Health`](crate::engine::Health) is ready) |

/// Messages by outcome.
pub const MESSAGES: &str = "idemq_messages_total";
/// Duplicates skipped, by topic and consumer group.
pub const DUPLICATES: &str = "message_duplicate_count";
/// Claim latency.
pub const CLAIM_SECONDS: &str = "idemq_claim_seconds";
/// Claims answered InFlight.
pub const IN_FLIGHT_CONFLICTS: &str = "idemq_in_flight_conflicts_total";
/// Expired leases taken over.
pub const LEASE_TAKEOVERS: &str = "idemq_lease_takeovers_total";
/// Completions refused because the lease was lost.
pub const FENCED_COMPLETIONS: &str = "idemq_fenced_completions_total";
/// Store calls that failed.
pub const STORE_ERRORS: &str = "idemq_store_errors_total";
/// Same key, different payload.
pub const PAYLOAD_CONFLICTS: &str = "idemq_payload_conflicts_total";
/// Settlements (ack, nack, reject) the broker refused.
pub const SETTLE_FAILURES: &str = "idemq_settle_failures_total";
/// User hooks (and key functions) that panicked or overran `hook_timeout`; the message was
/// settled as it would have been anyway.
pub const HOOK_FAILURES: &str = "idemq_hook_failures_total";
/// Batch handler calls that failed and were split: each of their messages ran alone.
pub const BATCH_SPLITS: &str = "idemq_batch_splits_total";
/// Transactions retried after the database reported a deadlock or a serialization failure
/// (label `reason`: `deadlock` or `serialization`).
pub const TRANSACTION_RETRIES: &str = "idemq_transaction_retries_total";
/// Messages dead-lettered because no dedup key could be derived from them (label `reason`:
/// the [`KeyError`](crate::KeyError)'s kind).
pub const KEY_ERRORS: &str = "idemq_key_errors_total";
/// Consumers of this process that are ready (polling, store and broker answering).
pub const READY: &str = "idemq_consumer_ready";

/// Values of the `outcome` label.
pub mod outcome {
    /// Handler ran and the record completed.
    pub const PROCESSED: &str = "processed";
    /// Skipped as a duplicate (acked).
    pub const DUPLICATE: &str = "duplicate";
    /// Another worker holds it; redelivered later.
    pub const IN_FLIGHT: &str = "in_flight";
    /// Handler failed; released and redelivered later.
    pub const RETRIED: &str = "retried";
    /// Dead-lettered (no key, payload conflict, permanent handler failure).
    pub const REJECTED: &str = "rejected";
    /// The lease was lost before completion; redelivered later.
    pub const FENCED: &str = "fenced";
    /// The store was unavailable; redelivered later.
    pub const STORE_UNAVAILABLE: &str = "store_unavailable";
    /// The store answered one key with an error other than unavailability; redelivered later.
    pub const STORE_ERROR: &str = "store_error";
    /// Sent back unrun: an earlier message of its ordering lane was sent back.
    pub const DEFERRED: &str = "deferred";
    /// Its delivery went stale (partition revoked) before the handler ran.
    pub const STALE: &str = "stale";
}
