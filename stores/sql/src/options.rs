//! [`SqlStoreOptions`] (with the names of the tables derived from the dedup table's) and
//! [`SqliteSynchronous`].

use crate::ident::TableName;
use idemq_core::StoreError;
use std::time::Duration;

/// SQLite's `synchronous` setting for stores opened by
/// [`SqlStore::connect`](crate::SqlStore::connect).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SqliteSynchronous {
    /// Every commit is fsynced: a completed record survives power loss (the default).
    #[default]
    Full,
    /// In WAL mode, commits survive a crash of the process but the last ones may be lost
    /// on power loss; much faster on slow disks.
    Normal,
}

/// Options of a SQL store.
///
/// ```
/// use idemq_sql::{SqlStoreOptions, TableName};
/// let opts = SqlStoreOptions {
///     table: TableName::new("payments_dedup")?,
///     ..Default::default()
/// };
/// assert_eq!(opts.keys_table()?.as_str(), "payments_dedup_keys");
/// # Ok::<(), idemq_core::StoreError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SqlStoreOptions {
    /// The dedup table (default `idemq_dedup`).
    pub table: TableName,
    /// The unique-index table used by
    /// [`SqlStore::insert_key_in_tx`](crate::SqlStore::insert_key_in_tx) (default
    /// `<table>_keys`).
    pub keys_table: Option<TableName>,
    /// Create / upgrade the tables when the store opens (default `true`). Turn off when
    /// the schema is managed elsewhere (`idemq store migrate`, your own tooling).
    pub migrate: bool,
    /// Pool size for [`SqlStore::connect`](crate::SqlStore::connect) (default 10; an
    /// in-memory SQLite database always uses one connection, since each connection would
    /// otherwise see its own database).
    pub max_connections: u32,
    /// How long to wait for a pooled connection before answering
    /// [`StoreError::Unavailable`] (default 10 s).
    pub acquire_timeout: Duration,
    /// SQLite only: how long a statement waits for another writer's lock (default 5 s).
    pub busy_timeout: Duration,
    /// PostgreSQL and MySQL: how long [`SqlStore::connect`](crate::SqlStore::connect)'s
    /// first connection may take before startup fails (default 5 s). A refused connection
    /// fails at once, naming the host and port, whatever this says.
    pub connect_timeout: Duration,
    /// SQLite only: durability of commits (default [`SqliteSynchronous::Full`]).
    pub sqlite_synchronous: SqliteSynchronous,
    /// The most keys written by one statement; larger batches are split (default 500).
    pub max_batch: usize,
    /// PostgreSQL and MySQL: the fence table of in-transaction completions and takeover
    /// tombstones (default `<table>_fence`; see
    /// [`SqlStore::complete_in_tx`](crate::SqlStore::complete_in_tx)).
    pub fence_table: Option<TableName>,
    /// The unique-index strategy's attempt counts per key (default `<table>_attempts`; see
    /// [`SqlStore::unique_index`](crate::SqlStore::unique_index)).
    pub attempts_table: Option<TableName>,
    /// PostgreSQL and MySQL: connections of the heartbeat's own pool (default 2), used by
    /// [`DedupStore::extend`](idemq_core::DedupStore::extend) /
    /// [`DedupStore::extend_batch`](idemq_core::DedupStore::extend_batch) only, so renewing
    /// leases never waits for a connection behind handler transactions holding the main
    /// pool. `0` shares the main pool. SQLite always shares it (a pool given to
    /// [`SqlStore::from_pool`](crate::SqlStore::from_pool) may be an in-memory database, of
    /// which every new connection would be a different, empty one; and SQLite's single
    /// writer makes a heartbeat wait for a handler's write transaction whatever pool it
    /// comes from).
    pub heartbeat_connections: u32,
}

impl Default for SqlStoreOptions {
    fn default() -> Self {
        Self {
            table: TableName::default(),
            keys_table: None,
            migrate: true,
            max_connections: 10,
            acquire_timeout: Duration::from_secs(10),
            busy_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
            sqlite_synchronous: SqliteSynchronous::Full,
            max_batch: 500,
            fence_table: None,
            attempts_table: None,
            heartbeat_connections: 2,
        }
    }
}

impl SqlStoreOptions {
    /// Default options for the dedup table `table`.
    pub fn with_table(table: TableName) -> Self {
        Self {
            table,
            ..Self::default()
        }
    }

    /// The unique-index table: [`SqlStoreOptions::keys_table`] or `<table>_keys`
    /// (an error when that would exceed the identifier limit: set it explicitly).
    pub fn keys_table(&self) -> Result<TableName, StoreError> {
        match &self.keys_table {
            Some(k) => Ok(k.clone()),
            None => self.table.with_suffix("_keys").map_err(|_| {
                StoreError::Config(format!(
                    "dedup table name `{}` is too long to derive the keys table `{}_keys`: \
                     set SqlStoreOptions::keys_table explicitly",
                    self.table, self.table
                ))
            }),
        }
    }
}

impl SqlStoreOptions {
    /// The attempts table: [`SqlStoreOptions::attempts_table`] or `<table>_attempts` (an
    /// error when that would exceed the identifier limit: set it explicitly).
    pub fn attempts_table(&self) -> Result<TableName, StoreError> {
        match &self.attempts_table {
            Some(a) => Ok(a.clone()),
            None => self.table.with_suffix("_attempts").map_err(|_| {
                StoreError::Config(format!(
                    "dedup table name `{}` is too long to derive the attempts table \
                     `{}_attempts`: set SqlStoreOptions::attempts_table explicitly",
                    self.table, self.table
                ))
            }),
        }
    }

    /// The fence table: [`SqlStoreOptions::fence_table`] or `<table>_fence` (an error when
    /// that would exceed the identifier limit: set it explicitly).
    pub fn fence_table(&self) -> Result<TableName, StoreError> {
        match &self.fence_table {
            Some(f) => Ok(f.clone()),
            None => self.table.with_suffix("_fence").map_err(|_| {
                StoreError::Config(format!(
                    "dedup table name `{}` is too long to derive the fence table `{}_fence`: \
                     set SqlStoreOptions::fence_table explicitly",
                    self.table, self.table
                ))
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_keys_table_must_fit() {
        let long = TableName::new(&"t".repeat(60)).unwrap();
        let err = SqlStoreOptions::with_table(long).keys_table().unwrap_err();
        assert!(err.to_string().contains("keys_table"), "{err}");
    }
}
