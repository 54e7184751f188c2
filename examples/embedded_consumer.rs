//! The smallest complete consumer: the in-memory broker, a SQLite dedup store, and a handler
//! whose effect commits in the same transaction as its dedup record.
//!
//! ```sh
//! cargo run --example embedded_consumer
//! ```

use idemq::broker::MemoryBroker;
use idemq::sql::sqlx::{self, sqlite::SqlitePoolOptions};
use idemq::sql::{SqlStoreOptions, SqliteStore};
use idemq::{
    BrokerKind, ClaimedMessage, CompleteOutcome, Envelope, HandlerError, IdempotentConsumer,
    KeyStrategy,
};
use std::sync::Arc;
use std::time::Duration;

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
                BrokerKind::Memory,
                "orders",
                format!(r#"{{"order_id":"{id}"}}"#),
            )
            .with_header("x-idempotency-key", id),
        );
    }

    let effect_store = store.clone();
    let consumer = IdempotentConsumer::new(
        store.clone(),
        KeyStrategy::header("shipping", "x-idempotency-key")?,
        move |m: ClaimedMessage| {
            let store = effect_store.clone();
            async move {
                let order = m
                    .envelope
                    .headers
                    .get_str("x-idempotency-key")
                    .unwrap_or("?")
                    .to_string();
                let mut tx = store
                    .pool()
                    .begin()
                    .await
                    .map_err(HandlerError::retryable)?;
                sqlx::query("INSERT INTO shipments (order_id) VALUES (?)")
                    .bind(&order)
                    .execute(&mut *tx)
                    .await
                    .map_err(HandlerError::retryable)?;
                match store
                    .complete_in_tx(&mut tx, &m.key, m.token, None, Duration::from_secs(86_400))
                    .await
                    .map_err(HandlerError::retryable)?
                {
                    CompleteOutcome::Completed => {
                        tx.commit().await.map_err(HandlerError::retryable)?;
                        Ok(None)
                    }
                    CompleteOutcome::Fenced => Err(HandlerError::retryable("lease lost")),
                }
            }
        },
    );
    consumer.run_until_idle(&mut broker.subscribe()).await?;
    let (n,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM shipments")
        .fetch_one(&pool)
        .await?;
    println!("shipments: {n}, stats: {:?}", consumer.stats());
    assert_eq!(n, 3);
    Ok(())
}
