//! `kvhandoff sim`: its arguments, its run (seeded worlds or the exhaustive check) and its
//! summary.

use std::process::ExitCode;

use clap::Args;

use super::print_json;

#[derive(Debug, Args)]
pub(crate) struct SimArgs {
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
    /// The share of requests that are multi-rank (several P ranks per D rank, or one P rank per
    /// several D ranks), 0 to 1 [default: the mode's: 0.1 in mixed, pull and bidir, 0 in push].
    #[arg(long, value_parser = parse_share)]
    multi_source: Option<f64>,
    /// Give multi-rank requests no second turn (by default they keep the one they draw in
    /// mixed and bidir: D's ranks keep their blocks and P's ranks read them back across the
    /// pair, each from every D rank that holds its slices).
    #[arg(long)]
    no_multi_rank_turns: bool,
    /// The share of single-source push requests that P hands over layer-wise (its engine
    /// reports each layer as it is produced; each part is written once D registered), 0 to 1.
    #[arg(long, value_parser = parse_share, default_value_t = kvhandoff_sim::DEFAULT_LAYERWISE)]
    layerwise: f64,
    /// Process stalls under chaos (SIGSTOP, a paused VM, a GC pause): the mean number per seed,
    /// each seed drawing 0 to twice as many, from a quarter under the peer timeout to past the
    /// quarantine; 0 runs none. Messages to a stalled process queue; on resume its due timers
    /// run first, then it handles what queued.
    #[arg(long, value_parser = parse_stalls, default_value_t = kvhandoff_sim::DEFAULT_STALLS)]
    stalls: f64,
    /// The share of stalls that freeze the stalled process's posted transfers until it resumes
    /// (their life clock suspended, so they may land after any time fence), 0 to 1.
    #[arg(long, value_parser = parse_share, default_value_t = kvhandoff_sim::DEFAULT_STALL_FREEZE)]
    stall_freeze: f64,
    /// The share of resumes in which the process handles what queued before its due timers run
    /// (the shell before issue 19's fix), 0 to 1 (0: always timers first); exercises the
    /// machines' own refusals of stale messages.
    #[arg(long, value_parser = parse_share, default_value_t = kvhandoff_sim::DEFAULT_STALL_MESSAGES_FIRST)]
    stall_messages_first: f64,
    /// Let stalls freeze a process's writes for longer than the stall allowance (quarantine −
    /// fence floor): the deployment requirement the time-based frees rest on, broken on
    /// purpose; the run must then find blocks handed out under a write that still lands.
    #[arg(long)]
    stall_past_allowance: bool,
    /// Run every seed with the configuration given here instead of one it draws for itself
    /// (the swarm: timing profiles whose peer timeout passes the lease extension and the read
    /// span, small tombstone tables, registration resends, stall mixes, storms of late
    /// messages, hostile peers).
    #[arg(long)]
    no_swarm: bool,
    /// A hostile peer: D's rank 0 also floods P's rank 0 with cancels and releases for made-up
    /// keys during the faulty phase (tens per heartbeat); P must keep them within the peer's
    /// budget of records, and its engine's admission with it.
    #[arg(long)]
    flood_peer: bool,
    /// The chance, 0 to 1, that a P rank's answer (WriteDone, WriteFailed, CancelAck) in a
    /// world with several P ranks names another rank, or a sibling rank's share (a buggy or
    /// forged peer; needs --multi-source above 0); D must count answers only for their sender.
    #[arg(long, value_parser = parse_share, default_value_t = 0.0)]
    misname_rank: f64,
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
    /// Run the exhaustive small-scope check (1 P, 1 D, every choice sequence to each scope's
    /// depth bound) instead of seeded worlds; reports per scope its depth, the states visited,
    /// the states cut at the bound and whether it is complete (nothing cut). Exits 1 on a
    /// violation or a scope stopped at its cap on states.
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

fn parse_share(text: &str) -> Result<f64, String> {
    let share: f64 = text
        .trim()
        .parse()
        .map_err(|e| format!("bad share {text:?}: {e}"))?;
    if (0.0..=1.0).contains(&share) {
        Ok(share)
    } else {
        Err(format!("{text:?} is outside 0..=1"))
    }
}

fn parse_stalls(text: &str) -> Result<f64, String> {
    let stalls: f64 = text
        .trim()
        .parse()
        .map_err(|e| format!("bad stall rate {text:?}: {e}"))?;
    // A bound keeps a world's stall count (0 to twice this) small.
    if (0.0..=100.0).contains(&stalls) {
        Ok(stalls)
    } else {
        Err(format!("{text:?} is outside 0..=100"))
    }
}

fn parse_mutation(text: &str) -> Result<kvhandoff_protocol::machine::Mutation, String> {
    text.parse()
}

pub(crate) fn run_sim(args: SimArgs) -> ExitCode {
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
    options.multi_source = args.multi_source;
    options.multi_rank_turns = !args.no_multi_rank_turns;
    options.layerwise = args.layerwise;
    options.stalls = args.stalls;
    options.stall_freeze = args.stall_freeze;
    options.stall_messages_first = args.stall_messages_first;
    options.stall_past_allowance = args.stall_past_allowance;
    options.swarm = !args.no_swarm;
    let started = std::time::Instant::now();
    options.flood_peer = args.flood_peer;
    options.misname_rank = args.misname_rank;
    let progress =
        super::progress::SweepProgress::new("seeds", options.seeds.clone().count() as u64);
    let report = kvhandoff_sim::run_seeds_observed(&options, &|| progress.tick());
    progress.finish();
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
            "replay one seed with: kvhandoff sim --seed S --requests {requests} --pool-blocks {}..{} --faults {} --mode {} --layerwise {} --stalls {} --stall-freeze {} --stall-messages-first {}{}{}{}{}{}{}",
            options.pool_blocks.start(),
            options.pool_blocks.end(),
            args.faults,
            mode_name(args.mode),
            args.layerwise,
            args.stalls,
            args.stall_freeze,
            args.stall_messages_first,
            if args.stall_past_allowance { " --stall-past-allowance" } else { "" },
            args.multi_source
                .map(|s| format!(" --multi-source {s}"))
                .unwrap_or_default(),
            if args.long { " --long" } else { "" },
            if args.no_swarm { " --no-swarm" } else { "" },
            if args.no_multi_rank_turns { " --no-multi-rank-turns" } else { "" },
            hostile_flags(&args),
        );
        ExitCode::FAILURE
    }
}

/// The hostile-peer flags of a replay line.
fn hostile_flags(args: &SimArgs) -> String {
    let mut flags = String::new();
    if args.flood_peer {
        flags.push_str(" --flood-peer");
    }
    if args.misname_rank > 0.0 {
        flags.push_str(&format!(" --misname-rank {}", args.misname_rank));
    }
    flags
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
                "exhaustive: {} request(s), {} crash(es): depth {}, states {}, cut {} ({:.0} %), capped: {}, complete: {}, {:.1} s ({:.0} states/s)",
                scope.requests,
                scope.crashes,
                scope.depth,
                scope.states,
                scope.cut,
                100.0 * scope.cut as f64 / scope.states.max(1) as f64,
                scope.capped,
                scope.complete,
                scope.seconds,
                scope.states as f64 / scope.seconds.max(1e-9),
            );
        }
        for violation in &report.violations {
            println!("  VIOLATION {violation}");
        }
    }
    eprintln!("elapsed: {:.1} s", started.elapsed().as_secs_f64());
    // Not complete is not a failure: the scopes are bounded by depth and say how much they
    // cut. A violation, or a scope that stopped at its cap on states, is.
    if !report.capped && report.violations.is_empty() {
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
