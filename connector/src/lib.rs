//! kvhandoff hands KV cache from prefill (P) to decode (D) engines of disaggregated LLM serving.
//!
//! This crate is what an engine links: the connector, its transfer parameters and the runtime
//! that hosts the ranks, with the sans-IO core ([`protocol`]) and the shells and transports
//! ([`actors`]) re-exported. The `kvhandoff` command line (demo, bench, node, sim) lives in its
//! own crate, `kvhandoff-cli`, and none of its code is compiled here.
//!
//! The engine-facing surface is small: start a [`Runtime`], build a rank on a transport, and
//! drive it through a [`KvConnector`] with the hooks an engine already calls each step. The
//! protocol itself lives in pure state machines ([`protocol::machine`]) that the simulator steps
//! deterministically.
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

mod connector;

pub use connector::KvConnector;
pub use kvhandoff_actors as actors;
pub use kvhandoff_actors::system::Runtime;
pub use kvhandoff_protocol as protocol;
pub use kvhandoff_protocol::session::{
    ConnectorCall, ConnectorError, ConnectorEvent, ConnectorIdentity, ConnectorReply,
    ConnectorSettings, KvTransferParams, RankLinks, DEFAULT_NEXT_TURN_TTL,
    DEFAULT_RECOMPUTE_THRESHOLD, MAX_FANS,
};
pub use kvhandoff_protocol::TransferMode;
