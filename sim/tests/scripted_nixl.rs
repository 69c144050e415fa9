//! The scripted world is as hostile as the NIXL we measured, and its ghost can fail.
//!
//! Under the scripted model these tests replace (an abandon or an invalidation cut the write
//! on the spot), a D that freed on declaring P dead could never be caught: the write it freed
//! under was gone. Each mutation test first asserts that it reached the bug's precondition.

use kvhandoff_protocol::machine::{
    Config, DecodeFailure, DecodeOutcome, FreeProof, Mutation, NetEvent,
};
use kvhandoff_sim::scripted::*;

// Scenario: P abandons its hung write at the write deadline, and the write lands anyway half a
// second later (measured: NIXL refuses the abandon of a transfer in progress). Nobody freed
// under it, and the data that landed is used.
#[test]
fn an_abandoned_write_lands_anyway_and_nobody_freed_under_it() {
    let mut h = writing();
    h.advance(ms(1_000));
    assert_eq!(h.p().counters().writes_abandoned, 1);
    let w = h.the_write();
    assert!(h.writes[&w].abandoned);
    h.advance(ms(500));
    assert!(h.events_d().is_empty() && h.p_results().is_empty());
    h.complete_write(&w);
    assert_eq!(h.landings.len(), 1);
    assert!(h.landings[0].late, "it landed after its abandon");
    let (outcome, proof) = h.d_results()[0];
    assert!(
        matches!(proof, FreeProof::WritesCompleted | FreeProof::PeerQuiesced),
        "{outcome:?} {proof:?}"
    );
    assert_eq!(h.p_results().len(), 1);
    h.assert_no_leak();
}

// Scenario: D hears that P is lost and invalidates it while P is alive and writing; the write
// lands after the invalidation (measured), inside D's fence. D dials the same P again (the death
// fenced a request) and asks it again with a cancel; P answers only once its write ended, so D's
// blocks come back by P's proof after the landing, never before it.
#[test]
fn a_write_lands_after_d_declared_a_live_p_dead() {
    let mut h = writing();
    h.event(&d_addr(), NetEvent::PeerLost { peer: p_addr() });
    assert_eq!(h.nodes[&d_addr()].invalidated.len(), 1);
    h.advance(ms(300));
    assert!(
        h.d().counters().peers_rejoined >= 1,
        "precondition: D met the same P again"
    );
    assert!(
        h.d_results().is_empty(),
        "still fenced: P's write is in flight"
    );
    let w = h.the_write();
    h.complete_write(&w);
    assert!(h.landings[0].late, "it landed after the invalidation");
    h.advance(ms(300));
    let results = h.d_results();
    assert_eq!(results.len(), 1, "settled by P's proof, not the quarantine");
    assert!(
        matches!(
            results[0],
            (
                DecodeOutcome::Failed(DecodeFailure::PeerDead),
                FreeProof::CancelAcknowledged | FreeProof::WritesCompleted
            )
        ),
        "{results:?}"
    );
    h.assert_no_leak();
}

// Mutation `free_on_peer_dead`: D frees the moment it declares P dead. The write it freed
// under is still in flight, so the ghost's judgement of the hand-back fails, and so does the
// landing that follows.
#[test]
fn the_ghost_catches_free_on_peer_dead() {
    let mut h = writing();
    h.set_mutation(&d_addr(), Some(Mutation::FreeOnPeerDead));
    h.event(&d_addr(), NetEvent::PeerLost { peer: p_addr() });
    let results = h.d_results();
    assert_eq!(results.len(), 1, "the mutation freed at once");
    assert_eq!(
        h.writes.len(),
        1,
        "precondition: P's write is still in flight"
    );
    let w = h.the_write();
    h.complete_write(&w);
    let violations = h.take_violations();
    assert!(
        violations.iter().any(|v| v.contains("may still land")),
        "{violations:#?}"
    );
    assert!(
        violations
            .iter()
            .any(|v| v.contains("after D handed them back")
                && v.contains("outlived an invalidation")),
        "{violations:#?}"
    );
}

// Mutation `free_source_on_abandon`: P frees its source blocks when NIXL has not confirmed its
// abandon by the abandon timeout (1 s + 500 ms here), trusting an invalidation instead. The
// write may still read them: the ghost's P check fails.
#[test]
fn the_ghost_catches_free_source_on_abandon() {
    let mut h = writing();
    h.set_mutation(&p_addr(), Some(Mutation::FreeSourceOnAbandon));
    h.advance(ms(999));
    assert!(h.p_results().is_empty());
    h.advance(ms(1));
    assert_eq!(
        h.p().counters().writes_abandoned,
        1,
        "precondition: P abandoned"
    );
    h.advance(h.p().config().abandon_timeout);
    assert_eq!(h.p_results().len(), 1, "the mutation freed P's blocks");
    assert_eq!(
        h.writes.len(),
        1,
        "precondition: NIXL went on with the write"
    );
    let violations = h.take_violations();
    assert!(
        violations
            .iter()
            .any(|v| v.contains("freed the source blocks")),
        "{violations:#?}; P: {:?}",
        h.p_results()
    );
    h.fail_writes(kvhandoff_protocol::WriteFailure::TransferFailed);
    h.take_violations();
}

// Mutation `free_on_deadline`: D frees at its deadline without P's answer while P's write is
// still in flight (P's own write deadline is later).
#[test]
fn the_ghost_catches_free_on_deadline() {
    let config = Config {
        decode_deadline: ms(500),
        write_timeout: ms(2_000),
        max_write_life: ms(2_500),
        quarantine: ms(9_000),
        ..Config::fast()
    };
    let mut h = Harness::with_config(config);
    h.set_mutation(&d_addr(), Some(Mutation::FreeOnDeadline));
    h.prefill(prefill_start(1, &[10])).unwrap();
    h.decode(decode_start(1, &[500])).unwrap();
    h.advance_to(at(ms(500)));
    assert_eq!(h.d_results().len(), 1, "the mutation freed at the deadline");
    assert_eq!(h.writes.len(), 1, "precondition: P's write is in flight");
    let violations = h.take_violations();
    assert!(
        violations.iter().any(|v| v.contains("may still land")),
        "{violations:#?}"
    );
    h.complete_writes();
    let late = h.take_violations();
    assert!(
        late.iter().any(|v| v.contains("after D handed them back")),
        "{late:#?}"
    );
}

// A write aimed at an incarnation that died fails, even after a new one is up; a write left
// pending fails at its bound; neither lands.
#[test]
fn writes_end_as_measured_when_the_target_dies_or_the_bound_comes() {
    let mut h = writing();
    h.restart(&d_addr(), Config::fast(), &p_addr());
    assert!(h.writes.is_empty(), "the write to the dead D failed");
    assert!(h.landings.is_empty());
    assert_eq!(h.p_results().len(), 1);

    let mut h = writing();
    let w = h.the_write();
    let ends_by = h.writes[&w].ends_by;
    assert_eq!(ends_by, at(h.p().config().max_write_life));
    h.advance_to(ends_by);
    assert!(h.writes.is_empty() && h.landings.is_empty());
    h.advance(h.d().config().decode_deadline);
    h.assert_no_leak();
}
