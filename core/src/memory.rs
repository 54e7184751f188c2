//! The in-memory dedup store: the embedded default for tests and the demo.
//!
//! It obeys the full contract (the test kit runs on it) but keeps nothing across restarts,
//! so it only deduplicates within one process. [`MemoryStore::set_available`] simulates an
//! outage, so engines can be tested for "store down means no ack".

use crate::key::DedupKey;
use crate::store::{
    acquired_record, check_distinct_keys, duration_ms, evaluate_claim_request, now_ms,
    ClaimOutcome, ClaimRequest, ClaimVerdict, CompleteOutcome, Completion, DedupRecord, DedupStore,
    ExtendOutcome, FencingToken, RecordStatus, ReleaseOutcome, RollbackOutcome, StoreError,
    StoreStats,
};
use async_trait::async_trait;
use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

/// The records: a slab in claim order, and an index from key to slot (hashed with a
/// per-process seeded fast hasher).
///
/// Why not one `HashMap<DedupKey, DedupRecord>`: a record is ~160 bytes, and a growing map
/// moves every one of them on each resize, into freshly mapped pages; that was about a
/// quarter of the engine's time over this store. The index moves 24-byte entries; the slab
/// grows by `realloc` (a page remap for large blocks, not a copy) and keeps a batch's records
/// next to each other, in the order their completions arrive.
#[derive(Debug, Default)]
struct Records {
    index: HashMap<DedupKey, usize, foldhash::fast::RandomState>,
    slab: Vec<DedupRecord>,
}

impl Records {
    fn len(&self) -> usize {
        self.slab.len()
    }

    fn get(&self, key: &DedupKey) -> Option<&DedupRecord> {
        self.index.get(key).and_then(|&i| self.slab.get(i))
    }

    fn get_mut(&mut self, key: &DedupKey) -> Option<&mut DedupRecord> {
        let i = *self.index.get(key)?;
        self.slab.get_mut(i)
    }

    fn remove(&mut self, key: &DedupKey) -> Option<DedupRecord> {
        let i = self.index.remove(key)?;
        if i >= self.slab.len() {
            return None;
        }
        let removed = self.slab.swap_remove(i);
        // The last record moved into the hole: point its key at its new slot.
        if let Some(moved) = self.slab.get(i) {
            if let Some(slot) = self.index.get_mut(&moved.key) {
                *slot = i;
            }
        }
        Some(removed)
    }

    fn values(&self) -> std::slice::Iter<'_, DedupRecord> {
        self.slab.iter()
    }
}

/// An in-process [`DedupStore`].
///
/// ```
/// # tokio_test_block(async {
/// use idemq_core::{MemoryStore, DedupStore, ClaimRequest, ClaimOutcome, ConsumerGroup, DedupKey};
/// use std::time::Duration;
/// let store = MemoryStore::new();
/// let key = DedupKey::new(&ConsumerGroup::new("g").unwrap(), "order-1").unwrap();
/// let req = ClaimRequest::new(key.clone(), Duration::from_secs(30));
/// let ClaimOutcome::Acquired(lease) = store.claim(&req).await.unwrap() else { panic!() };
/// store.complete(&key, lease.token, None, Duration::from_secs(3600)).await.unwrap();
/// assert!(matches!(store.claim(&req).await.unwrap(), ClaimOutcome::Duplicate(_)));
/// # });
/// # fn tokio_test_block(f: impl std::future::Future<Output = ()>) {
/// #     tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(f)
/// # }
/// ```
#[derive(Debug, Default)]
pub struct MemoryStore {
    records: Mutex<Records>,
    unavailable: AtomicBool,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Simulates an outage: while `false`, every call fails with [`StoreError::Unavailable`].
    pub fn set_available(&self, available: bool) {
        self.unavailable.store(!available, Ordering::SeqCst);
    }

    /// Number of records held.
    pub fn len(&self) -> usize {
        self.lock().map(|m| m.len()).unwrap_or(0)
    }

    /// True when no record is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> Result<MutexGuard<'_, Records>, StoreError> {
        if self.unavailable.load(Ordering::SeqCst) {
            return Err(StoreError::Unavailable(
                "memory store switched off (simulated outage)".into(),
            ));
        }
        self.records
            .lock()
            .map_err(|_| StoreError::Backend("memory store lock poisoned".into()))
    }

    /// Releases `key` if `token` holds it; `unrun` takes back the attempt its claim counted.
    fn give_back(
        &self,
        key: &DedupKey,
        token: FencingToken,
        unrun: bool,
    ) -> Result<ReleaseOutcome, StoreError> {
        let mut map = self.lock()?;
        match map.get_mut(key) {
            Some(r) if r.is_held_by(token) => {
                r.lease_until_ms = 0;
                if unrun {
                    r.attempts = r.attempts.saturating_sub(1);
                }
                Ok(ReleaseOutcome::Released)
            }
            _ => Ok(ReleaseOutcome::Fenced),
        }
    }
}

#[async_trait]
impl DedupStore for MemoryStore {
    async fn claim_batch(&self, reqs: &[ClaimRequest]) -> Result<Vec<ClaimOutcome>, StoreError> {
        check_distinct_keys(reqs)?;
        let mut map = self.lock()?;
        let now = now_ms();
        let mut out = Vec::with_capacity(reqs.len());
        for req in reqs {
            // One probe per key (the entry), not a lookup and then an insert: the index is
            // large and cold, and the probe is most of a claim's cost here.
            let Records { index, slab } = &mut *map;
            let slot = index.entry(req.key.clone());
            let at = match &slot {
                Entry::Occupied(o) => Some(*o.get()),
                Entry::Vacant(_) => None,
            };
            let existing = at.and_then(|i| slab.get(i));
            let verdict = evaluate_claim_request(existing, req, now);
            let taken_over = match (&verdict, existing) {
                (ClaimVerdict::Answer(o), _) => {
                    out.push(o.clone());
                    continue;
                }
                (ClaimVerdict::TakeOver, r) => r,
                _ => None,
            };
            let token = req.token.unwrap_or_else(FencingToken::random);
            let (lease, record) = acquired_record(req, taken_over, token, now);
            match (slot, at.and_then(|i| slab.get_mut(i))) {
                (Entry::Occupied(_), Some(r)) => *r = record,
                (Entry::Occupied(mut o), None) => {
                    // Unreachable while index and slab agree; heal rather than lose it.
                    o.insert(slab.len());
                    slab.push(record);
                }
                (Entry::Vacant(v), _) => {
                    v.insert(slab.len());
                    slab.push(record);
                }
            }
            out.push(ClaimOutcome::Acquired(lease));
        }
        Ok(out)
    }

    async fn complete_batch(
        &self,
        items: &[Completion],
    ) -> Result<Vec<CompleteOutcome>, StoreError> {
        let mut map = self.lock()?;
        let now = now_ms();
        Ok(items
            .iter()
            .map(|c| match map.get_mut(&c.key) {
                Some(r) if r.is_held_by(c.token) => {
                    r.status = RecordStatus::Completed;
                    r.result = c.result.clone();
                    r.completed_ms = Some(now);
                    r.expires_ms = Some(now.saturating_add(duration_ms(c.retention)));
                    CompleteOutcome::Completed
                }
                Some(r) if r.token == c.token && r.status == RecordStatus::Completed => {
                    CompleteOutcome::AlreadyCompleted
                }
                _ => CompleteOutcome::Fenced,
            })
            .collect())
    }

    async fn release(
        &self,
        key: &DedupKey,
        token: FencingToken,
    ) -> Result<ReleaseOutcome, StoreError> {
        self.give_back(key, token, false)
    }

    async fn release_unrun(
        &self,
        key: &DedupKey,
        token: FencingToken,
    ) -> Result<ReleaseOutcome, StoreError> {
        self.give_back(key, token, true)
    }

    async fn roll_back(
        &self,
        key: &DedupKey,
        token: FencingToken,
        retention: Duration,
    ) -> Result<RollbackOutcome, StoreError> {
        let mut map = self.lock()?;
        let now = now_ms();
        match map.get_mut(key) {
            Some(r) if r.is_held_by(token) => {
                r.status = RecordStatus::RolledBack;
                r.result = None;
                r.completed_ms = Some(now);
                r.expires_ms = Some(now.saturating_add(duration_ms(retention)));
                Ok(RollbackOutcome::RolledBack)
            }
            Some(r) if r.token == token && r.status == RecordStatus::RolledBack => {
                Ok(RollbackOutcome::RolledBack)
            }
            _ => Ok(RollbackOutcome::Fenced),
        }
    }

    async fn extend(
        &self,
        key: &DedupKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<ExtendOutcome, StoreError> {
        let mut map = self.lock()?;
        let now = now_ms();
        match map.get_mut(key) {
            Some(r) if r.is_held_by(token) => {
                r.lease_until_ms = now.saturating_add(duration_ms(lease));
                Ok(ExtendOutcome::Extended {
                    until_ms: r.lease_until_ms,
                })
            }
            _ => Ok(ExtendOutcome::Fenced),
        }
    }

    async fn get(&self, key: &DedupKey) -> Result<Option<DedupRecord>, StoreError> {
        Ok(self.lock()?.get(key).cloned())
    }

    async fn purge_expired(&self, limit: usize) -> Result<u64, StoreError> {
        let mut map = self.lock()?;
        let now = now_ms();
        let doomed: Vec<DedupKey> = map
            .values()
            .filter(|r| r.is_retention_expired(now))
            .take(limit)
            .map(|r| r.key.clone())
            .collect();
        for k in &doomed {
            map.remove(k);
        }
        Ok(doomed.len() as u64)
    }

    async fn list_stuck(
        &self,
        stale_for: Duration,
        limit: usize,
    ) -> Result<Vec<DedupRecord>, StoreError> {
        let map = self.lock()?;
        let cutoff = now_ms() - duration_ms(stale_for);
        let mut v: Vec<DedupRecord> = map
            .values()
            .filter(|r| r.status == RecordStatus::InProgress && r.lease_until_ms <= cutoff)
            .cloned()
            .collect();
        v.sort_by_key(|r| (r.lease_until_ms, r.key.clone()));
        v.truncate(limit);
        Ok(v)
    }

    async fn forget(&self, key: &DedupKey) -> Result<bool, StoreError> {
        Ok(self.lock()?.remove(key).is_some())
    }

    async fn stats(&self) -> Result<StoreStats, StoreError> {
        let map = self.lock()?;
        let now = now_ms();
        let mut stats = StoreStats::default();
        for r in map.values() {
            stats.count(r, now);
        }
        Ok(stats)
    }
}
