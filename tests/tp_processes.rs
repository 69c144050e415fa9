//! An engine as vLLM deploys one: every TP rank its own process. Two engines of TP 2 (the demo
//! model's 8 KV heads, 4 per rank) run as four `kvhandoff node` processes over NIXL; each names
//! its engine's rank-0 ports (`--listen`, `--peer`, `--router`) and its `--rank`, and finds its
//! peer rank at the base port + rank, as vLLM's side channel does. Rank `r` of D pairs with rank
//! `r` of P; each rank's pattern is seeded by the model's head, so a rank that received another
//! rank's bytes would fail its check. Needs the NIXL runtime:
//! `source scripts/nixl-env.sh && cargo test --features nixl --test tp_processes`.
#![cfg(feature = "nixl")]

mod nodes;

use std::net::SocketAddr;
use std::thread;
use std::time::{Duration, Instant};

use nodes::{finish_all, require_runtime, Node, ONE_AT_A_TIME};

/// How long a test waits for the four processes before killing them.
const WAIT: Duration = Duration::from_secs(120);
const REQUESTS: u64 = 40;
const NAMES: [[&str; 2]; 2] = [["D0", "D1"], ["P0", "P1"]];

fn run_tp2(mode: &str) {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    require_runtime();
    // Consecutive ports: each engine's base and base + 1, and the router link's.
    let [p_base, _, d_base, _, router, _]: [SocketAddr; 6] =
        kvhandoff_testkit::ports::loopback_ports();
    let router = router.to_string();
    let requests = REQUESTS.to_string();
    let common = [
        "--tp",
        "2",
        "--requests",
        &requests,
        "--seed",
        "5",
        "--max-prompt-tokens",
        "64",
        "--pool-blocks",
        "128",
        "--mean-arrival-gap-ms",
        "15",
        "--max-call-skew-ms",
        "80",
        "--timeout-secs",
        "90",
        "--mode",
        mode,
        "--router",
        &router,
    ];
    let spawn = |role: &str, rank: usize| {
        let mut args: Vec<&str> = common.to_vec();
        let rank_text = ["0", "1"][rank];
        args.extend(["--rank", rank_text]);
        match role {
            "decode" => Node::spawn(NAMES[0][rank], role, d_base, p_base, &args),
            _ => Node::spawn(NAMES[1][rank], role, p_base, d_base, &args),
        }
    };
    let started = Instant::now();
    let mut nodes = vec![spawn("decode", 0), spawn("decode", 1)];
    thread::sleep(Duration::from_millis(300));
    nodes.push(spawn("prefill", 0));
    nodes.push(spawn("prefill", 1));
    let done = finish_all(nodes, Instant::now() + WAIT);
    let all = done.iter().map(|n| n.show()).collect::<Vec<_>>().join("\n");
    println!("{mode}: four ranks done in {:?}\n{all}", started.elapsed());
    for (i, node) in done.iter().enumerate() {
        let (role, rank) = (i / 2, i % 2);
        assert!(
            node.status.is_some(),
            "{} killed at the deadline\n{all}",
            node.name
        );
        let base = if role == 0 { d_base } else { p_base };
        let listen = SocketAddr::new(base.ip(), base.port() + rank as u16);
        assert!(
            node.stderr.contains(&format!("listening on {listen}")),
            "{} listens on its engine's base port + its rank\n{all}",
            node.name
        );
        let report = node.json(&all);
        assert_eq!(report["mode"], mode, "{all}");
        assert_eq!(report["ok"], true, "{}\n{all}", node.name);
        assert_eq!(report["bytes"], report["expected_bytes"], "{all}");
        if role == 0 {
            assert_eq!(report["verified"], REQUESTS, "{}\n{all}", node.name);
            assert_eq!(report["byte_errors"], 0, "{all}");
            assert_eq!(report["outcomes"]["ready"], REQUESTS, "{all}");
        } else {
            assert_eq!(report["prefill_outcomes"]["sent"], REQUESTS, "{all}");
            assert_eq!(report["peer_exited"], true, "{all}");
        }
        assert!(node.status.is_some_and(|s| s.success()), "{all}");
    }
}

#[test]
fn a_tp2_pair_pushes_with_every_rank_in_its_own_process() {
    run_tp2("push");
}

#[test]
fn a_tp2_pair_pulls_with_every_rank_in_its_own_process() {
    run_tp2("pull");
}
