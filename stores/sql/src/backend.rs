//! The three backends behind one small execution interface.
//!
//! Everything above this module (the store, migrations, the entity helpers) is written once,
//! generic over [`SqlBackend`]. A backend contributes its [`Dialect`] (the SQL text differs),
//! its error classification, and two primitives — run a statement, fetch rows — over a tiny
//! value model ([`Val`] in, [`Row`] out) so the shared code never needs sqlx's per-database
//! trait bounds.

use idemq_core::StoreError;
use std::future::Future;
use std::pin::Pin;

/// A boxed, `Send` future (the execution primitives return these).
pub type BoxFut<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The SQL dialect of a backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Dialect {
    /// SQLite 3.35+ (bundled by sqlx).
    Sqlite,
    /// PostgreSQL 12+.
    Postgres,
    /// MariaDB 10.6+ / MySQL 8.0.4+ (`JSON_TABLE`).
    MySql,
}

impl Dialect {
    /// The backend's name, for messages.
    pub fn name(self) -> &'static str {
        match self {
            Dialect::Sqlite => "sqlite",
            Dialect::Postgres => "postgres",
            Dialect::MySql => "mysql",
        }
    }

    /// Turns a statement written with `?` placeholders into this dialect's form
    /// (`$1, $2, …` for PostgreSQL), so one SQL text serves every backend. Every `?` is
    /// taken for a placeholder: do not use it on SQL holding a literal `?`.
    ///
    /// ```
    /// use idemq_sql::Dialect;
    /// assert_eq!(Dialect::Postgres.placeholders("a = ? AND b = ?".into()), "a = $1 AND b = $2");
    /// assert_eq!(Dialect::MySql.placeholders("a = ?".into()), "a = ?");
    /// ```
    pub fn placeholders(self, sql: String) -> String {
        if self != Dialect::Postgres {
            return sql;
        }
        let mut out = String::with_capacity(sql.len() + sql.len() / 4);
        let mut n = 0usize;
        for c in sql.chars() {
            if c == '?' {
                n += 1;
                out.push('$');
                out.push_str(&n.to_string());
            } else {
                out.push(c);
            }
        }
        out
    }

    /// Suffix of a `SELECT` that must read the latest committed row inside a transaction
    /// (InnoDB's consistent reads would otherwise show the transaction's snapshot).
    pub(crate) fn locking_read(self) -> &'static str {
        match self {
            Dialect::Sqlite => "",
            Dialect::Postgres | Dialect::MySql => " FOR UPDATE",
        }
    }

    /// The database's own clock, in milliseconds since the Unix epoch: every lease, retention
    /// and expiry of the dedup table is decided on it, never on a client's clock (a consumer
    /// whose clock runs ahead would otherwise take over live leases). The value is fixed for
    /// the whole statement, so one statement never sees two different "now"s.
    ///
    /// - PostgreSQL: `statement_timestamp()` (the current statement's start; `now()` would be
    ///   the start of a long business transaction);
    /// - MySQL/MariaDB: `UTC_TIMESTAMP(6)`, counted from the epoch with `TIMESTAMPDIFF` (pure
    ///   arithmetic: `UNIX_TIMESTAMP(NOW(3))` goes through the session time zone and is
    ///   ambiguous in a DST fall-back hour);
    /// - SQLite: `julianday('now')` (millisecond precision, stable within a statement; works
    ///   on every SQLite 3.35+, unlike `unixepoch('subsec')` which needs 3.42). SQLite runs
    ///   in the client's process, so there the database's clock *is* that host's clock.
    pub(crate) fn now_ms_sql(self) -> &'static str {
        match self {
            Dialect::Sqlite => {
                "CAST(ROUND((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)"
            }
            Dialect::Postgres => {
                "CAST(FLOOR(EXTRACT(EPOCH FROM statement_timestamp()) * 1000) AS BIGINT)"
            }
            Dialect::MySql => {
                "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)"
            }
        }
    }

    /// `CAST(expr AS <64-bit integer>)`.
    pub(crate) fn cast_i64(self, expr: &str) -> String {
        match self {
            Dialect::Sqlite => format!("CAST({expr} AS INTEGER)"),
            Dialect::Postgres => format!("CAST({expr} AS BIGINT)"),
            Dialect::MySql => format!("CAST({expr} AS SIGNED)"),
        }
    }

    /// `CAST(expr AS <text>)`.
    pub(crate) fn cast_text(self, expr: &str) -> String {
        match self {
            Dialect::Sqlite | Dialect::Postgres => format!("CAST({expr} AS TEXT)"),
            Dialect::MySql => format!("CAST({expr} AS CHAR)"),
        }
    }
}

/// A statement parameter.
#[doc(hidden)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Val {
    /// A 64-bit integer or NULL.
    I64(Option<i64>),
    /// Text or NULL.
    Text(Option<String>),
    /// Bytes or NULL.
    Bytes(Option<Vec<u8>>),
    /// A dedup key: text, bound as bytes on MySQL (the key columns are `VARBINARY` there, so
    /// comparisons are exact: no case folding, no trailing-space padding).
    Key(String),
    /// PostgreSQL only: a `BIGINT[]`.
    I64Array(Vec<i64>),
    /// PostgreSQL only: a `TEXT[]` (keys or nullable text).
    TextArray(Vec<Option<String>>),
    /// PostgreSQL only: a `BYTEA[]`.
    BytesArray(Vec<Option<Vec<u8>>>),
}

impl Val {
    fn is_array(&self) -> bool {
        matches!(
            self,
            Val::I64Array(_) | Val::TextArray(_) | Val::BytesArray(_)
        )
    }
}

/// The expected type of a result column.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A nullable 64-bit integer.
    I64,
    /// Nullable text (also read from binary strings holding UTF-8).
    Text,
    /// Nullable bytes.
    Bytes,
}

/// A decoded result row.
#[doc(hidden)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row(pub Vec<Val>);

impl Row {
    fn at(&self, i: usize) -> Result<&Val, String> {
        self.0.get(i).ok_or_else(|| format!("column {i} missing"))
    }
    /// A nullable integer column.
    pub fn opt_i64(&self, i: usize) -> Result<Option<i64>, String> {
        match self.at(i)? {
            Val::I64(v) => Ok(*v),
            other => Err(format!("column {i}: expected an integer, got {other:?}")),
        }
    }
    /// A non-null integer column.
    pub fn i64(&self, i: usize) -> Result<i64, String> {
        self.opt_i64(i)?
            .ok_or_else(|| format!("column {i}: unexpected NULL"))
    }
    /// A nullable text column.
    pub fn opt_text(&self, i: usize) -> Result<Option<&str>, String> {
        match self.at(i)? {
            Val::Text(v) => Ok(v.as_deref()),
            Val::Key(v) => Ok(Some(v)),
            other => Err(format!("column {i}: expected text, got {other:?}")),
        }
    }
    /// A non-null text column.
    pub fn text(&self, i: usize) -> Result<&str, String> {
        self.opt_text(i)?
            .ok_or_else(|| format!("column {i}: unexpected NULL"))
    }
    /// A nullable bytes column.
    pub fn opt_bytes(&self, i: usize) -> Result<Option<&[u8]>, String> {
        match self.at(i)? {
            Val::Bytes(v) => Ok(v.as_deref()),
            other => Err(format!("column {i}: expected bytes, got {other:?}")),
        }
    }
}

/// How a database error should be handled.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// Deadlock, serialization failure, busy/locked: the statement can be retried at once.
    RetryNow,
    /// The server is unreachable, overloaded, shutting down or timed out: back off.
    Unavailable,
    /// Anything else (syntax, constraint, type errors...).
    Other,
}

mod sealed {
    pub trait Sealed {}
}

/// A database idemq's SQL stores run on: [`sqlx::Sqlite`], [`sqlx::Postgres`],
/// [`sqlx::MySql`] (each behind its cargo feature). Sealed.
pub trait SqlBackend: sqlx::Database + sealed::Sealed {
    /// The SQL dialect.
    const DIALECT: Dialect;

    #[doc(hidden)]
    fn fetch<'a>(
        conn: &'a mut <Self as sqlx::Database>::Connection,
        sql: &'a str,
        args: Vec<Val>,
        kinds: &'a [Kind],
    ) -> BoxFut<'a, Result<Vec<Row>, sqlx::Error>>;

    #[doc(hidden)]
    fn execute<'a>(
        conn: &'a mut <Self as sqlx::Database>::Connection,
        sql: &'a str,
        args: Vec<Val>,
    ) -> BoxFut<'a, Result<u64, sqlx::Error>>;

    #[doc(hidden)]
    fn classify(err: &(dyn sqlx::error::DatabaseError + 'static)) -> ErrorClass;
}

/// Classifies any sqlx error for backend `DB`.
pub(crate) fn error_class<DB: SqlBackend>(e: &sqlx::Error) -> ErrorClass {
    use sqlx::Error as E;
    match e {
        E::Database(db) => DB::classify(db.as_ref()),
        E::Io(_) | E::Tls(_) | E::PoolTimedOut | E::PoolClosed | E::WorkerCrashed => {
            ErrorClass::Unavailable
        }
        _ => ErrorClass::Other,
    }
}

/// Maps a sqlx error of backend `DB` to the store contract's error, prefixed with `op` for
/// context: connection, I/O, pool timeout, busy/locked, deadlock and serialization failures
/// become [`StoreError::Unavailable`] (back off, retry the transaction); configuration
/// errors [`StoreError::Config`]; the rest [`StoreError::Backend`].
///
/// Use it for your own statements in a transaction shared with idemq's helpers, so every
/// error of the transaction is classified the same way.
pub fn map_sqlx_error<DB: SqlBackend>(op: &str, e: sqlx::Error) -> StoreError {
    let backend = DB::DIALECT.name();
    if let sqlx::Error::Configuration(c) = &e {
        return StoreError::Config(format!("{backend} {op}: {c}"));
    }
    match error_class::<DB>(&e) {
        ErrorClass::RetryNow | ErrorClass::Unavailable => {
            StoreError::Unavailable(format!("{backend} {op}: {e}"))
        }
        ErrorClass::Other => StoreError::Backend(format!("{backend} {op}: {e}")),
    }
}

/// The one generic implementation of the primitives; each backend instantiates it.
#[allow(dead_code)]
mod generic {
    use super::{Kind, Row, Val};
    use sqlx::{ColumnIndex, Database, Decode, Encode, Executor, IntoArguments, Type};

    pub(super) type Query<'q, DB> = sqlx::query::Query<'q, DB, <DB as Database>::Arguments<'q>>;

    /// Binds scalar values (array values are PostgreSQL-only: see `postgres_impl`).
    pub(super) fn bind_scalars<'q, DB>(
        mut q: Query<'q, DB>,
        args: Vec<Val>,
        key_as_bytes: bool,
    ) -> Result<Query<'q, DB>, sqlx::Error>
    where
        DB: Database,
        Option<i64>: Type<DB> + Encode<'q, DB>,
        Option<String>: Type<DB> + Encode<'q, DB>,
        Option<Vec<u8>>: Type<DB> + Encode<'q, DB>,
        String: Type<DB> + Encode<'q, DB>,
        Vec<u8>: Type<DB> + Encode<'q, DB>,
    {
        for a in args {
            q = match a {
                Val::I64(v) => q.bind(v),
                Val::Text(v) => q.bind(v),
                Val::Bytes(v) => q.bind(v),
                Val::Key(k) if key_as_bytes => q.bind(k.into_bytes()),
                Val::Key(k) => q.bind(k),
                a if a.is_array() => {
                    return Err(sqlx::Error::Protocol(
                        "idemq-sql: array parameters are PostgreSQL-only".into(),
                    ))
                }
                _ => unreachable!("all scalar variants are handled above"),
            };
        }
        Ok(q)
    }

    fn decode<DB>(row: &DB::Row, kinds: &[Kind]) -> Result<Row, sqlx::Error>
    where
        DB: Database,
        for<'r> i64: Type<DB> + Decode<'r, DB>,
        for<'r> String: Type<DB> + Decode<'r, DB>,
        for<'r> Vec<u8>: Type<DB> + Decode<'r, DB>,
        usize: ColumnIndex<DB::Row>,
    {
        use sqlx::Row as _;
        let mut out = Vec::with_capacity(kinds.len());
        for (i, k) in kinds.iter().enumerate() {
            out.push(match k {
                Kind::I64 => Val::I64(row.try_get::<Option<i64>, _>(i)?),
                Kind::Bytes => Val::Bytes(row.try_get::<Option<Vec<u8>>, _>(i)?),
                Kind::Text => match row.try_get::<Option<String>, _>(i) {
                    Ok(v) => Val::Text(v),
                    // MySQL reports VARBINARY/BLOB columns as binary: read UTF-8 bytes.
                    Err(first) => match row.try_get::<Option<Vec<u8>>, _>(i) {
                        Ok(None) => Val::Text(None),
                        Ok(Some(b)) => Val::Text(Some(String::from_utf8(b).map_err(|e| {
                            sqlx::Error::ColumnDecode {
                                index: i.to_string(),
                                source: Box::new(e),
                            }
                        })?)),
                        Err(_) => return Err(first),
                    },
                },
            });
        }
        Ok(Row(out))
    }

    pub(super) async fn fetch<'q, DB>(
        conn: &mut DB::Connection,
        q: Query<'q, DB>,
        kinds: &[Kind],
    ) -> Result<Vec<Row>, sqlx::Error>
    where
        DB: Database,
        for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
        <DB as Database>::Arguments<'q>: IntoArguments<'q, DB>,
        for<'r> i64: Type<DB> + Decode<'r, DB>,
        for<'r> String: Type<DB> + Decode<'r, DB>,
        for<'r> Vec<u8>: Type<DB> + Decode<'r, DB>,
        usize: ColumnIndex<DB::Row>,
    {
        let rows = q.fetch_all(&mut *conn).await?;
        rows.iter().map(|r| decode::<DB>(r, kinds)).collect()
    }

    pub(super) async fn execute<'q, DB>(
        conn: &mut DB::Connection,
        q: Query<'q, DB>,
    ) -> Result<DB::QueryResult, sqlx::Error>
    where
        DB: Database,
        for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
        <DB as Database>::Arguments<'q>: IntoArguments<'q, DB>,
    {
        q.execute(&mut *conn).await
    }
}

#[cfg(feature = "sqlite")]
mod sqlite_impl {
    use super::*;
    use sqlx::sqlite::{Sqlite, SqliteConnection};

    impl sealed::Sealed for Sqlite {}

    impl SqlBackend for Sqlite {
        const DIALECT: Dialect = Dialect::Sqlite;

        fn fetch<'a>(
            conn: &'a mut SqliteConnection,
            sql: &'a str,
            args: Vec<Val>,
            kinds: &'a [Kind],
        ) -> BoxFut<'a, Result<Vec<Row>, sqlx::Error>> {
            Box::pin(async move {
                let q = generic::bind_scalars(sqlx::query::<Sqlite>(sql), args, false)?;
                generic::fetch::<Sqlite>(conn, q, kinds).await
            })
        }

        fn execute<'a>(
            conn: &'a mut SqliteConnection,
            sql: &'a str,
            args: Vec<Val>,
        ) -> BoxFut<'a, Result<u64, sqlx::Error>> {
            Box::pin(async move {
                let q = generic::bind_scalars(sqlx::query::<Sqlite>(sql), args, false)?;
                Ok(generic::execute::<Sqlite>(conn, q).await?.rows_affected())
            })
        }

        fn classify(err: &(dyn sqlx::error::DatabaseError + 'static)) -> ErrorClass {
            // Extended result code; the primary code is its low byte.
            let code = err.code().and_then(|c| c.parse::<i32>().ok()).unwrap_or(-1);
            match (code, code & 0xff) {
                // BUSY_SNAPSHOT / BUSY_RECOVERY and LOCKED fail at once: retry the statement.
                (517 | 261, _) | (_, 6) => ErrorClass::RetryNow,
                // Plain BUSY comes after busy_timeout already waited: back off instead.
                (_, 5) => ErrorClass::Unavailable,
                (_, 10 | 13 | 14) => ErrorClass::Unavailable, // IOERR, FULL, CANTOPEN
                _ => ErrorClass::Other,
            }
        }
    }
}

// The two are built into statements by `queries` and recognised by `postgres_impl` below:
// they live here, the lower module, so `backend` never imports `queries`.

/// The part of [`PG_CUSTOM_PLAN`] no argument is bound in (what identifies it).
#[cfg(any(feature = "postgres", test))]
pub(crate) const PG_CUSTOM_PLAN_TAIL: &str =
    "(SELECT count(*) FROM generate_series(1, 1000000000)) > 0)";

/// PostgreSQL: an always-true condition, its `?` bound to 1 (`queries::pg_custom_plan_arg`), that
/// has every run of its (cached, prepared) statement planned for the arguments and the
/// table as they are then — a custom plan — instead of the generic plan PostgreSQL
/// otherwise switches to after five runs and keeps until the table is next analyzed.
///
/// Built while the table was small, a generic plan scans it: on a new table that then
/// grows, `complete_batch(100)` took over a second on 180,000 rows, comparing every row
/// with every key. PostgreSQL uses the generic plan when it is estimated no dearer than the
/// custom ones; here only the generic plan, which cannot fold `$n = 1`, keeps the second
/// operand, estimated at a billion rows (never run: the first operand is true), so it never
/// is. A custom plan folds the condition away. Cheaper than an unnamed statement (see
/// `postgres_impl::plan_per_call`), which is parsed again on every call.
pub(crate) const PG_CUSTOM_PLAN: &str =
    "(?::bigint = 1 OR (SELECT count(*) FROM generate_series(1, 1000000000)) > 0)";

#[cfg(feature = "postgres")]
mod postgres_impl {
    use super::*;
    use sqlx::postgres::{PgConnection, Postgres};

    impl sealed::Sealed for Postgres {}

    /// Whether `sql` must run as an unnamed statement, parsed and planned for its arguments
    /// on every call, rather than as a cached prepared statement: a statement that binds an
    /// array and is not an `INSERT`, i.e. one that looks rows up by a batch of keys
    /// (`UPDATE … FROM UNNEST(…)`, `WHERE id = ANY(…)`), unless it already has every run
    /// planned for its arguments ([`PG_CUSTOM_PLAN`], which says why a
    /// cached generic plan is wrong for such a statement, and which costs less: no parsing).
    /// An `INSERT` from arrays (the claim, tombstones, unique keys) has no lookup to plan:
    /// it stays cached.
    fn plan_per_call(sql: &str, args: &[Val]) -> bool {
        args.iter()
            .any(|a| matches!(a, Val::I64Array(_) | Val::TextArray(_) | Val::BytesArray(_)))
            && !sql.trim_start().starts_with("INSERT")
            && !sql.contains(PG_CUSTOM_PLAN_TAIL)
    }

    /// The statement `sql` with `args` bound. PostgreSQL binds arrays too: batch statements
    /// pass one array per column (`UNNEST($1::text[], …)`), so a batch of any size is one
    /// short statement (cached unless [`plan_per_call`] says otherwise).
    fn query<'a>(sql: &'a str, args: Vec<Val>) -> generic::Query<'a, Postgres> {
        let q = sqlx::query::<Postgres>(sql).persistent(!plan_per_call(sql, &args));
        bind(q, args)
    }

    fn bind(mut q: generic::Query<'_, Postgres>, args: Vec<Val>) -> generic::Query<'_, Postgres> {
        for a in args {
            q = match a {
                Val::I64(v) => q.bind(v),
                Val::Text(v) => q.bind(v),
                Val::Bytes(v) => q.bind(v),
                Val::Key(k) => q.bind(k),
                Val::I64Array(v) => q.bind(v),
                Val::TextArray(v) => q.bind(v),
                Val::BytesArray(v) => q.bind(v),
            };
        }
        q
    }

    impl SqlBackend for Postgres {
        const DIALECT: Dialect = Dialect::Postgres;

        fn fetch<'a>(
            conn: &'a mut PgConnection,
            sql: &'a str,
            args: Vec<Val>,
            kinds: &'a [Kind],
        ) -> BoxFut<'a, Result<Vec<Row>, sqlx::Error>> {
            Box::pin(async move { generic::fetch::<Postgres>(conn, query(sql, args), kinds).await })
        }

        fn execute<'a>(
            conn: &'a mut PgConnection,
            sql: &'a str,
            args: Vec<Val>,
        ) -> BoxFut<'a, Result<u64, sqlx::Error>> {
            Box::pin(async move {
                Ok(generic::execute::<Postgres>(conn, query(sql, args))
                    .await?
                    .rows_affected())
            })
        }

        fn classify(err: &(dyn sqlx::error::DatabaseError + 'static)) -> ErrorClass {
            let code = err.code().map(|c| c.into_owned()).unwrap_or_default();
            match code.as_str() {
                // serialization_failure, deadlock_detected
                "40001" | "40P01" => ErrorClass::RetryNow,
                // lock_not_available, query_canceled (statement timeout),
                // admin/crash shutdown, cannot_connect_now, read_only_sql_transaction (standby)
                "55P03" | "57014" | "57P01" | "57P02" | "57P03" | "25006" => {
                    ErrorClass::Unavailable
                }
                // connection exceptions, insufficient resources, system errors
                c if c.starts_with("08") || c.starts_with("53") || c.starts_with("58") => {
                    ErrorClass::Unavailable
                }
                _ => ErrorClass::Other,
            }
        }
    }
}

#[cfg(feature = "mysql")]
mod mysql_impl {
    use super::*;
    use sqlx::mysql::{MySql, MySqlConnection, MySqlDatabaseError};

    impl sealed::Sealed for MySql {}

    impl SqlBackend for MySql {
        const DIALECT: Dialect = Dialect::MySql;

        fn fetch<'a>(
            conn: &'a mut MySqlConnection,
            sql: &'a str,
            args: Vec<Val>,
            kinds: &'a [Kind],
        ) -> BoxFut<'a, Result<Vec<Row>, sqlx::Error>> {
            Box::pin(async move {
                let q = generic::bind_scalars(sqlx::query::<MySql>(sql), args, true)?;
                generic::fetch::<MySql>(conn, q, kinds).await
            })
        }

        fn execute<'a>(
            conn: &'a mut MySqlConnection,
            sql: &'a str,
            args: Vec<Val>,
        ) -> BoxFut<'a, Result<u64, sqlx::Error>> {
            Box::pin(async move {
                let q = generic::bind_scalars(sqlx::query::<MySql>(sql), args, true)?;
                Ok(generic::execute::<MySql>(conn, q).await?.rows_affected())
            })
        }

        fn classify(err: &(dyn sqlx::error::DatabaseError + 'static)) -> ErrorClass {
            let number = err
                .try_downcast_ref::<MySqlDatabaseError>()
                .map(|e| e.number())
                .unwrap_or(0);
            match number {
                // ER_LOCK_DEADLOCK; ER_CHECKREAD (1020, "Record has changed since last read"):
                // MariaDB's snapshot isolation (`innodb_snapshot_isolation=ON`, the default
                // from 11.6) refusing to lock or update a row changed after the transaction's
                // read view was taken — a serialization failure like PostgreSQL's 40001:
                // retrying the whole transaction can succeed.
                1213 | 1020 => ErrorClass::RetryNow,
                // lock wait timeout, too many connections, shutdown in progress, server gone
                // away, lost connection, connection killed, read-only server, idle disconnect,
                // statement time limits (MariaDB 1969, MySQL 3024), query interrupted,
                // read-only transaction, lock NOWAIT
                1205 | 1040 | 1053 | 2006 | 2013 | 1927 | 1290 | 1836 | 4031 | 1969 | 3024
                | 1317 | 1792 | 3572 => ErrorClass::Unavailable,
                _ => match err.code().as_deref() {
                    Some("40001") => ErrorClass::RetryNow,
                    Some(c) if c.starts_with("08") => ErrorClass::Unavailable,
                    _ => ErrorClass::Other,
                },
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn postgres_placeholders_are_numbered_in_text_order() {
        assert_eq!(
            Dialect::Postgres.placeholders("a = ? AND b IN (?, ?)".into()),
            "a = $1 AND b IN ($2, $3)"
        );
        assert_eq!(Dialect::MySql.placeholders("a = ?".into()), "a = ?");
        assert_eq!(Dialect::Sqlite.placeholders("a = ?".into()), "a = ?");
    }
}
