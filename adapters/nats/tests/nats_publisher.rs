//! The publisher against the real server: the dedup key becomes `Nats-Msg-Id`, and the
//! stream drops a second publish with the same key, saying so in the `PubAck`.

mod support;

use idemq_core::envelope::Position;
use idemq_core::{OutgoingMessage, PublishError, Publisher, DEDUP_HEADER};
use idemq_nats::MSG_ID_HEADER;

/// A producer retry after a lost `PubAck`: two publishes with one dedup key store one
/// message; the second is reported a duplicate, pointing at the stored one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_publish_with_the_same_key_is_stored_once_and_reported_a_duplicate() {
    let Some(url) = support::nats_url() else {
        return;
    };
    let names = support::Names::fresh("pub-dedup");
    // Declares the stream (its duplicate window is the server's default, 2 minutes).
    drop(support::source(support::config(&url, &names)).await);
    let p = support::publisher(&url).await;
    let m = OutgoingMessage::new(names.subject.clone(), r#"{"payment":"p-7"}"#)
        .with_key("order-7")
        .with_dedup_key("pay-7");
    let first = p.publish_acked(&m).await.expect("first publish");
    let second = p.publish_acked(&m).await.expect("second publish");
    let other = p
        .publish_acked(&m.clone().with_dedup_key("pay-8"))
        .await
        .expect("another key");
    assert!(!first.duplicate, "the first publish is stored: {first:?}");
    assert!(
        second.duplicate,
        "the resend must be reported a duplicate: {second:?}"
    );
    assert!(
        !other.duplicate,
        "another key is another message: {other:?}"
    );
    assert_eq!(first.stream, names.stream);
    assert_eq!(
        second.receipt.position, first.receipt.position,
        "a duplicate's PubAck names the stored message"
    );
    assert_eq!(first.receipt.message_id.as_deref(), Some("pay-7"));
    assert!(matches!(
        first.receipt.position,
        Some(Position::Sequence(_))
    ));

    // Pipelined, the same: a resend inside the batch names the first copy.
    let batch: Vec<OutgoingMessage> = ["pay-9", "pay-9", "pay-10"]
        .iter()
        .map(|k| m.clone().with_dedup_key(*k))
        .collect();
    let receipts: Vec<_> = p
        .publish_batch(batch)
        .await
        .into_iter()
        .map(|r| r.expect("batch publish").position)
        .collect();
    assert_eq!(
        receipts[0], receipts[1],
        "the resend names the stored message"
    );
    assert_ne!(receipts[1], receipts[2]);

    let stored = support::read_stream(&url, &names.stream)
        .await
        .expect("read the stream");
    let keys: Vec<(Option<&str>, Option<&str>)> = stored
        .iter()
        .map(|e| {
            (
                e.headers.get_str(MSG_ID_HEADER),
                e.headers.get_str(DEDUP_HEADER),
            )
        })
        .collect();
    assert_eq!(
        keys,
        ["pay-7", "pay-8", "pay-9", "pay-10"].map(|k| (Some(k), Some(k))),
        "one stored message per key, the key in Nats-Msg-Id and idemq's header"
    );
    assert_eq!(stored[0].key.as_deref(), Some(&b"order-7"[..]));
    let dlq = support::config(&url, &names).dead_letter_stream_name();
    support::delete_streams(&url, &[names.stream, dlq]).await;
}

/// A subject no stream captures is `Unroutable`, a header NATS cannot carry `Rejected`
/// with its name: neither is stored, and each says what to fix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_cannot_be_stored_says_why() {
    let Some(url) = support::nats_url() else {
        return;
    };
    let p = support::publisher(&url).await;
    let nowhere = format!("idemq-test.nowhere.{:08x}", rand::random::<u32>());
    match p.publish(OutgoingMessage::new(nowhere.clone(), "{}")).await {
        Err(PublishError::Unroutable(why)) => assert!(why.contains("no stream"), "{why}"),
        other => panic!("expected Unroutable for {nowhere}, got {other:?}"),
    }
    let bad = OutgoingMessage::new(nowhere, "{}").with_header("x-note", "two\nlines");
    match p.publish(bad).await {
        Err(PublishError::Rejected(why)) => assert!(why.contains("x-note"), "{why}"),
        other => panic!("expected Rejected, got {other:?}"),
    }
}
