//! The server's clock, as this process can know it.
//!
//! JetStream has no "time now" request and no server-side compare-on-time, so leases are
//! judged by the client against the *server's* time: [`ServerClock::now_ms`] is the `ts`
//! field of the stream leader's `STREAM.INFO` answer (the time the leader gathered it,
//! by the clock that also stamps every message it stores), plus the time elapsed since
//! that answer arrived on this process's **monotonic** clock. The client's wall clock is
//! never read, so a consumer whose clock is wrong by an hour judges leases like the others.
//!
//! The estimate is a lower bound: the leader's clock was at `ts` somewhere between the
//! request and the answer, so it is at least `ts + elapsed` now, and at most one round trip
//! ahead of that. A lower bound errs on the safe side: a lease is never seen as ended
//! before the leader's clock passes its end (a takeover may come up to one round trip
//! late). The reading is refreshed every `clock_resync` (default 1 s) so a stepped server
//! clock or a new leader (another machine) is followed; between refreshes monotonic time
//! drifts from the server's by parts per million.

use crate::errors::request_err;
use async_nats::jetstream::response::Response;
use async_nats::jetstream::Context;
use idemq_core::StoreError;
use serde::Deserialize;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

#[derive(Deserialize)]
struct InfoTs {
    ts: Option<String>,
}

#[derive(Clone, Copy)]
struct Reading {
    server_ms: i64,
    at: Instant,
}

/// The stream leader's clock (see the module docs).
pub(crate) struct ServerClock {
    js: Context,
    stream: String,
    resync: Duration,
    last: Mutex<Option<Reading>>,
    refresh: tokio::sync::Mutex<()>,
}

impl ServerClock {
    pub(crate) fn new(js: Context, stream: String, resync: Duration) -> Self {
        Self {
            js,
            stream,
            resync,
            last: Mutex::new(None),
            refresh: tokio::sync::Mutex::new(()),
        }
    }

    fn fresh(&self) -> Option<i64> {
        let last = *self.last.lock().unwrap_or_else(|p| p.into_inner());
        let r = last?;
        let age = r.at.elapsed();
        (age < self.resync).then(|| r.server_ms.saturating_add(age.as_millis() as i64))
    }

    /// Milliseconds since the epoch on the stream leader's clock (a lower bound).
    pub(crate) async fn now_ms(&self) -> Result<i64, StoreError> {
        if let Some(now) = self.fresh() {
            return Ok(now);
        }
        // One refresh at a time; the others wait for it and read its result.
        let _one = self.refresh.lock().await;
        if let Some(now) = self.fresh() {
            return Ok(now);
        }
        let server_ms = self.read_server().await?;
        let at = Instant::now();
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Some(Reading { server_ms, at });
        Ok(server_ms)
    }

    /// Forgets the reading, so the next call asks the server (after a reconnect).
    pub(crate) fn invalidate(&self) {
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    async fn read_server(&self) -> Result<i64, StoreError> {
        let subject = format!("STREAM.INFO.{}", self.stream);
        let answer: Response<InfoTs> = self
            .js
            .request(subject, &serde_json::json!({}))
            .await
            .map_err(|e| request_err("read the server time (STREAM.INFO)", e))?;
        let ts = match answer {
            Response::Ok(InfoTs { ts: Some(ts) }) => ts,
            Response::Ok(InfoTs { ts: None }) => {
                return Err(StoreError::Config(format!(
                "the NATS server's STREAM.INFO for {} carries no `ts`: idemq judges leases on the \
                     server's clock and needs nats-server 2.10 or newer",
                self.stream
            )))
            }
            Response::Err { error } => {
                return Err(crate::errors::api_err(
                    "read the server time (STREAM.INFO)",
                    &error,
                ))
            }
        };
        let t = OffsetDateTime::parse(&ts, &Rfc3339).map_err(|e| {
            StoreError::Backend(format!("the server's time {ts:?} is not RFC 3339: {e}"))
        })?;
        Ok((t.unix_timestamp_nanos() / 1_000_000) as i64)
    }
}
