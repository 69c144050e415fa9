//! `kvhandoff bench transfer`: the KV bytes of one realistic request, moved by raw NIXL and by
//! kvhandoff end to end, next to memcpy and the planner.
//!
//! The request: 2,048 tokens of an 8B-class geometry (32 layers, 8 KV heads, head dim 128,
//! bf16, 16-token kernel blocks, TP 1), so 128 blocks in 64 regions (K and V per layer) of
//! 32 KiB per block: 256 MiB. Two block tables hold it (each side's pool has `2 × blocks`
//! blocks):
//! - **contiguous**: P's blocks `0..n`, D's blocks `n..2n`; the planner merges each region's
//!   blocks into one descriptor (64 descriptors of 4 MiB);
//! - **fragmented**: P's blocks are the odd ids, D's the even ids in a scattered order, so no two
//!   blocks are adjacent on either side and no run merges (128 × 64 = 8,192 descriptors of
//!   32 KiB).
//!
//! What is measured, in one process, in one run (so the ratios compare like with like):
//! - **memcpy**: one thread, `copy_from_slice` of the request's bytes between two buffers.
//! - **raw NIXL**: two `nixl_sys` agents (UCX, progress thread on with
//!   [`NixlConfig::default`]'s `pthr_delay_us`), the planner's descriptors, then per repetition:
//!   two `XferDescList`s, `create_xfer_req` (with a notification), `post_xfer_req`, and
//!   `get_xfer_status` polled (with `yield_now`) until done and the target has the notification.
//!   The time is from the first descriptor list entry to the notification at the target; "post"
//!   is the time inside `create_xfer_req` + `post_xfer_req`.
//! - **kvhandoff**: two ranks built with [`build_rank`] on [`NixlTransport`]s in one
//!   [`Runtime`], a [`KvConnector`] per side, one request at a time in vLLM's order: P's
//!   `request_finished`, then D's `request_allocated`. The handoff latency runs from the start of
//!   D's call (the second of the two) to D's `BlocksReady`, seen by
//!   [`KvConnector::wait_events`](kvhandoff::KvConnector::wait_events) (woken by the event itself, so the bench adds no poll
//!   granularity and takes no core from the transfer); the throughput is the request's bytes
//!   over that latency. Each request waits for P's `BlocksFree` before the next starts.
//! - **latency**: the same two paths on a one-block request (P's first block of the contiguous
//!   table to D's), [`TransferOptions::latency_repeats`] times alternating: the fixed cost
//!   per handoff, where the throughput tables hide it ([`TransferReport::latency`]).
//! - **prepared lists** ([`TableNumbers::prepared_gain`], [`TransferReport::prepared_gain`],
//!   [`LatencyNumbers::prepared_gain`]): per table, after the raw vs kvhandoff pass, a second
//!   pass alternates the kvhandoff ranks with a second pair whose
//!   [`NixlConfig::prepared_lists`] is off (every post through dynamic lists); the gain is the
//!   dynamic-only p50 over the prepared p50. Then the request alone with raw nixl-sys, created
//!   and released unposted both ways ([`PreparedRequest`]).
//! - **idle CPU** (with [`TransferOptions::idle_secs`]): the process's user + system time while
//!   the two ranks sit idle, after the raw agents are gone.
//! - **planning**: [`fragmented_70b_case`] planned with one reused [`Planner`].
//! - **notifications**: the round trip A → B → A between two agents of one process for several
//!   progress-thread settings.
//!
//! Raw and kvhandoff repetitions alternate, so machine noise hits both alike; each path and
//! table starts with one untimed warm-up. Both sides' source pools are filled with a non-zero
//! pattern first (untouched pages would all read the kernel's shared zero page). Every
//! repetition checks the data landed: the first and last 8 bytes of every source block are
//! stamped with their (region, block) and checked at their destination (cleared before each
//! repetition).
//!
//! GB/s are decimal (10⁹ bytes per second). Medians over the repetitions unless named.
//!
//! [`NixlConfig::default`]: kvhandoff_actors::transport::nixl::NixlConfig
//! [`NixlConfig::prepared_lists`]: kvhandoff_actors::transport::nixl::NixlConfig::prepared_lists
//! [`build_rank`]: kvhandoff_actors::system::build_rank
//! [`NixlTransport`]: kvhandoff_actors::transport::nixl::NixlTransport
//! [`Runtime`]: kvhandoff::Runtime
//! [`KvConnector`]: kvhandoff::KvConnector

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use kvhandoff_protocol::planner::{fragmented_70b_case, PlanInput, Planner, FRAGMENTED_70B_BLOCKS};
use kvhandoff_protocol::{BlockIds, KvGeometry, KvLayout};
use kvhandoff_testkit::stats::{gbps, human_bytes, median, percentile};
use serde::{Deserialize, Serialize};

/// The throughput target: kvhandoff end to end over raw NIXL on the same descriptors.
pub const TARGET_RATIO: f64 = 0.9;
/// The planning target for [`fragmented_70b_case`], µs.
pub const TARGET_PLAN_US: f64 = 100.0;
/// The least descriptors any valid plan of [`fragmented_70b_case`] has: 118 blocks × 160 regions.
pub const FRAGMENTED_70B_MIN_DESCRIPTORS: usize = FRAGMENTED_70B_BLOCKS as usize * 160;
/// The latency target: a one-block kvhandoff handoff over one raw NIXL WRITE with its
/// notification, p50 over p50, in the same run.
pub const TARGET_LATENCY_RATIO: f64 = 1.5;

/// What `bench transfer` runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferOptions {
    /// Prompt tokens of the request (default 2,048); blocks are `tokens / 16`, rounded up.
    pub tokens: u32,
    /// Layers (default 32).
    pub num_layers: u32,
    /// KV heads (default 8).
    pub kv_heads: u32,
    /// Head dimension (default 128).
    pub head_dim: u32,
    /// Timed repetitions per table and path (default 20); each path also runs one untimed
    /// warm-up per table.
    pub repeats: usize,
    /// Plans of the fragmented 70B case (default 200).
    pub plan_repeats: usize,
    /// Timed notification round trips per setting (default 200).
    pub notify_rounds: usize,
    /// Measure every progress-thread setting, not only the default one (default true).
    pub notify_sweep: bool,
    /// Limit of every single wait (default 30 s).
    pub timeout: Duration,
    /// Timed repetitions of the one-block handoff behind [`TransferReport::latency`] (default
    /// 50).
    pub latency_repeats: usize,
    /// The kvhandoff ranks run NIXL's arrival poller ([`NixlConfig::poller`], default true);
    /// false measures the timer-only shell, for before/after comparisons.
    ///
    /// [`NixlConfig::poller`]: kvhandoff_actors::transport::nixl::NixlConfig::poller
    pub arrival_poller: bool,
    /// Seconds to measure the CPU time of the process while its two kvhandoff ranks sit idle
    /// (connected, after the handoffs, raw agents gone); 0 skips it (default).
    pub idle_secs: u64,
}

impl Default for TransferOptions {
    fn default() -> Self {
        TransferOptions {
            tokens: 2048,
            num_layers: 32,
            kv_heads: 8,
            head_dim: 128,
            repeats: 20,
            plan_repeats: 200,
            notify_rounds: 200,
            notify_sweep: true,
            timeout: Duration::from_secs(30),
            latency_repeats: 50,
            arrival_poller: true,
            idle_secs: 0,
        }
    }
}

impl TransferOptions {
    /// A few small blocks for tests: 64 tokens (4 blocks), 2 layers, 1 head of 64, R = 2.
    pub fn tiny() -> Self {
        TransferOptions {
            tokens: 64,
            num_layers: 2,
            kv_heads: 1,
            head_dim: 64,
            repeats: 2,
            plan_repeats: 5,
            notify_rounds: 5,
            notify_sweep: false,
            timeout: Duration::from_secs(30),
            latency_repeats: 2,
            arrival_poller: true,
            idle_secs: 0,
        }
    }

    /// Logical blocks of the request.
    pub fn blocks(&self) -> u32 {
        self.tokens.div_ceil(BLOCK_TOKENS)
    }

    fn check(&self) -> Result<(), TransferBenchError> {
        let bad = |why: &str| Err(TransferBenchError::Options(why.into()));
        if self.tokens == 0 || self.blocks() > 1 << 20 {
            return bad("tokens must be between 1 and 2^24");
        }
        if self.num_layers == 0 || self.kv_heads == 0 || self.head_dim == 0 {
            return bad("layers, heads and head_dim must be positive");
        }
        if self.repeats == 0
            || self.plan_repeats == 0
            || self.notify_rounds == 0
            || self.latency_repeats == 0
        {
            return bad("repetition counts must be positive");
        }
        if self.timeout.is_zero() {
            return bad("the timeout must be positive");
        }
        Ok(())
    }
}

const BLOCK_TOKENS: u32 = 16;

/// Why `bench transfer` could not produce numbers.
#[derive(Debug, thiserror::Error)]
pub enum TransferBenchError {
    /// Built without the `nixl` feature.
    #[error(
        "`bench transfer` needs the NIXL runtime: rebuild with the `nixl` cargo feature \
         (`source scripts/nixl-env.sh && cargo run --release --features nixl -- bench transfer`)"
    )]
    NixlFeatureMissing,
    /// The options make no sense.
    #[error("invalid bench options: {0}")]
    Options(String),
    /// A NIXL call failed (or the runtime is missing).
    #[error("NIXL: {0}")]
    Nixl(String),
    /// The run went wrong: a timeout, an unexpected event, bytes that did not land.
    #[error("the transfer run failed: {0}")]
    Run(String),
}

// ---------------------------------------------------------------------------------------------
// The run.

/// Runs the transfer benchmark.
///
/// # Errors
/// [`TransferBenchError::NixlFeatureMissing`] without the `nixl` feature; otherwise bad options,
/// a NIXL failure (the runtime missing included), or a run that goes wrong.
pub fn transfer(options: &TransferOptions) -> Result<TransferReport, TransferBenchError> {
    options.check()?;
    #[cfg(feature = "nixl")]
    {
        live::run(options)
    }
    #[cfg(not(feature = "nixl"))]
    {
        Err(TransferBenchError::NixlFeatureMissing)
    }
}

mod reference;
mod report;
mod sweep;
mod tables;

pub use reference::{memcpy_gbps, plan_fragmented_70b};
pub use report::{
    Fragmented70b, IdleCpu, LatencyNumbers, LatencySamples, NotifyPoint, PreparedRequest,
    PushNumbers, RawNumbers, RequestShape, TableNumbers, TransferReport,
};
pub use sweep::{descriptor_sweep, run_table, sweep_pool, SweepOptions, SweepPoint, SweepReport};
use tables::us;
pub use tables::{bench_geometry, block_tables, BlockTable};

#[cfg(feature = "nixl")]
mod live;

#[cfg(test)]
mod tests;
