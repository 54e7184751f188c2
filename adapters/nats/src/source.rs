//! The durable pull-consumer [`Source`]: a background task fetches batches and keeps
//! unsettled deliveries alive with progress acks; deliveries reach `poll` through the core's
//! [`ChannelSource`], or in ordered mode through per-subject lanes (`lanes.rs`); settlements
//! go to each message's ack subject.

use crate::envelope::{dead_letter_headers, stored_to_envelope, to_envelope, DeadLetterOrigin};
use crate::lanes::{Fetched, GiveBack, Lanes, Limits, Room};
use crate::link::{connect, Link};
use crate::publisher::send_and_confirm;
use crate::NatsError;
use async_nats::header::HeaderMap;
use async_nats::jetstream::consumer::{pull, AckPolicy, PullConsumer};
use async_nats::jetstream::context::GetStreamErrorKind;
use async_nats::jetstream::message::PublishMessage as Publish;
use async_nats::jetstream::{self, AckKind, ErrorCode};
use async_nats::Subject;
use async_trait::async_trait;
use bytes::Bytes;
use futures::{FutureExt, StreamExt};
use idemq_core::adapter::{channel_source, ChannelSender, ChannelSource, SharedState};
use idemq_core::envelope::Position;
use idemq_core::publish::PublishError;
use idemq_core::source::{Delivery, Readiness, ReadinessProbe, Settle, Source, SourceError};
use idemq_core::{Envelope, RetryPolicy};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

/// Header of a dead-letter copy: why it was rejected.
pub const DLQ_REASON: &str = "idemq-dlq-reason";
/// Header of a dead-letter copy: the subject it was consumed from.
pub const DLQ_SUBJECT: &str = "idemq-dlq-subject";
/// Header of a dead-letter copy: the stream it was consumed from.
pub const DLQ_STREAM: &str = "idemq-dlq-stream";
/// Header of a dead-letter copy: its sequence in that stream.
pub const DLQ_SEQUENCE: &str = "idemq-dlq-sequence";
/// Header of a dead-letter copy: the original's `Nats-Msg-Id`, when it had one. The copy's
/// own `Nats-Msg-Id` names the dead-lettering instead (see [`NatsSource`]'s `reject`).
pub const DLQ_MSG_ID: &str = "idemq-dlq-msg-id";

/// Settings of a [`NatsSource`] (`Debug` shows the URL without its credentials).
#[derive(Clone)]
pub struct NatsSourceConfig {
    /// `nats://HOST:PORT`, several separated by commas; credentials as user info
    /// (`nats://user:password@host:port` or `nats://token@host:port`).
    pub url: String,
    /// The stream to consume.
    pub stream: String,
    /// The durable pull consumer's name (created, or updated to these settings).
    pub durable: String,
    /// Filter subjects of the consumer (wildcards allowed); empty: the whole stream.
    pub subjects: Vec<String>,
    /// Create the stream (file storage, [`NatsSourceConfig::subjects`] as its subjects) when
    /// it does not exist; off: a missing stream is a configuration error.
    pub declare_stream: bool,
    /// Messages asked for per pull request (and the local buffer's size).
    pub batch: usize,
    /// How long one pull request waits on the server for messages before it is renewed.
    pub fetch_wait: Duration,
    /// The consumer's `AckWait`: how long the server waits for a settlement before it
    /// redelivers. The source sends progress acks for deliveries unsettled after half of it,
    /// so only a crashed or cut-off source lets it run out.
    pub ack_wait: Duration,
    /// The consumer's `max_deliver` (`-1`: unlimited). The server stops delivering a message
    /// after that many attempts *without* dead-lettering it: keep it unlimited or above the
    /// engine's `RetryPolicy::max_attempts`, which dead-letters through `reject`.
    pub max_deliver: i64,
    /// The consumer's `max_ack_pending` (`0`: the server's default, 1000). `1` keeps the
    /// stream's order even across a crash (one message at a time).
    pub max_ack_pending: i64,
    /// Per-subject order: deliveries of one subject are handed out one at a time, the next
    /// only when the previous is settled, and a nack holds the delivery locally (progress
    /// acks keep it) so nothing newer of its subject overtakes it. Order holds within one
    /// source's life; after a crash the server redelivers the dead source's messages after
    /// `AckWait`, possibly behind newer ones, unless `max_ack_pending` is 1. Off: deliveries
    /// are handed out as fetched and a nack is a `-NAK` with its delay.
    ///
    /// A subject waiting for its held delivery does not hold up the others: the source keeps
    /// up to `4 × batch` (at least 64) fetched messages, of which such a subject keeps a
    /// quarter; its later messages are given back to the server (a `-NAK` whose delay ends
    /// when the held delivery may go out again, counted in
    /// [`GIVEN_BACK`](crate::metrics::GIVEN_BACK)) and handed out in order once back. Each
    /// give-back spends one of the message's `max_deliver` deliveries; one that has no
    /// delivery left to spend is kept instead. The server still sends nothing new while
    /// `max_ack_pending` messages are unsettled, given-back ones included: when a held
    /// subject's backlog fills that window, intake stops for every subject until the held
    /// delivery is settled, and [`readiness`](Source::readiness) says `Waiting` and why.
    pub ordered: bool,
    /// Where `reject` publishes; `None`: `idemq.dlq.<stream>`. It must not be a subject this
    /// consumer reads (it would consume its own dead letters).
    pub dead_letter_subject: Option<String>,
    /// The stream created to store dead letters when no stream captures the dead-letter
    /// subject; `None`: `<stream>_DLQ`.
    pub dead_letter_stream: Option<String>,
    /// The name put in every envelope's [`SourceRef::cluster`](idemq_core::SourceRef).
    pub cluster: Option<String>,
    /// Longest wait for the first connection.
    pub connect_timeout: Duration,
    /// Longest wait for a JetStream API answer, a double ack's confirmation or a
    /// dead-letter copy's `PubAck`.
    pub request_timeout: Duration,
}

impl std::fmt::Debug for NatsSourceConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsSourceConfig")
            .field("url", &crate::redact(&self.url))
            .field("stream", &self.stream)
            .field("durable", &self.durable)
            .field("subjects", &self.subjects)
            .field("declare_stream", &self.declare_stream)
            .field("batch", &self.batch)
            .field("fetch_wait", &self.fetch_wait)
            .field("ack_wait", &self.ack_wait)
            .field("max_deliver", &self.max_deliver)
            .field("max_ack_pending", &self.max_ack_pending)
            .field("ordered", &self.ordered)
            .field("dead_letter_subject", &self.dead_letter_subject)
            .field("dead_letter_stream", &self.dead_letter_stream)
            .field("cluster", &self.cluster)
            .field("connect_timeout", &self.connect_timeout)
            .field("request_timeout", &self.request_timeout)
            .finish()
    }
}

impl NatsSourceConfig {
    /// Consumes the existing stream `stream` at `url` through the durable consumer
    /// `durable`: batches of 100, `AckWait` 30 s, unlimited deliveries, unordered.
    pub fn new(
        url: impl Into<String>,
        stream: impl Into<String>,
        durable: impl Into<String>,
    ) -> Self {
        Self {
            url: url.into(),
            stream: stream.into(),
            durable: durable.into(),
            subjects: Vec::new(),
            declare_stream: false,
            batch: 100,
            fetch_wait: Duration::from_secs(5),
            ack_wait: Duration::from_secs(30),
            max_deliver: -1,
            max_ack_pending: 0,
            ordered: false,
            dead_letter_subject: None,
            dead_letter_stream: None,
            cluster: None,
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(5),
        }
    }

    /// The dead-letter subject.
    pub fn dead_letter_subject_name(&self) -> String {
        self.dead_letter_subject
            .clone()
            .unwrap_or_else(|| format!("idemq.dlq.{}", self.stream))
    }

    /// The stream created for dead letters when none captures the subject.
    pub fn dead_letter_stream_name(&self) -> String {
        self.dead_letter_stream
            .clone()
            .unwrap_or_else(|| format!("{}_DLQ", self.stream))
    }

    fn check(&self) -> Result<(), NatsError> {
        let bad_name = |n: &str| {
            n.is_empty() || n.contains(|c: char| c.is_whitespace() || matches!(c, '.' | '*' | '>'))
        };
        let problem = if bad_name(&self.stream) {
            Some(format!(
                "stream name {:?}: a stream name is not empty and has no spaces, '.', '*' or '>'",
                self.stream
            ))
        } else if bad_name(&self.durable) {
            Some(format!("durable name {:?}: a consumer name is not empty and has no spaces, '.', '*' or '>'", self.durable))
        } else if self.batch == 0 {
            Some("batch 0 would never fetch: ask for at least 1 message per pull (e.g. 100)".into())
        } else if self.ack_wait < Duration::from_secs(1) {
            Some(format!("ack_wait {:?} is shorter than a round trip under load: use 1 s or more (30 s is the server's default)", self.ack_wait))
        } else if self.fetch_wait < Duration::from_millis(100) {
            Some(format!(
                "fetch_wait {:?} renews pull requests in a hot loop: use 100 ms or more",
                self.fetch_wait
            ))
        } else if self.declare_stream && self.subjects.is_empty() {
            Some("declare_stream needs the subjects the new stream captures: set subjects".into())
        } else if self.dead_letter_subject_name().contains(['*', '>', ' ']) {
            Some(format!(
                "dead-letter subject {:?} must be a plain subject, without wildcards",
                self.dead_letter_subject_name()
            ))
        } else {
            None
        };
        problem.map_or(Ok(()), |p| Err(NatsError::Config(p)))
    }

    fn consumer_config(&self) -> pull::Config {
        let (filter_subject, filter_subjects) = match self.subjects.as_slice() {
            [one] => (one.clone(), Vec::new()),
            many => (String::new(), many.to_vec()),
        };
        pull::Config {
            durable_name: Some(self.durable.clone()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: self.ack_wait,
            max_deliver: self.max_deliver,
            max_ack_pending: self.max_ack_pending,
            filter_subject,
            filter_subjects,
            ..pull::Config::default()
        }
    }
}

/// Whether a subject filter (`*` one token, `>` the rest) covers a plain subject.
fn covers(filter: &str, subject: &str) -> bool {
    let mut want = filter.split('.');
    let mut have = subject.split('.');
    loop {
        match (want.next(), have.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(_)) => {}
            (Some(w), Some(h)) if w == h => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

/// A fetched message the source answers for until it is settled.
struct Tracked {
    /// Where its settlement goes: the ack subject of its latest delivery.
    reply: Subject,
    /// When it was fetched or last kept alive.
    touched: Instant,
    seq: Option<u64>,
}

/// What the fetch task, `poll` and every delivery share.
#[derive(Default)]
struct State {
    next_id: u64,
    tracked: HashMap<u64, Tracked>,
    by_seq: HashMap<u64, u64>,
    closed: bool,
    /// Why the last pull failed, until `poll` reports it.
    trouble: Option<String>,
    /// Ordered mode: per subject, what was fetched and not handed out, the delivery held by
    /// a nack, and what was given back.
    lanes: Lanes,
    /// Ordered mode: since when the pull loop has been reading from the server without a
    /// pause (`None` while it waits for room, for the link, or after a failed pull). A
    /// given-back message is expected back only while it reads.
    reading_since: Option<Instant>,
}

impl State {
    /// Ends the source: every ack subject still owed a settlement, and the deliveries kept
    /// here (to be dropped outside the lock: they settle through it).
    fn close(&mut self) -> (Vec<Subject>, Vec<Delivery>) {
        self.closed = true;
        self.by_seq.clear();
        let owed = self.tracked.drain().map(|(_, t)| t.reply).collect();
        (owed, self.lanes.drain())
    }

    /// Stops answering for given-back messages: where each one's `-NAK` goes, with its
    /// delay.
    fn let_go(&mut self, back: Vec<GiveBack>) -> Vec<(Subject, Duration)> {
        back.into_iter()
            .filter_map(|g| {
                let t = self.tracked.remove(&g.id)?;
                if let Some(s) = t.seq {
                    self.by_seq.remove(&s);
                }
                tracing::debug!(subject = %g.subject, seq = ?g.seq, delay = ?g.delay, "ordered: given back behind its subject's held delivery");
                Some((t.reply, g.delay))
            })
            .collect()
    }
}

struct Shared {
    cfg: NatsSourceConfig,
    link: Link,
    js: jetstream::Context,
    dlq: String,
    state: SharedState<State>,
    /// A panic of the background task, returned by every later `poll`.
    fatal: Mutex<Option<String>>,
    /// Acks sent whose confirmation is still awaited; bounded so a server that stopped
    /// answering slows the acks down instead of piling up tasks.
    acks_in_flight: Arc<tokio::sync::Semaphore>,
    /// Ordered mode: what the lanes keep.
    limits: Limits,
    /// The consumer's `max_ack_pending` as the server applies it (`None`: unlimited): the
    /// server sends nothing new while that many messages are unsettled.
    window: Option<usize>,
    /// Ordered mode: wakes the pull loop waiting for room in the lanes.
    room: tokio::sync::Notify,
}

/// Double acks awaiting their confirmation at once, at most.
const MAX_ACKS_IN_FLIGHT: usize = 4096;

/// Ordered mode: how often the pull loop, waiting for room in the lanes, looks again
/// without being notified.
const ROOM_RECHECK: Duration = Duration::from_secs(1);

fn ack_body(kind: AckKind) -> Bytes {
    Bytes::from(kind)
}

impl Shared {
    /// Starts answering for a fetched message, or keeps it back: a redelivered copy of one
    /// still held only refreshes where that one settles.
    fn admit(&self, msg: async_nats::Message) -> Option<Fetched> {
        let Some(reply) = msg.reply.clone() else {
            tracing::warn!(subject = %msg.subject, "message without an ack subject from a pull consumer: skipped");
            return None;
        };
        let env = to_envelope(&msg, self.cfg.cluster.as_deref());
        let seq = match env.source.position {
            Some(Position::Sequence(s)) => Some(s),
            _ => None,
        };
        let mut st = self.state.lock();
        if st.closed {
            return None;
        }
        let held = seq.and_then(|s| st.by_seq.get(&s).copied());
        if let Some(t) = held.and_then(|id| st.tracked.get_mut(&id)) {
            t.reply = reply;
            t.touched = Instant::now();
            metrics::counter!(crate::metrics::REDELIVERED_WHILE_HELD).increment(1);
            return None;
        }
        let id = st.next_id;
        st.next_id += 1;
        st.tracked.insert(
            id,
            Tracked {
                reply,
                touched: Instant::now(),
                seq,
            },
        );
        if let Some(s) = seq {
            st.by_seq.insert(s, id);
        }
        drop(st);
        Some(Fetched {
            stored_ms: env.timestamp_ms,
            env,
            id,
            seq,
        })
    }

    /// A fetched message as a delivery, settled through this source.
    fn delivery(self: &Arc<Self>, f: Fetched) -> Delivery {
        let settle = NatsSettle {
            shared: self.clone(),
            id: f.id,
            seq: f.seq,
            stored_ms: f.stored_ms,
            subject: f.env.source.name.clone(),
            envelope: None,
        };
        Delivery::new(f.env, Box::new(settle))
    }

    /// Ordered mode: keeps a fetched message in its subject's lane for `poll`, then waits
    /// while the lanes are full and some can move (the engine takes from them); what a
    /// stalled lane holds beyond its bound, or what blocks intake when none can move, is
    /// given back. False when the source stops meanwhile.
    async fn take_in(&self, f: Fetched, stop: &mut watch::Receiver<bool>) -> bool {
        {
            let mut st = self.state.lock();
            if st.closed {
                return false;
            }
            st.lanes.take_in(f);
        }
        self.state.wake_one();
        let mut paused = false;
        loop {
            let naks = {
                let mut st = self.state.lock();
                if st.closed {
                    return false;
                }
                match st.lanes.room(Instant::now(), &self.limits) {
                    Room::Open => {
                        if paused {
                            st.reading_since = Some(Instant::now());
                        }
                        return true;
                    }
                    Room::Full => {
                        st.reading_since = None;
                        None
                    }
                    Room::GiveBack(back) => Some(st.let_go(back)),
                }
            };
            match naks {
                Some(naks) => self.give_back_delayed(naks).await,
                None => {
                    paused = true;
                    // The lanes notify when they change; the periodic look covers a change
                    // no one notified (a held delivery coming due while no one polls).
                    tokio::select! {
                        _ = stop.changed() => return false,
                        _ = self.room.notified() => {}
                        _ = tokio::time::sleep(ROOM_RECHECK) => {}
                    }
                }
            }
        }
    }

    /// Naks given-back messages with their delays: the server redelivers each no sooner
    /// (and after `AckWait` if a nak is lost: nothing keeps them alive any more).
    async fn give_back_delayed(&self, naks: Vec<(Subject, Duration)>) {
        metrics::counter!(crate::metrics::GIVEN_BACK).increment(naks.len() as u64);
        for (reply, delay) in naks {
            let _ = self
                .link
                .client
                .publish(reply, ack_body(AckKind::Nak(Some(delay))))
                .await;
        }
    }

    /// Ordered mode: the pull loop reads from the server from now on (`true`), or stopped.
    fn reading(&self, on: bool) {
        let mut st = self.state.lock();
        if !on {
            st.reading_since = None;
        } else if st.reading_since.is_none() {
            st.reading_since = Some(Instant::now());
        }
    }

    /// Ordered mode: stops waiting for given-back messages due back `AckWait` ago while the
    /// pull loop was reading all along: the server did not redeliver them (another consumer
    /// of the durable settled them, or they left the stream), and their subject would
    /// otherwise wait for them forever.
    fn expire_given_back(&self) {
        let grace = self.cfg.ack_wait;
        let gone = {
            let mut st = self.state.lock();
            let now = Instant::now();
            let Some(cut) = now.checked_sub(grace) else {
                return;
            };
            if st.reading_since.is_none_or(|t| t > cut) || st.lanes.away() == 0 {
                return;
            }
            st.lanes.expire_away(cut)
        };
        for (subject, seqs) in &gone {
            metrics::counter!(crate::metrics::GIVEN_BACK_MISSING).increment(seqs.len() as u64);
            tracing::warn!(%subject, ?seqs, "given-back messages were not redelivered (settled by another consumer of the durable, or removed from the stream): their subject stops waiting for them");
        }
        if !gone.is_empty() {
            self.state.wake_one();
        }
    }

    /// Why nothing new can arrive, when the server's `max_ack_pending` window is full of
    /// messages this source holds back behind held subjects (ordered mode).
    fn window_stall(&self) -> Option<String> {
        let window = self.window?;
        let st = self.state.lock();
        let pending = st.tracked.len() + st.lanes.away();
        if pending < window {
            return None;
        }
        let stalled = st.lanes.stalled();
        let (first, more) = stalled.split_at(stalled.len().min(3));
        let subjects = match (first, more.len()) {
            ([], _) => return None,
            (first, 0) => first.join(", "),
            (first, n) => format!("{} and {n} more", first.join(", ")),
        };
        Some(format!(
            "no new messages from stream {}: {pending} messages of consumer {} are unsettled and its max_ack_pending is {window}, so the server sends nothing newer until some settle; among them is the backlog held behind a nacked message being retried, of {subjects} (intake resumes once such a message is settled or dead-lettered; a max_ack_pending above what one subject can pile up keeps the other subjects flowing)",
            self.cfg.stream, self.cfg.durable
        ))
    }

    /// Stops answering for delivery `id` and returns where its settlement goes; `None` when
    /// the source was closed or it is settled already. Frees its subject (ordered mode).
    fn release(&self, id: u64, subject: &str) -> Option<Subject> {
        let mut st = self.state.lock();
        if st.closed {
            return None;
        }
        let t = st.tracked.remove(&id)?;
        if let Some(s) = t.seq {
            st.by_seq.remove(&s);
        }
        st.lanes.settled(subject);
        drop(st);
        self.state.wake_one();
        self.room.notify_one();
        Some(t.reply)
    }

    fn note_trouble(&self, why: String) {
        tracing::warn!(stream = %self.cfg.stream, durable = %self.cfg.durable, error = %why, "nats pull failed");
        self.state.lock().trouble = Some(why);
        self.state.wake_one();
    }

    /// Progress acks for everything unsettled past half of `AckWait`.
    async fn keep_alive(&self) {
        let due = self.cfg.ack_wait / 2;
        let now = Instant::now();
        let replies: Vec<Subject> = {
            let mut st = self.state.lock();
            st.tracked
                .values_mut()
                .filter(|t| now.duration_since(t.touched) >= due)
                .map(|t| {
                    t.touched = now;
                    t.reply.clone()
                })
                .collect()
        };
        for r in replies {
            if self
                .link
                .client
                .publish(r, ack_body(AckKind::Progress))
                .await
                .is_ok()
            {
                metrics::counter!(crate::metrics::PROGRESS).increment(1);
            }
        }
    }

    /// Naks `owed` so the server redelivers them at once (best effort: `AckWait` otherwise).
    async fn give_back(&self, owed: Vec<Subject>) {
        for r in owed {
            let _ = self
                .link
                .client
                .publish(r, ack_body(AckKind::Nak(None)))
                .await;
        }
        let _ = self.link.client.flush().await;
    }

    /// The durable consumer, created or updated to this source's settings.
    async fn consumer(&self) -> Result<PullConsumer, String> {
        self.js
            .create_consumer_on_stream(self.cfg.consumer_config(), self.cfg.stream.clone())
            .await
            .map_err(|e| e.to_string())
    }
}

/// The settlement handle of one delivery.
struct NatsSettle {
    shared: Arc<Shared>,
    id: u64,
    seq: Option<u64>,
    /// When the stream stored the message (from the ack subject): part of its dead-letter
    /// copy's `Nats-Msg-Id`.
    stored_ms: Option<i64>,
    subject: String,
    /// Handed back by the engine before a nack, reject or drop (see `Settle::take_back`).
    envelope: Option<Envelope>,
}

impl NatsSettle {
    fn ignored(&self, op: &'static str) -> Result<(), SourceError> {
        tracing::debug!(subject = %self.subject, seq = ?self.seq, op, "stale or settled delivery: ignored");
        metrics::counter!(crate::metrics::STALE_SETTLES, "op" => op).increment(1);
        Ok(())
    }

    /// Sends `kind` to `reply` and waits for the server's confirmation.
    async fn confirmed(&self, reply: Subject, kind: AckKind) -> Result<(), SourceError> {
        let what = match kind {
            AckKind::Term => "term",
            _ => "ack",
        };
        match self.shared.link.client.request(reply, ack_body(kind)).await {
            Ok(_) => Ok(()),
            Err(e) => {
                use async_nats::RequestErrorKind as K;
                let text = format!(
                    "{what} of {} #{} not confirmed: {e} (the server redelivers it after AckWait if it missed it)",
                    self.subject,
                    self.seq.unwrap_or_default()
                );
                Err(match e.kind() {
                    K::NoResponders => SourceError::Broker(text),
                    _ => SourceError::Disconnected(text),
                })
            }
        }
    }

    /// Ordered mode: the delivery waits here, unsettled and kept alive, until `delay` ends.
    fn hold(&mut self, mut env: Envelope, delay: Duration) {
        let mut st = self.shared.state.lock();
        if st.closed || !st.tracked.contains_key(&self.id) {
            // The source is closed or the message settled: nothing to hold. (A delivery
            // made of it and dropped would abandon itself, and come back here.)
            return;
        }
        env.redelivered = true;
        env.delivery_count = Some(env.delivery_count.unwrap_or(1).saturating_add(1));
        let again = NatsSettle {
            shared: self.shared.clone(),
            id: self.id,
            seq: self.seq,
            stored_ms: self.stored_ms,
            subject: self.subject.clone(),
            envelope: None,
        };
        let d = Delivery::new(env, Box::new(again));
        st.lanes
            .hold(self.subject.clone(), d, Instant::now() + delay);
        drop(st);
        self.shared.state.wake_one();
        // The subject is stalled now: the pull loop may have to give back its backlog.
        self.shared.room.notify_one();
    }

    /// The dead-letter copy: the message's payload and its headers as
    /// [`dead_letter_headers`] turns them into the copy's.
    async fn dead_letter_copy(&mut self, reason: &str) -> Result<(HeaderMap, Bytes), SourceError> {
        let env = match self.envelope.take() {
            Some(env) => env,
            None => self.stored().await?,
        };
        let cfg = &self.shared.cfg;
        let origin = DeadLetterOrigin {
            stream: &cfg.stream,
            durable: &cfg.durable,
            subject: &env.source.name,
            sequence: self.seq,
            stored_ms: self.stored_ms,
        };
        let headers = dead_letter_headers(&env.headers, reason, &origin);
        Ok((headers, env.payload))
    }

    /// The message as the stream stores it (when the engine did not hand the envelope back).
    async fn stored(&self) -> Result<Envelope, SourceError> {
        let cfg = &self.shared.cfg;
        let Some(seq) = self.seq else {
            return Err(SourceError::Broker(format!(
                "cannot dead-letter a message of {} without its stream sequence",
                self.subject
            )));
        };
        let fetched = match self.shared.js.get_stream(&cfg.stream).await {
            Ok(stream) => stream.get_raw_message(seq).await.map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        let m = fetched.map_err(|e| {
            SourceError::Broker(format!(
                "reading {}#{seq} to dead-letter it: {e}",
                cfg.stream
            ))
        })?;
        Ok(stored_to_envelope(m, cfg.cluster.as_deref()))
    }
}

#[async_trait]
impl Settle for NatsSettle {
    /// The double ack is sent here and confirmed in the background: awaiting each
    /// confirmation in turn made the engine, which settles a batch's deliveries one after
    /// another, wait a round trip per message. A confirmation that does not come is logged
    /// and counted ([`ACKS_UNCONFIRMED`](crate::metrics::ACKS_UNCONFIRMED)); the server then
    /// redelivers the message after `AckWait` and the dedup record absorbs it.
    async fn ack(&mut self) -> Result<(), SourceError> {
        let Some(reply) = self.shared.release(self.id, &self.subject) else {
            return self.ignored("ack");
        };
        let permit = self
            .shared
            .acks_in_flight
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| SourceError::Disconnected("the nats source is closed".into()))?;
        let client = self.shared.link.client.clone();
        let (subject, seq) = (self.subject.clone(), self.seq.unwrap_or_default());
        tokio::spawn(async move {
            if let Err(e) = client.request(reply, ack_body(AckKind::Ack)).await {
                metrics::counter!(crate::metrics::ACKS_UNCONFIRMED).increment(1);
                tracing::warn!(%subject, seq, error = %e, "ack not confirmed; the server redelivers the message after AckWait if it missed it");
            }
            drop(permit);
        });
        Ok(())
    }

    async fn nack(&mut self, redeliver_after: Duration) -> Result<(), SourceError> {
        if self.shared.cfg.ordered {
            if let Some(env) = self.envelope.take() {
                if self.is_stale() {
                    return self.ignored("nack");
                }
                self.hold(env, redeliver_after);
                return Ok(());
            }
            // Only a caller settling through `Settle` directly, bypassing `Delivery`, gets
            // here: the server redelivers it instead (kept, if not in order).
        }
        let Some(reply) = self.shared.release(self.id, &self.subject) else {
            return self.ignored("nack");
        };
        let delay = (!redeliver_after.is_zero()).then_some(redeliver_after);
        self.shared
            .link
            .client
            .publish(reply, ack_body(AckKind::Nak(delay)))
            .await
            .map_err(|e| {
                SourceError::Disconnected(format!(
                    "nak of {} not sent: {e} (the server redelivers it after AckWait)",
                    self.subject
                ))
            })
    }

    async fn reject(&mut self, reason: &str) -> Result<(), SourceError> {
        if self.is_stale() || !self.shared.state.lock().tracked.contains_key(&self.id) {
            return self.ignored("reject");
        }
        let (headers, payload) = self.dead_letter_copy(reason).await?;
        let sh = &self.shared;
        let publish = Publish::build().payload(payload).headers(headers);
        send_and_confirm(&sh.js, sh.dlq.clone(), publish)
            .await
            .map_err(|e| match e {
                PublishError::Disconnected(t) | PublishError::Ambiguous(t) => {
                    SourceError::Disconnected(format!("dead-letter copy to {}: {t}", sh.dlq))
                }
                other => SourceError::Broker(format!("dead-letter copy to {}: {other}", sh.dlq)),
            })?;
        metrics::counter!(crate::metrics::DEAD_LETTERS, "stream" => sh.cfg.stream.clone())
            .increment(1);
        match sh.release(self.id, &self.subject) {
            Some(reply) => self.confirmed(reply, AckKind::Term).await,
            // Closed meanwhile: the copy is stored, the original comes back and is a
            // duplicate for the dedup store.
            None => Ok(()),
        }
    }

    fn abandon(&mut self) {
        if self.is_stale() {
            return;
        }
        if self.shared.cfg.ordered {
            if let Some(env) = self.envelope.take() {
                self.hold(env, Duration::ZERO);
                return;
            }
        }
        let Some(reply) = self.shared.release(self.id, &self.subject) else {
            return;
        };
        // Must not block: the nak runs on the runtime when there is one; without one the
        // server redelivers after AckWait.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let client = self.shared.link.client.clone();
            rt.spawn(async move {
                let _ = client.publish(reply, ack_body(AckKind::Nak(None))).await;
            });
        }
    }

    fn is_stale(&self) -> bool {
        self.shared.state.lock().closed
    }

    fn take_back(&mut self, envelope: Envelope) {
        self.envelope = Some(envelope);
    }
}

/// The background work of a source: pull requests, progress acks, and (ordered mode)
/// forgetting given-back messages the server does not redeliver. Fetched messages go to
/// `tx`, or into the lanes when it is `None` (ordered mode).
async fn run(
    shared: Arc<Shared>,
    consumer: PullConsumer,
    tx: Option<ChannelSender>,
    stop: watch::Receiver<bool>,
) {
    let tick = (shared.cfg.ack_wait / 4).max(Duration::from_millis(50));
    let heartbeat = {
        let shared = shared.clone();
        let mut stop = stop.clone();
        async move {
            let mut every = tokio::time::interval(tick);
            loop {
                tokio::select! {
                    _ = stop.changed() => return,
                    _ = every.tick() => {}
                }
                if shared.link.is_up() {
                    shared.keep_alive().await;
                }
                shared.expire_given_back();
            }
        }
    };
    tokio::join!(heartbeat, pull_loop(shared, consumer, tx, stop));
}

/// Asks for batches while the source runs; a failed pull request is reported to `poll` and
/// retried after a back-off, with the consumer created again (it may have been deleted).
async fn pull_loop(
    shared: Arc<Shared>,
    mut consumer: PullConsumer,
    tx: Option<ChannelSender>,
    mut stop: watch::Receiver<bool>,
) {
    let cfg = &shared.cfg;
    let mut rests =
        RetryPolicy::backoff(Duration::from_millis(100), Duration::from_secs(5)).waits();
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = shared.link.restored() => {}
        }
        // A continuous pull: the next request for a batch goes out before this one is
        // used up, so the server's round trip overlaps the engine's work (one request at a
        // time left the consumer idle between batches).
        let asked = consumer
            .stream()
            .max_messages_per_batch(cfg.batch)
            .expires(cfg.fetch_wait)
            .heartbeat(cfg.fetch_wait / 2)
            .messages()
            .await;
        let failed = match asked {
            Ok(mut batch) => {
                shared.reading(true);
                loop {
                    let next = tokio::select! {
                        _ = stop.changed() => return,
                        _ = shared.link.down() => break None,
                        next = batch.next() => next,
                    };
                    match next {
                        None => break None,
                        Some(Err(e)) => break Some(e.to_string()),
                        Some(Ok(m)) => {
                            rests.reset();
                            let Some(f) = shared.admit(m.message) else {
                                continue;
                            };
                            let Some(tx) = &tx else {
                                if !shared.take_in(f, &mut stop).await {
                                    return;
                                }
                                continue;
                            };
                            tokio::select! {
                                _ = stop.changed() => return,
                                sent = tx.send(shared.delivery(f)) => if sent.is_err() { return },
                            }
                        }
                    }
                }
            }
            Err(e) => Some(e.to_string()),
        };
        shared.reading(false);
        let Some(why) = failed else { continue };
        shared.note_trouble(format!(
            "pull request to consumer {} of stream {} failed: {why}",
            cfg.durable, cfg.stream
        ));
        tokio::select! {
            _ = stop.changed() => return,
            _ = tokio::time::sleep(rests.next_delay()) => {}
        }
        match shared.consumer().await {
            Ok(c) => consumer = c,
            Err(e) => {
                tracing::warn!(durable = %cfg.durable, error = %e, "recreating the nats consumer failed; retrying")
            }
        }
    }
}

/// A consumer of one JetStream stream through a durable pull consumer; see the crate docs
/// for how settlements map.
pub struct NatsSource {
    shared: Arc<Shared>,
    inner: ChannelSource,
    stop: watch::Sender<bool>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl std::fmt::Debug for NatsSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsSource")
            .field("stream", &self.shared.cfg.stream)
            .field("durable", &self.shared.cfg.durable)
            .field("servers", &self.shared.link.servers)
            .finish_non_exhaustive()
    }
}

/// Creates the stream storing dead letters unless one captures `dlq` already.
async fn ensure_dead_letter_stream(
    js: &jetstream::Context,
    cfg: &NatsSourceConfig,
    dlq: &str,
) -> Result<(), NatsError> {
    if js.stream_by_subject(dlq.to_string()).await.is_ok() {
        return Ok(());
    }
    let name = cfg.dead_letter_stream_name();
    js.get_or_create_stream(jetstream::stream::Config {
        name: name.clone(),
        subjects: vec![dlq.to_string()],
        ..Default::default()
    })
    .await
    .map(|_| ())
    .map_err(|e| NatsError::Stream {
        stream: name,
        reason: format!(
            "cannot create it for the dead-letter subject {dlq}: {e} (create a stream capturing {dlq}, or set dead_letter_subject to a subject one captures)"
        ),
    })
}

impl NatsSource {
    /// Connects, checks (or creates) the stream, creates the dead-letter stream when no
    /// stream captures the dead-letter subject, creates or updates the durable consumer, and
    /// then fetches in the background. Fails with what to fix when the server cannot be
    /// reached, the stream is missing, the dead-letter subject is one this consumer reads,
    /// or the server refuses the consumer.
    pub async fn connect(cfg: NatsSourceConfig) -> Result<Self, NatsError> {
        cfg.check()?;
        let link = connect(
            &cfg.url,
            &format!("idemq-source {}/{}", cfg.stream, cfg.durable),
            cfg.connect_timeout,
            cfg.request_timeout,
        )
        .await?;
        let js = jetstream::ContextBuilder::new()
            .timeout(cfg.request_timeout)
            .build(link.client.clone());
        let stream = match js.get_stream(&cfg.stream).await {
            Ok(s) => s,
            Err(e) => {
                let missing = matches!(e.kind(), GetStreamErrorKind::JetStream(ref j) if j.error_code() == ErrorCode::STREAM_NOT_FOUND);
                if !(missing && cfg.declare_stream) {
                    let reason = if missing {
                        format!("does not exist at {}: create it (`nats stream add {} --subjects '<subject>'`) or set declare_stream with the subjects", link.servers, cfg.stream)
                    } else {
                        format!("cannot be read at {}: {e} (is JetStream enabled on the server: nats-server -js?)", link.servers)
                    };
                    return Err(NatsError::Stream {
                        stream: cfg.stream.clone(),
                        reason,
                    });
                }
                js.create_stream(jetstream::stream::Config {
                    name: cfg.stream.clone(),
                    subjects: cfg.subjects.clone(),
                    ..Default::default()
                })
                .await
                .map_err(|e| NatsError::Stream {
                    stream: cfg.stream.clone(),
                    reason: format!("cannot be created with subjects {:?}: {e}", cfg.subjects),
                })?
            }
        };
        let dlq = cfg.dead_letter_subject_name();
        let read = if cfg.subjects.is_empty() {
            stream.cached_info().config.subjects.clone()
        } else {
            cfg.subjects.clone()
        };
        if let Some(f) = read.iter().find(|f| covers(f, &dlq)) {
            return Err(NatsError::Config(format!(
                "dead-letter subject {dlq} is read by this consumer (subject filter {f}): it would consume its own dead letters; set dead_letter_subject outside {f}"
            )));
        }
        ensure_dead_letter_stream(&js, &cfg, &dlq).await?;
        let consumer = stream
            .create_consumer(cfg.consumer_config())
            .await
            .map_err(|e| NatsError::Consumer {
                stream: cfg.stream.clone(),
                durable: cfg.durable.clone(),
                reason: e.to_string(),
            })?;
        tracing::info!(stream = %cfg.stream, durable = %cfg.durable, servers = %link.servers, batch = cfg.batch, ordered = cfg.ordered, "nats pull consumer started");
        let (tx, inner) = channel_source(cfg.batch);
        // Ordered mode fills the lanes instead of the channel.
        let tx = (!cfg.ordered).then_some(tx);
        let window = usize::try_from(consumer.cached_info().config.max_ack_pending)
            .ok()
            .filter(|w| *w > 0);
        let shared = Arc::new(Shared {
            limits: Limits::new(cfg.batch, cfg.max_deliver),
            window,
            room: tokio::sync::Notify::new(),
            cfg,
            link,
            js,
            dlq,
            state: SharedState::new(State::default()),
            fatal: Mutex::new(None),
            acks_in_flight: Arc::new(tokio::sync::Semaphore::new(MAX_ACKS_IN_FLIGHT)),
        });
        let (stop, stop_rx) = watch::channel(false);
        let report = {
            let shared = shared.clone();
            move |text: String| {
                tracing::error!(stream = %shared.cfg.stream, panic = %text, "the nats source task panicked: the source stops");
                *shared.fatal.lock().unwrap_or_else(|e| e.into_inner()) =
                    Some(format!("the nats source task panicked: {text}"));
                shared.state.wake_one();
            }
        };
        let task = tokio::spawn(watched(run(shared.clone(), consumer, tx, stop_rx), report));
        Ok(Self {
            shared,
            inner,
            stop,
            task: Some(task),
        })
    }

    /// Why `poll` cannot deliver now, if it cannot: the task died, the server is
    /// unreachable, or the last pull failed (reported once).
    fn obstacle(&self) -> Option<SourceError> {
        if let Some(p) = self
            .shared
            .fatal
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
        {
            return Some(SourceError::Broker(p));
        }
        if !self.shared.link.is_up() {
            return Some(SourceError::Disconnected(self.shared.link.unreachable()));
        }
        self.shared
            .state
            .lock()
            .trouble
            .take()
            .map(SourceError::Broker)
    }

    /// Unordered: what the channel holds, as fetched.
    async fn poll_fetched(&mut self, max: usize) -> Result<Option<Vec<Delivery>>, SourceError> {
        loop {
            if let Some(got) = self.inner.poll(max).now_or_never() {
                return got;
            }
            if let Some(e) = self.obstacle() {
                return Err(e);
            }
            tokio::select! {
                got = self.inner.poll(max) => return got,
                _ = self.shared.link.down() => {}
                _ = self.shared.state.woken() => {}
            }
        }
    }

    /// Ordered: due held deliveries first, then the next kept message of each subject with
    /// nothing out, in stream order.
    fn hand_out(&self, max: usize) -> Vec<Delivery> {
        let (mut out, fetched) = self.shared.state.lock().lanes.hand_out(Instant::now(), max);
        if !out.is_empty() || !fetched.is_empty() {
            self.shared.room.notify_one();
        }
        out.extend(fetched.into_iter().map(|f| self.shared.delivery(f)));
        out
    }

    /// Ordered: what the lanes can hand out, waiting for the pull loop, a held delivery's
    /// delay or a settlement when they can hand out nothing.
    async fn poll_ordered(&mut self, max: usize) -> Result<Option<Vec<Delivery>>, SourceError> {
        loop {
            let out = self.hand_out(max);
            if !out.is_empty() {
                return Ok(Some(out));
            }
            if let Some(e) = self.obstacle() {
                return Err(e);
            }
            let next_due = self.shared.state.lock().lanes.next_due();
            let due = async {
                match next_due {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = due => {}
                _ = self.shared.link.down() => {}
                _ = self.shared.state.woken() => {}
            }
        }
    }

    /// Marks everything stale and takes it out: the naks owed and the deliveries kept.
    fn end(&self) -> (Vec<Subject>, Vec<Delivery>) {
        let ended = self.shared.state.lock().close();
        self.shared.room.notify_one();
        ended
    }
}

/// Runs the background task; a panic in it is handed to `report` as text (the source keeps
/// it for every later `poll`) instead of ending the task as if the source were closed.
async fn watched(task: impl std::future::Future<Output = ()>, report: impl FnOnce(String)) {
    let outcome = std::panic::AssertUnwindSafe(task).catch_unwind().await;
    if let Err(panic) = outcome {
        let text = match (panic.downcast_ref::<String>(), panic.downcast_ref::<&str>()) {
            (Some(s), _) => s.clone(),
            (None, Some(s)) => (*s).to_string(),
            (None, None) => "a panic without a message".to_string(),
        };
        report(text);
    }
}

#[async_trait]
impl Source for NatsSource {
    async fn poll(&mut self, max: usize) -> Result<Option<Vec<Delivery>>, SourceError> {
        if self.task.is_none() {
            return Err(SourceError::Config("poll after close".into()));
        }
        let max = max.max(1);
        let got = if self.shared.cfg.ordered {
            self.poll_ordered(max).await
        } else {
            self.poll_fetched(max).await
        };
        match (got, self.obstacle()) {
            // The channel ended because the task died, not because the source was closed.
            (Ok(None), Some(e)) => Err(e),
            (got, _) => got,
        }
    }

    async fn close(&mut self) -> Result<(), SourceError> {
        let (owed, kept) = self.end();
        drop(kept);
        self.shared.give_back(owed).await;
        // The acks already sent get their confirmations (or their timeouts) before the
        // connection goes.
        let all = u32::try_from(MAX_ACKS_IN_FLIGHT).unwrap_or(u32::MAX);
        let _confirmed = self.shared.acks_in_flight.acquire_many(all).await;
        let _ = self.stop.send(true);
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
        self.inner.close().await
    }

    fn readiness(&self) -> ReadinessProbe {
        let shared = self.shared.clone();
        ReadinessProbe::new(move || {
            let cfg = &shared.cfg;
            if !shared.link.is_up() {
                Readiness::Waiting(shared.link.unreachable())
            } else if let Some(why) = shared.window_stall() {
                Readiness::Waiting(why)
            } else {
                Readiness::Ready(format!(
                    "pulling {} from stream {}",
                    cfg.durable, cfg.stream
                ))
            }
        })
    }
}

impl Drop for NatsSource {
    fn drop(&mut self) {
        // A crash as far as the consumer goes, but a polite one: what was unsettled is
        // nakked (when a runtime is there to send it) instead of waiting out AckWait.
        let (owed, kept) = self.end();
        drop(kept);
        let _ = self.stop.send(true);
        if owed.is_empty() {
            return;
        }
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let shared = self.shared.clone();
            rt.spawn(async move { shared.give_back(owed).await });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subject_filters_cover_what_they_match() {
        assert!(covers("orders.>", "orders.dlq"));
        assert!(covers("orders.*", "orders.dlq"));
        assert!(covers("idemq.dlq.ORDERS", "idemq.dlq.ORDERS"));
        assert!(!covers("orders.*", "orders.eu.dlq"));
        assert!(!covers("orders.>", "orders"));
        assert!(!covers("orders", "idemq.dlq.ORDERS"));
        assert!(covers(">", "idemq.dlq.ORDERS"));
    }

    #[test]
    fn settings_that_cannot_work_say_what_to_fix() {
        let ok = NatsSourceConfig::new("nats://127.0.0.1:1", "ORDERS", "billing");
        assert!(ok.check().is_ok());
        let cases: Vec<(NatsSourceConfig, &str)> = vec![
            (
                NatsSourceConfig::new("nats://h", "OR.DERS", "b"),
                "stream name",
            ),
            (
                NatsSourceConfig::new("nats://h", "ORDERS", "bil ling"),
                "durable name",
            ),
            (
                NatsSourceConfig {
                    batch: 0,
                    ..ok.clone()
                },
                "batch 0",
            ),
            (
                NatsSourceConfig {
                    ack_wait: Duration::from_millis(10),
                    ..ok.clone()
                },
                "ack_wait",
            ),
            (
                NatsSourceConfig {
                    declare_stream: true,
                    ..ok.clone()
                },
                "subjects",
            ),
            (
                NatsSourceConfig {
                    dead_letter_subject: Some("dlq.>".into()),
                    ..ok.clone()
                },
                "wildcards",
            ),
        ];
        for (cfg, says) in cases {
            let e = cfg.check().expect_err(says).to_string();
            assert!(e.contains(says), "{e}");
        }
    }

    #[tokio::test]
    async fn a_panic_in_the_background_task_is_reported_not_swallowed() {
        let kept = Arc::new(Mutex::new(None::<String>));
        let sink = kept.clone();
        let task = async { panic!("injected: a message the conversion could not take") };
        watched(task, move |text| *sink.lock().expect("lock") = Some(text)).await;
        let text = kept.lock().expect("lock").clone();
        assert_eq!(
            text.as_deref(),
            Some("injected: a message the conversion could not take")
        );
        let calm = Arc::new(Mutex::new(None::<String>));
        let sink = calm.clone();
        watched(async {}, move |text| {
            *sink.lock().expect("lock") = Some(text)
        })
        .await;
        assert!(calm.lock().expect("lock").is_none(), "nothing to report");
    }

    #[test]
    fn debug_output_hides_credentials() {
        let cfg = NatsSourceConfig::new("nats://app:hunter2@h:4222,nats://tok3n@h2:4222", "S", "d");
        let shown = format!("{cfg:?}");
        assert!(
            !shown.contains("hunter2") && !shown.contains("tok3n"),
            "{shown}"
        );
        assert!(shown.contains("nats://app:***@h:4222"), "{shown}");
    }
}
