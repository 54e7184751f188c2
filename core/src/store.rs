//! The claim contract every dedup store implements.
//!
//! `claim(key, lease)` answers exactly one of:
//! - [`ClaimOutcome::Acquired`]: the caller owns the key until the lease ends and holds a
//!   [`FencingToken`];
//! - [`ClaimOutcome::Duplicate`]: processed before; the record may carry the stored result;
//! - [`ClaimOutcome::InFlight`]: another worker holds a live lease: do not ack, redeliver later;
//! - [`ClaimOutcome::PayloadConflict`]: the key is known with a *different* payload hash, which
//!   is reported instead of being silently skipped.
//!
//! [`DedupStore::complete`] marks a key done only while the caller's token still owns it; a
//! worker whose lease expired and was taken over, or who released the key, gets
//! [`CompleteOutcome::Fenced`], never a silent double commit. (A lease that ended but was not
//! taken over still belongs to its token: nobody else ran the message.) Completion is
//! idempotent for the token that owns a completed record, and a repeat says so
//! ([`CompleteOutcome::AlreadyCompleted`]): the engine's `complete` after a handler completed
//! in its own database transaction acks either way, and a transaction that finds its claim
//! completed before rolls its repeated effect back.
//!
//! Record lifecycle (AWS Powertools' vocabulary): `IN_PROGRESS` with a lease; `EXPIRED` is an
//! in-progress record whose lease ended (claimable by takeover, listed by
//! [`DedupStore::list_stuck`]); `COMPLETED` until its retention ends, after which a claim
//! starts afresh and [`DedupStore::purge_expired`] deletes it. A released record keeps its
//! row (and its attempt count) with an ended lease. `ROLLED_BACK` ([`DedupStore::roll_back`])
//! is terminal like `COMPLETED`, for the opposite reason: the operation of the key was given
//! up for good (a transactional message's check-back dropped its half message), so until its
//! retention ends every claim is refused with [`ClaimOutcome::RolledBack`] — a late holder
//! of the key can no longer apply an effect whose message is gone.
//!
//! Time is milliseconds since the Unix epoch. Leases, retention and expiry are decided on the
//! *store's* clock (the SQL database's own time, Redis `TIME` inside the scripts), so workers
//! whose clocks disagree still agree on who holds a lease; [`Lease::until_ms`] and the record
//! times are on that clock. ([`crate::MemoryStore`]'s store clock is its process's.)

use crate::key::DedupKey;
use async_trait::async_trait;
use bytes::Bytes;
use sha2::{Digest, Sha256};
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch, now, by this process's clock (plus the test skew of
/// [`set_test_clock_skew_ms`], normally 0). Stores decide leases on *their own* clock (the
/// database's, Redis `TIME`), never on this one.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
        .saturating_add(TEST_CLOCK_SKEW_MS.load(std::sync::atomic::Ordering::Relaxed))
}

static TEST_CLOCK_SKEW_MS: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(0);

/// Test hook: skews [`now_ms`] for the whole process by `ms` (negative: behind), to show that
/// a client whose clock is wrong neither takes over a live lease nor sees a dead one as live.
/// Every client-side clock read of idemq goes through [`now_ms`]. Not for production use.
#[doc(hidden)]
pub fn set_test_clock_skew_ms(ms: i64) {
    TEST_CLOCK_SKEW_MS.store(ms, std::sync::atomic::Ordering::Relaxed);
}

/// A duration in whole milliseconds, saturating (stores keep `i64` millis).
pub fn duration_ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Proof of ownership of a claimed key: opaque, unique per acquisition, compared for equality.
///
/// Always in `1..=i64::MAX` so every store can keep it in a signed 64-bit column.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FencingToken(pub i64);

impl FencingToken {
    /// A token from a stored or caller-chosen value, if it is in range (`1..=i64::MAX`).
    pub fn new(value: i64) -> Option<Self> {
        Self(value).is_valid().then_some(Self(value))
    }
    /// True when the value is in range; stores refuse claims with other tokens.
    pub fn is_valid(self) -> bool {
        self.0 > 0
    }
    /// A fresh random token.
    pub fn random() -> Self {
        use rand::Rng;
        Self(rand::thread_rng().gen_range(1..=i64::MAX))
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// SHA-256 of a payload, to tell a true duplicate from a key collision.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct PayloadHash(pub [u8; 32]);

impl PayloadHash {
    /// Hashes a payload.
    pub fn of(payload: &[u8]) -> Self {
        Self(Sha256::digest(payload).into())
    }
    /// Rebuilds a hash read back from a store; `None` if it is not 32 bytes.
    pub fn from_slice(b: &[u8]) -> Option<Self> {
        <[u8; 32]>::try_from(b).ok().map(Self)
    }
    /// Lowercase hex.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
    /// Parses lowercase or uppercase hex.
    pub fn from_hex(s: &str) -> Option<Self> {
        hex::decode(s).ok().and_then(|b| Self::from_slice(&b))
    }
}

impl fmt::Debug for PayloadHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PayloadHash({})", &self.to_hex()[..12])
    }
}

/// Status of a stored record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RecordStatus {
    /// Claimed; the lease says until when.
    InProgress,
    /// Done; duplicates are skipped until the retention ends.
    Completed,
    /// Given up for good ([`DedupStore::roll_back`]): claims are refused until the retention
    /// ends.
    RolledBack,
}

impl RecordStatus {
    /// The stored code: 0 in progress, 1 completed, 2 rolled back.
    pub fn code(self) -> i64 {
        match self {
            RecordStatus::InProgress => 0,
            RecordStatus::Completed => 1,
            RecordStatus::RolledBack => 2,
        }
    }
    /// Parses a stored code.
    pub fn from_code(c: i64) -> Option<Self> {
        match c {
            0 => Some(RecordStatus::InProgress),
            1 => Some(RecordStatus::Completed),
            2 => Some(RecordStatus::RolledBack),
            _ => None,
        }
    }
    /// Whether the record ended its lifecycle (completed or rolled back): it lives until its
    /// retention ends and no claim acquires it before.
    pub fn is_terminal(self) -> bool {
        matches!(self, RecordStatus::Completed | RecordStatus::RolledBack)
    }
}

/// What a store knows about a key, with audit fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DedupRecord {
    /// The key.
    pub key: DedupKey,
    /// In progress or completed.
    pub status: RecordStatus,
    /// The token of the latest acquisition.
    pub token: FencingToken,
    /// End of the current lease (in progress) or of the last one.
    pub lease_until_ms: i64,
    /// How many times the key has been acquired in this lifecycle.
    pub attempts: u32,
    /// Payload hash given at the latest acquisition.
    pub payload_hash: Option<PayloadHash>,
    /// The stored result of the handler, replayed to duplicates.
    pub result: Option<Bytes>,
    /// When the key was first claimed in this lifecycle.
    pub first_seen_ms: i64,
    /// When it was completed (or rolled back).
    pub completed_ms: Option<i64>,
    /// When a completed (or rolled-back) record may be forgotten.
    pub expires_ms: Option<i64>,
    /// Who holds / held it.
    pub worker: Option<Arc<str>>,
}

impl DedupRecord {
    /// Whether the record was released (its lease set to 0): its token owns nothing.
    pub fn is_released(&self) -> bool {
        self.status == RecordStatus::InProgress && self.lease_until_ms == 0
    }
    /// Whether `token` holds the key: in progress under it and not released (its lease may
    /// have ended: nobody took it over). Only such a holder may complete, release, extend or
    /// roll the key back.
    pub fn is_held_by(&self, token: FencingToken) -> bool {
        self.token == token && self.status == RecordStatus::InProgress && !self.is_released()
    }
    /// Whether the record is in progress with a lease that has ended at `now`.
    pub fn is_lease_expired(&self, now: i64) -> bool {
        self.status == RecordStatus::InProgress && self.lease_until_ms <= now
    }
    /// Whether a completed or rolled-back record's retention has ended at `now`.
    pub fn is_retention_expired(&self, now: i64) -> bool {
        self.status.is_terminal() && self.expires_ms.is_some_and(|e| e <= now)
    }
}

/// A request to claim one key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimRequest {
    /// The key.
    pub key: DedupKey,
    /// How long the claim lasts without a heartbeat.
    pub lease: Duration,
    /// Hash of the payload; `None` disables the conflict check for this claim.
    pub payload_hash: Option<PayloadHash>,
    /// Who claims (kept for audit and `list_stuck`). Shared: a batch's claims carry one
    /// worker id.
    pub worker: Option<Arc<str>>,
    /// The token to acquire with, chosen by the caller so a retried claim is idempotent: a
    /// claim whose reply was lost (it committed, then the connection died) is answered, on
    /// retry with the same token, with the lease it already holds instead of `InFlight`
    /// against itself. `None`: the store picks a random one. Tokens must be unique per
    /// acquisition: use [`FencingToken::random`].
    pub token: Option<FencingToken>,
    /// How many times the broker has delivered this message, this delivery included, when
    /// it counts (the envelope's `delivery_count`). A store that keeps no record per claim
    /// (the unique index) counts attempts from it; stores with records ignore it.
    pub deliveries: Option<u32>,
}

impl ClaimRequest {
    /// A claim with a lease and no payload check.
    pub fn new(key: DedupKey, lease: Duration) -> Self {
        Self {
            key,
            lease,
            payload_hash: None,
            worker: None,
            token: None,
            deliveries: None,
        }
    }
    /// Adds the broker's delivery count (see [`ClaimRequest::deliveries`]).
    pub fn with_deliveries(mut self, n: u32) -> Self {
        self.deliveries = Some(n);
        self
    }
    /// Claims with a caller-chosen token (idempotent retries; see [`ClaimRequest::token`]).
    pub fn with_token(mut self, t: FencingToken) -> Self {
        self.token = Some(t);
        self
    }
    /// Adds the payload hash.
    pub fn with_payload_hash(mut self, h: PayloadHash) -> Self {
        self.payload_hash = Some(h);
        self
    }
    /// Adds the worker id.
    pub fn with_worker(mut self, w: impl Into<Arc<str>>) -> Self {
        self.worker = Some(w.into());
        self
    }
}

/// An acquired lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    /// Proof of ownership for `complete`, `release` and `extend`.
    pub token: FencingToken,
    /// When the lease ends unless extended.
    pub until_ms: i64,
    /// 1 for the first acquisition of this lifecycle, one more after each release of a run
    /// and each takeover (a release without a run, `release_unrun`, takes its count back).
    pub attempt: u32,
    /// True when an expired lease of another worker was taken over (crash recovery).
    pub takeover: bool,
}

/// The answer to a claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimOutcome {
    /// The caller owns the key.
    Acquired(Lease),
    /// Completed before; skip and ack.
    Duplicate(DedupRecord),
    /// Another worker holds a live lease until `until_ms`: do not ack, redeliver later.
    InFlight {
        /// End of the other worker's lease.
        until_ms: i64,
    },
    /// The key is known with a different payload hash.
    PayloadConflict(DedupRecord),
    /// The key's operation was given up for good ([`DedupStore::roll_back`]: its
    /// transactional message was dropped) and its retention has not ended: do not apply the
    /// effect. The engine dead-letters a delivery that meets it.
    RolledBack(DedupRecord),
}

/// The answer to `complete`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompleteOutcome {
    /// Durable: the key is done.
    Completed,
    /// This token had completed the key already; nothing changed. After the engine's own
    /// completion it is as good as [`CompleteOutcome::Completed`] (a retried call whose
    /// first reply was lost). Inside a caller's transaction it means **the effect was
    /// committed before** — by a transaction whose reply never arrived — so this
    /// transaction repeats it: roll it back and settle the message as done.
    AlreadyCompleted,
    /// The token no longer owns the key (lease taken over, released, or purged).
    Fenced,
    /// Only in the answer to a batch call split over several stores (a layered store's
    /// primary and fallback) when the part holding this item failed while the others
    /// answered: its state is not known, as after an error. Retry it. A call whose every
    /// part failed returns the error instead.
    Unknown,
}

impl CompleteOutcome {
    /// Whether the key is durably completed by this token (now or before).
    pub fn is_done(self) -> bool {
        matches!(
            self,
            CompleteOutcome::Completed | CompleteOutcome::AlreadyCompleted
        )
    }
}

/// The answer to `release`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReleaseOutcome {
    /// The key can be claimed again.
    Released,
    /// The token no longer owns the key; nothing changed.
    Fenced,
}

/// The answer to [`DedupStore::roll_back`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RollbackOutcome {
    /// The key is recorded as rolled back (now, or by this token before: a retried call
    /// whose first reply was lost).
    RolledBack,
    /// The token no longer owns the key; nothing changed.
    Fenced,
}

/// The answer to `extend`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExtendOutcome {
    /// The lease now ends at `until_ms`.
    Extended {
        /// New end of the lease.
        until_ms: i64,
    },
    /// The token no longer owns the key.
    Fenced,
    /// Only in a batch answer: the part of the call holding this lease failed while the
    /// others answered (see [`CompleteOutcome::Unknown`]). The lease keeps its last known end.
    Unknown,
}

/// A completion, for [`DedupStore::complete_batch`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// The key.
    pub key: DedupKey,
    /// The token from `Acquired`.
    pub token: FencingToken,
    /// The result to replay to duplicates.
    pub result: Option<Bytes>,
    /// How long duplicates are recognised.
    pub retention: Duration,
}

/// A store failure. Every variant means "not durable": never ack on it.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The store cannot be reached or timed out: back off and retry.
    #[error("dedup store unavailable: {0}")]
    Unavailable(String),
    /// The store answered with an error that retrying will not fix as is.
    #[error("dedup store error: {0}")]
    Backend(String),
    /// A stored record could not be read back.
    #[error("dedup store holds a malformed record for `{key}`: {reason}")]
    Corrupt {
        /// The key.
        key: String,
        /// What was wrong.
        reason: String,
    },
    /// The store is misconfigured (bad table name, key prefix, URL...).
    #[error("dedup store misconfigured: {0}")]
    Config(String),
    /// A key longer than the store accepts.
    #[error("dedup key of {len} bytes exceeds the store's {max}-byte limit")]
    KeyTooLong {
        /// Length in bytes.
        len: usize,
        /// Limit in bytes.
        max: usize,
    },
}

impl StoreError {
    /// Whether retrying the same call later may succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(self, StoreError::Unavailable(_))
    }
}

/// Where a store's claim of a key happens, which decides how the engine runs a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ClaimMode {
    /// Claimed with a lease before the handler runs and completed after it: a dedup record
    /// with states, for any effect (a database row, an HTTP call, a publish). The default.
    #[default]
    Lease,
    /// The claim is the key's insert in the effect's own transaction (the unique-index
    /// strategy): the handler's transaction claims, applies and completes in one commit,
    /// and reports keys that were already there with [`ClaimedMessage::mark_duplicate`].
    /// The store's `claim_batch` only hands the keys out (no round trip, no lease to keep);
    /// only a handler that says it claims in its transaction
    /// ([`Handler::claims_in_transaction`]) may run over such a store: the engine refuses
    /// any other at start-up, since nothing else would record the key.
    ///
    /// [`ClaimedMessage::mark_duplicate`]: crate::ClaimedMessage::mark_duplicate
    /// [`Handler::claims_in_transaction`]: crate::Handler::claims_in_transaction
    InEffectTransaction,
}

/// The contract every dedup store implements (memory, SQL, Redis, layered).
///
/// Object safe: engines hold an `Arc<dyn DedupStore>`. Batch variants make one round trip
/// for many keys and must answer exactly what the single calls would.
#[async_trait]
pub trait DedupStore: Send + Sync + 'static {
    /// Where this store's claims happen ([`ClaimMode::Lease`] unless it says otherwise).
    fn claim_mode(&self) -> ClaimMode {
        ClaimMode::Lease
    }

    /// Claims many keys in one round trip. Keys must be distinct; the answer is in order.
    async fn claim_batch(&self, reqs: &[ClaimRequest]) -> Result<Vec<ClaimOutcome>, StoreError>;

    /// Claims one key.
    async fn claim(&self, req: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let mut v = self.claim_batch(std::slice::from_ref(req)).await?;
        v.pop()
            .ok_or_else(|| StoreError::Backend("claim_batch returned no outcome".into()))
    }

    /// Completes many keys in one round trip; the answer is in order.
    async fn complete_batch(
        &self,
        items: &[Completion],
    ) -> Result<Vec<CompleteOutcome>, StoreError>;

    /// Marks the key done if `token` still owns it, storing `result` for `retention`.
    async fn complete(
        &self,
        key: &DedupKey,
        token: FencingToken,
        result: Option<Bytes>,
        retention: Duration,
    ) -> Result<CompleteOutcome, StoreError> {
        let item = Completion {
            key: key.clone(),
            token,
            result,
            retention,
        };
        let mut v = self.complete_batch(std::slice::from_ref(&item)).await?;
        v.pop()
            .ok_or_else(|| StoreError::Backend("complete_batch returned no outcome".into()))
    }

    /// Gives the key back after a failure so a redelivery can retry at once.
    async fn release(
        &self,
        key: &DedupKey,
        token: FencingToken,
    ) -> Result<ReleaseOutcome, StoreError>;

    /// Gives the key back, as [`release`](Self::release) does, when its handler did **not**
    /// run: it was held behind a failing message of its lane, its claim was answered too
    /// late, or its delivery went stale. The attempt this claim counted is taken back, so a
    /// message's attempts count runs of its handler, not claims, and a message released
    /// unrun can never use up its retry budget. The default releases and keeps the count;
    /// every store of this workspace takes it back.
    async fn release_unrun(
        &self,
        key: &DedupKey,
        token: FencingToken,
    ) -> Result<ReleaseOutcome, StoreError> {
        self.release(key, token).await
    }

    /// Records the key as rolled back if `token` still owns it: the operation is given up
    /// for good, and every claim until `retention` ends is answered
    /// [`ClaimOutcome::RolledBack`]. For a check-back that drops a transactional message: a
    /// claim granted to it proves the local transaction cannot commit *now* (its holder is
    /// fenced, or it never claimed), and this record keeps a late local transaction from
    /// claiming the key afterwards and applying an effect whose message was dropped.
    /// Idempotent for the token (a repeat answers `RolledBack`).
    ///
    /// The default refuses ([`StoreError::Config`]): a store that cannot keep the state must
    /// not be used to drop messages. Every store of this workspace keeps it.
    async fn roll_back(
        &self,
        key: &DedupKey,
        token: FencingToken,
        retention: Duration,
    ) -> Result<RollbackOutcome, StoreError> {
        let _ = (key, token, retention);
        Err(StoreError::Config(
            "this store cannot record a rolled-back key".into(),
        ))
    }

    /// Extends the lease (heartbeat for long handlers).
    async fn extend(
        &self,
        key: &DedupKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<ExtendOutcome, StoreError>;

    /// Extends many leases (one heartbeat of a batch); one outcome per lease, in order.
    /// The default extends one at a time; stores that can should answer in one round trip.
    async fn extend_batch(
        &self,
        leases: &[(DedupKey, FencingToken)],
        lease: Duration,
    ) -> Result<Vec<ExtendOutcome>, StoreError> {
        let mut out = Vec::with_capacity(leases.len());
        for (key, token) in leases {
            out.push(self.extend(key, *token, lease).await?);
        }
        Ok(out)
    }

    /// Reads a record (operations, tests).
    async fn get(&self, key: &DedupKey) -> Result<Option<DedupRecord>, StoreError>;

    /// Deletes up to `limit` completed records whose retention has ended; returns how many.
    async fn purge_expired(&self, limit: usize) -> Result<u64, StoreError>;

    /// In-progress records whose lease has ended at least `stale_for` ago: work that was
    /// abandoned and never redelivered. Oldest first, at most `limit`.
    async fn list_stuck(
        &self,
        stale_for: Duration,
        limit: usize,
    ) -> Result<Vec<DedupRecord>, StoreError>;

    /// Deletes a record by hand, whatever its state (operations). Returns whether it existed.
    async fn forget(&self, key: &DedupKey) -> Result<bool, StoreError>;

    /// Counts the records by state, on the store's clock (operations: `idemq store stats`).
    /// A full scan on most stores: for operators and dashboards, not the message path. The
    /// default answers [`StoreError::Config`] for stores that cannot count; every store of
    /// idemq does.
    async fn stats(&self) -> Result<StoreStats, StoreError> {
        Err(StoreError::Config(
            "this store does not report stats".into(),
        ))
    }
}

/// The records of a store by state (see [`DedupStore::stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StoreStats {
    /// In progress with a live lease: being handled now.
    pub in_progress: u64,
    /// In progress with an ended lease (crashed or released work): the next delivery takes
    /// it over; `list_stuck` lists them.
    pub abandoned: u64,
    /// Completed, within retention: duplicates are acked without running.
    pub completed: u64,
    /// Completed or rolled back, past retention: `purge_expired` deletes them; a copy
    /// arriving now runs.
    pub expired: u64,
    /// Rolled back, within retention: claims are refused.
    pub rolled_back: u64,
}

impl StoreStats {
    /// Counts one record as of `now_ms` (the store's clock).
    pub fn count(&mut self, r: &DedupRecord, now_ms: i64) {
        match r.status {
            RecordStatus::InProgress if r.lease_until_ms > now_ms => self.in_progress += 1,
            RecordStatus::InProgress => self.abandoned += 1,
            RecordStatus::Completed if r.expires_ms.is_some_and(|e| e <= now_ms) => {
                self.expired += 1
            }
            RecordStatus::Completed => self.completed += 1,
            RecordStatus::RolledBack if r.expires_ms.is_some_and(|e| e <= now_ms) => {
                self.expired += 1
            }
            RecordStatus::RolledBack => self.rolled_back += 1,
        }
    }
    /// All records.
    pub fn total(&self) -> u64 {
        self.in_progress + self.abandoned + self.completed + self.expired + self.rolled_back
    }
}

/// What a store should do with a claim, given the record it holds.
///
/// Every store calls this (directly, or after its atomic insert-or-takeover failed and it read
/// the row back), so the rules live in one place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimVerdict {
    /// No record, or a completed one past retention: start a new lifecycle (attempt 1).
    AcquireFresh,
    /// An in-progress record whose lease ended: take it over (attempt + 1).
    TakeOver,
    /// Answer without writing.
    Answer(ClaimOutcome),
}

/// What a claim that acquires writes: the lease it answers and the in-progress record.
/// `taken_over` is the record whose ended lease it takes over (the verdict was
/// [`ClaimVerdict::TakeOver`]): its attempts go on and its first-seen time stays; without one
/// a new lifecycle starts at `now` with attempt 1.
///
/// ```
/// use idemq_core::{acquired_record, ClaimRequest, ConsumerGroup, DedupKey, FencingToken};
/// use std::time::Duration;
/// let key = DedupKey::new(&ConsumerGroup::new("g").unwrap(), "pay-1").unwrap();
/// let req = ClaimRequest::new(key, Duration::from_secs(30));
/// let (first, record) = acquired_record(&req, None, FencingToken(7), 1_000);
/// assert_eq!((first.attempt, first.until_ms, first.takeover), (1, 31_000, false));
/// let (again, _) = acquired_record(&req, Some(&record), FencingToken(8), 40_000);
/// assert_eq!((again.attempt, again.takeover), (2, true));
/// ```
pub fn acquired_record(
    req: &ClaimRequest,
    taken_over: Option<&DedupRecord>,
    token: FencingToken,
    now: i64,
) -> (Lease, DedupRecord) {
    let (attempt, first_seen, takeover) = match taken_over {
        Some(r) => (
            r.attempts.saturating_add(1),
            r.first_seen_ms,
            r.lease_until_ms > 0,
        ),
        None => (1, now, false),
    };
    let lease = Lease {
        token,
        until_ms: now.saturating_add(duration_ms(req.lease)),
        attempt,
        takeover,
    };
    let record = DedupRecord {
        key: req.key.clone(),
        status: RecordStatus::InProgress,
        token,
        lease_until_ms: lease.until_ms,
        attempts: attempt,
        payload_hash: req.payload_hash,
        result: None,
        first_seen_ms: first_seen,
        completed_ms: None,
        expires_ms: None,
        worker: req.worker.clone(),
    };
    (lease, record)
}

/// Applies the claim rules to an existing record.
pub fn evaluate_claim(
    existing: Option<&DedupRecord>,
    payload_hash: Option<&PayloadHash>,
    now: i64,
) -> ClaimVerdict {
    let Some(rec) = existing else {
        return ClaimVerdict::AcquireFresh;
    };
    if rec.is_retention_expired(now) {
        return ClaimVerdict::AcquireFresh;
    }
    // An ended lease (crash or release) is taken over whatever payload it had: a corrected
    // resend after a failure must not be stuck behind the failed one's hash.
    if rec.is_lease_expired(now) {
        return ClaimVerdict::TakeOver;
    }
    // Given up whatever its payload: no claim may apply the effect of a dropped message.
    if rec.status == RecordStatus::RolledBack {
        return ClaimVerdict::Answer(ClaimOutcome::RolledBack(rec.clone()));
    }
    if let (Some(stored), Some(given)) = (rec.payload_hash.as_ref(), payload_hash) {
        if stored != given {
            return ClaimVerdict::Answer(ClaimOutcome::PayloadConflict(rec.clone()));
        }
    }
    match rec.status {
        RecordStatus::Completed => ClaimVerdict::Answer(ClaimOutcome::Duplicate(rec.clone())),
        RecordStatus::RolledBack => ClaimVerdict::Answer(ClaimOutcome::RolledBack(rec.clone())),
        RecordStatus::InProgress => ClaimVerdict::Answer(ClaimOutcome::InFlight {
            until_ms: rec.lease_until_ms,
        }),
    }
}

/// [`evaluate_claim`] for a request: a live lease already held under the request's own
/// token (a retried claim whose first reply was lost) is answered `Acquired` with that lease.
pub fn evaluate_claim_request(
    existing: Option<&DedupRecord>,
    req: &ClaimRequest,
    now: i64,
) -> ClaimVerdict {
    if let (Some(rec), Some(token)) = (existing, req.token) {
        if rec.is_held_by(token) && rec.lease_until_ms > now {
            return ClaimVerdict::Answer(ClaimOutcome::Acquired(Lease {
                token,
                until_ms: rec.lease_until_ms,
                attempt: rec.attempts,
                takeover: false,
            }));
        }
    }
    evaluate_claim(existing, req.payload_hash.as_ref(), now)
}

/// Rejects batches that name a key twice (the answer for the second would depend on order)
/// and caller-chosen tokens out of `1..=i64::MAX` (a store could not keep or parse them).
/// Every store calls it first in `claim_batch`.
pub fn check_distinct_keys(reqs: &[ClaimRequest]) -> Result<(), StoreError> {
    // Every claim of every store pays for this check: a fast seeded hasher, not SipHash.
    let mut seen: std::collections::HashSet<&str, foldhash::fast::RandomState> =
        std::collections::HashSet::with_capacity_and_hasher(reqs.len(), Default::default());
    for r in reqs {
        if let Some(t) = r.token {
            if !t.is_valid() {
                return Err(StoreError::Backend(format!(
                    "claim of `{}` with fencing token {} out of range: tokens are 1..=i64::MAX; use FencingToken::random()",
                    r.key, t.0
                )));
            }
        }
        if !seen.insert(r.key.as_str()) {
            return Err(StoreError::Backend(format!(
                "claim_batch got key `{}` twice; dedup the batch first",
                r.key
            )));
        }
    }
    Ok(())
}
