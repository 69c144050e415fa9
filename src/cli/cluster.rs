//! `kvhandoff cluster`: every rank of a P and a D engine as a process of its own on this host
//! (`kvhandoff node --tp N --rank R`), run to the end and reported together.
//!
//! The ranks find each other as vLLM's do: each engine's rank `R` listens on its engine's base
//! port + `R` (`docs/compatibility.md`, "Across processes"). Every process this command starts
//! is killed and reaped when the run ends, fails, passes its deadline, or on Ctrl-C / SIGTERM.
//! `--kill ENGINE:R@N` kills one rank mid-run and restarts it ([`kill`]); `--model M --prefill
//! SPEC --decode SPEC` runs the ranks of a heterogeneous pair instead ([`pair`]), with a router
//! process (`kvhandoff router`) through which every request's parameters go, as through vLLM's
//! proxy. `--transport mem` is refused: one process's fabric cannot join processes.

mod kill;
mod pair;
mod report;

use std::io::Read;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, ExitCode, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use clap::Args;

use super::{print_json, ModeArg};
use kill::{KillSpec, Killer};
use report::{rank_line, render, report_of, ClusterReport, RankLine};

/// Most TP ranks per engine: the demo model's 8 KV heads.
const MAX_TP: u32 = 8;
/// Most ranks (TP × PP) of one engine of a heterogeneous pair: each takes a port above its
/// engine's base.
const MAX_SIDE_RANKS: usize = 64;
/// How often the run looks at its children.
const POLL: Duration = Duration::from_millis(50);
/// How much longer than the nodes' own limit the command waits before killing them.
const GRACE: Duration = Duration::from_secs(30);

#[derive(Debug, Args)]
pub(crate) struct ClusterArgs {
    /// TP ranks of each engine (both engines run the demo model at this TP): 1, 2, 4 or 8.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=8), conflicts_with = "model")]
    tp: u32,
    /// Requests every rank pair hands off.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    requests: u32,
    /// How the requests move their KV: `push`, `pull`, `mixed` or `bidir` (the last three use
    /// a router link per rank pair).
    #[arg(long, value_enum, default_value_t = ModeArg::Push)]
    mode: ModeArg,
    /// Seed of the schedule every rank follows.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Longest prompt, in tokens.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(16..=1_000_000))]
    max_prompt_tokens: u32,
    /// Each node's limit, waiting for its peer included; the command kills what still runs
    /// 30 s after it.
    #[arg(long, default_value_t = 120, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    timeout_secs: u64,
    /// Kill one rank mid-run and restart it (push mode; with `--model`, every mode):
    /// `prefill:R@N` or `decode:R@N` sends
    /// SIGKILL to rank R of that engine when request N arrives on its schedule, then starts
    /// it again with the rest of the plan; rank R of the other engine survives it (with
    /// `--model`, every other rank: a pair's fan spreads the death).
    #[arg(long, value_name = "ENGINE:R@N", value_parser = kill::parse_kill)]
    kill: Option<KillSpec>,
    /// How the ranks' KV moves: `nixl` (one NIXL agent per process over UCX). `mem` is refused
    /// with the reason: the in-memory fabric cannot join processes.
    #[arg(long, value_enum, default_value_t = TransportArg::Nixl)]
    transport: TransportArg,
    #[command(flatten)]
    pair: super::pair_args::PairArgs,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// `--transport`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum TransportArg {
    Mem,
    Nixl,
}

/// The children, killed and reaped when dropped (a panic or an early return included).
struct Children(Vec<(RankSpec, Child, thread::JoinHandle<String>)>);

#[derive(Debug, Clone, Copy)]
struct RankSpec {
    engine: &'static str,
    rank: u32,
    listen: SocketAddr,
    pid: u32,
    /// With `--kill`: the process's part in it ([`RankLine::life`]).
    life: Option<&'static str>,
}

/// What every rank's command line shares.
struct Launch<'a> {
    exe: PathBuf,
    args: &'a ClusterArgs,
    mode: &'static str,
    p_base: SocketAddr,
    d_base: SocketAddr,
    router: SocketAddr,
    /// With `--model`: the pair every rank belongs to.
    pair: Option<pair::PairRun>,
}

impl Launch<'_> {
    /// Starts rank `rank` of `engine` with `extra` flags, its JSON report read on a thread;
    /// with `tap`, its stderr goes through [`kill::tap`] (which forwards it) instead of ours.
    fn spawn(
        &self,
        engine: &'static str,
        rank: u32,
        extra: &[String],
        tap: Option<Arc<kill::Marks>>,
    ) -> Result<(RankSpec, Child, thread::JoinHandle<String>), String> {
        let (listen, peer) = match engine {
            "decode" => (self.d_base, self.p_base),
            _ => (self.p_base, self.d_base),
        };
        let args = self.args;
        let listen_at = SocketAddr::new(listen.ip(), listen.port() + rank as u16);
        let mut command = Command::new(&self.exe);
        command
            .args(["node", "--role", engine, "--json"])
            .args(["--listen", &listen.to_string(), "--peer", &peer.to_string()])
            .args(["--rank", &rank.to_string()]);
        match &self.pair {
            Some(pair) => command
                .args(pair.node_args())
                .args(["--first-turn", args.pair.first_turn.name()]),
            None => command.args(["--tp", &args.tp.to_string()]),
        };
        command
            .args(["--requests", &args.requests.to_string()])
            .args(["--seed", &args.seed.to_string(), "--mode", self.mode])
            .args(["--max-prompt-tokens", &args.max_prompt_tokens.to_string()])
            .args(["--timeout-secs", &args.timeout_secs.to_string()])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(if tap.is_some() {
                Stdio::piped()
            } else {
                Stdio::inherit()
            });
        if self.mode != "push" || self.pair.is_some() {
            // A pair's ranks all go through its router; a TP cluster's ranks use a router link
            // per rank pair where they pull or read back.
            command.args(["--router", &self.router.to_string()]);
        }
        let mut child = command
            .spawn()
            .map_err(|e| format!("cannot start {engine} rank {rank}: {e}"))?;
        let mut out = child
            .stdout
            .take()
            .ok_or_else(|| format!("{engine} rank {rank}: no stdout"))?;
        if let (Some(marks), Some(err)) = (tap, child.stderr.take()) {
            kill::tap(err, marks);
        }
        let spec = RankSpec {
            engine,
            rank,
            listen: listen_at,
            pid: child.id(),
            life: None,
        };
        let reader = thread::spawn(move || {
            let mut text = String::new();
            let _ = out.read_to_string(&mut text);
            text
        });
        Ok((spec, child, reader))
    }
}

impl Launch<'_> {
    /// Starts the pair's router (`kvhandoff router`) on the router address, its JSON report
    /// read on a thread.
    fn spawn_router(&self) -> Result<(RankSpec, Child, thread::JoinHandle<String>), String> {
        let (p, d) = self
            .pair
            .as_ref()
            .map_or((1, 1), |p| (p.prefill_ranks, p.decode_ranks));
        let mut child = Command::new(&self.exe)
            .args(["router", "--json", "--listen", &self.router.to_string()])
            .args(["--prefill-ranks", &p.to_string()])
            .args(["--decode-ranks", &d.to_string()])
            .args(["--requests", &self.args.requests.to_string()])
            .args(if self.mode == "bidir" {
                &["--turns"][..]
            } else {
                &[]
            })
            .args([
                "--timeout-secs",
                &(self.args.timeout_secs + GRACE.as_secs()).to_string(),
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("cannot start the router: {e}"))?;
        let mut out = child.stdout.take().ok_or("the router: no stdout")?;
        let spec = RankSpec {
            engine: "router",
            rank: 0,
            listen: self.router,
            pid: child.id(),
            life: None,
        };
        let reader = thread::spawn(move || {
            let mut text = String::new();
            let _ = out.read_to_string(&mut text);
            text
        });
        Ok((spec, child, reader))
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        for (_, child, _) in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

pub(crate) fn run_cluster(args: ClusterArgs) -> ExitCode {
    if !cfg!(feature = "nixl") {
        eprintln!("error: kvhandoff cluster runs its ranks over NIXL: build with --features nixl");
        return ExitCode::from(2);
    }
    let pair = match args.pair.specs() {
        Ok(None) => None,
        Ok(Some(specs)) => match pair::PairRun::new(specs, args.pair.window) {
            Ok(pair) => Some(pair),
            Err(error) => {
                eprintln!("error: {error}");
                return ExitCode::from(2);
            }
        },
        Err(error) => {
            eprintln!("error: {error}");
            return ExitCode::from(2);
        }
    };
    if let Err(why) = super::pair_args::PairMode::of(args.mode, args.pair.first_turn) {
        eprintln!("error: {why}");
        return ExitCode::from(2);
    }
    if args.transport == TransportArg::Mem {
        eprintln!(
            "error: --transport mem: the in-memory fabric is one process's and cannot join \
             ranks in processes of their own; run every rank in one process with `kvhandoff \
             demo --transport mem` (add --model … for a pair), or use --transport nixl"
        );
        return ExitCode::from(2);
    }
    if MAX_TP % args.tp != 0 {
        eprintln!(
            "error: --tp {} does not divide the demo model's {MAX_TP} KV heads",
            args.tp
        );
        return ExitCode::from(2);
    }
    let killer = args.kill.map(|spec| match &pair {
        Some(pair) => Killer::for_pair(spec, &args, pair),
        None => Killer::new(spec, &args),
    });
    let killer = match killer.transpose() {
        Ok(killer) => killer,
        Err(error) => {
            eprintln!("error: --kill: {error}");
            return ExitCode::from(2);
        }
    };
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    if let Err(error) = ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst)) {
        eprintln!("error: cannot watch for Ctrl-C: {error}");
        return ExitCode::from(2);
    }
    match run(&args, pair, killer, &stop) {
        Ok(report) => {
            let printed = if args.json {
                print_json(&report)
            } else {
                print!("{}", render(&report));
                true
            };
            if printed && report.ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(error) => {
            eprintln!("error: the cluster could not start: {error}");
            ExitCode::FAILURE
        }
    }
}

fn run(
    args: &ClusterArgs,
    pair: Option<pair::PairRun>,
    mut killer: Option<Killer>,
    stop: &AtomicBool,
) -> Result<ClusterReport, String> {
    let wall = Instant::now();
    let exe = std::env::current_exe().map_err(|e| format!("this program's path: {e}"))?;
    // Three blocks of consecutive ports (P's, D's, the router links'), one per rank of an
    // engine each.
    let ports: [SocketAddr; 3 * MAX_SIDE_RANKS] = kvhandoff_testkit::ports::loopback_ports();
    let base = |block: usize| ports[block * MAX_SIDE_RANKS];
    let ranks_of = |engine: &str| pair.as_ref().map_or(args.tp, |p| p.ranks(engine));
    let mode = mode_name(args.mode);
    let launch = Launch {
        exe,
        args,
        mode,
        p_base: base(0),
        d_base: base(1),
        router: base(2),
        pair: pair.clone(),
    };
    let mut children = Children(Vec::new());
    if pair.is_some() {
        // A pair's requests go through its router, as vLLM's proxy hands P's answer to D (a
        // push's or a pull's) and D's to P's next turn.
        children.0.push(launch.spawn_router()?);
    }
    // D first (it listens on the router links), then P.
    for engine in ["decode", "prefill"] {
        for rank in 0..ranks_of(engine) {
            let (extra, tap, life) = match killer.as_mut() {
                Some(k) => k.launch(engine, rank),
                None => (Vec::new(), None, None),
            };
            let (mut spec, child, reader) = launch.spawn(engine, rank, &extra, tap)?;
            spec.life = life;
            children.0.push((spec, child, reader));
        }
        thread::sleep(Duration::from_millis(300));
    }
    let deadline = Instant::now() + Duration::from_secs(args.timeout_secs) + GRACE;
    let mut statuses: Vec<Option<ExitStatus>> = vec![None; children.0.len()];
    let mut stopped = None;
    while statuses.iter().any(Option::is_none) {
        for (i, (_, child, _)) in children.0.iter_mut().enumerate() {
            if statuses[i].is_none() {
                statuses[i] = child.try_wait().map_err(|e| format!("waiting: {e}"))?;
            }
        }
        if let Some(killer) = &mut killer {
            killer.step(&launch, &mut children, &mut statuses, wall)?;
        }
        if stop.load(Ordering::SeqCst) {
            stopped = Some("interrupted".to_string());
        } else if Instant::now() >= deadline {
            stopped = Some(format!(
                "past the deadline ({} s + {} s)",
                args.timeout_secs,
                GRACE.as_secs()
            ));
        }
        if stopped.is_some() {
            for (i, (_, child, _)) in children.0.iter_mut().enumerate() {
                if statuses[i].is_none() {
                    let _ = child.kill();
                    statuses[i] = child.wait().ok();
                }
            }
            break;
        }
        thread::sleep(killer.as_ref().map_or(POLL, |k| k.nap(POLL)));
    }
    let all_exited = statuses.iter().all(Option::is_some);
    let mut ranks = Vec::new();
    let mut texts = Vec::new();
    for ((spec, _, reader), status) in std::mem::take(&mut children.0).into_iter().zip(&statuses) {
        let text = reader.join().unwrap_or_default();
        ranks.push(rank_line(spec, status.as_ref(), &text));
        texts.push(text);
    }
    let requests = u64::from(args.requests);
    // Per rank, what its D processes verified together (more than one after a restart).
    let verified = (0..ranks_of("decode"))
        .map(|rank| {
            ranks
                .iter()
                .filter(|r| r.engine == "decode" && r.rank == rank)
                .map(|r| r.done)
                .sum::<u64>()
        })
        .min()
        .unwrap_or(0);
    let byte_errors = ranks.iter().map(|r| r.byte_errors).sum();
    let leaked_blocks = ranks.iter().map(|r| r.leaked_blocks).sum();
    let kill = killer.map(|k| k.report(&ranks, &texts));
    let ranks_ok = match &kill {
        Some(kill) => kill.ok,
        None => verified == requests && ranks.iter().all(|r| r.ok),
    };
    let ok = stopped.is_none() && all_exited && byte_errors == 0 && leaked_blocks == 0 && ranks_ok;
    Ok(ClusterReport {
        transport: "nixl",
        mode: mode.to_string(),
        tp: if pair.is_some() { 0 } else { args.tp },
        pair: pair.as_ref().map(pair::PairRun::describe),
        processes: ranks.len(),
        requests,
        verified,
        byte_errors,
        leaked_blocks,
        all_exited,
        stopped,
        wall_s: wall.elapsed().as_secs_f64(),
        ok,
        ranks,
        kill,
    })
}

fn mode_name(mode: ModeArg) -> &'static str {
    match mode {
        ModeArg::Push => "push",
        ModeArg::Pull => "pull",
        ModeArg::Mixed => "mixed",
        ModeArg::Bidir => "bidir",
    }
}
