//! Kafka record → [`Envelope`], losslessly.

use bytes::Bytes;
use idemq_core::envelope::{props, Headers, Position, SourceRef};
use idemq_core::{BrokerKind, Envelope};
use rdkafka::message::{BorrowedMessage, Headers as _};
use rdkafka::Message;

/// The type marker stored under [`props::type_of`] for a Kafka header whose value is null
/// (Kafka distinguishes a null header value from an empty one).
pub const NULL_HEADER_TYPE: &str = "null";

/// Converts a consumed record: key, headers (null values marked), topic/partition/offset,
/// timestamp, and the leader epoch under [`props::LEADER_EPOCH`].
pub fn to_envelope(msg: &BorrowedMessage<'_>, cluster: Option<&str>) -> Envelope {
    let mut headers = Headers::new();
    if let Some(hs) = msg.headers() {
        for h in hs.iter() {
            match h.value {
                Some(v) => headers.insert(h.key, Bytes::copy_from_slice(v)),
                None => {
                    headers.insert(h.key, Bytes::new());
                    headers.insert(props::type_of(h.key), NULL_HEADER_TYPE);
                }
            }
        }
    }
    // SAFETY: the pointer is the live message `msg` borrows; librdkafka only reads it.
    let epoch = unsafe { rdkafka::bindings::rd_kafka_message_leader_epoch(msg.ptr()) };
    if epoch >= 0 {
        headers.insert(props::LEADER_EPOCH, epoch.to_string());
    }
    Envelope {
        broker: BrokerKind::Kafka,
        source: SourceRef {
            cluster: cluster.map(str::to_string),
            name: msg.topic().to_string(),
            partition: Some(msg.partition()),
            position: Some(Position::Offset(msg.offset())),
        },
        message_id: None,
        key: msg.key().map(Bytes::copy_from_slice),
        ordering_key: None,
        headers,
        payload: msg
            .payload()
            .map(Bytes::copy_from_slice)
            .unwrap_or_default(),
        timestamp_ms: msg.timestamp().to_millis(),
        delivery_count: Some(1),
        redelivered: false,
    }
}
