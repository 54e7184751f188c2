//! AMQP field values ↔ envelope headers: the value's text under the header's name, its wire
//! type under [`props::type_of`] when it is not a byte string, so nothing is lost either way.

use bytes::Bytes;
use idemq_core::envelope::{props, Headers};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};

/// The type name recorded under [`props::type_of`] for each non-string AMQP field type.
fn type_name(v: &AMQPValue) -> Option<&'static str> {
    Some(match v {
        AMQPValue::LongString(_) => return None,
        AMQPValue::Boolean(_) => "bool",
        AMQPValue::ShortShortInt(_) => "i8",
        AMQPValue::ShortShortUInt(_) => "u8",
        AMQPValue::ShortInt(_) => "i16",
        AMQPValue::ShortUInt(_) => "u16",
        AMQPValue::LongInt(_) => "i32",
        AMQPValue::LongUInt(_) => "u32",
        AMQPValue::LongLongInt(_) => "i64",
        AMQPValue::Float(_) => "f32",
        AMQPValue::Double(_) => "f64",
        AMQPValue::DecimalValue(_) => "decimal",
        AMQPValue::ShortString(_) => "short-string",
        AMQPValue::Timestamp(_) => "timestamp",
        AMQPValue::FieldArray(_) => "array",
        AMQPValue::FieldTable(_) => "table",
        AMQPValue::ByteArray(_) => "bytes",
        AMQPValue::Void => "void",
    })
}

/// How many arrays and tables deep a header value is rendered; one nested deeper is written
/// `[...]` / `{...}`. Keeps the text and the recursion bounded whatever a producer nested.
pub(crate) const MAX_RENDER_DEPTH: usize = 16;

/// A JSON-like text of a value (strings quoted inside arrays and tables).
fn render(v: &AMQPValue, out: &mut String, depth: usize) {
    use std::fmt::Write;
    let nested = depth > 0;
    let _ = match v {
        AMQPValue::LongString(s) if nested => {
            write!(out, "{:?}", String::from_utf8_lossy(s.as_bytes()))
        }
        AMQPValue::LongString(s) => write!(out, "{}", String::from_utf8_lossy(s.as_bytes())),
        AMQPValue::ShortString(s) if nested => write!(out, "{:?}", s.as_str()),
        AMQPValue::ShortString(s) => write!(out, "{}", s.as_str()),
        AMQPValue::Boolean(b) => write!(out, "{b}"),
        AMQPValue::ShortShortInt(n) => write!(out, "{n}"),
        AMQPValue::ShortShortUInt(n) => write!(out, "{n}"),
        AMQPValue::ShortInt(n) => write!(out, "{n}"),
        AMQPValue::ShortUInt(n) => write!(out, "{n}"),
        AMQPValue::LongInt(n) => write!(out, "{n}"),
        AMQPValue::LongUInt(n) => write!(out, "{n}"),
        AMQPValue::LongLongInt(n) => write!(out, "{n}"),
        AMQPValue::Float(x) => write!(out, "{x}"),
        AMQPValue::Double(x) => write!(out, "{x}"),
        AMQPValue::DecimalValue(d) => write!(out, "{}e-{}", d.value, d.scale),
        AMQPValue::Timestamp(t) => write!(out, "{t}"),
        AMQPValue::ByteArray(b) => write!(out, "{:?}", b.as_slice()),
        AMQPValue::Void => write!(out, "null"),
        AMQPValue::FieldArray(_) if depth >= MAX_RENDER_DEPTH => {
            out.push_str("[...]");
            Ok(())
        }
        AMQPValue::FieldTable(_) if depth >= MAX_RENDER_DEPTH => {
            out.push_str("{...}");
            Ok(())
        }
        AMQPValue::FieldArray(a) => {
            out.push('[');
            for (i, item) in a.as_slice().iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                render(item, out, depth + 1);
            }
            out.push(']');
            Ok(())
        }
        AMQPValue::FieldTable(t) => {
            out.push('{');
            for (i, (k, item)) in t.inner().iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                let _ = write!(out, "{:?}:", k.as_str());
                render(item, out, depth + 1);
            }
            out.push('}');
            Ok(())
        }
    };
}

/// The envelope form of one field value: its bytes (raw for byte strings, text otherwise)
/// and its type name (`None` for a long string).
pub(crate) fn to_header(v: &AMQPValue) -> (Bytes, Option<&'static str>) {
    match v {
        AMQPValue::LongString(s) => (Bytes::copy_from_slice(s.as_bytes()), None),
        AMQPValue::ByteArray(b) => (Bytes::copy_from_slice(b.as_slice()), Some("bytes")),
        other => {
            let mut text = String::new();
            render(other, &mut text, 0);
            (Bytes::from(text), type_name(other))
        }
    }
}

/// Appends an AMQP header table to envelope headers (typed values keep their type).
pub(crate) fn table_to_headers(table: &FieldTable, headers: &mut Headers) {
    for (name, value) in table.inner() {
        let (bytes, ty) = to_header(value);
        headers.insert(name.as_str(), bytes);
        if let Some(ty) = ty {
            headers.insert(props::type_of(name.as_str()), ty);
        }
    }
}

/// The AMQP value for a header about to be published: scalars recorded with a type (by a
/// consumer that received them typed) are sent typed again; everything else as a long string.
pub(crate) fn from_header(value: &Bytes, ty: Option<&str>) -> AMQPValue {
    let text = std::str::from_utf8(value).ok();
    let parsed = match (ty, text) {
        (Some("bool"), Some(t)) => t.parse().ok().map(AMQPValue::Boolean),
        (Some("i8"), Some(t)) => t.parse().ok().map(AMQPValue::ShortShortInt),
        (Some("u8"), Some(t)) => t.parse().ok().map(AMQPValue::ShortShortUInt),
        (Some("i16"), Some(t)) => t.parse().ok().map(AMQPValue::ShortInt),
        (Some("u16"), Some(t)) => t.parse().ok().map(AMQPValue::ShortUInt),
        (Some("i32"), Some(t)) => t.parse().ok().map(AMQPValue::LongInt),
        (Some("u32"), Some(t)) => t.parse().ok().map(AMQPValue::LongUInt),
        (Some("i64"), Some(t)) => t.parse().ok().map(AMQPValue::LongLongInt),
        (Some("f32"), Some(t)) => t.parse().ok().map(AMQPValue::Float),
        (Some("f64"), Some(t)) => t.parse().ok().map(AMQPValue::Double),
        (Some("timestamp"), Some(t)) => t.parse().ok().map(AMQPValue::Timestamp),
        (Some("bytes"), _) => Some(AMQPValue::ByteArray(value.to_vec().into())),
        _ => None,
    };
    parsed.unwrap_or_else(|| AMQPValue::LongString(LongString::from(value.to_vec())))
}

/// Inserts a string-valued header.
pub(crate) fn put_str(table: &mut FieldTable, name: &str, value: &str) {
    table.insert(
        ShortString::from(name.to_string()),
        AMQPValue::LongString(value.into()),
    );
}

/// Reads an integer header of any width (RabbitMQ's `x-delivery-count` is a long, a client
/// may write a long long).
pub(crate) fn get_u64(table: &FieldTable, name: &str) -> Option<u64> {
    match table.inner().get(name)? {
        AMQPValue::ShortShortUInt(n) => Some(u64::from(*n)),
        AMQPValue::ShortUInt(n) => Some(u64::from(*n)),
        AMQPValue::LongUInt(n) => Some(u64::from(*n)),
        AMQPValue::ShortShortInt(n) => u64::try_from(*n).ok(),
        AMQPValue::ShortInt(n) => u64::try_from(*n).ok(),
        AMQPValue::LongInt(n) => u64::try_from(*n).ok(),
        AMQPValue::LongLongInt(n) => u64::try_from(*n).ok(),
        AMQPValue::Timestamp(n) => Some(*n),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn typed_values_keep_their_type_and_come_back_typed() {
        let mut t = FieldTable::default();
        t.insert("n".into(), AMQPValue::LongInt(-7));
        t.insert("ok".into(), AMQPValue::Boolean(true));
        t.insert("s".into(), AMQPValue::LongString("text".into()));
        let mut h = Headers::new();
        table_to_headers(&t, &mut h);
        assert_eq!(h.get_str("n"), Some("-7"));
        assert_eq!(h.get_str(&props::type_of("n")), Some("i32"));
        assert_eq!(h.get_str(&props::type_of("s")), None);
        let back = from_header(h.get("n").unwrap(), h.get_str(&props::type_of("n")));
        assert_eq!(back, AMQPValue::LongInt(-7));
        let back = from_header(h.get("ok").unwrap(), Some("bool"));
        assert_eq!(back, AMQPValue::Boolean(true));
    }

    #[test]
    fn the_dedup_header_strategy_reads_the_plugin_header_a_producer_set() {
        // What pika or any client following rabbitmq-message-deduplication sends: the key in
        // the plugin's header only, no `idemq-dedup-key`, no `message_id`.
        let mut t = FieldTable::default();
        t.insert(
            crate::PLUGIN_DEDUP_HEADER.into(),
            AMQPValue::LongString("pay-7".into()),
        );
        let mut env = idemq_core::Envelope::new(crate::RABBITMQ, "payments", "{}");
        table_to_headers(&t, &mut env.headers);
        let keys = idemq_core::KeyStrategy::dedup_header("billing").unwrap();
        assert_eq!(keys.derive(&env).unwrap().as_str(), "billing:pay-7");
        // A client library that stamps every message with a random `message_id` must not
        // turn a resend with the same plugin header into a new key.
        let stamped = env.clone().with_message_id("4f0c-random");
        assert_eq!(keys.derive(&stamped).unwrap().as_str(), "billing:pay-7");
        // idemq's own header still comes first; `message_id` alone is still read.
        let ours = stamped.with_header(idemq_core::DEDUP_HEADER, "pay-8");
        assert_eq!(keys.derive(&ours).unwrap().as_str(), "billing:pay-8");
        let id_only =
            idemq_core::Envelope::new(crate::RABBITMQ, "payments", "{}").with_message_id("pay-9");
        assert_eq!(keys.derive(&id_only).unwrap().as_str(), "billing:pay-9");
        // An empty plugin header is an error naming it, not a reason to read `message_id`.
        let empty = id_only.clone().with_header(crate::PLUGIN_DEDUP_HEADER, "");
        let reason = keys.derive(&empty).unwrap_err().to_string();
        assert!(reason.contains(crate::PLUGIN_DEDUP_HEADER), "{reason}");
        // Without any, the dead-letter reason names each slot looked in.
        env.headers = Headers::new();
        let reason = keys.derive(&env).unwrap_err().to_string();
        for slot in [
            idemq_core::DEDUP_HEADER,
            crate::PLUGIN_DEDUP_HEADER,
            "rabbitmq message id (`message_id`)",
        ] {
            assert!(reason.contains(slot), "{slot}: {reason}");
        }
    }

    #[test]
    fn tables_render_as_text() {
        let mut inner = FieldTable::default();
        inner.insert("count".into(), AMQPValue::LongLongInt(2));
        inner.insert("queue".into(), AMQPValue::LongString("q".into()));
        let v = AMQPValue::FieldArray(vec![AMQPValue::FieldTable(inner)].into());
        let (text, ty) = to_header(&v);
        assert_eq!(&text[..], br#"[{"count":2,"queue":"q"}]"#);
        assert_eq!(ty, Some("array"));
    }
}

/// Arbitrary AMQP values and tables, for the conversion's seeded property tests.
#[cfg(test)]
pub(crate) mod arbitrary {
    use lapin::types::{AMQPValue, DecimalValue, FieldTable, LongString, ShortString};
    use rand::rngs::StdRng;
    use rand::Rng;

    pub(crate) use idemq_core::testkit::fuzz::{bytes, text};

    /// Any field value; arrays and tables nest up to `depth` more levels.
    pub(crate) fn value(rng: &mut StdRng, depth: usize) -> AMQPValue {
        let kinds = if depth == 0 { 16 } else { 18 };
        match rng.gen_range(0..kinds) {
            0 => AMQPValue::Boolean(rng.gen()),
            1 => AMQPValue::ShortShortInt(rng.gen()),
            2 => AMQPValue::ShortShortUInt(rng.gen()),
            3 => AMQPValue::ShortInt(rng.gen()),
            4 => AMQPValue::ShortUInt(rng.gen()),
            5 => AMQPValue::LongInt(rng.gen()),
            6 => AMQPValue::LongUInt(rng.gen()),
            7 => AMQPValue::LongLongInt(rng.gen()),
            // From bit patterns: NaN, infinities and subnormals included.
            8 => AMQPValue::Float(f32::from_bits(rng.gen())),
            9 => AMQPValue::Double(f64::from_bits(rng.gen())),
            10 => AMQPValue::DecimalValue(DecimalValue {
                scale: rng.gen(),
                value: rng.gen(),
            }),
            11 => AMQPValue::ShortString(ShortString::from(text(rng, 255))),
            12 | 13 => AMQPValue::LongString(LongString::from(bytes(rng))),
            14 => AMQPValue::Timestamp(rng.gen()),
            15 => {
                if rng.gen_bool(0.5) {
                    AMQPValue::Void
                } else {
                    AMQPValue::ByteArray(bytes(rng).into())
                }
            }
            16 => {
                let n = rng.gen_range(0..5);
                AMQPValue::FieldArray(
                    (0..n)
                        .map(|_| value(rng, depth - 1))
                        .collect::<Vec<_>>()
                        .into(),
                )
            }
            _ => AMQPValue::FieldTable(table(rng, depth - 1)),
        }
    }

    /// A header table of up to a few dozen entries.
    pub(crate) fn table(rng: &mut StdRng, depth: usize) -> FieldTable {
        let mut t = FieldTable::default();
        for _ in 0..rng.gen_range(0..8) {
            t.insert(ShortString::from(text(rng, 255)), value(rng, depth));
        }
        if rng.gen_bool(0.02) {
            t.insert("deep".into(), nested_arrays(rng.gen_range(20..1_000)));
        }
        t
    }

    /// `levels` arrays, each holding the next, around one string.
    pub(crate) fn nested_arrays(levels: usize) -> AMQPValue {
        let mut v = AMQPValue::LongString("x".into());
        for _ in 0..levels {
            v = AMQPValue::FieldArray(vec![v].into());
        }
        v
    }
}

#[cfg(test)]
mod conversion_tests {
    use super::arbitrary::{nested_arrays, table};
    use super::*;
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    /// A scalar's text and type name bring back the same scalar.
    fn comes_back(v: &AMQPValue, bytes: &Bytes, ty: Option<&str>) -> bool {
        let back = from_header(bytes, ty);
        match (v, &back) {
            (AMQPValue::Float(a), AMQPValue::Float(b)) => a == b || (a.is_nan() && b.is_nan()),
            (AMQPValue::Double(a), AMQPValue::Double(b)) => a == b || (a.is_nan() && b.is_nan()),
            (AMQPValue::LongString(_), _) | (AMQPValue::ByteArray(_), _) => back == *v,
            (
                AMQPValue::Boolean(_)
                | AMQPValue::ShortShortInt(_)
                | AMQPValue::ShortShortUInt(_)
                | AMQPValue::ShortInt(_)
                | AMQPValue::ShortUInt(_)
                | AMQPValue::LongInt(_)
                | AMQPValue::LongUInt(_)
                | AMQPValue::LongLongInt(_)
                | AMQPValue::Timestamp(_),
                _,
            ) => back == *v,
            // Strings, decimals, void, arrays and tables go back as their text.
            _ => matches!(back, AMQPValue::LongString(_)),
        }
    }

    #[test]
    fn every_header_table_becomes_headers_whatever_it_holds() {
        for seed in 0..3_000u64 {
            let mut rng = StdRng::seed_from_u64(seed);
            let t = table(&mut rng, 3);
            let mut h = Headers::new();
            table_to_headers(&t, &mut h);
            let mut want = Vec::new();
            for (name, v) in t.inner() {
                let (bytes, ty) = to_header(v);
                assert!(comes_back(v, &bytes, ty), "seed {seed}: {name:?} = {v:?}");
                match v {
                    AMQPValue::LongString(s) => assert_eq!(&bytes[..], s.as_bytes()),
                    AMQPValue::ByteArray(b) => assert_eq!(&bytes[..], b.as_slice()),
                    AMQPValue::FieldArray(_) => {
                        assert!(bytes.starts_with(b"[") && bytes.ends_with(b"]"))
                    }
                    AMQPValue::FieldTable(_) => {
                        assert!(bytes.starts_with(b"{") && bytes.ends_with(b"}"))
                    }
                    _ => {}
                }
                want.push((name.as_str().to_string(), bytes.to_vec()));
                if let Some(ty) = ty {
                    want.push((props::type_of(name.as_str()), ty.as_bytes().to_vec()));
                }
            }
            let got: Vec<(String, Vec<u8>)> =
                h.iter().map(|(n, v)| (n.to_string(), v.to_vec())).collect();
            assert_eq!(got, want, "seed {seed}");
        }
    }

    #[test]
    fn nested_values_render_a_bounded_depth() {
        for levels in [MAX_RENDER_DEPTH - 1, MAX_RENDER_DEPTH, 200, 1_000] {
            let (text, ty) = to_header(&nested_arrays(levels));
            assert_eq!(ty, Some("array"));
            let want = if levels <= MAX_RENDER_DEPTH {
                format!("{}\"x\"{}", "[".repeat(levels), "]".repeat(levels))
            } else {
                format!(
                    "{}[...]{}",
                    "[".repeat(MAX_RENDER_DEPTH),
                    "]".repeat(MAX_RENDER_DEPTH)
                )
            };
            assert_eq!(String::from_utf8_lossy(&text), want, "{levels} levels");
        }
    }
}
