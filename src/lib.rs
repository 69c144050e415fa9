//! The `kvhandoff` command line's harnesses: the demo (both sides of the handoff in one
//! process), the benchmarks, and the `node` role of a two-process run. They drive the library
//! an engine links ([`kvhandoff`]) exactly as an engine would; nothing here is part of it.
#![warn(missing_docs)]

pub mod bench;
pub mod demo;
pub mod hetero;
#[cfg(feature = "nixl")]
pub mod nixl_agent;
pub mod node;
pub mod stats;
