//! `kvhandoff node`: one engine role of the demo as its own process, talking to the other role's
//! process over the TCP side channel and NIXL.
//!
//! ```text
//! kvhandoff node --role decode  --listen 127.0.0.1:5601 --peer 127.0.0.1:5600 --requests 200
//! kvhandoff node --role prefill --listen 127.0.0.1:5600 --peer 127.0.0.1:5601 --requests 200
//! ```
//!
//! Each process builds one rank of the demo's geometry (`prefill-0` or `decode-0`, TP 1), starts
//! it with a TCP side channel on `--listen` ([`Handshaker::Tcp`]) and puts the other role's
//! `--peer` address in its link's peer book ([`AddPeerAddress`]). Both derive the same seeded
//! schedule from the same options (`--requests`, `--seed`, `--max-prompt-tokens` must match):
//! P fills each request's blocks with the pattern and calls `request_finished`, D allocates,
//! calls `request_allocated` with the parameters a router would give it (`remote_engine_id
//! prefill-0`, `remote_host`/`remote_port` = `--peer`, `tp_size 1`, `do_remote_prefill`) and
//! checks every byte on `BlocksReady`.
//!
//! # Finding each other
//! Either process may start first. Everything is bounded by one deadline from the process's
//! start ([`DemoOptions::timeout`], `--timeout-secs`, default 60 s).
//! - D probes P's side channel with plain TCP connects until one is accepted, then asks its
//!   link for the handshake ([`Connect`]) and waits until it completed
//!   ([`SideChannelStats::outgoing_ok`]), so that no request pays for it (and no request's own
//!   handshake can race it). A failed handshake is retried.
//! - P waits until D's handshake arrived ([`SideChannelStats::incoming_ok`] `>= 1`).
//!
//! The schedule's time zero is the moment P saw the handshake complete; D takes the middle of
//! its handshake for it (each side loads the other's metadata before counting the handshake,
//! which takes about as long on both: tens of milliseconds with NIXL). So the two clocks agree
//! within a few milliseconds; from then on nothing passes between the processes but the
//! protocol. Both follow the schedule's clock: prompt `i` reaches P at `arrival_i`, its prefill
//! is due done at `arrival_i + hold`, P calls `request_finished` `prefill_delay_i` and D calls
//! `request_allocated` `decode_delay_i` after that. So both races happen, in about equal
//! numbers, as long as P's fills keep up with the arrivals (P's report says how late it ran: a
//! late P makes D register first).
//!
//! # Ending
//! D ends when every request is verified (or failed), P when every request had its event
//! (`Sent` or `Released`) — which needs D's registrations. P then stays until D's side channel
//! refuses connections (D has exited, so every notification P sent has been read) or for at most
//! [`NodeOptions::linger`]. Each prints its report and exits 0 only if its own side is OK: D's
//! report is a [`DemoReport`] ([`ReportRole::Decode`](crate::demo::ReportRole::Decode), the demo's keys), P's a
//! [`PrefillReport`] with P's counts, the race counts of its endpoint included.
//!
//! # Kills and restarts
//! A node survives the death of its peer (`kill -9`) and serves the peer's next incarnation:
//! the endpoint declares the peer dead after [`Config::peer_timeout`] of silence (1.5
//! heartbeats with `--heartbeat-ms`), fails what was bound to it with a typed outcome, and takes
//! a new handshake from the same engine as a restart. For tests of that:
//! - `--start-at K` runs requests `K..` of the same seeded plan (a restarted node continues the
//!   plan its predecessor was running; same seed, so the same ids and pairing keys). Its clock
//!   is shifted so that request `K` arrives at its time zero (its handshake).
//! - `--heartbeat-ms H` (peer timeout 1.5 H), `--lease-ms`, `--decode-deadline-ms` set the
//!   protocol's timing ([`NodeTiming`]), kept valid for [`Config::validate`].
//! - Every node reports, besides its role's report, a [`NodeFacts`] section (`"node"` in the
//!   JSON): each request's typed outcome and when it ended (unix ms), the pool's free blocks at
//!   the end, and the peer deaths its endpoint declared (with when the node saw each).
//! - `--expect-peer-loss` makes the node a survivor: it exits 0 when [`NodeFacts::ok`] holds
//!   (every request has exactly one typed outcome, no byte error in a `Ready` request, every
//!   block back, nothing else went wrong) even if some requests failed; without it a node also
//!   needs its role's strict verdict (every request handed off).
//!
//! P runs until every request of its plan has an outcome, whatever happens to D: requests whose
//! D never registers end by lease expiry (`--lease-ms`). Then it stays until D exits, for at most
//! `--linger-ms`.
//!
//! Without the cargo feature `nixl`, [`run`] returns [`DemoError::NoNixl`] and the CLI prints
//! that message and exits 1. [`run_on`] runs a node on any transport whose agents can reach each
//! other (the tests run two in-memory nodes in one process).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kvhandoff_actors::machine::{Config, Counters};
use kvhandoff_actors::system::{
    agent_name, build_rank, AddPeerAddress, Connect, Handshaker, LinkActor, QuerySideChannel,
    RankActor, RankMemory, ShellConfig, SideChannelConfig, SideChannelStats,
};
use kvhandoff_actors::transport::TransportError;
use kvhandoff_actors::PeerAddr;
use kvhandoff_protocol::{AgentName, EngineId};
use serde::{Deserialize, Serialize};

use crate::demo::{
    self, block_on_timeout, build_report, check_options, human_bytes, identity, model,
    query_counters, races_of, run_decode, run_prefill, schedule, DecodePacing, DecodeRecord,
    DecodeRun, DemoError, DemoOptions, DemoReport, Facts, FreeList, Planned, PrefillOutcomes,
    PrefillPacing, PrefillRecord, PrefillRun, Races, Tallies, DECODE_ENGINE, PREFILL_ENGINE,
};
use crate::{ConnectorIdentity, KvConnector, KvTransferParams, Runtime};

/// Which engine a node runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NodeRole {
    /// `prefill-0`: fills and sends.
    Prefill,
    /// `decode-0`: receives and verifies.
    Decode,
}

/// What a node runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeOptions {
    /// This process's engine.
    pub role: NodeRole,
    /// Where this rank's side channel listens (port 0 picks one; it is printed on stderr).
    pub listen: SocketAddr,
    /// The other role's side channel.
    pub peer: SocketAddr,
    /// The schedule, pool and deadline, as in the demo ([`DemoOptions::transport`] is not
    /// used). Both processes must be given the same schedule options. `timeout` bounds the
    /// whole process, waiting for the peer included.
    pub schedule: DemoOptions,
    /// The schedule's time from a prompt's arrival to its prefill being done (default 20 ms).
    pub hold: Duration,
    /// How long P stays, after its last event, waiting for D to exit (default 10 s).
    pub linger: Duration,
    /// The first request of the plan this node runs (default 0; see the module docs).
    pub start_at: usize,
    /// The protocol's timing (default: [`Config::default`]).
    pub timing: NodeTiming,
    /// The peer is expected to die during the run: the exit status follows [`NodeFacts::ok`]
    /// alone (default false).
    pub expect_peer_loss: bool,
}

/// The protocol timing of a node; `None` keeps [`Config::default`]'s value.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NodeTiming {
    /// The heartbeat interval H; the peer timeout becomes 1.5 H (at least 10 ms).
    pub heartbeat: Option<Duration>,
    /// How long P holds finished blocks without a registration or renewal.
    pub lease: Option<Duration>,
    /// How long D waits for P's data after allocating.
    pub decode_deadline: Option<Duration>,
}

impl NodeTiming {
    /// The endpoint configuration: [`Config::default`] with these values, and the values that
    /// depend on them moved so that [`Config::validate`] holds: a heartbeat renews a lease by at
    /// most the lease and by more than one heartbeat (`lease_extension`), the quarantine covers
    /// the latest a late write can land, and ended keys are remembered for at least the peer
    /// timeout.
    ///
    /// # Errors
    /// A heartbeat under 10 ms, a lease not above the heartbeat, or any other invalid result.
    pub fn config(&self) -> Result<Config, String> {
        let mut c = Config::default();
        if let Some(h) = self.heartbeat {
            if h < Duration::from_millis(10) {
                return Err(format!("a heartbeat of {h:?} is below 10 ms"));
            }
            c.heartbeat_interval = h;
            c.peer_timeout = h * 3 / 2;
        }
        if let Some(lease) = self.lease {
            c.lease_duration = lease;
        }
        if let Some(deadline) = self.decode_deadline {
            c.decode_deadline = deadline;
        }
        c.lease_extension = c.lease_extension.min(c.lease_duration);
        if c.lease_extension <= c.heartbeat_interval {
            // A renewal must outlast the next heartbeat: renew by the whole lease.
            c.lease_extension = c.lease_duration;
        }
        if c.lease_extension <= c.heartbeat_interval {
            return Err(format!(
                "the lease ({:?}) must exceed the heartbeat interval ({:?})",
                c.lease_duration, c.heartbeat_interval
            ));
        }
        let latest_write =
            c.registration_ttl + c.heartbeat_interval + c.write_timeout + c.abandon_timeout;
        if c.quarantine <= latest_write {
            c.quarantine = latest_write + c.heartbeat_interval;
        }
        c.tombstone_ttl = c.tombstone_ttl.max(c.peer_timeout);
        c.validate().map_err(|e| e.to_string())?;
        Ok(c)
    }
}

impl NodeOptions {
    /// The defaults for `role` between `listen` and `peer`: the demo's schedule options but
    /// prompts of at most 512 tokens arriving 20 ms apart on average (so that P's fills keep up
    /// on a small machine) and call offsets of up to 30 ms (so that D's registration, which
    /// crosses processes, still often reaches P before P finishes).
    pub fn new(role: NodeRole, listen: SocketAddr, peer: SocketAddr) -> Self {
        NodeOptions {
            role,
            listen,
            peer,
            schedule: DemoOptions {
                max_prompt_tokens: 512,
                mean_arrival_gap: Duration::from_millis(20),
                max_call_skew: Duration::from_millis(30),
                ..DemoOptions::default()
            },
            hold: Duration::from_millis(20),
            linger: Duration::from_secs(10),
            start_at: 0,
            timing: NodeTiming::default(),
            expect_peer_loss: false,
        }
    }
}

/// The side channel as this node saw it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LinkSummary {
    /// Where this node listened.
    pub listen: String,
    /// The peer's side channel.
    pub peer: String,
    /// From the process's start to the handshake (the schedule's start), ms.
    pub waited_ms: f64,
    /// Incoming handshakes completed.
    pub incoming_ok: u64,
    /// Outgoing handshakes completed.
    pub outgoing_ok: u64,
    /// Incoming connections rejected (the peer's probes among them).
    pub rejected: u64,
    /// Outgoing handshakes that failed.
    pub outgoing_failed: u64,
}

/// What P's node did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PrefillReport {
    /// `"nixl"` (or the transport given to [`run_on`]).
    pub transport: String,
    /// Always [`NodeRole::Prefill`].
    pub role: NodeRole,
    /// The schedule's seed.
    pub seed: u64,
    /// Requests in the schedule.
    pub requests: u64,
    /// Races as P's endpoint counted them.
    pub races: Races,
    /// P's outcomes.
    pub prefill_outcomes: PrefillOutcomes,
    /// Bytes of the requests whose write completed (`Sent`).
    pub bytes: u64,
    /// Bytes the requests' blocks hold.
    pub expected_bytes: u64,
    /// Prompt tokens over all requests.
    pub tokens: u64,
    /// Blocks over all requests.
    pub blocks: u64,
    /// Requests whose `request_finished` came more than 1 ms after the schedule's time (P's
    /// fill ran late).
    pub late_finishes: u64,
    /// The latest `request_finished` against the schedule, ms.
    pub max_finish_lag_ms: f64,
    /// P's engine events.
    pub events: u64,
    /// Events beyond the first for a request.
    pub duplicates: u64,
    /// Events naming an unknown request, or handing back other blocks.
    pub unknown: u64,
    /// Blocks freed while already free.
    pub double_frees: u64,
    /// Blocks not back on the free list at the end.
    pub leaked_blocks: u64,
    /// Logical blocks in the pool.
    pub pool_blocks: u32,
    /// The side channel.
    pub link: LinkSummary,
    /// Whether D had exited (its side channel refused a connection) before P left.
    pub peer_exited: bool,
    /// The whole process, ms.
    pub wall_ms: f64,
    /// Whether the run hit its overall limit.
    pub timed_out: bool,
    /// Everything that went wrong, in words (at most 32 kept).
    pub errors: Vec<String>,
    /// [`PrefillReport::verdict_ok`] at the end.
    pub ok: bool,
    /// The verdict line.
    pub verdict: String,
}

impl PrefillReport {
    /// True only if every request was sent, with exactly one event each, and every block came
    /// back once.
    pub fn verdict_ok(&self) -> bool {
        let n = self.requests;
        n > 0
            && !self.timed_out
            && self.errors.is_empty()
            && self.prefill_outcomes.sent == n
            && self.events == n
            && self.duplicates == 0
            && self.unknown == 0
            && self.double_frees == 0
            && self.leaked_blocks == 0
    }

    fn verdict_line(&self) -> String {
        let o = &self.prefill_outcomes;
        let head = format!(
            "{}/{} requests sent ({} released, {} without an event)",
            o.sent, self.requests, o.released, o.missing
        );
        if self.verdict_ok() {
            return format!("verdict: OK — {head}");
        }
        let mut why = vec![head];
        if self.timed_out {
            why.push("timed out".into());
        }
        if self.double_frees > 0 || self.leaked_blocks > 0 {
            why.push(format!(
                "{} double frees, {} blocks not returned",
                self.double_frees, self.leaked_blocks
            ));
        }
        if self.duplicates > 0 || self.unknown > 0 {
            why.push(format!(
                "{} duplicate and {} unknown events",
                self.duplicates, self.unknown
            ));
        }
        if let Some(first) = self.errors.first() {
            why.push(format!("{} errors (first: {first})", self.errors.len()));
        }
        format!("verdict: FAILED — {}", why.join("; "))
    }

    /// The report as a table for people, ending with the verdict line.
    pub fn render_table(&self) -> String {
        let mut lines: Vec<(&str, String)> = vec![
            (
                "transport",
                format!(
                    "{} (this process is P; D runs in another process)",
                    self.transport
                ),
            ),
            (
                "side channel",
                format!(
                    "listen {}, peer {}; D connected after {:.0} ms",
                    self.link.listen, self.link.peer, self.link.waited_ms
                ),
            ),
            (
                "requests",
                format!(
                    "{} (seed {}), {} tokens, {} blocks",
                    self.requests, self.seed, self.tokens, self.blocks
                ),
            ),
            (
                "races (P's count)",
                format!(
                    "D registers first {:>4}   P finishes first {:>4}",
                    self.races.decode_registers_first, self.races.prefill_finishes_first
                ),
            ),
            (
                "P outcomes",
                format!(
                    "sent {}   released {}   no event {}",
                    self.prefill_outcomes.sent,
                    self.prefill_outcomes.released,
                    self.prefill_outcomes.missing
                ),
            ),
            (
                "bytes sent",
                format!(
                    "{} (expected {})",
                    human_bytes(self.bytes),
                    human_bytes(self.expected_bytes)
                ),
            ),
            (
                "schedule",
                format!(
                    "{} finishes late, worst {:.1} ms",
                    self.late_finishes, self.max_finish_lag_ms
                ),
            ),
            (
                "blocks",
                format!(
                    "pool {}; double frees {}; not returned {}",
                    self.pool_blocks, self.double_frees, self.leaked_blocks
                ),
            ),
            (
                "events",
                format!(
                    "P {}   duplicates {}   unknown {}",
                    self.events, self.duplicates, self.unknown
                ),
            ),
            (
                "wall time",
                format!(
                    "{:.1} ms (D {} before P left)",
                    self.wall_ms,
                    if self.peer_exited {
                        "exited"
                    } else {
                        "had not exited"
                    }
                ),
            ),
        ];
        for (i, e) in self.errors.iter().take(5).enumerate() {
            lines.push((if i == 0 { "errors" } else { "" }, e.clone()));
        }
        let mut out = String::from("kvhandoff node: prefill side of the KV handoff\n");
        for (name, value) in lines {
            let _ = writeln!(out, "  {name:<19} {value}");
        }
        out.push_str(&self.verdict);
        out.push('\n');
        out
    }
}

/// What a node reports: P's counts or D's demo report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum NodeReport {
    /// `--role prefill`.
    Prefill(PrefillReport),
    /// `--role decode` ([`ReportRole::Decode`](crate::demo::ReportRole::Decode)).
    Decode(DemoReport),
}

impl NodeReport {
    /// Whether this node's side is OK.
    pub fn verdict_ok(&self) -> bool {
        match self {
            NodeReport::Prefill(r) => r.verdict_ok(),
            NodeReport::Decode(r) => r.verdict_ok(),
        }
    }

    /// The report as a table for people.
    pub fn render_table(&self) -> String {
        match self {
            NodeReport::Prefill(r) => r.render_table(),
            NodeReport::Decode(r) => r.render_table(),
        }
    }
}

/// One request's end as a node saw it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestEnd {
    /// The request's index in the whole seeded plan.
    pub index: u64,
    /// Its typed outcome: `"Sent"` or `"Released(<ReleaseCause>)"` on P, `"Ready"` or
    /// `"Failed(<DecodeFailure>)"` on D (the machines' `Debug` names); `None` without one.
    pub outcome: Option<String>,
    /// Events the engine got for it (exactly 1 when all is well).
    pub events: u32,
    /// When this side's engine called (`request_finished` / `request_allocated`), unix ms.
    pub called_unix_ms: Option<f64>,
    /// When the engine took its event, unix ms.
    pub ended_unix_ms: Option<f64>,
    /// D: bytes found wrong (of a `Ready` request).
    pub byte_errors: u64,
}

/// The pool at the end of the run (the leak check).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolSummary {
    /// Logical blocks in the pool.
    pub blocks: u32,
    /// Blocks back on the engine's free list at the end.
    pub free_at_end: u32,
    /// Blocks freed while already free.
    pub double_frees: u64,
    /// Block ids outside the pool handed back.
    pub bad_ids: u64,
}

/// What every node reports besides its role's report (`"node"` in the JSON): the facts a kill
/// test checks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeFacts {
    /// The first request of the plan this node ran.
    pub start_at: u64,
    /// The heartbeat interval in force, ms.
    pub heartbeat_ms: f64,
    /// The peer timeout in force, ms.
    pub peer_timeout_ms: f64,
    /// P's lease in force, ms.
    pub lease_ms: f64,
    /// D's deadline in force, ms.
    pub decode_deadline_ms: f64,
    /// Whether the node ran as a survivor (`--expect-peer-loss`).
    pub expect_peer_loss: bool,
    /// The schedule's time zero (the handshake), unix ms.
    pub schedule_start_unix_ms: f64,
    /// The pool at the end.
    pub pool: PoolSummary,
    /// Peers the endpoint declared dead (`Counters::peers_declared_dead`, restarts included).
    pub peer_deaths: u64,
    /// When the node saw each of those deaths (it polls the counters every 10 ms), unix ms.
    pub peer_deaths_seen_unix_ms: Vec<f64>,
    /// Requests per outcome (`"none"` for those without one).
    pub outcomes: BTreeMap<String, u64>,
    /// Every request of the node's part of the plan, in plan order.
    pub requests: Vec<RequestEnd>,
    /// Errors that no typed outcome explains (at most 32).
    pub unexplained_errors: Vec<String>,
    /// [`NodeFacts::verdict_ok`] at the end.
    pub ok: bool,
    /// The verdict line.
    pub verdict: String,
}

impl NodeFacts {
    /// True when every request has exactly one typed outcome, no `Ready` request has a wrong
    /// byte, every block is back on the free list (none freed twice), the run did not time out
    /// and no error is left that a typed outcome does not explain.
    pub fn verdict_ok(&self) -> bool {
        !self.requests.is_empty()
            && self
                .requests
                .iter()
                .all(|r| r.events == 1 && r.outcome.is_some())
            && self
                .requests
                .iter()
                .all(|r| r.byte_errors == 0 || r.outcome.as_deref() != Some("Ready"))
            && self.pool.free_at_end == self.pool.blocks
            && self.pool.double_frees == 0
            && self.pool.bad_ids == 0
            && self.unexplained_errors.is_empty()
    }

    fn verdict_line(&self, timed_out: bool) -> String {
        let counts: Vec<String> = self
            .outcomes
            .iter()
            .map(|(o, n)| format!("{o} {n}"))
            .collect();
        let head = format!(
            "{} requests: {}; {} peer deaths; pool {}/{} free",
            self.requests.len(),
            counts.join(", "),
            self.peer_deaths,
            self.pool.free_at_end,
            self.pool.blocks
        );
        if self.ok {
            return format!("node verdict: OK — {head}");
        }
        let mut why = vec![head];
        if timed_out {
            why.push("timed out".into());
        }
        let bad = self
            .requests
            .iter()
            .filter(|r| r.events != 1 || r.outcome.is_none())
            .count();
        if bad > 0 {
            why.push(format!("{bad} requests without exactly one outcome"));
        }
        if let Some(first) = self.unexplained_errors.first() {
            why.push(format!(
                "{} unexplained errors (first: {first})",
                self.unexplained_errors.len()
            ));
        }
        format!("node verdict: FAILED — {}", why.join("; "))
    }
}

/// A node's whole result: its role's report and the [`NodeFacts`]. The JSON is the role's
/// report with a `"node"` key added.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NodeRun {
    /// The role's report.
    #[serde(flatten)]
    pub report: NodeReport,
    /// The facts of every node.
    pub node: NodeFacts,
}

impl NodeRun {
    /// The exit status's verdict: [`NodeFacts::ok`], and for a node that does not expect to
    /// lose its peer, its role's strict verdict as well.
    pub fn verdict_ok(&self) -> bool {
        self.node.ok && (self.node.expect_peer_loss || self.report.verdict_ok())
    }

    /// The role's table, then the node's facts.
    pub fn render_table(&self) -> String {
        let n = &self.node;
        let mut out = self.report.render_table();
        let deaths: Vec<String> = n
            .peer_deaths_seen_unix_ms
            .iter()
            .map(|t| format!("{:.0}", t - n.schedule_start_unix_ms))
            .collect();
        let lines = [
            (
                "plan",
                format!("requests {}.. of the seeded plan", n.start_at),
            ),
            (
                "timing",
                format!(
                    "heartbeat {:.0} ms, peer timeout {:.0} ms, lease {:.0} ms, D deadline {:.0} ms",
                    n.heartbeat_ms, n.peer_timeout_ms, n.lease_ms, n.decode_deadline_ms
                ),
            ),
            (
                "peer deaths",
                format!(
                    "{} (seen at {} ms from the schedule's start)",
                    n.peer_deaths,
                    deaths.join(", ")
                ),
            ),
        ];
        for (name, value) in lines {
            let _ = writeln!(out, "  {name:<19} {value}");
        }
        out.push_str(&n.verdict);
        out.push('\n');
        out
    }
}

/// Runs one node on NIXL (cargo feature `nixl`); its role's report only (see [`run_full`]).
///
/// # Errors
/// As [`run_full`].
pub fn run(options: &NodeOptions) -> Result<NodeReport, DemoError> {
    run_full(options).map(|run| run.report)
}

/// Runs one node on NIXL (cargo feature `nixl`).
///
/// # Errors
/// [`DemoError::NoNixl`] without the feature; [`DemoError::NixlUnavailable`] without the NIXL
/// runtime; otherwise as [`run_full_on`].
pub fn run_full(options: &NodeOptions) -> Result<NodeRun, DemoError> {
    #[cfg(feature = "nixl")]
    {
        use kvhandoff_actors::transport::nixl::{
            nixl_runtime_available, NixlConfig, NixlTransport,
        };
        nixl_runtime_available().map_err(|e| DemoError::NixlUnavailable(e.to_string()))?;
        run_full_on("nixl", options, |name| {
            NixlTransport::new(name, NixlConfig::default())
        })
    }
    #[cfg(not(feature = "nixl"))]
    {
        let _ = options;
        Err(DemoError::NoNixl)
    }
}

/// [`run_full_on`], the role's report only.
///
/// # Errors
/// As [`run_full_on`].
pub fn run_on<T, F>(
    transport: &'static str,
    options: &NodeOptions,
    make: F,
) -> Result<NodeReport, DemoError>
where
    T: RankMemory + Unpin + Send + 'static,
    F: FnOnce(AgentName) -> Result<T, TransportError>,
{
    run_full_on(transport, options, make).map(|run| run.report)
}

/// Wall-clock times of a run's instants.
#[derive(Debug, Clone, Copy)]
struct UnixClock {
    at: Instant,
    unix_ms: f64,
}

impl UnixClock {
    fn now() -> Self {
        let unix_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64() * 1e3);
        UnixClock {
            at: Instant::now(),
            unix_ms,
        }
    }

    fn unix_ms(&self, t: Instant) -> f64 {
        if t >= self.at {
            self.unix_ms + (t - self.at).as_secs_f64() * 1e3
        } else {
            self.unix_ms - (self.at - t).as_secs_f64() * 1e3
        }
    }
}

/// Watches the endpoint's `peers_declared_dead` on its own thread, every 10 ms, and notes when
/// each death was first seen.
struct DeathWatch {
    stop: Arc<AtomicBool>,
    thread: Option<thread::JoinHandle<Vec<Instant>>>,
}

impl DeathWatch {
    const POLL: Duration = Duration::from_millis(10);

    fn start(rank: actix::Addr<RankActor>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = thread::Builder::new()
            .name("node-death-watch".into())
            .spawn(move || {
                let mut seen = Vec::new();
                let mut deaths = 0;
                while !flag.load(Ordering::Relaxed) {
                    if let Some(c) = query_counters(&rank) {
                        let now = Instant::now();
                        while deaths < c.peers_declared_dead {
                            deaths += 1;
                            seen.push(now);
                        }
                    }
                    thread::sleep(Self::POLL);
                }
                seen
            })
            .ok();
        DeathWatch { stop, thread }
    }

    /// Stops the watch; the deaths seen, in order.
    fn finish(mut self) -> Vec<Instant> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .take()
            .and_then(|t| t.join().ok())
            .unwrap_or_default()
    }
}

impl Drop for DeathWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The part of `plan` a node runs: requests `start_at..`, with arrivals shifted so that the
/// first arrives at the node's time zero.
fn part_of(plan: &[Planned], start_at: usize) -> Vec<Planned> {
    let Some(first) = plan.get(start_at) else {
        return Vec::new();
    };
    let zero = first.arrival;
    plan[start_at..]
        .iter()
        .map(|q| Planned {
            arrival: q.arrival.saturating_sub(zero),
            ..q.clone()
        })
        .collect()
}

/// Runs one node on the transport `make` creates for the rank's agent name; `transport` names
/// it in the report.
///
/// # Errors
/// [`DemoError`] when the node cannot start: bad options, a transport or rank that cannot be
/// built, a side channel that cannot listen. A node that starts and goes wrong (the peer never
/// came, a request failed) returns a report whose verdict is FAILED.
pub fn run_full_on<T, F>(
    transport: &'static str,
    options: &NodeOptions,
    make: F,
) -> Result<NodeRun, DemoError>
where
    T: RankMemory + Unpin + Send + 'static,
    F: FnOnce(AgentName) -> Result<T, TransportError>,
{
    let wall = Instant::now();
    let clock = UnixClock::now();
    let opts = &options.schedule;
    let deadline = wall + opts.timeout;
    let workload = check_options(opts)?;
    let whole = schedule(opts, workload.block_tokens)?;
    if options.start_at >= whole.len() {
        return Err(DemoError::Options(format!(
            "start_at {} is not below requests {}",
            options.start_at,
            whole.len()
        )));
    }
    let plan = part_of(&whole, options.start_at);
    let config = options.timing.config().map_err(DemoError::Options)?;
    let engine_id = |name| EngineId::new(name).map_err(|e| DemoError::Options(e.to_string()));
    let (own, other) = match options.role {
        NodeRole::Prefill => (engine_id(PREFILL_ENGINE)?, engine_id(DECODE_ENGINE)?),
        NodeRole::Decode => (engine_id(DECODE_ENGINE)?, engine_id(PREFILL_ENGINE)?),
    };
    let name = agent_name(&own, 0).map_err(|e| DemoError::Options(e.to_string()))?;
    let rank_transport = make(name).map_err(|e| DemoError::Build(e.into()))?;
    let shell = ShellConfig {
        poll_interval: opts.poll_interval,
        ..ShellConfig::default()
    };
    let (setup, pool) = build_rank(
        rank_transport,
        &own,
        workload.geometry.clone(),
        &model(),
        opts.pool_blocks,
        config.clone(),
        shell,
    )?;
    let runtime = Runtime::start()?;
    let handle = runtime.add_rank_with(
        setup,
        Handshaker::Tcp(SideChannelConfig::new(options.listen)),
    )?;
    let listen = handle.side_channel.unwrap_or(options.listen);
    eprintln!(
        "kvhandoff node: {own} listening on {listen}, peer {other} at {}",
        options.peer
    );
    let link = handle.link.clone();
    let rank = handle.rank.clone();
    let watch = DeathWatch::start(rank.clone());
    let added = block_on_timeout(
        link.send(AddPeerAddress {
            engine: other.clone(),
            addr: options.peer,
        }),
        Duration::from_secs(5),
    );
    if !matches!(added, Some(Ok(Ok(())))) {
        return Err(DemoError::Options(format!(
            "the link did not take the peer's address {}",
            options.peer
        )));
    }
    let conn = KvConnector::new(
        ConnectorIdentity {
            host: listen.ip().to_string(),
            port: listen.port(),
            ..identity(own.as_str())?
        },
        handle,
    );

    let mut errors = Vec::new();
    let met = match options.role {
        NodeRole::Decode => await_prefill(&link, options.peer, &other, deadline),
        NodeRole::Prefill => await_decode(&link, deadline),
    };
    // The schedule's time zero: when P saw the handshake complete (D's estimate of it on D).
    let start = match met {
        Ok(at) => at,
        Err(why) => {
            errors.push(why);
            Instant::now()
        }
    };
    let waited_ms = (Instant::now() - wall).as_secs_f64() * 1e3;
    eprintln!(
        "kvhandoff node: {own} met {other} after {waited_ms:.0} ms; running the schedule \
         (requests {}..{})",
        options.start_at,
        whole.len()
    );
    let facts = FactsInput {
        options,
        config: &config,
        clock,
        start,
    };

    let run = match options.role {
        NodeRole::Decode => {
            let side = run_decode(
                conn,
                pool,
                &plan,
                DecodeRun {
                    start,
                    deadline,
                    pacing: DecodePacing::Clock { hold: options.hold },
                    params: KvTransferParams {
                        do_remote_prefill: true,
                        remote_engine_id: Some(PREFILL_ENGINE.into()),
                        remote_host: Some(options.peer.ip().to_string()),
                        remote_port: Some(options.peer.port()),
                        tp_size: Some(1),
                        ..KvTransferParams::default()
                    },
                },
            );
            let counters = query_counters(&rank);
            let deaths = watch.finish();
            errors.extend(side.errors);
            let bytes = plan
                .iter()
                .zip(&side.records)
                .filter(|(_, r)| r.ready)
                .map(|(q, _)| q.blocks as u64 * workload.block_bytes)
                .sum();
            drop(rank);
            runtime.shutdown();
            let (ends, explained) = decode_ends(&plan, &side.records, options.start_at, clock);
            let node = facts.build(Outcome {
                ends,
                explained,
                errors: &errors,
                free: &side.free,
                pool_blocks: opts.pool_blocks,
                counters: counters.as_ref(),
                deaths,
                timed_out: side.timed_out,
            });
            let report = NodeReport::Decode(build_report(
                Facts {
                    options: opts,
                    transport,
                    workload: &workload,
                    plan: &plan,
                    prefill: None,
                    decode: &side.records,
                },
                Tallies {
                    races: Races::default(),
                    bytes,
                    errors,
                    timed_out: side.timed_out,
                    double_frees: side.free.double_frees,
                    bad_ids: side.free.bad_ids,
                    leaks: demo::Leaks {
                        prefill: 0,
                        decode: side.free.in_use(),
                    },
                    duplicates: side.duplicates,
                    unknown: side.unknown,
                    wall,
                },
            ));
            NodeRun { report, node }
        }
        NodeRole::Prefill => {
            let side = run_prefill(
                conn,
                pool,
                &plan,
                PrefillRun {
                    start,
                    deadline,
                    corrupt: opts.corrupt_one_request.then_some(plan.len() / 2),
                    pacing: PrefillPacing::Clock { hold: options.hold },
                },
            );
            let peer_exited = await_exit(
                options.peer,
                (Instant::now() + options.linger).min(deadline),
            );
            let counters = query_counters(&rank);
            let deaths = watch.finish();
            let stats = side_channel(&link);
            drop(rank);
            runtime.shutdown();
            errors.extend(side.errors);
            let (ends, explained) = prefill_ends(&plan, &side.records, options.start_at, clock);
            let node = facts.build(Outcome {
                ends,
                explained,
                errors: &errors,
                free: &side.free,
                pool_blocks: opts.pool_blocks,
                counters: counters.as_ref(),
                deaths,
                timed_out: side.timed_out,
            });
            let races = match &counters {
                Some(c) => races_of(c),
                None => {
                    errors.push("P's counters did not come back".into());
                    Races::default()
                }
            };
            let (late, lag) = lateness(&plan, &side.records, start, options.hold);
            let records = &side.records;
            let blocks: u64 = plan.iter().map(|q| q.blocks as u64).sum();
            let mut r = PrefillReport {
                transport: transport.into(),
                role: NodeRole::Prefill,
                seed: opts.seed,
                requests: plan.len() as u64,
                races,
                prefill_outcomes: PrefillOutcomes {
                    sent: records.iter().filter(|r| r.sent).count() as u64,
                    released: records.iter().filter(|r| r.released.is_some()).count() as u64,
                    missing: records.iter().filter(|r| r.events == 0).count() as u64,
                },
                bytes: demo::sent_bytes(&plan, records, workload.block_bytes),
                expected_bytes: blocks * workload.block_bytes,
                tokens: plan.iter().map(|q| u64::from(q.tokens)).sum(),
                blocks,
                late_finishes: late,
                max_finish_lag_ms: lag,
                events: records.iter().map(|r| u64::from(r.events)).sum(),
                duplicates: side.duplicates,
                unknown: side.unknown,
                double_frees: side.free.double_frees,
                leaked_blocks: side.free.in_use(),
                pool_blocks: opts.pool_blocks,
                link: LinkSummary::default(),
                peer_exited,
                wall_ms: wall.elapsed().as_secs_f64() * 1e3,
                timed_out: side.timed_out,
                errors,
                ok: false,
                verdict: String::new(),
            };
            if let Some(s) = stats {
                r.link = summary(&s, listen, options.peer, waited_ms);
            }
            if side.free.bad_ids > 0 {
                push(
                    &mut r.errors,
                    format!("{} block ids outside the pool", side.free.bad_ids),
                );
            }
            if r.timed_out {
                push(
                    &mut r.errors,
                    format!(
                        "the run reached its {:?} limit with {} events missing",
                        opts.timeout, r.prefill_outcomes.missing
                    ),
                );
            }
            r.ok = r.verdict_ok();
            r.verdict = r.verdict_line();
            NodeRun {
                report: NodeReport::Prefill(r),
                node,
            }
        }
    };
    Ok(run)
}

/// What [`NodeFacts`] are built from, known when the schedule starts.
struct FactsInput<'a> {
    options: &'a NodeOptions,
    config: &'a Config,
    clock: UnixClock,
    start: Instant,
}

/// What [`NodeFacts`] are built from, known at the end.
struct Outcome<'a> {
    ends: Vec<RequestEnd>,
    /// The errors the engine loop noted for typed failures (expected of a survivor).
    explained: BTreeSet<String>,
    errors: &'a [String],
    free: &'a FreeList,
    pool_blocks: u32,
    counters: Option<&'a Counters>,
    deaths: Vec<Instant>,
    timed_out: bool,
}

impl FactsInput<'_> {
    fn build(&self, o: Outcome<'_>) -> NodeFacts {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let mut outcomes = BTreeMap::new();
        for r in &o.ends {
            let name = r.outcome.clone().unwrap_or_else(|| "none".into());
            *outcomes.entry(name).or_insert(0) += 1;
        }
        let mut unexplained: Vec<String> = o
            .errors
            .iter()
            .filter(|e| !o.explained.contains(*e))
            .take(32)
            .cloned()
            .collect();
        if o.counters.is_none() {
            push(
                &mut unexplained,
                "the endpoint's counters did not come back".into(),
            );
        }
        if o.timed_out {
            push(
                &mut unexplained,
                format!(
                    "the run reached its {:?} limit",
                    self.options.schedule.timeout
                ),
            );
        }
        let in_use = u32::try_from(o.free.in_use()).unwrap_or(u32::MAX);
        let mut node = NodeFacts {
            start_at: self.options.start_at as u64,
            heartbeat_ms: ms(self.config.heartbeat_interval),
            peer_timeout_ms: ms(self.config.peer_timeout),
            lease_ms: ms(self.config.lease_duration),
            decode_deadline_ms: ms(self.config.decode_deadline),
            expect_peer_loss: self.options.expect_peer_loss,
            schedule_start_unix_ms: self.clock.unix_ms(self.start),
            pool: PoolSummary {
                blocks: o.pool_blocks,
                free_at_end: o.pool_blocks.saturating_sub(in_use),
                double_frees: o.free.double_frees,
                bad_ids: o.free.bad_ids,
            },
            peer_deaths: o.counters.map_or(0, |c| c.peers_declared_dead),
            peer_deaths_seen_unix_ms: o.deaths.iter().map(|&t| self.clock.unix_ms(t)).collect(),
            outcomes,
            requests: o.ends,
            unexplained_errors: unexplained,
            ok: false,
            verdict: String::new(),
        };
        node.ok = node.verdict_ok();
        node.verdict = node.verdict_line(o.timed_out);
        node
    }
}

/// P's requests as [`RequestEnd`]s, and the errors its loop noted for their typed releases.
fn prefill_ends(
    plan: &[Planned],
    records: &[PrefillRecord],
    start_at: usize,
    clock: UnixClock,
) -> (Vec<RequestEnd>, BTreeSet<String>) {
    let mut explained = BTreeSet::new();
    let ends = plan
        .iter()
        .zip(records)
        .enumerate()
        .map(|(j, (q, r))| {
            let outcome = match (r.sent, r.released) {
                (_, Some(cause)) => {
                    explained.insert(format!("P: {} released unsent: {cause:?}", q.prefill_id));
                    Some(format!("Released({cause:?})"))
                }
                (true, None) => Some("Sent".to_string()),
                (false, None) => None,
            };
            RequestEnd {
                index: (start_at + j) as u64,
                outcome,
                events: r.events,
                called_unix_ms: r.finish_call.map(|t| clock.unix_ms(t)),
                ended_unix_ms: r.ended_at.map(|t| clock.unix_ms(t)),
                byte_errors: 0,
            }
        })
        .collect();
    (ends, explained)
}

/// D's requests as [`RequestEnd`]s, and the errors its loop noted for their typed failures.
fn decode_ends(
    plan: &[Planned],
    records: &[DecodeRecord],
    start_at: usize,
    clock: UnixClock,
) -> (Vec<RequestEnd>, BTreeSet<String>) {
    let mut explained = BTreeSet::new();
    let ends = plan
        .iter()
        .zip(records)
        .enumerate()
        .map(|(j, (q, r))| {
            let outcome = if r.ready {
                Some("Ready".to_string())
            } else if let Some(why) = r.failure {
                explained.insert(format!("D: {} failed: {why:?}", q.decode_id));
                Some(format!("Failed({why:?})"))
            } else {
                None
            };
            RequestEnd {
                index: (start_at + j) as u64,
                outcome,
                events: r.events,
                called_unix_ms: r.allocate_call.map(|t| clock.unix_ms(t)),
                ended_unix_ms: r.ended_at.map(|t| clock.unix_ms(t)),
                byte_errors: r.byte_errors,
            }
        })
        .collect();
    (ends, explained)
}

fn push(errors: &mut Vec<String>, error: String) {
    if errors.len() < 32 {
        errors.push(error);
    }
}

/// How often the waits look again.
const WAIT_POLL: Duration = Duration::from_millis(2);
/// How often a refused TCP probe is repeated.
const PROBE_POLL: Duration = Duration::from_millis(20);

fn side_channel(link: &actix::Addr<LinkActor>) -> Option<SideChannelStats> {
    block_on_timeout(link.send(QuerySideChannel), Duration::from_secs(5))?.ok()
}

fn summary(
    s: &SideChannelStats,
    listen: SocketAddr,
    peer: SocketAddr,
    waited_ms: f64,
) -> LinkSummary {
    LinkSummary {
        listen: listen.to_string(),
        peer: peer.to_string(),
        waited_ms,
        incoming_ok: s.incoming_ok,
        outgoing_ok: s.outgoing_ok,
        rejected: s.total_rejected(),
        outgoing_failed: s.outgoing_failed.values().sum(),
    }
}

/// Whether a TCP connection to `addr` is accepted now.
fn accepts(addr: SocketAddr) -> bool {
    TcpStream::connect_timeout(&addr, Duration::from_millis(500)).is_ok()
}

/// D: waits until P's side channel accepts, then hands P our handshake and waits until it
/// completed. Returns D's estimate of the moment P saw the handshake complete: the middle of
/// the handshake (P counts it after loading D and answering; D after loading P, which takes
/// about as long: with NIXL, tens of milliseconds each).
fn await_prefill(
    link: &actix::Addr<LinkActor>,
    peer: SocketAddr,
    prefill: &EngineId,
    deadline: Instant,
) -> Result<Instant, String> {
    let never = || format!("P's side channel at {peer} never completed a handshake");
    loop {
        while !accepts(peer) {
            if Instant::now() + PROBE_POLL >= deadline {
                return Err(format!("P's side channel at {peer} never accepted"));
            }
            thread::sleep(PROBE_POLL);
        }
        let failed_before = side_channel(link).map_or(0, |s| s.outgoing_failed.values().sum());
        let sent = Instant::now();
        link.do_send(Connect(PeerAddr::new(prefill.clone(), 0)));
        loop {
            let Some(s) = side_channel(link) else {
                return Err("the link did not answer".into());
            };
            if s.outgoing_ok >= 1 {
                let took = sent.elapsed();
                eprintln!(
                    "kvhandoff node: handshake with {prefill} took {:.1} ms",
                    took.as_secs_f64() * 1e3
                );
                return Ok(sent + took / 2);
            }
            if s.outgoing_failed.values().sum::<u64>() > failed_before {
                // Refused or cut off: P may be restarting. Probe and try again.
                break;
            }
            if Instant::now() >= deadline {
                return Err(never());
            }
            thread::sleep(WAIT_POLL);
        }
        if Instant::now() + PROBE_POLL >= deadline {
            return Err(never());
        }
        thread::sleep(PROBE_POLL);
    }
}

/// P: waits until D's handshake arrived; returns when P saw it.
fn await_decode(link: &actix::Addr<LinkActor>, deadline: Instant) -> Result<Instant, String> {
    loop {
        match side_channel(link) {
            Some(s) if s.incoming_ok >= 1 => return Ok(Instant::now()),
            Some(_) => {}
            None => return Err("the link did not answer".into()),
        }
        if Instant::now() >= deadline {
            return Err("D never connected".into());
        }
        thread::sleep(WAIT_POLL);
    }
}

/// P, after its last event: waits until D's side channel refuses connections (D exited) or
/// `until`. Returns whether D exited.
fn await_exit(peer: SocketAddr, until: Instant) -> bool {
    loop {
        if !accepts(peer) {
            return true;
        }
        if Instant::now() + PROBE_POLL >= until {
            return false;
        }
        thread::sleep(PROBE_POLL);
    }
}

/// P's `request_finished` calls against the schedule: how many came more than 1 ms late, and the
/// latest, in ms.
fn lateness(
    plan: &[Planned],
    records: &[demo::PrefillRecord],
    start: Instant,
    hold: Duration,
) -> (u64, f64) {
    let mut late = 0;
    let mut worst = Duration::ZERO;
    for (q, r) in plan.iter().zip(records) {
        let Some(called) = r.finish_call else {
            continue;
        };
        let due = start + q.arrival + hold + q.prefill_delay;
        let lag = called.saturating_duration_since(due);
        if lag > Duration::from_millis(1) {
            late += 1;
        }
        worst = worst.max(lag);
    }
    (late, worst.as_secs_f64() * 1e3)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timing_flags_give_a_valid_config() {
        let ms = Duration::from_millis;
        let c = NodeTiming {
            heartbeat: Some(ms(200)),
            lease: Some(ms(3000)),
            decode_deadline: Some(ms(1500)),
        }
        .config()
        .unwrap();
        assert_eq!(
            (c.heartbeat_interval, c.peer_timeout, c.lease_duration),
            (ms(200), ms(300), ms(3000))
        );
        assert_eq!(c.decode_deadline, ms(1500));
        assert!(c.lease_extension <= c.lease_duration);
        // A heartbeat longer than the default quarantine allows moves the quarantine.
        let long = NodeTiming {
            heartbeat: Some(Duration::from_secs(20)),
            ..NodeTiming::default()
        };
        long.config().unwrap();
        assert_eq!(NodeTiming::default().config().unwrap(), Config::default());
        let bad = NodeTiming {
            heartbeat: Some(ms(500)),
            lease: Some(ms(400)),
            ..NodeTiming::default()
        };
        assert!(bad.config().is_err());
        let tiny = NodeTiming {
            heartbeat: Some(ms(5)),
            ..NodeTiming::default()
        };
        assert!(tiny.config().is_err());
    }

    #[test]
    fn a_later_part_of_the_plan_keeps_ids_and_shifts_arrivals() {
        let options = DemoOptions {
            requests: 20,
            ..DemoOptions::default()
        };
        let whole = schedule(&options, 16).unwrap();
        let part = part_of(&whole, 12);
        assert_eq!(part.len(), 8);
        assert_eq!(part[0].arrival, Duration::ZERO);
        for (q, w) in part.iter().zip(&whole[12..]) {
            assert_eq!((&q.prefill_id, &q.decode_id), (&w.prefill_id, &w.decode_id));
            assert_eq!(q.arrival, w.arrival - whole[12].arrival);
        }
        assert!(part_of(&whole, 20).is_empty());
    }
}
