//! # idemq-core
//!
//! The broker-agnostic heart of idemq: the [`Envelope`] every adapter produces, the
//! [`KeyStrategy`] that turns it into a [`DedupKey`], the claim contract every store
//! implements ([`DedupStore`]), and the [`IdempotentConsumer`] engine that runs a handler over
//! any [`Source`] with exactly-once effects.
//!
//! This crate knows no broker and no database: adapters (`idemq-kafka`, `idemq-rabbitmq`,
//! `idemq-rocketmq`) implement [`Source`]; stores (`idemq-sql`, `idemq-redis`) implement
//! [`DedupStore`]. The in-memory [`MemoryStore`] and [`broker::MemoryBroker`] obey the same
//! contracts for the embedded default and for tests.
#![warn(missing_docs)]

pub mod adapter;
pub mod broker;
pub mod engine;
pub mod envelope;
pub mod handler;
pub mod idgen;
pub mod key;
pub mod memory;
pub mod metrics;
pub mod publish;
pub mod secrets;
pub mod source;
pub mod store;
#[cfg(feature = "testkit")]
pub mod testkit;

/// The attribute for implementing [`Handler`] (and the other async traits) on your types.
pub use async_trait::async_trait;
/// The byte buffer of payloads and stored results.
pub use bytes::Bytes;
pub use engine::{
    ConsumerConfig, ConsumerError, ConsumerStats, DeliveryOrder, Health, HealthReport, HealthState,
    IdempotentConsumer, LeaseKeepAlive, LeaseState, LossCause, RetryPolicy,
};
pub use envelope::{
    BrokerKind, DedupSlot, Envelope, Headers, Position, SourceRef, TRACEPARENT_HEADER,
};
pub use handler::{
    BatchHandler, BoxError, ClaimedMessage, Handler, HandlerError, HandlerResult, LeaseLost,
    LeaseWatch,
};
pub use key::{ConsumerGroup, DedupKey, Field, KeyError, KeySource, KeyStrategy, OversizeKey};
pub use memory::MemoryStore;
pub use publish::{OutgoingMessage, PublishError, PublishReceipt, Publisher, DEDUP_HEADER};
pub use source::{Delivery, Settle, Settlement, Source, SourceError};
pub use store::{
    acquired_record, evaluate_claim, evaluate_claim_request, now_ms, ClaimMode, ClaimOutcome,
    ClaimRequest, ClaimVerdict, CompleteOutcome, Completion, DedupRecord, DedupStore,
    ExtendOutcome, FencingToken, Lease, PayloadHash, RecordStatus, ReleaseOutcome, RollbackOutcome,
    StoreError, StoreStats,
};

#[cfg(all(test, feature = "testkit"))]
mod memory_contract {
    use super::*;
    use std::sync::Arc;
    crate::store_contract_tests!(async {
        let s: Arc<dyn DedupStore> = Arc::new(MemoryStore::new());
        Some(vec![s.clone(), s])
    });

    #[tokio::test]
    async fn stats_count_records_by_state() {
        let s: Arc<dyn DedupStore> = Arc::new(MemoryStore::new());
        crate::testkit::store::stats_count_records_by_state(&s).await;
    }
}
