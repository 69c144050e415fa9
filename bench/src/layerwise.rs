//! `kvhandoff bench layerwise`: how much of a push's transfer layer-wise push hides behind the
//! prefill, by prompt length.
//!
//! P's forward pass is emulated: a stated prefill throughput gives the prompt's compute time,
//! split evenly over the layers; as each layer's time passes, P writes that layer's KV (a
//! pattern over every byte, new each round) into its blocks and, layer-wise, reports the layer
//! ready. The transfer is real: two ranks over NIXL (or the in-memory transport) moving the
//! bytes, and every byte D receives is checked against the pattern. D registers first, as when
//! the router sends both legs at once. What is measured is the **exposed** transfer time: from
//! the end of the last layer's compute to D's `BlocksReady` — whole-request push starts its
//! write there; layer-wise push has written all but its last part by then.

use std::time::Duration;

use serde::{Deserialize, Serialize};

#[cfg(test)]
mod tests;

mod measure;

/// Which transport the two ranks use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LayerwiseTransport {
    /// NIXL over UCX (cargo feature `nixl`).
    Nixl,
    /// The in-memory transport (no NIXL: for tests).
    Mem,
}

/// What `bench layerwise` runs.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerwiseOptions {
    /// Prompt lengths, in tokens (default 128, 256, 512, 1,024, 2,048, 4,096).
    pub tokens: Vec<u32>,
    /// The emulated prefill's throughput, tokens per second (default 10,000).
    pub prefill_tokens_per_s: f64,
    /// Layers of the model (default 32; 8 KV heads of 128, bf16: a Llama-3-8B rank).
    pub layers: u32,
    /// Parts a layer-wise request is written in (default 8).
    pub parts: u32,
    /// Prompts shorter than this go as one part (default 256).
    pub min_tokens: u64,
    /// Timed rounds per prompt length and mode; the figure is their median (default 3).
    pub rounds: usize,
    /// The transport (default NIXL).
    pub transport: LayerwiseTransport,
    /// The longest one handoff may take before the run fails (default 60 s).
    pub timeout: Duration,
}

impl Default for LayerwiseOptions {
    fn default() -> Self {
        LayerwiseOptions {
            tokens: vec![128, 256, 512, 1_024, 2_048, 4_096],
            prefill_tokens_per_s: 10_000.0,
            layers: 32,
            parts: 8,
            min_tokens: 256,
            rounds: 3,
            transport: LayerwiseTransport::Nixl,
            timeout: Duration::from_secs(60),
        }
    }
}

/// The prompt lengths over which the target applies (1K to 4K tokens).
pub const TARGET_TOKENS: std::ops::RangeInclusive<u32> = 1_024..=4_096;

/// The reduction of exposed transfer time layer-wise push must reach over [`TARGET_TOKENS`].
pub const TARGET_REDUCTION: f64 = 0.6;

/// Most tokens of one prompt.
const MAX_TOKENS: u32 = 1 << 17;

impl LayerwiseOptions {
    fn check(&self) -> Result<(), LayerwiseBenchError> {
        let bad = |why: &str| Err(LayerwiseBenchError::Options(why.into()));
        if self.tokens.is_empty() || self.tokens.iter().any(|&t| t == 0 || t > MAX_TOKENS) {
            return bad("prompt lengths must be between 1 and 131,072 tokens");
        }
        if !(self.prefill_tokens_per_s.is_finite() && self.prefill_tokens_per_s >= 1.0) {
            return bad("the prefill throughput must be at least 1 token per second");
        }
        if !(1..=256).contains(&self.layers) || !(1..=self.layers).contains(&self.parts) {
            return bad("layers must be 1..=256 and parts 1..=layers");
        }
        if self.rounds == 0 || self.rounds > crate::MAX_ROUNDS {
            return bad("rounds must be between 1 and 101");
        }
        Ok(())
    }
}

/// One prompt length's figures.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerwiseRow {
    /// Prompt tokens.
    pub tokens: u32,
    /// Bytes of KV the request moves.
    pub bytes: u64,
    /// The emulated prefill's compute time, ms.
    pub compute_ms: f64,
    /// Parts the layer-wise request went in (1 below the threshold).
    pub parts: u32,
    /// Exposed transfer time of whole-request push, ms (median round).
    pub exposed_ms_whole: f64,
    /// Exposed transfer time of layer-wise push, ms (median round).
    pub exposed_ms_layerwise: f64,
    /// `1 − layerwise ÷ whole`.
    pub reduction: f64,
    /// Every round's exposed time, whole-request push, ms.
    pub rounds_ms_whole: Vec<f64>,
    /// Every round's exposed time, layer-wise push, ms.
    pub rounds_ms_layerwise: Vec<f64>,
    /// Bytes checked on D, over every round of both modes (every byte each moved).
    pub verified_bytes: u64,
}

/// What `bench layerwise` measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerwiseReport {
    /// The transport.
    pub transport: LayerwiseTransport,
    /// The emulated prefill's throughput, tokens per second.
    pub prefill_tokens_per_s: f64,
    /// Layers of the model.
    pub layers: u32,
    /// Parts of a layer-wise request above the threshold.
    pub parts: u32,
    /// The threshold below which a request goes as one part, tokens.
    pub min_tokens: u64,
    /// Rounds per prompt length and mode.
    pub rounds: usize,
    /// One row per prompt length.
    pub rows: Vec<LayerwiseRow>,
    /// The target: [`TARGET_REDUCTION`] over [`TARGET_TOKENS`].
    pub target_reduction: f64,
    /// Whether every row in [`TARGET_TOKENS`] reached it (false if no row is in that range).
    pub target_met: bool,
}

impl LayerwiseReport {
    /// The report as a table.
    pub fn render_table(&self) -> String {
        use std::fmt::Write as _;
        let mut out = format!(
            "layer-wise vs whole-request push ({:?}; prefill {:.0} tokens/s, {} layers, {} parts, \
             one part below {} tokens; median of {} rounds)\n",
            self.transport,
            self.prefill_tokens_per_s,
            self.layers,
            self.parts,
            self.min_tokens,
            self.rounds
        );
        let _ = writeln!(
            out,
            "{:>7} {:>10} {:>11} {:>6} {:>13} {:>16} {:>10}",
            "tokens",
            "KV MiB",
            "compute ms",
            "parts",
            "exposed whole",
            "exposed layerwise",
            "reduction"
        );
        for r in &self.rows {
            let _ = writeln!(
                out,
                "{:>7} {:>10.1} {:>11.1} {:>6} {:>13.2} {:>16.2} {:>10.2}",
                r.tokens,
                r.bytes as f64 / (1 << 20) as f64,
                r.compute_ms,
                r.parts,
                r.exposed_ms_whole,
                r.exposed_ms_layerwise,
                r.reduction
            );
        }
        let _ = writeln!(
            out,
            "target: reduction >= {} for {}..={} tokens: {}",
            self.target_reduction,
            TARGET_TOKENS.start(),
            TARGET_TOKENS.end(),
            if self.target_met { "met" } else { "NOT met" }
        );
        out
    }
}

/// Why `bench layerwise` produced no numbers.
#[derive(Debug, thiserror::Error)]
pub enum LayerwiseBenchError {
    /// Built without the `nixl` feature, and NIXL was asked for.
    #[error("`bench layerwise` over NIXL needs the `nixl` cargo feature (or `--transport mem`)")]
    NixlFeatureMissing,
    /// The options make no sense.
    #[error("invalid bench options: {0}")]
    Options(String),
    /// The ranks did not start (NIXL missing, a bind failed).
    #[error("could not start the ranks: {0}")]
    Start(String),
    /// A handoff failed, timed out, or D's bytes were wrong.
    #[error("the run failed: {0}")]
    Run(String),
}

/// Runs the bench.
///
/// # Errors
/// [`LayerwiseBenchError`] for bad options, ranks that do not start, or a handoff that fails
/// or delivers a wrong byte.
pub fn layerwise(options: &LayerwiseOptions) -> Result<LayerwiseReport, LayerwiseBenchError> {
    options.check()?;
    let rows = measure::run(options)?;
    let in_target: Vec<&LayerwiseRow> = rows
        .iter()
        .filter(|r| TARGET_TOKENS.contains(&r.tokens))
        .collect();
    let target_met =
        !in_target.is_empty() && in_target.iter().all(|r| r.reduction >= TARGET_REDUCTION);
    Ok(LayerwiseReport {
        transport: options.transport,
        prefill_tokens_per_s: options.prefill_tokens_per_s,
        layers: options.layers,
        parts: options.parts,
        min_tokens: options.min_tokens,
        rounds: options.rounds,
        rows,
        target_reduction: TARGET_REDUCTION,
        target_met,
    })
}
