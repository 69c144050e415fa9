//! Everything that crosses between engines: the side-channel handshake and the control
//! notifications of the lease protocol.
//!
//! Every control message names the pairing key and epoch it is about, so that a message for an
//! older attempt can be recognised and ignored. Block ids travel as logical ids, one list per
//! cache group.

use serde::{Deserialize, Serialize};

use crate::geometry::{KvGeometry, RegionDesc, MAX_CACHE_GROUPS};
use crate::ids::{AgentName, EngineId, Epoch, Incarnation, PairingKey, RequestId};
use crate::trace::TraceId;
use rules::check_len;
pub use rules::FieldError;

/// Most logical blocks one cache group of one request may list.
pub const MAX_BLOCKS_PER_GROUP: usize = 1 << 16;
/// Most logical blocks one request may list over all its cache groups.
///
/// Without this bound, [`MAX_CACHE_GROUPS`] full groups of large ids would encode to more than
/// [`crate::wire::MAX_PAYLOAD_LEN`] bytes (making `encode` panic) or exceed the decoder's size
/// limit (making a valid message undecodable). At this bound a [`Register`] encodes to at most
/// about 1.3 MiB.
pub const MAX_BLOCKS_PER_REQUEST: usize = 1 << 18;
/// Most regions a handshake may advertise.
pub const MAX_REGIONS: usize = 1 << 14;
/// Most bytes of NIXL agent metadata a handshake may carry.
pub const MAX_AGENT_METADATA: usize = 1 << 20;
/// Most leases one heartbeat may renew.
pub const MAX_HEARTBEAT_LEASES: usize = 1 << 12;
/// Most transfer modes a handshake may list.
pub const MAX_TRANSFER_MODES: usize = 8;

/// Per-cache-group lists of logical block ids of one request.
///
/// ```
/// use kvhandoff_protocol::BlockIds;
/// let ids = BlockIds::single_group(vec![3, 4, 9]);
/// assert_eq!(ids.total(), 3);
/// assert!(!ids.is_empty());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct BlockIds {
    /// One list per cache group, in the geometry's group order.
    pub groups: Vec<Vec<u32>>,
}

impl BlockIds {
    /// Ids of a model with a single cache group.
    pub fn single_group(ids: Vec<u32>) -> Self {
        Self { groups: vec![ids] }
    }

    /// Number of block ids over all groups.
    pub fn total(&self) -> usize {
        self.groups.iter().map(Vec::len).sum()
    }

    /// True when no group lists any block.
    pub fn is_empty(&self) -> bool {
        self.groups.iter().all(Vec::is_empty)
    }

    /// Checks the wire limits ([`MAX_CACHE_GROUPS`], [`MAX_BLOCKS_PER_GROUP`],
    /// [`MAX_BLOCKS_PER_REQUEST`]) and that no group lists a block twice: a list that passes
    /// fits in a message. Engines' lists are checked with it before anything is sent.
    ///
    /// ```
    /// use kvhandoff_protocol::{BlockIds, MAX_BLOCKS_PER_GROUP};
    /// assert!(BlockIds::single_group(vec![1, 2, 3]).validate().is_ok());
    /// assert!(BlockIds::single_group(vec![1, 1]).validate().is_err());
    /// let huge = BlockIds::single_group((0..=MAX_BLOCKS_PER_GROUP as u32).collect());
    /// assert!(huge.validate().is_err());
    /// ```
    ///
    /// # Errors
    /// The first broken limit.
    pub fn validate(&self) -> Result<(), FieldError> {
        if self.groups.len() > MAX_CACHE_GROUPS {
            return Err(FieldError::TooMany {
                field: "block id groups",
                len: self.groups.len(),
                limit: MAX_CACHE_GROUPS,
            });
        }
        for group in &self.groups {
            if group.len() > MAX_BLOCKS_PER_GROUP {
                return Err(FieldError::TooMany {
                    field: "block ids",
                    len: group.len(),
                    limit: MAX_BLOCKS_PER_GROUP,
                });
            }
            let mut seen = std::collections::BTreeSet::new();
            if let Some(&dup) = group.iter().find(|id| !seen.insert(**id)) {
                return Err(FieldError::DuplicateBlock { block: dup });
            }
        }
        check_len(
            "block ids in all groups",
            self.total(),
            MAX_BLOCKS_PER_REQUEST,
        )
    }
}

/// The 32-byte SHA-256 over what must match between P and D; see
/// [`crate::compatibility_hash`].
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CompatHash(pub [u8; 32]);

impl std::fmt::Debug for CompatHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CompatHash(")?;
        for byte in &self.0[..8] {
            write!(f, "{byte:02x}")?;
        }
        write!(f, "..)")
    }
}

/// A way of moving KV blocks that an engine can take part in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum TransferMode {
    /// D registers blocks, P writes them.
    Push,
    /// P exports blocks, D reads them.
    Pull,
    /// Push, one layer group at a time as P's forward pass produces them.
    LayerwisePush,
    /// D keeps its blocks after decoding; P reads them back on the next turn.
    Bidirectional,
}

/// The side-channel handshake: everything a peer needs to move bytes to or from this rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Handshake {
    /// The sender's protocol version ([`crate::PROTOCOL_VERSION`]).
    pub protocol_version: u16,
    /// The sending engine.
    pub engine_id: EngineId,
    /// The sending rank's process run: the same in every handshake of one run, new after a
    /// restart.
    pub incarnation: Incarnation,
    /// The NIXL agent name of the sending rank.
    pub agent_name: AgentName,
    /// NIXL agent metadata, for `load_remote_md` on the receiver.
    pub agent_metadata: Vec<u8>,
    /// Registered regions in [`KvGeometry::regions`] order; for a `routed` rank, the buffers
    /// its route places pieces in (each one block of its whole length).
    pub regions: Vec<RegionDesc>,
    /// The sending rank's transfers are placed by a route (a rank of a heterogeneous pair): its
    /// region table lists its buffers (at most [`MAX_ROUTED_BUFFERS`]), not its geometry's
    /// regions, and only a peer whose own route accepts this rank's geometry pairs with it.
    pub routed: bool,
    /// The sending rank's geometry.
    pub geometry: KvGeometry,
    /// The sender's compatibility hash.
    pub compat_hash: CompatHash,
    /// Transfer modes the sender supports.
    pub modes: Vec<TransferMode>,
    /// The sender's clock when it sent the handshake, in microseconds since its own epoch; the
    /// receiver estimates the clock offset from it and the round trip.
    pub clock_sample_us: u64,
    /// The connection's trace id: made by the side that dials, adopted by the side that answers,
    /// so both sides' records of one connection join.
    pub trace_id: TraceId,
}

/// D → P: D has allocated `blocks` for the request paired by `key`, for attempt `epoch`; P may
/// write them once its prefill has finished.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Register {
    /// The pairing key of the request.
    pub key: PairingKey,
    /// The attempt.
    pub epoch: Epoch,
    /// The decode engine (where to write).
    pub decode_engine: EngineId,
    /// D's own id of the request, for logs on P.
    pub decode_request: RequestId,
    /// D's TP rank that owns `blocks`.
    pub decode_rank: u32,
    /// D's logical block ids, one list per cache group.
    pub blocks: BlockIds,
    /// Tokens D expects to receive.
    pub num_tokens: u64,
    /// Where in D's registered memory a routed writer may place this request's pieces (a
    /// heterogeneous pair: the request's KV and staging buffers, in the order the pair's plan
    /// names them); empty for ranks that plan from the region tables. At most
    /// [`MAX_REGISTER_SPANS`]. The machines carry it untouched: D's shell fills it from its
    /// route as it sends the registration, P's route reads it as it plans the write.
    pub memory: Vec<MemorySpan>,
    /// The attempt's trace id, made by D when the attempt started; P's records of it carry it.
    pub trace_id: TraceId,
}

/// A range of a rank's registered memory, in its transport's address space.
///
/// ```
/// use kvhandoff_protocol::MemorySpan;
/// let span = MemorySpan { addr: 4096, len: 512 };
/// assert!(span.contains(4096 + 100, 412));
/// assert!(!span.contains(4096 + 100, 413));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MemorySpan {
    /// First byte.
    pub addr: u64,
    /// Bytes.
    pub len: u64,
}

impl MemorySpan {
    /// Whether `addr .. addr + len` lies inside the span.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        let (Some(end), Some(own_end)) = (addr.checked_add(len), self.addr.checked_add(self.len))
        else {
            return false;
        };
        addr >= self.addr && end <= own_end
    }
}

/// Most spans one [`Register`] may name.
pub const MAX_REGISTER_SPANS: usize = 16;
/// Most buffers a routed rank's handshake may list ([`Handshake::routed`]).
pub const MAX_ROUTED_BUFFERS: usize = 64;

/// P → D: every write of `epoch` from `prefill_rank` for `key` has landed (sent as the
/// notification of the last write, so it arrives after the data).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteDone {
    /// The pairing key.
    pub key: PairingKey,
    /// The attempt the writes belonged to.
    pub epoch: Epoch,
    /// P's TP rank that wrote.
    pub prefill_rank: u32,
    /// The integrity digests of the written blocks as P read them (see [`crate::integrity`]):
    /// empty unless both sides run with `Config::integrity_digest`, then one per
    /// [`crate::integrity::blocks_per_digest`] blocks of the registration, at most
    /// [`crate::integrity::MAX_WRITE_DIGESTS`].
    pub digests: Vec<u64>,
}

/// One part of a layer-wise write landed: layers `first .. first + count` of P's `of` layers,
/// for every block of the registration (the notification of that part's transfer, so it arrives
/// after the part's data). D counts a rank's writes landed when its parts cover all `of` layers,
/// each layer once; a whole-request write sends [`WriteDone`] instead.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WritePartDone {
    /// The pairing key.
    pub key: PairingKey,
    /// The attempt the write belongs to.
    pub epoch: Epoch,
    /// P's TP rank that wrote.
    pub prefill_rank: u32,
    /// The part's first layer (P's layer index on its rank).
    pub first: u32,
    /// Layers in the part (at least 1).
    pub count: u32,
    /// Layers of the whole write (P's layers on its rank).
    pub of: u32,
    /// The integrity digests of the part's layers of the written blocks, as for
    /// [`WriteDone::digests`] (empty unless integrity digests are on).
    pub digests: Vec<u64>,
}

/// Why P could not complete its writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum WriteFailure {
    /// Posting the transfer failed.
    PostFailed,
    /// The transfer was posted but failed.
    TransferFailed,
    /// The transfer stayed in progress past its deadline.
    TransferTimedOut,
    /// P aborted the request.
    PrefillAborted,
    /// P's lease on its blocks ended before the write.
    LeaseExpired,
    /// D's registration does not fit P's blocks (count or geometry).
    PlanMismatch,
    /// P no longer holds blocks for this key: they were sent to another attempt, released, or
    /// never produced.
    Unavailable,
    /// D's registration waited for P's prefill longer than P keeps registrations.
    RegistrationExpired,
    /// The bytes that landed on D do not match the digests P computed over what it wrote
    /// (`Config::integrity_digest`): corrupted in flight. Never sent by P: D's shell reports it
    /// for a write whose notification arrived (so nothing of it is in flight any more).
    DigestMismatch,
}

/// P → D: P will not (or no longer) write `epoch` for `key`, and nothing it posted for that
/// epoch is still in flight, so D may reuse its blocks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteFailed {
    /// The pairing key.
    pub key: PairingKey,
    /// The attempt.
    pub epoch: Epoch,
    /// P's TP rank.
    pub prefill_rank: u32,
    /// What went wrong.
    pub reason: WriteFailure,
}

/// Why D gave up on an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum CancelReason {
    /// D's registration deadline passed.
    Deadline,
    /// The engine aborted the request.
    Aborted,
    /// D is shutting down.
    Shutdown,
}

/// D → P: stop writing `epoch` for `key`; answer with [`CancelAck`] once nothing is in flight.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cancel {
    /// The pairing key.
    pub key: PairingKey,
    /// The attempt to stop.
    pub epoch: Epoch,
    /// Why.
    pub reason: CancelReason,
}

/// P → D: P has drained its writes for `epoch` of `key` and will post none: D may reuse its
/// blocks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CancelAck {
    /// The pairing key.
    pub key: PairingKey,
    /// The attempt that was cancelled.
    pub epoch: Epoch,
    /// P's TP rank.
    pub prefill_rank: u32,
}

/// One lease named in a heartbeat.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LeaseRef {
    /// The pairing key.
    pub key: PairingKey,
    /// The attempt.
    pub epoch: Epoch,
}

/// D → P: D is alive and still wants the listed leases kept. An empty list is a pure liveness
/// ping.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heartbeat {
    /// The sending engine.
    pub engine: EngineId,
    /// Leases to renew.
    pub leases: Vec<LeaseRef>,
}

/// Why D tells P to let go of its blocks without a write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum ReleaseReason {
    /// D already holds every token (a full prefix-cache hit).
    FullPrefixHit,
    /// D aborted before it registered.
    Aborted,
    /// D read the blocks (pull mode) and is done with them.
    ReadDone,
    /// The reader's reads of the blocks failed or were given up; none is in flight any more.
    ReadFailed,
    /// The reader will not read the blocks (it recomputes instead, or a read could outlive the
    /// holder's lease).
    Declined,
}

/// The reader → the holder: the holder may free its blocks for `key` now. Push: D → P. Pull
/// and bidirectional: from the side that reads to the side that exported, sent only once no
/// read of `epoch` is or will be in flight.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Release {
    /// The pairing key.
    pub key: PairingKey,
    /// The attempt.
    pub epoch: Epoch,
    /// Why.
    pub reason: ReleaseReason,
}

/// Every message that crosses between engines.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Message {
    /// Side-channel handshake.
    Handshake(Box<Handshake>),
    /// D registers its blocks.
    Register(Box<Register>),
    /// P's writes landed.
    WriteDone(WriteDone),
    /// P's writes failed or will not happen; nothing is in flight.
    WriteFailed(WriteFailed),
    /// D gives up on an attempt.
    Cancel(Cancel),
    /// P confirms a cancel after draining.
    CancelAck(CancelAck),
    /// D is alive; renew leases.
    Heartbeat(Heartbeat),
    /// The holder may free its blocks.
    Release(Release),
    /// A reader asks to read exported blocks.
    ReadAsk(ReadAsk),
    /// The holder lets the reader read.
    ReadGrant(Box<ReadGrant>),
    /// The holder will not let the reader read.
    ReadRefused(ReadRefused),
    /// A part of a layer-wise write landed.
    WritePartDone(WritePartDone),
}

/// The one-byte kind that precedes a message's payload on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
pub enum MessageKind {
    /// [`Message::Handshake`].
    Handshake = 1,
    /// [`Message::Register`].
    Register = 2,
    /// [`Message::WriteDone`].
    WriteDone = 3,
    /// [`Message::WriteFailed`].
    WriteFailed = 4,
    /// [`Message::Cancel`].
    Cancel = 5,
    /// [`Message::CancelAck`].
    CancelAck = 6,
    /// [`Message::Heartbeat`].
    Heartbeat = 7,
    /// [`Message::Release`].
    Release = 8,
    /// [`Message::ReadAsk`].
    ReadAsk = 9,
    /// [`Message::ReadGrant`].
    ReadGrant = 10,
    /// [`Message::ReadRefused`].
    ReadRefused = 11,
    /// [`Message::WritePartDone`].
    WritePartDone = 12,
}

impl MessageKind {
    /// Every kind, in wire-code order.
    pub const ALL: [MessageKind; 12] = [
        MessageKind::Handshake,
        MessageKind::Register,
        MessageKind::WriteDone,
        MessageKind::WriteFailed,
        MessageKind::Cancel,
        MessageKind::CancelAck,
        MessageKind::Heartbeat,
        MessageKind::Release,
        MessageKind::ReadAsk,
        MessageKind::ReadGrant,
        MessageKind::ReadRefused,
        MessageKind::WritePartDone,
    ];

    /// The kind with wire code `code`, if any.
    pub fn from_code(code: u8) -> Option<MessageKind> {
        Self::ALL.into_iter().find(|k| *k as u8 == code)
    }
}

/// Most layers one rank's layer-wise write may name (a model's layers on one pipeline stage).
pub const MAX_WRITE_LAYERS: u32 = 4096;

impl Message {
    /// The wire kind of this message.
    pub fn kind(&self) -> MessageKind {
        match self {
            Message::Handshake(_) => MessageKind::Handshake,
            Message::Register(_) => MessageKind::Register,
            Message::WriteDone(_) => MessageKind::WriteDone,
            Message::WriteFailed(_) => MessageKind::WriteFailed,
            Message::Cancel(_) => MessageKind::Cancel,
            Message::CancelAck(_) => MessageKind::CancelAck,
            Message::Heartbeat(_) => MessageKind::Heartbeat,
            Message::Release(_) => MessageKind::Release,
            Message::ReadAsk(_) => MessageKind::ReadAsk,
            Message::ReadGrant(_) => MessageKind::ReadGrant,
            Message::ReadRefused(_) => MessageKind::ReadRefused,
            Message::WritePartDone(_) => MessageKind::WritePartDone,
        }
    }

    /// The pairing key and epoch the message is about, for the messages that name one.
    pub fn lease(&self) -> Option<(&PairingKey, Epoch)> {
        match self {
            Message::Handshake(_) | Message::Heartbeat(_) => None,
            Message::Register(m) => Some((&m.key, m.epoch)),
            Message::WriteDone(m) => Some((&m.key, m.epoch)),
            Message::WriteFailed(m) => Some((&m.key, m.epoch)),
            Message::Cancel(m) => Some((&m.key, m.epoch)),
            Message::CancelAck(m) => Some((&m.key, m.epoch)),
            Message::Release(m) => Some((&m.key, m.epoch)),
            Message::ReadAsk(m) => Some((&m.key, m.epoch)),
            Message::ReadGrant(m) => Some((&m.key, m.epoch)),
            Message::ReadRefused(m) => Some((&m.key, m.epoch)),
            Message::WritePartDone(m) => Some((&m.key, m.epoch)),
        }
    }
}

mod read_messages;
mod rules;
#[cfg(test)]
mod tests;

pub use read_messages::{ReadAsk, ReadGrant, ReadRefusal, ReadRefused};
