//! Transactions whose COMMIT reached the database but whose reply did not reach the consumer.
//!
//! The store's connections go through [`ReplyCutProxy`], which lets one `COMMIT` through,
//! waits for PostgreSQL's answer (so the transaction is committed) and then resets the
//! connection or swallows the answer. The consumer sees an error or a timeout although its
//! effects are in: every path that retries after it must not write them again. The effect
//! here is a ledger row with no unique constraint, so a repeat shows as a second row.

mod support;

use idemq_core::broker::MemoryBroker;
use idemq_core::testkit::reply_cut::{ReplyCutProxy, ReplyFault};
use idemq_core::{
    BrokerKind, ClaimedMessage, ConsumerConfig, DedupStore, Envelope, HandlerError,
    IdempotentConsumer, KeyStrategy,
};
use idemq_sql::{sqlx, PgStore, SqlResultExt};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// PostgreSQL's simple-query COMMIT as sqlx sends it (the message body, NUL-terminated).
const COMMIT: &[u8] = b"COMMIT\0";
const MESSAGES: usize = 40;

/// A store whose connections pass through a fresh proxy, on its own dedup table.
async fn store_behind_proxy(url: &str) -> (ReplyCutProxy, PgStore) {
    let rest = url.split("://").nth(1).expect("url has a scheme");
    let after_at = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
    let host_port = after_at.split('/').next().expect("host:port");
    let proxy = ReplyCutProxy::start(host_port).await.expect("proxy");
    let proxied = url.replacen(host_port, &proxy.addr().to_string(), 1);
    let store = PgStore::connect(
        &proxied,
        support::options(&support::unique("lost_reply"), 8),
    )
    .await
    .expect("connect through the proxy");
    (proxy, store)
}

async fn ledger(store: &PgStore) -> String {
    let t = support::unique("ledger");
    sqlx::query(&format!(
        "CREATE TABLE {t} (payment_id TEXT NOT NULL, amount BIGINT NOT NULL)"
    ))
    .execute(store.pool())
    .await
    .expect("ledger table");
    t
}

/// Rows per payment in the ledger.
async fn rows_per_payment(store: &PgStore, table: &str) -> HashMap<String, i64> {
    let rows: Vec<(String, i64)> = sqlx::query_as(&format!(
        "SELECT payment_id, COUNT(*) FROM {table} GROUP BY payment_id"
    ))
    .fetch_all(store.pool())
    .await
    .expect("ledger rows");
    rows.into_iter().collect()
}

fn payments() -> MemoryBroker {
    let broker = MemoryBroker::new();
    for i in 0..MESSAGES {
        broker.publish(Envelope::new(
            BrokerKind::MEMORY,
            "payments",
            format!(r#"{{"payment_id":"pay-{i}","amount":{}}}"#, 1 + i % 7),
        ));
    }
    broker
}

#[derive(serde::Deserialize)]
struct Payment {
    payment_id: String,
    amount: i64,
}

/// Inserts the batch's ledger rows; the first call with more than one message arms the
/// proxy, so that call's COMMIT is the one whose reply is lost.
async fn write_rows(
    tx: &mut sqlx::PgConnection,
    msgs: &[ClaimedMessage],
    table: &str,
    arm: &(Arc<ReplyCutProxy>, ReplyFault, Arc<AtomicBool>),
) -> Result<(), HandlerError> {
    for m in msgs {
        let p: Payment = m.json()?;
        sqlx::query(&format!(
            "INSERT INTO {table} (payment_id, amount) VALUES ($1, $2)"
        ))
        .bind(p.payment_id)
        .bind(p.amount)
        .execute(&mut *tx)
        .await
        .classify()?;
    }
    let (proxy, fault, armed) = arm;
    if msgs.len() > 1 && !armed.swap(true, Ordering::SeqCst) {
        proxy.arm(COMMIT, 1, *fault);
    }
    Ok(())
}

/// One run of a batch-handler consumer over `store` (or its unique index) with a lost COMMIT
/// reply; asserts every payment is in the ledger once and acked.
async fn batch_commit_reply_lost(fault: ReplyFault, unique_index: bool) {
    let Some(url) = support::postgres_url() else {
        return;
    };
    let (proxy, store) = store_behind_proxy(&url).await;
    let proxy = Arc::new(proxy);
    let table = ledger(&store).await;
    let arm = Arc::new((proxy.clone(), fault, Arc::new(AtomicBool::new(false))));
    let handler = {
        let table = table.clone();
        store.batch_handler(move |tx, msgs| {
            let table = table.clone();
            let arm = arm.clone();
            Box::pin(async move { write_rows(tx, msgs, &table, &arm).await })
        })
    };
    let keys = KeyStrategy::json_pointer(&support::unique("lost"), "/payment_id").expect("keys");
    let dedup: Arc<dyn DedupStore> = match unique_index {
        true => Arc::new(store.unique_index()),
        false => Arc::new(store.clone()),
    };
    let cfg = ConsumerConfig {
        max_batch: 16,
        // A swallowed reply leaves the commit hanging: the timeout cuts the handler off
        // after its COMMIT went out.
        handler_timeout: Some(Duration::from_secs(3)),
        redelivery_delay: Duration::from_millis(50),
        ..ConsumerConfig::default()
    };
    let consumer = IdempotentConsumer::new(dedup, keys, handler).with_config(cfg);
    let broker = payments();
    tokio::time::timeout(
        Duration::from_secs(120),
        consumer.run_until_idle(&mut broker.subscribe()),
    )
    .await
    .expect("the run ends")
    .expect("run");
    assert_eq!(proxy.cuts(), 1, "exactly one COMMIT reply was lost");
    let stats = consumer.stats();
    assert!(
        stats.batch_splits >= 1,
        "the lost reply failed a batch: {stats:?}"
    );
    let rows = rows_per_payment(&store, &table).await;
    let twice: Vec<_> = rows.iter().filter(|(_, n)| **n != 1).collect();
    assert!(
        twice.is_empty(),
        "payments applied more than once after a lost COMMIT reply: {twice:?}"
    );
    assert_eq!(rows.len(), MESSAGES, "every payment applied");
    assert_eq!(broker.pending(), 0, "every message settled");
    assert_eq!(broker.acked(), MESSAGES as u64, "every message acked");
    assert!(
        broker.dead_letters().is_empty(),
        "{:?}",
        broker.dead_letters()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lease_batch_whose_commit_reply_is_reset_is_applied_once() {
    batch_commit_reply_lost(ReplyFault::Reset, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lease_batch_cut_off_after_its_commit_went_out_is_applied_once() {
    batch_commit_reply_lost(ReplyFault::Swallow, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_unique_index_batch_whose_commit_reply_is_reset_is_applied_once() {
    batch_commit_reply_lost(ReplyFault::Reset, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_unique_index_batch_cut_off_after_its_commit_went_out_is_applied_once() {
    batch_commit_reply_lost(ReplyFault::Swallow, true).await;
}

/// The per-message transaction (`begin_for` … `commit`): its COMMIT reply lost, the handler
/// fails, and the retry must find the message done instead of writing it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_message_transaction_whose_commit_reply_is_reset_is_applied_once() {
    let Some(url) = support::postgres_url() else {
        return;
    };
    let (proxy, store) = store_behind_proxy(&url).await;
    let proxy = Arc::new(proxy);
    let table = ledger(&store).await;
    let armed = Arc::new(AtomicBool::new(false));
    let handler = {
        let (store, table, proxy) = (store.clone(), table.clone(), proxy.clone());
        move |msg: ClaimedMessage| {
            let (store, table, proxy, armed) =
                (store.clone(), table.clone(), proxy.clone(), armed.clone());
            async move {
                let p: Payment = msg.json()?;
                let mut tx = store.begin_for(&msg).await?;
                sqlx::query(&format!(
                    "INSERT INTO {table} (payment_id, amount) VALUES ($1, $2)"
                ))
                .bind(p.payment_id)
                .bind(p.amount)
                .execute(&mut *tx)
                .await
                .classify()?;
                if !armed.swap(true, Ordering::SeqCst) {
                    proxy.arm(COMMIT, 1, ReplyFault::Reset);
                }
                tx.commit().await
            }
        }
    };
    let keys = KeyStrategy::json_pointer(&support::unique("lost1"), "/payment_id").expect("keys");
    let cfg = ConsumerConfig {
        redelivery_delay: Duration::from_millis(50),
        ..ConsumerConfig::default()
    };
    let consumer = IdempotentConsumer::new(Arc::new(store.clone()), keys, handler).with_config(cfg);
    let broker = payments();
    tokio::time::timeout(
        Duration::from_secs(120),
        consumer.run_until_idle(&mut broker.subscribe()),
    )
    .await
    .expect("the run ends")
    .expect("run");
    assert_eq!(proxy.cuts(), 1, "exactly one COMMIT reply was lost");
    let rows = rows_per_payment(&store, &table).await;
    assert!(rows.values().all(|n| *n == 1), "applied twice: {rows:?}");
    assert_eq!(rows.len(), MESSAGES, "every payment applied");
    assert_eq!(broker.acked(), MESSAGES as u64, "every message acked");
    assert!(
        broker.dead_letters().is_empty(),
        "{:?}",
        broker.dead_letters()
    );
}
