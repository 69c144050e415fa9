//! Unit tests of the messages: kind codes, leases, block-id and field rules, and their display.

use super::*;
use crate::ids::IdError;
use crate::trace::TraceIdError;

fn key() -> PairingKey {
    PairingKey::new("cmpl-1-0").unwrap()
}

fn one_of_each() -> Vec<Message> {
    use crate::geometry::{CacheGroup, CacheGroupKind, KvLayout};
    let geometry = KvGeometry {
        num_layers: 1,
        total_kv_heads: 1,
        head_dim: 8,
        dtype_bytes: 2,
        kernel_block_size: 4,
        kernel_blocks_per_logical: 1,
        layout: KvLayout::Nhd,
        tp_size: 1,
        tp_rank: 0,
        pp_size: 1,
        pp_rank: 0,
        mla: true,
        cache_groups: vec![CacheGroup {
            kind: CacheGroupKind::FullAttention,
            num_layers: 1,
        }],
    };
    vec![
        Message::Handshake(Box::new(Handshake {
            protocol_version: crate::PROTOCOL_VERSION,
            engine_id: EngineId::new("p").unwrap(),
            incarnation: crate::Incarnation(1),
            agent_name: AgentName::new("p-0").unwrap(),
            agent_metadata: vec![],
            regions: vec![RegionDesc {
                base: 0,
                len: 64,
                num_blocks: 1,
                block_len: 64,
            }],
            geometry,
            compat_hash: CompatHash([0; 32]),
            modes: vec![],
            clock_sample_us: 0,
            trace_id: crate::TraceId::from_u128(0x7ace),
            routed: false,
        })),
        Message::Register(Box::new(Register {
            key: key(),
            epoch: Epoch(1),
            decode_engine: EngineId::new("d").unwrap(),
            decode_request: RequestId::new("r").unwrap(),
            decode_rank: 0,
            blocks: BlockIds::default(),
            num_tokens: 0,
            trace_id: crate::TraceId::from_u128(0x7ace),
            memory: Vec::new(),
        })),
        Message::WriteDone(WriteDone {
            key: key(),
            epoch: Epoch(2),
            prefill_rank: 0,
            digests: Vec::new(),
        }),
        Message::WriteFailed(WriteFailed {
            key: key(),
            epoch: Epoch(3),
            prefill_rank: 0,
            reason: WriteFailure::PostFailed,
        }),
        Message::Cancel(Cancel {
            key: key(),
            epoch: Epoch(4),
            reason: CancelReason::Shutdown,
        }),
        Message::CancelAck(CancelAck {
            key: key(),
            epoch: Epoch(5),
            prefill_rank: 0,
        }),
        Message::Heartbeat(Heartbeat {
            engine: EngineId::new("d").unwrap(),
            leases: vec![],
        }),
        Message::Release(Release {
            key: key(),
            epoch: Epoch(6),
            reason: ReleaseReason::ReadDone,
        }),
        Message::ReadAsk(ReadAsk {
            key: key(),
            epoch: Epoch(7),
            reader_request: RequestId::new("r").unwrap(),
            reader_rank: 0,
            ask: 2,
            trace_id: crate::TraceId::from_u128(0x7ace),
        }),
        Message::ReadGrant(Box::new(ReadGrant {
            key: key(),
            epoch: Epoch(7),
            holder_rank: 0,
            blocks: BlockIds::default(),
            num_tokens: 0,
            ask: 2,
            memory: Vec::new(),
        })),
        Message::ReadRefused(ReadRefused {
            key: key(),
            epoch: Epoch(8),
            holder_rank: 0,
            reason: ReadRefusal::Unavailable,
        }),
        Message::WritePartDone(WritePartDone {
            key: key(),
            epoch: Epoch(9),
            prefill_rank: 0,
            first: 0,
            count: 1,
            of: 1,
            digests: Vec::new(),
        }),
    ]
}

#[test]
fn a_write_part_names_layers_within_its_write() {
    let part = |first, count, of| {
        Message::WritePartDone(WritePartDone {
            key: key(),
            epoch: Epoch(1),
            prefill_rank: 0,
            first,
            count,
            of,
            digests: Vec::new(),
        })
        .validate()
    };
    assert_eq!(part(2, 2, 4), Ok(()));
    for (first, count, of) in [(0, 0, 4), (3, 2, 4), (u32::MAX, 2, 4), (0, 1, 5_000)] {
        assert_eq!(
            part(first, count, of),
            Err(FieldError::BadPart { first, count, of }),
            "{first}+{count}/{of}"
        );
    }
}

#[test]
fn kind_codes_are_fixed() {
    let codes: Vec<u8> = MessageKind::ALL.iter().map(|k| *k as u8).collect();
    assert_eq!(codes, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]);
    for code in 0..=u8::MAX {
        let kind = MessageKind::from_code(code);
        assert_eq!(kind.is_some(), (1..=12).contains(&code), "{code}");
        if let Some(kind) = kind {
            assert_eq!(kind as u8, code);
        }
    }
}

#[test]
fn each_message_has_its_kind_and_the_minimal_one_is_valid() {
    let messages = one_of_each();
    let kinds: Vec<MessageKind> = messages.iter().map(Message::kind).collect();
    assert_eq!(kinds, MessageKind::ALL);
    for m in &messages {
        assert_eq!(m.validate(), Ok(()), "{m:?}");
    }
}

#[test]
fn lease_names_key_and_epoch_where_there_is_one() {
    let leases: Vec<Option<u64>> = one_of_each()
        .iter()
        .map(|m| {
            m.lease().map(|(k, e)| {
                assert_eq!(k, &key());
                e.0
            })
        })
        .collect();
    assert_eq!(
        leases,
        [
            None,
            Some(1),
            Some(2),
            Some(3),
            Some(4),
            Some(5),
            None,
            Some(6),
            Some(7),
            Some(7),
            Some(8),
            Some(9)
        ]
    );
}

#[test]
fn block_ids_count_over_groups() {
    let empty = BlockIds::default();
    assert!(empty.is_empty());
    assert_eq!(empty.total(), 0);
    let hollow = BlockIds {
        groups: vec![vec![], vec![]],
    };
    assert!(hollow.is_empty());
    let ids = BlockIds {
        groups: vec![vec![1, 2], vec![], vec![7]],
    };
    assert!(!ids.is_empty());
    assert_eq!(ids.total(), 3);
    assert_eq!(
        BlockIds::single_group(vec![4]).groups,
        vec![vec![4]],
        "one group"
    );
}

#[test]
fn block_id_rules() {
    let ok = BlockIds {
        groups: vec![vec![3, 1, 2], vec![1]],
    };
    assert_eq!(ok.validate(), Ok(()));
    assert_eq!(
        BlockIds::single_group(vec![5, 6, 5]).validate(),
        Err(FieldError::DuplicateBlock { block: 5 })
    );
    assert_eq!(
        BlockIds {
            groups: vec![vec![]; MAX_CACHE_GROUPS + 1]
        }
        .validate(),
        Err(FieldError::TooMany {
            field: "block id groups",
            len: MAX_CACHE_GROUPS + 1,
            limit: MAX_CACHE_GROUPS
        })
    );
    let full = || (0..MAX_BLOCKS_PER_GROUP as u32).collect::<Vec<_>>();
    let at_limit = BlockIds {
        groups: vec![full(); MAX_BLOCKS_PER_REQUEST / MAX_BLOCKS_PER_GROUP],
    };
    assert_eq!(at_limit.validate(), Ok(()));
    let mut over = at_limit;
    over.groups.push(vec![0]);
    assert_eq!(
        over.validate(),
        Err(FieldError::TooMany {
            field: "block ids in all groups",
            len: MAX_BLOCKS_PER_REQUEST + 1,
            limit: MAX_BLOCKS_PER_REQUEST
        })
    );
}

#[test]
fn the_first_broken_rule_is_reported() {
    // A register with a zero epoch and a duplicate block: the epoch is checked first.
    let m = Message::Register(Box::new(Register {
        key: key(),
        epoch: Epoch(0),
        decode_engine: EngineId::new("d").unwrap(),
        decode_request: RequestId::new("r").unwrap(),
        decode_rank: 0,
        blocks: BlockIds::single_group(vec![1, 1]),
        num_tokens: 0,
        trace_id: crate::TraceId::from_u128(0x7ace),
        memory: Vec::new(),
    }));
    assert_eq!(m.validate(), Err(FieldError::ZeroEpoch));
}

#[test]
fn handshake_geometry_errors_come_before_region_errors() {
    let mut messages = one_of_each();
    let Message::Handshake(h) = &mut messages[0] else {
        unreachable!()
    };
    h.geometry.head_dim = 0;
    h.regions.clear();
    assert_eq!(
        messages[0].validate(),
        Err(FieldError::Geometry(crate::GeometryError::Zero {
            field: "head_dim"
        }))
    );
}

#[test]
fn compat_hash_debug_shows_a_prefix() {
    let mut bytes = [0u8; 32];
    bytes[0] = 0xab;
    bytes[7] = 0x01;
    bytes[8] = 0xff;
    assert_eq!(
        format!("{:?}", CompatHash(bytes)),
        "CompatHash(ab00000000000001..)"
    );
}

#[test]
fn field_errors_display() {
    assert_eq!(
        FieldError::RegionCount {
            regions: 3,
            expected: 4
        }
        .to_string(),
        "region table has 3 entries but the geometry defines 4"
    );
    assert_eq!(
        FieldError::from(IdError::Empty { kind: "engine id" }).to_string(),
        "engine id is empty"
    );
}

/// The messages that carry a trace id: the handshake (the connection's), the registration and
/// the ask (the attempt's), each with it as its last field.
fn traced() -> Vec<Message> {
    one_of_each()
        .into_iter()
        .filter(|m| {
            matches!(
                m.kind(),
                MessageKind::Handshake | MessageKind::Register | MessageKind::ReadAsk
            )
        })
        .collect()
}

fn trace_of(message: &Message) -> TraceId {
    match message {
        Message::Handshake(h) => h.trace_id,
        Message::Register(r) => r.trace_id,
        Message::ReadAsk(a) => a.trace_id,
        _ => unreachable!("only the traced kinds"),
    }
}

#[test]
fn trace_ids_round_trip_through_the_codec() {
    for message in traced() {
        for value in [1, 0x7ace, u128::MAX, 1 << 127] {
            let mut message = message.clone();
            match &mut message {
                Message::Handshake(h) => h.trace_id = TraceId::from_u128(value),
                Message::Register(r) => r.trace_id = TraceId::from_u128(value),
                Message::ReadAsk(a) => a.trace_id = TraceId::from_u128(value),
                _ => unreachable!(),
            }
            let frame = crate::wire::encode(&message);
            // A fixed 16 bytes at the payload's end, most significant first (as printed).
            assert_eq!(frame[frame.len() - 16..], value.to_be_bytes());
            let decoded = crate::wire::decode(&frame).unwrap();
            assert_eq!(trace_of(&decoded), TraceId::from_u128(value));
            assert_eq!(decoded, message);
        }
    }
}

#[test]
fn a_zero_trace_id_is_refused_by_the_codec() {
    for message in traced() {
        let mut frame = crate::wire::encode(&message);
        let len = frame.len();
        frame[len - 16..].fill(0);
        assert_eq!(
            crate::wire::decode(&frame),
            Err(crate::WireError::InvalidField {
                kind: message.kind(),
                source: FieldError::TraceId(TraceIdError::Zero),
            }),
            "{:?}",
            message.kind()
        );
    }
}

#[test]
fn a_truncated_trace_id_is_malformed() {
    for message in traced() {
        let mut frame = crate::wire::encode(&message);
        frame.truncate(frame.len() - 1);
        let payload_len = u32::try_from(frame.len() - crate::wire::HEADER_LEN).unwrap();
        frame[8..12].copy_from_slice(&payload_len.to_le_bytes());
        assert!(
            matches!(
                crate::wire::decode(&frame),
                Err(crate::WireError::MalformedPayload { .. })
            ),
            "{:?}",
            message.kind()
        );
    }
}

/// A completion carries at most `MAX_WRITE_DIGESTS` digests (a peer controls the count); at the
/// bound, with digests of the largest varint size, it still fits in one frame.
#[test]
fn write_digests_are_bounded_and_fit_a_frame() {
    use crate::integrity::MAX_WRITE_DIGESTS;
    let done = |n: usize| {
        Message::WriteDone(WriteDone {
            key: key(),
            epoch: Epoch(1),
            prefill_rank: 0,
            digests: vec![u64::MAX; n],
        })
    };
    assert_eq!(done(MAX_WRITE_DIGESTS).validate(), Ok(()));
    assert!(crate::wire::encode(&done(MAX_WRITE_DIGESTS)).len() <= crate::wire::MAX_PAYLOAD_LEN);
    assert_eq!(
        done(MAX_WRITE_DIGESTS + 1).validate(),
        Err(FieldError::TooMany {
            field: "write digests",
            len: MAX_WRITE_DIGESTS + 1,
            limit: MAX_WRITE_DIGESTS,
        })
    );
    let part = Message::WritePartDone(WritePartDone {
        key: key(),
        epoch: Epoch(1),
        prefill_rank: 0,
        first: 0,
        count: 1,
        of: 1,
        digests: vec![0; MAX_WRITE_DIGESTS + 1],
    });
    assert!(matches!(part.validate(), Err(FieldError::TooMany { .. })));
}

/// A routed rank's table lists 1 to `MAX_ROUTED_BUFFERS` buffers of any count (not the
/// geometry's); an unrouted one's must be the geometry's.
#[test]
fn a_routed_handshake_lists_its_buffers() {
    let Message::Handshake(base) = one_of_each().swap_remove(0) else {
        unreachable!("the first message is the handshake")
    };
    let buffer = base.regions[0];
    let with = |routed: bool, count: usize| {
        let mut h = base.clone();
        h.routed = routed;
        h.regions = vec![buffer; count];
        Message::Handshake(h).validate()
    };
    assert!(with(false, 1).is_ok(), "the geometry's one region");
    assert!(matches!(
        with(false, 3),
        Err(FieldError::RegionCount { regions: 3, .. })
    ));
    assert!(with(true, 3).is_ok());
    assert!(with(true, MAX_ROUTED_BUFFERS).is_ok());
    assert!(matches!(
        with(true, 0),
        Err(FieldError::RegionCount { regions: 0, .. })
    ));
    assert!(matches!(
        with(true, MAX_ROUTED_BUFFERS + 1),
        Err(FieldError::TooMany { .. })
    ));
}

/// A registration names at most `MAX_REGISTER_SPANS` non-empty spans inside the address space.
#[test]
fn a_registration_names_bounded_non_empty_spans() {
    let Message::Register(base) = one_of_each().swap_remove(1) else {
        unreachable!("the second message is the registration")
    };
    let with = |memory: Vec<MemorySpan>| {
        let mut r = base.clone();
        r.memory = memory;
        Message::Register(r).validate()
    };
    let span = MemorySpan { addr: 64, len: 64 };
    assert!(with(vec![span; MAX_REGISTER_SPANS]).is_ok());
    assert!(matches!(
        with(vec![span; MAX_REGISTER_SPANS + 1]),
        Err(FieldError::TooMany { .. })
    ));
    assert_eq!(
        with(vec![MemorySpan { addr: 64, len: 0 }]),
        Err(FieldError::EmptySpan)
    );
    assert_eq!(
        with(vec![MemorySpan {
            addr: u64::MAX - 8,
            len: 64
        }]),
        Err(FieldError::EmptySpan)
    );
    assert!(!span.contains(u64::MAX, 2), "no overflow in the check");
}
