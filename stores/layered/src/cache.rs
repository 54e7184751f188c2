//! The cache of completed keys: a fixed-size table of 128-bit key fingerprints.
//!
//! # Layout
//!
//! The table is allocated once, when the store is built, for the configured capacity: about
//! [`BYTES_PER_SLOT`] bytes per slot and `capacity / LOAD` slots, so about 53 bytes per
//! key of capacity, whatever is cached. Slots come in groups of [`WAYS`], each in two
//! cache-line-aligned parts of 192 bytes: what a duplicate check reads, and what only an
//! answer's record needs. A key may live in either of two groups chosen by its
//! fingerprint, and goes into the first while that has some room (so a check usually
//! reads one group). A slot holds the key's fingerprint, the instant its entry stops being
//! answered (its deadline, in milliseconds of this process's monotonic clock), and what a
//! `Duplicate` answer needs: the completing token, the attempts, the worker (interned), a
//! tag of the payload hash, and the completion and expiry times to the second. A
//! completion with a stored result (or anything else that does not fit a slot) keeps its
//! whole record in a side map, found through its slot.
//!
//! A duplicate check hashes the key once (SipHash-1-3, 128-bit, keyed at random per cache),
//! reads its groups and the clock: no allocation, no lock, no write to shared memory. A
//! batch of checks (a claim batch) reads the clock once, after its lookups, and fetches the
//! groups of the keys a few places ahead while it looks up the current one. Expiry
//! is lazy: a slot whose deadline has passed is never answered and is free for the next
//! insert into its group. When both groups of a key are full of live entries, one entry
//! moves to its other group if that one has room, otherwise the entry closest to its
//! deadline is dropped (a cache may forget; it must never invent).
//!
//! # Fingerprint collisions
//!
//! The table keeps no key text, so a fresh key would be answered `Duplicate` (its message
//! skipped) if its fingerprint equalled that of a cached key. The fingerprint is the
//! 128-bit output of SipHash-1-3 under a random 128-bit key drawn when the cache is built:
//! a pseudo-random function, so producers cannot choose keys that collide, and any two
//! distinct keys share a fingerprint with probability 2⁻¹²⁸. A lookup compares against at
//! most the `S` live slots of the table, so `L` lookups of fresh keys answer wrongly with
//! probability at most `L·S·2⁻¹²⁸`: for 10¹⁵ lookups (a million a second for 30 years)
//! against 10⁸ slots, below 3·10⁻¹⁶. Entries with a side record are checked against the
//! full key besides.
//!
//! The payload hash is kept as a 64-bit tag (another keyed SipHash-1-3). A different tag
//! proves a different payload, and the claim goes to the authoritative store (which
//! answers `PayloadConflict` with the full record). Equal tags for different payload hashes
//! happen with probability 2⁻⁶⁴ per such claim; the key was completed either way, and the
//! message is then acked as a duplicate instead of dead-lettered as a conflict.
//!
//! # Concurrency
//!
//! Each group is guarded by a sequence lock: a writer makes its version odd (compare and
//! swap), writes, and makes it even again; a reader copies what it needs between two reads
//! of the version and retries if it changed. Inserts and removals hold both groups of their
//! key (taken in index order), so a removal cannot pass an insert of the same key.

use idemq_core::{ClaimOutcome, DedupKey, DedupRecord, FencingToken, PayloadHash, RecordStatus};
use siphasher::sip128::{Hasher128, SipHasher13};
use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{fence, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::{Duration, Instant};

/// Slots per group.
pub(crate) const WAYS: usize = 8;
/// The load of a full table: it has `capacity / LOAD` slots.
pub(crate) const LOAD: f64 = 0.9;
/// Bytes of table per slot.
pub(crate) const BYTES_PER_SLOT: usize =
    (std::mem::size_of::<Hot>() + std::mem::size_of::<Cold>()) / WAYS;

/// A key goes to its first group while that has this many free slots; after that, to
/// the emptier of its two. At the table's full load, about 82 % of the keys are then in
/// their first group, and fewer than one insert in a million has to drop an entry.
const FIRST_GROUP_SLACK: usize = 3;
/// Worker references: 0 = none, 1..=[`MAX_WORKERS`] = interned name, [`SIDE`] = the
/// slot's record is in the side map.
const MAX_WORKERS: usize = 254;
const SIDE: u8 = 255;
/// Deadlines are milliseconds since the cache was built, in 40 bits (34 years).
const DEADLINE_MAX: u64 = (1 << 40) - 1;
/// How many keys ahead a batch of lookups prefetches groups.
const LOOKAHEAD: usize = 8;
/// A reader retries a group being written this many times, then answers "not cached".
const READ_RETRIES: usize = 64;
const SIDE_SHARDS: usize = 16;

/// The part of a group of [`WAYS`] slots that a duplicate check reads: 192 bytes (three
/// cache lines).
#[derive(Default)]
#[repr(C, align(64))]
struct Hot {
    /// `[0]`: the version (odd while written). `[1..5]`: low 32 bits of each slot's
    /// deadline, two per word. `[5]`: high 8 bits of each deadline. `[6]`: attempts.
    /// `[7]`: worker references. A deadline of 0 is an empty slot.
    head: [AtomicU64; 8],
    /// Slot `i`'s fingerprint is `(fp[2i], fp[2i + 1])`.
    fp: [AtomicU64; 2 * WAYS],
}

/// The rest of a group, read only to build a `Duplicate` answer: 192 bytes, in a table of
/// its own so that duplicate checks touch half the memory.
#[derive(Default)]
#[repr(C, align(64))]
struct Cold {
    /// The completing token.
    token: [AtomicU64; WAYS],
    /// The payload-hash tag, 0 without a payload hash.
    pay: [AtomicU64; WAYS],
    /// Completion (low 32 bits) and expiry (high 32 bits), seconds since the Unix epoch.
    times: [AtomicU64; WAYS],
}

/// One group of [`WAYS`] slots; its [`Hot`] version guards both parts.
#[derive(Clone, Copy)]
struct Group<'a> {
    hot: &'a Hot,
    cold: &'a Cold,
}

#[inline]
fn byte(w: u64, i: usize) -> u8 {
    (w >> (8 * i)) as u8
}

#[inline]
fn with_byte(w: u64, i: usize, v: u8) -> u64 {
    (w & !(0xff << (8 * i))) | (u64::from(v) << (8 * i))
}

impl<'a> Group<'a> {
    #[inline]
    fn deadline(self, i: usize) -> u64 {
        let lo = (self.hot.head[1 + i / 2].load(Ordering::Relaxed) >> (32 * (i % 2))) & 0xffff_ffff;
        let hi = u64::from(byte(self.hot.head[5].load(Ordering::Relaxed), i));
        (hi << 32) | lo
    }

    /// Writer only (the group is held).
    fn set_deadline(self, i: usize, d: u64) {
        let w = &self.hot.head[1 + i / 2];
        let shift = 32 * (i % 2);
        let lo =
            (w.load(Ordering::Relaxed) & !(0xffff_ffff << shift)) | ((d & 0xffff_ffff) << shift);
        w.store(lo, Ordering::Relaxed);
        let h = &self.hot.head[5];
        h.store(
            with_byte(h.load(Ordering::Relaxed), i, (d >> 32) as u8),
            Ordering::Relaxed,
        );
    }

    /// Writer only.
    fn set_byte(self, word: usize, i: usize, v: u8) {
        let w = &self.hot.head[word];
        w.store(
            with_byte(w.load(Ordering::Relaxed), i, v),
            Ordering::Relaxed,
        );
    }

    #[inline]
    fn fp(self, i: usize) -> (u64, u64) {
        (
            self.hot.fp[2 * i].load(Ordering::Relaxed),
            self.hot.fp[2 * i + 1].load(Ordering::Relaxed),
        )
    }

    /// The slot holding fingerprint `(a, b)` (live or not). Readers check the version.
    #[inline]
    fn find(self, a: u64, b: u64) -> Option<usize> {
        (0..WAYS).find(|&i| {
            self.hot.fp[2 * i].load(Ordering::Relaxed) == a
                && self.hot.fp[2 * i + 1].load(Ordering::Relaxed) == b
                && self.deadline(i) != 0
        })
    }

    fn snapshot(self, i: usize) -> Slot {
        Slot {
            deadline: self.deadline(i),
            attempts: byte(self.hot.head[6].load(Ordering::Relaxed), i),
            worker: byte(self.hot.head[7].load(Ordering::Relaxed), i),
            token: self.cold.token[i].load(Ordering::Relaxed),
            pay: self.cold.pay[i].load(Ordering::Relaxed),
            times: self.cold.times[i].load(Ordering::Relaxed),
        }
    }

    /// Writer only.
    fn write(self, i: usize, (a, b): (u64, u64), s: &Slot) {
        self.hot.fp[2 * i].store(a, Ordering::Relaxed);
        self.hot.fp[2 * i + 1].store(b, Ordering::Relaxed);
        self.set_deadline(i, s.deadline);
        self.set_byte(6, i, s.attempts);
        self.set_byte(7, i, s.worker);
        self.cold.token[i].store(s.token, Ordering::Relaxed);
        self.cold.pay[i].store(s.pay, Ordering::Relaxed);
        self.cold.times[i].store(s.times, Ordering::Relaxed);
    }

    /// Writer only: empties slot `i`.
    fn clear(self, i: usize) {
        self.set_deadline(i, 0);
        self.set_byte(7, i, 0);
    }

    /// Holds the group for writing (spins, then yields: writers hold it for nanoseconds).
    fn lock(self) -> Held<'a> {
        let mut spins = 0u32;
        loop {
            if let Some(h) = self.try_lock() {
                return h;
            }
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }

    fn try_lock(self) -> Option<Held<'a>> {
        let v = self.hot.head[0].load(Ordering::Relaxed);
        if v & 1 == 1 {
            return None;
        }
        self.hot.head[0]
            .compare_exchange(v, v + 1, Ordering::Acquire, Ordering::Relaxed)
            .ok()?;
        // Readers that see any of the writes below also see the odd version.
        fence(Ordering::Release);
        Some(Held {
            g: self.hot,
            v: v + 2,
        })
    }
}

/// A group held for writing; dropping it publishes the writes.
struct Held<'a> {
    g: &'a Hot,
    v: u64,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.g.head[0].store(self.v, Ordering::Release);
    }
}

/// One slot's contents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Slot {
    deadline: u64,
    attempts: u8,
    worker: u8,
    token: u64,
    pay: u64,
    times: u64,
}

/// The cache of completed records.
pub(crate) struct CompletedCache {
    hot: Box<[Hot]>,
    cold: Box<[Cold]>,
    /// Fingerprint key, payload-tag key.
    keys: [(u64, u64); 2],
    origin: Instant,
    max_ttl: Duration,
    workers: Box<[OnceLock<Arc<str>>]>,
    worker_count: AtomicUsize,
    intern: Mutex<()>,
    side: Box<[RwLock<SideShard>]>,
}

/// Whole records of completions that do not fit a slot, by fingerprint.
type SideShard = HashMap<u128, Arc<DedupRecord>>;

/// Why a cache could not be built.
#[derive(Debug)]
pub(crate) struct TooLarge {
    pub(crate) bytes: u128,
}

impl CompletedCache {
    /// A table for about `capacity` keys (at least two groups), entries answered for at
    /// most `max_ttl`. Fails when the table cannot be allocated.
    pub(crate) fn new(capacity: u64, max_ttl: Duration) -> Result<Self, TooLarge> {
        let slots = (capacity as f64 / LOAD).ceil();
        let n = ((slots / WAYS as f64).ceil() as u128).max(2);
        let too_large = || TooLarge {
            bytes: n * (std::mem::size_of::<Hot>() + std::mem::size_of::<Cold>()) as u128,
        };
        let n = usize::try_from(n).map_err(|_| too_large())?;
        let mut hot: Vec<Hot> = Vec::new();
        hot.try_reserve_exact(n).map_err(|_| too_large())?;
        hot.resize_with(n, Hot::default);
        let mut cold: Vec<Cold> = Vec::new();
        cold.try_reserve_exact(n).map_err(|_| too_large())?;
        cold.resize_with(n, Cold::default);
        let seed = std::hash::RandomState::new();
        let r = |i: u64| seed.hash_one(i);
        Ok(Self {
            hot: hot.into_boxed_slice(),
            cold: cold.into_boxed_slice(),
            keys: [(r(0), r(1)), (r(2), r(3))],
            origin: Instant::now(),
            max_ttl,
            workers: (0..MAX_WORKERS).map(|_| OnceLock::new()).collect(),
            worker_count: AtomicUsize::new(0),
            intern: Mutex::new(()),
            side: (0..SIDE_SHARDS)
                .map(|_| RwLock::new(HashMap::new()))
                .collect(),
        })
    }

    #[inline]
    fn group(&self, i: usize) -> Group<'_> {
        Group {
            hot: &self.hot[i],
            cold: &self.cold[i],
        }
    }

    /// Slots in the table (live or not).
    pub(crate) fn slots(&self) -> usize {
        self.hot.len() * WAYS
    }

    /// Bytes of the table (side records not included).
    pub(crate) fn table_bytes(&self) -> usize {
        self.slots() * BYTES_PER_SLOT
    }

    #[inline]
    fn fingerprint(&self, key: &DedupKey) -> (u64, u64) {
        let (k0, k1) = self.keys[0];
        let mut h = SipHasher13::new_with_keys(k0, k1);
        h.write(key.as_str().as_bytes());
        let x = h.finish128();
        (x.h1, x.h2)
    }

    fn pay_tag(&self, p: Option<&PayloadHash>) -> u64 {
        let Some(p) = p else { return 0 };
        let (k0, k1) = self.keys[1];
        let mut h = siphasher::sip::SipHasher13::new_with_keys(k0, k1);
        h.write(&p.0);
        h.finish().max(1)
    }

    /// The two groups a fingerprint may live in.
    #[inline]
    fn groups_of(&self, (a, b): (u64, u64)) -> (usize, usize) {
        let n = self.hot.len();
        let g1 = ((u128::from(a) * n as u128) >> 64) as usize;
        let mut g2 = ((u128::from(b) * n as u128) >> 64) as usize;
        if g2 == g1 {
            g2 = if g1 + 1 == n { 0 } else { g1 + 1 };
        }
        (g1, g2)
    }

    /// Milliseconds since the cache was built.
    #[inline]
    fn now(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Reads fingerprint `fp` in group `g` consistently: what `take` copies out of its
    /// slot, `None` when absent.
    #[inline]
    fn read<T>(
        &self,
        g: Group<'_>,
        (a, b): (u64, u64),
        take: impl Fn(Group<'_>, usize) -> T,
    ) -> Option<T> {
        for _ in 0..READ_RETRIES {
            let v = g.hot.head[0].load(Ordering::Acquire);
            if v & 1 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let found = g.find(a, b).map(|i| take(g, i));
            fence(Ordering::Acquire);
            if g.hot.head[0].load(Ordering::Relaxed) == v {
                return found;
            }
        }
        // Written all along: answer "not cached", which only costs a round trip.
        None
    }

    /// What `take` copies out of the live slot of fingerprint `fp`, if any. `take` also
    /// returns the slot's deadline. Only the lines `take` reads are touched: a duplicate
    /// check reads a group's head and fingerprints, not the rest of its slots.
    #[inline]
    fn lookup<T>(
        &self,
        fp: (u64, u64),
        take: impl Fn(Group<'_>, usize) -> (u64, T) + Copy,
    ) -> Option<T> {
        let (deadline, found) = self.lookup_any(fp, take)?;
        (self.now() < deadline).then_some(found)
    }

    /// [`CompletedCache::lookup`] without the deadline check: the slot's deadline and what
    /// `take` copied, live or not. The caller compares the deadline with a clock read
    /// after the lookup.
    #[inline]
    fn lookup_any<T>(
        &self,
        fp: (u64, u64),
        take: impl Fn(Group<'_>, usize) -> (u64, T) + Copy,
    ) -> Option<(u64, T)> {
        let (g1, g2) = self.groups_of(fp);
        self.read(self.group(g1), fp, take)
            .or_else(|| self.read(self.group(g2), fp, take))
    }

    /// [`CompletedCache::lookup_any`] of every fingerprint, in order, with the first group
    /// of the fingerprint [`LOOKAHEAD`] places ahead fetched into the processor's cache
    /// meanwhile: at a million keys the table is far larger than the cache, and a lookup
    /// otherwise waits for its group's lines one key after another.
    fn lookups_ahead<T>(
        &self,
        fps: &[(u64, u64)],
        take: impl Fn(Group<'_>, usize) -> (u64, T) + Copy,
    ) -> Vec<Option<(u64, T)>> {
        for fp in fps.iter().take(LOOKAHEAD) {
            self.prefetch_first_group(*fp);
        }
        fps.iter()
            .enumerate()
            .map(|(i, fp)| {
                if let Some(ahead) = fps.get(i + LOOKAHEAD) {
                    self.prefetch_first_group(*ahead);
                }
                self.lookup_any(*fp, take)
            })
            .collect()
    }

    /// Asks the processor to fetch the lines of the fingerprint's first group (a hint: no
    /// effect on what any read returns).
    #[inline]
    fn prefetch_first_group(&self, fp: (u64, u64)) {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            let hot: *const Hot = &self.hot[self.groups_of(fp).0];
            for line in 0..std::mem::size_of::<Hot>() / 64 {
                // SAFETY: a prefetch never faults and changes nothing a read returns, for
                // any address; here it is inside `self.hot`. SSE is in every x86_64
                // processor (the target's baseline).
                unsafe { _mm_prefetch::<_MM_HINT_T0>(hot.cast::<i8>().wrapping_add(64 * line)) };
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = fp;
    }

    /// Whether each of `keys` is cached as completed, in order: [`CompletedCache::contains`]
    /// for a batch, with one clock read for the whole batch, taken after every lookup (so
    /// an entry is answered only if still live when the batch's answer is given). On these
    /// VMs the clock read serialises the processor: one per key cost a quarter of a check
    /// and kept the table's cache misses of consecutive keys from overlapping.
    pub(crate) fn contains_batch(&self, keys: &[DedupKey]) -> Vec<bool> {
        let worker = |g: Group<'_>, i: usize| {
            (
                g.deadline(i),
                byte(g.hot.head[7].load(Ordering::Relaxed), i),
            )
        };
        let fps: Vec<(u64, u64)> = keys.iter().map(|k| self.fingerprint(k)).collect();
        let found: Vec<Option<(u64, u8)>> = self.lookups_ahead(&fps, worker);
        let now = self.now();
        keys.iter()
            .zip(found)
            .map(|(k, f)| match f {
                Some((deadline, _)) if deadline <= now => false,
                None => false,
                Some((_, SIDE)) => self.side_record(self.fingerprint(k), k).is_some(),
                Some(_) => true,
            })
            .collect()
    }

    /// Whether `key` is cached as completed.
    #[inline]
    pub(crate) fn contains(&self, key: &DedupKey) -> bool {
        let fp = self.fingerprint(key);
        let worker = |g: Group<'_>, i: usize| {
            (
                g.deadline(i),
                byte(g.hot.head[7].load(Ordering::Relaxed), i),
            )
        };
        match self.lookup(fp, worker) {
            None => false,
            Some(SIDE) => self.side_record(fp, key).is_some(),
            Some(_) => true,
        }
    }

    fn side_record(&self, (a, b): (u64, u64), key: &DedupKey) -> Option<Arc<DedupRecord>> {
        let id = (u128::from(a) << 64) | u128::from(b);
        let shard = self.side[(b as usize) % SIDE_SHARDS].read().ok()?;
        shard.get(&id).filter(|r| r.key == *key).cloned()
    }

    /// What the cache can answer for a claim of `key`: `Duplicate` or `PayloadConflict`,
    /// or `None` ("ask the store").
    #[inline]
    pub(crate) fn answer(
        &self,
        key: &DedupKey,
        payload_hash: Option<&PayloadHash>,
    ) -> Option<ClaimOutcome> {
        let fp = self.fingerprint(key);
        let slot = self.lookup(fp, |g, i| {
            let s = g.snapshot(i);
            (s.deadline, s)
        })?;
        self.answer_from(key, fp, slot, payload_hash)
    }

    /// [`CompletedCache::answer`] for a batch of claims, in order, with one clock read for
    /// the whole batch taken after every lookup (see [`CompletedCache::contains_batch`]).
    pub(crate) fn answer_batch<'k>(
        &self,
        claims: impl ExactSizeIterator<Item = (&'k DedupKey, Option<&'k PayloadHash>)> + Clone,
    ) -> Vec<Option<ClaimOutcome>> {
        let fps: Vec<(u64, u64)> = claims
            .clone()
            .map(|(key, _)| self.fingerprint(key))
            .collect();
        let found = self.lookups_ahead(&fps, |g, i| {
            let s = g.snapshot(i);
            (s.deadline, s)
        });
        let now = self.now();
        claims
            .zip(fps)
            .zip(found)
            .map(|(((key, payload_hash), fp), slot)| {
                let slot = slot.filter(|(_, slot)| now < slot.deadline)?.1;
                self.answer_from(key, fp, slot, payload_hash)
            })
            .collect()
    }

    /// The answer for `key` from its live `slot`.
    fn answer_from(
        &self,
        key: &DedupKey,
        fp: (u64, u64),
        slot: Slot,
        payload_hash: Option<&PayloadHash>,
    ) -> Option<ClaimOutcome> {
        if slot.worker == SIDE {
            let rec = self.side_record(fp, key)?;
            return Some(match (rec.payload_hash.as_ref(), payload_hash) {
                (Some(stored), Some(given)) if stored != given => {
                    ClaimOutcome::PayloadConflict((*rec).clone())
                }
                _ => ClaimOutcome::Duplicate((*rec).clone()),
            });
        }
        let payload_hash = match (slot.pay, payload_hash) {
            (0, _) => None,
            // The record has a payload hash this slot does not keep.
            (_, None) => return None,
            // A different payload: the store answers the conflict with its record.
            (tag, Some(given)) if tag != self.pay_tag(Some(given)) => return None,
            (_, Some(given)) => Some(*given),
        };
        let completed_ms = (slot.times & 0xffff_ffff) as i64 * 1000;
        Some(ClaimOutcome::Duplicate(DedupRecord {
            key: key.clone(),
            status: RecordStatus::Completed,
            token: FencingToken(slot.token as i64),
            lease_until_ms: completed_ms,
            attempts: u32::from(slot.attempts),
            payload_hash,
            result: None,
            first_seen_ms: completed_ms,
            completed_ms: Some(completed_ms),
            expires_ms: Some((slot.times >> 32) as i64 * 1000),
            worker: match slot.worker {
                0 => None,
                w => self.workers[usize::from(w) - 1].get().cloned(),
            },
        }))
    }

    /// The reference of worker name `w`, interning it if there is room.
    fn worker_ref(&self, w: Option<&Arc<str>>) -> Option<u8> {
        let Some(w) = w else { return Some(0) };
        let known = |n: usize| (0..n).find(|&i| self.workers[i].get().is_some_and(|x| **x == **w));
        let n = self.worker_count.load(Ordering::Acquire);
        if let Some(i) = known(n) {
            return u8::try_from(i + 1).ok();
        }
        let _g = self.intern.lock().ok()?;
        let n = self.worker_count.load(Ordering::Acquire);
        if let Some(i) = known(n) {
            return u8::try_from(i + 1).ok();
        }
        if n >= MAX_WORKERS {
            return None;
        }
        self.workers[n].set(w.clone()).ok()?;
        self.worker_count.store(n + 1, Ordering::Release);
        u8::try_from(n + 1).ok()
    }

    /// A slot for `rec`, or `None` when it needs a side record.
    fn compact(&self, rec: &DedupRecord, deadline: u64) -> Option<Slot> {
        if rec.result.is_some() {
            return None;
        }
        let secs = |ms: Option<i64>| ms.and_then(|ms| u32::try_from(ms.div_euclid(1000)).ok());
        let (completed, expires) = (secs(rec.completed_ms)?, secs(rec.expires_ms)?);
        Some(Slot {
            deadline,
            attempts: u8::try_from(rec.attempts).ok()?,
            worker: self.worker_ref(rec.worker.as_ref())?,
            token: rec.token.0 as u64,
            pay: self.pay_tag(rec.payload_hash.as_ref()),
            times: u64::from(completed) | (u64::from(expires) << 32),
        })
    }

    /// Caches a completed record for `min(left, max_ttl)` if `still_valid()` says so,
    /// checked while both groups of the key are held: an [`CompletedCache::invalidate`]
    /// (which holds them too) that follows a change `still_valid` would see is ordered
    /// either before the check (which then fails) or after the insert (which it then
    /// undoes). Returns whether the record was cached.
    pub(crate) fn insert_if(
        &self,
        rec: &DedupRecord,
        left: Duration,
        still_valid: impl FnOnce() -> bool,
    ) -> bool {
        let ttl = u64::try_from(left.min(self.max_ttl).as_millis()).unwrap_or(u64::MAX);
        let deadline = self.now().saturating_add(ttl);
        if ttl == 0 || deadline > DEADLINE_MAX {
            return false;
        }
        let fp = self.fingerprint(&rec.key);
        let (slot, side) = match self.compact(rec, deadline) {
            Some(s) => (s, None),
            None => (
                Slot {
                    deadline,
                    attempts: 0,
                    worker: SIDE,
                    token: 0,
                    pay: 0,
                    times: 0,
                },
                Some(Arc::new(rec.clone())),
            ),
        };
        let (i1, i2) = self.groups_of(fp);
        let (_h1, _h2) = self.hold_both(i1, i2);
        if !still_valid() {
            return false;
        }
        #[cfg(test)]
        test_hook::before_insert();
        if let Some(r) = side {
            self.side_put(fp, r);
        }
        let (g1, g2) = (self.group(i1), self.group(i2));
        // The key's own slot, wherever it is.
        for g in [g1, g2] {
            if let Some(i) = g.find(fp.0, fp.1) {
                self.replace(g, i, fp, &slot);
                return true;
            }
        }
        let now = self.now();
        let free = |g: Group<'_>| (0..WAYS).filter(|&i| g.deadline(i) <= now).count();
        let (f1, f2) = (free(g1), free(g2));
        if f1 > 0 || f2 > 0 {
            // The first group while it has some room (so most keys are found in the first
            // group a check reads), the emptier one when it is nearly full (so a full table
            // seldom has to drop anything).
            let g = if f1 >= FIRST_GROUP_SLACK || f1 >= f2 {
                g1
            } else {
                g2
            };
            if let Some(i) = (0..WAYS).find(|&i| g.deadline(i) <= now) {
                self.replace(g, i, fp, &slot);
                return true;
            }
        }
        // Both full of live entries: move one to its other group, if that has room.
        for (g, gi) in [(g1, i1), (g2, i2)] {
            for i in 0..WAYS {
                let (a1, a2) = self.groups_of(g.fp(i));
                let alt = if a1 == gi { a2 } else { a1 };
                if alt == i1 || alt == i2 {
                    continue;
                }
                let ag = self.group(alt);
                let Some(_ha) = ag.try_lock() else { continue };
                if let Some(j) = (0..WAYS).find(|&j| ag.deadline(j) <= now) {
                    self.replace(ag, j, g.fp(i), &g.snapshot(i));
                    // The moved entry's side record (if any) stays under its fingerprint.
                    g.write(i, fp, &slot);
                    return true;
                }
            }
        }
        // Otherwise drop the entry closest to its deadline.
        let (g, i) = [g1, g2]
            .into_iter()
            .flat_map(|g| (0..WAYS).map(move |i| (g, i)))
            .min_by_key(|(g, i)| g.deadline(*i))
            .unwrap_or((g1, 0));
        self.replace(g, i, fp, &slot);
        true
    }

    /// Holds groups `a` and `b` (in index order, so two writers cannot deadlock).
    fn hold_both(&self, a: usize, b: usize) -> (Held<'_>, Option<Held<'_>>) {
        let (lo, hi) = (a.min(b), a.max(b));
        let first = self.group(lo).lock();
        let second = (hi != lo).then(|| self.group(hi).lock());
        (first, second)
    }

    /// Writer only: puts `slot` in slot `i` of `g`, dropping the side record of what was
    /// there (unless it is the same key's).
    fn replace(&self, g: Group<'_>, i: usize, fp: (u64, u64), slot: &Slot) {
        if g.deadline(i) != 0 && g.fp(i) != fp {
            self.drop_side(g, i);
        } else if g.deadline(i) != 0 && slot.worker != SIDE {
            // The same key, no longer with a side record.
            self.drop_side(g, i);
        }
        g.write(i, fp, slot);
    }

    fn drop_side(&self, g: Group<'_>, i: usize) {
        if byte(g.hot.head[7].load(Ordering::Relaxed), i) == SIDE {
            let (a, b) = g.fp(i);
            if let Ok(mut m) = self.side[(b as usize) % SIDE_SHARDS].write() {
                m.remove(&((u128::from(a) << 64) | u128::from(b)));
            }
        }
    }

    fn side_put(&self, (a, b): (u64, u64), rec: Arc<DedupRecord>) {
        if let Ok(mut m) = self.side[(b as usize) % SIDE_SHARDS].write() {
            m.insert((u128::from(a) << 64) | u128::from(b), rec);
        }
    }

    /// Drops `key`'s entry (waits for an [`CompletedCache::insert_if`] of it in progress).
    pub(crate) fn invalidate(&self, key: &DedupKey) {
        let fp = self.fingerprint(key);
        let (i1, i2) = self.groups_of(fp);
        let _held = self.hold_both(i1, i2);
        for g in [self.group(i1), self.group(i2)] {
            while let Some(i) = g.find(fp.0, fp.1) {
                self.drop_side(g, i);
                g.clear(i);
            }
        }
    }

    /// Drops every entry.
    pub(crate) fn clear(&self) {
        for g in (0..self.hot.len()).map(|i| self.group(i)) {
            let _held = g.lock();
            for i in 0..WAYS {
                g.clear(i);
            }
        }
        for s in self.side.iter() {
            if let Ok(mut m) = s.write() {
                m.clear();
            }
        }
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
    use bytes::Bytes;
    use idemq_core::ConsumerGroup;

    const HOUR: Duration = Duration::from_secs(3600);

    fn key(k: &str) -> DedupKey {
        DedupKey::new(&ConsumerGroup::new("g").expect("group"), k).expect("key")
    }

    fn rec(k: &str) -> DedupRecord {
        DedupRecord {
            key: key(k),
            status: RecordStatus::Completed,
            token: FencingToken(7),
            lease_until_ms: 1_700_000_000_500,
            attempts: 2,
            payload_hash: None,
            result: None,
            first_seen_ms: 1_700_000_000_100,
            completed_ms: Some(1_700_000_000_999),
            expires_ms: Some(1_700_003_600_999),
            worker: Some(Arc::from("w1")),
        }
    }

    fn put(c: &CompletedCache, r: &DedupRecord, left: Duration) -> bool {
        c.insert_if(r, left, || true)
    }

    fn side_len(c: &CompletedCache) -> usize {
        c.side.iter().map(|s| s.read().expect("side").len()).sum()
    }

    fn live(c: &CompletedCache) -> usize {
        let now = c.now();
        (0..c.hot.len())
            .map(|gi| (0..WAYS).filter(|&i| c.group(gi).deadline(i) > now).count())
            .sum()
    }

    #[test]
    fn a_compact_entry_answers_a_duplicate_with_what_it_keeps() {
        let c = CompletedCache::new(100, HOUR).expect("cache");
        let r = rec("a");
        assert!(put(&c, &r, HOUR));
        assert!(c.contains(&r.key));
        let Some(ClaimOutcome::Duplicate(got)) = c.answer(&r.key, None) else {
            panic!("expected a local duplicate");
        };
        assert_eq!(got.key, r.key);
        assert_eq!(got.status, RecordStatus::Completed);
        assert_eq!(got.token, r.token);
        assert_eq!(got.attempts, 2);
        assert_eq!(got.worker.as_deref(), Some("w1"));
        assert_eq!(got.result, None);
        assert_eq!(got.payload_hash, None);
        // Times to the second; the ones the slot does not keep read as the completion.
        assert_eq!(got.completed_ms, Some(1_700_000_000_000));
        assert_eq!(got.expires_ms, Some(1_700_003_600_000));
        assert_eq!(got.first_seen_ms, 1_700_000_000_000);
        assert_eq!(got.lease_until_ms, 1_700_000_000_000);
        assert!(!c.contains(&key("b")));
        assert!(c.answer(&key("b"), None).is_none());
        assert_eq!(side_len(&c), 0, "a compact entry has no side record");
    }

    #[test]
    fn a_batch_is_answered_as_each_key_alone() {
        let c = CompletedCache::new(100, HOUR).expect("cache");
        let a = PayloadHash::of(b"a");
        let mut with_pay = rec("paid");
        with_pay.payload_hash = Some(a);
        let mut with_result = rec("result");
        with_result.result = Some(b"kept whole".to_vec().into());
        with_result.payload_hash = Some(a);
        for r in [&rec("compact"), &with_pay, &with_result] {
            assert!(put(&c, r, HOUR));
        }
        assert!(put(&c, &rec("brief"), Duration::from_millis(20)));
        std::thread::sleep(Duration::from_millis(60));
        let other = PayloadHash::of(b"b");
        let claims: Vec<(DedupKey, Option<PayloadHash>)> = vec![
            (key("compact"), None),
            (key("fresh"), None),
            (key("paid"), Some(a)),
            (key("paid"), Some(other)),
            (key("result"), Some(other)),
            (key("brief"), None),
        ];
        let batch = c.answer_batch(claims.iter().map(|(k, p)| (k, p.as_ref())));
        let alone: Vec<Option<ClaimOutcome>> = claims
            .iter()
            .map(|(k, p)| c.answer(k, p.as_ref()))
            .collect();
        assert_eq!(batch, alone);
        // What each answer is, so the comparison above is not of two empty answers.
        assert!(matches!(batch[0], Some(ClaimOutcome::Duplicate(_))));
        assert_eq!(batch[1], None, "a fresh key goes to the store");
        assert!(matches!(batch[2], Some(ClaimOutcome::Duplicate(_))));
        assert_eq!(batch[3], None, "another payload goes to the store");
        assert!(matches!(batch[4], Some(ClaimOutcome::PayloadConflict(_))));
        assert_eq!(batch[5], None, "an entry past its deadline is not answered");
        let keys: Vec<DedupKey> = claims.iter().map(|(k, _)| k.clone()).collect();
        let alone: Vec<bool> = keys.iter().map(|k| c.contains(k)).collect();
        assert_eq!(c.contains_batch(&keys), alone);
        assert_eq!(alone, [true, false, true, true, true, false]);
    }

    #[test]
    fn entries_expire_and_invalidate() {
        let c = CompletedCache::new(100, Duration::from_secs(60)).expect("cache");
        c.insert_if(&rec("short"), Duration::from_millis(30), || true);
        c.insert_if(&rec("long"), HOUR, || true);
        assert!(c.contains(&key("short")));
        std::thread::sleep(Duration::from_millis(60));
        assert!(!c.contains(&key("short")), "answered past its deadline");
        assert!(c.answer(&key("short"), None).is_none());
        assert!(
            c.contains(&key("long")),
            "capped at the cache TTL, not dropped"
        );
        c.invalidate(&key("long"));
        assert!(!c.contains(&key("long")));
        assert!(
            !c.insert_if(&rec("no"), HOUR, || false),
            "still_valid said no"
        );
        assert!(!c.contains(&key("no")));
        assert!(!put(&c, &rec("zero"), Duration::ZERO));
        assert!(!c.contains(&key("zero")));
    }

    #[test]
    fn the_payload_tag_sends_other_payloads_to_the_store() {
        let c = CompletedCache::new(100, HOUR).expect("cache");
        let (a, b) = (PayloadHash::of(b"a"), PayloadHash::of(b"b"));
        let mut r = rec("p");
        r.payload_hash = Some(a);
        put(&c, &r, HOUR);
        assert!(c.contains(&r.key), "cached whatever the payload");
        match c.answer(&r.key, Some(&a)) {
            Some(ClaimOutcome::Duplicate(got)) => assert_eq!(got.payload_hash, Some(a)),
            o => panic!("same payload: {o:?}"),
        }
        assert!(c.answer(&r.key, Some(&b)).is_none(), "another payload");
        assert!(
            c.answer(&r.key, None).is_none(),
            "the stored hash is not kept"
        );
        // Stored without a hash: any payload is a duplicate, as the stores answer.
        put(&c, &rec("n"), HOUR);
        match c.answer(&key("n"), Some(&b)) {
            Some(ClaimOutcome::Duplicate(got)) => assert_eq!(got.payload_hash, None),
            o => panic!("{o:?}"),
        }
    }

    #[test]
    fn a_record_with_a_result_is_kept_whole() {
        let c = CompletedCache::new(100, HOUR).expect("cache");
        let a = PayloadHash::of(b"a");
        let mut r = rec("r");
        r.result = Some(Bytes::from_static(b"receipt"));
        r.payload_hash = Some(a);
        put(&c, &r, HOUR);
        assert_eq!(side_len(&c), 1);
        assert!(c.contains(&r.key));
        match c.answer(&r.key, Some(&a)) {
            Some(ClaimOutcome::Duplicate(got)) => assert_eq!(got, r),
            o => panic!("{o:?}"),
        }
        match c.answer(&r.key, Some(&PayloadHash::of(b"b"))) {
            Some(ClaimOutcome::PayloadConflict(got)) => assert_eq!(got, r),
            o => panic!("{o:?}"),
        }
        // Replaced by a compact entry of the same key: the side record goes.
        put(&c, &rec("r"), HOUR);
        assert_eq!(side_len(&c), 0);
        put(&c, &r, HOUR);
        c.invalidate(&r.key);
        assert_eq!(side_len(&c), 0);
        assert!(!c.contains(&r.key));
        put(&c, &r, HOUR);
        c.clear();
        assert_eq!(side_len(&c), 0);
        assert!(!c.contains(&r.key));
    }

    #[test]
    fn records_that_do_not_fit_a_slot_are_kept_whole() {
        let c = CompletedCache::new(1000, HOUR).expect("cache");
        let mut many = rec("many-attempts");
        many.attempts = 300;
        put(&c, &many, HOUR);
        match c.answer(&many.key, None) {
            Some(ClaimOutcome::Duplicate(got)) => assert_eq!(got.attempts, 300),
            o => panic!("{o:?}"),
        }
        // Worker names past the interning table keep their records whole.
        for i in 0..MAX_WORKERS + 10 {
            let mut r = rec(&format!("w{i}"));
            r.worker = Some(Arc::from(format!("worker-{i}").as_str()));
            put(&c, &r, HOUR);
        }
        for i in 0..MAX_WORKERS + 10 {
            match c.answer(&key(&format!("w{i}")), None) {
                Some(ClaimOutcome::Duplicate(got)) => {
                    assert_eq!(got.worker.as_deref(), Some(format!("worker-{i}").as_str()))
                }
                o => panic!("{i}: {o:?}"),
            }
        }
        assert_eq!(side_len(&c), 1 + 10);
    }

    #[test]
    fn a_fresh_key_is_never_answered() {
        let c = CompletedCache::new(10_000, HOUR).expect("cache");
        for i in 0..10_000 {
            put(&c, &rec(&format!("done-{i}")), HOUR);
        }
        for i in 0..100_000 {
            for k in [
                format!("done-{i}x"),
                format!("x-done-{i}"),
                format!("fresh-{i}"),
            ] {
                assert!(!c.contains(&key(&k)), "{k}");
            }
        }
    }

    /// Past the capacity, the entries closest to their deadline go first, and the table
    /// never grows.
    #[test]
    fn capacity_bounds_the_table() {
        let c = CompletedCache::new(1000, Duration::from_secs(100_000)).expect("cache");
        let slots = c.slots();
        assert!(
            (1000..=1200).contains(&slots),
            "{slots} slots for 1000 keys"
        );
        // Later keys live longer, so they are the ones to keep.
        let n = 20_000;
        for i in 0..n {
            put(
                &c,
                &rec(&format!("k{i}")),
                Duration::from_secs(60 + i as u64),
            );
        }
        assert_eq!(c.slots(), slots);
        assert!(live(&c) <= slots);
        let recent = (n - 500..n)
            .filter(|i| c.contains(&key(&format!("k{i}"))))
            .count();
        assert!(recent >= 475, "{recent} of the last 500 keys kept");
        // At the sized load, nothing is dropped.
        let c = CompletedCache::new(10_000, HOUR).expect("cache");
        for i in 0..10_000 {
            put(&c, &rec(&format!("f{i}")), HOUR);
        }
        let kept = (0..10_000)
            .filter(|i| c.contains(&key(&format!("f{i}"))))
            .count();
        assert!(kept >= 9_990, "{kept} of 10000 kept at capacity");
        // Every entry, moved or not, can be invalidated.
        for i in 0..10_000 {
            c.invalidate(&key(&format!("f{i}")));
        }
        assert_eq!(live(&c), 0);
    }

    #[test]
    fn a_cache_too_large_to_allocate_is_an_error() {
        let e = CompletedCache::new(u64::MAX / 2, HOUR)
            .err()
            .expect("too large");
        assert!(e.bytes > u128::from(u64::MAX));
    }

    /// Readers racing writers see whole entries: the token and attempts of a key (both
    /// derived from its number) always belong together, keys never inserted are never
    /// found, and an invalidated key stays gone.
    #[test]
    fn concurrent_readers_see_whole_entries() {
        let c = Arc::new(CompletedCache::new(2_000, HOUR).expect("cache"));
        let n = 4_000usize;
        let keys: Arc<Vec<DedupKey>> = Arc::new((0..n).map(|i| key(&format!("c{i}"))).collect());
        let entry = |i: usize| {
            let mut r = rec(&format!("c{i}"));
            r.token = FencingToken(i as i64 + 1);
            r.attempts = (i % 250) as u32 + 1;
            r
        };
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut readers = Vec::new();
        for _ in 0..2 {
            let (c, keys, stop) = (c.clone(), keys.clone(), stop.clone());
            readers.push(std::thread::spawn(move || {
                let mut seen = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    for (i, k) in keys.iter().enumerate() {
                        match c.answer(k, None) {
                            None => {}
                            Some(ClaimOutcome::Duplicate(r)) => {
                                assert_eq!(i % 2, 0, "c{i} was never inserted");
                                assert_eq!(r.token, FencingToken(i as i64 + 1), "c{i}");
                                assert_eq!(r.attempts, (i % 250) as u32 + 1, "c{i}");
                                seen += 1;
                            }
                            Some(o) => panic!("{o:?}"),
                        }
                    }
                }
                seen
            }));
        }
        for round in 0..20 {
            for i in (0..n).step_by(2) {
                put(&c, &entry(i), HOUR);
            }
            for i in (round % 4..n).step_by(4) {
                c.invalidate(&keys[i]);
            }
        }
        stop.store(true, Ordering::Relaxed);
        let seen: u64 = readers.into_iter().map(|r| r.join().expect("reader")).sum();
        assert!(seen > 0, "the readers saw entries");
        for i in (0..n).step_by(2) {
            c.invalidate(&keys[i]);
            assert!(!c.contains(&keys[i]), "c{i} after invalidate");
        }
    }
}
