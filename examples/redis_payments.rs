//! Payment callbacks with a Redis dedup store: the in-memory broker publishes every payment
//! twice or more and loses acks; each payment is applied (pushed to a Redis list) once. The
//! push and the dedup record's completion run in one script (`complete_with`), so a crash
//! between them cannot leave one without the other.
//!
//! ```sh
//! REDIS_URL=redis://127.0.0.1:22379/ cargo run --example redis_payments --features redis
//! ```

use idemq::broker::{Faults, MemoryBroker};
use idemq::handler::json;
use idemq::redis::redis::{cmd, AsyncCommands};
use idemq::redis::RedisStore;
use idemq::{BrokerKind, Envelope, IdempotentConsumer, KeyStrategy};
use std::sync::Arc;

/// A payment callback's body.
#[derive(serde::Deserialize)]
struct Payment {
    payment_id: String,
}

/// What a run did, for the caller to check.
#[derive(Debug)]
pub struct Report {
    /// Payments published (each at least once).
    pub payments: usize,
    /// Entries in this run's applied list.
    pub applied: usize,
    /// Distinct payment ids among them.
    pub distinct: usize,
    /// Deliveries the engine skipped as duplicates.
    pub duplicates: u64,
}

/// Publishes `payments` callbacks (with duplicates and lost acks) and consumes them.
pub async fn run(url: &str, payments: usize) -> Result<Report, Box<dyn std::error::Error>> {
    let run_id = format!("{:016x}", rand::random::<u64>());
    let applied = format!("example:applied:{run_id}");
    let broker = MemoryBroker::with_seed(7);
    broker.set_faults(Faults {
        lost_ack_rate: 0.2,
        duplicate_publish_rate: 0.3,
    });
    for i in 0..payments {
        let body = format!(r#"{{"payment_id":"pay-{i}","amount":{}}}"#, 100 + i);
        broker.publish(Envelope::new(
            BrokerKind::MEMORY,
            "payment-callbacks",
            body.clone(),
        ));
        broker.publish(Envelope::new(BrokerKind::MEMORY, "payment-callbacks", body));
    }

    // --- idemq: the store, the key, a typed handler, the consumer (8 lines) ---
    let store = RedisStore::connect(url, Default::default()).await?;
    let keys = KeyStrategy::json_pointer(&format!("payments-{run_id}"), "/payment_id")?;
    let handler = json(
        (store.clone(), applied.clone()),
        |(db, list), msg, p: Payment| async move {
            // The effect and the completion run in one server-side script: both or neither.
            let push = cmd("RPUSH").arg(&list).arg(p.payment_id).to_owned();
            db.complete_with(&msg, &[push], None).await
        },
    );
    let consumer = IdempotentConsumer::new(Arc::new(store), keys, handler);
    consumer.run_until_idle(&mut broker.subscribe()).await?;

    let mut conn = idemq::redis::redis::Client::open(url)?
        .get_multiplexed_async_connection()
        .await?;
    let ids: Vec<String> = conn.lrange(&applied, 0, -1).await?;
    let _: i64 = conn.del(&applied).await?;
    let distinct = ids.iter().collect::<std::collections::HashSet<_>>().len();
    Ok(Report {
        payments,
        applied: ids.len(),
        distinct,
        duplicates: consumer.stats().duplicates,
    })
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("REDIS_URL")
        .or_else(|_| std::env::var("IDEMQ_TEST_REDIS_URL"))
        .map_err(|_| "set REDIS_URL=redis://host:port/")?;
    let r = run(&url, 300).await?;
    println!("{r:?}");
    assert_eq!(
        (r.applied, r.distinct),
        (300, 300),
        "every payment applied once"
    );
    Ok(())
}
