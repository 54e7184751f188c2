//! Batch effects in one transaction, and the unique-index strategy as a store of the one
//! engine. A storm of producer duplicates, lost acks, handler failures and consumer
//! crashes, three consumers at once, on SQLite, PostgreSQL and MariaDB: every payment's
//! effect row (in a ledger table *without* a unique constraint) exists exactly once, with
//! the keys in the keys table (unique index), in the effect rows themselves, or in the
//! dedup table with leases completed in the batch's transaction.

mod support;

use idemq_core::broker::{Faults, MemoryBroker};
use idemq_core::{
    BrokerKind, ClaimedMessage, ConsumerConfig, DedupStore, Envelope, HandlerError,
    IdempotentConsumer, KeyStrategy, RetryPolicy,
};
use idemq_sql::{Kind, SqlBackend, SqlStore, Val};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

const PAYMENTS: usize = 1500;
const POISON: &str = "pay-poison";

fn payment(id: &str) -> Envelope {
    Envelope::new(
        BrokerKind::MEMORY,
        "payments",
        format!(r#"{{"payment_id":"{id}","amount":100}}"#),
    )
}

/// A deterministic ~5% of keys whose first attempt fails after writing its effect row
/// (the rollback must take the row away).
fn flaky(key: &str) -> bool {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    key.hash(&mut h);
    h.finish() % 100 < 5
}

async fn exec<DB: SqlBackend>(store: &SqlStore<DB>, sql: &str) {
    let mut conn = store.pool().acquire().await.expect("connection");
    DB::execute(&mut conn, &DB::DIALECT.placeholders(sql.to_owned()), vec![])
        .await
        .expect(sql);
}

fn payment_id(msg: &ClaimedMessage) -> String {
    msg.key
        .as_str()
        .rsplit(':')
        .next()
        .unwrap_or_default()
        .to_owned()
}

/// The failures the storm injects, after the effect row was written (the rollback must
/// take it away): the poison fails for good, ~5% of keys fail their first attempt.
fn injected_failure(msg: &ClaimedMessage) -> Result<(), HandlerError> {
    let id = payment_id(msg);
    if id == POISON {
        return Err(HandlerError::permanent("poison payment"));
    }
    if msg.attempt == 1 && flaky(&id) {
        return Err(HandlerError::retryable("flaky downstream"));
    }
    Ok(())
}

/// The consumers of the shapes (one engine, handlers of different types) behind one face.
#[idemq_core::async_trait]
trait Storm: Send + Sync {
    async fn run_until_idle(
        &self,
        src: &mut idemq_core::broker::MemorySource,
    ) -> Result<(), idemq_core::ConsumerError>;
    fn stats(&self) -> idemq_core::ConsumerStats;
}

#[idemq_core::async_trait]
impl<H: idemq_core::Handler> Storm for IdempotentConsumer<H> {
    async fn run_until_idle(
        &self,
        src: &mut idemq_core::broker::MemorySource,
    ) -> Result<(), idemq_core::ConsumerError> {
        IdempotentConsumer::run_until_idle(self, src).await
    }
    fn stats(&self) -> idemq_core::ConsumerStats {
        IdempotentConsumer::stats(self)
    }
}

/// How the storm's handler writes, and where the keys go.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Shape {
    /// One statement per message, keys in the store's keys table (unique index).
    PerMessage,
    /// One multi-row insert per batch, keys in the store's keys table (unique index).
    Batched,
    /// The effect table's unique column is the dedup (`keyed_batch_handler`); the rows it
    /// wrote are copied to the unconstrained ledger, so a failed dedup would show there.
    KeyedEffects,
    /// One multi-row insert per batch over the dedup table with leases, completed in the
    /// batch's transaction.
    Leases,
}

async fn storm<DB: SqlBackend>(store: SqlStore<DB>, label: &str, shape: Shape) {
    let ledger = support::unique("uq_ledger");
    exec(
        &store,
        &format!("CREATE TABLE {ledger} (payment_id VARCHAR(64) NOT NULL)"),
    )
    .await;
    let keyed = format!("{ledger}_k");
    exec(
        &store,
        &format!("CREATE TABLE {keyed} (dedup_key VARCHAR(200) NOT NULL PRIMARY KEY)"),
    )
    .await;

    let broker = MemoryBroker::with_seed(11);
    broker.set_faults(Faults {
        lost_ack_rate: 0.2,
        duplicate_publish_rate: 0.3,
    });
    for i in 0..PAYMENTS {
        let id = format!("pay-{i}");
        broker.publish(payment(&id));
        broker.publish(payment(&id)); // the callback sent twice
        if i == PAYMENTS / 2 {
            broker.publish(payment(POISON));
        }
    }

    let keys =
        KeyStrategy::json_pointer(&support::unique("payments"), "/payment_id").expect("keys");
    let cfg = ConsumerConfig {
        max_batch: 64,
        retry: RetryPolicy::fixed(Duration::from_millis(5)).with_max_attempts(4),
        ..ConsumerConfig::default()
    };
    let table = ledger.clone();
    let multi_row = move |msgs: &[ClaimedMessage]| {
        let ledger = &table;
        let rows = vec!["(?)"; msgs.len()].join(", ");
        DB::DIALECT.placeholders(format!("INSERT INTO {ledger} (payment_id) VALUES {rows}"))
    };
    let ids = |msgs: &[ClaimedMessage]| -> Vec<Val> {
        msgs.iter()
            .map(|m| Val::Text(Some(payment_id(m))))
            .collect()
    };
    let one_row = DB::DIALECT.placeholders(format!("INSERT INTO {ledger} (payment_id) VALUES (?)"));
    let unique: Arc<dyn DedupStore> = Arc::new(store.unique_index());
    let consumer: Arc<dyn Storm> = match shape {
        Shape::KeyedEffects => {
            let (ledger, keyed) = (ledger.clone(), keyed.clone());
            let handler = store.keyed_batch_handler(move |tx, msgs| {
                let rows = vec!["(?)"; msgs.len()].join(", ");
                let write = DB::DIALECT.placeholders(match DB::DIALECT {
                    idemq_sql::Dialect::MySql => format!(
                        "INSERT IGNORE INTO {keyed} (dedup_key) VALUES {rows} RETURNING dedup_key"
                    ),
                    _ => format!(
                        "INSERT INTO {keyed} (dedup_key) VALUES {rows} \
                         ON CONFLICT (dedup_key) DO NOTHING RETURNING dedup_key"
                    ),
                });
                let copy = DB::DIALECT
                    .placeholders(format!("INSERT INTO {ledger} (payment_id) VALUES (?)"));
                Box::pin(async move {
                    let keys = msgs
                        .iter()
                        .map(|m| Val::Text(Some(m.key.as_str().to_owned())))
                        .collect();
                    let written = DB::fetch(tx, &write, keys, &[Kind::Text])
                        .await
                        .map_err(HandlerError::retryable)?;
                    let written: Vec<String> = written
                        .iter()
                        .filter_map(|r| r.text(0).ok().map(str::to_owned))
                        .collect();
                    for m in msgs
                        .iter()
                        .filter(|m| written.iter().any(|k| k == m.key.as_str()))
                    {
                        DB::execute(tx, &copy, vec![Val::Text(Some(payment_id(m)))])
                            .await
                            .map_err(HandlerError::retryable)?;
                    }
                    msgs.iter().try_for_each(injected_failure)?;
                    Ok(written)
                })
            });
            Arc::new(IdempotentConsumer::new(unique, keys, handler).with_config(cfg))
        }
        Shape::Batched | Shape::Leases => {
            // All new messages of a batch written with one multi-row insert.
            let handler = store.batch_handler(move |tx, msgs| {
                let (sql, args) = (multi_row(msgs), ids(msgs));
                Box::pin(async move {
                    DB::execute(tx, &sql, args)
                        .await
                        .map_err(HandlerError::retryable)?;
                    msgs.iter().try_for_each(injected_failure)
                })
            });
            let on: Arc<dyn DedupStore> = match shape {
                Shape::Leases => Arc::new(store.clone()),
                _ => unique,
            };
            Arc::new(IdempotentConsumer::new(on, keys, handler).with_config(cfg))
        }
        Shape::PerMessage => {
            let handler = store.batch_handler(move |tx, msgs| {
                let insert = one_row.clone();
                Box::pin(async move {
                    for m in msgs {
                        DB::execute(&mut *tx, &insert, vec![Val::Text(Some(payment_id(m)))])
                            .await
                            .map_err(HandlerError::retryable)?;
                        injected_failure(m)?;
                    }
                    Ok(())
                })
            });
            Arc::new(IdempotentConsumer::new(unique, keys, handler).with_config(cfg))
        }
    };

    // Three consumers; the first crashes four times (its future is dropped mid-batch:
    // an open transaction is rolled back, unsettled deliveries go back to the queue).
    let mut tasks = Vec::new();
    for c in 0..3 {
        let (consumer, broker) = (consumer.clone(), broker.clone());
        tasks.push(tokio::spawn(async move {
            if c == 0 {
                for crash in 0..4u64 {
                    let mut src = broker.subscribe();
                    let run = consumer.run_until_idle(&mut src);
                    if tokio::time::timeout(Duration::from_millis(40 + 25 * crash), run)
                        .await
                        .is_ok()
                    {
                        return;
                    }
                }
            }
            let mut src = broker.subscribe();
            tokio::time::timeout(Duration::from_secs(120), consumer.run_until_idle(&mut src))
                .await
                .expect("the storm ends")
                .expect("consumer run");
        }));
    }
    for t in tasks {
        t.await.expect("consumer task");
    }

    let mut conn = store.pool().acquire().await.expect("connection");
    let rows = DB::fetch(
        &mut conn,
        &format!("SELECT payment_id, COUNT(*) FROM {ledger} GROUP BY payment_id"),
        vec![],
        &[Kind::Text, Kind::I64],
    )
    .await
    .expect("ledger");
    let counts: BTreeMap<String, i64> = rows
        .iter()
        .map(|r| (r.text(0).expect("id").to_owned(), r.i64(1).expect("count")))
        .collect();
    let double_effects: i64 = counts.values().map(|n| (n - 1).max(0)).sum();
    let lost = (0..PAYMENTS)
        .filter(|i| !counts.contains_key(&format!("pay-{i}")))
        .count();
    let stats = consumer.stats();
    eprintln!(
        "[{label}] published={} processed={} duplicates={} retried={} rejected={} batch_splits={} double_effects={double_effects} lost={lost}",
        broker.published(),
        stats.processed,
        stats.duplicates,
        stats.retried,
        stats.rejected,
        stats.batch_splits
    );
    assert_eq!(double_effects, 0, "[{label}] double effects: {counts:?}");
    assert_eq!(lost, 0, "[{label}] lost payments");
    assert!(
        !counts.contains_key(POISON),
        "[{label}] the poison payment's effect was rolled back"
    );
    let dead = broker.dead_letters();
    assert_eq!(dead.len(), 1, "[{label}] only the poison is dead-lettered");
    assert!(
        dead[0].reason.contains("poison payment"),
        "{}",
        dead[0].reason
    );
    assert!(
        stats.retried > 0 && stats.batch_splits > 0,
        "[{label}] failures were injected and isolated: {stats:?}"
    );
    assert!(
        stats.duplicates > 0,
        "[{label}] duplicates were met: {stats:?}"
    );
    exec(&store, &format!("DROP TABLE {ledger}")).await;
    exec(&store, &format!("DROP TABLE {keyed}")).await;
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unique_index_storm_sqlite() {
    let (_guard, store) = support::sqlite_store().await.expect("sqlite");
    storm(store.clone(), "sqlite", Shape::PerMessage).await;
    storm(store.clone(), "sqlite batched", Shape::Batched).await;
    storm(store.clone(), "sqlite keyed effects", Shape::KeyedEffects).await;
    storm(store, "sqlite leases", Shape::Leases).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unique_index_storm_postgres() {
    let Some((_guard, store)) = support::postgres_store().await else {
        return;
    };
    storm(store.clone(), "postgres", Shape::PerMessage).await;
    storm(store.clone(), "postgres batched", Shape::Batched).await;
    storm(store.clone(), "postgres keyed effects", Shape::KeyedEffects).await;
    storm(store, "postgres leases", Shape::Leases).await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unique_index_storm_mariadb() {
    let Some((_guard, store)) = support::mysql_store().await else {
        return;
    };
    storm(store.clone(), "mariadb", Shape::PerMessage).await;
    storm(store.clone(), "mariadb batched", Shape::Batched).await;
    storm(store.clone(), "mariadb keyed effects", Shape::KeyedEffects).await;
    storm(store, "mariadb leases", Shape::Leases).await;
}

/// A message without a usable key is dead-lettered with the reason; the rest commit.
#[cfg(feature = "sqlite")]
#[tokio::test]
async fn a_message_without_a_key_is_dead_lettered_and_the_rest_commit() {
    let (_guard, store) = support::sqlite_store().await.expect("sqlite");
    let broker = MemoryBroker::new();
    broker.publish(payment("pay-1"));
    broker.publish(Envelope::new(
        BrokerKind::MEMORY,
        "payments",
        r#"{"amount":5}"#,
    ));
    broker.publish(payment("pay-2"));
    let keys = KeyStrategy::json_pointer("nokey", "/payment_id").expect("keys");
    let handler = store.batch_handler(|_tx, _msgs| Box::pin(async { Ok(()) }));
    let consumer = IdempotentConsumer::new(Arc::new(store.unique_index()), keys, handler);
    consumer
        .run_until_idle(&mut broker.subscribe())
        .await
        .expect("run");
    assert_eq!(consumer.stats().processed, 2);
    let dead = broker.dead_letters();
    assert_eq!(dead.len(), 1);
    assert!(dead[0].reason.contains("payment_id"), "{}", dead[0].reason);
}

/// A custom key function that panics on one message dead-letters that message with the
/// panic message as its reason, as the dedup-table engine does; the consumer survives and
/// the rest commit (a panic escaping would kill the consumer, and the redelivery again).
#[cfg(feature = "sqlite")]
#[tokio::test]
async fn a_panicking_key_function_dead_letters_the_message_and_the_rest_commit() {
    let (_guard, store) = support::sqlite_store().await.expect("sqlite");
    let broker = MemoryBroker::new();
    broker.publish(payment("pay-1"));
    broker.publish(payment(POISON));
    broker.publish(payment("pay-2"));
    let keys = KeyStrategy::custom("panicky", |e| {
        let text = String::from_utf8_lossy(&e.payload).into_owned();
        if text.contains(POISON) {
            panic!("the key function cannot read {POISON}");
        }
        Ok(text)
    })
    .expect("keys");
    let handler = store.batch_handler(|_tx, _msgs| Box::pin(async { Ok(()) }));
    let consumer = IdempotentConsumer::new(Arc::new(store.unique_index()), keys, handler);
    let mut source = broker.subscribe();
    let run = tokio::spawn(async move {
        let result = consumer.run_until_idle(&mut source).await;
        (consumer, result)
    });
    let (consumer, result) = run
        .await
        .expect("the consumer must survive a panicking key function");
    result.expect("run");
    assert_eq!(consumer.stats().processed, 2);
    let dead = broker.dead_letters();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert!(
        dead[0].reason.contains("key function panicked")
            && dead[0].reason.contains("cannot read pay-poison"),
        "{}",
        dead[0].reason
    );
}

/// Every producer duplicate acked across batches is counted as a duplicate (the earlier
/// unique-index consumer's stats stayed at 0 with every copy acked).
#[cfg(feature = "sqlite")]
#[tokio::test]
async fn duplicates_found_in_the_transaction_are_counted() {
    let (_guard, store) = support::sqlite_store().await.expect("sqlite");
    let broker = MemoryBroker::new();
    for i in 0..50 {
        broker.publish(payment(&format!("pay-{i}")));
    }
    for i in 0..50 {
        broker.publish(payment(&format!("pay-{i}"))); // the producer retried, later
    }
    let keys = KeyStrategy::json_pointer(&support::unique("dups"), "/payment_id").expect("keys");
    let handler = store.batch_handler(|_tx, _msgs| Box::pin(async { Ok(()) }));
    let consumer = IdempotentConsumer::new(Arc::new(store.unique_index()), keys, handler)
        .with_config(ConsumerConfig {
            max_batch: 10,
            ..ConsumerConfig::default()
        });
    consumer
        .run_until_idle(&mut broker.subscribe())
        .await
        .expect("run");
    let stats = consumer.stats();
    assert_eq!((stats.processed, stats.duplicates), (50, 50), "{stats:?}");
}

/// A plain handler cannot run over the unique-index store: nothing would record the keys,
/// so the engine refuses at start-up with the reason instead of acking unrecorded effects.
#[cfg(feature = "sqlite")]
#[tokio::test]
async fn a_handler_that_records_no_key_is_refused_over_the_unique_index() {
    let (_guard, store) = support::sqlite_store().await.expect("sqlite");
    let broker = MemoryBroker::new();
    broker.publish(payment("pay-1"));
    let keys = KeyStrategy::json_pointer("plain", "/payment_id").expect("keys");
    let consumer = IdempotentConsumer::new(
        Arc::new(store.unique_index()),
        keys,
        |_m: ClaimedMessage| async { Ok(None) },
    );
    let err = consumer
        .run_until_idle(&mut broker.subscribe())
        .await
        .expect_err("refused");
    assert!(err.to_string().contains("does not insert them"), "{err}");
    assert_eq!(broker.dead_letters().len(), 0);
}

/// The unique index's attempt counts live in the attempts table: durable (a second store
/// over the same database, as after a restart or in another consumer of the group, sees
/// them), read only for redeliveries, and a claim given back unrun is not an attempt.
async fn attempts_survive_a_restart<DB: SqlBackend>(a: SqlStore<DB>, b: SqlStore<DB>) {
    use idemq_core::{ClaimOutcome, ClaimRequest, DedupKey, DedupStore, FencingToken};
    let g = idemq_core::ConsumerGroup::new(&format!("attempts-{}", FencingToken::random()))
        .expect("group");
    let k = DedupKey::new(&g, "pay-1").expect("key");
    let claim = |store: &SqlStore<DB>, deliveries: u32| {
        let store = store.unique_index();
        let req = ClaimRequest::new(k.clone(), Duration::from_secs(30)).with_deliveries(deliveries);
        async move {
            match store.claim(&req).await.expect("claim") {
                ClaimOutcome::Acquired(l) => l,
                o => panic!("the unique index hands every key out: {o:?}"),
            }
        }
    };
    let first = claim(&a, 1).await;
    assert_eq!(first.attempt, 1);
    a.unique_index()
        .release(&k, first.token)
        .await
        .expect("a failed run");
    // Delivered again, to another consumer (or after a restart): one failure was counted.
    let second = claim(&b, 2).await;
    assert_eq!(second.attempt, 2);
    // Held behind a failing message of its lane: given back without a run.
    b.unique_index()
        .release_unrun(&k, second.token)
        .await
        .expect("given back unrun");
    let third = claim(&a, 3).await;
    assert_eq!(
        third.attempt, 2,
        "the claim given back unrun is not an attempt"
    );
    // A run lost to a crash (no release at all) counts: the broker delivered again.
    let fourth = claim(&b, 4).await;
    assert_eq!(fourth.attempt, 3, "three deliveries less one unrun claim");
    // Forgetting the key forgets its counts.
    assert!(!a.unique_index().forget(&k).await.expect("forget"));
    assert_eq!(
        claim(&b, 5).await.attempt,
        5,
        "only the broker's count is left"
    );
}

#[cfg(feature = "sqlite")]
#[tokio::test]
async fn unique_index_attempts_survive_a_restart_sqlite() {
    let dir = support::TempDir::new();
    let url = dir.sqlite_url("attempts");
    let open = || idemq_sql::SqliteStore::connect(&url, support::options("idemq_attempts", 4));
    let a = open().await.expect("sqlite");
    let b = open().await.expect("sqlite again");
    attempts_survive_a_restart(a, b).await;
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn unique_index_attempts_survive_a_restart_postgres() {
    let Some(url) = support::postgres_url() else {
        return;
    };
    let t = support::unique("attempts");
    let a = idemq_sql::PgStore::connect(&url, support::options(&t, 4))
        .await
        .expect("pg");
    let b = idemq_sql::PgStore::connect(&url, support::options(&t, 4))
        .await
        .expect("pg");
    attempts_survive_a_restart(a, b).await;
}

#[cfg(feature = "mysql")]
#[tokio::test]
async fn unique_index_attempts_survive_a_restart_mariadb() {
    let Some(url) = support::mysql_url() else {
        return;
    };
    let t = support::unique("attempts");
    let a = idemq_sql::MySqlStore::connect(&url, support::options(&t, 4))
        .await
        .expect("mysql");
    let b = idemq_sql::MySqlStore::connect(&url, support::options(&t, 4))
        .await
        .expect("mysql");
    attempts_survive_a_restart(a, b).await;
}
