//! `RankActor`: hosts one rank's `Endpoint` and keeps its single timer.

use actix::clock::Instant;
use actix::{Actor, AsyncContext, Context, Handler, Message, Recipient, SpawnHandle};
use tokio::sync::mpsc::UnboundedSender;

use super::link::Connect;
use super::writer::{LoadPeer, WriterOps};
use kvhandoff_protocol::driver::{
    connected_input, handshake_step, route, HandshakeStep, PeerInfo, Routed,
};
use kvhandoff_protocol::machine::{
    ConnectFailure, Counters, Endpoint, EndpointStats, EngineEvent, Input, Rejected, Time,
};

/// Receives whether an engine input was accepted.
pub type Verdict = Box<dyn FnOnce(Result<(), Rejected>) + Send>;

/// An engine's call into its rank: the input, and where to send the verdict.
#[derive(Message)]
#[rtype(result = "()")]
pub struct EngineCall {
    /// An engine input (`DecodeAllocated`, `PrefillFinished` or `Abort`).
    pub input: Input,
    /// Called with whether the input was accepted.
    pub reply: Option<Verdict>,
}

/// Receives, in order, whether each input of an [`EngineCalls`] batch was accepted.
pub type Verdicts = Box<dyn FnOnce(Vec<Result<(), Rejected>>) + Send>;

/// A batch of engine calls (one engine step's worth): the inputs are handled in order, the
/// verdicts come back together, and the outputs are flushed once for the whole batch.
#[derive(Message)]
#[rtype(result = "()")]
pub struct EngineCalls {
    /// Engine inputs (`DecodeAllocated`, `PrefillFinished` or `Abort`), in order.
    pub inputs: Vec<Input>,
    /// Called with one verdict per input, in the same order.
    pub reply: Option<Verdicts>,
}

/// Inputs from the writer (completions, notifications) or the link (handshakes).
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub struct Feed(pub Vec<Input>);

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

/// Hosts an [`Endpoint`]: translates messages into `handle` calls and outputs into actions.
pub struct RankActor {
    endpoint: Endpoint,
    origin: Instant,
    writer: Recipient<WriterOps>,
    loader: Recipient<LoadPeer>,
    link: Recipient<Connect>,
    events: UnboundedSender<EngineEvent>,
    timer: Option<(Time, SpawnHandle)>,
}

impl RankActor {
    pub(crate) fn new(
        endpoint: Endpoint,
        writer: Recipient<WriterOps>,
        loader: Recipient<LoadPeer>,
        link: Recipient<Connect>,
        events: UnboundedSender<EngineEvent>,
    ) -> Self {
        RankActor {
            endpoint,
            origin: Instant::now(),
            writer,
            loader,
            link,
            events,
            timer: None,
        }
    }

    fn now(&self) -> Time {
        Time::from_duration(Instant::now().saturating_duration_since(self.origin))
    }

    fn is_engine_input(input: &Input) -> bool {
        match input {
            Input::DecodeAllocated(_)
            | Input::PrefillFinished(_)
            | Input::Abort { .. }
            | Input::Shutdown => true,
            Input::Received { .. }
            | Input::Malformed { .. }
            | Input::PeerConnected { .. }
            | Input::PeerConnectFailed { .. }
            | Input::PeerLost { .. }
            | Input::WriteCompleted { .. }
            | Input::WriteFailed { .. } => false,
        }
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
            self.writer.do_send(WriterOps(ops));
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

impl Handler<EngineCall> for RankActor {
    type Result = ();

    fn handle(&mut self, call: EngineCall, ctx: &mut Context<Self>) {
        let verdict = if Self::is_engine_input(&call.input) {
            let now = self.now();
            self.endpoint.handle(now, call.input)
        } else {
            Err(Rejected::NotAnEngineInput)
        };
        if let Some(reply) = call.reply {
            reply(verdict);
        }
        self.flush(ctx);
    }
}

impl Handler<EngineCalls> for RankActor {
    type Result = ();

    fn handle(&mut self, calls: EngineCalls, ctx: &mut Context<Self>) {
        let mut verdicts = Vec::with_capacity(calls.inputs.len());
        for input in calls.inputs {
            verdicts.push(if Self::is_engine_input(&input) {
                let now = self.now();
                self.endpoint.handle(now, input)
            } else {
                Err(Rejected::NotAnEngineInput)
            });
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
        let now = self.now();
        for input in feed.0 {
            if Self::is_engine_input(&input) {
                tracing::warn!(?input, "an engine input arrived through the feed; dropped");
                continue;
            }
            // Inputs from peers and the transport are never refused.
            let _ = self.endpoint.handle(now, input);
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
        if let HandshakeStep::Repeat(input) = handshake_step(&self.endpoint, &info) {
            // A repeated handshake of the live incarnation (a late copy, a second dial, a
            // replay): reloading would cut the live connection, so only the endpoint hears it.
            let _ = self.endpoint.handle(self.now(), input);
            self.flush(ctx);
            return actix::AtomicResponse::new(Box::pin(actix::fut::ready(Ok(()))));
        }
        let load = self.loader.send(LoadPeer(info.clone()));
        actix::AtomicResponse::new(Box::pin(load.into_actor(self).map(
            move |loaded, act, ctx| {
                let now = act.now();
                let result = match loaded {
                    Ok(Ok(())) => Ok(()),
                    Ok(Err(error)) => Err(ConnectFailure::Refused(error.to_string())),
                    Err(_) => Err(ConnectFailure::Refused("writer unavailable".into())),
                };
                let _ = act.endpoint.handle(now, connected_input(&info, &result));
                act.flush(ctx);
                result
            },
        )))
    }
}
