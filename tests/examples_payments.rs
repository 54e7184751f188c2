//! The payment examples, run against the real servers: every payment is applied once
//! although the broker publishes each at least twice and loses acks.

mod support;
#[allow(unused_imports)]
use support::server_url;

#[cfg(feature = "postgres")]
#[allow(dead_code)]
#[path = "../examples/pg_payments.rs"]
mod pg_payments;

#[cfg(feature = "redis")]
#[allow(dead_code)]
#[path = "../examples/redis_payments.rs"]
mod redis_payments;

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_postgres_example_applies_every_duplicated_payment_once() {
    let Some(url) = server_url("IDEMQ_TEST_POSTGRES_URL") else {
        return;
    };
    let r = pg_payments::run(&url, 200).await.expect("example runs");
    assert_eq!((r.rows, r.distinct), (200, 200), "{r:?}");
    assert!(
        r.duplicates >= 200,
        "the broker's duplicates were skipped: {r:?}"
    );
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_redis_example_applies_every_duplicated_payment_once() {
    let Some(url) = server_url("IDEMQ_TEST_REDIS_URL") else {
        return;
    };
    let r = redis_payments::run(&url, 200).await.expect("example runs");
    assert_eq!((r.applied, r.distinct), (200, 200), "{r:?}");
    assert!(
        r.duplicates >= 200,
        "the broker's duplicates were skipped: {r:?}"
    );
}
