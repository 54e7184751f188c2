//! Errors that say what to do next: at startup (a wrong scheme, `rediss://` without TLS
//! compiled in, a port where nothing or another server listens, a refused login) and in
//! handlers (a Redis error classified as retryable or permanent for `?`).

use crate::sniff::{endpoint, identify, Endpoint, Server};
use idemq_core::{HandlerError, StoreError};
use redis::RedisError;
use std::time::Duration;

/// Maps a Redis client error: connection, IO, timeout and transient server states are
/// [`StoreError::Unavailable`] (back off, retry, never ack); the rest is
/// [`StoreError::Backend`].
pub fn map_redis_error(e: &RedisError) -> StoreError {
    use redis::ErrorKind as K;
    let transient = e.is_io_error()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || matches!(
            e.kind(),
            K::BusyLoadingError
                | K::TryAgain
                | K::ClusterDown
                | K::MasterDown
                | K::ReadOnly
                | K::ClusterConnectionNotFound
                // A slot moving (resharding) or a failover in progress: the client has
                // followed the redirections it could; later the map is settled.
                | K::Moved
                | K::Ask
        )
        // MISCONF: persistence failing, writes refused until it recovers; NOREPLICAS:
        // min-replicas-to-write not met.
        || matches!(
            e.code(),
            Some("OOM" | "LOADING" | "BUSY" | "MISCONF" | "NOREPLICAS")
        );
    if transient {
        StoreError::Unavailable(format!("redis: {e}"))
    } else {
        StoreError::Backend(format!("redis: {e}"))
    }
}

pub(crate) fn store_err(e: RedisError) -> StoreError {
    map_redis_error(&e)
}

/// The URL schemes the `redis` crate opens.
pub const REDIS_SCHEMES: &[&str] = &["redis", "rediss", "redis+unix", "unix"];

/// The message for `rediss://` in a build whose `redis` crate has no TLS feature.
pub(crate) fn tls_missing() -> StoreError {
    StoreError::Config(
        "`rediss://` needs TLS, which this build's `redis` crate lacks: enable its cargo \
         feature `tokio-rustls-comp` (or `tokio-native-tls-comp`) by adding \
         `redis = { version = \"0.27\", features = [\"tokio-rustls-comp\"] }` next to \
         idemq-redis in your Cargo.toml (cargo unifies the features), or use `redis://` \
         for a plain-text port"
            .into(),
    )
}

/// Checks the scheme and opens a client, naming the fix for a wrong scheme or a missing TLS
/// feature.
pub(crate) fn open_client(url: &str) -> Result<redis::Client, StoreError> {
    let scheme = url.split_once(':').map_or("", |(s, _)| s);
    if !REDIS_SCHEMES.iter().any(|s| s.eq_ignore_ascii_case(scheme)) {
        let shown = if scheme.is_empty() {
            "a URL without a scheme".to_owned()
        } else {
            format!("scheme `{scheme}:`")
        };
        return Err(StoreError::Config(format!(
            "RedisStore cannot open {shown}: use redis://host:port/db, rediss:// (TLS), \
             redis+unix:///path/to/socket, or redis+cluster://host:port,host:port/ for a Redis \
             Cluster (SQL databases: idemq-sql's stores)"
        )));
    }
    redis::Client::open(url).map_err(|e| {
        if e.kind() == redis::ErrorKind::InvalidClientConfig && e.to_string().contains("TLS") {
            tls_missing()
        } else {
            StoreError::Config(format!(
                "invalid Redis URL: {e} (expected redis://[user:password@]host:port/db)"
            ))
        }
    })
}

/// Opens one plain connection and sends `PING` within the timeouts, so startup fails at
/// once with a message naming the host, port and fix instead of a driver-internal one.
pub(crate) async fn probe(
    client: &redis::Client,
    url: &str,
    connect_timeout: Duration,
    response_timeout: Duration,
) -> Result<(), StoreError> {
    let ep = endpoint(url, 6379);
    let cfg = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(connect_timeout)
        .set_response_timeout(response_timeout);
    let attempt = async {
        let mut conn = client
            .get_multiplexed_async_connection_with_config(&cfg)
            .await?;
        redis::cmd("PING").query_async::<()>(&mut conn).await
    };
    // The library's own timeouts bound each step; this bounds the whole handshake.
    let budget = connect_timeout.saturating_add(response_timeout);
    match tokio::time::timeout(budget, attempt).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(startup_error(&e, ep.as_ref(), url).await),
        Err(_) => Err(silent(ep.as_ref(), url, budget).await),
    }
}

fn at(ep: Option<&Endpoint>) -> String {
    ep.map_or_else(|| "the configured socket".to_owned(), |e| e.to_string())
}

async fn wrong_server(ep: Option<&Endpoint>) -> Option<StoreError> {
    let ep = ep?;
    match identify(ep).await? {
        Server::Redis => None,
        other => Some(StoreError::Config(format!(
            "{ep} answers as {}, not Redis: the URL's host or port points at the wrong server \
             (use Redis's port, default 6379; open {} with idemq-sql and a {} URL)",
            other.name(),
            other.name(),
            other.scheme()
        ))),
    }
}

fn tls_hint(url: &str) -> &'static str {
    if url.len() >= 7 && url[..7].eq_ignore_ascii_case("rediss:") {
        " (rediss:// expects TLS on that port; use redis:// for a plain-text one)"
    } else {
        ""
    }
}

async fn silent(ep: Option<&Endpoint>, url: &str, budget: Duration) -> StoreError {
    if let Some(e) = wrong_server(ep).await {
        return e;
    }
    StoreError::Unavailable(format!(
        "Redis at {} accepted the connection but did not answer PING within {budget:?} \
         (connect_timeout + response_timeout){}",
        at(ep),
        tls_hint(url)
    ))
}

/// Maps a failed startup `PING` to an error naming the host, port and what to fix.
pub(crate) async fn startup_error(e: &RedisError, ep: Option<&Endpoint>, url: &str) -> StoreError {
    let where_ = at(ep);
    if e.is_connection_refusal() {
        return StoreError::Config(format!(
            "cannot connect to Redis at {where_}: connection refused (nothing listens there): \
             check the host and port in the URL, and that the server is running"
        ));
    }
    if e.kind() == redis::ErrorKind::AuthenticationFailed
        || matches!(e.code(), Some("NOAUTH" | "WRONGPASS"))
    {
        return StoreError::Config(format!(
            "Redis at {where_} refused the login: {e}: check the user and password in the URL \
             (redis://user:password@host:port/db)"
        ));
    }
    if e.kind() == redis::ErrorKind::InvalidClientConfig {
        return StoreError::Config(format!("Redis at {where_}: {e}"));
    }
    if let Some(wrong) = wrong_server(ep).await {
        return wrong;
    }
    match map_redis_error(e) {
        StoreError::Unavailable(_) => StoreError::Unavailable(format!(
            "cannot connect to Redis at {where_}: {e}{}",
            tls_hint(url)
        )),
        _ => StoreError::Config(format!(
            "Redis at {where_} refused the startup PING: {e}{}",
            tls_hint(url)
        )),
    }
}

/// Whether retrying later may succeed: connection, IO and timeout errors and transient
/// server states (`LOADING`, `BUSY`, `TRYAGAIN`, read-only replica...) — the ones
/// [`map_redis_error`] calls unavailable. A wrong type, a script error or a bad argument is
/// not.
///
/// ```
/// use idemq_redis::redis::{ErrorKind, RedisError};
/// let wrong_type = RedisError::from((ErrorKind::TypeError, "WRONGTYPE"));
/// assert!(!idemq_redis::is_retryable_redis_error(&wrong_type));
/// let io = RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
/// assert!(idemq_redis::is_retryable_redis_error(&io));
/// ```
pub fn is_retryable_redis_error(e: &RedisError) -> bool {
    map_redis_error(e).is_retryable()
}

/// A handler's error for a Redis error: [`HandlerError::Retryable`] when
/// [`is_retryable_redis_error`] says so, else [`HandlerError::Permanent`].
pub fn handler_error(e: RedisError) -> HandlerError {
    if is_retryable_redis_error(&e) {
        HandlerError::Retryable(e.into())
    } else {
        HandlerError::Permanent(e.into())
    }
}

/// `?` for Redis results in a handler: `.classify()?` turns a [`RedisError`] into the
/// [`HandlerError`] [`handler_error`] chooses. (`From<RedisError> for HandlerError` cannot
/// exist outside `redis` and idemq-core.)
///
/// ```no_run
/// # async fn f(mut conn: idemq_redis::redis::aio::ConnectionManager) -> idemq_core::HandlerResult {
/// use idemq_redis::RedisResultExt;
/// use idemq_redis::redis::AsyncCommands;
/// let _: i64 = conn.incr("balance:7", 100).await.classify()?;
/// # Ok(None) }
/// ```
pub trait RedisResultExt<T> {
    /// The result with its Redis error classified as retryable or permanent.
    fn classify(self) -> Result<T, HandlerError>;
}

impl<T> RedisResultExt<T> for Result<T, RedisError> {
    fn classify(self) -> Result<T, HandlerError> {
        self.map_err(handler_error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wrong_scheme_names_the_redis_ones() {
        let e = open_client("postgres://h:6379/").unwrap_err().to_string();
        assert!(e.contains("`postgres:`") && e.contains("redis://"), "{e}");
    }

    #[test]
    fn the_tls_message_names_the_feature() {
        let e = tls_missing().to_string();
        assert!(
            e.contains("tokio-rustls-comp") && e.contains("Cargo.toml"),
            "{e}"
        );
    }
}
