//! Claims: the `SET NX GET` fast path, the claim script, and a failed batch's leases
//! given back.

use crate::codec::{claim_identity, decode_record, write_identity};
use crate::errors::store_err;
use crate::lua;
use crate::pipeline::Reply;
use crate::store::{clamp_ms, RedisStore};
use idemq_core::store::check_distinct_keys;
use idemq_core::{
    evaluate_claim_request, now_ms, ClaimOutcome, ClaimRequest, ClaimVerdict, DedupStore,
    FencingToken, Lease, StoreError,
};
use redis::{Cmd, Value};

/// One decoded claim answer, before errors are settled for the whole batch.
type ClaimAnswer = Result<ClaimOutcome, StoreError>;

impl RedisStore {
    /// [`DedupStore::claim_batch`]: the fast path where on, then the claim script.
    pub(crate) async fn claim_all(
        &self,
        reqs: &[ClaimRequest],
    ) -> Result<Vec<ClaimOutcome>, StoreError> {
        check_distinct_keys(reqs)?;
        if reqs.is_empty() {
            return Ok(Vec::new());
        }
        let tokens: Vec<FencingToken> = reqs
            .iter()
            .map(|r| r.token.unwrap_or_else(FencingToken::random))
            .collect();
        let leases: Vec<i64> = reqs.iter().map(|r| clamp_ms(r.lease)).collect();
        let mut answers: Vec<Option<ClaimAnswer>> = (0..reqs.len()).map(|_| None).collect();
        let scripted: Vec<usize> = if self.fast_claims {
            match self.claim_fast(reqs, &tokens, &leases, &mut answers).await {
                Ok(s) => s,
                Err(e) => return Err(self.fail_batch(reqs, answers, e).await),
            }
        } else {
            (0..reqs.len()).collect()
        };
        if !scripted.is_empty() {
            if let Err(e) = self
                .claim_scripted(reqs, &tokens, &leases, &scripted, &mut answers)
                .await
            {
                return Err(self.fail_batch(reqs, answers, e).await);
            }
        }
        let answers: Vec<ClaimAnswer> = answers
            .into_iter()
            .map(|a| a.unwrap_or_else(|| Err(StoreError::Backend("no answer for key".into()))))
            .collect();
        if let Some(pos) = answers.iter().position(Result::is_err) {
            // Settle the whole batch as failed; leases it acquired are given back.
            self.release_all(reqs, &answers).await;
            let mut answers = answers;
            let err = answers.swap_remove(pos).err();
            return Err(err.unwrap_or_else(|| StoreError::Backend("claim failed".into())));
        }
        Ok(answers.into_iter().filter_map(Result::ok).collect())
    }

    /// The fast path, one round trip: `SET key record NX GET PX ttl` per key, pipelined.
    /// A nil reply is a fresh acquisition; an existing record is judged by
    /// [`idemq_core::evaluate_claim`] itself. Returns the keys whose record must be rewritten
    /// (takeover, retention over), which go through the claim script.
    async fn claim_fast(
        &self,
        reqs: &[ClaimRequest],
        tokens: &[FencingToken],
        leases: &[i64],
        answers: &mut [Option<ClaimAnswer>],
    ) -> Result<Vec<usize>, StoreError> {
        let now = now_ms();
        let mut cmds = Vec::with_capacity(reqs.len());
        let mut slots = Vec::with_capacity(reqs.len());
        // One scratch buffer for every key and record: the commands copy the bytes.
        let (mut k, mut v) = (Vec::with_capacity(128), Vec::with_capacity(256));
        for (i, r) in reqs.iter().enumerate() {
            use std::io::Write;
            k.clear();
            self.write_redis_key(&mut k, &r.key);
            v.clear();
            write_identity(
                &mut v,
                tokens[i],
                r.payload_hash.as_ref(),
                r.worker.as_deref(),
            );
            // Writing into a Vec cannot fail.
            let _ = write!(v, "{}|1|{now}|||-", now + leases[i]);
            let mut c = redis::cmd("SET");
            c.arg(&k[..])
                .arg(&v[..])
                .arg("NX")
                .arg("GET")
                .arg("PX")
                .arg(leases[i] + self.cfg.in_progress_grace_ms);
            cmds.push(c);
            slots.push(self.slot_of(&k));
        }
        let all: Vec<usize> = (0..reqs.len()).collect();
        let (groups, order) = self.groups(&cmds, &slots, &all);
        let replies = self.send(&groups, true).await;
        if replies.len() != reqs.len() {
            return Err(StoreError::Backend(format!(
                "redis answered {} replies to {} claims",
                replies.len(),
                reqs.len()
            )));
        }
        let mut scripted = Vec::new();
        let mut unreplicated = None;
        for (i, reply) in order.into_iter().zip(replies) {
            let r = &reqs[i];
            let v = match reply {
                Reply::Value(v) => v,
                Reply::Unreplicated(v, e) => {
                    // Decoded like the others, so the batch's failure gives back what it
                    // acquired at once instead of leaving it to its lease end.
                    unreplicated = Some(e);
                    v
                }
                Reply::NoScript => {
                    answers[i] = Some(Err(StoreError::Backend("SET answered NOSCRIPT".into())));
                    continue;
                }
                Reply::Failed(e) => {
                    answers[i] = Some(Err(e));
                    continue;
                }
            };
            answers[i] = match v {
                Value::Nil => Some(Ok(ClaimOutcome::Acquired(Lease {
                    token: tokens[i],
                    until_ms: now + leases[i],
                    attempt: 1,
                    takeover: false,
                }))),
                Value::BulkString(b) => match decode_record(r.key.clone(), &b) {
                    Ok(rec) => match evaluate_claim_request(Some(&rec), r, now) {
                        ClaimVerdict::Answer(o) => Some(Ok(o)),
                        ClaimVerdict::AcquireFresh | ClaimVerdict::TakeOver => {
                            scripted.push(i);
                            None
                        }
                    },
                    Err(e) => Some(Err(Self::corrupt(&r.key, e))),
                },
                Value::ServerError(e) if e.code() == "WRONGTYPE" => Some(Err(Self::corrupt(
                    &r.key,
                    "not an idemq record (wrong type)",
                ))),
                Value::ServerError(e) => Some(Err(store_err(e.into()))),
                other => Some(Err(StoreError::Backend(format!(
                    "unexpected SET reply {other:?}"
                )))),
            };
        }
        match unreplicated {
            Some(e) => Err(e),
            None => Ok(scripted),
        }
    }

    /// The claim script over the keys `idx`: the whole decision and write, atomically.
    async fn claim_scripted(
        &self,
        reqs: &[ClaimRequest],
        tokens: &[FencingToken],
        leases: &[i64],
        idx: &[usize],
        answers: &mut [Option<ClaimAnswer>],
    ) -> Result<(), StoreError> {
        let parts: Vec<(u16, Vec<usize>)> = self
            .partition(idx.iter().map(|&i| &reqs[i].key))
            .into_iter()
            .map(|(slot, p)| (slot, p.into_iter().map(|j| idx[j]).collect()))
            .collect();
        let slots: Vec<u16> = parts.iter().map(|p| p.0).collect();
        let cmds: Vec<Cmd> = parts
            .iter()
            .map(|(_, part)| {
                let mut c = redis::cmd("EVALSHA");
                c.arg(&lua::CLAIM.sha).arg(part.len());
                for &i in part {
                    c.arg(self.redis_key(&reqs[i].key));
                }
                // ARGV[1] is unused: the script reads the server's `TIME`.
                c.arg(0).arg(self.cfg.in_progress_grace_ms);
                for &i in part {
                    let r = &reqs[i];
                    c.arg(leases[i]).arg(claim_identity(
                        tokens[i],
                        r.payload_hash.as_ref(),
                        r.worker.as_deref(),
                    ));
                }
                c
            })
            .collect();
        let replies = self.eval_many(&lua::CLAIM, &cmds, &slots, true).await?;
        for ((_, part), reply) in parts.iter().zip(&replies) {
            // The reply starts with the server's time: the leases acquired end there.
            let (now, vals) = match reply {
                Value::Array(v) if v.len() % 3 == 1 => match Self::int(&v[0]) {
                    Ok(now) => (now, &v[1..]),
                    Err(e) => {
                        for &i in part {
                            answers[i] = Some(Err(StoreError::Backend(format!(
                                "claim reply without the server's time: {e}"
                            ))));
                        }
                        continue;
                    }
                },
                other => {
                    for &i in part {
                        answers[i] = Some(Err(StoreError::Backend(format!(
                            "unexpected claim reply {other:?}"
                        ))));
                    }
                    continue;
                }
            };
            let lease = |i: usize, attempt: u32, takeover: bool| {
                ClaimOutcome::Acquired(Lease {
                    token: tokens[i],
                    until_ms: now + leases[i],
                    attempt,
                    takeover,
                })
            };
            // Every key not named in the reply was acquired fresh (attempt 1).
            for &i in part {
                answers[i] = Some(Ok(lease(i, 1, false)));
            }
            for t in vals.chunks_exact(3) {
                let pos = match Self::int(&t[0]).map(usize::try_from) {
                    Ok(Ok(p)) if (1..=part.len()).contains(&p) => p,
                    _ => {
                        return Err(StoreError::Backend(format!(
                            "claim reply names no key of the call: {:?}",
                            t[0]
                        )))
                    }
                };
                let i = part[pos - 1];
                let key = &reqs[i].key;
                let (code, payload) = (&t[1], &t[2]);
                answers[i] = Some((|| {
                    Ok(match Self::int(code)? {
                        c @ (1 | 2) => {
                            let attempt = u32::try_from(Self::int(payload)?)
                                .map_err(|_| Self::corrupt(key, "attempt out of range"))?;
                            lease(i, attempt, c == 2)
                        }
                        3 => ClaimOutcome::Duplicate(Self::decode(key, payload)?),
                        4 => ClaimOutcome::InFlight {
                            until_ms: Self::int(payload)?,
                        },
                        5 => ClaimOutcome::PayloadConflict(Self::decode(key, payload)?),
                        7 => ClaimOutcome::RolledBack(Self::decode(key, payload)?),
                        6 => {
                            let rec = Self::decode(key, payload)?;
                            ClaimOutcome::Acquired(Lease {
                                token: rec.token,
                                until_ms: rec.lease_until_ms,
                                attempt: rec.attempts,
                                takeover: false,
                            })
                        }
                        9 => {
                            let why = match payload {
                                Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
                                other => format!("{other:?}"),
                            };
                            return Err(Self::corrupt(key, why));
                        }
                        c => return Err(StoreError::Backend(format!("unknown claim code {c}"))),
                    })
                })());
            }
        }
        Ok(())
    }

    /// A batch failed part-way: give back what it acquired so far, answer `err`.
    async fn fail_batch(
        &self,
        reqs: &[ClaimRequest],
        answers: Vec<Option<ClaimAnswer>>,
        err: StoreError,
    ) -> StoreError {
        let got: Vec<ClaimAnswer> = answers
            .into_iter()
            .map(|a| a.unwrap_or_else(|| Err(StoreError::Backend("unanswered".into()))))
            .collect();
        self.release_all(reqs, &got).await;
        err
    }

    /// Gives back the leases a failed batch acquired, so its keys do not wait for expiry.
    async fn release_all(&self, reqs: &[ClaimRequest], answers: &[ClaimAnswer]) {
        for (r, a) in reqs.iter().zip(answers) {
            if let Ok(ClaimOutcome::Acquired(l)) = a {
                if let Err(e) = self.release(&r.key, l.token).await {
                    tracing::warn!(key = %r.key, error = %e, "could not release a lease of a failed batch");
                }
            }
        }
    }
}
