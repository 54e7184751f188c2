//! # idemq-layered
//!
//! A layered [`DedupStore`](idemq_core::DedupStore) for replay storms and outages (seed 003
//! §3–4), built so that no layer can turn a fresh message into a skipped one:
//!
//! ```text
//! claim ──► local cache of completed keys ──hit──► Duplicate (no round trip)
//!               │ miss
//!               ▼
//!           pre-filter insert (bloom: answers only "never seen")
//!               ▼
//!           authoritative store ──Unavailable──► fallback store (gated by the filter)
//! ```
//!
//! - [`LayeredStore`]: the store itself; its docs state what each mode guarantees.
//! - [`PreFilter`], [`LocalBloom`]: never-seen-only filters (a RedisBloom-backed one lives in
//!   `idemq-redis`, so this crate does not depend on Redis).
//! - [`LeaseWatchdog`]: Redisson-style lease renewal over any store (the core's
//!   [`LeaseKeepAlive`](idemq_core::LeaseKeepAlive) under this crate's name).
#![warn(missing_docs)]

mod cache;
mod claims;
pub mod filter;
pub mod layered;
pub mod watchdog;

pub use filter::{BloomSizing, LocalBloom, Novelty, PreFilter};
pub use layered::{
    FallbackGate, LayerStats, LayeredStore, LayeredStoreBuilder, DEFAULT_CACHE_CAPACITY,
    DEFAULT_CACHE_TTL, DEFAULT_OUTAGE_RETRY_AFTER,
};
pub use watchdog::{LeaseLost, LeaseState, LeaseWatchdog};
