//! The gaps vLLM's push mode leaves open (reference §9.4, §9.2, §3.3), closed: every scenario
//! ends in exactly one outcome per side, within a bound, with a proof, and no write ever lands
//! in blocks D has handed back (the harness's ghost checks that in every test).

use kvhandoff_protocol::machine::{
    Config, ConnectFailure, DecodeFailure, DecodeOutcome, DropReason, EndpointCall, EndpointEvent,
    FreeProof, NetEvent, PrefillOutcome, Rejected, ReleaseCause, Time,
};
use kvhandoff_protocol::{Epoch, Message, PairingKey, ReleaseReason, RequestId, WriteFailure};
use kvhandoff_sim::scripted::*;

// -------------------------------------------------------------------------------------------
// §9.4.1: D never hangs
// -------------------------------------------------------------------------------------------

// Scenario: P dies while D waits for its prefill (vLLM: D hangs, issue 46283). D declares P
// dead within peer_timeout + one heartbeat interval and invalidates it; its blocks, exposed to
// P, stay fenced for the quarantine (NIXL cannot stop a write a falsely-dead P still posts),
// then come back with proof DeadPeerFence — a bounded wait, never a hang.
#[test]
fn p_death_before_the_write_is_detected_in_bounded_time() {
    let mut h = Harness::new();
    h.decode(decode_start(1, &[500])).unwrap();
    h.advance(ms(1_000));
    let crashed = h.now;
    h.crash(&p_addr());
    let config = h.d().config().clone();
    h.advance(config.peer_timeout + config.heartbeat_interval);
    assert_eq!(
        h.d().counters().peers_declared_dead,
        1,
        "declared dead in time"
    );
    assert!(h.d_results().is_empty(), "fenced, not freed");
    h.advance(config.quarantine);

    assert_eq!(
        h.d_results(),
        vec![(
            DecodeOutcome::Failed(DecodeFailure::PeerDead),
            FreeProof::DeadPeerFence
        )]
    );
    let failed = h.event_time(&d_addr(), &d_request(1)).unwrap();
    assert!(
        failed <= crashed + config.peer_timeout + config.heartbeat_interval + config.quarantine,
        "freed at {failed}, crash at {crashed}"
    );
    let invalidated = &h.nodes[&d_addr()].invalidated;
    assert_eq!(invalidated.len(), 1);
    assert_eq!(invalidated[0].1, p_addr());
    assert!(
        invalidated[0].0 <= failed,
        "invalidate before handing blocks back"
    );
    assert_eq!(h.d().counters().peers_declared_dead, 1);
    h.assert_no_leak();
}

// Scenario: the same death, as D's engine sees it (issue 19, deliverable 4): told that the
// request failed the moment P is declared dead (`DecodeFenced`, no blocks), so that it can
// recompute elsewhere; the blocks only with the final `Failed`, after the fence.
#[test]
fn p_death_tells_the_engine_at_once_and_hands_the_blocks_back_at_the_fence() {
    let mut h = Harness::new();
    h.decode(decode_start(1, &[500])).unwrap();
    h.advance(ms(1_000));
    h.crash(&p_addr());
    let config = h.d().config().clone();
    h.advance(config.peer_timeout + config.heartbeat_interval);
    assert_eq!(
        h.d().counters().peers_declared_dead,
        1,
        "precondition: P declared dead"
    );
    assert_eq!(
        h.early_d(),
        vec![EndpointEvent::DecodeFenced {
            request: d_request(1),
            key: key(1),
            epoch: Epoch(1),
            failure: DecodeFailure::PeerDead,
        }]
    );
    let told = h.nodes[&d_addr()].early[0].0;
    assert!(h.d_results().is_empty(), "the blocks stay fenced");
    h.advance(config.quarantine);
    assert_eq!(
        h.d_results(),
        vec![(
            DecodeOutcome::Failed(DecodeFailure::PeerDead),
            FreeProof::DeadPeerFence
        )]
    );
    let freed = h.event_time(&d_addr(), &d_request(1)).unwrap();
    assert!(
        freed >= told + config.quarantine,
        "told at {told}, freed at {freed}"
    );
    assert_eq!(h.early_d().len(), 1, "told once");
    h.assert_no_leak();
}

// Scenario: P dies with its write in flight. D invalidates P and keeps its blocks fenced for
// the quarantine, longer than any write of P can stay in flight, before handing them back.
#[test]
fn p_death_during_the_write_cuts_the_write() {
    let mut h = writing();
    h.advance(ms(300));
    h.crash(&p_addr());
    h.advance(ms(300));
    assert!(h.d_results().is_empty(), "fenced, not freed");
    let quarantine = h.d().config().quarantine;
    h.advance(quarantine);
    assert_eq!(
        h.d_results(),
        vec![(
            DecodeOutcome::Failed(DecodeFailure::PeerDead),
            FreeProof::DeadPeerFence
        )]
    );
    assert!(
        h.writes.is_empty(),
        "the invalidation cut the orphaned write"
    );
    assert!(h.landings.is_empty());
    h.assert_no_leak();
}

// Scenario: the transport reports P lost (side channel closed): D invalidates P at once and
// fences its blocks; they come back after the quarantine.
#[test]
fn peer_lost_fails_d_at_once() {
    let mut h = writing();
    h.event(&d_addr(), NetEvent::PeerLost { peer: p_addr() });
    assert!(h.d_results().is_empty(), "fenced, not freed");
    let quarantine = h.d().config().quarantine;
    h.advance(quarantine);
    assert_eq!(
        h.d_results(),
        vec![(
            DecodeOutcome::Failed(DecodeFailure::PeerDead),
            FreeProof::DeadPeerFence
        )]
    );
    assert_eq!(h.nodes[&d_addr()].invalidated.len(), 1);
    // D's invalidation did not stop P's write (measured): it failed at its bound, long before
    // the quarantine ended, and P, no longer hearing D, released its blocks as D's death.
    assert!(h.writes.is_empty());
    assert_eq!(
        h.p_results(),
        vec![PrefillOutcome::Released(ReleaseCause::PeerDead)]
    );
    h.assert_no_leak();
}

// Scenario: P is alive but its write hangs in the transport (never pushes): P abandons it at
// its write deadline; NIXL goes on with it (measured), so nobody frees anything until it ends,
// at the fabric's bound (max_write_life); then D fails with TransferTimedOut, still long before
// its own deadline.
#[test]
fn hung_write_is_abandoned_and_d_fails_before_its_deadline() {
    let mut h = writing();
    h.advance(ms(999));
    assert!(h.events_d().is_empty());
    h.advance(ms(1));
    assert_eq!(h.p().counters().writes_abandoned, 1);
    assert!(
        h.writes[&h.the_write()].abandoned,
        "the abandon did not stop it"
    );
    let life = h.p().config().max_write_life;
    h.advance_to(at(life - ms(1)));
    assert!(
        h.events_d().is_empty(),
        "the abandoned write may still land"
    );
    assert!(h.p_results().is_empty(), "it may still read P's blocks");
    h.advance(ms(1));
    assert!(h.writes.is_empty(), "it ended at its bound");
    assert_eq!(h.event_time(&d_addr(), &d_request(1)), Some(at(life)));
    assert_eq!(
        h.d_results(),
        vec![(
            DecodeOutcome::Failed(DecodeFailure::WriteFailed(WriteFailure::TransferTimedOut)),
            FreeProof::PeerQuiesced
        )]
    );
    assert_eq!(
        h.p_results(),
        vec![PrefillOutcome::Released(ReleaseCause::WriteFailed(
            WriteFailure::TransferTimedOut
        ))]
    );
    assert!(h.now < at(h.d().config().decode_deadline));
    h.assert_no_leak();
}

// Scenario: a handshake to P that fails (§9.2 first row): D fails at once, blocks never exposed.
#[test]
fn handshake_failure_fails_d_at_once() {
    let mut h = Harness::new();
    h.connect_mode = ConnectMode::Fail(ConnectFailure::Incompatible);
    h.decode(decode_start(1, &[500])).unwrap();
    assert_eq!(
        h.d_results(),
        vec![(
            DecodeOutcome::Failed(DecodeFailure::HandshakeFailed),
            FreeProof::NeverExposed
        )]
    );
    assert_eq!(h.count_sent(&d_addr(), is_register), 0);
    h.assert_no_leak();
}

// Scenario: a handshake that never answers times out after connect_timeout.
#[test]
fn handshake_timeout_fails_d() {
    let mut h = Harness::new();
    h.connect_mode = ConnectMode::Hold;
    h.decode(decode_start(1, &[500])).unwrap();
    h.advance(ms(499));
    assert!(h.events_d().is_empty());
    h.advance(ms(1));
    assert_eq!(
        h.d_results(),
        vec![(
            DecodeOutcome::Failed(DecodeFailure::HandshakeFailed),
            FreeProof::NeverExposed
        )]
    );
    h.assert_no_leak();
}

// -------------------------------------------------------------------------------------------
// §9.2: write failures reach D (PR 50754)
// -------------------------------------------------------------------------------------------

// Scenario: the WRITE fails to post: P tells D at once and D fails fast with PeerQuiesced
// (vLLM: D waits for its watchdog).
#[test]
fn write_post_failure_fails_d_fast() {
    let mut h = Harness::new();
    h.reject_posts = Some(WriteFailure::PostFailed);
    h.prefill(prefill_start(1, &[10])).unwrap();
    h.decode(decode_start(1, &[500])).unwrap();
    assert_eq!(h.now, Time::ZERO);
    assert_eq!(
        h.d_results(),
        vec![(
            DecodeOutcome::Failed(DecodeFailure::WriteFailed(WriteFailure::PostFailed)),
            FreeProof::PeerQuiesced
        )]
    );
    assert_eq!(
        h.p_results(),
        vec![PrefillOutcome::Released(ReleaseCause::WriteFailed(
            WriteFailure::PostFailed
        ))]
    );
    assert_eq!(
        h.count_sent(&p_addr(), |m| matches!(m, Message::WriteFailed(_))),
        1
    );
    h.assert_no_leak();
}

// Scenario: the WRITE fails in flight (§9.2 "ERR state"): same, with TransferFailed.
#[test]
fn write_failure_in_flight_fails_d_fast() {
    let mut h = writing();
    h.advance(ms(100));
    let w = h.the_write();
    h.fail_write(&w, WriteFailure::TransferFailed);
    assert_eq!(
        h.d_results(),
        vec![(
            DecodeOutcome::Failed(DecodeFailure::WriteFailed(WriteFailure::TransferFailed)),
            FreeProof::PeerQuiesced
        )]
    );
    assert_eq!(h.event_time(&d_addr(), &d_request(1)), Some(at(ms(100))));
    h.assert_no_leak();
}

// -------------------------------------------------------------------------------------------
// §9.4.3: duplicate registration after the match
// -------------------------------------------------------------------------------------------

// Scenario: a duplicate registration arrives after P sent (vLLM stashes it forever): P keeps
// nothing and answers nothing (D already has its data), counting it as a duplicate.
#[test]
fn duplicate_registration_after_the_write_leaks_nothing() {
    let mut h = Harness::new();
    h.prefill(prefill_start(1, &[10])).unwrap();
    h.decode(decode_start(1, &[500])).unwrap();
    h.complete_writes();
    assert_eq!(h.d_results()[0].0, DecodeOutcome::Ready);
    let register = h
        .sent
        .iter()
        .find(|(_, e)| is_register(&e.message))
        .unwrap()
        .1
        .clone();
    h.inject(&d_addr(), &p_addr(), register.message.clone());
    assert_eq!(h.p().stats().pending_registrations, 0);
    assert_eq!(h.posted.len(), 1, "no second WRITE");
    assert_eq!(h.p().counters().dropped(DropReason::Duplicate), 1);
    assert_eq!(h.p().counters().dropped(DropReason::Late), 0);
    assert_eq!(
        h.count_sent(&p_addr(), |m| matches!(m, Message::WriteFailed(_))),
        0,
        "a served registration's duplicate gets no answer"
    );
    assert_eq!(h.d_results().len(), 1);
    h.assert_no_leak();
}

// Scenario: a duplicate registration of the epoch P already served, overtaking the WRITE's
// notification (the notification is held in the network). D must still end Ready: the data
// landed and P reports Sent.
#[test]
fn duplicate_registration_must_not_fail_a_delivered_request() {
    let mut h = Harness::new();
    h.prefill(prefill_start(1, &[10])).unwrap();
    h.decode(decode_start(1, &[500])).unwrap();
    h.set_filter(|e| match e.message {
        Message::WriteDone(_) => Rule::Hold,
        _ => Rule::Deliver,
    });
    h.complete_writes();
    assert_eq!(h.p_results(), vec![PrefillOutcome::Sent]);
    let register = h
        .sent
        .iter()
        .find(|(_, e)| is_register(&e.message))
        .unwrap()
        .1
        .clone();
    h.inject(&d_addr(), &p_addr(), register.message);
    h.deliver_all_held();
    assert_eq!(
        h.d_results(),
        vec![(DecodeOutcome::Ready, FreeProof::WritesCompleted)],
        "P sent, the data landed: D is Ready"
    );
    h.assert_no_leak();
}

// -------------------------------------------------------------------------------------------
// §9.4.4 and §3.3: D gives up early
// -------------------------------------------------------------------------------------------

// Scenario: D aborts while its handshake with P is in progress (before registering): D's
// blocks come back at once (never exposed), and P, which finished, releases at once once the
// handshake completes (vLLM: P waits for its lease).
#[test]
fn d_abort_while_connecting_releases_p_at_once() {
    let mut h = Harness::new();
    h.connect_mode = ConnectMode::Hold;
    h.prefill(prefill_start(1, &[10])).unwrap();
    h.decode(decode_start(1, &[500])).unwrap();
    assert_eq!(h.pending_connects.len(), 1);
    h.abort(&d_addr(), d_request(1)).unwrap();
    assert_eq!(
        h.d_results(),
        vec![(
            DecodeOutcome::Failed(DecodeFailure::Aborted),
            FreeProof::NeverExposed
        )]
    );
    h.advance(ms(50));
    h.complete_connects();
    assert_eq!(h.count_sent(&d_addr(), is_register), 0);
    assert_eq!(
        h.p_results(),
        vec![PrefillOutcome::Released(ReleaseCause::ReleasedByPeer(
            ReleaseReason::Aborted
        ))]
    );
    assert_eq!(h.event_time(&p_addr(), &p_request(1)), Some(at(ms(50))));
    h.assert_no_leak();
}

// Scenario: the same abort while P has not finished yet: P remembers the release and frees its
// blocks the moment its prefill finishes.
#[test]
fn d_abort_while_connecting_before_p_finishes() {
    let mut h = Harness::new();
    h.connect_mode = ConnectMode::Hold;
    h.decode(decode_start(1, &[500])).unwrap();
    h.abort(&d_addr(), d_request(1)).unwrap();
    h.complete_connects();
    h.advance(ms(500));
    h.prefill(prefill_start(1, &[10])).unwrap();
    assert_eq!(
        h.p_results(),
        vec![PrefillOutcome::Released(ReleaseCause::ReleasedByPeer(
            ReleaseReason::Aborted
        ))]
    );
    assert_eq!(h.event_time(&p_addr(), &p_request(1)), Some(h.now));
    assert!(h.posted.is_empty());
    h.assert_no_leak();
}

// Scenario: D aborts while P's write is in flight (vLLM: blocks held until finished_recving,
// or leaked). D must not hand its blocks back until P's write has drained and P answered.
#[test]
fn d_abort_during_the_write_waits_for_the_drain() {
    let mut h = writing();
    h.abort(&d_addr(), d_request(1)).unwrap();
    assert_eq!(h.count_sent(&d_addr(), is_cancel), 1);
    h.advance(ms(300));
    assert!(
        h.events_d().is_empty(),
        "no D event while the write may still land"
    );
    assert!(h.p_results().is_empty(), "P is draining");

    let w = h.the_write();
    h.complete_write(&w);
    let results = h.d_results();
    assert_eq!(results.len(), 1);
    assert_eq!(results[0].0, DecodeOutcome::Failed(DecodeFailure::Aborted));
    assert!(
        matches!(
            results[0].1,
            FreeProof::WritesCompleted | FreeProof::CancelAcknowledged
        ),
        "{results:?}"
    );
    assert!(h.landings[0].at <= h.event_time(&d_addr(), &d_request(1)).unwrap());
    assert_eq!(
        h.p_results(),
        vec![PrefillOutcome::Released(ReleaseCause::CancelledByPeer)]
    );
    assert_eq!(
        h.count_sent(&p_addr(), |m| matches!(m, Message::CancelAck(_))),
        1
    );
    h.assert_no_leak();
}

// Scenario: the same abort, and the write never lands: P abandons it at its write deadline
// (NIXL cannot cancel), then D frees with proof.
#[test]
fn d_abort_during_a_write_that_never_lands() {
    let mut h = writing();
    h.abort(&d_addr(), d_request(1)).unwrap();
    h.advance(ms(999));
    assert!(h.events_d().is_empty());
    h.advance(ms(1));
    assert_eq!(h.p().counters().writes_abandoned, 1);
    assert!(
        h.events_d().is_empty(),
        "the abandon does not stop the write"
    );
    h.advance(h.p().config().max_write_life);
    let results = h.d_results();
    assert_eq!(results.len(), 1);
    assert_eq!(results[0].0, DecodeOutcome::Failed(DecodeFailure::Aborted));
    assert!(matches!(
        results[0].1,
        FreeProof::PeerQuiesced | FreeProof::CancelAcknowledged
    ));
    assert!(h.landings.is_empty());
    assert_eq!(h.p().counters().writes_abandoned, 1);
    h.assert_no_leak();
}

// -------------------------------------------------------------------------------------------
// No late write into reused blocks
// -------------------------------------------------------------------------------------------

/// D's deadline (500 ms) comes long before P's write deadline (2 s). A write may live as long
/// as P waits for it (2 s + 500 ms of abandon), and the quarantine must still exceed
/// registration_ttl + heartbeat_interval + max_message_delay + max_write_life
/// (5 s + 100 ms + 1 s + 2.5 s).
fn short_deadline() -> Config {
    Config {
        decode_deadline: ms(500),
        write_timeout: ms(2_000),
        max_write_life: ms(2_500),
        quarantine: ms(9_000),
        ..Config::fast()
    }
}

// Scenario: D's deadline passes while P's write is in flight; the write lands late (1.5 s). D
// hands its blocks back only after the landing, never before.
#[test]
fn late_landing_precedes_the_d_event() {
    let mut h = Harness::with_config(short_deadline());
    h.prefill(prefill_start(1, &[10])).unwrap();
    h.decode(decode_start(1, &[500])).unwrap();
    h.advance(ms(1_500));
    assert!(h.count_sent(&d_addr(), is_cancel) >= 1);
    assert!(h.events_d().is_empty(), "D waits for the drain");
    let w = h.the_write();
    h.complete_write(&w);
    let freed = h.event_time(&d_addr(), &d_request(1)).expect("D ended");
    assert_eq!(freed, at(ms(1_500)));
    assert_eq!(
        h.d_results()[0].0,
        DecodeOutcome::Failed(DecodeFailure::Deadline)
    );
    assert!(h.landings.iter().all(|l| l.at <= freed));
    assert!(h.violations.is_empty());
    h.assert_no_leak();
}

// Scenario: D's deadline passes while P's write is in flight and the write never lands: P
// abandons it at 2 s, NIXL goes on with it until its bound (2.5 s); only then does D free,
// with proof, and nothing can land afterwards.
#[test]
fn abandoned_write_precedes_the_d_event() {
    let mut h = Harness::with_config(short_deadline());
    h.prefill(prefill_start(1, &[10])).unwrap();
    h.decode(decode_start(1, &[500])).unwrap();
    h.advance(ms(1_999));
    assert!(h.events_d().is_empty());
    assert_eq!(h.writes.len(), 1);
    h.advance(ms(1));
    assert!(
        h.events_d().is_empty(),
        "abandoned, and NIXL goes on with it"
    );
    h.advance_to(at(ms(2_500)));
    assert_eq!(
        h.d_results(),
        vec![(
            DecodeOutcome::Failed(DecodeFailure::Deadline),
            FreeProof::PeerQuiesced
        )]
    );
    assert_eq!(h.event_time(&d_addr(), &d_request(1)), Some(at(ms(2_500))));
    assert!(h.writes.is_empty(), "nothing is left that could land");
    assert!(h.landings.is_empty());
    h.assert_no_leak();
}

// Scenario: every proof is lost (P's acks and failure reports never reach D, heartbeats do):
// D resends its cancel, then frees only after the quarantine, and counts it as such.
#[test]
fn quarantine_frees_when_every_proof_is_lost() {
    let mut h = writing();
    h.set_filter(|e| {
        let from_p = e.from.engine.as_str() == "prefill";
        match e.message {
            Message::CancelAck(_) | Message::WriteFailed(_) if from_p => Rule::Drop,
            _ => Rule::Deliver,
        }
    });
    h.abort(&d_addr(), d_request(1)).unwrap();
    let quarantine = h.d().config().quarantine;
    h.advance(quarantine - ms(1));
    assert!(h.events_d().is_empty());
    h.advance(ms(1));
    assert_eq!(
        h.d_results(),
        vec![(
            DecodeOutcome::Failed(DecodeFailure::Aborted),
            FreeProof::Quarantine
        )]
    );
    assert_eq!(
        h.event_time(&d_addr(), &d_request(1)),
        Some(at(quarantine)),
        "freed exactly at the quarantine (7 s in the fast config)"
    );
    let c = h.d().counters();
    assert_eq!(c.quarantine_frees, 1);
    assert_eq!(
        c.cancel_resends,
        u64::from(h.d().config().max_cancel_retries)
    );
    assert!(h.landings.is_empty());
    h.assert_no_leak();
}

// Scenario: D registers before P finishes, then aborts, and every cancel is lost. A request that
// gave up no longer renews P's registration: it expires on P registration_ttl after D's last
// renewal, P tells D (RegistrationExpired), and D frees with that proof before its quarantine.
// P's prefill, finishing later, never writes into the freed blocks.
#[test]
fn cancelling_stops_renewing_the_registration() {
    let mut h = Harness::new();
    h.set_filter(|e| {
        if is_cancel(&e.message) {
            Rule::Drop
        } else {
            Rule::Deliver
        }
    });
    h.decode(decode_start(1, &[500])).unwrap();
    h.advance(ms(1_000));
    assert_eq!(h.p().stats().pending_registrations, 1);
    let renewed = h.p().counters().leases_renewed;
    assert!(renewed >= 9, "D renews while registered: {renewed}");
    h.abort(&d_addr(), d_request(1)).unwrap();
    let aborted = h.now;
    h.advance(ms(1_000));
    assert_eq!(
        h.p().counters().leases_renewed,
        renewed,
        "no renewal after the cancel"
    );
    assert!(h.events_d().is_empty());
    let config = h.d().config().clone();
    h.advance_to(aborted + config.registration_ttl);
    assert_eq!(
        h.d_results(),
        vec![(
            DecodeOutcome::Failed(DecodeFailure::Aborted),
            FreeProof::PeerQuiesced
        )]
    );
    assert_eq!(
        h.event_time(&d_addr(), &d_request(1)),
        Some(aborted + config.registration_ttl),
        "the registration expires registration_ttl after the last renewal"
    );
    assert_eq!(
        h.count_sent(&p_addr(), |m| matches!(
            m,
            Message::WriteFailed(f) if f.reason == WriteFailure::RegistrationExpired
        )),
        1
    );
    assert_eq!(h.d().counters().quarantine_frees, 0);
    h.prefill(prefill_start(1, &[10])).unwrap();
    h.advance(h.p().config().lease_duration);
    assert!(h.posted.is_empty(), "no WRITE into D's freed blocks");
    assert_eq!(
        h.p_results(),
        vec![PrefillOutcome::Released(ReleaseCause::LeaseExpired)]
    );
    h.assert_no_leak();
}

// Scenario: with two writers (TP fan-in), D cancels; only rank 0 is told (D cancels only its
// registered `prefill` peer) and acknowledges. Rank 1's write is still in flight: rank 0's ack
// settles rank 0 only, so D holds its blocks until rank 1's write settles too.
#[test]
fn one_rank_ack_must_not_free_blocks_another_rank_writes() {
    let mut h = two_writers();
    h.abort(&d_addr(), d_request(1)).unwrap();
    assert_eq!(h.count_sent(&d_addr(), is_cancel), 1);
    assert!(
        h.sent
            .iter()
            .filter(|(_, e)| is_cancel(&e.message))
            .all(|(_, e)| e.to == p_addr()),
        "only the registered peer (rank 0) is told"
    );
    let w0 = h
        .pending_writes()
        .into_iter()
        .find(|(a, _)| a == &p_addr())
        .unwrap();
    h.complete_write(&w0);
    assert_eq!(
        h.count_sent(&p_addr(), |m| matches!(m, Message::CancelAck(_))),
        1,
        "rank 0 drained and acknowledged"
    );
    assert_eq!(
        h.d().counters().dropped(DropReason::Duplicate),
        1,
        "rank 0's WriteDone settled it; its CancelAck is a duplicate for rank 0"
    );
    // Rank 1's write is still pending: the ghost flags any D event now.
    h.advance(ms(500));
    assert!(
        h.events_d().is_empty(),
        "D freed {:?} while rank 1's write may land",
        h.d_results()
    );
    let w1 = h.the_write();
    assert_eq!(w1.0, p1_addr());
    h.complete_write(&w1);
    assert_eq!(
        h.d_results(),
        vec![(
            DecodeOutcome::Failed(DecodeFailure::Aborted),
            FreeProof::WritesCompleted
        )]
    );
    let freed = h.event_time(&d_addr(), &d_request(1)).unwrap();
    assert_eq!(freed, at(ms(500)), "freed the moment rank 1 settled");
    assert!(h.landings.iter().all(|l| l.at <= freed));
    assert_eq!(h.landings.len(), 2);
    assert_eq!(h.d().counters().quarantine_frees, 0);
    h.assert_no_leak();
}

// Scenario: the same, and rank 1's write hangs: rank 1 (never told of the cancel) abandons it
// at its write deadline and, once the transport says it can no longer land (at its bound),
// reports WriteFailed(TransferTimedOut); that settles rank 1 and D frees with proof, long
// before the quarantine.
#[test]
fn one_rank_ack_then_the_other_rank_abandons() {
    let mut h = two_writers();
    h.abort(&d_addr(), d_request(1)).unwrap();
    let w0 = h
        .pending_writes()
        .into_iter()
        .find(|(a, _)| a == &p_addr())
        .unwrap();
    h.complete_write(&w0);
    let config = h.d().config().clone();
    h.advance_to(at(config.write_timeout));
    assert_eq!(h.ep(&p1_addr()).counters().writes_abandoned, 1);
    let ended = config.max_write_life;
    h.advance_to(at(ended - ms(1)));
    assert!(
        h.events_d().is_empty(),
        "D freed {:?} while rank 1's write may land",
        h.d_results()
    );
    h.advance(ms(1));
    assert_eq!(
        h.d_results(),
        vec![(
            DecodeOutcome::Failed(DecodeFailure::Aborted),
            FreeProof::PeerQuiesced
        )]
    );
    assert_eq!(h.event_time(&d_addr(), &d_request(1)), Some(at(ended)));
    assert_eq!(
        h.count_sent(&p1_addr(), |m| matches!(
            m,
            Message::WriteFailed(f) if f.reason == WriteFailure::TransferTimedOut
        )),
        1
    );
    assert!(h.writes.is_empty(), "nothing is left that could land");
    assert_eq!(h.landings.len(), 1, "only rank 0's write landed");
    assert_eq!(h.d().counters().quarantine_frees, 0);
    h.assert_no_leak();
}

// -------------------------------------------------------------------------------------------
// Cancel overtaking its registration
// -------------------------------------------------------------------------------------------

// Scenario: D aborts while its registration is still on the wire, and the Cancel overtakes it:
// P acks at once (nothing posted), then swallows the late registration as Late, no WRITE.
#[test]
fn cancel_overtaking_its_registration_is_acked_and_the_register_swallowed() {
    let mut h = Harness::new();
    h.set_filter(|e| {
        if is_register(&e.message) {
            Rule::Hold
        } else {
            Rule::Deliver
        }
    });
    h.decode(decode_start(1, &[500])).unwrap();
    h.abort(&d_addr(), d_request(1)).unwrap();
    assert_eq!(
        h.d_results(),
        vec![(
            DecodeOutcome::Failed(DecodeFailure::Aborted),
            FreeProof::CancelAcknowledged
        )]
    );
    h.deliver_all_held();
    assert_eq!(h.p().counters().dropped(DropReason::Late), 1);
    assert_eq!(h.p().stats().pending_registrations, 0);
    h.prefill(prefill_start(1, &[10])).unwrap();
    assert!(h.posted.is_empty(), "no WRITE into D's freed blocks");
    assert_eq!(
        h.p_results(),
        vec![PrefillOutcome::Released(ReleaseCause::CancelledByPeer)]
    );
    h.assert_no_leak();
}

// Scenario: the same while P already holds its blocks: the cancel releases them, and the late
// registration is swallowed.
#[test]
fn cancel_overtaking_its_registration_while_p_holds() {
    let mut h = Harness::new();
    h.prefill(prefill_start(1, &[10])).unwrap();
    h.set_filter(|e| {
        if is_register(&e.message) {
            Rule::Hold
        } else {
            Rule::Deliver
        }
    });
    h.decode(decode_start(1, &[500])).unwrap();
    h.abort(&d_addr(), d_request(1)).unwrap();
    assert_eq!(
        h.p_results(),
        vec![PrefillOutcome::Released(ReleaseCause::CancelledByPeer)]
    );
    assert_eq!(
        h.d_results(),
        vec![(
            DecodeOutcome::Failed(DecodeFailure::Aborted),
            FreeProof::CancelAcknowledged
        )]
    );
    h.deliver_all_held();
    assert!(h.posted.is_empty());
    // The cancel ended P's request bound to that very epoch: the overtaken registration is a
    // duplicate of it.
    assert_eq!(h.p().counters().dropped(DropReason::Duplicate), 1);
    assert_eq!(h.p().counters().dropped(DropReason::Late), 0);
    assert_eq!(
        h.count_sent(&p_addr(), |m| matches!(m, Message::WriteFailed(_))),
        0,
        "a swallowed registration gets no answer"
    );
    h.assert_no_leak();
}

// Scenario: as above, and then P's engine finishes the same key again (a retry: new request
// id, same pairing key) before the overtaken registration arrives. The cancel's epoch must still be swallowed: D freed
// its blocks on the CancelAck.
//
// With the new tombstones, P's first request leaves `Ended { epoch: Some(1), replay: None }`
// (formerly `Cancelled(1)`, which made any later finish for the key release at once);
// `PrefillTable::finished` removes an `Ended` tombstone, so the second request is `Held` and the late
// registration of epoch 1 is matched: a WRITE into D's freed blocks.
#[test]
fn refinished_key_must_not_serve_a_registration_its_cancel_overtook() {
    let mut h = Harness::new();
    h.prefill(prefill_start(1, &[10])).unwrap();
    h.set_filter(|e| {
        if is_register(&e.message) {
            Rule::Hold
        } else {
            Rule::Deliver
        }
    });
    h.decode(decode_start(1, &[500])).unwrap();
    h.abort(&d_addr(), d_request(1)).unwrap();
    assert_eq!(
        h.d_results(),
        vec![(
            DecodeOutcome::Failed(DecodeFailure::Aborted),
            FreeProof::CancelAcknowledged
        )]
    );
    // A retry of the same request on P (same pairing key, new request id).
    let retry_id = RequestId::new(format!("cmpl-{}-0-cccccccc", uuid(1))).unwrap();
    let mut again = prefill_start(1, &[10]);
    again.request = retry_id.clone();
    again.key = PairingKey::from_request_id(&retry_id);
    assert_eq!(again.key, key(1));
    h.prefill(again).unwrap();
    h.deliver_all_held();
    assert!(
        h.posted.is_empty(),
        "no WRITE into D's freed blocks: {:?}",
        h.posted
    );
    h.advance(h.p().config().lease_duration);
    h.assert_no_leak();
}

// -------------------------------------------------------------------------------------------
// P aborts
// -------------------------------------------------------------------------------------------

// Scenario: P aborts after finishing, before D registers: blocks freed at once; D's later
// registration is answered WriteFailed(PrefillAborted) and D fails fast.
#[test]
fn p_abort_before_the_write() {
    let mut h = Harness::new();
    h.prefill(prefill_start(1, &[10])).unwrap();
    h.abort(&p_addr(), p_request(1)).unwrap();
    assert_eq!(
        h.p_results(),
        vec![PrefillOutcome::Released(ReleaseCause::Aborted)]
    );
    h.advance(ms(100));
    h.decode(decode_start(1, &[500])).unwrap();
    assert_eq!(
        h.d_results(),
        vec![(
            DecodeOutcome::Failed(DecodeFailure::WriteFailed(WriteFailure::PrefillAborted)),
            FreeProof::PeerQuiesced
        )]
    );
    assert_eq!(h.event_time(&d_addr(), &d_request(1)), Some(at(ms(100))));
    assert!(h.posted.is_empty());
    h.assert_no_leak();
}

// Scenario: P aborts during its write: P keeps its blocks until the write drained (abandoned
// at the write deadline, it still runs until its bound), then D gets
// WriteFailed(PrefillAborted).
#[test]
fn p_abort_during_the_write_reports_after_the_drain() {
    let mut h = writing();
    h.abort(&p_addr(), p_request(1)).unwrap();
    assert!(h.p_results().is_empty(), "P's blocks are still being read");
    assert_eq!(
        h.count_sent(&p_addr(), |m| matches!(m, Message::WriteFailed(_))),
        0,
        "nothing is promised before the drain"
    );
    h.advance(ms(1_000));
    assert!(h.p_results().is_empty(), "abandoned, still running");
    h.advance(ms(1_000));
    assert_eq!(
        h.p_results(),
        vec![PrefillOutcome::Released(ReleaseCause::Aborted)]
    );
    assert_eq!(
        h.d_results(),
        vec![(
            DecodeOutcome::Failed(DecodeFailure::WriteFailed(WriteFailure::PrefillAborted)),
            FreeProof::PeerQuiesced
        )]
    );
    h.assert_no_leak();
}

// Scenario: P aborts during its write and the write completes anyway: the data landed, so D
// is Ready and P counts it as sent.
#[test]
fn p_abort_during_a_write_that_completes() {
    let mut h = writing();
    h.abort(&p_addr(), p_request(1)).unwrap();
    h.complete_writes();
    assert_eq!(h.p_results(), vec![PrefillOutcome::Sent]);
    assert_eq!(
        h.d_results(),
        vec![(DecodeOutcome::Ready, FreeProof::WritesCompleted)]
    );
    h.assert_no_leak();
}

// -------------------------------------------------------------------------------------------
// Leases
// -------------------------------------------------------------------------------------------

// Scenario: P finishes and D never registers: the lease frees P's blocks after exactly
// lease_duration, and the tombstone is forgotten after tombstone_ttl.
#[test]
fn lease_expiry_while_d_never_registers() {
    let mut h = Harness::new();
    h.prefill(prefill_start(1, &[10, 11])).unwrap();
    h.advance(ms(2_999));
    assert!(h.p_results().is_empty());
    h.advance(ms(1));
    assert_eq!(
        h.p_results(),
        vec![PrefillOutcome::Released(ReleaseCause::LeaseExpired)]
    );
    assert_eq!(h.p().stats().tombstones, 1);
    h.assert_no_leak();
    h.advance(h.p().config().tombstone_ttl);
    assert_eq!(
        h.p().stats().tombstones,
        0,
        "tombstones are bounded in time"
    );
}

// Scenario: D dies while P writes: the write to the dead agent fails (measured), P releases
// its blocks and, no longer hearing D, declares it dead (P-side twin of the D hang).
#[test]
fn d_death_during_the_write_releases_p() {
    let mut h = writing();
    h.advance(ms(200));
    h.crash(&d_addr());
    assert_eq!(
        h.p_results(),
        vec![PrefillOutcome::Released(ReleaseCause::WriteFailed(
            WriteFailure::TransferFailed
        ))]
    );
    h.advance(ms(500));
    assert_eq!(h.nodes[&p_addr()].invalidated.len(), 1);
    assert_eq!(h.p().counters().peers_declared_dead, 1);
    h.assert_no_leak();
}

// -------------------------------------------------------------------------------------------
// Restarts and retries
// -------------------------------------------------------------------------------------------

// Scenario: P restarts (PeerConnected again while connected): the old incarnation is dead
// (the transport replaced it before reporting the new one), so D fails its requests without
// cutting the new incarnation; their blocks stay fenced for the quarantine.
#[test]
fn p_restart_fails_the_old_incarnation() {
    let mut h = writing();
    h.advance(ms(50));
    h.restart(&p_addr(), Config::fast(), &d_addr());
    assert!(h.d_results().is_empty(), "fenced, not freed");
    let quarantine = h.d().config().quarantine;
    h.advance(quarantine);
    assert_eq!(
        h.d_results(),
        vec![(
            DecodeOutcome::Failed(DecodeFailure::PeerDead),
            FreeProof::DeadPeerFence
        )]
    );
    assert!(
        h.nodes[&d_addr()].invalidated.is_empty(),
        "invalidating now would cut the new incarnation"
    );
    assert!(h.writes.is_empty(), "the old incarnation's write is cut");
    assert!(h.landings.is_empty());
    assert_eq!(h.d().counters().peers_declared_dead, 1);

    // The new incarnation serves new requests.
    h.prefill(prefill_start(2, &[20])).unwrap();
    h.decode(decode_start(2, &[600])).unwrap();
    h.complete_writes();
    assert_eq!(h.d_results()[1].0, DecodeOutcome::Ready);
    assert_eq!(h.p_results(), vec![PrefillOutcome::Sent]);
    h.assert_no_leak();
}

// Scenario: P restarts while D's request is still connecting: nothing was exposed, so the
// request simply registers with the new incarnation.
#[test]
fn p_restart_while_d_connects_registers_with_the_new_one() {
    let mut h = Harness::new();
    h.connect(&d_addr(), &p_addr());
    h.advance(ms(50));
    h.restart(&p_addr(), Config::fast(), &d_addr());
    h.decode(decode_start(1, &[500])).unwrap();
    h.prefill(prefill_start(1, &[10])).unwrap();
    h.complete_writes();
    assert_eq!(
        h.d_results(),
        vec![(DecodeOutcome::Ready, FreeProof::WritesCompleted)]
    );
    h.assert_no_leak();
}

// Scenario: D retries a key it cancelled (new request id, same pairing key): the retry runs at
// a newer epoch, and P serves it when its prefill finishes.
#[test]
fn retry_at_a_newer_epoch_after_a_cancel_is_served() {
    let mut h = Harness::new();
    h.decode(decode_start(1, &[500])).unwrap();
    h.abort(&d_addr(), d_request(1)).unwrap();
    assert_eq!(
        h.d_results()[0],
        (
            DecodeOutcome::Failed(DecodeFailure::Aborted),
            FreeProof::CancelAcknowledged
        )
    );
    let retry_id = RequestId::new(format!("cmpl-{}-0-cccccccc", uuid(1))).unwrap();
    let mut retry = decode_start(1, &[700]);
    retry.request = retry_id.clone();
    retry.key = PairingKey::from_request_id(&retry_id);
    h.decode(retry).unwrap();
    assert_eq!(
        h.p().stats().pending_registrations,
        1,
        "the retry waits on P"
    );

    h.prefill(prefill_start(1, &[10])).unwrap();
    assert_eq!(h.posted.len(), 1, "P writes the retry's blocks");
    assert_eq!(h.posted[0].1.epoch, Epoch(2));
    h.complete_writes();
    let d = h.events_d();
    assert!(
        matches!(&d[1], EndpointEvent::Decode { outcome: DecodeOutcome::Ready, epoch, .. } if *epoch == Epoch(2))
    );
    h.assert_no_leak();
}

// Scenario: a retry of a key that ended (Ready) runs at the next epoch; the old epoch's late
// messages are ignored.
#[test]
fn retry_after_ready_runs_at_the_next_epoch() {
    let mut h = Harness::new();
    h.prefill(prefill_start(1, &[10])).unwrap();
    h.decode(decode_start(1, &[500])).unwrap();
    h.complete_writes();
    let retry_id = RequestId::new(format!("cmpl-{}-0-cccccccc", uuid(1))).unwrap();
    let mut retry = decode_start(1, &[700]);
    retry.request = retry_id;
    h.decode(retry).unwrap();
    let regs: Vec<_> = h
        .sent
        .iter()
        .filter_map(|(_, e)| match &e.message {
            Message::Register(r) => Some(r.epoch),
            _ => None,
        })
        .collect();
    assert_eq!(regs, vec![Epoch(1), Epoch(2)]);
    // P no longer holds blocks for the key: the retry fails fast instead of waiting.
    assert_eq!(
        h.d_results()[1],
        (
            DecodeOutcome::Failed(DecodeFailure::WriteFailed(WriteFailure::Unavailable)),
            FreeProof::PeerQuiesced
        )
    );
    h.assert_no_leak();
}

// -------------------------------------------------------------------------------------------
// Confused or foreign peers
// -------------------------------------------------------------------------------------------

// Scenario: a network partition during the write (both sides alive, nothing gets through, not
// even a new dial): each side declares the other dead and invalidates it; D dials P again while
// the death fences its request, and every dial fails; nothing lands and both sides end.
#[test]
fn partition_during_the_write_ends_both_sides_without_landing() {
    let mut h = writing();
    h.set_filter(|_| Rule::Drop);
    h.connect_mode = ConnectMode::Fail(ConnectFailure::TimedOut);
    h.advance(ms(1_000));
    let quarantine = h.d().config().quarantine;
    h.advance(quarantine);
    assert_eq!(
        h.d_results(),
        vec![(
            DecodeOutcome::Failed(DecodeFailure::PeerDead),
            FreeProof::DeadPeerFence
        )]
    );
    assert_eq!(h.p_results().len(), 1);
    assert!(matches!(
        h.p_results()[0],
        PrefillOutcome::Released(
            ReleaseCause::PeerDead | ReleaseCause::WriteFailed(WriteFailure::TransferFailed)
        )
    ));
    assert!(h.landings.is_empty());
    assert_eq!(h.nodes[&d_addr()].invalidated.len(), 1);
    assert_eq!(h.nodes[&p_addr()].invalidated.len(), 1);
    h.assert_no_leak();
}

// Scenario: a completion notification for D's key from another prefill engine (a connected
// but unrelated peer) is ignored: it cannot make D Ready on someone else's data.
#[test]
fn notification_from_another_prefill_engine_is_ignored() {
    let mut h = writing();
    let other = kvhandoff_protocol::PeerAddr::new(engine("other-prefill"), 0);
    h.add_endpoint(other.clone(), Config::fast());
    h.connect(&other, &d_addr());
    let done = Message::WriteDone(kvhandoff_protocol::WriteDone {
        key: key(1),
        epoch: Epoch::FIRST,
        prefill_rank: 0,
        digests: Vec::new(),
    });
    h.inject(&other, &d_addr(), done);
    assert_eq!(h.d().counters().dropped(DropReason::Unexpected), 1);
    assert!(h.events_d().is_empty());
    h.complete_writes();
    assert_eq!(h.d_results()[0].0, DecodeOutcome::Ready);
}

// Scenario: a heartbeat claiming another engine than its sender renews nothing.
#[test]
fn heartbeat_naming_another_engine_is_dropped() {
    let mut h = Harness::new();
    h.prefill(prefill_start(1, &[10])).unwrap();
    h.connect(&d_addr(), &p_addr());
    let hb = Message::Heartbeat(kvhandoff_protocol::Heartbeat {
        engine: engine("someone-else"),
        leases: vec![kvhandoff_protocol::LeaseRef {
            key: key(1),
            epoch: Epoch::FIRST,
        }],
    });
    let renewed = h.p().counters().leases_renewed;
    h.inject(&d_addr(), &p_addr(), hb);
    assert_eq!(h.p().counters().dropped(DropReason::Unexpected), 1);
    assert_eq!(h.p().counters().leases_renewed, renewed);
}

// Scenario: a stray Release for a key whose write is in flight (a confused or stale D) does
// not stop the write or free P's blocks under it.
#[test]
fn stray_release_does_not_stop_a_write_in_flight() {
    let mut h = writing();
    let release = Message::Release(kvhandoff_protocol::Release {
        key: key(1),
        epoch: Epoch::FIRST,
        reason: ReleaseReason::Aborted,
    });
    h.inject(&d_addr(), &p_addr(), release);
    assert!(h.p_results().is_empty(), "blocks under a write stay held");
    assert_eq!(h.writes.len(), 1);
    h.complete_writes();
    assert_eq!(h.p_results(), vec![PrefillOutcome::Sent]);
    assert_eq!(h.d_results()[0].0, DecodeOutcome::Ready);
    h.assert_no_leak();
}

// Scenario (harness self-check, and the protocol's one assumption): a registration replayed to
// a P that forgot the key (a restart wiped its tombstones) is served, and the write lands in
// blocks D already handed back. The ghost must flag it. The machines cannot prevent this: it
// needs a message older than every tombstone, which the protocol assumes never arrives.
#[test]
fn ghost_flags_a_landing_into_handed_back_blocks() {
    let mut h = Harness::new();
    h.prefill(prefill_start(1, &[10])).unwrap();
    h.decode(decode_start(1, &[500])).unwrap();
    h.complete_writes();
    assert_eq!(h.d_results()[0].0, DecodeOutcome::Ready);
    let register = h
        .sent
        .iter()
        .find(|(_, e)| is_register(&e.message))
        .unwrap()
        .1
        .clone();

    h.restart(&p_addr(), Config::fast(), &d_addr());
    h.prefill(prefill_start(1, &[10])).unwrap();
    h.inject(&d_addr(), &p_addr(), register.message);
    let w = h.the_write();
    h.complete_write(&w);
    assert_eq!(h.violations.len(), 1, "{:?}", h.violations);
    assert!(h.violations[0].contains("after D handed them back"));
    h.violations.clear();
}

// Scenario: P's first CancelAck is lost: D's cancel resend is answered again (P remembers the
// cancel), and D frees with proof at the resend, not at the quarantine.
#[test]
fn lost_cancel_ack_is_recovered_by_the_resend() {
    let mut h = Harness::new();
    h.decode(decode_start(1, &[500])).unwrap();
    let mut acks_dropped = 0;
    h.set_filter(move |e| match e.message {
        Message::CancelAck(_) if acks_dropped == 0 => {
            acks_dropped += 1;
            Rule::Drop
        }
        _ => Rule::Deliver,
    });
    h.abort(&d_addr(), d_request(1)).unwrap();
    assert!(h.events_d().is_empty(), "the first ack was lost");
    h.advance(h.d().config().cancel_retry_interval);
    assert_eq!(h.d().counters().cancel_resends, 1);
    assert_eq!(
        h.d_results(),
        vec![(
            DecodeOutcome::Failed(DecodeFailure::Aborted),
            FreeProof::CancelAcknowledged
        )]
    );
    assert_eq!(h.d().counters().quarantine_frees, 0);
    h.assert_no_leak();
}

// Scenario: D's engine shuts down while P's write is in flight. D cancels with reason Shutdown
// and still hands its blocks back only after P drained and answered; new requests are refused.
// P's engine shutting down aborts its held requests at once.
#[test]
fn shutdown_cancels_and_still_waits_for_the_proof() {
    let mut h = writing();
    h.call(&d_addr(), EndpointCall::Shutdown).unwrap();
    assert_eq!(
        h.count_sent(&d_addr(), |m| matches!(
            m,
            Message::Cancel(c) if c.reason == kvhandoff_protocol::CancelReason::Shutdown
        )),
        1
    );
    assert_eq!(
        h.decode(decode_start(2, &[600])),
        Err(Rejected::ShuttingDown),
        "no new request after shutdown"
    );
    h.advance(ms(300));
    assert!(
        h.events_d().is_empty(),
        "no D event while the write may still land"
    );
    let w = h.the_write();
    h.complete_write(&w);
    let results = h.d_results();
    assert_eq!(results.len(), 1);
    assert_eq!(results[0].0, DecodeOutcome::Failed(DecodeFailure::Shutdown));
    assert!(
        matches!(
            results[0].1,
            FreeProof::WritesCompleted | FreeProof::CancelAcknowledged
        ),
        "{results:?}"
    );
    assert!(!h.d().has_pending_work());

    // P's engine shuts down with a request held: released at once, and nothing new is taken.
    h.prefill(prefill_start(3, &[20])).unwrap();
    h.call(&p_addr(), EndpointCall::Shutdown).unwrap();
    assert!(h
        .p_results()
        .contains(&PrefillOutcome::Released(ReleaseCause::Aborted)));
    assert_eq!(
        h.prefill(prefill_start(4, &[21])),
        Err(Rejected::ShuttingDown)
    );
    h.assert_no_leak();
}

// -------------------------------------------------------------------------------------------
// Engine inputs past the limits: typed refusals, nothing changes
// -------------------------------------------------------------------------------------------

// Scenario: a block list larger than a message can carry (it would have panicked in the codec)
// and an epoch past `Epoch::MAX` are refused at the call with typed errors; nothing is sent or
// held, and the endpoint goes on serving.
#[test]
fn block_lists_and_epochs_past_the_limits_are_refused_typed() {
    use kvhandoff_protocol::{BlockIds, FieldError, MAX_BLOCKS_PER_GROUP};
    let mut h = Harness::new();
    let too_many: Vec<u32> = (0..=MAX_BLOCKS_PER_GROUP as u32).collect();
    let mut start = decode_start(1, &[500]);
    start.blocks = BlockIds::single_group(too_many.clone());
    assert!(matches!(
        h.decode(start),
        Err(Rejected::BlockList(FieldError::TooMany { .. }))
    ));
    let mut start = prefill_start(1, &[10]);
    start.blocks = BlockIds::single_group(too_many);
    assert!(matches!(
        h.prefill(start),
        Err(Rejected::BlockList(FieldError::TooMany { .. }))
    ));
    let mut start = decode_start(1, &[500, 500]);
    start.blocks = BlockIds::single_group(vec![500, 500]);
    assert!(matches!(
        h.decode(start),
        Err(Rejected::BlockList(FieldError::DuplicateBlock {
            block: 500
        }))
    ));
    for bad in [Epoch(0), Epoch(Epoch::MAX.0 + 1), Epoch(u64::MAX)] {
        let mut start = decode_start(1, &[500]);
        start.epoch = bad;
        assert_eq!(h.decode(start), Err(Rejected::EpochOutOfRange(bad)));
    }
    assert!(h.d().stats().decode_requests == 0 && h.p().stats().prefill_requests == 0);
    // A key whose last attempt used Epoch::MAX cannot be retried: refused, typed.
    let mut last = decode_start(1, &[500]);
    last.epoch = Epoch::MAX;
    h.decode(last).unwrap();
    h.prefill(prefill_start(1, &[10])).unwrap();
    h.complete_writes();
    assert_eq!(h.d_results()[0].0, DecodeOutcome::Ready);
    let retry = decode_start(1, &[501]);
    assert_eq!(h.decode(retry), Err(Rejected::EpochOutOfRange(Epoch::MAX)));
    // The endpoint still serves other keys.
    h.decode(decode_start(2, &[600])).unwrap();
    h.prefill(prefill_start(2, &[20])).unwrap();
    h.complete_writes();
    assert_eq!(h.d_results()[1].0, DecodeOutcome::Ready);
    h.assert_no_leak();
}
