//! Per-transfer figures (vLLM's `nixl_*` histograms), failures by cause, request ends by
//! proof, and the side channel's handshakes and rejections.
//!
//! Everything here is process-wide and only grows: histograms are the `prometheus` crate's own
//! (an observation is a few atomic adds), and the counters are atomics indexed by the
//! taxonomy's enums, so recording takes no lock and allocates nothing. Time is read here, in
//! the shell: the transport driver only calls its [`TransferObserver`] at the moments that
//! matter ([`TransferClock`] is the transport actor's observer).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::LazyLock;
use std::time::{Duration, Instant};

use prometheus::core::{Collector, Metric};
use prometheus::proto::MetricFamily;
use prometheus::{Histogram, HistogramOpts};

use kvhandoff_protocol::driver::TransferObserver;
use kvhandoff_protocol::machine::{FreeProof, ReadProof};
use kvhandoff_protocol::transport::TransportError;
use kvhandoff_protocol::WriteId;

use super::taxonomy::FailureCause;
use crate::system::RejectReason;

/// vLLM's `nixl_xfer_time_seconds` buckets (seconds), so that its dashboards read ours.
pub const XFER_TIME_BUCKETS: [f64; 12] = [
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0,
];
/// vLLM's `nixl_post_time_seconds` buckets: a post is usually well under a millisecond.
pub const POST_TIME_BUCKETS: [f64; 13] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0,
];
/// vLLM's `nixl_bytes_transferred` buckets: 2^11 (2 KiB) to 2^33 (8 GiB), every factor 4.
pub const BYTES_BUCKETS: [f64; 12] = [
    2048.0,
    8192.0,
    32768.0,
    131072.0,
    524288.0,
    2097152.0,
    8388608.0,
    33554432.0,
    134217728.0,
    536870912.0,
    2147483648.0,
    8589934592.0,
];
/// vLLM's `nixl_num_descriptors` buckets.
pub const DESCRIPTOR_BUCKETS: [f64; 14] = [
    10.0, 20.0, 30.0, 50.0, 75.0, 100.0, 200.0, 400.0, 1000.0, 2000.0, 4000.0, 10000.0, 20000.0,
    50000.0,
];
/// Handshake buckets (seconds): a loopback handshake takes about a millisecond, one across
/// hosts a few; the side channel's own timeouts are 5 s.
pub const HANDSHAKE_TIME_BUCKETS: [f64; 12] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
];

/// Transfers whose post time the clock remembers at once, at most (a bound on its table, far
/// above the endpoint's own bounds on transfers in flight): one beyond it is not timed.
const MAX_TIMED: usize = 1 << 16;
/// An entry older than this when the table is full is dropped: its transfer's end was never
/// reported (a transport that forgets an invalidated peer's transfers), and every transfer
/// ends or is abandoned long before (`max_write_life` is seconds).
const STALE: Duration = Duration::from_secs(600);

struct Histograms {
    xfer_time: Histogram,
    post_time: Histogram,
    bytes: Histogram,
    descriptors: Histogram,
    handshake_time: Histogram,
}

fn histogram(name: &str, help: &str, buckets: &[f64]) -> prometheus::Result<Histogram> {
    Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets.to_vec()))
}

impl Histograms {
    fn new() -> prometheus::Result<Histograms> {
        Ok(Histograms {
            xfer_time: histogram(
                "kvhandoff_xfer_time_seconds",
                "Time from the start of each transfer's post call to its completion (the post \
                 included), for transfers that completed (vllm:nixl_xfer_time_seconds).",
                &XFER_TIME_BUCKETS,
            )?,
            post_time: histogram(
                "kvhandoff_post_time_seconds",
                "Time spent in the transport's post call of each transfer that was posted \
                 (vllm:nixl_post_time_seconds).",
                &POST_TIME_BUCKETS,
            )?,
            bytes: histogram(
                "kvhandoff_bytes_transferred",
                "Bytes of each completed transfer (vllm:nixl_bytes_transferred).",
                &BYTES_BUCKETS,
            )?,
            descriptors: histogram(
                "kvhandoff_num_descriptors",
                "Descriptors of each completed transfer (vllm:nixl_num_descriptors).",
                &DESCRIPTOR_BUCKETS,
            )?,
            handshake_time: histogram(
                "kvhandoff_handshake_time_seconds",
                "Time of each completed side-channel handshake: connect to the peer loaded \
                 (initiator), connection accepted to answer written (listener).",
                &HANDSHAKE_TIME_BUCKETS,
            )?,
        })
    }

    fn all(&self) -> [&Histogram; 5] {
        [
            &self.xfer_time,
            &self.post_time,
            &self.bytes,
            &self.descriptors,
            &self.handshake_time,
        ]
    }
}

/// The options are fixed and valid, so this is never `None` (a test says so); were it, nothing
/// would be recorded rather than the process failing.
static HISTOGRAMS: LazyLock<Option<Histograms>> = LazyLock::new(|| Histograms::new().ok());

/// `N` counters at 0.
const fn zeros<const N: usize>() -> [AtomicU64; N] {
    [const { AtomicU64::new(0) }; N]
}

static FAILED_TRANSFERS: [AtomicU64; FailureCause::ALL.len()] = zeros();
static FAILED_NOTIFICATIONS: [AtomicU64; FailureCause::ALL.len()] = zeros();
static REJECTIONS: [AtomicU64; RejectReason::ALL.len()] = zeros();
static DECODE_FAILED_BY_PROOF: [AtomicU64; FREE_PROOFS.len()] = zeros();
static EXPORT_SENT_BY_PROOF: [AtomicU64; READ_PROOFS.len()] = zeros();
static EXPORT_RELEASED_BY_PROOF: [AtomicU64; READ_PROOFS.len()] = zeros();

/// Every [`FreeProof`], in the order of its counters.
pub(crate) const FREE_PROOFS: [FreeProof; 6] = [
    FreeProof::NeverExposed,
    FreeProof::WritesCompleted,
    FreeProof::CancelAcknowledged,
    FreeProof::PeerQuiesced,
    FreeProof::DeadPeerFence,
    FreeProof::Quarantine,
];

/// Every [`ReadProof`], in the order of its counters.
pub(crate) const READ_PROOFS: [ReadProof; 3] = [
    ReadProof::NeverGranted,
    ReadProof::ReaderReleased,
    ReadProof::GrantFence,
];

/// The `proof` label of a D request's hand-back.
pub const fn free_proof_label(proof: FreeProof) -> &'static str {
    match proof {
        FreeProof::NeverExposed => "never_exposed",
        FreeProof::WritesCompleted => "writes_completed",
        FreeProof::CancelAcknowledged => "cancel_acknowledged",
        FreeProof::PeerQuiesced => "peer_quiesced",
        FreeProof::DeadPeerFence => "dead_peer_fence",
        FreeProof::Quarantine => "quarantine",
    }
}

/// The `proof` label of an export's hand-back.
pub const fn read_proof_label(proof: ReadProof) -> &'static str {
    match proof {
        ReadProof::NeverGranted => "never_granted",
        ReadProof::ReaderReleased => "reader_released",
        ReadProof::GrantFence => "grant_fence",
    }
}

fn add(a: &AtomicU64, n: u64) {
    a.fetch_add(n, Ordering::Relaxed);
}

fn read(a: &AtomicU64) -> u64 {
    a.load(Ordering::Relaxed)
}

/// Counts one transfer that failed, for `cause`.
pub(crate) fn count_failed_transfer(cause: FailureCause) {
    add(&FAILED_TRANSFERS[cause.index()], 1);
}

/// Counts a D request that failed, handed back under `proof`.
pub(crate) fn count_decode_failed(proof: FreeProof) {
    // `FREE_PROOFS` lists every variant, so the position is always found.
    if let Some(i) = FREE_PROOFS.iter().position(|p| *p == proof) {
        add(&DECODE_FAILED_BY_PROOF[i], 1);
    }
}

/// Counts an export that ended (`read`: its reader read it), handed back under `proof`.
pub(crate) fn count_export_end(read_it: bool, proof: ReadProof) {
    let counters = if read_it {
        &EXPORT_SENT_BY_PROOF
    } else {
        &EXPORT_RELEASED_BY_PROOF
    };
    if let Some(i) = READ_PROOFS.iter().position(|p| *p == proof) {
        add(&counters[i], 1);
    }
}

/// Counts one side-channel connection the listener rejected.
pub(crate) fn count_rejection(reason: RejectReason) {
    if let Some(i) = RejectReason::ALL.iter().position(|r| *r == reason) {
        add(&REJECTIONS[i], 1);
    }
}

/// Records one completed side-channel handshake that took `took`.
pub(crate) fn observe_handshake(took: Duration) {
    if let Some(h) = HISTOGRAMS.as_ref() {
        h.handshake_time.observe(took.as_secs_f64());
    }
}

/// The transport actor's [`TransferObserver`]: times each transfer's post call and its post to
/// completion, and records the completed ones' bytes and descriptors.
#[derive(Debug)]
pub(crate) struct TransferClock {
    posting: Option<Instant>,
    /// Transfers posted and not ended: when their post call started, bytes, descriptors.
    in_flight: HashMap<WriteId, (Instant, u64, usize)>,
}

impl TransferClock {
    pub(crate) fn new() -> TransferClock {
        TransferClock {
            posting: None,
            // Sized once for a busy rank's transfers in flight: no allocation per transfer.
            in_flight: HashMap::with_capacity(1024),
        }
    }
}

impl TransferObserver for TransferClock {
    fn posting(&mut self) {
        self.posting = Some(Instant::now());
    }

    fn posted(&mut self, id: WriteId, descriptors: usize, bytes: u64) {
        let now = Instant::now();
        // As NIXL's telemetry, which vLLM reads: a transfer's time runs from the start of its
        // post call, so it includes the post.
        let start = self.posting.take().unwrap_or(now);
        if let Some(h) = HISTOGRAMS.as_ref() {
            h.post_time.observe(now.duration_since(start).as_secs_f64());
        }
        if self.in_flight.len() >= MAX_TIMED {
            // Only when full, so the sweep's cost is spread over 64 Ki transfers.
            self.in_flight
                .retain(|_, (posted, _, _)| now.duration_since(*posted) < STALE);
        }
        if self.in_flight.len() < MAX_TIMED {
            self.in_flight.insert(id, (start, bytes, descriptors));
        }
    }

    fn ended(&mut self, id: WriteId, ok: bool) {
        let Some((posted, bytes, descriptors)) = self.in_flight.remove(&id) else {
            return;
        };
        // As vLLM: only completed transfers are observed; a failed one is counted by cause
        // where its request ends.
        if let (true, Some(h)) = (ok, HISTOGRAMS.as_ref()) {
            h.xfer_time.observe(posted.elapsed().as_secs_f64());
            h.bytes.observe(bytes as f64);
            h.descriptors.observe(descriptors as f64);
        }
    }

    fn notification_failed(&mut self, error: &TransportError) {
        let cause = FailureCause::of_transport(error);
        add(&FAILED_NOTIFICATIONS[cause.index()], 1);
        // vLLM's num_failed_transfers includes the failed notifications.
        count_failed_transfer(cause);
    }
}

/// One histogram's figures at one moment.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HistogramSnapshot {
    /// Observations.
    pub count: u64,
    /// Sum of the observed values.
    pub sum: f64,
    /// Cumulative counts by upper bound (the `+Inf` bucket is `count`).
    pub buckets: Vec<(f64, u64)>,
}

impl HistogramSnapshot {
    fn of(h: &Histogram) -> HistogramSnapshot {
        let metric = h.metric();
        let proto = metric.get_histogram();
        HistogramSnapshot {
            count: proto.get_sample_count(),
            sum: proto.get_sample_sum(),
            buckets: proto
                .get_bucket()
                .iter()
                .map(|b| (b.upper_bound(), b.cumulative_count()))
                .collect(),
        }
    }
}

/// The process's per-transfer figures, failures by cause, request ends by proof and side
/// channel figures at one moment ([`transfer_snapshot`]). Every figure only grows.
///
/// ```
/// let m = kvhandoff_actors::metrics::transfer_snapshot();
/// assert_eq!(m.xfer_time_seconds.buckets.len(), 12);
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TransferMetrics {
    /// Post to completion of each completed transfer, seconds.
    pub xfer_time_seconds: HistogramSnapshot,
    /// The transport's post call of each posted transfer, seconds.
    pub post_time_seconds: HistogramSnapshot,
    /// Bytes of each completed transfer.
    pub bytes_transferred: HistogramSnapshot,
    /// Descriptors of each completed transfer.
    pub num_descriptors: HistogramSnapshot,
    /// Each completed side-channel handshake, seconds.
    pub handshake_time_seconds: HistogramSnapshot,
    /// Failed transfers by cause (failed notifications included, as vLLM counts them); every
    /// cause is present.
    pub failed_transfers: BTreeMap<FailureCause, u64>,
    /// Notifications that could not be sent, by cause; every cause is present.
    pub failed_notifications: BTreeMap<FailureCause, u64>,
    /// Side-channel connections the listener rejected, by reason; every reason is present.
    pub side_channel_rejections: BTreeMap<RejectReason, u64>,
    /// D requests that failed, by what made it safe to hand their blocks back.
    pub decode_failed_by_proof: BTreeMap<FreeProof, u64>,
    /// Exports their reader read, by what made it safe to hand the blocks back.
    pub export_sent_by_proof: BTreeMap<ReadProof, u64>,
    /// Exports released unread, by what made it safe to hand the blocks back.
    pub export_released_by_proof: BTreeMap<ReadProof, u64>,
}

/// The process's per-transfer figures now (see [`TransferMetrics`]).
pub fn transfer_snapshot() -> TransferMetrics {
    let mut m = TransferMetrics::default();
    if let Some(h) = HISTOGRAMS.as_ref() {
        m.xfer_time_seconds = HistogramSnapshot::of(&h.xfer_time);
        m.post_time_seconds = HistogramSnapshot::of(&h.post_time);
        m.bytes_transferred = HistogramSnapshot::of(&h.bytes);
        m.num_descriptors = HistogramSnapshot::of(&h.descriptors);
        m.handshake_time_seconds = HistogramSnapshot::of(&h.handshake_time);
    }
    for cause in FailureCause::ALL {
        m.failed_transfers
            .insert(cause, read(&FAILED_TRANSFERS[cause.index()]));
        m.failed_notifications
            .insert(cause, read(&FAILED_NOTIFICATIONS[cause.index()]));
    }
    for (reason, n) in RejectReason::ALL.iter().zip(&REJECTIONS) {
        m.side_channel_rejections.insert(*reason, read(n));
    }
    for (proof, n) in FREE_PROOFS.iter().zip(&DECODE_FAILED_BY_PROOF) {
        m.decode_failed_by_proof.insert(*proof, read(n));
    }
    for (i, proof) in READ_PROOFS.iter().enumerate() {
        m.export_sent_by_proof
            .insert(*proof, read(&EXPORT_SENT_BY_PROOF[i]));
        m.export_released_by_proof
            .insert(*proof, read(&EXPORT_RELEASED_BY_PROOF[i]));
    }
    m
}

/// The histograms' families, for the collector.
pub(crate) fn histogram_families() -> Vec<MetricFamily> {
    HISTOGRAMS
        .as_ref()
        .map(|h| h.all().iter().flat_map(|h| h.collect()).collect())
        .unwrap_or_default()
}

/// The histograms' descriptions, for the collector's `desc`.
pub(crate) fn histogram_descs() -> Vec<prometheus::core::Desc> {
    HISTOGRAMS
        .as_ref()
        .map(|h| {
            h.all()
                .iter()
                .flat_map(|h| h.desc().into_iter().cloned().collect::<Vec<_>>())
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_histograms_are_built() {
        assert!(HISTOGRAMS.is_some());
        assert_eq!(histogram_families().len(), 5);
    }

    #[test]
    fn a_completed_transfer_is_timed_and_sized_and_a_failed_one_is_not() {
        let mut clock = TransferClock::new();
        let before = transfer_snapshot();
        clock.posting();
        clock.posted(WriteId(7), 3, 4096);
        clock.posting();
        // A size no other test moves: the failed transfer's bytes must not show.
        clock.posted(WriteId(8), 5, 1 << 40);
        clock.ended(WriteId(8), false);
        clock.ended(WriteId(7), true);
        // A second end, or one of a transfer never posted, is not observed again.
        clock.ended(WriteId(7), true);
        clock.ended(WriteId(9), true);
        let after = transfer_snapshot();
        // Other tests of this binary may observe at the same time: at least ours.
        assert!(after.post_time_seconds.count >= before.post_time_seconds.count + 2);
        assert!(after.xfer_time_seconds.count > before.xfer_time_seconds.count);
        assert!(after.bytes_transferred.sum >= before.bytes_transferred.sum + 4096.0);
        assert!(after.num_descriptors.sum >= before.num_descriptors.sum + 3.0);
        assert!(after.bytes_transferred.sum - before.bytes_transferred.sum < (1u64 << 40) as f64);
        assert!(clock.in_flight.is_empty());
    }

    #[test]
    fn a_full_table_drops_the_transfers_whose_end_never_came() {
        let mut clock = TransferClock::new();
        let Some(long_ago) = Instant::now().checked_sub(STALE * 2) else {
            return; // The machine has not been up that long: nothing can be that old.
        };
        for i in 0..MAX_TIMED as u64 {
            clock.in_flight.insert(WriteId(i), (long_ago, 1, 1));
        }
        clock.posting();
        clock.posted(WriteId(u64::MAX), 1, 1);
        assert_eq!(clock.in_flight.len(), 1, "the stale entries made room");
        assert!(clock.in_flight.contains_key(&WriteId(u64::MAX)));
    }

    #[test]
    fn a_transfers_time_includes_its_post() {
        let mut clock = TransferClock::new();
        clock.posting();
        std::thread::sleep(Duration::from_millis(20));
        clock.posted(WriteId(11), 1, 1);
        let (start, _, _) = clock.in_flight[&WriteId(11)];
        assert!(start.elapsed() >= Duration::from_millis(20));
    }

    #[test]
    fn a_failed_notification_counts_in_both_failure_families() {
        let before = transfer_snapshot();
        let mut clock = TransferClock::new();
        clock.notification_failed(&TransportError::TooManyPeers { limit: 1 });
        let after = transfer_snapshot();
        let cause = FailureCause::TransportError;
        assert!(after.failed_notifications[&cause] > before.failed_notifications[&cause]);
        assert!(after.failed_transfers[&cause] > before.failed_transfers[&cause]);
    }
}
