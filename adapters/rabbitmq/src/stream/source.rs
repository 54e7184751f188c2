//! The stream [`Source`]: a named consumer reading from the offset stored on the broker, the
//! contiguous settled prefix stored back after each batch.

use super::producer::{Inner, ProducerSlot};
use super::{
    confirm_channel, create_stream, stream_envelope, stream_message, ConfirmFailure, StreamEndpoint,
};
use crate::{RabbitError, DLQ_QUEUE, DLQ_REASON};
use async_trait::async_trait;
use futures::{FutureExt, StreamExt};
use idemq_core::adapter::{
    DelayedRedelivery, Epoch, HeldSettle, LocallyHeld, OffsetTracker, PartitionId, SharedState,
};
use idemq_core::envelope::props;
use idemq_core::publish::OutgoingMessage;
use idemq_core::source::{Delivery, Source, SourceError};
use idemq_core::Envelope;
use rabbitmq_stream_client::error::ClientError;
use rabbitmq_stream_client::types::{OffsetSpecification, ResponseCode};
use rabbitmq_stream_client::{Consumer, Environment};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// Header of a dead-lettered stream message: the offset it had in its stream.
pub const DLQ_OFFSET: &str = "idemq-dlq-offset";

/// Where a consumer name with no stored offset starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamStart {
    /// The first message the stream still holds.
    First,
    /// Only messages published after the subscription.
    Next,
    /// This offset.
    Offset(u64),
}

/// Settings of a [`StreamSource`].
#[derive(Debug, Clone)]
pub struct StreamSourceConfig {
    /// `rabbitmq-stream://user:pass@host:port/vhost`.
    pub url: String,
    /// The stream to read.
    pub stream: String,
    /// The consumer name: its offset is stored on the broker under this name (the
    /// equivalent of a consumer group; run one source per name at a time).
    pub consumer_name: String,
    /// Where to start when the broker has no offset stored for the name (default `First`).
    pub start: StreamStart,
    /// Create the stream (and the dead-letter stream) when missing (default true).
    pub create: bool,
    /// Where `reject` publishes; `None` = `<stream>.dlq`.
    pub dead_letter_stream: Option<String>,
    /// Longest wait for the broker to confirm a dead-letter publish.
    pub confirm_timeout: Duration,
    /// The name put in every envelope's `source.cluster`.
    pub cluster: Option<String>,
}

impl StreamSourceConfig {
    /// Reads `stream` as `consumer_name`, from its stored offset (or the first message).
    pub fn new(
        url: impl Into<String>,
        stream: impl Into<String>,
        consumer_name: impl Into<String>,
    ) -> Self {
        Self {
            url: url.into(),
            stream: stream.into(),
            consumer_name: consumer_name.into(),
            start: StreamStart::First,
            create: true,
            dead_letter_stream: None,
            confirm_timeout: Duration::from_secs(30),
            cluster: None,
        }
    }

    /// The dead-letter stream.
    pub fn dead_letter_stream_name(&self) -> String {
        self.dead_letter_stream
            .clone()
            .unwrap_or_else(|| format!("{}.dlq", self.stream))
    }
}

/// A delivery waiting (nacked or dropped) to be handed out again.
struct Held {
    epoch: Epoch,
    offset: u64,
    envelope: Envelope,
}

#[derive(Default)]
struct State {
    tracker: OffsetTracker,
    epoch: Option<Epoch>,
    held: DelayedRedelivery<Held, ()>,
    closed: bool,
}

/// What the source and its deliveries share.
struct Shared {
    part: PartitionId,
    sync: SharedState<State>,
    dlq: DeadLetters,
}

/// The dead-letter stream's producer, opened at the first reject.
struct DeadLetters {
    env: Environment,
    stream: String,
    timeout: Duration,
    producer: ProducerSlot,
}

impl DeadLetters {
    async fn publish(&self, msg: &OutgoingMessage) -> Result<(), SourceError> {
        let fail = |e: String| SourceError::Broker(format!("dead-letter to {}: {e}", self.stream));
        let (tx, mut rx) = confirm_channel();
        let open = || async {
            let p = self.env.producer().build(&self.stream).await;
            p.map(Inner::Plain).map_err(|e| e.to_string())
        };
        let generation = self
            .producer
            .send(stream_message(msg, None), tx, open)
            .await
            .map_err(fail)?;
        let lost = match tokio::time::timeout(self.timeout, rx.recv()).await {
            Ok(Some(Ok(()))) => return Ok(()),
            Ok(Some(Err(ConfirmFailure::Refused(why)))) => return Err(fail(why)),
            Ok(Some(Err(ConfirmFailure::Lost(why)))) => why,
            Ok(None) => "connection lost before the confirm".into(),
            Err(_) => format!("no confirm within {:?}", self.timeout),
        };
        self.producer.discard(generation).await;
        Err(fail(lost))
    }
}

/// A named consumer of one RabbitMQ stream; see the [module](super) docs for how
/// settlements map.
pub struct StreamSource {
    cfg: StreamSourceConfig,
    env: Environment,
    endpoint: StreamEndpoint,
    shared: Arc<Shared>,
    consumer: Option<Consumer>,
}

impl std::fmt::Debug for StreamSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamSource")
            .field("stream", &self.cfg.stream)
            .field("consumer_name", &self.cfg.consumer_name)
            .finish_non_exhaustive()
    }
}

fn client_err(what: &str, e: impl std::fmt::Display) -> SourceError {
    SourceError::Disconnected(format!("{what}: {e}"))
}

impl StreamSource {
    /// Connects, creates the streams when asked, and subscribes from the offset the broker
    /// stored for the consumer name (the one after it), or from
    /// [`StreamSourceConfig::start`].
    pub async fn connect(cfg: StreamSourceConfig) -> Result<Self, RabbitError> {
        if cfg.consumer_name.is_empty() {
            return Err(RabbitError::Config(
                "a stream source needs a consumer name: its offsets are stored under it".into(),
            ));
        }
        let endpoint = StreamEndpoint::parse(&cfg.url)?;
        let env = endpoint.environment().await?;
        let dlq = cfg.dead_letter_stream_name();
        if cfg.create {
            create_stream(&env, &cfg.stream).await?;
            create_stream(&env, &dlq).await?;
        }
        let shared = Arc::new(Shared {
            part: (cfg.stream.clone(), 0),
            sync: SharedState::new(State::default()),
            dlq: DeadLetters {
                env: env.clone(),
                stream: dlq,
                timeout: cfg.confirm_timeout,
                producer: ProducerSlot::new(None),
            },
        });
        let mut src = Self {
            cfg,
            env,
            endpoint,
            shared,
            consumer: None,
        };
        src.subscribe()
            .await
            .map_err(|e| RabbitError::Connect(e.to_string()))?;
        Ok(src)
    }

    /// The offset stored on the broker for the consumer name: the last one processed.
    pub async fn stored_offset(&self) -> Result<Option<u64>, RabbitError> {
        let client = self.endpoint.client().await?;
        let answer = client
            .query_offset(self.cfg.consumer_name.clone(), &self.cfg.stream)
            .await;
        let _ = client.close().await;
        match answer {
            Ok(o) => Ok(Some(o)),
            Err(ClientError::RequestError(ResponseCode::OffsetNotFound)) => Ok(None),
            Err(e) => Err(RabbitError::Connect(format!("query offset: {e}"))),
        }
    }

    /// (Re)subscribes from the stored offset under a new epoch: deliveries of the previous
    /// subscription are stale from now on.
    async fn subscribe(&mut self) -> Result<(), SourceError> {
        if let Some(old) = self.consumer.take() {
            let _ = old.handle().close().await;
        }
        let stored = self
            .stored_offset()
            .await
            .map_err(|e| client_err("stored offset", e))?;
        let (spec, low) = match (stored, self.cfg.start) {
            (Some(o), _) => (OffsetSpecification::Offset(o + 1), o + 1),
            (None, StreamStart::First) => (OffsetSpecification::First, 0),
            (None, StreamStart::Next) => (OffsetSpecification::Next, 0),
            (None, StreamStart::Offset(o)) => (OffsetSpecification::Offset(o), o),
        };
        let consumer = self
            .env
            .consumer()
            .name(&self.cfg.consumer_name)
            .offset(spec)
            .build(&self.cfg.stream)
            .await
            .map_err(|e| client_err("subscribe", e))?;
        {
            let mut st = self.shared.sync.lock();
            let low = i64::try_from(low).unwrap_or(i64::MAX);
            st.epoch = Some(st.tracker.assign(self.shared.part.clone(), low));
            st.held = DelayedRedelivery::new();
        }
        tracing::info!(stream = %self.cfg.stream, consumer = %self.cfg.consumer_name, from = ?stored.map(|o| o + 1), "stream consumer subscribed");
        self.consumer = Some(consumer);
        Ok(())
    }

    fn delivery(&self, epoch: Epoch, offset: u64, envelope: Envelope) -> Delivery {
        Delivery::new(
            envelope,
            Box::new(HeldSettle(StreamSettle {
                shared: self.shared.clone(),
                epoch,
                offset,
                stream: self.cfg.stream.clone(),
                pending: true,
                envelope: None,
            })),
        )
    }

    fn envelope(&self, d: &rabbitmq_stream_client::types::Delivery) -> Envelope {
        let mut env = stream_envelope(&self.cfg.stream, d.offset(), d.message());
        env.source.cluster = self.cfg.cluster.clone();
        env
    }

    /// Stores the committable offset (the last of the contiguous settled prefix).
    async fn commit(&mut self) -> Result<(), SourceError> {
        let commits = self.shared.sync.lock().tracker.take_commits();
        let Some(consumer) = &self.consumer else {
            return Ok(());
        };
        for (p, next) in commits {
            let Ok(last) = u64::try_from(next - 1) else {
                continue;
            };
            // `store_offset` has no answer in the protocol: read it back on the same
            // connection, so that it is stored before the batch counts as committed (a
            // subscription opened right after a crash must see it).
            let stored = match consumer.store_offset(last).await {
                Ok(()) => consumer.query_offset().await.map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            match stored {
                Ok(o) if o >= last => {}
                Ok(o) => {
                    self.shared.sync.lock().tracker.commit_failed(&p, next);
                    return Err(client_err(
                        "store offset",
                        format!("stored {last} but the broker reads back {o}"),
                    ));
                }
                Err(e) => {
                    self.shared.sync.lock().tracker.commit_failed(&p, next);
                    return Err(client_err("store offset", e));
                }
            }
        }
        Ok(())
    }
}

#[async_trait]
impl Source for StreamSource {
    async fn poll(&mut self, max: usize) -> Result<Option<Vec<Delivery>>, SourceError> {
        let max = max.max(1);
        loop {
            let (epoch, next_due) = {
                let mut st = self.shared.sync.lock();
                if st.closed {
                    return Ok(None);
                }
                let Some(epoch) = st.epoch else {
                    return Err(SourceError::Config("stream source not subscribed".into()));
                };
                let due: Vec<Held> = st
                    .held
                    .pop_due(Instant::now(), max)
                    .into_iter()
                    .filter(|h| h.epoch == epoch)
                    .collect();
                if !due.is_empty() {
                    drop(st);
                    let out = due
                        .into_iter()
                        .map(|h| self.delivery(h.epoch, h.offset, h.envelope))
                        .collect();
                    return Ok(Some(out));
                }
                (epoch, st.held.next_due())
            };
            if let Some(at) = next_due {
                // Something is held: nothing newer goes out before it (stream order).
                tokio::select! {
                    _ = tokio::time::sleep_until(at) => {}
                    _ = self.shared.sync.woken() => {}
                }
                continue;
            }
            if self.consumer.is_none() {
                self.subscribe().await?;
                continue;
            }
            let Some(consumer) = self.consumer.as_mut() else {
                continue;
            };
            // Cancel-safe: nothing is taken from the consumer until `next` is ready, and
            // nothing below awaits.
            let first = tokio::select! {
                next = consumer.next() => next,
                _ = self.shared.sync.woken() => continue,
            };
            let mut got = Vec::new();
            let mut failed = None;
            match first {
                Some(Ok(d)) => got.push(d),
                Some(Err(e)) => failed = Some(e.to_string()),
                None => failed = Some("the broker closed the subscription".into()),
            }
            while failed.is_none() && got.len() < max {
                match consumer.next().now_or_never() {
                    Some(Some(Ok(d))) => got.push(d),
                    Some(Some(Err(e))) => failed = Some(e.to_string()),
                    _ => break,
                }
            }
            let mut out = Vec::with_capacity(got.len());
            {
                let mut st = self.shared.sync.lock();
                for d in &got {
                    let offset = i64::try_from(d.offset()).unwrap_or(i64::MAX);
                    if st.tracker.delivered(&self.shared.part, epoch, offset) {
                        out.push((d.offset(), self.envelope(d)));
                    }
                }
            }
            let out: Vec<Delivery> = out
                .into_iter()
                .map(|(o, env)| self.delivery(epoch, o, env))
                .collect();
            if let Some(why) = failed {
                tracing::warn!(stream = %self.cfg.stream, error = %why, "stream subscription failed; resubscribing from the stored offset");
                metrics::counter!(crate::metrics::RECONNECTS).increment(1);
                // Deliveries already handed out keep their epoch until the resubscribe.
                if let Some(old) = self.consumer.take() {
                    let _ = old.handle().close().await;
                }
                if out.is_empty() {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
            }
            if !out.is_empty() {
                return Ok(Some(out));
            }
        }
    }

    async fn after_batch(&mut self) -> Result<(), SourceError> {
        self.commit().await
    }

    async fn close(&mut self) -> Result<(), SourceError> {
        let committed = self.commit().await;
        {
            let mut st = self.shared.sync.lock();
            st.closed = true;
            st.tracker.revoke(&self.shared.part);
            st.held = DelayedRedelivery::new();
        }
        self.shared.sync.wake_all();
        if let Some(c) = self.consumer.take() {
            let _ = c.handle().close().await;
        }
        committed
    }
}

impl Drop for StreamSource {
    fn drop(&mut self) {
        // A crash as far as the broker is concerned: nothing more is stored.
        {
            let mut st = self.shared.sync.lock();
            st.closed = true;
            st.tracker.revoke(&self.shared.part);
            st.held = DelayedRedelivery::new();
        }
        if let Some(c) = self.consumer.take() {
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move {
                    let _ = c.handle().close().await;
                });
            }
        }
    }
}

/// The settlement handle of one stream delivery.
struct StreamSettle {
    shared: Arc<Shared>,
    epoch: Epoch,
    offset: u64,
    stream: String,
    /// Not settled yet.
    pending: bool,
    /// Handed back by the engine before a nack or a dead letter (see `Settle::take_back`),
    /// to hold it for a redelivery or copy it to the dead-letter stream.
    envelope: Option<Envelope>,
}

impl StreamSettle {
    fn current(&self, st: &State) -> bool {
        self.pending && !st.closed && st.tracker.is_current(&self.shared.part, self.epoch)
    }
}

#[async_trait]
impl LocallyHeld for StreamSettle {
    fn settled(&mut self) {
        let mut st = self.shared.sync.lock();
        if self.current(&st) {
            let offset = i64::try_from(self.offset).unwrap_or(i64::MAX);
            st.tracker.settled(&self.shared.part, self.epoch, offset);
        }
        self.pending = false;
        self.envelope = None;
    }

    fn hold(&mut self, delay: Duration) {
        let mut st = self.shared.sync.lock();
        let current = self.current(&st);
        if let (true, Some(mut envelope)) = (current, self.envelope.take()) {
            envelope.redelivered = true;
            envelope.delivery_count = Some(envelope.delivery_count.unwrap_or(1) + 1);
            let held = Held {
                epoch: self.epoch,
                offset: self.offset,
                envelope,
            };
            st.held.push((), held, Instant::now() + delay);
            drop(st);
            self.shared.sync.wake_all();
        }
        self.pending = false;
        self.envelope = None;
    }

    fn take_back(&mut self, envelope: Envelope) {
        self.envelope = Some(envelope);
    }

    async fn dead_letter(&mut self, reason: &str) -> Result<(), SourceError> {
        let env = {
            let st = self.shared.sync.lock();
            match (self.current(&st), &self.envelope) {
                (true, Some(env)) => env.clone(),
                // Stale: the next subscription reads it again from the stored offset.
                _ => return Ok(()),
            }
        };
        let mut copy = OutgoingMessage::new(self.shared.dlq.stream.clone(), env.payload.clone());
        for (name, value) in env.headers.iter() {
            if !name.starts_with(props::PREFIX) {
                copy = copy.with_header(name, value.clone());
            }
        }
        if let Some(id) = &env.message_id {
            copy = copy.with_key(id.clone());
        }
        // The dedup key stays the message's own (the wire form re-adds its header from it).
        if let Some(k) = env.headers.get_str(idemq_core::DEDUP_HEADER) {
            copy = copy.with_dedup_key(k);
        }
        copy = copy
            .with_header(DLQ_REASON, reason.to_string())
            .with_header(DLQ_QUEUE, self.stream.clone())
            .with_header(DLQ_OFFSET, self.offset.to_string());
        self.shared.dlq.publish(&copy).await?;
        metrics::counter!(crate::metrics::DEAD_LETTERS, "queue" => self.stream.clone())
            .increment(1);
        Ok(())
    }

    fn is_stale(&self) -> bool {
        let st = self.shared.sync.lock();
        st.closed || !st.tracker.is_current(&self.shared.part, self.epoch)
    }
}

/// Reads every message now in `stream` (from its first offset, unnamed: nothing stored),
/// until none has arrived for `idle`; for tools and tests (e.g. a dead-letter stream).
pub async fn read_stream(
    url: &str,
    stream: &str,
    idle: Duration,
) -> Result<Vec<Envelope>, RabbitError> {
    let env = StreamEndpoint::parse(url)?.environment().await?;
    let mut consumer = env
        .consumer()
        .offset(OffsetSpecification::First)
        .build(stream)
        .await
        .map_err(|e| RabbitError::Connect(format!("read {stream}: {e}")))?;
    let mut out = Vec::new();
    while let Ok(Some(next)) = tokio::time::timeout(idle, consumer.next()).await {
        let d = next.map_err(|e| RabbitError::Connect(format!("read {stream}: {e}")))?;
        out.push(stream_envelope(stream, d.offset(), d.message()));
    }
    let _ = consumer.handle().close().await;
    Ok(out)
}
