//! The unique-index strategy's keys table inside the caller's transaction:
//! [`SqlStore::insert_key_in_tx`] and [`SqlStore::purge_keys_older_than`].

use crate::backend::{map_sqlx_error, SqlBackend, Val};
use crate::exec::{check_key, limit_i64, retry_now};
use crate::store::SqlStore;
use idemq_core::store::duration_ms;
use idemq_core::{DedupKey, StoreError};
use std::time::Duration;

/// The answer of [`SqlStore::insert_key_in_tx`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyInsert {
    /// The key is new: go on with the business writes, then commit.
    Inserted,
    /// The key was inserted before (or by a concurrent transaction that committed): skip
    /// the business writes. The caller's transaction is still usable.
    Duplicate,
}

impl<DB: SqlBackend> SqlStore<DB> {
    /// The unique-index strategy: inserts `key` into the keys table inside the caller's
    /// transaction. [`KeyInsert::Duplicate`] means it was processed (committed) before; the
    /// statement never raises on a duplicate, so the transaction stays usable (PostgreSQL
    /// would otherwise abort it). If another open transaction holds the same key, this waits
    /// for it to commit or roll back.
    ///
    /// Keys stay until [`SqlStore::purge_keys_older_than`] removes them.
    pub async fn insert_key_in_tx(
        &self,
        conn: &mut DB::Connection,
        key: &DedupKey,
    ) -> Result<KeyInsert, StoreError> {
        check_key(key)?;
        let n = DB::execute(
            conn,
            &self.q.insert_key,
            vec![Val::Key(key.as_str().to_owned())],
        )
        .await
        .map_err(|e| map_sqlx_error::<DB>("insert_key_in_tx", e))?;
        Ok(if n > 0 {
            KeyInsert::Inserted
        } else {
            KeyInsert::Duplicate
        })
    }

    /// Deletes up to `limit` unique-index keys inserted more than `age` ago; returns how
    /// many. A redelivery of a purged key is processed again: keep `age` above the longest
    /// redelivery horizon of your brokers.
    pub async fn purge_keys_older_than(
        &self,
        age: Duration,
        limit: usize,
    ) -> Result<u64, StoreError> {
        if limit == 0 {
            return Ok(0);
        }
        let mut conn = self.acquire().await?;
        retry_now!(
            "purge_keys",
            DB::execute(
                &mut conn,
                &self.q.purge_keys,
                vec![
                    Val::I64(Some(duration_ms(age))),
                    Val::I64(Some(limit_i64(limit))),
                ],
            )
        )
    }
}
