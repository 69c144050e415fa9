//! Every message the actors of a rank exchange, and those the engine side sends them, in one
//! place: the actors depend on this module, never on each other's files.
//!
//! Who handles what: the [`RankActor`](super::RankActor) takes [`Call`], [`Calls`], [`Feed`],
//! [`LinkUp`], [`QueryStats`] and [`QueryCounters`]; the [`TransportActor`](super::TransportActor)
//! takes [`TransportOps`], [`LoadPeer`] and [`QueryTransportStats`]; the
//! [`LinkActor`](super::LinkActor) takes [`Connect`], [`Hello`], [`AddPeerAddress`] and
//! [`QuerySideChannel`].

use std::net::SocketAddr;

use actix::Message;
use kvhandoff_protocol::driver::{PeerInfo, TransportOp, TransportStats};
use kvhandoff_protocol::machine::{
    ConnectFailure, Counters, EndpointStats, EngineCall, NetEvent, Rejected,
};
use kvhandoff_protocol::{EngineId, PeerAddr};

use super::side_channel::{PeerBookFull, SideChannelStats};
use crate::transport::TransportError;

/// Receives whether an engine input was accepted.
pub type Verdict = Box<dyn FnOnce(Result<(), Rejected>) + Send>;

/// An engine's call into its rank, and where to send the verdict.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Call {
    /// The call.
    pub call: EngineCall,
    /// Called with whether the call was accepted.
    pub reply: Option<Verdict>,
}

/// Receives, in order, whether each call of a [`Calls`] batch was accepted.
pub type Verdicts = Box<dyn FnOnce(Vec<Result<(), Rejected>>) + Send>;

/// A batch of engine calls (one engine step's worth): the inputs are handled in order, the
/// verdicts come back together, and the outputs are flushed once for the whole batch.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Calls {
    /// The calls, in order.
    pub calls: Vec<EngineCall>,
    /// Where the peers these calls need listen (a TCP rank's side channel, from the router's
    /// `remote_host`/`remote_port`): the rank hands them to its link before it runs the calls,
    /// so an engine talks to its rank only. Empty for in-process ranks.
    pub addresses: Vec<AddPeerAddress>,
    /// Called with one verdict per call, in the same order.
    pub reply: Option<Verdicts>,
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

/// Tells a rank's link where `engine`'s side channel listens (from the connector's
/// `kv_transfer_params` `remote_host`/`remote_port`, or `kvhandoff node --peer`). Send it to
/// [`RankHandle::link`](super::RankHandle::link).
#[derive(Message, Debug, Clone, PartialEq, Eq)]
#[rtype(result = "Result<(), PeerBookFull>")]
pub struct AddPeerAddress {
    /// The remote engine.
    pub engine: EngineId,
    /// Its side channel.
    pub addr: SocketAddr,
}

/// Asks a rank's link for its [`SideChannelStats`].
#[derive(Message, Debug, Clone, Copy)]
#[rtype(result = "SideChannelStats")]
pub struct QuerySideChannel;
