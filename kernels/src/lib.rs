//! KV block transforms for heterogeneous deployments (NHD/HND permute, block-size regroup,
//! TP head slicing).
//!
//! Nothing lives here yet: transforms arrive with the heterogeneous-geometry work. The crate
//! exists so the workspace has its final shape.
#![forbid(unsafe_code)]
