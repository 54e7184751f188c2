//! A partition's sent-back records come back in offset order, whatever order they were
//! sent back in.
//!
//! The engine sends a lane's records back in the order their fates are known, not in offset
//! order: in an ordered batch, a record whose claim found the key in flight elsewhere is
//! nacked (with the rest of its lane) during dispatch, *before* an earlier record of the
//! same partition whose handler then fails. Redelivered in push order, the later records
//! ran first; with Flow 3 (offsets stored with the effects, greatest wins) they moved the
//! stored offset past the earlier ones, and a crash before those ran skipped them for good
//! (the MariaDB "offsets ran 136 records ahead of the effects" defect).

mod support;

use idemq_core::envelope::Position;
use idemq_core::publish::{OutgoingMessage, Publisher};
use idemq_core::source::{Delivery, Source};
use std::time::Duration;

fn offset(d: &Delivery) -> i64 {
    match d.envelope.source.position {
        Some(Position::Offset(o)) => o,
        other => panic!("no offset: {other:?}"),
    }
}

async fn take(src: &mut dyn Source, n: usize) -> Vec<Delivery> {
    let mut out = Vec::new();
    while out.len() < n {
        let batch = tokio::time::timeout(Duration::from_secs(30), src.poll(n - out.len()))
            .await
            .expect("records within 30 s")
            .expect("poll")
            .expect("source open");
        out.extend(batch);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_sent_back_out_of_order_are_redelivered_in_offset_order() {
    let Some(brokers) = support::brokers() else {
        return;
    };
    let topic = support::unique("order-back");
    support::create_topic(&brokers, &topic, 1).await;
    let p = support::publisher(&brokers).await;
    for i in 0..6 {
        p.publish(OutgoingMessage::new(&topic, format!("{i}")).with_key("entity"))
            .await
            .expect("publish");
    }
    let mut src = support::subscribe(&brokers, &format!("{topic}-g"), &topic).await;
    let mut first = take(&mut src, 6).await;
    assert_eq!(
        first.iter().map(offset).collect::<Vec<_>>(),
        [0, 1, 2, 3, 4, 5]
    );
    // As the engine does: offset 3 is sent back during dispatch (its key is in flight
    // elsewhere), 4 and 5 deferred behind it; then 1's handler fails (2 not run), 0 is acked.
    let mut by_offset: Vec<Option<Delivery>> = first.drain(..).map(Some).collect();
    let mut back = |o: usize, delay_ms: u64| {
        let d = by_offset[o].take().expect("delivery");
        async move { d.nack(Duration::from_millis(delay_ms)).await.expect("nack") }
    };
    back(3, 200).await;
    back(4, 200).await;
    back(5, 200).await;
    back(1, 50).await;
    back(2, 50).await;
    by_offset[0]
        .take()
        .expect("delivery")
        .ack()
        .await
        .expect("ack");

    let again = take(&mut src, 5).await;
    let order: Vec<i64> = again.iter().map(offset).collect();
    assert_eq!(
        order,
        [1, 2, 3, 4, 5],
        "a partition's records must come back in offset order"
    );
    for d in again {
        d.ack().await.expect("ack");
    }
    src.close().await.expect("close");
}
