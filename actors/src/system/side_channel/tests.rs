//! Unit tests of the side channel: clock estimates, the bounded peer book, frame reading.

use actix::clock::Instant;
use kvhandoff_protocol::{MessageKind, WireError, PROTOCOL_VERSION};

use super::handshake::read_handshake;
use super::*;

#[test]
fn round_trip_offsets_follow_vllm() {
    let e = ClockEstimate::round_trip(1_000_500, 100, 300);
    assert_eq!(
        e,
        ClockEstimate {
            offset_us: 1_000_300,
            rtt_us: Some(200)
        }
    );
    let back = ClockEstimate::round_trip(0, 1_000, 1_000);
    assert_eq!(back.offset_us, -1_000);
    assert_eq!(ClockEstimate::one_way(50, 80).offset_us, -30);
    assert_eq!(clamp_i64(i128::MAX), i64::MAX);
    assert_eq!(clamp_i64(i128::MIN), i64::MIN);
}

#[test]
fn lower_rtt_wins_unless_the_clock_moved() {
    let kept = ClockEstimate {
        offset_us: 1_000,
        rtt_us: Some(100),
    };
    let better = ClockEstimate {
        offset_us: 1_010,
        rtt_us: Some(50),
    };
    let worse = ClockEstimate {
        offset_us: 1_010,
        rtt_us: Some(150),
    };
    let restarted = ClockEstimate {
        offset_us: -5_000,
        rtt_us: Some(150),
    };
    let one_way = ClockEstimate {
        offset_us: 0,
        rtt_us: None,
    };
    assert!(better.replaces(&kept));
    assert!(!worse.replaces(&kept));
    assert!(restarted.replaces(&kept));
    assert!(!one_way.replaces(&kept));
    assert!(kept.replaces(&one_way));
    assert!(one_way.replaces(&one_way));
}

#[test]
fn the_book_is_bounded() {
    let e = |s: &str| EngineId::new(s).unwrap();
    let at = |s: &str, rank| PeerAddr::new(e(s), rank);
    let a: SocketAddr = "127.0.0.1:1".parse().unwrap();
    let b: SocketAddr = "127.0.0.1:2".parse().unwrap();
    let mut book = PeerBook::new(1);
    assert!(book.is_empty());
    assert_eq!(book.insert(at("p", 0), a), Ok(None));
    assert_eq!(book.insert(at("p", 0), b), Ok(Some(a)));
    assert_eq!(book.insert(at("q", 0), a), Err(PeerBookFull { limit: 1 }));
    // Another rank of a known engine is another entry: the bound counts ranks.
    assert_eq!(book.insert(at("p", 1), a), Err(PeerBookFull { limit: 1 }));
    assert_eq!(book.get(&at("p", 0)), Some(b));
    assert_eq!(book.len(), 1);
    assert_eq!(book.remove(&at("p", 0)), Some(b));
    assert_eq!(book.get(&at("p", 0)), None);
}

/// Each rank of an engine listens on its own port (a D rank fed by P ranks 0 and 1 dials
/// both): the second rank's address neither replaces the first nor stands in for a third.
#[test]
fn two_ranks_of_one_engine_keep_two_addresses() {
    let prefill = EngineId::new("prefill").unwrap();
    let at = |rank| PeerAddr::new(prefill.clone(), rank);
    let r0: SocketAddr = "127.0.0.1:5600".parse().unwrap();
    let r1: SocketAddr = "127.0.0.1:5601".parse().unwrap();
    let mut book = PeerBook::new(2);
    assert_eq!(book.insert(at(0), r0), Ok(None));
    assert_eq!(book.insert(at(1), r1), Ok(None), "a new entry, not a move");
    assert_eq!(book.get(&at(0)), Some(r0));
    assert_eq!(book.get(&at(1)), Some(r1));
    assert_eq!(book.get(&at(2)), None, "an unknown rank has no address");
    assert_eq!(book.len(), 2);
    assert_eq!(
        book.insert(at(2), r1),
        Err(PeerBookFull { limit: 2 }),
        "still bounded"
    );
}

#[tokio::test]
async fn frames_are_read_with_limits() {
    let far = Instant::now() + Duration::from_secs(5);
    let mut empty: &[u8] = &[];
    assert_eq!(
        read_handshake(&mut empty, far).await,
        Err(HandshakeError::Closed)
    );
    let mut garbage: &[u8] = b"KVX";
    assert!(matches!(
        read_handshake(&mut garbage, far).await,
        Err(HandshakeError::Wire(WireError::BadMagic { .. }))
    ));
    let mut short: &[u8] = b"KVHO\x01";
    assert_eq!(
        read_handshake(&mut short, far).await,
        Err(HandshakeError::Truncated {
            got: 5,
            wanted: HEADER_LEN
        })
    );
    let mut huge = Vec::from(MAGIC);
    huge.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    huge.extend_from_slice(&[MessageKind::Handshake as u8, 0]);
    huge.extend_from_slice(&u32::MAX.to_le_bytes());
    let err = read_handshake(&mut huge.as_slice(), far).await.unwrap_err();
    assert_eq!(err.reason(), RejectReason::PayloadTooLarge);
    let mut truncated = huge.clone();
    truncated[8..12].copy_from_slice(&100u32.to_le_bytes());
    truncated.extend_from_slice(&[0; 10]);
    assert_eq!(
        read_handshake(&mut truncated.as_slice(), far).await,
        Err(HandshakeError::Truncated {
            got: HEADER_LEN + 10,
            wanted: HEADER_LEN + 100
        })
    );
    let mut wrong = truncated.clone();
    wrong[6] = MessageKind::Register as u8;
    assert_eq!(
        read_handshake(&mut wrong.as_slice(), far).await,
        Err(HandshakeError::WrongKind(MessageKind::Register))
    );
}

/// `RejectReason::ALL` (each reason's series from the first scrape) is kept by hand: every
/// variant in it, once, with labels of their own.
#[test]
fn all_holds_every_reject_reason_once() {
    use std::collections::BTreeSet;
    use strum::IntoEnumIterator;
    let every: BTreeSet<RejectReason> = RejectReason::iter().collect();
    let listed: BTreeSet<RejectReason> = RejectReason::ALL.into_iter().collect();
    assert_eq!(listed, every);
    assert_eq!(listed.len(), RejectReason::ALL.len(), "listed twice");
    let labels: BTreeSet<&str> = RejectReason::ALL.iter().map(|r| r.label()).collect();
    assert_eq!(labels.len(), RejectReason::ALL.len(), "labels must differ");
}

/// A route that accepts peers of TP 2 only.
struct TpTwo;

impl kvhandoff_protocol::driver::TransferRoute for TpTwo {
    fn accepts(
        &self,
        _own: &kvhandoff_protocol::KvGeometry,
        peer: &kvhandoff_protocol::KvGeometry,
    ) -> Result<(), kvhandoff_protocol::driver::RouteError> {
        if peer.tp_size == 2 {
            Ok(())
        } else {
            Err(kvhandoff_protocol::driver::RouteError(format!(
                "TP {} is not planned",
                peer.tp_size
            )))
        }
    }

    fn descriptors(
        &self,
        _: &kvhandoff_protocol::driver::RouteRequest<'_>,
        _: &mut Vec<kvhandoff_protocol::planner::Descriptor>,
    ) -> Result<(), kvhandoff_protocol::driver::RouteError> {
        Err(kvhandoff_protocol::driver::RouteError("not here".into()))
    }
}

/// A rank's handshake and the peer's, `routed` or not, at TP `own_tp` and `peer_tp`.
fn pair_of_infos(
    own_tp: u32,
    peer_tp: u32,
    peer_routed: bool,
) -> (
    kvhandoff_protocol::driver::PeerInfo,
    kvhandoff_protocol::Handshake,
) {
    use kvhandoff_protocol::driver::PeerInfo;
    use kvhandoff_protocol::{
        AgentName, CompatHash, EngineId, Incarnation, KvGeometry, KvLayout, PeerAddr, RegionDesc,
        TraceId,
    };
    let geometry = |tp: u32| {
        let mut g = KvGeometry::dense(2, 8, 64, 2, 16, KvLayout::Hnd);
        g.tp_size = tp;
        g
    };
    let regions = |g: &KvGeometry| {
        g.regions()
            .unwrap()
            .iter()
            .enumerate()
            .map(|(i, s)| RegionDesc {
                base: 0x10_0000 * (i as u64 + 1),
                len: 4 * s.block_len,
                num_blocks: 4,
                block_len: s.block_len,
            })
            .collect::<Vec<_>>()
    };
    let own_geometry = geometry(own_tp);
    let own = PeerInfo {
        peer: PeerAddr::new(EngineId::new("prefill").unwrap(), 0),
        agent: AgentName::new("prefill-rank0").unwrap(),
        metadata: Vec::new(),
        regions: regions(&own_geometry),
        routed: false,
        geometry: own_geometry,
        compat: CompatHash([3; 32]),
        incarnation: Incarnation(1),
    };
    let peer_geometry = geometry(peer_tp);
    let peer = PeerInfo {
        peer: PeerAddr::new(EngineId::new("decode").unwrap(), 0),
        agent: AgentName::new("decode-rank0").unwrap(),
        metadata: Vec::new(),
        regions: if peer_routed {
            vec![RegionDesc {
                base: 0x4000,
                len: 1 << 20,
                num_blocks: 1,
                block_len: 1 << 20,
            }]
        } else {
            regions(&peer_geometry)
        },
        routed: peer_routed,
        geometry: peer_geometry,
        compat: CompatHash([3; 32]),
        incarnation: Incarnation(2),
    };
    let handshake = peer.handshake(Vec::new(), 0, TraceId::from_u128(7));
    (own, handshake)
}

/// Over the side channel, a peer of another layout or a routed peer pairs only when this
/// rank's route accepts its geometry; refusals name the field or carry the route's reason.
#[test]
fn a_routed_or_different_peer_needs_the_routes_consent() {
    use super::handshake::validate_handshake;
    let route: kvhandoff_protocol::driver::SharedRoute = std::sync::Arc::new(TpTwo);
    let check =
        |own_tp, peer_tp, routed, route: Option<&kvhandoff_protocol::driver::SharedRoute>| {
            let (own, handshake) = pair_of_infos(own_tp, peer_tp, routed);
            validate_handshake(&own, &[], &handshake, None, route)
        };
    // The same layout, neither routed: no route needed.
    assert_eq!(check(1, 1, false, None), Ok(()));
    // Another TP without a route: refused, naming the field.
    assert_eq!(
        check(1, 2, false, None),
        Err(HandshakeError::Incompatible("tp_size"))
    );
    // A routed peer without a route: refused, even at the same TP.
    assert_eq!(
        check(2, 2, true, None),
        Err(HandshakeError::Incompatible("routed"))
    );
    // With a route: what it accepts pairs; what it refuses is refused with its reason.
    assert_eq!(check(1, 2, true, Some(&route)), Ok(()));
    assert_eq!(check(1, 2, false, Some(&route)), Ok(()));
    let refused = check(1, 4, true, Some(&route)).unwrap_err();
    assert!(
        matches!(&refused, HandshakeError::RouteRefused(why) if why.contains("TP 4")),
        "{refused}"
    );
    assert_eq!(refused.reason(), RejectReason::Incompatible);
}
