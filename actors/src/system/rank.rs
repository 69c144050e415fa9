//! `RankActor`: hosts one rank's `Endpoint` and keeps its single timer.

use actix::{Actor, AsyncContext, Context, Handler, Recipient, SpawnHandle};
use tokio::sync::mpsc::UnboundedSender;

use super::messages::{
    AddPeerAddress, Call, Calls, Connect, Feed, LinkUp, LoadPeer, QueryCounters, QueryStats,
    TransportOps,
};
use kvhandoff_protocol::driver::{connected_input, handshake_step, route, HandshakeStep, Routed};
use kvhandoff_protocol::machine::{ConnectFailure, Endpoint, EngineEvent, Time};

/// Hosts an [`Endpoint`]: turns engine calls into `handle_call`, network and transport reports
/// into `handle_event`, and outputs into actions.
pub struct RankActor {
    endpoint: Endpoint,
    transport: Recipient<TransportOps>,
    loader: Recipient<LoadPeer>,
    link: Recipient<Connect>,
    /// The link's book of side-channel addresses.
    book: Recipient<AddPeerAddress>,
    events: UnboundedSender<EngineEvent>,
    timer: Option<(Time, SpawnHandle)>,
}

impl RankActor {
    pub(crate) fn new(
        endpoint: Endpoint,
        transport: Recipient<TransportOps>,
        loader: Recipient<LoadPeer>,
        link: Recipient<Connect>,
        book: Recipient<AddPeerAddress>,
        events: UnboundedSender<EngineEvent>,
    ) -> Self {
        RankActor {
            endpoint,
            transport,
            loader,
            link,
            book,
            events,
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
        if self.endpoint.poll_timeout().is_some_and(|at| at <= now) {
            self.endpoint.handle_timeout(now);
        }
        now
    }

    /// Routes every queued output, then re-arms the timer.
    fn flush(&mut self, ctx: &mut Context<Self>) {
        let mut ops = Vec::new();
        while let Some(output) = self.endpoint.poll_output() {
            match route(output) {
                Routed::Transport(op) => ops.push(op),
                Routed::Connect(peer) => self.link.do_send(Connect(peer)),
                Routed::Event(event) => {
                    // The engine may have gone away; its events then have nowhere to go.
                    let _ = self.events.send(event);
                }
            }
        }
        if !ops.is_empty() {
            self.transport.do_send(TransportOps(ops));
        }
        self.arm_timer(ctx);
    }

    fn arm_timer(&mut self, ctx: &mut Context<Self>) {
        let next = self.endpoint.poll_timeout();
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
                act.endpoint.handle_timeout(now);
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
    }
}

impl Handler<Call> for RankActor {
    type Result = ();

    fn handle(&mut self, call: Call, ctx: &mut Context<Self>) {
        let now = self.caught_up();
        let verdict = self.endpoint.handle_call(now, call.call);
        if let Some(reply) = call.reply {
            reply(verdict);
        }
        self.flush(ctx);
    }
}

impl Handler<Calls> for RankActor {
    type Result = ();

    fn handle(&mut self, calls: Calls, ctx: &mut Context<Self>) {
        for address in calls.addresses {
            // A full book only fails the handshake that needed the address, as a typed
            // `ConnectFailed` outcome of the request.
            self.book.do_send(address);
        }
        let mut verdicts = Vec::with_capacity(calls.calls.len());
        self.caught_up();
        for call in calls.calls {
            let now = self.now();
            verdicts.push(self.endpoint.handle_call(now, call));
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
            self.endpoint.handle_event(now, event);
        }
        self.flush(ctx);
    }
}

impl Handler<QueryStats> for RankActor {
    type Result = actix::MessageResult<QueryStats>;

    fn handle(&mut self, _: QueryStats, _: &mut Context<Self>) -> Self::Result {
        actix::MessageResult(self.endpoint.stats())
    }
}

impl Handler<QueryCounters> for RankActor {
    type Result = actix::MessageResult<QueryCounters>;

    fn handle(&mut self, _: QueryCounters, _: &mut Context<Self>) -> Self::Result {
        actix::MessageResult(self.endpoint.counters().clone())
    }
}

impl Handler<LinkUp> for RankActor {
    type Result = actix::AtomicResponse<Self, Result<(), ConnectFailure>>;

    fn handle(&mut self, LinkUp(info): LinkUp, ctx: &mut Context<Self>) -> Self::Result {
        use actix::{ActorFutureExt, WrapFuture};
        if let HandshakeStep::Repeat(event) = handshake_step(&self.endpoint, &info) {
            // A repeated handshake of the live incarnation (a late copy, a second dial, a
            // replay): reloading would cut the live connection, so only the endpoint hears it.
            let now = self.caught_up();
            self.endpoint.handle_event(now, event);
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
                act.endpoint
                    .handle_event(now, connected_input(&info, &result));
                act.flush(ctx);
                result
            },
        )))
    }
}
