//! A password given in a store or broker URL, or in a client property, never appears in an
//! error's text, its `Debug` form, or a configuration's `Debug`: the real servers refuse
//! the login (or nothing listens), and every message the user can see is checked.
#![cfg(all(
    feature = "postgres",
    feature = "mysql",
    feature = "redis",
    feature = "kafka",
    feature = "rabbitmq"
))]

use idemq::kafka::{KafkaProducerConfig, KafkaSourceConfig};
use idemq::rabbitmq::{RabbitPublisher, RabbitSource, RabbitSourceConfig};
use idemq::redis::RedisStore;
use idemq::sql::{MySqlStore, PgStore, SqlStoreOptions};

mod support;
use support::{server_url, Refused};

/// The password every URL and property here carries; percent-encoding-free on purpose, and
/// also tried percent-encoded (`ENCODED` decodes to `DECODED`).
const SECRET: &str = "s3cr3t-Pw9";
const ENCODED: &str = "s3cr3t%40Pw9";
const DECODED: &str = "s3cr3t@Pw9";

/// `url` with its user info replaced by `user:password`.
fn with_login(url: &str, user: &str, password: &str) -> String {
    let (scheme, rest) = url.split_once("://").expect("scheme");
    let host = rest.rsplit_once('@').map_or(rest, |(_, h)| h);
    format!("{scheme}://{user}:{password}@{host}")
}

/// `url` pointing at a local port nothing listens on.
fn at_closed_port(url: &str) -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = l.local_addr().expect("addr").port();
    drop(l);
    let (scheme, rest) = url.split_once("://").expect("scheme");
    let (login, hostpath) = rest.rsplit_once('@').map_or(("", rest), |(l, h)| (l, h));
    let path = hostpath.find('/').map_or("", |i| &hostpath[i..]);
    let at = if login.is_empty() { "" } else { "@" };
    format!("{scheme}://{login}{at}127.0.0.1:{port}{path}")
}

fn assert_hidden(what: &str, text: &str) {
    for secret in [SECRET, ENCODED, DECODED] {
        assert!(
            !text.contains(secret),
            "{what} shows the password `{secret}`: {text}"
        );
    }
}

/// Checks both forms of an error the user may print or log.
fn assert_error_hidden<E: std::fmt::Display + std::fmt::Debug>(what: &str, e: &E) {
    eprintln!("{what}: {e}");
    assert_hidden(what, &e.to_string());
    assert_hidden(what, &format!("{e:?}"));
}

fn opts() -> SqlStoreOptions {
    SqlStoreOptions::default()
}

#[tokio::test]
async fn postgres_errors_hide_the_password() {
    let Some(url) = server_url("IDEMQ_TEST_POSTGRES_URL") else {
        return;
    };
    for pw in [SECRET, ENCODED] {
        let login = with_login(&url, "nobody_here", pw);
        let e = PgStore::connect(&login, opts())
            .await
            .refused("an unknown role is refused");
        assert_error_hidden("PostgreSQL login error", &e);
        let e = PgStore::connect(&at_closed_port(&login), opts())
            .await
            .refused("nothing listens");
        assert!(e.to_string().contains("127.0.0.1"), "names the server: {e}");
        assert_error_hidden("PostgreSQL connect error", &e);
        let e = idemq::open_store(&at_closed_port(&login))
            .await
            .refused("nothing listens");
        assert_error_hidden("open_store error", &e);
    }
}

#[tokio::test]
async fn mysql_errors_hide_the_password() {
    let Some(url) = server_url("IDEMQ_TEST_MYSQL_URL") else {
        return;
    };
    let user = url
        .split_once("://")
        .and_then(|(_, r)| r.split_once(':'))
        .map(|(u, _)| u.to_owned())
        .expect("user in the URL");
    for pw in [SECRET, ENCODED] {
        let login = with_login(&url, &user, pw);
        let e = MySqlStore::connect(&login, opts())
            .await
            .refused("a wrong password is refused");
        assert!(
            e.to_string().contains("password"),
            "says what to check: {e}"
        );
        assert_error_hidden("MariaDB login error", &e);
        let e = MySqlStore::connect(&at_closed_port(&login), opts())
            .await
            .refused("nothing listens");
        assert_error_hidden("MariaDB connect error", &e);
    }
}

#[tokio::test]
async fn redis_errors_hide_the_password() {
    let Some(url) = server_url("IDEMQ_TEST_REDIS_URL") else {
        return;
    };
    for pw in [SECRET, ENCODED] {
        // The test server has no password: AUTH with one is refused.
        let login = with_login(&url, "", pw);
        let e = RedisStore::builder(&login)
            .connect()
            .await
            .refused("AUTH is refused");
        assert_error_hidden("Redis login error", &e);
        let e = RedisStore::builder(at_closed_port(&login))
            .connect()
            .await
            .refused("nothing listens");
        assert_error_hidden("Redis connect error", &e);
        let cluster = at_closed_port(&login).replacen("redis://", "redis+cluster://", 1);
        let e = idemq::open_store(&cluster).await.refused("nothing listens");
        assert_error_hidden("Redis Cluster connect error", &e);
    }
}

#[tokio::test]
async fn rabbitmq_errors_and_settings_hide_the_password() {
    let Some(url) = server_url("IDEMQ_TEST_AMQP_URL") else {
        return;
    };
    for pw in [SECRET, ENCODED] {
        let login = with_login(&url, "guest", pw);
        let cfg = RabbitSourceConfig::new(login.clone(), "idemq-secrets-never-declared");
        assert_hidden("RabbitSourceConfig Debug", &format!("{cfg:?}"));
        let e = RabbitSource::connect(cfg)
            .await
            .refused("a wrong password is refused");
        assert_error_hidden("RabbitMQ source login error", &e);
        let e = RabbitPublisher::connect(login.clone())
            .await
            .refused("a wrong password is refused");
        assert_error_hidden("RabbitMQ publisher login error", &e);
        let e = RabbitPublisher::connect(at_closed_port(&login))
            .await
            .refused("nothing listens");
        assert!(e.to_string().contains("127.0.0.1"), "names the broker: {e}");
        assert_error_hidden("RabbitMQ connect error", &e);
    }
}

#[test]
fn kafka_settings_hide_sasl_and_ssl_passwords() {
    let producer = KafkaProducerConfig::idempotent("127.0.0.1:9092")
        .set("security.protocol", "SASL_SSL")
        .set("sasl.mechanism", "PLAIN")
        .set("sasl.username", "app")
        .set("sasl.password", SECRET)
        .set("ssl.key.password", SECRET);
    let shown = format!("{producer:?}");
    assert_hidden("KafkaProducerConfig Debug", &shown);
    assert!(
        shown.contains("sasl.username"),
        "other settings stay visible: {shown}"
    );
    // An unsafe setting next to the secret: the refusal names the key, not the password.
    let e = producer
        .clone()
        .set("acks", "1")
        .validate()
        .expect_err("acks=1 with idempotence is refused");
    assert!(e.to_string().contains("acks"), "{e}");
    assert_error_hidden("producer config error", &e);

    let source = KafkaSourceConfig::new("127.0.0.1:9092", "billing", &["payments"])
        .set("sasl.password", SECRET);
    assert_hidden("KafkaSourceConfig Debug", &format!("{source:?}"));
}
