//! Transactional (half) messages whose check-back consults the dedup store.
//!
//! [`TransactionalPublisher::send_in_transaction`] sends a half message (invisible to
//! consumers), runs the caller's local transaction (the business effect, recorded in the dedup
//! store under the message's dedup key: a claim of the key with a lease, and its completion
//! in the effect's transaction, e.g. `idemq_sql`'s `begin_for` … `commit`), and commits or
//! rolls back the half message by its outcome. The check-back reads that same record, so the
//! local transaction must record its key in the store the check-back is given: a key recorded
//! only elsewhere (a unique index's keys table, say) is unknown to the check-back, whose claim
//! would be granted and answer ROLLBACK while the effect stays. A store that claims keys in
//! the effect's transaction (the unique index) cannot answer a check-back at all (its claim
//! proves nothing) and is refused by [`StoreCheckBack::new`]. When that last step is lost (the producer
//! crashed after its local commit, or the outcome was [`LocalOutcome::Unknown`]), the broker
//! checks back and [`StoreCheckBack`] answers from the store.
//!
//! ROLLBACK drops the half message for good, so it is answered only once the local
//! transaction can no longer commit: the check-back *claims* the key, and only a claim the
//! store grants (no record, a released key, or an ended lease taken over — decided on the
//! store's clock) answers ROLLBACK. The takeover gives the key a new fencing token, so the old
//! holder's `complete` (and `complete_in_tx`, with its effect in the same transaction) answers
//! `Fenced`; the check-back then records the key **rolled back**
//! ([`DedupStore::roll_back`], kept for [`StoreCheckBack::with_rollback_retention`]), so a
//! local transaction that had not claimed its key yet — late, or in another process of the
//! producer group — is refused its claim ([`ClaimOutcome::RolledBack`]) instead of applying
//! an effect whose message was dropped. A new attempt of the operation needs a new key.
//! Completed → COMMIT; rolled back → ROLLBACK. A live lease, a local transaction still
//! running in this process, a store that cannot answer (or cannot record a roll-back) →
//! UNKNOWN (the broker asks again).
//!
//! The local transaction is bounded ([`LOCAL_TIMEOUT`]): past it the publisher answers UNKNOWN
//! and *cancels* the local future (it is dropped at its next await: an open database
//! transaction rolls back), so it cannot complete after the answer.
//!
//! The local transaction must claim its key before its effect and apply nothing when the
//! claim is not `Acquired` (a `RolledBack` answer means its message is gone: answer
//! [`LocalOutcome::Rollback`]). (`CHECK_IMMUNITY_TIME_IN_SECONDS` would delay the first
//! check-back, but in a run with it the rocketmq-rust 1.0 broker delivered a message
//! committed normally a second time, its re-queued half message checked back later.)

use crate::client::{env, own_client};
use crate::fields::to_message;
use crate::publisher::{classify, confirmed};
use crate::RocketError;
use cheetah_string::CheetahString;
use futures::future::BoxFuture;
use idemq_core::key::{ConsumerGroup, DedupKey};
use idemq_core::publish::{OutgoingMessage, PublishError, PublishReceipt, DEDUP_HEADER};
use idemq_core::store::{
    ClaimMode, ClaimOutcome, ClaimRequest, DedupStore, FencingToken, RecordStatus, RollbackOutcome,
};
use rocketmq_client_rust::{LocalTransactionState, TransactionListener, TransactionMQProducer};
use rocketmq_model::common::message::message_ext::MessageExt;
use rocketmq_model::common::message::MessageTrait;
use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long a local transaction may run before the publisher answers UNKNOWN and cancels it.
pub const LOCAL_TIMEOUT: Duration = Duration::from_secs(30);

/// The lease of the check-back's own claim (it records the key rolled back at once; the
/// lease only bounds a roll-back that failed).
const CHECK_LEASE: Duration = Duration::from_secs(30);

/// How long a rolled-back key refuses claims by default: a day, far past any local
/// transaction's bound and the broker's check-back schedule.
pub const DEFAULT_ROLLBACK_RETENTION: Duration = Duration::from_secs(24 * 3600);

/// What the local transaction decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LocalOutcome {
    /// The effect is committed: deliver the message.
    Commit,
    /// The effect did not happen: drop the message. Checked against the store first (an
    /// error may hide a COMMIT that landed): a completed key commits the message instead,
    /// and a key whose lease still lives leaves it to the check-back.
    Rollback,
    /// Not known yet: the broker will check back (and the store answers).
    Unknown,
}

/// Dedup keys whose local transaction is running in this process (its future not yet
/// dropped): a check-back for one of them answers UNKNOWN, whatever the store holds (the
/// transaction may not have claimed its key yet).
#[derive(Debug, Default)]
struct Running {
    keys: Mutex<HashMap<String, usize>>,
}

impl Running {
    fn enter(self: &Arc<Self>, key: &str) -> RunningGuard {
        *self
            .keys
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(key.to_string())
            .or_default() += 1;
        RunningGuard {
            running: self.clone(),
            key: key.to_string(),
        }
    }

    fn contains(&self, key: &str) -> bool {
        self.keys
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(key)
    }
}

/// Removes its key from [`Running`] when the local future holding it is dropped (finished
/// or cancelled).
struct RunningGuard {
    running: Arc<Running>,
    key: String,
}

impl Drop for RunningGuard {
    fn drop(&mut self) {
        let mut keys = self.running.keys.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = keys.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                keys.remove(&self.key);
            }
        }
    }
}

/// Answers the broker's check-back from the dedup store's record of the message's key.
pub struct StoreCheckBack {
    store: Arc<dyn DedupStore>,
    group: ConsumerGroup,
    timeout: Duration,
    rollback_retention: Duration,
    running: Arc<Running>,
}

impl StoreCheckBack {
    /// Looks keys up in `store` under the consumer group `group` (the namespace the local
    /// transaction recorded them in).
    pub fn new(store: Arc<dyn DedupStore>, group: &str) -> Result<Self, RocketError> {
        let group = ConsumerGroup::new(group)
            .map_err(|e| RocketError::Config(format!("group {group}: {e}")))?;
        if store.claim_mode() == ClaimMode::InEffectTransaction {
            return Err(RocketError::Config(
                "the check-back cannot answer from a store that claims keys in the effect's \
                 transaction (the unique index): its claim is granted without reading anything, \
                 so every check-back would roll back. Give it the store with leases that the \
                 local transaction records its key in"
                    .into(),
            ));
        }
        Ok(Self {
            store,
            group,
            timeout: Duration::from_secs(3),
            rollback_retention: DEFAULT_ROLLBACK_RETENTION,
            running: Arc::default(),
        })
    }

    /// How long a key this check-back rolled back refuses claims
    /// ([`DEFAULT_ROLLBACK_RETENTION`] unless set): longer than any local transaction of the
    /// key can start late. Past it the key is claimable afresh.
    pub fn with_rollback_retention(mut self, retention: Duration) -> Self {
        self.rollback_retention = retention;
        self
    }

    fn key(&self, dedup_key: &str) -> Result<DedupKey, String> {
        DedupKey::new(&self.group, dedup_key).map_err(|e| e.to_string())
    }

    /// The state for a message, from the store: COMMIT when its key is completed; ROLLBACK
    /// when it is recorded rolled back, or once the store granted this check-back a claim of
    /// the key (no record, released, or an ended lease taken over, which fences the old
    /// holder) and recorded the key rolled back under it; UNKNOWN for a live lease, a local
    /// transaction of the key still running in this process, or a store that cannot answer
    /// or cannot record the roll-back.
    pub async fn state_of(&self, dedup_key: &str) -> LocalTransactionState {
        let key = match self.key(dedup_key) {
            Ok(k) => k,
            Err(e) => {
                tracing::warn!(key = dedup_key, error = %e, "check-back: bad dedup key; unknown");
                return LocalTransactionState::Unknown;
            }
        };
        if self.running.contains(dedup_key) {
            return LocalTransactionState::Unknown;
        }
        let claim = ClaimRequest::new(key.clone(), CHECK_LEASE)
            .with_token(FencingToken::random())
            .with_worker("rocketmq-check-back");
        match self.store.claim(&claim).await {
            Ok(ClaimOutcome::Duplicate(_)) => LocalTransactionState::CommitMessage,
            Ok(ClaimOutcome::PayloadConflict(r)) if r.status == RecordStatus::Completed => {
                LocalTransactionState::CommitMessage
            }
            Ok(ClaimOutcome::InFlight { .. }) => match self.store.get(&key).await {
                // Completed in the local transaction through a fence table (PostgreSQL,
                // MySQL): the claim still sees the live lease, the read folds the completion
                // in. Without this the answer stayed UNKNOWN until the lease ended, which a
                // long lease can stretch past the broker's last check-back.
                Ok(Some(r)) if r.status == RecordStatus::Completed => {
                    LocalTransactionState::CommitMessage
                }
                _ => LocalTransactionState::Unknown,
            },
            Ok(ClaimOutcome::PayloadConflict(_)) => LocalTransactionState::Unknown,
            // Rolled back before (by another check-back, or this one whose answer was lost).
            Ok(ClaimOutcome::RolledBack(_)) => LocalTransactionState::RollbackMessage,
            Ok(ClaimOutcome::Acquired(lease)) => {
                // The key is ours now: whoever held it before is fenced. Record it rolled
                // back before answering: a local transaction that has not claimed it yet
                // must be refused, not apply the effect of a dropped message. Until that is
                // durable the answer is UNKNOWN (the broker asks again; the claim's lease
                // ends by itself).
                match self
                    .store
                    .roll_back(&key, lease.token, self.rollback_retention)
                    .await
                {
                    Ok(RollbackOutcome::RolledBack) => {}
                    Ok(RollbackOutcome::Fenced) => {
                        tracing::warn!(key = dedup_key, "check-back: the key was taken from the check-back's claim before its roll-back; unknown");
                        return LocalTransactionState::Unknown;
                    }
                    Err(e) => {
                        tracing::warn!(key = dedup_key, error = %e, "check-back: cannot record the key rolled back; unknown");
                        return LocalTransactionState::Unknown;
                    }
                }
                metrics::counter!("idemq_rocketmq_tx_check_rollbacks_total").increment(1);
                tracing::info!(
                    key = dedup_key,
                    takeover = lease.takeover,
                    attempt = lease.attempt,
                    "check-back: key fenced and recorded rolled back; rolling back"
                );
                LocalTransactionState::RollbackMessage
            }
            Err(e) => {
                tracing::warn!(key = dedup_key, error = %e, "check-back: store unavailable; answering unknown");
                LocalTransactionState::Unknown
            }
        }
    }
}

/// Runs a future on the bridge runtime from a client blocking thread, bounded; past the
/// bound the future is cancelled (dropped at its next await), never left running.
fn run_bounded<T: Send + 'static>(
    fut: impl std::future::Future<Output = T> + Send + 'static,
    within: Duration,
) -> Option<T> {
    let env = env().ok()?;
    let (tx, rx) = std::sync::mpsc::channel();
    let task = env.bridge.spawn(async move {
        let _ = tx.send(fut.await);
    });
    match rx.recv_timeout(within) {
        Ok(v) => Some(v),
        Err(_) => {
            task.abort();
            None
        }
    }
}

type LocalTx = Mutex<Option<BoxFuture<'static, LocalOutcome>>>;

struct Listener {
    check: Arc<StoreCheckBack>,
    local_timeout: Duration,
}

fn dedup_key_of(m: &MessageExt) -> Option<String> {
    m.properties().get(DEDUP_HEADER).map(|v| v.to_string())
}

impl TransactionListener for Listener {
    fn execute_local_transaction(
        &self,
        msg: &dyn MessageTrait,
        arg: Option<&(dyn Any + Send + Sync)>,
    ) -> LocalTransactionState {
        let Some(fut) = arg
            .and_then(|a| a.downcast_ref::<LocalTx>())
            .and_then(|m| m.lock().ok().and_then(|mut f| f.take()))
        else {
            return LocalTransactionState::Unknown;
        };
        match run_bounded(fut, self.local_timeout) {
            Some(LocalOutcome::Commit) => LocalTransactionState::CommitMessage,
            // A rollback drops the message for good, and a local transaction may answer it
            // after an error whose COMMIT had in fact landed (its reply lost): the store
            // decides, as for a check-back (COMMIT for a completed key, ROLLBACK only once its
            // claim fenced every holder, UNKNOWN while a lease lives: the broker asks again).
            Some(LocalOutcome::Rollback) => match msg
                .property(&CheetahString::from_static_str(DEDUP_HEADER))
                .map(|k| k.to_string())
            {
                Some(key) => {
                    let check = self.check.clone();
                    run_bounded(
                        async move { check.state_of(&key).await },
                        self.check.timeout,
                    )
                    .unwrap_or(LocalTransactionState::Unknown)
                }
                None => LocalTransactionState::RollbackMessage,
            },
            Some(LocalOutcome::Unknown) => LocalTransactionState::Unknown,
            None => {
                metrics::counter!("idemq_rocketmq_tx_local_timeouts_total").increment(1);
                tracing::warn!(timeout = ?self.local_timeout, "local transaction timed out; cancelled, answering unknown");
                LocalTransactionState::Unknown
            }
        }
    }

    fn check_local_transaction(&self, msg: &MessageExt) -> LocalTransactionState {
        metrics::counter!("idemq_rocketmq_tx_checks_total").increment(1);
        let Some(key) = dedup_key_of(msg) else {
            tracing::warn!(msg_id = %msg.msg_id(), "check-back: half message without a dedup key; unknown");
            return LocalTransactionState::Unknown;
        };
        let check = self.check.clone();
        let timeout = check.timeout;
        let k = key.clone();
        let state = run_bounded(async move { check.state_of(&k).await }, timeout)
            .unwrap_or(LocalTransactionState::Unknown);
        tracing::info!(key = %key, ?state, "rocketmq transaction check-back answered from the store");
        state
    }
}

/// The local transaction of `key` as the listener runs it: registered as running here until
/// the future is dropped (finished or cancelled).
fn local_tx<F>(running: &Arc<Running>, key: &str, local: F) -> LocalTx
where
    F: std::future::Future<Output = LocalOutcome> + Send + 'static,
{
    let guard = running.enter(key);
    Mutex::new(Some(Box::pin(async move {
        let _running = guard;
        local.await
    })))
}

/// A transactional producer whose check-back answers from the dedup store.
pub struct TransactionalPublisher {
    producer: tokio::sync::Mutex<TransactionMQProducer>,
    check: Arc<StoreCheckBack>,
}

impl TransactionalPublisher {
    /// Starts a transactional producer of `group` for `topics`.
    pub async fn connect(
        name_server: &str,
        group: &str,
        topics: Vec<String>,
        check: StoreCheckBack,
    ) -> Result<Self, RocketError> {
        let env = env()?;
        let check = Arc::new(check);
        let mut p = TransactionMQProducer::builder(env.client.clone())
            .client_config(own_client(name_server)?)
            .producer_group(group.to_string())
            .topics(topics)
            .transaction_listener(Listener {
                check: check.clone(),
                local_timeout: LOCAL_TIMEOUT,
            })
            .build();
        p.start()
            .await
            .map_err(|e| RocketError::Client(format!("transactional producer {group}: {e}")))?;
        Ok(Self {
            producer: tokio::sync::Mutex::new(p),
            check,
        })
    }

    /// Sends `msg` as a half message, runs `local` (the business effect), and ends the
    /// transaction by its outcome. The message needs a dedup key: the check-back looks it up.
    ///
    /// `local` runs at most [`LOCAL_TIMEOUT`]: past it the outcome is
    /// [`LocalOutcome::Unknown`] and `local` is cancelled (dropped at its next await), so
    /// write its effect and complete its key in one store transaction (`complete_in_tx`),
    /// which then rolls back. Claim the key first thing: the check-back rolls back a key
    /// nobody holds.
    pub async fn send_in_transaction<F>(
        &self,
        msg: OutgoingMessage,
        local: F,
    ) -> Result<(PublishReceipt, LocalOutcome), PublishError>
    where
        F: std::future::Future<Output = LocalOutcome> + Send + 'static,
    {
        let Some(dedup_key) = msg.dedup_key.clone() else {
            return Err(PublishError::Config(
                "a transactional message needs a dedup key: the check-back reads the store by it"
                    .into(),
            ));
        };
        self.check.key(&dedup_key).map_err(|e| {
            PublishError::Config(format!(
                "dedup key `{dedup_key}` of a transactional message: {e}"
            ))
        })?;
        let m = to_message(&msg)?;
        let arg = local_tx(&self.check.running, &dedup_key, local);
        let r = self
            .producer
            .lock()
            .await
            .send_message_in_transaction(m, Some(arg))
            .await
            .map_err(|e| classify(&msg.destination, e))?;
        let outcome = match r.local_transaction_state {
            Some(LocalTransactionState::CommitMessage) => LocalOutcome::Commit,
            Some(LocalTransactionState::RollbackMessage) => LocalOutcome::Rollback,
            _ => LocalOutcome::Unknown,
        };
        let receipt = confirmed(&msg.destination, r.send_result)?;
        Ok((receipt, outcome))
    }

    /// Stops the producer (a pending check-back is then answered by another member of the
    /// producer group, or after a restart).
    pub async fn shutdown(&self) {
        self.producer.lock().await.shutdown().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cheetah_string::CheetahString;
    use idemq_core::store::CompleteOutcome;
    use idemq_core::MemoryStore;
    use rocketmq_model::common::message::message_single::Message;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Instant;

    const GROUP: &str = "orders";

    /// A store that claims in the effect's transaction (as the unique index does): every
    /// claim is granted without reading anything.
    struct ClaimsInTransaction(MemoryStore);

    #[async_trait::async_trait]
    impl DedupStore for ClaimsInTransaction {
        fn claim_mode(&self) -> ClaimMode {
            ClaimMode::InEffectTransaction
        }
        async fn claim_batch(
            &self,
            reqs: &[ClaimRequest],
        ) -> Result<Vec<ClaimOutcome>, idemq_core::StoreError> {
            self.0.claim_batch(reqs).await
        }
        async fn complete_batch(
            &self,
            items: &[idemq_core::Completion],
        ) -> Result<Vec<CompleteOutcome>, idemq_core::StoreError> {
            self.0.complete_batch(items).await
        }
        async fn release(
            &self,
            key: &DedupKey,
            token: FencingToken,
        ) -> Result<idemq_core::ReleaseOutcome, idemq_core::StoreError> {
            self.0.release(key, token).await
        }
        async fn extend(
            &self,
            key: &DedupKey,
            token: FencingToken,
            lease: Duration,
        ) -> Result<idemq_core::ExtendOutcome, idemq_core::StoreError> {
            self.0.extend(key, token, lease).await
        }
        async fn get(
            &self,
            key: &DedupKey,
        ) -> Result<Option<idemq_core::DedupRecord>, idemq_core::StoreError> {
            self.0.get(key).await
        }
        async fn purge_expired(&self, limit: usize) -> Result<u64, idemq_core::StoreError> {
            self.0.purge_expired(limit).await
        }
        async fn list_stuck(
            &self,
            stale_for: Duration,
            limit: usize,
        ) -> Result<Vec<idemq_core::DedupRecord>, idemq_core::StoreError> {
            self.0.list_stuck(stale_for, limit).await
        }
        async fn forget(&self, key: &DedupKey) -> Result<bool, idemq_core::StoreError> {
            self.0.forget(key).await
        }
    }

    /// Its claim proves nothing, so every check-back would answer ROLLBACK, dropping the
    /// messages of committed local transactions: refused when the check-back is made.
    #[test]
    fn a_store_that_claims_in_the_effects_transaction_is_refused() {
        let refused = StoreCheckBack::new(Arc::new(ClaimsInTransaction(MemoryStore::new())), GROUP);
        match refused {
            Err(RocketError::Config(why)) => assert!(why.contains("unique index"), "{why}"),
            Err(e) => panic!("expected a configuration error, got {e}"),
            Ok(_) => panic!("a check-back over a store that claims in the effect's transaction"),
        }
        assert!(StoreCheckBack::new(Arc::new(MemoryStore::new()), GROUP).is_ok());
    }

    fn key(k: &str) -> DedupKey {
        DedupKey::new(&ConsumerGroup::new(GROUP).expect("group"), k).expect("key")
    }

    fn half_message() -> Message {
        Message::builder()
            .topic("orders")
            .body_slice(b"{}")
            .build()
            .expect("message")
    }

    fn checked_back(k: &str) -> MessageExt {
        let mut m = MessageExt::default();
        m.put_property(
            CheetahString::from_static_str(DEDUP_HEADER),
            CheetahString::from_string(k.to_string()),
        );
        m
    }

    /// Sets its flag when dropped: the future holding it is gone.
    struct DropFlag(Arc<AtomicBool>);

    impl Drop for DropFlag {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    fn wait_for(what: &str, within: Duration, done: impl Fn() -> bool) {
        let deadline = Instant::now() + within;
        while !done() {
            assert!(Instant::now() < deadline, "{what} within {within:?}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// A local transaction that outlives the publisher's bound is cancelled when the publisher
    /// answers UNKNOWN: woken afterwards, it never completes its key.
    #[test]
    fn a_local_transaction_past_its_bound_is_cancelled_and_never_completes() {
        let store: Arc<dyn DedupStore> = Arc::new(MemoryStore::new());
        let check = Arc::new(StoreCheckBack::new(store.clone(), GROUP).expect("check-back"));
        let listener = Listener {
            check: check.clone(),
            local_timeout: Duration::from_millis(300),
        };
        let (go, wake) = tokio::sync::oneshot::channel::<()>();
        let completed: Arc<Mutex<Option<CompleteOutcome>>> = Arc::default();
        let dropped = Arc::new(AtomicBool::new(false));
        let (db, done, flag) = (store.clone(), completed.clone(), dropped.clone());
        let local = async move {
            let _flag = DropFlag(flag);
            let k = key("order-slow");
            let lease = match db.claim(&ClaimRequest::new(k.clone(), CHECK_LEASE)).await {
                Ok(ClaimOutcome::Acquired(l)) => l,
                other => panic!("claim: {other:?}"),
            };
            let _ = wake.await;
            let c = db
                .complete(&k, lease.token, None, Duration::from_secs(3600))
                .await;
            *done.lock().unwrap_or_else(|e| e.into_inner()) = c.ok();
            LocalOutcome::Commit
        };
        let arg = local_tx(&check.running, "order-slow", local);
        let state = listener.execute_local_transaction(&half_message(), Some(&arg));
        assert_eq!(state, LocalTransactionState::Unknown, "past its bound");
        // The slow transaction would wake up now.
        let _ = go.send(());
        wait_for(
            "the local future is dropped",
            Duration::from_secs(20),
            || dropped.load(Ordering::SeqCst),
        );
        let late = *completed.lock().unwrap_or_else(|e| e.into_inner());
        assert_eq!(
            late, None,
            "the local transaction abandoned at its bound ran on after the publisher answered \
             UNKNOWN and completed its key"
        );
        assert!(
            !check.running.contains("order-slow"),
            "a cancelled local transaction no longer counts as running"
        );
    }

    /// A local transaction that answers Rollback is checked against the store: one whose
    /// COMMIT landed though it saw an error (its effect and completion are in) is committed,
    /// not dropped; one that released its key is rolled back; one whose lease still lives
    /// is unknown (the broker checks back).
    #[test]
    fn a_rollback_answer_is_checked_against_the_store() {
        let store: Arc<dyn DedupStore> = Arc::new(MemoryStore::new());
        let check = Arc::new(StoreCheckBack::new(store.clone(), GROUP).expect("check-back"));
        let listener = Listener {
            check: check.clone(),
            local_timeout: Duration::from_secs(30),
        };
        let keyed = |k: &str| {
            let mut m = half_message();
            m.put_property(
                CheetahString::from_static_str(DEDUP_HEADER),
                CheetahString::from_string(k.to_string()),
            );
            m
        };
        let cases = [
            ("order-landed", LocalTransactionState::CommitMessage),
            ("order-released", LocalTransactionState::RollbackMessage),
            ("order-held", LocalTransactionState::Unknown),
        ];
        for (name, want) in cases {
            let db = store.clone();
            let local = async move {
                let k = key(name);
                let Ok(ClaimOutcome::Acquired(lease)) =
                    db.claim(&ClaimRequest::new(k.clone(), CHECK_LEASE)).await
                else {
                    return LocalOutcome::Unknown;
                };
                match name {
                    // Committed; the reply was lost and the code mapped the error to Rollback.
                    "order-landed" => {
                        let _ = db.complete(&k, lease.token, None, CHECK_LEASE).await;
                    }
                    "order-released" => {
                        let _ = db.release(&k, lease.token).await;
                    }
                    _ => {}
                }
                LocalOutcome::Rollback
            };
            let arg = local_tx(&check.running, name, local);
            let state = listener.execute_local_transaction(&keyed(name), Some(&arg));
            assert_eq!(state, want, "{name}");
        }
    }

    /// A check-back that finds no record (the local transaction runs in another process of
    /// the producer group and has not claimed its key yet) answers ROLLBACK and records the
    /// key rolled back: the late local transaction's claim is refused, so it applies no
    /// effect for the dropped message. Asked again, the check-back answers ROLLBACK from the
    /// record (its first answer may have been lost), and a stale claim of the check-back's
    /// own cannot commit it.
    #[test]
    fn a_late_claim_after_a_rollback_is_refused() {
        let store: Arc<dyn DedupStore> = Arc::new(MemoryStore::new());
        let check = Arc::new(StoreCheckBack::new(store.clone(), GROUP).expect("check-back"));
        let listener = Listener {
            check: check.clone(),
            local_timeout: Duration::from_secs(30),
        };
        let answer = listener.check_local_transaction(&checked_back("order-elsewhere"));
        assert_eq!(answer, LocalTransactionState::RollbackMessage);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let late =
            rt.block_on(store.claim(&ClaimRequest::new(key("order-elsewhere"), CHECK_LEASE)));
        match late {
            Ok(ClaimOutcome::RolledBack(rec)) => {
                assert_eq!(rec.status, RecordStatus::RolledBack);
                assert_eq!(rec.worker.as_deref(), Some("rocketmq-check-back"));
            }
            other => panic!(
                "the late local transaction's claim after the check-back rolled its message \
                 back must be refused, got {other:?}: its effect would apply with no message"
            ),
        }
        assert_eq!(
            listener.check_local_transaction(&checked_back("order-elsewhere")),
            LocalTransactionState::RollbackMessage,
            "asked again"
        );
        let rec = rt
            .block_on(store.get(&key("order-elsewhere")))
            .expect("get")
            .expect("the rolled-back record");
        let retained = rec.expires_ms.unwrap_or(0) - rec.completed_ms.unwrap_or(0);
        assert_eq!(
            retained,
            idemq_core::store::duration_ms(DEFAULT_ROLLBACK_RETENTION),
            "kept for the check-back's retention"
        );
    }

    /// A check-back that arrives while the local transaction runs in this process (it has
    /// not even claimed its key yet) answers UNKNOWN: that transaction may still commit.
    #[test]
    fn a_check_back_while_the_local_transaction_runs_here_answers_unknown() {
        let store: Arc<dyn DedupStore> = Arc::new(MemoryStore::new());
        let check = Arc::new(StoreCheckBack::new(store.clone(), GROUP).expect("check-back"));
        let listener = Arc::new(Listener {
            check: check.clone(),
            local_timeout: Duration::from_secs(30),
        });
        let (go, wake) = tokio::sync::oneshot::channel::<()>();
        let started = Arc::new(AtomicBool::new(false));
        let (db, began) = (store.clone(), started.clone());
        let local = async move {
            began.store(true, Ordering::SeqCst);
            let _ = wake.await;
            let k = key("order-late");
            let lease = match db.claim(&ClaimRequest::new(k.clone(), CHECK_LEASE)).await {
                Ok(ClaimOutcome::Acquired(l)) => l,
                other => panic!("claim after the check-back: {other:?}"),
            };
            match db
                .complete(&k, lease.token, None, Duration::from_secs(3600))
                .await
            {
                Ok(CompleteOutcome::Completed) => LocalOutcome::Commit,
                _ => LocalOutcome::Unknown,
            }
        };
        let arg = local_tx(&check.running, "order-late", local);
        let runner = listener.clone();
        let local_run = std::thread::spawn(move || {
            runner.execute_local_transaction(&half_message(), Some(&arg))
        });
        wait_for(
            "the local transaction starts",
            Duration::from_secs(20),
            || started.load(Ordering::SeqCst),
        );
        let answer = listener.check_local_transaction(&checked_back("order-late"));
        let _ = go.send(());
        let outcome = local_run.join().expect("listener thread");
        assert!(
            !(answer == LocalTransactionState::RollbackMessage
                && outcome == LocalTransactionState::CommitMessage),
            "the check-back answered {answer:?} while the local transaction ran here, which then \
             committed ({outcome:?}): effect applied, message never delivered"
        );
        assert_eq!(answer, LocalTransactionState::Unknown);
        assert_eq!(outcome, LocalTransactionState::CommitMessage);
        assert_eq!(
            listener.check_local_transaction(&checked_back("order-late")),
            LocalTransactionState::CommitMessage,
            "asked again once it committed"
        );
    }
}
