//! The per-field limits of `Message::validate` and the frame limit of the codec agree: the
//! largest valid message of every kind encodes within `MAX_PAYLOAD_LEN` and decodes again (the
//! decoder's size limit counts decoded sizes, not encoded bytes, so it needs checking too), and
//! one entry more than a limit is refused.

use kvhandoff_protocol::wire::{self, WireError, MAX_PAYLOAD_LEN};
use kvhandoff_protocol::{
    AgentName, BlockIds, CacheGroup, CacheGroupKind, CompatHash, EngineId, Epoch, FieldError,
    Handshake, Heartbeat, KvGeometry, KvLayout, LeaseRef, Message, MessageKind, PairingKey,
    RegionDesc, Register, TransferMode, MAX_AGENT_METADATA, MAX_BLOCKS_PER_GROUP,
    MAX_BLOCKS_PER_REQUEST, MAX_CACHE_GROUPS, MAX_HEARTBEAT_LEASES, MAX_ID_LEN, MAX_LAYERS,
    MAX_TRANSFER_MODES, PROTOCOL_VERSION,
};

/// An id of exactly `MAX_ID_LEN` bytes, distinct per `n`.
fn long_id(n: usize) -> String {
    let mut s = format!("{n:08}-");
    s.push_str(&"é".repeat((MAX_ID_LEN - s.len()) / 2));
    while s.len() < MAX_ID_LEN {
        s.push('x');
    }
    assert_eq!(s.len(), MAX_ID_LEN);
    s
}

/// Encodes (which panics past `MAX_PAYLOAD_LEN`), checks the size, and decodes.
fn fits_and_round_trips(message: &Message) -> usize {
    assert_eq!(message.validate(), Ok(()));
    let bytes = wire::encode(message);
    assert!(bytes.len() - wire::HEADER_LEN <= MAX_PAYLOAD_LEN);
    assert_eq!(wire::decode(&bytes).as_ref(), Ok(message));
    bytes.len()
}

fn register(groups: Vec<Vec<u32>>) -> Message {
    Message::Register(Box::new(Register {
        key: PairingKey::new(long_id(1)).unwrap(),
        epoch: Epoch(u64::MAX),
        decode_engine: EngineId::new(long_id(2)).unwrap(),
        decode_request: kvhandoff_protocol::RequestId::new(long_id(3)).unwrap(),
        decode_rank: u32::MAX,
        blocks: BlockIds { groups },
        num_tokens: u64::MAX,
        trace_id: kvhandoff_protocol::TraceId::from_u128(u128::MAX),
        memory: Vec::new(),
    }))
}

/// `n` distinct ids that each take the longest (5-byte) varint.
fn big_ids(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| u32::MAX - i).collect()
}

#[test]
fn the_largest_register_fits() {
    let full_groups = MAX_BLOCKS_PER_REQUEST / MAX_BLOCKS_PER_GROUP;
    let len = fits_and_round_trips(&register(vec![big_ids(MAX_BLOCKS_PER_GROUP); full_groups]));
    let spread = MAX_BLOCKS_PER_REQUEST / MAX_CACHE_GROUPS;
    fits_and_round_trips(&register(vec![big_ids(spread); MAX_CACHE_GROUPS]));
    println!("largest register frame: {len} bytes");
}

#[test]
fn a_register_over_the_total_block_limit_is_refused() {
    // Every group within its own limit, the total one over.
    let mut groups = vec![big_ids(MAX_BLOCKS_PER_REQUEST / MAX_CACHE_GROUPS); MAX_CACHE_GROUPS];
    groups[0].push(0);
    let message = register(groups);
    assert_eq!(
        message.validate(),
        Err(FieldError::TooMany {
            field: "block ids in all groups",
            len: MAX_BLOCKS_PER_REQUEST + 1,
            limit: MAX_BLOCKS_PER_REQUEST,
        })
    );
    assert!(matches!(
        wire::decode(&wire::encode(&message)),
        Err(WireError::InvalidField {
            kind: MessageKind::Register,
            source: FieldError::TooMany { .. }
        })
    ));
}

#[test]
fn the_largest_handshake_fits() {
    // Most regions a valid geometry defines: every layer on one rank, K and V each.
    let groups = MAX_CACHE_GROUPS as u32;
    let geometry = KvGeometry {
        num_layers: MAX_LAYERS,
        total_kv_heads: 1,
        head_dim: 1 << 10,
        dtype_bytes: 1 << 4,
        kernel_block_size: 1 << 20,
        kernel_blocks_per_logical: u32::MAX,
        layout: KvLayout::Nhd,
        tp_size: 1,
        tp_rank: 0,
        pp_size: 1,
        pp_rank: 0,
        mla: false,
        cache_groups: (0..groups)
            .map(|g| CacheGroup {
                kind: if g == 0 {
                    CacheGroupKind::FullAttention
                } else {
                    CacheGroupKind::SlidingWindow {
                        window_tokens: u32::MAX - g,
                    }
                },
                num_layers: MAX_LAYERS / groups,
            })
            .collect(),
    };
    let specs = geometry.regions().unwrap();
    assert_eq!(specs.len(), 2 * MAX_LAYERS as usize);
    let regions = specs
        .iter()
        .map(|s| RegionDesc {
            base: 1 << 62,
            len: 1 << 62,
            num_blocks: 1 << 28,
            block_len: s.block_len,
        })
        .collect();
    let message = Message::Handshake(Box::new(Handshake {
        protocol_version: PROTOCOL_VERSION,
        engine_id: EngineId::new(long_id(1)).unwrap(),
        incarnation: kvhandoff_protocol::Incarnation(u128::MAX),
        agent_name: AgentName::new(long_id(2)).unwrap(),
        agent_metadata: vec![0xff; MAX_AGENT_METADATA],
        regions,
        geometry,
        compat_hash: CompatHash([0xff; 32]),
        modes: vec![TransferMode::Bidirectional; MAX_TRANSFER_MODES],
        clock_sample_us: u64::MAX,
        trace_id: kvhandoff_protocol::TraceId::from_u128(u128::MAX),
        routed: false,
    }));
    let len = fits_and_round_trips(&message);
    println!("largest handshake frame: {len} bytes");
}

#[test]
fn the_largest_heartbeat_fits() {
    let message = Message::Heartbeat(Heartbeat {
        engine: EngineId::new(long_id(0)).unwrap(),
        leases: (0..MAX_HEARTBEAT_LEASES)
            .map(|i| LeaseRef {
                key: PairingKey::new(long_id(i)).unwrap(),
                epoch: Epoch(u64::MAX),
            })
            .collect(),
    });
    let len = fits_and_round_trips(&message);
    println!("largest heartbeat frame: {len} bytes");
}
