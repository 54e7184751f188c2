//! `idemq store inspect|release` on a real (SQLite file) store: what an operator sees of an
//! abandoned claim, releasing it, and the refusals that keep a completed record safe.
#![cfg(feature = "sqlite")]

use idemq::sql::{SqlStoreOptions, SqliteStore};
use idemq::{ClaimOutcome, ClaimRequest, ConsumerGroup, DedupKey, DedupStore};
use std::process::Output;
use std::time::Duration;

fn idemq(url: &str, args: &[&str]) -> Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_idemq"))
        .args(["store", "--url", url])
        .args(args)
        .output()
        .expect("run idemq")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[tokio::test]
async fn an_operator_inspects_and_releases_an_abandoned_claim() {
    let dir = std::env::temp_dir().join(format!("idemq-cli-store-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let url = format!("sqlite://{}?mode=rwc", dir.join("dedup.db").display());
    let store = SqliteStore::connect(&url, SqlStoreOptions::default())
        .await
        .expect("store");
    let group = ConsumerGroup::new("billing").expect("group");
    let (stuck, done) = (
        DedupKey::new(&group, "pay-1").expect("key"),
        DedupKey::new(&group, "pay-2").expect("key"),
    );
    // A worker claims pay-1 and dies; pay-2 is completed with a stored result.
    let ClaimOutcome::Acquired(_) = store
        .claim(&ClaimRequest::new(stuck.clone(), Duration::from_secs(600)))
        .await
        .expect("claim")
    else {
        panic!("fresh key not acquired")
    };
    let ClaimOutcome::Acquired(lease) = store
        .claim(&ClaimRequest::new(done.clone(), Duration::from_secs(600)))
        .await
        .expect("claim")
    else {
        panic!("fresh key not acquired")
    };
    store
        .complete(
            &done,
            lease.token,
            Some("receipt-77".into()),
            Duration::from_secs(3600),
        )
        .await
        .expect("complete");

    let o = idemq(&url, &["inspect", stuck.as_str()]);
    assert!(o.status.success(), "{o:?}");
    let text = stdout(&o);
    assert!(text.contains("in progress, lease ends in"), "{text}");
    assert!(text.contains("attempts:    1"), "{text}");

    let o = idemq(&url, &["release", stuck.as_str()]);
    assert!(o.status.success(), "{o:?}");
    assert!(
        stdout(&o).contains("released billing:pay-1"),
        "{}",
        stdout(&o)
    );
    // The next delivery claims it at once, as a takeover of the same record.
    match store
        .claim(&ClaimRequest::new(stuck.clone(), Duration::from_secs(600)))
        .await
        .expect("claim after release")
    {
        ClaimOutcome::Acquired(l) => assert_eq!(l.attempt, 2, "{l:?}"),
        other => panic!("released key not claimable: {other:?}"),
    }

    let o = idemq(&url, &["get", done.as_str()]);
    assert!(o.status.success(), "`get` is an alias of inspect: {o:?}");
    let text = stdout(&o);
    assert!(text.contains("status:      completed"), "{text}");
    assert!(text.contains("result:      receipt-77"), "{text}");
    assert!(text.contains("expires:     in "), "{text}");

    let o = idemq(&url, &["release", done.as_str()]);
    assert_eq!(
        o.status.code(),
        Some(1),
        "a completed record is not released: {o:?}"
    );
    assert!(stdout(&o).contains("is completed"), "{}", stdout(&o));
    assert!(
        matches!(
            store
                .claim(&ClaimRequest::new(done.clone(), Duration::from_secs(600)))
                .await
                .expect("claim"),
            ClaimOutcome::Duplicate(_)
        ),
        "the completed record still answers duplicates"
    );

    let o = idemq(&url, &["stats"]);
    assert!(o.status.success(), "{o:?}");
    let text = stdout(&o);
    for line in [
        "in progress: 1",
        "abandoned:   0",
        "completed:   1",
        "total:       2",
    ] {
        assert!(text.contains(line), "no `{line}` in:\n{text}");
    }

    let o = idemq(&url, &["inspect", "billing:never-seen"]);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    assert!(stdout(&o).contains("no record for billing:never-seen"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_cli_refuses_bad_store_urls_and_hides_passwords() {
    let bin = env!("CARGO_BIN_EXE_idemq");
    let out = std::process::Command::new(bin)
        .args([
            "store",
            "--url",
            "cassandra://app:s3cr3t-Pw9@db1/ks",
            "migrate",
        ])
        .output()
        .expect("run idemq");
    assert!(!out.status.success(), "an unknown scheme fails");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("cassandra"), "{stderr}");
    assert!(
        stderr.contains("sqlite://"),
        "lists what is supported: {stderr}"
    );
    assert!(!stderr.contains("s3cr3t-Pw9"), "{stderr}");
    let out = std::process::Command::new(bin)
        .args([
            "store",
            "--url",
            "postgres//app:s3cr3t-Pw9@db1/ks",
            "migrate",
        ])
        .output()
        .expect("run idemq");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("not a store URL"), "{stderr}");
    assert!(!stderr.contains("s3cr3t-Pw9"), "{stderr}");
}
