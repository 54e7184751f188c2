//! `idemq bench --brokers kafka`: the Kafka adapter against plain rdkafka consumers, and the
//! transactional producer against the idempotent one.
//!
//! Every consumer's clock starts when its first record is in hand (after the group join and
//! the first fetch), so a join's few hundred milliseconds do not swamp the per-message cost:
//! the bare and hand-written consumers start timing at their first record, and
//! [`KafkaBench::source`] returns a source that already holds its first batch.

use super::broker::{bench_key, bench_payload, BrokerBench, BrokerRun, EffectSink};
use idemq::kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use idemq::kafka::rdkafka::client::DefaultClientContext;
use idemq::kafka::rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use idemq::kafka::rdkafka::error::{KafkaError, RDKafkaErrorCode};
use idemq::kafka::rdkafka::message::{Header, OwnedHeaders};
use idemq::kafka::rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use idemq::kafka::rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
use idemq::kafka::{
    commit_transaction, KafkaProducerConfig, KafkaPublisher, KafkaSource, KafkaSourceConfig,
};
use idemq::{async_trait, Delivery, OutgoingMessage, Publisher, Source, SourceError};
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Partitions of every benchmark topic.
const PARTITIONS: i32 = 4;
/// The transaction interval of the producer comparison.
const COMMIT_INTERVAL: Duration = Duration::from_millis(100);

/// Key, payload, partition and offset of a consumed record.
type Row = (String, String, i32, i64);

fn row<M: Message>(m: &M) -> Row {
    let text = |b: Option<&[u8]>| b.map(|b| String::from_utf8_lossy(b).into_owned());
    (
        text(m.key()).unwrap_or_default(),
        text(m.payload()).unwrap_or_default(),
        m.partition(),
        m.offset(),
    )
}

/// The Kafka side of the broker benchmark.
pub struct KafkaBench {
    brokers: String,
    publisher: KafkaPublisher,
    /// Records per batch of the plain consumers (and of the source's first poll), the
    /// run's `--batch`, as the idempotent consumers' `max_batch`.
    batch: usize,
}

impl KafkaBench {
    /// On `IDEMQ_TEST_KAFKA_BROKERS` (what `scripts/servers.sh env` exports), else
    /// 127.0.0.1:19092 (the port `scripts/servers.sh` starts Kafka on), with the plain
    /// consumers taking up to `batch` records per batch.
    pub async fn from_env(batch: usize) -> anyhow::Result<Self> {
        let brokers = std::env::var("IDEMQ_TEST_KAFKA_BROKERS")
            .ok()
            .filter(|b| !b.is_empty())
            .unwrap_or_else(|| "127.0.0.1:19092".to_string());
        let publisher = KafkaPublisher::connect(&KafkaProducerConfig::idempotent(&brokers)).await?;
        Ok(Self {
            brokers,
            publisher,
            batch: batch.max(1),
        })
    }

    fn unique(prefix: &str) -> String {
        format!("{prefix}-{:08x}", rand::random::<u32>())
    }

    fn consumer(&self, group: &str, topic: &str) -> anyhow::Result<StreamConsumer> {
        let c: StreamConsumer = ClientConfig::new()
            .set("bootstrap.servers", &self.brokers)
            .set("group.id", group)
            .set("auto.offset.reset", "earliest")
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .create()?;
        c.subscribe(&[topic])?;
        Ok(c)
    }

    /// Consumes `n` records of `topic` a poll-batch at a time: `on_batch` gets each batch's
    /// `(key, payload)` rows, then the batch's offsets are committed (async, as a consumer
    /// committing per poll does). Timed from the first record.
    async fn consume<F, Fut>(
        &self,
        topic: &str,
        n: usize,
        batch: usize,
        mut on_batch: F,
    ) -> anyhow::Result<Duration>
    where
        F: FnMut(Vec<(String, String)>) -> Fut,
        Fut: std::future::Future<Output = anyhow::Result<()>>,
    {
        use futures::FutureExt;
        let c = self.consumer(&Self::unique("bench-bare"), topic)?;
        let mut seen = 0;
        let mut started = None;
        while seen < n {
            let first = tokio::time::timeout(Duration::from_secs(60), c.recv())
                .await
                .map_err(|_| anyhow::anyhow!("no record within 60 s ({seen} of {n})"))??;
            started.get_or_insert_with(Instant::now);
            let mut rows = Vec::with_capacity(batch);
            let mut next: HashMap<i32, i64> = HashMap::new();
            let take = |rows: &mut Vec<(String, String)>,
                        next: &mut HashMap<i32, i64>,
                        (key, payload, partition, offset): Row| {
                rows.push((key, payload));
                next.insert(partition, offset + 1);
            };
            take(&mut rows, &mut next, row(&first));
            drop(first);
            while rows.len() < batch && seen + rows.len() < n {
                match c.recv().now_or_never() {
                    Some(Ok(m)) => take(&mut rows, &mut next, row(&m)),
                    Some(Err(e)) => return Err(e.into()),
                    None => break,
                }
            }
            seen += rows.len();
            on_batch(rows).await?;
            let mut tpl = TopicPartitionList::new();
            for (p, o) in next {
                tpl.add_partition_offset(topic, p, Offset::Offset(o))?;
            }
            c.commit(&tpl, CommitMode::Async)?;
        }
        Ok(started.map_or(Duration::ZERO, |s| s.elapsed()))
    }
}

#[async_trait]
impl BrokerBench for KafkaBench {
    fn name(&self) -> &'static str {
        "kafka"
    }

    async fn fill(&self, n: usize) -> anyhow::Result<String> {
        let topic = create_topic(&self.brokers, "bench").await?;
        let msgs: Vec<OutgoingMessage> = (0..n)
            .map(|i| {
                OutgoingMessage::new(&topic, bench_payload(i))
                    .with_key(bench_key(i))
                    .with_dedup_key(bench_key(i))
            })
            .collect();
        for chunk in msgs.chunks(5_000) {
            for r in self.publisher.publish_batch(chunk.to_vec()).await {
                r?;
            }
        }
        Ok(topic)
    }

    async fn bare(&self, dest: &str, n: usize) -> anyhow::Result<Duration> {
        self.consume(dest, n, self.batch, |_rows| async { Ok(()) })
            .await
    }

    async fn handwritten(
        &self,
        dest: &str,
        n: usize,
        sink: &EffectSink,
    ) -> anyhow::Result<Duration> {
        self.consume(dest, n, self.batch, |rows| async move {
            sink.insert_batch(&rows).await
        })
        .await
    }

    async fn source(&self, dest: &str) -> anyhow::Result<Box<dyn Source>> {
        let cfg = KafkaSourceConfig::new(&self.brokers, &Self::unique("bench-idemq"), &[dest]);
        let mut inner = KafkaSource::connect(cfg).await?;
        // Join the group and fetch before the clock starts, as the plain consumers do.
        let first = tokio::time::timeout(Duration::from_secs(60), inner.poll(self.batch))
            .await
            .map_err(|_| anyhow::anyhow!("no record within 60 s"))??;
        Ok(Box::new(Primed { first, inner }))
    }
}

/// A source that hands out an already-polled batch first.
struct Primed {
    first: Option<Vec<Delivery>>,
    inner: KafkaSource,
}

#[async_trait]
impl Source for Primed {
    async fn poll(&mut self, max: usize) -> Result<Option<Vec<Delivery>>, SourceError> {
        match self.first.take() {
            Some(batch) => Ok(Some(batch)),
            None => self.inner.poll(max).await,
        }
    }

    async fn after_batch(&mut self) -> Result<(), SourceError> {
        self.inner.after_batch().await
    }

    async fn close(&mut self) -> Result<(), SourceError> {
        self.inner.close().await
    }
}

/// Creates a fresh topic (`<prefix>-<random>`, [`PARTITIONS`] partitions) and returns its name.
async fn create_topic(brokers: &str, prefix: &str) -> anyhow::Result<String> {
    let topic = KafkaBench::unique(prefix);
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()?;
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    let new = NewTopic::new(&topic, PARTITIONS, TopicReplication::Fixed(1));
    for r in admin.create_topics([&new], &opts).await? {
        r.map_err(|(t, code)| anyhow::anyhow!("create topic {t}: {code}"))?;
    }
    Ok(topic)
}

/// Deletes a benchmark topic, best effort (a leftover topic only costs disk).
async fn delete_topic(brokers: &str, topic: &str) {
    let admin: Result<AdminClient<DefaultClientContext>, _> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create();
    if let Ok(admin) = admin {
        let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
        let _ = admin.delete_topics(&[topic], &opts).await;
    }
}

/// Sends `n` records of about 64 bytes; with a commit interval, transactionally, one
/// transaction per interval (the last one committed before the clock stops), otherwise
/// with the idempotent producer; every delivery report is awaited at the end.
async fn produce_run(
    brokers: &str,
    n: usize,
    interval: Option<Duration>,
) -> anyhow::Result<Duration> {
    let transactional = interval.is_some();
    let interval = interval.unwrap_or(COMMIT_INTERVAL);
    let topic = create_topic(brokers, "bench-produce").await?;
    let cfg = if transactional {
        KafkaProducerConfig::transactional(brokers, &KafkaBench::unique("bench-txn"))
    } else {
        KafkaProducerConfig::idempotent(brokers)
    };
    let producer: FutureProducer = cfg.client_config()?.create()?;
    let blocking = |p: &FutureProducer, f: fn(&FutureProducer) -> Result<(), KafkaError>| {
        let p = p.clone();
        tokio::task::spawn_blocking(move || f(&p))
    };
    if transactional {
        blocking(&producer, |p| p.init_transactions(Duration::from_secs(30))).await??;
    }
    // Warm up outside the clock: topic metadata, the connection to the leader, and the
    // producer id (the idempotent producer acquires it on its first send, the
    // transactional one in init_transactions). Without this a short idempotent run paid
    // its start-up inside the clock and the transactional one did not.
    if transactional {
        producer.begin_transaction()?;
    }
    let warm = FutureRecord::to(&topic).key("warm-up").payload("warm-up");
    producer
        .send(warm, Duration::from_secs(30))
        .await
        .map_err(|(e, _)| e)?;
    if transactional {
        blocking(&producer, |p| {
            commit_transaction(p, Duration::from_secs(30))
        })
        .await??;
    }
    let started = Instant::now();
    if transactional {
        producer.begin_transaction()?;
    }
    let mut txn_started = Instant::now();
    let mut pending = Vec::with_capacity(n);
    for i in 0..n {
        let (key, payload) = (bench_key(i), bench_payload(i));
        let headers = OwnedHeaders::new().insert(Header {
            key: idemq::DEDUP_HEADER,
            value: Some(key.as_bytes()),
        });
        let mut record = FutureRecord::to(&topic)
            .key(key.as_bytes())
            .payload(payload.as_bytes())
            .headers(headers);
        loop {
            match producer.send_result(record) {
                Ok(f) => {
                    pending.push(f);
                    break;
                }
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)) => {
                    record = r;
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                Err((e, _)) => return Err(e.into()),
            }
        }
        if transactional && txn_started.elapsed() >= interval {
            blocking(&producer, |p| {
                commit_transaction(p, Duration::from_secs(30))
            })
            .await??;
            producer.begin_transaction()?;
            txn_started = Instant::now();
        }
    }
    if transactional {
        blocking(&producer, |p| {
            commit_transaction(p, Duration::from_secs(30))
        })
        .await??;
    }
    for f in pending {
        f.await?.map_err(|(e, _)| e)?;
    }
    let elapsed = started.elapsed();
    delete_topic(brokers, &topic).await;
    Ok(elapsed)
}

/// Transactional (one commit per 100 ms) against idempotent producing, best of
/// `run.rounds` interleaved rounds; prints the ratio (target ≥ 0.85).
pub async fn producer_comparison(run: &BrokerRun) -> anyhow::Result<(Duration, Duration)> {
    let bench = KafkaBench::from_env(run.batch).await?;
    let n = (run.messages * 2).max(1);
    let (mut idem, mut txn) = (Duration::MAX, Duration::MAX);
    for _ in 0..run.rounds.max(1) {
        idem = idem.min(produce_run(&bench.brokers, n, None).await?);
        txn = txn.min(produce_run(&bench.brokers, n, Some(COMMIT_INTERVAL)).await?);
    }
    let rate = |d: Duration| n as f64 / d.as_secs_f64().max(1e-9);
    println!(
        "kafka producer: best of {} interleaved rounds, {n} records of ~64 bytes",
        run.rounds.max(1)
    );
    println!(
        "  {:<42} {:>10.0} msgs/s  1.00x",
        "idempotent producer",
        rate(idem)
    );
    println!(
        "  {:<42} {:>10.0} msgs/s  {:.2}x of idempotent (target >= 0.85)",
        "transactional producer, commit every 100 ms",
        rate(txn),
        idem.as_secs_f64() / txn.as_secs_f64().max(1e-9)
    );
    Ok((idem, txn))
}

/// The transactional producer at each commit interval against the idempotent producer,
/// `n` records per run, best of `rounds` interleaved rounds: `(interval, idempotent
/// records/s, transactional records/s)` per interval.
pub async fn producer_intervals(
    n: usize,
    rounds: usize,
    intervals: &[Duration],
) -> anyhow::Result<Vec<(Duration, f64, f64)>> {
    let bench = KafkaBench::from_env(256).await?;
    let n = n.max(1);
    let mut idem = Duration::MAX;
    let mut txn = vec![Duration::MAX; intervals.len()];
    for _ in 0..rounds.max(1) {
        idem = idem.min(produce_run(&bench.brokers, n, None).await?);
        for (slot, iv) in txn.iter_mut().zip(intervals) {
            *slot = (*slot).min(produce_run(&bench.brokers, n, Some(*iv)).await?);
        }
    }
    let rate = |d: Duration| n as f64 / d.as_secs_f64().max(1e-9);
    Ok(intervals
        .iter()
        .zip(txn)
        .map(|(iv, t)| (*iv, rate(idem), rate(t)))
        .collect())
}

/// `consumers` idempotent consumers in one group over one topic of [`PARTITIONS`]
/// partitions holding `n` messages, sharing one PostgreSQL store (a table of its own):
/// messages/s from the moment the consumers are created (group joins and the rebalances
/// of a group growing to its size included) until every message has been handled once.
pub async fn group_scaling(
    postgres_url: &str,
    n: usize,
    counts: &[usize],
    batch: usize,
) -> anyhow::Result<Vec<(usize, f64)>> {
    use idemq::sql::{PgStore, SqlStoreOptions, TableName};
    use idemq::{ClaimedMessage, ConsumerConfig, DedupStore, HandlerError, IdempotentConsumer};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    let bench = KafkaBench::from_env(batch).await?;
    let table = TableName::new(&format!("bench_grp_{:08x}", rand::random::<u32>()))?;
    let pg = PgStore::connect(postgres_url, SqlStoreOptions::with_table(table)).await?;
    let store: Arc<dyn DedupStore> = Arc::new(pg.clone());
    let mut out = Vec::new();
    for &c in counts {
        let topic = bench.fill(n).await?;
        let keys = bench.keys()?;
        let group = KafkaBench::unique("bench-group");
        let done = Arc::new(AtomicUsize::new(0));
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let started = Instant::now();
        let mut runs = Vec::new();
        for _ in 0..c {
            let mut src =
                KafkaSource::connect(KafkaSourceConfig::new(&bench.brokers, &group, &[&topic]))
                    .await?;
            let count = done.clone();
            let consumer =
                IdempotentConsumer::new(store.clone(), keys.clone(), move |_m: ClaimedMessage| {
                    let count = count.clone();
                    async move {
                        count.fetch_add(1, Ordering::AcqRel);
                        Ok::<_, HandlerError>(None)
                    }
                })
                .with_config(ConsumerConfig {
                    max_batch: batch,
                    ..ConsumerConfig::default()
                });
            let mut stop = stop_rx.clone();
            runs.push(async move {
                consumer
                    .run(&mut src, async move {
                        let _ = stop.wait_for(|s| *s).await;
                    })
                    .await
            });
        }
        let watch = async {
            let limit = Instant::now() + Duration::from_secs(300);
            while done.load(Ordering::Acquire) < n && Instant::now() < limit {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let el = started.elapsed();
            let _ = stop_tx.send(true);
            el
        };
        let (elapsed, results) = tokio::join!(watch, futures::future::join_all(runs));
        for r in results {
            r?;
        }
        let handled = done.load(Ordering::Acquire);
        anyhow::ensure!(
            handled >= n,
            "{c} consumers handled {handled} of {n} within 300 s"
        );
        out.push((c, n as f64 / elapsed.as_secs_f64().max(1e-9)));
        delete_topic(&bench.brokers, &topic).await;
    }
    for t in pg.tables() {
        idemq::sql::sqlx::query(&format!("DROP TABLE IF EXISTS {t}"))
            .execute(pg.pool())
            .await?;
    }
    Ok(out)
}
