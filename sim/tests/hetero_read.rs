//! Multi-rank pulls in seeded worlds (issue 23): heterogeneous reads, each D rank reading from
//! every P rank that holds its heads, P ranks exporting to every D rank that reads them, and
//! replicas that no D rank reads. The sweeps must be clean and reach the marks of the read
//! path's fan-ins (after their preconditions), and the fan-ins' deliberate bugs must be caught
//! through pulls alone.

use kvhandoff_sim::{
    run_seeds, run_world, seed_world, Faults, Mode, Mutation, SimOptions, SimReport,
    HETERO_READ_MARKS,
};

fn chaos(seeds: std::ops::Range<u64>, mode: Mode) -> SimOptions {
    SimOptions {
        requests: 10..=80,
        pool_blocks: 8..=64,
        mode,
        ..SimOptions::new(seeds, 40, Faults::Chaos)
    }
}

/// `kvhandoff sim`'s defaults (the swarm, the default stalls, layer-wise push).
fn cli(seeds: std::ops::Range<u64>, requests: usize, mode: Mode) -> SimOptions {
    SimOptions {
        mode,
        layerwise: 0.3,
        stalls: kvhandoff_sim::DEFAULT_STALLS,
        stall_freeze: kvhandoff_sim::DEFAULT_STALL_FREEZE,
        stall_messages_first: kvhandoff_sim::DEFAULT_STALL_MESSAGES_FIRST,
        swarm: true,
        ..SimOptions::new(seeds, requests, Faults::Chaos)
    }
}

fn count(outcomes: &std::collections::BTreeMap<String, u64>, prefix: &str) -> u64 {
    outcomes
        .iter()
        .filter(|(k, _)| k.starts_with(prefix))
        .map(|(_, v)| v)
        .sum()
}

/// The preconditions of each mark, then the marks: parts of multi-rank reads loaded (D ranks
/// reading from several P ranks), parts aborted after a sibling failed, replicas' exports.
fn assert_hetero_marks(report: &SimReport) {
    assert!(
        count(&report.outcomes, "sub.import.Loaded") > 0,
        "precondition: parts of multi-rank reads loaded: {:?}",
        report.outcomes
    );
    assert!(
        count(&report.outcomes, "sub.import.Failed(Aborted)") > 0
            && count(&report.outcomes, "sub.import.Failed(")
                > count(&report.outcomes, "sub.import.Failed(Aborted)"),
        "precondition: parts failed, and parts aborted: {:?}",
        report.outcomes
    );
    assert!(
        count(&report.outcomes, "multi.export.Released(FullPrefixHit)") > 0,
        "precondition: P ranks no D rank read from: {:?}",
        report.outcomes
    );
    for mark in HETERO_READ_MARKS {
        assert!(
            report.coverage.get(*mark).is_some_and(|&n| n > 0),
            "coverage mark {mark} never hit: {:?}",
            report.coverage
        );
    }
}

/// Mixed and pull worlds (a tenth of their requests multi-rank, half of mixed's pulled): clean,
/// nothing leaked, every heterogeneous read mark hit.
#[test]
fn mixed_and_pull_sweeps_with_multi_rank_pulls_are_clean_and_hit_their_marks() {
    for (mode, seeds) in [(Mode::Mixed, 5_000..5_150), (Mode::Pull, 6_000..6_100)] {
        let opts = chaos(seeds, mode);
        assert!(opts.required_marks().contains(&"hetero_read"), "{mode:?}");
        let report = run_seeds(&opts);
        assert!(report.violations.is_empty(), "{}", report.first_violation());
        assert_eq!(report.leaked_blocks, 0, "{:?}", report.leaks);
        assert_eq!(report.stale_writes, 0);
        assert_hetero_marks(&report);
        assert!(
            report
                .outcomes
                .get("multi.pull.retried")
                .is_some_and(|&n| n > 0),
            "the router retried some failed multi-rank reads: {:?}",
            report.outcomes
        );
    }
}

/// Found by `kvhandoff sim --mode mixed --seeds 1..101 --requests 40` (issue 23): a multi-rank
/// read on D rank 0 started under policy `Recompute`; before its last part ended, a single-rank
/// read on the same rank started under `Fail` (the engine's policy is drawn per request), and
/// the session folded the read's failure by the settings of that moment: the engine heard
/// `Failed(PeerDead)` for a request that recomputes. The session's fan-in now keeps the policy
/// the read started under, as a single import does
/// (`session::fan_reads::tests::a_multi_rank_read_fails_by_the_policy_it_started_under`).
#[test]
fn seed_4_a_multi_rank_read_fails_by_the_policy_it_started_under() {
    let options = cli(4..5, 40, Mode::Mixed);
    let r = run_world(seed_world(&options, 4), 4);
    // Before the fix: S10, the engine heard `Failed(PeerDead)` under `Recompute` (the run
    // stops there).
    assert!(
        r.violations.is_empty(),
        "{:?}",
        r.violations.first().map(|v| &v.message)
    );
    assert_eq!(r.leaked_blocks, 0);
    // The story was told: multi-rank reads failed under both policies on the world's ranks.
    assert!(
        count(&r.outcomes, "multi.import.Recompute") > 0
            && count(&r.outcomes, "multi.import.Failed") > 0,
        "{:?}",
        r.outcomes
    );
}

/// `reader_ready_on_first_part` (a reader's fan-in decides `Loaded` at its first loaded part) is
/// caught by the request's judgement (S10: the engine heard `Loaded`, a part did not load) and
/// by D's bytes (S7/S8: a slice that never arrived).
#[test]
fn a_reader_loaded_at_its_first_part_is_caught() {
    let opts = SimOptions {
        mutation: Some(Mutation::ReaderReadyOnFirstPart),
        ..chaos(0..100, Mode::Pull)
    };
    let report = run_seeds(&opts);
    let messages = report.violation_messages();
    assert!(
        messages
            .iter()
            .any(|m| m.starts_with("S10: pulled request")),
        "{messages:?}"
    );
    assert!(
        messages
            .iter()
            .any(|m| m.starts_with("S7:") || m.starts_with("S8:")),
        "{messages:?}"
    );
}

/// `free_on_first_source_settled` is caught through pulls alone (no pushed multi-rank request
/// in a pull world): the shared blocks go back before a sibling part ended (S10), and a holder
/// or reader frees blocks a sibling's read still references (S2).
#[test]
fn the_fan_in_mutation_is_caught_through_pulls() {
    let opts = SimOptions {
        mutation: Some(Mutation::FreeOnFirstSourceSettled),
        ..chaos(0..100, Mode::Pull)
    };
    let report = run_seeds(&opts);
    let messages = report.violation_messages();
    assert!(
        messages.iter().any(|m| m.starts_with("S10:")),
        "{messages:?}"
    );
    assert!(
        messages.iter().any(|m| m.contains("S2:")),
        "blocks freed while a read referenced them: {messages:?}"
    );
}

/// Found by `kvhandoff sim --mode mixed --seeds 1..20001 --requests 50` (issue 23): a
/// multi-rank pull on D rank 0 failed (P rank 3's handshake), and D's process stopped for ~21 s
/// holding the router's retry (the very parameters, epoch 1) and P rank 0's late grant of the
/// failed try's ask 0. By the resume the reader's record of that try had expired, so the retry's
/// import ran at epoch 1 again, sent its ask 0, and took the held grant for its answer: it read
/// blocks P had freed 21 s before (S2). An import now numbers its asks from its trace id
/// (`ImportCommon::first_ask`), so the earlier try's grant names no ask of the retry and is
/// refused as stale (`import::tests`, "grant naming ask 0, the number an earlier attempt...").
#[test]
fn seed_6974_a_grant_of_an_earlier_try_is_never_read_under() {
    let options = cli(6974..6975, 50, Mode::Mixed);
    // The world as found, before the swarm drew late registrations, completions and grants,
    // stalls between layer-wise parts or with a registration pending, late registration
    // copies outside the small tables, and answers ahead of exports.
    let mut world = seed_world(&options, 6974);
    world.early_answers = 0.0;
    world.late_completions = false;
    world.late_register = 0.0;
    world.late_register_copies = 0.0;
    world.late_grant = 0.0;
    world.stall_mid_layers = 0.0;
    world.stall_pending_registration = 0.0;
    let r = run_world(world, 6974);
    // The precondition, reached before the read: the router retried, and held messages were
    // handled after a stall.
    assert!(
        r.outcomes.get("multi.pull.retried").is_some_and(|&n| n > 0),
        "{:?}",
        r.outcomes
    );
    assert!(
        r.coverage["stale_message_after_stall"] > 0,
        "{:?}",
        r.coverage
    );
    // Before the fix: S2, the retry read blocks P had freed (the run stops there).
    assert!(
        r.violations.is_empty(),
        "{:?}",
        r.violations.first().map(|v| &v.message)
    );
    // The retry's part refused the earlier try's grant as stale.
    assert!(
        r.outcomes
            .get("sub.import.Failed(StaleGrant)")
            .is_some_and(|&n| n > 0),
        "{:?}",
        r.outcomes
    );
    assert_eq!(r.leaked_blocks, 0);
}
