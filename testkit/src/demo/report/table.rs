//! The report as a table for people.

use std::fmt::Write as _;

use super::{DemoReport, ReportRole};
use crate::demo::DemoMode;
use crate::stats::human_bytes;

impl DemoReport {
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
        if let Some(h) = &self.hetero {
            lines.push((
                "pair",
                format!(
                    "{}: P {} ({} ranks) -> D {} ({} ranks); {} links, {} idle P ranks",
                    h.model,
                    h.prefill,
                    h.prefill_ranks,
                    h.decode,
                    h.decode_ranks,
                    h.links,
                    h.idle_prefill_ranks
                ),
            ));
            lines.push((
                "pair work",
                format!(
                    "{} sub-requests, {} descriptors, staging jobs P {} / D {}, {} zeroed, {} \
                     faults armed",
                    h.sub_requests,
                    h.descriptors,
                    h.prefill_jobs,
                    h.decode_jobs,
                    human_bytes(h.zeroed_bytes),
                    h.faults_injected
                ),
            ));
            for (i, t) in h.transforms.iter().enumerate() {
                lines.push((if i == 0 { "transforms" } else { "" }, t.clone()));
            }
        }
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
