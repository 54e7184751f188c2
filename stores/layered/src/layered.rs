//! [`LayeredStore`]: local cache → (pre-filter) → authoritative store → (fallback store).

use crate::cache::CompletedCache;
use crate::claims::{ClaimBook, ClaimInfo};
use crate::filter::{Novelty, PreFilter};
use async_trait::async_trait;
use idemq_core::store::{check_distinct_keys, duration_ms};
use idemq_core::{
    now_ms, ClaimMode, ClaimOutcome, ClaimRequest, CompleteOutcome, Completion, DedupKey,
    DedupRecord, DedupStore, ExtendOutcome, FencingToken, PayloadHash, RecordStatus,
    ReleaseOutcome, RollbackOutcome, StoreError, StoreStats,
};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Default number of completed keys kept in the local cache (seed 003: 100k entries).
pub const DEFAULT_CACHE_CAPACITY: u64 = 100_000;
/// Default upper bound on how long a completed key stays cached (seed 003: 5 minutes).
pub const DEFAULT_CACHE_TTL: Duration = Duration::from_secs(300);
/// Default delay suggested to the caller for keys refused during an outage.
pub const DEFAULT_OUTAGE_RETRY_AFTER: Duration = Duration::from_secs(1);

/// Which keys a [`LayeredStore`] sends to its fallback store while the primary is
/// [`StoreError::Unavailable`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FallbackGate {
    /// Every key goes to the fallback. Highest availability, weakest guarantee: a key the
    /// primary completed (or still holds in flight) before the outage is processed again
    /// if it is redelivered during the outage and this process's cache does not know it.
    AllKeys,
    /// Only keys the [`PreFilter`] proves *never seen* go to the fallback; the others are
    /// answered [`ClaimOutcome::InFlight`] (not acked, redelivered later) until the primary
    /// is back. Requires a pre-filter. Sound for every key that was inserted into the
    /// filter before it reached the primary: the layered store inserts each key before its
    /// primary claim, so this covers all keys claimed through layered stores sharing that
    /// filter (a shared RedisBloom filter on a server other than the primary, or a single
    /// consumer process with a [`LocalBloom`](crate::LocalBloom)). Keys written to the
    /// primary by anything else are not covered.
    NeverSeenKeys,
}

#[derive(Clone)]
struct Fallback {
    store: Arc<dyn DedupStore>,
    gate: FallbackGate,
}

/// Counters of what the layers answered (for tests, benchmarks and dashboards).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct LayerStats {
    /// Claims answered by the local cache without a round trip.
    pub cache_hits: u64,
    /// Claims sent to the primary store.
    pub primary_claims: u64,
    /// Claims sent to the fallback store during an outage.
    pub fallback_claims: u64,
    /// Claims refused during an outage because the pre-filter may have seen the key.
    pub refused_during_outage: u64,
    /// Primary acquisitions turned into duplicates because the fallback had completed the key.
    pub reconciled: u64,
}

#[derive(Default)]
struct Counters {
    cache_hits: AtomicU64,
    primary_claims: AtomicU64,
    fallback_claims: AtomicU64,
    refused: AtomicU64,
    reconciled: AtomicU64,
}

/// Builds a [`LayeredStore`]; see its docs for what each layer guarantees.
pub struct LayeredStoreBuilder {
    primary: Arc<dyn DedupStore>,
    cache_capacity: u64,
    cache_ttl: Duration,
    cache_on_complete: bool,
    filter: Option<Arc<dyn PreFilter>>,
    fallback: Option<Fallback>,
    outage_retry_after: Duration,
    reconcile: bool,
    distrust_when: Option<DistrustProbe>,
}

/// A condition under which the pre-filter's "never seen" answers are no longer trusted
/// (see [`LayeredStoreBuilder::distrust_filter_when`]).
type DistrustProbe = Arc<dyn Fn() -> bool + Send + Sync>;

impl LayeredStoreBuilder {
    /// Stop trusting the pre-filter for the fallback gate (for good, as after a failed
    /// insert) once `lost()` answers `true` — e.g. the primary reports that its dataset was
    /// lost (`idemq_redis::RedisStore::incarnation_lost`): keys it knew may then be
    /// missing from a filter restored or recreated with it. Checked before each use of the
    /// filter's answers and by [`LayeredStore::filter_trusted`].
    pub fn distrust_filter_when(mut self, lost: impl Fn() -> bool + Send + Sync + 'static) -> Self {
        self.distrust_when = Some(Arc::new(lost));
        self
    }

    /// Size and time bound of the cache of completed keys (`capacity` 0 disables it).
    ///
    /// The cache is a table of fixed-size slots allocated when the store is built: about
    /// 53 bytes per key of `capacity`, used or not (5.3 MB for the default 100 000).
    /// [`build`](Self::build) fails if it cannot be allocated. Past about `capacity` live
    /// keys the entries closest to their end are dropped first.
    pub fn cache(mut self, capacity: u64, ttl: Duration) -> Self {
        self.cache_capacity = capacity;
        self.cache_ttl = ttl;
        self
    }

    /// No local cache: every claim goes to the authoritative store.
    pub fn no_cache(self) -> Self {
        self.cache(0, Duration::ZERO)
    }

    /// Whether a key completed through this store is cached at once (default `true`), so
    /// even its first redelivery is answered locally. Otherwise only duplicates reported
    /// by the authoritative store are cached.
    pub fn cache_on_complete(mut self, on: bool) -> Self {
        self.cache_on_complete = on;
        self
    }

    /// A never-seen-only pre-filter: consulted only to gate the fallback store (see
    /// [`FallbackGate::NeverSeenKeys`]); keys are inserted into it before every primary
    /// claim (one extra round trip per batch for a remote filter such as RedisBloom).
    pub fn prefilter(mut self, filter: Arc<dyn PreFilter>) -> Self {
        self.filter = Some(filter);
        self
    }

    /// A fallback store used while the primary answers [`StoreError::Unavailable`]
    /// (seed 003 §3.2 degrade). See [`FallbackGate`] for what each gate guarantees.
    pub fn fallback(mut self, store: Arc<dyn DedupStore>, gate: FallbackGate) -> Self {
        self.fallback = Some(Fallback { store, gate });
        self
    }

    /// How far in the future the `until_ms` of a refused key lies (default 1 s).
    pub fn outage_retry_after(mut self, d: Duration) -> Self {
        self.outage_retry_after = d;
        self
    }

    /// After an outage, check each key the primary hands out against the fallback: if the
    /// fallback completed it, copy the completion to the primary and answer
    /// [`ClaimOutcome::Duplicate`] (default `false`). Costs one fallback `get` per acquired
    /// key, so use it with an in-process or local fallback. Closes the post-outage hole
    /// for keys completed on *this* fallback.
    pub fn reconcile_after_outage(mut self, on: bool) -> Self {
        self.reconcile = on;
        self
    }

    /// Checks the configuration, allocates the cache, and builds the store.
    pub fn build(self) -> Result<LayeredStore, StoreError> {
        let in_tx = |s: &Arc<dyn DedupStore>| s.claim_mode() == ClaimMode::InEffectTransaction;
        if in_tx(&self.primary) || self.fallback.as_ref().is_some_and(|fb| in_tx(&fb.store)) {
            return Err(StoreError::Config(
                "a layered store cannot front a store that claims keys in the effect's transaction (the unique-index strategy): its keys are recorded by the handler's own commit, never through the layer, so the layer's cache and fallback would know nothing. Give the consumer the unique index itself".into(),
            ));
        }
        if let Some(fb) = &self.fallback {
            if fb.gate == FallbackGate::NeverSeenKeys && self.filter.is_none() {
                return Err(StoreError::Config(
                    "FallbackGate::NeverSeenKeys needs a pre-filter: call .prefilter(..) or use FallbackGate::AllKeys".into(),
                ));
            }
        }
        if self.reconcile && self.fallback.is_none() {
            return Err(StoreError::Config(
                "reconcile_after_outage needs a fallback store".into(),
            ));
        }
        self.assemble()
    }

    fn assemble(self) -> Result<LayeredStore, StoreError> {
        let cache = if self.cache_capacity > 0 && !self.cache_ttl.is_zero() {
            let c = CompletedCache::new(self.cache_capacity, self.cache_ttl).map_err(|e| {
                StoreError::Config(format!(
                    "the cache of {} completed keys needs {} bytes, which cannot be allocated: lower LayeredStoreBuilder::cache's capacity",
                    self.cache_capacity, e.bytes
                ))
            })?;
            Some(c)
        } else {
            None
        };
        let claims = ClaimBook::new(self.cache_capacity.max(100_000));
        Ok(LayeredStore {
            primary: self.primary,
            cache,
            cache_ttl: self.cache_ttl,
            cache_on_complete: self.cache_on_complete,
            claims,
            filter: self.filter,
            filter_trusted: AtomicBool::new(true),
            fallback: self.fallback,
            outage_retry_after: self.outage_retry_after,
            reconcile: self.reconcile,
            distrust_when: self.distrust_when,
            counters: Counters::default(),
            forgets: AtomicU64::new(0),
        })
    }
}

/// A [`DedupStore`] in layers: an in-process cache of completed keys, an optional
/// never-seen-only pre-filter, the authoritative store, and an optional fallback store.
///
/// # What each layer may answer
///
/// - **Cache**: a fixed-size table of 128-bit fingerprints of keys the authoritative
///   store (or the fallback) reported completed; it answers [`ClaimOutcome::Duplicate`]
///   without a round trip. A key never completed is never in it, so a fresh message is
///   answered from the cache only if its fingerprint equals a cached key's. The
///   fingerprint is SipHash-1-3 (128-bit output) under a random key drawn when the store
///   is built, so producers cannot aim at a collision and two distinct keys collide with
///   probability 2⁻¹²⁸: `L` lookups of fresh keys against at most `S` cached keys answer
///   wrongly with probability at most `L·S·2⁻¹²⁸`, below 3·10⁻¹⁶ for 10¹⁵ lookups (a
///   million a second for 30 years) against 10⁸ keys. A claim whose payload hash differs
///   from the cached one (kept as a 64-bit tag) goes to the store, which answers the
///   conflict; equal tags for different payloads (probability 2⁻⁶⁴ per such claim) answer
///   `Duplicate` instead of `PayloadConflict` for a key that was completed. An entry lives
///   no longer than the cache TTL and no longer than the record's retention (`expires_ms`,
///   measured on this process's clock). Not seen by the cache: a `forget` made through
///   *another* process; this process keeps answering `Duplicate` for such a key until the
///   entry expires.
///
///   The record of a local `Duplicate` is rebuilt from the slot: key, status, token,
///   attempts, worker and payload hash as stored; `completed_ms` and `expires_ms` to the
///   second (rounded down); `first_seen_ms` and `lease_until_ms`, which the slot does not
///   keep, read as `completed_ms`. A completion with a stored result (or more than 255
///   attempts, more than 254 distinct worker names, times outside 1970–2106) is kept with
///   its whole record, answered as the store would (including payload conflicts), at the
///   cost of the record's memory beside the slot.
/// - **Pre-filter** (bloom): never short-circuits a claim. "Never seen" still needs the
///   authoritative claim (a fresh key needs a lease: two racing redeliveries would both be
///   "never seen"), and "maybe seen" means nothing. Keys are inserted before each primary
///   claim; the insert's answer decides only the outage path ([`FallbackGate`]). If an
///   insert ever fails, the filter may miss keys the primary knows, so from then on this
///   store treats every key as "maybe seen".
/// - **Primary**: the authority; every claim not answered by the cache goes there.
/// - **Fallback** (optional): used only when the primary answers
///   [`StoreError::Unavailable`]. Claims made on it are completed, released and extended
///   on it. Every other primary error is returned as is.
///
/// # Guarantees by mode
///
/// | mode | primary down | what can go wrong |
/// |---|---|---|
/// | no fallback (default) | every claim fails `Unavailable`: no ack, retry later | nothing: exactly-once effects as strong as the primary's |
/// | [`FallbackGate::AllKeys`] | claims go to the fallback | a key completed or in flight on the primary is processed again if redelivered during the outage (unless cached here); after recovery, a key completed on the fallback is processed again on the primary (unless cached here or [`reconcile_after_outage`](LayeredStoreBuilder::reconcile_after_outage)) |
/// | [`FallbackGate::NeverSeenKeys`] | keys the filter never saw go to the fallback, others answer `InFlight` | only keys that reached the primary without passing through this filter; after recovery, as above |
///
/// In both fallback modes, one more case: a primary call that failed *after* the primary
/// applied it (reply lost as the server died) leaves a lease nobody holds. The key may then
/// be processed on the fallback and, once that orphan lease expires, taken over and
/// processed again on the primary — unless the completion is still cached here or
/// reconciliation finds it on the fallback.
///
/// Without a fallback none of this applies: an unavailable primary is an error, the message
/// is not acked, and the broker redelivers it later. Pick a fallback only where an
/// occasional second execution during an outage is cheaper than stopping.
///
/// Batch claims answer exactly what single claims would, key by key.
pub struct LayeredStore {
    primary: Arc<dyn DedupStore>,
    cache: Option<CompletedCache>,
    cache_ttl: Duration,
    cache_on_complete: bool,
    claims: ClaimBook,
    filter: Option<Arc<dyn PreFilter>>,
    filter_trusted: AtomicBool,
    fallback: Option<Fallback>,
    outage_retry_after: Duration,
    reconcile: bool,
    distrust_when: Option<DistrustProbe>,
    counters: Counters,
    /// Bumped by `forget`: a claim or completion that began before a forget must not
    /// cache what it read (the operator wants the key processed again).
    forgets: AtomicU64,
}

impl std::fmt::Debug for LayeredStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayeredStore")
            .field("cache_slots", &self.cache.as_ref().map(|c| c.slots()))
            .field("cache_bytes", &self.cache.as_ref().map(|c| c.table_bytes()))
            .field("cache_ttl", &self.cache_ttl)
            .field("filter", &self.filter.as_ref().map(|f| f.describe()))
            .field("fallback", &self.fallback.as_ref().map(|f| f.gate))
            .finish_non_exhaustive()
    }
}

enum Route {
    Primary,
    Fallback,
}

impl LayeredStore {
    /// A builder over the authoritative store, with a cache of
    /// [`DEFAULT_CACHE_CAPACITY`] entries for at most [`DEFAULT_CACHE_TTL`], no filter and
    /// no fallback.
    pub fn builder(primary: Arc<dyn DedupStore>) -> LayeredStoreBuilder {
        LayeredStoreBuilder {
            primary,
            cache_capacity: DEFAULT_CACHE_CAPACITY,
            cache_ttl: DEFAULT_CACHE_TTL,
            cache_on_complete: true,
            filter: None,
            fallback: None,
            outage_retry_after: DEFAULT_OUTAGE_RETRY_AFTER,
            reconcile: false,
            distrust_when: None,
        }
    }

    /// A layered store with the default cache and nothing else.
    ///
    /// # Panics
    ///
    /// If the default cache (about 5.3 MB) cannot be allocated.
    pub fn new(primary: Arc<dyn DedupStore>) -> Self {
        match Self::builder(primary).assemble() {
            Ok(s) => s,
            Err(e) => panic!("{e}"),
        }
    }

    /// The authoritative store.
    pub fn primary(&self) -> &Arc<dyn DedupStore> {
        &self.primary
    }

    /// Answers from the local cache alone: `Some(Duplicate)` for a key known completed
    /// with the same payload hash (or none), `None` otherwise (which means "ask the
    /// store", never "fresh"). A payload conflict is answered locally only for a
    /// completion kept with its whole record (one with a stored result); otherwise the
    /// store answers it. See [`LayeredStore`] for what a local answer's record carries.
    #[inline]
    pub fn check_local(
        &self,
        key: &DedupKey,
        payload_hash: Option<&PayloadHash>,
    ) -> Option<ClaimOutcome> {
        self.cache.as_ref()?.answer(key, payload_hash)
    }

    /// [`LayeredStore::check_local`] for a batch of claims, in order (what `claim_batch`
    /// asks the cache): one clock read for the batch instead of one per key.
    pub fn check_local_batch(&self, reqs: &[ClaimRequest]) -> Vec<Option<ClaimOutcome>> {
        match &self.cache {
            Some(c) => c.answer_batch(reqs.iter().map(|r| (&r.key, r.payload_hash.as_ref()))),
            None => vec![None; reqs.len()],
        }
    }

    /// [`LayeredStore::is_cached_duplicate`] for a batch of keys, in order, with one clock
    /// read for the batch.
    pub fn cached_duplicates(&self, keys: &[DedupKey]) -> Vec<bool> {
        match &self.cache {
            Some(c) => c.contains_batch(keys),
            None => vec![false; keys.len()],
        }
    }

    /// Whether the local cache holds `key` as completed, whatever its payload hash (the
    /// cheapest duplicate check: one keyed hash, a read of one or two slot groups and a
    /// clock read).
    #[inline]
    pub fn is_cached_duplicate(&self, key: &DedupKey) -> bool {
        self.cache.as_ref().is_some_and(|c| c.contains(key))
    }

    /// Whether the pre-filter is still trusted to gate the fallback (false after an insert failed).
    pub fn filter_trusted(&self) -> bool {
        self.filter.is_some() && self.trust_filter()
    }

    /// Whether the filter's answers may gate the fallback: no insert failed and the
    /// [`LayeredStoreBuilder::distrust_filter_when`] condition never held.
    fn trust_filter(&self) -> bool {
        if let Some(lost) = &self.distrust_when {
            if lost() {
                self.distrust_filter(
                    "the distrust_filter_when condition holds (e.g. the primary lost its dataset)",
                );
            }
        }
        self.filter_trusted.load(Ordering::Acquire)
    }

    /// What the layers answered so far.
    pub fn stats(&self) -> LayerStats {
        let c = &self.counters;
        LayerStats {
            cache_hits: c.cache_hits.load(Ordering::Relaxed),
            primary_claims: c.primary_claims.load(Ordering::Relaxed),
            fallback_claims: c.fallback_claims.load(Ordering::Relaxed),
            refused_during_outage: c.refused.load(Ordering::Relaxed),
            reconciled: c.reconciled.load(Ordering::Relaxed),
        }
    }

    /// Drops every cached completion (e.g. after records were forgotten elsewhere).
    pub fn clear_cache(&self) {
        if let Some(c) = &self.cache {
            c.clear();
        }
    }

    fn cache_record(&self, rec: &DedupRecord, epoch: u64) {
        let Some(cache) = &self.cache else { return };
        if rec.status != RecordStatus::Completed {
            return;
        }
        let Some(expires) = rec.expires_ms else {
            return;
        };
        let left = expires.saturating_sub(now_ms());
        if left <= 0 {
            return;
        }
        // The forget counter is compared under the cache's lock of this key, which
        // `forget`'s invalidation takes after bumping it: a forget that begins after the
        // read of `rec` either fails this check or removes the entry afterwards.
        cache.insert_if(rec, Duration::from_millis(left as u64), || {
            self.forgets.load(Ordering::Acquire) == epoch
        });
    }

    fn uncache(&self, key: &DedupKey) {
        if let Some(c) = &self.cache {
            c.invalidate(key);
        }
    }

    fn note_acquired(
        &self,
        req: &ClaimRequest,
        lease: &idemq_core::Lease,
        on_fallback: bool,
        now: i64,
    ) {
        self.claims.insert(
            req.key.clone(),
            ClaimInfo {
                token: lease.token,
                on_fallback,
                attempt: lease.attempt,
                lease_until_ms: lease.until_ms,
                first_seen_ms: now,
                payload_hash: req.payload_hash,
                worker: req.worker.clone(),
            },
        );
    }

    /// Where the holder of `token` for `key` claimed it.
    fn route(&self, key: &DedupKey, token: FencingToken) -> Route {
        match self.claims.get(key) {
            Some(info) if info.token == token && info.on_fallback && self.fallback.is_some() => {
                Route::Fallback
            }
            _ => Route::Primary,
        }
    }

    /// Releases `key` on the store its claim was made on; `unrun` takes back the claim's
    /// attempt.
    async fn give_back(
        &self,
        key: &DedupKey,
        token: FencingToken,
        unrun: bool,
    ) -> Result<ReleaseOutcome, StoreError> {
        let out = self
            .on_claims_store(key, token, ReleaseOutcome::Fenced, |store| {
                let key = key.clone();
                async move {
                    match unrun {
                        true => store.release_unrun(&key, token).await,
                        false => store.release(&key, token).await,
                    }
                }
            })
            .await?;
        if out == ReleaseOutcome::Released {
            self.claims.remove(key);
        }
        Ok(out)
    }

    /// Calls `call` on the store the claim of `key` under `token` was made on. What the
    /// primary answers `fenced` is asked of the fallback, as `by_route` does: the token may
    /// belong to a fallback claim this store forgot (an error there leaves it fenced).
    async fn on_claims_store<O, F, Fut>(
        &self,
        key: &DedupKey,
        token: FencingToken,
        fenced: O,
        call: F,
    ) -> Result<O, StoreError>
    where
        O: PartialEq + Copy,
        F: Fn(Arc<dyn DedupStore>) -> Fut,
        Fut: std::future::Future<Output = Result<O, StoreError>>,
    {
        Ok(match (self.route(key, token), &self.fallback) {
            (Route::Fallback, Some(fb)) => call(fb.store.clone()).await?,
            (_, fb) => match call(self.primary.clone()).await? {
                o if o == fenced => match fb {
                    Some(fb) => call(fb.store.clone()).await.unwrap_or(fenced),
                    None => fenced,
                },
                o => o,
            },
        })
    }

    /// Sends each of `items` (a completion, a lease) to the store its claim was made on, in
    /// one `call` per store; the answers are in the order of `items`. The fallback's share
    /// goes first: a primary still down must not keep the fallback's completions from
    /// becoming durable (their leases would lapse and the handlers run again). What the
    /// primary answers `fenced` is asked of the fallback: the token may belong to a
    /// fallback claim this store forgot (an error there leaves it fenced). When one store's
    /// part fails and the other's answers, the failed part's items are `unknown` and the
    /// answers are kept (a heartbeat mixing fallback and primary leases during an outage
    /// must still renew the fallback's); only a call whose every part failed is an error.
    async fn by_route<T, O, F, Fut>(
        &self,
        items: &[T],
        key_token: impl Fn(&T) -> (&DedupKey, FencingToken),
        (fenced, unknown): (O, O),
        call: F,
    ) -> Result<Vec<O>, StoreError>
    where
        T: Clone,
        O: Copy + PartialEq,
        F: Fn(Arc<dyn DedupStore>, Vec<T>) -> Fut,
        Fut: std::future::Future<Output = Result<Vec<O>, StoreError>>,
    {
        // One batch call for the items at `which`; one answer per item asked.
        let ask = |store: &Arc<dyn DedupStore>, which: &[usize]| {
            let batch: Vec<T> = which.iter().map(|&i| items[i].clone()).collect();
            let (n, answer) = (batch.len(), call(store.clone(), batch));
            async move {
                let answer = answer.await?;
                if answer.len() != n {
                    return Err(StoreError::Backend(format!(
                        "a batch call answered {} outcomes for {n} items",
                        answer.len()
                    )));
                }
                Ok(answer)
            }
        };
        let (mut prim, mut fbk) = (Vec::new(), Vec::new());
        for (i, item) in items.iter().enumerate() {
            let (key, token) = key_token(item);
            match self.route(key, token) {
                Route::Primary => prim.push(i),
                Route::Fallback => fbk.push(i),
            }
        }
        let mut out = vec![fenced; items.len()];
        let mut failed: Option<StoreError> = None;
        let mut answered = 0;
        if let (Some(fb), false) = (&self.fallback, fbk.is_empty()) {
            match ask(&fb.store, &fbk).await {
                Ok(answer) => {
                    answered += fbk.len();
                    for (&i, o) in fbk.iter().zip(answer) {
                        out[i] = o;
                    }
                }
                Err(e) => {
                    for &i in &fbk {
                        out[i] = unknown;
                    }
                    failed = Some(e);
                }
            }
        }
        let mut refused = Vec::new();
        if !prim.is_empty() {
            match ask(&self.primary, &prim).await {
                Ok(answer) => {
                    answered += prim.len();
                    for (&i, o) in prim.iter().zip(answer) {
                        if o == fenced {
                            refused.push(i);
                        }
                        out[i] = o;
                    }
                }
                Err(e) => {
                    for &i in &prim {
                        out[i] = unknown;
                    }
                    failed = Some(e);
                }
            }
        }
        if let (Some(e), 0) = (failed, answered) {
            return Err(e);
        }
        if let (Some(fb), false) = (&self.fallback, refused.is_empty()) {
            if let Ok(again) = ask(&fb.store, &refused).await {
                for (&i, o) in refused.iter().zip(again) {
                    out[i] = o;
                }
            }
        }
        Ok(out)
    }

    /// Inserts keys into the filter; `None` when there is no filter.
    async fn filter_insert(&self, reqs: &[ClaimRequest]) -> Option<Vec<Novelty>> {
        let filter = self.filter.as_ref()?;
        let keys: Vec<DedupKey> = reqs.iter().map(|r| r.key.clone()).collect();
        match filter.insert(&keys).await {
            Ok(v) if v.len() == keys.len() => Some(v),
            Ok(v) => {
                self.distrust_filter(&format!(
                    "{} answered {} novelties for {} keys",
                    filter.describe(),
                    v.len(),
                    keys.len()
                ));
                Some(vec![Novelty::MaybeSeen; keys.len()])
            }
            Err(e) => {
                self.distrust_filter(&format!("{} insert failed: {e}", filter.describe()));
                Some(vec![Novelty::MaybeSeen; keys.len()])
            }
        }
    }

    fn distrust_filter(&self, why: &str) {
        if self.filter_trusted.swap(false, Ordering::AcqRel) {
            tracing::error!(
                reason = why,
                "pre-filter no longer trusted: it may miss keys the primary knows; \
                 every key now counts as maybe seen for the fallback gate"
            );
        }
    }

    async fn claim_remote(&self, reqs: &[ClaimRequest]) -> Result<Vec<ClaimOutcome>, StoreError> {
        let epoch = self.forgets.load(Ordering::Acquire);
        let novelty = self.filter_insert(reqs).await;
        self.counters
            .primary_claims
            .fetch_add(reqs.len() as u64, Ordering::Relaxed);
        match self.primary.claim_batch(reqs).await {
            Ok(out) => {
                if out.len() != reqs.len() {
                    return Err(StoreError::Backend(format!(
                        "primary answered {} outcomes for {} claims",
                        out.len(),
                        reqs.len()
                    )));
                }
                self.after_primary(reqs, out, epoch).await
            }
            Err(StoreError::Unavailable(msg)) => match &self.fallback {
                None => Err(StoreError::Unavailable(msg)),
                Some(fb) => self.degraded(fb, reqs, novelty, msg, epoch).await,
            },
            Err(e) => Err(e),
        }
    }

    async fn after_primary(
        &self,
        reqs: &[ClaimRequest],
        mut out: Vec<ClaimOutcome>,
        epoch: u64,
    ) -> Result<Vec<ClaimOutcome>, StoreError> {
        let now = now_ms();
        for (req, o) in reqs.iter().zip(out.iter_mut()) {
            match o {
                ClaimOutcome::Duplicate(rec) => self.cache_record(rec, epoch),
                ClaimOutcome::Acquired(lease) => {
                    let lease = *lease;
                    if self.reconcile {
                        if let Some(dup) = self.reconcile_one(req, &lease, epoch).await? {
                            *o = dup;
                            continue;
                        }
                    }
                    self.note_acquired(req, &lease, false, now);
                }
                _ => {}
            }
        }
        Ok(out)
    }

    /// The primary handed out `req.key`: if the fallback completed it during an outage,
    /// copy the completion to the primary and answer Duplicate.
    async fn reconcile_one(
        &self,
        req: &ClaimRequest,
        lease: &idemq_core::Lease,
        epoch: u64,
    ) -> Result<Option<ClaimOutcome>, StoreError> {
        let Some(fb) = &self.fallback else {
            return Ok(None);
        };
        let rec = match fb.store.get(&req.key).await {
            Ok(Some(r)) => r,
            Ok(None) => return Ok(None),
            Err(e) => {
                // Unsure whether the fallback completed it: give the key back, retry later.
                if let Err(e2) = self.primary.release(&req.key, lease.token).await {
                    tracing::warn!(key = %req.key, error = %e2, "release after failed reconcile");
                }
                return Err(e);
            }
        };
        let now = now_ms();
        if !rec.status.is_terminal() || rec.is_retention_expired(now) {
            return Ok(None);
        }
        let left = rec.expires_ms.unwrap_or(now).saturating_sub(now).max(1);
        if rec.status == RecordStatus::RolledBack {
            // Rolled back on the fallback during an outage: the primary must refuse the key
            // too, or a late claim would apply the effect of a dropped message.
            let kept = self
                .primary
                .roll_back(&req.key, lease.token, Duration::from_millis(left as u64))
                .await?;
            if kept != RollbackOutcome::RolledBack {
                return Ok(None);
            }
            tracing::info!(key = %req.key, "roll-back made on the fallback copied to the primary");
            return Ok(Some(ClaimOutcome::RolledBack(rec)));
        }
        let done = self
            .primary
            .complete(
                &req.key,
                lease.token,
                rec.result.clone(),
                Duration::from_millis(left as u64),
            )
            .await?;
        if !done.is_done() {
            return Ok(None);
        }
        self.counters.reconciled.fetch_add(1, Ordering::Relaxed);
        tracing::info!(key = %req.key, "completion made on the fallback copied to the primary");
        self.cache_record(&rec, epoch);
        Ok(Some(
            match (rec.payload_hash.as_ref(), req.payload_hash.as_ref()) {
                (Some(a), Some(b)) if a != b => ClaimOutcome::PayloadConflict(rec),
                _ => ClaimOutcome::Duplicate(rec),
            },
        ))
    }

    async fn degraded(
        &self,
        fb: &Fallback,
        reqs: &[ClaimRequest],
        novelty: Option<Vec<Novelty>>,
        primary_error: String,
        epoch: u64,
    ) -> Result<Vec<ClaimOutcome>, StoreError> {
        let allowed: Vec<bool> = match fb.gate {
            FallbackGate::AllKeys => vec![true; reqs.len()],
            FallbackGate::NeverSeenKeys => match novelty {
                Some(v) if self.trust_filter() => v.iter().map(|n| n.is_never_seen()).collect(),
                _ => vec![false; reqs.len()],
            },
        };
        let pass: Vec<ClaimRequest> = reqs
            .iter()
            .zip(&allowed)
            .filter(|(_, ok)| **ok)
            .map(|(r, _)| r.clone())
            .collect();
        tracing::warn!(
            error = %primary_error,
            to_fallback = pass.len(),
            refused = reqs.len() - pass.len(),
            "primary dedup store unavailable: degrading"
        );
        let mut fb_out = if pass.is_empty() {
            Vec::new()
        } else {
            self.counters
                .fallback_claims
                .fetch_add(pass.len() as u64, Ordering::Relaxed);
            fb.store.claim_batch(&pass).await?
        };
        if fb_out.len() != pass.len() {
            return Err(StoreError::Backend(format!(
                "fallback answered {} outcomes for {} claims",
                fb_out.len(),
                pass.len()
            )));
        }
        let now = now_ms();
        let until_ms = now.saturating_add(duration_ms(self.outage_retry_after));
        let mut fb_iter = fb_out.drain(..);
        let mut out = Vec::with_capacity(reqs.len());
        for (req, ok) in reqs.iter().zip(allowed) {
            if !ok {
                self.counters.refused.fetch_add(1, Ordering::Relaxed);
                out.push(ClaimOutcome::InFlight { until_ms });
                continue;
            }
            let Some(o) = fb_iter.next() else {
                return Err(StoreError::Backend("fallback answer ended early".into()));
            };
            match &o {
                ClaimOutcome::Acquired(lease) => self.note_acquired(req, lease, true, now),
                ClaimOutcome::Duplicate(rec) => self.cache_record(rec, epoch),
                _ => {}
            }
            out.push(o);
        }
        Ok(out)
    }

    fn cache_completion(&self, c: &Completion, store_now: i64, epoch: u64) {
        if !self.cache_on_complete || self.cache.is_none() {
            return;
        }
        let Some(info) = self.claims.get(&c.key) else {
            return;
        };
        // First-seen is only known for a first acquisition; otherwise let the store answer.
        if info.token != c.token || info.attempt != 1 {
            return;
        }
        let rec = DedupRecord {
            key: c.key.clone(),
            status: RecordStatus::Completed,
            token: c.token,
            lease_until_ms: info.lease_until_ms,
            attempts: info.attempt,
            payload_hash: info.payload_hash,
            result: c.result.clone(),
            first_seen_ms: info.first_seen_ms,
            completed_ms: Some(store_now),
            expires_ms: Some(store_now.saturating_add(duration_ms(c.retention))),
            worker: info.worker.clone(),
        };
        self.cache_record(&rec, epoch);
    }
}

#[async_trait]
impl DedupStore for LayeredStore {
    /// The primary's: a store that claims in the effect's transaction keeps doing so behind
    /// the layer (which [`LayeredStoreBuilder::build`] refuses; [`LayeredStore::new`] lets it
    /// through as a pass-through), so the engine runs its handler as that store needs.
    fn claim_mode(&self) -> ClaimMode {
        self.primary.claim_mode()
    }

    async fn claim(&self, req: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        if let Some(o) = self.check_local(&req.key, req.payload_hash.as_ref()) {
            self.counters.cache_hits.fetch_add(1, Ordering::Relaxed);
            return Ok(o);
        }
        // Boxed apart, so the future of a cache hit stays small (async_trait boxes it).
        let mut v = Box::pin(self.claim_remote(std::slice::from_ref(req))).await?;
        v.pop()
            .ok_or_else(|| StoreError::Backend("claim_batch returned no outcome".into()))
    }

    async fn claim_batch(&self, reqs: &[ClaimRequest]) -> Result<Vec<ClaimOutcome>, StoreError> {
        check_distinct_keys(reqs)?;
        let local = self.check_local_batch(reqs);
        let hits = local.iter().filter(|o| o.is_some()).count();
        self.counters
            .cache_hits
            .fetch_add(hits as u64, Ordering::Relaxed);
        if hits == 0 {
            return self.claim_remote(reqs).await;
        }
        let remote: Vec<ClaimRequest> = reqs
            .iter()
            .zip(&local)
            .filter(|(_, o)| o.is_none())
            .map(|(r, _)| r.clone())
            .collect();
        let mut remote_out = if remote.is_empty() {
            Vec::new()
        } else {
            self.claim_remote(&remote).await?
        }
        .into_iter();
        let mut out = Vec::with_capacity(reqs.len());
        for o in local {
            match o {
                Some(o) => out.push(o),
                None => out.push(remote_out.next().ok_or_else(|| {
                    StoreError::Backend("remote claim answer ended early".into())
                })?),
            }
        }
        Ok(out)
    }

    async fn complete_batch(
        &self,
        items: &[Completion],
    ) -> Result<Vec<CompleteOutcome>, StoreError> {
        let epoch = self.forgets.load(Ordering::Acquire);
        let out = self
            .by_route(
                items,
                |c| (&c.key, c.token),
                (CompleteOutcome::Fenced, CompleteOutcome::Unknown),
                |store, batch| async move { store.complete_batch(&batch).await },
            )
            .await?;
        let now = now_ms();
        for (c, o) in items.iter().zip(&out) {
            if o.is_done() {
                self.cache_completion(c, now, epoch);
                self.claims.remove(&c.key);
            }
        }
        Ok(out)
    }

    async fn release(
        &self,
        key: &DedupKey,
        token: FencingToken,
    ) -> Result<ReleaseOutcome, StoreError> {
        self.give_back(key, token, false).await
    }

    async fn release_unrun(
        &self,
        key: &DedupKey,
        token: FencingToken,
    ) -> Result<ReleaseOutcome, StoreError> {
        self.give_back(key, token, true).await
    }

    /// On the store the claim was made on (its `fenced` on the primary asked of the
    /// fallback, as a release is).
    async fn roll_back(
        &self,
        key: &DedupKey,
        token: FencingToken,
        retention: Duration,
    ) -> Result<RollbackOutcome, StoreError> {
        let out = self
            .on_claims_store(key, token, RollbackOutcome::Fenced, |store| {
                let key = key.clone();
                async move { store.roll_back(&key, token, retention).await }
            })
            .await?;
        if out == RollbackOutcome::RolledBack {
            self.claims.remove(key);
        }
        Ok(out)
    }

    async fn extend(
        &self,
        key: &DedupKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<ExtendOutcome, StoreError> {
        let out = self.extend_batch(&[(key.clone(), token)], lease).await?;
        Ok(out[0])
    }

    /// Each lease on the store it was claimed on, one `extend_batch` per store the batch
    /// touches (a heartbeat of a batch is one round trip, not one per key).
    async fn extend_batch(
        &self,
        leases: &[(DedupKey, FencingToken)],
        lease: Duration,
    ) -> Result<Vec<ExtendOutcome>, StoreError> {
        self.by_route(
            leases,
            |(key, token)| (key, *token),
            (ExtendOutcome::Fenced, ExtendOutcome::Unknown),
            |store, batch| async move { store.extend_batch(&batch, lease).await },
        )
        .await
    }

    async fn get(&self, key: &DedupKey) -> Result<Option<DedupRecord>, StoreError> {
        match self.primary.get(key).await {
            Err(StoreError::Unavailable(msg)) => match &self.fallback {
                Some(fb) => fb.store.get(key).await,
                None => Err(StoreError::Unavailable(msg)),
            },
            r => r,
        }
    }

    async fn purge_expired(&self, limit: usize) -> Result<u64, StoreError> {
        let n = self.primary.purge_expired(limit).await?;
        let rest = limit.saturating_sub(usize::try_from(n).unwrap_or(usize::MAX));
        let m = match &self.fallback {
            Some(fb) if rest > 0 => fb.store.purge_expired(rest).await?,
            _ => 0,
        };
        Ok(n + m)
    }

    /// The primary's counts: the cache and the filter only mirror its state. Records a
    /// fallback store took during an outage are not included.
    async fn stats(&self) -> Result<StoreStats, StoreError> {
        self.primary.stats().await
    }

    async fn list_stuck(
        &self,
        stale_for: Duration,
        limit: usize,
    ) -> Result<Vec<DedupRecord>, StoreError> {
        let mut v = self.primary.list_stuck(stale_for, limit).await?;
        if let Some(fb) = &self.fallback {
            v.extend(fb.store.list_stuck(stale_for, limit).await?);
            v.sort_by(|a, b| (a.lease_until_ms, &a.key).cmp(&(b.lease_until_ms, &b.key)));
            v.truncate(limit);
        }
        Ok(v)
    }

    /// Forgets `key` on the primary and on the fallback, and drops it from the cache.
    ///
    /// A failure of either store is returned (after the other was tried and the cache
    /// cleared): a key still known to the fallback would be answered `Duplicate` during
    /// the next outage. A failed fallback forget is also counted
    /// (`idemq_layered_fallback_forget_failures_total`) and logged.
    async fn forget(&self, key: &DedupKey) -> Result<bool, StoreError> {
        self.forgets.fetch_add(1, Ordering::AcqRel);
        self.uncache(key);
        self.claims.remove(key);
        let primary = self.primary.forget(key).await;
        let fallback = match &self.fallback {
            Some(fb) => fb.store.forget(key).await,
            None => Ok(false),
        };
        // Calls that read the record before it was deleted must not cache it now (they
        // compare the counter under the cache's lock), and one that cached it meanwhile is
        // undone here.
        self.forgets.fetch_add(1, Ordering::AcqRel);
        self.uncache(key);
        let fallback = fallback.inspect_err(|e| {
            metrics::counter!("idemq_layered_fallback_forget_failures_total").increment(1);
            tracing::warn!(
                key = %key,
                error = %e,
                "forget failed on the fallback store: it may still answer Duplicate for this key during an outage"
            );
        });
        Ok(primary? | fallback?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use idemq_core::{ConsumerGroup, MemoryStore};
    use std::sync::mpsc;

    /// A `forget` that runs between the cache's "was the key forgotten
    /// meanwhile?" check and its insert must not leave the forgotten key cached (it would
    /// answer `Duplicate` for the cache TTL). The hook runs the forget on another thread
    /// at exactly that point and gives it time to finish; the key must not be cached
    /// afterwards, and the next claim must acquire it.
    #[test]
    fn a_forget_racing_the_cache_insert_leaves_nothing_cached() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let primary: Arc<dyn DedupStore> = Arc::new(MemoryStore::new());
        let store = Arc::new(LayeredStore::new(primary.clone()));
        let key = DedupKey::new(&ConsumerGroup::new("race").expect("group"), "k").expect("key");
        let req = ClaimRequest::new(key.clone(), Duration::from_secs(30));
        rt.block_on(async {
            // Completed on the primary behind the cache's back.
            let ClaimOutcome::Acquired(l) = primary.claim(&req).await.expect("claim") else {
                panic!("expected Acquired");
            };
            let done = primary
                .complete(&key, l.token, None, Duration::from_secs(3600))
                .await
                .expect("complete");
            assert_eq!(done, CompleteOutcome::Completed);
        });
        let (tx, rx) = mpsc::channel();
        let (s2, k2) = (store.clone(), key.clone());
        let forgetter = std::sync::Mutex::new(None);
        let slot = Arc::new(forgetter);
        let slot2 = slot.clone();
        crate::cache::test_hook::set_before_insert(move || {
            let h = std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime");
                let r = rt.block_on(s2.forget(&k2));
                let _ = tx.send(());
                r
            });
            // Before the fix the forget finishes here, then the stale insert lands. With
            // the fix it waits for the shard lock this insert holds.
            let _ = rx.recv_timeout(Duration::from_millis(300));
            if let Ok(mut g) = slot2.lock() {
                *g = Some(h);
            }
        });
        let first = rt.block_on(store.claim(&req)).expect("claim");
        assert!(matches!(first, ClaimOutcome::Duplicate(_)), "{first:?}");
        let h = slot.lock().expect("lock").take().expect("the hook ran");
        assert!(
            h.join().expect("join").expect("forget"),
            "the record existed"
        );
        assert!(
            !store.is_cached_duplicate(&key),
            "a forgotten key is still cached"
        );
        let again = rt.block_on(store.claim(&req)).expect("claim");
        assert!(
            matches!(again, ClaimOutcome::Acquired(_)),
            "after forget: {again:?}"
        );
    }
}
