//! `RedisStore::complete_batch_with`: a batch's effects (Redis commands) and its
//! completions in one script, on the real server — applied once, not re-applied on a
//! retried call, not applied at all when one lease of the batch is lost, and through the
//! engine's batch handler with duplicates and lost acks: each effect once, no completion
//! round trip of the engine's own.

mod support;

use idemq_core::broker::{Faults, MemoryBroker};
use idemq_core::handler::batch;
use idemq_core::{
    BrokerKind, ClaimOutcome, ClaimRequest, ClaimedMessage, DedupStore, Envelope, HandlerError,
    IdempotentConsumer, KeyStrategy, LeaseLost,
};
use idemq_redis::redis::{self, AsyncCommands};
use idemq_redis::RedisStore;
use std::sync::Arc;
use std::time::Duration;

use support::rpush;

/// A claimed message on a fresh key, with a 30 s lease.
async fn claimed(store: &RedisStore, name: &str) -> ClaimedMessage {
    support::claimed(store, name, Duration::from_secs(30)).await
}

#[tokio::test]
async fn a_batch_and_its_completions_commit_together_and_once() {
    let Some(url) = support::redis_url() else {
        return;
    };
    let prefix = support::unique_prefix("cbw");
    let store = support::connect(&url, &prefix, false).await;
    let mut conn = support::raw(&url).await;
    let list = format!("{prefix}:applied");
    let mut msgs = Vec::new();
    for i in 0..3 {
        msgs.push(claimed(&store, &format!("pay-{i}")).await);
    }
    let effects: Vec<redis::Cmd> = (0..3).map(|i| rpush(&list, &format!("pay-{i}"))).collect();
    store
        .complete_batch_with(&msgs, &effects)
        .await
        .expect("applied");
    let applied: Vec<String> = conn.lrange(&list, 0, -1).await.expect("lrange");
    assert_eq!(applied, ["pay-0", "pay-1", "pay-2"]);
    for m in &msgs {
        let again = store
            .claim(&ClaimRequest::new(m.key.clone(), Duration::from_secs(30)))
            .await
            .expect("claim");
        assert!(matches!(again, ClaimOutcome::Duplicate(_)), "{again:?}");
    }
    // A retried call (its reply lost) applies nothing again.
    store
        .complete_batch_with(&msgs, &effects)
        .await
        .expect("retried");
    let len: i64 = conn.llen(&list).await.expect("llen");
    assert_eq!(len, 3, "the batch was applied a second time");
    let _: i64 = conn.del(&list).await.expect("del");
}

#[tokio::test]
async fn one_lost_lease_applies_nothing_of_the_batch() {
    let Some(url) = support::redis_url() else {
        return;
    };
    let prefix = support::unique_prefix("cbw");
    let store = support::connect(&url, &prefix, false).await;
    let mut conn = support::raw(&url).await;
    let list = format!("{prefix}:applied");
    let mut msgs = Vec::new();
    for i in 0..3 {
        msgs.push(claimed(&store, &format!("pay-{i}")).await);
    }
    // The second message's lease is given back (as after its handler failed elsewhere).
    store
        .release(&msgs[1].key, msgs[1].token)
        .await
        .expect("release");
    let err = store
        .complete_batch_with(&msgs, &[rpush(&list, "all")])
        .await
        .expect_err("fenced");
    match &err {
        HandlerError::Retryable(source) => {
            let lost = source.downcast_ref::<LeaseLost>().expect("LeaseLost");
            assert_eq!(lost.key, msgs[1].key);
        }
        other => panic!("want a retryable LeaseLost, got {other:?}"),
    }
    let len: i64 = conn.llen(&list).await.expect("llen");
    assert_eq!(len, 0, "nothing of the batch may be applied");
    let rec = store.get(&msgs[0].key).await.expect("get").expect("record");
    assert_eq!(rec.status, idemq_core::RecordStatus::InProgress);
}

#[tokio::test]
async fn through_the_engine_each_payment_is_applied_once() {
    let Some(url) = support::redis_url() else {
        return;
    };
    let prefix = support::unique_prefix("cbw");
    let store = support::connect(&url, &prefix, false).await;
    let mut conn = support::raw(&url).await;
    let list = format!("{prefix}:applied");
    let broker = MemoryBroker::with_seed(17);
    broker.set_faults(Faults {
        lost_ack_rate: 0.2,
        duplicate_publish_rate: 0.3,
    });
    const PAYMENTS: usize = 300;
    for i in 0..PAYMENTS {
        broker.publish(
            Envelope::new(BrokerKind::MEMORY, "payments", format!("p-{i}"))
                .with_header("payment", format!("p-{i}")),
        );
    }
    let handler = batch(
        (store.clone(), list.clone()),
        |(db, list), msgs: Vec<ClaimedMessage>| async move {
            let effects: Vec<redis::Cmd> = msgs
                .iter()
                .map(|m| rpush(&list, m.key.business_key()))
                .collect();
            db.complete_batch_with(&msgs, &effects).await
        },
    );
    let consumer = IdempotentConsumer::new(
        Arc::new(store),
        KeyStrategy::header("billing", "payment").expect("keys"),
        handler,
    );
    consumer
        .run_until_idle(&mut broker.subscribe())
        .await
        .expect("run");
    let applied: Vec<String> = conn.lrange(&list, 0, -1).await.expect("lrange");
    let distinct: std::collections::HashSet<&String> = applied.iter().collect();
    let stats = consumer.stats();
    assert_eq!(
        (applied.len(), distinct.len()),
        (PAYMENTS, PAYMENTS),
        "each payment once: {stats:?}"
    );
    assert!(stats.duplicates > 0, "{stats:?}");
    let _: i64 = conn.del(&list).await.expect("del");
}
