//! The rules a decoded message must keep beyond its types ([`Message::validate`]): id rules,
//! list bounds, epochs, geometry, layer-wise parts; and the typed error that names the broken one.

use super::{
    MemorySpan, Message, WritePartDone, MAX_AGENT_METADATA, MAX_HEARTBEAT_LEASES, MAX_REGIONS,
    MAX_REGISTER_SPANS, MAX_ROUTED_BUFFERS, MAX_TRANSFER_MODES, MAX_WRITE_LAYERS,
};
use crate::ids::{Epoch, IdError};
use crate::trace::TraceIdError;

/// A field of a decoded message that breaks a rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FieldError {
    /// An identifier is invalid.
    #[error(transparent)]
    Id(#[from] IdError),
    /// A trace id is invalid (all zeros).
    #[error(transparent)]
    TraceId(#[from] TraceIdError),
    /// A list is longer than its limit.
    #[error("{field}: {len} entries, above the limit of {limit}")]
    TooMany {
        /// The field.
        field: &'static str,
        /// Its length.
        len: usize,
        /// The limit.
        limit: usize,
    },
    /// A block id appears twice in one group.
    #[error("block {block} is listed twice in one group")]
    DuplicateBlock {
        /// The repeated id.
        block: u32,
    },
    /// The epoch is zero (epochs start at 1).
    #[error("epoch 0 is not a valid attempt")]
    ZeroEpoch,
    /// The handshake's geometry is invalid.
    #[error("geometry: {0}")]
    Geometry(#[from] crate::GeometryError),
    /// A [`Register`](super::Register) or a [`ReadGrant`](super::ReadGrant) names an empty
    /// memory span, or one past the end of the address space.
    #[error("a registration or grant names an empty memory span or one past the address space")]
    EmptySpan,
    /// The handshake's region table does not match its geometry.
    #[error("region table has {regions} entries but the geometry defines {expected}")]
    RegionCount {
        /// Entries in the table.
        regions: usize,
        /// Regions the geometry defines.
        expected: usize,
    },
    /// A layer-wise part names no layers, layers past its write's, or more than
    /// [`MAX_WRITE_LAYERS`].
    #[error("write part of layers {first}+{count} of {of} is out of range")]
    BadPart {
        /// The part's first layer.
        first: u32,
        /// Its layer count.
        count: u32,
        /// The write's layers.
        of: u32,
    },
    /// The handshake's own protocol version differs from its frame's.
    #[error("handshake speaks protocol version {found}, its frame version {expected}")]
    ProtocolVersion {
        /// The version in the handshake.
        found: u16,
        /// The version of the frame (this build's).
        expected: u16,
    },
}

impl Message {
    /// Checks every field rule that the type system does not: id rules, list bounds, epochs,
    /// geometry. [`crate::wire::decode`] calls this on everything it decodes.
    ///
    /// # Errors
    /// The first broken rule.
    pub fn validate(&self) -> Result<(), FieldError> {
        if let Some((key, epoch)) = self.lease() {
            key.validate()?;
            check_epoch(epoch)?;
        }
        match self {
            Message::Handshake(h) => {
                if h.protocol_version != crate::PROTOCOL_VERSION {
                    return Err(FieldError::ProtocolVersion {
                        found: h.protocol_version,
                        expected: crate::PROTOCOL_VERSION,
                    });
                }
                h.engine_id.validate()?;
                h.agent_name.validate()?;
                h.trace_id.validate()?;
                check_len("agent metadata", h.agent_metadata.len(), MAX_AGENT_METADATA)?;
                check_len("regions", h.regions.len(), MAX_REGIONS)?;
                check_len("transfer modes", h.modes.len(), MAX_TRANSFER_MODES)?;
                h.geometry.validate()?;
                let expected = if h.routed {
                    if h.regions.is_empty() {
                        return Err(FieldError::RegionCount {
                            regions: 0,
                            expected: 1,
                        });
                    }
                    check_len("routed buffers", h.regions.len(), MAX_ROUTED_BUFFERS)?;
                    h.regions.len()
                } else {
                    h.geometry.regions()?.len()
                };
                if h.regions.len() != expected {
                    return Err(FieldError::RegionCount {
                        regions: h.regions.len(),
                        expected,
                    });
                }
                for region in &h.regions {
                    region.validate()?;
                }
                Ok(())
            }
            Message::Register(m) => {
                m.decode_engine.validate()?;
                m.decode_request.validate()?;
                m.trace_id.validate()?;
                check_spans("register spans", &m.memory)?;
                m.blocks.validate()
            }
            Message::Heartbeat(m) => {
                m.engine.validate()?;
                check_len("heartbeat leases", m.leases.len(), MAX_HEARTBEAT_LEASES)?;
                for lease in &m.leases {
                    lease.key.validate()?;
                    check_epoch(lease.epoch)?;
                }
                Ok(())
            }
            Message::ReadAsk(m) => {
                m.reader_request.validate()?;
                Ok(m.trace_id.validate()?)
            }
            Message::ReadGrant(m) => {
                check_spans("grant spans", &m.memory)?;
                m.blocks.validate()
            }
            Message::WritePartDone(m) => {
                check_part(m)?;
                check_digests(&m.digests)
            }
            Message::WriteDone(m) => check_digests(&m.digests),
            Message::WriteFailed(_)
            | Message::Cancel(_)
            | Message::CancelAck(_)
            | Message::Release(_)
            | Message::ReadRefused(_) => Ok(()),
        }
    }
}

pub(super) fn check_epoch(epoch: Epoch) -> Result<(), FieldError> {
    if epoch.0 == 0 {
        return Err(FieldError::ZeroEpoch);
    }
    Ok(())
}

pub(super) fn check_part(part: &WritePartDone) -> Result<(), FieldError> {
    let end = part.first.checked_add(part.count);
    if part.count == 0 || part.of > MAX_WRITE_LAYERS || end.is_none_or(|end| end > part.of) {
        return Err(FieldError::BadPart {
            first: part.first,
            count: part.count,
            of: part.of,
        });
    }
    Ok(())
}

pub(super) fn check_digests(digests: &[u64]) -> Result<(), FieldError> {
    check_len(
        "write digests",
        digests.len(),
        crate::integrity::MAX_WRITE_DIGESTS,
    )
}

pub(super) fn check_len(field: &'static str, len: usize, limit: usize) -> Result<(), FieldError> {
    if len > limit {
        return Err(FieldError::TooMany { field, len, limit });
    }
    Ok(())
}

/// The memory a registration or a grant names: at most [`MAX_REGISTER_SPANS`] spans, each
/// non-empty and inside the address space.
pub(super) fn check_spans(field: &'static str, spans: &[MemorySpan]) -> Result<(), FieldError> {
    check_len(field, spans.len(), MAX_REGISTER_SPANS)?;
    if spans
        .iter()
        .any(|s| s.len == 0 || s.addr.checked_add(s.len).is_none())
    {
        return Err(FieldError::EmptySpan);
    }
    Ok(())
}
