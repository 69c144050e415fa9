//! Heterogeneous transfers run end to end on host memory: the executor that applies a
//! [`kvhandoff_protocol::hetero`] request plan (P-side transforms, the wire, D-side
//! transforms), the verifier of the reference KV ([`crate::pattern`]) and the verification
//! matrix.
//!
//! To run one request of a pair over any [`wire::Wire`]:
//!
//! ```
//! use kvhandoff_testkit::hetero::handoff::{Handoff, RequestShape};
//! use kvhandoff_testkit::hetero::wire::MemoryWire;
//! use kvhandoff_protocol::hetero::{model, plan_pair};
//! let pair = plan_pair(
//!     model("gqa8").unwrap(),
//!     "tp=1,block=16,layout=NHD".parse().unwrap(),
//!     "tp=2,block=32,layout=HND".parse().unwrap(),
//! )
//! .unwrap();
//! let shape = RequestShape { tokens: 150, cached_tokens: 0, seed: 7 };
//! let mut handoff = Handoff::prepare(pair, shape).unwrap();
//! let stats = handoff.run(&mut MemoryWire).unwrap();
//! handoff.verify().unwrap();
//! assert!(stats.bytes > 0);
//! ```

pub mod handoff;
pub mod matrix;
#[cfg(feature = "nixl")]
pub mod nixl_wire;
pub mod pair_demo;
pub mod plan_report;
pub mod vllm;
pub mod wire;

#[cfg(test)]
mod tests;
