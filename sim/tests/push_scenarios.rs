//! End-to-end push scenarios on two real endpoints: our terms for the applicable cases of
//! vLLM's `test_nixl_push_connector.py` (reference §10.1; numbers in comments refer to it).

use kvhandoff_protocol::machine::{
    DecodeFailure, DecodeOutcome, DropReason, FreeProof, NetEvent, PrefillOutcome, PrefillStart,
    Rejected, ReleaseCause,
};
use kvhandoff_protocol::{
    BlockIds, Epoch, Message, PairingKey, Register, ReleaseReason, RequestId, WireError, WriteDone,
    WriteFailure,
};
use kvhandoff_sim::scripted::*;

/// The one write posted so far.
fn only_posted(h: &Harness) -> kvhandoff_protocol::machine::WriteOrder {
    assert_eq!(h.posted.len(), 1, "exactly one WRITE: {:?}", h.posted);
    h.posted[0].1.clone()
}

// -------------------------------------------------------------------------------------------
// The two races (§3.2; 7, 8, 11)
// -------------------------------------------------------------------------------------------

// Scenario: D registers first (§10.1 #8, #11). The registration waits on P; P's finish matches
// it and fires exactly one WRITE; D is Ready and P Sent.
#[test]
fn d_registers_first_completes_with_one_write() {
    let mut h = Harness::new();
    h.decode(decode_start(1, &[500, 501, 502])).unwrap();
    assert_eq!(h.count_sent(&d_addr(), is_register), 1);
    assert_eq!(h.p().stats().pending_registrations, 1);
    assert!(h.posted.is_empty(), "nothing fires before P finishes");

    h.prefill(prefill_start(1, &[10, 11, 12])).unwrap();
    let order = only_posted(&h);
    assert_eq!(order.to, d_addr());
    assert_eq!(order.local, blocks(&[10, 11, 12]));
    assert_eq!(order.remote, blocks(&[500, 501, 502]));
    assert_eq!(h.p().counters().decode_registered_first, 1);
    assert_eq!(h.p().counters().prefill_finished_first, 0);
    assert!(h.events_d().is_empty(), "D waits for the data");

    h.complete_writes();
    assert_eq!(
        h.d_results(),
        vec![(DecodeOutcome::Ready, FreeProof::WritesCompleted)]
    );
    assert_eq!(h.p_results(), vec![PrefillOutcome::Sent]);
    assert_eq!(h.p().counters().writes_posted, 1);
    h.assert_no_leak();
}

// Scenario: P finishes first (§10.1 #7). P holds its blocks under a lease; D's registration
// matches them and fires exactly one WRITE.
#[test]
fn p_finishes_first_completes_with_one_write() {
    let mut h = Harness::new();
    h.prefill(prefill_start(1, &[10, 11, 12])).unwrap();
    assert_eq!(h.p().stats().prefill_requests, 1);
    assert!(h.posted.is_empty());

    h.decode(decode_start(1, &[500, 501, 502])).unwrap();
    let order = only_posted(&h);
    assert_eq!(order.remote, blocks(&[500, 501, 502]));
    assert_eq!(h.p().counters().prefill_finished_first, 1);
    assert_eq!(h.p().counters().decode_registered_first, 0);

    h.complete_writes();
    assert_eq!(
        h.d_results(),
        vec![(DecodeOutcome::Ready, FreeProof::WritesCompleted)]
    );
    assert_eq!(h.p_results(), vec![PrefillOutcome::Sent]);
    h.assert_no_leak();
}

// Scenario: the WRITE's notification reaches D only after the data (NIXL's rule): D is not
// Ready when P learns of the completion if the notification is still on its way.
#[test]
fn d_is_ready_only_when_the_notification_arrives() {
    let mut h = Harness::new();
    h.prefill(prefill_start(1, &[10])).unwrap();
    h.decode(decode_start(1, &[500])).unwrap();
    h.set_filter(|e| match e.message {
        Message::WriteDone(_) => Rule::Hold,
        _ => Rule::Deliver,
    });
    h.complete_writes();
    assert_eq!(h.p_results(), vec![PrefillOutcome::Sent]);
    assert!(h.events_d().is_empty(), "no notification, no Ready");
    assert_eq!(h.landings.len(), 1);
    h.deliver_all_held();
    assert_eq!(
        h.d_results(),
        vec![(DecodeOutcome::Ready, FreeProof::WritesCompleted)]
    );
    h.assert_no_leak();
}

// -------------------------------------------------------------------------------------------
// Pairing (§3.2; 9, 27)
// -------------------------------------------------------------------------------------------

// Scenario: suffix-stripped pairing (§10.1 #9). P's `cmpl-<uuid>-0-aaaaaaaa` and D's
// `cmpl-<uuid>-0-bbbbbbbb` derive the same key and match; the write names that key.
#[test]
fn random_suffixes_are_stripped_for_pairing() {
    let (p_id, d_id) = (p_request(7), d_request(7));
    assert_ne!(p_id, d_id);
    assert!(p_id.as_str().ends_with("-0-aaaaaaaa"));
    assert!(d_id.as_str().ends_with("-0-bbbbbbbb"));
    assert_eq!(
        PairingKey::from_request_id(&p_id),
        PairingKey::from_request_id(&d_id)
    );

    let mut h = Harness::new();
    h.prefill(prefill_start(7, &[1, 2])).unwrap();
    h.decode(decode_start(7, &[3, 4])).unwrap();
    assert_eq!(only_posted(&h).key, key(7));
    h.complete_writes();
    let d_events = h.events_d();
    assert_eq!(d_events[0].request(), &d_id);
    assert_eq!(h.events_p()[0].request(), &p_id);
    assert_eq!(h.d_results()[0].0, DecodeOutcome::Ready);
    h.assert_no_leak();
}

// Scenario: different uuids do not pair (§10.1 #27): both sides wait, nothing fires, and each
// ends on its own timer (P's lease; D's deadline with a cancel P acknowledges).
#[test]
fn different_uuids_do_not_pair() {
    assert_ne!(key(1), key(2));
    let mut h = Harness::new();
    h.prefill(prefill_start(1, &[10, 11])).unwrap();
    h.decode(decode_start(2, &[500, 501])).unwrap();
    assert!(h.posted.is_empty());
    let stats = h.p().stats();
    assert_eq!(
        (stats.prefill_requests, stats.pending_registrations),
        (1, 1),
        "both wait unmatched"
    );

    h.advance(h.p().config().lease_duration);
    assert_eq!(
        h.p_results(),
        vec![PrefillOutcome::Released(ReleaseCause::LeaseExpired)]
    );
    h.advance(h.d().config().decode_deadline);
    assert_eq!(
        h.d_results(),
        vec![(
            DecodeOutcome::Failed(DecodeFailure::Deadline),
            FreeProof::CancelAcknowledged
        )]
    );
    assert!(h.posted.is_empty());
    h.assert_no_leak();
}

// Scenario: the completion index is part of the key: `cmpl-<uuid>-0-…` and `cmpl-<uuid>-1-…`
// are different prompts of one batch and never pair.
#[test]
fn completion_index_is_kept_in_the_key() {
    let zero = RequestId::new(format!("cmpl-{}-0-aaaaaaaa", uuid(3))).unwrap();
    let one = RequestId::new(format!("cmpl-{}-1-bbbbbbbb", uuid(3))).unwrap();
    assert_ne!(
        PairingKey::from_request_id(&zero),
        PairingKey::from_request_id(&one)
    );
    let mut h = Harness::new();
    let mut p = prefill_start(3, &[10]);
    p.key = PairingKey::from_request_id(&zero);
    p.request = zero;
    let mut d = decode_start(3, &[500]);
    d.key = PairingKey::from_request_id(&one);
    d.request = one;
    h.prefill(p).unwrap();
    h.decode(d).unwrap();
    assert!(
        h.posted.is_empty(),
        "different completion indices must not pair"
    );
    assert_eq!(h.p().stats().pending_registrations, 1);
}

// -------------------------------------------------------------------------------------------
// Malformed input (§3.2; 10, 28, 29)
// -------------------------------------------------------------------------------------------

// Scenario: undecodable bytes (§10.1 #10): counted as Malformed, nothing stashed or fired.
#[test]
fn malformed_bytes_are_counted_and_dropped() {
    let mut h = Harness::new();
    h.prefill(prefill_start(1, &[10])).unwrap();
    let before = h.p().stats();
    h.event(
        &p_addr(),
        NetEvent::Malformed {
            from: Some(d_addr()),
            error: WireError::TruncatedHeader { len: 3 },
        },
    );
    h.event(
        &p_addr(),
        NetEvent::Malformed {
            from: None,
            error: WireError::UnknownKind { code: 0xff },
        },
    );
    assert_eq!(h.p().counters().dropped(DropReason::Malformed), 2);
    assert_eq!(h.p().stats(), before, "nothing changed");
    assert!(h.posted.is_empty() && h.sent.is_empty());
}

/// D's registration for request `n`, as D would send it.
fn register(n: u32, ids: &[u32]) -> Register {
    Register {
        key: key(n),
        epoch: Epoch::FIRST,
        decode_engine: engine("decode"),
        decode_request: d_request(n),
        decode_rank: 0,
        blocks: blocks(ids),
        num_tokens: 16,
        trace_id: kvhandoff_protocol::TraceId::from_u128(0x7ace + u128::from(n)),
        memory: Vec::new(),
    }
}

// Scenario: a registration naming another decode engine (or rank) than its sender is dropped
// (P would otherwise write into the blocks of a rank that never offered them).
#[test]
fn register_not_matching_its_sender_is_dropped() {
    let mut h = Harness::new();
    h.prefill(prefill_start(1, &[10])).unwrap();
    h.connect(&d_addr(), &p_addr());

    let mut other_engine = register(1, &[500]);
    other_engine.decode_engine = engine("someone-else");
    h.inject(
        &d_addr(),
        &p_addr(),
        Message::Register(Box::new(other_engine)),
    );
    let mut other_rank = register(1, &[500]);
    other_rank.decode_rank = 3;
    h.inject(
        &d_addr(),
        &p_addr(),
        Message::Register(Box::new(other_rank)),
    );

    assert_eq!(h.p().counters().dropped(DropReason::Unexpected), 2);
    assert!(h.posted.is_empty());
    assert_eq!(h.p().stats().pending_registrations, 0);
    assert_eq!(
        h.p().stats().prefill_requests,
        1,
        "the held blocks are untouched"
    );

    // The genuine registration still matches.
    h.inject(
        &d_addr(),
        &p_addr(),
        Message::Register(Box::new(register(1, &[500]))),
    );
    assert_eq!(h.posted.len(), 1);
}

// Scenario: a message from a peer that never connected is dropped as UnknownPeer, and does not
// create a peer entry.
#[test]
fn message_from_unconnected_peer_is_dropped() {
    let mut h = Harness::new();
    h.prefill(prefill_start(1, &[10])).unwrap();
    let peers_before = h.p().stats().peers;
    h.inject(
        &d_addr(),
        &p_addr(),
        Message::Register(Box::new(register(1, &[500]))),
    );
    assert_eq!(h.p().counters().dropped(DropReason::UnknownPeer), 1);
    assert_eq!(h.p().stats().peers, peers_before);
    assert!(h.posted.is_empty());
    assert_eq!(h.p().stats().pending_registrations, 0);
}

// -------------------------------------------------------------------------------------------
// Duplicate registration (§3.2; 30; §9.4.3)
// -------------------------------------------------------------------------------------------

// Scenario: the same registration twice before the match (§10.1 #30): one pending entry, one
// WRITE once P finishes, nothing left behind.
#[test]
fn duplicate_registration_before_match_is_idempotent() {
    let mut h = Harness::new();
    h.set_filter(|e| {
        if is_register(&e.message) {
            Rule::Duplicate
        } else {
            Rule::Deliver
        }
    });
    h.decode(decode_start(1, &[500, 501])).unwrap();
    assert_eq!(h.p().stats().pending_registrations, 1);
    assert_eq!(h.p().counters().dropped(DropReason::Duplicate), 1);

    h.prefill(prefill_start(1, &[10, 11])).unwrap();
    assert_eq!(h.posted.len(), 1);
    h.complete_writes();
    assert_eq!(h.d_results()[0].0, DecodeOutcome::Ready);
    assert_eq!(h.posted.len(), 1, "exactly one WRITE");
    h.assert_no_leak();
}

// Scenario: a duplicate arriving after the match (vLLM stashes it forever, §9.4.3): dropped,
// one WRITE, no leak.
#[test]
fn duplicate_registration_after_match_is_idempotent() {
    let mut h = Harness::new();
    h.prefill(prefill_start(1, &[10, 11])).unwrap();
    h.set_filter(|e| {
        if is_register(&e.message) {
            Rule::Duplicate
        } else {
            Rule::Deliver
        }
    });
    h.decode(decode_start(1, &[500, 501])).unwrap();
    assert_eq!(h.posted.len(), 1);
    assert_eq!(h.p().counters().dropped(DropReason::Duplicate), 1);
    assert_eq!(h.p().stats().pending_registrations, 0);
    h.complete_writes();
    assert_eq!(h.posted.len(), 1);
    assert_eq!(h.d_results()[0].0, DecodeOutcome::Ready);
    h.assert_no_leak();
}

// -------------------------------------------------------------------------------------------
// Watchdog (§4; 6)
// -------------------------------------------------------------------------------------------

// Scenario: D registered, P never finishes (§10.1 #6, but hard): at D's deadline D cancels,
// P acks, D fails with proof CancelAcknowledged; P's later finish releases its blocks at once.
#[test]
fn watchdog_deadline_cancels_and_p_acks() {
    let mut h = Harness::new();
    h.decode(decode_start(1, &[500])).unwrap();
    h.advance(ms(4_999));
    assert!(h.events_d().is_empty(), "not before the deadline");
    h.advance(ms(1));
    assert_eq!(h.count_sent(&d_addr(), is_cancel), 1);
    assert_eq!(
        h.d_results(),
        vec![(
            DecodeOutcome::Failed(DecodeFailure::Deadline),
            FreeProof::CancelAcknowledged
        )]
    );
    assert_eq!(h.p().stats().pending_registrations, 0);

    h.prefill(prefill_start(1, &[10])).unwrap();
    assert_eq!(
        h.p_results(),
        vec![PrefillOutcome::Released(ReleaseCause::CancelledByPeer)]
    );
    assert!(h.posted.is_empty());
    h.assert_no_leak();
}

// Scenario: P finished, D's registration is lost: D's heartbeats keep P's lease; D's deadline
// cancels, P acks and releases its held blocks.
#[test]
fn watchdog_deadline_releases_p_held_blocks() {
    let mut h = Harness::new();
    h.prefill(prefill_start(1, &[10])).unwrap();
    h.set_filter(|e| {
        if is_register(&e.message) {
            Rule::Drop
        } else {
            Rule::Deliver
        }
    });
    h.decode(decode_start(1, &[500])).unwrap();
    h.advance(ms(5_000));
    assert_eq!(
        h.d_results(),
        vec![(
            DecodeOutcome::Failed(DecodeFailure::Deadline),
            FreeProof::CancelAcknowledged
        )]
    );
    assert_eq!(
        h.p_results(),
        vec![PrefillOutcome::Released(ReleaseCause::CancelledByPeer)]
    );
    assert_eq!(
        h.event_time(&p_addr(), &p_request(1)),
        Some(h.now),
        "released by the cancel, not by its lease"
    );
    h.assert_no_leak();
}

// -------------------------------------------------------------------------------------------
// Empty blocks and full prefix hits (§3.3; 21, 23)
// -------------------------------------------------------------------------------------------

// Scenario: P finishes with empty blocks (§10.1 #23): released at once, no lease, no write.
#[test]
fn p_empty_blocks_are_released_at_once() {
    let mut h = Harness::new();
    h.prefill(prefill_start(1, &[])).unwrap();
    assert_eq!(
        h.p_results(),
        vec![PrefillOutcome::Released(ReleaseCause::Empty)]
    );
    assert_eq!(h.p().stats().prefill_requests, 0, "no lease");
    assert!(h.posted.is_empty());
    h.assert_no_leak();
}

// Scenario: D registered, then P finishes with nothing to send: D learns at once (not at its
// deadline) that no write will come.
#[test]
fn p_empty_blocks_fail_a_waiting_registration_fast() {
    let mut h = Harness::new();
    h.decode(decode_start(1, &[500])).unwrap();
    h.prefill(prefill_start(1, &[])).unwrap();
    assert_eq!(
        h.d_results(),
        vec![(
            DecodeOutcome::Failed(DecodeFailure::WriteFailed(WriteFailure::Unavailable)),
            FreeProof::PeerQuiesced
        )]
    );
    assert_eq!(h.now, kvhandoff_protocol::machine::Time::ZERO);
    h.assert_no_leak();
}

// Scenario: as above, but the network delivers a copy of D's registration late, after P
// finished a new request for the same key. P answered that registration when its empty prefill
// ended, so the copy is below the key's floor: dropped Late, no WRITE into blocks D freed.
#[test]
fn p_empty_blocks_answer_keeps_a_late_copy_of_the_registration_away_from_later_blocks() {
    let mut h = Harness::new();
    h.set_filter(|e| {
        if is_register(&e.message) {
            Rule::Hold
        } else {
            Rule::Deliver
        }
    });
    h.decode(decode_start(1, &[500])).unwrap();
    assert_eq!(h.duplicate_held_where(|e| is_register(&e.message)), 1);
    h.clear_filter();
    h.deliver_held_next().expect("the registration");
    assert_eq!(h.p().stats().pending_registrations, 1);

    h.prefill(prefill_start(1, &[])).unwrap();
    assert_eq!(
        h.d_results(),
        vec![(
            DecodeOutcome::Failed(DecodeFailure::WriteFailed(WriteFailure::Unavailable)),
            FreeProof::PeerQuiesced
        )]
    );

    // P runs the request again: new blocks under the same key, held for a registration.
    let again = RequestId::new("prefill-1-again").unwrap();
    h.prefill(PrefillStart {
        request: again.clone(),
        key: key(1),
        blocks: blocks(&[10, 11]),
    })
    .unwrap();
    assert_eq!(h.p().stats().prefill_requests, 1);

    let copy = h.deliver_held_next().expect("the copy");
    assert!(is_register(&copy.message));
    assert!(h.held.is_empty());
    assert!(
        h.posted.is_empty(),
        "the copy must not reach the new blocks"
    );
    assert_eq!(h.p().counters().dropped(DropReason::Late), 1);
    assert_eq!(h.p().counters().writes_posted, 0);
    assert_eq!(
        h.p().stats().prefill_requests,
        1,
        "the new blocks stay held"
    );

    h.abort(&p_addr(), again).unwrap();
    assert_eq!(
        h.p_results(),
        vec![
            PrefillOutcome::Released(ReleaseCause::Empty),
            PrefillOutcome::Released(ReleaseCause::Aborted)
        ]
    );
    h.assert_no_leak();
}

// Scenario: full prefix hit on D (§10.1 #21): D registers nothing, is Ready at once with
// nothing exposed, and tells P to release its held blocks at once (vLLM: lease only).
#[test]
fn d_full_prefix_hit_releases_p_at_once() {
    let mut h = Harness::new();
    h.prefill(prefill_start(1, &[10, 11])).unwrap();
    h.decode(decode_start(1, &[])).unwrap();
    assert_eq!(
        h.d_results(),
        vec![(DecodeOutcome::Ready, FreeProof::NeverExposed)]
    );
    assert_eq!(h.count_sent(&d_addr(), is_register), 0);
    assert_eq!(
        h.p_results(),
        vec![PrefillOutcome::Released(ReleaseCause::ReleasedByPeer(
            ReleaseReason::FullPrefixHit
        ))]
    );
    assert!(h.posted.is_empty());
    assert_eq!(h.now, kvhandoff_protocol::machine::Time::ZERO);
    h.assert_no_leak();
}

// Scenario: the Release of a full prefix hit arrives before P finishes: P remembers it and
// releases its blocks the moment they finish.
#[test]
fn d_full_prefix_hit_release_before_p_finishes() {
    let mut h = Harness::new();
    h.decode(decode_start(1, &[])).unwrap();
    assert_eq!(
        h.d_results()[0],
        (DecodeOutcome::Ready, FreeProof::NeverExposed)
    );
    assert_eq!(
        h.count_sent(&d_addr(), |m| matches!(m, Message::Release(_))),
        1
    );
    h.advance(ms(200));
    h.prefill(prefill_start(1, &[10, 11])).unwrap();
    assert_eq!(
        h.p_results(),
        vec![PrefillOutcome::Released(ReleaseCause::ReleasedByPeer(
            ReleaseReason::FullPrefixHit
        ))]
    );
    assert_eq!(h.event_time(&p_addr(), &p_request(1)), Some(h.now));
    assert!(h.posted.is_empty());
    h.assert_no_leak();
}

// -------------------------------------------------------------------------------------------
// Unknown requests (§10.1 #24, #33)
// -------------------------------------------------------------------------------------------

// Scenario: the engine aborts an id no side knows: refused with UnknownRequest, nothing sent.
#[test]
fn abort_of_unknown_request_is_rejected() {
    let mut h = Harness::new();
    for side in [d_addr(), p_addr()] {
        let id = RequestId::new("never-heard-of-you").unwrap();
        assert_eq!(
            h.abort(&side, id.clone()),
            Err(Rejected::UnknownRequest(id))
        );
    }
    assert!(h.sent.is_empty());
    h.assert_no_leak();
}

// Scenario: a completion notification for a key D never saw (§10.1 #33): dropped UnknownKey,
// no request created.
#[test]
fn write_done_for_unknown_key_is_dropped() {
    let mut h = Harness::new();
    h.decode(decode_start(1, &[500])).unwrap();
    let done = Message::WriteDone(WriteDone {
        key: key(99),
        epoch: Epoch::FIRST,
        prefill_rank: 0,
        digests: Vec::new(),
    });
    h.inject(&p_addr(), &d_addr(), done);
    assert_eq!(h.d().counters().dropped(DropReason::UnknownKey), 1);
    assert_eq!(h.d().stats().decode_requests, 1);
    assert!(h.events_d().is_empty());
}

// Scenario: a second notification after the request ended is recognised as Late, not as a new
// key, and changes nothing.
#[test]
fn write_done_after_the_end_is_late() {
    let mut h = Harness::new();
    h.prefill(prefill_start(1, &[10])).unwrap();
    h.decode(decode_start(1, &[500])).unwrap();
    h.complete_writes();
    assert_eq!(h.d_results().len(), 1);
    let done = Message::WriteDone(WriteDone {
        key: key(1),
        epoch: Epoch::FIRST,
        prefill_rank: 0,
        digests: Vec::new(),
    });
    h.inject(&p_addr(), &d_addr(), done);
    assert_eq!(h.d().counters().dropped(DropReason::Late), 1);
    assert_eq!(h.d_results().len(), 1, "still exactly one event");
    h.assert_no_leak();
}

// -------------------------------------------------------------------------------------------
// Heartbeats keyed by pairing key (§4, §9.4.2; 35)
// -------------------------------------------------------------------------------------------

/// P finished at 0; D's registration is held in the network until 4 s (past the 3 s lease).
fn late_registration(strip_heartbeat_leases: bool) -> Harness {
    let mut h = Harness::new();
    h.set_filter(move |e| match &mut e.message {
        Message::Register(_) => Rule::Hold,
        Message::Heartbeat(hb) if strip_heartbeat_leases => {
            // Still a liveness ping, but it renews nothing.
            hb.leases.clear();
            Rule::Deliver
        }
        _ => Rule::Deliver,
    });
    h.prefill(prefill_start(1, &[10, 11])).unwrap();
    h.decode(decode_start(1, &[500, 501])).unwrap();
    assert!(h.p().config().lease_duration < ms(4_000));
    h.advance(ms(4_000));
    h
}

// Scenario: P finishes first and D's registration comes late, after several heartbeats that
// name the pairing key: the lease is renewed past `lease_duration` and the push completes.
#[test]
fn heartbeats_renew_p_lease_while_d_waits() {
    let mut h = late_registration(false);
    assert!(h.p_results().is_empty(), "the lease did not expire");
    assert!(h.p().counters().leases_renewed >= 10);
    // The registration and each of D's resends of it (nothing had landed) were held.
    let resends = h.d().config().max_register_retries as usize;
    assert_eq!(h.held.len(), 1 + resends);
    assert_eq!(h.d().counters().register_resends, resends as u64);
    h.deliver_all_held();
    assert_eq!(
        h.posted.len(),
        1,
        "P took one copy; the others are duplicates"
    );
    assert_eq!(
        h.p().counters().dropped(DropReason::Duplicate),
        resends as u64
    );
    h.complete_writes();
    assert_eq!(h.p_results(), vec![PrefillOutcome::Sent]);
    assert_eq!(
        h.d_results(),
        vec![(DecodeOutcome::Ready, FreeProof::WritesCompleted)]
    );
    h.assert_no_leak();
}

// Scenario: the same, but the heartbeats renew nothing: the lease expires at 3 s, and the late
// registration is answered with WriteFailed(LeaseExpired) so D fails at once.
#[test]
fn without_renewal_the_lease_expires_and_d_fails_fast() {
    let mut h = late_registration(true);
    assert_eq!(
        h.p_results(),
        vec![PrefillOutcome::Released(ReleaseCause::LeaseExpired)]
    );
    assert_eq!(
        h.event_time(&p_addr(), &p_request(1)),
        Some(kvhandoff_protocol::machine::Time::from_duration(ms(3_000)))
    );
    assert_eq!(h.p().counters().leases_renewed, 0);
    h.deliver_all_held();
    assert!(h.posted.is_empty());
    assert_eq!(
        h.d_results(),
        vec![(
            DecodeOutcome::Failed(DecodeFailure::WriteFailed(WriteFailure::LeaseExpired)),
            FreeProof::PeerQuiesced
        )]
    );
    assert_eq!(h.p().counters().dropped(DropReason::Late), 1);
    h.assert_no_leak();
}

// -------------------------------------------------------------------------------------------
// Prefix-cache trimming (§8.3; 40, 41)
// -------------------------------------------------------------------------------------------

// Scenario: partial prefix hit (§10.1 #40): P [10..14], D registers [500, 501] -> local
// [13, 14] into remote [500, 501].
#[test]
fn partial_prefix_hit_trims_p_blocks() {
    let mut h = Harness::new();
    h.prefill(prefill_start(1, &[10, 11, 12, 13, 14])).unwrap();
    h.decode(decode_start(1, &[500, 501])).unwrap();
    let order = only_posted(&h);
    assert_eq!(order.local, blocks(&[13, 14]));
    assert_eq!(order.remote, blocks(&[500, 501]));
    h.complete_writes();
    // P hands back all of its blocks, not only the written ones.
    match &h.events_p()[0] {
        kvhandoff_protocol::machine::EndpointEvent::Prefill { blocks: b, .. } => {
            assert_eq!(b, &blocks(&[10, 11, 12, 13, 14]));
        }
        other => panic!("{other:?}"),
    }
    h.assert_no_leak();
}

// Scenario: no prefix hit (§10.1 #41): [10, 11, 12] -> [500, 501, 502], untrimmed.
#[test]
fn no_prefix_hit_is_untrimmed() {
    let mut h = Harness::new();
    h.decode(decode_start(1, &[500, 501, 502])).unwrap();
    h.prefill(prefill_start(1, &[10, 11, 12])).unwrap();
    let order = only_posted(&h);
    assert_eq!(order.local, blocks(&[10, 11, 12]));
    assert_eq!(order.remote, blocks(&[500, 501, 502]));
    h.complete_writes();
    h.assert_no_leak();
}

// Scenario: D registers more blocks than P holds: the plan cannot fit, P rejects it at once
// and D fails fast instead of waiting for its deadline.
#[test]
fn registration_larger_than_p_blocks_is_rejected() {
    let mut h = Harness::new();
    h.prefill(prefill_start(1, &[10])).unwrap();
    h.decode(decode_start(1, &[500, 501])).unwrap();
    assert!(h.posted.is_empty());
    assert_eq!(
        h.p_results(),
        vec![PrefillOutcome::Released(ReleaseCause::Rejected)]
    );
    assert_eq!(
        h.d_results(),
        vec![(
            DecodeOutcome::Failed(DecodeFailure::WriteFailed(WriteFailure::PlanMismatch)),
            FreeProof::PeerQuiesced
        )]
    );
    h.assert_no_leak();
}

// -------------------------------------------------------------------------------------------
// Several writers (§5.3; 36)
// -------------------------------------------------------------------------------------------

// Scenario: expected_writes = 2 (§10.1 #36, as TP fan-in): D is Ready only after WriteDone
// from two distinct P ranks; a repeated notification from the same rank does not count.
#[test]
fn two_writes_from_two_ranks_are_needed() {
    let mut h = two_writers();
    assert_eq!(h.posted.len(), 2);
    let writes = h.pending_writes();
    let from_p0 = writes.iter().find(|(a, _)| a == &p_addr()).unwrap().clone();
    let from_p1 = writes
        .iter()
        .find(|(a, _)| a == &p1_addr())
        .unwrap()
        .clone();

    h.complete_write(&from_p0);
    assert!(h.events_d().is_empty(), "one of two writes is not enough");
    let again = Message::WriteDone(WriteDone {
        key: key(1),
        epoch: Epoch::FIRST,
        prefill_rank: 0,
        digests: Vec::new(),
    });
    h.inject(&p_addr(), &d_addr(), again);
    assert_eq!(h.d().counters().dropped(DropReason::Duplicate), 1);
    assert!(
        h.events_d().is_empty(),
        "the same rank twice is still one write"
    );

    h.complete_write(&from_p1);
    assert_eq!(
        h.d_results(),
        vec![(DecodeOutcome::Ready, FreeProof::WritesCompleted)]
    );
    assert_eq!(h.p_results(), vec![PrefillOutcome::Sent]);
    assert_eq!(
        h.events_of(&p1_addr()).len(),
        1,
        "rank 1 ended its request too"
    );
    h.assert_no_leak();
}

// Scenario: a notification for another epoch than D's is ignored (StaleEpoch / FutureEpoch).
#[test]
fn notifications_for_other_epochs_are_ignored() {
    let mut h = Harness::new();
    let mut start = decode_start(1, &[500]);
    start.epoch = Epoch(2);
    h.decode(start).unwrap();
    for (epoch, reason) in [
        (Epoch(1), DropReason::StaleEpoch),
        (Epoch(3), DropReason::FutureEpoch),
    ] {
        let done = Message::WriteDone(WriteDone {
            key: key(1),
            epoch,
            prefill_rank: 0,
            digests: Vec::new(),
        });
        h.inject(&p_addr(), &d_addr(), done);
        assert_eq!(h.d().counters().dropped(reason), 1);
    }
    assert!(h.events_d().is_empty());
    assert_eq!(h.d().stats().decode_requests, 1);
}

// Scenario: hybrid cache groups (§7): trimming is tail-aligned per group, each group by its own
// prefix hit.
#[test]
fn trimming_is_per_cache_group() {
    let mut h = Harness::new();
    let mut p = prefill_start(1, &[]);
    p.blocks = BlockIds {
        groups: vec![vec![10, 11, 12], vec![20, 21, 22]],
    };
    let mut d = decode_start(1, &[]);
    d.blocks = BlockIds {
        groups: vec![vec![500], vec![600, 601]],
    };
    h.prefill(p).unwrap();
    h.decode(d).unwrap();
    let order = only_posted(&h);
    assert_eq!(order.local.groups, vec![vec![12], vec![21, 22]]);
    assert_eq!(order.remote.groups, vec![vec![500], vec![600, 601]]);
    h.complete_writes();
    assert_eq!(h.d_results()[0].0, DecodeOutcome::Ready);
    h.assert_no_leak();
}

// -------------------------------------------------------------------------------------------
// Who may speak for an attempt: a restarted D's retries, and each source rank's own share
// (issue 19, finding 7)
// -------------------------------------------------------------------------------------------

/// Request 1 served once (P `Sent`, D `Ready` at epoch 1), then D restarts. Returns the harness
/// and the first incarnation's registration.
fn served_then_d_restarted() -> (Harness, Message) {
    let mut h = Harness::new();
    h.prefill(prefill_start(1, &[10, 11])).unwrap();
    h.decode(decode_start(1, &[500, 501])).unwrap();
    let old_register = h
        .sent
        .iter()
        .find(|(_, e)| e.from == d_addr() && is_register(&e.message))
        .map(|(_, e)| e.message.clone())
        .expect("D registered");
    h.complete_writes();
    assert_eq!(
        h.d_results(),
        vec![(DecodeOutcome::Ready, FreeProof::WritesCompleted)]
    );
    h.advance(ms(50));
    h.restart(
        &d_addr(),
        kvhandoff_protocol::machine::Config::fast(),
        &p_addr(),
    );
    (h, old_register)
}

/// P's engine prefills request 1's key again (the router's retry), under a new request id.
fn retry_on_p() -> PrefillStart {
    PrefillStart {
        key: key(1),
        ..prefill_start(2, &[20, 21])
    }
}

// Scenario: D restarts and the router retries request 1 with its default epoch 1 on both
// sides. P still remembers the dead incarnation's attempt at (key 1, epoch 1): its floor used to
// swallow every copy of the retry's registration, and D's retry failed at its deadline. P now
// scopes that memory by D's incarnation: the retry is written and Ready. A late copy of the old
// incarnation's registration — which P, shown it after the new handshake (a notification polled
// late), can only take as the new incarnation's — arrives inside the restart window and is
// left unanswered: it never reaches the retry's blocks.
#[test]
fn a_restarted_ds_retry_at_epoch_one_is_served_and_the_old_runs_registration_is_not() {
    let (mut h, old_register) = served_then_d_restarted();
    // The precondition: P ended the key at epoch 1 for the first incarnation, and saw the
    // restart.
    assert_eq!(h.p_results(), vec![PrefillOutcome::Sent]);
    assert_eq!(h.p().counters().peer_restarts, 1);
    h.prefill(retry_on_p()).unwrap();
    // The old incarnation's registration, late.
    h.inject(&d_addr(), &p_addr(), old_register);
    assert_eq!(h.posted.len(), 1, "the old registration reached no blocks");
    assert_eq!(h.p().counters().dropped(DropReason::PriorIncarnation), 1);
    // The retry: its registration waits out the restart window (D repeats it) and is served.
    h.decode(decode_start(1, &[600, 601])).unwrap();
    h.advance(ms(2_000));
    assert_eq!(h.posted.len(), 2, "the retry was written: {:?}", h.posted);
    let order = h.posted[1].1.clone();
    assert_eq!(
        (order.local, order.remote),
        (blocks(&[20, 21]), blocks(&[600, 601]))
    );
    h.complete_writes();
    assert_eq!(
        h.d_results(),
        vec![(DecodeOutcome::Ready, FreeProof::WritesCompleted)]
    );
    assert_eq!(
        h.p_results(),
        vec![PrefillOutcome::Sent, PrefillOutcome::Sent]
    );
    h.assert_no_leak();
}

// The mutation `accept_prior_incarnation`: P takes the late copy of the old incarnation's
// registration as the new one's at once, and writes the retry's prefill into the blocks the
// dead process had named — in the new process, memory it may have given to anything.
#[test]
fn accept_prior_incarnation_writes_the_old_runs_registration() {
    let (mut h, old_register) = served_then_d_restarted();
    h.set_mutation(
        &p_addr(),
        Some(kvhandoff_protocol::machine::Mutation::AcceptPriorIncarnation),
    );
    h.prefill(retry_on_p()).unwrap();
    h.inject(&d_addr(), &p_addr(), old_register);
    assert_eq!(h.posted.len(), 2, "the old registration was written");
    assert_eq!(h.posted[1].1.remote, blocks(&[500, 501]));
    // Its landing is the ghost's violation; this test only shows the write.
    h.fail_writes(WriteFailure::TransferFailed);
    h.take_violations();
}

// Scenario: with two source ranks, P rank 0 sends a `WriteDone` naming rank 1. D counted the
// rank the message names, so rank 0 settled rank 1's share and D was Ready while rank 1's write
// was still in flight. D now counts a message only for the rank that sent it.
#[test]
fn a_rank_cannot_settle_another_ranks_share() {
    let mut h = two_writers();
    let from_p0 = h
        .pending_writes()
        .into_iter()
        .find(|(a, _)| a == &p_addr())
        .unwrap();
    h.complete_write(&from_p0);
    // The precondition: rank 0 has settled, rank 1's write is in flight.
    assert!(h.events_d().is_empty());
    assert!(h.pending_writes().iter().any(|(a, _)| a == &p1_addr()));
    let forged = Message::WriteDone(WriteDone {
        key: key(1),
        epoch: Epoch::FIRST,
        prefill_rank: 1,
        digests: Vec::new(),
    });
    h.inject(&p_addr(), &d_addr(), forged);
    assert_eq!(h.d().counters().dropped(DropReason::Unexpected), 1);
    assert!(
        h.events_d().is_empty(),
        "rank 1's share is rank 1's to settle"
    );
    h.complete_writes();
    assert_eq!(
        h.d_results(),
        vec![(DecodeOutcome::Ready, FreeProof::WritesCompleted)]
    );
    h.assert_no_leak();
}

/// P holds request 1's prefill; D's first incarnation registered, but its `Register` sat in P's
/// queue (a stalled P, a notification polled late) while D restarted. Returns the harness, with
/// the registration still held, and runs P with `mutation`.
fn registration_queued_across_a_d_restart(
    mutation: Option<kvhandoff_protocol::machine::Mutation>,
) -> Harness {
    let mut h = Harness::new();
    h.set_mutation(&p_addr(), mutation);
    h.prefill(prefill_start(1, &[10, 11])).unwrap();
    h.set_filter(|e| {
        if is_register(&e.message) {
            Rule::Hold
        } else {
            Rule::Deliver
        }
    });
    h.decode(decode_start(1, &[500, 501])).unwrap();
    h.advance(ms(50));
    h.restart(
        &d_addr(),
        kvhandoff_protocol::machine::Config::fast(),
        &p_addr(),
    );
    h.clear_filter();
    h
}

// Scenario (issue 19, finding 7; the sweep's seed 275 at 300 × 40 showed it with a stalled P):
// the old incarnation's registration reaches P only after the new incarnation's handshake. P
// has no record of the key to stop it, and cannot tell it from the new incarnation's — but it
// names blocks of the dead process, which the new one may have given to anything. Inside the
// restart window every registration of the restarted rank is left unanswered; the mutation
// `accept_prior_incarnation` writes it.
#[test]
fn an_old_runs_registration_after_the_restart_reaches_no_blocks() {
    let mut h = registration_queued_across_a_d_restart(None);
    // The precondition: P holds the prefill unclaimed, D restarted, the old registration is
    // still on its way.
    assert_eq!(h.p().stats().prefill_requests, 1);
    assert_eq!(h.p().counters().peer_restarts, 1);
    assert_eq!(h.held.len(), 1);
    h.deliver_all_held();
    assert!(
        h.posted.is_empty(),
        "the old registration reached no blocks"
    );
    assert_eq!(h.p().counters().dropped(DropReason::PriorIncarnation), 1);

    let mut h = registration_queued_across_a_d_restart(Some(
        kvhandoff_protocol::machine::Mutation::AcceptPriorIncarnation,
    ));
    h.deliver_all_held();
    assert_eq!(
        h.posted.len(),
        1,
        "the mutation writes the old registration"
    );
    h.fail_writes(WriteFailure::TransferFailed);
    h.take_violations();
}
