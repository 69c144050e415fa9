//! A multi-rank request's next turn read back across the heterogeneous pair (issue 23, item
//! 4): D's ranks keep their blocks with turn links (`keep_for_next_turn`, each D rank the
//! holder for the P ranks it served), the router hands the answer of the request's first D
//! rank to every P rank, and each P rank reads its slices back from every D rank that holds
//! them (`next_turn_allocated` with turn links). The sweeps must reach the read backs (their
//! preconditions first), be clean, and catch a reader that ignores all but its first D rank.

use kvhandoff_sim::{run_seeds, seed_world, Faults, Mode, Mutation, SimOptions, HETERO_TURN_MARKS};

fn chaos(seeds: std::ops::Range<u64>, mode: Mode) -> SimOptions {
    SimOptions {
        requests: 10..=80,
        pool_blocks: 8..=64,
        mode,
        multi_rank_turns: true,
        ..SimOptions::new(seeds, 40, Faults::Chaos)
    }
}

/// Bidir and mixed worlds with multi-rank requests that keep their second turn: D ranks kept
/// their blocks and P ranks read parts of them back (the precondition), every read back that
/// loaded from two or more D ranks and every one that failed a part was judged (the marks),
/// and the runs are clean with nothing leaked.
#[test]
fn multi_rank_turns_are_read_back_across_the_pair_cleanly() {
    for (mode, seeds) in [(Mode::Bidir, 8_000..8_150), (Mode::Mixed, 9_000..9_150)] {
        let opts = chaos(seeds, mode);
        for mark in HETERO_TURN_MARKS {
            assert!(opts.required_marks().contains(mark), "{mode:?} {mark}");
        }
        let report = run_seeds(&opts);
        assert!(
            report.outcomes_starting("multi.turn2.part.export.Read") > 0
                && report.outcomes_starting("multi.turn2.part.import.Loaded") > 0,
            "precondition: parts of kept turns were read back: {:?}",
            report.outcomes
        );
        assert!(
            report.outcomes_starting("multi.turn2.import.Loaded") > 0
                && report.outcomes_starting("multi.turn2.import.Failed") > 0
                && report.outcomes_starting("multi.turn2.import.Recompute") > 0,
            "precondition: read backs loaded, and failed under both policies: {:?}",
            report.outcomes
        );
        for mark in HETERO_TURN_MARKS {
            assert!(
                report.coverage.get(*mark).is_some_and(|&n| n > 0),
                "{mode:?}: mark {mark} never hit: {:?}",
                report.coverage
            );
        }
        assert!(report.violations.is_empty(), "{}", report.first_violation());
        assert_eq!(report.leaked_blocks, 0, "{:?}", report.leaks);
        assert_eq!(report.stale_writes, 0);
    }
}

/// `read_back_from_first_rank` (P's next turn reads back only from the first D rank its turn
/// links name, as if the pair were 1:1) is caught by the read back's judgement (S10: the rank
/// handed its blocks back while a part the checker expected never ended) and by P's bytes
/// (S7/S8: the other D ranks' slices never arrived, though the read ended `Loaded`).
#[test]
fn a_read_back_from_its_first_rank_only_is_caught() {
    let opts = SimOptions {
        mutation: Some(Mutation::ReadBackFromFirstRank),
        ..chaos(0..100, Mode::Bidir)
    };
    let report = run_seeds(&opts);
    let messages = report.violation_messages();
    assert!(
        messages
            .iter()
            .any(|m| m.starts_with("S10:") && m.contains("read back")),
        "{messages:?}"
    );
    assert!(
        messages
            .iter()
            .any(|m| m.starts_with("S7: read back") || m.starts_with("S8: read back")),
        "{messages:?}"
    );
}

/// Without the option (the constructors' default, so every regression seed replays as found),
/// a multi-rank request has no second turn and the world keeps its nodes: D's rank 1 is a node
/// of its own only where turns are read back across ranks.
#[test]
fn worlds_without_multi_rank_turns_keep_their_shape() {
    let off = SimOptions {
        mode: Mode::Bidir,
        ..SimOptions::new(0..30, 30, Faults::Chaos)
    };
    assert!(!off.required_marks().contains(&"hetero_turn2_read_back"));
    assert!(!seed_world(&off, 0).reads_turns_back_across_ranks());
    let report = run_seeds(&off);
    assert_eq!(
        report.outcomes_starting("multi.turn2."),
        0,
        "{:?}",
        report.outcomes
    );
    assert!(report.clean(), "{}", report.first_violation());
    let on = SimOptions {
        multi_rank_turns: true,
        ..off
    };
    assert!(seed_world(&on, 0).reads_turns_back_across_ranks());
    // Pull and push worlds have no second turns: nothing changes there.
    for mode in [Mode::Pull, Mode::Push] {
        let opts = SimOptions { mode, ..on.clone() };
        assert!(
            !seed_world(&opts, 0).reads_turns_back_across_ranks(),
            "{mode:?}"
        );
    }
}
