//! Seeded swarm simulation (tier T3): chaos sweeps at loads drawn per seed must find no
//! violation and no leak, must reach every coverage mark, must be deterministic, and must catch
//! every deliberate bug.

use kvhandoff_sim::{run_seed, run_seeds, seed_load, Faults, Mutation, SimOptions};

/// CI's chaos tier: request counts and pool sizes drawn per seed, from light to heavy load and
/// from contended pools (blocks reused soon after they are freed) to roomy ones.
fn ci_chaos(seeds: std::ops::Range<u64>) -> SimOptions {
    SimOptions {
        requests: 10..=160,
        pool_blocks: 8..=64,
        ..SimOptions::new(seeds, 50, Faults::Chaos)
    }
}

#[test]
fn chaos_sweep_at_varied_load_is_clean_and_hits_every_mark() {
    let report = run_seeds(&ci_chaos(0..700));
    assert!(report.violations.is_empty(), "{}", report.first_violation());
    assert_eq!(report.leaked_blocks, 0, "{:?}", report.leaks);
    assert_eq!(report.stale_writes, 0);
    for mark in kvhandoff_sim::COVERAGE_MARKS {
        assert!(
            report.coverage[*mark] > 0,
            "coverage mark {mark} never hit: {:?}",
            report.coverage
        );
    }
    assert!(
        report.outcomes["decode.Ready"] > 20_000,
        "{:?}",
        report.outcomes
    );
    // The load really varied.
    let loads: Vec<(usize, u32)> = (0..700).map(|s| seed_load(&ci_chaos(0..1), s)).collect();
    assert!(loads.iter().any(|&(r, _)| r < 30) && loads.iter().any(|&(r, _)| r > 140));
    assert!(loads.iter().any(|&(_, p)| p < 12) && loads.iter().any(|&(_, p)| p > 56));
}

#[test]
fn no_faults_and_network_faults_are_clean() {
    for faults in [Faults::None, Faults::Network] {
        let report = run_seeds(&SimOptions::new(0..100, 50, faults));
        assert!(
            report.violations.is_empty(),
            "{faults:?}: {}",
            report.first_violation()
        );
        assert_eq!(report.leaked_blocks, 0);
        assert!(report.coverage["decode_registered_first"] > 0);
        assert!(report.coverage["prefill_finished_first"] > 0);
    }
    // Without faults every request is ready.
    let report = run_seeds(&SimOptions::new(0..20, 50, Faults::None));
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
    let a = run_seeds(&ci_chaos(10..30));
    let b = run_seeds(&ci_chaos(10..30));
    assert_eq!(a, b);
    let one = run_seed(17, 30, Faults::Chaos, false, None);
    let again = run_seed(17, 30, Faults::Chaos, false, None);
    assert_eq!(one.trace_hash, again.trace_hash);
    assert_eq!(one.steps, again.steps);
    let other = run_seed(18, 30, Faults::Chaos, false, None);
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
            "counters",
            "coverage",
            "leaked_blocks",
            "leaks",
            "mode",
            "mutation",
            "outcomes",
            "pool_blocks_range",
            "requests",
            "requests_range",
            "seeds",
            "stale_writes",
            "total_requests",
            "trace_hash",
            "violations"
        ]
    );
}

/// The deliberate bugs the sweeps catch, each with the smallest scope that catches it here.
/// Not listed: `ignore_heartbeat_sender` (a second D engine of a key must keep renewing the
/// first's registration past the first's quarantine: the swarm's orphaned registrations,
/// `stalls.rs::seed_1_…`, and the prefill table's unit test
/// `another_ranks_heartbeat_never_renews_a_pending_registration`),
/// `evict_young_tombstones` (needs the swarm's late registration copies into small tables:
/// `stalls.rs::seed_25_…` and `scripts/swarm-check.sh`),
/// `match_expired_registration` (needs a late timer: `exhaustive.rs`) and
/// `free_on_first_source_settled` (needs multi-rank requests: `multi_source.rs`); the read
/// path's four need reads (`modes.rs`: `release_before_reads_end`, `short_grant_fence`,
/// `long_grant_fence`, `lose_last_read_post`).
const CAUGHT: &[(&str, u64, bool)] = &[
    // (mutation, seeds, varied load): 40 requests per seed unless the load varies.
    ("free_on_deadline", 300, false),
    ("free_on_peer_dead", 300, false),
    ("free_source_on_abandon", 300, false),
    ("handshake_always_restart", 300, false),
    ("skip_epoch_floor", 300, true),
    // A stale `WriteDone` reaching a newer epoch needs a retry and a late copy: rarer.
    ("accept_stale_write_done", 700, true),
];

#[test]
fn the_sweeps_catch_the_deliberate_bugs() {
    for &(name, seeds, varied) in CAUGHT {
        let mutation: Mutation = name.parse().unwrap();
        let mut options = if varied {
            ci_chaos(0..seeds)
        } else {
            SimOptions::new(0..seeds, 40, Faults::Chaos)
        };
        options.mutation = Some(mutation);
        let report = run_seeds(&options);
        assert!(
            !report.clean(),
            "mutation {mutation} went unnoticed: {:?} {:?}",
            report.coverage,
            report.counters
        );
        eprintln!(
            "mutation {mutation}: {} violations, first: {}",
            report.violations.len(),
            report
                .violations
                .first()
                .map(|v| v.message.as_str())
                .unwrap_or("(a leak or stale write)")
        );
    }
}
