//! `LogToDatabase` on the real databases (SQLite always; PostgreSQL and MariaDB when their
//! URLs are set): a message's effect, its dedup record and its partition's next offset commit
//! together; a lost lease rolls back the effect *and* the offset and asks for a retry; a
//! message with no partition offset is refused for good; and the group's stored offsets
//! answer a source's assignment from a thread outside the runtime.
//!
//! Kafka's flow 3 end to end (a real broker, SIGKILLed consumers) is
//! `adapters/kafka/tests/kafka_to_database.rs`.

mod support;

use idemq_core::adapter::{OffsetStore, PartitionId};
use idemq_core::envelope::{Position, SourceRef};
use idemq_core::{
    ClaimedMessage, ConsumerGroup, DedupKey, DedupStore, Envelope, FencingToken, HandlerError,
    RecordStatus,
};
use idemq_sql::{
    Kind, LeaseLost, LogToDatabase, NoLogPosition, SqlBackend, SqlStore, TableName, Val,
};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

const TOPIC: &str = "payments";

fn key(name: &str) -> DedupKey {
    let g = ConsumerGroup::new("log-to-db").expect("group");
    DedupKey::new(&g, &support::unique(name)).expect("key")
}

/// A claimed message of `TOPIC`, partition 2, at `position`.
fn message(
    key: DedupKey,
    token: FencingToken,
    partition: Option<i32>,
    position: Option<Position>,
) -> ClaimedMessage {
    let mut env = Envelope::new(idemq_core::BrokerKind::MEMORY, TOPIC, "{}");
    env.source = SourceRef {
        cluster: None,
        name: TOPIC.into(),
        partition,
        position,
    };
    let (_, watch) = idemq_core::handler::LeaseWatch::pair();
    ClaimedMessage::new(Arc::new(env), key, token, 1, false, watch)
        .with_retention(Duration::from_secs(60))
}

/// One run's tables: the effects, the offsets (a fresh table), the group.
struct Run<DB: SqlBackend> {
    flow: LogToDatabase<DB>,
    effects: String,
}

impl<DB: SqlBackend> Run<DB> {
    async fn new(store: SqlStore<DB>) -> Self {
        let effects = support::unique("ltd_fx");
        let offsets = idemq_sql::SourceOffsets::from_pool(
            store.pool().clone(),
            Some(TableName::new(&support::unique("ltd_off")).expect("table")),
        )
        .await
        .expect("offsets table");
        let mut conn = store.pool().acquire().await.expect("conn");
        DB::execute(
            &mut conn,
            &format!("CREATE TABLE {effects} (msg_key VARCHAR(300) NOT NULL)"),
            vec![],
        )
        .await
        .expect("effect table");
        let group = support::unique("billing");
        Self {
            flow: LogToDatabase::with_offsets(store, offsets, &group),
            effects,
        }
    }

    /// The effect of `m`, through its `OffsetTx`, then its commit.
    async fn apply(&self, m: &ClaimedMessage) -> Result<(), HandlerError> {
        let mut tx = self.flow.begin(m).await?;
        DB::execute(
            &mut *tx,
            &DB::DIALECT.placeholders(format!("INSERT INTO {} (msg_key) VALUES (?)", self.effects)),
            vec![Val::Text(Some(m.key.as_str().to_owned()))],
        )
        .await
        .map_err(idemq_sql::handler_error)?;
        tx.commit().await.map(|_| ())
    }

    async fn effects(&self) -> i64 {
        let mut conn = self.flow.store().pool().acquire().await.expect("conn");
        let rows = DB::fetch(
            &mut conn,
            &format!("SELECT COUNT(*) FROM {}", self.effects),
            vec![],
            &[Kind::I64],
        )
        .await
        .expect("count");
        rows[0].i64(0).expect("count")
    }

    async fn stored(&self, partition: i32) -> Option<i64> {
        self.flow
            .offsets()
            .load(self.flow.group(), TOPIC, partition)
            .await
            .expect("load offset")
    }

    async fn drop_tables(self) {
        let mut conn = self.flow.store().pool().acquire().await.expect("conn");
        for t in [self.effects.as_str(), self.flow.offsets().table().as_str()] {
            let _ = DB::execute(&mut conn, &format!("DROP TABLE {t}"), vec![]).await;
        }
    }
}

async fn an_offset_commits_with_its_effect_and_its_dedup_record<DB: SqlBackend>(
    store: SqlStore<DB>,
) {
    let run = Run::new(store.clone()).await;
    let k = key("ok");
    let token = support::claim(&store, &k).await;
    let m = message(k.clone(), token, Some(2), Some(Position::Offset(41)));
    let tx = run.flow.begin(&m).await.expect("begin");
    assert_eq!(tx.position(), (TOPIC, 2, 41));
    assert_eq!(tx.key(), &k);
    drop(tx); // dropped open: nothing kept
    assert_eq!(
        run.stored(2).await,
        None,
        "a dropped transaction stores nothing"
    );
    run.apply(&m).await.expect("commit");
    assert_eq!(run.effects().await, 1);
    assert_eq!(
        run.stored(2).await,
        Some(42),
        "one past the message's offset"
    );
    let rec = store.get(&k).await.expect("get").expect("record");
    assert_eq!(rec.status, RecordStatus::Completed);
    // A queue offset (RocketMQ) is recorded the same way.
    let q = key("queue");
    let token = support::claim(&store, &q).await;
    run.apply(&message(q, token, Some(5), Some(Position::QueueOffset(9))))
        .await
        .expect("commit a queue offset");
    assert_eq!(run.stored(5).await, Some(10));
    run.drop_tables().await;
}

async fn a_lost_lease_rolls_back_the_effect_and_the_offset<DB: SqlBackend>(store: SqlStore<DB>) {
    let run = Run::new(store.clone()).await;
    let k = key("fenced");
    support::claim(&store, &k).await;
    // A token that does not own the key: another worker holds it now.
    let m = message(
        k.clone(),
        FencingToken::random(),
        Some(2),
        Some(Position::Offset(41)),
    );
    let e = run.apply(&m).await.expect_err("fenced");
    match &e {
        HandlerError::Retryable(src) => {
            assert!(src.downcast_ref::<LeaseLost>().is_some(), "{e}")
        }
        other => panic!("expected a retryable LeaseLost, got {other:?}"),
    }
    assert_eq!(run.effects().await, 0, "the effect was rolled back");
    assert_eq!(run.stored(2).await, None, "the offset was rolled back");
    let rec = store.get(&k).await.expect("get").expect("record");
    assert_eq!(rec.status, RecordStatus::InProgress, "still the owner's");
    run.drop_tables().await;
}

async fn a_message_without_a_partition_offset_is_refused_for_good<DB: SqlBackend>(
    store: SqlStore<DB>,
) {
    let run = Run::new(store.clone()).await;
    for (partition, position) in [
        (None, Some(Position::Offset(41))),
        (Some(2), None),
        (Some(2), Some(Position::DeliveryTag(7))),
    ] {
        let k = key("nopos");
        let token = support::claim(&store, &k).await;
        let e = run
            .apply(&message(k, token, partition, position))
            .await
            .expect_err("no position");
        match &e {
            HandlerError::Permanent(src) => {
                assert!(src.downcast_ref::<NoLogPosition>().is_some(), "{e}");
                assert!(e.to_string().contains("no partition and offset"), "{e}");
            }
            other => panic!("expected a permanent NoLogPosition, got {other:?}"),
        }
    }
    assert_eq!(run.effects().await, 0);
    run.drop_tables().await;
}

async fn the_group_offsets_answer_an_assignment<DB: SqlBackend>(store: SqlStore<DB>) {
    let run = Run::new(store.clone()).await;
    let k = key("assign");
    let token = support::claim(&store, &k).await;
    run.apply(&message(k, token, Some(2), Some(Position::Offset(41))))
        .await
        .expect("commit");
    let offsets = run.flow.offset_store().expect("inside a runtime");
    assert_eq!(offsets.group(), run.flow.group());
    // Asked as a client's rebalance callback asks: from a thread of its own.
    let asked: Vec<PartitionId> = vec![(TOPIC.into(), 2), (TOPIC.into(), 3)];
    let found = tokio::task::spawn_blocking(move || offsets.positions(&asked))
        .await
        .expect("join")
        .expect("positions");
    assert_eq!(found, HashMap::from([((TOPIC.to_string(), 2), 42)]));
    // Outside a runtime there is nothing to run the query on: a clear Config error.
    let flow = run.flow.clone();
    let outside = std::thread::spawn(move || flow.offset_store().map(|_| ()))
        .join()
        .expect("join");
    assert!(
        matches!(&outside, Err(idemq_core::StoreError::Config(m)) if m.contains("Tokio runtime")),
        "{outside:?}"
    );
    run.drop_tables().await;
}

/// One test per scenario above, on the store `$store` evaluates to (`None`: skipped).
macro_rules! scenarios {
    ($store:expr) => {
        scenarios!($store;
            an_offset_commits_with_its_effect_and_its_dedup_record,
            a_lost_lease_rolls_back_the_effect_and_the_offset,
            a_message_without_a_partition_offset_is_refused_for_good,
            the_group_offsets_answer_an_assignment);
    };
    ($store:expr; $($scenario:ident),*) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $scenario() {
            let Some((_dir, store)) = $store else { return };
            super::$scenario(store).await;
        }
    )*};
    // A server's store (no directory to keep), or `None` when its URL is not set.
    ($store:ty, $url:expr) => {
        async fn store() -> Option<((), $store)> {
            let store = <$store>::connect(&$url?, super::support::options("idemq_ltd", 4))
                .await
                .expect("connect");
            Some(((), store))
        }
        scenarios!(store().await);
    };
}

#[cfg(feature = "sqlite")]
mod sqlite {
    async fn store() -> Option<(super::support::TempDir, idemq_sql::SqliteStore)> {
        let dir = super::support::TempDir::new();
        let store = idemq_sql::SqliteStore::connect(
            &dir.sqlite_url("ltd.db"),
            super::support::options("idemq_ltd", 4),
        )
        .await
        .expect("sqlite");
        Some((dir, store))
    }
    scenarios!(store().await);
}

#[cfg(feature = "postgres")]
mod postgres {
    scenarios!(idemq_sql::PgStore, super::support::postgres_url());
}

#[cfg(feature = "mysql")]
mod mysql {
    scenarios!(idemq_sql::MySqlStore, super::support::mysql_url());
}
