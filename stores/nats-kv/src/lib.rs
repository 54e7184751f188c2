//! # idemq-nats-kv
//!
//! The NATS JetStream key-value [`DedupStore`](idemq_core::DedupStore): one KV entry per
//! dedup key, every change a compare-and-set on the key's **revision**.
//!
//! - **Claim** = a write at revision 0 (the KV `create`: it fails if the key exists). If
//!   the key exists, the store reads it from the stream leader and applies
//!   [`idemq_core::evaluate_claim_request`]: duplicate, in flight, payload conflict, or a
//!   rewrite (takeover of an ended lease, a new lifecycle after retention) as an `update`
//!   at the revision it read, so of two racing claimers exactly one wins and the other
//!   re-reads and answers `InFlight`.
//! - **Fencing.** The record carries the claim's [`FencingToken`](idemq_core::FencingToken)
//!   (the caller's, or a random one); `complete`, `extend` and `release` read the record,
//!   check the token still owns it, and write at the revision read: a token that lost the
//!   key (taken over, released, purged) gets `Fenced`, and a write that meets a newer
//!   revision re-reads and judges again. The token is not the revision itself: the
//!   contract lets the caller choose the token (a retried claim whose reply was lost gets
//!   its own lease back), a heartbeat changes the revision while the token stays, and a
//!   completion retried after a lost reply must still answer `Completed`.
//! - **Time.** Leases and retention are judged on the **server's clock**: the stream
//!   leader's time read from its `STREAM.INFO` answer, carried forward on this process's
//!   monotonic clock (never the client's wall clock; see [`NatsKvOptions::clock_resync`]).
//! - **Retention.** With per-key TTLs (NATS 2.11+, on by default for a bucket the store
//!   creates) every write carries `Nats-TTL`: lease or retention plus a grace, so records
//!   leave by themselves; `purge_expired` deletes completed records past retention sooner
//!   (a purge at the revision judged); the bucket's `max_age` is optional.
//! - **Batches** are pipelined: JetStream has no multi-key transaction that answers per
//!   key (2.12's atomic batches are all-or-nothing), so `claim_batch` and
//!   `complete_batch` run their keys concurrently, `max_concurrency` at a time, and answer
//!   in order.
//! - **Keys** are `<prefix>.<encoded dedup key>` in the bucket; any dedup key is encoded
//!   (never refused, never colliding: [`codec::encode_key`]); hostile bucket names and
//!   prefixes are refused ([`validate_bucket`], [`validate_prefix`]).
//! - A server that does not answer is [`StoreError::Unavailable`](idemq_core::StoreError):
//!   the engine acks nothing and backs off.
//!
//! This is a store crate, separate from any NATS broker adapter: an adapter never depends
//! on a store (docs/extending.md), so a NATS consumer may keep its dedup records in
//! PostgreSQL, and a Kafka consumer in NATS KV.
//!
//! ```no_run
//! # async fn demo() -> Result<(), idemq_core::StoreError> {
//! use idemq_core::{ClaimOutcome, ClaimRequest, ConsumerGroup, DedupKey, DedupStore};
//! use idemq_nats_kv::{NatsKvOptions, NatsKvStore};
//! use std::time::Duration;
//! let store = NatsKvStore::connect("nats-kv://127.0.0.1:4222/idemq", NatsKvOptions::default()).await?;
//! let key = DedupKey::new(&ConsumerGroup::new("payments").unwrap(), "order-42").unwrap();
//! if let ClaimOutcome::Acquired(lease) = store.claim(&ClaimRequest::new(key.clone(), Duration::from_secs(30))).await? {
//!     // ... the effect ...
//!     store.complete(&key, lease.token, None, Duration::from_secs(86_400)).await?;
//! }
//! # Ok(()) }
//! ```
//!
//! Module order (each uses only those before it): `options`, `codec`, `errors` → `clock`,
//! `kv` → `store` (the [`NatsKvStore`] and its `DedupStore` impl) → `scan`.
#![warn(missing_docs)]

mod clock;
pub mod codec;
mod errors;
mod kv;
mod options;
mod scan;
mod store;

pub use options::{
    validate_bucket, validate_prefix, NatsKvOptions, DEFAULT_BUCKET, DEFAULT_COMPLETED_GRACE,
    DEFAULT_IN_PROGRESS_GRACE, DEFAULT_PREFIX, MAX_BUCKET_LEN, MAX_PREFIX_LEN, NATS_KV_SCHEME,
};
pub use store::{NatsKvStore, CAS_RETRIES};

/// The `async-nats` crate this store is built on.
pub use async_nats;
