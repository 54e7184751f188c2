//! How a dedup key becomes a KV key, and a [`DedupRecord`] a KV value.
//!
//! **Keys.** A KV key may hold only `A-Z a-z 0-9 - _ = / .` (it is the tail of a subject:
//! a dot splits tokens, `*`/`>` are wildcards, a space ends the subject), and a dedup key
//! may hold any text. [`encode_key`] keeps `A-Z a-z 0-9 - _` and writes every other byte
//! (`=` included) as `=XX` (uppercase hex), so the map is injective: two dedup keys never
//! share a KV key, and none is refused. The result is one subject token (no dots), so the
//! store's keys are `<prefix>.<encoded>`; an encoding over [`MAX_ENCODED_KEY_LEN`] is
//! replaced by `=H` and the SHA-256 of the dedup key (`=H` never starts an escape, which
//! is `=` and two hex digits).
//!
//! **Values.** One JSON object per record (readable with `nats kv get`); the result bytes
//! in hex. The dedup key itself is stored too, so scans rebuild it without decoding.

use bytes::Bytes;
use idemq_core::{DedupKey, DedupRecord, FencingToken, PayloadHash, RecordStatus, StoreError};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::sync::Arc;

/// The longest encoded dedup key kept readable; longer ones are hashed.
pub const MAX_ENCODED_KEY_LEN: usize = 1024;

/// The KV key segment of a dedup key (see the module docs).
///
/// ```
/// use idemq_nats_kv::codec::encode_key;
/// assert_eq!(encode_key("orders:42"), "orders=3A42");
/// assert_eq!(encode_key("a.b c=*"), "a=2Eb=20c=3D=2A");
/// assert_ne!(encode_key("a=2E"), encode_key("a."));
/// ```
pub fn encode_key(key: &str) -> String {
    if key.is_empty() {
        // A lone `=` is no escape, so no other key encodes to it.
        return "=".into();
    }
    let mut out = String::with_capacity(key.len() + 8);
    for b in key.bytes() {
        if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' {
            out.push(b as char);
        } else {
            out.push('=');
            out.push_str(&format!("{b:02X}"));
        }
    }
    if out.len() > MAX_ENCODED_KEY_LEN {
        return format!("=H{}", hex::encode(Sha256::digest(key.as_bytes())));
    }
    out
}

/// The stored form of a record.
#[derive(Debug, Serialize, Deserialize)]
struct Stored {
    /// Format version.
    v: u8,
    key: String,
    status: String,
    token: i64,
    lease_until_ms: i64,
    attempts: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    payload_hash: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    result_hex: Option<String>,
    first_seen_ms: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    completed_ms: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    expires_ms: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    worker: Option<String>,
}

const IN_PROGRESS: &str = "in_progress";
const COMPLETED: &str = "completed";
const ROLLED_BACK: &str = "rolled_back";

/// Encodes a record as the KV value.
pub fn encode_record(r: &DedupRecord) -> Bytes {
    let s = Stored {
        v: 1,
        key: r.key.as_str().to_string(),
        status: match r.status {
            RecordStatus::InProgress => IN_PROGRESS,
            RecordStatus::Completed => COMPLETED,
            RecordStatus::RolledBack => ROLLED_BACK,
        }
        .to_string(),
        token: r.token.0,
        lease_until_ms: r.lease_until_ms,
        attempts: r.attempts,
        payload_hash: r.payload_hash.map(|h| h.to_hex()),
        result_hex: r.result.as_ref().map(hex::encode),
        first_seen_ms: r.first_seen_ms,
        completed_ms: r.completed_ms,
        expires_ms: r.expires_ms,
        worker: r.worker.as_deref().map(str::to_string),
    };
    // Serialising plain strings and integers cannot fail.
    Bytes::from(serde_json::to_vec(&s).unwrap_or_default())
}

/// Decodes a KV value; `kv_key` only names the record in the error.
pub fn decode_record(kv_key: &str, value: &[u8]) -> Result<DedupRecord, StoreError> {
    let corrupt = |reason: String| StoreError::Corrupt {
        key: kv_key.to_string(),
        reason,
    };
    let s: Stored =
        serde_json::from_slice(value).map_err(|e| corrupt(format!("not an idemq record: {e}")))?;
    if s.v != 1 {
        return Err(corrupt(format!(
            "record format {} is newer than this idemq",
            s.v
        )));
    }
    let status = match s.status.as_str() {
        IN_PROGRESS => RecordStatus::InProgress,
        COMPLETED => RecordStatus::Completed,
        ROLLED_BACK => RecordStatus::RolledBack,
        other => return Err(corrupt(format!("unknown status {other:?}"))),
    };
    let token = FencingToken::new(s.token)
        .ok_or_else(|| corrupt(format!("fencing token {} out of range", s.token)))?;
    let payload_hash = match s.payload_hash {
        Some(h) => Some(
            PayloadHash::from_hex(&h).ok_or_else(|| corrupt(format!("bad payload hash {h:?}")))?,
        ),
        None => None,
    };
    let result = match s.result_hex {
        Some(h) => Some(Bytes::from(
            hex::decode(&h).map_err(|e| corrupt(format!("bad result hex: {e}")))?,
        )),
        None => None,
    };
    Ok(DedupRecord {
        key: DedupKey::from_stored(s.key),
        status,
        token,
        lease_until_ms: s.lease_until_ms,
        attempts: s.attempts,
        payload_hash,
        result,
        first_seen_ms: s.first_seen_ms,
        completed_ms: s.completed_ms,
        expires_ms: s.expires_ms,
        worker: s.worker.map(Arc::<str>::from),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_byte_string_gets_its_own_valid_key() {
        let keys = [
            "",
            "=",
            "==",
            "a",
            "a.b",
            "a=2Eb",
            "a b",
            "a\u{0}b",
            "*",
            ">",
            "a/b",
            "é",
            "=H00",
            "orders:42",
            "orders=3A42",
        ];
        let enc: Vec<String> = keys.iter().map(|k| encode_key(k)).collect();
        for (k, e) in keys.iter().zip(&enc) {
            assert!(
                e.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'=')),
                "{k:?} -> {e:?}"
            );
        }
        let distinct: std::collections::HashSet<&String> = enc.iter().collect();
        assert_eq!(distinct.len(), keys.len(), "{enc:?}");
        let long = "\u{1F600}".repeat(300);
        assert!(encode_key(&long).starts_with("=H"));
        assert!(encode_key(&long).len() <= MAX_ENCODED_KEY_LEN);
    }

    #[test]
    fn a_record_survives_the_round_trip() {
        let r = DedupRecord {
            key: DedupKey::from_stored("g:k\u{0}"),
            status: RecordStatus::Completed,
            token: FencingToken(7),
            lease_until_ms: 10,
            attempts: 2,
            payload_hash: Some(PayloadHash::of(b"x")),
            result: Some(Bytes::from_static(b"\x00\xffok")),
            first_seen_ms: 1,
            completed_ms: Some(5),
            expires_ms: Some(9),
            worker: Some("w".into()),
        };
        assert_eq!(decode_record("k", &encode_record(&r)).expect("decode"), r);
        let e = decode_record("k", b"{}").expect_err("garbage");
        assert!(matches!(e, StoreError::Corrupt { .. }), "{e:?}");
    }
}
