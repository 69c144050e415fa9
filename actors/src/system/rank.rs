//! `RankActor`: hosts one rank's [`Session`] (and through it the rank's endpoint) and keeps its
//! single timer.

use std::net::ToSocketAddrs;

use actix::{Actor, AsyncContext, Context, Handler, Recipient, SpawnHandle};
use tokio::sync::mpsc::UnboundedSender;

use super::messages::{
    AddPeerAddress, Call, Calls, ClockMeasured, ConfigureSession, Connect, Expecting, Feed, LinkUp,
    LoadPeer, QueryCounters, QueryStats, SetLinks, SetTurnLinks, TransportOps,
};
use kvhandoff_protocol::driver::{connected_input, handshake_step, HandshakeStep};
use kvhandoff_protocol::machine::{ConnectFailure, Time};
use kvhandoff_protocol::session::{
    ConnectorError, ConnectorEvent, PeerAddress, Session, SessionOutput,
};
use kvhandoff_protocol::PeerAddr;

/// How often a rank publishes its gauges (blocks in quarantine, peers by state): what a scrape
/// shows of them is at most this old.
const GAUGE_INTERVAL: std::time::Duration = std::time::Duration::from_millis(200);

/// Where the rank actor reaches its transport actor.
pub(crate) struct TransportInbox {
    /// The operations the session asks for.
    pub(crate) ops: Recipient<TransportOps>,
    /// Whether the rank has live work ([`Expecting`]).
    pub(crate) expecting: Recipient<Expecting>,
}

/// Hosts a [`Session`]: engine calls become `handle_call`, network and transport reports
/// `handle_event`, and outputs actions.
pub struct RankActor {
    session: Session,
    transport: Recipient<TransportOps>,
    /// Where the rank says whether it has live work ([`Expecting`]), and what it said last.
    expecting: (Recipient<Expecting>, bool),
    loader: Recipient<LoadPeer>,
    link: Recipient<Connect>,
    /// The link's book of side-channel addresses.
    book: Recipient<AddPeerAddress>,
    events: UnboundedSender<ConnectorEvent>,
    /// Counts the events handed to the engine in the process's metrics.
    counter: crate::metrics::EventCounter,
    timer: Option<(Time, SpawnHandle)>,
}

impl RankActor {
    pub(crate) fn new(
        session: Session,
        transport: TransportInbox,
        loader: Recipient<LoadPeer>,
        link: Recipient<Connect>,
        book: Recipient<AddPeerAddress>,
        events: UnboundedSender<ConnectorEvent>,
        counter: crate::metrics::EventCounter,
    ) -> Self {
        RankActor {
            session,
            transport: transport.ops,
            expecting: (transport.expecting, false),
            loader,
            link,
            book,
            events,
            counter,
            timer: None,
        }
    }

    fn now(&self) -> Time {
        // The process's one clock, so that a peer's times convert into ours (see `clock.rs`).
        Time::from_duration(super::process_clock())
    }

    /// Now, after running every timer of the endpoint that is already due. A process that was
    /// stopped (SIGSTOP, a VM pause, a debugger) resumes with messages queued in its mailbox
    /// and its timer overdue; actix may hand it the messages first. Running the due timers
    /// before any input means a peer whose deadline passed is declared dead, and a lease that
    /// ended is ended, before anything the stall kept queued is handled (the machines also
    /// refuse such inputs on their own; neither is trusted alone).
    fn caught_up(&mut self) -> Time {
        let now = self.now();
        if self.session.poll_timeout().is_some_and(|at| at <= now) {
            self.session.handle_timeout(now);
        }
        now
    }

    /// Routes every queued output, then re-arms the timer.
    fn flush(&mut self, ctx: &mut Context<Self>) {
        let mut ops = Vec::new();
        while let Some(output) = self.session.poll_output() {
            match output {
                SessionOutput::Transport(op) => ops.push(op),
                SessionOutput::Connect(peer) => self.link.do_send(Connect(peer)),
                SessionOutput::PeerAddress(address) => self.learn_address(address),
                SessionOutput::Event(event) => {
                    self.counter.count(&event);
                    // The engine may have gone away; its events then have nowhere to go.
                    let _ = self.events.send(event);
                }
                SessionOutput::Observed(_) => {}
            }
        }
        if !ops.is_empty() {
            self.transport.do_send(TransportOps(ops));
        }
        // Live work means an arrival (a Register, a write's notice, a completion) may be on its
        // way: a transport that polls for arrivals polls eagerly until the work ends. Sent after
        // the ops, so the transport sees them first.
        let expecting = self.session.endpoint().has_pending_work();
        if expecting != self.expecting.1 {
            self.expecting.1 = expecting;
            self.expecting.0.do_send(Expecting(expecting));
        }
        // Every step that may change the counters ends here: scrapes read what this leaves.
        self.counter.publish(self.session.endpoint().counters());
        self.arm_timer(ctx);
    }

    /// Hands the link where a peer engine's side channel listens. Resolving a host name may
    /// wait on DNS; one that does not resolve fails only the handshake that needs it (a typed
    /// `ConnectFailed` outcome of its requests), as a full book does.
    fn learn_address(&self, address: PeerAddress) {
        let PeerAddress {
            engine,
            rank,
            host,
            port,
        } = address;
        let peer = PeerAddr::new(engine, rank);
        match (host.as_str(), port)
            .to_socket_addrs()
            .map(|mut a| a.next())
        {
            Ok(Some(addr)) => self.book.do_send(AddPeerAddress { peer, addr }),
            Ok(None) => tracing::warn!(%peer, %host, "peer side channel resolves to no address"),
            Err(error) => tracing::warn!(%peer, %host, %error, "peer side channel unresolved"),
        }
    }

    fn arm_timer(&mut self, ctx: &mut Context<Self>) {
        let next = self.session.poll_timeout();
        if let Some((at, handle)) = self.timer.take() {
            if Some(at) == next {
                self.timer = Some((at, handle));
                return;
            }
            ctx.cancel_future(handle);
        }
        if let Some(at) = next {
            let delay = at.saturating_since(self.now());
            let handle = ctx.run_later(delay, |act, ctx| {
                act.timer = None;
                let now = act.now();
                act.session.handle_timeout(now);
                act.flush(ctx);
            });
            self.timer = Some((at, handle));
        }
    }
}

impl Actor for RankActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        self.arm_timer(ctx);
        // The gauges walk the rank's live requests and peers: published on a cadence of their
        // own rather than after every step, so that the hot path does not pay for them.
        ctx.run_interval(GAUGE_INTERVAL, |act, _| {
            act.counter.publish_gauges(act.session.endpoint().gauges());
        });
    }
}

impl Handler<Call> for RankActor {
    type Result = ();

    fn handle(&mut self, call: Call, ctx: &mut Context<Self>) {
        let now = self.caught_up();
        let verdict = self.session.endpoint_mut().handle_call(now, call.call);
        if let Some(reply) = call.reply {
            reply(verdict);
        }
        self.flush(ctx);
    }
}

impl Handler<Calls> for RankActor {
    type Result = ();

    fn handle(&mut self, calls: Calls, ctx: &mut Context<Self>) {
        let mut verdicts = Vec::with_capacity(calls.calls.len());
        self.caught_up();
        for call in calls.calls {
            let now = self.now();
            verdicts.push(self.session.handle_call(now, call));
        }
        if let Some(reply) = calls.reply {
            reply(verdicts);
        }
        self.flush(ctx);
    }
}

impl Handler<Feed> for RankActor {
    type Result = ();

    fn handle(&mut self, feed: Feed, ctx: &mut Context<Self>) {
        let now = self.caught_up();
        for event in feed.0 {
            self.session.handle_event(now, event);
        }
        self.flush(ctx);
    }
}

impl Handler<QueryStats> for RankActor {
    type Result = actix::MessageResult<QueryStats>;

    fn handle(&mut self, _: QueryStats, _: &mut Context<Self>) -> Self::Result {
        actix::MessageResult(self.session.endpoint().stats())
    }
}

impl Handler<QueryCounters> for RankActor {
    type Result = actix::MessageResult<QueryCounters>;

    fn handle(&mut self, _: QueryCounters, _: &mut Context<Self>) -> Self::Result {
        let counters = self.session.endpoint().counters().clone();
        // What the asker sees, a scrape sees too.
        self.counter.publish(&counters);
        actix::MessageResult(counters)
    }
}

impl Handler<LinkUp> for RankActor {
    type Result = actix::AtomicResponse<Self, Result<(), ConnectFailure>>;

    fn handle(&mut self, LinkUp(info): LinkUp, ctx: &mut Context<Self>) -> Self::Result {
        use actix::{ActorFutureExt, WrapFuture};
        if let HandshakeStep::Repeat(event) = handshake_step(self.session.endpoint(), &info) {
            // A repeated handshake of the live incarnation (a late copy, a second dial, a
            // replay): reloading would cut the live connection, so only the endpoint hears it.
            let now = self.caught_up();
            self.session.handle_event(now, event);
            self.flush(ctx);
            return actix::AtomicResponse::new(Box::pin(actix::fut::ready(Ok(()))));
        }
        let load = self.loader.send(LoadPeer(info.clone()));
        actix::AtomicResponse::new(Box::pin(load.into_actor(self).map(
            move |loaded, act, ctx| {
                let now = act.caught_up();
                let result = match loaded {
                    Ok(Ok(())) => Ok(()),
                    Ok(Err(error)) => Err(ConnectFailure::Refused(error.to_string())),
                    Err(_) => Err(ConnectFailure::Refused(
                        "transport actor unavailable".into(),
                    )),
                };
                act.session
                    .handle_event(now, connected_input(&info, &result));
                act.flush(ctx);
                result
            },
        )))
    }
}

impl Handler<ConfigureSession> for RankActor {
    type Result = ();

    fn handle(&mut self, configure: ConfigureSession, _: &mut Context<Self>) {
        self.session.set_identity(configure.identity);
        self.session.set_settings(configure.settings);
        if let Some(limit) = configure.fan_limit {
            self.session.set_fan_limit(limit);
        }
    }
}

impl Handler<SetLinks> for RankActor {
    type Result = Result<(), ConnectorError>;

    fn handle(&mut self, SetLinks(links): SetLinks, _: &mut Context<Self>) -> Self::Result {
        self.session.set_links(links)
    }
}

impl Handler<SetTurnLinks> for RankActor {
    type Result = Result<(), ConnectorError>;

    fn handle(&mut self, SetTurnLinks(links): SetTurnLinks, _: &mut Context<Self>) -> Self::Result {
        self.session.set_turn_links(links)
    }
}

impl Handler<ClockMeasured> for RankActor {
    type Result = ();

    fn handle(&mut self, measured: ClockMeasured, _: &mut Context<Self>) {
        self.session
            .clock_measured(measured.engine, measured.offset_us);
    }
}
