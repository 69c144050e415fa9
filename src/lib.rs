//! kvhandoff: hands KV cache from prefill to decode engines over NIXL.
#![warn(missing_docs)]

pub use kvhandoff_protocol as protocol;
