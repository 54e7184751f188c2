//! Stock reservations with a dedup log and a guard: the engine claims each reservation's
//! business key in the dedup table, and the handler's transaction runs
//! `UPDATE stock SET qty = qty - ? WHERE sku = ? AND qty >= ?` (never below zero) together
//! with the dedup record's completion. A duplicate reservation is skipped by the log; one
//! the stock cannot cover is dead-lettered with the reason, and nothing is half-applied.
//!
//! Needs no server (a SQLite file in the temp dir):
//!
//! ```sh
//! cargo run --example inventory_dedup_log
//! ```

use idemq::broker::{Faults, MemoryBroker};
use idemq::handler::json;
use idemq::sql::sqlx;
use idemq::sql::{SqlResultExt, SqlStoreOptions, SqliteStore};
use idemq::{BrokerKind, Envelope, HandlerError, IdempotentConsumer, KeyStrategy};
use std::sync::Arc;

#[derive(serde::Deserialize)]
struct Reservation {
    reservation_id: String,
    sku: String,
    qty: i64,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("idemq-inventory-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let url = format!("sqlite://{}?mode=rwc", dir.join("shop.db").display());
    let store = SqliteStore::connect(&url, SqlStoreOptions::default()).await?;
    sqlx::query("CREATE TABLE stock (sku TEXT PRIMARY KEY, qty INTEGER NOT NULL CHECK (qty >= 0))")
        .execute(store.pool())
        .await?;
    sqlx::query("INSERT INTO stock VALUES ('lamp', 5)")
        .execute(store.pool())
        .await?;

    let broker = MemoryBroker::with_seed(3);
    // Every reservation may be published twice and its ack lost.
    broker.set_faults(Faults {
        duplicate_publish_rate: 0.5,
        lost_ack_rate: 0.3,
    });
    for (id, qty) in [("r-1", 2), ("r-2", 2), ("r-3", 2)] {
        broker.publish(Envelope::new(
            BrokerKind::MEMORY,
            "reservations",
            format!(r#"{{"reservation_id":"{id}","sku":"lamp","qty":{qty}}}"#),
        ));
    }

    let consumer = IdempotentConsumer::new(
        Arc::new(store.clone()),
        KeyStrategy::json_pointer("inventory", "/reservation_id")?,
        json(store.clone(), |store, msg, r: Reservation| async move {
            let mut tx = store.begin_for(&msg).await?;
            let taken = sqlx::query("UPDATE stock SET qty = qty - ? WHERE sku = ? AND qty >= ?")
                .bind(r.qty)
                .bind(&r.sku)
                .bind(r.qty)
                .execute(&mut *tx)
                .await
                .classify()?
                .rows_affected();
            if taken == 0 {
                // Rolled back with `tx`: the dead letter holds the whole reservation.
                return Err(HandlerError::permanent(format!(
                    "reservation {} for {} x {}: not enough stock",
                    r.reservation_id, r.qty, r.sku
                )));
            }
            tx.commit().await
        }),
    );
    consumer.run_until_idle(&mut broker.subscribe()).await?;

    let (left,): (i64,) = sqlx::query_as("SELECT qty FROM stock WHERE sku = 'lamp'")
        .fetch_one(store.pool())
        .await?;
    // A refused reservation's resend is refused again (dead-lettering gives the key back, so
    // a replay after a restock could still succeed): count reservations, not dead letters.
    let mut refused: Vec<String> = broker
        .dead_letters()
        .into_iter()
        .map(|d| d.reason)
        .collect();
    refused.dedup();
    println!(
        "lamps left={left} reserved={} refused={} ({}), duplicates skipped={}",
        consumer.stats().processed,
        refused.len(),
        refused.first().map_or("", String::as_str),
        consumer.stats().duplicates
    );
    assert_eq!((left, consumer.stats().processed, refused.len()), (1, 2, 1));
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
