//! What the adapter declares: the consumed queue (classic or quorum), the dead-letter queue,
//! one TTL retry queue per delay tier, and the deduplication plugin's exchange and queue
//! arguments when that plugin is present.

use crate::fields::put_str;
use crate::{connect, RabbitError};
use lapin::options::{
    ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, ExchangeKind};
use std::time::Duration;

/// How the consumed queue is declared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueType {
    /// A durable classic queue: `redelivered` only, no delivery count.
    Classic,
    /// A durable quorum queue (`x-queue-type: quorum`): replicated, counts deliveries in
    /// `x-delivery-count`.
    Quorum,
}

/// The default delay tiers of the TTL retry queues: a nack's delay is rounded *up* to the
/// next tier (so a message never comes back early); delays past the last tier get a tier of
/// their own, rounded up to a whole second.
pub const DEFAULT_RETRY_TIERS_MS: &[u64] = &[
    100, 250, 500, 1_000, 2_000, 5_000, 10_000, 30_000, 60_000, 300_000, 900_000, 3_600_000,
];

/// The tier (milliseconds) that holds a nack of `delay`.
pub fn retry_tier(tiers: &[u64], delay: Duration) -> u64 {
    let ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX).max(1);
    tiers
        .iter()
        .copied()
        .find(|t| *t >= ms)
        .unwrap_or_else(|| ms.div_ceil(1000).saturating_mul(1000))
}

/// The retry queue of `queue` for a tier: `<queue>.retry.<ms>`.
pub fn retry_queue_name(queue: &str, tier_ms: u64) -> String {
    format!("{queue}.retry.{tier_ms}")
}

fn durable() -> QueueDeclareOptions {
    QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    }
}

/// Declares the consumed queue (`Some(kind)`), or checks that it exists (`None`, passive).
pub(crate) async fn declare_queue(
    ch: &Channel,
    queue: &str,
    kind: Option<QueueType>,
) -> Result<(), lapin::Error> {
    let mut args = FieldTable::default();
    let opts = match kind {
        None => QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        },
        Some(QueueType::Classic) => durable(),
        Some(QueueType::Quorum) => {
            put_str(&mut args, "x-queue-type", "quorum");
            durable()
        }
    };
    ch.queue_declare(queue, opts, args).await.map(|_| ())
}

/// Declares a durable classic queue with no arguments (the dead-letter queue).
pub(crate) async fn declare_plain(ch: &Channel, queue: &str) -> Result<(), lapin::Error> {
    ch.queue_declare(queue, durable(), FieldTable::default())
        .await
        .map(|_| ())
}

/// The `x-expires` of a tier's retry queue when it may sit unused for `idle`: the tier's
/// TTL plus `idle`, so that a message parked right after a declaration is dead-lettered
/// back long before the queue can expire.
pub fn retry_queue_expires_ms(tier_ms: u64, idle: Duration) -> u64 {
    let idle_ms = u64::try_from(idle.as_millis()).unwrap_or(u64::MAX);
    tier_ms.saturating_add(idle_ms)
}

/// The exchange retry tiers dead-letter through: durable, direct, each consumed queue bound
/// to it under its own name. Not the default exchange: after a broker restart, a quorum
/// queue's at-least-once dead-lettering does not find the default exchange and keeps the
/// expired messages forever (counted, never ready; rabbitmq-server#12625, seen here on 3.10).
/// A named exchange is found again when the broker's dead-letter worker retries, after
/// `dead_letter_worker_publisher_confirm_timeout` (3 min by default): messages parked across
/// a restart come back, that much later.
pub const RETRY_EXCHANGE: &str = "idemq.retry";

/// Declares the retry queue of one tier: messages wait `tier_ms` (`x-message-ttl`, the same
/// for every message of the queue, so they expire in arrival order), then the broker
/// dead-letters them through [`RETRY_EXCHANGE`] back to `queue` (declared and bound here).
/// Nobody consumes it.
///
/// A tier is a quorum queue with **at-least-once dead-lettering**
/// (`x-dead-letter-strategy=at-least-once`, which needs `x-overflow=reject-publish`): the
/// message stays in the tier until `queue` has confirmed it. RabbitMQ's default
/// dead-lettering is at-most-once, and a classic tier dropped what expired while `queue` was
/// unavailable — e.g. a quorum queue still electing its leader after a broker restart,
/// when a tier expires everything that waited through the restart at once. The consumed
/// message is acked only after the tier confirmed the copy, so with this a nacked message
/// is never lost between the two queues (quorum queues take `x-message-ttl` from RabbitMQ
/// 3.10 on: older brokers refuse the tier). Tiers declared as classic queues by an older
/// version must be deleted once, when empty (RabbitMQ refuses a redeclaration with other
/// arguments).
///
/// With `idle`, the queue also gets `x-expires` ([`retry_queue_expires_ms`]): RabbitMQ
/// deletes it once nobody has declared it for that long, so the retry queues of a queue
/// that is no longer consumed (or of a tier no longer used) do not stay forever. The broker
/// deletes an expired queue *with* its messages; the source therefore declares a tier again
/// before parking a message in it once `idle / 2` has passed since its last declaration
/// (see `RabbitSourceConfig::retry_queue_idle_expiry`).
pub(crate) async fn declare_retry_tier(
    ch: &Channel,
    queue: &str,
    tier_ms: u64,
    idle: Option<Duration>,
) -> Result<(), lapin::Error> {
    let durable_exchange = ExchangeDeclareOptions {
        durable: true,
        ..ExchangeDeclareOptions::default()
    };
    ch.exchange_declare(
        RETRY_EXCHANGE,
        ExchangeKind::Direct,
        durable_exchange,
        FieldTable::default(),
    )
    .await?;
    ch.queue_bind(
        queue,
        RETRY_EXCHANGE,
        queue,
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    let mut args = FieldTable::default();
    args.insert(
        "x-message-ttl".into(),
        AMQPValue::LongLongInt(i64::try_from(tier_ms).unwrap_or(i64::MAX)),
    );
    if let Some(idle) = idle {
        let ms = retry_queue_expires_ms(tier_ms, idle);
        args.insert(
            "x-expires".into(),
            AMQPValue::LongLongInt(i64::try_from(ms).unwrap_or(i64::MAX)),
        );
    }
    put_str(&mut args, "x-dead-letter-exchange", RETRY_EXCHANGE);
    put_str(&mut args, "x-dead-letter-routing-key", queue);
    put_str(&mut args, "x-queue-type", "quorum");
    put_str(&mut args, "x-dead-letter-strategy", "at-least-once");
    put_str(&mut args, "x-overflow", "reject-publish");
    ch.queue_declare(&retry_queue_name(queue, tier_ms), durable(), args)
        .await
        .map(|_| ())
}

/// The exchange type of the community rabbitmq-message-deduplication plugin.
pub const DEDUP_EXCHANGE_TYPE: &str = "x-message-deduplication";
/// The plugin's name, for error messages.
pub const DEDUP_PLUGIN: &str = "rabbitmq_message_deduplication";

/// Whether the broker has the deduplication plugin (see [`detect_dedup_plugin`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DedupPlugin {
    /// The `x-message-deduplication` exchange type exists.
    Available,
    /// It does not; the broker's answer.
    Unavailable(String),
}

impl DedupPlugin {
    /// True when the plugin is there.
    pub fn is_available(&self) -> bool {
        matches!(self, DedupPlugin::Available)
    }
}

/// Settings of a deduplicating exchange (the plugin's arguments).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DedupExchange {
    /// Exchange name.
    pub name: String,
    /// `x-cache-size`: how many keys the plugin remembers (its cache is bounded: older keys
    /// are forgotten, which is one reason consumer-side dedup stays on).
    pub cache_size: u32,
    /// `x-cache-ttl`: how long a key is remembered.
    pub cache_ttl: Option<Duration>,
    /// `x-cache-persistence`: `"memory"` or `"disk"`.
    pub persistence: Option<String>,
}

impl DedupExchange {
    /// A deduplicating exchange remembering `cache_size` keys.
    pub fn new(name: impl Into<String>, cache_size: u32) -> Self {
        Self {
            name: name.into(),
            cache_size,
            cache_ttl: None,
            persistence: None,
        }
    }

    fn arguments(&self) -> FieldTable {
        let mut args = FieldTable::default();
        args.insert("x-cache-size".into(), AMQPValue::LongUInt(self.cache_size));
        if let Some(ttl) = self.cache_ttl {
            let ms = u32::try_from(ttl.as_millis()).unwrap_or(u32::MAX);
            args.insert("x-cache-ttl".into(), AMQPValue::LongUInt(ms));
        }
        if let Some(p) = &self.persistence {
            put_str(&mut args, "x-cache-persistence", p);
        }
        args
    }
}

/// Tries the plugin's exchange type on a throwaway connection (an unknown exchange type is a
/// *connection* error in RabbitMQ, so it must not be tried on a connection that matters).
/// The probe exchange is auto-deleted right away.
pub async fn detect_dedup_plugin(url: &str) -> Result<DedupPlugin, RabbitError> {
    let probe = DedupExchange::new(format!("idemq.dedup-probe.{}", std::process::id()), 1);
    match declare_on_fresh_connection(url, &probe, true).await? {
        Ok(()) => Ok(DedupPlugin::Available),
        Err(why) => Ok(DedupPlugin::Unavailable(why)),
    }
}

/// Declares a deduplicating exchange; without the plugin, [`RabbitError::DedupPluginMissing`]
/// names it.
pub async fn declare_dedup_exchange(
    url: &str,
    exchange: &DedupExchange,
) -> Result<(), RabbitError> {
    declare_on_fresh_connection(url, exchange, false)
        .await?
        .map_err(|broker| RabbitError::DedupPluginMissing {
            what: format!("exchange `{}`", exchange.name),
            broker,
        })
}

/// Declares a durable queue with `x-message-deduplication: true` after checking that the
/// plugin is there (without it the broker would silently ignore the argument).
pub async fn declare_dedup_queue(url: &str, queue: &str) -> Result<(), RabbitError> {
    if let DedupPlugin::Unavailable(broker) = detect_dedup_plugin(url).await? {
        return Err(RabbitError::DedupPluginMissing {
            what: format!("queue `{queue}`"),
            broker,
        });
    }
    let conn = connect(url, "idemq-dedup-queue").await?;
    let ch = conn.create_channel().await?;
    let mut args = FieldTable::default();
    args.insert("x-message-deduplication".into(), AMQPValue::Boolean(true));
    let res = ch.queue_declare(queue, durable(), args).await;
    let _ = conn.close(200, "done").await;
    res.map(|_| ()).map_err(RabbitError::from)
}

/// `Ok(Err(why))` when the broker refused the exchange type; `Err` when it could not be asked.
async fn declare_on_fresh_connection(
    url: &str,
    exchange: &DedupExchange,
    delete_after: bool,
) -> Result<Result<(), String>, RabbitError> {
    let conn = connect(url, "idemq-dedup-probe").await?;
    let ch = conn.create_channel().await?;
    let opts = ExchangeDeclareOptions {
        durable: !delete_after,
        auto_delete: delete_after,
        ..ExchangeDeclareOptions::default()
    };
    let kind = ExchangeKind::Custom(DEDUP_EXCHANGE_TYPE.to_string());
    let outcome = match ch
        .exchange_declare(&exchange.name, kind, opts, exchange.arguments())
        .await
    {
        Ok(()) => {
            if delete_after {
                let _ = ch
                    .exchange_delete(&exchange.name, ExchangeDeleteOptions::default())
                    .await;
            }
            Ok(())
        }
        Err(e) => Err(e.to_string()),
    };
    if conn.status().connected() {
        let _ = conn.close(200, "done").await;
    }
    Ok(outcome)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_round_up_to_a_tier_never_down() {
        let t = DEFAULT_RETRY_TIERS_MS;
        assert_eq!(retry_tier(t, Duration::from_millis(500)), 500);
        assert_eq!(retry_tier(t, Duration::from_millis(501)), 1_000);
        assert_eq!(retry_tier(t, Duration::ZERO), 100);
        assert_eq!(retry_tier(t, Duration::from_millis(7_200_001)), 7_201_000);
        assert_eq!(retry_queue_name("orders", 500), "orders.retry.500");
    }
}
