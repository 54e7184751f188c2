//! The keyed, confirmed publisher: `SEND_OK` is the only confirmation.

use crate::client::{env, own_client};
use crate::fields::to_message;
use crate::RocketError;
use async_trait::async_trait;
use idemq_core::envelope::Position;
use idemq_core::publish::{OutgoingMessage, PublishError, PublishReceipt, Publisher};
use rocketmq_client_rust::{ClientError, DefaultMQProducer};
use rocketmq_model::common::message::message_queue::MessageQueue;
use rocketmq_model::common::message::message_single::Message;
use rocketmq_model::result::{SendResult, SendStatus};
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use tokio::sync::Mutex;

/// Publisher settings.
#[derive(Debug, Clone)]
pub struct PublisherConfig {
    /// Name server address, `host:port` (several separated by `;`).
    pub name_server: String,
    /// Producer group (one per application role).
    pub group: String,
    /// Per-send timeout in milliseconds.
    pub send_timeout_ms: u64,
}

impl PublisherConfig {
    /// A publisher of `group` through the name server at `name_server`.
    pub fn new(name_server: impl Into<String>, group: impl Into<String>) -> Self {
        Self {
            name_server: name_server.into(),
            group: group.into(),
            send_timeout_ms: 5_000,
        }
    }
}

/// A [`Publisher`] over RocketMQ's `DefaultMQProducer`.
///
/// `KEYS` = dedup key first, then the message key; the ordering key becomes the sharding
/// key. The ordering key, else the message key, picks the queue (hash modulo the queue
/// count), so one key's messages stay in one queue, in order, for orderly consumers;
/// messages without either are spread over the queues. Only `SEND_OK` confirms; flush-disk / flush-slave /
/// slave-unavailable statuses and timeouts are [`PublishError::Ambiguous`]; a broker
/// refusal with a response code is [`PublishError::Rejected`].
pub struct RocketPublisher {
    producer: Arc<Mutex<DefaultMQProducer>>,
    cfg: PublisherConfig,
}

impl RocketPublisher {
    /// Starts a producer.
    pub async fn connect(cfg: PublisherConfig) -> Result<Self, RocketError> {
        let env = env()?;
        let mut producer = DefaultMQProducer::builder(env.client.clone())
            .client_config(own_client(&cfg.name_server)?)
            .producer_group(cfg.group.clone())
            .build();
        producer
            .start()
            .await
            .map_err(|e| RocketError::Client(format!("producer {}: {e}", cfg.group)))?;
        Ok(Self {
            producer: Arc::new(Mutex::new(producer)),
            cfg,
        })
    }

    /// Sends an already built RocketMQ message (tags, keys and properties as given).
    pub async fn send_raw(
        &self,
        msg: Message,
        ordering_key: Option<&[u8]>,
    ) -> Result<PublishReceipt, PublishError> {
        let topic = msg.topic().to_string();
        let producer = self.producer.lock().await;
        let sent = match ordering_key {
            Some(k) => {
                let mut h = std::collections::hash_map::DefaultHasher::new();
                k.hash(&mut h);
                let slot = h.finish();
                producer
                    .send_with_selector(
                        msg,
                        |mqs: &[MessageQueue], _m: &Message, slot: &u64| {
                            (!mqs.is_empty())
                                .then(|| mqs[(*slot % mqs.len() as u64) as usize].clone())
                        },
                        slot,
                    )
                    .await
            }
            None => {
                producer
                    .send_with_timeout(msg, self.cfg.send_timeout_ms)
                    .await
            }
        };
        drop(producer);
        let result = sent.map_err(|e| classify(&topic, e))?;
        confirmed(&topic, result)
    }

    /// Stops the producer.
    pub async fn shutdown(&self) {
        self.producer.lock().await.shutdown().await;
    }
}

/// `SEND_OK` → a receipt; anything else → the error that says whether a resend is safe.
pub(crate) fn confirmed(
    topic: &str,
    result: Option<SendResult>,
) -> Result<PublishReceipt, PublishError> {
    let Some(r) = result else {
        return Err(PublishError::Ambiguous(format!(
            "{topic}: the client returned no send result"
        )));
    };
    match r.send_status {
        SendStatus::SendOk => {}
        other => {
            metrics::counter!("idemq_rocketmq_publish_ambiguous_total").increment(1);
            return Err(PublishError::Ambiguous(format!(
                "{topic}: broker answered {other:?}, not SEND_OK"
            )));
        }
    }
    Ok(PublishReceipt {
        destination: topic.to_string(),
        partition: r.message_queue.as_ref().map(|q| q.queue_id()),
        position: i64::try_from(r.queue_offset)
            .ok()
            .map(Position::QueueOffset),
        message_id: r.msg_id.map(|id| id.to_string()),
    })
}

/// A client error: a broker response code means refused (not stored); anything else (a
/// timeout, a lost connection mid-request) may have been stored.
pub(crate) fn classify(topic: &str, e: ClientError) -> PublishError {
    match e.broker_response_code() {
        // TOPIC_NOT_EXIST
        Some(17) => PublishError::Unroutable(format!("{topic}: {e}")),
        Some(code) => PublishError::Rejected(format!("{topic}: broker code {code}: {e}")),
        None => PublishError::Ambiguous(format!("{topic}: {e}")),
    }
}

#[async_trait]
impl Publisher for RocketPublisher {
    async fn publish(&self, msg: OutgoingMessage) -> Result<PublishReceipt, PublishError> {
        let m = to_message(&msg)?;
        // Like Kafka's partitioner: the ordering key, else the message key, picks the queue.
        let lane = msg.ordering_key.as_ref().or(msg.key.as_ref());
        let r = self.send_raw(m, lane.map(|k| &k[..])).await;
        match &r {
            Ok(_) => metrics::counter!("idemq_rocketmq_published_total").increment(1),
            Err(e) => {
                tracing::warn!(topic = %msg.destination, error = %e, "rocketmq publish failed")
            }
        }
        r
    }
}
