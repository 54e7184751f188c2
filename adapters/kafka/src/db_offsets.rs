//! Offsets kept outside Kafka: where a [`KafkaSource`](crate::KafkaSource) starts a partition
//! it is assigned.

use idemq_core::adapter::PartitionId;
use std::collections::HashMap;
use std::fmt;

/// Why stored offsets could not be read.
#[derive(Debug, Clone, thiserror::Error)]
#[error("loading stored offsets failed: {0}")]
pub struct OffsetStoreError(pub String);

/// Where the consumed offsets of a [`KafkaSource`](crate::KafkaSource) really live (a
/// database table written with the effects, for instance: see
/// [`KafkaToDatabase`](crate::KafkaToDatabase) with the `sql` feature).
///
/// The source calls [`OffsetStore::positions`] on its polling thread inside every partition
/// assignment, **before** the partitions are assigned, and starts each partition at the
/// offset returned for it. A partition without a stored offset starts where the group's
/// Kafka commit (or `auto.offset.reset`) says. When the call fails, the assignment goes on
/// from Kafka's committed offsets, which the source only ever commits after a record's
/// handler returned (so they never pass what the store holds): records may be read again and
/// the dedup record absorbs them, nothing is skipped.
///
/// The call blocks the polling thread: keep it short (one query).
///
/// ```
/// use idemq_core::adapter::PartitionId;
/// use idemq_kafka::{OffsetStore, OffsetStoreError};
/// use std::collections::HashMap;
///
/// /// Every partition starts at offset 100.
/// #[derive(Debug)]
/// struct Fixed;
///
/// impl OffsetStore for Fixed {
///     fn positions(&self, parts: &[PartitionId]) -> Result<HashMap<PartitionId, i64>, OffsetStoreError> {
///         Ok(parts.iter().map(|p| (p.clone(), 100)).collect())
///     }
/// }
/// let cfg = idemq_kafka::KafkaSourceConfig::new("127.0.0.1:9092", "billing", &["payments"])
///     .offsets_from(Fixed);
/// assert!(cfg.offset_store.is_some());
/// ```
pub trait OffsetStore: fmt::Debug + Send + Sync + 'static {
    /// The next offset to consume of each of `partitions` that has one stored.
    fn positions(
        &self,
        partitions: &[PartitionId],
    ) -> Result<HashMap<PartitionId, i64>, OffsetStoreError>;
}
