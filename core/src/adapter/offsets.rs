//! Per-partition committable watermarks, and where a partition starts when its consumed
//! offsets live outside the broker.

use std::collections::{BTreeSet, HashMap};
use std::fmt;

/// A partition: topic (or RocketMQ `broker/topic`) and partition / queue id.
pub type PartitionId = (String, i32);

/// One assignment of a partition to this consumer. A settlement carries the epoch of the
/// assignment it was delivered under; after a revoke (and any re-assignment) it is stale.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Epoch(pub u64);

#[derive(Debug)]
struct PartitionState {
    epoch: Epoch,
    /// Delivered and not yet settled.
    outstanding: BTreeSet<i64>,
    /// Where the assignment began: everything below was settled before it.
    low: i64,
    /// One past the highest offset delivered.
    high: i64,
    /// The last offset handed out by `take_commits` (or the start).
    committed: i64,
}

/// Tracks, per partition, which offsets are settled, and answers the offset that may be
/// committed: one past the contiguous settled prefix, never beyond an unsettled offset.
///
/// Kafka commits "everything before offset N" at once, so an out-of-order ack of offset 7
/// must not commit while 5 is still running; a nack keeps 5 outstanding (redelivered
/// locally) and holds the watermark. Settlements from an older assignment are ignored.
///
/// ```
/// use idemq_core::adapter::OffsetTracker;
/// let mut t = OffsetTracker::new();
/// let p = ("orders".to_string(), 0);
/// let e = t.assign(p.clone(), 10);
/// for o in 10..13 { t.delivered(&p, e, o); }
/// t.settled(&p, e, 12);
/// t.settled(&p, e, 10);
/// assert_eq!(t.take_commits(), vec![(p.clone(), 11)]); // 11 still running: commit up to it
/// t.settled(&p, e, 11);
/// assert_eq!(t.take_commits(), vec![(p, 13)]);
/// ```
#[derive(Debug, Default)]
pub struct OffsetTracker {
    parts: HashMap<PartitionId, PartitionState>,
    next_epoch: u64,
}

impl OffsetTracker {
    /// An empty tracker.
    pub fn new() -> Self {
        Self::default()
    }

    /// The partition is (re)assigned, consuming from `start` (the committed offset): a new
    /// epoch; anything settled under an older one is ignored.
    pub fn assign(&mut self, p: PartitionId, start: i64) -> Epoch {
        self.next_epoch += 1;
        let epoch = Epoch(self.next_epoch);
        self.parts.insert(
            p,
            PartitionState {
                epoch,
                outstanding: BTreeSet::new(),
                low: start,
                high: start,
                committed: start,
            },
        );
        epoch
    }

    /// The partition was revoked: forget it. Returns its final committable offset, if it
    /// advanced past the last commit (commit it before the revoke completes).
    pub fn revoke(&mut self, p: &PartitionId) -> Option<i64> {
        let st = self.parts.remove(p)?;
        let w = watermark(&st);
        (w > st.committed).then_some(w)
    }

    /// The current epoch of a partition, if assigned.
    pub fn epoch(&self, p: &PartitionId) -> Option<Epoch> {
        self.parts.get(p).map(|s| s.epoch)
    }

    /// True while `epoch` is the partition's current assignment.
    pub fn is_current(&self, p: &PartitionId, epoch: Epoch) -> bool {
        self.epoch(p) == Some(epoch)
    }

    /// An offset was handed to the engine. Returns false (and records nothing) when the
    /// epoch is stale or the offset lies before the assignment's start.
    pub fn delivered(&mut self, p: &PartitionId, epoch: Epoch, offset: i64) -> bool {
        match self.parts.get_mut(p) {
            Some(st) if st.epoch == epoch && offset >= st.low => {
                st.outstanding.insert(offset);
                st.high = st.high.max(offset + 1);
                true
            }
            _ => false,
        }
    }

    /// An offset is settled for good (acked, dead-lettered). Returns false when stale.
    pub fn settled(&mut self, p: &PartitionId, epoch: Epoch, offset: i64) -> bool {
        match self.parts.get_mut(p) {
            Some(st) if st.epoch == epoch => st.outstanding.remove(&offset),
            _ => false,
        }
    }

    /// The offset that may be committed for a partition now.
    pub fn committable(&self, p: &PartitionId) -> Option<i64> {
        self.parts.get(p).map(watermark)
    }

    /// Partitions whose committable offset advanced since the last call, with that offset.
    pub fn take_commits(&mut self) -> Vec<(PartitionId, i64)> {
        let mut out = Vec::new();
        for (p, st) in &mut self.parts {
            let w = watermark(st);
            if w > st.committed {
                st.committed = w;
                out.push((p.clone(), w));
            }
        }
        out.sort();
        out
    }

    /// A commit handed out by `take_commits` failed: offer it again next time.
    pub fn commit_failed(&mut self, p: &PartitionId, offset: i64) {
        if let Some(st) = self.parts.get_mut(p) {
            if st.committed >= offset {
                st.committed = offset - 1;
            }
        }
    }

    /// Offsets delivered and not yet settled, across partitions.
    pub fn outstanding(&self) -> usize {
        self.parts.values().map(|s| s.outstanding.len()).sum()
    }

    /// Assigned partitions.
    pub fn partitions(&self) -> impl Iterator<Item = &PartitionId> {
        self.parts.keys()
    }
}

fn watermark(st: &PartitionState) -> i64 {
    st.outstanding.first().copied().unwrap_or(st.high)
}

/// Why stored offsets could not be read.
#[derive(Debug, Clone, thiserror::Error)]
#[error("loading stored offsets failed: {0}")]
pub struct OffsetStoreError(pub String);

/// Where a source's consumed offsets really live when the broker's own commits are only a
/// copy: a database table written in the same transaction as the effects, for instance
/// (`idemq_sql::SourceOffsets::for_group`, which the SQL store's `LogToDatabase` flow uses).
///
/// For a source whose client asks, on every assignment of partitions (or queues), where to
/// start each one: the source calls [`OffsetStore::positions`] there, before it consumes
/// from them, and starts each partition at the offset returned for it. A partition without
/// a stored offset starts where the broker's own commit (or its reset policy) says. When the
/// call fails, the source goes on from the broker's commits; a source that commits only the
/// offsets whose handler returned (as [`OffsetTracker`] hands them out) never has them pass
/// what the store holds, so records may be read again and the dedup record absorbs them,
/// nothing is skipped.
///
/// The call blocks the client's thread that asked (Kafka's rebalance callback runs on the
/// polling thread): keep it short (one query).
///
/// ```
/// use idemq_core::adapter::{OffsetStore, OffsetStoreError, PartitionId};
/// use std::collections::HashMap;
///
/// /// Every partition of `orders` starts at offset 100; the others where the broker says.
/// #[derive(Debug)]
/// struct Fixed;
///
/// impl OffsetStore for Fixed {
///     fn positions(&self, parts: &[PartitionId]) -> Result<HashMap<PartitionId, i64>, OffsetStoreError> {
///         Ok(parts.iter().filter(|p| p.0 == "orders").map(|p| (p.clone(), 100)).collect())
///     }
/// }
///
/// let store: Box<dyn OffsetStore> = Box::new(Fixed);
/// let asked = [("orders".to_string(), 0), ("refunds".to_string(), 0)];
/// let found = store.positions(&asked)?;
/// assert_eq!(found.get(&("orders".to_string(), 0)), Some(&100));
/// assert_eq!(found.get(&("refunds".to_string(), 0)), None);
/// # Ok::<(), OffsetStoreError>(())
/// ```
pub trait OffsetStore: fmt::Debug + Send + Sync + 'static {
    /// The next offset to consume of each of `partitions` that has one stored.
    fn positions(
        &self,
        partitions: &[PartitionId],
    ) -> Result<HashMap<PartitionId, i64>, OffsetStoreError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p() -> PartitionId {
        ("t".into(), 3)
    }

    #[test]
    fn settlements_of_a_revoked_assignment_do_nothing() {
        let mut t = OffsetTracker::new();
        let old = t.assign(p(), 0);
        assert!(t.delivered(&p(), old, 0));
        assert_eq!(t.revoke(&p()), None);
        let new = t.assign(p(), 0);
        assert!(!t.settled(&p(), old, 0), "stale settle must be ignored");
        assert!(t.delivered(&p(), new, 0));
        assert_eq!(t.take_commits(), vec![]);
        assert!(t.settled(&p(), new, 0));
        assert_eq!(t.take_commits(), vec![(p(), 1)]);
    }

    #[test]
    fn a_held_offset_holds_the_watermark_and_a_failed_commit_is_offered_again() {
        let mut t = OffsetTracker::new();
        let e = t.assign(p(), 100);
        for o in 100..105 {
            t.delivered(&p(), e, o);
        }
        for o in [101, 102, 103, 104] {
            t.settled(&p(), e, o);
        }
        assert_eq!(t.committable(&p()), Some(100));
        assert!(t.take_commits().is_empty());
        t.settled(&p(), e, 100);
        assert_eq!(t.take_commits(), vec![(p(), 105)]);
        t.commit_failed(&p(), 105);
        assert_eq!(t.take_commits(), vec![(p(), 105)]);
        assert_eq!(t.revoke(&p()), None);
    }

    #[test]
    fn revoke_reports_an_uncommitted_watermark() {
        let mut t = OffsetTracker::new();
        let e = t.assign(p(), 0);
        t.delivered(&p(), e, 0);
        t.settled(&p(), e, 0);
        assert_eq!(t.revoke(&p()), Some(1));
    }
}
