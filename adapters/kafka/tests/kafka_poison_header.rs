//! A record whose header *name* is not UTF-8 (a Go or C producer can send one; the broker
//! does not check) on the real broker: the consumer-group source hands it out with the name
//! escaped and goes on with the records behind it, and the group's committed offset moves
//! past it; the transactional processor (Flow 2) transforms it like any other record.
//! Before, reading such a header panicked on the polling thread and `poll` waited forever.

mod support;

use idemq_core::source::Source;
use idemq_kafka::rdkafka::config::ClientConfig;
use idemq_kafka::rdkafka::message::{Header, Headers as _, OwnedHeaders};
use idemq_kafka::rdkafka::producer::{FutureProducer, FutureRecord};
use idemq_kafka::{KafkaProducerConfig, KafkaSource, TransactionalProcessor};
use std::time::Duration;
use tokio::time::Instant;

/// The header name no `&str` can hold: "caf" then Latin-1 `é`.
const LATIN1_NAME: &[u8] = b"caf\xe9";
/// How the source spells it: the byte that is not UTF-8 escaped.
const ESCAPED_NAME: &str = "caf\\xe9";

/// Headers with a name that is not UTF-8, written through librdkafka's own C call:
/// rdkafka's `OwnedHeaders::insert` takes the name as a `&str`, so it cannot make one.
fn poison_headers() -> OwnedHeaders {
    let headers = OwnedHeaders::new().insert(Header {
        key: "ok",
        value: Some("1"),
    });
    let value = b"latin-1";
    let native = headers.as_borrowed() as *const _
        as *mut idemq_kafka::rdkafka::bindings::rd_kafka_headers_t;
    // SAFETY: `native` is the live header list `headers` owns (`as_borrowed` is a view of the
    // same pointer); librdkafka copies name and value, whose lengths are passed.
    let err = unsafe {
        idemq_kafka::rdkafka::bindings::rd_kafka_header_add(
            native,
            LATIN1_NAME.as_ptr().cast(),
            LATIN1_NAME.len() as isize,
            value.as_ptr().cast(),
            value.len() as isize,
        )
    };
    assert_eq!(
        err,
        idemq_kafka::rdkafka::bindings::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR,
        "adding the raw header"
    );
    assert_eq!(headers.count(), 2);
    headers
}

/// Produces `before`, the poison record, then `after-0` .. `after-4` to partition 0.
async fn produce_around_poison(brokers: &str, topic: &str) -> Vec<String> {
    let p: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .create()
        .expect("producer");
    let mut payloads = vec!["before".to_string(), "poison".to_string()];
    payloads.extend((0..5).map(|i| format!("after-{i}")));
    for body in &payloads {
        let mut rec: FutureRecord<'_, str, str> = FutureRecord::to(topic)
            .partition(0)
            .key(body.as_str())
            .payload(body.as_str());
        if body == "poison" {
            rec = rec.headers(poison_headers());
        }
        p.send(rec, Duration::from_secs(30))
            .await
            .map_err(|(e, _)| e)
            .expect("produce");
    }
    payloads
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_with_a_non_utf8_header_name_is_delivered_and_the_ones_after_it_flow() {
    let Some(brokers) = support::brokers() else {
        return;
    };
    let topic = support::unique("poison-hdr");
    support::create_topic(&brokers, &topic, 1).await;
    let payloads = produce_around_poison(&brokers, &topic).await;

    let group = support::unique("poison-hdr-g");
    let mut source = KafkaSource::connect(support::source_config(&brokers, &group, &topic))
        .await
        .expect("source");
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut seen = Vec::new();
    while seen.len() < payloads.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        let polled = tokio::time::timeout(left, source.poll(100)).await;
        let batch = match polled {
            Err(_) => panic!(
                "poll returned nothing within 60 s after {} of {} records ({:?}): the \
                 polling thread is stuck or dead",
                seen.len(),
                payloads.len(),
                seen.iter()
                    .map(
                        |e: &idemq_core::Envelope| String::from_utf8_lossy(&e.payload).into_owned()
                    )
                    .collect::<Vec<_>>()
            ),
            Ok(Err(e)) => panic!("poll failed: {e}"),
            Ok(Ok(None)) => panic!("the source ended"),
            Ok(Ok(Some(batch))) => batch,
        };
        for d in batch {
            seen.push(d.envelope.clone());
            d.ack().await.expect("ack");
        }
        source.after_batch().await.expect("after batch");
    }
    let got: Vec<String> = seen
        .iter()
        .map(|e| String::from_utf8_lossy(&e.payload).into_owned())
        .collect();
    assert_eq!(got, payloads, "every record, in offset order");
    let poison = &seen[1];
    assert_eq!(
        poison.headers.get(ESCAPED_NAME).map(|v| &v[..]),
        Some(&b"latin-1"[..]),
        "the header is carried under its escaped name: {:?}",
        poison.headers
    );
    assert_eq!(poison.headers.get_str("ok"), Some("1"));
    source.close().await.expect("close");

    // The group's committed offset is past the poison record: a restart does not meet it.
    let committed = tokio::task::spawn_blocking({
        let (brokers, group, topic) = (brokers.clone(), group.clone(), topic.clone());
        move || support::committed_offsets(&brokers, &group, &topic, 1)
    })
    .await
    .expect("offsets");
    assert_eq!(committed, vec![payloads.len() as i64]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flow_2_transforms_a_record_with_a_non_utf8_header_name() {
    let Some(brokers) = support::brokers() else {
        return;
    };
    let input = support::unique("poison-txn-in");
    let output = support::unique("poison-txn-out");
    support::create_topic(&brokers, &input, 1).await;
    support::create_topic(&brokers, &output, 1).await;
    let payloads = produce_around_poison(&brokers, &input).await;

    let cfg = KafkaProducerConfig::transactional(&brokers, &support::unique("poison-txn"));
    let mut proc = TransactionalProcessor::new(&cfg, &format!("{input}-g"), &[input.as_str()])
        .await
        .expect("processor");
    let mut done = 0;
    let mut escaped_seen = false;
    let deadline = Instant::now() + Duration::from_secs(60);
    while done < payloads.len() && Instant::now() < deadline {
        let out = output.clone();
        let n = proc
            .process_batch(10, Duration::from_secs(2), |env| {
                escaped_seen |= env.headers.get(ESCAPED_NAME).is_some();
                Ok(vec![idemq_core::publish::OutgoingMessage::new(
                    out.clone(),
                    env.payload.clone(),
                )])
            })
            .await
            .expect("a batch holding the poison record commits");
        done += n;
    }
    assert_eq!(done, payloads.len(), "every input committed within 60 s");
    assert!(escaped_seen, "the transform saw the escaped header name");
    let outputs = support::read_all(&brokers, &output, Duration::from_secs(2)).await;
    let got: Vec<String> = outputs
        .iter()
        .map(|e| String::from_utf8_lossy(&e.payload).into_owned())
        .collect();
    assert_eq!(got, payloads);
}
