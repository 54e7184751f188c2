//! The transactional outbox on every backend, as scenarios:
//! - an order's effect and its outgoing message commit together, or neither does;
//! - a process that commits and exits before relaying: the message is published once after
//!   restart (a real child process: this test binary re-run with `IDEMQ_OUTBOX_CHILD`);
//! - a relay that dies after publishing and before marking sent: the message is published
//!   again with the same dedup key, and the idempotent consumer applies it once;
//! - a publisher that rejects a message: the row stays failed with the error text and holds
//!   back its lane, until an operator retries it;
//! - a retryable error backs the row off, then it goes out;
//! - three relays at once keep every ordering key's order and publish each message once;
//! - purge removes only old sent rows; hostile or oversize table names are refused.
//!
//! SQLite always runs; PostgreSQL and MySQL/MariaDB need `IDEMQ_TEST_POSTGRES_URL` /
//! `IDEMQ_TEST_MYSQL_URL` (see `support`).

mod support;

use async_trait::async_trait;
use idemq_core::broker::MemoryBroker;
use idemq_core::{
    ClaimedMessage, DedupStore, Envelope, HandlerError, IdempotentConsumer, KeyStrategy,
    OutgoingMessage, PublishError, PublishReceipt, Publisher, Source, DEDUP_HEADER,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The env var that turns `a_crash_between_commit_and_relay_publishes_once_after_restart`,
/// re-run by itself in a child process, into the crashing child:
/// `<backend>|<url>|<outbox table>|<orders table>`.
const CHILD_ENV: &str = "IDEMQ_OUTBOX_CHILD";
/// The child's exit code after its commit.
const CHILD_EXIT: i32 = 42;

/// All messages currently queued in `broker`, in delivery order (acked, so a later drain
/// sees only new ones).
async fn take_all(broker: &MemoryBroker) -> Vec<Envelope> {
    let mut src = broker.subscribe();
    let mut out = Vec::new();
    while broker.pending() > 0 {
        let Some(batch) = src.poll(1000).await.expect("poll") else {
            break;
        };
        for d in batch {
            out.push(d.envelope.clone());
            d.ack().await.expect("ack");
        }
    }
    out
}

/// Runs an idempotent consumer (dedup key from the dedup header) over everything in
/// `broker`; returns how many effects ran per dedup key, and the duplicates dropped.
async fn consume(broker: &MemoryBroker, store: Arc<dyn DedupStore>) -> (HashMap<String, u32>, u64) {
    let effects: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
    let seen = effects.clone();
    let consumer = IdempotentConsumer::new(
        store,
        KeyStrategy::dedup_header("billing").expect("strategy"),
        move |m: ClaimedMessage| {
            let seen = seen.clone();
            async move {
                let k = m
                    .envelope
                    .headers
                    .get_str(DEDUP_HEADER)
                    .unwrap_or("?")
                    .to_owned();
                *seen.lock().expect("lock").entry(k).or_insert(0) += 1;
                Ok::<_, HandlerError>(None)
            }
        },
    );
    consumer
        .run_until_idle(&mut broker.subscribe())
        .await
        .expect("consumer");
    let dups = consumer.stats().duplicates;
    let map = effects.lock().expect("lock").clone();
    (map, dups)
}

/// Publishes to a memory broker, then never returns: a relay that dies between the
/// broker's confirm and its mark.
struct PublishThenHang(MemoryBroker);

#[async_trait]
impl Publisher for PublishThenHang {
    async fn publish(&self, msg: OutgoingMessage) -> Result<PublishReceipt, PublishError> {
        Publisher::publish(&self.0, msg).await?;
        std::future::pending().await
    }
}

/// Rejects messages to destination `bad`; publishes the rest.
struct RejectBad(MemoryBroker);

#[async_trait]
impl Publisher for RejectBad {
    async fn publish(&self, msg: OutgoingMessage) -> Result<PublishReceipt, PublishError> {
        if msg.destination == "bad" {
            return Err(PublishError::Rejected("message too large (test)".into()));
        }
        Publisher::publish(&self.0, msg).await
    }
}

/// Fails with `Disconnected` the first `n` times.
struct FlakyFirst(MemoryBroker, AtomicU32);

#[async_trait]
impl Publisher for FlakyFirst {
    async fn publish(&self, msg: OutgoingMessage) -> Result<PublishReceipt, PublishError> {
        if self
            .1
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(PublishError::Disconnected(
                "broker restarting (test)".into(),
            ));
        }
        Publisher::publish(&self.0, msg).await
    }
}

/// Publishes after a random pause, so concurrent relays interleave.
struct Jittery(MemoryBroker);

#[async_trait]
impl Publisher for Jittery {
    async fn publish(&self, msg: OutgoingMessage) -> Result<PublishReceipt, PublishError> {
        let ms = rand::random::<u64>() % 3;
        tokio::time::sleep(Duration::from_millis(ms)).await;
        Publisher::publish(&self.0, msg).await
    }
}

macro_rules! outbox_suite {
    ($m:ident, $feature:literal, $db:ty, $store:ty, $server:block) => {
        #[cfg(feature = $feature)]
        mod $m {
            use super::*;
            use idemq_sql::sqlx::{self, Pool};
            use idemq_sql::{
                Outbox, OutboxError, OutboxOptions, OutboxRelay, OutboxStatus, RelayOptions,
                SqlBackend, TableName,
            };
            use idemq_core::RetryPolicy;

            type Db = $db;
            const BACKEND: &str = $feature;

            fn q(sql: &str) -> String {
                <Db as SqlBackend>::DIALECT.placeholders(sql.to_owned())
            }

            /// A database URL (and the temp dir keeping a SQLite file alive), or `None` to skip.
            async fn server() -> Option<(Option<support::TempDir>, String)> $server

            async fn pool(url: &str) -> Pool<Db> {
                let store = <$store>::connect(url, support::options(&support::unique("obx_dedup"), 8))
                    .await
                    .expect("open store");
                store.pool().clone()
            }

            async fn dedup_store(url: &str) -> Arc<dyn DedupStore> {
                Arc::new(
                    <$store>::connect(url, support::options(&support::unique("obx_dedup"), 4))
                        .await
                        .expect("open store"),
                )
            }

            async fn outbox(pool: &Pool<Db>, table: &str) -> Outbox<Db> {
                Outbox::from_pool(
                    pool.clone(),
                    OutboxOptions::with_table(TableName::new(table).expect("table")),
                )
                .await
                .expect("open outbox")
            }

            async fn orders_table(pool: &Pool<Db>) -> String {
                let t = support::unique("obx_orders");
                sqlx::query::<Db>(&format!(
                    "CREATE TABLE {t} (id VARCHAR(64) NOT NULL PRIMARY KEY, amount BIGINT NOT NULL)"
                ))
                .execute(pool)
                .await
                .expect("create orders");
                t
            }

            async fn order_count(pool: &Pool<Db>, t: &str) -> i64 {
                let (n,): (i64,) = sqlx::query_as::<Db, (i64,)>(&format!(
                    "SELECT CAST(COUNT(*) AS {}) FROM {t}",
                    if BACKEND == "mysql" { "SIGNED" } else { "BIGINT" }
                ))
                .fetch_one(pool)
                .await
                .expect("count");
                n
            }

            /// Pays order `id` and enqueues its event in one transaction.
            async fn pay(
                pool: &Pool<Db>,
                ob: &Outbox<Db>,
                orders: &str,
                id: &str,
                commit: bool,
            ) -> idemq_sql::Enqueued {
                let mut tx = pool.begin().await.expect("begin");
                sqlx::query::<Db>(&q(&format!("INSERT INTO {orders} (id, amount) VALUES (?, ?)")))
                    .bind(id)
                    .bind(100i64)
                    .execute(&mut *tx)
                    .await
                    .expect("insert order");
                let e = ob
                    .enqueue(
                        &mut tx,
                        OutgoingMessage::new("payments", format!(r#"{{"order":"{id}"}}"#))
                            .with_key(id.to_owned())
                            .with_header("trace", "t-1")
                            .with_header("bin", vec![0u8, 255])
                            .with_dedup_key(format!("pay-{id}")),
                    )
                    .await
                    .expect("enqueue");
                if commit {
                    tx.commit().await.expect("commit");
                } else {
                    tx.rollback().await.expect("rollback");
                }
                e
            }

            #[tokio::test]
            async fn effect_and_message_commit_together_or_not_at_all() {
                let Some((_dir, url)) = server().await else { return };
                let pool = pool(&url).await;
                let ob = outbox(&pool, &support::unique("obx")).await;
                let orders = orders_table(&pool).await;

                pay(&pool, &ob, &orders, "o-1", false).await;
                assert_eq!(order_count(&pool, &orders).await, 0);
                assert_eq!(ob.counts().await.unwrap().pending, 0, "rolled back: no message");

                let e = pay(&pool, &ob, &orders, "o-2", true).await;
                assert_eq!(e.dedup_key, "pay-o-2");
                assert_eq!(order_count(&pool, &orders).await, 1);
                assert_eq!(ob.counts().await.unwrap().pending, 1);

                // A message without a dedup key gets a generated one, kept on the row.
                let mut tx = pool.begin().await.unwrap();
                let gen = ob
                    .enqueue(&mut tx, OutgoingMessage::new("audit", "x"))
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
                assert_eq!(gen.dedup_key.len(), 36, "{}", gen.dedup_key);
                let stored = ob.entry(gen.id).await.unwrap().unwrap();
                assert_eq!(stored.message.dedup_key.as_deref(), Some(gen.dedup_key.as_str()));

                let broker = MemoryBroker::new();
                let report = ob.relay(broker.clone()).drain().await.unwrap();
                assert_eq!((report.claimed, report.sent), (2, 2), "{report:?}");
                let got = take_all(&broker).await;
                assert_eq!(got.len(), 2);
                let pay_msg = got.iter().find(|e| e.source.name == "payments").unwrap();
                assert_eq!(pay_msg.headers.get_str(DEDUP_HEADER), Some("pay-o-2"));
                assert_eq!(pay_msg.headers.get_str("trace"), Some("t-1"));
                assert_eq!(pay_msg.headers.get("bin").map(|b| b.to_vec()), Some(vec![0u8, 255]));
                assert_eq!(pay_msg.key.as_deref(), Some(&b"o-2"[..]));
                assert_eq!(&pay_msg.payload[..], br#"{"order":"o-2"}"#);
                let audit = got.iter().find(|e| e.source.name == "audit").unwrap();
                assert_eq!(audit.headers.get_str(DEDUP_HEADER), Some(gen.dedup_key.as_str()));

                let row = ob.entry(e.id).await.unwrap().unwrap();
                assert_eq!((row.status, row.attempts), (OutboxStatus::Sent, 1));
                assert_eq!(ob.relay(broker.clone()).drain().await.unwrap().claimed, 0);
                assert_eq!(broker.published(), 2, "sent rows are not published again");
            }

            /// The crashing child's work (`spec` is `CHILD_ENV`'s value): commits an order
            /// and its message; its caller then exits the process before any relay runs.
            async fn child_enqueue(spec: &str) {
                let parts: Vec<&str> = spec.split('|').collect();
                assert!(
                    parts.len() == 4 && parts[0] == BACKEND,
                    "{CHILD_ENV}={spec:?} is not `{BACKEND}|<url>|<outbox table>|<orders table>`"
                );
                let pool = pool(parts[1]).await;
                let ob = outbox(&pool, parts[2]).await;
                pay(&pool, &ob, parts[3], "o-crash", true).await;
            }

            #[tokio::test]
            async fn a_crash_between_commit_and_relay_publishes_once_after_restart() {
                // Re-run by itself below as the crashing child: a separate process, so the
                // child's exit is a real one and no separate test passes by doing nothing.
                if let Ok(spec) = std::env::var(CHILD_ENV) {
                    child_enqueue(&spec).await;
                    // Committed; the relay never runs: the process dies here.
                    std::process::exit(CHILD_EXIT);
                }
                let Some((_dir, url)) = server().await else { return };
                let pool = pool(&url).await;
                let table = support::unique("obx");
                let ob = outbox(&pool, &table).await;
                let orders = orders_table(&pool).await;

                let module = module_path!().split_once("::").map_or("", |(_, m)| m).to_owned();
                let status = std::process::Command::new(std::env::current_exe().unwrap())
                    .args([
                        &format!("{module}::a_crash_between_commit_and_relay_publishes_once_after_restart"),
                        "--exact",
                        "--nocapture",
                        "--test-threads=1",
                    ])
                    .env(CHILD_ENV, format!("{BACKEND}|{url}|{table}|{orders}"))
                    .status()
                    .expect("spawn child");
                assert_eq!(status.code(), Some(CHILD_EXIT), "the child must die after its commit");
                assert_eq!(order_count(&pool, &orders).await, 1, "the child's effect committed");
                assert_eq!(ob.counts().await.unwrap().pending, 1, "its message waits in the outbox");

                // "Restart": a relay in this process.
                let broker = MemoryBroker::new();
                let relay = ob.relay(broker.clone());
                assert_eq!(relay.drain().await.unwrap().sent, 1);
                assert_eq!(relay.drain().await.unwrap().claimed, 0);
                assert_eq!(broker.published(), 1, "published exactly once");
                let (effects, dups) = consume(&broker, dedup_store(&url).await).await;
                assert_eq!(effects.get("pay-o-crash"), Some(&1));
                assert_eq!(dups, 0);
            }

            #[tokio::test]
            async fn a_relay_dying_after_publish_republishes_with_the_same_key_and_the_consumer_applies_once() {
                let Some((_dir, url)) = server().await else { return };
                let pool = pool(&url).await;
                let ob = outbox(&pool, &support::unique("obx")).await;
                let orders = orders_table(&pool).await;
                let e = pay(&pool, &ob, &orders, "o-7", true).await;

                let broker = MemoryBroker::new();
                let lease = Duration::from_millis(300);
                let dying = OutboxRelay::new(
                    ob.clone(),
                    PublishThenHang(broker.clone()),
                    RelayOptions { lease, ..Default::default() },
                );
                let task = tokio::spawn(async move { dying.relay_once().await });
                while broker.published() < 1 {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                task.abort(); // the relay dies: published, never marked
                let _ = task.await;
                let row = ob.entry(e.id).await.unwrap().unwrap();
                assert_eq!(row.status, OutboxStatus::Pending);

                // Within the lease nobody republishes; after it, the next relay does.
                assert_eq!(ob.relay(broker.clone()).drain().await.unwrap().claimed, 0);
                tokio::time::sleep(lease + Duration::from_millis(100)).await;
                assert_eq!(ob.relay(broker.clone()).drain().await.unwrap().sent, 1);
                let row = ob.entry(e.id).await.unwrap().unwrap();
                assert_eq!((row.status, row.attempts), (OutboxStatus::Sent, 2));

                assert_eq!(broker.published(), 2, "published twice");
                let (effects, dups) = consume(&broker, dedup_store(&url).await).await;
                assert_eq!(effects.get("pay-o-7"), Some(&1), "applied once: {effects:?}");
                assert_eq!(dups, 1, "the resend was dropped");
            }

            #[tokio::test]
            async fn a_rejected_message_stays_failed_with_its_error_and_holds_back_its_lane() {
                let Some((_dir, url)) = server().await else { return };
                let pool = pool(&url).await;
                let ob = outbox(&pool, &support::unique("obx")).await;
                let mut tx = pool.begin().await.unwrap();
                let bad = ob
                    .enqueue(&mut tx, OutgoingMessage::new("bad", "big").with_ordering_key("acct-1"))
                    .await
                    .unwrap();
                let behind = ob
                    .enqueue(&mut tx, OutgoingMessage::new("bad", "next").with_ordering_key("acct-1"))
                    .await
                    .unwrap();
                let other = ob
                    .enqueue(&mut tx, OutgoingMessage::new("good", "fine").with_ordering_key("acct-2"))
                    .await
                    .unwrap();
                tx.commit().await.unwrap();

                let broker = MemoryBroker::new();
                let relay = OutboxRelay::new(ob.clone(), RejectBad(broker.clone()), RelayOptions::default());
                let r = relay.drain().await.unwrap();
                assert_eq!((r.sent, r.failed), (1, 1), "{r:?}");
                let row = ob.entry(bad.id).await.unwrap().unwrap();
                assert_eq!((row.status, row.attempts), (OutboxStatus::Failed, 1));
                assert!(
                    row.last_error.as_deref().unwrap_or("").contains("message too large"),
                    "{:?}",
                    row.last_error
                );
                let failed = ob.list(OutboxStatus::Failed, 0, 10).await.unwrap();
                assert_eq!(failed.iter().map(|e| e.id).collect::<Vec<_>>(), vec![bad.id]);
                let held = ob.entry(behind.id).await.unwrap().unwrap();
                assert_eq!((held.status, held.attempts), (OutboxStatus::Pending, 0), "held back, not attempted");
                assert_eq!(ob.entry(other.id).await.unwrap().unwrap().status, OutboxStatus::Sent);
                assert_eq!(broker.published(), 1);

                // The operator fixes the cause and retries: the lane goes out in order.
                assert!(ob.retry_failed(bad.id).await.unwrap());
                assert!(!ob.retry_failed(bad.id).await.unwrap(), "no longer failed");
                let r = ob.relay(broker.clone()).drain().await.unwrap();
                assert_eq!(r.sent, 2, "{r:?}");
                let got = take_all(&broker).await;
                let lane: Vec<&[u8]> = got
                    .iter()
                    .filter(|e| e.source.name == "bad")
                    .map(|e| &e.payload[..])
                    .collect();
                assert_eq!(lane, vec![&b"big"[..], &b"next"[..]]);
                assert_eq!(ob.entry(bad.id).await.unwrap().unwrap().attempts, 2);
            }

            #[tokio::test]
            async fn a_retryable_error_backs_off_then_the_message_goes_out() {
                let Some((_dir, url)) = server().await else { return };
                let pool = pool(&url).await;
                let ob = outbox(&pool, &support::unique("obx")).await;
                let mut tx = pool.begin().await.unwrap();
                let e = ob.enqueue(&mut tx, OutgoingMessage::new("t", "m")).await.unwrap();
                tx.commit().await.unwrap();

                let broker = MemoryBroker::new();
                let relay = OutboxRelay::new(
                    ob.clone(),
                    FlakyFirst(broker.clone(), AtomicU32::new(2)),
                    RelayOptions {
                        retry: RetryPolicy::fixed(Duration::from_millis(200)),
                        ..Default::default()
                    },
                );
                assert_eq!(relay.drain().await.unwrap().retried, 1);
                let row = ob.entry(e.id).await.unwrap().unwrap();
                assert_eq!(row.status, OutboxStatus::Pending);
                assert!(row.last_error.as_deref().unwrap_or("").contains("unreachable"), "{row:?}");
                assert!(row.available_ms > idemq_core::now_ms(), "backing off");
                assert_eq!(relay.drain().await.unwrap().claimed, 0, "not before its delay");

                let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
                let ob2 = ob.clone();
                let run = tokio::spawn(async move {
                    relay.run(async { let _ = stopped.await; }).await
                });
                let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
                while ob2.entry(e.id).await.unwrap().unwrap().status != OutboxStatus::Sent {
                    assert!(tokio::time::Instant::now() < deadline, "never sent");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                let _ = stop.send(());
                run.await.unwrap().unwrap();
                let row = ob.entry(e.id).await.unwrap().unwrap();
                assert_eq!((row.attempts, row.last_error), (3, None));
                assert_eq!(broker.published(), 1);
            }

            #[tokio::test]
            async fn three_relays_keep_each_ordering_keys_order_and_publish_each_message_once() {
                let Some((_dir, url)) = server().await else { return };
                let pool = pool(&url).await;
                let ob = outbox(&pool, &support::unique("obx")).await;
                const KEYS: usize = 5;
                const PER_KEY: usize = 40;
                let mut tx = pool.begin().await.unwrap();
                for v in 0..PER_KEY {
                    for k in 0..KEYS {
                        let msg = OutgoingMessage::new("ledger", format!("{v}"))
                            .with_ordering_key(format!("acct-{k}"))
                            .with_dedup_key(format!("acct-{k}-v{v}"));
                        ob.enqueue(&mut tx, msg).await.unwrap();
                    }
                    // Unordered traffic in between.
                    ob.enqueue(&mut tx, OutgoingMessage::new("audit", format!("{v}"))).await.unwrap();
                }
                tx.commit().await.unwrap();

                let broker = MemoryBroker::new();
                let (stop, _) = tokio::sync::watch::channel(false);
                let mut tasks = Vec::new();
                for _ in 0..3 {
                    let relay = OutboxRelay::new(
                        ob.clone(),
                        Jittery(broker.clone()),
                        RelayOptions {
                            batch: 7,
                            poll_interval: Duration::from_millis(5),
                            ..Default::default()
                        },
                    );
                    let mut rx = stop.subscribe();
                    tasks.push(tokio::spawn(async move {
                        relay.run(async move { let _ = rx.changed().await; }).await
                    }));
                }
                let total = (KEYS * PER_KEY + PER_KEY) as u64;
                let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
                while ob.counts().await.unwrap().sent < total {
                    assert!(tokio::time::Instant::now() < deadline, "relays stalled: {:?}", ob.counts().await);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                let _ = stop.send(true);
                for t in tasks {
                    t.await.unwrap().unwrap();
                }
                assert_eq!(broker.published(), total, "each message published once");
                let mut per_key: HashMap<Vec<u8>, Vec<usize>> = HashMap::new();
                for e in take_all(&broker).await {
                    if let Some(k) = &e.ordering_key {
                        let v: usize = std::str::from_utf8(&e.payload).unwrap().parse().unwrap();
                        per_key.entry(k.to_vec()).or_default().push(v);
                    }
                }
                assert_eq!(per_key.len(), KEYS);
                for (k, vs) in per_key {
                    assert_eq!(vs, (0..PER_KEY).collect::<Vec<_>>(), "order of {:?}", String::from_utf8_lossy(&k));
                }
            }

            #[tokio::test]
            async fn purge_removes_only_old_sent_rows() {
                let Some((_dir, url)) = server().await else { return };
                let pool = pool(&url).await;
                let ob = outbox(&pool, &support::unique("obx")).await;
                let mut tx = pool.begin().await.unwrap();
                ob.enqueue(&mut tx, OutgoingMessage::new("t", "sent")).await.unwrap();
                ob.enqueue(&mut tx, OutgoingMessage::new("bad", "failed")).await.unwrap();
                tx.commit().await.unwrap();
                let broker = MemoryBroker::new();
                OutboxRelay::new(ob.clone(), RejectBad(broker.clone()), RelayOptions::default())
                    .drain()
                    .await
                    .unwrap();
                let mut tx = pool.begin().await.unwrap();
                ob.enqueue(&mut tx, OutgoingMessage::new("t", "pending")).await.unwrap();
                tx.commit().await.unwrap();
                assert_eq!(ob.purge_sent_older_than(Duration::from_secs(3600), 100).await.unwrap(), 0);
                tokio::time::sleep(Duration::from_millis(20)).await;
                assert_eq!(ob.purge_sent_older_than(Duration::from_millis(5), 100).await.unwrap(), 1);
                let c = ob.counts().await.unwrap();
                assert_eq!((c.pending, c.sent, c.failed), (1, 0, 1));
            }

            #[tokio::test]
            async fn hostile_and_oversize_table_names_are_refused() {
                assert!(TableName::new("obx; DROP TABLE users").is_err());
                let Some((_dir, url)) = server().await else { return };
                let pool = pool(&url).await;
                let long = TableName::new(&"o".repeat(idemq_sql::MAX_OUTBOX_TABLE_LEN + 1)).unwrap();
                let err = Outbox::<Db>::from_pool(pool.clone(), OutboxOptions::with_table(long))
                    .await
                    .unwrap_err();
                assert!(matches!(err, OutboxError::Config(_)), "{err}");
                // A dedup table is not an outbox.
                let dedup = support::unique("obx_dedup");
                <$store>::from_pool(pool.clone(), support::options(&dedup, 2)).await.unwrap();
                let err = Outbox::<Db>::from_pool(
                    pool.clone(),
                    OutboxOptions::with_table(TableName::new(&dedup).unwrap()),
                )
                .await
                .unwrap_err();
                assert!(err.to_string().contains("not an idemq outbox table"), "{err}");
                let ob = outbox(&pool, &support::unique("obx")).await;
                let mut tx = pool.begin().await.unwrap();
                let err = ob.enqueue(&mut tx, OutgoingMessage::new("", "x")).await.unwrap_err();
                assert!(matches!(err, OutboxError::InvalidMessage(_)), "{err}");
                let err = ob
                    .enqueue(&mut tx, OutgoingMessage::new("t", "x").with_dedup_key("k".repeat(2000)))
                    .await
                    .unwrap_err();
                assert!(matches!(err, OutboxError::InvalidMessage(_)), "{err}");
            }
        }
    };
}

outbox_suite!(
    sqlite,
    "sqlite",
    idemq_sql::sqlx::Sqlite,
    idemq_sql::SqliteStore,
    {
        let dir = support::TempDir::new();
        let url = dir.sqlite_url("outbox.db");
        Some((Some(dir), url))
    }
);

outbox_suite!(
    postgres,
    "postgres",
    idemq_sql::sqlx::Postgres,
    idemq_sql::PgStore,
    { support::postgres_url().map(|u| (None, u)) }
);

outbox_suite!(
    mysql,
    "mysql",
    idemq_sql::sqlx::MySql,
    idemq_sql::MySqlStore,
    { support::mysql_url().map(|u| (None, u)) }
);
