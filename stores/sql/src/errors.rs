//! Errors that say what to do next: at startup (a wrong scheme, a port where no server or
//! the wrong server listens, a refused login) and in handlers (a sqlx error classified as
//! retryable or permanent, so `?` redelivers a deadlock but dead-letters a constraint
//! violation).

#[cfg(any(feature = "postgres", feature = "mysql"))]
use crate::backend::error_class;
use crate::backend::{ErrorClass, SqlBackend};
#[cfg(any(feature = "postgres", feature = "mysql"))]
use crate::sniff::{identify, Endpoint, Server};
use idemq_core::{HandlerError, StoreError};
#[cfg(any(feature = "postgres", feature = "mysql"))]
use std::time::Duration;

/// Refuses a URL whose scheme `store` does not take, naming the accepted ones.
pub(crate) fn check_scheme(
    url: &str,
    store: &str,
    accepted: &[&str],
    others: &str,
) -> Result<(), StoreError> {
    let scheme = url.split_once(':').map_or("", |(s, _)| s);
    if accepted.iter().any(|a| a.eq_ignore_ascii_case(scheme)) {
        return Ok(());
    }
    let list = accepted
        .iter()
        .map(|a| format!("{a}://"))
        .collect::<Vec<_>>()
        .join(" or ");
    let shown = if scheme.is_empty() {
        "a URL without a scheme".to_owned()
    } else {
        format!("scheme `{scheme}:`")
    };
    Err(StoreError::Config(format!(
        "{store} cannot open {shown}: use {list} ({others})"
    )))
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
/// Connects once, within `timeout`, before the pool is built: a refused connection, a
/// wrong server or a refused login fails startup at once with a message naming the fix,
/// instead of the pool retrying until its acquire timeout says "pool timed out".
pub(crate) async fn probe<DB: SqlBackend>(
    opts: &<DB::Connection as sqlx::Connection>::Options,
    ep: Option<&Endpoint>,
    expected: Server,
    timeout: Duration,
) -> Result<(), StoreError> {
    use sqlx::Connection;
    let connect = tokio::time::timeout(timeout, DB::Connection::connect_with(opts));
    // A server of another kind may hold the handshake until the timeout (Redis waits for
    // the end of a line that never comes): if it has not completed after a moment, ask
    // beside it who answers there, and fail at once if it is another server.
    let sniff = async {
        tokio::time::sleep(SNIFF_AFTER.min(timeout)).await;
        wrong_server(ep, expected).await
    };
    tokio::select! {
        r = connect => match r {
            Ok(Ok(conn)) => {
                let _ = conn.close().await;
                Ok(())
            }
            Ok(Err(e)) => Err(startup_error::<DB>(e, ep, expected).await),
            Err(_) => Err(silent_server(ep, expected, timeout).await),
        },
        Some(wrong) = sniff => Err(wrong),
    }
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
/// How long a first connection may take before [`probe`] asks who answers beside it
/// (a handshake with the right server on a local network takes milliseconds).
const SNIFF_AFTER: Duration = Duration::from_millis(300);

#[cfg(any(feature = "postgres", feature = "mysql"))]
fn at(ep: Option<&Endpoint>) -> String {
    ep.map_or_else(|| "the configured socket".to_owned(), |e| e.to_string())
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
/// The server answering at `ep` is not `expected`: say which one it is, if it can be told.
async fn wrong_server(ep: Option<&Endpoint>, expected: Server) -> Option<StoreError> {
    let ep = ep?;
    let found = identify(ep).await?;
    if found == expected {
        return None;
    }
    Some(StoreError::Config(format!(
        "{ep} answers as {}, not {}: the URL's host or port points at the wrong server \
         (use {}'s port, or open that server with a {} URL)",
        found.name(),
        expected.name(),
        expected.name(),
        found.scheme()
    )))
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
async fn silent_server(ep: Option<&Endpoint>, expected: Server, timeout: Duration) -> StoreError {
    if let Some(e) = wrong_server(ep, expected).await {
        return e;
    }
    StoreError::Unavailable(format!(
        "{} at {} accepted the connection but did not complete the {} handshake within \
         {timeout:?} (SqlStoreOptions::connect_timeout): is that port a {} server?",
        expected.name(),
        at(ep),
        expected.name(),
        expected.name()
    ))
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
/// Maps a failed first connection to an error naming the host, port and what to fix.
pub(crate) async fn startup_error<DB: SqlBackend>(
    e: sqlx::Error,
    ep: Option<&Endpoint>,
    expected: Server,
) -> StoreError {
    use std::io::ErrorKind as Io;
    let name = expected.name();
    let where_ = at(ep);
    match &e {
        sqlx::Error::Io(io) if io.kind() == Io::ConnectionRefused => StoreError::Config(format!(
            "cannot connect to {name} at {where_}: connection refused (nothing listens on that \
             port): check the host and port in the URL, and that the server is running"
        )),
        sqlx::Error::Io(io) if matches!(io.kind(), Io::NotFound | Io::Other) && ep.is_some() => {
            // Name resolution failures surface as `Other` ("failed to lookup address").
            StoreError::Config(format!(
                "cannot connect to {name} at {where_}: {io}: check the host name in the URL"
            ))
        }
        sqlx::Error::Configuration(c) => {
            StoreError::Config(format!("invalid {name} URL for {where_}: {c}"))
        }
        sqlx::Error::Tls(t) => StoreError::Config(format!(
            "TLS with {name} at {where_} failed: {t}: check sslmode / ssl-mode in the URL and \
             the server's TLS setup"
        )),
        sqlx::Error::Database(db) => match error_class::<DB>(&e) {
            ErrorClass::Unavailable | ErrorClass::RetryNow => StoreError::Unavailable(format!(
                "{name} at {where_} is not accepting connections now: {db}"
            )),
            ErrorClass::Other => StoreError::Config(format!(
                "{name} at {where_} refused the connection: {db}: check the user, password \
                 and database name in the URL"
            )),
        },
        _ => match wrong_server(ep, expected).await {
            Some(wrong) => wrong,
            None => StoreError::Unavailable(format!("cannot connect to {name} at {where_}: {e}")),
        },
    }
}

/// Whether retrying a failed statement (or its whole transaction) later may succeed: a
/// deadlock, a serialization failure, a lock wait timeout, a lost or refused connection, a
/// pool timeout, a server shutting down. Constraint violations, syntax errors, type and
/// decode errors and a missing row are not.
///
/// ```
/// use idemq_sql::is_retryable_sqlx_error;
/// assert!(is_retryable_sqlx_error(&idemq_sql::sqlx::Error::PoolTimedOut));
/// assert!(!is_retryable_sqlx_error(&idemq_sql::sqlx::Error::RowNotFound));
/// ```
pub fn is_retryable_sqlx_error(e: &sqlx::Error) -> bool {
    use sqlx::Error as E;
    match e {
        E::Database(db) => database_class(db.as_ref()) != ErrorClass::Other,
        E::Io(_) | E::Tls(_) | E::PoolTimedOut | E::PoolClosed | E::WorkerCrashed => true,
        E::Protocol(_) => true,
        _ => false,
    }
}

/// Classifies a server error with the rules of the backend that raised it.
fn database_class(db: &(dyn sqlx::error::DatabaseError + 'static)) -> ErrorClass {
    #[cfg(feature = "postgres")]
    if db
        .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
        .is_some()
    {
        return <sqlx::Postgres as SqlBackend>::classify(db);
    }
    #[cfg(feature = "mysql")]
    if db
        .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
        .is_some()
    {
        return <sqlx::MySql as SqlBackend>::classify(db);
    }
    #[cfg(feature = "sqlite")]
    if db.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some() {
        return <sqlx::Sqlite as SqlBackend>::classify(db);
    }
    match db.code().as_deref() {
        Some("40001" | "40P01") => ErrorClass::RetryNow,
        _ => ErrorClass::Other,
    }
}

/// A handler's error for a sqlx error: [`HandlerError::Retryable`] when
/// [`is_retryable_sqlx_error`] says so, else [`HandlerError::Permanent`] (dead-lettered:
/// redelivering a unique violation or a syntax error would fail the same way forever).
///
/// ```
/// use idemq_core::HandlerError;
/// let e = idemq_sql::handler_error(idemq_sql::sqlx::Error::PoolTimedOut);
/// assert!(matches!(e, HandlerError::Retryable(_)));
/// ```
pub fn handler_error(e: sqlx::Error) -> HandlerError {
    if is_retryable_sqlx_error(&e) {
        HandlerError::Retryable(e.into())
    } else {
        HandlerError::Permanent(e.into())
    }
}

/// `?` for sqlx results in a handler: `.classify()?` turns a sqlx error into the
/// [`HandlerError`] [`handler_error`] chooses (retry a deadlock or a lost connection,
/// dead-letter a constraint or syntax error). `From<sqlx::Error> for HandlerError` cannot
/// exist outside sqlx and idemq-core, hence the extension trait. `StoreError` needs
/// nothing: `?` converts it already.
///
/// ```no_run
/// # async fn f(tx: &mut idemq_sql::sqlx::PgConnection) -> idemq_core::HandlerResult {
/// use idemq_sql::SqlResultExt;
/// idemq_sql::sqlx::query("UPDATE accounts SET balance = balance + 1")
///     .execute(&mut *tx)
///     .await
///     .classify()?;
/// # Ok(None) }
/// ```
pub trait SqlResultExt<T> {
    /// The result with its sqlx error classified as retryable or permanent.
    fn classify(self) -> Result<T, HandlerError>;
}

impl<T> SqlResultExt<T> for Result<T, sqlx::Error> {
    fn classify(self) -> Result<T, HandlerError> {
        self.map_err(handler_error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wrong_scheme_names_the_accepted_ones() {
        let e = check_scheme(
            "postgress://u:secret@h/db",
            "PgStore",
            &["postgres", "postgresql"],
            "MySQL: MySqlStore",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("`postgress:`") && e.contains("postgres:// or postgresql://"),
            "{e}"
        );
        assert!(!e.contains("secret"), "{e}");
        assert!(check_scheme("POSTGRES://h/db", "PgStore", &["postgres"], "").is_ok());
    }

    #[test]
    fn io_and_pool_errors_retry_and_logic_errors_do_not() {
        let io = sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert!(is_retryable_sqlx_error(&io));
        assert!(!is_retryable_sqlx_error(&sqlx::Error::ColumnNotFound(
            "x".into()
        )));
        let r: Result<(), sqlx::Error> = Err(sqlx::Error::RowNotFound);
        assert!(matches!(r.classify(), Err(HandlerError::Permanent(_))));
    }
}
