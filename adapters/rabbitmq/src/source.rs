//! The manual-ack queue [`Source`]: a background task owns the connection (and reconnects),
//! deliveries reach `poll` through the core's [`ChannelSource`], settlements go straight to
//! the channel the delivery came on.

use crate::fields::{get_u64, put_str, table_to_headers};
use crate::topology::{self, retry_queue_name, QueueType, DEFAULT_RETRY_TIERS_MS};
use crate::{connect, RabbitError};
use async_trait::async_trait;
use bytes::Bytes;
use futures::{FutureExt, StreamExt};
use idemq_core::adapter::{channel_source, ChannelSender, ChannelSource, DelayedRedelivery};
use idemq_core::envelope::{props, Position};
use idemq_core::source::{Delivery, Settle, Source, SourceError};
use idemq_core::{Envelope, RetryPolicy};
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions,
    BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions,
};
use lapin::publisher_confirm::Confirmation;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, Consumer};
use std::collections::HashMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{watch, Notify};
use tokio::time::Instant;

/// Header carrying why a message was dead-lettered.
pub const DLQ_REASON: &str = "idemq-dlq-reason";
/// Header carrying the queue a dead-lettered message was consumed from.
pub const DLQ_QUEUE: &str = "idemq-dlq-queue";
/// Header counting how often a message went through a retry queue.
pub const RETRIES: &str = "idemq-retries";

/// Settings of a [`RabbitSource`] (`Debug` shows the URL without its password).
#[derive(Clone)]
pub struct RabbitSourceConfig {
    /// `amqp://user:pass@host:port/vhost` (`%2f` for `/`).
    pub url: String,
    /// The queue to consume.
    pub queue: String,
    /// Declare the queue with this type, or (`None`) only check that it exists.
    pub declare: Option<QueueType>,
    /// `basic.qos` prefetch: deliveries unacked at once on the channel.
    pub prefetch: u16,
    /// The name put in every envelope's [`SourceRef::cluster`](idemq_core::SourceRef).
    pub cluster: Option<String>,
    /// Where `reject` publishes; `None` = `<queue>.dlq` (declared by the source).
    pub dead_letter_queue: Option<String>,
    /// Delay tiers (ms) of the TTL retry queues, ascending.
    pub retry_tiers: Vec<u64>,
    /// Keep queue order across nacks: a nacked delivery is held *unacked* locally and
    /// everything behind it waits (holds prefetch slots; keep delays short of the broker's
    /// `consumer_timeout`). Off: nacks go through the retry queues and the rest flows.
    pub ordered: bool,
    /// First reconnect back-off; doubles up to [`RabbitSourceConfig::reconnect_max`].
    pub reconnect_min: Duration,
    /// Longest reconnect back-off.
    pub reconnect_max: Duration,
    /// Longest wait for the broker to confirm a retry or dead-letter publish.
    pub confirm_timeout: Duration,
    /// How long a TTL retry queue may go undeclared before the broker deletes it
    /// (`x-expires` = tier + this; default 30 min; `None`: retry queues stay until deleted by
    /// hand). Each source declares a tier again before parking a message in it once half
    /// this time has passed, so a parked message always returns before its queue can expire.
    /// Every source of a queue must use the same value (RabbitMQ refuses to redeclare a
    /// queue with other arguments), and retry queues declared by an older version without
    /// `x-expires` must be deleted once, when empty.
    pub retry_queue_idle_expiry: Option<Duration>,
}

impl std::fmt::Debug for RabbitSourceConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitSourceConfig")
            .field("url", &idemq_core::secrets::redact_url(&self.url))
            .field("queue", &self.queue)
            .field("declare", &self.declare)
            .field("prefetch", &self.prefetch)
            .field("cluster", &self.cluster)
            .field("dead_letter_queue", &self.dead_letter_queue)
            .field("retry_tiers", &self.retry_tiers)
            .field("ordered", &self.ordered)
            .field("reconnect_min", &self.reconnect_min)
            .field("reconnect_max", &self.reconnect_max)
            .field("confirm_timeout", &self.confirm_timeout)
            .field("retry_queue_idle_expiry", &self.retry_queue_idle_expiry)
            .finish()
    }
}

impl RabbitSourceConfig {
    /// Consumes the existing queue `queue` at `url`, prefetch 100.
    pub fn new(url: impl Into<String>, queue: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            queue: queue.into(),
            declare: None,
            prefetch: 100,
            cluster: None,
            dead_letter_queue: None,
            retry_tiers: DEFAULT_RETRY_TIERS_MS.to_vec(),
            ordered: false,
            reconnect_min: Duration::from_millis(100),
            reconnect_max: Duration::from_secs(10),
            confirm_timeout: Duration::from_secs(30),
            retry_queue_idle_expiry: Some(Duration::from_secs(30 * 60)),
        }
    }
    /// Declares the queue as `kind` (builder form).
    pub fn declare(mut self, kind: QueueType) -> Self {
        self.declare = Some(kind);
        self
    }
    /// Sets the prefetch (builder form).
    pub fn prefetch(mut self, n: u16) -> Self {
        self.prefetch = n;
        self
    }
    /// Names the cluster (builder form).
    pub fn cluster(mut self, name: impl Into<String>) -> Self {
        self.cluster = Some(name.into());
        self
    }
    /// Keeps queue order across nacks (builder form; see [`RabbitSourceConfig::ordered`]).
    pub fn ordered(mut self) -> Self {
        self.ordered = true;
        self
    }
    /// The dead-letter queue.
    pub fn dead_letter_queue_name(&self) -> String {
        self.dead_letter_queue
            .clone()
            .unwrap_or_else(|| format!("{}.dlq", self.queue))
    }
}

/// What deliveries and the connection task share.
struct Shared {
    cfg: RabbitSourceConfig,
    dlq: String,
    /// Bumped on every new channel and on close: a delivery of an older one is stale.
    generation: AtomicU64,
    /// Retry tiers declared so far, with when this source last declared each.
    tiers: Mutex<HashMap<u64, Instant>>,
    /// Ordered mode: nacked deliveries waiting, on one lane (the queue).
    held: Mutex<DelayedRedelivery<Delivery, ()>>,
    held_changed: Notify,
    /// Why the connection task died, when it panicked: every `poll` returns it.
    fatal: Mutex<Option<String>>,
}

impl Shared {
    /// Takes the held deliveries out (they point back at `Shared`: a cycle otherwise).
    fn release_held(&self) -> Vec<Delivery> {
        self.held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain_lanes(|_| true)
    }
}

/// A message as it came, kept to republish it into a retry or dead-letter queue.
struct Raw {
    properties: BasicProperties,
    payload: Bytes,
    retries: u64,
}

/// The settlement handle of one delivery.
struct RabbitSettle {
    shared: Arc<Shared>,
    channel: Channel,
    generation: u64,
    tag: u64,
    raw: Arc<Raw>,
    /// Handed back by the engine before a nack (see `Settle::take_back`): ordered mode holds
    /// it locally instead of keeping a copy of every envelope.
    envelope: Option<Envelope>,
}

fn broker_err(what: &str, e: impl std::fmt::Display) -> SourceError {
    SourceError::Broker(format!("{what}: {e}"))
}

fn lapin_err(what: &str, e: lapin::Error) -> SourceError {
    match e {
        lapin::Error::InvalidChannelState(_)
        | lapin::Error::InvalidConnectionState(_)
        | lapin::Error::IOError(_) => SourceError::Disconnected(format!("{what}: {e}")),
        other => broker_err(what, other),
    }
}

impl RabbitSettle {
    fn stale(&self) -> bool {
        self.shared.generation.load(Ordering::SeqCst) != self.generation
            || !self.channel.status().connected()
    }

    fn ignored(&self, op: &'static str) -> Result<(), SourceError> {
        tracing::debug!(queue = %self.shared.cfg.queue, tag = self.tag, op, "stale delivery: settle ignored");
        metrics::counter!(crate::metrics::STALE_SETTLES, "op" => op).increment(1);
        Ok(())
    }

    /// Publishes a copy of the message to `queue` through the default exchange and waits for
    /// the broker's confirm; `extra` headers are added to the original ones.
    async fn republish(&self, queue: &str, extra: FieldTable) -> Result<(), SourceError> {
        let mut headers = self.raw.properties.headers().clone().unwrap_or_default();
        for (k, v) in extra.inner() {
            headers.insert(k.clone(), v.clone());
        }
        let props = self.raw.properties.clone().with_headers(headers);
        let opts = BasicPublishOptions {
            mandatory: true,
            ..BasicPublishOptions::default()
        };
        let confirm = self
            .channel
            .basic_publish("", queue, opts, &self.raw.payload, props)
            .await
            .map_err(|e| lapin_err("publish", e))?;
        match tokio::time::timeout(self.shared.cfg.confirm_timeout, confirm).await {
            Err(_) => Err(SourceError::Broker(format!(
                "no confirm from the broker for the copy to `{queue}` within {:?}",
                self.shared.cfg.confirm_timeout
            ))),
            Ok(Err(e)) => Err(lapin_err("confirm", e)),
            Ok(Ok(Confirmation::Ack(None))) => Ok(()),
            Ok(Ok(Confirmation::Ack(Some(ret)))) => Err(SourceError::Broker(format!(
                "`{queue}` is unroutable: {}",
                ret.reply_text
            ))),
            Ok(Ok(Confirmation::Nack(_))) => Err(SourceError::Broker(format!(
                "the broker nacked the copy to `{queue}`"
            ))),
            Ok(Ok(Confirmation::NotRequested)) => Ok(()),
        }
    }

    /// Declares the tier's retry queue unless this source declared it recently enough: with
    /// `x-expires`, again once half the idle expiry has passed (a declaration resets the
    /// broker's expiry timer, and the queue must outlive the message about to be parked).
    async fn ensure_tier(&self, tier: u64) -> Result<(), SourceError> {
        let cfg = &self.shared.cfg;
        let fresh = |declared: Instant| match cfg.retry_queue_idle_expiry {
            Some(idle) => declared.elapsed() < idle / 2,
            None => true,
        };
        let known = self
            .shared
            .tiers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&tier)
            .is_some_and(|at| fresh(*at));
        if !known {
            let at = Instant::now();
            topology::declare_retry_tier(
                &self.channel,
                &cfg.queue,
                tier,
                cfg.retry_queue_idle_expiry,
            )
            .await
            .map_err(|e| lapin_err("declare retry queue", e))?;
            self.shared
                .tiers
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(tier, at);
        }
        Ok(())
    }

    async fn requeue(&self) -> Result<(), SourceError> {
        let opts = BasicNackOptions {
            requeue: true,
            multiple: false,
        };
        self.channel
            .basic_nack(self.tag, opts)
            .await
            .map_err(|e| lapin_err("nack", e))
    }

    async fn ack_original(&self) -> Result<(), SourceError> {
        self.channel
            .basic_ack(self.tag, BasicAckOptions::default())
            .await
            .map_err(|e| lapin_err("ack", e))
    }

    /// Ordered mode: the delivery stays unacked and goes back to the source's local buffer.
    fn hold(&self, mut env: Envelope, delay: Duration) {
        env.redelivered = true;
        env.delivery_count = Some(env.delivery_count.unwrap_or(1) + 1);
        let again = RabbitSettle {
            shared: self.shared.clone(),
            channel: self.channel.clone(),
            generation: self.generation,
            tag: self.tag,
            raw: self.raw.clone(),
            envelope: None,
        };
        let d = Delivery::new(env, Box::new(again));
        self.shared
            .held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((), d, Instant::now() + delay);
        self.shared.held_changed.notify_one();
    }
}

#[async_trait]
impl Settle for RabbitSettle {
    async fn ack(&mut self) -> Result<(), SourceError> {
        if self.stale() {
            return self.ignored("ack");
        }
        self.ack_original().await
    }

    async fn nack(&mut self, redeliver_after: Duration) -> Result<(), SourceError> {
        if self.stale() {
            return self.ignored("nack");
        }
        if redeliver_after.is_zero() {
            return self.requeue().await;
        }
        if self.shared.cfg.ordered {
            match self.envelope.take() {
                Some(env) => {
                    self.hold(env, redeliver_after);
                    return Ok(());
                }
                // Only a caller that nacks through `Settle` directly, bypassing `Delivery`,
                // gets here: the broker requeues it instead (kept, if not in order).
                None => return self.requeue().await,
            }
        }
        let tier = topology::retry_tier(&self.shared.cfg.retry_tiers, redeliver_after);
        let queue = retry_queue_name(&self.shared.cfg.queue, tier);
        let mut extra = FieldTable::default();
        extra.insert(
            RETRIES.into(),
            AMQPValue::LongLongInt(
                i64::try_from(self.raw.retries.saturating_add(1)).unwrap_or(i64::MAX),
            ),
        );
        let parked = match self.ensure_tier(tier).await {
            Ok(()) => self.republish(&queue, extra).await,
            Err(e) => Err(e),
        };
        match parked {
            Ok(()) => {
                metrics::counter!(crate::metrics::RETRIES, "tier_ms" => tier.to_string())
                    .increment(1);
                self.ack_original().await
            }
            Err(e) => {
                // Not parked: give it back to the queue rather than hold a prefetch slot.
                tracing::warn!(queue = %queue, error = %e, "retry queue publish failed; requeueing at once");
                let _ = self.requeue().await;
                Err(e)
            }
        }
    }

    async fn reject(&mut self, reason: &str) -> Result<(), SourceError> {
        if self.stale() {
            return self.ignored("reject");
        }
        let mut extra = FieldTable::default();
        put_str(&mut extra, DLQ_REASON, reason);
        put_str(&mut extra, DLQ_QUEUE, &self.shared.cfg.queue);
        self.republish(&self.shared.dlq, extra).await?;
        metrics::counter!(crate::metrics::DEAD_LETTERS, "queue" => self.shared.cfg.queue.clone())
            .increment(1);
        self.ack_original().await
    }

    fn abandon(&mut self) {
        if self.stale() {
            return;
        }
        // Must not block: the requeue runs on the runtime, when there is one. Without one the
        // channel's close requeues it anyway.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let ch = self.channel.clone();
            let tag = self.tag;
            rt.spawn(async move {
                let opts = BasicNackOptions {
                    requeue: true,
                    multiple: false,
                };
                if let Err(e) = ch.basic_nack(tag, opts).await {
                    tracing::debug!(error = %e, tag, "requeue of an abandoned delivery failed");
                }
            });
        }
    }

    fn is_stale(&self) -> bool {
        self.stale()
    }

    fn take_back(&mut self, envelope: Envelope) {
        self.envelope = Some(envelope);
    }
}

/// One connection, one channel, one consumer.
struct Session {
    conn: Connection,
    channel: Channel,
    consumer: Consumer,
    generation: u64,
}

async fn open_session(shared: &Shared) -> Result<Session, RabbitError> {
    let cfg = &shared.cfg;
    let conn = connect(&cfg.url, &format!("idemq-source {}", cfg.queue)).await?;
    let channel = conn.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    channel
        .basic_qos(cfg.prefetch, BasicQosOptions::default())
        .await?;
    topology::declare_queue(&channel, &cfg.queue, cfg.declare)
        .await
        .map_err(|e| RabbitError::Declare {
            queue: cfg.queue.clone(),
            reason: e.to_string(),
        })?;
    topology::declare_plain(&channel, &shared.dlq)
        .await
        .map_err(|e| RabbitError::Declare {
            queue: shared.dlq.clone(),
            reason: e.to_string(),
        })?;
    let consumer = channel
        .basic_consume(
            &cfg.queue,
            "",
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let generation = shared.generation.fetch_add(1, Ordering::SeqCst) + 1;
    tracing::info!(queue = %cfg.queue, generation, prefetch = cfg.prefetch, "rabbitmq consumer started");
    Ok(Session {
        conn,
        channel,
        consumer,
        generation,
    })
}

/// The envelope of a delivery (or a `basic.get`) from `queue`: `message_id` as message id
/// and key, AMQP properties under the reserved [`props`] names, headers with their types,
/// `redelivered`, and `delivery_count` from `x-delivery-count` plus retry-queue round trips.
pub fn to_envelope(queue: &str, delivery: &lapin::message::Delivery) -> Envelope {
    let payload = Bytes::copy_from_slice(&delivery.data);
    envelope_of(queue, None, delivery, payload).0
}

fn envelope_of(
    queue: &str,
    cluster: Option<&String>,
    d: &lapin::message::Delivery,
    payload: Bytes,
) -> (Envelope, u64) {
    let p = &d.properties;
    let mut env = Envelope::new(crate::RABBITMQ, queue, payload);
    env.source.cluster = cluster.cloned();
    env.source.position = Some(Position::DeliveryTag(d.delivery_tag));
    env.redelivered = d.redelivered;
    if let Some(id) = p.message_id() {
        env.message_id = Some(id.to_string());
        env.key = Some(Bytes::copy_from_slice(id.as_str().as_bytes()));
    }
    env.timestamp_ms = p
        .timestamp()
        .and_then(|s| i64::try_from(s).ok())
        .map(|s| s.saturating_mul(1000));
    let named = [
        (props::REPLY_TO, p.reply_to().as_ref().map(|s| s.as_str())),
        (
            props::CORRELATION_ID,
            p.correlation_id().as_ref().map(|s| s.as_str()),
        ),
        (
            props::CONTENT_TYPE,
            p.content_type().as_ref().map(|s| s.as_str()),
        ),
        (
            props::CONTENT_ENCODING,
            p.content_encoding().as_ref().map(|s| s.as_str()),
        ),
        (props::MESSAGE_TYPE, p.kind().as_ref().map(|s| s.as_str())),
        (props::EXCHANGE, Some(d.exchange.as_str())),
        (props::ROUTING_KEY, Some(d.routing_key.as_str())),
    ];
    for (name, value) in named {
        if let Some(v) = value {
            env.headers
                .insert(name, Bytes::copy_from_slice(v.as_bytes()));
        }
    }
    let mut retries = 0;
    if let Some(h) = p.headers() {
        table_to_headers(h, &mut env.headers);
        retries = get_u64(h, RETRIES).unwrap_or(0);
        // Quorum queues count failed deliveries; retry-queue round trips count too.
        let returned = get_u64(h, "x-delivery-count").unwrap_or(0);
        let before = returned.saturating_add(retries);
        if before > 0 {
            env.delivery_count = u32::try_from(before.saturating_add(1)).ok();
            env.redelivered = true;
        }
    }
    (env, retries)
}

/// The connection task: forwards deliveries, reconnects with back-off, stops on request.
async fn run(
    shared: Arc<Shared>,
    mut session: Option<Session>,
    tx: ChannelSender,
    mut stop: watch::Receiver<bool>,
) {
    // Jittered: every consumer of a restarted broker reconnects at once otherwise.
    let mut backoff = RetryPolicy::backoff(shared.cfg.reconnect_min, shared.cfg.reconnect_max)
        .with_jitter(0.2)
        .waits();
    loop {
        let s = match session.take() {
            Some(s) => s,
            None => {
                tokio::select! {
                    _ = stop.changed() => return,
                    _ = tokio::time::sleep(backoff.next_delay()) => {}
                }
                match open_session(&shared).await {
                    Ok(s) => {
                        metrics::counter!(crate::metrics::RECONNECTS).increment(1);
                        backoff.reset();
                        s
                    }
                    Err(e) => {
                        tracing::warn!(queue = %shared.cfg.queue, error = %e, failures = backoff.failures(), "rabbitmq reconnect failed");
                        continue;
                    }
                }
            }
        };
        let stopped = pump(&shared, s, &tx, &mut stop).await;
        // Whatever was delivered on that channel can no longer be settled there.
        shared.generation.fetch_add(1, Ordering::SeqCst);
        if stopped {
            return;
        }
    }
}

/// Forwards deliveries of one session; true when asked to stop (or the source is gone).
async fn pump(
    shared: &Arc<Shared>,
    mut s: Session,
    tx: &ChannelSender,
    stop: &mut watch::Receiver<bool>,
) -> bool {
    let stopped = loop {
        let next = tokio::select! {
            _ = stop.changed() => break true,
            next = s.consumer.next() => next,
        };
        let d = match next {
            Some(Ok(d)) => d,
            Some(Err(e)) => {
                tracing::warn!(queue = %shared.cfg.queue, error = %e, "rabbitmq channel failed; reconnecting");
                break false;
            }
            None => {
                tracing::warn!(queue = %shared.cfg.queue, "rabbitmq consumer cancelled by the broker; reconnecting");
                break false;
            }
        };
        let payload = Bytes::from(d.data.clone());
        let cfg = &shared.cfg;
        let (env, retries) = envelope_of(&cfg.queue, cfg.cluster.as_ref(), &d, payload.clone());
        let raw = Arc::new(Raw {
            properties: d.properties.clone(),
            payload,
            retries,
        });
        let settle = RabbitSettle {
            shared: shared.clone(),
            channel: s.channel.clone(),
            generation: s.generation,
            tag: d.delivery_tag,
            raw,
            envelope: None,
        };
        let delivery = Delivery::new(env, Box::new(settle));
        tokio::select! {
            _ = stop.changed() => break true,
            sent = tx.send(delivery) => if sent.is_err() { break true },
        }
    };
    if stopped {
        // Cancel first so the broker sends nothing more, then close: unacked deliveries go
        // back to the queue.
        let tag = s.consumer.tag();
        let _ = s
            .channel
            .basic_cancel(tag.as_str(), BasicCancelOptions::default())
            .await;
        let _ = s.channel.close(200, "idemq source closed").await;
        let _ = s.conn.close(200, "idemq source closed").await;
    }
    stopped
}

/// Runs the connection task, catching a panic in it (a bug, or a client library that
/// panics on what a producer sent) as the source's fatal error. `keep_open`, a sender of
/// the source's channel, is dropped only after that: the channel ends (and `poll` looks for
/// the error) once the error is there, so a task that died never reads as a source that
/// ended normally.
async fn guarded(shared: Arc<Shared>, keep_open: ChannelSender, task: impl Future<Output = ()>) {
    if let Err(panic) = AssertUnwindSafe(task).catch_unwind().await {
        let what = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".to_string());
        tracing::error!(queue = %shared.cfg.queue, panic = %what, "the rabbitmq connection task panicked: the source stops");
        *shared.fatal.lock().unwrap_or_else(|e| e.into_inner()) =
            Some(format!("the connection task panicked: {what}"));
    }
    drop(keep_open);
}

/// A manual-ack consumer of one RabbitMQ queue; see the crate docs for how settlements map.
pub struct RabbitSource {
    shared: Arc<Shared>,
    inner: ChannelSource,
    stop: watch::Sender<bool>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl std::fmt::Debug for RabbitSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitSource")
            .field("queue", &self.shared.cfg.queue)
            .field("generation", &self.shared.generation.load(Ordering::SeqCst))
            .finish_non_exhaustive()
    }
}

impl RabbitSource {
    /// Connects, declares the queue, the dead-letter queue and the consumer; then consumes in
    /// the background, reconnecting with back-off. Fails when the first connection or a
    /// declaration fails (bad URL, credentials, queue arguments).
    pub async fn connect(cfg: RabbitSourceConfig) -> Result<Self, RabbitError> {
        if cfg.prefetch == 0 {
            return Err(RabbitError::Config(
                "prefetch 0 means unlimited unacked deliveries: set a bound (e.g. 100)".into(),
            ));
        }
        let shared = Arc::new(Shared {
            dlq: cfg.dead_letter_queue_name(),
            cfg,
            generation: AtomicU64::new(0),
            tiers: Mutex::new(HashMap::new()),
            held: Mutex::new(DelayedRedelivery::new()),
            held_changed: Notify::new(),
            fatal: Mutex::new(None),
        });
        let first = open_session(&shared).await?;
        let (tx, inner) = channel_source(usize::from(shared.cfg.prefetch));
        let (stop, stop_rx) = watch::channel(false);
        let task = tokio::spawn(guarded(
            shared.clone(),
            tx.clone(),
            run(shared.clone(), Some(first), tx, stop_rx),
        ));
        Ok(Self {
            shared,
            inner,
            stop,
            task: Some(task),
        })
    }

    /// The connection task's panic, as `poll`'s error.
    fn fatal(&self) -> Option<SourceError> {
        self.shared
            .fatal
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .map(SourceError::Broker)
    }

    /// Ordered mode: due held deliveries first; nothing new while one is held.
    async fn poll_ordered(&mut self, max: usize) -> Result<Option<Vec<Delivery>>, SourceError> {
        loop {
            let (due, next) = {
                let mut held = self.shared.held.lock().unwrap_or_else(|e| e.into_inner());
                let due: Vec<Delivery> = held
                    .pop_due(Instant::now(), max)
                    .into_iter()
                    .filter(|d| !d.is_stale())
                    .collect();
                (due, held.next_due())
            };
            if !due.is_empty() {
                return Ok(Some(due));
            }
            match next {
                Some(at) => tokio::select! {
                    _ = tokio::time::sleep_until(at) => {}
                    _ = self.shared.held_changed.notified() => {}
                },
                None => tokio::select! {
                    got = self.inner.poll(max) => return got,
                    _ = self.shared.held_changed.notified() => {}
                },
            }
        }
    }
}

#[async_trait]
impl Source for RabbitSource {
    async fn poll(&mut self, max: usize) -> Result<Option<Vec<Delivery>>, SourceError> {
        if self.task.is_none() {
            return Err(SourceError::Config("poll after close".into()));
        }
        if let Some(e) = self.fatal() {
            return Err(e);
        }
        let got = if self.shared.cfg.ordered {
            self.poll_ordered(max).await
        } else {
            self.inner.poll(max).await
        };
        match (got, self.fatal()) {
            // The channel ended because the connection task died, not because it stopped.
            (Ok(None), Some(e)) => Err(e),
            (got, _) => got,
        }
    }

    async fn close(&mut self) -> Result<(), SourceError> {
        // Stale from now on: nothing settles on the channel being closed.
        self.shared.generation.fetch_add(1, Ordering::SeqCst);
        drop(self.shared.release_held());
        let _ = self.stop.send(true);
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
        self.inner.close().await
    }
}

impl Drop for RabbitSource {
    fn drop(&mut self) {
        // A crash as far as the broker is concerned: the task closes the connection, the
        // broker requeues what was unacked.
        self.shared.generation.fetch_add(1, Ordering::SeqCst);
        drop(self.shared.release_held());
        let _ = self.stop.send(true);
    }
}

#[cfg(test)]
mod conversion_tests {
    use super::*;
    use crate::fields::arbitrary::{bytes, table, text};
    use lapin::types::{LongString, ShortString};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// An integer header of any AMQP width, extremes included.
    fn count(rng: &mut StdRng) -> AMQPValue {
        let big = rng.gen_bool(0.5);
        match rng.gen_range(0..5) {
            0 => AMQPValue::LongLongInt(if big { i64::MAX } else { rng.gen() }),
            1 => AMQPValue::Timestamp(if big { u64::MAX } else { rng.gen() }),
            2 => AMQPValue::LongUInt(if big { u32::MAX } else { rng.gen() }),
            3 => AMQPValue::ShortShortInt(rng.gen()),
            _ => AMQPValue::LongString(LongString::from(bytes(rng))),
        }
    }

    fn delivery(rng: &mut StdRng) -> lapin::message::Delivery {
        let mut p = BasicProperties::default();
        let short = |rng: &mut StdRng| ShortString::from(text(rng, 255));
        if rng.gen_bool(0.7) {
            p = p.with_message_id(short(rng));
        }
        if rng.gen_bool(0.3) {
            p = p.with_correlation_id(short(rng));
        }
        if rng.gen_bool(0.3) {
            p = p.with_reply_to(short(rng));
        }
        if rng.gen_bool(0.3) {
            p = p.with_content_type(short(rng));
        }
        if rng.gen_bool(0.3) {
            p = p.with_content_encoding(short(rng));
        }
        if rng.gen_bool(0.3) {
            p = p.with_type(short(rng));
        }
        if rng.gen_bool(0.3) {
            p = p.with_timestamp(rng.gen());
        }
        if rng.gen_bool(0.8) {
            let mut t = table(rng, 2);
            if rng.gen_bool(0.4) {
                t.insert(RETRIES.into(), count(rng));
            }
            if rng.gen_bool(0.4) {
                t.insert("x-delivery-count".into(), count(rng));
            }
            p = p.with_headers(t);
        }
        lapin::message::Delivery {
            delivery_tag: rng.gen(),
            exchange: short(rng),
            routing_key: short(rng),
            redelivered: rng.gen(),
            properties: p,
            data: bytes(rng),
            acker: lapin::acker::Acker::default(),
        }
    }

    #[test]
    fn every_delivery_becomes_an_envelope_whatever_it_holds() {
        for seed in 0..3_000u64 {
            let mut rng = StdRng::seed_from_u64(seed);
            let d = delivery(&mut rng);
            let cluster = Some("c".to_string());
            let (env, retries) =
                envelope_of("q", cluster.as_ref(), &d, Bytes::from(d.data.clone()));
            let p = &d.properties;
            assert_eq!(&env.payload[..], &d.data[..], "seed {seed}");
            assert_eq!(env.source.name, "q");
            assert_eq!(env.source.cluster, cluster);
            assert_eq!(
                env.source.position,
                Some(Position::DeliveryTag(d.delivery_tag))
            );
            let id = p.message_id().as_ref().map(|s| s.as_str());
            assert_eq!(env.message_id.as_deref(), id, "seed {seed}");
            assert_eq!(env.key.as_deref(), id.map(str::as_bytes), "seed {seed}");
            let named = [
                (props::REPLY_TO, p.reply_to()),
                (props::CORRELATION_ID, p.correlation_id()),
                (props::CONTENT_TYPE, p.content_type()),
                (props::CONTENT_ENCODING, p.content_encoding()),
                (props::MESSAGE_TYPE, p.kind()),
            ];
            for (name, v) in named {
                assert_eq!(
                    env.headers.get_str(name),
                    v.as_ref().map(|s| s.as_str()),
                    "seed {seed}: {name}"
                );
            }
            assert_eq!(
                env.headers.get_str(props::EXCHANGE),
                Some(d.exchange.as_str())
            );
            assert_eq!(
                env.headers.get_str(props::ROUTING_KEY),
                Some(d.routing_key.as_str())
            );
            let table = p.headers().clone().unwrap_or_default();
            for (name, v) in table.inner() {
                let (b, _) = crate::fields::to_header(v);
                assert!(
                    env.headers
                        .iter()
                        .any(|(n, got)| n == name.as_str() && *got == b),
                    "seed {seed}: header {name:?} carried"
                );
            }
            let carried_retries = get_u64(&table, RETRIES).unwrap_or(0);
            assert_eq!(retries, carried_retries);
            let returned = get_u64(&table, "x-delivery-count").unwrap_or(0);
            let before = returned.saturating_add(carried_retries);
            if before > 0 {
                assert!(env.redelivered, "seed {seed}");
                assert_eq!(
                    env.delivery_count,
                    u32::try_from(before.saturating_add(1)).ok()
                );
            } else {
                assert_eq!(env.redelivered, d.redelivered);
                assert_eq!(env.delivery_count, None);
            }
        }
    }

    #[tokio::test]
    async fn a_panic_in_the_connection_task_makes_poll_fail() {
        let cfg = RabbitSourceConfig::new("amqp://127.0.0.1:1/%2f", "q");
        let shared = Arc::new(Shared {
            dlq: cfg.dead_letter_queue_name(),
            cfg,
            generation: AtomicU64::new(0),
            tiers: Mutex::new(HashMap::new()),
            held: Mutex::new(DelayedRedelivery::new()),
            held_changed: Notify::new(),
            fatal: Mutex::new(None),
        });
        let (tx, inner) = channel_source(4);
        let (stop, _stop_rx) = watch::channel(false);
        // Under the same guard as the connection task, panicking where it converts.
        let task = tokio::spawn(guarded(shared.clone(), tx.clone(), async move {
            let _owned = tx;
            panic!("injected: a delivery the conversion could not take")
        }));
        let mut source = RabbitSource {
            shared,
            inner,
            stop,
            task: Some(task),
        };
        let polled = tokio::time::timeout(Duration::from_secs(30), source.poll(10)).await;
        match polled {
            Err(_) => panic!("poll still waits 30 s after the connection task panicked"),
            Ok(Ok(None)) => panic!(
                "poll ended the source as if it had been closed: the panic went unnoticed \
                 and the consumer would stop without an error"
            ),
            Ok(Ok(Some(got))) => panic!("poll returned {got:?}"),
            Ok(Err(e)) => assert!(
                e.to_string()
                    .contains("the connection task panicked: injected: a delivery"),
                "{e}"
            ),
        }
        assert!(source.poll(10).await.is_err(), "the source stays failed");
        source.close().await.expect("close");
    }
}
