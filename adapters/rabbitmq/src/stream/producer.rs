//! The stream publisher: confirmed publishes, and with a producer name, broker-side
//! deduplication by publishing id.

use super::{
    confirm_callback, confirm_channel, create_stream, stream_message, ConfirmFailure, Confirmed,
    StreamEndpoint,
};
use crate::RabbitError;
use async_trait::async_trait;
use idemq_core::publish::{OutgoingMessage, PublishError, PublishReceipt, Publisher};
use rabbitmq_stream_client::types::Message;
use rabbitmq_stream_client::{Dedup, Environment, NoDedup, Producer};
use std::time::Duration;
use tokio::sync::{mpsc, Mutex};

/// The header of an [`OutgoingMessage`] carrying its publishing id (a decimal `u64`), read by
/// a named [`StreamPublisher`]. The broker stores a message of a named producer only when
/// its id is higher than every id it stored for that name before: ids must grow.
pub const PUBLISHING_ID_HEADER: &str = "idemq-publishing-id";

/// Settings of a [`StreamPublisher`].
#[derive(Debug, Clone)]
pub struct StreamPublisherConfig {
    /// `rabbitmq-stream://user:pass@host:port/vhost`.
    pub url: String,
    /// The stream written to (every message goes there, whatever its destination says).
    pub stream: String,
    /// The producer name: set, the broker deduplicates by publishing id (taken from each
    /// message's [`PUBLISHING_ID_HEADER`]); `None`, no deduplication and ids are assigned.
    /// One name per logical producer: two live producers with one name would drop each
    /// other's messages.
    pub producer_name: Option<String>,
    /// Create the stream when it does not exist (default true).
    pub create: bool,
    /// Longest wait for a confirm, from the message's send (in a batch too); past it the
    /// outcome is [`PublishError::Ambiguous`].
    pub confirm_timeout: Duration,
}

impl StreamPublisherConfig {
    /// An unnamed (non-deduplicating) publisher to `stream`.
    pub fn new(url: impl Into<String>, stream: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            stream: stream.into(),
            producer_name: None,
            create: true,
            confirm_timeout: Duration::from_secs(30),
        }
    }

    /// Names the producer: the broker deduplicates its messages by publishing id.
    pub fn named(mut self, name: impl Into<String>) -> Self {
        self.producer_name = Some(name.into());
        self
    }
}

pub(crate) enum Inner {
    Named(Producer<Dedup>),
    Plain(Producer<NoDedup>),
}

impl Inner {
    fn is_closed(&self) -> bool {
        match self {
            Inner::Named(p) => p.is_closed(),
            Inner::Plain(p) => p.is_closed(),
        }
    }
}

/// A sent message's confirm, on its way.
struct Confirm {
    rx: mpsc::Receiver<Confirmed>,
    publishing_id: Option<u64>,
    /// Set at the send: a batch whose connection died settles within one `confirm_timeout`,
    /// not one per message (the stream client leaves a lost connection's confirms unanswered).
    deadline: tokio::time::Instant,
    /// The producer it was sent on: only a failure on the current one condemns it.
    generation: u64,
}

impl Inner {
    async fn send(&mut self, message: Message, tx: mpsc::Sender<Confirmed>) -> Result<(), String> {
        match self {
            Inner::Named(p) => p.send(message, confirm_callback!(tx)).await,
            Inner::Plain(p) => p.send(message, confirm_callback!(tx)).await,
        }
        .map_err(|e| e.to_string())
    }

    /// Closes the producer's connection, if the broker still answers. Its batch-send timer
    /// task is the stream client's and outlives it (rabbitmq-stream-client 0.4.4).
    async fn close(self) {
        let closed = match self {
            Inner::Named(p) => p.close().await,
            Inner::Plain(p) => p.close().await,
        };
        if let Err(e) = closed {
            tracing::debug!(error = %e, "closing a replaced stream producer");
        }
    }
}

/// A stream producer that is replaced after a send or a confirm failed on it: the stream
/// client (0.4.4) neither marks a producer closed when its connection drops nor answers the
/// confirms it was waiting for, so after a broker restart `is_closed` stays false and every
/// send on the old producer would go unanswered, for good. The publisher and the stream
/// source's dead-letter producer both hold one.
pub(crate) struct ProducerSlot {
    /// The producer (none before the first send, or after a discard) and its generation,
    /// counted up at each open.
    current: Mutex<(Option<Inner>, u64)>,
}

impl ProducerSlot {
    pub(crate) fn new(first: Option<Inner>) -> Self {
        Self {
            current: Mutex::new((first, 0)),
        }
    }

    /// Hands `message` to the current producer, opened with `open` first when there is none
    /// or it is closed; returns the producer's generation, to [`ProducerSlot::discard`] it if
    /// the confirm does not come. A failed send discards it at once. An error means the
    /// message was not handed to a connection: safe to resend.
    pub(crate) async fn send<F, Fut>(
        &self,
        message: Message,
        tx: mpsc::Sender<Confirmed>,
        open: F,
    ) -> Result<u64, String>
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = Result<Inner, String>>,
    {
        let mut current = self.current.lock().await;
        if !matches!(current.0.as_ref(), Some(p) if !p.is_closed()) {
            if let Some(old) = current.0.take() {
                Self::retire(old, "closed");
            }
            current.0 = Some(open().await?);
            current.1 += 1;
        }
        let generation = current.1;
        let Some(p) = current.0.as_mut() else {
            return Err("no stream producer".into());
        };
        if let Err(e) = p.send(message, tx).await {
            if let Some(old) = current.0.take() {
                Self::retire(old, "a send failed");
            }
            return Err(e);
        }
        Ok(generation)
    }

    /// Drops producer `generation` (a confirm did not come) if it is still the current one,
    /// so the next send opens a new one; a later failure of an older one changes nothing.
    pub(crate) async fn discard(&self, generation: u64) {
        let mut current = self.current.lock().await;
        if current.1 == generation {
            if let Some(old) = current.0.take() {
                Self::retire(old, "a confirm did not come");
            }
        }
    }

    /// Closes `old` on the side, bounded: on a dead connection the close gets no answer
    /// either.
    fn retire(old: Inner, why: &str) {
        tracing::info!(why, "stream producer replaced at the next send");
        metrics::counter!(crate::metrics::RECONNECTS).increment(1);
        tokio::spawn(tokio::time::timeout(Duration::from_secs(5), old.close()));
    }
}

/// Publishes to a RabbitMQ stream and answers only after the broker's confirm. With a
/// producer name ([`StreamPublisherConfig::named`]) a resend of a publishing id the broker
/// already stored — after a lost confirm, or by a restarted producer *process* — is
/// confirmed and not stored again.
pub struct StreamPublisher {
    cfg: StreamPublisherConfig,
    endpoint: StreamEndpoint,
    env: Environment,
    producer: ProducerSlot,
    /// Publishing ids sent and not yet confirmed: one id is never in flight twice (the
    /// client keys its confirm waiters by id, and a second confirm for an id it no longer
    /// waits for brings its connection task down).
    in_flight: std::sync::Mutex<std::collections::HashSet<u64>>,
    released: tokio::sync::Notify,
}

impl std::fmt::Debug for StreamPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamPublisher")
            .field("stream", &self.cfg.stream)
            .field("producer_name", &self.cfg.producer_name)
            .finish_non_exhaustive()
    }
}

impl StreamPublisher {
    /// Connects (creating the stream when asked) and declares the producer.
    pub async fn connect(cfg: StreamPublisherConfig) -> Result<Self, RabbitError> {
        let endpoint = StreamEndpoint::parse(&cfg.url)?;
        let env = endpoint.environment().await?;
        if cfg.create {
            create_stream(&env, &cfg.stream).await?;
        }
        let mut p = Self {
            cfg,
            endpoint,
            env,
            producer: ProducerSlot::new(None),
            in_flight: std::sync::Mutex::new(std::collections::HashSet::new()),
            released: tokio::sync::Notify::new(),
        };
        p.producer = ProducerSlot::new(Some(p.open().await?));
        Ok(p)
    }

    async fn open(&self) -> Result<Inner, RabbitError> {
        let stream = &self.cfg.stream;
        let fail = |e: rabbitmq_stream_client::error::ProducerCreateError| RabbitError::Declare {
            queue: stream.clone(),
            reason: format!("stream producer: {e}"),
        };
        Ok(match &self.cfg.producer_name {
            Some(name) => Inner::Named(
                self.env
                    .producer()
                    .name(name)
                    .build(stream)
                    .await
                    .map_err(fail)?,
            ),
            None => Inner::Plain(self.env.producer().build(stream).await.map_err(fail)?),
        })
    }

    /// The highest publishing id the broker stored for this producer name on this stream
    /// (`None` before the first, or for an unnamed producer): a restarted producer resumes
    /// after it. Asked of the broker, so it survives restarts of either side.
    pub async fn last_publishing_id(&self) -> Result<Option<u64>, RabbitError> {
        let Some(name) = &self.cfg.producer_name else {
            return Ok(None);
        };
        sequence_of(&self.endpoint, &self.cfg.stream, name).await
    }

    /// The stream written to.
    pub fn stream(&self) -> &str {
        &self.cfg.stream
    }

    /// Hands one message to the producer; the receiver yields its confirm.
    async fn send(&self, msg: &OutgoingMessage) -> Result<Confirm, PublishError> {
        let publishing_id = match &self.cfg.producer_name {
            None => None,
            Some(name) => Some(publishing_id(msg, name)?),
        };
        if let Some(id) = publishing_id {
            self.reserve(id).await?;
        }
        let sent = self.send_reserved(msg, publishing_id).await;
        if let (Err(_), Some(id)) = (&sent, publishing_id) {
            self.release(id);
        }
        sent
    }

    /// Waits until `id` is not in flight, then marks it.
    async fn reserve(&self, id: u64) -> Result<(), PublishError> {
        let deadline = tokio::time::Instant::now() + self.cfg.confirm_timeout;
        loop {
            let released = self.released.notified();
            if self
                .in_flight
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(id)
            {
                return Ok(());
            }
            if tokio::time::timeout_at(deadline, released).await.is_err() {
                return Err(PublishError::Disconnected(format!(
                    "publishing id {id} is still waiting for its confirm"
                )));
            }
        }
    }

    fn release(&self, id: u64) {
        self.in_flight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id);
        self.released.notify_waiters();
    }

    async fn send_reserved(
        &self,
        msg: &OutgoingMessage,
        publishing_id: Option<u64>,
    ) -> Result<Confirm, PublishError> {
        let message = stream_message(msg, publishing_id);
        let (tx, rx) = confirm_channel();
        let open = || async { self.open().await.map_err(|e| e.to_string()) };
        let generation = self
            .producer
            .send(message, tx, open)
            .await
            .map_err(PublishError::Disconnected)?;
        Ok(Confirm {
            rx,
            publishing_id,
            deadline: tokio::time::Instant::now() + self.cfg.confirm_timeout,
            generation,
        })
    }

    async fn settle(&self, confirm: Confirm) -> Result<PublishReceipt, PublishError> {
        let Confirm {
            mut rx,
            publishing_id: id,
            deadline,
            generation,
        } = confirm;
        let answer = tokio::time::timeout_at(deadline, rx.recv()).await;
        if let Some(id) = id {
            self.release(id);
        }
        let outcome = match answer {
            Err(_) => Err(PublishError::Ambiguous(format!(
                "no confirm within {:?}",
                self.cfg.confirm_timeout
            ))),
            Ok(None) => Err(PublishError::Ambiguous("connection lost after send".into())),
            Ok(Some(Err(ConfirmFailure::Lost(e)))) => Err(PublishError::Ambiguous(format!(
                "connection lost after send: {e}"
            ))),
            Ok(Some(Err(ConfirmFailure::Refused(why)))) => Err(PublishError::Rejected(format!(
                "{}: {why}",
                self.cfg.stream
            ))),
            Ok(Some(Ok(()))) => Ok(PublishReceipt {
                destination: self.cfg.stream.clone(),
                ..PublishReceipt::default()
            }),
        };
        let label = match &outcome {
            Ok(_) => "confirmed",
            Err(PublishError::Rejected(_)) => "rejected",
            Err(_) => "ambiguous",
        };
        if label == "ambiguous" {
            self.producer.discard(generation).await;
        }
        metrics::counter!(crate::metrics::PUBLISHED, "outcome" => label).increment(1);
        outcome
    }
}

/// The highest publishing id the broker stored for producer `name` on `stream` (`None`
/// before the first), asked without declaring a producer: safe while that producer runs.
pub async fn last_publishing_id(
    url: &str,
    stream: &str,
    name: &str,
) -> Result<Option<u64>, RabbitError> {
    sequence_of(&StreamEndpoint::parse(url)?, stream, name).await
}

async fn sequence_of(
    endpoint: &StreamEndpoint,
    stream: &str,
    name: &str,
) -> Result<Option<u64>, RabbitError> {
    let client = endpoint.client().await?;
    let seq = client
        .query_publisher_sequence(name, stream)
        .await
        .map_err(|e| RabbitError::Connect(format!("query publisher sequence: {e}")));
    let _ = client.close().await;
    // The broker answers 0 for a name it has not seen (ids start at 1 to be told apart).
    Ok(Some(seq?).filter(|s| *s > 0))
}

fn publishing_id(msg: &OutgoingMessage, name: &str) -> Result<u64, PublishError> {
    let raw = msg.headers.get_str(PUBLISHING_ID_HEADER).ok_or_else(|| {
        PublishError::Config(format!(
            "the named stream producer `{name}` deduplicates by publishing id: set the \
             `{PUBLISHING_ID_HEADER}` header (a growing u64, e.g. an outbox row id)"
        ))
    })?;
    raw.trim().parse::<u64>().map_err(|_| {
        PublishError::Config(format!(
            "`{PUBLISHING_ID_HEADER}` must be a decimal u64, got {raw:?}"
        ))
    })
}

#[async_trait]
impl Publisher for StreamPublisher {
    async fn publish(&self, msg: OutgoingMessage) -> Result<PublishReceipt, PublishError> {
        let confirm = self.send(&msg).await?;
        self.settle(confirm).await
    }

    /// Pipelined: messages are handed over, then their confirms collected; a publishing id
    /// that repeats within the batch first waits for the confirms of what went before it.
    async fn publish_batch(
        &self,
        msgs: Vec<OutgoingMessage>,
    ) -> Vec<Result<PublishReceipt, PublishError>> {
        let mut out = Vec::with_capacity(msgs.len());
        let mut pending = Vec::new();
        let mut wave = std::collections::HashSet::new();
        for m in &msgs {
            let id = m
                .headers
                .get_str(PUBLISHING_ID_HEADER)
                .and_then(|s| s.trim().parse::<u64>().ok());
            if self.cfg.producer_name.is_some() && id.is_some_and(|id| !wave.insert(id)) {
                for sent in pending.drain(..) {
                    out.push(self.finish(sent).await);
                }
                wave.clear();
                wave.extend(id);
            }
            pending.push(self.send(m).await);
        }
        for sent in pending {
            out.push(self.finish(sent).await);
        }
        out
    }
}

impl StreamPublisher {
    async fn finish(
        &self,
        sent: Result<Confirm, PublishError>,
    ) -> Result<PublishReceipt, PublishError> {
        self.settle(sent?).await
    }
}
