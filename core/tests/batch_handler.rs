//! The engine with a batch handler, over the in-memory broker and store: one call per
//! polled batch, a failure isolated to its message, duplicates, order within a lane.

use idemq_core::broker::{Faults, MemoryBroker};
use idemq_core::handler::batch;
use idemq_core::{
    BrokerKind, ClaimedMessage, ConsumerConfig, DedupStore, DeliveryOrder, Envelope, HandlerError,
    IdempotentConsumer, KeyStrategy, MemoryStore,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

fn payment(id: &str, account: u32) -> Envelope {
    Envelope::new(
        BrokerKind::MEMORY,
        "payments",
        format!(r#"{{"payment_id":"{id}","account":{account},"amount":10}}"#),
    )
    .with_ordering_key(format!("acct-{account}"))
}

fn keys() -> KeyStrategy {
    KeyStrategy::json_pointer("billing", "/payment_id").expect("valid strategy")
}

fn fast(max_batch: usize) -> ConsumerConfig {
    ConsumerConfig {
        max_batch,
        lease: Duration::from_millis(800),
        retry: idemq_core::RetryPolicy::fixed(Duration::from_millis(10)).with_max_attempts(4),
        in_flight_delay_max: Duration::from_millis(100),
        store_backoff: Duration::from_millis(10),
        store_backoff_max: Duration::from_millis(50),
        store_retries: 1,
        ..ConsumerConfig::default()
    }
}

#[derive(serde::Deserialize)]
struct Payment {
    payment_id: String,
    account: u32,
}

/// What the handler applied (only from calls that succeeded: a failed call applies
/// nothing, like a rolled-back transaction), and the size of every call.
#[derive(Default)]
struct Ledger {
    applied: HashMap<String, u32>,
    calls: Vec<usize>,
    /// Payment ids in the order applied, per account.
    order: HashMap<u32, Vec<String>>,
}

/// A transactional batch handler: `poison` fails for good, `flaky` on its first attempt,
/// `panicky` panics on its first attempt; nothing of a failed call is applied.
fn ledger_handler(ledger: Arc<Mutex<Ledger>>) -> impl idemq_core::Handler {
    batch(ledger, |ledger, msgs: Vec<ClaimedMessage>| async move {
        let mut staged = Vec::with_capacity(msgs.len());
        for m in &msgs {
            let p: Payment = m.json()?;
            match p.payment_id.as_str() {
                "poison" => return Err(HandlerError::permanent("poison payment")),
                "flaky" if m.attempt == 1 => {
                    return Err(HandlerError::retryable("flaky downstream"))
                }
                "panicky" if m.attempt == 1 && !m.takeover => panic!("the handler panicked"),
                _ => {}
            }
            staged.push(p);
        }
        let mut l = ledger.lock().expect("ledger");
        l.calls.push(msgs.len());
        for p in staged {
            *l.applied.entry(p.payment_id.clone()).or_default() += 1;
            l.order.entry(p.account).or_default().push(p.payment_id);
        }
        Ok(())
    })
}

#[tokio::test]
async fn one_call_per_polled_batch_and_every_message_completed_once() {
    let broker = MemoryBroker::new();
    for i in 0..40 {
        broker.publish(payment(&format!("p-{i}"), i % 3));
    }
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let store = Arc::new(MemoryStore::new());
    let consumer = IdempotentConsumer::new(store.clone(), keys(), ledger_handler(ledger.clone()))
        .with_config(fast(20));
    consumer
        .run_until_idle(&mut broker.subscribe())
        .await
        .expect("run");
    {
        let l = ledger.lock().expect("ledger");
        assert_eq!(l.calls, vec![20, 20], "one call per polled batch");
        assert_eq!(l.applied.len(), 40);
        assert!(l.applied.values().all(|n| *n == 1));
    }
    let stats = consumer.stats();
    assert_eq!((stats.processed, stats.batch_splits), (40, 0), "{stats:?}");
    for i in 0..40 {
        let key = keys()
            .derive(&payment(&format!("p-{i}"), i % 3))
            .expect("key");
        let rec = store.get(&key).await.expect("get").expect("record");
        assert_eq!(rec.status, idemq_core::RecordStatus::Completed);
    }
}

#[tokio::test]
async fn a_failing_message_does_not_sink_its_batch() {
    let broker = MemoryBroker::new();
    for i in 0..30 {
        broker.publish(payment(&format!("p-{i}"), i % 4));
        if i == 7 {
            broker.publish(payment("poison", 9));
        }
        if i == 15 {
            broker.publish(payment("flaky", 8));
            broker.publish(payment("panicky", 7));
        }
    }
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let consumer = IdempotentConsumer::new(
        Arc::new(MemoryStore::new()),
        keys(),
        ledger_handler(ledger.clone()),
    )
    .with_config(fast(64));
    consumer
        .run_until_idle(&mut broker.subscribe())
        .await
        .expect("run");
    let l = ledger.lock().expect("ledger");
    for i in 0..30 {
        assert_eq!(l.applied.get(&format!("p-{i}")), Some(&1), "p-{i}");
    }
    assert_eq!(
        l.applied.get("flaky"),
        Some(&1),
        "retried alone, applied once"
    );
    assert_eq!(
        l.applied.get("panicky"),
        Some(&1),
        "run again alone as a takeover"
    );
    assert_eq!(l.applied.get("poison"), None);
    let dead = broker.dead_letters();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert!(
        dead[0].reason.contains("poison payment"),
        "{}",
        dead[0].reason
    );
    let stats = consumer.stats();
    assert!(stats.batch_splits >= 1, "{stats:?}");
    assert_eq!(stats.processed, 32, "{stats:?}");
}

#[tokio::test]
async fn duplicates_and_lost_acks_with_a_batch_handler_apply_each_payment_once() {
    let broker = MemoryBroker::with_seed(5);
    broker.set_faults(Faults {
        lost_ack_rate: 0.2,
        duplicate_publish_rate: 0.3,
    });
    for i in 0..500 {
        broker.publish(payment(&format!("p-{i}"), i % 5));
    }
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let consumer = IdempotentConsumer::new(
        Arc::new(MemoryStore::new()),
        keys(),
        ledger_handler(ledger.clone()),
    )
    .with_config(ConsumerConfig {
        pipeline_depth: 3,
        ..fast(32)
    });
    consumer
        .run_until_idle(&mut broker.subscribe())
        .await
        .expect("run");
    let l = ledger.lock().expect("ledger");
    assert_eq!(l.applied.len(), 500);
    assert!(l.applied.values().all(|n| *n == 1), "double effects");
    let stats = consumer.stats();
    assert!(stats.duplicates > 0, "{stats:?}");
}

#[tokio::test]
async fn per_key_order_holds_within_the_call_and_after_a_split() {
    let broker = MemoryBroker::new();
    // A message sent back returns to its place in its lane, as on an ordered broker.
    broker.set_ordering(DeliveryOrder::PerKey);
    for i in 0..60 {
        broker.publish(payment(&format!("p-{i:02}"), i % 3));
        if i == 20 {
            broker.publish(payment("flaky", 1));
        }
    }
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let consumer = IdempotentConsumer::new(
        Arc::new(MemoryStore::new()),
        keys(),
        ledger_handler(ledger.clone()),
    )
    .with_config(ConsumerConfig {
        ordering: DeliveryOrder::PerKey,
        ..fast(100)
    });
    consumer
        .run_until_idle(&mut broker.subscribe())
        .await
        .expect("run");
    let l = ledger.lock().expect("ledger");
    for account in [0u32, 2] {
        let got = &l.order[&account];
        let mut sorted = got.clone();
        sorted.sort();
        assert_eq!(got, &sorted, "account {account} applied out of order");
        assert_eq!(got.len(), 20);
    }
    // Account 1's lane held at `flaky` (sent back, with what followed it in the batch):
    // its payments still apply once each, in publication order.
    let got = &l.order[&1];
    let want: Vec<String> = (0..60)
        .filter(|i| i % 3 == 1)
        .map(|i| format!("p-{i:02}"))
        .flat_map(|p| {
            let flaky = (p == "p-19").then(|| "flaky".to_string());
            std::iter::once(p).chain(flaky)
        })
        .collect();
    assert_eq!(got, &want, "account 1 applied out of order");
}
