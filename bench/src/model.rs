//! `kvhandoff model`: a deployment model of disaggregated serving, push vs pull vs layer-wise push,
//! for the seed's setup (1 P + 1 D instance of Llama-3.3-70B on p5en: H200s and EFA). It is a
//! discrete-event simulation, deterministic for a seed: Poisson arrivals, P's chunked-prefill
//! steps (FLOPs at a fitted MFU), the KV transfer on each rank's link (bytes ÷ bandwidth plus
//! NIXL's post cost per descriptor), and D's decode steps (weights and KV read from HBM) with
//! requests joining at step boundaries under a running-request limit. Pull's read is issued by
//! D's scheduler and its post lengthens D's step; push's post lengthens P's. `docs/model.md`
//! gives every parameter's source, the fit and what the model leaves out.

mod fitting;
pub mod params;
mod sim;
#[cfg(test)]
mod tests;

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

pub use fitting::{
    fit, render_pairs, tp4_pairs, FitPair, FitReport, RatioSpread, SPREAD_SEEDS, TPOT_GAP_LIMIT_MS,
};
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
