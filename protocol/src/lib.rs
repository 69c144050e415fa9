//! The sans-IO core of kvhandoff, as quinn-proto is quinn's: identifiers and epochs, KV
//! geometry, the messages that cross between prefill (P) and decode (D) engines and their
//! versioned wire codec ([`wire`]), the write planner ([`planner`]), the state machines of
//! every request and peer ([`machine`]), the [`transport::Transport`] trait the shells implement
//! and the [`driver`] that translates between the two.
//!
//! Nothing here does I/O, spawns, sleeps or reads a clock, and the crate depends on no runtime
//! (no actix, tokio, NIXL or CUDA): every function is deterministic and safe to call from the
//! actix shells (`kvhandoff-actors`), the simulator (`kvhandoff-sim`) and fuzzers alike.
//!
//! ```
//! use kvhandoff_protocol::{wire, Epoch, Message, PairingKey, RequestId, WriteDone};
//! let d_request = RequestId::new("cmpl-abc-0-1a2b3c4d").unwrap();
//! let key = PairingKey::from_request_id(&d_request);
//! let done = Message::WriteDone(WriteDone { key, epoch: Epoch::FIRST, prefill_rank: 0, digests: vec![] });
//! assert_eq!(wire::decode(&wire::encode(&done)).unwrap(), done);
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod addr;
mod compat;
pub mod driver;
mod geometry;
pub mod hetero;
mod ids;
pub mod integrity;
pub mod machine;
mod message;
pub mod planner;
pub mod session;
pub mod trace;
pub mod transport;
pub mod wire;

pub use addr::{PeerAddr, WriteId};

pub use compat::{compatibility_hash, ModelIdentity};
pub use geometry::{
    CacheGroup, CacheGroupKind, GeometryError, KvGeometry, KvLayout, RegionDesc, RegionKind,
    RegionSpec, MAX_CACHE_GROUPS, MAX_LAYERS, MAX_PARALLEL,
};
pub use ids::{
    AgentName, EngineId, Epoch, IdError, Incarnation, PairingKey, RequestId, MAX_ID_LEN,
};
pub use message::{
    BlockIds, Cancel, CancelAck, CancelReason, CompatHash, FieldError, Handshake, Heartbeat,
    LeaseRef, MemorySpan, Message, MessageKind, ReadAsk, ReadGrant, ReadRefusal, ReadRefused,
    Register, Release, ReleaseReason, TransferMode, WriteDone, WriteFailed, WriteFailure,
    WritePartDone, MAX_AGENT_METADATA, MAX_BLOCKS_PER_GROUP, MAX_BLOCKS_PER_REQUEST,
    MAX_HEARTBEAT_LEASES, MAX_REGIONS, MAX_REGISTER_SPANS, MAX_ROUTED_BUFFERS, MAX_TRANSFER_MODES,
    MAX_WRITE_LAYERS,
};
pub use trace::{TraceId, TraceIdError, TraceIds};
pub use wire::{WireError, PROTOCOL_VERSION};
