//! `kvhandoff cluster --model M --prefill SPEC --decode SPEC`: heterogeneous pairs across
//! processes. Every rank of both engines is its own `kvhandoff node --model …` process with its
//! own NIXL agent and TCP side channel; a routed rank's handshake is accepted by the peer's
//! route, D names its request's buffers in each registration (`Register::memory`) and P places
//! its pieces there; every D rank checks every byte of its own rank in its own geometry. Needs
//! the NIXL runtime: `source scripts/nixl-env.sh && cargo test --features nixl --test
//! cluster_pairs`.
#![cfg(feature = "nixl")]

mod nodes;

use std::process::Command;

use nodes::{require_runtime, ONE_AT_A_TIME};
use serde_json::Value;

fn gone(pid: u64) -> bool {
    !std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// Runs the pair through `cluster`, checks the report and returns it.
fn pair(model: &str, prefill: &str, decode: &str, ranks: (u64, u64), requests: u32) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_kvhandoff"))
        .args(["cluster", "--json", "--model", model])
        .args(["--prefill", prefill, "--decode", decode])
        .args(["--requests", &requests.to_string(), "--seed", "7"])
        .args(["--timeout-secs", "60"])
        .output()
        .expect("kvhandoff runs");
    let text = String::from_utf8_lossy(&out.stdout);
    let all = format!(
        "{model} {prefill} -> {decode}\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}\n{all}"));
    // The pair really differs, and every rank of both engines ran as its own process.
    let (p, d) = ranks;
    assert_ne!(prefill, decode, "{all}");
    assert_eq!(report["processes"], p + d, "{all}");
    let lines = report["ranks"].as_array().expect("ranks");
    for (engine, count) in [("prefill", p), ("decode", d)] {
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
        assert_eq!(r["done"], u64::from(requests), "{all}");
        assert!(gone(r["pid"].as_u64().expect("pid")), "{all}");
    }
    assert!(out.status.success(), "{all}");
    report
}

/// Less TP on D (each D rank gathers the heads of two P processes), larger blocks, another
/// layout.
#[test]
fn tp_down_with_another_block_size_and_layout() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    require_runtime();
    pair(
        "gqa8",
        "tp=4,block=16,layout=NHD",
        "tp=2,block=32,layout=HND",
        (4, 2),
        32,
    );
}

/// More TP on D (one P process writes a slice of its heads to each of four D processes), and
/// another layout.
#[test]
fn tp_up_with_another_layout() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    require_runtime();
    pair(
        "gqa8",
        "tp=1,block=16,layout=HND",
        "tp=4,block=16,layout=NHD",
        (1, 4),
        32,
    );
}

/// A hybrid cache (sliding-window layers beside full attention) with P's pipeline stages: each
/// stage writes its layers to the D ranks that hold them.
#[test]
fn a_sliding_window_hybrid_from_pipeline_stages() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    require_runtime();
    pair(
        "swa",
        "tp=1,block=32,layout=NHD,pp=2",
        "tp=2,block=16,layout=HND",
        (2, 2),
        32,
    );
}

/// A mamba hybrid: the state slots move beside the attention blocks, block size and TP differ.
#[test]
fn a_mamba_hybrid_across_tp_and_block_size() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    require_runtime();
    pair(
        "mamba",
        "tp=2,block=16,layout=HND",
        "tp=1,block=64,layout=HND",
        (2, 1),
        32,
    );
}
