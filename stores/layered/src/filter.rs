//! Pre-filters: set-membership sketches that may only ever say "definitely never seen".
//!
//! A bloom filter answers "maybe seen" for every key it was given *and* for a small fraction
//! of keys it was never given (false positives). Seed 003's layered design treated "maybe
//! seen" as "duplicate" and so silently dropped about 0.1% of fresh messages. Here the only
//! answer that carries meaning is [`Novelty::NeverSeen`]; [`Novelty::MaybeSeen`] never
//! skips anything — it sends the key to the authoritative store, or, during an outage,
//! makes the [`LayeredStore`](crate::LayeredStore) refuse the key for now (redeliver later).

use async_trait::async_trait;
use idemq_core::{DedupKey, StoreError};
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};

/// What a pre-filter knows about one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Novelty {
    /// The key was definitely never inserted into this filter.
    NeverSeen,
    /// The key may have been inserted (or it is a false positive). Means nothing on its own.
    MaybeSeen,
}

impl Novelty {
    /// True for [`Novelty::NeverSeen`].
    pub fn is_never_seen(self) -> bool {
        self == Novelty::NeverSeen
    }
}

/// A set-membership pre-filter (a bloom filter, local or shared) that can only prove absence.
///
/// Implementations must never answer [`Novelty::NeverSeen`] for a key they were given
/// before, including after their own storage was lost (a restarted server): in doubt, answer
/// [`Novelty::MaybeSeen`] or return an error, which callers treat as "maybe seen".
#[async_trait]
pub trait PreFilter: Send + Sync + 'static {
    /// Inserts the keys. For each key, in order: whether it was definitely absent before
    /// this call ([`Novelty::NeverSeen`]) or may have been present.
    async fn insert(&self, keys: &[DedupKey]) -> Result<Vec<Novelty>, StoreError>;

    /// Queries the keys without inserting them; the answer is in order.
    async fn check(&self, keys: &[DedupKey]) -> Result<Vec<Novelty>, StoreError>;

    /// A short description for logs (`"local bloom"`, `"redisbloom idemq-bf"`...).
    fn describe(&self) -> String;
}

/// Bit-array sizing for a bloom filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BloomSizing {
    /// Number of bits.
    pub bits: u64,
    /// Number of hash functions.
    pub hashes: u32,
}

impl BloomSizing {
    /// The optimal sizing for `expected_items` at false-positive rate `fp_rate`
    /// (`m = -n ln p / ln² 2`, `k = m/n ln 2`). `fp_rate` is clamped to `[1e-9, 0.5]`.
    pub fn optimal(expected_items: u64, fp_rate: f64) -> Self {
        let n = expected_items.max(1) as f64;
        let p = if fp_rate.is_finite() {
            fp_rate.clamp(1e-9, 0.5)
        } else {
            0.01
        };
        let ln2 = std::f64::consts::LN_2;
        let m = (-n * p.ln() / (ln2 * ln2)).ceil().max(64.0);
        let k = ((m / n) * ln2).round().clamp(1.0, 30.0);
        Self {
            bits: m as u64,
            hashes: k as u32,
        }
    }
}

/// An in-process bloom filter: lock-free (atomic words), no dependencies.
///
/// It only knows the keys inserted into it by this process since it was created, so as a
/// gate for a fallback store it protects against keys this process has seen (see
/// [`FallbackGate::NeverSeenKeys`](crate::FallbackGate::NeverSeenKeys)).
///
/// ```
/// use idemq_layered::{LocalBloom, Novelty};
/// let f = LocalBloom::new(1000, 0.01);
/// assert_eq!(f.insert_str("g:a"), Novelty::NeverSeen);
/// assert_eq!(f.insert_str("g:a"), Novelty::MaybeSeen);
/// assert_eq!(f.check_str("g:a"), Novelty::MaybeSeen);
/// ```
pub struct LocalBloom {
    words: Box<[AtomicU64]>,
    bits: u64,
    hashes: u32,
    hasher: std::hash::RandomState,
}

impl std::fmt::Debug for LocalBloom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalBloom")
            .field("bits", &self.bits)
            .field("hashes", &self.hashes)
            .finish_non_exhaustive()
    }
}

impl LocalBloom {
    /// A filter sized for `expected_items` at false-positive rate `fp_rate`.
    pub fn new(expected_items: u64, fp_rate: f64) -> Self {
        Self::with_sizing(BloomSizing::optimal(expected_items, fp_rate))
    }

    /// A filter with explicit sizing (at least 64 bits, at least one hash).
    pub fn with_sizing(sizing: BloomSizing) -> Self {
        let bits = sizing.bits.max(64);
        let words = bits.div_ceil(64);
        let words: Box<[AtomicU64]> = (0..words).map(|_| AtomicU64::new(0)).collect();
        Self {
            bits: words.len() as u64 * 64,
            words,
            hashes: sizing.hashes.max(1),
            hasher: std::hash::RandomState::new(),
        }
    }

    /// The sizing in use.
    pub fn sizing(&self) -> BloomSizing {
        BloomSizing {
            bits: self.bits,
            hashes: self.hashes,
        }
    }

    /// Fraction of bits set (1.0 = saturated: every query answers "maybe seen").
    pub fn fill_ratio(&self) -> f64 {
        let ones: u64 = self
            .words
            .iter()
            .map(|w| u64::from(w.load(Ordering::Relaxed).count_ones()))
            .sum();
        ones as f64 / self.bits as f64
    }

    fn base_hashes(&self, s: &str) -> (u64, u64) {
        let h1 = self.hasher.hash_one(s);
        // Odd, so the probe sequence visits distinct positions (Kirsch–Mitzenmacher).
        let h2 = self.hasher.hash_one((0x9e37_79b9_7f4a_7c15_u64, s)) | 1;
        (h1, h2)
    }

    fn positions(&self, s: &str) -> impl Iterator<Item = (usize, u64)> + '_ {
        let (h1, h2) = self.base_hashes(s);
        let bits = self.bits;
        (0..u64::from(self.hashes)).map(move |i| {
            let bit = h1.wrapping_add(i.wrapping_mul(h2)) % bits;
            ((bit / 64) as usize, 1u64 << (bit % 64))
        })
    }

    /// Inserts one key; says whether it was definitely absent before.
    pub fn insert_str(&self, s: &str) -> Novelty {
        let mut changed = false;
        for (w, mask) in self.positions(s) {
            let old = self.words[w].fetch_or(mask, Ordering::AcqRel);
            changed |= old & mask == 0;
        }
        if changed {
            Novelty::NeverSeen
        } else {
            Novelty::MaybeSeen
        }
    }

    /// Queries one key.
    pub fn check_str(&self, s: &str) -> Novelty {
        for (w, mask) in self.positions(s) {
            if self.words[w].load(Ordering::Acquire) & mask == 0 {
                return Novelty::NeverSeen;
            }
        }
        Novelty::MaybeSeen
    }
}

#[async_trait]
impl PreFilter for LocalBloom {
    async fn insert(&self, keys: &[DedupKey]) -> Result<Vec<Novelty>, StoreError> {
        Ok(keys.iter().map(|k| self.insert_str(k.as_str())).collect())
    }

    async fn check(&self, keys: &[DedupKey]) -> Result<Vec<Novelty>, StoreError> {
        Ok(keys.iter().map(|k| self.check_str(k.as_str())).collect())
    }

    fn describe(&self) -> String {
        format!("local bloom ({} bits, {} hashes)", self.bits, self.hashes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inserted_keys_are_never_reported_never_seen() {
        let f = LocalBloom::new(10_000, 0.01);
        for i in 0..10_000 {
            f.insert_str(&format!("g:{i}"));
        }
        for i in 0..10_000 {
            assert_eq!(f.check_str(&format!("g:{i}")), Novelty::MaybeSeen);
        }
    }

    #[test]
    fn false_positive_rate_is_near_the_target() {
        let f = LocalBloom::new(10_000, 0.01);
        for i in 0..10_000 {
            f.insert_str(&format!("in:{i}"));
        }
        let fp = (0..100_000)
            .filter(|i| f.check_str(&format!("out:{i}")) == Novelty::MaybeSeen)
            .count();
        assert!(fp < 2_000, "false positives {fp} of 100000 at 1% target");
    }

    #[test]
    fn sizing_is_sane() {
        let s = BloomSizing::optimal(1_000_000, 0.001);
        assert!(s.bits > 14_000_000 && s.bits < 15_000_000, "{s:?}");
        assert_eq!(s.hashes, 10);
        let s = BloomSizing::optimal(0, f64::NAN);
        assert!(s.bits >= 64 && s.hashes >= 1);
    }
}
