//! Flow 3, Kafka → database exactly once: the effect, the dedup record and the consumed
//! offset commit in one database transaction, and assigned partitions start at the offsets
//! stored there. No Kafka transaction.

use crate::db_offsets::{OffsetStore, OffsetStoreError};
use crate::KafkaSourceConfig;
use bytes::Bytes;
use idemq_core::adapter::PartitionId;
use idemq_core::engine::{ConsumerConfig, DeliveryOrder};
use idemq_core::envelope::Position;
use idemq_core::{
    ClaimedMessage, CompleteOutcome, DedupKey, FencingToken, HandlerError, HandlerResult,
    IdempotentConsumer, StoreError,
};
use idemq_sql::{
    handler_error, map_sqlx_error, LeaseLost, PooledTx, SourceOffsets, SqlBackend, SqlStore,
};
use std::collections::HashMap;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::time::Duration;

/// A claimed message that carries no Kafka position (topic, partition, offset): it did not
/// come from a [`KafkaSource`](crate::KafkaSource), so its offset cannot be recorded.
#[derive(Debug, Clone, thiserror::Error)]
#[error("message `{key}` has no Kafka partition and offset: Flow 3 needs records of a KafkaSource")]
pub struct NoKafkaPosition {
    /// The message's dedup key.
    pub key: DedupKey,
}

/// Flow 3: runs each handler's effect, its dedup record and its partition's next offset in
/// one transaction on a [`SqlStore`]'s database, and gives the
/// [`KafkaSource`](crate::KafkaSource) those offsets to start from on every assignment.
///
/// Build the engine with [`KafkaToDatabase::consumer`], which refuses any ordering but
/// [`DeliveryOrder::PerPartition`]: the records of a partition must commit in offset order (the stored offset is "everything before
/// it is done"); the offset write is greatest-wins, so a late commit of a consumer that lost
/// the partition never moves it back. Records settled without the handler's transaction (a
/// business duplicate at a new offset, a dead-lettered record) do not move the stored
/// offset until a later record of the partition does: after a crash they are read again and
/// absorbed again by the dedup store.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use idemq_core::engine::{ConsumerConfig, DeliveryOrder};
/// use idemq_core::ClaimedMessage;
/// use idemq_kafka::{KafkaSource, KafkaSourceConfig, KafkaToDatabase};
/// use idemq_sql::{sqlx, PgStore, SqlResultExt, SqlStoreOptions};
///
/// let store = PgStore::connect("postgres://localhost/app", SqlStoreOptions::default()).await?;
/// let flow = KafkaToDatabase::new(store.clone(), "billing").await?;
/// let mut source = KafkaSource::new(
///     flow.source_config(KafkaSourceConfig::new("127.0.0.1:9092", "billing", &["payments"]))?,
/// )?;
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
pub struct KafkaToDatabase<DB: SqlBackend> {
    store: SqlStore<DB>,
    offsets: SourceOffsets<DB>,
    group: Arc<str>,
}

impl<DB: SqlBackend> Clone for KafkaToDatabase<DB> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            offsets: self.offsets.clone(),
            group: self.group.clone(),
        }
    }
}

impl<DB: SqlBackend> std::fmt::Debug for KafkaToDatabase<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaToDatabase")
            .field("group", &self.group)
            .field("offsets", &self.offsets)
            .finish_non_exhaustive()
    }
}

impl<DB: SqlBackend> KafkaToDatabase<DB> {
    /// Flow 3 for `group` on `store`'s database, with the offsets in
    /// [`DEFAULT_OFFSETS_TABLE`](idemq_sql::DEFAULT_OFFSETS_TABLE) (created if missing).
    ///
    /// `group` names whose offsets these are; it is usually the Kafka `group.id`, but the
    /// stored offsets, not the Kafka group, decide where consumption resumes.
    pub async fn new(store: SqlStore<DB>, group: &str) -> Result<Self, StoreError> {
        let offsets = SourceOffsets::from_pool(store.pool().clone(), None).await?;
        Ok(Self::with_offsets(store, offsets, group))
    }

    /// Flow 3 with an offsets table of your choosing (on the same database as `store`).
    pub fn with_offsets(store: SqlStore<DB>, offsets: SourceOffsets<DB>, group: &str) -> Self {
        Self {
            store,
            offsets,
            group: Arc::from(group),
        }
    }

    /// The dedup key strategy Flow 3 is tested with: the record's `idemq-dedup-key` header
    /// (or Kafka key) under consumer group `group`.
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

    /// The [`OffsetStore`] a [`KafkaSource`](crate::KafkaSource) reads on assignment. Needs
    /// a Tokio runtime (the queries run on it; the source's polling thread waits for them).
    pub fn offset_store(&self) -> Result<DbOffsetStore<DB>, StoreError> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|e| {
            StoreError::Config(format!(
                "KafkaToDatabase::offset_store needs a Tokio runtime: {e}"
            ))
        })?;
        Ok(DbOffsetStore {
            offsets: self.offsets.clone(),
            group: self.group.clone(),
            runtime,
            timeout: Duration::from_secs(30),
        })
    }

    /// The engine for Flow 3: `handler` (which writes its effect through
    /// [`KafkaToDatabase::begin`] and [`KafkaTx::commit`]) over this flow's store, with
    /// [`KafkaToDatabase::key_strategy`] keys under this flow's group.
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
        check_ordering(&cfg)?;
        let keys = Self::key_strategy(&self.group)
            .map_err(|e| StoreError::Config(format!("Flow 3 group {:?}: {e}", self.group)))?;
        Ok(IdempotentConsumer::new(Arc::new(self.store.clone()), keys, handler).with_config(cfg))
    }

    /// `cfg` starting every assigned partition at the offset stored here.
    pub fn source_config(&self, cfg: KafkaSourceConfig) -> Result<KafkaSourceConfig, StoreError> {
        Ok(cfg.offsets_from(self.offset_store()?))
    }

    /// Opens the transaction of `msg`: write the effect through it (`&mut *tx`), then
    /// [`KafkaTx::commit`].
    ///
    /// Errors: [`NoKafkaPosition`] (permanent) when `msg` has no topic partition and offset;
    /// a database that cannot begin a transaction (retryable when it is unavailable).
    pub async fn begin(&self, msg: &ClaimedMessage) -> Result<KafkaTx<DB>, HandlerError> {
        let src = &msg.envelope.source;
        let (Some(partition), Some(Position::Offset(offset))) = (src.partition, src.position)
        else {
            return Err(HandlerError::Permanent(
                NoKafkaPosition {
                    key: msg.key.clone(),
                }
                .into(),
            ));
        };
        let tx = PooledTx::begin(self.store.pool())
            .await
            .map_err(|e| map_sqlx_error::<DB>("begin", e))?;
        Ok(KafkaTx {
            tx,
            flow: self.clone(),
            key: msg.key.clone(),
            token: msg.token,
            retention: msg.retention,
            topic: src.name.clone(),
            partition,
            offset,
        })
    }
}

/// Flow 3's one requirement on the engine's settings (see [`KafkaToDatabase::consumer`]).
pub fn check_ordering(cfg: &ConsumerConfig) -> Result<(), StoreError> {
    match cfg.ordering {
        DeliveryOrder::PerPartition => Ok(()),
        other => Err(StoreError::Config(format!(
            "Flow 3 (Kafka -> database) needs ConsumerConfig::ordering = \
             DeliveryOrder::PerPartition, got {other:?}: the offset stored with each effect means \
             \"everything before it is done\", so a partition's records must commit in offset \
             order (otherwise a crash can skip a record a later one overtook); set \
             `ordering: DeliveryOrder::PerPartition`"
        ))),
    }
}

/// The transaction of one Kafka record in Flow 3 (see [`KafkaToDatabase`]): it dereferences
/// to the connection for the effect's statements; [`KafkaTx::commit`] adds the dedup record
/// and the partition's next offset and commits. Dropping it rolls back.
///
/// ```no_run
/// # async fn demo(flow: idemq_kafka::KafkaToDatabase<idemq_sql::sqlx::Postgres>, msg: idemq_core::ClaimedMessage) -> idemq_core::HandlerResult {
/// use idemq_sql::{sqlx, SqlResultExt};
/// let mut tx = flow.begin(&msg).await?;
/// sqlx::query("UPDATE accounts SET balance = balance + 1 WHERE id = 7")
///     .execute(&mut *tx)
///     .await
///     .classify()?;
/// tx.commit().await
/// # }
/// ```
pub struct KafkaTx<DB: SqlBackend> {
    /// Closed when dropped open (never back to the pool mid-transaction; see [`PooledTx`]).
    tx: PooledTx<DB>,
    flow: KafkaToDatabase<DB>,
    key: DedupKey,
    token: FencingToken,
    retention: Duration,
    topic: String,
    partition: i32,
    offset: i64,
}

impl<DB: SqlBackend> std::fmt::Debug for KafkaTx<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaTx")
            .field("key", &self.key)
            .field("topic", &self.topic)
            .field("partition", &self.partition)
            .field("offset", &self.offset)
            .finish_non_exhaustive()
    }
}

impl<DB: SqlBackend> Deref for KafkaTx<DB> {
    type Target = DB::Connection;
    fn deref(&self) -> &DB::Connection {
        &self.tx
    }
}

impl<DB: SqlBackend> DerefMut for KafkaTx<DB> {
    fn deref_mut(&mut self) -> &mut DB::Connection {
        &mut self.tx
    }
}

impl<DB: SqlBackend> KafkaTx<DB> {
    /// The record's topic, partition and offset.
    pub fn position(&self) -> (&str, i32, i64) {
        (&self.topic, self.partition, self.offset)
    }

    /// Completes the record with no stored result and commits (see
    /// [`KafkaTx::commit_with`]).
    pub async fn commit(self) -> HandlerResult {
        self.commit_with(None).await
    }

    /// Completes the dedup record (storing `result` for duplicates), records `offset + 1` as
    /// the partition's next offset (greatest wins) and commits, all in this transaction.
    ///
    /// Errors: [`LeaseLost`] as [`HandlerError::Retryable`] after a rollback when this
    /// worker's lease was lost; database errors classified by [`handler_error`] /
    /// the store (unavailable, deadlock and serialization failures are retryable).
    pub async fn commit_with(mut self, result: Option<Bytes>) -> HandlerResult {
        let outcome = self
            .flow
            .store
            .complete_in_tx(
                &mut *self.tx,
                &self.key,
                self.token,
                result.as_deref(),
                self.retention,
            )
            .await?;
        if matches!(outcome, CompleteOutcome::Fenced) {
            if let Err(e) = self.tx.rollback().await {
                tracing::debug!(key = %self.key, error = %e, "rollback after a lost lease failed (the server rolls back on disconnect)");
            }
            return Err(HandlerError::Retryable(LeaseLost { key: self.key }.into()));
        }
        self.flow
            .offsets
            .advance_in_tx(
                &mut *self.tx,
                &self.flow.group,
                &self.topic,
                self.partition,
                self.offset + 1,
            )
            .await?;
        self.tx.commit().await.map_err(handler_error)?;
        Ok(result)
    }

    /// Rolls back (dropping the transaction does too).
    pub async fn rollback(mut self) -> Result<(), StoreError> {
        self.tx
            .rollback()
            .await
            .map_err(|e| map_sqlx_error::<DB>("rollback", e))
    }
}

/// The [`OffsetStore`] of a [`KafkaToDatabase`]: one query for the group's stored offsets,
/// run on the Tokio runtime it was created on.
///
/// ```no_run
/// # async fn demo(flow: idemq_kafka::KafkaToDatabase<idemq_sql::sqlx::Postgres>) -> Result<(), idemq_core::StoreError> {
/// let cfg = idemq_kafka::KafkaSourceConfig::new("127.0.0.1:9092", "billing", &["payments"])
///     .offsets_from(flow.offset_store()?);
/// # Ok(()) }
/// ```
pub struct DbOffsetStore<DB: SqlBackend> {
    offsets: SourceOffsets<DB>,
    group: Arc<str>,
    runtime: tokio::runtime::Handle,
    timeout: Duration,
}

impl<DB: SqlBackend> std::fmt::Debug for DbOffsetStore<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DbOffsetStore")
            .field("group", &self.group)
            .field("offsets", &self.offsets)
            .finish_non_exhaustive()
    }
}

impl<DB: SqlBackend> OffsetStore for DbOffsetStore<DB> {
    fn positions(
        &self,
        partitions: &[PartitionId],
    ) -> Result<HashMap<PartitionId, i64>, OffsetStoreError> {
        let (done, wait) = std::sync::mpsc::channel();
        let offsets = self.offsets.clone();
        let group = self.group.clone();
        // Spawned rather than `block_on`: the caller may be any thread, even a runtime's.
        self.runtime.spawn(async move {
            let _ = done.send(offsets.load_group(&group).await);
        });
        let stored = wait
            .recv_timeout(self.timeout)
            .map_err(|e| OffsetStoreError(format!("no answer from the offsets table: {e}")))?
            .map_err(|e| OffsetStoreError(e.to_string()))?;
        let wanted: std::collections::HashSet<&PartitionId> = partitions.iter().collect();
        Ok(stored
            .into_iter()
            .map(|s| ((s.topic, s.partition), s.next_offset))
            .filter(|(p, _)| wanted.contains(p))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flow3_refuses_any_ordering_but_per_partition() {
        for ordering in [DeliveryOrder::Unordered, DeliveryOrder::PerKey] {
            let err = check_ordering(&ConsumerConfig {
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
        check_ordering(&ConsumerConfig {
            ordering: DeliveryOrder::PerPartition,
            ..ConsumerConfig::default()
        })
        .expect("PerPartition is what Flow 3 needs");
    }
}
