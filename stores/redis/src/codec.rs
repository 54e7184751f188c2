//! The compact record encoding shared by the client and the Lua scripts.
//!
//! One Redis string per key instead of a hash, so a fresh claim is a single
//! `SET key record NX GET PX ttl`, the work of the classic Redis lock:
//!
//! ```text
//! i1|<status 0|1|2>|<token>|<payload hex?>|<worker len?>|<worker>|<lease_until>|<attempts>|<first_seen>|<completed?>|<expires?>|<'-' | '+'<result bytes>>
//! ```
//!
//! Integers are decimal, times milliseconds since the Unix epoch; `?` fields are empty
//! when absent; the worker is length-prefixed and the result runs to the end, so both may
//! hold any bytes (`|` included). The identity part (token, payload hash, worker) comes
//! first, so the scripts rewrite the times and status while copying it as one substring.

use bytes::Bytes;
use idemq_core::{DedupKey, DedupRecord, FencingToken, PayloadHash, RecordStatus};

/// Why a stored value could not be read back.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The value does not start with the `i1|` version tag.
    #[error("value is not an idemq v1 record")]
    NotARecord,
    /// A header field is missing or malformed.
    #[error("field `{0}` is missing or malformed")]
    Field(&'static str),
    /// The worker name is not UTF-8.
    #[error("worker name is not UTF-8")]
    Worker,
    /// The result marker is neither `-` nor `+`.
    #[error("result marker is malformed")]
    Result,
}

/// The worker field as the scripts store it: `<len>|<worker>`, or `|` for none.
pub(crate) fn worker_field(worker: Option<&str>) -> Vec<u8> {
    match worker {
        None => b"|".to_vec(),
        Some(w) => {
            let mut v = format!("{}|", w.len()).into_bytes();
            v.extend_from_slice(w.as_bytes());
            v
        }
    }
}

/// The result field: `-` for none, `+` and the bytes otherwise.
pub(crate) fn result_field(result: Option<&Bytes>) -> Vec<u8> {
    match result {
        None => b"-".to_vec(),
        Some(r) => {
            let mut v = Vec::with_capacity(r.len() + 1);
            v.push(b'+');
            v.extend_from_slice(r);
            v
        }
    }
}

/// The payload hash field: lowercase hex or empty.
pub(crate) fn hash_field(h: Option<&PayloadHash>) -> String {
    h.map(PayloadHash::to_hex).unwrap_or_default()
}

/// The identity part of a record, written by the client for a fresh claim:
/// `i1|0|<token>|<payload hex or empty>|<worker len or empty>|<worker>|`.
pub(crate) fn claim_identity(
    token: FencingToken,
    payload_hash: Option<&PayloadHash>,
    worker: Option<&str>,
) -> Vec<u8> {
    let mut v = Vec::with_capacity(96 + worker.map_or(0, str::len));
    write_identity(&mut v, token, payload_hash, worker);
    v
}

/// Appends the identity part to `out` (no allocation beyond `out`'s growth).
pub(crate) fn write_identity(
    out: &mut Vec<u8>,
    token: FencingToken,
    payload_hash: Option<&PayloadHash>,
    worker: Option<&str>,
) {
    use std::io::Write;
    // Writing into a Vec cannot fail.
    let _ = write!(out, "i1|0|{}|", token.0);
    if let Some(h) = payload_hash {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        for b in h.0 {
            out.push(HEX[usize::from(b >> 4)]);
            out.push(HEX[usize::from(b & 15)]);
        }
    }
    out.push(b'|');
    if let Some(w) = worker {
        let _ = write!(out, "{}|", w.len());
        out.extend_from_slice(w.as_bytes());
    } else {
        out.push(b'|');
    }
    out.push(b'|');
}

fn int<T: std::str::FromStr>(f: &[u8], name: &'static str) -> Result<T, DecodeError> {
    std::str::from_utf8(f)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or(DecodeError::Field(name))
}

fn opt_int(f: &[u8], name: &'static str) -> Result<Option<i64>, DecodeError> {
    if f.is_empty() {
        Ok(None)
    } else {
        int(f, name).map(Some)
    }
}

/// Splits `n` `|`-terminated fields off the front of `rest`.
fn fields<'a, const N: usize>(
    rest: &'a [u8],
    names: [&'static str; N],
) -> Result<([&'a [u8]; N], &'a [u8]), DecodeError> {
    let mut out: [&[u8]; N] = [&[]; N];
    let mut pos = 0usize;
    for (f, name) in out.iter_mut().zip(names) {
        let end = rest[pos..]
            .iter()
            .position(|&b| b == b'|')
            .ok_or(DecodeError::Field(name))?;
        *f = &rest[pos..pos + end];
        pos += end + 1;
    }
    Ok((out, &rest[pos..]))
}

/// Decodes a stored value into the record of `key`.
pub fn decode_record(key: DedupKey, v: &[u8]) -> Result<DedupRecord, DecodeError> {
    let rest = v.strip_prefix(b"i1|").ok_or(DecodeError::NotARecord)?;
    let ([st, tok, ph, wl], rest) =
        fields(rest, ["status", "token", "payload_hash", "worker_len"])?;
    let status = match st {
        b"0" => RecordStatus::InProgress,
        b"1" => RecordStatus::Completed,
        b"2" => RecordStatus::RolledBack,
        _ => return Err(DecodeError::Field("status")),
    };
    let token: i64 = int(tok, "token")?;
    let payload_hash = if ph.is_empty() {
        None
    } else {
        let s = std::str::from_utf8(ph).map_err(|_| DecodeError::Field("payload_hash"))?;
        Some(PayloadHash::from_hex(s).ok_or(DecodeError::Field("payload_hash"))?)
    };
    let (worker, rest) = if wl.is_empty() {
        (None, rest)
    } else {
        let len: usize = int(wl, "worker_len")?;
        let w = rest.get(..len).ok_or(DecodeError::Field("worker"))?;
        let w = std::str::from_utf8(w).map_err(|_| DecodeError::Worker)?;
        (Some(w.to_string()), &rest[len..])
    };
    let rest = rest
        .strip_prefix(b"|")
        .ok_or(DecodeError::Field("worker"))?;
    let ([lu, att, fs, cm, ex], tail) = fields(
        rest,
        [
            "lease_until",
            "attempts",
            "first_seen",
            "completed",
            "expires",
        ],
    )?;
    let result = match tail.split_first() {
        Some((b'-', [])) => None,
        Some((b'+', r)) => Some(Bytes::copy_from_slice(r)),
        _ => return Err(DecodeError::Result),
    };
    Ok(DedupRecord {
        key,
        status,
        token: FencingToken(token),
        lease_until_ms: int(lu, "lease_until")?,
        attempts: int(att, "attempts")?,
        payload_hash,
        result,
        first_seen_ms: int(fs, "first_seen")?,
        completed_ms: opt_int(cm, "completed")?,
        expires_ms: opt_int(ex, "expires")?,
        worker: worker.map(std::sync::Arc::from),
    })
}

/// Encodes a record the way the scripts write it (tests and tools).
pub fn encode_record(r: &DedupRecord) -> Vec<u8> {
    let opt = |v: Option<i64>| v.map(|x| x.to_string()).unwrap_or_default();
    let mut v = format!(
        "i1|{}|{}|{}|",
        r.status.code(),
        r.token.0,
        hash_field(r.payload_hash.as_ref()),
    )
    .into_bytes();
    v.extend(worker_field(r.worker.as_deref()));
    v.extend_from_slice(
        format!(
            "|{}|{}|{}|{}|{}|",
            r.lease_until_ms,
            r.attempts,
            r.first_seen_ms,
            opt(r.completed_ms),
            opt(r.expires_ms)
        )
        .as_bytes(),
    );
    v.extend(result_field(r.result.as_ref()));
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use idemq_core::ConsumerGroup;

    fn key() -> DedupKey {
        DedupKey::new(&ConsumerGroup::new("g").unwrap(), "k|1").unwrap()
    }

    #[test]
    fn round_trips_every_field_including_binary_results_and_pipes_in_worker() {
        let rec = DedupRecord {
            key: key(),
            status: RecordStatus::Completed,
            token: FencingToken(i64::MAX),
            lease_until_ms: 1_700_000_000_123,
            attempts: 3,
            payload_hash: Some(PayloadHash::of(b"x")),
            result: Some(Bytes::from_static(b"a|b\x00\xff-+")),
            first_seen_ms: 1_700_000_000_000,
            completed_ms: Some(1_700_000_000_200),
            expires_ms: Some(1_700_000_360_200),
            worker: Some("w|ü|".into()),
        };
        assert_eq!(decode_record(key(), &encode_record(&rec)).unwrap(), rec);
        let ok = b"i1|0|1||||1|1|1|||-";
        assert_eq!(decode_record(key(), ok).unwrap().lease_until_ms, 1);
        let bare = DedupRecord {
            status: RecordStatus::InProgress,
            payload_hash: None,
            result: None,
            completed_ms: None,
            expires_ms: None,
            worker: None,
            lease_until_ms: 0,
            ..rec
        };
        assert_eq!(decode_record(key(), &encode_record(&bare)).unwrap(), bare);
        let empty_worker = DedupRecord {
            worker: Some("".into()),
            result: Some(Bytes::new()),
            ..bare
        };
        assert_eq!(
            decode_record(key(), &encode_record(&empty_worker)).unwrap(),
            empty_worker
        );
    }

    #[test]
    fn foreign_or_truncated_values_are_errors_not_panics() {
        for v in [
            &b""[..],
            b"OK",
            b"i1|",
            b"i1|3|1|||1|1|1|||-",
            b"i1|0|x|||1|1|1|||-",
            b"i1|0|1|zz|||1|1|1|||-",
            b"i1|0|1||5|ab|1|1|1|||-",
            b"i1|0|1|||1|1|1|||",
            b"i1|0|1|||1|1|1|||*",
            b"i1|0|1|||1|1|1||-",
            b"i1|0|1|||x|1|1|||-",
        ] {
            assert!(
                decode_record(key(), v).is_err(),
                "{:?}",
                String::from_utf8_lossy(v)
            );
        }
    }
}
