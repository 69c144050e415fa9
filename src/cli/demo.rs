//! `kvhandoff demo`: its arguments and its run.

use std::process::ExitCode;

use clap::Args;
use kvhandoff_testkit::demo::{self, DemoOptions, DemoTransport};

use super::logging::LogArgs;
use super::{conclude, demo_mode, ModeArg};

#[derive(Debug, Args)]
pub(crate) struct DemoArgs {
    /// Requests to hand off.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    requests: u32,
    /// Seed of the schedule (prompt lengths, arrivals, ids).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// What the KV bytes travel over: `nixl` needs a build with `--features nixl` and the
    /// NIXL runtime (`source scripts/nixl-env.sh`).
    #[arg(long, value_enum, default_value_t = TransportArg::Mem)]
    transport: TransportArg,
    /// How the requests move their KV: `push` (P writes into D's blocks), `pull` (D reads
    /// P's exported blocks), `mixed` (each request's mode drawn from the seed) or `bidir`
    /// (multi-turn conversations: D keeps each turn's blocks, P reads them back for the next).
    #[arg(long, value_enum, default_value_t = ModeArg::Push)]
    mode: ModeArg,
    /// `--mode bidir`: turns per conversation (`--requests` counts turns).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=64))]
    turns: u32,
    /// `--mode bidir`: how long D keeps a turn's blocks for the next one, ms (the TTL of
    /// `keep_for_next_turn`; short for a demo).
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
    keep_ttl_ms: u64,
    /// `--mode bidir`: P reads a later turn's prefix back from D only when it saves at least
    /// this many tokens; below, P declines D's blocks and recomputes.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
    recompute_threshold: u32,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    log: LogArgs,
    /// Integrity digests on both ranks: P digests every block it writes (XXH3-64), D checks
    /// every block that lands and fails a mismatching request (the in-memory transport only:
    /// NIXL cannot read its registered memory, and the ranks refuse to start).
    #[arg(long)]
    integrity_digest: bool,
    #[command(flatten)]
    pair: super::pair_args::PairArgs,
    /// With `--model` (mem only): share of requests, 0 to 1, that arm one transport fault on a
    /// random P rank as they start (a refused post, a failed or half-landed write, a late
    /// landing). The verdict is then FAILED by design; the report's accounting must still hold.
    #[arg(long, requires = "model", default_value_t = 0.0)]
    chaos: f64,
    /// With `--model`: every rank pairs over its own TCP side channel on loopback (rank R at
    /// its engine's base port + R) and D names its request's buffers in its registration, where
    /// P places the pieces: the wire of a pair across processes, in one process.
    #[arg(long, requires = "model")]
    side_channels: bool,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum TransportArg {
    /// The in-memory transport.
    Mem,
    /// NIXL (UCX, DRAM): two agents in one process.
    Nixl,
}

pub(crate) fn run_demo(args: DemoArgs) -> ExitCode {
    let _logs = match args.log.init() {
        Ok(guard) => guard,
        Err(error) => {
            eprintln!("error: {error}");
            return ExitCode::from(2);
        }
    };
    if args.pair.model.is_some() {
        return run_hetero(&args);
    }
    let options = DemoOptions {
        transport: match args.transport {
            TransportArg::Mem => DemoTransport::Mem,
            TransportArg::Nixl => DemoTransport::Nixl,
        },
        mode: demo_mode(args.mode),
        requests: args.requests as usize,
        seed: args.seed,
        turns: args.turns,
        keep_ttl: std::time::Duration::from_millis(args.keep_ttl_ms),
        recompute_threshold: args.recompute_threshold,
        integrity_digest: args.integrity_digest,
        ..DemoOptions::default()
    };
    let result = with_progress(&options, || demo::run(&options));
    conclude(
        result,
        args.json,
        "the demo",
        |r| r.render_table(),
        |r| r.verdict_ok(),
    )
}

/// Runs `run` with a progress bar (or plain lines, see `progress`) over the requests whose KV
/// arrived or failed, read from the process's metrics (the demo is this process's only
/// runtime), so that the demo itself needs no hook.
fn with_progress<R>(options: &DemoOptions, run: impl FnOnce() -> R) -> R {
    use std::sync::atomic::{AtomicBool, Ordering};
    let received = || {
        let m = kvhandoff::metrics::snapshot();
        m.requests_ready + m.requests_failed + m.requests_recomputed
    };
    let turns = match options.mode {
        kvhandoff_testkit::demo::DemoMode::Bidir => u64::from(options.turns.max(1)),
        _ => 1,
    };
    let progress = super::progress::SweepProgress::new("requests", options.requests as u64 * turns);
    let before = received();
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        scope.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                progress.set_done(received().saturating_sub(before));
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        });
        let result = run();
        stop.store(true, Ordering::Relaxed);
        progress.finish();
        result
    })
}

/// `demo --model M --prefill SPEC --decode SPEC`: a pair the planner refuses, or a spec that
/// does not parse, is exit 2 with the reason (`{"error": …}` with `--json`), as `plan`'s.
fn run_hetero(args: &DemoArgs) -> ExitCode {
    use kvhandoff_testkit::hetero::pair_demo::{self as hetero, HeteroDemoOptions};
    let refuse = |error: String| super::pair_args::refuse(args.json, &error);
    let mode = match super::pair_args::PairMode::of(args.mode, args.pair.first_turn) {
        Ok(mode) => mode,
        Err(why) => return refuse(why),
    };
    let pair = match args.pair.specs() {
        Ok(Some(pair)) => pair,
        Ok(None) => return refuse("--model names the pair".into()),
        Err(e) => return refuse(e),
    };
    let options = HeteroDemoOptions {
        transport: match args.transport {
            TransportArg::Mem => DemoTransport::Mem,
            TransportArg::Nixl => DemoTransport::Nixl,
        },
        requests: args.requests as usize,
        window: args.pair.window as usize,
        chaos: args.chaos,
        seed: args.seed,
        side_channels: args.side_channels,
        pull: mode.pull,
        mixed: mode.mixed,
        bidir: mode.bidir,
        ..HeteroDemoOptions::new(&pair.model, pair.prefill, pair.decode)
    };
    match hetero::run(&options) {
        Err(kvhandoff_testkit::demo::DemoError::Options(why)) => refuse(why),
        result => conclude(
            result,
            args.json,
            "the demo",
            |r| r.render_table(),
            |r| r.verdict_ok(),
        ),
    }
}
