//! The versioned wire codec of [`Message`].
//!
//! A frame is a 12-byte header followed by a bincode 2 (serde) payload:
//!
//! | bytes | field | value |
//! |---|---|---|
//! | 0..4 | magic | `b"KVHO"` |
//! | 4..6 | protocol version | `u16`, little endian ([`PROTOCOL_VERSION`]) |
//! | 6 | kind | [`MessageKind`] code |
//! | 7 | flags | `0` (reserved) |
//! | 8..12 | payload length | `u32`, little endian, at most [`MAX_PAYLOAD_LEN`] |
//!
//! The payload is the message's struct (not the enum) in bincode's standard configuration
//! (little endian, variable-length integers), decoded under bincode's size limit of
//! [`MAX_PAYLOAD_LEN`] so that a hostile length prefix inside the payload cannot make the decoder
//! allocate what it claims. (The limit counts *decoded* sizes, 8 bytes for every `u64` however
//! short its varint, so it can trip before the input ends; every valid message stays well below
//! it.)
//! Decoding checks every field rule ([`Message::validate`]).
//!
//! ```
//! use kvhandoff_protocol::{wire, Cancel, CancelReason, Epoch, Message, PairingKey};
//! let msg = Message::Cancel(Cancel {
//!     key: PairingKey::new("cmpl-1-0").unwrap(),
//!     epoch: Epoch::FIRST,
//!     reason: CancelReason::Deadline,
//! });
//! let bytes = wire::encode(&msg);
//! assert_eq!(wire::decode(&bytes).unwrap(), msg);
//! assert!(wire::decode(&bytes[..bytes.len() - 1]).is_err());
//! ```

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::message::{FieldError, Message, MessageKind};

/// The protocol version this build speaks. Any change to the wire format or the meaning of a
/// message changes it.
pub const PROTOCOL_VERSION: u16 = 8;
/// The four bytes every frame starts with.
pub const MAGIC: [u8; 4] = *b"KVHO";
/// Bytes in a frame header.
pub const HEADER_LEN: usize = 12;
/// Most payload bytes a frame may carry; also bincode's decode limit, which bounds what any
/// one length prefix can make the decoder allocate.
pub const MAX_PAYLOAD_LEN: usize = 2 << 20;

/// Why bytes are not a valid frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Fewer bytes than a header.
    #[error("frame of {len} bytes is shorter than the {HEADER_LEN}-byte header")]
    TruncatedHeader {
        /// Bytes given.
        len: usize,
    },
    /// The frame does not start with [`MAGIC`].
    #[error("bad magic {found:02x?}")]
    BadMagic {
        /// The first four bytes.
        found: [u8; 4],
    },
    /// A protocol version this build does not speak.
    #[error("protocol version {found} is not supported (this build speaks {PROTOCOL_VERSION})")]
    UnsupportedVersion {
        /// The version in the header.
        found: u16,
    },
    /// A kind code that names no message.
    #[error("unknown message kind {code}")]
    UnknownKind {
        /// The code in the header.
        code: u8,
    },
    /// Reserved flag bits are set.
    #[error("reserved flags {flags:#04x} are set")]
    ReservedFlags {
        /// The flags byte.
        flags: u8,
    },
    /// The header announces more payload than [`MAX_PAYLOAD_LEN`].
    #[error("payload length {len} exceeds the limit of {MAX_PAYLOAD_LEN}")]
    PayloadTooLarge {
        /// The announced length.
        len: u64,
    },
    /// Fewer payload bytes than the header announces.
    #[error("payload truncated: header announces {announced} bytes, {available} present")]
    TruncatedPayload {
        /// Announced length.
        announced: usize,
        /// Bytes after the header.
        available: usize,
    },
    /// Bytes after the announced payload.
    #[error("{extra} trailing bytes after the payload")]
    TrailingBytes {
        /// How many.
        extra: usize,
    },
    /// The payload is not a valid encoding of the kind's struct.
    #[error("{kind:?} payload is malformed: {detail}")]
    MalformedPayload {
        /// The kind being decoded.
        kind: MessageKind,
        /// The decoder's description.
        detail: String,
    },
    /// The payload decoded but left bytes unread.
    #[error("{kind:?} payload has {extra} unread bytes")]
    PayloadNotConsumed {
        /// The kind being decoded.
        kind: MessageKind,
        /// Unread bytes.
        extra: usize,
    },
    /// The payload decoded but a field breaks a rule.
    #[error("{kind:?} has an invalid field: {source}")]
    InvalidField {
        /// The kind being decoded.
        kind: MessageKind,
        /// The rule that broke.
        #[source]
        source: FieldError,
    },
}

type Config = bincode::config::Configuration<
    bincode::config::LittleEndian,
    bincode::config::Varint,
    bincode::config::Limit<MAX_PAYLOAD_LEN>,
>;

fn config() -> Config {
    bincode::config::standard().with_limit::<MAX_PAYLOAD_LEN>()
}

/// Appends `value`'s payload to `frame`.
fn append_payload<T: Serialize>(frame: &mut Vec<u8>, value: &T) {
    // Serializing plain data structs into a Vec cannot fail; the limit only guards decoding, and
    // `validate` bounds every list well below it.
    bincode::serde::encode_into_std_write(value, frame, config()).unwrap_or_else(|err| {
        unreachable!("bincode cannot fail to encode a message struct: {err}")
    });
}

/// Room a frame starts with: every message but a long heartbeat or register fits, so encoding
/// allocates once.
const FRAME_START_CAPACITY: usize = 256;

/// Encodes `message` as one frame.
///
/// # Panics
/// If the encoded payload would exceed [`MAX_PAYLOAD_LEN`]: only a message that breaks its own
/// limits (see [`Message::validate`]) can do that, and that is a bug in the caller.
pub fn encode(message: &Message) -> Vec<u8> {
    let mut frame = Vec::with_capacity(FRAME_START_CAPACITY);
    frame.extend_from_slice(&MAGIC);
    frame.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    frame.push(message.kind() as u8);
    frame.push(0);
    // The payload's length, filled in once the payload is written after it.
    frame.extend_from_slice(&[0; 4]);
    debug_assert_eq!(frame.len(), HEADER_LEN);
    match message {
        Message::Handshake(m) => append_payload(&mut frame, m.as_ref()),
        Message::Register(m) => append_payload(&mut frame, m),
        Message::WriteDone(m) => append_payload(&mut frame, m),
        Message::WriteFailed(m) => append_payload(&mut frame, m),
        Message::Cancel(m) => append_payload(&mut frame, m),
        Message::CancelAck(m) => append_payload(&mut frame, m),
        Message::Heartbeat(m) => append_payload(&mut frame, m),
        Message::Release(m) => append_payload(&mut frame, m),
        Message::ReadAsk(m) => append_payload(&mut frame, m),
        Message::ReadGrant(m) => append_payload(&mut frame, m.as_ref()),
        Message::ReadRefused(m) => append_payload(&mut frame, m),
        Message::WritePartDone(m) => append_payload(&mut frame, m),
    }
    let payload_len = frame.len() - HEADER_LEN;
    assert!(
        payload_len <= MAX_PAYLOAD_LEN,
        "message of {payload_len} bytes breaks the wire limit"
    );
    frame[HEADER_LEN - 4..HEADER_LEN].copy_from_slice(&(payload_len as u32).to_le_bytes());
    frame
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// The message kind.
    pub kind: MessageKind,
    /// Payload bytes that follow the header.
    pub payload_len: usize,
}

/// Decodes and checks a frame header; useful to size a read from a stream before the payload
/// arrives.
///
/// # Errors
/// Any header-level [`WireError`].
pub fn decode_header(bytes: &[u8]) -> Result<Header, WireError> {
    let Some(header) = bytes.get(..HEADER_LEN) else {
        return Err(WireError::TruncatedHeader { len: bytes.len() });
    };
    let magic = [header[0], header[1], header[2], header[3]];
    if magic != MAGIC {
        return Err(WireError::BadMagic { found: magic });
    }
    let version = u16::from_le_bytes([header[4], header[5]]);
    if version != PROTOCOL_VERSION {
        return Err(WireError::UnsupportedVersion { found: version });
    }
    let kind =
        MessageKind::from_code(header[6]).ok_or(WireError::UnknownKind { code: header[6] })?;
    if header[7] != 0 {
        return Err(WireError::ReservedFlags { flags: header[7] });
    }
    let len = u32::from_le_bytes([header[8], header[9], header[10], header[11]]);
    let payload_len = usize::try_from(len).map_err(|_| WireError::PayloadTooLarge {
        len: u64::from(len),
    })?;
    if payload_len > MAX_PAYLOAD_LEN {
        return Err(WireError::PayloadTooLarge {
            len: u64::from(len),
        });
    }
    Ok(Header { kind, payload_len })
}

fn payload<T: DeserializeOwned>(kind: MessageKind, bytes: &[u8]) -> Result<T, WireError> {
    let (value, read) =
        bincode::serde::decode_from_slice::<T, _>(bytes, config()).map_err(|err| {
            WireError::MalformedPayload {
                kind,
                detail: err.to_string(),
            }
        })?;
    if read != bytes.len() {
        return Err(WireError::PayloadNotConsumed {
            kind,
            extra: bytes.len() - read,
        });
    }
    Ok(value)
}

/// Decodes one whole frame: exactly one header and the payload it announces.
///
/// Never panics, whatever the input, and allocates a bounded amount: no single string or list
/// preallocates more than [`MAX_PAYLOAD_LEN`] bytes whatever its length prefix claims, and in
/// all a hostile frame makes it allocate at most a small multiple of [`MAX_PAYLOAD_LEN`]
/// (6x, measured by `tests/alloc.rs`, for a frame full of empty lists).
///
/// # Errors
/// A [`WireError`] that says which rule the bytes break.
pub fn decode(bytes: &[u8]) -> Result<Message, WireError> {
    let header = decode_header(bytes)?;
    let body = &bytes[HEADER_LEN..];
    if body.len() < header.payload_len {
        return Err(WireError::TruncatedPayload {
            announced: header.payload_len,
            available: body.len(),
        });
    }
    if body.len() > header.payload_len {
        return Err(WireError::TrailingBytes {
            extra: body.len() - header.payload_len,
        });
    }
    let kind = header.kind;
    let message = match kind {
        MessageKind::Handshake => Message::Handshake(Box::new(payload(kind, body)?)),
        MessageKind::Register => Message::Register(Box::new(payload(kind, body)?)),
        MessageKind::WriteDone => Message::WriteDone(payload(kind, body)?),
        MessageKind::WriteFailed => Message::WriteFailed(payload(kind, body)?),
        MessageKind::Cancel => Message::Cancel(payload(kind, body)?),
        MessageKind::CancelAck => Message::CancelAck(payload(kind, body)?),
        MessageKind::Heartbeat => Message::Heartbeat(payload(kind, body)?),
        MessageKind::Release => Message::Release(payload(kind, body)?),
        MessageKind::ReadAsk => Message::ReadAsk(payload(kind, body)?),
        MessageKind::ReadGrant => Message::ReadGrant(Box::new(payload(kind, body)?)),
        MessageKind::ReadRefused => Message::ReadRefused(payload(kind, body)?),
        MessageKind::WritePartDone => Message::WritePartDone(payload(kind, body)?),
    };
    message
        .validate()
        .map_err(|source| WireError::InvalidField { kind, source })?;
    Ok(message)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CancelAck, Epoch, Handshake, PairingKey};

    fn ack() -> Message {
        Message::CancelAck(CancelAck {
            key: PairingKey::new("k").unwrap(),
            epoch: Epoch(300),
            prefill_rank: 2,
        })
    }

    #[test]
    fn constants_are_the_documented_ones() {
        assert_eq!(PROTOCOL_VERSION, 8);
        assert_eq!(&MAGIC, b"KVHO");
        assert_eq!(HEADER_LEN, 12);
        assert_eq!(MAX_PAYLOAD_LEN, 2 * 1024 * 1024);
    }

    #[test]
    fn header_layout() {
        let bytes = encode(&ack());
        assert_eq!(&bytes[0..4], b"KVHO");
        assert_eq!(&bytes[4..6], &[8, 0]);
        assert_eq!(bytes[6], MessageKind::CancelAck as u8);
        assert_eq!(bytes[7], 0);
        assert_eq!(
            u32::from_le_bytes(bytes[8..12].try_into().unwrap()) as usize,
            bytes.len() - HEADER_LEN
        );
        assert_eq!(
            decode_header(&bytes),
            Ok(Header {
                kind: MessageKind::CancelAck,
                payload_len: bytes.len() - HEADER_LEN
            })
        );
    }

    #[test]
    fn payload_is_the_struct_in_standard_bincode() {
        // key: length 1 + "k"; epoch 300: varint marker 251 + u16 LE; rank 2: one byte. No enum
        // tag: the header's kind says which struct follows.
        let bytes = encode(&ack());
        assert_eq!(&bytes[HEADER_LEN..], &[1, b'k', 251, 44, 1, 2]);
    }

    #[test]
    fn decode_header_needs_only_the_header() {
        let bytes = encode(&ack());
        assert!(decode_header(&bytes[..HEADER_LEN]).is_ok());
        assert_eq!(
            decode_header(&bytes[..HEADER_LEN - 1]),
            Err(WireError::TruncatedHeader {
                len: HEADER_LEN - 1
            })
        );
    }

    #[test]
    #[should_panic(expected = "breaks the wire limit")]
    fn encoding_a_message_over_the_wire_limit_panics() {
        // Breaks its own limit (agent metadata above MAX_AGENT_METADATA), so `encode` refuses.
        let h = Handshake {
            protocol_version: PROTOCOL_VERSION,
            engine_id: crate::EngineId::new("p").unwrap(),
            incarnation: crate::Incarnation(1),
            agent_name: crate::AgentName::new("a").unwrap(),
            agent_metadata: vec![0; MAX_PAYLOAD_LEN],
            regions: vec![],
            geometry: crate::KvGeometry {
                num_layers: 1,
                total_kv_heads: 1,
                head_dim: 1,
                dtype_bytes: 1,
                kernel_block_size: 1,
                kernel_blocks_per_logical: 1,
                layout: crate::KvLayout::Nhd,
                tp_size: 1,
                tp_rank: 0,
                pp_size: 1,
                pp_rank: 0,
                mla: false,
                cache_groups: vec![],
            },
            compat_hash: crate::CompatHash([0; 32]),
            modes: vec![],
            clock_sample_us: 0,
            trace_id: crate::TraceId::from_u128(0x7ace),
            routed: false,
        };
        let _ = encode(&Message::Handshake(Box::new(h)));
    }

    #[test]
    fn errors_display() {
        assert_eq!(
            WireError::UnsupportedVersion { found: 1 }.to_string(),
            "protocol version 1 is not supported (this build speaks 8)"
        );
        assert_eq!(
            WireError::BadMagic { found: *b"GET " }.to_string(),
            "bad magic [47, 45, 54, 20]"
        );
        assert_eq!(
            WireError::ReservedFlags { flags: 1 }.to_string(),
            "reserved flags 0x01 are set"
        );
    }
}
