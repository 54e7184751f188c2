//! `idemq bench --brokers …`: each broker adapter against the consumers its users would
//! otherwise write, measured side by side in one run.
//!
//! Every broker answers the same four questions through [`BrokerBench`]; this module runs
//! them in interleaved rounds (noise on a shared machine only slows a run down, so the best
//! time of each is kept) and prints ratios:
//!
//! - **bare**: the broker's own consumer, manual ack/commit, no dedup at all;
//! - **hand-written**: the same consumer writing each batch's effect rows with one
//!   `INSERT … ON CONFLICT (msg_key) DO NOTHING` on PostgreSQL, then acking (what a team
//!   writes without idemq; at-least-once with idempotent rows);
//! - **idemq + memory store**: the engine over the adapter's `Source`, against *bare*;
//! - **idemq + PostgreSQL store**: the engine with a handler that inserts the same effect row,
//!   against *hand-written*;
//! - **idemq unique index + PostgreSQL**: `UniqueIndexConsumer` with a batch handler (the
//!   batch's keys and effect rows in one transaction), against *hand-written*.
//!
//! Adding a broker is one `impl BrokerBench` in its own module; nothing here knows a broker.

use idemq::sql::unique::{UniqueIndexConfig, UniqueIndexConsumer};
use idemq::sql::{PgStore, SqlResultExt, SqlStoreOptions, TableName};
use idemq::{
    async_trait, Capabilities, ClaimedMessage, ConsumerConfig, DedupStore, HandlerError,
    IdempotentConsumer, KeyStrategy, MemoryStore, Source, SourceError,
};
use sqlx::PgPool;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The key every benchmark message carries, in the broker's native key slot and in
/// [`idemq::DEDUP_HEADER`]: `m-<i>` for message `i`.
pub fn bench_key(i: usize) -> String {
    format!("m-{i}")
}

/// The payload of benchmark message `i` (about 64 bytes, like a small callback).
pub fn bench_payload(i: usize) -> String {
    format!("{{\"order\":{i},\"amount_cents\":1999,\"currency\":\"EUR\",\"v\":1}}")
}

/// What one broker adapter gives the broker benchmark.
#[async_trait]
pub trait BrokerBench: Send + Sync {
    /// Short name for the report ("kafka", "rabbitmq", …).
    fn name(&self) -> &'static str;

    /// Creates a fresh destination (topic, queue) holding `n` messages, message `i` with key
    /// [`bench_key`]`(i)` and payload [`bench_payload`]`(i)`, and returns its name. Called
    /// once per measured run, so every consumer starts from a full destination.
    async fn fill(&self, n: usize) -> anyhow::Result<String>;

    /// The broker's own consumer on `dest` (a fresh group), acking or committing what it
    /// receives as its users would (manual acks, or a commit per poll), until `n` messages.
    async fn bare(&self, dest: &str, n: usize) -> anyhow::Result<Duration>;

    /// The same consumer, but each received batch is written with one
    /// [`EffectSink::insert_batch`] before it is acked or committed.
    async fn handwritten(
        &self,
        dest: &str,
        n: usize,
        sink: &EffectSink,
    ) -> anyhow::Result<Duration>;

    /// The adapter's [`Source`] on `dest` (a fresh group), for the idempotent consumer.
    async fn source(&self, dest: &str) -> anyhow::Result<Box<dyn Source>>;

    /// The key strategy matching how [`BrokerBench::fill`] stored the key, under a fresh
    /// consumer group on every call: every measured run fills with the same keys `m-<i>`,
    /// and the PostgreSQL store is shared by the rounds (and outlives the run), so under a
    /// fixed group every run after the first found its keys completed, ran no handler, and
    /// never reached its count.
    fn keys(&self) -> anyhow::Result<KeyStrategy> {
        Ok(KeyStrategy::dedup_header(&format!(
            "bench-{:08x}",
            rand::random::<u32>()
        ))?)
    }

    /// Broker-specific comparisons run after the consumers, in the same command (e.g. the
    /// adapter's publisher against the client's own), printing their own report lines with
    /// ratios. None by default.
    async fn extra(&self, _run: &BrokerRun) -> anyhow::Result<()> {
        Ok(())
    }
}

/// The effect table of the benchmark: `msg_key` unique, as a hand-written consumer would
/// make its writes idempotent.
#[derive(Clone)]
pub struct EffectSink {
    pool: PgPool,
    table: String,
}

impl EffectSink {
    /// Creates a fresh effect table on `pool` (name generated, so runs never collide).
    pub async fn create(pool: PgPool) -> anyhow::Result<Self> {
        let table = format!("bench_fx_{:08x}", rand::random::<u32>());
        sqlx::query(&format!(
            "CREATE TABLE {table} (msg_key TEXT PRIMARY KEY, payload TEXT NOT NULL)"
        ))
        .execute(&pool)
        .await?;
        Ok(Self { pool, table })
    }

    /// The pool the table lives on.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Writes one effect row per `(key, payload)` in one statement; rows already there are
    /// left alone (`ON CONFLICT DO NOTHING`).
    pub async fn insert_batch(&self, rows: &[(String, String)]) -> anyhow::Result<()> {
        let (keys, payloads): (Vec<&str>, Vec<&str>) =
            rows.iter().map(|(k, p)| (k.as_str(), p.as_str())).unzip();
        sqlx::query(&format!(
            "INSERT INTO {} (msg_key, payload) SELECT * FROM UNNEST($1::text[], $2::text[]) \
             ON CONFLICT (msg_key) DO NOTHING",
            self.table
        ))
        .bind(keys)
        .bind(payloads)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Writes one effect row (the idempotent consumer's handler).
    pub async fn insert_one(&self, key: &str, payload: &[u8]) -> Result<(), sqlx::Error> {
        sqlx::query(&format!(
            "INSERT INTO {} (msg_key, payload) VALUES ($1, $2) ON CONFLICT (msg_key) DO NOTHING",
            self.table
        ))
        .bind(key)
        .bind(String::from_utf8_lossy(payload).as_ref())
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Rows in the table.
    pub async fn count(&self) -> anyhow::Result<i64> {
        let (n,): (i64,) = sqlx::query_as(&format!("SELECT count(*) FROM {}", self.table))
            .fetch_one(&self.pool)
            .await?;
        Ok(n)
    }

    /// Empties the table between runs.
    pub async fn clear(&self) -> anyhow::Result<()> {
        sqlx::query(&format!("TRUNCATE {}", self.table))
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Drops the table.
    pub async fn drop_table(&self) -> anyhow::Result<()> {
        sqlx::query(&format!("DROP TABLE IF EXISTS {}", self.table))
            .execute(&self.pool)
            .await?;
        Ok(())
    }
}

/// The source of a measured idempotent consumer: it notes when the consumer starts closing
/// it, and the run's clock stops there. The plain consumers' clocks stop at their last
/// batch, before their client is dropped; closing a client (leaving a Kafka group, which
/// waits out a poll and a synchronous commit, or cancelling a RabbitMQ consumer) is a fixed
/// cost of every consumer, not a message's, and timing it for idemq alone had added about
/// 0.14 s (an eighth) to the Kafka adapter's 100 000-message run.
struct ClockedSource<'s, 'a> {
    inner: &'s mut (dyn Source + 'a),
    closing_at: Option<Instant>,
}

impl<'s, 'a> ClockedSource<'s, 'a> {
    fn new(inner: &'s mut (dyn Source + 'a)) -> Self {
        Self {
            inner,
            closing_at: None,
        }
    }

    /// Time from `start` until the close began (or until now, if it has not).
    fn elapsed_since(&self, start: Instant) -> Duration {
        self.closing_at.unwrap_or_else(Instant::now) - start
    }
}

#[async_trait]
impl Source for ClockedSource<'_, '_> {
    async fn poll(&mut self, max: usize) -> Result<Option<Vec<idemq::Delivery>>, SourceError> {
        self.inner.poll(max).await
    }

    async fn after_batch(&mut self) -> Result<(), SourceError> {
        self.inner.after_batch().await
    }

    async fn close(&mut self) -> Result<(), SourceError> {
        self.closing_at.get_or_insert_with(Instant::now);
        self.inner.close().await
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
}

/// Runs the idempotent consumer over `source` until `n` handlers have run, then stops it.
/// With a sink, each handler writes its effect row there (one statement per message).
pub async fn run_engine(
    source: &mut (dyn Source + '_),
    keys: KeyStrategy,
    store: Arc<dyn DedupStore>,
    sink: Option<EffectSink>,
    n: usize,
    cfg: ConsumerConfig,
) -> anyhow::Result<Duration> {
    let done = Arc::new(AtomicUsize::new(0));
    let finished = Arc::new(tokio::sync::Notify::new());
    let (count, notify) = (done.clone(), finished.clone());
    let handler = move |m: ClaimedMessage| {
        let (count, notify, sink) = (count.clone(), notify.clone(), sink.clone());
        async move {
            if let Some(sink) = &sink {
                sink.insert_one(m.key.as_str(), &m.envelope.payload)
                    .await
                    .map_err(HandlerError::retryable)?;
            }
            if count.fetch_add(1, Ordering::AcqRel) + 1 >= n {
                notify.notify_one();
            }
            Ok(None)
        }
    };
    let consumer = IdempotentConsumer::new(store, keys, handler).with_config(cfg);
    let mut source = ClockedSource::new(source);
    let t = Instant::now();
    consumer.run(&mut source, finished.notified()).await?;
    let elapsed = source.elapsed_since(t);
    anyhow::ensure!(
        done.load(Ordering::Acquire) >= n,
        "the idempotent consumer stopped after {} of {n} messages",
        done.load(Ordering::Acquire)
    );
    Ok(elapsed)
}

/// How the unique-index consumer of the benchmark writes its keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UniqueMode {
    /// Batch handler: the batch's keys into the store's keys table, then its effect rows,
    /// in one transaction (two writes per message).
    KeysTable,
    /// The effect table's unique column is the dedup: one `INSERT … ON CONFLICT DO NOTHING
    /// RETURNING msg_key` per batch (one write per message, as the hand-written consumer).
    KeyedEffects,
}

/// Runs the unique-index consumer in `mode` until `n` effects are written.
pub async fn run_unique(
    source: &mut (dyn Source + '_),
    keys: KeyStrategy,
    store: PgStore,
    sink: EffectSink,
    n: usize,
    cfg: UniqueIndexConfig,
    mode: UniqueMode,
) -> anyhow::Result<Duration> {
    let done = Arc::new(AtomicUsize::new(0));
    let finished = Arc::new(tokio::sync::Notify::new());
    let (count, notify) = (done.clone(), finished.clone());
    let counted = move |written: usize| {
        if count.fetch_add(written, Ordering::AcqRel) + written >= n {
            notify.notify_one();
        }
    };
    let rows = |msgs: &[&idemq::sql::unique::UniqueMessage]| {
        let keys: Vec<String> = msgs.iter().map(|m| m.key.as_str().to_owned()).collect();
        let payloads: Vec<String> = msgs
            .iter()
            .map(|m| String::from_utf8_lossy(&m.envelope.payload).into_owned())
            .collect();
        (keys, payloads)
    };
    let insert = format!(
        "INSERT INTO {} (msg_key, payload) SELECT * FROM UNNEST($1::text[], $2::text[]) \
         ON CONFLICT (msg_key) DO NOTHING",
        sink.table
    );
    let mut source = ClockedSource::new(source);
    let t = Instant::now();
    match mode {
        UniqueMode::KeysTable => {
            let consumer = UniqueIndexConsumer::from_batch_fn(store, keys, move |msgs, tx| {
                let (counted, insert) = (counted.clone(), insert.clone());
                let (keys, payloads) = rows(msgs);
                let written = msgs.len();
                Box::pin(async move {
                    sqlx::query(&insert)
                        .bind(keys)
                        .bind(payloads)
                        .execute(&mut *tx)
                        .await
                        .classify()?;
                    counted(written);
                    Ok(())
                })
            })
            .with_config(cfg);
            consumer.run(&mut source, finished.notified()).await?;
        }
        UniqueMode::KeyedEffects => {
            let insert = format!("{insert} RETURNING msg_key");
            let consumer =
                UniqueIndexConsumer::from_keyed_batch_fn(store, keys, move |msgs, tx| {
                    let (counted, insert) = (counted.clone(), insert.clone());
                    let (keys, payloads) = rows(msgs);
                    Box::pin(async move {
                        let written: Vec<(String,)> = sqlx::query_as(&insert)
                            .bind(keys)
                            .bind(payloads)
                            .fetch_all(&mut *tx)
                            .await
                            .classify()?;
                        counted(written.len());
                        Ok(written.into_iter().map(|(k,)| k).collect())
                    })
                })
                .with_config(cfg);
            consumer.run(&mut source, finished.notified()).await?;
        }
    }
    let elapsed = source.elapsed_since(t);
    anyhow::ensure!(
        done.load(Ordering::Acquire) >= n,
        "the unique-index consumer ({mode:?}) stopped after {} of {n} messages",
        done.load(Ordering::Acquire)
    );
    Ok(elapsed)
}

/// Options shared by every broker's run.
pub struct BrokerRun {
    /// Messages per measured run.
    pub messages: usize,
    /// Deliveries per poll.
    pub batch: usize,
    /// Interleaved rounds; the best time of each consumer is kept.
    pub rounds: usize,
    /// PostgreSQL for the effect table and the PostgreSQL store (skipped when `None`).
    pub postgres_url: Option<String>,
    /// Redis for the engine over the Redis store (effect rows still in PostgreSQL; skipped
    /// when `None` or without the `redis` feature).
    pub redis_url: Option<String>,
    /// `ConsumerConfig::pipeline_depth` of the idempotent consumers.
    pub pipeline_depth: usize,
    /// `UniqueIndexConfig::pipeline_depth` of the unique-index consumers.
    pub unique_pipeline_depth: usize,
    /// Which consumers to measure.
    pub consumers: Consumers,
}

/// The consumers a broker run measures (`--consumers`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Consumers(Vec<&'static str>);

impl Consumers {
    /// Every consumer's name, in the order they run.
    pub const NAMES: [&'static str; 8] = [
        "bare",
        "memory",
        "handwritten",
        "postgres",
        "redis",
        "unique",
        "unique-keyed",
        "producer",
    ];

    /// Every consumer.
    pub fn all() -> Self {
        Self(Self::NAMES.to_vec())
    }

    /// The named consumers; an empty list means all of them.
    pub fn parse(names: &[String]) -> anyhow::Result<Self> {
        if names.is_empty() {
            return Ok(Self::all());
        }
        let mut chosen = Vec::new();
        for n in names {
            let Some(known) = Self::NAMES.iter().find(|k| **k == n.trim()) else {
                anyhow::bail!("unknown consumer {n:?} (known: {})", Self::NAMES.join(", "));
            };
            chosen.push(*known);
        }
        Ok(Self(chosen))
    }

    /// Whether `name` is measured.
    pub fn has(&self, name: &str) -> bool {
        // A misspelt name in the bench itself would silently skip a consumer.
        debug_assert!(Self::NAMES.contains(&name), "unknown consumer {name:?}");
        self.0.contains(&name)
    }
}

impl BrokerRun {
    /// The idempotent consumers' settings: the defaults, with this run's batch and
    /// pipeline depth.
    pub fn consumer_config(&self) -> ConsumerConfig {
        ConsumerConfig {
            max_batch: self.batch,
            pipeline_depth: self.pipeline_depth,
            ..ConsumerConfig::default()
        }
    }
}

/// Best times of one broker's consumers.
#[derive(Debug, Default)]
pub struct BrokerFigures {
    /// Bare consumer.
    pub bare: Option<Duration>,
    /// Engine + memory store.
    pub memory: Option<Duration>,
    /// Hand-written `ON CONFLICT` consumer.
    pub handwritten: Option<Duration>,
    /// Engine + PostgreSQL store + effect row per message.
    pub postgres: Option<Duration>,
    /// Engine + Redis store + effect row per message (in PostgreSQL).
    pub redis: Option<Duration>,
    /// Unique-index consumer with a batch handler: keys and effect rows of a batch in one
    /// PostgreSQL transaction (one key insert, one effect insert, one commit).
    pub unique: Option<Duration>,
    /// Unique-index consumer whose effect rows carry the keys: one insert, one commit.
    pub unique_keyed: Option<Duration>,
}

/// The Redis store of the run (its own key prefix), when a URL is given and the binary has
/// the `redis` feature.
async fn redis_store(run: &BrokerRun) -> anyhow::Result<Option<Arc<dyn DedupStore>>> {
    #[cfg(feature = "redis")]
    if let Some(url) = &run.redis_url {
        let store = idemq::redis::RedisStore::builder(url)
            .prefix(format!("bench-broker-{:08x}", rand::random::<u32>()))
            .connect()
            .await?;
        return Ok(Some(Arc::new(store)));
    }
    let _ = run;
    Ok(None)
}

/// Empties the effect table, fills a destination, runs the engine over `store` with a
/// handler writing each effect row, and checks that `n` rows were written.
async fn engine_into(
    bench: &dyn BrokerBench,
    sink: &EffectSink,
    store: Arc<dyn DedupStore>,
    run: &BrokerRun,
    what: &str,
) -> anyhow::Result<Duration> {
    let n = run.messages.max(1);
    let mut src = refilled(bench, sink, n).await?;
    let t = run_engine(
        src.as_mut(),
        bench.keys()?,
        store,
        Some(sink.clone()),
        n,
        run.consumer_config(),
    )
    .await?;
    anyhow::ensure!(sink.count().await? == n as i64, "{what} effects");
    Ok(t)
}

/// An empty effect table and the adapter's source on a fresh destination of `n` messages:
/// the start of every measured run that writes effects through idemq.
async fn refilled(
    bench: &dyn BrokerBench,
    sink: &EffectSink,
    n: usize,
) -> anyhow::Result<Box<dyn Source>> {
    sink.clear().await?;
    let dest = bench.fill(n).await?;
    bench.source(&dest).await
}

fn keep_best(slot: &mut Option<Duration>, t: Duration) {
    *slot = Some(slot.map_or(t, |s| s.min(t)));
}

/// Measures one broker and prints its report.
pub async fn measure(bench: &dyn BrokerBench, run: &BrokerRun) -> anyhow::Result<BrokerFigures> {
    let n = run.messages.max(1);
    let pg = match &run.postgres_url {
        Some(url) => {
            let pool = PgPool::connect(url).await?;
            // A table of its own, dropped at the end: nothing left behind in a shared
            // database's default table.
            let table = TableName::new(&format!("bench_dd_{:08x}", rand::random::<u32>()))?;
            let store = PgStore::connect(url, SqlStoreOptions::with_table(table)).await?;
            Some((EffectSink::create(pool).await?, Arc::new(store)))
        }
        None => None,
    };
    let redis = redis_store(run).await?;
    let mut f = BrokerFigures::default();
    for round in 0..run.rounds.max(1) {
        tracing::info!(broker = bench.name(), round, "bench round");
        let wants = |name: &str| run.consumers.has(name);
        if wants("bare") {
            let dest = bench.fill(n).await?;
            keep_best(&mut f.bare, bench.bare(&dest, n).await?);
        }
        if wants("memory") {
            let dest = bench.fill(n).await?;
            let mut src = bench.source(&dest).await?;
            let mem: Arc<dyn DedupStore> = Arc::new(MemoryStore::new());
            let t = run_engine(
                src.as_mut(),
                bench.keys()?,
                mem,
                None,
                n,
                run.consumer_config(),
            )
            .await?;
            keep_best(&mut f.memory, t);
        }
        if let Some((sink, pg_store)) = &pg {
            if wants("handwritten") {
                sink.clear().await?;
                let dest = bench.fill(n).await?;
                keep_best(&mut f.handwritten, bench.handwritten(&dest, n, sink).await?);
                anyhow::ensure!(sink.count().await? == n as i64, "hand-written effects");
            }
            if wants("postgres") {
                let store: Arc<dyn DedupStore> = pg_store.clone();
                let t = engine_into(bench, sink, store, run, "idemq + PostgreSQL").await?;
                keep_best(&mut f.postgres, t);
            }
            if let (Some(redis), true) = (&redis, wants("redis")) {
                let t = engine_into(bench, sink, redis.clone(), run, "idemq + Redis").await?;
                keep_best(&mut f.redis, t);
            }
            for (mode, slot) in [
                (UniqueMode::KeysTable, &mut f.unique),
                (UniqueMode::KeyedEffects, &mut f.unique_keyed),
            ] {
                let name = match mode {
                    UniqueMode::KeysTable => "unique",
                    UniqueMode::KeyedEffects => "unique-keyed",
                };
                if !wants(name) {
                    continue;
                }
                let mut src = refilled(bench, sink, n).await?;
                let t = run_unique(
                    src.as_mut(),
                    bench.keys()?,
                    PgStore::clone(pg_store),
                    sink.clone(),
                    n,
                    UniqueIndexConfig::default()
                        .with_max_batch(run.batch)
                        .with_pipeline_depth(run.unique_pipeline_depth),
                    mode,
                )
                .await?;
                anyhow::ensure!(
                    sink.count().await? == n as i64,
                    "idemq unique-index effects ({mode:?})"
                );
                keep_best(slot, t);
            }
        }
    }
    if let Some((sink, store)) = &pg {
        sink.drop_table().await?;
        for t in store.tables() {
            sqlx::query(&format!("DROP TABLE IF EXISTS {t}"))
                .execute(sink.pool())
                .await?;
        }
    }
    print_report(bench.name(), n, run, &f);
    bench.extra(run).await?;
    Ok(f)
}

fn print_report(name: &str, n: usize, run: &BrokerRun, f: &BrokerFigures) {
    let rate = |d: Duration| n as f64 / d.as_secs_f64().max(1e-9);
    let ratio = |ours: Option<Duration>, base: Option<Duration>| match (ours, base) {
        (Some(o), Some(b)) => format!("{:.2}x", b.as_secs_f64() / o.as_secs_f64().max(1e-9)),
        _ => "-".into(),
    };
    println!(
        "{name}: best of {} interleaved rounds, {n} messages, batch {}, idemq pipeline depth {} (unique index {})",
        run.rounds.max(1),
        run.batch,
        run.pipeline_depth,
        run.unique_pipeline_depth
    );
    let line = |label: &str, t: Option<Duration>, vs: String| {
        if let Some(t) = t {
            println!("  {label:<42} {:>10.0} msgs/s  {vs}", rate(t));
        }
    };
    line("bare consumer (manual ack/commit)", f.bare, "1.00x".into());
    line(
        "idemq + memory store",
        f.memory,
        format!("{} of bare (reported)", ratio(f.memory, f.bare)),
    );
    line(
        "hand-written INSERT … ON CONFLICT consumer",
        f.handwritten,
        "1.00x".into(),
    );
    line(
        "idemq + PostgreSQL store",
        f.postgres,
        format!(
            "{} of hand-written (target >= 0.80)",
            ratio(f.postgres, f.handwritten)
        ),
    );
    line(
        "idemq + Redis store",
        f.redis,
        format!(
            "{} of hand-written (target >= 0.80)",
            ratio(f.redis, f.handwritten)
        ),
    );
    line(
        "idemq unique index, keys table + effects",
        f.unique,
        format!(
            "{} of hand-written (target >= 0.80)",
            ratio(f.unique, f.handwritten)
        ),
    );
    line(
        "idemq unique index, keyed effect rows",
        f.unique_keyed,
        format!(
            "{} of hand-written (target >= 0.80)",
            ratio(f.unique_keyed, f.handwritten)
        ),
    );
}
