//! Kafka adapter metric names, through the `metrics` facade (the core's names cover
//! messages and settlements; these cover what only Kafka does).
//!
//! | name | kind | labels |
//! |---|---|---|
//! | `idemq_kafka_commit_failures_total` | counter | — (the offsets are offered again) |
//! | `idemq_kafka_dead_letters_total` | counter | `topic` (the dead-letter topic) |
//! | `idemq_kafka_partitions_revoked_total` | counter | — |
//! | `idemq_kafka_partitions_paused_total` | counter | — (back-pressure pauses) |

/// Offset commits the broker refused.
pub const COMMIT_FAILURES: &str = "idemq_kafka_commit_failures_total";
/// Records produced to a dead-letter topic.
pub const DEAD_LETTERS: &str = "idemq_kafka_dead_letters_total";
/// Partitions taken away by a rebalance.
pub const PARTITIONS_REVOKED: &str = "idemq_kafka_partitions_revoked_total";
/// Partitions paused because their local buffer was full.
pub const PARTITIONS_PAUSED: &str = "idemq_kafka_partitions_paused_total";
