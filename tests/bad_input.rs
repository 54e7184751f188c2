//! The bad-input catalogue, through the public API and the CLI as a user meets it: each
//! bad message is dead-lettered with a reason that says what is wrong, the good messages
//! around it are processed once, nothing is lost, and the consumer keeps running; each bad
//! setting is refused at configuration with a message naming the fix.
//!
//! Runs on the default features (the in-memory broker, SQLite): no server needed.

use idemq::broker::MemoryBroker;
use idemq::sql::{SqlStoreOptions, SqliteStore, TableName};
use idemq::{
    BrokerKind, ClaimedMessage, ConsumerConfig, ConsumerGroup, Envelope, HandlerError,
    IdempotentConsumer, KeyStrategy, OversizeKey,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

mod support;
use support::Refused;

const HEADER: &str = "x-idempotency-key";

/// Effects by business key, recorded by the handler (independently of the dedup store).
type Effects = Arc<Mutex<HashMap<String, u32>>>;

async fn sqlite() -> Arc<SqliteStore> {
    Arc::new(
        SqliteStore::connect("sqlite::memory:", SqlStoreOptions::default())
            .await
            .expect("sqlite"),
    )
}

/// A consumer recording each effect; a payload of `big-result` returns a result over the
/// engine's bound.
fn consumer(
    store: Arc<SqliteStore>,
    keys: KeyStrategy,
    effects: Effects,
) -> IdempotentConsumer<impl idemq::Handler> {
    IdempotentConsumer::new(store, keys, move |m: ClaimedMessage| {
        let effects = effects.clone();
        async move {
            *effects
                .lock()
                .expect("effects")
                .entry(m.key.business_key().to_owned())
                .or_default() += 1;
            if &m.envelope.payload[..] == b"big-result" {
                return Ok(Some(vec![b'r'; 128 * 1024].into()));
            }
            Ok::<_, HandlerError>(None)
        }
    })
    .with_config(ConsumerConfig {
        max_result_bytes: 64 * 1024,
        ..ConsumerConfig::default()
    })
}

fn msg(payload: impl Into<idemq::Bytes>) -> Envelope {
    Envelope::new(BrokerKind::MEMORY, "payments", payload)
}

/// The dead letter whose payload is `payload`, and its reason.
fn reason_for(broker: &MemoryBroker, payload: &[u8]) -> String {
    broker
        .dead_letters()
        .into_iter()
        .find(|d| &d.envelope.payload[..] == payload)
        .map(|d| d.reason)
        .unwrap_or_else(|| {
            panic!(
                "`{}` was not dead-lettered",
                String::from_utf8_lossy(payload)
            )
        })
}

#[tokio::test]
async fn bad_messages_are_dead_lettered_with_reasons_and_the_rest_flow() {
    let broker = MemoryBroker::new();
    let keys = KeyStrategy::header("billing", HEADER).expect("keys");
    let effects: Effects = Arc::default();

    // Good messages around the bad ones, one of them sent twice.
    broker.publish(msg("good-1").with_header(HEADER, "pay-1"));
    broker.publish(msg("no-key"));
    broker.publish(msg("empty-key").with_header(HEADER, ""));
    broker.publish(msg("not-utf8").with_header(HEADER, vec![0xff_u8, 0xfe, 0x00]));
    broker.publish(msg("good-1").with_header(HEADER, "pay-1"));
    // A giant payload is a payload like any other.
    let giant = vec![b'p'; 8 * 1024 * 1024];
    broker.publish(msg(giant.clone()).with_header(HEADER, "pay-giant"));
    // An oversize key is hashed (the default policy), and a raw key that spells out that
    // very hash is a different key: it must not be taken for a duplicate of it.
    let oversize = "o".repeat(1000);
    let long = msg("long-key").with_header(HEADER, oversize.clone());
    let hashed = keys.derive(&long).expect("an oversize key is hashed");
    assert!(
        hashed.business_key().starts_with("#sha256:"),
        "{}",
        hashed.business_key()
    );
    broker.publish(long);
    broker.publish(msg("mimic").with_header(HEADER, hashed.business_key().to_owned()));
    // A handler result over max_result_bytes.
    broker.publish(msg("big-result").with_header(HEADER, "pay-big-result"));
    broker.publish(msg("good-2").with_header(HEADER, "pay-2"));

    let c = consumer(sqlite().await, keys.clone(), effects.clone());
    c.run_until_idle(&mut broker.subscribe())
        .await
        .expect("the consumer keeps running through bad input");

    let no_key = reason_for(&broker, b"no-key");
    assert!(no_key.contains(HEADER), "names the header: {no_key}");
    let empty = reason_for(&broker, b"empty-key");
    assert!(empty.contains("empty"), "{empty}");
    let not_utf8 = reason_for(&broker, b"not-utf8");
    assert!(not_utf8.contains("UTF-8"), "{not_utf8}");
    let big = reason_for(&broker, b"big-result");
    assert!(big.contains("max_result_bytes"), "{big}");
    assert_eq!(broker.dead_letters().len(), 4, "only the bad ones");

    let effects = effects.lock().expect("effects").clone();
    assert_eq!(effects.get("pay-1"), Some(&1), "the duplicate was skipped");
    assert_eq!(effects.get("pay-2"), Some(&1));
    assert_eq!(effects.get("pay-giant"), Some(&1));
    assert_eq!(
        effects.get(hashed.business_key()),
        Some(&1),
        "the hashed key"
    );
    let mimic = keys
        .derive(&msg("mimic").with_header(HEADER, hashed.business_key().to_owned()))
        .expect("mimic key");
    assert_ne!(
        mimic, hashed,
        "a raw `#sha256:` key is escaped, not confused"
    );
    assert_eq!(effects.get(mimic.business_key()), Some(&1), "the mimic ran");
    // Nothing lost: every message was acked or dead-lettered, none is left.
    assert_eq!(broker.pending(), 0);
    assert_eq!(
        broker.acked() + broker.dead_letters().len() as u64,
        broker.published()
    );
}

#[tokio::test]
async fn payloads_a_json_pointer_cannot_read_are_dead_lettered() {
    let broker = MemoryBroker::new();
    broker.publish(msg(r#"{"payment_id":"p-1"}"#));
    broker.publish(msg("not json {"));
    broker.publish(msg(r#"{"other":1}"#));
    broker.publish(msg(r#"{"payment_id":null}"#));
    broker.publish(msg(r#"{"payment_id":"p-2"}"#));
    let effects: Effects = Arc::default();
    let keys = KeyStrategy::json_pointer("billing", "/payment_id").expect("keys");
    let c = consumer(sqlite().await, keys, effects.clone());
    c.run_until_idle(&mut broker.subscribe())
        .await
        .expect("run");

    let malformed = reason_for(&broker, b"not json {");
    assert!(malformed.contains("not valid JSON"), "{malformed}");
    assert!(
        malformed.contains("/payment_id"),
        "names the pointer: {malformed}"
    );
    let missing = reason_for(&broker, br#"{"other":1}"#);
    assert!(missing.contains("/payment_id"), "{missing}");
    let null = reason_for(&broker, br#"{"payment_id":null}"#);
    assert!(
        null.contains("null") && null.contains("/payment_id"),
        "names the null: {null}"
    );
    let effects = effects.lock().expect("effects").clone();
    assert_eq!(effects.len(), 2, "{effects:?}");
    assert_eq!(broker.pending(), 0);
}

#[tokio::test]
async fn an_oversize_key_under_the_reject_policy_is_dead_lettered() {
    let broker = MemoryBroker::new();
    broker.publish(msg("long").with_header(HEADER, "k".repeat(300)));
    broker.publish(msg("short").with_header(HEADER, "pay-1"));
    let keys = KeyStrategy::header("billing", HEADER)
        .expect("keys")
        .oversize(OversizeKey::Reject);
    let effects: Effects = Arc::default();
    let c = consumer(sqlite().await, keys, effects.clone());
    c.run_until_idle(&mut broker.subscribe())
        .await
        .expect("run");
    let why = reason_for(&broker, b"long");
    assert!(why.contains("300 bytes"), "{why}");
    assert_eq!(effects.lock().expect("effects").len(), 1);
}

#[test]
fn hostile_names_are_refused_at_configuration() {
    for hostile in [
        "billing'; DROP TABLE idemq_dedup; --",
        "a b",
        "",
        "x\u{0}y",
        &"g".repeat(65),
    ] {
        let e = ConsumerGroup::new(hostile).expect_err("hostile group");
        assert!(e.to_string().contains("A-Z a-z 0-9"), "{e}");
        assert!(KeyStrategy::header(hostile, HEADER).is_err());
    }
    for hostile in [
        "dedup; DROP TABLE users",
        "dedup\"--",
        "1dedup",
        "a.b.c.d",
        "",
    ] {
        let e = TableName::new(hostile).expect_err("hostile table");
        assert!(!e.to_string().is_empty());
    }
    let e = KeyStrategy::json_pointer("billing", "payment_id").expect_err("not a pointer");
    assert!(e.to_string().contains("start with `/`"), "{e}");
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn hostile_redis_prefixes_are_refused_before_connecting() {
    for hostile in ["idemq dedup", "pre\r\nFLUSHALL\r\n", "{tag", "all*", ""] {
        assert!(
            idemq::redis::validate_prefix(hostile).is_err(),
            "{hostile:?}"
        );
        // Port 1: nothing listens, so only the prefix check can answer.
        let e = idemq::redis::RedisStore::builder("redis://127.0.0.1:1/")
            .prefix(hostile)
            .connect()
            .await
            .refused("hostile prefix");
        assert!(e.to_string().contains("prefix"), "{e}");
    }
}

#[tokio::test]
async fn an_unknown_store_url_lists_the_supported_schemes() {
    let e = idemq::open_store("cassandra://db1/ks")
        .await
        .refused("refused");
    let text = e.to_string();
    assert!(text.contains("cassandra"), "{text}");
    assert!(
        text.contains("sqlite://") && text.contains("postgres://"),
        "{text}"
    );
    let e = idemq::open_store("not a url").await.refused("refused");
    assert!(e.to_string().contains("not a store URL"), "{e}");
}
