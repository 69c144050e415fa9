//! Heterogeneous transfers run end to end on host memory: the executor that applies a
//! [`kvhandoff_protocol`] pair plan (P-side transforms, the wire, D-side transforms), the
//! reference KV it is checked against, and the verification matrix.

#[cfg(feature = "nixl")]
pub mod nixl_wire;
pub mod wire;
