//! `RedisStore::complete_with`: the effect (Redis commands) and the completion in one
//! script, on the real server — applied once, not re-applied on a retried call, not applied
//! at all when the lease is lost, a failing command named, and through the engine with
//! duplicates and lost acks: each effect once.

mod support;

use idemq_core::broker::{Faults, MemoryBroker};
use idemq_core::{
    BrokerKind, ClaimOutcome, ClaimRequest, ClaimedMessage, DedupStore, Envelope, HandlerError,
    IdempotentConsumer, KeyStrategy, LeaseLost,
};
use idemq_redis::redis::{self, AsyncCommands};
use std::sync::Arc;
use std::time::Duration;

use support::{claimed, rpush};

#[tokio::test]
async fn the_effect_and_the_completion_commit_together_and_once() {
    let Some(url) = support::redis_url() else {
        return;
    };
    let prefix = support::unique_prefix("cw");
    let store = support::connect(&url, &prefix, false).await;
    let mut conn = support::raw(&url).await;
    let list = format!("{prefix}:applied");
    let msg = claimed(&store, "pay-1", Duration::from_secs(30)).await;

    let out = store
        .complete_with(&msg, &[rpush(&list, "pay-1"), rpush(&list, "audit")], None)
        .await;
    assert!(matches!(out, Ok(None)), "{out:?}");
    let applied: Vec<String> = conn.lrange(&list, 0, -1).await.expect("lrange");
    assert_eq!(applied, ["pay-1", "audit"]);
    // Completed: the next claim of the key is a duplicate.
    let again = store
        .claim(&ClaimRequest::new(msg.key.clone(), Duration::from_secs(30)))
        .await
        .expect("claim");
    assert!(matches!(again, ClaimOutcome::Duplicate(_)), "{again:?}");

    // A retried call (its reply lost) completes again without applying again.
    let retried = store
        .complete_with(&msg, &[rpush(&list, "pay-1")], None)
        .await;
    assert!(retried.is_ok(), "{retried:?}");
    let len: i64 = conn.llen(&list).await.expect("llen");
    assert_eq!(len, 2, "the effect was applied a second time");
    let _: i64 = conn.del(&list).await.expect("del");
}

#[tokio::test]
async fn a_lost_lease_applies_nothing_and_says_so() {
    let Some(url) = support::redis_url() else {
        return;
    };
    let prefix = support::unique_prefix("cw");
    let store = support::connect(&url, &prefix, false).await;
    let mut conn = support::raw(&url).await;
    let list = format!("{prefix}:applied");
    let msg = claimed(&store, "pay-2", Duration::from_millis(300)).await;
    // The lease ends and another worker takes the key over.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let taken = store
        .claim(&ClaimRequest::new(msg.key.clone(), Duration::from_secs(30)))
        .await
        .expect("takeover");
    assert!(matches!(taken, ClaimOutcome::Acquired(_)), "{taken:?}");

    let out = store
        .complete_with(&msg, &[rpush(&list, "pay-2")], None)
        .await;
    match out {
        Err(HandlerError::Retryable(e)) => {
            assert!(e.downcast_ref::<LeaseLost>().is_some(), "{e}");
        }
        other => panic!("expected a retryable LeaseLost, got {other:?}"),
    }
    let len: i64 = conn.llen(&list).await.expect("llen");
    assert_eq!(len, 0, "a fenced call applied its effect");
}

#[tokio::test]
async fn a_failing_command_is_permanent_and_named_and_the_record_stays_in_progress() {
    let Some(url) = support::redis_url() else {
        return;
    };
    let prefix = support::unique_prefix("cw");
    let store = support::connect(&url, &prefix, false).await;
    let mut conn = support::raw(&url).await;
    let not_a_list = format!("{prefix}:string");
    let _: () = conn.set(&not_a_list, "x").await.expect("set");
    let msg = claimed(&store, "pay-3", Duration::from_secs(30)).await;

    let out = store
        .complete_with(&msg, &[rpush(&not_a_list, "pay-3")], None)
        .await;
    match out {
        Err(HandlerError::Permanent(e)) => {
            let text = e.to_string();
            assert!(text.contains("effect command 1"), "{text}");
            assert!(text.contains("WRONGTYPE"), "{text}");
        }
        other => panic!("expected a permanent error, got {other:?}"),
    }
    let rec = store
        .get(&msg.key)
        .await
        .expect("get")
        .expect("the record is still there");
    assert_eq!(rec.status, idemq_core::RecordStatus::InProgress, "{rec:?}");

    let empty = store.complete_with(&msg, &[redis::Cmd::new()], None).await;
    assert!(
        matches!(&empty, Err(HandlerError::Permanent(e)) if e.to_string().contains("empty")),
        "{empty:?}"
    );
    let _: i64 = conn.del(&not_a_list).await.expect("del");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_the_engine_each_payment_is_applied_once() {
    let Some(url) = support::redis_url() else {
        return;
    };
    let prefix = support::unique_prefix("cw");
    let store = support::connect(&url, &prefix, false).await;
    let mut conn = support::raw(&url).await;
    let list = format!("{prefix}:applied");
    let broker = MemoryBroker::with_seed(11);
    broker.set_faults(Faults {
        lost_ack_rate: 0.2,
        duplicate_publish_rate: 0.3,
    });
    const PAYMENTS: usize = 200;
    for i in 0..PAYMENTS {
        broker.publish(
            Envelope::new(BrokerKind::MEMORY, "payments", format!("p-{i}"))
                .with_header("payment", format!("p-{i}")),
        );
    }
    let db = store.clone();
    let effects = list.clone();
    let consumer = IdempotentConsumer::new(
        Arc::new(store),
        KeyStrategy::header("billing", "payment").expect("keys"),
        move |m: ClaimedMessage| {
            let (db, list) = (db.clone(), effects.clone());
            async move {
                let id = m.key.business_key().to_string();
                db.complete_with(&m, &[rpush(&list, &id)], None).await
            }
        },
    );
    consumer
        .run_until_idle(&mut broker.subscribe())
        .await
        .expect("run");
    let applied: Vec<String> = conn.lrange(&list, 0, -1).await.expect("lrange");
    let distinct: std::collections::HashSet<&String> = applied.iter().collect();
    assert_eq!(
        (applied.len(), distinct.len()),
        (PAYMENTS, PAYMENTS),
        "each payment once: {:?}",
        consumer.stats()
    );
    let _: i64 = conn.del(&list).await.expect("del");
}

#[tokio::test]
async fn in_a_cluster_effects_under_the_records_hash_tag_commit_with_it() {
    let Some(url) = support::cluster_url() else {
        return;
    };
    let prefix = support::unique_prefix("cwc");
    let store = support::connect(&url, &prefix, true).await;
    let msg = claimed(&store, "pay-c", Duration::from_secs(30)).await;
    // The record is `<prefix>:{<group>}:pay-c`: an effect key with the same tag lives on
    // the record's node.
    let list = format!("{{{}}}:applied", msg.key.group());
    let out = store
        .complete_with(&msg, &[rpush(&list, "pay-c")], None)
        .await;
    assert!(matches!(out, Ok(None)), "{out:?}");
    let mut conn = store.cluster_connection().expect("a cluster store");
    let applied: Vec<String> = conn.lrange(&list, 0, -1).await.expect("lrange");
    assert_eq!(applied, ["pay-c"]);
    let _: i64 = conn.del(&list).await.expect("del");
}
