//! `kvhandoff bench report`: runs every bench through its library function and writes the
//! generated part of `docs/benchmarks.md` and its plots (`docs/plots/*.svg`).
//!
//! What runs, in order ([`ReportPlan`] holds each bench's options, [`ReportPlan::full`] or
//! [`ReportPlan::quick`]):
//! 1. **control** ([`crate::control`]): the machines and the actix system, no bytes.
//! 2. **transfer** ([`crate::transfer::transfer`], feature `nixl`): raw NIXL vs kvhandoff on the
//!    contiguous and fragmented tables, and the one-block handoff whose samples make the latency
//!    CDF.
//! 3. **descriptor sweep** ([`crate::transfer::descriptor_sweep`], feature `nixl`): bandwidth by
//!    descriptor size, both paths.
//! 4. **fragmentation** ([`fragmentation_sweep`]): descriptors the planner makes as the block
//!    table fragments (pure).
//! 5. **turns** ([`crate::turns::turns`]): reading a previous turn's KV back vs recomputing it
//!    (NIXL when available, else the in-memory transport, and the report says which).
//! 6. **model** ([`crate::model::tp4_pairs`]): the deployment model on the seed's TP 4 rows, next
//!    to the seed's figures (which live in [`crate::model::SEED_TP4_ROWS`] only).
//! 7. **layer-wise**: not in this build (the bench is being written); the report says so.
//! 8. **kernels** ([`crate::kernels::run`], feature `cuda`): the KV block transforms.
//!
//! A bench that this build or machine cannot run (no `nixl` feature or runtime, no `cuda`
//! feature) is skipped with its reason in the report; any other failure stops the run before
//! anything is written. The markdown goes between the `report:begin` and `report:end` marker
//! lines of `<out-dir>/benchmarks.md` ([`splice_section`]), leaving the hand-written text
//! around them as it is; without markers the section is appended.

mod fragmentation;
mod machine;
mod markdown;
mod plots;
mod progress;
mod run;
mod sections;
#[cfg(test)]
mod tests;

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::kernels::{KernelBenchError, KernelBenchOptions, KernelBenchReport, Workload};
use crate::layerwise::{LayerwiseBenchError, LayerwiseOptions};
use crate::model::{FitPair, Mode, ModelError, ModelOptions};
use crate::transfer::{
    SweepOptions, SweepReport, TransferBenchError, TransferOptions, TransferReport,
};
use crate::turns::{TurnsBenchError, TurnsOptions, TurnsReport};
use crate::{BenchError, ControlOptions, ControlReport};

pub use fragmentation::{
    default_geometry, fragmentation_sweep, FragmentationError, FragmentationPoint,
    FragmentationSweep,
};
pub use machine::MachineInfo;
pub use markdown::{render_section, splice_section, MarkerError, REPORT_BEGIN, REPORT_END};
pub use plots::{
    bandwidth_svg, fragmentation_svg, latency_cdf_svg, layerwise_svg, model_svg, write_svg,
    PlotError, BANDWIDTH_PLOT, FRAGMENTATION_PLOT, LATENCY_CDF_PLOT, LAYERWISE_PLOT, MODEL_PLOT,
};
pub use progress::{Progress, Silent, StderrProgress};
pub use run::{nixl_unavailable, run_report};

/// The markdown file the report writes in its output folder.
pub const MARKDOWN_FILE: &str = "benchmarks.md";
/// The folder of the plots, inside the output folder.
pub const PLOTS_DIR: &str = "plots";

/// One row of the layer-wise bench as the report shows it: exposed transfer time of a prompt,
/// whole-request push against layer-wise push.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LayerwisePoint {
    /// Prompt tokens.
    pub tokens: u32,
    /// Transfer time not hidden behind compute, whole-request push, ms.
    pub exposed_ms_whole: f64,
    /// The same, layer-wise push, ms.
    pub exposed_ms_layerwise: f64,
}

/// What `bench report` is asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReportOptions {
    /// Where `benchmarks.md` is (or goes) and `plots/` goes.
    pub out_dir: PathBuf,
    /// Small sizes and few repetitions: the whole run in a minute or two, figures not for
    /// comparison.
    pub quick: bool,
    /// The command line the report names as its producer.
    pub command: String,
}

/// Each bench's options for one report run.
#[derive(Debug, Clone, PartialEq)]
pub struct ReportPlan {
    /// `bench control`.
    pub control: ControlOptions,
    /// `bench transfer`.
    pub transfer: TransferOptions,
    /// The descriptor-size sweep.
    pub sweep: SweepOptions,
    /// Blocks of the fragmentation sweep's request.
    pub fragmentation_blocks: u32,
    /// Levels of the fragmentation sweep, beyond 0.
    pub fragmentation_steps: u32,
    /// `bench turns`.
    pub turns: TurnsOptions,
    /// The model's base options (each TP 4 workload replaces mode, lengths and rate).
    pub model: ModelOptions,
    /// `bench kernels` (run with the `cuda` feature only).
    pub kernels: KernelBenchOptions,
    /// `bench layerwise` (over NIXL: skipped where NIXL is not).
    pub layerwise: LayerwiseOptions,
}

impl ReportPlan {
    /// The full run: every bench at its command line's defaults, except the one-block handoff,
    /// repeated 200 times for its CDF (50 by default).
    pub fn full() -> Self {
        ReportPlan {
            control: ControlOptions::default(),
            transfer: TransferOptions {
                latency_repeats: 200,
                ..TransferOptions::default()
            },
            sweep: SweepOptions::default(),
            fragmentation_blocks: 128,
            fragmentation_steps: 20,
            turns: TurnsOptions::default(),
            model: ModelOptions::seed(Mode::Push, 4, 512, 128, 4.0),
            kernels: KernelBenchOptions::default(),
            layerwise: LayerwiseOptions::default(),
        }
    }

    /// The quick run (`--quick`): small requests, few rounds; the model and the fragmentation
    /// sweep as in the full run (they take well under a second).
    pub fn quick() -> Self {
        let full = ReportPlan::full();
        ReportPlan {
            control: ControlOptions {
                requests: 20_000,
                actix_requests: 5_000,
                rounds: 3,
                ..ControlOptions::default()
            },
            transfer: TransferOptions {
                tokens: 256,
                repeats: 5,
                plan_repeats: 20,
                notify_rounds: 20,
                notify_sweep: false,
                latency_repeats: 50,
                ..TransferOptions::default()
            },
            sweep: SweepOptions::quick(),
            turns: TurnsOptions {
                prefixes: vec![16, 256, 1000],
                repeats: 2,
                ..TurnsOptions::default()
            },
            kernels: KernelBenchOptions {
                workload: Workload {
                    blocks: 64,
                    ..KernelBenchOptions::default().workload
                },
                rounds: 2,
                ..KernelBenchOptions::default()
            },
            layerwise: LayerwiseOptions {
                tokens: vec![256, 1_024],
                rounds: 1,
                ..LayerwiseOptions::default()
            },
            ..full
        }
    }
}

/// A bench's result, or why it did not run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome<T> {
    /// It ran.
    Ran(T),
    /// It did not: why.
    Skipped(String),
}

impl<T> Outcome<T> {
    /// The result, if it ran.
    pub fn ran(&self) -> Option<&T> {
        match self {
            Outcome::Ran(t) => Some(t),
            Outcome::Skipped(_) => None,
        }
    }
}

/// One step of the run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepSummary {
    /// The step.
    pub name: String,
    /// Whether it ran (false: skipped, and `note` says why).
    pub ran: bool,
    /// Wall time, s.
    pub seconds: f64,
    /// What it did, or why it was skipped.
    pub note: String,
}

/// Everything the markdown section is made of.
#[derive(Debug, Clone, PartialEq)]
pub struct ReportData {
    /// Where it ran.
    pub machine: MachineInfo,
    /// The command that produced it.
    pub command: String,
    /// `--quick`.
    pub quick: bool,
    /// The benches' options.
    pub plan: ReportPlan,
    /// The steps, in order.
    pub steps: Vec<StepSummary>,
    /// `bench control`.
    pub control: Outcome<ControlReport>,
    /// `bench transfer`.
    pub transfer: Outcome<TransferReport>,
    /// The descriptor-size sweep.
    pub sweep: Outcome<SweepReport>,
    /// The fragmentation sweep.
    pub fragmentation: FragmentationSweep,
    /// `bench turns`.
    pub turns: Outcome<TurnsReport>,
    /// The model on the seed's TP 4 workloads.
    pub model: Vec<FitPair>,
    /// The layer-wise bench.
    pub layerwise: Outcome<Vec<LayerwisePoint>>,
    /// `bench kernels`.
    pub kernels: Outcome<KernelBenchReport>,
    /// Plot files written (names inside `plots/`).
    pub plots: Vec<String>,
}

/// What a report run did (`--json` prints it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReportSummary {
    /// The markdown file written.
    pub markdown: PathBuf,
    /// The plots written.
    pub plots: Vec<PathBuf>,
    /// `--quick`.
    pub quick: bool,
    /// Wall time of the whole run, s.
    pub seconds: f64,
    /// Every step, in order.
    pub steps: Vec<StepSummary>,
}

impl ReportSummary {
    /// The summary for people.
    pub fn render_table(&self) -> String {
        let mut out = format!(
            "kvhandoff bench report: {} in {:.1} s{}\n",
            self.markdown.display(),
            self.seconds,
            if self.quick { " (quick)" } else { "" }
        );
        for s in &self.steps {
            out.push_str(&format!(
                "  {:<18} {:<8} {:>7.1} s  {}\n",
                s.name,
                if s.ran { "ran" } else { "skipped" },
                s.seconds,
                s.note
            ));
        }
        for p in &self.plots {
            out.push_str(&format!("  plot {}\n", p.display()));
        }
        out
    }
}

/// Why the report could not be produced.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// `bench control` failed.
    #[error("bench control: {0}")]
    Control(#[from] BenchError),
    /// `bench transfer` or the descriptor sweep failed.
    #[error("bench transfer: {0}")]
    Transfer(#[from] TransferBenchError),
    /// `bench turns` failed.
    #[error("bench turns: {0}")]
    Turns(#[from] TurnsBenchError),
    /// The model refused its options.
    #[error("model: {0}")]
    Model(#[from] ModelError),
    /// `bench kernels` failed.
    #[error("bench kernels: {0}")]
    Kernels(#[from] KernelBenchError),
    /// `bench layerwise` failed.
    #[error("bench layerwise: {0}")]
    Layerwise(#[from] LayerwiseBenchError),
    /// The fragmentation sweep failed.
    #[error(transparent)]
    Fragmentation(#[from] FragmentationError),
    /// A plot could not be drawn or written.
    #[error("plot {0}")]
    Plot(#[from] PlotError),
    /// The markdown file's markers are malformed.
    #[error("{}: {source}", path.display())]
    Markers {
        /// The markdown file.
        path: PathBuf,
        /// What is wrong with its markers.
        source: MarkerError,
    },
    /// A file or folder could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
}
