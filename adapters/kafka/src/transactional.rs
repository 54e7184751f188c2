//! Kafka → Kafka exactly once: consume-transform-produce in one Kafka transaction per batch.
//!
//! [`TransactionalProcessor`] reads `read_committed` input in a consumer group, produces each
//! batch's outputs with a transactional producer, and adds the consumed offsets to the same
//! transaction (`send_offsets_to_transaction` with the consumer's group metadata, KIP-447).
//! Either the outputs and the offsets commit together, or neither does:
//!
//! - a failed transform or an abortable producer error aborts the transaction and rewinds
//!   the consumer to the last committed offsets, so the batch is consumed again and its
//!   aborted outputs stay invisible to `read_committed` readers; a transaction that cannot
//!   begin rewinds the consumer the same way, so no polled record is skipped;
//! - a retriable error of `send_offsets_to_transaction` or `commit_transaction` (a time-out:
//!   the broker's answer has not come back, the outcome is not decided) calls it again,
//!   with back-off, within the processor's timeout: aborting then could abort a commit the
//!   broker already decided. A commit still undecided at the end of that time stops the
//!   processor with [`TxnError::Fatal`] (a new instance's `init_transactions` resolves it);
//! - a fenced producer (another instance took the `transactional.id`) or a fatal error stops
//!   this processor with [`TxnError::Fenced`] / [`TxnError::Fatal`] naming the cause; it then
//!   refuses every later batch with the same error (drop it: that closes its consumer, which
//!   leaves the group, and build a new one).
//!
//! **Rebalances.** Each assignment of an input partition is an epoch. A record is kept in a
//! batch only if its partition is still assigned in the epoch it was polled in when the batch
//! runs: a record polled just before the rebalance that revoked its partition (or took it away
//! and gave it back) is dropped — never transformed, and neither its outputs, its changelog
//! key nor its offset are committed. The partition's owner consumes it from the committed
//! offset instead ([`TransactionalProcessor::revoked`] counts these records). Without this, a
//! record polled in the same poll loop as the revocation would be transformed and committed
//! here *and* by the new owner.
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
use idemq_core::engine::RetryPolicy;
use idemq_core::envelope::Position;
use idemq_core::publish::{OutgoingMessage, PublishError};
use idemq_core::{Envelope, KeyStrategy};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::{ClientContext, DefaultClientContext};
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

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
/// resolved, so every key it committed is already in the changelog. The partitions whose
/// first records arrive in one poll are read by one reader. A revoke drops the partition's
/// index, and every assignment restores it again (each assignment is a new epoch: while
/// the partition was elsewhere, another owner may have committed keys).
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
    /// Longest a restore (the changelog partitions one batch needs, read together) may take
    /// before the batch fails as [`TxnError::Fatal`].
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

/// The input partitions this processor owns (each with the epoch of its assignment), the
/// keys seen on each, and which still need their restore. Rebalances update it from inside
/// the consumer's `poll`, so nothing changes between a batch's poll and its commit.
#[derive(Debug, Default)]
struct Partitions {
    /// Assigned partitions → the epoch of their current assignment.
    owned: HashMap<PartitionId, u64>,
    /// The last epoch handed out.
    epoch: u64,
    /// Restored partitions: key → record timestamp (ms).
    index: HashMap<PartitionId, HashMap<String, i64>>,
    /// Assigned, not yet restored.
    pending: HashSet<PartitionId>,
}

impl Partitions {
    fn assigned(&mut self, p: PartitionId) {
        self.epoch += 1;
        self.owned.insert(p.clone(), self.epoch);
        self.index.remove(&p);
        self.pending.insert(p);
    }

    fn revoked(&mut self, p: &PartitionId) {
        self.owned.remove(p);
        self.index.remove(p);
        self.pending.remove(p);
    }

    /// Whether `p` is still assigned in `epoch`.
    fn owns(&self, p: &PartitionId, epoch: u64) -> bool {
        self.owned.get(p) == Some(&epoch)
    }

    /// Forgets every key: each owned partition is restored again before its next record.
    fn forget_keys(&mut self) {
        self.index.clear();
        self.pending = self.owned.keys().cloned().collect();
    }
}

/// The processor's consumer context: assignments start a partition's epoch and mark it for
/// restore, revokes end it and drop its keys.
struct TxnCtx {
    parts: Arc<Mutex<Partitions>>,
}

fn lock(parts: &Mutex<Partitions>) -> MutexGuard<'_, Partitions> {
    parts.lock().unwrap_or_else(|e| e.into_inner())
}

impl ClientContext for TxnCtx {}

impl ConsumerContext for TxnCtx {
    fn post_rebalance(&self, c: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let mut parts = lock(&self.parts);
        let id = |e: &rdkafka::topic_partition_list::TopicPartitionListElem<'_>| {
            (e.topic().to_string(), e.partition())
        };
        match rebalance {
            Rebalance::Assign(tpl) => {
                for e in tpl.elements() {
                    parts.assigned(id(&e));
                }
            }
            Rebalance::Revoke(tpl) => {
                for e in tpl.elements() {
                    parts.revoked(&id(&e));
                }
                metrics::counter!(crate::metrics::PARTITIONS_REVOKED).increment(tpl.count() as u64);
            }
            Rebalance::Error(e) => {
                // rust-rdkafka unassigns on a failed rebalance: keep only what is still
                // assigned (nothing, if the assignment cannot be read).
                tracing::warn!(error = %e, "transactional consumer: rebalance failed");
                let still: HashSet<PartitionId> = c
                    .assignment()
                    .map(|t| t.elements().iter().map(id).collect())
                    .unwrap_or_default();
                let gone: Vec<PartitionId> = parts
                    .owned
                    .keys()
                    .filter(|p| !still.contains(*p))
                    .cloned()
                    .collect();
                for p in gone {
                    parts.revoked(&p);
                }
            }
        }
    }
}

/// A polled record and the epoch of its partition's assignment when it was polled.
struct Polled {
    env: Envelope,
    epoch: u64,
}

/// Business dedup at run time.
struct Dedup {
    cfg: BusinessDedup,
    group: String,
    parts: Arc<Mutex<Partitions>>,
    bootstrap: String,
}

/// Consume-transform-produce with one Kafka transaction per batch.
pub struct TransactionalProcessor {
    consumer: Arc<BaseConsumer<TxnCtx>>,
    producer: FutureProducer,
    timeout: Duration,
    parts: Arc<Mutex<Partitions>>,
    dedup: Option<Arc<Dedup>>,
    duplicates: AtomicU64,
    keyless: AtomicU64,
    revoked: AtomicU64,
    /// Set when the producer was fenced or failed fatally: every later batch is refused.
    stopped: Option<Stopped>,
}

/// Why a processor stopped for good.
#[derive(Debug, Clone)]
enum Stopped {
    Fenced(String),
    Fatal(String),
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
        let parts = Arc::new(Mutex::new(Partitions::default()));
        let dedup = match options.dedup {
            Some(cfg) => {
                ensure_changelogs(bootstrap, group, input, &cfg).await?;
                Some(Arc::new(Dedup {
                    cfg,
                    group: group.to_string(),
                    parts: parts.clone(),
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
            .create_with_context(TxnCtx {
                parts: parts.clone(),
            })
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
            parts,
            dedup,
            duplicates: AtomicU64::new(0),
            keyless: AtomicU64::new(0),
            revoked: AtomicU64::new(0),
            stopped: None,
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

    /// Polled records dropped because a rebalance revoked their partition (or assigned it
    /// anew) before their batch ran: never transformed, nothing of them committed; the
    /// partition's owner consumes them again from the committed offset.
    pub fn revoked(&self) -> u64 {
        self.revoked.load(Ordering::Relaxed)
    }

    /// Polls up to `max` records (waiting at most `wait` for the first), runs `transform`
    /// on each, and commits the outputs together with the consumed offsets. Returns how
    /// many input records were committed (0 when none arrived).
    ///
    /// Records of a partition revoked by a rebalance served during the poll are dropped,
    /// not transformed (see the module documentation). After [`TxnError::Fenced`] or
    /// [`TxnError::Fatal`] the processor is stopped: every later call returns that error
    /// again without consuming anything.
    pub async fn process_batch<F>(
        &mut self,
        max: usize,
        wait: Duration,
        transform: F,
    ) -> Result<usize, TxnError>
    where
        F: FnMut(&Envelope) -> Result<Vec<OutgoingMessage>, String>,
    {
        if let Some(s) = &self.stopped {
            return Err(match s.clone() {
                Stopped::Fenced(why) => TxnError::Fenced(format!("stopped earlier: {why}")),
                Stopped::Fatal(why) => TxnError::Fatal(format!("stopped earlier: {why}")),
            });
        }
        let r = match self.poll(max, wait).await {
            Ok(polled) => self.run_batch(polled, transform).await,
            Err(e) => Err(e),
        };
        match r {
            Err(TxnError::Fenced(why)) => Err(TxnError::Fenced(self.stop(Stopped::Fenced(why)))),
            Err(TxnError::Fatal(why)) => Err(TxnError::Fatal(self.stop(Stopped::Fatal(why)))),
            other => other,
        }
    }

    /// Stops the processor for good: its producer cannot commit again, so nothing it holds
    /// stays in use (every key is forgotten; a batch's keys were only ever added once its
    /// transaction committed).
    fn stop(&mut self, why: Stopped) -> String {
        lock(&self.parts).forget_keys();
        let (Stopped::Fenced(text) | Stopped::Fatal(text)) = &why;
        let text = text.clone();
        tracing::error!(reason = %text, "transactional processor stopped: drop it, build a new one");
        self.stopped = Some(why);
        text
    }

    /// The batch step: drops the records whose partition is no longer assigned in the epoch
    /// they were polled in, transforms the rest and commits their outputs, changelog keys
    /// and offsets in one transaction.
    async fn run_batch<F>(&self, polled: Vec<Polled>, mut transform: F) -> Result<usize, TxnError>
    where
        F: FnMut(&Envelope) -> Result<Vec<OutgoingMessage>, String>,
    {
        let batch = self.current(polled);
        if batch.is_empty() {
            return Ok(0);
        }
        if let Err(e) = self.producer.begin_transaction() {
            // The batch's records are polled already (the consumer's position is past them):
            // unless the processor stops, they must be consumed again, not skipped.
            let f = Fault::of(&e);
            return Err(match next_step(&f) {
                next @ (Next::Fenced | Next::Fatal | Next::Config) => f.into_error(next),
                // No transaction began, so there is nothing to abort unless librdkafka says
                // an earlier one still needs it.
                Next::Retry | Next::Abort => {
                    let why = format!("begin_transaction failed: {}", f.text);
                    self.undo(why, f.abortable).await
                }
            });
        }
        let (newly_seen, dropped) = match self.produce_all(&batch, &mut transform).await {
            Ok(seen) => seen,
            Err(why) => return Err(self.abort(why).await),
        };
        if let Err(e) = self.commit(&batch).await {
            return Err(match e {
                TxnError::Aborted(why) => self.abort(why).await,
                other => other,
            });
        }
        // Committed: the keys are seen for good (an abort above left them unseen).
        if self.dedup.is_some() {
            let mut parts = lock(&self.parts);
            let now = now_ms();
            for (p, keys) in newly_seen {
                if let Some(index) = parts.index.get_mut(&p) {
                    index.extend(keys.into_iter().map(|k| (k, now)));
                }
            }
        }
        self.duplicates.fetch_add(dropped, Ordering::Relaxed);
        Ok(batch.len())
    }

    /// The records of `polled` whose partition is still assigned in the epoch they were
    /// polled in; the others are counted and dropped.
    fn current(&self, mut polled: Vec<Polled>) -> Vec<Polled> {
        let before = polled.len();
        {
            let parts = lock(&self.parts);
            polled.retain(|r| partition_of(&r.env).is_some_and(|p| parts.owns(&p, r.epoch)));
        }
        let gone = before - polled.len();
        if gone > 0 {
            self.revoked.fetch_add(gone as u64, Ordering::Relaxed);
            tracing::info!(
                records = gone,
                "records of revoked partitions dropped untransformed: their new owner consumes them"
            );
        }
        polled
    }

    async fn poll(&self, max: usize, wait: Duration) -> Result<Vec<Polled>, TxnError> {
        let c = self.consumer.clone();
        let parts = self.parts.clone();
        let dedup = self.dedup.clone();
        tokio::task::spawn_blocking(move || {
            let mut out: Vec<Polled> = Vec::new();
            let deadline = std::time::Instant::now() + wait;
            while out.len() < max {
                let left = deadline.saturating_duration_since(std::time::Instant::now());
                let timeout = if out.is_empty() { left } else { Duration::ZERO };
                // A rebalance is served inside this call (the callback updates `parts`), so
                // a record returned by it belongs to the epoch current when it returns.
                match c.poll(timeout) {
                    Some(Ok(m)) => {
                        let env = to_envelope(&m, None);
                        let epoch = partition_of(&env)
                            .and_then(|p| lock(&parts).owned.get(&p).copied());
                        match epoch {
                            Some(epoch) => out.push(Polled { env, epoch }),
                            None => tracing::debug!(
                                topic = m.topic(),
                                partition = m.partition(),
                                "record of an unassigned partition ignored"
                            ),
                        }
                    }
                    Some(Err(KafkaError::MessageConsumptionFatal(code))) => {
                        return Err(TxnError::Fatal(format!("consumer: {code}")))
                    }
                    Some(Err(e)) => tracing::warn!(error = %e, "transactional consumer error"),
                    // Nothing more now, or a rebalance event was served: an empty batch
                    // waits on until its deadline, a started one ends here.
                    None if out.is_empty() && !left.is_zero() => {}
                    None => break,
                }
            }
            if let Some(d) = dedup {
                // A record of a partition arrived in its current epoch: its start offset
                // was fetched stable, so the previous owner's transactions are resolved and
                // its keys are in the changelog. Rebuild the partition's keys before
                // transforming anything. (Records of an earlier epoch prove nothing; the
                // batch step drops them.)
                let todo: Vec<PartitionId> = {
                    let parts = lock(&d.parts);
                    let arrived: HashSet<PartitionId> = out
                        .iter()
                        .filter_map(|r| partition_of(&r.env).filter(|p| parts.owns(p, r.epoch)))
                        .collect();
                    arrived
                        .into_iter()
                        .filter(|p| parts.pending.contains(p))
                        .collect()
                };
                let mut by_topic: HashMap<String, Vec<i32>> = HashMap::new();
                for (t, p) in todo {
                    by_topic.entry(t).or_default().push(p);
                }
                for (t, ps) in by_topic {
                    let restored = restore(&d, &t, &ps)?;
                    let mut parts = lock(&d.parts);
                    for (p, keys) in restored {
                        // Revoked meanwhile: the next assignment restores again.
                        if parts.pending.remove(&p) {
                            tracing::info!(topic = %p.0, partition = p.1, keys = keys.len(), "business-dedup keys restored from the changelog");
                            parts.index.insert(p, keys);
                        }
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
        inputs: &[Polled],
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
        for env in inputs.iter().map(|r| &r.env) {
            let mut mark = None;
            if let (Some(d), Some(p)) = (&self.dedup, partition_of(env)) {
                match d.cfg.keys.derive(env) {
                    Ok(key) => {
                        let key = key.as_str().to_string();
                        let fresh = newly.get(&p).is_none_or(|s| !s.contains(&key));
                        let seen = match d.already_seen(&p, &key) {
                            Some(seen) => seen,
                            // Never transform without the partition's keys: a key committed
                            // by an earlier owner would be output again.
                            None => {
                                failed = Some(format!(
                                    "business-dedup keys of {}[{}] are not restored",
                                    p.0, p.1
                                ));
                                break;
                            }
                        };
                        if !fresh || seen {
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

    async fn commit(&self, batch: &[Polled]) -> Result<(), TxnError> {
        let mut next: HashMap<(String, i32), i64> = HashMap::new();
        {
            // Rebalances are served only inside the consumer's poll, which does not run
            // during a batch; checked anyway, since committing the offset of a partition
            // owned elsewhere would make its records count twice.
            let parts = lock(&self.parts);
            if let Some(r) = batch
                .iter()
                .find(|r| partition_of(&r.env).is_none_or(|p| !parts.owns(&p, r.epoch)))
            {
                return Err(TxnError::Aborted(format!(
                    "{}[{}] was revoked during the batch",
                    r.env.source.name,
                    r.env.source.partition.unwrap_or(-1)
                )));
            }
        }
        for env in batch.iter().map(|r| &r.env) {
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
        let budget = self.timeout;
        tokio::task::spawn_blocking(move || {
            let deadline = Instant::now() + budget;
            match with_retries("send_offsets_to_transaction", budget, deadline, |t| {
                p.send_offsets_to_transaction(&tpl, &meta, t)
                    .map_err(|e| Fault::of(&e))
            }) {
                Ok(()) => {}
                // Nothing is committed before commit_transaction: aborting is safe.
                Err((Next::Retry, f)) => {
                    return Err(TxnError::Aborted(format!(
                        "send_offsets_to_transaction still failing after {budget:?}: {}",
                        f.text
                    )))
                }
                Err((next, f)) => return Err(f.into_error(next)),
            }
            match with_retries("commit_transaction", budget, deadline, |t| {
                crate::commit_transaction(&p, t).map_err(|e| Fault::of(&e))
            }) {
                Ok(()) => Ok(()),
                // The commit may be decided already (the EndTxn reply lost): an abort now
                // could drop a batch whose offsets are committed, or fail against the
                // commit in progress. Stopping is safe: the next instance's
                // init_transactions completes or aborts it, and its consumer reads the
                // offsets that outcome left.
                Err((Next::Retry, f)) => Err(TxnError::Fatal(format!(
                    "commit_transaction outcome unknown after retrying for {budget:?}: {}",
                    f.text
                ))),
                Err((next, f)) => Err(f.into_error(next)),
            }
        })
        .await
        .map_err(blocking_err)?
    }

    /// Aborts the open transaction and rewinds the input to the committed offsets.
    async fn abort(&self, why: String) -> TxnError {
        self.undo(why, true).await
    }

    /// Undoes a batch that will not commit: aborts its transaction when `abort_txn` (one is
    /// open), then rewinds the input to the committed offsets so its records are consumed
    /// again. Returns [`TxnError::Aborted`] with `why`, or what stopped the undo.
    async fn undo(&self, why: String, abort_txn: bool) -> TxnError {
        tracing::warn!(reason = %why, abort_txn, "undoing Kafka batch: rewinding input to the committed offsets");
        let p = self.producer.clone();
        let c = self.consumer.clone();
        let timeout = self.timeout;
        let done = tokio::task::spawn_blocking(move || -> Result<(), KafkaError> {
            if abort_txn {
                p.abort_transaction(timeout)?;
            }
            rewind(&c, timeout)
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

/// Seeks every assigned input partition back to the group's committed offset (its
/// beginning where none is committed): what a batch that did not commit consumed is
/// consumed again.
fn rewind<C: ConsumerContext>(c: &BaseConsumer<C>, timeout: Duration) -> Result<(), KafkaError> {
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
    /// Whether a committed transaction already saw `key` on `p`; `None` when the keys of
    /// `p` are not restored (not assigned, or restore pending).
    fn already_seen(&self, p: &PartitionId, key: &str) -> Option<bool> {
        let parts = lock(&self.parts);
        let index = parts.index.get(p)?;
        let Some(at) = index.get(key) else {
            return Some(false);
        };
        Some(match self.cfg.retention {
            Some(w) => now_ms() - at < w.as_millis() as i64,
            None => true,
        })
    }
}

/// Keys seen per input partition, as restored from the changelog: key → timestamp (ms).
type Restored = HashMap<PartitionId, HashMap<String, i64>>;

/// Reads the changelog partitions of input partitions `ps` (all of one input topic) from the
/// beginning to their end (`read_committed`: aborted keys are not seen), into a key →
/// timestamp index per input partition. One reader serves them all: a rebalance hands over
/// several partitions at once, and a reader per partition costs a client start-up (about a
/// second on a busy broker) each.
fn restore(d: &Dedup, topic: &str, ps: &[i32]) -> Result<Restored, TxnError> {
    let changelog = BusinessDedup::changelog_topic(&d.group, topic);
    let fail = |e: KafkaError| TxnError::Fatal(format!("restoring {changelog}{ps:?}: {e}"));
    let reader: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &d.bootstrap)
        .set("group.id", format!("{}-restore", d.group))
        .set("enable.auto.commit", "false")
        .set("isolation.level", "read_committed")
        .set("enable.partition.eof", "true")
        .create()
        .map_err(fail)?;
    let mut tpl = TopicPartitionList::new();
    for p in ps {
        tpl.add_partition_offset(&changelog, *p, Offset::Beginning)
            .map_err(fail)?;
    }
    reader.assign(&tpl).map_err(fail)?;
    let horizon = d.cfg.retention.map(|w| now_ms() - w.as_millis() as i64);
    let deadline = std::time::Instant::now() + d.cfg.restore_timeout;
    let mut keys: Restored = ps
        .iter()
        .map(|p| ((topic.to_string(), *p), HashMap::new()))
        .collect();
    // The partitions read to their end. Nothing is written to them meanwhile: this
    // processor is their only writer, and it transforms nothing before the restore.
    let mut done: HashSet<i32> = HashSet::new();
    while done.len() < ps.len() {
        if std::time::Instant::now() > deadline {
            let left: Vec<String> = ps
                .iter()
                .filter(|p| !done.contains(*p))
                .map(|p| {
                    let wm = reader.fetch_watermarks(&changelog, *p, Duration::from_secs(5));
                    format!("[{p}] watermarks {wm:?}")
                })
                .collect();
            return Err(TxnError::Fatal(format!(
                "restoring {changelog} took longer than {:?} (an open transaction on it?): \
                 not read to the end: {}; positions {:?}",
                d.cfg.restore_timeout,
                left.join(", "),
                reader.position().ok().map(|t| t
                    .elements()
                    .iter()
                    .map(|e| (e.partition(), e.offset()))
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
                if let Some(index) = keys.get_mut(&(topic.to_string(), m.partition())) {
                    index.insert(String::from_utf8_lossy(k).into_owned(), at);
                }
            }
            // End of the committed log: with read_committed, the last stable offset.
            Some(Err(KafkaError::PartitionEOF(p))) => {
                done.insert(p);
            }
            Some(Err(e)) => {
                tracing::warn!(error = %e, %changelog, "changelog restore: consumer error")
            }
            None => {}
        }
    }
    Ok(keys)
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

/// One failed Kafka call as librdkafka describes it, read once from the error so that the
/// decision over it ([`next_step`]) is a pure function.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Fault {
    /// librdkafka's own reason (not its bare "Fatal error"), with the code.
    text: String,
    /// Another producer instance owns the `transactional.id`.
    fenced: bool,
    /// `rd_kafka_error_is_fatal`: the producer cannot be used again.
    fatal: bool,
    /// `rd_kafka_error_txn_requires_abort`: the transaction must be aborted.
    abortable: bool,
    /// `rd_kafka_error_is_retriable`: nothing is decided yet; call the same function again.
    retriable: bool,
    /// The settings are unusable.
    config: bool,
}

impl Fault {
    fn of(e: &KafkaError) -> Self {
        match e {
            KafkaError::Transaction(t) => Self {
                text: format!("{} ({})", t.string(), t.code()),
                fenced: matches!(
                    t.code(),
                    RDKafkaErrorCode::Fenced
                        | RDKafkaErrorCode::ProducerFenced
                        | RDKafkaErrorCode::InvalidProducerEpoch
                ),
                fatal: t.is_fatal(),
                abortable: t.txn_requires_abort(),
                retriable: t.is_retriable(),
                config: false,
            },
            other => {
                let sorted = publish_error(other);
                Self {
                    text: other.to_string(),
                    fenced: matches!(sorted, PublishError::Fenced(_)),
                    fatal: false,
                    abortable: false,
                    // `commit_transaction`'s wait for deliveries ran out: records are still
                    // in flight, the transaction is open and undecided.
                    retriable: matches!(
                        other,
                        KafkaError::Flush(RDKafkaErrorCode::OperationTimedOut)
                    ),
                    config: matches!(sorted, PublishError::Config(_)),
                }
            }
        }
    }

    /// The error a caller sees when `next` is not retried (here, or any more).
    fn into_error(self, next: Next) -> TxnError {
        match next {
            Next::Retry | Next::Abort => TxnError::Aborted(self.text),
            Next::Fenced => TxnError::Fenced(self.text),
            Next::Fatal => TxnError::Fatal(self.text),
            Next::Config => TxnError::Config(self.text),
        }
    }
}

/// What to do after a failed transactional call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Next {
    /// Call the same function again: its outcome is not decided (a timed-out commit goes on
    /// in the background, and only calling `commit_transaction` again learns how it ended).
    Retry,
    /// Abort the transaction and rewind the input.
    Abort,
    /// Stop: another instance owns the `transactional.id`.
    Fenced,
    /// Stop: the producer cannot continue.
    Fatal,
    /// Stop: the settings are unusable.
    Config,
}

/// librdkafka's contract for a failed transactional call: fenced and fatal errors stop the
/// producer; an error that requires an abort is aborted even when it is also retriable (no
/// call goes on in that state); a retriable one is called again; anything else aborts.
fn next_step(f: &Fault) -> Next {
    if f.fenced {
        Next::Fenced
    } else if f.fatal {
        Next::Fatal
    } else if f.abortable {
        Next::Abort
    } else if f.retriable {
        Next::Retry
    } else if f.config {
        Next::Config
    } else {
        Next::Abort
    }
}

/// Sorts an error of a call that is not retried here (`init_transactions`, an abort, a
/// rewind) into abort-and-retry, fenced, fatal or misconfigured.
fn classify(e: &KafkaError) -> TxnError {
    let f = Fault::of(e);
    let next = next_step(&f);
    f.into_error(next)
}

/// How many attempts one retried call's budget is split into at least: librdkafka goes on
/// with a timed-out commit in the background, so a shorter wait per call costs nothing and
/// leaves time to call again.
const ATTEMPTS_PER_BUDGET: u32 = 4;

/// The back-off between attempts of a retriable transactional call.
fn txn_retry_policy() -> RetryPolicy {
    RetryPolicy::backoff(Duration::from_millis(50), Duration::from_secs(1))
}

/// Calls `call` (a blocking librdkafka transactional call, given its timeout) until it
/// succeeds, fails with anything but [`Next::Retry`], or `deadline` leaves no time for
/// another attempt after the back-off; then `Err((Next::Retry, last fault))`. Each attempt
/// waits at most `budget / ATTEMPTS_PER_BUDGET`. Blocks the thread: call it from
/// `spawn_blocking`.
fn with_retries<T>(
    call_name: &'static str,
    budget: Duration,
    deadline: Instant,
    mut call: impl FnMut(Duration) -> Result<T, Fault>,
) -> Result<T, (Next, Fault)> {
    let slice = budget / ATTEMPTS_PER_BUDGET;
    let mut waits = txn_retry_policy().waits();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let fault = match call(left.min(slice)) {
            Ok(v) => return Ok(v),
            Err(f) => f,
        };
        let next = next_step(&fault);
        if next != Next::Retry {
            return Err((next, fault));
        }
        let pause = waits.next_delay();
        if deadline.saturating_duration_since(Instant::now()) <= pause {
            return Err((Next::Retry, fault));
        }
        metrics::counter!(crate::metrics::TRANSACTION_RETRIES, "call" => call_name).increment(1);
        tracing::warn!(
            call = call_name,
            attempt = waits.failures(),
            error = %fault.text,
            "transactional call failed retriably: calling it again"
        );
        std::thread::sleep(pause);
    }
}

#[cfg(test)]
mod tests {
    //! The batch step driven by hand on the real broker (skipped without
    //! `IDEMQ_TEST_KAFKA_BROKERS`): a group rebalance served between a batch's poll and its
    //! commit.
    use super::*;
    use idemq_core::publish::{Publisher, DEDUP_HEADER};

    pub(super) fn brokers() -> Option<String> {
        std::env::var("IDEMQ_TEST_KAFKA_BROKERS")
            .ok()
            .filter(|b| !b.is_empty())
    }

    pub(super) fn unique(prefix: &str) -> String {
        format!(
            "{prefix}-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or_default()
        )
    }

    pub(super) async fn create_topic(brokers: &str, topic: &str, partitions: i32) {
        let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .create()
            .expect("admin client");
        let t = NewTopic::new(topic, partitions, TopicReplication::Fixed(1));
        let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(20)));
        for r in admin.create_topics([&t], &opts).await.expect("create") {
            r.expect("topic created");
        }
    }

    /// `group`'s committed offset per partition of `topic` (`None` where none).
    pub(super) fn committed(
        brokers: &str,
        group: &str,
        topic: &str,
        parts: i32,
    ) -> Vec<Option<i64>> {
        let c: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .set("group.id", group)
            .set("isolation.level", "read_committed")
            .create()
            .expect("offsets client");
        let mut tpl = TopicPartitionList::new();
        for p in 0..parts {
            tpl.add_partition(topic, p);
        }
        let got = c
            .committed_offsets(tpl, Duration::from_secs(10))
            .expect("committed offsets");
        got.elements()
            .iter()
            .map(|e| match e.offset() {
                Offset::Offset(o) => Some(o),
                _ => None,
            })
            .collect()
    }

    /// Every record of `topic` partition 0, read `read_committed` to its end.
    pub(super) fn read_committed(brokers: &str, topic: &str) -> Vec<String> {
        let c: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .set("group.id", unique("reader"))
            .set("isolation.level", "read_committed")
            .set("enable.partition.eof", "true")
            .create()
            .expect("reader");
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(topic, 0, Offset::Beginning)
            .expect("tpl");
        c.assign(&tpl).expect("assign");
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let mut out = Vec::new();
        loop {
            assert!(
                std::time::Instant::now() < deadline,
                "{topic} not read to its end in 30 s"
            );
            match c.poll(Duration::from_millis(200)) {
                Some(Ok(m)) => {
                    out.push(String::from_utf8_lossy(m.payload().unwrap_or_default()).into_owned())
                }
                Some(Err(KafkaError::PartitionEOF(_))) => return out,
                _ => {}
            }
        }
    }

    fn owned<C: ConsumerContext>(c: &BaseConsumer<C>) -> Vec<i32> {
        let mut v: Vec<i32> = c
            .assignment()
            .map(|t| t.elements().iter().map(|e| e.partition()).collect())
            .unwrap_or_default();
        v.sort();
        v
    }

    /// A batch is polled (records of both input partitions), then a second member joins and
    /// the group takes one partition away (cooperative rebalance, served by the processor's
    /// own consumer); the batch step then runs on what was polled. Records of the revoked
    /// partition must be neither transformed nor committed (outputs, changelog keys,
    /// offsets); the kept partition's records are processed once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn records_of_a_partition_revoked_after_the_poll_are_neither_transformed_nor_committed() {
        let Some(brokers) = brokers() else {
            eprintln!("skipped: IDEMQ_TEST_KAFKA_BROKERS is not set");
            return;
        };
        let input = unique("revoke-in");
        let output = unique("revoke-out");
        create_topic(&brokers, &input, 2).await;
        create_topic(&brokers, &output, 1).await;
        let publisher = crate::KafkaPublisher::connect(&KafkaProducerConfig::idempotent(&brokers))
            .await
            .expect("publisher");
        let msgs: Vec<OutgoingMessage> = (0..20)
            .map(|i| {
                let k = format!("{input}-{i:02}");
                OutgoingMessage::new(&input, format!("in:{k}"))
                    .with_key(k.clone())
                    .with_dedup_key(k)
            })
            .collect();
        for r in publisher.publish_batch(msgs).await {
            r.expect("publish");
        }
        let group = format!("{input}-g");
        let cfg = KafkaProducerConfig::transactional(&brokers, &unique("revoke-txn"));
        let opts = TxnOptions::default()
            .consumer_property("partition.assignment.strategy", "cooperative-sticky")
            .consumer_property("session.timeout.ms", "6000")
            .consumer_property("heartbeat.interval.ms", "100")
            .dedup(BusinessDedup::new(
                KeyStrategy::dedup_header(&group).expect("key strategy"),
            ));
        let proc = TransactionalProcessor::with_options(&cfg, &group, &[input.as_str()], opts)
            .await
            .expect("processor");

        // 1. Poll until the batch holds records of both partitions.
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let mut polled = Vec::new();
        loop {
            let parts: HashSet<i32> = polled
                .iter()
                .filter_map(|r: &Polled| r.env.source.partition)
                .collect();
            if parts.len() == 2 {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no records of both partitions within 30 s: {} polled",
                polled.len()
            );
            polled.extend(proc.poll(100, Duration::from_secs(1)).await.expect("poll"));
        }

        // 2. A second member joins; the processor's consumer serves the rebalance (records
        // it returns meanwhile are set aside, never processed) until each owns one partition.
        let c = proc.consumer.clone();
        let (brokers2, input2, group2) = (brokers.clone(), input.clone(), group.clone());
        let (kept, other) = tokio::task::spawn_blocking(move || {
            let other: BaseConsumer = ClientConfig::new()
                .set("bootstrap.servers", &brokers2)
                .set("group.id", &group2)
                .set("enable.auto.commit", "false")
                .set("partition.assignment.strategy", "cooperative-sticky")
                .set("session.timeout.ms", "6000")
                .set("heartbeat.interval.ms", "100")
                .create()
                .expect("second member");
            other.subscribe(&[&input2]).expect("subscribe");
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            loop {
                let _ = c.poll(Duration::from_millis(50));
                let _ = other.poll(Duration::from_millis(50));
                let (mine, theirs) = (owned(&c), owned(&other));
                if mine.len() == 1 && theirs.len() == 1 {
                    return (mine[0], other);
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "the rebalance did not split the partitions within 30 s: processor \
                     {mine:?}, second member {theirs:?}"
                );
            }
        })
        .await
        .expect("rebalance driver");
        let revoked = 1 - kept;

        // 3. The batch step on what was polled before the revocation.
        let mut transformed: Vec<(i32, i64)> = Vec::new();
        let out = output.clone();
        let mut transform = |env: &Envelope| {
            transformed.push((env.source.partition.unwrap_or(-1), env_offset(env)));
            let k = env
                .headers
                .get_str(DEDUP_HEADER)
                .unwrap_or_default()
                .to_string();
            Ok(vec![
                OutgoingMessage::new(out.clone(), format!("out:{k}")).with_dedup_key(k)
            ])
        };
        let kept_polled: Vec<i64> = polled
            .iter()
            .filter(|r| r.env.source.partition == Some(kept))
            .map(|r| env_offset(&r.env))
            .collect();
        let result = proc.run_batch(polled, &mut transform).await;

        let of_revoked: Vec<&(i32, i64)> =
            transformed.iter().filter(|(p, _)| *p == revoked).collect();
        let offsets = committed(&brokers, &group, &input, 2);
        let outputs = read_committed(&brokers, &output);
        drop(other);
        assert!(
            result.as_ref().is_ok_and(|n| *n == kept_polled.len())
                && of_revoked.is_empty()
                && offsets[revoked as usize].is_none()
                && offsets[kept as usize] == kept_polled.iter().max().map(|o| o + 1)
                && outputs.len() == kept_polled.len(),
            "partition {revoked} was revoked between the poll and the commit, {kept} kept: \
             batch result {result:?}; {} records of the revoked partition transformed \
             (partition, offset: {of_revoked:?}); committed offsets {offsets:?} (want none on \
             {revoked}, {:?} on {kept}); {} committed outputs (want {})",
            of_revoked.len(),
            kept_polled.iter().max().map(|o| o + 1),
            outputs.len(),
            kept_polled.len(),
        );
    }
}

#[cfg(test)]
mod fenced_tests {
    //! A fenced processor stops for good (real broker; skipped without
    //! `IDEMQ_TEST_KAFKA_BROKERS`).
    use super::tests::{brokers, committed, create_topic, unique};
    use super::*;
    use idemq_core::publish::Publisher;

    fn position(c: &BaseConsumer<TxnCtx>) -> Vec<(i32, Offset)> {
        c.position()
            .map(|t| {
                t.elements()
                    .iter()
                    .map(|e| (e.partition(), e.offset()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Fenced mid-batch by a newer instance with its `transactional.id`, the processor
    /// returns `Fenced`, then refuses every later batch with `Fenced` without consuming
    /// anything more (its consumer's position stays where the fenced batch left it), and
    /// keeps no business-dedup keys; the group's offsets stay at its last commit.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_fenced_processor_refuses_later_batches_and_consumes_nothing_more() {
        let Some(brokers) = brokers() else {
            eprintln!("skipped: IDEMQ_TEST_KAFKA_BROKERS is not set");
            return;
        };
        let input = unique("fenced-in");
        let output = unique("fenced-out");
        create_topic(&brokers, &input, 1).await;
        create_topic(&brokers, &output, 1).await;
        let publisher = crate::KafkaPublisher::connect(&KafkaProducerConfig::idempotent(&brokers))
            .await
            .expect("publisher");
        let msgs: Vec<OutgoingMessage> = (0..20)
            .map(|i| {
                let k = format!("{input}-{i:02}");
                OutgoingMessage::new(&input, k.clone()).with_dedup_key(k)
            })
            .collect();
        for r in publisher.publish_batch(msgs).await {
            r.expect("publish");
        }
        let group = format!("{input}-g");
        let cfg = KafkaProducerConfig::transactional(&brokers, &unique("fenced-txn"));
        let opts = |group: &str| {
            TxnOptions::default()
                .consumer_property("session.timeout.ms", "6000")
                .dedup(BusinessDedup::new(
                    KeyStrategy::dedup_header(group).expect("key strategy"),
                ))
        };
        let mut old =
            TransactionalProcessor::with_options(&cfg, &group, &[input.as_str()], opts(&group))
                .await
                .expect("processor");
        let out = output.clone();
        let forward =
            move |env: &Envelope| Ok(vec![OutgoingMessage::new(out.clone(), env.payload.clone())]);
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let mut done = 0;
        while done == 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "no first batch within 30 s"
            );
            done = old
                .process_batch(5, Duration::from_secs(1), forward.clone())
                .await
                .expect("first batch");
        }
        assert_eq!(done, 5, "the first batch");
        // A newer instance with the same transactional.id (in another group: it takes no
        // partition away) fences the old one.
        let other = format!("{group}-new");
        let _new =
            TransactionalProcessor::with_options(&cfg, &other, &[input.as_str()], opts(&other))
                .await
                .expect("newer instance");
        let fenced = old
            .process_batch(5, Duration::from_secs(5), forward.clone())
            .await;
        assert!(
            matches!(fenced, Err(TxnError::Fenced(_))),
            "the old instance is fenced: {fenced:?}"
        );
        let at = position(&old.consumer);
        let again = old
            .process_batch(5, Duration::from_secs(2), forward.clone())
            .await;
        let after = position(&old.consumer);
        let keys_left = lock(&old.parts).index.len();
        let offsets = committed(&brokers, &group, &input, 1);
        assert!(
            matches!(&again, Err(TxnError::Fenced(why)) if why.contains("stopped earlier"))
                && after == at
                && keys_left == 0
                && offsets == [Some(5)],
            "after being fenced: later batch {again:?} (want Fenced, stopped earlier); consumer \
             position {at:?} then {after:?} (want unchanged); {keys_left} partitions' keys kept \
             (want 0); committed offsets {offsets:?} (want [Some(5)])"
        );
    }
}

#[cfg(test)]
mod failed_call_tests {
    //! Transactional calls that fail without ending the processor, on the real broker
    //! (skipped without `IDEMQ_TEST_KAFKA_BROKERS`).
    use super::tests::{brokers, committed, create_topic, read_committed, unique};
    use super::*;
    use idemq_core::publish::Publisher;

    /// Polls until a batch of up to `max` records arrives (the group's first assignment
    /// takes a few seconds).
    async fn poll_batch(proc: &TransactionalProcessor, max: usize) -> Vec<Polled> {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let polled = proc.poll(max, Duration::from_secs(1)).await.expect("poll");
            if !polled.is_empty() {
                return polled;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no records within 30 s"
            );
        }
    }

    fn offsets(polled: &[Polled]) -> Vec<i64> {
        polled.iter().map(|r| env_offset(&r.env)).collect()
    }

    /// A polled batch whose transaction cannot begin (here a transaction is already open
    /// on the producer: librdkafka refuses with a state error, not fatal) is not skipped:
    /// the input is rewound to the committed offsets, so the next poll returns the same
    /// records, and they are committed once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_batch_whose_transaction_cannot_begin_is_consumed_again_not_skipped() {
        let Some(brokers) = brokers() else {
            eprintln!("skipped: IDEMQ_TEST_KAFKA_BROKERS is not set");
            return;
        };
        let input = unique("begin-in");
        let output = unique("begin-out");
        create_topic(&brokers, &input, 1).await;
        create_topic(&brokers, &output, 1).await;
        let publisher = crate::KafkaPublisher::connect(&KafkaProducerConfig::idempotent(&brokers))
            .await
            .expect("publisher");
        let msgs: Vec<OutgoingMessage> = (0..10)
            .map(|i| OutgoingMessage::new(&input, format!("{input}-{i:02}")))
            .collect();
        for r in publisher.publish_batch(msgs).await {
            r.expect("publish");
        }
        let group = format!("{input}-g");
        let cfg = KafkaProducerConfig::transactional(&brokers, &unique("begin-txn"));
        let proc = TransactionalProcessor::new(&cfg, &group, &[input.as_str()])
            .await
            .expect("processor");
        let out = output.clone();
        let forward =
            move |env: &Envelope| Ok(vec![OutgoingMessage::new(out.clone(), env.payload.clone())]);

        let first = poll_batch(&proc, 5).await;
        let first_offsets = offsets(&first);
        let first_payloads: Vec<String> = first
            .iter()
            .map(|r| String::from_utf8_lossy(&r.env.payload).into_owned())
            .collect();
        proc.producer
            .begin_transaction()
            .expect("the test opens a transaction");
        let failed = proc.run_batch(first, forward.clone()).await;
        // The test's own transaction: closed, so that the next batch can begin.
        let p = proc.producer.clone();
        tokio::task::spawn_blocking(move || p.abort_transaction(Duration::from_secs(10)))
            .await
            .expect("abort task")
            .expect("abort the test's transaction");

        let again = poll_batch(&proc, 5).await;
        let again_offsets = offsets(&again);
        let done = proc.run_batch(again, forward).await;
        let offsets = committed(&brokers, &group, &input, 1);
        let outputs = read_committed(&brokers, &output);
        let next = first_offsets.iter().max().map(|o| o + 1);
        assert!(
            matches!(failed, Err(TxnError::Aborted(_)))
                && again_offsets == first_offsets
                && done.as_ref().is_ok_and(|n| *n == first_offsets.len())
                && offsets == [next]
                && outputs == first_payloads,
            "begin failed: {failed:?} (want Aborted); the next poll returned offsets \
             {again_offsets:?} (want the failed batch's {first_offsets:?} again); that batch: \
             {done:?}; committed offsets {offsets:?} (want [{next:?}]); committed outputs \
             {outputs:?} (want {first_payloads:?})"
        );
    }

    /// A commit that librdkafka reports as retriable (its time ran out before the broker's
    /// answer: the outcome is undecided and the commit goes on in the background) is called
    /// again, not aborted: the transaction commits and its output becomes visible.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_commit_that_timed_out_is_called_again_and_commits() {
        let Some(brokers) = brokers() else {
            eprintln!("skipped: IDEMQ_TEST_KAFKA_BROKERS is not set");
            return;
        };
        let input = unique("retry-in");
        let output = unique("retry-out");
        create_topic(&brokers, &input, 1).await;
        create_topic(&brokers, &output, 1).await;
        let cfg = KafkaProducerConfig::transactional(&brokers, &unique("retry-txn"));
        let proc = TransactionalProcessor::new(&cfg, &format!("{input}-g"), &[input.as_str()])
            .await
            .expect("processor");
        proc.producer.begin_transaction().expect("begin");
        proc.send_to(&OutgoingMessage::new(output.clone(), "paid"), None)
            .await
            .expect("delivered into the open transaction");
        let p = proc.producer.clone();
        let budget = Duration::from_secs(20);
        let (result, faults) = tokio::task::spawn_blocking(move || {
            let mut faults = Vec::new();
            let result = with_retries("commit_transaction", budget, Instant::now() + budget, |t| {
                // The first call gets no time at all: librdkafka sends EndTxn and
                // returns before the broker can answer.
                let t = if faults.is_empty() { Duration::ZERO } else { t };
                crate::commit_transaction(&p, t).map_err(|e| {
                    let f = Fault::of(&e);
                    faults.push(f.clone());
                    f
                })
            });
            (result, faults)
        })
        .await
        .expect("commit task");
        let outputs = read_committed(&brokers, &output);
        assert!(
            result.is_ok()
                && faults
                    .first()
                    .is_some_and(|f| f.retriable && !f.abortable && !f.fatal)
                && outputs == ["paid"],
            "commit: {result:?} after faults {faults:?} (want Ok after a first retriable \
             one); committed outputs {outputs:?} (want [\"paid\"])"
        );
    }
}

#[cfg(test)]
mod decision_tests {
    //! Which failed transactional calls are retried, aborted or stop the processor
    //! (librdkafka's contract), and the bounded retry loop, without a broker.
    use super::*;

    fn fault(fenced: bool, fatal: bool, abortable: bool, retriable: bool) -> Fault {
        Fault {
            text: "test fault".into(),
            fenced,
            fatal,
            abortable,
            retriable,
            config: false,
        }
    }

    #[test]
    fn only_a_retriable_fault_is_retried_and_an_abortable_one_is_aborted_even_if_retriable() {
        let cases = [
            // (fenced, fatal, abortable, retriable) → next
            ((false, false, false, true), Next::Retry),
            ((false, false, true, false), Next::Abort),
            ((false, false, true, true), Next::Abort),
            ((false, true, false, false), Next::Fatal),
            ((false, true, true, true), Next::Fatal),
            ((true, true, false, false), Next::Fenced),
            ((false, false, false, false), Next::Abort),
        ];
        let wrong: Vec<_> = cases
            .iter()
            .filter(|((fe, fa, ab, re), want)| next_step(&fault(*fe, *fa, *ab, *re)) != *want)
            .map(|((fe, fa, ab, re), want)| {
                let got = next_step(&fault(*fe, *fa, *ab, *re));
                format!(
                    "fenced={fe} fatal={fa} abortable={ab} retriable={re}: {got:?}, want {want:?}"
                )
            })
            .collect();
        assert!(wrong.is_empty(), "{wrong:#?}");
    }

    #[test]
    fn errors_outside_librdkafkas_transaction_api_are_sorted_as_before() {
        let cases = [
            // Records still in flight when the commit's wait ran out: undecided.
            (
                KafkaError::Flush(RDKafkaErrorCode::OperationTimedOut),
                Next::Retry,
            ),
            (
                KafkaError::MessageProduction(RDKafkaErrorCode::ProducerFenced),
                Next::Fenced,
            ),
            (
                KafkaError::MessageProduction(RDKafkaErrorCode::InvalidTransactionTimeout),
                Next::Config,
            ),
            (
                KafkaError::MessageProduction(RDKafkaErrorCode::MessageTimedOut),
                Next::Abort,
            ),
            (KafkaError::Canceled, Next::Abort),
        ];
        for (e, want) in cases {
            assert_eq!(next_step(&Fault::of(&e)), want, "{e}");
        }
    }

    #[test]
    fn a_retriable_call_is_called_again_until_it_succeeds_within_the_budget() {
        let budget = Duration::from_secs(8);
        let mut timeouts = Vec::new();
        let r = with_retries("commit_transaction", budget, Instant::now() + budget, |t| {
            timeouts.push(t);
            if timeouts.len() < 3 {
                Err(fault(false, false, false, true))
            } else {
                Ok(timeouts.len())
            }
        });
        assert!(
            r == Ok(3) && timeouts.iter().all(|t| *t <= budget / ATTEMPTS_PER_BUDGET),
            "result {r:?}, per-call timeouts {timeouts:?} (want 3 calls, each ≤ a quarter \
             of {budget:?})"
        );
    }

    #[test]
    fn a_call_that_stays_retriable_gives_up_as_retry_once_the_budget_is_spent() {
        let budget = Duration::from_millis(400);
        let started = Instant::now();
        let mut calls = 0;
        let r: Result<(), _> = with_retries("commit_transaction", budget, started + budget, |_| {
            calls += 1;
            Err(fault(false, false, false, true))
        });
        let took = started.elapsed();
        assert!(
            matches!(r, Err((Next::Retry, _))) && calls >= 2 && took <= budget,
            "result {r:?} after {calls} calls in {took:?} (want Retry, more than one call, \
             within {budget:?})"
        );
    }

    #[test]
    fn an_abortable_or_fatal_call_is_not_called_again() {
        for (f, want) in [
            (fault(false, false, true, true), Next::Abort),
            (fault(false, true, false, false), Next::Fatal),
            (fault(true, true, false, false), Next::Fenced),
        ] {
            let mut calls = 0;
            let budget = Duration::from_secs(8);
            let r: Result<(), _> = with_retries(
                "commit_transaction",
                budget,
                Instant::now() + budget,
                |_| {
                    calls += 1;
                    Err(f.clone())
                },
            );
            assert!(
                matches!(&r, Err((next, _)) if *next == want) && calls == 1,
                "{f:?}: {r:?} after {calls} calls (want {want:?} after 1)"
            );
        }
    }
}
