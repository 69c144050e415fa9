//! A hostile peer on the notification path: two good ranks (P and D) on one in-memory fabric,
//! plus a "hostile" agent that both have loaded as a connected peer (as after a handshake) and a
//! "stranger" agent that neither loaded. They send garbage, truncated and oversized frames,
//! frames of unknown kinds and invalid fields, valid messages that break the rules (a `Register`
//! naming another engine, a `Heartbeat` for another engine, answers for keys nobody has, a
//! handshake on the notification path, a `WriteDone` impersonating P for a live request), and
//! notifications from an unknown agent. Every one must be dropped with a typed reason, counted
//! (`Counters::dropped` by [`DropReason`], `TransportStats::unknown_senders`), nothing may panic,
//! and requests between the good ranks complete with every byte verified before, during and
//! after the barrage.
//!
//! Real time (no paused clock) with `Config::default()` (heartbeat 2 s, peer timeout 3 s): the
//! whole test takes milliseconds, far from any protocol deadline.

mod fixture;
use fixture::{call, fill, geometry, model, next_event, wrong_bytes};

/// How long a test waits for a rank's next event.
const EVENT_WITHIN: Duration = Duration::from_secs(5);

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kvhandoff_actors::system::{
    agent_name, build_mem_rank, start_rank, Directory, Handshaker, KvPool, LinkUp, QueryCounters,
    QueryTransportStats, RankHandle, ShellConfig,
};
use kvhandoff_actors::transport::mem::{MemFabric, MemTransport};
use kvhandoff_actors::transport::{Transport, TransportError, MAX_NOTIFICATION_LEN};
use kvhandoff_protocol::driver::{PeerInfo, TransportStats};
use kvhandoff_protocol::machine::{
    Config, Counters, DecodeStart, DropReason, EndpointCall, PrefillStart,
};
use kvhandoff_protocol::session::ConnectorEvent;
use kvhandoff_protocol::wire::{self, WireError, HEADER_LEN, MAGIC, MAX_PAYLOAD_LEN};
use kvhandoff_protocol::PeerAddr;
use kvhandoff_protocol::{
    BlockIds, Cancel, CancelAck, CancelReason, EngineId, Epoch, Heartbeat, Message, MessageKind,
    PairingKey, Register, RequestId, TransferMode, WriteDone, WriteFailed, WriteFailure,
    PROTOCOL_VERSION,
};

fn engine(name: &str) -> EngineId {
    EngineId::new(name).unwrap()
}

struct Rank {
    handle: RankHandle,
    pool: KvPool,
    info: PeerInfo,
}

fn start(fabric: &MemFabric, directory: &Directory, name: &str) -> Rank {
    let (setup, pool) = build_mem_rank(
        fabric,
        &engine(name),
        geometry(),
        &model(),
        32,
        Config::default(),
        ShellConfig::default(),
    )
    .unwrap();
    let info = setup.info.clone();
    Rank {
        handle: start_rank(setup, Handshaker::InProcess(directory.clone()), None).unwrap(),
        pool,
        info,
    }
}

async fn counters(rank: &RankHandle) -> Counters {
    rank.rank
        .send(QueryCounters)
        .await
        .expect("the rank answers")
}

async fn writer_stats(rank: &RankHandle) -> TransportStats {
    rank.transport
        .send(QueryTransportStats)
        .await
        .expect("the transport actor answers")
}

fn request(id: &str) -> RequestId {
    RequestId::new(id).unwrap()
}

fn key_of(id: &str) -> PairingKey {
    PairingKey::from_request_id(&request(id))
}

const D_BLOCKS: [u32; 3] = [3, 4, 5];
const P_BLOCKS: [u32; 3] = [20, 21, 22];

/// D allocates and registers request `base` (D registers first).
async fn register_on_d(d: &Rank, base: &str) {
    let d_id = request(&format!("{base}-dddddddd"));
    call(
        &d.handle,
        EndpointCall::DecodeAllocated(DecodeStart {
            key: PairingKey::from_request_id(&d_id),
            request: d_id,
            epoch: Epoch::FIRST,
            prefill: d_peer_of_p(),
            blocks: BlockIds::single_group(D_BLOCKS.to_vec()),
            num_tokens: 12,
            expected_writes: 1,
        }),
    )
    .await
    .unwrap();
}

/// P fills and finishes request `base`; D must get every byte, P its `Sent`.
async fn finish_on_p(p: &mut Rank, d: &mut Rank, base: &str) {
    let p_id = request(&format!("{base}-eeeeeeee"));
    fill(&p.pool, base, &P_BLOCKS);
    call(
        &p.handle,
        EndpointCall::PrefillFinished(PrefillStart {
            key: PairingKey::from_request_id(&p_id),
            request: p_id,
            blocks: BlockIds::single_group(P_BLOCKS.to_vec()),
        }),
    )
    .await
    .unwrap();
    let event = next_event(&mut d.handle, EVENT_WITHIN).await;
    assert!(
        matches!(&event, ConnectorEvent::BlocksReady { .. }),
        "{base}: {event:?}"
    );
    assert_eq!(
        wrong_bytes(&d.pool, base, &D_BLOCKS),
        0,
        "every byte of {base}"
    );
    let event = next_event(&mut p.handle, EVENT_WITHIN).await;
    assert!(
        matches!(event, ConnectorEvent::BlocksFree { released: None, .. }),
        "{base}: {event:?}"
    );
}

/// One good request between P and D, every byte checked.
async fn hand_off(p: &mut Rank, d: &mut Rank, base: &str) {
    register_on_d(d, base).await;
    finish_on_p(p, d, base).await;
}

/// The P rank as D's requests name it.
fn d_peer_of_p() -> PeerAddr {
    PeerAddr::new(engine("prefill"), 0)
}

/// A frame header with every field given.
fn header(version: u16, kind: u8, flags: u8, len: u32) -> Vec<u8> {
    let mut h = Vec::from(MAGIC);
    h.extend_from_slice(&version.to_le_bytes());
    h.push(kind);
    h.push(flags);
    h.extend_from_slice(&len.to_le_bytes());
    h
}

/// Drop counts minus a baseline.
fn dropped_since(now: &Counters, before: &Counters) -> BTreeMap<DropReason, u64> {
    now.dropped
        .iter()
        .map(|(r, n)| (*r, n - before.dropped(*r)))
        .filter(|(_, n)| *n > 0)
        .collect()
}

/// Polls until `done` holds for the rank's counters and writer stats (2 s at most).
async fn settle(rank: &RankHandle, done: impl Fn(&Counters, &TransportStats) -> bool) {
    let until = Instant::now() + Duration::from_secs(2);
    loop {
        let (c, w) = (counters(rank).await, writer_stats(rank).await);
        if done(&c, &w) {
            return;
        }
        assert!(
            Instant::now() < until,
            "counters did not settle: {c:?} {w:?}"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[actix_rt::test]
async fn hostile_notifications_are_dropped_typed_and_counted_while_requests_carry_on() {
    let fabric = MemFabric::new();
    let directory = Directory::new();
    let mut p = start(&fabric, &directory, "prefill");
    let mut d = start(&fabric, &directory, "decode");
    let p_addr = p.info.peer.clone();
    let d_addr = d.info.peer.clone();

    // A good request before anything hostile happens.
    hand_off(&mut p, &mut d, "cmpl-before-0").await;

    // The hostile agent: loaded by both ranks as a connected peer, as a handshake would.
    let hostile_engine = engine("hostile");
    let mut hostile: MemTransport = fabric
        .agent(agent_name(&hostile_engine, 0).unwrap())
        .unwrap();
    let hostile_info = PeerInfo {
        peer: PeerAddr::new(hostile_engine.clone(), 0),
        agent: hostile.agent_name().clone(),
        metadata: hostile.local_metadata().unwrap(),
        regions: Vec::new(),
        geometry: geometry(),
        compat: p.info.compat,
        incarnation: kvhandoff_protocol::Incarnation::random(),
        routed: false,
    };
    for rank in [&p, &d] {
        let loaded = rank.handle.rank.send(LinkUp(hostile_info.clone())).await;
        assert_eq!(loaded.unwrap(), Ok(()), "the rank loads the hostile peer");
    }
    hostile
        .load_remote(&p_addr, &p.info.agent, &p.info.metadata)
        .unwrap();
    hostile
        .load_remote(&d_addr, &d.info.agent, &d.info.metadata)
        .unwrap();
    // The stranger: it knows P and D, neither knows it.
    let mut stranger: MemTransport = fabric
        .agent(agent_name(&engine("stranger"), 0).unwrap())
        .unwrap();
    stranger
        .load_remote(&p_addr, &p.info.agent, &p.info.metadata)
        .unwrap();
    stranger
        .load_remote(&d_addr, &d.info.agent, &d.info.metadata)
        .unwrap();

    let (p0, pw0) = (counters(&p.handle).await, writer_stats(&p.handle).await);
    let (d0, dw0) = (counters(&d.handle).await, writer_stats(&d.handle).await);

    // 1. Bytes that are not a valid frame, each with the typed error `wire::decode` gives it.
    let register = |engine_name: &str, rank: u32, blocks: Vec<u32>, id: &str| {
        Message::Register(Box::new(Register {
            key: key_of(id),
            epoch: Epoch::FIRST,
            decode_engine: engine(engine_name),
            decode_request: request(id),
            decode_rank: rank,
            blocks: BlockIds::single_group(blocks),
            num_tokens: 8,
            trace_id: kvhandoff_protocol::TraceId::random(),
            memory: Vec::new(),
        }))
    };
    let valid = wire::encode(&register("hostile", 0, vec![1], "cmpl-h1-0-aaaaaaaa"));
    let cancel = wire::encode(&Message::Cancel(Cancel {
        key: key_of("cmpl-h2-0-aaaaaaaa"),
        epoch: Epoch::FIRST,
        reason: CancelReason::Deadline,
    }));
    let mut trailing = valid.clone();
    trailing.extend_from_slice(&[0xab; 3]);
    let mut wrong_payload = header(
        PROTOCOL_VERSION,
        MessageKind::Register as u8,
        0,
        (cancel.len() - HEADER_LEN) as u32,
    );
    wrong_payload.extend_from_slice(&cancel[HEADER_LEN..]);
    let mut garbage_payload = header(PROTOCOL_VERSION, MessageKind::Cancel as u8, 0, 64);
    garbage_payload.extend_from_slice(&[0xff; 64]);
    // The largest notification a transport carries: a header announcing the largest payload,
    // then that many zero bytes.
    let mut largest = header(
        PROTOCOL_VERSION,
        MessageKind::Register as u8,
        0,
        MAX_PAYLOAD_LEN as u32,
    );
    largest.resize(MAX_NOTIFICATION_LEN, 0);
    let bad_block_ids = wire::encode(&register("hostile", 0, vec![7, 7], "cmpl-h3-0-aaaaaaaa"));
    let epoch_zero = wire::encode(&Message::Cancel(Cancel {
        key: key_of("cmpl-h4-0-aaaaaaaa"),
        epoch: Epoch(0),
        reason: CancelReason::Aborted,
    }));
    type Check = fn(&WireError) -> bool;
    let malformed: Vec<(&str, Vec<u8>, Check)> = vec![
        ("garbage", b"GET / HTTP/1.1\r\n\r\n".to_vec(), |e| {
            matches!(e, WireError::BadMagic { .. })
        }),
        ("empty", Vec::new(), |e| {
            matches!(e, WireError::TruncatedHeader { len: 0 })
        }),
        ("half a header", valid[..HEADER_LEN - 1].to_vec(), |e| {
            matches!(e, WireError::TruncatedHeader { .. })
        }),
        (
            "truncated payload",
            valid[..valid.len() - 5].to_vec(),
            |e| matches!(e, WireError::TruncatedPayload { .. }),
        ),
        ("trailing bytes", trailing, |e| {
            matches!(e, WireError::TrailingBytes { extra: 3 })
        }),
        (
            "oversized length (u32::MAX)",
            header(PROTOCOL_VERSION, MessageKind::Register as u8, 0, u32::MAX),
            |e| matches!(e, WireError::PayloadTooLarge { .. }),
        ),
        (
            "oversized length (limit + 1)",
            header(
                PROTOCOL_VERSION,
                MessageKind::WriteDone as u8,
                0,
                MAX_PAYLOAD_LEN as u32 + 1,
            ),
            |e| matches!(e, WireError::PayloadTooLarge { .. }),
        ),
        ("largest notification, zero payload", largest, |e| {
            matches!(
                e,
                WireError::MalformedPayload { .. }
                    | WireError::PayloadNotConsumed { .. }
                    | WireError::InvalidField { .. }
            )
        }),
        (
            "unknown kind 0xee",
            header(PROTOCOL_VERSION, 0xee, 0, 0),
            |e| matches!(e, WireError::UnknownKind { code: 0xee }),
        ),
        ("unknown kind 0", header(PROTOCOL_VERSION, 0, 0, 0), |e| {
            matches!(e, WireError::UnknownKind { code: 0 })
        }),
        (
            "unsupported version",
            header(PROTOCOL_VERSION + 1, MessageKind::Register as u8, 0, 0),
            |e| matches!(e, WireError::UnsupportedVersion { .. }),
        ),
        (
            "reserved flags",
            header(PROTOCOL_VERSION, MessageKind::Register as u8, 0x80, 0),
            |e| matches!(e, WireError::ReservedFlags { flags: 0x80 }),
        ),
        (
            "a cancel's payload under a register header",
            wrong_payload,
            |e| {
                matches!(
                    e,
                    WireError::MalformedPayload { .. } | WireError::PayloadNotConsumed { .. }
                )
            },
        ),
        ("garbage payload", garbage_payload, |e| {
            matches!(
                e,
                WireError::MalformedPayload { .. } | WireError::PayloadNotConsumed { .. }
            )
        }),
        ("duplicate block ids", bad_block_ids, |e| {
            matches!(e, WireError::InvalidField { .. })
        }),
        ("epoch 0", epoch_zero, |e| {
            matches!(e, WireError::InvalidField { .. })
        }),
    ];
    for (what, bytes, check) in &malformed {
        let error = wire::decode(bytes).expect_err(what);
        assert!(check(&error), "{what}: {error:?}");
        hostile.send_notification(&p_addr, bytes.clone()).unwrap();
    }
    // Above the notification limit: refused typed by the sending transport, nothing sent.
    assert!(matches!(
        hostile.send_notification(&p_addr, vec![0; MAX_NOTIFICATION_LEN + 1]),
        Err(TransportError::NotificationTooLarge { .. })
    ));

    // 2. Valid frames that break the rules, from the connected hostile peer.
    let unknown = key_of("cmpl-nobody-0-aaaaaaaa");
    let unexpected = [
        // A registration must come from the rank whose blocks it names.
        register("decode", 0, vec![1], "cmpl-h5-0-aaaaaaaa"),
        register("hostile", 3, vec![1], "cmpl-h6-0-aaaaaaaa"),
        // A heartbeat must name its sender.
        Message::Heartbeat(Heartbeat {
            engine: engine("decode"),
            leases: Vec::new(),
        }),
    ];
    // P→D answers sent to P, about a key nobody has.
    let unknown_key = [
        Message::WriteDone(WriteDone {
            key: unknown.clone(),
            epoch: Epoch::FIRST,
            prefill_rank: 0,
            digests: Vec::new(),
        }),
        Message::WriteFailed(WriteFailed {
            key: unknown.clone(),
            epoch: Epoch::FIRST,
            prefill_rank: 0,
            reason: WriteFailure::TransferFailed,
        }),
        Message::CancelAck(CancelAck {
            key: unknown,
            epoch: Epoch::FIRST,
            prefill_rank: 0,
        }),
    ];
    // A valid handshake (D's own) on the notification path.
    let handshake = Message::Handshake(Box::new(d.info.handshake(
        vec![TransferMode::Push],
        0,
        kvhandoff_protocol::TraceId::random(),
    )));
    for message in unexpected.iter().chain(&unknown_key).chain([&handshake]) {
        hostile
            .send_notification(&p_addr, wire::encode(message))
            .unwrap();
    }

    // 3. Notifications from an agent P never loaded: dropped before decoding.
    stranger
        .send_notification(
            &p_addr,
            wire::encode(&register("stranger", 0, vec![1], "cmpl-s1-0-aaaaaaaa")),
        )
        .unwrap();
    stranger
        .send_notification(&p_addr, b"not even a frame".to_vec())
        .unwrap();

    let want_p: BTreeMap<DropReason, u64> = [
        (DropReason::Malformed, malformed.len() as u64),
        (DropReason::Unexpected, unexpected.len() as u64),
        (DropReason::UnknownKey, unknown_key.len() as u64),
        (DropReason::WrongPath, 1),
    ]
    .into();
    settle(&p.handle, |c, w| {
        dropped_since(c, &p0) == want_p && w.unknown_senders == pw0.unknown_senders + 2
    })
    .await;

    // 4. A good request while the hostile peer impersonates P towards D: its `WriteDone` for
    // the live request (from the wrong engine) is dropped, and the stranger's never reaches
    // D's endpoint; the request completes with P's real bytes.
    let live = "cmpl-during-0";
    register_on_d(&d, live).await;
    let done = wire::encode(&Message::WriteDone(WriteDone {
        key: key_of(&format!("{live}-dddddddd")),
        epoch: Epoch::FIRST,
        prefill_rank: 0,
        digests: Vec::new(),
    }));
    hostile.send_notification(&d_addr, done.clone()).unwrap();
    stranger.send_notification(&d_addr, done).unwrap();
    settle(&d.handle, |c, w| {
        c.dropped(DropReason::Unexpected) == d0.dropped(DropReason::Unexpected) + 1
            && w.unknown_senders == dw0.unknown_senders + 1
    })
    .await;
    assert!(d.handle.events.try_recv().is_err(), "no event on D yet");
    finish_on_p(&mut p, &mut d, live).await;

    // 5. And another request after the barrage.
    hand_off(&mut p, &mut d, "cmpl-after-0").await;

    // Exactly the drops expected, nothing else moved, and both ranks still answer.
    let (p1, pw1) = (counters(&p.handle).await, writer_stats(&p.handle).await);
    assert_eq!(dropped_since(&p1, &p0), want_p, "P's drops");
    assert_eq!(pw1.unknown_senders, pw0.unknown_senders + 2);
    assert_eq!(p1.peers_declared_dead, 0);
    let (d1, dw1) = (counters(&d.handle).await, writer_stats(&d.handle).await);
    assert_eq!(
        dropped_since(&d1, &d0),
        BTreeMap::from([(DropReason::Unexpected, 1)]),
        "D's drops"
    );
    assert_eq!(dw1.unknown_senders, dw0.unknown_senders + 1);
    assert_eq!(d1.peers_declared_dead, 0);
    println!(
        "P dropped {:?}, unknown senders {}; D dropped {:?}, unknown senders {}",
        dropped_since(&p1, &p0),
        pw1.unknown_senders,
        dropped_since(&d1, &d0),
        dw1.unknown_senders
    );
}
