//! Values that go into and come out of an [`Endpoint`](super::Endpoint).

use std::collections::BTreeMap;
use std::fmt;
use std::ops::{Add, Sub};
use std::time::Duration;

use crate::{
    BlockIds, Epoch, Incarnation, Message, PairingKey, ReleaseReason, RequestId, WireError,
    WriteFailure,
};

use crate::{PeerAddr, WriteId};

/// A point in time, in nanoseconds since an origin chosen by whoever drives the machines.
///
/// The machines never read a clock: every call takes the current `Time`, so a simulator can run
/// them on virtual time and a test can step time by hand.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Time(u64);

impl Time {
    /// The origin.
    pub const ZERO: Time = Time(0);

    /// `nanos` nanoseconds after the origin.
    pub const fn from_nanos(nanos: u64) -> Time {
        Time(nanos)
    }

    /// The time `elapsed` after the origin (saturating at the far future).
    pub fn from_duration(elapsed: Duration) -> Time {
        Time(u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX))
    }

    /// Nanoseconds since the origin.
    pub const fn as_nanos(self) -> u64 {
        self.0
    }

    /// Time since the origin.
    pub fn since_origin(self) -> Duration {
        Duration::from_nanos(self.0)
    }

    /// How long after `earlier` this is (zero if it is not later).
    pub fn saturating_since(self, earlier: Time) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}

impl Add<Duration> for Time {
    type Output = Time;
    fn add(self, rhs: Duration) -> Time {
        let nanos = u64::try_from(rhs.as_nanos()).unwrap_or(u64::MAX);
        Time(self.0.saturating_add(nanos))
    }
}

impl Sub<Time> for Time {
    type Output = Duration;
    fn sub(self, rhs: Time) -> Duration {
        self.saturating_since(rhs)
    }
}

impl fmt::Display for Time {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:.6}s", self.0 as f64 / 1e9)
    }
}

/// D's engine allocated blocks for a request whose prefill runs on a remote P.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeStart {
    /// D's own id of the request.
    pub request: RequestId,
    /// The pairing key shared with P.
    pub key: PairingKey,
    /// The attempt (from the router's transfer parameters, or [`Epoch::FIRST`]).
    pub epoch: Epoch,
    /// The P rank that writes this rank's blocks.
    pub prefill: PeerAddr,
    /// D's newly allocated logical blocks, one list per cache group. All empty means D already
    /// holds every token (a full prefix-cache hit): P is told to release at once.
    pub blocks: BlockIds,
    /// Tokens D expects to receive.
    pub num_tokens: u64,
    /// Writes that must land before D is ready (from the TP plan; 1 for equal TP).
    pub expected_writes: u32,
}

/// P's engine finished a prefill and hands its blocks over for sending.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefillStart {
    /// P's own id of the request.
    pub request: RequestId,
    /// The pairing key shared with D.
    pub key: PairingKey,
    /// P's logical blocks holding the prompt's KV, one list per cache group. All empty means
    /// there is nothing to send: the request ends at once.
    pub blocks: BlockIds,
}

/// Why a peer connection could not be made.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ConnectFailure {
    /// The handshake did not finish before its deadline.
    TimedOut,
    /// The peer's geometry or compatibility hash does not match ours.
    Incompatible,
    /// The side channel or transport refused (the text says how).
    Refused(String),
    /// Too many peers are known already.
    TooManyPeers,
}

/// A call from the local engine into its rank's [`Endpoint`](super::Endpoint), through
/// [`Endpoint::handle_call`](super::Endpoint::handle_call). Calls can be refused
/// ([`Rejected`]); a refused call changed nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineCall {
    /// D: blocks allocated for a remote prefill.
    DecodeAllocated(DecodeStart),
    /// P: prefill finished; blocks to send.
    PrefillFinished(PrefillStart),
    /// The engine is shutting down: every D request gives up (registered ones cancel with
    /// `CancelReason::Shutdown` and still wait for their proof), every P request is aborted
    /// (writes in flight drain first), and new requests are refused.
    Shutdown,
    /// Either side: the engine aborted the request.
    Abort {
        /// The engine's request id.
        request: RequestId,
    },
    /// Pull holder (P) or bidirectional holder (D between turns): export blocks for a remote
    /// reader.
    Export(super::read_types::ExportStart),
    /// Pull reader (D) or bidirectional reader (P on a later turn): read a remote export into
    /// allocated blocks.
    Import(super::read_types::ImportStart),
    /// The engine will not read the export of `key` (it recomputes instead, or the saving is
    /// below its threshold): the holder may let go of its blocks now.
    DeclineExport {
        /// The export's pairing key.
        key: PairingKey,
        /// The reader's attempt.
        epoch: Epoch,
        /// The rank that exports.
        holder: PeerAddr,
    },
}

/// What the network and the transport report to an [`Endpoint`](super::Endpoint), through
/// [`Endpoint::handle_event`](super::Endpoint::handle_event). Events are never refused: what
/// cannot be used is counted in [`Counters::dropped`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NetEvent {
    /// A decoded message from a peer.
    Received {
        /// Who sent it.
        from: PeerAddr,
        /// The message.
        message: Message,
    },
    /// Bytes from a peer that did not decode; counted and dropped.
    Malformed {
        /// Who sent them, if known.
        from: Option<PeerAddr>,
        /// Why they did not decode.
        error: WireError,
    },
    /// The handshake with a peer finished (whichever side started it). For a peer that is
    /// connected to `incarnation` already ([`Endpoint::connected_incarnation`](super::Endpoint::connected_incarnation)), it is a repeated
    /// handshake: the shell must not reload the peer, and the endpoint changes nothing but the
    /// peer's liveness. Otherwise the shell has loaded the peer in the transport first; for a
    /// peer connected to another incarnation that load replaced the old one (a restart), and the
    /// endpoint fails everything bound to the old incarnation, fencing its blocks.
    PeerConnected {
        /// The peer.
        peer: PeerAddr,
        /// The peer's process run, from its handshake.
        incarnation: Incarnation,
    },
    /// A handshake this endpoint asked for failed.
    PeerConnectFailed {
        /// The peer.
        peer: PeerAddr,
        /// Why.
        reason: ConnectFailure,
    },
    /// The side channel or transport saw the peer go away.
    PeerLost {
        /// The peer.
        peer: PeerAddr,
    },
    /// A posted write finished and its notification was handed to the fabric.
    WriteCompleted {
        /// The write.
        write: WriteId,
    },
    /// A write failed to post, failed in flight, or was abandoned; nothing of it is in flight.
    WriteFailed {
        /// The write.
        write: WriteId,
        /// How it failed.
        failure: WriteFailure,
    },
}

/// One write for the transport to post: `local` blocks of this rank into `remote` blocks of
/// `to`, pairwise per cache group, then `notification` to `to` once the data landed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteOrder {
    /// The write's id; completions name it.
    pub write: WriteId,
    /// The target rank.
    pub to: PeerAddr,
    /// The pairing key.
    pub key: PairingKey,
    /// The attempt.
    pub epoch: Epoch,
    /// Local logical blocks, per group; same lengths as `remote`.
    pub local: BlockIds,
    /// Remote logical blocks, per group.
    pub remote: BlockIds,
    /// Sent to `to` after the data has landed.
    pub notification: Message,
}

/// Everything an [`Endpoint`](super::Endpoint) asks its shell to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    /// Send a control message to a peer.
    Send {
        /// The peer.
        to: PeerAddr,
        /// The message.
        message: Message,
    },
    /// Post a write.
    PostWrite(Box<WriteOrder>),
    /// Post a read; report its end with [`NetEvent::WriteCompleted`] or
    /// [`NetEvent::WriteFailed`] under the read's id (reads and writes share one id space).
    PostRead(Box<super::read_types::ReadOrder>),
    /// Make sure a write never lands, then report it with [`NetEvent::WriteCompleted`] (it had
    /// landed) or [`NetEvent::WriteFailed`].
    AbandonWrite {
        /// The write.
        write: WriteId,
    },
    /// Start a handshake with a peer; answer with [`NetEvent::PeerConnected`] or
    /// [`NetEvent::PeerConnectFailed`].
    Connect {
        /// The peer.
        peer: PeerAddr,
    },
    /// The peer is declared dead: invalidate its transport connection so that nothing it
    /// posted can land any more.
    Invalidate {
        /// The peer.
        peer: PeerAddr,
    },
    /// Tell the engine something.
    Event(EngineEvent),
}

/// Why D's request failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DecodeFailure {
    /// P died or was declared dead.
    PeerDead,
    /// P did not deliver before D's deadline.
    Deadline,
    /// P reported that its write failed or will not happen.
    WriteFailed(WriteFailure),
    /// D's engine aborted the request.
    Aborted,
    /// D's engine is shutting down.
    Shutdown,
    /// The handshake with P failed.
    HandshakeFailed,
    /// P and D cannot exchange this request's KV (geometry or plan).
    Incompatible,
}

/// The one terminal outcome of a request on D.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DecodeOutcome {
    /// Every expected byte arrived for the current epoch.
    Ready,
    /// The request failed; its blocks hold nothing usable.
    Failed(DecodeFailure),
}

/// What made it safe to hand D's blocks back (the safety story's four proofs, plus the case of
/// blocks that were never exposed to P).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FreeProof {
    /// No registration naming the blocks was ever sent.
    NeverExposed,
    /// Every expected write of the epoch was counted.
    WritesCompleted,
    /// P acknowledged a cancel after draining its writes.
    CancelAcknowledged,
    /// P reported that nothing of the epoch is or will be in flight.
    PeerQuiesced,
    /// P was declared dead (or replaced), and the fence passed: `Config::quarantine` since the
    /// death, longer than any write of the old incarnation can take to land. A deadline, not
    /// a proof; reported apart from [`FreeProof::Quarantine`] so that false deaths are visible.
    DeadPeerFence,
    /// Only a quarantine after a cancel passed: a deadline, not a proof.
    Quarantine,
}

/// Why P let go of its blocks without a completed write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ReleaseCause {
    /// The lease ended without a registration or renewal.
    LeaseExpired,
    /// D cancelled the attempt.
    CancelledByPeer,
    /// D said it does not need the blocks.
    ReleasedByPeer(ReleaseReason),
    /// P's engine aborted the request.
    Aborted,
    /// D died or was declared dead.
    PeerDead,
    /// The write failed.
    WriteFailed(WriteFailure),
    /// D's registration did not fit P's blocks.
    Rejected,
    /// There were no blocks to send.
    Empty,
}

/// The one terminal outcome of a request on P.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PrefillOutcome {
    /// The write completed.
    Sent,
    /// The blocks were let go without a completed write.
    Released(ReleaseCause),
}

/// What the engine learns; exactly one per request, carrying the request's blocks back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineEvent {
    /// D's request ended. On `Ready` the blocks hold the prompt's KV; on `Failed` they are free.
    Decode {
        /// D's request id.
        request: RequestId,
        /// The pairing key.
        key: PairingKey,
        /// The attempt.
        epoch: Epoch,
        /// How it ended.
        outcome: DecodeOutcome,
        /// What made it safe to hand the blocks back.
        proof: FreeProof,
        /// The blocks, handed back.
        blocks: BlockIds,
    },
    /// An export ended; the blocks are free.
    Export {
        /// The engine's id of the request.
        request: RequestId,
        /// The pairing key.
        key: PairingKey,
        /// How it ended.
        outcome: super::read_types::ExportOutcome,
        /// What made it safe to hand the blocks back.
        proof: super::read_types::ReadProof,
        /// The blocks, handed back.
        blocks: BlockIds,
    },
    /// An import ended. No read of it can still land in the blocks; on `Loaded` (and in the
    /// valid prefix of `Recompute`) they hold the holder's KV.
    Import {
        /// The engine's id of the request.
        request: RequestId,
        /// The pairing key.
        key: PairingKey,
        /// The reader's attempt.
        epoch: Epoch,
        /// How it ended.
        outcome: super::read_types::ImportOutcome,
        /// The blocks, handed back.
        blocks: BlockIds,
    },
    /// P's request ended; the blocks are free.
    Prefill {
        /// P's request id.
        request: RequestId,
        /// The pairing key.
        key: PairingKey,
        /// How it ended.
        outcome: PrefillOutcome,
        /// The blocks, handed back.
        blocks: BlockIds,
    },
}

impl EngineEvent {
    /// The engine's id of the request the event is about.
    pub fn request(&self) -> &RequestId {
        match self {
            EngineEvent::Decode { request, .. }
            | EngineEvent::Prefill { request, .. }
            | EngineEvent::Export { request, .. }
            | EngineEvent::Import { request, .. } => request,
        }
    }
}

/// Why the engine's input was refused. Nothing changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Rejected {
    /// The request id is already live on this endpoint.
    #[error("request {0} is already in progress")]
    DuplicateRequest(RequestId),
    /// The pairing key is already live on this side.
    #[error("pairing key {0} is already in progress")]
    DuplicateKey(PairingKey),
    /// No live request has this id.
    #[error("no request {0} is in progress")]
    UnknownRequest(RequestId),
    /// The request table is full.
    #[error("the {table} table is full ({limit} entries)")]
    TableFull {
        /// Which table.
        table: &'static str,
        /// Its bound.
        limit: usize,
    },
    /// The request's fields break a rule.
    #[error("invalid request: {0}")]
    Invalid(&'static str),
    /// The block list breaks a wire limit (it could not be sent).
    #[error("invalid block list: {0}")]
    BlockList(crate::FieldError),
    /// The epoch is 0 or beyond [`Epoch::MAX`], or a retry of the key would need one beyond it.
    #[error("epoch {0} is out of range (1..={max})", max = Epoch::MAX)]
    EpochOutOfRange(Epoch),
    /// The endpoint is shutting down and takes no new requests.
    #[error("the endpoint is shutting down")]
    ShuttingDown,
    /// A decline names an export this rank is reading now: letting the holder go would free
    /// blocks its reads may still land from. The import's own end releases the holder.
    #[error("an import of {0} from that holder is in progress on this rank; its end releases the holder")]
    ImportInProgress(PairingKey),
    /// A duration the engine passed is beyond what this rank accepts.
    #[error("{what} of {given:?} is beyond the limit of {max:?}")]
    TooLong {
        /// Which duration.
        what: &'static str,
        /// What was passed.
        given: std::time::Duration,
        /// The most accepted.
        max: std::time::Duration,
    },
}

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
    /// Cancels and releases for an attempt an older request of the key had settled, which
    /// reached a newer request of the key: ignored (a cancel is still acknowledged).
    pub stale_settles_ignored: u64,
    /// D blocks freed by quarantine alone (after a cancel).
    pub quarantine_frees: u64,
    /// D blocks freed by the fence after their P was declared dead or replaced.
    pub fence_frees: u64,
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
