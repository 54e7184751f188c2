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
//!   writes without idemq; at-least-once with idempotent rows; one row written per message);
//! - **bound3**: the same consumer writing, per batch, what a dedup table with leases writes,
//!   raw: the batch's claims into a table shaped like the dedup table (autocommit), then one
//!   transaction with the effect rows and the claims' completion (three rows per message);
//! - **idemq + memory store**: the engine over the adapter's `Source`, against *bare*;
//! - **unique-keyed**: the engine over the store's unique index with
//!   [`SqlStore::keyed_batch_handler`](idemq::sql::SqlStore::keyed_batch_handler): the effect
//!   rows carry the key, one `INSERT … ON CONFLICT DO NOTHING RETURNING` per batch (the
//!   default for effect rows in the store's own database), against *hand-written*;
//! - **unique**: the same with [`SqlStore::batch_handler`](idemq::sql::SqlStore::batch_handler)
//!   (the batch's keys into the keys table, then its effect rows, one transaction);
//! - **batch-redis**: [`idemq::handler::batch`] writing the batch's effect rows with one
//!   [`EffectSink::insert_batch`], claims and completions in Redis, against *hand-written*;
//! - **batch-postgres**: `batch_handler` over the PostgreSQL dedup table with leases (claim,
//!   effect and completion rows), against *bound3*;
//! - **postgres**, **redis**: the per-message handler (one effect insert per message) over
//!   each store, for comparison.
//!
//! Adding a broker is one `impl BrokerBench` in its own module; nothing here knows a broker.

use idemq::sql::{PgStore, SqlResultExt, SqlStoreOptions, TableName};
use idemq::{
    async_trait, ClaimedMessage, ConsumerConfig, DedupStore, Handler, HandlerError,
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
///
/// A sink made by [`EffectSink::bound3`] also writes what a dedup table with leases writes
/// around each batch, raw (see [`EffectSink::insert_batch`]): the bound the engine's
/// leases-mode batch handler is measured against, through every broker's own
/// [`BrokerBench::handwritten`].
#[derive(Clone)]
pub struct EffectSink {
    pool: PgPool,
    table: String,
    /// The claims table of a [`EffectSink::bound3`] sink.
    claims: Option<String>,
    /// [`EffectSink::insert_batch`] calls (shared by clones), for the mean batch size a
    /// hand-written consumer wrote.
    batches: Arc<AtomicUsize>,
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
        Ok(Self {
            pool,
            table,
            claims: None,
            batches: Arc::default(),
        })
    }

    /// The same effect table, written with the three statements of a dedup table with
    /// leases around each batch: creates a claims table shaped like the PostgreSQL store's
    /// dedup table (its columns, key collation and index).
    pub async fn bound3(&self) -> anyhow::Result<Self> {
        let claims = format!("{}_claims", self.table);
        sqlx::query(&format!(
            "CREATE TABLE {claims} (\
             dedup_key VARCHAR(257) COLLATE \"C\" NOT NULL PRIMARY KEY, \
             status BIGINT NOT NULL, token BIGINT NOT NULL, lease_until_ms BIGINT NOT NULL, \
             attempts BIGINT NOT NULL, took_over BIGINT NOT NULL DEFAULT 0, payload_hash BYTEA, \
             result BYTEA, first_seen_ms BIGINT NOT NULL, completed_ms BIGINT, \
             expires_ms BIGINT, worker TEXT)"
        ))
        .execute(&self.pool)
        .await?;
        sqlx::query(&format!(
            "CREATE INDEX {claims}_expires_idx ON {claims} (expires_ms) WHERE status = 1"
        ))
        .execute(&self.pool)
        .await?;
        Ok(Self {
            claims: Some(claims),
            batches: Arc::default(),
            ..self.clone()
        })
    }

    /// The pool the table lives on.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The multi-row effect insert: `$1` keys, `$2` payloads (text arrays); rows already
    /// there are left alone.
    fn insert_sql(&self) -> String {
        format!(
            "INSERT INTO {} (msg_key, payload) SELECT * FROM UNNEST($1::text[], $2::text[]) \
             ON CONFLICT (msg_key) DO NOTHING",
            self.table
        )
    }

    /// Writes one effect row per `(key, payload)` in one statement; rows already there are
    /// left alone (`ON CONFLICT DO NOTHING`).
    ///
    /// A [`EffectSink::bound3`] sink first claims the keys with one multi-row
    /// `INSERT … ON CONFLICT DO NOTHING RETURNING` into its claims table (autocommit, as the
    /// store's claim round trip), then writes the effect rows of the keys it claimed and
    /// completes their claims (one `UPDATE … FROM UNNEST`, fenced by token) in one
    /// transaction.
    pub async fn insert_batch(&self, rows: &[(String, String)]) -> anyhow::Result<()> {
        self.batches.fetch_add(1, Ordering::Relaxed);
        let Some(claims) = &self.claims else {
            let (keys, payloads): (Vec<&str>, Vec<&str>) =
                rows.iter().map(|(k, p)| (k.as_str(), p.as_str())).unzip();
            sqlx::query(&self.insert_sql())
                .bind(keys)
                .bind(payloads)
                .execute(&self.pool)
                .await?;
            return Ok(());
        };
        let now = idemq::now_ms();
        let keys: Vec<&str> = rows.iter().map(|(k, _)| k.as_str()).collect();
        let tokens: Vec<i64> = rows.iter().map(|_| rand::random::<i64>()).collect();
        let claimed: Vec<(String,)> = sqlx::query_as(&format!(
            "INSERT INTO {claims} (dedup_key, status, token, lease_until_ms, attempts, \
             took_over, first_seen_ms) SELECT v.k, 0, v.tok, $3, 1, 0, $4 \
             FROM UNNEST($1::text[], $2::bigint[]) AS v(k, tok) \
             ON CONFLICT (dedup_key) DO NOTHING RETURNING dedup_key"
        ))
        .bind(&keys)
        .bind(&tokens)
        .bind(now + 30_000)
        .bind(now)
        .fetch_all(&self.pool)
        .await?;
        if claimed.is_empty() {
            return Ok(());
        }
        let mine: std::collections::HashSet<&str> = claimed.iter().map(|(k,)| k.as_str()).collect();
        let (mut keys, mut payloads, mut toks) = (Vec::new(), Vec::new(), Vec::new());
        for ((k, p), t) in rows.iter().zip(&tokens) {
            if mine.contains(k.as_str()) {
                keys.push(k.as_str());
                payloads.push(p.as_str());
                toks.push(*t);
            }
        }
        let mut tx = self.pool.begin().await?;
        sqlx::query(&self.insert_sql())
            .bind(&keys)
            .bind(payloads)
            .execute(&mut *tx)
            .await?;
        let done = sqlx::query(&format!(
            "UPDATE {claims} AS t SET status = 1, completed_ms = $3, expires_ms = $4 \
             FROM UNNEST($1::text[], $2::bigint[]) AS v(k, tok) \
             WHERE t.dedup_key = v.k AND t.token = v.tok AND t.status = 0"
        ))
        .bind(&keys)
        .bind(&toks)
        .bind(now)
        .bind(now + 7 * 24 * 3_600_000)
        .execute(&mut *tx)
        .await?;
        anyhow::ensure!(
            done.rows_affected() == keys.len() as u64,
            "bound3: {} of {} claims completed",
            done.rows_affected(),
            keys.len()
        );
        tx.commit().await?;
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

    /// [`EffectSink::insert_batch`] calls since the last [`EffectSink::clear`].
    pub fn batches(&self) -> usize {
        self.batches.load(Ordering::Relaxed)
    }

    /// Empties the table (and the claims table) between runs.
    pub async fn clear(&self) -> anyhow::Result<()> {
        self.batches.store(0, Ordering::Relaxed);
        for t in std::iter::once(&self.table).chain(&self.claims) {
            sqlx::query(&format!("TRUNCATE {t}"))
                .execute(&self.pool)
                .await?;
        }
        Ok(())
    }

    /// Drops the table (and the claims table).
    pub async fn drop_table(&self) -> anyhow::Result<()> {
        for t in self.claims.iter().chain(std::iter::once(&self.table)) {
            sqlx::query(&format!("DROP TABLE IF EXISTS {t}"))
                .execute(&self.pool)
                .await?;
        }
        Ok(())
    }
}

/// The effect rows of claimed messages, as the sink's insert binds them: keys
/// (`msg.key`, the dedup key) and payloads.
fn effect_rows(msgs: &[ClaimedMessage]) -> (Vec<String>, Vec<String>) {
    msgs.iter()
        .map(|m| {
            (
                m.key.as_str().to_owned(),
                String::from_utf8_lossy(&m.envelope.payload).into_owned(),
            )
        })
        .unzip()
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
}

/// Counts the effects a measured consumer wrote and says when all `n` are in.
struct Progress {
    done: AtomicUsize,
    /// Handler calls that wrote effects (batches, for a batch handler).
    calls: AtomicUsize,
    finished: tokio::sync::Notify,
    n: usize,
}

impl Progress {
    fn new(n: usize) -> Arc<Self> {
        Arc::new(Self {
            done: AtomicUsize::new(0),
            calls: AtomicUsize::new(0),
            finished: tokio::sync::Notify::new(),
            n,
        })
    }

    fn add(&self, written: usize) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        if self.done.fetch_add(written, Ordering::AcqRel) + written >= self.n {
            self.finished.notify_one();
        }
    }

    fn done(&self) -> usize {
        self.done.load(Ordering::Acquire)
    }
}

/// Runs `consumer` on `source` until `progress` counted its `n` messages, then stops it:
/// the time until it began to close its source. Logs the run's handler calls and mean
/// batch at info (`IDEMQ_LOG=idemq::bench=info`).
async fn timed<H: Handler>(
    source: &mut (dyn Source + '_),
    consumer: IdempotentConsumer<H>,
    progress: &Progress,
    what: &str,
) -> anyhow::Result<Duration> {
    let mut source = ClockedSource::new(source);
    let t = Instant::now();
    consumer
        .run(&mut source, progress.finished.notified())
        .await?;
    let elapsed = source.elapsed_since(t);
    let calls = progress.calls.load(Ordering::Relaxed);
    tracing::info!(
        consumer = what,
        messages = progress.done(),
        handler_calls = calls,
        mean_batch = progress.done() as f64 / calls.max(1) as f64,
        rate = progress.done() as f64 / elapsed.as_secs_f64().max(1e-9),
        "bench run"
    );
    anyhow::ensure!(
        progress.done() >= progress.n,
        "the idempotent consumer ({what}) stopped after {} of {} messages",
        progress.done(),
        progress.n
    );
    Ok(elapsed)
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
    let progress = Progress::new(n);
    let count = progress.clone();
    let handler = move |m: ClaimedMessage| {
        let (count, sink) = (count.clone(), sink.clone());
        async move {
            if let Some(sink) = &sink {
                sink.insert_one(m.key.as_str(), &m.envelope.payload)
                    .await
                    .map_err(HandlerError::retryable)?;
            }
            count.add(1);
            Ok(None)
        }
    };
    let consumer = IdempotentConsumer::new(store, keys, handler).with_config(cfg);
    timed(source, consumer, &progress, "per-message handler").await
}

/// How a measured batch-handler consumer writes its effect rows, and where its keys go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchShape {
    /// `keyed_batch_handler` over the store's unique index: the effect table's unique
    /// column is the dedup, one `INSERT … ON CONFLICT DO NOTHING RETURNING msg_key` per
    /// batch (one write per message, as the hand-written consumer).
    UniqueKeyed,
    /// `batch_handler` over the store's unique index: the batch's keys into the keys table,
    /// then its effect rows, in one transaction (two writes per message).
    Unique,
    /// `batch_handler` over the dedup table with leases: claims in one round trip, then
    /// the effect rows and the completions in one transaction (three writes per message).
    Leases,
    /// [`idemq::handler::batch`] over the given store (Redis): one
    /// [`EffectSink::insert_batch`] per batch, completions by the engine afterwards.
    Plain,
}

impl BatchShape {
    /// The consumer's name in `--consumers` and the results.
    pub fn name(self) -> &'static str {
        match self {
            BatchShape::UniqueKeyed => "unique-keyed",
            BatchShape::Unique => "unique",
            BatchShape::Leases => "batch-postgres",
            BatchShape::Plain => "batch-redis",
        }
    }
}

/// Runs the engine with a batch handler of `shape` until the run's messages are written: the SQL
/// shapes over `pg` (its unique index, or the store itself for leases), [`BatchShape::Plain`]
/// over `store`.
pub async fn run_batch(
    source: &mut (dyn Source + '_),
    keys: KeyStrategy,
    pg: &PgStore,
    store: Option<Arc<dyn DedupStore>>,
    sink: EffectSink,
    run: &BrokerRun,
    shape: BatchShape,
) -> anyhow::Result<Duration> {
    let cfg = run.consumer_config();
    let progress = Progress::new(run.messages.max(1));
    let count = progress.clone();
    let insert = sink.insert_sql();
    let what = shape.name();
    match shape {
        BatchShape::UniqueKeyed => {
            let insert = format!("{insert} RETURNING msg_key");
            let handler = pg.keyed_batch_handler(move |tx, msgs| {
                let (insert, count) = (insert.clone(), count.clone());
                let (keys, payloads) = effect_rows(msgs);
                Box::pin(async move {
                    let written: Vec<(String,)> = sqlx::query_as(&insert)
                        .bind(keys)
                        .bind(payloads)
                        .fetch_all(&mut *tx)
                        .await
                        .classify()?;
                    count.add(written.len());
                    Ok(written.into_iter().map(|(k,)| k).collect())
                })
            });
            let store = Arc::new(pg.unique_index());
            let consumer = IdempotentConsumer::new(store, keys, handler).with_config(cfg);
            timed(source, consumer, &progress, what).await
        }
        BatchShape::Unique | BatchShape::Leases => {
            let handler = pg.batch_handler(move |tx, msgs| {
                let (insert, count) = (insert.clone(), count.clone());
                let (keys, payloads) = effect_rows(msgs);
                Box::pin(async move {
                    sqlx::query(&insert)
                        .bind(keys)
                        .bind(payloads)
                        .execute(&mut *tx)
                        .await
                        .classify()?;
                    count.add(msgs.len());
                    Ok(())
                })
            });
            let store: Arc<dyn DedupStore> = match shape {
                BatchShape::Unique => Arc::new(pg.unique_index()),
                _ => Arc::new(pg.clone()),
            };
            let consumer = IdempotentConsumer::new(store, keys, handler).with_config(cfg);
            timed(source, consumer, &progress, what).await
        }
        BatchShape::Plain => {
            let store = store.ok_or_else(|| anyhow::anyhow!("{what} needs its store"))?;
            let handler = idemq::handler::batch((sink, count), |(sink, count), msgs| async move {
                let rows: Vec<(String, String)> = msgs
                    .iter()
                    .map(|m| {
                        (
                            m.key.as_str().to_owned(),
                            String::from_utf8_lossy(&m.envelope.payload).into_owned(),
                        )
                    })
                    .collect();
                sink.insert_batch(&rows)
                    .await
                    .map_err(HandlerError::retryable)?;
                count.add(msgs.len());
                Ok(())
            });
            let consumer = IdempotentConsumer::new(store, keys, handler).with_config(cfg);
            timed(source, consumer, &progress, what).await
        }
    }
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
    /// Which consumers to measure.
    pub consumers: Consumers,
}

/// The consumers a broker run measures (`--consumers`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Consumers(Vec<&'static str>);

impl Consumers {
    /// Every consumer's name, in the order they run.
    pub const NAMES: [&'static str; 11] = [
        "bare",
        "memory",
        "handwritten",
        "bound3",
        "unique-keyed",
        "unique",
        "batch-redis",
        "batch-postgres",
        "postgres",
        "redis",
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
    /// Hand-written `ON CONFLICT` consumer (one row written per message).
    pub handwritten: Option<Duration>,
    /// The hand-written consumer writing a dedup table's three rows per message, raw
    /// ([`EffectSink::bound3`]).
    pub bound3: Option<Duration>,
    /// Batch handler over the unique index, effect rows carrying the keys.
    pub unique_keyed: Option<Duration>,
    /// Batch handler over the unique index, keys table + effect rows.
    pub unique: Option<Duration>,
    /// `handler::batch` + Redis store, effect rows in PostgreSQL.
    pub batch_redis: Option<Duration>,
    /// Batch handler over the PostgreSQL dedup table with leases.
    pub batch_postgres: Option<Duration>,
    /// Engine + PostgreSQL store + effect row per message.
    pub postgres: Option<Duration>,
    /// Engine + Redis store + effect row per message (in PostgreSQL).
    pub redis: Option<Duration>,
}

impl BrokerFigures {
    fn batch_slot(&mut self, shape: BatchShape) -> &mut Option<Duration> {
        match shape {
            BatchShape::UniqueKeyed => &mut self.unique_keyed,
            BatchShape::Unique => &mut self.unique,
            BatchShape::Plain => &mut self.batch_redis,
            BatchShape::Leases => &mut self.batch_postgres,
        }
    }
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
            let sink = EffectSink::create(pool).await?;
            let bound = sink.bound3().await?;
            Some((sink, bound, Arc::new(store)))
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
        let Some((sink, bound, pg_store)) = &pg else {
            continue;
        };
        for (name, with, slot) in [
            ("handwritten", sink, &mut f.handwritten),
            ("bound3", bound, &mut f.bound3),
        ] {
            if !wants(name) {
                continue;
            }
            with.clear().await?;
            let dest = bench.fill(n).await?;
            let t = bench.handwritten(&dest, n, with).await?;
            tracing::info!(
                consumer = name,
                messages = n,
                handler_calls = with.batches(),
                mean_batch = n as f64 / with.batches().max(1) as f64,
                rate = n as f64 / t.as_secs_f64().max(1e-9),
                "bench run"
            );
            keep_best(slot, t);
            anyhow::ensure!(sink.count().await? == n as i64, "{name} effects");
        }
        for shape in [
            BatchShape::UniqueKeyed,
            BatchShape::Unique,
            BatchShape::Plain,
            BatchShape::Leases,
        ] {
            let store = match shape {
                BatchShape::Plain => match &redis {
                    Some(r) => Some(r.clone()),
                    None => continue,
                },
                _ => None,
            };
            if !wants(shape.name()) {
                continue;
            }
            let mut src = refilled(bench, sink, n).await?;
            let t = run_batch(
                src.as_mut(),
                bench.keys()?,
                pg_store,
                store,
                sink.clone(),
                run,
                shape,
            )
            .await?;
            anyhow::ensure!(
                sink.count().await? == n as i64,
                "idemq {} effects",
                shape.name()
            );
            keep_best(f.batch_slot(shape), t);
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
    }
    if let Some((sink, bound, store)) = &pg {
        bound.drop_table().await?;
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
        "{name}: best of {} interleaved rounds, {n} messages, batch {}, idemq pipeline depth {}",
        run.rounds.max(1),
        run.batch,
        run.pipeline_depth,
    );
    let line = |label: &str, t: Option<Duration>, vs: String| {
        if let Some(t) = t {
            println!("  {label:<50} {:>10.0} msgs/s  {vs}", rate(t));
        }
    };
    let vs = |ours: Option<Duration>, base: Option<Duration>, of: &str, target: &str| {
        format!("{} of {of} ({target})", ratio(ours, base))
    };
    let hw = f.handwritten;
    line("bare consumer (manual ack/commit)", f.bare, "1.00x".into());
    line(
        "idemq + memory store",
        f.memory,
        vs(f.memory, f.bare, "bare", "reported"),
    );
    line(
        "hand-written INSERT … ON CONFLICT consumer",
        hw,
        "1.00x".into(),
    );
    line(
        "unique-keyed: batch handler, keyed effect rows",
        f.unique_keyed,
        vs(f.unique_keyed, hw, "hand-written", "target >= 1.00"),
    );
    line(
        "unique: batch handler, keys table + effect rows",
        f.unique,
        vs(f.unique, hw, "hand-written", "reported"),
    );
    line(
        "batch-redis: batch handler + Redis store",
        f.batch_redis,
        vs(f.batch_redis, hw, "hand-written", "target >= 0.80"),
    );
    line(
        "bound3: hand-written claim + effect + completion",
        f.bound3,
        vs(f.bound3, hw, "hand-written", "reported"),
    );
    line(
        "batch-postgres: batch handler, dedup table + leases",
        f.batch_postgres,
        vs(f.batch_postgres, f.bound3, "bound3", "target >= 0.80"),
    );
    line(
        "postgres: per-message handler, PostgreSQL store",
        f.postgres,
        vs(f.postgres, hw, "hand-written", "reported"),
    );
    line(
        "redis: per-message handler, Redis store",
        f.redis,
        vs(f.redis, hw, "hand-written", "reported"),
    );
}
