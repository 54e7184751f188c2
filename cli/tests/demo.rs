//! The embedded main job, as a new user runs it (smaller, to keep the suite quick).

use std::process::Command;

fn idemq(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_idemq"))
        .args(args)
        .output()
        .expect("run the idemq binary")
}

#[test]
fn the_demo_survives_duplicates_redeliveries_failures_and_crashes_with_no_double_or_lost_effect() {
    let out = idemq(&["demo", "--messages", "400", "--crashes", "2", "--quiet"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "demo failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary = stdout.lines().last().expect("a summary line");
    assert!(summary.starts_with("processed=400 "), "{summary}");
    assert!(summary.ends_with(" double_effects=0 lost=0"), "{summary}");
    let dupes: u64 = summary
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix("duplicates_skipped="))
        .and_then(|v| v.parse().ok())
        .expect("duplicates_skipped field");
    assert!(dupes > 0, "the storm had duplicates to skip: {summary}");
    let detail = stdout.lines().next().expect("detail line");
    assert!(
        detail.contains("crashes=4"),
        "both kinds of crash were injected: {detail}"
    );
    assert!(detail.contains("dead_lettered=0"), "{detail}");
}

#[test]
fn an_unknown_store_url_scheme_is_a_clear_error() {
    let out = idemq(&["store", "--url", "cassandra://db/ks", "purge"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("unknown store URL scheme `cassandra`"),
        "{err}"
    );
    assert!(
        err.contains("sqlite://"),
        "the error lists what is supported: {err}"
    );
}

#[test]
fn store_operations_work_on_a_sqlite_file() {
    let dir = std::env::temp_dir().join(format!("idemq-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let url = format!("sqlite://{}?mode=rwc", dir.join("ops.db").display());
    let out = idemq(&["store", "--url", &url, "migrate"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = idemq(&["store", "--url", &url, "stuck"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("0 stuck records"));
    let out = idemq(&["store", "--url", &url, "forget", "g:nope"]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "forgetting a missing key says so"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
