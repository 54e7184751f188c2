//! A partitioned log into a database, exactly once with no broker transaction: each
//! message's effect, its dedup record and its partition's next offset commit in one database
//! transaction, and the source starts every assigned partition at the offset stored there.
//!
//! [`LogToDatabase`] is the flow: the store, the offsets table ([`SourceOffsets`]) and the
//! group the offsets are stored under; [`LogToDatabase::begin`] opens an [`OffsetTx`], a
//! [`MessageTx`] that also records the message's partition offset when it commits. Kafka's
//! "Flow 3" is this flow over a `KafkaSource` configured with
//! [`LogToDatabase::offset_store`] (`KafkaSourceConfig::offsets_from`); nothing in it is
//! Kafka's: any envelope with a partition and an offset ([`Position::Offset`], or a queue's
//! [`Position::QueueOffset`]) has its offset recorded.

use crate::backend::SqlBackend;
use crate::claimed::{deref_to_connection, MessageTx};
use crate::offsets::{GroupOffsets, SourceOffsets};
use crate::store::SqlStore;
use bytes::Bytes;
use idemq_core::engine::{ConsumerConfig, DeliveryOrder};
use idemq_core::envelope::{Position, SourceRef};
use idemq_core::{
    ClaimedMessage, DedupKey, HandlerError, HandlerResult, IdempotentConsumer, StoreError,
};
use std::sync::Arc;

/// A claimed message that carries no partition and offset: it did not come from a
/// partitioned log (a Kafka partition, a RocketMQ queue), so there is no offset to record.
/// Permanent: the same message never gains one.
#[derive(Debug, Clone, thiserror::Error)]
#[error(
    "message `{key}` has no partition and offset: LogToDatabase records a partitioned log's \
     offsets, so it needs messages of such a source (a KafkaSource, for instance)"
)]
pub struct NoLogPosition {
    /// The message's dedup key.
    pub key: DedupKey,
}

/// Consumes a partitioned log into this store's database exactly once: each handler's
/// effect, its dedup record and its partition's next offset commit in one transaction
/// ([`LogToDatabase::begin`], then [`OffsetTx::commit`]), and the source starts every
/// assigned partition at the offsets stored there ([`LogToDatabase::offset_store`]).
///
/// Named for what it moves, a **log** (partitions of offset-ordered records: a Kafka topic,
/// RocketMQ queues) into a **database**; Kafka's Flow 3 is this over a `KafkaSource`.
///
/// Build the engine with [`LogToDatabase::consumer`], which refuses any ordering but
/// [`DeliveryOrder::PerPartition`]: the records of a partition must commit in offset order
/// (the stored offset is "everything before it is done"); the offset write is greatest-wins,
/// so a late commit of a consumer that lost the partition never moves it back. Records
/// settled without the handler's transaction (a business duplicate at a new offset, a
/// dead-lettered record) do not move the stored offset until a later record of the
/// partition does: after a crash they are read again and absorbed again by the dedup store.
///
/// ```no_run
/// # async fn demo<S: idemq_core::Source>(
/// #     connect: impl FnOnce(idemq_sql::GroupOffsets<idemq_sql::sqlx::Postgres>) -> S,
/// # ) -> Result<(), Box<dyn std::error::Error>> {
/// use idemq_core::engine::{ConsumerConfig, DeliveryOrder};
/// use idemq_core::ClaimedMessage;
/// use idemq_sql::{sqlx, LogToDatabase, PgStore, SqlResultExt, SqlStoreOptions};
///
/// let store = PgStore::connect("postgres://localhost/app", SqlStoreOptions::default()).await?;
/// let flow = LogToDatabase::new(store.clone(), "billing").await?;
/// // A source that starts every assigned partition at these offsets; with Kafka:
/// // KafkaSource::connect(KafkaSourceConfig::new(..).offsets_from(flow.offset_store()?)).await?
/// let mut source = connect(flow.offset_store()?);
/// let handler_flow = flow.clone();
/// let consumer = flow.consumer(
///     move |msg: ClaimedMessage| {
///         let flow = handler_flow.clone();
///         async move {
///             let mut tx = flow.begin(&msg).await?;
///             sqlx::query("INSERT INTO payments_applied (id) VALUES ($1)")
///                 .bind(msg.key.as_str())
///                 .execute(&mut *tx)
///                 .await
///                 .classify()?;
///             tx.commit().await // dedup record + offset + effect, one commit
///         }
///     },
///     // Anything but PerPartition is refused with a Config error.
///     ConsumerConfig { ordering: DeliveryOrder::PerPartition, ..Default::default() },
/// )?;
/// consumer.run(&mut source, std::future::pending()).await?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct LogToDatabase<DB: SqlBackend> {
    store: SqlStore<DB>,
    offsets: SourceOffsets<DB>,
    group: Arc<str>,
}

impl<DB: SqlBackend> Clone for LogToDatabase<DB> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            offsets: self.offsets.clone(),
            group: self.group.clone(),
        }
    }
}

impl<DB: SqlBackend> LogToDatabase<DB> {
    /// The flow for `group` on `store`'s database, with the offsets in
    /// [`DEFAULT_OFFSETS_TABLE`](crate::DEFAULT_OFFSETS_TABLE) (created if missing).
    ///
    /// `group` names whose offsets these are; it is usually the broker's consumer group
    /// (Kafka's `group.id`), but the stored offsets, not the broker's group, decide where
    /// consumption resumes.
    pub async fn new(store: SqlStore<DB>, group: &str) -> Result<Self, StoreError> {
        let offsets = SourceOffsets::from_pool(store.pool().clone(), None).await?;
        Ok(Self::with_offsets(store, offsets, group))
    }

    /// The flow with an offsets table of your choosing (on the same database as `store`).
    pub fn with_offsets(store: SqlStore<DB>, offsets: SourceOffsets<DB>, group: &str) -> Self {
        Self {
            store,
            offsets,
            group: Arc::from(group),
        }
    }

    /// The dedup key strategy the flow is tested with: the message's `idemq-dedup-key`
    /// header (or the broker's own dedup slots) under consumer group `group`.
    pub fn key_strategy(group: &str) -> Result<idemq_core::KeyStrategy, idemq_core::KeyError> {
        idemq_core::KeyStrategy::dedup_header(group)
    }

    /// The offsets table.
    pub fn offsets(&self) -> &SourceOffsets<DB> {
        &self.offsets
    }

    /// The dedup store.
    pub fn store(&self) -> &SqlStore<DB> {
        &self.store
    }

    /// The group the offsets are stored under.
    pub fn group(&self) -> &str {
        &self.group
    }

    /// The [`OffsetStore`](idemq_core::adapter::OffsetStore) a source reads on every
    /// assignment (`KafkaSourceConfig::offsets_from`): this group's stored offsets
    /// ([`SourceOffsets::for_group`]). Needs a Tokio runtime (the queries run on it; the
    /// source's thread waits for them).
    pub fn offset_store(&self) -> Result<GroupOffsets<DB>, StoreError> {
        self.offsets.for_group(&self.group)
    }

    /// The engine for the flow: `handler` (which writes its effect through
    /// [`LogToDatabase::begin`] and [`OffsetTx::commit`]) over this flow's store, with
    /// [`LogToDatabase::key_strategy`] keys under this flow's group.
    ///
    /// Refuses (a [`StoreError::Config`] naming the setting and the fix) an engine whose
    /// `cfg.ordering` is not [`DeliveryOrder::PerPartition`]: the stored offset is
    /// "everything before it is done" and greatest wins, so a partition's records must commit
    /// in offset order. Run unordered (or per key), a later record commits its offset while an
    /// earlier one is still running or was sent back, and a crash then starts the partition
    /// past the earlier record: it is skipped for good.
    pub fn consumer<H: idemq_core::Handler>(
        &self,
        handler: H,
        cfg: ConsumerConfig,
    ) -> Result<IdempotentConsumer<H>, StoreError> {
        check_log_ordering(&cfg)?;
        let keys = Self::key_strategy(&self.group).map_err(|e| {
            StoreError::Config(format!("LogToDatabase group {:?}: {e}", self.group))
        })?;
        Ok(IdempotentConsumer::new(Arc::new(self.store.clone()), keys, handler).with_config(cfg))
    }

    /// Opens the transaction of `msg`: write the effect through it (`&mut *tx`), then
    /// [`OffsetTx::commit`].
    ///
    /// Errors: [`NoLogPosition`] (permanent) when `msg` has no partition and offset; a
    /// database that cannot begin a transaction (retryable when it is unavailable).
    pub async fn begin(&self, msg: &ClaimedMessage) -> Result<OffsetTx<DB>, HandlerError> {
        let Some((log, partition, offset)) = log_position(&msg.envelope.source) else {
            return Err(HandlerError::Permanent(
                NoLogPosition {
                    key: msg.key.clone(),
                }
                .into(),
            ));
        };
        let tx = self.store.begin_for(msg).await?;
        Ok(OffsetTx {
            tx,
            offsets: self.offsets.clone(),
            group: self.group.clone(),
            log,
            partition,
            offset,
        })
    }
}

/// Where `src` sits in a partitioned log: the name its offsets are stored under, the
/// partition and the offset. A topic's partitions are numbered once per topic (Kafka), so
/// the topic names them; a queue id is only unique per broker (RocketMQ), so a queue offset
/// is stored under `broker/topic` when the envelope names its broker, as
/// [`PartitionId`](idemq_core::adapter::PartitionId) spells it.
fn log_position(src: &SourceRef) -> Option<(String, i32, i64)> {
    match (src.partition, src.position) {
        (Some(partition), Some(Position::Offset(offset))) => {
            Some((src.name.clone(), partition, offset))
        }
        (Some(partition), Some(Position::QueueOffset(offset))) => {
            let log = match &src.cluster {
                Some(broker) => format!("{broker}/{}", src.name),
                None => src.name.clone(),
            };
            Some((log, partition, offset))
        }
        _ => None,
    }
}

/// The flow's one requirement on the engine's settings (see [`LogToDatabase::consumer`]):
/// [`DeliveryOrder::PerPartition`], or a [`StoreError::Config`] naming the setting and the
/// fix.
pub fn check_log_ordering(cfg: &ConsumerConfig) -> Result<(), StoreError> {
    match cfg.ordering {
        DeliveryOrder::PerPartition => Ok(()),
        other => Err(StoreError::Config(format!(
            "LogToDatabase (a log's offsets stored with the effects, Kafka's flow 3) needs \
             ConsumerConfig::ordering = DeliveryOrder::PerPartition, got {other:?}: the offset \
             stored with each effect means \"everything before it is done\", so a partition's \
             records must commit in offset order (otherwise a crash can skip a record a later \
             one overtook); set `ordering: DeliveryOrder::PerPartition`"
        ))),
    }
}

/// The transaction of one message of a [`LogToDatabase`]: a [`MessageTx`] that also records
/// the message's partition offset. It dereferences to the connection for the effect's
/// statements; [`OffsetTx::commit`] writes the partition's next offset and then completes
/// the dedup record and commits, as [`MessageTx::commit`] does. Dropping it rolls back.
///
/// Named for what it adds to a [`MessageTx`]: the offset.
///
/// ```no_run
/// # async fn demo(flow: idemq_sql::LogToDatabase<idemq_sql::sqlx::Postgres>, msg: idemq_core::ClaimedMessage) -> idemq_core::HandlerResult {
/// use idemq_sql::{sqlx, SqlResultExt};
/// let mut tx = flow.begin(&msg).await?;
/// sqlx::query("UPDATE accounts SET balance = balance + 1 WHERE id = 7")
///     .execute(&mut *tx)
///     .await
///     .classify()?;
/// tx.commit().await
/// # }
/// ```
pub struct OffsetTx<DB: SqlBackend> {
    tx: MessageTx<DB>,
    offsets: SourceOffsets<DB>,
    group: Arc<str>,
    /// The name the partition's offsets are stored under (see `log_position`).
    log: String,
    partition: i32,
    offset: i64,
}

impl<DB: SqlBackend> std::fmt::Debug for OffsetTx<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OffsetTx")
            .field("key", self.tx.key())
            .field("log", &self.log)
            .field("partition", &self.partition)
            .field("offset", &self.offset)
            .finish_non_exhaustive()
    }
}

deref_to_connection!(OffsetTx, tx);

impl<DB: SqlBackend> OffsetTx<DB> {
    /// Where the message sits: the name its offsets are stored under (the topic; for a
    /// queue offset with a broker, `broker/topic`), the partition and the offset.
    pub fn position(&self) -> (&str, i32, i64) {
        (&self.log, self.partition, self.offset)
    }

    /// The message's key.
    pub fn key(&self) -> &DedupKey {
        self.tx.key()
    }

    /// Completes the message with no stored result and commits (see
    /// [`OffsetTx::commit_with`]).
    pub async fn commit(self) -> HandlerResult {
        self.commit_with(None).await
    }

    /// Records `offset + 1` as the partition's next offset (greatest wins), completes the
    /// dedup record (storing `result` for duplicates) and commits, all in this transaction
    /// ([`MessageTx::commit_with`]).
    ///
    /// Errors: [`LeaseLost`](crate::LeaseLost) as [`HandlerError::Retryable`] after a
    /// rollback (of the effect and the offset too) when this worker's lease was lost;
    /// database errors classified by [`handler_error`](crate::handler_error) / the store
    /// (unavailable, deadlock and serialization failures are retryable).
    pub async fn commit_with(mut self, result: Option<Bytes>) -> HandlerResult {
        self.offsets
            .advance_in_tx(
                &mut *self.tx,
                &self.group,
                &self.log,
                self.partition,
                self.offset + 1,
            )
            .await?;
        self.tx.commit_with(result).await
    }

    /// Rolls back (dropping the transaction does too).
    pub async fn rollback(self) -> Result<(), StoreError> {
        self.tx.rollback().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flow_refuses_any_ordering_but_per_partition() {
        for ordering in [DeliveryOrder::Unordered, DeliveryOrder::PerKey] {
            let err = check_log_ordering(&ConsumerConfig {
                ordering,
                ..ConsumerConfig::default()
            })
            .unwrap_err();
            assert!(matches!(err, StoreError::Config(_)), "{err:?}");
            let msg = err.to_string();
            assert!(
                msg.contains("DeliveryOrder::PerPartition")
                    && msg.contains(&format!("{ordering:?}")),
                "{msg}"
            );
        }
        check_log_ordering(&ConsumerConfig {
            ordering: DeliveryOrder::PerPartition,
            ..ConsumerConfig::default()
        })
        .expect("PerPartition is what the flow needs");
    }

    fn source(cluster: Option<&str>, partition: Option<i32>, pos: Option<Position>) -> SourceRef {
        SourceRef {
            cluster: cluster.map(str::to_owned),
            name: "payments".into(),
            partition,
            position: pos,
        }
    }

    #[test]
    fn a_log_position_needs_a_partition_and_an_offset() {
        // A Kafka record: its topic, even with a cluster label.
        assert_eq!(
            log_position(&source(Some("eu-1"), Some(3), Some(Position::Offset(41)))),
            Some(("payments".to_string(), 3, 41))
        );
        // A RocketMQ queue: queue ids repeat on every broker.
        assert_eq!(
            log_position(&source(
                Some("broker-a"),
                Some(3),
                Some(Position::QueueOffset(7))
            )),
            Some(("broker-a/payments".to_string(), 3, 7))
        );
        assert_eq!(
            log_position(&source(None, Some(3), Some(Position::QueueOffset(7)))),
            Some(("payments".to_string(), 3, 7))
        );
        // A queue without partitions, a channel's delivery tag, a stream sequence: nothing
        // to record.
        for (partition, pos) in [
            (None, Some(Position::Offset(41))),
            (Some(3), None),
            (Some(3), Some(Position::DeliveryTag(9))),
            (Some(3), Some(Position::Sequence(9))),
        ] {
            assert_eq!(log_position(&source(None, partition, pos)), None);
        }
    }
}
