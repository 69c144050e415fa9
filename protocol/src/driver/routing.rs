//! The shells' small decisions beside the driver: where each endpoint output goes ([`route`])
//! and what a finished handshake means for a rank ([`handshake_step`], [`connected_input`]).

use crate::machine::{Endpoint, EndpointEvent, NetEvent, Output};
use crate::PeerAddr;

#[cfg(doc)]
use super::TransportDriver;
use super::{PeerInfo, TransportOp};

/// Where a shell sends one endpoint output.
#[derive(Debug)]
pub enum Routed {
    /// To the transport's driver ([`TransportDriver::perform`]).
    Transport(TransportOp),
    /// To the link: start a handshake with the peer.
    Connect(PeerAddr),
    /// To the engine.
    Event(EndpointEvent),
}

/// Routes one endpoint output (the one mapping every shell uses).
pub fn route(output: Output) -> Routed {
    match output {
        Output::Send { to, message } => Routed::Transport(TransportOp::Send { to, message }),
        Output::PostWrite(order) => Routed::Transport(TransportOp::PostWrite(order)),
        Output::ExtendWrite { write, from, to } => {
            Routed::Transport(TransportOp::ExtendWrite { write, from, to })
        }
        Output::PostRead(order) => Routed::Transport(TransportOp::PostRead(order)),
        Output::AbandonWrite { write } => Routed::Transport(TransportOp::Abandon(write)),
        Output::Invalidate { peer } => Routed::Transport(TransportOp::Invalidate(peer)),
        Output::Connect { peer } => Routed::Connect(peer),
        Output::Event(event) => Routed::Event(event),
    }
}

/// What a finished handshake means for a rank whose endpoint is `endpoint`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HandshakeStep {
    /// It repeats the incarnation the endpoint is connected to: feed this event and nothing
    /// else (reloading the peer would cut the live connection).
    Repeat(NetEvent),
    /// A new peer or a new incarnation: load the peer into the transport first, then feed
    /// [`connected_input`] with the load's result.
    Load,
}

/// Decides what a handshake from `peer` means (see [`HandshakeStep`]).
pub fn handshake_step(endpoint: &Endpoint, peer: &PeerInfo) -> HandshakeStep {
    if endpoint.connected_incarnation(&peer.peer) == Some(peer.incarnation) {
        HandshakeStep::Repeat(NetEvent::PeerConnected {
            peer: peer.peer.clone(),
            incarnation: peer.incarnation,
        })
    } else {
        HandshakeStep::Load
    }
}

/// The event that reports a handshake whose load into the transport ended with `loaded`.
pub fn connected_input(
    peer: &PeerInfo,
    loaded: &Result<(), crate::machine::ConnectFailure>,
) -> NetEvent {
    match loaded {
        Ok(()) => NetEvent::PeerConnected {
            peer: peer.peer.clone(),
            incarnation: peer.incarnation,
        },
        Err(reason) => NetEvent::PeerConnectFailed {
            peer: peer.peer.clone(),
            reason: reason.clone(),
        },
    }
}
