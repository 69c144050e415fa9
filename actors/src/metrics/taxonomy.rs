//! One failure taxonomy for the failure counters
//! (`kvhandoff_num_failed_transfers_total{cause}`, `kvhandoff_num_failed_notifications_total{cause}`).
//!
//! The protocol has one failure type per place a transfer can end badly ([`WriteFailure`] on
//! the wire, [`DecodeFailure`] on D, [`ReleaseCause`] on P, [`ImportFailure`] and [`ExportEnd`]
//! on the read path) and the transport has its own errors ([`TransportError`]). Dashboards want
//! one `cause` label whatever the path, so every variant of those types maps here to one
//! [`FailureCause`], whose label is stable (snake_case, never renamed). The table is in
//! docs/operations.md; the unit tests below pin it.
//!
//! Ends that are not failures (a lease that expired with nobody reading, counted by
//! `kvhandoff_num_kv_expired_reqs_total` as vLLM does; blocks D said it did not need; nothing to
//! send) map to `None`.

use kvhandoff_protocol::machine::{DecodeFailure, ExportEnd, ImportFailure, ReleaseCause};
use kvhandoff_protocol::transport::TransportError;
use kvhandoff_protocol::{ReleaseReason, WriteFailure};

/// Why a transfer (or a notification) failed, across every path: the `cause` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[cfg_attr(test, derive(strum::EnumIter))]
pub enum FailureCause {
    /// The transport refused to post the transfer, or it could not be planned
    /// (`WriteFailure::PostFailed`).
    PostFailed,
    /// The transfer was posted and the transport reported it failed (a write, a read, or the
    /// reader's reads of an export).
    TransferFailed,
    /// A deadline passed: the transfer's, D's, or the reader's.
    TimedOut,
    /// The holder's lease ended before the transfer could run (seen by the side that waited).
    LeaseExpired,
    /// The peer died or was declared dead (or a read grant's fence passed without the
    /// reader's release).
    PeerDead,
    /// The handshake with the peer failed.
    HandshakeFailed,
    /// The two sides' blocks or geometry do not fit each other.
    Incompatible,
    /// This side's engine aborted the request.
    Aborted,
    /// The peer gave up on the request (D's cancel, a reader that gave up before reading).
    CancelledByPeer,
    /// The engine is shutting down.
    Shutdown,
    /// P holds nothing for the key any more.
    Unavailable,
    /// The holder refused the read.
    Refused,
    /// This process was stalled with the transfer's grant or completion queued: its bytes are
    /// not trusted.
    Stalled,
    /// A notification could not be sent because the peer's agent is unreachable.
    PeerUnreachable,
    /// A notification named a peer the transport does not know or has invalidated.
    PeerUnknown,
    /// Any other transport error.
    TransportError,
    /// The bytes that landed do not match the writer's integrity digests
    /// (`WriteFailure::DigestMismatch`, D's own verdict).
    DigestMismatch,
}

impl FailureCause {
    /// Every cause, in label order of the docs: each has its series from the first scrape.
    pub const ALL: [FailureCause; 17] = [
        FailureCause::PostFailed,
        FailureCause::TransferFailed,
        FailureCause::TimedOut,
        FailureCause::LeaseExpired,
        FailureCause::PeerDead,
        FailureCause::HandshakeFailed,
        FailureCause::Incompatible,
        FailureCause::Aborted,
        FailureCause::CancelledByPeer,
        FailureCause::Shutdown,
        FailureCause::Unavailable,
        FailureCause::Refused,
        FailureCause::Stalled,
        FailureCause::PeerUnreachable,
        FailureCause::PeerUnknown,
        FailureCause::TransportError,
        FailureCause::DigestMismatch,
    ];

    /// The stable `cause` label.
    pub const fn label(self) -> &'static str {
        match self {
            FailureCause::PostFailed => "post_failed",
            FailureCause::TransferFailed => "transfer_failed",
            FailureCause::TimedOut => "timed_out",
            FailureCause::LeaseExpired => "lease_expired",
            FailureCause::PeerDead => "peer_dead",
            FailureCause::HandshakeFailed => "handshake_failed",
            FailureCause::Incompatible => "incompatible",
            FailureCause::Aborted => "aborted",
            FailureCause::CancelledByPeer => "cancelled_by_peer",
            FailureCause::Shutdown => "shutdown",
            FailureCause::Unavailable => "unavailable",
            FailureCause::Refused => "refused",
            FailureCause::Stalled => "stalled",
            FailureCause::PeerUnreachable => "peer_unreachable",
            FailureCause::PeerUnknown => "peer_unknown",
            FailureCause::TransportError => "transport_error",
            FailureCause::DigestMismatch => "digest_mismatch",
        }
    }

    /// The index of the cause in [`FailureCause::ALL`] (the counters' array slot).
    pub(crate) const fn index(self) -> usize {
        self as usize
    }

    /// Why P's writes failed, as P reports it to D.
    pub const fn of_write(failure: WriteFailure) -> FailureCause {
        match failure {
            WriteFailure::PostFailed => FailureCause::PostFailed,
            WriteFailure::TransferFailed => FailureCause::TransferFailed,
            WriteFailure::TransferTimedOut | WriteFailure::RegistrationExpired => {
                FailureCause::TimedOut
            }
            WriteFailure::PrefillAborted => FailureCause::Aborted,
            WriteFailure::LeaseExpired => FailureCause::LeaseExpired,
            WriteFailure::PlanMismatch => FailureCause::Incompatible,
            WriteFailure::Unavailable => FailureCause::Unavailable,
            WriteFailure::DigestMismatch => FailureCause::DigestMismatch,
        }
    }

    /// Why a D request failed (its `Failed` event).
    pub const fn of_decode(failure: DecodeFailure) -> FailureCause {
        match failure {
            DecodeFailure::PeerDead => FailureCause::PeerDead,
            DecodeFailure::Deadline => FailureCause::TimedOut,
            DecodeFailure::WriteFailed(w) => FailureCause::of_write(w),
            DecodeFailure::Aborted => FailureCause::Aborted,
            DecodeFailure::Shutdown => FailureCause::Shutdown,
            DecodeFailure::HandshakeFailed => FailureCause::HandshakeFailed,
            DecodeFailure::Incompatible => FailureCause::Incompatible,
        }
    }

    /// Why P (or a holder) let its blocks go unsent (its `BlocksFree` with a cause); `None`
    /// when that is not a failure: the lease ended with nobody asking (an expiry, counted
    /// apart), the reader did not need the blocks or read them, or there were none.
    pub const fn of_release(cause: ReleaseCause) -> Option<FailureCause> {
        match cause {
            ReleaseCause::LeaseExpired
            | ReleaseCause::Empty
            | ReleaseCause::ReleasedByPeer(
                ReleaseReason::FullPrefixHit | ReleaseReason::ReadDone | ReleaseReason::Declined,
            ) => None,
            ReleaseCause::ReleasedByPeer(ReleaseReason::Aborted)
            | ReleaseCause::CancelledByPeer => Some(FailureCause::CancelledByPeer),
            ReleaseCause::ReleasedByPeer(ReleaseReason::ReadFailed) => {
                Some(FailureCause::TransferFailed)
            }
            ReleaseCause::Aborted => Some(FailureCause::Aborted),
            ReleaseCause::PeerDead => Some(FailureCause::PeerDead),
            ReleaseCause::WriteFailed(w) => Some(FailureCause::of_write(w)),
            ReleaseCause::Rejected => Some(FailureCause::Incompatible),
        }
    }

    /// Why a reader's import did not load (all of it).
    pub const fn of_import(failure: ImportFailure) -> FailureCause {
        match failure {
            ImportFailure::Refused(_) => FailureCause::Refused,
            ImportFailure::DeclinedNearExpiry => FailureCause::LeaseExpired,
            ImportFailure::ReadFailed => FailureCause::TransferFailed,
            ImportFailure::PeerDead => FailureCause::PeerDead,
            ImportFailure::Deadline => FailureCause::TimedOut,
            ImportFailure::Aborted => FailureCause::Aborted,
            ImportFailure::Shutdown => FailureCause::Shutdown,
            ImportFailure::HandshakeFailed => FailureCause::HandshakeFailed,
            ImportFailure::PlanMismatch => FailureCause::Incompatible,
            ImportFailure::StaleGrant | ImportFailure::LateRead => FailureCause::Stalled,
        }
    }

    /// Why a holder's export ended unread; `None` when that is not a failure (an expiry, a
    /// decline, a full prefix hit, nothing exported).
    pub const fn of_export(end: ExportEnd) -> Option<FailureCause> {
        match end {
            ExportEnd::LeaseExpired
            | ExportEnd::Declined
            | ExportEnd::FullPrefixHit
            | ExportEnd::Empty => None,
            ExportEnd::ReaderFailed => Some(FailureCause::TransferFailed),
            ExportEnd::ReaderAborted => Some(FailureCause::CancelledByPeer),
            ExportEnd::Aborted => Some(FailureCause::Aborted),
            ExportEnd::GrantFenced => Some(FailureCause::PeerDead),
        }
    }

    /// Why the transport refused to send a notification.
    pub fn of_transport(error: &TransportError) -> FailureCause {
        match error {
            TransportError::PeerUnreachable { .. } => FailureCause::PeerUnreachable,
            TransportError::UnknownPeer { .. } | TransportError::PeerInvalidated { .. } => {
                FailureCause::PeerUnknown
            }
            _ => FailureCause::TransportError,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvhandoff_protocol::ReadRefusal;
    use std::collections::BTreeSet;

    /// `ALL` (the series present from the first scrape) is kept by hand: every variant in it.
    #[test]
    fn all_holds_every_cause() {
        use strum::IntoEnumIterator;
        let every: BTreeSet<FailureCause> = FailureCause::iter().collect();
        let listed: BTreeSet<FailureCause> = FailureCause::ALL.into_iter().collect();
        assert_eq!(listed, every);
    }

    #[test]
    fn every_cause_has_its_own_snake_case_label_at_its_index() {
        let labels: BTreeSet<&str> = FailureCause::ALL.iter().map(|c| c.label()).collect();
        assert_eq!(labels.len(), FailureCause::ALL.len(), "labels must differ");
        for (i, cause) in FailureCause::ALL.iter().enumerate() {
            assert_eq!(cause.index(), i, "{cause:?}");
            let label = cause.label();
            assert!(
                label
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c == '_' || c.is_ascii_digit()),
                "{label}"
            );
        }
    }

    /// The mapping table of docs/operations.md, pinned: a change here is a change of the
    /// metric's meaning and must change the docs too.
    #[test]
    fn the_mapping_is_the_documented_table() {
        use FailureCause as C;
        let writes = [
            (WriteFailure::PostFailed, C::PostFailed),
            (WriteFailure::TransferFailed, C::TransferFailed),
            (WriteFailure::TransferTimedOut, C::TimedOut),
            (WriteFailure::PrefillAborted, C::Aborted),
            (WriteFailure::LeaseExpired, C::LeaseExpired),
            (WriteFailure::PlanMismatch, C::Incompatible),
            (WriteFailure::Unavailable, C::Unavailable),
            (WriteFailure::RegistrationExpired, C::TimedOut),
            (WriteFailure::DigestMismatch, C::DigestMismatch),
        ];
        for (w, c) in writes {
            assert_eq!(C::of_write(w), c, "{w:?}");
            assert_eq!(C::of_decode(DecodeFailure::WriteFailed(w)), c, "{w:?}");
            assert_eq!(
                C::of_release(ReleaseCause::WriteFailed(w)),
                Some(c),
                "{w:?}"
            );
        }
        let decodes = [
            (DecodeFailure::PeerDead, C::PeerDead),
            (DecodeFailure::Deadline, C::TimedOut),
            (DecodeFailure::Aborted, C::Aborted),
            (DecodeFailure::Shutdown, C::Shutdown),
            (DecodeFailure::HandshakeFailed, C::HandshakeFailed),
            (DecodeFailure::Incompatible, C::Incompatible),
        ];
        for (d, c) in decodes {
            assert_eq!(C::of_decode(d), c, "{d:?}");
        }
        let releases = [
            (ReleaseCause::LeaseExpired, None),
            (ReleaseCause::CancelledByPeer, Some(C::CancelledByPeer)),
            (
                ReleaseCause::ReleasedByPeer(ReleaseReason::FullPrefixHit),
                None,
            ),
            (ReleaseCause::ReleasedByPeer(ReleaseReason::ReadDone), None),
            (ReleaseCause::ReleasedByPeer(ReleaseReason::Declined), None),
            (
                ReleaseCause::ReleasedByPeer(ReleaseReason::Aborted),
                Some(C::CancelledByPeer),
            ),
            (
                ReleaseCause::ReleasedByPeer(ReleaseReason::ReadFailed),
                Some(C::TransferFailed),
            ),
            (ReleaseCause::Aborted, Some(C::Aborted)),
            (ReleaseCause::PeerDead, Some(C::PeerDead)),
            (ReleaseCause::Rejected, Some(C::Incompatible)),
            (ReleaseCause::Empty, None),
        ];
        for (r, c) in releases {
            assert_eq!(C::of_release(r), c, "{r:?}");
        }
        let imports = [
            (ImportFailure::Refused(ReadRefusal::Busy), C::Refused),
            (ImportFailure::DeclinedNearExpiry, C::LeaseExpired),
            (ImportFailure::ReadFailed, C::TransferFailed),
            (ImportFailure::PeerDead, C::PeerDead),
            (ImportFailure::Deadline, C::TimedOut),
            (ImportFailure::Aborted, C::Aborted),
            (ImportFailure::Shutdown, C::Shutdown),
            (ImportFailure::HandshakeFailed, C::HandshakeFailed),
            (ImportFailure::PlanMismatch, C::Incompatible),
            (ImportFailure::StaleGrant, C::Stalled),
            (ImportFailure::LateRead, C::Stalled),
        ];
        for (i, c) in imports {
            assert_eq!(C::of_import(i), c, "{i:?}");
        }
        let exports = [
            (ExportEnd::LeaseExpired, None),
            (ExportEnd::Declined, None),
            (ExportEnd::FullPrefixHit, None),
            (ExportEnd::ReaderFailed, Some(C::TransferFailed)),
            (ExportEnd::ReaderAborted, Some(C::CancelledByPeer)),
            (ExportEnd::Aborted, Some(C::Aborted)),
            (ExportEnd::GrantFenced, Some(C::PeerDead)),
            (ExportEnd::Empty, None),
        ];
        for (e, c) in exports {
            assert_eq!(C::of_export(e), c, "{e:?}");
        }
    }
}
