//! `kvhandoff cluster` end to end: every TP rank of both engines a process of its own over NIXL,
//! reported together; every process it started gone after a Ctrl-C; and `--kill` of a P rank
//! and of a D rank (killed mid-run, restarted, its peer surviving). Needs the NIXL runtime:
//! `source scripts/nixl-env.sh && cargo test --features nixl --test cluster`.
#![cfg(feature = "nixl")]

mod nodes;

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nodes::{require_runtime, ONE_AT_A_TIME};
use serde_json::Value;

fn cluster(args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_kvhandoff"));
    command.arg("cluster").args(args).arg("--json");
    command
}

fn gone(pid: u64) -> bool {
    !std::path::Path::new(&format!("/proc/{pid}")).exists()
}

#[test]
fn a_tp2_cluster_verifies_every_byte_in_mixed_mode() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    require_runtime();
    let out = cluster(&[
        "--tp",
        "2",
        "--requests",
        "24",
        "--mode",
        "mixed",
        "--seed",
        "3",
    ])
    .output()
    .expect("kvhandoff runs");
    let text = String::from_utf8_lossy(&out.stdout);
    let all = format!("{text}\n{}", String::from_utf8_lossy(&out.stderr));
    let report: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}\n{all}"));
    assert_eq!(report["ok"], true, "{all}");
    assert_eq!(report["processes"], 4, "{all}");
    assert_eq!(report["verified"], 24, "{all}");
    assert_eq!(report["byte_errors"], 0, "{all}");
    assert_eq!(report["leaked_blocks"], 0, "{all}");
    assert_eq!(report["all_exited"], true, "{all}");
    let ranks = report["ranks"].as_array().expect("ranks");
    for engine in ["decode", "prefill"] {
        let ranks: Vec<u64> = ranks
            .iter()
            .filter(|r| r["engine"] == engine)
            .map(|r| r["rank"].as_u64().expect("rank"))
            .collect();
        assert_eq!(ranks, [0, 1], "{engine}: {all}");
    }
    for r in ranks {
        assert_eq!(r["exit_code"], 0, "{all}");
        assert!(gone(r["pid"].as_u64().expect("pid")), "{all}");
    }
    assert!(out.status.success(), "{all}");
}

#[test]
fn ctrl_c_stops_every_process_the_cluster_started() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    require_runtime();
    ctrl_c_stops(&["--tp", "2", "--requests", "100000"], 4, 4);
}

/// The same for a heterogeneous pair pulling through its router: the router process is gone
/// too.
#[test]
fn ctrl_c_stops_a_pairs_ranks_and_its_router() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    require_runtime();
    let args = [
        "--model",
        "gqa8",
        "--prefill",
        "tp=2,block=16,layout=NHD",
        "--decode",
        "tp=1,block=32,layout=HND",
        "--mode",
        "pull",
        "--requests",
        "600",
    ];
    let report = ctrl_c_stops(&args, 3, 4);
    let router = report["ranks"]
        .as_array()
        .and_then(|r| r.iter().find(|r| r["engine"] == "router"));
    assert!(router.is_some(), "{report}");
}

/// Starts `cluster` with `args`, interrupts it (SIGINT) once `running` ranks run their schedule,
/// and checks that it stops within 10 s with every one of its `processes` gone. Returns the
/// report.
fn ctrl_c_stops(args: &[&str], running: usize, processes: usize) -> Value {
    let mut child = cluster(args)
        .args(["--timeout-secs", "300"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kvhandoff runs");
    // Precondition: every rank is running its schedule (each D rank says so once it met P).
    let stderr = child.stderr.take().expect("stderr");
    let mut lines = BufReader::new(stderr).lines();
    let mut seen = 0;
    let started = Instant::now();
    while seen < running {
        let line = lines
            .next()
            .expect("the ranks start")
            .expect("stderr is text");
        if line.contains("running the schedule") {
            seen += 1;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "ranks never ran"
        );
    }
    // Keep draining stderr so that no child blocks on a full pipe.
    let drain = std::thread::spawn(move || lines.count());
    let interrupted = Instant::now();
    let status = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .expect("kill runs");
    assert!(status.success());
    let mut text = String::new();
    child
        .stdout
        .take()
        .expect("stdout")
        .read_to_string(&mut text)
        .expect("stdout is text");
    let exit = child.wait().expect("the cluster exits");
    let took = interrupted.elapsed();
    drain.join().expect("drained");
    let report: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert_eq!(report["stopped"], "interrupted", "{text}");
    assert_eq!(report["all_exited"], true, "{text}");
    assert_eq!(report["ok"], false, "{text}");
    assert!(!exit.success(), "{text}");
    assert!(
        took < Duration::from_secs(10),
        "stopped in {took:?}\n{text}"
    );
    let ranks = report["ranks"].as_array().expect("ranks");
    assert_eq!(ranks.len(), processes, "{text}");
    for r in ranks {
        let pid = r["pid"].as_u64().expect("pid");
        assert!(gone(pid), "process {pid} left behind\n{text}");
    }
    report
}

/// `cluster --tp 2 --kill ENGINE:R@60` over 240 requests, checked from its JSON: the kill
/// landed mid-plan with requests left for the restart (the precondition), the survivor failed
/// the requests that needed the dead rank with outcomes a death explains (`allowed`) and no
/// byte error or leak, the other rank pair verified everything, the restarted process served
/// requests `K..`, and every process is gone. Returns the report for the test's own checks.
fn kill_run(victim: &str, rank: u64, allowed: &[&str]) -> Value {
    let at = 60;
    let requests = 240;
    let spec = format!("{victim}:{rank}@{at}");
    let started = Instant::now();
    let out = cluster(&[
        "--tp",
        "2",
        "--requests",
        &requests.to_string(),
        "--kill",
        &spec,
        "--timeout-secs",
        "60",
    ])
    .output()
    .expect("kvhandoff runs");
    let took = started.elapsed();
    let text = String::from_utf8_lossy(&out.stdout);
    let all = format!("{text}\n{}", String::from_utf8_lossy(&out.stderr));
    let report: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}\n{all}"));
    let kill = &report["kill"];
    assert_eq!(kill["engine"], victim, "{all}");
    assert_eq!(kill["rank"], rank, "{all}");

    // Precondition: killed at request N or just after (before its plan ended), with requests
    // between the kill and K that needed the dead rank, and requests K.. for the restart.
    let killed_at = kill["request_at_kill"].as_u64().expect("killed");
    let k = kill["restart_at"].as_u64().expect("restarted");
    assert!(
        (at..requests - 1).contains(&killed_at),
        "killed at {killed_at}\n{all}"
    );
    assert!(killed_at + 1 < k && k < requests, "K = {k}\n{all}");

    assert_eq!(report["ok"], true, "{all}");
    assert_eq!(kill["ok"], true, "{all}");
    assert_eq!(report["all_exited"], true, "{all}");
    assert_eq!(report["processes"], 5, "{all}");
    assert_eq!(report["byte_errors"], 0, "{all}");
    assert_eq!(report["leaked_blocks"], 0, "{all}");

    let survivor = &kill["survivor"];
    assert_eq!(survivor["rank"], rank, "{all}");
    assert_eq!(survivor["exit_code"], 0, "{all}");
    assert_eq!(survivor["byte_errors"], 0, "{all}");
    assert_eq!(survivor["leaked_blocks"], 0, "{all}");
    assert!(survivor["peer_deaths"].as_u64() >= Some(1), "{all}");
    assert!(survivor["failed"].as_u64() > Some(0), "{all}");
    let outcomes = survivor["outcomes"].as_object().expect("outcomes");
    assert_eq!(
        outcomes.values().filter_map(Value::as_u64).sum::<u64>(),
        requests,
        "{all}"
    );
    for outcome in outcomes.keys() {
        assert!(
            allowed.iter().any(|a| outcome.starts_with(a)),
            "the survivor's {outcome}\n{all}"
        );
    }

    let part = requests - k;
    assert_eq!(kill["restarted"]["exit_code"], 0, "{all}");
    assert_eq!(kill["restarted"]["done"], part, "{all}");
    assert_eq!(kill["served_after_restart"], part, "{all}");

    let ranks = report["ranks"].as_array().expect("ranks");
    for r in ranks {
        let pid = r["pid"].as_u64().expect("pid");
        assert!(gone(pid), "rank process {pid} left behind\n{all}");
        match r["life"].as_str() {
            Some("killed") => {
                assert_eq!(r["engine"], victim, "{all}");
                assert_eq!(r["signal"], 9, "{all}");
                assert_eq!(Some(pid), kill["killed_pid"].as_u64(), "{all}");
            }
            Some("restarted" | "survivor") => assert_eq!(r["rank"], rank, "{all}"),
            other => {
                assert_eq!(other, None, "{all}");
                assert_ne!(r["rank"], rank, "{all}");
                assert_eq!(r["ok"], true, "{all}");
                assert_eq!(r["exit_code"], 0, "{all}");
                assert_eq!(r["done"], requests, "{all}");
            }
        }
    }
    assert!(out.status.success(), "{all}");
    println!(
        "--kill {spec}: killed at request {killed_at}, restarted at {k}; survivor {:?}; {took:?}",
        survivor["outcomes"]
    );
    report
}

#[test]
fn a_killed_prefill_rank_fails_only_its_requests_and_is_served_after_restart() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    require_runtime();
    // D's outcomes when its P dies: in flight (PeerDead, WriteFailed), allocated while no P
    // listened (HandshakeFailed), or before K from the restarted P (Deadline).
    kill_run(
        "prefill",
        1,
        &[
            "Ready",
            "Failed(PeerDead)",
            "Failed(HandshakeFailed)",
            "Failed(Deadline)",
            "Failed(WriteFailed(",
        ],
    );
}

#[test]
fn a_killed_decode_rank_fails_only_its_requests_and_is_served_after_restart() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    require_runtime();
    // P's outcomes when its D dies: bound to it (PeerDead, WriteFailed) or finished with no D
    // to register them (LeaseExpired).
    kill_run(
        "decode",
        0,
        &[
            "Sent",
            "Released(PeerDead)",
            "Released(WriteFailed(",
            "Released(LeaseExpired)",
        ],
    );
}
