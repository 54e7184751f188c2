//! The Kafka [`Publisher`]: one result per message, after the broker's acknowledgement.

use crate::config::KafkaProducerConfig;
use crate::KafkaSourceError;
use async_trait::async_trait;
use idemq_core::envelope::{Headers, Position};
use idemq_core::publish::{OutgoingMessage, PublishError, PublishReceipt, Publisher};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::ClientConfig;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

/// Client keys copied from a consumer's configuration into the dead-letter producer's.
const SHARED_PREFIXES: [&str; 5] = ["bootstrap.servers", "security.", "sasl.", "ssl.", "client."];

/// Publishes [`OutgoingMessage`]s to Kafka.
///
/// Headers are [`OutgoingMessage::wire_headers`] (so the dedup key travels in
/// [`DEDUP_HEADER`](idemq_core::publish::DEDUP_HEADER)); the record key is
/// [`OutgoingMessage::key`]; with an [`OutgoingMessage::ordering_key`] the partition is
/// chosen from it with Kafka's default (murmur2) hash, otherwise librdkafka partitions by
/// the record key. Each result comes only after the delivery report.
#[derive(Clone)]
pub struct KafkaPublisher {
    producer: FutureProducer,
    timeout: Duration,
    partitions: std::sync::Arc<Mutex<HashMap<String, i32>>>,
}

impl std::fmt::Debug for KafkaPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaPublisher")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl KafkaPublisher {
    /// A publisher over a validated producer configuration (see
    /// [`KafkaProducerConfig::idempotent`]). The client connects lazily: a broker that is
    /// not up yet fails the first sends (after `message.timeout.ms`), not this call, whose
    /// errors are the configuration's.
    pub async fn connect(cfg: &KafkaProducerConfig) -> Result<Self, KafkaSourceError> {
        let client = cfg.client_config()?;
        let producer = client
            .create()
            .map_err(|e| KafkaSourceError::Client(e.to_string()))?;
        Ok(Self {
            producer,
            timeout: Duration::from_secs(30),
            partitions: Default::default(),
        })
    }

    /// How long a message may wait in the local queue when it is full (builder form).
    pub fn queue_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The underlying producer.
    pub fn producer(&self) -> &FutureProducer {
        &self.producer
    }

    /// An idempotent producer reaching the same cluster as a consumer configuration
    /// (bootstrap, security and client keys copied).
    pub(crate) fn producer_for(
        consumer: &ClientConfig,
    ) -> Result<FutureProducer, KafkaSourceError> {
        let bootstrap = consumer.get("bootstrap.servers").unwrap_or_default();
        let mut cfg = KafkaProducerConfig::idempotent(bootstrap);
        for (k, v) in consumer.config_map() {
            if SHARED_PREFIXES.iter().any(|p| k.starts_with(p)) {
                cfg = cfg.set(k, v);
            }
        }
        cfg.client_config()?
            .create()
            .map_err(|e| KafkaSourceError::Client(e.to_string()))
    }

    async fn partition_for(&self, topic: &str, ordering_key: &[u8]) -> Result<i32, PublishError> {
        let known = self
            .partitions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(topic)
            .copied();
        let count = match known {
            Some(n) => n,
            None => {
                let producer = self.producer.clone();
                let t = topic.to_string();
                let n = tokio::task::spawn_blocking(move || {
                    producer
                        .client()
                        .fetch_metadata(Some(&t), Duration::from_secs(10))
                        .map(|m| {
                            m.topics()
                                .iter()
                                .find(|mt| mt.name() == t)
                                .map(|mt| mt.partitions().len() as i32)
                                .unwrap_or(0)
                        })
                })
                .await
                .map_err(|e| PublishError::Disconnected(e.to_string()))?
                .map_err(|e| PublishError::Disconnected(format!("metadata of {topic}: {e}")))?;
                if n == 0 {
                    return Err(PublishError::Unroutable(format!(
                        "topic {topic} has no partitions"
                    )));
                }
                self.partitions
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(topic.to_string(), n);
                n
            }
        };
        Ok(partition_of(ordering_key, count))
    }
}

#[async_trait]
impl Publisher for KafkaPublisher {
    async fn publish(&self, msg: OutgoingMessage) -> Result<PublishReceipt, PublishError> {
        let partition = match &msg.ordering_key {
            Some(k) => Some(self.partition_for(&msg.destination, k).await?),
            None => None,
        };
        let (partition, offset) = produce(
            &self.producer,
            &msg.destination,
            msg.key.as_deref(),
            partition,
            &msg.wire_headers(),
            &msg.payload,
            self.timeout,
        )
        .await?;
        Ok(PublishReceipt {
            destination: msg.destination,
            partition: Some(partition),
            position: Some(Position::Offset(offset)),
            message_id: None,
        })
    }

    async fn publish_batch(
        &self,
        msgs: Vec<OutgoingMessage>,
    ) -> Vec<Result<PublishReceipt, PublishError>> {
        // Every send is enqueued before any delivery report is awaited: one window of acks.
        futures::future::join_all(msgs.into_iter().map(|m| self.publish(m))).await
    }
}

/// Kafka's default partitioner: murmur2 of the key, positive, modulo the partition count
/// (the Java client's choice, so producers in other languages agree).
pub fn partition_of(key: &[u8], partitions: i32) -> i32 {
    ((murmur2(key) & 0x7fff_ffff) as i32) % partitions.max(1)
}

fn murmur2(data: &[u8]) -> u32 {
    const M: u32 = 0x5bd1_e995;
    let mut h: u32 = 0x9747_b28c ^ data.len() as u32;
    let chunks = data.chunks_exact(4);
    let rest = chunks.remainder();
    for c in chunks {
        let mut k = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> 24;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M) ^ k;
    }
    if rest.len() >= 3 {
        h ^= (rest[2] as u32) << 16;
    }
    if rest.len() >= 2 {
        h ^= (rest[1] as u32) << 8;
    }
    if !rest.is_empty() {
        h ^= rest[0] as u32;
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^ (h >> 15)
}

/// Produces one record and waits for its delivery report: `(partition, offset)`.
pub(crate) async fn produce(
    producer: &FutureProducer,
    topic: &str,
    key: Option<&[u8]>,
    partition: Option<i32>,
    headers: &Headers,
    payload: &[u8],
    queue_timeout: Duration,
) -> Result<(i32, i64), PublishError> {
    let mut kh = OwnedHeaders::new_with_capacity(headers.len());
    for (name, value) in headers.iter() {
        kh = kh.insert(Header {
            key: name,
            value: Some(value.as_ref()),
        });
    }
    let mut rec: FutureRecord<'_, [u8], [u8]> =
        FutureRecord::to(topic).payload(payload).headers(kh);
    if let Some(k) = key {
        rec = rec.key(k);
    }
    if let Some(p) = partition {
        rec = rec.partition(p);
    }
    match producer.send(rec, queue_timeout).await {
        Ok(d) => Ok((d.partition, d.offset)),
        Err((e, _)) => Err(publish_error(&e)),
    }
}

/// What a producer error means for a resend (see [`PublishError`]).
pub fn publish_error(e: &KafkaError) -> PublishError {
    use RDKafkaErrorCode as C;
    let text = e.to_string();
    let code = match e {
        KafkaError::MessageProduction(c) => *c,
        KafkaError::Transaction(t) if t.is_fatal() && t.code() == C::Fenced => C::Fenced,
        KafkaError::Transaction(t) => t.code(),
        KafkaError::ClientConfig(..) | KafkaError::ClientCreation(_) => {
            return PublishError::Config(text)
        }
        _ => return PublishError::Ambiguous(text),
    };
    match code {
        C::ProducerFenced
        | C::InvalidProducerEpoch
        | C::Fenced
        | C::TransactionCoordinatorFenced => PublishError::Fenced(text),
        C::UnknownTopicOrPartition | C::UnknownTopic | C::UnknownPartition => {
            PublishError::Unroutable(text)
        }
        C::MessageSizeTooLarge
        | C::InvalidMessageSize
        | C::InvalidMessage
        | C::InvalidRecord
        | C::TopicAuthorizationFailed
        | C::ClusterAuthorizationFailed
        | C::TransactionalIdAuthorizationFailed
        | C::InvalidRequiredAcks
        | C::InvalidTopic
        | C::PolicyViolation => PublishError::Rejected(text),
        // Never left the client.
        C::QueueFull | C::PurgeQueue => PublishError::Disconnected(text),
        C::InvalidArgument | C::InvalidTransactionTimeout => PublishError::Config(text),
        // Timeouts, transport failures, in-flight purges: the broker may have it.
        _ => PublishError::Ambiguous(text),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn murmur2_matches_the_java_client() {
        // Values from Kafka's UtilsTest.testMurmur2.
        assert_eq!(murmur2(b"21") as i32, -973932308);
        assert_eq!(murmur2(b"foobar") as i32, -790332482);
        assert_eq!(murmur2(b"a-little-bit-long-string") as i32, -985981536);
        assert_eq!(murmur2(b"a-little-bit-longer-string") as i32, -1486304829);
        assert_eq!(
            murmur2(b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8") as i32,
            -58897971
        );
        assert_eq!(murmur2(b"abc") as i32, 479470107);
    }

    #[test]
    fn produce_errors_say_whether_a_resend_is_safe() {
        let m = |c| publish_error(&KafkaError::MessageProduction(c));
        assert!(matches!(
            m(RDKafkaErrorCode::MessageTimedOut),
            PublishError::Ambiguous(_)
        ));
        assert!(matches!(
            m(RDKafkaErrorCode::ProducerFenced),
            PublishError::Fenced(_)
        ));
        assert!(matches!(
            m(RDKafkaErrorCode::UnknownTopicOrPartition),
            PublishError::Unroutable(_)
        ));
        assert!(matches!(
            m(RDKafkaErrorCode::MessageSizeTooLarge),
            PublishError::Rejected(_)
        ));
        assert!(matches!(
            m(RDKafkaErrorCode::QueueFull),
            PublishError::Disconnected(_)
        ));
    }
}
