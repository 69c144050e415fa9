//! Values that go into and come out of an [`Endpoint`](super::Endpoint).

use std::fmt;
use std::ops::{Add, Sub};
use std::time::Duration;

use crate::{
    BlockIds, Epoch, Incarnation, Message, PairingKey, ReleaseReason, RequestId, WireError,
    WriteFailure,
};

use crate::{PeerAddr, WriteId};

pub use super::counters::{Counters, DropReason};

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

/// A layer-wise push: how P's prefill reports its layers, and how many go into one write part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerPlan {
    /// P's layers on this rank (every layer of every cache group's regions).
    pub layers: u32,
    /// Layers posted as one part: a part goes out as soon as this many new layers are ready
    /// (and the rest when the last layer is). `layers` makes it one part: whole-request push
    /// over the layer-wise path (below the prompt-length threshold).
    pub part_layers: u32,
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
pub enum EndpointCall {
    /// D: blocks allocated for a remote prefill.
    DecodeAllocated(DecodeStart),
    /// P: prefill finished; blocks to send.
    PrefillFinished(PrefillStart),
    /// P, layer-wise push: the prefill starts into these blocks; its layers are reported with
    /// [`EndpointCall::LayersReady`] as the forward pass produces them, and each part is
    /// written as soon as D's registration is here. Owes one final event, as
    /// [`EndpointCall::PrefillFinished`] does (and takes its place).
    PrefillStarted {
        /// The request, its key and blocks.
        start: PrefillStart,
        /// Its layers and parts.
        plan: LayerPlan,
    },
    /// P, layer-wise push: layers `0 .. ready` of the request's blocks hold their KV (never
    /// fewer than an earlier call said; `ready == layers` ends the prefill). A request that
    /// already ended (D gave up) takes it and does nothing.
    LayersReady {
        /// The request.
        request: RequestId,
        /// Layers ready, from layer 0.
        ready: u32,
    },
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
    /// D's shell found that the bytes of a write whose completion arrived from `from` do not
    /// match the integrity digests P sent with it (`Config::integrity_digest`): handled as
    /// that P rank's `WriteFailed(DigestMismatch)`. Reported only once nothing of the write is
    /// in flight (its completion, or every part's, arrived).
    DigestMismatch {
        /// The P rank that wrote.
        from: PeerAddr,
        /// The pairing key.
        key: PairingKey,
        /// The attempt.
        epoch: Epoch,
        /// P's TP rank, as its completion named it.
        prefill_rank: u32,
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
    /// Where D's registration said a routed writer may place the pieces ([`Register::memory`](crate::Register::memory)).
    pub remote_memory: Vec<crate::MemorySpan>,
    /// Sent to `to` after the data has landed.
    pub notification: Message,
    /// A layer-wise write: its layers and the layers to post now (`0 .. stream.posted`); later
    /// layers follow in [`Output::ExtendWrite`]. `None`: the whole request at once.
    pub stream: Option<StreamedLayers>,
}

/// The layers of a layer-wise write posted so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamedLayers {
    /// Layers of the whole write (P's layers on its rank).
    pub layers: u32,
    /// Layers `0 .. posted` are posted (or, in an order, to post now; 0: none yet).
    pub posted: u32,
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
    /// Post the next layers of a layer-wise write, `from .. to` (`to == layers` posts its
    /// last part). Its end is reported under the write's id once every posted part ended and
    /// either the last was posted or the write was abandoned.
    ExtendWrite {
        /// The write.
        write: WriteId,
        /// First layer of the part.
        from: u32,
        /// End of the part.
        to: u32,
    },
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
    Event(EndpointEvent),
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

/// What the engine learns: exactly one *final* event per request, carrying the request's
/// blocks back ([`EndpointEvent::hands_back`]); a D request may be told of its failure once
/// before that ([`EndpointEvent::DecodeFenced`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EndpointEvent {
    /// D's request ended. On `Ready` the blocks hold the prompt's KV; on `Failed` they are free.
    /// The final event of a D request: nothing about it follows.
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
    /// D's request has failed, but its blocks stay out: P was declared dead (or replaced by a
    /// new incarnation) after the blocks were exposed to it, and a write NIXL cannot stop may
    /// still land in them. Sent at most once per request, the moment the request is fenced by
    /// the death, so that the engine can recompute the prompt into other blocks at once
    /// instead of waiting out the fence (`Config::quarantine`).
    ///
    /// Carries no blocks on purpose: the engine must neither read nor reuse the request's
    /// blocks until the request's final [`EndpointEvent::Decode`], which always follows, is
    /// always `Failed(failure)` with this event's `failure`, and is the one that hands them
    /// back (by a proof the old incarnation still sends, or by the fence).
    DecodeFenced {
        /// D's request id.
        request: RequestId,
        /// The pairing key.
        key: PairingKey,
        /// The attempt.
        epoch: Epoch,
        /// Why the request failed: `PeerDead`, or the reason it was already cancelling for
        /// (a deadline, an abort, ...) when the death fenced it; the final event repeats it.
        failure: DecodeFailure,
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

impl EndpointEvent {
    /// The engine's id of the request the event is about.
    pub fn request(&self) -> &RequestId {
        match self {
            EndpointEvent::Decode { request, .. }
            | EndpointEvent::DecodeFenced { request, .. }
            | EndpointEvent::Prefill { request, .. }
            | EndpointEvent::Export { request, .. }
            | EndpointEvent::Import { request, .. } => request,
        }
    }

    /// Whether this is its request's final event, the one that hands the blocks back (every
    /// event but [`EndpointEvent::DecodeFenced`]).
    pub fn hands_back(&self) -> bool {
        match self {
            EndpointEvent::DecodeFenced { .. } => false,
            EndpointEvent::Decode { .. }
            | EndpointEvent::Prefill { .. }
            | EndpointEvent::Export { .. }
            | EndpointEvent::Import { .. } => true,
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
