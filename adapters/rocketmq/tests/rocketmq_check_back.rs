#![recursion_limit = "512"]
//! The transactional check-back's decision, without a broker: `StoreCheckBack::state_of`
//! called directly against the memory store and PostgreSQL, the way the broker's check-back
//! calls it.
//!
//! The rule under test: ROLLBACK drops the half message for good, so it may be answered only
//! once the local transaction can no longer commit — the store itself has taken the key over
//! (on its own clock), which fences the old holder's completion. A live lease, a store that
//! cannot answer, anything uncertain is UNKNOWN (the broker asks again).

mod support;

use async_trait::async_trait;
use idemq_core::store::{
    set_test_clock_skew_ms, ClaimOutcome, ClaimRequest, CompleteOutcome, Completion, DedupRecord,
    DedupStore, ExtendOutcome, Lease, ReleaseOutcome, StoreError,
};
use idemq_core::{ConsumerGroup, DedupKey, MemoryStore};
use idemq_rocketmq::rocketmq_client_rust::LocalTransactionState;
use idemq_rocketmq::StoreCheckBack;
use idemq_sql::{sqlx, PgStore, SqlStoreOptions};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// The clock-skew test moves this process's test clock, and the memory store keeps its leases on
/// that clock: the tests of this file run one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const RETENTION: Duration = Duration::from_secs(3600);

fn key(group: &str, k: &str) -> DedupKey {
    DedupKey::new(&ConsumerGroup::new(group).expect("group"), k).expect("key")
}

/// The local transaction's claim.
async fn acquire(store: &dyn DedupStore, key: &DedupKey, lease: Duration) -> Lease {
    match store.claim(&ClaimRequest::new(key.clone(), lease)).await {
        Ok(ClaimOutcome::Acquired(l)) => l,
        other => panic!("the local transaction's claim of {key}: {other:?}"),
    }
}

/// Waits (bounded) until the store's record of `key` shows its lease ended at `now()`, a
/// reading of the store's clock.
async fn until_lease_ended<F, Fut>(store: &dyn DedupStore, key: &DedupKey, now: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = i64>,
{
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let rec = store.get(key).await.expect("get").expect("record");
        if rec.is_lease_expired(now().await) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the lease of {key} did not end within 30 s: {rec:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Resets the process clock's skew when dropped (also when the test fails).
struct Skew;

impl Skew {
    fn by(ms: i64) -> Self {
        set_test_clock_skew_ms(ms);
        Self
    }
}

impl Drop for Skew {
    fn drop(&mut self) {
        set_test_clock_skew_ms(0);
    }
}

/// A store that cannot be reached.
struct Down;

fn down() -> StoreError {
    StoreError::Unavailable("test: the store is down".into())
}

#[async_trait]
impl DedupStore for Down {
    async fn claim_batch(&self, _: &[ClaimRequest]) -> Result<Vec<ClaimOutcome>, StoreError> {
        Err(down())
    }
    async fn complete_batch(&self, _: &[Completion]) -> Result<Vec<CompleteOutcome>, StoreError> {
        Err(down())
    }
    async fn release(
        &self,
        _: &DedupKey,
        _: idemq_core::store::FencingToken,
    ) -> Result<ReleaseOutcome, StoreError> {
        Err(down())
    }
    async fn extend(
        &self,
        _: &DedupKey,
        _: idemq_core::store::FencingToken,
        _: Duration,
    ) -> Result<ExtendOutcome, StoreError> {
        Err(down())
    }
    async fn get(&self, _: &DedupKey) -> Result<Option<DedupRecord>, StoreError> {
        Err(down())
    }
    async fn purge_expired(&self, _: usize) -> Result<u64, StoreError> {
        Err(down())
    }
    async fn list_stuck(&self, _: Duration, _: usize) -> Result<Vec<DedupRecord>, StoreError> {
        Err(down())
    }
    async fn forget(&self, _: &DedupKey) -> Result<bool, StoreError> {
        Err(down())
    }
}

/// A slow local transaction: it claimed its key, then stalled past its lease. The check-back
/// asked meanwhile may roll the half message back only if that makes the slow transaction's
/// completion impossible; the completion then answers `Fenced`.
#[tokio::test]
async fn a_check_back_after_the_lease_ended_fences_the_slow_local_transaction() {
    let _serial = SERIAL.lock().await;
    let group = support::unique("orders");
    let store: Arc<dyn DedupStore> = Arc::new(MemoryStore::new());
    let check = StoreCheckBack::new(store.clone(), &group).expect("check-back");
    let k = key(&group, "order-slow");
    let lease = acquire(&*store, &k, Duration::from_millis(300)).await;
    until_lease_ended(&*store, &k, || async { idemq_core::store::now_ms() }).await;

    let answer = check.state_of("order-slow").await;
    // The slow local transaction wakes up and completes its key.
    let late = store
        .complete(&k, lease.token, None, RETENTION)
        .await
        .expect("complete");
    assert!(
        !(answer == LocalTransactionState::RollbackMessage && late == CompleteOutcome::Completed),
        "the check-back answered {answer:?} for an ended lease it had only read, and the slow \
         local transaction then completed ({late:?}): its effect is applied while the broker \
         dropped the half message (never delivered)"
    );
    assert_eq!(
        answer,
        LocalTransactionState::RollbackMessage,
        "an ended lease, once fenced, is rolled back"
    );
    assert_eq!(late, CompleteOutcome::Fenced, "the old holder is fenced");
    // Asked again (a second check-back): still rollback, never commit.
    assert_eq!(
        check.state_of("order-slow").await,
        LocalTransactionState::RollbackMessage
    );
}

/// What each record state answers: completed → COMMIT; a live lease → UNKNOWN (and the
/// holder can still complete, after which COMMIT); no record, a released key → ROLLBACK; a
/// store that cannot answer → UNKNOWN.
#[tokio::test]
async fn check_back_answers_from_the_record_and_never_guesses() {
    let _serial = SERIAL.lock().await;
    let group = support::unique("orders");
    let store: Arc<dyn DedupStore> = Arc::new(MemoryStore::new());
    let check = StoreCheckBack::new(store.clone(), &group).expect("check-back");

    let done = key(&group, "order-done");
    let l = acquire(&*store, &done, Duration::from_secs(30)).await;
    store
        .complete(&done, l.token, None, RETENTION)
        .await
        .expect("complete");
    assert_eq!(
        check.state_of("order-done").await,
        LocalTransactionState::CommitMessage,
        "completed"
    );

    let live = key(&group, "order-live");
    let l = acquire(&*store, &live, Duration::from_secs(30)).await;
    assert_eq!(
        check.state_of("order-live").await,
        LocalTransactionState::Unknown,
        "a live lease: the local transaction may still commit"
    );
    assert_eq!(
        store
            .complete(&live, l.token, None, RETENTION)
            .await
            .expect("complete"),
        CompleteOutcome::Completed,
        "the check-back left the live holder alone"
    );
    assert_eq!(
        check.state_of("order-live").await,
        LocalTransactionState::CommitMessage
    );

    let released = key(&group, "order-released");
    let l = acquire(&*store, &released, Duration::from_secs(30)).await;
    store.release(&released, l.token).await.expect("release");
    assert_eq!(
        check.state_of("order-released").await,
        LocalTransactionState::RollbackMessage,
        "released: the local transaction gave up"
    );
    assert_eq!(
        check.state_of("order-never-claimed").await,
        LocalTransactionState::RollbackMessage,
        "no record"
    );

    let unreachable = StoreCheckBack::new(Arc::new(Down), &group).expect("check-back");
    assert_eq!(
        unreachable.state_of("order-done").await,
        LocalTransactionState::Unknown,
        "a store that cannot answer"
    );
}

async fn pg() -> Option<PgStore> {
    let url = support::postgres_url()?;
    Some(
        PgStore::connect(&url, SqlStoreOptions::default())
            .await
            .unwrap_or_else(|e| panic!("PostgreSQL store at {url}: {e}")),
    )
}

/// PostgreSQL's clock, in ms since the epoch: the store decides leases on it.
async fn db_now_ms(store: &PgStore) -> i64 {
    let (now,): (i64,) =
        sqlx::query_as("SELECT (extract(epoch from clock_timestamp()) * 1000)::bigint")
            .fetch_one(store.pool())
            .await
            .expect("database clock");
    now
}

async fn execute(store: &PgStore, sql: &str) {
    sqlx::query(sql)
        .execute(store.pool())
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// A slow local transaction on PostgreSQL that writes its effect and completes its key in one
/// database transaction (`complete_in_tx`): when the check-back answers ROLLBACK after its
/// lease ended, its completion is fenced and the effect rolls back with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_a_rolled_back_local_transaction_keeps_no_effect() {
    let _serial = SERIAL.lock().await;
    let Some(store) = pg().await else { return };
    let group = support::unique("orders");
    let orders = support::unique("orders");
    execute(
        &store,
        &format!("CREATE TABLE {orders} (order_id TEXT NOT NULL)"),
    )
    .await;
    let check = StoreCheckBack::new(Arc::new(store.clone()), &group).expect("check-back");
    let k = key(&group, "order-slow");

    // The local transaction: claim (a short lease), begin, write the order, then stall.
    let lease = acquire(&store, &k, Duration::from_millis(500)).await;
    let mut tx = store.pool().begin().await.expect("begin");
    sqlx::query(&format!("INSERT INTO {orders} (order_id) VALUES ($1)"))
        .bind("order-slow")
        .execute(&mut *tx)
        .await
        .expect("order row");
    let db = store.clone();
    until_lease_ended(&store, &k, || db_now_ms(&db)).await;

    let answer = check.state_of("order-slow").await;
    // The local transaction wakes up, completes its key in its transaction, and commits
    // only if that completion held.
    let done = store
        .complete_in_tx(&mut *tx, &k, lease.token, None, RETENTION)
        .await
        .expect("complete_in_tx");
    if done == CompleteOutcome::Completed {
        tx.commit().await.expect("commit");
    } else {
        tx.rollback().await.expect("rollback");
    }
    let (rows,): (i64,) = sqlx::query_as(&format!("SELECT count(*) FROM {orders}"))
        .fetch_one(store.pool())
        .await
        .expect("count");
    execute(&store, &format!("DROP TABLE {orders}")).await;
    assert!(
        !(answer == LocalTransactionState::RollbackMessage && rows > 0),
        "the check-back answered {answer:?}, then the slow local transaction completed \
         ({done:?}) and committed its order: effect applied, message never delivered"
    );
    assert_eq!(answer, LocalTransactionState::RollbackMessage);
    assert_eq!(done, CompleteOutcome::Fenced);
    assert_eq!(rows, 0, "the fenced transaction's order was rolled back");
}

/// A store whose clock runs an hour behind the producer's (the memory store keeps its leases
/// on this process's test clock, skewed here; the producer reads the real one): a lease live
/// on the store's clock is not taken for ended. The check-back answers UNKNOWN, the local
/// transaction completes, and the next check-back commits.
#[tokio::test]
async fn a_store_clock_behind_the_producer_does_not_roll_back_a_live_lease() {
    let _serial = SERIAL.lock().await;
    let _skew = Skew::by(-3_600_000);
    let group = support::unique("orders");
    let store: Arc<dyn DedupStore> = Arc::new(MemoryStore::new());
    let check = StoreCheckBack::new(store.clone(), &group).expect("check-back");
    let k = key(&group, "order-live");
    let lease = acquire(&*store, &k, Duration::from_secs(60)).await;

    let answer = check.state_of("order-live").await;
    let done = store
        .complete(&k, lease.token, None, RETENTION)
        .await
        .expect("complete");
    assert_ne!(
        answer,
        LocalTransactionState::RollbackMessage,
        "a lease live on the store's clock was rolled back by the producer's clock, and the \
         local transaction then completed ({done:?}): effect applied, message never delivered"
    );
    assert_eq!(answer, LocalTransactionState::Unknown);
    assert_eq!(done, CompleteOutcome::Completed);
    assert_eq!(
        check.state_of("order-live").await,
        LocalTransactionState::CommitMessage
    );
}

/// A local transaction that completed its key in its own transaction (PostgreSQL's fence
/// table) and committed, whose end-of-transaction was lost: its lease is still live, and the
/// check-back commits at once instead of answering UNKNOWN until the lease ends (a long lease
/// could outlast the broker's check-backs, which then drop the message).
#[tokio::test]
async fn on_postgres_a_completion_in_the_local_transaction_commits_before_its_lease_ends() {
    let _serial = SERIAL.lock().await;
    let Some(store) = pg().await else { return };
    let group = support::unique("orders");
    let check = StoreCheckBack::new(Arc::new(store.clone()), &group).expect("check-back");
    let k = key(&group, "order-done");
    let lease = acquire(&store, &k, Duration::from_secs(600)).await;
    let mut tx = store.pool().begin().await.expect("begin");
    let done = store
        .complete_in_tx(&mut *tx, &k, lease.token, None, RETENTION)
        .await
        .expect("complete_in_tx");
    assert_eq!(done, CompleteOutcome::Completed);
    tx.commit().await.expect("commit");
    assert_eq!(
        check.state_of("order-done").await,
        LocalTransactionState::CommitMessage,
        "a key completed in the local transaction commits while its lease is live"
    );
}
