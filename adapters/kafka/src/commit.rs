//! Committing a Kafka transaction without rust-rdkafka's flush stall.
//!
//! `Producer::commit_transaction` in rust-rdkafka (0.38 and later) first calls its own
//! `flush`, which asks librdkafka once without waiting and, while any record is still
//! undelivered, calls `poll(100 ms)`; that `poll` keeps polling until its deadline even
//! after the last delivery report came in. Every commit with a record still in flight
//! therefore blocks for at least 100 ms, however fast the broker acknowledged: a
//! producer committing every 100 ms spends about half its time there.
//!
//! [`commit_transaction`] waits for the in-flight count to reach zero itself (the
//! `FutureProducer`'s own thread serves the delivery reports), then lets
//! `commit_transaction` run: its flush then finds nothing to wait for.

use rdkafka::error::{KafkaError, KafkaResult, RDKafkaErrorCode};
use rdkafka::producer::{FutureProducer, Producer};
use rdkafka::util::Timeout;
use std::time::{Duration, Instant};

/// How often the in-flight count is looked at while waiting: short against a commit
/// (a broker round trip plus the transaction markers, milliseconds), long enough not
/// to spin.
const IN_FLIGHT_CHECK: Duration = Duration::from_micros(500);

/// Commits `producer`'s open transaction: waits (blocking, up to `timeout`) until every
/// record it sent has a delivery report, then commits.
///
/// Use it in place of `producer.commit_transaction(timeout)`; like that call it blocks
/// the thread, so call it from `tokio::task::spawn_blocking`. A failed delivery makes the
/// commit fail as it would have (librdkafka turns it into an abortable transaction
/// error). `Err(KafkaError::Flush(OperationTimedOut))` means records were still in flight
/// at `timeout`; the transaction is left open, as rust-rdkafka's own flush leaves it.
///
/// ```no_run
/// use idemq_kafka::{commit_transaction, KafkaProducerConfig};
/// use idemq_kafka::rdkafka::producer::{FutureProducer, FutureRecord, Producer};
/// use std::time::Duration;
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let producer: FutureProducer =
///     KafkaProducerConfig::transactional("127.0.0.1:9092", "payments-1")
///         .client_config()?
///         .create()?;
/// producer.init_transactions(Duration::from_secs(30))?;
/// producer.begin_transaction()?;
/// let _delivery = producer.send_result(FutureRecord::to("out").key("k").payload("v"));
/// let p = producer.clone();
/// tokio::task::spawn_blocking(move || commit_transaction(&p, Duration::from_secs(30)))
///     .await??;
/// # Ok(())
/// # }
/// ```
pub fn commit_transaction(producer: &FutureProducer, timeout: Duration) -> KafkaResult<()> {
    let deadline = Instant::now() + timeout;
    // A zero-timeout flush only wakes the broker threads with librdkafka's "flushing" flag
    // set, so records waiting out `linger.ms` leave now; its time-out error is expected.
    let _ = producer.flush(Timeout::After(Duration::ZERO));
    wait_for_deliveries(producer, deadline)?;
    producer.commit_transaction(Timeout::After(
        deadline.saturating_duration_since(Instant::now()),
    ))
}

/// Blocks until `producer` has no record in flight, or fails at `deadline`.
fn wait_for_deliveries(producer: &FutureProducer, deadline: Instant) -> KafkaResult<()> {
    while producer.in_flight_count() > 0 {
        if Instant::now() >= deadline {
            return Err(KafkaError::Flush(RDKafkaErrorCode::OperationTimedOut));
        }
        std::thread::sleep(IN_FLIGHT_CHECK);
    }
    Ok(())
}
