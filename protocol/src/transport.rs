//! Transports: how bytes and notifications move between engine ranks.
//!
//! A [`Transport`] is one rank's endpoint on the fabric: one NIXL agent. It is synchronous,
//! non-blocking and polled: a shell calls it from one thread, feeds what
//! [`Transport::poll_completions`] and [`Transport::poll_notifications`] return into the state
//! machines, and turns their outputs back into calls. Nothing in it blocks or sleeps.
//!
//! Implementations:
//! - `kvhandoff_actors::transport::mem::MemTransport`: in-process agents on a shared fabric, real bytes, fault
//!   switches; the default for tests and the demo.
//! - a NIXL transport (cargo feature `nixl`), which maps every method onto one or two
//!   `nixl_sys::Agent` calls (each method names them).
//!
//! # Life of a write
//!
//! 1. Each side registers its memory ([`Transport::register_region`]) and hands the other its
//!    [`Transport::local_metadata`] (over the side channel); the other side loads it with
//!    [`Transport::load_remote`].
//! 2. The initiator posts [`Descriptor`]s with [`Transport::post_write`]. Posting checks every
//!    descriptor against registered memory on both sides and either posts everything or nothing.
//! 3. The data lands in the target's memory some time later; then the write's notification (if
//!    any) is delivered to the target, and then [`Transport::poll_completions`] reports exactly one
//!    [`Completion`] for the write.
//!
//! ```
//! use kvhandoff_protocol::transport::{AddrRange, Descriptor};
//! let region = AddrRange { base: 0x1000, len: 256 };
//! let d = Descriptor { local_addr: 0x1000, remote_addr: 0x9000, len: 64 };
//! assert!(region.contains(d.local_addr, d.len));
//! assert!(!region.contains(0x10f0, 64)); // runs past the end
//! ```

use crate::{wire, AgentName, PeerAddr, RegionDesc, WriteId};

/// Default bound on one notification's bytes: one wire frame of the largest message the protocol
/// allows (a `Register` with many blocks can reach this; see `crate::wire`).
pub const MAX_NOTIFICATION_LEN: usize = wire::HEADER_LEN + wire::MAX_PAYLOAD_LEN;

/// A contiguous range of registered memory, in its owner's address space.
///
/// This is the `(base, len)` half of a [`RegionDesc`]; the other half (`num_blocks`,
/// `block_len`) comes from the geometry, see [`AddrRange::to_region_desc`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AddrRange {
    /// First byte's address.
    pub base: u64,
    /// Bytes in the range.
    pub len: u64,
}

impl AddrRange {
    /// One past the last byte's address, or `None` if that overflows.
    pub fn end(&self) -> Option<u64> {
        self.base.checked_add(self.len)
    }

    /// Whether `[addr, addr + len)` lies inside this range (a zero-length span never does).
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        let (Some(end), Some(span_end)) = (self.end(), addr.checked_add(len)) else {
            return false;
        };
        len > 0 && addr >= self.base && span_end <= end
    }

    /// The region as advertised in a handshake, with the geometry's block layout.
    pub fn to_region_desc(&self, num_blocks: u32, block_len: u64) -> RegionDesc {
        RegionDesc {
            base: self.base,
            len: self.len,
            num_blocks,
            block_len,
        }
    }
}

/// One contiguous span of a transfer (the descriptor planner's output type): `len` bytes between
/// `local_addr` (this agent's registered memory) and `remote_addr` (the peer's). Maps onto one
/// entry of each of NIXL's two `XferDescList`s.
pub use crate::planner::Descriptor;

/// The end of one posted transfer. Exactly one is reported per successful post.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// The transfer.
    pub write: WriteId,
    /// `Ok` when every byte landed (and the notification, if any, was delivered);
    /// otherwise why not.
    pub result: Result<(), TransportError>,
}

/// A notification received from another agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    /// The sending agent.
    pub from: AgentName,
    /// The sender as a peer, when this transport has the sender's metadata loaded (resolved when
    /// the notification is polled).
    pub peer: Option<PeerAddr>,
    /// The payload.
    pub bytes: Vec<u8>,
}

/// Why a transport call or a transfer failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransportError {
    /// No metadata was ever loaded for the peer (or its tombstone was evicted).
    #[error("unknown peer {peer}")]
    UnknownPeer {
        /// The peer.
        peer: PeerAddr,
    },
    /// The peer was invalidated and has not been loaded again since.
    #[error("peer {peer} was invalidated")]
    PeerInvalidated {
        /// The peer.
        peer: PeerAddr,
    },
    /// The remote agent is gone, or is a newer incarnation than the loaded metadata describes.
    #[error("agent {agent} is unreachable")]
    PeerUnreachable {
        /// The remote agent.
        agent: AgentName,
    },
    /// More peers than the transport's bound.
    #[error("too many peers (limit {limit})")]
    TooManyPeers {
        /// The bound.
        limit: usize,
    },
    /// The peer is loaded with another agent, or the agent is loaded as another peer; invalidate
    /// the old pairing first.
    #[error("peer {peer} and agent {agent} conflict with an already loaded pairing")]
    LoadConflict {
        /// The peer being loaded.
        peer: PeerAddr,
        /// The agent being loaded.
        agent: AgentName,
    },
    /// The metadata names another agent than the one expected.
    #[error("metadata is for agent {found}, expected {expected}")]
    MetadataMismatch {
        /// The agent the caller expected.
        expected: AgentName,
        /// The agent the metadata names.
        found: AgentName,
    },
    /// The metadata does not decode (or comes from another fabric).
    #[error("bad agent metadata: {why}")]
    BadMetadata {
        /// What is wrong.
        why: &'static str,
    },
    /// A live agent with that name already exists.
    #[error("agent name {agent} is in use")]
    AgentNameInUse {
        /// The name.
        agent: AgentName,
    },
    /// No agent with that name exists on the fabric.
    #[error("no agent {agent}")]
    UnknownAgent {
        /// The name.
        agent: AgentName,
    },
    /// A transfer with no descriptors.
    #[error("a transfer needs at least one descriptor")]
    NoDescriptors,
    /// More descriptors than the transport's bound.
    #[error("{count} descriptors, above the limit of {limit}")]
    TooManyDescriptors {
        /// Descriptors given.
        count: usize,
        /// The bound.
        limit: usize,
    },
    /// A descriptor of zero bytes.
    #[error("descriptor {index} is empty")]
    EmptyDescriptor {
        /// Index of the descriptor.
        index: usize,
    },
    /// A descriptor's local span is not inside one region registered with this agent.
    #[error("descriptor {index}: local span {addr:#x}+{len} is outside registered memory")]
    LocalOutOfRange {
        /// Index of the descriptor.
        index: usize,
        /// Its local address.
        addr: u64,
        /// Its length.
        len: u64,
    },
    /// A descriptor's remote span is not inside one region of the peer's loaded metadata.
    #[error(
        "descriptor {index}: remote span {addr:#x}+{len} is outside the peer's registered memory"
    )]
    RemoteOutOfRange {
        /// Index of the descriptor.
        index: usize,
        /// Its remote address.
        addr: u64,
        /// Its length.
        len: u64,
    },
    /// A transfer with this id is still pending (posted and not yet reported).
    #[error("transfer {write} is already pending")]
    DuplicateWrite {
        /// The id.
        write: WriteId,
    },
    /// No pending transfer has this id: it was never posted, or its completion was already
    /// reported.
    #[error("no pending transfer {write}")]
    UnknownWrite {
        /// The id.
        write: WriteId,
    },
    /// Too many transfers pending on this agent.
    #[error("too many transfers in flight (limit {limit})")]
    TooManyInFlight {
        /// The bound.
        limit: usize,
    },
    /// A notification above the transport's bound.
    #[error("notification of {len} bytes, above the limit of {limit}")]
    NotificationTooLarge {
        /// Bytes given.
        len: usize,
        /// The bound.
        limit: usize,
    },
    /// The receiving agent's notification queue is full; try again after it polls.
    #[error("notification queue of agent {agent} is full")]
    PeerInboxFull {
        /// The receiving agent.
        agent: AgentName,
    },
    /// Posting failed in the backend (or by an injected fault); nothing was posted.
    #[error("post failed: {reason}")]
    PostFailed {
        /// What the backend said.
        reason: String,
    },
    /// The transfer failed after posting. Some of its bytes may have landed; its notification
    /// was not delivered.
    #[error("transfer failed: {reason}")]
    TransferFailed {
        /// What the backend said.
        reason: String,
    },
    /// The transfer was abandoned before it landed; none of its bytes landed.
    #[error("transfer abandoned")]
    Abandoned,
    /// The transport cannot stop this transfer; its completion will come in its own time.
    #[error("transfer {write} cannot be abandoned")]
    AbandonRefused {
        /// The id.
        write: WriteId,
    },
    /// A region of zero bytes, or one above the transport's bound.
    #[error("bad region length {len}")]
    BadRegionLen {
        /// Bytes asked for.
        len: u64,
    },
    /// The fabric's memory bound would be exceeded.
    #[error("out of fabric memory: {requested} bytes asked, {available} available")]
    OutOfMemory {
        /// Bytes asked for.
        requested: u64,
        /// Bytes left under the bound.
        available: u64,
    },
    /// More registered regions than the transport's bound.
    #[error("too many registered regions (limit {limit})")]
    TooManyRegions {
        /// The bound.
        limit: usize,
    },
    /// The region is registered already.
    #[error("region at {base:#x} is already registered")]
    AlreadyRegistered {
        /// The region's base.
        base: u64,
    },
    /// The region belongs to another agent or another fabric.
    #[error("region at {base:#x} does not belong to this agent")]
    ForeignRegion {
        /// The region's base.
        base: u64,
    },
    /// A direct read or write of region memory outside the region.
    #[error("access {offset}+{len} is outside region at {base:#x}")]
    RegionOutOfBounds {
        /// The region's base.
        base: u64,
        /// Offset of the access.
        offset: u64,
        /// Bytes of the access.
        len: u64,
    },
    /// Any other backend failure.
    #[error("backend error: {reason}")]
    Backend {
        /// What the backend said.
        reason: String,
    },
}

/// One rank's endpoint on the transfer fabric (one NIXL agent).
///
/// Every method is synchronous and non-blocking. Transfers are identified by the caller's
/// [`WriteId`]s (reads use the same id space); ids of pending transfers must be distinct.
///
/// # Contract
///
/// - **Exactly one completion.** Every transfer for which a `post_*` call returned `Ok` is
///   reported by exactly one [`Completion`] from [`Self::poll_completions`], whatever happens to it
///   (landing, failure, [`Self::abandon_write`], [`Self::invalidate_remote`]). A post that
///   returned `Err` posted nothing and is never reported.
/// - **Data before notification before completion.** A transfer's notification is delivered to
///   the peer only after all of its bytes landed; its `Ok` completion is reported no earlier than
///   that. A failed transfer delivers no notification.
/// - **Standalone notifications are not ordered after transfers.** A notification sent with
///   [`Self::send_notification`] may arrive before the bytes of a transfer posted earlier.
///   To tell a peer that data landed, attach the notification to the transfer, or send it after
///   the transfer's `Ok` completion.
/// - **Memory is read at transfer time.** The source bytes are read when the transfer moves
///   them, not when it is posted: keep source memory unchanged until the completion.
/// - **Metadata is a snapshot.** [`Self::local_metadata`] describes the regions registered when
///   it was taken; a peer can target only those until it loads newer metadata.
pub trait Transport {
    /// Memory the engine hands to [`Self::register_region`]: a
    /// `MemRegion` for the in-memory transport, engine-owned device or host memory
    /// (built by an `unsafe` constructor that promises it outlives the registration) for NIXL.
    type Region;

    /// This agent's name (NIXL: `Agent::name`).
    fn agent_name(&self) -> &AgentName;

    /// Registers `region` for transfers and returns its address range, which goes into the
    /// handshake's [`RegionDesc`] (NIXL: `register_memory`).
    ///
    /// # Errors
    /// The region is already registered, not this agent's, or over a bound.
    fn register_region(&mut self, region: &Self::Region) -> Result<AddrRange, TransportError>;

    /// This agent's metadata, for the peer's [`Self::load_remote`] (NIXL: `get_local_md`).
    ///
    /// # Errors
    /// The backend could not produce it.
    fn local_metadata(&self) -> Result<Vec<u8>, TransportError>;

    /// Loads a peer's metadata so that it can be written to, read from and notified (NIXL:
    /// `load_remote_md`, which returns the agent name checked against `agent`). Loading the same
    /// peer and agent again refreshes its region snapshot and leaves pending transfers alone.
    ///
    /// # Errors
    /// Bad metadata, metadata for another agent, a conflicting pairing, or too many peers.
    fn load_remote(
        &mut self,
        peer: &PeerAddr,
        agent: &AgentName,
        metadata: &[u8],
    ) -> Result<(), TransportError>;

    /// Forgets a peer (NIXL: `invalidate_remote_md`). Later posts and notifications to it fail
    /// with [`TransportError::PeerInvalidated`] until it is loaded again. A pending transfer to
    /// it is still reported exactly once, and never as failed while its bytes may still land: a
    /// transport that can stop it (the in-memory one) reports it failed at once; one that cannot
    /// (NIXL: an invalidation does not stop a transfer in progress) reports it with its real
    /// end, keeping what it needs to learn it. A no-op for an unknown peer except that later
    /// calls report it as invalidated.
    fn invalidate_remote(&mut self, peer: &PeerAddr);

    /// Posts a write of local memory into the peer's memory, with an optional notification
    /// delivered to the peer after the data landed (NIXL: `create_xfer_req(XferOp::Write, ..)`
    /// with the notification in its `OptArgs`, then `post_xfer_req`).
    ///
    /// # Errors
    /// Nothing is posted when any check fails: unknown or invalidated peer, a descriptor outside
    /// registered memory on either side, a duplicate id, a bound, or a backend refusal.
    fn post_write(
        &mut self,
        write: WriteId,
        peer: &PeerAddr,
        descriptors: &[Descriptor],
        notification: Option<Vec<u8>>,
    ) -> Result<(), TransportError>;

    /// Posts a read of the peer's memory into local memory, with an optional notification
    /// delivered to the peer after the data was read (NIXL: `XferOp::Read`). Otherwise exactly
    /// like [`Self::post_write`].
    ///
    /// # Errors
    /// As [`Self::post_write`].
    fn post_read(
        &mut self,
        write: WriteId,
        peer: &PeerAddr,
        descriptors: &[Descriptor],
        notification: Option<Vec<u8>>,
    ) -> Result<(), TransportError>;

    /// Gives up on a pending transfer. After `Ok` it will never land (any more); its one
    /// completion is still reported: `Err(Abandoned)`, or `Ok` if it had landed already.
    ///
    /// # Errors
    /// [`TransportError::UnknownWrite`] when nothing is pending under the id (its completion was
    /// reported already); [`TransportError::AbandonRefused`] when the transport cannot stop it
    /// (NIXL cannot stop a posted RDMA transfer): keep waiting for its completion.
    fn abandon_write(&mut self, write: WriteId) -> Result<(), TransportError>;

    /// Makes progress and appends every newly finished transfer to `out`, in finishing order
    /// (NIXL: `get_xfer_status` on each pending request, releasing the finished ones).
    fn poll_completions(&mut self, out: &mut Vec<Completion>);

    /// Sends a notification to a peer (NIXL: `send_notification`).
    ///
    /// # Errors
    /// Unknown, invalidated or unreachable peer, an oversized message, or a full queue.
    fn send_notification(&mut self, peer: &PeerAddr, bytes: Vec<u8>) -> Result<(), TransportError>;

    /// Appends every notification received since the last call to `out`, in arrival order
    /// (NIXL: `get_notifications`).
    fn poll_notifications(&mut self, out: &mut Vec<Notification>);

    /// Most bytes one notification may carry on this transport.
    fn max_notification_len(&self) -> usize;

    /// Prepares a block-granular view of a region table for reuse across posts: `peer` `None`
    /// is this agent's own table, `Some` a loaded peer's (dropped again when the peer is
    /// invalidated or reloaded). A post whose every descriptor is exactly one block of prepared
    /// tables on both sides may then skip per-request descriptor lists (NIXL:
    /// `prepare_xfer_dlist`, then `make_xfer_req` with block indices). Purely an optimisation:
    /// posts behave the same whether or not anything was prepared. The default does nothing.
    ///
    /// # Errors
    /// An unknown or invalidated peer, a table the backend refuses, or a bound; nothing is
    /// prepared then and posts take the unprepared path.
    fn prepare_blocks(
        &mut self,
        peer: Option<&PeerAddr>,
        regions: &[RegionDesc],
    ) -> Result<(), TransportError> {
        let _ = (peer, regions);
        Ok(())
    }

    /// Appends the `len` bytes at `addr` of this agent's own registered memory to `out`: the
    /// shell's access to the bytes it digests (`Config::integrity_digest`, see
    /// [`crate::integrity`]). The default cannot read (a transport of device memory it has no
    /// CPU mapping of); the in-memory and NIXL (host memory) transports can.
    ///
    /// # Errors
    /// [`TransportError::LocalOutOfRange`] when the span is not inside one region registered
    /// with this agent; [`TransportError::Backend`] when the transport cannot read its memory.
    fn read_local(&self, addr: u64, len: u64, out: &mut Vec<u8>) -> Result<(), TransportError> {
        let _ = (addr, len, out);
        Err(TransportError::Backend {
            reason: "this transport cannot read its registered memory".into(),
        })
    }

    /// Asks the transport to call `hook` (from any thread, without blocking) when a
    /// notification arrives for this agent while none is waiting to be polled, so that the
    /// caller may poll at once instead of on its next tick. A transport that cannot tell may
    /// instead call it whenever an arrival is likely (NIXL has no arrival callback: its poller
    /// thread calls the hook on a µs cadence while a transfer is pending or the rank
    /// [expects](Transport::set_expecting) something), so a call may find nothing. Purely an
    /// optimisation: the default never calls it, and notifications wait for the next poll.
    fn set_arrival_hook(&mut self, hook: ArrivalHook) {
        let _ = hook;
    }

    /// Tells the transport whether its rank has live work that an arrival may advance (a
    /// request in progress, an export or an import): a transport that must poll to see
    /// arrivals (NIXL) polls eagerly while this is true and may stop polling when it is false
    /// and nothing is pending. Purely an optimisation; the default ignores it.
    fn set_expecting(&mut self, expecting: bool) {
        let _ = expecting;
    }
}

/// What [`Transport::set_arrival_hook`] calls.
pub type ArrivalHook = std::sync::Arc<dyn Fn() + Send + Sync>;
