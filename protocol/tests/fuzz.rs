//! `wire::decode` against hostile input: it never panics, whatever the bytes; what it accepts is
//! a valid message that re-encodes to a frame decoding to the same message; and length fields
//! that claim huge sizes fail fast without allocating what they claim.

mod common;

use std::time::{Duration, Instant};

use common::*;
use kvhandoff_protocol::wire::{self, WireError, HEADER_LEN, MAX_PAYLOAD_LEN};
use kvhandoff_protocol::{FieldError, IdError, Message, MessageKind, PROTOCOL_VERSION};
use proptest::prelude::*;
use proptest::sample::Index;

/// Whatever `decode` says about `bytes`, it says it without panicking (a panic fails the case),
/// and an accepted message is valid and stable under re-encoding.
fn check_decode(bytes: &[u8]) -> Result<(), TestCaseError> {
    if let Ok(message) = wire::decode(bytes) {
        prop_assert_eq!(message.validate(), Ok(()));
        let again = wire::encode(&message);
        prop_assert_eq!(wire::decode(&again), Ok(message));
    }
    Ok(())
}

/// One edit of a frame.
#[derive(Debug, Clone)]
enum Mutation {
    FlipBit(Index, u8),
    SetByte(Index, u8),
    Insert(Index, u8),
    Delete(Index),
    Truncate(Index),
    Append(Vec<u8>),
    /// Rewrites a payload byte and then fixes the header's length (so the payload is reached).
    SetPayloadByteFixed(Index, u8),
    InsertPayloadFixed(Index, Vec<u8>),
    DeletePayloadFixed(Index, Index),
    Version(u16),
    Kind(u8),
    Flags(u8),
    PayloadLen(u32),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    use Mutation::*;
    prop_oneof![
        3 => (any::<Index>(), 0u8..8).prop_map(|(i, b)| FlipBit(i, b)),
        2 => (any::<Index>(), any::<u8>()).prop_map(|(i, v)| SetByte(i, v)),
        1 => (any::<Index>(), any::<u8>()).prop_map(|(i, v)| Insert(i, v)),
        1 => any::<Index>().prop_map(Delete),
        1 => any::<Index>().prop_map(Truncate),
        1 => proptest::collection::vec(any::<u8>(), 1..8).prop_map(Append),
        4 => (any::<Index>(), any::<u8>()).prop_map(|(i, v)| SetPayloadByteFixed(i, v)),
        2 => (any::<Index>(), proptest::collection::vec(any::<u8>(), 1..12))
            .prop_map(|(i, v)| InsertPayloadFixed(i, v)),
        2 => (any::<Index>(), any::<Index>()).prop_map(|(i, n)| DeletePayloadFixed(i, n)),
        1 => prop_oneof![Just(0u16), Just(PROTOCOL_VERSION + 1), any::<u16>()].prop_map(Version),
        2 => prop_oneof![0u8..=9, any::<u8>()].prop_map(Kind),
        1 => any::<u8>().prop_map(Flags),
        1 => prop_oneof![
            Just(u32::MAX),
            Just(MAX_PAYLOAD_LEN as u32 + 1),
            0u32..4096,
        ].prop_map(PayloadLen),
    ]
}

fn apply(frame: &mut Vec<u8>, mutation: &Mutation) {
    use Mutation::*;
    let payload_len = frame.len().saturating_sub(HEADER_LEN);
    let header_ok = frame.len() >= HEADER_LEN;
    match mutation {
        FlipBit(i, bit) if !frame.is_empty() => {
            let i = i.index(frame.len());
            frame[i] ^= 1 << bit;
        }
        SetByte(i, v) if !frame.is_empty() => {
            let i = i.index(frame.len());
            frame[i] = *v;
        }
        Insert(i, v) => {
            let i = i.index(frame.len() + 1);
            frame.insert(i, *v);
        }
        Delete(i) if !frame.is_empty() => {
            let i = i.index(frame.len());
            frame.remove(i);
        }
        Truncate(i) => {
            let len = i.index(frame.len() + 1);
            frame.truncate(len);
        }
        Append(bytes) => frame.extend_from_slice(bytes),
        SetPayloadByteFixed(i, v) if header_ok && payload_len > 0 => {
            let i = HEADER_LEN + i.index(payload_len);
            frame[i] = *v;
            fix_len(frame);
        }
        InsertPayloadFixed(i, bytes) if header_ok => {
            let at = HEADER_LEN + i.index(payload_len + 1);
            frame.splice(at..at, bytes.iter().copied());
            fix_len(frame);
        }
        DeletePayloadFixed(i, n) if header_ok && payload_len > 0 => {
            let at = HEADER_LEN + i.index(payload_len);
            let n = 1 + n.index((frame.len() - at).min(16));
            frame.drain(at..at + n);
            fix_len(frame);
        }
        Version(v) if header_ok => frame[4..6].copy_from_slice(&v.to_le_bytes()),
        Kind(k) if header_ok => frame[6] = *k,
        Flags(f) if header_ok => frame[7] = *f,
        PayloadLen(len) if header_ok => frame[8..12].copy_from_slice(&len.to_le_bytes()),
        _ => {}
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 10_000, ..ProptestConfig::default() })]

    /// Arbitrary bytes: almost all fail on the header, which is the point of having one.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        check_decode(&bytes)?;
    }

    /// A well-formed header of any kind followed by arbitrary payload bytes: this reaches the
    /// payload decoder and the field rules.
    #[test]
    fn arbitrary_payloads_never_panic(
        kind in 1u8..=8,
        payload in proptest::collection::vec(any::<u8>(), 0..256),
    ) {
        check_decode(&frame(kind, &payload))?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 10_000, ..ProptestConfig::default() })]

    /// Valid frames with a few edits anywhere (header fields included) never panic the decoder,
    /// and whatever still decodes re-encodes to the same message.
    #[test]
    fn mutated_frames_never_panic(
        message in message(),
        mutations in proptest::collection::vec(mutation(), 1..=4),
    ) {
        let mut bytes = wire::encode(&message);
        for m in &mutations {
            apply(&mut bytes, m);
        }
        check_decode(&bytes)?;
    }

    /// The payload of one kind under the header of another.
    #[test]
    fn payloads_under_the_wrong_kind_never_panic(message in message(), kind in 1u8..=8) {
        let mut bytes = wire::encode(&message);
        bytes[6] = kind;
        check_decode(&bytes)?;
    }
}

/// `decode` refuses `bytes` with an error matching `expected`, within a few milliseconds (in a
/// debug build), i.e. without touching anywhere near the length it was promised.
fn refuses_fast(bytes: &[u8], expected: impl Fn(&WireError) -> bool) {
    let start = Instant::now();
    let result = wire::decode(bytes);
    let took = start.elapsed();
    let err = result.expect_err("a hostile frame was accepted");
    assert!(expected(&err), "unexpected error: {err:?}");
    assert!(took < Duration::from_millis(500), "took {took:?}");
}

/// The bincode varint encoding of a `u64` that does not fit in 4 bytes: marker 253, then 8
/// little-endian bytes.
fn varint_u64(value: u64) -> Vec<u8> {
    let mut v = vec![253];
    v.extend_from_slice(&value.to_le_bytes());
    v
}

/// The varint encoding of a small length (< 251): the byte itself.
fn varint_small(value: usize) -> u8 {
    assert!(value < 251);
    value as u8
}

#[test]
fn a_header_that_claims_a_huge_payload_is_refused_before_any_payload_is_read() {
    for len in [MAX_PAYLOAD_LEN as u32 + 1, 1 << 31, u32::MAX] {
        let bytes = header(PROTOCOL_VERSION, MessageKind::Handshake as u8, 0, len);
        refuses_fast(&bytes, |e| {
            *e == WireError::PayloadTooLarge { len: len.into() }
        });
    }
    // At the limit itself the header is fine and the missing bytes are reported.
    let bytes = header(PROTOCOL_VERSION, 1, 0, MAX_PAYLOAD_LEN as u32);
    refuses_fast(&bytes, |e| {
        *e == WireError::TruncatedPayload {
            announced: MAX_PAYLOAD_LEN,
            available: 0,
        }
    });
}

/// A handshake whose `agent_metadata` length prefix claims 2^60 bytes.
#[test]
fn a_huge_vec_length_in_a_handshake_is_refused() {
    // Handshake payload order: protocol_version (varint u16), engine_id, agent_name (strings:
    // varint length + UTF-8), agent_metadata (varint length + bytes), ...
    let mut payload = vec![PROTOCOL_VERSION as u8];
    payload.extend([varint_small(1), b'p', varint_small(1), b'a']);
    payload.extend(varint_u64(1 << 60));
    payload.extend([0u8; 32]);
    refuses_fast(&frame(MessageKind::Handshake as u8, &payload), |e| {
        matches!(
            e,
            WireError::MalformedPayload {
                kind: MessageKind::Handshake,
                ..
            }
        )
    });
}

/// Every string and list field of a message, given a length prefix of 2^60 (and of u64::MAX),
/// fails as a malformed payload; strings fail on bincode's decode limit before allocating.
#[test]
fn huge_length_prefixes_in_every_position_are_refused() {
    let huge = [1u64 << 60, u64::MAX, MAX_PAYLOAD_LEN as u64 + 1];
    for claim in huge {
        let prefix = varint_u64(claim);
        let cases: Vec<(MessageKind, Vec<u8>)> = vec![
            // Handshake.engine_id
            (
                MessageKind::Handshake,
                [&[1u8][..], &prefix, b"xyz"].concat(),
            ),
            // Handshake.agent_name
            (
                MessageKind::Handshake,
                [&[1u8, 1, b'e'][..], &prefix].concat(),
            ),
            // Handshake.regions (after an empty agent_metadata)
            (
                MessageKind::Handshake,
                [&[1u8, 1, b'e', 1, b'a', 0][..], &prefix].concat(),
            ),
            // Register.key
            (MessageKind::Register, prefix.clone()),
            // Register.blocks.groups (after key, epoch, engine, request, rank)
            (
                MessageKind::Register,
                [&[1u8, b'k', 1, 1, b'd', 1, b'r', 0][..], &prefix].concat(),
            ),
            // Register.blocks.groups[0]
            (
                MessageKind::Register,
                [&[1u8, b'k', 1, 1, b'd', 1, b'r', 0, 1][..], &prefix].concat(),
            ),
            // Heartbeat.engine
            (MessageKind::Heartbeat, prefix.clone()),
            // Heartbeat.leases
            (MessageKind::Heartbeat, [&[1u8, b'e'][..], &prefix].concat()),
            // WriteDone.key
            (MessageKind::WriteDone, prefix.clone()),
        ];
        for (kind, payload) in cases {
            refuses_fast(
                &frame(kind as u8, &payload),
                |e| matches!(e, WireError::MalformedPayload { kind: k, .. } if *k == kind),
            );
        }
    }
}

/// The string case is stopped by the decode limit itself, not by running out of input.
#[test]
fn a_huge_string_length_hits_the_decode_limit() {
    let payload = [varint_u64(1 << 60), vec![b'x'; 64]].concat();
    let err = wire::decode(&frame(MessageKind::Cancel as u8, &payload)).unwrap_err();
    match err {
        WireError::MalformedPayload { kind, detail } => {
            assert_eq!(kind, MessageKind::Cancel);
            assert!(detail.contains("LimitExceeded"), "{detail}");
        }
        other => panic!("unexpected {other:?}"),
    }
}

/// A `WriteDone` payload whose key is one string of `key_len` bytes.
fn write_done_with_key_of(key_len: usize) -> Vec<u8> {
    let mut payload = vec![252];
    payload.extend_from_slice(&(key_len as u32).to_le_bytes());
    payload.resize(payload.len() + key_len, b'k');
    payload.extend([1, 0, 0]);
    assert!(payload.len() <= MAX_PAYLOAD_LEN);
    frame(MessageKind::WriteDone as u8, &payload)
}

/// A 1 MiB id decodes (within the decode limit) and is then refused by the id rules, quickly.
#[test]
fn a_megabyte_id_is_refused_by_the_field_rules() {
    let bytes = write_done_with_key_of(1 << 20);
    let start = Instant::now();
    let err = wire::decode(&bytes).unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(2));
    assert!(
        matches!(
            err,
            WireError::InvalidField {
                kind: MessageKind::WriteDone,
                source: FieldError::Id(IdError::TooLong { len, .. }),
            } if len == 1 << 20
        ),
        "{err:?}"
    );
}

/// bincode's limit counts decoded sizes (8 bytes for every `u64`, whatever its varint took), so
/// a frame just under `MAX_PAYLOAD_LEN` that is one giant string exceeds it: refused as malformed.
#[test]
fn a_payload_near_the_size_limit_can_exceed_the_decode_limit() {
    let bytes = write_done_with_key_of(MAX_PAYLOAD_LEN - 16);
    let err = wire::decode(&bytes).unwrap_err();
    assert_eq!(
        err,
        WireError::MalformedPayload {
            kind: MessageKind::WriteDone,
            detail: "LimitExceeded".into(),
        }
    );
}

/// Sanity check of the hand-written payloads above: they follow the real layout.
#[test]
fn the_hand_written_layout_matches_the_encoder() {
    use kvhandoff_protocol::{Epoch, PairingKey, WriteDone};
    let m = Message::WriteDone(WriteDone {
        key: PairingKey::new("k").unwrap(),
        epoch: Epoch(1),
        prefill_rank: 0,
        digests: Vec::new(),
    });
    assert_eq!(wire::encode(&m), frame(3, &[1, b'k', 1, 0, 0]));
    assert_eq!(wire::decode(&frame(3, &[1, b'k', 1, 0, 0])), Ok(m));
}

/// The decoder accepts integers in a longer varint form than the encoder writes (bincode does not
/// insist on the shortest form), so equal messages can arrive as different bytes: compare
/// messages, never frames. Re-encoding gives the canonical frame.
#[test]
fn non_minimal_varints_decode_to_the_same_message() {
    use kvhandoff_protocol::{Epoch, PairingKey, WriteDone};
    let canonical = frame(MessageKind::WriteDone as u8, &[1, b'k', 1, 0, 0]);
    let long_epoch = frame(MessageKind::WriteDone as u8, &[1, b'k', 251, 1, 0, 0, 0]);
    let longer_epoch = frame(
        MessageKind::WriteDone as u8,
        &[1, b'k', 253, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    );
    let expected = Message::WriteDone(WriteDone {
        key: PairingKey::new("k").unwrap(),
        epoch: Epoch(1),
        prefill_rank: 0,
        digests: Vec::new(),
    });
    for bytes in [&canonical, &long_epoch, &longer_epoch] {
        assert_eq!(wire::decode(bytes).as_ref(), Ok(&expected));
    }
    assert_eq!(wire::encode(&expected), canonical);
}
