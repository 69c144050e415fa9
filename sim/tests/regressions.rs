//! Bugs the simulator found, each a named test with its seed or path.

use kvhandoff_sim::{exhaustive, run_world, Action, Faults, WorldConfig};

/// Found by the exhaustive check: P accepted a second copy of a registration whose pending wait
/// had expired (P had answered `RegistrationExpired`) once the prefill for the key finished, and
/// wrote into blocks D had already freed. Fixed by P remembering every answer it gives without
/// binding blocks (`PrefillTombstone::Answered`), an epoch floor that copies cannot pass.
#[test]
fn duplicated_register_after_answer_writes_freed_blocks() {
    // Path found by the exhaustive check with duplication of D→P messages on.
    let mut cfg = WorldConfig::small(2, 0, None);
    cfg.dup_control = true;
    let path = [
        Action::Run(0),
        Action::Run(1),
        Action::Run(2),
        Action::Run(4),
        Action::Dup(6),
        Action::Timer(0),
        Action::Run(3),
        Action::Run(7),
        Action::Run(8),
    ];
    let mut world = kvhandoff_sim::World::new(cfg.clone(), 0);
    for a in path {
        world.apply(a);
    }
    assert!(world.violations().is_empty(), "{:#?}", world.violations());
    let result = exhaustive(&cfg, 9, 25_000);
    assert!(result.violation.is_none(), "{:?}", result.violation);
    let mut seeded = WorldConfig::seeded(50, Faults::Chaos, None);
    seeded.dup_control = true;
    for seed in 0..300 {
        let r = run_world(seeded.clone(), seed);
        assert!(r.violations.is_empty(), "seed {seed}: {:#?}", r.violations);
    }
}

/// Found by `kvhandoff sim --seeds 1..10000`: P aborted a held request (its tombstone had no
/// epoch), D's cancel of epoch 1 arrived and was acknowledged without raising P's floor, a new
/// prefill for the key finished, and D's overtaken `Register(e1)` was written into blocks D had
/// freed. Fixed by every cancel raising the key's floor (`Writer::raise_floor`).
#[test]
fn seed_7403_cancel_after_abort_raises_the_floor() {
    let result = run_world(WorldConfig::seeded(50, Faults::Chaos, None), 7403);
    assert!(result.violations.is_empty(), "{:#?}", result.violations);
    assert_eq!(result.stale_writes, 0);
    assert_eq!(result.leaked_blocks, 0);
}

/// The sweep in which it was found, around the seed: clean.
#[test]
fn seeds_7390_to_7420_are_clean() {
    for seed in 7390..7420 {
        let r = run_world(WorldConfig::seeded(50, Faults::Chaos, None), seed);
        assert!(r.violations.is_empty(), "seed {seed}: {:#?}", r.violations);
    }
}
