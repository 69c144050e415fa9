//! The [`NodeFacts`] a node builds at the end, and the other figures of its reports.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kvhandoff_protocol::machine::{Config, Counters};

use kvhandoff::TransferMode;
use kvhandoff_protocol::machine::ImportOutcome;

use super::{LinkSummary, NodeFacts, NodeOptions, PoolSummary, RequestEnd, SideChannelStats};
use crate::demo::{
    self, failed_note, import_note, no_answer_note, released_note, unread_note, DecodeRecord,
    FreeList, Planned, PrefillRecord, TurnStart,
};

/// Wall-clock times of a run's instants.
#[derive(Debug, Clone, Copy)]
pub(super) struct UnixClock {
    at: Instant,
    unix_ms: f64,
}

impl UnixClock {
    pub(super) fn now() -> Self {
        let unix_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64() * 1e3);
        UnixClock {
            at: Instant::now(),
            unix_ms,
        }
    }

    pub(super) fn unix_ms(&self, t: Instant) -> f64 {
        if t >= self.at {
            self.unix_ms + (t - self.at).as_secs_f64() * 1e3
        } else {
            self.unix_ms - (self.at - t).as_secs_f64() * 1e3
        }
    }
}

/// What [`NodeFacts`] are built from, known when the schedule starts.
pub(super) struct FactsInput<'a> {
    pub(super) options: &'a NodeOptions,
    pub(super) config: &'a Config,
    pub(super) clock: UnixClock,
    pub(super) start: Instant,
}

/// What [`NodeFacts`] are built from, known at the end.
pub(super) struct Outcome<'a> {
    pub(super) ends: Vec<RequestEnd>,
    /// The errors the engine loop noted for typed failures (expected of a survivor).
    pub(super) explained: BTreeSet<String>,
    pub(super) errors: &'a [String],
    pub(super) free: &'a FreeList,
    pub(super) pool_blocks: u32,
    pub(super) counters: Option<&'a Counters>,
    pub(super) deaths: Vec<Instant>,
    pub(super) timed_out: bool,
}

impl FactsInput<'_> {
    pub(super) fn build(&self, o: Outcome<'_>) -> NodeFacts {
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
            quarantine_ms: ms(self.config.quarantine),
            grant_fence_ms: ms(kvhandoff_protocol::machine::read_span(self.config)),
            expect_peer_loss: self.options.expect_peer_loss,
            schedule_start_unix_ms: self.clock.unix_ms(self.start),
            pool: PoolSummary {
                blocks: o.pool_blocks,
                free_at_end: o.pool_blocks.saturating_sub(in_use),
                double_frees: o.free.double_frees,
                bad_ids: o.free.bad_ids,
            },
            peer_deaths: o.counters.map_or(0, |c| c.peers_declared_dead),
            repeated_handshakes: o.counters.map_or(0, |c| c.repeated_handshakes),
            peer_restarts: o.counters.map_or(0, |c| c.peer_restarts),
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

/// P's requests as [`RequestEnd`]s, and the errors its loop noted for their typed outcomes.
pub(super) fn prefill_ends(
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
            let pulled = q.mode == TransferMode::Pull;
            let outcome = match (r.sent, r.released, r.export_end) {
                (_, Some(cause), _) => {
                    explained.insert(released_note(&q.prefill_id, cause));
                    Some(format!("Released({cause:?})"))
                }
                (_, None, Some(end)) => {
                    explained.insert(unread_note(&q.prefill_id, end));
                    Some(format!("Unread({end:?})"))
                }
                (true, None, None) if pulled => Some("Read".to_string()),
                (true, None, None) => Some("Sent".to_string()),
                (false, None, None) if r.abandoned => Some("Abandoned".to_string()),
                (false, None, None) => None,
            };
            let turn = match (r.turn_start, r.import_outcome) {
                (Some(TurnStart::Read), Some(outcome)) => {
                    if outcome != ImportOutcome::Loaded {
                        explained.insert(format!("P: {} read back: {outcome:?}", q.prefill_id));
                    }
                    Some(format!("Read({outcome:?})"))
                }
                (Some(TurnStart::Read), None) => Some("Read".to_string()),
                (Some(start), _) => Some(format!("{start:?}")),
                (None, _) => None,
            };
            RequestEnd {
                index: (start_at + j) as u64,
                outcome,
                events: r.events,
                called_unix_ms: r.finish_call.map(|t| clock.unix_ms(t)),
                ended_unix_ms: r.ended_at.map(|t| clock.unix_ms(t)),
                fenced_unix_ms: None,
                byte_errors: r.read_byte_errors,
                proof: r.export_proof.map(|p| format!("{p:?}")),
                turn,
                turn_called_unix_ms: r.read_call.map(|t| clock.unix_ms(t)),
                turn_ended_unix_ms: r.read_ended_at.map(|t| clock.unix_ms(t)),
            }
        })
        .collect();
    (ends, explained)
}

/// D's requests as [`RequestEnd`]s, and the errors its loop noted for their typed outcomes.
pub(super) fn decode_ends(
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
                explained.insert(failed_note(&q.decode_id, why));
                Some(format!("Failed({why:?})"))
            } else if let Some(outcome) = r.import_failure {
                explained.insert(import_note(&q.decode_id, outcome));
                Some(format!("Import({outcome:?})"))
            } else if r.no_answer {
                explained.insert(no_answer_note(&q.decode_id));
                Some("NoAnswer".to_string())
            } else if r.abandoned {
                Some("Abandoned".to_string())
            } else {
                None
            };
            let turn = r.export_outcome.map(|o| match r.export_proof {
                Some(proof) => format!("Kept({o:?})/{proof:?}"),
                None => format!("Kept({o:?})"),
            });
            RequestEnd {
                index: (start_at + j) as u64,
                outcome,
                events: r.events,
                called_unix_ms: r.allocate_call.map(|t| clock.unix_ms(t)),
                ended_unix_ms: r.ended_at.map(|t| clock.unix_ms(t)),
                fenced_unix_ms: r.fenced_at.map(|t| clock.unix_ms(t)),
                byte_errors: r.byte_errors,
                proof: r.proof.map(|p| format!("{p:?}")),
                turn,
                turn_called_unix_ms: r.keep_call.map(|t| clock.unix_ms(t)),
                turn_ended_unix_ms: r.export_ended_at.map(|t| clock.unix_ms(t)),
            }
        })
        .collect();
    (ends, explained)
}

pub(super) fn push(errors: &mut Vec<String>, error: String) {
    if errors.len() < 32 {
        errors.push(error);
    }
}

pub(super) fn summary(
    s: &SideChannelStats,
    listen: SocketAddr,
    peer: SocketAddr,
    (listening_ms, waited_ms): (f64, f64),
) -> LinkSummary {
    LinkSummary {
        listen: listen.to_string(),
        peer: peer.to_string(),
        listening_ms,
        waited_ms,
        incoming_ok: s.incoming_ok,
        outgoing_ok: s.outgoing_ok,
        rejected: s.total_rejected(),
        outgoing_failed: s.outgoing_failed.values().sum(),
    }
}

/// P's `request_finished` calls against the schedule: how many came more than 1 ms late, and the
/// latest, in ms.
pub(super) fn lateness(
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
