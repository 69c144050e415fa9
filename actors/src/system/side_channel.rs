//! The TCP side channel: how ranks of different processes exchange their handshakes.
//!
//! # Frame exchange
//!
//! Each rank started with [`Handshaker::Tcp`](super::Handshaker::Tcp) listens on one socket
//! address. A handshake is one TCP connection and two wire frames ([`wire`]):
//!
//! 1. The initiator connects (bounded by [`SideChannelConfig::connect_timeout`]) and writes one
//!    [`Message::Handshake`] frame describing itself; its `clock_sample_us` is its clock just
//!    before the write.
//! 2. The listener reads one frame: the 12-byte header first (the magic is checked byte by byte
//!    as it arrives; then [`wire::decode_header`] rejects a bad version, kind, flags or a length
//!    above [`MAX_PAYLOAD_LEN`](wire::MAX_PAYLOAD_LEN), and a kind other than `Handshake`, before any payload is read),
//!    then exactly `payload_len` bytes, all under one deadline of
//!    [`SideChannelConfig::io_timeout`]. It decodes and validates the handshake, hands the peer
//!    to its rank ([`LinkUp`]: the rank loads it into the writer's transport and feeds
//!    `Input::PeerConnected`, atomically), then answers with its own handshake frame and closes.
//! 3. The initiator reads and validates the answer the same way and hands the peer to its rank
//!    ([`LinkUp`]).
//!
//! This is exactly what the in-process [`Directory`](super::Directory) path does. A handshake
//! from an engine that connected before (a restart) is loaded and reported again; the endpoint
//! handles the restart. An initiator whose handshake fails feeds
//! `Input::PeerConnectFailed` ([`HandshakeError::connect_failure`]).
//!
//! **A rejection is a close with nothing written**: the protocol has no rejection message, and a
//! peer that breaks the rules learns nothing more from us. The initiator sees the connection
//! close (or reset) before an answer and reports [`ConnectFailure::Refused`]. The listener
//! counts every rejection by [`RejectReason`] in [`SideChannelStats`] and logs it.
//!
//! # Bounds
//! - Every read has a deadline and a size limit ([`MAX_PAYLOAD_LEN`](wire::MAX_PAYLOAD_LEN)); payload buffers grow with
//!   the bytes that actually arrive, not with what a header announces.
//! - At most [`SideChannelConfig::max_concurrent`] incoming handshakes are served at once; a
//!   connection beyond that is closed at once and counted as [`RejectReason::Busy`].
//! - The [`PeerBook`] (engine → socket address) and the clock table hold at most
//!   [`SideChannelConfig::max_peer_addresses`] engines.
//!
//! # Clock offset
//! The initiator estimates the listener's clock offset as `remote - (t_send + t_recv) / 2`,
//! vLLM's formula, with `rtt = t_recv - t_send`; of consistent samples the lowest-RTT one is
//! kept, and a sample that contradicts the kept one (the peer restarted with a new clock) replaces
//! it. The listener records a one-way sample (`remote - t_recv`, no RTT) only while it has no
//! round-trip estimate. Clocks are microseconds since the rank's link started. The estimates are
//! reported in [`SideChannelStats::clocks`]; the protocol does not use them yet.

use std::collections::BTreeMap;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actix::clock::Instant;
use actix::Recipient;
use kvhandoff_protocol::{
    wire, EngineId, FieldError, GeometryError, Handshake, Message, MessageKind, TransferMode,
    WireError, PROTOCOL_VERSION,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

use super::rank::LinkUp;
use super::PeerInfo;
use crate::machine::ConnectFailure;
use crate::PeerAddr;

use wire::{HEADER_LEN, MAGIC};

/// Settings of one rank's TCP side channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SideChannelConfig {
    /// Where to listen; port 0 picks a free port (see [`RankHandle::side_channel`](super::RankHandle::side_channel)).
    pub listen: SocketAddr,
    /// How long a TCP connect to a peer may take.
    pub connect_timeout: Duration,
    /// How long reading one frame (header and payload together) or writing one may take; a peer
    /// that stalls longer is cut off.
    pub io_timeout: Duration,
    /// Most incoming handshakes served at once; beyond it new connections are closed at once.
    pub max_concurrent: usize,
    /// Most engines the [`PeerBook`] (and the clock table) holds.
    pub max_peer_addresses: usize,
    /// Transfer modes this rank advertises. A peer that advertises modes none of which are ours
    /// is rejected; an empty list on either side accepts any.
    pub modes: Vec<TransferMode>,
}

impl SideChannelConfig {
    /// Defaults (5 s timeouts as vLLM's side channel, 64 concurrent handshakes, 4096 engines,
    /// push mode) listening on `listen`.
    pub fn new(listen: SocketAddr) -> Self {
        SideChannelConfig {
            listen,
            connect_timeout: Duration::from_secs(5),
            io_timeout: Duration::from_secs(5),
            max_concurrent: 64,
            max_peer_addresses: 4096,
            modes: vec![TransferMode::Push],
        }
    }
}

impl Default for SideChannelConfig {
    /// [`SideChannelConfig::new`] on `127.0.0.1:0`.
    fn default() -> Self {
        SideChannelConfig::new(SocketAddr::from(([127, 0, 0, 1], 0)))
    }
}

/// The book is full and does not know the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the peer book is full ({limit} engines)")]
pub struct PeerBookFull {
    /// The book's bound.
    pub limit: usize,
}

/// Where to reach each remote engine's side channel: a bounded map engine id → socket address.
#[derive(Debug, Clone)]
pub struct PeerBook {
    limit: usize,
    entries: BTreeMap<EngineId, SocketAddr>,
}

impl PeerBook {
    /// An empty book of at most `limit` engines.
    pub fn new(limit: usize) -> Self {
        PeerBook {
            limit,
            entries: BTreeMap::new(),
        }
    }

    /// Records (or replaces) the address of `engine`; returns the address it replaced.
    ///
    /// # Errors
    /// [`PeerBookFull`] if `engine` is new and the book is full.
    pub fn insert(
        &mut self,
        engine: EngineId,
        addr: SocketAddr,
    ) -> Result<Option<SocketAddr>, PeerBookFull> {
        if !self.entries.contains_key(&engine) && self.entries.len() >= self.limit {
            return Err(PeerBookFull { limit: self.limit });
        }
        Ok(self.entries.insert(engine, addr))
    }

    /// The address of `engine`, if known.
    pub fn get(&self, engine: &EngineId) -> Option<SocketAddr> {
        self.entries.get(engine).copied()
    }

    /// Forgets `engine`; returns its address.
    pub fn remove(&mut self, engine: &EngineId) -> Option<SocketAddr> {
        self.entries.remove(engine)
    }

    /// Engines known.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when no engine is known.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// Tells a rank's link where `engine`'s side channel listens (from the connector's
/// `kv_transfer_params` `remote_host`/`remote_port`, or `kvhandoff node --peer`). Send it to
/// [`RankHandle::link`](super::RankHandle::link).
#[derive(actix::Message, Debug, Clone, PartialEq, Eq)]
#[rtype(result = "Result<(), PeerBookFull>")]
pub struct AddPeerAddress {
    /// The remote engine.
    pub engine: EngineId,
    /// Its side channel.
    pub addr: SocketAddr,
}

/// Asks a rank's link for its [`SideChannelStats`].
#[derive(actix::Message, Debug, Clone, Copy)]
#[rtype(result = "SideChannelStats")]
pub struct QuerySideChannel;

/// Why a handshake was rejected (listener) or failed (initiator).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RejectReason {
    /// Too many handshakes in progress; closed at once.
    Busy,
    /// The connection closed before a single byte.
    Closed,
    /// The connection closed in the middle of a frame.
    Truncated,
    /// The frame did not arrive (or could not be written) in time.
    TimedOut,
    /// Another socket error.
    Io,
    /// The frame does not start with the magic.
    BadMagic,
    /// The header's protocol version is not ours.
    UnsupportedVersion,
    /// The header's kind names no message.
    UnknownKind,
    /// Reserved header flags are set.
    ReservedFlags,
    /// The header announces more than [`MAX_PAYLOAD_LEN`](wire::MAX_PAYLOAD_LEN) bytes.
    PayloadTooLarge,
    /// A valid header of a message other than a handshake.
    WrongKind,
    /// The payload does not decode.
    Malformed,
    /// The handshake's own protocol version is not ours.
    ProtocolVersion,
    /// The handshake's geometry is invalid.
    InvalidGeometry,
    /// The region table does not match the geometry (count, block lengths, bounds).
    RegionTable,
    /// Another field breaks a rule (ids, list bounds).
    InvalidField,
    /// The compatibility hash is not ours.
    CompatMismatch,
    /// The geometry is valid but does not fit ours.
    Incompatible,
    /// No transfer mode in common.
    NoCommonMode,
    /// The handshake claims to come from our own engine.
    OwnEngine,
    /// The answer came from another engine than the one we dialled.
    UnexpectedEngine,
    /// The answer came from another rank than the one we dialled.
    UnexpectedRank,
    /// The rank could not load the peer.
    LoadFailed,
    /// No address is known for the engine (initiator).
    NoAddress,
    /// The TCP connect failed (initiator).
    ConnectRefused,
    /// The TCP connect timed out (initiator).
    ConnectTimedOut,
}

/// One clock-offset estimate of a peer engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClockEstimate {
    /// The peer's clock minus ours, in microseconds.
    pub offset_us: i64,
    /// The round trip the estimate came from (the error is at most half of it); `None` for a
    /// one-way sample from an incoming handshake, which overstates the offset by the one-way
    /// latency.
    pub rtt_us: Option<u64>,
}

impl ClockEstimate {
    fn round_trip(remote_us: u64, t_send_us: u64, t_recv_us: u64) -> Self {
        let mid = (i128::from(t_send_us) + i128::from(t_recv_us)) / 2;
        ClockEstimate {
            offset_us: clamp_i64(i128::from(remote_us) - mid),
            rtt_us: Some(t_recv_us.saturating_sub(t_send_us)),
        }
    }

    fn one_way(remote_us: u64, t_recv_us: u64) -> Self {
        ClockEstimate {
            offset_us: clamp_i64(i128::from(remote_us) - i128::from(t_recv_us)),
            rtt_us: None,
        }
    }

    /// Whether `self` should replace `old` (see the module docs).
    fn replaces(&self, old: &ClockEstimate) -> bool {
        match (self.rtt_us, old.rtt_us) {
            (None, None) => true,
            (None, Some(_)) => false,
            (Some(_), None) => true,
            (Some(new), Some(kept)) => {
                let apart = self.offset_us.abs_diff(old.offset_us);
                new < kept || apart > new.saturating_add(kept) / 2
            }
        }
    }
}

fn clamp_i64(v: i128) -> i64 {
    i64::try_from(v).unwrap_or(if v < 0 { i64::MIN } else { i64::MAX })
}

/// What a rank's side channel has done, for reports.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SideChannelStats {
    /// The bound listening address (`None` for an in-process link).
    pub listen: Option<SocketAddr>,
    /// Connections accepted by the listener (including those closed as busy).
    pub accepted: u64,
    /// Incoming handshakes that completed.
    pub incoming_ok: u64,
    /// Outgoing handshakes that completed.
    pub outgoing_ok: u64,
    /// Incoming connections rejected, by reason.
    pub rejected: BTreeMap<RejectReason, u64>,
    /// Outgoing handshakes that failed, by reason.
    pub outgoing_failed: BTreeMap<RejectReason, u64>,
    /// The latest kept clock-offset estimate of each peer engine.
    pub clocks: BTreeMap<EngineId, ClockEstimate>,
}

impl SideChannelStats {
    /// Incoming connections rejected for `reason`.
    pub fn rejections(&self, reason: RejectReason) -> u64 {
        self.rejected.get(&reason).copied().unwrap_or(0)
    }

    /// Incoming connections rejected, over all reasons.
    pub fn total_rejected(&self) -> u64 {
        self.rejected.values().sum()
    }

    /// Outgoing handshakes that failed for `reason`.
    pub fn failures(&self, reason: RejectReason) -> u64 {
        self.outgoing_failed.get(&reason).copied().unwrap_or(0)
    }
}

/// Why a handshake did not complete.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandshakeError {
    /// Too many handshakes in progress.
    #[error("too many handshakes in progress")]
    Busy,
    /// The peer closed before sending anything (for an initiator: it rejected us).
    #[error("the peer closed the side channel without a frame")]
    Closed,
    /// The peer closed in the middle of a frame.
    #[error("the peer closed the side channel after {got} of {wanted} bytes")]
    Truncated {
        /// Bytes received.
        got: usize,
        /// Bytes the frame needed.
        wanted: usize,
    },
    /// A read or write missed its deadline.
    #[error("the side channel timed out")]
    TimedOut,
    /// A socket error.
    #[error("side channel i/o error: {kind:?}: {detail}")]
    Io {
        /// Its kind.
        kind: io::ErrorKind,
        /// Its text.
        detail: String,
    },
    /// The frame is not a valid wire frame.
    #[error("bad frame: {0}")]
    Wire(#[from] WireError),
    /// A valid frame of another kind than a handshake.
    #[error("expected a handshake, got a {0:?} frame")]
    WrongKind(MessageKind),
    /// The compatibility hash is not ours.
    #[error("compatibility hash mismatch")]
    CompatMismatch,
    /// The region table does not match the geometry.
    #[error("region table: {0}")]
    RegionTable(String),
    /// The geometry does not fit ours.
    #[error("incompatible geometry: {0} differs")]
    Incompatible(&'static str),
    /// No transfer mode in common.
    #[error("no transfer mode in common (peer {peer:?}, ours {ours:?})")]
    NoCommonMode {
        /// The peer's modes.
        peer: Vec<TransferMode>,
        /// Ours.
        ours: Vec<TransferMode>,
    },
    /// The handshake names our own engine.
    #[error("the handshake names our own engine {0}")]
    OwnEngine(EngineId),
    /// The answer came from another engine than the one dialled.
    #[error("engine {found} answered, {expected} was expected")]
    UnexpectedEngine {
        /// Who answered.
        found: EngineId,
        /// Who was dialled.
        expected: EngineId,
    },
    /// The answer came from another rank than the one dialled.
    #[error("rank {found} answered, rank {expected} was expected")]
    UnexpectedRank {
        /// Who answered.
        found: u32,
        /// Who was dialled.
        expected: u32,
    },
    /// The rank could not load the peer.
    #[error("could not load the peer: {0}")]
    Load(String),
    /// No address is known for the engine.
    #[error("no address for engine")]
    NoAddress,
    /// The TCP connect failed.
    #[error("connect to {addr} failed: {detail}")]
    Connect {
        /// Where.
        addr: SocketAddr,
        /// The error.
        detail: String,
    },
    /// The TCP connect timed out.
    #[error("connect to {0} timed out")]
    ConnectTimedOut(SocketAddr),
}

impl HandshakeError {
    /// The counter this error goes to.
    pub fn reason(&self) -> RejectReason {
        match self {
            HandshakeError::Busy => RejectReason::Busy,
            HandshakeError::Closed => RejectReason::Closed,
            HandshakeError::Truncated { .. } => RejectReason::Truncated,
            HandshakeError::TimedOut => RejectReason::TimedOut,
            HandshakeError::Io { .. } => RejectReason::Io,
            HandshakeError::Wire(error) => wire_reason(error),
            HandshakeError::WrongKind(_) => RejectReason::WrongKind,
            HandshakeError::CompatMismatch => RejectReason::CompatMismatch,
            HandshakeError::RegionTable(_) => RejectReason::RegionTable,
            HandshakeError::Incompatible(_) => RejectReason::Incompatible,
            HandshakeError::NoCommonMode { .. } => RejectReason::NoCommonMode,
            HandshakeError::OwnEngine(_) => RejectReason::OwnEngine,
            HandshakeError::UnexpectedEngine { .. } => RejectReason::UnexpectedEngine,
            HandshakeError::UnexpectedRank { .. } => RejectReason::UnexpectedRank,
            HandshakeError::Load(_) => RejectReason::LoadFailed,
            HandshakeError::NoAddress => RejectReason::NoAddress,
            HandshakeError::Connect { .. } => RejectReason::ConnectRefused,
            HandshakeError::ConnectTimedOut(_) => RejectReason::ConnectTimedOut,
        }
    }

    /// What the initiating rank's endpoint is told.
    pub fn connect_failure(&self) -> ConnectFailure {
        match self.reason() {
            RejectReason::TimedOut | RejectReason::ConnectTimedOut => ConnectFailure::TimedOut,
            RejectReason::CompatMismatch
            | RejectReason::Incompatible
            | RejectReason::NoCommonMode
            | RejectReason::ProtocolVersion
            | RejectReason::UnsupportedVersion
            | RejectReason::InvalidGeometry
            | RejectReason::RegionTable => ConnectFailure::Incompatible,
            RejectReason::Closed => {
                ConnectFailure::Refused("the peer closed the side channel (rejected)".into())
            }
            RejectReason::Busy
            | RejectReason::Truncated
            | RejectReason::Io
            | RejectReason::BadMagic
            | RejectReason::UnknownKind
            | RejectReason::ReservedFlags
            | RejectReason::PayloadTooLarge
            | RejectReason::WrongKind
            | RejectReason::Malformed
            | RejectReason::InvalidField
            | RejectReason::OwnEngine
            | RejectReason::UnexpectedEngine
            | RejectReason::UnexpectedRank
            | RejectReason::LoadFailed
            | RejectReason::NoAddress
            | RejectReason::ConnectRefused => ConnectFailure::Refused(self.to_string()),
        }
    }

    /// A well-formed handshake from a peer that does not fit this rank (a deployment problem),
    /// as opposed to noise on the port.
    pub fn is_mismatch(&self) -> bool {
        matches!(
            self.reason(),
            RejectReason::ProtocolVersion
                | RejectReason::UnsupportedVersion
                | RejectReason::CompatMismatch
                | RejectReason::Incompatible
                | RejectReason::NoCommonMode
                | RejectReason::OwnEngine
                | RejectReason::UnexpectedEngine
                | RejectReason::UnexpectedRank
                | RejectReason::RegionTable
                | RejectReason::InvalidGeometry
                | RejectReason::LoadFailed
        )
    }

    fn io(error: io::Error) -> Self {
        match error.kind() {
            io::ErrorKind::TimedOut => HandshakeError::TimedOut,
            kind => HandshakeError::Io {
                kind,
                detail: error.to_string(),
            },
        }
    }
}

fn wire_reason(error: &WireError) -> RejectReason {
    match error {
        WireError::TruncatedHeader { .. } | WireError::TruncatedPayload { .. } => {
            RejectReason::Truncated
        }
        WireError::BadMagic { .. } => RejectReason::BadMagic,
        WireError::UnsupportedVersion { .. } => RejectReason::UnsupportedVersion,
        WireError::UnknownKind { .. } => RejectReason::UnknownKind,
        WireError::ReservedFlags { .. } => RejectReason::ReservedFlags,
        WireError::PayloadTooLarge { .. } => RejectReason::PayloadTooLarge,
        WireError::TrailingBytes { .. }
        | WireError::MalformedPayload { .. }
        | WireError::PayloadNotConsumed { .. } => RejectReason::Malformed,
        WireError::InvalidField { source, .. } => match source {
            FieldError::ProtocolVersion { .. } => RejectReason::ProtocolVersion,
            FieldError::RegionCount { .. }
            | FieldError::Geometry(GeometryError::BadRegion { .. }) => RejectReason::RegionTable,
            FieldError::Geometry(_) => RejectReason::InvalidGeometry,
            FieldError::Id(_)
            | FieldError::TooMany { .. }
            | FieldError::DuplicateBlock { .. }
            | FieldError::ZeroEpoch => RejectReason::InvalidField,
        },
    }
}

impl PeerInfo {
    /// This rank's handshake message, advertising `modes`, stamped with `clock_sample_us`.
    pub fn handshake(&self, modes: Vec<TransferMode>, clock_sample_us: u64) -> Handshake {
        Handshake {
            protocol_version: PROTOCOL_VERSION,
            engine_id: self.peer.engine.clone(),
            agent_name: self.agent.clone(),
            agent_metadata: self.metadata.clone(),
            regions: self.regions.clone(),
            geometry: self.geometry.clone(),
            compat_hash: self.compat,
            modes,
            clock_sample_us,
        }
    }

    /// The peer a received handshake describes: rank = its `geometry.tp_rank`.
    pub fn from_handshake(handshake: Handshake) -> PeerInfo {
        PeerInfo {
            peer: PeerAddr::new(handshake.engine_id, handshake.geometry.tp_rank),
            agent: handshake.agent_name,
            metadata: handshake.agent_metadata,
            regions: handshake.regions,
            geometry: handshake.geometry,
            compat: handshake.compat_hash,
        }
    }
}

/// The geometry rules both sides apply until heterogeneous transfers exist: the same per-rank
/// layout. Returns the first field that differs.
pub(crate) fn layout_mismatch(own: &PeerInfo, peer: &PeerInfo) -> Option<&'static str> {
    let (a, b) = (&own.geometry, &peer.geometry);
    if a.kernel_block_size != b.kernel_block_size {
        return Some("kernel_block_size");
    }
    if a.kernel_blocks_per_logical != b.kernel_blocks_per_logical {
        return Some("kernel_blocks_per_logical");
    }
    if a.layout != b.layout {
        return Some("layout");
    }
    if a.tp_size != b.tp_size {
        return Some("tp_size");
    }
    if a.pp_size != b.pp_size {
        return Some("pp_size");
    }
    if a.cache_groups != b.cache_groups {
        return Some("cache_groups");
    }
    if own.regions.len() != peer.regions.len() {
        return Some("region count");
    }
    if own
        .regions
        .iter()
        .zip(&peer.regions)
        .any(|(x, y)| x.block_len != y.block_len)
    {
        return Some("region block_len");
    }
    None
}

/// Checks a received handshake (already decoded, so its field rules hold) against this rank;
/// `expected` is the rank an initiator dialled.
pub(crate) fn validate_handshake(
    own: &PeerInfo,
    own_modes: &[TransferMode],
    handshake: &Handshake,
    expected: Option<&PeerAddr>,
) -> Result<(), HandshakeError> {
    if handshake.protocol_version != PROTOCOL_VERSION {
        return Err(HandshakeError::Wire(WireError::InvalidField {
            kind: MessageKind::Handshake,
            source: FieldError::ProtocolVersion {
                found: handshake.protocol_version,
                expected: PROTOCOL_VERSION,
            },
        }));
    }
    if handshake.engine_id == own.peer.engine {
        return Err(HandshakeError::OwnEngine(handshake.engine_id.clone()));
    }
    if let Some(expected) = expected {
        if handshake.engine_id != expected.engine {
            return Err(HandshakeError::UnexpectedEngine {
                found: handshake.engine_id.clone(),
                expected: expected.engine.clone(),
            });
        }
        if handshake.geometry.tp_rank != expected.rank {
            return Err(HandshakeError::UnexpectedRank {
                found: handshake.geometry.tp_rank,
                expected: expected.rank,
            });
        }
    }
    if handshake.compat_hash != own.compat {
        return Err(HandshakeError::CompatMismatch);
    }
    // Decoding checked the geometry, the table's length and each region on its own; the block
    // lengths must also be the geometry's.
    let specs = handshake
        .geometry
        .regions()
        .map_err(|e| HandshakeError::RegionTable(e.to_string()))?;
    if specs.len() != handshake.regions.len() {
        return Err(HandshakeError::RegionTable(format!(
            "{} regions for a geometry of {}",
            handshake.regions.len(),
            specs.len()
        )));
    }
    if let Some(i) = specs
        .iter()
        .zip(&handshake.regions)
        .position(|(spec, desc)| spec.block_len != desc.block_len)
    {
        return Err(HandshakeError::RegionTable(format!(
            "region {i}: block_len {} but the geometry says {}",
            handshake.regions[i].block_len, specs[i].block_len
        )));
    }
    for (i, region) in handshake.regions.iter().enumerate() {
        region
            .validate()
            .map_err(|e| HandshakeError::RegionTable(format!("region {i}: {e}")))?;
    }
    let as_peer = PeerInfo {
        peer: PeerAddr::new(handshake.engine_id.clone(), handshake.geometry.tp_rank),
        agent: handshake.agent_name.clone(),
        metadata: Vec::new(),
        regions: handshake.regions.clone(),
        geometry: handshake.geometry.clone(),
        compat: handshake.compat_hash,
    };
    if let Some(field) = layout_mismatch(own, &as_peer) {
        return Err(HandshakeError::Incompatible(field));
    }
    if !own_modes.is_empty()
        && !handshake.modes.is_empty()
        && !handshake.modes.iter().any(|m| own_modes.contains(m))
    {
        return Err(HandshakeError::NoCommonMode {
            peer: handshake.modes.clone(),
            ours: own_modes.to_vec(),
        });
    }
    Ok(())
}

/// Reads one handshake frame under `deadline`: header first (the magic checked as it arrives),
/// then exactly the announced payload, growing the buffer only with bytes that arrive.
pub(crate) async fn read_handshake<S>(
    stream: &mut S,
    deadline: Instant,
) -> Result<Handshake, HandshakeError>
where
    S: AsyncRead + Unpin,
{
    let mut header = [0u8; HEADER_LEN];
    let mut filled = 0;
    while filled < HEADER_LEN {
        let n = tokio::time::timeout_at(deadline, stream.read(&mut header[filled..]))
            .await
            .map_err(|_| HandshakeError::TimedOut)?
            .map_err(HandshakeError::io)?;
        if n == 0 {
            return Err(if filled == 0 {
                HandshakeError::Closed
            } else {
                HandshakeError::Truncated {
                    got: filled,
                    wanted: HEADER_LEN,
                }
            });
        }
        let seen = (filled + n).min(MAGIC.len());
        if header[..seen] != MAGIC[..seen] {
            let mut found = [0u8; 4];
            found[..seen].copy_from_slice(&header[..seen]);
            return Err(WireError::BadMagic { found }.into());
        }
        filled += n;
    }
    let announced = wire::decode_header(&header)?;
    if announced.kind != MessageKind::Handshake {
        return Err(HandshakeError::WrongKind(announced.kind));
    }
    // `decode_header` bounds `payload_len` by MAX_PAYLOAD_LEN; start small regardless.
    let mut frame = Vec::with_capacity(HEADER_LEN + announced.payload_len.min(64 << 10));
    frame.extend_from_slice(&header);
    let limit = u64::try_from(announced.payload_len).unwrap_or(u64::MAX);
    let got = tokio::time::timeout_at(deadline, (&mut *stream).take(limit).read_to_end(&mut frame))
        .await
        .map_err(|_| HandshakeError::TimedOut)?
        .map_err(HandshakeError::io)?;
    if got < announced.payload_len {
        return Err(HandshakeError::Truncated {
            got: HEADER_LEN + got,
            wanted: HEADER_LEN + announced.payload_len,
        });
    }
    match wire::decode(&frame)? {
        Message::Handshake(handshake) => Ok(*handshake),
        other => Err(HandshakeError::WrongKind(other.kind())),
    }
}

async fn write_frame<S>(
    stream: &mut S,
    frame: &[u8],
    deadline: Instant,
) -> Result<(), HandshakeError>
where
    S: AsyncWrite + Unpin,
{
    tokio::time::timeout_at(deadline, async {
        stream.write_all(frame).await?;
        stream.flush().await
    })
    .await
    .map_err(|_| HandshakeError::TimedOut)?
    .map_err(HandshakeError::io)
}

/// What both sides of a handshake know about this rank.
pub(crate) struct Local {
    pub(crate) info: PeerInfo,
    pub(crate) config: SideChannelConfig,
    origin: Instant,
}

impl Local {
    pub(crate) fn new(info: PeerInfo, config: SideChannelConfig) -> Self {
        Local {
            info,
            config,
            origin: Instant::now(),
        }
    }

    fn now_us(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    fn frame(&self) -> (Vec<u8>, u64) {
        let now = self.now_us();
        let handshake = self.info.handshake(self.config.modes.clone(), now);
        (wire::encode(&Message::Handshake(Box::new(handshake))), now)
    }

    /// Checks that this rank's own handshake is valid (so that encoding it cannot panic).
    pub(crate) fn check_own(&self) -> io::Result<()> {
        let handshake = self.info.handshake(self.config.modes.clone(), 0);
        Message::Handshake(Box::new(handshake))
            .validate()
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("own handshake: {e}")))
    }
}

/// State shared by the link actor and its connection tasks.
pub(crate) struct Shared {
    stats: Mutex<SideChannelStats>,
    max_clocks: usize,
}

impl Shared {
    pub(crate) fn new(listen: Option<SocketAddr>, max_clocks: usize) -> Self {
        Shared {
            stats: Mutex::new(SideChannelStats {
                listen,
                ..SideChannelStats::default()
            }),
            max_clocks,
        }
    }

    fn with<R>(&self, f: impl FnOnce(&mut SideChannelStats) -> R) -> R {
        let mut stats = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut stats)
    }

    pub(crate) fn snapshot(&self) -> SideChannelStats {
        self.with(|s| s.clone())
    }

    fn record_clock(&self, engine: &EngineId, estimate: ClockEstimate) {
        let max = self.max_clocks;
        self.with(|s| match s.clocks.get_mut(engine) {
            Some(kept) => {
                if estimate.replaces(kept) {
                    *kept = estimate;
                }
            }
            None => {
                if s.clocks.len() < max {
                    s.clocks.insert(engine.clone(), estimate);
                }
            }
        });
    }

    fn rejected(&self, reason: RejectReason) {
        self.with(|s| *s.rejected.entry(reason).or_insert(0) += 1);
    }

    pub(crate) fn outgoing_failed(&self, reason: RejectReason) {
        self.with(|s| *s.outgoing_failed.entry(reason).or_insert(0) += 1);
    }
}

/// Binds the listener (synchronously, inside the actix system's runtime).
pub(crate) fn bind(listen: SocketAddr) -> io::Result<(TcpListener, SocketAddr)> {
    let std_listener = std::net::TcpListener::bind(listen)?;
    std_listener.set_nonblocking(true)?;
    let listener = TcpListener::from_std(std_listener)?;
    let addr = listener.local_addr()?;
    Ok((listener, addr))
}

/// Accepts connections forever, each served in its own task, at most `max_concurrent` at once.
pub(crate) async fn accept_loop(
    listener: TcpListener,
    local: Arc<Local>,
    shared: Arc<Shared>,
    up: Recipient<LinkUp>,
) {
    let permits = Arc::new(Semaphore::new(
        local.config.max_concurrent.min(Semaphore::MAX_PERMITS),
    ));
    loop {
        let (stream, from) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(error) => {
                // Out of descriptors and the like: back off a little and keep serving.
                tracing::warn!(%error, "side channel accept failed");
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        shared.with(|s| s.accepted += 1);
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            tracing::debug!(%from, "side channel busy; connection closed");
            shared.rejected(RejectReason::Busy);
            drop(stream);
            continue;
        };
        let (local, shared, up) = (local.clone(), shared.clone(), up.clone());
        actix::spawn(async move {
            let mut stream = stream;
            match serve(&local, &mut stream, &up).await {
                Ok((info, clock)) => {
                    tracing::info!(peer = %info.peer, %from, "side channel handshake served");
                    shared.record_clock(&info.peer.engine, clock);
                    shared.with(|s| s.incoming_ok += 1);
                    let _ = stream.shutdown().await;
                }
                Err(error) => {
                    // Mismatched peers are worth a warning; noise (scanners, garbage, stalls)
                    // is only counted and logged at debug level.
                    if error.is_mismatch() {
                        tracing::warn!(%from, %error, "side channel handshake rejected");
                    } else {
                        tracing::debug!(%from, %error, "side channel connection rejected");
                    }
                    shared.rejected(error.reason());
                }
            }
            // Counted before the close, so whoever sees the close sees the count.
            drop(stream);
            drop(permit);
        });
    }
}

/// The listener's half: read, validate, hand to the rank, answer.
async fn serve(
    local: &Local,
    stream: &mut TcpStream,
    up: &Recipient<LinkUp>,
) -> Result<(PeerInfo, ClockEstimate), HandshakeError> {
    let deadline = Instant::now() + local.config.io_timeout;
    let handshake = read_handshake(stream, deadline).await?;
    let t_recv = local.now_us();
    validate_handshake(&local.info, &local.config.modes, &handshake, None)?;
    let clock = ClockEstimate::one_way(handshake.clock_sample_us, t_recv);
    let info = PeerInfo::from_handshake(handshake);
    link_up(up, info.clone()).await?;
    let (answer, _) = local.frame();
    let deadline = Instant::now() + local.config.io_timeout;
    write_frame(stream, &answer, deadline).await?;
    Ok((info, clock))
}

/// Hands a handshaken peer to the rank, which loads it and feeds `PeerConnected` (or, if the
/// load fails, `PeerConnectFailed`) atomically.
pub(crate) async fn link_up(up: &Recipient<LinkUp>, info: PeerInfo) -> Result<(), HandshakeError> {
    match up.send(LinkUp(info)).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(failure)) => Err(HandshakeError::Load(format!("{failure:?}"))),
        Err(_) => Err(HandshakeError::Load("rank unavailable".into())),
    }
}

/// The initiator's half: connect, send ours, read and validate theirs. Loading is the caller's.
pub(crate) async fn initiate(
    local: &Local,
    addr: SocketAddr,
    expected: &PeerAddr,
) -> Result<(PeerInfo, ClockEstimate), HandshakeError> {
    let mut stream =
        match tokio::time::timeout(local.config.connect_timeout, TcpStream::connect(addr)).await {
            Err(_) => return Err(HandshakeError::ConnectTimedOut(addr)),
            Ok(Err(error)) if error.kind() == io::ErrorKind::TimedOut => {
                return Err(HandshakeError::ConnectTimedOut(addr))
            }
            Ok(Err(error)) => {
                return Err(HandshakeError::Connect {
                    addr,
                    detail: error.to_string(),
                })
            }
            Ok(Ok(stream)) => stream,
        };
    let deadline = Instant::now() + local.config.io_timeout;
    let (frame, t_send) = local.frame();
    write_frame(&mut stream, &frame, deadline).await?;
    let handshake = read_handshake(&mut stream, deadline).await?;
    let t_recv = local.now_us();
    validate_handshake(&local.info, &local.config.modes, &handshake, Some(expected))?;
    let clock = ClockEstimate::round_trip(handshake.clock_sample_us, t_send, t_recv);
    Ok((PeerInfo::from_handshake(handshake), clock))
}

/// Records a completed outgoing handshake.
pub(crate) fn outgoing_ok(shared: &Shared, engine: &EngineId, clock: ClockEstimate) {
    shared.record_clock(engine, clock);
    shared.with(|s| s.outgoing_ok += 1);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_offsets_follow_vllm() {
        let e = ClockEstimate::round_trip(1_000_500, 100, 300);
        assert_eq!(
            e,
            ClockEstimate {
                offset_us: 1_000_300,
                rtt_us: Some(200)
            }
        );
        let back = ClockEstimate::round_trip(0, 1_000, 1_000);
        assert_eq!(back.offset_us, -1_000);
        assert_eq!(ClockEstimate::one_way(50, 80).offset_us, -30);
        assert_eq!(clamp_i64(i128::MAX), i64::MAX);
        assert_eq!(clamp_i64(i128::MIN), i64::MIN);
    }

    #[test]
    fn lower_rtt_wins_unless_the_clock_moved() {
        let kept = ClockEstimate {
            offset_us: 1_000,
            rtt_us: Some(100),
        };
        let better = ClockEstimate {
            offset_us: 1_010,
            rtt_us: Some(50),
        };
        let worse = ClockEstimate {
            offset_us: 1_010,
            rtt_us: Some(150),
        };
        let restarted = ClockEstimate {
            offset_us: -5_000,
            rtt_us: Some(150),
        };
        let one_way = ClockEstimate {
            offset_us: 0,
            rtt_us: None,
        };
        assert!(better.replaces(&kept));
        assert!(!worse.replaces(&kept));
        assert!(restarted.replaces(&kept));
        assert!(!one_way.replaces(&kept));
        assert!(kept.replaces(&one_way));
        assert!(one_way.replaces(&one_way));
    }

    #[test]
    fn the_book_is_bounded() {
        let e = |s: &str| EngineId::new(s).unwrap();
        let a: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let b: SocketAddr = "127.0.0.1:2".parse().unwrap();
        let mut book = PeerBook::new(1);
        assert!(book.is_empty());
        assert_eq!(book.insert(e("p"), a), Ok(None));
        assert_eq!(book.insert(e("p"), b), Ok(Some(a)));
        assert_eq!(book.insert(e("q"), a), Err(PeerBookFull { limit: 1 }));
        assert_eq!(book.get(&e("p")), Some(b));
        assert_eq!(book.len(), 1);
        assert_eq!(book.remove(&e("p")), Some(b));
        assert_eq!(book.get(&e("p")), None);
    }

    #[tokio::test]
    async fn frames_are_read_with_limits() {
        let far = Instant::now() + Duration::from_secs(5);
        let mut empty: &[u8] = &[];
        assert_eq!(
            read_handshake(&mut empty, far).await,
            Err(HandshakeError::Closed)
        );
        let mut garbage: &[u8] = b"KVX";
        assert!(matches!(
            read_handshake(&mut garbage, far).await,
            Err(HandshakeError::Wire(WireError::BadMagic { .. }))
        ));
        let mut short: &[u8] = b"KVHO\x01";
        assert_eq!(
            read_handshake(&mut short, far).await,
            Err(HandshakeError::Truncated {
                got: 5,
                wanted: HEADER_LEN
            })
        );
        let mut huge = Vec::from(MAGIC);
        huge.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        huge.extend_from_slice(&[MessageKind::Handshake as u8, 0]);
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        let err = read_handshake(&mut huge.as_slice(), far).await.unwrap_err();
        assert_eq!(err.reason(), RejectReason::PayloadTooLarge);
        let mut truncated = huge.clone();
        truncated[8..12].copy_from_slice(&100u32.to_le_bytes());
        truncated.extend_from_slice(&[0; 10]);
        assert_eq!(
            read_handshake(&mut truncated.as_slice(), far).await,
            Err(HandshakeError::Truncated {
                got: HEADER_LEN + 10,
                wanted: HEADER_LEN + 100
            })
        );
        let mut wrong = truncated.clone();
        wrong[6] = MessageKind::Register as u8;
        assert_eq!(
            read_handshake(&mut wrong.as_slice(), far).await,
            Err(HandshakeError::WrongKind(MessageKind::Register))
        );
    }
}
