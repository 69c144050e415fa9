//! `kvhandoff plan`: one pair of heterogeneous geometries planned (per P rank its target D
//! ranks, byte ranges, descriptor counts and transforms), or why the pair cannot work (exit 2).

use std::process::ExitCode;

use clap::Args;
use kvhandoff_testkit::hetero::plan_report::plan_report;

use super::print_json;

#[derive(Debug, Args)]
pub(crate) struct PlanArgs {
    /// A model of the catalog: gqa8, gqa2, mla, swa, mamba.
    #[arg(long)]
    model: String,
    /// P's geometry: `tp=N,block=N,layout=NHD|HND[,pp=N][,kbpl=N]`.
    #[arg(long)]
    prefill: String,
    /// D's geometry, the same way.
    #[arg(long)]
    decode: String,
    /// Tokens of the example request whose pieces are counted.
    #[arg(long, default_value_t = 100)]
    tokens: u64,
    /// Tokens D already holds in the example (whole D logical blocks): P's list is end-trimmed.
    #[arg(long, default_value_t = 0)]
    cached: u64,
    /// Also run the request on host memory (shuffled block ids) and check every byte.
    #[arg(long)]
    verify: bool,
    /// Print the plan as JSON (an impossible pair: `{"error": "..."}`, exit 2).
    #[arg(long)]
    json: bool,
}

pub(crate) fn run_plan(args: PlanArgs) -> ExitCode {
    let report = plan_report(
        &args.model,
        &args.prefill,
        &args.decode,
        args.tokens,
        args.cached,
        args.verify,
    );
    match report {
        Ok(report) => {
            let printed = if args.json {
                print_json(&report)
            } else {
                print!("{}", report.render_table());
                true
            };
            if printed {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(error) => {
            if args.json {
                print_json(&serde_json::json!({ "error": error.to_string() }));
            } else {
                eprintln!("error: {error}");
            }
            ExitCode::from(2)
        }
    }
}
