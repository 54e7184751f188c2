//! Which real servers a test run has, for every integration test of the workspace.
//!
//! A test that needs a server asks [`server_url`] for its address (an `IDEMQ_TEST_*`
//! variable, as `eval "$(scripts/servers.sh env)"` exports them) and returns early on `None`.
//! What `None` means depends on how the run was started:
//!
//! - the variable is set: the server is there, the test runs;
//! - the server is named in `IDEMQ_SKIP_SERVERS` (`scripts/test.sh --servers …` names every
//!   server it did not start, and RocketMQ while its first build still runs): the test is
//!   *skipped for a missing server*, and a line goes to the file `IDEMQ_SKIP_LOG` names, so the
//!   run's summary counts it as skipped (never as passed) and can run it again once the
//!   server is up;
//! - otherwise, with `IDEMQ_REQUIRE_SERVERS=1` (what the servers' env sets): a panic, since a
//!   run that promised every server must not pass a test it did not run;
//! - otherwise (a plain `cargo test`): skipped with a note on stderr.
//!
//! ```
//! use idemq_core::testkit::servers::server_url;
//!
//! # std::env::remove_var("IDEMQ_REQUIRE_SERVERS");
//! let Some(url) = server_url("IDEMQ_TEST_SOME_UNSET_SERVER_URL") else {
//!     return; // skipped: the note says which variable was missing
//! };
//! # let _ = url;
//! ```

use std::cell::Cell;
use std::io::Write;

/// The server an `IDEMQ_TEST_*` variable points at, by the names `scripts/servers.sh` uses.
pub fn server_of(var: &str) -> &'static str {
    match var {
        v if v.contains("POSTGRES") => "postgres",
        v if v.contains("MYSQL") || v.contains("MARIADB") => "mariadb",
        v if v.contains("REDIS_CLUSTER") => "redis-cluster",
        v if v.contains("REDIS") => "redis",
        v if v.contains("KAFKA") => "kafka",
        v if v.contains("AMQP") || v.contains("RABBITMQ") => "rabbitmq",
        v if v.contains("ROCKETMQ") => "rocketmq",
        v if v.contains("NATS_CLUSTER") => "nats-cluster",
        v if v.contains("NATS") => "nats",
        v if v.contains("TOXIPROXY") => "toxiproxy",
        _ => "unknown",
    }
}

thread_local! {
    static SKIPPED_HERE: Cell<bool> = const { Cell::new(false) };
}

/// The address in `var`, or `None` when the test must not run (see the module doc for which
/// `None` is a recorded skip and which a panic).
pub fn server_url(var: &str) -> Option<String> {
    if let Ok(url) = std::env::var(var) {
        if !url.trim().is_empty() {
            return Some(url);
        }
    }
    let server = server_of(var);
    let skipped_by_design = std::env::var("IDEMQ_SKIP_SERVERS")
        .map(|list| list.split(',').any(|s| s.trim() == server))
        .unwrap_or(false);
    if skipped_by_design {
        record_skip(server);
        eprintln!("skipped: needs {server} ({var}), which this run does not start");
        return None;
    }
    if std::env::var("IDEMQ_REQUIRE_SERVERS").as_deref() == Ok("1") {
        panic!(
            "{var} is not set but IDEMQ_REQUIRE_SERVERS=1: start the servers with \
             `scripts/servers.sh start {server}` and `eval \"$(scripts/servers.sh env)\"`"
        );
    }
    eprintln!("skipped: {var} is not set (scripts/servers.sh start {server}; eval \"$(scripts/servers.sh env)\")");
    None
}

/// Whether this thread's test was skipped for a missing server by design: a kit macro whose
/// harness returned `None` asks this before it fails the test under `IDEMQ_REQUIRE_SERVERS=1`.
pub fn skipped_for_a_missing_server() -> bool {
    SKIPPED_HERE.with(Cell::get)
}

/// One line `server <TAB> test binary <TAB> package dir <TAB> test name` in `IDEMQ_SKIP_LOG`.
/// The test name is the thread's (libtest names a test's thread after the test); a test run
/// on the main thread (`--test-threads=1`) is logged with an empty name: its whole binary.
fn record_skip(server: &str) {
    SKIPPED_HERE.with(|s| s.set(true));
    let Ok(path) = std::env::var("IDEMQ_SKIP_LOG") else {
        return;
    };
    let test = std::thread::current()
        .name()
        .filter(|n| *n != "main")
        .unwrap_or("")
        .to_owned();
    let exe = std::env::current_exe()
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    let dir = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_default();
    let line = format!("{server}\t{exe}\t{dir}\t{test}\n");
    // One write of one short line in append mode: lines of parallel tests do not interleave.
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut f| f.write_all(line.as_bytes()));
    if let Err(e) = written {
        panic!("cannot record a skipped test in IDEMQ_SKIP_LOG={path}: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::server_of;

    /// Every variable `scripts/test.sh` lists under a server maps back to that server's name,
    /// so `IDEMQ_SKIP_SERVERS` (which names servers) skips exactly the tests of the servers a
    /// run did not start.
    #[test]
    fn each_variable_of_test_sh_names_its_server() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/test.sh");
        let script = std::fs::read_to_string(path).expect("scripts/test.sh");
        let mut checked = 0;
        for line in script.lines() {
            let Some((server, vars)) = line
                .trim()
                .strip_prefix('[')
                .and_then(|l| l.split_once("]=\""))
            else {
                continue;
            };
            for var in vars.trim_end_matches('"').split_whitespace() {
                assert_eq!(server_of(var), server, "{var} in scripts/test.sh");
                checked += 1;
            }
        }
        assert!(
            checked >= 20,
            "read the SERVER_VARS table of scripts/test.sh ({checked} variables)"
        );
    }
}
