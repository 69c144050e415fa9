//! The arithmetic of `bench turns`, without any timing: the model's KV bytes per token, the
//! recompute model and its calibration, the least-squares line through the measured reads, and
//! where reading starts to win.

use super::*;

/// Llama-3.3-70B's parameters (70,553,706,496), for the FLOPs cross-check.
pub const LLAMA_70B_PARAMS: f64 = 70.6e9;
/// Dense BF16 peak of one H200 (and H100) SXM, TFLOPS, from NVIDIA's data sheet (1,979 with
/// sparsity): a published peak, not a measurement.
pub const H200_BF16_DENSE_TFLOPS: f64 = 989.0;
/// The TP the seed's P instance is assumed to run at (the seed's push/pull rows used TP 4; the
/// multi-turn run does not say).
pub const SEED_ASSUMED_TP: u32 = 4;

/// The seed's multi-turn figures (vLLM PR 32553, Llama-3.3-70B-Instruct on p5en, mean TTFT in
/// ms), and the prefix they were measured with.
pub mod seed {
    /// No prefix caching on P, P recomputes the history.
    pub const RECOMPUTE_MEAN_TTFT_MS: f64 = 1049.77;
    /// No prefix caching on P, P pulls the history from D.
    pub const PULL_MEAN_TTFT_MS: f64 = 498.15;
    /// Prefix caching on P, recompute.
    pub const CACHED_RECOMPUTE_MEAN_TTFT_MS: f64 = 396.73;
    /// Prefix caching on P, pull.
    pub const CACHED_PULL_MEAN_TTFT_MS: f64 = 334.39;
    /// Mean TPOT of the same runs (21.81–21.89 ms): one engine step at that load.
    pub const MEAN_TPOT_MS: f64 = 21.88;
    /// The common prefix of every conversation, tokens.
    pub const COMMON_PREFIX_TOKENS: f64 = 500.0;
    /// The mean of the per-conversation prefix, lognormal(average 4000, 0.85, max 10000).
    pub const CONVERSATION_PREFIX_MEAN_TOKENS: f64 = 4000.0;
}

/// vLLM's default `kv_recompute_threshold` (PR 32553): P reads from D only when at least this
/// many prefix tokens would be saved.
pub const VLLM_RECOMPUTE_THRESHOLD_TOKENS: u32 = 64;

/// A dense model's KV geometry and the TP it is served at.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelGeometry {
    /// The model's name.
    pub name: String,
    /// Layers.
    pub num_layers: u32,
    /// KV heads of the whole model.
    pub kv_heads: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// Bytes per element (2: bf16).
    pub dtype_bytes: u32,
    /// Tokens per KV block.
    pub block_tokens: u32,
    /// Tensor parallelism: each rank holds `kv_heads / tp_size` heads and reads only those.
    pub tp_size: u32,
}

impl ModelGeometry {
    /// Llama-3.3-70B (80 layers, 8 KV heads of 128, bf16), 16-token blocks, at `tp_size`.
    pub fn llama_3_3_70b(tp_size: u32) -> Self {
        ModelGeometry {
            name: "Llama-3.3-70B".into(),
            num_layers: 80,
            kv_heads: 8,
            head_dim: 128,
            dtype_bytes: 2,
            block_tokens: 16,
            tp_size,
        }
    }

    /// KV heads one rank holds.
    pub fn kv_heads_per_rank(&self) -> u32 {
        self.kv_heads / self.tp_size.max(1)
    }

    /// KV bytes of one token, all ranks: K and V × layers × heads × head dim × dtype.
    pub fn bytes_per_token(&self) -> u64 {
        2 * u64::from(self.num_layers)
            * u64::from(self.kv_heads)
            * u64::from(self.head_dim)
            * u64::from(self.dtype_bytes)
    }

    /// KV bytes of one token on one rank (what one rank reads).
    pub fn bytes_per_token_per_rank(&self) -> u64 {
        self.bytes_per_token() / u64::from(self.tp_size.max(1))
    }

    /// Blocks a prefix of `tokens` occupies (whole blocks move).
    pub fn blocks(&self, tokens: u32) -> u32 {
        tokens.div_ceil(self.block_tokens.max(1))
    }

    /// Bytes one rank reads for a prefix of `tokens`: its blocks, whole.
    pub fn read_bytes(&self, tokens: u32) -> u64 {
        u64::from(self.blocks(tokens))
            * u64::from(self.block_tokens)
            * self.bytes_per_token_per_rank()
    }

    /// Regions one rank registers: K and V per layer.
    pub fn regions(&self) -> u32 {
        2 * self.num_layers
    }

    /// The descriptors one read of `tokens` posts with `table`: one per region when every block
    /// run merges (contiguous), one per block and region when none does (fragmented).
    pub fn descriptors(&self, tokens: u32, table: TableKind) -> u64 {
        match table {
            TableKind::Contiguous => u64::from(self.regions()),
            TableKind::Fragmented => u64::from(self.regions()) * u64::from(self.blocks(tokens)),
        }
    }

    /// Rank 0's geometry, as the transport registers it.
    pub fn kv_geometry(&self) -> KvGeometry {
        let mut geometry = KvGeometry::dense(
            self.num_layers,
            self.kv_heads,
            self.head_dim,
            self.dtype_bytes,
            self.block_tokens,
            KvLayout::Nhd,
        );
        geometry.tp_size = self.tp_size;
        geometry.tp_rank = 0;
        geometry
    }

    pub(super) fn check(&self) -> Result<(), TurnsBenchError> {
        let bad = |why: String| Err(TurnsBenchError::Options(why));
        if self.tp_size == 0 || self.kv_heads % self.tp_size != 0 {
            return bad(format!(
                "TP {} does not divide the {} KV heads",
                self.tp_size, self.kv_heads
            ));
        }
        self.kv_geometry()
            .validate()
            .map_err(|e| TurnsBenchError::Options(e.to_string()))
    }

    /// The geometry as the report states it, with its byte counts.
    pub fn shape(&self) -> ModelShape {
        ModelShape {
            name: self.name.clone(),
            num_layers: self.num_layers,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            dtype_bytes: self.dtype_bytes,
            block_tokens: self.block_tokens,
            tp_size: self.tp_size,
            kv_heads_per_rank: self.kv_heads_per_rank(),
            regions_per_rank: self.regions(),
            bytes_per_token: self.bytes_per_token(),
            bytes_per_token_per_rank: self.bytes_per_token_per_rank(),
            read_by: "one TP rank reads its own heads; the ranks of an instance read in parallel"
                .into(),
        }
    }
}

/// The JSON's `model`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelShape {
    /// The model.
    pub name: String,
    /// Layers.
    pub num_layers: u32,
    /// KV heads of the whole model.
    pub kv_heads: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// Bytes per element.
    pub dtype_bytes: u32,
    /// Tokens per block.
    pub block_tokens: u32,
    /// Tensor parallelism.
    pub tp_size: u32,
    /// KV heads per rank.
    pub kv_heads_per_rank: u32,
    /// Regions per rank (K and V per layer).
    pub regions_per_rank: u32,
    /// KV bytes per token, whole model.
    pub bytes_per_token: u64,
    /// KV bytes per token on one rank: what `rows[].bytes` counts.
    pub bytes_per_token_per_rank: u64,
    /// Whose bytes the reads move.
    pub read_by: String,
}

/// How the seed's figures give the recompute throughput.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SeedCalibration {
    /// The seed's mean TTFT recomputing the history (no prefix caching on P), ms.
    pub recompute_mean_ttft_ms: f64,
    /// The same pulling the history from D, ms.
    pub pull_mean_ttft_ms: f64,
    /// Their difference: what recomputing the prefix cost beyond reading it, ms.
    pub saved_ms: f64,
    /// The prefix assumed reusable on average: the 500-token common prefix plus the
    /// per-conversation prefix's mean of 4,000 (earlier turns' history left out).
    pub mean_prefix_tokens: f64,
}

/// The FLOPs bound beside the calibrated throughput: what fraction of the instance's peak the
/// model implies.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FlopsCheck {
    /// 2 × parameters per prefilled token (attention's quadratic part left out).
    pub flops_per_token: f64,
    /// Dense BF16 peak per GPU (H200/H100 SXM data sheet), TFLOPS.
    pub gpu_peak_tflops: f64,
    /// GPUs of the instance (its TP).
    pub gpus: u32,
    /// Tokens per second at 100% of that peak.
    pub peak_tokens_per_s: f64,
    /// `tokens_per_s / peak_tokens_per_s`.
    pub implied_mfu: f64,
}

/// The JSON's `compute_model`: P's prefill throughput for recomputing a prefix, linear in
/// tokens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ComputeModel {
    /// Prefill tokens per second of one P instance (all its TP ranks).
    pub tokens_per_s: f64,
    /// `1000 / tokens_per_s`.
    pub ms_per_token: f64,
    /// Where `tokens_per_s` comes from.
    pub source: String,
    /// The seed derivation, when the figure is the seed's.
    pub calibration: Option<SeedCalibration>,
    /// The FLOPs cross-check.
    pub flops_check: FlopsCheck,
}

impl ComputeModel {
    /// The model calibrated on the seed's multi-turn figures: the mean TTFT that pulling saved
    /// (1049.77 − 498.15 = 551.62 ms) is the recompute of the mean reusable prefix (4,500
    /// tokens), the read time being small beside it. Leaving the read out makes the throughput an
    /// upper bound (recompute a lower one: conservative for reading); leaving the earlier turns'
    /// history out of the prefix makes it a lower bound.
    pub fn from_seed() -> Self {
        let saved_ms = seed::RECOMPUTE_MEAN_TTFT_MS - seed::PULL_MEAN_TTFT_MS;
        let mean_prefix_tokens = seed::COMMON_PREFIX_TOKENS + seed::CONVERSATION_PREFIX_MEAN_TOKENS;
        let tokens_per_s = mean_prefix_tokens / (saved_ms / 1e3);
        let mut model = Self::with_tokens_per_s(
            tokens_per_s,
            format!(
                "calibrated on the seed's multi-turn run (vLLM PR 32553, Llama-3.3-70B-Instruct, \
                 p5en H200, no prefix caching on P): pulling saved {:.2} - {:.2} = {saved_ms:.2} ms \
                 of mean TTFT; taken as the recompute of the mean reusable prefix, {} common + {} \
                 per-conversation mean = {mean_prefix_tokens} tokens (history of earlier turns and \
                 the read time left out); one P instance at TP {} assumed. An assumption, not a \
                 measurement",
                seed::RECOMPUTE_MEAN_TTFT_MS,
                seed::PULL_MEAN_TTFT_MS,
                seed::COMMON_PREFIX_TOKENS,
                seed::CONVERSATION_PREFIX_MEAN_TOKENS,
                SEED_ASSUMED_TP,
            ),
            SEED_ASSUMED_TP,
        );
        model.calibration = Some(SeedCalibration {
            recompute_mean_ttft_ms: seed::RECOMPUTE_MEAN_TTFT_MS,
            pull_mean_ttft_ms: seed::PULL_MEAN_TTFT_MS,
            saved_ms,
            mean_prefix_tokens,
        });
        model
    }

    /// A model of `tokens_per_s` from `source`, cross-checked against an instance of `gpus`.
    pub fn with_tokens_per_s(tokens_per_s: f64, source: String, gpus: u32) -> Self {
        let flops_per_token = 2.0 * LLAMA_70B_PARAMS;
        let peak_tokens_per_s = f64::from(gpus) * H200_BF16_DENSE_TFLOPS * 1e12 / flops_per_token;
        ComputeModel {
            tokens_per_s,
            ms_per_token: 1e3 / tokens_per_s,
            source,
            calibration: None,
            flops_check: FlopsCheck {
                flops_per_token,
                gpu_peak_tflops: H200_BF16_DENSE_TFLOPS,
                gpus,
                peak_tokens_per_s,
                implied_mfu: tokens_per_s / peak_tokens_per_s,
            },
        }
    }

    /// Recomputing a prefix of `tokens`, ms.
    pub fn recompute_ms(&self, tokens: u32) -> f64 {
        f64::from(tokens) * self.ms_per_token
    }
}

/// A straight line through the measured reads: `read_ms = fixed_ms + bytes × slope`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReadFit {
    /// The intercept: what a read costs whatever its size, ms (never negative: a negative
    /// least-squares intercept refits the line through the origin).
    pub fixed_ms: f64,
    /// The slope, ms per MiB.
    pub ms_per_mib: f64,
    /// The slope as a bandwidth, GB/s (10⁹ bytes).
    pub gbps: f64,
    /// Measured sizes the line was fitted on.
    pub points: usize,
}

const MIB: f64 = 1048576.0;

impl ReadFit {
    /// The least-squares line through `(bytes, ms)`; through the origin when there is one
    /// distinct size or the intercept would be negative. `None` without points.
    pub fn fit(points: &[(u64, f64)]) -> Option<ReadFit> {
        if points.is_empty() {
            return None;
        }
        let n = points.len() as f64;
        let xs = || points.iter().map(|&(b, _)| b as f64 / MIB);
        let mean_x = xs().sum::<f64>() / n;
        let mean_y = points.iter().map(|&(_, ms)| ms).sum::<f64>() / n;
        let sxx: f64 = xs().map(|x| (x - mean_x).powi(2)).sum();
        let sxy: f64 = points
            .iter()
            .map(|&(b, ms)| (b as f64 / MIB - mean_x) * (ms - mean_y))
            .sum();
        let (mut fixed_ms, mut slope) = (0.0, 0.0);
        if sxx > 0.0 {
            slope = sxy / sxx;
            fixed_ms = mean_y - slope * mean_x;
        }
        if sxx <= 0.0 || fixed_ms < 0.0 || slope <= 0.0 {
            // Through the origin: slope = Σxy / Σx².
            let sx2: f64 = xs().map(|x| x * x).sum();
            let sxy0: f64 = points.iter().map(|&(b, ms)| b as f64 / MIB * ms).sum();
            fixed_ms = 0.0;
            slope = if sx2 > 0.0 { sxy0 / sx2 } else { 0.0 };
        }
        Some(ReadFit {
            fixed_ms,
            ms_per_mib: slope,
            gbps: if slope > 0.0 {
                MIB / (slope * 1e6)
            } else {
                0.0
            },
            points: points.len(),
        })
    }

    /// The line at `bytes`, ms.
    pub fn read_ms(&self, bytes: u64) -> f64 {
        self.fixed_ms + self.ms_per_mib * bytes as f64 / MIB
    }

    /// The prefix (tokens, continuous: blocks not rounded) at which reading `bytes_per_token`
    /// per token plus `extra_ms` costs as much as recomputing at `ms_per_token`; `None` when
    /// reading never catches up (it moves a token slower than P computes one).
    pub fn break_even_tokens(
        &self,
        bytes_per_token: u64,
        ms_per_token: f64,
        extra_ms: f64,
    ) -> Option<f64> {
        let read_per_token = self.ms_per_mib * bytes_per_token as f64 / MIB;
        let gain = ms_per_token - read_per_token;
        (gain > 0.0).then(|| (self.fixed_ms + extra_ms) / gain)
    }
}

/// One prefix's row of the JSON.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnRow {
    /// The reusable prefix, tokens.
    pub prefix_tokens: u32,
    /// Its blocks.
    pub blocks: u32,
    /// Bytes one rank reads (whole blocks).
    pub bytes: u64,
    /// Descriptors of the read (planned, or computed for an extrapolated row).
    pub descriptors: u64,
    /// True when `read_ms` was measured; false when it is the fitted line's value (the read is
    /// above `max_read_bytes` or the transports' 65,536 descriptors per post).
    pub measured: bool,
    /// Timed reads behind `read_ms` (0 when not measured).
    pub samples: usize,
    /// Reading the prefix from D, ms: the median of the repetitions (the fit when not measured).
    pub read_ms: f64,
    /// The fastest repetition, ms (= `read_ms` when not measured).
    pub read_ms_min: f64,
    /// The slowest, ms.
    pub read_ms_max: f64,
    /// `bytes / read_ms`, GB/s.
    pub read_gbps: f64,
    /// Recomputing the prefix under the compute model, ms.
    pub recompute_ms: f64,
    /// `read_ms / recompute_ms`: below 1, reading wins.
    pub ratio: f64,
    /// `recompute_ms - read_ms`: what reading saves (negative: what it loses).
    pub saved_ms: f64,
}

impl TurnRow {
    /// A row from its read times (ms; one value for an extrapolated row).
    pub fn new(
        geometry: &ModelGeometry,
        prefix_tokens: u32,
        descriptors: u64,
        measured: bool,
        samples_ms: &[f64],
        compute: &ComputeModel,
    ) -> Self {
        let bytes = geometry.read_bytes(prefix_tokens);
        let read_ms = median(samples_ms);
        let (lo, hi) = spread(samples_ms);
        let recompute_ms = compute.recompute_ms(prefix_tokens);
        TurnRow {
            prefix_tokens,
            blocks: geometry.blocks(prefix_tokens),
            bytes,
            descriptors,
            measured,
            samples: if measured { samples_ms.len() } else { 0 },
            read_ms,
            read_ms_min: lo,
            read_ms_max: hi,
            read_gbps: gbps(bytes, read_ms * 1e3),
            recompute_ms,
            ratio: if recompute_ms > 0.0 {
                read_ms / recompute_ms
            } else {
                f64::INFINITY
            },
            saved_ms: recompute_ms - read_ms,
        }
    }

    /// Whether reading beats recomputing.
    pub fn read_wins(&self) -> bool {
        self.read_ms < self.recompute_ms
    }
}

/// The smallest prefix from which reading wins at that row and every longer one (rows in any
/// order); `None` when it does not win at the longest.
pub fn threshold_tokens(rows: &[TurnRow]) -> Option<u32> {
    let mut sorted: Vec<&TurnRow> = rows.iter().collect();
    sorted.sort_by_key(|r| r.prefix_tokens);
    let mut threshold = None;
    for row in sorted.iter().rev() {
        if !row.read_wins() {
            break;
        }
        threshold = Some(row.prefix_tokens);
    }
    threshold
}
