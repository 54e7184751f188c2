//! The smallest complete consumer: the in-memory broker, a SQLite dedup store, and a handler
//! whose effect commits in the same transaction as its dedup record.
//!
//! ```sh
//! cargo run --example embedded_consumer
//! ```

use idemq::broker::MemoryBroker;
use idemq::handler::with_state;
use idemq::sql::sqlx::{self, sqlite::SqlitePoolOptions};
use idemq::sql::{SqlResultExt, SqlStoreOptions, SqliteStore};
use idemq::{BrokerKind, ClaimedMessage, Envelope, IdempotentConsumer, KeyStrategy};
use std::sync::Arc;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .connect("sqlite::memory:")
        .await?;
    sqlx::query("CREATE TABLE shipments (order_id TEXT NOT NULL)")
        .execute(&pool)
        .await?;
    let store = Arc::new(SqliteStore::from_pool(pool.clone(), SqlStoreOptions::default()).await?);

    let broker = MemoryBroker::new();
    for id in ["o-1", "o-2", "o-1", "o-3", "o-2"] {
        broker.publish(
            Envelope::new(
                BrokerKind::MEMORY,
                "orders",
                format!(r#"{{"order_id":"{id}"}}"#),
            )
            .with_header("x-idempotency-key", id),
        );
    }

    // The effect and the dedup record commit in one transaction: `begin_for` opens it on the
    // store's pool, `commit` completes the record with the engine's own key, token and
    // retention (a lease lost meanwhile rolls the effect back and asks for a retry).
    let consumer = IdempotentConsumer::new(
        store.clone(),
        KeyStrategy::header("shipping", "x-idempotency-key")?,
        with_state(store, |store, m: ClaimedMessage| async move {
            let mut tx = store.begin_for(&m).await?;
            sqlx::query("INSERT INTO shipments (order_id) VALUES (?)")
                .bind(m.key.business_key())
                .execute(&mut *tx)
                .await
                .classify()?;
            tx.commit().await
        }),
    );
    consumer.run_until_idle(&mut broker.subscribe()).await?;
    let (n,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM shipments")
        .fetch_one(&pool)
        .await?;
    let stats = consumer.stats();
    // Five messages, three distinct orders: each order ships once, the repeats are skipped.
    println!(
        "shipments={n} processed={} duplicates={}",
        stats.processed, stats.duplicates
    );
    assert_eq!((n, stats.processed), (3, 3));
    Ok(())
}
