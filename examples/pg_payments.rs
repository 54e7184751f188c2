//! Payment callbacks on PostgreSQL, a batch of effect rows and their keys in one
//! transaction: the in-memory broker publishes every payment twice or more (producer
//! retries) and loses acks (redeliveries); each payment is applied once.
//!
//! ```sh
//! DATABASE_URL=postgres://postgres@127.0.0.1:25432/idemq \
//!     cargo run --example pg_payments --features postgres
//! ```
//!
//! The idemq-specific code is the store, the key, a batch handler and the consumer. The
//! engine hands the handler every claimed message of a polled batch; `store.batch_handler`
//! opens one transaction, inserts the batch's keys into the store's keys table (the unique
//! index: keys already there are acked as duplicates and never reach the closure), runs the
//! closure (one multi-row insert), and commits; the messages are acked after the commit.
//! `m.json()?` parses a payload (one that does not parse fails the batch, which the engine
//! then runs message by message, dead-lettering only that one, naming the type), and
//! `.classify()?` retries a deadlock but dead-letters a constraint violation.

use idemq::broker::{Faults, MemoryBroker};
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
            BrokerKind::MEMORY,
            "payment-callbacks",
            body.clone(),
        ));
        broker.publish(Envelope::new(BrokerKind::MEMORY, "payment-callbacks", body));
    }

    // --- idemq (12 lines around the effect's own 5): the key, a batch handler writing a
    // polled batch's payments with one statement in the transaction that also records their
    // keys, and the consumer ---
    let keys = KeyStrategy::json_pointer(&format!("payments-{run_id}"), "/payment_id")?;
    let run = run_id.clone();
    let handler = store.batch_handler(move |tx, msgs| {
        let run = run.clone();
        Box::pin(async move {
            let paid: Vec<Payment> = msgs.iter().map(|m| m.json()).collect::<Result<_, _>>()?;
            let (ids, amounts): (Vec<String>, Vec<i64>) =
                paid.into_iter().map(|p| (p.payment_id, p.amount)).unzip();
            sqlx::query("INSERT INTO example_payments (run, payment_id, amount) SELECT $1, * FROM UNNEST($2::text[], $3::bigint[])")
                .bind(run).bind(ids).bind(amounts)
                .execute(&mut *tx).await.classify()?;
            Ok(())
        })
    });
    let consumer = IdempotentConsumer::new(Arc::new(store.unique_index()), keys, handler);
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
