//! The verification matrix: every model of the catalog × TP pairs from {1,2,4,8}² × kernel
//! block sizes {16,32,64}² × layouts {NHD,HND}² (2,880 cells), each run end to end twice (150
//! tokens, then 100 tokens of which D holds the first 64: partly covered blocks, more than one
//! sliding window, the prefix end trim) and verified byte for byte, with vLLM 0.33's verdict
//! for the same cell beside it; and a few cells beyond it (PP, kernel blocks per logical block,
//! pairs that cannot work).

pub mod runtime;

use std::collections::BTreeMap;
use std::fmt::Write as _;
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

/// The terminal summary.
pub fn render_summary(report: &MatrixReport) -> String {
    let s = &report.summary;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "matrix: {} cells ({} models × TP {{1,2,4,8}}² × blocks {{16,32,64}}² × layouts \
         {{NHD,HND}}²), each {} requests, verified byte for byte in {:.1} s",
        s.cells,
        MODELS.len(),
        PASSES.len(),
        s.seconds
    );
    let _ = writeln!(
        out,
        "  verified {}  rejected {} (of which failures of ours: {})",
        s.verified, s.rejected, s.broken
    );
    for (reason, n) in &s.rejected_reasons {
        let _ = writeln!(out, "    {n:5} × {reason}");
    }
    let _ = writeln!(
        out,
        "  vLLM 0.33: push {}  pull only {}  rejected {}  (we verify {} cells vLLM cannot push)",
        s.vllm_push, s.vllm_pull_only, s.vllm_rejected, s.verified_beyond_vllm_push
    );
    for (reason, n) in &s.vllm_reasons {
        let _ = writeln!(out, "    {n:5} × {reason}");
    }
    let _ = writeln!(out, "edge cells:");
    for c in &report.edge_cells {
        let _ = writeln!(
            out,
            "  {:5} {} → {}: {}",
            c.model,
            c.prefill,
            c.decode,
            match c.outcome {
                Outcome::Verified => format!("verified ({})", join_or(&c.transforms, "no kernel")),
                Outcome::Rejected => format!("rejected: {}", c.reason.as_deref().unwrap_or("")),
            }
        );
    }
    out
}

fn join_or(items: &[String], empty: &str) -> String {
    if items.is_empty() {
        empty.to_string()
    } else {
        items.join(", ")
    }
}

/// The block-pair and layout-pair class of a cell, the table's column.
fn column(c: &Cell) -> usize {
    let (p, d) = (c.prefill, c.decode);
    match (p.block.cmp(&d.block), p.layout == d.layout) {
        (std::cmp::Ordering::Equal, true) => 0,
        (std::cmp::Ordering::Equal, false) => 1,
        (std::cmp::Ordering::Less, _) => 2,
        (std::cmp::Ordering::Greater, _) => 3,
    }
}

const COLUMNS: [&str; 4] = [
    "same block, same layout (6)",
    "same block, layouts differ (6)",
    "P block < D block (12)",
    "P block > D block (12)",
];

/// The tables of `docs/compatibility.md`: per model, per TP pair, per class of block and
/// layout pair, our verified count and vLLM 0.33's push / pull-only / rejected counts; then
/// where the transforms ran, vLLM's reasons, every cell we reject and the edge cells.
pub fn render_markdown(report: &MatrixReport) -> String {
    let cells = matrix_cells();
    let mut out = String::new();
    let s = &report.summary;
    let _ = writeln!(
        out,
        "Generated by `cargo run --release -- matrix --markdown`: {} cells, {} verified, {} \
         rejected; vLLM 0.33: {} push, {} pull only, {} rejected.\n",
        s.cells, s.verified, s.rejected, s.vllm_push, s.vllm_pull_only, s.vllm_rejected
    );
    let _ = writeln!(
        out,
        "Each entry: **cells verified / cells** · vLLM 0.33 `push` / `pull` (pull only) / `none` \
         (rejected in both modes).\n"
    );
    for model in &MODELS {
        let _ = writeln!(out, "### `{}`: {}\n", model.name, model.about);
        let _ = writeln!(out, "| P TP → D TP | {} |", COLUMNS.join(" | "));
        let _ = writeln!(out, "|---|---|---|---|---|");
        for p_tp in TPS {
            for d_tp in TPS {
                let mut entries = Vec::new();
                for col in 0..COLUMNS.len() {
                    let (mut n, mut ok, mut push, mut pull, mut none) = (0, 0, 0, 0, 0);
                    for (cell, r) in cells.iter().zip(&report.cells) {
                        let mine = cell.model.name == model.name
                            && cell.prefill.tp == p_tp
                            && cell.decode.tp == d_tp
                            && column(cell) == col;
                        if !mine {
                            continue;
                        }
                        n += 1;
                        ok += usize::from(r.outcome == Outcome::Verified);
                        match r.vllm {
                            "push" => push += 1,
                            "pull only" => pull += 1,
                            _ => none += 1,
                        }
                    }
                    let mut v = Vec::new();
                    for (count, label) in [(push, "push"), (pull, "pull"), (none, "none")] {
                        if count > 0 {
                            v.push(format!("{label} {count}"));
                        }
                    }
                    entries.push(format!("**{ok}/{n}** · {}", v.join(", ")));
                }
                let _ = writeln!(out, "| {p_tp} → {d_tp} | {} |", entries.join(" | "));
            }
        }
        let _ = writeln!(out);
    }
    let _ = writeln!(out, "### Where the transforms ran (cells per model)\n");
    let mut by: BTreeMap<(&str, String), usize> = BTreeMap::new();
    for r in &report.cells {
        let key = join_or(&r.transforms, "none (byte ranges only)");
        *by.entry((r.model, key)).or_default() += 1;
    }
    let _ = writeln!(out, "| model | kernels run | cells |\n|---|---|---|");
    for ((model, key), n) in &by {
        let _ = writeln!(out, "| `{model}` | {key} | {n} |");
    }
    let _ = writeln!(
        out,
        "\n### Why vLLM 0.33 does not push a cell (first reason, cells)\n"
    );
    let _ = writeln!(out, "| reason | cells |\n|---|---|");
    for (reason, n) in &s.vllm_reasons {
        let _ = writeln!(out, "| {reason} | {n} |");
    }
    let _ = writeln!(out, "\n### Cells we reject\n");
    if s.rejected == 0 {
        let _ = writeln!(out, "None: every cell of the matrix is verified.");
    }
    for r in report
        .cells
        .iter()
        .filter(|r| r.outcome == Outcome::Rejected)
    {
        let _ = writeln!(
            out,
            "- `{}` {} → {}: {}",
            r.model,
            r.prefill,
            r.decode,
            r.reason.as_deref().unwrap_or("")
        );
    }
    let _ = writeln!(out, "\n### Beyond the matrix\n");
    let _ = writeln!(
        out,
        "| model | P | D | ours | vLLM 0.33 |\n|---|---|---|---|---|"
    );
    for r in &report.edge_cells {
        let ours = match r.outcome {
            Outcome::Verified => format!("verified ({})", join_or(&r.transforms, "no kernel")),
            Outcome::Rejected => format!("rejected: {}", r.reason.as_deref().unwrap_or("")),
        };
        let vllm = if r.vllm_reason.is_empty() {
            r.vllm.to_string()
        } else {
            format!("{}: {}", r.vllm, r.vllm_reason)
        };
        let _ = writeln!(
            out,
            "| `{}` | `{}` | `{}` | {ours} | {vllm} |",
            r.model, r.prefill, r.decode
        );
    }
    out
}
