//! The source conformance kit: every broker adapter must pass it against its real broker
//! (feature `testkit`), as every store passes the store kit, and as every Watermill Pub/Sub
//! passes Watermill's suite.
//!
//! An adapter's test implements [`SourceHarness`] (a fresh destination per scenario) and
//! expands [`source_contract_tests!`](crate::source_contract_tests), one `#[tokio::test]` per
//! scenario:
//!
//! ```ignore
//! struct Kafka { brokers: String }
//! #[async_trait::async_trait]
//! impl idemq_core::testkit::source::SourceHarness for Kafka { /* ... */ }
//!
//! idemq_core::source_contract_tests!(async {
//!     let brokers = idemq_core::testkit::servers::server_url("IDEMQ_TEST_KAFKA_BROKERS")?;
//!     Some(std::sync::Arc::new(Kafka { brokers }) as std::sync::Arc<dyn idemq_core::testkit::source::SourceHarness>)
//! });
//! ```
//!
//! The harness factory returns `None` to skip (no server configured): take the address from
//! [`server_url`](crate::testkit::servers::server_url), which prints the skip note, records a
//! skip by design and panics under `IDEMQ_REQUIRE_SERVERS=1` (the servers' env sets it). A
//! factory that returns `None` another way fails under `IDEMQ_REQUIRE_SERVERS=1` too.

use crate::engine::{ConsumerConfig, DeliveryOrder, IdempotentConsumer, RetryPolicy};
use crate::envelope::Envelope;
use crate::handler::{ClaimedMessage, HandlerError};
use crate::key::KeyStrategy;
use crate::memory::MemoryStore;
use crate::publish::{OutgoingMessage, Publisher};
use crate::source::{Delivery, Source};
use async_trait::async_trait;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

/// What the kit needs from an adapter under test.
#[async_trait]
pub trait SourceHarness: Send + Sync {
    /// A fresh, empty destination (topic / queue) for one scenario, with its own consumer
    /// group, so scenarios run in parallel against one server. `scenario` is a short
    /// identifier usable in names. Panics with the reason when the broker refuses.
    async fn fixture(&self, scenario: &str) -> Box<dyn SourceFixture>;
}

/// One destination and one consumer group on the broker under test.
#[async_trait]
pub trait SourceFixture: Send + Sync {
    /// A publisher that reaches the destination (durable confirms).
    fn publisher(&self) -> Arc<dyn Publisher>;
    /// The destination to put in [`OutgoingMessage::destination`].
    fn destination(&self) -> String;
    /// A new consumer of the destination in the fixture's consumer group. Sources of one
    /// fixture share the group: a second subscription after the first was closed or dropped
    /// sees what the first left unsettled.
    async fn subscribe(&self) -> Box<dyn Source>;
    /// A consumer that keeps the order of each partition / queue across nacks (the kit's
    /// ordered scenario runs the engine with [`DeliveryOrder::PerPartition`] on it). The
    /// default is [`SourceFixture::subscribe`], for brokers that always keep it.
    async fn subscribe_ordered(&self) -> Box<dyn Source> {
        self.subscribe().await
    }
    /// Messages dead-lettered so far from this destination, with the reason given to
    /// `reject` (read from the broker's dead-letter queue / topic).
    async fn dead_letters(&self) -> Vec<(Envelope, String)>;
    /// A nack delay this broker honours (RocketMQ rounds up to its levels).
    fn nack_delay(&self) -> Duration {
        Duration::from_millis(500)
    }
    /// How long to wait for a message that should arrive (group joins take seconds).
    fn patience(&self) -> Duration {
        Duration::from_secs(30)
    }
    /// How long to watch for a message that must *not* arrive.
    fn quiet(&self) -> Duration {
        Duration::from_secs(2)
    }
}

/// The dedup key the kit wrote on a delivery.
fn kit_key(d: &Delivery) -> String {
    d.envelope
        .headers
        .get_str(crate::publish::DEDUP_HEADER)
        .unwrap_or("<none>")
        .to_string()
}

fn scenario_prefix(scenario: &str) -> String {
    format!("{scenario}-{:08x}", rand::random::<u32>())
}

async fn publish_keys(f: &dyn SourceFixture, keys: &[String]) {
    let p = f.publisher();
    for k in keys {
        let m = OutgoingMessage::new(f.destination(), format!("{{\"id\":\"{k}\"}}"))
            .with_key("kit-entity")
            .with_dedup_key(k.clone());
        p.publish(m)
            .await
            .unwrap_or_else(|e| panic!("publish {k} to {}: {e}", f.destination()));
    }
}

/// Polls until `n` deliveries arrived or `within` passed (each poll cancelled at the
/// deadline, which the contract says loses nothing).
async fn collect(src: &mut dyn Source, n: usize, within: Duration) -> Vec<Delivery> {
    let deadline = Instant::now() + within;
    let mut got = Vec::new();
    while got.len() < n {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        match tokio::time::timeout(left, src.poll(n - got.len())).await {
            Ok(Ok(Some(batch))) => got.extend(batch),
            Ok(Ok(None)) => break,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "kit: poll failed; retrying");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(_) => break,
        }
    }
    got
}

async fn ack_all(src: &mut dyn Source, ds: Vec<Delivery>) {
    for d in ds {
        d.ack().await.expect("ack");
    }
    src.after_batch().await.expect("after_batch");
}

/// An acked message is not delivered again, even to a new subscription.
pub async fn acked_message_is_not_redelivered_after_restart(h: &dyn SourceHarness) {
    let f = h.fixture("acked").await;
    let p = scenario_prefix("acked");
    let keys: Vec<String> = (0..3).map(|i| format!("{p}-{i}")).collect();
    publish_keys(&*f, &keys).await;
    let mut src = f.subscribe().await;
    let got = collect(&mut *src, 3, f.patience()).await;
    assert_eq!(got.len(), 3, "all three published messages must arrive");
    ack_all(&mut *src, got).await;
    src.close().await.expect("close");
    drop(src);
    let mut again = f.subscribe().await;
    let late = collect(&mut *again, 1, f.quiet()).await;
    let late: Vec<String> = late.iter().map(kit_key).collect();
    assert!(
        late.is_empty(),
        "acked messages came back after a restart: {late:?}"
    );
    again.close().await.expect("close");
}

/// A nacked message comes back, and not before its delay.
pub async fn nacked_message_comes_back_after_its_delay(h: &dyn SourceHarness) {
    let f = h.fixture("nacked").await;
    let k = format!("{}-x", scenario_prefix("nacked"));
    publish_keys(&*f, std::slice::from_ref(&k)).await;
    let mut src = f.subscribe().await;
    let first = collect(&mut *src, 1, f.patience()).await;
    assert_eq!(first.len(), 1, "the published message must arrive");
    let delay = f.nack_delay();
    let nacked_at = Instant::now();
    for d in first {
        d.nack(delay).await.expect("nack");
    }
    src.after_batch().await.expect("after_batch");
    let back = collect(&mut *src, 1, f.patience() + delay).await;
    let waited = nacked_at.elapsed();
    assert_eq!(
        back.iter().map(kit_key).collect::<Vec<_>>(),
        vec![k],
        "the nacked message must come back"
    );
    // A little slack for clock granularity, none for an early redelivery.
    assert!(
        waited + Duration::from_millis(20) >= delay,
        "nacked with delay {delay:?} but redelivered after {waited:?}"
    );
    ack_all(&mut *src, back).await;
    src.close().await.expect("close");
}

/// A rejected message reaches the dead-letter with its reason, and is not redelivered.
pub async fn rejected_message_reaches_the_dead_letter_with_its_reason(h: &dyn SourceHarness) {
    let f = h.fixture("rejected").await;
    let k = format!("{}-poison", scenario_prefix("rejected"));
    publish_keys(&*f, std::slice::from_ref(&k)).await;
    let mut src = f.subscribe().await;
    let got = collect(&mut *src, 1, f.patience()).await;
    assert_eq!(got.len(), 1, "the published message must arrive");
    let reason = format!("kit: {k} cannot be processed");
    for d in got {
        d.reject(&reason).await.expect("reject");
    }
    src.after_batch().await.expect("after_batch");
    let deadline = Instant::now() + f.patience();
    let dead = loop {
        let dead = f.dead_letters().await;
        if dead
            .iter()
            .any(|(e, _)| e.headers.get_str(crate::publish::DEDUP_HEADER) == Some(k.as_str()))
            || Instant::now() > deadline
        {
            break dead;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let (_, why) = dead
        .iter()
        .find(|(e, _)| e.headers.get_str(crate::publish::DEDUP_HEADER) == Some(k.as_str()))
        .unwrap_or_else(|| panic!("{k} not in the dead letters: {dead:?}"));
    assert!(
        why.contains(&reason),
        "dead-letter reason {why:?} must carry {reason:?}"
    );
    let again = collect(&mut *src, 1, f.quiet()).await;
    assert!(again.is_empty(), "a rejected message was redelivered");
    src.close().await.expect("close");
}

/// A delivery dropped unsettled comes back on the same subscription; one left unsettled by
/// a dropped subscription comes back on the next.
pub async fn dropped_deliveries_and_sources_are_redelivered(h: &dyn SourceHarness) {
    let f = h.fixture("dropped").await;
    let p = scenario_prefix("dropped");
    let (a, b) = (format!("{p}-a"), format!("{p}-b"));
    publish_keys(&*f, std::slice::from_ref(&a)).await;
    let mut src = f.subscribe().await;
    let got = collect(&mut *src, 1, f.patience()).await;
    assert_eq!(got.len(), 1, "the published message must arrive");
    drop(got);
    let back = collect(&mut *src, 1, f.patience()).await;
    assert_eq!(
        back.iter().map(kit_key).collect::<Vec<_>>(),
        vec![a.clone()],
        "a dropped delivery must be redelivered"
    );
    ack_all(&mut *src, back).await;

    publish_keys(&*f, std::slice::from_ref(&b)).await;
    let held = collect(&mut *src, 1, f.patience()).await;
    assert_eq!(
        held.iter().map(kit_key).collect::<Vec<_>>(),
        vec![b.clone()]
    );
    drop(src); // a crash: no close, nothing settled
    drop(held);
    let mut next = f.subscribe().await;
    let back = collect(&mut *next, 1, f.patience()).await;
    assert_eq!(
        back.iter().map(kit_key).collect::<Vec<_>>(),
        vec![b],
        "a dropped source's unsettled message must be redelivered"
    );
    ack_all(&mut *next, back).await;
    next.close().await.expect("close");
}

/// Polls cancelled at any point lose nothing.
pub async fn cancelled_polls_lose_nothing(h: &dyn SourceHarness) {
    let f = h.fixture("cancelled").await;
    let p = scenario_prefix("cancelled");
    let keys: Vec<String> = (0..20).map(|i| format!("{p}-{i}")).collect();
    let mut src = f.subscribe().await;
    let publisher = {
        let keys = keys.clone();
        let pubr = f.publisher();
        let dest = f.destination();
        tokio::spawn(async move {
            for k in keys {
                let m = OutgoingMessage::new(dest.clone(), "{}")
                    .with_key("kit-entity")
                    .with_dedup_key(k);
                pubr.publish(m).await.expect("publish");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    let mut seen = HashSet::new();
    let deadline = Instant::now() + f.patience();
    let mut round = 0u64;
    while seen.len() < keys.len() && Instant::now() < deadline {
        round += 1;
        // Every other poll is cut off almost at once, mid-wait.
        let limit = if round.is_multiple_of(2) {
            Duration::from_micros(200)
        } else {
            Duration::from_millis(300)
        };
        match tokio::time::timeout(limit, src.poll(7)).await {
            Ok(Ok(Some(batch))) => {
                for d in batch {
                    seen.insert(kit_key(&d));
                    d.ack().await.expect("ack");
                }
                src.after_batch().await.expect("after_batch");
            }
            // Nothing published yet (a source that ends when empty says so at once).
            Ok(Ok(None)) => tokio::time::sleep(Duration::from_millis(10)).await,
            _ => {}
        }
    }
    publisher.await.expect("publisher task");
    let missing: Vec<&String> = keys.iter().filter(|k| !seen.contains(*k)).collect();
    assert!(
        missing.is_empty(),
        "cancelled polls lost messages: {missing:?}"
    );
    src.close().await.expect("close");
}

/// Out-of-order acks commit only the contiguous prefix: after a crash, the unsettled
/// message comes back and the settled one before it does not.
pub async fn out_of_order_acks_commit_only_the_contiguous_prefix(h: &dyn SourceHarness) {
    let f = h.fixture("prefix").await;
    let p = scenario_prefix("prefix");
    let keys: Vec<String> = (0..3).map(|i| format!("{p}-{i}")).collect();
    publish_keys(&*f, &keys).await;
    let mut src = f.subscribe().await;
    let mut got = collect(&mut *src, 3, f.patience()).await;
    assert_eq!(got.len(), 3, "all three published messages must arrive");
    got.sort_by_key(kit_key);
    let mut it = got.into_iter();
    let (m0, m1, m2) = match (it.next(), it.next(), it.next()) {
        (Some(a), Some(b), Some(c)) => (a, b, c),
        _ => unreachable!("three deliveries collected"),
    };
    m2.ack().await.expect("ack m2");
    m0.ack().await.expect("ack m0");
    src.after_batch().await.expect("after_batch");
    drop(src); // crash with m1 unsettled
    drop(m1);
    let mut next = f.subscribe().await;
    let back: Vec<String> = {
        let ds = collect(&mut *next, 2, f.patience()).await;
        let keys = ds.iter().map(kit_key).collect();
        ack_all(&mut *next, ds).await;
        keys
    };
    assert!(
        back.contains(&keys[1]),
        "the unsettled middle message must come back: {back:?}"
    );
    assert!(
        !back.contains(&keys[0]),
        "the acked first message came back (committed past nothing): {back:?}"
    );
    next.close().await.expect("close");
}

/// Settling a delivery after its source went away is harmless: it reports stale, acks
/// nothing, and the message comes back to the next subscription.
pub async fn a_stale_settle_is_harmless(h: &dyn SourceHarness) {
    let f = h.fixture("stale").await;
    let k = format!("{}-s", scenario_prefix("stale"));
    publish_keys(&*f, std::slice::from_ref(&k)).await;
    let mut src = f.subscribe().await;
    let mut got = collect(&mut *src, 1, f.patience()).await;
    let d = got.pop().expect("the published message must arrive");
    src.close().await.expect("close");
    drop(src);
    assert!(
        d.is_stale(),
        "a delivery of a closed source must report stale"
    );
    let _ = d.ack().await; // must not ack anything
    let mut next = f.subscribe().await;
    let back = collect(&mut *next, 1, f.patience()).await;
    assert_eq!(
        back.iter().map(kit_key).collect::<Vec<_>>(),
        vec![k],
        "a stale ack must not settle the message"
    );
    ack_all(&mut *next, back).await;
    next.close().await.expect("close");
}

/// The dedup key written by a publisher survives the broker, for `KeyStrategy::dedup_header`.
pub async fn the_dedup_header_survives_a_round_trip(h: &dyn SourceHarness) {
    let f = h.fixture("header").await;
    let k = format!("{}-order-42-paid", scenario_prefix("header"));
    let m = OutgoingMessage::new(f.destination(), r#"{"order":42}"#)
        .with_key("order-42")
        .with_header("x-trace", "t-1")
        .with_dedup_key(k.clone());
    f.publisher().publish(m).await.expect("publish");
    let mut src = f.subscribe().await;
    let got = collect(&mut *src, 1, f.patience()).await;
    let d = got.first().expect("the published message must arrive");
    let keys = KeyStrategy::dedup_header("kit").expect("group");
    assert_eq!(
        keys.derive(&d.envelope).expect("dedup key").as_str(),
        format!("kit:{k}")
    );
    assert_eq!(
        d.envelope.headers.get_str("x-trace"),
        Some("t-1"),
        "user headers must survive"
    );
    assert_eq!(&d.envelope.payload[..], br#"{"order":42}"#);
    ack_all(&mut *src, got).await;
    src.close().await.expect("close");
}

fn kit_config(f: &dyn SourceFixture) -> ConsumerConfig {
    ConsumerConfig {
        max_batch: 16,
        lease: Duration::from_secs(2),
        retry: RetryPolicy::fixed(f.nack_delay()),
        in_flight_delay_max: Duration::from_millis(300).max(f.nack_delay()),
        store_backoff: Duration::from_millis(20),
        store_backoff_max: Duration::from_millis(200),
        ..ConsumerConfig::default()
    }
}

/// Runs `consumer` over `src` until `done` says so (checked every 50 ms) or `within` passes.
async fn run_until<H: crate::handler::Handler>(
    consumer: &IdempotentConsumer<H>,
    mut src: Box<dyn Source>,
    within: Duration,
    done: impl Fn() -> bool,
) {
    let deadline = Instant::now() + within;
    let stop = async {
        while !done() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    consumer.run(&mut *src, stop).await.expect("consumer run");
}

/// In per-partition order, a message that fails once is retried before anything behind it.
pub async fn ordered_consumption_keeps_order_across_a_nack(h: &dyn SourceHarness) {
    let f = h.fixture("ordered").await;
    let p = scenario_prefix("ordered");
    let keys: Vec<String> = (0..10).map(|i| format!("{p}-{i:02}")).collect();
    publish_keys(&*f, &keys).await;
    let applied = Arc::new(Mutex::new(Vec::<String>::new()));
    let seen = applied.clone();
    let poison = keys[3].clone();
    let consumer = IdempotentConsumer::new(
        Arc::new(MemoryStore::new()),
        KeyStrategy::dedup_header("kit").expect("group"),
        move |m: ClaimedMessage| {
            let seen = seen.clone();
            let poison = poison.clone();
            async move {
                let k = m
                    .envelope
                    .headers
                    .get_str(crate::publish::DEDUP_HEADER)
                    .unwrap_or("")
                    .to_string();
                if k == poison && m.attempt == 1 {
                    return Err(HandlerError::retryable("kit: first attempt fails"));
                }
                seen.lock().unwrap_or_else(|e| e.into_inner()).push(k);
                Ok(None)
            }
        },
    )
    .with_config(ConsumerConfig {
        ordering: DeliveryOrder::PerPartition,
        ..kit_config(&*f)
    });
    let src = f.subscribe_ordered().await;
    let n = keys.len();
    let progress = applied.clone();
    run_until(&consumer, src, f.patience() * 2, move || {
        progress.lock().unwrap_or_else(|e| e.into_inner()).len() >= n
    })
    .await;
    let applied = applied.lock().unwrap_or_else(|e| e.into_inner()).clone();
    assert_eq!(
        applied, keys,
        "messages of one partition must apply in order across a nack"
    );
}

/// A storm of producer duplicates through the engine, with consumer crashes (mid-handler
/// and between completion and ack), ends with every message applied exactly once.
pub async fn a_duplicate_storm_with_crashes_is_exactly_once(h: &dyn SourceHarness) {
    let f = h.fixture("storm").await;
    let p = scenario_prefix("storm");
    let keys: Vec<String> = (0..120).map(|i| format!("{p}-{i:03}")).collect();
    // Every fifth message is sent twice: a producer retry after a lost confirm.
    let mut sends = keys.clone();
    sends.extend(keys.iter().step_by(5).cloned());
    publish_keys(&*f, &sends).await;

    let store = Arc::new(MemoryStore::new());
    let effects = Arc::new(Mutex::new(HashMap::<String, u32>::new()));
    let crashing = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let make = || {
        let effects = effects.clone();
        let crashing = crashing.clone();
        IdempotentConsumer::new(
            store.clone(),
            KeyStrategy::dedup_header("kit").expect("group"),
            move |m: ClaimedMessage| {
                let effects = effects.clone();
                let crashing = crashing.clone();
                async move {
                    if crashing.load(std::sync::atomic::Ordering::SeqCst) {
                        // The process is going down: never reaches its effect.
                        std::future::pending::<()>().await;
                    }
                    let k = m
                        .envelope
                        .headers
                        .get_str(crate::publish::DEDUP_HEADER)
                        .unwrap_or("")
                        .to_string();
                    *effects
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .entry(k)
                        .or_default() += 1;
                    Ok(None)
                }
            },
        )
        .with_config(kit_config(&*f))
    };
    for round in 0..3u64 {
        crashing.store(false, std::sync::atomic::Ordering::SeqCst);
        let consumer = make();
        let mut src = f.subscribe().await;
        let task = tokio::spawn(async move {
            let _ = consumer.run(&mut *src, std::future::pending()).await;
        });
        tokio::time::sleep(Duration::from_millis(400 + 300 * round)).await;
        // Crash: new handlers stop short of their effect; the ones past it complete; then
        // the process dies with whatever is unacked.
        crashing.store(true, std::sync::atomic::Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(300)).await;
        task.abort();
        let _ = task.await;
    }
    crashing.store(false, std::sync::atomic::Ordering::SeqCst);
    let consumer = make();
    let src = f.subscribe().await;
    let progress = effects.clone();
    let n = keys.len();
    run_until(&consumer, src, f.patience() * 3, move || {
        progress.lock().unwrap_or_else(|e| e.into_inner()).len() >= n
    })
    .await;
    let effects = effects.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let doubles: Vec<(&String, &u32)> = effects.iter().filter(|(_, c)| **c > 1).collect();
    let lost: Vec<&String> = keys.iter().filter(|k| !effects.contains_key(*k)).collect();
    assert!(
        doubles.is_empty() && lost.is_empty(),
        "double_effects={} lost={} (doubles {doubles:?}, lost {lost:?})",
        doubles.len(),
        lost.len()
    );
}

/// Expands to one `#[tokio::test]` per scenario of the source conformance kit. The argument
/// is a future yielding `Option<Arc<dyn SourceHarness>>` (`None` skips, unless
/// `IDEMQ_REQUIRE_SERVERS=1`).
#[macro_export]
macro_rules! source_contract_tests {
    ($harness:expr) => {
        $crate::source_contract_tests!(@case $harness;
            acked_message_is_not_redelivered_after_restart,
            nacked_message_comes_back_after_its_delay,
            rejected_message_reaches_the_dead_letter_with_its_reason,
            dropped_deliveries_and_sources_are_redelivered,
            cancelled_polls_lose_nothing,
            out_of_order_acks_commit_only_the_contiguous_prefix,
            a_stale_settle_is_harmless,
            the_dedup_header_survives_a_round_trip,
            ordered_consumption_keeps_order_across_a_nack,
            a_duplicate_storm_with_crashes_is_exactly_once);
    };
    (@case $harness:expr; $($name:ident),*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() {
                let harness: Option<std::sync::Arc<dyn $crate::testkit::source::SourceHarness>> = $harness.await;
                match harness {
                    Some(h) => $crate::testkit::source::$name(&*h).await,
                    None if std::env::var("IDEMQ_REQUIRE_SERVERS").as_deref() == Ok("1")
                        && !$crate::testkit::servers::skipped_for_a_missing_server() =>
                    {
                        panic!("IDEMQ_REQUIRE_SERVERS=1 but the broker for this source kit is not configured")
                    }
                    None => eprintln!("skipped: broker not configured"),
                }
            }
        )*
    };
}
