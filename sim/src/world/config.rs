//! The shape of a simulated world: what runs, which faults may happen, the machines'
//! configuration.

use std::time::Duration;

use kvhandoff_protocol::machine::{Config, Mutation};

use crate::Faults;

/// Shape of a world: what runs and which faults may happen.
#[derive(Debug, Clone)]
pub struct WorldConfig {
    /// Requests to run.
    pub requests: usize,
    /// D engines (one rank each).
    pub decode_engines: usize,
    /// Ranks of the P engine. Rank 0 is node 0 and serves every single-source request; ranks
    /// 1.. are nodes after the D engines and serve only multi-rank requests (see
    /// `multi_source`).
    pub prefill_ranks: usize,
    /// The share of requests that are multi-rank (push only): a D rank fed by 2–4 P ranks, a P
    /// rank feeding every D rank, or both, each pair an ordinary 1:1 sub-request. Drawn per
    /// request from a stream of its own; 0 keeps the world's original shape.
    pub multi_source: f64,
    /// Multi-rank requests take part in conversations (issue 23, item 4): pulled ones keep the
    /// sibling declines their transfer draws, and they keep the second turn it draws: D's
    /// ranks keep their blocks with turn links, and P's ranks read them back across the
    /// heterogeneous pair. Such a world has a second rank of D's engine `decode-0` (its last
    /// node), which its multi-rank requests take as D rank 1 in place of `decode-1`: a read
    /// back names its holders as ranks of the one engine whose answer the router forwards.
    /// Off in the constructors, so that every regression seed replays as found.
    pub multi_rank_turns: bool,
    /// The share of single-source push requests that P hands over layer-wise (its engine
    /// reports layers as they are produced, each part written as soon as D registered). Drawn
    /// per request from a stream of its own; 0 (the constructors') keeps every regression seed
    /// replaying as found.
    pub layerwise: f64,
    /// How long P's engine computes one layer of a layer-wise prefill, in µs (drawn per layer
    /// from this range; the swarm draws slow layers, so that stalls and cancels meet partial
    /// layer sets often).
    pub layer_compute_us: (u64, u64),
    /// The chance that D's engine aborts a layer-wise request as P reports one of its layers
    /// before the last (the swarm draws it, so that D gives up on partly sent writes often);
    /// 0 in the constructors.
    pub abort_mid_layers: f64,
    /// Which faults may happen.
    pub faults: Faults,
    /// The machines' configuration.
    pub machine: Config,
    /// Scheduler-driven (fuzz, exhaustive): no random faults, no due times; every choice is
    /// made through [`World::apply`](crate::World::apply).
    pub explore: bool,
    /// Most crashes in explore mode.
    pub max_crashes: u32,
    /// Blocks per rank.
    pub pool_blocks: u32,
    /// Virtual time over which requests start (seeded mode).
    pub span: Duration,
    /// Chaos duplicates D→P control messages too, not only P→D notifications. NIXL does not
    /// duplicate, but a protocol that survives it needs fewer assumptions; on by default in
    /// seeded runs (it found the bug of `tests/regressions.rs`).
    pub dup_control: bool,
    /// The deliberate bug every endpoint runs with (the mutation check), if any.
    pub mutation: Option<Mutation>,
    /// Engines retry a failed allocation every 2–10 ms instead of waiting in a queue for blocks
    /// to be freed: the engine model in which the first regressions were found (their seeds
    /// replay their paths only with it). Costly at high load.
    pub poll_allocations: bool,
    /// The longest a slow message takes (chaos and network faults slow some messages down).
    /// Kept below `machine.max_message_delay`.
    pub slow_message_max: Duration,
    /// How the requests move their KV.
    pub mode: crate::Mode,
    /// Process stalls (chaos, seeded mode; see `world/stall.rs`): the mean number per world,
    /// each world drawing 0 to twice as many. 0 (the constructors' default, so that every
    /// regression seed replays as found) runs none; `kvhandoff sim` runs
    /// [`DEFAULT_STALLS`] under chaos.
    pub stalls: f64,
    /// The chance that a stall freezes the stalled process's transfers until it resumes
    /// (their life clock suspended), rather than letting them move on.
    pub stall_freeze: f64,
    /// The chance that a resumed process handles what it held before its due timers run: the
    /// shell before issue 19's fix, or one whose transport polled the queue before its rank's
    /// timers ran. 0 by default (the fixed shell: timers first); above 0 it exercises the
    /// machines' own refusals of stale messages, which timers-first makes unreachable.
    pub stall_messages_first: f64,
    /// Stalls freeze writes for longer than the stall allowance (`Config::stall_allowance`): a
    /// deployment that breaks the requirement the time-based frees rest on. Off by default; on,
    /// the checker must find blocks handed out under a write that still lands.
    pub stall_past_allowance: bool,
    /// The configuration was drawn by the swarm (`swarm.rs`): stall lengths fall around every
    /// threshold of this configuration (not only the fast one's order of them). Off in the
    /// constructors, so that every regression seed replays as found.
    pub swarm: bool,
    /// A conversation's second turn goes under its first turn's key, as a router that keeps one
    /// `transfer_id` for the whole conversation sends it (swarm; otherwise a key of its own).
    pub one_key_across_turns: bool,
    /// Half the stalls stop P's rank 0 (the writer and holder most requests meet), the rest a
    /// node drawn at random (swarm).
    pub stall_prefill: bool,
    /// D's rank 0 is also a hostile peer: during the faulty phase it sends P's rank 0 a stream
    /// of cancels and releases for made-up keys (tens per heartbeat, from a random stream of
    /// its own, see `world/hostile.rs`). Honest simulated peers never exercise the per-peer
    /// budget of the records P writes for keys it holds nothing for, so without this its loss
    /// would go unseen. Off in the constructors, so that every seed replays as found.
    pub flood_peer: bool,
    /// The chance that an answer of a P rank (`WriteDone`, `WriteFailed`, `CancelAck`) in a
    /// world with several P ranks names another rank (a buggy or forged peer): the rank number
    /// alone, or, for a multi-rank request, the share of a sibling rank writing the same D rank
    /// (its pair's key). D must count an answer only for the rank that sent it; honest ranks
    /// always name themselves, so without this a D that trusts the named rank goes unseen.
    /// Faulty phase only, from a random stream of its own; 0 in the constructors.
    pub misname_rank: f64,
    /// The chance that a process stops right after it posts a transfer, its transfers frozen
    /// (a pause that follows a post), at most three per world: transfers in
    /// flight meet stalls often, and their reports come late (swarm).
    pub stall_after_post: f64,
    /// The share of single-source push requests (not layer-wise) whose D the router hands the
    /// request about when P's lease on its blocks ends, P stopping from the registration's
    /// arrival until just past that end (swarm, `engine/leases.rs`): without it a
    /// registration reaches a lease that ended while its timer could not run in a few seeds of
    /// 300 only. 0 in the constructors.
    pub late_register: f64,
    /// The chance that a grant reaching a reader in the faulty phase meets an aimed pair of
    /// stalls (swarm, `engine/late_grants.rs`): the reader handles the grant late, then stops
    /// with its reads frozen past the holder's grant fence, where only its late-read check
    /// keeps it from trusting what lands. Needs stalls and messages-first resumes; at most
    /// three per world. 0 in the constructors.
    pub late_grant: f64,
    /// The chance that a registration D sends in the faulty phase gets one more copy, delivered
    /// as late as a message may be (between 60% and all of `machine.max_message_delay`): it
    /// reaches P after its key's request ended there, where only P's record of the key (its
    /// epoch floor) refuses it. The swarm draws it with small tombstone tables, whose
    /// admission control keeps such a record alive while it is young, and at a lower rate in
    /// half the other chaos pushing worlds. 0 in the constructors.
    pub late_register_copies: f64,
    /// The share of single-source pulls whose P engine hands the router its answer before
    /// its rank has the export, the rank's call following 0.5–60 ms later (one in eight: half
    /// to one and a half `register_retry_interval`), as vLLM's scheduler answers and its worker
    /// hands the export over at the next step (swarm, `engine/early_answers.rs`); as large a
    /// share of multi-rank pulls (each P rank's call after its own delay,
    /// `engine/multi/early.rs`) and of D's keeps for a second turn (`engine/early_keeps.rs`,
    /// `engine/multi/turn/early.rs`). 0 in the constructors.
    pub early_answers: f64,
    /// The share of single-source push requests that get a sibling D engine of their key (a
    /// decode leg the router sent twice) when P's request fails, timed for its registration
    /// to reach P's record of the key shortly before that record first expires; each of the
    /// sibling's registrations gets a late copy, which arrives after it (swarm,
    /// `engine/late_siblings.rs`). Needs two D engines. 0 in the constructors.
    pub late_siblings: f64,
    /// The share of single-source push requests (not layer-wise) set up as orphaned
    /// registrations with a sibling (swarm, `engine/orphans.rs`): D aborts soon after
    /// registering and loses every cancel, a second D engine of the key registers while P
    /// holds the first registration and heartbeats past the first D's quarantine, and P's leg
    /// starts after it. Needs two D engines. 0 in the constructors.
    pub orphaned_registrations: f64,
    /// The chance that P stops right after posting a part of a layer-wise write with parts
    /// still to come, until D gave up and freed the blocks (swarm, `engine/lapsed_layers.rs`):
    /// its registration has lapsed when it runs again. At most twice per world; 0 in the
    /// constructors.
    pub stall_mid_layers: f64,
    /// The chance that P stops right after taking a registration it holds pending (its prefill
    /// has not ended), until D gave up and freed the blocks, its resume handing over what
    /// queued first (swarm, `engine/expired_registrations.rs`). At most twice per world; 0 in
    /// the constructors.
    pub stall_pending_registration: f64,
    /// The swarm may draw completions that take the slowest a message may take
    /// (`Rates::slow_write_done`). True in the constructors; a regression seed found before
    /// that draw existed turns it off to replay its world.
    pub late_completions: bool,
}

/// Most stalls per world that start right after a post.
pub const MAX_POST_STALLS: u32 = 3;

/// The coverage mark of [`WorldConfig::flood_peer`]: `peer_flood_refused` (P left a made-up
/// key's cancel or release unanswered for the sender's budget, `DropReason::TombstoneBudget`).
pub const FLOOD_MARKS: &[&str] = &["peer_flood_refused"];

/// The coverage mark of [`WorldConfig::misname_rank`]: `misnamed_rank_refused` (D refused an
/// answer naming a rank other than its sender's, `DropReason::Unexpected`).
pub const MISNAME_MARKS: &[&str] = &["misnamed_rank_refused"];

/// The coverage marks of [`WorldConfig::layerwise`]: a layer-wise request made ready by its
/// parts, and one whose first parts landed before D gave up (the fence over a partial layer
/// set).
pub const LAYERWISE_MARKS: &[&str] = &["layerwise_ready", "layerwise_partial_then_cancel"];

/// The share of push requests handed over layer-wise in `kvhandoff sim`.
pub const DEFAULT_LAYERWISE: f64 = 0.3;

/// Stalls per world in the chaos mix of `kvhandoff sim` (mean; each world draws 0 to twice as
/// many).
pub const DEFAULT_STALLS: f64 = 1.0;

/// The share of stalls that freeze the stalled process's transfers in the chaos mix of
/// `kvhandoff sim`.
pub const DEFAULT_STALL_FREEZE: f64 = 0.5;

/// The share of resumes in the chaos mix of `kvhandoff sim` that hand the resumed endpoint what
/// it held before its due timers run: neither the shell's timers-first order nor the machines'
/// own refusals of stale messages is trusted alone, so the sweeps exercise each without the
/// other half the time.
pub const DEFAULT_STALL_MESSAGES_FIRST: f64 = 0.5;

/// The coverage marks of process stalls, required wherever a world may stall:
/// `stall_past_peer_timeout` (a process connected to a peer stopped for longer than the peer
/// timeout) and `stale_message_after_stall` (a message that arrived while its process was
/// stopped was handed to the resumed shell, after its due timers ran).
pub const STALL_MARKS: &[&str] = &["stall_past_peer_timeout", "stale_message_after_stall"];

impl WorldConfig {
    /// A seeded world of `requests` requests with the fast machine configuration.
    pub fn seeded(requests: usize, faults: Faults, mutation: Option<Mutation>) -> WorldConfig {
        let machine = Config {
            // Reads of two blocks: a failed read leaves a valid prefix to recompute from.
            read_chunk_blocks: 2,
            ..Config::fast()
        };
        WorldConfig {
            requests,
            decode_engines: 2,
            prefill_ranks: 1,
            multi_source: 0.0,
            multi_rank_turns: false,
            layerwise: 0.0,
            layer_compute_us: (100, 3_000),
            abort_mid_layers: 0.0,
            faults,
            machine,
            explore: false,
            max_crashes: 0,
            pool_blocks: 24,
            span: Duration::from_millis(10 * requests as u64 + 50),
            dup_control: true,
            mutation,
            poll_allocations: false,
            slow_message_max: Duration::from_millis(140),
            mode: crate::Mode::Push,
            stalls: 0.0,
            stall_freeze: DEFAULT_STALL_FREEZE,
            stall_messages_first: 0.0,
            stall_past_allowance: false,
            swarm: false,
            one_key_across_turns: false,
            stall_prefill: false,
            flood_peer: false,
            misname_rank: 0.0,
            stall_after_post: 0.0,
            late_register: 0.0,
            late_grant: 0.0,
            late_register_copies: 0.0,
            early_answers: 0.0,
            late_siblings: 0.0,
            orphaned_registrations: 0.0,
            stall_mid_layers: 0.0,
            stall_pending_registration: 0.0,
            late_completions: true,
        }
    }

    /// Whether this world's processes may stall (chaos in seeded mode, a positive rate).
    pub fn may_stall(&self) -> bool {
        !self.explore && self.faults == Faults::Chaos && self.stalls > 0.0
    }

    /// The coverage marks this world must hit: its mode's, the stall marks if it may stall, and
    /// the hostile peers' marks if it has them.
    pub fn required_marks(&self) -> Vec<&'static str> {
        let mut marks = self.mode.required_marks();
        if self.may_stall() {
            marks.extend_from_slice(STALL_MARKS);
        }
        if self.floods() {
            marks.extend_from_slice(FLOOD_MARKS);
        }
        if self.reads_turns_back_across_ranks() {
            marks.extend_from_slice(crate::HETERO_TURN_MARKS);
        }
        if self.siblings_decline_across_ranks() {
            marks.extend_from_slice(crate::HETERO_DECLINE_MARKS);
        }
        // Ranks misname themselves in push answers only: a world that only pulls has none.
        if self.misnames() && self.mode.pushes() {
            marks.extend_from_slice(MISNAME_MARKS);
        }
        marks
    }

    /// Whether multi-rank requests read their second turn back across the pair: the world
    /// then has D's rank 1 as a node of its own ([`WorldConfig::multi_rank_turns`]).
    pub fn reads_turns_back_across_ranks(&self) -> bool {
        !self.explore
            && self.multi_rank_turns
            && self.multi_source > 0.0
            && self.mode.second_turn_share() > 0.0
    }

    /// Whether siblings decline multi-rank pulls (the drawn sibling declines of pulled
    /// multi-rank requests are kept, [`WorldConfig::multi_rank_turns`]).
    pub fn siblings_decline_across_ranks(&self) -> bool {
        !self.explore
            && self.multi_rank_turns
            && self.multi_source > 0.0
            && self.mode.pull_share() > 0.0
    }

    /// Whether a hostile peer floods P with made-up keys (seeded mode only).
    pub fn floods(&self) -> bool {
        !self.explore && self.flood_peer
    }

    /// Whether P ranks may name another rank in their answers (seeded mode, several P ranks).
    pub fn misnames(&self) -> bool {
        !self.explore && self.misname_rank > 0.0 && self.prefill_ranks > 1
    }

    /// A small world for the ordering fuzz and the exhaustive check: 1 P, 1 D, short
    /// deadlines and slow heartbeats, so that few timer steps reach every deadline.
    pub fn small(requests: usize, max_crashes: u32, mutation: Option<Mutation>) -> WorldConfig {
        let ms = Duration::from_millis;
        let machine = Config {
            lease_duration: ms(3_000),
            lease_extension: ms(2_000),
            heartbeat_interval: ms(1_000),
            peer_timeout: ms(1_500),
            connect_timeout: ms(400),
            decode_deadline: ms(100),
            registration_ttl: ms(200),
            write_timeout: ms(300),
            abandon_timeout: ms(100),
            max_write_life: ms(500),
            max_message_delay: ms(100),
            cancel_retry_interval: ms(50),
            max_cancel_retries: 1,
            // Registration resends would multiply the timer orderings; the seeded sweeps
            // cover them.
            max_register_retries: 0,
            // Above the fence floor, which counts a message waiting a peer timeout in a
            // stopped receiver's queue.
            quarantine: ms(3_500),
            tombstone_ttl: ms(3_000),
            ..Config::default()
        };
        WorldConfig {
            requests,
            decode_engines: 1,
            prefill_ranks: 1,
            multi_source: 0.0,
            multi_rank_turns: false,
            layerwise: 0.0,
            layer_compute_us: (100, 3_000),
            abort_mid_layers: 0.0,
            faults: Faults::Chaos,
            machine,
            explore: true,
            max_crashes,
            pool_blocks: 4,
            span: Duration::ZERO,
            dup_control: false,
            mutation,
            poll_allocations: false,
            slow_message_max: Duration::from_millis(140),
            mode: crate::Mode::Push,
            stalls: 0.0,
            stall_freeze: 0.0,
            stall_messages_first: 0.0,
            stall_past_allowance: false,
            swarm: false,
            one_key_across_turns: false,
            stall_prefill: false,
            flood_peer: false,
            misname_rank: 0.0,
            stall_after_post: 0.0,
            late_register: 0.0,
            late_grant: 0.0,
            late_register_copies: 0.0,
            early_answers: 0.0,
            late_siblings: 0.0,
            orphaned_registrations: 0.0,
            stall_mid_layers: 0.0,
            stall_pending_registration: 0.0,
            late_completions: true,
        }
    }
}
