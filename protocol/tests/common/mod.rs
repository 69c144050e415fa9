//! Shared test helpers: proptest strategies that build only *valid* messages (every id, list
//! bound, epoch and geometry rule of `Message::validate` holds), hex helpers, and a way to build
//! ids that break the id rules (as a hostile peer would send them).
//!
//! Each test binary includes this module with `mod common;` and uses a different part of it.
#![allow(dead_code)]

use kvhandoff_protocol::wire::{HEADER_LEN, MAGIC};
use kvhandoff_protocol::{
    AgentName, BlockIds, CacheGroup, CacheGroupKind, Cancel, CancelAck, CancelReason, CompatHash,
    EngineId, Epoch, Handshake, Heartbeat, KvGeometry, KvLayout, LeaseRef, Message, PairingKey,
    ReadAsk, ReadGrant, ReadRefusal, ReadRefused, RegionDesc, Register, Release, ReleaseReason,
    RequestId, TransferMode, WriteDone, WriteFailed, WriteFailure, MAX_CACHE_GROUPS, MAX_ID_LEN,
    PROTOCOL_VERSION,
};
use proptest::collection::{btree_set, vec};
use proptest::prelude::*;
use serde::de::DeserializeOwned;

// ---------------------------------------------------------------------------------------------
// Ids

/// A string that passes the id rules: ASCII, any Unicode without control characters, or exactly
/// [`MAX_ID_LEN`] bytes.
pub fn id_string() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => "[a-zA-Z0-9._:/-]{1,64}",
        2 => "[^\\p{Cc}]{1,32}",
        1 => "[a-z]{256}",
        1 => "[a-z0-9-]{1,16}-[0-9a-f]{8}",
    ]
    .prop_filter("ids are at most MAX_ID_LEN bytes", |s| {
        s.len() <= MAX_ID_LEN
    })
}

pub fn engine_id() -> impl Strategy<Value = EngineId> {
    id_string().prop_map(|s| EngineId::new(s).unwrap())
}

pub fn request_id() -> impl Strategy<Value = RequestId> {
    id_string().prop_map(|s| RequestId::new(s).unwrap())
}

pub fn pairing_key() -> impl Strategy<Value = PairingKey> {
    prop_oneof![
        id_string().prop_map(|s| PairingKey::new(s).unwrap()),
        request_id().prop_map(|r| PairingKey::from_request_id(&r)),
    ]
}

pub fn agent_name() -> impl Strategy<Value = AgentName> {
    id_string().prop_map(|s| AgentName::new(s).unwrap())
}

/// Any valid epoch (never 0), with small and extreme values likely.
pub fn epoch() -> impl Strategy<Value = Epoch> {
    prop_oneof![
        Just(Epoch::FIRST),
        (1u64..1000).prop_map(Epoch),
        (1u64..=u64::MAX).prop_map(Epoch),
        Just(Epoch(u64::MAX)),
    ]
}

/// An id of type `T` built *without* its rules, the way a peer's bytes can produce one.
pub fn unchecked_id<T: DeserializeOwned>(value: &str) -> T {
    let cfg = bincode::config::standard();
    let bytes = bincode::serde::encode_to_vec(value, cfg).unwrap();
    bincode::serde::decode_from_slice(&bytes, cfg).unwrap().0
}

// ---------------------------------------------------------------------------------------------
// Geometry

pub fn cache_group_kind() -> impl Strategy<Value = CacheGroupKind> {
    prop_oneof![
        3 => Just(CacheGroupKind::FullAttention),
        2 => (1u32..=u32::MAX).prop_map(|window_tokens| CacheGroupKind::SlidingWindow { window_tokens }),
        1 => (0u64..1 << 24, 0u64..1 << 24)
            .prop_filter("mamba state is not empty", |(c, s)| c + s > 0)
            .prop_map(|(conv_state_bytes, ssm_state_bytes)| CacheGroupKind::Mamba {
                conv_state_bytes,
                ssm_state_bytes,
            }),
    ]
}

/// `(total_kv_heads, tp_size, mla)`: heads split evenly over TP, or replicated across it, or MLA.
fn heads_and_tp() -> impl Strategy<Value = (u32, u32, bool)> {
    prop_oneof![
        // Split: tp divides heads.
        (1u32..=64, 0usize..8).prop_map(|(heads, pick)| {
            let divisors: Vec<u32> = (1..=heads).filter(|d| heads % d == 0).collect();
            (heads, divisors[pick % divisors.len()], false)
        }),
        // Replicated: heads divide tp.
        (1u32..=8, 1u32..=8).prop_map(|(heads, factor)| (heads, heads * factor, false)),
        // MLA: one latent, any tp.
        (1u32..=16).prop_map(|tp| (1, tp, true)),
    ]
}

/// A geometry that passes [`KvGeometry::validate`]: hybrid groups, MLA, PP and replicated heads
/// included.
pub fn geometry() -> impl Strategy<Value = KvGeometry> {
    (
        heads_and_tp(),
        1u32..=4,
        vec((cache_group_kind(), 1u32..=6), 1..=4),
        prop_oneof![Just(64u32), Just(128), Just(256), 1u32..=576],
        1u32..=4,
        prop_oneof![Just(16u32), Just(32), 1u32..=256],
        1u32..=4,
        prop_oneof![Just(KvLayout::Nhd), Just(KvLayout::Hnd)],
        any::<prop::sample::Index>(),
        any::<prop::sample::Index>(),
    )
        .prop_map(
            |(
                (total_kv_heads, tp_size, mla),
                pp_size,
                groups,
                head_dim,
                dtype_bytes,
                kernel_block_size,
                kernel_blocks_per_logical,
                layout,
                tp_pick,
                pp_pick,
            )| {
                let local_layers: u32 = groups.iter().map(|(_, n)| n).sum();
                KvGeometry {
                    num_layers: local_layers * pp_size,
                    total_kv_heads,
                    head_dim,
                    dtype_bytes,
                    kernel_block_size,
                    kernel_blocks_per_logical,
                    layout,
                    tp_size,
                    tp_rank: tp_pick.index(tp_size as usize) as u32,
                    pp_size,
                    pp_rank: pp_pick.index(pp_size as usize) as u32,
                    mla,
                    cache_groups: groups
                        .into_iter()
                        .map(|(kind, num_layers)| CacheGroup { kind, num_layers })
                        .collect(),
                }
            },
        )
}

/// A self-consistent region whose stride is `block_len`.
pub fn region(block_len: u64) -> impl Strategy<Value = RegionDesc> {
    (0u32..4096, 0u64..4096, any::<u64>()).prop_map(move |(num_blocks, slack, base)| {
        let len = u64::from(num_blocks) * block_len + slack;
        RegionDesc {
            base: base.min(u64::MAX - len),
            len,
            num_blocks,
            block_len,
        }
    })
}

/// A geometry and a region table of exactly the length (and block lengths) it defines.
pub fn geometry_and_regions() -> impl Strategy<Value = (KvGeometry, Vec<RegionDesc>)> {
    geometry().prop_flat_map(|g| {
        let specs = g.regions().expect("a valid geometry has regions");
        let regions: Vec<_> = specs.iter().map(|s| region(s.block_len)).collect();
        (Just(g), regions)
    })
}

// ---------------------------------------------------------------------------------------------
// Messages, one strategy per variant

pub fn transfer_mode() -> impl Strategy<Value = TransferMode> {
    proptest::sample::select(&TRANSFER_MODES[..])
}

pub fn handshake() -> impl Strategy<Value = Handshake> {
    (
        engine_id(),
        agent_name(),
        vec(any::<u8>(), 0..512),
        geometry_and_regions(),
        any::<[u8; 32]>(),
        vec(transfer_mode(), 0..=8),
        any::<u64>(),
        any::<u128>(),
        trace_id(),
    )
        .prop_map(
            |(
                engine_id,
                agent_name,
                agent_metadata,
                (geometry, regions),
                hash,
                modes,
                clock,
                incarnation,
                trace_id,
            )| {
                Handshake {
                    protocol_version: PROTOCOL_VERSION,
                    engine_id,
                    incarnation: kvhandoff_protocol::Incarnation(incarnation),
                    agent_name,
                    agent_metadata,
                    regions,
                    geometry,
                    compat_hash: CompatHash(hash),
                    modes,
                    clock_sample_us: clock,
                    trace_id,
                    routed: false,
                }
            },
        )
}

/// One cache group's ids: distinct, in any order.
fn block_list() -> impl Strategy<Value = Vec<u32>> {
    prop_oneof![btree_set(0u32..4096, 0..64), btree_set(any::<u32>(), 0..64),]
        .prop_flat_map(|set| Just(set.into_iter().collect::<Vec<_>>()).prop_shuffle())
}

pub fn block_ids() -> impl Strategy<Value = BlockIds> {
    vec(block_list(), 0..=MAX_CACHE_GROUPS).prop_map(|groups| BlockIds { groups })
}

/// Any valid trace id: 128 bits, not all zeros.
pub fn trace_id() -> impl Strategy<Value = kvhandoff_protocol::TraceId> {
    (1..=u128::MAX).prop_map(kvhandoff_protocol::TraceId::from_u128)
}

pub fn register() -> impl Strategy<Value = Register> {
    (
        pairing_key(),
        epoch(),
        engine_id(),
        request_id(),
        any::<u32>(),
        block_ids(),
        any::<u64>(),
        trace_id(),
        vec(memory_span(), 0..=kvhandoff_protocol::MAX_REGISTER_SPANS),
    )
        .prop_map(
            |(
                key,
                epoch,
                decode_engine,
                decode_request,
                decode_rank,
                blocks,
                num_tokens,
                trace_id,
                memory,
            )| {
                Register {
                    key,
                    epoch,
                    decode_engine,
                    decode_request,
                    decode_rank,
                    blocks,
                    num_tokens,
                    trace_id,
                    memory,
                }
            },
        )
}

/// A non-empty span that does not pass the end of the address space.
pub fn memory_span() -> impl Strategy<Value = kvhandoff_protocol::MemorySpan> {
    (any::<u64>(), 1..=u64::MAX).prop_map(|(addr, len)| kvhandoff_protocol::MemorySpan {
        addr: addr.min(u64::MAX - len),
        len,
    })
}

pub fn write_done() -> impl Strategy<Value = WriteDone> {
    (pairing_key(), epoch(), any::<u32>()).prop_map(|(key, epoch, prefill_rank)| WriteDone {
        key,
        epoch,
        prefill_rank,
        digests: Vec::new(),
    })
}

/// Every write failure. The match below stops compiling when a variant is added, so that this
/// list (and the strategies built on it) cannot silently fall behind the enum.
pub const WRITE_FAILURES: [WriteFailure; 9] = [
    WriteFailure::PostFailed,
    WriteFailure::TransferFailed,
    WriteFailure::TransferTimedOut,
    WriteFailure::PrefillAborted,
    WriteFailure::LeaseExpired,
    WriteFailure::PlanMismatch,
    WriteFailure::Unavailable,
    WriteFailure::RegistrationExpired,
    WriteFailure::DigestMismatch,
];

/// Every cancel reason (see [`WRITE_FAILURES`]).
pub const CANCEL_REASONS: [CancelReason; 3] = [
    CancelReason::Deadline,
    CancelReason::Aborted,
    CancelReason::Shutdown,
];

/// Every release reason (see [`WRITE_FAILURES`]).
pub const RELEASE_REASONS: [ReleaseReason; 5] = [
    ReleaseReason::FullPrefixHit,
    ReleaseReason::Aborted,
    ReleaseReason::ReadDone,
    ReleaseReason::ReadFailed,
    ReleaseReason::Declined,
];

/// Every read refusal (see [`WRITE_FAILURES`]).
pub const READ_REFUSALS: [ReadRefusal; 6] = [
    ReadRefusal::Unavailable,
    ReadRefusal::Expired,
    ReadRefusal::NearExpiry,
    ReadRefusal::StaleEpoch,
    ReadRefusal::Busy,
    ReadRefusal::Aborted,
];

/// Every transfer mode (see [`WRITE_FAILURES`]).
pub const TRANSFER_MODES: [TransferMode; 4] = [
    TransferMode::Push,
    TransferMode::Pull,
    TransferMode::LayerwisePush,
    TransferMode::Bidirectional,
];

/// Compile-time exhaustiveness of the lists above: the index of each variant in its list.
pub fn variant_index(value: VariantOf) -> usize {
    match value {
        VariantOf::WriteFailure(w) => match w {
            WriteFailure::PostFailed => 0,
            WriteFailure::TransferFailed => 1,
            WriteFailure::TransferTimedOut => 2,
            WriteFailure::PrefillAborted => 3,
            WriteFailure::LeaseExpired => 4,
            WriteFailure::PlanMismatch => 5,
            WriteFailure::Unavailable => 6,
            WriteFailure::RegistrationExpired => 7,
            WriteFailure::DigestMismatch => 8,
        },
        VariantOf::CancelReason(c) => match c {
            CancelReason::Deadline => 0,
            CancelReason::Aborted => 1,
            CancelReason::Shutdown => 2,
        },
        VariantOf::ReleaseReason(r) => match r {
            ReleaseReason::FullPrefixHit => 0,
            ReleaseReason::Aborted => 1,
            ReleaseReason::ReadDone => 2,
            ReleaseReason::ReadFailed => 3,
            ReleaseReason::Declined => 4,
        },
        VariantOf::ReadRefusal(r) => match r {
            ReadRefusal::Unavailable => 0,
            ReadRefusal::Expired => 1,
            ReadRefusal::NearExpiry => 2,
            ReadRefusal::StaleEpoch => 3,
            ReadRefusal::Busy => 4,
            ReadRefusal::Aborted => 5,
        },
        VariantOf::TransferMode(t) => match t {
            TransferMode::Push => 0,
            TransferMode::Pull => 1,
            TransferMode::LayerwisePush => 2,
            TransferMode::Bidirectional => 3,
        },
    }
}

/// A value of one of the enums listed above.
#[derive(Debug, Clone, Copy)]
pub enum VariantOf {
    WriteFailure(WriteFailure),
    CancelReason(CancelReason),
    ReleaseReason(ReleaseReason),
    ReadRefusal(ReadRefusal),
    TransferMode(TransferMode),
}

pub fn write_failure() -> impl Strategy<Value = WriteFailure> {
    proptest::sample::select(&WRITE_FAILURES[..])
}

pub fn write_failed() -> impl Strategy<Value = WriteFailed> {
    (pairing_key(), epoch(), any::<u32>(), write_failure()).prop_map(
        |(key, epoch, prefill_rank, reason)| WriteFailed {
            key,
            epoch,
            prefill_rank,
            reason,
        },
    )
}

pub fn cancel() -> impl Strategy<Value = Cancel> {
    let reason = proptest::sample::select(&CANCEL_REASONS[..]);
    (pairing_key(), epoch(), reason).prop_map(|(key, epoch, reason)| Cancel { key, epoch, reason })
}

pub fn cancel_ack() -> impl Strategy<Value = CancelAck> {
    (pairing_key(), epoch(), any::<u32>()).prop_map(|(key, epoch, prefill_rank)| CancelAck {
        key,
        epoch,
        prefill_rank,
    })
}

pub fn heartbeat() -> impl Strategy<Value = Heartbeat> {
    let lease = (pairing_key(), epoch()).prop_map(|(key, epoch)| LeaseRef { key, epoch });
    (engine_id(), vec(lease, 0..16)).prop_map(|(engine, leases)| Heartbeat { engine, leases })
}

pub fn release() -> impl Strategy<Value = Release> {
    let reason = proptest::sample::select(&RELEASE_REASONS[..]);
    (pairing_key(), epoch(), reason).prop_map(|(key, epoch, reason)| Release { key, epoch, reason })
}

pub fn read_ask() -> impl Strategy<Value = ReadAsk> {
    (
        pairing_key(),
        epoch(),
        request_id(),
        any::<u32>(),
        any::<u32>(),
        trace_id(),
    )
        .prop_map(
            |(key, epoch, reader_request, reader_rank, ask, trace_id)| ReadAsk {
                key,
                epoch,
                reader_request,
                reader_rank,
                ask,
                trace_id,
            },
        )
}

pub fn read_grant() -> impl Strategy<Value = ReadGrant> {
    (
        pairing_key(),
        epoch(),
        any::<u32>(),
        block_ids(),
        any::<u64>(),
        any::<u32>(),
        vec(memory_span(), 0..=kvhandoff_protocol::MAX_REGISTER_SPANS),
    )
        .prop_map(
            |(key, epoch, holder_rank, blocks, num_tokens, ask, memory)| ReadGrant {
                key,
                epoch,
                holder_rank,
                blocks,
                num_tokens,
                ask,
                memory,
            },
        )
}

pub fn read_refused() -> impl Strategy<Value = ReadRefused> {
    let reason = proptest::sample::select(&READ_REFUSALS[..]);
    (pairing_key(), epoch(), any::<u32>(), reason).prop_map(|(key, epoch, holder_rank, reason)| {
        ReadRefused {
            key,
            epoch,
            holder_rank,
            reason,
        }
    })
}

/// Any valid message, every variant equally likely.
pub fn message() -> impl Strategy<Value = Message> {
    prop_oneof![
        handshake().prop_map(|h| Message::Handshake(Box::new(h))),
        register().prop_map(|r| Message::Register(Box::new(r))),
        write_done().prop_map(Message::WriteDone),
        write_failed().prop_map(Message::WriteFailed),
        cancel().prop_map(Message::Cancel),
        cancel_ack().prop_map(Message::CancelAck),
        heartbeat().prop_map(Message::Heartbeat),
        release().prop_map(Message::Release),
        read_ask().prop_map(Message::ReadAsk),
        read_grant().prop_map(|g| Message::ReadGrant(Box::new(g))),
        read_refused().prop_map(Message::ReadRefused),
    ]
}

// ---------------------------------------------------------------------------------------------
// Frames and hex

/// A frame header with arbitrary field values.
pub fn header(version: u16, kind: u8, flags: u8, payload_len: u32) -> Vec<u8> {
    let mut h = Vec::with_capacity(HEADER_LEN);
    h.extend_from_slice(&MAGIC);
    h.extend_from_slice(&version.to_le_bytes());
    h.push(kind);
    h.push(flags);
    h.extend_from_slice(&payload_len.to_le_bytes());
    h
}

/// A well-formed header (current version, no flags) for `payload`, followed by it.
pub fn frame(kind: u8, payload: &[u8]) -> Vec<u8> {
    let mut f = header(PROTOCOL_VERSION, kind, 0, payload.len() as u32);
    f.extend_from_slice(payload);
    f
}

/// Rewrites the header's payload length to match the bytes that follow it.
pub fn fix_len(frame: &mut [u8]) {
    let len = (frame.len() - HEADER_LEN) as u32;
    frame[8..12].copy_from_slice(&len.to_le_bytes());
}

pub fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn from_hex(text: &str) -> Vec<u8> {
    let text = text.trim();
    assert!(text.len() % 2 == 0, "odd number of hex digits");
    assert!(
        text.bytes()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c)),
        "golden hex must be lowercase hex digits only"
    );
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap())
        .collect()
}
