//! Kafka → Kafka exactly once: consume-transform-produce in one Kafka transaction per batch.
//!
//! [`TransactionalProcessor`] reads `read_committed` input in a consumer group, produces each
//! batch's outputs with a transactional producer, and adds the consumed offsets to the same
//! transaction (`send_offsets_to_transaction` with the consumer's group metadata, KIP-447).
//! Either the outputs and the offsets commit together, or neither does:
//!
//! - a failed transform or an abortable producer error aborts the transaction and rewinds
//!   the consumer to the last committed offsets, so the batch is consumed again and its
//!   aborted outputs stay invisible to `read_committed` readers;
//! - a fenced producer (another instance took the `transactional.id`) or a fatal error stops
//!   this processor with [`TxnError::Fenced`] / [`TxnError::Fatal`] naming the cause.
//!
//! **Business duplicates** (the same dedup key at a new input offset: a producer that resent
//! a payment) are dropped with [`BusinessDedup`]: the keys seen are state kept **in Kafka**,
//! in a compacted changelog topic written in the *same* transaction as the outputs and the
//! offsets (the way Kafka Streams keeps exactly-once state), so the three commit or abort
//! together. See [`BusinessDedup`] for the layout and its one requirement (every copy of a
//! key lands on the same input partition).
use crate::config::KafkaProducerConfig;
use crate::envelope::to_envelope;
use crate::publisher::publish_error;
use idemq_core::adapter::PartitionId;
use idemq_core::envelope::Position;
use idemq_core::publish::{OutgoingMessage, PublishError};
use idemq_core::{Envelope, KeyStrategy};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::{ClientContext, DefaultClientContext};
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// Why a transactional batch did not commit.
#[derive(Debug, thiserror::Error)]
pub enum TxnError {
    /// The batch was aborted and the input rewound; calling again retries it.
    #[error("transaction aborted and input rewound: {0}")]
    Aborted(String),
    /// Another producer instance owns this `transactional.id`: stop this one.
    #[error("producer fenced (another instance owns the transactional.id): {0}")]
    Fenced(String),
    /// The producer or consumer cannot continue: stop and recreate it.
    #[error("fatal Kafka error: {0}")]
    Fatal(String),
    /// The settings are unusable.
    #[error("transactional processor misconfigured: {0}")]
    Config(String),
}

/// Drops business duplicates in a [`TransactionalProcessor`] with exactly-once state kept in
/// Kafka.
///
/// **Layout.** For each input topic `T` of consumer group `G` there is a changelog topic
/// `G-T-dedup-changelog` ([`BusinessDedup::changelog_topic`]) with at least as many
/// partitions as `T`, created compacted by [`TransactionalProcessor::with_options`] if
/// missing (`cleanup.policy=compact`, or `compact,delete` with `retention.ms` when a
/// [`BusinessDedup::retention`] is set). The key of each input record is derived with a
/// [`KeyStrategy`]; when input partition `p` of `T` produces outputs for key `k`, the same
/// transaction writes `k` to partition `p` of the changelog. So the outputs, the consumed
/// offsets and "k was seen" commit or abort **together**: an aborted batch leaves its keys
/// unseen (they are processed again when the batch is), a committed one can never be
/// processed again.
///
/// **Restore.** The keys seen on an input partition live in a local index. When a partition is
/// assigned, the index of its changelog partition is rebuilt (read `read_committed` from the
/// beginning to its end) before its first record is transformed: the first record arriving
/// means the consumer's committed offset was fetched *stable* (librdkafka asks for stable
/// offsets under `read_committed`, KIP-447), i.e. the previous owner's last transaction is
/// resolved, so every key it committed is already in the changelog.
///
/// **The requirement.** Every copy of a business key must land on the **same input partition**
/// (the producer partitions by the dedup key, or by an entity key the copies share — Kafka's
/// default partitioner does this when the record key is the same). A copy on another
/// partition is checked against that partition's keys only, and is not caught.
///
/// Records without a usable key are transformed every time (no business dedup is possible
/// for them); the processor counts them ([`TransactionalProcessor::keyless`]).
#[derive(Debug, Clone)]
pub struct BusinessDedup {
    /// How a record's dedup key is derived (the group of the key is part of it).
    pub keys: KeyStrategy,
    /// How long a key is remembered (`None` = as long as the changelog keeps it: forever
    /// under compaction). With a window, the changelog is created `compact,delete` with
    /// `retention.ms` = the window, and restored keys older than it are ignored.
    pub retention: Option<Duration>,
    /// Longest a partition's restore may take before the batch fails as [`TxnError::Fatal`].
    pub restore_timeout: Duration,
}

impl BusinessDedup {
    /// Business dedup with `keys`, remembering keys for as long as the changelog keeps them.
    pub fn new(keys: KeyStrategy) -> Self {
        Self {
            keys,
            retention: None,
            restore_timeout: Duration::from_secs(120),
        }
    }

    /// Remembers keys for `window` only (builder form).
    pub fn retention(mut self, window: Duration) -> Self {
        self.retention = Some(window);
        self
    }

    /// The changelog topic of input `topic` for consumer group `group`.
    pub fn changelog_topic(group: &str, topic: &str) -> String {
        format!("{group}-{topic}-dedup-changelog")
    }
}

/// Settings of a [`TransactionalProcessor`] beyond the producer, group and input.
#[derive(Debug, Clone, Default)]
pub struct TxnOptions {
    /// Extra librdkafka consumer properties (e.g. `session.timeout.ms`); the processor sets
    /// `bootstrap.servers`, `group.id`, `isolation.level=read_committed` and manual offsets
    /// itself.
    pub consumer: Vec<(String, String)>,
    /// Drop business duplicates with a changelog written in the same transaction.
    pub dedup: Option<BusinessDedup>,
}

impl TxnOptions {
    /// Sets a consumer property (builder form).
    pub fn consumer_property(mut self, key: &str, value: &str) -> Self {
        self.consumer.push((key.to_string(), value.to_string()));
        self
    }

    /// Drops business duplicates (builder form; see [`BusinessDedup`]).
    pub fn dedup(mut self, dedup: BusinessDedup) -> Self {
        self.dedup = Some(dedup);
        self
    }
}

/// The keys seen per input partition, and which partitions still need their restore.
#[derive(Debug, Default)]
struct SeenKeys {
    /// Restored partitions: key → record timestamp (ms).
    index: HashMap<PartitionId, HashMap<String, i64>>,
    /// Assigned, not yet restored.
    pending: HashSet<PartitionId>,
}

/// The processor's consumer context: assignments mark partitions for restore, revokes drop
/// their keys.
struct TxnCtx {
    seen: Arc<Mutex<SeenKeys>>,
}

fn lock(seen: &Mutex<SeenKeys>) -> MutexGuard<'_, SeenKeys> {
    seen.lock().unwrap_or_else(|e| e.into_inner())
}

impl ClientContext for TxnCtx {}

impl ConsumerContext for TxnCtx {
    fn post_rebalance(&self, _c: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let mut seen = lock(&self.seen);
        match rebalance {
            Rebalance::Assign(tpl) => {
                for e in tpl.elements() {
                    let p = (e.topic().to_string(), e.partition());
                    seen.index.remove(&p);
                    seen.pending.insert(p);
                }
            }
            Rebalance::Revoke(tpl) => {
                for e in tpl.elements() {
                    let p = (e.topic().to_string(), e.partition());
                    seen.index.remove(&p);
                    seen.pending.remove(&p);
                }
            }
            Rebalance::Error(_) => {}
        }
    }
}

/// Business dedup at run time.
struct Dedup {
    cfg: BusinessDedup,
    group: String,
    seen: Arc<Mutex<SeenKeys>>,
    bootstrap: String,
}

/// Consume-transform-produce with one Kafka transaction per batch.
pub struct TransactionalProcessor {
    consumer: Arc<BaseConsumer<TxnCtx>>,
    producer: FutureProducer,
    timeout: Duration,
    dedup: Option<Arc<Dedup>>,
    duplicates: AtomicU64,
    keyless: AtomicU64,
}

impl std::fmt::Debug for TransactionalProcessor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransactionalProcessor")
            .finish_non_exhaustive()
    }
}

fn blocking_err(e: tokio::task::JoinError) -> TxnError {
    TxnError::Fatal(format!("blocking Kafka call panicked: {e}"))
}

impl TransactionalProcessor {
    /// A processor reading `input` in `group` (read_committed) and producing with `producer`
    /// (built by [`KafkaProducerConfig::transactional`]); initialises the transactions,
    /// which fences any older instance with the same `transactional.id`.
    pub async fn new(
        producer: &KafkaProducerConfig,
        group: &str,
        input: &[&str],
    ) -> Result<Self, TxnError> {
        Self::with_options(producer, group, input, TxnOptions::default()).await
    }

    /// [`TransactionalProcessor::new`] with consumer properties and business dedup; with
    /// dedup, creates each input's changelog topic if it is missing (see [`BusinessDedup`]).
    pub async fn with_options(
        producer: &KafkaProducerConfig,
        group: &str,
        input: &[&str],
        options: TxnOptions,
    ) -> Result<Self, TxnError> {
        let pcfg = producer
            .client_config()
            .map_err(|e| TxnError::Config(e.to_string()))?;
        if producer.get("transactional.id").is_none() {
            return Err(TxnError::Config(
                "the producer config has no transactional.id: build it with KafkaProducerConfig::transactional".into(),
            ));
        }
        let bootstrap = producer.get("bootstrap.servers").unwrap_or_default();
        let seen = Arc::new(Mutex::new(SeenKeys::default()));
        let dedup = match options.dedup {
            Some(cfg) => {
                ensure_changelogs(bootstrap, group, input, &cfg).await?;
                Some(Arc::new(Dedup {
                    cfg,
                    group: group.to_string(),
                    seen: seen.clone(),
                    bootstrap: bootstrap.to_string(),
                }))
            }
            None => None,
        };
        let mut ccfg = ClientConfig::new();
        ccfg.set("auto.offset.reset", "earliest");
        for (k, v) in &options.consumer {
            ccfg.set(k, v);
        }
        let consumer: BaseConsumer<TxnCtx> = ccfg
            .set("bootstrap.servers", bootstrap)
            .set("group.id", group)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("isolation.level", "read_committed")
            .create_with_context(TxnCtx { seen })
            .map_err(|e| TxnError::Config(e.to_string()))?;
        consumer
            .subscribe(input)
            .map_err(|e| TxnError::Config(e.to_string()))?;
        let producer: FutureProducer =
            pcfg.create().map_err(|e| TxnError::Config(e.to_string()))?;
        let p = producer.clone();
        tokio::task::spawn_blocking(move || p.init_transactions(Duration::from_secs(30)))
            .await
            .map_err(blocking_err)?
            .map_err(|e| classify(&e))?;
        Ok(Self {
            consumer: Arc::new(consumer),
            producer,
            timeout: Duration::from_secs(30),
            dedup,
            duplicates: AtomicU64::new(0),
            keyless: AtomicU64::new(0),
        })
    }

    /// Business duplicates dropped so far (inputs whose key a committed transaction had
    /// already seen on their partition: consumed, no output).
    pub fn duplicates(&self) -> u64 {
        self.duplicates.load(Ordering::Relaxed)
    }

    /// Inputs transformed without business dedup because no key could be derived.
    pub fn keyless(&self) -> u64 {
        self.keyless.load(Ordering::Relaxed)
    }

    /// Polls up to `max` records (waiting at most `wait` for the first), runs `transform`
    /// on each, and commits the outputs together with the consumed offsets. Returns how
    /// many input records were committed (0 when none arrived).
    pub async fn process_batch<F>(
        &mut self,
        max: usize,
        wait: Duration,
        mut transform: F,
    ) -> Result<usize, TxnError>
    where
        F: FnMut(&Envelope) -> Result<Vec<OutgoingMessage>, String>,
    {
        let inputs = self.poll(max, wait).await?;
        if inputs.is_empty() {
            return Ok(0);
        }
        self.producer
            .begin_transaction()
            .map_err(|e| classify(&e))?;
        let (newly_seen, dropped) = match self.produce_all(&inputs, &mut transform).await {
            Ok(seen) => seen,
            Err(why) => return Err(self.abort(why).await),
        };
        if let Err(e) = self.commit(&inputs).await {
            return Err(match e {
                TxnError::Aborted(why) => self.abort(why).await,
                other => other,
            });
        }
        // Committed: the keys are seen for good (an abort above left them unseen).
        if let Some(d) = &self.dedup {
            let mut seen = lock(&d.seen);
            let now = now_ms();
            for (p, keys) in newly_seen {
                if let Some(index) = seen.index.get_mut(&p) {
                    index.extend(keys.into_iter().map(|k| (k, now)));
                }
            }
        }
        self.duplicates.fetch_add(dropped, Ordering::Relaxed);
        Ok(inputs.len())
    }

    async fn poll(&self, max: usize, wait: Duration) -> Result<Vec<Envelope>, TxnError> {
        let c = self.consumer.clone();
        let dedup = self.dedup.clone();
        tokio::task::spawn_blocking(move || {
            let mut out = Vec::new();
            let deadline = std::time::Instant::now() + wait;
            while out.len() < max {
                let left = deadline.saturating_duration_since(std::time::Instant::now());
                let timeout = if out.is_empty() { left } else { Duration::ZERO };
                match c.poll(timeout) {
                    Some(Ok(m)) => out.push(to_envelope(&m, None)),
                    Some(Err(KafkaError::MessageConsumptionFatal(code))) => {
                        return Err(TxnError::Fatal(format!("consumer: {code}")))
                    }
                    Some(Err(e)) => tracing::warn!(error = %e, "transactional consumer error"),
                    None => break,
                }
            }
            if let Some(d) = dedup {
                // A record of a partition arrived: its start offset was fetched stable, so
                // the previous owner's transactions are resolved and its keys are in the
                // changelog. Rebuild the partition's keys before transforming anything.
                let arrived: HashSet<PartitionId> = out.iter().filter_map(partition_of).collect();
                let todo: Vec<PartitionId> = {
                    let seen = lock(&d.seen);
                    arrived
                        .into_iter()
                        .filter(|p| seen.pending.contains(p))
                        .collect()
                };
                for p in todo {
                    let keys = restore(&d, &p)?;
                    let mut seen = lock(&d.seen);
                    // Revoked meanwhile: the next assignment restores again.
                    if seen.pending.remove(&p) {
                        tracing::info!(topic = %p.0, partition = p.1, keys = keys.len(), "business-dedup keys restored from the changelog");
                        seen.index.insert(p, keys);
                    }
                }
            }
            Ok(out)
        })
        .await
        .map_err(blocking_err)?
    }

    /// Transforms and sends every input's outputs into the open transaction, skipping (and
    /// counting) business duplicates; returns the keys this transaction marks as seen, per
    /// input partition, with their changelog records already sent.
    async fn produce_all<F>(
        &self,
        inputs: &[Envelope],
        transform: &mut F,
    ) -> Result<(NewlySeen, u64), String>
    where
        F: FnMut(&Envelope) -> Result<Vec<OutgoingMessage>, String>,
    {
        // Outputs are sent as each input is transformed, so a later failure leaves earlier
        // outputs in the open transaction: the abort is what keeps them invisible.
        let mut sent = Vec::new();
        let mut failed = None;
        let mut newly: NewlySeen = HashMap::new();
        let mut dropped = 0u64;
        for env in inputs {
            let mut mark = None;
            if let (Some(d), Some(p)) = (&self.dedup, partition_of(env)) {
                match d.cfg.keys.derive(env) {
                    Ok(key) => {
                        let key = key.as_str().to_string();
                        let fresh = newly.get(&p).is_none_or(|s| !s.contains(&key));
                        if !fresh || d.already_seen(&p, &key) {
                            dropped += 1;
                            tracing::debug!(%key, topic = %p.0, partition = p.1, "business duplicate dropped");
                            continue;
                        }
                        mark = Some((p, key));
                    }
                    Err(e) => {
                        self.keyless.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(error = %e, "no dedup key: transformed without business dedup");
                    }
                }
            }
            match transform(env) {
                Ok(outs) => {
                    sent.extend(outs.iter().map(|m| self.send_to(m, None)));
                    if let (Some(d), Some((p, key))) = (&self.dedup, mark) {
                        let topic = BusinessDedup::changelog_topic(&d.group, &p.0);
                        let m = OutgoingMessage::new(topic, env_offset(env).to_string())
                            .with_key(key.clone());
                        sent.push(self.send_to(&m, Some(p.1)));
                        newly.entry(p).or_default().insert(key);
                    }
                }
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        let mut produce_error = None;
        for r in futures::future::join_all(sent).await {
            if let Err(e) = r {
                produce_error
                    .get_or_insert_with(|| format!("produce failed: {}", publish_error(&e)));
            }
        }
        match failed.or(produce_error) {
            Some(why) => Err(why),
            None => Ok((newly, dropped)),
        }
    }

    fn send_to(
        &self,
        m: &OutgoingMessage,
        partition: Option<i32>,
    ) -> impl std::future::Future<Output = Result<(), KafkaError>> {
        let mut kh = OwnedHeaders::new();
        for (n, v) in m.wire_headers().iter() {
            kh = kh.insert(Header {
                key: n,
                value: Some(v.as_ref()),
            });
        }
        let mut rec: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(&m.destination)
            .payload(&m.payload[..])
            .headers(kh);
        if let Some(k) = &m.key {
            rec = rec.key(&k[..]);
        }
        if let Some(p) = partition {
            rec = rec.partition(p);
        }
        let fut = self.producer.send_result(rec).map_err(|(e, _)| e);
        async move {
            match fut?.await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err((e, _))) => Err(e),
                Err(_) => Err(KafkaError::Canceled),
            }
        }
    }

    async fn commit(&self, inputs: &[Envelope]) -> Result<(), TxnError> {
        let mut next: HashMap<(String, i32), i64> = HashMap::new();
        for env in inputs {
            if let (Some(p), Some(idemq_core::envelope::Position::Offset(o))) =
                (env.source.partition, env.source.position)
            {
                let e = next.entry((env.source.name.clone(), p)).or_insert(o + 1);
                *e = (*e).max(o + 1);
            }
        }
        let mut tpl = TopicPartitionList::new();
        for ((t, p), o) in &next {
            tpl.add_partition_offset(t, *p, Offset::Offset(*o))
                .map_err(|e| TxnError::Fatal(e.to_string()))?;
        }
        let meta = self
            .consumer
            .group_metadata()
            .ok_or_else(|| TxnError::Fatal("consumer has no group metadata".into()))?;
        let p = self.producer.clone();
        let timeout = self.timeout;
        tokio::task::spawn_blocking(move || {
            p.send_offsets_to_transaction(&tpl, &meta, timeout)?;
            crate::commit_transaction(&p, timeout)
        })
        .await
        .map_err(blocking_err)?
        .map_err(|e| classify(&e))
    }

    /// Aborts the open transaction and rewinds the input to the committed offsets.
    async fn abort(&self, why: String) -> TxnError {
        tracing::warn!(reason = %why, "aborting Kafka transaction and rewinding input");
        let p = self.producer.clone();
        let c = self.consumer.clone();
        let timeout = self.timeout;
        let done = tokio::task::spawn_blocking(move || -> Result<(), KafkaError> {
            p.abort_transaction(timeout)?;
            let assigned = c.assignment()?;
            let committed = c.committed_offsets(assigned, timeout)?;
            let mut seek = TopicPartitionList::new();
            for el in committed.elements() {
                let to = match el.offset() {
                    Offset::Offset(o) => Offset::Offset(o),
                    _ => Offset::Beginning,
                };
                seek.add_partition_offset(el.topic(), el.partition(), to)?;
            }
            for r in c.seek_partitions(seek, timeout)?.elements() {
                r.error()?;
            }
            Ok(())
        })
        .await;
        match done {
            Ok(Ok(())) => TxnError::Aborted(why),
            Ok(Err(e)) => match classify(&e) {
                TxnError::Aborted(_) => {
                    TxnError::Fatal(format!("{why}; then abort/rewind failed: {e}"))
                }
                other => other,
            },
            Err(e) => blocking_err(e),
        }
    }
}

/// Keys marked seen by the open transaction, per input partition.
type NewlySeen = HashMap<PartitionId, HashSet<String>>;

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or_default()
}

fn partition_of(env: &Envelope) -> Option<PartitionId> {
    env.source.partition.map(|p| (env.source.name.clone(), p))
}

fn env_offset(env: &Envelope) -> i64 {
    match env.source.position {
        Some(Position::Offset(o)) => o,
        _ => -1,
    }
}

impl Dedup {
    fn already_seen(&self, p: &PartitionId, key: &str) -> bool {
        let seen = lock(&self.seen);
        let Some(at) = seen.index.get(p).and_then(|i| i.get(key)) else {
            return false;
        };
        match self.cfg.retention {
            Some(w) => now_ms() - at < w.as_millis() as i64,
            None => true,
        }
    }
}

/// Reads the changelog partition of input partition `p` from the beginning to its end
/// (`read_committed`: aborted keys are not seen), into a key → timestamp index.
fn restore(d: &Dedup, p: &PartitionId) -> Result<HashMap<String, i64>, TxnError> {
    let topic = BusinessDedup::changelog_topic(&d.group, &p.0);
    let fail = |e: KafkaError| TxnError::Fatal(format!("restoring {topic}[{}]: {e}", p.1));
    let reader: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &d.bootstrap)
        .set("group.id", format!("{}-restore", d.group))
        .set("enable.auto.commit", "false")
        .set("isolation.level", "read_committed")
        .set("enable.partition.eof", "true")
        .create()
        .map_err(fail)?;
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(&topic, p.1, Offset::Beginning)
        .map_err(fail)?;
    reader.assign(&tpl).map_err(fail)?;
    let horizon = d.cfg.retention.map(|w| now_ms() - w.as_millis() as i64);
    let deadline = std::time::Instant::now() + d.cfg.restore_timeout;
    let mut keys = HashMap::new();
    loop {
        if std::time::Instant::now() > deadline {
            let wm = reader.fetch_watermarks(&topic, p.1, Duration::from_secs(5));
            return Err(TxnError::Fatal(format!(
                "restoring {topic}[{}] took longer than {:?} (an open transaction on it?): \
                 {} keys read, watermarks {wm:?}, position {:?}",
                p.1,
                d.cfg.restore_timeout,
                keys.len(),
                reader.position().ok().map(|t| t
                    .elements()
                    .iter()
                    .map(|e| e.offset())
                    .collect::<Vec<_>>())
            )));
        }
        match reader.poll(Duration::from_millis(200)) {
            Some(Ok(m)) => {
                let Some(k) = m.key() else { continue };
                let at = m.timestamp().to_millis().unwrap_or_else(now_ms);
                if horizon.is_some_and(|h| at < h) {
                    continue;
                }
                keys.insert(String::from_utf8_lossy(k).into_owned(), at);
            }
            // End of the committed log: with read_committed, the last stable offset.
            Some(Err(KafkaError::PartitionEOF(_))) => return Ok(keys),
            Some(Err(e)) => tracing::warn!(error = %e, %topic, "changelog restore: consumer error"),
            None => {}
        }
    }
}

/// Creates each input's changelog topic if missing (compacted, as many partitions as the
/// input), and checks that an existing one has enough partitions.
async fn ensure_changelogs(
    bootstrap: &str,
    group: &str,
    input: &[&str],
    cfg: &BusinessDedup,
) -> Result<(), TxnError> {
    let conf = |e: KafkaError| TxnError::Config(format!("business-dedup changelog: {e}"));
    // A metadata request of an admin (producer-type) handle would otherwise let a broker
    // with auto.create.topics.enable create the changelog with its default partition count.
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("allow.auto.create.topics", "false")
        .create()
        .map_err(conf)?;
    let partitions = |topic: &str| -> Result<Option<usize>, TxnError> {
        let md = admin
            .inner()
            .fetch_metadata(Some(topic), Duration::from_secs(10))
            .map_err(conf)?;
        Ok(md
            .topics()
            .iter()
            .find(|t| t.name() == topic && t.error().is_none())
            .map(|t| t.partitions().len())
            .filter(|n| *n > 0))
    };
    let retention = cfg.retention.map(|w| w.as_millis().to_string());
    for t in input {
        let want = partitions(t)?.ok_or_else(|| {
            TxnError::Config(format!("input topic {t} not found: create it first"))
        })?;
        let changelog = BusinessDedup::changelog_topic(group, t);
        match partitions(&changelog)? {
            Some(n) if n >= want => continue,
            Some(n) => {
                return Err(TxnError::Config(format!(
                    "changelog {changelog} has {n} partitions, input {t} has {want}: input \
                     partition p writes its keys to changelog partition p; add partitions to \
                     the changelog (it must be co-partitioned with the input)"
                )))
            }
            None => {}
        }
        let mut nt = NewTopic::new(&changelog, want as i32, TopicReplication::Fixed(-1));
        nt = match &retention {
            Some(ms) => nt
                .set("cleanup.policy", "compact,delete")
                .set("retention.ms", ms),
            None => nt.set("cleanup.policy", "compact"),
        };
        let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
        for r in admin.create_topics([&nt], &opts).await.map_err(conf)? {
            if let Err((name, code)) = r {
                if code != rdkafka::types::RDKafkaErrorCode::TopicAlreadyExists {
                    return Err(TxnError::Config(format!("creating {name}: {code}")));
                }
            }
        }
        tracing::info!(%changelog, partitions = want, "business-dedup changelog created");
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            match partitions(&changelog)? {
                Some(n) if n >= want => break,
                Some(n) => {
                    return Err(TxnError::Config(format!(
                        "changelog {changelog} was created with {n} partitions, input {t} has \
                         {want} (created by someone else meanwhile?): it must have at least as \
                         many partitions as the input"
                    )))
                }
                None if std::time::Instant::now() > deadline => {
                    return Err(TxnError::Config(format!(
                        "changelog {changelog} not visible 30 s after creating it"
                    )))
                }
                None => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }
    Ok(())
}

/// Sorts a transactional error into abort-and-retry, fenced, or fatal, with librdkafka's
/// own reason (not its bare "Fatal error").
fn classify(e: &KafkaError) -> TxnError {
    match e {
        KafkaError::Transaction(t) => {
            let text = format!("{} ({})", t.string(), t.code());
            if matches!(
                t.code(),
                rdkafka::types::RDKafkaErrorCode::Fenced
                    | rdkafka::types::RDKafkaErrorCode::ProducerFenced
                    | rdkafka::types::RDKafkaErrorCode::InvalidProducerEpoch
            ) {
                TxnError::Fenced(text)
            } else if t.is_fatal() {
                TxnError::Fatal(text)
            } else {
                TxnError::Aborted(text)
            }
        }
        other => match publish_error(other) {
            PublishError::Fenced(s) => TxnError::Fenced(s),
            PublishError::Config(s) => TxnError::Config(s),
            p => TxnError::Aborted(p.to_string()),
        },
    }
}
