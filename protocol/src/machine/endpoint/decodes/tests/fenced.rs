//! A D request fenced by its P's death: the engine hears of the failure at the death
//! (`EndpointEvent::DecodeFenced`), and gets the blocks back only with the final `Decode` event,
//! at the fence or with a proof from the old incarnation — `Failed` with the same failure, never
//! `Ready` (issue 19, deliverable 4).

use std::time::Duration;

use super::{ack, done, key, p, registered};
use crate::machine::types::{
    DecodeFailure, DecodeOutcome, EndpointCall, EndpointEvent, FreeProof, NetEvent, Output, Time,
};
use crate::machine::{Endpoint, FanIn};
use crate::{Epoch, Incarnation, Message, RequestId};

const LOST_AT: Time = Time::from_nanos(1_000_000_000);

fn request() -> RequestId {
    RequestId::new("d-req").unwrap()
}

/// The engine events `d` has queued (its other outputs dropped), and whether it sent a cancel.
fn drain(d: &mut Endpoint) -> (Vec<EndpointEvent>, bool) {
    let mut events = Vec::new();
    let mut cancelled = false;
    while let Some(output) = d.poll_output() {
        match output {
            Output::Event(event) => events.push(event),
            Output::Send {
                message: Message::Cancel(_),
                ..
            } => cancelled = true,
            Output::Send { .. }
            | Output::PostWrite(_)
            | Output::ExtendWrite { .. }
            | Output::PostRead(_)
            | Output::AbandonWrite { .. }
            | Output::Connect { .. }
            | Output::Invalidate { .. } => {}
        }
    }
    (events, cancelled)
}

fn fenced(failure: DecodeFailure) -> EndpointEvent {
    EndpointEvent::DecodeFenced {
        request: request(),
        key: key(),
        epoch: Epoch::FIRST,
        failure,
    }
}

fn ended(failure: DecodeFailure, proof: FreeProof) -> EndpointEvent {
    EndpointEvent::Decode {
        request: request(),
        key: key(),
        epoch: Epoch::FIRST,
        outcome: DecodeOutcome::Failed(failure),
        proof,
        blocks: crate::BlockIds::single_group(vec![5, 6]),
    }
}

/// Runs `d`'s timers up to `until`, returning the engine events on the way.
fn run_until(d: &mut Endpoint, until: Time) -> Vec<EndpointEvent> {
    let mut events = Vec::new();
    while let Some(at) = d.poll_timeout().filter(|&at| at <= until) {
        d.handle_timeout(at);
        events.extend(drain(d).0);
    }
    events
}

fn lose_p(d: &mut Endpoint) -> Vec<EndpointEvent> {
    d.handle_event(LOST_AT, NetEvent::PeerLost { peer: p(0) });
    drain(d).0
}

#[test]
fn a_dead_peer_is_told_at_once_and_the_blocks_come_back_at_the_fence() {
    let mut d = registered(1);
    assert!(
        d.decode_state(&key())
            .is_some_and(|s| s.contains("Registered")),
        "precondition: registered with P"
    );
    assert_eq!(lose_p(&mut d), vec![fenced(DecodeFailure::PeerDead)]);
    assert_eq!(d.counters().decodes_fenced, 1);
    let quarantine = d.config().quarantine;
    let before = LOST_AT + (quarantine - Duration::from_millis(1));
    assert_eq!(run_until(&mut d, before), vec![], "fenced until the fence");
    assert_eq!(d.live_decode_blocks().count(), 1, "the blocks stay out");
    assert_eq!(
        run_until(&mut d, LOST_AT + quarantine),
        vec![ended(DecodeFailure::PeerDead, FreeProof::DeadPeerFence)]
    );
    assert_eq!(
        (d.counters().decodes_fenced, d.counters().fence_frees),
        (1, 1)
    );
}

/// The death was false: the same incarnation connects again, D cancels, and P's write turns out
/// to have landed. The request the engine was told had failed ends `Failed`, not `Ready`.
#[test]
fn a_write_that_lands_after_the_early_event_still_ends_failed() {
    let mut d = registered(1);
    assert_eq!(lose_p(&mut d), vec![fenced(DecodeFailure::PeerDead)]);
    let back = NetEvent::PeerConnected {
        peer: p(0),
        incarnation: Incarnation(1),
    };
    d.handle_event(LOST_AT, back);
    let (events, cancelled) = drain(&mut d);
    assert!(events.is_empty() && cancelled, "precondition: asked again");
    d.handle_event(
        LOST_AT,
        NetEvent::Received {
            from: p(0),
            message: done(0),
        },
    );
    assert_eq!(
        drain(&mut d).0,
        vec![ended(DecodeFailure::PeerDead, FreeProof::WritesCompleted)]
    );
    assert_eq!(d.counters().fence_frees, 0);
}

/// A request already cancelling (the engine aborted it) is fenced when P dies: told then, with
/// the reason it was cancelling for; a restart of P (a second death of the old incarnation)
/// tells nothing new; the quarantine from the cancel frees it.
#[test]
fn a_cancelling_request_is_told_once_when_its_peer_dies() {
    let mut d = registered(1);
    let abort = EndpointCall::Abort { request: request() };
    d.handle_call(Time::ZERO, abort).unwrap();
    let (events, cancelled) = drain(&mut d);
    assert!(events.is_empty() && cancelled, "precondition: cancelling");
    assert_eq!(lose_p(&mut d), vec![fenced(DecodeFailure::Aborted)]);
    let restarted = NetEvent::PeerConnected {
        peer: p(0),
        incarnation: Incarnation(77),
    };
    d.handle_event(LOST_AT, restarted);
    assert_eq!(drain(&mut d).0, vec![], "told once");
    // The quarantine runs from the cancel, at time zero.
    let quarantine = Time::ZERO + d.config().quarantine;
    assert_eq!(
        run_until(&mut d, quarantine),
        vec![ended(DecodeFailure::Aborted, FreeProof::Quarantine)]
    );
    assert_eq!(d.counters().decodes_fenced, 1);
}

/// A request whose P answers the cancel is never fenced: no early event, one final one.
#[test]
fn a_request_settled_by_a_live_peer_is_not_told_early() {
    let mut d = registered(1);
    let abort = EndpointCall::Abort { request: request() };
    d.handle_call(Time::ZERO, abort).unwrap();
    let received = NetEvent::Received {
        from: p(0),
        message: ack(0),
    };
    d.handle_event(Time::ZERO, received);
    assert_eq!(
        drain(&mut d).0,
        vec![ended(DecodeFailure::Aborted, FreeProof::CancelAcknowledged)]
    );
    assert_eq!(d.counters().decodes_fenced, 0);
}

/// Two P ranks feed one D rank; P rank 1 dies. The fan-in of D's sub-requests (each a plain
/// request of its own endpoint here) fails the request at rank 1's early event, aborts rank
/// 0's sub-request, and hands the shared blocks back only after rank 1's fence.
#[test]
fn a_fan_in_forwards_one_early_event_and_waits_for_the_fence() {
    use crate::machine::{FanInStep, FanOutcome, FanSide, SubFailure, SubRequest};
    let sub = |n: u32| SubRequest {
        request: request(),
        key: key().for_pair(n, 0).unwrap(),
    };
    // Each sub-request runs on an endpoint of its own so that both can reuse the fixture; the
    // fan-in only sees their events, renamed to its sub-requests.
    let mut subs = [registered(1), registered(1)];
    let rename = |n: u32, event: EndpointEvent| match event {
        EndpointEvent::DecodeFenced { epoch, failure, .. } => EndpointEvent::DecodeFenced {
            request: RequestId::new(format!("sub-{n}")).unwrap(),
            key: sub(n).key,
            epoch,
            failure,
        },
        EndpointEvent::Decode {
            epoch,
            outcome,
            proof,
            blocks,
            ..
        } => EndpointEvent::Decode {
            request: RequestId::new(format!("sub-{n}")).unwrap(),
            key: sub(n).key,
            epoch,
            outcome,
            proof,
            blocks,
        },
        other @ (EndpointEvent::Prefill { .. }
        | EndpointEvent::Export { .. }
        | EndpointEvent::Import { .. }) => other,
    };
    let named = |n: u32| SubRequest {
        request: RequestId::new(format!("sub-{n}")).unwrap(),
        key: sub(n).key,
    };
    let blocks = crate::BlockIds::single_group(vec![5, 6]);
    let mut fan = FanIn::new(FanSide::Decode, blocks.clone(), [named(0), named(1)]).unwrap();
    let early = lose_p(&mut subs[1]);
    assert_eq!(early.len(), 1, "precondition: rank 1's sub-request fenced");
    let step = fan.on_event(&rename(1, early[0].clone())).unwrap();
    assert_eq!(
        step,
        FanInStep {
            abort: vec![named(0).request],
            outcome: Some(FanOutcome::Failed {
                request: named(1).request,
                failure: SubFailure::Decode(DecodeFailure::PeerDead),
            }),
            hand_back: None,
            fenced: true,
        }
    );
    // Rank 0's sub-request, aborted, is acknowledged by its live P rank (on its endpoint's
    // clock, which has not reached rank 0's liveness deadline).
    let abort = EndpointCall::Abort { request: request() };
    subs[0].handle_call(Time::ZERO, abort).unwrap();
    let received = NetEvent::Received {
        from: p(0),
        message: ack(0),
    };
    subs[0].handle_event(Time::ZERO, received);
    let (acked, _) = drain(&mut subs[0]);
    assert_eq!(
        acked,
        vec![ended(DecodeFailure::Aborted, FreeProof::CancelAcknowledged)]
    );
    let step = fan.on_event(&rename(0, acked[0].clone())).unwrap();
    assert_eq!(step, FanInStep::default(), "rank 1 may still write");
    let quarantine = LOST_AT + subs[1].config().quarantine;
    let freed = run_until(&mut subs[1], quarantine);
    assert_eq!(freed.len(), 1);
    let step = fan.on_event(&rename(1, freed[0].clone())).unwrap();
    assert_eq!(step.hand_back, Some(blocks));
    assert!(!step.fenced, "told once");
}

/// The gauges follow the fenced request: its blocks count as quarantined from the death until
/// the fence hands them back, and the peer moves from connected to dead.
#[test]
fn the_gauges_show_the_fenced_blocks_and_the_dead_peer() {
    use crate::machine::Gauges;
    // Connected to P's two ranks; the request's two blocks are exposed to rank 0.
    let mut d = registered(1);
    assert_eq!(
        d.gauges(),
        Gauges {
            peers_connected: 2,
            ..Gauges::default()
        }
    );
    lose_p(&mut d);
    assert_eq!(
        d.gauges(),
        Gauges {
            blocks_quarantined: 2,
            peers_connected: 1,
            peers_dead: 1,
            ..Gauges::default()
        }
    );
    let fence = LOST_AT + d.config().quarantine;
    run_until(&mut d, fence);
    assert_eq!(d.gauges().blocks_quarantined, 0);
}
