//! Kafka → Kafka exactly once on the real broker: an aborted transaction's outputs are never
//! seen by read_committed readers, and the rewound input is processed once; a zombie with
//! the same transactional id is fenced.

mod support;

use idemq_core::publish::{OutgoingMessage, Publisher, DEDUP_HEADER};
use idemq_kafka::{KafkaProducerConfig, TransactionalProcessor, TxnError};
use std::collections::{HashMap, HashSet};
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aborted_batch_is_invisible_and_its_inputs_are_output_once() {
    let Some(brokers) = support::brokers() else {
        return;
    };
    let input = support::unique("ctp-in");
    let output = support::unique("ctp-out");
    support::create_topic(&brokers, &input, 2).await;
    support::create_topic(&brokers, &output, 1).await;
    let keys: Vec<String> = (0..30).map(|i| format!("{input}-{i:02}")).collect();
    let p = support::publisher(&brokers);
    for k in &keys {
        p.publish(OutgoingMessage::new(&input, k.clone()).with_dedup_key(k.clone()))
            .await
            .expect("publish");
    }

    let cfg = KafkaProducerConfig::transactional(&brokers, &support::unique("ctp-txn"));
    let mut proc = TransactionalProcessor::new(&cfg, &format!("{input}-g"), &[input.as_str()])
        .await
        .expect("processor");
    let poison = keys[13].clone();
    let mut failed_once = false;
    let mut aborts = 0;
    let mut done = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while done < keys.len() && tokio::time::Instant::now() < deadline {
        let out = output.clone();
        let r = proc
            .process_batch(10, Duration::from_secs(2), |env| {
                let k = env
                    .headers
                    .get_str(DEDUP_HEADER)
                    .unwrap_or_default()
                    .to_string();
                if k == poison && !failed_once {
                    failed_once = true;
                    return Err(format!("injected failure at {k}"));
                }
                Ok(vec![
                    OutgoingMessage::new(out.clone(), format!("out:{k}")).with_dedup_key(k)
                ])
            })
            .await;
        match r {
            Ok(n) => done += n,
            Err(TxnError::Aborted(_)) => aborts += 1,
            Err(e) => panic!("unexpected transactional failure: {e}"),
        }
    }
    assert_eq!(
        aborts, 1,
        "the injected failure must abort exactly one batch"
    );

    let committed = support::read_all(&brokers, &output, Duration::from_secs(2)).await;
    let mut counts: HashMap<String, u32> = HashMap::new();
    for e in &committed {
        *counts
            .entry(
                e.headers
                    .get_str(DEDUP_HEADER)
                    .unwrap_or_default()
                    .to_string(),
            )
            .or_default() += 1;
    }
    let doubles: Vec<_> = counts.iter().filter(|(_, c)| **c > 1).collect();
    let lost: Vec<_> = keys.iter().filter(|k| !counts.contains_key(*k)).collect();
    assert!(
        doubles.is_empty() && lost.is_empty(),
        "read_committed output: doubles {doubles:?} lost {lost:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zombie_with_the_same_transactional_id_is_fenced() {
    let Some(brokers) = support::brokers() else {
        return;
    };
    let input = support::unique("zombie-in");
    let output = support::unique("zombie-out");
    support::create_topic(&brokers, &input, 1).await;
    support::create_topic(&brokers, &output, 1).await;
    let p = support::publisher(&brokers);
    for i in 0..4 {
        p.publish(OutgoingMessage::new(&input, format!("{i}")))
            .await
            .expect("publish");
    }
    let cfg = KafkaProducerConfig::transactional(&brokers, &support::unique("zombie-txn"));
    let group = format!("{input}-g");
    let mut old = TransactionalProcessor::new(&cfg, &group, &[input.as_str()])
        .await
        .expect("old");
    // The new instance takes the id over: the old one is now a zombie.
    let _new = TransactionalProcessor::new(&cfg, &format!("{group}-new"), &[input.as_str()])
        .await
        .expect("new");
    let mut seen = HashSet::new();
    let out = output.clone();
    let r = loop {
        let r = old
            .process_batch(10, Duration::from_secs(5), |env| {
                seen.insert(env.payload.clone());
                Ok(vec![OutgoingMessage::new(out.clone(), env.payload.clone())])
            })
            .await;
        if !matches!(r, Ok(0)) {
            break r;
        }
    };
    assert!(
        matches!(r, Err(TxnError::Fenced(_))),
        "the zombie must be fenced: {r:?}"
    );
    let visible = support::read_all(&brokers, &output, Duration::from_secs(2)).await;
    assert!(
        visible.is_empty(),
        "a fenced zombie's outputs must stay invisible"
    );
}
