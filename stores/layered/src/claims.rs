//! The claims a [`LayeredStore`](crate::LayeredStore) handed out and has not settled yet:
//! where each was made (primary or fallback) and what its completion needs to be cached.
//!
//! A bounded map in shards under plain mutexes: one insert per acquired claim, one lookup
//! and one removal per completion. Nothing here is needed for correctness: a claim missing
//! from the book is routed to the primary (and retried on the fallback if the primary
//! does not know its token), and its completion is simply not cached. So when a shard is
//! full, claims older than [`MAX_AGE_MS`] go first, then arbitrary ones.

use idemq_core::{DedupKey, FencingToken, PayloadHash};
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::{Arc, Mutex, MutexGuard};

/// A claim is forgotten this long after it was made (a day: far past any lease).
pub(crate) const MAX_AGE_MS: i64 = 24 * 3600 * 1000;
const SHARDS: usize = 64;

/// What this store remembers about a claim it handed out.
#[derive(Debug, Clone)]
pub(crate) struct ClaimInfo {
    pub(crate) token: FencingToken,
    pub(crate) on_fallback: bool,
    pub(crate) attempt: u32,
    pub(crate) lease_until_ms: i64,
    /// When the claim was made (this process's wall clock).
    pub(crate) first_seen_ms: i64,
    pub(crate) payload_hash: Option<PayloadHash>,
    pub(crate) worker: Option<Arc<str>>,
}

type Shard = HashMap<DedupKey, ClaimInfo, foldhash::fast::RandomState>;

/// The claims in flight, at most about `capacity` of them.
pub(crate) struct ClaimBook {
    shards: Box<[Mutex<Shard>]>,
    hasher: foldhash::fast::RandomState,
    per_shard: usize,
}

impl ClaimBook {
    pub(crate) fn new(capacity: u64) -> Self {
        let per_shard = usize::try_from(capacity.div_ceil(SHARDS as u64))
            .unwrap_or(usize::MAX)
            .max(16);
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            hasher: foldhash::fast::RandomState::default(),
            per_shard,
        }
    }

    fn shard(&self, key: &DedupKey) -> MutexGuard<'_, Shard> {
        let h = self.hasher.hash_one(key);
        // A panic elsewhere while holding the lock leaves a usable map: every operation
        // here is a single insert, lookup or removal.
        self.shards[(h >> 58) as usize % SHARDS]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn insert(&self, key: DedupKey, info: ClaimInfo) {
        let now = info.first_seen_ms;
        let mut m = self.shard(&key);
        if m.len() >= self.per_shard && !m.contains_key(&key) {
            make_room(&mut m, self.per_shard, now);
        }
        m.insert(key, info);
    }

    /// The claim of `key`, unless it is older than [`MAX_AGE_MS`].
    pub(crate) fn get(&self, key: &DedupKey) -> Option<ClaimInfo> {
        let now = idemq_core::now_ms();
        self.shard(key)
            .get(key)
            .filter(|i| now.saturating_sub(i.first_seen_ms) < MAX_AGE_MS)
            .cloned()
    }

    pub(crate) fn remove(&self, key: &DedupKey) {
        self.shard(key).remove(key);
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(|e| e.into_inner()).len())
            .sum()
    }
}

/// Makes room in a full shard: drops claims past their age, then arbitrary ones down to
/// three quarters of the shard (so the next quarter of inserts costs nothing).
fn make_room(m: &mut Shard, cap: usize, now: i64) {
    m.retain(|_, i| now.saturating_sub(i.first_seen_ms) < MAX_AGE_MS);
    if m.len() >= cap {
        let excess = m.len() - cap * 3 / 4;
        let doomed: Vec<DedupKey> = m.keys().take(excess).cloned().collect();
        for k in &doomed {
            m.remove(k);
        }
        tracing::debug!(
            dropped = doomed.len(),
            "layered store: more claims in flight than its capacity; some are forgotten (their completions go uncached)"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use idemq_core::ConsumerGroup;

    fn key(i: usize) -> DedupKey {
        DedupKey::new(&ConsumerGroup::new("g").expect("group"), &format!("k{i}")).expect("key")
    }

    fn info(token: i64, first_seen_ms: i64) -> ClaimInfo {
        ClaimInfo {
            token: FencingToken(token),
            on_fallback: false,
            attempt: 1,
            lease_until_ms: first_seen_ms + 30_000,
            first_seen_ms,
            payload_hash: None,
            worker: None,
        }
    }

    #[test]
    fn claims_are_kept_until_removed_or_too_old() {
        let b = ClaimBook::new(1000);
        let now = idemq_core::now_ms();
        b.insert(key(1), info(1, now));
        b.insert(key(2), info(2, now - MAX_AGE_MS - 1));
        assert_eq!(b.get(&key(1)).map(|i| i.token), Some(FencingToken(1)));
        assert!(b.get(&key(2)).is_none(), "older than a day");
        b.insert(key(1), info(3, now));
        assert_eq!(b.get(&key(1)).map(|i| i.token), Some(FencingToken(3)));
        b.remove(&key(1));
        assert!(b.get(&key(1)).is_none());
    }

    #[test]
    fn the_book_stays_bounded() {
        let b = ClaimBook::new(1000);
        let now = idemq_core::now_ms();
        for i in 0..50_000 {
            b.insert(key(i), info(i as i64 + 1, now));
        }
        let n = b.len();
        assert!(n <= SHARDS * b.per_shard, "{n} claims kept");
        assert!(n >= 500, "{n} claims kept");
        // The latest claim is always there.
        assert_eq!(
            b.get(&key(49_999)).map(|i| i.token),
            Some(FencingToken(50_000))
        );
    }
}
