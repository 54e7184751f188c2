//! Consumed offsets kept in the database, next to the effects they account for.
//!
//! [`SourceOffsets`] is a table `(consumer_group, topic, partition_id) → next_offset`. A
//! handler writes the offset after its record in the **same transaction** as its effect and
//! its dedup record ([`SourceOffsets::advance_in_tx`]); a consumer that takes a partition
//! over starts from [`SourceOffsets::load`] instead of the broker's committed offset. Effect,
//! dedup record and position then commit together or not at all: a crash anywhere loses
//! nothing and repeats nothing, with no broker transaction.
//!
//! [`SourceOffsets::for_group`] is one group's view, a [`GroupOffsets`]: the
//! [`OffsetStore`] a source asks on every assignment where to start each partition
//! (`KafkaSourceConfig::offsets_from` in idemq-kafka).
//!
//! The write is *greatest wins*: an older transaction committing late (a zombie consumer
//! after a rebalance) never moves a partition's offset back. Migrations live in
//! `migrations/<backend>/offsets/`, tracked in
//! [`SCHEMA_VERSION_TABLE`](crate::migrate::SCHEMA_VERSION_TABLE) under the table's name.

use crate::backend::{map_sqlx_error, Dialect, Kind, SqlBackend, Val};
use crate::ident::TableName;
use crate::migrate::{self, Migration};
use idemq_core::adapter::{OffsetStore, OffsetStoreError, PartitionId};
use idemq_core::{now_ms, StoreError};
use sqlx::Pool;
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// The default offsets table.
pub const DEFAULT_OFFSETS_TABLE: &str = "idemq_source_offsets";

/// Longest consumer group or topic name the table holds (bytes).
pub const MAX_OFFSETS_NAME_BYTES: usize = 255;

const SQLITE: &[Migration] = &[Migration {
    version: 1,
    name: "offsets/0001_source_offsets.sql",
    sql: include_str!("../migrations/sqlite/offsets/0001_source_offsets.sql"),
}];

const POSTGRES: &[Migration] = &[Migration {
    version: 1,
    name: "offsets/0001_source_offsets.sql",
    sql: include_str!("../migrations/postgres/offsets/0001_source_offsets.sql"),
}];

const MYSQL: &[Migration] = &[Migration {
    version: 1,
    name: "offsets/0001_source_offsets.sql",
    sql: include_str!("../migrations/mysql/offsets/0001_source_offsets.sql"),
}];

/// The offsets-table migrations of a dialect, in order (`migrations/<backend>/offsets/`).
pub fn offsets_migrations(dialect: Dialect) -> &'static [Migration] {
    match dialect {
        Dialect::Sqlite => SQLITE,
        Dialect::Postgres => POSTGRES,
        Dialect::MySql => MYSQL,
    }
}

#[derive(Debug)]
struct OffsetsSql {
    load: String,
    load_group: String,
    upsert: String,
}

impl OffsetsSql {
    fn new(d: Dialect, t: &TableName) -> Self {
        let upsert = match d {
            Dialect::Postgres => format!(
                "INSERT INTO {t} (consumer_group, topic, partition_id, next_offset, updated_ms) \
                 VALUES (?, ?, ?, ?, ?) ON CONFLICT (consumer_group, topic, partition_id) DO \
                 UPDATE SET next_offset = GREATEST({t}.next_offset, EXCLUDED.next_offset), \
                 updated_ms = EXCLUDED.updated_ms"
            ),
            Dialect::Sqlite => format!(
                "INSERT INTO {t} (consumer_group, topic, partition_id, next_offset, updated_ms) \
                 VALUES (?, ?, ?, ?, ?) ON CONFLICT (consumer_group, topic, partition_id) DO \
                 UPDATE SET next_offset = MAX({t}.next_offset, excluded.next_offset), \
                 updated_ms = excluded.updated_ms"
            ),
            // `VALUES(col)` is what both MariaDB and MySQL 8 accept.
            Dialect::MySql => format!(
                "INSERT INTO {t} (consumer_group, topic, partition_id, next_offset, updated_ms) \
                 VALUES (?, ?, ?, ?, ?) ON DUPLICATE KEY UPDATE \
                 next_offset = GREATEST(next_offset, VALUES(next_offset)), \
                 updated_ms = VALUES(updated_ms)"
            ),
        };
        Self {
            load: d.placeholders(format!(
                "SELECT next_offset FROM {t} WHERE consumer_group = ? AND topic = ? \
                 AND partition_id = ?"
            )),
            load_group: d.placeholders(format!(
                "SELECT topic, partition_id, next_offset FROM {t} WHERE consumer_group = ? \
                 ORDER BY topic, partition_id"
            )),
            upsert: d.placeholders(upsert),
        }
    }
}

/// One stored position: the next offset to consume in a topic partition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredOffset {
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// The next offset to consume (one past the last record whose effect committed).
    pub next_offset: i64,
}

/// Consumed offsets in a database table, written in the business transaction
/// ([`LogToDatabase`](crate::LogToDatabase) keeps its offsets here; docs/adapters.md).
///
/// ```no_run
/// # async fn demo(pool: idemq_sql::sqlx::PgPool) -> Result<(), idemq_core::StoreError> {
/// use idemq_sql::SourceOffsets;
///
/// let offsets = SourceOffsets::from_pool(pool.clone(), None).await?;
/// let mut tx = pool.begin().await.map_err(|e| idemq_core::StoreError::Unavailable(e.to_string()))?;
/// // ... the effect through `&mut *tx`, then, in the same transaction:
/// offsets.advance_in_tx(&mut tx, "billing", "payments", 3, 1_042).await?;
/// tx.commit().await.map_err(|e| idemq_core::StoreError::Unavailable(e.to_string()))?;
/// assert_eq!(offsets.load("billing", "payments", 3).await?, Some(1_042));
/// # Ok(()) }
/// ```
pub struct SourceOffsets<DB: SqlBackend> {
    pool: Pool<DB>,
    table: TableName,
    sql: Arc<OffsetsSql>,
}

impl<DB: SqlBackend> Clone for SourceOffsets<DB> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            table: self.table.clone(),
            sql: self.sql.clone(),
        }
    }
}

impl<DB: SqlBackend> fmt::Debug for SourceOffsets<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SourceOffsets")
            .field("backend", &DB::DIALECT.name())
            .field("table", &self.table.as_str())
            .finish_non_exhaustive()
    }
}

fn check_name(what: &str, v: &str) -> Result<(), StoreError> {
    if v.is_empty() || v.len() > MAX_OFFSETS_NAME_BYTES {
        return Err(StoreError::Config(format!(
            "{what} `{v}` must be 1..={MAX_OFFSETS_NAME_BYTES} bytes for the offsets table"
        )));
    }
    Ok(())
}

impl<DB: SqlBackend> SourceOffsets<DB> {
    /// Opens the offsets table on `pool` (`None` = [`DEFAULT_OFFSETS_TABLE`]), creating or
    /// upgrading it.
    pub async fn from_pool(pool: Pool<DB>, table: Option<TableName>) -> Result<Self, StoreError> {
        let table = match table {
            Some(t) => t,
            None => TableName::new(DEFAULT_OFFSETS_TABLE)?,
        };
        let offsets = Self {
            sql: Arc::new(OffsetsSql::new(DB::DIALECT, &table)),
            pool,
            table,
        };
        offsets.migrate().await?;
        Ok(offsets)
    }

    /// Creates or upgrades the table; returns the schema version now applied. Safe to run
    /// concurrently from many processes.
    pub async fn migrate(&self) -> Result<i64, StoreError> {
        migrate::run_set::<DB>(
            &self.pool,
            offsets_migrations(DB::DIALECT),
            &self.table,
            &self.table,
        )
        .await
    }

    /// The pool.
    pub fn pool(&self) -> &Pool<DB> {
        &self.pool
    }

    /// The table.
    pub fn table(&self) -> &TableName {
        &self.table
    }

    /// Records, in the caller's transaction, that `group` consumes `topic`/`partition` from
    /// `next_offset` on. Greatest wins: a smaller value than the stored one changes nothing.
    pub async fn advance_in_tx(
        &self,
        conn: &mut DB::Connection,
        group: &str,
        topic: &str,
        partition: i32,
        next_offset: i64,
    ) -> Result<(), StoreError> {
        check_name("consumer group", group)?;
        check_name("topic", topic)?;
        DB::execute(
            conn,
            &self.sql.upsert,
            vec![
                Val::Key(group.to_owned()),
                Val::Key(topic.to_owned()),
                Val::I64(Some(i64::from(partition))),
                Val::I64(Some(next_offset)),
                Val::I64(Some(now_ms())),
            ],
        )
        .await
        .map_err(|e| map_sqlx_error::<DB>("advance source offset", e))?;
        Ok(())
    }

    /// The next offset `group` consumes in `topic`/`partition`, if one was stored.
    pub async fn load(
        &self,
        group: &str,
        topic: &str,
        partition: i32,
    ) -> Result<Option<i64>, StoreError> {
        let err = |e| map_sqlx_error::<DB>("load source offset", e);
        let mut conn = self.pool.acquire().await.map_err(err)?;
        let rows = DB::fetch(
            &mut conn,
            &self.sql.load,
            vec![
                Val::Key(group.to_owned()),
                Val::Key(topic.to_owned()),
                Val::I64(Some(i64::from(partition))),
            ],
            &[Kind::I64],
        )
        .await
        .map_err(err)?;
        match rows.first() {
            Some(r) => Ok(Some(r.i64(0).map_err(|reason| self.corrupt(reason))?)),
            None => Ok(None),
        }
    }

    /// `group`'s offsets as the [`OffsetStore`] a source reads on every assignment. Needs a
    /// Tokio runtime: the query runs on the one current here, and the source's thread waits
    /// for it (at most 30 s).
    pub fn for_group(&self, group: &str) -> Result<GroupOffsets<DB>, StoreError> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|e| {
            StoreError::Config(format!(
                "SourceOffsets::for_group needs a Tokio runtime: {e}"
            ))
        })?;
        Ok(GroupOffsets {
            offsets: self.clone(),
            group: Arc::from(group),
            runtime,
            timeout: Duration::from_secs(30),
        })
    }

    /// Every position stored for `group`, ordered by topic and partition.
    pub async fn load_group(&self, group: &str) -> Result<Vec<StoredOffset>, StoreError> {
        let err = |e| map_sqlx_error::<DB>("load source offsets", e);
        let mut conn = self.pool.acquire().await.map_err(err)?;
        let rows = DB::fetch(
            &mut conn,
            &self.sql.load_group,
            vec![Val::Key(group.to_owned())],
            &[Kind::Text, Kind::I64, Kind::I64],
        )
        .await
        .map_err(err)?;
        rows.iter()
            .map(|r| {
                let partition = r.i64(1).map_err(|reason| self.corrupt(reason))?;
                Ok(StoredOffset {
                    topic: r.text(0).map_err(|reason| self.corrupt(reason))?.to_owned(),
                    partition: i32::try_from(partition)
                        .map_err(|_| self.corrupt(format!("partition {partition} out of range")))?,
                    next_offset: r.i64(2).map_err(|reason| self.corrupt(reason))?,
                })
            })
            .collect()
    }

    fn corrupt(&self, reason: String) -> StoreError {
        StoreError::Corrupt {
            key: self.table.as_str().to_owned(),
            reason,
        }
    }
}

/// One group's stored offsets as an [`OffsetStore`] (from [`SourceOffsets::for_group`]): one
/// query for the group's positions, run on the Tokio runtime it was created on, while the
/// calling thread (a client's rebalance callback) waits for the answer.
///
/// ```no_run
/// # async fn demo(pool: idemq_sql::sqlx::PgPool) -> Result<(), idemq_core::StoreError> {
/// use idemq_core::adapter::OffsetStore;
/// use idemq_sql::SourceOffsets;
///
/// let offsets = SourceOffsets::from_pool(pool, None).await?;
/// let billing = offsets.for_group("billing")?;
/// // What a source asks on an assignment (from its client's thread, not the runtime's):
/// let start = tokio::task::spawn_blocking(move || {
///     billing.positions(&[("payments".to_string(), 3)])
/// })
/// .await;
/// # Ok(()) }
/// ```
pub struct GroupOffsets<DB: SqlBackend> {
    offsets: SourceOffsets<DB>,
    group: Arc<str>,
    runtime: tokio::runtime::Handle,
    timeout: Duration,
}

impl<DB: SqlBackend> GroupOffsets<DB> {
    /// The group whose offsets these are.
    pub fn group(&self) -> &str {
        &self.group
    }
}

impl<DB: SqlBackend> fmt::Debug for GroupOffsets<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GroupOffsets")
            .field("group", &self.group)
            .field("offsets", &self.offsets)
            .finish_non_exhaustive()
    }
}

impl<DB: SqlBackend> OffsetStore for GroupOffsets<DB> {
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
        let wanted: HashSet<&PartitionId> = partitions.iter().collect();
        Ok(stored
            .into_iter()
            .map(|s| ((s.topic, s.partition), s.next_offset))
            .filter(|(p, _)| wanted.contains(p))
            .collect())
    }
}
