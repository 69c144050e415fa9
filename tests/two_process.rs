//! `kvhandoff node` end to end: P and D as two processes on loopback, handshaking over the TCP
//! side channel and moving every byte over NIXL (UCX). Needs the NIXL runtime:
//! `source scripts/nixl-env.sh && cargo test --features nixl --test two_process`.
//!
//! Each test starts the two roles in one order (D first, P first), 200 requests with small
//! prompts (one 512 KiB block each, so the unoptimized binary keeps up with the arrivals), waits
//! for both with a deadline (killing them past it) and checks both reports.
#![cfg(feature = "nixl")]

use std::io::Read;
use std::net::{SocketAddr, TcpListener};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use serde_json::Value;

const REQUESTS: u64 = 200;

/// The two processes of one test share 2 cores with the other test's: one test at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// How long a test waits for both processes before killing them.
const WAIT: Duration = Duration::from_secs(90);

/// Two free loopback ports (bound, then released for the children to bind).
fn two_ports() -> (SocketAddr, SocketAddr) {
    let a = TcpListener::bind("127.0.0.1:0").expect("bind");
    let b = TcpListener::bind("127.0.0.1:0").expect("bind");
    (a.local_addr().unwrap(), b.local_addr().unwrap())
}

fn start(role: &str, listen: SocketAddr, peer: SocketAddr) -> Child {
    Command::new(env!("CARGO_BIN_EXE_kvhandoff"))
        .args(["node", "--role", role])
        .args(["--listen", &listen.to_string(), "--peer", &peer.to_string()])
        .args(["--requests", &REQUESTS.to_string(), "--seed", "11"])
        .args(["--max-prompt-tokens", "16", "--pool-blocks", "32"])
        .args([
            "--mean-arrival-gap-ms",
            "12",
            "--timeout-secs",
            "60",
            "--json",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the kvhandoff binary starts")
}

struct Finished {
    status: Option<ExitStatus>,
    stdout: String,
    stderr: String,
}

/// Waits for `child` until `deadline`, then kills it; collects its output.
fn finish(mut child: Child, deadline: Instant) -> Finished {
    // Drain the pipes on threads so that a chatty child never blocks on a full pipe.
    let mut out = child.stdout.take().expect("stdout");
    let mut err = child.stderr.take().expect("stderr");
    let out = thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let err = thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
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
    Finished {
        status,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    }
}

fn run_pair(decode_first: bool) {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    if let Err(e) = kvhandoff::actors::transport::nixl::nixl_runtime_available() {
        panic!("{e}");
    }
    let (p_addr, d_addr) = two_ports();
    let started = Instant::now();
    let (first, second) = if decode_first {
        ("decode", "prefill")
    } else {
        ("prefill", "decode")
    };
    let addrs = |role| match role {
        "decode" => (d_addr, p_addr),
        _ => (p_addr, d_addr),
    };
    let (l, p) = addrs(first);
    let a = start(first, l, p);
    // The second one comes a little later: the first must wait for it.
    thread::sleep(Duration::from_millis(300));
    let (l, p) = addrs(second);
    let b = start(second, l, p);
    let deadline = Instant::now() + WAIT;
    // Both are waited for concurrently: P stays until D has exited.
    let a = thread::spawn(move || finish(a, deadline));
    let b = finish(b, deadline);
    let a = a.join().expect("waiter");
    let (d, p) = if decode_first { (a, b) } else { (b, a) };
    let took = started.elapsed();
    let show = |name: &str, f: &Finished| {
        format!(
            "--- {name}: {:?}\n{}\n--- {name} stderr\n{}",
            f.status, f.stdout, f.stderr
        )
    };
    let both = format!("{}\n{}", show("D", &d), show("P", &p));
    println!("{} first: both done in {took:?}\n{both}", first);
    assert!(
        d.status.is_some() && p.status.is_some(),
        "killed at the deadline\n{both}"
    );

    let dv: Value =
        serde_json::from_str(&d.stdout).unwrap_or_else(|e| panic!("D's JSON: {e}\n{both}"));
    assert_eq!(dv["transport"], "nixl", "{both}");
    assert_eq!(dv["role"], "decode", "{both}");
    assert_eq!(dv["requests"], REQUESTS, "{both}");
    assert_eq!(dv["verified"], REQUESTS, "{both}");
    assert_eq!(dv["byte_errors"], 0, "{both}");
    assert_eq!(dv["outcomes"]["ready"], REQUESTS, "{both}");
    assert_eq!(dv["outcomes"]["failed"], 0, "{both}");
    assert_eq!(dv["bytes"], dv["expected_bytes"], "{both}");
    for race in ["decode_registers_first", "prefill_finishes_first"] {
        // D's view: its calls against the times the schedule has P call.
        assert!(
            dv["races"][race].as_u64().unwrap_or(0) > 0,
            "D {race}\n{both}"
        );
    }
    assert_eq!(dv["ok"], true, "{both}");
    assert!(d.status.is_some_and(|s| s.success()), "{both}");

    let pv: Value =
        serde_json::from_str(&p.stdout).unwrap_or_else(|e| panic!("P's JSON: {e}\n{both}"));
    assert_eq!(pv["role"], "prefill", "{both}");
    assert_eq!(pv["prefill_outcomes"]["sent"], REQUESTS, "{both}");
    let races = &pv["races"];
    let (d_first, p_first) = (
        races["decode_registers_first"].as_u64().unwrap_or(0),
        races["prefill_finishes_first"].as_u64().unwrap_or(0),
    );
    // The races as P's endpoint saw them: both happened, once per request.
    assert_eq!(d_first + p_first, REQUESTS, "{both}");
    assert!(d_first > 0 && p_first > 0, "{races}\n{both}");
    assert_eq!(pv["link"]["incoming_ok"], 1, "{both}");
    assert_eq!(pv["peer_exited"], true, "P stayed until D exited\n{both}");
    assert_eq!(pv["ok"], true, "{both}");
    assert!(p.status.is_some_and(|s| s.success()), "{both}");
}

#[test]
fn decode_first_then_prefill_hand_off_200_requests_over_nixl() {
    run_pair(true);
}

#[test]
fn prefill_first_then_decode_hand_off_200_requests_over_nixl() {
    run_pair(false);
}
