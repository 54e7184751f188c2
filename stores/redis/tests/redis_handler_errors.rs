//! `.classify()?` on Redis results in a handler: a wrong-type or a bad-argument error is
//! permanent (redelivering it fails the same way), a dropped connection retryable.

mod support;

use idemq_core::HandlerError;
use idemq_redis::redis::{self, AsyncCommands};
use idemq_redis::{handler_error, RedisResultExt};

#[tokio::test]
async fn a_wrong_type_is_permanent_and_a_lost_connection_retryable() {
    let Some(url) = support::redis_url() else {
        return;
    };
    let mut conn = redis::Client::open(url.as_str())
        .expect("url")
        .get_multiplexed_async_connection()
        .await
        .expect("connect");
    let k = format!("{}:string", support::unique_prefix("hx"));
    let _: () = conn.set(&k, "not a list").await.expect("set");
    let wrong = conn.lpush::<_, _, i64>(&k, "x").await.classify();
    assert!(
        matches!(wrong, Err(HandlerError::Permanent(_))),
        "{wrong:?}"
    );
    let not_int = conn.incr::<_, _, i64>(&k, 1).await.classify();
    assert!(
        matches!(not_int, Err(HandlerError::Permanent(_))),
        "{not_int:?}"
    );
    let _: () = conn.del(&k).await.expect("del");

    let dropped =
        redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
    assert!(matches!(handler_error(dropped), HandlerError::Retryable(_)));
}
