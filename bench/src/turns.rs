//! `kvhandoff bench turns`: turn 2 of a conversation in the bidirectional mode (vLLM PR 32553),
//! where P reads the previous turn's KV back from D instead of recomputing the prefix. What the
//! read costs against what recomputing costs, by the length of the reusable prefix.
//!
//! - **Reading** is measured here, with real transfers: two ranks built by [`build_rank`] (P the
//!   reader, D the holder), each behind the shell's [`TransportDriver`], and P's driver
//!   performing a [`ReadOrder`] for D's blocks, as the transport actor does for an import: the
//!   planner, then `post_read` (over NIXL: UCX over loopback, DRAM, two agents in one process;
//!   without the `nixl` feature or runtime, or with `--transport mem`, the in-memory transport,
//!   and the report says so). The time runs from the order to P's completion. Each prefix is
//!   read `repeats` times after one untimed round (four times as often up to 32 MiB: cheap, and
//!   the noisiest), the prefixes interleaved; the figure is the median. Every read is checked: each block's first and last 8 bytes carry D's mark of the
//!   block the table names.
//! - **The bytes** are one TP rank's: Llama-3.3-70B (80 layers, 8 KV heads of 128, bf16,
//!   16-token blocks) at TP 4 holds 2 heads a rank, 81,920 bytes per token (327,680 for the
//!   whole model). The ranks of an instance read their shares in parallel, so one rank's read
//!   is the instance's. Blocks are scattered on both sides by default (the `fragmented` table of
//!   `bench transfer`: no two blocks adjacent, one descriptor per block and region).
//! - **The cap**: a prefix whose read is above `max_read_bytes` (or the transports' 65,536
//!   descriptors per post) is not read; its `read_ms` is the least-squares line
//!   (`fixed_ms + bytes × slope`) through the measured prefixes, and its row says
//!   `measured: false`.
//! - **Recomputing** is a model, not a measurement: P's prefill throughput in tokens per second
//!   ([`ComputeModel`]), by default calibrated on the seed's multi-turn figures, with a FLOPs
//!   cross-check; linear in tokens (attention's quadratic part left out).
//!
//! [`build_rank`]: kvhandoff_actors::system::build_rank
//! [`TransportDriver`]: kvhandoff_protocol::driver::TransportDriver
//! [`ReadOrder`]: kvhandoff_protocol::machine::ReadOrder

use std::fmt::Write as _;
use std::time::Duration;

use kvhandoff_actors::transport::mem::{MemFabric, MemLimits};
use kvhandoff_protocol::{KvGeometry, KvLayout};
use serde::{Deserialize, Serialize};

use kvhandoff_testkit::stats::{gbps, human_bytes, median, spread};

mod measure;
mod model;

pub use model::{
    seed, threshold_tokens, ComputeModel, FlopsCheck, ModelGeometry, ModelShape, ReadFit,
    SeedCalibration, TurnRow, H200_BF16_DENSE_TFLOPS, LLAMA_70B_PARAMS, SEED_ASSUMED_TP,
    VLLM_RECOMPUTE_THRESHOLD_TOKENS,
};

/// The prefixes read by default, tokens.
pub const DEFAULT_PREFIXES: [u32; 8] = [16, 64, 256, 500, 1000, 2000, 4000, 8000];
/// The default cap on one measured read: 320 MiB (a 4,096-token prefix of one TP-4 rank).
pub const DEFAULT_MAX_READ_BYTES: u64 = 320 << 20;
/// Reads of at most this many bytes (32 MiB) are repeated [`SMALL_READ_REPEATS`] times as often.
pub const SMALL_READ_BYTES: u64 = 32 << 20;
/// How many times as often small reads are repeated.
pub const SMALL_READ_REPEATS: usize = 4;
/// Most descriptors one post may carry on either transport (`NixlConfig`, `MemLimits`).
pub const MAX_DESCRIPTORS_PER_POST: u64 = 1 << 16;

/// Which block table the reads use.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum TableKind {
    /// Each side's blocks adjacent: the planner merges a region's blocks into one descriptor.
    Contiguous,
    /// No two blocks adjacent on either side: one descriptor per block and region (the default:
    /// D's blocks of the previous turn are wherever its allocator put them).
    #[default]
    Fragmented,
}

impl TableKind {
    /// `"contiguous"` or `"fragmented"`.
    pub fn name(self) -> &'static str {
        match self {
            TableKind::Contiguous => "contiguous",
            TableKind::Fragmented => "fragmented",
        }
    }
}

/// What the reads travel over.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum TurnsTransport {
    /// NIXL when this build and machine have it, the in-memory transport otherwise (the
    /// default).
    #[default]
    Auto,
    /// NIXL, or an error.
    Nixl,
    /// The in-memory transport.
    Mem,
}

/// What `bench turns` runs.
#[derive(Debug, Clone, PartialEq)]
pub struct TurnsOptions {
    /// Reusable prefix lengths, tokens (default [`DEFAULT_PREFIXES`]).
    pub prefixes: Vec<u32>,
    /// Timed reads per prefix (default 5; [`SMALL_READ_REPEATS`] times as many for reads of at
    /// most [`SMALL_READ_BYTES`]), after one untimed round.
    pub repeats: usize,
    /// The model and its TP (default Llama-3.3-70B at TP 4).
    pub geometry: ModelGeometry,
    /// Reads above this many bytes are not measured but taken from the fitted line (default
    /// [`DEFAULT_MAX_READ_BYTES`]).
    pub max_read_bytes: u64,
    /// The block table (default fragmented).
    pub table: TableKind,
    /// The transport (default auto).
    pub transport: TurnsTransport,
    /// P's prefill throughput, tokens/s, instead of the seed calibration.
    pub tokens_per_s: Option<f64>,
    /// Limit of each read (default 30 s).
    pub timeout: Duration,
}

impl Default for TurnsOptions {
    fn default() -> Self {
        TurnsOptions {
            prefixes: DEFAULT_PREFIXES.to_vec(),
            repeats: 5,
            geometry: ModelGeometry::llama_3_3_70b(4),
            max_read_bytes: DEFAULT_MAX_READ_BYTES,
            table: TableKind::Fragmented,
            transport: TurnsTransport::Auto,
            tokens_per_s: None,
            timeout: Duration::from_secs(30),
        }
    }
}

impl TurnsOptions {
    /// A run for tests: 2 layers of the 70B's heads at TP 4, prefixes of 16 and 48 tokens, two
    /// repetitions.
    pub fn tiny() -> Self {
        TurnsOptions {
            prefixes: vec![16, 48],
            repeats: 2,
            geometry: ModelGeometry {
                name: "Llama-3.3-70B, 2 of its 80 layers".into(),
                num_layers: 2,
                ..ModelGeometry::llama_3_3_70b(4)
            },
            ..TurnsOptions::default()
        }
    }

    /// Whether the read of `tokens` is measured (under both caps) or extrapolated.
    pub fn measures(&self, tokens: u32) -> bool {
        self.geometry.read_bytes(tokens) <= self.max_read_bytes
            && self.geometry.descriptors(tokens, self.table) <= MAX_DESCRIPTORS_PER_POST
    }

    fn check(&self) -> Result<(), TurnsBenchError> {
        let bad = |why: &str| Err(TurnsBenchError::Options(why.into()));
        self.geometry.check()?;
        if self.prefixes.is_empty() || self.prefixes.iter().any(|&t| t == 0 || t > 1 << 20) {
            return bad("prefixes must be between 1 and 2^20 tokens");
        }
        if self.repeats == 0 || self.repeats > 1000 {
            return bad("repeats must be 1 to 1000");
        }
        if !self.prefixes.iter().any(|&t| self.measures(t)) {
            return bad("no prefix fits under max_read_bytes: nothing would be measured");
        }
        if let Some(tps) = self.tokens_per_s {
            if !(tps.is_finite() && tps > 0.0) {
                return bad("tokens_per_s must be positive");
            }
        }
        if self.timeout.is_zero() {
            return bad("the timeout must be positive");
        }
        Ok(())
    }
}

/// Why `bench turns` could not produce numbers.
#[derive(Debug, thiserror::Error)]
pub enum TurnsBenchError {
    /// The options make no sense.
    #[error("invalid bench options: {0}")]
    Options(String),
    /// NIXL was asked for and this build or machine does not have it.
    #[error("NIXL: {0}")]
    Nixl(String),
    /// A read went wrong: a refusal, a timeout, bytes that did not land.
    #[error("the turns run failed: {0}")]
    Run(String),
}

/// The seed's multi-turn figures, beside ours.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SeedFigures {
    /// Mean TTFT, no prefix caching on P, recompute, ms.
    pub recompute_mean_ttft_ms: f64,
    /// Mean TTFT, no prefix caching on P, pull from D, ms.
    pub pull_mean_ttft_ms: f64,
    /// `pull / recompute`.
    pub ratio: f64,
    /// Mean TTFT, prefix caching on P, recompute, ms.
    pub prefix_cache_recompute_mean_ttft_ms: f64,
    /// Mean TTFT, prefix caching on P, pull from D, ms.
    pub prefix_cache_pull_mean_ttft_ms: f64,
    /// `pull / recompute` with prefix caching.
    pub prefix_cache_ratio: f64,
}

impl SeedFigures {
    fn new() -> Self {
        SeedFigures {
            recompute_mean_ttft_ms: seed::RECOMPUTE_MEAN_TTFT_MS,
            pull_mean_ttft_ms: seed::PULL_MEAN_TTFT_MS,
            ratio: seed::PULL_MEAN_TTFT_MS / seed::RECOMPUTE_MEAN_TTFT_MS,
            prefix_cache_recompute_mean_ttft_ms: seed::CACHED_RECOMPUTE_MEAN_TTFT_MS,
            prefix_cache_pull_mean_ttft_ms: seed::CACHED_PULL_MEAN_TTFT_MS,
            prefix_cache_ratio: seed::CACHED_PULL_MEAN_TTFT_MS
                / seed::CACHED_RECOMPUTE_MEAN_TTFT_MS,
        }
    }
}

/// Where reading starts to win, from the fitted line (continuous, blocks not rounded).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BreakEven {
    /// The transfer alone against the recompute, tokens (`null`: reading never catches up).
    pub tokens: Option<f64>,
    /// The same with one engine step added to the read (`step_ms`): a request that waits for
    /// remote KV is scheduled a step later at least.
    pub tokens_with_one_step: Option<f64>,
    /// The step, ms: the seed's mean TPOT at that load.
    pub step_ms: f64,
    /// vLLM's default `kv_recompute_threshold`, tokens.
    pub vllm_recompute_threshold_tokens: u32,
    /// The line's read of that many tokens, ms.
    pub read_ms_at_vllm_threshold: f64,
    /// The model's recompute of that many tokens, ms.
    pub recompute_ms_at_vllm_threshold: f64,
}

/// What `bench turns` measured and modelled.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnsReport {
    /// The model's geometry and the bytes per token.
    pub model: ModelShape,
    /// The recompute model.
    pub compute_model: ComputeModel,
    /// `"nixl"` or `"mem"`.
    pub transport: String,
    /// What the transport is, and why `mem` when it is.
    pub transport_note: String,
    /// The block table of the reads.
    pub table: String,
    /// Timed reads per measured prefix above [`SMALL_READ_BYTES`] (`rows[].samples` has each
    /// row's count).
    pub repeats: usize,
    /// Reads above this many bytes are extrapolated.
    pub max_read_bytes: u64,
    /// The line through the measured reads.
    pub read_fit: ReadFit,
    /// One row per prefix, shortest first.
    pub rows: Vec<TurnRow>,
    /// The shortest prefix from which reading wins at every longer row (`null`: it does not win
    /// at the longest).
    pub threshold_tokens: Option<u32>,
    /// The fitted break-even.
    pub break_even: BreakEven,
    /// The seed's figures.
    pub seed: SeedFigures,
}

impl TurnsReport {
    /// The report for people.
    pub fn render_table(&self) -> String {
        let m = &self.model;
        let c = &self.compute_model;
        let mut out = String::from(
            "kvhandoff bench turns: turn 2 of a conversation, reading the previous turn's KV \
             back from D vs recomputing it\n",
        );
        let _ = writeln!(
            out,
            "  model      {}: {} layers, {} KV heads x {}, {} bytes/element, TP {} ({} heads a \
             rank): {} per token per rank ({} for the whole model)",
            m.name,
            m.num_layers,
            m.kv_heads,
            m.head_dim,
            m.dtype_bytes,
            m.tp_size,
            m.kv_heads_per_rank,
            human_bytes(m.bytes_per_token_per_rank),
            human_bytes(m.bytes_per_token),
        );
        let _ = writeln!(
            out,
            "  transport  {}: {}",
            self.transport, self.transport_note
        );
        let _ = writeln!(
            out,
            "  reads      {} table, median of {} (min-max; x{SMALL_READ_REPEATS} up to 32 MiB); above {} the line {:.3} ms + {:.3} \
             ms/MiB ({:.2} GB/s) through {} measured sizes (*)",
            self.table,
            self.repeats,
            human_bytes(self.max_read_bytes),
            self.read_fit.fixed_ms,
            self.read_fit.ms_per_mib,
            self.read_fit.gbps,
            self.read_fit.points,
        );
        let _ = writeln!(
            out,
            "  recompute  {:.0} tokens/s per P instance (a model, not measured; {:.0}% of TP {} \
             H200 bf16 peak)",
            c.tokens_per_s,
            c.flops_check.implied_mfu * 100.0,
            c.flops_check.gpus,
        );
        let _ = writeln!(out, "             source: {}", c.source);
        let _ = writeln!(
            out,
            "  {:>7} {:>6} {:>11} {:>7} {:>22} {:>8} {:>13} {:>8} {:>10}",
            "prefix",
            "blocks",
            "bytes",
            "descs",
            "read ms (min-max)",
            "GB/s",
            "recompute ms",
            "ratio",
            "saved ms"
        );
        for r in &self.rows {
            let read = if r.measured {
                format!(
                    "{:.2} ({:.2}-{:.2})",
                    r.read_ms, r.read_ms_min, r.read_ms_max
                )
            } else {
                format!("{:.2} *", r.read_ms)
            };
            let _ = writeln!(
                out,
                "  {:>7} {:>6} {:>11} {:>7} {:>22} {:>8.2} {:>13.2} {:>8.3} {:>10.2}",
                r.prefix_tokens,
                r.blocks,
                human_bytes(r.bytes),
                r.descriptors,
                read,
                r.read_gbps,
                r.recompute_ms,
                r.ratio,
                r.saved_ms
            );
        }
        let tokens = |t: Option<f64>| match t {
            None => "never".to_string(),
            Some(t) if t <= 0.0 => "any prefix (the line has no fixed cost)".to_string(),
            Some(t) => format!("{t:.1} tokens"),
        };
        let b = &self.break_even;
        let _ = writeln!(
            out,
            "  reading wins from {} (rows); break-even on the line: {}, {} with one {:.2} ms \
             engine step added",
            self.threshold_tokens
                .map_or("no row".to_string(), |t| format!("{t} tokens")),
            tokens(b.tokens),
            tokens(b.tokens_with_one_step),
            b.step_ms,
        );
        let _ = writeln!(
            out,
            "  vLLM's default kv_recompute_threshold {} tokens: read {:.3} ms vs recompute {:.3} \
             ms",
            b.vllm_recompute_threshold_tokens,
            b.read_ms_at_vllm_threshold,
            b.recompute_ms_at_vllm_threshold,
        );
        let s = &self.seed;
        let _ = writeln!(
            out,
            "  seed (mean TTFT): recompute {:.2} -> pull {:.2} ms ({:.3}); with prefix caching \
             {:.2} -> {:.2} ms ({:.3})",
            s.recompute_mean_ttft_ms,
            s.pull_mean_ttft_ms,
            s.ratio,
            s.prefix_cache_recompute_mean_ttft_ms,
            s.prefix_cache_pull_mean_ttft_ms,
            s.prefix_cache_ratio,
        );
        out
    }
}

/// Runs the benchmark.
///
/// # Errors
/// [`TurnsBenchError`] for bad options, NIXL asked for and missing, or a read that goes wrong.
pub fn turns(options: &TurnsOptions) -> Result<TurnsReport, TurnsBenchError> {
    options.check()?;
    let mut prefixes = options.prefixes.clone();
    prefixes.sort_unstable();
    prefixes.dedup();
    let measured_prefixes: Vec<u32> = prefixes
        .iter()
        .copied()
        .filter(|&t| options.measures(t))
        .collect();
    let (transport, transport_note, measured) = read_all(options, &measured_prefixes)?;
    let compute = match options.tokens_per_s {
        Some(tps) => ComputeModel::with_tokens_per_s(
            tps,
            "--prefill-tokens-per-s, given on the command line (an assumption, not a measurement)"
                .into(),
            options.geometry.tp_size,
        ),
        None => ComputeModel::from_seed(),
    };
    let g = &options.geometry;
    let points: Vec<(u64, f64)> = measured
        .iter()
        .map(|m| (g.read_bytes(m.prefix_tokens), median(&m.samples_ms)))
        .collect();
    let fit = ReadFit::fit(&points).ok_or_else(|| TurnsBenchError::Run("nothing read".into()))?;
    let rows: Vec<TurnRow> = prefixes
        .iter()
        .map(|&t| match measured.iter().find(|m| m.prefix_tokens == t) {
            Some(m) => TurnRow::new(g, t, m.descriptors, true, &m.samples_ms, &compute),
            None => TurnRow::new(
                g,
                t,
                g.descriptors(t, options.table),
                false,
                &[fit.read_ms(g.read_bytes(t))],
                &compute,
            ),
        })
        .collect();
    let bpt = g.bytes_per_token_per_rank();
    let vllm = VLLM_RECOMPUTE_THRESHOLD_TOKENS;
    let break_even = BreakEven {
        tokens: fit.break_even_tokens(bpt, compute.ms_per_token, 0.0),
        tokens_with_one_step: fit.break_even_tokens(bpt, compute.ms_per_token, seed::MEAN_TPOT_MS),
        step_ms: seed::MEAN_TPOT_MS,
        vllm_recompute_threshold_tokens: vllm,
        read_ms_at_vllm_threshold: fit.read_ms(g.read_bytes(vllm)),
        recompute_ms_at_vllm_threshold: compute.recompute_ms(vllm),
    };
    Ok(TurnsReport {
        model: g.shape(),
        compute_model: compute,
        transport: transport.into(),
        transport_note,
        table: options.table.name().into(),
        repeats: options.repeats,
        max_read_bytes: options.max_read_bytes,
        read_fit: fit,
        threshold_tokens: threshold_tokens(&rows),
        rows,
        break_even,
        seed: SeedFigures::new(),
    })
}

const NIXL_NOTE: &str = "NIXL (UCX over loopback, DRAM): two agents in one process";

/// Reads over the transport the options pick: its name, a note, and the reads.
fn read_all(
    options: &TurnsOptions,
    prefixes: &[u32],
) -> Result<(&'static str, String, Vec<measure::Measured>), TurnsBenchError> {
    let mem = |why: &str| -> Result<_, TurnsBenchError> {
        let note = format!(
            "the in-memory transport (the bytes copied by an in-process fabric, not NIXL): {why}"
        );
        Ok(("mem", note, read_mem(options, prefixes)?))
    };
    match options.transport {
        TurnsTransport::Mem => mem("asked for with --transport mem"),
        TurnsTransport::Nixl => {
            nixl_available().map_err(TurnsBenchError::Nixl)?;
            Ok(("nixl", NIXL_NOTE.into(), read_nixl(options, prefixes)?))
        }
        TurnsTransport::Auto => match nixl_available() {
            Ok(()) => Ok(("nixl", NIXL_NOTE.into(), read_nixl(options, prefixes)?)),
            Err(why) => mem(&format!(
                "NIXL unavailable ({why}); these are NOT NIXL reads"
            )),
        },
    }
}

fn read_mem(
    options: &TurnsOptions,
    prefixes: &[u32],
) -> Result<Vec<measure::Measured>, TurnsBenchError> {
    // Both pools, twice the largest table each, and room to spare.
    let most = prefixes
        .iter()
        .map(|&t| options.geometry.read_bytes(t))
        .max()
        .unwrap_or(0);
    let fabric = MemFabric::with_limits(MemLimits {
        max_fabric_bytes: (4 * most).max(1 << 30),
        ..MemLimits::default()
    });
    measure::measure(options, prefixes, |name| {
        fabric
            .agent(name)
            .map_err(|e| TurnsBenchError::Run(format!("a memory agent: {e}")))
    })
}

#[cfg(feature = "nixl")]
fn nixl_available() -> Result<(), String> {
    kvhandoff_actors::transport::nixl::nixl_runtime_available().map_err(|e| e.to_string())
}

#[cfg(not(feature = "nixl"))]
fn nixl_available() -> Result<(), String> {
    Err("this build has no `nixl` cargo feature".into())
}

#[cfg(feature = "nixl")]
fn read_nixl(
    options: &TurnsOptions,
    prefixes: &[u32],
) -> Result<Vec<measure::Measured>, TurnsBenchError> {
    use kvhandoff_actors::transport::nixl::{NixlConfig, NixlTransport};
    measure::measure(options, prefixes, |name| {
        NixlTransport::new(name, NixlConfig::default())
            .map_err(|e| TurnsBenchError::Nixl(e.to_string()))
    })
}

#[cfg(not(feature = "nixl"))]
fn read_nixl(
    _options: &TurnsOptions,
    _prefixes: &[u32],
) -> Result<Vec<measure::Measured>, TurnsBenchError> {
    Err(TurnsBenchError::Nixl(
        "this build has no `nixl` cargo feature".into(),
    ))
}

#[cfg(test)]
mod tests;
