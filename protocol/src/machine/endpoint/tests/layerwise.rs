//! Layer-wise push on P: parts follow the engine's layers, the write ends after its last part,
//! and nothing is posted into a registration that may have lapsed.

use std::time::Duration;

use super::{d, key, outputs, p_endpoint, receive_register};
use crate::machine::types::{EndpointCall, EndpointEvent, LayerPlan, NetEvent, Output, Time};
use crate::machine::{Config, PrefillOutcome, Rejected, ReleaseCause};
use crate::{BlockIds, Cancel, CancelReason, Epoch, Incarnation, Message, RequestId};

fn request() -> RequestId {
    RequestId::new("p-layers").unwrap()
}

const PLAN: LayerPlan = LayerPlan {
    layers: 4,
    part_layers: 2,
};

/// P, connected to D, with a layer-wise prefill of `key()` started (no layer ready yet).
fn p_started() -> crate::machine::Endpoint {
    let mut p = p_endpoint();
    p.handle_event(
        Time::ZERO,
        NetEvent::PeerConnected {
            peer: d(),
            incarnation: Incarnation(7),
        },
    );
    let start = crate::machine::PrefillStart {
        request: request(),
        key: key(),
        blocks: BlockIds::single_group(vec![1, 2]),
    };
    p.handle_call(
        Time::ZERO,
        EndpointCall::PrefillStarted { start, plan: PLAN },
    )
    .unwrap();
    assert!(outputs(&mut p).is_empty());
    p
}

fn layers(p: &mut crate::machine::Endpoint, at: Time, ready: u32) -> Vec<Output> {
    let call = EndpointCall::LayersReady {
        request: request(),
        ready,
    };
    p.handle_call(at, call).unwrap();
    outputs(p)
}

fn extended(out: &[Output]) -> Vec<(u32, u32)> {
    out.iter()
        .filter_map(|o| match o {
            Output::ExtendWrite { from, to, .. } => Some((*from, *to)),
            _ => None,
        })
        .collect()
}

fn ms(n: u64) -> Time {
    Time::ZERO + Duration::from_millis(n)
}

/// The registration binds a write of no layers; each part goes out once two new layers are
/// ready, and the write ends `Sent` only with its end after the last part.
#[test]
fn parts_follow_the_layers_and_the_write_ends_after_the_last() {
    let mut p = p_started();
    assert!(
        extended(&layers(&mut p, ms(1), 1)).is_empty(),
        "half a part"
    );
    let out = receive_register(&mut p, ms(2));
    let write = match out.as_slice() {
        [Output::PostWrite(order)] => {
            let stream = order.stream.expect("a layer-wise order");
            assert_eq!(
                (stream.layers, stream.posted),
                (4, 0),
                "layer 1 is half a part"
            );
            order.write
        }
        other => panic!("expected one post, got {other:?}"),
    };
    assert_eq!(extended(&layers(&mut p, ms(3), 2)), vec![(0, 2)]);
    assert_eq!(extended(&layers(&mut p, ms(4), 2)), vec![], "no new layer");
    assert_eq!(extended(&layers(&mut p, ms(5), 4)), vec![(2, 4)]);
    p.handle_event(ms(6), NetEvent::WriteCompleted { write });
    let ended = outputs(&mut p);
    assert!(
        ended.iter().any(|o| matches!(
            o,
            Output::Event(EndpointEvent::Prefill {
                outcome: PrefillOutcome::Sent,
                ..
            })
        )),
        "{ended:?}"
    );
}

/// D gives up while the prefill still runs: P abandons the write at once (its last part will
/// never come) and acknowledges only when the parts posted have ended.
#[test]
fn a_cancel_of_a_partial_write_abandons_it_and_acks_after_its_end() {
    let mut p = p_started();
    receive_register(&mut p, ms(1));
    assert_eq!(extended(&layers(&mut p, ms(2), 2)), vec![(0, 2)]);
    let cancel = Message::Cancel(Cancel {
        key: key(),
        epoch: Epoch(1),
        reason: CancelReason::Deadline,
    });
    p.handle_event(
        ms(3),
        NetEvent::Received {
            from: d(),
            message: cancel,
        },
    );
    let out = outputs(&mut p);
    let write = out
        .iter()
        .find_map(|o| match o {
            Output::AbandonWrite { write } => Some(*write),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no abandon: {out:?}"));
    assert!(!out.iter().any(is_cancel_ack), "acked with parts in flight");
    assert!(
        extended(&layers(&mut p, ms(4), 3)).is_empty(),
        "a part after the cancel"
    );
    p.handle_event(
        ms(5),
        NetEvent::WriteFailed {
            write,
            failure: crate::WriteFailure::TransferFailed,
        },
    );
    let out = outputs(&mut p);
    assert!(out.iter().any(is_cancel_ack), "{out:?}");
    assert!(out.iter().any(|o| matches!(
        o,
        Output::Event(EndpointEvent::Prefill {
            outcome: PrefillOutcome::Released(ReleaseCause::CancelledByPeer),
            ..
        })
    )));
    // The engine still computes: its last layers are taken and do nothing (once).
    assert!(layers(&mut p, ms(6), 4).is_empty());
    assert!(matches!(
        p.handle_call(
            ms(7),
            EndpointCall::LayersReady {
                request: request(),
                ready: 4
            }
        ),
        Err(Rejected::UnknownRequest(_))
    ));
    let unknown = EndpointCall::LayersReady {
        request: RequestId::new("never-started").unwrap(),
        ready: 1,
    };
    assert!(matches!(
        p.handle_call(ms(7), unknown),
        Err(Rejected::UnknownRequest(_))
    ));
}

fn is_cancel_ack(o: &Output) -> bool {
    matches!(
        o,
        Output::Send {
            message: Message::CancelAck(_),
            ..
        }
    )
}

/// P was stopped past D's registration TTL with layers to post: D may have fenced and reused
/// its blocks by now, so the next part is not posted and the write is given up.
#[test]
fn no_part_is_posted_after_the_registration_lapsed() {
    let mut p = p_started();
    receive_register(&mut p, ms(1));
    let lapsed = ms(1) + Config::fast().registration_ttl;
    // The precondition: the registration's timer is due and has not run.
    assert!(p.poll_timeout().is_some_and(|t| t <= lapsed));
    let out = layers(&mut p, lapsed, 2);
    assert!(
        extended(&out).is_empty(),
        "a part into a lapsed registration: {out:?}"
    );
    assert!(out.iter().any(|o| matches!(o, Output::AbandonWrite { .. })));
    assert_eq!(p.counters().expired_leases_refused, 1);
}

/// With the deliberate bug the part goes out: the check above can fail.
#[cfg(feature = "mutations")]
#[test]
fn the_lapsed_registration_check_can_fail() {
    let mut p = p_started();
    p.set_mutation(Some(crate::machine::Mutation::ExtendLapsedRegistration));
    receive_register(&mut p, ms(1));
    let lapsed = ms(1) + Config::fast().registration_ttl;
    assert_eq!(extended(&layers(&mut p, lapsed, 2)), vec![(0, 2)]);
}

/// D's heartbeats keep the registration standing while the prefill runs.
#[test]
fn heartbeats_renew_the_registration_of_a_partial_write() {
    let mut p = p_started();
    receive_register(&mut p, ms(1));
    let config = Config::fast();
    let later = ms(1) + config.registration_ttl + Duration::from_millis(10);
    let mut at = ms(1);
    while at < later {
        at = at + config.heartbeat_interval;
        let beat = crate::Heartbeat {
            engine: d().engine,
            leases: vec![crate::LeaseRef {
                key: key(),
                epoch: Epoch(1),
            }],
        };
        let message = Message::Heartbeat(beat);
        p.handle_event(at, NetEvent::Received { from: d(), message });
        p.handle_timeout(at);
        // The engine's layer 1 every beat keeps the write's own deadline from firing.
        assert!(extended(&layers(&mut p, at, 1)).is_empty());
    }
    assert_eq!(extended(&layers(&mut p, at, 2)), vec![(0, 2)]);
}
