//! Completions: the batch completion script, and `complete_with` /
//! `complete_batch_with`, which apply a handler's Redis commands in the same script.

use crate::codec::result_field;
use crate::lua;
use crate::store::{clamp_ms, RedisStore};
use bytes::Bytes;
use idemq_core::{
    ClaimedMessage, CompleteOutcome, Completion, HandlerError, HandlerResult, LeaseLost, StoreError,
};
use redis::{Cmd, Value};

/// Appends effect commands to a script call: their count, then each one's length and
/// words. Cursor commands (SCAN …) and empty commands are refused: not effects.
fn push_effects(c: &mut Cmd, effects: &[Cmd]) -> Result<(), HandlerError> {
    c.arg(effects.len());
    for (i, effect) in effects.iter().enumerate() {
        let mut args: Vec<&[u8]> = Vec::new();
        for a in effect.args_iter() {
            match a {
                redis::Arg::Simple(b) => args.push(b),
                redis::Arg::Cursor => {
                    return Err(HandlerError::Permanent(
                        format!(
                            "effect command {} is a cursor command (SCAN …): not an effect",
                            i + 1
                        )
                        .into(),
                    ))
                }
            }
        }
        if args.is_empty() {
            return Err(HandlerError::Permanent(
                format!("effect command {} is empty", i + 1).into(),
            ));
        }
        c.arg(args.len());
        for a in args {
            c.arg(a);
        }
    }
    Ok(())
}

impl RedisStore {
    /// Applies `effects` (Redis commands: the message's effect on data in this Redis) and
    /// completes `msg` in **one server-side script**, so the effect and the dedup record
    /// commit together or not at all — the Redis counterpart of `idemq_sql`'s
    /// `begin_for` … `commit`. A crash before the script leaves neither; after it, both.
    /// Returns what a handler returns (`Ok(result)`, `result` stored for duplicates).
    ///
    /// - The lease was lost (taken over after it expired, or released): nothing is applied,
    ///   and the error is [`HandlerError::Retryable`] with [`LeaseLost`] as its source.
    /// - Completed earlier by this very claim (a retried call whose reply was lost): nothing
    ///   is applied again.
    /// - A command fails (e.g. `WRONGTYPE`): [`HandlerError::Permanent`] naming it. A script
    ///   is atomic but not transactional: **the commands before it stay applied** and the
    ///   record stays in progress, so keep effects to commands that cannot fail on your
    ///   keys.
    /// - In a Redis Cluster every key the commands touch must live on the record's node:
    ///   give them the record's hash tag (`{<group>}`, with
    ///   [`RedisStoreBuilder::hash_tag`](crate::RedisStoreBuilder::hash_tag)), or the server
    ///   refuses the script.
    ///
    /// ```no_run
    /// use idemq_core::{ClaimedMessage, HandlerResult};
    /// use idemq_redis::{redis, RedisStore};
    ///
    /// async fn apply(store: &RedisStore, msg: ClaimedMessage) -> HandlerResult {
    ///     let mut credit = redis::cmd("HINCRBY");
    ///     credit.arg("balances").arg("account-7").arg(100);
    ///     store.complete_with(&msg, &[credit], None).await
    /// }
    /// ```
    pub async fn complete_with(
        &self,
        msg: &ClaimedMessage,
        effects: &[Cmd],
        result: Option<Bytes>,
    ) -> HandlerResult {
        let record = self.redis_key(&msg.key);
        let mut c = redis::cmd("EVALSHA");
        c.arg(&lua::COMPLETE_WITH.sha)
            .arg(1)
            .arg(&record)
            .arg(0)
            .arg(self.cfg.completed_grace_ms)
            .arg(msg.token.0)
            .arg(clamp_ms(msg.retention))
            .arg(result_field(result.as_ref()));
        push_effects(&mut c, effects)?;
        let slot = self.partition(std::iter::once(&msg.key))[0].0;
        let reply = self
            .eval_many(&lua::COMPLETE_WITH, &[c], &[slot], true)
            .await?
            .pop()
            .ok_or_else(|| StoreError::Backend("missing complete_with reply".into()))?;
        let parts = match reply {
            Value::Array(v) if !v.is_empty() => v,
            other => {
                return Err(StoreError::Backend(format!(
                    "unexpected complete_with reply {other:?}"
                ))
                .into())
            }
        };
        match Self::int(&parts[0])? {
            1 | 2 => Ok(result),
            0 => Err(HandlerError::Retryable(
                LeaseLost {
                    key: msg.key.clone(),
                }
                .into(),
            )),
            3 => {
                let which = parts.get(1).map(Self::int).transpose()?.unwrap_or(0);
                let why = Self::reply_text(parts.get(2));
                Err(HandlerError::Permanent(
                    format!(
                        "effect command {which} of `{}` failed: {why} (the commands before it \
                         were applied; the record stays in progress)",
                        msg.key
                    )
                    .into(),
                ))
            }
            _ => Err(Self::corrupt(&msg.key, "not an idemq record").into()),
        }
    }

    /// [`RedisStore::complete_with`] for a batch: applies `effects` and completes every
    /// message of `msgs` in **one server-side script**, then marks them completed so the
    /// engine acks without a completion round trip (the Redis counterpart of `idemq_sql`'s
    /// `batch_handler`). Call it from a [`BatchHandler`](idemq_core::BatchHandler) with the
    /// claimed messages it was given.
    ///
    /// Every lease is checked before anything is written: if one was lost, nothing is
    /// applied and the error is [`HandlerError::Retryable`] with [`LeaseLost`] naming that
    /// key (the engine then runs the batch's messages one by one). A retried call whose
    /// reply was lost applies nothing again. A failing command is as in `complete_with`:
    /// the commands before it stay applied and no record is completed. In a Redis Cluster
    /// the records and the keys the commands touch must share one slot: give the store a
    /// hash tag ([`RedisStoreBuilder::hash_tag`](crate::RedisStoreBuilder::hash_tag)) so a
    /// group's records do.
    ///
    /// ```no_run
    /// use idemq_core::{ClaimedMessage, HandlerError};
    /// use idemq_redis::{redis, RedisStore};
    ///
    /// async fn apply(store: &RedisStore, msgs: Vec<ClaimedMessage>) -> Result<(), HandlerError> {
    ///     let mut credit = redis::cmd("HINCRBY");
    ///     credit.arg("{payments}:balances").arg("account-7").arg(100 * msgs.len() as i64);
    ///     store.complete_batch_with(&msgs, &[credit]).await
    /// }
    /// ```
    pub async fn complete_batch_with(
        &self,
        msgs: &[ClaimedMessage],
        effects: &[Cmd],
    ) -> Result<(), HandlerError> {
        if msgs.is_empty() {
            return Ok(());
        }
        let parts = self.partition(msgs.iter().map(|m| &m.key));
        let slot = parts.first().map_or(0, |p| p.0);
        if parts.iter().any(|p| p.0 != slot) {
            return Err(HandlerError::Permanent(
                "the batch's records live on several Redis Cluster slots: give the store a \
                 hash tag (RedisStoreBuilder::hash_tag) so one script can complete them"
                    .into(),
            ));
        }
        let mut c = redis::cmd("EVALSHA");
        c.arg(&lua::COMPLETE_BATCH_WITH.sha).arg(msgs.len());
        for m in msgs {
            c.arg(self.redis_key(&m.key));
        }
        c.arg(0).arg(self.cfg.completed_grace_ms);
        for m in msgs {
            c.arg(m.token.0).arg(clamp_ms(m.retention));
        }
        push_effects(&mut c, effects)?;
        let reply = self
            .eval_many(&lua::COMPLETE_BATCH_WITH, &[c], &[slot], true)
            .await?
            .pop()
            .ok_or_else(|| StoreError::Backend("missing complete_batch_with reply".into()))?;
        let parts = match reply {
            Value::Array(v) if !v.is_empty() => v,
            other => {
                return Err(StoreError::Backend(format!(
                    "unexpected complete_batch_with reply {other:?}"
                ))
                .into())
            }
        };
        let at = |i: usize| -> Result<i64, StoreError> {
            parts
                .get(i)
                .map(Self::int)
                .transpose()
                .map(Option::unwrap_or_default)
        };
        let key_at = |i: i64| {
            usize::try_from(i - 1)
                .ok()
                .and_then(|i| msgs.get(i))
                .map(|m| m.key.clone())
        };
        match at(0)? {
            1 | 2 => {
                for m in msgs {
                    m.mark_completed();
                }
                Ok(())
            }
            0 => {
                let key = key_at(at(1)?).unwrap_or_else(|| msgs[0].key.clone());
                Err(HandlerError::Retryable(LeaseLost { key }.into()))
            }
            3 => {
                let which = at(1)?;
                let why = Self::reply_text(parts.get(2));
                Err(HandlerError::Permanent(
                    format!(
                        "effect command {which} of a batch of {} failed: {why} (the commands \
                         before it were applied; no record was completed)",
                        msgs.len()
                    )
                    .into(),
                ))
            }
            _ => {
                let key = key_at(at(1)?).unwrap_or_else(|| msgs[0].key.clone());
                Err(Self::corrupt(&key, "not an idemq record").into())
            }
        }
    }

    /// [`DedupStore::complete_batch`](idemq_core::DedupStore::complete_batch): one
    /// completion script per slot (per group with hash tags), in one round trip.
    pub(crate) async fn complete_all(
        &self,
        items: &[Completion],
    ) -> Result<Vec<CompleteOutcome>, StoreError> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let parts = self.partition(items.iter().map(|c| &c.key));
        let slots: Vec<u16> = parts.iter().map(|p| p.0).collect();
        let cmds: Vec<Cmd> = parts
            .iter()
            .map(|(_, idx)| {
                let mut c = redis::cmd("EVALSHA");
                c.arg(&lua::COMPLETE.sha).arg(idx.len());
                for &i in idx {
                    c.arg(self.redis_key(&items[i].key));
                }
                c.arg(0).arg(self.cfg.completed_grace_ms);
                for &i in idx {
                    let it = &items[i];
                    c.arg(it.token.0)
                        .arg(clamp_ms(it.retention))
                        .arg(result_field(it.result.as_ref()));
                }
                c
            })
            .collect();
        let replies = self.eval_many(&lua::COMPLETE, &cmds, &slots, true).await?;
        let mut out = vec![CompleteOutcome::Fenced; items.len()];
        for ((_, idx), reply) in parts.iter().zip(&replies) {
            let vals = match reply {
                Value::Array(v) if v.len() == idx.len() => v,
                other => {
                    return Err(StoreError::Backend(format!(
                        "unexpected complete reply {other:?}"
                    )))
                }
            };
            for (&i, v) in idx.iter().zip(vals) {
                out[i] = match Self::int(v)? {
                    1 => CompleteOutcome::Completed,
                    2 => CompleteOutcome::AlreadyCompleted,
                    0 => CompleteOutcome::Fenced,
                    _ => return Err(Self::corrupt(&items[i].key, "not an idemq record")),
                };
            }
        }
        Ok(out)
    }
}
