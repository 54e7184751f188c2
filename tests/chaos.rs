//! The fault-injection soak: broker × store, real servers, consumer **processes** killed and
//! paused, the store crashed mid-run, checked against an independent effect ledger.
//!
//! Each pair publishes `IDEMQ_CHAOS_MESSAGES` business keys through the real broker with
//! producer duplicates (a resend of every fifth key with the same dedup key) and a replay
//! of the first tenth, then runs two consumer processes that apply each message as one row
//! of a ledger table **without** a unique constraint, written in the transaction that
//! completes the dedup record (`begin_for` … `commit`). Meanwhile the parent
//!
//! - SIGKILLs a consumer `IDEMQ_CHAOS_KILLS` times at random moments and starts a new one;
//! - has consumers abort themselves at chosen points: after the claim before the effect,
//!   and after the effect's commit before the ack (an `abort()`: no unwinding, no close);
//! - SIGSTOPs a consumer past its lease, then SIGCONTs it (seed 002's GC pause): its
//!   messages are taken over by the other consumer, and its late commits are fenced;
//! - crashes PostgreSQL (`scripts/servers.sh restart-postgres`, `pg_ctl -m immediate`)
//!   once, on the PostgreSQL pairs;
//!
//! and then requires every key's row exactly once: `double_effects=0 lost=0`.
//!
//! The CI profile (the defaults) is small; the long profile is the same tests with more:
//!
//! ```sh
//! IDEMQ_CHAOS_MESSAGES=1000000 IDEMQ_CHAOS_KILLS=10 scripts/chaos.sh
//! ```
//!
//! The kill between the effect and the completion does not exist here by construction: both
//! commit in one transaction. With a store outside the effect's database (Redis) that window
//! is real and documented in docs/reliability.md; the Redis pairs are not part of this soak.
#![cfg(all(
    feature = "kafka",
    feature = "rabbitmq",
    feature = "rocketmq",
    feature = "postgres",
    feature = "mysql",
    feature = "redis",
    feature = "layered"
))]

use idemq::core::testkit::process::{child_role, ChildProcess};
use idemq::engine::RetryPolicy;
use idemq::kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use idemq::kafka::rdkafka::client::DefaultClientContext;
use idemq::kafka::rdkafka::ClientConfig;
use idemq::kafka::{KafkaProducerConfig, KafkaPublisher, KafkaSource, KafkaSourceConfig};
use idemq::layered::LayeredStore;
use idemq::rabbitmq::{QueueType, RabbitPublisher, RabbitSource, RabbitSourceConfig};
use idemq::redis::redis::cmd as redis_cmd;
use idemq::redis::RedisStore;
use idemq::rocketmq::{PublisherConfig, RocketPublisher, RocketSource, SourceConfig};
use idemq::sql::{sqlx, MySqlStore, PgStore, SqlResultExt, SqlStoreOptions, TableName};
use idemq::{
    ClaimedMessage, ConsumerConfig, DedupStore, IdempotentConsumer, KeyStrategy, OutgoingMessage,
    Publisher, Source,
};
use rand::Rng;
use std::sync::Arc;
use std::time::{Duration, Instant};

const CHILD: &str = "IDEMQ_CHAOS_CHILD";
/// Consumer processes running at once.
const CONSUMERS: usize = 2;
/// The consumers' lease: short, so a paused consumer loses its claims within the run.
const LEASE: Duration = Duration::from_secs(3);

#[derive(Clone, Copy, Debug, PartialEq)]
enum Broker {
    Kafka,
    RabbitMq,
    RocketMq,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Store {
    Postgres,
    MySql,
    Redis,
    /// The layered store (local cache) over Redis.
    Layered,
}

impl Broker {
    fn parse(s: &str) -> Self {
        match s {
            "kafka" => Self::Kafka,
            "rabbitmq" => Self::RabbitMq,
            "rocketmq" => Self::RocketMq,
            other => panic!("unknown broker {other}"),
        }
    }
    fn name(self) -> &'static str {
        match self {
            Self::Kafka => "kafka",
            Self::RabbitMq => "rabbitmq",
            Self::RocketMq => "rocketmq",
        }
    }
    fn env(self) -> &'static str {
        match self {
            Self::Kafka => "IDEMQ_TEST_KAFKA_BROKERS",
            Self::RabbitMq => "IDEMQ_TEST_AMQP_URL",
            Self::RocketMq => "IDEMQ_TEST_ROCKETMQ_NAMESRV",
        }
    }
}

impl Store {
    fn parse(s: &str) -> Self {
        match s {
            "postgres" => Self::Postgres,
            "mysql" => Self::MySql,
            "redis" => Self::Redis,
            "layered" => Self::Layered,
            other => panic!("unknown store {other}"),
        }
    }
    fn name(self) -> &'static str {
        match self {
            Self::Postgres => "postgres",
            Self::MySql => "mysql",
            Self::Redis => "redis",
            Self::Layered => "layered",
        }
    }
    fn env(self) -> &'static str {
        match self {
            Self::Postgres => "IDEMQ_TEST_POSTGRES_URL",
            Self::MySql => "IDEMQ_TEST_MYSQL_URL",
            Self::Redis | Self::Layered => "IDEMQ_TEST_REDIS_URL",
        }
    }
    /// The command that crashes and restarts the store's server mid-run, if there is one.
    fn restart_env(self) -> Option<&'static str> {
        match self {
            Self::Postgres => Some("IDEMQ_TEST_POSTGRES_RESTART_CMD"),
            Self::MySql => None,
            Self::Redis | Self::Layered => Some("IDEMQ_TEST_REDIS_RESTART_CMD"),
        }
    }
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|s| !s.trim().is_empty())
}

fn knob(name: &str, default: usize) -> usize {
    var(name).map_or(default, |v| {
        v.parse()
            .unwrap_or_else(|_| panic!("{name}={v}: not a number"))
    })
}

/// The broker's and the store's URLs, or `None` to skip (a panic when
/// `IDEMQ_REQUIRE_SERVERS=1`).
fn servers(broker: Broker, store: Store) -> Option<(String, String)> {
    match (var(broker.env()), var(store.env())) {
        (Some(b), Some(s)) => Some((b, s)),
        _ => {
            assert!(
                var("IDEMQ_REQUIRE_SERVERS").as_deref() != Some("1"),
                "IDEMQ_REQUIRE_SERVERS=1 needs {} and {} (eval \"$(scripts/servers.sh env)\")",
                broker.env(),
                store.env()
            );
            eprintln!("skipped: needs {} and {}", broker.env(), store.env());
            None
        }
    }
}

fn unique(what: &str) -> String {
    format!("idemq_chaos_{what}_{:08x}", rand::random::<u32>())
}

/// The effect ledger, where the parent reads it: a SQL table without a unique constraint,
/// or (Redis stores) a list of applications plus a set of the keys applied.
enum Ledger {
    Pg(PgStore, String),
    My(MySqlStore, String),
    // A connection manager: it reconnects after the Redis restart mid-run (a plain
    // multiplexed connection stays broken, and the parent would never see the ledger again).
    Redis(idemq::redis::redis::aio::ConnectionManager, String),
}

impl Ledger {
    async fn create(store: Store, url: &str, table: &str, ledger: &str) -> Self {
        let opts = SqlStoreOptions::with_table(TableName::new(table).expect("table name"));
        // No unique constraint: a second effect of a key is a second row.
        let ddl = format!("CREATE TABLE {ledger} (k VARCHAR(64) NOT NULL, pid BIGINT NOT NULL)");
        match store {
            Store::Postgres => {
                let s = PgStore::connect(url, opts).await.expect("PostgreSQL");
                sqlx::query(&ddl).execute(s.pool()).await.expect("ledger");
                Self::Pg(s, ledger.into())
            }
            Store::MySql => {
                let s = MySqlStore::connect(url, opts).await.expect("MariaDB");
                sqlx::query(&ddl).execute(s.pool()).await.expect("ledger");
                Self::My(s, ledger.into())
            }
            Store::Redis | Store::Layered => {
                let conn = idemq::redis::redis::Client::open(url)
                    .expect("redis url")
                    .get_connection_manager()
                    .await
                    .expect("Redis");
                Self::Redis(conn, ledger.into())
            }
        }
    }

    /// (applications, distinct keys), or `None` while the store is unreachable (it is
    /// restarted mid-run).
    async fn counts(&mut self) -> Option<(i64, i64)> {
        let q = |t: &str| format!("SELECT COUNT(*), COUNT(DISTINCT k) FROM {t}");
        match self {
            Self::Pg(s, t) => sqlx::query_as(&q(t)).fetch_one(s.pool()).await.ok(),
            Self::My(s, t) => sqlx::query_as(&q(t)).fetch_one(s.pool()).await.ok(),
            Self::Redis(conn, l) => {
                let mut p = idemq::redis::redis::pipe();
                p.cmd("LLEN").arg(format!("{l}:rows"));
                p.cmd("SCARD").arg(format!("{l}:keys"));
                p.query_async(conn).await.ok()
            }
        }
    }

    async fn drop(&mut self) {
        match self {
            Self::Pg(s, t) => {
                let _ = sqlx::query(&format!("DROP TABLE {t}"))
                    .execute(s.pool())
                    .await;
            }
            Self::My(s, t) => {
                let _ = sqlx::query(&format!("DROP TABLE {t}"))
                    .execute(s.pool())
                    .await;
            }
            Self::Redis(conn, l) => {
                let _: Result<i64, _> = idemq::redis::redis::cmd("DEL")
                    .arg(format!("{l}:rows"))
                    .arg(format!("{l}:keys"))
                    .query_async(conn)
                    .await;
            }
        }
    }
}

/// What a consumer child is told, as one `|`-separated argument.
struct Plan {
    broker: Broker,
    store: Store,
    destination: String,
    group: String,
    table: String,
    ledger: String,
    /// Abort after this many handled messages (0: never).
    abort_after: usize,
    /// Where: `before-effect` or `before-ack`.
    abort_at: String,
}

impl Plan {
    fn encode(&self) -> String {
        format!(
            "{}|{}|{}|{}|{}|{}|{}|{}",
            self.broker.name(),
            self.store.name(),
            self.destination,
            self.group,
            self.table,
            self.ledger,
            self.abort_after,
            self.abort_at
        )
    }

    fn decode(s: &str) -> Self {
        let p: Vec<&str> = s.split('|').collect();
        assert_eq!(p.len(), 8, "bad {CHILD}: {s}");
        Self {
            broker: Broker::parse(p[0]),
            store: Store::parse(p[1]),
            destination: p[2].into(),
            group: p[3].into(),
            table: p[4].into(),
            ledger: p[5].into(),
            abort_after: p[6].parse().expect("abort_after"),
            abort_at: p[7].into(),
        }
    }
}

/// Counts handled messages and aborts the process at the planned point.
struct Tripwire {
    after: usize,
    at: String,
    seen: std::sync::atomic::AtomicUsize,
}

impl Tripwire {
    fn check(&self, point: &str) {
        if self.after == 0 || self.at != point {
            return;
        }
        let n = self.seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        if n >= self.after {
            eprintln!("child {}: abort at {point} after {n}", std::process::id());
            std::process::abort();
        }
    }
}

async fn child_source(plan: &Plan, url: &str) -> Box<dyn Source> {
    match plan.broker {
        Broker::Kafka => {
            let mut cfg = KafkaSourceConfig::new(url, &plan.group, &[plan.destination.as_str()])
                .set("session.timeout.ms", "6000")
                .set("heartbeat.interval.ms", "500");
            cfg.commit_interval = Duration::from_millis(500);
            Box::new(KafkaSource::new(cfg).expect("kafka source"))
        }
        Broker::RabbitMq => Box::new(
            RabbitSource::connect(
                RabbitSourceConfig::new(url, &plan.destination)
                    .declare(QueueType::Quorum)
                    .prefetch(64),
            )
            .await
            .expect("rabbitmq source"),
        ),
        Broker::RocketMq => Box::new(
            RocketSource::connect(SourceConfig::new(url, &plan.group, &plan.destination))
                .await
                .expect("rocketmq source"),
        ),
    }
}

/// The handler of one store: the ledger row and the dedup completion in one transaction.
macro_rules! ledger_consumer {
    ($store:expr, $insert:expr, $plan:expr, $trip:expr) => {{
        let db = $store.clone();
        let (insert, trip) = ($insert, $trip);
        let handler = move |m: ClaimedMessage| {
            let (db, insert, trip) = (db.clone(), insert.clone(), trip.clone());
            async move {
                trip.check("before-effect");
                let mut tx = db.begin_for(&m).await?;
                sqlx::query(&insert)
                    .bind(m.key.business_key().to_string())
                    .bind(i64::from(std::process::id()))
                    .execute(&mut *tx)
                    .await
                    .classify()?;
                let done = tx.commit().await;
                if done.is_ok() {
                    trip.check("before-ack");
                }
                done
            }
        };
        IdempotentConsumer::new(
            Arc::new($store),
            KeyStrategy::dedup_header(&$plan.group).expect("group"),
            handler,
        )
        .with_config(consumer_config())
    }};
}

fn consumer_config() -> ConsumerConfig {
    ConsumerConfig {
        max_batch: 64,
        lease: LEASE,
        in_flight_delay_max: Duration::from_millis(500),
        store_backoff: Duration::from_millis(200),
        retry: RetryPolicy::fixed(Duration::from_millis(200)),
        ..ConsumerConfig::default()
    }
}

/// A consumer process: runs until killed (or aborts itself as planned).
async fn consumer_child(arg: &str) {
    let plan = Plan::decode(arg);
    let broker_url = var(plan.broker.env()).expect("broker URL");
    let store_url = var(plan.store.env()).expect("store URL");
    let trip = Arc::new(Tripwire {
        after: plan.abort_after,
        at: plan.abort_at.clone(),
        seen: Default::default(),
    });
    let opts = SqlStoreOptions::with_table(TableName::new(&plan.table).expect("table"));
    let mut source = child_source(&plan, &broker_url).await;
    eprintln!(
        "child {} consuming {} on {}",
        std::process::id(),
        plan.destination,
        plan.broker.name()
    );
    let r = match plan.store {
        Store::Postgres => {
            let store = PgStore::connect(&store_url, opts).await.expect("store");
            let insert = format!("INSERT INTO {} (k, pid) VALUES ($1, $2)", plan.ledger);
            let c = ledger_consumer!(store, insert, plan, trip);
            c.run(&mut *source, std::future::pending()).await
        }
        Store::MySql => {
            let store = MySqlStore::connect(&store_url, opts).await.expect("store");
            let insert = format!("INSERT INTO {} (k, pid) VALUES (?, ?)", plan.ledger);
            let c = ledger_consumer!(store, insert, plan, trip);
            c.run(&mut *source, std::future::pending()).await
        }
        Store::Redis | Store::Layered => {
            let redis = RedisStore::builder(&store_url)
                .prefix(&plan.table)
                .connect()
                .await
                .expect("store");
            let engine_store: Arc<dyn DedupStore> = match plan.store {
                Store::Layered => Arc::new(LayeredStore::new(Arc::new(redis.clone()))),
                _ => Arc::new(redis.clone()),
            };
            let (rows, keys) = (
                format!("{}:rows", plan.ledger),
                format!("{}:keys", plan.ledger),
            );
            let handler = move |m: ClaimedMessage| {
                let (db, rows, keys, trip) =
                    (redis.clone(), rows.clone(), keys.clone(), trip.clone());
                async move {
                    trip.check("before-effect");
                    let k = m.key.business_key().to_string();
                    let mut row = redis_cmd("RPUSH");
                    row.arg(&rows).arg(format!("{k}|{}", std::process::id()));
                    let mut key = redis_cmd("SADD");
                    key.arg(&keys).arg(&k);
                    // The effect and the completion in one script.
                    let done = db.complete_with(&m, &[row, key], None).await;
                    if done.is_ok() {
                        trip.check("before-ack");
                    }
                    done
                }
            };
            let c = IdempotentConsumer::new(
                engine_store,
                KeyStrategy::dedup_header(&plan.group).expect("group"),
                handler,
            )
            .with_config(consumer_config());
            c.run(&mut *source, std::future::pending()).await
        }
    };
    panic!("the consumer stopped: {r:?}");
}

async fn create_topic(brokers: &str, topic: &str) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .expect("admin client");
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(20)));
    for r in admin
        .create_topics(
            [&NewTopic::new(topic, 4, TopicReplication::Fixed(1))],
            &opts,
        )
        .await
        .expect("create_topics")
    {
        r.unwrap_or_else(|(name, code)| panic!("create topic {name}: {code}"));
    }
}

/// Publishes every key once, every fifth twice (a producer resend), then the first tenth
/// again (a replay). Returns how many messages went out.
async fn publish(broker: Broker, url: &str, destination: &str, keys: usize) -> usize {
    let publisher: Box<dyn Publisher> = match broker {
        Broker::Kafka => {
            create_topic(url, destination).await;
            Box::new(KafkaPublisher::new(&KafkaProducerConfig::idempotent(url)).expect("kafka"))
        }
        Broker::RabbitMq => {
            // The queue must exist before the first publish: its source declares it.
            let mut s = RabbitSource::connect(
                RabbitSourceConfig::new(url, destination).declare(QueueType::Quorum),
            )
            .await
            .expect("declare queue");
            s.close().await.expect("close declaring source");
            Box::new(RabbitPublisher::connect(url).await.expect("rabbitmq"))
        }
        Broker::RocketMq => Box::new(
            RocketPublisher::connect(PublisherConfig::new(url, unique("producer")))
                .await
                .expect("rocketmq"),
        ),
    };
    let message = |i: usize| {
        OutgoingMessage::new(destination, format!("{{\"order\":\"o-{i:07}\"}}"))
            .with_key(format!("o-{i:07}"))
            .with_dedup_key(format!("o-{i:07}"))
    };
    let mut batch = Vec::new();
    let mut sent = 0;
    let order = (0..keys)
        .flat_map(|i| if i % 5 == 0 { vec![i, i] } else { vec![i] })
        .chain(0..keys / 10);
    for i in order {
        batch.push(message(i));
        if batch.len() == 500 {
            sent += flush(&*publisher, &mut batch).await;
        }
    }
    sent + flush(&*publisher, &mut batch).await
}

async fn flush(publisher: &dyn Publisher, batch: &mut Vec<OutgoingMessage>) -> usize {
    let n = batch.len();
    for r in publisher.publish_batch(std::mem::take(batch)).await {
        r.expect("confirmed publish");
    }
    n
}

fn send_signal(child: &ChildProcess, signal: &str) {
    let ok = std::process::Command::new("kill")
        .args([signal, &child.id().to_string()])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(ok, "kill {signal} {}", child.id());
}

fn restart_store(env: &str) {
    let cmd = var(env).unwrap_or_else(|| panic!("{env} (eval \"$(scripts/servers.sh env)\")"));
    let out = std::process::Command::new("bash")
        .args(["-c", &cmd])
        .output()
        .expect("run the restart command");
    assert!(
        out.status.success(),
        "{cmd}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Pairs share the servers and PostgreSQL is crashed mid-run: one pair at a time.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn soak(test: &str, broker: Broker, store: Store) {
    if let Some(arg) = child_role(CHILD) {
        consumer_child(&arg).await;
        return;
    }
    let Some((broker_url, store_url)) = servers(broker, store) else {
        return;
    };
    let _alone = ONE_AT_A_TIME.lock().await;
    let keys = knob("IDEMQ_CHAOS_MESSAGES", 3000);
    let kills = knob("IDEMQ_CHAOS_KILLS", 3);
    let limit = Duration::from_secs(knob("IDEMQ_CHAOS_LIMIT_SECS", 420) as u64);
    let table = unique("dedup");
    let ledger = unique("ledger");
    let mut db = Ledger::create(store, &store_url, &table, &ledger).await;
    let destination = unique("orders");
    let published = publish(broker, &broker_url, &destination, keys).await;
    let plan = |abort_after: usize, abort_at: &str| Plan {
        broker,
        store,
        destination: destination.clone(),
        group: unique("billing"),
        table: table.clone(),
        ledger: ledger.clone(),
        abort_after,
        abort_at: abort_at.into(),
    };
    // Every consumer of the run is one group: the first plan's.
    let group = plan(0, "").group;
    let spawn = |abort_after: usize, abort_at: &str| {
        let mut p = plan(abort_after, abort_at);
        p.group = group.clone();
        ChildProcess::spawn_self(test, CHILD, &p.encode()).expect("spawn a consumer")
    };
    // One consumer aborts itself between claim and effect, one between commit and ack; the
    // ones started after a SIGKILL run clean.
    let mut children = vec![
        spawn(keys / 7 + 1, "before-effect"),
        spawn(keys / 5 + 1, "before-ack"),
    ];
    debug_assert_eq!(children.len(), CONSUMERS);

    let started = Instant::now();
    let (mut killed, mut paused, mut restarted, mut respawned) = (0, false, false, 0);
    // A paused consumer and when it gets SIGCONT (the loop goes on meanwhile).
    let mut resume: Option<(usize, Instant)> = None;
    let mut tails = Vec::new();
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let Some((_, done)) = db.counts().await else {
            // The store is restarting; the time limit still holds.
            if started.elapsed() > limit {
                break;
            }
            continue;
        };
        if (done >= keys as i64 && resume.is_none()) || started.elapsed() > limit {
            break;
        }
        // Children that aborted (as planned) or died are replaced by clean ones.
        for c in children.iter_mut() {
            if let Ok(Some(status)) = c.try_wait() {
                tails.push(format!("[{status}] {}", c.stderr_tail(1500)));
                *c = spawn(0, "");
                respawned += 1;
            }
        }
        let progress = done as f64 / keys as f64;
        if killed < kills && progress >= (killed + 1) as f64 / (kills + 2) as f64 {
            let i = rand::thread_rng().gen_range(0..children.len());
            tokio::time::sleep(Duration::from_millis(rand::thread_rng().gen_range(0..50))).await;
            children[i].kill().expect("SIGKILL");
            tails.push(children[i].stderr_tail(1500));
            children[i] = spawn(0, "");
            killed += 1;
            eprintln!("{broker:?}/{store:?}: SIGKILL {killed} at {done} of {keys}");
        }
        if !paused && progress >= 0.3 {
            paused = true;
            let i = rand::thread_rng().gen_range(0..children.len());
            send_signal(&children[i], "-STOP");
            resume = Some((i, Instant::now() + LEASE * 2));
            eprintln!("{broker:?}/{store:?}: SIGSTOP at {done} of {keys}");
        }
        if let Some((i, at)) = resume.filter(|(_, at)| Instant::now() >= *at) {
            send_signal(&children[i], "-CONT");
            resume = None;
            eprintln!(
                "{broker:?}/{store:?}: SIGCONT at {done} ({:?} late)",
                at.elapsed()
            );
        }
        if let Some(cmd) = store
            .restart_env()
            .filter(|_| !restarted && progress >= 0.5)
        {
            restarted = true;
            restart_store(cmd);
            eprintln!("{broker:?}/{store:?}: the store's server restarted at {done}");
        }
    }
    // Late redeliveries (a killed consumer's unacked messages, RocketMQ's reconsume) must
    // find their keys done: watch a little longer for a second row.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let mut counts = None;
    for _ in 0..100 {
        counts = db.counts().await;
        if counts.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (total, done) = counts.expect("the ledger's counts (is the store up?)");
    for mut c in children {
        let _ = c.kill();
    }
    let double_effects = total - done;
    let lost = keys as i64 - done;
    println!(
        "chaos {}/{}: keys={keys} published={published} sigkills={killed} aborts+deaths={respawned} \
         sigstop={paused} store_restart={restarted} rows={total} double_effects={double_effects} \
         lost={lost} in {:.0?}",
        broker.name(),
        store.name(),
        started.elapsed()
    );
    assert_eq!(
        (double_effects, lost),
        (0, 0),
        "{broker:?}/{store:?}: {total} rows for {done} of {keys} keys; \
         children said:\n{}",
        tails.join("\n---\n")
    );
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_kafka_postgres() {
    soak("chaos_kafka_postgres", Broker::Kafka, Store::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_rabbitmq_postgres() {
    soak("chaos_rabbitmq_postgres", Broker::RabbitMq, Store::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_rocketmq_postgres() {
    soak("chaos_rocketmq_postgres", Broker::RocketMq, Store::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_kafka_mysql() {
    soak("chaos_kafka_mysql", Broker::Kafka, Store::MySql).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_rabbitmq_mysql() {
    soak("chaos_rabbitmq_mysql", Broker::RabbitMq, Store::MySql).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_rocketmq_mysql() {
    soak("chaos_rocketmq_mysql", Broker::RocketMq, Store::MySql).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_kafka_redis() {
    soak("chaos_kafka_redis", Broker::Kafka, Store::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_rabbitmq_redis() {
    soak("chaos_rabbitmq_redis", Broker::RabbitMq, Store::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_rocketmq_redis() {
    soak("chaos_rocketmq_redis", Broker::RocketMq, Store::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_kafka_layered() {
    soak("chaos_kafka_layered", Broker::Kafka, Store::Layered).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_rabbitmq_layered() {
    soak("chaos_rabbitmq_layered", Broker::RabbitMq, Store::Layered).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_rocketmq_layered() {
    soak("chaos_rocketmq_layered", Broker::RocketMq, Store::Layered).await;
}
