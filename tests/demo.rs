//! The demo end to end (P and D over the in-memory transport, and over NIXL with the `nixl`
//! feature; pushed, pulled, mixed and bidirectional conversations; every byte checked), its byte
//! pattern, its sabotage hook, the `node` roles run as two threads over the TCP side channel
//! (and the router link), and a tiny `bench control`.

use std::time::Duration;

use kvhandoff::TransportKind;
use kvhandoff_actors::transport::mem::MemFabric;
use kvhandoff_bench::{self as bench, ControlOptions};
use kvhandoff_protocol::{KvLayout, PairingKey, RegionKind, RequestId};
use kvhandoff_testkit::demo::{self, DemoOptions};
use kvhandoff_testkit::demo::{DemoMode, DemoReport, DemoTransport, ReportRole};
use kvhandoff_testkit::node::{self, NodeOptions, NodeReport, NodeRole};
use kvhandoff_testkit::pattern::{
    block_byte_offset, demo_geometry, expected_byte, fill_kernel_block, request_key,
};

/// A seed for which both races happen with 16 requests.
const SEED: u64 = 7;

fn small(seed: u64) -> DemoOptions {
    DemoOptions {
        requests: 16,
        seed,
        // Short prompts keep the unoptimized test build fast: the pattern is computed per byte.
        max_prompt_tokens: 256,
        pool_blocks: 128,
        timeout: Duration::from_secs(30),
        ..DemoOptions::default()
    }
}

#[test]
fn sixteen_requests_arrive_byte_exact_through_both_races() {
    let report = demo::run(&small(SEED)).expect("the demo runs");
    println!("{}", report.render_table());
    assert!(report.verdict_ok(), "{}", report.render_table());
    assert!(report.ok);
    assert!(report
        .verdict
        .starts_with("verdict: OK — 16/16 requests verified"));
    assert_eq!(report.requests, 16);
    assert_eq!(report.verified, 16);
    assert_eq!(report.byte_errors, 0);
    assert_eq!(report.outcomes.ready, 16);
    assert_eq!(report.outcomes.failed, 0);
    assert!(
        report.races.decode_registers_first > 0,
        "{:?}",
        report.races
    );
    assert!(
        report.races.prefill_finishes_first > 0,
        "{:?}",
        report.races
    );
    assert_eq!(
        report.races.decode_registers_first + report.races.prefill_finishes_first,
        16
    );
    assert_eq!(report.bytes, report.expected_bytes);
    assert!(report.gbps > 0.0);
    assert!(report.handoff_latency_us.p50 > 0.0);
    assert!(report.handoff_latency_us.p99 >= report.handoff_latency_us.p50);

    // The JSON the CLI prints with --json.
    let json = serde_json::to_string_pretty(&report).unwrap();
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["transport"], "mem");
    assert_eq!(v["mode"], "push");
    assert_eq!(v["pulled"], 0);
    assert_eq!(v["role"], "both");
    for key in ["requests", "verified", "byte_errors", "bytes", "gbps"] {
        assert!(v[key].is_number(), "{key} in {json}");
    }
    for key in ["decode_registers_first", "prefill_finishes_first"] {
        assert!(v["races"][key].is_u64(), "races.{key}");
    }
    for key in ["ready", "failed"] {
        assert!(v["outcomes"][key].is_u64(), "outcomes.{key}");
    }
    for key in ["p50", "p99"] {
        assert!(
            v["handoff_latency_us"][key].is_number(),
            "handoff_latency_us.{key}"
        );
    }
    assert_eq!(v["requests"], 16);
    assert_eq!(v["byte_errors"], 0);
}

/// What every pulled request of a run must show: D read P's blocks, every byte right.
fn assert_all_pulled(report: &DemoReport, requests: u64) {
    assert!(report.verdict_ok(), "{}", report.render_table());
    assert_eq!(report.mode, "pull");
    assert_eq!(report.pulled, requests);
    assert_eq!((report.verified, report.byte_errors), (requests, 0));
    assert_eq!(report.outcomes.ready, requests);
    assert_eq!(
        report.prefill_outcomes.sent, requests,
        "every export was read"
    );
    // No race in pull: D reads after P's answer.
    assert_eq!(report.races, Default::default());
    assert_eq!(report.call_order, Default::default());
}

#[test]
fn sixteen_pulled_requests_arrive_byte_exact() {
    let report = demo::run(&DemoOptions {
        mode: DemoMode::Pull,
        ..small(SEED)
    })
    .expect("the demo runs");
    println!("{}", report.render_table());
    assert_all_pulled(&report, 16);
    assert_eq!(report.bytes, report.expected_bytes, "D's reads moved them");
    assert!(report.handoff_latency_us.p50 > 0.0);
    let v = serde_json::to_value(&report).unwrap();
    assert_eq!(v["mode"], "pull");
    assert_eq!(v["pulled"], 16);
    assert!(report.render_table().contains("pull (16 pulled, 0 pushed)"));
}

#[test]
fn mixed_requests_are_pushed_and_pulled_byte_exact() {
    let report = demo::run(&DemoOptions {
        mode: DemoMode::Mixed,
        ..small(SEED)
    })
    .expect("the demo runs");
    println!("{}", report.render_table());
    assert!(report.verdict_ok(), "{}", report.render_table());
    assert_eq!(report.mode, "mixed");
    assert!(
        report.pulled > 0 && report.pulled < 16,
        "both modes drawn: {}",
        report.pulled
    );
    assert_eq!((report.verified, report.byte_errors), (16, 0));
    assert_eq!(report.prefill_outcomes.sent, 16);
    // P's endpoint counts the races of the pushed requests only.
    assert_eq!(
        report.races.decode_registers_first + report.races.prefill_finishes_first,
        16 - report.pulled
    );
    assert_eq!(report.bytes, report.expected_bytes);
    assert_eq!(serde_json::to_value(&report).unwrap()["mode"], "mixed");
}

/// Conversations of 4 turns: what every bidirectional run of `requests` turns must show.
fn assert_conversations(report: &DemoReport, requests: u64) {
    assert!(report.verdict_ok(), "{}", report.render_table());
    assert_eq!(report.mode, "bidir");
    assert_eq!(report.requests, requests);
    assert_eq!((report.verified, report.byte_errors), (requests, 0));
    assert_eq!(report.outcomes.ready, requests);
    assert_eq!(report.prefill_outcomes.sent, requests);
    assert_eq!(report.leaked_blocks, Default::default());
    let t = report.turns;
    assert_eq!(t.conversations, requests.div_ceil(4));
    assert_eq!(t.later_turns, requests - t.conversations);
    assert_eq!(
        t.pulled_from_decode + t.recomputed + t.declined_near_expiry,
        t.later_turns,
        "{t:?}"
    );
    // Every prefix read back was checked byte by byte on P.
    assert!(t.pulled_from_decode > 0, "{t:?}");
    assert_eq!(t.read_back_verified, t.pulled_from_decode, "{t:?}");
    assert!(t.read_back_bytes > 0);
    // D kept every turn with a next one, and every keep ended (read, declined or expired).
    assert_eq!(t.kept, t.later_turns, "{t:?}");
    assert_eq!(t.kept_read, t.pulled_from_decode, "{t:?}");
    assert_eq!(t.kept_read + t.kept_unread, t.kept, "{t:?}");
    assert_eq!(report.events.prefill, requests);
    assert_eq!(report.events.decode, requests);
    assert_eq!(report.events.duplicates + report.events.unknown, 0);
}

fn conversations(seed: u64) -> DemoOptions {
    DemoOptions {
        mode: DemoMode::Bidir,
        turns: 4,
        ..small(seed)
    }
}

/// Four conversations of four turns (seed 7: two pushed, two pulled; by the schedule, three
/// later turns come back near the end of D's 2 s TTL and three more have a prefix under 64
/// tokens):
/// every turn's KV is checked on D, every prefix read back is checked on P, and the turns are
/// counted.
#[test]
fn bidirectional_conversations_read_turns_back_byte_exact() {
    let report = demo::run(&conversations(SEED)).expect("the demo runs");
    println!("{}", report.render_table());
    assert_conversations(&report, 16);
    let t = report.turns;
    assert!(t.recomputed > 0, "a prefix under the threshold: {t:?}");
    assert!(
        t.declined_near_expiry > 0,
        "a turn back near the TTL's end: {t:?}"
    );
    assert_eq!(t.keep_ttl_ms, 2000.0);
    assert_eq!(t.recompute_threshold_tokens, 64);
    assert!(report.pulled > 0 && report.pulled < 16, "{}", report.pulled);
    // The mem fabric counts what moved: the handoffs and the prefixes read back.
    assert_eq!(report.bytes, report.expected_bytes);
    let v = serde_json::to_value(&report).unwrap();
    assert_eq!(v["mode"], "bidir");
    for key in ["pulled_from_decode", "recomputed", "declined_near_expiry"] {
        assert!(v["turns"][key].is_u64(), "turns.{key}");
    }
    assert!(report.render_table().contains("later turns: read back"));
}

/// A threshold above every prefix: no turn reads back; each declines D's kept blocks at once.
#[test]
fn a_high_threshold_recomputes_every_later_turn() {
    let report = demo::run(&DemoOptions {
        recompute_threshold: 1_000_000,
        requests: 8,
        ..conversations(SEED)
    })
    .expect("the demo runs");
    let t = report.turns;
    assert!(report.verdict_ok(), "{}", report.render_table());
    assert_eq!(t.pulled_from_decode, 0);
    assert_eq!(t.recomputed + t.declined_near_expiry, 6);
    assert_eq!((t.kept, t.kept_unread), (6, 6));
    assert_eq!((report.verified, report.byte_errors), (8, 0));
}

#[test]
fn a_corrupted_pulled_request_is_caught() {
    let report = demo::run(&DemoOptions {
        mode: DemoMode::Pull,
        corrupt_one_request: true,
        ..small(SEED)
    })
    .expect("the demo runs");
    assert!(!report.verdict_ok());
    assert!(report.byte_errors > 0);
    assert_eq!(report.verified, 15, "exactly the corrupted request fails");
    assert_eq!(report.outcomes.ready, 16);
}

#[test]
fn a_corrupted_request_is_caught() {
    let report = demo::run(&DemoOptions {
        corrupt_one_request: true,
        ..small(SEED)
    })
    .expect("the demo runs");
    assert!(!report.verdict_ok(), "{}", report.render_table());
    assert!(!report.ok);
    assert!(report.byte_errors > 0);
    assert_eq!(report.verified, 15, "exactly the corrupted request fails");
    // The transfer itself was fine: every request still ended Ready, no block leaked.
    assert_eq!(report.outcomes.ready, 16);
    assert_eq!(report.double_frees, 0);
    assert!(report
        .verdict
        .starts_with("verdict: FAILED — 15/16 requests verified"));
}

#[test]
fn a_run_that_reaches_its_limit_reports_failed() {
    let started = std::time::Instant::now();
    let report = demo::run(&DemoOptions {
        timeout: Duration::from_millis(30),
        limit_grows_with_work: false,
        max_prompt_tokens: 2048,
        pool_blocks: 256,
        ..small(SEED)
    })
    .expect("the demo runs");
    assert!(started.elapsed() < Duration::from_secs(10));
    assert!(report.timed_out);
    assert!(!report.verdict_ok());
    assert!(
        report.verdict.starts_with("verdict: FAILED"),
        "{}",
        report.verdict
    );
    assert!(report.verdict.contains("timed out"), "{}", report.verdict);
}

#[test]
fn bad_options_are_refused() {
    let too_long = DemoOptions {
        max_prompt_tokens: 4096,
        pool_blocks: 16,
        ..DemoOptions::default()
    };
    assert!(matches!(
        demo::run(&too_long),
        Err(demo::DemoError::Options(_))
    ));
    let none = DemoOptions {
        requests: 0,
        ..DemoOptions::default()
    };
    assert!(demo::run(&none).is_err());
}

#[test]
fn the_pattern_depends_on_every_coordinate() {
    let key = 0x1234_5678_9abc_def0;
    let base = expected_byte(key, 3, RegionKind::Key, 40, 5, 17);
    let mut differ = 0;
    let variants = [
        expected_byte(key ^ 1, 3, RegionKind::Key, 40, 5, 17),
        expected_byte(key, 4, RegionKind::Key, 40, 5, 17),
        expected_byte(key, 3, RegionKind::Value, 40, 5, 17),
        expected_byte(key, 3, RegionKind::Key, 41, 5, 17),
        expected_byte(key, 3, RegionKind::Key, 40, 6, 17),
        expected_byte(key, 3, RegionKind::Key, 40, 5, 18),
    ];
    for v in variants {
        differ += usize::from(v != base);
    }
    // A byte is one of 256 values: allow one coincidence, no more.
    assert!(differ >= 5, "{variants:?} vs {base}");

    // Whole rows: any change of coordinate changes most of a head's 256 bytes.
    let row = |key, layer, kind, token, head| -> Vec<u8> {
        (0..256)
            .map(|b| expected_byte(key, layer, kind, token, head, b))
            .collect()
    };
    let a = row(key, 0, RegionKind::Key, 0, 0);
    for other in [
        row(key, 0, RegionKind::Key, 1, 0),
        row(key, 0, RegionKind::Key, 0, 1),
        row(key, 1, RegionKind::Key, 0, 0),
        row(key, 0, RegionKind::Value, 0, 0),
        row(key + 1, 0, RegionKind::Key, 0, 0),
    ] {
        let same = a.iter().zip(&other).filter(|(x, y)| x == y).count();
        assert!(same < 16, "{same} equal bytes");
    }
}

#[test]
fn filled_blocks_follow_the_hnd_layout() {
    let g = demo_geometry();
    assert_eq!(g.layout, KvLayout::Hnd);
    let row = (g.head_dim * g.dtype_bytes) as usize;
    let block_len = row * g.total_kv_heads as usize * g.kernel_block_size as usize;
    assert_eq!(block_len, 32 * 1024);
    // HND: heads outermost, then tokens, then the head's elements.
    assert_eq!(block_byte_offset(&g, 0, 0, 0), 0);
    assert_eq!(block_byte_offset(&g, 1, 0, 0), row);
    assert_eq!(block_byte_offset(&g, 0, 1, 0), row * 16);
    assert_eq!(block_byte_offset(&g, 15, 7, 255), block_len - 1);

    let key = request_key(&PairingKey::from_request_id(
        &RequestId::new("cmpl-abc-0-1234abcd").unwrap(),
    ));
    let mut block = vec![0u8; block_len];
    let first_token = 48; // the prompt's fourth block
    fill_kernel_block(&g, key, 2, RegionKind::Value, first_token, &mut block);
    for t in 0..16 {
        for h in 0..8 {
            for b in [0, 1, 7, 8, 100, 255] {
                assert_eq!(
                    block[block_byte_offset(&g, t, h, b)],
                    expected_byte(key, 2, RegionKind::Value, first_token + u64::from(t), h, b),
                    "token {t} head {h} byte {b}"
                );
            }
        }
    }
    // NHD puts tokens outermost.
    let nhd = kvhandoff_protocol::KvGeometry {
        layout: KvLayout::Nhd,
        ..g.clone()
    };
    assert_eq!(block_byte_offset(&nhd, 0, 1, 0), row);
    assert_eq!(block_byte_offset(&nhd, 1, 0, 0), row * 8);
    let mut nhd_block = vec![0u8; block_len];
    fill_kernel_block(&nhd, key, 2, RegionKind::Value, first_token, &mut nhd_block);
    assert_eq!(
        nhd_block[block_byte_offset(&nhd, 3, 5, 9)],
        block[block_byte_offset(&g, 3, 5, 9)]
    );
}

#[test]
fn pairing_keys_give_both_sides_the_same_pattern() {
    let p = RequestId::new("cmpl-0a1b-0-deadbeef").unwrap();
    let d = RequestId::new("cmpl-0a1b-0-0badf00d").unwrap();
    assert_eq!(
        request_key(&PairingKey::from_request_id(&p)),
        request_key(&PairingKey::from_request_id(&d))
    );
    let other = RequestId::new("cmpl-0a1b-1-0badf00d").unwrap();
    assert_ne!(
        request_key(&PairingKey::from_request_id(&p)),
        request_key(&PairingKey::from_request_id(&other))
    );
}

#[test]
fn bench_control_reports_positive_numbers() {
    let report = bench::control(&ControlOptions {
        requests: 500,
        actix_requests: 300,
        actix_pool_blocks: 64,
        actix_batch: 16,
        rounds: 3,
        timeout: Duration::from_secs(30),
    })
    .expect("the bench runs");
    assert_eq!(report.machine.decode_registers_first_rounds_ns.len(), 3);
    assert_eq!(report.actix.rounds_requests_per_sec.len(), 3);
    let mut rates = report.actix.rounds_requests_per_sec.clone();
    rates.sort_by(f64::total_cmp);
    assert_eq!(report.actix_requests_per_sec, rates[1], "the median round");
    assert!(report.machine_ns_per_request > 0.0);
    assert!(report.machine_ns_per_request_prefill_first > 0.0);
    assert!(report.actix_requests_per_sec > 0.0);
    assert_eq!(report.actix.ready, 300);
    assert_eq!(report.actix.sent, 300);
    assert_eq!(
        report.actix.races.decode_registers_first + report.actix.races.prefill_finishes_first,
        300
    );
    let v: serde_json::Value = serde_json::to_value(&report).unwrap();
    assert!(v["machine_ns_per_request"].as_f64().unwrap() > 0.0);
    assert!(v["actix_requests_per_sec"].as_f64().unwrap() > 0.0);
    assert!(report.render_table().contains("ns/request"));
}

/// The default run, for people: `cargo test --release --test demo -- --ignored --nocapture`.
#[test]
#[ignore = "the full default run; use --release"]
fn default_run_prints_its_report() {
    let report = demo::run(&DemoOptions::default()).expect("the demo runs");
    println!("{}", report.render_table());
    println!("{}", serde_json::to_string_pretty(&report).unwrap());
    assert!(report.verdict_ok());
    let bench = bench::control(&ControlOptions::default()).expect("the bench runs");
    println!("{}", bench.render_table());
    println!("{}", serde_json::to_string_pretty(&bench).unwrap());
}

#[cfg(not(feature = "nixl"))]
#[test]
fn nixl_without_the_feature_is_a_clear_error() {
    let err = demo::run(&DemoOptions {
        transport: DemoTransport::Nixl,
        ..small(SEED)
    })
    .expect_err("no NIXL in this build");
    assert!(matches!(err, demo::DemoError::NoNixl));
    assert_eq!(
        err.to_string(),
        "this build has no NIXL support; rebuild with --features nixl"
    );
    let addr = "127.0.0.1:1".parse().unwrap();
    let err = node::run(&NodeOptions::new(NodeRole::Decode, addr, addr)).expect_err("no NIXL");
    assert!(matches!(err, demo::DemoError::NoNixl));
}

/// Two free loopback ports (bound, then released), from below the ephemeral range.
fn two_ports() -> (std::net::SocketAddr, std::net::SocketAddr) {
    let [a, b] = kvhandoff_testkit::ports::loopback_ports();
    (a, b)
}

fn node_options(
    role: NodeRole,
    listen: std::net::SocketAddr,
    peer: std::net::SocketAddr,
) -> NodeOptions {
    NodeOptions {
        schedule: DemoOptions {
            requests: 40,
            seed: SEED,
            min_prompt_tokens: 16,
            max_prompt_tokens: 16,
            pool_blocks: 32,
            mean_arrival_gap: Duration::from_millis(12),
            // The two sides start their schedules a few milliseconds apart and a busy machine
            // delays calls by as much: a skew well above both keeps both races in P's count.
            max_call_skew: Duration::from_millis(60),
            timeout: Duration::from_secs(30),
            ..DemoOptions::default()
        },
        linger: Duration::from_secs(5),
        ..NodeOptions::new(role, listen, peer)
    }
}

/// The `node` roles, each with its own runtime and TCP side channel, on one in-memory fabric:
/// the same code paths as two `kvhandoff node` processes, minus NIXL.
#[test]
fn two_nodes_meet_over_the_side_channel_and_hand_off_every_byte() {
    let fabric = MemFabric::new();
    let (p_addr, d_addr) = two_ports();
    let (p, d) = std::thread::scope(|s| {
        // D first: it waits for P's side channel.
        let d = s.spawn(|| {
            node::run_on(
                &node_options(NodeRole::Decode, d_addr, p_addr),
                TransportKind::Mem(fabric.clone()),
            )
        });
        std::thread::sleep(Duration::from_millis(200));
        let p = s.spawn(|| {
            node::run_on(
                &node_options(NodeRole::Prefill, p_addr, d_addr),
                TransportKind::Mem(fabric.clone()),
            )
        });
        (p.join().unwrap(), d.join().unwrap())
    });
    let (NodeReport::Prefill(p), NodeReport::Decode(d)) = (p.unwrap(), d.unwrap()) else {
        panic!("wrong report kinds");
    };
    println!("{}", p.render_table());
    println!("{}", d.render_table());
    assert!(d.verdict_ok(), "{}", d.render_table());
    assert!(p.verdict_ok(), "{}", p.render_table());
    assert_eq!(d.role, ReportRole::Decode);
    assert_eq!((d.verified, d.byte_errors, d.outcomes.ready), (40, 0, 40));
    assert_eq!(p.prefill_outcomes.sent, 40);
    assert_eq!(
        p.races.decode_registers_first + p.races.prefill_finishes_first,
        40
    );
    assert!(p.races.decode_registers_first > 0, "{:?}", p.races);
    assert!(p.races.prefill_finishes_first > 0, "{:?}", p.races);
    assert!(p.peer_exited, "P saw D leave");
    assert_eq!(p.link.incoming_ok, 1);
    // D's JSON has the demo's keys.
    let demo_keys: Vec<String> = serde_json::to_value(demo::run(&small(SEED)).unwrap())
        .unwrap()
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    let v = serde_json::to_value(&d).unwrap();
    let d_keys: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
    assert_eq!(d_keys, demo_keys);
    assert_eq!(v["role"], "decode");
    let v = serde_json::to_value(NodeReport::Prefill(p)).unwrap();
    assert_eq!(v["role"], "prefill");
    assert_eq!(v["prefill_outcomes"]["sent"], 40);
}

#[test]
fn a_node_needs_the_router_link_to_pull() {
    let fabric = MemFabric::new();
    let (p_addr, d_addr) = two_ports();
    let mut options = node_options(NodeRole::Decode, d_addr, p_addr);
    options.schedule.mode = DemoMode::Pull;
    let err = node::run_on(&options, TransportKind::Mem(fabric.clone())).expect_err("no router");
    assert!(matches!(err, demo::DemoError::Options(_)), "{err}");
    assert!(err.to_string().contains("--router"), "{err}");
}

/// Two nodes in `mode` on one in-memory fabric (threads, TCP side channel and router link).
fn two_nodes(mode: DemoMode) -> (node::PrefillReport, DemoReport) {
    let fabric = MemFabric::new();
    let [p_addr, d_addr, router] = kvhandoff_testkit::ports::loopback_ports();
    let options = |role, listen, peer| {
        let mut o = node_options(role, listen, peer);
        o.schedule.mode = mode;
        o.schedule.max_prompt_tokens = 128;
        o.schedule.pool_blocks = 128;
        o.router = Some(router);
        o
    };
    let (p, d) = std::thread::scope(|s| {
        let d = s.spawn(|| {
            node::run_on(
                &options(NodeRole::Decode, d_addr, p_addr),
                TransportKind::Mem(fabric.clone()),
            )
        });
        std::thread::sleep(Duration::from_millis(200));
        let p = s.spawn(|| {
            node::run_on(
                &options(NodeRole::Prefill, p_addr, d_addr),
                TransportKind::Mem(fabric.clone()),
            )
        });
        (p.join().unwrap(), d.join().unwrap())
    });
    let (NodeReport::Prefill(p), NodeReport::Decode(d)) = (p.unwrap(), d.unwrap()) else {
        panic!("wrong report kinds");
    };
    println!("{}", p.render_table());
    println!("{}", d.render_table());
    assert!(d.verdict_ok(), "{}", d.render_table());
    assert!(p.verdict_ok(), "{}", p.render_table());
    assert_eq!((d.verified, d.byte_errors, d.outcomes.ready), (40, 0, 40));
    assert_eq!(p.prefill_outcomes.sent, 40);
    assert_eq!(d.bytes, d.expected_bytes);
    assert_eq!(p.bytes, p.expected_bytes);
    assert!(p.peer_exited, "P saw D leave");
    (p, d)
}

/// D reads every request from P: P's answers (the block ids) reach D over the router link.
#[test]
fn two_nodes_pull_every_byte_over_the_router_link() {
    let (p, d) = two_nodes(DemoMode::Pull);
    assert_eq!((d.mode.as_str(), d.pulled), ("pull", 40));
    assert_eq!((p.mode.as_str(), p.pulled), ("pull", 40));
    assert_eq!(p.races, Default::default(), "no race in pull");
}

#[test]
fn two_nodes_push_and_pull_mixed_requests() {
    let (p, d) = two_nodes(DemoMode::Mixed);
    assert!(d.pulled > 0 && d.pulled < 40, "{}", d.pulled);
    assert_eq!(
        p.races.decode_registers_first + p.races.prefill_finishes_first,
        40 - p.pulled
    );
}

/// Conversations across two nodes: D's keeps reach P over the router link, P reads back.
#[test]
fn two_nodes_run_conversations() {
    let (p, d) = two_nodes(DemoMode::Bidir);
    assert_eq!(d.turns.kept, 30);
    assert_eq!(d.turns.kept_read + d.turns.kept_unread, 30);
    assert_eq!(p.turns.later_turns, 30);
    assert_eq!(p.turns.read_back_verified, p.turns.pulled_from_decode);
    assert_eq!(p.turns.pulled_from_decode, d.turns.kept_read);
}

#[test]
fn a_node_whose_peer_never_comes_reports_failed() {
    let fabric = MemFabric::new();
    let (p_addr, d_addr) = two_ports();
    let started = std::time::Instant::now();
    let mut options = node_options(NodeRole::Decode, d_addr, p_addr);
    options.schedule.timeout = Duration::from_millis(500);
    let report = node::run_on(&options, TransportKind::Mem(fabric.clone())).unwrap();
    assert!(started.elapsed() < Duration::from_secs(10));
    assert!(!report.verdict_ok());
    let NodeReport::Decode(d) = report else {
        panic!("a decode report")
    };
    assert!(d.timed_out);
    assert!(
        d.errors.iter().any(|e| e.contains("never accepted")),
        "{:?}",
        d.errors
    );
}

#[cfg(feature = "nixl")]
#[test]
fn sixteen_requests_over_nixl_in_one_process() {
    let report = demo::run(&DemoOptions {
        transport: DemoTransport::Nixl,
        ..small(SEED)
    })
    .expect("the NIXL demo runs (source scripts/nixl-env.sh)");
    println!("{}", report.render_table());
    assert!(report.verdict_ok(), "{}", report.render_table());
    assert_eq!(report.transport, "nixl");
    assert_eq!((report.verified, report.byte_errors), (16, 0));
    assert!(
        report.races.decode_registers_first > 0,
        "{:?}",
        report.races
    );
    assert!(
        report.races.prefill_finishes_first > 0,
        "{:?}",
        report.races
    );
}

#[cfg(feature = "nixl")]
#[test]
fn sixteen_pulled_requests_over_nixl_in_one_process() {
    let report = demo::run(&DemoOptions {
        transport: DemoTransport::Nixl,
        mode: DemoMode::Pull,
        ..small(SEED)
    })
    .expect("the NIXL demo runs (source scripts/nixl-env.sh)");
    println!("{}", report.render_table());
    assert_eq!(report.transport, "nixl");
    assert_all_pulled(&report, 16);
}

#[cfg(feature = "nixl")]
#[test]
fn bidirectional_conversations_over_nixl_in_one_process() {
    let report = demo::run(&DemoOptions {
        transport: DemoTransport::Nixl,
        ..conversations(SEED)
    })
    .expect("the NIXL demo runs (source scripts/nixl-env.sh)");
    println!("{}", report.render_table());
    assert_eq!(report.transport, "nixl");
    assert_conversations(&report, 16);
    // NIXL counts no bytes: the handoffs and reads that completed.
    assert_eq!(report.bytes, report.expected_bytes);
}
