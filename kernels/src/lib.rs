//! KV block transforms for heterogeneous deployments: the bytes of one region's kernel blocks
//! rearranged from one geometry to another, on the CPU (safe Rust) and, behind the feature
//! `cuda`, as CUDA C compiled at run time by NVRTC.
//!
//! Each kernel works on byte slices holding whole kernel blocks of **one region** (the K, V or
//! latent region of one layer: `RegionSpec::block_len`-sized blocks laid end to end)
//! with its shape given explicitly as a [`BlockShape`]: tokens per kernel block
//! (`KvGeometry::kernel_block_size`), KV heads on the rank (`KvGeometry::heads_per_rank`),
//! `head_dim` and `dtype_bytes`. The elements are never interpreted: a kernel moves whole *rows*
//! (the `head_dim × dtype_bytes` bytes of one token of one head), so any dtype (or packed
//! format) is moved exactly.
//!
//! - [`digest`](mod@digest): the integrity digest of KV blocks (XXH3-64), which P computes over
//!   the bytes it writes and D over the bytes that landed (`Config::integrity_digest`).
//! - [`permute`]: NHD (`[tokens, heads, head_dim]`) ↔ HND (`[heads, tokens, head_dim]`), the
//!   `kv_postprocess_layout_on_receive` of vLLM.
//! - [`regroup_gather`] / [`regroup_split`]: `ratio` kernel blocks of `B` tokens ↔ one block of
//!   `ratio × B` tokens (vLLM's `block_size_ratio`, `kv_postprocess_blksize_on_receive`), with
//!   the tail of a partly covered destination block zeroed.
//! - [`slice_heads`] / [`gather_heads`]: heads `[h0, h1)` of a block into a block with fewer heads,
//!   and several ranks' blocks into one with all their heads (heterogeneous TP, GQA head
//!   slicing). Which ranks hold which heads, and replication when TP exceeds the heads, is the
//!   caller's mapping (vLLM's `compute_tp_mapping`).
//!
//! Every kernel checks its shape and buffer lengths first and returns a [`KernelError`]; none
//! panics on bad input. They run on `threads` threads (`std::thread::scope`, blocks split into
//! contiguous runs) when the buffer is large enough for threads to pay ([`PAR_MIN_BYTES`]).
//!
//! [`bench`](mod@bench) measures each against a plain `copy_from_slice` of the same bytes; the
//! module `cuda` (feature `cuda`) holds the CUDA C kernels and compiles them with NVRTC.
//!
//! `unsafe` is forbidden in every CPU module. With the feature `cuda` the crate only denies it:
//! probing whether `libnvrtc`/`libcuda` can be loaded and launching a kernel are `unsafe fn` in
//! cudarc, and cudarc *panics* when a library is missing, so the probe cannot be skipped
//! (`/work/shared/reference/cuda-on-this-machine.md`); those calls live in `cuda` alone.
#![cfg_attr(not(feature = "cuda"), forbid(unsafe_code))]
#![cfg_attr(feature = "cuda", deny(unsafe_code))]
#![warn(missing_docs)]

pub mod bench;
mod copy;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod digest;
mod error;
mod heads;
mod par;
mod permute;
mod regroup;
mod shape;

#[cfg(test)]
mod reference;

pub use error::KernelError;
pub use heads::{gather_heads, slice_heads};
pub use par::{default_threads, PAR_MIN_BYTES};
pub use permute::permute;
pub use regroup::{regroup_gather, regroup_split};
pub use shape::{BlockShape, Layout};
