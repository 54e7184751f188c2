//! `idemq kafka check-config`: every rule's verdict with its message, exit 1 on an unsafe
//! producer configuration, 0 on a safe one.
#![cfg(feature = "kafka")]

use std::process::Command;

fn check(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_idemq"))
        .args(["kafka", "check-config"])
        .args(args)
        .output()
        .expect("run idemq");
    (
        out.status.code().expect("exit code"),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[test]
fn an_unsafe_properties_file_is_explained_rule_by_rule_and_exits_1() {
    let dir = std::env::temp_dir().join(format!("idemq-cc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let file = dir.join("producer.properties");
    std::fs::write(
        &file,
        "# payments producer\nbootstrap.servers=127.0.0.1:9092\ntransactional.id=payments-0\n\
         acks=1\nmax.in.flight.requests.per.connection=10\ntransaction.timeout.ms=1200000\n",
    )
    .expect("write");
    let (code, out) = check(&[file.to_str().expect("path")]);
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(code, 1, "{out}");
    for expected in [
        "producer configuration: transactional (transactional.id=payments-0)",
        "ok    bootstrap.servers is set",
        "FAIL  idempotence: acks=all: acks=1 breaks idempotence: use acks=all",
        "FAIL  idempotence: max.in.flight.requests.per.connection <= 5: \
         max.in.flight.requests.per.connection=10 breaks idempotence",
        "FAIL  transaction.timeout.ms <= the broker's transaction.max.timeout.ms: \
         transaction.timeout.ms=1200000 exceeds the broker's transaction.max.timeout.ms=900000",
        "ok    transactional producer has a transactional.id",
        "unsafe: 3 problem(s)",
    ] {
        assert!(out.contains(expected), "missing {expected:?} in:\n{out}");
    }
    // One line per rule (9), plus the header and the verdict.
    assert_eq!(out.lines().count(), 11, "{out}");
}

#[test]
fn x_pairs_override_the_file_and_a_safe_config_exits_0() {
    let (code, out) = check(&[
        "-X",
        "bootstrap.servers=127.0.0.1:9092",
        "-X",
        "transactional.id=payments-0",
        "-X",
        "enable.idempotence=true",
        "-X",
        "acks=all",
    ]);
    assert_eq!(code, 0, "{out}");
    assert!(out.trim_end().ends_with("safe"), "{out}");
    assert!(!out.contains("FAIL"), "{out}");
    // The broker's limit is a flag: a lower one makes the default 60 s timeout too long.
    let (code, out) = check(&[
        "-X",
        "bootstrap.servers=b:1",
        "-X",
        "transactional.id=t",
        "--broker-max-transaction-timeout-ms",
        "30000",
    ]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains(
            "transaction.timeout.ms=60000 exceeds the broker's transaction.max.timeout.ms=30000"
        ),
        "{out}"
    );
}

#[test]
fn a_malformed_line_or_nothing_to_check_is_refused() {
    let (code, out) = check(&["-X", "acks"]);
    assert_eq!(code, 2, "{out}");
    let (code, _) = check(&[]);
    assert_eq!(code, 2);
}
