//! Hot rows: many payments, few accounts, each batch updating the balances of the accounts
//! its payments name, in message order (the consumer a newcomer writes). Batches of one
//! consumer must not deadlock each other (its transactions take turns while the pipeline
//! overlaps the rest), and deadlocks between two consumers are retried, counted in
//! `idemq_transaction_retries_total` and never reach the user as failures.

mod support;

use idemq_core::broker::MemoryBroker;
use idemq_core::{
    BrokerKind, ConsumerConfig, Envelope, HandlerError, IdempotentConsumer, KeyStrategy,
};
use idemq_sql::{sqlx, PgStore, SqlResultExt};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

const ACCOUNTS: i64 = 7;

#[derive(serde::Deserialize)]
struct Payment {
    account: i64,
    amount: i64,
}

/// Counts `idemq_transaction_retries_total` (the only metric this test reads).
struct RetriesRecorder(Arc<AtomicU64>);

struct Tally(Arc<AtomicU64>);

impl metrics::CounterFn for Tally {
    fn increment(&self, value: u64) {
        self.0.fetch_add(value, Ordering::Relaxed);
    }
    fn absolute(&self, _value: u64) {}
}

impl metrics::Recorder for RetriesRecorder {
    fn describe_counter(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_gauge(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_histogram(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn register_counter(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        if key.name() == idemq_core::metrics::TRANSACTION_RETRIES {
            metrics::Counter::from_arc(Arc::new(Tally(self.0.clone())))
        } else {
            metrics::Counter::noop()
        }
    }
    fn register_gauge(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        metrics::Gauge::noop()
    }
    fn register_histogram(
        &self,
        _: &metrics::Key,
        _: &metrics::Metadata<'_>,
    ) -> metrics::Histogram {
        metrics::Histogram::noop()
    }
}

fn retries_counter() -> Arc<AtomicU64> {
    static RETRIES: std::sync::OnceLock<Arc<AtomicU64>> = std::sync::OnceLock::new();
    RETRIES
        .get_or_init(|| {
            let n = Arc::new(AtomicU64::new(0));
            let _ = metrics::set_global_recorder(RetriesRecorder(n.clone()));
            n
        })
        .clone()
}

/// Payments `0..n` spread over the accounts in a shuffled order; returns the broker and the
/// balance each account must end with.
fn payments(n: usize, seed: u64) -> (MemoryBroker, Vec<i64>) {
    let broker = MemoryBroker::new();
    let mut want = vec![0i64; ACCOUNTS as usize];
    let mut x = seed | 1;
    for i in 0..n {
        // xorshift: a fixed, shuffled account sequence.
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let account = (x % ACCOUNTS as u64) as i64;
        let amount = 1 + (i as i64 % 9);
        want[account as usize] += amount;
        broker.publish(Envelope::new(
            BrokerKind::MEMORY,
            "payments",
            format!(r#"{{"payment_id":"pay-{i}","account":{account},"amount":{amount}}}"#),
        ));
        if i % 10 == 0 {
            // The callback sent twice.
            broker.publish(Envelope::new(
                BrokerKind::MEMORY,
                "payments",
                format!(r#"{{"payment_id":"pay-{i}","account":{account},"amount":{amount}}}"#),
            ));
        }
    }
    (broker, want)
}

async fn accounts_table(store: &PgStore) -> String {
    let t = support::unique("hot_accounts");
    sqlx::query(&format!(
        "CREATE TABLE {t} (id BIGINT PRIMARY KEY, balance BIGINT NOT NULL)"
    ))
    .execute(store.pool())
    .await
    .expect("accounts table");
    sqlx::query(&format!(
        "INSERT INTO {t} SELECT g, 0 FROM generate_series(0, {}) g",
        ACCOUNTS - 1
    ))
    .execute(store.pool())
    .await
    .expect("accounts");
    t
}

async fn balances(store: &PgStore, table: &str) -> Vec<i64> {
    let rows: Vec<(i64,)> = sqlx::query_as(&format!("SELECT balance FROM {table} ORDER BY id"))
        .fetch_all(store.pool())
        .await
        .expect("balances");
    rows.into_iter().map(|(b,)| b).collect()
}

/// The newcomer's handler: one UPDATE per payment, in message order, in the batch's
/// transaction.
fn handler(store: &PgStore, table: &str) -> impl idemq_core::Handler {
    let update = format!("UPDATE {table} SET balance = balance + $1 WHERE id = $2");
    store.batch_handler(move |tx, msgs| {
        let update = update.clone();
        Box::pin(async move {
            for m in msgs {
                let p: Payment = m.json()?;
                sqlx::query(&update)
                    .bind(p.amount)
                    .bind(p.account)
                    .execute(&mut *tx)
                    .await
                    .classify()?;
            }
            Ok::<(), HandlerError>(())
        })
    })
}

/// A consumer of that handler, keys in the store's keys table under `group`.
fn consumer(
    store: &PgStore,
    table: &str,
    group: &str,
    cfg: ConsumerConfig,
) -> IdempotentConsumer<impl idemq_core::Handler> {
    let keys = KeyStrategy::json_pointer(group, "/payment_id").expect("keys");
    IdempotentConsumer::new(Arc::new(store.unique_index()), keys, handler(store, table))
        .with_config(cfg)
}

async fn server_deadlocks(store: &PgStore) -> i64 {
    let (n,): (i64,) =
        sqlx::query_as("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
            .fetch_one(store.pool())
            .await
            .expect("pg_stat_database");
    n
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hot_rows_with_the_pipeline_on_apply_every_payment_once_without_deadlocks() {
    let Some((_guard, store)) = support::postgres_store().await else {
        return;
    };
    let table = accounts_table(&store).await;
    let (broker, want) = payments(3000, 7);
    let cfg = ConsumerConfig {
        pipeline_depth: 4,
        ..ConsumerConfig::default()
    };
    let consumer = consumer(&store, &table, &support::unique("hot"), cfg);
    tokio::time::timeout(
        std::time::Duration::from_secs(120),
        consumer.run_until_idle(&mut broker.subscribe()),
    )
    .await
    .expect("the run ends")
    .expect("run");
    assert_eq!(balances(&store, &table).await, want);
    let stats = consumer.stats();
    assert_eq!(
        (
            stats.processed,
            stats.retried,
            stats.rejected,
            stats.batch_splits
        ),
        (3000, 0, 0, 0),
        "no failure may reach the user: {stats:?}"
    );
    assert_eq!(stats.duplicates, 300, "{stats:?}");
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn deadlocks_between_two_consumers_are_retried_and_counted() {
    let Some((_guard, store)) = support::postgres_store().await else {
        return;
    };
    let retries = retries_counter();
    let before = retries.load(Ordering::Relaxed);
    let table = accounts_table(&store).await;
    let (broker, want) = payments(600, 11);
    let cfg = ConsumerConfig {
        max_batch: 50,
        ..ConsumerConfig::default()
    };
    let deadlocks_before = server_deadlocks(&store).await;
    // Two consumers (two processes, as far as their turns go), one queue, one key group.
    let group = support::unique("hot2");
    let a = consumer(&store, &table, &group, cfg.clone());
    let b = consumer(&store, &table, &group, cfg);
    let (ba, bb) = (broker.clone(), broker.clone());
    let (ra, rb) = tokio::join!(
        async move {
            let r = a.run_until_idle(&mut ba.subscribe()).await;
            (a.stats(), r)
        },
        async move {
            let r = b.run_until_idle(&mut bb.subscribe()).await;
            (b.stats(), r)
        }
    );
    ra.1.expect("run a");
    rb.1.expect("run b");
    assert_eq!(balances(&store, &table).await, want);
    let (sa, sb) = (ra.0, rb.0);
    assert_eq!(sa.processed + sb.processed, 600, "{sa:?} {sb:?}");
    assert_eq!(
        (sa.retried + sb.retried, sa.rejected + sb.rejected),
        (0, 0),
        "deadlocks must not reach the user: {sa:?} {sb:?}"
    );
    // The server's statistics are flushed by each backend within a second or so.
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    let deadlocks = server_deadlocks(&store).await - deadlocks_before;
    let counted = retries.load(Ordering::Relaxed) - before;
    eprintln!("deadlocks on the server: {deadlocks}; transaction retries counted: {counted}");
    assert!(
        deadlocks == 0 || counted >= 1,
        "the server reported {deadlocks} deadlocks but no retry was counted"
    );
}
