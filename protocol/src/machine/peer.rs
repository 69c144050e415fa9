//! `Peer`: one remote engine rank as this endpoint sees it — handshake, liveness, death.
//!
//! ```text
//!   Connecting --Connected--> Connected --silence > peer_timeout / Lost--> Dead --ttl--> (forgotten)
//!      |  \--failed / deadline--> (forgotten)   ^  |\--Connected(another incarnation): the peer
//!      '-------------------------------------------'  |   restarted (old one dead, new one up)
//!                                                     '--Connected(same incarnation): a repeated
//!                                                         handshake; heard from, nothing else
//!   Dead --ConnectRequested--> Connecting;  Dead --Connected--> Connected
//! ```
//!
//! A handshake names the sender's [`Incarnation`]: only a new one is a restart. A late copy of
//! a concurrent handshake, a second dial or a replay of the live incarnation's handshake must not
//! fail the requests the live peer is serving.

use std::collections::VecDeque;

use crate::{Incarnation, Message};

use super::effects::Outbox;
use super::shape::Machine;
use super::types::{ConnectFailure, Time};
use super::Config;

/// A handshake is in progress; messages for the peer wait here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PeerConnecting {
    pub(crate) deadline: Time,
    pub(crate) queued: VecDeque<Message>,
}

/// The peer is reachable and heard from recently.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PeerUp {
    pub(crate) last_heard: Time,
    pub(crate) next_heartbeat: Time,
    /// The process run this connection reaches.
    pub(crate) incarnation: Incarnation,
}

/// The peer was declared dead; remembered until `until` so its late messages are recognised.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PeerDown {
    pub(crate) until: Time,
}

/// One remote rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Peer {
    Connecting(PeerConnecting),
    Connected(PeerUp),
    Dead(PeerDown),
}

/// What can happen to a peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PeerInput {
    /// A request needs the peer.
    ConnectRequested,
    /// A handshake finished with this incarnation of the peer.
    Connected(Incarnation),
    /// A handshake failed.
    ConnectFailed(ConnectFailure),
    /// A message arrived from the peer.
    Heard,
    /// The side channel or transport lost the peer.
    Lost,
    /// A timer is due.
    Timeout,
}

/// What the endpoint must do after a peer transition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PeerNotice {
    /// Nothing.
    Quiet,
    /// Start a handshake.
    Connect,
    /// The peer is up: send these queued messages, wake the requests waiting for it.
    Up(Vec<Message>),
    /// The peer restarted: its old incarnation is dead (invalidate, fail its requests), and the
    /// new one is up.
    Restarted,
    /// A handshake repeated the connected incarnation: nothing changes (it counts as hearing
    /// from the peer).
    Repeated,
    /// The handshake failed: fail the requests waiting for it; queued messages are dropped.
    ConnectFailed(ConnectFailure),
    /// The peer is dead: invalidate it and fail every request bound to it.
    Died,
    /// Send the peer a heartbeat now.
    HeartbeatDue,
    /// A message from a peer that is not connected; drop it.
    NotConnected,
    /// Forget the peer.
    Forget,
}

impl Peer {
    /// A new peer whose handshake is starting.
    pub(crate) fn connecting(now: Time, config: &Config) -> Peer {
        Peer::Connecting(PeerConnecting {
            deadline: now + config.connect_timeout,
            queued: VecDeque::new(),
        })
    }

    /// A new peer that connected to us.
    pub(crate) fn connected(now: Time, config: &Config, incarnation: Incarnation) -> Peer {
        Peer::Connected(PeerUp {
            last_heard: now,
            next_heartbeat: now + config.heartbeat_interval,
            incarnation,
        })
    }

    /// The incarnation a connected peer's connection reaches.
    pub(crate) fn incarnation(&self) -> Option<Incarnation> {
        match self {
            Peer::Connected(s) => Some(s.incarnation),
            Peer::Connecting(_) | Peer::Dead(_) => None,
        }
    }

    pub(crate) fn is_connected(&self) -> bool {
        match self {
            Peer::Connected(_) => true,
            Peer::Connecting(_) | Peer::Dead(_) => false,
        }
    }

    /// Whether the peer is connected but silent past its timeout at `now`: its timer is due to
    /// declare it dead (and has not run yet).
    pub(crate) fn overdue(&self, now: Time, config: &Config) -> bool {
        match self {
            Peer::Connected(s) => now >= s.last_heard + config.peer_timeout,
            Peer::Connecting(_) | Peer::Dead(_) => false,
        }
    }

    pub(crate) fn is_dead(&self) -> bool {
        match self {
            Peer::Dead(_) => true,
            Peer::Connecting(_) | Peer::Connected(_) => false,
        }
    }

    /// Queues a message until the handshake finishes. Returns false (and drops it) if the peer
    /// is not connecting or its queue is full.
    pub(crate) fn queue(&mut self, message: Message, config: &Config) -> bool {
        match self {
            Peer::Connecting(s) if s.queued.len() < config.max_queued_per_peer => {
                s.queued.push_back(message);
                true
            }
            Peer::Connecting(_) | Peer::Connected(_) | Peer::Dead(_) => false,
        }
    }
}

/// What a peer transition reads besides the state.
pub(crate) struct PeerCtx<'a> {
    pub(crate) now: Time,
    pub(crate) config: &'a Config,
}

impl Machine for Peer {
    type Ctx<'a> = PeerCtx<'a>;
    type Input = PeerInput;
    /// A peer never ends by itself: its owner forgets it on the notices that say so.
    type Next = (Peer, PeerNotice);

    /// When the peer next needs [`PeerInput::Timeout`].
    fn next_timer(&self, config: &Config) -> Time {
        match self {
            Peer::Connecting(s) => s.deadline,
            Peer::Connected(s) => s.next_heartbeat.min(s.last_heard + config.peer_timeout),
            Peer::Dead(s) => s.until,
        }
    }

    fn handle(self, ctx: &Self::Ctx<'_>, input: Self::Input, _fx: &mut Outbox) -> Self::Next {
        let (now, config) = (ctx.now, ctx.config);
        match self {
            Peer::Connecting(s) => s.handle(now, config, input),
            Peer::Connected(s) => s.handle(now, config, input),
            Peer::Dead(s) => s.handle(now, config, input),
        }
    }
}

fn dead(now: Time, config: &Config) -> Peer {
    Peer::Dead(PeerDown {
        until: now + config.tombstone_ttl,
    })
}

impl PeerConnecting {
    fn handle(self, now: Time, config: &Config, input: PeerInput) -> (Peer, PeerNotice) {
        match input {
            PeerInput::Connected(incarnation) => (
                Peer::connected(now, config, incarnation),
                PeerNotice::Up(self.queued.into_iter().collect()),
            ),
            PeerInput::ConnectFailed(reason) => {
                (Peer::Connecting(self), PeerNotice::ConnectFailed(reason))
            }
            PeerInput::Lost => (
                Peer::Connecting(self),
                PeerNotice::ConnectFailed(ConnectFailure::Refused("peer lost".into())),
            ),
            PeerInput::Timeout if now >= self.deadline => (
                Peer::Connecting(self),
                PeerNotice::ConnectFailed(ConnectFailure::TimedOut),
            ),
            PeerInput::Timeout | PeerInput::ConnectRequested => {
                (Peer::Connecting(self), PeerNotice::Quiet)
            }
            PeerInput::Heard => (Peer::Connecting(self), PeerNotice::NotConnected),
        }
    }
}

impl PeerUp {
    fn handle(mut self, now: Time, config: &Config, input: PeerInput) -> (Peer, PeerNotice) {
        match input {
            PeerInput::Heard => {
                self.last_heard = self.last_heard.max(now);
                (Peer::Connected(self), PeerNotice::Quiet)
            }
            PeerInput::Connected(incarnation) if incarnation == self.incarnation => {
                self.last_heard = self.last_heard.max(now);
                (Peer::Connected(self), PeerNotice::Repeated)
            }
            PeerInput::Connected(incarnation) => (
                Peer::connected(now, config, incarnation),
                PeerNotice::Restarted,
            ),
            PeerInput::Lost => (dead(now, config), PeerNotice::Died),
            PeerInput::Timeout if now >= self.last_heard + config.peer_timeout => {
                (dead(now, config), PeerNotice::Died)
            }
            PeerInput::Timeout if now >= self.next_heartbeat => {
                self.next_heartbeat = now + config.heartbeat_interval;
                (Peer::Connected(self), PeerNotice::HeartbeatDue)
            }
            PeerInput::Timeout | PeerInput::ConnectRequested | PeerInput::ConnectFailed(_) => {
                (Peer::Connected(self), PeerNotice::Quiet)
            }
        }
    }
}

impl PeerDown {
    fn handle(self, now: Time, config: &Config, input: PeerInput) -> (Peer, PeerNotice) {
        match input {
            PeerInput::ConnectRequested => (Peer::connecting(now, config), PeerNotice::Connect),
            PeerInput::Connected(incarnation) => (
                Peer::connected(now, config, incarnation),
                PeerNotice::Up(Vec::new()),
            ),
            PeerInput::Heard => (Peer::Dead(self), PeerNotice::NotConnected),
            PeerInput::Timeout if now >= self.until => (Peer::Dead(self), PeerNotice::Forget),
            PeerInput::Timeout | PeerInput::Lost | PeerInput::ConnectFailed(_) => {
                (Peer::Dead(self), PeerNotice::Quiet)
            }
        }
    }
}

#[cfg(test)]
mod tests;
