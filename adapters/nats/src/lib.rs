//! # idemq-nats: NATS JetStream for idemq (async-nats)
//!
//! **What JetStream guarantees.** A stream stores the messages published to its subjects; a
//! publish is durable once the server's `PubAck` arrives. A *durable pull consumer* (explicit
//! acks) remembers, per message, whether it was acknowledged: a message handed out and not
//! acked within `AckWait` is delivered again (`delivered` counts the attempts, up to
//! `max_deliver`). Delivery is at least once. A stream drops a second publish carrying the
//! same `Nats-Msg-Id` within its duplicate window (2 min by default) and says so in the
//! `PubAck` — a producer retry is absorbed there, but not a redelivery of the *same* message
//! after a lost ack, nor a resend after the window: consumer-side dedup (the idemq engine and
//! a store) stays on.
//!
//! **How settlements map** ([`NatsSource`]; messages are fetched in batches of
//! [`NatsSourceConfig::batch`]):
//!
//! | settle | effect |
//! |---|---|
//! | `ack` | a *double ack*: `+ACK` sent, its confirmation awaited in the background (up to 4096 at once; a lost confirmation is logged and counted in `idemq_nats_acks_unconfirmed_total`, and the message may come back after `AckWait`, which the dedup store absorbs), and waited for on `close`. The engine acks only after the dedup record is durable |
//! | `nack(delay)` | `-NAK` with the delay: the server redelivers it no sooner. With [`NatsSourceConfig::ordered`] the delivery is instead held locally (kept alive with progress acks) and nothing newer of its subject is handed out until it is handed out again; the other subjects flow meanwhile (the held subject's backlog beyond its share of the buffer is given back to the server and comes back in order) |
//! | `reject(reason)` | a copy goes to the dead-letter subject ([`NatsSourceConfig::dead_letter_subject`], `idemq.dlq.<stream>` by default, stored by a stream the source creates when none captures it) with [`DLQ_REASON`], [`DLQ_SUBJECT`], [`DLQ_STREAM`] and [`DLQ_SEQUENCE`]; the original's `Nats-Msg-Id` moves to [`DLQ_MSG_ID`] and the copy's own names the dead-lettering (stream, durable, stream sequence, stored time), so the dead-letter stream drops a resend of the same dead-lettering but never the copy of another message with the same id. Only after its `PubAck` is the original terminated (`+TERM`, confirmed). A failed publish fails the reject (the engine then nacks), so nothing is lost |
//! | dropped unsettled | `-NAK` without delay when the source still runs; otherwise the server redelivers it after `AckWait`. Never acked |
//!
//! **Long handlers.** The engine keeps its store lease alive but tells the source nothing; the
//! source itself sends an in-progress ack (`+WPI`, which restarts `AckWait`) for every
//! delivery it handed out, buffered or holds unsettled once half of `AckWait` has passed
//! since it was fetched or last touched. A delivery is therefore redelivered only when the
//! source itself is gone (crash, network) — then after `AckWait`.
//!
//! **What is fenced.** Acks name a stream sequence of the durable consumer, so they stay valid
//! across a reconnect or a server restart (the consumer's state is on disk): a reconnect
//! makes nothing stale. `close()` (and dropping the source) ends it: every delivery still
//! unsettled is nakked for prompt redelivery and goes stale —
//! [`Settle::is_stale`](idemq_core::Settle::is_stale) is true and its settlements are
//! ignored. If the server redelivers a message the source still holds (its progress acks
//! were lost in an outage), the copy is not handed out twice: the held delivery settles
//! through the newest delivery's ack subject.
//!
//! **Every message becomes an envelope** ([`to_envelope`], never a panic): the subject is
//! [`SourceRef::name`](idemq_core::SourceRef), the stream sequence the position
//! ([`Position::Sequence`](idemq_core::Position)), every header name and value (the client
//! admits printable-ASCII names and single-line UTF-8 values) becomes bytes, repeated names
//! in order; `Nats-Msg-Id` is the message id, [`KEY_HEADER`] the message key, the ack
//! subject's attempt count the delivery count and its timestamp the timestamp.
//!
//! **Publishing.** [`NatsPublisher`] implements the core [`Publisher`](idemq_core::Publisher):
//! the dedup key goes into `Nats-Msg-Id` (the stream drops a duplicate within its window)
//! and [`DEDUP_HEADER`](idemq_core::DEDUP_HEADER), the result comes after the `PubAck`, and
//! [`NatsPublisher::publish_acked`] also says whether the stream found it a duplicate (the
//! core's receipt has no field for that; the counter [`metrics::PUBLISHED`] counts both).
//!
//! ```no_run
//! use idemq_nats::{NatsSource, NatsSourceConfig};
//! # async fn f() -> Result<(), idemq_nats::NatsError> {
//! let mut cfg = NatsSourceConfig::new("nats://127.0.0.1:4222", "ORDERS", "billing");
//! cfg.subjects = vec!["orders.>".into()];
//! let source = NatsSource::connect(cfg).await?;
//! # let _ = source; Ok(()) }
//! ```

#![warn(missing_docs)]

mod envelope;
mod lanes;
mod link;
mod publisher;
mod source;

pub use envelope::{outgoing_headers, stored_to_envelope, to_envelope, AckInfo, KEY_HEADER};
pub use link::redact;
pub use publisher::{NatsPublished, NatsPublisher, NatsPublisherConfig};
pub use source::{
    NatsSource, NatsSourceConfig, DLQ_MSG_ID, DLQ_REASON, DLQ_SEQUENCE, DLQ_STREAM, DLQ_SUBJECT,
};

/// The header JetStream deduplicates publishes by, within the stream's duplicate window.
pub const MSG_ID_HEADER: &str = "Nats-Msg-Id";

/// NATS JetStream's [`BrokerKind`](idemq_core::BrokerKind), stamped on every envelope this
/// crate builds: the `broker` label `nats`.
/// [`KeySource::DedupHeader`](idemq_core::KeySource::DedupHeader) reads idemq's
/// [`DEDUP_HEADER`](idemq_core::DEDUP_HEADER), then `Nats-Msg-Id` (what any NATS producer
/// that deduplicates on the server sets).
pub const NATS: idemq_core::BrokerKind = idemq_core::BrokerKind::new(
    "nats",
    &[
        idemq_core::DedupSlot::Header(idemq_core::DEDUP_HEADER),
        idemq_core::DedupSlot::Header(MSG_ID_HEADER),
    ],
);

/// Re-export of the async-nats version this crate is built on.
pub use async_nats;

/// Metric names of this adapter (through the `metrics` facade); the core's names cover
/// messages and settlements.
pub mod metrics {
    /// Counter, label `outcome` (`stored`, `duplicate`, `failed`): publishes by `PubAck`.
    pub const PUBLISHED: &str = "idemq_nats_published_total";
    /// Counter, label `stream`: messages copied to a dead-letter subject.
    pub const DEAD_LETTERS: &str = "idemq_nats_dead_letters_total";
    /// Counter: double acks whose confirmation did not come (the message may be
    /// redelivered after `AckWait`; the dedup record absorbs it).
    pub const ACKS_UNCONFIRMED: &str = "idemq_nats_acks_unconfirmed_total";
    /// Counter: in-progress acks sent for deliveries unsettled past half of `AckWait`.
    pub const PROGRESS: &str = "idemq_nats_progress_acks_total";
    /// Counter, label `op`: settlements of stale deliveries, ignored.
    pub const STALE_SETTLES: &str = "idemq_nats_stale_settles_total";
    /// Counter: redelivered copies of a message the source still held, not handed out.
    pub const REDELIVERED_WHILE_HELD: &str = "idemq_nats_redelivered_while_held_total";
    /// Counter: fetched messages an ordered source gave back to the server (a `-NAK` with a
    /// delay) instead of keeping them behind their subject's held delivery.
    pub const GIVEN_BACK: &str = "idemq_nats_given_back_total";
    /// Counter: given-back messages the server did not redeliver within `AckWait` of their
    /// delay while the source was fetching (settled by another consumer of the durable, or
    /// removed from the stream); their subject stopped waiting for them.
    pub const GIVEN_BACK_MISSING: &str = "idemq_nats_given_back_missing_total";
}

/// Why a NATS client, stream or consumer could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum NatsError {
    /// The server could not be reached or refused the login.
    #[error("cannot connect to nats at {servers}: {reason} (check the URL, that nats-server runs with JetStream enabled (-js), and the credentials in the URL: nats://user:password@host:port or nats://token@host:port)")]
    Connect {
        /// The server list, without credentials.
        servers: String,
        /// The client's answer, without credentials.
        reason: String,
    },
    /// The stream to consume does not exist, or could not be created.
    #[error("stream `{stream}`: {reason}")]
    Stream {
        /// The stream.
        stream: String,
        /// What went wrong and what to do.
        reason: String,
    },
    /// The durable consumer could not be created or updated.
    #[error("consumer `{durable}` on stream `{stream}`: {reason} (a durable's filter subjects and ack policy can only change if the server allows the update; delete it with `nats consumer rm {stream} {durable}` to start over)")]
    Consumer {
        /// The stream.
        stream: String,
        /// The durable consumer's name.
        durable: String,
        /// The server's answer.
        reason: String,
    },
    /// The settings are wrong: the text says what to fix.
    #[error("nats misconfigured: {0}")]
    Config(String),
}
