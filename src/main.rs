//! The `kvhandoff` command line.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

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
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Version => {
            println!(
                "kvhandoff {} (protocol version {})",
                env!("CARGO_PKG_VERSION"),
                kvhandoff::protocol::PROTOCOL_VERSION
            );
            ExitCode::SUCCESS
        }
    }
}
