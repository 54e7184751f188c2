#![recursion_limit = "512"]
//! Real process kills on the real (rocketmq-rust) broker, with the dedup records and the
//! business rows in PostgreSQL (they outlive the processes).
//!
//! - A payment consumer **process** (this test binary re-run as a child) is SIGKILLed three
//!   times at random points while it pays 300 callbacks (a quarter of them sent twice by the
//!   producer); each payment commits its ledger row and its dedup record in one transaction.
//!   The ledger has **no unique constraint**: at the end every payment is in it exactly once.
//! - A transactional **producer process** is SIGKILLed after its local transaction committed
//!   (before it could tell the broker); another is killed holding its claim, before its
//!   local commit. The restarted producer's check-back answers from the store: the first
//!   half message is committed and applied once by the order service (an idempotent
//!   consumer), the second is rolled back and never delivered. The rocketmq-rust broker
//!   sometimes commits a checked-back half message twice (two check-backs answered COMMIT:
//!   two deliveries of one UNIQ_KEY); the test allows that and requires one effect.

mod support;

use idemq_core::engine::{ConsumerConfig, RetryPolicy};
use idemq_core::publish::{OutgoingMessage, Publisher};
use idemq_core::store::{ClaimOutcome, ClaimRequest, DedupStore, RecordStatus};
use idemq_core::testkit::process::{child_role, ChildProcess};
use idemq_core::{
    ClaimedMessage, CompleteOutcome, DedupKey, HandlerError, IdempotentConsumer, KeyStrategy,
    MemoryStore,
};
use idemq_rocketmq::{LocalOutcome, RocketSourceConfig, StoreCheckBack, TransactionalPublisher};
use idemq_sql::{sqlx, PgStore, SqlResultExt, SqlStoreOptions};
use rand::Rng;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use support::wait_until;
use tokio::time::Instant;

const CONSUMER_ROLE: &str = "IDEMQ_ROCKETMQ_CRASH_CONSUMER";
const PRODUCER_ROLE: &str = "IDEMQ_ROCKETMQ_CRASH_PRODUCER";

async fn pg_store(url: &str) -> PgStore {
    PgStore::connect(url, SqlStoreOptions::default())
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL store at {url}: {e}"))
}

async fn scalar(store: &PgStore, sql: &str) -> i64 {
    let (n,): (i64,) = sqlx::query_as(sql)
        .fetch_one(store.pool())
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    n
}

async fn execute(store: &PgStore, sql: &str) {
    sqlx::query(sql)
        .execute(store.pool())
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// The consumer child: pays every callback of `topic` as a member of `group`, each payment's
/// ledger row and dedup record in one transaction; runs until killed.
async fn payment_consumer(arg: &str) {
    let [topic, group, ledger]: [&str; 3] = arg
        .split('|')
        .collect::<Vec<_>>()
        .try_into()
        .unwrap_or_else(|_| panic!("bad {CONSUMER_ROLE}: {arg}"));
    let ns = support::namesrv().expect("name server");
    let url = support::postgres_url().expect("PostgreSQL");
    let store = pg_store(&url).await;
    let db = store.clone();
    let insert = format!("INSERT INTO {ledger} (payment_id, pid) VALUES ($1, $2)");
    let handler = move |m: ClaimedMessage| {
        let (db, insert) = (db.clone(), insert.clone());
        async move {
            let payment = support::dedup_key_of(&m.envelope);
            let mut tx = db.begin_for(&m).await?;
            sqlx::query(&insert)
                .bind(payment)
                .bind(i64::from(std::process::id()))
                .execute(&mut *tx)
                .await
                .classify()?;
            // A window between the effect and the commit, for the kill to land in.
            tokio::time::sleep(Duration::from_millis(3)).await;
            tx.commit().await
        }
    };
    let consumer = IdempotentConsumer::new(
        Arc::new(store),
        KeyStrategy::dedup_header(group).expect("group"),
        handler,
    )
    .with_config(ConsumerConfig {
        max_batch: 32,
        lease: Duration::from_secs(3),
        retry: RetryPolicy::fixed(Duration::from_millis(200)),
        ..ConsumerConfig::default()
    });
    let mut src = support::source(RocketSourceConfig::new(&ns, group, topic)).await;
    eprintln!("child {} consuming {topic}", std::process::id());
    let r = consumer.run(&mut src, std::future::pending()).await;
    panic!("the consumer stopped: {r:?}");
}

/// Seed 000 with real crashes: 300 callbacks (every fourth sent twice), a consumer process
/// SIGKILLed three times mid-batch, a fourth finishing: one ledger row per payment.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_consumer_process_killed_mid_batch_pays_each_key_once() {
    if let Some(arg) = child_role(CONSUMER_ROLE) {
        payment_consumer(&arg).await;
        return;
    }
    let Some(ns) = support::namesrv() else { return };
    let Some(url) = support::postgres_url() else {
        return;
    };
    const PAYMENTS: usize = 300;
    const KILLS: usize = 3;
    let topic = support::unique("paykill");
    let group = support::unique("paykillcg");
    let ledger = support::unique("ledger");
    let store = pg_store(&url).await;
    // No unique constraint: a second payment of a key would be a second row.
    execute(
        &store,
        &format!("CREATE TABLE {ledger} (payment_id TEXT NOT NULL, pid BIGINT NOT NULL)"),
    )
    .await;
    let publisher = support::publisher(&ns).await;
    let mut sent = 0;
    for i in 0..PAYMENTS {
        let copies = match i % 4 {
            0 => 2,
            _ => 1,
        };
        for _ in 0..copies {
            let m = OutgoingMessage::new(
                &topic,
                format!("{{\"payment_id\":\"pay-{i:04}\",\"amount_cents\":1999}}"),
            )
            .with_dedup_key(format!("pay-{i:04}"));
            publisher.publish(m).await.expect("SEND_OK");
            sent += 1;
        }
    }
    let arg = format!("{topic}|{group}|{ledger}");
    let test = "a_consumer_process_killed_mid_batch_pays_each_key_once";
    let rows = format!("SELECT count(*) FROM {ledger}");
    let mut tails = Vec::new();
    for kill in 0..KILLS {
        let mut child = ChildProcess::spawn_self(test, CONSUMER_ROLE, &arg).expect("spawn");
        // Somewhere in the (kill+1)-th quarter of the payments.
        let target =
            (PAYMENTS * (kill + 1) / 4 + rand::thread_rng().gen_range(0..PAYMENTS / 8)) as i64;
        let deadline = Instant::now() + Duration::from_secs(120);
        let mut paid = scalar(&store, &rows).await;
        while paid < target && Instant::now() < deadline {
            if let Ok(Some(status)) = child.try_wait() {
                panic!("child exited ({status}):\n{}", child.stderr_tail(4000));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
            paid = scalar(&store, &rows).await;
        }
        assert!(
            paid >= target,
            "kill {kill}: only {paid} of {target} payments within 120 s:\n{}",
            child.stderr_tail(4000)
        );
        tokio::time::sleep(Duration::from_millis(rand::thread_rng().gen_range(0..30))).await;
        child.kill().expect("SIGKILL");
        eprintln!("kill {kill}: SIGKILLed after {paid} payments");
        tails.push(child.stderr_tail(1500));
    }
    let mut last = ChildProcess::spawn_self(test, CONSUMER_ROLE, &arg).expect("spawn");
    let distinct = format!("SELECT count(DISTINCT payment_id) FROM {ledger}");
    let deadline = Instant::now() + Duration::from_secs(240);
    while scalar(&store, &distinct).await < PAYMENTS as i64 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    // Redeliveries of what the killed children held come back for a while (10 s, 30 s).
    tokio::time::sleep(Duration::from_secs(5)).await;
    let tail = last.stderr_tail(4000);
    last.kill().expect("SIGKILL");
    let total = scalar(&store, &rows).await;
    let paid = scalar(&store, &distinct).await;
    let doubles = scalar(
        &store,
        &format!(
            "SELECT count(*) FROM (SELECT payment_id FROM {ledger} GROUP BY payment_id \
             HAVING count(*) > 1) d"
        ),
    )
    .await;
    execute(&store, &format!("DROP TABLE {ledger}")).await;
    assert!(
        paid == PAYMENTS as i64 && total == PAYMENTS as i64 && doubles == 0,
        "{sent} messages for {PAYMENTS} payments, {KILLS} kills: {paid} paid, {total} ledger \
         rows, {doubles} paid twice\nlast child:\n{tail}\nkilled children:\n{}",
        tails.join("\n---\n")
    );
}

/// The producer child: sends one half message of `key` whose local transaction claims the
/// key, and (`after-commit`) commits the order row and the dedup record, or
/// (`before-commit`) does not; then it hangs (the parent kills it), so the broker never
/// hears the outcome.
async fn order_producer(arg: &str) {
    let [topic, producer_group, orders, key_group, key, mode]: [&str; 6] = arg
        .split('|')
        .collect::<Vec<_>>()
        .try_into()
        .unwrap_or_else(|_| panic!("bad {PRODUCER_ROLE}: {arg}"));
    let ns = support::namesrv().expect("name server");
    let url = support::postgres_url().expect("PostgreSQL");
    let store = pg_store(&url).await;
    let check = StoreCheckBack::new(Arc::new(store.clone()), key_group).expect("check-back");
    let tx = TransactionalPublisher::connect(&ns, producer_group, vec![topic.to_string()], check)
        .await
        .expect("transactional producer");
    let dedup = DedupKey::new(
        &idemq_core::ConsumerGroup::new(key_group).expect("group"),
        key,
    )
    .expect("key");
    let (insert, commit) = (
        format!("INSERT INTO {orders} (order_id) VALUES ($1)"),
        mode == "after-commit",
    );
    let order = key.to_string();
    let local = async move {
        let lease = match store
            .claim(&ClaimRequest::new(dedup.clone(), Duration::from_secs(8)))
            .await
        {
            Ok(ClaimOutcome::Acquired(l)) => l,
            other => panic!("claim: {other:?}"),
        };
        if commit {
            let mut t = store.pool().begin().await.expect("begin");
            sqlx::query(&insert)
                .bind(&order)
                .execute(&mut *t)
                .await
                .expect("order row");
            let done = store
                .complete_in_tx(
                    &mut *t,
                    &dedup,
                    lease.token,
                    None,
                    Duration::from_secs(3600),
                )
                .await
                .expect("complete");
            assert!(matches!(done, CompleteOutcome::Completed), "{done:?}");
            t.commit().await.expect("commit");
        }
        eprintln!("local transaction of {order} done (committed: {commit}); hanging");
        std::future::pending::<LocalOutcome>().await
    };
    let m = OutgoingMessage::new(topic, format!("{{\"order\":\"{key}\"}}")).with_dedup_key(key);
    let r = tx.send_in_transaction(m, local).await;
    eprintln!("send_in_transaction returned {r:?}; hanging");
    std::future::pending::<()>().await;
}

/// Transactional producers killed after / before their local commit: the check-back of
/// the restarted producer commits the first from the store (delivered once) and rolls the
/// second back once its claim expired (never delivered).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_producer_killed_after_its_local_commit_is_committed_by_the_check_back() {
    if let Some(arg) = child_role(PRODUCER_ROLE) {
        order_producer(&arg).await;
        return;
    }
    let Some(ns) = support::namesrv() else { return };
    let Some(url) = support::postgres_url() else {
        return;
    };
    let topic = support::unique("txkill");
    let producer_group = support::unique("txkillpg");
    let key_group = support::unique("orders");
    let orders = support::unique("orders");
    let store = pg_store(&url).await;
    execute(
        &store,
        &format!("CREATE TABLE {orders} (order_id TEXT NOT NULL)"),
    )
    .await;
    // The transactional producer sends to an existing route.
    support::publisher(&ns)
        .await
        .publish(OutgoingMessage::new(&topic, "warm-up").with_dedup_key("warm-up"))
        .await
        .expect("SEND_OK");
    let test = "a_producer_killed_after_its_local_commit_is_committed_by_the_check_back";
    let group = idemq_core::ConsumerGroup::new(&key_group).expect("group");
    let arg = |key: &str, mode: &str| {
        format!("{topic}|{producer_group}|{orders}|{key_group}|{key}|{mode}")
    };

    // Killed after its local commit: the order row and the completed record are there.
    let mut committed =
        ChildProcess::spawn_self(test, PRODUCER_ROLE, &arg("order-committed", "after-commit"))
            .expect("spawn");
    let rows = format!("SELECT count(*) FROM {orders} WHERE order_id = 'order-committed'");
    let deadline = Instant::now() + Duration::from_secs(60);
    while scalar(&store, &rows).await == 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        scalar(&store, &rows).await,
        1,
        "the local transaction committed within 60 s:\n{}",
        committed.stderr_tail(4000)
    );
    committed.kill().expect("SIGKILL");

    // Killed holding its claim, before its local commit.
    let mut uncommitted =
        ChildProcess::spawn_self(test, PRODUCER_ROLE, &arg("order-lost", "before-commit"))
            .expect("spawn");
    let lost = DedupKey::new(&group, "order-lost").expect("key");
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut claimed = false;
    while !claimed && Instant::now() < deadline {
        claimed = matches!(
            store.get(&lost).await,
            Ok(Some(r)) if r.status == RecordStatus::InProgress
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        claimed,
        "the second producer claimed its key within 60 s:\n{}",
        uncommitted.stderr_tail(4000)
    );
    uncommitted.kill().expect("SIGKILL");

    // The restarted producer (same producer group) answers the broker's check-backs.
    let check = StoreCheckBack::new(Arc::new(store.clone()), &key_group).expect("check-back");
    let restarted =
        TransactionalPublisher::connect(&ns, &producer_group, vec![topic.clone()], check)
            .await
            .expect("restarted producer");
    // The order service: an idempotent consumer. Every delivery passes the key strategy, so
    // it records what the broker sent (dedup key, UNIQ_KEY); the handler records effects.
    let raw: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
    let effects: Arc<Mutex<Vec<String>>> = Arc::default();
    let seen = raw.clone();
    let keys = KeyStrategy::custom("order-service", move |env| {
        let key = support::dedup_key_of(env);
        seen.lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((key.clone(), env.message_id.clone().unwrap_or_default()));
        Ok(key)
    })
    .expect("group");
    let applied = effects.clone();
    let consumer = IdempotentConsumer::new(
        Arc::new(MemoryStore::new()),
        keys,
        move |m: ClaimedMessage| {
            let applied = applied.clone();
            async move {
                applied
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(support::dedup_key_of(&m.envelope));
                Ok::<_, HandlerError>(None)
            }
        },
    );
    let src = support::source(RocketSourceConfig::new(
        &ns,
        support::unique("ordersvc"),
        &topic,
    ))
    .await;
    let (stop_tx, run) = support::run_until_stopped(consumer, src);
    let count = |list: &Mutex<Vec<String>>, k: &str| {
        list.lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|x| *x == k)
            .count()
    };
    let arrived = wait_until(Duration::from_secs(120), || {
        count(&effects, "order-committed") > 0
    })
    .await;
    // The lost one's claim (8 s) has expired by now or soon: its check-back rolls it back;
    // give a second check-back of the committed one time to show itself too.
    tokio::time::sleep(Duration::from_secs(20)).await;
    let _ = stop_tx.send(());
    let _ = run.await;
    let (once, never) = (
        count(&effects, "order-committed"),
        count(&effects, "order-lost"),
    );
    let raw = raw.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let copies: Vec<&String> = raw
        .iter()
        .filter(|(k, _)| k == "order-committed")
        .map(|(_, id)| id)
        .collect();
    eprintln!("broker deliveries of the committed order: {copies:?}");
    let orders_lost = scalar(
        &store,
        &format!("SELECT count(*) FROM {orders} WHERE order_id = 'order-lost'"),
    )
    .await;
    restarted.shutdown().await;
    execute(&store, &format!("DROP TABLE {orders}")).await;
    assert!(
        arrived,
        "the committed order's message arrived within 120 s"
    );
    assert_eq!(
        once, 1,
        "committed by the check-back, applied once: {raw:?}"
    );
    // The broker may commit a checked-back half message twice (two check-backs answered
    // COMMIT): both copies are the same message (one UNIQ_KEY), which dedup absorbs.
    assert!(
        copies.iter().all(|id| *id == copies[0]),
        "copies of the committed order are one message: {raw:?}"
    );
    assert_eq!(
        never, 0,
        "the uncommitted order's message is never delivered: {raw:?}"
    );
    assert!(
        raw.iter().all(|(k, _)| k != "order-lost"),
        "the uncommitted order's message is never delivered: {raw:?}"
    );
    assert_eq!(orders_lost, 0, "the uncommitted order has no row");
}
