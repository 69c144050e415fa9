//! Handshakes: building and reading them, validating them against this rank, and the frame I/O
//! of one exchange.

use actix::clock::Instant;
use kvhandoff_protocol::{
    FieldError, Handshake, MessageKind, PeerAddr, TransferMode, WireError, PROTOCOL_VERSION,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::auth::{read_header, AuthFailure, AUTH_MAGIC};
use super::{wire, HandshakeError, Message, HEADER_LEN, MAGIC};
use kvhandoff_protocol::driver::{PeerInfo, SharedRoute};

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
    route: Option<&SharedRoute>,
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
        if handshake.geometry.rank_index() != expected.rank {
            return Err(HandshakeError::UnexpectedRank {
                found: handshake.geometry.rank_index(),
                expected: expected.rank,
            });
        }
    }
    if handshake.compat_hash != own.compat {
        return Err(HandshakeError::CompatMismatch);
    }
    check_pairing(own, handshake, route)?;
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

/// Reads one handshake frame under `deadline` and decodes it (see [`read_frame`]).
pub(crate) async fn read_handshake<S>(
    stream: &mut S,
    deadline: Instant,
) -> Result<Handshake, HandshakeError>
where
    S: AsyncRead + Unpin,
{
    let frame = read_frame(stream, deadline).await?;
    decode_handshake(&frame)
}

/// Decodes a handshake frame read by [`read_frame`].
pub(crate) fn decode_handshake(frame: &[u8]) -> Result<Handshake, HandshakeError> {
    match wire::decode(frame)? {
        Message::Handshake(handshake) => Ok(*handshake),
        other => Err(HandshakeError::WrongKind(other.kind())),
    }
}

/// Reads the bytes of one handshake frame under `deadline`: header first (the magic checked as
/// it arrives), then exactly the announced payload, growing the buffer only with bytes that
/// arrive. An auth frame's magic in its place is [`AuthFailure::NoKeyHere`]: the peer has a
/// pre-shared key, this rank none.
pub(crate) async fn read_frame<S>(
    stream: &mut S,
    deadline: Instant,
) -> Result<Vec<u8>, HandshakeError>
where
    S: AsyncRead + Unpin,
{
    let mut header = [0u8; HEADER_LEN];
    read_header(
        stream,
        &mut header,
        (&MAGIC, &AUTH_MAGIC, AuthFailure::NoKeyHere),
        deadline,
    )
    .await?;
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
    Ok(frame)
}

pub(super) async fn write_frame<S>(
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

/// Whether this rank can place transfers with the rank `handshake` describes. Two ranks that
/// plan from their region tables need the same per-rank layout, and the peer's table must be
/// its geometry's (the block lengths included). A routed rank on either side (a heterogeneous
/// pair: its table lists buffers, [`Handshake::routed`]) pairs only when this rank's route
/// accepts the peer's geometry; its table is then the buffers the route's pieces may use,
/// bounded and checked one by one when the frame was decoded.
fn check_pairing(
    own: &PeerInfo,
    handshake: &Handshake,
    route: Option<&SharedRoute>,
) -> Result<(), HandshakeError> {
    for (i, region) in handshake.regions.iter().enumerate() {
        region
            .validate()
            .map_err(|e| HandshakeError::RegionTable(format!("region {i}: {e}")))?;
    }
    if !handshake.routed {
        // Decoding checked the geometry and the table's length; the block lengths must also be
        // the geometry's.
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
    }
    let as_peer = PeerInfo {
        peer: PeerAddr::new(handshake.engine_id.clone(), handshake.geometry.rank_index()),
        agent: handshake.agent_name.clone(),
        metadata: Vec::new(),
        regions: handshake.regions.clone(),
        geometry: handshake.geometry.clone(),
        compat: handshake.compat_hash,
        incarnation: handshake.incarnation,
        routed: handshake.routed,
    };
    let mismatch = if own.routed || handshake.routed {
        Some("routed")
    } else {
        layout_mismatch(own, &as_peer)
    };
    let Some(field) = mismatch else {
        return Ok(());
    };
    match route {
        Some(route) => route
            .accepts(&own.geometry, &handshake.geometry)
            .map_err(|refused| HandshakeError::RouteRefused(refused.0)),
        None => Err(HandshakeError::Incompatible(field)),
    }
}
