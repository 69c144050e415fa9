//! Deterministic simulation of kvhandoff engines.
//!
//! A [`World`] holds engine ranks (one P, one or more D) whose protocol state is the real
//! [`kvhandoff_actors::machine::Endpoint`], a virtual clock, a simulated NIXL with real bytes,
//! a simulated notification network with faults, crash and restart of engine processes, LIFO
//! block allocators, and a ghost ledger that checks the safety properties after every step.
//! Every choice comes from one ChaCha8 stream seeded by the run's seed, so a seed replays
//! exactly ([`run_seed`]); the same world is also driven choice by choice by the ordering fuzz
//! and the exhaustive check ([`World::apply`], [`exhaustive`]).
//!
//! See `docs/testing.md` for the invariants, the coverage marks and how to replay a seed.
#![forbid(unsafe_code)]

mod engine;
mod explore;
mod ledger;
mod nixl;
mod world;

use std::collections::BTreeMap;
use std::ops::Range;

use serde::Serialize;
use sha2::{Digest, Sha256};

pub use explore::{exhaustive, Action, Exhaustive, Kind};
pub use ledger::{pattern, BLOCK_BYTES};
pub use world::{NodeId, Violation, World, WorldConfig};

/// Which faults a run injects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Faults {
    /// Only random timings (both races still happen).
    None,
    /// Faults NIXL's notification path and the side channel really have: delays, reordering
    /// (by differing delays) and partitions that heal. No loss or duplication: NIXL loses
    /// notifications only when a peer dies.
    Network,
    /// Everything: also message loss and duplication, failed, late-failing, partial, hanging
    /// and slow writes, abandons the transport does not confirm, failed handshakes, engine
    /// aborts, retries with a new epoch, and crashes with restart.
    Chaos,
}

impl std::str::FromStr for Faults {
    type Err = String;
    fn from_str(s: &str) -> Result<Faults, String> {
        match s {
            "none" => Ok(Faults::None),
            "network" => Ok(Faults::Network),
            "chaos" => Ok(Faults::Chaos),
            other => Err(format!(
                "unknown fault set {other:?} (none, network, chaos)"
            )),
        }
    }
}

/// The coverage marks every sweep reports (each counts how often a run reached the situation).
pub const COVERAGE_MARKS: &[&str] = &[
    "decode_registered_first",
    "prefill_finished_first",
    "deadline_during_write",
    "cancel_overtook_registration",
    "peer_died_with_write_outstanding",
    "duplicate_notification",
    "completion_after_lease",
    "stale_epoch_message",
    "partial_landing",
    "abandon_unconfirmed",
    "crash_restart",
    "quarantine_free",
    "message_lost_with_connection",
];

/// What to run.
#[derive(Debug, Clone)]
pub struct SimOptions {
    /// Seeds to run, one world each.
    pub seeds: Range<u64>,
    /// Requests per world.
    pub requests: usize,
    /// Faults to inject.
    pub faults: Faults,
    /// Four times the requests over four times the virtual time.
    pub long: bool,
    /// Turn on the deliberate bug `mutation_free_on_deadline` (the simulator must catch it).
    pub mutation: bool,
}

/// The result of a sweep. Identical for identical options, whatever the thread count.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct SimReport {
    /// Seeds run.
    pub seeds: u64,
    /// Requests per seed.
    pub requests: usize,
    /// Terminal outcomes by kind (`decode.Ready`, `prefill.Sent`, ...).
    pub outcomes: BTreeMap<String, u64>,
    /// Every broken invariant, with its seed, step and last steps.
    pub violations: Vec<Violation>,
    /// Blocks still leased when a run ended.
    pub leaked_blocks: u64,
    /// Writes that landed in a block not leased to their (key, epoch).
    pub stale_writes: u64,
    /// Coverage marks and how often they were hit.
    pub coverage: BTreeMap<String, u64>,
    /// SHA-256 (hex) over every step of every seed, in seed order.
    pub trace_hash: String,
}

/// One seed's result.
#[derive(Debug, Clone)]
pub struct SeedResult {
    /// The seed.
    pub seed: u64,
    /// Outcomes by kind.
    pub outcomes: BTreeMap<String, u64>,
    /// Broken invariants.
    pub violations: Vec<Violation>,
    /// Blocks still leased at the end.
    pub leaked_blocks: u64,
    /// Stale landings.
    pub stale_writes: u64,
    /// Coverage marks.
    pub coverage: BTreeMap<&'static str, u64>,
    /// SHA-256 of every step.
    pub trace_hash: [u8; 32],
    /// Steps taken.
    pub steps: u64,
}

/// Parses `"A..B"` (half-open) or a single seed `"S"`.
///
/// ```
/// assert_eq!(kvhandoff_sim::parse_seed_range("1..10000").unwrap(), 1..10000);
/// assert_eq!(kvhandoff_sim::parse_seed_range("7").unwrap(), 7..8);
/// assert!(kvhandoff_sim::parse_seed_range("9..3").is_err());
/// ```
///
/// # Errors
/// A message for text that is not a seed or a non-empty range.
pub fn parse_seed_range(text: &str) -> Result<Range<u64>, String> {
    let num = |s: &str| {
        s.trim()
            .parse::<u64>()
            .map_err(|e| format!("bad seed {s:?}: {e}"))
    };
    let range = match text.split_once("..") {
        Some((a, b)) => num(a)?..num(b)?,
        None => {
            let s = num(text)?;
            s..s.checked_add(1).ok_or("seed too large")?
        }
    };
    if range.is_empty() {
        return Err(format!("empty seed range {text:?}"));
    }
    Ok(range)
}

/// Runs one seed: a faulty phase, then a liveness phase without faults in which every request
/// must end and every table and pool must empty. Prints the seed on a violation.
pub fn run_seed(
    seed: u64,
    requests: usize,
    faults: Faults,
    long: bool,
    mutation: bool,
) -> SeedResult {
    let mut cfg = WorldConfig::seeded(requests, faults, mutation);
    if long {
        cfg.span *= 4;
    }
    run_world(cfg, seed)
}

/// Runs one seeded world of any shape (see [`run_seed`]).
pub fn run_world(cfg: WorldConfig, seed: u64) -> SeedResult {
    let mut world = World::new(cfg, seed);
    let limit_after = std::time::Duration::from_secs(40);
    loop {
        if !world.violations().is_empty() {
            break;
        }
        if world.now() >= world.heal && world.quiescent() {
            break;
        }
        if world.now() > world.heal + limit_after {
            let left = world.unfinished();
            world.violate(format!(
                "L2: not quiescent 40 s after faults stopped: {left}"
            ));
            break;
        }
        if !world.step_seeded() {
            if !world.quiescent() {
                let left = world.unfinished();
                world.violate(format!("L2: nothing left to do, not quiescent: {left}"));
            }
            break;
        }
    }
    for v in world.violations() {
        eprintln!(
            "kvhandoff-sim: seed {seed} step {}: {} (replay: KVHANDOFF_SIM_TRACE=1 with this seed)",
            v.step, v.message
        );
    }
    world.finish(seed)
}

impl World {
    fn finish(mut self, seed: u64) -> SeedResult {
        for n in 0..self.nodes.len() {
            if let Some(endpoint) = self.nodes[n].endpoint.take() {
                self.absorb_counters(&endpoint);
            }
        }
        let c = self.counters.clone();
        self.coverage
            .insert("decode_registered_first", c.decode_registered_first);
        self.coverage
            .insert("prefill_finished_first", c.prefill_finished_first);
        self.coverage.insert("quarantine_free", c.quarantine_frees);
        SeedResult {
            seed,
            leaked_blocks: self.nodes.iter().map(|n| n.pool.leased() as u64).sum(),
            stale_writes: self.stale_writes,
            trace_hash: self.trace_hash(),
            steps: self.step,
            outcomes: std::mem::take(&mut self.outcomes),
            violations: std::mem::take(&mut self.violations),
            coverage: std::mem::take(&mut self.coverage),
        }
    }
}

/// Runs every seed of `opts` (on two threads) and merges the results in seed order.
pub fn run_seeds(opts: &SimOptions) -> SimReport {
    let seeds: Vec<u64> = opts.seeds.clone().collect();
    let requests = if opts.long {
        opts.requests * 4
    } else {
        opts.requests
    };
    let run = |chunk: &[u64]| -> Vec<SeedResult> {
        chunk
            .iter()
            .map(|&s| run_seed(s, requests, opts.faults, opts.long, opts.mutation))
            .collect()
    };
    let half = seeds.len().div_ceil(2);
    let (first, second) = seeds.split_at(half);
    let mut results = std::thread::scope(|scope| {
        let other = scope.spawn(|| run(second));
        let mut mine = run(first);
        mine.extend(other.join().expect("simulation thread panicked"));
        mine
    });
    results.sort_by_key(|r| r.seed);
    let mut report = SimReport {
        seeds: seeds.len() as u64,
        requests,
        coverage: COVERAGE_MARKS.iter().map(|m| (m.to_string(), 0)).collect(),
        ..SimReport::default()
    };
    let mut hash = Sha256::new();
    for r in results {
        for (k, v) in r.outcomes {
            *report.outcomes.entry(k).or_insert(0) += v;
        }
        for (k, v) in r.coverage {
            *report.coverage.entry(k.to_string()).or_insert(0) += v;
        }
        report.violations.extend(r.violations);
        report.leaked_blocks += r.leaked_blocks;
        report.stale_writes += r.stale_writes;
        hash.update(r.trace_hash);
    }
    report.trace_hash = hash.finalize().iter().map(|b| format!("{b:02x}")).collect();
    report
}
