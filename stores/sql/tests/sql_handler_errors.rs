//! Handler ergonomics on the real databases: `.classify()?` retries what a retry can fix
//! (a serialization failure) and dead-letters what it cannot (a unique violation, a syntax
//! error); `begin_for` / `commit` completes a message in the business transaction, and a
//! lost lease rolls the effect back.

mod support;

use idemq_core::{
    ClaimOutcome, ClaimRequest, ClaimedMessage, ConsumerGroup, DedupKey, DedupStore, Envelope,
    FencingToken, HandlerError, RecordStatus,
};
use idemq_sql::{handler_error, sqlx, LeaseLost, SqlResultExt};
use std::sync::Arc;
use std::time::Duration;

fn key(name: &str) -> DedupKey {
    let g = ConsumerGroup::new("handler-errors").expect("group");
    DedupKey::new(&g, &support::unique(name)).expect("key")
}

fn message(key: DedupKey, token: FencingToken) -> ClaimedMessage {
    let env = Arc::new(Envelope::new(
        idemq_core::BrokerKind::MEMORY,
        "payments",
        "{}",
    ));
    let (_, watch) = idemq_core::handler::LeaseWatch::pair();
    ClaimedMessage::new(env, key, token, 1, false, watch).with_retention(Duration::from_secs(60))
}

#[cfg(feature = "postgres")]
mod postgres {
    use super::*;
    use idemq_sql::PgStore;

    async fn store() -> Option<PgStore> {
        let url = support::postgres_url()?;
        Some(
            PgStore::connect(&url, support::options("idemq_handler_errors", 4))
                .await
                .expect("connect"),
        )
    }

    #[tokio::test]
    async fn a_unique_violation_is_permanent_and_a_syntax_error_too() {
        let Some(store) = store().await else { return };
        let t = support::unique("hx_unique");
        sqlx::query(&format!("CREATE TABLE {t} (id TEXT PRIMARY KEY)"))
            .execute(store.pool())
            .await
            .expect("create");
        let insert = format!("INSERT INTO {t} (id) VALUES ('a')");
        sqlx::query(&insert)
            .execute(store.pool())
            .await
            .expect("first");
        let dup = sqlx::query(&insert).execute(store.pool()).await.classify();
        assert!(matches!(dup, Err(HandlerError::Permanent(_))), "{dup:?}");
        let syntax = sqlx::query("SELEKT 1")
            .execute(store.pool())
            .await
            .classify();
        assert!(
            matches!(syntax, Err(HandlerError::Permanent(_))),
            "{syntax:?}"
        );
        let _ = sqlx::query(&format!("DROP TABLE {t}"))
            .execute(store.pool())
            .await;
    }

    #[tokio::test]
    async fn a_serialization_failure_is_retryable() {
        let Some(store) = store().await else { return };
        let t = support::unique("hx_serial");
        sqlx::query(&format!("CREATE TABLE {t} (g INT NOT NULL)"))
            .execute(store.pool())
            .await
            .expect("create");
        // Write skew: each transaction reads the group, then inserts into it.
        let mut a = store.pool().begin().await.expect("begin a");
        let mut b = store.pool().begin().await.expect("begin b");
        for tx in [&mut a, &mut b] {
            sqlx::query("SET TRANSACTION ISOLATION LEVEL SERIALIZABLE")
                .execute(&mut **tx)
                .await
                .expect("serializable");
            sqlx::query(&format!("SELECT COUNT(*) FROM {t} WHERE g = 1"))
                .execute(&mut **tx)
                .await
                .expect("read");
        }
        let ins = format!("INSERT INTO {t} (g) VALUES (1)");
        sqlx::query(&ins).execute(&mut *a).await.expect("a writes");
        a.commit().await.expect("a commits");
        let b_result = match sqlx::query(&ins).execute(&mut *b).await {
            Ok(_) => b.commit().await,
            Err(e) => Err(e),
        };
        let err = b_result.expect_err("b must fail to serialize");
        assert!(
            matches!(handler_error(err), HandlerError::Retryable(_)),
            "40001 is retryable"
        );
        let _ = sqlx::query(&format!("DROP TABLE {t}"))
            .execute(store.pool())
            .await;
    }

    #[tokio::test]
    async fn commit_completes_with_the_messages_key_token_and_retention() {
        let Some(store) = store().await else { return };
        let k = key("tx-ok");
        let ClaimOutcome::Acquired(lease) = store
            .claim(&ClaimRequest::new(k.clone(), Duration::from_secs(30)))
            .await
            .expect("claim")
        else {
            panic!("fresh key");
        };
        let msg = message(k.clone(), lease.token);
        let tx = store.begin_for(&msg).await.expect("begin");
        assert_eq!(tx.key(), &k);
        let r = tx
            .commit_with(Some("receipt".into()))
            .await
            .expect("commit");
        assert_eq!(r.as_deref(), Some(&b"receipt"[..]));
        let rec = store.get(&k).await.expect("get").expect("record");
        assert_eq!(rec.status, RecordStatus::Completed);
        assert_eq!(rec.result.as_deref(), Some(&b"receipt"[..]));
    }

    #[tokio::test]
    async fn a_lost_lease_rolls_the_effect_back_and_asks_for_a_retry() {
        let Some(store) = store().await else { return };
        let t = support::unique("hx_fenced");
        sqlx::query(&format!("CREATE TABLE {t} (id TEXT)"))
            .execute(store.pool())
            .await
            .expect("create");
        let k = key("tx-fenced");
        let ClaimOutcome::Acquired(_) = store
            .claim(&ClaimRequest::new(k.clone(), Duration::from_secs(30)))
            .await
            .expect("claim")
        else {
            panic!("fresh key");
        };
        // A token that does not own the key: another worker holds it now.
        let msg = message(k.clone(), FencingToken::random());
        let mut tx = store.begin_for(&msg).await.expect("begin");
        sqlx::query(&format!("INSERT INTO {t} (id) VALUES ('effect')"))
            .execute(&mut *tx)
            .await
            .expect("effect");
        let e = tx.commit().await.expect_err("fenced");
        match &e {
            HandlerError::Retryable(src) => {
                assert!(src.downcast_ref::<LeaseLost>().is_some(), "{e}")
            }
            other => panic!("expected a retryable LeaseLost, got {other:?}"),
        }
        // The error says the attempt left nothing behind (the transaction was rolled back).
        assert!(
            e.to_string().contains("nothing of this attempt kept"),
            "{e}"
        );
        let (n,): (i64,) = sqlx::query_as(&format!("SELECT COUNT(*) FROM {t}"))
            .fetch_one(store.pool())
            .await
            .expect("count");
        assert_eq!(n, 0, "the effect was rolled back");
        let rec = store.get(&k).await.expect("get").expect("record");
        assert_eq!(rec.status, RecordStatus::InProgress, "still the owner's");
        let _ = sqlx::query(&format!("DROP TABLE {t}"))
            .execute(store.pool())
            .await;
    }
}

#[cfg(feature = "mysql")]
mod mysql {
    use super::*;
    use idemq_sql::MySqlStore;

    #[tokio::test]
    async fn a_unique_violation_is_permanent() {
        let Some(url) = support::mysql_url() else {
            return;
        };
        let store = MySqlStore::connect(&url, support::options("idemq_handler_errors", 2))
            .await
            .expect("connect");
        let t = support::unique("hx_unique");
        sqlx::query(&format!("CREATE TABLE {t} (id VARCHAR(10) PRIMARY KEY)"))
            .execute(store.pool())
            .await
            .expect("create");
        let insert = format!("INSERT INTO {t} (id) VALUES ('a')");
        sqlx::query(&insert)
            .execute(store.pool())
            .await
            .expect("first");
        let dup = sqlx::query(&insert).execute(store.pool()).await.classify();
        assert!(matches!(dup, Err(HandlerError::Permanent(_))), "{dup:?}");
        let _ = sqlx::query(&format!("DROP TABLE {t}"))
            .execute(store.pool())
            .await;
    }

    /// A one-connection store: whatever a cut-off call leaves on its connection, the next
    /// call meets it.
    async fn one_connection_store() -> Option<MySqlStore> {
        let url = support::mysql_url()?;
        Some(
            MySqlStore::connect(&url, support::options("idemq_handler_cutoff", 1))
                .await
                .expect("connect"),
        )
    }

    /// The engine cuts a handler off (drops its future) when its lease is lost: the
    /// transaction dropped mid-statement must end with nothing of it kept, and the pool's
    /// next user must get its own answers (sqlx cannot resume a MySQL connection dropped
    /// mid-exchange: launchbadge/sqlx#563).
    #[tokio::test]
    async fn a_handler_cut_off_mid_statement_keeps_nothing_and_the_pool_stays_in_step() {
        let Some(store) = one_connection_store().await else {
            return;
        };
        let t = support::unique("hx_cutoff");
        sqlx::query(&format!("CREATE TABLE {t} (id VARCHAR(20))"))
            .execute(store.pool())
            .await
            .expect("create");
        let k = key("tx-cutoff");
        let ClaimOutcome::Acquired(lease) = store
            .claim(&ClaimRequest::new(k.clone(), Duration::from_secs(30)))
            .await
            .expect("claim")
        else {
            panic!("fresh key");
        };
        let msg = message(k.clone(), lease.token);
        let handler = async {
            let mut tx = store.begin_for(&msg).await?;
            sqlx::query(&format!("INSERT INTO {t} (id) VALUES ('effect')"))
                .execute(&mut *tx)
                .await
                .classify()?;
            // Still running when the handler is cut off.
            sqlx::query("SELECT SLEEP(2)")
                .execute(&mut *tx)
                .await
                .classify()?;
            tx.commit().await
        };
        let cut = tokio::time::timeout(Duration::from_millis(300), handler).await;
        assert!(
            cut.is_err(),
            "the handler should have been cut off: {cut:?}"
        );
        // The one connection answers this query, not the cut-off one's SLEEP or ROLLBACK.
        let (n, tag): (i64, String) = sqlx::query_as(&format!("SELECT COUNT(*), 'mine' FROM {t}"))
            .fetch_one(store.pool())
            .await
            .expect("count");
        assert_eq!(
            (n, tag.as_str()),
            (0, "mine"),
            "the cut-off effect was kept"
        );
        let rec = store.get(&k).await.expect("get").expect("record");
        assert_eq!(rec.status, RecordStatus::InProgress, "not completed");
        let _ = sqlx::query(&format!("DROP TABLE {t}"))
            .execute(store.pool())
            .await;
    }

    /// Store calls cut off at any point (a heartbeat's timeout, a shutdown) leave the pool
    /// in step: every later call answers for its own keys.
    #[tokio::test]
    async fn store_calls_cut_off_at_any_point_leave_the_pool_in_step() {
        let Some(store) = one_connection_store().await else {
            return;
        };
        for round in 0..40u64 {
            let reqs: Vec<ClaimRequest> = (0..32)
                .map(|i| {
                    ClaimRequest::new(key(&format!("cut{round}-{i}")), Duration::from_secs(30))
                })
                .collect();
            let cut = Duration::from_micros(round * 250);
            let _ = tokio::time::timeout(cut, store.claim_batch(&reqs)).await;
            let leases: Vec<(DedupKey, FencingToken)> = reqs
                .iter()
                .map(|r| (r.key.clone(), FencingToken::random()))
                .collect();
            let _ = tokio::time::timeout(cut, store.extend_batch(&leases, Duration::from_secs(30)))
                .await;
            // A fresh key is acquired, and its record is the one read back.
            let k = key(&format!("after{round}"));
            let got = store
                .claim(&ClaimRequest::new(k.clone(), Duration::from_secs(30)))
                .await
                .expect("claim after a cut-off call");
            assert!(
                matches!(got, ClaimOutcome::Acquired(_)),
                "round {round}: {got:?}"
            );
            let rec = store.get(&k).await.expect("get").expect("record");
            assert_eq!(rec.key, k, "round {round}: another key's record");
        }
    }
}
