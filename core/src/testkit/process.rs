//! Consumer **processes** for crash tests: a test re-runs its own binary as a child that
//! plays one role (consume, produce), and the parent kills it with SIGKILL at a point of
//! its choosing — a real process exit, not a dropped future, so nothing in the child gets
//! to clean up (no close, no final commit, no ack in flight).
//!
//! ```no_run
//! use idemq_core::testkit::process::{child_role, ChildProcess};
//!
//! fn killed_consumer_changes_the_world_once() {
//!     const ROLE: &str = "MY_CRATE_CHILD";
//!     if let Some(arg) = child_role(ROLE) {
//!         // … run the consumer with `arg`, exit when done …
//!         std::process::exit(0);
//!     }
//!     let mut child = ChildProcess::spawn_self(
//!         "killed_consumer_changes_the_world_once",
//!         ROLE,
//!         "run-1",
//!     )
//!     .expect("spawn");
//!     // … wait for some effects, then:
//!     child.kill().expect("SIGKILL");
//!     println!("{}", child.stderr_tail(2000));
//! }
//! ```

use std::io::Read;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// The argument the parent gave this process, when it runs as a child of role `env_var`.
pub fn child_role(env_var: &str) -> Option<String> {
    std::env::var(env_var).ok()
}

/// A child test process; killed (SIGKILL) on drop if still running.
pub struct ChildProcess {
    child: Child,
    stderr_path: PathBuf,
}

impl ChildProcess {
    /// Re-runs the current test binary for the single test `test` (its full path as libtest
    /// prints it, e.g. `flow1::killed_consumer`), with `env_var=arg` in its environment.
    /// Its stdout is dropped; its stderr goes to a file read by [`ChildProcess::stderr_tail`]
    /// (so a child's panic or logs show up in the parent's failure message).
    pub fn spawn_self(test: &str, env_var: &str, arg: &str) -> std::io::Result<Self> {
        let exe = std::env::current_exe()?;
        let stderr_path = std::env::temp_dir().join(format!(
            "idemq-child-{}-{:016x}.stderr",
            std::process::id(),
            rand::random::<u64>()
        ));
        let stderr = std::fs::File::create(&stderr_path)?;
        let child = Command::new(exe)
            .args(["--exact", test, "--nocapture", "--test-threads=1"])
            .env(env_var, arg)
            .stdout(Stdio::null())
            .stderr(Stdio::from(stderr))
            .spawn()?;
        Ok(Self { child, stderr_path })
    }

    /// The child's pid.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL (std's `kill` on Unix), then reaps the child.
    pub fn kill(&mut self) -> std::io::Result<ExitStatus> {
        let _ = self.child.kill(); // already exited is fine
        self.child.wait()
    }

    /// Whether the child has exited, and how.
    pub fn try_wait(&mut self) -> std::io::Result<Option<ExitStatus>> {
        self.child.try_wait()
    }

    /// Waits up to `limit` for the child to exit by itself; kills it after that.
    pub fn wait_or_kill(&mut self, limit: Duration) -> std::io::Result<ExitStatus> {
        let until = Instant::now() + limit;
        while Instant::now() < until {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.kill()
    }

    /// The last `max_bytes` of the child's stderr so far.
    pub fn stderr_tail(&self, max_bytes: usize) -> String {
        let mut buf = Vec::new();
        if let Ok(mut f) = std::fs::File::open(&self.stderr_path) {
            let _ = f.read_to_end(&mut buf);
        }
        let start = buf.len().saturating_sub(max_bytes);
        String::from_utf8_lossy(&buf[start..]).into_owned()
    }
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        let _ = std::fs::remove_file(&self.stderr_path);
    }
}
