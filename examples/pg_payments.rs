//! Payment callbacks on PostgreSQL, the effect and the dedup record in one transaction: the
//! in-memory broker publishes every payment twice or more (producer retries) and loses acks
//! (redeliveries); each payment is applied once.
//!
//! ```sh
//! DATABASE_URL=postgres://postgres@127.0.0.1:25432/idemq \
//!     cargo run --example pg_payments --features postgres
//! ```
//!
//! The idemq-specific code is the store, the key, a typed handler (`json`: the payload
//! arrives parsed; one that does not parse is dead-lettered naming the type), the consumer,
//! and three lines in the handler: `begin_for(&msg)` opens the transaction on the store's pool, `.classify()?`
//! retries a deadlock but dead-letters a constraint violation, and `tx.commit()` completes
//! the message with the engine's own key, token and retention before committing (a lost
//! lease rolls back and retries).

use idemq::broker::{Faults, MemoryBroker};
use idemq::handler::json;
use idemq::sql::{sqlx, PgStore, SqlResultExt};
use idemq::{BrokerKind, Envelope, IdempotentConsumer, KeyStrategy};
use std::sync::Arc;

/// A payment callback's body.
#[derive(serde::Deserialize)]
struct Payment {
    payment_id: String,
    amount: i64,
}

/// What a run did, for the caller to check.
#[derive(Debug)]
pub struct Report {
    /// Payments published (each at least once).
    pub payments: usize,
    /// Rows in the payments table for this run.
    pub rows: i64,
    /// Distinct payment ids among them.
    pub distinct: i64,
    /// Deliveries the engine skipped as duplicates.
    pub duplicates: u64,
}

/// Publishes `payments` callbacks (with duplicates and lost acks) and consumes them.
pub async fn run(url: &str, payments: usize) -> Result<Report, Box<dyn std::error::Error>> {
    let run_id = format!("{:016x}", rand::random::<u64>());
    let store = PgStore::connect(url, Default::default()).await?;
    sqlx::query("CREATE TABLE IF NOT EXISTS example_payments (run TEXT NOT NULL, payment_id TEXT NOT NULL, amount BIGINT NOT NULL)")
        .execute(store.pool())
        .await?;

    let broker = MemoryBroker::with_seed(42);
    broker.set_faults(Faults {
        lost_ack_rate: 0.2,
        duplicate_publish_rate: 0.3,
    });
    for i in 0..payments {
        let body = format!(r#"{{"payment_id":"pay-{i}","amount":{}}}"#, 100 + i);
        broker.publish(Envelope::new(
            BrokerKind::Memory,
            "payment-callbacks",
            body.clone(),
        ));
        broker.publish(Envelope::new(BrokerKind::Memory, "payment-callbacks", body));
    }

    // --- idemq: the key, a typed handler writing the effect and completing the message in
    // one transaction, the consumer (13 lines; the store was opened above) ---
    let keys = KeyStrategy::json_pointer(&format!("payments-{run_id}"), "/payment_id")?;
    let state = (store.clone(), run_id.clone());
    let handler = json(state, |(db, run), msg, p: Payment| async move {
        let mut tx = db.begin_for(&msg).await?;
        sqlx::query("INSERT INTO example_payments (run, payment_id, amount) VALUES ($1, $2, $3)")
            .bind(run)
            .bind(p.payment_id)
            .bind(p.amount)
            .execute(&mut *tx)
            .await
            .classify()?;
        tx.commit().await
    });
    let consumer = IdempotentConsumer::new(Arc::new(store), keys, handler);
    consumer.run_until_idle(&mut broker.subscribe()).await?;

    let pool = sqlx::PgPool::connect(url).await?;
    let (rows, distinct): (i64, i64) = sqlx::query_as(
        "SELECT COUNT(*), COUNT(DISTINCT payment_id) FROM example_payments WHERE run = $1",
    )
    .bind(&run_id)
    .fetch_one(&pool)
    .await?;
    Ok(Report {
        payments,
        rows,
        distinct,
        duplicates: consumer.stats().duplicates,
    })
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL")
        .or_else(|_| std::env::var("IDEMQ_TEST_POSTGRES_URL"))
        .map_err(|_| "set DATABASE_URL=postgres://user@host:port/db")?;
    let r = run(&url, 300).await?;
    println!("{r:?}");
    assert_eq!(
        (r.rows, r.distinct),
        (300, 300),
        "every payment applied once"
    );
    Ok(())
}
