//! A dedup store behind a switch, for tests of what an adapter or the engine does while the
//! store is down.

use crate::store::{
    ClaimOutcome, ClaimRequest, CompleteOutcome, Completion, DedupRecord, DedupStore,
    ExtendOutcome, FencingToken, ReleaseOutcome, RollbackOutcome, StoreError,
};
use crate::DedupKey;
use async_trait::async_trait;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// `inner` behind a switch: while it is down, every call answers `StoreError::Unavailable`,
/// as an outage of the real server would; switched up, every call goes to `inner`.
///
/// ```
/// use idemq_core::testkit::switchable::SwitchableStore;
/// use idemq_core::MemoryStore;
/// use std::sync::Arc;
///
/// let store = SwitchableStore::new(Arc::new(MemoryStore::new()));
/// store.set_down(true); // the outage starts
/// store.set_down(false); // and ends
/// ```
pub struct SwitchableStore {
    inner: Arc<dyn DedupStore>,
    down: AtomicBool,
}

impl SwitchableStore {
    /// `inner`, switched up.
    pub fn new(inner: Arc<dyn DedupStore>) -> Self {
        Self {
            inner,
            down: AtomicBool::new(false),
        }
    }

    /// Starts (`true`) or ends (`false`) the outage.
    pub fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
    }

    fn check(&self) -> Result<(), StoreError> {
        if self.down.load(Ordering::SeqCst) {
            Err(StoreError::Unavailable("test: the store is down".into()))
        } else {
            Ok(())
        }
    }
}

#[async_trait]
impl DedupStore for SwitchableStore {
    fn claim_mode(&self) -> crate::store::ClaimMode {
        self.inner.claim_mode()
    }
    async fn claim_batch(&self, reqs: &[ClaimRequest]) -> Result<Vec<ClaimOutcome>, StoreError> {
        self.check()?;
        self.inner.claim_batch(reqs).await
    }
    async fn complete_batch(
        &self,
        items: &[Completion],
    ) -> Result<Vec<CompleteOutcome>, StoreError> {
        self.check()?;
        self.inner.complete_batch(items).await
    }
    async fn release(
        &self,
        key: &DedupKey,
        token: FencingToken,
    ) -> Result<ReleaseOutcome, StoreError> {
        self.check()?;
        self.inner.release(key, token).await
    }
    async fn roll_back(
        &self,
        key: &DedupKey,
        token: FencingToken,
        retention: Duration,
    ) -> Result<RollbackOutcome, StoreError> {
        self.check()?;
        self.inner.roll_back(key, token, retention).await
    }
    async fn release_unrun(
        &self,
        key: &DedupKey,
        token: FencingToken,
    ) -> Result<ReleaseOutcome, StoreError> {
        self.check()?;
        self.inner.release_unrun(key, token).await
    }
    async fn extend(
        &self,
        key: &DedupKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<ExtendOutcome, StoreError> {
        self.check()?;
        self.inner.extend(key, token, lease).await
    }
    async fn extend_batch(
        &self,
        leases: &[(DedupKey, FencingToken)],
        lease: Duration,
    ) -> Result<Vec<ExtendOutcome>, StoreError> {
        self.check()?;
        self.inner.extend_batch(leases, lease).await
    }
    async fn get(&self, key: &DedupKey) -> Result<Option<DedupRecord>, StoreError> {
        self.check()?;
        self.inner.get(key).await
    }
    async fn purge_expired(&self, limit: usize) -> Result<u64, StoreError> {
        self.check()?;
        self.inner.purge_expired(limit).await
    }
    async fn list_stuck(
        &self,
        stale_for: Duration,
        limit: usize,
    ) -> Result<Vec<DedupRecord>, StoreError> {
        self.check()?;
        self.inner.list_stuck(stale_for, limit).await
    }
    async fn forget(&self, key: &DedupKey) -> Result<bool, StoreError> {
        self.check()?;
        self.inner.forget(key).await
    }
}
