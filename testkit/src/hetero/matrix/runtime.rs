//! The matrix through the runtime: every cell run by the heterogeneous demo (every rank a real
//! rank, the lease protocol between them, pair sub-requests in the connectors, the route placing
//! each write) on the in-memory transport, every byte checked.

use std::time::Instant;

use serde::Serialize;

use super::{edge_cells, matrix_cells, Cell};
use crate::demo::DemoError;
use crate::hetero::pair_demo::{run, HeteroDemoOptions};

/// How one cell went through the runtime.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RuntimeCell {
    /// `model P-spec -> D-spec`.
    pub cell: String,
    /// Every request ready and verified, every block back, every event once.
    pub ok: bool,
    /// The demo's verdict line, or why the cell could not run.
    pub verdict: String,
}

/// Every cell's result through the runtime.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RuntimeMatrixReport {
    /// Requests per cell.
    pub requests_per_cell: usize,
    /// Requests in flight at once per cell.
    pub window: usize,
    /// `"push"` or `"pull"`.
    pub mode: String,
    /// Cells run.
    pub cells: usize,
    /// Cells whose every request verified.
    pub verified: usize,
    /// Cells the planner refused (a verdict, not a failure).
    pub rejected: usize,
    /// Requests over all cells.
    pub requests: u64,
    /// Sub-requests over all cells (one per link, side and request).
    pub sub_requests: u64,
    /// Wall time, seconds.
    pub seconds: f64,
    /// The cells that ran and went wrong (none when everything works).
    pub failed: Vec<RuntimeCell>,
}

fn name(cell: &Cell) -> String {
    format!("{} {} -> {}", cell.model.name, cell.prefill, cell.decode)
}

/// Runs every cell of [`matrix_cells`] and the [`edge_cells`] (pipeline stages, kernel blocks
/// per logical block, pairs the planner refuses) through the runtime, `requests` each,
/// `window` at once, the seed differing per cell; with `side_channels`, every rank over its own
/// TCP side channel and P placing its pieces where D's registration says (the wire of a pair
/// across processes, `HeteroDemoOptions::side_channels`); with `pull`, D reads every cell's
/// requests instead (`HeteroDemoOptions::pull`); with `bidir`, each request's next turn reads
/// D's kept blocks back into P (`HeteroDemoOptions::bidir`; a cell the planner cannot plan the
/// other way counts as rejected).
pub fn run_runtime_matrix(
    requests: usize,
    window: usize,
    side_channels: bool,
    pull: bool,
    bidir: bool,
) -> RuntimeMatrixReport {
    let start = Instant::now();
    let mut cells = matrix_cells();
    cells.extend(edge_cells());
    let mut report = RuntimeMatrixReport {
        requests_per_cell: requests,
        window,
        mode: match (pull, bidir) {
            (_, true) => "bidir",
            (true, false) => "pull",
            (false, false) => "push",
        }
        .into(),
        cells: cells.len(),
        verified: 0,
        rejected: 0,
        requests: 0,
        sub_requests: 0,
        seconds: 0.0,
        failed: Vec::new(),
    };
    for (i, cell) in cells.iter().enumerate() {
        let options = HeteroDemoOptions {
            requests,
            window,
            seed: i as u64 + 1,
            side_channels,
            pull,
            bidir,
            ..HeteroDemoOptions::new(cell.model.name, cell.prefill, cell.decode)
        };
        match run(&options) {
            Ok(demo) => {
                report.requests += demo.requests;
                report.sub_requests += demo.hetero.as_ref().map_or(0, |h| h.sub_requests);
                if demo.ok {
                    report.verified += 1;
                } else {
                    report.failed.push(RuntimeCell {
                        cell: name(cell),
                        ok: false,
                        verdict: demo.verdict,
                    });
                }
            }
            Err(DemoError::Options(_)) => report.rejected += 1,
            Err(error) => report.failed.push(RuntimeCell {
                cell: name(cell),
                ok: false,
                verdict: error.to_string(),
            }),
        }
    }
    report.seconds = start.elapsed().as_secs_f64();
    report
}

/// A short summary for a terminal.
pub fn render_runtime_summary(report: &RuntimeMatrixReport) -> String {
    let mut out = format!(
        "heterogeneous matrix through the runtime ({}, mem transport, {} requests per cell, {} in \
         flight)\n  cells {}   verified {}   rejected {}   failed {}\n  requests {}   \
         sub-requests {}   {:.1} s\n",
        report.mode,
        report.requests_per_cell,
        report.window,
        report.cells,
        report.verified,
        report.rejected,
        report.failed.len(),
        report.requests,
        report.sub_requests,
        report.seconds
    );
    for cell in report.failed.iter().take(20) {
        out.push_str(&format!("  FAILED {}: {}\n", cell.cell, cell.verdict));
    }
    out
}
