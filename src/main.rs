//! The `kvhandoff` command line: parses the arguments and dispatches. Each subcommand's
//! arguments and the function that runs it live in `cli/` (`demo`, `node`, `bench`, `sim`,
//! `plan`, `matrix`, `model`); `completions` prints a shell's completion script.

mod cli;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use cli::bench::{run_bench, BenchCommand};
use cli::cluster::{run_cluster, ClusterArgs};
use cli::demo::{run_demo, DemoArgs};
use cli::matrix::{run_matrix_command, MatrixArgs};
use cli::model::{run_model_command, ModelArgs};
use cli::node::{run_node, NodeArgs};
use cli::plan::{run_plan, PlanArgs};
use cli::router::{run_router, RouterArgs};
use cli::sim::{run_sim, SimArgs};

/// kvhandoff: hands KV cache from prefill to decode engines over NIXL.
#[derive(Debug, Parser)]
#[command(name = "kvhandoff", version, about, long_about = None)]
struct Cli {
    /// A TOML file of option defaults, one table per subcommand (`[node]`, `[bench.transfer]`;
    /// keys are the long options). Also `KVHANDOFF_CONFIG`. Below it: the built-in defaults;
    /// above it: `KVHANDOFF_<SUBCOMMAND>_<OPTION>` variables, then the command line.
    #[arg(long, global = true, value_name = "FILE")]
    config: Option<std::path::PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print the crate and protocol versions and the NIXL runtime found.
    Version {
        /// Print them as JSON (`version`, `protocol_version`, `nixl`).
        #[arg(long)]
        json: bool,
    },
    /// P and D in one process hand requests' KV cache over; every byte is verified.
    Demo(DemoArgs),
    /// One engine role (P or D) of the demo as its own process, over NIXL and a TCP side
    /// channel; run one of each (either first). Needs a build with `--features nixl`.
    Node(Box<NodeArgs>),
    /// Every TP rank of a P and a D engine as a process of its own on this host (`node --tp N
    /// --rank R` each, over NIXL), run to the end and reported together; every process it
    /// started is stopped on failure, at its deadline and on Ctrl-C.
    Cluster(ClusterArgs),
    /// The router of a heterogeneous pair's processes (what `cluster --model … --mode pull`
    /// starts): P's ranks tell it their answers, D's ranks get P's answer from it.
    Router(RouterArgs),
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
    /// Print a shell completion script for `kvhandoff` (e.g. `kvhandoff completions bash >
    /// ~/.local/share/bash-completion/completions/kvhandoff`).
    Completions {
        /// The shell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

/// What `kvhandoff version` says of NIXL: not built in, or the runtime found and whether it
/// loads.
fn nixl_line() -> String {
    #[cfg(feature = "nixl")]
    {
        use kvhandoff_actors::transport::nixl::{nixl_runtime_available, nixl_runtime_folder};
        let found = nixl_runtime_folder()
            .and_then(|dir| dir.parent().map(|wheel| wheel.display().to_string()))
            .unwrap_or_else(|| "not found".into());
        match nixl_runtime_available() {
            Ok(()) => format!("NIXL runtime: {found} (loads)"),
            Err(e) => format!("NIXL runtime: {found}; {e}"),
        }
    }
    #[cfg(not(feature = "nixl"))]
    {
        "NIXL: not in this build (build with `--features nixl`)".to_string()
    }
}

/// `kvhandoff --version`: the crate and protocol versions and the NIXL runtime found.
fn long_version() -> &'static str {
    let text = format!(
        "{} (protocol version {})\n{}",
        env!("CARGO_PKG_VERSION"),
        kvhandoff_protocol::PROTOCOL_VERSION,
        nixl_line()
    );
    // Once per process, for clap's `'static` version text.
    Box::leak(text.into_boxed_str())
}

/// UCX writes its log to stdout unless `UCX_LOG_FILE` says otherwise, and the reports of
/// `--json` go there too: a warning it prints at exit (a transfer request it never got back,
/// after a peer died) would follow the JSON and break every reader of it. Its log goes to
/// stderr with the rest of the diagnostics, unless the user pointed it elsewhere.
fn keep_ucx_log_off_stdout() {
    if std::env::var_os("UCX_LOG_FILE").is_none() {
        // Before any thread starts and before the NIXL runtime (and UCX with it) is loaded.
        std::env::set_var("UCX_LOG_FILE", "stderr");
    }
}

fn main() -> ExitCode {
    use clap::{CommandFactory, FromArgMatches};
    keep_ucx_log_off_stdout();
    let wants_version = std::env::args().any(|a| a == "--version");
    let mut command = Cli::command();
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let env: Vec<(String, String)> = std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
        .collect();
    command = match cli::config::configure(command, &argv, &env) {
        Ok(command) => command,
        Err(error) => {
            eprintln!("error: {error}");
            return ExitCode::from(2);
        }
    };
    if wants_version {
        // Only then: finding and loading the NIXL runtime costs a little.
        command = command.long_version(long_version());
    }
    let cli = match Cli::from_arg_matches(&command.get_matches_from(argv)) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    match cli.command {
        Command::Version { json: true } => {
            let printed = cli::print_json(&serde_json::json!({
                "version": env!("CARGO_PKG_VERSION"),
                "protocol_version": kvhandoff_protocol::PROTOCOL_VERSION,
                "nixl": nixl_line(),
            }));
            if printed {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Command::Version { json: false } => {
            println!(
                "kvhandoff {} (protocol version {})",
                env!("CARGO_PKG_VERSION"),
                kvhandoff_protocol::PROTOCOL_VERSION
            );
            println!("{}", nixl_line());
            ExitCode::SUCCESS
        }
        Command::Demo(args) => run_demo(args),
        Command::Node(args) => run_node(*args),
        Command::Cluster(args) => run_cluster(args),
        Command::Router(args) => run_router(args),
        Command::Bench(command) => run_bench(command),
        Command::Sim(args) => run_sim(args),
        Command::Plan(args) => run_plan(args),
        Command::Matrix(args) => run_matrix_command(args),
        Command::Model(args) => run_model_command(args),
        Command::Completions { shell } => {
            use clap::CommandFactory;
            clap_complete::generate(
                shell,
                &mut Cli::command(),
                "kvhandoff",
                &mut std::io::stdout(),
            );
            ExitCode::SUCCESS
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_parses_with_and_without_json() {
        use clap::Parser;
        for (argv, json) in [
            (["kvhandoff", "version", "--json"].as_slice(), true),
            (["kvhandoff", "version"].as_slice(), false),
        ] {
            let cli = Cli::try_parse_from(argv).expect("parses");
            assert!(matches!(cli.command, Command::Version { json: j } if j == json));
        }
    }

    /// Every shell's script names the binary and its subcommands.
    #[test]
    fn completions_cover_every_subcommand() {
        use clap::CommandFactory;
        for shell in [
            clap_complete::Shell::Bash,
            clap_complete::Shell::Zsh,
            clap_complete::Shell::Fish,
        ] {
            let mut out = Vec::new();
            clap_complete::generate(shell, &mut Cli::command(), "kvhandoff", &mut out);
            let script = String::from_utf8(out).expect("UTF-8");
            for name in [
                "demo",
                "node",
                "cluster",
                "bench",
                "sim",
                "layerwise",
                "completions",
            ] {
                assert!(script.contains(name), "{shell}: {name} missing");
            }
        }
    }
}
