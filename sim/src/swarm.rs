//! Swarm testing: each seed draws its own configuration, so that states one fixed configuration
//! makes rare are common in some seeds of any 300.
//!
//! One configuration cannot reach every defence: the machines' guards are layered. With the
//! fast configuration's 150 ms peer timeout, any stall long enough to lapse a lease or outlive a
//! grant fence first makes the stalled process's peers look dead, and the overdue-peer guard
//! refuses what the deeper guards (the lease check, the stale-grant check, the late-read check)
//! would have refused; a bug in one of those is then invisible. Real deployments set the peer
//! timeout where they like, so the swarm draws timing profiles in which each threshold is
//! crossed alone: peer timeouts past the lease extension and the read span. (A profile with the
//! peer timeout past D's deadline plus its quarantine found that the fence floor must count a
//! peer timeout, `Config::max_handling_delay`; such a configuration is now refused.) Likewise
//! small tombstone tables, registration resends, stall counts, which stalls freeze transfers,
//! which resumes hand over messages first, stalls aimed at P or right after a post, storms of
//! late messages and retries, hostile peers, routers late to D at P's lease end, readers that
//! handle a grant late and then stop with their reads frozen past the holder's fence, P ranks
//! stopped with a registration pending until D freed its blocks, layer-wise writers stopped
//! between two parts until D freed them, late registration copies in small tables,
//! registrations P holds for a D that gave up while a sibling D heartbeats the key, P
//! engines that answer the router for a pull before their rank has the export, and sibling D
//! engines that register as their key's record ages.
//!
//! The draws come from streams of their own, seeded by the seed alone: a seed's load is drawn
//! as without the swarm, and a seed replays with the same options. [`SimOptions::new`] leaves
//! the swarm off, so every regression seed replays the world it was found in.
//!
//! [`SimOptions::new`]: crate::SimOptions::new

use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::world::Rates;
use crate::{Faults, SimOptions, WorldConfig};

/// Tombstones per side in the swarm's small tables: from a handful (eviction at capacity under
/// any load, budgets of one or two records per peer) to the fixed sweep's small table.
const SMALL_TABLES: std::ops::RangeInclusive<usize> = 6..=24;

/// How each seed's timings relate its peer timeout to the other thresholds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TimingProfile {
    /// The fast configuration: a death is declared before any lease or fence runs out.
    Fast,
    /// A peer timeout of a second: deaths after a few hundred milliseconds of silence are not
    /// declared, short stalls pass unnoticed.
    Second,
    /// A peer timeout past the lease extension and the read span: a stall lapses leases and
    /// outlives grant fences while its peers still look alive.
    PastLeases,
}

/// Draws seed `seed`'s configuration into `cfg` (already built for the seed's load).
pub(crate) fn draw(opts: &SimOptions, seed: u64, cfg: &mut WorldConfig) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x7377_6172_6d5f_6366);
    cfg.swarm = true;
    let profile = match rng.gen_range(0..10) {
        0..=3 => TimingProfile::Fast,
        4..=5 => TimingProfile::Second,
        _ => TimingProfile::PastLeases,
    };
    apply_profile(&mut rng, cfg, profile);
    if rng.gen_ratio(1, 4) {
        cfg.machine.max_tombstones = rng.gen_range(SMALL_TABLES);
    }
    if rng.gen_ratio(1, 4) {
        // Resends multiply late registration copies, which the epoch floor and the tombstones
        // must stop.
        let m = &mut cfg.machine;
        m.max_register_retries = rng.gen_range(0..=6);
        m.register_retry_interval = Duration::from_millis(rng.gen_range(100..=500));
        m.tombstone_ttl = m
            .tombstone_ttl
            .max(m.tombstone_min_life() + m.heartbeat_interval);
    }
    if cfg.stalls > 0.0 {
        cfg.stalls *= [0.5, 1.0, 2.0, 3.0][rng.gen_range(0..4)];
        cfg.stall_freeze = [0.0, cfg.stall_freeze, 1.0][rng.gen_range(0..3)];
        if cfg.stall_messages_first > 0.0 {
            cfg.stall_messages_first = [0.0, cfg.stall_messages_first, 1.0][rng.gen_range(0..3)];
        }
        cfg.stall_prefill = rng.gen_ratio(1, 2);
        if rng.gen_ratio(1, 2) {
            cfg.stall_after_post = 0.05;
        }
    }
    if cfg.faults == Faults::Chaos {
        // Hostile peers: honest simulated ones never test the budgets and checks kept for
        // buggy or forged ones.
        cfg.flood_peer |= rng.gen_ratio(1, 6);
        if cfg.prefill_ranks > 1 && rng.gen_ratio(1, 4) {
            cfg.misname_rank = cfg.misname_rank.max(0.2);
        }
    }
    // Its own stream, so that the draws above stay what they were.
    let mut turns = ChaCha8Rng::seed_from_u64(seed ^ 0x6f6e_655f_6b65_7931);
    cfg.one_key_across_turns = turns.gen_ratio(1, 2);
    // Its own stream too: one seed in three hands every push request over layer-wise, so that
    // partial layer sets meet stalls, cancels and deaths often.
    let mut layers = ChaCha8Rng::seed_from_u64(seed ^ 0x6c61_7965_725f_7331);
    if cfg.layerwise > 0.0 && layers.gen_ratio(1, 3) {
        cfg.layerwise = 1.0;
    }
    if cfg.layerwise > 0.0 && layers.gen_ratio(1, 2) {
        cfg.layer_compute_us = (5_000, 60_000);
    }
    if cfg.layerwise > 0.0 && cfg.faults == Faults::Chaos && layers.gen_ratio(1, 2) {
        cfg.abort_mid_layers = 0.1;
    }
    // The aimed stalls, each on a stream of its own, one eligible stalling seed in three:
    // P stopped between two layer-wise parts until D freed the blocks; routers that hand some
    // pushed requests to D about when P's lease ends, each met by a stall of P across that end;
    // P stopped with a registration pending until D freed; readers that handle a grant late and
    // then stop with their reads frozen past the holder's fence.
    let stalls_and_pushes = cfg.may_stall() && cfg.mode.pushes();
    let first = cfg.stall_messages_first > 0.0;
    if stalls_and_pushes && cfg.layerwise > 0.0 && one_in(seed, 0x6d69_645f_7374_6c31, 3) {
        cfg.stall_mid_layers = 0.2;
    }
    if stalls_and_pushes && one_in(seed, 0x6c61_7465_5f72_6567, 3) {
        cfg.late_register = 0.2;
    }
    if stalls_and_pushes && first && one_in(seed, 0x7065_6e64_5f73_746c, 3) {
        cfg.stall_pending_registration = 0.3;
    }
    if cfg.may_stall() && cfg.mode.reads() && first && one_in(seed, 0x6c61_7465_5f67_6e74, 3) {
        cfg.late_grant = 0.3;
    }
    // Late registration copies meet every small table (whose admission control keeps a young
    // record of each ended key), shrunk further on a stream of its own.
    let small_table = cfg.machine.max_tombstones <= *SMALL_TABLES.end();
    let chaos_pushes = cfg.faults == Faults::Chaos && cfg.mode.pushes();
    if chaos_pushes && small_table {
        cfg.late_register_copies = 0.6;
        let mut table = ChaCha8Rng::seed_from_u64(seed ^ 0x7461_626c_655f_6370);
        cfg.machine.max_tombstones = cfg.machine.max_tombstones.min(table.gen_range(6..=12));
    } else if chaos_pushes && one_in(seed, 0x6c61_7465_5f63_6f70, 2) {
        // ...and half the other chaos pushing seeds: with roomy tables an old attempt's copy
        // meets a record written long ago (a sibling D's, a stalled D's late resend), and a
        // copy past the epoch floor's record is what `skip_epoch_floor` needs.
        cfg.late_register_copies = 0.3;
    }
    // P engines that answer the router before their rank has the export (vLLM's), for half
    // the single-source pulls of one reading seed in two, on a stream of its own.
    if cfg.mode.reads() && one_in(seed, 0x6561_726c_795f_616e, 2) {
        cfg.early_answers = 0.5;
    }
    // Orphaned registrations with a sibling heartbeating the key, one chaos pushing seed in
    // two, on a stream of its own.
    if chaos_pushes && cfg.decode_engines >= 2 && one_in(seed, 0x6f72_7068_616e_7377, 2) {
        cfg.orphaned_registrations = 0.5;
    }
    // Late siblings, their registrations copied late, where the tables have room (a full
    // table leaves a registration it has no record for unanswered), with two D engines.
    if chaos_pushes && cfg.decode_engines >= 2 && cfg.machine.max_tombstones > *SMALL_TABLES.end() {
        cfg.late_siblings = 1.0;
    }
    debug_assert!(opts.faults == cfg.faults);
    if let Err(e) = cfg.machine.validate() {
        // The profiles are built to be valid: a refusal is a bug of this module.
        panic!("swarm drew an invalid configuration for seed {seed}: {e}");
    }
}

/// One draw in `n` from seed `seed`'s stream `salt`: a stream per draw, so that adding one
/// leaves the seed's other draws what they were.
fn one_in(seed: u64, salt: u64, n: u32) -> bool {
    ChaCha8Rng::seed_from_u64(seed ^ salt).gen_ratio(1, n)
}

/// Moves the heartbeat and peer timeout of `cfg` to `profile`, keeping every bound valid.
fn apply_profile(rng: &mut ChaCha8Rng, cfg: &mut WorldConfig, profile: TimingProfile) {
    let ms = Duration::from_millis;
    let m = &mut cfg.machine;
    let heartbeat = match profile {
        TimingProfile::Fast => return,
        TimingProfile::Second => ms(250),
        TimingProfile::PastLeases => ms(500),
    };
    m.heartbeat_interval = heartbeat;
    m.lease_extension = m.lease_extension.max(m.heartbeat_interval * 2);
    m.lease_duration = m.lease_duration.max(m.lease_extension);
    m.peer_timeout = match profile {
        TimingProfile::Fast | TimingProfile::Second => ms(1_000),
        TimingProfile::PastLeases => {
            let floor = m
                .lease_extension
                .max(kvhandoff_protocol::machine::read_span(m));
            floor + ms(rng.gen_range(300..=2_500))
        }
    };
    // The fence floor and the tombstones' minimum life count a message waiting a peer timeout
    // in a stopped receiver's queue: the quarantine and the tombstones move with it, a
    // heartbeat to spare.
    m.quarantine = m.quarantine.max(m.fence_floor() + m.heartbeat_interval);
    m.tombstone_ttl = m
        .tombstone_ttl
        .max(m.tombstone_min_life() + m.heartbeat_interval);
}

/// Seed `seed`'s fault rates beyond the fixed sweep's picks (chaos only): one seed in two
/// runs a storm of late messages — many slow messages, many copies, most failed requests
/// retried with a new epoch — where answers of an old attempt meet the new one.
pub(crate) fn draw_rates(seed: u64, faults: Faults, rates: &mut Rates) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x7377_6172_6d5f_7274);
    if faults == Faults::Chaos && rng.gen_ratio(1, 2) {
        rates.slow_msg = rates.slow_msg.max(0.2);
        rates.dup = rates.dup.max(0.1);
        rates.retry = rates.retry.max(0.9);
    }
    // Its own stream, so that the draws above stay what they were.
    let mut router = ChaCha8Rng::seed_from_u64(seed ^ 0x726f_7574_6572_5f31);
    if faults == Faults::Chaos && router.gen_ratio(1, 2) {
        rates.router_retry = 0.8;
    }
    // Its own stream too: in a storm of retries, completions that take the slowest a message
    // may take meet the attempt that replaced theirs (often enough that every day's 300 seeds
    // of `swarm-check.sh` catch `accept_stale_write_done`: with half the storms and half the
    // completions, one range in thirty missed it).
    let mut late = ChaCha8Rng::seed_from_u64(seed ^ 0x6c61_7465_5f77_6431);
    if faults == Faults::Chaos && rates.retry >= 0.9 && late.gen_ratio(3, 4) {
        rates.slow_write_done = 0.9;
    }
}
