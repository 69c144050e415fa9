//! The knobs of a [`MemFabric`](super::MemFabric): its bounds, an agent's fault switches, and
//! what an agent counts.

use std::time::Duration;

use kvhandoff_protocol::MAX_REGIONS;

use crate::transport::MAX_NOTIFICATION_LEN;
#[cfg(doc)]
use {
    super::MemFabric,
    crate::transport::{Transport, TransportError},
    std::time::Instant,
};

/// Bounds of a [`MemFabric`]; every queue and table is bounded by one of these.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemLimits {
    /// Most transfers pending per agent (posted and not yet reported).
    pub max_in_flight: usize,
    /// Most descriptors per transfer.
    pub max_descriptors: usize,
    /// Most bytes per notification.
    pub max_notification_len: usize,
    /// Most notifications queued per receiving agent.
    pub max_inbox: usize,
    /// Most notification bytes queued per receiving agent.
    pub max_inbox_bytes: usize,
    /// Most peers loaded per agent (invalidated peers are remembered up to the same number).
    pub max_peers: usize,
    /// Most regions registered per agent.
    pub max_regions: usize,
    /// Most bytes of region memory on the whole fabric.
    pub max_fabric_bytes: u64,
}

impl Default for MemLimits {
    fn default() -> Self {
        Self {
            max_in_flight: 1024,
            max_descriptors: 1 << 16,
            max_notification_len: MAX_NOTIFICATION_LEN,
            max_inbox: 4096,
            max_inbox_bytes: 64 << 20,
            max_peers: 1024,
            max_regions: MAX_REGIONS,
            max_fabric_bytes: 1 << 30,
        }
    }
}

/// Per-agent fault switches and latency settings. The default is a healthy agent whose transfers
/// land on the first poll after posting.
///
/// Switches about transfers apply to the agent's own posts (it is the initiator). A post takes at
/// most one of `fail_next_transfers`, `partial_next_transfers`, `hang_next_transfers` and
/// `corrupt_next_transfers`, in that order of precedence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemFaults {
    /// A transfer lands during this many-th `poll_completions` after its post; 0 lands it inside
    /// the post (like NIXL completing a small transfer immediately). Read at post time, so
    /// raising it delays the transfers posted afterwards ("delay landing by K polls": 1 + K).
    pub land_after_polls: u32,
    /// A transfer also waits this long after its post (measured with [`Instant`]). Zero (the
    /// default) never reads the clock.
    pub land_after: Duration,
    /// The next this-many posts return [`TransportError::PostFailed`]; nothing is posted.
    pub fail_next_posts: u32,
    /// The next this-many posted transfers complete with [`TransportError::TransferFailed`]
    /// when due; no byte lands and no notification is delivered.
    pub fail_next_transfers: u32,
    /// The next this-many posted transfers land only the first half of their bytes (in
    /// descriptor order), then complete with [`TransportError::TransferFailed`]; no notification.
    pub partial_next_transfers: u32,
    /// The next this-many posted transfers never land: they stay pending until abandoned or
    /// their peer is invalidated.
    pub hang_next_transfers: u32,
    /// The next this-many posted transfers land with one byte wrong (every bit of the middle
    /// byte of their first descriptor flipped at the destination), then complete `Ok` and
    /// deliver their notification: corruption in flight that only an integrity check
    /// (`Config::integrity_digest`) can notice. Taken after the three above.
    pub corrupt_next_transfers: u32,
    /// While set, nothing this agent posted lands (pending transfers resume when cleared).
    pub stall: bool,
    /// The next this-many notifications this agent sends (standalone, or attached to its
    /// transfers) are silently lost; the transfers themselves still land and complete `Ok`.
    pub drop_next_notifications: u32,
    /// A landed transfer's completion is reported this many polls after the landing, leaving a
    /// window in which the data (and notification) arrived but the initiator does not know yet.
    pub completion_lag_polls: u32,
    /// While set, [`Transport::abandon_write`] on a transfer that has not landed returns
    /// [`TransportError::AbandonRefused`] (as a NIXL transport must for in-flight RDMA).
    pub refuse_abandon: bool,
}

impl Default for MemFaults {
    fn default() -> Self {
        Self {
            land_after_polls: 1,
            land_after: Duration::ZERO,
            fail_next_posts: 0,
            fail_next_transfers: 0,
            partial_next_transfers: 0,
            hang_next_transfers: 0,
            corrupt_next_transfers: 0,
            stall: false,
            drop_next_notifications: 0,
            completion_lag_polls: 0,
            refuse_abandon: false,
        }
    }
}

/// Counters of one agent (writes and reads are both "transfers").
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MemStats {
    /// Calls of `poll_completions`.
    pub polls: u64,
    /// Transfers posted.
    pub posted: u64,
    /// Posts refused (by a check or an injected fault).
    pub post_errors: u64,
    /// Transfers whose every byte landed.
    pub landed: u64,
    /// Transfers that completed with a transfer failure (injected, partial, unreachable peer).
    pub failed: u64,
    /// Transfers abandoned before landing.
    pub abandoned: u64,
    /// Transfers failed by invalidating their peer.
    pub invalidated: u64,
    /// Bytes copied by this agent's transfers, partial ones included.
    pub bytes_landed: u64,
    /// Completions reported.
    pub completions: u64,
    /// Notifications this agent put in a peer's queue (standalone and attached).
    pub notifications_sent: u64,
    /// Notifications this agent sent that the drop fault lost.
    pub notifications_dropped: u64,
    /// `send_notification` calls refused.
    pub notification_errors: u64,
    /// Notifications put in this agent's queue.
    pub notifications_received: u64,
}
