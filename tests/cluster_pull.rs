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

use nodes::pair_cluster::{kill, run_mode};
use nodes::{require_runtime, ONE_AT_A_TIME};
use serde_json::Value;

/// Runs the pair's pull through `cluster`, checks the report and returns it.
fn pull(model: &str, prefill: &str, decode: &str, ranks: (u64, u64), requests: u32) -> Value {
    run_mode("pull", model, prefill, decode, ranks, requests, 11)
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
        11,
    );
    // The first turns pulled, as vLLM's NIXL connector moves them.
    run_mode(
        "bidir --first-turn pull",
        "mamba",
        "tp=2,block=16,layout=HND",
        "tp=1,block=64,layout=HND",
        (2, 1),
        24,
        11,
    );
}

/// Mixed across processes: each request pushed or pulled by the seed (every process draws the
/// same), both through the router.
#[test]
fn a_mixed_pair_pushes_and_pulls_across_processes() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    require_runtime();
    let report = run_mode(
        "mixed",
        "gqa8",
        "tp=4,block=16,layout=NHD",
        "tp=2,block=32,layout=HND",
        (4, 2),
        32,
        11,
    );
    // Both paths ran on every D rank.
    for r in report["ranks"].as_array().expect("ranks") {
        if r["engine"] == "decode" {
            let o = &r["outcomes"];
            assert!(
                o["Ready"].as_u64() > Some(0) && o["Loaded"].as_u64() > Some(0),
                "{report}"
            );
        }
    }
}

/// What a pair across processes refuses, typed (exit 2): the in-memory transport
/// (one process's fabric), and a rank started to pull or read back without the router that
/// hands it its answers.
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
    for (extra, reason) in [
        (&["--mode", "pull", "--transport", "mem"][..], "one process"),
        (&["--mode", "mixed", "--transport", "mem"], "one process"),
    ] {
        let out = cluster(extra);
        assert_eq!(out.status.code(), Some(2), "{extra:?}");
        let text = String::from_utf8_lossy(&out.stderr);
        assert!(text.contains(reason), "{extra:?}: {text}");
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

/// kill -9 of a P rank of a pulling pair whose D rank reads from both P ranks: the router
/// abandons what the dead rank will never serve (D never starts it), the reads in flight from
/// the dead rank fail typed on D, and the restarted rank's exports are read again.
#[test]
fn a_killed_prefill_rank_of_a_pulling_pair_fails_typed_and_is_read_after_restart() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    require_runtime();
    let (report, all) = kill(
        "pull",
        "prefill",
        "tp=2,block=16,layout=NHD",
        "tp=1,block=32,layout=HND",
    );
    let outcomes = &report["kill"]["survivor"]["outcomes"];
    assert_eq!(report["kill"]["survivor"]["engine"], "decode", "{all}");
    assert!(outcomes["Loaded"].as_u64() > Some(0), "{all}");
    assert!(outcomes["Abandoned"].as_u64() > Some(0), "{all}");
    let router = report["ranks"]
        .as_array()
        .and_then(|r| r.iter().find(|r| r["engine"] == "router"))
        .expect("the router's line");
    assert_eq!(router["ok"], true, "{all}");
}

/// kill -9 of a D rank of a bidirectional pair whose one P rank pushes to and reads back from
/// both D ranks: the turns the restart skipped are abandoned on both engines, and the restarted
/// rank's turns are pushed and read back again, every byte checked in P's geometry.
#[test]
fn a_killed_decode_rank_of_a_bidirectional_pair_is_read_back_after_restart() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    require_runtime();
    let (report, all) = kill(
        "bidir",
        "decode",
        "tp=1,block=16,layout=NHD",
        "tp=2,block=32,layout=HND",
    );
    let k = report["kill"]["restart_at"].as_u64().expect("restarted");
    let lines = report["ranks"].as_array().expect("ranks");
    let restarted = lines
        .iter()
        .find(|r| r["life"] == "restarted")
        .expect("the restart's line");
    let prefill = lines
        .iter()
        .find(|r| r["engine"] == "prefill")
        .expect("P's line");
    // Every next turn of the restart's part was kept by it and read back by P.
    assert_eq!(restarted["read_back"], 240 - k, "{all}");
    assert!(prefill["read_back"].as_u64() >= Some(240 - k), "{all}");
}
