//! LayeredStore over the in-memory store: the contract kit, and what each layer may answer.

use async_trait::async_trait;
use idemq_core::{
    ClaimOutcome, ClaimRequest, CompleteOutcome, ConsumerGroup, DedupKey, DedupStore, FencingToken,
    MemoryStore, PayloadHash, StoreError,
};
use idemq_layered::{
    BloomSizing, FallbackGate, LayeredStore, LeaseLost, LeaseState, LeaseWatchdog, LocalBloom,
    Novelty, PreFilter,
};
use std::sync::Arc;
use std::time::Duration;

const LONG: Duration = Duration::from_secs(60);
const RETAIN: Duration = Duration::from_secs(3600);

mod kit_two_layers_over_one_memory_store {
    use super::*;
    idemq_core::store_contract_tests!(async {
        let mem: Arc<dyn DedupStore> = Arc::new(MemoryStore::new());
        let a: Arc<dyn DedupStore> = Arc::new(LayeredStore::new(mem.clone()));
        let b: Arc<dyn DedupStore> = Arc::new(LayeredStore::new(mem));
        Some(vec![a.clone(), b.clone(), a, b])
    });
}

/// Over SQLite: two layers (each its own cache) on one SQLite store.
mod kit_two_layers_over_sqlite {
    use super::*;
    idemq_core::store_contract_tests!(async {
        let sqlite = idemq_sql::SqliteStore::connect("sqlite::memory:", Default::default())
            .await
            .expect("in-memory SQLite");
        let sqlite: Arc<dyn DedupStore> = Arc::new(sqlite);
        let a: Arc<dyn DedupStore> = Arc::new(LayeredStore::new(sqlite.clone()));
        let b: Arc<dyn DedupStore> = Arc::new(LayeredStore::new(sqlite));
        Some(vec![a.clone(), b.clone(), a, b])
    });
}

mod kit_one_layer_with_filter_and_fallback {
    use super::*;
    idemq_core::store_contract_tests!(async {
        let mem: Arc<dyn DedupStore> = Arc::new(MemoryStore::new());
        let s = LayeredStore::builder(mem)
            .prefilter(Arc::new(LocalBloom::new(100_000, 0.01)))
            .fallback(Arc::new(MemoryStore::new()), FallbackGate::NeverSeenKeys)
            .reconcile_after_outage(true)
            .build()
            .expect("valid config");
        let s: Arc<dyn DedupStore> = Arc::new(s);
        Some(vec![s.clone(), s])
    });
}

fn group() -> ConsumerGroup {
    ConsumerGroup::new(&format!("g-{:x}", FencingToken::random().0)).unwrap()
}

fn key(g: &ConsumerGroup, k: &str) -> DedupKey {
    DedupKey::new(g, k).unwrap()
}

fn req(k: &DedupKey) -> ClaimRequest {
    ClaimRequest::new(k.clone(), LONG).with_worker("t")
}

async fn process(s: &dyn DedupStore, k: &DedupKey) {
    match s.claim(&req(k)).await.unwrap() {
        ClaimOutcome::Acquired(l) => {
            assert_eq!(
                s.complete(k, l.token, Some("ok".into()), RETAIN)
                    .await
                    .unwrap(),
                CompleteOutcome::Completed
            );
        }
        o => panic!("{k} should be fresh, got {o:?}"),
    }
}

/// A filter that answers "maybe seen" for everything: the worst false-positive rate.
struct AlwaysMaybe;

#[async_trait]
impl PreFilter for AlwaysMaybe {
    async fn insert(&self, keys: &[DedupKey]) -> Result<Vec<Novelty>, StoreError> {
        Ok(vec![Novelty::MaybeSeen; keys.len()])
    }
    async fn check(&self, keys: &[DedupKey]) -> Result<Vec<Novelty>, StoreError> {
        Ok(vec![Novelty::MaybeSeen; keys.len()])
    }
    fn describe(&self) -> String {
        "always maybe".into()
    }
}

/// A filter whose inserts fail.
struct Broken;

#[async_trait]
impl PreFilter for Broken {
    async fn insert(&self, _: &[DedupKey]) -> Result<Vec<Novelty>, StoreError> {
        Err(StoreError::Unavailable("filter down".into()))
    }
    async fn check(&self, _: &[DedupKey]) -> Result<Vec<Novelty>, StoreError> {
        Err(StoreError::Unavailable("filter down".into()))
    }
    fn describe(&self) -> String {
        "broken".into()
    }
}

fn saturated_bloom() -> Arc<LocalBloom> {
    let f = LocalBloom::with_sizing(BloomSizing {
        bits: 64,
        hashes: 2,
    });
    let mut i = 0;
    while f.fill_ratio() < 1.0 {
        f.insert_str(&format!("filler-{i}"));
        i += 1;
    }
    Arc::new(f)
}

/// A saturated bloom filter (every query positive) never skips a fresh message: with the
/// primary up every fresh key is acquired; during an outage the gate refuses them
/// (`InFlight`: no ack, redelivered) instead of calling them duplicates.
#[tokio::test]
async fn a_saturated_bloom_filter_never_skips_a_fresh_message() {
    let bloom = saturated_bloom();
    let g = group();
    for i in 0..1000 {
        assert_eq!(
            bloom.check_str(&format!("{}:fresh-{i}", g.as_str())),
            Novelty::MaybeSeen
        );
    }
    let filters: [Arc<dyn PreFilter>; 2] = [bloom, Arc::new(AlwaysMaybe)];
    for filter in filters {
        let primary = Arc::new(MemoryStore::new());
        let s = LayeredStore::builder(primary.clone())
            .prefilter(filter)
            .fallback(Arc::new(MemoryStore::new()), FallbackGate::NeverSeenKeys)
            .build()
            .unwrap();
        let keys: Vec<DedupKey> = (0..1000).map(|i| key(&g, &format!("fresh-{i}"))).collect();
        // Primary up: each fresh message is acquired and processed, single and batched.
        for k in &keys[..500] {
            process(&s, k).await;
        }
        let reqs: Vec<ClaimRequest> = keys[500..].iter().map(req).collect();
        for o in s.claim_batch(&reqs).await.unwrap() {
            assert!(
                matches!(o, ClaimOutcome::Acquired(_)),
                "fresh key skipped: {o:?}"
            );
        }
        // Primary down: a fresh key is refused for now, never answered Duplicate.
        primary.set_available(false);
        let g2 = group();
        let outage: Vec<DedupKey> = (0..100).map(|i| key(&g2, &format!("o-{i}"))).collect();
        for k in &outage {
            match s.claim(&req(k)).await.unwrap() {
                ClaimOutcome::InFlight { until_ms } => assert!(until_ms > idemq_core::now_ms()),
                o => panic!("outage + saturated filter must refuse, got {o:?}"),
            }
        }
        // Primary back: the refused keys are processed.
        primary.set_available(true);
        for k in &outage {
            process(&s, k).await;
        }
        assert_eq!(s.stats().refused_during_outage, 100);
        assert_eq!(s.stats().fallback_claims, 0);
    }
}

/// The cache holds only keys reported completed: a fresh key is never answered from it.
#[tokio::test]
async fn a_fresh_message_is_never_answered_duplicate_by_the_cache() {
    let primary = Arc::new(MemoryStore::new());
    let s = LayeredStore::new(primary.clone());
    let g = group();
    for i in 0..2000 {
        process(&s, &key(&g, &format!("done-{i}"))).await;
    }
    // Every completed key is a duplicate, answered without the primary.
    let before = s.stats().primary_claims;
    for i in 0..2000 {
        let k = key(&g, &format!("done-{i}"));
        assert!(s.is_cached_duplicate(&k));
        assert!(matches!(
            s.claim(&req(&k)).await.unwrap(),
            ClaimOutcome::Duplicate(_)
        ));
    }
    assert_eq!(
        s.stats().primary_claims,
        before,
        "duplicates answered locally"
    );
    // Look-alike fresh keys (same group, near names, other groups) are never duplicates.
    let g2 = group();
    let mut fresh = Vec::new();
    for i in 0..2000 {
        fresh.push(key(&g, &format!("done-{i}x")));
        fresh.push(key(&g, &format!("xdone-{i}")));
        fresh.push(key(&g2, &format!("done-{i}")));
    }
    for k in &fresh {
        assert!(
            s.check_local(k, None).is_none(),
            "{k} answered from the cache"
        );
    }
    for chunk in fresh.chunks(100) {
        let reqs: Vec<ClaimRequest> = chunk.iter().map(req).collect();
        for (k, o) in chunk.iter().zip(s.claim_batch(&reqs).await.unwrap()) {
            assert!(matches!(o, ClaimOutcome::Acquired(_)), "{k}: {o:?}");
        }
    }
}

/// A cached completion never outlives the record's retention.
#[tokio::test]
async fn cached_duplicates_expire_with_the_retention() {
    let primary = Arc::new(MemoryStore::new());
    let s = LayeredStore::new(primary.clone());
    let k = key(&group(), "short");
    let ClaimOutcome::Acquired(l) = s.claim(&req(&k)).await.unwrap() else {
        panic!()
    };
    s.complete(&k, l.token, None, Duration::from_millis(200))
        .await
        .unwrap();
    assert!(s.is_cached_duplicate(&k));
    tokio::time::sleep(Duration::from_millis(350)).await;
    assert!(!s.is_cached_duplicate(&k));
    match s.claim(&req(&k)).await.unwrap() {
        ClaimOutcome::Acquired(l) => assert_eq!(l.attempt, 1),
        o => panic!("retention over: a new lifecycle, got {o:?}"),
    }
}

/// `forget` through the layered store drops the cached completion too.
#[tokio::test]
async fn forget_invalidates_the_cache() {
    let s = LayeredStore::new(Arc::new(MemoryStore::new()));
    let k = key(&group(), "f");
    process(&s, &k).await;
    assert!(s.is_cached_duplicate(&k));
    assert!(s.forget(&k).await.unwrap());
    assert!(!s.is_cached_duplicate(&k));
    assert!(matches!(
        s.claim(&req(&k)).await.unwrap(),
        ClaimOutcome::Acquired(_)
    ));
}

/// Without a fallback, an outage is an error (no ack, retry), never "not a duplicate".
#[tokio::test]
async fn without_fallback_an_outage_is_an_error() {
    let primary = Arc::new(MemoryStore::new());
    let s = LayeredStore::new(primary.clone());
    let k = key(&group(), "x");
    process(&s, &k).await;
    let fresh = key(&group(), "y");
    primary.set_available(false);
    // Known duplicates are still answered from the cache...
    assert!(matches!(
        s.claim(&req(&k)).await.unwrap(),
        ClaimOutcome::Duplicate(_)
    ));
    // ...anything else fails retryably.
    let err = s.claim(&req(&fresh)).await.unwrap_err();
    assert!(err.is_retryable(), "{err:?}");
    let err = s.claim_batch(&[req(&k), req(&fresh)]).await.unwrap_err();
    assert!(err.is_retryable(), "{err:?}");
}

/// AllKeys: the fallback takes every claim during an outage; completions are routed back
/// to it; after recovery, reconciliation copies its completions to the primary.
#[tokio::test]
async fn fallback_all_keys_with_reconciliation() {
    for reconcile in [false, true] {
        let primary = Arc::new(MemoryStore::new());
        let fallback = Arc::new(MemoryStore::new());
        let s = LayeredStore::builder(primary.clone())
            .fallback(fallback.clone(), FallbackGate::AllKeys)
            .reconcile_after_outage(reconcile)
            .build()
            .unwrap();
        let k = key(&group(), "during-outage");
        primary.set_available(false);
        process(&s, &k).await; // claimed and completed on the fallback
        assert_eq!(s.stats().fallback_claims, 1);
        assert!(fallback.get(&k).await.unwrap().is_some());
        assert!(matches!(
            s.claim(&req(&k)).await.unwrap(),
            ClaimOutcome::Duplicate(_)
        ));
        primary.set_available(true);
        s.clear_cache();
        let after = s.claim(&req(&k)).await.unwrap();
        if reconcile {
            assert!(
                matches!(after, ClaimOutcome::Duplicate(ref r) if r.result.as_deref() == Some(&b"ok"[..])),
                "{after:?}"
            );
            let on_primary = primary
                .get(&k)
                .await
                .unwrap()
                .expect("copied to the primary");
            assert_eq!(on_primary.status, idemq_core::RecordStatus::Completed);
            assert_eq!(s.stats().reconciled, 1);
        } else {
            // The documented hole of AllKeys without reconciliation.
            assert!(matches!(after, ClaimOutcome::Acquired(_)), "{after:?}");
        }
    }
}

/// NeverSeenKeys: during an outage only keys the filter never saw go to the fallback.
#[tokio::test]
async fn fallback_gate_refuses_keys_the_primary_may_know() {
    let primary = Arc::new(MemoryStore::new());
    let s = LayeredStore::builder(primary.clone())
        .prefilter(Arc::new(LocalBloom::new(10_000, 0.001)))
        .fallback(Arc::new(MemoryStore::new()), FallbackGate::NeverSeenKeys)
        .build()
        .unwrap();
    let g = group();
    let done = key(&g, "done");
    let busy = key(&g, "busy");
    process(&s, &done).await;
    let ClaimOutcome::Acquired(_) = s.claim(&req(&busy)).await.unwrap() else {
        panic!()
    };
    s.clear_cache();
    primary.set_available(false);
    let new = key(&g, "new");
    let out = s
        .claim_batch(&[req(&done), req(&busy), req(&new)])
        .await
        .unwrap();
    assert!(
        matches!(out[0], ClaimOutcome::InFlight { .. }),
        "{:?}",
        out[0]
    );
    assert!(
        matches!(out[1], ClaimOutcome::InFlight { .. }),
        "{:?}",
        out[1]
    );
    let ClaimOutcome::Acquired(l) = out[2] else {
        panic!("{:?}", out[2])
    };
    assert_eq!(
        s.complete(&new, l.token, None, RETAIN).await.unwrap(),
        CompleteOutcome::Completed
    );
    assert_eq!(s.stats().fallback_claims, 1);
    assert_eq!(s.stats().refused_during_outage, 2);
}

/// A filter whose insert failed is no longer trusted: the gate refuses every key.
#[tokio::test]
async fn a_failed_filter_insert_makes_the_gate_refuse_everything() {
    let primary = Arc::new(MemoryStore::new());
    let s = LayeredStore::builder(primary.clone())
        .prefilter(Arc::new(Broken))
        .fallback(Arc::new(MemoryStore::new()), FallbackGate::NeverSeenKeys)
        .build()
        .unwrap();
    process(&s, &key(&group(), "a")).await; // the primary still works
    assert!(!s.filter_trusted());
    primary.set_available(false);
    assert!(matches!(
        s.claim(&req(&key(&group(), "b"))).await.unwrap(),
        ClaimOutcome::InFlight { .. }
    ));
}

#[tokio::test]
async fn a_gate_without_a_filter_is_a_config_error() {
    let err = LayeredStore::builder(Arc::new(MemoryStore::new()))
        .fallback(Arc::new(MemoryStore::new()), FallbackGate::NeverSeenKeys)
        .build()
        .unwrap_err();
    assert!(matches!(err, StoreError::Config(_)), "{err:?}");
}

/// A payload conflict is never answered `Duplicate` by the cache: the cache answers the
/// same payload locally, and a different one goes to the store, which reports the
/// conflict (or the cache does, from the whole record it keeps for a stored result).
#[tokio::test]
async fn a_payload_conflict_is_never_answered_duplicate_by_the_cache() {
    let s = LayeredStore::new(Arc::new(MemoryStore::new()));
    let g = group();
    let a = PayloadHash::of(b"a");
    let b = PayloadHash::of(b"b");
    for with_result in [false, true] {
        let k = key(&g, &format!("p-{with_result}"));
        let ClaimOutcome::Acquired(l) = s.claim(&req(&k).with_payload_hash(a)).await.unwrap()
        else {
            panic!()
        };
        let result = with_result.then(|| bytes::Bytes::from_static(b"ok"));
        s.complete(&k, l.token, result, RETAIN).await.unwrap();
        assert!(s.is_cached_duplicate(&k));
        match s.check_local(&k, Some(&a)) {
            Some(ClaimOutcome::Duplicate(r)) => assert_eq!(r.payload_hash, Some(a)),
            o => panic!("same payload, answered locally: {o:?}"),
        }
        let local = s.check_local(&k, Some(&b));
        if with_result {
            assert!(
                matches!(local, Some(ClaimOutcome::PayloadConflict(ref r)) if r.payload_hash == Some(a)),
                "{local:?}"
            );
        } else {
            assert!(local.is_none(), "left to the store: {local:?}");
        }
        let before = s.stats().primary_claims;
        match s.claim(&req(&k).with_payload_hash(b)).await.unwrap() {
            ClaimOutcome::PayloadConflict(r) => assert_eq!(r.payload_hash, Some(a)),
            o => panic!("a different payload: {o:?}"),
        }
        assert_eq!(
            s.stats().primary_claims - before,
            u64::from(!with_result),
            "asked the store only for the compact entry"
        );
    }
}

/// The watchdog keeps a short lease alive past its end, and reports a takeover. On tokio's
/// paused clock: a stalled machine cannot make a renewal look late (a false `Expired`).
#[tokio::test(start_paused = true)]
async fn watchdog_extends_and_reports_loss() {
    let store: Arc<dyn DedupStore> = Arc::new(MemoryStore::new());
    let k = key(&group(), "long");
    let lease_len = Duration::from_millis(900);
    let claimed_at = tokio::time::Instant::now();
    let ClaimOutcome::Acquired(lease) = store
        .claim(&ClaimRequest::new(k.clone(), lease_len))
        .await
        .unwrap()
    else {
        panic!()
    };
    // Renewed every 200 ms: a renewal may come up to 500 ms late before the lease is given
    // up (on the paused clock, however long the machine stalls).
    let every = Duration::from_millis(200);
    let dog = LeaseWatchdog::spawn_with(
        store.clone(),
        k.clone(),
        &lease,
        lease_len,
        claimed_at,
        every,
        every,
    );
    tokio::time::sleep(Duration::from_millis(2000)).await;
    match dog.state() {
        LeaseState::Held { until } => assert!(until > claimed_at + lease_len * 2),
        s => panic!("{s:?}"),
    }
    assert!(matches!(
        store
            .claim(&ClaimRequest::new(k.clone(), lease_len))
            .await
            .unwrap(),
        ClaimOutcome::InFlight { .. }
    ));
    // An operator forgets the key and another worker claims it: the old holder is fenced.
    store.forget(&k).await.unwrap();
    let ClaimOutcome::Acquired(_) = store
        .claim(&ClaimRequest::new(k.clone(), LONG))
        .await
        .unwrap()
    else {
        panic!()
    };
    let lost = tokio::time::timeout(Duration::from_secs(2), dog.lost())
        .await
        .unwrap();
    assert_eq!(lost, LeaseLost::Fenced);
}

/// Renewals failing until the lease ends report `Expired`; dropping stops the renewals.
#[tokio::test]
async fn watchdog_reports_expiry_when_the_store_stays_down_and_stops_on_drop() {
    let mem = Arc::new(MemoryStore::new());
    let store: Arc<dyn DedupStore> = mem.clone();
    let k = key(&group(), "down");
    let lease_len = Duration::from_millis(200);
    let claimed_at = tokio::time::Instant::now();
    let ClaimOutcome::Acquired(lease) = store
        .claim(&ClaimRequest::new(k.clone(), lease_len))
        .await
        .unwrap()
    else {
        panic!()
    };
    let dog = LeaseWatchdog::spawn(store.clone(), k.clone(), &lease, lease_len, claimed_at);
    mem.set_available(false);
    let lost = tokio::time::timeout(Duration::from_secs(2), dog.lost())
        .await
        .unwrap();
    assert_eq!(lost, LeaseLost::Expired);
    mem.set_available(true);

    // Dropped: no more extensions, the lease ends.
    let k2 = key(&group(), "dropped");
    let claimed_at = tokio::time::Instant::now();
    let ClaimOutcome::Acquired(lease) = store
        .claim(&ClaimRequest::new(k2.clone(), lease_len))
        .await
        .unwrap()
    else {
        panic!()
    };
    let dog = LeaseWatchdog::spawn(store.clone(), k2.clone(), &lease, lease_len, claimed_at);
    drop(dog);
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(matches!(
        store.claim(&ClaimRequest::new(k2, LONG)).await.unwrap(),
        ClaimOutcome::Acquired(l) if l.takeover
    ));
}

/// The memory store, but no extend is ever answered (a hung connection).
struct HangingExtends(MemoryStore);

#[async_trait]
impl DedupStore for HangingExtends {
    async fn claim_batch(&self, reqs: &[ClaimRequest]) -> Result<Vec<ClaimOutcome>, StoreError> {
        self.0.claim_batch(reqs).await
    }
    async fn complete_batch(
        &self,
        items: &[idemq_core::Completion],
    ) -> Result<Vec<CompleteOutcome>, StoreError> {
        self.0.complete_batch(items).await
    }
    async fn release(
        &self,
        key: &DedupKey,
        token: FencingToken,
    ) -> Result<idemq_core::ReleaseOutcome, StoreError> {
        self.0.release(key, token).await
    }
    async fn extend(
        &self,
        _key: &DedupKey,
        _token: FencingToken,
        _lease: Duration,
    ) -> Result<idemq_core::ExtendOutcome, StoreError> {
        std::future::pending().await
    }
    async fn get(&self, key: &DedupKey) -> Result<Option<idemq_core::DedupRecord>, StoreError> {
        self.0.get(key).await
    }
    async fn purge_expired(&self, limit: usize) -> Result<u64, StoreError> {
        self.0.purge_expired(limit).await
    }
    async fn list_stuck(
        &self,
        stale_for: Duration,
        limit: usize,
    ) -> Result<Vec<idemq_core::DedupRecord>, StoreError> {
        self.0.list_stuck(stale_for, limit).await
    }
    async fn forget(&self, key: &DedupKey) -> Result<bool, StoreError> {
        self.0.forget(key).await
    }
}

/// A store that never answers an extend: the lease is reported lost by the time it ends
/// on this process's clock (counted from the claim's start), never `Held` past it.
#[tokio::test(start_paused = true)]
async fn a_watchdog_whose_extend_hangs_reports_the_loss_by_the_lease_end() {
    let store: Arc<dyn DedupStore> = Arc::new(HangingExtends(MemoryStore::new()));
    let k = key(&group(), "hung");
    let lease_len = Duration::from_millis(300);
    let claimed_at = tokio::time::Instant::now();
    let ClaimOutcome::Acquired(lease) = store
        .claim(&ClaimRequest::new(k.clone(), lease_len))
        .await
        .unwrap()
    else {
        panic!()
    };
    let lease_end = claimed_at + lease_len;
    let dog = LeaseWatchdog::spawn(store.clone(), k.clone(), &lease, lease_len, claimed_at);
    let lost = tokio::time::timeout(lease_len * 20, dog.lost())
        .await
        .expect("the loss is reported while the extend hangs");
    assert!(
        tokio::time::Instant::now() <= lease_end,
        "reported {:?} after the lease ended",
        tokio::time::Instant::now() - lease_end
    );
    assert_eq!(lost, LeaseLost::Expired);
    assert!(matches!(dog.state(), LeaseState::Lost(LeaseLost::Expired)));
}

/// A primary whose claims read the record, then wait at a gate before answering (a claim
/// that read a record just before an operator's `forget`), and which counts how leases are
/// extended.
struct GatedClaims {
    inner: MemoryStore,
    gate: tokio::sync::Semaphore,
    extends: std::sync::atomic::AtomicUsize,
    extend_batches: std::sync::atomic::AtomicUsize,
}

impl GatedClaims {
    fn new(open: bool) -> Self {
        Self {
            inner: MemoryStore::new(),
            gate: tokio::sync::Semaphore::new(if open { 1 << 20 } else { 0 }),
            extends: Default::default(),
            extend_batches: Default::default(),
        }
    }
}

#[async_trait]
impl DedupStore for GatedClaims {
    async fn claim_batch(&self, reqs: &[ClaimRequest]) -> Result<Vec<ClaimOutcome>, StoreError> {
        let out = self.inner.claim_batch(reqs).await;
        let _pass = self.gate.acquire().await;
        out
    }
    async fn complete_batch(
        &self,
        items: &[idemq_core::Completion],
    ) -> Result<Vec<CompleteOutcome>, StoreError> {
        self.inner.complete_batch(items).await
    }
    async fn release(
        &self,
        key: &DedupKey,
        token: FencingToken,
    ) -> Result<idemq_core::ReleaseOutcome, StoreError> {
        self.inner.release(key, token).await
    }
    async fn extend(
        &self,
        key: &DedupKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<idemq_core::ExtendOutcome, StoreError> {
        self.extends
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner.extend(key, token, lease).await
    }
    async fn extend_batch(
        &self,
        leases: &[(DedupKey, FencingToken)],
        lease: Duration,
    ) -> Result<Vec<idemq_core::ExtendOutcome>, StoreError> {
        self.extend_batches
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner.extend_batch(leases, lease).await
    }
    async fn get(&self, key: &DedupKey) -> Result<Option<idemq_core::DedupRecord>, StoreError> {
        self.inner.get(key).await
    }
    async fn purge_expired(&self, limit: usize) -> Result<u64, StoreError> {
        self.inner.purge_expired(limit).await
    }
    async fn list_stuck(
        &self,
        stale_for: Duration,
        limit: usize,
    ) -> Result<Vec<idemq_core::DedupRecord>, StoreError> {
        self.inner.list_stuck(stale_for, limit).await
    }
    async fn forget(&self, key: &DedupKey) -> Result<bool, StoreError> {
        self.inner.forget(key).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_that_read_the_record_before_a_forget_does_not_cache_it() {
    let g = group();
    let k = key(&g, "forgotten");
    let primary = Arc::new(GatedClaims::new(false));
    // Completed on the primary directly, so the layer has not cached it.
    process(&primary.inner, &k).await;
    let layered = Arc::new(LayeredStore::new(primary.clone()));
    let racing = {
        let (l, k) = (layered.clone(), k.clone());
        tokio::spawn(async move { l.claim(&req(&k)).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await; // the claim has read the record
    assert!(
        layered.forget(&k).await.unwrap(),
        "the operator forgets the key"
    );
    primary.gate.add_permits(1000);
    let stale = racing.await.unwrap().unwrap();
    assert!(matches!(stale, ClaimOutcome::Duplicate(_)), "{stale:?}");
    assert!(
        matches!(
            layered.claim(&req(&k)).await.unwrap(),
            ClaimOutcome::Acquired(_)
        ),
        "after the forget the key is processed again, not answered from the cache"
    );
}

/// A `forget` the fallback store fails is no longer dropped: the caller
/// gets the error (the key may still answer `Duplicate` from the fallback during the next
/// outage), after the primary forgot it and the cache dropped it. The fallback is a real
/// SQLite store whose table is gone, so its `DELETE` fails in the database.
#[tokio::test]
async fn a_failed_fallback_forget_is_returned() {
    let fallback = idemq_sql::SqliteStore::connect("sqlite::memory:", Default::default())
        .await
        .expect("sqlite");
    let s = LayeredStore::builder(Arc::new(MemoryStore::new()))
        .fallback(Arc::new(fallback.clone()), FallbackGate::AllKeys)
        .build()
        .expect("layered");
    let k = key(&group(), "unforgettable");
    process(&s, &k).await;
    assert!(s.is_cached_duplicate(&k));
    sqlx_exec(&fallback, "DROP TABLE idemq_dedup").await;
    let err = s
        .forget(&k)
        .await
        .expect_err("the fallback's failure must be returned");
    assert!(!err.to_string().is_empty());
    // The primary and the cache did forget it.
    assert!(!s.is_cached_duplicate(&k));
    assert!(s.primary().get(&k).await.expect("get").is_none());
}

async fn sqlx_exec(store: &idemq_sql::SqliteStore, sql: &str) {
    use idemq_sql::sqlx::Executor;
    store.pool().execute(sql).await.expect(sql);
}

#[tokio::test]
async fn stats_are_the_primarys_counts() {
    let primary: Arc<dyn DedupStore> = Arc::new(MemoryStore::new());
    let layered: Arc<dyn DedupStore> = Arc::new(LayeredStore::new(primary.clone()));
    idemq_core::testkit::store::stats_count_records_by_state(&layered).await;
    assert_eq!(
        layered.stats().await.expect("layered stats"),
        primary.stats().await.expect("primary stats")
    );
}

/// A heartbeat of a batch is one `extend_batch` on the primary, not one `extend` per key,
/// and answers each lease as `extend` would (a released key is fenced).
#[tokio::test]
async fn a_batch_of_leases_is_extended_in_one_call_to_the_primary() {
    use idemq_core::ExtendOutcome;
    use std::sync::atomic::Ordering;
    let g = group();
    let primary = Arc::new(GatedClaims::new(true));
    let layered = LayeredStore::new(primary.clone());
    let mut leases = Vec::new();
    for i in 0..20 {
        let k = key(&g, &format!("hb-{i}"));
        match layered.claim(&req(&k)).await.unwrap() {
            ClaimOutcome::Acquired(l) => leases.push((k, l.token)),
            o => panic!("fresh key: {o:?}"),
        }
    }
    let (gone, gone_token) = leases[7].clone();
    layered.release(&gone, gone_token).await.unwrap();
    let out = layered
        .extend_batch(&leases, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(out.len(), leases.len());
    for (i, o) in out.iter().enumerate() {
        if i == 7 {
            assert_eq!(*o, ExtendOutcome::Fenced, "the released key");
        } else {
            assert!(
                matches!(o, ExtendOutcome::Extended { .. }),
                "lease {i}: {o:?}"
            );
        }
    }
    assert_eq!(primary.extend_batches.load(Ordering::Relaxed), 1);
    assert_eq!(primary.extends.load(Ordering::Relaxed), 0);
}

/// A store that claims keys in the effect's transaction (the unique index) records its keys
/// with the handler's own commit, never through the layer: the builder refuses it, and a
/// layer made with `new` passes its claim mode through, so the engine runs the handler as
/// that store needs instead of completing through a store that refuses completions (which
/// reran the effect without end).
#[tokio::test]
async fn a_unique_index_behind_the_layer_is_refused_or_passed_through() {
    use idemq_core::broker::MemoryBroker;
    use idemq_core::{
        BrokerKind, ClaimMode, ConsumerConfig, Envelope, HandlerError, IdempotentConsumer,
        KeyStrategy,
    };
    use idemq_sql::sqlx;
    let sqlite = idemq_sql::SqliteStore::connect("sqlite::memory:", Default::default())
        .await
        .expect("sqlite");
    sqlx::query("CREATE TABLE effects (payment_id TEXT NOT NULL)")
        .execute(sqlite.pool())
        .await
        .expect("effects table");
    let unique: Arc<dyn DedupStore> = Arc::new(sqlite.unique_index());
    let err = LayeredStore::builder(unique.clone())
        .build()
        .expect_err("a layer over the unique index is refused");
    assert!(
        matches!(&err, StoreError::Config(m) if m.contains("unique-index")),
        "{err:?}"
    );
    let layered = LayeredStore::new(unique);
    assert_eq!(layered.claim_mode(), ClaimMode::InEffectTransaction);

    let broker = MemoryBroker::new();
    for i in 0..20 {
        broker.publish(Envelope::new(
            BrokerKind::MEMORY,
            "payments",
            format!(r#"{{"payment_id":"p-{}"}}"#, i % 10),
        ));
    }
    let handler = sqlite.batch_handler(|tx, msgs| {
        Box::pin(async move {
            for m in msgs {
                sqlx::query("INSERT INTO effects (payment_id) VALUES (?)")
                    .bind(m.key.as_str().to_string())
                    .execute(&mut *tx)
                    .await
                    .map_err(HandlerError::retryable)?;
            }
            Ok(())
        })
    });
    let keys = KeyStrategy::json_pointer("layered-unique", "/payment_id").expect("keys");
    let consumer =
        IdempotentConsumer::new(Arc::new(layered), keys, handler).with_config(ConsumerConfig {
            redelivery_delay: Duration::from_millis(20),
            ..ConsumerConfig::default()
        });
    tokio::time::timeout(
        Duration::from_secs(30),
        consumer.run_until_idle(&mut broker.subscribe()),
    )
    .await
    .expect("the run ends (it looped, rerunning effects, when the mode was not forwarded)")
    .expect("run");
    let (effects,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM effects")
        .fetch_one(sqlite.pool())
        .await
        .expect("count");
    assert_eq!(effects, 10, "each payment applied once");
    assert_eq!(broker.acked(), 20);
    assert!(broker.dead_letters().is_empty());
}

/// A heartbeat and a batch completion mixing fallback and primary claims while the primary
/// is down: the fallback's answers are kept (its leases renewed, its completions durable)
/// and only the primary's items are `Unknown`; a call whose every part failed is an error.
#[tokio::test]
async fn a_failed_part_of_a_routed_batch_does_not_discard_the_other_parts_answers() {
    use idemq_core::{Completion, ExtendOutcome};
    let primary = Arc::new(MemoryStore::new());
    let s = LayeredStore::builder(primary.clone())
        .fallback(Arc::new(MemoryStore::new()), FallbackGate::AllKeys)
        .build()
        .unwrap();
    let g = group();
    let on_primary = key(&g, "claimed-before-the-outage");
    let ClaimOutcome::Acquired(p) = s.claim(&req(&on_primary)).await.unwrap() else {
        panic!("the primary grants a fresh key")
    };
    primary.set_available(false);
    let on_fallback = key(&g, "claimed-during-the-outage");
    let ClaimOutcome::Acquired(f) = s.claim(&req(&on_fallback)).await.unwrap() else {
        panic!("the fallback grants a fresh key")
    };
    let beat = s
        .extend_batch(
            &[
                (on_primary.clone(), p.token),
                (on_fallback.clone(), f.token),
            ],
            LONG,
        )
        .await
        .expect("one part answered");
    assert_eq!(beat[0], ExtendOutcome::Unknown, "{beat:?}");
    assert!(
        matches!(beat[1], ExtendOutcome::Extended { .. }),
        "{beat:?}"
    );
    let done = s
        .complete_batch(&[
            Completion {
                key: on_primary.clone(),
                token: p.token,
                result: None,
                retention: RETAIN,
            },
            Completion {
                key: on_fallback.clone(),
                token: f.token,
                result: None,
                retention: RETAIN,
            },
        ])
        .await
        .expect("one part answered");
    assert_eq!(
        done,
        vec![CompleteOutcome::Unknown, CompleteOutcome::Completed]
    );
    // Every part failed: the error, not a row of unknowns.
    let err = s
        .extend_batch(&[(on_primary.clone(), p.token)], LONG)
        .await
        .expect_err("only the primary was asked, and it is down");
    assert!(err.is_retryable(), "{err:?}");
}
