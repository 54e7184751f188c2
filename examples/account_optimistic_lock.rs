//! Account changes applied under an optimistic lock: each event carries the account's
//! sequence number, and `UPDATE accounts SET version = ? WHERE id = ? AND version < ?` in the
//! effect's transaction lets only a newer change through. A redelivered change, or an older
//! one arriving late, finds the version already past it and is skipped. One row per
//! account: nothing grows with traffic (docs/strategies.md).
//!
//! Needs no server (SQLite in memory):
//!
//! ```sh
//! cargo run --example account_optimistic_lock
//! ```

use idemq::broker::MemoryBroker;
use idemq::sql::sqlx::{self, sqlite::SqlitePoolOptions};
use idemq::sql::{VersionOutcome, VersionedEntity};
use idemq::{BrokerKind, Envelope, Source};

#[derive(serde::Deserialize)]
struct BalanceChange {
    account: i64,
    seq: i64,
    delta: i64,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .connect("sqlite::memory:")
        .await?;
    sqlx::query(
        "CREATE TABLE accounts (id INTEGER PRIMARY KEY, balance INTEGER NOT NULL, version INTEGER NOT NULL)",
    )
    .execute(&pool)
    .await?;
    sqlx::query("INSERT INTO accounts VALUES (7, 1000, 0)")
        .execute(&pool)
        .await?;

    let broker = MemoryBroker::new();
    // Changes 1..=3, with change 2 redelivered after 3 and change 1 replayed at the end.
    for (seq, delta) in [(1, -100), (2, -50), (3, 200), (2, -50), (1, -100)] {
        broker.publish(Envelope::new(
            BrokerKind::MEMORY,
            "account-changes",
            format!(r#"{{"account":7,"seq":{seq},"delta":{delta}}}"#),
        ));
    }

    let accounts = VersionedEntity::new("accounts", "id", "version")?;
    let mut source = broker.subscribe();
    let mut stale = 0;
    while let Some(batch) = source.poll(16).await? {
        for delivery in batch {
            let Ok(change) = serde_json::from_slice::<BalanceChange>(&delivery.envelope.payload)
            else {
                delivery.reject("not a balance change").await?;
                continue;
            };
            let mut tx = pool.begin().await?;
            match accounts
                .apply_if_newer(&mut *tx, change.account, change.seq)
                .await?
            {
                VersionOutcome::Applied => {
                    sqlx::query("UPDATE accounts SET balance = balance + ? WHERE id = ?")
                        .bind(change.delta)
                        .bind(change.account)
                        .execute(&mut *tx)
                        .await?;
                    tx.commit().await?;
                }
                // Already applied (or superseded): the version says so, nothing to write.
                VersionOutcome::Stale(_) => stale += 1,
                VersionOutcome::NotFound => {
                    delivery.reject("unknown account").await?;
                    continue;
                }
            }
            delivery.ack().await?;
        }
    }
    let (balance, version): (i64, i64) =
        sqlx::query_as("SELECT balance, version FROM accounts WHERE id = 7")
            .fetch_one(&pool)
            .await?;
    println!("balance={balance} version={version} stale_skipped={stale}");
    assert_eq!((balance, version, stale), (1050, 3, 2));
    Ok(())
}
