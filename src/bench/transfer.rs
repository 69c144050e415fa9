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
//!   D's call (the second of the two) to D's `BlocksReady`, seen by polling D's connector (every
//!   1 ms through the first 80% of the raw time just measured, then every 50 µs: a tight loop
//!   would take a core from the transfer on a 2-core machine); the throughput is the request's
//!   bytes over that latency. Each request waits for P's `BlocksFree` before the next starts.
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
//! [`build_rank`]: kvhandoff_actors::system::build_rank
//! [`NixlTransport`]: kvhandoff_actors::transport::nixl::NixlTransport
//! [`Runtime`]: kvhandoff::Runtime
//! [`KvConnector`]: kvhandoff::KvConnector

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use crate::stats::{gbps, human_bytes, median, percentile};
use kvhandoff_protocol::planner::{fragmented_70b_case, PlanInput, Planner, FRAGMENTED_70B_BLOCKS};
use kvhandoff_protocol::{BlockIds, KvGeometry, KvLayout};
use serde::{Deserialize, Serialize};

/// The throughput target: kvhandoff end to end over raw NIXL on the same descriptors.
pub const TARGET_RATIO: f64 = 0.9;
/// The planning target for [`fragmented_70b_case`], µs.
pub const TARGET_PLAN_US: f64 = 100.0;
/// The least descriptors any valid plan of [`fragmented_70b_case`] has: 118 blocks × 160 regions.
pub const FRAGMENTED_70B_MIN_DESCRIPTORS: usize = FRAGMENTED_70B_BLOCKS as usize * 160;
/// How often the bench polls D's connector while it waits for `BlocksReady`, once
/// [`COARSE_FRACTION`] of the raw time has passed.
pub const DRIVER_POLL: Duration = Duration::from_micros(50);
/// How often it polls before that.
pub const COARSE_POLL: Duration = Duration::from_millis(1);
/// The share of the same repetition's raw NIXL time the driver polls coarsely through.
pub const COARSE_FRACTION: f64 = 0.8;

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
        if self.repeats == 0 || self.plan_repeats == 0 || self.notify_rounds == 0 {
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

/// The shape of the request moved.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestShape {
    /// Layers.
    pub num_layers: u32,
    /// KV heads.
    pub kv_heads: u32,
    /// Head dimension.
    pub head_dim: u32,
    /// Tokens per kernel block.
    pub block_tokens: u32,
    /// Logical blocks moved.
    pub blocks: u32,
    /// Regions per rank (K and V per layer).
    pub regions: usize,
    /// Bytes of one block in one region.
    pub block_bytes: u64,
    /// Bytes moved per request.
    pub request_bytes: u64,
    /// Blocks in each side's pool.
    pub pool_blocks: u32,
}

/// Raw NIXL on one block table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RawNumbers {
    /// Request bytes over the time to the target's notification, GB/s (median).
    pub gbps: f64,
    /// Request bytes over the time to the initiator's completion, GB/s (median).
    pub complete_gbps: f64,
    /// Building the two descriptor lists, µs (median).
    pub build_us: f64,
    /// Inside `create_xfer_req` + `post_xfer_req`, µs (median).
    pub post_us: f64,
    /// First list entry to the initiator's `Success`, µs (median).
    pub complete_us: f64,
    /// First list entry to the notification at the target, µs (median).
    pub total_us: f64,
    /// Repetitions whose post already finished the transfer.
    pub done_in_post: usize,
}

/// kvhandoff on one block table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PushNumbers {
    /// Request bytes over the handoff latency, GB/s (median).
    pub gbps: f64,
    /// Start of D's call to D's `BlocksReady`, µs: median.
    pub latency_p50_us: f64,
    /// The same, 99th percentile (nearest rank).
    pub latency_p99_us: f64,
    /// The same, fastest.
    pub latency_min_us: f64,
    /// D's `request_allocated` call itself, µs (median).
    pub d_call_us: f64,
    /// P's `request_finished` call itself, µs (median).
    pub p_call_us: f64,
}

/// One block table moved both ways.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TableNumbers {
    /// `contiguous` or `fragmented`.
    pub table: String,
    /// Descriptors the planner makes for it (and both paths post).
    pub descriptors: usize,
    /// Raw NIXL.
    pub raw: RawNumbers,
    /// kvhandoff end to end.
    pub kvhandoff: PushNumbers,
    /// `kvhandoff.gbps / raw.gbps`.
    pub ratio: f64,
    /// Median over the repetitions of raw time ÷ kvhandoff latency, each pair run back to back
    /// (less sensitive to slow drifts in machine load).
    pub paired_ratio: f64,
    /// Median kvhandoff latency minus median raw total, µs: what kvhandoff adds.
    pub overhead_us: f64,
}

/// The fragmented Llama-70B planning case.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Fragmented70b {
    /// Descriptors planned.
    pub descriptors: usize,
    /// The least any valid plan has (118 × 160).
    pub minimum: usize,
    /// One plan with a reused planner, µs (median).
    pub plan_us: f64,
    /// The same, 99th percentile.
    pub plan_us_p99: f64,
    /// Plans timed.
    pub plans: usize,
    /// Minimal, and the median under [`TARGET_PLAN_US`].
    pub met: bool,
}

/// The notification round trip with one agent setting.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NotifyPoint {
    /// Whether the agents run NIXL's progress thread.
    pub progress_thread: bool,
    /// `pthr_delay_us` (meaningless without the progress thread).
    pub pthr_delay_us: u64,
    /// Round trip A → B → A, µs: median.
    pub rtt_p50_us: f64,
    /// The same, 99th percentile.
    pub rtt_p99_us: f64,
    /// The same, fastest.
    pub rtt_min_us: f64,
    /// A 32 MiB single-descriptor WRITE with a notification, to the target's notification,
    /// GB/s (median of 5).
    pub write_32mib_gbps: f64,
    /// Round trips timed.
    pub rounds: usize,
}

/// What `bench transfer` measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TransferReport {
    /// One thread copying the request's bytes, GB/s (median).
    pub memcpy_gbps: f64,
    /// Raw NIXL on the headline table, GB/s.
    pub raw_nixl_gbps: f64,
    /// kvhandoff end to end on the headline table, GB/s.
    pub kvhandoff_gbps: f64,
    /// `kvhandoff_gbps / raw_nixl_gbps`.
    pub ratio: f64,
    /// Descriptors of the headline table.
    pub descriptors: usize,
    /// The headline table (`fragmented`: the realistic, harder one).
    pub headline_table: String,
    /// The lower ratio of the two tables.
    pub ratio_min: f64,
    /// [`TARGET_RATIO`].
    pub target_ratio: f64,
    /// Both tables at or above the target ratio.
    pub ratio_met: bool,
    /// Handoff latency of the headline table, µs: median.
    pub handoff_latency_p50_us: f64,
    /// The same, 99th percentile.
    pub handoff_latency_p99_us: f64,
    /// Raw create + post of the headline table, µs (median).
    pub raw_post_us: f64,
    /// Notification round trip with [`NixlConfig::default`]'s agent settings, µs (median).
    ///
    /// [`NixlConfig::default`]: kvhandoff_actors::transport::nixl::NixlConfig
    pub notification_rtt_us: f64,
    /// The planning case.
    pub fragmented_70b: Fragmented70b,
    /// The request moved.
    pub request: RequestShape,
    /// Timed repetitions per table and path.
    pub repeats: usize,
    /// The kvhandoff ranks' settings: progress thread, its delay, the writer's poll interval.
    pub progress_thread: bool,
    /// `pthr_delay_us` of both paths.
    pub pthr_delay_us: u64,
    /// The writer's transport poll interval, µs.
    pub writer_poll_us: f64,
    /// Per table.
    pub tables: Vec<TableNumbers>,
    /// The notification round trip per agent setting.
    pub notification_sweep: Vec<NotifyPoint>,
}

impl TransferReport {
    /// The report as a table for people.
    pub fn render_table(&self) -> String {
        let r = &self.request;
        let mut out = format!(
            "kvhandoff bench transfer: {} blocks x {} regions x {} = {} per request, \
             {} repetitions (medians)\n",
            r.blocks,
            r.regions,
            human_bytes(r.block_bytes),
            human_bytes(r.request_bytes),
            self.repeats
        );
        let _ = writeln!(
            out,
            "  {:<12} {:>6} {:>9} {:>9} {:>10} {:>7} {:>7} {:>11} {:>11} {:>11}",
            "table",
            "descs",
            "raw GB/s",
            "kvh GB/s",
            "kvh/raw",
            "paired",
            "post ms",
            "raw ms",
            "kvh p50 ms",
            "kvh p99 ms"
        );
        for t in &self.tables {
            let _ = writeln!(
                out,
                "  {:<12} {:>6} {:>9.2} {:>9.2} {:>10.3} {:>7.3} {:>7.2} {:>11.2} {:>11.2} {:>11.2}",
                t.table,
                t.descriptors,
                t.raw.gbps,
                t.kvhandoff.gbps,
                t.ratio,
                t.paired_ratio,
                t.raw.post_us / 1e3,
                t.raw.total_us / 1e3,
                t.kvhandoff.latency_p50_us / 1e3,
                t.kvhandoff.latency_p99_us / 1e3,
            );
        }
        let verdict = |met: bool| if met { "met" } else { "NOT met" };
        let _ = writeln!(
            out,
            "  memcpy (one thread)       {:>8.2} GB/s",
            self.memcpy_gbps
        );
        let _ = writeln!(
            out,
            "  kvhandoff / raw NIXL      {:>8.3} ({} table; lowest {:.3}; target >= {:.2}: {})",
            self.ratio,
            self.headline_table,
            self.ratio_min,
            self.target_ratio,
            verdict(self.ratio_met)
        );
        let f = &self.fragmented_70b;
        let _ = writeln!(
            out,
            "  fragmented 70B plan       {:>8.1} us median, p99 {:.1} us, {} descriptors \
             (minimum {}; target < {TARGET_PLAN_US} us: {})",
            f.plan_us,
            f.plan_us_p99,
            f.descriptors,
            f.minimum,
            verdict(f.met)
        );
        let _ = writeln!(
            out,
            "  notification round trip  {:>8.1} us (progress thread {}, pthr_delay_us {}; \
             writer polls every {:.0} us)",
            self.notification_rtt_us,
            if self.progress_thread { "on" } else { "off" },
            self.pthr_delay_us,
            self.writer_poll_us
        );
        if !self.notification_sweep.is_empty() {
            let _ = writeln!(
                out,
                "  {:<28} {:>10} {:>10} {:>10} {:>14}",
                "agent setting", "rtt p50 us", "p99 us", "min us", "32 MiB GB/s"
            );
            for p in &self.notification_sweep {
                let setting = if p.progress_thread {
                    format!("progress thread, delay {}", p.pthr_delay_us)
                } else {
                    "no progress thread, polling".to_string()
                };
                let _ = writeln!(
                    out,
                    "  {:<28} {:>10.1} {:>10.1} {:>10.1} {:>14.2}",
                    setting, p.rtt_p50_us, p.rtt_p99_us, p.rtt_min_us, p.write_32mib_gbps
                );
            }
        }
        out
    }
}

// ---------------------------------------------------------------------------------------------
// Geometry and block tables.

/// The geometry of the request (TP 1, bf16, 16-token kernel blocks, NHD, one full-attention
/// group).
pub fn bench_geometry(options: &TransferOptions) -> KvGeometry {
    KvGeometry::dense(
        options.num_layers,
        options.kv_heads,
        options.head_dim,
        2,
        BLOCK_TOKENS,
        KvLayout::Nhd,
    )
}

/// One block table: P's (local) and D's (remote) ids in token order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockTable {
    /// `contiguous` or `fragmented`.
    pub name: &'static str,
    /// P's blocks.
    pub local: BlockIds,
    /// D's blocks.
    pub remote: BlockIds,
}

/// The two block tables of `blocks` blocks, and the pool size (`2 × blocks`) they fit in.
///
/// ```
/// use kvhandoff_cli::bench::transfer::block_tables;
/// let (pool, [contiguous, fragmented]) = block_tables(4);
/// assert_eq!(pool, 8);
/// assert_eq!(contiguous.local.groups[0], [0, 1, 2, 3]);
/// assert_eq!(contiguous.remote.groups[0], [4, 5, 6, 7]);
/// assert_eq!(fragmented.local.groups[0], [1, 3, 5, 7]);
/// assert!(fragmented.remote.groups[0].iter().all(|b| b % 2 == 0));
/// ```
pub fn block_tables(blocks: u32) -> (u32, [BlockTable; 2]) {
    let n = blocks;
    let contiguous = BlockTable {
        name: "contiguous",
        local: BlockIds::single_group((0..n).collect()),
        remote: BlockIds::single_group((n..2 * n).collect()),
    };
    // Odd ids locally; even ids remotely, visited by a permutation `i -> (i * a + c) mod n` with
    // `a` coprime to `n`. No two ids of a side are adjacent, so no run merges.
    let a = (n / 2..n.max(2))
        .map(|a| a | 1)
        .find(|&a| gcd(a, n) == 1)
        .unwrap_or(1);
    let c = n / 3;
    let fragmented = BlockTable {
        name: "fragmented",
        local: BlockIds::single_group((0..n).map(|i| 2 * i + 1).collect()),
        remote: BlockIds::single_group(
            (0..n)
                .map(|i| 2 * ((u64::from(i) * u64::from(a) + u64::from(c)) % u64::from(n)) as u32)
                .collect(),
        ),
    };
    (2 * n, [contiguous, fragmented])
}

fn gcd(mut a: u32, mut b: u32) -> u32 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

// ---------------------------------------------------------------------------------------------
// Statistics.

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

// ---------------------------------------------------------------------------------------------
// memcpy and planning (no NIXL).

/// One thread copying `bytes` between two buffers: GB/s, median of `repeats` after one warm-up.
pub fn memcpy_gbps(bytes: u64, repeats: usize) -> f64 {
    let len = usize::try_from(bytes).unwrap_or(usize::MAX);
    let src = vec![0x5au8; len];
    let mut dst = vec![0u8; len];
    dst.copy_from_slice(&src);
    let mut samples = Vec::with_capacity(repeats);
    for _ in 0..repeats.max(1) {
        let start = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        samples.push(gbps(bytes, us(start.elapsed())));
    }
    median(&samples)
}

/// Plans [`fragmented_70b_case`] `plans` times with one reused [`Planner`].
///
/// # Errors
/// [`TransferBenchError::Run`] if the case does not plan (a bug).
pub fn plan_fragmented_70b(plans: usize) -> Result<Fragmented70b, TransferBenchError> {
    let (geometry, local, remote, p, d) = fragmented_70b_case();
    let specs = geometry
        .regions()
        .map_err(|e| TransferBenchError::Run(e.to_string()))?;
    let input = PlanInput::new(
        &local,
        &remote,
        &specs,
        &p,
        &d,
        geometry.kernel_blocks_per_logical,
    );
    let mut planner = Planner::new();
    let mut out = Vec::new();
    let mut plan = |out: &mut Vec<_>| {
        planner
            .plan_into(&input, out)
            .map_err(|e| TransferBenchError::Run(format!("the 70B case does not plan: {e}")))
    };
    // Warm-up: sizes the planner's buffers and the output once.
    plan(&mut out)?;
    let mut samples = Vec::with_capacity(plans);
    let mut descriptors = 0;
    for _ in 0..plans.max(1) {
        let start = Instant::now();
        let summary = plan(&mut out)?;
        samples.push(us(start.elapsed()));
        descriptors = std::hint::black_box(summary.descriptors);
    }
    let plan_us = median(&samples);
    Ok(Fragmented70b {
        descriptors,
        minimum: FRAGMENTED_70B_MIN_DESCRIPTORS,
        plan_us,
        plan_us_p99: percentile(&samples, 99.0),
        plans: samples.len(),
        met: descriptors == FRAGMENTED_70B_MIN_DESCRIPTORS && plan_us < TARGET_PLAN_US,
    })
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

#[cfg(feature = "nixl")]
mod live {
    //! The parts that need the NIXL runtime.

    use std::thread;
    use std::time::{Duration, Instant};

    use kvhandoff_actors::system::{
        agent_name, build_rank, KvPool, RankOptions, RegionBytes, ShellConfig,
    };
    use kvhandoff_actors::transport::nixl::{
        nixl_runtime_available, HostBuffer, NixlConfig, NixlTransport,
    };
    use kvhandoff_protocol::machine::Config;
    use kvhandoff_protocol::planner::{Descriptor, PlanInput, Planner};
    use kvhandoff_protocol::{BlockIds, EngineId, KvGeometry, RegionDesc, RegionSpec, RequestId};
    use nixl_sys::{
        Agent, AgentConfig, Backend, MemType, NixlError, NotificationMap, OptArgs,
        RegistrationHandle, XferDescList, XferOp, XferStatus,
    };

    use crate::stats::min;

    use super::{
        block_tables, gbps, median, memcpy_gbps, percentile, plan_fragmented_70b, us, BlockTable,
        NotifyPoint, PushNumbers, RawNumbers, RequestShape, TableNumbers, TransferBenchError,
        TransferOptions, TransferReport, BLOCK_TOKENS, COARSE_FRACTION, COARSE_POLL, DRIVER_POLL,
        TARGET_RATIO,
    };
    use crate::demo::{self, DECODE_ENGINE, PREFILL_ENGINE};
    use kvhandoff::{ConnectorEvent, KvConnector, KvTransferParams, Runtime};

    fn nixl(what: &str) -> impl Fn(NixlError) -> TransferBenchError + '_ {
        move |e| TransferBenchError::Nixl(format!("{what}: {e}"))
    }

    fn run_error(why: impl Into<String>) -> TransferBenchError {
        TransferBenchError::Run(why.into())
    }

    pub(super) fn run(options: &TransferOptions) -> Result<TransferReport, TransferBenchError> {
        nixl_runtime_available().map_err(|e| TransferBenchError::Nixl(e.to_string()))?;
        let geometry = super::bench_geometry(options);
        geometry
            .validate()
            .map_err(|e| TransferBenchError::Options(e.to_string()))?;
        let specs = geometry
            .regions()
            .map_err(|e| TransferBenchError::Options(e.to_string()))?;
        let block_bytes = specs[0].block_len;
        let blocks = options.blocks();
        let (pool_blocks, tables) = block_tables(blocks);
        let request_bytes = block_bytes * u64::from(blocks) * specs.len() as u64;
        let shape = RequestShape {
            num_layers: options.num_layers,
            kv_heads: options.kv_heads,
            head_dim: options.head_dim,
            block_tokens: BLOCK_TOKENS,
            blocks,
            regions: specs.len(),
            block_bytes,
            request_bytes,
            pool_blocks,
        };
        let nixl_config = NixlConfig::default();
        let shell = ShellConfig::default();

        let fragmented_70b = plan_fragmented_70b(options.plan_repeats)?;
        let memcpy = memcpy_gbps(request_bytes, options.repeats.clamp(3, 10));

        let agent_config = AgentConfig {
            enable_prog_thread: nixl_config.progress_thread,
            pthr_delay_us: nixl_config.pthr_delay_us,
            ..AgentConfig::default()
        };
        let mut raw = RawPair::new(&agent_config, &specs, pool_blocks, "bench-raw")?;
        let mut push = Push::new(&geometry, pool_blocks, nixl_config.clone(), shell.clone())?;
        // Real bytes in every source page (untouched pages would all read the shared zero page).
        let region_len = block_bytes * u64::from(pool_blocks);
        fill(&raw.p.byte_regions(), region_len)?;
        fill(&pool_regions(&push.p_pool), region_len)?;

        let mut numbers = Vec::new();
        for table in &tables {
            numbers.push(run_table(
                options,
                &geometry,
                &specs,
                table,
                request_bytes,
                &mut raw,
                &mut push,
            )?);
        }
        push.shutdown();
        drop(raw);

        let notification_sweep = notification_sweep(options, &nixl_config)?;
        let notification_rtt_us = notification_sweep
            .iter()
            .find(|p| {
                p.progress_thread == nixl_config.progress_thread
                    && p.pthr_delay_us == nixl_config.pthr_delay_us
            })
            .map_or(0.0, |p| p.rtt_p50_us);

        let headline = numbers
            .iter()
            .find(|t| t.table == "fragmented")
            .or(numbers.first())
            .cloned()
            .ok_or_else(|| run_error("no table ran"))?;
        let ratio_min = numbers
            .iter()
            .map(|t| t.ratio)
            .fold(f64::INFINITY, f64::min);
        Ok(TransferReport {
            memcpy_gbps: memcpy,
            raw_nixl_gbps: headline.raw.gbps,
            kvhandoff_gbps: headline.kvhandoff.gbps,
            ratio: headline.ratio,
            descriptors: headline.descriptors,
            headline_table: headline.table.clone(),
            ratio_min,
            target_ratio: TARGET_RATIO,
            ratio_met: ratio_min >= TARGET_RATIO,
            handoff_latency_p50_us: headline.kvhandoff.latency_p50_us,
            handoff_latency_p99_us: headline.kvhandoff.latency_p99_us,
            raw_post_us: headline.raw.post_us,
            notification_rtt_us,
            fragmented_70b,
            request: shape,
            repeats: options.repeats,
            progress_thread: nixl_config.progress_thread,
            pthr_delay_us: nixl_config.pthr_delay_us,
            writer_poll_us: us(shell.poll_interval),
            tables: numbers,
            notification_sweep,
        })
    }

    /// One table: planner count, then warm-ups, then alternating raw and kvhandoff repetitions.
    fn run_table(
        options: &TransferOptions,
        geometry: &KvGeometry,
        specs: &[RegionSpec],
        table: &BlockTable,
        request_bytes: u64,
        raw: &mut RawPair,
        push: &mut Push,
    ) -> Result<TableNumbers, TransferBenchError> {
        let kbpl = geometry.kernel_blocks_per_logical;
        let mut planner = Planner::new();
        let plan = |planner: &mut Planner, local: &[RegionDesc], remote: &[RegionDesc]| {
            let input = PlanInput::new(local, remote, specs, &table.local, &table.remote, kbpl);
            planner
                .plan(&input)
                .map_err(|e| run_error(format!("{} table does not plan: {e}", table.name)))
        };
        let raw_plan = plan(&mut planner, &raw.p.regions, &raw.d.regions)?;
        // What the P rank's writer plans: its own regions against the ones D advertised.
        let push_count = plan(&mut planner, &push.p_regions, &push.d_regions)?.descriptor_count();
        if raw_plan.descriptor_count() != push_count || raw_plan.bytes != request_bytes {
            return Err(run_error(format!(
                "{}: raw plans {} descriptors / {} bytes, kvhandoff {push_count} descriptors",
                table.name,
                raw_plan.descriptor_count(),
                raw_plan.bytes
            )));
        }
        let block_bytes = specs[0].block_len * u64::from(kbpl);
        let local = table.local.groups.first().cloned().unwrap_or_default();
        let remote = table.remote.groups.first().cloned().unwrap_or_default();
        raw.p.stamp(block_bytes, &local)?;
        push.stamp_source(block_bytes, &local)?;

        let mut raw_samples = Vec::new();
        let mut push_samples = Vec::new();
        for rep in 0..=options.repeats {
            let raw_sample = raw.once(
                &raw_plan.descriptors,
                format!("{}-{rep}", table.name).as_bytes(),
                block_bytes,
                (&local, &remote),
                options.timeout,
            )?;
            // The driver sleeps coarsely through most of the expected transfer time (the raw
            // total just measured), then polls finely: a tight poll loop would take a core from
            // the transfer on a small machine.
            let coarse = Duration::from_secs_f64(raw_sample.total_us * COARSE_FRACTION / 1e6);
            let push_sample = push.once(
                table,
                rep,
                block_bytes,
                (&local, &remote),
                coarse,
                options.timeout,
            )?;
            // Repetition 0 is the warm-up (connections, first touch of the pages).
            if rep > 0 {
                raw_samples.push(raw_sample);
                push_samples.push(push_sample);
            }
        }
        let col = |f: fn(&RawSample) -> f64| raw_samples.iter().map(f).collect::<Vec<f64>>();
        let total = col(|s| s.total_us);
        let complete = col(|s| s.complete_us);
        let raw_numbers = RawNumbers {
            gbps: median(
                &total
                    .iter()
                    .map(|&t| gbps(request_bytes, t))
                    .collect::<Vec<_>>(),
            ),
            complete_gbps: median(
                &complete
                    .iter()
                    .map(|&t| gbps(request_bytes, t))
                    .collect::<Vec<_>>(),
            ),
            build_us: median(&col(|s| s.build_us)),
            post_us: median(&col(|s| s.post_us)),
            complete_us: median(&complete),
            total_us: median(&total),
            done_in_post: raw_samples.iter().filter(|s| s.done_in_post).count(),
        };
        let latency: Vec<f64> = push_samples.iter().map(|s| s.latency_us).collect();
        let push_numbers = PushNumbers {
            gbps: median(
                &latency
                    .iter()
                    .map(|&t| gbps(request_bytes, t))
                    .collect::<Vec<_>>(),
            ),
            latency_p50_us: median(&latency),
            latency_p99_us: percentile(&latency, 99.0),
            latency_min_us: min(&latency),
            d_call_us: median(&push_samples.iter().map(|s| s.d_call_us).collect::<Vec<_>>()),
            p_call_us: median(&push_samples.iter().map(|s| s.p_call_us).collect::<Vec<_>>()),
        };
        let ratio = if raw_numbers.gbps > 0.0 {
            push_numbers.gbps / raw_numbers.gbps
        } else {
            0.0
        };
        let paired: Vec<f64> = raw_samples
            .iter()
            .zip(&push_samples)
            .map(|(r, p)| r.total_us / p.latency_us.max(f64::MIN_POSITIVE))
            .collect();
        Ok(TableNumbers {
            table: table.name.to_string(),
            paired_ratio: median(&paired),
            descriptors: push_count,
            overhead_us: push_numbers.latency_p50_us - raw_numbers.total_us,
            raw: raw_numbers,
            kvhandoff: push_numbers,
            ratio,
        })
    }

    // -----------------------------------------------------------------------------------------
    // Stamps: proof that every block landed where the table says.

    fn tag(region: usize, block: u32) -> [u8; 8] {
        (((region as u64) << 32 | u64::from(block)) ^ 0x6b76_6861_6e64_6f66).to_le_bytes()
    }

    fn ends(block: u32, block_bytes: u64) -> [u64; 2] {
        let start = u64::from(block) * block_bytes;
        [start, start + block_bytes - 8]
    }

    /// Writes a non-zero pattern over the first `len` bytes of every region.
    fn fill(regions: &[&dyn RegionBytes], len: u64) -> Result<(), TransferBenchError> {
        const CHUNK: u64 = 1 << 20;
        for (r, region) in regions.iter().enumerate() {
            let pattern: Vec<u8> = (0..CHUNK)
                .map(|i| (i as u8).wrapping_mul(31) ^ (r as u8) ^ 0xa5)
                .collect();
            let mut at = 0;
            while at < len {
                let n = (len - at).min(CHUNK);
                region
                    .write(at, &pattern[..n as usize])
                    .map_err(|e| run_error(format!("fill: {e}")))?;
                at += n;
            }
        }
        Ok(())
    }

    fn stamp(
        regions: &[&dyn RegionBytes],
        block_bytes: u64,
        blocks: &[u32],
    ) -> Result<(), TransferBenchError> {
        for (r, region) in regions.iter().enumerate() {
            for &b in blocks {
                for at in ends(b, block_bytes) {
                    region
                        .write(at, &tag(r, b))
                        .map_err(|e| run_error(format!("stamp: {e}")))?;
                }
            }
        }
        Ok(())
    }

    fn clear(
        regions: &[&dyn RegionBytes],
        block_bytes: u64,
        blocks: &[u32],
    ) -> Result<(), TransferBenchError> {
        for region in regions {
            for &b in blocks {
                for at in ends(b, block_bytes) {
                    region
                        .write(at, &[0; 8])
                        .map_err(|e| run_error(format!("clear: {e}")))?;
                }
            }
        }
        Ok(())
    }

    fn check(
        what: &str,
        regions: &[&dyn RegionBytes],
        block_bytes: u64,
        (local, remote): (&[u32], &[u32]),
    ) -> Result<(), TransferBenchError> {
        let mut buf = [0u8; 8];
        for (r, region) in regions.iter().enumerate() {
            for (&l, &d) in local.iter().zip(remote) {
                for at in ends(d, block_bytes) {
                    region
                        .read(at, &mut buf)
                        .map_err(|e| run_error(format!("check: {e}")))?;
                    if buf != tag(r, l) {
                        return Err(run_error(format!(
                            "{what}: region {r} block {d} does not hold P's block {l}"
                        )));
                    }
                }
            }
        }
        Ok(())
    }

    // -----------------------------------------------------------------------------------------
    // Raw NIXL.

    /// One raw agent with its memory. Fields drop in order: registrations, arguments, backend,
    /// agent, and the memory last (after the agent and its UCX workers are gone).
    struct RawSide {
        handles: Vec<RegistrationHandle>,
        args: OptArgs,
        notifs: NotificationMap,
        _backend: Backend,
        agent: Agent,
        buffers: Vec<HostBuffer>,
        regions: Vec<RegionDesc>,
        name: String,
    }

    impl RawSide {
        fn new(
            name: &str,
            config: &AgentConfig,
            region_lens: &[(u64, u32)],
        ) -> Result<Self, TransferBenchError> {
            let agent = Agent::new_configured(name, config).map_err(nixl("create agent"))?;
            let (_mems, params) = agent.get_plugin_params("UCX").map_err(nixl(
                "UCX plugin parameters (is NIXL_PLUGIN_DIR set? source scripts/nixl-env.sh)",
            ))?;
            let backend = agent
                .create_backend("UCX", &params)
                .map_err(nixl("create UCX backend"))?;
            let mut args = OptArgs::new().map_err(nixl("opt args"))?;
            args.add_backend(&backend)
                .map_err(nixl("opt args: backend"))?;
            let mut side = RawSide {
                handles: Vec::new(),
                args,
                notifs: NotificationMap::new().map_err(nixl("notification map"))?,
                _backend: backend,
                agent,
                buffers: Vec::new(),
                regions: Vec::new(),
                name: name.to_string(),
            };
            for &(len, num_blocks) in region_lens {
                let buffer =
                    HostBuffer::new(len).map_err(|e| TransferBenchError::Nixl(e.to_string()))?;
                let handle = side
                    .agent
                    .register_memory(&buffer, Some(&side.args))
                    .map_err(nixl("register_memory"))?;
                side.regions.push(RegionDesc {
                    base: buffer.base(),
                    len,
                    num_blocks,
                    block_len: len / u64::from(num_blocks.max(1)),
                });
                side.handles.push(handle);
                side.buffers.push(buffer);
            }
            Ok(side)
        }

        fn byte_regions(&self) -> Vec<&dyn RegionBytes> {
            self.buffers.iter().map(|b| b as &dyn RegionBytes).collect()
        }

        fn stamp(&self, block_bytes: u64, blocks: &[u32]) -> Result<(), TransferBenchError> {
            stamp(&self.byte_regions(), block_bytes, blocks)
        }

        /// Polls for notifications; true when one equal to `expected` arrived.
        fn received(&mut self, expected: &[u8]) -> Result<bool, TransferBenchError> {
            self.agent
                .get_notifications(&mut self.notifs, None)
                .map_err(nixl("get_notifications"))?;
            if self.notifs.is_empty().unwrap_or(true) {
                return Ok(false);
            }
            let mut found = false;
            let senders: Vec<String> = self
                .notifs
                .agents()
                .filter_map(|a| a.ok().map(str::to_owned))
                .collect();
            for sender in senders {
                let count = self.notifs.get_notifications_size(&sender).unwrap_or(0);
                for index in 0..count {
                    if let Ok(bytes) = self.notifs.get_notification_bytes(&sender, index) {
                        found |= bytes == expected;
                    }
                }
            }
            // NIXL appends to the map; start a fresh one (as `NixlTransport` does).
            self.notifs = NotificationMap::new().map_err(nixl("notification map"))?;
            Ok(found)
        }
    }

    fn connect(a: &RawSide, b: &RawSide) -> Result<(), TransferBenchError> {
        let md_a = a.agent.get_local_md().map_err(nixl("get_local_md"))?;
        let md_b = b.agent.get_local_md().map_err(nixl("get_local_md"))?;
        b.agent
            .load_remote_md(&md_a)
            .map_err(nixl("load_remote_md"))?;
        a.agent
            .load_remote_md(&md_b)
            .map_err(nixl("load_remote_md"))?;
        Ok(())
    }

    struct RawSample {
        build_us: f64,
        post_us: f64,
        complete_us: f64,
        total_us: f64,
        done_in_post: bool,
    }

    struct RawPair {
        p: RawSide,
        d: RawSide,
    }

    impl RawPair {
        fn new(
            config: &AgentConfig,
            specs: &[RegionSpec],
            pool_blocks: u32,
            prefix: &str,
        ) -> Result<Self, TransferBenchError> {
            let lens: Vec<(u64, u32)> = specs
                .iter()
                .map(|s| (s.block_len * u64::from(pool_blocks), pool_blocks))
                .collect();
            let p = RawSide::new(&format!("{prefix}-prefill"), config, &lens)?;
            let d = RawSide::new(&format!("{prefix}-decode"), config, &lens)?;
            connect(&p, &d)?;
            Ok(RawPair { p, d })
        }

        /// One WRITE of `descriptors` from P to D with notification `note`; waits for P's
        /// completion and D's notification, polling both (so it also works without a progress
        /// thread), and checks the stamps.
        fn once(
            &mut self,
            descriptors: &[Descriptor],
            note: &[u8],
            block_bytes: u64,
            tables: (&[u32], &[u32]),
            timeout: Duration,
        ) -> Result<RawSample, TransferBenchError> {
            clear(&self.d.byte_regions(), block_bytes, tables.1)?;
            let sample = self.write(descriptors, note, timeout)?;
            check("raw NIXL", &self.d.byte_regions(), block_bytes, tables)?;
            Ok(sample)
        }

        fn write(
            &mut self,
            descriptors: &[Descriptor],
            note: &[u8],
            timeout: Duration,
        ) -> Result<RawSample, TransferBenchError> {
            let start = Instant::now();
            let mut local = XferDescList::new(MemType::Dram).map_err(nixl("descriptor list"))?;
            let mut remote = XferDescList::new(MemType::Dram).map_err(nixl("descriptor list"))?;
            for d in descriptors {
                local.add_desc(d.local_addr as usize, d.len as usize, 0);
                remote.add_desc(d.remote_addr as usize, d.len as usize, 0);
            }
            self.p
                .args
                .set_has_notification(true)
                .map_err(nixl("opt args"))?;
            self.p
                .args
                .set_notification_message(note)
                .map_err(nixl("opt args"))?;
            let built = Instant::now();
            let req = self
                .p
                .agent
                .create_xfer_req(
                    XferOp::Write,
                    &local,
                    &remote,
                    &self.d.name,
                    Some(&self.p.args),
                )
                .map_err(nixl("create_xfer_req"))?;
            let in_progress = self
                .p
                .agent
                .post_xfer_req(&req, None)
                .map_err(nixl("post_xfer_req"))?;
            let posted = Instant::now();
            let mut complete = (!in_progress).then_some(posted);
            let mut notified = None;
            let deadline = start + timeout;
            while complete.is_none() || notified.is_none() {
                if complete.is_none() {
                    match self
                        .p
                        .agent
                        .get_xfer_status(&req)
                        .map_err(nixl("get_xfer_status"))?
                    {
                        XferStatus::Success => complete = Some(Instant::now()),
                        XferStatus::InProgress => {}
                    }
                }
                if notified.is_none() && self.d.received(note)? {
                    notified = Some(Instant::now());
                }
                if Instant::now() > deadline {
                    return Err(run_error(format!(
                        "raw WRITE of {} descriptors: no completion/notification in {timeout:?}",
                        descriptors.len()
                    )));
                }
                thread::yield_now();
            }
            drop(req);
            let (complete, notified) = (complete.unwrap_or(posted), notified.unwrap_or(posted));
            Ok(RawSample {
                build_us: us(built - start),
                post_us: us(posted - built),
                complete_us: us(complete - start),
                total_us: us(notified - start),
                done_in_post: !in_progress,
            })
        }
    }

    // -----------------------------------------------------------------------------------------
    // kvhandoff end to end.

    struct PushSample {
        latency_us: f64,
        d_call_us: f64,
        p_call_us: f64,
    }

    struct Push {
        p_conn: KvConnector,
        d_conn: KvConnector,
        p_pool: KvPool,
        d_pool: KvPool,
        p_regions: Vec<RegionDesc>,
        d_regions: Vec<RegionDesc>,
        runtime: Option<Runtime>,
    }

    fn pool_regions(pool: &KvPool) -> Vec<&dyn RegionBytes> {
        pool.regions().map(|(_, bytes)| bytes).collect()
    }

    impl Push {
        fn new(
            geometry: &KvGeometry,
            pool_blocks: u32,
            nixl_config: NixlConfig,
            shell: ShellConfig,
        ) -> Result<Self, TransferBenchError> {
            let options =
                |e: kvhandoff_protocol::IdError| TransferBenchError::Options(e.to_string());
            let build = |engine: &str| {
                let engine = EngineId::new(engine).map_err(options)?;
                let name = agent_name(&engine, geometry.tp_rank).map_err(options)?;
                let transport = NixlTransport::new(name, nixl_config.clone())
                    .map_err(|e| TransferBenchError::Nixl(e.to_string()))?;
                build_rank(
                    transport,
                    &engine,
                    geometry.clone(),
                    &demo::model(),
                    pool_blocks,
                    Config::default(),
                    shell.clone(),
                )
                .map_err(|e| TransferBenchError::Nixl(format!("build a rank: {e}")))
            };
            let (p_setup, p_pool) = build(PREFILL_ENGINE)?;
            let (d_setup, d_pool) = build(DECODE_ENGINE)?;
            let p_regions = p_setup.info.regions.clone();
            let d_regions = d_setup.info.regions.clone();
            let mut runtime = Runtime::start().map_err(|e| run_error(e.to_string()))?;
            let p_handle = runtime
                .add_rank(p_setup, RankOptions::default())
                .map_err(|e| run_error(e.to_string()))?;
            let d_handle = runtime
                .add_rank(d_setup, RankOptions::default())
                .map_err(|e| run_error(e.to_string()))?;
            let ident = |engine| demo::identity(engine).map_err(|e| run_error(e.to_string()));
            Ok(Push {
                p_conn: KvConnector::new(ident(PREFILL_ENGINE)?, p_handle),
                d_conn: KvConnector::new(ident(DECODE_ENGINE)?, d_handle),
                p_pool,
                d_pool,
                p_regions,
                d_regions,
                runtime: Some(runtime),
            })
        }

        fn stamp_source(&self, block_bytes: u64, blocks: &[u32]) -> Result<(), TransferBenchError> {
            stamp(&pool_regions(&self.p_pool), block_bytes, blocks)
        }

        /// One request: P finishes, D allocates; waits for D's `BlocksReady` and P's
        /// `BlocksFree`; checks the stamps.
        fn once(
            &mut self,
            table: &BlockTable,
            rep: usize,
            block_bytes: u64,
            tables: (&[u32], &[u32]),
            coarse: Duration,
            timeout: Duration,
        ) -> Result<PushSample, TransferBenchError> {
            let d_regions = pool_regions(&self.d_pool);
            clear(&d_regions, block_bytes, tables.1)?;
            // vLLM-like ids: one base, a random-looking 8-hex suffix per engine.
            let base = format!("cmpl-bench-{}-{rep:06}-0", table.name);
            let id = |suffix: u32| {
                RequestId::new(format!("{base}-{suffix:08x}"))
                    .map_err(|e| TransferBenchError::Options(e.to_string()))
            };
            let (p_id, d_id) = (id(0x9e37_79b9)?, id(0x7f4a_7c15)?);
            let tokens = table.local.total() as u64 * u64::from(BLOCK_TOKENS);
            let connector = |e: kvhandoff::ConnectorError| run_error(format!("connector: {e}"));

            let p_start = Instant::now();
            let params = self
                .p_conn
                .request_finished(&p_id, table.local.clone(), &KvTransferParams::default())
                .map_err(connector)?;
            let d_start = Instant::now();
            self.d_conn
                .request_allocated(&d_id, table.remote.clone(), tokens, &params)
                .map_err(connector)?;
            let d_returned = Instant::now();
            let deadline = d_start + timeout;
            let ready = wait_for(
                &mut self.d_conn,
                d_start + coarse,
                deadline,
                |event| match event {
                    ConnectorEvent::BlocksReady { request, blocks } if *request == d_id => {
                        Some(check_blocks(blocks, &table.remote))
                    }
                    _ => Some(Err(format!("D: unexpected event {event:?}"))),
                },
            )?;
            wait_for(&mut self.p_conn, ready, deadline, |event| match event {
                ConnectorEvent::BlocksFree {
                    request,
                    released: None,
                    blocks,
                } if *request == p_id => Some(check_blocks(blocks, &table.local)),
                _ => Some(Err(format!("P: unexpected event {event:?}"))),
            })?;
            check("kvhandoff", &d_regions, block_bytes, tables)?;
            Ok(PushSample {
                latency_us: us(ready - d_start),
                d_call_us: us(d_returned - d_start),
                p_call_us: us(d_start - p_start),
            })
        }

        fn shutdown(&mut self) {
            if let Some(runtime) = self.runtime.take() {
                runtime.shutdown();
            }
        }
    }

    fn check_blocks(got: &BlockIds, want: &BlockIds) -> Result<(), String> {
        if got == want {
            Ok(())
        } else {
            Err(format!("blocks {got:?} returned, {want:?} expected"))
        }
    }

    /// Polls `conn` every [`COARSE_POLL`] until `coarse_until`, then every [`DRIVER_POLL`], until
    /// `accept` settles an event; returns when it was seen.
    fn wait_for(
        conn: &mut KvConnector,
        coarse_until: Instant,
        deadline: Instant,
        accept: impl Fn(&ConnectorEvent) -> Option<Result<(), String>>,
    ) -> Result<Instant, TransferBenchError> {
        loop {
            let events = conn.poll_events();
            let now = Instant::now();
            for event in &events {
                match accept(event) {
                    Some(Ok(())) => return Ok(now),
                    Some(Err(why)) => return Err(run_error(why)),
                    None => {}
                }
            }
            if now > deadline {
                return Err(run_error("no event before the deadline"));
            }
            thread::sleep(if now < coarse_until {
                COARSE_POLL
            } else {
                DRIVER_POLL
            });
        }
    }

    impl Drop for Push {
        fn drop(&mut self) {
            self.shutdown();
        }
    }

    // -----------------------------------------------------------------------------------------
    // Notifications.

    /// The agent settings measured: the progress thread with `pthr_delay_us` 0 (the crate
    /// default), 1, 10 and 100, and without it; only the default one unless `notify_sweep`.
    fn notification_sweep(
        options: &TransferOptions,
        default: &NixlConfig,
    ) -> Result<Vec<NotifyPoint>, TransferBenchError> {
        let settings: Vec<(bool, u64)> = if options.notify_sweep {
            vec![(true, 0), (true, 1), (true, 10), (true, 100), (false, 0)]
        } else {
            vec![(default.progress_thread, default.pthr_delay_us)]
        };
        settings
            .into_iter()
            .enumerate()
            .map(|(k, (on, delay))| notify_point(options, k, on, delay))
            .collect()
    }

    fn notify_point(
        options: &TransferOptions,
        k: usize,
        progress_thread: bool,
        pthr_delay_us: u64,
    ) -> Result<NotifyPoint, TransferBenchError> {
        let config = AgentConfig {
            enable_prog_thread: progress_thread,
            pthr_delay_us,
            ..AgentConfig::default()
        };
        // One 32 MiB region per side (smaller for tiny runs), for the single-descriptor WRITE.
        let len: u64 = if options.notify_sweep {
            32 << 20
        } else {
            1 << 20
        };
        let mut pair = {
            let p = RawSide::new(&format!("bench-rtt{k}-a"), &config, &[(len, 1)])?;
            let d = RawSide::new(&format!("bench-rtt{k}-b"), &config, &[(len, 1)])?;
            connect(&p, &d)?;
            RawPair { p, d }
        };
        let mut rtt = Vec::with_capacity(options.notify_rounds);
        let warmup = 10;
        for round in 0..warmup + options.notify_rounds {
            let sample = round_trip(&mut pair, round, options.timeout)?;
            if round >= warmup {
                rtt.push(sample);
            }
        }
        let descriptor = [Descriptor {
            local_addr: pair.p.regions[0].base,
            remote_addr: pair.d.regions[0].base,
            len,
        }];
        let mut write = Vec::new();
        for rep in 0..6 {
            let sample = pair.write(&descriptor, format!("w{rep}").as_bytes(), options.timeout)?;
            if rep > 0 {
                write.push(gbps(len, sample.total_us));
            }
        }
        Ok(NotifyPoint {
            progress_thread,
            pthr_delay_us,
            rtt_p50_us: median(&rtt),
            rtt_p99_us: percentile(&rtt, 99.0),
            rtt_min_us: min(&rtt),
            write_32mib_gbps: median(&write),
            rounds: rtt.len(),
        })
    }

    /// A → B, then B → A, each side polling both agents (`yield_now` between polls); µs.
    fn round_trip(
        pair: &mut RawPair,
        round: usize,
        timeout: Duration,
    ) -> Result<f64, TransferBenchError> {
        let ping = format!("ping-{round}").into_bytes();
        let pong = format!("pong-{round}").into_bytes();
        let start = Instant::now();
        let deadline = start + timeout;
        pair.p
            .agent
            .send_notification(&pair.d.name, &ping, None)
            .map_err(nixl("send_notification"))?;
        while !pair.d.received(&ping)? {
            pair.p.received(&[])?;
            if Instant::now() > deadline {
                return Err(run_error("ping not delivered"));
            }
            thread::yield_now();
        }
        pair.d
            .agent
            .send_notification(&pair.p.name, &pong, None)
            .map_err(nixl("send_notification"))?;
        while !pair.p.received(&pong)? {
            pair.d.received(&[])?;
            if Instant::now() > deadline {
                return Err(run_error("pong not delivered"));
            }
            thread::yield_now();
        }
        Ok(us(start.elapsed()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvhandoff_protocol::planner::descriptor_count;
    use kvhandoff_protocol::RegionDesc;

    #[test]
    fn tables_do_not_merge_when_fragmented() {
        for n in [1u32, 2, 3, 4, 5, 128] {
            let (pool, [c, f]) = block_tables(n);
            let mut remote = f.remote.groups[0].clone();
            remote.sort_unstable();
            remote.dedup();
            assert_eq!(remote.len(), n as usize, "a permutation for n = {n}");
            assert!(remote.iter().all(|&b| b < pool));
            assert!(f.local.groups[0].iter().all(|&b| b < pool));
            let options = TransferOptions {
                tokens: n * BLOCK_TOKENS,
                ..TransferOptions::tiny()
            };
            let geometry = bench_geometry(&options);
            let specs = geometry.regions().unwrap();
            let table = |base: u64| -> Vec<RegionDesc> {
                specs
                    .iter()
                    .enumerate()
                    .map(|(i, s)| RegionDesc {
                        base: base + (i as u64) * (1 << 32),
                        len: s.block_len * u64::from(pool),
                        num_blocks: pool,
                        block_len: s.block_len,
                    })
                    .collect()
            };
            let (local, remote) = (table(1 << 40), table(1 << 41));
            let count = |t: &BlockTable| {
                descriptor_count(&PlanInput::new(
                    &local, &remote, &specs, &t.local, &t.remote, 1,
                ))
                .unwrap()
            };
            assert_eq!(count(&c), specs.len());
            assert_eq!(count(&f), specs.len() * n as usize);
        }
    }

    #[test]
    fn default_request_is_the_8b_case() {
        let options = TransferOptions::default();
        assert_eq!(options.blocks(), 128);
        let geometry = bench_geometry(&options);
        let specs = geometry.regions().unwrap();
        assert_eq!(specs.len(), 64);
        assert_eq!(specs[0].block_len, 32 * 1024);
    }
}
