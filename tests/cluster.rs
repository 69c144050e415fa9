//! `kvhandoff cluster` end to end: every TP rank of both engines a process of its own over NIXL,
//! reported together; and every process it started gone after a Ctrl-C. Needs the NIXL runtime:
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
    let mut child = cluster(&["--tp", "2", "--requests", "100000", "--timeout-secs", "300"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kvhandoff runs");
    // Precondition: every rank is running its schedule (each D rank says so once it met P).
    let stderr = child.stderr.take().expect("stderr");
    let mut lines = BufReader::new(stderr).lines();
    let mut running = 0;
    let started = Instant::now();
    while running < 4 {
        let line = lines
            .next()
            .expect("the ranks start")
            .expect("stderr is text");
        if line.contains("running the schedule") {
            running += 1;
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
    for r in report["ranks"].as_array().expect("ranks") {
        let pid = r["pid"].as_u64().expect("pid");
        assert!(gone(pid), "rank process {pid} left behind\n{text}");
    }
}
