//! kvhandoff hands KV cache from prefill (P) to decode (D) engines of disaggregated LLM serving.
//!
//! This crate is what an engine links: the rank builder, the connector, its transfer parameters
//! and the runtime that hosts the ranks, over the sans-IO core (`kvhandoff-protocol`, whose
//! engine-facing `Session` every call goes through) and the shells and transports
//! (`kvhandoff-actors`). It re-exports what an engine names, not those crates whole. The
//! `kvhandoff` command line (demo, bench, node, sim) lives in its own crate, `kvhandoff-cli`,
//! and none of its code is compiled here.
//!
//! The engine-facing surface is small: a [`RankBuilder`] starts a rank on the engine's own KV
//! memory ([`KvRegion`]) over a transport ([`TransportKind`]), and the engine drives it through
//! its [`KvConnector`] with the hooks it already calls each step, reading and writing its blocks
//! through the rank's [`KvCache`]. Everything an engine needs is re-exported here (ids,
//! geometry, configuration, events), so it links this crate only; `examples/handoff.rs` is a P
//! and a D engine loop to start from. The protocol itself lives in pure state machines that the
//! simulator steps deterministically, through the same session.
//!
//! ```
//! use kvhandoff::KvTransferParams;
//! // What P hands the router after its prefill, and what D receives with the decode leg:
//! let params = KvTransferParams {
//!     do_remote_prefill: true,
//!     remote_engine_id: Some("prefill-0".into()),
//!     tp_size: Some(1),
//!     ..KvTransferParams::default()
//! };
//! let json = serde_json::to_string(&params).unwrap();
//! assert!(json.contains("\"remote_engine_id\":\"prefill-0\""));
//! ```
#![warn(missing_docs)]

mod builder;
mod cache;
mod connector;
pub mod route;
mod settings;
mod warm;

pub use builder::{EngineRank, RankBuilder, SideChannel, StartError, TransportKind};
pub use cache::{KvCache, KvCacheError};
pub use connector::KvConnector;
pub use kvhandoff_actors::metrics;
pub use kvhandoff_actors::system::Runtime;
pub use kvhandoff_actors::system::SideChannelStats;
pub use kvhandoff_actors::system::{
    AcceptPolicy, AdoptError, AuthFailure, BuildError, KvRegion, MemoryLocation, Placement, Psk,
    PskError, RegionProblem, RuntimeError, ShellConfig, SideChannelConfig, PSK_MAX_LEN,
    PSK_MIN_LEN,
};
pub use kvhandoff_actors::transport::mem::MemFabric;
#[cfg(feature = "nixl")]
pub use kvhandoff_actors::transport::nixl::NixlConfig;
pub use kvhandoff_protocol::hetero::{PairPlan, SideName};
pub use kvhandoff_protocol::machine::{
    Config, DecodeFailure, ExportOutcome, FreeProof, ImportOutcome, LoadFailurePolicy, ReadProof,
    ReleaseCause,
};
pub use kvhandoff_protocol::session::{
    ConnectorCall, ConnectorError, ConnectorEvent, ConnectorIdentity, ConnectorReply,
    ConnectorSettings, KvTransferParams, RankLinks, DEFAULT_NEXT_TURN_TTL,
    DEFAULT_RECOMPUTE_THRESHOLD, MAX_FANS,
};
pub use kvhandoff_protocol::PeerAddr;
pub use kvhandoff_protocol::TransferMode;
pub use kvhandoff_protocol::{
    BlockIds, EngineId, IdError, KvGeometry, KvLayout, ModelIdentity, RegionSpec, RequestId,
};
pub use settings::{RankSettings, SettingValue, SettingsError, RANK_ENV_PREFIX, RANK_TABLE};
