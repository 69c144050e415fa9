//! One test per `WireError` variant, and per kind of `FieldError`, each proving that the matching
//! input produces exactly that error (the header checks run in order: length, magic, version,
//! kind, flags, payload length; then the payload's length, decoding and field rules).

mod common;

use common::*;
use kvhandoff_protocol::wire::{self, WireError, HEADER_LEN, MAGIC, MAX_PAYLOAD_LEN};
use kvhandoff_protocol::{
    AgentName, BlockIds, CacheGroup, CacheGroupKind, Cancel, CancelAck, CancelReason, CompatHash,
    EngineId, Epoch, FieldError, GeometryError, Handshake, Heartbeat, IdError, KvGeometry,
    KvLayout, LeaseRef, Message, MessageKind, PairingKey, RegionDesc, Register, Release,
    ReleaseReason, RequestId, TransferMode, WriteDone, WriteFailed, WriteFailure,
    MAX_AGENT_METADATA, MAX_BLOCKS_PER_GROUP, MAX_CACHE_GROUPS, MAX_HEARTBEAT_LEASES, MAX_ID_LEN,
    MAX_REGIONS, MAX_TRANSFER_MODES, PROTOCOL_VERSION,
};

fn key() -> PairingKey {
    PairingKey::new("cmpl-1-0").unwrap()
}

fn write_done() -> Message {
    Message::WriteDone(WriteDone {
        key: key(),
        epoch: Epoch(3),
        prefill_rank: 1,
        digests: Vec::new(),
    })
}

fn valid_frame() -> Vec<u8> {
    wire::encode(&write_done())
}

/// The error `decode` gives for `message` once encoded (`encode` does not validate, so a
/// message that breaks the field rules can be sent, as a buggy or hostile peer would).
fn field_error(message: &Message) -> FieldError {
    match wire::decode(&wire::encode(message)) {
        Err(WireError::InvalidField { kind, source }) => {
            assert_eq!(kind, message.kind());
            assert_eq!(message.validate(), Err(source.clone()), "validate agrees");
            source
        }
        other => panic!("expected InvalidField, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Header errors

#[test]
fn truncated_header() {
    let frame = valid_frame();
    for len in 0..HEADER_LEN {
        assert_eq!(
            wire::decode(&frame[..len]),
            Err(WireError::TruncatedHeader { len })
        );
        assert_eq!(
            wire::decode_header(&frame[..len]),
            Err(WireError::TruncatedHeader { len })
        );
    }
    // A header alone is enough for decode_header.
    assert!(wire::decode_header(&frame[..HEADER_LEN]).is_ok());
}

#[test]
fn bad_magic() {
    let mut frame = valid_frame();
    frame[..4].copy_from_slice(b"KVH0");
    assert_eq!(
        wire::decode(&frame),
        Err(WireError::BadMagic { found: *b"KVH0" })
    );
    // Every single-bit error in the magic is caught.
    for bit in 0..32 {
        let mut frame = valid_frame();
        frame[bit / 8] ^= 1 << (bit % 8);
        assert!(matches!(
            wire::decode(&frame),
            Err(WireError::BadMagic { .. })
        ));
    }
    assert_eq!(MAGIC, *b"KVHO");
}

#[test]
fn unsupported_version() {
    for version in [0, PROTOCOL_VERSION + 1, u16::MAX] {
        let mut frame = valid_frame();
        frame[4..6].copy_from_slice(&version.to_le_bytes());
        assert_eq!(
            wire::decode(&frame),
            Err(WireError::UnsupportedVersion { found: version })
        );
    }
}

#[test]
fn unknown_kind() {
    for code in [0u8, 13, 0x80, 0xff] {
        let mut frame = valid_frame();
        frame[6] = code;
        assert_eq!(wire::decode(&frame), Err(WireError::UnknownKind { code }));
    }
    for kind in MessageKind::ALL {
        assert_eq!(MessageKind::from_code(kind as u8), Some(kind));
    }
}

#[test]
fn reserved_flags() {
    for flags in [1u8, 0x80, 0xff] {
        let mut frame = valid_frame();
        frame[7] = flags;
        assert_eq!(
            wire::decode(&frame),
            Err(WireError::ReservedFlags { flags })
        );
    }
}

#[test]
fn payload_too_large() {
    for len in [MAX_PAYLOAD_LEN as u32 + 1, u32::MAX] {
        let mut frame = valid_frame();
        frame[8..12].copy_from_slice(&len.to_le_bytes());
        let expected = WireError::PayloadTooLarge { len: len.into() };
        assert_eq!(wire::decode(&frame), Err(expected.clone()));
        assert_eq!(wire::decode_header(&frame), Err(expected));
    }
}

// ---------------------------------------------------------------------------------------------
// Payload-length errors

#[test]
fn truncated_payload() {
    let frame = valid_frame();
    let announced = frame.len() - HEADER_LEN;
    for available in 0..announced {
        assert_eq!(
            wire::decode(&frame[..HEADER_LEN + available]),
            Err(WireError::TruncatedPayload {
                announced,
                available
            })
        );
    }
}

#[test]
fn trailing_bytes() {
    let mut frame = valid_frame();
    frame.extend_from_slice(&[0, 0, 0]);
    assert_eq!(
        wire::decode(&frame),
        Err(WireError::TrailingBytes { extra: 3 })
    );
    // Two frames back to back are not one frame.
    let two = [valid_frame(), valid_frame()].concat();
    assert_eq!(
        wire::decode(&two),
        Err(WireError::TrailingBytes {
            extra: valid_frame().len()
        })
    );
}

// ---------------------------------------------------------------------------------------------
// Payload errors

#[test]
fn malformed_payload() {
    // The payload ends inside a field, with the header's length matching it.
    let mut frame = valid_frame();
    frame.pop();
    fix_len(&mut frame);
    assert!(matches!(
        wire::decode(&frame),
        Err(WireError::MalformedPayload {
            kind: MessageKind::WriteDone,
            ..
        })
    ));
    // An enum variant index that does not exist: WriteFailed.reason = one past the last.
    let failed = Message::WriteFailed(WriteFailed {
        key: key(),
        epoch: Epoch(1),
        prefill_rank: 0,
        reason: WriteFailure::PostFailed,
    });
    let mut frame = wire::encode(&failed);
    let last = frame.len() - 1;
    assert_eq!(frame[last], 0);
    frame[last] = WRITE_FAILURES.len() as u8;
    assert!(matches!(
        wire::decode(&frame),
        Err(WireError::MalformedPayload {
            kind: MessageKind::WriteFailed,
            ..
        })
    ));
    // The last one that does exist decodes.
    frame[last] = WRITE_FAILURES.len() as u8 - 1;
    assert!(wire::decode(&frame).is_ok());
    // An id that is not UTF-8.
    let frame = common::frame(MessageKind::Cancel as u8, &[2, 0xc3, 0x28, 1, 0]);
    assert!(matches!(
        wire::decode(&frame),
        Err(WireError::MalformedPayload {
            kind: MessageKind::Cancel,
            ..
        })
    ));
    // An empty payload.
    let frame = common::frame(MessageKind::Release as u8, &[]);
    assert!(matches!(
        wire::decode(&frame),
        Err(WireError::MalformedPayload {
            kind: MessageKind::Release,
            ..
        })
    ));
}

#[test]
fn payload_not_consumed() {
    let mut frame = valid_frame();
    frame.extend_from_slice(&[0, 0]);
    fix_len(&mut frame);
    assert_eq!(
        wire::decode(&frame),
        Err(WireError::PayloadNotConsumed {
            kind: MessageKind::WriteDone,
            extra: 2
        })
    );
}

// ---------------------------------------------------------------------------------------------
// Field errors (WireError::InvalidField), one per kind of FieldError

#[test]
fn invalid_field_empty_id() {
    let m = Message::Cancel(Cancel {
        key: unchecked_id(""),
        epoch: Epoch(1),
        reason: CancelReason::Deadline,
    });
    assert_eq!(
        field_error(&m),
        FieldError::Id(IdError::Empty {
            kind: "pairing key"
        })
    );
}

#[test]
fn invalid_field_too_long_id() {
    let long = "e".repeat(MAX_ID_LEN + 1);
    let m = Message::Heartbeat(Heartbeat {
        engine: unchecked_id(&long),
        leases: vec![],
    });
    assert_eq!(
        field_error(&m),
        FieldError::Id(IdError::TooLong {
            kind: "engine id",
            len: MAX_ID_LEN + 1
        })
    );
}

#[test]
fn invalid_field_control_character() {
    for (id, at) in [("a\nb", 1), ("\0", 0), ("é\u{7f}", 2), ("x\u{85}", 1)] {
        let m = Message::Register(Box::new(Register {
            key: key(),
            epoch: Epoch(1),
            decode_engine: EngineId::new("decode-0").unwrap(),
            decode_request: unchecked_id(id),
            decode_rank: 0,
            blocks: BlockIds::single_group(vec![1]),
            num_tokens: 16,
            trace_id: kvhandoff_protocol::TraceId::from_u128(0x7ace),
            memory: Vec::new(),
        }));
        assert_eq!(
            field_error(&m),
            FieldError::Id(IdError::ControlCharacter {
                kind: "request id",
                at
            }),
            "{id:?}"
        );
    }
}

fn register_with(blocks: BlockIds) -> Message {
    Message::Register(Box::new(Register {
        key: key(),
        epoch: Epoch(1),
        decode_engine: EngineId::new("decode-0").unwrap(),
        decode_request: RequestId::new("cmpl-1-0-aaaaaaaa").unwrap(),
        decode_rank: 0,
        blocks,
        num_tokens: 1,
        trace_id: kvhandoff_protocol::TraceId::from_u128(0x7ace),
        memory: Vec::new(),
    }))
}

#[test]
fn invalid_field_too_many_blocks() {
    let ids = (0..=MAX_BLOCKS_PER_GROUP as u32).collect();
    assert_eq!(
        field_error(&register_with(BlockIds::single_group(ids))),
        FieldError::TooMany {
            field: "block ids",
            len: MAX_BLOCKS_PER_GROUP + 1,
            limit: MAX_BLOCKS_PER_GROUP
        }
    );
    // Too many groups.
    let groups = vec![vec![]; MAX_CACHE_GROUPS + 1];
    assert_eq!(
        field_error(&register_with(BlockIds { groups })),
        FieldError::TooMany {
            field: "block id groups",
            len: MAX_CACHE_GROUPS + 1,
            limit: MAX_CACHE_GROUPS
        }
    );
    // At the limits: fine.
    let ids = (0..MAX_BLOCKS_PER_GROUP as u32).collect();
    assert_eq!(
        register_with(BlockIds::single_group(ids)).validate(),
        Ok(())
    );
}

#[test]
fn invalid_field_too_many_other_lists() {
    let h = |f: &dyn Fn(&mut Handshake)| {
        let mut h = small_handshake();
        f(&mut h);
        field_error(&Message::Handshake(Box::new(h)))
    };
    assert_eq!(
        h(&|h| h.agent_metadata = vec![0; MAX_AGENT_METADATA + 1]),
        FieldError::TooMany {
            field: "agent metadata",
            len: MAX_AGENT_METADATA + 1,
            limit: MAX_AGENT_METADATA
        }
    );
    assert_eq!(
        h(&|h| h.modes = vec![TransferMode::Push; MAX_TRANSFER_MODES + 1]),
        FieldError::TooMany {
            field: "transfer modes",
            len: MAX_TRANSFER_MODES + 1,
            limit: MAX_TRANSFER_MODES
        }
    );
    assert_eq!(
        h(&|h| h.regions = vec![h.regions[0]; MAX_REGIONS + 1]),
        FieldError::TooMany {
            field: "regions",
            len: MAX_REGIONS + 1,
            limit: MAX_REGIONS
        }
    );
    let lease = LeaseRef {
        key: key(),
        epoch: Epoch(1),
    };
    let m = Message::Heartbeat(Heartbeat {
        engine: EngineId::new("decode-0").unwrap(),
        leases: vec![lease; MAX_HEARTBEAT_LEASES + 1],
    });
    assert_eq!(
        field_error(&m),
        FieldError::TooMany {
            field: "heartbeat leases",
            len: MAX_HEARTBEAT_LEASES + 1,
            limit: MAX_HEARTBEAT_LEASES
        }
    );
}

#[test]
fn invalid_field_duplicate_block() {
    let blocks = BlockIds {
        groups: vec![vec![1, 2, 3], vec![4, 9, 5, 9]],
    };
    assert_eq!(
        field_error(&register_with(blocks)),
        FieldError::DuplicateBlock { block: 9 }
    );
    // The same id in two different groups is fine: each group has its own block table.
    let blocks = BlockIds {
        groups: vec![vec![1, 2], vec![1, 2]],
    };
    assert_eq!(register_with(blocks).validate(), Ok(()));
}

#[test]
fn invalid_field_zero_epoch() {
    let zero = Epoch(0);
    let messages = [
        register_with(BlockIds::default()),
        write_done(),
        Message::WriteFailed(WriteFailed {
            key: key(),
            epoch: zero,
            prefill_rank: 0,
            reason: WriteFailure::PostFailed,
        }),
        Message::Cancel(Cancel {
            key: key(),
            epoch: zero,
            reason: CancelReason::Aborted,
        }),
        Message::CancelAck(CancelAck {
            key: key(),
            epoch: zero,
            prefill_rank: 0,
        }),
        Message::Release(Release {
            key: key(),
            epoch: zero,
            reason: ReleaseReason::Aborted,
        }),
        Message::Heartbeat(Heartbeat {
            engine: EngineId::new("d").unwrap(),
            leases: vec![
                LeaseRef {
                    key: key(),
                    epoch: Epoch(1),
                },
                LeaseRef {
                    key: key(),
                    epoch: zero,
                },
            ],
        }),
    ];
    for mut m in messages {
        match &mut m {
            Message::Register(r) => r.epoch = zero,
            Message::WriteDone(w) => w.epoch = zero,
            _ => {}
        }
        assert_eq!(field_error(&m), FieldError::ZeroEpoch, "{m:?}");
    }
}

fn small_geometry() -> KvGeometry {
    KvGeometry {
        num_layers: 2,
        total_kv_heads: 2,
        head_dim: 4,
        dtype_bytes: 2,
        kernel_block_size: 4,
        kernel_blocks_per_logical: 1,
        layout: KvLayout::Hnd,
        tp_size: 1,
        tp_rank: 0,
        pp_size: 1,
        pp_rank: 0,
        mla: false,
        cache_groups: vec![CacheGroup {
            kind: CacheGroupKind::FullAttention,
            num_layers: 2,
        }],
    }
}

fn small_handshake() -> Handshake {
    let geometry = small_geometry();
    let regions = geometry
        .regions()
        .unwrap()
        .iter()
        .enumerate()
        .map(|(i, s)| RegionDesc {
            base: 0x1000 * (i as u64 + 1),
            len: 8 * s.block_len,
            num_blocks: 8,
            block_len: s.block_len,
        })
        .collect();
    Handshake {
        protocol_version: PROTOCOL_VERSION,
        engine_id: EngineId::new("prefill-0").unwrap(),
        incarnation: kvhandoff_protocol::Incarnation(7),
        agent_name: AgentName::new("prefill-0-tp0").unwrap(),
        agent_metadata: vec![1, 2, 3],
        regions,
        geometry,
        compat_hash: CompatHash([7; 32]),
        modes: vec![TransferMode::Push],
        clock_sample_us: 1,
        trace_id: kvhandoff_protocol::TraceId::from_u128(0x7ace),
        routed: false,
    }
}

#[test]
fn the_small_handshake_is_valid() {
    let m = Message::Handshake(Box::new(small_handshake()));
    assert_eq!(wire::decode(&wire::encode(&m)), Ok(m));
}

#[test]
fn invalid_field_bad_geometry() {
    let mut h = small_handshake();
    h.geometry.tp_rank = 1;
    assert_eq!(
        field_error(&Message::Handshake(Box::new(h))),
        FieldError::Geometry(GeometryError::RankOutOfRange {
            field: "tp",
            rank: 1,
            size: 1
        })
    );
    let mut h = small_handshake();
    h.geometry.head_dim = 0;
    assert_eq!(
        field_error(&Message::Handshake(Box::new(h))),
        FieldError::Geometry(GeometryError::Zero { field: "head_dim" })
    );
}

#[test]
fn invalid_field_handshake_protocol_version() {
    let mut h = small_handshake();
    h.protocol_version = PROTOCOL_VERSION + 1;
    assert_eq!(
        field_error(&Message::Handshake(Box::new(h))),
        FieldError::ProtocolVersion {
            found: PROTOCOL_VERSION + 1,
            expected: PROTOCOL_VERSION
        }
    );
}

#[test]
fn invalid_field_region_count_mismatch() {
    let mut h = small_handshake();
    h.regions.pop();
    assert_eq!(
        field_error(&Message::Handshake(Box::new(h))),
        FieldError::RegionCount {
            regions: 3,
            expected: 4
        }
    );
    let mut h = small_handshake();
    h.regions.push(h.regions[0]);
    assert_eq!(
        field_error(&Message::Handshake(Box::new(h))),
        FieldError::RegionCount {
            regions: 5,
            expected: 4
        }
    );
}

#[test]
fn invalid_field_bad_region() {
    type Break = fn(&mut RegionDesc);
    let cases: [(Break, &str); 4] = [
        (|r| r.block_len = 0, "block_len is zero"),
        (
            |r| {
                r.num_blocks = u32::MAX;
                r.block_len = u64::MAX;
            },
            "num_blocks * block_len overflows",
        ),
        (|r| r.len -= 1, "num_blocks * block_len exceeds len"),
        (|r| r.base = u64::MAX - r.len + 1, "base + len overflows"),
    ];
    for (break_it, why) in cases {
        let mut h = small_handshake();
        break_it(&mut h.regions[2]);
        assert_eq!(
            field_error(&Message::Handshake(Box::new(h))),
            FieldError::Geometry(GeometryError::BadRegion { why }),
            "{why}"
        );
    }
    // At the edge of the address space is fine.
    let mut h = small_handshake();
    h.regions[2].base = u64::MAX - h.regions[2].len;
    assert_eq!(Message::Handshake(Box::new(h)).validate(), Ok(()));
}

/// A handshake's ids are checked too: engine id and agent name.
#[test]
fn invalid_field_handshake_ids() {
    let mut h = small_handshake();
    h.agent_name = unchecked_id("agent\ttab");
    assert_eq!(
        field_error(&Message::Handshake(Box::new(h))),
        FieldError::Id(IdError::ControlCharacter {
            kind: "agent name",
            at: 5
        })
    );
    let mut h = small_handshake();
    h.engine_id = unchecked_id("");
    assert_eq!(
        field_error(&Message::Handshake(Box::new(h))),
        FieldError::Id(IdError::Empty { kind: "engine id" })
    );
}

/// Heartbeat lease keys are checked like every other key.
#[test]
fn invalid_field_heartbeat_lease_key() {
    let m = Message::Heartbeat(Heartbeat {
        engine: EngineId::new("d").unwrap(),
        leases: vec![LeaseRef {
            key: unchecked_id("k\r"),
            epoch: Epoch(1),
        }],
    });
    assert_eq!(
        field_error(&m),
        FieldError::Id(IdError::ControlCharacter {
            kind: "pairing key",
            at: 1
        })
    );
}

/// The header is checked before the payload, in a fixed order: a frame with several faults
/// reports the first.
#[test]
fn header_checks_run_in_order() {
    let mut frame = valid_frame();
    frame[4..6].copy_from_slice(&9u16.to_le_bytes()); // bad version
    frame[6] = 0; // unknown kind
    frame[7] = 1; // flags
    frame[8..12].copy_from_slice(&u32::MAX.to_le_bytes()); // too large
    assert_eq!(
        wire::decode(&frame),
        Err(WireError::UnsupportedVersion { found: 9 })
    );
    frame[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    assert_eq!(
        wire::decode(&frame),
        Err(WireError::UnknownKind { code: 0 })
    );
    frame[6] = 3;
    assert_eq!(
        wire::decode(&frame),
        Err(WireError::ReservedFlags { flags: 1 })
    );
    frame[7] = 0;
    assert_eq!(
        wire::decode(&frame),
        Err(WireError::PayloadTooLarge {
            len: u32::MAX.into()
        })
    );
}

/// Every error has a human-readable message naming what is wrong.
#[test]
fn errors_display() {
    let e = WireError::InvalidField {
        kind: MessageKind::Register,
        source: FieldError::DuplicateBlock { block: 9 },
    };
    assert_eq!(
        e.to_string(),
        "Register has an invalid field: block 9 is listed twice in one group"
    );
    assert_eq!(
        WireError::TruncatedHeader { len: 3 }.to_string(),
        "frame of 3 bytes is shorter than the 12-byte header"
    );
}
