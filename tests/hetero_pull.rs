//! Pull between engines of different geometries, end to end in one process: P's ranks export,
//! the router hands P's answer to D's ranks, each D rank reads every link into it under the
//! grant fence (one import per P rank it needs, folded into one `Imported`), and runs every
//! transform of the pair on its side; every byte checked in D's geometry. In process (D knows
//! P's memory) and over side channels (P's grant names its buffer, `ReadGrant::memory`).

mod cli_json;

use kvhandoff_testkit::demo::DemoReport;
use kvhandoff_testkit::hetero::pair_demo::{run, HeteroDemoOptions};

fn pull(model: &str, prefill: &str, decode: &str, requests: usize) -> HeteroDemoOptions {
    HeteroDemoOptions {
        requests,
        pull: true,
        ..HeteroDemoOptions::new(model, prefill.parse().unwrap(), decode.parse().unwrap())
    }
}

fn ok(cell: &str, report: &DemoReport) {
    assert!(
        report.ok,
        "{cell}: {}\n{:?}",
        report.verdict,
        report.errors.first()
    );
    assert_eq!(report.mode, "pull", "{cell}");
    assert_eq!(
        (report.verified, report.pulled),
        (report.requests, report.requests),
        "{cell}"
    );
    assert_eq!(report.bytes, report.expected_bytes, "{cell}");
    assert_eq!(
        report.leaked_blocks.prefill + report.leaked_blocks.decode,
        0,
        "{cell}"
    );
}

/// TP up and down, block size, layout, pipeline stages, and every cache kind: where P would
/// have staged (sliced, permuted or regrouped), D reads P's blocks into its mirror and runs
/// P's part itself.
const CELLS: [(&str, &str, &str); 10] = [
    (
        "gqa8",
        "tp=1,block=16,layout=NHD",
        "tp=2,block=16,layout=NHD",
    ),
    (
        "gqa8",
        "tp=4,block=16,layout=NHD",
        "tp=1,block=32,layout=HND",
    ),
    (
        "gqa8",
        "tp=2,block=16,layout=NHD",
        "tp=4,block=32,layout=HND",
    ),
    (
        "gqa8",
        "tp=2,block=64,layout=NHD",
        "tp=2,block=16,layout=HND",
    ),
    (
        "gqa8",
        "tp=2,block=16,layout=NHD,pp=2",
        "tp=4,block=32,layout=HND",
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
        "tp=8,block=16,layout=NHD",
        "tp=1,block=32,layout=HND",
    ),
    (
        "mamba",
        "tp=4,block=16,layout=NHD",
        "tp=2,block=16,layout=NHD",
    ),
    (
        "mamba",
        "tp=1,block=16,layout=HND",
        "tp=2,block=16,layout=NHD,pp=2",
    ),
];

#[test]
fn pairs_of_different_geometries_pull_byte_for_byte() {
    let mut mirrored = false;
    for (model, p, d) in CELLS {
        let cell = format!("{model} {p} -> {d}");
        let report = run(&pull(model, p, d, 12)).unwrap_or_else(|e| panic!("{cell}: {e}"));
        ok(&cell, &report);
        let h = report.hetero.as_ref().unwrap();
        assert_eq!(
            h.sub_requests,
            2 * u64::from(h.links) * report.requests,
            "{cell}"
        );
        mirrored |= h.transforms.iter().any(|t| t.contains("P's part"));
    }
    assert!(
        mirrored,
        "no cell ran P's transforms on D: the mirror went untested"
    );
}

/// The wire across processes, in one process: each rank over its own TCP side channel, P's
/// grant naming the slot's KV buffer, D's route placing its reads there when the grant comes.
#[test]
fn pairs_pull_over_side_channels_from_the_memory_p_names() {
    for (model, p, d) in [CELLS[1], CELLS[2], CELLS[4], CELLS[5], CELLS[8]] {
        let cell = format!("{model} {p} -> {d}");
        let options = HeteroDemoOptions {
            side_channels: true,
            ..pull(model, p, d, 12)
        };
        let report = run(&options).unwrap_or_else(|e| panic!("{cell}: {e}"));
        ok(&cell, &report);
    }
}

/// Chaos on the readers: a third of the requests arm a fault on a random D rank's transport
/// (a refused post, a failed or half-landed read, a late one) with 8 requests in flight. Reads
/// fail by design; the accounting must hold: one event per request and side, every block back
/// on both sides, every loaded request byte-verified.
#[test]
fn chaos_fails_reads_but_never_the_accounting() {
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
        let cell = format!("{model} {p} -> {d}");
        let mut o = pull(model, p, d, 80);
        o.window = 8;
        o.chaos = 0.3;
        o.seed = seed;
        let r = run(&o).unwrap();
        let h = r.hetero.as_ref().unwrap();
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
            (r.requests, r.requests),
            "{cell}"
        );
        assert_eq!(r.events.duplicates + r.events.unknown, 0, "{cell}");
        assert_eq!(
            r.leaked_blocks.prefill + r.leaked_blocks.decode,
            0,
            "{cell}"
        );
        assert_eq!((r.verified, r.byte_errors), (r.outcomes.ready, 0), "{cell}");
    }
}

/// A conversation's next turn between different geometries, in one process: each request
/// pushed, then D keeps its blocks and P reads them back into its own geometry (the pair
/// planned the other way: one export per P rank on each D rank, one import per D rank on each
/// P rank), every byte of the read-back checked in P's geometry; in process and over side
/// channels.
#[test]
fn a_next_turn_reads_d_s_blocks_back_into_p_s_geometry() {
    for (model, p, d) in [CELLS[1], CELLS[2], CELLS[4], CELLS[5], CELLS[7], CELLS[9]] {
        for side_channels in [false, true] {
            let cell = format!("{model} {p} -> {d} (side channels {side_channels})");
            let options = HeteroDemoOptions {
                requests: 12,
                bidir: true,
                side_channels,
                ..HeteroDemoOptions::new(model, p.parse().unwrap(), d.parse().unwrap())
            };
            let r = run(&options).unwrap_or_else(|e| panic!("{cell}: {e}"));
            assert!(r.ok, "{cell}: {}\n{:?}", r.verdict, r.errors.first());
            assert_eq!(r.mode, "bidir", "{cell}");
            let t = &r.turns;
            // Every next turn read back, every byte checked; every keep read.
            assert_eq!(
                (t.later_turns, t.pulled_from_decode, t.read_back_verified),
                (r.requests, r.requests, r.requests),
                "{cell}"
            );
            assert_eq!((t.kept, t.kept_read), (r.requests, r.requests), "{cell}");
            assert!(t.read_back_bytes > 0, "{cell}");
            assert_eq!(r.bytes, r.expected_bytes, "{cell}");
        }
    }
}

/// Mixed: each request pushed or pulled by the seed, both paths interleaved on the same ranks
/// and endpoints, in process and over side channels; every byte checked in D's geometry either
/// way. A chaos run on the in-memory fabric arms faults on writers and readers alike and must
/// keep the accounting.
#[test]
fn a_mixed_run_pushes_and_pulls_on_the_same_ranks() {
    for (model, p, d) in [CELLS[1], CELLS[2], CELLS[5], CELLS[8]] {
        for side_channels in [false, true] {
            let cell = format!("{model} {p} -> {d} (side channels {side_channels})");
            let options = HeteroDemoOptions {
                requests: 16,
                mixed: true,
                side_channels,
                window: 6,
                ..HeteroDemoOptions::new(model, p.parse().unwrap(), d.parse().unwrap())
            };
            let r = run(&options).unwrap_or_else(|e| panic!("{cell}: {e}"));
            // The precondition: both paths ran.
            assert!(
                r.pulled > 0 && r.pulled < r.requests,
                "{cell}: {}",
                r.pulled
            );
            assert!(r.ok, "{cell}: {}\n{:?}", r.verdict, r.errors.first());
            assert_eq!(r.mode, "mixed", "{cell}");
            assert_eq!(r.verified, r.requests, "{cell}");
            assert_eq!(r.bytes, r.expected_bytes, "{cell}");
        }
    }
    let chaos = HeteroDemoOptions {
        requests: 24,
        mixed: true,
        chaos: 0.3,
        window: 8,
        ..HeteroDemoOptions::new(
            "gqa8",
            CELLS[1].1.parse().unwrap(),
            CELLS[1].2.parse().unwrap(),
        )
    };
    let r = run(&chaos).expect("the chaos run");
    assert!(
        r.hetero.as_ref().is_some_and(|h| h.faults_injected > 0),
        "{}",
        r.verdict
    );
    assert_eq!(
        r.outcomes.ready + r.outcomes.failed,
        r.requests,
        "{}",
        r.verdict
    );
    assert_eq!(
        r.outcomes.missing + r.prefill_outcomes.missing,
        0,
        "{}",
        r.verdict
    );
    assert_eq!(r.byte_errors, 0, "{}", r.verdict);
    assert_eq!(
        r.leaked_blocks.prefill + r.leaked_blocks.decode,
        0,
        "{}",
        r.verdict
    );
    assert_eq!(r.verified, r.outcomes.ready, "{}", r.verdict);
}

/// A conversation whose first turn is pulled (as vLLM's NIXL connector moves it) or mixed, then
/// read back: both directions of reads on the same ranks.
#[test]
fn a_pulled_first_turn_is_read_back_too() {
    for ((model, p, d), (pull, mixed)) in [(CELLS[1], (true, false)), (CELLS[5], (false, true))] {
        let cell = format!("{model} {p} -> {d} (pull {pull}, mixed {mixed})");
        let options = HeteroDemoOptions {
            requests: 12,
            bidir: true,
            pull,
            mixed,
            side_channels: true,
            ..HeteroDemoOptions::new(model, p.parse().unwrap(), d.parse().unwrap())
        };
        let r = run(&options).unwrap_or_else(|e| panic!("{cell}: {e}"));
        assert!(r.pulled > 0, "{cell}: the precondition, first turns pulled");
        assert!(r.ok, "{cell}: {}\n{:?}", r.verdict, r.errors.first());
        assert_eq!(r.mode, "bidir", "{cell}");
        assert_eq!(r.verified, r.requests, "{cell}");
        assert_eq!(r.turns.read_back_verified, r.requests, "{cell}");
        assert_eq!(r.bytes, r.expected_bytes, "{cell}");
    }
}

#[test]
fn the_cli_pulls_a_pair() {
    let (code, json) = cli_json::run_json(
        "demo",
        &[
            "--model",
            "swa",
            "--prefill",
            "tp=2,block=16,layout=NHD",
            "--decode",
            "tp=1,block=32,layout=HND",
            "--mode",
            "pull",
            "--requests",
            "8",
        ],
    );
    assert_eq!(code, Some(0), "{json}");
    assert_eq!(json["ok"], true);
    assert_eq!(json["mode"], "pull");
    assert_eq!(json["verified"], 8);
}
