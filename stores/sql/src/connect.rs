//! Opening a store: over a pool of yours ([`SqlStore::from_pool`]) or from a URL
//! (`connect`, per backend, with startup errors that name the fix), the heartbeat's pool,
//! and the schema (migrations, version).

use crate::backend::{map_sqlx_error, Dialect, Kind, SqlBackend, Val};
use crate::migrate;
use crate::options::SqlStoreOptions;
use crate::queries::Queries;
use crate::store::SqlStore;
use idemq_core::StoreError;
use sqlx::Pool;
use std::sync::Arc;

impl<DB: SqlBackend> SqlStore<DB> {
    /// Wraps an existing pool (your application's), running the migrations unless
    /// [`SqlStoreOptions::migrate`] is off.
    pub async fn from_pool(pool: Pool<DB>, options: SqlStoreOptions) -> Result<Self, StoreError> {
        let keys_table = options.keys_table()?;
        if keys_table == options.table {
            return Err(StoreError::Config(format!(
                "the keys table must differ from the dedup table (`{keys_table}`)"
            )));
        }
        let fence_table = options.fence_table()?;
        if fence_table == options.table || fence_table == keys_table {
            return Err(StoreError::Config(format!(
                "the fence table must differ from the dedup and keys tables (`{fence_table}`)"
            )));
        }
        let attempts_table = options.attempts_table()?;
        if [&options.table, &keys_table, &fence_table].contains(&&attempts_table) {
            return Err(StoreError::Config(format!(
                "the attempts table must differ from the dedup, keys and fence tables \
                 (`{attempts_table}`)"
            )));
        }
        let mariadb = if DB::DIALECT == Dialect::MySql {
            let mut conn = pool
                .acquire()
                .await
                .map_err(|e| map_sqlx_error::<DB>("acquire connection", e))?;
            let v = DB::fetch(&mut conn, "SELECT VERSION()", vec![], &[Kind::Text])
                .await
                .map_err(|e| map_sqlx_error::<DB>("server version", e))?;
            v.first()
                .and_then(|r| r.opt_text(0).ok().flatten())
                .is_some_and(|v| v.contains("MariaDB"))
        } else {
            false
        };
        let q = Arc::new(Queries::new(
            DB::DIALECT,
            mariadb,
            &options.table,
            &keys_table,
            // SQLite needs no fence table: see `complete_in_tx`.
            (DB::DIALECT != Dialect::Sqlite).then_some(&fence_table),
        ));
        let heartbeat_pool = if DB::DIALECT == Dialect::Sqlite || options.heartbeat_connections == 0
        {
            pool.clone()
        } else {
            // Same server and credentials as the main pool; connections open on first use.
            sqlx::pool::PoolOptions::<DB>::new()
                .max_connections(options.heartbeat_connections)
                .acquire_timeout(options.acquire_timeout)
                .connect_lazy_with((*pool.connect_options()).clone())
        };
        let store = Self {
            pool,
            heartbeat_pool,
            q,
            options: Arc::new(options),
            keys_table,
            fence_table,
            attempts_table,
        };
        if store.options.migrate {
            store.migrate().await?;
        }
        Ok(store)
    }

    /// Creates or upgrades the tables; returns the schema version now applied. Safe to run
    /// concurrently from many processes.
    pub async fn migrate(&self) -> Result<i64, StoreError> {
        migrate::run::<DB>(
            &self.pool,
            &self.options.table,
            &self.keys_table,
            &self.fence_table,
            &self.attempts_table,
        )
        .await
    }

    /// The schema version recorded for this store's table, `None` before any migration.
    pub async fn schema_version(&self) -> Result<Option<i64>, StoreError> {
        let mut conn = self.acquire().await?;
        let sql = DB::DIALECT.placeholders(format!(
            "SELECT version FROM {} WHERE dedup_table = ?",
            migrate::SCHEMA_VERSION_TABLE
        ));
        let rows = DB::fetch(
            &mut conn,
            &sql,
            vec![Val::Text(Some(self.options.table.as_str().to_owned()))],
            &[Kind::I64],
        )
        .await
        .map_err(|e| map_sqlx_error::<DB>("schema_version", e))?;
        Ok(rows.first().and_then(|r| r.opt_i64(0).ok().flatten()))
    }
}

#[cfg(feature = "sqlite")]
mod sqlite_connect {
    use super::*;
    use crate::options::SqliteSynchronous;
    use sqlx::sqlite::{
        Sqlite, SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions,
        SqliteSynchronous as Sync,
    };
    use std::str::FromStr;

    impl SqlStore<Sqlite> {
        /// Opens a SQLite database (`sqlite://path.db`, `sqlite://path.db?mode=rwc`,
        /// `sqlite::memory:`), creating the file if the URL sets no `mode`. File databases
        /// use WAL journaling and [`SqlStoreOptions::busy_timeout`]; migrations run unless
        /// disabled.
        pub async fn connect(url: &str, options: SqlStoreOptions) -> Result<Self, StoreError> {
            crate::errors::check_scheme(url, "SqliteStore", &["sqlite"], OTHER_STORES)?;
            let mut co = SqliteConnectOptions::from_str(url).map_err(|e| {
                StoreError::Config(format!("invalid SQLite URL `{url}`: {e} (expected e.g. sqlite://idemq.db or sqlite::memory:)"))
            })?;
            let memory = url.contains(":memory:") || url.contains("mode=memory");
            if !url.contains("mode=") {
                co = co.create_if_missing(true);
            }
            co = co.busy_timeout(options.busy_timeout).synchronous(
                match options.sqlite_synchronous {
                    SqliteSynchronous::Full => Sync::Full,
                    SqliteSynchronous::Normal => Sync::Normal,
                },
            );
            if !memory {
                co = co.journal_mode(SqliteJournalMode::Wal);
            }
            let mut po = SqlitePoolOptions::new()
                .max_connections(options.max_connections.max(1))
                .acquire_timeout(options.acquire_timeout);
            if memory {
                // One connection, kept forever: the database lives and dies with it.
                po = po
                    .max_connections(1)
                    .min_connections(1)
                    .idle_timeout(None)
                    .max_lifetime(None);
            }
            let pool = po
                .connect_with(co)
                .await
                .map_err(|e| map_sqlx_error::<Sqlite>(&format!("connect to {url}"), e))?;
            Self::from_pool(pool, options).await
        }
    }
}

#[cfg(feature = "postgres")]
mod postgres_connect {
    use super::*;
    use crate::errors::{check_scheme, probe};
    use crate::sniff::{endpoint, Server};
    use sqlx::postgres::{PgConnectOptions, PgPoolOptions, Postgres};
    use std::str::FromStr;

    impl SqlStore<Postgres> {
        /// Connects to PostgreSQL (`postgres://user:pass@host:port/db`, or `postgresql://`)
        /// and runs the migrations unless disabled.
        ///
        /// Startup fails at once, with a [`StoreError::Config`] naming what to fix, on
        /// another scheme, on a refused connection (host and port named), on a port where
        /// another server answers (named), and on a refused login; a server that accepts the
        /// connection but does not answer within [`SqlStoreOptions::connect_timeout`] is
        /// [`StoreError::Unavailable`].
        ///
        /// ```
        /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
        /// let err = idemq_sql::PgStore::connect("postgress://localhost/db", Default::default())
        ///     .await
        ///     .unwrap_err();
        /// assert!(err.to_string().contains("postgres:// or postgresql://"));
        /// # });
        /// ```
        pub async fn connect(url: &str, options: SqlStoreOptions) -> Result<Self, StoreError> {
            check_scheme(url, "PgStore", &["postgres", "postgresql"], OTHER_STORES)?;
            let co = PgConnectOptions::from_str(url).map_err(|e| {
                StoreError::Config(format!("invalid PostgreSQL URL `{}`: {e}", redact(url)))
            })?;
            let ep = endpoint(url, 5432);
            probe::<Postgres>(&co, ep.as_ref(), Server::Postgres, options.connect_timeout).await?;
            let pool = PgPoolOptions::new()
                .max_connections(options.max_connections.max(1))
                .acquire_timeout(options.acquire_timeout)
                .connect_with(co)
                .await
                .map_err(|e| {
                    map_sqlx_error::<Postgres>(&format!("connect to {}", redact(url)), e)
                })?;
            Self::from_pool(pool, options).await
        }
    }
}

#[cfg(feature = "mysql")]
mod mysql_connect {
    use super::*;
    use crate::errors::{check_scheme, probe};
    use crate::sniff::{endpoint, Server};
    use sqlx::mysql::{MySql, MySqlConnectOptions, MySqlPoolOptions};
    use std::str::FromStr;

    impl SqlStore<MySql> {
        /// Connects to MySQL or MariaDB (`mysql://user:pass@host:port/db`; `mariadb://` is
        /// accepted too) and runs the migrations unless disabled.
        ///
        /// Startup errors name what to fix, as for [`SqlStore::<Postgres>::connect`]:
        /// another scheme, a refused connection, another server on the port (a MySQL
        /// client waits for a greeting a PostgreSQL or Redis server never sends, so that
        /// case takes [`SqlStoreOptions::connect_timeout`]), a refused login.
        ///
        /// ```
        /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
        /// let err = idemq_sql::MySqlStore::connect("postgres://localhost/db", Default::default())
        ///     .await
        ///     .unwrap_err();
        /// assert!(err.to_string().contains("mysql:// or mariadb://"));
        /// # });
        /// ```
        pub async fn connect(url: &str, options: SqlStoreOptions) -> Result<Self, StoreError> {
            check_scheme(url, "MySqlStore", &["mysql", "mariadb"], OTHER_STORES)?;
            let url = match url.split_once("://") {
                Some((s, rest)) if s.eq_ignore_ascii_case("mariadb") => format!("mysql://{rest}"),
                _ => url.to_owned(),
            };
            let co = MySqlConnectOptions::from_str(&url).map_err(|e| {
                StoreError::Config(format!("invalid MySQL URL `{}`: {e}", redact(&url)))
            })?;
            let ep = endpoint(&url, 3306);
            probe::<MySql>(&co, ep.as_ref(), Server::MySql, options.connect_timeout).await?;
            let pool = MySqlPoolOptions::new()
                .max_connections(options.max_connections.max(1))
                .acquire_timeout(options.acquire_timeout)
                .connect_with(co)
                .await
                .map_err(|e| map_sqlx_error::<MySql>(&format!("connect to {}", redact(&url)), e))?;
            Self::from_pool(pool, options).await
        }
    }
}

/// The stores to use for other URLs, for scheme errors.
#[allow(dead_code)]
const OTHER_STORES: &str = "PostgreSQL: PgStore with postgres://, MySQL/MariaDB: MySqlStore \
     with mysql://, SQLite: SqliteStore with sqlite://, Redis: idemq-redis";

#[cfg(any(feature = "postgres", feature = "mysql"))]
use idemq_core::secrets::redact_url as redact;
