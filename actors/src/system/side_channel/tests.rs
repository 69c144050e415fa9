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
