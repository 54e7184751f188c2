//! Flow 1 (at-least-once + dedup store, the default) with real process kills, on the real
//! broker and PostgreSQL.
//!
//! A producer sends 2 000 payments on a 4-partition topic and resends 377 of them at
//! new offsets (before, between and after the crashes). A consumer **process** (this test
//! binary re-run as a child) applies each payment as a row of a ledger table **without a
//! unique constraint**, in the same database transaction as its dedup record
//! (`complete_in_tx`), then returns to the engine, which acks, and the source commits Kafka
//! offsets. The parent SIGKILLs children:
//!
//! 1. one stopped right **between effect and commit**: the handler's transaction (ledger row
//!    and dedup record) has committed, the handler has not returned, so neither the ack nor
//!    the Kafka offset commit happened — the record is redelivered after the restart;
//! 2. one killed at a random point of the run;
//! 3. a last one runs until the group's committed offsets reach the end of the topic.
//!
//! Then the ledger holds exactly one row per payment: the redelivered record and every
//! resent copy met a completed dedup record.

mod support;

use idemq_core::engine::{ConsumerConfig, RetryPolicy};
use idemq_core::publish::{OutgoingMessage, Publisher, DEDUP_HEADER};
use idemq_core::testkit::process::{child_role, ChildProcess};
use idemq_core::{ClaimedMessage, CompleteOutcome, HandlerError, IdempotentConsumer, KeyStrategy};
use idemq_kafka::KafkaSource;
use idemq_sql::{sqlx, PgStore, SqlResultExt, SqlStoreOptions, TableName};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

const ROLE: &str = "IDEMQ_KAFKA_FLOW1_CHILD";
const TEST: &str = "a_consumer_process_killed_between_effect_and_commit_applies_each_payment_once";
const N: usize = 2_000;
const PARTS: i32 = 4;

fn pg_url() -> Option<String> {
    idemq_core::testkit::servers::server_url("IDEMQ_TEST_POSTGRES_URL")
}

fn key(topic: &str, i: usize) -> String {
    format!("{topic}-pay-{i:05}")
}

async fn send(brokers: &str, topic: &str, idx: impl Iterator<Item = usize>) {
    let p = support::publisher(brokers).await;
    let msgs: Vec<OutgoingMessage> = idx
        .map(|i| {
            OutgoingMessage::new(topic, format!("{{\"payment\":{i},\"cents\":1999}}"))
                .with_key(format!("account-{}", i % 61))
                .with_dedup_key(key(topic, i))
        })
        .collect();
    for r in p.publish_batch(msgs).await {
        r.expect("publish");
    }
}

/// The child: consume with the PostgreSQL store; with `hang` = n > 0, stop forever right
/// after the n-th handled payment's ledger row and dedup record committed (before its
/// handler returns).
async fn child(arg: &str) -> ! {
    let f: Vec<&str> = arg.split('|').collect();
    let (brokers, topic, group, ledger, dedup, hang) = (f[0], f[1], f[2], f[3], f[4], f[5]);
    let url = pg_url().expect("postgres url");
    let store = PgStore::connect(
        &url,
        SqlStoreOptions::with_table(TableName::new(dedup).expect("table")),
    )
    .await
    .expect("store");
    let mut source = KafkaSource::connect(support::source_config(brokers, group, topic))
        .await
        .expect("source");
    let insert = format!("INSERT INTO {ledger} (payment, cents) VALUES ($1, 1999)");
    let hang: usize = hang.parse().unwrap_or(0);
    let handled = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let tx_store = store.clone();
    let consumer = IdempotentConsumer::new(
        Arc::new(store),
        KeyStrategy::dedup_header(group).expect("keys"),
        move |m: ClaimedMessage| {
            let (store, insert, handled) = (tx_store.clone(), insert.clone(), handled.clone());
            async move {
                let payment = m
                    .envelope
                    .headers
                    .get_str(DEDUP_HEADER)
                    .unwrap_or_default()
                    .to_string();
                let mut tx = store.pool().begin().await.classify()?;
                sqlx::query(&insert)
                    .bind(&payment)
                    .execute(&mut *tx)
                    .await
                    .classify()?;
                let done = store
                    .complete_in_tx(&mut tx, &m.key, m.token, None, m.retention)
                    .await?;
                match done {
                    CompleteOutcome::Completed => {}
                    // Committed by an earlier transaction of this claim: nothing to repeat.
                    CompleteOutcome::AlreadyCompleted => return Ok(None),
                    _ => return Err(HandlerError::retryable(std::io::Error::other("lease lost"))),
                }
                tx.commit().await.classify()?;
                if handled.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1 == hang {
                    // Effect and dedup record are durable; no ack, no offset commit yet.
                    eprintln!("EFFECT-COMMITTED {payment}");
                    std::future::pending::<()>().await;
                }
                Ok(None)
            }
        },
    )
    .with_config(ConsumerConfig {
        max_batch: 100,
        max_concurrency: 8,
        lease: Duration::from_secs(3),
        retry: RetryPolicy::fixed(Duration::from_millis(100)),
        in_flight_delay_max: Duration::from_millis(500),
        ..ConsumerConfig::default()
    });
    consumer
        .run(&mut source, std::future::pending())
        .await
        .expect("consumer run");
    std::process::exit(0)
}

async fn scalar(pool: &sqlx::PgPool, sql: &str) -> i64 {
    let (n,): (i64,) = sqlx::query_as(sql).fetch_one(pool).await.expect(sql);
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_process_killed_between_effect_and_commit_applies_each_payment_once() {
    if let Some(arg) = child_role(ROLE) {
        child(&arg).await;
    }
    let (Some(brokers), Some(url)) = (support::brokers(), pg_url()) else {
        return;
    };
    let topic = support::unique("flow1");
    let suffix = topic.replace('-', "_");
    let (ledger, dedup) = (format!("{suffix}_ledger"), format!("{suffix}_dd"));
    let group = format!("{topic}-g");
    let pool = sqlx::PgPool::connect(&url).await.expect("pg");
    sqlx::query(&format!(
        "CREATE TABLE {ledger} (id BIGSERIAL PRIMARY KEY, payment TEXT NOT NULL, cents BIGINT NOT NULL)"
    ))
    .execute(&pool)
    .await
    .expect("ledger table");
    support::create_topic(&brokers, &topic, PARTS).await;
    send(&brokers, &topic, 0..N).await;
    send(&brokers, &topic, (0..N).step_by(8)).await; // resent at new offsets
    let arg = |hang: &str| format!("{brokers}|{topic}|{group}|{ledger}|{dedup}|{hang}");
    let count = format!("SELECT COUNT(*) FROM {ledger}");

    // 1. Stopped between effect and commit (of its 500th payment), then SIGKILLed.
    let mut c = ChildProcess::spawn_self(TEST, ROLE, &arg("500")).expect("child 1");
    let deadline = Instant::now() + Duration::from_secs(120);
    while !c.stderr_tail(8192).contains("EFFECT-COMMITTED") {
        assert!(
            Instant::now() < deadline,
            "child 1 never hung: {}",
            c.stderr_tail(8000)
        );
        if let Ok(Some(s)) = c.try_wait() {
            panic!("child 1 exited: {s}: {}", c.stderr_tail(8000));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let hang = c
        .stderr_tail(8192)
        .lines()
        .find_map(|l| l.strip_prefix("EFFECT-COMMITTED ").map(str::to_string))
        .expect("hung payment");
    c.kill().expect("SIGKILL");
    let applied = scalar(
        &pool,
        &format!("SELECT COUNT(*) FROM {ledger} WHERE payment = '{hang}'"),
    )
    .await;
    assert_eq!(
        applied, 1,
        "the hung payment's effect committed before the kill"
    );
    let committed = support::committed_offsets(&brokers, &group, &topic, PARTS);
    assert!(
        committed.iter().sum::<i64>() < scalar(&pool, &count).await,
        "records whose effect committed are still uncommitted in Kafka: they come back"
    );
    eprintln!(
        "child 1 killed between effect and commit of {hang}: {} rows, Kafka committed {committed:?}",
        scalar(&pool, &count).await
    );
    send(&brokers, &topic, (0..N).step_by(8).take(60)).await; // resent again

    // 2. Killed at a random point.
    let mut c = ChildProcess::spawn_self(TEST, ROLE, &arg("0")).expect("child 2");
    let target = (scalar(&pool, &count).await + 200 + i64::from(std::process::id() % 600))
        .min(N as i64 - 100);
    let deadline = Instant::now() + Duration::from_secs(120);
    while scalar(&pool, &count).await < target {
        assert!(
            Instant::now() < deadline,
            "child 2 made no progress: {}",
            c.stderr_tail(8000)
        );
        if let Ok(Some(s)) = c.try_wait() {
            panic!("child 2 exited: {s}: {}", c.stderr_tail(8000));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(u64::from(std::process::id() % 150))).await;
    c.kill().expect("SIGKILL");
    eprintln!("child 2 killed at {} rows", scalar(&pool, &count).await);
    send(&brokers, &topic, (N - 200..N).step_by(3)).await; // resent after the crashes

    // 3. The last child runs until the group's committed offsets reach the end.
    let ends = support::high_watermarks(&brokers, &topic, PARTS);
    let mut c = ChildProcess::spawn_self(TEST, ROLE, &arg("0")).expect("child 3");
    let deadline = Instant::now() + Duration::from_secs(240);
    loop {
        let now = support::committed_offsets(&brokers, &group, &topic, PARTS);
        if now == ends {
            break;
        }
        if Instant::now() > deadline {
            panic!(
                "last child did not finish: committed {now:?}, ends {ends:?}: {}",
                c.stderr_tail(8000)
            );
        }
        if let Ok(Some(s)) = c.try_wait() {
            panic!("child 3 exited: {s}: {}", c.stderr_tail(8000));
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    c.kill().expect("stop the last child");

    let total = scalar(&pool, &count).await;
    let distinct = scalar(
        &pool,
        &format!("SELECT COUNT(DISTINCT payment) FROM {ledger}"),
    )
    .await;
    let doubled = scalar(
        &pool,
        &format!("SELECT COUNT(*) FROM (SELECT payment FROM {ledger} GROUP BY payment HAVING COUNT(*) > 1) d"),
    )
    .await;
    let records: i64 = ends.iter().sum();
    eprintln!("{records} records for {N} payments: ledger {total} rows, {distinct} distinct, {doubled} doubled");
    assert!(records > N as i64, "the resent copies are on the topic");
    assert_eq!(
        (total, distinct, doubled),
        (N as i64, N as i64, 0),
        "one ledger row per payment"
    );
    for t in [ledger.as_str(), dedup.as_str(), &format!("{dedup}_keys")] {
        let _ = sqlx::query(&format!("DROP TABLE IF EXISTS {t}"))
            .execute(&pool)
            .await;
    }
}
