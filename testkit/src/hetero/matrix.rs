//! The verification matrix: every model of the catalog × TP pairs from {1,2,4,8}² × kernel
//! block sizes {16,32,64}² × layouts {NHD,HND}² (2,880 cells), each run end to end twice (150
//! tokens, then 100 tokens of which D holds the first 64: partly covered blocks, more than one
//! sliding window, the prefix end trim) and verified byte for byte, with vLLM 0.33's verdict
//! for the same cell beside it; and a few cells beyond it (PP, kernel blocks per logical block,
//! pairs that cannot work).

mod render;
pub mod runtime;

pub use render::{render_markdown, render_summary};

use std::collections::BTreeMap;
use std::time::Instant;

use kvhandoff_protocol::hetero::{
    plan_pair, Model, PairPlan, RunsOn, SideSpec, TransformKind, MODELS,
};
use kvhandoff_protocol::KvLayout;
use serde::Serialize;

use super::handoff::{Handoff, HandoffError, RequestShape};
use super::vllm::vllm_verdict;
use super::wire::{MemoryWire, Wire, WireError};

/// TP sizes of the matrix.
pub const TPS: [u32; 4] = [1, 2, 4, 8];
/// Kernel block sizes of the matrix.
pub const BLOCKS: [u32; 3] = [16, 32, 64];
/// Layouts of the matrix.
pub const LAYOUTS: [KvLayout; 2] = [KvLayout::Nhd, KvLayout::Hnd];
/// The two requests every cell runs: `(tokens, cached_tokens)`.
pub const PASSES: [(u64, u64); 2] = [(150, 0), (100, 64)];

/// One cell: a model and both sides' specs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cell {
    /// The model.
    pub model: &'static Model,
    /// P's spec.
    pub prefill: SideSpec,
    /// D's spec.
    pub decode: SideSpec,
}

/// Every cell of the matrix, in a fixed order (model, P TP, D TP, P block, D block, P layout,
/// D layout).
pub fn matrix_cells() -> Vec<Cell> {
    let mut cells = Vec::new();
    for model in &MODELS {
        for p_tp in TPS {
            for d_tp in TPS {
                for p_block in BLOCKS {
                    for d_block in BLOCKS {
                        for p_layout in LAYOUTS {
                            for d_layout in LAYOUTS {
                                cells.push(Cell {
                                    model,
                                    prefill: SideSpec::new(p_tp, p_block, p_layout),
                                    decode: SideSpec::new(d_tp, d_block, d_layout),
                                });
                            }
                        }
                    }
                }
            }
        }
    }
    cells
}

/// Cells beyond the matrix: PP stages, kernel blocks per logical block, and pairs that cannot
/// work (each rejected with its reason).
pub fn edge_cells() -> Vec<Cell> {
    let spec = |s: &str| s.parse::<SideSpec>().expect("edge cell specs parse");
    let m = |name| kvhandoff_protocol::hetero::model(name).expect("catalog model");
    [
        (
            "gqa8",
            "tp=2,pp=2,block=16,layout=HND",
            "tp=1,block=16,layout=HND",
        ),
        (
            "gqa8",
            "tp=4,pp=2,block=16,layout=NHD",
            "tp=2,block=32,layout=HND",
        ),
        (
            "gqa2",
            "tp=8,pp=4,block=64,layout=HND",
            "tp=1,block=16,layout=NHD",
        ),
        (
            "mla",
            "tp=8,pp=2,block=16,layout=HND",
            "tp=2,block=64,layout=NHD",
        ),
        (
            "swa",
            "tp=2,pp=2,block=32,layout=NHD",
            "tp=4,block=16,layout=HND",
        ),
        (
            "gqa8",
            "tp=1,pp=2,block=16,layout=HND",
            "tp=2,pp=2,block=16,layout=HND",
        ),
        (
            "gqa8",
            "tp=2,block=32,kbpl=2,layout=HND",
            "tp=4,block=16,kbpl=4,layout=NHD",
        ),
        (
            "swa",
            "tp=1,block=16,kbpl=2,layout=NHD",
            "tp=2,block=32,layout=HND",
        ),
        (
            "mamba",
            "tp=8,block=16,kbpl=4,layout=HND",
            "tp=2,block=64,layout=HND",
        ),
        (
            "gqa8",
            "tp=3,block=16,layout=HND",
            "tp=1,block=16,layout=HND",
        ),
        (
            "mamba",
            "tp=1,block=16,layout=HND",
            "tp=16,block=16,layout=HND",
        ),
        (
            "swa",
            "tp=1,pp=4,block=16,layout=HND",
            "tp=1,block=16,layout=HND",
        ),
        (
            "gqa8",
            "tp=1,block=16,layout=HND",
            "tp=1,block=24,layout=HND",
        ),
    ]
    .into_iter()
    .map(|(name, p, d)| Cell {
        model: m(name),
        prefill: spec(p),
        decode: spec(d),
    })
    .collect()
}

/// What one request of a cell did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PassReport {
    /// Prompt tokens.
    pub tokens: u64,
    /// Tokens D held already.
    pub cached_tokens: u64,
    /// Bytes the wire moved.
    pub bytes: u64,
    /// Pieces (NIXL descriptors) it posted.
    pub descriptors: usize,
    /// Staging bytes, both sides.
    pub staging_bytes: u64,
}

/// A cell's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    /// Every pass ran and every byte checked.
    Verified,
    /// The planner refused the pair or a request, or a pass delivered a wrong byte.
    Rejected,
}

/// One cell's report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CellReport {
    /// Model name.
    pub model: &'static str,
    /// P's spec.
    pub prefill: String,
    /// D's spec.
    pub decode: String,
    /// Verified or rejected.
    pub outcome: Outcome,
    /// Why it was rejected.
    pub reason: Option<String>,
    /// Whether the rejection is a failure of ours: the planner accepted the cell but its run
    /// failed or delivered a wrong byte (as opposed to a pair or request the planner refuses).
    pub broken: bool,
    /// Each pass (those that ran).
    pub passes: Vec<PassReport>,
    /// The transforms that run a kernel, as `kind on side`.
    pub transforms: Vec<String>,
    /// The most writes any D rank waits for.
    pub max_writers: u32,
    /// P ranks that write nothing (replicas another rank writes for).
    pub idle_prefill_ranks: usize,
    /// vLLM 0.33: `push`, `pull only` or `rejected`.
    pub vllm: &'static str,
    /// vLLM's reason (or note).
    pub vllm_reason: String,
}

/// The transforms of a pair that run a kernel, as `"permute on D"`.
pub fn kernel_transforms(pair: &PairPlan) -> Vec<String> {
    pair.pipeline
        .transforms
        .iter()
        .filter(|t| t.runs_on != RunsOn::Addressing && t.kind != TransformKind::ZeroTail)
        .map(|t| format!("{} {}", t.kind.label(), t.runs_on.label()))
        .collect()
}

/// Makes the wire of each pass (its index): a wire may bind to the arenas of its first call
/// (NIXL registers them), and every pass has arenas of its own.
pub type WireMaker<'a> = dyn FnMut(usize) -> Result<Box<dyn Wire>, WireError> + 'a;

/// Memory wires for every pass.
pub fn memory_wires(_pass: usize) -> Result<Box<dyn Wire>, WireError> {
    Ok(Box::new(MemoryWire))
}

/// Runs `cell` with `passes`, each over a wire from `wires`, and verifies every pass.
///
/// ```
/// use kvhandoff_testkit::hetero::matrix::{memory_wires, run_cell, Cell, Outcome, PASSES};
/// let cell = Cell {
///     model: kvhandoff_protocol::hetero::model("swa").unwrap(),
///     prefill: "tp=2,block=16,layout=NHD".parse().unwrap(),
///     decode: "tp=4,block=64,layout=HND".parse().unwrap(),
/// };
/// let report = run_cell(&cell, &PASSES, 1, &mut memory_wires);
/// assert_eq!(report.outcome, Outcome::Verified, "{:?}", report.reason);
/// ```
pub fn run_cell(
    cell: &Cell,
    passes: &[(u64, u64)],
    seed: u64,
    wires: &mut WireMaker<'_>,
) -> CellReport {
    let verdict = vllm_verdict(cell.model, &cell.prefill, &cell.decode);
    let mut report = CellReport {
        model: cell.model.name,
        prefill: cell.prefill.to_string(),
        decode: cell.decode.to_string(),
        outcome: Outcome::Rejected,
        reason: None,
        broken: false,
        passes: Vec::new(),
        transforms: Vec::new(),
        max_writers: 0,
        idle_prefill_ranks: 0,
        vllm: verdict.label(),
        vllm_reason: verdict.reason().to_string(),
    };
    let pair = match plan_pair(cell.model, cell.prefill, cell.decode) {
        Ok(pair) => pair,
        Err(error) => {
            report.reason = Some(error.to_string());
            return report;
        }
    };
    report.transforms = kernel_transforms(&pair);
    report.max_writers = pair.completions.iter().copied().max().unwrap_or(0);
    report.idle_prefill_ranks = pair.idle_prefill_ranks().len();
    for (i, &(tokens, cached_tokens)) in passes.iter().enumerate() {
        let shape = RequestShape {
            tokens,
            cached_tokens,
            seed: seed.wrapping_mul(31).wrapping_add(i as u64),
        };
        let outcome = Handoff::prepare(pair.clone(), shape).and_then(|mut h| {
            let mut wire = wires(i)?;
            let stats = h.run(wire.as_mut())?;
            Ok((h, stats))
        });
        let (handoff, stats) = match outcome {
            Ok(done) => done,
            Err(error) => {
                report.broken = !matches!(error, HandoffError::Plan(_) | HandoffError::Shape(_));
                report.reason = Some(format!("{tokens} tokens, {cached_tokens} cached: {error}"));
                return report;
            }
        };
        if let Err(mismatch) = handoff.verify() {
            report.broken = true;
            report.reason = Some(format!(
                "{tokens} tokens, {cached_tokens} cached: {mismatch}"
            ));
            return report;
        }
        report.passes.push(PassReport {
            tokens,
            cached_tokens,
            bytes: stats.bytes,
            descriptors: stats.descriptors,
            staging_bytes: stats.staging_bytes,
        });
    }
    report.outcome = Outcome::Verified;
    report
}

/// Counts over the matrix.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct MatrixSummary {
    /// Cells run.
    pub cells: usize,
    /// Cells verified.
    pub verified: usize,
    /// Cells rejected.
    pub rejected: usize,
    /// Rejected cells that are failures of ours (see [`CellReport::broken`]).
    pub broken: usize,
    /// Our rejection reasons, with counts.
    pub rejected_reasons: BTreeMap<String, usize>,
    /// Cells vLLM 0.33 runs in push mode.
    pub vllm_push: usize,
    /// Cells vLLM 0.33 runs only in pull mode.
    pub vllm_pull_only: usize,
    /// Cells vLLM 0.33 rejects in both modes.
    pub vllm_rejected: usize,
    /// vLLM's push refusals (the first reason of each cell it does not push), with counts.
    pub vllm_reasons: BTreeMap<String, usize>,
    /// Cells we verify that vLLM cannot push.
    pub verified_beyond_vllm_push: usize,
    /// Wall-clock seconds of the run.
    pub seconds: f64,
}

/// The whole matrix's report.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MatrixReport {
    /// The counts.
    pub summary: MatrixSummary,
    /// Every cell.
    pub cells: Vec<CellReport>,
    /// The cells beyond the matrix.
    pub edge_cells: Vec<CellReport>,
}

/// Runs `cells` over memory wires on up to `threads` threads (thread `t` takes cells `t`,
/// `t + threads`, ...), and returns their reports in the cells' order.
pub fn run_cells(cells: &[Cell], threads: usize) -> Vec<CellReport> {
    let threads = threads.clamp(1, 64).min(cells.len().max(1));
    let mut slots: Vec<Option<CellReport>> = vec![None; cells.len()];
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                scope.spawn(move || {
                    (t..cells.len())
                        .step_by(threads)
                        .map(|i| (i, run_cell(&cells[i], &PASSES, i as u64, &mut memory_wires)))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        for handle in handles {
            for (i, report) in handle.join().unwrap_or_default() {
                slots[i] = Some(report);
            }
        }
    });
    slots.into_iter().flatten().collect()
}

/// Runs the whole matrix and the edge cells.
pub fn run_matrix(threads: usize) -> MatrixReport {
    let start = Instant::now();
    let cells = run_cells(&matrix_cells(), threads);
    let edge_cells = run_cells(&edge_cells(), threads);
    let mut summary = summarize(&cells);
    summary.seconds = start.elapsed().as_secs_f64();
    MatrixReport {
        summary,
        cells,
        edge_cells,
    }
}

/// Counts `cells`.
pub fn summarize(cells: &[CellReport]) -> MatrixSummary {
    let mut s = MatrixSummary {
        cells: cells.len(),
        ..MatrixSummary::default()
    };
    for c in cells {
        match c.outcome {
            Outcome::Verified => s.verified += 1,
            Outcome::Rejected => {
                s.rejected += 1;
                s.broken += usize::from(c.broken);
                let reason = c.reason.clone().unwrap_or_default();
                *s.rejected_reasons.entry(reason).or_default() += 1;
            }
        }
        match c.vllm {
            "push" => s.vllm_push += 1,
            "pull only" => s.vllm_pull_only += 1,
            _ => s.vllm_rejected += 1,
        }
        if c.vllm != "push" {
            let first = c.vllm_reason.trim_start_matches("push: ");
            let first = first.split("; pull: ").next().unwrap_or(first);
            *s.vllm_reasons.entry(first.to_string()).or_default() += 1;
            if c.outcome == Outcome::Verified {
                s.verified_beyond_vllm_push += 1;
            }
        }
    }
    s
}
