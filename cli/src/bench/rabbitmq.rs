//! RabbitMQ in the broker benchmark (lapin 2 on RabbitMQ 3.10).
//!
//! Every consumer has one connection and one channel to a fresh durable classic queue, the
//! same `basic.qos` prefetch ([`RabbitBench::prefetch`]: twice the batch) and manual acks, one
//! `basic.ack` per message:
//!
//! - **bare**: a lapin consumer that acks each delivery as it arrives;
//! - **hand-written**: the same consumer taking what has arrived (up to the batch size),
//!   writing the batch's effect rows with one `INSERT … ON CONFLICT DO NOTHING` (key from
//!   `message_id`), then acking each delivery of the batch;
//! - **idemq**: [`RabbitSource`] under the engine.
//!
//! And, RabbitMQ only ([`BrokerBench::extra`]): [`RabbitPublisher`] against lapin's own
//! confirmed publish of the same persistent, `mandatory` messages (message id and dedup
//! header set), both pipelined (a batch sent, then its confirms awaited) and one at a time.

use super::broker::{bench_key, bench_payload, BrokerBench, BrokerRun, EffectSink};
use futures::{FutureExt, StreamExt};
use idemq::rabbitmq::lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use idemq::rabbitmq::lapin::publisher_confirm::{Confirmation, PublisherConfirm};
use idemq::rabbitmq::lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use idemq::rabbitmq::lapin::{BasicProperties, Channel, Connection, Consumer};
use idemq::rabbitmq::{connect, RabbitPublisher, RabbitSource, RabbitSourceConfig};
use idemq::{async_trait, KeyStrategy, OutgoingMessage, Publisher, Source, DEDUP_HEADER};
use std::time::{Duration, Instant};

/// The longest one measured run may take before the run fails.
const RUN_LIMIT: Duration = Duration::from_secs(600);

/// Benchmark queues delete themselves when left unused this long (a failed run leaves
/// nothing behind for good).
const QUEUE_EXPIRES: Duration = Duration::from_secs(15 * 60);

/// Where the adapter's source would dead-letter (nothing is rejected in the benchmark).
const BENCH_DLQ: &str = "idemq-bench.dlq";

/// Messages sent before their confirms are awaited, when filling a queue.
const FILL_WINDOW: usize = 2000;

/// The RabbitMQ side of `idemq bench --brokers rabbitmq`.
pub struct RabbitBench {
    url: String,
    batch: usize,
    prefetch: u16,
}

impl RabbitBench {
    /// The broker at `IDEMQ_TEST_AMQP_URL` (what `scripts/servers.sh env` exports); the
    /// hand-written consumer's batches and the prefetch follow `batch`.
    pub fn from_env(batch: usize) -> anyhow::Result<Self> {
        let url = std::env::var("IDEMQ_TEST_AMQP_URL").map_err(|_| {
            anyhow::anyhow!("IDEMQ_TEST_AMQP_URL is not set (eval \"$(scripts/servers.sh env)\")")
        })?;
        let batch = batch.max(1);
        Ok(Self {
            url,
            batch,
            prefetch: u16::try_from(batch.saturating_mul(2)).unwrap_or(u16::MAX),
        })
    }

    async fn channel(&self, what: &str) -> anyhow::Result<(Connection, Channel)> {
        let conn = connect(&self.url, what).await?;
        let ch = conn.create_channel().await?;
        Ok((conn, ch))
    }

    /// A fresh durable queue that expires when unused.
    async fn fresh_queue(&self, ch: &Channel, what: &str) -> anyhow::Result<String> {
        let queue = format!("idemq-bench.{what}.{:08x}", rand::random::<u32>());
        let mut args = FieldTable::default();
        let expires = i64::try_from(QUEUE_EXPIRES.as_millis()).unwrap_or(i64::MAX);
        args.insert("x-expires".into(), AMQPValue::LongLongInt(expires));
        let opts = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        ch.queue_declare(&queue, opts, args).await?;
        Ok(queue)
    }

    async fn delete_queue(&self, queue: &str) -> anyhow::Result<()> {
        let (conn, ch) = self.channel("idemq-bench cleanup").await?;
        ch.queue_delete(queue, QueueDeleteOptions::default())
            .await?;
        let _ = conn.close(200, "done").await;
        Ok(())
    }

    /// A manual-ack consumer of `dest` with the benchmark's prefetch.
    async fn consumer(&self, dest: &str) -> anyhow::Result<(Connection, Channel, Consumer)> {
        let (conn, ch) = self.channel("idemq-bench consumer").await?;
        ch.basic_qos(self.prefetch, BasicQosOptions::default())
            .await?;
        let consumer = ch
            .basic_consume(
                dest,
                "",
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        Ok((conn, ch, consumer))
    }
}

/// What a team's confirmed publish sets: persistent, the key as `message_id` and in the
/// dedup header.
fn lapin_properties(key: &str) -> BasicProperties {
    let mut headers = FieldTable::default();
    headers.insert(
        ShortString::from(DEDUP_HEADER),
        AMQPValue::LongString(LongString::from(key)),
    );
    BasicProperties::default()
        .with_delivery_mode(2)
        .with_message_id(ShortString::from(key))
        .with_headers(headers)
}

fn mandatory() -> BasicPublishOptions {
    BasicPublishOptions {
        mandatory: true,
        ..BasicPublishOptions::default()
    }
}

/// Waits for the confirms of one pipelined window; any nack or return fails the run.
async fn confirmed(pending: Vec<PublisherConfirm>) -> anyhow::Result<()> {
    for confirm in pending {
        match confirm.await? {
            Confirmation::Ack(None) | Confirmation::NotRequested => {}
            Confirmation::Ack(Some(ret)) => {
                anyhow::bail!("returned: {} {}", ret.reply_code, ret.reply_text)
            }
            Confirmation::Nack(_) => anyhow::bail!("the broker nacked a publish"),
        }
    }
    Ok(())
}

/// lapin's own confirmed publish of messages `from..to` to `queue`, `window` at a time.
async fn lapin_publish(
    ch: &Channel,
    queue: &str,
    from: usize,
    to: usize,
    window: usize,
) -> anyhow::Result<()> {
    let mut pending = Vec::with_capacity(window);
    for i in from..to {
        let key = bench_key(i);
        let payload = bench_payload(i);
        pending.push(
            ch.basic_publish(
                "",
                queue,
                mandatory(),
                payload.as_bytes(),
                lapin_properties(&key),
            )
            .await?,
        );
        if pending.len() >= window {
            confirmed(std::mem::take(&mut pending)).await?;
        }
    }
    confirmed(pending).await
}

/// The adapter's publisher, `window` messages per `publish_batch` (or `publish` one by one
/// for a window of 1).
async fn idemq_publish(
    p: &RabbitPublisher,
    queue: &str,
    from: usize,
    to: usize,
    window: usize,
) -> anyhow::Result<()> {
    let msg = |i: usize| OutgoingMessage::new(queue, bench_payload(i)).with_dedup_key(bench_key(i));
    if window <= 1 {
        for i in from..to {
            p.publish(msg(i)).await?;
        }
        return Ok(());
    }
    let mut i = from;
    while i < to {
        let end = (i + window).min(to);
        for r in p.publish_batch((i..end).map(msg).collect()).await {
            r?;
        }
        i = end;
    }
    Ok(())
}

fn keep_best(slot: &mut Option<Duration>, t: Duration) {
    *slot = Some(slot.map_or(t, |s| s.min(t)));
}

#[async_trait]
impl BrokerBench for RabbitBench {
    fn name(&self) -> &'static str {
        "rabbitmq"
    }

    async fn fill(&self, n: usize) -> anyhow::Result<String> {
        let (conn, ch) = self.channel("idemq-bench fill").await?;
        ch.confirm_select(ConfirmSelectOptions::default()).await?;
        let queue = self.fresh_queue(&ch, "consume").await?;
        lapin_publish(&ch, &queue, 0, n, FILL_WINDOW).await?;
        let _ = conn.close(200, "filled").await;
        Ok(queue)
    }

    async fn bare(&self, dest: &str, n: usize) -> anyhow::Result<Duration> {
        let t = Instant::now();
        let (conn, _ch, mut consumer) = self.consumer(dest).await?;
        let mut got = 0;
        while got < n {
            let d = tokio::time::timeout(RUN_LIMIT, consumer.next())
                .await
                .map_err(|_| anyhow::anyhow!("bare consumer: stuck after {got} of {n}"))?
                .ok_or_else(|| anyhow::anyhow!("bare consumer: cancelled after {got}"))??;
            d.ack(Default::default()).await?;
            got += 1;
        }
        let elapsed = t.elapsed();
        let _ = conn.close(200, "done").await;
        self.delete_queue(dest).await?;
        Ok(elapsed)
    }

    async fn handwritten(
        &self,
        dest: &str,
        n: usize,
        sink: &EffectSink,
    ) -> anyhow::Result<Duration> {
        let t = Instant::now();
        let (conn, _ch, mut consumer) = self.consumer(dest).await?;
        let mut got = 0;
        while got < n {
            // Wait for one delivery, then take what has already arrived, up to a batch.
            let first = tokio::time::timeout(RUN_LIMIT, consumer.next())
                .await
                .map_err(|_| anyhow::anyhow!("hand-written consumer: stuck after {got} of {n}"))?
                .ok_or_else(|| anyhow::anyhow!("hand-written consumer: cancelled"))??;
            let mut batch = vec![first];
            while batch.len() < self.batch {
                match consumer.next().now_or_never() {
                    Some(Some(d)) => batch.push(d?),
                    _ => break,
                }
            }
            let rows: Vec<(String, String)> = batch
                .iter()
                .map(|d| {
                    let key = d.properties.message_id().as_ref().map(|k| k.to_string());
                    let payload = String::from_utf8_lossy(&d.data).into_owned();
                    (key.unwrap_or_default(), payload)
                })
                .collect();
            sink.insert_batch(&rows).await?;
            for d in &batch {
                d.ack(Default::default()).await?;
            }
            got += batch.len();
        }
        let elapsed = t.elapsed();
        let _ = conn.close(200, "done").await;
        self.delete_queue(dest).await?;
        Ok(elapsed)
    }

    /// A fresh key namespace per engine run: the PostgreSQL store is shared, and keys
    /// `m-<i>` completed by an earlier run would otherwise be acked as duplicates.
    fn keys(&self) -> anyhow::Result<KeyStrategy> {
        let group = format!("bench-rabbitmq-{:08x}", rand::random::<u32>());
        Ok(KeyStrategy::dedup_header(&group)?)
    }

    async fn source(&self, dest: &str) -> anyhow::Result<Box<dyn Source>> {
        let mut cfg = RabbitSourceConfig::new(&self.url, dest).prefetch(self.prefetch);
        cfg.dead_letter_queue = Some(BENCH_DLQ.into());
        Ok(Box::new(RabbitSource::connect(cfg).await?))
    }

    /// The adapter's confirmed publisher against lapin's own confirmed publish.
    async fn extra(&self, run: &BrokerRun) -> anyhow::Result<()> {
        let n = run.messages.max(1);
        // Confirmed one at a time, every publish waits for an fsync: fewer messages.
        let one_by_one = (n / 20).max(100);
        let window = run.batch.max(2);
        let (conn, ch) = self.channel("idemq-bench lapin publisher").await?;
        ch.confirm_select(ConfirmSelectOptions::default()).await?;
        let queue = self.fresh_queue(&ch, "publish").await?;
        let ours = RabbitPublisher::connect(&self.url).await?;
        let (mut lapin_batch, mut ours_batch) = (None, None);
        let (mut lapin_one, mut ours_one) = (None, None);
        for _ in 0..run.rounds.max(1) {
            let t = Instant::now();
            lapin_publish(&ch, &queue, 0, n, window).await?;
            keep_best(&mut lapin_batch, t.elapsed());
            let t = Instant::now();
            idemq_publish(&ours, &queue, 0, n, window).await?;
            keep_best(&mut ours_batch, t.elapsed());
            let t = Instant::now();
            lapin_publish(&ch, &queue, 0, one_by_one, 1).await?;
            keep_best(&mut lapin_one, t.elapsed());
            let t = Instant::now();
            idemq_publish(&ours, &queue, 0, one_by_one, 1).await?;
            keep_best(&mut ours_one, t.elapsed());
            // Keep the queue small between rounds.
            ch.queue_purge(&queue, Default::default()).await?;
        }
        let _ = conn.close(200, "done").await;
        ours.close().await?;
        self.delete_queue(&queue).await?;
        let rate =
            |m: usize, d: Option<Duration>| d.map_or(0.0, |d| m as f64 / d.as_secs_f64().max(1e-9));
        let ratio = |ours: Option<Duration>, base: Option<Duration>| match (ours, base) {
            (Some(o), Some(b)) => b.as_secs_f64() / o.as_secs_f64().max(1e-9),
            _ => 0.0,
        };
        println!(
            "rabbitmq publisher: best of {} interleaved rounds, persistent + mandatory + confirms",
            run.rounds.max(1)
        );
        println!(
            "  {:<42} {:>10.0} msgs/s  1.00x",
            format!("lapin confirmed publish, {window} in flight"),
            rate(n, lapin_batch)
        );
        println!(
            "  {:<42} {:>10.0} msgs/s  {:.2}x of lapin (target >= 0.90)",
            format!("RabbitPublisher::publish_batch({window})"),
            rate(n, ours_batch),
            ratio(ours_batch, lapin_batch)
        );
        println!(
            "  {:<42} {:>10.0} msgs/s  1.00x",
            format!("lapin confirmed publish, one at a time ({one_by_one})"),
            rate(one_by_one, lapin_one)
        );
        println!(
            "  {:<42} {:>10.0} msgs/s  {:.2}x of lapin (target >= 0.90)",
            "RabbitPublisher::publish, one at a time",
            rate(one_by_one, ours_one),
            ratio(ours_one, lapin_one)
        );
        Ok(())
    }
}
