//! The session on its own: a call's parameters into the endpoint's input, and the fan-in of a
//! multi-rank request (its sub-requests' events played by the test where a real one would need
//! a second engine to die).

use super::*;
use crate::hetero::SideName;
use crate::machine::{
    Config, DecodeFailure, DecodeOutcome, DecodeStart, EndpointCall, FreeProof, Rejected,
};
use crate::{BlockIds, Epoch, PairingKey, RequestId};

fn id(s: &str) -> RequestId {
    RequestId::new(s).unwrap()
}

fn blocks() -> BlockIds {
    BlockIds::single_group(vec![2, 3])
}

fn session(engine: &str, links: Option<RankLinks>) -> Session {
    let engine = EngineId::new(engine).unwrap();
    let endpoint = Endpoint::new(engine.clone(), 0, Config::default()).unwrap();
    let mut session = Session::new(
        endpoint,
        ConnectorIdentity::in_process(engine, 0, 1),
        ConnectorSettings::default(),
    );
    if let Some(links) = links {
        session.set_links(links).unwrap();
    }
    session
}

fn decode_links(peers: Vec<u32>) -> RankLinks {
    RankLinks {
        side: SideName::Decode,
        rank: 0,
        remote_tp: 2,
        remote_ranks: 2,
        peers,
    }
}

fn allocated(request: &RequestId, tp: u32) -> ConnectorCall {
    ConnectorCall::RequestAllocated {
        request: request.clone(),
        blocks: blocks(),
        num_tokens: 32,
        params: KvTransferParams {
            do_remote_prefill: true,
            remote_engine_id: Some("prefill".into()),
            tp_size: Some(tp),
            ..KvTransferParams::default()
        },
    }
}

/// Every output queued now: the engine's events, and how many of the others.
fn drain(session: &mut Session) -> (Vec<ConnectorEvent>, usize) {
    let mut events = Vec::new();
    let mut others = 0;
    while let Some(out) = session.poll_output() {
        match out {
            SessionOutput::Event(event) => events.push(event),
            SessionOutput::Transport(_)
            | SessionOutput::Connect(_)
            | SessionOutput::PeerAddress(_)
            | SessionOutput::Observed(_) => others += 1,
        }
    }
    (events, others)
}

fn fenced(sub: &RequestId, key: PairingKey, failure: DecodeFailure) -> EndpointEvent {
    EndpointEvent::DecodeFenced {
        request: sub.clone(),
        key,
        epoch: Epoch::FIRST,
        failure,
    }
}

fn freed(sub: &RequestId, key: PairingKey, failure: DecodeFailure) -> EndpointEvent {
    EndpointEvent::Decode {
        request: sub.clone(),
        key,
        epoch: Epoch::FIRST,
        outcome: DecodeOutcome::Failed(failure),
        proof: FreeProof::DeadPeerFence,
        blocks: blocks(),
    }
}

#[test]
fn a_call_becomes_the_endpoint_input_the_router_parameters_name() {
    let mut d = session("decode", None);
    let request = id("req-1");
    let mut call = allocated(&request, 1);
    if let ConnectorCall::RequestAllocated { params, .. } = &mut call {
        params.transfer_id = Some("xfer-9".into());
        params.epoch = Some(3);
    }
    d.handle_call(Time::ZERO, call).unwrap();
    let key = PairingKey::from_transfer_id("xfer-9").unwrap();
    assert!(d.endpoint().decode_state(&key).is_some(), "D holds the key");
    // The same key again is the endpoint's refusal, typed, and changes nothing.
    let again = d.handle_call(Time::ZERO, allocated(&id("req-2"), 1));
    assert!(again.is_ok(), "another request id pairs by its own id");
    let mut dup = allocated(&id("req-3"), 1);
    if let ConnectorCall::RequestAllocated { params, .. } = &mut dup {
        params.transfer_id = Some("xfer-9".into());
    }
    assert!(matches!(
        d.handle_call(Time::ZERO, dup),
        Err(ConnectorError::Rejected(Rejected::DuplicateKey(_)))
    ));
    // A TP size this rank cannot pair with, unlinked: unsupported, not a guess.
    assert!(matches!(
        d.handle_call(Time::ZERO, allocated(&id("req-4"), 2)),
        Err(ConnectorError::Unsupported(_))
    ));
}

#[test]
fn a_side_channel_address_comes_before_the_handshake_that_needs_it() {
    let mut d = session("decode", None);
    d.set_peer_addresses(true);
    let request = id("req-1");
    assert_eq!(
        d.handle_call(Time::ZERO, allocated(&request, 1)),
        Err(ConnectorError::MissingParam("remote_host"))
    );
    assert_eq!(drain(&mut d), (vec![], 0), "a refused call queues nothing");
    let mut call = allocated(&request, 1);
    if let ConnectorCall::RequestAllocated { params, .. } = &mut call {
        params.remote_host = Some("10.0.0.7".into());
        params.remote_port = Some(5600);
    }
    d.handle_call(Time::ZERO, call).unwrap();
    let first = d.poll_output();
    assert!(
        matches!(&first, Some(SessionOutput::PeerAddress(PeerAddress { host, port: 5600, .. })) if host == "10.0.0.7"),
        "{first:?}"
    );
    assert!(matches!(d.poll_output(), Some(SessionOutput::Connect(_))));
    // A call the endpoint refuses (the same request again) leaves no address behind.
    let mut again = allocated(&request, 1);
    if let ConnectorCall::RequestAllocated { params, .. } = &mut again {
        params.remote_host = Some("10.0.0.8".into());
        params.remote_port = Some(5601);
    }
    assert!(d.handle_call(Time::ZERO, again).is_err());
    assert_eq!(drain(&mut d), (vec![], 0), "a refused call queues nothing");
}

/// Ranks of one engine listen on consecutive ports (vLLM's convention): rank 1 of a TP 2 P
/// advertises its engine's base port, and rank 1 of a TP 2 D dials that base + 1.
#[test]
fn ranks_reach_each_other_at_the_base_port_plus_the_rank() {
    let rank_one = |engine: &str, port| {
        let engine = EngineId::new(engine).unwrap();
        let endpoint = Endpoint::new(engine.clone(), 1, Config::default()).unwrap();
        let identity = ConnectorIdentity {
            engine,
            rank: 1,
            tp_size: 2,
            host: "10.0.0.7".into(),
            port,
        };
        let mut session = Session::new(endpoint, identity, ConnectorSettings::default());
        session.set_peer_addresses(true);
        session
    };
    let mut p = rank_one("prefill", 5601);
    let finished = ConnectorCall::RequestFinished {
        request: id("p-1"),
        blocks: blocks(),
        num_tokens: 32,
        params: KvTransferParams {
            do_remote_decode: true,
            ..KvTransferParams::default()
        },
    };
    let Ok(ConnectorReply::DecodeParams(answer)) = p.handle_call(Time::ZERO, finished) else {
        panic!("P answers with the parameters for D");
    };
    assert_eq!(answer.remote_port, Some(5600), "the engine's base port");

    let mut d = rank_one("decode", 6601);
    let mut call = allocated(&id("d-1"), 2);
    if let ConnectorCall::RequestAllocated { params, .. } = &mut call {
        params.remote_host = answer.remote_host.clone();
        params.remote_port = answer.remote_port;
    }
    d.handle_call(Time::ZERO, call).unwrap();
    let address = d.poll_output();
    assert!(
        matches!(
            &address,
            Some(SessionOutput::PeerAddress(PeerAddress { port: 5601, .. }))
        ),
        "P's rank 1 at the base + 1: {address:?}"
    );
    assert!(matches!(
        d.poll_output(),
        Some(SessionOutput::Connect(peer)) if peer.rank == 1
    ));

    // A base so high that the rank's port would not exist is a typed refusal.
    let mut past = allocated(&id("d-2"), 2);
    if let ConnectorCall::RequestAllocated { params, .. } = &mut past {
        params.remote_host = Some("10.0.0.7".into());
        params.remote_port = Some(u16::MAX);
    }
    assert!(matches!(
        d.handle_call(Time::ZERO, past),
        Err(ConnectorError::InvalidParam {
            name: "remote_port",
            ..
        })
    ));
}

/// Over a side channel every P rank listens at its own port (the base + its rank): a D rank
/// fed by several P ranks of one engine gives each sub-request its own P rank's address, ahead
/// of that rank's handshake (this was refused while the side channel kept one address per
/// engine). A base port that puts one of them past 65535 refuses the whole request, typed.
#[test]
fn each_p_rank_of_a_multi_rank_request_gets_its_own_side_channel_address() {
    let with_port = |request: &str, port| {
        let mut call = allocated(&id(request), 2);
        if let ConnectorCall::RequestAllocated { params, .. } = &mut call {
            params.remote_host = Some("10.0.0.7".into());
            params.remote_port = Some(port);
        }
        call
    };
    // (rank, port) of each address, and the ranks dialled, in output order.
    let addresses_and_connects = |session: &mut Session| {
        let mut addresses = Vec::new();
        let mut connects = Vec::new();
        while let Some(output) = session.poll_output() {
            match output {
                SessionOutput::PeerAddress(PeerAddress {
                    engine, rank, port, ..
                }) => {
                    assert_eq!(engine.as_str(), "prefill");
                    addresses.push((rank, port));
                }
                SessionOutput::Connect(peer) => {
                    assert!(
                        addresses.iter().any(|&(rank, _)| rank == peer.rank),
                        "{peer}'s address comes before its handshake"
                    );
                    connects.push(peer.rank);
                }
                _ => {}
            }
        }
        (addresses, connects)
    };
    let mut one = session("decode", Some(decode_links(vec![1])));
    one.set_peer_addresses(true);
    one.handle_call(Time::ZERO, with_port("d-1", 5600)).unwrap();
    assert_eq!(
        addresses_and_connects(&mut one),
        (vec![(1, 5601)], vec![1]),
        "P's rank 1 at the base + 1"
    );

    let mut two = session("decode", Some(decode_links(vec![0, 1])));
    two.set_peer_addresses(true);
    two.handle_call(Time::ZERO, with_port("d-2", 5600)).unwrap();
    assert_eq!(two.fans_in_progress(), 1);
    assert_eq!(
        addresses_and_connects(&mut two),
        (vec![(0, 5600), (1, 5601)], vec![0, 1]),
        "each P rank at its own port"
    );

    // Rank 0 would fit at 65535, rank 1 would not: nothing starts, nothing is queued.
    let mut past = session("decode", Some(decode_links(vec![0, 1])));
    past.set_peer_addresses(true);
    assert!(matches!(
        past.handle_call(Time::ZERO, with_port("d-3", u16::MAX)),
        Err(ConnectorError::InvalidParam {
            name: "remote_port",
            ..
        })
    ));
    assert_eq!(past.fans_in_progress(), 0, "nothing started");
    assert_eq!(
        drain(&mut past),
        (vec![], 0),
        "a refused call queues nothing"
    );
}

/// D rank 0 fed by P ranks 0 and 1; both die. The engine hears one `DecodeFenced` for its
/// request (at the first pair fenced), and one `Failed` once both pairs handed back.
#[test]
fn a_multi_rank_request_is_told_once() {
    let mut d = session("decode", Some(decode_links(vec![0, 1])));
    let request = id("d-2");
    d.handle_call(Time::ZERO, allocated(&request, 2)).unwrap();
    drain(&mut d);
    assert_eq!(
        d.fans_in_progress(),
        1,
        "precondition: the request fans out"
    );
    let key = PairingKey::from_request_id(&request);
    let sub = |p: u32| {
        (
            sub_request_id(&request, p, 0).unwrap(),
            key.for_pair(p, 0).unwrap(),
        )
    };
    let ((sub0, _), (sub1, key1)) = (sub(0), sub(1));
    d.engine_event(fenced(&sub1, key1.clone(), DecodeFailure::PeerDead));
    let (events, _) = drain(&mut d);
    assert_eq!(
        events,
        vec![ConnectorEvent::DecodeFenced {
            request: request.clone(),
            reason: DecodeFailure::PeerDead,
        }]
    );
    assert_eq!(
        d.counters().siblings_aborted,
        1,
        "pair 0 is aborted at once"
    );
    // Pair 0 never registered (no handshake here): its abort ended it at once, and its own
    // event was folded, not forwarded.
    assert!(!d.endpoint().live_decode_blocks().any(|(r, _)| r == &sub0));
    assert_eq!(d.fans_in_progress(), 1, "pair 1 is still fenced");
    d.engine_event(freed(&sub1, key1, DecodeFailure::PeerDead));
    let (events, _) = drain(&mut d);
    assert_eq!(
        events,
        vec![ConnectorEvent::Failed {
            request,
            reason: DecodeFailure::PeerDead,
            proof: FreeProof::DeadPeerFence,
            blocks: blocks(),
        }]
    );
    assert_eq!(d.fans_in_progress(), 0);
}

/// A sub-request the endpoint refuses after its sibling started: the request fails at once,
/// the started sibling is aborted, and the engine gets one `Failed` when it handed back.
#[test]
fn a_refused_sub_request_fails_the_request_and_aborts_its_sibling() {
    let mut d = session("decode", Some(decode_links(vec![0, 1])));
    let request = id("d-3");
    let key = PairingKey::from_request_id(&request);
    // Pair 1's key is taken already (a stale request of an earlier run, say).
    let squatter = EndpointCall::DecodeAllocated(DecodeStart {
        request: id("squatter"),
        key: key.for_pair(1, 0).unwrap(),
        epoch: Epoch::FIRST,
        prefill: PeerAddr::new(EngineId::new("prefill").unwrap(), 1),
        blocks: BlockIds::single_group(vec![9]),
        num_tokens: 16,
        expected_writes: 1,
    });
    d.endpoint_mut().handle_call(Time::ZERO, squatter).unwrap();
    drain(&mut d);
    assert_eq!(
        d.handle_call(Time::ZERO, allocated(&request, 2)),
        Ok(ConnectorReply::Accepted),
        "pair 0 started: the call is accepted and owes its event"
    );
    assert_eq!(
        d.counters().subs_refused,
        1,
        "precondition: pair 1 was refused"
    );
    assert_eq!(d.counters().siblings_aborted, 1);
    let (events, _) = drain(&mut d);
    let ours: Vec<_> = events.iter().filter(|e| e.request() == &request).collect();
    assert_eq!(ours.len(), 1, "{events:?}");
    assert!(
        matches!(ours[0], ConnectorEvent::Failed { proof: FreeProof::NeverExposed, blocks: b, .. } if *b == blocks()),
        "{events:?}"
    );
    assert_eq!(d.fans_in_progress(), 0);
}

#[test]
fn every_sub_request_refused_leaves_the_blocks_with_the_engine() {
    let mut d = session("decode", Some(decode_links(vec![0, 1])));
    d.handle_call(Time::ZERO, ConnectorCall::Shutdown).unwrap();
    let refused = d.handle_call(Time::ZERO, allocated(&id("d-4"), 2));
    assert_eq!(
        refused,
        Err(ConnectorError::Rejected(Rejected::ShuttingDown))
    );
    assert_eq!(drain(&mut d).0, vec![]);
    assert_eq!(d.fans_in_progress(), 0);
}

#[test]
fn a_prefill_replica_hands_its_blocks_back_at_once() {
    let links = RankLinks {
        side: SideName::Prefill,
        rank: 1,
        remote_tp: 1,
        remote_ranks: 1,
        peers: vec![],
    };
    let mut p = session("prefill", Some(links));
    let request = id("p-1");
    let call = ConnectorCall::RequestFinished {
        request: request.clone(),
        blocks: blocks(),
        num_tokens: 32,
        params: KvTransferParams::default(),
    };
    assert!(matches!(
        p.handle_call(Time::ZERO, call),
        Ok(ConnectorReply::DecodeParams(_))
    ));
    assert_eq!(
        drain(&mut p).0,
        vec![ConnectorEvent::BlocksFree {
            request,
            released: None,
            blocks: blocks(),
        }]
    );
}

#[test]
fn an_abort_of_a_multi_rank_request_aborts_every_pair() {
    let mut d = session("decode", Some(decode_links(vec![0, 1])));
    let request = id("d-5");
    d.handle_call(Time::ZERO, allocated(&request, 2)).unwrap();
    drain(&mut d);
    d.handle_call(
        Time::ZERO,
        ConnectorCall::Abort {
            request: request.clone(),
        },
    )
    .unwrap();
    let (events, _) = drain(&mut d);
    assert_eq!(events.len(), 1, "{events:?}");
    assert!(matches!(
        &events[0],
        ConnectorEvent::Failed {
            reason: DecodeFailure::Aborted,
            ..
        }
    ));
    assert_eq!(
        d.handle_call(Time::ZERO, ConnectorCall::Abort { request }),
        Err(ConnectorError::Rejected(Rejected::UnknownRequest(id(
            "d-5"
        )))),
        "gone: a second abort is refused"
    );
}

#[test]
fn an_export_answers_with_its_hard_end_on_the_session_clock() {
    let mut p = session("prefill", None);
    let now = Time::from_duration(std::time::Duration::from_secs(100));
    let call = ConnectorCall::RequestFinished {
        request: id("p-2"),
        blocks: blocks(),
        num_tokens: 32,
        params: KvTransferParams {
            transfer_mode: Some("pull".into()),
            ..KvTransferParams::default()
        },
    };
    let Ok(ConnectorReply::DecodeParams(params)) = p.handle_call(now, call) else {
        panic!("accepted");
    };
    let settings = ConnectorSettings::default();
    let hard_end = 100.0 + (settings.lease_duration * 2 + settings.read_span).as_secs_f64();
    assert_eq!(params.remote_blocks_expiry_time, Some(hard_end));
    assert_eq!(params.remote_block_ids, Some(blocks().groups));
}
