//! The shell's translation, driven without actors: `TransportDriver` over the in-memory
//! transport and its fault switches. Each case names the transport's behaviour and the endpoint
//! input the shell must make of it (the actix `TransportActor` and `RankActor` only forward).

// The shared fixture; this file needs only its geometry and model.
#[allow(dead_code)]
mod fixture;
use fixture::{geometry, model};

use kvhandoff_actors::system::{build_mem_rank, ShellConfig};
use kvhandoff_actors::transport::mem::{MemFabric, MemTransport};
use kvhandoff_protocol::driver::{
    connected_input, handshake_step, HandshakeStep, PeerInfo, TransportDriver, TransportOp,
};
use kvhandoff_protocol::machine::{Config, ConnectFailure, NetEvent, Time, WriteOrder};
use kvhandoff_protocol::{
    BlockIds, EngineId, Epoch, Incarnation, Message, PairingKey, WriteDone, WriteFailure,
};
use kvhandoff_protocol::{PeerAddr, WriteId};

struct Side {
    driver: TransportDriver<MemTransport>,
    info: PeerInfo,
    endpoint: kvhandoff_protocol::machine::Endpoint,
}

fn side(fabric: &MemFabric, name: &str) -> Side {
    let (setup, _pool) = build_mem_rank(
        fabric,
        &EngineId::new(name).unwrap(),
        geometry(),
        &model(),
        16,
        Config::fast(),
        ShellConfig::default(),
    )
    .unwrap();
    Side {
        info: setup.info.clone(),
        driver: TransportDriver::new(setup.transport, setup.info),
        endpoint: setup.endpoint,
    }
}

fn order(write: u64, to: &PeerAddr) -> WriteOrder {
    let key = PairingKey::new("key-1").unwrap();
    WriteOrder {
        write: WriteId(write),
        to: to.clone(),
        key: key.clone(),
        epoch: Epoch::FIRST,
        local: BlockIds::single_group(vec![1, 2]),
        remote: BlockIds::single_group(vec![3, 4]),
        notification: Message::WriteDone(WriteDone {
            key,
            epoch: Epoch::FIRST,
            prefill_rank: 0,
        }),
    }
}

fn perform(side: &mut Side, op: TransportOp) -> Vec<NetEvent> {
    let mut feed = Vec::new();
    side.driver.perform(op, &mut feed);
    feed
}

fn poll(side: &mut Side) -> Vec<NetEvent> {
    let mut feed = Vec::new();
    // The in-memory fabric lands a transfer on the poll after its post.
    for _ in 0..3 {
        side.driver.poll(&mut feed);
    }
    feed
}

fn post_failed(write: u64) -> Vec<NetEvent> {
    vec![NetEvent::WriteFailed {
        write: WriteId(write),
        failure: WriteFailure::PostFailed,
    }]
}

#[test]
fn writes_become_completions_failures_and_notifications() {
    let fabric = MemFabric::new();
    let (mut p, mut d) = (side(&fabric, "prefill"), side(&fabric, "decode"));
    let to = d.info.peer.clone();
    // A write to a peer the transport has not loaded cannot be planned: PostFailed.
    let feed = perform(&mut p, TransportOp::Post(Box::new(order(1, &to))));
    assert_eq!(feed, post_failed(1));
    p.driver.load_peer(d.info.clone()).unwrap();
    d.driver.load_peer(p.info.clone()).unwrap();
    // The transport refuses the post: PostFailed.
    p.driver
        .transport_mut()
        .update_faults(|f| f.fail_next_posts = 1);
    assert_eq!(
        perform(&mut p, TransportOp::Post(Box::new(order(2, &to)))),
        post_failed(2)
    );
    // A good write: its completion on P, its notification on D.
    assert!(perform(&mut p, TransportOp::Post(Box::new(order(3, &to)))).is_empty());
    assert_eq!(
        poll(&mut p),
        vec![NetEvent::WriteCompleted { write: WriteId(3) }]
    );
    let on_d = poll(&mut d);
    assert!(
        matches!(&on_d[..], [NetEvent::Received { from, message: Message::WriteDone(_) }] if *from == p.info.peer),
        "{on_d:?}"
    );
    // A transfer that fails in flight: TransferFailed.
    p.driver
        .transport_mut()
        .update_faults(|f| f.fail_next_transfers = 1);
    assert!(perform(&mut p, TransportOp::Post(Box::new(order(4, &to)))).is_empty());
    assert_eq!(
        poll(&mut p),
        vec![NetEvent::WriteFailed {
            write: WriteId(4),
            failure: WriteFailure::TransferFailed,
        }]
    );
    // An abandon the transport refuses changes nothing: the write's end still comes.
    p.driver.transport_mut().update_faults(|f| {
        f.hang_next_transfers = 1;
        f.refuse_abandon = true;
    });
    assert!(perform(&mut p, TransportOp::Post(Box::new(order(5, &to)))).is_empty());
    assert!(perform(&mut p, TransportOp::Abandon(WriteId(5))).is_empty());
    let stats = p.driver.stats();
    assert_eq!((stats.posted, stats.post_failures), (3, 2), "{stats:?}");
}

#[test]
fn a_send_to_an_invalidated_peer_is_the_peer_lost() {
    let fabric = MemFabric::new();
    let (mut p, d) = (side(&fabric, "prefill"), side(&fabric, "decode"));
    let to = d.info.peer.clone();
    p.driver.load_peer(d.info.clone()).unwrap();
    let message = Message::Heartbeat(kvhandoff_protocol::Heartbeat {
        engine: p.info.peer.engine.clone(),
        leases: vec![],
    });
    let send = |to: &PeerAddr| TransportOp::Send {
        to: to.clone(),
        message: message.clone(),
    };
    assert!(perform(&mut p, send(&to)).is_empty(), "delivered");
    assert!(perform(&mut p, TransportOp::Invalidate(to.clone())).is_empty());
    assert_eq!(
        perform(&mut p, send(&to)),
        vec![NetEvent::PeerLost { peer: to.clone() }]
    );
    // A peer the transport never heard of is not a death: counted, dropped.
    let stranger = PeerAddr::new(EngineId::new("stranger").unwrap(), 0);
    assert!(perform(&mut p, send(&stranger)).is_empty());
    assert_eq!(p.driver.stats().send_failures, 2);
}

#[test]
fn a_handshake_is_loaded_unless_it_repeats_the_connected_incarnation() {
    let fabric = MemFabric::new();
    let (mut p, d) = (side(&fabric, "prefill"), side(&fabric, "decode"));
    // A peer the endpoint does not know: load it, then report the load's result.
    assert_eq!(handshake_step(&p.endpoint, &d.info), HandshakeStep::Load);
    let connected = connected_input(&d.info, &Ok(()));
    assert_eq!(
        connected,
        NetEvent::PeerConnected {
            peer: d.info.peer.clone(),
            incarnation: d.info.incarnation,
        }
    );
    p.endpoint.handle_event(Time::ZERO, connected);
    // The same incarnation again: feed it, load nothing.
    assert_eq!(
        handshake_step(&p.endpoint, &d.info),
        HandshakeStep::Repeat(NetEvent::PeerConnected {
            peer: d.info.peer.clone(),
            incarnation: d.info.incarnation,
        })
    );
    // A new incarnation of the same engine: a restart, loaded.
    let restarted = PeerInfo {
        incarnation: Incarnation::random(),
        ..d.info.clone()
    };
    assert_eq!(handshake_step(&p.endpoint, &restarted), HandshakeStep::Load);
    // A load that failed is reported as the handshake failing.
    let refused = ConnectFailure::Refused("bad metadata".into());
    assert_eq!(
        connected_input(&restarted, &Err(refused.clone())),
        NetEvent::PeerConnectFailed {
            peer: restarted.peer.clone(),
            reason: refused,
        }
    );
}
