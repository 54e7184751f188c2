//! Kafka record → [`Envelope`], losslessly.

use bytes::{Bytes, BytesMut};
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
    // SAFETY: the pointer is the live message `msg` borrows; librdkafka only reads it.
    let epoch = unsafe { rdkafka::bindings::rd_kafka_message_leader_epoch(msg.ptr()) };
    let epoch = (epoch >= 0).then(|| epoch.to_string());
    let header_bytes: usize = msg
        .headers()
        .map(|hs| hs.iter().filter_map(|h| h.value).map(<[u8]>::len).sum())
        .unwrap_or(0);
    let mut copy = ValueCopier::for_record(
        msg.key().map_or(0, <[u8]>::len)
            + msg.payload().map_or(0, <[u8]>::len)
            + header_bytes
            + epoch.as_ref().map_or(0, String::len),
    );

    let key = msg.key().map(|k| copy.value(k));
    let payload = copy.value(msg.payload().unwrap_or_default());
    let mut headers = Headers::new();
    if let Some(hs) = msg.headers() {
        for h in hs.iter() {
            match h.value {
                Some(v) => headers.insert(h.key, copy.value(v)),
                None => {
                    headers.insert(h.key, Bytes::new());
                    headers.insert(props::type_of(h.key), NULL_HEADER_TYPE);
                }
            }
        }
    }
    if let Some(epoch) = &epoch {
        headers.insert(props::LEADER_EPOCH, copy.value(epoch.as_bytes()));
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
        key,
        ordering_key: None,
        headers,
        payload,
        timestamp_ms: msg.timestamp().to_millis(),
        delivery_count: Some(1),
        redelivered: false,
    }
}

/// Records up to this size (key, payload and header values together) share one buffer.
/// Above it each value gets its own: a handler that keeps only the key of a large record
/// must not keep its payload alive.
const SHARED_BUFFER_MAX: usize = 4096;

/// Owned copies of one record's values. A small record's values are copied into one buffer
/// and handed out as parts of it: one allocation (and one free, on whichever thread drops
/// the last of them) per record instead of one per value. Records are made on the polling
/// thread and dropped on the consumer's; with glibc's allocator every cross-thread free
/// takes the allocating thread's arena lock, and those lock waits were the largest part of
/// the engine's time over this source.
struct ValueCopier {
    /// The record's buffer, sized for all its values up front (so it never reallocates and
    /// every part shares it); `None` above [`SHARED_BUFFER_MAX`].
    shared: Option<BytesMut>,
}

impl ValueCopier {
    fn for_record(total: usize) -> Self {
        Self {
            shared: (total <= SHARED_BUFFER_MAX).then(|| BytesMut::with_capacity(total)),
        }
    }

    fn value(&mut self, v: &[u8]) -> Bytes {
        match &mut self.shared {
            Some(buf) => {
                buf.extend_from_slice(v);
                buf.split().freeze()
            }
            None => Bytes::copy_from_slice(v),
        }
    }
}
