//! The harness of the multi-process tests: `kvhandoff node` children on NIXL over loopback,
//! their JSON reports, and the checks every such test shares. Each test crate uses part of it.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;

pub mod pair_cluster;

/// The heartbeat interval the nodes run with, ms.
pub const H_MS: f64 = 200.0;
/// Scheduling slack on top of two heartbeat intervals, ms.
pub const SLACK_MS: f64 = 300.0;
/// The bound on "kill → typed outcome", ms.
pub const BOUND_MS: f64 = 2.0 * H_MS + SLACK_MS;
/// P's lease on finished blocks that no D registered, ms.
pub const LEASE_MS: f64 = 3000.0;
/// D's deadline for P's data, ms (kill-P test).
pub const DECODE_DEADLINE_MS: f64 = 1500.0;
/// Mean gap between prompt arrivals, ms.
pub const GAP_MS: f64 = 20.0;
/// Requests in the whole seeded plan.
pub const REQUESTS: u64 = 120;
/// The fabric bounds both nodes run with (they must agree): they size D's fence, the
/// quarantine, to about 3.7 s (the fence floor counts the 300 ms peer timeout) instead of the production defaults' minutes.
pub const FENCE_FLAGS: [&str; 6] = [
    "--registration-ttl-ms",
    "1000",
    "--max-write-life-ms",
    "1500",
    "--max-message-delay-ms",
    "500",
];
/// How long a test waits for all its processes.
pub const WAIT: Duration = Duration::from_secs(40);

/// The processes of one test share 2 cores: one test at a time.
pub static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

pub fn unix_ms() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_secs_f64()
        * 1e3
}

/// Two free loopback ports (bound, then released for the children to bind), from below the
/// ephemeral range so that NIXL's own sockets cannot take them first.
pub fn two_ports() -> (SocketAddr, SocketAddr) {
    let [a, b] = kvhandoff_testkit::ports::loopback_ports();
    (a, b)
}

/// Three free loopback ports: P's and D's side channels and the router link.
pub fn three_ports() -> (SocketAddr, SocketAddr, SocketAddr) {
    let [a, b, c] = kvhandoff_testkit::ports::loopback_ports();
    (a, b, c)
}

/// One `kvhandoff node` child; killed when dropped unless it was waited for.
pub struct Node {
    name: &'static str,
    child: Option<Child>,
    stderr: Arc<Mutex<String>>,
    stdout: Option<thread::JoinHandle<String>>,
    stderr_thread: Option<thread::JoinHandle<()>>,
}

pub struct Finished {
    pub name: &'static str,
    pub status: Option<ExitStatus>,
    pub stdout: String,
    pub stderr: String,
}

impl Finished {
    pub fn show(&self) -> String {
        format!(
            "--- {}: {:?}\n{}\n--- {} stderr\n{}",
            self.name, self.status, self.stdout, self.name, self.stderr
        )
    }

    pub fn json(&self, all: &str) -> Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("{}'s JSON: {e}\n{all}", self.name))
    }
}

impl Node {
    /// A node with the settings the kill and interference tests share (fast heartbeats, short
    /// leases and fence) plus `extra` flags.
    pub fn start(
        name: &'static str,
        role: &str,
        listen: SocketAddr,
        peer: SocketAddr,
        extra: &[&str],
    ) -> Node {
        Node::start_with(name, role, listen, peer, &[], extra)
    }

    /// [`Node::start`] with some of the shared settings replaced: `overrides` are
    /// `(flag, value)` pairs (`--max-prompt-tokens`, `--pool-blocks`, `--mean-arrival-gap-ms`,
    /// ...).
    pub fn start_with(
        name: &'static str,
        role: &str,
        listen: SocketAddr,
        peer: SocketAddr,
        overrides: &[(&str, &str)],
        extra: &[&str],
    ) -> Node {
        let mut shared: Vec<(&str, String)> = vec![
            ("--seed", "11".into()),
            ("--max-prompt-tokens", "16".into()),
            ("--pool-blocks", "64".into()),
            ("--mean-arrival-gap-ms", GAP_MS.to_string()),
            ("--heartbeat-ms", H_MS.to_string()),
            ("--lease-ms", LEASE_MS.to_string()),
            ("--timeout-secs", "30".into()),
        ];
        for pair in FENCE_FLAGS.chunks(2) {
            shared.push((pair[0], pair[1].into()));
        }
        for (flag, value) in overrides {
            match shared.iter_mut().find(|(f, _)| f == flag) {
                Some(slot) => slot.1 = (*value).into(),
                None => panic!("{flag} is not a shared setting"),
            }
        }
        let mut args: Vec<&str> = Vec::new();
        for (flag, value) in &shared {
            args.push(flag);
            args.push(value);
        }
        args.extend(extra);
        Node::spawn(name, role, listen, peer, &args)
    }

    /// `kvhandoff node --role ROLE --listen LISTEN --peer PEER ARGS... --json`, its output
    /// drained on threads.
    pub fn spawn(
        name: &'static str,
        role: &str,
        listen: SocketAddr,
        peer: SocketAddr,
        args: &[&str],
    ) -> Node {
        Node::spawn_with_env(name, role, listen, peer, args, &[])
    }

    /// [`Node::spawn`] with `env` added to the child's environment.
    pub fn spawn_with_env(
        name: &'static str,
        role: &str,
        listen: SocketAddr,
        peer: SocketAddr,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Node {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvhandoff"))
            .envs(env.iter().copied())
            .args(["node", "--role", role])
            .args(["--listen", &listen.to_string(), "--peer", &peer.to_string()])
            .args(args)
            .arg("--json")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the kvhandoff binary starts");
        // Drain both pipes on threads so that a chatty child never blocks on a full pipe.
        let mut out = child.stdout.take().expect("stdout");
        let stdout = thread::spawn(move || {
            let mut s = String::new();
            let _ = out.read_to_string(&mut s);
            s
        });
        let err = child.stderr.take().expect("stderr");
        let stderr = Arc::new(Mutex::new(String::new()));
        let sink = stderr.clone();
        let stderr_thread = thread::spawn(move || {
            for line in BufReader::new(err).lines() {
                let Ok(line) = line else { break };
                let mut s = sink.lock().unwrap_or_else(|e| e.into_inner());
                s.push_str(&line);
                s.push('\n');
            }
        });
        Node {
            name,
            child: Some(child),
            stderr,
            stdout: Some(stdout),
            stderr_thread: Some(stderr_thread),
        }
    }

    /// The node's stderr so far, readable from another thread while the node runs.
    pub fn stderr_handle(&self) -> Arc<Mutex<String>> {
        self.stderr.clone()
    }

    pub fn stderr(&self) -> String {
        self.stderr
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Waits until the node printed that it runs its schedule (it met its peer).
    pub fn await_schedule(&mut self, deadline: Instant) {
        while !self.stderr().contains("running the schedule") {
            assert!(
                Instant::now() < deadline,
                "{} never started its schedule\n{}",
                self.name,
                self.stderr()
            );
            let exited = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten());
            assert!(
                exited.is_none(),
                "{} exited before its schedule: {exited:?}\n{}",
                self.name,
                self.stderr()
            );
            thread::sleep(Duration::from_millis(5));
        }
    }

    /// Sends `signal` (`STOP`, `CONT`) with `kill(1)`; returns the instant (unix ms) taken just
    /// before it.
    pub fn signal(&mut self, signal: &str) -> f64 {
        let child = self.child.as_ref().expect("a running child");
        let at = unix_ms();
        let status = Command::new("kill")
            .args([format!("-{signal}"), child.id().to_string()])
            .status()
            .expect("kill(1) runs");
        assert!(status.success(), "kill -{signal} {}: {status}", child.id());
        at
    }

    /// Waits until the node stopped itself (`--stop-self-after`: its state in `/proc` is
    /// `T`); returns the instant (unix ms) it was seen stopped.
    pub fn await_stopped(&mut self, deadline: Instant) -> f64 {
        let child = self.child.as_mut().expect("a running child");
        let stat = format!("/proc/{}/stat", child.id());
        loop {
            let state = std::fs::read_to_string(&stat).unwrap_or_default();
            // `pid (comm) S ...`: the state follows the command's closing parenthesis.
            let state = state
                .rsplit(") ")
                .next()
                .and_then(|rest| rest.chars().next());
            if matches!(state, Some('T' | 't')) {
                return unix_ms();
            }
            let exited = child.try_wait().ok().flatten();
            assert!(
                exited.is_none(),
                "{} exited before it stopped itself: {exited:?}\n{}",
                self.name,
                self.stderr()
            );
            assert!(
                Instant::now() < deadline,
                "{} never stopped itself\n{}",
                self.name,
                self.stderr()
            );
            thread::sleep(Duration::from_micros(500));
        }
    }

    /// SIGKILL now; returns the instant (unix ms) taken just before it.
    pub fn kill(&mut self) -> f64 {
        let at = unix_ms();
        let child = self.child.as_mut().expect("a running child");
        child.kill().expect("SIGKILL");
        let _ = child.wait();
        at
    }

    /// Waits for the node until `deadline` (then kills it) and collects its output.
    pub fn finish(mut self, deadline: Instant) -> Finished {
        let mut child = self.child.take().expect("a child");
        let status = loop {
            match child.try_wait().expect("try_wait") {
                Some(status) => break Some(status),
                None if Instant::now() >= deadline => {
                    let _ = child.kill();
                    let _ = child.wait();
                    break None;
                }
                None => thread::sleep(Duration::from_millis(20)),
            }
        };
        let stdout = self
            .stdout
            .take()
            .and_then(|t| t.join().ok())
            .unwrap_or_default();
        if let Some(t) = self.stderr_thread.take() {
            let _ = t.join();
        }
        Finished {
            name: self.name,
            status,
            stdout,
            stderr: self.stderr(),
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Waits for several nodes at once (a P stays until its D exits).
pub fn finish_all(nodes: Vec<Node>, deadline: Instant) -> Vec<Finished> {
    let waiters: Vec<_> = nodes
        .into_iter()
        .map(|n| thread::spawn(move || n.finish(deadline)))
        .collect();
    waiters
        .into_iter()
        .map(|w| w.join().expect("waiter"))
        .collect()
}

/// Starts D (`d_args`, listening on `d_addr`), then P 300 ms later (`p_args`, on `p_addr`),
/// and waits for both until `deadline`: D and P as they ended, and both outputs as one text
/// for assertion messages.
pub fn run_d_then_p(
    (d_addr, d_args): (SocketAddr, &[&str]),
    (p_addr, p_args): (SocketAddr, &[&str]),
    deadline: Instant,
) -> (Finished, Finished, String) {
    let d = Node::spawn("D", "decode", d_addr, p_addr, d_args);
    thread::sleep(Duration::from_millis(300));
    let p = Node::spawn("P", "prefill", p_addr, d_addr, p_args);
    let mut done = finish_all(vec![d, p], deadline).into_iter();
    let (d, p) = (done.next().expect("D"), done.next().expect("P"));
    let both = format!("{}\n{}", d.show(), p.show());
    (d, p, both)
}

pub fn require_runtime() {
    if let Err(e) = kvhandoff_actors::transport::nixl::nixl_runtime_available() {
        panic!("the kill tests need the NIXL runtime (source scripts/nixl-env.sh): {e}");
    }
}

pub fn f(v: &Value) -> Option<f64> {
    v.as_f64()
}

/// One request of a node's JSON.
#[derive(Debug)]
pub struct End {
    pub index: u64,
    pub outcome: String,
    pub events: u64,
    pub called: Option<f64>,
    pub ended: Option<f64>,
    /// D: when the engine was told the request failed while its blocks stayed fenced.
    pub fenced: Option<f64>,
    pub byte_errors: u64,
    /// What freed its blocks when no transfer proved it (D: a failed pushed request; P: a
    /// pulled one).
    pub proof: Option<String>,
    /// Conversations: how a later turn's prefix came (P) or a keep ended (D).
    pub turn: Option<String>,
    /// P: when it asked to read a later turn's prefix back.
    pub turn_called: Option<f64>,
    /// When that ended.
    pub turn_ended: Option<f64>,
}

pub fn ends(report: &Value) -> Vec<End> {
    report["node"]["requests"]
        .as_array()
        .expect("node.requests")
        .iter()
        .map(|r| End {
            index: r["index"].as_u64().expect("index"),
            outcome: r["outcome"].as_str().unwrap_or("none").to_string(),
            events: r["events"].as_u64().unwrap_or(0),
            called: f(&r["called_unix_ms"]),
            ended: f(&r["ended_unix_ms"]),
            fenced: f(&r["fenced_unix_ms"]),
            byte_errors: r["byte_errors"].as_u64().unwrap_or(0),
            proof: r["proof"].as_str().map(str::to_string),
            turn: r["turn"].as_str().map(str::to_string),
            turn_called: f(&r["turn_called_unix_ms"]),
            turn_ended: f(&r["turn_ended_unix_ms"]),
        })
        .collect()
}

/// Checks shared by every node: one typed outcome per request, all blocks back, no error that
/// a typed outcome does not explain.
pub fn check_node(report: &Value, requests: u64, all: &str) {
    let node = &report["node"];
    assert_eq!(node["ok"], true, "node verdict\n{all}");
    let list = ends(report);
    assert_eq!(list.len() as u64, requests, "{all}");
    for r in &list {
        // A request that never started anything (D never got P's answer, or a later turn
        // whose conversation ended before it) has its typed outcome and no event.
        let events = match r.outcome.as_str() {
            "NoAnswer" | "Abandoned" => 0,
            _ => 1,
        };
        assert_eq!(
            r.events, events,
            "request {} ({}) has {} events\n{all}",
            r.index, r.outcome, r.events
        );
        assert_ne!(
            r.outcome, "none",
            "request {} has no outcome\n{all}",
            r.index
        );
        assert!(
            r.ended.is_some() || r.outcome == "Abandoned",
            "request {} has no end time\n{all}",
            r.index
        );
    }
    assert_eq!(
        node["pool"]["free_at_end"], node["pool"]["blocks"],
        "every block back\n{all}"
    );
    assert_eq!(node["pool"]["double_frees"], 0, "{all}");
    assert_eq!(
        node["unexplained_errors"].as_array().map(Vec::len),
        Some(0),
        "{all}"
    );
}

/// A D request that ended after P's kill: `Ready` (P1's write had landed) within the bound;
/// `Failed(PeerDead)` either at once (`NeverExposed`: it had not registered) or after the fence
/// (`DeadPeerFence`): not before D declared the death plus the quarantine — the blocks were
/// held while a falsely-dead P could still write — and within the bound after that.
pub fn check_fenced_end(r: &End, since_kill: f64, detected: f64, quarantine: f64, all: &str) {
    match (r.outcome.as_str(), r.proof.as_deref()) {
        ("Ready", _) | ("Failed(PeerDead)", Some("NeverExposed")) => assert!(
            since_kill <= BOUND_MS,
            "request {} ({}, {:?}) ended {since_kill:.0} ms after the kill\n{all}",
            r.index,
            r.outcome,
            r.proof
        ),
        ("Failed(PeerDead)", Some("DeadPeerFence")) => {
            // The node notes the death on a 10 ms watch: allow that much early.
            assert!(
                since_kill >= detected + quarantine - 20.0,
                "request {} freed {since_kill:.0} ms after the kill, before the fence \
                 (death seen at {detected:.0} ms, quarantine {quarantine:.0} ms)\n{all}",
                r.index
            );
            assert!(
                since_kill <= BOUND_MS + quarantine,
                "request {} freed {since_kill:.0} ms after the kill (bound {:.0} ms)\n{all}",
                r.index,
                BOUND_MS + quarantine
            );
        }
        (outcome, proof) => panic!(
            "request {}: {outcome} with proof {proof:?} after P's kill\n{all}",
            r.index
        ),
    }
}

/// The peer's death was declared after the kill and within the bound; returns the delay, ms.
pub fn check_detection(report: &Value, killed: f64, who: &str, all: &str) -> f64 {
    check_detection_within(report, killed, BOUND_MS, who, all)
}

/// [`check_detection`] with another bound (nodes run with another heartbeat), ms.
pub fn check_detection_within(
    report: &Value,
    killed: f64,
    bound: f64,
    who: &str,
    all: &str,
) -> f64 {
    let deaths = report["node"]["peer_deaths"].as_u64().unwrap_or(0);
    assert!(deaths >= 1, "{who} counted no peer death\n{all}");
    let seen = report["node"]["peer_deaths_seen_unix_ms"][0]
        .as_f64()
        .unwrap_or_else(|| panic!("{who} saw no death\n{all}"));
    let delay = seen - killed;
    assert!(
        (0.0..=bound).contains(&delay),
        "{who} saw the death {delay:.0} ms after the kill (bound {bound} ms)\n{all}"
    );
    delay
}
