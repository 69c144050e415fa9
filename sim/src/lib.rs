//! Deterministic simulation of kvhandoff engines.
//!
//! A [`World`] holds engine ranks (P's rank 0, three more P ranks in worlds with multi-rank
//! requests, and one or more D engines) whose protocol state is the real
//! [`kvhandoff_protocol::machine::Endpoint`], a virtual clock, a simulated NIXL with real bytes,
//! a simulated notification network with faults, crash and restart of engine processes, LIFO
//! block allocators, and a ghost ledger that checks the safety properties after every step.
//! Every choice comes from one ChaCha8 stream seeded by the run's seed, so a seed replays
//! exactly ([`run_seed`]); the same world is also driven choice by choice by the ordering fuzz
//! and the exhaustive check ([`World::apply`], [`exhaustive`]).
//!
//! See `docs/testing.md` for the invariants, the coverage marks and how to replay a seed.
#![forbid(unsafe_code)]

mod engine;
mod exhaustive_report;
mod explore;
mod ledger;
mod mode;
mod nixl;
mod options;
pub mod scripted;
mod swarm;
mod transport;
mod world;

use std::collections::BTreeMap;
use std::ops::Range;
use std::time::Duration;

use rand::{Rng, SeedableRng};
use serde::Serialize;
use sha2::{Digest, Sha256};

pub use engine::MULTI_SOURCE_PREFILL_RANKS;
pub use exhaustive_report::{
    run_exhaustive, ExhaustiveReport, ExhaustiveScope, EXHAUSTIVE_MAX_STATES, EXHAUSTIVE_SCOPES,
};
pub use explore::{exhaustive, Action, Exhaustive, Kind};
pub use kvhandoff_protocol::machine::Mutation;
pub use ledger::{pattern, BLOCK_BYTES};
pub use mode::{
    Mode, HETERO_DECLINE_MARKS, HETERO_READ_MARKS, HETERO_TURN_MARKS, MULTI_SOURCE_MARKS,
    READ_MARKS,
};
pub use options::SimOptions;
pub use world::{
    NodeId, Violation, World, WorldConfig, DEFAULT_LAYERWISE, DEFAULT_STALLS, DEFAULT_STALL_FREEZE,
    DEFAULT_STALL_MESSAGES_FIRST, FLOOD_MARKS, LAYERWISE_MARKS, MISNAME_MARKS, STALL_MARKS,
};

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
    "write_landed_after_invalidate",
    "write_landed_after_abandon",
    "false_death_peer_alive",
    "tombstone_evicted",
    "fence_free",
    "poster_crashed_mid_write",
    "duplicate_handshake_same_incarnation",
    "new_incarnation_while_connected",
    "register_resent",
    "stale_cancel_newer_epoch",
    "admission_refused",
    "second_decode_same_key",
    "shell_post_refused",
    "shell_send_refused",
    "decode_fenced_early",
    "fenced_peer_asked_again",
];

/// Blocks per rank unless a sweep says otherwise.
pub const DEFAULT_POOL_BLOCKS: u32 = 24;

/// The load of one seed: drawn from the options by the seed alone (not from the world's
/// stream), so a seed replays with the same load whatever else runs.
pub fn seed_load(opts: &SimOptions, seed: u64) -> (usize, u32) {
    let mut rng = load_rng(seed);
    let requests = rng.gen_range(opts.requests.clone());
    let pool = rng.gen_range(opts.pool_blocks.clone());
    (requests, pool)
}

fn load_rng(seed: u64) -> rand_chacha::ChaCha8Rng {
    rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ 0x6c6f_6164_6c6f_6164)
}

/// Tombstones per side in the seeds that run with a small table (one in eight): eviction at
/// capacity happens, and late messages of evicted keys look new.
pub const SMALL_TOMBSTONE_TABLE: usize = 24;

/// The delivery bound of the seeds with a slow network: messages (and late copies) take up to
/// several seconds.
pub const SLOW_NETWORK_DELAY: Duration = Duration::from_secs(4);

/// A world whose slow messages take seconds: `max_message_delay` [`SLOW_NETWORK_DELAY`], slow
/// messages up to 90 % of it, and the bounds that depend on it moved so that the machine
/// configuration stays valid (the quarantine one heartbeat above its floor, tombstones living
/// past their minimum).
pub fn slow_network(cfg: &mut WorldConfig) {
    let m = &mut cfg.machine;
    m.max_message_delay = SLOW_NETWORK_DELAY;
    m.quarantine = m.quarantine.max(m.fence_floor() + m.heartbeat_interval);
    m.tombstone_ttl = m
        .tombstone_ttl
        .max(m.tombstone_min_life() + m.heartbeat_interval);
    cfg.slow_message_max = SLOW_NETWORK_DELAY * 9 / 10;
}

/// The seed's world, at its drawn load: one seed in eight also runs with a small tombstone
/// table ([`SMALL_TOMBSTONE_TABLE`]), one in eight with a slow network ([`slow_network`]).
pub fn seed_world(opts: &SimOptions, seed: u64) -> WorldConfig {
    let (requests, pool) = seed_load(opts, seed);
    let mut cfg = WorldConfig::seeded(requests, opts.faults, opts.mutation);
    cfg.pool_blocks = pool;
    cfg.poll_allocations = opts.poll_allocations;
    cfg.mode = opts.mode;
    cfg.stalls = opts.stalls;
    cfg.stall_freeze = opts.stall_freeze;
    cfg.stall_messages_first = opts.stall_messages_first;
    cfg.stall_past_allowance = opts.stall_past_allowance;
    cfg.layerwise = opts.layerwise;
    let share = opts.multi_source_share();
    if share > 0.0 {
        // More P ranks only where some requests use them: other worlds keep their nodes, and
        // so their traces.
        cfg.multi_source = share;
        cfg.prefill_ranks = MULTI_SOURCE_PREFILL_RANKS;
        cfg.multi_rank_turns = opts.multi_rank_turns;
    }
    if opts.long {
        cfg.span *= 4;
    }
    // Drawn after the load, from the same stream, so the load of a seed is unchanged.
    let mut rng = load_rng(seed);
    let _ = (
        rng.gen_range(opts.requests.clone()),
        rng.gen_range(opts.pool_blocks.clone()),
    );
    if rng.gen_ratio(1, 8) {
        cfg.machine.max_tombstones = SMALL_TOMBSTONE_TABLE;
    }
    if rng.gen_ratio(1, 8) {
        slow_network(&mut cfg);
    }
    cfg.flood_peer = opts.flood_peer;
    cfg.misname_rank = opts.misname_rank;
    if opts.swarm {
        swarm::draw(opts, seed, &mut cfg);
    }
    cfg
}

/// The result of a sweep. Identical for identical options, whatever the thread count.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct SimReport {
    /// How the requests moved their KV.
    pub mode: Mode,
    /// Seeds run.
    pub seeds: u64,
    /// Requests per seed (the most any seed ran when the load varies).
    pub requests: usize,
    /// Requests per seed were drawn from `[lo, hi]`.
    pub requests_range: [usize; 2],
    /// Blocks per rank were drawn from `[lo, hi]`.
    pub pool_blocks_range: [u32; 2],
    /// Requests run over all seeds.
    pub total_requests: u64,
    /// The deliberate bug the run had, if any.
    pub mutation: Option<String>,
    /// Terminal outcomes by kind (`decode.Ready`, `prefill.Sent`, ...).
    pub outcomes: BTreeMap<String, u64>,
    /// Every broken invariant, with its seed, step and last steps.
    pub violations: Vec<Violation>,
    /// Blocks still leased when a run ended.
    pub leaked_blocks: u64,
    /// Each leaked block: seed, node, block and who held it (at most 64 listed).
    pub leaks: Vec<String>,
    /// Writes that landed in a block not leased to their (key, epoch).
    pub stale_writes: u64,
    /// Coverage marks and how often they were hit.
    pub coverage: BTreeMap<String, u64>,
    /// Machine counters worth watching, summed (fence frees, stuck writes, evictions...).
    pub counters: BTreeMap<String, u64>,
    /// SHA-256 (hex) over every step of every seed, in seed order.
    pub trace_hash: String,
    /// Second turns (mixed and bidirectional worlds).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub turns: Option<Turns>,
}

impl SimReport {
    /// No violation, no leak, no stale write.
    pub fn clean(&self) -> bool {
        self.violations.is_empty() && self.leaked_blocks == 0 && self.stale_writes == 0
    }

    /// The first violation with its seed and trace, for a failing test's message (empty when
    /// there is none).
    pub fn first_violation(&self) -> String {
        self.violations
            .first()
            .map(|v| format!("seed {}: {}\n{}", v.seed, v.message, v.trace.join("\n")))
            .unwrap_or_default()
    }

    /// Every violation's message.
    pub fn violation_messages(&self) -> Vec<&str> {
        self.violations.iter().map(|v| v.message.as_str()).collect()
    }

    /// The outcomes whose kind starts with `prefix`, summed.
    pub fn outcomes_starting(&self, prefix: &str) -> u64 {
        self.outcomes
            .iter()
            .filter(|(kind, _)| kind.starts_with(prefix))
            .map(|(_, n)| n)
            .sum()
    }
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
    /// Who held each leaked block.
    pub leaks: Vec<String>,
    /// Requests the seed ran.
    pub requests: usize,
    /// When faults stopped (virtual time since the start).
    pub heal: std::time::Duration,
    /// When an attempt last started or ended.
    pub last_progress: std::time::Duration,
    /// Machine counters worth watching.
    pub counters: BTreeMap<&'static str, u64>,
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
    mutation: Option<Mutation>,
) -> SeedResult {
    let mut cfg = WorldConfig::seeded(requests, faults, mutation);
    if long {
        cfg.span *= 4;
    }
    run_world(cfg, seed)
}

/// How long after faults stop (and after the last attempt started or ended, whichever is
/// later) the world must be quiescent: a backlog of requests waiting for blocks is progress,
/// not a liveness failure, as long as something starts or ends within this window.
pub const LIVENESS_WINDOW: std::time::Duration = std::time::Duration::from_secs(40);

/// Runs one seeded world of any shape (see [`run_seed`]).
pub fn run_world(cfg: WorldConfig, seed: u64) -> SeedResult {
    let mut world = World::new(cfg, seed);
    loop {
        if !world.violations().is_empty() {
            break;
        }
        if world.now() >= world.heal && world.quiescent() {
            break;
        }
        if world.now() > world.heal.max(world.last_progress) + LIVENESS_WINDOW {
            let left = world.unfinished();
            world.violate(format!(
                "L2: not quiescent {} s after faults stopped and the last attempt started or \
                 ended: {left}",
                LIVENESS_WINDOW.as_secs()
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
            if let Some(session) = self.nodes[n].session.take() {
                self.absorb_counters(session.endpoint());
            }
        }
        let c = self.counters.clone();
        self.coverage
            .insert("decode_registered_first", c.decode_registered_first);
        self.coverage
            .insert("prefill_finished_first", c.prefill_finished_first);
        self.coverage.insert("quarantine_free", c.quarantine_frees);
        self.coverage.insert("register_resent", c.register_resends);
        self.coverage
            .insert("stale_cancel_newer_epoch", c.stale_settles_ignored);
        self.coverage
            .insert("tombstone_evicted", self.tombstones_evicted);
        // Marks this world need not hit are reported only when hit.
        let required = self.cfg.required_marks();
        self.coverage
            .retain(|mark, hits| *hits > 0 || required.contains(mark));
        let counters = BTreeMap::from([
            ("quarantine_frees", c.quarantine_frees),
            ("fence_frees", c.fence_frees),
            ("stuck_writes", c.stuck_writes),
            ("tombstones_evicted", self.tombstones_evicted),
            ("peers_declared_dead", c.peers_declared_dead),
            ("peer_restarts", c.peer_restarts),
            ("repeated_handshakes", c.repeated_handshakes),
            ("writes_abandoned", c.writes_abandoned),
            ("cancel_resends", c.cancel_resends),
            ("register_resends", c.register_resends),
            ("register_resends_skipped", c.register_resends_skipped),
            ("reads_asked_again", c.reads_asked_again),
            ("fenced_block_us", self.fenced_block_us),
            ("reads_granted", c.reads_granted),
            ("reads_posted", c.reads_posted),
            ("reads_failed", c.reads_failed),
            ("reads_declined_near_expiry", c.reads_declined_near_expiry),
            ("exports_renewed", c.exports_renewed),
            ("grant_fence_frees", c.grant_fence_frees),
            ("stalls", self.stalls_run),
            ("transfers_frozen_by_stall", self.stall_frozen),
            ("decodes_fenced", c.decodes_fenced),
            ("cancels_unanswered", c.cancels_unanswered),
            ("stale_grants_refused", c.stale_grants_refused),
            ("late_reads_distrusted", c.late_reads_distrusted),
            ("expired_leases_refused", c.expired_leases_refused),
            ("stale_messages_refused", c.stale_messages_refused),
        ]);
        SeedResult {
            seed,
            leaked_blocks: self.nodes.iter().map(|n| n.pool.leased() as u64).sum(),
            leaks: self.explain_leaks(),
            requests: self.cfg.requests,
            heal: self.heal.since_origin(),
            last_progress: self.last_progress.since_origin(),
            counters,
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
    run_seeds_observed(opts, &|| {})
}

/// [`run_seeds`], calling `seed_done` after each seed ends (from either of the two worker
/// threads): what a progress bar counts.
pub fn run_seeds_observed(opts: &SimOptions, seed_done: &(dyn Fn() + Sync)) -> SimReport {
    let seeds: Vec<u64> = opts.seeds.clone().collect();
    let run = |chunk: &[u64]| -> Vec<SeedResult> {
        chunk
            .iter()
            .map(|&s| {
                let result = run_world(seed_world(opts, s), s);
                seed_done();
                result
            })
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
        requests_range: [*opts.requests.start(), *opts.requests.end()],
        pool_blocks_range: [*opts.pool_blocks.start(), *opts.pool_blocks.end()],
        mutation: opts.mutation.map(|m| m.name().to_string()),
        coverage: opts
            .required_marks()
            .into_iter()
            .map(|m| (m.to_string(), 0))
            .collect(),
        mode: opts.mode,
        ..SimReport::default()
    };
    let mut hash = Sha256::new();
    for r in results {
        report.requests = report.requests.max(r.requests);
        report.total_requests += r.requests as u64;
        for (k, v) in r.outcomes {
            *report.outcomes.entry(k).or_insert(0) += v;
        }
        for (k, v) in r.coverage {
            *report.coverage.entry(k.to_string()).or_insert(0) += v;
        }
        for (k, v) in r.counters {
            *report.counters.entry(k.to_string()).or_insert(0) += v;
        }
        report.violations.extend(r.violations);
        report.leaked_blocks += r.leaked_blocks;
        for leak in r.leaks {
            if report.leaks.len() < 64 {
                report.leaks.push(format!("seed {}: {leak}", r.seed));
            }
        }
        report.stale_writes += r.stale_writes;
        hash.update(r.trace_hash);
    }
    report.trace_hash = hash.finalize().iter().map(|b| format!("{b:02x}")).collect();
    if opts.mode.reads() && opts.mode != Mode::Pull {
        let count = |key: &str| report.outcomes.get(key).copied().unwrap_or(0);
        report.turns = Some(Turns {
            pulled_from_decode: count("turn2.pulled_from_decode"),
            recomputed: count("turn2.recomputed"),
            declined_near_expiry: count("turn2.declined_near_expiry"),
        });
    }
    report
}

/// How second turns went (bidirectional worlds).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Turns {
    /// P read the first turn's KV back from D.
    pub pulled_from_decode: u64,
    /// P recomputed instead (it declined, or the read failed or was refused).
    pub recomputed: u64,
    /// The read was declined because it could outlive D's TTL.
    pub declined_near_expiry: u64,
}
