//! The demo's report of a heterogeneous run: the plain demo's keys, and the pair's section.

use std::time::{Duration, Instant};

use kvhandoff_protocol::hetero::PairPlan;

use super::flight::Shared;
use super::HeteroDemoOptions;
use crate::demo::{
    DemoReport, EventCounts, GeometrySummary, HeteroSummary, Latency, Leaks, Outcomes,
    PrefillOutcomes, Races, ReportRole, TurnCounts,
};
use crate::stats::gbps;

#[allow(clippy::too_many_arguments)]
pub(super) fn report(
    options: &HeteroDemoOptions,
    pair: &PairPlan,
    handoffs: &[Shared],
    pulled: &[bool],
    t: Tally,
    bytes: u64,
    window: Duration,
    wall: Instant,
    transport: &str,
) -> DemoReport {
    let m = pair.model;
    let spec = pair.prefill.spec;
    let summary = HeteroSummary {
        model: m.name.into(),
        prefill: spec.to_string(),
        decode: pair.decode.spec.to_string(),
        prefill_ranks: pair.prefill.ranks.len() as u32,
        decode_ranks: pair.decode.ranks.len() as u32,
        links: pair.links.len() as u32,
        idle_prefill_ranks: pair.idle_prefill_ranks().len() as u32,
        sub_requests: t.sub_requests,
        faults_injected: t.faults_injected,
        descriptors: t.descriptors,
        prefill_jobs: t.prefill_jobs,
        decode_jobs: t.decode_jobs,
        zeroed_bytes: t.zeroed,
        transforms: pair
            .pipeline
            .transforms
            .iter()
            .map(|x| match (options.pull, x.runs_on) {
                // In pull P does nothing for the read: D runs P's part over its mirror.
                (true, kvhandoff_protocol::hetero::RunsOn::Prefill) => format!(
                    "{} on D (pull: P's part, run over D's copy of P's blocks): {}",
                    x.kind.label(),
                    x.reason
                ),
                _ => format!("{} {}: {}", x.kind.label(), x.runs_on.label(), x.reason),
            })
            .collect(),
    };
    let mut report = DemoReport {
        transport: transport.into(),
        mode: match (options.pull, options.mixed) {
            (true, _) => "pull",
            (false, true) => "mixed",
            (false, false) => "push",
        }
        .into(),
        pulled: pulled.iter().filter(|p| **p).count() as u64,
        role: ReportRole::Both,
        seed: options.seed,
        requests: handoffs.len() as u64,
        verified: t.verified,
        byte_errors: t.byte_errors,
        races: t.races,
        call_order: t.call_order,
        outcomes: Outcomes {
            ready: t.ready,
            failed: t.failed,
            missing: t.decode_missing,
        },
        prefill_outcomes: PrefillOutcomes {
            sent: t.sent,
            released: t.released,
            missing: t.prefill_missing,
        },
        bytes,
        expected_bytes: handoffs
            .iter()
            .zip(pulled)
            .filter_map(|(h, pull)| h.lock().ok().map(|h| (h, pull)))
            .map(|(h, pull)| {
                if *pull {
                    h.pull_bytes()
                } else {
                    h.plan.bytes()
                }
            })
            .sum(),
        tokens: handoffs
            .iter()
            .filter_map(|h| h.lock().ok())
            .map(|h| h.shape.tokens)
            .sum(),
        blocks: handoffs
            .iter()
            .filter_map(|h| h.lock().ok())
            .map(|h| h.prefill_blocks.total() as u64)
            .sum(),
        gbps: gbps(bytes, window.as_secs_f64() * 1e6),
        handoff_window_ms: window.as_secs_f64() * 1e3,
        handoff_latency_us: Latency::of(t.latencies_us),
        wall_ms: wall.elapsed().as_secs_f64() * 1e3,
        events: EventCounts {
            prefill: t.prefill_events,
            decode: t.decode_events,
            duplicates: t.duplicates,
            unknown: t.unknown,
        },
        turns: TurnCounts::default(),
        double_frees: 0,
        leaked_blocks: t.leaks,
        pool_blocks: handoffs
            .iter()
            .filter_map(|h| h.lock().ok())
            .map(|h| {
                h.prefill_memory
                    .pool_blocks
                    .max(h.decode_memory.pool_blocks)
            })
            .max()
            .unwrap_or(0),
        geometry: GeometrySummary {
            layers: m.num_layers,
            kv_heads: m.kv_heads,
            head_dim: m.head_dim,
            dtype_bytes: m.dtype_bytes,
            block_tokens: spec.block,
            layout: format!(
                "P {} -> D {}",
                kvhandoff_protocol::hetero::layout_name(spec.layout),
                kvhandoff_protocol::hetero::layout_name(pair.decode.spec.layout)
            ),
            block_bytes: m.row_bytes()
                * u64::from(m.kv_heads)
                * 2
                * u64::from(m.num_layers)
                * spec.logical_block(),
        },
        timed_out: t.timed_out,
        errors: t.errors,
        ok: false,
        verdict: String::new(),
        hetero: Some(Box::new(summary)),
    };
    report.ok = report.verdict_ok();
    report.verdict = report.verdict_line();
    report
}

/// Most errors a report keeps.
const MAX_ERRORS: usize = 32;

/// What the run saw.
#[derive(Default)]
pub(super) struct Tally {
    pub(super) ready: u64,
    pub(super) failed: u64,
    pub(super) decode_missing: u64,
    pub(super) sent: u64,
    pub(super) released: u64,
    pub(super) prefill_missing: u64,
    pub(super) verified: u64,
    pub(super) byte_errors: u64,
    pub(super) races: Races,
    pub(super) call_order: Races,
    pub(super) prefill_events: u64,
    pub(super) decode_events: u64,
    pub(super) duplicates: u64,
    pub(super) unknown: u64,
    pub(super) leaks: Leaks,
    pub(super) sent_bytes: u64,
    pub(super) sub_requests: u64,
    pub(super) faults_injected: u64,
    pub(super) descriptors: u64,
    pub(super) prefill_jobs: u64,
    pub(super) decode_jobs: u64,
    pub(super) zeroed: u64,
    pub(super) latencies_us: Vec<f64>,
    pub(super) timed_out: bool,
    pub(super) errors: Vec<String>,
    /// Each rank's events by typed outcome (`Ready`, `Failed(PeerDead)`, `Sent`, …).
    pub(super) outcomes: std::collections::BTreeMap<String, u64>,
}

impl Tally {
    pub(super) fn outcome(&mut self, outcome: String) {
        *self.outcomes.entry(outcome).or_default() += 1;
    }

    pub(super) fn error(&mut self, error: String) {
        if self.errors.len() < MAX_ERRORS {
            self.errors.push(error);
        }
    }
}
