//! The kernel benchmark without the CLI: prints `KernelBenchReport` as JSON.
//!
//! ```sh
//! cargo run --release -p kvhandoff-kernels --example bench_kernels -- [--threads N] [--blocks N] [--rounds N]
//! cargo run --release -p kvhandoff-kernels --features cuda --example bench_kernels   # + NVRTC
//! ```
//! `kvhandoff bench kernels --json` runs the same [`kvhandoff_kernels::bench::run`].

use std::process::ExitCode;

use kvhandoff_kernels::bench::{run, KernelBenchOptions};

fn main() -> ExitCode {
    let mut options = KernelBenchOptions::default();
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().and_then(|v| v.parse::<usize>().ok());
        let slot = match flag.as_str() {
            "--threads" => &mut options.threads,
            "--blocks" => &mut options.workload.blocks,
            "--rounds" => &mut options.rounds,
            _ => {
                eprintln!("usage: bench_kernels [--threads N] [--blocks N] [--rounds N]");
                return ExitCode::from(2);
            }
        };
        match value {
            Some(v) => *slot = v,
            None => {
                eprintln!("{flag} needs a number");
                return ExitCode::from(2);
            }
        }
    }
    match run(&options) {
        Ok(report) => match serde_json::to_string_pretty(&report) {
            Ok(json) => {
                println!("{json}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("{e}");
                ExitCode::FAILURE
            }
        },
        Err(e) => {
            eprintln!("bench kernels: {e}");
            ExitCode::FAILURE
        }
    }
}
