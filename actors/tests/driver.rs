//! The shell's translation, driven without actors: `TransportDriver` over the in-memory
//! transport and its fault switches. Each case names the transport's behaviour and the endpoint
//! input the shell must make of it (the actix `TransportActor` and `RankActor` only forward).

// The shared fixture; this file needs only its geometry and model.
mod fixture;
use fixture::{geometry, model};

use kvhandoff_actors::system::{build_mem_rank, ShellConfig};
use kvhandoff_actors::transport::mem::{MemFabric, MemTransport};
use kvhandoff_protocol::driver::{
    connected_input, handshake_step, HandshakeStep, PeerInfo, TransportDriver, TransportOp,
};
use kvhandoff_protocol::machine::{
    Config, ConnectFailure, NetEvent, ReadOrder, StreamedLayers, Time, WriteOrder,
};
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
            digests: Vec::new(),
        }),
        stream: None,
        remote_memory: Vec::new(),
    }
}

/// A layer-wise write of the fixture's two layers, posting its first `posted` at once.
fn streamed(write: u64, to: &PeerAddr, layers: u32, posted: u32) -> TransportOp {
    TransportOp::PostWrite(Box::new(WriteOrder {
        stream: Some(StreamedLayers { layers, posted }),
        ..order(write, to)
    }))
}

/// The layers D was told landed, from the notifications it polled.
fn parts_on(d: &mut Side) -> Vec<(u32, u32, u32)> {
    poll(d)
        .into_iter()
        .filter_map(|event| match event {
            NetEvent::Received {
                message: Message::WritePartDone(p),
                ..
            } => Some((p.first, p.count, p.of)),
            _ => None,
        })
        .collect()
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
    let feed = perform(&mut p, TransportOp::PostWrite(Box::new(order(1, &to))));
    assert_eq!(feed, post_failed(1));
    p.driver.load_peer(d.info.clone()).unwrap();
    d.driver.load_peer(p.info.clone()).unwrap();
    // The transport refuses the post: PostFailed.
    p.driver
        .transport_mut()
        .update_faults(|f| f.fail_next_posts = 1);
    assert_eq!(
        perform(&mut p, TransportOp::PostWrite(Box::new(order(2, &to)))),
        post_failed(2)
    );
    // A good write: its completion on P, its notification on D.
    assert!(perform(&mut p, TransportOp::PostWrite(Box::new(order(3, &to)))).is_empty());
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
    assert!(perform(&mut p, TransportOp::PostWrite(Box::new(order(4, &to)))).is_empty());
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
    assert!(perform(&mut p, TransportOp::PostWrite(Box::new(order(5, &to)))).is_empty());
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

/// A rank with a transfer route: the driver posts the route's descriptors (not the planner's)
/// and counts them; a route's refusal is `WriteFailed(PostFailed)`, with nothing posted.
#[test]
fn a_route_places_writes_and_its_refusal_is_a_post_failure() {
    use kvhandoff_protocol::driver::{RouteDirection, RouteError, RouteRequest, TransferRoute};
    use kvhandoff_protocol::planner::Descriptor;
    use std::sync::{Arc, Mutex};

    /// Copies 100 bytes from P's first region to D's, for key-1 only; records what it was asked.
    struct OneCopy {
        asked: Mutex<Vec<(RouteDirection, String, BlockIds)>>,
        from: u64,
        to: u64,
    }
    impl TransferRoute for OneCopy {
        fn accepts(
            &self,
            _: &kvhandoff_protocol::KvGeometry,
            _: &kvhandoff_protocol::KvGeometry,
        ) -> Result<(), RouteError> {
            Ok(())
        }
        fn descriptors(
            &self,
            request: &RouteRequest<'_>,
            out: &mut Vec<Descriptor>,
        ) -> Result<(), RouteError> {
            self.asked.lock().unwrap().push((
                request.direction,
                request.key.to_string(),
                request.remote.clone(),
            ));
            if request.key.as_str() != "key-1" {
                return Err(RouteError("unknown key".into()));
            }
            out.push(Descriptor {
                local_addr: self.from,
                remote_addr: self.to,
                len: 100,
            });
            Ok(())
        }
    }

    let fabric = MemFabric::new();
    let (mut p, mut d) = (side(&fabric, "prefill"), side(&fabric, "decode"));
    let route = Arc::new(OneCopy {
        asked: Mutex::new(Vec::new()),
        from: p.info.regions[0].base,
        to: d.info.regions[1].base + 7,
    });
    p.driver.set_route(route.clone());
    p.driver.load_peer(d.info.clone()).unwrap();
    d.driver.load_peer(p.info.clone()).unwrap();
    let to = d.info.peer.clone();
    assert!(perform(&mut p, TransportOp::PostWrite(Box::new(order(1, &to)))).is_empty());
    assert_eq!(
        poll(&mut p),
        vec![NetEvent::WriteCompleted { write: WriteId(1) }]
    );
    let stats = p.driver.stats();
    assert_eq!((stats.posted, stats.descriptors, stats.bytes), (1, 1, 100));
    // Another key: the route refuses, nothing is posted.
    let mut other = order(2, &to);
    other.key = PairingKey::new("key-2").unwrap();
    assert_eq!(
        perform(&mut p, TransportOp::PostWrite(Box::new(other))),
        post_failed(2)
    );
    assert_eq!(p.driver.stats().posted, 1);
    assert_eq!(p.driver.stats().post_failures, 1);
    let asked = route.asked.lock().unwrap();
    assert_eq!(asked.len(), 2);
    assert_eq!(
        asked[0],
        (
            RouteDirection::Write,
            "key-1".to_string(),
            BlockIds::single_group(vec![3, 4])
        )
    );
    drop(asked);
    assert!(
        !poll(&mut d).is_empty(),
        "D gets the routed write's notification"
    );
}

/// A layer-wise write goes out in parts, each with its own notification, and ends once: after
/// its last part landed.
#[test]
fn a_layer_wise_write_ends_after_its_last_part() {
    let fabric = MemFabric::new();
    let (mut p, mut d) = (side(&fabric, "prefill"), side(&fabric, "decode"));
    let to = d.info.peer.clone();
    p.driver.load_peer(d.info.clone()).unwrap();
    d.driver.load_peer(p.info.clone()).unwrap();
    assert!(perform(&mut p, streamed(1, &to, 2, 1)).is_empty());
    assert!(poll(&mut p).is_empty(), "ended before its last part");
    assert_eq!(parts_on(&mut d), vec![(0, 1, 2)]);
    let extend = TransportOp::ExtendWrite {
        write: WriteId(1),
        from: 1,
        to: 2,
    };
    assert!(perform(&mut p, extend).is_empty());
    assert_eq!(
        poll(&mut p),
        vec![NetEvent::WriteCompleted { write: WriteId(1) }]
    );
    assert_eq!(parts_on(&mut d), vec![(1, 1, 2)]);
    // A write whose layers are not this rank's cannot be split: PostFailed.
    assert_eq!(perform(&mut p, streamed(2, &to, 3, 1)), post_failed(2));
}

/// An abandoned layer-wise write posts nothing more and ends once its posted parts ended.
#[test]
fn an_abandoned_layer_wise_write_ends_with_its_posted_parts() {
    let fabric = MemFabric::new();
    let (mut p, d) = (side(&fabric, "prefill"), side(&fabric, "decode"));
    let to = d.info.peer.clone();
    p.driver.load_peer(d.info.clone()).unwrap();
    p.driver
        .transport_mut()
        .update_faults(|f| f.hang_next_transfers = 1);
    assert!(perform(&mut p, streamed(1, &to, 2, 1)).is_empty());
    assert!(perform(&mut p, TransportOp::Abandon(WriteId(1))).is_empty());
    let extend = TransportOp::ExtendWrite {
        write: WriteId(1),
        from: 1,
        to: 2,
    };
    assert!(perform(&mut p, extend).is_empty());
    assert_eq!(
        poll(&mut p),
        vec![NetEvent::WriteFailed {
            write: WriteId(1),
            failure: WriteFailure::TransferFailed,
        }]
    );
    assert_eq!(p.driver.stats().posted, 1, "one write, one part posted");
}

/// Block ids past the registered regions — the remote ones come from the peer (D's
/// registration for a write, P's answer for a read), the local ones from the engine — are
/// refused by the planner before the transport is called: `WriteFailed(PostFailed)`, nothing
/// posted. The last block of the pool still posts.
#[test]
fn blocks_past_the_registered_regions_never_reach_the_transport() {
    let fabric = MemFabric::new();
    let (mut p, d) = (side(&fabric, "prefill"), side(&fabric, "decode"));
    let to = d.info.peer.clone();
    p.driver.load_peer(d.info.clone()).unwrap();
    let posted = |p: &mut Side| {
        let s = p.driver.transport_mut().stats();
        (s.posted, s.post_errors)
    };
    let before = posted(&mut p);
    // The fixture's pools have 16 logical blocks: 0..=15.
    let cases = [
        (1, vec![1, 2], vec![3, 16]),
        (2, vec![1, 16], vec![3, 4]),
        (3, vec![1], vec![u32::MAX]),
    ];
    for (write, local, remote) in cases {
        let o = WriteOrder {
            local: BlockIds::single_group(local),
            remote: BlockIds::single_group(remote),
            ..order(write, &to)
        };
        assert_eq!(
            perform(&mut p, TransportOp::PostWrite(Box::new(o))),
            post_failed(write)
        );
    }
    let read = ReadOrder {
        read: WriteId(4),
        from: to.clone(),
        key: PairingKey::new("key-2").unwrap(),
        epoch: Epoch::FIRST,
        local: BlockIds::single_group(vec![1]),
        remote: BlockIds::single_group(vec![16]),
        remote_memory: Vec::new(),
    };
    assert_eq!(
        perform(&mut p, TransportOp::PostRead(Box::new(read))),
        post_failed(4)
    );
    assert_eq!(posted(&mut p), before, "the transport was never called");
    assert_eq!(p.driver.stats().post_failures, 4);
    let last = WriteOrder {
        local: BlockIds::single_group(vec![15]),
        remote: BlockIds::single_group(vec![15]),
        ..order(5, &to)
    };
    assert!(perform(&mut p, TransportOp::PostWrite(Box::new(last))).is_empty());
    assert_eq!(posted(&mut p).0, before.0 + 1);
}

/// What the driver told its observer, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Seen {
    Posting,
    Posted(u64, usize, u64),
    Ended(u64, bool),
    NotificationFailed,
}

#[derive(Clone, Default)]
struct Recorder(std::sync::Arc<std::sync::Mutex<Vec<Seen>>>);

impl Recorder {
    fn take(&self) -> Vec<Seen> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

impl kvhandoff_protocol::driver::TransferObserver for Recorder {
    fn posting(&mut self) {
        self.0.lock().unwrap().push(Seen::Posting);
    }
    fn posted(&mut self, id: WriteId, descriptors: usize, bytes: u64) {
        self.0
            .lock()
            .unwrap()
            .push(Seen::Posted(id.0, descriptors, bytes));
    }
    fn ended(&mut self, id: WriteId, ok: bool) {
        self.0.lock().unwrap().push(Seen::Ended(id.0, ok));
    }
    fn notification_failed(&mut self, _: &kvhandoff_protocol::transport::TransportError) {
        self.0.lock().unwrap().push(Seen::NotificationFailed);
    }
}

/// The observer (the transport actor's per-transfer metrics) hears of each transfer posted,
/// once, with its descriptors and bytes, and of its end; a post that fails is never `posted`.
#[test]
fn the_observer_sees_each_transfer_posted_and_ended_once() {
    let fabric = MemFabric::new();
    let (mut p, d) = (side(&fabric, "prefill"), side(&fabric, "decode"));
    let seen = Recorder::default();
    p.driver.set_observer(Box::new(seen.clone()));
    let to = d.info.peer.clone();
    // Not planned (the peer is not loaded): no post call, nothing posted.
    assert_eq!(
        perform(&mut p, TransportOp::PostWrite(Box::new(order(1, &to)))),
        post_failed(1)
    );
    assert_eq!(seen.take(), vec![]);
    p.driver.load_peer(d.info.clone()).unwrap();
    // Refused by the transport: the post call ran, nothing was posted.
    p.driver
        .transport_mut()
        .update_faults(|f| f.fail_next_posts = 1);
    assert_eq!(
        perform(&mut p, TransportOp::PostWrite(Box::new(order(2, &to)))),
        post_failed(2)
    );
    assert_eq!(seen.take(), vec![Seen::Posting]);
    // A good write, then one that fails in flight.
    assert!(perform(&mut p, TransportOp::PostWrite(Box::new(order(3, &to)))).is_empty());
    poll(&mut p);
    let good = seen.take();
    let [Seen::Posting, Seen::Posted(3, descriptors, bytes), Seen::Ended(3, true)] = good[..]
    else {
        panic!("{good:?}");
    };
    let stats = p.driver.stats();
    assert_eq!(
        (descriptors as u64, bytes),
        (stats.descriptors, stats.bytes)
    );
    assert!(descriptors > 0 && bytes > 0);
    p.driver
        .transport_mut()
        .update_faults(|f| f.fail_next_transfers = 1);
    assert!(perform(&mut p, TransportOp::PostWrite(Box::new(order(4, &to)))).is_empty());
    poll(&mut p);
    assert_eq!(
        seen.take(),
        vec![
            Seen::Posting,
            Seen::Posted(4, descriptors, bytes),
            Seen::Ended(4, false)
        ]
    );
    // A layer-wise write is one transfer, ended when its last part ends.
    assert!(perform(&mut p, streamed(5, &to, 2, 1)).is_empty());
    poll(&mut p);
    let extend = TransportOp::ExtendWrite {
        write: WriteId(5),
        from: 1,
        to: 2,
    };
    assert!(perform(&mut p, extend).is_empty());
    poll(&mut p);
    assert_eq!(
        seen.take(),
        vec![
            Seen::Posting,
            Seen::Posted(5, descriptors, bytes),
            Seen::Ended(5, true)
        ]
    );
    // A notification the transport cannot send; a heartbeat's failure is not one (as vLLM).
    let stranger = PeerAddr::new(EngineId::new("stranger").unwrap(), 0);
    let heartbeat = Message::Heartbeat(kvhandoff_protocol::Heartbeat {
        engine: p.info.peer.engine.clone(),
        leases: vec![],
    });
    let send = |message: Message| TransportOp::Send {
        to: stranger.clone(),
        message,
    };
    perform(&mut p, send(heartbeat));
    assert_eq!(seen.take(), vec![]);
    perform(&mut p, send(order(6, &to).notification));
    assert_eq!(seen.take(), vec![Seen::NotificationFailed]);
    assert_eq!(
        p.driver.stats().send_failures,
        2,
        "both counted by the driver"
    );
}
