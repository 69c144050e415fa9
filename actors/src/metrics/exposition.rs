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
use prometheus::{
    Encoder, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};

use kvhandoff_protocol::machine::DropReason;

use super::transfers::{free_proof_label, read_proof_label};
use super::{EndpointMetrics, ProcessMetrics, TransferMetrics};

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
) -> [(&'static str, &'static str, u64); 20] {
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
            "kvhandoff_reads_asked_again_total",
            "Asks a reader sent again soon because the holder did not have the export yet \
             (an engine that answers the router before its rank has the export).",
            e.reads_asked_again,
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

/// A gauge's value: figures above `i64::MAX` read as `i64::MAX`.
fn gauge_value(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// The families of [`TransferMetrics`]' counters and the endpoint gauges (the histograms are the
/// `prometheus` crate's own and collected as they are). Every series exists at 0.
fn transfer_families(
    t: &TransferMetrics,
    e: &EndpointMetrics,
    out: &mut Vec<Box<dyn Collector>>,
) -> prometheus::Result<()> {
    for (name, help, by_cause) in [
        (
            "kvhandoff_num_failed_transfers_total",
            "Failed transfers by cause: each request whose KV did not move (counted once, on \
             each side, at its final event), plus the failed notifications, as vLLM's \
             vllm:nixl_num_failed_transfers counts them.",
            &t.failed_transfers,
        ),
        (
            "kvhandoff_num_failed_notifications_total",
            "Notifications (control messages) the transport could not send, by cause \
             (vllm:nixl_num_failed_notifications).",
            &t.failed_notifications,
        ),
    ] {
        let family = IntCounterVec::new(Opts::new(name, help), &["cause"])?;
        for (cause, n) in by_cause {
            family.with_label_values(&[cause.label()]).inc_by(*n);
        }
        out.push(Box::new(family));
    }

    let by_proof = IntCounterVec::new(
        Opts::new(
            "kvhandoff_requests_by_proof_total",
            "Requests whose final event names what made it safe to hand their blocks back, by \
             that proof: side=receiving outcome=failed (D's Failed), side=sending outcome=sent \
             or released (an export's end). The same requests as kvhandoff_requests_total, \
             which keeps its labels.",
        ),
        &["side", "outcome", "proof"],
    )?;
    for (proof, n) in &t.decode_failed_by_proof {
        by_proof
            .with_label_values(&["receiving", "failed", free_proof_label(*proof)])
            .inc_by(*n);
    }
    for (outcome, counts) in [
        ("sent", &t.export_sent_by_proof),
        ("released", &t.export_released_by_proof),
    ] {
        for (proof, n) in counts {
            by_proof
                .with_label_values(&["sending", outcome, read_proof_label(*proof)])
                .inc_by(*n);
        }
    }
    out.push(Box::new(by_proof));

    let rejections = IntCounterVec::new(
        Opts::new(
            "kvhandoff_side_channel_rejections_total",
            "Incoming side-channel connections the listener rejected (closed with nothing \
             written), by reason.",
        ),
        &["reason"],
    )?;
    for (reason, n) in &t.side_channel_rejections {
        rejections.with_label_values(&[reason.label()]).inc_by(*n);
    }
    out.push(Box::new(rejections));

    let quarantined = IntGauge::new(
        "kvhandoff_blocks_quarantined",
        "Logical blocks of D requests that gave up and wait for a proof that no write can \
         still land, or for their quarantine or dead-peer fence to pass.",
    )?;
    quarantined.set(gauge_value(e.blocks_quarantined));
    out.push(Box::new(quarantined));

    let peers = IntGaugeVec::new(
        Opts::new(
            "kvhandoff_peers",
            "Peers of the live ranks by liveness state (connecting, connected, dead: declared \
             dead and still remembered).",
        ),
        &["state"],
    )?;
    for (state, n) in [
        ("connecting", e.peers_connecting),
        ("connected", e.peers_connected),
        ("dead", e.peers_dead),
    ] {
        peers.with_label_values(&[state]).set(gauge_value(n));
    }
    out.push(Box::new(peers));
    Ok(())
}

/// Builds every family from the snapshots. Each call makes fresh metric objects: they are
/// only the crate's containers for one scrape's values.
fn families(
    p: &ProcessMetrics,
    e: &EndpointMetrics,
    t: &TransferMetrics,
) -> prometheus::Result<Vec<Box<dyn Collector>>> {
    let mut out: Vec<Box<dyn Collector>> = Vec::new();
    transfer_families(t, e, &mut out)?;

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
    ranks.set(gauge_value(e.live_ranks));
    out.push(Box::new(ranks));
    Ok(out)
}

/// The runtime's collector: reads the process's snapshots at each scrape.
struct RuntimeCollector {
    descs: Vec<Desc>,
}

impl RuntimeCollector {
    fn new() -> prometheus::Result<RuntimeCollector> {
        let zero = families(
            &ProcessMetrics::default(),
            &EndpointMetrics::default(),
            &TransferMetrics::default(),
        )?;
        let mut descs: Vec<Desc> = zero
            .iter()
            .flat_map(|c| c.desc().into_iter().cloned())
            .collect();
        descs.extend(super::transfers::histogram_descs());
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
        let mut out: Vec<MetricFamily> = families(
            &super::snapshot(),
            &super::endpoint_snapshot(),
            &super::transfer_snapshot(),
        )
        .map(|all| all.iter().flat_map(|c| c.collect()).collect())
        .unwrap_or_default();
        out.extend(super::transfers::histogram_families());
        out
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::FailureCause;
    use crate::system::RejectReason;

    /// Every family, with its type: each is on the page from the first scrape, whatever ran.
    const FAMILIES: [(&str, &str); 10] = [
        ("kvhandoff_xfer_time_seconds", "histogram"),
        ("kvhandoff_post_time_seconds", "histogram"),
        ("kvhandoff_bytes_transferred", "histogram"),
        ("kvhandoff_num_descriptors", "histogram"),
        ("kvhandoff_handshake_time_seconds", "histogram"),
        ("kvhandoff_num_failed_transfers_total", "counter"),
        ("kvhandoff_num_failed_notifications_total", "counter"),
        ("kvhandoff_side_channel_rejections_total", "counter"),
        ("kvhandoff_blocks_quarantined", "gauge"),
        ("kvhandoff_peers", "gauge"),
    ];

    #[test]
    fn every_family_and_every_labelled_series_is_on_the_first_page() {
        let text = prometheus_text();
        for (name, kind) in FAMILIES {
            assert!(
                text.contains(&format!("# TYPE {name} {kind}\n")),
                "{name} missing\n{text}"
            );
        }
        for name in [
            "kvhandoff_requests_total",
            "kvhandoff_bytes_transferred_total",
        ] {
            assert!(text.contains(&format!("# TYPE {name} counter\n")), "{name}");
        }
        for cause in FailureCause::ALL {
            for family in [
                "kvhandoff_num_failed_transfers_total",
                "kvhandoff_num_failed_notifications_total",
            ] {
                let series = format!("{family}{{cause=\"{}\"}} ", cause.label());
                assert!(text.contains(&series), "{series} missing\n{text}");
            }
        }
        for reason in RejectReason::ALL {
            let series = format!(
                "kvhandoff_side_channel_rejections_total{{reason=\"{}\"}} ",
                reason.label()
            );
            assert!(text.contains(&series), "{series} missing");
        }
        for state in ["connecting", "connected", "dead"] {
            let series = format!("kvhandoff_peers{{state=\"{state}\"}} ");
            assert!(text.contains(&series), "{series} missing");
        }
        for proof in crate::metrics::transfers::FREE_PROOFS {
            let series = format!(
                "kvhandoff_requests_by_proof_total{{outcome=\"failed\",proof=\"{}\",side=\"receiving\"}} ",
                free_proof_label(proof)
            );
            assert!(text.contains(&series), "{series} missing");
        }
        for proof in crate::metrics::transfers::READ_PROOFS {
            for outcome in ["sent", "released"] {
                let series = format!(
                    "kvhandoff_requests_by_proof_total{{outcome=\"{outcome}\",proof=\"{}\",side=\"sending\"}} ",
                    read_proof_label(proof)
                );
                assert!(text.contains(&series), "{series} missing");
            }
        }
        // vLLM's buckets, so that its dashboards read ours.
        assert!(text.contains("kvhandoff_xfer_time_seconds_bucket{le=\"0.005\"}"));
        assert!(text.contains("kvhandoff_bytes_transferred_bucket{le=\"8589934592\"}"));
        assert!(text.contains("kvhandoff_num_descriptors_bucket{le=\"50000\"}"));
    }

    #[test]
    fn the_registry_takes_the_collector_with_its_histograms() {
        // Registering checks the collector's descriptions against what it collects.
        let registry = registry().expect("the collector's fixed names are valid");
        let names: Vec<String> = registry
            .gather()
            .iter()
            .map(|f| f.name().to_string())
            .collect();
        assert!(
            names.iter().any(|n| n == "kvhandoff_xfer_time_seconds"),
            "{names:?}"
        );
    }
}
