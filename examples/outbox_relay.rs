//! The transactional outbox of idemq-sql, end to end, with no server: an order service
//! marks orders paid and enqueues an `order-paid` message **in the same SQLite
//! transaction** (`Outbox::enqueue`), so the effect and the message commit together or not
//! at all (one transaction is rolled back: neither its order nor its message exists). An
//! `OutboxRelay` publishes the committed rows to the in-memory broker
//! (`idemq::broker::MemoryBroker`, standing in for Kafka, RabbitMQ or RocketMQ). The first
//! relay dies after the broker took a batch and before it marked the rows sent; once its
//! lease ends, a second relay publishes those rows **again, with the same dedup keys**, and
//! the billing service's idempotent consumer (`KeyStrategy::dedup_header`, SQLite dedup
//! store, invoice and dedup record in one transaction) drops the copies: one invoice per
//! order.
//!
//! Servers: none (two in-memory SQLite databases: the order service's and billing's).
//!
//! ```sh
//! cargo run --example outbox_relay --features sqlite
//! ```
//!
//! (The other examples need the test servers: `scripts/servers.sh start`, then
//! `eval "$(scripts/servers.sh env)"`; this one does not.)
//!
//! It ends with one line such as
//! `outbox: orders=20 rolled_back=1 sent=20 published=25 relay_resends=5 invoices=20 distinct=20 duplicates_skipped=5`
//! and fails (non-zero exit) unless each order is invoiced exactly once.

use idemq::broker::MemoryBroker;
use idemq::handler::with_state;
use idemq::sql::sqlx::{self, sqlite::SqlitePoolOptions};
use idemq::sql::{
    Outbox, OutboxOptions, OutboxRelay, RelayOptions, SqlResultExt, SqlStoreOptions, SqliteStore,
    TableName,
};
use idemq::{
    ClaimedMessage, IdempotentConsumer, KeyStrategy, OutgoingMessage, PublishError, PublishReceipt,
    Publisher,
};
use std::sync::Arc;
use std::time::Duration;

/// Orders the service marks paid (each gets one outgoing message).
const ORDERS: usize = 20;

/// A relay's publisher that hands every message of a round to the broker, then never
/// returns: the relay process dies between the broker's confirm and marking the rows sent.
struct DiesBeforeMarking(MemoryBroker);

#[idemq::async_trait]
impl Publisher for DiesBeforeMarking {
    async fn publish(&self, msg: OutgoingMessage) -> Result<PublishReceipt, PublishError> {
        Publisher::publish(&self.0, msg).await?;
        std::future::pending().await
    }

    async fn publish_batch(
        &self,
        msgs: Vec<OutgoingMessage>,
    ) -> Vec<Result<PublishReceipt, PublishError>> {
        for m in msgs {
            // The in-memory broker stores every message at once (its confirm cannot fail).
            let _ = Publisher::publish(&self.0, m).await;
        }
        std::future::pending().await
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let run = format!("{:08x}", rand::random::<u32>());
    let orders_table = format!("orders_{run}");
    let invoices_table = format!("invoices_{run}");
    let topic = format!("order-paid-{run}");

    // --- The order service: its database holds the orders and the outbox. ---
    let orders_db = SqlitePoolOptions::new()
        .max_connections(1)
        .connect("sqlite::memory:")
        .await?;
    sqlx::query(&format!(
        "CREATE TABLE {orders_table} (order_id TEXT PRIMARY KEY, status TEXT NOT NULL)"
    ))
    .execute(&orders_db)
    .await?;
    let outbox = Outbox::from_pool(
        orders_db.clone(),
        OutboxOptions::with_table(TableName::new(&format!("outbox_{run}"))?),
    )
    .await?;

    // The effect (the order is paid) and its outgoing message: one transaction each.
    for i in 0..ORDERS {
        let order_id = format!("o-{i:03}");
        let mut tx = orders_db.begin().await?;
        sqlx::query(&format!(
            "INSERT INTO {orders_table} (order_id, status) VALUES (?, 'PAID')"
        ))
        .bind(&order_id)
        .execute(&mut *tx)
        .await?;
        outbox
            .enqueue(
                &mut tx,
                OutgoingMessage::new(&topic, format!(r#"{{"order_id":"{order_id}"}}"#))
                    .with_key(order_id.clone())
                    .with_dedup_key(format!("order-paid-{order_id}")),
            )
            .await?;
        tx.commit().await?;
    }
    // A transaction that rolls back (the payment was declined after all): neither the
    // order row nor its message survives.
    {
        let mut tx = orders_db.begin().await?;
        sqlx::query(&format!(
            "INSERT INTO {orders_table} (order_id, status) VALUES ('o-declined', 'PAID')"
        ))
        .execute(&mut *tx)
        .await?;
        outbox
            .enqueue(
                &mut tx,
                OutgoingMessage::new(&topic, r#"{"order_id":"o-declined"}"#)
                    .with_key("o-declined")
                    .with_dedup_key("order-paid-o-declined"),
            )
            .await?;
        tx.rollback().await?;
    }

    // --- Relay 1 claims a batch, the broker stores it, and the relay dies before marking
    // the rows sent. ---
    let broker = MemoryBroker::new();
    let lease = Duration::from_millis(500);
    let dying = OutboxRelay::new(
        outbox.clone(),
        DiesBeforeMarking(broker.clone()),
        RelayOptions {
            batch: 5,
            lease,
            ..RelayOptions::default()
        },
    );
    let relay_task = tokio::spawn(async move { dying.relay_once().await });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while broker.published() < 5 {
        if tokio::time::Instant::now() > deadline {
            return Err("the first relay published nothing within 10 s".into());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    relay_task.abort(); // the relay process is gone: published, never marked
    let _ = relay_task.await;
    let resends = broker.published();
    let left = outbox.counts().await?;
    assert_eq!(
        (left.pending, left.sent),
        (ORDERS as u64, 0),
        "every row is still pending"
    );

    // --- Relay 2, after relay 1's lease ended: publishes every row, the 5 again with the
    // same dedup keys. ---
    tokio::time::sleep(lease + Duration::from_millis(100)).await;
    let report = outbox.relay(broker.clone()).drain().await?;
    let counts = outbox.counts().await?;
    assert_eq!(
        (report.sent, counts.sent, counts.pending),
        (ORDERS as u64, ORDERS as u64, 0),
        "relay 2 sends every row: {report:?}"
    );

    // --- The billing service: an idempotent consumer keyed by the carried dedup key; the
    // invoice and the dedup record commit in one transaction. ---
    let billing = SqliteStore::connect("sqlite::memory:", SqlStoreOptions::default()).await?;
    sqlx::query(&format!(
        "CREATE TABLE {invoices_table} (order_id TEXT NOT NULL)" // no unique constraint: a double would show
    ))
    .execute(billing.pool())
    .await?;
    let insert: Arc<str> = format!("INSERT INTO {invoices_table} (order_id) VALUES (?)").into();
    let consumer = IdempotentConsumer::new(
        Arc::new(billing.clone()),
        KeyStrategy::dedup_header(&format!("billing-{run}"))?,
        with_state(
            (billing.clone(), insert),
            |(db, insert), msg: ClaimedMessage| async move {
                let mut tx = db.begin_for(&msg).await?;
                sqlx::query(&insert)
                    .bind(msg.key.business_key())
                    .execute(&mut *tx)
                    .await
                    .classify()?;
                tx.commit().await
            },
        ),
    );
    consumer.run_until_idle(&mut broker.subscribe()).await?;

    let (orders,): (i64,) = sqlx::query_as(&format!("SELECT COUNT(*) FROM {orders_table}"))
        .fetch_one(&orders_db)
        .await?;
    let (invoices, distinct): (i64, i64) = sqlx::query_as(&format!(
        "SELECT COUNT(*), COUNT(DISTINCT order_id) FROM {invoices_table}"
    ))
    .fetch_one(billing.pool())
    .await?;
    let stats = consumer.stats();
    let published = broker.published();
    assert_eq!(orders, ORDERS as i64, "the rolled-back order is not there");
    assert_eq!(
        (invoices, distinct),
        (ORDERS as i64, ORDERS as i64),
        "each paid order is invoiced exactly once"
    );
    assert_eq!(
        stats.duplicates, resends,
        "every relay resend was dropped by the consumer"
    );
    println!(
        "outbox: orders={orders} rolled_back=1 sent={} published={published} relay_resends={resends} invoices={invoices} distinct={distinct} duplicates_skipped={}",
        counts.sent, stats.duplicates
    );
    Ok(())
}
