//! `idemq bench --stores postgres,postgres-unique,postgres-unique-batch`: a message's
//! effect row and its dedup record written in one PostgreSQL transaction, three ways, over
//! the in-memory broker, all by the one engine ([`IdempotentConsumer`]):
//!
//! - **dedup table** (`postgres`): the engine claims the batch's keys with leases, each
//!   handler opens [`begin_for`](idemq::sql::SqlStore::begin_for), inserts its effect row
//!   and completes the record in that transaction;
//! - **unique index** (`postgres-unique`): the store's unique index
//!   ([`unique_index`](idemq::sql::SqlStore::unique_index)) with a
//!   [`batch_handler`](idemq::sql::SqlStore::batch_handler) inserting one effect row per
//!   message: the batch's keys and effect rows in one transaction;
//! - **unique index, batch handler** (`postgres-unique-batch`): the same with one multi-row
//!   effect insert per batch.

use super::fill;
use idemq::handler::with_state;
use idemq::sql::{sqlx, PgStore, SqlResultExt, SqlStoreOptions, TableName};
use idemq::{ConsumerConfig, IdempotentConsumer, KeyStrategy};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A fresh store (own dedup table) and an effect table on PostgreSQL.
async fn setup(url: &str) -> anyhow::Result<(PgStore, String, KeyStrategy)> {
    let tag = format!("{:08x}", rand::random::<u32>());
    let opts = SqlStoreOptions {
        table: TableName::new(&format!("bench_dedup_{tag}"))?,
        ..SqlStoreOptions::default()
    };
    let store = PgStore::connect(url, opts).await?;
    let effects = format!("bench_effects_{tag}");
    sqlx::query(&format!("CREATE TABLE {effects} (msg_key TEXT NOT NULL)"))
        .execute(store.pool())
        .await?;
    Ok((
        store,
        effects,
        KeyStrategy::header(&format!("bench-{tag}"), "k")?,
    ))
}

async fn teardown(store: &PgStore, effects: &str) -> anyhow::Result<()> {
    let tables = std::iter::once(effects.to_owned())
        .chain(store.tables().into_iter().map(|t| t.as_str().to_owned()));
    for table in tables {
        sqlx::query(&format!("DROP TABLE IF EXISTS {table} CASCADE"))
            .execute(store.pool())
            .await?;
    }
    Ok(())
}

async fn count(store: &PgStore, effects: &str) -> anyhow::Result<i64> {
    let (n,): (i64,) = sqlx::query_as(&format!("SELECT count(*) FROM {effects}"))
        .fetch_one(store.pool())
        .await?;
    Ok(n)
}

/// Times `run` (a consumer over a broker of `n` messages), checks that it wrote `n` effect
/// rows, and drops the tables.
async fn timed_run(
    store: &PgStore,
    effects: &str,
    n: usize,
    what: &str,
    run: impl std::future::Future<Output = Result<(), idemq::ConsumerError>>,
) -> anyhow::Result<Duration> {
    let t = Instant::now();
    run.await?;
    let elapsed = t.elapsed();
    anyhow::ensure!(count(store, effects).await? == n as i64, "{what} effects");
    teardown(store, effects).await?;
    Ok(elapsed)
}

/// The engine with the dedup-table store; effect + completion in the handler's transaction.
pub async fn dedup_table(url: &str, n: usize, batch: usize) -> anyhow::Result<Duration> {
    let (store, effects, keys) = setup(url).await?;
    let broker = fill(n);
    let insert = format!("INSERT INTO {effects} (msg_key) VALUES ($1)");
    let handler = with_state((store.clone(), insert), |(store, insert), msg| async move {
        let mut tx = store.begin_for(&msg).await?;
        sqlx::query(&insert)
            .bind(msg.key.as_str())
            .execute(&mut *tx)
            .await
            .classify()?;
        tx.commit().await
    });
    let consumer =
        IdempotentConsumer::new(Arc::new(store.clone()), keys, handler).with_config(config(batch));
    let mut source = broker.subscribe();
    let run = consumer.run_until_idle(&mut source);
    timed_run(&store, &effects, n, "dedup-table", run).await
}

/// The settings of every consumer here: the defaults, with the run's batch.
fn config(batch: usize) -> ConsumerConfig {
    ConsumerConfig {
        max_batch: batch,
        ..ConsumerConfig::default()
    }
}

/// The unique-index strategy with a batch handler: one key insert, one multi-row effect
/// insert and one commit per batch (what a hand-written `ON CONFLICT` consumer does, plus
/// the key insert).
pub async fn unique_index_batched(url: &str, n: usize, batch: usize) -> anyhow::Result<Duration> {
    let (store, effects, keys) = setup(url).await?;
    let broker = fill(n);
    let insert = format!("INSERT INTO {effects} (msg_key) SELECT * FROM UNNEST($1::text[])");
    let handler = store.batch_handler(move |tx, msgs| {
        let insert = insert.clone();
        let keys: Vec<&str> = msgs.iter().map(|m| m.key.as_str()).collect();
        Box::pin(async move {
            sqlx::query(&insert)
                .bind(keys)
                .execute(&mut *tx)
                .await
                .classify()?;
            Ok(())
        })
    });
    let consumer = IdempotentConsumer::new(Arc::new(store.unique_index()), keys, handler)
        .with_config(config(batch));
    let mut source = broker.subscribe();
    let run = consumer.run_until_idle(&mut source);
    timed_run(&store, &effects, n, "unique-index batched", run).await
}

/// The unique-index strategy, one effect statement per message: the batch's key insert
/// and its effect rows in one transaction.
pub async fn unique_index(url: &str, n: usize, batch: usize) -> anyhow::Result<Duration> {
    let (store, effects, keys) = setup(url).await?;
    let broker = fill(n);
    let insert = format!("INSERT INTO {effects} (msg_key) VALUES ($1)");
    let handler = store.batch_handler(move |tx, msgs| {
        let insert = insert.clone();
        Box::pin(async move {
            for msg in msgs {
                sqlx::query(&insert)
                    .bind(msg.key.as_str())
                    .execute(&mut *tx)
                    .await
                    .classify()?;
            }
            Ok(())
        })
    });
    let consumer = IdempotentConsumer::new(Arc::new(store.unique_index()), keys, handler)
        .with_config(config(batch));
    let mut source = broker.subscribe();
    let run = consumer.run_until_idle(&mut source);
    timed_run(&store, &effects, n, "unique-index", run).await
}
