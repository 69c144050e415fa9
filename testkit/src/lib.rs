//! kvhandoff's test kit: the harnesses the `kvhandoff` command line runs and the end-to-end
//! tests drive. The demo (a mock engine on both sides of the handoff in one process), the
//! `node` role of a two-process run, the heterogeneous executor and its matrix, the byte
//! patterns every harness fills and checks, and the reports. They drive the library an engine
//! links ([`kvhandoff`]) exactly as an engine would; nothing here is part of it.
//!
//! Feature `test-hooks`: hooks only tests use (a node that stops itself, the handshake replay).
#![warn(missing_docs)]

pub mod demo;
pub mod hetero;
mod hooks;
#[cfg(feature = "nixl")]
pub mod nixl_agent;
pub mod node;
pub mod pattern;
pub mod ports;
pub mod stats;
