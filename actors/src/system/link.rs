//! `LinkActor`: one rank's peer connections (handshakes), in process through a [`Directory`] or
//! across processes through the TCP side channel ([`super::side_channel`]).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use actix::{
    Actor, ActorFutureExt, AsyncContext, Context, Handler, Recipient, ResponseActFuture, WrapFuture,
};
use tokio::net::TcpListener;

use super::messages::{
    AddPeerAddress, ClockMeasured, Connect, Feed, Hello, LinkUp, QuerySideChannel,
};
use super::side_channel::{self, HandshakeError, Local, PeerBook, PeerBookFull, SideChannelConfig};
use super::Directory;
use kvhandoff_protocol::driver::{PeerInfo, SharedRoute};
use kvhandoff_protocol::machine::{ConnectFailure, NetEvent};
use kvhandoff_protocol::PeerAddr;

/// How a link reaches its peers.
pub(crate) enum LinkMode {
    /// Through the in-process directory.
    InProcess(Directory),
    /// Through the TCP side channel; the listener is bound already and starts with the actor.
    Tcp {
        listener: Option<TcpListener>,
        config: SideChannelConfig,
    },
}

/// Where a link reaches its rank: handshakes to load, failures to feed, clocks measured.
pub(crate) struct RankInbox {
    pub(crate) up: Recipient<LinkUp>,
    pub(crate) feed: Recipient<Feed>,
    pub(crate) clocks: Recipient<ClockMeasured>,
}

/// Runs handshakes for one rank.
pub struct LinkActor {
    local: Arc<Local>,
    mode: LinkMode,
    book: PeerBook,
    shared: Arc<side_channel::Shared>,
    up: Recipient<LinkUp>,
    rank: Recipient<Feed>,
    /// Where the clock offsets measured at handshakes go (the rank's session).
    clocks: Recipient<ClockMeasured>,
    timeout: Duration,
    /// Which peer geometries other than our own this rank pairs with (in process).
    route: Option<SharedRoute>,
}

impl LinkActor {
    pub(crate) fn new(
        own: PeerInfo,
        mode: LinkMode,
        listen: Option<SocketAddr>,
        rank: RankInbox,
        timeout: Duration,
        route: Option<SharedRoute>,
    ) -> Self {
        let RankInbox {
            up,
            feed: rank,
            clocks,
        } = rank;
        let config = match &mode {
            LinkMode::InProcess(_) => SideChannelConfig::default(),
            LinkMode::Tcp { config, .. } => config.clone(),
        };
        let limit = config.max_peer_addresses;
        LinkActor {
            local: Arc::new(Local::new(own, config, timeout, route.clone())),
            mode,
            book: PeerBook::new(limit),
            shared: Arc::new(side_channel::Shared::new(listen, limit)),
            up,
            rank,
            clocks,
            timeout,
            route,
        }
    }

    /// Rules both in-process sides apply: the same model (hash), and the same per-rank layout
    /// unless the rank's [`TransferRoute`](kvhandoff_protocol::driver::TransferRoute) accepts
    /// the peer's geometry (a heterogeneous pair it can place).
    fn check_compatible(
        own: &PeerInfo,
        peer: &PeerInfo,
        route: Option<&SharedRoute>,
    ) -> Result<(), ConnectFailure> {
        if own.compat != peer.compat {
            return Err(ConnectFailure::Incompatible);
        }
        if side_channel::layout_mismatch(own, peer).is_none() {
            return Ok(());
        }
        match route.map(|r| r.accepts(&own.geometry, &peer.geometry)) {
            Some(Ok(())) => Ok(()),
            Some(Err(error)) => {
                tracing::warn!(peer = %peer.peer, %error, "heterogeneous peer refused");
                Err(ConnectFailure::Incompatible)
            }
            None => Err(ConnectFailure::Incompatible),
        }
    }

    fn refused(reason: impl Into<String>) -> ConnectFailure {
        ConnectFailure::Refused(reason.into())
    }

    /// The peer's link checks us and hands us to its rank first, then we hand the peer to
    /// ours, so that by the time our endpoint talks to the peer, the peer knows us.
    fn connect_in_process(
        &mut self,
        directory: Directory,
        peer: PeerAddr,
    ) -> ResponseActFuture<Self, ()> {
        let own = self.local.info.clone();
        let route = self.route.clone();
        let timeout = self.timeout;
        let target = peer.clone();
        let handshake = async move {
            let Some((info, remote_link)) = directory.lookup(&target) else {
                return Err(Self::refused("peer not found"));
            };
            Self::check_compatible(&own, &info, route.as_ref())?;
            let answer = tokio::time::timeout(timeout, remote_link.send(Hello(own)))
                .await
                .map_err(|_| ConnectFailure::TimedOut)?;
            answer.map_err(|_| Self::refused("peer link unavailable"))??;
            Ok(info)
        };
        Box::pin(handshake.into_actor(self).map(move |result, act, _| {
            match result {
                // The rank loads the peer and feeds `PeerConnected` (or `PeerConnectFailed`).
                Ok(info) => act.up.do_send(LinkUp(info)),
                Err(reason) => act
                    .rank
                    .do_send(Feed(vec![NetEvent::PeerConnectFailed { peer, reason }])),
            }
        }))
    }

    fn connect_tcp(&mut self, peer: PeerAddr) -> ResponseActFuture<Self, ()> {
        let addr = self.book.get(&peer);
        let local = self.local.clone();
        let shared = self.shared.clone();
        let up = self.up.clone();
        let rank = self.rank.clone();
        let clocks = self.clocks.clone();
        let handshake = async move {
            let started = std::time::Instant::now();
            let deadline = local.handshake_deadline();
            let shaken = match addr {
                Some(addr) => side_channel::initiate(&local, addr, &peer, deadline).await,
                None => Err(HandshakeError::NoAddress),
            };
            let (info, clock, trace_id) = match shaken {
                Ok(shaken) => shaken,
                Err(error) => {
                    tracing::warn!(peer = %peer, %error, "side channel handshake failed");
                    shared.outgoing_failed(error.reason());
                    let reason = error.connect_failure();
                    rank.do_send(Feed(vec![NetEvent::PeerConnectFailed { peer, reason }]));
                    return;
                }
            };
            // The rank loads the peer and feeds `PeerConnected`, or `PeerConnectFailed` if the
            // load fails.
            match side_channel::link_up(&up, info, side_channel::remaining(deadline)).await {
                Ok(()) => {
                    crate::metrics::observe_handshake(started.elapsed());
                    tracing::info!(peer = %peer, ?clock, %trace_id, "side channel handshake completed");
                    clocks.do_send(ClockMeasured {
                        engine: peer.engine.clone(),
                        offset_us: clock.offset_us,
                    });
                    side_channel::outgoing_ok(&shared, &peer.engine, clock);
                }
                Err(error) => {
                    tracing::warn!(peer = %peer, %trace_id, %error, "handshaken peer not loaded");
                    shared.outgoing_failed(error.reason());
                }
            }
        };
        Box::pin(handshake.into_actor(self))
    }
}

impl Actor for LinkActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        if let LinkMode::Tcp { listener, .. } = &mut self.mode {
            if let Some(listener) = listener.take() {
                let accept = side_channel::accept_loop(
                    listener,
                    self.local.clone(),
                    self.shared.clone(),
                    self.up.clone(),
                );
                // Tied to the actor: the listener closes when the link stops.
                ctx.spawn(accept.into_actor(self));
            }
        }
    }
}

impl Handler<Connect> for LinkActor {
    type Result = ResponseActFuture<Self, ()>;

    fn handle(&mut self, Connect(peer): Connect, _: &mut Context<Self>) -> Self::Result {
        match &self.mode {
            LinkMode::InProcess(directory) => {
                let directory = directory.clone();
                self.connect_in_process(directory, peer)
            }
            LinkMode::Tcp { .. } => self.connect_tcp(peer),
        }
    }
}

impl Handler<Hello> for LinkActor {
    type Result = ResponseActFuture<Self, Result<(), ConnectFailure>>;

    fn handle(&mut self, Hello(info): Hello, _: &mut Context<Self>) -> Self::Result {
        let checked = Self::check_compatible(&self.local.info, &info, self.route.as_ref());
        let up = self.up.clone();
        let limit = self.timeout;
        let load = async move {
            checked?;
            // The rank loads the peer, then feeds `PeerConnected` (bounded, as every wait).
            tokio::time::timeout(limit, up.send(LinkUp(info)))
                .await
                .map_err(|_| ConnectFailure::TimedOut)?
                .map_err(|_| Self::refused("rank unavailable"))?
        };
        Box::pin(load.into_actor(self))
    }
}

impl Handler<AddPeerAddress> for LinkActor {
    type Result = Result<(), PeerBookFull>;

    fn handle(&mut self, msg: AddPeerAddress, _: &mut Context<Self>) -> Self::Result {
        let AddPeerAddress { peer, addr } = msg;
        let old = self.book.insert(peer.clone(), addr)?;
        // The listener admits by engine: any rank of an engine we reach may dial us.
        self.shared.know(&peer.engine);
        if let Some(old) = old {
            if old != addr {
                tracing::info!(%peer, %old, new = %addr, "peer side channel moved");
            }
        }
        Ok(())
    }
}

impl Handler<QuerySideChannel> for LinkActor {
    type Result = actix::MessageResult<QuerySideChannel>;

    fn handle(&mut self, _: QuerySideChannel, _: &mut Context<Self>) -> Self::Result {
        actix::MessageResult(self.shared.snapshot())
    }
}
