//! The transport implementations: [`mem::MemTransport`] (in-process agents on a shared
//! [`mem::MemFabric`], real bytes, fault switches) and, with the cargo feature `nixl`,
//! `nixl::NixlTransport` over real NIXL agents.
//!
//! The [`Transport`] trait they implement, and its types, belong to the sans-IO core
//! ([`kvhandoff_protocol::transport`]); they are re-exported here beside their implementations.

pub mod mem;
#[cfg(feature = "nixl")]
pub mod nixl;

pub use kvhandoff_protocol::transport::*;
