//! Heterogeneous geometry (issue 12): P and D engines with different TP, PP, kernel block
//! size, kernel blocks per logical block and layout, for dense GQA, MLA, sliding-window and
//! mamba caches, planned down to the byte.
//!
//! Three layers, all pure (no I/O, checked arithmetic, no panics on any input, a limit on
//! everything):
//!
//! 1. **A side**: a model of the [catalog](MODELS) and a [`SideSpec`]
//!    (`tp=N,block=N,layout=NHD|HND[,pp=N][,kbpl=N]`) give every rank's [`KvGeometry`], layer
//!    window, heads, regions and distinct tensors ([`SideLayout::build`]).
//! 2. **The pair** ([`plan_pair`]): which P rank (TP, PP) writes which D rank ([`Link`]): the
//!    layer window, the heads (each head of a D rank has exactly one writer, also when TP
//!    exceeds the heads and several P ranks hold a replica; MLA's latent has one writer per D
//!    rank), the mamba state byte ranges, the writes each D rank waits for, and the
//!    [`Pipeline`]: which transforms run, on which side and why.
//! 3. **A request** ([`plan_request`]): token count, both sides' logical block ids per cache
//!    group and every rank's addresses give P's staging jobs, the wire's pieces per link (merged
//!    where contiguous on both sides), D's staging jobs and the tail D zeroes, with
//!    sliding-window clipping and the prefix-cache end trim applied.
//!
//! The CLI crate's host executor (`kvhandoff_cli::hetero`) runs these plans with the
//! `kvhandoff-kernels` transforms and checks every byte against a reference.
//!
//! [`KvGeometry`]: crate::KvGeometry

mod catalog;
mod error;
mod pair;
mod ranks;
mod request;
mod rows;
mod spec;
mod transforms;

#[cfg(test)]
mod tests;

pub use catalog::{model, Model, ModelGroup, MODELS, MODEL_NAMES};
pub use error::{HeteroError, SideName, SpecError};
pub use pair::{plan_pair, ByteLink, HeadLink, Link, PairPlan, StateLink};
pub use ranks::{rank_heads, RankId, RankLayout, RankRegion, SideLayout, Tensor};
pub use request::{
    plan_request, tensor_len, DecodeJob, GroupSpan, PrefillJob, RankMemory, RequestInput,
    RequestPlan, SideMemory, Space, Transfer, ZeroRange,
};
pub use rows::{BlockRun, Piece};
pub use spec::{layout_name, SideSpec};
pub use transforms::{
    decide, BlockFormat, Pipeline, RunsOn, Stage, StageOp, StridedBytes, Transform, TransformKind,
};

/// Most ranks (TP × PP) of one side.
pub const MAX_RANKS: u32 = 1024;
/// Most tokens per kernel block.
pub const MAX_BLOCK_TOKENS: u32 = 4096;
/// Most kernel blocks per logical block.
pub const MAX_KBPL: u32 = 64;
/// Most tokens of one request.
pub const MAX_REQUEST_TOKENS: u64 = 1 << 18;
/// Most logical blocks in one side's pool.
pub const MAX_POOL_BLOCKS: u32 = 1 << 20;
/// Most pieces one request's plan may hold.
pub const MAX_PIECES: usize = 1 << 22;
