//! Process stalls in the scripted world (issue 19): a process stopped longer than its peers'
//! fences (SIGSTOP, a paused VM, a long GC pause) and resumed. While stopped it runs no timer and
//! handles nothing; what reaches it is held; on resume its due timers run first, then it handles
//! what was held, in order.

use kvhandoff_protocol::machine::{DecodeFailure, DecodeOutcome, FreeProof, NetEvent};
use kvhandoff_sim::scripted::*;

/// The harness's stall: no timer and no input while stopped, what arrives is held, and on
/// resume the timers run before the held messages are handed over.
#[test]
fn a_stalled_process_runs_its_timers_before_what_it_held() {
    let mut h = Harness::new();
    h.connect(&d_addr(), &p_addr());
    h.decode(decode_start(1, &[500])).unwrap();
    // The precondition: P holds D's registration and the two are connected.
    assert_eq!(h.p().stats().pending_registrations, 1);
    let p_dead_before = h.p().counters().peers_declared_dead;

    h.stall(&p_addr());
    h.advance(ms(1_000));
    // D noticed the silence and declared P dead (again after each of its dials to ask the
    // stopped P, which answers nothing); P ran nothing and holds D's heartbeats.
    assert!(h.d().counters().peers_declared_dead >= 1);
    assert_eq!(h.p().counters().peers_declared_dead, p_dead_before);
    assert!(!h.nodes[&p_addr()].held.is_empty(), "D's traffic is held");
    assert_eq!(h.p().stats().pending_registrations, 1, "no timer ran");

    h.resume(&p_addr());
    assert!(h.nodes[&p_addr()].held.is_empty());
    assert!(!h.is_stalled(&p_addr()));
    // Its own peer timer ran at the resume, before any held heartbeat could renew D.
    assert_eq!(h.p().counters().peers_declared_dead, p_dead_before + 1);
}

/// Issue 19, finding 2: P stalls with D's `Register` on its way; D declares P dead, fences and
/// frees its blocks by `DeadPeerFence`; P resumes (its timers first: it declares D dead), a
/// handshake with D completes (a late dial, or the re-dial its side channel answers before the
/// shell feeds the queue), and only then is P handed the held `Register`; P's prefill finishes
/// after that (so a lease check on a held prefill alone cannot refuse it). P must not write
/// into the blocks D freed. Found by the seeded world's stalls (`kvhandoff sim --mode push
/// --seeds 1..300 --requests 40`: seeds 52, 89, 245, 265).
#[test]
fn a_stalled_p_never_writes_a_held_register_into_freed_blocks() {
    let mut h = Harness::new();
    h.connect(&d_addr(), &p_addr());
    h.stall(&p_addr());
    h.decode(decode_start(1, &[500])).unwrap();
    assert_eq!(h.count_sent(&d_addr(), is_register), 1);
    // Past D's deadline and its fence.
    h.advance(ms(20_000));
    // The precondition: D gave its blocks back by the fence while P was stopped, the
    // `Register` still held in P.
    assert_eq!(
        h.d_results(),
        vec![(
            DecodeOutcome::Failed(DecodeFailure::PeerDead),
            FreeProof::DeadPeerFence
        )]
    );
    let held_register = |h: &Harness| {
        h.nodes[&p_addr()]
            .held
            .iter()
            .any(|e| matches!(e, NetEvent::Received { message, .. } if is_register(message)))
    };
    assert!(held_register(&h));

    h.resume_timers(&p_addr());
    h.connect(&p_addr(), &d_addr());
    h.hand_over_held(&p_addr());
    h.prefill(prefill_start(1, &[10])).unwrap();
    h.complete_writes();
    h.advance(ms(20_000));
    assert!(
        h.posted.iter().all(|(_, order)| order.to != d_addr()),
        "P wrote into blocks D freed: {:?}",
        h.posted
    );
    assert!(h.take_violations().is_empty());
}
