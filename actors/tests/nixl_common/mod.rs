//! What the real-NIXL integration tests (`nixl_transport`, `nixl_stall`) share: the deadline
//! every wait polls against, the serialization of a binary's tests, names and addresses, raw
//! nixl-sys agents configured like `NixlTransport`, and child tests: a parent re-runs its own
//! test binary (`std::env::current_exe()`) with one `#[ignore]`d child test of the same binary
//! as the filter, so a child test lives in the same file as the tests that start it.

// Each test crate uses only part of this module.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, TryRecvError};
use std::sync::{Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use kvhandoff_actors::transport::nixl::{nixl_runtime_available, NixlConfig};
use kvhandoff_protocol::{AgentName, EngineId, PeerAddr};

/// Every wait of these tests polls against this deadline; nothing waits unbounded.
pub const DEADLINE: Duration = Duration::from_secs(30);
/// How long a test watches for something that must *not* happen.
pub const QUIET: Duration = Duration::from_millis(500);
/// Environment variable naming the child test a parent started.
const CHILD_ENV: &str = "KVH_NIXL_TRANSPORT_CHILD";

/// NIXL keeps process-wide state (plugin manager, UCX contexts); the tests of this binary take
/// turns so they neither race on it nor skew the timings.
static NIXL_SERIAL: Mutex<()> = Mutex::new(());

pub fn serial() -> MutexGuard<'static, ()> {
    NIXL_SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

pub fn require_runtime() {
    if let Err(err) = nixl_runtime_available() {
        panic!("{err}");
    }
}

pub fn name(s: &str) -> AgentName {
    AgentName::new(s).expect("valid agent name")
}

pub fn addr(engine: &str) -> PeerAddr {
    PeerAddr::new(EngineId::new(engine).expect("valid engine id"), 0)
}

/// Polls `poll` until it yields a value, panicking after [`DEADLINE`].
pub fn wait_for<T>(what: &str, mut poll: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(value) = poll() {
            return value;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "timed out after {DEADLINE:?} waiting for {what}"
        );
        thread::yield_now();
    }
}

/// Re-runs this test binary with `test` as the only (ignored) test, with extra environment;
/// panics unless it passes within [`DEADLINE`]. Returns its output.
pub fn run_child(test: &str, envs: &[(&str, &str)], unset: &[&str]) -> String {
    spawn_child(test, envs, unset).finish()
}

/// A child test started by [`spawn_child`]: its stdin, and its stdout lines as they come. A
/// child still running when this is dropped (the parent panicked) is killed, stopped or not.
pub struct ChildTest {
    test: String,
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    out: Option<JoinHandle<String>>,
    err: Option<JoinHandle<String>>,
}

/// Starts this test binary with `test` as the only (ignored) test, with extra environment and
/// piped stdin/stdout/stderr; see [`ChildTest`].
pub fn spawn_child(test: &str, envs: &[(&str, &str)], unset: &[&str]) -> ChildTest {
    let exe = std::env::current_exe().expect("test binary path");
    let mut cmd = Command::new(exe);
    cmd.args([
        "--exact",
        test,
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(CHILD_ENV, test)
    .stdin(Stdio::piped())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    for k in unset {
        cmd.env_remove(k);
    }
    let mut child = cmd.spawn().expect("spawn child test");
    let stdin = child.stdin.take();
    let stdout = child.stdout.take().expect("stdout");
    let mut stderr = child.stderr.take().expect("stderr");
    let (tx, lines) = mpsc::channel();
    let out = thread::spawn(move || {
        let mut all = String::new();
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            all.push_str(&line);
            all.push('\n');
            let _ = tx.send(line);
        }
        all
    });
    let err = thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut s);
        s
    });
    ChildTest {
        test: test.to_owned(),
        child,
        stdin,
        lines,
        out: Some(out),
        err: Some(err),
    }
}

impl ChildTest {
    pub fn pid(&self) -> i32 {
        i32::try_from(self.child.id()).expect("pid fits an i32")
    }

    /// Sends one line to the child's stdin.
    pub fn send_line(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().expect("stdin still open");
        writeln!(stdin, "{line}").expect("write to the child's stdin");
        stdin.flush().expect("flush the child's stdin");
    }

    /// Waits (up to [`DEADLINE`]) for a stdout line containing `marker`; returns the text from
    /// the marker on (libtest may print `test ... ` before the child's first line). Lines
    /// without it are skipped (they stay in the output [`ChildTest::finish`] returns).
    pub fn expect_line(&mut self, marker: &str) -> String {
        let start = Instant::now();
        loop {
            let left = DEADLINE.saturating_sub(start.elapsed());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    if let Some(at) = line.find(marker) {
                        return line[at..].to_owned();
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    let output = self.kill_and_collect();
                    panic!(
                        "child {} printed no {marker:?} within {DEADLINE:?}:\n{output}",
                        self.test
                    )
                }
                Err(RecvTimeoutError::Disconnected) => {
                    let output = self.kill_and_collect();
                    panic!(
                        "child {} ended before printing {marker:?}:\n{output}",
                        self.test
                    )
                }
            }
        }
    }

    /// A stdout line containing `marker` if one has arrived (from the marker on), without
    /// waiting; lines without it are skipped.
    pub fn try_line(&mut self, marker: &str) -> Option<String> {
        loop {
            match self.lines.try_recv() {
                Ok(line) => {
                    if let Some(at) = line.find(marker) {
                        return Some(line[at..].to_owned());
                    }
                }
                Err(TryRecvError::Empty | TryRecvError::Disconnected) => return None,
            }
        }
    }

    pub fn kill_and_collect(&mut self) -> String {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.collect()
    }

    pub fn collect(&mut self) -> String {
        let join = |h: Option<JoinHandle<String>>| h.map(|h| h.join().unwrap_or_default());
        format!(
            "{}{}",
            join(self.out.take()).unwrap_or_default(),
            join(self.err.take()).unwrap_or_default()
        )
    }

    /// Closes stdin and waits (up to [`DEADLINE`]) for the child to end; panics unless its one
    /// test passed. Returns its output.
    pub fn finish(mut self) -> String {
        drop(self.stdin.take());
        let start = Instant::now();
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("child status") {
                break Some(status);
            }
            if start.elapsed() > DEADLINE {
                let _ = self.child.kill();
                let _ = self.child.wait();
                break None;
            }
            thread::sleep(Duration::from_millis(10));
        };
        let output = self.collect();
        let test = &self.test;
        match status {
            None => panic!("child {test} timed out after {DEADLINE:?}:\n{output}"),
            Some(s) if !s.success() || !output.contains("1 passed") => {
                panic!("child {test} failed ({s}):\n{output}")
            }
            Some(_) => output,
        }
    }
}

impl Drop for ChildTest {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Whether this process is the child started for `test` (else the test returns at once).
pub fn is_child(test: &str) -> bool {
    std::env::var(CHILD_ENV).as_deref() == Ok(test)
}

/// The median of `v` (the upper one of an even count).
pub fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// A raw nixl-sys agent configured like `NixlTransport` (progress thread on, its default
/// `pthr_delay_us`) with the UCX backend, and `OptArgs` naming that backend.
pub fn raw_agent(name: &str) -> (nixl_sys::Agent, nixl_sys::OptArgs) {
    use nixl_sys::{Agent, AgentConfig, OptArgs};
    let defaults = NixlConfig::default();
    let config = AgentConfig {
        enable_prog_thread: defaults.progress_thread,
        pthr_delay_us: defaults.pthr_delay_us,
        ..AgentConfig::default()
    };
    let agent = Agent::new_configured(name, &config).unwrap();
    let (_, params) = agent.get_plugin_params("UCX").unwrap();
    let backend = agent.create_backend("UCX", &params).unwrap();
    let mut args = OptArgs::new().unwrap();
    args.add_backend(&backend).unwrap();
    (agent, args)
}
