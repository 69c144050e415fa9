//! The process's own counters: what every rank of this process handed over, and how it ended.
//!
//! Each rank's actor counts its requests' final events here, at the moment it hands them to the
//! engine, so the figures are the runtime's own (an engine that exports its own metrics reads
//! them with [`snapshot`]; the Python package's `kvhandoff.metrics()` is this snapshot). Bytes
//! are counted per request, when it succeeds, as the request's blocks times the rank's bytes
//! per logical block: what a handoff moved, on the side that sent it and on the side that got
//! it alike (a push D posts nothing, yet receives).
//!
//! Per transfer, the transport actor times each post and each transfer and records its bytes
//! and descriptors, and every request that fails counts once by [`FailureCause`]
//! ([`transfer_snapshot`]).
//!
//! Besides these, each rank publishes its endpoint's counters and gauges
//! ([`endpoint_snapshot`]), and all are rendered in the Prometheus text format by [`prometheus_text`] (served on
//! `/metrics` by [`MetricsServer`]; `kvhandoff node --metrics-addr`). The metric names, and
//! which counter each reads, are listed in docs/operations.md.

mod endpoint;
mod exposition;
pub mod http;
mod taxonomy;
mod transfers;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

pub use endpoint::{endpoint_snapshot, EndpointMetrics};
pub use exposition::{prometheus_text, registry, CONTENT_TYPE};
pub use http::{MetricsServer, MetricsServerError};
pub use taxonomy::FailureCause;
pub(crate) use transfers::{count_rejection, observe_handshake, TransferClock};
pub use transfers::{
    free_proof_label, read_proof_label, transfer_snapshot, HistogramSnapshot, TransferMetrics,
    BYTES_BUCKETS, DESCRIPTOR_BUCKETS, HANDSHAKE_TIME_BUCKETS, POST_TIME_BUCKETS,
    XFER_TIME_BUCKETS,
};

use kvhandoff_protocol::machine::{
    Counters as EndpointCounters, ExportEnd, ExportOutcome, Gauges, ImportOutcome, ReleaseCause,
};
use kvhandoff_protocol::session::ConnectorEvent;
use kvhandoff_protocol::BlockIds;

/// A copy of the process's counters at one moment ([`snapshot`]). Every figure only grows.
///
/// ```
/// let before = kvhandoff_actors::metrics::snapshot();
/// assert!(kvhandoff_actors::metrics::snapshot().requests_ready >= before.requests_ready);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProcessMetrics {
    /// Requests whose KV arrived here: a D's `BlocksReady`, a reader's `Imported` `Loaded`.
    pub requests_ready: u64,
    /// Requests whose KV will not arrive here: a D's `Failed`, a reader's `Imported` `Failed`.
    pub requests_failed: u64,
    /// Reads that ended in `Imported` `Recompute` (part of the KV arrived; the rest recomputes).
    pub requests_recomputed: u64,
    /// Requests whose KV left here: P's `BlocksFree` after the write, an export that was read.
    pub requests_sent: u64,
    /// Requests whose blocks were let go unsent: P's `BlocksFree` with a cause, an export
    /// released unread.
    pub requests_released: u64,
    /// Of `requests_released`, those let go because the holder's lease ended with nobody
    /// asking for them: P's `BlocksFree` with `LeaseExpired`, an export that ended
    /// `LeaseExpired`.
    pub requests_expired: u64,
    /// D requests failed early because their P died (`DecodeFenced`).
    pub requests_fenced: u64,
    /// Calls refused after their verdict came late (`Refused`).
    pub calls_refused_late: u64,
    /// Bytes of KV of the requests counted in `requests_sent`.
    pub bytes_sent: u64,
    /// Bytes of KV of the requests counted in `requests_ready` (and the valid part of the
    /// recomputed ones' blocks is not counted).
    pub bytes_received: u64,
}

struct Counters {
    requests_ready: AtomicU64,
    requests_failed: AtomicU64,
    requests_recomputed: AtomicU64,
    requests_sent: AtomicU64,
    requests_released: AtomicU64,
    requests_expired: AtomicU64,
    requests_fenced: AtomicU64,
    calls_refused_late: AtomicU64,
    bytes_sent: AtomicU64,
    bytes_received: AtomicU64,
}

static COUNTERS: Counters = Counters {
    requests_ready: AtomicU64::new(0),
    requests_failed: AtomicU64::new(0),
    requests_recomputed: AtomicU64::new(0),
    requests_sent: AtomicU64::new(0),
    requests_released: AtomicU64::new(0),
    requests_expired: AtomicU64::new(0),
    requests_fenced: AtomicU64::new(0),
    calls_refused_late: AtomicU64::new(0),
    bytes_sent: AtomicU64::new(0),
    bytes_received: AtomicU64::new(0),
};

/// The process's counters now (every rank of every runtime in this process).
pub fn snapshot() -> ProcessMetrics {
    let c = &COUNTERS;
    let read = |a: &AtomicU64| a.load(Ordering::Relaxed);
    ProcessMetrics {
        requests_ready: read(&c.requests_ready),
        requests_failed: read(&c.requests_failed),
        requests_recomputed: read(&c.requests_recomputed),
        requests_sent: read(&c.requests_sent),
        requests_released: read(&c.requests_released),
        requests_expired: read(&c.requests_expired),
        requests_fenced: read(&c.requests_fenced),
        calls_refused_late: read(&c.calls_refused_late),
        bytes_sent: read(&c.bytes_sent),
        bytes_received: read(&c.bytes_received),
    }
}

/// What a rank needs to count its events (bytes per logical block of each cache group) and to
/// publish its endpoint counters (its slot, retired when the last clone is dropped).
#[derive(Debug, Clone)]
pub(crate) struct EventCounter {
    group_block_bytes: Vec<u64>,
    endpoint: Arc<endpoint::EndpointSlot>,
}

impl EventCounter {
    pub(crate) fn new(group_block_bytes: Vec<u64>) -> EventCounter {
        EventCounter {
            group_block_bytes,
            endpoint: Arc::new(endpoint::EndpointSlot::register()),
        }
    }

    /// Publishes the rank's endpoint counters for [`endpoint_snapshot`] (a comparison when
    /// nothing changed).
    pub(crate) fn publish(&self, counters: &EndpointCounters) {
        self.endpoint.publish(counters);
    }

    /// Publishes the rank's gauges (blocks in quarantine, peers by state) for
    /// [`endpoint_snapshot`].
    pub(crate) fn publish_gauges(&self, gauges: Gauges) {
        self.endpoint.publish_gauges(gauges);
    }

    fn bytes_of(&self, blocks: &BlockIds) -> u64 {
        blocks
            .groups
            .iter()
            .zip(&self.group_block_bytes)
            .map(|(ids, bytes)| (ids.len() as u64).saturating_mul(*bytes))
            .fold(0u64, u64::saturating_add)
    }

    /// Counts one event the rank hands to its engine.
    pub(crate) fn count(&self, event: &ConnectorEvent) {
        let c = &COUNTERS;
        let add = |a: &AtomicU64, n: u64| {
            a.fetch_add(n, Ordering::Relaxed);
        };
        match event {
            ConnectorEvent::BlocksReady { blocks, .. } => {
                add(&c.requests_ready, 1);
                add(&c.bytes_received, self.bytes_of(blocks));
            }
            ConnectorEvent::DecodeFenced { .. } => add(&c.requests_fenced, 1),
            ConnectorEvent::Failed { reason, proof, .. } => {
                add(&c.requests_failed, 1);
                transfers::count_failed_transfer(FailureCause::of_decode(*reason));
                transfers::count_decode_failed(*proof);
            }
            ConnectorEvent::Refused { .. } => add(&c.calls_refused_late, 1),
            ConnectorEvent::BlocksFree {
                released, blocks, ..
            } => match released {
                None => {
                    add(&c.requests_sent, 1);
                    add(&c.bytes_sent, self.bytes_of(blocks));
                }
                Some(cause) => {
                    add(&c.requests_released, 1);
                    if matches!(cause, ReleaseCause::LeaseExpired) {
                        add(&c.requests_expired, 1);
                    }
                    if let Some(failure) = FailureCause::of_release(*cause) {
                        transfers::count_failed_transfer(failure);
                    }
                }
            },
            ConnectorEvent::ExportEnded {
                outcome,
                proof,
                blocks,
                ..
            } => match outcome {
                ExportOutcome::Read => {
                    add(&c.requests_sent, 1);
                    add(&c.bytes_sent, self.bytes_of(blocks));
                    transfers::count_export_end(true, *proof);
                }
                ExportOutcome::Released(end) => {
                    add(&c.requests_released, 1);
                    if matches!(end, ExportEnd::LeaseExpired) {
                        add(&c.requests_expired, 1);
                    }
                    if let Some(failure) = FailureCause::of_export(*end) {
                        transfers::count_failed_transfer(failure);
                    }
                    transfers::count_export_end(false, *proof);
                }
            },
            ConnectorEvent::Imported {
                outcome, blocks, ..
            } => match outcome {
                ImportOutcome::Loaded => {
                    add(&c.requests_ready, 1);
                    add(&c.bytes_received, self.bytes_of(blocks));
                }
                ImportOutcome::Recompute { failure, .. } => {
                    add(&c.requests_recomputed, 1);
                    transfers::count_failed_transfer(FailureCause::of_import(*failure));
                }
                ImportOutcome::Failed(failure) => {
                    add(&c.requests_failed, 1);
                    transfers::count_failed_transfer(FailureCause::of_import(*failure));
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvhandoff_protocol::RequestId;

    #[test]
    fn a_ready_request_counts_its_blocks_bytes_per_group() {
        let counter = EventCounter::new(vec![100, 10]);
        let before = snapshot();
        counter.count(&ConnectorEvent::BlocksReady {
            request: RequestId::new("r").unwrap(),
            blocks: BlockIds {
                groups: vec![vec![1, 2, 3], vec![4]],
            },
        });
        let after = snapshot();
        // Other tests of this binary may count at the same time: at least ours.
        assert!(after.requests_ready > before.requests_ready);
        assert!(after.bytes_received >= before.bytes_received + 310);
    }

    #[test]
    fn a_failed_request_counts_once_by_cause_and_by_proof() {
        use kvhandoff_protocol::machine::{DecodeFailure, FreeProof};
        let counter = EventCounter::new(vec![1]);
        let before = transfer_snapshot();
        counter.count(&ConnectorEvent::Failed {
            request: RequestId::new("r").unwrap(),
            reason: DecodeFailure::HandshakeFailed,
            proof: FreeProof::PeerQuiesced,
            blocks: BlockIds::default(),
        });
        // A lease that ended with nobody reading is an expiry, not a failed transfer.
        counter.count(&ConnectorEvent::BlocksFree {
            request: RequestId::new("p").unwrap(),
            released: Some(ReleaseCause::LeaseExpired),
            blocks: BlockIds::default(),
        });
        let after = transfer_snapshot();
        let cause = FailureCause::HandshakeFailed;
        assert!(after.failed_transfers[&cause] > before.failed_transfers[&cause]);
        let proof = FreeProof::PeerQuiesced;
        assert!(after.decode_failed_by_proof[&proof] > before.decode_failed_by_proof[&proof]);
        assert_eq!(
            after.failed_transfers[&FailureCause::LeaseExpired],
            before.failed_transfers[&FailureCause::LeaseExpired]
        );
    }
}
