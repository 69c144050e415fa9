//! Multi-rank requests in seeded worlds (issue 12): several P ranks per D rank, one P rank per
//! several D ranks, or both, each pair an ordinary sub-request under its pair's key. Chaos
//! sweeps must stay clean and reach every multi-rank mark, the fan-in's deliberate bug must be
//! caught, and worlds without multi-rank requests must replay as before.

use kvhandoff_sim::{
    run_seeds, seed_world, Faults, Mode, Mutation, SimOptions, SimReport, MULTI_SOURCE_MARKS,
    MULTI_SOURCE_PREFILL_RANKS,
};

fn chaos(seeds: std::ops::Range<u64>, mode: Mode, share: Option<f64>) -> SimOptions {
    SimOptions {
        requests: 10..=120,
        pool_blocks: 8..=64,
        mode,
        multi_source: share,
        ..SimOptions::new(seeds, 50, Faults::Chaos)
    }
}

fn assert_clean_with_multi_marks(report: &SimReport) {
    assert!(report.violations.is_empty(), "{}", report.first_violation());
    assert_eq!(report.leaked_blocks, 0, "{:?}", report.leaks);
    assert_eq!(report.stale_writes, 0);
    for mark in MULTI_SOURCE_MARKS {
        assert!(
            report.coverage.get(*mark).is_some_and(|&n| n > 0),
            "coverage mark {mark} never hit: {:?}",
            report.coverage
        );
    }
}

/// The command line's default mode has multi-rank requests (10 %).
#[test]
fn mixed_sweep_with_multi_rank_requests_is_clean_and_hits_their_marks() {
    let report = run_seeds(&chaos(3_000..3_250, Mode::Mixed, None));
    assert_clean_with_multi_marks(&report);
    assert!(
        report.outcomes["multi.decode.Ready"] > 100,
        "{:?}",
        report.outcomes
    );
}

/// Push with a fifth of the requests multi-rank, on small pools.
#[test]
fn push_sweep_with_multi_rank_requests_is_clean_and_hits_their_marks() {
    let opts = SimOptions {
        pool_blocks: 8..=16,
        ..chaos(4_000..4_200, Mode::Push, Some(0.2))
    };
    let report = run_seeds(&opts);
    assert_clean_with_multi_marks(&report);
}

/// `free_on_first_source_settled` (the fan-in hands the shared blocks back at the first failed
/// sub-request's own hand-back) is caught, and not only by the bookkeeping check (S10): blocks
/// freed under a write still in flight (S2) or written after they went back (S1).
#[test]
fn the_fan_in_mutation_is_caught() {
    let opts = SimOptions {
        mutation: Some(Mutation::FreeOnFirstSourceSettled),
        ..chaos(0..100, Mode::Mixed, None)
    };
    let report = run_seeds(&opts);
    assert!(
        !report.violations.is_empty(),
        "not caught by 100 mixed seeds"
    );
    let harm =
        |v: &&kvhandoff_sim::Violation| v.message.contains("S2:") || v.message.contains("S1:");
    assert!(
        report
            .violations
            .iter()
            .any(|v| v.message.starts_with("S10:")),
        "{}",
        report.first_violation()
    );
    assert!(
        report.violations.iter().any(|v| harm(&v)),
        "the early hand-back never met a write in flight: {:?}",
        report
            .violations
            .iter()
            .map(|v| &v.message)
            .collect::<Vec<_>>()
    );
}

/// Seed 8 (push, 30 requests, a fifth multi-rank). Clean, it reaches a partial failure (a pair
/// ready, a sibling failed) and stays clean. With the deliberate bug, a D rank fed by four P
/// ranks hands its blocks back at its first failed pair, while two writes of the others are
/// still in flight (S10, then S2 at the free).
#[test]
fn seed_8_a_failed_pair_frees_the_shared_blocks_only_after_its_siblings() {
    let opts = |mutation| SimOptions {
        multi_source: Some(0.2),
        mutation,
        ..SimOptions::new(8..9, 30, Faults::Chaos)
    };
    let clean = run_seeds(&opts(None));
    let count = |prefix: &str| -> u64 {
        clean
            .outcomes
            .iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .map(|(_, v)| v)
            .sum()
    };
    assert!(
        count("sub.decode.Ready") > 0 && count("sub.decode.Failed") > 0,
        "precondition: some sub-request ready and another failed: {:?}",
        clean.outcomes
    );
    assert!(
        clean.coverage["multi_source_partial_failure"] > 0,
        "precondition: a partial failure: {:?}",
        clean.coverage
    );
    assert!(clean.clean(), "{}", clean.first_violation());

    let mutated = run_seeds(&opts(Some(Mutation::FreeOnFirstSourceSettled)));
    let messages: Vec<&str> = mutated
        .violations
        .iter()
        .map(|v| v.message.as_str())
        .collect();
    assert!(
        messages.iter().any(|m| m.starts_with("S10:")),
        "{messages:?}"
    );
    assert!(
        messages.iter().any(|m| m.contains("S2:")),
        "blocks freed while a write referenced them: {messages:?}"
    );
}

/// Worlds without multi-rank requests keep their nodes and replay exactly as before the
/// feature: the trace hashes below were taken before it (push, and mixed as it was), and
/// re-pinned where a protocol change moved them (issue 19: P leaves a restarted or rejoined D's
/// registrations unanswered through its window; the sweeps' mixed mode also draws siblings that
/// decline a read, the stale-message guards change what a late input does, and a D rank dials
/// a dead P whose death fenced requests, to ask it again; then the tombstones' minimum life
/// counts a peer timeout, and a read's ask and grant carry the ask's number; then a read's ask
/// carries its trace id, which the trace prints: with the trace id cut from that line, the
/// mixed hash was the one before, so nothing but the text changed; then a grant printed the
/// holder's memory (protocol v8) and, issue 23, a reader numbers its asks from its trace id,
/// which the trace prints: with the ask numbers cut, the traces before and after issue 23's
/// change are the same line for line; then half the chaos pushing worlds outside the small
/// tables draw late registration copies, D skips a resend a stall carried past its grace, and
/// P writes again a record that refuses a registration; then a reader asks again after an
/// `Unavailable` soon after its first ask, which moves the mixed hash only).
#[test]
fn worlds_without_multi_rank_requests_replay_as_before() {
    let push = SimOptions::new(0..40, 30, Faults::Chaos);
    assert_eq!(push.multi_source_share(), 0.0);
    assert_eq!(seed_world(&push, 3).prefill_ranks, 1);
    assert_eq!(
        run_seeds(&push).trace_hash,
        "9f8fba651cb0f55a5c8380082d0bc8488a4f24a859d401b9ee773689fa569462"
    );
    let mixed = SimOptions {
        mode: Mode::Mixed,
        multi_source: Some(0.0),
        ..SimOptions::new(0..40, 30, Faults::Chaos)
    };
    assert_eq!(
        run_seeds(&mixed).trace_hash,
        "dd949d37101ecb759491c279849ddc4e7b8916b2480d1bc1d7fcab6f5c14882a"
    );
    let default_mixed = SimOptions {
        mode: Mode::Mixed,
        ..SimOptions::new(0..1, 30, Faults::Chaos)
    };
    assert_eq!(
        seed_world(&default_mixed, 0).prefill_ranks,
        MULTI_SOURCE_PREFILL_RANKS
    );
}
