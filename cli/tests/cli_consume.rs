//! `idemq consume` against the real brokers, run as the binary a user runs: producer
//! duplicates are skipped and each message processed is printed as a JSON line.
#![cfg(feature = "sqlite")]

#[cfg(feature = "kafka")]
use idemq::core::testkit::process::{child_role, ChildProcess};
use idemq_core::testkit::servers::server_url;
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

/// A SQLite dedup store in a fresh directory, removed at the end.
struct TempStore(PathBuf);

impl TempStore {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "idemq-cli-{tag}-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        Self(dir)
    }
    fn url(&self) -> String {
        format!("sqlite://{}?mode=rwc", self.0.join("dedup.db").display())
    }
}

impl Drop for TempStore {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs `idemq ARGS` to its end (failing the test after `limit`).
async fn idemq(args: &[&str], limit: Duration) -> std::process::Output {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_idemq"))
        .args(args)
        .kill_on_drop(true)
        .output();
    tokio::time::timeout(limit, out)
        .await
        .unwrap_or_else(|_| panic!("idemq {args:?} still running after {limit:?}"))
        .expect("run idemq")
}

/// stdout's JSON lines.
fn json_lines(stdout: &str) -> Vec<serde_json::Value> {
    stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON line ({e}): {l}")))
        .collect()
}

#[tokio::test]
async fn the_help_says_stdout_is_at_least_once_after_a_crash() {
    let out = idemq(&["consume", "--help"], Duration::from_secs(60)).await;
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{help}");
    let flat = help.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(flat.contains("at-least-once"), "{help}");
    assert!(flat.contains("\"takeover\": true"), "{help}");
    assert!(
        !flat.contains("prints each message processed once"),
        "{help}"
    );
}

#[cfg(feature = "rabbitmq")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dedup_header_reads_the_dedup_plugins_header_as_pika_sends_it() {
    use idemq::rabbitmq::lapin::options::{
        BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
    };
    use idemq::rabbitmq::lapin::publisher_confirm::Confirmation;
    use idemq::rabbitmq::lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
    use idemq::rabbitmq::lapin::BasicProperties;

    let Some(url) = server_url("IDEMQ_TEST_AMQP_URL") else {
        return;
    };
    let queue = format!("idemq_cli_plugin_{:08x}", rand::random::<u32>());
    let conn = idemq::rabbitmq::connect(&url, "idemq cli test")
        .await
        .expect("connect");
    let ch = conn.create_channel().await.expect("channel");
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    ch.queue_declare(&queue, durable, FieldTable::default())
        .await
        .expect("declare queue");
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirms");
    // What a pika producer of the message-deduplication plugin sends: persistent, confirmed,
    // the key in `x-deduplication-header` and nowhere else. 12 payments, the first 4 resent.
    for i in (0..12).chain(0..4) {
        let mut headers = FieldTable::default();
        headers.insert(
            ShortString::from("x-deduplication-header"),
            AMQPValue::LongString(LongString::from(format!("pay-{i}"))),
        );
        let props = BasicProperties::default()
            .with_delivery_mode(2)
            .with_headers(headers);
        let payload = format!("{{\"amount\":{i}}}");
        let confirm = ch
            .basic_publish(
                "",
                &queue,
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                payload.as_bytes(),
                props,
            )
            .await
            .expect("publish")
            .await
            .expect("confirm");
        assert_eq!(
            confirm,
            Confirmation::Ack(None),
            "publish {i} not confirmed"
        );
    }
    let store = TempStore::new("plugin");
    let sep = if url.contains('?') { '&' } else { '?' };
    let out = idemq(
        &[
            "consume",
            "--broker",
            &format!("{url}{sep}queue={queue}"),
            "--store",
            &store.url(),
            "--key",
            "dedup-header",
            "--idle-exit",
            "5",
        ],
        Duration::from_secs(120),
    )
    .await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let lines = json_lines(&stdout);
    let keys: BTreeSet<&str> = lines.iter().filter_map(|v| v["key"].as_str()).collect();
    let want: BTreeSet<String> = (0..12).map(|i| format!("pay-{i}")).collect();
    assert_eq!(
        keys,
        want.iter().map(String::as_str).collect(),
        "each payment once, keyed by the plugin header:\n{stdout}\n{stderr}"
    );
    assert_eq!(lines.len(), 12, "{stdout}");
    assert!(
        stderr.contains("processed=12 duplicates_skipped=4 dead_lettered=0"),
        "{stderr}"
    );
    let dlq = ch
        .queue_declare(
            &format!("{queue}.dlq"),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("the dead-letter queue");
    assert_eq!(dlq.message_count(), 0, "nothing dead-lettered: {stderr}");
    for q in [queue.clone(), format!("{queue}.dlq")] {
        let _ = ch.queue_delete(&q, QueueDeleteOptions::default()).await;
    }
}

/// A NATS stream through `--broker nats://…/STREAM`: messages keyed in idemq's header (as a
/// bridge from another broker sends them, resends included, which the stream's own dedup
/// cannot see) and in `Nats-Msg-Id` alone (as any NATS producer sets it), each printed once.
#[cfg(feature = "nats")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_stream_is_consumed_once_per_key_from_either_slot() {
    use idemq::nats::async_nats;
    let Some(url) = server_url("IDEMQ_TEST_NATS_URL") else {
        return;
    };
    let tag = format!("{:08x}", rand::random::<u32>());
    let (stream, root) = (format!("IDEMQ_CLI_{tag}"), format!("idemq-cli.{tag}"));
    let js = async_nats::jetstream::new(async_nats::connect(url.as_str()).await.expect("connect"));
    js.create_stream(async_nats::jetstream::stream::Config {
        name: stream.clone(),
        subjects: vec![format!("{root}.>")],
        ..Default::default()
    })
    .await
    .expect("create the stream");
    let send = |header: &'static str, i: u32| {
        let js = js.clone();
        let subject = format!("{root}.payments");
        async move {
            let mut h = async_nats::HeaderMap::new();
            h.insert(header, format!("pay-{i}").as_str());
            js.publish_with_headers(subject, h, format!("{{\"amount\":{i}}}").into())
                .await
                .expect("publish")
                .await
                .expect("PubAck");
        }
    };
    for i in (0..12).chain(0..4) {
        send(idemq::DEDUP_HEADER, i).await;
    }
    for i in 12..16 {
        send("Nats-Msg-Id", i).await;
    }
    let store = TempStore::new("nats");
    let (broker, store_url) = (format!("{url}/{stream}?subject={root}.>"), store.url());
    let args: Vec<&str> = "consume --key dedup-header --idle-exit 5"
        .split(' ')
        .chain(["--broker", broker.as_str(), "--store", store_url.as_str()])
        .collect();
    let out = idemq(&args, Duration::from_secs(120)).await;
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stderr}");
    let mut printed: Vec<String> = json_lines(&stdout)
        .iter()
        .map(|v| v["key"].as_str().unwrap_or("<no key>").to_string())
        .collect();
    printed.sort_by_key(|k| {
        k.trim_start_matches("pay-")
            .parse::<u32>()
            .unwrap_or(u32::MAX)
    });
    let want: Vec<String> = (0..16).map(|i| format!("pay-{i}")).collect();
    assert_eq!(printed, want, "each payment printed once:\n{stderr}");
    let counts = "processed=16 duplicates_skipped=4 dead_lettered=0";
    assert!(stderr.contains(counts), "{stderr}");
    for s in [stream.clone(), format!("{stream}_DLQ")] {
        let _ = js.delete_stream(&s).await;
    }
}

#[cfg(feature = "kafka")]
mod kafka {
    use super::*;
    use idemq::kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use idemq::kafka::rdkafka::client::DefaultClientContext;
    use idemq::kafka::rdkafka::ClientConfig;
    use idemq::kafka::{KafkaProducerConfig, KafkaPublisher};
    use idemq::{OutgoingMessage, Publisher};

    /// The `--idle-exit` of the runs that must print everything published before them. The
    /// source is ready once partitions are assigned, before the offset lookup and the first
    /// fetch: on a loaded machine that fetch and the first SQLite batch can take seconds, and
    /// a short window would end the run before it printed every line.
    const IDLE_EXIT: &str = "8";

    /// A fresh topic of `partitions` partitions.
    async fn create_topic(brokers: &str, tag: &str, partitions: i32) -> String {
        let topic = format!("idemq_cli_{tag}_{:08x}", rand::random::<u32>());
        let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .create()
            .expect("admin");
        let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(20)));
        for r in admin
            .create_topics(
                [&NewTopic::new(
                    &topic,
                    partitions,
                    TopicReplication::Fixed(1),
                )],
                &opts,
            )
            .await
            .expect("create topic")
        {
            r.expect("topic created");
        }
        topic
    }

    /// Publishes payments `ids` (confirmed), each as `{"payment_id":"pay-<i>","amount":<i>}`.
    async fn publish_payments(brokers: &str, topic: &str, ids: impl Iterator<Item = u32>) {
        let publisher = KafkaPublisher::connect(&KafkaProducerConfig::idempotent(brokers))
            .await
            .expect("publisher");
        let batch = ids
            .map(|i| {
                OutgoingMessage::new(
                    topic,
                    format!("{{\"payment_id\":\"pay-{i}\",\"amount\":{i}}}"),
                )
            })
            .collect();
        for r in publisher.publish_batch(batch).await {
            r.expect("confirmed");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn consume_prints_each_kafka_message_once_and_skips_the_resends() {
        let Some(brokers) = server_url("IDEMQ_TEST_KAFKA_BROKERS") else {
            return;
        };
        let topic = create_topic(&brokers, "consume", 2).await;
        // 20 payments, the first 5 resent by the provider with the same payment id.
        publish_payments(&brokers, &topic, (0..20).chain(0..5)).await;
        let store = TempStore::new("consume");
        let out = idemq(
            &[
                "consume",
                "--broker",
                &format!("kafka://{brokers}/{topic}"),
                "--store",
                &store.url(),
                "--key",
                "json:/payment_id",
                "--group",
                &format!("{topic}-g"),
                "--idle-exit",
                "10",
            ],
            Duration::from_secs(120),
        )
        .await;
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        let lines = json_lines(&stdout);
        let keys: BTreeSet<&str> = lines.iter().filter_map(|v| v["key"].as_str()).collect();
        assert_eq!(lines.len(), 20, "one line per payment:\n{stdout}\n{stderr}");
        assert_eq!(keys.len(), 20, "{stdout}");
        assert!(
            lines.iter().all(|v| v["source"] == topic.as_str()),
            "{stdout}"
        );
        assert!(
            stderr.contains("processed=20 duplicates_skipped=5"),
            "{stderr}"
        );
    }

    /// `idemq consume` of `topic` in `group` with `--key json:/payment_id` and
    /// `--idle-exit` [`IDLE_EXIT`], to its end: (stdout's JSON lines, stderr).
    async fn consume_payments(
        brokers: &str,
        topic: &str,
        group: &str,
        store: &TempStore,
    ) -> (Vec<serde_json::Value>, String) {
        let out = idemq(
            &[
                "consume",
                "--broker",
                &format!("kafka://{brokers}/{topic}"),
                "--store",
                &store.url(),
                "--key",
                "json:/payment_id",
                "--group",
                group,
                "--idle-exit",
                IDLE_EXIT,
            ],
            Duration::from_secs(120),
        )
        .await;
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{stderr}");
        (json_lines(&stdout), stderr)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_line_a_crashed_run_may_have_printed_comes_again_with_takeover() {
        let Some(brokers) = server_url("IDEMQ_TEST_KAFKA_BROKERS") else {
            return;
        };
        let topic = create_topic(&brokers, "takeover", 1).await;
        let group = format!("{topic}-g");
        publish_payments(&brokers, &topic, 0..5).await;
        // A run that claimed pay-2, printed its line and was SIGKILLed before recording it
        // done leaves this behind: an in-progress record whose lease ends.
        let store = TempStore::new("takeover");
        {
            let dedup = idemq::open_store(&store.url()).await.expect("store");
            let key = idemq::DedupKey::from_stored(format!("{group}:pay-2"));
            let claimed = dedup
                .claim(&idemq::ClaimRequest::new(
                    key.clone(),
                    Duration::from_secs(1),
                ))
                .await
                .expect("claim");
            assert!(
                matches!(claimed, idemq::ClaimOutcome::Acquired(_)),
                "{claimed:?}"
            );
            let until = std::time::Instant::now() + Duration::from_secs(60);
            loop {
                let r = dedup.get(&key).await.expect("get").expect("the record");
                if r.lease_until_ms < idemq::now_ms() {
                    break;
                }
                assert!(
                    std::time::Instant::now() < until,
                    "lease never ended: {r:?}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        let (lines, stderr) = consume_payments(&brokers, &topic, &group, &store).await;
        assert_eq!(lines.len(), 5, "{lines:?}\n{stderr}");
        for v in &lines {
            let again = v["key"] == "pay-2";
            assert_eq!(v["takeover"], again, "{v}");
            assert_eq!(v["attempt"], if again { 2 } else { 1 }, "{v}");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dead_letters_are_said_on_stderr_with_the_last_reason() {
        let Some(brokers) = server_url("IDEMQ_TEST_KAFKA_BROKERS") else {
            return;
        };
        let topic = create_topic(&brokers, "dlq", 1).await;
        let group = format!("{topic}-g");
        publish_payments(&brokers, &topic, 0..3).await;
        // 4 callbacks without a payment id: no dedup key, dead-lettered.
        let publisher = KafkaPublisher::connect(&KafkaProducerConfig::idempotent(&brokers))
            .await
            .expect("publisher");
        let bad = (0..4)
            .map(|i| OutgoingMessage::new(&topic, format!("{{\"amount\":{i}}}")))
            .collect();
        for r in publisher.publish_batch(bad).await {
            r.expect("confirmed");
        }
        let store = TempStore::new("dlq");
        let (lines, stderr) = consume_payments(&brokers, &topic, &group, &store).await;
        assert_eq!(lines.len(), 3, "{lines:?}\n{stderr}");
        assert!(
            stderr.contains("processed=3 duplicates_skipped=0 dead_lettered=4"),
            "{stderr}"
        );
        // Said as they happen (at most every 10 s) and at the end: 4 in all, with the reason.
        let notes: Vec<&str> = stderr
            .lines()
            .filter_map(|l| l.strip_prefix("idemq consume: dead-lettered "))
            .collect();
        let said: u64 = notes
            .iter()
            .map(|n| {
                n.split(' ')
                    .next()
                    .and_then(|c| c.parse::<u64>().ok())
                    .unwrap_or_else(|| panic!("no count in `{n}`"))
            })
            .sum();
        assert_eq!(said, 4, "{stderr}");
        assert!(
            notes.iter().all(|n| n.contains("; last reason: ")
                && n.contains("payload has no value at JSON pointer `/payment_id`")),
            "{stderr}"
        );
    }

    /// A running `idemq` whose stderr is collected as it comes.
    struct Running {
        child: tokio::process::Child,
        stderr: std::sync::Arc<std::sync::Mutex<String>>,
    }

    impl Running {
        fn start(args: &[&str]) -> Self {
            use tokio::io::AsyncBufReadExt;
            let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_idemq"))
                .args(args)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .kill_on_drop(true)
                .spawn()
                .expect("start idemq");
            let stderr = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
            let mut lines = tokio::io::BufReader::new(child.stderr.take().expect("stderr")).lines();
            let collected = stderr.clone();
            tokio::spawn(async move {
                while let Ok(Some(line)) = lines.next_line().await {
                    let mut all = collected.lock().unwrap_or_else(|e| e.into_inner());
                    all.push_str(&line);
                    all.push('\n');
                }
            });
            Self { child, stderr }
        }

        fn stderr(&self) -> String {
            self.stderr
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone()
        }

        /// The first stderr line that starts with `prefix`, waiting up to `limit` for it.
        async fn line_starting(&mut self, prefix: &str, limit: Duration) -> String {
            let until = tokio::time::Instant::now() + limit;
            loop {
                if let Some(l) = self.stderr().lines().find(|l| l.starts_with(prefix)) {
                    return l.to_string();
                }
                if let Ok(Some(status)) = self.child.try_wait() {
                    panic!(
                        "idemq exited ({status}) before saying `{prefix}`: {}",
                        self.stderr()
                    );
                }
                assert!(
                    tokio::time::Instant::now() < until,
                    "no `{prefix}` after {limit:?}: {}",
                    self.stderr()
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_static_member_killed_and_restarted_gets_its_partitions_back_at_once() {
        let Some(brokers) = server_url("IDEMQ_TEST_KAFKA_BROKERS") else {
            return;
        };
        let topic = create_topic(&brokers, "static", 2).await;
        let group = format!("{topic}-g");
        let store = TempStore::new("static");
        let (broker, store_url) = (format!("kafka://{brokers}/{topic}"), store.url());
        // A session of 5 minutes: a member that came back as a new, dynamic member would
        // wait that long for the killed one to be given up, far past this test's bounds.
        let args = |extra: &'static [&'static str]| {
            let mut v = vec![
                "consume",
                "--broker",
                &broker,
                "--store",
                &store_url,
                "--key",
                "json:/payment_id",
                "--group",
                &group,
                "--instance-id",
                "payments-1",
                "--session-timeout",
                "300",
            ];
            v.extend_from_slice(extra);
            v.into_iter().map(str::to_owned).collect::<Vec<String>>()
        };
        let first_args = args(&[]);
        let mut first = Running::start(&first_args.iter().map(String::as_str).collect::<Vec<_>>());
        let held = first
            .line_starting("idemq consume: ready: ", Duration::from_secs(60))
            .await;
        assert!(held.contains("assigned 2 partitions"), "{held}");
        first.child.kill().await.expect("SIGKILL the first run");
        publish_payments(&brokers, &topic, 0..10).await;
        let again_args = args(&["--idle-exit", IDLE_EXIT]);
        let again = idemq(
            &again_args.iter().map(String::as_str).collect::<Vec<_>>(),
            Duration::from_secs(120),
        )
        .await;
        let stdout = String::from_utf8_lossy(&again.stdout);
        let stderr = String::from_utf8_lossy(&again.stderr);
        assert!(again.status.success(), "{stderr}");
        let now_held = stderr
            .lines()
            .find(|l| l.starts_with("idemq consume: ready: "))
            .unwrap_or_else(|| panic!("never ready: {stderr}"));
        assert_eq!(now_held, held, "the same partitions, back: {stderr}");
        let keys: BTreeSet<String> = json_lines(&stdout)
            .iter()
            .filter_map(|v| v["key"].as_str().map(str::to_owned))
            .collect();
        assert_eq!(keys.len(), 10, "{stdout}\n{stderr}");
    }

    #[tokio::test]
    async fn an_unusable_instance_id_is_refused_with_the_rule() {
        let cfg = idemq::kafka::KafkaSourceConfig::new("127.0.0.1:1", "g", &["t"])
            .static_member("payments 1");
        let e = idemq::kafka::KafkaSource::connect(cfg)
            .await
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(e.contains("group.instance.id `payments 1`"), "{e}");
        assert!(e.contains("A-Z a-z 0-9 . _ -"), "{e}");
    }

    /// The role of a child process that joins a consumer group, holds its partitions
    /// without consuming, and waits to be SIGKILLed: a consumer that crashed without leaving.
    const MEMBER_ROLE: &str = "IDEMQ_CLI_TEST_GROUP_MEMBER";
    /// What the member prints on stderr once it holds partitions.
    const HOLDING: &str = "holding partitions";

    /// How long the coordinator waits for a member that stopped heartbeating before it
    /// gives the member's partitions to another (the member's session timeout). Longer than
    /// [`IDLE_EXIT`] by a margin a slow start cannot eat: an idle clock that counted the wait
    /// for partitions would end the run before any partition was assigned.
    const MEMBER_SESSION_MS: &str = "15000";

    /// The child's part: `brokers topic group` in its argument. Never returns.
    async fn hold_partitions(arg: &str) -> ! {
        let mut parts = arg.split(' ');
        let (Some(brokers), Some(topic), Some(group)) = (parts.next(), parts.next(), parts.next())
        else {
            panic!("member argument `{arg}` is not `brokers topic group`");
        };
        // Not the default 45 s, so the test does not wait that long for the coordinator to
        // give the dead member up.
        let cfg = idemq::kafka::KafkaSourceConfig::new(brokers, group, &[topic])
            .set("session.timeout.ms", MEMBER_SESSION_MS)
            .set("heartbeat.interval.ms", "1000");
        let source = idemq::kafka::KafkaSource::connect(cfg)
            .await
            .expect("member source");
        loop {
            let held = source.assigned();
            if !held.is_empty() {
                eprintln!("{HOLDING}: {held:?}");
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }

    /// A member of `group` on `topic`, run as a child process; returns once it holds
    /// partitions.
    fn start_member(test: &str, brokers: &str, topic: &str, group: &str) -> ChildProcess {
        let mut member =
            ChildProcess::spawn_self(test, MEMBER_ROLE, &format!("{brokers} {topic} {group}"))
                .expect("spawn the group member");
        let until = std::time::Instant::now() + Duration::from_secs(60);
        while !member.stderr_tail(4000).contains(HOLDING) {
            if let Ok(Some(status)) = member.try_wait() {
                panic!("member exited ({status}): {}", member.stderr_tail(4000));
            }
            assert!(
                std::time::Instant::now() < until,
                "member holds no partitions after 60 s: {}",
                member.stderr_tail(4000)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        member
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn idle_exit_counts_only_once_partitions_are_assigned() {
        if let Some(arg) = child_role(MEMBER_ROLE) {
            hold_partitions(&arg).await;
        }
        let Some(brokers) = server_url("IDEMQ_TEST_KAFKA_BROKERS") else {
            return;
        };
        let topic = create_topic(&brokers, "idle", 2).await;
        let group = format!("{topic}-g");
        publish_payments(&brokers, &topic, 0..30).await;
        // A consumer of the group crashes holding both partitions: until the coordinator
        // gives it up (its session timeout, well past the idle window), a restarted consumer
        // gets nothing.
        let mut member = start_member(
            "kafka::idle_exit_counts_only_once_partitions_are_assigned",
            &brokers,
            &topic,
            &group,
        );
        member.kill().expect("SIGKILL the member");
        let store = TempStore::new("idle");
        let out = idemq(
            &[
                "consume",
                "--broker",
                &format!("kafka://{brokers}/{topic}"),
                "--store",
                &store.url(),
                "--key",
                "json:/payment_id",
                "--group",
                &group,
                "--idle-exit",
                IDLE_EXIT,
            ],
            Duration::from_secs(120),
        )
        .await;
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        let keys: BTreeSet<String> = json_lines(&stdout)
            .iter()
            .filter_map(|v| v["key"].as_str().map(str::to_owned))
            .collect();
        assert_eq!(
            keys.len(),
            30,
            "--idle-exit must not count the wait for partitions:\n{stdout}\n{stderr}"
        );
        assert!(stderr.contains("processed=30"), "{stderr}");
        assert!(
            stderr.contains("waiting for partitions"),
            "the wait is said on stderr: {stderr}"
        );
    }
}
