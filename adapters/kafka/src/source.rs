//! The consumer-group [`Source`].

use crate::envelope::{convert, ValueChunks, UNREADABLE_HEADERS};
use crate::publisher::{produce, KafkaPublisher};
use crate::KafkaSourceError;
use async_trait::async_trait;
use idemq_core::adapter::{
    DelayedRedelivery, Epoch, HeldSettle, LocallyHeld, OffsetStore, OffsetTracker, PartitionId,
    SharedState,
};
use idemq_core::envelope::{props, Headers};
use idemq_core::source::{Delivery, Readiness, ReadinessProbe, Source, SourceError};
use idemq_core::Envelope;
use rdkafka::client::ClientContext;
use rdkafka::consumer::RebalanceProtocol;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::producer::FutureProducer;
use rdkafka::types::{RDKafkaErrorCode, RDKafkaRespErr};
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::Duration;
use tokio::time::Instant;

/// Header naming why a record was dead-lettered.
pub const DLQ_REASON: &str = "idemq-dlq-reason";
/// Header with the original topic of a dead-lettered record.
pub const DLQ_TOPIC: &str = "idemq-dlq-topic";
/// Header with the original partition of a dead-lettered record.
pub const DLQ_PARTITION: &str = "idemq-dlq-partition";
/// Header with the original offset of a dead-lettered record.
pub const DLQ_OFFSET: &str = "idemq-dlq-offset";

/// Settings of a [`KafkaSource`].
#[derive(Debug, Clone)]
pub struct KafkaSourceConfig {
    /// librdkafka consumer properties; `enable.auto.commit`, `enable.auto.offset.store` and
    /// `isolation.level` are set by the source.
    pub client: ClientConfig,
    /// Topics to subscribe to.
    pub topics: Vec<String>,
    /// The name put in [`SourceRef::cluster`](idemq_core::envelope::SourceRef::cluster).
    pub cluster: Option<String>,
    /// Dead-letter topic; `None` = `<topic>.dlq`.
    pub dead_letter_topic: Option<String>,
    /// Read only committed transactional records (`isolation.level=read_committed`).
    pub read_committed: bool,
    /// Records buffered per partition (default 10 000). Once a partition's buffer is full
    /// (one held back by a nack aside), the background thread stops taking records from
    /// librdkafka (which keeps what it prefetched, within its own
    /// `queued.max.messages.kbytes`) for up to a second at a time, then polls anyway, so
    /// rebalances and `max.poll.interval.ms` are still served; a partition whose buffer
    /// reaches twice this is paused (resumed at half), the last resort, because a paused
    /// partition loses what librdkafka prefetched and is fetched again on resume (pausing at
    /// this size alone halved the engine's throughput).
    pub buffer_per_partition: usize,
    /// How often settled offsets are committed besides after each batch (the polling thread
    /// commits on its next turn after a batch is done).
    pub commit_interval: Duration,
    /// Longest wait for a dead-letter produce to be confirmed.
    pub dead_letter_timeout: Duration,
    /// Where consumed offsets really live: assigned partitions start at the offsets it
    /// returns instead of Kafka's committed ones (see [`OffsetStore`]). Kafka commits go on
    /// as an advisory copy (lag monitoring).
    pub offset_store: Option<Arc<dyn OffsetStore>>,
}

impl KafkaSourceConfig {
    /// A consumer of `topics` in `group` on `bootstrap_servers`, from the earliest offset
    /// when the group has none committed.
    pub fn new(bootstrap_servers: &str, group: &str, topics: &[&str]) -> Self {
        let mut client = ClientConfig::new();
        client
            .set("bootstrap.servers", bootstrap_servers)
            .set("group.id", group)
            .set("auto.offset.reset", "earliest");
        Self {
            client,
            topics: topics.iter().map(|t| t.to_string()).collect(),
            cluster: None,
            dead_letter_topic: None,
            read_committed: false,
            buffer_per_partition: 10_000,
            commit_interval: Duration::from_secs(5),
            dead_letter_timeout: Duration::from_secs(30),
            offset_store: None,
        }
    }

    /// Starts every assigned partition at the offset `store` holds for it, not at Kafka's
    /// committed offset (builder form; see [`OffsetStore`]).
    ///
    /// ```no_run
    /// # async fn demo(store: idemq_sql::PgStore) -> Result<(), Box<dyn std::error::Error>> {
    /// use idemq_kafka::{KafkaSource, KafkaSourceConfig};
    /// // Flow 3: the offsets are written with the effects (idemq-sql's LogToDatabase).
    /// let flow = idemq_sql::LogToDatabase::new(store, "billing").await?;
    /// let cfg = KafkaSourceConfig::new("127.0.0.1:9092", "billing", &["payments"])
    ///     .offsets_from(flow.offset_store()?);
    /// assert!(cfg.offset_store.is_some());
    /// # Ok(()) }
    /// ```
    pub fn offsets_from(mut self, store: impl OffsetStore) -> Self {
        self.offset_store = Some(Arc::new(store));
        self
    }

    /// Sets a librdkafka consumer property (builder form).
    pub fn set(mut self, key: &str, value: &str) -> Self {
        self.client.set(key, value);
        self
    }

    /// Names the cluster in every envelope's source reference (builder form).
    pub fn cluster(mut self, name: &str) -> Self {
        self.cluster = Some(name.to_string());
        self
    }

    /// Dead-letters into `topic` instead of `<topic>.dlq` (builder form).
    pub fn dead_letter_topic(mut self, topic: &str) -> Self {
        self.dead_letter_topic = Some(topic.to_string());
        self
    }

    /// Reads only committed transactional records (builder form).
    pub fn read_committed(mut self) -> Self {
        self.read_committed = true;
        self
    }

    /// Static group membership (builder form): this consumer is `instance_id` in its group
    /// (librdkafka's `group.instance.id`, Kafka's KIP-345), an id that belongs to one
    /// consumer process and stays the same across its restarts (the pod or host name, a
    /// slot number), 1 to 249 characters of `A-Z a-z 0-9 . _ -`.
    ///
    /// A dynamic member (the default) that dies without leaving the group (SIGKILL, crash,
    /// power loss) keeps its partitions until its session times out
    /// ([`session_timeout`](Self::session_timeout), 45 s by default): a restarted consumer
    /// joins as a new member and nobody reads those partitions meanwhile. A static member
    /// that comes back under the same id within its session timeout takes its old place at
    /// once, with the same partitions and no rebalance of the others. The price: a static
    /// member that does *not* come back holds its partitions for the whole session timeout
    /// (it does not leave the group on close either: under the classic group protocol,
    /// the default, librdkafka sends no LeaveGroup for a static member), and two live
    /// consumers with one id fence each other (the broker fences the older one: librdkafka
    /// logs a fatal `FencedInstanceId` error, and it gets no partitions any more).
    pub fn static_member(mut self, instance_id: &str) -> Self {
        self.client.set("group.instance.id", instance_id);
        self
    }

    /// How long the group coordinator waits for a silent member before handing its
    /// partitions to others (`session.timeout.ms`, builder form; librdkafka's default is
    /// 45 s, the broker accepts 6 s to 30 min by default). Heartbeats go out every
    /// `heartbeat.interval.ms` (3 s by default), which must stay well below it. With
    /// [`static_member`](Self::static_member), make it longer than a restart takes.
    pub fn session_timeout(mut self, timeout: Duration) -> Self {
        self.client
            .set("session.timeout.ms", timeout.as_millis().to_string());
        self
    }

    /// The static member id, when set ([`KafkaSourceConfig::static_member`]).
    pub fn instance_id(&self) -> Option<&str> {
        self.client.get("group.instance.id")
    }

    /// The dead-letter topic for records of `topic`.
    pub fn dead_letter_topic_for(&self, topic: &str) -> String {
        self.dead_letter_topic
            .clone()
            .unwrap_or_else(|| format!("{topic}.dlq"))
    }
}

/// Kafka's rule for `group.instance.id`: the broker would refuse another id only when the
/// consumer joins, long after construction.
fn check_instance_id(id: &str) -> Result<(), KafkaSourceError> {
    let legal = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    if id.is_empty() || id.len() > 249 || !id.chars().all(legal) || id == "." || id == ".." {
        return Err(KafkaSourceError::Config(format!(
            "group.instance.id `{id}` is not usable: use 1 to 249 characters from \
             A-Z a-z 0-9 . _ - (not `.` or `..`), one id per consumer process, the same \
             across its restarts"
        )));
    }
    Ok(())
}

/// One assignment of a partition, shared by the source and every delivery made under it.
///
/// A delivery settles and answers `is_stale` through its slot alone: an atomic load, and a
/// push onto the slot's own list, instead of the source's state lock and a hashed partition
/// lookup in the tracker per message (with the partition's name copied into every delivery).
/// The polling thread moves the settled offsets into the tracker before each commit and
/// before a revoke ([`absorb_settled`]).
struct PartSlot {
    id: PartitionId,
    epoch: Epoch,
    /// True while this is the partition's current assignment; cleared, under the state
    /// lock, when it is revoked or replaced and when the source closes. Settlements of a
    /// slot no longer current are dropped: the partition's new owner reads the records again.
    current: AtomicBool,
    /// Offsets settled since the polling thread last moved them into the tracker.
    settled: Mutex<Vec<i64>>,
    /// The list `absorb_settled` swaps in for `settled` and works through: the two keep
    /// their capacity, so no settlement allocates once they have grown.
    absorbing: Mutex<Vec<i64>>,
    /// The source's state, for a nack (held here) and the staleness check of a dead letter.
    /// Weak: the state holds the slot.
    shared: Weak<Shared>,
    dlq: Arc<DeadLetter>,
}

impl std::fmt::Debug for PartSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PartSlot")
            .field("id", &self.id)
            .field("epoch", &self.epoch)
            .field("current", &self.is_current())
            .finish_non_exhaustive()
    }
}

impl PartSlot {
    fn is_current(&self) -> bool {
        self.current.load(Ordering::Acquire)
    }

    /// Ends the assignment (call under the state lock).
    fn retire(&self) {
        self.current.store(false, Ordering::Release);
    }
}

/// A record in its partition's buffer, not yet handed to the engine: its offset is
/// already outstanding in the tracker (marked on the polling thread at hand-over).
#[derive(Debug)]
struct Buffered {
    offset: i64,
    envelope: Envelope,
    /// Its headers could not be read ([`UNREADABLE_HEADERS`]): dead-lettered by `poll`.
    unreadable: bool,
}

/// A nacked record held until it is due again, with the assignment it was consumed under.
#[derive(Debug)]
struct Record {
    slot: Arc<PartSlot>,
    offset: i64,
    envelope: Envelope,
    /// When a held (nacked) record is due again.
    held_until: Instant,
}

/// Holds `r` until its `held_until`, keeping its partition's held records in **offset**
/// order. The engine sends records back in the order their fates become known, which is not
/// offset order: in an ordered batch a record whose key is in flight elsewhere goes back
/// (with the rest of its lane) during dispatch, before an earlier record of the partition
/// whose handler fails afterwards. Redelivered in that order, the later records would run
/// first, and with offsets stored alongside the effects (Flow 3) move the stored offset past
/// records that have not run; a crash then skipped them for good. A record due later than
/// one behind it holds that one back too (`DelayedRedelivery` never lets a lane's later item
/// be due before an earlier one).
fn hold_in_offset_order(delayed: &mut DelayedRedelivery<Record, PartitionId>, r: Record) {
    let lane = r.slot.id.clone();
    if !delayed.holds(&lane) {
        let due = r.held_until;
        delayed.push(lane, r, due);
        return;
    }
    let mut held = delayed.drain_lanes(|l| *l == lane);
    held.push(r);
    held.sort_by_key(|h| h.offset);
    for h in held {
        let due = h.held_until;
        delayed.push(lane.clone(), h, due);
    }
}

#[derive(Debug)]
struct PartState {
    slot: Arc<PartSlot>,
    buffer: VecDeque<Buffered>,
    paused: bool,
}

#[derive(Debug, Default)]
struct State {
    tracker: OffsetTracker,
    parts: HashMap<PartitionId, PartState>,
    delayed: DelayedRedelivery<Record, PartitionId>,
    closed: bool,
    fatal: Option<String>,
}

/// What the source, its polling thread and its deliveries share.
#[derive(Debug)]
struct Shared {
    sync: SharedState<State>,
    stop: AtomicBool,
    /// A batch finished since the last commit: the polling thread commits on its next turn.
    commit_wanted: AtomicBool,
    /// The group coordinator has assigned partitions (possibly none) and no eager rebalance
    /// has taken them away since: what [`Source::readiness`] reports.
    assigned: AtomicBool,
}

/// The consumer context: rebalance and commit callbacks, run on the polling thread.
struct Ctx {
    shared: Arc<Shared>,
    offsets: Option<Arc<dyn OffsetStore>>,
    dlq: Arc<DeadLetter>,
}

impl Ctx {
    /// Sets each partition of an assignment to the offset the [`OffsetStore`] holds for it.
    fn seek_to_stored(&self, tpl: &mut TopicPartitionList) {
        let Some(store) = &self.offsets else {
            return;
        };
        let parts: Vec<PartitionId> = tpl
            .elements()
            .iter()
            .map(|e| (e.topic().to_string(), e.partition()))
            .collect();
        match store.positions(&parts) {
            Ok(found) => {
                for ((topic, partition), offset) in found {
                    if let Err(e) =
                        tpl.set_partition_offset(&topic, partition, Offset::Offset(offset))
                    {
                        tracing::warn!(%topic, partition, error = %e, "stored offset not applied");
                    }
                }
                tracing::info!(
                    assigned = parts.len(),
                    "assigned partitions start at the stored offsets"
                );
            }
            Err(e) => tracing::warn!(
                error = %e,
                "stored offsets unavailable: starting from Kafka's committed offsets (never \
                 past the stored ones; repeats are absorbed by the dedup records)"
            ),
        }
    }
}

impl ClientContext for Ctx {}

impl ConsumerContext for Ctx {
    // rdkafka's default strategy, with the stored offsets set on the assignment first.
    fn rebalance(
        &self,
        consumer: &BaseConsumer<Self>,
        err: RDKafkaRespErr,
        tpl: &mut TopicPartitionList,
    ) {
        let assigning = err == RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS;
        if assigning {
            self.seek_to_stored(tpl);
        }
        let rebalance = match err {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => Rebalance::Assign(tpl),
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS => Rebalance::Revoke(tpl),
            other => Rebalance::Error(KafkaError::Rebalance(RDKafkaErrorCode::from(other))),
        };
        self.pre_rebalance(consumer, &rebalance);
        let cooperative = matches!(
            consumer.rebalance_protocol(),
            RebalanceProtocol::Cooperative
        );
        let done = match (assigning, cooperative) {
            (true, true) => consumer.incremental_assign(tpl),
            (true, false) => consumer.assign(tpl),
            (false, true) => consumer.incremental_unassign(tpl),
            (false, false) => consumer.unassign(),
        };
        if let Err(e) = done {
            tracing::warn!(error = %e, assigning, "applying a rebalance failed");
        }
        self.post_rebalance(consumer, &rebalance);
        // An eager revoke takes every partition away until the next assignment; a
        // cooperative one only some, and the rest keep flowing.
        if assigning {
            self.shared.assigned.store(true, Ordering::Release);
        } else if !cooperative {
            self.shared.assigned.store(false, Ordering::Release);
        }
    }

    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let Rebalance::Revoke(tpl) = rebalance else {
            return;
        };
        let mut finals = TopicPartitionList::new();
        {
            let mut st = self.shared.sync.lock();
            // What the engine settled since the last commit counts in the final one.
            absorb_settled(&mut st);
            for e in tpl.elements() {
                let p: PartitionId = (e.topic().to_string(), e.partition());
                if let Some(w) = st.tracker.revoke(&p) {
                    // Adding a partition to a fresh list cannot fail.
                    let _ = finals.add_partition_offset(&p.0, p.1, Offset::Offset(w));
                }
                if let Some(ps) = st.parts.remove(&p) {
                    ps.slot.retire();
                }
                st.delayed.drain_lanes(|l| *l == p);
            }
        }
        tracing::info!(
            revoked = tpl.count(),
            committing = finals.count(),
            "kafka partitions revoked"
        );
        metrics::counter!(crate::metrics::PARTITIONS_REVOKED).increment(tpl.count() as u64);
        if finals.count() > 0 && !consumer.assignment_lost() {
            if let Err(e) = consumer.commit(&finals, CommitMode::Sync) {
                tracing::warn!(error = %e, "final commit of revoked partitions failed; their settled records will be redelivered");
            }
        }
    }

    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Assign(tpl) => {
                {
                    let mut st = self.shared.sync.lock();
                    for e in tpl.elements() {
                        let p: PartitionId = (e.topic().to_string(), e.partition());
                        let epoch = st.tracker.assign(p.clone(), 0);
                        let slot = Arc::new(PartSlot {
                            id: p.clone(),
                            epoch,
                            current: AtomicBool::new(true),
                            settled: Mutex::new(Vec::new()),
                            absorbing: Mutex::new(Vec::new()),
                            shared: Arc::downgrade(&self.shared),
                            dlq: self.dlq.clone(),
                        });
                        let fresh = PartState {
                            slot,
                            buffer: VecDeque::new(),
                            paused: false,
                        };
                        if let Some(old) = st.parts.insert(p, fresh) {
                            old.slot.retire();
                        }
                    }
                }
                // A partition paused under an earlier assignment must not stay paused.
                if let Err(e) = consumer.resume(tpl) {
                    tracing::debug!(error = %e, "resume of newly assigned partitions");
                }
                tracing::info!(assigned = tpl.count(), "kafka partitions assigned");
            }
            Rebalance::Error(e) => tracing::warn!(error = %e, "kafka rebalance error"),
            Rebalance::Revoke(_) => {}
        }
    }

    fn commit_callback(&self, result: KafkaResult<()>, offsets: &TopicPartitionList) {
        if let Err(e) = result {
            tracing::warn!(error = %e, "kafka offset commit failed; offering it again");
            metrics::counter!(crate::metrics::COMMIT_FAILURES).increment(1);
            let mut st = self.shared.sync.lock();
            for el in offsets.elements() {
                if let Offset::Offset(o) = el.offset() {
                    st.tracker
                        .commit_failed(&(el.topic().to_string(), el.partition()), o);
                }
            }
        }
    }
}

type Consumer_ = BaseConsumer<Ctx>;

/// Dead-lettering: a producer and the topic naming rule.
struct DeadLetter {
    producer: FutureProducer,
    cfg: KafkaSourceConfig,
}

/// A Kafka consumer-group subscription as an idemq [`Source`].
///
/// A background thread keeps polling librdkafka (so a slow batch never exceeds
/// `max.poll.interval.ms`) and buffers records per partition, pausing a partition whose
/// buffer is full. See the crate docs for how settlements map onto offsets.
pub struct KafkaSource {
    shared: Arc<Shared>,
    consumer: Option<Arc<Consumer_>>,
    poller: Option<JoinHandle<()>>,
    cfg: KafkaSourceConfig,
}

impl std::fmt::Debug for KafkaSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSource")
            .field("topics", &self.cfg.topics)
            .finish_non_exhaustive()
    }
}

impl KafkaSource {
    /// Creates the consumer, subscribes, and starts the polling thread. The Kafka client
    /// connects lazily: a broker that is not up yet is no error here (polls report
    /// [`SourceError::Disconnected`] until it answers; [`Source::readiness`] says when the
    /// group assigned partitions). Errors are the configuration's.
    pub async fn connect(cfg: KafkaSourceConfig) -> Result<Self, KafkaSourceError> {
        if cfg.topics.is_empty() {
            return Err(KafkaSourceError::Config("no topics to subscribe to".into()));
        }
        if cfg.client.get("group.id").is_none() {
            return Err(KafkaSourceError::Config(
                "group.id is missing: a source commits offsets for a consumer group".into(),
            ));
        }
        if let Some(id) = cfg.instance_id() {
            check_instance_id(id)?;
        }
        let mut client = cfg.client.clone();
        client
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("enable.partition.eof", "false")
            .set(
                "isolation.level",
                if cfg.read_committed {
                    "read_committed"
                } else {
                    "read_uncommitted"
                },
            );
        let shared = Arc::new(Shared {
            sync: SharedState::new(State::default()),
            stop: AtomicBool::new(false),
            commit_wanted: AtomicBool::new(false),
            assigned: AtomicBool::new(false),
        });
        let dlq = Arc::new(DeadLetter {
            producer: KafkaPublisher::producer_for(&cfg.client)?,
            cfg: cfg.clone(),
        });
        let consumer: Consumer_ = client
            .create_with_context(Ctx {
                shared: shared.clone(),
                offsets: cfg.offset_store.clone(),
                dlq,
            })
            .map_err(|e| KafkaSourceError::Client(e.to_string()))?;
        let topics: Vec<&str> = cfg.topics.iter().map(String::as_str).collect();
        consumer
            .subscribe(&topics)
            .map_err(|e| KafkaSourceError::Client(e.to_string()))?;
        let consumer = Arc::new(consumer);
        let poller = {
            let consumer = consumer.clone();
            let shared = shared.clone();
            let cfg = cfg.clone();
            spawn_poller(shared.clone(), move || poll_thread(consumer, shared, cfg))
                .map_err(|e| KafkaSourceError::Client(e.to_string()))?
        };
        Ok(Self {
            shared,
            consumer: Some(consumer),
            poller: Some(poller),
            cfg,
        })
    }

    /// Partitions assigned to this consumer now.
    pub fn assigned(&self) -> Vec<PartitionId> {
        let mut v: Vec<_> = self.shared.sync.lock().parts.keys().cloned().collect();
        v.sort();
        v
    }

    /// Commits what is committable now (asynchronously; a failure is offered again).
    pub fn commit_now(&self) -> Result<(), SourceError> {
        match &self.consumer {
            Some(c) => commit_ready(c, &self.shared, CommitMode::Async),
            None => Ok(()),
        }
    }

    /// Up to `max` deliveries: held records that are due, then buffered ones; and whether
    /// any of them could not become a proper envelope (see [`dead_letter_unreadable`]).
    fn take_batch(&self, st: &mut State, max: usize) -> (Vec<Delivery>, bool) {
        let mut out = Vec::with_capacity(max.min(1024));
        let mut unreadable = false;
        for rec in st.delayed.pop_due(Instant::now(), max) {
            if rec.slot.is_current()
                && st
                    .tracker
                    .delivered(&rec.slot.id, rec.slot.epoch, rec.offset)
            {
                unreadable |= rec.envelope.headers.get(UNREADABLE_HEADERS).is_some();
                out.push(delivery(rec.slot, rec.offset, rec.envelope));
            }
        }
        let mut resume = TopicPartitionList::new();
        let low_water = self.cfg.buffer_per_partition;
        let State { parts, delayed, .. } = st;
        let room = max.saturating_sub(out.len());
        // Buffered records are of their partition's current assignment (a revoke drops the
        // buffer) and already outstanding in the tracker: nothing to check per record.
        drain_fairly(
            parts,
            room,
            |p| delayed.holds(p),
            |slot, b| {
                unreadable |= b.unreadable;
                out.push(delivery(slot.clone(), b.offset, b.envelope));
                true
            },
        );
        for (p, ps) in parts.iter_mut() {
            if ps.paused && ps.buffer.len() <= low_water {
                ps.paused = false;
                let _ = resume.add_partition(&p.0, p.1);
            }
        }
        if resume.count() > 0 {
            if let Some(c) = &self.consumer {
                if let Err(e) = c.resume(&resume) {
                    tracing::warn!(error = %e, "resuming drained partitions failed");
                }
            }
        }
        (out, unreadable)
    }
}

/// The delivery of the record at `offset` under the assignment `slot`.
fn delivery(slot: Arc<PartSlot>, offset: i64, envelope: Envelope) -> Delivery {
    Delivery::new(
        envelope,
        Box::new(HeldSettle(KafkaSettle {
            slot,
            offset: Some(offset),
            envelope: None,
        })),
    )
}

/// Moves the offsets the engine settled since the last call from the partitions' slots into
/// the tracker (on the polling thread, before a commit or a revoke chooses its offsets).
fn absorb_settled(st: &mut State) {
    let State { tracker, parts, .. } = st;
    for ps in parts.values() {
        let slot = &ps.slot;
        let mut absorbing = lock(&slot.absorbing);
        std::mem::swap(&mut *absorbing, &mut *lock(&slot.settled));
        for offset in absorbing.drain(..) {
            tracker.settled(&slot.id, slot.epoch, offset);
        }
    }
}

/// Locks a slot's list (never poisoned: every update under it is one push or one take).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn commit_ready(
    consumer: &Consumer_,
    shared: &Shared,
    mode: CommitMode,
) -> Result<(), SourceError> {
    let mut tpl = TopicPartitionList::new();
    // Held while the commit is issued, so a revoke cannot slip between choosing the offsets
    // and sending them: a partition no longer owned is never committed.
    let mut st = shared.sync.lock();
    absorb_settled(&mut st);
    let commits = st.tracker.take_commits();
    if commits.is_empty() {
        return Ok(());
    }
    for ((topic, partition), offset) in &commits {
        let _ = tpl.add_partition_offset(topic, *partition, Offset::Offset(*offset));
    }
    if matches!(mode, CommitMode::Sync) {
        drop(st);
    }
    let result = consumer.commit(&tpl, mode);
    if let Err(e) = &result {
        metrics::counter!(crate::metrics::COMMIT_FAILURES).increment(1);
        let mut st = shared.sync.lock();
        for (p, o) in &commits {
            st.tracker.commit_failed(p, *o);
        }
        return Err(SourceError::Broker(format!("offset commit failed: {e}")));
    }
    Ok(())
}

/// Records taken from librdkafka in one go before they are handed to the source: one lock
/// and one wake-up per burst instead of per record (per-record hand-offs woke the consumer
/// task for every record and cost more than the records themselves).
const BURST: usize = 512;

/// Longest the background thread holds off polling while the buffers are full.
const THROTTLE_MAX: Duration = Duration::from_secs(1);

/// Takes up to `room` records from the partitions' buffers (partitions `held` selects are
/// skipped), an equal share from each partition that has records, in passes until `room`
/// records were accepted or the buffers are empty; `accept` answers whether it kept a record
/// (a record of a stale assignment is dropped and does not count). Records of one partition
/// leave in offset order. Taking from one partition until it ran dry had left the others'
/// buffers filling until they were paused, and a paused partition is fetched again on
/// resume: a stall of up to `fetch.wait.max.ms` behind the fetch request in flight.
fn drain_fairly(
    parts: &mut HashMap<PartitionId, PartState>,
    room: usize,
    held: impl Fn(&PartitionId) -> bool,
    mut accept: impl FnMut(&Arc<PartSlot>, Buffered) -> bool,
) {
    let mut accepted = 0;
    loop {
        let flowing = parts
            .iter()
            .filter(|(p, ps)| !ps.buffer.is_empty() && !held(p))
            .count();
        if flowing == 0 || accepted >= room {
            return;
        }
        let share = (room - accepted).div_ceil(flowing);
        for (p, ps) in parts.iter_mut() {
            if held(p) {
                continue;
            }
            let mut taken = 0;
            while taken < share && accepted < room {
                let Some(rec) = ps.buffer.pop_front() else {
                    break;
                };
                if accept(&ps.slot, rec) {
                    taken += 1;
                    accepted += 1;
                }
            }
        }
    }
}

/// Whether the polling thread should hold off: a partition whose records flow holds `cap`
/// of them. Judged per partition, not on the average, so that no flowing partition reaches
/// the pause threshold (twice `cap`) while others are light; a partition held back by a
/// nack is left out (its buffer fills and is paused in `hand_over`, the others go on).
fn buffers_full(shared: &Shared, cap: usize) -> bool {
    let st = shared.sync.lock();
    st.parts
        .iter()
        .any(|(p, ps)| ps.buffer.len() >= cap && !st.delayed.holds(p))
}

fn poll_thread(consumer: Arc<Consumer_>, shared: Arc<Shared>, cfg: KafkaSourceConfig) {
    let mut last_commit = std::time::Instant::now();
    let cap = cfg.buffer_per_partition.max(1);
    let mut burst: Vec<Polled> = Vec::with_capacity(BURST);
    let mut chunks = ValueChunks::shared();
    let mut last_poll = std::time::Instant::now();
    while !shared.stop.load(Ordering::Acquire) {
        // Back-pressure without pausing: while the buffers are full, leave the records in
        // librdkafka's queue, but poll at least once a second.
        if buffers_full(&shared, cap) && last_poll.elapsed() < THROTTLE_MAX {
            commit_when_due(&consumer, &shared, &cfg, &mut last_commit);
            std::thread::sleep(Duration::from_millis(1));
            continue;
        }
        last_poll = std::time::Instant::now();
        // Wait for one record, then take what else librdkafka already holds.
        let mut wait = Duration::from_millis(100);
        let mut fatal = false;
        while burst.len() < BURST {
            match consumer.poll(wait) {
                Some(Ok(msg)) => {
                    let (envelope, unreadable) = convert(&msg, cfg.cluster.as_deref(), &mut chunks);
                    burst.push(Polled {
                        partition: msg.partition(),
                        offset: msg.offset(),
                        envelope,
                        unreadable,
                    });
                    wait = Duration::ZERO;
                }
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "kafka consumer error");
                    if let rdkafka::error::KafkaError::MessageConsumptionFatal(code) = e {
                        shared.sync.lock().fatal = Some(format!("fatal consumer error: {code}"));
                        fatal = true;
                    }
                    break;
                }
                None => break,
            }
        }
        if !burst.is_empty() {
            hand_over(&consumer, &shared, &mut burst, cap);
        }
        if fatal {
            shared.sync.wake_one();
            break;
        }
        commit_when_due(&consumer, &shared, &cfg, &mut last_commit);
    }
}

/// Starts the polling thread running `body`. A panic on it is caught and kept as the
/// source's fatal error, which `poll` returns from then on: a thread that died must not
/// leave `poll` waiting for records that will never come (while the group, after
/// `max.poll.interval.ms`, hands the partitions to another member).
fn spawn_poller(
    shared: Arc<Shared>,
    body: impl FnOnce() + Send + 'static,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("idemq-kafka-poll".into())
        .spawn(move || {
            // Nothing `body` shares is left half-updated by a panic: the state's lock does
            // not poison and every update under it is one step.
            let Err(panic) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)) else {
                return;
            };
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".to_string());
            tracing::error!(panic = %what, "the kafka polling thread panicked: the source stops");
            shared.sync.lock().fatal = Some(format!("the polling thread panicked: {what}"));
            shared.sync.wake_one();
        })
}

/// Takes out of a batch the records that could not become envelopes (their headers were
/// unreadable, see [`UNREADABLE_HEADERS`]) and dead-letters each with the reason, on a task
/// of its own so that dropping `poll` cannot interrupt it; a dead letter that fails is held
/// and comes back like a nacked record, to be dead-lettered again.
fn dead_letter_unreadable(batch: Vec<Delivery>) -> Vec<Delivery> {
    if !batch
        .iter()
        .any(|d| d.envelope.headers.get(UNREADABLE_HEADERS).is_some())
    {
        return batch;
    }
    let mut out = Vec::with_capacity(batch.len());
    for d in batch {
        let Some(why) = d.envelope.headers.get(UNREADABLE_HEADERS) else {
            out.push(d);
            continue;
        };
        let reason = format!(
            "the record cannot become an envelope: {}",
            String::from_utf8_lossy(why)
        );
        let at = &d.envelope.source;
        tracing::warn!(topic = %at.name, partition = ?at.partition, position = ?at.position, %reason, "dead-lettering a record the source cannot convert");
        tokio::spawn(async move {
            if let Err(e) = d.reject(&reason).await {
                tracing::warn!(error = %e, "dead-lettering an unconvertible record failed; it is held and tried again");
            }
        });
    }
    out
}

/// Commits the settled offsets when a batch asked for it or `commit_interval` has passed.
fn commit_when_due(
    consumer: &Consumer_,
    shared: &Shared,
    cfg: &KafkaSourceConfig,
    last_commit: &mut std::time::Instant,
) {
    if shared.commit_wanted.swap(false, Ordering::AcqRel)
        || last_commit.elapsed() >= cfg.commit_interval
    {
        *last_commit = std::time::Instant::now();
        if let Err(e) = commit_ready(consumer, shared, CommitMode::Async) {
            tracing::warn!(error = %e, "offset commit failed");
        }
    }
}

/// A record taken from librdkafka, its topic in its envelope.
struct Polled {
    partition: i32,
    offset: i64,
    envelope: Envelope,
    unreadable: bool,
}

/// Moves a burst of records into their partitions' buffers, marking each outstanding in the
/// tracker (records of a partition no longer assigned are dropped: its new owner reads
/// them), pausing partitions whose buffer holds twice `cap` (the last resort, see
/// `buffer_per_partition`), and wakes the source once.
fn hand_over(consumer: &Consumer_, shared: &Shared, burst: &mut Vec<Polled>, cap: usize) {
    let mut st = shared.sync.lock();
    let State { tracker, parts, .. } = &mut *st;
    // The partition of the previous record: a burst holds runs of one partition's records,
    // so the lookup key is made only where the partition changes, not per record.
    let mut part: PartitionId = (String::new(), -1);
    for r in burst.drain(..) {
        if part.1 != r.partition || part.0 != r.envelope.source.name {
            part = (r.envelope.source.name.clone(), r.partition);
        }
        let part = &part;
        let Some(ps) = parts.get_mut(part) else {
            tracing::debug!(topic = %part.0, partition = part.1, "record of an unassigned partition dropped");
            continue;
        };
        if !tracker.delivered(part, ps.slot.epoch, r.offset) {
            continue;
        }
        let full = ps.buffer.len() + 1 >= cap.saturating_mul(2) && !ps.paused;
        if full {
            ps.paused = true;
            metrics::counter!(crate::metrics::PARTITIONS_PAUSED).increment(1);
            let mut tpl = TopicPartitionList::new();
            let _ = tpl.add_partition(&part.0, part.1);
            if let Err(e) = consumer.pause(&tpl) {
                tracing::warn!(error = %e, "pausing a full partition failed");
            }
        }
        ps.buffer.push_back(Buffered {
            offset: r.offset,
            envelope: r.envelope,
            unreadable: r.unreadable,
        });
    }
    drop(st);
    shared.sync.wake_one();
}

#[async_trait]
impl Source for KafkaSource {
    async fn poll(&mut self, max: usize) -> Result<Option<Vec<Delivery>>, SourceError> {
        let max = max.max(1);
        loop {
            let next_due = {
                let mut st = self.shared.sync.lock();
                if st.closed {
                    return Ok(None);
                }
                if let Some(f) = &st.fatal {
                    return Err(SourceError::Broker(f.clone()));
                }
                let (batch, unreadable) = self.take_batch(&mut st, max);
                if batch.is_empty() {
                    st.delayed.next_due()
                } else {
                    drop(st);
                    if !unreadable {
                        return Ok(Some(batch));
                    }
                    let batch = dead_letter_unreadable(batch);
                    if !batch.is_empty() {
                        return Ok(Some(batch));
                    }
                    // Every record taken was dead-lettered: look again at once.
                    continue;
                }
            };
            // Nothing has left the shared state yet: dropping this future loses nothing.
            let far = Instant::now() + Duration::from_secs(3600);
            tokio::select! {
                _ = self.shared.sync.woken() => {}
                _ = tokio::time::sleep_until(next_due.unwrap_or(far)) => {}
            }
        }
    }

    /// Asks the polling thread to commit on its next turn (at most a millisecond later
    /// while records flow, at most its 100 ms poll wait when idle) instead of committing
    /// here: `rd_kafka_commit` per batch from the consumer's thread contended with
    /// librdkafka's own threads for its queue lock, and commits asked for by several
    /// batches in between go out as one.
    async fn after_batch(&mut self) -> Result<(), SourceError> {
        self.shared.commit_wanted.store(true, Ordering::Release);
        Ok(())
    }

    async fn close(&mut self) -> Result<(), SourceError> {
        self.shared.stop.store(true, Ordering::Release);
        let poller = self.poller.take();
        let consumer = self.consumer.take();
        let shared = self.shared.clone();
        let result = tokio::task::spawn_blocking(move || {
            if let Some(p) = poller {
                let _ = p.join();
            }
            let Some(consumer) = consumer else {
                return Ok(());
            };
            let committed = commit_ready(&consumer, &shared, CommitMode::Sync);
            consumer.unsubscribe();
            // Dropping the last handle closes the consumer: it leaves the group, running
            // the revoke callback (which commits anything settled meanwhile).
            drop(consumer);
            committed
        })
        .await
        .map_err(|e| SourceError::Broker(format!("closing the consumer panicked: {e}")))?;
        let mut st = self.shared.sync.lock();
        st.closed = true;
        for ps in st.parts.values() {
            ps.slot.retire();
        }
        st.parts.clear();
        drop(st);
        self.shared.sync.wake_one();
        result
    }

    /// Ready once the group coordinator has assigned partitions (an empty assignment
    /// counts: the group has more members than partitions), until an eager rebalance
    /// revokes them. Before that the consumer has joined nothing yet, or waits for the
    /// coordinator: after a member of the group died without leaving, that lasts until the
    /// dead member's `session.timeout.ms` (45 s by default), unless the dead member was
    /// static and this consumer takes its place ([`KafkaSourceConfig::static_member`]).
    fn readiness(&self) -> ReadinessProbe {
        let shared = self.shared.clone();
        let topics = self.cfg.topics.join(", ");
        let group = self
            .cfg
            .client
            .get("group.id")
            .unwrap_or_default()
            .to_string();
        ReadinessProbe::new(move || {
            if !shared.assigned.load(Ordering::Acquire) {
                return Readiness::Waiting(format!(
                    "partitions of {topics} from the group coordinator of `{group}`"
                ));
            }
            let mut parts: Vec<PartitionId> = shared.sync.lock().parts.keys().cloned().collect();
            parts.sort();
            let named: Vec<String> = parts.iter().map(|(t, p)| format!("{t}[{p}]")).collect();
            Readiness::Ready(match parts.len() {
                0 => "assigned no partitions (the group has more members than partitions)"
                    .to_string(),
                1 => format!("assigned 1 partition: {}", named.join(", ")),
                n => format!("assigned {n} partitions: {}", named.join(", ")),
            })
        })
    }
}

impl Drop for KafkaSource {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        {
            let mut st = self.shared.sync.lock();
            st.closed = true;
            // Kept in the state: the revoke when the consumer closes still commits what
            // was settled before now.
            for ps in st.parts.values() {
                ps.slot.retire();
            }
        }
        let poller = self.poller.take();
        let consumer = self.consumer.take();
        if poller.is_some() || consumer.is_some() {
            // Closing a consumer blocks (it leaves the group): never on an async worker.
            let _ = std::thread::Builder::new()
                .name("idemq-kafka-close".into())
                .spawn(move || {
                    if let Some(p) = poller {
                        let _ = p.join();
                    }
                    drop(consumer);
                });
        }
    }
}

/// The settlement handle of one Kafka delivery: its assignment and offset, and its envelope
/// once the engine hands it back for a nack or a dead letter (no copy is kept meanwhile).
struct KafkaSettle {
    slot: Arc<PartSlot>,
    /// The record's offset, until the delivery is settled.
    offset: Option<i64>,
    envelope: Option<Envelope>,
}

#[async_trait]
impl LocallyHeld for KafkaSettle {
    fn settled(&mut self) {
        if let Some(offset) = self.offset.take() {
            if self.slot.is_current() {
                lock(&self.slot.settled).push(offset);
            }
        }
    }

    fn hold(&mut self, delay: Duration) {
        let Some(offset) = self.offset.take() else {
            return;
        };
        let part = &self.slot.id;
        let Some(mut envelope) = self.envelope.take() else {
            // Only a caller that nacks through `Settle` directly, bypassing `Delivery`, gets
            // here: the offset stays outstanding (nothing past it is committed), and the
            // record comes back from the committed offset after a restart or rebalance.
            tracing::warn!(topic = %part.0, partition = part.1, offset, "nack without the envelope; the record stays uncommitted");
            return;
        };
        let Some(shared) = self.slot.shared.upgrade() else {
            return;
        };
        let mut st = shared.sync.lock();
        // Checked under the state lock, where an assignment ends.
        if self.slot.is_current() {
            envelope.delivery_count = Some(envelope.delivery_count.unwrap_or(1) + 1);
            envelope.redelivered = true;
            let r = Record {
                slot: self.slot.clone(),
                offset,
                envelope,
                held_until: Instant::now() + delay,
            };
            hold_in_offset_order(&mut st.delayed, r);
            drop(st);
            shared.sync.wake_one();
        }
    }

    fn take_back(&mut self, envelope: Envelope) {
        self.envelope = Some(envelope);
    }

    async fn dead_letter(&mut self, reason: &str) -> Result<(), SourceError> {
        // Stale: another consumer owns the partition now and will see the record.
        let (true, Some(env)) = (!self.is_stale(), &self.envelope) else {
            return Ok(());
        };
        let dlq = &self.slot.dlq;
        let topic = dlq.cfg.dead_letter_topic_for(&env.source.name);
        let mut headers = Headers::new();
        for (n, v) in env.headers.iter() {
            if !n.starts_with(props::PREFIX) {
                headers.insert(n, v.clone());
            }
        }
        headers.insert(DLQ_REASON, reason.to_string());
        headers.insert(DLQ_TOPIC, env.source.name.clone());
        let partition = env.source.partition.unwrap_or(-1);
        headers.insert(DLQ_PARTITION, partition.to_string());
        if let Some(idemq_core::envelope::Position::Offset(o)) = env.source.position {
            headers.insert(DLQ_OFFSET, o.to_string());
        }
        produce(
            &dlq.producer,
            &topic,
            env.key.as_deref(),
            None,
            &headers,
            &env.payload,
            dlq.cfg.dead_letter_timeout,
        )
        .await
        .map_err(|e| SourceError::Broker(format!("dead-letter produce to {topic} failed: {e}")))?;
        metrics::counter!(crate::metrics::DEAD_LETTERS, "topic" => topic).increment(1);
        Ok(())
    }

    fn is_stale(&self) -> bool {
        self.offset.is_none() || !self.slot.is_current()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use idemq_core::envelope::Position;

    /// A slot of a source that is not there (its state is gone): enough for buffers and
    /// settlements (librdkafka creates the dead-letter producer without connecting).
    fn slot(id: PartitionId, epoch: Epoch, shared: Weak<Shared>) -> Arc<PartSlot> {
        let cfg = KafkaSourceConfig::new("127.0.0.1:1", "slots", &["t"]);
        let dlq = Arc::new(DeadLetter {
            producer: KafkaPublisher::producer_for(&cfg.client).expect("producer"),
            cfg,
        });
        Arc::new(PartSlot {
            id,
            epoch,
            current: AtomicBool::new(true),
            settled: Mutex::new(Vec::new()),
            absorbing: Mutex::new(Vec::new()),
            shared,
            dlq,
        })
    }

    fn part(n: i32, records: std::ops::Range<i64>) -> (PartitionId, PartState) {
        let id: PartitionId = ("t".to_string(), n);
        let buffer = records
            .map(|offset| Buffered {
                offset,
                envelope: Envelope::new(crate::KAFKA, "t", ""),
                unreadable: false,
            })
            .collect();
        let state = PartState {
            slot: slot(id.clone(), Epoch(1), Weak::new()),
            buffer,
            paused: false,
        };
        (id, state)
    }

    fn taken(
        parts: &mut HashMap<PartitionId, PartState>,
        room: usize,
        held: impl Fn(&PartitionId) -> bool,
        accept: impl Fn(i32, i64) -> bool,
    ) -> Vec<(i32, i64)> {
        let mut out = Vec::new();
        drain_fairly(parts, room, held, |slot, b| {
            let kept = accept(slot.id.1, b.offset);
            if kept {
                out.push((slot.id.1, b.offset));
            }
            kept
        });
        out
    }

    fn per_partition(out: &[(i32, i64)], p: i32) -> Vec<i64> {
        out.iter()
            .filter(|(q, _)| *q == p)
            .map(|(_, o)| *o)
            .collect()
    }

    #[test]
    fn a_batch_takes_an_equal_share_of_every_partition_in_offset_order() {
        let mut parts: HashMap<_, _> = [part(0, 0..100), part(1, 0..100), part(2, 0..100)]
            .into_iter()
            .collect();
        let out = taken(&mut parts, 30, |_| false, |_, _| true);
        assert_eq!(out.len(), 30);
        for p in 0..3 {
            assert_eq!(
                per_partition(&out, p),
                (0..10).collect::<Vec<_>>(),
                "partition {p}"
            );
        }
        // The next batch goes on where each partition stopped.
        let out = taken(&mut parts, 3, |_| false, |_, _| true);
        for p in 0..3 {
            assert_eq!(per_partition(&out, p), vec![10], "partition {p}");
        }
    }

    #[test]
    fn a_short_partition_leaves_its_share_to_the_others() {
        let mut parts: HashMap<_, _> = [part(0, 0..2), part(1, 0..100)].into_iter().collect();
        let out = taken(&mut parts, 20, |_| false, |_, _| true);
        assert_eq!(per_partition(&out, 0), vec![0, 1]);
        assert_eq!(per_partition(&out, 1), (0..18).collect::<Vec<_>>());
    }

    #[test]
    fn held_partitions_are_skipped_and_dropped_records_do_not_count() {
        let mut parts: HashMap<_, _> = [part(0, 0..10), part(1, 0..10), part(2, 0..10)]
            .into_iter()
            .collect();
        let held = |p: &PartitionId| p.1 == 2;
        // Odd offsets of partition 0 belong to a stale assignment: dropped, not counted.
        let stale = |p: i32, offset: i64| !(p == 0 && offset % 2 == 1);
        let out = taken(&mut parts, 8, held, stale);
        assert_eq!(out.len(), 8);
        assert_eq!(per_partition(&out, 0), vec![0, 2, 4, 6]);
        assert_eq!(per_partition(&out, 1), vec![0, 1, 2, 3]);
        assert!(per_partition(&out, 2).is_empty());
        assert_eq!(parts[&("t".to_string(), 2)].buffer.len(), 10);
        // Nothing left to take: the loop ends short of the room.
        let out = taken(&mut parts, 100, held, |_, _| true);
        assert_eq!(out.len(), 3 + 6);
    }

    /// A source's state with partition 0 of `t` assigned and offsets 0..10 handed out.
    fn assigned_state() -> (Arc<Shared>, Arc<PartSlot>, Vec<Delivery>) {
        let shared = Arc::new(Shared {
            sync: SharedState::new(State::default()),
            stop: AtomicBool::new(false),
            commit_wanted: AtomicBool::new(false),
            assigned: AtomicBool::new(true),
        });
        let id: PartitionId = ("t".to_string(), 0);
        let mut st = shared.sync.lock();
        let epoch = st.tracker.assign(id.clone(), 0);
        let slot = slot(id.clone(), epoch, Arc::downgrade(&shared));
        let buffer = (0..10)
            .map(|offset| {
                assert!(st.tracker.delivered(&id, epoch, offset));
                let mut envelope = Envelope::new(crate::KAFKA, "t", "");
                envelope.source.position = Some(Position::Offset(offset));
                Buffered {
                    offset,
                    envelope,
                    unreadable: false,
                }
            })
            .collect();
        st.parts.insert(
            id,
            PartState {
                slot: slot.clone(),
                buffer,
                paused: false,
            },
        );
        let mut out = Vec::new();
        drain_fairly(
            &mut st.parts,
            10,
            |_| false,
            |slot, b| {
                out.push(delivery(slot.clone(), b.offset, b.envelope));
                true
            },
        );
        drop(st);
        (shared, slot, out)
    }

    #[tokio::test]
    async fn acks_reach_the_tracker_through_the_slot_up_to_the_first_unsettled_offset() {
        let (shared, _slot, deliveries) = assigned_state();
        let mut running = Vec::new();
        for d in deliveries {
            assert!(!d.is_stale(), "a fresh delivery is stale");
            // Offset 4 is still running: nothing past it may be committed.
            if d.envelope.source.position == Some(Position::Offset(4)) {
                running.push(d);
            } else {
                d.ack().await.expect("ack");
            }
        }
        {
            let mut st = shared.sync.lock();
            assert_eq!(st.tracker.take_commits(), vec![], "not absorbed yet");
            absorb_settled(&mut st);
            assert_eq!(st.tracker.take_commits(), vec![(("t".to_string(), 0), 4)]);
        }
        for d in running {
            d.ack().await.expect("ack");
        }
        let mut st = shared.sync.lock();
        absorb_settled(&mut st);
        assert_eq!(st.tracker.take_commits(), vec![(("t".to_string(), 0), 10)]);
    }

    #[tokio::test]
    async fn a_revoked_assignment_is_stale_and_its_late_acks_are_dropped() {
        let (shared, slot, mut deliveries) = assigned_state();
        let late = deliveries.remove(0);
        for d in deliveries {
            d.ack().await.expect("ack");
        }
        {
            let mut st = shared.sync.lock();
            absorb_settled(&mut st);
            if let Some(ps) = st.parts.remove(&slot.id) {
                ps.slot.retire();
            }
        }
        assert!(
            late.is_stale(),
            "a delivery of a revoked partition is stale"
        );
        late.ack().await.expect("a late ack is harmless");
        assert!(
            lock(&slot.settled).is_empty(),
            "a retired slot keeps no settlement"
        );
        // A nack of a stale delivery holds nothing either.
        assert!(shared.sync.lock().delayed.next_due().is_none());
    }
}

#[cfg(test)]
mod poll_safety_tests {
    //! The polling thread's panic guard and the dead-lettering of records that cannot become
    //! envelopes, without a broker (librdkafka creates clients without connecting).
    use super::*;
    use idemq_core::adapter::SettleRecorder;
    use idemq_core::Settlement;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_panic_on_the_polling_thread_makes_poll_fail() {
        let cfg = KafkaSourceConfig::new("127.0.0.1:1", "poll-safety", &["t"]);
        let mut source = KafkaSource::connect(cfg)
            .await
            .expect("a source starts without a broker");
        // A second thread under the same guard as the polling thread, panicking where the
        // real one did: converting a record.
        let injected = spawn_poller(source.shared.clone(), || {
            panic!("injected: a header name that is not UTF-8")
        })
        .expect("thread");
        let polled = tokio::time::timeout(Duration::from_secs(30), source.poll(10)).await;
        match polled {
            Err(_) => panic!("poll still waits 30 s after the polling thread panicked"),
            Ok(Ok(got)) => panic!("poll returned {got:?} instead of the panic"),
            Ok(Err(e)) => assert!(
                e.to_string()
                    .contains("the polling thread panicked: injected: a header name"),
                "{e}"
            ),
        }
        assert!(
            source.poll(10).await.is_err(),
            "the source stays failed: nothing polls the consumer any more"
        );
        tokio::task::spawn_blocking(move || injected.join())
            .await
            .expect("join")
            .expect("the guard caught the panic");
        source.close().await.expect("close");
    }

    #[tokio::test]
    async fn a_record_that_cannot_become_an_envelope_is_dead_lettered_with_the_reason() {
        let mut outcomes = Vec::new();
        let mut batch = Vec::new();
        for i in 0..6 {
            let (settle, outcome) = SettleRecorder::new();
            let mut env = Envelope::new(crate::KAFKA, "t", format!("r{i}"));
            if i % 3 == 1 {
                env.headers
                    .insert(UNREADABLE_HEADERS, format!("broken {i}"));
            }
            batch.push(Delivery::new(env, Box::new(settle)));
            outcomes.push(outcome);
        }
        let kept = dead_letter_unreadable(batch);
        let payloads: Vec<&[u8]> = kept.iter().map(|d| &d.envelope.payload[..]).collect();
        assert_eq!(
            payloads,
            [&b"r0"[..], b"r2", b"r3", b"r5"],
            "the others go on"
        );
        for d in kept {
            d.ack().await.expect("ack");
        }
        for (i, outcome) in outcomes.into_iter().enumerate() {
            let settled = tokio::time::timeout(Duration::from_secs(30), outcome)
                .await
                .expect("settled within 30 s")
                .expect("settled, not dropped");
            let want = if i % 3 == 1 {
                Settlement::Reject(format!("the record cannot become an envelope: broken {i}"))
            } else {
                Settlement::Ack
            };
            assert_eq!(settled, want, "record {i}");
        }
    }
}
