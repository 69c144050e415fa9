//! `kvhandoff cluster --kill ENGINE:R@N`: kill -9 of one rank in the middle of the run, and its
//! restart with the rest of the plan.
//!
//! Rank R of ENGINE (the victim) is killed when request N arrives on its schedule (its
//! "running the schedule" line on stderr is its time zero; the seeded plan gives request N's
//! arrival). It is restarted at once with `--start-at K`: K is the first request that arrives
//! at least a restart's lead after the kill (twice the victim's own start-up time,
//! clamped), so that the new process is up and met its peer before its first request; when the
//! plan ends sooner, K is its last request if that one leaves the shortest lead. Rank R of the
//! other engine (the survivor) runs with `--expect-peer-loss` from the start: it must give
//! every request a typed outcome, no byte error and every block back. Every other rank pair
//! runs as without `--kill` and must verify everything.
//!
//! Only the victim pair gets the short timings below (a heartbeat, fabric bounds, a survivor's
//! deadline or lease), so that the survivor notices the death and ends what it held within the
//! run; both sides of the pair get the same heartbeat and bounds, as the protocol requires.
//!
//! A heterogeneous pair (`--model`) is killed in any mode: every rank but the victim survives
//! it, and the pair's router, told of the restart by its `hello` (`--start-at K`), abandons the
//! requests below K that no rank finished deciding, so that no survivor waits for a rank that
//! will never serve them. Equal geometries are killed in push mode only.

use std::io::{BufRead, BufReader};
use std::process::{ChildStderr, ExitStatus};
use std::sync::{Arc, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

use super::{Children, ClusterArgs, Launch};
use crate::cli::{demo_mode, ModeArg};
use kvhandoff_testkit::node::{self, NodeOptions, NodeRole};

/// [`RankLine::life`](super::RankLine::life) of the rank to be killed, before the kill.
const VICTIM: &str = "victim";
/// [`RankLine::life`](super::RankLine::life) of the killed process.
pub(super) const KILLED: &str = "killed";
/// [`RankLine::life`](super::RankLine::life) of the victim's restarted process.
const RESTARTED: &str = "restarted";
/// [`RankLine::life`](super::RankLine::life) of the victim's peer rank.
const SURVIVOR: &str = "survivor";

/// The victim pair's heartbeat, ms: the survivor declares the dead rank after 1.5 of it
/// (750 ms) instead of the protocol's 3 s, and a loaded small host (a cluster runs four or more
/// processes on it) does not stall a live rank that long (the single-pair kill tests' 200 ms
/// is tuned for two processes).
const HEARTBEAT_MS: &str = "500";
/// The victim pair's fabric bounds (registration TTL, write life, message delay), ms: D's fence
/// after P's death is sized on them, about 4 s here instead of the defaults' minutes, so that
/// blocks a dead P could still have written come back within the run. Both sides must agree.
const FENCE_FLAGS: [&str; 6] = [
    "--registration-ttl-ms",
    "1000",
    "--max-write-life-ms",
    "1500",
    "--max-message-delay-ms",
    "500",
];
/// A D survivor's deadline for P's data, ms: the requests it allocates between the restart
/// and K (the restarted P never prefills them) end this long after; 100 times a handoff on
/// loopback, so that no live request meets it on a loaded host.
const DECODE_DEADLINE_MS: &str = "2000";
/// A P survivor's lease on finished blocks no D registered, ms: those the dead D never
/// registered come back after it instead of 30 s; the restarted D, if it starts late, still
/// registers its first requests within it.
const LEASE_MS: u64 = 3000;
/// How long a pair's D survivor keeps a turn for its read-back (`--mode bidir`), ms: the parts a
/// dead P rank would have read end this long after the keep instead of 30 s, which would hold
/// the window's slots for minutes. It outlasts P's lease by as much again: the P survivor
/// starts its read-back only once its first turns ended, and those the dead D never
/// registered end a lease after P held them, while D's survivor, which never waits for
/// them, may already keep the restart's turns. With a keep only as long as the lease, P could
/// reach the last of them after they had gone.
const KEEP_TTL_MS: u64 = 2 * LEASE_MS;
/// The restart's lead (how long after the kill its first request arrives) is twice the
/// victim's own start-up to listening (which ran alongside every other rank's; a restart also
/// has to meet its peer), at least this: a restart took up to 0.9 s on a loaded 2-core host
/// whose first start-ups took 0.5 s, and more than 1.5 s beside CI's other tests and two
/// simulator sweeps (the survivor then failed every request of the restart's part, unable to
/// connect, and the restart waited for a peer that had finished)...
const MIN_LEAD: Duration = Duration::from_millis(2500);
/// ...and at most this (the plan must leave requests for the restart).
const MAX_LEAD: Duration = Duration::from_millis(3000);

/// The gap between a pair rank's request starts: `kvhandoff node`'s default
/// `--mean-arrival-gap-ms`, which `node --model` takes as a fixed gap.
const PAIR_GAP: Duration = Duration::from_millis(20);

/// An engine of the cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Engine {
    Prefill,
    Decode,
}

impl Engine {
    fn name(self) -> &'static str {
        match self {
            Engine::Prefill => "prefill",
            Engine::Decode => "decode",
        }
    }
}

/// `--kill ENGINE:R@N`: kill rank `rank` of `engine` when request `at` arrives on its schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct KillSpec {
    pub(crate) engine: Engine,
    pub(crate) rank: u32,
    pub(crate) at: u32,
}

/// Why a `--kill` value does not parse.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(crate) enum KillSpecError {
    #[error("expected ENGINE:R@N (e.g. prefill:1@100), got {0:?}")]
    Shape(String),
    #[error("engine {0:?}: expected prefill or decode")]
    Engine(String),
    #[error("rank {0:?}: expected a number below 8")]
    Rank(String),
    #[error("request {0:?}: expected a number")]
    Request(String),
}

/// The value parser of `--kill`: `prefill:R@N` or `decode:R@N` (`--tp` and `--requests` are
/// checked against it in [`Killer::new`]).
pub(crate) fn parse_kill(text: &str) -> Result<KillSpec, KillSpecError> {
    let shape = || KillSpecError::Shape(text.to_string());
    let (engine, rest) = text.split_once(':').ok_or_else(shape)?;
    let (rank, at) = rest.split_once('@').ok_or_else(shape)?;
    let engine = match engine {
        "prefill" => Engine::Prefill,
        "decode" => Engine::Decode,
        other => return Err(KillSpecError::Engine(other.to_string())),
    };
    let rank = rank
        .parse::<u32>()
        .ok()
        .filter(|r| *r < super::MAX_TP)
        .ok_or_else(|| KillSpecError::Rank(rank.to_string()))?;
    let at = at
        .parse::<u32>()
        .map_err(|_| KillSpecError::Request(at.to_string()))?;
    Ok(KillSpec { engine, rank, at })
}

/// When the victim's process did what, as its stderr told (see [`tap`]).
pub(super) struct Marks {
    spawned: Instant,
    listening: OnceLock<Instant>,
    schedule: OnceLock<Instant>,
}

/// Forwards a child's stderr to ours line by line, noting when it listened and when it started
/// its schedule. The thread ends with the child (its stderr closes).
pub(super) fn tap(stderr: ChildStderr, marks: Arc<Marks>) {
    thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            let now = Instant::now();
            if line.contains(" listening on ") {
                let _ = marks.listening.set(now);
            }
            if line.contains("running the schedule") {
                let _ = marks.schedule.set(now);
            }
            eprintln!("{line}");
        }
    });
}

mod report;

pub(crate) use report::KillReport;

/// Where the kill stands.
#[derive(Debug)]
enum Phase {
    /// Waiting for request N on the victim's schedule.
    Armed,
    /// The victim exited (or never started its schedule) before request N.
    Missed(&'static str),
    Killed(Kill),
}

#[derive(Debug)]
struct Kill {
    pid: u32,
    run_ms: f64,
    schedule_ms: f64,
    request: u64,
    lead: Duration,
    /// `None`: no request of the plan arrives [`MIN_LEAD`] after the kill; nothing was
    /// restarted.
    restart_at: Option<u64>,
}

/// Runs `--kill` for the cluster: the victim pair's flags, the kill, the restart, the report.
pub(super) struct Killer {
    spec: KillSpec,
    requests: u32,
    /// A heterogeneous pair (`--model`): every rank but the victim is a survivor (a fan
    /// spreads a death over every rank linked to the dead one and their siblings), and the
    /// restart is judged on what it served rather than on all of its part.
    pair: bool,
    /// Request `i` arrives `arrivals[i]` into the schedule.
    arrivals: Vec<Duration>,
    marks: Option<Arc<Marks>>,
    phase: Phase,
}

impl Killer {
    /// Checks `spec` against the cluster's options and computes the plan's arrivals.
    pub(super) fn new(spec: KillSpec, args: &ClusterArgs) -> Result<Killer, String> {
        if spec.rank >= args.tp {
            return Err(format!("rank {} is not below --tp {}", spec.rank, args.tp));
        }
        if spec.at >= args.requests {
            return Err(format!(
                "request {} is not below --requests {}",
                spec.at, args.requests
            ));
        }
        if !matches!(args.mode, ModeArg::Push) {
            return Err("a killed rank is restarted in push mode only (--mode push)".into());
        }
        // The schedule every node derives from these options (as `kvhandoff node` builds it).
        let any = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
        let mut schedule = NodeOptions::new(NodeRole::Prefill, any, any).schedule;
        schedule.requests = args.requests as usize;
        schedule.seed = args.seed;
        schedule.min_prompt_tokens = args.max_prompt_tokens.min(16);
        schedule.max_prompt_tokens = args.max_prompt_tokens;
        schedule.mode = demo_mode(args.mode);
        let arrivals = node::arrivals(&schedule).map_err(|e| format!("the plan: {e}"))?;
        Ok(Killer {
            spec,
            requests: args.requests,
            pair: false,
            arrivals,
            marks: None,
            phase: Phase::Armed,
        })
    }

    /// As [`Killer::new`], for the ranks of a heterogeneous pair (`kvhandoff node --model`): a
    /// rank starts its requests a fixed [`PAIR_GAP`] apart from when it met its peers.
    pub(super) fn for_pair(
        spec: KillSpec,
        args: &ClusterArgs,
        pair: &super::pair::PairRun,
    ) -> Result<Killer, String> {
        let ranks = pair.ranks(spec.engine.name());
        if spec.rank >= ranks {
            return Err(format!(
                "rank {} is not below the {ranks} ranks of {}",
                spec.rank,
                spec.engine.name()
            ));
        }
        if spec.at >= args.requests {
            return Err(format!(
                "request {} is not below --requests {}",
                spec.at, args.requests
            ));
        }
        let arrivals = (0..args.requests).map(|r| PAIR_GAP * r).collect();
        Ok(Killer {
            spec,
            requests: args.requests,
            pair: true,
            arrivals,
            marks: None,
            phase: Phase::Armed,
        })
    }

    /// The victim pair's flags, without the survivor's own.
    fn pair_flags() -> Vec<String> {
        let mut flags = vec!["--heartbeat-ms".to_string(), HEARTBEAT_MS.to_string()];
        flags.extend(FENCE_FLAGS.iter().map(|f| f.to_string()));
        flags
    }

    /// How to start rank `rank` of `engine`: extra flags, a stderr tap (the victim's), and its
    /// [`RankLine::life`](super::RankLine::life).
    pub(super) fn launch(
        &mut self,
        engine: &str,
        rank: u32,
    ) -> (Vec<String>, Option<Arc<Marks>>, Option<&'static str>) {
        if rank != self.spec.rank && !self.pair {
            return (Vec::new(), None, None);
        }
        let mut flags = Killer::pair_flags();
        if engine == self.spec.engine.name() && rank == self.spec.rank {
            let marks = Arc::new(Marks {
                spawned: Instant::now(),
                listening: OnceLock::new(),
                schedule: OnceLock::new(),
            });
            self.marks = Some(marks.clone());
            return (flags, Some(marks), Some(VICTIM));
        }
        flags.push("--expect-peer-loss".into());
        // A survivor of the other engine ends what the death left it: D what no P will write,
        // P what no D will register (in a pair, a rank of the victim's own engine is a sibling
        // in the fan, and its requests end by a cancel from D).
        flags.extend(match engine {
            "decode" => ["--decode-deadline-ms".into(), DECODE_DEADLINE_MS.into()],
            _ => ["--lease-ms".into(), LEASE_MS.to_string()],
        });
        if self.pair && engine == "decode" {
            // In bidir, the turns a dead P rank never reads back end within the run.
            flags.extend(["--keep-ttl-ms".into(), KEEP_TTL_MS.to_string()]);
        }
        (flags, None, Some(SURVIVOR))
    }

    /// When request N is due on the victim's schedule, if it started it.
    fn due(&self) -> Option<Instant> {
        let zero = *self.marks.as_ref()?.schedule.get()?;
        Some(zero + self.arrivals[self.spec.at as usize])
    }

    /// How long the run may sleep before looking again (`poll`, or less to kill on time).
    pub(super) fn nap(&self, poll: Duration) -> Duration {
        match (&self.phase, self.due()) {
            (Phase::Armed, Some(due)) => poll.min(due.saturating_duration_since(Instant::now())),
            _ => poll,
        }
    }

    /// The restart's lead: twice the victim's start-up (to listening), clamped.
    fn lead(&self) -> Duration {
        (self.startup().unwrap_or(MAX_LEAD) * 2).clamp(MIN_LEAD, MAX_LEAD)
    }

    /// The victim's start-up: from its spawn to its side channel listening.
    fn startup(&self) -> Option<Duration> {
        let marks = self.marks.as_ref()?;
        Some(
            marks
                .listening
                .get()?
                .saturating_duration_since(marks.spawned),
        )
    }

    /// Kills the victim once request N is due, and starts it again with `--start-at K`.
    pub(super) fn step(
        &mut self,
        launch: &Launch,
        children: &mut Children,
        statuses: &mut Vec<Option<ExitStatus>>,
        wall: Instant,
    ) -> Result<(), String> {
        if !matches!(self.phase, Phase::Armed) {
            return Ok(());
        }
        let Some(i) = children.0.iter().position(|(s, ..)| s.life == Some(VICTIM)) else {
            return Ok(());
        };
        if statuses[i].is_some() {
            self.phase = Phase::Missed("it exited before the request arrived");
            return Ok(());
        }
        let (Some(due), Some(zero)) = (
            self.due(),
            self.marks.as_ref().and_then(|m| m.schedule.get().copied()),
        ) else {
            return Ok(());
        };
        if Instant::now() < due {
            return Ok(());
        }
        let (spec, child, _) = &mut children.0[i];
        let at = Instant::now();
        child.kill().map_err(|e| {
            format!(
                "--kill: cannot kill {} rank {}: {e}",
                spec.engine, spec.rank
            )
        })?;
        statuses[i] = Some(child.wait().map_err(|e| format!("--kill: reaping: {e}"))?);
        spec.life = Some(KILLED);
        let into = at.saturating_duration_since(zero);
        let arrived = self.arrivals.partition_point(|a| *a <= into);
        let first_after = |lead: Duration| {
            let k = self.arrivals.partition_point(|a| *a < into + lead);
            Some(k.max(arrived)).filter(|k| *k < self.arrivals.len())
        };
        // Past the plan's end at the wanted lead: its last request, if not too soon.
        let k = first_after(self.lead())
            .or_else(|| first_after(MIN_LEAD).map(|_| self.arrivals.len() - 1));
        let lead = k.map_or(Duration::ZERO, |k| self.arrivals[k].saturating_sub(into));
        let mut kill = Kill {
            pid: spec.pid,
            run_ms: at.saturating_duration_since(wall).as_secs_f64() * 1e3,
            schedule_ms: into.as_secs_f64() * 1e3,
            request: arrived.saturating_sub(1) as u64,
            lead,
            restart_at: None,
        };
        let engine = self.spec.engine.name();
        eprintln!(
            "kvhandoff cluster: killed {engine} rank {} (pid {}) {:.0} ms into its schedule \
             (request {})",
            self.spec.rank, kill.pid, kill.schedule_ms, kill.request
        );
        if let Some(k) = k {
            let mut flags = Killer::pair_flags();
            flags.extend(["--start-at".to_string(), k.to_string()]);
            if self.pair {
                // Its first requests may have been given up on by its peers before it met
                // them (a start-up slower than the lead): typed, not a failure of the restart.
                flags.push("--expect-peer-loss".into());
            }
            let (mut spec, child, reader) = launch.spawn(engine, self.spec.rank, &flags, None)?;
            spec.life = Some(RESTARTED);
            eprintln!(
                "kvhandoff cluster: restarted {engine} rank {} (pid {}) with --start-at {k}",
                self.spec.rank, spec.pid
            );
            children.0.push((spec, child, reader));
            statuses.push(None);
            kill.restart_at = Some(k as u64);
        }
        self.phase = Phase::Killed(kill);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kill_values_parse_or_say_why() {
        assert_eq!(
            parse_kill("prefill:1@100"),
            Ok(KillSpec {
                engine: Engine::Prefill,
                rank: 1,
                at: 100
            })
        );
        assert_eq!(
            parse_kill("decode:0@0").map(|k| k.engine),
            Ok(Engine::Decode)
        );
        assert!(matches!(
            parse_kill("router:0@1"),
            Err(KillSpecError::Engine(_))
        ));
        assert!(matches!(
            parse_kill("prefill:8@1"),
            Err(KillSpecError::Rank(_))
        ));
        assert!(matches!(
            parse_kill("prefill:x@1"),
            Err(KillSpecError::Rank(_))
        ));
        assert!(matches!(
            parse_kill("prefill:1@-3"),
            Err(KillSpecError::Request(_))
        ));
        assert!(matches!(
            parse_kill("prefill1@3"),
            Err(KillSpecError::Shape(_))
        ));
        assert!(matches!(
            parse_kill("prefill:1"),
            Err(KillSpecError::Shape(_))
        ));
    }
}
