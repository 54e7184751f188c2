//! Batches far over the databases' statement limits (SQLite's 32766 and MySQL's 65535 bound
//! parameters, MariaDB's `max_allowed_packet`): claims, heartbeats and completions of 20,000
//! keys in one call each are split by the store and answered in order.

mod support;

use idemq_core::{
    ClaimOutcome, ClaimRequest, CompleteOutcome, Completion, ConsumerGroup, DedupKey, DedupStore,
    ExtendOutcome, FencingToken,
};
use std::sync::Arc;
use std::time::Duration;

const KEYS: usize = 20_000;

async fn twenty_thousand_keys_in_one_call_each(s: Arc<dyn DedupStore>) {
    let g = ConsumerGroup::new(&support::unique("large")).expect("group");
    let keys: Vec<DedupKey> = (0..KEYS)
        .map(|i| DedupKey::new(&g, &format!("order-{i:06}")).expect("key"))
        .collect();
    let reqs: Vec<ClaimRequest> = keys
        .iter()
        .map(|k| ClaimRequest::new(k.clone(), Duration::from_secs(120)))
        .collect();
    let claimed = s.claim_batch(&reqs).await.expect("claim 20k keys");
    assert_eq!(claimed.len(), KEYS);
    let tokens: Vec<FencingToken> = claimed
        .iter()
        .map(|o| match o {
            ClaimOutcome::Acquired(l) => l.token,
            other => panic!("a fresh key must be acquired: {other:?}"),
        })
        .collect();
    let leases: Vec<(DedupKey, FencingToken)> =
        keys.iter().cloned().zip(tokens.iter().copied()).collect();
    let extended = s
        .extend_batch(&leases, Duration::from_secs(120))
        .await
        .expect("extend 20k leases");
    assert_eq!(extended.len(), KEYS);
    assert!(
        extended
            .iter()
            .all(|o| matches!(o, ExtendOutcome::Extended { .. })),
        "every lease is ours to extend"
    );
    // One foreign token in the middle: only that lease is answered Fenced, in its place.
    let mut mixed = leases.clone();
    mixed[KEYS / 2].1 = FencingToken(tokens[KEYS / 2].0 ^ 1);
    let answers = s
        .extend_batch(&mixed, Duration::from_secs(120))
        .await
        .expect("extend with a foreign token");
    assert_eq!(answers[KEYS / 2], ExtendOutcome::Fenced);
    assert!(matches!(
        answers[KEYS / 2 + 1],
        ExtendOutcome::Extended { .. }
    ));
    let completions: Vec<Completion> = keys
        .iter()
        .zip(&tokens)
        .map(|(k, t)| Completion {
            key: k.clone(),
            token: *t,
            result: Some(bytes::Bytes::from(format!("receipt for {k}"))),
            retention: Duration::from_secs(3600),
        })
        .collect();
    let done = s
        .complete_batch(&completions)
        .await
        .expect("complete 20k keys");
    assert_eq!(done.len(), KEYS);
    assert!(done.iter().all(|o| *o == CompleteOutcome::Completed));
    let again = s.claim_batch(&reqs).await.expect("claim again");
    assert!(
        again
            .iter()
            .all(|o| matches!(o, ClaimOutcome::Duplicate(_))),
        "every key is a duplicate now"
    );
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_splits_batches_past_its_parameter_limit() {
    let dir = support::TempDir::new();
    let s = idemq_sql::SqliteStore::connect(
        &dir.sqlite_url("large.db"),
        support::options("idemq_large", 2),
    )
    .await
    .expect("sqlite store");
    twenty_thousand_keys_in_one_call_each(Arc::new(s)).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_splits_batches_of_any_size() {
    let Some(url) = support::postgres_url() else {
        return;
    };
    let store = idemq_sql::PgStore::connect(&url, support::options(&support::unique("large"), 2))
        .await
        .expect("postgres store");
    twenty_thousand_keys_in_one_call_each(Arc::new(store.clone())).await;
    for t in store.tables() {
        let _ = idemq_sql::sqlx::query(&format!("DROP TABLE IF EXISTS {t}"))
            .execute(store.pool())
            .await;
    }
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_splits_batches_past_its_parameter_limit() {
    let Some(url) = support::mysql_url() else {
        return;
    };
    let store =
        idemq_sql::MySqlStore::connect(&url, support::options(&support::unique("large"), 2))
            .await
            .expect("mysql store");
    twenty_thousand_keys_in_one_call_each(Arc::new(store.clone())).await;
    for t in store.tables() {
        let _ = idemq_sql::sqlx::query(&format!("DROP TABLE IF EXISTS {t}"))
            .execute(store.pool())
            .await;
    }
}
