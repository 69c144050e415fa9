//! The command line's subcommands, one module each with its arguments and the function that
//! runs it (`main.rs` only parses and dispatches), and what they share: the mode argument and
//! how a run's report and verdict become the output and the exit code.

pub(crate) mod bench;
pub(crate) mod cluster;
pub(crate) mod config;
pub(crate) mod demo;
pub(crate) mod logging;
pub(crate) mod matrix;
pub(crate) mod model;
pub(crate) mod node;
pub(crate) mod pair_args;
pub(crate) mod plan;
pub(crate) mod progress;
pub(crate) mod router;
pub(crate) mod sim;

use std::process::ExitCode;

use kvhandoff_testkit::demo::DemoMode;

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub(crate) enum ModeArg {
    /// P writes into the blocks D registered (NIXL WRITE).
    Push,
    /// P exports its blocks; D reads them (NIXL READ).
    Pull,
    /// Each request pushed or pulled, drawn from the seed.
    Mixed,
    /// Multi-turn conversations (each pushed or pulled, drawn from the seed); between turns P
    /// reads D's kept blocks back (NIXL READ) or recomputes.
    Bidir,
}

pub(crate) fn print_json<T: serde::Serialize>(value: &T) -> bool {
    match serde_json::to_string_pretty(value) {
        Ok(text) => {
            println!("{text}");
            true
        }
        Err(error) => {
            eprintln!("error: cannot render the report as JSON: {error}");
            false
        }
    }
}

/// Prints a run's report (JSON or a table) and turns its verdict into the exit code; a run that
/// could not start is reported as `what` with its error.
pub(crate) fn conclude<R: serde::Serialize, E: std::fmt::Display>(
    result: Result<R, E>,
    json: bool,
    what: &str,
    table: impl Fn(&R) -> String,
    ok: impl Fn(&R) -> bool,
) -> ExitCode {
    match result {
        Ok(report) => {
            let printed = if json {
                print_json(&report)
            } else {
                print!("{}", table(&report));
                true
            };
            if printed && ok(&report) {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(error) => {
            eprintln!("error: {what} could not run: {error}");
            ExitCode::FAILURE
        }
    }
}

pub(crate) fn demo_mode(mode: ModeArg) -> DemoMode {
    match mode {
        ModeArg::Push => DemoMode::Push,
        ModeArg::Pull => DemoMode::Pull,
        ModeArg::Mixed => DemoMode::Mixed,
        ModeArg::Bidir => DemoMode::Bidir,
    }
}
