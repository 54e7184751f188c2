//! A local delayed-redelivery buffer.

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;
use tokio::time::Instant;

/// Nacked messages waiting for their delay, released in due order; within one lane
/// (partition, ordering key) never out of the order they were pushed in.
///
/// `T` is whatever the adapter redelivers (a raw record, a delivery); `L` names a lane.
///
/// ```
/// use idemq_core::adapter::DelayedRedelivery;
/// use tokio::time::{Duration, Instant};
/// let mut buf: DelayedRedelivery<&str, u32> = DelayedRedelivery::new();
/// let now = Instant::now();
/// buf.push(0, "late", now + Duration::from_secs(5));
/// buf.push(1, "early", now);
/// assert_eq!(buf.pop_due(now, 10), vec!["early"]);
/// assert!(buf.holds(&0));
/// ```
#[derive(Debug)]
pub struct DelayedRedelivery<T, L: Eq + Hash + Clone> {
    // (due, seq) → (lane, item). seq breaks ties in push order.
    queue: BTreeMap<(Instant, u64), (L, T)>,
    // Per lane: the due time of its latest pushed item, so a later push of the lane is never
    // due before an earlier one (the lane's order survives unequal delays).
    lanes: HashMap<L, (Instant, usize)>,
    seq: u64,
}

impl<T, L: Eq + Hash + Clone> Default for DelayedRedelivery<T, L> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T, L: Eq + Hash + Clone> DelayedRedelivery<T, L> {
    /// An empty buffer.
    pub fn new() -> Self {
        Self {
            queue: BTreeMap::new(),
            lanes: HashMap::new(),
            seq: 0,
        }
    }

    /// Holds `item` of `lane` until `due` (or until the lane's earlier items are due, if
    /// later).
    pub fn push(&mut self, lane: L, item: T, due: Instant) {
        let entry = self.lanes.entry(lane.clone()).or_insert((due, 0));
        let due = due.max(entry.0);
        *entry = (due, entry.1 + 1);
        self.seq += 1;
        self.queue.insert((due, self.seq), (lane, item));
    }

    /// Takes up to `max` items due at `now`, in due order.
    pub fn pop_due(&mut self, now: Instant, max: usize) -> Vec<T> {
        let mut out = Vec::new();
        while out.len() < max {
            let Some(entry) = self.queue.first_entry() else {
                break;
            };
            if entry.key().0 > now {
                break;
            }
            let (lane, item) = entry.remove();
            self.forget_one(&lane);
            out.push(item);
        }
        out
    }

    fn forget_one(&mut self, lane: &L) {
        if let Some(e) = self.lanes.get_mut(lane) {
            e.1 -= 1;
            if e.1 == 0 {
                self.lanes.remove(lane);
            }
        }
    }

    /// When the next item is due.
    pub fn next_due(&self) -> Option<Instant> {
        self.queue.keys().next().map(|(t, _)| *t)
    }

    /// True while `lane` has an item waiting: an ordered source holds the lane's newer
    /// messages back until then.
    pub fn holds(&self, lane: &L) -> bool {
        self.lanes.contains_key(lane)
    }

    /// Drops every item of the lanes `drop_lane` selects (a revoked partition) and returns
    /// them.
    pub fn drain_lanes(&mut self, mut drop_lane: impl FnMut(&L) -> bool) -> Vec<T> {
        let keys: Vec<(Instant, u64)> = self
            .queue
            .iter()
            .filter(|(_, (l, _))| drop_lane(l))
            .map(|(k, _)| *k)
            .collect();
        let mut out = Vec::with_capacity(keys.len());
        for k in keys {
            if let Some((lane, item)) = self.queue.remove(&k) {
                self.forget_one(&lane);
                out.push(item);
            }
        }
        out
    }

    /// Items waiting.
    pub fn len(&self) -> usize {
        self.queue.len()
    }

    /// True when nothing waits.
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_lane_keeps_its_order_when_a_later_item_has_a_shorter_delay() {
        let mut b: DelayedRedelivery<u32, &str> = DelayedRedelivery::new();
        let t0 = Instant::now();
        b.push("k", 1, t0 + Duration::from_secs(10));
        b.push("k", 2, t0 + Duration::from_secs(1));
        b.push("other", 3, t0 + Duration::from_secs(1));
        assert_eq!(b.pop_due(t0 + Duration::from_secs(2), 10), vec![3]);
        assert!(b.holds(&"k"));
        assert_eq!(b.pop_due(t0 + Duration::from_secs(10), 10), vec![1, 2]);
        assert!(!b.holds(&"k"));
        assert!(b.is_empty());
    }

    #[test]
    fn draining_a_lane_releases_it() {
        let mut b: DelayedRedelivery<u32, i32> = DelayedRedelivery::new();
        let t0 = Instant::now();
        b.push(0, 1, t0);
        b.push(1, 2, t0);
        assert_eq!(b.drain_lanes(|l| *l == 0), vec![1]);
        assert!(!b.holds(&0));
        assert_eq!(b.len(), 1);
    }
}
