//! The seed scenarios on every backend, with concurrent duplicate deliveries, each asserting
//! a concrete end state:
//! - a duplicated payment callback creates one payment (unique index in the business tx);
//! - stock deduction with a dedup log and a `stock >= n` guard never oversells;
//! - an order's UNPAID→PAID state machine under concurrent duplicates;
//! - account balances with versions (compare-and-set, and apply-if-newer snapshots);
//!
//! plus the store's in-transaction helpers (`complete_in_tx`, `insert_key_in_tx`), key
//! bounds, migrations and purges.
//!
//! SQLite always runs (a file in a temp dir); PostgreSQL and MySQL/MariaDB need
//! `IDEMQ_TEST_POSTGRES_URL` / `IDEMQ_TEST_MYSQL_URL` (see `support`).

mod support;

use idemq_core::{
    ClaimOutcome, ClaimRequest, CompleteOutcome, ConsumerGroup, DedupKey, DedupStore, FencingToken,
    StoreError,
};
use idemq_sql::{
    map_sqlx_error, KeyInsert, SqlBackend, SqlStore, StateMachine, Transition, VersionOutcome,
    VersionedEntity,
};
use std::time::Duration;

const RETAIN: Duration = Duration::from_secs(3600);

fn group() -> ConsumerGroup {
    ConsumerGroup::new(&support::unique("scn")).expect("group")
}

/// Retries `body` while it fails with a retryable error (deadlock, busy, serialization).
macro_rules! with_retry {
    ($body:expr) => {{
        let mut attempt = 0u32;
        loop {
            match $body.await {
                Ok(v) => break v,
                Err(e) if e.is_retryable() && attempt < 50 => {
                    attempt += 1;
                    tokio::time::sleep(Duration::from_millis(2 + u64::from(attempt) * 3)).await;
                }
                Err(e) => panic!("unexpected error after {attempt} retries: {e}"),
            }
        }
    }};
}

macro_rules! scenario_suite {
    ($m:ident, $feature:literal, $db:ty, $open:path, $begin:expr) => {
        #[cfg(feature = $feature)]
        mod $m {
            use super::*;
            use idemq_sql::sqlx::{self, Pool, Transaction};

            type Db = $db;
            type Store = SqlStore<Db>;

            fn q(sql: &str) -> String {
                <Db as SqlBackend>::DIALECT.placeholders(sql.to_owned())
            }

            fn sqlerr(e: sqlx::Error) -> StoreError {
                map_sqlx_error::<Db>("test sql", e)
            }

            async fn begin(pool: &Pool<Db>) -> Result<Transaction<'static, Db>, StoreError> {
                let stmt: Option<&'static str> = $begin;
                match stmt {
                    Some(s) => pool.begin_with(s).await,
                    None => pool.begin().await,
                }
                .map_err(sqlerr)
            }

            async fn exec(pool: &Pool<Db>, sql: &str) {
                sqlx::query::<Db>(sql)
                    .execute(pool)
                    .await
                    .unwrap_or_else(|e| panic!("{sql}: {e}"));
            }

            async fn count(pool: &Pool<Db>, sql: &str) -> i64 {
                sqlx::query_scalar::<Db, i64>(sql)
                    .fetch_one(pool)
                    .await
                    .unwrap_or_else(|e| panic!("{sql}: {e}"))
            }

            async fn store() -> Option<(support::Guard, Store)> {
                $open().await
            }

            // ---- unique index in the business transaction -------------------------------

            async fn pay_once(
                s: &Store,
                payments: &str,
                key: &DedupKey,
                order: &str,
                worker: i64,
            ) -> Result<KeyInsert, StoreError> {
                let mut tx = begin(s.pool()).await?;
                let r = s.insert_key_in_tx(&mut *tx, key).await?;
                if r == KeyInsert::Inserted {
                    sqlx::query::<Db>(&q(&format!(
                        "INSERT INTO {payments} (order_no, amount, worker) VALUES (?, ?, ?)"
                    )))
                    .bind(order.to_owned())
                    .bind(29_900i64)
                    .bind(worker)
                    .execute(&mut *tx)
                    .await
                    .map_err(sqlerr)?;
                } else {
                    // The transaction is still usable after a duplicate (PostgreSQL would
                    // have aborted it on a raised unique violation).
                    sqlx::query::<Db>(&format!("SELECT COUNT(*) FROM {payments}"))
                        .fetch_one(&mut *tx)
                        .await
                        .map_err(sqlerr)?;
                }
                tx.commit().await.map_err(sqlerr)?;
                Ok(r)
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn duplicated_payment_callback_creates_one_payment() {
                let Some((_g, s)) = store().await else { return };
                let payments = support::unique("payments");
                exec(
                    s.pool(),
                    &format!(
                        "CREATE TABLE {payments} (order_no VARCHAR(64) NOT NULL, \
                         amount BIGINT NOT NULL, worker BIGINT NOT NULL)"
                    ),
                )
                .await;
                let g = group();
                let orders: Vec<String> = (0..12).map(|i| format!("PO2023{i:06}")).collect();
                // A rolled-back transaction (crash before commit) leaves no key behind.
                {
                    let key = DedupKey::new(&g, &orders[0]).unwrap();
                    let mut tx = begin(s.pool()).await.unwrap();
                    assert_eq!(
                        s.insert_key_in_tx(&mut *tx, &key).await.unwrap(),
                        KeyInsert::Inserted
                    );
                    tx.rollback().await.unwrap();
                }
                // Each callback delivered 6 times, by 16 concurrent consumers.
                let mut tasks = Vec::new();
                for w in 0..16i64 {
                    let s = s.clone();
                    let payments = payments.clone();
                    let g = g.clone();
                    let orders = orders.clone();
                    tasks.push(tokio::spawn(async move {
                        let mut inserted = 0;
                        for d in 0..(orders.len() * 6) {
                            if d % 16 != w as usize % 16 && d % 8 != w as usize % 8 {
                                continue;
                            }
                            let order = &orders[d % orders.len()];
                            let key = DedupKey::new(&g, order).unwrap();
                            if with_retry!(pay_once(&s, &payments, &key, order, w))
                                == KeyInsert::Inserted
                            {
                                inserted += 1;
                            }
                        }
                        inserted
                    }));
                }
                let mut inserted = 0;
                for t in tasks {
                    inserted += t.await.unwrap();
                }
                assert_eq!(inserted, orders.len(), "one Inserted per order");
                assert_eq!(
                    count(s.pool(), &format!("SELECT COUNT(*) FROM {payments}")).await,
                    orders.len() as i64,
                    "exactly one payment per order"
                );
                assert_eq!(
                    count(
                        s.pool(),
                        &format!("SELECT COUNT(DISTINCT order_no) FROM {payments}")
                    )
                    .await,
                    orders.len() as i64
                );
                exec(s.pool(), &format!("DROP TABLE {payments}")).await;
            }

            // ---- stock deduction: dedup log + guarded update -----------------------------

            #[derive(Debug, PartialEq, Eq, Clone, Copy)]
            enum Deduct {
                Done,
                Duplicate,
                OutOfStock,
            }

            async fn deduct_once(
                s: &Store,
                inventory: &str,
                log: &str,
                key: &DedupKey,
                order: &str,
                qty: i64,
            ) -> Result<Deduct, StoreError> {
                let mut tx = begin(s.pool()).await?;
                if s.insert_key_in_tx(&mut *tx, key).await? == KeyInsert::Duplicate {
                    tx.commit().await.map_err(sqlerr)?;
                    return Ok(Deduct::Duplicate);
                }
                let n = sqlx::query::<Db>(&q(&format!(
                    "UPDATE {inventory} SET stock = stock - ?, version = version + 1 \
                     WHERE sku = ? AND stock >= ?"
                )))
                .bind(qty)
                .bind(1001i64)
                .bind(qty)
                .execute(&mut *tx)
                .await
                .map_err(sqlerr)?
                .rows_affected();
                if n == 0 {
                    // Insufficient stock: roll back, so the dedup key is not recorded either.
                    tx.rollback().await.map_err(sqlerr)?;
                    return Ok(Deduct::OutOfStock);
                }
                sqlx::query::<Db>(&q(&format!("INSERT INTO {log} (order_no, qty) VALUES (?, ?)")))
                    .bind(order.to_owned())
                    .bind(qty)
                    .execute(&mut *tx)
                    .await
                    .map_err(sqlerr)?;
                tx.commit().await.map_err(sqlerr)?;
                Ok(Deduct::Done)
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn stock_deduction_never_oversells_under_a_duplicate_storm() {
                let Some((_g, s)) = store().await else { return };
                let inventory = support::unique("inventory");
                let log = support::unique("stock_log");
                exec(
                    s.pool(),
                    &format!(
                        "CREATE TABLE {inventory} (sku BIGINT NOT NULL PRIMARY KEY, \
                         stock BIGINT NOT NULL, version BIGINT NOT NULL)"
                    ),
                )
                .await;
                exec(
                    s.pool(),
                    &format!("CREATE TABLE {log} (order_no VARCHAR(64) NOT NULL, qty BIGINT NOT NULL)"),
                )
                .await;
                exec(s.pool(), &format!("INSERT INTO {inventory} (sku, stock, version) VALUES (1001, 100, 0)"))
                    .await;
                let g = group();
                // 60 orders of 2 units (120 wanted, 100 in stock), each delivered 4 times.
                let mut deliveries: Vec<usize> = (0..60).flat_map(|o| [o; 4]).collect();
                deliveries.rotate_left(37);
                let per = deliveries.len().div_ceil(12);
                let mut tasks = Vec::new();
                for chunk in deliveries.chunks(per) {
                    let chunk = chunk.to_vec();
                    let (s, inventory, log, g) = (s.clone(), inventory.clone(), log.clone(), g.clone());
                    tasks.push(tokio::spawn(async move {
                        let mut v = Vec::new();
                        for o in chunk {
                            let order = format!("SO-{o}");
                            let key = DedupKey::new(&g, &order).unwrap();
                            v.push((o, with_retry!(deduct_once(&s, &inventory, &log, &key, &order, 2))));
                        }
                        v
                    }));
                }
                let mut done = std::collections::HashMap::<usize, usize>::new();
                let mut out_of_stock = 0;
                for t in tasks {
                    for (o, r) in t.await.unwrap() {
                        match r {
                            Deduct::Done => *done.entry(o).or_default() += 1,
                            Deduct::OutOfStock => out_of_stock += 1,
                            Deduct::Duplicate => {}
                        }
                    }
                }
                assert_eq!(done.len(), 50, "exactly 50 orders fit in 100 units");
                assert!(done.values().all(|&n| n == 1), "no order deducted twice: {done:?}");
                assert!(out_of_stock >= 10, "the 10 orders that do not fit are refused");
                let stock = count(s.pool(), &format!("SELECT stock FROM {inventory} WHERE sku = 1001")).await;
                assert_eq!(stock, 0, "stock ends at exactly 0, never negative");
                assert_eq!(count(s.pool(), &format!("SELECT version FROM {inventory}")).await, 50);
                assert_eq!(count(s.pool(), &format!("SELECT COUNT(*) FROM {log}")).await, 50);
                assert_eq!(
                    count(s.pool(), &format!("SELECT COUNT(DISTINCT order_no) FROM {log}")).await,
                    50
                );
                exec(s.pool(), &format!("DROP TABLE {inventory}")).await;
                exec(s.pool(), &format!("DROP TABLE {log}")).await;
            }

            // ---- order state machine -----------------------------------------------------

            async fn pay_order(
                sm: &StateMachine,
                s: &Store,
                orders: &str,
                ledger: &str,
                id: i64,
            ) -> Result<Transition, StoreError> {
                let mut tx = begin(s.pool()).await?;
                let t = sm.transition(&mut *tx, id, &["UNPAID"], "PAID").await?;
                if t == Transition::Applied {
                    sqlx::query::<Db>(&q(&format!(
                        "UPDATE {orders} SET paid_count = paid_count + 1 WHERE id = ?"
                    )))
                    .bind(id)
                    .execute(&mut *tx)
                    .await
                    .map_err(sqlerr)?;
                    sqlx::query::<Db>(&q(&format!("INSERT INTO {ledger} (order_id) VALUES (?)")))
                        .bind(id)
                        .execute(&mut *tx)
                        .await
                        .map_err(sqlerr)?;
                }
                tx.commit().await.map_err(sqlerr)?;
                Ok(t)
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn order_unpaid_to_paid_under_concurrent_duplicates() {
                let Some((_g, s)) = store().await else { return };
                let orders = support::unique("orders");
                let ledger = support::unique("ledger");
                exec(
                    s.pool(),
                    &format!(
                        "CREATE TABLE {orders} (id BIGINT NOT NULL PRIMARY KEY, \
                         status VARCHAR(16) NOT NULL, paid_count BIGINT NOT NULL)"
                    ),
                )
                .await;
                exec(s.pool(), &format!("CREATE TABLE {ledger} (order_id BIGINT NOT NULL)")).await;
                for id in 1..=20 {
                    exec(s.pool(), &format!("INSERT INTO {orders} VALUES ({id}, 'UNPAID', 0)")).await;
                }
                exec(s.pool(), &format!("INSERT INTO {orders} VALUES (99, 'CANCELLED', 0)")).await;
                let sm = StateMachine::new(&orders, "id", "status").unwrap();
                // Orders 1..=20, the cancelled 99 and the unknown 404, each delivered 5 times.
                let ids: Vec<i64> = (1..=20).chain([99, 404]).collect();
                let mut tasks = Vec::new();
                for w in 0..10usize {
                    let (s, sm, orders, ledger, ids) =
                        (s.clone(), sm.clone(), orders.clone(), ledger.clone(), ids.clone());
                    tasks.push(tokio::spawn(async move {
                        let mut v = Vec::new();
                        for d in 0..(ids.len() * 5) {
                            if d % 10 != w {
                                continue;
                            }
                            let id = ids[(d * 7) % ids.len()];
                            v.push((id, with_retry!(pay_order(&sm, &s, &orders, &ledger, id))));
                        }
                        v
                    }));
                }
                let mut applied = std::collections::HashMap::<i64, usize>::new();
                let (mut again, mut illegal, mut missing) = (0, 0, 0);
                for t in tasks {
                    for (id, r) in t.await.unwrap() {
                        match r {
                            Transition::Applied => *applied.entry(id).or_default() += 1,
                            Transition::AlreadyInTarget => again += 1,
                            Transition::Illegal(cur) => {
                                assert_eq!((id, cur.as_str()), (99, "CANCELLED"));
                                illegal += 1
                            }
                            Transition::NotFound => {
                                assert_eq!(id, 404);
                                missing += 1
                            }
                        }
                    }
                }
                assert_eq!(applied.len(), 20);
                assert!(applied.values().all(|&n| n == 1), "{applied:?}");
                assert_eq!((again, illegal, missing), (80, 5, 5));
                assert_eq!(
                    count(s.pool(), &format!("SELECT COUNT(*) FROM {orders} WHERE status = 'PAID' AND paid_count = 1")).await,
                    20
                );
                assert_eq!(count(s.pool(), &format!("SELECT COUNT(*) FROM {ledger}")).await, 20);
                assert_eq!(
                    count(s.pool(), &format!("SELECT paid_count FROM {orders} WHERE id = 99")).await,
                    0
                );
                let mut conn = s.pool().acquire().await.unwrap();
                assert_eq!(sm.current(&mut *conn, 99).await.unwrap().as_deref(), Some("CANCELLED"));
                assert!(matches!(
                    sm.transition(&mut *conn, 1, &[], "PAID").await,
                    Err(StoreError::Config(_))
                ));
                drop(conn);
                exec(s.pool(), &format!("DROP TABLE {orders}")).await;
                exec(s.pool(), &format!("DROP TABLE {ledger}")).await;
            }

            // ---- account balance with versions ---------------------------------------------

            /// Debit `amount` if the account is at `expected` version. `Ok(None)` = not yet
            /// (an earlier message is still missing): redeliver later.
            async fn debit(
                ve: &VersionedEntity,
                s: &Store,
                accounts: &str,
                expected: i64,
                amount: i64,
            ) -> Result<Option<bool>, StoreError> {
                let mut tx = begin(s.pool()).await?;
                let out = ve.compare_and_set(&mut *tx, 7, expected, expected + 1).await?;
                let res = match out {
                    VersionOutcome::Applied => {
                        sqlx::query::<Db>(&q(&format!(
                            "UPDATE {accounts} SET balance = balance - ? WHERE id = ?"
                        )))
                        .bind(amount)
                        .bind(7i64)
                        .execute(&mut *tx)
                        .await
                        .map_err(sqlerr)?;
                        Some(true)
                    }
                    VersionOutcome::Stale(cur) if cur > expected => Some(false), // duplicate
                    VersionOutcome::Stale(_) => None,                             // too early
                    VersionOutcome::NotFound => panic!("account 7 exists"),
                };
                tx.commit().await.map_err(sqlerr)?;
                Ok(res)
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn account_balance_with_versions() {
                let Some((_g, s)) = store().await else { return };
                let accounts = support::unique("accounts");
                exec(
                    s.pool(),
                    &format!(
                        "CREATE TABLE {accounts} (id BIGINT NOT NULL PRIMARY KEY, \
                         balance BIGINT NOT NULL, version BIGINT NOT NULL)"
                    ),
                )
                .await;
                exec(s.pool(), &format!("INSERT INTO {accounts} VALUES (7, 1000, 0)")).await;
                let ve = VersionedEntity::new(&accounts, "id", "version").unwrap();
                // Ten debits of 100, message k expects version k; each delivered 4 times,
                // out of order, by 8 workers that requeue messages arriving too early.
                let mut applied_total = 0;
                let mut tasks = Vec::new();
                for w in 0..8i64 {
                    let (s, ve, accounts) = (s.clone(), ve.clone(), accounts.clone());
                    tasks.push(tokio::spawn(async move {
                        let mut queue: std::collections::VecDeque<i64> =
                            (0..40).map(|d| (d * 3 + w) % 10).collect();
                        let mut applied = 0;
                        let mut spins = 0;
                        while let Some(k) = queue.pop_front() {
                            match with_retry!(debit(&ve, &s, &accounts, k, 100)) {
                                Some(true) => applied += 1,
                                Some(false) => {}
                                None => {
                                    spins += 1;
                                    assert!(spins < 100_000, "debits never progressed");
                                    queue.push_back(k);
                                    tokio::task::yield_now().await;
                                }
                            }
                        }
                        applied
                    }));
                }
                for t in tasks {
                    applied_total += t.await.unwrap();
                }
                assert_eq!(applied_total, 10, "each debit applied once");
                assert_eq!(count(s.pool(), &format!("SELECT balance FROM {accounts} WHERE id = 7")).await, 0);
                assert_eq!(count(s.pool(), &format!("SELECT version FROM {accounts} WHERE id = 7")).await, 10);

                // Snapshots "balance is X as of sequence n", out of order with duplicates:
                // the newest wins whatever the arrival order.
                exec(s.pool(), &format!("INSERT INTO {accounts} VALUES (8, 0, 0)")).await;
                let mut seqs: Vec<i64> = (1..=30).chain(1..=30).collect();
                seqs.reverse();
                seqs.rotate_left(11);
                let mut tasks = Vec::new();
                for part in seqs.chunks(15) {
                    let (s, ve, accounts, part) = (s.clone(), ve.clone(), accounts.clone(), part.to_vec());
                    tasks.push(tokio::spawn(async move {
                        let mut applied = 0;
                        for n in part {
                            applied += with_retry!(async {
                                let mut tx = begin(s.pool()).await?;
                                let o = ve.apply_if_newer(&mut *tx, 8, n).await?;
                                if o == VersionOutcome::Applied {
                                    sqlx::query::<Db>(&q(&format!("UPDATE {accounts} SET balance = ? WHERE id = ?")))
                                        .bind(n * 10)
                                        .bind(8i64)
                                        .execute(&mut *tx)
                                        .await
                                        .map_err(sqlerr)?;
                                } else {
                                    assert!(matches!(o, VersionOutcome::Stale(c) if c >= n), "{o:?}");
                                }
                                tx.commit().await.map_err(sqlerr)?;
                                Ok::<_, StoreError>(usize::from(o == VersionOutcome::Applied))
                            });
                        }
                        applied
                    }));
                }
                let mut applied = 0;
                for t in tasks {
                    applied += t.await.unwrap();
                }
                assert!((1..=30).contains(&applied));
                assert_eq!(count(s.pool(), &format!("SELECT balance FROM {accounts} WHERE id = 8")).await, 300);
                assert_eq!(count(s.pool(), &format!("SELECT version FROM {accounts} WHERE id = 8")).await, 30);
                let mut conn = s.pool().acquire().await.unwrap();
                assert_eq!(ve.apply_if_newer(&mut *conn, 404, 1).await.unwrap(), VersionOutcome::NotFound);
                assert_eq!(ve.current(&mut *conn, 8).await.unwrap(), Some(30));
                drop(conn);
                exec(s.pool(), &format!("DROP TABLE {accounts}")).await;
            }

            // ---- the store's in-transaction helpers and bounds ------------------------------

            async fn acquire(s: &Store, k: &DedupKey, lease: Duration) -> FencingToken {
                match s.claim(&ClaimRequest::new(k.clone(), lease)).await.unwrap() {
                    ClaimOutcome::Acquired(l) => l.token,
                    o => panic!("expected Acquired, got {o:?}"),
                }
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn complete_in_tx_commits_with_the_effect() {
                let Some((_g, s)) = store().await else { return };
                let effects = support::unique("effects");
                exec(s.pool(), &format!("CREATE TABLE {effects} (k VARCHAR(300) NOT NULL)")).await;
                let g = group();
                let k = DedupKey::new(&g, "mail-1").unwrap();
                let token = acquire(&s, &k, Duration::from_secs(60)).await;

                // Rolled back: neither the effect nor the completion happened.
                let mut tx = begin(s.pool()).await.unwrap();
                sqlx::query::<Db>(&q(&format!("INSERT INTO {effects} (k) VALUES (?)")))
                    .bind(k.as_str().to_owned())
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                assert_eq!(
                    s.complete_in_tx(&mut *tx, &k, token, Some(b"r1"), RETAIN).await.unwrap(),
                    CompleteOutcome::Completed
                );
                tx.rollback().await.unwrap();
                assert!(matches!(
                    s.claim(&ClaimRequest::new(k.clone(), Duration::from_secs(60))).await.unwrap(),
                    ClaimOutcome::InFlight { .. }
                ));
                assert_eq!(count(s.pool(), &format!("SELECT COUNT(*) FROM {effects}")).await, 0);

                // Committed: both, and the engine's later `complete` is idempotent.
                let mut tx = begin(s.pool()).await.unwrap();
                sqlx::query::<Db>(&q(&format!("INSERT INTO {effects} (k) VALUES (?)")))
                    .bind(k.as_str().to_owned())
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                assert_eq!(
                    s.complete_in_tx(&mut *tx, &k, token, Some(b"r1"), RETAIN).await.unwrap(),
                    CompleteOutcome::Completed
                );
                assert_eq!(
                    s.complete_in_tx(&mut *tx, &k, token, Some(b"r1"), RETAIN).await.unwrap(),
                    CompleteOutcome::AlreadyCompleted,
                    "idempotent within the transaction, and says it was done before"
                );
                tx.commit().await.unwrap();
                assert_eq!(count(s.pool(), &format!("SELECT COUNT(*) FROM {effects}")).await, 1);
                // Folded from the fence table (Completed) or found done (SQLite): either acks.
                assert!(s.complete(&k, token, None, RETAIN).await.unwrap().is_done());
                match s.claim(&ClaimRequest::new(k.clone(), Duration::from_secs(60))).await.unwrap() {
                    ClaimOutcome::Duplicate(r) => assert_eq!(r.result.as_deref(), Some(&b"r1"[..])),
                    o => panic!("expected Duplicate, got {o:?}"),
                }

                // A stale token (lease taken over) is fenced: the caller rolls back.
                let k2 = DedupKey::new(&g, "mail-2").unwrap();
                let old = acquire(&s, &k2, Duration::from_millis(50)).await;
                tokio::time::sleep(Duration::from_millis(120)).await;
                let new = acquire(&s, &k2, Duration::from_secs(60)).await;
                let mut tx = begin(s.pool()).await.unwrap();
                assert_eq!(
                    s.complete_in_tx(&mut *tx, &k2, old, None, RETAIN).await.unwrap(),
                    CompleteOutcome::Fenced
                );
                tx.rollback().await.unwrap();
                assert_eq!(s.complete(&k2, new, None, RETAIN).await.unwrap(), CompleteOutcome::Completed);
                exec(s.pool(), &format!("DROP TABLE {effects}")).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn complete_batch_stores_each_result_and_retention() {
                let Some((_g, s)) = store().await else { return };
                let g = group();
                let keys: Vec<DedupKey> =
                    (0..6).map(|i| DedupKey::new(&g, &format!("r{i}")).unwrap()).collect();
                let reqs: Vec<ClaimRequest> = keys
                    .iter()
                    .map(|k| ClaimRequest::new(k.clone(), Duration::from_secs(60)))
                    .collect();
                let tokens: Vec<FencingToken> = s
                    .claim_batch(&reqs)
                    .await
                    .unwrap()
                    .into_iter()
                    .map(|o| match o {
                        ClaimOutcome::Acquired(l) => l.token,
                        o => panic!("{o:?}"),
                    })
                    .collect();
                // Mixed results (some empty, some absent) and retentions, in reverse order.
                let items: Vec<idemq_core::Completion> = (0..6)
                    .rev()
                    .map(|i| idemq_core::Completion {
                        key: keys[i].clone(),
                        token: tokens[i],
                        result: match i % 3 {
                            0 => None,
                            1 => Some(bytes::Bytes::new()),
                            _ => Some(bytes::Bytes::from(format!("receipt-{i}\0\u{ff}"))),
                        },
                        retention: Duration::from_secs(100 * (i as u64 + 1)),
                    })
                    .collect();
                let done = s.complete_batch(&items).await.unwrap();
                assert!(done.iter().all(|d| *d == CompleteOutcome::Completed), "{done:?}");
                for i in 0..6 {
                    let r = s.get(&keys[i]).await.unwrap().unwrap();
                    let want: Option<Vec<u8>> = match i % 3 {
                        0 => None,
                        1 => Some(Vec::new()),
                        _ => Some(format!("receipt-{i}\0\u{ff}").into_bytes()),
                    };
                    assert_eq!(r.result.map(|b| b.to_vec()), want, "result of {i}");
                    let kept = r.expires_ms.unwrap() - r.completed_ms.unwrap();
                    assert_eq!(kept, 100_000 * (i as i64 + 1), "retention of {i}");
                }
                // A key named twice, stale token first: answered item by item.
                let k = DedupKey::new(&g, "twice").unwrap();
                let t = acquire(&s, &k, Duration::from_secs(60)).await;
                let item = |token| idemq_core::Completion {
                    key: k.clone(),
                    token,
                    result: Some(bytes::Bytes::from_static(b"ok")),
                    retention: RETAIN,
                };
                let done = s
                    .complete_batch(&[item(FencingToken::random()), item(t), item(t)])
                    .await
                    .unwrap();
                assert_eq!(
                    done,
                    vec![CompleteOutcome::Fenced, CompleteOutcome::Completed, CompleteOutcome::AlreadyCompleted]
                );
                assert_eq!(s.get(&k).await.unwrap().unwrap().result.as_deref(), Some(&b"ok"[..]));
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn oversize_keys_are_refused() {
                let Some((_g, s)) = store().await else { return };
                let long = DedupKey::from_stored("g:".to_owned() + &"x".repeat(300));
                let err = s
                    .claim(&ClaimRequest::new(long.clone(), Duration::from_secs(1)))
                    .await
                    .unwrap_err();
                assert!(matches!(err, StoreError::KeyTooLong { len: 302, max: 257 }), "{err:?}");
                assert!(matches!(s.get(&long).await, Err(StoreError::KeyTooLong { .. })));
                let mut tx = begin(s.pool()).await.unwrap();
                assert!(matches!(
                    s.insert_key_in_tx(&mut *tx, &long).await,
                    Err(StoreError::KeyTooLong { .. })
                ));
                tx.rollback().await.unwrap();
                // The longest allowed key round-trips, and case / trailing spaces matter.
                let g = group();
                let max = DedupKey::from_stored(format!("{}:{}", g.as_str(), "k".repeat(257 - g.as_str().len() - 1)));
                assert_eq!(max.as_str().len(), 257);
                acquire(&s, &max, Duration::from_secs(60)).await;
                assert_eq!(s.get(&max).await.unwrap().unwrap().key, max);
                let a = DedupKey::new(&g, "Order-A").unwrap();
                acquire(&s, &a, Duration::from_secs(60)).await;
                for other in ["order-a", "Order-A ", "ORDER-A"] {
                    acquire(&s, &DedupKey::new(&g, other).unwrap(), Duration::from_secs(60)).await;
                }
                let uni = DedupKey::new(&g, "订单-42").unwrap();
                acquire(&s, &uni, Duration::from_secs(60)).await;
                assert_eq!(s.get(&uni).await.unwrap().unwrap().key, uni);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn migrations_are_versioned_and_idempotent() {
                let Some((_g, s)) = store().await else { return };
                let latest = idemq_sql::migrate::latest_version(<Db as SqlBackend>::DIALECT);
                assert_eq!(s.schema_version().await.unwrap(), Some(latest));
                assert_eq!(s.migrate().await.unwrap(), latest);
                let _ = s.schema_version().await.unwrap();
                // Concurrent migrations of a fresh table apply it once, without errors.
                let table = support::unique("dedup_mig");
                let mut tasks = Vec::new();
                for _ in 0..4 {
                    let pool = s.pool().clone();
                    let opts = support::options(&table, 2);
                    tasks.push(tokio::spawn(async move { SqlStore::<Db>::from_pool(pool, opts).await }));
                }
                for t in tasks {
                    t.await.unwrap().expect("concurrent migration");
                }
                let other = SqlStore::<Db>::from_pool(s.pool().clone(), support::options(&table, 2)).await.unwrap();
                assert_eq!(other.schema_version().await.unwrap(), Some(latest));
                assert_eq!(other.keys_table().as_str(), format!("{table}_keys"));
                let g = group();
                let k = DedupKey::new(&g, "x").unwrap();
                acquire(&other, &k, Duration::from_secs(60)).await;
                assert!(s.get(&k).await.unwrap().is_none(), "tables are separate");
                exec(s.pool(), &format!("DROP TABLE {table}")).await;
                exec(s.pool(), &format!("DROP TABLE {table}_keys")).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn keys_purge_in_bounded_chunks() {
                let Some((_g, s)) = store().await else { return };
                let table = support::unique("dedup_pk");
                let s = SqlStore::<Db>::from_pool(s.pool().clone(), support::options(&table, 2)).await.unwrap();
                let g = group();
                for i in 0..7 {
                    let mut tx = begin(s.pool()).await.unwrap();
                    let k = DedupKey::new(&g, &format!("k{i}")).unwrap();
                    assert_eq!(s.insert_key_in_tx(&mut *tx, &k).await.unwrap(), KeyInsert::Inserted);
                    tx.commit().await.unwrap();
                }
                tokio::time::sleep(Duration::from_millis(30)).await;
                assert_eq!(s.purge_keys_older_than(Duration::from_secs(3600), 100).await.unwrap(), 0);
                assert_eq!(s.purge_keys_older_than(Duration::from_millis(1), 3).await.unwrap(), 3);
                assert_eq!(s.purge_keys_older_than(Duration::from_millis(1), 100).await.unwrap(), 4);
                assert_eq!(s.purge_keys_older_than(Duration::from_millis(1), 100).await.unwrap(), 0);
                exec(s.pool(), &format!("DROP TABLE {table}")).await;
                exec(s.pool(), &format!("DROP TABLE {table}_keys")).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn hostile_table_names_are_config_errors() {
                let Some((_g, s)) = store().await else { return };
                for bad in ["t; DROP TABLE x", "x\"; --", "a b", ""] {
                    let err = idemq_sql::TableName::new(bad).unwrap_err();
                    assert!(matches!(err, StoreError::Config(_)), "{bad}: {err:?}");
                    assert!(matches!(StateMachine::new("orders", bad, "status"), Err(StoreError::Config(_))));
                    assert!(matches!(VersionedEntity::new(bad, "id", "v"), Err(StoreError::Config(_))));
                }
                let long = idemq_sql::TableName::new(&"t".repeat(63)).unwrap();
                let err = SqlStore::<Db>::from_pool(s.pool().clone(), idemq_sql::SqlStoreOptions::with_table(long))
                    .await
                    .unwrap_err();
                assert!(matches!(err, StoreError::Config(ref m) if m.contains("keys_table")), "{err:?}");
            }
        }
    };
}

scenario_suite!(
    sqlite,
    "sqlite",
    idemq_sql::sqlx::Sqlite,
    support::sqlite_store,
    Some("BEGIN IMMEDIATE")
);
scenario_suite!(
    postgres,
    "postgres",
    idemq_sql::sqlx::Postgres,
    support::postgres_store,
    None
);
scenario_suite!(
    mysql,
    "mysql",
    idemq_sql::sqlx::MySql,
    support::mysql_store,
    None
);
