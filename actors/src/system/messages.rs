//! Every message the actors of a rank exchange, and those the engine side sends them, in one
//! place: the actors depend on this module, never on each other's files.
//!
//! Who handles what: the [`RankActor`](super::RankActor) takes [`Calls`], [`Call`],
//! [`ConfigureSession`], [`SetLinks`], [`Feed`], [`LinkUp`], [`ClockMeasured`], [`QueryStats`]
//! and [`QueryCounters`]; the [`TransportActor`](super::TransportActor)
//! takes [`TransportOps`], [`LoadPeer`] and [`QueryTransportStats`]; the
//! [`LinkActor`](super::LinkActor) takes [`Connect`], [`Hello`], [`AddPeerAddress`] and
//! [`QuerySideChannel`].

use std::net::SocketAddr;

use actix::Message;
use kvhandoff_protocol::driver::{PeerInfo, TransportOp, TransportStats};
use kvhandoff_protocol::machine::{
    ConnectFailure, Counters, EndpointCall, EndpointStats, NetEvent, Rejected,
};
use kvhandoff_protocol::session::{
    ConnectorCall, ConnectorError, ConnectorIdentity, ConnectorReply, ConnectorSettings, RankLinks,
};
use kvhandoff_protocol::{EngineId, PeerAddr};

use super::side_channel::{PeerBookFull, SideChannelStats};
use crate::transport::TransportError;

/// Receives whether an engine input was accepted.
pub type Verdict = Box<dyn FnOnce(Result<(), Rejected>) + Send>;

/// A call in the endpoint's own terms (keys, epochs, peer ranks), past the rank's session: for
/// tests of the shells and tools that speak the protocol directly. Engines send [`Calls`].
#[derive(Message)]
#[rtype(result = "()")]
pub struct Call {
    /// The call.
    pub call: EndpointCall,
    /// Called with whether the call was accepted.
    pub reply: Option<Verdict>,
}

/// Receives, in order, each call's result of a [`Calls`] batch.
pub type Verdicts = Box<dyn FnOnce(Vec<Result<ConnectorReply, ConnectorError>>) + Send>;

/// A batch of the engine's calls (one engine step's worth), for the rank's
/// [`Session`](kvhandoff_protocol::session::Session): handled in order, the results come back
/// together, and the outputs are flushed once for the whole batch.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Calls {
    /// The calls, in order.
    pub calls: Vec<ConnectorCall>,
    /// Called with one result per call, in the same order.
    pub reply: Option<Verdicts>,
}

/// Tells the rank's session whom it speaks for and with which settings (sent by the
/// connector when it is made; calls after it use them).
#[derive(Message, Debug, Clone)]
#[rtype(result = "()")]
pub struct ConfigureSession {
    /// The engine rank's identity.
    pub identity: ConnectorIdentity,
    /// The connector's settings.
    pub settings: ConnectorSettings,
    /// Lowers the bound on multi-rank requests in progress (tests of the bound).
    pub fan_limit: Option<usize>,
}

/// Gives the rank's session its links to the other engine's ranks
/// ([`Session::set_links`](kvhandoff_protocol::session::Session::set_links)).
#[derive(Message, Debug, Clone)]
#[rtype(result = "Result<(), ConnectorError>")]
pub struct SetLinks(pub RankLinks);

/// Gives the rank's session its links for a conversation's later turns, the pair planned the
/// other way ([`Session::set_turn_links`](kvhandoff_protocol::session::Session::set_turn_links)).
#[derive(Message, Debug, Clone)]
#[rtype(result = "Result<(), ConnectorError>")]
pub struct SetTurnLinks(pub RankLinks);

/// The side channel measured a peer engine's clock (peer minus ours, µs) at a handshake.
#[derive(Message, Debug, Clone)]
#[rtype(result = "()")]
pub struct ClockMeasured {
    /// The peer engine.
    pub engine: EngineId,
    /// Its clock minus ours, in microseconds.
    pub offset_us: i64,
}

/// Events from the transport actor (completions, notifications) or the link (handshakes).
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub struct Feed(pub Vec<NetEvent>);

/// Asks for the endpoint's table sizes.
#[derive(Message)]
#[rtype(result = "EndpointStats")]
pub struct QueryStats;

/// A handshake finished: load the peer into the transport, then tell the endpoint. Handled
/// atomically (no other message or timer runs in between), so every transport operation the
/// endpoint asks for is ordered correctly around the load.
#[derive(Message, Debug)]
#[rtype(result = "Result<(), ConnectFailure>")]
pub struct LinkUp(pub PeerInfo);

/// Asks for the endpoint's counters.
#[derive(Message)]
#[rtype(result = "Counters")]
pub struct QueryCounters;

/// A batch of [`TransportOp`]s, in order.
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub struct TransportOps(pub Vec<TransportOp>);

/// The rank actor tells its transport actor whether the rank has live work that an arrival may
/// advance (sent when that changes); a transport that must poll for arrivals polls eagerly
/// only then ([`Transport::set_expecting`](crate::transport::Transport::set_expecting)).
#[derive(Message, Debug, Clone, Copy, PartialEq, Eq)]
#[rtype(result = "()")]
pub struct Expecting(pub bool);

/// Loads a peer into the transport (from the link actor, during a handshake).
#[derive(Message, Debug)]
#[rtype(result = "Result<(), TransportError>")]
pub struct LoadPeer(pub PeerInfo);

/// Asks the transport actor for its counters.
#[derive(Message)]
#[rtype(result = "TransportStats")]
pub struct QueryTransportStats;

/// The rank actor asks for a handshake with a peer.
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub struct Connect(pub PeerAddr);

/// A peer's handshake arrives in process: check it, and hand it to the rank ([`LinkUp`]: load,
/// then `PeerConnected`).
#[derive(Message, Debug)]
#[rtype(result = "Result<(), ConnectFailure>")]
pub struct Hello(pub PeerInfo);

/// Tells a rank's link where one rank of another engine listens (from the connector's
/// `kv_transfer_params` `remote_host`/`remote_port` plus the peer's rank, or `kvhandoff node
/// --peer`), and so to take that engine's handshakes. Send it to
/// [`RankHandle::link`](super::RankHandle::link).
#[derive(Message, Debug, Clone, PartialEq, Eq)]
#[rtype(result = "Result<(), PeerBookFull>")]
pub struct AddPeerAddress {
    /// The remote rank (engine and rank index): each rank of an engine has its own address.
    pub peer: PeerAddr,
    /// Its side channel.
    pub addr: SocketAddr,
}

/// Asks a rank's link for its [`SideChannelStats`].
#[derive(Message, Debug, Clone, Copy)]
#[rtype(result = "SideChannelStats")]
pub struct QuerySideChannel;
