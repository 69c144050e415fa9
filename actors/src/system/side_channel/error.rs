//! [`HandshakeError`]: why a handshake did not complete, and the counter each error goes to.

use std::io;
use std::net::SocketAddr;

use kvhandoff_protocol::{
    EngineId, FieldError, GeometryError, MessageKind, TransferMode, WireError,
};

use super::auth::AuthFailure;
use super::{ConnectFailure, RejectReason};

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
    /// The peer's geometry differs from ours and this rank's transfer route cannot place a
    /// pair with it (a heterogeneous pair that is not the planned one).
    #[error("heterogeneous peer refused by the route: {0}")]
    RouteRefused(String),
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
    /// The listener does not accept handshakes from this engine ([`AcceptPolicy`](super::AcceptPolicy)).
    #[error("handshakes from engine {0} are not accepted here")]
    NotAccepted(EngineId),
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
    /// The pre-shared-key authentication failed ([`SideChannelConfig::psk`](super::SideChannelConfig::psk)).
    #[error("authentication failed: {0}")]
    Authentication(AuthFailure),
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
            HandshakeError::Incompatible(_) | HandshakeError::RouteRefused(_) => {
                RejectReason::Incompatible
            }
            HandshakeError::NoCommonMode { .. } => RejectReason::NoCommonMode,
            HandshakeError::OwnEngine(_) => RejectReason::OwnEngine,
            HandshakeError::UnexpectedEngine { .. } => RejectReason::UnexpectedEngine,
            HandshakeError::UnexpectedRank { .. } => RejectReason::UnexpectedRank,
            HandshakeError::Load(_) => RejectReason::LoadFailed,
            HandshakeError::NotAccepted(_) => RejectReason::NotAccepted,
            HandshakeError::NoAddress => RejectReason::NoAddress,
            HandshakeError::Connect { .. } => RejectReason::ConnectRefused,
            HandshakeError::ConnectTimedOut(_) => RejectReason::ConnectTimedOut,
            HandshakeError::Authentication(_) => RejectReason::AuthenticationFailed,
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
            | RejectReason::NotAccepted
            | RejectReason::NoAddress
            | RejectReason::ConnectRefused
            | RejectReason::AuthenticationFailed => ConnectFailure::Refused(self.to_string()),
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
                | RejectReason::NotAccepted
                | RejectReason::AuthenticationFailed
        )
    }

    pub(super) fn io(error: io::Error) -> Self {
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
            | FieldError::TraceId(_)
            | FieldError::TooMany { .. }
            | FieldError::DuplicateBlock { .. }
            | FieldError::BadPart { .. }
            | FieldError::EmptySpan
            | FieldError::ZeroEpoch => RejectReason::InvalidField,
        },
    }
}
