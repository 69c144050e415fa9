//! Golden wire vectors: one frame per message kind, stored as lowercase hex under
//! `tests/golden/<kind>.hex`.
//!
//! Each test (a) encodes a fixed message and compares the bytes with its file, and (b) decodes the
//! file and compares the result with the message.
//!
//! **A change of these bytes requires bumping `PROTOCOL_VERSION`** (in `src/wire.rs`), and then
//! `GOLDEN_PROTOCOL_VERSION` below: peers of the same version must agree on every byte. The
//! bytes change when a field, a variant, their order, an id rule or the codec configuration
//! changes; appending a variant to an enum keeps the old bytes but still changes what a version
//! means, so it needs a bump too.
//!
//! To regenerate the files after such a change, run
//!
//! ```text
//! KVHANDOFF_BLESS=1 cargo test -p kvhandoff-protocol --test golden
//! ```
//!
//! and commit the new files together with the new version.

mod common;

use std::path::PathBuf;

use common::{from_hex, to_hex};
use kvhandoff_protocol::wire::{self, HEADER_LEN};
use kvhandoff_protocol::{
    compatibility_hash, AgentName, BlockIds, CacheGroup, CacheGroupKind, Cancel, CancelAck,
    CancelReason, EngineId, Epoch, Handshake, Heartbeat, KvGeometry, KvLayout, LeaseRef,
    MemorySpan, Message, MessageKind, ModelIdentity, PairingKey, ReadAsk, ReadGrant, ReadRefusal,
    ReadRefused, RegionDesc, Register, Release, ReleaseReason, RequestId, TraceId, TransferMode,
    WriteDone, WriteFailed, WriteFailure, WritePartDone, PROTOCOL_VERSION,
};

/// The protocol version the golden files were made with. If this test fails because
/// `PROTOCOL_VERSION` changed, bless the files and update this constant in the same change; if
/// the files changed, `PROTOCOL_VERSION` must change too.
const GOLDEN_PROTOCOL_VERSION: u16 = 8;

#[test]
fn goldens_pin_the_protocol_version() {
    assert_eq!(
        PROTOCOL_VERSION, GOLDEN_PROTOCOL_VERSION,
        "PROTOCOL_VERSION changed: re-bless the golden files and update GOLDEN_PROTOCOL_VERSION"
    );
}

fn key() -> PairingKey {
    let d_request = RequestId::new("cmpl-5b1c9a52-6f0e-4c1b-9a7e-0c4c3f2d1e00-0-bbbbbbbb").unwrap();
    PairingKey::from_request_id(&d_request)
}

fn geometry() -> KvGeometry {
    // A small hybrid model on TP rank 1 of 2, PP rank 0 of 2: 3 local layers of full attention,
    // 2 of sliding window, 1 mamba.
    KvGeometry {
        num_layers: 12,
        total_kv_heads: 8,
        head_dim: 128,
        dtype_bytes: 2,
        kernel_block_size: 16,
        kernel_blocks_per_logical: 2,
        layout: KvLayout::Hnd,
        tp_size: 2,
        tp_rank: 1,
        pp_size: 2,
        pp_rank: 0,
        mla: false,
        cache_groups: vec![
            CacheGroup {
                kind: CacheGroupKind::FullAttention,
                num_layers: 3,
            },
            CacheGroup {
                kind: CacheGroupKind::SlidingWindow {
                    window_tokens: 4096,
                },
                num_layers: 2,
            },
            CacheGroup {
                kind: CacheGroupKind::Mamba {
                    conv_state_bytes: 24_576,
                    ssm_state_bytes: 1_048_576,
                },
                num_layers: 1,
            },
        ],
    }
}

fn handshake() -> Message {
    let geometry = geometry();
    let identity = ModelIdentity {
        model: "example/hybrid-12l".into(),
        dtype: "bfloat16".into(),
        cache_dtype: "bfloat16".into(),
    };
    let regions = geometry
        .regions()
        .unwrap()
        .iter()
        .enumerate()
        .map(|(i, spec)| RegionDesc {
            base: 0x7f00_0000_0000 + (i as u64) * 0x1_0000_0000,
            len: 1000 * spec.block_len,
            num_blocks: 1000,
            block_len: spec.block_len,
        })
        .collect();
    Message::Handshake(Box::new(Handshake {
        protocol_version: PROTOCOL_VERSION,
        engine_id: EngineId::new("prefill-0").unwrap(),
        incarnation: kvhandoff_protocol::Incarnation(0x0123_4567_89ab_4cde_8f01_2345_6789_abcd),
        agent_name: AgentName::new("prefill-0-pp0-tp1").unwrap(),
        agent_metadata: b"nixl-agent-metadata\x00\x01\x02\xff".to_vec(),
        regions,
        compat_hash: compatibility_hash(&identity, &geometry),
        geometry,
        modes: vec![TransferMode::Push, TransferMode::LayerwisePush],
        clock_sample_us: 1_700_000_000_123_456,
        trace_id: TraceId::from_u128(0x4bf9_2f35_77b3_4da6_a3ce_929d_0e0e_4736),
        routed: false,
    }))
}

fn register() -> Message {
    Message::Register(Box::new(Register {
        key: key(),
        epoch: Epoch(2),
        decode_engine: EngineId::new("decode-1").unwrap(),
        decode_request: RequestId::new("cmpl-5b1c9a52-6f0e-4c1b-9a7e-0c4c3f2d1e00-0-bbbbbbbb")
            .unwrap(),
        decode_rank: 1,
        blocks: BlockIds {
            groups: vec![vec![7, 8, 9, 300, 70_000], vec![12, 11], vec![5]],
        },
        num_tokens: 130,
        trace_id: TraceId::from_u128(0x0af7_6519_16cd_43dd_8448_eb21_1c80_319c),
        memory: vec![
            MemorySpan {
                addr: 0x7f00_0000_1000,
                len: 1 << 20,
            },
            MemorySpan {
                addr: 0x7f00_8000_0000,
                len: 4096,
            },
        ],
    }))
}

fn write_done() -> Message {
    Message::WriteDone(WriteDone {
        key: key(),
        epoch: Epoch(2),
        prefill_rank: 1,
        digests: vec![0x2d06_8005_38d3_94c2, 7],
    })
}

fn write_part_done() -> Message {
    Message::WritePartDone(WritePartDone {
        key: key(),
        epoch: Epoch(2),
        prefill_rank: 1,
        first: 20,
        count: 10,
        of: 80,
        digests: vec![0x0123_4567_89ab_cdef],
    })
}

fn write_failed() -> Message {
    Message::WriteFailed(WriteFailed {
        key: key(),
        epoch: Epoch(3),
        prefill_rank: 0,
        reason: WriteFailure::TransferTimedOut,
    })
}

fn cancel() -> Message {
    Message::Cancel(Cancel {
        key: key(),
        epoch: Epoch(2),
        reason: CancelReason::Deadline,
    })
}

fn cancel_ack() -> Message {
    Message::CancelAck(CancelAck {
        key: key(),
        epoch: Epoch(2),
        prefill_rank: 1,
    })
}

fn heartbeat() -> Message {
    Message::Heartbeat(Heartbeat {
        engine: EngineId::new("decode-1").unwrap(),
        leases: vec![
            LeaseRef {
                key: key(),
                epoch: Epoch(2),
            },
            LeaseRef {
                key: PairingKey::from_transfer_id("xfer-42").unwrap(),
                epoch: Epoch(u64::MAX),
            },
        ],
    })
}

fn release() -> Message {
    Message::Release(Release {
        key: PairingKey::from_transfer_id("xfer-42").unwrap(),
        epoch: Epoch::FIRST,
        reason: ReleaseReason::FullPrefixHit,
    })
}

fn read_ask() -> Message {
    Message::ReadAsk(ReadAsk {
        key: key(),
        epoch: Epoch(2),
        reader_request: RequestId::new("cmpl-5b1c9a52-6f0e-4c1b-9a7e-0c4c3f2d1e00-0-bbbbbbbb")
            .unwrap(),
        reader_rank: 1,
        ask: 1,
        trace_id: TraceId::from_u128(0x0af7_6519_16cd_43dd_8448_eb21_1c80_319c),
    })
}

fn read_grant() -> Message {
    Message::ReadGrant(Box::new(ReadGrant {
        key: key(),
        epoch: Epoch(2),
        holder_rank: 0,
        blocks: BlockIds {
            groups: vec![vec![4, 5, 6, 90_000], vec![1]],
        },
        num_tokens: 61,
        ask: 1,
        memory: vec![MemorySpan {
            addr: 0x7f00_2000_0000,
            len: 1 << 20,
        }],
    }))
}

fn read_refused() -> Message {
    Message::ReadRefused(ReadRefused {
        key: key(),
        epoch: Epoch(3),
        holder_rank: 1,
        reason: ReadRefusal::NearExpiry,
    })
}

/// The golden file's name for each kind. Exhaustive, so a new kind cannot go without a vector.
fn file_name(kind: MessageKind) -> &'static str {
    match kind {
        MessageKind::Handshake => "handshake",
        MessageKind::Register => "register",
        MessageKind::WriteDone => "write_done",
        MessageKind::WriteFailed => "write_failed",
        MessageKind::Cancel => "cancel",
        MessageKind::CancelAck => "cancel_ack",
        MessageKind::Heartbeat => "heartbeat",
        MessageKind::Release => "release",
        MessageKind::ReadAsk => "read_ask",
        MessageKind::ReadGrant => "read_grant",
        MessageKind::ReadRefused => "read_refused",
        MessageKind::WritePartDone => "write_part_done",
    }
}

fn path(kind: MessageKind) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(format!("{}.hex", file_name(kind)))
}

fn blessing() -> bool {
    std::env::var("KVHANDOFF_BLESS").is_ok_and(|v| v == "1")
}

/// (a) `encode(message)` is the file's frame, and (b) decoding the file gives `message` back.
fn check(message: Message) {
    let kind = message.kind();
    assert_eq!(message.validate(), Ok(()));
    let encoded = wire::encode(&message);
    let path = path(kind);
    if blessing() {
        std::fs::write(&path, format!("{}\n", to_hex(&encoded))).unwrap();
        eprintln!("blessed {}", path.display());
        return;
    }
    let text = std::fs::read_to_string(&path).unwrap_or_else(|err| {
        panic!(
            "{}: {err} (run with KVHANDOFF_BLESS=1 to create it)",
            path.display()
        )
    });
    let golden = from_hex(&text);
    assert_eq!(
        &golden[4..6],
        &GOLDEN_PROTOCOL_VERSION.to_le_bytes()[..],
        "{kind:?}: the file's header has another version"
    );
    assert_eq!(
        golden[6], kind as u8,
        "{kind:?}: the file holds another kind"
    );
    assert_eq!(
        to_hex(&encoded),
        to_hex(&golden),
        "{kind:?}: the encoding changed. If that is intended, bump PROTOCOL_VERSION and bless"
    );
    assert_eq!(wire::decode(&golden), Ok(message), "{kind:?}");
    assert_eq!(
        wire::decode_header(&golden).unwrap().payload_len,
        golden.len() - HEADER_LEN
    );
}

#[test]
fn golden_handshake() {
    check(handshake());
}

#[test]
fn golden_register() {
    check(register());
}

#[test]
fn golden_write_done() {
    check(write_done());
}

#[test]
fn golden_write_part_done() {
    check(write_part_done());
}

#[test]
fn golden_write_failed() {
    check(write_failed());
}

#[test]
fn golden_cancel() {
    check(cancel());
}

#[test]
fn golden_cancel_ack() {
    check(cancel_ack());
}

#[test]
fn golden_heartbeat() {
    check(heartbeat());
}

#[test]
fn golden_release() {
    check(release());
}

#[test]
fn golden_read_ask() {
    check(read_ask());
}

#[test]
fn golden_read_grant() {
    check(read_grant());
}

#[test]
fn golden_read_refused() {
    check(read_refused());
}

/// Exactly one golden message per kind, and one file per kind (no stale files).
#[test]
fn every_kind_has_one_vector() {
    let messages = [
        handshake(),
        register(),
        write_done(),
        write_failed(),
        cancel(),
        cancel_ack(),
        heartbeat(),
        release(),
        read_ask(),
        read_grant(),
        read_refused(),
        write_part_done(),
    ];
    let kinds: Vec<MessageKind> = messages.iter().map(Message::kind).collect();
    assert_eq!(kinds, MessageKind::ALL);
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden");
    let mut files: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".hex"))
        .collect();
    files.sort();
    let mut expected: Vec<String> = MessageKind::ALL
        .iter()
        .map(|k| format!("{}.hex", file_name(*k)))
        .collect();
    expected.sort();
    if !blessing() {
        assert_eq!(files, expected);
    }
}

/// A readable check of the simplest vector, byte by byte, so the layout in docs/protocol.md
/// stays true.
#[test]
fn the_release_vector_reads_as_documented() {
    let bytes = wire::encode(&release());
    let expected: Vec<u8> = [
        &b"KVHO"[..],     // magic
        &[0x08, 0x00],    // version 8, little endian
        &[0x08],          // kind: Release
        &[0x00],          // flags
        &[0x0a, 0, 0, 0], // payload length 10, little endian
        &[0x07],          // key: varint length 7 ...
        &b"xfer-42"[..],  // ... and its UTF-8 bytes
        &[0x01],          // epoch 1 (varint)
        &[0x00],          // reason: FullPrefixHit (variant 0, varint)
    ]
    .concat();
    assert_eq!(bytes, expected);
}
