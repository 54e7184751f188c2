//! NATS message ↔ envelope: what the client admits off the wire becomes bytes, what an
//! [`OutgoingMessage`] holds goes on the wire or is refused by name.

use crate::source::{DLQ_MSG_ID, DLQ_REASON, DLQ_SEQUENCE, DLQ_STREAM, DLQ_SUBJECT};
use crate::{MSG_ID_HEADER, NATS};
use async_nats::header::{HeaderMap, HeaderName, HeaderValue};
use bytes::Bytes;
use idemq_core::envelope::Position;
use idemq_core::publish::OutgoingMessage;
use idemq_core::Envelope;
use std::str::FromStr;

/// The header carrying [`OutgoingMessage::key`] (NATS has no message key of its own): the
/// publisher writes it, [`to_envelope`] reads it back into [`Envelope::key`].
pub const KEY_HEADER: &str = "idemq-key";

/// What a JetStream ack subject says about a delivery (ADR-15: `$JS.ACK.<stream>.<consumer>.
/// <delivered>.<stream seq>.<consumer seq>.<timestamp>.<pending>`, or the v2 form with a
/// domain and an account hash before the stream and an optional token after).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AckInfo {
    /// The stream.
    pub stream: String,
    /// The durable consumer.
    pub consumer: String,
    /// How often the server has delivered this message (1 = first).
    pub delivered: u64,
    /// The message's sequence in the stream.
    pub stream_sequence: u64,
    /// When the stream stored it, milliseconds since the Unix epoch.
    pub published_ms: i64,
}

impl AckInfo {
    /// Reads an ack subject; `None` when it is not one.
    ///
    /// ```
    /// use idemq_nats::AckInfo;
    /// let i = AckInfo::parse("$JS.ACK.ORDERS.billing.2.41.7.1790230470084404000.3").unwrap();
    /// assert_eq!((i.stream.as_str(), i.delivered, i.stream_sequence), ("ORDERS", 2, 41));
    /// assert_eq!(i.published_ms, 1_790_230_470_084);
    /// assert!(AckInfo::parse("_INBOX.x").is_none());
    /// ```
    pub fn parse(reply: &str) -> Option<AckInfo> {
        let t: Vec<&str> = reply.split('.').collect();
        if t.len() < 9 || t[0] != "$JS" || t[1] != "ACK" {
            return None;
        }
        // v1 has 9 tokens; v2 inserts domain and account hash (11, or 12 with a token).
        let at = match t.len() {
            9 => 2,
            11.. => 4,
            _ => return None,
        };
        let num = |i: usize| t[at + i].parse::<u64>().ok();
        let nanos: i128 = t[at + 5].parse().ok()?;
        Some(AckInfo {
            stream: t[at].to_string(),
            consumer: t[at + 1].to_string(),
            delivered: num(2)?,
            stream_sequence: num(3)?,
            published_ms: i64::try_from(nanos / 1_000_000).unwrap_or(if nanos < 0 {
                i64::MIN
            } else {
                i64::MAX
            }),
        })
    }
}

/// The envelope of a message consumed from a stream: the subject as the source name, the
/// stream sequence as position (from the ack subject), every header as bytes (repeated names
/// in order), `Nats-Msg-Id` as message id, [`KEY_HEADER`] as key, and the delivery count and
/// timestamp from the ack subject. Never panics; a message without an ack subject (not from
/// a consumer) has no position, count or timestamp.
pub fn to_envelope(msg: &async_nats::Message, cluster: Option<&str>) -> Envelope {
    let mut env = Envelope::new(NATS, msg.subject.as_str(), msg.payload.clone());
    env.source.cluster = cluster.map(str::to_string);
    if let Some(headers) = &msg.headers {
        for (name, values) in headers.iter() {
            let name: &str = name.as_ref();
            for v in values {
                env.headers
                    .insert(name, Bytes::copy_from_slice(v.as_str().as_bytes()));
            }
        }
        env.message_id = headers.get(MSG_ID_HEADER).map(|v| v.as_str().to_string());
        env.key = headers
            .get(KEY_HEADER)
            .map(|v| Bytes::copy_from_slice(v.as_str().as_bytes()));
    }
    if let Some(info) = msg.reply.as_ref().and_then(|r| AckInfo::parse(r.as_str())) {
        env.source.position = Some(Position::Sequence(info.stream_sequence));
        env.delivery_count = Some(u32::try_from(info.delivered).unwrap_or(u32::MAX));
        env.redelivered = info.delivered > 1;
        env.timestamp_ms = Some(info.published_ms);
    }
    env
}

/// The envelope of a message read from a stream by sequence (a direct or API get, as for a
/// dead-letter stream), like [`to_envelope`]'s but with the stored sequence as position, and
/// no delivery count (nothing delivered it) or timestamp (async-nats' time type changes with
/// its `chrono` feature, which another crate of a build may turn on).
pub fn stored_to_envelope(
    m: async_nats::jetstream::message::StreamMessage,
    cluster: Option<&str>,
) -> Envelope {
    let sequence = m.sequence;
    let msg = async_nats::Message {
        subject: m.subject,
        reply: None,
        length: m.payload.len(),
        payload: m.payload,
        headers: Some(m.headers),
        status: None,
        description: None,
    };
    let mut env = to_envelope(&msg, cluster);
    env.source.position = Some(Position::Sequence(sequence));
    env
}

/// Why one header cannot go on a NATS message, or `None` when it can as it is.
fn unsendable(name: &str, value: &[u8]) -> Option<String> {
    if HeaderName::from_str(name).is_err() {
        return Some(format!(
            "header name {name:?} cannot go on a NATS message (printable ASCII without ':' or spaces only)"
        ));
    }
    let Ok(text) = std::str::from_utf8(value) else {
        return Some(format!(
            "header `{name}` is not UTF-8: NATS header values are text"
        ));
    };
    if text.contains(['\r', '\n']) {
        return Some(format!(
            "header `{name}` holds a line break: NATS header values are one line"
        ));
    }
    if text.trim() != text {
        return Some(format!(
            "header `{name}` starts or ends with whitespace, which NATS trims on delivery"
        ));
    }
    None
}

/// The NATS headers of `msg`: its wire headers ([`OutgoingMessage::wire_headers`], with
/// [`DEDUP_HEADER`](idemq_core::DEDUP_HEADER)), the dedup key also in `Nats-Msg-Id`
/// (replacing one set by hand) and the key in [`KEY_HEADER`]. A header NATS cannot carry as
/// it is (a name outside printable ASCII or with `:`, a value that is not one line of UTF-8
/// or has edge whitespace the receiving client trims) is refused with its name, never
/// altered.
pub fn outgoing_headers(msg: &OutgoingMessage) -> Result<HeaderMap, String> {
    let mut out = HeaderMap::new();
    let mut push = |name: &str, value: &[u8]| -> Result<(), String> {
        if let Some(why) = unsendable(name, value) {
            return Err(why);
        }
        match (
            HeaderName::from_str(name),
            std::str::from_utf8(value).map(HeaderValue::from_str),
        ) {
            (Ok(n), Ok(Ok(v))) => {
                out.append(n, v);
                Ok(())
            }
            _ => Err(format!("header `{name}` cannot go on a NATS message")),
        }
    };
    for (name, value) in msg.wire_headers().iter() {
        if msg.dedup_key.is_some() && name == MSG_ID_HEADER {
            continue;
        }
        if name == KEY_HEADER {
            continue;
        }
        push(name, value)?;
    }
    if let Some(k) = &msg.dedup_key {
        push(MSG_ID_HEADER, k.as_bytes())?;
    }
    if let Some(k) = &msg.key {
        push(KEY_HEADER, k)?;
    }
    Ok(out)
}

/// Server instructions among the headers of a stored message (every `Nats-*` header:
/// `Nats-Expected-*`, `Nats-Rollup`, `Nats-TTL`, `Nats-Msg-Id`, ...): a dead-letter copy
/// must not carry the original's, or the dead-letter stream would act on them (refuse the
/// copy, purge itself, or drop it as a duplicate of another message's copy).
pub(crate) fn is_server_directive(name: &str) -> bool {
    name.to_ascii_lowercase().starts_with("nats-")
}

/// The longest dead-letter reason carried (in bytes, cut at a character boundary): the copy
/// must still fit the server's `max_payload`.
const MAX_REASON: usize = 4_096;

/// Where a rejected message was consumed: what its dead-letter copy records.
pub(crate) struct DeadLetterOrigin<'a> {
    /// The stream it was consumed from.
    pub stream: &'a str,
    /// The durable consumer that rejected it.
    pub durable: &'a str,
    /// The subject it was published to.
    pub subject: &'a str,
    /// Its sequence in the stream.
    pub sequence: Option<u64>,
    /// When the stream stored it, milliseconds since the Unix epoch.
    pub stored_ms: Option<i64>,
}

/// The `Nats-Msg-Id` of a dead-letter copy: the stream, the durable consumer, the stream
/// sequence and, when known, the time the stream stored the message (a stream deleted and
/// created again numbers from 1 anew). Every send of one dead-lettering carries the same id
/// (a `PubAck` that timed out after the copy went out, or an unconfirmed `+TERM` and the
/// message rejected again on its redelivery), so the dead-letter stream keeps one copy
/// within its duplicate window; another message with the same dedup key, or the same
/// message rejected by another durable, gets another id. `None` without a sequence: the
/// copy then carries no id and is never taken for another.
pub(crate) fn dead_letter_msg_id(origin: &DeadLetterOrigin<'_>) -> Option<String> {
    let seq = origin.sequence?;
    // Stream and consumer names hold no '.', so one id names one origin.
    let (stream, durable) = (origin.stream, origin.durable);
    Some(match origin.stored_ms {
        Some(ms) => format!("{stream}.{durable}.{seq}.{ms}"),
        None => format!("{stream}.{durable}.{seq}"),
    })
}

/// The headers of the dead-letter copy of a message with `headers`: its own, except the
/// server instructions ([`is_server_directive`]) and earlier dead-letter headers
/// (`idemq-dlq-*`: a dead letter consumed and rejected again describes its latest
/// rejection), the original's `Nats-Msg-Id` moved to [`DLQ_MSG_ID`]; then [`DLQ_REASON`]
/// (cut to 4 KiB), [`DLQ_SUBJECT`], [`DLQ_STREAM`], [`DLQ_SEQUENCE`] and the copy's own
/// `Nats-Msg-Id` ([`dead_letter_msg_id`]). A header the client cannot carry is left out.
pub(crate) fn dead_letter_headers(
    headers: &idemq_core::envelope::Headers,
    reason: &str,
    origin: &DeadLetterOrigin<'_>,
) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (name, value) in headers.iter() {
        let name = if name == MSG_ID_HEADER {
            DLQ_MSG_ID
        } else if is_server_directive(name) || name.starts_with("idemq-dlq-") {
            continue;
        } else {
            name
        };
        let parsed = (
            HeaderName::from_str(name),
            std::str::from_utf8(value).map(HeaderValue::from_str),
        );
        if let (Ok(n), Ok(Ok(v))) = parsed {
            h.append(n, v);
        }
    }
    let mut cut = reason.len().min(MAX_REASON);
    while !reason.is_char_boundary(cut) {
        cut -= 1;
    }
    h.append(DLQ_REASON, HeaderValue::from_lossy(&reason[..cut]));
    h.append(DLQ_SUBJECT, HeaderValue::from_lossy(origin.subject));
    h.append(DLQ_STREAM, HeaderValue::from_lossy(origin.stream));
    if let Some(s) = origin.sequence {
        h.append(DLQ_SEQUENCE, HeaderValue::from(s));
    }
    if let Some(id) = dead_letter_msg_id(origin) {
        h.insert(MSG_ID_HEADER, HeaderValue::from_lossy(&id));
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;
    use idemq_core::testkit::fuzz::{bytes, text};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// A header name: mostly the fuzz text (which the client often refuses: those are
    /// dropped, as the client never admits them off the wire), sometimes printable ASCII.
    fn name(rng: &mut StdRng) -> Option<String> {
        let n = if rng.gen_bool(0.5) {
            text(rng, 40)
        } else {
            (0..rng.gen_range(1..30))
                .map(|_| char::from(rng.gen_range(b'!'..=b'~')))
                .collect()
        };
        HeaderName::from_str(&n).ok().map(|_| n)
    }

    /// A header value as the client reads it: UTF-8 (the fuzz bytes, lossily), one line,
    /// trimmed.
    fn value(rng: &mut StdRng) -> String {
        let raw = String::from_utf8_lossy(&bytes(rng)).into_owned();
        HeaderValue::from_lossy(&raw).as_str().trim().to_string()
    }

    fn ack_subject(rng: &mut StdRng) -> String {
        let n = |rng: &mut StdRng| {
            if rng.gen_bool(0.2) {
                u64::MAX.to_string()
            } else {
                rng.gen::<u32>().to_string()
            }
        };
        let ts = if rng.gen_bool(0.1) {
            i128::MAX.to_string()
        } else {
            rng.gen::<i64>().to_string()
        };
        match rng.gen_range(0..4) {
            0 => format!(
                "$JS.ACK.S.c.{}.{}.{}.{ts}.{}",
                n(rng),
                n(rng),
                n(rng),
                n(rng)
            ),
            1 => format!(
                "$JS.ACK.hub.acc.S.c.{}.{}.{}.{ts}.{}.tok",
                n(rng),
                n(rng),
                n(rng),
                n(rng)
            ),
            2 => format!("$JS.ACK.{}", text(rng, 60)),
            _ => text(rng, 60),
        }
    }

    fn message(rng: &mut StdRng) -> async_nats::Message {
        let mut headers = HeaderMap::new();
        for _ in 0..rng.gen_range(0..10) {
            let Some(n) = name(rng) else { continue };
            for _ in 0..rng.gen_range(1..3) {
                let v = value(rng);
                headers.append(HeaderName::from_str(&n).expect("checked"), v.as_str());
            }
        }
        if rng.gen_bool(0.3) {
            headers.append(MSG_ID_HEADER, value(rng).as_str());
        }
        if rng.gen_bool(0.3) {
            headers.append(KEY_HEADER, value(rng).as_str());
        }
        let payload = Bytes::from(bytes(rng));
        async_nats::Message {
            subject: text(rng, 80).into(),
            reply: rng.gen_bool(0.9).then(|| ack_subject(rng).into()),
            length: payload.len(),
            payload,
            headers: rng.gen_bool(0.9).then_some(headers),
            status: None,
            description: None,
        }
    }

    #[test]
    fn every_message_becomes_an_envelope_whatever_it_holds() {
        for seed in 0..3_000u64 {
            let mut rng = StdRng::seed_from_u64(seed);
            let m = message(&mut rng);
            let env = to_envelope(&m, Some("eu"));
            assert_eq!(env.payload, m.payload, "seed {seed}");
            assert_eq!(env.source.name, m.subject.as_str(), "seed {seed}");
            assert_eq!(env.source.cluster.as_deref(), Some("eu"));
            let mut want: Vec<(String, Vec<u8>)> = Vec::new();
            if let Some(h) = &m.headers {
                for (n, vs) in h.iter() {
                    for v in vs {
                        let n: &str = n.as_ref();
                        want.push((n.to_string(), v.as_str().as_bytes().to_vec()));
                    }
                }
                assert_eq!(
                    env.message_id.as_deref(),
                    h.get(MSG_ID_HEADER).map(|v| v.as_str()),
                    "seed {seed}"
                );
                assert_eq!(
                    env.key.as_deref(),
                    h.get(KEY_HEADER).map(|v| v.as_str().as_bytes()),
                    "seed {seed}"
                );
            }
            let got: Vec<(String, Vec<u8>)> = env
                .headers
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_vec()))
                .collect();
            assert_eq!(got, want, "seed {seed}: every header, values in order");
            match m.reply.as_ref().and_then(|r| AckInfo::parse(r.as_str())) {
                Some(info) => {
                    assert_eq!(
                        env.source.position,
                        Some(Position::Sequence(info.stream_sequence))
                    );
                    assert_eq!(
                        env.delivery_count.map(u64::from),
                        Some(info.delivered.min(u64::from(u32::MAX)))
                    );
                    assert_eq!(env.redelivered, info.delivered > 1);
                }
                None => {
                    assert_eq!(env.source.position, None, "seed {seed}");
                    assert_eq!(env.delivery_count, None, "seed {seed}");
                }
            }
        }
    }

    #[test]
    fn outgoing_headers_are_sent_as_they_are_or_refused_by_name() {
        let (mut sent, mut refused) = (0, 0);
        for seed in 0..3_000u64 {
            let mut rng = StdRng::seed_from_u64(seed);
            let mut m = OutgoingMessage::new("orders.created", bytes(&mut rng));
            let mut pairs = Vec::new();
            for _ in 0..rng.gen_range(0..6) {
                let n = if rng.gen_bool(0.7) {
                    name(&mut rng).unwrap_or_else(|| text(&mut rng, 20))
                } else {
                    text(&mut rng, 20)
                };
                let v = if rng.gen_bool(0.7) {
                    value(&mut rng).into_bytes()
                } else {
                    bytes(&mut rng)
                };
                pairs.push((n.clone(), v.clone()));
                m = m.with_header(n, v);
            }
            if rng.gen_bool(0.5) {
                m = m.with_dedup_key(value(&mut rng));
            }
            match outgoing_headers(&m) {
                Ok(h) => {
                    sent += 1;
                    // What the consumer reads back is what was meant to go.
                    let back = to_envelope(
                        &async_nats::Message {
                            subject: "orders.created".into(),
                            reply: None,
                            payload: m.payload.clone(),
                            headers: Some(h),
                            status: None,
                            description: None,
                            length: 0,
                        },
                        None,
                    );
                    for (name, value) in m.wire_headers().iter() {
                        let carried = back.headers.iter().any(|(n, v)| n == name && v == value);
                        assert!(carried, "seed {seed}: {name:?} lost");
                    }
                    assert_eq!(back.message_id, m.dedup_key, "seed {seed}");
                }
                Err(why) => {
                    refused += 1;
                    let culprit = pairs
                        .iter()
                        .chain(
                            m.dedup_key
                                .iter()
                                .map(|k| (MSG_ID_HEADER.to_string(), k.as_bytes().to_vec()))
                                .collect::<Vec<_>>()
                                .iter(),
                        )
                        .find(|(n, v)| unsendable(n, v).is_some())
                        .cloned();
                    let (n, _) = culprit.unwrap_or_else(|| panic!("seed {seed}: refused {why}"));
                    assert!(why.contains(&n) || why.contains(&format!("{n:?}")), "{why}");
                }
            }
        }
        assert!(
            sent > 300 && refused > 300,
            "sent {sent}, refused {refused}"
        );
    }

    #[test]
    fn ack_subjects_are_read_or_refused_never_misread() {
        let v2 = AckInfo::parse("$JS.ACK._.acc.ORDERS.billing.3.100.7.1790230470084404000.0")
            .expect("v2 without token");
        assert_eq!(
            (v2.stream.as_str(), v2.consumer.as_str()),
            ("ORDERS", "billing")
        );
        assert_eq!((v2.delivered, v2.stream_sequence), (3, 100));
        for bad in [
            "$JS.ACK.S.c.1.2.3.4",
            "$JS.ACK.d.a.S.c.1.2.3.4",
            "$JS.ACK.S.c.x.2.3.4.5",
            "$JS.FC.S.c.1.2.3.4.5",
            "",
        ] {
            assert_eq!(AckInfo::parse(bad), None, "{bad}");
        }
        for seed in 0..2_000u64 {
            let mut rng = StdRng::seed_from_u64(seed);
            let _ = AckInfo::parse(&ack_subject(&mut rng));
        }
    }

    #[test]
    fn dead_letter_copies_move_the_message_id_and_drop_directives() {
        let headers = idemq_core::envelope::Headers::new()
            .with(MSG_ID_HEADER, "order-7")
            .with(idemq_core::DEDUP_HEADER, "order-7")
            .with("Nats-Expected-Last-Sequence", "3")
            .with("nats-rollup", "all")
            .with(DLQ_REASON, "rejected before")
            .with("traceparent", "00-abc-def-01");
        let origin = DeadLetterOrigin {
            stream: "ORDERS",
            durable: "billing",
            subject: "orders.eu",
            sequence: Some(41),
            stored_ms: Some(1_790_230_470_084),
        };
        let h = dead_letter_headers(&headers, "cannot bill", &origin);
        let one = |name: &str| h.get(name).map(|v| v.as_str().to_string());
        assert_eq!(
            one(DLQ_MSG_ID).as_deref(),
            Some("order-7"),
            "original id kept"
        );
        assert_eq!(
            one(MSG_ID_HEADER).as_deref(),
            Some("ORDERS.billing.41.1790230470084"),
            "the copy's own id"
        );
        assert_eq!(h.get_all(MSG_ID_HEADER).count(), 1);
        assert_eq!(one(idemq_core::DEDUP_HEADER).as_deref(), Some("order-7"));
        assert_eq!(one("traceparent").as_deref(), Some("00-abc-def-01"));
        assert_eq!(one("Nats-Expected-Last-Sequence"), None);
        assert_eq!(one("nats-rollup"), None);
        assert_eq!(one(DLQ_REASON).as_deref(), Some("cannot bill"));
        assert_eq!(
            h.get_all(DLQ_REASON).count(),
            1,
            "the earlier reason dropped"
        );
        assert_eq!(one(DLQ_SUBJECT).as_deref(), Some("orders.eu"));
        assert_eq!(one(DLQ_STREAM).as_deref(), Some("ORDERS"));
        assert_eq!(one(DLQ_SEQUENCE).as_deref(), Some("41"));

        // The same dead-lettering sent again (another reason, the envelope read back from
        // the stream) dedups; another message, durable or stream incarnation does not.
        let id = |o: &DeadLetterOrigin<'_>| {
            dead_letter_headers(&idemq_core::envelope::Headers::new(), "again", o)
                .get(MSG_ID_HEADER)
                .map(|v| v.as_str().to_string())
        };
        assert_eq!(id(&origin), one(MSG_ID_HEADER));
        for other in [
            DeadLetterOrigin {
                sequence: Some(42),
                ..origin
            },
            DeadLetterOrigin {
                durable: "audit",
                ..origin
            },
            DeadLetterOrigin {
                stored_ms: Some(1_790_230_999_000),
                ..origin
            },
        ] {
            assert_ne!(id(&other), id(&origin));
        }
        let unplaced = DeadLetterOrigin {
            sequence: None,
            ..origin
        };
        assert_eq!(id(&unplaced), None, "no sequence, no id");

        assert!(is_server_directive("Nats-Expected-Last-Sequence"));
        assert!(is_server_directive(MSG_ID_HEADER));
        assert!(!is_server_directive(idemq_core::DEDUP_HEADER));
    }

    #[test]
    fn a_long_reason_is_cut_at_a_character_boundary() {
        let origin = DeadLetterOrigin {
            stream: "S",
            durable: "d",
            subject: "s",
            sequence: Some(1),
            stored_ms: None,
        };
        let reason = "é".repeat(MAX_REASON);
        let h = dead_letter_headers(&idemq_core::envelope::Headers::new(), &reason, &origin);
        let kept = h.get(DLQ_REASON).map(|v| v.as_str().len());
        assert_eq!(kept, Some(MAX_REASON));
        assert_eq!(
            h.get(MSG_ID_HEADER).map(|v| v.as_str()),
            Some("S.d.1"),
            "without a stored time"
        );
    }
}
