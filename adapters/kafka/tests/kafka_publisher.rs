//! The publisher and the envelope mapping on the real broker.

mod support;

use idemq_core::envelope::{props, Position};
use idemq_core::publish::{OutgoingMessage, PublishError, Publisher, DEDUP_HEADER};
use idemq_core::source::{Delivery, Source};
use idemq_core::KeyStrategy;
use idemq_kafka::rdkafka::error::{KafkaError, KafkaResult, RDKafkaErrorCode};
use idemq_kafka::rdkafka::message::{Header, OwnedHeaders};
use idemq_kafka::rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use idemq_kafka::{
    commit_transaction, partition_of, KafkaProducerConfig, KafkaPublisher, KafkaSource,
    NULL_HEADER_TYPE,
};
use std::time::Duration;

async fn collect(src: &mut KafkaSource, n: usize, within: Duration) -> Vec<Delivery> {
    let deadline = tokio::time::Instant::now() + within;
    let mut got = Vec::new();
    while got.len() < n {
        match tokio::time::timeout_at(deadline, src.poll(n - got.len())).await {
            Ok(Ok(Some(b))) => got.extend(b),
            _ => break,
        }
    }
    got
}

/// A dedup key published with the message is read back by `KeyStrategy::dedup_header`, and
/// the envelope carries the record's coordinates, key, timestamp and leader epoch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_published_dedup_key_comes_back_with_the_records_coordinates() {
    let Some(brokers) = support::brokers() else {
        return;
    };
    let topic = support::unique("roundtrip");
    support::create_topic(&brokers, &topic, 2).await;
    let receipt = support::publisher(&brokers)
        .await
        .publish(
            OutgoingMessage::new(&topic, "{\"payment\":7}")
                .with_key("order-7")
                .with_header("x-trace", "abc")
                .with_dedup_key("payment-7"),
        )
        .await
        .expect("publish");
    let mut src = support::subscribe(&brokers, &support::unique("g"), &topic).await;
    let got = collect(&mut src, 1, Duration::from_secs(30)).await;
    let d = got.into_iter().next().expect("the message must arrive");
    let env = &d.envelope;
    assert_eq!(
        KeyStrategy::dedup_header("billing")
            .unwrap()
            .derive(env)
            .unwrap()
            .as_str(),
        "billing:payment-7"
    );
    assert_eq!(env.headers.get_str(DEDUP_HEADER), Some("payment-7"));
    assert_eq!(env.headers.get_str("x-trace"), Some("abc"));
    assert_eq!(env.key.as_deref(), Some(&b"order-7"[..]));
    assert_eq!(env.source.cluster.as_deref(), Some("test"));
    assert_eq!(env.source.name, topic);
    assert_eq!(env.source.partition, receipt.partition);
    assert_eq!(env.source.position, receipt.position);
    assert!(env.timestamp_ms.is_some_and(|t| t > 0));
    assert!(
        env.headers
            .get_str(props::LEADER_EPOCH)
            .is_some_and(|e| e.parse::<i32>().is_ok()),
        "leader epoch missing: {:?}",
        env.headers
    );
    assert_eq!(env.delivery_count, Some(1));
    d.ack().await.expect("ack");
    src.close().await.expect("close");
}

/// Every value of a record comes back byte for byte, whether the record's values share one
/// buffer (small records) or are copied one by one (a payload over 4 KiB): key or no key, a
/// null header value (marked), an empty one, non-UTF-8 bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn record_values_map_losslessly_small_and_large() {
    let Some(brokers) = support::brokers() else {
        return;
    };
    let topic = support::unique("values");
    support::create_topic(&brokers, &topic, 1).await;
    let producer: FutureProducer = KafkaProducerConfig::idempotent(&brokers)
        .client_config()
        .unwrap()
        .create()
        .unwrap();
    let large: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
    let cases: [(Option<&[u8]>, &[u8]); 3] = [
        (Some(b"order-1"), b"{\"small\":1}"),
        (None, &[0xff, 0xfe, 0x00, 0x80]),
        (Some(b"order-3"), &large),
    ];
    for (key, payload) in cases {
        let headers = OwnedHeaders::new()
            .insert(Header {
                key: "absent",
                value: None::<&[u8]>,
            })
            .insert(Header {
                key: "empty",
                value: Some(&b""[..]),
            })
            .insert(Header {
                key: "binary",
                value: Some(&[0u8, 0xc3, 0x28][..]),
            });
        let mut rec = FutureRecord::<[u8], [u8]>::to(&topic)
            .payload(payload)
            .headers(headers);
        if let Some(k) = key {
            rec = rec.key(k);
        }
        producer
            .send(rec, Duration::from_secs(10))
            .await
            .map_err(|(e, _)| e)
            .expect("send");
    }
    let mut src = support::subscribe(&brokers, &support::unique("g"), &topic).await;
    let got = collect(&mut src, 3, Duration::from_secs(30)).await;
    assert_eq!(got.len(), 3, "all three records arrive");
    for (d, (key, payload)) in got.iter().zip(cases) {
        let env = &d.envelope;
        assert_eq!(env.key.as_deref(), key);
        assert_eq!(&env.payload[..], payload);
        assert_eq!(env.headers.get("absent").map(|v| v.len()), Some(0));
        assert_eq!(
            env.headers.get_str(&props::type_of("absent")),
            Some(NULL_HEADER_TYPE),
            "a null header value is marked"
        );
        assert_eq!(env.headers.get("empty").map(|v| &v[..]), Some(&b""[..]));
        assert_eq!(env.headers.get_str(&props::type_of("empty")), None);
        assert_eq!(
            env.headers.get("binary").map(|v| &v[..]),
            Some(&[0u8, 0xc3, 0x28][..])
        );
        assert!(env
            .headers
            .get_str(props::LEADER_EPOCH)
            .is_some_and(|e| e.parse::<i32>().is_ok()));
    }
    for d in got {
        d.ack().await.expect("ack");
    }
    src.close().await.expect("close");
}

/// With an ordering key the partition is Kafka's default hash of it, whatever the record key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ordering_key_picks_the_partition() {
    let Some(brokers) = support::brokers() else {
        return;
    };
    let topic = support::unique("ordering");
    support::create_topic(&brokers, &topic, 4).await;
    let p = support::publisher(&brokers).await;
    for i in 0..8 {
        let ok = format!("customer-{i}");
        let r = p
            .publish(
                OutgoingMessage::new(&topic, "{}")
                    .with_key(format!("unrelated-{i}"))
                    .with_ordering_key(ok.clone()),
            )
            .await
            .expect("publish");
        assert_eq!(r.partition, Some(partition_of(ok.as_bytes(), 4)));
        assert!(matches!(r.position, Some(Position::Offset(_))));
    }
}

/// A message over the size limit is refused as `Rejected` (not stored, not worth a resend).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_message_is_rejected() {
    let Some(brokers) = support::brokers() else {
        return;
    };
    let p = KafkaPublisher::connect(
        &KafkaProducerConfig::idempotent(&brokers).set("message.max.bytes", "2000"),
    )
    .await
    .expect("publisher");
    let err = p
        .publish(OutgoingMessage::new(
            support::unique("big"),
            vec![b'x'; 10_000],
        ))
        .await
        .expect_err("too large");
    assert!(matches!(err, PublishError::Rejected(_)), "{err:?}");
}

/// `read_committed` hides an aborted transaction's records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_committed_hides_aborted_records() {
    let Some(brokers) = support::brokers() else {
        return;
    };
    let topic = support::unique("rc");
    support::create_topic(&brokers, &topic, 1).await;
    let cfg = KafkaProducerConfig::transactional(&brokers, &support::unique("txn"));
    let producer: FutureProducer = cfg.client_config().unwrap().create().unwrap();
    let send = |p: FutureProducer, payload: &'static str, commit: bool| {
        let topic = topic.clone();
        async move {
            p.begin_transaction().expect("begin");
            p.send(
                FutureRecord::<str, str>::to(&topic).payload(payload),
                Duration::from_secs(10),
            )
            .await
            .expect("send");
            let p2 = p.clone();
            tokio::task::spawn_blocking(move || {
                if commit {
                    p2.commit_transaction(Duration::from_secs(10))
                } else {
                    p2.abort_transaction(Duration::from_secs(10))
                }
            })
            .await
            .unwrap()
            .expect("end transaction");
        }
    };
    {
        let p = producer.clone();
        tokio::task::spawn_blocking(move || p.init_transactions(Duration::from_secs(20)))
            .await
            .unwrap()
            .expect("init");
    }
    send(producer.clone(), "aborted", false).await;
    send(producer.clone(), "committed", true).await;

    let cfg = support::source_config(&brokers, &support::unique("g"), &topic).read_committed();
    let mut src = KafkaSource::connect(cfg).await.expect("source");
    let got = collect(&mut src, 2, Duration::from_secs(8)).await;
    let payloads: Vec<_> = got
        .iter()
        .map(|d| String::from_utf8_lossy(&d.envelope.payload).to_string())
        .collect();
    assert_eq!(payloads, vec!["committed".to_string()]);
    src.close().await.expect("close");
}

/// `idemq_kafka::commit_transaction` commits records still in flight when it is called
/// (it waits for their delivery reports itself), and at a zero timeout refuses with a
/// flush time-out, leaving the transaction open for the caller to abort.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_transaction_waits_for_in_flight_records_and_times_out_cleanly() {
    let Some(brokers) = support::brokers() else {
        return;
    };
    let topic = support::unique("commit");
    support::create_topic(&brokers, &topic, 2).await;
    let cfg = KafkaProducerConfig::transactional(&brokers, &support::unique("txn"));
    let producer: FutureProducer = cfg.client_config().unwrap().create().unwrap();
    let blocking = |p: &FutureProducer, f: fn(&FutureProducer) -> KafkaResult<()>| {
        let p = p.clone();
        async move { tokio::task::spawn_blocking(move || f(&p)).await.unwrap() }
    };
    blocking(&producer, |p| p.init_transactions(Duration::from_secs(20)))
        .await
        .expect("init");
    let send_all = |p: &FutureProducer, what: &str| {
        (0..300)
            .map(|i| {
                let payload = format!("{what}-{i}");
                p.send_result(
                    FutureRecord::<str, str>::to(&topic)
                        .key(&payload)
                        .payload(&payload),
                )
                .map_err(|(e, _)| e)
                .expect("enqueue")
            })
            .collect::<Vec<_>>()
    };

    // Nothing can be delivered within zero time: refused, transaction still open.
    producer.begin_transaction().expect("begin");
    let doomed = send_all(&producer, "aborted");
    let refused = blocking(&producer, |p| commit_transaction(p, Duration::ZERO)).await;
    assert!(
        matches!(
            refused,
            Err(KafkaError::Flush(RDKafkaErrorCode::OperationTimedOut))
        ),
        "a zero timeout with records in flight is a flush time-out, got {refused:?}"
    );
    blocking(&producer, |p| p.abort_transaction(Duration::from_secs(10)))
        .await
        .expect("the transaction was left open, so it can be aborted");
    for d in doomed {
        // Delivered into the aborted transaction or purged by the abort: either way settled.
        let _ = d.await.expect("a delivery report, not a dropped future");
    }

    // Called right after the sends: every record is committed, each delivery succeeded.
    producer.begin_transaction().expect("begin");
    let sent = send_all(&producer, "committed");
    blocking(&producer, |p| {
        commit_transaction(p, Duration::from_secs(30))
    })
    .await
    .expect("commit");
    for d in sent {
        d.await.expect("report").expect("delivered");
    }

    let cfg = support::source_config(&brokers, &support::unique("g"), &topic).read_committed();
    let mut src = KafkaSource::connect(cfg).await.expect("source");
    let got = collect(&mut src, 301, Duration::from_secs(8)).await;
    let mut payloads: Vec<String> = got
        .iter()
        .map(|d| String::from_utf8_lossy(&d.envelope.payload).to_string())
        .collect();
    payloads.sort();
    let mut want: Vec<String> = (0..300).map(|i| format!("committed-{i}")).collect();
    want.sort();
    assert_eq!(
        payloads, want,
        "exactly the committed transaction's records"
    );
    src.close().await.expect("close");
}

/// A tiny per-partition buffer pauses and resumes the partition; nothing is lost or
/// reordered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn back_pressure_pauses_without_loss_or_reordering() {
    let Some(brokers) = support::brokers() else {
        return;
    };
    let topic = support::unique("pressure");
    support::create_topic(&brokers, &topic, 1).await;
    let p = support::publisher(&brokers).await;
    let msgs = (0..300)
        .map(|i| OutgoingMessage::new(&topic, format!("{i}")))
        .collect();
    for r in p.publish_batch(msgs).await {
        r.expect("publish");
    }
    let mut cfg = support::source_config(&brokers, &support::unique("g"), &topic);
    cfg.buffer_per_partition = 16;
    let mut src = KafkaSource::connect(cfg).await.expect("source");
    let mut seen = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while seen.len() < 300 && tokio::time::Instant::now() < deadline {
        if let Ok(Ok(Some(batch))) = tokio::time::timeout(Duration::from_secs(5), src.poll(3)).await
        {
            for d in batch {
                seen.push(
                    String::from_utf8_lossy(&d.envelope.payload)
                        .parse::<u32>()
                        .unwrap(),
                );
                d.ack().await.unwrap();
            }
            src.after_batch().await.unwrap();
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    assert_eq!(seen, (0..300).collect::<Vec<_>>());
    src.close().await.expect("close");
}
