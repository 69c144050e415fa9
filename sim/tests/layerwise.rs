//! Layer-wise push in seeded worlds (issue 22): P's engine reports layers as it produces them,
//! each part is written once D registered, and D is ready when its parts cover every layer.
//! Chaos sweeps with stalls must stay clean and reach the layer-wise marks (a partial layer set
//! cancelled among them), and each deliberate bug of the layer-wise rules must be caught.

use kvhandoff_sim::{run_seeds, Faults, Mode, Mutation, SimOptions, LAYERWISE_MARKS};

fn chaos(seeds: std::ops::Range<u64>, layerwise: f64) -> SimOptions {
    // As `kvhandoff sim --mode push --layerwise S --requests 40` runs it.
    SimOptions {
        requests: 40..=40,
        mode: Mode::Push,
        layerwise,
        stalls: kvhandoff_sim::DEFAULT_STALLS,
        stall_messages_first: kvhandoff_sim::DEFAULT_STALL_MESSAGES_FIRST,
        swarm: true,
        ..SimOptions::new(seeds, 40, Faults::Chaos)
    }
}

#[test]
fn layer_wise_sweep_is_clean_and_hits_its_marks() {
    let report = run_seeds(&chaos(9_000..9_150, 1.0));
    assert!(report.violations.is_empty(), "{}", report.first_violation());
    assert_eq!(report.leaked_blocks, 0, "{:?}", report.leaks);
    assert_eq!(report.stale_writes, 0);
    for mark in LAYERWISE_MARKS {
        assert!(
            report.coverage.get(*mark).is_some_and(|&n| n > 0),
            "coverage mark {mark} never hit: {:?}",
            report.coverage
        );
    }
}

/// Each rule of layer-wise push has a bug that the sweep catches.
#[test]
fn the_layer_wise_mutations_are_caught() {
    for mutation in [
        Mutation::ReadyOnFirstPart,
        Mutation::AckPartialWriteAtOnce,
        Mutation::ExtendLapsedRegistration,
    ] {
        let opts = SimOptions {
            mutation: Some(mutation),
            ..chaos(9_000..9_150, 1.0)
        };
        let report = run_seeds(&opts);
        assert!(
            !report.violations.is_empty(),
            "{mutation} was not caught in 150 seeds"
        );
    }
}
