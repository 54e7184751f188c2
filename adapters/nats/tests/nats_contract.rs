//! The source conformance kit against the real NATS server (JetStream): each fixture is a
//! fresh stream with one durable pull consumer, its dead letters read back from the
//! dead-letter stream the source creates; the kit's scenarios that apply run on ordered
//! (per-subject) sources too. Besides the kit: header bytes of every shape the client admits
//! survive a trip through the server.

mod support;

use async_trait::async_trait;
use idemq_core::envelope::Envelope;
use idemq_core::publish::{OutgoingMessage, Publisher};
use idemq_core::source::Source;
use idemq_core::testkit::source::{SourceFixture, SourceHarness};
use idemq_nats::{DLQ_MSG_ID, DLQ_REASON, DLQ_SEQUENCE};
use std::sync::Arc;
use std::time::Duration;

struct Nats {
    url: String,
    /// Every subscription ordered, not only `subscribe_ordered`'s.
    ordered: bool,
}

struct StreamFixture {
    url: String,
    names: support::Names,
    ordered: bool,
    publisher: Arc<dyn Publisher>,
}

impl StreamFixture {
    fn config(&self, ordered: bool) -> idemq_nats::NatsSourceConfig {
        let mut c = support::config(&self.url, &self.names);
        c.ordered = ordered;
        c
    }
}

#[async_trait]
impl SourceHarness for Nats {
    async fn fixture(&self, scenario: &str) -> Box<dyn SourceFixture> {
        let names = support::Names::fresh(&format!("kit-{scenario}"));
        // The first source declares the stream, the dead-letter stream and the durable:
        // messages published before any subscription are kept.
        drop(support::source(support::config(&self.url, &names)).await);
        Box::new(StreamFixture {
            url: self.url.clone(),
            publisher: Arc::new(support::publisher(&self.url).await),
            names,
            ordered: self.ordered,
        })
    }
}

#[async_trait]
impl SourceFixture for StreamFixture {
    fn publisher(&self) -> Arc<dyn Publisher> {
        self.publisher.clone()
    }
    fn destination(&self) -> String {
        self.names.subject.clone()
    }
    async fn subscribe(&self) -> Box<dyn Source> {
        Box::new(support::source(self.config(self.ordered)).await)
    }
    async fn subscribe_ordered(&self) -> Box<dyn Source> {
        Box::new(support::source(self.config(true)).await)
    }
    async fn dead_letters(&self) -> Vec<(Envelope, String)> {
        let stream = self.config(self.ordered).dead_letter_stream_name();
        let mut out = Vec::new();
        for e in support::read_stream(&self.url, &stream)
            .await
            .unwrap_or_default()
        {
            let reason = e.headers.get_str(DLQ_REASON).map(str::to_owned);
            out.push((e, reason.unwrap_or_default()));
        }
        out
    }
}

/// The harness, or `None` (a skip) without `IDEMQ_TEST_NATS_URL`.
fn harness(ordered: bool) -> Option<Arc<dyn SourceHarness>> {
    let nats: Arc<dyn SourceHarness> = Arc::new(Nats {
        url: support::nats_url()?,
        ordered,
    });
    Some(nats)
}

idemq_core::source_contract_tests!(async { harness(false) });

/// The kit's scenarios once more with every subscription ordered (per subject). Two do not
/// apply: `acked_message_is_not_redelivered_after_restart` and
/// `out_of_order_acks_commit_only_the_contiguous_prefix` collect three deliveries of one
/// subject before settling any, and an ordered source hands a subject's next delivery out
/// only once the previous one is settled (`one_delivery_per_subject_is_out_at_a_time`).
mod ordered_source {
    use super::*;

    macro_rules! scenarios {
        ($($name:ident),*) => {$(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() {
                if let Some(h) = harness(true) {
                    idemq_core::testkit::source::$name(&*h).await;
                }
            }
        )*};
    }

    scenarios!(
        nacked_message_comes_back_after_its_delay,
        rejected_message_reaches_the_dead_letter_with_its_reason,
        dropped_deliveries_and_sources_are_redelivered,
        cancelled_polls_lose_nothing,
        a_stale_settle_is_harmless,
        the_dedup_header_survives_a_round_trip,
        ordered_consumption_keeps_order_across_a_nack,
        a_duplicate_storm_with_crashes_is_exactly_once
    );

    /// Two subjects of one stream: each has one delivery out at a time, the next of a
    /// subject comes when the previous is settled (a nack holds it back in front of the
    /// rest), and one subject waiting never holds up the other.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_delivery_per_subject_is_out_at_a_time() {
        let Some(url) = support::nats_url() else {
            return;
        };
        let names = support::Names::fresh("ordered-lanes");
        let mut cfg = support::config(&url, &names);
        cfg.ordered = true;
        let mut src = support::source(cfg).await;
        let p = support::publisher(&url).await;
        let (a, b) = (format!("{}.a", names.root), format!("{}.b", names.root));
        for (subject, key) in [(&a, "a1"), (&a, "a2"), (&b, "b1"), (&a, "a3"), (&b, "b2")] {
            p.publish(OutgoingMessage::new(subject.clone(), "{}").with_dedup_key(key))
                .await
                .expect("publish");
        }
        fn key(d: &idemq_core::Delivery) -> String {
            let k = d.envelope.headers.get_str(idemq_core::DEDUP_HEADER);
            k.unwrap_or("?").to_string()
        }
        // Polls until at least `n` deliveries are out (30 s at most).
        async fn out(src: &mut idemq_nats::NatsSource, n: usize) -> Vec<idemq_core::Delivery> {
            let mut got = Vec::new();
            let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
            while got.len() < n && tokio::time::Instant::now() < deadline {
                if let Ok(Ok(Some(ds))) =
                    tokio::time::timeout(Duration::from_secs(1), src.poll(10)).await
                {
                    got.extend(ds);
                }
            }
            got
        }
        // What a poll hands out within a second (nothing, when the lanes are busy).
        async fn more(src: &mut idemq_nats::NatsSource) -> Vec<String> {
            match tokio::time::timeout(Duration::from_secs(1), src.poll(10)).await {
                Ok(Ok(Some(ds))) => ds.iter().map(key).collect(),
                _ => Vec::new(),
            }
        }
        let mut first = out(&mut src, 2).await;
        first.sort_by_key(key);
        assert_eq!(first.iter().map(key).collect::<Vec<_>>(), ["a1", "b1"]);
        assert_eq!(
            more(&mut src).await,
            Vec::<String>::new(),
            "a2 waits for a1, b2 for b1"
        );
        let (b1, a1) = (first.pop().expect("b1"), first.pop().expect("a1"));
        // a1 goes back for 2 s and stays in front of a2; b's lane moves on meanwhile.
        let nacked = tokio::time::Instant::now();
        a1.nack(Duration::from_secs(2)).await.expect("nack a1");
        b1.ack().await.expect("ack b1");
        let mut next = out(&mut src, 1).await;
        let early: Vec<String> = next.iter().map(key).collect();
        assert!(
            early.contains(&"b2".to_string()),
            "b2 goes out at once: {early:?}"
        );
        let a1_early = early.contains(&"a1".to_string());
        assert!(
            !a1_early || nacked.elapsed() >= Duration::from_secs(2),
            "a1 came back early"
        );
        while next.len() < 2 {
            next.extend(out(&mut src, 1).await);
        }
        next.sort_by_key(key);
        assert_eq!(next.iter().map(key).collect::<Vec<_>>(), ["a1", "b2"]);
        assert!(
            nacked.elapsed() >= Duration::from_secs(2),
            "a1 came back early"
        );
        assert_eq!(
            more(&mut src).await,
            Vec::<String>::new(),
            "a2 waits for a1 again"
        );
        for d in next {
            d.ack().await.expect("ack");
        }
        for want in ["a2", "a3"] {
            let got = out(&mut src, 1).await;
            assert_eq!(
                got.iter().map(key).collect::<Vec<_>>(),
                [want],
                "a's rest in order"
            );
            for d in got {
                d.ack().await.expect("ack");
            }
        }
        src.close().await.expect("close");
        let dlq = support::config(&url, &names).dead_letter_stream_name();
        support::delete_streams(&url, &[names.stream, dlq]).await;
    }

    /// The poison message of the poison tests: its handler fails every time.
    const POISON: &str = "a-000";

    /// What a poison test's handler did: the keys it applied, in order, and how often it
    /// ran the poison message.
    #[derive(Clone, Default)]
    struct Runs {
        applied: Arc<std::sync::Mutex<Vec<String>>>,
        poison_attempts: Arc<std::sync::atomic::AtomicU32>,
    }

    impl Runs {
        fn applied(&self) -> Vec<String> {
            self.applied
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone()
        }
        fn attempts(&self) -> u32 {
            self.poison_attempts
                .load(std::sync::atomic::Ordering::SeqCst)
        }
        /// True once every key of `keys` was applied.
        fn applied_all(&self, keys: &[String]) -> bool {
            let applied = self.applied();
            keys.iter().all(|k| applied.contains(k))
        }
    }

    /// An engine with one lane per subject whose handler fails [`POISON`] every time
    /// (retried after `retry`'s delays, then dead-lettered) and applies every other key.
    fn poisoned_consumer(
        retry: idemq_core::RetryPolicy,
        runs: &Runs,
    ) -> idemq_core::IdempotentConsumer<impl idemq_core::Handler> {
        use idemq_core::{ClaimedMessage, HandlerError};
        let runs = runs.clone();
        idemq_core::IdempotentConsumer::new(
            Arc::new(idemq_core::MemoryStore::new()),
            idemq_core::KeyStrategy::dedup_header("ordered-poison").expect("group"),
            move |m: ClaimedMessage| {
                let runs = runs.clone();
                async move {
                    let key = m.envelope.headers.get_str(idemq_core::DEDUP_HEADER);
                    let key = key.unwrap_or_default().to_string();
                    if key == POISON {
                        runs.poison_attempts
                            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        return Err(HandlerError::retryable("poison: fails every time"));
                    }
                    runs.applied
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(key);
                    Ok(None)
                }
            },
        )
        .with_config(idemq_core::ConsumerConfig {
            max_batch: 32,
            ordering: idemq_core::DeliveryOrder::PerPartition,
            retry,
            ..idemq_core::ConsumerConfig::default()
        })
    }

    /// Publishes `keys` to `subject` in order, each stored before the next is sent.
    async fn publish_in_order(url: &str, subject: &str, keys: &[String]) {
        let p = support::publisher(url).await;
        for k in keys {
            p.publish(OutgoingMessage::new(subject, "{}").with_dedup_key(k.as_str()))
                .await
                .unwrap_or_else(|e| panic!("publish {k}: {e}"));
        }
    }

    /// Waits until `done` says so, `within` at most; false when it did not.
    async fn eventually(within: Duration, done: impl Fn() -> bool) -> bool {
        let deadline = tokio::time::Instant::now() + within;
        while !done() {
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        true
    }

    /// The keys of `applied` that start with `prefix`, in the order applied.
    fn of(applied: &[String], prefix: &str) -> Vec<String> {
        applied
            .iter()
            .filter(|k| k.starts_with(prefix))
            .cloned()
            .collect()
    }

    /// A message of subject a that always fails is held by its retries (3 s, 6 s, 8 s, then
    /// the dead letter) in front of 300 more of a — more than an ordered source keeps in
    /// memory — and 20 messages of subject b are published after all of them. b's all run
    /// while a's head is still being retried (a's backlog does not take intake away from b),
    /// the source saying ready; once the head is dead-lettered, a's rest runs in order, each
    /// message once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_poison_message_holds_up_only_its_own_subject() {
        let Some(url) = support::nats_url() else {
            return;
        };
        let names = support::Names::fresh("ordered-poison");
        let mut cfg = support::config(&url, &names);
        cfg.ordered = true;
        let dlq = cfg.dead_letter_stream_name();
        let mut src = support::source(cfg).await;
        let readiness = src.readiness();
        let (a, b) = (format!("{}.a", names.root), format!("{}.b", names.root));
        let a_rest: Vec<String> = (1..=300).map(|i| format!("a-{i:03}")).collect();
        let b_all: Vec<String> = (0..20).map(|i| format!("b-{i:02}")).collect();
        publish_in_order(&url, &a, &[POISON.to_string()]).await;
        publish_in_order(&url, &a, &a_rest).await;
        publish_in_order(&url, &b, &b_all).await;
        let retry = idemq_core::RetryPolicy {
            initial_delay: Duration::from_secs(3),
            max_delay: Duration::from_secs(8),
            multiplier: 2.0,
            jitter: 0.0,
            max_attempts: Some(4),
        };
        let runs = Runs::default();
        let consumer = poisoned_consumer(retry, &runs);
        // The poison's attempts, what had been applied and the source's readiness once b's
        // messages had all run.
        type Seen = (u32, Vec<String>, idemq_core::source::Readiness);
        let at_b_done = Arc::new(std::sync::Mutex::new(None::<Seen>));
        let stop = {
            let (runs, at_b_done, b_all, a_rest) = (
                runs.clone(),
                at_b_done.clone(),
                b_all.clone(),
                a_rest.clone(),
            );
            async move {
                if eventually(Duration::from_secs(60), || runs.applied_all(&b_all)).await {
                    let seen = (runs.attempts(), runs.applied(), readiness.check());
                    *at_b_done.lock().unwrap_or_else(|e| e.into_inner()) = Some(seen);
                }
                eventually(Duration::from_secs(120), || runs.applied_all(&a_rest)).await;
            }
        };
        consumer.run(&mut src, stop).await.expect("run");
        let applied = runs.applied();
        let seen = at_b_done.lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some((attempts, then, ready)) = seen else {
            panic!(
                "b's messages did not all run within 60 s ({} of 20 did): a's poison held up \
                 every subject",
                of(&applied, "b-").len()
            );
        };
        assert!(
            attempts < 4 && of(&then, "a-").is_empty(),
            "b's messages ran only after a's poison message was dead-lettered ({attempts} of \
             its 4 attempts made, {} of a's later messages applied before b's were done): a's \
             backlog held up every subject",
            of(&then, "a-").len()
        );
        assert!(
            ready.is_ready(),
            "intake was flowing, yet the source said {ready:?}"
        );
        assert_eq!(
            of(&applied, "b-"),
            b_all,
            "b's messages once each, in order"
        );
        assert_eq!(
            of(&applied, "a-"),
            a_rest,
            "a's messages after its head once each, in order"
        );
        assert_eq!(
            runs.attempts(),
            4,
            "the poison ran as often as the policy says"
        );
        let copies = dead_copies(&url, &dlq, POISON, 1).await;
        assert_eq!(copies.len(), 1, "the poison message is dead-lettered once");
        support::delete_streams(&url, &[names.stream, dlq]).await;
    }

    /// The server hands a consumer nothing new while `max_ack_pending` of its messages are
    /// unsettled. With a window of 40, a message of subject a that always fails (retried
    /// after 2 s and 4 s, then dead-lettered) in front of 100 more of a fills it, and 5
    /// messages of subject b published after cannot arrive: the source is not ready and says
    /// why while that lasts. Once the poison is dead-lettered everything runs (a in order,
    /// each message once) and the source is ready again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_window_filled_behind_a_poison_message_is_reported_not_ready() {
        let Some(url) = support::nats_url() else {
            return;
        };
        let names = support::Names::fresh("ordered-window");
        let mut cfg = support::config(&url, &names);
        cfg.ordered = true;
        cfg.max_ack_pending = 40;
        let dlq = cfg.dead_letter_stream_name();
        let mut src = support::source(cfg).await;
        let readiness = src.readiness();
        let (a, b) = (format!("{}.a", names.root), format!("{}.b", names.root));
        let a_rest: Vec<String> = (1..=100).map(|i| format!("a-{i:03}")).collect();
        let b_all: Vec<String> = (0..5).map(|i| format!("b-{i:02}")).collect();
        publish_in_order(&url, &a, &[POISON.to_string()]).await;
        publish_in_order(&url, &a, &a_rest).await;
        publish_in_order(&url, &b, &b_all).await;
        let retry = idemq_core::RetryPolicy {
            initial_delay: Duration::from_secs(2),
            max_delay: Duration::from_secs(4),
            multiplier: 2.0,
            jitter: 0.0,
            max_attempts: Some(3),
        };
        let runs = Runs::default();
        let consumer = poisoned_consumer(retry, &runs);
        // What the readiness probe said while the poison was being retried, and at the end.
        let reported = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
        let ready_after = Arc::new(std::sync::Mutex::new(None::<bool>));
        let stop = {
            let (runs, reported, ready_after) =
                (runs.clone(), reported.clone(), ready_after.clone());
            let everything: Vec<String> = a_rest.iter().chain(&b_all).cloned().collect();
            async move {
                let watch = async {
                    while runs.attempts() < 3 {
                        if let idemq_core::source::Readiness::Waiting(why) = readiness.check() {
                            reported.lock().unwrap_or_else(|e| e.into_inner()).push(why);
                        }
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                };
                let _ = tokio::time::timeout(Duration::from_secs(60), watch).await;
                eventually(Duration::from_secs(90), || runs.applied_all(&everything)).await;
                let ready =
                    eventually(Duration::from_secs(10), || readiness.check().is_ready()).await;
                *ready_after.lock().unwrap_or_else(|e| e.into_inner()) = Some(ready);
            }
        };
        consumer.run(&mut src, stop).await.expect("run");
        let reported = reported.lock().unwrap_or_else(|e| e.into_inner()).clone();
        assert!(
            reported.iter().any(|why| why.contains("max_ack_pending")),
            "the server's window was full behind the poison message (nothing new could \
             arrive), yet the source said ready throughout; it said {reported:?}"
        );
        let applied = runs.applied();
        assert_eq!(
            of(&applied, "a-"),
            a_rest,
            "a's messages after its head once each, in order"
        );
        assert_eq!(
            of(&applied, "b-"),
            b_all,
            "b's messages once each, in order"
        );
        assert_eq!(
            *ready_after.lock().unwrap_or_else(|e| e.into_inner()),
            Some(true),
            "ready again once the window emptied"
        );
        assert_eq!(dead_copies(&url, &dlq, POISON, 1).await.len(), 1);
        support::delete_streams(&url, &[names.stream, dlq]).await;
    }
}

/// Header names and values of every shape the client admits (printable-ASCII names, one
/// line of UTF-8, from the core's fuzz generators) reach a consumer byte for byte; what it
/// does not admit is refused by the publisher, naming the header, and nothing is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fuzzed_headers_survive_the_server_byte_for_byte() {
    use idemq_core::testkit::fuzz::{bytes, text};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    let Some(url) = support::nats_url() else {
        return;
    };
    let names = support::Names::fresh("fuzz-headers");
    let mut src = support::source(support::config(&url, &names)).await;
    let publisher = support::publisher(&url).await;
    let mut sent: Vec<OutgoingMessage> = Vec::new();
    let mut refused = 0;
    for seed in 0..300u64 {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut m = OutgoingMessage::new(names.subject.clone(), bytes(&mut rng))
            .with_dedup_key(format!("fuzz-{seed}"));
        for _ in 0..rng.gen_range(0..6) {
            let name = if rng.gen_bool(0.8) {
                (0..rng.gen_range(1..24))
                    .map(|_| char::from(rng.gen_range(b'!'..=b'~')))
                    .filter(|c| *c != ':')
                    .collect()
            } else {
                text(&mut rng, 24)
            };
            let value = String::from_utf8_lossy(&bytes(&mut rng)).into_owned();
            let value = if rng.gen_bool(0.8) {
                value.replace(['\r', '\n'], " ").trim().to_string()
            } else {
                value
            };
            m = m.with_header(name, value);
        }
        match publisher.publish(m.clone()).await {
            Ok(_) => sent.push(m),
            Err(idemq_core::PublishError::Rejected(why)) => {
                refused += 1;
                assert!(why.contains("header"), "seed {seed}: {why}");
            }
            Err(e) => panic!("seed {seed}: {e}"),
        }
    }
    assert!(
        sent.len() > 100 && refused > 10,
        "{} sent, {refused} refused",
        sent.len()
    );
    let mut got = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while got.len() < sent.len() && tokio::time::Instant::now() < deadline {
        if let Ok(Ok(Some(batch))) =
            tokio::time::timeout(Duration::from_secs(2), src.poll(64)).await
        {
            for d in batch {
                got.push(d.envelope.clone());
                d.ack().await.expect("ack");
            }
        }
    }
    assert_eq!(got.len(), sent.len(), "every message sent arrives");
    for (m, env) in sent.iter().zip(&got) {
        assert_eq!(env.payload, m.payload);
        assert_eq!(env.message_id, m.dedup_key);
        for (name, value) in m.wire_headers().iter() {
            assert!(
                env.headers.iter().any(|(n, v)| n == name && v == value),
                "{:?}: header {name:?} = {:?} did not arrive as sent",
                m.dedup_key,
                String::from_utf8_lossy(value)
            );
        }
    }
    src.close().await.expect("close");
    let dlq = support::config(&url, &names).dead_letter_stream_name();
    support::delete_streams(&url, &[names.stream, dlq]).await;
}

/// The dead-letter copies in `stream` whose dedup header is `key`, once `want` of them are
/// there or after 15 s.
async fn dead_copies(url: &str, stream: &str, key: &str, want: usize) -> Vec<Envelope> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let copies: Vec<Envelope> = support::read_stream(url, stream)
            .await
            .unwrap_or_default()
            .into_iter()
            .filter(|e| e.headers.get_str(idemq_core::DEDUP_HEADER) == Some(key))
            .collect();
        if copies.len() >= want || tokio::time::Instant::now() > deadline {
            return copies;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Polls until `n` deliveries are out (30 s at most).
async fn deliveries(src: &mut idemq_nats::NatsSource, n: usize) -> Vec<idemq_core::Delivery> {
    let mut got = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while got.len() < n && tokio::time::Instant::now() < deadline {
        if let Ok(Ok(Some(ds))) = tokio::time::timeout(Duration::from_secs(1), src.poll(10)).await {
            got.extend(ds);
        }
    }
    got
}

/// Two messages with one dedup key (the second published after the stream's duplicate
/// window, so both are stored) are both rejected within the dead-letter stream's window:
/// both copies are stored there. A copy carrying the original's `Nats-Msg-Id` would be
/// dropped by the dead-letter stream as a duplicate publish while its original is
/// terminated. The original id stays readable in [`DLQ_MSG_ID`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_dead_letters_with_one_dedup_key_are_both_kept() {
    let Some(url) = support::nats_url() else {
        return;
    };
    let names = support::Names::fresh("dlq-one-key");
    let js = support::jetstream(&url).await.expect("jetstream");
    js.create_stream(idemq_nats::async_nats::jetstream::stream::Config {
        name: names.stream.clone(),
        subjects: vec![format!("{}.>", names.root)],
        duplicate_window: Duration::from_millis(500),
        ..Default::default()
    })
    .await
    .expect("stream with a short duplicate window");
    let cfg = support::config(&url, &names);
    let dlq = cfg.dead_letter_stream_name();
    let mut src = support::source(cfg).await;
    let p = support::publisher(&url).await;
    let key = "poison-twice";
    let msg = OutgoingMessage::new(names.subject.clone(), "{}").with_dedup_key(key);
    let first = p.publish_acked(&msg).await.expect("first publish");
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let second = p.publish_acked(&msg).await.expect("second publish");
    assert!(
        !first.duplicate && !second.duplicate,
        "both stored in the source stream"
    );
    let got = deliveries(&mut src, 2).await;
    assert_eq!(got.len(), 2, "both messages arrive");
    for (i, d) in got.into_iter().enumerate() {
        d.reject(&format!("rejection {i}")).await.expect("reject");
    }
    let copies = dead_copies(&url, &dlq, key, 2).await;
    assert_eq!(
        copies.len(),
        2,
        "both dead letters must be in {dlq}, got {:?}",
        copies
            .iter()
            .map(|e| e.headers.get_str(DLQ_SEQUENCE))
            .collect::<Vec<_>>()
    );
    let mut sequences: Vec<Option<&str>> = copies
        .iter()
        .map(|e| e.headers.get_str(DLQ_SEQUENCE))
        .collect();
    sequences.sort();
    let want = [first.receipt.position, second.receipt.position].map(|p| match p {
        Some(idemq_core::Position::Sequence(s)) => s.to_string(),
        other => panic!("no stream sequence: {other:?}"),
    });
    assert_eq!(
        sequences,
        [Some(want[0].as_str()), Some(want[1].as_str())],
        "one copy of each"
    );
    for c in &copies {
        assert_eq!(c.headers.get_str(DLQ_MSG_ID), Some(key), "the original id");
        assert_ne!(
            c.message_id.as_deref(),
            Some(key),
            "no colliding Nats-Msg-Id"
        );
    }
    assert_ne!(copies[0].message_id, copies[1].message_id);
    src.close().await.expect("close");
    support::delete_streams(&url, &[names.stream, dlq]).await;
}

/// One message rejected by two durable consumers of its stream (each dead-letters it to
/// the stream's one dead-letter subject): two dead-lettering events, two copies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_message_rejected_by_two_durables_is_dead_lettered_twice() {
    let Some(url) = support::nats_url() else {
        return;
    };
    let names = support::Names::fresh("dlq-two-durables");
    let a = support::config(&url, &names);
    let mut b = a.clone();
    b.durable = format!("{}-b", a.durable);
    let dlq = a.dead_letter_stream_name();
    let mut src_a = support::source(a).await;
    let mut src_b = support::source(b).await;
    let p = support::publisher(&url).await;
    let key = "poison-for-both";
    p.publish(OutgoingMessage::new(names.subject.clone(), "{}").with_dedup_key(key))
        .await
        .expect("publish");
    for src in [&mut src_a, &mut src_b] {
        let got = deliveries(src, 1).await;
        assert_eq!(got.len(), 1, "each durable gets the message");
        for d in got {
            d.reject("poison").await.expect("reject");
        }
    }
    let copies = dead_copies(&url, &dlq, key, 2).await;
    assert_eq!(copies.len(), 2, "one copy per durable in {dlq}");
    src_a.close().await.expect("close");
    src_b.close().await.expect("close");
    support::delete_streams(&url, &[names.stream, dlq]).await;
}
