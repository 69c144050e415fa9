//! `kvhandoff bench`: the benchmarks' arguments (`control`, `transfer`, `turns`, `kernels`,
//! `layerwise`, `report`) and their runs.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Subcommand};
use kvhandoff_bench::{self as bench, ControlOptions};

use super::conclude;

#[derive(Debug, Subcommand)]
pub(crate) enum BenchCommand {
    /// Cost of the pure state machines per request, and throughput of the actix system.
    Control(ControlArgs),
    /// One request's KV bytes moved by raw NIXL and by kvhandoff end to end (feature `nixl`).
    Transfer(TransferArgs),
    /// Turn 2 of a conversation: P reading the previous turn's KV back from D (measured) vs
    /// recomputing the prefix (a model), by prefix length.
    Turns(TurnsArgs),
    /// The KV block transforms (NHD/HND permute, block-size regroup, TP head slice/gather) on
    /// the CPU against memcpy, and their CUDA versions (compiled to PTX; run where a GPU is).
    Kernels(KernelsArgs),
    /// Exposed transfer time of whole-request vs layer-wise push by prompt length, over real
    /// NIXL, with P's forward pass emulated from a stated prefill throughput; every byte checked.
    Layerwise(LayerwiseArgs),
    /// Run every bench and write the generated section of `<out-dir>/benchmarks.md` (between its
    /// `report:begin`/`report:end` marker lines) and the plots `<out-dir>/plots/*.svg`.
    Report(ReportArgs),
}

#[derive(Debug, Args)]
pub(crate) struct LayerwiseArgs {
    /// Prompt lengths, in tokens, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "128,256,512,1024,2048,4096",
          value_parser = clap::value_parser!(u32).range(1..=131_072))]
    tokens: Vec<u32>,
    /// The emulated prefill's throughput, tokens per second (sets each layer's compute time).
    #[arg(long, default_value_t = 10_000.0)]
    prefill_tokens_per_s: f64,
    /// Layers of the model (8 KV heads of 128, bf16, 16-token blocks).
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=256))]
    layers: u32,
    /// Parts a layer-wise request is written in.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=256))]
    parts: u32,
    /// Prompts shorter than this many tokens go as one part.
    #[arg(long, default_value_t = 256)]
    min_tokens: u64,
    /// Timed rounds per prompt length and mode (the figure is the median).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=101))]
    rounds: u32,
    /// The transport: nixl, or mem (the in-memory one, no NIXL).
    #[arg(long, default_value = "nixl", value_parser = ["nixl", "mem"])]
    transport: String,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
pub(crate) struct ReportArgs {
    /// The folder of `benchmarks.md` (created if missing) and `plots/`.
    #[arg(long, default_value = "docs")]
    out_dir: PathBuf,
    /// Small sizes and few repetitions, a minute or two: a smoke run, not figures to compare.
    #[arg(long)]
    quick: bool,
    /// Print the summary of what ran as JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
pub(crate) struct KernelsArgs {
    /// Threads for the copy and every kernel [default: the machine's parallelism].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=256))]
    threads: Option<u32>,
    /// Blocks of the workload (each 16 tokens × 8 heads × 128 × bf16 = 32 KiB).
    #[arg(long, default_value_t = 2048, value_parser = clap::value_parser!(u32).range(4..=65_536))]
    blocks: u32,
    /// Timed rounds (after one untimed round); the figure is the median.
    #[arg(long, default_value_t = 7, value_parser = clap::value_parser!(u32).range(1..=1000))]
    rounds: u32,
    /// Do not compile or run the CUDA kernels.
    #[arg(long)]
    no_cuda: bool,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
pub(crate) struct TurnsArgs {
    /// Reusable prefix lengths to compare, tokens, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = bench::turns::DEFAULT_PREFIXES,
          value_parser = clap::value_parser!(u32).range(1..=1_048_576))]
    prefixes: Vec<u32>,
    /// Timed reads per prefix (after one untimed round); the figure is the median.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=1000))]
    repeats: u32,
    /// Tensor parallelism of the Llama-3.3-70B instance: one rank holds and reads 8/TP of the
    /// 8 KV heads (1, 2, 4 or 8).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=8))]
    tp: u32,
    /// Reads above this many MiB are not measured: their time is the line fitted through the
    /// measured ones.
    #[arg(long, default_value_t = 320, value_parser = clap::value_parser!(u64).range(1..=1_048_576))]
    max_read_mib: u64,
    /// How D's blocks and P's lie: scattered (one descriptor per block and region) or adjacent.
    #[arg(long, value_enum, default_value_t = TableArg::Fragmented)]
    table: TableArg,
    /// What the reads travel over: `auto` is NIXL when built with `--features nixl` and the
    /// runtime loads (`source scripts/nixl-env.sh`), the in-memory transport otherwise.
    #[arg(long, value_enum, default_value_t = TurnsTransportArg::Auto)]
    transport: TurnsTransportArg,
    /// P's prefill throughput for the recompute model, tokens/s per instance, instead of the
    /// figure calibrated on the seed's multi-turn run.
    #[arg(long, value_parser = parse_tokens_per_s)]
    prefill_tokens_per_s: Option<f64>,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum TableArg {
    /// No two blocks adjacent on either side.
    Fragmented,
    /// Each side's blocks adjacent.
    Contiguous,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum TurnsTransportArg {
    /// NIXL if available, else the in-memory transport (the report says which).
    Auto,
    /// NIXL (UCX, DRAM), or an error.
    Nixl,
    /// The in-memory transport.
    Mem,
}

fn parse_tokens_per_s(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(tps) if tps.is_finite() && tps > 0.0 => Ok(tps),
        _ => Err(format!(
            "{text}: expected a positive number of tokens per second"
        )),
    }
}

#[derive(Debug, Args)]
pub(crate) struct TransferArgs {
    /// Prompt tokens of the request (16 per block).
    #[arg(long, default_value_t = 2048, value_parser = clap::value_parser!(u32).range(16..=1_048_576))]
    tokens: u32,
    /// Timed repetitions per block table and path.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    repeats: u32,
    /// Plans of the fragmented 70B case.
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    plan_repeats: u32,
    /// Notification round trips per agent setting.
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    notify_rounds: u32,
    /// Measure only the default agent setting's notification round trip.
    #[arg(long)]
    no_notify_sweep: bool,
    /// Timed repetitions of the one-block handoff (`latency`).
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    latency_repeats: u32,
    /// Run the kvhandoff ranks without NIXL's arrival poller (timer-only polling, as before
    /// event-driven completion), for comparisons.
    #[arg(long)]
    no_arrival_poller: bool,
    /// Also measure the process's CPU for this many seconds while its two ranks sit idle.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=3600))]
    idle_secs: u64,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
pub(crate) struct ControlArgs {
    /// Requests per race order and round through the pure machines.
    #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(u32).range(1..=10_000_000))]
    requests: u32,
    /// Requests through the actix system per round.
    #[arg(long, default_value_t = 50_000, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    actix_requests: u32,
    /// Rounds of each measurement; the figures are the medians.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=101))]
    rounds: u32,
    /// Blocks in each engine's pool in the actix run (one per request: the most requests each
    /// side has in flight).
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..=65_536))]
    actix_pool_blocks: u32,
    /// Engine calls per submit in the actix run (one scheduler step's worth).
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=65_536))]
    actix_batch: u32,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    json: bool,
}

pub(crate) fn run_bench(command: BenchCommand) -> ExitCode {
    match command {
        BenchCommand::Control(args) => {
            let options = ControlOptions {
                requests: args.requests as usize,
                actix_requests: args.actix_requests as usize,
                actix_pool_blocks: args.actix_pool_blocks,
                actix_batch: args.actix_batch as usize,
                rounds: args.rounds as usize,
                ..ControlOptions::default()
            };
            conclude(
                bench::control(&options),
                args.json,
                "the benchmark",
                |r| r.render_table(),
                |_| true,
            )
        }
        BenchCommand::Transfer(args) => run_bench_transfer(args),
        BenchCommand::Turns(args) => run_bench_turns(args),
        BenchCommand::Report(args) => run_bench_report(args),
        BenchCommand::Layerwise(args) => {
            let transport = match args.transport.as_str() {
                "mem" => bench::layerwise::LayerwiseTransport::Mem,
                _ => bench::layerwise::LayerwiseTransport::Nixl,
            };
            let options = bench::layerwise::LayerwiseOptions {
                tokens: args.tokens,
                prefill_tokens_per_s: args.prefill_tokens_per_s,
                layers: args.layers,
                parts: args.parts,
                min_tokens: args.min_tokens,
                rounds: args.rounds as usize,
                transport,
                ..bench::layerwise::LayerwiseOptions::default()
            };
            conclude(
                bench::layerwise::layerwise(&options),
                args.json,
                "the layer-wise benchmark",
                |r| r.render_table(),
                |_| true,
            )
        }
        BenchCommand::Kernels(args) => {
            let defaults = bench::kernels::KernelBenchOptions::default();
            let options = bench::kernels::KernelBenchOptions {
                workload: bench::kernels::Workload {
                    blocks: args.blocks as usize,
                    ..defaults.workload
                },
                rounds: args.rounds as usize,
                threads: args.threads.map_or(defaults.threads, |t| t as usize),
                cuda: !args.no_cuda,
                ..defaults
            };
            conclude(
                bench::kernels::run(options),
                args.json,
                "the benchmark",
                |r| r.render_table(),
                |_| true,
            )
        }
    }
}

fn run_bench_report(args: ReportArgs) -> ExitCode {
    use bench::report::{run_report, ReportOptions, StderrProgress};
    let mut command = String::from("kvhandoff bench report");
    if args.quick {
        command.push_str(" --quick");
    }
    command.push_str(&format!(" --out-dir {}", args.out_dir.display()));
    let options = ReportOptions {
        out_dir: args.out_dir,
        quick: args.quick,
        command,
    };
    conclude(
        run_report(&options, &mut StderrProgress::new()),
        args.json,
        "the report",
        |r| r.render_table(),
        |_| true,
    )
}

fn run_bench_turns(args: TurnsArgs) -> ExitCode {
    let json = args.json;
    conclude(
        bench::turns::turns(&turns_options(args)),
        json,
        "the turns benchmark",
        |r| r.render_table(),
        |_| true,
    )
}

fn turns_options(args: TurnsArgs) -> bench::turns::TurnsOptions {
    use bench::turns::{ModelGeometry, TableKind, TurnsOptions, TurnsTransport};
    TurnsOptions {
        prefixes: args.prefixes,
        repeats: args.repeats as usize,
        geometry: ModelGeometry::llama_3_3_70b(args.tp),
        max_read_bytes: args.max_read_mib << 20,
        table: match args.table {
            TableArg::Fragmented => TableKind::Fragmented,
            TableArg::Contiguous => TableKind::Contiguous,
        },
        transport: match args.transport {
            TurnsTransportArg::Auto => TurnsTransport::Auto,
            TurnsTransportArg::Nixl => TurnsTransport::Nixl,
            TurnsTransportArg::Mem => TurnsTransport::Mem,
        },
        tokens_per_s: args.prefill_tokens_per_s,
        ..TurnsOptions::default()
    }
}

fn run_bench_transfer(args: TransferArgs) -> ExitCode {
    let options = bench::transfer::TransferOptions {
        tokens: args.tokens,
        repeats: args.repeats as usize,
        plan_repeats: args.plan_repeats as usize,
        notify_rounds: args.notify_rounds as usize,
        notify_sweep: !args.no_notify_sweep,
        latency_repeats: args.latency_repeats as usize,
        arrival_poller: !args.no_arrival_poller,
        idle_secs: args.idle_secs,
        ..bench::transfer::TransferOptions::default()
    };
    conclude(
        bench::transfer::transfer(&options),
        args.json,
        "the transfer benchmark",
        |r| r.render_table(),
        |_| true,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Cli, Command};
    use clap::Parser;

    fn turns_args(argv: &[&str]) -> TurnsArgs {
        let cli = Cli::try_parse_from(["kvhandoff", "bench", "turns"].iter().chain(argv))
            .unwrap_or_else(|e| panic!("{e}"));
        match cli.command {
            Command::Bench(BenchCommand::Turns(args)) => args,
            other => panic!("{other:?}"),
        }
    }

    /// `bench turns --json` with a tiny size (two short prefixes of the 70B rank, the in-memory
    /// transport, two repetitions) runs and renders valid JSON with the promised keys.
    #[test]
    fn bench_turns_json_runs_tiny() {
        let args = turns_args(&[
            "--json",
            "--prefixes",
            "16,48",
            "--repeats",
            "2",
            "--transport",
            "mem",
        ]);
        assert!(args.json);
        let report = bench::turns::turns(&turns_options(args)).unwrap_or_else(|e| panic!("{e}"));
        let text = serde_json::to_string_pretty(&report).expect("renders");
        let json: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
        for key in [
            "model",
            "compute_model",
            "transport",
            "rows",
            "threshold_tokens",
            "seed",
        ] {
            assert!(json.get(key).is_some(), "missing {key}: {text}");
        }
        assert_eq!(json["transport"], "mem");
        assert_eq!(json["model"]["bytes_per_token"], 327_680);
        assert!(json["compute_model"]["tokens_per_s"].as_f64().is_some());
        assert!(json["compute_model"]["source"].as_str().is_some());
        assert_eq!(json["seed"]["recompute_mean_ttft_ms"], 1049.77);
        assert_eq!(json["seed"]["pull_mean_ttft_ms"], 498.15);
        let rows = json["rows"].as_array().expect("rows");
        assert_eq!(rows.len(), 2);
        for row in rows {
            for key in [
                "prefix_tokens",
                "bytes",
                "read_ms",
                "recompute_ms",
                "ratio",
                "saved_ms",
            ] {
                assert!(row.get(key).is_some(), "missing rows[].{key}: {text}");
            }
        }
    }

    #[test]
    fn bench_report_defaults_to_the_full_run_into_docs() {
        let parse = |argv: &[&str]| {
            let cli = Cli::try_parse_from(["kvhandoff", "bench", "report"].iter().chain(argv))
                .unwrap_or_else(|e| panic!("{e}"));
            match cli.command {
                Command::Bench(BenchCommand::Report(args)) => args,
                other => panic!("{other:?}"),
            }
        };
        let args = parse(&[]);
        assert_eq!(args.out_dir, PathBuf::from("docs"));
        assert!(!args.quick && !args.json);
        let args = parse(&["--quick", "--json", "--out-dir", "/tmp/x"]);
        assert_eq!(args.out_dir, PathBuf::from("/tmp/x"));
        assert!(args.quick && args.json);
        assert!(Cli::try_parse_from(["kvhandoff", "bench", "report", "--rounds", "3"]).is_err());
    }

    #[test]
    fn bench_turns_defaults_are_the_70b_sweep() {
        let options = turns_options(turns_args(&[]));
        assert_eq!(options.prefixes, bench::turns::DEFAULT_PREFIXES);
        assert_eq!(options.geometry.bytes_per_token_per_rank(), 81_920);
        assert_eq!(options.max_read_bytes, 320 << 20);
        assert!(Cli::try_parse_from(["kvhandoff", "bench", "turns", "--tp", "16"]).is_err());
        assert!(Cli::try_parse_from([
            "kvhandoff",
            "bench",
            "turns",
            "--prefill-tokens-per-s",
            "0"
        ])
        .is_err());
    }
}
