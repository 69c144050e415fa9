//! The demo's report: what a run did, the verdict, the table for people, and how the report is
//! built from the engines' records.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use kvhandoff_protocol::KvLayout;
use serde::{Deserialize, Serialize};

use super::engines::{note, DecodeRecord, PrefillRecord, TurnStart};
use super::schedule::{Planned, Workload};
use super::{DemoMode, DemoOptions};
use crate::stats::{human_bytes, percentile};
use kvhandoff::TransferMode;
use kvhandoff_protocol::machine::{ExportOutcome, ImportOutcome};

/// Race counts (pushed requests only: a pulled one has no race, D reads after P's answer).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Races {
    /// D's registration reached P before P finished.
    pub decode_registers_first: u64,
    /// P finished before D's registration reached it.
    pub prefill_finishes_first: u64,
}

/// D's outcomes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Outcomes {
    /// `BlocksReady` (push), or `Imported` with `Loaded` (pull).
    pub ready: u64,
    /// `Failed` (push), or `Imported` with any other outcome (pull).
    pub failed: u64,
    /// No event before the run's deadline.
    pub missing: u64,
}

/// P's outcomes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefillOutcomes {
    /// `BlocksFree` after the write completed (push), or `ExportEnded` after D read the
    /// blocks (pull).
    pub sent: u64,
    /// `BlocksFree` without a completed write, or `ExportEnded` unread.
    pub released: u64,
    /// No event before the run's deadline.
    pub missing: u64,
}

/// Handoff latency percentiles, from the moment both sides had called to D's `BlocksReady`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Latency {
    /// Median, µs.
    pub p50: f64,
    /// 99th percentile, µs.
    pub p99: f64,
    /// Largest, µs.
    pub max: f64,
}

/// Engine events seen.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventCounts {
    /// Events on P.
    pub prefill: u64,
    /// Events on D.
    pub decode: u64,
    /// Events beyond the first for a request (either side).
    pub duplicates: u64,
    /// Events naming a request the engine does not know, or handing back other blocks.
    pub unknown: u64,
}

/// Blocks not back on a free list at the end.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Leaks {
    /// On P.
    pub prefill: u64,
    /// On D.
    pub decode: u64,
}

/// The turns of bidirectional conversations ([`DemoMode::Bidir`]; zero in the other modes).
/// P's counts are zero in a report of D alone ([`ReportRole::Decode`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct TurnCounts {
    /// Conversations.
    pub conversations: u64,
    /// Turns after a conversation's first (each reads its prefix back or recomputes it).
    pub later_turns: u64,
    /// Later turns whose prefix P read back from D's kept blocks (`Imported` / `Loaded`).
    pub pulled_from_decode: u64,
    /// Later turns whose prefix P recomputed: below the recompute threshold (P declined D's
    /// blocks), or a read back that did not load (an error too).
    pub recomputed: u64,
    /// Later turns that came back with less than the near-expiry margin of D's TTL left: P
    /// declined D's blocks and recomputed.
    pub declined_near_expiry: u64,
    /// Prefixes read back whose every byte P checked and found right.
    pub read_back_verified: u64,
    /// Bytes P read back from D.
    pub read_back_bytes: u64,
    /// Turns whose blocks D kept for the next turn (`keep_for_next_turn`).
    pub kept: u64,
    /// Keeps that ended read by P (`ExportEnded` / `Read`).
    pub kept_read: u64,
    /// Keeps that ended unread (declined by P, or their TTL expired).
    pub kept_unread: u64,
    /// D's keep TTL, ms.
    pub keep_ttl_ms: f64,
    /// P reads a prefix back only from this many tokens on.
    pub recompute_threshold_tokens: u32,
}

/// The model geometry the demo ran with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GeometrySummary {
    /// Layers.
    pub layers: u32,
    /// KV heads.
    pub kv_heads: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// Bytes per element.
    pub dtype_bytes: u32,
    /// Tokens per block.
    pub block_tokens: u32,
    /// `"HND"` or `"NHD"`.
    pub layout: String,
    /// Bytes of one logical block over every region.
    pub block_bytes: u64,
}

/// Which engines a report speaks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReportRole {
    /// P and D in one process (`kvhandoff demo`).
    Both,
    /// D alone (`kvhandoff node --role decode`): P's side is in another process and its
    /// fields here stay zero.
    Decode,
}

/// What a demo run did, and whether every byte arrived.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DemoReport {
    /// `"mem"` or `"nixl"`.
    pub transport: String,
    /// How the requests moved their KV: `"push"`, `"pull"` or `"mixed"` (each request drawn).
    pub mode: String,
    /// Requests whose KV was pulled (D read P's export); the others were pushed.
    pub pulled: u64,
    /// Which engines the report speaks for.
    pub role: ReportRole,
    /// The schedule's seed.
    pub seed: u64,
    /// Requests handed off.
    pub requests: u64,
    /// Requests whose every byte D checked and found right.
    pub verified: u64,
    /// Bytes found wrong, over all requests: by D in what arrived, and by P in the prefixes it
    /// read back (`bidir`).
    pub byte_errors: u64,
    /// Races as P's endpoint counted them. For [`ReportRole::Decode`] (P's endpoint is in
    /// another process): as `call_order`.
    pub races: Races,
    /// Races as the engines' call times ordered them (P's `request_finished` vs D's
    /// `request_allocated`), over the pushed requests; may differ from `races` by the
    /// registration's flight time. For
    /// [`ReportRole::Decode`]: D's calls against the times the schedule has P call, in D's
    /// clock (P's own report has the counts its endpoint saw).
    pub call_order: Races,
    /// D's outcomes.
    pub outcomes: Outcomes,
    /// P's outcomes (zero for [`ReportRole::Decode`]).
    pub prefill_outcomes: PrefillOutcomes,
    /// Bytes moved: with `mem`, the bytes landed by P's agent's writes and D's agent's reads;
    /// with `nixl` (NIXL counts no bytes), the blocks of the requests whose write completed or
    /// that D read (P's `sent`), or for [`ReportRole::Decode`] that arrived (D's `ready`).
    pub bytes: u64,
    /// Bytes the requests' blocks hold, and the prefixes P read back (what should have moved).
    pub expected_bytes: u64,
    /// Prompt tokens over all requests.
    pub tokens: u64,
    /// Blocks per side over all requests.
    pub blocks: u64,
    /// `bytes` over the handoff window, in GB/s (10^9 bytes per second).
    pub gbps: f64,
    /// From the first handoff's start (both sides had called) to the last `BlocksReady`, ms.
    pub handoff_window_ms: f64,
    /// Handoff latency percentiles (for [`ReportRole::Decode`], from D's call or P's scheduled
    /// call, whichever is later).
    pub handoff_latency_us: Latency,
    /// The whole run, setup and teardown included, ms.
    pub wall_ms: f64,
    /// Engine events seen (one per request and side: the handoff's).
    pub events: EventCounts,
    /// The turns of conversations (`bidir`).
    pub turns: TurnCounts,
    /// Blocks freed while already free.
    pub double_frees: u64,
    /// Blocks not back on a free list at the end.
    pub leaked_blocks: Leaks,
    /// Logical blocks per side's pool.
    pub pool_blocks: u32,
    /// The model geometry.
    pub geometry: GeometrySummary,
    /// Whether the run hit its overall limit.
    pub timed_out: bool,
    /// Everything that went wrong, in words (at most 32 kept).
    pub errors: Vec<String>,
    /// [`DemoReport::verdict_ok`] at the end of the run.
    pub ok: bool,
    /// The verdict line.
    pub verdict: String,
}

impl DemoReport {
    /// True only if every request ended `Ready` and verified with no byte error, no block was
    /// freed twice, every block came back on both sides, and both engines saw exactly one event
    /// per request. For [`ReportRole::Decode`], D's side of all that.
    pub fn verdict_ok(&self) -> bool {
        let n = self.requests;
        let prefill_ok = match self.role {
            ReportRole::Both => self.prefill_outcomes.sent == n && self.events.prefill == n,
            ReportRole::Decode => true,
        };
        n > 0
            && !self.timed_out
            && self.errors.is_empty()
            && self.turns_ok()
            && self.outcomes.ready == n
            && self.verified == n
            && self.byte_errors == 0
            && prefill_ok
            && self.double_frees == 0
            && self.leaked_blocks == Leaks::default()
            && self.events.decode == n
            && self.events.duplicates == 0
            && self.events.unknown == 0
    }

    /// Every later turn read its prefix back (and checked every byte) or recomputed it, and
    /// every keep of D ended; trivially true outside `bidir`.
    fn turns_ok(&self) -> bool {
        let t = &self.turns;
        let prefill_ok = match self.role {
            ReportRole::Both => {
                t.pulled_from_decode + t.recomputed + t.declined_near_expiry == t.later_turns
                    && t.read_back_verified == t.pulled_from_decode
                    && t.kept_read == t.pulled_from_decode
            }
            ReportRole::Decode => true,
        };
        prefill_ok && t.kept == t.later_turns && t.kept_read + t.kept_unread == t.kept
    }

    fn verdict_line(&self) -> String {
        if self.verdict_ok() {
            return format!(
                "verdict: OK — {}/{} requests verified, 0 byte errors",
                self.verified, self.requests
            );
        }
        let mut why = vec![format!(
            "{}/{} requests verified, {} byte errors",
            self.verified, self.requests, self.byte_errors
        )];
        if self.timed_out {
            why.push("timed out".into());
        }
        if self.outcomes.failed > 0 || self.outcomes.missing > 0 {
            why.push(format!(
                "D: {} failed, {} without an event",
                self.outcomes.failed, self.outcomes.missing
            ));
        }
        if self.prefill_outcomes.released > 0 || self.prefill_outcomes.missing > 0 {
            why.push(format!(
                "P: {} released unsent, {} without an event",
                self.prefill_outcomes.released, self.prefill_outcomes.missing
            ));
        }
        if !self.turns_ok() {
            let t = &self.turns;
            why.push(format!(
                "turns: {} later, {} read back ({} verified), {} recomputed, {} declined near \
                 expiry; {} kept, {} ended",
                t.later_turns,
                t.pulled_from_decode,
                t.read_back_verified,
                t.recomputed,
                t.declined_near_expiry,
                t.kept,
                t.kept_read + t.kept_unread
            ));
        }
        if self.double_frees > 0 {
            why.push(format!("{} double frees", self.double_frees));
        }
        if self.leaked_blocks != Leaks::default() {
            why.push(format!(
                "leaked blocks P {} / D {}",
                self.leaked_blocks.prefill, self.leaked_blocks.decode
            ));
        }
        if self.events.duplicates > 0 || self.events.unknown > 0 {
            why.push(format!(
                "{} duplicate and {} unknown events",
                self.events.duplicates, self.events.unknown
            ));
        }
        if let Some(first) = self.errors.first() {
            why.push(format!("{} errors (first: {first})", self.errors.len()));
        }
        format!("verdict: FAILED — {}", why.join("; "))
    }

    fn transport_line(&self) -> String {
        let how = match (self.role, self.transport.as_str()) {
            (ReportRole::Both, "nixl") => {
                "P and D in one process: two NIXL agents (UCX), one actix runtime"
            }
            (ReportRole::Both, _) => "P and D in one process, one actix runtime",
            (ReportRole::Decode, _) => "this process is D; P runs in another process",
        };
        format!("{} ({how})", self.transport)
    }

    /// The report as a table for people, ending with the verdict line.
    pub fn render_table(&self) -> String {
        let g = &self.geometry;
        let mut out = String::new();
        let mut lines: Vec<(&str, String)> = vec![
            ("transport", self.transport_line()),
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
                "model geometry",
                format!(
                    "{} layers x {} KV heads x {} dim, {} B/elem, {}-token blocks, {} ({} per block)",
                    g.layers,
                    g.kv_heads,
                    g.head_dim,
                    g.dtype_bytes,
                    g.block_tokens,
                    g.layout,
                    human_bytes(g.block_bytes)
                ),
            ),
            (
                "requests",
                format!(
                    "{} (seed {}), {} tokens, {} blocks per side",
                    self.requests, self.seed, self.tokens, self.blocks
                ),
            ),
            (
                match self.role {
                    ReportRole::Both => "races (P's count)",
                    ReportRole::Decode => "races (D's view)",
                },
                format!(
                    "D registers first {:>4}   P finishes first {:>4}",
                    self.races.decode_registers_first, self.races.prefill_finishes_first
                ),
            ),
            (
                "races (call order)",
                format!(
                    "D registers first {:>4}   P finishes first {:>4}",
                    self.call_order.decode_registers_first,
                    self.call_order.prefill_finishes_first
                ),
            ),
            (
                "turns",
                if self.mode == DemoMode::Bidir.name() {
                    let t = &self.turns;
                    format!(
                        "{} conversations, {} later turns: read back {} ({} verified, {}), \
                         recomputed {}, declined near expiry {}; D kept {} ({} read, {} unread; \
                         TTL {:.0} ms), threshold {} tokens",
                        t.conversations,
                        t.later_turns,
                        t.pulled_from_decode,
                        t.read_back_verified,
                        human_bytes(t.read_back_bytes),
                        t.recomputed,
                        t.declined_near_expiry,
                        t.kept,
                        t.kept_read,
                        t.kept_unread,
                        t.keep_ttl_ms,
                        t.recompute_threshold_tokens
                    )
                } else {
                    "one turn per request".into()
                },
            ),
            (
                "D outcomes",
                format!(
                    "ready {}   failed {}   no event {}",
                    self.outcomes.ready, self.outcomes.failed, self.outcomes.missing
                ),
            ),
            (
                "P outcomes",
                match self.role {
                    ReportRole::Both => format!(
                        "sent {}   released {}   no event {}",
                        self.prefill_outcomes.sent,
                        self.prefill_outcomes.released,
                        self.prefill_outcomes.missing
                    ),
                    ReportRole::Decode => "in P's own report".into(),
                },
            ),
            (
                "verified",
                format!(
                    "{}/{} requests, every byte; {} byte errors",
                    self.verified, self.requests, self.byte_errors
                ),
            ),
            (
                "bytes moved",
                format!(
                    "{} (expected {}) in {:.1} ms -> {:.2} GB/s",
                    human_bytes(self.bytes),
                    human_bytes(self.expected_bytes),
                    self.handoff_window_ms,
                    self.gbps
                ),
            ),
            (
                "handoff latency",
                format!(
                    "p50 {:.0} us   p99 {:.0} us   max {:.0} us",
                    self.handoff_latency_us.p50,
                    self.handoff_latency_us.p99,
                    self.handoff_latency_us.max
                ),
            ),
            (
                "blocks",
                format!(
                    "pool {} per side; double frees {}; not returned P {} / D {}",
                    self.pool_blocks,
                    self.double_frees,
                    self.leaked_blocks.prefill,
                    self.leaked_blocks.decode
                ),
            ),
            (
                "events",
                format!(
                    "P {}   D {}   duplicates {}   unknown {}",
                    self.events.prefill,
                    self.events.decode,
                    self.events.duplicates,
                    self.events.unknown
                ),
            ),
            ("wall time", format!("{:.1} ms", self.wall_ms)),
        ];
        for (i, e) in self.errors.iter().take(5).enumerate() {
            lines.push((if i == 0 { "errors" } else { "" }, e.clone()));
        }
        out.push_str(match self.role {
            ReportRole::Both => "kvhandoff demo: prefill -> decode KV handoff\n",
            ReportRole::Decode => "kvhandoff node: decode side of the KV handoff\n",
        });
        for (name, value) in lines {
            let _ = writeln!(out, "  {name:<19} {value}");
        }
        out.push_str(&self.verdict);
        out.push('\n');
        out
    }
}

/// The run's facts that are not in the records.
pub(crate) struct Tallies {
    pub(crate) races: Races,
    pub(crate) bytes: u64,
    pub(crate) errors: Vec<String>,
    pub(crate) timed_out: bool,
    pub(crate) double_frees: u64,
    pub(crate) bad_ids: u64,
    pub(crate) leaks: Leaks,
    pub(crate) duplicates: u64,
    pub(crate) unknown: u64,
    pub(crate) wall: Instant,
}

/// What a report is built from.
pub(crate) struct Facts<'a> {
    pub(crate) options: &'a DemoOptions,
    /// `"mem"` or `"nixl"`.
    pub(crate) transport: &'static str,
    pub(crate) workload: &'a Workload,
    pub(crate) plan: &'a [Planned],
    /// P's records; `None` for [`ReportRole::Decode`].
    pub(crate) prefill: Option<&'a [PrefillRecord]>,
    pub(crate) decode: &'a [DecodeRecord],
}

/// Builds the report of a run (its verdict included).
pub(crate) fn build(facts: Facts<'_>, t: Tallies) -> DemoReport {
    let Facts {
        options,
        transport,
        workload,
        plan,
        prefill,
        decode: d,
    } = facts;
    let (geometry, block_bytes) = (&workload.geometry, workload.block_bytes);
    let role = match prefill {
        Some(_) => ReportRole::Both,
        None => ReportRole::Decode,
    };
    let p = prefill.unwrap_or(&[]);
    let mut errors = t.errors;
    if t.bad_ids > 0 {
        note(
            &mut errors,
            format!("{} block ids outside the pool", t.bad_ids),
        );
    }
    let mut call_order = Races::default();
    let mut latencies = Vec::new();
    let mut first_start: Option<Instant> = None;
    let mut last_ready: Option<Instant> = None;
    for (i, dr) in d.iter().enumerate() {
        // When P called (or, seen from D alone, when the schedule has it call).
        let finish = match prefill {
            Some(p) => p.get(i).and_then(|r| r.finish_call),
            None => dr.planned_finish,
        };
        let (Some(pf), Some(da)) = (finish, dr.allocate_call) else {
            continue;
        };
        if plan.get(i).is_some_and(|q| q.mode == TransferMode::Push) {
            if da <= pf {
                call_order.decode_registers_first += 1;
            } else {
                call_order.prefill_finishes_first += 1;
            }
        }
        let both = pf.max(da);
        first_start = Some(first_start.map_or(both, |f| f.min(both)));
        if let Some(ready) = dr.ready_at {
            latencies.push(ready.saturating_duration_since(both).as_secs_f64() * 1e6);
            last_ready = Some(last_ready.map_or(ready, |l| l.max(ready)));
        }
    }
    latencies.sort_by(f64::total_cmp);
    let window = match (first_start, last_ready) {
        (Some(a), Some(b)) => b.saturating_duration_since(a),
        _ => Duration::ZERO,
    };
    let count = |f: &dyn Fn(&DecodeRecord) -> bool| d.iter().filter(|r| f(r)).count() as u64;
    let blocks: u64 = plan.iter().map(|q| q.blocks as u64).sum();
    let turns = turn_counts(options, plan, p, d, block_bytes);
    let mut report = DemoReport {
        transport: transport.into(),
        mode: options.mode.name().into(),
        pulled: plan.iter().filter(|q| q.mode == TransferMode::Pull).count() as u64,
        role,
        seed: options.seed,
        requests: plan.len() as u64,
        verified: count(&|r| r.verified),
        byte_errors: d.iter().map(|r| r.byte_errors).sum::<u64>()
            + p.iter().map(|r| r.read_byte_errors).sum::<u64>(),
        races: match role {
            ReportRole::Both => t.races,
            ReportRole::Decode => call_order,
        },
        call_order,
        outcomes: Outcomes {
            ready: count(&|r| r.ready),
            failed: count(&|r| r.failed),
            missing: count(&|r| r.events == 0),
        },
        prefill_outcomes: PrefillOutcomes {
            sent: p.iter().filter(|r| r.sent).count() as u64,
            released: p
                .iter()
                .filter(|r| r.released.is_some() || r.export_end.is_some())
                .count() as u64,
            missing: p.iter().filter(|r| r.events == 0).count() as u64,
        },
        bytes: t.bytes,
        expected_bytes: blocks * block_bytes + turns.read_back_bytes,
        tokens: plan.iter().map(|q| u64::from(q.tokens)).sum(),
        blocks,
        gbps: if window.is_zero() {
            0.0
        } else {
            t.bytes as f64 / window.as_secs_f64() / 1e9
        },
        handoff_window_ms: window.as_secs_f64() * 1e3,
        handoff_latency_us: Latency {
            p50: percentile(&latencies, 50.0),
            p99: percentile(&latencies, 99.0),
            max: latencies.last().copied().unwrap_or(0.0),
        },
        wall_ms: t.wall.elapsed().as_secs_f64() * 1e3,
        events: EventCounts {
            prefill: p.iter().map(|r| u64::from(r.events)).sum(),
            decode: d.iter().map(|r| u64::from(r.events)).sum(),
            duplicates: t.duplicates,
            unknown: t.unknown,
        },
        turns,
        double_frees: t.double_frees,
        leaked_blocks: t.leaks,
        pool_blocks: options.pool_blocks,
        geometry: GeometrySummary {
            layers: geometry.num_layers,
            kv_heads: geometry.total_kv_heads,
            head_dim: geometry.head_dim,
            dtype_bytes: geometry.dtype_bytes,
            block_tokens: workload.block_tokens,
            layout: match geometry.layout {
                KvLayout::Hnd => "HND".into(),
                KvLayout::Nhd => "NHD".into(),
            },
            block_bytes,
        },
        timed_out: t.timed_out,
        errors,
        ok: false,
        verdict: String::new(),
    };
    if report.timed_out {
        let missing = report.outcomes.missing + report.prefill_outcomes.missing;
        note(
            &mut report.errors,
            format!(
                "the run reached its {:?} limit with {missing} events missing",
                options.timeout
            ),
        );
    }
    if report.bytes != report.expected_bytes {
        note(
            &mut report.errors,
            format!(
                "the transport moved {} bytes; the blocks hold {}",
                report.bytes, report.expected_bytes
            ),
        );
    }
    report.ok = report.verdict_ok();
    report.verdict = report.verdict_line();
    report
}

/// The turn counts of a run (zeros outside [`DemoMode::Bidir`]; P's zero without P's records).
pub(crate) fn turn_counts(
    options: &DemoOptions,
    plan: &[Planned],
    p: &[PrefillRecord],
    d: &[DecodeRecord],
    block_bytes: u64,
) -> TurnCounts {
    if options.mode != DemoMode::Bidir {
        return TurnCounts::default();
    }
    let count = |f: &dyn Fn(&PrefillRecord) -> bool| p.iter().filter(|r| f(r)).count() as u64;
    let loaded = |r: &PrefillRecord| r.import_outcome == Some(ImportOutcome::Loaded);
    let kept = |f: &dyn Fn(&ExportOutcome) -> bool| {
        d.iter()
            .filter(|r| r.export_outcome.as_ref().is_some_and(f))
            .count() as u64
    };
    TurnCounts {
        conversations: plan.iter().filter(|q| !q.later_turn()).count() as u64,
        later_turns: plan.iter().filter(|q| q.later_turn()).count() as u64,
        pulled_from_decode: count(&|r| loaded(r)),
        recomputed: count(&|r| {
            r.turn_start == Some(TurnStart::Recomputed)
                || (r.turn_start == Some(TurnStart::Read) && !loaded(r))
        }),
        declined_near_expiry: count(&|r| r.turn_start == Some(TurnStart::DeclinedNearExpiry)),
        read_back_verified: count(&|r| r.read_verified),
        read_back_bytes: p.iter().map(|r| r.read_blocks).sum::<u64>() * block_bytes,
        kept: d.iter().filter(|r| r.keep_call.is_some()).count() as u64,
        kept_read: kept(&|o| *o == ExportOutcome::Read),
        kept_unread: kept(&|o| *o != ExportOutcome::Read),
        keep_ttl_ms: options.keep_ttl.as_secs_f64() * 1e3,
        recompute_threshold_tokens: options.recompute_threshold,
    }
}
