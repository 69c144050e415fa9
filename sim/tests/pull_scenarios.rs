//! Pull mode and bidirectional turns, end to end on real endpoints in the scripted world: our
//! terms for the applicable cases of vLLM's pull and bidirectional tests (reference §10.3,
//! §11), and the cases vLLM leaves open. The ghost checks every read at both ends: the holder
//! never hands its blocks back while a read of them may run, the reader never while a read may
//! land in its own.

use std::time::Duration;

use kvhandoff_protocol::machine::{
    Config, EndpointCall, ExportEnd, ExportOutcome, ImportFailure, ImportOutcome,
    LoadFailurePolicy, ReadProof, Time,
};
use kvhandoff_protocol::{Epoch, Message, ReadRefusal, ReleaseReason};
use kvhandoff_sim::scripted::*;

const LEASE: Duration = Duration::from_millis(3_000);

fn is_ask(m: &Message) -> bool {
    matches!(m, Message::ReadAsk(_))
}

fn is_release(m: &Message, reason: ReleaseReason) -> bool {
    matches!(m, Message::Release(r) if r.reason == reason)
}

fn export_results(
    h: &Harness,
    addr: &kvhandoff_protocol::PeerAddr,
) -> Vec<(ExportOutcome, ReadProof)> {
    h.events_of(addr).iter().map(export_result).collect()
}

fn import_results(h: &Harness, addr: &kvhandoff_protocol::PeerAddr) -> Vec<ImportOutcome> {
    h.events_of(addr).iter().map(import_result).collect()
}

/// P exported request 1's [10, 11]; D imports them into [500, 501]: the read is posted.
fn reading() -> Harness {
    let mut h = Harness::new();
    h.export(&p_addr(), export_start(1, &[10, 11], LEASE))
        .unwrap();
    h.import(&d_addr(), import_start(1, &[500, 501], &[10, 11]))
        .unwrap();
    assert_eq!(h.reads.len(), 1, "D asked, P granted, D posted its read");
    h
}

// ---------------------------------------------------------------------------------------------
// Pull
// ---------------------------------------------------------------------------------------------

// Scenario (§10.3 91, pull read done): D asks, P grants, D reads P's blocks into its own, then
// releases them; P frees on the release, D's blocks hold the KV.
#[test]
fn pull_reads_then_releases() {
    let mut h = reading();
    let order = h.reads[&h.the_read()].order.clone();
    assert_eq!(order.remote, blocks(&[10, 11]));
    assert_eq!(order.local, blocks(&[500, 501]));
    assert!(
        export_results(&h, &p_addr()).is_empty(),
        "P holds its blocks while D reads"
    );
    h.complete_reads();
    assert_eq!(import_results(&h, &d_addr()), vec![ImportOutcome::Loaded]);
    assert_eq!(
        export_results(&h, &p_addr()),
        vec![(ExportOutcome::Read, ReadProof::ReaderReleased)]
    );
    assert_eq!(h.read_landings.len(), 1);
    assert_eq!(h.p().counters().reads_granted, 1);
    h.assert_no_leak();
}

// Scenario (§10.3 106; §9.4.4 closed): D already holds every token: no read, P is told at once.
#[test]
fn full_prefix_hit_releases_p_at_once() {
    let mut h = Harness::new();
    h.export(&p_addr(), export_start(1, &[10, 11], LEASE))
        .unwrap();
    h.import(&d_addr(), import_start(1, &[], &[10, 11]))
        .unwrap();
    assert_eq!(import_results(&h, &d_addr()), vec![ImportOutcome::Loaded]);
    assert_eq!(
        export_results(&h, &p_addr()),
        vec![(
            ExportOutcome::Released(ExportEnd::FullPrefixHit),
            ReadProof::NeverGranted
        )]
    );
    assert!(h.reads_posted.is_empty());
    h.assert_no_leak();
}

// Scenario: D's engine prefers to recompute (the saving is under its threshold): it declines,
// and P lets go at once instead of at its lease's end.
#[test]
fn a_declined_export_is_freed_at_once() {
    let mut h = Harness::new();
    h.export(&p_addr(), export_start(1, &[10, 11], LEASE))
        .unwrap();
    let decline = EndpointCall::DeclineExport {
        key: key(1),
        epoch: Epoch::FIRST,
        holder: p_addr(),
    };
    h.call(&d_addr(), decline).unwrap();
    assert_eq!(
        export_results(&h, &p_addr()),
        vec![(
            ExportOutcome::Released(ExportEnd::Declined),
            ReadProof::NeverGranted
        )]
    );
    assert_eq!(h.now, Time::ZERO);
    h.assert_no_leak();
}

// Scenario (mark read_racing_ttl_expiry): D's ask is on the way when P's lease ends (D's
// heartbeats had not named the key yet): P lets go at the lease's end (nothing was granted, so
// nothing can be reading), and the late ask is refused as expired; with policy Recompute, D
// recomputes everything.
#[test]
fn an_ask_that_loses_the_race_with_the_lease_is_refused() {
    let mut h = Harness::new();
    h.export(&p_addr(), export_start(1, &[10, 11], LEASE))
        .unwrap();
    h.advance_to(at(LEASE - ms(20)));
    h.set_filter(|e| {
        if is_ask(&e.message) {
            Rule::Hold
        } else {
            Rule::Deliver
        }
    });
    let mut start = import_start(1, &[500, 501], &[10, 11]);
    start.policy = LoadFailurePolicy::Recompute;
    h.import(&d_addr(), start).unwrap();
    h.advance_to(at(LEASE + ms(10)));
    assert_eq!(
        export_results(&h, &p_addr()),
        vec![(
            ExportOutcome::Released(ExportEnd::LeaseExpired),
            ReadProof::NeverGranted
        )]
    );
    h.clear_filter();
    assert!(h.deliver_held_where(|e| is_ask(&e.message)).is_some());
    assert_eq!(
        import_results(&h, &d_addr()),
        vec![ImportOutcome::Recompute {
            valid_tokens: 0,
            failure: ImportFailure::Refused(ReadRefusal::Expired)
        }]
    );
    h.drop_held_where(|_| true);
    h.assert_no_leak();
}

// Scenario (mark pull_read_after_lease_renewal): D's first asks are lost; its heartbeats name
// the key while it waits, so P's lease is renewed past its first end, and a later ask is
// granted and read.
#[test]
fn heartbeats_renew_the_export_while_the_reader_waits() {
    let config = Config {
        max_register_retries: 20,
        register_retry_interval: ms(1_000),
        tombstone_ttl: ms(30_000),
        decode_deadline: ms(20_000),
        ..Config::fast()
    };
    let mut h = Harness::with_config(config);
    h.export(&p_addr(), export_start(1, &[10, 11], ms(5_000)))
        .unwrap();
    h.set_filter(|e| {
        if is_ask(&e.message) {
            Rule::Drop
        } else {
            Rule::Deliver
        }
    });
    h.import(&d_addr(), import_start(1, &[500, 501], &[10, 11]))
        .unwrap();
    h.advance_to(at(ms(5_500)));
    assert!(
        export_results(&h, &p_addr()).is_empty(),
        "renewed past the lease"
    );
    assert!(h.p().counters().exports_renewed > 0);
    h.clear_filter();
    h.advance(ms(1_000));
    assert_eq!(
        h.reads.len(),
        1,
        "a resent ask was granted after the renewal"
    );
    h.complete_reads();
    assert_eq!(import_results(&h, &d_addr()), vec![ImportOutcome::Loaded]);
    h.assert_no_leak();
}

// Scenario: renewals never take an export past its hard end (twice the lease): a reader that
// never manages to ask does not hold P's blocks forever.
#[test]
fn renewals_stop_at_the_hard_end() {
    let config = Config {
        max_register_retries: 100,
        register_retry_interval: ms(300),
        decode_deadline: ms(60_000),
        tombstone_ttl: ms(40_000),
        ..Config::fast()
    };
    let mut h = Harness::with_config(config);
    h.export(&p_addr(), export_start(1, &[10, 11], LEASE))
        .unwrap();
    h.set_filter(|e| {
        if is_ask(&e.message) {
            Rule::Drop
        } else {
            Rule::Deliver
        }
    });
    h.import(&d_addr(), import_start(1, &[500, 501], &[10, 11]))
        .unwrap();
    h.advance_to(at(LEASE * 2));
    assert_eq!(
        export_results(&h, &p_addr()),
        vec![(
            ExportOutcome::Released(ExportEnd::LeaseExpired),
            ReadProof::NeverGranted
        )]
    );
    h.clear_filter();
    h.abort(&d_addr(), d_request(1)).unwrap();
    h.assert_no_leak();
}

// Scenario (holder side of the expiry gate): D's asks are lost until late in P's lease (its
// heartbeats keep renewing it, up to the renewal cap); an ask gets through just before the cap
// and is granted, but the grant is lost; D's next ask comes after the cap, when a grant could
// outlive the export's hard end: refused before anything starts. P keeps its blocks until the
// first grant's fence, then they are back, before the hard end.
#[test]
fn a_grant_that_could_outlive_the_export_is_refused() {
    let config = Config {
        max_register_retries: 20,
        register_retry_interval: ms(700),
        tombstone_ttl: ms(30_000),
        decode_deadline: ms(20_000),
        ..Config::fast()
    };
    let mut h = Harness::with_config(config);
    h.export(&p_addr(), export_start(1, &[10, 11], LEASE))
        .unwrap();
    h.set_filter(|e| {
        if is_ask(&e.message) {
            Rule::Drop
        } else {
            Rule::Deliver
        }
    });
    h.import(&d_addr(), import_start(1, &[500, 501], &[10, 11]))
        .unwrap();
    // Renewal cap 6 s, hard end 9 s; D asks every 700 ms: at 5.6 s, then at 6.3 s.
    h.advance_to(at(ms(5_500)));
    assert!(
        export_results(&h, &p_addr()).is_empty(),
        "renewed while D waits"
    );
    h.set_filter(|e| {
        if matches!(e.message, Message::ReadGrant(_)) {
            Rule::Drop
        } else {
            Rule::Deliver
        }
    });
    h.advance_to(at(ms(6_000)));
    assert_eq!(
        h.p().counters().reads_granted,
        1,
        "the ask at 5.6 s was granted"
    );
    h.advance_to(at(ms(6_400)));
    assert_eq!(
        import_results(&h, &d_addr()),
        vec![ImportOutcome::Failed(ImportFailure::Refused(
            ReadRefusal::NearExpiry
        ))]
    );
    assert_eq!(h.p().counters().reads_declined_near_expiry, 1);
    assert!(h.reads_posted.is_empty());
    h.clear_filter();
    let span = h.p().config().max_message_delay + h.p().config().max_write_life;
    h.advance_to(at(ms(5_600) + span));
    assert_eq!(
        export_results(&h, &p_addr()),
        vec![(
            ExportOutcome::Released(ExportEnd::GrantFenced),
            ReadProof::GrantFence
        )]
    );
    assert!(h.now <= at(LEASE * 2 + span), "back before the hard end");
    h.assert_no_leak();
}

// Scenario (reader side of the same gate; §10.3 105): the exported expiry is known and too
// near: the reader declines before asking and the holder lets go at once.
#[test]
fn the_reader_declines_a_read_too_near_the_expiry() {
    let mut h = Harness::new();
    h.export(&p_addr(), export_start(1, &[10, 11], LEASE))
        .unwrap();
    let mut start = import_start(1, &[500, 501], &[10, 11]);
    // A read's span is 3 s: an export that ends in 2 s is too near.
    start.expires = Some(at(ms(2_000)));
    start.policy = LoadFailurePolicy::Recompute;
    h.import(&d_addr(), start).unwrap();
    assert_eq!(
        import_results(&h, &d_addr()),
        vec![ImportOutcome::Recompute {
            valid_tokens: 0,
            failure: ImportFailure::DeclinedNearExpiry
        }]
    );
    assert_eq!(h.count_sent(&d_addr(), is_ask), 0);
    assert_eq!(
        export_results(&h, &p_addr()),
        vec![(
            ExportOutcome::Released(ExportEnd::Declined),
            ReadProof::NeverGranted
        )]
    );
    h.assert_no_leak();
}

// Scenario (mark load_failure_recompute): six blocks read in three reads of two; the second
// read fails: D recomputes from its first block (token 32), and releases P only once the third
// read has ended too.
#[test]
fn a_failed_read_recomputes_from_the_first_missing_block() {
    let config = Config {
        read_chunk_blocks: 2,
        ..Config::fast()
    };
    let mut h = Harness::with_config(config);
    let remote = [10, 11, 12, 13, 14, 15];
    h.export(&p_addr(), export_start(1, &remote, LEASE))
        .unwrap();
    let mut start = import_start(1, &[500, 501, 502, 503, 504, 505], &remote);
    start.policy = LoadFailurePolicy::Recompute;
    h.import(&d_addr(), start).unwrap();
    let reads = h.pending_reads();
    assert_eq!(reads.len(), 3);
    h.complete_read(&reads[0]);
    h.fail_read(&reads[1]);
    assert!(
        import_results(&h, &d_addr()).is_empty(),
        "the third read may still land"
    );
    assert_eq!(
        h.count_sent(&d_addr(), |m| matches!(m, Message::Release(_))),
        0
    );
    h.complete_read(&reads[2]);
    assert_eq!(
        import_results(&h, &d_addr()),
        vec![ImportOutcome::Recompute {
            valid_tokens: 32,
            failure: ImportFailure::ReadFailed
        }]
    );
    assert_eq!(
        export_results(&h, &p_addr()),
        vec![(
            ExportOutcome::Released(ExportEnd::ReaderFailed),
            ReadProof::ReaderReleased
        )]
    );
    assert_eq!(h.d().counters().reads_failed, 1);
    h.assert_no_leak();
}

// Scenario (§9.1, policy fail): the read fails and the request fails.
#[test]
fn a_failed_read_fails_the_request_under_policy_fail() {
    let mut h = reading();
    let r = h.the_read();
    h.fail_read(&r);
    assert_eq!(
        import_results(&h, &d_addr()),
        vec![ImportOutcome::Failed(ImportFailure::ReadFailed)]
    );
    assert_eq!(
        h.count_sent(&d_addr(), |m| is_release(m, ReleaseReason::ReadFailed)),
        1
    );
    h.assert_no_leak();
}

// Scenario: the holder's engine aborts while D reads: P keeps the blocks until D's release
// (its reads end), and reports the abort then.
#[test]
fn a_holder_abort_waits_for_the_reader() {
    let mut h = reading();
    h.abort(&p_addr(), p_request(1)).unwrap();
    assert!(
        export_results(&h, &p_addr()).is_empty(),
        "D is reading P's blocks"
    );
    h.complete_reads();
    assert_eq!(import_results(&h, &d_addr()), vec![ImportOutcome::Loaded]);
    assert_eq!(
        export_results(&h, &p_addr()),
        vec![(
            ExportOutcome::Released(ExportEnd::Aborted),
            ReadProof::ReaderReleased
        )]
    );
    h.assert_no_leak();
}

// Scenario: D aborts while its read runs: it waits for the read to end before releasing P and
// handing its own blocks back.
#[test]
fn a_reader_abort_waits_for_its_reads() {
    let mut h = reading();
    h.abort(&d_addr(), d_request(1)).unwrap();
    assert!(
        import_results(&h, &d_addr()).is_empty(),
        "the read may still land"
    );
    h.complete_reads();
    assert_eq!(
        import_results(&h, &d_addr()),
        vec![ImportOutcome::Failed(ImportFailure::Aborted)]
    );
    assert_eq!(export_results(&h, &p_addr()).len(), 1);
    h.assert_no_leak();
}

// Scenario: D gives up while its ask is on the way, and P's grant arrives after D ended: D
// answers the stale grant with a release (it read nothing under it), so P frees at once.
#[test]
fn a_grant_that_arrives_after_the_reader_gave_up_is_released() {
    let mut h = Harness::new();
    h.export(&p_addr(), export_start(1, &[10, 11], LEASE))
        .unwrap();
    h.set_filter(|e| {
        if matches!(e.message, Message::ReadGrant(_)) {
            Rule::Hold
        } else {
            Rule::Deliver
        }
    });
    h.import(&d_addr(), import_start(1, &[500, 501], &[10, 11]))
        .unwrap();
    h.abort(&d_addr(), d_request(1)).unwrap();
    assert_eq!(
        import_results(&h, &d_addr()),
        vec![ImportOutcome::Failed(ImportFailure::Aborted)]
    );
    h.clear_filter();
    h.deliver_all_held();
    assert_eq!(
        export_results(&h, &p_addr()),
        vec![(
            ExportOutcome::Released(ExportEnd::ReaderAborted),
            ReadProof::ReaderReleased
        )]
    );
    assert!(h.reads_posted.is_empty());
    h.assert_no_leak();
}

// Scenario: D's release is lost: P keeps the blocks until the grant's fence (no read posted
// under the grant can run past it), then frees them with that deadline as its proof.
#[test]
fn a_lost_release_is_covered_by_the_grant_fence() {
    let mut h = reading();
    h.set_filter(|e| {
        if matches!(e.message, Message::Release(_)) {
            Rule::Drop
        } else {
            Rule::Deliver
        }
    });
    h.complete_reads();
    assert_eq!(import_results(&h, &d_addr()), vec![ImportOutcome::Loaded]);
    let config = h.p().config().clone();
    let span = config.max_message_delay + config.max_write_life;
    h.advance_to(at(span - ms(1)));
    assert!(export_results(&h, &p_addr()).is_empty());
    h.advance_to(at(span));
    assert_eq!(
        export_results(&h, &p_addr()),
        vec![(
            ExportOutcome::Released(ExportEnd::GrantFenced),
            ReadProof::GrantFence
        )]
    );
    assert_eq!(h.p().counters().grant_fence_frees, 1);
    h.assert_no_leak();
}

// ---------------------------------------------------------------------------------------------
// Kill tests
// ---------------------------------------------------------------------------------------------

// Scenario: P is killed mid-read: the read from the dead agent fails, D's request ends at once
// (well within two heartbeats) and no read can land in its blocks afterwards.
#[test]
fn p_killed_mid_read() {
    let mut h = reading();
    h.advance(ms(10));
    h.crash(&p_addr());
    let config = h.d().config().clone();
    assert!(h.reads.is_empty(), "the read from the dead P failed");
    let results = import_results(&h, &d_addr());
    assert_eq!(
        results,
        vec![ImportOutcome::Failed(ImportFailure::ReadFailed)]
    );
    let ended = h.event_time(&d_addr(), &d_request(1)).unwrap();
    assert!(ended <= at(ms(10)) + config.heartbeat_interval * 2);
    h.advance(config.peer_timeout + config.heartbeat_interval);
    assert_eq!(h.d().counters().peers_declared_dead, 1);
    h.assert_no_leak();
}

// Scenario: D is killed holding a grant (pull): its reads vanish with it; P cannot know
// whether one still runs, so it keeps the blocks until the grant's fence, then frees them.
#[test]
fn d_killed_holding_a_grant() {
    let mut h = reading();
    h.crash(&d_addr());
    let config = h.p().config().clone();
    h.advance(config.peer_timeout + config.heartbeat_interval);
    assert_eq!(h.p().counters().peers_declared_dead, 1, "P saw D die");
    let fence = at(config.max_message_delay + config.max_write_life);
    assert!(export_results(&h, &p_addr()).is_empty());
    h.advance_to(fence);
    assert_eq!(
        export_results(&h, &p_addr()),
        vec![(
            ExportOutcome::Released(ExportEnd::GrantFenced),
            ReadProof::GrantFence
        )]
    );
    h.assert_no_leak();
}

// ---------------------------------------------------------------------------------------------
// Bidirectional
// ---------------------------------------------------------------------------------------------

/// D keeps request 1's turn-1 blocks [500, 501] for the next turn (TTL 480 s), exported under
/// D's id; P's turn-2 request reads them into [20, 21].
fn turn_two() -> Harness {
    let mut h = Harness::new();
    let mut export = export_start(1, &[500, 501], Duration::from_secs(480));
    export.request = d_request(1);
    h.export(&d_addr(), export).unwrap();
    h
}

fn turn_two_import() -> kvhandoff_protocol::machine::ImportStart {
    let mut start = import_start(1, &[20, 21], &[500, 501]);
    start.request = p_request(1);
    start.holder = d_addr();
    start
}

// Scenario (§10.3 81, 91, 92): turn 2 reads turn 1's KV back from D; D frees on P's release.
#[test]
fn turn_two_reads_from_decode() {
    let mut h = turn_two();
    h.import(&p_addr(), turn_two_import()).unwrap();
    h.complete_reads();
    assert_eq!(import_results(&h, &p_addr()), vec![ImportOutcome::Loaded]);
    assert_eq!(
        export_results(&h, &d_addr()),
        vec![(ExportOutcome::Read, ReadProof::ReaderReleased)]
    );
    h.assert_no_leak();
}

// Scenario (mark d_ttl_renewed_by_p; beyond vLLM): P waits for its ask to get through; its
// heartbeats renew D's TTL meanwhile.
#[test]
fn p_heartbeats_renew_the_decode_ttl_while_p_waits() {
    let mut h = Harness::new();
    let mut export = export_start(1, &[500, 501], ms(2_000));
    export.request = d_request(1);
    h.export(&d_addr(), export).unwrap();
    h.set_filter(|e| {
        if is_ask(&e.message) {
            Rule::Drop
        } else {
            Rule::Deliver
        }
    });
    h.import(&p_addr(), turn_two_import()).unwrap();
    h.advance_to(at(ms(2_500)));
    assert!(
        export_results(&h, &d_addr()).is_empty(),
        "P's heartbeats kept it"
    );
    assert!(h.d().counters().exports_renewed > 0);
    h.clear_filter();
    h.abort(&p_addr(), p_request(1)).unwrap();
    h.assert_no_leak();
}

// Scenario: D is killed holding turn-1 blocks while P waits for its grant: P sees D die within
// two heartbeat intervals of its timeout and its turn-2 request ends (recompute); nothing was
// read.
#[test]
fn d_killed_holding_turn_one_blocks() {
    let mut h = turn_two();
    h.set_filter(|e| {
        if is_ask(&e.message) {
            Rule::Drop
        } else {
            Rule::Deliver
        }
    });
    let mut start = turn_two_import();
    start.policy = LoadFailurePolicy::Recompute;
    h.import(&p_addr(), start).unwrap();
    h.crash(&d_addr());
    let config = h.p().config().clone();
    h.advance(config.peer_timeout + config.heartbeat_interval * 2);
    assert_eq!(
        import_results(&h, &p_addr()),
        vec![ImportOutcome::Recompute {
            valid_tokens: 0,
            failure: ImportFailure::PeerDead
        }]
    );
    assert!(h.reads_posted.is_empty());
    h.clear_filter();
    h.assert_no_leak();
}

// Scenario (beyond vLLM: bidirectional after a pull turn): turn 1 by pull (D reads P), turn 2
// by a bidirectional read (P reads D), in one deployment.
#[test]
fn bidirectional_turn_after_pull_turn() {
    let mut h = reading();
    h.complete_reads();
    let mut export = export_start(2, &[500, 501], Duration::from_secs(480));
    export.request = d_request(2);
    h.export(&d_addr(), export).unwrap();
    let mut start = import_start(2, &[30, 31], &[500, 501]);
    start.request = p_request(2);
    start.holder = d_addr();
    h.import(&p_addr(), start).unwrap();
    h.complete_reads();
    let p_imports: Vec<ImportOutcome> = h
        .events_of(&p_addr())
        .iter()
        .filter(|e| matches!(e, kvhandoff_protocol::machine::EndpointEvent::Import { .. }))
        .map(import_result)
        .collect();
    assert_eq!(p_imports, vec![ImportOutcome::Loaded], "P's turn-2 read");
    h.assert_no_leak();
}

// Scenario: a copy of the granted attempt's ask gets the same grant again (the reader, already
// reading, drops it as a duplicate); nothing else changes.
#[test]
fn a_copy_of_the_ask_changes_nothing() {
    let mut h = reading();
    let ask = Message::ReadAsk(kvhandoff_protocol::ReadAsk {
        key: key(1),
        epoch: Epoch::FIRST,
        reader_request: d_request(1),
        reader_rank: 0,
        ask: 0,
        trace_id: kvhandoff_protocol::TraceId::from_u128(n_trace()),
    });
    // The same attempt again: the same grant, nothing changes.
    h.inject(&d_addr(), &p_addr(), ask);
    assert_eq!(h.reads.len(), 1);
    h.complete_reads();
    assert_eq!(h.p().counters().reads_granted, 1, "one grant, sent twice");
    h.assert_no_leak();
}

// ---------------------------------------------------------------------------------------------
// The ghost can fail (each test asserts the bug's precondition first)
// ---------------------------------------------------------------------------------------------

// Mutation `release_before_reads_end`: D releases P and hands its own blocks back when the
// first of three reads completes. Both ends of the ghost fail: P frees blocks two reads still
// read, and those reads then land in blocks D handed back.
#[test]
fn the_ghost_catches_release_before_reads_end() {
    let config = Config {
        read_chunk_blocks: 1,
        ..Config::fast()
    };
    let mut h = Harness::with_config(config);
    h.set_mutation(
        &d_addr(),
        Some(kvhandoff_protocol::machine::Mutation::ReleaseBeforeReadsEnd),
    );
    h.export(&p_addr(), export_start(1, &[10, 11, 12], LEASE))
        .unwrap();
    h.import(&d_addr(), import_start(1, &[500, 501, 502], &[10, 11, 12]))
        .unwrap();
    let reads = h.pending_reads();
    assert_eq!(reads.len(), 3, "precondition: three reads in flight");
    h.complete_read(&reads[0]);
    assert_eq!(h.reads.len(), 2, "precondition: two reads still run");
    assert_eq!(
        import_results(&h, &d_addr()).len(),
        1,
        "the mutation ended D"
    );
    let freed = h.take_violations();
    assert!(
        freed
            .iter()
            .any(|v| v.contains("handed back the exported blocks")),
        "{freed:#?}"
    );
    assert!(
        freed.iter().any(|v| v.contains("may still land in them")),
        "{freed:#?}"
    );
    h.complete_reads();
    let late = h.take_violations();
    assert!(
        late.iter()
            .any(|v| v.contains("after the holder handed them back")),
        "{late:#?}"
    );
}

// Mutation `short_grant_fence`: P's grant fence counts only the grant's delivery. D's release
// is lost and its read is slow: P frees at the short fence while the read still runs.
#[test]
fn the_ghost_catches_a_short_grant_fence() {
    let mut h = reading();
    h.set_mutation(
        &p_addr(),
        Some(kvhandoff_protocol::machine::Mutation::ShortGrantFence),
    );
    // Re-grant under the mutation: a newer attempt of the same reader.
    h.set_filter(|e| {
        if matches!(e.message, Message::Release(_)) {
            Rule::Drop
        } else {
            Rule::Deliver
        }
    });
    let config = h.p().config().clone();
    let ask = Message::ReadAsk(kvhandoff_protocol::ReadAsk {
        key: key(1),
        epoch: Epoch(2),
        reader_request: d_request(1),
        reader_rank: 0,
        ask: 0,
        trace_id: kvhandoff_protocol::TraceId::from_u128(n_trace()),
    });
    h.inject(&d_addr(), &p_addr(), ask);
    h.advance(config.max_message_delay + ms(1));
    assert_eq!(h.reads.len(), 1, "precondition: the read still runs");
    assert_eq!(
        export_results(&h, &p_addr()).len(),
        1,
        "the short fence freed P's blocks"
    );
    let violations = h.take_violations();
    assert!(
        violations
            .iter()
            .any(|v| v.contains("handed back the exported blocks")),
        "{violations:#?}"
    );
    h.complete_reads();
    h.take_violations();
}

// ---------------------------------------------------------------------------------------------
// More of §10.3 in our terms
// ---------------------------------------------------------------------------------------------

// §10.3 84: the holder's engine aborts before any reader asked: nothing can be reading, so the
// blocks are free at once.
#[test]
fn an_export_aborted_before_any_ask_is_freed_at_once() {
    let mut h = Harness::new();
    h.export(&p_addr(), export_start(1, &[10, 11], LEASE))
        .unwrap();
    h.abort(&p_addr(), p_request(1)).unwrap();
    assert_eq!(
        export_results(&h, &p_addr()),
        vec![(
            ExportOutcome::Released(ExportEnd::Aborted),
            ReadProof::NeverGranted
        )]
    );
    assert_eq!(h.now, Time::ZERO);
    h.assert_no_leak();
}

// §10.3 98: the engine hands the same request in twice (a reschedule): the second is refused,
// and nothing is read twice.
#[test]
fn a_second_import_of_the_same_request_is_refused() {
    let mut h = reading();
    let again = h.import(&d_addr(), import_start(1, &[600, 601], &[10, 11]));
    assert!(matches!(
        again,
        Err(kvhandoff_protocol::machine::Rejected::DuplicateRequest(_))
    ));
    assert_eq!(h.reads_posted.len(), 1);
    h.complete_reads();
    h.assert_no_leak();
}

// §10.3 103 (and vLLM's end-trim): the reader's own prefix cache had the start, so it holds
// fewer blocks than the holder exported: it reads the holder's last blocks only.
#[test]
fn a_reader_with_fewer_blocks_reads_the_tail() {
    let mut h = Harness::new();
    h.export(&p_addr(), export_start(1, &[10, 11, 12], LEASE))
        .unwrap();
    h.import(&d_addr(), import_start(1, &[500], &[10, 11, 12]))
        .unwrap();
    let order = h.reads[&h.the_read()].order.clone();
    assert_eq!(order.remote, blocks(&[12]));
    assert_eq!(order.local, blocks(&[500]));
    h.complete_reads();
    assert_eq!(import_results(&h, &d_addr()), vec![ImportOutcome::Loaded]);
    h.assert_no_leak();
}

// §10.3 106: a full prefix hit needs no read, so an expired deadline does not matter: no gate,
// no failure.
#[test]
fn a_full_prefix_hit_skips_the_expiry_gate() {
    let mut h = Harness::new();
    h.export(&p_addr(), export_start(1, &[10, 11], LEASE))
        .unwrap();
    let mut start = import_start(1, &[], &[10, 11]);
    start.expires = Some(Time::ZERO);
    h.import(&d_addr(), start).unwrap();
    assert_eq!(import_results(&h, &d_addr()), vec![ImportOutcome::Loaded]);
    assert_eq!(h.d().counters().reads_declined_near_expiry, 0);
    h.assert_no_leak();
}

/// The trace id of an injected ask (any valid one: the holder only logs it).
fn n_trace() -> u128 {
    0x7ace
}
