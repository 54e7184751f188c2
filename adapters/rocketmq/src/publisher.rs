//! The keyed, confirmed publisher: `SEND_OK` is the only confirmation.

use crate::client::{env, own_client};
use crate::fields::to_message;
use crate::RocketError;
use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use idemq_core::engine::RetryPolicy;
use idemq_core::envelope::Position;
use idemq_core::publish::{OutgoingMessage, PublishError, PublishReceipt, Publisher};
use rocketmq_client_rust::{ClientError, DefaultMQProducer};
use rocketmq_model::common::message::message_queue::MessageQueue;
use rocketmq_model::common::message::message_single::Message;
use rocketmq_model::result::{SendResult, SendStatus};
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::RwLock;

/// Publisher settings.
#[derive(Debug, Clone)]
pub struct RocketPublisherConfig {
    /// Name server address, `host:port` (several separated by `;`).
    pub name_server: String,
    /// Producer group (one per application role).
    pub group: String,
    /// Per-send timeout in milliseconds.
    pub send_timeout_ms: u64,
    /// Sends [`Publisher::publish_batch`] keeps in flight at once (at least 1). One
    /// ordering lane (the ordering key, else the message key) is never sent concurrently
    /// with itself, and after one of its messages fails the rest of it is not sent, so its
    /// order holds.
    pub max_in_flight: usize,
}

impl RocketPublisherConfig {
    /// A publisher of `group` through the name server at `name_server`.
    pub fn new(name_server: impl Into<String>, group: impl Into<String>) -> Self {
        Self {
            name_server: name_server.into(),
            group: group.into(),
            send_timeout_ms: 5_000,
            max_in_flight: 64,
        }
    }
}

/// The pauses between sends the broker answered `SYSTEM_BUSY`: 5 ms doubling to 200 ms,
/// jittered ±50% (so lanes turned away together do not come back together); bounded by
/// `send_timeout_ms`, not by a count.
const BUSY_RETRY: RetryPolicy = RetryPolicy {
    initial_delay: Duration::from_millis(5),
    max_delay: Duration::from_millis(200),
    multiplier: 2.0,
    jitter: 0.5,
    max_attempts: None,
};

/// A [`Publisher`] over RocketMQ's `DefaultMQProducer`.
///
/// `KEYS` = dedup key first, then the message key; the ordering key becomes the sharding
/// key. The ordering key, else the message key, picks the queue (hash modulo the queue
/// count), so one key's messages stay in one queue, in order, for orderly consumers;
/// messages without either are spread over the queues. Only `SEND_OK` confirms: flush-disk /
/// flush-slave / slave-unavailable statuses and timeouts are [`PublishError::Ambiguous`];
/// `SYSTEM_BUSY` (flow control, or a broker whose disk is too full to write) is retried
/// within `send_timeout_ms`, then [`PublishError::Busy`]; an unknown topic is
/// [`PublishError::Unroutable`]; any other broker response code is
/// [`PublishError::Rejected`].
pub struct RocketPublisher {
    /// Sends share the producer (the client's sends take `&self`); only shutdown is
    /// exclusive.
    producer: Arc<RwLock<DefaultMQProducer>>,
    cfg: RocketPublisherConfig,
}

impl RocketPublisher {
    /// Starts a producer.
    pub async fn connect(cfg: RocketPublisherConfig) -> Result<Self, RocketError> {
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
            producer: Arc::new(RwLock::new(producer)),
            cfg,
        })
    }

    /// Sends an already built RocketMQ message (tags, keys and properties as given).
    ///
    /// A broker that answers `SYSTEM_BUSY` (its flow control: not stored) is asked again
    /// after a pause (5 ms, doubling up to 200 ms, jittered) while `send_timeout_ms` lasts,
    /// each attempt bounded by what is left of it; then the answer is
    /// [`PublishError::Busy`]. The client does not retry these for a send with a queue
    /// selector, and a publisher with many sends in flight meets them.
    pub async fn send_raw(
        &self,
        msg: Message,
        ordering_key: Option<&[u8]>,
    ) -> Result<PublishReceipt, PublishError> {
        let patience = Duration::from_millis(self.cfg.send_timeout_ms);
        let started = Instant::now();
        let mut attempt = 0;
        loop {
            let left = patience.saturating_sub(started.elapsed());
            let left_ms = u64::try_from(left.as_millis()).unwrap_or(u64::MAX).max(1);
            match self.send_once(msg.clone(), ordering_key, left_ms).await {
                Err(PublishError::Busy(why)) => {
                    metrics::counter!("idemq_rocketmq_publish_busy_total").increment(1);
                    attempt += 1;
                    let nap = BUSY_RETRY.delay(attempt);
                    if started.elapsed() + nap >= patience {
                        return Err(PublishError::Busy(format!(
                            "{why}; still busy after {patience:?}"
                        )));
                    }
                    tokio::time::sleep(nap).await;
                }
                other => return other,
            }
        }
    }

    async fn send_once(
        &self,
        msg: Message,
        ordering_key: Option<&[u8]>,
        timeout_ms: u64,
    ) -> Result<PublishReceipt, PublishError> {
        let topic = msg.topic().to_string();
        let producer = self.producer.read().await;
        let sent = match ordering_key {
            Some(k) => {
                let mut h = std::collections::hash_map::DefaultHasher::new();
                k.hash(&mut h);
                let slot = h.finish();
                producer
                    .send_with_selector_timeout(
                        msg,
                        |mqs: &[MessageQueue], _m: &Message, slot: &u64| {
                            (!mqs.is_empty())
                                .then(|| mqs[(*slot % mqs.len() as u64) as usize].clone())
                        },
                        slot,
                        timeout_ms,
                    )
                    .await
            }
            None => producer.send_with_timeout(msg, timeout_ms).await,
        };
        drop(producer);
        let result = sent.map_err(|e| classify(&topic, e))?;
        confirmed(&topic, result)
    }

    /// Stops the producer.
    pub async fn shutdown(&self) {
        self.producer.write().await.shutdown().await;
    }
}

/// The messages of a batch by ordering lane (the ordering key, else the message key), in
/// the order each lane first appears; a message with neither is a lane of its own. Each
/// message keeps its index in the batch.
fn lanes(msgs: Vec<OutgoingMessage>) -> Vec<Vec<(usize, OutgoingMessage)>> {
    let mut lanes: Vec<Vec<(usize, OutgoingMessage)>> = Vec::new();
    let mut lane_of: HashMap<Bytes, usize> = HashMap::new();
    for (i, m) in msgs.into_iter().enumerate() {
        match m.ordering_key.as_ref().or(m.key.as_ref()) {
            Some(k) => {
                let lane = *lane_of.entry(k.clone()).or_insert_with(|| {
                    lanes.push(Vec::new());
                    lanes.len() - 1
                });
                lanes[lane].push((i, m));
            }
            None => lanes.push(vec![(i, m)]),
        }
    }
    lanes
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
    classify_code(topic, e.broker_response_code(), &e.to_string())
}

fn classify_code(topic: &str, code: Option<i32>, e: &str) -> PublishError {
    match code {
        // SYSTEM_BUSY: flow control ("broker busy, retry later"), not stored.
        Some(2) => PublishError::Busy(format!("{topic}: broker code 2 (system busy): {e}")),
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

    /// Pipelined: up to `max_in_flight` sends at once, one lane's messages one after
    /// another in batch order. After a failure the rest of that lane is not sent
    /// ([`PublishError::Disconnected`]: resending is safe): sent, a later message could be
    /// stored before the failed one's resend and overtake it in its queue. A synchronous send costs a broker round trip, so the
    /// one-at-a-time default bounded a publisher to a few hundred messages a second.
    async fn publish_batch(
        &self,
        msgs: Vec<OutgoingMessage>,
    ) -> Vec<Result<PublishReceipt, PublishError>> {
        in_lanes(msgs, self.cfg.max_in_flight, |m| self.publish(m)).await
    }
}

type Outcome = Result<PublishReceipt, PublishError>;

/// Sends `msgs` through `send`, up to `max_in_flight` lanes at once, one lane's messages one
/// after another; after a failure the rest of its lane is not sent. Results in batch order.
async fn in_lanes<F, Fut>(msgs: Vec<OutgoingMessage>, max_in_flight: usize, send: F) -> Vec<Outcome>
where
    F: Fn(OutgoingMessage) -> Fut,
    Fut: std::future::Future<Output = Outcome>,
{
    let n = msgs.len();
    let send = &send;
    let sent: Vec<Vec<(usize, Outcome)>> = futures::stream::iter(lanes(msgs))
        .map(|lane| async move {
            let mut out = Vec::with_capacity(lane.len());
            let mut failed = false;
            for (i, m) in lane {
                let r = if failed {
                    Err(PublishError::Disconnected(
                        "not sent: an earlier message of its ordering lane failed, \
                         and this one would overtake its resend"
                            .into(),
                    ))
                } else {
                    send(m).await
                };
                failed |= r.is_err();
                out.push((i, r));
            }
            out
        })
        .buffer_unordered(max_in_flight.max(1))
        .collect()
        .await;
    let mut results: Vec<Option<Outcome>> = (0..n).map(|_| None).collect();
    for (i, r) in sent.into_iter().flatten() {
        results[i] = Some(r);
    }
    results
        .into_iter()
        .map(|r| {
            r.unwrap_or_else(|| {
                Err(PublishError::Ambiguous(
                    "the batch lost track of this message".into(),
                ))
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(key: Option<&str>, ordering: Option<&str>) -> OutgoingMessage {
        let mut m = OutgoingMessage::new("t", "{}");
        if let Some(k) = key {
            m = m.with_key(k.to_string());
        }
        if let Some(o) = ordering {
            m = m.with_ordering_key(o.to_string());
        }
        m
    }

    #[test]
    fn broker_codes_say_whether_the_message_was_stored_and_may_be_resent() {
        let busy = classify_code("t", Some(2), "broker operation failed");
        assert!(matches!(busy, PublishError::Busy(_)), "{busy:?}");
        assert!(busy.is_retryable() && !busy.may_be_stored());
        let missing = classify_code("t", Some(17), "no route");
        assert!(
            matches!(missing, PublishError::Unroutable(_)),
            "{missing:?}"
        );
        let refused = classify_code("t", Some(13), "message illegal");
        assert!(matches!(refused, PublishError::Rejected(_)), "{refused:?}");
        assert!(!refused.is_retryable());
        let lost = classify_code("t", None, "timeout");
        assert!(lost.may_be_stored() && lost.is_retryable());
    }

    #[tokio::test]
    async fn a_failed_send_stops_its_lane_and_no_other() {
        let sent = std::sync::Mutex::new(Vec::new());
        let batch = vec![
            msg(Some("a"), None).with_dedup_key("a1"),
            msg(Some("b"), None).with_dedup_key("b1"),
            msg(Some("a"), None).with_dedup_key("a2"), // fails
            msg(Some("b"), None).with_dedup_key("b2"),
            msg(Some("a"), None).with_dedup_key("a3"), // must not go out
        ];
        let results = in_lanes(batch, 8, |m| {
            let key = m.dedup_key.clone().unwrap_or_default();
            sent.lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(key.clone());
            async move {
                if key == "a2" {
                    return Err(PublishError::Ambiguous("timeout".into()));
                }
                Ok(PublishReceipt {
                    destination: "t".into(),
                    partition: None,
                    position: None,
                    message_id: Some(key),
                })
            }
        })
        .await;
        let ids: Vec<String> = results
            .iter()
            .map(|r| match r {
                Ok(receipt) => receipt.message_id.clone().unwrap_or_default(),
                Err(PublishError::Ambiguous(_)) => "ambiguous".into(),
                Err(PublishError::Disconnected(_)) => "not sent".into(),
                Err(e) => format!("{e}"),
            })
            .collect();
        assert_eq!(ids, ["a1", "b1", "ambiguous", "b2", "not sent"]);
        let mut sent = sent.into_inner().unwrap_or_else(|e| e.into_inner());
        sent.sort();
        assert_eq!(
            sent,
            ["a1", "a2", "b1", "b2"],
            "a3 went out after a2 failed"
        );
    }

    #[test]
    fn a_batch_is_split_into_lanes_by_ordering_key_then_message_key() {
        let batch = vec![
            msg(Some("a"), None),
            msg(Some("b"), None),
            msg(None, None),
            msg(Some("x"), Some("a")), // the ordering key wins over the message key
            msg(Some("b"), None),
            msg(None, None),
        ];
        let indices: Vec<Vec<usize>> = lanes(batch)
            .into_iter()
            .map(|lane| lane.into_iter().map(|(i, _)| i).collect())
            .collect();
        // One lane per key in order of first appearance, batch order within a lane; each
        // message without a key is a lane of its own.
        assert_eq!(indices, vec![vec![0, 3], vec![1, 4], vec![2], vec![5]]);
    }
}
