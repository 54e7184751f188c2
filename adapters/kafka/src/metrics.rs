//! Kafka adapter metric names, through the `metrics` facade (the core's names cover
//! messages and settlements; these cover what only Kafka does).
//!
//! | name | kind | labels |
//! |---|---|---|
//! | `idemq_kafka_commit_failures_total` | counter | — (the offsets are offered again) |
//! | `idemq_kafka_dead_letters_total` | counter | `topic` (the dead-letter topic) |
//! | `idemq_kafka_partitions_revoked_total` | counter | — |
//! | `idemq_kafka_partitions_paused_total` | counter | — (back-pressure pauses) |
//! | `idemq_kafka_header_names_escaped_total` | counter | — (header names that are not UTF-8, carried escaped) |
//! | `idemq_kafka_transaction_retries_total` | counter | `call` (`send_offsets_to_transaction`, `commit_transaction`) |

/// Offset commits the broker refused.
pub const COMMIT_FAILURES: &str = "idemq_kafka_commit_failures_total";
/// Records produced to a dead-letter topic.
pub const DEAD_LETTERS: &str = "idemq_kafka_dead_letters_total";
/// Partitions taken away by a rebalance.
pub const PARTITIONS_REVOKED: &str = "idemq_kafka_partitions_revoked_total";
/// Partitions paused because their local buffer was full.
pub const PARTITIONS_PAUSED: &str = "idemq_kafka_partitions_paused_total";
/// Header names that were not UTF-8, carried escaped (see [`crate::escape_header_name`]).
pub const HEADER_NAMES_ESCAPED: &str = "idemq_kafka_header_names_escaped_total";
/// Transactional calls of a `TransactionalProcessor` called again after a retriable error
/// (a timed-out commit whose outcome is not known yet).
pub const TRANSACTION_RETRIES: &str = "idemq_kafka_transaction_retries_total";
