//! Between RocketMQ messages and idemq's envelope / outgoing message.
//!
//! `KEYS` rule: the publisher writes the dedup key first, then the message key (when it is a
//! different string), space-separated. Reading back, when the first key equals the
//! [`DEDUP_HEADER`] property the rest is the message key; otherwise the whole `KEYS` value is
//! the message key (messages from other producers).

use bytes::Bytes;
use cheetah_string::CheetahString;
use idemq_core::envelope::{props, Envelope, Position, SourceRef};
use idemq_core::publish::{OutgoingMessage, PublishError, DEDUP_HEADER};
use rocketmq_model::common::message::message_ext::MessageExt;
use rocketmq_model::common::message::message_single::Message;
use rocketmq_model::common::message::{MessageConst, STRING_HASH_SET};

/// The property that carries a dead-lettered message's reason.
pub const DLQ_REASON: &str = "idemq-dlq-reason";
/// The header carrying this delivery's `MessageExt::msg_id` (an offset id that changes on
/// every redelivery: for diagnosis only, never a dedup key).
pub const OFFSET_MSG_ID: &str = "idemq.rocketmq.offset-msg-id";
/// The property that names the topic a dead-lettered message came from.
pub const DLQ_ORIGIN_TOPIC: &str = "idemq-dlq-origin-topic";

const UNIQ_KEY: &str = MessageConst::PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX;

/// The stable broker id of a message: `UNIQ_KEY` (the producer's `SendResult.msg_id`), which
/// survives redelivery; `MessageExt::msg_id` (an offset id) changes on every redelivery.
pub fn stable_message_id(m: &MessageExt) -> String {
    m.properties()
        .get(UNIQ_KEY)
        .map(|v| v.to_string())
        .unwrap_or_else(|| m.msg_id().to_string())
}

fn is_system_property(name: &str) -> bool {
    STRING_HASH_SET.contains(name)
}

/// The envelope of a received message, lossless for what idemq reads.
pub fn to_envelope(m: &MessageExt) -> Envelope {
    let mut env = Envelope::new(
        crate::ROCKETMQ,
        m.topic().to_string(),
        Bytes::copy_from_slice(m.body_slice()),
    );
    env.source = SourceRef {
        cluster: Some(m.broker_name().to_string()),
        name: m.topic().to_string(),
        partition: Some(m.queue_id()),
        position: Some(Position::QueueOffset(m.queue_offset())),
    };
    env.message_id = Some(stable_message_id(m));
    env.headers
        .insert(OFFSET_MSG_ID, Bytes::copy_from_slice(m.msg_id().as_bytes()));
    let reconsumed = u32::try_from(m.reconsume_times()).unwrap_or(0);
    env.delivery_count = Some(reconsumed.saturating_add(1));
    env.redelivered = reconsumed > 0;
    env.timestamp_ms = Some(m.born_timestamp());
    let properties = m.properties();
    for (name, value) in properties.iter() {
        if !is_system_property(name.as_str()) {
            env.headers
                .insert(name.to_string(), Bytes::copy_from_slice(value.as_bytes()));
        }
    }
    if let Some(tags) = m.get_tags() {
        env.headers
            .insert(props::TAGS, Bytes::copy_from_slice(tags.as_bytes()));
    }
    if let Some(keys) = properties.get(MessageConst::PROPERTY_KEYS) {
        let dedup = properties.get(DEDUP_HEADER).map(|v| v.as_str());
        let key = match (dedup, keys.as_str().split_once(MessageConst::KEY_SEPARATOR)) {
            (Some(d), Some((first, rest))) if first == d => Some(rest),
            (Some(d), None) if keys.as_str() == d => None,
            _ => Some(keys.as_str()),
        };
        if let Some(k) = key.filter(|k| !k.is_empty()) {
            env.key = Some(Bytes::copy_from_slice(k.as_bytes()));
        }
    }
    if let Some(sk) = properties.get(MessageConst::PROPERTY_SHARDING_KEY) {
        env.ordering_key = Some(Bytes::copy_from_slice(sk.as_bytes()));
    }
    env
}

/// The first of the space-separated keys in `KEYS` (the envelope's key), the dedup slot
/// [`ROCKETMQ`](crate::ROCKETMQ) declares after idemq's property: `None` without `KEYS`,
/// empty when `KEYS` holds only separators (the core reports that as an empty key).
pub(crate) fn first_key(env: &Envelope) -> Option<&[u8]> {
    let keys = env.key.as_deref()?;
    Some(
        keys.split(|b| *b == b' ')
            .find(|k| !k.is_empty())
            .unwrap_or_default(),
    )
}

/// A property value RocketMQ can carry: UTF-8 without its two separator characters.
fn property_value(name: &str, v: &[u8]) -> Result<String, PublishError> {
    let s = std::str::from_utf8(v).map_err(|_| {
        PublishError::Rejected(format!(
            "property {name} is not UTF-8: RocketMQ properties are strings"
        ))
    })?;
    if s.contains(['\u{1}', '\u{2}']) {
        return Err(PublishError::Rejected(format!(
            "property {name} contains \\u0001 or \\u0002, RocketMQ's property separators"
        )));
    }
    Ok(s.to_string())
}

/// The `KEYS` value: the dedup key first, then the message key (never the msgId).
fn keys_of(msg: &OutgoingMessage) -> Result<Vec<String>, PublishError> {
    let mut keys = Vec::new();
    if let Some(d) = &msg.dedup_key {
        keys.push(property_value("KEYS", d.as_bytes())?);
    }
    if let Some(k) = &msg.key {
        let k = property_value("KEYS", k)?;
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    Ok(keys)
}

/// The RocketMQ message for an outgoing message: dedup key and key in `KEYS`, the ordering
/// key as sharding key, [`props::TAGS`] as tags, every other header as a user property
/// (the dedup key too, under [`DEDUP_HEADER`]).
pub fn to_message(msg: &OutgoingMessage) -> Result<Message, PublishError> {
    let mut b = Message::builder()
        .topic(msg.destination.as_str())
        .body(msg.payload.clone())
        .keys(keys_of(msg)?);
    if let Some(ok) = &msg.ordering_key {
        b = b.sharding_key(property_value("ordering key", ok)?);
    }
    for (name, value) in msg.wire_headers().iter() {
        let v = property_value(name, value)?;
        if name == props::TAGS {
            b = b.tags(v);
            continue;
        }
        b = b
            .raw_property(CheetahString::from(name), v)
            .map_err(|e| PublishError::Rejected(format!("property {name}: {e}")))?;
    }
    b.build()
        .map_err(|e| PublishError::Config(format!("message for {}: {e}", msg.destination)))
}

/// A copy of a received message for the dead-letter topic, with the reason and origin.
pub fn dead_letter_copy(m: &MessageExt, topic: &str, reason: &str) -> Result<Message, String> {
    let mut b = Message::builder().topic(topic).body_slice(m.body_slice());
    let properties = m.properties();
    if let Some(keys) = properties.get(MessageConst::PROPERTY_KEYS) {
        b = b.key(keys.clone());
    }
    if let Some(tags) = m.get_tags() {
        b = b.tags(tags);
    }
    for (name, value) in properties.iter() {
        if !is_system_property(name.as_str()) && name.as_str() != DLQ_REASON {
            b = b
                .raw_property(name.clone(), value.clone())
                .map_err(|e| e.to_string())?;
        }
    }
    let reason = reason.replace(['\u{1}', '\u{2}'], " ");
    b = b
        .raw_property(DLQ_REASON, reason)
        .map_err(|e| e.to_string())?
        .raw_property(DLQ_ORIGIN_TOPIC, m.topic().clone())
        .map_err(|e| e.to_string())?;
    b.build().map_err(|e| e.to_string())
}

#[cfg(test)]
mod conversion_tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    use std::collections::HashMap;

    use idemq_core::testkit::fuzz::text;

    fn message(rng: &mut StdRng) -> (MessageExt, Vec<u8>, HashMap<CheetahString, CheetahString>) {
        let mut properties: HashMap<CheetahString, CheetahString> = HashMap::new();
        for _ in 0..rng.gen_range(0..10) {
            properties.insert(text(rng, 300).into(), text(rng, 3_000).into());
        }
        let dedup = text(rng, 40);
        for (name, value) in [
            (UNIQ_KEY, text(rng, 40)),
            (DEDUP_HEADER, dedup.clone()),
            (
                MessageConst::PROPERTY_KEYS,
                match rng.gen_range(0..3) {
                    0 => format!("{dedup} {}", text(rng, 40)),
                    1 => dedup.clone(),
                    _ => text(rng, 80),
                },
            ),
            (MessageConst::PROPERTY_TAGS, text(rng, 40)),
            (MessageConst::PROPERTY_SHARDING_KEY, text(rng, 40)),
        ] {
            if rng.gen_bool(0.5) {
                properties.insert(name.into(), value.into());
            }
        }
        let most = if rng.gen_bool(0.02) { 200_000 } else { 64 };
        let mut body = vec![0u8; rng.gen_range(0..most)];
        rng.fill(&mut body[..]);
        let mut m = MessageExt::default();
        m.message.set_topic(text(rng, 100).into());
        m.message.set_body(Some(Bytes::from(body.clone())));
        m.message.set_properties(properties.clone());
        m.broker_name = text(rng, 40).into();
        m.queue_id = rng.gen();
        m.queue_offset = rng.gen();
        m.reconsume_times = rng.gen();
        m.born_timestamp = rng.gen();
        m.msg_id = text(rng, 40).into();
        (m, body, properties)
    }

    /// A message as a producer outside idemq sends it: the given `KEYS`, no idemq property.
    fn keyed(keys: Option<&str>) -> MessageExt {
        let mut properties = HashMap::new();
        if let Some(k) = keys {
            properties.insert(CheetahString::from(MessageConst::PROPERTY_KEYS), k.into());
        }
        let mut m = MessageExt::default();
        m.message.set_topic("payments".into());
        m.message.set_properties(properties);
        m
    }

    #[test]
    fn the_dedup_header_strategy_reads_the_first_of_keys() {
        let keys = idemq_core::KeyStrategy::dedup_header("billing").expect("strategy");
        let env = to_envelope(&keyed(Some("pay-7 order-42")));
        assert_eq!(env.broker, crate::ROCKETMQ);
        assert_eq!(keys.derive(&env).expect("key").as_str(), "billing:pay-7");
        // idemq's property comes first.
        let ours = env.clone().with_header(DEDUP_HEADER, "pay-8");
        assert_eq!(keys.derive(&ours).expect("key").as_str(), "billing:pay-8");
        // Without either, the reason names both slots; `KEYS` of separators only is empty.
        let reason = keys
            .derive(&to_envelope(&keyed(None)))
            .expect_err("no key")
            .to_string();
        assert!(
            reason.contains(DEDUP_HEADER) && reason.contains("RocketMQ `KEYS`"),
            "{reason}"
        );
        let mut blank = to_envelope(&keyed(None));
        blank.key = Some(Bytes::from_static(b"   "));
        assert_eq!(
            keys.derive(&blank),
            Err(idemq_core::KeyError::Empty("RocketMQ `KEYS`".into()))
        );
    }

    #[test]
    fn every_message_becomes_an_envelope_whatever_it_holds() {
        for seed in 0..3_000u64 {
            let mut rng = StdRng::seed_from_u64(seed);
            let (m, body, properties) = message(&mut rng);
            let env = to_envelope(&m);
            assert_eq!(&env.payload[..], &body[..], "seed {seed}");
            assert_eq!(env.source.name, m.topic().as_str());
            assert_eq!(env.source.cluster.as_deref(), Some(m.broker_name.as_str()));
            assert_eq!(env.source.partition, Some(m.queue_id));
            assert_eq!(
                env.source.position,
                Some(Position::QueueOffset(m.queue_offset))
            );
            let uniq = properties.get(UNIQ_KEY).map(|v| v.to_string());
            assert_eq!(
                env.message_id,
                Some(uniq.unwrap_or_else(|| m.msg_id.to_string()))
            );
            assert_eq!(env.headers.get_str(OFFSET_MSG_ID), Some(m.msg_id.as_str()));
            let reconsumed = u32::try_from(m.reconsume_times).unwrap_or(0);
            assert_eq!(
                env.delivery_count,
                Some(reconsumed.saturating_add(1)),
                "seed {seed}"
            );
            assert_eq!(env.redelivered, reconsumed > 0);
            assert_eq!(env.timestamp_ms, Some(m.born_timestamp));
            for (name, value) in &properties {
                if !STRING_HASH_SET.contains(name.as_str()) {
                    assert!(
                        env.headers
                            .iter()
                            .any(|(n, v)| n == name.as_str() && v == value.as_bytes()),
                        "seed {seed}: property {name:?} carried"
                    );
                }
            }
            let tags = properties.get(MessageConst::PROPERTY_TAGS);
            assert_eq!(env.headers.get_str(props::TAGS), tags.map(|t| t.as_str()));
            let keys = properties
                .get(MessageConst::PROPERTY_KEYS)
                .map(|k| k.as_str());
            match (&env.key, keys) {
                (Some(k), Some(all)) => {
                    let k = std::str::from_utf8(k).expect("a key from KEYS is text");
                    assert!(
                        !k.is_empty() && all.ends_with(k),
                        "seed {seed}: {k:?} of {all:?}"
                    );
                    if !properties.contains_key(DEDUP_HEADER) {
                        assert_eq!(k, all, "seed {seed}: without a dedup key KEYS is the key");
                    }
                }
                (Some(_), None) => panic!("seed {seed}: a key without KEYS"),
                (None, Some(all)) => assert!(
                    all.is_empty() || properties.contains_key(DEDUP_HEADER),
                    "seed {seed}: KEYS {all:?} lost"
                ),
                (None, None) => {}
            }
            let sharding = properties.get(MessageConst::PROPERTY_SHARDING_KEY);
            assert_eq!(env.ordering_key.as_deref(), sharding.map(|s| s.as_bytes()));
        }
    }
}
