//! `kvhandoff model`: the deployment model (push, pull or layer-wise push for the seed's 1P1D
//! Llama-3.3-70B on p5en), or with `--fit` the grid search of its free parameters on the seed's
//! TP 4 rows.

use std::process::ExitCode;

use clap::Args;
use kvhandoff_bench::model::{self, Arrivals, BlockTable, Deployment, Mode, ModelOptions};

use super::conclude;

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum ModelModeArg {
    /// P writes the whole request into D's registered blocks after its prefill.
    Push,
    /// D's scheduler reads P's blocks (NIXL READ); the post sits in D's step.
    Pull,
    /// P writes each group of layers as it is computed (whole-request push below 256 tokens).
    Layerwise,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum ArrivalsArg {
    /// `vllm bench serve`'s generator (numpy's legacy MT19937, rescaled to `requests / qps` s).
    BenchServe,
    /// Exponential gaps from SplitMix64.
    Poisson,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum BlockTableArg {
    /// One descriptor per block and region (a pool after some serving).
    Fragmented,
    /// One descriptor per region.
    Contiguous,
}

#[derive(Debug, Args)]
pub(crate) struct ModelArgs {
    /// How the KV moves from P to D.
    #[arg(long, value_enum, default_value_t = ModelModeArg::Push)]
    mode: ModelModeArg,
    /// TP of the P and of the D instance (1, 2, 4 or 8: it splits 8 KV heads).
    #[arg(long, default_value_t = 4)]
    tp: u32,
    /// Prompt tokens of every request.
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..=1_048_576))]
    input_len: u32,
    /// Output tokens of every request (at least 2).
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u32).range(2..=1_048_576))]
    output_len: u32,
    /// Mean Poisson arrival rate, requests/s.
    #[arg(long, default_value_t = 4.0, value_parser = parse_positive)]
    qps: f64,
    /// Requests per run (the seed's runs had about 100).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    requests: u32,
    /// Independent runs pooled (seeds `seed`, `seed + 1`, …).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    runs: u32,
    /// The first run's seed (`vllm bench serve --seed`; its default, 0, gives the seed's own
    /// send times).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// How the send times are drawn.
    #[arg(long, value_enum, default_value_t = ArrivalsArg::BenchServe)]
    arrivals: ArrivalsArg,
    /// How the blocks lie in both pools.
    #[arg(long, value_enum, default_value_t = BlockTableArg::Fragmented)]
    table: BlockTableArg,
    /// Network bandwidth per GPU, GB/s, instead of p5en's EFA (50).
    #[arg(long, value_parser = parse_positive)]
    link_gbps: Option<f64>,
    /// Search the free parameters on the seed's TP 4 rows and print seed vs model.
    #[arg(long)]
    fit: bool,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    json: bool,
}

fn parse_positive(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(value) if value.is_finite() && value > 0.0 => Ok(value),
        _ => Err(format!("{text}: expected a positive number")),
    }
}

fn model_options(args: &ModelArgs) -> ModelOptions {
    let mut deployment = Deployment::seed(args.tp);
    deployment.block_table = match args.table {
        BlockTableArg::Fragmented => BlockTable::Fragmented,
        BlockTableArg::Contiguous => BlockTable::Contiguous,
    };
    if let Some(gbps) = args.link_gbps {
        deployment.link_bytes_per_s = gbps * 1e9;
    }
    ModelOptions {
        mode: match args.mode {
            ModelModeArg::Push => Mode::Push,
            ModelModeArg::Pull => Mode::Pull,
            ModelModeArg::Layerwise => Mode::Layerwise,
        },
        input_len: args.input_len,
        output_len: args.output_len,
        qps: args.qps,
        requests: args.requests as usize,
        runs: args.runs as usize,
        arrivals: match args.arrivals {
            ArrivalsArg::BenchServe => Arrivals::BenchServe,
            ArrivalsArg::Poisson => Arrivals::Poisson,
        },
        seed: args.seed,
        deployment,
    }
}

pub(crate) fn run_model_command(args: ModelArgs) -> ExitCode {
    let options = model_options(&args);
    if args.fit {
        return conclude(
            model::fit(&options),
            args.json,
            "the fit",
            |r| r.render_table(),
            |_| true,
        );
    }
    conclude(
        model::run_model(&options),
        args.json,
        "the model",
        |r| r.render_table(),
        |_| true,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Cli, Command};
    use clap::Parser;

    fn parse(argv: &[&str]) -> Result<ModelArgs, clap::Error> {
        let cli = Cli::try_parse_from(["kvhandoff", "model"].iter().chain(argv))?;
        match cli.command {
            Command::Model(args) => Ok(args),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn model_json_has_the_promised_keys() {
        let args = parse(&[
            "--mode",
            "pull",
            "--tp",
            "4",
            "--input-len",
            "512",
            "--output-len",
            "64",
            "--qps",
            "4",
            "--runs",
            "2",
            "--json",
        ])
        .unwrap_or_else(|e| panic!("{e}"));
        let report = model::run_model(&model_options(&args)).unwrap_or_else(|e| panic!("{e}"));
        let json = serde_json::to_value(&report).expect("renders");
        for key in [
            "mean_ttft_ms",
            "median_ttft_ms",
            "p99_ttft_ms",
            "mean_tpot_ms",
            "req_per_s",
        ] {
            assert!(
                json[key].as_f64().is_some_and(f64::is_finite),
                "{key}: {json}"
            );
        }
        assert_eq!(json["mode"], "pull");
    }

    #[test]
    fn bad_flags_are_errors_not_panics() {
        for argv in [
            &["--qps", "-1"][..],
            &["--qps", "0"],
            &["--qps", "nan"],
            &["--output-len", "1"],
            &["--input-len", "0"],
            &["--mode", "sideways"],
            &["--link-gbps", "0"],
        ] {
            assert!(parse(argv).is_err(), "{argv:?}");
        }
        for tp in ["0", "3", "16"] {
            let args = parse(&["--tp", tp]).unwrap_or_else(|e| panic!("{e}"));
            assert!(
                model::run_model(&model_options(&args)).is_err(),
                "--tp {tp}"
            );
        }
    }
}
