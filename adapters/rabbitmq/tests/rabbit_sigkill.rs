//! A consumer *process* killed mid-batch (prefetch 100, SIGKILL: no close, no ack in flight,
//! no final anything): the broker redelivers what it had unacked, and every message still
//! changes the world once. The effect is a row in a ledger table **without** a unique
//! constraint, written in the same PostgreSQL transaction that completes the dedup record
//! (`PgStore::begin_for`), so only the dedup store stands between a redelivery and a second
//! row. Children are this test binary run again (`idemq_core::testkit::process`).

mod support;

use idemq_core::testkit::process::{child_role, ChildProcess};
use idemq_core::{
    async_trait, ClaimedMessage, ConsumerConfig, Delivery, IdempotentConsumer, KeyStrategy,
    OutgoingMessage, Publisher, RetryPolicy, Source, SourceError,
};
use idemq_rabbitmq::{QueueType, RabbitSource};
use idemq_sql::sqlx::{self, PgPool};
use idemq_sql::{PgStore, SqlResultExt, SqlStoreOptions, TableName};
use std::sync::Arc;
use std::time::Duration;

const ROLE: &str = "IDEMQ_RABBIT_SIGKILL_CHILD";
const TEST: &str = "a_consumer_process_killed_mid_batch_changes_the_world_once";
const GROUP: &str = "ledger";

/// What parent and children share: the queue and the tables of this run.
struct Run {
    queue: String,
    dedup: String,
    ledger: String,
    arrivals: String,
    /// The last child runs until every key is applied, then exits 0.
    last: bool,
    keys: usize,
}

impl Run {
    fn encode(&self) -> String {
        format!(
            "{}|{}|{}|{}|{}|{}",
            self.queue, self.dedup, self.ledger, self.arrivals, self.last, self.keys
        )
    }
    fn decode(s: &str) -> Self {
        let f: Vec<&str> = s.split('|').collect();
        assert_eq!(f.len(), 6, "child argument {s:?}");
        Self {
            queue: f[0].into(),
            dedup: f[1].into(),
            ledger: f[2].into(),
            arrivals: f[3].into(),
            last: f[4] == "true",
            keys: f[5].parse().expect("keys"),
        }
    }
}

fn pg_url() -> Option<String> {
    idemq_core::testkit::servers::server_url("IDEMQ_TEST_POSTGRES_URL")
}

/// The child's source: the RabbitMQ source, with every delivery it hands out recorded in the
/// arrivals table (key, redelivered, pid) — an observation only, outside any transaction.
struct Observed {
    inner: RabbitSource,
    pool: PgPool,
    insert: String,
}

#[async_trait]
impl Source for Observed {
    async fn poll(&mut self, max: usize) -> Result<Option<Vec<Delivery>>, SourceError> {
        let got = self.inner.poll(max).await?;
        if let Some(ds) = &got {
            let keys: Vec<String> = ds
                .iter()
                .map(|d| {
                    let k = d.envelope.headers.get_str(idemq_core::DEDUP_HEADER);
                    k.unwrap_or_default().to_owned()
                })
                .collect();
            let again: Vec<bool> = ds.iter().map(|d| d.envelope.redelivered).collect();
            sqlx::query(&self.insert)
                .bind(keys)
                .bind(again)
                .bind(i64::from(std::process::id()))
                .execute(&self.pool)
                .await
                .map_err(|e| SourceError::Broker(format!("recording arrivals: {e}")))?;
        }
        Ok(got)
    }
    async fn after_batch(&mut self) -> Result<(), SourceError> {
        self.inner.after_batch().await
    }
    async fn close(&mut self) -> Result<(), SourceError> {
        self.inner.close().await
    }
}

async fn scalar(pool: &PgPool, sql: &str) -> i64 {
    let (n,): (i64,) = sqlx::query_as(sql)
        .fetch_one(pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    n
}

/// The child: consume with prefetch 100, each effect a ledger row committed with the dedup
/// record; run until SIGKILLed (or, the last one, until every key is in the ledger).
async fn child(run: Run) -> ! {
    let url = support::amqp_url().expect("amqp url in the child");
    let pg = pg_url().expect("postgres url in the child");
    let table = TableName::new(&run.dedup).expect("dedup table");
    let store = PgStore::connect(&pg, SqlStoreOptions::with_table(table))
        .await
        .expect("pg store");
    let cfg = support::config(&url, &run.queue, QueueType::Classic).prefetch(100);
    let inner = RabbitSource::connect(cfg).await.expect("source");
    let mut src = Observed {
        inner,
        pool: store.pool().clone(),
        insert: format!(
            "INSERT INTO {} (msg_key, redelivered, pid) \
             SELECT k, r, $3 FROM UNNEST($1::text[], $2::bool[]) AS t(k, r)",
            run.arrivals
        ),
    };
    let insert = format!(
        "INSERT INTO {} (msg_key, redelivered, pid) VALUES ($1, $2, $3)",
        run.ledger
    );
    let fx = store.clone();
    let consumer = IdempotentConsumer::new(
        Arc::new(store.clone()),
        KeyStrategy::dedup_header(GROUP).expect("keys"),
        move |m: ClaimedMessage| {
            let (store, insert) = (fx.clone(), insert.clone());
            async move {
                // Some work, so that a kill finds a batch half done.
                tokio::time::sleep(Duration::from_millis(2)).await;
                let key = m.envelope.headers.get_str(idemq_core::DEDUP_HEADER);
                let key = key.unwrap_or_default().to_owned();
                let mut tx = store.begin_for(&m).await?;
                sqlx::query(&insert)
                    .bind(key)
                    .bind(m.envelope.redelivered)
                    .bind(i64::from(std::process::id()))
                    .execute(&mut *tx)
                    .await
                    .classify()?;
                tx.commit().await
            }
        },
    )
    .with_config(ConsumerConfig {
        max_batch: 100,
        max_concurrency: 32,
        lease: Duration::from_secs(3),
        retry: RetryPolicy::fixed(Duration::from_millis(250)),
        in_flight_delay_max: Duration::from_millis(500),
        ..ConsumerConfig::default()
    });
    let pool = store.pool().clone();
    let distinct = format!("SELECT count(DISTINCT msg_key) FROM {}", run.ledger);
    let (last, keys) = (run.last, run.keys as i64);
    let done = async move {
        loop {
            if last && scalar(&pool, &distinct).await >= keys {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    consumer.run(&mut src, done).await.expect("consumer run");
    let _ = src.close().await;
    std::process::exit(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_consumer_process_killed_mid_batch_changes_the_world_once() {
    if let Some(arg) = child_role(ROLE) {
        child(Run::decode(&arg)).await;
    }
    let Some(url) = support::amqp_url() else {
        return;
    };
    let Some(pg) = pg_url() else {
        return;
    };
    let tag = format!("{:08x}", rand::random::<u32>());
    let keys = 3000usize;
    let mut run = Run {
        queue: support::fresh_queue("sigkill"),
        dedup: format!("rabbit_kill_dedup_{tag}"),
        ledger: format!("rabbit_kill_ledger_{tag}"),
        arrivals: format!("rabbit_kill_arrivals_{tag}"),
        last: false,
        keys,
    };
    let pool = PgPool::connect(&pg).await.expect("postgres");
    for t in [&run.ledger, &run.arrivals] {
        // No unique constraint: a second effect would be a second row.
        sqlx::query(&format!(
            "CREATE TABLE {t} (msg_key TEXT NOT NULL, redelivered BOOL NOT NULL, pid BIGINT NOT NULL, \
             at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp())"
        ))
        .execute(&pool)
        .await
        .expect("create table");
    }
    // Declared before publishing; then 3000 payments, every tenth sent twice (a producer
    // retry after a lost confirm).
    drop(support::source(support::config(&url, &run.queue, QueueType::Classic)).await);
    let names: Vec<String> = (0..keys).map(|i| format!("pay-{i:05}")).collect();
    let mut sends: Vec<OutgoingMessage> = names
        .iter()
        .map(|k| OutgoingMessage::new(run.queue.clone(), "{}").with_dedup_key(k.clone()))
        .collect();
    sends.extend(sends.clone().into_iter().step_by(10));
    let p = support::publisher(&url).await;
    for chunk in sends.chunks(500) {
        for r in p.publish_batch(chunk.to_vec()).await {
            r.expect("publish");
        }
    }

    let ledger_rows = format!("SELECT count(*) FROM {}", run.ledger);
    let kills = 4;
    for kill in 0..kills {
        let mut c = ChildProcess::spawn_self(TEST, ROLE, &run.encode()).expect("spawn child");
        let before = scalar(&pool, &ledger_rows).await;
        // Kill once this child has applied a few hundred (plus a random bit): mid-batch.
        let target = before + 300 + i64::from(rand::random::<u8>());
        let deadline = std::time::Instant::now() + Duration::from_secs(90);
        while scalar(&pool, &ledger_rows).await < target {
            if let Ok(Some(status)) = c.try_wait() {
                panic!(
                    "child {kill} exited early ({status}):\n{}",
                    c.stderr_tail(4000)
                );
            }
            assert!(
                std::time::Instant::now() < deadline,
                "child {kill} made no progress:\n{}",
                c.stderr_tail(4000)
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        c.kill().expect("SIGKILL");
        eprintln!(
            "kill {kill}: pid {} killed at {} ledger rows",
            c.id(),
            scalar(&pool, &ledger_rows).await
        );
    }
    run.last = true;
    let mut c = ChildProcess::spawn_self(TEST, ROLE, &run.encode()).expect("spawn last child");
    let status = c
        .wait_or_kill(Duration::from_secs(180))
        .expect("last child");
    assert!(
        status.success(),
        "the last child did not finish ({status}):\n{}",
        c.stderr_tail(4000)
    );

    let (l, a) = (&run.ledger, &run.arrivals);
    let rows = scalar(&pool, &ledger_rows).await;
    let distinct = scalar(&pool, &format!("SELECT count(DISTINCT msg_key) FROM {l}")).await;
    let doubles = scalar(
        &pool,
        &format!(
            "SELECT count(*) FROM (SELECT msg_key FROM {l} GROUP BY msg_key HAVING count(*) > 1) d"
        ),
    )
    .await;
    let redelivered = scalar(
        &pool,
        &format!("SELECT count(DISTINCT msg_key) FROM {a} WHERE redelivered"),
    )
    .await;
    // Redelivered to a later process although an earlier one had already committed the
    // effect (killed between commit and ack): the store alone kept them from a second row.
    let absorbed = scalar(
        &pool,
        &format!(
            "SELECT count(DISTINCT a.msg_key) FROM {a} a JOIN {l} f ON f.msg_key = a.msg_key \
             WHERE a.redelivered AND a.pid <> f.pid AND f.at < a.at"
        ),
    )
    .await;
    let applied_again = scalar(
        &pool,
        &format!("SELECT count(*) FROM {l} WHERE redelivered"),
    )
    .await;
    eprintln!(
        "{kills} SIGKILLs: ledger rows={rows} distinct={distinct} double_effects={doubles}; \
         keys redelivered={redelivered} (applied on a redelivery: {applied_again}, \
         already applied by a killed process and absorbed: {absorbed})"
    );
    assert_eq!(doubles, 0, "a redelivered message changed the world twice");
    assert_eq!(
        (rows, distinct),
        (keys as i64, keys as i64),
        "lost or doubled effects"
    );
    assert!(
        redelivered > 0,
        "no delivery came back redelivered: the kills did not land mid-batch"
    );

    for t in [&run.ledger, &run.arrivals] {
        let _ = sqlx::query(&format!("DROP TABLE IF EXISTS {t}"))
            .execute(&pool)
            .await;
    }
    for t in [
        run.dedup.clone(),
        format!("{}_keys", run.dedup),
        format!("{}_fence", run.dedup),
    ] {
        let _ = sqlx::query(&format!("DROP TABLE IF EXISTS {t}"))
            .execute(&pool)
            .await;
    }
    let q = run.queue.clone();
    let mut queues = vec![q.clone(), format!("{q}.dlq")];
    queues.extend(
        idemq_rabbitmq::DEFAULT_RETRY_TIERS_MS
            .iter()
            .map(|t| idemq_rabbitmq::retry_queue_name(&q, *t)),
    );
    support::delete_queues(&url, &queues).await;
}
