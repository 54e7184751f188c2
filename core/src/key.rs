//! Dedup keys: where the key of a message comes from, namespacing and bounds.
//!
//! The key comes from the business, never by default from the broker: a producer retry
//! gets a new RocketMQ msgId and a Kafka resend a new offset, so a broker id would let the
//! duplicate through. [`KeyStrategy`] extracts it, namespaces it by consumer group (two
//! services may both process order 42) and bounds its length.
//!
//! # Fingerprint encoding
//!
//! [`KeySource::Fingerprint`] produces `fp1:` followed by the lowercase hex SHA-256 of the
//! concatenation, for each field in order, of the field value's UTF-8 length as a 4-byte
//! big-endian integer followed by the UTF-8 bytes. A JSON string field contributes its
//! string value (no quotes); any other JSON value contributes its compact JSON text with
//! object keys sorted. Any language can compute the same key:
//!
//! ```text
//! fingerprint(["42", "u7", "pay"]) = "fp1:" + hex(sha256(00000002 "42" 00000002 "u7" 00000003 "pay"))
//! ```
//!
//! # Oversize keys
//!
//! A business key longer than [`KeyStrategy::max_key_bytes`] (or containing a NUL byte) is,
//! by default, replaced by
//! `#sha256:` and the lowercase hex SHA-256 of its bytes (72 bytes), so the stored key is
//! bounded whatever the producer sends. [`OversizeKey::Reject`] turns that into an error.
//! Raw keys that begin with `#` are stored with a second `#` in front, so the hashed and the
//! raw namespaces never meet ([`HASHED_KEY_PREFIX`]).
//!
//! JSON pointer keys take the field's text: the number `42` and the string `"42"` give the
//! same key `42`. That is deliberate (producers drift between the two for ids); a payload
//! conflict check still tells different payloads apart.

use crate::envelope::{DedupSlot, Envelope};
use bytes::Bytes;
use sha2::{Digest, Sha256};
use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

/// The longest consumer group name accepted.
pub const MAX_GROUP_LEN: usize = 64;
/// Default bound on the business part of a key before it is hashed.
pub const DEFAULT_MAX_KEY_BYTES: usize = 128;
/// The longest a stored [`DedupKey`] can be: group, separator, and a bounded business key.
/// Stores size their key columns for this.
pub const MAX_DEDUP_KEY_BYTES: usize = MAX_GROUP_LEN + 1 + 192;

/// Why no dedup key could be derived. The message is rejected (dead-lettered) with this
/// reason, never processed without a key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// The configured header is absent.
    #[error(
        "message has no header `{0}`: the producer must set it, or configure another key strategy"
    )]
    MissingHeader(String),
    /// [`KeySource::DedupHeader`] found no key in any of the slots it reads on this broker;
    /// the text names each of them.
    #[error("message has no dedup key: none of {0} is set; publish with OutgoingMessage::with_dedup_key (or set one of them at the producer), or configure another key strategy")]
    MissingDedupKey(String),
    /// The message has no broker key.
    #[error("message has no message key (Kafka key / RocketMQ keys / AMQP message_id): set one at the producer, or configure another key strategy")]
    MissingMessageKey,
    /// The broker gave no message id.
    #[error(
        "message has no broker message id; the broker-id strategy cannot be used for this source"
    )]
    MissingMessageId,
    /// The key source yielded an empty value.
    #[error("dedup key from {0} is empty: the producer sent an empty value")]
    Empty(String),
    /// The payload is not JSON, so a JSON pointer cannot be read.
    #[error("payload is not valid JSON ({0}); cannot read the key at JSON pointer `{1}`")]
    MalformedPayload(String, String),
    /// The JSON pointer matched nothing.
    #[error("payload has no value at JSON pointer `{0}`")]
    MissingField(String),
    /// The JSON pointer matched `null`: the producer sent the field without a value.
    #[error("payload has null at JSON pointer `{0}`: the producer sent the field without a value")]
    NullField(String),
    /// A JSON pointer that does not start with `/`.
    #[error("`{0}` is not a JSON pointer: it must start with `/` (RFC 6901), e.g. `/order/id`")]
    InvalidPointer(String),
    /// The empty JSON pointer, which names the whole payload: every payload would be its
    /// own key, so a resend that differs in any byte would run again.
    #[error("the empty JSON pointer names the whole payload, not a field: point at the id the producer sends (e.g. `/payment_id`), or key on several fields with KeyStrategy::fingerprint")]
    EmptyPointer,
    /// The key is not UTF-8.
    #[error("dedup key from {0} is not valid UTF-8")]
    NotUtf8(String),
    /// The key is longer than the bound and the policy is [`OversizeKey::Reject`].
    #[error("dedup key is {len} bytes, more than the {max}-byte limit: shorten it at the producer or use OversizeKey::Hash")]
    TooLong {
        /// The key's length in bytes.
        len: usize,
        /// The configured bound.
        max: usize,
    },
    /// The consumer group name is unusable.
    #[error("invalid consumer group `{0}`: use 1 to 64 characters from A-Z a-z 0-9 . _ -")]
    InvalidGroup(String),
    /// A fingerprint needs at least one field.
    #[error("a fingerprint needs at least one field")]
    EmptyFingerprint,
    /// A user-supplied key function failed.
    #[error("custom key function failed: {0}")]
    Custom(String),
}

impl KeyError {
    /// A short name of the error's kind, the `reason` label of
    /// [`KEY_ERRORS`](crate::metrics::KEY_ERRORS).
    pub fn kind(&self) -> &'static str {
        match self {
            KeyError::MissingHeader(_) => "missing_header",
            KeyError::MissingDedupKey(_) => "missing_dedup_key",
            KeyError::MissingMessageKey => "missing_message_key",
            KeyError::MissingMessageId => "missing_message_id",
            KeyError::Empty(_) => "empty",
            KeyError::MalformedPayload(..) => "malformed_payload",
            KeyError::MissingField(_) => "missing_field",
            KeyError::NullField(_) => "null_field",
            KeyError::InvalidPointer(_) | KeyError::EmptyPointer => "invalid_pointer",
            KeyError::NotUtf8(_) => "not_utf8",
            KeyError::TooLong { .. } => "too_long",
            KeyError::InvalidGroup(_) => "invalid_group",
            KeyError::EmptyFingerprint => "empty_fingerprint",
            KeyError::Custom(_) => "custom",
        }
    }
}

/// A validated consumer group: the namespace of a set of keys.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ConsumerGroup(Arc<str>);

impl ConsumerGroup {
    /// Validates a group name: 1–64 characters of `A-Z a-z 0-9 . _ -`.
    ///
    /// ```
    /// use idemq_core::ConsumerGroup;
    /// assert!(ConsumerGroup::new("payments").is_ok());
    /// assert!(ConsumerGroup::new("").is_err());
    /// assert!(ConsumerGroup::new("a:b").is_err());
    /// ```
    pub fn new(name: &str) -> Result<Self, KeyError> {
        let ok = !name.is_empty()
            && name.len() <= MAX_GROUP_LEN
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
        if ok {
            Ok(Self(name.into()))
        } else {
            Err(KeyError::InvalidGroup(name.to_string()))
        }
    }
    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A namespaced, bounded dedup key: `<group>:<business key>`.
///
/// The group cannot contain `:`, so the split is unambiguous.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DedupKey(Arc<str>);

impl DedupKey {
    /// Builds `<group>:<key>`, hashing `key` when it is longer than `max_key_bytes`.
    pub fn new(group: &ConsumerGroup, key: &str) -> Result<Self, KeyError> {
        build_key(group, key, DEFAULT_MAX_KEY_BYTES, OversizeKey::Hash)
    }
    /// Rebuilds a key read back from a store, without validation.
    pub fn from_stored(s: impl Into<Arc<str>>) -> Self {
        Self(s.into())
    }
    /// The full stored form.
    pub fn as_str(&self) -> &str {
        &self.0
    }
    /// The consumer group part.
    pub fn group(&self) -> &str {
        self.0.split_once(':').map_or("", |(g, _)| g)
    }
    /// The business key part (after `<group>:`; the `#sha256:` form for an oversize key).
    /// This is what a bridge carries on as the dedup key of a forwarded message, so the
    /// consumers on the other side dedup on the same business key.
    ///
    /// ```
    /// use idemq_core::{ConsumerGroup, DedupKey};
    /// let key = DedupKey::new(&ConsumerGroup::new("billing").unwrap(), "pay-1").unwrap();
    /// assert_eq!(key.business_key(), "pay-1");
    /// ```
    pub fn business_key(&self) -> &str {
        self.0.split_once(':').map_or(&self.0, |(_, k)| k)
    }
}

impl fmt::Display for DedupKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// What to do with a business key longer than the bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OversizeKey {
    /// Replace it by `#sha256:<hex>` (the default).
    #[default]
    Hash,
    /// Reject the message with [`KeyError::TooLong`].
    Reject,
}

/// One field of a fingerprint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Field {
    /// A header's value.
    Header(String),
    /// A JSON pointer into the payload.
    JsonPointer(String),
    /// The message key.
    MessageKey,
}

/// A user-supplied key function.
pub type KeyFn = Arc<dyn Fn(&Envelope) -> Result<String, KeyError> + Send + Sync>;

/// Where the business key comes from.
#[derive(Clone)]
pub enum KeySource {
    /// A header / property, e.g. `x-idempotency-key`.
    Header(String),
    /// The broker message key (Kafka key, RocketMQ `keys`, AMQP `message_id`).
    ///
    /// Only when the producer sets it per *message*. A Kafka record key is usually an
    /// *entity* key (all events of order 42 share it, for partitioning): used as a dedup key
    /// it would make the second event of order 42 a duplicate (or, with the payload check,
    /// a conflict). Use a header or payload field for Kafka.
    MessageKey,
    /// A JSON pointer (RFC 6901) into a JSON payload, e.g. `/payment/id`.
    JsonPointer(String),
    /// A stable hash over several fields (see the module docs for the encoding).
    Fingerprint(Vec<Field>),
    /// The broker's own message id. Opt-in: producer retries get new ids on some brokers.
    BrokerMessageId,
    /// The key an idemq [`Publisher`](crate::publish::Publisher) wrote, or a producer
    /// outside idemq put where its broker keeps one: the [`DedupSlot`]s of the envelope's
    /// [`BrokerKind`](crate::BrokerKind), in order, as its adapter declares them (typically
    /// the [`DEDUP_HEADER`](crate::envelope::DEDUP_HEADER) header first, then the broker's
    /// native places; see each adapter's constant). A message with none of them is
    /// dead-lettered with a reason naming every slot looked in.
    DedupHeader,
    /// A closure.
    Custom(KeyFn),
}

impl fmt::Debug for KeySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeySource::Header(h) => f.debug_tuple("Header").field(h).finish(),
            KeySource::MessageKey => f.write_str("MessageKey"),
            KeySource::JsonPointer(p) => f.debug_tuple("JsonPointer").field(p).finish(),
            KeySource::Fingerprint(fs) => f.debug_tuple("Fingerprint").field(fs).finish(),
            KeySource::BrokerMessageId => f.write_str("BrokerMessageId"),
            KeySource::DedupHeader => f.write_str("DedupHeader"),
            KeySource::Custom(_) => f.write_str("Custom(..)"),
        }
    }
}

/// Derives the [`DedupKey`] of an envelope.
///
/// ```
/// use idemq_core::{Envelope, BrokerKind, KeyStrategy, KeyError};
/// let keys = KeyStrategy::json_pointer("payments", "/payment_id").unwrap();
/// let env = Envelope::new(BrokerKind::MEMORY, "callbacks", r#"{"payment_id":"p-1"}"#);
/// assert_eq!(keys.derive(&env).unwrap().as_str(), "payments:p-1");
///
/// let bad = Envelope::new(BrokerKind::MEMORY, "callbacks", "not json");
/// assert!(matches!(keys.derive(&bad), Err(KeyError::MalformedPayload(..))));
/// ```
#[derive(Debug, Clone)]
pub struct KeyStrategy {
    source: KeySource,
    group: ConsumerGroup,
    max_key_bytes: usize,
    oversize: OversizeKey,
}

impl KeyStrategy {
    /// A strategy for `group` reading keys from `source`.
    pub fn new(group: &str, source: KeySource) -> Result<Self, KeyError> {
        let group = ConsumerGroup::new(group)?;
        match &source {
            KeySource::JsonPointer(p) => check_pointer(p)?,
            KeySource::Fingerprint(fields) => {
                if fields.is_empty() {
                    return Err(KeyError::EmptyFingerprint);
                }
                for f in fields {
                    if let Field::JsonPointer(p) = f {
                        check_pointer(p)?;
                    }
                }
            }
            _ => {}
        }
        Ok(Self {
            source,
            group,
            max_key_bytes: DEFAULT_MAX_KEY_BYTES,
            oversize: OversizeKey::Hash,
        })
    }
    /// Key from a header.
    pub fn header(group: &str, name: &str) -> Result<Self, KeyError> {
        Self::new(group, KeySource::Header(name.to_string()))
    }
    /// Key from the broker message key (see the caveat on [`KeySource::MessageKey`]).
    pub fn message_key(group: &str) -> Result<Self, KeyError> {
        Self::new(group, KeySource::MessageKey)
    }
    /// Key from a JSON pointer into the payload.
    pub fn json_pointer(group: &str, pointer: &str) -> Result<Self, KeyError> {
        Self::new(group, KeySource::JsonPointer(pointer.to_string()))
    }
    /// Key from a fingerprint over fields.
    pub fn fingerprint(group: &str, fields: Vec<Field>) -> Result<Self, KeyError> {
        Self::new(group, KeySource::Fingerprint(fields))
    }
    /// Key from the broker's message id (opt-in; see [`KeySource::BrokerMessageId`]).
    pub fn broker_message_id(group: &str) -> Result<Self, KeyError> {
        Self::new(group, KeySource::BrokerMessageId)
    }
    /// Key from what an idemq publisher wrote (see [`KeySource::DedupHeader`]): the right
    /// choice for messages produced with
    /// [`OutgoingMessage::with_dedup_key`](crate::publish::OutgoingMessage::with_dedup_key),
    /// and for relays across brokers.
    pub fn dedup_header(group: &str) -> Result<Self, KeyError> {
        Self::new(group, KeySource::DedupHeader)
    }
    /// Key from a closure.
    pub fn custom(
        group: &str,
        f: impl Fn(&Envelope) -> Result<String, KeyError> + Send + Sync + 'static,
    ) -> Result<Self, KeyError> {
        Self::new(group, KeySource::Custom(Arc::new(f)))
    }
    /// Bound on the business key in bytes (at most 192); longer keys are hashed or rejected.
    pub fn max_key_bytes(mut self, max: usize) -> Self {
        self.max_key_bytes = max.clamp(1, 192);
        self
    }
    /// What to do with an oversize key.
    pub fn oversize(mut self, policy: OversizeKey) -> Self {
        self.oversize = policy;
        self
    }
    /// The consumer group.
    pub fn group(&self) -> &ConsumerGroup {
        &self.group
    }

    /// Derives the key, or says why there is none.
    pub fn derive(&self, env: &Envelope) -> Result<DedupKey, KeyError> {
        // Borrowed where the envelope already holds the text (headers, the message key): one
        // allocation per key, the key's own.
        let raw: Cow<'_, str> = match &self.source {
            KeySource::Header(name) => {
                let v = env
                    .headers
                    .get(name)
                    .ok_or_else(|| KeyError::MissingHeader(name.clone()))?;
                Cow::Borrowed(utf8(v, || format!("header `{name}`"))?)
            }
            KeySource::MessageKey => {
                let v = env.key.as_ref().ok_or(KeyError::MissingMessageKey)?;
                Cow::Borrowed(utf8(v, || "the message key".to_string())?)
            }
            KeySource::JsonPointer(p) => {
                let doc = parse_json(&env.payload, p)?;
                Cow::Owned(json_field(&doc, p)?)
            }
            KeySource::Fingerprint(fields) => Cow::Owned(fingerprint_fields(env, fields)?),
            KeySource::BrokerMessageId => Cow::Borrowed(
                env.message_id
                    .as_deref()
                    .ok_or(KeyError::MissingMessageId)?,
            ),
            KeySource::DedupHeader => dedup_header_key(env)?,
            KeySource::Custom(f) => Cow::Owned(f(env)?),
        };
        if raw.is_empty() {
            return Err(KeyError::Empty(self.describe_source()));
        }
        build_key(&self.group, &raw, self.max_key_bytes, self.oversize)
    }

    /// Where this strategy reads keys, for messages to an operator (`JSON pointer
    /// `/payment_id``, `header `x-idempotency-key``).
    pub fn describe_source(&self) -> String {
        match &self.source {
            KeySource::Header(h) => format!("header `{h}`"),
            KeySource::MessageKey => "the message key".into(),
            KeySource::JsonPointer(p) => format!("JSON pointer `{p}`"),
            KeySource::Fingerprint(_) => "fingerprint".into(),
            KeySource::BrokerMessageId => "the broker message id".into(),
            KeySource::DedupHeader => format!("header `{}`", crate::envelope::DEDUP_HEADER),
            KeySource::Custom(_) => "custom key function".into(),
        }
    }
}

impl DedupSlot {
    fn read(self, env: &Envelope) -> Result<Option<&str>, KeyError> {
        let raw: Option<&[u8]> = match self {
            DedupSlot::Header(h) => env.headers.get(h).map(|v| v.as_ref()),
            DedupSlot::MessageId => return Ok(env.message_id.as_deref()),
            DedupSlot::Custom { read, .. } => read(env),
        };
        raw.map(|v| {
            std::str::from_utf8(v).map_err(|_| KeyError::NotUtf8(self.describe(env.broker)))
        })
        .transpose()
    }
}

/// The first slot that holds a value; an empty value is an error naming its slot (a
/// producer bug, not a reason to look further).
fn dedup_header_key(env: &Envelope) -> Result<Cow<'_, str>, KeyError> {
    let slots = env.broker.dedup_slots();
    for slot in slots {
        if let Some(v) = slot.read(env)? {
            if v.is_empty() {
                return Err(KeyError::Empty(slot.describe(env.broker)));
            }
            return Ok(Cow::Borrowed(v));
        }
    }
    let looked_in: Vec<String> = slots.iter().map(|s| s.describe(env.broker)).collect();
    Err(KeyError::MissingDedupKey(looked_in.join(", ")))
}

/// What a hashed business key starts with. Raw keys that start with `#` are stored with one
/// more `#`, so no raw key can ever equal a hashed one (a producer sending the literal text
/// `#sha256:<hex>` gets `##sha256:<hex>`).
pub const HASHED_KEY_PREFIX: &str = "#sha256:";

fn build_key(
    group: &ConsumerGroup,
    raw: &str,
    max: usize,
    oversize: OversizeKey,
) -> Result<DedupKey, KeyError> {
    let escape = raw.starts_with('#');
    let hashed = || {
        format!(
            "{HASHED_KEY_PREFIX}{}",
            hex::encode(Sha256::digest(raw.as_bytes()))
        )
    };
    // A NUL byte is refused by PostgreSQL text and truncates C strings elsewhere: such a key
    // is stored hashed, like an oversize one, so every store accepts it.
    let hashed_form = if raw.contains('\0') {
        Some(hashed())
    } else if raw.len() + usize::from(escape) > max {
        match oversize {
            OversizeKey::Reject => {
                return Err(KeyError::TooLong {
                    len: raw.len(),
                    max,
                })
            }
            OversizeKey::Hash => Some(hashed()),
        }
    } else {
        None
    };
    let g = group.as_str();
    // Assembled in a per-thread buffer and copied once into the key's `Arc<str>`: building
    // a `String` and converting it would allocate twice per message.
    thread_local! {
        static SCRATCH: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
    }
    let key: Arc<str> = SCRATCH.with(|cell| {
        let mut key = cell.borrow_mut();
        key.clear();
        key.push_str(g);
        key.push(':');
        match &hashed_form {
            Some(h) => key.push_str(h),
            None => {
                if escape {
                    key.push('#');
                }
                key.push_str(raw);
            }
        }
        let built = Arc::from(key.as_str());
        // A rare giant key must not pin its capacity in every thread for good.
        if key.capacity() > 4096 {
            *key = String::new();
        }
        built
    });
    Ok(DedupKey(key))
}

fn check_pointer(p: &str) -> Result<(), KeyError> {
    if p.is_empty() {
        Err(KeyError::EmptyPointer)
    } else if p.starts_with('/') {
        Ok(())
    } else {
        Err(KeyError::InvalidPointer(p.to_string()))
    }
}

fn utf8(v: &Bytes, what: impl Fn() -> String) -> Result<&str, KeyError> {
    std::str::from_utf8(v).map_err(|_| KeyError::NotUtf8(what()))
}

fn parse_json(payload: &[u8], pointer: &str) -> Result<serde_json::Value, KeyError> {
    serde_json::from_slice(payload)
        .map_err(|e| KeyError::MalformedPayload(e.to_string(), pointer.to_string()))
}

fn json_field(doc: &serde_json::Value, pointer: &str) -> Result<String, KeyError> {
    match doc.pointer(pointer) {
        None => Err(KeyError::MissingField(pointer.to_string())),
        Some(serde_json::Value::Null) => Err(KeyError::NullField(pointer.to_string())),
        Some(serde_json::Value::String(s)) => Ok(s.clone()),
        // serde_json's default map is ordered by key, so this text is canonical.
        Some(other) => Ok(other.to_string()),
    }
}

fn fingerprint_fields(env: &Envelope, fields: &[Field]) -> Result<String, KeyError> {
    let mut doc: Option<serde_json::Value> = None;
    let mut values = Vec::with_capacity(fields.len());
    for f in fields {
        let v = match f {
            Field::Header(h) => utf8(
                env.headers
                    .get(h)
                    .ok_or_else(|| KeyError::MissingHeader(h.clone()))?,
                || format!("header `{h}`"),
            )?
            .to_string(),
            Field::MessageKey => {
                utf8(env.key.as_ref().ok_or(KeyError::MissingMessageKey)?, || {
                    "the message key".to_string()
                })?
                .to_string()
            }
            Field::JsonPointer(p) => {
                if doc.is_none() {
                    doc = Some(parse_json(&env.payload, p)?);
                }
                match &doc {
                    Some(d) => json_field(d, p)?,
                    None => return Err(KeyError::MissingField(p.clone())),
                }
            }
        };
        values.push(v);
    }
    Ok(fingerprint(values.iter().map(String::as_str)))
}

/// The fingerprint of a list of values (see the module docs for the encoding).
///
/// ```
/// assert_eq!(
///     idemq_core::key::fingerprint(["42", "u7", "pay"]),
///     idemq_core::key::fingerprint(vec!["42", "u7", "pay"]),
/// );
/// assert_ne!(idemq_core::key::fingerprint(["4", "2"]), idemq_core::key::fingerprint(["42"]));
/// ```
pub fn fingerprint<'a>(values: impl IntoIterator<Item = &'a str>) -> String {
    let mut h = Sha256::new();
    for v in values {
        h.update((v.len() as u32).to_be_bytes());
        h.update(v.as_bytes());
    }
    format!("fp1:{}", hex::encode(h.finalize()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::BrokerKind;

    fn env(payload: &str) -> Envelope {
        Envelope::new(BrokerKind::MEMORY, "t", payload.to_string())
    }

    #[test]
    fn the_empty_pointer_is_refused_with_a_hint_to_a_field_or_a_fingerprint() {
        let err = KeyStrategy::json_pointer("g", "").unwrap_err();
        assert_eq!(err, KeyError::EmptyPointer);
        let text = err.to_string();
        assert!(
            text.contains("whole payload") && text.contains("KeyStrategy::fingerprint"),
            "{text}"
        );
        let in_fingerprint =
            KeyStrategy::fingerprint("g", vec![Field::JsonPointer(String::new())]).unwrap_err();
        assert_eq!(in_fingerprint, KeyError::EmptyPointer);
    }

    #[test]
    fn a_null_field_is_named_null_and_a_missing_one_missing() {
        let k = KeyStrategy::json_pointer("g", "/payment_id").unwrap();
        let null = k.derive(&env(r#"{"payment_id":null}"#)).unwrap_err();
        assert_eq!(null, KeyError::NullField("/payment_id".into()));
        assert!(null.to_string().contains("null"), "{null}");
        let missing = k.derive(&env(r#"{"id":7}"#)).unwrap_err();
        assert_eq!(missing, KeyError::MissingField("/payment_id".into()));
        assert_eq!(
            (null.kind(), missing.kind()),
            ("null_field", "missing_field")
        );
    }

    #[test]
    fn a_message_without_the_key_header_is_a_typed_error_naming_the_header() {
        let k = KeyStrategy::header("g", "x-idempotency-key").unwrap();
        let err = k.derive(&env("{}")).unwrap_err();
        assert_eq!(err, KeyError::MissingHeader("x-idempotency-key".into()));
        assert!(err.to_string().contains("x-idempotency-key"));
    }

    #[test]
    fn a_message_without_a_message_key_is_a_typed_error() {
        let k = KeyStrategy::message_key("g").unwrap();
        assert_eq!(k.derive(&env("{}")), Err(KeyError::MissingMessageKey));
    }

    #[test]
    fn an_empty_key_is_an_error_not_a_shared_empty_key() {
        let k = KeyStrategy::header("g", "id").unwrap();
        let e = env("{}").with_header("id", "");
        assert!(matches!(k.derive(&e), Err(KeyError::Empty(_))));
    }

    #[test]
    fn malformed_json_for_a_pointer_key_names_the_pointer() {
        let k = KeyStrategy::json_pointer("g", "/order/id").unwrap();
        let err = k.derive(&env("{not json")).unwrap_err();
        assert!(matches!(err, KeyError::MalformedPayload(_, ref p) if p == "/order/id"));
        assert!(err.to_string().contains("not valid JSON"));
    }

    #[test]
    fn pointer_keys_read_strings_and_numbers_and_reject_null() {
        let k = KeyStrategy::json_pointer("g", "/order/id").unwrap();
        assert_eq!(
            k.derive(&env(r#"{"order":{"id":"o-1"}}"#))
                .unwrap()
                .as_str(),
            "g:o-1"
        );
        assert_eq!(
            k.derive(&env(r#"{"order":{"id":42}}"#)).unwrap().as_str(),
            "g:42"
        );
        assert_eq!(
            k.derive(&env(r#"{"order":{"id":null}}"#)),
            Err(KeyError::NullField("/order/id".into()))
        );
    }

    #[test]
    fn a_pointer_without_leading_slash_is_rejected_at_configuration() {
        assert_eq!(
            KeyStrategy::json_pointer("g", "order.id").unwrap_err(),
            KeyError::InvalidPointer("order.id".into())
        );
    }

    #[test]
    fn oversize_keys_are_hashed_by_default_and_rejected_on_request() {
        let long = "x".repeat(1000);
        let k = KeyStrategy::header("g", "id").unwrap();
        let e = env("{}").with_header("id", long.clone());
        let key = k.derive(&e).unwrap();
        assert!(key.as_str().starts_with("g:#sha256:"));
        assert_eq!(key.as_str().len(), 2 + 8 + 64);
        assert!(key.as_str().len() <= MAX_DEDUP_KEY_BYTES);
        // the same long key hashes to the same dedup key
        assert_eq!(key, k.derive(&e).unwrap());

        let strict = k.oversize(OversizeKey::Reject);
        assert_eq!(
            strict.derive(&e),
            Err(KeyError::TooLong {
                len: 1000,
                max: 128
            })
        );
    }

    #[test]
    fn a_key_with_a_nul_byte_is_stored_hashed() {
        let k = KeyStrategy::header("g", "id").unwrap();
        let key = k.derive(&env("{}").with_header("id", "a\0b")).unwrap();
        assert!(key.as_str().starts_with("g:#sha256:"), "{key}");
        assert!(!key.as_str().contains('\0'));
        assert_ne!(key, k.derive(&env("{}").with_header("id", "a\0c")).unwrap());
    }

    #[test]
    fn an_empty_or_hostile_consumer_group_is_rejected() {
        for bad in ["", "a:b", "a b", "x'; DROP TABLE t; --", &"g".repeat(65)] {
            assert!(
                matches!(
                    KeyStrategy::header(bad, "id"),
                    Err(KeyError::InvalidGroup(_))
                ),
                "{bad:?} accepted"
            );
        }
        let msg = KeyStrategy::message_key("").unwrap_err().to_string();
        assert!(msg.contains("consumer group"), "{msg}");
    }

    #[test]
    fn keys_are_namespaced_by_group() {
        let a = KeyStrategy::message_key("billing").unwrap();
        let b = KeyStrategy::message_key("shipping").unwrap();
        let e = env("{}").with_key("order-42");
        assert_ne!(a.derive(&e).unwrap(), b.derive(&e).unwrap());
        assert_eq!(a.derive(&e).unwrap().group(), "billing");
    }

    #[test]
    fn fingerprint_is_stable_and_matches_the_documented_encoding() {
        let k = KeyStrategy::fingerprint(
            "g",
            vec![
                Field::JsonPointer("/order_id".into()),
                Field::JsonPointer("/user_id".into()),
                Field::Header("action".into()),
            ],
        )
        .unwrap();
        let e = env(r#"{"user_id":"u7","order_id":42}"#).with_header("action", "pay");
        // Documented encoding, computed by hand.
        let mut manual = Vec::new();
        for v in ["42", "u7", "pay"] {
            manual.extend_from_slice(&(v.len() as u32).to_be_bytes());
            manual.extend_from_slice(v.as_bytes());
        }
        let expected = format!("g:fp1:{}", hex::encode(Sha256::digest(&manual)));
        assert_eq!(k.derive(&e).unwrap().as_str(), expected);
        // Field order in the payload does not matter; field values do.
        let e2 = env(r#"{"order_id":42,"user_id":"u7"}"#).with_header("action", "pay");
        assert_eq!(k.derive(&e).unwrap(), k.derive(&e2).unwrap());
        let e3 = env(r#"{"order_id":42,"user_id":"u8"}"#).with_header("action", "pay");
        assert_ne!(k.derive(&e).unwrap(), k.derive(&e3).unwrap());
    }

    #[test]
    fn broker_id_and_custom_strategies() {
        let k = KeyStrategy::broker_message_id("g").unwrap();
        assert_eq!(k.derive(&env("{}")), Err(KeyError::MissingMessageId));
        assert_eq!(
            k.derive(&env("{}").with_message_id("m1")).unwrap().as_str(),
            "g:m1"
        );
        let c = KeyStrategy::custom("g", |e| Ok(format!("len-{}", e.payload.len()))).unwrap();
        assert_eq!(c.derive(&env("abc")).unwrap().as_str(), "g:len-3");
    }

    /// A broker whose producers may use a plugin's header or the message id, like
    /// RabbitMQ's (the adapters' own constants are tested in their crates).
    const PLUGGED: BrokerKind = BrokerKind::new(
        "plugged",
        &[
            DedupSlot::Header(crate::envelope::DEDUP_HEADER),
            DedupSlot::Header("x-plugin-key"),
            DedupSlot::MessageId,
        ],
    );

    fn first_word(env: &Envelope) -> Option<&[u8]> {
        let key = env.key.as_deref()?;
        Some(
            key.split(|b| *b == b' ')
                .find(|w| !w.is_empty())
                .unwrap_or_default(),
        )
    }

    /// A broker whose dedup key needs the adapter's own parsing.
    const WORDY: BrokerKind = BrokerKind::new(
        "wordy",
        &[
            DedupSlot::Header(crate::envelope::DEDUP_HEADER),
            DedupSlot::Custom {
                describe: "Wordy `KEYS`",
                read: first_word,
            },
        ],
    );

    #[test]
    fn dedup_header_reads_the_slots_the_broker_kind_declares_in_order() {
        let k = KeyStrategy::dedup_header("g").unwrap();
        let plugin = Envelope::new(PLUGGED, "payments", "{}").with_header("x-plugin-key", "pay-7");
        assert_eq!(k.derive(&plugin).unwrap().as_str(), "g:pay-7");
        // An earlier slot wins over a later one.
        let stamped = plugin.clone().with_message_id("4f0c-random");
        assert_eq!(k.derive(&stamped).unwrap().as_str(), "g:pay-7");
        let ours = stamped
            .clone()
            .with_header(crate::envelope::DEDUP_HEADER, "pay-8");
        assert_eq!(k.derive(&ours).unwrap().as_str(), "g:pay-8");
        let id_only = Envelope::new(PLUGGED, "payments", "{}").with_message_id("pay-9");
        assert_eq!(k.derive(&id_only).unwrap().as_str(), "g:pay-9");
        // A custom slot is read by the adapter's function.
        let words = Envelope::new(WORDY, "payments", "{}").with_key("  pay-10 order-1");
        assert_eq!(k.derive(&words).unwrap().as_str(), "g:pay-10");
        // A slot the kind does not declare is not read.
        let undeclared = Envelope::new(WORDY, "payments", "{}").with_message_id("pay-11");
        assert!(matches!(
            k.derive(&undeclared),
            Err(KeyError::MissingDedupKey(_))
        ));
        // The memory broker reads idemq's header, then the message id.
        let memory = Envelope::new(BrokerKind::MEMORY, "payments", "{}").with_message_id("pay-12");
        assert_eq!(k.derive(&memory).unwrap().as_str(), "g:pay-12");
    }

    #[test]
    fn a_missing_dedup_key_names_every_slot_looked_in() {
        let k = KeyStrategy::dedup_header("g").unwrap();
        let bare = |b| Envelope::new(b, "payments", "{}");
        let reason = k.derive(&bare(PLUGGED)).unwrap_err().to_string();
        for slot in [
            "idemq-dedup-key",
            "x-plugin-key",
            "plugged message id (`message_id`)",
        ] {
            assert!(reason.contains(slot), "{slot} not named: {reason}");
        }
        let reason = k.derive(&bare(WORDY)).unwrap_err().to_string();
        assert!(
            reason.contains("idemq-dedup-key") && reason.contains("Wordy `KEYS`"),
            "{reason}"
        );
        // An empty value is named by the slot it came from, a custom one included.
        let empty = bare(PLUGGED).with_header("x-plugin-key", "");
        let reason = k.derive(&empty).unwrap_err().to_string();
        assert!(reason.contains("x-plugin-key"), "{reason}");
        let blank = bare(WORDY).with_key("   ");
        assert_eq!(
            k.derive(&blank),
            Err(KeyError::Empty("Wordy `KEYS`".into()))
        );
        let binary = bare(WORDY).with_key(vec![0xff, 0xfe]);
        assert_eq!(
            k.derive(&binary),
            Err(KeyError::NotUtf8("Wordy `KEYS`".into()))
        );
    }

    #[test]
    fn a_raw_key_never_equals_the_hashed_form_of_another() {
        let g = ConsumerGroup::new("g").expect("group");
        let long = "x".repeat(500);
        let hashed = DedupKey::new(&g, &long).expect("hashed key");
        let business = hashed.as_str().trim_start_matches("g:");
        // A producer that sends the hashed text itself as its key gets another key.
        let raw = DedupKey::new(&g, business).expect("raw key");
        assert_ne!(raw, hashed);
        assert_eq!(raw.as_str(), format!("g:#{business}"));
        // The same for a NUL-bearing key and the old unprefixed form.
        let nul = DedupKey::new(&g, "a\0b").expect("nul key");
        let spoof = DedupKey::new(&g, nul.as_str().trim_start_matches("g:")).expect("spoof");
        assert_ne!(nul, spoof);
        let plain = DedupKey::new(&g, &format!("sha256:{}", &business[8..])).expect("plain");
        assert_ne!(plain, hashed);
    }
}
