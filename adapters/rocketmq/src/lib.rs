#![recursion_limit = "512"]
//! # idemq-rocketmq
//!
//! RocketMQ adapter for idemq (rocketmq-client-rust 1.0): a push-consumer [`RocketSource`],
//! a keyed, confirmed [`RocketPublisher`], and a [`TransactionalPublisher`] whose check-back
//! consults the dedup store.
//!
//! ## What RocketMQ guarantees
//! At least once per consumer group. A message is redelivered when its listener call does
//! not return success (lost ack, crash, rebalance before the consume offset was persisted:
//! offsets are committed every few seconds and on shutdown, so a crash replays). A producer
//! retry stores a second copy. `MessageExt::msg_id` is an *offset* id: it changes on every
//! redelivery (the broker re-stores the message in the retry topic), so it is never a dedup
//! key; the producer's `UNIQ_KEY` property is stable and becomes
//! [`Envelope::message_id`](idemq_core::Envelope::message_id). The dedup key travels in
//! `KEYS` (first) and in the `idemq-dedup-key` property.
//!
//! ## How settlements map
//! The listener is synchronous and runs on the client's blocking pool; it hands each message
//! (batch size 1, so a mixed batch never resends an acked or dead-lettered message) to the
//! engine through the core's channel source and waits for the settlement:
//!
//! | idemq | concurrently | orderly |
//! |---|---|---|
//! | ack | `CONSUME_SUCCESS` | `SUCCESS` |
//! | nack(d) | held on the listener thread for `d`, then the same message handed to the engine again (delivery count + 1); past [`max_held_nacks`](RocketSourceConfig::max_held_nacks) held at once, sent to the retry topic `%RETRY%<group>` with a delay level ≥ `d`, then success | held, order kept |
//! | reject(reason) | copy to the dead-letter topic (`%DLQ%<group>` or configured) with [`DLQ_REASON`], confirmed `SEND_OK`, then success | same |
//! | dropped unsettled | held 1 s, handed over again (same bound) | same |
//! | source closing | `RECONSUME_LATER` (the broker's levels: ~10 s, ~30 s, …; [`MIN_RECONSUME_DELAY`]) | `SUSPEND_CURRENT_QUEUE_A_MOMENT` |
//!
//! A held nack does not reach the broker: each `RECONSUME_LATER`, send-back or suspend
//! spends one of `max_reconsume_times`, after which the broker moves the message to
//! `%DLQ%<group>` without a reason, and the engine also nacks what is not a failure (a key
//! in flight elsewhere, the store down, a deferred lane). The engine's retry policy, which
//! counts handler failures (the store's attempts), dead-letters with a reason. A held message
//! keeps its listener thread and holds back its queue's committed offset until it is acked
//! or rejected, so in concurrent mode only a few are held at once: the others go to the
//! broker's delayed retry, which frees their threads for healthy messages and spends one
//! reconsume each.
//!
//! ## What is fenced
//! RocketMQ has no producer fencing and no consumer-side generation: a listener call that
//! outlived its source (closed, dropped) answers "later" and its delivery reports stale; a
//! late settle does nothing. Orderly mode locks each queue on the broker, so only one member
//! of the group consumes a queue; a rebalance can still replay a message whose offset was
//! not persisted, which the dedup store's claim fences (one effect per key).
//! Transactional messages: the check-back answers from the store ([`StoreCheckBack`]).
//!
//! ```no_run
//! use idemq_rocketmq::{RocketSource, RocketSourceConfig};
//! # async fn f() -> Result<(), idemq_rocketmq::RocketError> {
//! let src = RocketSource::connect(RocketSourceConfig::new("127.0.0.1:9876", "billing", "payments")).await?;
//! # drop(src); Ok(()) }
//! ```
#![warn(missing_docs)]

mod client;
mod fields;
mod listener_guard;
mod publisher;
mod source;
mod transaction;

pub use client::{client_config, client_runtime};
pub use fields::{
    stable_message_id, to_envelope, to_message, DLQ_ORIGIN_TOPIC, DLQ_REASON, OFFSET_MSG_ID,
};
pub use publisher::{RocketPublisher, RocketPublisherConfig};
/// The RocketMQ client crate the adapter is built on, for code that talks to the client
/// directly beside it (with [`client_runtime`] and [`client_config`]).
pub use rocketmq_client_rust;
/// The RocketMQ message model (messages, queues, consume-from settings) of that client.
pub use rocketmq_model;
pub use source::{ConsumeMode, RocketSource, RocketSourceConfig, MIN_RECONSUME_DELAY};
pub use transaction::{
    LocalOutcome, StoreCheckBack, TransactionalPublisher, DEFAULT_ROLLBACK_RETENTION, LOCAL_TIMEOUT,
};

/// RocketMQ's [`BrokerKind`](idemq_core::BrokerKind), stamped on every envelope this
/// adapter builds: the `broker` label `rocketmq`.
/// [`KeySource::DedupHeader`](idemq_core::KeySource::DedupHeader) reads idemq's
/// [`DEDUP_HEADER`](idemq_core::DEDUP_HEADER) property, then the first of the
/// space-separated `KEYS` ([`Envelope::key`](idemq_core::Envelope::key)), where this
/// adapter's publisher and most producers put the dedup key.
pub const ROCKETMQ: idemq_core::BrokerKind = idemq_core::BrokerKind::new(
    "rocketmq",
    &[
        idemq_core::DedupSlot::Header(idemq_core::DEDUP_HEADER),
        idemq_core::DedupSlot::Custom {
            describe: "RocketMQ `KEYS`",
            read: fields::first_key,
        },
    ],
);

/// Errors of the adapter's setup calls.
#[derive(Debug, thiserror::Error)]
pub enum RocketError {
    /// The RocketMQ client failed (name server unreachable, start refused).
    #[error("rocketmq client: {0}: check the name server address and that the broker is up")]
    Client(String),
    /// A setting is invalid.
    #[error("rocketmq adapter misconfigured: {0}")]
    Config(String),
}
