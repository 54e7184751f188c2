//! A batch's effect rows and its dedup records in one transaction.
//!
//! [`SqlStore::batch_handler`] makes the handler a consumer of effect rows wants: the
//! engine hands it the claimed messages of a polled batch, it opens one transaction, lets
//! the closure write every effect (one multi-row statement, as a hand-written consumer
//! would), records the keys in the same transaction, and commits. What it records depends
//! on the store the consumer was given:
//!
//! - [`SqlStore::unique_index`] (the unique-index strategy): the keys are inserted into the
//!   keys table first (one statement); only messages whose key was new reach the closure,
//!   the others are acked as duplicates. One key row and the effect per message.
//! - the [`SqlStore`] itself (dedup table with leases): the closure writes every claimed
//!   message's effect, then the leases are completed in the same transaction, fenced: if
//!   any lease was lost the transaction is rolled back and the engine runs the batch's
//!   messages one by one. If a lease was completed already — an earlier transaction of
//!   the same claims committed, but its COMMIT reply was lost and the engine reruns the
//!   messages — the transaction is rolled back too and those messages are settled as
//!   done, so their effects are not written twice. For consumers whose other effects
//!   need the lease.
//!
//! Either way the engine acks after the commit and makes no completion round trip of its
//! own. A failing call is rolled back whole; the engine then runs each message alone, so
//! only the one at fault is retried or dead-lettered.
//!
//! **Hot rows.** Batches that update the same rows (many payments, few accounts) would lock
//! them in different orders and deadlock, which the database detects only after its
//! deadlock timeout (a second on PostgreSQL) and answers by aborting one of them. So a
//! [`SqlStore::batch_handler`] runs one transaction at a time: a consumer's pipelined
//! batches overlap their polling, claims and acks, never their transactions. A
//! [`SqlStore::keyed_batch_handler`] only inserts rows of the batch's own keys: it gets the
//! messages sorted by key, so overlapping batches lock in one order, and its transactions
//! overlap. Deadlocks and serialization failures
//! against other processes are retried with back-off (logged at warn, counted in
//! `idemq_transaction_retries_total`) before the batch is failed.

use crate::backend::{error_class, ErrorClass, SqlBackend};
use crate::claimed::PooledTx;
use crate::errors::handler_error;
use crate::store::SqlStore;
use crate::unique::InsertSql;
use async_trait::async_trait;
use idemq_core::handler::{BatchHandler, Batched};
use idemq_core::metrics as m;
use idemq_core::{
    ClaimMode, ClaimedMessage, CompleteOutcome, Completion, DedupKey, HandlerError, LeaseLost,
    RetryPolicy, StoreError,
};
use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

/// The future a [`SqlStore::batch_handler`] closure returns (it borrows the transaction and
/// the messages).
pub type TxFuture<'a> = Pin<Box<dyn Future<Output = Result<(), HandlerError>> + Send + 'a>>;

/// The future a [`SqlStore::keyed_batch_handler`] closure returns: the keys
/// (`msg.key.as_str()`) of the effect rows it wrote.
pub type KeyedTxFuture<'a> =
    Pin<Box<dyn Future<Output = Result<Vec<String>, HandlerError>> + Send + 'a>>;

/// The future [`WriteEffects::write`] returns: `Some(keys written)` for keyed effects.
pub type WriteFuture<'a> =
    Pin<Box<dyn Future<Output = Result<Option<HashSet<String>>, HandlerError>> + Send + 'a>>;

/// How a [`TxBatchHandler`] writes effects: a closure of [`SqlStore::batch_handler`] or of
/// [`SqlStore::keyed_batch_handler`].
pub trait WriteEffects<DB: SqlBackend>: Send + Sync + 'static {
    /// Writes the effects of `msgs` through `tx`; `Some(keys)` when the effect rows carry
    /// the keys (those written are the new ones).
    fn write<'a>(
        &'a self,
        tx: &'a mut DB::Connection,
        msgs: &'a [ClaimedMessage],
    ) -> WriteFuture<'a>;

    /// Whether the effect rows carry the keys (no keys-table insert needed).
    fn keyed(&self) -> bool;
}

/// The closure of [`SqlStore::batch_handler`].
pub struct Rows<F>(F);

impl<DB, F> WriteEffects<DB> for Rows<F>
where
    DB: SqlBackend,
    F: for<'a> Fn(&'a mut DB::Connection, &'a [ClaimedMessage]) -> TxFuture<'a>
        + Send
        + Sync
        + 'static,
{
    fn write<'a>(
        &'a self,
        tx: &'a mut DB::Connection,
        msgs: &'a [ClaimedMessage],
    ) -> WriteFuture<'a> {
        let fut = (self.0)(tx, msgs);
        Box::pin(async move { fut.await.map(|()| None) })
    }
    fn keyed(&self) -> bool {
        false
    }
}

/// The closure of [`SqlStore::keyed_batch_handler`].
pub struct KeyedRows<F>(F);

impl<DB, F> WriteEffects<DB> for KeyedRows<F>
where
    DB: SqlBackend,
    F: for<'a> Fn(&'a mut DB::Connection, &'a [ClaimedMessage]) -> KeyedTxFuture<'a>
        + Send
        + Sync
        + 'static,
{
    fn write<'a>(
        &'a self,
        tx: &'a mut DB::Connection,
        msgs: &'a [ClaimedMessage],
    ) -> WriteFuture<'a> {
        let fut = (self.0)(tx, msgs);
        Box::pin(async move { fut.await.map(|keys| Some(keys.into_iter().collect())) })
    }
    fn keyed(&self) -> bool {
        true
    }
}

/// A batch handler writing effects and dedup records in one transaction; made by
/// [`SqlStore::batch_handler`] or [`SqlStore::keyed_batch_handler`] (see the module docs).
pub struct TxBatchHandler<DB: SqlBackend, W> {
    store: SqlStore<DB>,
    write: W,
    insert: InsertSql,
    /// One transaction at a time (see "Hot rows" in the module docs).
    turn: Arc<tokio::sync::Mutex<()>>,
    conflict_retries: u32,
}

/// Why a batch transaction did not commit.
enum TxFailure {
    Sql(sqlx::Error),
    Store(StoreError),
    Handler(HandlerError),
    Fenced(DedupKey),
    /// These messages (indices) were completed by their tokens in an earlier transaction
    /// that committed though its caller saw an error (a lost COMMIT reply): this one
    /// repeated their effects and was rolled back.
    AlreadyDone(Vec<usize>),
}

impl TxFailure {
    /// `deadlock` or `serialization` when retrying the transaction at once may succeed.
    fn conflict<DB: SqlBackend>(&self) -> Option<&'static str> {
        let sql = match self {
            TxFailure::Sql(e) => Some(e),
            TxFailure::Handler(HandlerError::Retryable(e)) => e.downcast_ref::<sqlx::Error>(),
            _ => None,
        }?;
        if error_class::<DB>(sql) != ErrorClass::RetryNow {
            return None;
        }
        let code = match sql {
            sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
            _ => None,
        };
        Some(match code.as_deref() {
            Some("40P01" | "1213") => "deadlock",
            _ => "serialization",
        })
    }

    fn into_handler_error(self) -> HandlerError {
        match self {
            TxFailure::Sql(e) => handler_error(e),
            TxFailure::Store(e) => e.into(),
            TxFailure::Handler(e) => e,
            TxFailure::Fenced(key) => HandlerError::Retryable(LeaseLost { key }.into()),
            TxFailure::AlreadyDone(_) => HandlerError::Retryable(
                StoreError::Backend("a batch repeated effects committed before".into()).into(),
            ),
        }
    }
}

impl<DB: SqlBackend> SqlStore<DB> {
    /// A batch handler whose closure writes the effects of a batch's messages through one
    /// transaction (`|tx, msgs| Box::pin(async move { … })`, writing with
    /// `execute(&mut *tx)`); the keys are recorded in the same transaction and the engine
    /// acks after its commit. Give the consumer [`SqlStore::unique_index`] for effect rows
    /// (the default: one key row per message), or this store for leases (see the module
    /// docs of [`batch`](crate::batch)).
    ///
    /// ```no_run
    /// use idemq_core::{IdempotentConsumer, KeyStrategy};
    /// use idemq_sql::{sqlx, PgStore, SqlResultExt};
    /// use std::sync::Arc;
    ///
    /// #[derive(serde::Deserialize)]
    /// struct Payment { account: i64, amount: i64 }
    ///
    /// # fn build(store: PgStore) -> Result<(), Box<dyn std::error::Error>> {
    /// let handler = store.batch_handler(|tx, msgs| Box::pin(async move {
    ///     for m in msgs {
    ///         let p: Payment = m.json()?;
    ///         sqlx::query("UPDATE accounts SET balance = balance + $1 WHERE id = $2")
    ///             .bind(p.amount)
    ///             .bind(p.account)
    ///             .execute(&mut *tx)
    ///             .await
    ///             .classify()?;
    ///     }
    ///     Ok(())
    /// }));
    /// let keys = KeyStrategy::json_pointer("payments", "/payment_id")?;
    /// let consumer = IdempotentConsumer::new(Arc::new(store.unique_index()), keys, handler);
    /// # let _ = consumer; Ok(()) }
    /// ```
    pub fn batch_handler<F>(&self, f: F) -> Batched<TxBatchHandler<DB, Rows<F>>>
    where
        F: for<'a> Fn(&'a mut DB::Connection, &'a [ClaimedMessage]) -> TxFuture<'a>
            + Send
            + Sync
            + 'static,
    {
        Batched(self.tx_batch(Rows(f)))
    }

    /// A batch handler for effect tables whose unique column *is* the dedup: the closure
    /// writes the batch's effect rows with the dedup key (`msg.key.as_str()`) in that column,
    /// skipping keys already there (`INSERT … ON CONFLICT (key) DO NOTHING RETURNING key` on
    /// PostgreSQL and SQLite, `INSERT IGNORE … RETURNING key` on MariaDB), and returns the
    /// keys it wrote; the others are acked as duplicates. With [`SqlStore::unique_index`] a
    /// batch is then one statement and one commit: one write per message, what a
    /// hand-written consumer does, with the engine's retries, dead-letters and
    /// never-ack-before-commit around it. With leases (this store as the consumer's store)
    /// every message's lease is completed in the transaction as by
    /// [`SqlStore::batch_handler`]. The closure gets the messages sorted by key, and its
    /// transactions are not made to take turns: two batches insert (and lock) their keys in
    /// one order, so a consumer's pipelined batches commit side by side.
    pub fn keyed_batch_handler<F>(&self, f: F) -> Batched<TxBatchHandler<DB, KeyedRows<F>>>
    where
        F: for<'a> Fn(&'a mut DB::Connection, &'a [ClaimedMessage]) -> KeyedTxFuture<'a>
            + Send
            + Sync
            + 'static,
    {
        Batched(self.tx_batch(KeyedRows(f)))
    }

    fn tx_batch<W>(&self, write: W) -> TxBatchHandler<DB, W> {
        TxBatchHandler {
            store: self.clone(),
            insert: InsertSql::new(DB::DIALECT, self.keys_table().as_str()),
            write,
            turn: Arc::default(),
            conflict_retries: 5,
        }
    }
}

impl<DB: SqlBackend, W: WriteEffects<DB>> TxBatchHandler<DB, W> {
    /// How often a transaction that met a deadlock or serialization failure is retried
    /// (with back-off) before the batch fails (default 5).
    pub fn with_conflict_retries(mut self, n: u32) -> Self {
        self.conflict_retries = n;
        self
    }

    /// One transaction: record the keys, write the effects, commit. Answers which messages
    /// were new (the others were duplicates).
    async fn transact(&self, msgs: &[ClaimedMessage]) -> Result<Vec<bool>, TxFailure> {
        let mut tx = PooledTx::begin(self.store.pool())
            .await
            .map_err(TxFailure::Sql)?;
        match self.in_tx(&mut tx, msgs).await {
            Ok(new) => {
                tx.commit().await.map_err(TxFailure::Sql)?;
                Ok(new)
            }
            Err(e) => {
                // Rolled back here, so the connection goes back to the pool; cut off before
                // this, it is closed instead (see `PooledTx`).
                let _ = tx.rollback().await;
                Err(e)
            }
        }
    }

    async fn in_tx(
        &self,
        tx: &mut PooledTx<DB>,
        msgs: &[ClaimedMessage],
    ) -> Result<Vec<bool>, TxFailure> {
        let claims_here = msgs
            .iter()
            .all(|m| m.claim_mode == ClaimMode::InEffectTransaction);
        if !claims_here {
            self.write
                .write(&mut **tx, msgs)
                .await
                .map_err(TxFailure::Handler)?;
            let completions: Vec<Completion> = msgs
                .iter()
                .map(|m| Completion {
                    key: m.key.clone(),
                    token: m.token,
                    result: None,
                    retention: m.retention,
                })
                .collect();
            let outcomes = self
                .store
                .complete_batch_in_tx(&mut **tx, &completions)
                .await
                .map_err(TxFailure::Store)?;
            if let Some(i) = outcomes.iter().position(|o| *o == CompleteOutcome::Fenced) {
                return Err(TxFailure::Fenced(msgs[i].key.clone()));
            }
            if outcomes.contains(&CompleteOutcome::Unknown) {
                return Err(TxFailure::Store(StoreError::Unavailable(
                    "a completion's outcome is unknown".into(),
                )));
            }
            let done_before: Vec<usize> = outcomes
                .iter()
                .enumerate()
                .filter(|(_, o)| **o == CompleteOutcome::AlreadyCompleted)
                .map(|(i, _)| i)
                .collect();
            if !done_before.is_empty() {
                return Err(TxFailure::AlreadyDone(done_before));
            }
            return Ok(vec![true; msgs.len()]);
        }
        if self.write.keyed() {
            let written = self
                .write
                .write(&mut **tx, msgs)
                .await
                .map_err(TxFailure::Handler)?
                .unwrap_or_default();
            return Ok(msgs
                .iter()
                .map(|m| written.contains(m.key.as_str()))
                .collect());
        }
        // Sorted: every consumer inserts (and locks) keys in one order.
        let mut keys: Vec<&str> = msgs.iter().map(|m| m.key.as_str()).collect();
        keys.sort_unstable();
        let inserted = self
            .insert
            .insert::<DB>(&mut **tx, &keys)
            .await
            .map_err(TxFailure::Sql)?;
        let new: Vec<bool> = msgs
            .iter()
            .map(|m| inserted.contains(m.key.as_str()))
            .collect();
        if inserted.len() == msgs.len() {
            self.write
                .write(&mut **tx, msgs)
                .await
                .map_err(TxFailure::Handler)?;
        } else if !inserted.is_empty() {
            let fresh: Vec<ClaimedMessage> = msgs
                .iter()
                .zip(&new)
                .filter(|(_, n)| **n)
                .map(|(m, _)| m.clone())
                .collect();
            self.write
                .write(&mut **tx, &fresh)
                .await
                .map_err(TxFailure::Handler)?;
        }
        Ok(new)
    }
}

#[async_trait]
impl<DB: SqlBackend, W: WriteEffects<DB>> BatchHandler for TxBatchHandler<DB, W> {
    async fn handle_batch(&self, mut msgs: Vec<ClaimedMessage>) -> Result<(), HandlerError> {
        // Keyed effect rows are inserts of the batch's own keys: sorted, two batches lock
        // them in one order and cannot deadlock, so their transactions overlap (as the
        // pipeline intends). Other effects may update shared rows: they take turns.
        let _turn = match self.write.keyed() {
            true => {
                msgs.sort_unstable_by(|a, b| a.key.cmp(&b.key));
                None
            }
            false => Some(self.turn.lock().await),
        };
        // Jittered, so two consumers that collided do not collide again.
        let mut backoff = RetryPolicy::backoff(Duration::from_millis(20), Duration::from_secs(2))
            .with_jitter(0.25)
            .waits();
        let mut tries = 0;
        loop {
            match self.transact(&msgs).await {
                Ok(new) => {
                    for (m, new) in msgs.iter().zip(new) {
                        match new {
                            true => m.mark_completed(),
                            false => m.mark_duplicate(),
                        }
                    }
                    return Ok(());
                }
                Err(TxFailure::AlreadyDone(done)) => {
                    // Rolled back: its effects for these were committed before, under these
                    // very leases. They are done; the rest run again without them.
                    tracing::info!(
                        messages = done.len(),
                        first_key = %msgs[done[0]].key,
                        "a batch transaction repeated effects an earlier commit of these claims made (its reply was lost); rolled back, the messages are done"
                    );
                    let done: HashSet<usize> = done.into_iter().collect();
                    let mut rest = Vec::with_capacity(msgs.len() - done.len());
                    for (i, m) in msgs.into_iter().enumerate() {
                        match done.contains(&i) {
                            true => m.mark_completed(),
                            false => rest.push(m),
                        }
                    }
                    msgs = rest;
                    if msgs.is_empty() {
                        return Ok(());
                    }
                }
                Err(failure) => match failure.conflict::<DB>() {
                    Some(reason) if tries < self.conflict_retries => {
                        tries += 1;
                        metrics::counter!(m::TRANSACTION_RETRIES, "reason" => reason).increment(1);
                        let first = msgs.first().map(|m| m.key.as_str()).unwrap_or("");
                        tracing::warn!(
                            reason,
                            table = %self.store.options().table.as_str(),
                            messages = msgs.len(),
                            first_key = first,
                            tries,
                            "batch transaction aborted by the database ({reason}); retrying it after a back-off"
                        );
                        tokio::time::sleep(backoff.next_delay()).await;
                    }
                    _ => return Err(failure.into_handler_error()),
                },
            }
        }
    }

    fn claims_in_transaction(&self) -> bool {
        true
    }
}
