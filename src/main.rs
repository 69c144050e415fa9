//! The `kvhandoff` command line: parses the arguments and dispatches. Each subcommand's
//! arguments and the function that runs it live in `cli/` (`demo`, `node`, `bench`, `sim`,
//! `plan`, `matrix`, `model`).

mod cli;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use cli::bench::{run_bench, BenchCommand};
use cli::demo::{run_demo, DemoArgs};
use cli::matrix::{run_matrix_command, MatrixArgs};
use cli::model::{run_model_command, ModelArgs};
use cli::node::{run_node, NodeArgs};
use cli::plan::{run_plan, PlanArgs};
use cli::sim::{run_sim, SimArgs};

/// kvhandoff: hands KV cache from prefill to decode engines over NIXL.
#[derive(Debug, Parser)]
#[command(name = "kvhandoff", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print the crate and protocol versions.
    Version,
    /// P and D in one process hand requests' KV cache over; every byte is verified.
    Demo(DemoArgs),
    /// One engine role (P or D) of the demo as its own process, over NIXL and a TCP side
    /// channel; run one of each (either first). Needs a build with `--features nixl`.
    Node(NodeArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Deterministic simulation of P and D under faults, with an all-seeing checker.
    Sim(SimArgs),
    /// Plan a pair of heterogeneous geometries (TP, PP, block size, layout) of a catalog model:
    /// who writes whom, byte ranges, descriptors, transforms; exit 2 if the pair cannot work.
    Plan(PlanArgs),
    /// Run and verify every cell of the heterogeneous matrix (5 models × TP × block × layout).
    Matrix(MatrixArgs),
    /// The deployment model: TTFT and TPOT of push, pull or layer-wise push for the seed's 1P1D
    /// Llama-3.3-70B on H200s with EFA (a discrete-event simulation; `--fit` refits it).
    Model(ModelArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Version => {
            println!(
                "kvhandoff {} (protocol version {})",
                env!("CARGO_PKG_VERSION"),
                kvhandoff_protocol::PROTOCOL_VERSION
            );
            ExitCode::SUCCESS
        }
        Command::Demo(args) => run_demo(args),
        Command::Node(args) => run_node(args),
        Command::Bench(command) => run_bench(command),
        Command::Sim(args) => run_sim(args),
        Command::Plan(args) => run_plan(args),
        Command::Matrix(args) => run_matrix_command(args),
        Command::Model(args) => run_model_command(args),
    }
}
