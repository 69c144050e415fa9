//! Seeded swarm simulation (tier T3): chaos sweeps must find no violation and no leak, must
//! reach every coverage mark, must be deterministic, and must catch the deliberate bug.

use kvhandoff_sim::{run_seed, run_seeds, Faults, SimOptions};

fn opts(seeds: std::ops::Range<u64>, requests: usize, faults: Faults) -> SimOptions {
    SimOptions {
        seeds,
        requests,
        faults,
        long: false,
        mutation: false,
    }
}

#[test]
fn chaos_500_seeds_50_requests() {
    let report = run_seeds(&opts(0..500, 50, Faults::Chaos));
    assert!(
        report.violations.is_empty(),
        "{:#?}",
        &report.violations[..1]
    );
    assert_eq!(report.leaked_blocks, 0);
    assert_eq!(report.stale_writes, 0);
    for mark in kvhandoff_sim::COVERAGE_MARKS {
        assert!(
            report.coverage[*mark] > 0,
            "coverage mark {mark} never hit: {:?}",
            report.coverage
        );
    }
    assert!(
        report.outcomes["decode.Ready"] > 10_000,
        "{:?}",
        report.outcomes
    );
}

#[test]
fn no_faults_and_network_faults_are_clean() {
    for faults in [Faults::None, Faults::Network] {
        let report = run_seeds(&opts(0..100, 50, faults));
        assert!(
            report.violations.is_empty(),
            "{faults:?}: {:#?}",
            &report.violations[..1]
        );
        assert_eq!(report.leaked_blocks, 0);
        assert!(report.coverage["decode_registered_first"] > 0);
        assert!(report.coverage["prefill_finished_first"] > 0);
    }
    // Without faults every request is ready.
    let report = run_seeds(&opts(0..20, 50, Faults::None));
    let failed: u64 = report
        .outcomes
        .iter()
        .filter(|(k, _)| k.starts_with("decode.Failed"))
        .map(|(_, v)| v)
        .sum();
    assert_eq!(failed, 0, "{:?}", report.outcomes);
}

#[test]
fn same_seed_same_trace_whatever_the_threads() {
    let a = run_seeds(&opts(10..30, 30, Faults::Chaos));
    let b = run_seeds(&opts(10..30, 30, Faults::Chaos));
    assert_eq!(a, b);
    let one = run_seed(17, 30, Faults::Chaos, false, false);
    let again = run_seed(17, 30, Faults::Chaos, false, false);
    assert_eq!(one.trace_hash, again.trace_hash);
    assert_eq!(one.steps, again.steps);
    let other = run_seed(18, 30, Faults::Chaos, false, false);
    assert_ne!(one.trace_hash, other.trace_hash);
    let json = serde_json::to_value(&a).unwrap();
    let mut keys: Vec<&str> = json
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        [
            "coverage",
            "leaked_blocks",
            "outcomes",
            "requests",
            "seeds",
            "stale_writes",
            "trace_hash",
            "violations"
        ]
    );
}

#[test]
fn the_simulator_catches_free_on_deadline() {
    let mut o = opts(0..200, 50, Faults::Chaos);
    o.mutation = true;
    let report = run_seeds(&o);
    assert!(
        report
            .violations
            .iter()
            .any(|v| v.message.contains("S1") || v.message.contains("S2")),
        "the mutation went unnoticed: {:?}",
        report.coverage
    );
}
