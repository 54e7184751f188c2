//! The embedded examples run to success as a newcomer runs them (`cargo run --example …`):
//! `cargo test` builds every example before the tests, and this runs the built binaries.
//! Each example asserts its own outcome and prints it as its last line, which the test
//! checks: a zero exit alone would pass an example that stopped checking anything.
//! The server-backed examples are run by `tests/examples_payments.rs`.

use std::path::PathBuf;

/// `target/<profile>/examples/<name>`, next to this test's own `target/<profile>/deps/`.
fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>/deps");
    profile_dir.join("examples").join(name)
}

fn run(name: &str) -> String {
    let path = example(name);
    assert!(
        path.exists(),
        "{} is not built (cargo test builds examples; was it run with --tests only?)",
        path.display()
    );
    let out = std::process::Command::new(&path)
        .output()
        .expect("run the example");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{name} failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[test]
fn the_embedded_quickstart_runs() {
    let out = run("embedded_consumer");
    assert!(out.contains("shipments=3 processed=3"), "{out}");
}

#[test]
fn the_payment_callback_example_runs() {
    let out = run("payment_callback");
    assert!(out.contains("payments=1 created=1 skipped=2"), "{out}");
}

#[test]
fn the_order_state_machine_example_runs() {
    let out = run("order_state_machine");
    assert!(
        out.contains("payments=2 applied=2 duplicates=2 refused=1"),
        "{out}"
    );
}

#[test]
fn the_account_optimistic_lock_example_runs() {
    let out = run("account_optimistic_lock");
    assert!(
        out.contains("balance=1050 version=3 stale_skipped=2"),
        "{out}"
    );
}

#[test]
fn the_inventory_dedup_log_example_runs() {
    let out = run("inventory_dedup_log");
    assert!(out.contains("lamps left=1 reserved=2 refused=1"), "{out}");
}

#[test]
fn the_outbox_relay_example_runs() {
    let out = run("outbox_relay");
    assert!(out.contains("invoices=20 distinct=20"), "{out}");
}
