//! The TCP side channel over real loopback sockets (127.0.0.1 only), on the real clock: two
//! ranks handshake over TCP and complete push requests end to end (both races); a listening rank
//! rejects hostile peers (and engines it does not accept), counting each by reason, and keeps
//! serving; a repeated handshake of a live incarnation changes nothing, a new incarnation is a
//! restart; an initiator reports typed failures.
//!
//! Both ranks share one `MemFabric` in process (MemTransport metadata is only valid there): the
//! point is the TCP handshake, not the transport.

mod fixture;
use fixture::{call, decode_start, fill, geometry, model, next_event, prefill_start, wrong_bytes};

/// How long a test waits for a rank's next event.
const EVENT_WITHIN: Duration = Duration::from_secs(10);

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvhandoff_actors::system::{
    build_mem_rank, start_rank, AcceptPolicy, AddPeerAddress, Handshaker, KvPool, QueryCounters,
    QuerySideChannel, RankHandle, RejectReason, ShellConfig, SideChannelConfig, SideChannelStats,
};
use kvhandoff_actors::transport::mem::MemFabric;
use kvhandoff_protocol::driver::PeerInfo;
use kvhandoff_protocol::machine::{Config, Counters, DecodeFailure, EndpointCall, FreeProof};
use kvhandoff_protocol::session::ConnectorEvent;
use kvhandoff_protocol::wire::{self, HEADER_LEN, MAX_PAYLOAD_LEN};
use kvhandoff_protocol::{
    BlockIds, CompatHash, EngineId, Epoch, Handshake, Incarnation, KvLayout, Message, PairingKey,
    PeerAddr, Register, RequestId, TraceId, TransferMode, PROTOCOL_VERSION,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

/// A listener that also takes handshakes from these engines (D engines that dial a P whose
/// peer book does not name them).
fn accepting(names: &[&str]) -> AcceptPolicy {
    AcceptPolicy::Known(names.iter().map(|n| engine(n)).collect())
}

/// The handshake budget of a [`start_quick`] rank, so hostile peers are cut quickly.
const QUICK_HANDSHAKE: Duration = Duration::from_millis(300);

/// Short real timeouts; takes `decode` and `raw-d`.
fn quick() -> SideChannelConfig {
    SideChannelConfig {
        connect_timeout: Duration::from_millis(300),
        accept: accepting(&["decode", "raw-d"]),
        ..SideChannelConfig::new(loopback())
    }
}

/// A rank on [`quick`] with the [`QUICK_HANDSHAKE`] budget.
fn start_quick(fabric: &MemFabric, name: &str) -> Rank {
    start_with(fabric, name, quick(), QUICK_HANDSHAKE)
}

struct Rank {
    handle: RankHandle,
    pool: KvPool,
    addr: SocketAddr,
}

fn engine(name: &str) -> EngineId {
    EngineId::new(name).unwrap()
}

fn start(fabric: &MemFabric, name: &str, config: SideChannelConfig) -> Rank {
    start_with(
        fabric,
        name,
        config,
        ShellConfig::default().handshake_timeout,
    )
}

/// A rank whose handshakes (each side's part) may take `handshake`.
fn start_with(
    fabric: &MemFabric,
    name: &str,
    config: SideChannelConfig,
    handshake: Duration,
) -> Rank {
    let shell = ShellConfig {
        handshake_timeout: handshake,
        ..ShellConfig::default()
    };
    let (setup, pool) = build_mem_rank(
        fabric,
        &engine(name),
        geometry(),
        &model(),
        32,
        Config::fast(),
        shell,
    )
    .unwrap();
    let handle = start_rank(setup, Handshaker::Tcp(config), None).unwrap();
    let addr = handle.side_channel.expect("a TCP rank reports its address");
    assert_ne!(addr.port(), 0, "port 0 is resolved to the bound port");
    Rank { handle, pool, addr }
}

/// A rank's handshake payload without starting it (a raw client speaks for it).
fn unstarted_info(fabric: &MemFabric, name: &str) -> PeerInfo {
    let (setup, _) = build_mem_rank(
        fabric,
        &engine(name),
        geometry(),
        &model(),
        32,
        Config::fast(),
        ShellConfig::default(),
    )
    .unwrap();
    setup.info
}

async fn add_peer(rank: &Rank, name: &str, addr: SocketAddr) {
    rank.handle
        .link
        .send(AddPeerAddress {
            peer: PeerAddr::new(engine(name), 0),
            addr,
        })
        .await
        .unwrap()
        .unwrap();
}

async fn stats(rank: &Rank) -> SideChannelStats {
    rank.handle.link.send(QuerySideChannel).await.unwrap()
}

/// D registers first: the push completes, every byte lands.
async fn push_d_first(
    p: &mut Rank,
    d: &mut Rank,
    tag: &str,
    d_blocks: Vec<u32>,
    p_blocks: Vec<u32>,
) {
    let d_id = format!("{tag}-11111111");
    let p_id = format!("{tag}-22222222");
    call(
        &d.handle,
        EndpointCall::DecodeAllocated(decode_start(&d_id, "prefill", d_blocks.clone())),
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    fill(&p.pool, tag, &p_blocks);
    call(
        &p.handle,
        EndpointCall::PrefillFinished(prefill_start(&p_id, p_blocks)),
    )
    .await
    .unwrap();
    let event = next_event(&mut d.handle, EVENT_WITHIN).await;
    assert!(
        matches!(&event, ConnectorEvent::BlocksReady { .. }),
        "{event:?}"
    );
    assert_eq!(
        wrong_bytes(&d.pool, tag, &d_blocks),
        0,
        "every byte of {tag}"
    );
    let event = next_event(&mut p.handle, EVENT_WITHIN).await;
    assert!(
        matches!(event, ConnectorEvent::BlocksFree { released: None, .. }),
        "{event:?}"
    );
}

#[actix_rt::test]
async fn tcp_ranks_deliver_both_races() {
    let fabric = MemFabric::new();
    let mut p = start(&fabric, "prefill", SideChannelConfig::new(loopback()));
    let mut d = start(&fabric, "decode", SideChannelConfig::new(loopback()));
    add_peer(&d, "prefill", p.addr).await;
    add_peer(&p, "decode", d.addr).await;

    // D registers first (D dials P over TCP).
    push_d_first(&mut p, &mut d, "req-a", vec![3, 4, 5], vec![20, 21, 22]).await;

    // P finishes first: P holds its blocks until D registers.
    let p_blocks = vec![1, 9, 10];
    fill(&p.pool, "req-b", &p_blocks);
    call(
        &p.handle,
        EndpointCall::PrefillFinished(prefill_start("req-b-33333333", p_blocks)),
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    let d_blocks = vec![7, 8, 0];
    call(
        &d.handle,
        EndpointCall::DecodeAllocated(decode_start("req-b-44444444", "prefill", d_blocks.clone())),
    )
    .await
    .unwrap();
    let event = next_event(&mut d.handle, EVENT_WITHIN).await;
    assert!(
        matches!(event, ConnectorEvent::BlocksReady { .. }),
        "{event:?}"
    );
    assert_eq!(
        wrong_bytes(&d.pool, "req-b", &d_blocks),
        0,
        "every byte of req-b"
    );
    let event = next_event(&mut p.handle, EVENT_WITHIN).await;
    assert!(
        matches!(event, ConnectorEvent::BlocksFree { released: None, .. }),
        "{event:?}"
    );

    let (ds, ps) = (stats(&d).await, stats(&p).await);
    assert_eq!(ds.listen, Some(d.addr));
    assert!(ds.outgoing_ok >= 1, "{ds:?}");
    assert!(ps.incoming_ok >= 1, "{ps:?}");
    assert_eq!(ds.total_rejected() + ps.total_rejected(), 0);
    assert!(ds.outgoing_failed.is_empty() && ps.outgoing_failed.is_empty());
    let clock = ds
        .clocks
        .get(&engine("prefill"))
        .expect("D estimated P's clock");
    let rtt = clock
        .rtt_us
        .expect("an initiator's estimate has a round trip");
    assert!(rtt < 5_000_000, "{clock:?}");
    // Both links started within the test: their clocks are close.
    assert!(clock.offset_us.unsigned_abs() < 5_000_000, "{clock:?}");
    assert!(ps.clocks.contains_key(&engine("decode")), "{ps:?}");
}

/// Connects, writes `bytes`, optionally half-closes, and reads until the listener closes.
/// Returns what the listener wrote and how long the listener took to close.
async fn probe(addr: SocketAddr, bytes: &[u8], half_close: bool) -> (Vec<u8>, Duration) {
    let started = Instant::now();
    let mut stream = TcpStream::connect(addr).await.unwrap();
    if !bytes.is_empty() {
        // The listener may close (and reset) before everything is written.
        let _ = stream.write_all(bytes).await;
    }
    if half_close {
        let _ = stream.shutdown().await;
    }
    let mut got = Vec::new();
    // A reset is a close too; what was read before it stays in `got`.
    let _ = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut got))
        .await
        .expect("the listener closes the connection");
    (got, started.elapsed())
}

fn frame_of(handshake: Handshake) -> Vec<u8> {
    wire::encode(&Message::Handshake(Box::new(handshake)))
}

#[actix_rt::test]
async fn hostile_peers_are_rejected_counted_and_survived() {
    let fabric = MemFabric::new();
    let mut p = start_quick(&fabric, "prefill");
    let raw = unstarted_info(&fabric, "raw-d");
    let good = raw.handshake(vec![TransferMode::Push], 7, TraceId::random());
    let good_frame = frame_of(good.clone());
    let with = |f: &dyn Fn(&mut Handshake)| {
        let mut h = good.clone();
        f(&mut h);
        frame_of(h)
    };
    let patched = |at: usize, byte: u8| {
        let mut frame = good_frame.clone();
        frame[at] = byte;
        frame
    };
    let header = |kind: u8, len: u32| {
        let mut h = Vec::from(*b"KVHO");
        h.extend_from_slice(&wire::PROTOCOL_VERSION.to_le_bytes());
        h.extend_from_slice(&[kind, 0]);
        h.extend_from_slice(&len.to_le_bytes());
        h
    };
    let register = wire::encode(&Message::Register(Box::new(Register {
        key: PairingKey::new("k-1").unwrap(),
        epoch: Epoch::FIRST,
        decode_engine: engine("raw-d"),
        decode_request: RequestId::new("r-1").unwrap(),
        decode_rank: 0,
        blocks: BlockIds::single_group(vec![1]),
        num_tokens: 4,
        trace_id: TraceId::random(),
        memory: Vec::new(),
    })));
    let mut malformed = header(1, 20);
    malformed.extend_from_slice(&[0xff; 20]);
    let slow_loris = good_frame[..HEADER_LEN + 10].to_vec();

    // (what, bytes, half-close after writing, expected reason)
    let cases: Vec<(&str, Vec<u8>, bool, RejectReason)> = vec![
        ("nothing, then close", vec![], true, RejectReason::Closed),
        (
            "garbage",
            b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
            false,
            RejectReason::BadMagic,
        ),
        (
            "short garbage",
            vec![0, 1, 2],
            false,
            RejectReason::BadMagic,
        ),
        ("bad magic", patched(0, b'X'), false, RejectReason::BadMagic),
        (
            "unsupported version",
            patched(4, 99),
            false,
            RejectReason::UnsupportedVersion,
        ),
        (
            "unknown kind",
            patched(6, 200),
            false,
            RejectReason::UnknownKind,
        ),
        (
            "reserved flags",
            patched(7, 1),
            false,
            RejectReason::ReservedFlags,
        ),
        (
            "oversized payload",
            header(1, MAX_PAYLOAD_LEN as u32 + 1),
            false,
            RejectReason::PayloadTooLarge,
        ),
        (
            "truncated payload, then close",
            good_frame[..good_frame.len() - 10].to_vec(),
            true,
            RejectReason::Truncated,
        ),
        (
            "truncated header, then close",
            good_frame[..7].to_vec(),
            true,
            RejectReason::Truncated,
        ),
        ("slow loris", slow_loris, false, RejectReason::TimedOut),
        ("silence", vec![], false, RejectReason::TimedOut),
        ("a register frame", register, false, RejectReason::WrongKind),
        (
            "malformed payload",
            malformed,
            false,
            RejectReason::Malformed,
        ),
        (
            "handshake protocol version",
            with(&|h: &mut Handshake| h.protocol_version = PROTOCOL_VERSION + 1),
            false,
            RejectReason::ProtocolVersion,
        ),
        (
            "compat hash mismatch",
            with(&|h: &mut Handshake| h.compat_hash = CompatHash([0xab; 32])),
            false,
            RejectReason::CompatMismatch,
        ),
        (
            "invalid geometry",
            with(&|h: &mut Handshake| h.geometry.head_dim = 0),
            false,
            RejectReason::InvalidGeometry,
        ),
        (
            "region table too short",
            with(&|h: &mut Handshake| {
                h.regions.pop();
            }),
            false,
            RejectReason::RegionTable,
        ),
        (
            "region block length",
            with(&|h: &mut Handshake| {
                h.regions[0].block_len /= 2;
            }),
            false,
            RejectReason::RegionTable,
        ),
        (
            "incompatible layout",
            with(&|h: &mut Handshake| h.geometry.layout = KvLayout::Nhd),
            false,
            RejectReason::Incompatible,
        ),
        (
            "no common mode",
            with(&|h: &mut Handshake| h.modes = vec![TransferMode::LayerwisePush]),
            false,
            RejectReason::NoCommonMode,
        ),
        (
            "our own engine",
            with(&|h: &mut Handshake| h.engine_id = engine("prefill")),
            false,
            RejectReason::OwnEngine,
        ),
        (
            "an engine neither in the peer book nor accepted",
            with(&|h: &mut Handshake| h.engine_id = engine("stranger")),
            false,
            RejectReason::NotAccepted,
        ),
    ];
    let timeout = QUICK_HANDSHAKE;
    for (i, (what, bytes, half_close, reason)) in cases.iter().enumerate() {
        let before = stats(&p).await;
        let published = kvhandoff_actors::metrics::transfer_snapshot().side_channel_rejections;
        let (got, took) = probe(p.addr, bytes, *half_close).await;
        assert!(
            got.is_empty(),
            "{what}: a rejection writes nothing, got {got:?}"
        );
        let after = stats(&p).await;
        assert_eq!(
            after.rejections(*reason),
            before.rejections(*reason) + 1,
            "{what}: counted as {reason:?}; {after:?}"
        );
        assert_eq!(after.total_rejected(), i as u64 + 1, "{what}: {after:?}");
        // Published process-wide for `/metrics` too (other tests of this binary may add).
        let now = kvhandoff_actors::metrics::transfer_snapshot().side_channel_rejections;
        assert!(now[reason] > published[reason], "{what}: not published");
        assert_eq!(after.incoming_ok, 0, "{what}");
        if *reason == RejectReason::TimedOut {
            assert!(
                took >= timeout - Duration::from_millis(50),
                "{what}: cut at {took:?}"
            );
        } else {
            assert!(took < Duration::from_secs(3), "{what}: took {took:?}");
        }
    }

    // The listener still serves a raw client that follows the rules...
    let mut stream = TcpStream::connect(p.addr).await.unwrap();
    stream.write_all(&good_frame).await.unwrap();
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await.unwrap();
    let Message::Handshake(answer) = wire::decode(&answer).unwrap() else {
        panic!("the answer is a handshake");
    };
    assert_eq!(answer.engine_id, engine("prefill"));
    assert_eq!(
        answer.modes,
        vec![
            TransferMode::Push,
            TransferMode::Pull,
            TransferMode::Bidirectional
        ]
    );
    let after = stats(&p).await;
    assert_eq!(after.incoming_ok, 1);
    assert!(after.clocks.contains_key(&engine("raw-d")), "{after:?}");

    // ... and a well-behaved rank completes a push.
    let mut d = start_quick(&fabric, "decode");
    add_peer(&d, "prefill", p.addr).await;
    push_d_first(&mut p, &mut d, "after-hostile", vec![2, 3], vec![4, 5]).await;
    let after = stats(&p).await;
    assert_eq!(after.incoming_ok, 2, "{after:?}");
    assert_eq!(after.total_rejected(), cases.len() as u64);
}

#[actix_rt::test]
async fn a_full_listener_closes_new_connections_at_once() {
    let fabric = MemFabric::new();
    let config = SideChannelConfig {
        max_concurrent: 2,
        accept: accepting(&["decode"]),
        ..SideChannelConfig::new(loopback())
    };
    let mut p = start_with(&fabric, "prefill", config, Duration::from_millis(1_500));
    // Two silent connections hold both slots.
    let idle_a = TcpStream::connect(p.addr).await.unwrap();
    let idle_b = TcpStream::connect(p.addr).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (got, took) = probe(p.addr, b"KVHO", false).await;
    assert!(got.is_empty());
    assert!(
        took < Duration::from_millis(1_000),
        "closed at once, not at the timeout: {took:?}"
    );
    let s = stats(&p).await;
    assert_eq!(s.rejections(RejectReason::Busy), 1, "{s:?}");
    assert_eq!(s.accepted, 3);
    // Once the silent ones are cut, a rank connects.
    drop((idle_a, idle_b));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut d = start(&fabric, "decode", SideChannelConfig::new(loopback()));
    add_peer(&d, "prefill", p.addr).await;
    push_d_first(&mut p, &mut d, "after-busy", vec![1], vec![2]).await;
}

/// A fake P listener that answers D's handshake with `answer(d's handshake)` (or never answers).
async fn fake_listener(answer: Option<fn(Handshake) -> Handshake>) -> SocketAddr {
    let listener = TcpListener::bind(loopback()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    actix_rt::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            actix_rt::spawn(async move {
                let mut header = [0u8; HEADER_LEN];
                if stream.read_exact(&mut header).await.is_err() {
                    return;
                }
                let len = wire::decode_header(&header).unwrap().payload_len;
                let mut frame = header.to_vec();
                frame.resize(HEADER_LEN + len, 0);
                stream.read_exact(&mut frame[HEADER_LEN..]).await.unwrap();
                let Message::Handshake(theirs) = wire::decode(&frame).unwrap() else {
                    panic!("D sends a handshake");
                };
                match answer {
                    Some(answer) => {
                        let ours = frame_of(answer(*theirs));
                        let _ = stream.write_all(&ours).await;
                        let _ = stream.shutdown().await;
                    }
                    None => {
                        // Hold the connection, say nothing.
                        tokio::time::sleep(Duration::from_secs(30)).await;
                    }
                }
            });
        }
    });
    addr
}

#[actix_rt::test]
async fn initiator_failures_are_typed() {
    let fabric = MemFabric::new();
    let mut d = start_quick(&fabric, "decode");
    // A port nothing listens on once the other listeners are up: held until then, so that the
    // system cannot hand the same port to one of them (which turned "refused" into "echo").
    let refused_holder = std::net::TcpListener::bind(loopback()).unwrap();
    let refused = refused_holder.local_addr().unwrap();
    add_peer(&d, "p-refused", refused).await;
    add_peer(&d, "p-silent", fake_listener(None).await).await;
    add_peer(&d, "p-echo", fake_listener(Some(|theirs| theirs)).await).await;
    add_peer(
        &d,
        "p-impostor",
        fake_listener(Some(|mut theirs| {
            theirs.engine_id = EngineId::new("impostor").unwrap();
            theirs
        }))
        .await,
    )
    .await;
    add_peer(
        &d,
        "p-other-model",
        fake_listener(Some(|mut theirs| {
            theirs.engine_id = EngineId::new("p-other-model").unwrap();
            theirs.compat_hash = CompatHash([1; 32]);
            theirs
        }))
        .await,
    )
    .await;
    drop(refused_holder);
    let cases = [
        ("p-unknown", RejectReason::NoAddress),
        ("p-refused", RejectReason::ConnectRefused),
        ("p-silent", RejectReason::TimedOut),
        ("p-echo", RejectReason::OwnEngine),
        ("p-impostor", RejectReason::UnexpectedEngine),
        ("p-other-model", RejectReason::CompatMismatch),
    ];
    for (i, (prefill, reason)) in cases.iter().enumerate() {
        let id = format!("{prefill}-req-{i}");
        call(
            &d.handle,
            EndpointCall::DecodeAllocated(decode_start(&id, prefill, vec![1, 2])),
        )
        .await
        .unwrap();
        let event = next_event(&mut d.handle, EVENT_WITHIN).await;
        assert!(
            matches!(
                event,
                ConnectorEvent::Failed {
                    reason: DecodeFailure::HandshakeFailed,
                    proof: FreeProof::NeverExposed,
                    ..
                }
            ),
            "{prefill}: {event:?}"
        );
        // The endpoint's own connect deadline may fire first; the link's verdict follows.
        let deadline = Instant::now() + Duration::from_secs(3);
        loop {
            let s = stats(&d).await;
            if s.failures(*reason) == 1 {
                assert_eq!(
                    s.outgoing_failed.values().sum::<u64>(),
                    i as u64 + 1,
                    "{prefill}: {s:?}"
                );
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{prefill}: {reason:?} not counted: {s:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let s = stats(&d).await;
    assert_eq!(s.outgoing_ok, 0);
    assert!(
        s.clocks.is_empty(),
        "no clock from a failed handshake: {s:?}"
    );
}

#[actix_rt::test]
async fn the_peer_book_is_bounded_and_a_restart_reconnects() {
    let fabric = MemFabric::new();
    let p = start(
        &fabric,
        "prefill",
        SideChannelConfig {
            max_peer_addresses: 1,
            ..SideChannelConfig::new(loopback())
        },
    );
    add_peer(&p, "d-1", loopback()).await;
    add_peer(&p, "d-1", p.addr).await; // replacing is fine
    let full = p
        .handle
        .link
        .send(AddPeerAddress {
            peer: PeerAddr::new(engine("d-2"), 0),
            addr: p.addr,
        })
        .await
        .unwrap();
    assert!(full.is_err(), "{full:?}");

    // An engine the book does not name (and the policy does not list) is refused, counted.
    let raw = unstarted_info(&fabric, "raw-d");
    let (got, _) = probe(
        p.addr,
        &frame_of(raw.handshake(vec![], 1, TraceId::random())),
        false,
    )
    .await;
    assert!(got.is_empty(), "a refusal writes nothing: {got:?}");
    let s = stats(&p).await;
    assert_eq!(s.rejections(RejectReason::NotAccepted), 1, "{s:?}");
    assert_eq!(s.incoming_ok, 0, "{s:?}");
}

/// Sends `info`'s handshake to `addr` as a raw client; true if a handshake came back (which
/// must repeat the dialler's trace id: the connection's records on both sides carry it).
async fn handshake_once(addr: SocketAddr, info: &PeerInfo, clock: u64) -> bool {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let trace_id = TraceId::random();
    stream
        .write_all(&frame_of(info.handshake(vec![], clock, trace_id)))
        .await
        .unwrap();
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await.unwrap();
    match wire::decode(&answer) {
        Ok(Message::Handshake(answer)) => {
            assert_eq!(
                answer.trace_id, trace_id,
                "the answer adopts the dialler's trace id"
            );
            true
        }
        _ => false,
    }
}

async fn counters(rank: &Rank) -> Counters {
    rank.handle.rank.send(QueryCounters).await.unwrap()
}

#[actix_rt::test]
async fn a_repeated_handshake_changes_nothing_and_a_new_incarnation_is_a_restart() {
    let fabric = MemFabric::new();
    let p = start_quick(&fabric, "prefill");
    let raw = unstarted_info(&fabric, "raw-d");
    // The first handshake connects; copies of it (a late concurrent dial, a replay by anyone
    // who can reach the port) are answered and change nothing: no restart, no death.
    for n in 1..=3u64 {
        assert!(handshake_once(p.addr, &raw, n).await, "handshake {n}");
    }
    let s = stats(&p).await;
    assert_eq!(s.incoming_ok, 3, "{s:?}");
    let c = counters(&p).await;
    assert_eq!(
        (
            c.repeated_handshakes,
            c.peer_restarts,
            c.peers_declared_dead
        ),
        (2, 0, 0),
        "{c:?}"
    );
    // Another incarnation of the same engine is a restart.
    let restarted = PeerInfo {
        incarnation: Incarnation::random(),
        ..raw.clone()
    };
    assert!(handshake_once(p.addr, &restarted, 4).await);
    let c = counters(&p).await;
    assert_eq!(
        (
            c.repeated_handshakes,
            c.peer_restarts,
            c.peers_declared_dead
        ),
        (2, 1, 1),
        "{c:?}"
    );
}
