//! Kafka → Kafka exactly once: consume-transform-produce in one Kafka transaction per batch.
//!
//! [`TransactionalProcessor`] reads `read_committed` input in a consumer group, produces each
//! batch's outputs with a transactional producer, and adds the consumed offsets to the same
//! transaction (`send_offsets_to_transaction` with the consumer's group metadata, KIP-447).
//! Either the outputs and the offsets commit together, or neither does:
//!
//! - a failed transform or an abortable producer error aborts the transaction and rewinds
//!   the consumer to the last committed offsets, so the batch is consumed again and its
//!   aborted outputs stay invisible to `read_committed` readers;
//! - a fenced producer (another instance took the `transactional.id`) or a fatal error stops
//!   this processor with [`TxnError::Fenced`] / [`TxnError::Fatal`] naming the cause.
//!
//! Business duplicates (the same dedup key at a new input offset) are *not* dropped here;
//! put a dedup store in the transform, or see the project's docs for the state-in-Kafka plan.

use crate::config::KafkaProducerConfig;
use crate::envelope::to_envelope;
use crate::publisher::publish_error;
use idemq_core::publish::{OutgoingMessage, PublishError};
use idemq_core::Envelope;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// Why a transactional batch did not commit.
#[derive(Debug, thiserror::Error)]
pub enum TxnError {
    /// The batch was aborted and the input rewound; calling again retries it.
    #[error("transaction aborted and input rewound: {0}")]
    Aborted(String),
    /// Another producer instance owns this `transactional.id`: stop this one.
    #[error("producer fenced (another instance owns the transactional.id): {0}")]
    Fenced(String),
    /// The producer or consumer cannot continue: stop and recreate it.
    #[error("fatal Kafka error: {0}")]
    Fatal(String),
    /// The settings are unusable.
    #[error("transactional processor misconfigured: {0}")]
    Config(String),
}

/// Consume-transform-produce with one Kafka transaction per batch.
pub struct TransactionalProcessor {
    consumer: Arc<BaseConsumer>,
    producer: FutureProducer,
    timeout: Duration,
}

impl std::fmt::Debug for TransactionalProcessor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransactionalProcessor")
            .finish_non_exhaustive()
    }
}

fn blocking_err(e: tokio::task::JoinError) -> TxnError {
    TxnError::Fatal(format!("blocking Kafka call panicked: {e}"))
}

impl TransactionalProcessor {
    /// A processor reading `input` in `group` (read_committed) and producing with `producer`
    /// (built by [`KafkaProducerConfig::transactional`]); initialises the transactions,
    /// which fences any older instance with the same `transactional.id`.
    pub async fn new(
        producer: &KafkaProducerConfig,
        group: &str,
        input: &[&str],
    ) -> Result<Self, TxnError> {
        let pcfg = producer
            .client_config()
            .map_err(|e| TxnError::Config(e.to_string()))?;
        if producer.get("transactional.id").is_none() {
            return Err(TxnError::Config(
                "the producer config has no transactional.id: build it with KafkaProducerConfig::transactional".into(),
            ));
        }
        let bootstrap = producer.get("bootstrap.servers").unwrap_or_default();
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", bootstrap)
            .set("group.id", group)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("isolation.level", "read_committed")
            .set("auto.offset.reset", "earliest")
            .create()
            .map_err(|e| TxnError::Config(e.to_string()))?;
        consumer
            .subscribe(input)
            .map_err(|e| TxnError::Config(e.to_string()))?;
        let producer: FutureProducer =
            pcfg.create().map_err(|e| TxnError::Config(e.to_string()))?;
        let p = producer.clone();
        tokio::task::spawn_blocking(move || p.init_transactions(Duration::from_secs(30)))
            .await
            .map_err(blocking_err)?
            .map_err(|e| classify(&e))?;
        Ok(Self {
            consumer: Arc::new(consumer),
            producer,
            timeout: Duration::from_secs(30),
        })
    }

    /// Polls up to `max` records (waiting at most `wait` for the first), runs `transform`
    /// on each, and commits the outputs together with the consumed offsets. Returns how
    /// many input records were committed (0 when none arrived).
    pub async fn process_batch<F>(
        &mut self,
        max: usize,
        wait: Duration,
        mut transform: F,
    ) -> Result<usize, TxnError>
    where
        F: FnMut(&Envelope) -> Result<Vec<OutgoingMessage>, String>,
    {
        let inputs = self.poll(max, wait).await?;
        if inputs.is_empty() {
            return Ok(0);
        }
        self.producer
            .begin_transaction()
            .map_err(|e| classify(&e))?;
        match self.produce_all(&inputs, &mut transform).await {
            Ok(()) => {}
            Err(why) => return Err(self.abort(why).await),
        }
        if let Err(e) = self.commit(&inputs).await {
            return Err(match e {
                TxnError::Aborted(why) => self.abort(why).await,
                other => other,
            });
        }
        Ok(inputs.len())
    }

    async fn poll(&self, max: usize, wait: Duration) -> Result<Vec<Envelope>, TxnError> {
        let c = self.consumer.clone();
        tokio::task::spawn_blocking(move || {
            let mut out = Vec::new();
            let deadline = std::time::Instant::now() + wait;
            while out.len() < max {
                let left = deadline.saturating_duration_since(std::time::Instant::now());
                let timeout = if out.is_empty() { left } else { Duration::ZERO };
                match c.poll(timeout) {
                    Some(Ok(m)) => out.push(to_envelope(&m, None)),
                    Some(Err(KafkaError::MessageConsumptionFatal(code))) => {
                        return Err(TxnError::Fatal(format!("consumer: {code}")))
                    }
                    Some(Err(e)) => tracing::warn!(error = %e, "transactional consumer error"),
                    None => break,
                }
            }
            Ok(out)
        })
        .await
        .map_err(blocking_err)?
    }

    async fn produce_all<F>(&self, inputs: &[Envelope], transform: &mut F) -> Result<(), String>
    where
        F: FnMut(&Envelope) -> Result<Vec<OutgoingMessage>, String>,
    {
        // Outputs are sent as each input is transformed, so a later failure leaves earlier
        // outputs in the open transaction: the abort is what keeps them invisible.
        let mut sent = Vec::new();
        let mut failed = None;
        for env in inputs {
            match transform(env) {
                Ok(outs) => sent.extend(outs.iter().map(|m| self.send(m))),
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        let mut produce_error = None;
        for r in futures::future::join_all(sent).await {
            if let Err(e) = r {
                produce_error
                    .get_or_insert_with(|| format!("produce failed: {}", publish_error(&e)));
            }
        }
        match failed.or(produce_error) {
            Some(why) => Err(why),
            None => Ok(()),
        }
    }

    fn send(
        &self,
        m: &OutgoingMessage,
    ) -> impl std::future::Future<Output = Result<(), KafkaError>> {
        let mut kh = OwnedHeaders::new();
        for (n, v) in m.wire_headers().iter() {
            kh = kh.insert(Header {
                key: n,
                value: Some(v.as_ref()),
            });
        }
        let mut rec: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(&m.destination)
            .payload(&m.payload[..])
            .headers(kh);
        if let Some(k) = &m.key {
            rec = rec.key(&k[..]);
        }
        let fut = self.producer.send_result(rec).map_err(|(e, _)| e);
        async move {
            match fut?.await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err((e, _))) => Err(e),
                Err(_) => Err(KafkaError::Canceled),
            }
        }
    }

    async fn commit(&self, inputs: &[Envelope]) -> Result<(), TxnError> {
        let mut next: HashMap<(String, i32), i64> = HashMap::new();
        for env in inputs {
            if let (Some(p), Some(idemq_core::envelope::Position::Offset(o))) =
                (env.source.partition, env.source.position)
            {
                let e = next.entry((env.source.name.clone(), p)).or_insert(o + 1);
                *e = (*e).max(o + 1);
            }
        }
        let mut tpl = TopicPartitionList::new();
        for ((t, p), o) in &next {
            tpl.add_partition_offset(t, *p, Offset::Offset(*o))
                .map_err(|e| TxnError::Fatal(e.to_string()))?;
        }
        let meta = self
            .consumer
            .group_metadata()
            .ok_or_else(|| TxnError::Fatal("consumer has no group metadata".into()))?;
        let p = self.producer.clone();
        let timeout = self.timeout;
        tokio::task::spawn_blocking(move || {
            p.send_offsets_to_transaction(&tpl, &meta, timeout)?;
            p.commit_transaction(timeout)
        })
        .await
        .map_err(blocking_err)?
        .map_err(|e| classify(&e))
    }

    /// Aborts the open transaction and rewinds the input to the committed offsets.
    async fn abort(&self, why: String) -> TxnError {
        tracing::warn!(reason = %why, "aborting Kafka transaction and rewinding input");
        let p = self.producer.clone();
        let c = self.consumer.clone();
        let timeout = self.timeout;
        let done = tokio::task::spawn_blocking(move || -> Result<(), KafkaError> {
            p.abort_transaction(timeout)?;
            let assigned = c.assignment()?;
            let committed = c.committed_offsets(assigned, timeout)?;
            let mut seek = TopicPartitionList::new();
            for el in committed.elements() {
                let to = match el.offset() {
                    Offset::Offset(o) => Offset::Offset(o),
                    _ => Offset::Beginning,
                };
                seek.add_partition_offset(el.topic(), el.partition(), to)?;
            }
            for r in c.seek_partitions(seek, timeout)?.elements() {
                r.error()?;
            }
            Ok(())
        })
        .await;
        match done {
            Ok(Ok(())) => TxnError::Aborted(why),
            Ok(Err(e)) => match classify(&e) {
                TxnError::Aborted(_) => {
                    TxnError::Fatal(format!("{why}; then abort/rewind failed: {e}"))
                }
                other => other,
            },
            Err(e) => blocking_err(e),
        }
    }
}

/// Sorts a transactional error into abort-and-retry, fenced, or fatal, with librdkafka's
/// own reason (not its bare "Fatal error").
fn classify(e: &KafkaError) -> TxnError {
    match e {
        KafkaError::Transaction(t) => {
            let text = format!("{} ({})", t.string(), t.code());
            if matches!(
                t.code(),
                rdkafka::types::RDKafkaErrorCode::Fenced
                    | rdkafka::types::RDKafkaErrorCode::ProducerFenced
                    | rdkafka::types::RDKafkaErrorCode::InvalidProducerEpoch
            ) {
                TxnError::Fenced(text)
            } else if t.is_fatal() {
                TxnError::Fatal(text)
            } else {
                TxnError::Aborted(text)
            }
        }
        other => match publish_error(other) {
            PublishError::Fenced(s) => TxnError::Fenced(s),
            PublishError::Config(s) => TxnError::Config(s),
            p => TxnError::Aborted(p.to_string()),
        },
    }
}
