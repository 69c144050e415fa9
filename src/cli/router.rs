//! `kvhandoff router`: the router of a heterogeneous pair whose ranks run as processes of their
//! own (what `cluster --model …` starts beside the ranks): every holder rank tells it its answer
//! to each request (P's for a push or a pull, D's for a kept turn), and it hands rank 0's answer
//! to every reader rank once all the holder's ranks answered — or tells them the request is
//! abandoned when a holder refused it, restarted past it or went away.

use std::net::SocketAddr;
use std::process::ExitCode;

use super::print_json;

/// Arguments of `kvhandoff router`.
#[derive(Debug, clap::Args)]
pub(crate) struct RouterArgs {
    /// Where the ranks connect, HOST:PORT.
    #[arg(long)]
    listen: SocketAddr,
    /// Ranks of P's engine (every one answers each first turn: a push's or a pull's).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=64))]
    prefill_ranks: u32,
    /// Ranks of D's engine (every one answers each request it holds: a kept turn's).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    decode_ranks: u32,
    /// First turns the router decides (with `--turns`, as many next turns too, numbered after
    /// them); it stops once it decided every one.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    requests: u64,
    /// Every first turn has a next turn that P's ranks read back from D's (`--mode bidir`).
    #[arg(long)]
    turns: bool,
    /// The longest the router runs.
    #[arg(long, default_value_t = 120, value_parser = clap::value_parser!(u64).range(1..=3600))]
    timeout_secs: u64,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

pub(crate) fn run_router(args: RouterArgs) -> ExitCode {
    use kvhandoff_testkit::hetero::pair_demo::{run_router, RouterPlan};
    let timeout = std::time::Duration::from_secs(args.timeout_secs);
    let plan = RouterPlan {
        prefill_ranks: args.prefill_ranks,
        decode_ranks: args.decode_ranks,
        requests: args.requests,
        turns: args.turns,
    };
    match run_router(args.listen, plan, timeout) {
        Ok(report) => {
            let printed = if args.json {
                print_json(&report)
            } else {
                println!(
                    "kvhandoff router: {} forwarded, {} abandoned, {} undecided",
                    report.forwarded, report.abandoned, report.undecided
                );
                true
            };
            if printed && report.ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::from(2)
        }
    }
}
