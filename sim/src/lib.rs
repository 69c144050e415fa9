//! Deterministic simulation of kvhandoff engines: virtual clock, seeded choices, simulated NIXL
//! and network with faults, and a ghost ledger of block ownership.
//!
//! Nothing lives here yet: the simulator arrives once the push-mode state machines exist.
#![forbid(unsafe_code)]
