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
//! Without the cargo feature `nixl`, [`run`] returns [`DemoError::NoNixl`] and the CLI prints
//! that message and exits 1. [`run_on`] runs a node on any transport whose agents can reach each
//! other (the tests run two in-memory nodes in one process).

use std::fmt::Write as _;
use std::net::{SocketAddr, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use kvhandoff_actors::machine::Config;
use kvhandoff_actors::system::{
    agent_name, build_rank, AddPeerAddress, Connect, Handshaker, LinkActor, QuerySideChannel,
    RankMemory, ShellConfig, SideChannelConfig, SideChannelStats,
};
use kvhandoff_actors::transport::TransportError;
use kvhandoff_actors::PeerAddr;
use kvhandoff_protocol::{AgentName, EngineId};
use serde::{Deserialize, Serialize};

use crate::demo::{
    self, block_on_timeout, build_report, check_options, human_bytes, identity, model,
    query_counters, races_of, run_decode, run_prefill, schedule, DecodePacing, DecodeRun,
    DemoError, DemoOptions, DemoReport, Facts, Planned, PrefillOutcomes, PrefillPacing, PrefillRun,
    Races, Tallies, DECODE_ENGINE, PREFILL_ENGINE,
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

/// Runs one node on NIXL (cargo feature `nixl`).
///
/// # Errors
/// [`DemoError::NoNixl`] without the feature; [`DemoError::NixlUnavailable`] without the NIXL
/// runtime; otherwise as [`run_on`].
pub fn run(options: &NodeOptions) -> Result<NodeReport, DemoError> {
    #[cfg(feature = "nixl")]
    {
        use kvhandoff_actors::transport::nixl::{
            nixl_runtime_available, NixlConfig, NixlTransport,
        };
        nixl_runtime_available().map_err(|e| DemoError::NixlUnavailable(e.to_string()))?;
        run_on("nixl", options, |name| {
            NixlTransport::new(name, NixlConfig::default())
        })
    }
    #[cfg(not(feature = "nixl"))]
    {
        let _ = options;
        Err(DemoError::NoNixl)
    }
}

/// Runs one node on the transport `make` creates for the rank's agent name; `transport` names
/// it in the report.
///
/// # Errors
/// [`DemoError`] when the node cannot start: bad options, a transport or rank that cannot be
/// built, a side channel that cannot listen. A node that starts and goes wrong (the peer never
/// came, a request failed) returns a report whose verdict is FAILED.
pub fn run_on<T, F>(
    transport: &'static str,
    options: &NodeOptions,
    make: F,
) -> Result<NodeReport, DemoError>
where
    T: RankMemory + Unpin + Send + 'static,
    F: FnOnce(AgentName) -> Result<T, TransportError>,
{
    let wall = Instant::now();
    let opts = &options.schedule;
    let deadline = wall + opts.timeout;
    let workload = check_options(opts)?;
    let plan = schedule(opts, workload.block_tokens)?;
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
        Config::default(),
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
    eprintln!("kvhandoff node: {own} met {other} after {waited_ms:.0} ms; running the schedule");

    let report = match options.role {
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
            errors.extend(side.errors);
            let bytes = plan
                .iter()
                .zip(&side.records)
                .filter(|(_, r)| r.ready)
                .map(|(q, _)| q.blocks as u64 * workload.block_bytes)
                .sum();
            drop(rank);
            runtime.shutdown();
            NodeReport::Decode(build_report(
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
            ))
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
            let counters = query_counters(&rank);
            let peer_exited = await_exit(
                options.peer,
                (Instant::now() + options.linger).min(deadline),
            );
            let stats = side_channel(&link);
            drop(rank);
            runtime.shutdown();
            errors.extend(side.errors);
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
            NodeReport::Prefill(r)
        }
    };
    Ok(report)
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
