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
//!    then exactly `payload_len` bytes, under one deadline for its whole part of the exchange:
//!    the rank's handshake timeout ([`ShellConfig::handshake_timeout`](super::ShellConfig::handshake_timeout)),
//!    the same budget the initiator has from its dial to its rank's load of the peer. It decodes and validates the handshake, hands the peer
//!    to its rank ([`LinkUp`]: the rank loads it into its transport and feeds
//!    `NetEvent::PeerConnected`, atomically), then answers with its own handshake frame and closes.
//! 3. The initiator reads and validates the answer the same way and hands the peer to its rank
//!    ([`LinkUp`]).
//!
//! This is exactly what the in-process [`Directory`](super::Directory) path does. A handshake
//! names the sender's incarnation: one repeating the incarnation the rank is connected to (a
//! late copy, a second dial, a replay) is answered but changes nothing (the peer is not
//! reloaded); one with a new incarnation is a restart, loaded and reported, and the endpoint
//! fails what the old incarnation served. The listener takes handshakes only from the engines
//! its [`AcceptPolicy`] admits (by default those in its [`PeerBook`]). An initiator whose handshake fails feeds
//! `NetEvent::PeerConnectFailed` ([`HandshakeError::connect_failure`]).
//!
//! **A rejection is a close with nothing written**: the protocol has no rejection message, and a
//! peer that breaks the rules learns nothing more from us. The initiator sees the connection
//! close (or reset) before an answer and reports [`ConnectFailure::Refused`]. The listener
//! counts every rejection by [`RejectReason`] in [`SideChannelStats`] and logs it.
//!
//! # Authentication
//! With a pre-shared key ([`SideChannelConfig::psk`], at least [`PSK_MIN_LEN`] bytes) every
//! exchange is authenticated by HMAC-SHA256 in a challenge–response around the unchanged
//! handshake frames; the protocol's messages and version are the same with or without it. The
//! auth frames are fixed-size (`KVHA`, auth version 1, step, two zero bytes, then the step's
//! body), so a peer controls no length in them:
//!
//! 1. initiator → listener: `Hello` with the initiator's fresh 32-byte nonce `nI`;
//! 2. listener → initiator: `Challenge` with its fresh nonce `nL` and its proof
//!    `HMAC(K, "listener proof" ‖ nI ‖ nL)`; the initiator checks it before it sends anything
//!    of its own ([`AuthFailure::BadProof`]: the keys differ);
//! 3. initiator → listener: its handshake frame `H_I`, then `Tag` with
//!    `HMAC(K, "initiator handshake" ‖ nI ‖ nL ‖ H_I)`; the listener verifies it before it
//!    decodes `H_I` ([`AuthFailure::BadMac`]);
//! 4. listener → initiator: its handshake frame `H_L`, then `Tag` with
//!    `HMAC(K, "listener handshake" ‖ nI ‖ nL ‖ H_I ‖ H_L)`, verified before `H_L` is decoded.
//!
//! Each MAC is over both sides' fresh nonces (so a recorded frame replayed on another
//! connection fails: the verifier's nonce is new), carries a label of its step (no MAC passes
//! for another step's) and covers the handshake bytes, length-prefixed (a forged or altered
//! handshake fails). Tags are compared in constant time (`hmac`'s `verify_slice`). Every
//! failure is [`HandshakeError::Authentication`], counted as
//! [`RejectReason::AuthenticationFailed`]; a rejection is still a close with nothing written,
//! and nothing of a rank's handshake is sent to a peer that has not proved the key. A rank with
//! a key takes no plain handshake ([`AuthFailure::PeerHasNoKey`]); a rank without one takes no
//! auth frame ([`AuthFailure::NoKeyHere`]). What each side sees of a refusal:
//!
//! | case | listener counts | initiator counts |
//! |---|---|---|
//! | keys differ | `Abandoned` (the initiator closed after the challenge) | `BadProof` |
//! | only the initiator has a key | `NoKeyHere` | `NoChallenge` (closed or reset before a challenge) |
//! | only the listener has a key | `PeerHasNoKey` | `Closed` (a plain refusal: it learns nothing) |
//! | replayed or altered frame | `BadMac` | — |
//!
//! (All but the keyless initiator's `Closed` are `AuthenticationFailed`. A busy listener also
//! closes before the challenge, so a keyed initiator may count that as `NoChallenge`.)
//!
//! It authenticates the handshake only: the NIXL data path, and the frames' confidentiality,
//! are not covered (see `docs/operations.md`, "Operations: authentication").
//!
//! # Bounds
//! - Every read has a deadline and a size limit ([`MAX_PAYLOAD_LEN`](wire::MAX_PAYLOAD_LEN)); payload buffers grow with
//!   the bytes that actually arrive, not with what a header announces.
//! - At most [`SideChannelConfig::max_concurrent`] incoming handshakes are served at once; a
//!   connection beyond that is closed at once and counted as [`RejectReason::Busy`].
//! - The [`PeerBook`] (peer rank → socket address) holds at most
//!   [`SideChannelConfig::max_peer_addresses`] peer ranks, the clock table as many engines.
//!
//! # Clock offset
//! The initiator estimates the listener's clock offset as `remote - (t_send + t_recv) / 2`,
//! vLLM's formula, with `rtt = t_recv - t_send`; of consistent samples the lowest-RTT one is
//! kept, and a sample that contradicts the kept one (the peer restarted with a new clock) replaces
//! it. The listener records a one-way sample (`remote - t_recv`, no RTT) only while it has no
//! round-trip estimate. Clocks are microseconds since the rank's link started. The estimates are
//! reported in [`SideChannelStats::clocks`]; the protocol does not use them yet.

mod auth;
mod error;
mod handshake;
mod psk;
mod tasks;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::time::Duration;

use kvhandoff_protocol::{wire, EngineId, Message, PeerAddr, TransferMode};

use super::messages::LinkUp;
use kvhandoff_protocol::machine::ConnectFailure;

use wire::{HEADER_LEN, MAGIC};

pub use auth::{AuthFailure, MAC_LEN, NONCE_LEN};
pub use error::HandshakeError;
pub(crate) use handshake::layout_mismatch;
pub use psk::{Psk, PskError, PSK_MAX_LEN, PSK_MIN_LEN};
pub(crate) use tasks::{
    accept_loop, bind, initiate, link_up, outgoing_ok, remaining, Local, Shared,
};

/// Settings of one rank's TCP side channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SideChannelConfig {
    /// Where to listen; port 0 picks a free port (see [`RankHandle::side_channel`](super::RankHandle::side_channel)).
    pub listen: SocketAddr,
    /// How long a TCP connect to a peer may take.
    pub connect_timeout: Duration,
    /// Most incoming handshakes served at once; beyond it new connections are closed at once.
    pub max_concurrent: usize,
    /// Most peer ranks the [`PeerBook`] holds (and engines the clock table holds).
    pub max_peer_addresses: usize,
    /// Transfer modes this rank advertises. A peer that advertises modes none of which are ours
    /// is rejected; an empty list on either side accepts any.
    pub modes: Vec<TransferMode>,
    /// Which engines' incoming handshakes the listener takes.
    pub accept: AcceptPolicy,
    /// The pre-shared key that authenticates every exchange (see "Authentication" above);
    /// `None` (the default) runs the plain exchange. Both sides must have the same key, or
    /// both none.
    pub psk: Option<Psk>,
}

/// Which engines' incoming handshakes a listener takes. A handshake is what makes a rank load a
/// peer and, for a new incarnation of a connected one, fail what the old one was serving: so it
/// is taken only from engines the rank has reason to talk to.
///
/// ```
/// use std::collections::BTreeSet;
/// use kvhandoff_actors::system::AcceptPolicy;
/// use kvhandoff_protocol::EngineId;
/// let prefill = EngineId::new("prefill-0").unwrap();
/// let policy = AcceptPolicy::Known(BTreeSet::from([prefill.clone()]));
/// assert!(policy.lists(&prefill));
/// assert!(!AcceptPolicy::default().lists(&prefill));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AcceptPolicy {
    /// Engines whose side-channel address the rank was given ([`AddPeerAddress`](super::AddPeerAddress)), and the
    /// engines listed here (for a P whose D engines dial it first). The default, with an empty
    /// list.
    Known(BTreeSet<EngineId>),
    /// Any engine with a valid, compatible handshake: only where every host that can reach the
    /// port is trusted (a replayed handshake with a new incarnation makes the rank fail the
    /// requests of the engine it names; the fence keeps that safe, not free).
    AnyEngine,
}

impl Default for AcceptPolicy {
    fn default() -> Self {
        AcceptPolicy::Known(BTreeSet::new())
    }
}

impl AcceptPolicy {
    /// Whether the policy itself names `engine` (the peer book is the other source).
    pub fn lists(&self, engine: &EngineId) -> bool {
        match self {
            AcceptPolicy::Known(listed) => listed.contains(engine),
            AcceptPolicy::AnyEngine => true,
        }
    }
}

impl SideChannelConfig {
    /// Defaults (a 5 s connect timeout as vLLM's side channel, 64 concurrent handshakes, 4096 engines,
    /// push, pull and bidirectional modes, handshakes taken from known engines only) listening
    /// on `listen`.
    pub fn new(listen: SocketAddr) -> Self {
        SideChannelConfig {
            listen,
            connect_timeout: Duration::from_secs(5),
            max_concurrent: 64,
            max_peer_addresses: 4096,
            modes: vec![
                TransferMode::Push,
                TransferMode::Pull,
                TransferMode::Bidirectional,
            ],
            accept: AcceptPolicy::default(),
            psk: None,
        }
    }
}

impl Default for SideChannelConfig {
    /// [`SideChannelConfig::new`] on `127.0.0.1:0`.
    fn default() -> Self {
        SideChannelConfig::new(SocketAddr::from(([127, 0, 0, 1], 0)))
    }
}

/// The book is full and does not know the peer rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the peer book is full ({limit} peer ranks)")]
pub struct PeerBookFull {
    /// The book's bound.
    pub limit: usize,
}

/// Where to reach each remote rank's side channel: a bounded map peer rank (engine and rank
/// index) → socket address. Keyed by rank, not by engine, because every rank of an engine
/// listens on its own port (vLLM's base port + rank): a D rank fed by several P ranks of one
/// engine (heterogeneous TP) needs each one's address.
///
/// ```
/// use kvhandoff_actors::system::PeerBook;
/// use kvhandoff_protocol::{EngineId, PeerAddr};
/// let prefill = EngineId::new("prefill").unwrap();
/// let mut book = PeerBook::new(2);
/// book.insert(PeerAddr::new(prefill.clone(), 0), "10.0.0.7:5600".parse().unwrap()).unwrap();
/// book.insert(PeerAddr::new(prefill.clone(), 1), "10.0.0.7:5601".parse().unwrap()).unwrap();
/// assert_eq!(book.get(&PeerAddr::new(prefill.clone(), 1)), Some("10.0.0.7:5601".parse().unwrap()));
/// assert_eq!(book.get(&PeerAddr::new(prefill, 2)), None);
/// ```
#[derive(Debug, Clone)]
pub struct PeerBook {
    limit: usize,
    entries: BTreeMap<PeerAddr, SocketAddr>,
}

impl PeerBook {
    /// An empty book of at most `limit` peer ranks.
    pub fn new(limit: usize) -> Self {
        PeerBook {
            limit,
            entries: BTreeMap::new(),
        }
    }

    /// Records (or replaces) the address of `peer`; returns the address it replaced.
    ///
    /// # Errors
    /// [`PeerBookFull`] if `peer` is new and the book is full.
    pub fn insert(
        &mut self,
        peer: PeerAddr,
        addr: SocketAddr,
    ) -> Result<Option<SocketAddr>, PeerBookFull> {
        if !self.entries.contains_key(&peer) && self.entries.len() >= self.limit {
            return Err(PeerBookFull { limit: self.limit });
        }
        Ok(self.entries.insert(peer, addr))
    }

    /// The address of `peer`, if known.
    pub fn get(&self, peer: &PeerAddr) -> Option<SocketAddr> {
        self.entries.get(peer).copied()
    }

    /// Forgets `peer`; returns its address.
    pub fn remove(&mut self, peer: &PeerAddr) -> Option<SocketAddr> {
        self.entries.remove(peer)
    }

    /// Peer ranks known.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when no peer rank is known.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// Why a handshake was rejected (listener) or failed (initiator).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[cfg_attr(test, derive(strum::EnumIter))]
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
    /// The listener does not accept handshakes from the engine ([`AcceptPolicy`]).
    NotAccepted,
    /// No address is known for the engine (initiator).
    NoAddress,
    /// The TCP connect failed (initiator).
    ConnectRefused,
    /// The TCP connect timed out (initiator).
    ConnectTimedOut,
    /// The pre-shared-key authentication failed: the keys differ, one side has none, or a MAC
    /// does not verify (an altered or replayed frame); see [`AuthFailure`].
    AuthenticationFailed,
}

impl RejectReason {
    /// Every reason: each has its series from the first scrape.
    pub const ALL: [RejectReason; 28] = [
        RejectReason::Busy,
        RejectReason::Closed,
        RejectReason::Truncated,
        RejectReason::TimedOut,
        RejectReason::Io,
        RejectReason::BadMagic,
        RejectReason::UnsupportedVersion,
        RejectReason::UnknownKind,
        RejectReason::ReservedFlags,
        RejectReason::PayloadTooLarge,
        RejectReason::WrongKind,
        RejectReason::Malformed,
        RejectReason::ProtocolVersion,
        RejectReason::InvalidGeometry,
        RejectReason::RegionTable,
        RejectReason::InvalidField,
        RejectReason::CompatMismatch,
        RejectReason::Incompatible,
        RejectReason::NoCommonMode,
        RejectReason::OwnEngine,
        RejectReason::UnexpectedEngine,
        RejectReason::UnexpectedRank,
        RejectReason::LoadFailed,
        RejectReason::NotAccepted,
        RejectReason::NoAddress,
        RejectReason::ConnectRefused,
        RejectReason::ConnectTimedOut,
        RejectReason::AuthenticationFailed,
    ];

    /// The stable `reason` label (snake_case) of the rejection metrics.
    pub const fn label(self) -> &'static str {
        match self {
            RejectReason::Busy => "busy",
            RejectReason::Closed => "closed",
            RejectReason::Truncated => "truncated",
            RejectReason::TimedOut => "timed_out",
            RejectReason::Io => "io",
            RejectReason::BadMagic => "bad_magic",
            RejectReason::UnsupportedVersion => "unsupported_version",
            RejectReason::UnknownKind => "unknown_kind",
            RejectReason::ReservedFlags => "reserved_flags",
            RejectReason::PayloadTooLarge => "payload_too_large",
            RejectReason::WrongKind => "wrong_kind",
            RejectReason::Malformed => "malformed",
            RejectReason::ProtocolVersion => "protocol_version",
            RejectReason::InvalidGeometry => "invalid_geometry",
            RejectReason::RegionTable => "region_table",
            RejectReason::InvalidField => "invalid_field",
            RejectReason::CompatMismatch => "compat_mismatch",
            RejectReason::Incompatible => "incompatible",
            RejectReason::NoCommonMode => "no_common_mode",
            RejectReason::OwnEngine => "own_engine",
            RejectReason::UnexpectedEngine => "unexpected_engine",
            RejectReason::UnexpectedRank => "unexpected_rank",
            RejectReason::LoadFailed => "load_failed",
            RejectReason::NotAccepted => "not_accepted",
            RejectReason::NoAddress => "no_address",
            RejectReason::ConnectRefused => "connect_refused",
            RejectReason::ConnectTimedOut => "connect_timed_out",
            RejectReason::AuthenticationFailed => "authentication_failed",
        }
    }
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

#[cfg(test)]
mod tests;
