//! How the report is built from the engines' records and the run's tallies (its verdict
//! included).

use std::time::{Duration, Instant};

use kvhandoff_protocol::KvLayout;

use super::{
    DemoReport, EventCounts, GeometrySummary, Latency, Leaks, Outcomes, PrefillOutcomes, Races,
    ReportRole, TurnCounts,
};
use crate::demo::engines::{note, DecodeRecord, PrefillRecord, TurnStart};
use crate::demo::schedule::{Planned, Workload};
use crate::demo::{DemoMode, DemoOptions};
use crate::stats::gbps;
use kvhandoff::TransferMode;
use kvhandoff_protocol::machine::{ExportOutcome, ImportOutcome};

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
        gbps: gbps(t.bytes, window.as_secs_f64() * 1e6),
        handoff_window_ms: window.as_secs_f64() * 1e3,
        handoff_latency_us: Latency::of(latencies),
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
        hetero: None,
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
