//! The cache of completed keys: moka decides what stays (capacity, LRU, per-entry expiry),
//! a read-optimised index answers hits.
//!
//! moka's own read path does bookkeeping on every `get` (read log, access order, expiry
//! wheel), about 1 µs per hit on a busy 2-core machine; a duplicate check must cost one hash
//! lookup. So hits are served from a sharded `RwLock<HashMap>` mirror of moka's contents,
//! kept in step by moka's eviction listener, with the expiry deadline checked on every
//! hit (so an entry is never served past its deadline, whenever moka gets to evicting it).
//! One hit in [`TOUCH_EVERY`] (per thread) is also read through moka, so its recency order
//! follows the traffic.

use idemq_core::{DedupKey, DedupRecord};
use moka::notification::RemovalCause;
use moka::policy::EvictionPolicy;
use moka::sync::Cache;
use std::cell::Cell;
use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

/// One read in this many goes through moka to refresh its recency order (a power of two).
pub(crate) const TOUCH_EVERY: u32 = 32;

const SHARDS: usize = 32;

/// A completed record and when it stops being served.
#[derive(Debug)]
pub(crate) struct Cached {
    pub(crate) record: DedupRecord,
    pub(crate) deadline: Instant,
    ttl: Duration,
}

/// The map key is already a keyed SipHash of the dedup key: pass it through.
#[derive(Default)]
struct PreHashed(u64);

impl Hasher for PreHashed {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is used; fold anything else in, for completeness.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type Shard = RwLock<HashMap<u64, Arc<Cached>, BuildHasherDefault<PreHashed>>>;

struct Index {
    shards: Box<[Shard]>,
    hasher: std::hash::RandomState,
}

impl Index {
    fn new() -> Self {
        Self {
            shards: (0..SHARDS)
                .map(|_| RwLock::new(HashMap::default()))
                .collect(),
            hasher: std::hash::RandomState::new(),
        }
    }

    #[inline]
    fn slot(&self, key: &DedupKey) -> (&Shard, u64) {
        let h = self.hasher.hash_one(key.as_str());
        (&self.shards[(h >> 59) as usize % SHARDS], h)
    }

    /// Removes `key`'s entry, or only `only` if given (not a newer value).
    fn remove(&self, key: &DedupKey, only: Option<&Arc<Cached>>) {
        let (shard, h) = self.slot(key);
        if let Ok(mut m) = shard.write() {
            let doomed = m.get(&h).is_some_and(|cur| {
                cur.record.key == *key
                    && match only {
                        None => true,
                        Some(o) => Arc::ptr_eq(o, cur),
                    }
            });
            if doomed {
                m.remove(&h);
            }
        }
    }

    fn clear(&self) {
        for s in self.shards.iter() {
            if let Ok(mut m) = s.write() {
                m.clear();
            }
        }
    }
}

thread_local! {
    static READS: Cell<u32> = const { Cell::new(0) };
}

/// The cache of completed records.
pub(crate) struct CompletedCache {
    index: Arc<Index>,
    policy: Cache<DedupKey, Arc<Cached>>,
    max_ttl: Duration,
}

struct CachedExpiry;

impl moka::Expiry<DedupKey, Arc<Cached>> for CachedExpiry {
    fn expire_after_create(
        &self,
        _key: &DedupKey,
        value: &Arc<Cached>,
        _created_at: Instant,
    ) -> Option<Duration> {
        Some(value.ttl)
    }

    fn expire_after_update(
        &self,
        _key: &DedupKey,
        value: &Arc<Cached>,
        _updated_at: Instant,
        _duration_until_expiry: Option<Duration>,
    ) -> Option<Duration> {
        Some(value.ttl)
    }
}

impl CompletedCache {
    pub(crate) fn new(capacity: u64, max_ttl: Duration) -> Self {
        let index = Arc::new(Index::new());
        let listener_index = index.clone();
        let policy = Cache::builder()
            .max_capacity(capacity)
            .eviction_policy(EvictionPolicy::lru())
            .expire_after(CachedExpiry)
            .eviction_listener(move |k: Arc<DedupKey>, v: Arc<Cached>, cause| {
                if cause != RemovalCause::Replaced {
                    listener_index.remove(&k, Some(&v));
                }
            })
            .build();
        Self {
            index,
            policy,
            max_ttl,
        }
    }

    /// Applies `f` to the live cached record of `key`, if any.
    #[inline]
    pub(crate) fn with<R>(&self, key: &DedupKey, f: impl FnOnce(&DedupRecord) -> R) -> Option<R> {
        let (shard, h) = self.index.slot(key);
        let out = {
            let m = shard.read().ok()?;
            let c = m.get(&h)?;
            if c.record.key != *key || Instant::now() >= c.deadline {
                return None;
            }
            f(&c.record)
        };
        let n = READS.with(|r| {
            let n = r.get().wrapping_add(1);
            r.set(n);
            n
        });
        if n & (TOUCH_EVERY - 1) == 0 {
            self.policy.get(key);
        }
        Some(out)
    }

    /// Caches a completed record for `min(time left, max_ttl)`.
    #[cfg(test)]
    pub(crate) fn insert(&self, record: DedupRecord, left: Duration) {
        self.insert_if(record, left, || true);
    }

    /// Caches a completed record for `min(time left, max_ttl)` if `still_valid()` says so,
    /// checked under the lock of the key's index shard: an [`CompletedCache::invalidate`]
    /// (which takes the same lock) that follows a change `still_valid` would see is
    /// ordered either before the check (which then fails) or after the insert (which it
    /// then undoes). Hits are served from the index only, so a policy entry left behind by
    /// that race is never answered. Returns whether the record was cached.
    pub(crate) fn insert_if(
        &self,
        record: DedupRecord,
        left: Duration,
        still_valid: impl FnOnce() -> bool,
    ) -> bool {
        let ttl = left.min(self.max_ttl);
        let Some(deadline) = Instant::now().checked_add(ttl) else {
            return false;
        };
        let key = record.key.clone();
        let v = Arc::new(Cached {
            record,
            deadline,
            ttl,
        });
        {
            let (shard, h) = self.index.slot(&key);
            let Ok(mut m) = shard.write() else {
                return false;
            };
            if !still_valid() {
                return false;
            }
            #[cfg(test)]
            test_hook::before_insert();
            m.insert(h, v.clone());
        }
        // Outside the shard lock: moka may call the eviction listener, which takes it.
        self.policy.insert(key, v);
        true
    }

    /// Drops `key`'s entry (waits for an [`CompletedCache::insert_if`] of it in progress).
    pub(crate) fn invalidate(&self, key: &DedupKey) {
        self.policy.invalidate(key);
        self.index.remove(key, None);
    }

    pub(crate) fn clear(&self) {
        self.policy.invalidate_all();
        self.index.clear();
    }

    pub(crate) fn entry_count(&self) -> u64 {
        self.policy.entry_count()
    }
}

/// A hook run inside [`CompletedCache::insert_if`] between its check and its insert (tests
/// of the forget race).
#[cfg(test)]
pub(crate) mod test_hook {
    use std::cell::RefCell;

    type Hook = Box<dyn FnOnce()>;

    thread_local! {
        static BEFORE_INSERT: RefCell<Option<Hook>> = const { RefCell::new(None) };
    }

    /// Runs `f` at the next insert on this thread.
    pub(crate) fn set_before_insert(f: impl FnOnce() + 'static) {
        BEFORE_INSERT.with(|h| *h.borrow_mut() = Some(Box::new(f)));
    }

    pub(super) fn before_insert() {
        if let Some(f) = BEFORE_INSERT.with(|h| h.borrow_mut().take()) {
            f();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use idemq_core::{ConsumerGroup, FencingToken, RecordStatus};

    fn rec(k: &str) -> DedupRecord {
        DedupRecord {
            key: DedupKey::new(&ConsumerGroup::new("g").unwrap(), k).unwrap(),
            status: RecordStatus::Completed,
            token: FencingToken(1),
            lease_until_ms: 0,
            attempts: 1,
            payload_hash: None,
            result: None,
            first_seen_ms: 0,
            completed_ms: Some(0),
            expires_ms: Some(i64::MAX),
            worker: None,
        }
    }

    #[test]
    fn hits_misses_expiry_and_eviction() {
        let c = CompletedCache::new(100, Duration::from_secs(60));
        let a = rec("a");
        c.insert(a.clone(), Duration::from_secs(60));
        assert_eq!(c.with(&a.key, |r| r.token), Some(FencingToken(1)));
        assert!(c.with(&rec("b").key, |_| ()).is_none());
        c.insert(rec("short"), Duration::from_millis(30));
        std::thread::sleep(Duration::from_millis(60));
        assert!(
            c.with(&rec("short").key, |_| ()).is_none(),
            "served past its deadline"
        );
        c.invalidate(&a.key);
        assert!(c.with(&a.key, |_| ()).is_none());
        // Capacity: moka evicts, the listener drops the mirror entries.
        for i in 0..1000 {
            c.insert(rec(&format!("k{i}")), Duration::from_secs(60));
        }
        c.policy.run_pending_tasks();
        let live = (0..1000)
            .filter(|i| c.with(&rec(&format!("k{i}")).key, |_| ()).is_some())
            .count();
        assert!(
            live <= 100 + 16,
            "mirror follows moka's capacity: {live} live"
        );
        assert!(live >= 50, "recent entries stay: {live}");
    }
}
