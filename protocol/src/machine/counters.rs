//! What an [`Endpoint`](super::Endpoint) counts besides outcomes: dropped inputs by reason,
//! and the events worth watching (resends, fences, stalls).

use std::collections::BTreeMap;

/// Why a message or completion from outside was ignored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DropReason {
    /// Bytes that did not decode.
    Malformed,
    /// A message from a peer that is not connected.
    UnknownPeer,
    /// A message about a key this side never saw.
    UnknownKey,
    /// A message about a key that ended recently (a late message).
    Late,
    /// A message for an older epoch than the one in force.
    StaleEpoch,
    /// A message for a newer epoch than the one in force.
    FutureEpoch,
    /// The same message again.
    Duplicate,
    /// A message that makes no sense in the request's state.
    Unexpected,
    /// A message this role does not handle (e.g. a handshake on the notification path).
    WrongPath,
    /// A completion for a write this endpoint does not know.
    UnknownWrite,
    /// A registration or request that did not fit its table.
    TableFull,
    /// A cancel, release or registration whose answer would write a record, for a key P holds
    /// nothing for, beyond the sender's budget of such records (or the peers' together).
    TombstoneBudget,
    /// A message that may be a late one of a restarted peer's previous incarnation: within
    /// `max_message_delay` of the restart, a registration of the restarted rank, or a message
    /// about a key whose record the old incarnation's attempt left.
    PriorIncarnation,
}

/// Counts of everything worth watching that is not an outcome.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counters {
    /// Dropped inputs, by reason.
    pub dropped: BTreeMap<DropReason, u64>,
    /// Cancels sent again because no answer came.
    pub cancel_resends: u64,
    /// Registrations sent again because no write had landed.
    pub register_resends: u64,
    /// Resends a stall of D carried past their time (by more than
    /// `Config::register_resend_grace`), not sent: a copy could outlive P's record of the key.
    pub register_resends_skipped: u64,
    /// Reads asked again after the holder said it exports nothing under the key, soon after
    /// the first ask (its export may not have been filed yet).
    pub reads_asked_again: u64,
    /// Cancels and releases for an attempt an older request of the key had settled, which
    /// reached a newer request of the key: ignored (a cancel is still acknowledged).
    pub stale_settles_ignored: u64,
    /// D blocks freed by quarantine alone (after a cancel).
    pub quarantine_frees: u64,
    /// D blocks freed by the fence after their P was declared dead or replaced.
    pub fence_frees: u64,
    /// D requests fenced by their P's death whose engine was told of the failure before the
    /// blocks came back ([`EndpointEvent::DecodeFenced`](super::EndpointEvent::DecodeFenced)).
    pub decodes_fenced: u64,
    /// Of those, D requests told because every resend of their cancel went unanswered while
    /// their P was not declared dead.
    pub cancels_unanswered: u64,
    /// P writes whose abandon the transport did not confirm in time: their source blocks stay
    /// held until the transport reports the write's end.
    pub stuck_writes: u64,
    /// Tombstones evicted at capacity before they expired (their keys' late messages then look
    /// new; see the safety story in docs/architecture.md).
    pub tombstones_evicted: u64,
    /// Heartbeats sent.
    pub heartbeats_sent: u64,
    /// Leases renewed by heartbeats.
    pub leases_renewed: u64,
    /// Peers declared dead (silence, loss, or a restart).
    pub peers_declared_dead: u64,
    /// Handshakes with another incarnation of a connected peer (restarts).
    pub peer_restarts: u64,
    /// Handshakes repeating the connected incarnation (late copies, second dials, replays):
    /// nothing changed.
    pub repeated_handshakes: u64,
    /// Writes posted.
    pub writes_posted: u64,
    /// Writes abandoned after their deadline or their peer's death.
    pub writes_abandoned: u64,
    /// Races seen: D's registration arrived before P finished.
    pub decode_registered_first: u64,
    /// Races seen: P finished before D's registration arrived.
    pub prefill_finished_first: u64,
    /// Reads granted to a reader (pull and bidirectional holders).
    pub reads_granted: u64,
    /// Reads refused because they could outlive the export (holders), or declined before
    /// asking for the same reason (readers).
    pub reads_declined_near_expiry: u64,
    /// Export leases renewed by a waiting reader's heartbeats.
    pub exports_renewed: u64,
    /// Exports freed by their grant's fence, without the reader's release.
    pub grant_fence_frees: u64,
    /// Reads posted (readers).
    pub reads_posted: u64,
    /// Reads that failed (readers).
    pub reads_failed: u64,
    /// Declines the engine made of an export this rank was reading, refused (the import's own
    /// end releases the holder).
    pub declines_refused_while_reading: u64,
    /// Messages refused because they came from a peer whose liveness deadline had passed
    /// before they were handled (this process was stalled with them queued): the peer was
    /// declared dead instead.
    pub stale_messages_refused: u64,
    /// Registrations and heartbeats that reached held blocks whose lease had ended before the
    /// timer ran: the blocks were released, nothing written.
    pub expired_leases_refused: u64,
    /// Grants that arrived later than a grant can travel after the ask: not read under.
    pub stale_grants_refused: u64,
    /// Reads reported done later than the fabric's bound on them: their bytes not trusted.
    pub late_reads_distrusted: u64,
    /// Reads abandoned because they were not reported by the fabric's bound on them (readers).
    pub reads_abandoned: u64,
    /// Times an import found its abandoned reads still not confirmed (its blocks stay held
    /// until the transport reports each read's end).
    pub stuck_reads: u64,
    /// Times this endpoint found its timers overdue by more than `Config::stall_allowance`:
    /// the process was stopped long enough that a write it had in flight may have landed
    /// after a peer's time-based fence (see the safety story in docs/architecture.md).
    pub stalls_past_allowance: u64,
    /// Peers declared dead that connected again with the same incarnation (a false death
    /// healed); the D requests they fenced asked them again for a proof.
    pub peers_rejoined: u64,
    /// Dials of a peer declared dead that still had D requests fenced by its death.
    pub fenced_peer_probes: u64,
    /// Writes whose landed bytes did not match P's integrity digests (D;
    /// `Config::integrity_digest`): their requests failed with
    /// `WriteFailed(DigestMismatch)`.
    pub digest_mismatches: u64,
}

impl Counters {
    /// How many inputs were dropped for `reason`.
    pub fn dropped(&self, reason: DropReason) -> u64 {
        self.dropped.get(&reason).copied().unwrap_or(0)
    }

    pub(crate) fn drop(&mut self, reason: DropReason) {
        *self.dropped.entry(reason).or_insert(0) += 1;
    }
}

/// What an [`Endpoint`](super::Endpoint) holds now, for gauges
/// ([`Endpoint::gauges`](super::Endpoint::gauges)): unlike [`Counters`], these go down.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Gauges {
    /// Logical blocks of D requests that gave up and wait for a proof that no write can still
    /// land, or for their quarantine or dead-peer fence to pass: blocks the engine cannot use.
    pub blocks_quarantined: u64,
    /// Peers whose handshake is in progress.
    pub peers_connecting: u64,
    /// Peers connected and heard from within their liveness deadline.
    pub peers_connected: u64,
    /// Peers declared dead and still remembered (so that their late messages are recognised).
    pub peers_dead: u64,
}
