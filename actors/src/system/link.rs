//! `LinkActor`: one rank's peer connections (handshakes).

use std::time::Duration;

use actix::{
    Actor, ActorFutureExt, Context, Handler, Message, Recipient, ResponseActFuture, WrapFuture,
};

use super::rank::Feed;
use super::writer::LoadPeer;
use super::{Directory, PeerInfo};
use crate::machine::{ConnectFailure, Input};
use crate::PeerAddr;

/// The rank actor asks for a handshake with a peer.
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub struct Connect(pub PeerAddr);

/// A peer's handshake arrives: load it, and tell the rank it is connected.
#[derive(Message, Debug)]
#[rtype(result = "Result<(), ConnectFailure>")]
pub struct Hello(pub PeerInfo);

/// Runs handshakes for one rank.
pub struct LinkActor {
    own: PeerInfo,
    directory: Directory,
    writer: Recipient<LoadPeer>,
    rank: Recipient<Feed>,
    timeout: Duration,
}

impl LinkActor {
    pub(crate) fn new(
        own: PeerInfo,
        directory: Directory,
        writer: Recipient<LoadPeer>,
        rank: Recipient<Feed>,
        timeout: Duration,
    ) -> Self {
        LinkActor {
            own,
            directory,
            writer,
            rank,
            timeout,
        }
    }

    /// Geometry rules both sides apply: the same model (hash) and, until heterogeneous
    /// transfers exist, the same per-rank layout.
    fn check_compatible(own: &PeerInfo, peer: &PeerInfo) -> Result<(), ConnectFailure> {
        let (a, b) = (&own.geometry, &peer.geometry);
        let same_layout = a.kernel_block_size == b.kernel_block_size
            && a.kernel_blocks_per_logical == b.kernel_blocks_per_logical
            && a.layout == b.layout
            && a.tp_size == b.tp_size
            && a.pp_size == b.pp_size
            && a.cache_groups == b.cache_groups
            && own.regions.len() == peer.regions.len()
            && own
                .regions
                .iter()
                .zip(&peer.regions)
                .all(|(x, y)| x.block_len == y.block_len);
        if own.compat != peer.compat || !same_layout {
            return Err(ConnectFailure::Incompatible);
        }
        Ok(())
    }

    fn refused(reason: impl Into<String>) -> ConnectFailure {
        ConnectFailure::Refused(reason.into())
    }
}

impl Actor for LinkActor {
    type Context = Context<Self>;
}

impl Handler<Connect> for LinkActor {
    type Result = ResponseActFuture<Self, ()>;

    fn handle(&mut self, Connect(peer): Connect, _: &mut Context<Self>) -> Self::Result {
        let directory = self.directory.clone();
        let own = self.own.clone();
        let writer = self.writer.clone();
        let timeout = self.timeout;
        let target = peer.clone();
        let handshake = async move {
            let Some((info, remote_link)) = directory.lookup(&target) else {
                return Err(Self::refused("peer not found"));
            };
            Self::check_compatible(&own, &info)?;
            writer
                .send(LoadPeer(info))
                .await
                .map_err(|_| Self::refused("writer unavailable"))?
                .map_err(|e| Self::refused(e.to_string()))?;
            let answer = tokio::time::timeout(timeout, remote_link.send(Hello(own)))
                .await
                .map_err(|_| ConnectFailure::TimedOut)?;
            answer.map_err(|_| Self::refused("peer link unavailable"))?
        };
        Box::pin(handshake.into_actor(self).map(move |result, act, _| {
            let input = match result {
                Ok(()) => Input::PeerConnected { peer },
                Err(reason) => Input::PeerConnectFailed { peer, reason },
            };
            act.rank.do_send(Feed(vec![input]));
        }))
    }
}

impl Handler<Hello> for LinkActor {
    type Result = ResponseActFuture<Self, Result<(), ConnectFailure>>;

    fn handle(&mut self, Hello(info): Hello, _: &mut Context<Self>) -> Self::Result {
        let checked = Self::check_compatible(&self.own, &info);
        let writer = self.writer.clone();
        let peer = info.peer.clone();
        let load = async move {
            checked?;
            writer
                .send(LoadPeer(info))
                .await
                .map_err(|_| Self::refused("writer unavailable"))?
                .map_err(|e| Self::refused(e.to_string()))
        };
        Box::pin(load.into_actor(self).map(move |result, act, _| {
            if result.is_ok() {
                act.rank
                    .do_send(Feed(vec![Input::PeerConnected { peer }]));
            }
            result
        }))
    }
}
