//! Completing a claimed message in the business transaction, with what the engine knows.
//!
//! [`SqlStore::begin_for`] opens a transaction on the store's pool for one
//! [`ClaimedMessage`]; the handler writes its effect through it, and
//! [`MessageTx::commit`] completes the dedup record with the message's own key, fencing
//! token and retention in the same transaction, then commits. The effect and the record
//! commit together or not at all.
//!
//! When the completion answers [`CompleteOutcome::Fenced`] (this worker's lease was lost:
//! another worker took the key over after it expired, or it was released), `commit` rolls
//! the transaction back and returns a [`HandlerError::Retryable`] whose source is
//! [`LeaseLost`]: nothing of this attempt is kept, the engine settles the delivery as a
//! failure, and the redelivery meets the key's current owner (a duplicate once that owner
//! completes). Dropping a [`MessageTx`] without committing (an early `?`, a cancelled
//! handler) closes its connection: the server rolls the transaction back.

use crate::backend::SqlBackend;
use crate::errors::handler_error;
use crate::store::SqlStore;
use bytes::Bytes;
pub use idemq_core::LeaseLost;
use idemq_core::{
    ClaimedMessage, CompleteOutcome, DedupKey, FencingToken, HandlerError, HandlerResult,
    StoreError,
};
use sqlx::pool::PoolConnection;
use sqlx::TransactionManager as _;
use std::time::Duration;

/// A pooled connection inside a transaction, closed rather than handed back to the pool
/// when dropped before its commit or rollback finished.
///
/// Not a `sqlx::Transaction`: one dropped while a statement is in flight (a handler cut off
/// when its lease is lost) would hand its connection back to the pool, and sqlx cannot
/// always bring a MySQL connection back in step after a cancelled exchange
/// (launchbadge/sqlx#563). It counts as open from *before* its `BEGIN`: one cut off after
/// sending `BEGIN` and before reading the answer would otherwise go back to the pool with
/// the server inside a transaction sqlx does not know about, and every later autocommit
/// statement on it (claims, completions) would run inside that transaction, never
/// committed, holding its locks. Closing the connection ends the transaction on the server.
///
/// ```no_run
/// # async fn demo(pool: &idemq_sql::sqlx::PgPool) -> Result<(), idemq_sql::sqlx::Error> {
/// use idemq_sql::{sqlx, PooledTx};
/// let mut tx = PooledTx::begin(pool).await?;
/// sqlx::query("UPDATE accounts SET balance = balance + 1 WHERE id = 7")
///     .execute(&mut *tx)
///     .await?;
/// tx.commit().await
/// # }
/// ```
pub struct PooledTx<DB: SqlBackend> {
    conn: PoolConnection<DB>,
    /// Set from before `BEGIN` until a commit or rollback succeeded.
    open: bool,
}

impl<DB: SqlBackend> PooledTx<DB> {
    /// Takes a connection from `pool` and begins a transaction on it.
    pub async fn begin(pool: &sqlx::Pool<DB>) -> Result<Self, sqlx::Error> {
        Self::open(pool, None).await
    }

    /// Like [`PooledTx::begin`], with `statement` in place of `BEGIN`: SQLite's
    /// `BEGIN IMMEDIATE` takes the write lock up front, so a read-then-write transaction
    /// cannot fail to upgrade its lock half-way through.
    pub async fn begin_with(
        pool: &sqlx::Pool<DB>,
        statement: &'static str,
    ) -> Result<Self, sqlx::Error> {
        Self::open(pool, Some(statement.into())).await
    }

    async fn open(
        pool: &sqlx::Pool<DB>,
        statement: Option<std::borrow::Cow<'static, str>>,
    ) -> Result<Self, sqlx::Error> {
        let mut tx = PooledTx {
            conn: pool.acquire().await?,
            open: true,
        };
        if let Err(e) = DB::TransactionManager::begin(&mut *tx.conn, statement).await {
            // The server answered (SQLite busy, say): the connection is in step and outside
            // any transaction, so it goes back to the pool. (Closing it would also lose an
            // in-memory SQLite database that lives on that one connection.)
            if matches!(e, sqlx::Error::Database(_)) {
                tx.open = false;
            }
            return Err(e);
        }
        Ok(tx)
    }

    /// Commits. A failed commit leaves the transaction open: the connection is closed when
    /// this is dropped, never reused.
    pub async fn commit(&mut self) -> Result<(), sqlx::Error> {
        DB::TransactionManager::commit(&mut *self.conn).await?;
        self.open = false;
        Ok(())
    }

    /// Rolls back (dropping it does too, by closing the connection).
    pub async fn rollback(&mut self) -> Result<(), sqlx::Error> {
        DB::TransactionManager::rollback(&mut *self.conn).await?;
        self.open = false;
        Ok(())
    }
}

impl<DB: SqlBackend> std::fmt::Debug for PooledTx<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PooledTx")
            .field("open", &self.open)
            .finish_non_exhaustive()
    }
}

/// `Deref` and `DerefMut` to the connection (`DB::Connection`) for a transaction type
/// `$ty<DB>` whose field `$field` dereferences to it: the effect's statements run through
/// `&mut *tx` on [`PooledTx`], [`MessageTx`] and `LogToDatabase`'s `OffsetTx` alike.
macro_rules! deref_to_connection {
    ($ty:ident, $field:ident) => {
        impl<DB: SqlBackend> std::ops::Deref for $ty<DB> {
            type Target = DB::Connection;
            fn deref(&self) -> &DB::Connection {
                &self.$field
            }
        }

        impl<DB: SqlBackend> std::ops::DerefMut for $ty<DB> {
            fn deref_mut(&mut self) -> &mut DB::Connection {
                &mut self.$field
            }
        }
    };
}
pub(crate) use deref_to_connection;

deref_to_connection!(PooledTx, conn);

impl<DB: SqlBackend> Drop for PooledTx<DB> {
    fn drop(&mut self) {
        if self.open {
            // Neither committed nor rolled back, maybe cut off mid-statement or mid-BEGIN.
            self.conn.close_on_drop();
        }
    }
}

/// A transaction on a [`SqlStore`]'s pool for one claimed message: write the effect through
/// it (it dereferences to the connection: `execute(&mut *tx)`), then [`MessageTx::commit`].
///
/// ```no_run
/// use idemq_core::{ClaimedMessage, HandlerResult};
/// use idemq_sql::{sqlx, PgStore, SqlResultExt};
///
/// async fn apply(store: &PgStore, msg: ClaimedMessage) -> HandlerResult {
///     let mut tx = store.begin_for(&msg).await?;
///     sqlx::query("UPDATE accounts SET balance = balance + 100 WHERE id = 7")
///         .execute(&mut *tx)
///         .await
///         .classify()?;
///     tx.commit().await // completes with msg's key, token and retention, then commits
/// }
/// ```
pub struct MessageTx<DB: SqlBackend> {
    /// Closed when dropped open; the server rolls the transaction back.
    tx: PooledTx<DB>,
    store: SqlStore<DB>,
    key: DedupKey,
    token: FencingToken,
    retention: Duration,
}

impl<DB: SqlBackend> std::fmt::Debug for MessageTx<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MessageTx")
            .field("key", &self.key)
            .field("token", &self.token)
            .finish_non_exhaustive()
    }
}

deref_to_connection!(MessageTx, tx);

impl<DB: SqlBackend> MessageTx<DB> {
    /// Completes the message with no stored result and commits (see
    /// [`MessageTx::commit_with`]).
    pub async fn commit(self) -> HandlerResult {
        self.commit_with(None).await
    }

    /// Completes the message in this transaction, storing `result` (replayed to
    /// duplicates), and commits; returns what the handler returns.
    ///
    /// Errors: [`LeaseLost`] as [`HandlerError::Retryable`] after a rollback when the lease
    /// was lost; a failed commit classified by [`handler_error`] (a serialization failure
    /// at commit is retryable).
    pub async fn commit_with(mut self, result: Option<Bytes>) -> HandlerResult {
        let outcome = self
            .store
            .complete_in_tx(
                &mut *self.tx,
                &self.key,
                self.token,
                result.as_deref(),
                self.retention,
            )
            .await?;
        match outcome {
            CompleteOutcome::Completed => {
                // A failed commit leaves it open: the connection is closed, not reused.
                self.tx.commit().await.map_err(handler_error)?;
                Ok(result)
            }
            CompleteOutcome::AlreadyCompleted => {
                // An earlier transaction of this claim committed (its reply was lost):
                // this one repeats its effect. Rolled back; the message is done.
                if let Err(e) = self.tx.rollback().await {
                    tracing::debug!(key = %self.key, error = %e, "rollback of a repeated effect failed (the server rolls back on disconnect)");
                }
                tracing::info!(key = %self.key, "effect committed before by this claim; rolled back the repeat");
                Ok(result)
            }
            CompleteOutcome::Unknown => {
                // Not answered by a single store's completion; should it happen, nothing
                // is committed and the message is retried.
                if let Err(e) = self.tx.rollback().await {
                    tracing::debug!(key = %self.key, error = %e, "rollback failed (the server rolls back on disconnect)");
                }
                Err(HandlerError::Retryable(
                    StoreError::Unavailable("the completion's outcome is unknown".into()).into(),
                ))
            }
            CompleteOutcome::Fenced => {
                if let Err(e) = self.tx.rollback().await {
                    tracing::debug!(key = %self.key, error = %e, "rollback after a lost lease failed (the server rolls back on disconnect)");
                }
                Err(HandlerError::Retryable(
                    LeaseLost {
                        key: self.key.clone(),
                    }
                    .into(),
                ))
            }
        }
    }

    /// Rolls back (dropping the transaction does too).
    pub async fn rollback(mut self) -> Result<(), StoreError> {
        self.tx
            .rollback()
            .await
            .map_err(|e| crate::backend::map_sqlx_error::<DB>("rollback", e))
    }

    /// The message's key.
    pub fn key(&self) -> &DedupKey {
        &self.key
    }
}

impl<DB: SqlBackend> SqlStore<DB> {
    /// Opens a transaction on this store's pool for `msg`, to be completed with `msg`'s own
    /// key, token and retention by [`MessageTx::commit`] (a lost lease rolls the effect
    /// back: see [`MessageTx::commit`]). The store handed to the consumer and the one the handler uses
    /// may be clones of each other (cloning shares the pool).
    pub async fn begin_for(&self, msg: &ClaimedMessage) -> Result<MessageTx<DB>, StoreError> {
        let tx = PooledTx::begin(self.pool())
            .await
            .map_err(|e| crate::backend::map_sqlx_error::<DB>("begin", e))?;
        Ok(MessageTx {
            tx,
            store: self.clone(),
            key: msg.key.clone(),
            token: msg.token,
            retention: msg.retention,
        })
    }

    /// [`SqlStore::complete_in_tx`] with `msg`'s key, token and retention, in a transaction
    /// of your own (on your own pool to the same database, for instance).
    pub async fn complete_message_in_tx(
        &self,
        conn: &mut DB::Connection,
        msg: &ClaimedMessage,
        result: Option<&[u8]>,
    ) -> Result<CompleteOutcome, StoreError> {
        self.complete_in_tx(conn, &msg.key, msg.token, result, msg.retention)
            .await
    }
}
