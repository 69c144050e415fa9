//! The heterogeneous demo end to end on the in-memory transport: every rank of a pair of
//! different geometries in one runtime, each request split into pair sub-requests by the
//! connectors, moved by the lease protocol and checked byte for byte in D's geometry. Then
//! deliberate faults, each of which the report must catch, and the CLI's refusals.

mod cli_json;

use kvhandoff_testkit::demo::{DemoError, DemoReport};
use kvhandoff_testkit::hetero::pair_demo::{run, HeteroDemoOptions, HeteroFault};

fn options(model: &str, prefill: &str, decode: &str, requests: usize) -> HeteroDemoOptions {
    HeteroDemoOptions {
        requests,
        ..HeteroDemoOptions::new(model, prefill.parse().unwrap(), decode.parse().unwrap())
    }
}

fn ok(report: &DemoReport) {
    assert!(report.ok, "{}\n{:?}", report.verdict, report.errors.first());
    assert_eq!(report.verified, report.requests);
    assert_eq!(report.bytes, report.expected_bytes);
}

/// The cells of the NIXL slice and more, each a pair of engines that differ in TP, block size,
/// layout or cache kind: every request ready, every byte right, every block back.
#[test]
fn pairs_of_different_geometries_hand_off_over_the_lease_protocol() {
    let cells = [
        (
            "gqa8",
            "tp=2,block=16,layout=NHD",
            "tp=4,block=16,layout=NHD",
        ),
        (
            "gqa8",
            "tp=4,block=16,layout=NHD",
            "tp=1,block=16,layout=NHD",
        ),
        (
            "gqa8",
            "tp=1,block=16,layout=HND",
            "tp=1,block=64,layout=HND",
        ),
        (
            "gqa8",
            "tp=2,block=64,layout=NHD",
            "tp=2,block=16,layout=HND",
        ),
        (
            "swa",
            "tp=2,block=16,layout=NHD",
            "tp=4,block=32,layout=HND",
        ),
        (
            "mla",
            "tp=4,block=16,layout=NHD",
            "tp=2,block=64,layout=NHD",
        ),
        (
            "gqa2",
            "tp=2,block=16,layout=NHD",
            "tp=8,block=16,layout=NHD",
        ),
        (
            "mamba",
            "tp=4,block=16,layout=NHD",
            "tp=2,block=16,layout=NHD",
        ),
        // Pipeline stages: ranks indexed stage by stage; each stage writes its layer window.
        (
            "gqa8",
            "tp=2,block=16,layout=NHD,pp=2",
            "tp=4,block=32,layout=HND",
        ),
        (
            "mla",
            "tp=2,block=16,layout=NHD,pp=2",
            "tp=1,block=64,layout=NHD,pp=2",
        ),
        (
            "mamba",
            "tp=1,block=16,layout=HND",
            "tp=2,block=16,layout=NHD,pp=2",
        ),
    ];
    for (model, p, d) in cells {
        let report = run(&options(model, p, d, 12)).unwrap();
        ok(&report);
        let h = report.hetero.as_ref().unwrap();
        assert_eq!(h.sub_requests, 2 * u64::from(h.links) * report.requests);
        assert!(h.descriptors > 0, "{model} {p} -> {d}");
    }
}

/// Replicated heads: P at TP 8 over 2 KV heads has 6 ranks that write nothing (each gets its
/// blocks back at once), and D at TP 1 waits for the 2 that do.
#[test]
fn replica_ranks_write_nothing_and_get_their_blocks_back() {
    let report = run(&options(
        "gqa2",
        "tp=8,block=32,layout=HND",
        "tp=1,block=16,layout=NHD",
        10,
    ))
    .unwrap();
    ok(&report);
    let h = report.hetero.unwrap();
    assert_eq!((h.links, h.idle_prefill_ranks), (2, 6));
    assert_eq!(report.events.prefill, report.requests);
}

/// Both races happen between the ranks of a request: P's endpoints count registrations that
/// came before their prefill finished and after.
#[test]
fn both_races_are_run() {
    let report = run(&options(
        "gqa8",
        "tp=2,block=16,layout=NHD",
        "tp=4,block=32,layout=HND",
        24,
    ))
    .unwrap();
    ok(&report);
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

/// A link whose write cannot be placed fails its sub-request (`PostFailed`): the D rank it
/// feeds fails the request, the P rank releases its blocks, every rank still gets its one
/// event, nothing leaks, and the other requests are untouched.
#[test]
fn an_unplaced_link_fails_its_request_cleanly() {
    let mut o = options(
        "gqa8",
        "tp=2,block=16,layout=NHD",
        "tp=4,block=16,layout=NHD",
        6,
    );
    o.fault = Some(HeteroFault::UnfiledLink);
    let report = run(&o).unwrap();
    assert!(!report.ok);
    assert_eq!(report.outcomes.failed, 1, "{:?}", report.outcomes);
    assert_eq!(report.prefill_outcomes.released, 1);
    assert_eq!(report.outcomes.ready, report.requests - 1);
    assert_eq!(report.verified, report.requests - 1);
    assert_eq!(report.byte_errors, 0);
    assert_eq!(report.outcomes.missing + report.prefill_outcomes.missing, 0);
    assert_eq!(
        report.leaked_blocks.prefill + report.leaked_blocks.decode,
        0
    );
    assert!(
        report.errors.iter().any(|e| e.contains("PostFailed")),
        "{:?}",
        report.errors
    );
}

/// One piece landing one row off is caught by the byte check.
#[test]
fn a_misplaced_piece_is_caught_by_the_byte_check() {
    let mut o = options(
        "gqa8",
        "tp=1,block=16,layout=NHD",
        "tp=2,block=32,layout=HND",
        4,
    );
    o.fault = Some(HeteroFault::ShiftedPiece);
    let report = run(&o).unwrap();
    assert!(!report.ok);
    // The request's protocol side went through: the fault is in the bytes alone.
    assert_eq!(report.outcomes.ready, report.requests);
    assert_eq!(report.verified, report.requests - 1);
    assert!(report.byte_errors > 0);
}

#[test]
fn pairs_the_planner_refuses_are_option_errors() {
    for (model, p, d) in [
        (
            "gqa8",
            "tp=3,block=16,layout=NHD",
            "tp=1,block=16,layout=NHD",
        ),
        (
            "swa",
            "tp=1,block=16,layout=NHD,pp=4",
            "tp=1,block=16,layout=NHD",
        ),
        (
            "nope",
            "tp=1,block=16,layout=NHD",
            "tp=1,block=16,layout=NHD",
        ),
    ] {
        let o = HeteroDemoOptions::new(
            model,
            p.parse()
                .unwrap_or_else(|_| "tp=1,block=16,layout=NHD".parse().unwrap()),
            d.parse().unwrap(),
        );
        match run(&o) {
            Err(DemoError::Options(why)) => assert!(!why.is_empty()),
            other => panic!("{model} {p}: {other:?}"),
        }
    }
}

fn demo(args: &[&str]) -> (Option<i32>, serde_json::Value) {
    cli_json::run_json("demo", args)
}

#[test]
fn the_cli_runs_a_pair_and_refuses_bad_ones_with_exit_2() {
    let (code, json) = demo(&[
        "--model",
        "mla",
        "--prefill",
        "tp=2,block=16,layout=NHD",
        "--decode",
        "tp=4,block=64,layout=HND",
        "--requests",
        "6",
    ]);
    assert_eq!(code, Some(0), "{json}");
    assert_eq!(json["ok"], true);
    assert_eq!(json["verified"], 6);
    assert_eq!(json["hetero"]["model"], "mla");
    // The report's keys are the demo's.
    for key in [
        "races",
        "outcomes",
        "prefill_outcomes",
        "bytes",
        "leaked_blocks",
        "verdict",
    ] {
        assert!(json.get(key).is_some(), "{key}");
    }
    for bad in [
        [
            "--model",
            "gqa8",
            "--prefill",
            "tp=3,block=16,layout=NHD",
            "--decode",
            "tp=1,block=16,layout=NHD",
        ],
        [
            "--model",
            "gqa8",
            "--prefill",
            "tp=1,block=16,layout=XYZ",
            "--decode",
            "tp=1,block=16,layout=NHD",
        ],
        [
            "--model",
            "gqa8",
            "--prefill",
            "tp=1,block=16,layout=NHD",
            "--decode",
            "tp=0,block=16,layout=NHD",
        ],
    ] {
        let (code, json) = demo(&bad);
        assert_eq!(code, Some(2), "{bad:?}: {json}");
        assert!(
            json["error"].as_str().is_some_and(|e| !e.is_empty()),
            "{json}"
        );
    }
    let (code, json) = demo(&[
        "--model",
        "gqa8",
        "--prefill",
        "tp=1,block=16,layout=NHD",
        "--decode",
        "tp=2,block=16,layout=NHD",
        "--chaos",
        "0.5",
        "--transport",
        "nixl",
    ]);
    assert_eq!(code, Some(2), "{json}");
    assert!(
        json["error"]
            .as_str()
            .is_some_and(|e| e.contains("--transport mem")),
        "{json}"
    );
}

/// D aborts a multi-rank request after registering and before any P rank finished: its
/// connector aborts the sub-request at every P rank that writes to it. D fails the request
/// once, every rank gets its one event, nothing leaks, and the P ranks that would have written
/// to it release their blocks unsent. (That D's blocks go back only after every pair settled is
/// the fan-in's rule, caught by the simulator's S10 under `free_on_first_source_settled`.)
#[test]
fn a_decode_abort_fails_the_request_once_at_every_rank() {
    let mut o = options(
        "gqa2",
        "tp=4,block=16,layout=NHD",
        "tp=1,block=32,layout=HND",
        5,
    );
    o.fault = Some(HeteroFault::DecodeAborts);
    let report = run(&o).unwrap();
    assert!(!report.ok);
    assert_eq!(report.outcomes.failed, 1, "{:?}", report.outcomes);
    assert_eq!(report.outcomes.ready, report.requests - 1);
    assert_eq!(
        report.prefill_outcomes.released, 1,
        "{:?}",
        report.prefill_outcomes
    );
    assert_eq!(report.outcomes.missing + report.prefill_outcomes.missing, 0);
    assert_eq!(
        report.leaked_blocks.prefill + report.leaked_blocks.decode,
        0
    );
    assert_eq!(report.events.decode, report.requests);
    assert_eq!(report.events.duplicates + report.events.unknown, 0);
    assert!(
        report.errors.iter().any(|e| e.contains("Aborted")),
        "{:?}",
        report.errors
    );
}

/// Load: many requests, up to 16 in flight at once on the same endpoints (each in its own
/// memory slot), so that later requests' calls interleave with earlier ones' writes and events.
#[test]
fn many_requests_in_flight_at_once() {
    let mut o = options(
        "swa",
        "tp=4,block=32,layout=HND",
        "tp=2,block=16,layout=NHD",
        96,
    );
    o.window = 16;
    let report = run(&o).unwrap();
    ok(&report);
    assert!(report.races.decode_registers_first > 0 && report.races.prefill_finishes_first > 0);
    let mut o = options(
        "gqa8",
        "tp=1,block=16,layout=NHD",
        "tp=1,block=16,layout=NHD",
        4,
    );
    o.window = 33;
    assert!(matches!(run(&o), Err(DemoError::Options(_))));
}

/// Chaos: a third of the requests arm a transport fault on a random P rank (a refused post, a
/// failed or half-landed write, a late landing) while 8 requests are in flight. Requests fail
/// by design; the accounting must hold: one event per request and side, every block back,
/// every ready request byte-verified, nothing counted twice.
#[test]
fn chaos_fails_requests_but_never_the_accounting() {
    for (model, p, d, seed) in [
        (
            "gqa8",
            "tp=2,block=16,layout=NHD",
            "tp=4,block=32,layout=HND",
            3,
        ),
        (
            "gqa2",
            "tp=8,block=32,layout=HND",
            "tp=1,block=16,layout=NHD",
            4,
        ),
        (
            "mamba",
            "tp=1,block=64,layout=HND",
            "tp=4,block=16,layout=NHD",
            5,
        ),
    ] {
        let mut o = options(model, p, d, 80);
        o.window = 8;
        o.chaos = 0.3;
        o.seed = seed;
        let r = run(&o).unwrap();
        let cell = format!("{model} {p} -> {d}");
        let h = r.hetero.as_ref().unwrap();
        // The precondition: faults were armed and some requests failed.
        assert!(
            h.faults_injected > 0 && r.outcomes.failed > 0,
            "{cell}: {}",
            r.verdict
        );
        assert!(!r.timed_out, "{cell}");
        assert_eq!(r.outcomes.ready + r.outcomes.failed, r.requests, "{cell}");
        assert_eq!(
            r.prefill_outcomes.sent + r.prefill_outcomes.released,
            r.requests,
            "{cell}"
        );
        assert_eq!(r.outcomes.missing + r.prefill_outcomes.missing, 0, "{cell}");
        assert_eq!(
            (r.events.decode, r.events.prefill),
            (r.requests, r.requests)
        );
        assert_eq!(r.events.duplicates + r.events.unknown, 0, "{cell}");
        assert_eq!(
            r.leaked_blocks.prefill + r.leaked_blocks.decode,
            0,
            "{cell}"
        );
        assert_eq!((r.verified, r.byte_errors), (r.outcomes.ready, 0), "{cell}");
    }
    let mut o = options(
        "gqa8",
        "tp=1,block=16,layout=NHD",
        "tp=2,block=16,layout=NHD",
        4,
    );
    o.chaos = 1.5;
    assert!(matches!(run(&o), Err(DemoError::Options(_))));
}

/// P's transforms run in its route when D's registration comes, right before the write: a
/// request filed without that staging work moves staging memory P never filled, and the byte
/// check catches it. (The precondition: the pair stages on P.)
#[test]
fn staging_runs_when_the_registration_comes_and_is_checked() {
    let mut o = options(
        "gqa8",
        "tp=2,block=16,layout=NHD",
        "tp=4,block=32,layout=HND",
        4,
    );
    o.fault = Some(HeteroFault::Unstaged);
    let report = run(&o).unwrap();
    let h = report.hetero.as_ref().unwrap();
    assert!(
        h.transforms.iter().any(|t| t.contains("on P")),
        "{:?}",
        h.transforms
    );
    assert_eq!(report.outcomes.ready, report.requests);
    assert_eq!(report.verified, report.requests - 1);
    assert!(report.byte_errors > 0);
}

/// The wire a pair across processes uses, in one process: every rank over its own TCP side
/// channel (rank `R` at its engine's base port + `R`), a routed rank's handshake accepted by the
/// peer's route, D naming its request's buffers in its registration (`Register::memory`) and P
/// placing each link's pieces there at post time. Pairs where each D rank has one P writer
/// (more TP on D, block size, layout, a hybrid cache, MLA replicas) and where it has several
/// (less TP on D, and P's pipeline stages), each P rank then reached at its own port.
#[test]
fn pairs_hand_off_over_side_channels_with_the_memory_d_names() {
    let cells = [
        (
            "gqa8",
            "tp=1,block=16,layout=NHD",
            "tp=2,block=32,layout=HND",
        ),
        (
            "gqa8",
            "tp=2,block=16,layout=HND",
            "tp=2,block=64,layout=HND",
        ),
        (
            "gqa8",
            "tp=2,block=64,layout=NHD",
            "tp=2,block=16,layout=HND",
        ),
        (
            "swa",
            "tp=1,block=16,layout=NHD",
            "tp=4,block=32,layout=HND",
        ),
        (
            "mamba",
            "tp=1,block=16,layout=HND",
            "tp=2,block=16,layout=NHD",
        ),
        (
            "mla",
            "tp=2,block=16,layout=NHD",
            "tp=2,block=64,layout=NHD",
        ),
        (
            "gqa8",
            "tp=4,block=16,layout=NHD",
            "tp=1,block=32,layout=HND",
        ),
        (
            "gqa8",
            "tp=2,block=16,layout=NHD,pp=2",
            "tp=2,block=16,layout=HND",
        ),
    ];
    for (model, p, d) in cells {
        let options = HeteroDemoOptions {
            side_channels: true,
            ..options(model, p, d, 12)
        };
        let report = run(&options).unwrap_or_else(|e| panic!("{model} {p} → {d}: {e}"));
        ok(&report);
    }
}
