//! The endpoint's own defences against inputs that are stale on their face: a process that was
//! stopped (SIGSTOP, a VM pause) resumes with messages queued and its timers overdue, and a
//! shell may hand it the messages first. Each test skips `handle_timeout` on purpose.

use std::time::Duration;

use super::Endpoint;
use crate::machine::types::{EndpointCall, NetEvent, Output, PrefillStart, Time};
use crate::machine::Config;
use crate::RequestId;
use crate::{BlockIds, EngineId, Epoch, Incarnation, Message, PairingKey, PeerAddr, Register};

mod layerwise;

fn p_endpoint() -> Endpoint {
    Endpoint::new(EngineId::new("prefill").unwrap(), 0, Config::fast()).unwrap()
}

fn d() -> PeerAddr {
    PeerAddr::new(EngineId::new("decode").unwrap(), 0)
}

fn key() -> PairingKey {
    PairingKey::new("stalled-key").unwrap()
}

fn register() -> Message {
    Message::Register(Box::new(Register {
        key: key(),
        epoch: Epoch(1),
        decode_engine: d().engine,
        decode_request: RequestId::new("d-req").unwrap(),
        decode_rank: 0,
        blocks: BlockIds::single_group(vec![40, 41]),
        num_tokens: 32,
        trace_id: crate::TraceId::from_u128(0x7ace),
        memory: Vec::new(),
    }))
}

fn outputs(ep: &mut Endpoint) -> Vec<Output> {
    std::iter::from_fn(|| ep.poll_output()).collect()
}

/// D's registration of `key()` reaches P at `at` (no timer run before it); P's outputs.
fn receive_register(p: &mut Endpoint, at: Time) -> Vec<Output> {
    p.handle_event(
        at,
        NetEvent::Received {
            from: d(),
            message: register(),
        },
    );
    outputs(p)
}

/// P, connected to D at time zero, with a prefill of `key()` finished and held.
fn p_holding() -> Endpoint {
    let mut p = p_endpoint();
    p.handle_event(
        Time::ZERO,
        NetEvent::PeerConnected {
            peer: d(),
            incarnation: Incarnation(7),
        },
    );
    p.handle_call(
        Time::ZERO,
        EndpointCall::PrefillFinished(PrefillStart {
            request: RequestId::new("p-req").unwrap(),
            key: key(),
            blocks: BlockIds::single_group(vec![1, 2]),
        }),
    )
    .unwrap();
    outputs(&mut p);
    p
}

/// D's registration sat in P's queue while P was stopped past the peer timeout: by then D has
/// declared P dead and fences its blocks toward the reuse P cannot see. P must take D as dead
/// (as its timer would have) and write nothing.
#[test]
fn a_message_queued_past_the_peer_timeout_is_from_a_dead_peer() {
    let mut p = p_holding();
    let config = Config::fast();
    let resumed = Time::ZERO + config.peer_timeout + Duration::from_millis(1);
    // The precondition: P's timer is overdue and has not run.
    assert!(p.poll_timeout().is_some_and(|t| t <= resumed));
    let out = receive_register(&mut p, resumed);
    assert!(
        !out.iter().any(|o| matches!(o, Output::PostWrite(_))),
        "a stale registration was written: {out:?}"
    );
    assert!(out
        .iter()
        .any(|o| matches!(o, Output::Invalidate { peer } if *peer == d())));
    assert_eq!(p.counters().stale_messages_refused, 1);
    assert_eq!(p.counters().peers_declared_dead, 1);
}

/// The same registration within the peer timeout is written: the guard costs nothing to a
/// peer that is merely slow.
#[test]
fn a_message_within_the_peer_timeout_is_served() {
    let mut p = p_holding();
    let config = Config::fast();
    let in_time = Time::ZERO + (config.peer_timeout - Duration::from_millis(1));
    let out = receive_register(&mut p, in_time);
    assert!(
        out.iter().any(|o| matches!(o, Output::PostWrite(_))),
        "{out:?}"
    );
    assert_eq!(p.counters().stale_messages_refused, 0);
}

/// Without the guard (the deliberate bug `accept_from_overdue_peer`) the queued registration
/// reaches P's held blocks: only the lease check stands between it and a write (it ended at
/// 3 s, after the peer timeout), so a stall shorter than the lease is written.
#[cfg(feature = "mutations")]
#[test]
fn the_overdue_peer_guard_can_fail() {
    let mut p = p_holding();
    p.set_mutation(Some(crate::machine::Mutation::AcceptFromOverduePeer));
    let config = Config::fast();
    let resumed = Time::ZERO + config.peer_timeout + Duration::from_millis(1);
    assert!(resumed < Time::ZERO + config.lease_duration);
    let out = receive_register(&mut p, resumed);
    assert!(
        out.iter().any(|o| matches!(o, Output::PostWrite(_))),
        "{out:?}"
    );
}

/// A stall past the lease too: with the overdue-peer guard switched off, the lease check alone
/// still refuses the write and tells D the lease expired.
#[cfg(feature = "mutations")]
#[test]
fn past_the_lease_the_lease_check_alone_refuses_the_write() {
    let mut p = p_holding();
    p.set_mutation(Some(crate::machine::Mutation::AcceptFromOverduePeer));
    let config = Config::fast();
    let resumed = Time::ZERO + config.lease_duration + Duration::from_millis(1);
    let out = receive_register(&mut p, resumed);
    assert!(
        !out.iter().any(|o| matches!(o, Output::PostWrite(_))),
        "{out:?}"
    );
    assert!(out.iter().any(|o| matches!(
        o,
        Output::Send { message: Message::WriteFailed(m), .. } if m.reason == crate::WriteFailure::LeaseExpired
    )));
    assert_eq!(p.counters().expired_leases_refused, 1);
}

/// An export lease near `Duration::MAX` once overflowed the hard-end arithmetic inside the
/// endpoint (a panic in the rank actor); it is a typed refusal that changes nothing.
#[test]
fn a_huge_export_lease_is_refused_typed() {
    use crate::machine::types::Rejected;
    use crate::machine::{ExportStart, MAX_EXPORT_LEASE};
    let mut p = p_endpoint();
    let export = |lease| {
        EndpointCall::Export(ExportStart {
            request: RequestId::new("p-export").unwrap(),
            key: key(),
            blocks: BlockIds::single_group(vec![1, 2]),
            num_tokens: 32,
            lease,
        })
    };
    for lease in [
        Duration::MAX,
        Duration::MAX / 2,
        MAX_EXPORT_LEASE + Duration::from_nanos(1),
    ] {
        let refused = p.handle_call(Time::ZERO, export(lease));
        assert!(
            matches!(refused, Err(Rejected::TooLong { .. })),
            "{lease:?}: {refused:?}"
        );
    }
    assert_eq!(p.stats().exports, 0);
    assert!(outputs(&mut p).is_empty());
    p.handle_call(Time::ZERO, export(MAX_EXPORT_LEASE)).unwrap();
    assert_eq!(p.stats().exports, 1);
}

/// A timer run later than the stall allowance (quarantine − fence floor) is counted: the
/// process was stopped long enough that a write it had in flight may land after a peer's
/// time-based fence. A timer merely a little late is not.
#[test]
fn timers_run_past_the_stall_allowance_are_counted() {
    let mut p = p_holding();
    let config = Config::fast();
    let due = p.poll_timeout().unwrap();
    p.handle_timeout(due + config.stall_allowance());
    assert_eq!(p.counters().stalls_past_allowance, 0);
    let due = p.poll_timeout().unwrap();
    p.handle_timeout(due + config.stall_allowance() + Duration::from_millis(1));
    assert_eq!(p.counters().stalls_past_allowance, 1);
}
