//! What a sweep runs: [`SimOptions`], and the coverage marks they require.

use std::ops::{Range, RangeInclusive};

#[cfg(doc)]
use crate::WorldConfig;

use crate::{
    Faults, Mode, Mutation, DEFAULT_POOL_BLOCKS, DEFAULT_STALL_FREEZE, FLOOD_MARKS,
    HETERO_TURN_MARKS, LAYERWISE_MARKS, MISNAME_MARKS, STALL_MARKS,
};

/// What to run.
#[derive(Debug, Clone)]
pub struct SimOptions {
    /// Seeds to run, one world each.
    pub seeds: Range<u64>,
    /// Requests per world: drawn per seed from this range (one value: a fixed load).
    pub requests: RangeInclusive<usize>,
    /// Blocks per rank: drawn per seed from this range. Small pools mean contention and blocks
    /// reused soon after they are freed; large ones, many requests in flight at a fault.
    pub pool_blocks: RangeInclusive<u32>,
    /// Which faults to inject.
    pub faults: Faults,
    /// Four times the virtual time over which requests start.
    pub long: bool,
    /// The deliberate bug every endpoint runs with (the simulator must catch it).
    pub mutation: Option<Mutation>,
    /// See [`WorldConfig::poll_allocations`].
    pub poll_allocations: bool,
    /// How the requests move their KV.
    pub mode: Mode,
    /// The share of requests that are multi-rank (see [`WorldConfig::multi_source`]); `None`:
    /// the mode's ([`Mode::multi_source_share`]).
    pub multi_source: Option<f64>,
    /// Multi-rank requests keep their drawn second turn, read back across the pair (see
    /// [`WorldConfig::multi_rank_turns`]); off in [`SimOptions::new`], so that every
    /// regression seed replays as found, on in `kvhandoff sim` unless `--no-multi-rank-turns`.
    pub multi_rank_turns: bool,
    /// The share of push requests handed over layer-wise (see [`WorldConfig::layerwise`]); 0
    /// in [`SimOptions::new`].
    pub layerwise: f64,
    /// Process stalls per world under chaos (see [`WorldConfig::stalls`]); 0 in
    /// [`SimOptions::new`], so that every regression seed replays as found.
    pub stalls: f64,
    /// The share of stalls that freeze the stalled process's transfers (see
    /// [`WorldConfig::stall_freeze`]).
    pub stall_freeze: f64,
    /// The share of resumes that hand over what was held before the due timers run (see
    /// [`WorldConfig::stall_messages_first`]).
    pub stall_messages_first: f64,
    /// Let stalls freeze writes past the stall allowance (see
    /// [`WorldConfig::stall_past_allowance`]).
    pub stall_past_allowance: bool,
    /// Each seed draws its own configuration around these options (`swarm.rs`): timing
    /// profiles, table sizes, resends, stall mixes. Off in [`SimOptions::new`], so that every
    /// regression seed replays as found; on in `kvhandoff sim` unless `--no-swarm`.
    pub swarm: bool,
    /// A hostile peer floods P with made-up keys in every world (see
    /// [`WorldConfig::flood_peer`]); the swarm also draws it per seed.
    pub flood_peer: bool,
    /// P ranks name another rank in their answers at this rate in every world with several P
    /// ranks (see [`WorldConfig::misname_rank`]); the swarm also draws it per seed.
    pub misname_rank: f64,
}

impl SimOptions {
    /// `requests` requests per seed, the default pool, no mutation.
    pub fn new(seeds: Range<u64>, requests: usize, faults: Faults) -> SimOptions {
        SimOptions {
            seeds,
            requests: requests..=requests,
            pool_blocks: DEFAULT_POOL_BLOCKS..=DEFAULT_POOL_BLOCKS,
            faults,
            long: false,
            mutation: None,
            poll_allocations: false,
            mode: Mode::Push,
            multi_source: None,
            multi_rank_turns: false,
            layerwise: 0.0,
            stalls: 0.0,
            stall_freeze: DEFAULT_STALL_FREEZE,
            stall_messages_first: 0.0,
            stall_past_allowance: false,
            swarm: false,
            flood_peer: false,
            misname_rank: 0.0,
        }
    }

    /// The coverage marks a sweep with these options must hit: the mode's, the stall marks if
    /// its worlds may stall, and the hostile peers' marks where its worlds have them (always
    /// under chaos with the swarm, which draws them per seed).
    pub fn required_marks(&self) -> Vec<&'static str> {
        let mut marks = self.mode.required_marks();
        if self.multi_source_share() > 0.0 && self.mode.multi_source_share() == 0.0 {
            marks.extend(self.mode.multi_rank_marks());
        }
        if self.multi_rank_turns
            && self.multi_source_share() > 0.0
            && self.mode.second_turn_share() > 0.0
        {
            marks.extend_from_slice(HETERO_TURN_MARKS);
        }
        if self.multi_rank_turns && self.multi_source_share() > 0.0 && self.mode.pull_share() > 0.0
        {
            marks.extend_from_slice(crate::HETERO_DECLINE_MARKS);
        }
        let chaos = self.faults == Faults::Chaos;
        if chaos && self.stalls > 0.0 {
            marks.extend_from_slice(STALL_MARKS);
        }
        let swarmed = chaos && self.swarm;
        if self.mode.pushes() && (self.flood_peer || swarmed) {
            marks.extend_from_slice(FLOOD_MARKS);
        }
        // P ranks misname themselves in push answers (`WriteDone` and its kin): a world that
        // only pulls has none.
        if self.multi_source_share() > 0.0
            && self.mode.pushes()
            && (self.misname_rank > 0.0 || swarmed)
        {
            marks.extend_from_slice(MISNAME_MARKS);
        }
        if chaos && self.layerwise > 0.0 && self.mode.pushes() {
            marks.extend_from_slice(LAYERWISE_MARKS);
        }
        if self.swarm && self.mode.second_turn_share() > 0.0 {
            // Routers that keep one `transfer_id` for a whole conversation (drawn per seed).
            marks.push("turn2_read_under_first_key");
        }
        if swarmed && self.mode.pushes() {
            // Routers that know nothing of epochs, after a D's crash (drawn per seed).
            marks.push("router_retry_at_epoch_one");
        }
        if swarmed && self.stalls > 0.0 && self.mode.pushes() && self.stall_messages_first > 0.0 {
            // Routers late to D at P's lease end, with P stopped across it (drawn per seed).
            marks.push("register_after_lease_end");
        }
        if swarmed && self.stalls > 0.0 && self.mode.reads() && self.stall_messages_first > 0.0 {
            // Readers that handle a grant late and stop with their reads frozen past the
            // holder's fence (drawn per seed).
            marks.push("frozen_read_landed_after_holder_freed");
        }
        if swarmed && self.stalls > 0.0 && self.mode.pushes() && self.stall_messages_first > 0.0 {
            // P stopped with a registration pending until D freed (drawn per seed).
            marks.push("finish_after_pending_registration_expired");
        }
        if swarmed && self.mode.pushes() {
            // Late registration copies with small tables, and orphaned registrations with a
            // sibling (drawn per seed).
            marks.push("register_after_decode_ended");
            marks.push("heartbeat_for_anothers_registration");
        }
        if swarmed && self.stalls > 0.0 && self.layerwise > 0.0 && self.mode.pushes() {
            // Layer-wise writers stopped between two parts until D freed (drawn per seed).
            marks.push("layers_resumed_past_d_free");
        }
        marks
    }

    /// The share of multi-rank requests these options run.
    pub fn multi_source_share(&self) -> f64 {
        self.multi_source
            .unwrap_or_else(|| self.mode.multi_source_share())
    }

    /// The long sweep's load: 10–300 requests and 8–128 blocks per rank, drawn per seed, over
    /// four times the virtual time.
    pub fn long_sweep(seeds: Range<u64>, faults: Faults) -> SimOptions {
        SimOptions {
            requests: 10..=300,
            pool_blocks: 8..=128,
            long: true,
            ..SimOptions::new(seeds, 50, faults)
        }
    }
}
