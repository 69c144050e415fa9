//! `kvhandoff matrix`: every cell of the heterogeneous verification matrix run end to end and
//! verified byte for byte, with vLLM 0.33's verdict beside it.

use std::process::ExitCode;

use clap::Args;
use kvhandoff_testkit::hetero::matrix::{render_markdown, render_summary, run_matrix};

use super::print_json;

#[derive(Debug, Args)]
pub(crate) struct MatrixArgs {
    /// Threads running cells [default: the machine's cores].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=64))]
    threads: Option<u32>,
    /// Print every cell and the summary as JSON.
    #[arg(long, conflicts_with = "markdown")]
    json: bool,
    /// Print the tables of docs/compatibility.md.
    #[arg(long)]
    markdown: bool,
    /// Run every cell through the runtime instead (every rank a real rank, the lease protocol
    /// between them: `demo --model`), on the in-memory transport.
    #[arg(long, conflicts_with = "markdown")]
    runtime: bool,
    /// With `--runtime`: requests per cell.
    #[arg(long, requires = "runtime", default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=256))]
    requests: u32,
    /// With `--runtime`: every rank over its own TCP side channel on loopback, D naming its
    /// request's buffers in its registration and P placing its pieces there (the wire of a
    /// pair across processes).
    #[arg(long, requires = "runtime")]
    side_channels: bool,
    /// With `--runtime`: D reads each cell's requests (pull) instead of P writing them.
    #[arg(long, requires = "runtime")]
    pull: bool,
    /// With `--runtime`: after each request, its next turn reads D's kept blocks back into P
    /// (the pair planned the other way).
    #[arg(long, requires = "runtime", conflicts_with = "pull")]
    bidir: bool,
}

pub(crate) fn run_matrix_command(args: MatrixArgs) -> ExitCode {
    if args.runtime {
        use kvhandoff_testkit::hetero::matrix::runtime::{
            render_runtime_summary, run_runtime_matrix,
        };
        let report = run_runtime_matrix(
            args.requests as usize,
            2,
            args.side_channels,
            args.pull,
            args.bidir,
        );
        let printed = if args.json {
            print_json(&report)
        } else {
            print!("{}", render_runtime_summary(&report));
            true
        };
        return if printed && report.failed.is_empty() {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        };
    }
    let threads = args.threads.map_or_else(
        || std::thread::available_parallelism().map_or(1, usize::from),
        |t| t as usize,
    );
    let report = run_matrix(threads);
    let printed = if args.json {
        print_json(&report)
    } else if args.markdown {
        print!("{}", render_markdown(&report));
        true
    } else {
        print!("{}", render_summary(&report));
        true
    };
    // A refused cell is a verdict; a cell that ran and delivered a wrong byte is a bug.
    if printed && report.summary.broken == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
