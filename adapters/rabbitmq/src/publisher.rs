//! The confirmed publisher: persistent messages, `mandatory`, a result only after the
//! broker's confirm.

use crate::fields::{from_header, put_str};
use crate::{connect, RabbitError};
use async_trait::async_trait;
use idemq_core::envelope::props;
use idemq_core::publish::{OutgoingMessage, PublishError, PublishReceipt, Publisher};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::publisher_confirm::{Confirmation, PublisherConfirm};
use lapin::types::{FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Connection};
use std::time::Duration;
use tokio::sync::Mutex;

/// The header the rabbitmq-message-deduplication plugin (exchange type
/// `x-message-deduplication`) reads the dedup key from: producers written for the plugin put
/// the key there, this crate's publisher writes it too, and [`RABBITMQ`](crate::RABBITMQ)
/// lists it as a dedup slot.
pub const PLUGIN_DEDUP_HEADER: &str = "x-deduplication-header";

/// Publishes to RabbitMQ with publisher confirms; see [`Publisher`] for what each error
/// means for a resend.
///
/// [`OutgoingMessage::destination`] is `exchange/routing-key`, or a queue name (sent through
/// the default exchange). The dedup key goes into [`DEDUP_HEADER`](idemq_core::DEDUP_HEADER),
/// [`PLUGIN_DEDUP_HEADER`] and `message_id`; the envelope's reserved property names
/// (`props::CORRELATION_ID`, `REPLY_TO`, `CONTENT_TYPE`, `CONTENT_ENCODING`, `MESSAGE_TYPE`)
/// become AMQP properties.
pub struct RabbitPublisher {
    url: String,
    confirm_timeout: Duration,
    link: Mutex<Option<(Connection, Channel)>>,
}

impl std::fmt::Debug for RabbitPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitPublisher")
            .field("confirm_timeout", &self.confirm_timeout)
            .finish_non_exhaustive()
    }
}

/// Splits a destination into exchange and routing key.
pub fn route(destination: &str) -> (&str, &str) {
    destination.split_once('/').unwrap_or(("", destination))
}

fn properties(msg: &OutgoingMessage) -> BasicProperties {
    let mut headers = FieldTable::default();
    let wire = msg.wire_headers();
    for (name, value) in wire.iter() {
        let ty = msg.headers.get_str(&props::type_of(name));
        headers.insert(ShortString::from(name.to_string()), from_header(value, ty));
    }
    let mut p = BasicProperties::default().with_delivery_mode(2);
    let id = msg.dedup_key.clone().or_else(|| {
        msg.key
            .as_ref()
            .and_then(|k| std::str::from_utf8(k).ok().map(str::to_string))
    });
    if let Some(k) = &msg.dedup_key {
        put_str(&mut headers, PLUGIN_DEDUP_HEADER, k);
    }
    if let Some(id) = id {
        p = p.with_message_id(id.into());
    }
    let prop = |name: &str| {
        msg.headers
            .get_str(name)
            .map(|s| ShortString::from(s.to_string()))
    };
    if let Some(v) = prop(props::CORRELATION_ID) {
        p = p.with_correlation_id(v);
    }
    if let Some(v) = prop(props::REPLY_TO) {
        p = p.with_reply_to(v);
    }
    if let Some(v) = prop(props::CONTENT_TYPE) {
        p = p.with_content_type(v);
    }
    if let Some(v) = prop(props::CONTENT_ENCODING) {
        p = p.with_content_encoding(v);
    }
    if let Some(v) = prop(props::MESSAGE_TYPE) {
        p = p.with_type(v);
    }
    if let Ok(now) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        p = p.with_timestamp(now.as_secs());
    }
    p.with_headers(headers)
}

impl RabbitPublisher {
    /// Connects to `url` and enables publisher confirms. Confirms are awaited 30 s at most.
    pub async fn connect(url: impl Into<String>) -> Result<Self, RabbitError> {
        let p = Self {
            url: url.into(),
            confirm_timeout: Duration::from_secs(30),
            link: Mutex::new(None),
        };
        // channel() connects through crate::connect, whose error already names the URL
        // without its password and is scrubbed of it.
        p.channel()
            .await
            .map_err(|e| RabbitError::Connect(e.to_string()))?;
        Ok(p)
    }

    /// Waits at most `timeout` after each message's send for its confirm (in a batch too);
    /// past it the outcome is [`PublishError::Ambiguous`].
    pub fn with_confirm_timeout(mut self, timeout: Duration) -> Self {
        self.confirm_timeout = timeout;
        self
    }

    /// Closes the connection (AMQP `connection.close`, 200): call it before the runtime
    /// shuts down, or lapin's I/O loop logs the connection as failed. Confirms already
    /// awaited are unaffected; a later publish connects again.
    pub async fn close(&self) -> Result<(), RabbitError> {
        let link = self.link.lock().await.take();
        match link {
            Some((conn, _)) if conn.status().connected() => conn
                .close(200, "publisher closed")
                .await
                .map_err(|e| RabbitError::Connect(format!("closing the connection: {e}"))),
            _ => Ok(()),
        }
    }

    /// The live channel, reconnecting when the last one is gone.
    async fn channel(&self) -> Result<Channel, PublishError> {
        let mut link = self.link.lock().await;
        if let Some((conn, ch)) = link.as_ref() {
            if conn.status().connected() && ch.status().connected() {
                return Ok(ch.clone());
            }
            tracing::info!("rabbitmq publisher channel gone; reconnecting");
            metrics::counter!(crate::metrics::RECONNECTS).increment(1);
        }
        let disconnected = |e: RabbitError| PublishError::Disconnected(e.to_string());
        let conn = connect(&self.url, "idemq-publisher")
            .await
            .map_err(disconnected)?;
        let ch = conn
            .create_channel()
            .await
            .map_err(|e| disconnected(e.into()))?;
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| disconnected(e.into()))?;
        *link = Some((conn, ch.clone()));
        Ok(ch)
    }

    /// Sends one message; the returned future is the broker's confirm.
    async fn send(
        &self,
        ch: &Channel,
        msg: &OutgoingMessage,
    ) -> Result<PublisherConfirm, PublishError> {
        let (exchange, routing_key) = route(&msg.destination);
        let opts = BasicPublishOptions {
            mandatory: true,
            ..BasicPublishOptions::default()
        };
        // A failure here means the frame did not leave: safe to resend.
        ch.basic_publish(exchange, routing_key, opts, &msg.payload, properties(msg))
            .await
            .map_err(|e| PublishError::Disconnected(e.to_string()))
    }

    /// Waits for `confirm` until `deadline`, set when the message was sent: a batch settles
    /// within one `confirm_timeout` of its last send, not one per message.
    async fn settle(
        &self,
        destination: &str,
        confirm: PublisherConfirm,
        deadline: tokio::time::Instant,
    ) -> Result<PublishReceipt, PublishError> {
        let outcome = match tokio::time::timeout_at(deadline, confirm).await {
            Err(_) => Err(PublishError::Ambiguous(format!(
                "no confirm within {:?}",
                self.confirm_timeout
            ))),
            // Sent, then the channel or connection died before the confirm.
            Ok(Err(e)) => Err(PublishError::Ambiguous(format!(
                "connection lost after send: {e}"
            ))),
            Ok(Ok(Confirmation::Ack(Some(ret)))) => Err(PublishError::Unroutable(format!(
                "{destination}: {} {}",
                ret.reply_code, ret.reply_text
            ))),
            Ok(Ok(Confirmation::Nack(_))) => Err(PublishError::Rejected(format!(
                "{destination}: the broker nacked the message"
            ))),
            Ok(Ok(Confirmation::Ack(None) | Confirmation::NotRequested)) => Ok(PublishReceipt {
                destination: destination.to_string(),
                ..PublishReceipt::default()
            }),
        };
        let label = match &outcome {
            Ok(_) => "confirmed",
            Err(PublishError::Unroutable(_)) => "unroutable",
            Err(PublishError::Rejected(_)) => "rejected",
            Err(_) => "ambiguous",
        };
        metrics::counter!(crate::metrics::PUBLISHED, "outcome" => label).increment(1);
        outcome
    }
}

#[async_trait]
impl Publisher for RabbitPublisher {
    async fn publish(&self, msg: OutgoingMessage) -> Result<PublishReceipt, PublishError> {
        let ch = self.channel().await?;
        let confirm = self.send(&ch, &msg).await?;
        let deadline = tokio::time::Instant::now() + self.confirm_timeout;
        self.settle(&msg.destination, confirm, deadline).await
    }

    /// Pipelined: every message is sent first, then the confirms are collected.
    async fn publish_batch(
        &self,
        msgs: Vec<OutgoingMessage>,
    ) -> Vec<Result<PublishReceipt, PublishError>> {
        let ch = match self.channel().await {
            Ok(ch) => ch,
            Err(e) => return msgs.iter().map(|_| Err(e.clone())).collect(),
        };
        let mut pending = Vec::with_capacity(msgs.len());
        for m in &msgs {
            let sent = self.send(&ch, m).await;
            pending.push((sent, tokio::time::Instant::now() + self.confirm_timeout));
        }
        let mut out = Vec::with_capacity(msgs.len());
        for (m, (sent, deadline)) in msgs.iter().zip(pending) {
            out.push(match sent {
                Ok(confirm) => self.settle(&m.destination, confirm, deadline).await,
                Err(e) => Err(e),
            });
        }
        out
    }
}
