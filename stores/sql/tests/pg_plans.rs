//! PostgreSQL: a statement that looks dedup rows up by an array of keys (batch completion,
//! read-back, probe, fold, heartbeat) is planned for the arrays it is given, on every call.
//!
//! A named prepared statement switches to a generic plan after five runs and keeps it until
//! the table's statistics change. Built while the table was small (a new deployment, a table
//! autovacuum has not analyzed yet), that plan scans the whole table for every batch — a
//! nested loop comparing every row with every key — and stays so as the table grows:
//! `complete_batch(100)` took over a second on a table of a few hundred thousand rows.
//! Inserts from arrays (the claim, tombstones) have no lookup to plan and stay cached.

mod support;

use idemq_core::{
    ClaimOutcome, ClaimRequest, CompleteOutcome, Completion, ConsumerGroup, DedupKey, DedupStore,
    ExtendOutcome, FencingToken,
};
use std::time::Duration;

/// Batches run on the small table: more than the five custom plans after which PostgreSQL
/// considers a generic one.
const ROUNDS: usize = 8;
const BATCH: usize = 10;

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_runs_no_key_array_lookup_on_a_generic_plan() {
    let Some(url) = support::postgres_url() else {
        return;
    };
    // One connection for everything (heartbeat included), so every statement the store
    // prepares is in that session's `pg_prepared_statements`.
    let mut opts = support::options(&support::unique("plans"), 1);
    opts.heartbeat_connections = 0;
    let store = idemq_sql::PgStore::connect(&url, opts)
        .await
        .expect("postgres store");
    let version: i64 =
        idemq_sql::sqlx::query_scalar("SELECT current_setting('server_version_num')::bigint")
            .fetch_one(store.pool())
            .await
            .expect("server version");
    // `pg_prepared_statements.generic_plans` is PostgreSQL 14+.
    if version < 140_000 {
        eprintln!("skipped: PostgreSQL {version} does not count generic plans");
        return;
    }

    let g = ConsumerGroup::new(&support::unique("plans")).expect("group");
    let lease = Duration::from_secs(120);
    for round in 0..ROUNDS {
        let keys: Vec<DedupKey> = (0..BATCH)
            .map(|i| DedupKey::new(&g, &format!("r{round}-{i}")).expect("key"))
            .collect();
        let reqs: Vec<ClaimRequest> = keys
            .iter()
            .map(|k| ClaimRequest::new(k.clone(), lease))
            .collect();
        let tokens: Vec<FencingToken> = store
            .claim_batch(&reqs)
            .await
            .expect("claim")
            .into_iter()
            .map(|o| match o {
                ClaimOutcome::Acquired(l) => l.token,
                other => panic!("a fresh key must be acquired: {other:?}"),
            })
            .collect();
        // Claimed again: nothing taken, every key read back.
        let again = store.claim_batch(&reqs).await.expect("claim again");
        assert!(again
            .iter()
            .all(|o| matches!(o, ClaimOutcome::InFlight { .. })));
        let leases: Vec<(DedupKey, FencingToken)> =
            keys.iter().cloned().zip(tokens.iter().copied()).collect();
        let extended = store.extend_batch(&leases, lease).await.expect("extend");
        assert!(extended
            .iter()
            .all(|o| matches!(o, ExtendOutcome::Extended { .. })));
        // One foreign token: its completion is fenced, which the store learns by a probe.
        let items: Vec<Completion> = keys
            .iter()
            .zip(&tokens)
            .enumerate()
            .map(|(i, (k, t))| Completion {
                key: k.clone(),
                token: if i == 0 { FencingToken(t.0 ^ 1) } else { *t },
                result: None,
                retention: Duration::from_secs(600),
            })
            .collect();
        let done = store.complete_batch(&items).await.expect("complete");
        assert_eq!(done[0], CompleteOutcome::Fenced);
        assert!(done[1..].iter().all(|d| *d == CompleteOutcome::Completed));
        // A read folds in-transaction completions (a lookup by a one-key array).
        assert!(store.get(&keys[1]).await.expect("get").is_some());
    }

    let generic: Vec<(String, i64)> = idemq_sql::sqlx::query_as(
        "SELECT statement, generic_plans FROM pg_prepared_statements \
         WHERE generic_plans > 0 AND parameter_types::text LIKE '%[]%' \
         AND statement NOT LIKE 'INSERT %'",
    )
    .fetch_all(store.pool())
    .await
    .expect("read pg_prepared_statements");
    for t in store.tables() {
        let _ = idemq_sql::sqlx::query(&format!("DROP TABLE IF EXISTS {t}"))
            .execute(store.pool())
            .await;
    }
    assert!(
        generic.is_empty(),
        "key-array lookups ran on a generic plan (planned once, for a small table): {generic:#?}"
    );
}
