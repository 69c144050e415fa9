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

/// Two engines started with different pairs cannot pair: P's route refuses D's handshake (a
/// geometry its plan does not have), counted by reason on P; D starts no request and both end
/// at their limit, FAILED, with nothing written.
#[test]
fn ranks_of_different_pairs_refuse_each_other() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    require_runtime();
    let (p_addr, d_addr) = nodes::two_ports();
    let node = |role: &str, listen: std::net::SocketAddr, peer: std::net::SocketAddr, d: &str| {
        Command::new(env!("CARGO_BIN_EXE_kvhandoff"))
            .args(["node", "--json", "--role", role, "--rank", "0"])
            .args(["--listen", &listen.to_string(), "--peer", &peer.to_string()])
            .args(["--model", "gqa8", "--prefill", "tp=1,block=16,layout=NHD"])
            .args(["--decode", d, "--requests", "4", "--timeout-secs", "4"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("kvhandoff starts")
    };
    let p = node("prefill", p_addr, d_addr, "tp=1,block=32,layout=HND");
    let d = node("decode", d_addr, p_addr, "tp=1,block=64,layout=HND");
    let (p, d) = (
        p.wait_with_output().expect("P ends"),
        d.wait_with_output().expect("D ends"),
    );
    let all = format!(
        "P:\n{}\n{}\nD:\n{}\n{}",
        String::from_utf8_lossy(&p.stdout),
        String::from_utf8_lossy(&p.stderr),
        String::from_utf8_lossy(&d.stdout),
        String::from_utf8_lossy(&d.stderr)
    );
    let json = |out: &std::process::Output| -> Value {
        let text = String::from_utf8_lossy(&out.stdout);
        let start = text.find('{').unwrap_or_else(|| panic!("no report\n{all}"));
        serde_json::Deserializer::from_str(&text[start..])
            .into_iter::<Value>()
            .next()
            .and_then(Result::ok)
            .unwrap_or_else(|| panic!("no report\n{all}"))
    };
    let (pr, dr) = (json(&p), json(&d));
    assert!(
        pr["handshakes_refused"]["incompatible"].as_u64() >= Some(1),
        "P refused D's handshake as incompatible\n{all}"
    );
    assert_eq!(pr["ok"], false, "{all}");
    assert_eq!(pr["done"], 0, "{all}");
    assert_eq!(dr["ok"], false, "{all}");
    assert_eq!(dr["done"], 0, "{all}");
    assert_eq!(dr["missing"], 4, "D started nothing\n{all}");
    assert!(!p.status.success() && !d.status.success(), "{all}");
}
