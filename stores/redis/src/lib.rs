//! # idemq-redis
//!
//! The Redis [`DedupStore`](idemq_core::DedupStore) with fencing tokens: claims as a
//! pipelined `SET key record NX GET PX lease` judged by `idemq_core::evaluate_claim` (the
//! crash-recovery rewrites — takeover, retention over — in a Lua script applying the same
//! rules atomically), Lua compare-token-and-set completion, compare-token release and
//! extension, batches in one round trip, hash-tagged keys for Redis Cluster slots,
//! reconnection after a Redis restart, and a bounded `SCAN` for operations.
//!
//! ```no_run
//! # async fn demo() -> Result<(), idemq_core::StoreError> {
//! use idemq_core::{ClaimOutcome, ClaimRequest, ConsumerGroup, DedupKey, DedupStore};
//! use idemq_redis::{RedisStore, RedisStoreOptions};
//! use std::time::Duration;
//! let store = RedisStore::connect("redis://127.0.0.1:6379/", RedisStoreOptions::default()).await?;
//! let key = DedupKey::new(&ConsumerGroup::new("payments").unwrap(), "order-42").unwrap();
//! if let ClaimOutcome::Acquired(lease) = store.claim(&ClaimRequest::new(key.clone(), Duration::from_secs(30))).await? {
//!     // ... the effect ...
//!     store.complete(&key, lease.token, None, Duration::from_secs(86_400)).await?;
//! }
//! # Ok(()) }
//! ```
//!
//! On a Redis Cluster, connect with `redis+cluster://host:port,host:port/` (see
//! [`RedisStore`]'s scope and [`RedisStoreBuilder::wait_replicas`]).
//!
//! With the `bloom` feature (default), [`RedisBloomFilter`] is a shared never-seen-only
//! [`PreFilter`](idemq_layered::PreFilter) for `idemq-layered`, backed by the RedisBloom
//! module when the server has it loaded (detected with `MODULE LIST`, never assumed).
//!
//! Module order (each uses only those before it): `sniff`, `codec`, `lua` → `errors` →
//! `cluster` → `conn` → `incarnation` → `store` (the [`RedisStore`] struct, accessors, the
//! `DedupStore` impl) → `pipeline` → `scan`, `claim`, `complete` → `builder` → `bloom`.
//! `pipeline` … `builder` add `impl RedisStore` blocks; the `DedupStore` impl calls the
//! methods of `claim`, `complete` and `scan` without importing them.
#![warn(missing_docs)]

#[cfg(feature = "bloom")]
mod bloom;
mod builder;
mod claim;
mod cluster;
pub mod codec;
mod complete;
mod conn;
mod errors;
mod incarnation;
mod lua;
mod pipeline;
mod scan;
mod sniff;
mod store;

#[cfg(feature = "bloom")]
pub use bloom::{redisbloom_loaded, RedisBloomFilter};
pub use builder::{
    validate_prefix, RedisStoreBuilder, RedisStoreOptions, DEFAULT_COMPLETED_GRACE,
    DEFAULT_IN_PROGRESS_GRACE, DEFAULT_MAX_KEYS_PER_SCRIPT, DEFAULT_PREFIX, MAX_PREFIX_LEN,
};
pub use cluster::{cluster_seed_urls, key_slot, CLUSTER_SCHEME};
pub use errors::{
    handler_error, is_retryable_redis_error, map_redis_error, RedisResultExt, REDIS_SCHEMES,
};
pub use store::RedisStore;

/// The `redis` crate this store is built on (for [`redis::aio::ConnectionManager`]).
pub use redis;
