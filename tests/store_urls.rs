//! A new user's bad store URLs: a misspelt scheme, the wrong store's URL, a port where
//! nothing listens, a port where another server answers, `rediss://` without TLS. Each
//! fails at startup with a message naming what to fix; a refused connection fails within
//! 2 s instead of waiting for a pool timeout that looks like an outage.

use idemq::StoreError;
use std::time::{Duration, Instant};

mod support;
#[allow(unused_imports)]
use support::server_url;

/// `host:port` of a server URL.
#[allow(dead_code)]
fn host_port(url: &str) -> String {
    let rest = url.split_once("://").expect("scheme").1;
    let authority = rest.split('/').next().expect("authority");
    authority
        .rsplit_once('@')
        .map_or(authority, |(_, h)| h)
        .to_owned()
}

/// A local port nothing listens on (bound, then released).
fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = l.local_addr().expect("addr").port();
    drop(l);
    port
}

/// Runs a failing connect, asserting it fails within `within`; returns the error.
async fn fails_within<T, F>(within: Duration, f: F) -> String
where
    F: std::future::Future<Output = Result<T, StoreError>>,
{
    let started = Instant::now();
    let r = f.await;
    let took = started.elapsed();
    let e = match r {
        Ok(_) => panic!("connected, but the URL is wrong"),
        Err(e) => e,
    };
    assert!(took < within, "took {took:?} (limit {within:?}): {e}");
    assert!(
        matches!(e, StoreError::Config(_)),
        "a startup configuration error, not a retryable one: {e:?}"
    );
    e.to_string()
}

const REFUSED_LIMIT: Duration = Duration::from_secs(2);
/// Wrong-server cases: the driver may wait for a greeting that never comes, so the store
/// asks the port who answers beside it (within about a second). Their connect timeout is
/// [`LONG_CONNECT_TIMEOUT`], so an error before the limit shows that it did not wait it out.
const WRONG_SERVER_LIMIT: Duration = Duration::from_secs(5);
const LONG_CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

#[cfg(feature = "postgres")]
mod postgres {
    use super::*;
    use idemq::sql::{PgStore, SqlStoreOptions};

    fn opts() -> SqlStoreOptions {
        SqlStoreOptions {
            connect_timeout: Duration::from_secs(1),
            ..Default::default()
        }
    }

    fn waits_long() -> SqlStoreOptions {
        SqlStoreOptions {
            connect_timeout: LONG_CONNECT_TIMEOUT,
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn a_misspelt_scheme_is_refused_naming_the_accepted_ones() {
        let msg = fails_within(
            REFUSED_LIMIT,
            PgStore::connect("postgress://postgres@127.0.0.1/idemq", opts()),
        )
        .await;
        assert!(
            msg.contains("`postgress:`") && msg.contains("postgres:// or postgresql://"),
            "{msg}"
        );
    }

    #[tokio::test]
    async fn a_refused_connection_fails_fast_naming_host_and_port() {
        let port = closed_port();
        let msg = fails_within(
            REFUSED_LIMIT,
            PgStore::connect(
                &format!("postgres://postgres@127.0.0.1:{port}/idemq"),
                SqlStoreOptions::default(),
            ),
        )
        .await;
        assert!(
            msg.contains(&format!("127.0.0.1:{port}")) && msg.contains("connection refused"),
            "{msg}"
        );
        assert!(msg.contains("check the host and port"), "{msg}");
    }

    #[tokio::test]
    async fn open_store_fails_fast_too() {
        let port = closed_port();
        let started = Instant::now();
        let e = idemq::open_store(&format!("postgresql://u:secret@127.0.0.1:{port}/db"))
            .await
            .err()
            .expect("refused");
        assert!(started.elapsed() < REFUSED_LIMIT, "{:?}", started.elapsed());
        let msg = e.to_string();
        assert!(
            msg.contains(&format!("127.0.0.1:{port}")) && !msg.contains("secret"),
            "{msg}"
        );
        assert!(
            matches!(e, idemq::OpenStoreError::Store(StoreError::Config(_))),
            "{e:?}"
        );
    }

    #[cfg(feature = "mysql")]
    #[tokio::test]
    async fn a_postgres_url_at_the_mysql_port_says_mysql_answered() {
        let Some(my) = server_url("IDEMQ_TEST_MYSQL_URL") else {
            return;
        };
        let hp = host_port(&my);
        let msg = fails_within(
            WRONG_SERVER_LIMIT,
            PgStore::connect(&format!("postgres://postgres@{hp}/idemq"), waits_long()),
        )
        .await;
        assert!(
            msg.contains(&hp) && msg.contains("answers as MySQL/MariaDB, not PostgreSQL"),
            "{msg}"
        );
    }

    #[cfg(feature = "redis")]
    #[tokio::test]
    async fn a_postgres_url_at_the_redis_port_says_redis_answered() {
        let Some(r) = server_url("IDEMQ_TEST_REDIS_URL") else {
            return;
        };
        let hp = host_port(&r);
        let msg = fails_within(
            WRONG_SERVER_LIMIT,
            PgStore::connect(&format!("postgres://postgres@{hp}/idemq"), waits_long()),
        )
        .await;
        assert!(msg.contains("answers as Redis, not PostgreSQL"), "{msg}");
    }
}

#[cfg(feature = "mysql")]
mod mysql {
    use super::*;
    use idemq::sql::{MySqlStore, SqlStoreOptions};

    fn opts() -> SqlStoreOptions {
        SqlStoreOptions {
            connect_timeout: Duration::from_secs(1),
            ..Default::default()
        }
    }

    fn waits_long() -> SqlStoreOptions {
        SqlStoreOptions {
            connect_timeout: LONG_CONNECT_TIMEOUT,
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn a_postgres_url_is_not_a_mysql_url() {
        let msg = fails_within(
            REFUSED_LIMIT,
            MySqlStore::connect("postgres://u@127.0.0.1/x", opts()),
        )
        .await;
        assert!(msg.contains("mysql:// or mariadb://"), "{msg}");
    }

    #[tokio::test]
    async fn a_refused_connection_fails_fast_naming_host_and_port() {
        let port = closed_port();
        let msg = fails_within(
            REFUSED_LIMIT,
            MySqlStore::connect(
                &format!("mysql://idemq:idemq@127.0.0.1:{port}/idemq"),
                SqlStoreOptions::default(),
            ),
        )
        .await;
        assert!(
            msg.contains(&format!("127.0.0.1:{port}")) && msg.contains("connection refused"),
            "{msg}"
        );
    }

    #[cfg(feature = "postgres")]
    #[tokio::test]
    async fn a_mysql_url_at_the_postgres_port_says_postgres_answered() {
        let Some(pg) = server_url("IDEMQ_TEST_POSTGRES_URL") else {
            return;
        };
        let hp = host_port(&pg);
        let msg = fails_within(
            WRONG_SERVER_LIMIT,
            MySqlStore::connect(&format!("mysql://idemq:idemq@{hp}/idemq"), waits_long()),
        )
        .await;
        assert!(
            msg.contains(&hp) && msg.contains("answers as PostgreSQL, not MySQL/MariaDB"),
            "{msg}"
        );
    }

    #[tokio::test]
    async fn a_wrong_password_names_the_login_as_the_thing_to_fix() {
        let Some(my) = server_url("IDEMQ_TEST_MYSQL_URL") else {
            return;
        };
        let hp = host_port(&my);
        let msg = fails_within(
            REFUSED_LIMIT,
            MySqlStore::connect(&format!("mysql://idemq:wrong@{hp}/idemq"), opts()),
        )
        .await;
        assert!(
            msg.contains(&hp) && msg.contains("check the user, password"),
            "{msg}"
        );
        assert!(!msg.contains("wrong@"), "{msg}");
    }
}

#[cfg(feature = "redis")]
mod redis {
    use super::*;
    use idemq::redis::{RedisStore, RedisStoreOptions};

    #[tokio::test]
    async fn a_misspelt_scheme_is_refused_naming_the_accepted_ones() {
        let msg = fails_within(
            REFUSED_LIMIT,
            RedisStore::connect("reddis://127.0.0.1/", RedisStoreOptions::default()),
        )
        .await;
        assert!(
            msg.contains("`reddis:`") && msg.contains("redis://"),
            "{msg}"
        );
    }

    #[tokio::test]
    async fn a_refused_connection_fails_fast_naming_host_and_port() {
        let port = closed_port();
        let msg = fails_within(
            REFUSED_LIMIT,
            RedisStore::connect(
                &format!("redis://127.0.0.1:{port}/"),
                RedisStoreOptions::default(),
            ),
        )
        .await;
        assert!(
            msg.contains(&format!("127.0.0.1:{port}")) && msg.contains("connection refused"),
            "{msg}"
        );
        let started = Instant::now();
        let e = idemq::open_store(&format!("redis://127.0.0.1:{port}/"))
            .await
            .err()
            .expect("refused");
        assert!(started.elapsed() < REFUSED_LIMIT, "{:?}", started.elapsed());
        assert!(e.to_string().contains("connection refused"), "{e}");
    }

    #[tokio::test]
    async fn rediss_without_tls_names_the_cargo_feature() {
        let Some(r) = server_url("IDEMQ_TEST_REDIS_URL") else {
            return;
        };
        let url = r.replacen("redis://", "rediss://", 1);
        let e = RedisStore::connect(&url, RedisStoreOptions::default())
            .await
            .expect_err("a plain-text port does not speak TLS");
        let msg = e.to_string();
        // Without TLS in the `redis` crate the message names the feature; with it, the
        // handshake to a plain-text port fails and the message says to use redis://.
        assert!(
            msg.contains("feature `tokio-rustls-comp`") || msg.contains("use redis://"),
            "{msg}"
        );
    }

    #[cfg(feature = "postgres")]
    #[tokio::test]
    async fn a_redis_url_at_the_postgres_port_says_postgres_answered() {
        let Some(pg) = server_url("IDEMQ_TEST_POSTGRES_URL") else {
            return;
        };
        let hp = host_port(&pg);
        let msg = fails_within(
            WRONG_SERVER_LIMIT,
            RedisStore::connect(&format!("redis://{hp}/"), RedisStoreOptions::default()),
        )
        .await;
        assert!(
            msg.contains(&hp) && msg.contains("answers as PostgreSQL, not Redis"),
            "{msg}"
        );
    }

    #[cfg(feature = "mysql")]
    #[tokio::test]
    async fn a_redis_url_at_the_mysql_port_says_mysql_answered() {
        let Some(my) = server_url("IDEMQ_TEST_MYSQL_URL") else {
            return;
        };
        let hp = host_port(&my);
        let msg = fails_within(
            WRONG_SERVER_LIMIT,
            RedisStore::connect(&format!("redis://{hp}/"), RedisStoreOptions::default()),
        )
        .await;
        assert!(
            msg.contains(&hp) && msg.contains("answers as MySQL/MariaDB, not Redis"),
            "{msg}"
        );
    }
}
