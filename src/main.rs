//! The `kvhandoff` command line.

use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use kvhandoff_cli::bench::{self, ControlOptions};
use kvhandoff_cli::demo::{self, DemoMode, DemoOptions, DemoTransport};
use kvhandoff_cli::node::{self, NodeOptions, NodeRole};

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
}

#[derive(Debug, Args)]
struct DemoArgs {
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
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum ModeArg {
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

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum TransportArg {
    /// The in-memory transport.
    Mem,
    /// NIXL (UCX, DRAM): two agents in one process.
    Nixl,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum RoleArg {
    /// `prefill-0`: fills the blocks and sends them.
    Prefill,
    /// `decode-0`: receives the blocks and checks every byte.
    Decode,
}

#[derive(Debug, Args)]
struct NodeArgs {
    /// This process's engine.
    #[arg(long, value_enum)]
    role: RoleArg,
    /// Where this rank's TCP side channel listens, HOST:PORT (port 0 picks one; printed on
    /// stderr).
    #[arg(long, value_parser = parse_addr)]
    listen: std::net::SocketAddr,
    /// The other role's side channel, HOST:PORT.
    #[arg(long, value_parser = parse_addr)]
    peer: std::net::SocketAddr,
    /// Requests to hand off (both processes must agree, as on every schedule option).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    requests: u32,
    /// Seed of the schedule (prompt lengths, arrivals, ids).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Longest prompt, in tokens (prompts are 16 tokens at least, or this many if fewer).
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    max_prompt_tokens: u32,
    /// Logical blocks (512 KiB each) in this side's pool.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pool_blocks: u32,
    /// Mean gap between prompt arrivals at P, ms (exponential). P's fills must keep up with
    /// the arrivals for both races to happen (P's report counts late finishes).
    #[arg(long, default_value_t = 20.0, value_parser = parse_gap_ms)]
    mean_arrival_gap_ms: f64,
    /// The whole process's limit, waiting for the peer included; past it the node reports
    /// FAILED.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    timeout_secs: u64,
    /// Run requests K.. of the seeded plan (a restarted node continues its predecessor's
    /// plan); request K arrives when the handshake completes.
    #[arg(long, default_value_t = 0, value_name = "K")]
    start_at: u32,
    /// Heartbeat interval, ms; the peer is declared dead after 1.5 intervals of silence
    /// (default: the protocol's 2000 ms, peer timeout 3000 ms).
    #[arg(long, value_parser = clap::value_parser!(u64).range(10..=600_000))]
    heartbeat_ms: Option<u64>,
    /// How long P holds finished blocks that no D registered, ms (default 30000).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
    lease_ms: Option<u64>,
    /// How long D waits for P's data after allocating, ms (default 120000).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
    decode_deadline_ms: Option<u64>,
    /// How long P keeps a registration whose prefill has not finished without renewal, ms
    /// (default 120000). Give both nodes the same value: D's fence is sized on it.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
    registration_ttl_ms: Option<u64>,
    /// The longest a posted write may stay in flight, ms (default 60000); P's write deadline
    /// and abandon wait fit inside it. Give both nodes the same value.
    #[arg(long, value_parser = clap::value_parser!(u64).range(3..=3_600_000))]
    max_write_life_ms: Option<u64>,
    /// The longest a control message may travel, ms (default 10000). Give both nodes the same
    /// value.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
    max_message_delay_ms: Option<u64>,
    /// How long P stays after its last event waiting for D to exit, ms.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(0..=3_600_000))]
    linger_ms: u64,
    /// The peer may die during the run (a kill test's survivor): exit 0 when every request has
    /// exactly one typed outcome, no ready request has a wrong byte and every block is back,
    /// even if requests failed.
    #[arg(long)]
    expect_peer_loss: bool,
    /// How the requests move their KV (both processes must agree): `push`, `pull`, `mixed` or
    /// `bidir`. Every mode but push needs `--router`.
    #[arg(long, value_enum, default_value_t = ModeArg::Push)]
    mode: ModeArg,
    /// The router link, HOST:PORT (D listens, P connects; give both the same): P's answers
    /// (a pulled request's block ids) reach D over it, and D's answers for a conversation's
    /// next turn reach P.
    #[arg(long, value_parser = parse_addr)]
    router: Option<std::net::SocketAddr>,
    /// TEST HOOK of the kill tests: right after this node's last engine call for request K of
    /// the plan (P: request_finished; D: keep_for_next_turn for a turn it keeps,
    /// request_allocated otherwise), stop this process with SIGSTOP (for the test to kill it
    /// there).
    #[arg(long, value_name = "K")]
    stop_self_after: Option<u32>,
    /// This many ms into the schedule, send this rank's handshake to the peer again, twice: a
    /// second dial through the link and a raw copy from a plain socket (a test of repeated
    /// handshakes: the peer must change nothing).
    #[arg(long, value_parser = clap::value_parser!(u64).range(0..=3_600_000))]
    repeat_handshake_ms: Option<u64>,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    json: bool,
}

fn parse_gap_ms(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(ms) if ms.is_finite() && (0.0..=60_000.0).contains(&ms) => Ok(ms),
        _ => Err(format!("{text}: expected milliseconds between 0 and 60000")),
    }
}

fn parse_addr(text: &str) -> Result<std::net::SocketAddr, String> {
    use std::net::ToSocketAddrs;
    text.to_socket_addrs()
        .map_err(|e| format!("{text}: {e}"))?
        .next()
        .ok_or_else(|| format!("{text} resolves to no address"))
}

#[derive(Debug, Args)]
struct SimArgs {
    /// One seed to run (replays it exactly).
    #[arg(long, conflicts_with = "seeds")]
    seed: Option<u64>,
    /// Seeds to run, half-open: `A..B`.
    #[arg(long, value_parser = kvhandoff_sim::parse_seed_range, default_value = "0..100")]
    seeds: std::ops::Range<u64>,
    /// Requests per seed: `N`, or `A..B` (inclusive) to draw a count per seed [default: 50;
    /// 10..300 with --long].
    #[arg(long, value_parser = parse_requests)]
    requests: Option<std::ops::RangeInclusive<usize>>,
    /// Blocks per engine rank: `N`, or `A..B` (inclusive) to draw a pool per seed [default: 24;
    /// 8..128 with --long].
    #[arg(long, value_parser = parse_pool_blocks)]
    pool_blocks: Option<std::ops::RangeInclusive<u32>>,
    /// Which faults to inject.
    #[arg(long, default_value = "chaos", value_parser = ["none", "network", "chaos"])]
    faults: String,
    /// How requests move their KV: push, pull, mixed (push or pull per request, some with a
    /// bidirectional second turn) or bidir (most with a second turn).
    #[arg(long, default_value = "mixed", value_parser = parse_mode)]
    mode: kvhandoff_sim::Mode,
    /// The long sweep: requests and pool sizes drawn per seed over wide ranges, four times the
    /// virtual time.
    #[arg(long)]
    long: bool,
    /// Run every endpoint with this deliberate bug (see --list-mutations): the run must fail.
    #[arg(long, value_parser = parse_mutation)]
    mutation: Option<kvhandoff_protocol::machine::Mutation>,
    /// Print the name of every deliberate bug, one per line, and exit.
    #[arg(long)]
    list_mutations: bool,
    /// Run the exhaustive small-scope check (1 P, 1 D, every choice sequence) instead of
    /// seeded worlds.
    #[arg(long)]
    exhaustive: bool,
    /// Engines retry failed allocations every few ms instead of queueing for freed blocks (the
    /// engine model of the first regression seeds; slow at high load).
    #[arg(long)]
    poll_allocations: bool,
    /// Print the report as JSON instead of a summary.
    #[arg(long)]
    json: bool,
}

fn parse_inclusive<T>(text: &str, lo: T, hi: T) -> Result<std::ops::RangeInclusive<T>, String>
where
    T: std::str::FromStr + PartialOrd + Copy + std::fmt::Display,
    T::Err: std::fmt::Display,
{
    let num = |s: &str| {
        s.trim()
            .parse::<T>()
            .map_err(|e| format!("bad number {s:?}: {e}"))
    };
    let (a, b) = match text.split_once("..") {
        Some((a, b)) => (num(a)?, num(b.trim_start_matches('='))?),
        None => {
            let n = num(text)?;
            (n, n)
        }
    };
    if a > b {
        return Err(format!("empty range {text:?}"));
    }
    if a < lo || b > hi {
        return Err(format!("{text:?} is outside {lo}..{hi}"));
    }
    Ok(a..=b)
}

fn parse_requests(text: &str) -> Result<std::ops::RangeInclusive<usize>, String> {
    parse_inclusive(text, 1, 10_000)
}

fn parse_pool_blocks(text: &str) -> Result<std::ops::RangeInclusive<u32>, String> {
    // A P request takes up to 4 blocks: a smaller pool could never start one.
    parse_inclusive(text, 4, 1 << 16)
}

fn parse_mutation(text: &str) -> Result<kvhandoff_protocol::machine::Mutation, String> {
    text.parse()
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// Cost of the pure state machines per request, and throughput of the actix system.
    Control(ControlArgs),
    /// One request's KV bytes moved by raw NIXL and by kvhandoff end to end (feature `nixl`).
    Transfer(TransferArgs),
    /// Turn 2 of a conversation: P reading the previous turn's KV back from D (measured) vs
    /// recomputing the prefix (a model), by prefix length.
    Turns(TurnsArgs),
}

#[derive(Debug, Args)]
struct TurnsArgs {
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
struct TransferArgs {
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
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
struct ControlArgs {
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

fn print_json<T: serde::Serialize>(value: &T) -> bool {
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
fn conclude<R: serde::Serialize, E: std::fmt::Display>(
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

fn demo_mode(mode: ModeArg) -> DemoMode {
    match mode {
        ModeArg::Push => DemoMode::Push,
        ModeArg::Pull => DemoMode::Pull,
        ModeArg::Mixed => DemoMode::Mixed,
        ModeArg::Bidir => DemoMode::Bidir,
    }
}

fn run_demo(args: DemoArgs) -> ExitCode {
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
        ..DemoOptions::default()
    };
    conclude(
        demo::run(&options),
        args.json,
        "the demo",
        |r| r.render_table(),
        |r| r.verdict_ok(),
    )
}

fn run_bench(command: BenchCommand) -> ExitCode {
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
    }
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

fn run_sim(args: SimArgs) -> ExitCode {
    if args.list_mutations {
        for mutation in kvhandoff_protocol::machine::Mutation::ALL {
            println!("{mutation}");
        }
        return ExitCode::SUCCESS;
    }
    if args.exhaustive {
        return run_exhaustive(&args);
    }
    let faults = match args.faults.parse::<kvhandoff_sim::Faults>() {
        Ok(faults) => faults,
        Err(error) => {
            eprintln!("error: {error}");
            return ExitCode::FAILURE;
        }
    };
    let seeds = match args.seed {
        Some(seed) => seed..seed.saturating_add(1),
        None => args.seeds.clone(),
    };
    let mut options = if args.long {
        kvhandoff_sim::SimOptions::long_sweep(seeds, faults)
    } else {
        kvhandoff_sim::SimOptions::new(seeds, 50, faults)
    };
    if let Some(requests) = args.requests.clone() {
        options.requests = requests;
    }
    if let Some(pool) = args.pool_blocks.clone() {
        options.pool_blocks = pool;
    }
    options.mutation = args.mutation;
    options.poll_allocations = args.poll_allocations;
    options.mode = args.mode;
    let started = std::time::Instant::now();
    let report = kvhandoff_sim::run_seeds(&options);
    let elapsed = started.elapsed();
    if args.json {
        if !print_json(&report) {
            return ExitCode::FAILURE;
        }
    } else {
        print_sim_summary(&report, &args.faults);
    }
    eprintln!("elapsed: {:.1} s", elapsed.as_secs_f64());
    if report.clean() {
        ExitCode::SUCCESS
    } else {
        let requests = match options.requests.start() == options.requests.end() {
            true => options.requests.start().to_string(),
            false => format!("{}..{}", options.requests.start(), options.requests.end()),
        };
        eprintln!(
            "replay one seed with: kvhandoff sim --seed S --requests {requests} --pool-blocks {}..{} --faults {} --mode {}{}",
            options.pool_blocks.start(),
            options.pool_blocks.end(),
            args.faults,
            mode_name(args.mode),
            if args.long { " --long" } else { "" },
        );
        ExitCode::FAILURE
    }
}

fn run_exhaustive(args: &SimArgs) -> ExitCode {
    let started = std::time::Instant::now();
    let report = kvhandoff_sim::run_exhaustive(args.mutation);
    if args.json {
        if !print_json(&report) {
            return ExitCode::FAILURE;
        }
    } else {
        for scope in &report.scopes {
            println!(
                "exhaustive: {} request(s), {} crash(es), depth {}: {} states, {} cut at depth, complete: {}",
                scope.requests, scope.crashes, scope.depth, scope.states, scope.depth_cut, scope.complete
            );
        }
        for violation in &report.violations {
            println!("  VIOLATION {violation}");
        }
    }
    eprintln!("elapsed: {:.1} s", started.elapsed().as_secs_f64());
    if report.complete && report.violations.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn mode_name(mode: kvhandoff_sim::Mode) -> &'static str {
    match mode {
        kvhandoff_sim::Mode::Push => "push",
        kvhandoff_sim::Mode::Pull => "pull",
        kvhandoff_sim::Mode::Mixed => "mixed",
        kvhandoff_sim::Mode::Bidir => "bidir",
    }
}

fn parse_mode(text: &str) -> Result<kvhandoff_sim::Mode, String> {
    text.parse()
}

fn print_sim_summary(report: &kvhandoff_sim::SimReport, faults: &str) {
    println!(
        "kvhandoff sim: {} seeds, {} requests in all ({}..={} per seed, {}..={} blocks per rank), faults {faults}, mode {}{}",
        report.seeds,
        report.total_requests,
        report.requests_range[0],
        report.requests_range[1],
        report.pool_blocks_range[0],
        report.pool_blocks_range[1],
        mode_name(report.mode),
        report
            .mutation
            .as_ref()
            .map(|m| format!(", mutation {m}"))
            .unwrap_or_default(),
    );
    println!("  outcomes        {:?}", report.outcomes);
    println!("  counters        {:?}", report.counters);
    println!("  violations      {}", report.violations.len());
    println!("  leaked blocks   {}", report.leaked_blocks);
    for leak in report.leaks.iter().take(16) {
        println!("      {leak}");
    }
    println!("  stale writes    {}", report.stale_writes);
    let missed: Vec<&String> = report
        .coverage
        .iter()
        .filter(|(_, hits)| **hits == 0)
        .map(|(mark, _)| mark)
        .collect();
    println!(
        "  coverage        {} marks, not hit: {:?}",
        report.coverage.len(),
        missed
    );
    println!("  trace hash      {}", report.trace_hash);
    for violation in &report.violations {
        println!(
            "  VIOLATION seed {} step {}: {}",
            violation.seed, violation.step, violation.message
        );
        for line in &violation.trace {
            println!("      {line}");
        }
    }
}

fn run_node(args: NodeArgs) -> ExitCode {
    let role = match args.role {
        RoleArg::Prefill => NodeRole::Prefill,
        RoleArg::Decode => NodeRole::Decode,
    };
    let mut options = NodeOptions::new(role, args.listen, args.peer);
    options.schedule = DemoOptions {
        requests: args.requests as usize,
        seed: args.seed,
        min_prompt_tokens: args.max_prompt_tokens.min(16),
        max_prompt_tokens: args.max_prompt_tokens,
        pool_blocks: args.pool_blocks,
        mean_arrival_gap: std::time::Duration::from_secs_f64(args.mean_arrival_gap_ms / 1e3),
        timeout: std::time::Duration::from_secs(args.timeout_secs),
        mode: demo_mode(args.mode),
        ..options.schedule
    };
    options.router = args.router;
    options.stop_self_after = args.stop_self_after.map(|k| k as usize);
    let ms = std::time::Duration::from_millis;
    options.start_at = args.start_at as usize;
    options.linger = ms(args.linger_ms);
    options.expect_peer_loss = args.expect_peer_loss;
    options.repeat_handshake_after = args.repeat_handshake_ms.map(ms);
    options.timing = node::NodeTiming {
        heartbeat: args.heartbeat_ms.map(ms),
        lease: args.lease_ms.map(ms),
        decode_deadline: args.decode_deadline_ms.map(ms),
        registration_ttl: args.registration_ttl_ms.map(ms),
        max_write_life: args.max_write_life_ms.map(ms),
        max_message_delay: args.max_message_delay_ms.map(ms),
    };
    conclude(
        node::run_full(&options),
        args.json,
        "the node",
        |r| r.render_table(),
        |r| r.verdict_ok(),
    )
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
        Command::Demo(args) => run_demo(args),
        Command::Node(args) => run_node(args),
        Command::Bench(command) => run_bench(command),
        Command::Sim(args) => run_sim(args),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
