//! The broker-neutral view of one delivery.
//!
//! Adapters convert their native message into an [`Envelope`] without losing anything a
//! handler or a key strategy may need; handlers see only the envelope.

use bytes::Bytes;
use std::fmt;

/// The header every adapter writes the dedup key into (and reads it back from).
pub const DEDUP_HEADER: &str = "idemq-dedup-key";

/// One place where a broker's producers put a dedup key: an adapter lists its slots, in
/// order, in its [`BrokerKind`], and [`KeySource::DedupHeader`](crate::KeySource::DedupHeader) takes the
/// first that holds a value. An empty value is an error naming its slot (a producer bug,
/// not a reason to look further); a value that is not UTF-8 is an error too.
///
/// ```
/// use idemq_core::{BrokerKind, DedupSlot, Envelope, KeyStrategy, DEDUP_HEADER};
/// // A broker whose clients put several space-separated keys in the message key, the
/// // dedup key first.
/// fn first_word(env: &Envelope) -> Option<&[u8]> {
///     let key = env.key.as_deref()?;
///     Some(key.split(|b| *b == b' ').find(|w| !w.is_empty()).unwrap_or_default())
/// }
/// const SPACED: BrokerKind = BrokerKind::new(
///     "spaced",
///     &[
///         DedupSlot::Header(DEDUP_HEADER),
///         DedupSlot::Custom { describe: "the first word of the message key", read: first_word },
///     ],
/// );
/// let keys = KeyStrategy::dedup_header("billing").unwrap();
/// let env = Envelope::new(SPACED, "orders", "{}").with_key("pay-7 order-42");
/// assert_eq!(keys.derive(&env).unwrap().as_str(), "billing:pay-7");
/// let none = keys.derive(&Envelope::new(SPACED, "orders", "{}")).unwrap_err().to_string();
/// assert!(none.contains("the first word of the message key"), "{none}");
/// ```
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum DedupSlot {
    /// A header (or property the adapter copies into [`Envelope::headers`]) of this name.
    Header(&'static str),
    /// The broker's message id, [`Envelope::message_id`], where the broker lets the
    /// producer choose it (AMQP `message_id`, for example).
    MessageId,
    /// A place only the adapter knows how to read: `read` returns the raw value, `None` when
    /// the message has none; `describe` names it in errors (e.g. "RocketMQ `KEYS`").
    Custom {
        /// What the slot is called in the broker's own terms.
        describe: &'static str,
        /// Reads the slot's value from the envelope the adapter built.
        read: fn(&Envelope) -> Option<&[u8]>,
    },
}

impl DedupSlot {
    /// How errors name the slot; `broker` qualifies the message id.
    pub(crate) fn describe(self, broker: crate::BrokerKind) -> String {
        match self {
            DedupSlot::Header(h) => format!("header `{h}`"),
            DedupSlot::MessageId => format!("the {broker} message id (`message_id`)"),
            DedupSlot::Custom { describe, .. } => describe.to_string(),
        }
    }
}

/// Which broker delivered a message: a label its adapter provides, with the places its
/// producers put a dedup key.
///
/// The core names no broker but its own in-process one ([`BrokerKind::MEMORY`]): each
/// adapter defines a constant (`idemq_kafka::KAFKA`, `idemq_rabbitmq::RABBITMQ`, ...) and
/// stamps it on every [`Envelope`] it builds. The name is the `broker` label of the
/// engine's metrics and the `broker` field of its tracing spans, so keep it short,
/// lowercase and stable (`"kafka"`, `"nats"`); nothing checks that at run time.
///
/// Two kinds are equal (and hash alike) when their names are: the name is the identity, the
/// slots are what the adapter says about it. Give one broker one constant.
///
/// ```
/// use idemq_core::{BrokerKind, DedupSlot, Envelope, KeyStrategy, DEDUP_HEADER};
/// // What an adapter for NATS JetStream would export.
/// pub const NATS: BrokerKind =
///     BrokerKind::new("nats", &[DedupSlot::Header(DEDUP_HEADER), DedupSlot::Header("Nats-Msg-Id")]);
///
/// let env = Envelope::new(NATS, "ORDERS", "{}").with_header("Nats-Msg-Id", "order-42");
/// let keys = KeyStrategy::dedup_header("billing").unwrap();
/// assert_eq!(keys.derive(&env).unwrap().as_str(), "billing:order-42");
/// assert_eq!(env.broker.to_string(), "nats");
/// ```
#[derive(Clone, Copy)]
pub struct BrokerKind {
    name: &'static str,
    dedup_slots: &'static [DedupSlot],
}

impl BrokerKind {
    /// The in-process broker of [`crate::broker`], for the embedded default and tests: the
    /// dedup key is idemq's header, else the message id its publisher sets.
    pub const MEMORY: BrokerKind = BrokerKind::new(
        "memory",
        &[DedupSlot::Header(DEDUP_HEADER), DedupSlot::MessageId],
    );

    /// A broker named `name` (the `broker` label of metrics and tracing fields: short and
    /// lowercase) whose producers put a dedup key in `dedup_slots`, read in that order by
    /// [`KeySource::DedupHeader`](crate::KeySource::DedupHeader). List
    /// [`DEDUP_HEADER`] first when the adapter's publisher writes it.
    pub const fn new(name: &'static str, dedup_slots: &'static [DedupSlot]) -> Self {
        Self { name, dedup_slots }
    }

    /// The broker's name, used in metric labels and tracing fields.
    pub const fn as_str(self) -> &'static str {
        self.name
    }

    /// Where its producers put a dedup key, in the order they are read.
    pub const fn dedup_slots(self) -> &'static [DedupSlot] {
        self.dedup_slots
    }
}

/// By name, like equality: an envelope's debug output shows `BrokerKind("kafka")`, not the
/// slot list (see [`BrokerKind::dedup_slots`]).
impl fmt::Debug for BrokerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("BrokerKind").field(&self.name).finish()
    }
}

impl PartialEq for BrokerKind {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
    }
}

impl Eq for BrokerKind {}

impl std::hash::Hash for BrokerKind {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.name.hash(state);
    }
}

impl fmt::Display for BrokerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}

/// Where a delivery sits in its broker: the position the broker acknowledges or commits.
///
/// Variants describe a shape, not a broker; an adapter picks the one that fits (and new
/// shapes may be added, hence `#[non_exhaustive]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Position {
    /// An offset in a partitioned log, committed per partition (a Kafka offset, a
    /// RabbitMQ stream offset, the memory broker's offset).
    Offset(i64),
    /// A tag that identifies the delivery on its connection or channel, meaningless after
    /// it closes (an AMQP delivery tag).
    DeliveryTag(u64),
    /// An offset within one queue of a topic, the queue named by
    /// [`SourceRef::partition`] (a RocketMQ queue offset).
    QueueOffset(i64),
    /// A sequence number in a stream or consumer (a NATS JetStream stream sequence).
    Sequence(u64),
}

/// The topic or queue a delivery came from.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct SourceRef {
    /// The broker or cluster that holds it (a RocketMQ queue id is unique only per broker;
    /// two Kafka clusters may both have a topic `orders`). `None` when there is only one.
    pub cluster: Option<String>,
    /// The topic, queue or stream (e.g. a Kafka topic, a RabbitMQ queue).
    pub name: String,
    /// The partition or queue within it (e.g. a Kafka partition, a RocketMQ queue id);
    /// `None` where the broker has no such division (a RabbitMQ queue).
    pub partition: Option<i32>,
    /// Where the delivery sits, when the broker says.
    pub position: Option<Position>,
}

/// Reserved header names under which adapters keep a broker's native properties that have no
/// field of their own in [`Envelope`], so that a handler or a key strategy can read them the
/// same way on every broker (`KeySource::Header(props::CORRELATION_ID.into())`).
///
/// Each name starts with `idemq.`, a prefix that no adapter copies from the wire.
pub mod props {
    /// AMQP `reply_to`.
    pub const REPLY_TO: &str = "idemq.reply-to";
    /// AMQP `correlation_id`.
    pub const CORRELATION_ID: &str = "idemq.correlation-id";
    /// AMQP `content_type`.
    pub const CONTENT_TYPE: &str = "idemq.content-type";
    /// AMQP `content_encoding`.
    pub const CONTENT_ENCODING: &str = "idemq.content-encoding";
    /// AMQP exchange the message was published to.
    pub const EXCHANGE: &str = "idemq.exchange";
    /// AMQP routing key.
    pub const ROUTING_KEY: &str = "idemq.routing-key";
    /// AMQP `type`.
    pub const MESSAGE_TYPE: &str = "idemq.type";
    /// RocketMQ tags.
    pub const TAGS: &str = "idemq.tags";
    /// Kafka leader epoch of the record.
    pub const LEADER_EPOCH: &str = "idemq.leader-epoch";
    /// The prefix every reserved name carries.
    pub const PREFIX: &str = "idemq.";
    /// The wire type of a header value that is not a byte string (AMQP field tables carry
    /// integers, booleans, tables...): the adapter stores the value's text form under the
    /// header's own name and the type under `idemq.type-of.<name>`, so nothing is lost.
    pub fn type_of(name: &str) -> String {
        format!("idemq.type-of.{name}")
    }
}

/// Message headers (Kafka headers, AMQP properties and headers, RocketMQ user properties).
///
/// Kept as an ordered list because Kafka allows repeated names; [`Headers::get`] returns
/// the first value of a name. Names compare exactly (brokers treat them case-sensitively).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Headers(Vec<(String, Bytes)>);

impl Headers {
    /// No headers.
    pub fn new() -> Self {
        Self(Vec::new())
    }
    /// Appends a header (does not replace an existing one of the same name).
    pub fn insert(&mut self, name: impl Into<String>, value: impl Into<Bytes>) {
        self.0.push((name.into(), value.into()));
    }
    /// Builder form of [`Headers::insert`].
    pub fn with(mut self, name: impl Into<String>, value: impl Into<Bytes>) -> Self {
        self.insert(name, value);
        self
    }
    /// The first value for `name`.
    pub fn get(&self, name: &str) -> Option<&Bytes> {
        self.0.iter().find(|(n, _)| n == name).map(|(_, v)| v)
    }
    /// The first value for `name`, if it is UTF-8.
    pub fn get_str(&self, name: &str) -> Option<&str> {
        self.get(name).and_then(|v| std::str::from_utf8(v).ok())
    }
    /// All headers in delivery order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Bytes)> {
        self.0.iter().map(|(n, v)| (n.as_str(), v))
    }
    /// Number of headers.
    pub fn len(&self) -> usize {
        self.0.len()
    }
    /// True when there are no headers.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// One delivery, as every broker adapter presents it.
///
/// ```
/// use idemq_core::{Envelope, BrokerKind};
/// let env = Envelope::new(BrokerKind::MEMORY, "orders", r#"{"order_id":42}"#)
///     .with_key("order-42")
///     .with_header("x-idempotency-key", "pay-42");
/// assert_eq!(env.headers.get_str("x-idempotency-key"), Some("pay-42"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Envelope {
    /// The broker that delivered it.
    pub broker: BrokerKind,
    /// Topic/queue, partition/queue id and offset/delivery tag.
    pub source: SourceRef,
    /// The broker's own message id (RocketMQ `UNIQ_KEY`, AMQP `message_id`). Not the
    /// default dedup key: a producer retry gets a new one on some brokers.
    pub message_id: Option<String>,
    /// The message key (Kafka record key, RocketMQ `keys`, AMQP `message_id`).
    pub key: Option<Bytes>,
    /// What orders this message relative to others when the consumer runs in per-key
    /// ordering mode: RocketMQ's sharding key, an AMQP header. `None` falls back to
    /// [`Envelope::key`] (the Kafka record key, which is what Kafka orders by); see
    /// [`Envelope::ordering_key`].
    pub ordering_key: Option<Bytes>,
    /// Headers / properties.
    pub headers: Headers,
    /// The body.
    pub payload: Bytes,
    /// Broker or producer timestamp, milliseconds since the Unix epoch.
    pub timestamp_ms: Option<i64>,
    /// How many times the broker has delivered this message (1 = first), when it counts.
    pub delivery_count: Option<u32>,
    /// The broker says this may have been delivered before (AMQP `redelivered`).
    pub redelivered: bool,
}

impl Envelope {
    /// A minimal envelope: broker, topic/queue name and payload.
    pub fn new(broker: BrokerKind, source: impl Into<String>, payload: impl Into<Bytes>) -> Self {
        Self {
            broker,
            source: SourceRef {
                cluster: None,
                name: source.into(),
                partition: None,
                position: None,
            },
            ordering_key: None,
            message_id: None,
            key: None,
            headers: Headers::new(),
            payload: payload.into(),
            timestamp_ms: None,
            delivery_count: None,
            redelivered: false,
        }
    }
    /// Sets the message key.
    pub fn with_key(mut self, key: impl Into<Bytes>) -> Self {
        self.key = Some(key.into());
        self
    }
    /// Adds a header.
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<Bytes>) -> Self {
        self.headers.insert(name, value);
        self
    }
    /// Sets the ordering key (see [`Envelope::ordering_key`]).
    pub fn with_ordering_key(mut self, key: impl Into<Bytes>) -> Self {
        self.ordering_key = Some(key.into());
        self
    }
    /// Sets the partition / queue id.
    pub fn with_partition(mut self, partition: i32) -> Self {
        self.source.partition = Some(partition);
        self
    }
    /// The key that orders this message in per-key mode: the explicit ordering key, else the
    /// message key.
    pub fn effective_ordering_key(&self) -> Option<&Bytes> {
        self.ordering_key.as_ref().or(self.key.as_ref())
    }
    /// Sets the broker message id.
    pub fn with_message_id(mut self, id: impl Into<String>) -> Self {
        self.message_id = Some(id.into());
        self
    }
    /// The W3C trace context of the message ([`TRACEPARENT_HEADER`]), when it carries a
    /// well-formed one. The engine records it on its `idemq.handle` and `idemq.duplicate`
    /// spans, so a duplicate's trace links to the trace that sent the original.
    ///
    /// ```
    /// use idemq_core::{BrokerKind, Envelope};
    /// let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    /// let e = Envelope::new(BrokerKind::MEMORY, "orders", "{}").with_header("traceparent", tp);
    /// assert_eq!(e.traceparent(), Some(tp));
    /// let bad = Envelope::new(BrokerKind::MEMORY, "orders", "{}").with_header("traceparent", "x");
    /// assert_eq!(bad.traceparent(), None);
    /// ```
    pub fn traceparent(&self) -> Option<&str> {
        self.headers
            .get_str(TRACEPARENT_HEADER)
            .filter(|v| is_traceparent(v))
    }
}

/// The W3C Trace Context header (`version-traceid-parentid-flags`). Publishers copy it like
/// any header (a bridge's `forward` keeps it), next to [`crate::DEDUP_HEADER`].
pub const TRACEPARENT_HEADER: &str = "traceparent";

/// `00-<32 hex>-<16 hex>-<2 hex>`, with neither id all zeros (W3C Trace Context §3.2).
fn is_traceparent(v: &str) -> bool {
    let parts: Vec<&str> = v.split('-').collect();
    let hex = |s: &str, n: usize| {
        s.len() == n && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    };
    let nonzero = |s: &str| s.bytes().any(|b| b != b'0');
    parts.len() >= 4
        && hex(parts[0], 2)
        && parts[0] != "ff"
        && hex(parts[1], 32)
        && nonzero(parts[1])
        && hex(parts[2], 16)
        && nonzero(parts[2])
        && hex(parts[3], 2)
        // Version 00 has exactly four fields; later versions may append more.
        && (parts.len() == 4 || parts[0] != "00")
}
