//! The process's figures in the Prometheus text format, through the maintained `prometheus`
//! crate (no hand-written exposition).
//!
//! One [`Collector`] reads [`snapshot`](super::snapshot) and
//! [`endpoint_snapshot`](super::endpoint_snapshot) at every scrape and builds the families from
//! them: the counters live in one place (the runtime's atomics and the ranks' published
//! endpoint counters), so nothing is counted twice and nothing has to be kept in step.
//! Counter names end in `_total`, as vLLM's `prometheus_client` exposes its `vllm:nixl_*`
//! counters (`vllm:nixl_num_kv_expired_reqs_total`).

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{Encoder, IntCounter, IntCounterVec, IntGauge, Opts, Registry, TextEncoder};

use kvhandoff_protocol::machine::DropReason;

use super::{EndpointMetrics, ProcessMetrics};

/// Every drop reason, so that each has its series from the start (at 0): a rate over a series
/// that appears only on its first increment misses that increment.
const DROP_REASONS: [DropReason; 13] = [
    DropReason::Malformed,
    DropReason::UnknownPeer,
    DropReason::UnknownKey,
    DropReason::Late,
    DropReason::StaleEpoch,
    DropReason::FutureEpoch,
    DropReason::Duplicate,
    DropReason::Unexpected,
    DropReason::WrongPath,
    DropReason::UnknownWrite,
    DropReason::TableFull,
    DropReason::TombstoneBudget,
    DropReason::PriorIncarnation,
];

/// The `reason` label of a drop.
fn reason_label(reason: DropReason) -> &'static str {
    match reason {
        DropReason::Malformed => "malformed",
        DropReason::UnknownPeer => "unknown_peer",
        DropReason::UnknownKey => "unknown_key",
        DropReason::Late => "late",
        DropReason::StaleEpoch => "stale_epoch",
        DropReason::FutureEpoch => "future_epoch",
        DropReason::Duplicate => "duplicate",
        DropReason::Unexpected => "unexpected",
        DropReason::WrongPath => "wrong_path",
        DropReason::UnknownWrite => "unknown_write",
        DropReason::TableFull => "table_full",
        DropReason::TombstoneBudget => "tombstone_budget",
        DropReason::PriorIncarnation => "prior_incarnation",
    }
}

/// The plain counters: name, help, value.
fn plain_counters(
    p: &ProcessMetrics,
    e: &EndpointMetrics,
) -> [(&'static str, &'static str, u64); 19] {
    [
        (
            "kvhandoff_calls_refused_late_total",
            "Engine calls refused because their verdict came late (Refused events).",
            p.calls_refused_late,
        ),
        (
            "kvhandoff_requests_fenced_total",
            "D requests told early that they failed because their P died (DecodeFenced); each \
             is also counted as failed when its blocks come back.",
            p.requests_fenced,
        ),
        (
            "kvhandoff_num_kv_expired_reqs_total",
            "Holders' leases that expired with nobody reading (P leases, exports) plus reads \
             declined because they could outlive the holder's lease (vllm:nixl_num_kv_expired_reqs).",
            p.requests_expired
                .saturating_add(e.reads_declined_near_expiry),
        ),
        (
            "kvhandoff_expired_leases_refused_total",
            "Registrations and heartbeats that reached held blocks whose lease had ended.",
            e.expired_leases_refused,
        ),
        (
            "kvhandoff_writes_posted_total",
            "Writes posted to the transport (push).",
            e.writes_posted,
        ),
        (
            "kvhandoff_writes_abandoned_total",
            "Writes abandoned after their deadline or their peer's death.",
            e.writes_abandoned,
        ),
        (
            "kvhandoff_stuck_writes_total",
            "Writes whose abandon the transport did not confirm in time (their source blocks \
             stay held).",
            e.stuck_writes,
        ),
        (
            "kvhandoff_digest_mismatches_total",
            "Writes whose landed bytes did not match P's integrity digests (integrity_digest on; \
             the request failed with WriteFailed(DigestMismatch)).",
            e.digest_mismatches,
        ),
        (
            "kvhandoff_reads_posted_total",
            "Reads posted to the transport (pull, bidirectional).",
            e.reads_posted,
        ),
        (
            "kvhandoff_reads_failed_total",
            "Reads that failed.",
            e.reads_failed,
        ),
        (
            "kvhandoff_reads_abandoned_total",
            "Reads abandoned because the fabric did not report them within its bound.",
            e.reads_abandoned,
        ),
        (
            "kvhandoff_stuck_reads_total",
            "Times an import found its abandoned reads still not confirmed.",
            e.stuck_reads,
        ),
        (
            "kvhandoff_stale_messages_refused_total",
            "Messages refused because their peer's liveness deadline had passed before they \
             were handled.",
            e.stale_messages_refused,
        ),
        (
            "kvhandoff_peers_declared_dead_total",
            "Peers declared dead (silence, loss, or a restart).",
            e.peers_declared_dead,
        ),
        (
            "kvhandoff_peer_restarts_total",
            "Handshakes with another incarnation of a connected peer.",
            e.peer_restarts,
        ),
        (
            "kvhandoff_peers_rejoined_total",
            "Peers declared dead that came back with the same incarnation.",
            e.peers_rejoined,
        ),
        (
            "kvhandoff_tombstones_evicted_total",
            "Tombstones evicted at capacity before they expired.",
            e.tombstones_evicted,
        ),
        (
            "kvhandoff_quarantine_frees_total",
            "D requests whose blocks were freed by the quarantine alone, after a cancel.",
            e.quarantine_frees,
        ),
        (
            "kvhandoff_fence_frees_total",
            "D requests whose blocks were freed by the fence after their P was declared dead or \
             replaced.",
            e.fence_frees,
        ),
    ]
}

/// Builds every family from the two snapshots. Each call makes fresh metric objects: they are
/// only the crate's containers for one scrape's values.
fn families(
    p: &ProcessMetrics,
    e: &EndpointMetrics,
) -> prometheus::Result<Vec<Box<dyn Collector>>> {
    let mut out: Vec<Box<dyn Collector>> = Vec::new();

    let requests = IntCounterVec::new(
        Opts::new(
            "kvhandoff_requests_total",
            "Requests by their final event: side=receiving (ready, failed, recomputed) or \
             side=sending (sent, released).",
        ),
        &["side", "outcome"],
    )?;
    for (side, outcome, n) in [
        ("receiving", "ready", p.requests_ready),
        ("receiving", "failed", p.requests_failed),
        ("receiving", "recomputed", p.requests_recomputed),
        ("sending", "sent", p.requests_sent),
        ("sending", "released", p.requests_released),
    ] {
        requests.with_label_values(&[side, outcome]).inc_by(n);
    }
    out.push(Box::new(requests));

    let bytes = IntCounterVec::new(
        Opts::new(
            "kvhandoff_bytes_transferred_total",
            "Bytes of KV of the requests sent (direction=sent) or received whole \
             (direction=received).",
        ),
        &["direction"],
    )?;
    bytes.with_label_values(&["sent"]).inc_by(p.bytes_sent);
    bytes
        .with_label_values(&["received"])
        .inc_by(p.bytes_received);
    out.push(Box::new(bytes));

    for (name, help, n) in plain_counters(p, e) {
        let counter = IntCounter::new(name, help)?;
        counter.inc_by(n);
        out.push(Box::new(counter));
    }

    let dropped = IntCounterVec::new(
        Opts::new(
            "kvhandoff_messages_dropped_total",
            "Messages and completions from outside that a rank ignored, by reason.",
        ),
        &["reason"],
    )?;
    for reason in DROP_REASONS {
        dropped.with_label_values(&[reason_label(reason)]).inc_by(0);
    }
    for (reason, n) in &e.dropped {
        dropped
            .with_label_values(&[reason_label(*reason)])
            .inc_by(*n);
    }
    out.push(Box::new(dropped));

    let ranks = IntGauge::new("kvhandoff_ranks", "Ranks running in this process.")?;
    ranks.set(i64::try_from(e.live_ranks).unwrap_or(i64::MAX));
    out.push(Box::new(ranks));
    Ok(out)
}

/// The runtime's collector: reads the process's snapshots at each scrape.
struct RuntimeCollector {
    descs: Vec<Desc>,
}

impl RuntimeCollector {
    fn new() -> prometheus::Result<RuntimeCollector> {
        let zero = families(&ProcessMetrics::default(), &EndpointMetrics::default())?;
        let descs = zero
            .iter()
            .flat_map(|c| c.desc().into_iter().cloned())
            .collect();
        Ok(RuntimeCollector { descs })
    }
}

impl Collector for RuntimeCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        // The options are fixed and valid (`RuntimeCollector::new` built them once already), so
        // this cannot fail; should it, the scrape shows nothing rather than wrong figures.
        families(&super::snapshot(), &super::endpoint_snapshot())
            .map(|all| all.iter().flat_map(|c| c.collect()).collect())
            .unwrap_or_default()
    }
}

/// A [`Registry`] holding the runtime's collector, for an engine that serves its own
/// `/metrics` and wants the runtime's families next to its own (register its collectors on
/// this registry, or gather both registries).
///
/// # Errors
/// Only if the `prometheus` crate refuses the collector's fixed names (a bug here).
pub fn registry() -> prometheus::Result<Registry> {
    let registry = Registry::new();
    registry.register(Box::new(RuntimeCollector::new()?))?;
    Ok(registry)
}

/// The runtime's figures in the Prometheus text format (version 0.0.4), as `/metrics` serves
/// them: what an engine that serves its own endpoint appends to its page.
///
/// ```
/// let text = kvhandoff_actors::metrics::prometheus_text();
/// assert!(text.contains("kvhandoff_requests_total{outcome=\"ready\",side=\"receiving\"}"));
/// ```
pub fn prometheus_text() -> String {
    let families = match registry() {
        Ok(registry) => registry.gather(),
        Err(_) => Vec::new(),
    };
    let mut out = Vec::new();
    // Encoding into a Vec cannot fail on I/O; the crate checks only what it was given.
    if TextEncoder::new().encode(&families, &mut out).is_err() {
        return String::new();
    }
    String::from_utf8(out).unwrap_or_default()
}

/// The content type of [`prometheus_text`].
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4";
