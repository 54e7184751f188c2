#![recursion_limit = "512"]
//! RocketMQ transactional (half) messages whose local transaction is recorded in a dedup
//! store, and whose broker check-back is answered from that store (`StoreCheckBack`), with
//! an idempotent consumer applying each order once.
//!
//! An order service places orders with `TransactionalPublisher::send_in_transaction`: the
//! half message (invisible to consumers) is sent, then the local transaction runs — claim
//! the order's key in the order service's store, write the order, complete the key — and
//! its outcome commits or rolls back the half message:
//!
//! | order | local transaction | the broker learns | delivered |
//! |---|---|---|---|
//! | `order-A` | committed | COMMIT | yes |
//! | `order-A` again | a producer resend (it thought the send timed out): the key is already completed, nothing is written again | COMMIT | yes, a second copy: the consumer drops it |
//! | `order-B` | validation failed, nothing written | ROLLBACK | never |
//! | `order-C` | committed, then the producer "crashed" before telling the broker | UNKNOWN → check-back: the key is completed → COMMIT | yes |
//! | `order-D` | claimed, then the producer "crashed" before writing anything | UNKNOWN → check-back: the lease has run out → ROLLBACK | never |
//!
//! The billing service's `IdempotentConsumer` (`KeyStrategy::dedup_header`: the dedup key
//! travels in `KEYS` and the `idemq-dedup-key` property) applies order-A and order-C once
//! each. The check-back comes after the broker's transaction timeout (≥ 6 s), so a run
//! takes about half a minute.
//!
//! Servers: RocketMQ (name server + broker; `IDEMQ_TEST_ROCKETMQ_NAMESRV`). Topic and
//! groups carry a random suffix.
//!
//! ```sh
//! scripts/servers.sh start rocketmq
//! eval "$(scripts/servers.sh env)"
//! cargo run --example rocketmq_transaction --features rocketmq
//! ```
//!
//! It ends with one line such as
//! `rocketmq transaction: placed=["order-A", "order-C"] applied={"order-A": 1, "order-C": 1} duplicates_skipped=1 check_back={"order-C": "CommitMessage", "order-D": "RollbackMessage"}`
//! and fails unless the committed orders are applied exactly once and the rolled-back ones
//! never. (Both stores here are the in-memory one, enough for one process; with producers
//! that really crash, record the order and complete its key in one database transaction,
//! e.g. `idemq::sql::PgStore::complete_in_tx`, so the check-back of a restarted producer
//! group still finds it.)

use idemq::rocketmq::{
    LocalOutcome, RocketPublisher, RocketPublisherConfig, RocketSource, RocketSourceConfig,
    StoreCheckBack, TransactionalPublisher,
};
use idemq::{
    ClaimOutcome, ClaimRequest, ClaimedMessage, CompleteOutcome, ConsumerGroup, DedupKey,
    DedupStore, HandlerError, IdempotentConsumer, KeyStrategy, MemoryStore, OutgoingMessage,
    Publisher,
};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long the example waits for the deliveries (check-backs included).
const PATIENCE: Duration = Duration::from_secs(150);
/// After the last expected delivery: time for a late copy or a wrong commit to show itself.
const GRACE: Duration = Duration::from_secs(12);

/// What the order service's local transaction does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    /// Write the order, complete its key, report COMMIT.
    Commit,
    /// Validation fails: write nothing, report ROLLBACK.
    Reject,
    /// Write the order and complete its key, then crash before reporting (UNKNOWN).
    CrashAfterCommit,
    /// Claim the key, then crash before writing anything (UNKNOWN; the lease runs out).
    CrashBeforeWrite,
}

type Shared<T> = Arc<Mutex<T>>;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The local transaction of one order: the order service's effect (its `orders` list),
/// recorded under the order's key in its store, which the check-back reads.
async fn place_order(
    store: Arc<dyn DedupStore>,
    key: DedupKey,
    orders: Shared<Vec<String>>,
    fate: Fate,
) -> LocalOutcome {
    if fate == Fate::Reject {
        return LocalOutcome::Rollback;
    }
    let lease = match fate {
        Fate::CrashBeforeWrite => Duration::from_secs(2),
        _ => Duration::from_secs(30),
    };
    let token = match store.claim(&ClaimRequest::new(key.clone(), lease)).await {
        Ok(ClaimOutcome::Acquired(l)) => l.token,
        // Placed before (this is a resend): the effect is committed, so is the message.
        Ok(ClaimOutcome::Duplicate(_)) => return LocalOutcome::Commit,
        // Being placed elsewhere, or the store cannot answer: let the check-back decide.
        Ok(_) | Err(_) => return LocalOutcome::Unknown,
    };
    if fate == Fate::CrashBeforeWrite {
        return LocalOutcome::Unknown;
    }
    lock(&orders).push(key.business_key().to_owned());
    match store
        .complete(&key, token, None, Duration::from_secs(3600))
        .await
    {
        Ok(CompleteOutcome::Completed) if fate == Fate::CrashAfterCommit => LocalOutcome::Unknown,
        Ok(CompleteOutcome::Completed) => LocalOutcome::Commit,
        // Fenced (the lease ran out meanwhile) or the store is down: ask again later.
        Ok(_) | Err(_) => LocalOutcome::Unknown,
    }
}

/// A server address that is not set. `main` returns it, and Rust prints a returned error with
/// `Debug`: this one prints its text as written (a `String` error would come out quoted).
struct NotSet(String);

impl std::fmt::Debug for NotSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::fmt::Display for NotSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for NotSet {}

/// The value of `name`, or an error saying how to get the servers and their addresses.
fn env_var(name: &str) -> Result<String, NotSet> {
    match std::env::var(name) {
        Ok(v) if !v.trim().is_empty() => Ok(v),
        _ => Err(NotSet(format!(
            "{name} is not set: start the servers with `scripts/servers.sh start rocketmq`, \
             then `eval \"$(scripts/servers.sh env)\"`"
        ))),
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let ns = env_var("IDEMQ_TEST_ROCKETMQ_NAMESRV")?;
    let run = format!("{:08x}", rand::random::<u32>());
    let topic = format!("idemq_example_orders_{run}");
    let orders_group = format!("orders_{run}");

    // A plain send creates the topic's route (a transactional producer needs one).
    let plain =
        RocketPublisher::connect(RocketPublisherConfig::new(&ns, format!("setup_{run}"))).await?;
    plain
        .publish(OutgoingMessage::new(&topic, r#"{"ping":true}"#).with_dedup_key("topic-ready"))
        .await?;
    plain.shutdown().await;

    // --- The order service: its store records each local transaction under the order's
    // key; the check-back reads it there. ---
    let order_store: Arc<dyn DedupStore> = Arc::new(MemoryStore::new());
    let placed: Shared<Vec<String>> = Arc::default();
    let producer = TransactionalPublisher::connect(
        &ns,
        &format!("order_service_{run}"),
        vec![topic.clone()],
        StoreCheckBack::new(order_store.clone(), &orders_group)?,
    )
    .await?;
    let namespace = ConsumerGroup::new(&orders_group)?;
    for (order, fate) in [
        ("order-A", Fate::Commit),
        ("order-A", Fate::Commit), // the producer's resend
        ("order-B", Fate::Reject),
        ("order-C", Fate::CrashAfterCommit),
        ("order-D", Fate::CrashBeforeWrite),
    ] {
        let msg = OutgoingMessage::new(&topic, format!(r#"{{"order":"{order}","cents":4200}}"#))
            .with_key(order)
            .with_dedup_key(order);
        let local = place_order(
            order_store.clone(),
            DedupKey::new(&namespace, order)?,
            placed.clone(),
            fate,
        );
        let (_, outcome) = producer.send_in_transaction(msg, local).await?;
        eprintln!("{order}: local transaction {fate:?}, told the broker {outcome:?}");
    }

    // --- The billing service: an idempotent consumer of the topic. ---
    let applied: Shared<BTreeMap<String, u32>> = Arc::default();
    let consumer = IdempotentConsumer::new(
        Arc::new(MemoryStore::new()),
        KeyStrategy::dedup_header(&format!("billing_{run}"))?,
        idemq::handler::with_state(applied.clone(), |applied, msg: ClaimedMessage| async move {
            let key = msg.key.business_key();
            if key.starts_with("order-") {
                *lock(&applied).entry(key.to_owned()).or_default() += 1; // the effect
            }
            Ok::<_, HandlerError>(None)
        }),
    );
    let mut source = RocketSource::connect(RocketSourceConfig::new(
        &ns,
        format!("billing_{run}"),
        &topic,
    ))
    .await?;
    let (watch, seen) = (consumer.clone(), applied.clone());
    let done = async move {
        let deadline = tokio::time::Instant::now() + PATIENCE;
        loop {
            let arrived = {
                let a = lock(&seen);
                a.contains_key("order-A") && a.contains_key("order-C")
            };
            if (arrived && watch.stats().duplicates >= 1) || tokio::time::Instant::now() > deadline
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        tokio::time::sleep(GRACE).await;
    };
    consumer.run(&mut source, done).await?;
    producer.shutdown().await;

    // What the check-back answers now, read from the order service's store.
    let check = StoreCheckBack::new(order_store, &orders_group)?;
    let check_back: BTreeMap<&str, String> = [
        ("order-C", format!("{:?}", check.state_of("order-C").await)),
        ("order-D", format!("{:?}", check.state_of("order-D").await)),
    ]
    .into_iter()
    .collect();

    let applied = lock(&applied).clone();
    let placed = lock(&placed).clone();
    let stats = consumer.stats();
    assert_eq!(
        placed,
        ["order-A", "order-C"],
        "orders the order service wrote"
    );
    assert_eq!(
        applied,
        BTreeMap::from([("order-A".to_owned(), 1), ("order-C".to_owned(), 1)]),
        "committed orders applied once each, rolled-back ones never"
    );
    assert!(
        stats.duplicates >= 1,
        "the resend of order-A was dropped: {stats:?}"
    );
    println!(
        "rocketmq transaction: placed={placed:?} applied={applied:?} duplicates_skipped={} check_back={check_back:?}",
        stats.duplicates
    );
    Ok(())
}
