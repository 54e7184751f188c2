//! Kafka record → [`Envelope`]: total, every record becomes one.
//!
//! The record is read through librdkafka's own calls, as bytes, and never through rdkafka's
//! `Headers::get`/`try_get`/`iter`: those turn each header name into a `&str` with an
//! `unwrap`, so a name that is not UTF-8 (any Go or C producer can send one; the broker does
//! not check) panicked on the polling thread. What cannot be carried as it is:
//!
//! - a header **name that is not UTF-8** is carried with every byte that is not part of a
//!   UTF-8 character written as `\xNN` (lowercase hex) and the rest as it is
//!   ([`escape_header_name`]); its value is kept unchanged. Counted in
//!   `idemq_kafka_header_names_escaped_total`. A dead-letter copy of the record carries the
//!   escaped name.
//! - a header name holding a NUL byte is cut at it (librdkafka hands names out as C strings).
//! - **headers librdkafka cannot parse**: the record is carried without them, with
//!   [`UNREADABLE_HEADERS`] saying why; the consumer-group source dead-letters such a record
//!   with that reason instead of handing it to a handler.
//!
//! Key and payload are bytes and taken as they are, whatever their size.

use bytes::{Bytes, BytesMut};
use idemq_core::envelope::{props, Headers, Position, SourceRef};
use idemq_core::Envelope;
use rdkafka::bindings as rdsys;
use rdkafka::message::BorrowedMessage;
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::Message;
use std::borrow::Cow;
use std::ffi::CStr;

/// The type marker stored under [`props::type_of`] for a Kafka header whose value is null
/// (Kafka distinguishes a null header value from an empty one).
pub const NULL_HEADER_TYPE: &str = "null";

/// Reserved header set on the envelope of a record whose headers librdkafka could not parse:
/// the reason. The record carries its key and payload but none of its headers; the
/// consumer-group source dead-letters it with this reason (the copy carries no `idemq.`
/// header), the transactional processor hands it to the transform as it is.
pub const UNREADABLE_HEADERS: &str = "idemq.kafka.unreadable-headers";

/// Converts a consumed record: key, headers (null values marked, names that are not UTF-8
/// escaped), topic/partition/offset, timestamp, and the leader epoch under
/// [`props::LEADER_EPOCH`]. Never panics, whatever the record holds (see the module docs).
pub fn to_envelope(msg: &BorrowedMessage<'_>, cluster: Option<&str>) -> Envelope {
    envelope_of(&read_record(msg), cluster)
}

/// [`to_envelope`], and whether the record's headers could not be read (the envelope then
/// carries [`UNREADABLE_HEADERS`]): the consumer-group source's polling thread learns it
/// here, so the consumer's side never searches each envelope's headers for it.
///
/// Small records' values are copied into `chunks`, shared by the records that follow.
pub(crate) fn convert(
    msg: &BorrowedMessage<'_>,
    cluster: Option<&str>,
    chunks: &mut ValueChunks,
) -> (Envelope, bool) {
    let r = read_record(msg);
    (envelope_in(&r, cluster, chunks), r.headers.is_err())
}

/// The name under which a header called `raw` is carried: `raw` itself when it is UTF-8,
/// else with each byte that is not part of a UTF-8 character written as `\xNN`.
///
/// ```
/// use idemq_kafka::escape_header_name;
/// assert_eq!(escape_header_name(b"trace-id"), "trace-id");
/// assert_eq!(escape_header_name(b"caf\xe9"), "caf\\xe9");
/// assert_eq!(escape_header_name("\u{e9}t\u{e9}".as_bytes()), "\u{e9}t\u{e9}");
/// ```
pub fn escape_header_name(raw: &[u8]) -> Cow<'_, str> {
    if let Ok(s) = std::str::from_utf8(raw) {
        return Cow::Borrowed(s);
    }
    use std::fmt::Write;
    let mut out = String::with_capacity(raw.len() * 2);
    for chunk in raw.utf8_chunks() {
        out.push_str(chunk.valid());
        for b in chunk.invalid() {
            // Writing to a String cannot fail.
            let _ = write!(out, "\\x{b:02x}");
        }
    }
    Cow::Owned(out)
}

/// One header as librdkafka holds it: the name's bytes (up to a NUL), the value (`None`:
/// a null value).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RawHeader<'a> {
    pub(crate) name: &'a [u8],
    pub(crate) value: Option<&'a [u8]>,
}

/// What an envelope is made of, read from a record without interpreting anything.
#[derive(Debug, Clone)]
pub(crate) struct RawRecord<'a> {
    pub(crate) topic: Cow<'a, str>,
    pub(crate) partition: i32,
    pub(crate) offset: i64,
    pub(crate) key: Option<&'a [u8]>,
    pub(crate) payload: Option<&'a [u8]>,
    /// The headers, or why librdkafka could not parse them.
    pub(crate) headers: Result<Vec<RawHeader<'a>>, String>,
    pub(crate) timestamp_ms: Option<i64>,
    /// Negative when the broker did not send one.
    pub(crate) leader_epoch: i32,
}

/// Reads a consumed record's parts.
fn read_record<'a>(msg: &'a BorrowedMessage<'_>) -> RawRecord<'a> {
    let native = msg.ptr();
    // SAFETY: `native` is the live message `msg` borrows; librdkafka only reads it.
    let leader_epoch = unsafe { rdsys::rd_kafka_message_leader_epoch(native) };
    // SAFETY: as above; the headers live as long as the message.
    let headers = unsafe { message_headers(native) };
    RawRecord {
        topic: topic_of(msg),
        partition: msg.partition(),
        offset: msg.offset(),
        key: msg.key(),
        payload: msg.payload(),
        headers,
        timestamp_ms: msg.timestamp().to_millis(),
        leader_epoch,
    }
}

/// The record's topic name (rdkafka's `Message::topic` panics on one that is not UTF-8;
/// Kafka's own rules allow only ASCII, but nothing here relies on that).
fn topic_of<'a>(msg: &'a BorrowedMessage<'_>) -> Cow<'a, str> {
    // SAFETY: `msg.ptr()` is the live message; its topic handle lives as long as it does.
    let rkt = unsafe { (*msg.ptr()).rkt };
    if rkt.is_null() {
        return Cow::Borrowed("");
    }
    // SAFETY: librdkafka returns the topic's NUL-terminated name, owned by the handle.
    let name = unsafe { rdsys::rd_kafka_topic_name(rkt) };
    if name.is_null() {
        return Cow::Borrowed("");
    }
    // SAFETY: `name` is a NUL-terminated string that outlives `msg`'s borrow.
    String::from_utf8_lossy(unsafe { CStr::from_ptr(name) }.to_bytes())
}

/// The headers of a consumed message: none, the list, or why librdkafka could not parse
/// them (it parses them on first access).
///
/// # Safety
/// `msg` must be a live message, and the returned slices must not outlive it.
unsafe fn message_headers<'a>(
    msg: *const rdsys::rd_kafka_message_t,
) -> Result<Vec<RawHeader<'a>>, String> {
    let mut hdrs: *mut rdsys::rd_kafka_headers_t = std::ptr::null_mut();
    let err = rdsys::rd_kafka_message_headers(msg, &mut hdrs);
    match err {
        rdsys::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR if !hdrs.is_null() => {
            Ok(read_headers(hdrs))
        }
        rdsys::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR
        | rdsys::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR__NOENT => Ok(Vec::new()),
        other => Err(format!(
            "librdkafka could not parse the record's headers: {}",
            RDKafkaErrorCode::from(other)
        )),
    }
}

/// Every header of a librdkafka header list, as bytes.
///
/// # Safety
/// `hdrs` must be a live header list, and the returned slices must not outlive it.
pub(crate) unsafe fn read_headers<'a>(
    hdrs: *const rdsys::rd_kafka_headers_t,
) -> Vec<RawHeader<'a>> {
    let count = rdsys::rd_kafka_header_cnt(hdrs);
    let mut out = Vec::with_capacity(count);
    for idx in 0..count {
        let mut name: *const std::ffi::c_char = std::ptr::null();
        let mut value: *const std::ffi::c_void = std::ptr::null();
        let mut size = 0usize;
        let err = rdsys::rd_kafka_header_get_all(hdrs, idx, &mut name, &mut value, &mut size);
        if err != rdsys::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR || name.is_null() {
            // Only an index past the end fails, and the loop stays below the count.
            continue;
        }
        out.push(RawHeader {
            name: CStr::from_ptr(name).to_bytes(),
            value: (!value.is_null()).then(|| std::slice::from_raw_parts(value.cast::<u8>(), size)),
        });
    }
    out
}

/// The envelope of a record's parts (see [`to_envelope`]). Total: every input makes one.
pub(crate) fn envelope_of(r: &RawRecord<'_>, cluster: Option<&str>) -> Envelope {
    envelope_in(r, cluster, &mut ValueChunks::per_record())
}

/// [`envelope_of`], a small record's values copied into `chunks`.
fn envelope_in(r: &RawRecord<'_>, cluster: Option<&str>, chunks: &mut ValueChunks) -> Envelope {
    let mut digits = [0u8; 10];
    let epoch = u32::try_from(r.leader_epoch)
        .ok()
        .map(|e| decimal(e, &mut digits));
    let (wire, unreadable): (&[RawHeader<'_>], Option<&String>) = match &r.headers {
        Ok(h) => (h, None),
        Err(why) => (&[], Some(why)),
    };
    let header_bytes: usize = wire.iter().filter_map(|h| h.value).map(<[u8]>::len).sum();
    let mut copy = chunks.copier(
        r.key.map_or(0, <[u8]>::len)
            + r.payload.map_or(0, <[u8]>::len)
            + header_bytes
            + epoch.map_or(0, <[u8]>::len),
    );

    let key = r.key.map(|k| copy.value(k));
    let payload = copy.value(r.payload.unwrap_or_default());
    let mut headers = Headers::new();
    for h in wire {
        let name = escape_header_name(h.name);
        if let Cow::Owned(escaped) = &name {
            metrics::counter!(crate::metrics::HEADER_NAMES_ESCAPED).increment(1);
            tracing::debug!(topic = %r.topic, partition = r.partition, offset = r.offset, header = %escaped, "header name is not UTF-8: carried escaped");
        }
        match h.value {
            Some(v) => headers.insert(name, copy.value(v)),
            None => {
                let marker = props::type_of(&name);
                headers.insert(name, Bytes::new());
                headers.insert(marker, NULL_HEADER_TYPE);
            }
        }
    }
    if let Some(why) = unreadable {
        headers.insert(UNREADABLE_HEADERS, why.clone());
    }
    if let Some(epoch) = epoch {
        headers.insert(props::LEADER_EPOCH, copy.value(epoch));
    }
    Envelope {
        broker: crate::KAFKA,
        source: SourceRef {
            cluster: cluster.map(str::to_string),
            name: r.topic.to_string(),
            partition: Some(r.partition),
            position: Some(Position::Offset(r.offset)),
        },
        message_id: None,
        key,
        ordering_key: None,
        headers,
        payload,
        timestamp_ms: r.timestamp_ms,
        delivery_count: Some(1),
        redelivered: false,
    }
}

/// `n` in decimal, written into `buf` (a `u32` has at most 10 digits): the leader epoch of
/// every record, without a `String` made and dropped per record.
fn decimal(mut n: u32, buf: &mut [u8; 10]) -> &[u8] {
    let mut at = buf.len();
    loop {
        at -= 1;
        buf[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return &buf[at..];
        }
    }
}

/// Records up to this size (key, payload and header values together) copy their values into
/// a shared buffer. Above it each value gets its own: a handler that keeps only the key of a
/// large record must not keep its payload alive.
const SHARED_BUFFER_MAX: usize = 4096;

/// The size of the buffers the consumer-group source's polling thread copies small records
/// into, one after another: a handler (or a held record) that keeps a value keeps at most
/// this much memory alive.
const CHUNK: usize = 8192;

/// Owned copies of records' values. A small record's values are copied into a shared buffer
/// and handed out as parts of it: one allocation (and one free, on whichever thread drops
/// the last of them) per buffer instead of one per value. Records are made on the polling
/// thread and dropped on the consumer's; with glibc's allocator a cross-thread free takes
/// the allocating thread's arena lock, and those frees were the largest part of the
/// engine's time over this source. The polling thread fills one [`CHUNK`] with the records
/// of a burst (about 60 records of 100 bytes per buffer: two allocations, the buffer and
/// its reference count, where each record had made two of its own); a single conversion
/// ([`to_envelope`]) sizes its buffer to the record.
pub(crate) struct ValueChunks {
    /// What is left of the current buffer.
    chunk: BytesMut,
    /// The size of a new buffer; 0: exactly the record's.
    size: usize,
}

impl ValueChunks {
    /// Buffers of [`CHUNK`] bytes, shared by consecutive records.
    pub(crate) fn shared() -> Self {
        Self {
            chunk: BytesMut::new(),
            size: CHUNK,
        }
    }

    /// A buffer of its own for each record, of the record's size.
    fn per_record() -> Self {
        Self {
            chunk: BytesMut::new(),
            size: 0,
        }
    }

    /// The copier of a record whose values take `total` bytes.
    fn copier(&mut self, total: usize) -> ValueCopier<'_> {
        if total > SHARED_BUFFER_MAX {
            return ValueCopier { shared: None };
        }
        // Room for every value up front: the buffer never reallocates, so every part of
        // it shares the one allocation.
        if self.chunk.capacity() < total {
            self.chunk = BytesMut::with_capacity(self.size.max(total));
        }
        ValueCopier {
            shared: Some(&mut self.chunk),
        }
    }
}

/// Copies one record's values ([`ValueChunks::copier`]).
struct ValueCopier<'a> {
    /// The shared buffer, with room for all the record's values; `None` above
    /// [`SHARED_BUFFER_MAX`].
    shared: Option<&'a mut BytesMut>,
}

impl ValueCopier<'_> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    #[test]
    fn leader_epochs_are_written_in_decimal() {
        let mut buf = [0u8; 10];
        for n in [0, 7, 10, 99, 100, 4_096, 1_000_000_007, u32::MAX] {
            assert_eq!(decimal(n, &mut buf), n.to_string().as_bytes(), "{n}");
        }
    }

    use idemq_core::testkit::fuzz::bytes;

    /// Headers of one record: none to many, names repeated now and then.
    fn raw_headers(rng: &mut StdRng) -> Vec<(Vec<u8>, Option<Vec<u8>>)> {
        let n = match rng.gen_range(0..10) {
            0..=2 => 0,
            3..=8 => rng.gen_range(1..6),
            _ => rng.gen_range(6..60),
        };
        let mut out: Vec<(Vec<u8>, Option<Vec<u8>>)> = Vec::with_capacity(n);
        for _ in 0..n {
            let name = match out.len() {
                k if k > 0 && rng.gen_bool(0.2) => out[rng.gen_range(0..k)].0.clone(),
                _ => bytes(rng),
            };
            let value = rng.gen_bool(0.85).then(|| bytes(rng));
            out.push((name, value));
        }
        out
    }

    /// `\xNN` back to the byte NN (the inverse of the escape for names without a `\`).
    fn unescape(s: &str) -> Vec<u8> {
        let b = s.as_bytes();
        let mut out = Vec::with_capacity(b.len());
        let mut i = 0;
        while i < b.len() {
            if b[i] == b'\\' && i + 3 < b.len() && b[i + 1] == b'x' {
                let hex = std::str::from_utf8(&b[i + 2..i + 4]).expect("ascii hex");
                out.push(u8::from_str_radix(hex, 16).expect("hex digits"));
                i += 4;
            } else {
                out.push(b[i]);
                i += 1;
            }
        }
        out
    }

    /// The header list an envelope must carry for `headers` (names already checked apart).
    fn expected_headers(
        headers: &[(Vec<u8>, Option<Vec<u8>>)],
        unreadable: Option<&str>,
        epoch: i32,
    ) -> Vec<(String, Vec<u8>)> {
        let mut out = Vec::new();
        for (name, value) in headers {
            let name = escape_header_name(name).into_owned();
            match value {
                Some(v) => out.push((name, v.clone())),
                None => {
                    out.push((name.clone(), Vec::new()));
                    out.push((props::type_of(&name), NULL_HEADER_TYPE.as_bytes().to_vec()));
                }
            }
        }
        if let Some(why) = unreadable {
            out.push((UNREADABLE_HEADERS.to_string(), why.as_bytes().to_vec()));
        }
        if epoch >= 0 {
            out.push((
                props::LEADER_EPOCH.to_string(),
                epoch.to_string().into_bytes(),
            ));
        }
        out
    }

    fn check_name(raw: &[u8], carried: &str, seed: u64) {
        match std::str::from_utf8(raw) {
            Ok(s) => assert_eq!(carried, s, "seed {seed}: a UTF-8 name is kept as it is"),
            Err(_) => {
                assert_ne!(carried.as_bytes(), raw, "seed {seed}");
                if !raw.contains(&b'\\') {
                    assert_eq!(
                        unescape(carried),
                        raw,
                        "seed {seed}: {carried:?} is reversible"
                    );
                }
            }
        }
    }

    #[test]
    fn every_record_becomes_an_envelope_whatever_its_bytes() {
        // The polling thread's conversion: records one after another into shared buffers,
        // each compared, once all are made, with the record converted on its own.
        let mut chunks = ValueChunks::shared();
        let mut pairs = Vec::new();
        for seed in 0..5_000u64 {
            let mut rng = StdRng::seed_from_u64(seed);
            let key = rng.gen_bool(0.8).then(|| bytes(&mut rng));
            let payload = rng.gen_bool(0.95).then(|| bytes(&mut rng));
            let headers = raw_headers(&mut rng);
            let unreadable = rng
                .gen_bool(0.05)
                .then(|| format!("librdkafka could not parse the record's headers: case {seed}"));
            let epoch = rng.gen_range(-2..5);
            let topic = format!("t{}", rng.gen_range(0..3));
            let partition = rng.gen_range(0..1000);
            let offset = rng.gen_range(0..i64::MAX);
            let raw = RawRecord {
                topic: Cow::Borrowed(&topic),
                partition,
                offset,
                key: key.as_deref(),
                payload: payload.as_deref(),
                headers: match &unreadable {
                    Some(why) => Err(why.clone()),
                    None => Ok(headers
                        .iter()
                        .map(|(n, v)| RawHeader {
                            name: n,
                            value: v.as_deref(),
                        })
                        .collect()),
                },
                timestamp_ms: rng.gen_bool(0.9).then(|| rng.gen()),
                leader_epoch: epoch,
            };
            let env = envelope_of(&raw, Some("c"));
            pairs.push((seed, envelope_in(&raw, Some("c"), &mut chunks), env.clone()));

            assert_eq!(
                env.payload,
                payload.clone().unwrap_or_default(),
                "seed {seed}"
            );
            assert_eq!(env.key.as_deref(), key.as_deref(), "seed {seed}");
            assert_eq!(env.source.name, topic);
            assert_eq!(env.source.cluster.as_deref(), Some("c"));
            assert_eq!(env.source.partition, Some(partition));
            assert_eq!(env.source.position, Some(Position::Offset(offset)));
            assert_eq!(env.timestamp_ms, raw.timestamp_ms);
            let wire = if unreadable.is_some() {
                &[][..]
            } else {
                &headers[..]
            };
            let carried: Vec<(String, Vec<u8>)> = env
                .headers
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_vec()))
                .collect();
            assert_eq!(
                carried,
                expected_headers(wire, unreadable.as_deref(), epoch),
                "seed {seed}"
            );
            for (name, _) in wire {
                check_name(name, &escape_header_name(name), seed);
            }
        }
        for (seed, shared, own) in pairs {
            assert_eq!(
                shared, own,
                "seed {seed}: a record converted into a shared buffer keeps its values"
            );
        }
    }

    /// librdkafka's header list, built through its C calls with any bytes as names (rdkafka's
    /// `OwnedHeaders::insert` takes names as `&str`).
    struct NativeHeaders(*mut rdsys::rd_kafka_headers_t);

    impl NativeHeaders {
        fn new(headers: &[(Vec<u8>, Option<Vec<u8>>)]) -> Self {
            // SAFETY: a fresh list; names and values are copied by librdkafka with the
            // lengths given.
            unsafe {
                let list = rdsys::rd_kafka_headers_new(headers.len());
                for (name, value) in headers {
                    let (v, len) = match value {
                        Some(v) => (v.as_ptr().cast(), v.len() as isize),
                        None => (std::ptr::null(), 0),
                    };
                    let err = rdsys::rd_kafka_header_add(
                        list,
                        name.as_ptr().cast(),
                        name.len() as isize,
                        v,
                        len,
                    );
                    assert_eq!(err, rdsys::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR);
                }
                Self(list)
            }
        }
    }

    impl Drop for NativeHeaders {
        fn drop(&mut self) {
            // SAFETY: the list made in `new`, destroyed once.
            unsafe { rdsys::rd_kafka_headers_destroy(self.0) }
        }
    }

    #[test]
    fn librdkafka_headers_are_read_as_bytes_whatever_their_names() {
        for seed in 0..2_000u64 {
            let mut rng = StdRng::seed_from_u64(seed ^ 0x006b_6166_6b61);
            let mut headers = raw_headers(&mut rng);
            if seed % 10 == 0 {
                // The record of the finding: a Latin-1 name among ordinary ones.
                headers.push((b"caf\xe9".to_vec(), Some(b"v".to_vec())));
            }
            let native = NativeHeaders::new(&headers);
            // SAFETY: `native` lives until the end of this iteration, past `read`.
            let read = unsafe { read_headers(native.0) };
            let want: Vec<RawHeader<'_>> = headers
                .iter()
                .map(|(n, v)| RawHeader {
                    // librdkafka hands names out as C strings: cut at the first NUL.
                    name: &n[..n.iter().position(|b| *b == 0).unwrap_or(n.len())],
                    value: v.as_deref(),
                })
                .collect();
            assert_eq!(read, want, "seed {seed}");
            let env = envelope_of(
                &RawRecord {
                    topic: Cow::Borrowed("t"),
                    partition: 0,
                    offset: 0,
                    key: None,
                    payload: None,
                    headers: Ok(read),
                    timestamp_ms: None,
                    leader_epoch: -1,
                },
                None,
            );
            let named = env
                .headers
                .iter()
                .filter(|(n, _)| !n.starts_with(props::PREFIX))
                .count();
            assert_eq!(
                named,
                headers.len(),
                "seed {seed}: one header per wire header"
            );
            if seed % 10 == 0 {
                assert_eq!(env.headers.get("caf\\xe9").map(|v| &v[..]), Some(&b"v"[..]));
            }
        }
    }
}
