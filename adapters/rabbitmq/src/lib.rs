//! # idemq-rabbitmq: RabbitMQ for idemq (lapin)
//!
//! **What RabbitMQ guarantees.** A queue holds each message until a consumer acks it. With
//! manual acks a delivery stays *unacked* on its channel until settled; when the channel or
//! connection closes (crash, network, broker restart) every unacked delivery goes back to the
//! queue and is delivered again with `redelivered = true` (quorum queues also count it in
//! `x-delivery-count`). So delivery is at least once, and a delivery tag means something only
//! on the channel that produced it. A publisher confirm says the broker took responsibility
//! for a (persistent) message; `mandatory` makes an unroutable message come back instead of
//! vanishing. Nothing in core RabbitMQ drops a duplicate: the community
//! rabbitmq-message-deduplication plugin can (an exchange of type `x-message-deduplication`
//! reading [`PLUGIN_DEDUP_HEADER`]), but its cache is bounded (`x-cache-size`, `x-cache-ttl`)
//! and can be lost, and it cannot see a redelivery of the *same* message after a lost ack.
//! Consumer-side dedup (the idemq engine and a store) therefore stays on either way; the
//! plugin, where present ([`detect_dedup_plugin`]), only saves work.
//!
//! **How settlements map** ([`RabbitSource`], prefetch = `basic.qos`):
//!
//! | settle | effect |
//! |---|---|
//! | `ack` | `basic.ack` of the delivery tag on the channel it came from |
//! | `nack(delay)` | a copy goes, *confirmed*, to the TTL retry queue of the delay's tier (`<queue>.retry.<ms>`, delays rounded up to [`DEFAULT_RETRY_TIERS_MS`]), a quorum queue which dead-letters it back to `<queue>` through [`RETRY_EXCHANGE`] when the TTL ends, *at least once* (kept until `<queue>` confirms it, so a broker restart does not drop it); then the original is acked. Retry queues carry `x-expires` (tier + [`RabbitSourceConfig::retry_queue_idle_expiry`], 30 min by default), so those of a queue nobody consumes any more go away; the source redeclares a tier before it could expire with a message inside. No hot loop, no prefetch slot held while waiting. [`RETRIES`] counts the round trips (added to `delivery_count`). A zero delay is a plain requeue |
//! | `reject(reason)` | a copy goes, confirmed, to the dead-letter queue (`<queue>.dlq` by default) with [`DLQ_REASON`] and [`DLQ_QUEUE`] headers; then the original is acked. A failed publish fails the reject (the engine then nacks), so nothing is lost |
//! | dropped unsettled | `basic.nack` with requeue |
//!
//! Between the confirmed copy and the ack of the original a crash leaves both: a duplicate,
//! which the dedup store absorbs — never a loss. With [`RabbitSourceConfig::ordered`], a nack
//! instead holds the delivery unacked locally (the core's `DelayedRedelivery`) and nothing
//! newer is handed out until it is due, so queue order survives the retry.
//!
//! **What is fenced.** Each channel the source opens is a *generation*. When the channel or
//! connection dies the source reconnects with back-off (and declares its consumer again),
//! and every delivery of the old generation goes stale:
//! [`Settle::is_stale`](idemq_core::Settle::is_stale) is true (the engine gives the claim back
//! instead of running the handler) and its settlements are ignored, so a delivery tag of an
//! old channel can never ack a message of the new one. The broker redelivers those messages
//! and the dedup store recognises the ones already done. `close()` cancels the consumer and
//! closes the channel; dropping the source does the same without waiting (a crash, for the
//! broker).
//!
//! **Every delivery becomes an envelope** ([`to_envelope`], never a panic): header values
//! of every AMQP type are carried as text with their type (arrays and tables nested more
//! than 16 deep are cut to `[...]` / `{...}`), counts such as `x-delivery-count` saturate
//! instead of overflowing. A panic in the background connection task is caught: every later
//! `poll` returns it as an error instead of ending the source as if it had been closed.
//!
//! **Publishing.** [`RabbitPublisher`] implements the core
//! [`Publisher`](idemq_core::Publisher): persistent (`delivery_mode` 2), `mandatory`, one
//! result per message only after the confirm (nack → `Rejected`, returned → `Unroutable`,
//! no confirm in time or a connection lost after sending → `Ambiguous`), with the dedup key in
//! `message_id`, [`PLUGIN_DEDUP_HEADER`] and [`DEDUP_HEADER`](idemq_core::DEDUP_HEADER).
//!
//! ```no_run
//! use idemq_rabbitmq::{QueueType, RabbitSource, RabbitSourceConfig};
//! # async fn f() -> Result<(), idemq_rabbitmq::RabbitError> {
//! let source = RabbitSource::connect(
//!     RabbitSourceConfig::new("amqp://guest:guest@127.0.0.1:5672/%2f", "payments")
//!         .declare(QueueType::Quorum)
//!         .prefetch(100),
//! )
//! .await?;
//! # let _ = source; Ok(()) }
//! ```

#![warn(missing_docs)]

mod fields;
mod publisher;
mod source;
#[cfg(feature = "streams")]
pub mod stream;
mod topology;

pub use publisher::{route, RabbitPublisher, PLUGIN_DEDUP_HEADER};
pub use source::{to_envelope, RabbitSource, RabbitSourceConfig, DLQ_QUEUE, DLQ_REASON, RETRIES};
pub use topology::{
    declare_dedup_exchange, declare_dedup_queue, detect_dedup_plugin, retry_queue_expires_ms,
    retry_queue_name, retry_tier, DedupExchange, DedupPlugin, QueueType, DEDUP_EXCHANGE_TYPE,
    DEDUP_PLUGIN, DEFAULT_RETRY_TIERS_MS, RETRY_EXCHANGE,
};

/// RabbitMQ's [`BrokerKind`](idemq_core::BrokerKind), stamped on every envelope this
/// crate builds (queues and, with feature `streams`, streams): the `broker` label
/// `rabbitmq`. [`KeySource::DedupHeader`](idemq_core::KeySource::DedupHeader) reads, in
/// order, idemq's [`DEDUP_HEADER`](idemq_core::DEDUP_HEADER), the dedup plugin's
/// [`PLUGIN_DEDUP_HEADER`] (what producers written for the plugin set), then AMQP
/// `message_id`. The plugin's header comes before `message_id`: a header set for
/// deduplication is the producer's deliberate key, while some client libraries stamp every
/// message, resends included, with a fresh random `message_id`.
pub const RABBITMQ: idemq_core::BrokerKind = idemq_core::BrokerKind::new(
    "rabbitmq",
    &[
        idemq_core::DedupSlot::Header(idemq_core::DEDUP_HEADER),
        idemq_core::DedupSlot::Header(PLUGIN_DEDUP_HEADER),
        idemq_core::DedupSlot::MessageId,
    ],
);

/// Re-export of the lapin version this crate is built on.
pub use lapin;

/// Metric names of this adapter (through the `metrics` facade); the core's names cover
/// messages and settlements.
pub mod metrics {
    /// Counter, label `tier_ms`: nacks parked in a retry queue.
    pub const RETRIES: &str = "idemq_rabbitmq_retries_total";
    /// Counter, label `queue`: messages copied to a dead-letter queue.
    pub const DEAD_LETTERS: &str = "idemq_rabbitmq_dead_letters_total";
    /// Counter: connections re-established by a source or a publisher.
    pub const RECONNECTS: &str = "idemq_rabbitmq_reconnects_total";
    /// Counter, label `op`: settlements of stale deliveries, ignored.
    pub const STALE_SETTLES: &str = "idemq_rabbitmq_stale_settles_total";
    /// Counter, label `outcome`: publishes by confirm outcome.
    pub const PUBLISHED: &str = "idemq_rabbitmq_published_total";
}

/// Why a RabbitMQ client or declaration failed.
#[derive(Debug, thiserror::Error)]
pub enum RabbitError {
    /// The broker could not be reached or refused the login: check the URL and that it runs.
    #[error("cannot connect to rabbitmq: {0}")]
    Connect(String),
    /// A queue could not be declared (or, declared passively, does not exist).
    #[error("cannot declare queue `{queue}`: {reason} (a queue that exists with other arguments must be deleted or declared the same way)")]
    Declare {
        /// The queue.
        queue: String,
        /// The broker's answer.
        reason: String,
    },
    /// The deduplication plugin is needed but the broker does not have it.
    #[error("cannot declare deduplicating {what}: the broker has no `{}` plugin (exchange type `{}`): enable it with `rabbitmq-plugins enable {}` or publish to a plain exchange; consumer-side dedup works without it. Broker said: {broker}", DEDUP_PLUGIN, DEDUP_EXCHANGE_TYPE, DEDUP_PLUGIN)]
    DedupPluginMissing {
        /// What was being declared.
        what: String,
        /// The broker's answer.
        broker: String,
    },
    /// A channel operation failed.
    #[error("rabbitmq error: {0}")]
    Amqp(#[from] lapin::Error),
    /// The settings are wrong.
    #[error("rabbitmq source misconfigured: {0}")]
    Config(String),
}

/// Opens a lapin connection whose I/O runs on the current tokio runtime, named `name` in the
/// broker's connection list (what the source and the publisher use; handy for your own
/// declarations or a plain consumer beside them).
pub async fn connect(url: &str, name: &str) -> Result<lapin::Connection, RabbitError> {
    let props = lapin::ConnectionProperties::default()
        .with_executor(tokio_executor_trait::Tokio::current())
        .with_reactor(tokio_reactor_trait::Tokio)
        .with_connection_name(name.into());
    lapin::Connection::connect(url, props).await.map_err(|e| {
        // The URL is named without its password; lapin's text is scrubbed of it too.
        RabbitError::Connect(format!(
            "{}: {}",
            idemq_core::secrets::redact_url(url),
            idemq_core::secrets::scrub(&e.to_string(), url)
        ))
    })
}
