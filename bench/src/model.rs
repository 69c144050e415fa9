//! `kvhandoff model`: a deployment model of disaggregated serving, push vs pull vs layer-wise push,
//! for the seed's setup (1 P + 1 D instance of Llama-3.3-70B on p5en: H200s and EFA). It is a
//! discrete-event simulation, deterministic for a seed: Poisson arrivals, P's chunked-prefill
//! steps (FLOPs at a fitted MFU), the KV transfer on each rank's link (bytes ÷ bandwidth plus
//! NIXL's post cost per descriptor), and D's decode steps (weights and KV read from HBM) with
//! requests joining at step boundaries under a running-request limit. Pull's read is issued by
//! D's scheduler and its post lengthens D's step; push's post lengthens P's. `docs/model.md`
//! gives every parameter's source, the fit and what the model leaves out.

pub mod params;
mod sim;
#[cfg(test)]
mod tests;

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

pub use params::{BlockTable, Deployment, FreeParameters, FITTED};
use sim::{simulate, Workload};

/// How the KV moves from P to D.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// P writes the whole request into the blocks D registered, after its prefill.
    Push,
    /// D's scheduler reads P's blocks once P's response reached D.
    Pull,
    /// P writes each group of layers as its forward pass produces it (whole-request push below
    /// the threshold).
    Layerwise,
}

/// How the requests' send times are drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Arrivals {
    /// `vllm bench serve`'s generator: numpy's legacy MT19937 seeded with the run's seed,
    /// exponential gaps, rescaled so that the last request goes at `requests / qps` s. With seed
    /// 0 (the benchmark's default) these are the seed's own send times.
    BenchServe,
    /// Exponential gaps from SplitMix64 (no rescaling).
    Poisson,
}

/// What `kvhandoff model` runs.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelOptions {
    /// How the KV moves.
    pub mode: Mode,
    /// Prompt tokens of every request.
    pub input_len: u32,
    /// Output tokens of every request (ignore-EOS, as the benchmark runs).
    pub output_len: u32,
    /// Mean arrival rate, requests/s.
    pub qps: f64,
    /// Requests per run (the seed's runs: about 100, from its req/s).
    pub requests: usize,
    /// Independent runs (seeds `seed`, `seed + 1`, …) whose requests are pooled.
    pub runs: usize,
    /// How the send times are drawn.
    pub arrivals: Arrivals,
    /// The first run's seed.
    pub seed: u64,
    /// The deployment (its `tp` is the instances' TP).
    pub deployment: Deployment,
}

impl ModelOptions {
    /// The seed's workload shape at `tp` with the fitted deployment.
    pub fn seed(mode: Mode, tp: u32, input_len: u32, output_len: u32, qps: f64) -> Self {
        ModelOptions {
            mode,
            input_len,
            output_len,
            qps,
            requests: 100,
            runs: 1,
            arrivals: Arrivals::BenchServe,
            seed: 0,
            deployment: Deployment::seed(tp),
        }
    }

    fn validate(&self) -> Result<(), ModelError> {
        let tp = self.deployment.tp;
        if tp == 0 || 8 % tp != 0 {
            return Err(ModelError::Tp(tp));
        }
        if !(self.qps.is_finite() && self.qps > 0.0) {
            return Err(ModelError::Qps(self.qps));
        }
        if self.input_len == 0 {
            return Err(ModelError::InputLen);
        }
        if self.output_len < 2 {
            return Err(ModelError::OutputLen(self.output_len));
        }
        if self.requests == 0 || self.runs == 0 {
            return Err(ModelError::NoRequests);
        }
        Ok(())
    }
}

/// Why the model cannot run.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ModelError {
    /// The TP must split Llama-3.3-70B's 8 KV heads evenly.
    #[error("--tp {0}: the TP must be 1, 2, 4 or 8 (it splits 8 KV heads)")]
    Tp(u32),
    /// Arrivals need a positive, finite rate.
    #[error("--qps {0}: expected a positive number of requests per second")]
    Qps(f64),
    /// A request needs a prompt.
    #[error("--input-len must be at least 1")]
    InputLen,
    /// TPOT needs a second token.
    #[error("--output-len {0}: must be at least 2 (TPOT is measured between tokens)")]
    OutputLen(u32),
    /// Nothing to simulate.
    #[error("--requests and --runs must be at least 1")]
    NoRequests,
}

/// The figures `vllm bench serve` prints, for the model's pooled requests.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelReport {
    /// How the KV moved.
    pub mode: Mode,
    /// TP of each instance.
    pub tp: u32,
    /// Prompt tokens.
    pub input_len: u32,
    /// Output tokens.
    pub output_len: u32,
    /// Arrival rate.
    pub qps: f64,
    /// Requests per run.
    pub requests: usize,
    /// Runs pooled.
    pub runs: usize,
    /// First seed.
    pub seed: u64,
    /// Mean time to first token, ms.
    pub mean_ttft_ms: f64,
    /// Median TTFT, ms.
    pub median_ttft_ms: f64,
    /// 99th percentile TTFT (nearest rank), ms.
    pub p99_ttft_ms: f64,
    /// Mean time per output token after the first, ms.
    pub mean_tpot_ms: f64,
    /// Completed requests ÷ time from the start to the last completion, mean over runs.
    pub req_per_s: f64,
    /// Mean transfer time (push: prefill end → KV on D; pull: read issued → KV on D), ms.
    pub mean_transfer_ms: f64,
    /// The deployment simulated.
    pub deployment: Deployment,
}

impl ModelReport {
    /// A one-line table.
    pub fn render_table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "mode {:?}  TP {}  in {} out {}  QPS {}  ({} runs × {} requests, seed {})",
            self.mode,
            self.tp,
            self.input_len,
            self.output_len,
            self.qps,
            self.runs,
            self.requests,
            self.seed
        );
        let _ = writeln!(
            out,
            "TTFT mean {:.2} ms  median {:.2} ms  p99 {:.2} ms  TPOT {:.2} ms  {:.2} req/s  transfer {:.2} ms",
            self.mean_ttft_ms,
            self.median_ttft_ms,
            self.p99_ttft_ms,
            self.mean_tpot_ms,
            self.req_per_s,
            self.mean_transfer_ms
        );
        out
    }
}

/// Runs the model.
pub fn run_model(options: &ModelOptions) -> Result<ModelReport, ModelError> {
    options.validate()?;
    let mut ttft = Vec::with_capacity(options.requests * options.runs);
    let mut tpot_sum = 0.0;
    let mut transfer_sum = 0.0;
    let mut rate_sum = 0.0;
    for run in 0..options.runs {
        let workload = Workload {
            mode: options.mode,
            arrivals: options.arrivals,
            input_len: options.input_len,
            output_len: options.output_len,
            qps: options.qps,
            requests: options.requests,
            seed: options.seed.wrapping_add(run as u64),
        };
        let times = simulate(&options.deployment, &workload);
        let mut last = 0.0_f64;
        for t in &times {
            ttft.push(t.first_token - t.arrival);
            tpot_sum += (t.finish - t.first_token) / f64::from(options.output_len - 1);
            transfer_sum += t.transfer;
            last = last.max(t.finish);
        }
        rate_sum += times.len() as f64 / last.max(f64::MIN_POSITIVE);
    }
    let count = ttft.len() as f64;
    ttft.sort_by(f64::total_cmp);
    let rank = |q: f64| ttft[((q * count).ceil() as usize).clamp(1, ttft.len()) - 1];
    Ok(ModelReport {
        mode: options.mode,
        tp: options.deployment.tp,
        input_len: options.input_len,
        output_len: options.output_len,
        qps: options.qps,
        requests: options.requests,
        runs: options.runs,
        seed: options.seed,
        mean_ttft_ms: ttft.iter().sum::<f64>() / count * 1e3,
        median_ttft_ms: rank(0.5) * 1e3,
        p99_ttft_ms: rank(0.99) * 1e3,
        mean_tpot_ms: tpot_sum / count * 1e3,
        req_per_s: rate_sum / options.runs as f64,
        mean_transfer_ms: transfer_sum / count * 1e3,
        deployment: options.deployment.clone(),
    })
}

/// One row of the seed's push/pull table (`seed-benchmarks.md`): the fit's data.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SeedRow {
    /// Push or pull.
    pub mode: Mode,
    /// Prompt tokens.
    pub input_len: u32,
    /// Output tokens.
    pub output_len: u32,
    /// Arrival rate.
    pub qps: f64,
    /// Mean TTFT, ms.
    pub mean_ttft_ms: f64,
    /// Median TTFT, ms.
    pub median_ttft_ms: f64,
    /// p99 TTFT, ms.
    pub p99_ttft_ms: f64,
    /// Mean TPOT, ms.
    pub mean_tpot_ms: f64,
    /// Completed requests per second.
    pub req_per_s: f64,
}

const fn row(mode: Mode, input_len: u32, output_len: u32, qps: f64, f: [f64; 5]) -> SeedRow {
    SeedRow {
        mode,
        input_len,
        output_len,
        qps,
        mean_ttft_ms: f[0],
        median_ttft_ms: f[1],
        p99_ttft_ms: f[2],
        mean_tpot_ms: f[3],
        req_per_s: f[4],
    }
}

/// The seed's TP 4 rows, pull then push for each workload: the only rows the fit sees.
pub const SEED_TP4_ROWS: [SeedRow; 10] = [
    row(
        Mode::Pull,
        512,
        64,
        4.0,
        [110.94, 85.07, 740.03, 12.51, 3.86],
    ),
    row(
        Mode::Push,
        512,
        64,
        4.0,
        [74.46, 77.13, 100.24, 12.50, 3.87],
    ),
    row(
        Mode::Pull,
        512,
        128,
        4.0,
        [301.92, 89.22, 1125.98, 12.66, 3.63],
    ),
    row(
        Mode::Push,
        512,
        128,
        4.0,
        [93.77, 79.95, 302.37, 12.59, 3.75],
    ),
    row(
        Mode::Pull,
        512,
        128,
        8.0,
        [2948.11, 2682.32, 7258.96, 12.70, 4.65],
    ),
    row(
        Mode::Push,
        512,
        128,
        8.0,
        [1212.48, 1275.05, 2826.72, 12.67, 5.92],
    ),
    row(
        Mode::Pull,
        1024,
        128,
        4.0,
        [330.94, 91.26, 1163.70, 12.74, 3.62],
    ),
    row(
        Mode::Push,
        1024,
        128,
        4.0,
        [273.83, 84.10, 1096.88, 12.79, 3.67],
    ),
    row(
        Mode::Pull,
        2048,
        128,
        4.0,
        [352.22, 98.53, 1225.20, 12.88, 3.61],
    ),
    row(
        Mode::Push,
        2048,
        128,
        4.0,
        [239.65, 88.23, 1042.32, 12.85, 3.73],
    ),
];

/// One workload of the fit: the seed's pull and push rows and the model's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FitPair {
    /// The seed's pull row.
    pub seed_pull: SeedRow,
    /// The seed's push row.
    pub seed_push: SeedRow,
    /// The model's pull run.
    pub model_pull: ModelReport,
    /// The model's push run.
    pub model_push: ModelReport,
    /// The model's layer-wise push run on the same workload.
    pub model_layerwise: ModelReport,
    /// Seed's mean-TTFT pull/push ratio.
    pub seed_ratio: f64,
    /// The model's.
    pub model_ratio: f64,
    /// `model_ratio / seed_ratio - 1`.
    pub ratio_error: f64,
    /// The model's ratio over other benchmark seeds (filled for the fit's best point only).
    pub spread: Option<RatioSpread>,
}

/// How the model's pull/push ratio of one workload varies with the benchmark's `--seed` (other
/// send-time sequences, one run of 100 requests each, like the seed's runs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RatioSpread {
    /// Seeds tried: 1 to `seeds`.
    pub seeds: usize,
    /// The smallest ratio.
    pub min: f64,
    /// The median ratio.
    pub median: f64,
    /// The largest ratio.
    pub max: f64,
    /// Fraction of the seeds whose ratio is within ±20% of the seed's.
    pub within_20_percent: f64,
}

/// The fit's result: the chosen free parameters and every TP 4 pair under them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FitReport {
    /// The best grid point.
    pub best: FreeParameters,
    /// Its largest |ratio error| over the five pairs.
    pub max_ratio_error: f64,
    /// Its largest |pull TPOT − push TPOT| over the five pairs, ms.
    pub max_tpot_gap_ms: f64,
    /// The pairs under the best point.
    pub pairs: Vec<FitPair>,
    /// Grid points tried.
    pub grid_points: usize,
    /// Grid points whose TPOT gap is within [`TPOT_GAP_LIMIT_MS`].
    pub feasible_points: usize,
}

/// The seed's pull and push TPOTs differ by at most 0.07 ms on every TP 4 row: a grid point
/// whose model differs by more than this on any row is ranked after every point that does not.
pub const TPOT_GAP_LIMIT_MS: f64 = 0.1;

/// Benchmark seeds (1 to this) over which the fit reports the spread of the best point's ratios.
pub const SPREAD_SEEDS: usize = 50;

impl FitReport {
    /// The seed-vs-model table (markdown).
    pub fn render_table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "fit: prefill MFU {:.2}, D max running {}, post {:.2} µs/descriptor, {:?} table, repeated prompts {}; max |ratio error| {:.1}%, max TPOT gap {:.2} ms ({} grid points, {} within the TPOT gap)\n",
            self.best.prefill_mfu,
            self.best.decode_max_running,
            self.best.post_per_descriptor_s * 1e6,
            self.best.block_table,
            self.best.repeated_prompts,
            self.max_ratio_error * 100.0,
            self.max_tpot_gap_ms,
            self.grid_points,
            self.feasible_points
        );
        out.push_str(&render_pairs(&self.pairs));
        out
    }
}

/// The seed-vs-model markdown table of `pairs`.
pub fn render_pairs(pairs: &[FitPair]) -> String {
    let mut out = String::from(
        "| in/out/QPS | mode | seed mean | model mean | seed median | model median | seed p99 | model p99 | seed TPOT | model TPOT | seed req/s | model req/s |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for pair in pairs {
        for (seed, model) in [
            (&pair.seed_pull, &pair.model_pull),
            (&pair.seed_push, &pair.model_push),
        ] {
            let _ = writeln!(
                out,
                "| {}/{}/{} | {:?} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
                seed.input_len,
                seed.output_len,
                seed.qps,
                seed.mode,
                seed.mean_ttft_ms,
                model.mean_ttft_ms,
                seed.median_ttft_ms,
                model.median_ttft_ms,
                seed.p99_ttft_ms,
                model.p99_ttft_ms,
                seed.mean_tpot_ms,
                model.mean_tpot_ms,
                seed.req_per_s,
                model.req_per_s
            );
        }
    }
    out.push_str(
        "\n| in/out/QPS | seed pull/push | model pull/push | error | model ratio over seeds 1–50: min / median / max | seeds within ±20% | model layer-wise mean TTFT |\n|---|---|---|---|---|---|---|\n",
    );
    for pair in pairs {
        let spread = pair.spread.as_ref().map_or_else(
            || ("–".to_string(), "–".to_string()),
            |s| {
                (
                    format!("{:.2} / {:.2} / {:.2}", s.min, s.median, s.max),
                    format!("{:.0}%", s.within_20_percent * 100.0),
                )
            },
        );
        let _ = writeln!(
            out,
            "| {}/{}/{} | {:.2} | {:.2} | {:+.1}% | {} | {} | {:.2} |",
            pair.seed_pull.input_len,
            pair.seed_pull.output_len,
            pair.seed_pull.qps,
            pair.seed_ratio,
            pair.model_ratio,
            pair.ratio_error * 100.0,
            spread.0,
            spread.1,
            pair.model_layerwise.mean_ttft_ms
        );
    }
    out
}

/// The model on the seed's TP 4 workloads under `deployment`.
pub fn tp4_pairs(base: &ModelOptions) -> Result<Vec<FitPair>, ModelError> {
    let mut pairs = Vec::new();
    for rows in SEED_TP4_ROWS.chunks(2) {
        let (seed_pull, seed_push) = (rows[0], rows[1]);
        let run = |mode| {
            run_model(&ModelOptions {
                mode,
                input_len: seed_pull.input_len,
                output_len: seed_pull.output_len,
                qps: seed_pull.qps,
                ..base.clone()
            })
        };
        let (model_pull, model_push, model_layerwise) =
            (run(Mode::Pull)?, run(Mode::Push)?, run(Mode::Layerwise)?);
        let seed_ratio = seed_pull.mean_ttft_ms / seed_push.mean_ttft_ms;
        let model_ratio = model_pull.mean_ttft_ms / model_push.mean_ttft_ms;
        pairs.push(FitPair {
            seed_pull,
            seed_push,
            model_pull,
            model_push,
            model_layerwise,
            seed_ratio,
            model_ratio,
            ratio_error: model_ratio / seed_ratio - 1.0,
            spread: None,
        });
    }
    Ok(pairs)
}

/// A grid point's rank: TPOT gap too large, worst ratio error, level error.
type RankKey = (bool, f64, f64);

/// Whether a grid point keyed (TPOT gap too large, worst ratio error, level error) ranks before
/// another: feasible first, then the smaller worst error (to 1e-9), then the smaller level error.
fn ranks_before(a: RankKey, b: RankKey) -> bool {
    if a.0 != b.0 {
        return !a.0;
    }
    if (a.1 - b.1).abs() > 1e-9 {
        return a.1 < b.1;
    }
    a.2 < b.2
}

/// The spread of `pair`'s model ratio over the benchmark seeds 1 to [`SPREAD_SEEDS`] (one run
/// each), under `base`'s deployment.
fn ratio_spread(base: &ModelOptions, pair: &FitPair) -> Result<RatioSpread, ModelError> {
    let mut ratios = Vec::with_capacity(SPREAD_SEEDS);
    for seed in 1..=SPREAD_SEEDS as u64 {
        let run = |mode| {
            run_model(&ModelOptions {
                mode,
                input_len: pair.seed_pull.input_len,
                output_len: pair.seed_pull.output_len,
                qps: pair.seed_pull.qps,
                runs: 1,
                seed,
                ..base.clone()
            })
        };
        ratios.push(run(Mode::Pull)?.mean_ttft_ms / run(Mode::Push)?.mean_ttft_ms);
    }
    ratios.sort_by(f64::total_cmp);
    let within = ratios
        .iter()
        .filter(|r| (*r / pair.seed_ratio - 1.0).abs() <= 0.2)
        .count();
    Ok(RatioSpread {
        seeds: ratios.len(),
        min: ratios[0],
        median: ratios[ratios.len() / 2],
        max: ratios[ratios.len() - 1],
        within_20_percent: within as f64 / ratios.len() as f64,
    })
}

/// The fit: every point of the grid ([`params::FIT_GRID_MFU`] × [`params::FIT_GRID_MAX_RUNNING`]
/// × [`params::FIT_GRID_POST_PER_DESCRIPTOR_S`] × [`params::FIT_GRID_BLOCK_TABLE`] ×
/// [`params::FIT_GRID_REPEATED_PROMPTS`]) on the five TP 4 workloads. Points whose pull and push
/// TPOTs differ by more than [`TPOT_GAP_LIMIT_MS`] on a row (the seed's never do) rank last;
/// then the point with the smallest largest |pull/push ratio error| wins, ties broken by the
/// mean-TTFT error of the ten rows (sum of squared log ratios).
pub fn fit(base: &ModelOptions) -> Result<FitReport, ModelError> {
    let mut best: Option<(RankKey, f64, FreeParameters, Vec<FitPair>)> = None;
    let mut grid_points = 0;
    let mut feasible_points = 0;
    let mut points = Vec::new();
    for &prefill_mfu in &params::FIT_GRID_MFU {
        for &decode_max_running in &params::FIT_GRID_MAX_RUNNING {
            for &post_per_descriptor_s in &params::FIT_GRID_POST_PER_DESCRIPTOR_S {
                for &block_table in &params::FIT_GRID_BLOCK_TABLE {
                    for &repeated_prompts in &params::FIT_GRID_REPEATED_PROMPTS {
                        points.push(FreeParameters {
                            prefill_mfu,
                            decode_max_running,
                            post_per_descriptor_s,
                            block_table,
                            repeated_prompts,
                        });
                    }
                }
            }
        }
    }
    for point in points {
        grid_points += 1;
        let options = ModelOptions {
            deployment: base.deployment.clone().with_fit(&point),
            ..base.clone()
        };
        let pairs = tp4_pairs(&options)?;
        let worst = pairs
            .iter()
            .map(|p| p.ratio_error.abs())
            .fold(0.0, f64::max);
        let tpot_gap = pairs
            .iter()
            .map(|p| (p.model_pull.mean_tpot_ms - p.model_push.mean_tpot_ms).abs())
            .fold(0.0, f64::max);
        let infeasible = tpot_gap > TPOT_GAP_LIMIT_MS;
        if !infeasible {
            feasible_points += 1;
        }
        let level: f64 = pairs
            .iter()
            .flat_map(|p| {
                [
                    (p.model_pull.mean_ttft_ms / p.seed_pull.mean_ttft_ms).ln(),
                    (p.model_push.mean_ttft_ms / p.seed_push.mean_ttft_ms).ln(),
                ]
            })
            .map(|e| e * e)
            .sum();
        let key = (infeasible, worst, level);
        let better = best
            .as_ref()
            .is_none_or(|(held, _, _, _)| ranks_before(key, *held));
        if better {
            best = Some((key, tpot_gap, point, pairs));
        }
    }
    let Some(((_, max_ratio_error, _), max_tpot_gap_ms, best, mut pairs)) = best else {
        return Err(ModelError::NoRequests);
    };
    let options = ModelOptions {
        deployment: base.deployment.clone().with_fit(&best),
        ..base.clone()
    };
    for pair in &mut pairs {
        pair.spread = Some(ratio_spread(&options, pair)?);
    }
    Ok(FitReport {
        best,
        max_ratio_error,
        max_tpot_gap_ms,
        pairs,
        grid_points,
        feasible_points,
    })
}
