//! `kvhandoff cluster --kill ENGINE:R@N`: kill -9 of one rank in the middle of the run, and its
//! restart with the rest of the plan.
//!
//! Rank R of ENGINE (the victim) is killed when request N arrives on its schedule (its
//! "running the schedule" line on stderr is its time zero; the seeded plan gives request N's
//! arrival). It is restarted at once with `--start-at K`: K is the first request that arrives
//! at least a restart's lead after the kill (twice the victim's own start-up time, clamped),
//! so that the new process is up and met its peer before its first request. Rank R of the
//! other engine (the survivor) runs with `--expect-peer-loss` from the start: it must give
//! every request a typed outcome, no byte error and every block back. Every other rank pair
//! runs as without `--kill` and must verify everything.
//!
//! Only the victim pair gets the short timings below (a heartbeat, fabric bounds, a survivor's
//! deadline or lease), so that the survivor notices the death and ends what it held within the
//! run; both sides of the pair get the same heartbeat and bounds, as the protocol requires.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{ChildStderr, ExitStatus};
use std::sync::{Arc, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::Value;

use super::{Children, ClusterArgs, Launch, RankLine};
use crate::cli::{demo_mode, ModeArg};
use kvhandoff_testkit::node::{self, NodeOptions, NodeRole};

/// [`RankLine::life`] of the rank to be killed, before the kill.
const VICTIM: &str = "victim";
/// [`RankLine::life`] of the killed process.
pub(super) const KILLED: &str = "killed";
/// [`RankLine::life`] of the victim's restarted process.
const RESTARTED: &str = "restarted";
/// [`RankLine::life`] of the victim's peer rank.
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
const LEASE_MS: &str = "3000";
/// The restart's lead (how long after the kill its first request arrives) is twice the
/// victim's own start-up, at least this...
const MIN_LEAD: Duration = Duration::from_millis(1000);
/// ...and at most this (the plan must leave requests for the restart).
const MAX_LEAD: Duration = Duration::from_millis(2500);

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
    /// `None`: no request of the plan arrives a lead after the kill; nothing was restarted.
    restart_at: Option<u64>,
}

/// Runs `--kill` for the cluster: the victim pair's flags, the kill, the restart, the report.
pub(super) struct Killer {
    spec: KillSpec,
    requests: u32,
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
    /// [`RankLine::life`].
    pub(super) fn launch(
        &mut self,
        engine: &str,
        rank: u32,
    ) -> (Vec<String>, Option<Arc<Marks>>, Option<&'static str>) {
        if rank != self.spec.rank {
            return (Vec::new(), None, None);
        }
        let mut flags = Killer::pair_flags();
        if engine == self.spec.engine.name() {
            let marks = Arc::new(Marks {
                spawned: Instant::now(),
                listening: OnceLock::new(),
                schedule: OnceLock::new(),
            });
            self.marks = Some(marks.clone());
            return (flags, Some(marks), Some(VICTIM));
        }
        flags.push("--expect-peer-loss".into());
        flags.extend(match self.spec.engine {
            Engine::Prefill => ["--decode-deadline-ms".into(), DECODE_DEADLINE_MS.into()],
            Engine::Decode => ["--lease-ms".into(), LEASE_MS.into()],
        });
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
        let startup = self
            .marks
            .as_ref()
            .and_then(|m| Some(m.listening.get()?.saturating_duration_since(m.spawned)))
            .unwrap_or(MAX_LEAD);
        (startup * 2).clamp(MIN_LEAD, MAX_LEAD)
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
        let lead = self.lead();
        let k = self
            .arrivals
            .partition_point(|a| *a < into + lead)
            .max(arrived);
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
        if k < self.arrivals.len() {
            let mut flags = Killer::pair_flags();
            flags.extend(["--start-at".to_string(), k.to_string()]);
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

    /// The kill section of the report, with its verdict, from every rank's line and its JSON.
    pub(super) fn report(self, ranks: &[RankLine], texts: &[String]) -> KillReport {
        let requests = u64::from(self.requests);
        let mut why = Vec::new();
        for r in ranks.iter().filter(|r| r.life.is_none()) {
            if !r.ok || r.done != requests {
                why.push(format!(
                    "{} rank {}: {}/{requests} done{}",
                    r.engine,
                    r.rank,
                    r.done,
                    r.error
                        .as_deref()
                        .map_or(String::new(), |e| format!(" ({e})"))
                ));
            }
        }
        let other_pairs_ok = why.is_empty();
        let kill = match self.phase {
            Phase::Killed(kill) => Some(kill),
            Phase::Armed => {
                why.push("the run ended before the kill".into());
                None
            }
            Phase::Missed(reason) => {
                why.push(format!("the victim was not killed: {reason}"));
                None
            }
        };
        if let Some(victim) = ranks.iter().find(|r| r.life == Some(KILLED)) {
            if victim.signal != Some(9) {
                why.push(format!("the killed process ended otherwise: {victim:?}"));
            }
        }
        let k = kill.as_ref().and_then(|k| k.restart_at);
        if kill.is_some() && k.is_none() {
            why.push(
                "no request of the plan arrives a restart's lead after the kill: nothing was \
                 restarted (give more --requests or an earlier @N)"
                    .into(),
            );
        }
        let restarted = ranks
            .iter()
            .find(|r| r.life == Some(RESTARTED))
            .map(|r| Incarnation {
                pid: r.pid,
                exit_code: r.exit_code,
                ok: r.ok,
                done: r.done,
            });
        let part = k.map_or(0, |k| requests - k);
        if let Some(r) = &restarted {
            if !r.ok || r.done != part {
                why.push(format!(
                    "the restarted rank: {}/{part} done, exit {:?}",
                    r.done, r.exit_code
                ));
            }
        }
        let survivor = ranks
            .iter()
            .zip(texts)
            .find(|(r, _)| r.life == Some(SURVIVOR))
            .map(|(r, text)| survivor(r, text, k));
        let mut served = 0;
        match &survivor {
            Some((s, after)) => {
                if !s.ok || s.byte_errors > 0 || s.leaked_blocks > 0 {
                    why.push(format!(
                        "the survivor: exit {:?}, {} byte errors, {} leaked blocks{}",
                        s.exit_code,
                        s.byte_errors,
                        s.leaked_blocks,
                        s.error
                            .as_deref()
                            .map_or(String::new(), |e| format!(" ({e})"))
                    ));
                }
                served = (*after).min(restarted.as_ref().map_or(0, |r| r.done));
                if k.is_some() && served != part {
                    why.push(format!("{served}/{part} requests served after the restart"));
                }
            }
            None => why.push("no survivor's report".into()),
        }
        KillReport {
            engine: self.spec.engine.name(),
            rank: self.spec.rank,
            at_request: self.spec.at,
            killed_pid: kill.as_ref().map(|k| k.pid),
            killed_run_ms: kill.as_ref().map(|k| k.run_ms),
            killed_schedule_ms: kill.as_ref().map(|k| k.schedule_ms),
            request_at_kill: kill.as_ref().map(|k| k.request),
            restart_lead_ms: kill.as_ref().map(|k| k.lead.as_secs_f64() * 1e3),
            restart_at: k,
            restarted,
            survivor: survivor.map(|(s, _)| s),
            served_after_restart: served,
            other_pairs_ok,
            ok: why.is_empty(),
            why,
        }
    }
}

/// The survivor's section from its line and JSON, and how many of requests `k..` it completed.
fn survivor(line: &RankLine, text: &str, k: Option<u64>) -> (Survivor, u64) {
    let report = super::report_of(text).unwrap_or(Value::Null);
    let node = &report["node"];
    let outcomes: BTreeMap<String, u64> = node["outcomes"]
        .as_object()
        .map(|o| {
            o.iter()
                .map(|(name, n)| (name.clone(), n.as_u64().unwrap_or(0)))
                .collect()
        })
        .unwrap_or_default();
    // What a request that went through is called on the survivor's side.
    let success = if line.engine == "decode" {
        "Ready"
    } else {
        "Sent"
    };
    let total: u64 = outcomes.values().sum();
    let failed = total - outcomes.get(success).copied().unwrap_or(0);
    let after = k.map_or(0, |k| {
        node["requests"].as_array().map_or(0, |list| {
            list.iter()
                .filter(|r| r["index"].as_u64().is_some_and(|i| i >= k))
                .filter(|r| r["outcome"] == success && r["byte_errors"].as_u64() == Some(0))
                .count() as u64
        })
    });
    let survivor = Survivor {
        engine: line.engine,
        rank: line.rank,
        pid: line.pid,
        exit_code: line.exit_code,
        ok: line.ok,
        outcomes,
        failed,
        byte_errors: line.byte_errors,
        leaked_blocks: line.leaked_blocks,
        peer_deaths: node["peer_deaths"].as_u64().unwrap_or(0),
        error: line.error.clone(),
    };
    (survivor, after)
}

/// The restarted process.
#[derive(Debug, Serialize)]
pub(super) struct Incarnation {
    pid: u32,
    exit_code: Option<i32>,
    /// Its strict verdict: every request of its part handed off.
    ok: bool,
    /// D: requests verified; P: requests sent (of its part, `K..`).
    done: u64,
}

/// The killed rank's peer, which ran on.
#[derive(Debug, Serialize)]
pub(super) struct Survivor {
    engine: &'static str,
    rank: u32,
    pid: u32,
    exit_code: Option<i32>,
    /// Its node verdict: every request one typed outcome, every block back.
    ok: bool,
    /// Its requests by typed outcome (`Ready` / `Sent` for those that went through).
    outcomes: BTreeMap<String, u64>,
    /// Requests that did not go through (every outcome but `Ready` / `Sent`).
    failed: u64,
    byte_errors: u64,
    leaked_blocks: u64,
    /// Peers its endpoint declared dead.
    peer_deaths: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

/// `--kill` in the report.
#[derive(Debug, Serialize)]
pub(crate) struct KillReport {
    engine: &'static str,
    rank: u32,
    /// `@N`: the request at whose arrival the rank was to die.
    at_request: u32,
    killed_pid: Option<u32>,
    /// When it was killed, ms into the run (from the command's start).
    killed_run_ms: Option<f64>,
    /// When it was killed, ms into its schedule (from its handshake).
    killed_schedule_ms: Option<f64>,
    /// The last request that had arrived on its schedule when it was killed.
    request_at_kill: Option<u64>,
    /// How long after the kill the restart's first request arrives, at least, ms.
    restart_lead_ms: Option<f64>,
    /// K: the restarted process ran requests `K..` of the plan.
    restart_at: Option<u64>,
    restarted: Option<Incarnation>,
    survivor: Option<Survivor>,
    /// Requests `K..` that went through on both sides of the restarted pair.
    served_after_restart: u64,
    /// Whether every rank pair but the killed rank's verified (D) and sent (P) every request.
    other_pairs_ok: bool,
    /// Whether the kill went as the issue asks: the other pairs all verified, the survivor's
    /// outcomes all typed with no byte error and no leak, the restart served `K..`.
    pub(super) ok: bool,
    /// Why not, when not.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    why: Vec<String>,
}

impl KillReport {
    /// The verdict line's count of requests: the other pairs', then the killed rank's pair's.
    pub(super) fn verdict_head(&self, requests: u64) -> String {
        let others = if self.other_pairs_ok {
            "every other rank pair verified every request"
        } else {
            "not every other rank pair verified every request"
        };
        let survivor = self.survivor.as_ref().map_or(String::new(), |s| {
            format!(
                "{} of {requests} went through and {} failed typed, ",
                requests - s.failed.min(requests),
                s.failed
            )
        });
        let part = self.restart_at.map_or(0, |k| requests.saturating_sub(k));
        format!(
            "{others}; the killed rank's pair: {survivor}{}/{part} served after the restart",
            self.served_after_restart
        )
    }

    /// The section's lines for the table.
    pub(super) fn render(&self) -> String {
        let mut out = format!(
            "kill: {} rank {} at request {}",
            self.engine, self.rank, self.at_request
        );
        if let (Some(pid), Some(run), Some(into), Some(request)) = (
            self.killed_pid,
            self.killed_run_ms,
            self.killed_schedule_ms,
            self.request_at_kill,
        ) {
            out.push_str(&format!(
                ": pid {pid} killed {into:.0} ms into its schedule (request {request}), \
                 {run:.0} ms into the run"
            ));
        }
        out.push('\n');
        if let (Some(k), Some(r)) = (self.restart_at, &self.restarted) {
            out.push_str(&format!(
                "  restarted: pid {} with --start-at {k} ({:.0} ms lead), exit {}, {} done; \
                 {} requests {k}.. served\n",
                r.pid,
                self.restart_lead_ms.unwrap_or(0.0),
                r.exit_code.map_or("-".into(), |c| c.to_string()),
                r.done,
                self.served_after_restart
            ));
        }
        if let Some(s) = &self.survivor {
            let outcomes: Vec<String> =
                s.outcomes.iter().map(|(o, n)| format!("{o} {n}")).collect();
            out.push_str(&format!(
                "  survivor: {} rank {} (pid {}), exit {}: {}; {} failed typed, {} byte errors, \
                 {} leaked blocks, {} peer deaths\n",
                s.engine,
                s.rank,
                s.pid,
                s.exit_code.map_or("-".into(), |c| c.to_string()),
                outcomes.join(", "),
                s.failed,
                s.byte_errors,
                s.leaked_blocks,
                s.peer_deaths
            ));
        }
        for why in &self.why {
            out.push_str(&format!("  not ok: {why}\n"));
        }
        out
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
