//! `kvhandoff cluster --model M --prefill SPEC --decode SPEC --mode pull`: heterogeneous pairs
//! pulling across processes. Every rank of both engines is its own `kvhandoff node --model …`
//! process, and a `kvhandoff router` process stands where vLLM's proxy does: each P rank tells
//! it its answer to the request's prefill leg, and only once every P rank answered does a D rank
//! get P's answer and call `request_allocated`. Each D rank then reads every link into it from
//! the P processes it needs (one import per P rank, each under the grant fence, placed in the
//! KV buffer P's grant names, `ReadGrant::memory`), runs the pair's transforms and checks every
//! byte of its rank. Needs the NIXL runtime: `source scripts/nixl-env.sh && cargo test
//! --features nixl --test cluster_pull`.
#![cfg(feature = "nixl")]

mod nodes;

use std::process::Command;

use nodes::{require_runtime, ONE_AT_A_TIME};
use serde_json::Value;

fn gone(pid: u64) -> bool {
    !std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// Runs the pair's pull through `cluster`, checks the report and returns it.
fn pull(model: &str, prefill: &str, decode: &str, ranks: (u64, u64), requests: u32) -> Value {
    run_mode("pull", model, prefill, decode, ranks, requests)
}

/// Runs the pair through `cluster` in `mode` (pull, or bidir: each request pushed, then its
/// next turn read back from D), checks the report and returns it.
fn run_mode(
    mode: &str,
    model: &str,
    prefill: &str,
    decode: &str,
    ranks: (u64, u64),
    requests: u32,
) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_kvhandoff"))
        .args(["cluster", "--json", "--mode", mode, "--model", model])
        .args(["--prefill", prefill, "--decode", decode])
        .args(["--requests", &requests.to_string(), "--seed", "11"])
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
        // handed to its readers.
        assert_eq!(r["done"], u64::from(requests), "{all}");
        if mode == "bidir" && r["engine"] != "router" {
            // P read every next turn back and checked it; D's every keep was read.
            assert_eq!(r["read_back"], u64::from(requests), "{all}");
        }
        assert!(gone(r["pid"].as_u64().expect("pid")), "{all}");
    }
    assert!(out.status.success(), "{all}");
    report
}

/// Less TP on D (each D rank reads two P processes), larger blocks, another layout: P's
/// transforms run on D over its copy of P's blocks.
#[test]
fn tp_down_pulls_with_another_block_size_and_layout() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    require_runtime();
    pull(
        "gqa8",
        "tp=4,block=16,layout=NHD",
        "tp=2,block=32,layout=HND",
        (4, 2),
        32,
    );
}

/// More TP on D (four D processes read their heads from one P process), another layout.
#[test]
fn tp_up_pulls_with_another_layout() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    require_runtime();
    pull(
        "gqa8",
        "tp=1,block=16,layout=HND",
        "tp=4,block=16,layout=NHD",
        (1, 4),
        32,
    );
}

/// A sliding-window hybrid from P's pipeline stages: each D rank reads its layers from both
/// stages.
#[test]
fn a_sliding_window_hybrid_pulls_from_pipeline_stages() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    require_runtime();
    pull(
        "swa",
        "tp=1,block=32,layout=NHD,pp=2",
        "tp=2,block=16,layout=HND",
        (2, 2),
        32,
    );
}

/// A mamba hybrid: the state slots are read beside the attention blocks, TP and block size
/// differ.
#[test]
fn a_mamba_hybrid_pulls_across_tp_and_block_size() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    require_runtime();
    pull(
        "mamba",
        "tp=2,block=16,layout=HND",
        "tp=1,block=64,layout=HND",
        (2, 1),
        32,
    );
}

/// A conversation's next turn across processes: each request pushed from two P processes into
/// one D process, then D keeps its blocks (one export per P rank that reads them back) and each
/// P process reads its part back into its own geometry once the router handed it D's answer,
/// the pair planned the other way.
#[test]
fn a_next_turn_reads_the_kept_blocks_back_into_p() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    require_runtime();
    run_mode(
        "bidir",
        "gqa8",
        "tp=2,block=16,layout=NHD",
        "tp=1,block=32,layout=HND",
        (2, 1),
        24,
    );
    run_mode(
        "bidir",
        "mamba",
        "tp=2,block=16,layout=HND",
        "tp=1,block=64,layout=HND",
        (2, 1),
        24,
    );
}

/// What a pair across processes refuses, typed (exit 2): mixed modes, a kill outside push, and
/// a rank started to pull or read back without the router that hands it its answers.
#[test]
fn what_a_pairs_pull_refuses_is_said() {
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_kvhandoff"))
            .args(args)
            .output()
            .expect("kvhandoff runs")
    };
    let pair = [
        "--model",
        "gqa8",
        "--prefill",
        "tp=2,block=16,layout=NHD",
        "--decode",
        "tp=1,block=32,layout=HND",
    ];
    let cluster = |extra: &[&str]| {
        let mut args = vec!["cluster"];
        args.extend(pair);
        args.extend(extra);
        run(&args)
    };
    for extra in [
        &["--mode", "mixed"][..],
        &["--mode", "pull", "--kill", "prefill:1@4"],
    ] {
        let out = cluster(extra);
        assert_eq!(out.status.code(), Some(2), "{extra:?}");
        assert!(!out.stderr.is_empty(), "{extra:?}: the reason is said");
    }
    for mode in ["pull", "bidir"] {
        let mut args = vec![
            "node", "--json", "--role", "decode", "--rank", "0", "--mode", mode,
        ];
        args.extend(pair);
        args.extend(["--listen", "127.0.0.1:1", "--peer", "127.0.0.1:2"]);
        let out = run(&args);
        assert_eq!(out.status.code(), Some(2), "{mode}");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("--router"), "{mode}: {text}");
    }
}
