//! Flow 3, Kafka → database exactly once, on the real broker and real PostgreSQL / MariaDB.
//!
//! 20 000 records (`IDEMQ_K2DB_MESSAGES` scales it) on a 4-partition topic are consumed by a
//! **real child process** (this test binary re-run with `IDEMQ_K2DB_CHILD`) whose handler
//! writes one effect row per record through idemq-sql's `LogToDatabase`: effect, dedup record and
//! the partition's next offset in one database transaction. The parent kills the child with
//! **SIGKILL** 5 times, each at a random point (a random effect count, then a random few
//! milliseconds more, so the kill lands mid-transaction, mid-batch or mid-rebalance), and
//! starts a new one; a last child runs until the stored offsets reach the end of the input.
//!
//! Every child joins under a **fresh Kafka consumer group**: Kafka holds no committed offset
//! for it, so every position it consumes from comes from the database (set on the
//! assignment by the source's rebalance callback). Then: the effect table (no unique
//! constraint, so a double would show) holds each key exactly once, and the stored offsets
//! equal each partition's high watermark; after every kill, the effect rows equal the sum of
//! the stored offsets (effects and positions only ever commit together: read in one statement,
//! as the dead child's last COMMIT may land after the kill). On a mismatch the message lists
//! the skipped offsets per partition and the child's stderr (the whole of it kept in a file).
//! Leases are 10 s and batches 50: on a 2-core machine shared with builds, 3 s leases and
//! batches of 200 (the heartbeat extends a batch's leases one statement each) ran out under
//! a slow MariaDB, cancelled handlers left statements running server-side, and their lock
//! waits (up to `innodb_lock_wait_timeout`) made the run crawl — a liveness matter; nothing
//! was lost or doubled.

mod support;

mod flow3 {
    use super::support;
    use idemq_core::engine::{ConsumerConfig, DeliveryOrder, RetryPolicy};
    use idemq_core::publish::{OutgoingMessage, Publisher};
    use idemq_core::testkit::process::ChildProcess;
    use idemq_core::ClaimedMessage;
    use idemq_kafka::rdkafka::consumer::{BaseConsumer, Consumer};
    use idemq_kafka::rdkafka::ClientConfig;
    use idemq_kafka::KafkaSource;
    use idemq_sql::{
        Kind, LogToDatabase, MySqlStore, PgStore, SourceOffsets, SqlBackend, SqlStore,
        SqlStoreOptions, TableName, Val,
    };
    use std::collections::BTreeMap;
    use std::time::Duration;
    use tokio::time::Instant;

    const CHILD_ENV: &str = "IDEMQ_K2DB_CHILD";
    const KILLS: usize = 5;
    const PARTITIONS: i32 = 4;

    fn messages() -> usize {
        std::env::var("IDEMQ_K2DB_MESSAGES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(20_000)
    }

    fn url(var: &str) -> Option<String> {
        idemq_core::testkit::servers::server_url(var)
    }

    /// A pseudo-random number (no rand dependency needed for kill points).
    fn random(below: u64) -> u64 {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or_default(),
        );
        h.finish() % below.max(1)
    }

    /// Names of one run, shared by the parent and its children.
    #[derive(Debug, Clone)]
    struct Run {
        topic: String,
        effects: String,
        dedup: String,
        offsets: String,
        ends: BTreeMap<i32, i64>,
    }

    impl Run {
        fn encode(&self) -> String {
            let ends: Vec<String> = self.ends.iter().map(|(p, o)| format!("{p}:{o}")).collect();
            format!(
                "{}|{}|{}|{}|{}",
                self.topic,
                self.effects,
                self.dedup,
                self.offsets,
                ends.join(",")
            )
        }

        fn decode(s: &str) -> Self {
            let f: Vec<&str> = s.split('|').collect();
            assert_eq!(f.len(), 5, "bad {CHILD_ENV}: {s}");
            let ends = f[4]
                .split(',')
                .filter(|x| !x.is_empty())
                .map(|x| {
                    let (p, o) = x.split_once(':').expect("p:o");
                    (p.parse().expect("partition"), o.parse().expect("offset"))
                })
                .collect();
            Self {
                topic: f[0].into(),
                effects: f[1].into(),
                dedup: f[2].into(),
                offsets: f[3].into(),
                ends,
            }
        }

        /// The logical group the offsets are stored under (each child's Kafka group differs).
        fn group(&self) -> String {
            format!("{}-flow3", self.topic)
        }
    }

    async fn flow<DB: SqlBackend>(store: SqlStore<DB>, run: &Run) -> LogToDatabase<DB> {
        let offsets = SourceOffsets::from_pool(
            store.pool().clone(),
            Some(TableName::new(&run.offsets).expect("table")),
        )
        .await
        .expect("offsets table");
        LogToDatabase::with_offsets(store, offsets, &run.group())
    }

    async fn scalar<DB: SqlBackend>(store: &SqlStore<DB>, sql: &str) -> i64 {
        let mut conn = store.pool().acquire().await.expect("conn");
        let rows = DB::fetch(&mut conn, sql, vec![], &[Kind::I64])
            .await
            .expect(sql);
        rows[0].i64(0).expect("count")
    }

    async fn scalar2<DB: SqlBackend>(store: &SqlStore<DB>, sql: &str) -> (i64, i64) {
        let mut conn = store.pool().acquire().await.expect("conn");
        let rows = DB::fetch(&mut conn, sql, vec![], &[Kind::I64, Kind::I64])
            .await
            .expect(sql);
        (
            rows[0].i64(0).expect("first"),
            rows[0].i64(1).expect("second"),
        )
    }

    async fn stored<DB: SqlBackend>(flow: &LogToDatabase<DB>) -> BTreeMap<i32, i64> {
        flow.offsets()
            .load_group(flow.group())
            .await
            .expect("stored offsets")
            .into_iter()
            .map(|s| (s.partition, s.next_offset))
            .collect()
    }

    /// The child: consume with Flow 3 until the stored offsets reach the end, then exit 0
    /// (unless SIGKILLed first).
    async fn child<DB: SqlBackend>(store: SqlStore<DB>, run: Run, brokers: String) -> ! {
        // The parent shows this stderr when a check fails.
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(
                "warn,idemq_kafka=info,idemq_core=info",
            ))
            .with_writer(std::io::stderr)
            .try_init();
        let flow = flow(store.clone(), &run).await;
        let kafka_group = format!("{}-child-{:08x}", run.topic, random(u64::from(u32::MAX)));
        let cfg = support::source_config(&brokers, &kafka_group, &run.topic)
            .offsets_from(flow.offset_store().expect("offset store"));
        let mut source = KafkaSource::connect(cfg).await.expect("source");
        drop(store);
        let insert = DB::DIALECT.placeholders(format!(
            "INSERT INTO {} (msg_key, part, off) VALUES (?, ?, ?)",
            run.effects
        ));
        let handler_flow = flow.clone();
        let consumer = flow
            .consumer(
                move |m: ClaimedMessage| {
                    let flow = handler_flow.clone();
                    let insert = insert.clone();
                    async move {
                        let mut tx = flow.begin(&m).await?;
                        let (_, part, off) = tx.position();
                        DB::execute(
                            &mut *tx,
                            &insert,
                            vec![
                                Val::Text(Some(m.key.as_str().to_owned())),
                                Val::I64(Some(i64::from(part))),
                                Val::I64(Some(off)),
                            ],
                        )
                        .await
                        .map_err(idemq_sql::handler_error)?;
                        tx.commit().await
                    }
                },
                ConsumerConfig {
                    max_batch: 50,
                    max_concurrency: 8,
                    ordering: DeliveryOrder::PerPartition,
                    lease: Duration::from_secs(10),
                    retry: RetryPolicy::fixed(Duration::from_millis(100)),
                    redelivery_delay: Duration::from_millis(200),
                    in_flight_delay_max: Duration::from_millis(500),
                    ..ConsumerConfig::default()
                },
            )
            .expect("Flow 3 engine");
        let ends = run.ends.clone();
        let watch = flow.clone();
        let done = async move {
            loop {
                if stored(&watch).await == ends {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        };
        consumer.run(&mut source, done).await.expect("consumer run");
        std::process::exit(0)
    }

    async fn publish(brokers: &str, topic: &str, n: usize) {
        let p = support::publisher(brokers).await;
        let msgs: Vec<OutgoingMessage> = (0..n)
            .map(|i| {
                OutgoingMessage::new(topic, format!("{{\"n\":{i}}}"))
                    .with_key(format!("entity-{}", i % 97))
                    .with_dedup_key(format!("k-{i:06}"))
            })
            .collect();
        for chunk in msgs.chunks(2_000) {
            for r in p.publish_batch(chunk.to_vec()).await {
                r.expect("publish");
            }
        }
    }

    fn high_watermarks(brokers: &str, topic: &str) -> BTreeMap<i32, i64> {
        let c: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .set("group.id", support::unique("k2db-wm"))
            .create()
            .expect("watermark client");
        (0..PARTITIONS)
            .map(|p| {
                let (_, high) = c
                    .fetch_watermarks(topic, p, Duration::from_secs(10))
                    .expect("watermarks");
                (p, high)
            })
            .collect()
    }

    fn spawn_child(backend: &str, test: &str, run: &Run) -> ChildProcess {
        ChildProcess::spawn_self(test, CHILD_ENV, &format!("{backend}|{}", run.encode()))
            .expect("spawn child")
    }

    /// The child's whole stderr is kept in a file (named in the message) and its tail is
    /// shown.
    fn child_log(child: &ChildProcess, backend: &str, k: usize) -> String {
        let all = child.stderr_tail(usize::MAX);
        let path = std::env::temp_dir().join(format!(
            "idemq-k2db-{backend}-child{k}-{}.log",
            std::process::id()
        ));
        let kept = match std::fs::write(&path, &all) {
            Ok(()) => format!("(whole log: {})", path.display()),
            Err(e) => format!("(whole log not kept: {e})"),
        };
        let tail: String = all
            .char_indices()
            .rev()
            .nth(16_000)
            .map_or(all.as_str(), |(i, _)| &all[i..])
            .to_string();
        format!("{kept}\n{tail}")
    }

    /// Which offsets below each partition's stored offset have no effect row (the records
    /// a restart would skip), as `partition: [first..last] (count)` runs.
    async fn gaps<DB: SqlBackend>(
        store: &SqlStore<DB>,
        run: &Run,
        stored: &BTreeMap<i32, i64>,
    ) -> String {
        let mut conn = store.pool().acquire().await.expect("conn");
        let mut out = Vec::new();
        for (p, next) in stored {
            let rows = DB::fetch(
                &mut conn,
                &format!(
                    "SELECT off FROM {} WHERE part = {p} AND off < {next} ORDER BY off",
                    run.effects
                ),
                vec![],
                &[Kind::I64],
            )
            .await
            .expect("effect offsets");
            let have: std::collections::BTreeSet<i64> =
                rows.iter().map(|r| r.i64(0).expect("off")).collect();
            let mut runs: Vec<(i64, i64)> = Vec::new();
            for o in (0..*next).filter(|o| !have.contains(o)) {
                match runs.last_mut() {
                    Some((_, last)) if *last + 1 == o => *last = o,
                    _ => runs.push((o, o)),
                }
            }
            if !runs.is_empty() {
                let n: i64 = runs.iter().map(|(a, b)| b - a + 1).sum();
                out.push(format!("p{p} (stored {next}): {n} missing in {runs:?}"));
            }
        }
        out.join("; ")
    }

    /// The parent: publish, kill five children at random points, let a sixth finish, check.
    async fn parent<DB: SqlBackend>(store: SqlStore<DB>, backend: &str, test: &str) {
        let Some(brokers) = support::brokers() else {
            return;
        };
        let started = std::time::Instant::now();
        let n = messages();
        let topic = support::unique(&format!("k2db-{backend}"));
        let suffix = topic.replace('-', "_");
        support::create_topic(&brokers, &topic, PARTITIONS).await;
        publish(&brokers, &topic, n).await;
        let ends = high_watermarks(&brokers, &topic);
        assert_eq!(ends.values().sum::<i64>(), n as i64, "records on the topic");
        let run = Run {
            effects: format!("{suffix}_fx"),
            dedup: format!("{suffix}_dd"),
            offsets: format!("{suffix}_off"),
            topic,
            ends: ends.clone(),
        };
        let id = match DB::DIALECT {
            idemq_sql::Dialect::MySql => "id BIGINT AUTO_INCREMENT PRIMARY KEY",
            _ => "id BIGSERIAL PRIMARY KEY",
        };
        {
            let mut conn = store.pool().acquire().await.expect("conn");
            DB::execute(
                &mut conn,
                &format!(
                    "CREATE TABLE {} ({id}, msg_key VARCHAR(300) NOT NULL, part BIGINT NOT NULL, \
                     off BIGINT NOT NULL)",
                    run.effects
                ),
                vec![],
            )
            .await
            .expect("effect table");
        }
        let flow = flow(store.clone(), &run).await;
        let count_sql = format!("SELECT COUNT(*) FROM {}", run.effects);
        let sum_type = match DB::DIALECT {
            idemq_sql::Dialect::MySql => "SIGNED",
            _ => "BIGINT",
        };
        let consistent_sql = format!(
            "SELECT (SELECT COUNT(*) FROM {}), (SELECT CAST(COALESCE(SUM(next_offset), 0) AS \
             {sum_type}) FROM {} WHERE consumer_group = '{}')",
            run.effects,
            run.offsets,
            run.group()
        );
        eprintln!(
            "[{backend}] {n} records published in {:?}",
            started.elapsed()
        );

        let mut kill_counts = Vec::new();
        for k in 0..KILLS {
            let mut child = spawn_child(backend, test, &run);
            // A random effect count in this child's slice of the run, then a random few ms.
            let slice = n as u64 / (KILLS as u64 + 2);
            let target = (slice * (k as u64 + 1) + random(slice)) as i64;
            let deadline = Instant::now() + Duration::from_secs(180);
            while scalar(&store, &count_sql).await < target {
                assert!(
                    Instant::now() < deadline,
                    "child {k} made no progress to {target}: {} effects\n--- child stderr (tail) \
                     ---\n{}",
                    scalar(&store, &count_sql).await,
                    child_log(&child, backend, k)
                );
                if let Ok(Some(status)) = child.try_wait() {
                    panic!(
                        "child {k} exited early: {status}\n--- child stderr (tail) ---\n{}",
                        child_log(&child, backend, k)
                    );
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            tokio::time::sleep(Duration::from_millis(random(300))).await;
            let status = child.kill().expect("SIGKILL"); // std's kill is SIGKILL on Unix
                                                         // One statement, one snapshot: the dead child's last COMMIT may still be landing
                                                         // (sent before the kill, applied by the server after it), so two separate reads
                                                         // of the effects and the offsets can straddle it.
            let (at, offsets_sum) = scalar2(&store, &consistent_sql).await;
            let now = stored(&flow).await;
            eprintln!(
                "[{backend}] kill {}: child SIGKILLed ({status}) at {at} effects, stored {now:?}",
                k + 1
            );
            // Effects and positions committed together, a partition's records in order: each
            // partition's stored offset counts exactly its effects, at every crash.
            if at != offsets_sum {
                panic!(
                    "effects vs stored offsets after kill {}: {at} effects, offsets sum to \
                     {offsets_sum} (now {now:?})\n\
                     skipped records: {}\n--- child stderr (tail) ---\n{}",
                    k + 1,
                    gaps(&store, &run, &now).await,
                    child_log(&child, backend, k)
                );
            }
            kill_counts.push(at);
        }

        let mut last = spawn_child(backend, test, &run);
        let deadline = Instant::now() + Duration::from_secs(300);
        let status = loop {
            if let Some(s) = last.try_wait().expect("wait") {
                break s;
            }
            if Instant::now() > deadline {
                let _ = last.kill();
                let now = stored(&flow).await;
                panic!(
                    "the last child did not finish the run: stored {now:?}, ends {ends:?}\n\
                     skipped records: {}\n--- child stderr (tail) ---\n{}",
                    gaps(&store, &run, &now).await,
                    child_log(&last, backend, KILLS)
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert!(
            status.success(),
            "last child: {status}\n--- child stderr (tail) ---\n{}",
            child_log(&last, backend, KILLS)
        );

        let total = scalar(&store, &count_sql).await;
        let distinct = scalar(
            &store,
            &format!("SELECT COUNT(DISTINCT msg_key) FROM {}", run.effects),
        )
        .await;
        let doubled = scalar(
            &store,
            &format!(
                "SELECT COUNT(*) FROM (SELECT msg_key FROM {} GROUP BY msg_key \
                 HAVING COUNT(*) > 1) d",
                run.effects
            ),
        )
        .await;
        let final_offsets = stored(&flow).await;
        eprintln!(
            "[{backend}] done in {:?}: kills at {kill_counts:?}, effects {total}, distinct \
             {distinct}, doubled {doubled}, stored {final_offsets:?}, ends {ends:?}",
            started.elapsed()
        );
        assert_eq!(
            (total, distinct, doubled),
            (n as i64, n as i64, 0),
            "each key exactly once"
        );
        assert_eq!(final_offsets, ends, "stored offsets = end of the input");
        // Greatest wins: a late, older transaction never moves an offset back.
        let mut tx = store.pool().begin().await.expect("begin");
        flow.offsets()
            .advance_in_tx(&mut tx, flow.group(), &run.topic, 0, 1)
            .await
            .expect("late advance");
        tx.commit().await.expect("commit");
        assert_eq!(
            stored(&flow).await,
            ends,
            "an older offset moved the stored one back"
        );
        let run_opts = options(&run.dedup);
        let run_keys = run_opts.keys_table().expect("keys table");
        for t in [
            run.effects.as_str(),
            run.dedup.as_str(),
            run_keys.as_str(),
            run.offsets.as_str(),
            store.table().as_str(),
            store.keys_table().as_str(),
        ] {
            let mut conn = store.pool().acquire().await.expect("conn");
            let _ = DB::execute(&mut conn, &format!("DROP TABLE IF EXISTS {t}"), vec![]).await;
        }
    }

    fn options(run_dedup: &str) -> SqlStoreOptions {
        SqlStoreOptions::with_table(TableName::new(run_dedup).expect("dedup table"))
    }

    /// In a child process: run the child of `backend` and never return.
    async fn maybe_child(backend: &str) {
        let Ok(spec) = std::env::var(CHILD_ENV) else {
            return;
        };
        let Some((b, rest)) = spec.split_once('|') else {
            return;
        };
        if b != backend {
            return;
        }
        let run = Run::decode(rest);
        let brokers = support::brokers().expect("brokers in the child");
        match backend {
            "pg" => {
                let u = url("IDEMQ_TEST_POSTGRES_URL").expect("pg url");
                let s = PgStore::connect(&u, options(&run.dedup)).await.expect("pg");
                child(s, run, brokers).await
            }
            _ => {
                let u = url("IDEMQ_TEST_MYSQL_URL").expect("mysql url");
                let s = MySqlStore::connect(&u, options(&run.dedup))
                    .await
                    .expect("mysql");
                child(s, run, brokers).await
            }
        }
    }

    /// The parent's own pool gets a throwaway dedup table (dropped at the end); the
    /// children's dedup table is named after the run's topic.
    fn parent_options() -> SqlStoreOptions {
        options(&format!("k2db_parent_{:08x}", random(u64::from(u32::MAX))))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn postgres_flow3_survives_five_sigkills_with_each_key_once_and_offsets_at_the_end() {
        maybe_child("pg").await;
        let Some(u) = url("IDEMQ_TEST_POSTGRES_URL") else {
            return;
        };
        let store = PgStore::connect(&u, parent_options()).await.expect("pg");
        parent(
            store,
            "pg",
            "flow3::postgres_flow3_survives_five_sigkills_with_each_key_once_and_offsets_at_the_end",
        )
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn mariadb_flow3_survives_five_sigkills_with_each_key_once_and_offsets_at_the_end() {
        maybe_child("my").await;
        let Some(u) = url("IDEMQ_TEST_MYSQL_URL") else {
            return;
        };
        let store = MySqlStore::connect(&u, parent_options())
            .await
            .expect("mysql");
        parent(
            store,
            "my",
            "flow3::mariadb_flow3_survives_five_sigkills_with_each_key_once_and_offsets_at_the_end",
        )
        .await;
    }
}
