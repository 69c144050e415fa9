//! The executor and verifier on a representative subset of the matrix (every model, every TP
//! pair, a few block and layout pairs; the full matrix runs in release through
//! `kvhandoff matrix`), and plans corrupted on purpose, which the verifier must reject.

use kvhandoff_protocol::hetero::{model, plan_pair, HeteroError, PairPlan, Space};
use kvhandoff_protocol::KvLayout;

use super::handoff::verify::Expected;
use super::handoff::{Handoff, HandoffError, RequestShape};
use super::matrix::{edge_cells, memory_wires, run_cell, Cell, Outcome, PASSES, TPS};
use super::plan_report::{plan_report, PlanReportError};
use super::vllm::vllm_verdict;
use super::wire::MemoryWire;

/// Block and layout pairs that, over every model and TP pair, exercise every transform on
/// both sides and by addressing.
const SUBSET: [((u32, KvLayout), (u32, KvLayout)); 4] = [
    ((16, KvLayout::Nhd), (16, KvLayout::Nhd)),
    ((16, KvLayout::Hnd), (64, KvLayout::Nhd)),
    ((64, KvLayout::Nhd), (32, KvLayout::Hnd)),
    ((32, KvLayout::Hnd), (16, KvLayout::Hnd)),
];

#[test]
fn a_representative_subset_of_the_matrix_verifies() {
    let mut cells = Vec::new();
    for m in &kvhandoff_protocol::hetero::MODELS {
        for p_tp in TPS {
            for d_tp in TPS {
                for ((pb, pl), (db, dl)) in SUBSET {
                    cells.push(Cell {
                        model: m,
                        prefill: kvhandoff_protocol::hetero::SideSpec::new(p_tp, pb, pl),
                        decode: kvhandoff_protocol::hetero::SideSpec::new(d_tp, db, dl),
                    });
                }
            }
        }
    }
    let reports = super::matrix::run_cells(&cells, 2);
    assert_eq!(reports.len(), 5 * 16 * 4);
    for r in &reports {
        assert_eq!(
            r.outcome,
            Outcome::Verified,
            "{} {} → {}: {:?}",
            r.model,
            r.prefill,
            r.decode,
            r.reason
        );
        assert_eq!(r.passes.len(), PASSES.len());
    }
    // Every kernel on both sides ran somewhere in the subset.
    let all: Vec<&String> = reports.iter().flat_map(|r| &r.transforms).collect();
    for t in [
        "slice heads on P",
        "gather heads on D",
        "permute on P",
        "permute on D",
        "regroup on P",
        "regroup on D",
    ] {
        assert!(all.iter().any(|s| s.as_str() == t), "{t} never ran");
    }
}

#[test]
fn the_edge_cells_verify_or_say_why_they_cannot_work() {
    for cell in edge_cells() {
        let r = run_cell(&cell, &PASSES, 5, &mut memory_wires);
        let impossible = cell.prefill.tp == 3
            || cell.decode.tp == 16
            || cell.prefill.pp == 4 && cell.model.name == "swa"
            || cell.decode.block == 24;
        if impossible {
            assert_eq!(r.outcome, Outcome::Rejected, "{r:?}");
            assert!(!r.broken);
        } else {
            assert_eq!(r.outcome, Outcome::Verified, "{r:?}");
        }
    }
}

fn handoff(name: &str, p: &str, d: &str, tokens: u64, cached: u64) -> Handoff {
    let pair = plan_pair(model(name).unwrap(), p.parse().unwrap(), d.parse().unwrap()).unwrap();
    let shape = RequestShape {
        tokens,
        cached_tokens: cached,
        seed: 11,
    };
    Handoff::prepare(pair, shape).unwrap()
}

/// Runs `h`, which must run, and returns the verifier's verdict.
fn verdict(mut h: Handoff) -> Result<(), super::handoff::verify::Mismatch> {
    h.run(&mut MemoryWire)
        .expect("the corrupted plan still runs");
    h.verify()
}

#[test]
fn the_untouched_plan_verifies() {
    let h = handoff(
        "gqa8",
        "tp=2,block=16,layout=HND",
        "tp=1,block=32,layout=HND",
        150,
        0,
    );
    verdict(h).unwrap();
}

#[test]
fn swapped_heads_are_caught() {
    // P tp=2 → D tp=1, HND: each writer writes its four heads in place. Swap where the two
    // links' first pieces land: heads 0..4 and 4..8 of one block trade places.
    let mut h = handoff(
        "gqa8",
        "tp=2,block=16,layout=HND",
        "tp=1,block=16,layout=HND",
        150,
        0,
    );
    let (a, b) = (
        h.plan.transfers[0].pieces[0].dst,
        h.plan.transfers[1].pieces[0].dst,
    );
    assert_eq!(
        h.plan.transfers[0].pieces[0].len,
        h.plan.transfers[1].pieces[0].len
    );
    h.plan.transfers[0].pieces[0].dst = b;
    h.plan.transfers[1].pieces[0].dst = a;
    let m = verdict(h).unwrap_err();
    assert_eq!(m.expected, Expected::Reference);
    assert!(m.location.contains("head"), "{m}");
}

#[test]
fn a_tail_left_unzeroed_is_caught() {
    let mut h = handoff(
        "gqa8",
        "tp=1,block=16,layout=NHD",
        "tp=1,block=16,layout=NHD",
        150,
        0,
    );
    // The tail's last byte only: an off-by-one in the zeroed range.
    h.plan.zero[0].len -= 1;
    let m = verdict(h).unwrap_err();
    assert_eq!((m.expected, m.wrong_bytes), (Expected::Zero, 1), "{m}");
}

#[test]
fn a_piece_one_row_off_is_caught() {
    let mut h = handoff(
        "swa",
        "tp=1,block=16,layout=HND",
        "tp=2,block=16,layout=HND",
        150,
        0,
    );
    let row = h.pair.model.row_bytes();
    h.plan.transfers[0].pieces[0].src += row;
    let m = verdict(h).unwrap_err();
    assert_eq!(m.expected, Expected::Reference, "{m}");
}

#[test]
fn a_dropped_piece_is_caught() {
    let mut h = handoff(
        "mamba",
        "tp=2,block=32,layout=NHD",
        "tp=1,block=32,layout=NHD",
        100,
        64,
    );
    // Drop a mamba state piece: D's state keeps its junk.
    let t = h
        .plan
        .transfers
        .iter_mut()
        .find(|t| t.src_space == Space::Kv && t.dst_space == Space::Kv)
        .unwrap();
    t.pieces.pop();
    let m = verdict(h).unwrap_err();
    assert!(m.found_untouched, "{m}");
}

#[test]
fn a_stray_write_outside_the_request_is_caught() {
    let mut h = handoff(
        "gqa2",
        "tp=1,block=16,layout=HND",
        "tp=1,block=16,layout=HND",
        150,
        0,
    );
    // Push one piece past the end of the blocks the request lists: into a free block of D.
    let listed: Vec<u32> = h.decode_blocks.groups[0].clone();
    let free = (0..h.decode_memory.pool_blocks)
        .find(|b| !listed.contains(b))
        .unwrap();
    let block_len = h.pair.decode.ranks[0].tensors[0].block_len;
    let piece = &mut h.plan.transfers[0].pieces[0];
    piece.dst = u64::from(free) * block_len;
    piece.len = piece.len.min(block_len);
    let m = verdict(h).unwrap_err();
    assert!(
        m.expected == Expected::Untouched || m.expected == Expected::Reference,
        "{m}"
    );
    assert!(m.wrong_bytes > 0);
}

#[test]
fn a_missing_permute_is_caught() {
    // P NHD → D HND at equal TP: P permutes into staging. Without the permute the staging holds
    // NHD blocks the plan calls HND: the job refuses, or the bytes are wrong.
    let mut h = handoff(
        "gqa8",
        "tp=2,block=16,layout=NHD",
        "tp=2,block=16,layout=HND",
        150,
        0,
    );
    for job in &mut h.plan.prefill_jobs {
        job.ops.clear();
        job.output.format.layout = KvLayout::Nhd;
    }
    let ran = h.run(&mut MemoryWire);
    assert!(ran.is_ok());
    assert!(h.verify().is_err());
    // And a job whose ops do not match its declared output is refused outright.
    let mut h = handoff(
        "gqa8",
        "tp=2,block=16,layout=NHD",
        "tp=2,block=16,layout=HND",
        150,
        0,
    );
    h.plan.prefill_jobs[0].ops.clear();
    assert!(matches!(
        h.run(&mut MemoryWire),
        Err(HandoffError::Stage { .. })
    ));
}

#[test]
fn a_head_written_twice_is_refused() {
    // gqa2 P tp=4 → D tp=1: P ranks 0 and 2 write. A plan that also had P rank 1 (a replica of
    // head 0) write head 0 would write D's bytes twice: the executor refuses it before the wire.
    let mut h = handoff(
        "gqa2",
        "tp=4,block=16,layout=HND",
        "tp=1,block=16,layout=HND",
        150,
        0,
    );
    let twice = h.plan.transfers[0].clone();
    h.plan.transfers.push(twice);
    assert!(matches!(
        h.run(&mut MemoryWire),
        Err(HandoffError::Overlap { .. })
    ));
}

#[test]
fn wrong_layers_are_caught() {
    // Equal geometry: region `r`'s pieces read P's tensor `r` at the same offsets for every
    // layer. Make the first piece of layer 0 read layer 1's bytes instead.
    let mut h = handoff(
        "mla",
        "tp=1,block=16,layout=HND",
        "tp=1,block=16,layout=HND",
        150,
        0,
    );
    let bases = h.prefill_memory.ranks[0].tensor_bases.clone();
    let pieces = &mut h.plan.transfers[0].pieces;
    let first = pieces[0];
    assert!(first.src < bases[1], "the first piece reads layer 0");
    pieces[0].src = first.src - bases[0] + bases[1];
    let m = verdict(h).unwrap_err();
    assert!(m.location.contains("layer 0 Latent"), "{m}");
    assert_eq!(m.expected, Expected::Reference);
}

#[test]
fn plans_out_of_bounds_are_refused_not_panics() {
    let mut h = handoff(
        "gqa8",
        "tp=1,block=16,layout=HND",
        "tp=2,block=16,layout=NHD",
        150,
        0,
    );
    h.plan.zero[0].addr = u64::MAX - 3;
    assert!(matches!(
        h.run(&mut MemoryWire),
        Err(HandoffError::OutOfBounds { .. })
    ));
}

#[test]
fn bad_shapes_say_why() {
    let pair: PairPlan = plan_pair(
        model("gqa8").unwrap(),
        "tp=1,block=16,layout=HND".parse().unwrap(),
        "tp=1,block=32,layout=HND".parse().unwrap(),
    )
    .unwrap();
    let shape = |tokens, cached_tokens| RequestShape {
        tokens,
        cached_tokens,
        seed: 0,
    };
    let e = Handoff::prepare(pair.clone(), shape(100, 16)).unwrap_err();
    assert!(
        e.to_string().contains("not a whole number of D's 32-token"),
        "{e}"
    );
    assert!(matches!(
        Handoff::prepare(pair.clone(), shape(100, 100)),
        Err(HandoffError::Shape(_))
    ));
    assert!(matches!(
        Handoff::prepare(pair, shape(1 << 30, 0)),
        Err(HandoffError::Plan(HeteroError::TooManyTokens { .. }))
    ));
}

#[test]
fn vllm_verdicts_follow_the_references() {
    let v = |m: &str, p: &str, d: &str| {
        vllm_verdict(model(m).unwrap(), &p.parse().unwrap(), &d.parse().unwrap())
    };
    let hnd16 = "tp=2,block=16,layout=HND";
    assert_eq!(v("gqa8", hnd16, hnd16).label(), "push");
    // Block sizes differ: push asserts both ways; pull takes D ≥ P without HMA, in HND.
    assert_eq!(
        v("gqa8", hnd16, "tp=2,block=32,layout=HND").label(),
        "pull only"
    );
    assert_eq!(
        v("gqa8", "tp=2,block=32,layout=HND", hnd16).label(),
        "rejected"
    );
    assert_eq!(
        v("swa", hnd16, "tp=2,block=32,layout=HND").label(),
        "rejected"
    );
    // Layouts differ: pull with the permute flag, P HND → D NHD only.
    assert_eq!(
        v("gqa8", hnd16, "tp=2,block=16,layout=NHD").label(),
        "pull only"
    );
    assert_eq!(
        v("gqa8", "tp=2,block=16,layout=NHD", hnd16).label(),
        "rejected"
    );
    assert_eq!(v("mla", "tp=2,block=16,layout=NHD", hnd16).label(), "push");
    // A KV-replicated D with more ranks than P: pull only.
    assert_eq!(
        v(
            "gqa2",
            "tp=1,block=16,layout=HND",
            "tp=4,block=16,layout=HND"
        )
        .label(),
        "pull only"
    );
    // Heterogeneous TP in NHD.
    assert_eq!(
        v(
            "gqa8",
            "tp=1,block=16,layout=NHD",
            "tp=2,block=16,layout=NHD"
        )
        .label(),
        "rejected"
    );
    // MLA with more P ranks: redundant writes, noted.
    let mla = v(
        "mla",
        "tp=8,block=16,layout=HND",
        "tp=2,block=16,layout=HND",
    );
    assert_eq!(mla.label(), "push");
    assert!(mla.reason().contains("4 times"), "{}", mla.reason());
}

#[test]
fn the_plan_report_shows_targets_and_says_why_a_pair_cannot_work() {
    let r = plan_report(
        "gqa2",
        "tp=4,block=16,layout=HND",
        "tp=1,block=16,layout=NHD",
        100,
        0,
        true,
    )
    .unwrap();
    assert_eq!(r.verified, Some(true));
    let writers: Vec<usize> = r.prefill_ranks.iter().map(|p| p.targets.len()).collect();
    assert_eq!(writers, [1, 0, 1, 0]);
    assert_eq!(r.decode_ranks[0].writers, 2);
    let t = &r.prefill_ranks[2].targets[0];
    assert_eq!(t.heads.as_ref().unwrap().decode_local, 1..2);
    let bytes = t.head_bytes.as_ref().unwrap();
    assert_eq!(
        (bytes.decode.offset, bytes.decode.count),
        (16, 16),
        "head 1 of each NHD token"
    );
    assert!(t.descriptors > 0 && t.bytes > 0);
    let e = plan_report(
        "gqa8",
        "tp=3,block=16,layout=HND",
        "tp=1,block=16,layout=HND",
        100,
        0,
        false,
    )
    .unwrap_err();
    assert!(matches!(
        e,
        PlanReportError::Hetero(HeteroError::Geometry { .. })
    ));
    let e = plan_report(
        "llama",
        "tp=1,block=16,layout=HND",
        "tp=1,block=16,layout=HND",
        100,
        0,
        false,
    )
    .unwrap_err();
    assert!(e.to_string().starts_with("unknown model \"llama\""));
    let e = plan_report(
        "gqa8",
        "tp=1,block=16",
        "tp=1,block=16,layout=HND",
        100,
        0,
        false,
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "P spec: field layout is missing (tp, block and layout are required)"
    );
    let e = plan_report(
        "gqa8",
        "tp=1,block=16,layout=HND",
        "tp=1,block=32,layout=HND",
        100,
        16,
        false,
    )
    .unwrap_err();
    assert!(matches!(
        e,
        PlanReportError::Handoff(HandoffError::Shape(_))
    ));
}
