//! Sending commands: scripts loaded and re-sent after `NOSCRIPT`, pipelines per target
//! (the server, a slot, a master), `WAIT` for replicas, cluster redirections followed, keys
//! grouped by slot into script calls, and the replies decoded.

use crate::cluster;
use crate::codec::decode_record;
use crate::conn::StoreConn;
use crate::errors::store_err;
use crate::lua::Lua;
use crate::store::RedisStore;
use idemq_core::{DedupKey, DedupRecord, StoreError};
use redis::aio::ConnectionLike;
use redis::cluster_routing::{
    MultipleNodeRoutingInfo, ResponsePolicy, Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr,
};
use redis::{Cmd, Pipeline, Value};

/// The same script call as `EVAL <source>` instead of `EVALSHA <sha>`.
fn with_source(cmd: &Cmd, s: &Lua) -> Cmd {
    let mut c = redis::cmd("EVAL");
    c.arg(&s.src);
    for a in cmd.args_iter().skip(2) {
        if let redis::Arg::Simple(bytes) = a {
            c.arg(bytes);
        }
    }
    c
}

/// Where a pipeline goes.
#[derive(Clone, PartialEq, Eq, Hash)]
pub(crate) enum Target {
    /// The standalone server.
    Server,
    /// The master of a slot, through the cluster client.
    Slot(u16),
    /// A master (`host:port`), on the store's own connection to it.
    Node(String),
}

/// Commands for one [`Target`], with the slot of each.
pub(crate) struct Batch {
    target: Target,
    pipe: Pipeline,
    slots: Vec<u16>,
}

/// One command's answer in [`RedisStore::send`].
pub(crate) enum Reply {
    Value(Value),
    /// `NOSCRIPT`: the script was not run.
    NoScript,
    Failed(StoreError),
    /// Run on the master, but `WAIT` saw too few replicas acknowledge it: the call must
    /// fail (the error), and what it acquired may be given back (the value says what).
    Unreplicated(Value, StoreError),
}

fn reply_of(v: Value) -> Reply {
    match v {
        Value::ServerError(e) => match e.code() {
            "NOSCRIPT" => Reply::NoScript,
            // A key of another type: the caller names the key (`Corrupt`).
            "WRONGTYPE" => Reply::Value(Value::ServerError(e)),
            _ => Reply::Failed(store_err(e.into())),
        },
        v => Reply::Value(v),
    }
}

/// The error for a `WAIT` reply (`acked`: replicas that acknowledged) short of `replicas`.
fn wait_shortfall(acked: Option<Value>, replicas: u32, timeout_ms: i64) -> Option<StoreError> {
    let got = match acked {
        Some(Value::Int(n)) => n,
        Some(Value::ServerError(e)) => return Some(store_err(e.into())),
        other => {
            return Some(StoreError::Backend(format!(
                "unexpected WAIT reply {other:?}"
            )))
        }
    };
    if got >= i64::from(replicas) {
        return None;
    }
    metrics::counter!("idemq_redis_wait_shortfall_total").increment(1);
    tracing::warn!(
        acked = got,
        replicas,
        timeout_ms,
        "redis write acknowledged by too few replicas: failing the call (no ack)"
    );
    Some(StoreError::Unavailable(format!(
        "WAIT {replicas} {timeout_ms}: only {got} replica(s) acknowledged the write in time; \
         it may not survive a failover, so the call fails and is retried"
    )))
}

/// The same failure for another command of a failed pipeline.
fn same_failure(e: &StoreError) -> StoreError {
    match e {
        StoreError::Unavailable(m) => StoreError::Unavailable(m.clone()),
        StoreError::Backend(m) => StoreError::Backend(m.clone()),
        StoreError::Config(m) => StoreError::Config(m.clone()),
        StoreError::Corrupt { key, reason } => StoreError::Corrupt {
            key: key.clone(),
            reason: reason.clone(),
        },
        StoreError::KeyTooLong { len, max } => StoreError::KeyTooLong {
            len: *len,
            max: *max,
        },
    }
}

impl RedisStore {
    pub(crate) async fn load(&self, s: &Lua) -> Result<(), StoreError> {
        let mut cmd = redis::cmd("SCRIPT");
        cmd.arg("LOAD").arg(&s.src);
        let v = match &self.conn {
            StoreConn::Single(c) => c.clone().req_packed_command(&cmd).await,
            // Every master: replicas get it when promoted, from the NOSCRIPT fallback.
            StoreConn::Cluster(h) => {
                let all = RoutingInfo::MultiNode((
                    MultipleNodeRoutingInfo::AllMasters,
                    Some(ResponsePolicy::AllSucceeded),
                ));
                h.call(|mut c| async move { c.route_command(&cmd, all).await })
                    .await
            }
        }
        .map_err(store_err)?;
        let sha: String = redis::from_owned_redis_value(v).map_err(store_err)?;
        if sha != s.sha {
            return Err(StoreError::Backend(format!(
                "SCRIPT LOAD of {} returned {sha}, expected {}",
                s.name, s.sha
            )));
        }
        Ok(())
    }

    /// Runs `EVALSHA` commands, `cmds[i]` on the keys of slot `slots[i]` (0 on a
    /// standalone server), in one round trip (one pipeline per slot on a cluster, all at
    /// once). Commands answered `NOSCRIPT` (a restarted or flushed server, a promoted
    /// replica) are re-sent once as `EVAL` with the source, which works whatever the script
    /// cache holds and caches the script again. `durable`: the calls write what must
    /// survive a failover (see
    /// [`RedisStoreBuilder::wait_replicas`](crate::RedisStoreBuilder::wait_replicas)).
    pub(crate) async fn eval_many(
        &self,
        s: &Lua,
        cmds: &[Cmd],
        slots: &[u16],
        durable: bool,
    ) -> Result<Vec<Value>, StoreError> {
        let all: Vec<usize> = (0..cmds.len()).collect();
        let mut out: Vec<Option<Value>> = vec![None; cmds.len()];
        let mut noscript = Vec::new();
        let (groups, order) = self.groups(cmds, slots, &all);
        for (i, r) in order.into_iter().zip(self.send(&groups, durable).await) {
            match r {
                Reply::Value(v) => out[i] = Some(v),
                Reply::NoScript => noscript.push(i),
                Reply::Failed(e) | Reply::Unreplicated(_, e) => return Err(e),
            }
        }
        if !noscript.is_empty() {
            tracing::info!(
                script = s.name,
                "redis lost its script cache (restart, failover or SCRIPT FLUSH); sending the source"
            );
            let by_source: Vec<Cmd> = cmds.iter().map(|c| with_source(c, s)).collect();
            let (groups, order) = self.groups(&by_source, slots, &noscript);
            let again = self.send(&groups, durable).await;
            for (i, r) in order.into_iter().zip(again) {
                match r {
                    Reply::Value(v) => out[i] = Some(v),
                    Reply::NoScript => {
                        return Err(StoreError::Backend(format!(
                            "EVAL of script {} answered NOSCRIPT",
                            s.name
                        )))
                    }
                    Reply::Failed(e) | Reply::Unreplicated(_, e) => return Err(e),
                }
            }
        }
        out.into_iter()
            .map(|v| v.ok_or_else(|| StoreError::Backend("missing script reply".into())))
            .collect()
    }

    /// The commands `which` (positions in `cmds`) as pipelines: one in all on a standalone
    /// server; on a cluster one per master (by the slot map) or, while the map is unknown,
    /// one per slot. Also answers the positions in the order the pipelines send them (the
    /// order of [`RedisStore::send`]'s replies).
    pub(crate) fn groups(
        &self,
        cmds: &[Cmd],
        slots: &[u16],
        which: &[usize],
    ) -> (Vec<Batch>, Vec<usize>) {
        let map = match &self.conn {
            StoreConn::Cluster(h) => h.slot_map(),
            StoreConn::Single(_) => None,
        };
        let target = |slot: u16| match (&self.conn, &map) {
            (StoreConn::Single(_), _) => Target::Server,
            (StoreConn::Cluster(_), Some(m)) => m
                .master_of(slot)
                .map_or(Target::Slot(slot), |a| Target::Node(a.to_owned())),
            (StoreConn::Cluster(_), None) => Target::Slot(slot),
        };
        let mut members: Vec<(Target, Vec<usize>)> = Vec::new();
        let mut at: std::collections::HashMap<Target, usize> = std::collections::HashMap::new();
        for &i in which {
            let t = target(slots[i]);
            let g = match at.get(&t) {
                Some(&g) => g,
                None => {
                    at.insert(t.clone(), members.len());
                    members.push((t, Vec::new()));
                    members.len() - 1
                }
            };
            members[g].1.push(i);
        }
        let mut order = Vec::with_capacity(which.len());
        let batches = members
            .into_iter()
            .map(|(target, idx)| {
                let mut pipe = redis::pipe();
                for &i in &idx {
                    pipe.add_command(cmds[i].clone());
                }
                let batch = Batch {
                    target,
                    pipe,
                    slots: idx.iter().map(|&i| slots[i]).collect(),
                };
                order.extend(idx);
                batch
            })
            .collect();
        (batches, order)
    }

    /// Sends each batch (all at once) and answers one [`Reply`] per command, batch after
    /// batch. With `durable` and `wait_replicas`, each pipeline ends with `WAIT n timeout`,
    /// on the same connection as its writes; a pipeline whose writes fewer replicas
    /// acknowledged answers [`StoreError::Unavailable`] for each of its commands.
    pub(crate) async fn send(&self, batches: &[Batch], durable: bool) -> Vec<Reply> {
        let wait = if durable {
            self.cfg.wait_replicas
        } else {
            None
        };
        futures::future::join_all(batches.iter().map(|b| self.send_batch(b, wait)))
            .await
            .into_iter()
            .flatten()
            .collect()
    }

    /// One batch; on a master's own connection, the commands answered with a redirection
    /// (not run) go once more to the node it names, one pipeline per node.
    async fn send_batch(&self, b: &Batch, wait: Option<(u32, i64)>) -> Vec<Reply> {
        let n = b.slots.len();
        let (vals, shortfall) = match self.send_pipeline(&b.target, &b.pipe, n, wait).await {
            Ok(sent) => sent,
            Err(failed) => return failed,
        };
        let redirected: Vec<(usize, cluster::Redirect)> = match b.target {
            Target::Node(_) => vals
                .iter()
                .enumerate()
                .filter_map(|(i, v)| cluster::redirect(v).map(|r| (i, r)))
                .collect(),
            _ => Vec::new(),
        };
        let mut out: Vec<Reply> = vals
            .into_iter()
            .map(|v| match &shortfall {
                Some(e) => Reply::Unreplicated(v, same_failure(e)),
                None => reply_of(v),
            })
            .collect();
        if redirected.is_empty() {
            return out;
        }
        if let StoreConn::Cluster(h) = &self.conn {
            h.refresh_slot_map();
        }
        // Not run where they went: once more to the node named, one pipeline per node
        // (`ASKING` before each command of an `ASK`).
        let cmds: Vec<&Cmd> = b.pipe.cmd_iter().collect();
        let mut by_node: Vec<(cluster::Redirect, Pipeline, Vec<usize>)> = Vec::new();
        for (i, r) in redirected {
            if r == cluster::Redirect::Later {
                out[i] = Reply::Failed(StoreError::Unavailable(
                    "redis cluster: slot not served right now (TRYAGAIN/CLUSTERDOWN)".into(),
                ));
                continue;
            }
            let g = match by_node.iter().position(|g| g.0 == r) {
                Some(g) => g,
                None => {
                    by_node.push((r, redis::pipe(), Vec::new()));
                    by_node.len() - 1
                }
            };
            if let cluster::Redirect::Ask(_) = by_node[g].0 {
                by_node[g].1.cmd("ASKING");
            }
            by_node[g].1.add_command(cmds[i].clone());
            by_node[g].2.push(i);
        }
        let again = by_node.iter().map(|(to, pipe, idx)| async move {
            let (addr, asking) = match to {
                cluster::Redirect::Moved(a) => (a.clone(), false),
                cluster::Redirect::Ask(a) => (a.clone(), true),
                cluster::Redirect::Later => (String::new(), false),
            };
            let n = pipe.cmd_iter().count();
            let sent = self
                .send_pipeline(&Target::Node(addr), pipe, n, wait)
                .await
                .map(|(vals, shortfall)| {
                    // Drop the `ASKING` replies: every other one.
                    let vals: Vec<Value> = if asking {
                        vals.into_iter().skip(1).step_by(2).collect()
                    } else {
                        vals
                    };
                    (vals, shortfall)
                })
                .map_err(|failed| {
                    if asking {
                        failed.into_iter().skip(1).step_by(2).collect()
                    } else {
                        failed
                    }
                });
            (idx, sent)
        });
        for (idx, sent) in futures::future::join_all(again).await {
            match sent {
                Ok((vals, shortfall)) => {
                    for (&i, v) in idx.iter().zip(vals) {
                        out[i] = match (&shortfall, cluster::redirect(&v)) {
                            (Some(e), None) => Reply::Unreplicated(v, same_failure(e)),
                            (Some(e), Some(_)) => Reply::Failed(same_failure(e)),
                            // Moved again: the map is being read; the caller retries later.
                            (None, Some(_)) => Reply::Failed(StoreError::Unavailable(
                                "redis cluster: slot moving (redirected twice)".into(),
                            )),
                            (None, None) => reply_of(v),
                        };
                    }
                }
                Err(failed) => {
                    for (&i, r) in idx.iter().zip(failed) {
                        out[i] = r;
                    }
                }
            }
        }
        out
    }

    /// Sends one pipeline of `n` commands (then `WAIT` when `wait`) to `target`: its `n`
    /// replies and the `WAIT` shortfall, or the replies of a pipeline that failed whole.
    async fn send_pipeline(
        &self,
        target: &Target,
        pipe: &Pipeline,
        n: usize,
        wait: Option<(u32, i64)>,
    ) -> Result<(Vec<Value>, Option<StoreError>), Vec<Reply>> {
        let with_wait: Pipeline;
        let pipe = match wait {
            Some((replicas, timeout)) => {
                let mut p = pipe.clone();
                p.cmd("WAIT").arg(replicas).arg(timeout);
                with_wait = p;
                &with_wait
            }
            None => pipe,
        };
        let total = n + usize::from(wait.is_some());
        let sent = match (&self.conn, target) {
            (StoreConn::Single(c), _) => c.clone().req_packed_commands(pipe, 0, total).await,
            (StoreConn::Cluster(h), Target::Node(addr)) => h.node_pipeline(addr, pipe, total).await,
            (StoreConn::Cluster(h), t) => {
                let slot = match t {
                    Target::Slot(slot) => *slot,
                    _ => 0,
                };
                let to = SingleNodeRoutingInfo::SpecificNode(Route::new(slot, SlotAddr::Master));
                h.call(|mut c| async move { c.route_pipeline(pipe, 0, total, to).await })
                    .await
            }
        };
        let all = |r: &dyn Fn() -> Reply| (0..n).map(|_| r()).collect::<Vec<Reply>>();
        let mut vals = match sent {
            Ok(v) if v.len() == total => v,
            Ok(v) => {
                let e = StoreError::Backend(format!(
                    "redis answered {} replies to {total} commands",
                    v.len()
                ));
                return Err(all(&|| Reply::Failed(same_failure(&e))));
            }
            // Through the cluster client one error reply fails the whole pipeline: a script
            // missing there is missing for every call in it.
            Err(e) if e.kind() == redis::ErrorKind::NoScriptError => {
                return Err(all(&|| Reply::NoScript))
            }
            Err(e) => {
                let e = store_err(e);
                return Err(all(&|| Reply::Failed(same_failure(&e))));
            }
        };
        let shortfall = match wait {
            Some((replicas, timeout)) => wait_shortfall(vals.pop(), replicas, timeout),
            None => None,
        };
        Ok((vals, shortfall))
    }

    /// The cluster slot of a Redis key (0 on a standalone server).
    pub(crate) fn slot_of(&self, redis_key: &[u8]) -> u16 {
        if self.is_cluster() {
            cluster::key_slot(redis_key)
        } else {
            0
        }
    }

    /// Splits keys into script invocations: per slot on a cluster (computed from the whole
    /// Redis key, so keys without a hash tag, or with a `{...}` of their own, are grouped
    /// right too), per group with hash tags on a standalone server, and at most
    /// `max_keys_per_script` keys each. Returns the slot and positions in `keys`, in order.
    pub(crate) fn partition<'a>(
        &self,
        keys: impl Iterator<Item = &'a DedupKey>,
    ) -> Vec<(u16, Vec<usize>)> {
        let max = self.cfg.max_keys_per_script;
        let mut parts: Vec<(u16, &str, Vec<usize>)> = Vec::new();
        let mut buf = Vec::with_capacity(128);
        for (i, k) in keys.enumerate() {
            let (slot, g) = if self.is_cluster() {
                buf.clear();
                self.write_redis_key(&mut buf, k);
                (cluster::key_slot(&buf), "")
            } else if self.cfg.hash_tag {
                (0, k.group())
            } else {
                (0, "")
            };
            match parts
                .iter_mut()
                .rev()
                .find(|(ps, pg, v)| *ps == slot && *pg == g && v.len() < max)
            {
                Some((_, _, v)) => v.push(i),
                None => parts.push((slot, g, vec![i])),
            }
        }
        parts.into_iter().map(|(s, _, v)| (s, v)).collect()
    }

    pub(crate) fn corrupt(key: &DedupKey, reason: impl std::fmt::Display) -> StoreError {
        StoreError::Corrupt {
            key: key.to_string(),
            reason: reason.to_string(),
        }
    }

    pub(crate) fn decode(key: &DedupKey, v: &Value) -> Result<DedupRecord, StoreError> {
        match v {
            Value::BulkString(b) => {
                decode_record(key.clone(), b).map_err(|e| Self::corrupt(key, e))
            }
            other => Err(Self::corrupt(
                key,
                format!("unexpected script reply {other:?}"),
            )),
        }
    }

    /// A script's error text (a failed effect command's reply), for the error it becomes.
    pub(crate) fn reply_text(v: Option<&Value>) -> String {
        match v {
            Some(Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
            Some(Value::SimpleString(s)) => s.clone(),
            other => format!("{other:?}"),
        }
    }

    pub(crate) fn int(v: &Value) -> Result<i64, StoreError> {
        match v {
            Value::Int(i) => Ok(*i),
            other => Err(StoreError::Backend(format!(
                "unexpected script reply {other:?}, expected an integer"
            ))),
        }
    }
}
