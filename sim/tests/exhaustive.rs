//! Exhaustive small-scope check (tier T1): every ordering of 1 P, 1 D and 1–2 requests, with
//! drops, duplicates, reorders, timers at any point and at most one crash, up to a depth bound,
//! checked against the same invariants as the simulator after every step.

use kvhandoff_sim::{exhaustive, run_exhaustive, Mutation, World, WorldConfig, EXHAUSTIVE_SCOPES};

/// The CI scopes of `kvhandoff sim --exhaustive` (one request with a crash to depth 11, two
/// requests to depth 9): every state within the depth bound visited, no violation.
#[test]
fn the_ci_scopes_complete_without_a_violation() {
    let report = run_exhaustive(None);
    for scope in &report.scopes {
        eprintln!(
            "exhaustive {} request(s), {} crash(es), depth {}: {} states, {} cut at depth, \
             complete: {}",
            scope.requests,
            scope.crashes,
            scope.depth,
            scope.states,
            scope.depth_cut,
            scope.complete
        );
    }
    assert!(report.violations.is_empty(), "{:#?}", report.violations);
    assert_eq!(report.scopes.len(), EXHAUSTIVE_SCOPES.len());
    assert!(report.complete, "a scope stopped at its cap");
    assert!(report.states > 100_000, "{}", report.states);
}

#[test]
fn exhaustive_catches_free_on_deadline() {
    let result = exhaustive(
        &WorldConfig::small(1, 0, Some(Mutation::FreeOnDeadline)),
        10,
        200_000,
    );
    let (v, path) = result
        .violation
        .expect("the exhaustive check must find the mutation");
    eprintln!(
        "mutation found after {} states: {} via {path:?}",
        result.states, v.message
    );
    assert!(
        v.message.contains("S1") || v.message.contains("S2") || v.message.starts_with("proof:"),
        "{}",
        v.message
    );
}

/// A late shell: P's prefill finishes after the wait of D's registration ended but before P's
/// timer ran, while D has freed its blocks at the quarantine. With the mutation
/// `match_expired_registration` (P expires registrations only on its timer) P matches it and
/// writes into the freed blocks (S1); found at depth 13 of one request. The same path without
/// the mutation is clean.
#[test]
fn exhaustive_catches_match_expired_registration() {
    let cfg = WorldConfig::small(1, 0, Some(Mutation::MatchExpiredRegistration));
    let result = exhaustive(&cfg, 13, 200_000);
    let (v, path) = result
        .violation
        .expect("the exhaustive check must find the mutation");
    assert!(v.message.starts_with("S1"), "{}", v.message);
    let mut world = World::new(WorldConfig::small(1, 0, None), 0);
    for &a in &path {
        world.apply(a);
    }
    assert!(world.violations().is_empty(), "{:#?}", world.violations());
}
