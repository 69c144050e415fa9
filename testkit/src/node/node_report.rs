//! What a node reports: P's [`PrefillReport`], the [`NodeReport`] of either role, and the
//! [`NodeFacts`] every node adds (with their verdicts and tables).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

#[cfg(doc)]
use super::run_on;
use super::{DemoReport, NodeRole};
use crate::demo::{PrefillOutcomes, Races, TurnCounts};
use crate::stats::human_bytes;

/// The side channel as this node saw it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LinkSummary {
    /// Where this node listened.
    pub listen: String,
    /// The peer's side channel.
    pub peer: String,
    /// From the process's start to its side channel listening (its NIXL agent and memory
    /// registered), ms.
    #[serde(default)]
    pub listening_ms: f64,
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
    /// How the requests moved their KV: `"push"`, `"pull"`, `"mixed"` or `"bidir"`.
    pub mode: String,
    /// Requests pulled by D (the others were pushed).
    pub pulled: u64,
    /// Requests in the schedule.
    pub requests: u64,
    /// Races as P's endpoint counted them (pushed requests).
    pub races: Races,
    /// P's outcomes.
    pub prefill_outcomes: PrefillOutcomes,
    /// Bytes of the requests whose write completed (`Sent`) or that D read, and of the
    /// prefixes P read back from D.
    pub bytes: u64,
    /// Bytes the requests' blocks hold, and the prefixes P read back.
    pub expected_bytes: u64,
    /// The turns of conversations (`bidir`), as P saw them (D's keeps are in D's report).
    pub turns: TurnCounts,
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
    /// True only if every request was sent, with exactly one event each, every block came
    /// back once, and every later turn of a conversation read its prefix back (every byte
    /// right) or recomputed it.
    pub fn verdict_ok(&self) -> bool {
        let n = self.requests;
        let t = &self.turns;
        n > 0
            && !self.timed_out
            && t.pulled_from_decode + t.recomputed + t.declined_near_expiry == t.later_turns
            && t.read_back_verified == t.pulled_from_decode
            && self.errors.is_empty()
            && self.prefill_outcomes.sent == n
            && self.events == n
            && self.duplicates == 0
            && self.unknown == 0
            && self.double_frees == 0
            && self.leaked_blocks == 0
    }

    pub(super) fn verdict_line(&self) -> String {
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
                "mode",
                format!(
                    "{} ({} pulled, {} pushed)",
                    self.mode,
                    self.pulled,
                    self.requests - self.pulled
                ),
            ),
            (
                "turns",
                format!(
                    "{} later turns: read back {} ({} verified), recomputed {}, declined near \
                     expiry {}",
                    self.turns.later_turns,
                    self.turns.pulled_from_decode,
                    self.turns.read_back_verified,
                    self.turns.recomputed,
                    self.turns.declined_near_expiry
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
    /// Its typed outcome (the machines' `Debug` names): on P `"Sent"` or
    /// `"Released(<ReleaseCause>)"` (pushed), `"Read"` or `"Unread(<ExportEnd>)"` (pulled); on
    /// D `"Ready"`, `"Failed(<DecodeFailure>)"` (pushed) or `"Import(<ImportOutcome>)"`
    /// (pulled, not loaded); on either, without an event: `"NoAnswer"` (D: a pulled request
    /// whose answer from P never came within D's deadline; never called) or `"Abandoned"` (a
    /// later turn of a conversation that ended before it, or a request the other side gave
    /// up); `None` without one.
    pub outcome: Option<String>,
    /// Events the engine got for it (exactly 1 when all is well).
    pub events: u32,
    /// When this side's engine called (`request_finished` / `request_allocated`), unix ms.
    pub called_unix_ms: Option<f64>,
    /// When the engine took its event, unix ms.
    pub ended_unix_ms: Option<f64>,
    /// D: when the engine was told the request failed while its blocks stayed fenced from a
    /// peer declared dead (`DecodeFenced`; the final event, later, hands them back), unix ms.
    #[serde(default)]
    pub fenced_unix_ms: Option<f64>,
    /// D: bytes found wrong (of a `Ready` request).
    pub byte_errors: u64,
    /// What freed its blocks when no transfer proved it: D, a failed pushed request
    /// (`FreeProof`'s `Debug` name); P, a pulled request (`ReadProof`'s).
    #[serde(default)]
    pub proof: Option<String>,
    /// Conversations: on P, how a later turn's prefix came (`"Read(<ImportOutcome>)"`,
    /// `"Recomputed"`, `"DeclinedNearExpiry"`); on D, how a keep for the next turn ended
    /// (`"Kept(<ExportOutcome>)"`, with the proof after a slash).
    #[serde(default)]
    pub turn: Option<String>,
    /// P: when it asked to read a later turn's prefix back (`next_turn_allocated`), unix ms.
    #[serde(default)]
    pub turn_called_unix_ms: Option<f64>,
    /// When that ended (P: the read back's event; D: the keep's `ExportEnded`), unix ms.
    #[serde(default)]
    pub turn_ended_unix_ms: Option<f64>,
}

impl RequestEnd {
    /// Whether the request has exactly one typed outcome: one event, or none for the outcomes
    /// that never start anything (`"NoAnswer"`, `"Abandoned"`).
    pub fn typed(&self) -> bool {
        match self.outcome.as_deref() {
            Some("NoAnswer" | "Abandoned") => self.events == 0,
            Some(_) => self.events == 1,
            None => false,
        }
    }
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
    /// The quarantine (D's fence after a cancel or a peer's death) in force, ms.
    pub quarantine_ms: f64,
    /// How long after a grant the holder of an export frees its blocks if the reader never
    /// releases them (`max_message_delay + max_write_life`), ms.
    #[serde(default)]
    pub grant_fence_ms: f64,
    /// Whether the node ran as a survivor (`--expect-peer-loss`).
    pub expect_peer_loss: bool,
    /// The schedule's time zero (the handshake), unix ms.
    pub schedule_start_unix_ms: f64,
    /// The pool at the end.
    pub pool: PoolSummary,
    /// Peers the endpoint declared dead (`Counters::peers_declared_dead`, restarts included).
    pub peer_deaths: u64,
    /// Handshakes that repeated the connected incarnation of the peer (nothing changed).
    pub repeated_handshakes: u64,
    /// Handshakes with a new incarnation of a connected peer (restarts).
    pub peer_restarts: u64,
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
    /// True when every request has exactly one typed outcome ([`RequestEnd::typed`]), no
    /// `Ready` request has a wrong byte, every block is back on the free list (none freed
    /// twice), the run did not time out and no error is left that a typed outcome does not
    /// explain.
    pub fn verdict_ok(&self) -> bool {
        !self.requests.is_empty()
            && self.requests.iter().all(RequestEnd::typed)
            && self
                .requests
                .iter()
                .all(|r| r.byte_errors == 0 || r.outcome.as_deref() != Some("Ready"))
            && self.pool.free_at_end == self.pool.blocks
            && self.pool.double_frees == 0
            && self.pool.bad_ids == 0
            && self.unexplained_errors.is_empty()
    }

    pub(super) fn verdict_line(&self, timed_out: bool) -> String {
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
        let bad = self.requests.iter().filter(|r| !r.typed()).count();
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
                    "heartbeat {:.0} ms, peer timeout {:.0} ms, lease {:.0} ms, D deadline {:.0} ms, \
                     quarantine {:.0} ms",
                    n.heartbeat_ms,
                    n.peer_timeout_ms,
                    n.lease_ms,
                    n.decode_deadline_ms,
                    n.quarantine_ms
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
