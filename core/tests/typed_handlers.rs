//! Typed JSON payloads and shared state in closure handlers: a malformed payload is
//! dead-lettered with a reason naming the type, and the messages behind it still run.

use idemq_core::broker::MemoryBroker;
use idemq_core::handler::{json, with_state};
use idemq_core::{BrokerKind, Envelope, IdempotentConsumer, KeyStrategy, MemoryStore};
use std::sync::{Arc, Mutex};

#[derive(Debug, serde::Deserialize)]
struct Payment {
    payment_id: String,
    amount: i64,
}

fn payment(i: usize) -> Envelope {
    Envelope::new(
        BrokerKind::MEMORY,
        "payments",
        format!(r#"{{"payment_id":"pay-{i}","amount":{}}}"#, 100 + i),
    )
}

#[tokio::test]
async fn typed_payloads_reach_the_handler_and_malformed_ones_are_dead_lettered() {
    let broker = MemoryBroker::new();
    for i in 0..20 {
        broker.publish(payment(i));
        if i == 7 {
            // A key the strategy can read, but not a Payment (amount is text).
            broker.publish(Envelope::new(
                BrokerKind::MEMORY,
                "payments",
                r#"{"payment_id":"pay-bad","amount":"lots"}"#,
            ));
        }
        broker.publish(payment(i)); // a producer duplicate
    }
    let applied: Arc<Mutex<Vec<(String, i64)>>> = Arc::default();
    let keys = KeyStrategy::json_pointer("payments", "/payment_id").expect("keys");
    let handler = json(applied.clone(), |applied, _msg, p: Payment| async move {
        applied.lock().expect("lock").push((p.payment_id, p.amount));
        Ok(None)
    });
    let consumer = IdempotentConsumer::new(Arc::new(MemoryStore::new()), keys, handler);
    consumer
        .run_until_idle(&mut broker.subscribe())
        .await
        .expect("run");

    let mut got = applied.lock().expect("lock").clone();
    got.sort();
    let mut want: Vec<(String, i64)> = (0..20)
        .map(|i| (format!("pay-{i}"), 100 + i as i64))
        .collect();
    want.sort();
    assert_eq!(
        got, want,
        "each payment applied once, with its typed fields"
    );
    let dead = broker.dead_letters();
    assert_eq!(
        dead.len(),
        1,
        "only the malformed payload is dead-lettered: {dead:?}"
    );
    let reason = &dead[0].reason;
    assert!(
        reason.contains("Payment") && reason.contains("expected i64"),
        "the reason names the type and what was wrong: {reason}"
    );
}

#[tokio::test]
async fn a_stateful_closure_gets_its_state_per_message() {
    let broker = MemoryBroker::new();
    for i in 0..10 {
        broker.publish(payment(i));
    }
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let keys = KeyStrategy::json_pointer("payments-state", "/payment_id").expect("keys");
    let handler = with_state(seen.clone(), |seen, msg| async move {
        seen.lock().expect("lock").push(msg.key.as_str().to_owned());
        Ok(None)
    });
    IdempotentConsumer::new(Arc::new(MemoryStore::new()), keys, handler)
        .run_until_idle(&mut broker.subscribe())
        .await
        .expect("run");
    assert_eq!(seen.lock().expect("lock").len(), 10);
}

#[tokio::test]
async fn a_bridge_carries_the_business_key_so_the_other_side_applies_each_payment_once() {
    use idemq_core::broker::Faults;
    use idemq_core::handler::forward;
    use idemq_core::{ClaimedMessage, HandlerError, DEDUP_HEADER};

    // The old broker: producer resends and lost acks, so payments arrive more than once.
    let old = MemoryBroker::with_seed(7);
    old.set_faults(Faults {
        duplicate_publish_rate: 0.3,
        lost_ack_rate: 0.2,
    });
    for i in 0..50 {
        old.publish(payment(i).with_header("x-payment-id", format!("pay-{i}")));
    }
    let new = Arc::new(MemoryBroker::new());
    let bridge = IdempotentConsumer::new(
        Arc::new(MemoryStore::new()),
        KeyStrategy::header("bridge", "x-payment-id").expect("strategy"),
        forward(new.clone(), |_| "payments-v2".to_string()),
    );
    bridge
        .run_until_idle(&mut old.subscribe())
        .await
        .expect("bridge");
    assert!(bridge.stats().duplicates > 0, "{:?}", bridge.stats());

    // The other side dedups on the carried key, under its own group.
    let applied: Arc<Mutex<Vec<String>>> = Arc::default();
    let ledger = applied.clone();
    let billing = IdempotentConsumer::new(
        Arc::new(MemoryStore::new()),
        KeyStrategy::dedup_header("billing").expect("strategy"),
        move |m: ClaimedMessage| {
            let ledger = ledger.clone();
            async move {
                let carried = m.envelope.headers.get_str(DEDUP_HEADER).map(str::to_owned);
                assert_eq!(carried.as_deref(), Some(m.key.business_key()));
                ledger
                    .lock()
                    .expect("ledger")
                    .push(m.key.business_key().to_owned());
                Ok::<_, HandlerError>(None)
            }
        },
    );
    billing
        .run_until_idle(&mut new.subscribe())
        .await
        .expect("billing");
    let mut applied = applied.lock().expect("ledger").clone();
    applied.sort();
    let mut expected: Vec<String> = (0..50).map(|i| format!("pay-{i}")).collect();
    expected.sort();
    assert_eq!(
        applied, expected,
        "each payment applied once on the new broker"
    );
}
