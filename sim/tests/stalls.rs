//! Process stalls in the seeded world (issue 19): chaos worlds in which processes stop for up
//! to past the quarantine and resume (timers first, then what they held); and the swarm's
//! aimed draws, each with a seed that reaches its precondition and catches its mutation.

use kvhandoff_sim::{
    run_seeds, run_world, seed_world, Faults, Mode, Mutation, SimOptions, WorldConfig,
    DEFAULT_LAYERWISE, DEFAULT_STALLS, DEFAULT_STALL_FREEZE, DEFAULT_STALL_MESSAGES_FIRST,
    STALL_MARKS,
};

fn stalling(seeds: std::ops::Range<u64>, mode: Mode, freeze: f64) -> SimOptions {
    SimOptions {
        mode,
        stalls: DEFAULT_STALLS,
        stall_freeze: freeze,
        ..SimOptions::new(seeds, 40, Faults::Chaos)
    }
}

/// What `kvhandoff sim` runs by default: half the stalls freeze the stalled process's transfers
/// (writes only within the stall allowance, the deployment requirement; reads for any stall).
fn default_stalling(seeds: std::ops::Range<u64>, mode: Mode) -> SimOptions {
    stalling(seeds, mode, DEFAULT_STALL_FREEZE)
}

/// Stalls happen, reach their marks, and a stalling sweep replays bit for bit; a world without
/// stalls draws none (its other faults are drawn as before: stalls come from a stream of their
/// own).
#[test]
fn stalls_hit_their_marks_and_replay() {
    let options = default_stalling(0..60, Mode::Mixed);
    let report = run_seeds(&options);
    assert!(report.counters["stalls"] > 20, "{:?}", report.counters);
    assert!(report.counters["transfers_frozen_by_stall"] > 0);
    for mark in STALL_MARKS {
        assert!(
            report.coverage.get(*mark).is_some_and(|&n| n > 0),
            "coverage mark {mark} never hit: {:?}",
            report.coverage
        );
    }
    assert_eq!(report, run_seeds(&options));
    let quiet = run_seeds(&SimOptions {
        stalls: 0.0,
        ..options
    });
    assert_eq!(quiet.counters["stalls"], 0);
    assert!(STALL_MARKS.iter().all(|m| !quiet.coverage.contains_key(*m)));
}

/// Found by the first stalling sweep (`kvhandoff sim --mode push --seeds 1..300 --requests 40
/// --stall-freeze 0`): P stopped for 9.9 s with D's `Register(k1 e1)` held; D declared P dead
/// and freed the blocks by its fence at 8.7 s; P resumed (timers first), a late handshake with
/// D completed, P handled the held `Register`, finished the prefill of k1 and wrote into the
/// freed block (S1). Seeds 52 and 89 show the same hole earlier: D's fence frees while P holds
/// the registration it took from the queue.
#[test]
fn seed_245_a_stalled_p_never_writes_a_held_register_into_freed_blocks() {
    let options = stalling(245..246, Mode::Push, 0.0);
    let r = run_world(seed_world(&options, 245), 245);
    // The precondition: a held message handled after a stall past the peer timeout, and a
    // fence free.
    assert!(
        r.coverage["stall_past_peer_timeout"] > 0,
        "{:?}",
        r.coverage
    );
    assert!(r.coverage["stale_message_after_stall"] > 0);
    assert!(r.violations.is_empty(), "{:#?}", r.violations);
    assert_eq!(r.stale_writes, 0);
    assert_eq!(r.leaked_blocks, 0, "{:?}", r.leaks);
}

/// Every mode clean at 300 seeds × 40 requests with the default stalls, the protocol refusing
/// what sat out a stall (at the protocol of issue 19's start, push seeds 52, 89, 245 and 265 and
/// mixed seed 275 failed with transfers that kept moving), and with frozen transfers: reads of
/// any length (pull seeds 25, 70, 71 and more failed before the reader distrusted late reads and
/// kept its blocks for its transport's word), writes within the stall allowance.
#[test]
fn stalling_sweeps_are_clean() {
    for mode in [Mode::Push, Mode::Pull, Mode::Mixed, Mode::Bidir] {
        for freeze in [0.0, DEFAULT_STALL_FREEZE] {
            let report = run_seeds(&stalling(1..301, mode, freeze));
            let first = report
                .violations
                .first()
                .map(|v| format!("seed {}: {}", v.seed, v.message));
            assert!(report.clean(), "{mode:?} freeze {freeze}: {first:?}");
        }
    }
}

/// The requirement the time-based frees rest on, broken on purpose: stalls that freeze a
/// writer's transfers past the stall allowance (quarantine − fence floor). Measured on NIXL
/// (`actors/tests/nixl_stall.rs`), such a write lands after the resume whatever D did, so D's
/// `DeadPeerFence` frees hand out blocks it still lands in — and the checker says so. This is
/// the test that the allowance is a real bound and that the sweeps would see it broken.
#[test]
fn writes_frozen_past_the_stall_allowance_are_caught() {
    let options = SimOptions {
        stall_past_allowance: true,
        ..default_stalling(1..301, Mode::Push)
    };
    let report = run_seeds(&options);
    assert!(
        report.counters["transfers_frozen_by_stall"] > 0,
        "precondition: frozen writes {:?}",
        report.counters
    );
    assert!(
        report
            .violations
            .iter()
            .any(|v| v.message.contains("frozen by their poster's stall")),
        "no frozen write past the allowance was caught: {:?}",
        report.violations.first()
    );
}

/// The machines alone, without the shell's timers-first order (every resume hands over what
/// was held first): every mode still clean, and the overdue-peer guard is what holds — its
/// deliberate bug `accept_from_overdue_peer` is caught.
#[test]
fn the_machines_alone_refuse_what_sat_out_a_stall() {
    let machines_alone = |mode, mutation| SimOptions {
        stall_messages_first: 1.0,
        mutation,
        ..default_stalling(5000..5300, mode)
    };
    for mode in [Mode::Push, Mode::Mixed] {
        let report = run_seeds(&machines_alone(mode, None));
        assert!(
            report
                .coverage
                .get("stale_message_after_stall")
                .is_some_and(|&n| n > 0),
            "precondition: a held message handled after a stall"
        );
        let first = report
            .violations
            .first()
            .map(|v| (v.seed, v.message.clone()));
        assert!(report.clean(), "{mode:?}: {first:?}");
    }
    let mutated = run_seeds(&machines_alone(
        Mode::Mixed,
        Some(kvhandoff_protocol::machine::Mutation::AcceptFromOverduePeer),
    ));
    assert!(
        !mutated.violations.is_empty(),
        "accept_from_overdue_peer not caught by 300 seeds with the machines alone"
    );
}

/// What `kvhandoff sim --requests 40` runs: mixed, chaos, the default stalls and layer-wise
/// share, each seed's configuration drawn by the swarm.
fn cli_swarm(seeds: std::ops::Range<u64>) -> SimOptions {
    SimOptions {
        mode: Mode::Mixed,
        layerwise: DEFAULT_LAYERWISE,
        stalls: DEFAULT_STALLS,
        stall_messages_first: DEFAULT_STALL_MESSAGES_FIRST,
        swarm: true,
        ..SimOptions::new(seeds, 40, Faults::Chaos)
    }
}

/// A registration that reaches P's held blocks after their lease ended, its timer not run (P
/// stopped across the lease's end with the `Register` queued, the resume handing it over
/// first), is refused; under `write_on_expired_lease` P writes it, and L5 (no write posted
/// after its lease) catches it. Seed 9807601 of the swarm's range 9807580..9807880: a router
/// late to D (`WorldConfig::late_register`) has D's `Register(k0)` reach P at 2.624 s, 503 ms
/// before the lease P took at 0.127 s ends; the aimed stall stops P for 570 ms from there, and
/// the resume hands the registration over before the lease's timer runs.
#[test]
fn seed_9807601_a_registration_after_the_lease_is_refused_and_writing_it_is_caught() {
    // The world as found, before the swarm drew late completions, late grants, stalls
    // between layer-wise parts or with a registration pending, and late registration copies
    // outside the small tables.
    let as_found = |world: &mut WorldConfig| {
        world.late_completions = false;
        world.late_grant = 0.0;
        world.stall_mid_layers = 0.0;
        world.stall_pending_registration = 0.0;
        world.late_register_copies = 0.0;
    };
    // The precondition: the lease check was asked about a registration past the lease; L5 (no
    // write posted after its lease) catches the mutation.
    reached_and_caught(
        9_807_601,
        as_found,
        ("register_after_lease_end", Some("expired_leases_refused")),
        (Mutation::WriteOnExpiredLease, "L5:"),
    );
}

/// Seed `seed` of the swarm (mixed, `world_as_found` applied to its drawn world) reaches `mark`
/// with the defence at work (`counter` > 0, where a counter shows it) and is clean; under `mutation` it reaches the mark
/// too, and a violation starting with `prefix` catches it.
fn reached_and_caught(
    seed: u64,
    world_as_found: impl Fn(&mut WorldConfig),
    mark_and_counter: (&str, Option<&str>),
    mutation_and_prefix: (Mutation, &str),
) {
    let options = cli_swarm(seed..seed + 1);
    reached_and_caught_with(
        options,
        seed,
        world_as_found,
        mark_and_counter,
        mutation_and_prefix,
    );
}

/// [`reached_and_caught`] in a world drawn with `options`.
fn reached_and_caught_with(
    options: SimOptions,
    seed: u64,
    world_as_found: impl Fn(&mut WorldConfig),
    (mark, counter): (&str, Option<&str>),
    (mutation, prefix): (Mutation, &str),
) {
    let run = |options: &SimOptions| {
        let mut world = seed_world(options, seed);
        world_as_found(&mut world);
        run_world(world, seed)
    };
    let reached =
        |report: &kvhandoff_sim::SeedResult| report.coverage.get(mark).is_some_and(|&n| n > 0);
    let clean = run(&options);
    assert!(reached(&clean), "{mark} not reached: {:?}", clean.coverage);
    if let Some(counter) = counter {
        assert!(clean.counters[counter] > 0, "{counter} is 0");
    }
    assert!(clean.violations.is_empty(), "{:#?}", clean.violations);
    assert_eq!(clean.leaked_blocks, 0, "{:?}", clean.leaks);

    let caught = run(&SimOptions {
        mutation: Some(mutation),
        ..options
    });
    assert!(reached(&caught), "{mark} not reached under {mutation:?}");
    assert!(
        caught
            .violations
            .iter()
            .any(|v| v.message.starts_with(prefix)),
        "{mutation:?} not caught: {:#?}",
        caught.violations
    );
}

/// A reader that handles its grant late (near the ask's delivery bound) and stops right after
/// posting, its read frozen past the holder's grant fence, lands what the holder's freed blocks
/// hold (`WorldConfig::late_grant`, drawn by the swarm). Its late-read check distrusts the
/// read's report, which comes after the trust horizon but before the reader's own bound on the
/// read; under `trust_late_reads` the import counts it, and the bytes of a `Loaded` import are
/// not the holder's KV (S7). Seed 27 of the swarm's range 0..300, mixed.
#[test]
fn seed_27_a_read_landed_after_the_holders_fence_is_distrusted_and_trusting_it_is_caught() {
    // The precondition: a frozen read landed after its holder freed the blocks it reads.
    reached_and_caught(
        27,
        |_| {},
        (
            "frozen_read_landed_after_holder_freed",
            Some("late_reads_distrusted"),
        ),
        (Mutation::TrustLateReads, "S7:"),
    );
}

/// P stopped right after posting a part of a layer-wise write with parts still to come, until
/// D gave up on the request and freed its blocks (`WorldConfig::stall_mid_layers`, drawn by the
/// swarm): on the resume its registration has lapsed and no part follows; under
/// `extend_lapsed_registration` the next part lands in blocks D freed (S1). Seed 2 of the
/// swarm's range 0..300, mixed.
#[test]
fn seed_2_no_part_follows_a_stall_past_ds_free_and_posting_one_is_caught() {
    // The precondition: P resumed between two parts after D freed the blocks.
    reached_and_caught(
        2,
        // The world as found, before the swarm drew stalls with a registration pending.
        |world| world.stall_pending_registration = 0.0,
        ("layers_resumed_past_d_free", Some("expired_leases_refused")),
        (Mutation::ExtendLapsedRegistration, "S1:"),
    );
}

/// P stopped right after taking a registration it holds pending (D registered before P's
/// prefill ended), until D gave up on it and freed its blocks, its resume handing the
/// prefill's end over before the timers (`WorldConfig::stall_pending_registration`, drawn by
/// the swarm): P expires the registration before it matches anything; under
/// `match_expired_registration` it matches and writes into blocks D freed (S1). Seed 4 of the
/// swarm's range 0..300, mixed.
#[test]
fn seed_4_a_registration_that_expired_in_a_stall_is_never_matched_and_matching_it_is_caught() {
    // The precondition: P's engine finished a prefill whose registration was pending past its
    // expiry.
    reached_and_caught(
        4,
        |_| {},
        // No counter tells an expired registration's answer from others.
        ("finish_after_pending_registration_expired", None),
        (Mutation::MatchExpiredRegistration, "S1:"),
    );
}

/// A late copy of a registration (`WorldConfig::late_register_copies`, drawn by the swarm with
/// a small tombstone table) reaches P, stopped meanwhile, after its key's request ended on both
/// sides. P's young record of the key refuses it:
/// admission control never evicts a record inside its minimum life, refusing new work instead.
/// Under `evict_young_tombstones` a burst of ends evicts the record, P takes the copy as a
/// pending registration, and the next prefill of the key would be written into blocks D gave
/// back. Seed 25 of the swarm's range 0..300, mixed.
#[test]
fn seed_25_a_late_registration_copy_after_its_key_ended_is_refused_and_evicting_the_young_record_is_caught(
) {
    reached_and_caught(
        25,
        |world| {
            // The precondition: the aimed draw, in a table small enough to fill.
            assert!(world.late_register_copies > 0.0);
            assert!(world.machine.max_tombstones <= 12);
        },
        // No counter tells a refused copy from other refusals.
        ("register_after_decode_ended", None),
        (Mutation::EvictYoungTombstones, "proof: P took request "),
    );
}

/// An orphaned registration with a sibling (`WorldConfig::orphaned_registrations`, drawn by the
/// swarm): D's engine aborts soon after D registered and every cancel D sends for the key is
/// lost, so P keeps the registration pending; a second D engine of the key registers while P
/// holds it (a duplicate) and heartbeats the key for longer than the first D's quarantine less
/// the registration's TTL; P's leg comes after that quarantine. P renews a pending registration
/// only for the D that sent it, so it has expired when the first D frees its blocks; under
/// `ignore_heartbeat_sender` the sibling's heartbeats keep it alive past that free. Seed 1 of
/// the swarm's range 0..300, mixed.
#[test]
fn seed_1_a_siblings_heartbeats_never_keep_an_orphaned_registration_alive_and_letting_them_is_caught(
) {
    reached_and_caught(
        1,
        |world| {
            // The precondition: the aimed draw, with a sibling D engine.
            assert!(world.orphaned_registrations > 0.0);
            assert!(world.decode_engines >= 2);
        },
        // No counter tells a refused renewal from other refusals.
        ("heartbeat_for_anothers_registration", None),
        (
            Mutation::IgnoreHeartbeatSender,
            "proof: request 0 e1 freed by Quarantine while P still holds its registration",
        ),
    );
}

/// A late copy of a registration for an attempt an ended request of its key settled reaches
/// P while a later request of the key holds blocks, outside the small tables
/// (`WorldConfig::late_register_copies`, which the swarm draws for half the chaos pushing
/// worlds with roomy tables too): the key's epoch floor stops it; under `skip_epoch_floor` it
/// reaches the later request's blocks and a write lands where no lease of its attempt is (S1).
/// Seed 46 of the swarm's range 0..300, mixed. Before that draw, `skip_epoch_floor` slipped
/// past the whole day range CI picks on 2026-12-10 (seeds 339100..339400).
#[test]
fn seed_46_a_late_copy_below_the_epoch_floor_is_stopped_and_skipping_the_floor_is_caught() {
    let world = seed_world(&cli_swarm(46..47), 46);
    assert!(
        world.late_register_copies > 0.0 && world.machine.max_tombstones > 24,
        "the precondition: late copies drawn outside the small tables ({}, {})",
        world.late_register_copies,
        world.machine.max_tombstones
    );
    reached_and_caught(
        46,
        // The world as found, before the swarm drew answers ahead of exports.
        |world| world.early_answers = 0.0,
        ("register_after_decode_ended", None),
        (Mutation::SkipEpochFloor, "S1:"),
    );
}

/// A race of an engine answering the router ahead of its rank's call, in seed `seed` of a
/// world drawn with `options`: the world drew the answers ahead (and whatever `drawn` adds,
/// as `what` says), the clean run reaches `mark` with readers asking again, and under
/// `give_up_on_early_refusal` R1 catches the read whose violation starts with `prefix`.
fn answered_ahead_and_giving_up_caught(
    options: SimOptions,
    seed: u64,
    (drawn, what): (fn(&WorldConfig) -> bool, &str),
    mark: &str,
    prefix: &str,
) {
    let world = seed_world(&options, seed);
    assert!(
        world.early_answers > 0.0 && drawn(&world),
        "the precondition: answers ahead of exports drawn{what}"
    );
    reached_and_caught_with(
        options,
        seed,
        |_| {},
        (mark, Some("reads_asked_again")),
        (Mutation::GiveUpOnEarlyRefusal, prefix),
    );
}

/// P's engine hands the router its answer for a pull before its rank has the export, as
/// vLLM's scheduler does (its worker hands the export over with the next step;
/// `WorldConfig::early_answers`, which the swarm draws for half the reading worlds): D's first
/// ask finds nothing under the key, and the reader asks again soon, inside its retry window,
/// until the export is there. Under `give_up_on_early_refusal` it fails at that first refusal
/// and R1 catches it. Seed 0 of the swarm's range 0..300, mixed. The race was first seen
/// through a real vLLM in pull mode (`docs/testing.md`).
#[test]
fn seed_0_a_read_asked_before_its_export_is_filed_asks_again_and_giving_up_is_caught() {
    answered_ahead_and_giving_up_caught(
        cli_swarm(0..1),
        0,
        (|_| true, ""),
        "read_asked_before_export",
        "R1:",
    );
}

/// The answer ahead must be the call's own: when P's rank makes the call, its reply must be
/// what the router already has (bar the expiry). Under `answer_ahead_without_address` the
/// answer ahead leaves out where the holder listens, and that check catches it. Seed 0 of the
/// swarm's range 0..300, mixed.
#[test]
fn seed_0_an_answer_ahead_without_the_holders_address_is_caught() {
    let world = seed_world(&cli_swarm(0..1), 0);
    assert!(
        world.early_answers > 0.0,
        "the precondition: answers ahead of exports drawn"
    );
    reached_and_caught(
        0,
        |_| {},
        ("export_answered_early", None),
        (Mutation::AnswerAheadWithoutAddress, "the rank answered "),
    );
}

/// The race above in a multi-rank pull: P's engine answers the router with rank 0's answer
/// and each P rank's worker hands its rank its share later, so a D rank asks a P rank that has
/// nothing under the pair's key yet; the part's reader asks again inside its retry window.
/// Under `give_up_on_early_refusal` that part fails at the first refusal and R1 catches it on
/// the part (`p26a1#p0d0`, P rank 0's share for D rank 0). Seed 18 of the swarm's range
/// 0..300, mixed.
#[test]
fn seed_18_a_part_asked_before_its_p_ranks_share_is_filed_asks_again_and_giving_up_is_caught() {
    answered_ahead_and_giving_up_caught(
        cli_swarm(18..19),
        18,
        (|w| w.multi_source > 0.0, ", with multi-rank requests"),
        "part_asked_before_export",
        "R1: reader 1 gave up on p26a1#p0d0 ",
    );
}

/// The race above in a second turn: D's engine answers the router's `keep_for_next_turn`
/// when the request ends and its worker hands the rank the kept blocks later, so P's read of
/// the next turn asks D before D's rank holds the keep; the reader asks again inside its retry
/// window. Under `give_up_on_early_refusal` the turn's read fails at the first refusal and R1
/// catches it (`x35a1`, request 35's keep). Seed 98 of the swarm's range 0..300, mixed.
#[test]
fn seed_98_a_turn_read_asked_before_ds_keep_is_filed_asks_again_and_giving_up_is_caught() {
    answered_ahead_and_giving_up_caught(
        cli_swarm(98..99),
        98,
        (|_| true, ""),
        "turn_asked_before_keep",
        "R1: reader 0 gave up on x35a1 ",
    );
}

/// The race above in a multi-rank request's second turn: D's engine answers the router's
/// `keep_for_next_turn` with its first rank's answer and each D rank's worker hands its rank
/// its share later, so a P rank reading the turn back asks a D rank that holds nothing under
/// the pair's key yet; the part's reader asks again. Under `give_up_on_early_refusal` the part
/// fails at the first refusal and R1 catches it (`x26a1#p0d3`, D rank 3's share of request
/// 26's keep). Seed 293 of the swarm's range 0..300, mixed, with multi-rank second turns (the
/// CLI's default).
#[test]
fn seed_293_a_turn_part_asked_before_its_d_ranks_keep_asks_again_and_giving_up_is_caught() {
    let options = SimOptions {
        multi_rank_turns: true,
        ..cli_swarm(293..294)
    };
    answered_ahead_and_giving_up_caught(
        options,
        293,
        (
            |w| w.multi_source > 0.0 && w.multi_rank_turns,
            ", with multi-rank second turns",
        ),
        "turn_part_asked_before_keep",
        "R1: reader 5 gave up on x26a1#p0d3 ",
    );
}

/// A sibling D engine of a key (the router sent the decode leg twice) starts registering as
/// P's record of the key's ended request ages (`WorldConfig::late_siblings`, which the swarm
/// draws where registrations get late copies and the tables have room): the record answers
/// its registration and is written again, so that it outlives the registration's late copies;
/// under `skip_record_refresh` the record expires first, a late copy becomes a pending
/// registration for blocks the sibling gave back, and the checker's question to P after a
/// registration of an ended attempt catches it. Seed 3 of the swarm's range 0..300, mixed.
/// Before the draw, the refresh was reached by one world (push seed 689) of the ranges tried.
#[test]
fn seed_3_a_late_siblings_copy_meets_the_record_written_again_and_skipping_that_is_caught() {
    let world = seed_world(&cli_swarm(3..4), 3);
    assert!(
        world.late_siblings > 0.0 && world.machine.max_tombstones > 24,
        "the precondition: late siblings drawn, in a table with room ({}, {})",
        world.late_siblings,
        world.machine.max_tombstones
    );
    reached_and_caught(
        3,
        |_| {},
        ("sibling_copy_past_record", None),
        (Mutation::SkipRecordRefresh, "proof: P took request "),
    );
}
