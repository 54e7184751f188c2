//! Order events guarded by a state machine: `UPDATE orders SET status = 'PAID' WHERE id = ?
//! AND status IN ('UNPAID')` in the effect's transaction. A duplicate callback finds the
//! order already PAID (nothing to do); a payment for a cancelled order is refused and
//! dead-lettered with the reason, not applied. The row's state is the dedup: no dedup table,
//! nothing that grows with traffic (docs/strategies.md).
//!
//! Needs no server (SQLite in memory):
//!
//! ```sh
//! cargo run --example order_state_machine
//! ```

use idemq::broker::MemoryBroker;
use idemq::sql::sqlx::{self, sqlite::SqlitePoolOptions};
use idemq::sql::{StateMachine, Transition};
use idemq::{BrokerKind, Envelope, Source};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .connect("sqlite::memory:")
        .await?;
    sqlx::query("CREATE TABLE orders (id INTEGER PRIMARY KEY, status TEXT NOT NULL)")
        .execute(&pool)
        .await?;
    sqlx::query("CREATE TABLE payments (order_id INTEGER NOT NULL, amount INTEGER NOT NULL)")
        .execute(&pool)
        .await?;
    sqlx::query("INSERT INTO orders VALUES (1, 'UNPAID'), (2, 'UNPAID'), (3, 'CANCELLED')")
        .execute(&pool)
        .await?;

    let broker = MemoryBroker::new();
    // Order 1 is paid and the provider calls back three times; order 3 was cancelled first.
    for order in [1, 1, 2, 1, 3] {
        broker.publish(Envelope::new(
            BrokerKind::MEMORY,
            "payment-callbacks",
            format!("{order}"),
        ));
    }

    let orders = StateMachine::new("orders", "id", "status")?;
    let mut source = broker.subscribe();
    let (mut applied, mut duplicates) = (0, 0);
    while let Some(batch) = source.poll(16).await? {
        for delivery in batch {
            let order: i64 = std::str::from_utf8(&delivery.envelope.payload)?.parse()?;
            let mut tx = pool.begin().await?;
            match orders
                .transition(&mut *tx, order, &["UNPAID"], "PAID")
                .await?
            {
                Transition::Applied => {
                    sqlx::query("INSERT INTO payments VALUES (?, 100)")
                        .bind(order)
                        .execute(&mut *tx)
                        .await?;
                    tx.commit().await?;
                    applied += 1;
                    delivery.ack().await?;
                }
                Transition::AlreadyInTarget => {
                    duplicates += 1;
                    delivery.ack().await?;
                }
                Transition::Illegal(state) => {
                    let why = format!("order {order} is {state}: a payment for it needs a refund");
                    delivery.reject(&why).await?;
                }
                Transition::NotFound => delivery.reject("unknown order").await?,
            }
        }
    }
    let (payments,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM payments")
        .fetch_one(&pool)
        .await?;
    let refused = broker.dead_letters();
    println!(
        "payments={payments} applied={applied} duplicates={duplicates} refused={}: {}",
        refused.len(),
        refused.first().map_or("", |d| d.reason.as_str())
    );
    assert_eq!((payments, applied, duplicates, refused.len()), (2, 2, 2, 1));
    Ok(())
}
