//! The unique-index consumer: the claim *is* the key insert in the business transaction.
//!
//! The dedup-table engine ([`idemq_core::IdempotentConsumer`]) claims a key with a lease,
//! runs the handler, then completes the record: three writes per message (batched), and a
//! lease protocol that works for any effect, including ones outside the database. When the
//! effect is a write to the *same* database, a unique index does the whole job with one
//! write: insert the key in the transaction that writes the effect, commit, then ack.
//!
//! [`UniqueIndexConsumer`] runs that strategy over any [`Source`]:
//!
//! 1. derive each delivery's key (no usable key → rejected with the reason; a panicking
//!    key function rejects its message with the panic message, as in the dedup-table
//!    engine, and the consumer keeps going);
//! 2. open one transaction for the batch and insert all its keys into the keys table with
//!    one statement (`INSERT … ON CONFLICT DO NOTHING RETURNING`, sorted, so two consumers
//!    lock keys in the same order); keys that were already there are duplicates;
//! 3. run the handler for each new key through the same transaction, then commit;
//! 4. ack what committed and the duplicates; nothing is acked before the commit.
//!
//! When one handler fails, the batch transaction is rolled back and the batch runs again
//! one message per transaction, so the failure is isolated: the others commit, the failed
//! one gets the [`RetryPolicy`] (nack after a delay, dead-letter once attempts are used up,
//! or at once for a permanent error).
//!
//! Why no lease is needed: a concurrent consumer inserting the same key waits on the row
//! lock of the uncommitted insert (PostgreSQL, MariaDB; SQLite has a single writer), then
//! sees it committed (a duplicate: skip) or rolled back (its own insert wins). A crash
//! before the commit leaves nothing; a crash after it leaves a key whose redelivery is a
//! duplicate. A commit whose answer was lost is settled the same way: nacked, and the
//! redelivery finds the key if the commit happened.
//!
//! What it cannot do: effects outside this database (an HTTP call, a publish) are not in
//! the transaction — use the dedup-table engine and its lease for those. There is no
//! stored result to replay to duplicates, and no "in flight elsewhere" answer (a duplicate
//! waits for the other transaction instead). Keys live in
//! [`SqlStore::keys_table`](crate::SqlStore::keys_table); purge them with
//! [`SqlStore::purge_keys_older_than`](crate::SqlStore::purge_keys_older_than).
//!
//! ```no_run
//! use idemq_core::broker::MemoryBroker;
//! use idemq_core::KeyStrategy;
//! use idemq_sql::unique::UniqueIndexConsumer;
//! use idemq_sql::{sqlx, PgStore, SqlResultExt};
//!
//! # async fn run(store: PgStore, broker: MemoryBroker) -> Result<(), Box<dyn std::error::Error>> {
//! let keys = KeyStrategy::json_pointer("payments", "/payment_id")?;
//! let consumer = UniqueIndexConsumer::from_fn(store, keys, |msg, tx| Box::pin(async move {
//!     sqlx::query("INSERT INTO ledger (payment_id) VALUES ($1)")
//!         .bind(msg.key.as_str())
//!         .execute(&mut *tx)
//!         .await
//!         .classify()?;
//!     Ok(())
//! }));
//! consumer.run_until_idle(&mut broker.subscribe()).await?;
//! # Ok(()) }
//! ```

use crate::backend::{error_class, Dialect, ErrorClass, Kind, SqlBackend, Val};
use crate::store::SqlStore;
use async_trait::async_trait;
use idemq_core::engine::{close_after_run, derive_key, drive_source_reporting, Backoff, Health};
use idemq_core::metrics::{self as m, outcome};
use idemq_core::{
    ConsumerError, DedupKey, Delivery, Envelope, HandlerError, KeyStrategy, RetryPolicy, Source,
};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// One message as the unique-index handler sees it.
#[derive(Debug)]
#[non_exhaustive]
pub struct UniqueMessage {
    /// The dedup key (already inserted in the transaction the handler writes through).
    pub key: DedupKey,
    /// The message.
    pub envelope: Envelope,
    /// Which attempt this is (1 on the first delivery; the broker's delivery count when it
    /// has one, else what this consumer has seen).
    pub attempt: u32,
}

/// Writes one message's effect through the batch's transaction. Return an error to roll
/// the message back: [`HandlerError::Retryable`] retries it by the [`RetryPolicy`],
/// [`HandlerError::Permanent`] dead-letters it. Closures go through [`tx_fn`].
#[async_trait]
pub trait TxHandler<DB: SqlBackend>: Send + Sync + 'static {
    /// Writes the effect of `msg` through `tx` (do not commit or roll back: the consumer
    /// owns the transaction).
    async fn handle(
        &self,
        msg: &UniqueMessage,
        tx: &mut DB::Connection,
    ) -> Result<(), HandlerError>;

    /// Writes the effects of the batch's new messages through `tx`; the default calls
    /// [`TxHandler::handle`] for each. Override it to write them all with one statement
    /// (what a hand-written consumer does with a multi-row insert). When it fails, the
    /// batch is rolled back and each message is retried alone, in its own transaction,
    /// through this method with one message, so the failing one is found.
    async fn handle_batch(
        &self,
        msgs: &[&UniqueMessage],
        tx: &mut DB::Connection,
    ) -> Result<(), HandlerError> {
        for m in msgs {
            self.handle(m, tx).await?;
        }
        Ok(())
    }

    /// For handlers whose effect rows carry the dedup key in a unique column (made by
    /// [`UniqueIndexConsumer::from_keyed_batch_fn`]): writes the effects of `msgs`, skipping
    /// the keys already there, and answers the keys written; the consumer then writes no key
    /// of its own. `None` (the default): the consumer inserts the keys into the store's keys
    /// table first and calls [`TxHandler::handle_batch`] with the new messages.
    async fn insert_keyed_effects(
        &self,
        _msgs: &[&UniqueMessage],
        _tx: &mut DB::Connection,
    ) -> Option<Result<HashSet<String>, HandlerError>> {
        None
    }
}

/// The future a [`UniqueIndexConsumer::from_keyed_batch_fn`] closure returns: the keys
/// (`msg.key.as_str()`) of the effect rows it wrote.
pub type KeyedTxFuture<'a> =
    Pin<Box<dyn Future<Output = Result<Vec<String>, HandlerError>> + Send + 'a>>;

/// A [`TxHandler`] whose effect insert is the dedup; made by
/// [`UniqueIndexConsumer::from_keyed_batch_fn`].
pub struct KeyedBatchTxFn<DB, F>(F, std::marker::PhantomData<fn() -> DB>);

#[async_trait]
impl<DB, F> TxHandler<DB> for KeyedBatchTxFn<DB, F>
where
    DB: SqlBackend,
    F: for<'a> Fn(&'a [&'a UniqueMessage], &'a mut DB::Connection) -> KeyedTxFuture<'a>
        + Send
        + Sync
        + 'static,
{
    async fn handle(
        &self,
        msg: &UniqueMessage,
        tx: &mut DB::Connection,
    ) -> Result<(), HandlerError> {
        (self.0)(&[msg], tx).await.map(drop)
    }

    async fn insert_keyed_effects(
        &self,
        msgs: &[&UniqueMessage],
        tx: &mut DB::Connection,
    ) -> Option<Result<HashSet<String>, HandlerError>> {
        Some(
            (self.0)(msgs, tx)
                .await
                .map(|keys| keys.into_iter().collect()),
        )
    }
}

/// The future a [`UniqueIndexConsumer::from_batch_fn`] closure returns.
pub type BatchTxFuture<'a> = TxFuture<'a>;

/// A [`TxHandler`] writing a whole batch's effects at once; made by
/// [`UniqueIndexConsumer::from_batch_fn`].
pub struct BatchTxFn<DB, F>(F, std::marker::PhantomData<fn() -> DB>);

#[async_trait]
impl<DB, F> TxHandler<DB> for BatchTxFn<DB, F>
where
    DB: SqlBackend,
    F: for<'a> Fn(&'a [&'a UniqueMessage], &'a mut DB::Connection) -> BatchTxFuture<'a>
        + Send
        + Sync
        + 'static,
{
    async fn handle(
        &self,
        msg: &UniqueMessage,
        tx: &mut DB::Connection,
    ) -> Result<(), HandlerError> {
        (self.0)(&[msg], tx).await
    }

    async fn handle_batch(
        &self,
        msgs: &[&UniqueMessage],
        tx: &mut DB::Connection,
    ) -> Result<(), HandlerError> {
        (self.0)(msgs, tx).await
    }
}

/// The future a [`tx_fn`] closure returns (borrowing the message and the connection).
pub type TxFuture<'a> = Pin<Box<dyn Future<Output = Result<(), HandlerError>> + Send + 'a>>;

/// A [`TxHandler`] from a closure `|msg, tx| Box::pin(async move { … })` (the box lets the
/// future borrow the message and the transaction). Name the backend when the closure is
/// written apart from the consumer (`tx_fn::<sqlx::Postgres, _>(…)`), or pass the closure
/// to [`UniqueIndexConsumer::from_fn`], which knows it from the store.
pub fn tx_fn<DB, F>(f: F) -> TxFn<DB, F>
where
    DB: SqlBackend,
    F: for<'a> Fn(&'a UniqueMessage, &'a mut DB::Connection) -> TxFuture<'a>,
{
    TxFn(f, std::marker::PhantomData)
}

/// A [`TxHandler`] from a closure over backend `DB`; made by [`tx_fn`].
pub struct TxFn<DB, F>(F, std::marker::PhantomData<fn() -> DB>);

#[async_trait]
impl<DB, F> TxHandler<DB> for TxFn<DB, F>
where
    DB: SqlBackend,
    F: for<'a> Fn(&'a UniqueMessage, &'a mut DB::Connection) -> TxFuture<'a>
        + Send
        + Sync
        + 'static,
{
    async fn handle(
        &self,
        msg: &UniqueMessage,
        tx: &mut DB::Connection,
    ) -> Result<(), HandlerError> {
        (self.0)(msg, tx).await
    }
}

/// Settings of a [`UniqueIndexConsumer`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct UniqueIndexConfig {
    /// Deliveries per poll, and keys per transaction (default 256).
    pub max_batch: usize,
    /// Delays and attempts for failed handlers (default: the engine's).
    pub retry: RetryPolicy,
    /// Wait after a batch that met a database outage, doubling up to `store_backoff_max`.
    pub store_backoff: Duration,
    /// The longest back-off.
    pub store_backoff_max: Duration,
    /// Delay before a delivery nacked because the database was down comes back.
    pub outage_redelivery: Duration,
    /// How often a batch transaction is retried at once after a deadlock or serialization
    /// failure before its messages are nacked (default 3).
    pub deadlock_retries: u32,
    /// Batches in progress at once (default 4): the next batch is polled and its
    /// transaction started while the previous one commits, so the broker's and the
    /// database's waits overlap (two commits in flight also share PostgreSQL's WAL flush).
    /// Batches may then commit out of order: set 1 when messages of one partition must
    /// take effect strictly in order. The same key in two batches at once is still applied
    /// once: the second insert waits on the first's index entry.
    pub pipeline_depth: usize,
}

impl Default for UniqueIndexConfig {
    fn default() -> Self {
        Self {
            max_batch: 256,
            retry: RetryPolicy::default(),
            store_backoff: Duration::from_millis(100),
            store_backoff_max: Duration::from_secs(5),
            outage_redelivery: Duration::from_secs(1),
            deadlock_retries: 3,
            pipeline_depth: 4,
        }
    }
}

impl UniqueIndexConfig {
    /// With this batch size.
    pub fn with_max_batch(mut self, n: usize) -> Self {
        self.max_batch = n.max(1);
        self
    }
    /// With this retry policy.
    pub fn with_retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }
    /// With up to `n` batches in progress at once (1: strictly one after another).
    pub fn with_pipeline_depth(mut self, n: usize) -> Self {
        self.pipeline_depth = n.max(1);
        self
    }
}

/// Counters of a [`UniqueIndexConsumer`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct UniqueIndexStats {
    /// Effects committed.
    pub processed: u64,
    /// Deliveries whose key was already there (acked without running).
    pub duplicates: u64,
    /// Handler failures nacked for a retry.
    pub retried: u64,
    /// Deliveries dead-lettered (no key, permanent failure, attempts used up).
    pub rejected: u64,
    /// Batches that fell back to one transaction per message after a handler failed.
    pub split_batches: u64,
    /// Batches nacked because the database was unavailable.
    pub store_unavailable: u64,
    /// Settlements the broker refused.
    pub settle_failures: u64,
}

#[derive(Default)]
struct Counters {
    processed: AtomicU64,
    duplicates: AtomicU64,
    retried: AtomicU64,
    rejected: AtomicU64,
    split_batches: AtomicU64,
    store_unavailable: AtomicU64,
    settle_failures: AtomicU64,
}

/// Runs a [`TxHandler`] over a [`Source`] with the unique-index strategy (see the module
/// docs): one key insert per message, in the transaction of its effect.
pub struct UniqueIndexConsumer<DB: SqlBackend, H> {
    store: SqlStore<DB>,
    keys: KeyStrategy,
    handler: H,
    cfg: UniqueIndexConfig,
    insert_sql: InsertSql,
    counters: Counters,
    health: Health,
    /// Attempts seen here per key, for brokers that do not count deliveries (bounded: it
    /// is cleared when it grows past a limit, which only makes retries start over).
    attempts: Mutex<HashMap<String, u32>>,
}

/// What happened to one message's key in a transaction.
#[derive(Debug)]
enum Fate {
    Committed,
    Duplicate,
    Failed(HandlerError),
}

/// Why a transaction did not commit.
enum TxFailure {
    /// A handler failed (which one is known only for a one-message transaction).
    Handler(HandlerError),
    /// The database failed.
    Store(sqlx::Error),
}

impl<DB: SqlBackend, F> UniqueIndexConsumer<DB, TxFn<DB, F>>
where
    F: for<'a> Fn(&'a UniqueMessage, &'a mut DB::Connection) -> TxFuture<'a>
        + Send
        + Sync
        + 'static,
{
    /// A consumer from a closure `|msg, tx| Box::pin(async move { … })` that writes each
    /// message's effect through `tx` (see [`tx_fn`]).
    pub fn from_fn(store: SqlStore<DB>, keys: KeyStrategy, f: F) -> Self {
        Self::new(store, keys, TxFn(f, std::marker::PhantomData))
    }
}

impl<DB: SqlBackend, F> UniqueIndexConsumer<DB, BatchTxFn<DB, F>>
where
    F: for<'a> Fn(&'a [&'a UniqueMessage], &'a mut DB::Connection) -> BatchTxFuture<'a>
        + Send
        + Sync
        + 'static,
{
    /// A consumer from a closure `|msgs, tx| Box::pin(async move { … })` that writes the
    /// effects of all new messages of a batch through `tx` at once (one multi-row statement:
    /// a batch then costs one key insert, one effect statement and one commit). A failure
    /// rolls the batch back and retries each message alone, so only the failing one is
    /// retried or dead-lettered.
    pub fn from_batch_fn(store: SqlStore<DB>, keys: KeyStrategy, f: F) -> Self {
        Self::new(store, keys, BatchTxFn(f, std::marker::PhantomData))
    }
}

impl<DB: SqlBackend, F> UniqueIndexConsumer<DB, KeyedBatchTxFn<DB, F>>
where
    F: for<'a> Fn(&'a [&'a UniqueMessage], &'a mut DB::Connection) -> KeyedTxFuture<'a>
        + Send
        + Sync
        + 'static,
{
    /// A consumer whose effect table *is* the dedup: the closure writes the batch's effect
    /// rows with the dedup key (`msg.key.as_str()`) in a unique column, skipping keys already
    /// there (`INSERT … ON CONFLICT (key) DO NOTHING RETURNING key` on PostgreSQL and SQLite,
    /// `INSERT IGNORE … RETURNING key` on MariaDB), and returns the keys it wrote. A batch
    /// is then one statement and one commit, one write per message (what a hand-written
    /// consumer does), with the engine's key derivation, retries, dead-letters and
    /// never-ack-before-commit around it. Messages whose key was not returned are acked as
    /// duplicates. Only for effects that are one row per message; otherwise use
    /// [`UniqueIndexConsumer::from_batch_fn`] (a key row in the store's keys table).
    pub fn from_keyed_batch_fn(store: SqlStore<DB>, keys: KeyStrategy, f: F) -> Self {
        Self::new(store, keys, KeyedBatchTxFn(f, std::marker::PhantomData))
    }
}

impl<DB: SqlBackend, H: TxHandler<DB>> UniqueIndexConsumer<DB, H> {
    /// A consumer writing keys to `store`'s keys table (created by its migrations).
    pub fn new(store: SqlStore<DB>, keys: KeyStrategy, handler: H) -> Self {
        let insert_sql = InsertSql::new(DB::DIALECT, store.keys_table().as_str());
        Self {
            store,
            keys,
            handler,
            cfg: UniqueIndexConfig::default(),
            insert_sql,
            counters: Counters::default(),
            health: Health::new(),
            attempts: Mutex::default(),
        }
    }

    /// Replaces the settings.
    pub fn with_config(mut self, cfg: UniqueIndexConfig) -> Self {
        self.cfg = cfg;
        self.cfg.max_batch = self.cfg.max_batch.max(1);
        self
    }

    /// The consumer's readiness (database and broker answering), for a health endpoint.
    pub fn health(&self) -> Health {
        self.health.clone()
    }

    /// Counters so far.
    pub fn stats(&self) -> UniqueIndexStats {
        let c = &self.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        UniqueIndexStats {
            processed: l(&c.processed),
            duplicates: l(&c.duplicates),
            retried: l(&c.retried),
            rejected: l(&c.rejected),
            split_batches: l(&c.split_batches),
            store_unavailable: l(&c.store_unavailable),
            settle_failures: l(&c.settle_failures),
        }
    }

    /// Polls and processes until `shutdown` resolves or the source ends, then closes the
    /// source. Batches in progress are finished first.
    pub async fn run<S: Source + ?Sized>(
        &self,
        source: &mut S,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), ConsumerError> {
        let backoff = Backoff {
            initial: self.cfg.store_backoff,
            max: self.cfg.store_backoff_max,
        };
        let result = drive_source_reporting(
            source,
            self.cfg.max_batch,
            self.cfg.pipeline_depth,
            backoff,
            &self.health,
            shutdown,
            |batch| self.process_batch(batch),
        )
        .await;
        close_after_run(source, result).await
    }

    /// Runs until the source ends.
    pub async fn run_until_idle<S: Source + ?Sized>(
        &self,
        source: &mut S,
    ) -> Result<(), ConsumerError> {
        self.run(source, std::future::pending()).await
    }

    /// One polled batch; answers whether the database was unavailable.
    async fn process_batch(&self, batch: Vec<Delivery>) -> bool {
        // Keys: the first delivery of a key runs, later copies share its fate.
        let mut firsts: BTreeMap<DedupKey, (UniqueMessage, Delivery)> = BTreeMap::new();
        let mut copies: Vec<(DedupKey, Delivery)> = Vec::new();
        let mut keyless: Vec<(Delivery, String)> = Vec::new();
        for mut d in batch {
            if d.is_stale() {
                continue; // the source gave it up; dropping it abandons nothing of ours
            }
            // Isolated like the dedup-table engine: a panicking key function dead-letters
            // its message instead of killing this consumer (and, redelivered, the next).
            let key = match derive_key(&self.keys, &d.envelope) {
                Ok(k) => k,
                Err(reason) => {
                    keyless.push((d, reason));
                    continue;
                }
            };
            if firsts.contains_key(&key) {
                copies.push((key, d));
                continue;
            }
            // The envelope moves to the message (no copy) and back before the delivery is
            // settled.
            let broker = d.envelope.broker;
            let envelope = std::mem::replace(
                &mut d.envelope,
                Envelope::new(broker, String::new(), idemq_core::Bytes::new()),
            );
            let msg = UniqueMessage {
                key: key.clone(),
                envelope,
                attempt: 1,
            };
            firsts.insert(key, (msg, d));
        }
        for (d, reason) in keyless {
            tracing::warn!(source = %d.envelope.source.name, %reason, "rejecting");
            self.reject(d, &reason).await;
        }
        if firsts.is_empty() {
            return false;
        }
        self.set_attempts(firsts.values_mut().map(|(m, _)| m));
        // BTreeMap order = sorted keys: every consumer inserts (and locks) in one order.
        let items: Vec<(UniqueMessage, Delivery)> = firsts.into_values().collect();
        let (fates, outage) = self.transact(&items).await;
        let mut tally = Tally::default();
        let mut failures = Failures::default();
        // Only a batch with copies needs each key's settlement again afterwards.
        let mut by_key: HashMap<DedupKey, Settlement> = HashMap::new();
        let mut decided = Vec::with_capacity(items.len());
        for ((msg, mut d), fate) in items.into_iter().zip(fates) {
            let s = self.settlement(&msg, fate, &mut tally, &mut failures);
            d.envelope = msg.envelope;
            if !copies.is_empty() {
                by_key.insert(msg.key, s.clone());
            }
            decided.push((d, s));
        }
        // Before any settlement: a nacked message must find its failure counted when it
        // comes back.
        self.remember(failures);
        for (d, s) in decided {
            self.settle(d, &s).await;
        }
        for (k, d) in copies {
            let s = by_key
                .get(&k)
                .cloned()
                .unwrap_or(Settlement::Nack(self.cfg.outage_redelivery));
            self.settle(d, &s).await;
        }
        tally.flush(self.keys.group().as_str());
        outage
    }

    /// Runs the batch in one transaction, or one transaction per message after a handler
    /// failure; answers each item's fate (`None`: the database was unavailable).
    async fn transact(&self, items: &[(UniqueMessage, Delivery)]) -> (Vec<Option<Fate>>, bool) {
        let all: Vec<usize> = (0..items.len()).collect();
        match self.with_retries(items, &all).await {
            Ok(fates) => return (fates.into_iter().map(Some).collect(), false),
            Err(TxFailure::Store(e)) => {
                self.outage(&e, items.len());
                return ((0..items.len()).map(|_| None).collect(), true);
            }
            Err(TxFailure::Handler(e)) if items.len() == 1 => {
                return (vec![Some(Fate::Failed(e))], false);
            }
            Err(TxFailure::Handler(_)) => {}
        }
        // One handler failed: isolate it, one transaction per message.
        self.counters.split_batches.fetch_add(1, Ordering::Relaxed);
        let mut fates = Vec::with_capacity(items.len());
        let mut outage = false;
        for i in 0..items.len() {
            let fate = match self.with_retries(items, &[i]).await {
                Ok(mut f) => f.pop(),
                Err(TxFailure::Handler(e)) => Some(Fate::Failed(e)),
                Err(TxFailure::Store(e)) => {
                    self.outage(&e, 1);
                    outage = true;
                    None
                }
            };
            fates.push(fate);
        }
        (fates, outage)
    }

    fn outage(&self, e: &sqlx::Error, n: usize) {
        tracing::warn!(error = %e, messages = n, "database unavailable; nacking, nothing acked");
        self.counters
            .store_unavailable
            .fetch_add(n as u64, Ordering::Relaxed);
        metrics::counter!(m::STORE_ERRORS, "op" => "unique_insert").increment(1);
    }

    /// [`Self::run_tx`], retried at once after deadlocks and serialization failures.
    async fn with_retries(
        &self,
        items: &[(UniqueMessage, Delivery)],
        which: &[usize],
    ) -> Result<Vec<Fate>, TxFailure> {
        let mut tries = 0;
        loop {
            match self.run_tx(items, which).await {
                Err(TxFailure::Store(e))
                    if error_class::<DB>(&e) == ErrorClass::RetryNow
                        && tries < self.cfg.deadlock_retries =>
                {
                    tries += 1;
                    tracing::debug!(error = %e, tries, "unique-index transaction retried");
                }
                other => return other,
            }
        }
    }

    /// One transaction: insert the keys of `which`, run the handlers of the new ones, commit.
    async fn run_tx(
        &self,
        items: &[(UniqueMessage, Delivery)],
        which: &[usize],
    ) -> Result<Vec<Fate>, TxFailure> {
        // Never back to the pool mid-transaction if this is cut off (see `PooledTx`).
        let mut tx = crate::PooledTx::begin(self.store.pool())
            .await
            .map_err(TxFailure::Store)?;
        let out = self.run_in_tx(&mut tx, items, which).await;
        if out.is_err() {
            // Rolled back here, so the connection goes back to the pool (a deadlock retried
            // at once needs no new connection); cut off before this, it is closed instead.
            let _ = tx.rollback().await;
        }
        out
    }

    async fn run_in_tx(
        &self,
        tx: &mut crate::PooledTx<DB>,
        items: &[(UniqueMessage, Delivery)],
        which: &[usize],
    ) -> Result<Vec<Fate>, TxFailure> {
        let batch: Vec<&UniqueMessage> = which.iter().map(|&i| &items[i].0).collect();
        if let Some(written) = self.handler.insert_keyed_effects(&batch, &mut **tx).await {
            // The effect rows carry the keys: what they wrote is what was new.
            let inserted = written.map_err(TxFailure::Handler)?;
            tx.commit().await.map_err(TxFailure::Store)?;
            return Ok(batch
                .iter()
                .map(|m| match inserted.contains(m.key.as_str()) {
                    true => Fate::Committed,
                    false => Fate::Duplicate,
                })
                .collect());
        }
        let keys: Vec<&str> = batch.iter().map(|m| m.key.as_str()).collect();
        let inserted = self
            .insert_sql
            .insert::<DB>(&mut **tx, &keys)
            .await
            .map_err(TxFailure::Store)?;
        let mut fates = Vec::with_capacity(which.len());
        let mut new_msgs: Vec<&UniqueMessage> = Vec::with_capacity(which.len());
        for &i in which {
            let msg = &items[i].0;
            if inserted.contains(msg.key.as_str()) {
                new_msgs.push(msg);
                fates.push(Fate::Committed);
            } else {
                fates.push(Fate::Duplicate);
            }
        }
        if !new_msgs.is_empty() {
            if let Err(e) = self.handler.handle_batch(&new_msgs, &mut **tx).await {
                // The caller rolls the transaction back (key inserts included).
                return Err(TxFailure::Handler(e));
            }
        }
        tx.commit().await.map_err(TxFailure::Store)?;
        Ok(fates)
    }

    /// Each message's attempt: one more than the failures this consumer recorded for its key
    /// (at least the broker's delivery count). Only failures are recorded, so the common path
    /// takes one lock per batch and finds the map empty.
    fn set_attempts<'a>(&self, msgs: impl Iterator<Item = &'a mut UniqueMessage>) {
        let seen = self.attempts.lock().unwrap_or_else(|p| p.into_inner());
        for m in msgs {
            let failed = match seen.is_empty() {
                true => 0,
                false => seen.get(m.key.as_str()).copied().unwrap_or(0),
            };
            m.attempt = (failed + 1).max(m.envelope.delivery_count.unwrap_or(1));
        }
    }

    /// Applies a batch's failure bookkeeping under one lock: failed attempts are recorded
    /// (bounded: the map is cleared past 100 000 keys, then the broker's delivery count is
    /// what remains), settled keys forgotten.
    fn remember(&self, f: Failures) {
        if f.failed.is_empty() && f.settled.is_empty() {
            return;
        }
        let mut seen = self.attempts.lock().unwrap_or_else(|p| p.into_inner());
        if !seen.is_empty() {
            for k in &f.settled {
                seen.remove(k.as_str());
            }
        }
        for (k, attempt) in f.failed {
            if seen.len() > 100_000 {
                seen.clear();
            }
            seen.insert(k.as_str().to_owned(), attempt);
        }
    }

    fn settlement(
        &self,
        msg: &UniqueMessage,
        fate: Option<Fate>,
        tally: &mut Tally,
        failures: &mut Failures,
    ) -> Settlement {
        let broker = msg.envelope.broker;
        match fate {
            None => Settlement::Nack(self.cfg.outage_redelivery),
            Some(Fate::Committed) => {
                failures.settled(&msg.key);
                self.counters.processed.fetch_add(1, Ordering::Relaxed);
                tally.outcome(broker, outcome::PROCESSED);
                Settlement::Ack
            }
            Some(Fate::Duplicate) => {
                failures.settled(&msg.key);
                self.counters.duplicates.fetch_add(1, Ordering::Relaxed);
                tally.outcome(broker, outcome::DUPLICATE);
                tally.duplicate(&msg.envelope.source.name);
                Settlement::Ack
            }
            Some(Fate::Failed(e)) => {
                let (delay, permanent) = match &e {
                    HandlerError::Permanent(_) => (Duration::ZERO, true),
                    HandlerError::RetryAfter { delay, .. } => (*delay, false),
                    _ => (self.cfg.retry.delay(msg.attempt), false),
                };
                if permanent || self.cfg.retry.exhausted(msg.attempt) {
                    failures.settled(&msg.key);
                    let reason = if permanent {
                        e.to_string()
                    } else {
                        format!("gave up after {} attempts: {e}", msg.attempt)
                    };
                    tracing::warn!(key = %msg.key, %reason, "dead-lettering");
                    Settlement::Reject(reason)
                } else {
                    tracing::warn!(key = %msg.key, attempt = msg.attempt, error = %e, "handler failed; rolled back, will retry");
                    self.counters.retried.fetch_add(1, Ordering::Relaxed);
                    failures.failed.push((msg.key.clone(), msg.attempt));
                    Settlement::Nack(delay)
                }
            }
        }
    }

    async fn settle(&self, d: Delivery, s: &Settlement) {
        let (what, res) = match s {
            Settlement::Ack => ("ack", d.ack().await),
            Settlement::Nack(after) => ("nack", d.nack(*after).await),
            Settlement::Reject(reason) => {
                self.counters.rejected.fetch_add(1, Ordering::Relaxed);
                ("reject", d.reject(reason).await)
            }
        };
        if let Err(e) = res {
            self.counters
                .settle_failures
                .fetch_add(1, Ordering::Relaxed);
            metrics::counter!(m::SETTLE_FAILURES, "settlement" => what).increment(1);
            tracing::warn!(error = %e, settlement = what, "broker refused a settlement; it will redeliver");
        }
    }

    async fn reject(&self, d: Delivery, reason: &str) {
        self.settle(d, &Settlement::Reject(reason.to_owned())).await;
    }
}

/// A batch's outcome counts, reported to `metrics` once per label set when the batch ends
/// (a `counter!` per message built and dropped its labels every time: three allocations).
#[derive(Default)]
struct Tally {
    outcomes: Vec<(idemq_core::BrokerKind, &'static str, u64)>,
    duplicates_by_topic: Vec<(String, u64)>,
}

impl Tally {
    fn outcome(&mut self, broker: idemq_core::BrokerKind, o: &'static str) {
        match self
            .outcomes
            .iter_mut()
            .find(|(b, name, _)| *b == broker && *name == o)
        {
            Some((_, _, n)) => *n += 1,
            None => self.outcomes.push((broker, o, 1)),
        }
    }

    fn duplicate(&mut self, topic: &str) {
        match self
            .duplicates_by_topic
            .iter_mut()
            .find(|(t, _)| t == topic)
        {
            Some((_, n)) => *n += 1,
            None => self.duplicates_by_topic.push((topic.to_owned(), 1)),
        }
    }

    fn flush(self, group: &str) {
        for (broker, o, n) in self.outcomes {
            metrics::counter!(m::MESSAGES, "outcome" => o, "broker" => broker.as_str(), "group" => group.to_owned())
                .increment(n);
        }
        for (topic, n) in self.duplicates_by_topic {
            metrics::counter!(m::DUPLICATES, "topic" => topic, "group" => group.to_owned())
                .increment(n);
        }
    }
}

/// A batch's changes to the per-key failure memory, applied under one lock.
#[derive(Default)]
struct Failures {
    failed: Vec<(DedupKey, u32)>,
    settled: Vec<DedupKey>,
}

impl Failures {
    fn settled(&mut self, key: &DedupKey) {
        self.settled.push(key.clone());
    }
}

#[derive(Debug, Clone)]
enum Settlement {
    Ack,
    Nack(Duration),
    Reject(String),
}

/// The batch key insert of one dialect.
struct InsertSql {
    dialect: Dialect,
    table: String,
}

impl InsertSql {
    fn new(dialect: Dialect, table: &str) -> Self {
        Self {
            dialect,
            table: table.to_owned(),
        }
    }

    /// Inserts `keys`; answers the ones that were new.
    async fn insert<DB: SqlBackend>(
        &self,
        conn: &mut DB::Connection,
        keys: &[&str],
    ) -> Result<HashSet<String>, sqlx::Error> {
        let (t, now) = (&self.table, self.dialect.now_ms_sql());
        let (sql, args) = match self.dialect {
            // One array parameter, whatever the batch size.
            Dialect::Postgres => (
                format!(
                    "INSERT INTO {t} (dedup_key, created_ms) SELECT u, {now} FROM UNNEST(?::text[]) AS u \
                     ON CONFLICT (dedup_key) DO NOTHING RETURNING dedup_key"
                ),
                vec![Val::TextArray(
                    keys.iter().map(|k| Some((*k).to_owned())).collect(),
                )],
            ),
            Dialect::Sqlite | Dialect::MySql => {
                let rows = vec![format!("(?, {now})"); keys.len()].join(", ");
                let sql = if self.dialect == Dialect::MySql {
                    // MariaDB: IGNORE skips existing keys (after waiting for an uncommitted
                    // insert of the same key), RETURNING lists the rows written.
                    format!("INSERT IGNORE INTO {t} (dedup_key, created_ms) VALUES {rows} RETURNING dedup_key")
                } else {
                    format!(
                        "INSERT INTO {t} (dedup_key, created_ms) VALUES {rows} \
                         ON CONFLICT (dedup_key) DO NOTHING RETURNING dedup_key"
                    )
                };
                let args = keys.iter().map(|k| Val::Key((*k).to_owned())).collect();
                (sql, args)
            }
        };
        let sql = self.dialect.placeholders(sql);
        let rows = DB::fetch(conn, &sql, args, &[Kind::Text]).await?;
        rows.iter()
            .map(|r| {
                r.text(0)
                    .map(str::to_owned)
                    .map_err(|e| sqlx::Error::Decode(e.into()))
            })
            .collect()
    }
}
