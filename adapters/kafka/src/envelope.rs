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
    // SAFETY: the pointer is the live message `msg` borrows; librdkafka only reads it.
    let epoch = unsafe { rdkafka::bindings::rd_kafka_message_leader_epoch(msg.ptr()) };
    let epoch = (epoch >= 0).then(|| epoch.to_string());
    let wire_headers: Vec<(&str, Option<&[u8]>)> = msg
        .headers()
        .map(|hs| hs.iter().map(|h| (h.key, h.value)).collect())
        .unwrap_or_default();
    // Every value in one list, in this order: key (if any), payload, header values, epoch.
    let mut values: Vec<&[u8]> = Vec::with_capacity(wire_headers.len() + 3);
    values.extend(msg.key());
    values.push(msg.payload().unwrap_or_default());
    values.extend(wire_headers.iter().filter_map(|(_, v)| *v));
    values.extend(epoch.as_deref().map(str::as_bytes));
    let mut copied = copy_values(&values).into_iter();
    let mut next = || copied.next().unwrap_or_default();

    let key = msg.key().map(|_| next());
    let payload = next();
    let mut headers = Headers::new();
    for (name, value) in &wire_headers {
        match value {
            Some(_) => headers.insert(*name, next()),
            None => {
                headers.insert(*name, Bytes::new());
                headers.insert(props::type_of(name), NULL_HEADER_TYPE);
            }
        }
    }
    if epoch.is_some() {
        headers.insert(props::LEADER_EPOCH, next());
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

/// Owned copies of `values`. A small record's values are copied into one buffer and
/// handed out as slices of it: one allocation (and one free, on whichever thread drops
/// the last of them) per record instead of one per value. Records are made on the polling
/// thread and dropped on the consumer's; with glibc's allocator every cross-thread free
/// takes the allocating thread's arena lock, and those lock waits were the largest part of
/// the engine's time over this source.
fn copy_values(values: &[&[u8]]) -> Vec<Bytes> {
    let total: usize = values.iter().map(|v| v.len()).sum();
    if total > SHARED_BUFFER_MAX {
        return values.iter().map(|v| Bytes::copy_from_slice(v)).collect();
    }
    let mut buf = Vec::with_capacity(total);
    let mut ends = Vec::with_capacity(values.len());
    for v in values {
        buf.extend_from_slice(v);
        ends.push(buf.len());
    }
    let buf = Bytes::from(buf);
    let mut start = 0;
    ends.into_iter()
        .map(|end| {
            let part = buf.slice(start..end);
            start = end;
            part
        })
        .collect()
}
