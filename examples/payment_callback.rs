//! A payment provider calls back twice (or ten times) for the same payment: the unique-index
//! strategy creates one payment row, because the dedup key and the payment commit in the same
//! transaction.
//!
//! ```sh
//! cargo run --example payment_callback
//! ```

use idemq::sql::sqlx::{self, sqlite::SqlitePoolOptions};
use idemq::sql::{KeyInsert, SqlStoreOptions, SqliteStore};
use idemq::{BrokerKind, Envelope, KeyStrategy};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .connect("sqlite::memory:")
        .await?;
    sqlx::query("CREATE TABLE payments (payment_id TEXT NOT NULL, amount INTEGER NOT NULL)")
        .execute(&pool)
        .await?;
    let store = SqliteStore::from_pool(pool.clone(), SqlStoreOptions::default()).await?;
    let keys = KeyStrategy::json_pointer("payments-svc", "/payment_id")?;

    let callback = Envelope::new(
        BrokerKind::MEMORY,
        "payment-callbacks",
        r#"{"payment_id":"pay-42","amount":1999}"#,
    );
    let (mut created, mut skipped) = (0, 0);
    for attempt in 1..=3 {
        let key = keys.derive(&callback)?;
        let mut tx = pool.begin().await?;
        match store.insert_key_in_tx(&mut tx, &key).await? {
            KeyInsert::Inserted => {
                sqlx::query("INSERT INTO payments (payment_id, amount) VALUES (?, ?)")
                    .bind("pay-42")
                    .bind(1999_i64)
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
                created += 1;
                println!("callback {attempt}: payment created");
            }
            KeyInsert::Duplicate => {
                tx.rollback().await?;
                skipped += 1;
                println!("callback {attempt}: duplicate, skipped");
            }
        }
    }
    let (n,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM payments")
        .fetch_one(&pool)
        .await?;
    // Three callbacks for one payment: one row, the two repeats skipped.
    println!("payments={n} created={created} skipped={skipped}");
    assert_eq!((n, created, skipped), (1, 1, 2));
    Ok(())
}
