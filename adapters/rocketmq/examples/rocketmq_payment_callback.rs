//! Seed 000's payment callback on RocketMQ: the gateway's callback is sent three times
//! (producer retries: three msgIds), the first delivery fails and is redelivered after
//! RECONSUME_LATER (yet another msgId). The dedup key — the payment id, in `KEYS` — makes
//! it one payment.
//!
//! `IDEMQ_TEST_ROCKETMQ_NAMESRV=127.0.0.1:29876 cargo run -p idemq-rocketmq --example rocketmq_payment_callback`
#![recursion_limit = "512"]

use idemq_core::{
    ClaimedMessage, HandlerError, IdempotentConsumer, KeyStrategy, MemoryStore, OutgoingMessage,
    Publisher,
};
use idemq_rocketmq::{RocketPublisher, RocketPublisherConfig, RocketSource, RocketSourceConfig};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let ns =
        std::env::var("IDEMQ_TEST_ROCKETMQ_NAMESRV").unwrap_or_else(|_| "127.0.0.1:9876".into());
    let run = rand_suffix();
    let topic = format!("payment_callbacks_{run}");
    let gateway =
        RocketPublisher::connect(RocketPublisherConfig::new(&ns, format!("gateway_{run}"))).await?;
    for attempt in 1..=3 {
        let callback = OutgoingMessage::new(&topic, r#"{"payment_id":"pay-000","cents":9900}"#)
            .with_key("order-000")
            .with_dedup_key("pay-000");
        let receipt = gateway.publish(callback).await?;
        println!("gateway send #{attempt}: msgId {:?}", receipt.message_id);
    }

    let payments = Arc::new(AtomicU32::new(0));
    let attempts = Arc::new(AtomicU32::new(0));
    let (paid, tries) = (payments.clone(), attempts.clone());
    let consumer = IdempotentConsumer::new(
        Arc::new(MemoryStore::new()),
        KeyStrategy::dedup_header("billing")?,
        move |m: ClaimedMessage| {
            let (paid, tries) = (paid.clone(), tries.clone());
            async move {
                if tries.fetch_add(1, Ordering::SeqCst) == 0 {
                    return Err(HandlerError::retryable("ledger timeout: reconsume later"));
                }
                paid.fetch_add(1, Ordering::SeqCst);
                println!(
                    "paid {:?} (UNIQ_KEY {:?})",
                    m.key.as_str(),
                    m.envelope.message_id
                );
                Ok(None)
            }
        },
    );
    let mut source = RocketSource::connect(RocketSourceConfig::new(
        &ns,
        format!("billing_{run}"),
        &topic,
    ))
    .await?;
    consumer
        .run(&mut source, tokio::time::sleep(Duration::from_secs(25)))
        .await?;
    println!("payments applied: {}", payments.load(Ordering::SeqCst));
    Ok(())
}

fn rand_suffix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
