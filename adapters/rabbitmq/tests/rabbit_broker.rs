//! Scenarios on the real broker beyond the conformance kit: routing failures, the envelope
//! as RabbitMQ fills it, quorum delivery counts, retry round trips, the dedup plugin's
//! absence, and producer duplicates with a consumer dropped mid-run.

mod support;

use idemq_core::envelope::props;
use idemq_core::{
    ConsumerConfig, Delivery, MemoryStore, OutgoingMessage, PublishError, Publisher, RetryPolicy,
    Source,
};
use idemq_rabbitmq::{
    DedupExchange, DedupPlugin, QueueType, RabbitError, DLQ_QUEUE, DLQ_REASON, RETRIES,
};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

async fn next_one(src: &mut dyn Source) -> Delivery {
    let batch = tokio::time::timeout(Duration::from_secs(20), src.poll(1))
        .await
        .expect("a delivery within 20 s")
        .expect("poll")
        .expect("source open");
    batch.into_iter().next().expect("one delivery")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_nobody_can_receive_is_reported_unroutable_not_lost_silently() {
    let Some(url) = support::amqp_url() else {
        return;
    };
    let p = support::publisher(&url).await;
    let to_nowhere =
        OutgoingMessage::new(support::fresh_queue("missing"), "x").with_dedup_key("k1");
    let err = p.publish(to_nowhere).await.expect_err("no such queue");
    assert!(matches!(err, PublishError::Unroutable(_)), "{err:?}");
    let unbound = OutgoingMessage::new("amq.direct/no-binding-here", "x").with_dedup_key("k2");
    let err = p.publish(unbound).await.expect_err("no binding");
    assert!(matches!(err, PublishError::Unroutable(_)), "{err:?}");
    assert!(!err.may_be_stored());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_envelope_carries_amqp_properties_typed_headers_and_the_dedup_key() {
    let Some(url) = support::amqp_url() else {
        return;
    };
    let q = support::fresh_queue("envelope");
    let mut src = support::source(support::config(&url, &q, QueueType::Classic)).await;
    let msg = OutgoingMessage::new(q.clone(), r#"{"order":7}"#)
        .with_dedup_key("order-7-paid")
        .with_header(props::CORRELATION_ID, "corr-1")
        .with_header(props::REPLY_TO, "replies")
        .with_header(props::CONTENT_TYPE, "application/json")
        .with_header("attempt-limit", "5")
        .with_header(props::type_of("attempt-limit"), "i32");
    support::publisher(&url)
        .await
        .publish(msg)
        .await
        .expect("publish");
    let d = next_one(&mut src).await;
    let e = &d.envelope;
    assert_eq!(e.message_id.as_deref(), Some("order-7-paid"));
    assert_eq!(e.key.as_deref(), Some(&b"order-7-paid"[..]));
    assert_eq!(
        e.headers.get_str(idemq_core::DEDUP_HEADER),
        Some("order-7-paid")
    );
    assert_eq!(
        e.headers.get_str(idemq_rabbitmq::PLUGIN_DEDUP_HEADER),
        Some("order-7-paid")
    );
    assert_eq!(e.headers.get_str(props::CORRELATION_ID), Some("corr-1"));
    assert_eq!(e.headers.get_str(props::REPLY_TO), Some("replies"));
    assert_eq!(
        e.headers.get_str(props::CONTENT_TYPE),
        Some("application/json")
    );
    assert_eq!(e.headers.get_str(props::EXCHANGE), Some(""));
    assert_eq!(e.headers.get_str(props::ROUTING_KEY), Some(q.as_str()));
    // Sent as an AMQP long int, received with its type kept.
    assert_eq!(e.headers.get_str("attempt-limit"), Some("5"));
    assert_eq!(
        e.headers.get_str(&props::type_of("attempt-limit")),
        Some("i32")
    );
    assert!(!e.redelivered);
    assert_eq!(e.delivery_count, None);
    assert!(e.timestamp_ms.is_some());
    d.ack().await.expect("ack");
    src.close().await.expect("close");
    support::delete_queues(&url, &[q.clone(), format!("{q}.dlq")]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quorum_queue_counts_deliveries_and_retry_round_trips_count_too() {
    let Some(url) = support::amqp_url() else {
        return;
    };
    let q = support::fresh_queue("quorum-count");
    let mut src = support::source(support::config(&url, &q, QueueType::Quorum)).await;
    let msg = OutgoingMessage::new(q.clone(), "x").with_dedup_key("count-me");
    support::publisher(&url)
        .await
        .publish(msg)
        .await
        .expect("publish");

    let first = next_one(&mut src).await;
    assert!(!first.envelope.redelivered);
    assert_eq!(first.envelope.delivery_count, None);
    first.nack(Duration::ZERO).await.expect("requeue");

    let second = next_one(&mut src).await;
    assert!(second.envelope.redelivered);
    assert_eq!(
        second.envelope.delivery_count,
        Some(2),
        "x-delivery-count 1 + 1"
    );
    second
        .nack(Duration::from_millis(100))
        .await
        .expect("park in a retry queue");

    let third = next_one(&mut src).await;
    assert_eq!(third.envelope.headers.get_str(RETRIES), Some("1"));
    assert!(third.envelope.redelivered);
    assert!(
        third.envelope.delivery_count >= Some(3),
        "{:?}",
        third.envelope.delivery_count
    );
    third.ack().await.expect("ack");
    src.close().await.expect("close");
    support::delete_queues(
        &url,
        &[
            q.clone(),
            format!("{q}.dlq"),
            idemq_rabbitmq::retry_queue_name(&q, 100),
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_dedup_plugin_declaring_a_dedup_exchange_names_the_plugin() {
    let Some(url) = support::amqp_url() else {
        return;
    };
    let found = idemq_rabbitmq::detect_dedup_plugin(&url)
        .await
        .expect("probe");
    let ex = DedupExchange::new(support::fresh_queue("dedup-ex"), 10_000);
    match found {
        DedupPlugin::Available => {
            idemq_rabbitmq::declare_dedup_exchange(&url, &ex)
                .await
                .expect("the plugin is there: the exchange declares");
        }
        DedupPlugin::Unavailable(why) => {
            assert!(why.contains("x-message-deduplication") || !why.is_empty());
            let err = idemq_rabbitmq::declare_dedup_exchange(&url, &ex)
                .await
                .expect_err("no plugin");
            assert!(
                matches!(err, RabbitError::DedupPluginMissing { .. }),
                "{err:?}"
            );
            assert!(
                err.to_string().contains("rabbitmq_message_deduplication"),
                "{err}"
            );
            let err = idemq_rabbitmq::declare_dedup_queue(&url, &support::fresh_queue("dq"))
                .await
                .expect_err("no plugin");
            assert!(
                matches!(err, RabbitError::DedupPluginMissing { .. }),
                "{err:?}"
            );
        }
    }
    // The probe leaves nothing broken: the broker still serves this URL.
    support::publisher(&url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn producer_duplicates_with_a_consumer_dropped_mid_run_change_the_world_once() {
    let Some(url) = support::amqp_url() else {
        return;
    };
    let q = support::fresh_queue("storm");
    // Declared before publishing, so that nothing is unroutable.
    drop(support::source(support::config(&url, &q, QueueType::Classic)).await);
    let keys: Vec<String> = (0..400).map(|i| format!("payment-{i:04}")).collect();
    let mut sends: Vec<OutgoingMessage> = keys
        .iter()
        .map(|k| {
            OutgoingMessage::new(q.clone(), format!("{{\"id\":\"{k}\"}}")).with_dedup_key(k.clone())
        })
        .collect();
    // Every fourth payment is sent again: a producer retry after a lost confirm.
    sends.extend(sends.clone().into_iter().step_by(4));
    let p = support::publisher(&url).await;
    for r in p.publish_batch(sends).await {
        r.expect("publish");
    }

    let store = Arc::new(MemoryStore::new());
    let effects = support::Effects::default();
    let halt = Arc::new(AtomicBool::new(false));
    let consumer = || {
        support::counting_consumer(
            store.clone(),
            "billing",
            effects.clone(),
            Duration::from_millis(2),
            halt.clone(),
        )
        .with_config(ConsumerConfig {
            max_batch: 50,
            max_concurrency: 50,
            lease: Duration::from_secs(5),
            retry: RetryPolicy::fixed(Duration::from_millis(200)),
            ..ConsumerConfig::default()
        })
    };

    // Consumer A, prefetch 100, dropped mid-run: its unacked deliveries go back to the queue.
    let first = consumer();
    let mut src =
        support::source(support::config(&url, &q, QueueType::Classic).prefetch(100)).await;
    let run = tokio::spawn(async move {
        let _ = first.run(&mut src, std::future::pending()).await;
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while support::applied(&effects) < 100 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "consumer A made no progress"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The process goes down: new handlers stop short of their effect, the ones past it
    // complete, then the consumer is dropped with whatever it has unacked.
    halt.store(true, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(300)).await;
    run.abort();
    let _ = run.await;
    let after_a = support::applied(&effects);
    halt.store(false, Ordering::SeqCst);

    // Consumer B takes over and drains the queue.
    let second = consumer();
    let mut src =
        support::source(support::config(&url, &q, QueueType::Classic).prefetch(100)).await;
    let progress = effects.clone();
    let done = async move {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while support::applied(&progress) < 400 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Let the duplicates still queued arrive and be dropped.
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    second.run(&mut src, done).await.expect("run");
    let (doubles, lost) = support::double_and_lost(&effects, &keys);
    eprintln!(
        "consumer A applied {after_a} before it was dropped; double_effects={doubles} lost={lost}"
    );
    assert_eq!(
        (doubles, lost),
        (0, 0),
        "double_effects={doubles} lost={lost}"
    );
    support::delete_queues(&url, &[q.clone(), format!("{q}.dlq")]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_key_less_message_is_dead_lettered_with_the_reason_and_the_consumer_keeps_going() {
    let Some(url) = support::amqp_url() else {
        return;
    };
    let q = support::fresh_queue("keyless");
    drop(support::source(support::config(&url, &q, QueueType::Classic)).await);
    let keys: Vec<String> = (0..12).map(|i| format!("invoice-{i:02}")).collect();
    let p = support::publisher(&url).await;
    for (i, k) in keys.iter().enumerate() {
        if i == 3 {
            // No dedup key, no message id, no key: nothing a key strategy can read.
            let keyless = OutgoingMessage::new(q.clone(), r#"{"invoice":"?"}"#);
            p.publish(keyless)
                .await
                .expect("publish the key-less message");
        }
        let m = OutgoingMessage::new(q.clone(), format!("{{\"invoice\":\"{k}\"}}"))
            .with_dedup_key(k.clone());
        p.publish(m).await.expect("publish");
    }

    let effects = support::Effects::default();
    let consumer = support::counting_consumer(
        Arc::new(MemoryStore::new()),
        "billing",
        effects.clone(),
        Duration::from_millis(1),
        Default::default(),
    )
    // Small batches: the key-less message sits in the middle of one, and more follow.
    .with_config(ConsumerConfig {
        max_batch: 4,
        ..ConsumerConfig::default()
    });
    let mut src = support::source(support::config(&url, &q, QueueType::Classic)).await;
    let progress = effects.clone();
    let stop = async move {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while support::applied(&progress) < 12 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    consumer.run(&mut src, stop).await.expect("run");
    src.close().await.expect("close");

    // Everything behind the key-less message was processed, once.
    let (doubles, lost) = support::double_and_lost(&effects, &keys);
    assert_eq!(
        (doubles, lost),
        (0, 0),
        "double_effects={doubles} lost={lost}"
    );
    assert_eq!(consumer.stats().rejected, 1, "{:?}", consumer.stats());

    // The key-less message is in the dead-letter queue with the reason, and nowhere else.
    let dead = support::take_all(&url, &format!("{q}.dlq")).await;
    assert_eq!(dead.len(), 1, "one dead letter: {dead:?}");
    let d = &dead[0];
    assert_eq!(&d.payload[..], br#"{"invoice":"?"}"#);
    let reason = d.headers.get_str(DLQ_REASON).unwrap_or_default();
    assert!(
        reason.contains("no usable dedup key") && reason.contains(idemq_core::DEDUP_HEADER),
        "the reason must say why: {reason:?}"
    );
    assert_eq!(d.headers.get_str(DLQ_QUEUE), Some(q.as_str()));
    assert!(
        support::take_all(&url, &q).await.is_empty(),
        "nothing left in the queue (the key-less message was acked after its copy)"
    );
    support::delete_queues(&url, &[q.clone(), format!("{q}.dlq")]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_queue_nobody_declares_any_more_expires() {
    let Some(url) = support::amqp_url() else {
        return;
    };
    let q = support::fresh_queue("retry-expiry");
    let mut cfg = support::config(&url, &q, QueueType::Classic);
    cfg.retry_queue_idle_expiry = Some(Duration::from_millis(1500));
    let mut src = support::source(cfg).await;
    let msg = OutgoingMessage::new(q.clone(), "x").with_dedup_key("expire-me");
    support::publisher(&url)
        .await
        .publish(msg)
        .await
        .expect("publish");
    next_one(&mut src)
        .await
        .nack(Duration::from_millis(100))
        .await
        .expect("park in the 100 ms tier");
    // The parked message comes back (the queue outlived it) ...
    let back = next_one(&mut src).await;
    assert_eq!(back.envelope.headers.get_str(RETRIES), Some("1"));
    back.ack().await.expect("ack");
    src.close().await.expect("close");
    // ... and the retry queue, unused from now on, goes away (x-expires = 100 ms + 1.5 s).
    let tier = idemq_rabbitmq::retry_queue_name(&q, 100);
    let conn = support::connection(&url).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let gone = loop {
        // A passive declare counts as a use (it restarts the expiry timer): look less often
        // than the queue's expiry. A passive declare of a missing queue closes the channel:
        // one channel per try.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let ch = conn.create_channel().await.expect("channel");
        let opts = idemq_rabbitmq::lapin::options::QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let exists = ch
            .queue_declare(&tier, opts, Default::default())
            .await
            .is_ok();
        if !exists || tokio::time::Instant::now() > deadline {
            break !exists;
        }
        let _ = ch.close(200, "next try").await;
    };
    let _ = conn.close(200, "done").await;
    assert!(gone, "{tier} still exists 30 s after its last use");
    support::delete_queues(&url, &[q.clone(), format!("{q}.dlq")]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_publisher_closes_its_connection_and_connects_again_on_the_next_publish() {
    let Some(url) = support::amqp_url() else {
        return;
    };
    let q = support::fresh_queue("closed-publisher");
    let mut src = support::source(support::config(&url, &q, QueueType::Classic)).await;
    let p = support::publisher(&url).await;
    p.publish(OutgoingMessage::new(q.clone(), "1").with_dedup_key("before-close"))
        .await
        .expect("publish");
    p.close().await.expect("close");
    p.close().await.expect("closing twice is harmless");
    p.publish(OutgoingMessage::new(q.clone(), "2").with_dedup_key("after-close"))
        .await
        .expect("a publish after close connects again");
    let mut keys = Vec::new();
    for _ in 0..2 {
        let d = next_one(&mut src).await;
        keys.push(
            d.envelope
                .headers
                .get_str(idemq_core::DEDUP_HEADER)
                .unwrap_or_default()
                .to_owned(),
        );
        d.ack().await.expect("ack");
    }
    assert_eq!(keys, ["before-close", "after-close"]);
    p.close().await.expect("close");
}
