//! The core contract kit on SQLite: one database file, four handles with separate pools.
#![cfg(feature = "sqlite")]

mod support;

use std::sync::Arc;

// Each case opens its own database file; the guard keeps the directory for the whole test.
struct Held(#[allow(dead_code)] support::TempDir);

idemq_core::store_contract_tests!(async {
    let (dir, handles) = support::sqlite_handles(4).await;
    // The directory must outlive the test, which owns only the handles: leave it in cargo's
    // scratch dir (`target/tmp`) rather than remove it under the running case.
    Box::leak(Box::new(Held(dir)));
    Some(handles)
});

#[tokio::test]
async fn in_memory_store_passes_the_kit() {
    let s: Arc<dyn idemq_core::DedupStore> = Arc::new(
        idemq_sql::SqliteStore::connect("sqlite::memory:", Default::default())
            .await
            .expect("open in-memory store"),
    );
    idemq_core::testkit::store::run_all(&[s.clone(), s]).await;
}
