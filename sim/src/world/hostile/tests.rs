//! Each hostile peer is caught exactly when the defence against it is gone.

use kvhandoff_protocol::machine::Mutation;

use crate::{
    run_world, Faults, SeedResult, WorldConfig, MULTI_SOURCE_PREFILL_RANKS, SMALL_TOMBSTONE_TABLE,
};

/// Seeds per check: the worlds are small and the detections frequent.
const SEEDS: std::ops::Range<u64> = 7000..7008;

fn flooded(seed: u64, mutation: Option<Mutation>) -> SeedResult {
    let mut cfg = WorldConfig::seeded(40, Faults::Chaos, mutation);
    // A flood of tens per heartbeat reaches one peer's share only of a small table.
    cfg.machine.max_tombstones = SMALL_TOMBSTONE_TABLE;
    cfg.flood_peer = true;
    run_world(cfg, seed)
}

fn misnamed(seed: u64, mutation: Option<Mutation>) -> SeedResult {
    let mut cfg = WorldConfig::seeded(40, Faults::Chaos, mutation);
    cfg.prefill_ranks = MULTI_SOURCE_PREFILL_RANKS;
    cfg.multi_source = 0.3;
    cfg.misname_rank = 0.2;
    run_world(cfg, seed)
}

/// Seeds whose first violation starts with `check`; panics on any other violation.
fn caught(results: &[SeedResult], check: &str) -> usize {
    results
        .iter()
        .filter(|r| !r.violations.is_empty())
        .inspect(|r| {
            assert!(
                r.violations.iter().any(|v| v.message.starts_with(check)),
                "seed {}: {:?}",
                r.seed,
                r.violations[0].message
            );
        })
        .count()
}

#[test]
fn a_flood_of_made_up_keys_is_held_to_one_peers_share() {
    let honest: Vec<SeedResult> = SEEDS.map(|s| flooded(s, None)).collect();
    assert_eq!(caught(&honest, "B1"), 0, "the budget holds the flood");
    let refused: u64 = honest
        .iter()
        .map(|r| r.coverage["peer_flood_refused"])
        .sum();
    assert!(refused > 0, "the budget refused part of the flood");
    let unbounded = Some(Mutation::UnboundedPeerTombstones);
    let mutated: Vec<SeedResult> = SEEDS.map(|s| flooded(s, unbounded)).collect();
    assert!(caught(&mutated, "B1") >= SEEDS.count() / 2);
}

#[test]
fn an_answer_counts_only_for_the_rank_that_sent_it() {
    let honest: Vec<SeedResult> = SEEDS.map(|s| misnamed(s, None)).collect();
    assert_eq!(caught(&honest, "R1"), 0, "D refuses misnamed answers");
    let refused: u64 = honest
        .iter()
        .map(|r| r.coverage["misnamed_rank_refused"])
        .sum();
    assert!(refused > 0, "some misnamed answer reached a live request");
    let trusting = Some(Mutation::TrustNamedRank);
    let mutated: Vec<SeedResult> = SEEDS.map(|s| misnamed(s, trusting)).collect();
    let flagged = mutated.iter().filter(|r| !r.violations.is_empty()).count();
    assert!(flagged >= SEEDS.count() / 2);
}
