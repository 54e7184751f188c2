//! Transactional (half) messages whose check-back consults the dedup store.
//!
//! [`TransactionalPublisher::send_in_transaction`] sends a half message (invisible to
//! consumers), runs the caller's local transaction (the business effect, recorded in the dedup
//! store under the message's dedup key, e.g. with the unique-index strategy), and commits or
//! rolls back the half message by its outcome. When that last step is lost (the producer
//! crashed after its local commit, or the outcome was [`LocalOutcome::Unknown`]), the broker
//! checks back after `transactionTimeout` (≥ 6 s here) and [`StoreCheckBack`] answers from
//! the store: completed → COMMIT, a live lease → UNKNOWN (asked again later), no record, an
//! expired lease or a released key → ROLLBACK.

use crate::client::{env, own_client};
use crate::fields::to_message;
use crate::publisher::{classify, confirmed};
use crate::RocketError;
use futures::future::BoxFuture;
use idemq_core::key::{ConsumerGroup, DedupKey};
use idemq_core::publish::{OutgoingMessage, PublishError, PublishReceipt, DEDUP_HEADER};
use idemq_core::store::{DedupStore, RecordStatus};
use rocketmq_client_rust::{LocalTransactionState, TransactionListener, TransactionMQProducer};
use rocketmq_model::common::message::message_ext::MessageExt;
use rocketmq_model::common::message::MessageTrait;
use std::any::Any;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// What the local transaction decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LocalOutcome {
    /// The effect is committed: deliver the message.
    Commit,
    /// The effect did not happen: drop the message.
    Rollback,
    /// Not known yet: the broker will check back (and the store answers).
    Unknown,
}

/// Answers the broker's check-back from the dedup store's record of the message's key.
pub struct StoreCheckBack {
    store: Arc<dyn DedupStore>,
    group: ConsumerGroup,
    timeout: Duration,
}

impl StoreCheckBack {
    /// Looks keys up in `store` under the consumer group `group` (the namespace the local
    /// transaction recorded them in).
    pub fn new(store: Arc<dyn DedupStore>, group: &str) -> Result<Self, RocketError> {
        let group = ConsumerGroup::new(group)
            .map_err(|e| RocketError::Config(format!("group {group}: {e}")))?;
        Ok(Self {
            store,
            group,
            timeout: Duration::from_secs(3),
        })
    }

    /// The state for a message, from the store (UNKNOWN when the store cannot answer).
    pub async fn state_of(&self, dedup_key: &str) -> LocalTransactionState {
        let key = match DedupKey::new(&self.group, dedup_key) {
            Ok(k) => k,
            Err(e) => {
                tracing::warn!(key = dedup_key, error = %e, "check-back: bad dedup key; rolling back");
                return LocalTransactionState::RollbackMessage;
            }
        };
        match self.store.get(&key).await {
            Ok(Some(r)) if r.status == RecordStatus::Completed => {
                LocalTransactionState::CommitMessage
            }
            Ok(Some(r)) if r.status == RecordStatus::InProgress && r.lease_until_ms > now_ms() => {
                LocalTransactionState::Unknown
            }
            Ok(_) => LocalTransactionState::RollbackMessage,
            Err(e) => {
                tracing::warn!(key = dedup_key, error = %e, "check-back: store unavailable; answering unknown");
                LocalTransactionState::Unknown
            }
        }
    }
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// Runs a future on the bridge runtime from a client blocking thread, bounded.
fn wait_on_bridge<T: Send + 'static>(
    fut: impl std::future::Future<Output = T> + Send + 'static,
    within: Duration,
) -> Option<T> {
    let env = env().ok()?;
    let (tx, rx) = std::sync::mpsc::channel();
    env.bridge.spawn(async move {
        let _ = tx.send(fut.await);
    });
    rx.recv_timeout(within).ok()
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
        _msg: &dyn MessageTrait,
        arg: Option<&(dyn Any + Send + Sync)>,
    ) -> LocalTransactionState {
        let Some(fut) = arg
            .and_then(|a| a.downcast_ref::<LocalTx>())
            .and_then(|m| m.lock().ok().and_then(|mut f| f.take()))
        else {
            return LocalTransactionState::Unknown;
        };
        match wait_on_bridge(fut, self.local_timeout) {
            Some(LocalOutcome::Commit) => LocalTransactionState::CommitMessage,
            Some(LocalOutcome::Rollback) => LocalTransactionState::RollbackMessage,
            Some(LocalOutcome::Unknown) | None => LocalTransactionState::Unknown,
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
        let state = wait_on_bridge(async move { check.state_of(&k).await }, timeout)
            .unwrap_or(LocalTransactionState::Unknown);
        tracing::info!(key = %key, ?state, "rocketmq transaction check-back answered from the store");
        state
    }
}

/// A transactional producer whose check-back answers from the dedup store.
pub struct TransactionalPublisher {
    producer: tokio::sync::Mutex<TransactionMQProducer>,
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
        let mut p = TransactionMQProducer::builder(env.client.clone())
            .client_config(own_client(name_server)?)
            .producer_group(group.to_string())
            .topics(topics)
            .transaction_listener(Listener {
                check: Arc::new(check),
                local_timeout: Duration::from_secs(30),
            })
            .build();
        p.start()
            .await
            .map_err(|e| RocketError::Client(format!("transactional producer {group}: {e}")))?;
        Ok(Self {
            producer: tokio::sync::Mutex::new(p),
        })
    }

    /// Sends `msg` as a half message, runs `local` (the business effect), and ends the
    /// transaction by its outcome. The message needs a dedup key: the check-back looks it up.
    pub async fn send_in_transaction<F>(
        &self,
        msg: OutgoingMessage,
        local: F,
    ) -> Result<(PublishReceipt, LocalOutcome), PublishError>
    where
        F: std::future::Future<Output = LocalOutcome> + Send + 'static,
    {
        if msg.dedup_key.is_none() {
            return Err(PublishError::Config(
                "a transactional message needs a dedup key: the check-back reads the store by it"
                    .into(),
            ));
        }
        let m = to_message(&msg)?;
        let arg: LocalTx = Mutex::new(Some(Box::pin(local)));
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
