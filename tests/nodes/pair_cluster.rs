//! `kvhandoff cluster --model …` runs of a heterogeneous pair, each rank and the router a
//! process of their own, and the checks every such run shares.

use std::process::Command;

use serde_json::Value;

/// Whether process `pid` is gone.
pub fn gone(pid: u64) -> bool {
    !std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// Runs the pair through `cluster` in `mode` (push, pull, mixed, or bidir: each request's first
/// turn handed to D, then its next turn read back from D; flags may follow the mode, as in
/// `"bidir --first-turn pull"`), checks the report and returns it.
pub fn run_mode(
    mode: &str,
    model: &str,
    prefill: &str,
    decode: &str,
    ranks: (u64, u64),
    requests: u32,
    seed: u64,
) -> Value {
    let mut words = mode.split_whitespace();
    let mode = words.next().unwrap_or("push");
    let out = Command::new(env!("CARGO_BIN_EXE_kvhandoff"))
        .args(["cluster", "--json", "--mode", mode, "--model", model])
        .args(words)
        .args(["--prefill", prefill, "--decode", decode])
        .args(["--requests", &requests.to_string()])
        .args(["--seed", &seed.to_string()])
        .args(["--timeout-secs", "60"])
        .output()
        .expect("kvhandoff runs");
    let text = String::from_utf8_lossy(&out.stdout);
    let all = format!(
        "{model} {prefill} -> {decode}\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}\n{all}"));
    let (p, d) = ranks;
    assert_eq!(report["mode"], mode, "{all}");
    // Every rank of both engines, and the router, ran as a process of its own.
    assert_eq!(report["processes"], p + d + 1, "{all}");
    let lines = report["ranks"].as_array().expect("ranks");
    for (engine, count) in [("prefill", p), ("decode", d), ("router", 1)] {
        let mut seen: Vec<u64> = lines
            .iter()
            .filter(|r| r["engine"] == engine)
            .map(|r| r["rank"].as_u64().expect("rank"))
            .collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..count).collect::<Vec<_>>(), "{engine}: {all}");
    }
    assert_eq!(report["ok"], true, "{all}");
    assert_eq!(report["verified"], u64::from(requests), "{all}");
    assert_eq!(report["byte_errors"], 0, "{all}");
    assert_eq!(report["leaked_blocks"], 0, "{all}");
    assert_eq!(report["all_exited"], true, "{all}");
    for r in lines {
        assert_eq!(r["exit_code"], 0, "{all}");
        // D: verified; P: every export read (or write landed); the router: every request
        // handed to its readers (in bidir, the next turns too).
        let turns = if mode == "bidir" && r["engine"] == "router" {
            2
        } else {
            1
        };
        assert_eq!(r["done"], turns * u64::from(requests), "{all}");
        if mode == "bidir" && r["engine"] != "router" {
            // P read every next turn back and checked it; D's every keep was read.
            assert_eq!(r["read_back"], u64::from(requests), "{all}");
        }
        assert!(gone(r["pid"].as_u64().expect("pid")), "{all}");
    }
    assert!(out.status.success(), "{all}");
    report
}

/// Runs `cluster --kill` of rank 1 of `engine` at its request 40 on a pair of 240 requests in
/// `mode`, checks what every kill must show, and returns the report and everything printed.
pub fn kill(mode: &str, engine: &str, prefill: &str, decode: &str) -> (Value, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvhandoff"))
        .args(["cluster", "--json", "--mode", mode, "--model", "gqa8"])
        .args(["--prefill", prefill, "--decode", decode])
        .args([
            "--requests",
            "240",
            "--window",
            "16",
            "--timeout-secs",
            "60",
        ])
        .args(["--kill", &format!("{engine}:1@40")])
        .output()
        .expect("kvhandoff runs");
    let text = String::from_utf8_lossy(&out.stdout);
    let all = format!(
        "{mode} kill {engine}\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}\n{all}"));
    let kill = &report["kill"];
    // The precondition: the victim died mid-run and was restarted before the plan ended.
    let at_kill = kill["request_at_kill"].as_u64().expect("killed");
    let k = kill["restart_at"].as_u64().expect("restarted");
    assert!(at_kill >= 40 && k > at_kill && k < 240, "{all}");
    assert_eq!(report["ok"], true, "{all}");
    assert_eq!(report["all_exited"], true, "{all}");
    assert_eq!(report["byte_errors"], 0, "{all}");
    assert_eq!(report["leaked_blocks"], 0, "{all}");
    // The death failed requests, typed, on the other engine; the restart served its part.
    let survivor = &kill["survivor"];
    assert!(survivor["failed"].as_u64() > Some(0), "{all}");
    let restarted = kill["restarted"]["done"].as_u64().unwrap_or(0);
    assert!(restarted > 0 && restarted * 2 >= 240 - k, "{all}");
    for r in report["ranks"].as_array().expect("ranks") {
        assert!(gone(r["pid"].as_u64().expect("pid")), "{all}");
        match r["life"].as_str() {
            Some("killed") => assert_eq!(r["signal"], 9, "{all}"),
            _ => assert_eq!(r["exit_code"], 0, "{all}"),
        }
    }
    (report, all)
}
