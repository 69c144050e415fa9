//! Kill tests: `kvhandoff node` processes over NIXL (UCX) on loopback, one of them killed with
//! SIGKILL in the middle of the run and restarted. The survivor must declare the peer dead
//! within two heartbeat intervals of the kill, give every affected request a typed terminal
//! outcome (P at once; D after its fence: blocks exposed to a P declared dead come back only
//! after the quarantine, since a falsely-dead P's writes would still land), free all its
//! blocks, and serve the restarted peer. Needs the NIXL runtime:
//! `source scripts/nixl-env.sh && cargo test --features nixl --test kill`.
//!
//! Both tests run the nodes with `--heartbeat-ms 200` (peer timeout 300 ms). "Within two
//! heartbeat intervals" is checked as `2 H + SLACK`: [`SLACK`] covers the test's own polling,
//! the node's 10 ms counter watch and scheduling on a loaded 2-core machine. Kill instants are
//! taken just before the SIGKILL, so every measured delay is an over-estimate.
//!
//! Every wait has a deadline, and every child is killed when its guard drops (a failing test
//! leaves no process behind).
#![cfg(feature = "nixl")]

use std::io::{BufRead, BufReader, Read};
use std::net::{SocketAddr, TcpListener};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;

/// The heartbeat interval the nodes run with, ms.
const H_MS: f64 = 200.0;
/// Scheduling slack on top of two heartbeat intervals, ms.
const SLACK_MS: f64 = 300.0;
/// The bound on "kill → typed outcome", ms.
const BOUND_MS: f64 = 2.0 * H_MS + SLACK_MS;
/// P's lease on finished blocks that no D registered, ms.
const LEASE_MS: f64 = 3000.0;
/// D's deadline for P's data, ms (kill-P test).
const DECODE_DEADLINE_MS: f64 = 1500.0;
/// Mean gap between prompt arrivals, ms.
const GAP_MS: f64 = 20.0;
/// Requests in the whole seeded plan.
const REQUESTS: u64 = 120;
/// The fabric bounds both nodes run with (they must agree): they size D's fence, the
/// quarantine, to about 3.4 s instead of the production defaults' minutes.
const FENCE_FLAGS: [&str; 6] = [
    "--registration-ttl-ms",
    "1000",
    "--max-write-life-ms",
    "1500",
    "--max-message-delay-ms",
    "500",
];
/// How long a test waits for all its processes.
const WAIT: Duration = Duration::from_secs(40);

/// The processes of one test share 2 cores: one test at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn unix_ms() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_secs_f64()
        * 1e3
}

/// Two free loopback ports (bound, then released for the children to bind).
fn two_ports() -> (SocketAddr, SocketAddr) {
    let a = TcpListener::bind("127.0.0.1:0").expect("bind");
    let b = TcpListener::bind("127.0.0.1:0").expect("bind");
    (a.local_addr().unwrap(), b.local_addr().unwrap())
}

/// One `kvhandoff node` child; killed when dropped unless it was waited for.
struct Node {
    name: &'static str,
    child: Option<Child>,
    stderr: Arc<Mutex<String>>,
    stdout: Option<thread::JoinHandle<String>>,
    stderr_thread: Option<thread::JoinHandle<()>>,
}

struct Finished {
    name: &'static str,
    status: Option<ExitStatus>,
    stdout: String,
    stderr: String,
}

impl Finished {
    fn show(&self) -> String {
        format!(
            "--- {}: {:?}\n{}\n--- {} stderr\n{}",
            self.name, self.status, self.stdout, self.name, self.stderr
        )
    }

    fn json(&self, all: &str) -> Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("{}'s JSON: {e}\n{all}", self.name))
    }
}

impl Node {
    fn start(
        name: &'static str,
        role: &str,
        listen: SocketAddr,
        peer: SocketAddr,
        extra: &[&str],
    ) -> Node {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvhandoff"))
            .args(["node", "--role", role])
            .args(["--listen", &listen.to_string(), "--peer", &peer.to_string()])
            .args([
                "--seed",
                "11",
                "--max-prompt-tokens",
                "16",
                "--pool-blocks",
                "64",
            ])
            .args(["--mean-arrival-gap-ms", &GAP_MS.to_string()])
            .args(["--heartbeat-ms", &H_MS.to_string()])
            .args(["--lease-ms", &LEASE_MS.to_string()])
            .args(FENCE_FLAGS)
            .args(["--timeout-secs", "30", "--json"])
            .args(extra)
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

    fn stderr(&self) -> String {
        self.stderr
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Waits until the node printed that it runs its schedule (it met its peer).
    fn await_schedule(&mut self, deadline: Instant) {
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

    /// SIGKILL now; returns the instant (unix ms) taken just before it.
    fn kill(&mut self) -> f64 {
        let at = unix_ms();
        let child = self.child.as_mut().expect("a running child");
        child.kill().expect("SIGKILL");
        let _ = child.wait();
        at
    }

    /// Waits for the node until `deadline` (then kills it) and collects its output.
    fn finish(mut self, deadline: Instant) -> Finished {
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
fn finish_all(nodes: Vec<Node>, deadline: Instant) -> Vec<Finished> {
    let waiters: Vec<_> = nodes
        .into_iter()
        .map(|n| thread::spawn(move || n.finish(deadline)))
        .collect();
    waiters
        .into_iter()
        .map(|w| w.join().expect("waiter"))
        .collect()
}

fn require_runtime() {
    if let Err(e) = kvhandoff::actors::transport::nixl::nixl_runtime_available() {
        panic!("the kill tests need the NIXL runtime (source scripts/nixl-env.sh): {e}");
    }
}

fn f(v: &Value) -> Option<f64> {
    v.as_f64()
}

/// One request of a node's JSON.
struct End {
    index: u64,
    outcome: String,
    events: u64,
    called: Option<f64>,
    ended: Option<f64>,
    byte_errors: u64,
    /// D, for a failed request: what freed its blocks.
    proof: Option<String>,
}

fn ends(report: &Value) -> Vec<End> {
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
            byte_errors: r["byte_errors"].as_u64().unwrap_or(0),
            proof: r["proof"].as_str().map(str::to_string),
        })
        .collect()
}

/// Checks shared by every node: one typed outcome per request, all blocks back, no error that
/// a typed outcome does not explain.
fn check_node(report: &Value, requests: u64, all: &str) {
    let node = &report["node"];
    assert_eq!(node["ok"], true, "node verdict\n{all}");
    let list = ends(report);
    assert_eq!(list.len() as u64, requests, "{all}");
    for r in &list {
        assert_eq!(
            r.events, 1,
            "request {} has {} events\n{all}",
            r.index, r.events
        );
        assert_ne!(
            r.outcome, "none",
            "request {} has no outcome\n{all}",
            r.index
        );
        assert!(
            r.ended.is_some(),
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
fn check_fenced_end(r: &End, since_kill: f64, detected: f64, quarantine: f64, all: &str) {
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
fn check_detection(report: &Value, killed: f64, who: &str, all: &str) -> f64 {
    let deaths = report["node"]["peer_deaths"].as_u64().unwrap_or(0);
    assert!(deaths >= 1, "{who} counted no peer death\n{all}");
    let seen = report["node"]["peer_deaths_seen_unix_ms"][0]
        .as_f64()
        .unwrap_or_else(|| panic!("{who} saw no death\n{all}"));
    let delay = seen - killed;
    assert!(
        (0.0..=BOUND_MS).contains(&delay),
        "{who} saw the death {delay:.0} ms after the kill (bound {BOUND_MS} ms)\n{all}"
    );
    delay
}

/// kill -9 of D in the middle of the run; D restarted with the rest of the plan.
///
/// P (`--requests 120`) and D1 (`--requests 60`, the plan's first half) run; 500 ms into the
/// schedule D1 is killed and D2 starts with `--start-at 60 --requests 120`. P (the survivor,
/// `--expect-peer-loss`) keeps running and takes D2's handshake as a restart. From P's JSON:
/// - every request has exactly one typed outcome; P's pool is all free; no unexplained error;
/// - P declared D dead after the kill and within `2 H + SLACK`;
/// - requests 0..60: ended before the kill → `Sent`; otherwise one of
///   - `Sent` ending within the bound (a write in flight at the kill that had landed),
///   - `Released(PeerDead)` / `Released(WriteFailed(..))` within the bound (bound to D1),
///   - `Released(LeaseExpired)` one lease after P finished it (or after the kill, whichever is
///     later): P holds finished blocks no live D registered — D1 never registered them, or its
///     registration was pending when it died (P drops pending registrations of a dead peer and
///     cannot tell which D a held request is for) — until the lease ends;
/// - requests 60..120: `Sent`, and D2's JSON has all 60 `Ready` with 0 byte errors.
#[test]
fn kill_decode_mid_run_then_restart_it() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    require_runtime();
    let started = Instant::now();
    let deadline = started + WAIT;
    let (p_addr, d_addr) = two_ports();
    let n = REQUESTS.to_string();
    let p = Node::start(
        "P",
        "prefill",
        p_addr,
        d_addr,
        &[
            "--requests",
            &n,
            "--expect-peer-loss",
            "--linger-ms",
            "8000",
        ],
    );
    let mut d1 = Node::start("D1", "decode", d_addr, p_addr, &["--requests", "60"]);
    d1.await_schedule(deadline);
    thread::sleep(Duration::from_millis(500));
    let killed = d1.kill();
    let d1_err = d1.stderr();
    drop(d1);
    let d2 = Node::start(
        "D2",
        "decode",
        d_addr,
        p_addr,
        &["--requests", &n, "--start-at", "60"],
    );
    let done = finish_all(vec![p, d2], deadline);
    let took = started.elapsed();
    let all = format!(
        "--- D1 stderr (killed)\n{d1_err}\n{}\n{}",
        done[0].show(),
        done[1].show()
    );
    let (p, d2) = (&done[0], &done[1]);
    assert!(
        p.status.is_some() && d2.status.is_some(),
        "killed at the deadline\n{all}"
    );

    let pv = p.json(&all);
    check_node(&pv, REQUESTS, &all);
    let detected = check_detection(&pv, killed, "P", &all);
    let mut counts = std::collections::BTreeMap::<String, u64>::new();
    let (mut bound, mut bound_worst) = (0, 0.0f64);
    for r in ends(&pv) {
        let ended = r.ended.unwrap_or(f64::NAN);
        let since_kill = ended - killed;
        *counts.entry(r.outcome.clone()).or_default() += 1;
        if r.index >= 60 {
            assert_eq!(r.outcome, "Sent", "request {} (D2's part)\n{all}", r.index);
            continue;
        }
        if since_kill < 0.0 {
            assert_eq!(
                r.outcome, "Sent",
                "request {} ended before the kill\n{all}",
                r.index
            );
            continue;
        }
        match r.outcome.as_str() {
            "Sent" | "Released(PeerDead)" => {
                bound += 1;
                bound_worst = bound_worst.max(since_kill);
                assert!(
                    since_kill <= BOUND_MS,
                    "request {} ended {} {since_kill:.0} ms after the kill\n{all}",
                    r.index,
                    r.outcome
                );
            }
            o if o.starts_with("Released(WriteFailed(") => {
                bound += 1;
                bound_worst = bound_worst.max(since_kill);
                assert!(since_kill <= BOUND_MS, "request {}: {o}\n{all}", r.index);
            }
            "Released(LeaseExpired)" => {
                let called = r.called.expect("a finished request has a call time");
                let earliest = called + LEASE_MS - SLACK_MS;
                let latest = called.max(killed) + LEASE_MS + SLACK_MS;
                assert!(
                    (earliest..=latest).contains(&ended),
                    "request {}: lease expired {:.0} ms after its finish (lease {LEASE_MS})\n{all}",
                    r.index,
                    ended - called
                );
            }
            o => panic!("request {}: unexpected outcome {o}\n{all}", r.index),
        }
    }

    let dv = d2.json(&all);
    check_node(&dv, REQUESTS - 60, &all);
    assert_eq!(dv["requests"], REQUESTS - 60, "{all}");
    assert_eq!(dv["outcomes"]["ready"], REQUESTS - 60, "{all}");
    assert_eq!(dv["verified"], REQUESTS - 60, "{all}");
    assert_eq!(dv["byte_errors"], 0, "{all}");
    assert_eq!(dv["ok"], true, "D2's strict verdict\n{all}");
    assert_eq!(dv["node"]["start_at"], 60, "{all}");
    for r in ends(&dv) {
        assert!(
            r.index >= 60 && r.outcome == "Ready" && r.byte_errors == 0,
            "{all}"
        );
    }
    assert!(p.status.is_some_and(|s| s.success()), "P's exit\n{all}");
    assert!(d2.status.is_some_and(|s| s.success()), "D2's exit\n{all}");
    println!(
        "kill D: P saw the death {detected:.0} ms after the kill (bound {BOUND_MS} ms); \
         {bound} requests bound to D1 at the kill ended within {bound_worst:.0} ms; \
         P outcomes {counts:?}; \
         all done in {took:?}"
    );
}

/// kill -9 of P in the middle of the run; P restarted with a later part of the plan.
///
/// D (`--requests 120 --expect-peer-loss --decode-deadline-ms 1500`) and P1 (`--requests 120`)
/// run; 400 ms into the schedule P1 is killed and P2 starts with `--start-at K`, K being the
/// first request the schedule brings well after P2 can be up (about 1.2 s later; the mean
/// arrival gap is 20 ms). From D's JSON:
/// - every request has exactly one typed outcome; D's pool is all free; no unexplained error;
/// - D declared P dead after the kill and within `2 H + SLACK`;
/// - requests that ended before the kill: `Ready`;
/// - requests live at the kill (allocated before it, not ended): `Ready` (P1's write had landed)
///   within `2 H + SLACK` of the kill, or `Failed(PeerDead)`: at once if never registered,
///   otherwise after D's fence (no earlier than the death plus the quarantine, no later than
///   `2 H + SLACK` plus the quarantine) — see [`check_fenced_end`];
/// - requests allocated after the kill, in the gap:
///   - `Failed(PeerDead)` after the fence: registered with the dead P before D noticed;
///   - `Failed(HandshakeFailed)`: allocated while no P listened (the connect is refused), ended
///     at once (within the bound of the call);
///   - `Failed(Deadline)` for `index < K`: allocated once P2 was up; P2 never prefills them
///     (its plan starts at K), so D's deadline ends them, one deadline after the call;
/// - requests `K..`: `Ready` with 0 byte errors; P2's JSON: all sent, strict verdict OK.
#[test]
fn kill_prefill_mid_run_then_restart_it() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    require_runtime();
    let started = Instant::now();
    let deadline = started + WAIT;
    let (p_addr, d_addr) = two_ports();
    let n = REQUESTS.to_string();
    let mut d = Node::start(
        "D",
        "decode",
        d_addr,
        p_addr,
        &[
            "--requests",
            &n,
            "--expect-peer-loss",
            "--decode-deadline-ms",
            &DECODE_DEADLINE_MS.to_string(),
        ],
    );
    let mut p1 = Node::start("P1", "prefill", p_addr, d_addr, &["--requests", &n]);
    d.await_schedule(deadline);
    let met = Instant::now();
    thread::sleep(Duration::from_millis(400));
    let killed = p1.kill();
    let p1_err = p1.stderr();
    drop(p1);
    // The first request due 1.2 s after now on D's schedule (arrivals 20 ms apart on average).
    let due = met.elapsed().as_secs_f64() * 1e3 + 1200.0;
    let k = ((due / GAP_MS).ceil() as u64).min(REQUESTS - 10);
    let p2 = Node::start(
        "P2",
        "prefill",
        p_addr,
        d_addr,
        &[
            "--requests",
            &n,
            "--start-at",
            &k.to_string(),
            "--linger-ms",
            "8000",
        ],
    );
    let done = finish_all(vec![d, p2], deadline);
    let took = started.elapsed();
    let all = format!(
        "K = {k}\n--- P1 stderr (killed)\n{p1_err}\n{}\n{}",
        done[0].show(),
        done[1].show()
    );
    let (d, p2) = (&done[0], &done[1]);
    assert!(
        d.status.is_some() && p2.status.is_some(),
        "killed at the deadline\n{all}"
    );

    let dv = d.json(&all);
    check_node(&dv, REQUESTS, &all);
    let detected = check_detection(&dv, killed, "D", &all);
    let quarantine = dv["node"]["quarantine_ms"]
        .as_f64()
        .unwrap_or_else(|| panic!("D reports its quarantine\n{all}"));
    assert!(
        quarantine < 5_000.0,
        "the fence flags took: {quarantine} ms\n{all}"
    );
    let mut counts = std::collections::BTreeMap::<String, u64>::new();
    let (mut live, mut live_worst) = (0, 0.0f64);
    for r in ends(&dv) {
        let ended = r.ended.unwrap_or(f64::NAN);
        let called = r.called.expect("an allocated request has a call time");
        let since_kill = ended - killed;
        *counts.entry(r.outcome.clone()).or_default() += 1;
        if r.outcome == "Ready" {
            assert_eq!(r.byte_errors, 0, "request {}\n{all}", r.index);
        }
        if r.index >= k {
            assert_eq!(
                r.outcome,
                "Ready",
                "request {} (P2's part) allocated {:.0} ms after the kill\n{all}",
                r.index,
                called - killed
            );
            continue;
        }
        if since_kill < 0.0 {
            assert_eq!(
                r.outcome, "Ready",
                "request {} ended before the kill\n{all}",
                r.index
            );
            continue;
        }
        if called < killed {
            // Live at the kill.
            live += 1;
            live_worst = live_worst.max(since_kill);
            assert!(
                r.outcome == "Failed(PeerDead)" || r.outcome == "Ready",
                "request {} live at the kill ended {}\n{all}",
                r.index,
                r.outcome
            );
            check_fenced_end(&r, since_kill, detected, quarantine, &all);
            continue;
        }
        match r.outcome.as_str() {
            // Registered with the dead P before D noticed.
            "Failed(PeerDead)" => {
                live += 1;
                live_worst = live_worst.max(since_kill);
                check_fenced_end(&r, since_kill, detected, quarantine, &all);
            }
            "Failed(HandshakeFailed)" => assert!(
                ended - called <= BOUND_MS,
                "request {}: refused handshake took {:.0} ms\n{all}",
                r.index,
                ended - called
            ),
            "Failed(Deadline)" => {
                let waited = ended - called;
                assert!(
                    (DECODE_DEADLINE_MS - SLACK_MS..=DECODE_DEADLINE_MS + BOUND_MS)
                        .contains(&waited),
                    "request {}: deadline after {waited:.0} ms\n{all}",
                    r.index
                );
            }
            o => panic!(
                "request {}: unexpected outcome {o} in the gap\n{all}",
                r.index
            ),
        }
    }

    let pv = p2.json(&all);
    check_node(&pv, REQUESTS - k, &all);
    assert_eq!(pv["prefill_outcomes"]["sent"], REQUESTS - k, "{all}");
    assert_eq!(pv["ok"], true, "P2's strict verdict\n{all}");
    assert!(d.status.is_some_and(|s| s.success()), "D's exit\n{all}");
    assert!(p2.status.is_some_and(|s| s.success()), "P2's exit\n{all}");
    println!(
        "kill P: D saw the death {detected:.0} ms after the kill (bound {BOUND_MS} ms); \
         {live} requests live at the kill (or sent to the dead P) ended within \
         {live_worst:.0} ms; K = {k}; \
         D outcomes {counts:?}; all done in {took:?}"
    );
}
