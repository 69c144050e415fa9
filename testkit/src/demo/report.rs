//! The demo's report: what a run did and the verdict. The table for people is in `table`, how
//! the report is built from the engines' records in `assemble`.

mod assemble;
mod table;

use serde::{Deserialize, Serialize};

#[cfg(doc)]
use super::DemoMode;
pub(crate) use assemble::{build, turn_counts, Facts, Tallies};

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

impl Latency {
    /// The percentiles of `samples_us` (any order; 0 for none).
    pub fn of(mut samples_us: Vec<f64>) -> Latency {
        samples_us.sort_by(f64::total_cmp);
        Latency {
            p50: crate::stats::percentile(&samples_us, 50.0),
            p99: crate::stats::percentile(&samples_us, 99.0),
            max: samples_us.last().copied().unwrap_or(0.0),
        }
    }
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
    /// The heterogeneous pair, for `demo --model … --prefill … --decode …` (absent otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hetero: Option<Box<HeteroSummary>>,
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

    pub(crate) fn verdict_line(&self) -> String {
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
}

/// What the heterogeneous demo (`hetero::pair_demo`) adds to the demo's report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeteroSummary {
    /// The catalog model.
    pub model: String,
    /// P's side spec.
    pub prefill: String,
    /// D's side spec.
    pub decode: String,
    /// P's ranks.
    pub prefill_ranks: u32,
    /// D's ranks.
    pub decode_ranks: u32,
    /// Links (P rank → D rank pairs that move bytes).
    pub links: u32,
    /// P ranks that write nothing (replicas).
    pub idle_prefill_ranks: u32,
    /// Sub-requests started over all ranks and requests (one per link and side).
    pub sub_requests: u64,
    /// Descriptors posted over all requests.
    pub descriptors: u64,
    /// P's staging jobs over all requests.
    pub prefill_jobs: u64,
    /// D's staging jobs over all requests.
    pub decode_jobs: u64,
    /// Bytes D zeroed (tails of partly covered blocks).
    pub zeroed_bytes: u64,
    /// Transport faults armed (`chaos`).
    pub faults_injected: u64,
    /// Each transform: what, where, why.
    pub transforms: Vec<String>,
}
