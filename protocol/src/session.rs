//! The engine-facing session: everything an engine's connector decides, as one sans-IO type that
//! owns the rank's [`Endpoint`].
//!
//! An engine speaks in its own terms — requests, block ids, the router's
//! [`KvTransferParams`] — and the endpoint in the protocol's: pairing keys, epochs, peer ranks.
//! The [`Session`] stands between them and is the only code that does:
//! - it turns each [`ConnectorCall`] into the endpoint's input (`prepare`, `read_inputs`):
//!   the pairing key, the epoch, the other engine's rank, the holder's expiry in our clock;
//! - it splits a push request of a heterogeneous pair into one sub-request per pair of ranks
//!   and folds their events back into one (`fan`, over [`FanIn`](crate::machine::FanIn));
//! - it turns the endpoint's events into the engine's [`ConnectorEvent`]s (`engine_events`).
//!
//! Driven quinn-style, like the endpoint: [`Session::handle_call`] (the engine, answered at
//! once), [`Session::handle_event`] (the network and the transport), [`Session::handle_timeout`],
//! then [`Session::poll_output`] until `None` and [`Session::poll_timeout`] for the next timer.
//! Time is an argument; nothing here reads a clock or does I/O. The actix shell hosts one per
//! rank (`kvhandoff_actors`), the engine reaches it through `kvhandoff::KvConnector`, and the
//! simulator steps the very same type.
//!
//! ```
//! use kvhandoff_protocol::machine::{Config, Endpoint, Time};
//! use kvhandoff_protocol::session::{
//!     ConnectorCall, ConnectorEvent, ConnectorIdentity, ConnectorReply, ConnectorSettings,
//!     KvTransferParams, Session, SessionOutput,
//! };
//! use kvhandoff_protocol::{BlockIds, EngineId, RequestId};
//!
//! let engine = EngineId::new("prefill-0").unwrap();
//! let endpoint = Endpoint::new(engine.clone(), 0, Config::fast()).unwrap();
//! let identity = ConnectorIdentity::in_process(engine, 0, 1);
//! let mut session = Session::new(endpoint, identity, ConnectorSettings::default());
//! // P's prefill finished: the session answers with the parameters for the router.
//! let call = ConnectorCall::RequestFinished {
//!     request: RequestId::new("req-1").unwrap(),
//!     blocks: BlockIds::single_group(vec![3, 4]),
//!     num_tokens: 32,
//!     params: KvTransferParams::default(),
//! };
//! let Ok(ConnectorReply::DecodeParams(params)) = session.handle_call(Time::ZERO, call) else {
//!     panic!("accepted");
//! };
//! assert_eq!(params.remote_engine_id.as_deref(), Some("prefill-0"));
//! // Nobody registers: the lease ends and the blocks come back.
//! let end = session.poll_timeout().unwrap();
//! session.handle_timeout(end);
//! let freed = std::iter::from_fn(|| session.poll_output())
//!     .any(|out| matches!(out, SessionOutput::Event(ConnectorEvent::BlocksFree { .. })));
//! assert!(freed);
//! ```

mod calls;
mod engine_events;
mod fan;
mod fan_declines;
mod fan_reads;
mod params;
mod prepare;
mod read_inputs;
mod settings;

use std::collections::{BTreeMap, VecDeque};

pub use calls::{ConnectorCall, ConnectorError, ConnectorEvent, ConnectorIdentity, ConnectorReply};
pub use fan::{sub_request_id, RankLinks, MAX_FANS};
pub use params::KvTransferParams;
pub use settings::{ConnectorSettings, DEFAULT_NEXT_TURN_TTL, DEFAULT_RECOMPUTE_THRESHOLD};

use crate::driver::{route, Routed, TransportOp};
use crate::machine::mutation::ActiveMutation;
use crate::machine::Mutation;
use crate::machine::{Endpoint, EndpointEvent, NetEvent, Time};
use crate::{EngineId, PeerAddr};

/// Where one rank of another engine has its side channel, as the router's parameters name it
/// (`remote_host`, and `remote_port` the engine's base port): the shell resolves it and hands
/// it to its link before the handshake that needs it. Only for a session whose peers are reached over a side channel
/// ([`Session::set_peer_addresses`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerAddress {
    /// The other engine.
    pub engine: EngineId,
    /// The rank of the other engine that listens here: each rank has its own port (the
    /// engine's base `remote_port` + this rank).
    pub rank: u32,
    /// Its side channel's host (a name or an IP address).
    pub host: String,
    /// Its side channel's port.
    pub port: u16,
}

/// What a [`Session`] asks of its shell, in order.
#[derive(Debug)]
pub enum SessionOutput {
    /// For the transport (post, send, abandon, invalidate).
    Transport(TransportOp),
    /// Start a handshake with a peer (answer with `PeerConnected` or `PeerConnectFailed`).
    Connect(PeerAddr),
    /// Where a peer rank's side channel listens; comes before the [`SessionOutput::Connect`]
    /// that needs it.
    PeerAddress(PeerAddress),
    /// For the engine.
    Event(ConnectorEvent),
    /// An endpoint event as it came, before the session folded it into the engine's
    /// ([`Session::observe_endpoint_events`]; off by default): for a checker or a trace that
    /// follows every sub-request, not for the engine.
    Observed(EndpointEvent),
}

/// What turning a call into the endpoint's input reads of the session (`prepare`,
/// `read_inputs`): whom it speaks for, its settings, and what it knows of its peers.
struct CallContext<'a> {
    identity: &'a ConnectorIdentity,
    settings: &'a ConnectorSettings,
    /// Peers are reached over a side channel whose addresses come with the calls.
    peer_addresses: bool,
    clock_offsets: &'a BTreeMap<EngineId, i64>,
}

/// One engine rank's session: its connector's logic over its [`Endpoint`] (see the module
/// documentation).
#[derive(Debug)]
pub struct Session {
    endpoint: Endpoint,
    identity: ConnectorIdentity,
    settings: ConnectorSettings,
    /// Peers are reached over a side channel whose addresses come with the calls.
    peer_addresses: bool,
    /// The other engine's ranks this rank pairs with, when the geometries differ.
    links: Option<RankLinks>,
    /// The same for a conversation's later turns, which read D's kept blocks back into P: the
    /// pair planned the other way (D's engine as the holder).
    turn_links: Option<RankLinks>,
    /// Multi-rank requests in progress.
    fans: fan::Fans,
    /// Clock offsets (peer minus ours, µs) of the engines the side channel measured.
    clock_offsets: BTreeMap<EngineId, i64>,
    /// What the session decided itself, delivered before the endpoint's next outputs.
    ready: VecDeque<SessionOutput>,
    /// Whether [`SessionOutput::Observed`] is emitted.
    observe: bool,
    /// The time of the latest input: what the outputs it queued are handled at.
    now: Time,
    counters: SessionCounters,
    /// The sub-requests the endpoint refused in the latest call (its siblings started).
    refused: Vec<(crate::RequestId, crate::machine::Rejected)>,
    mutation: ActiveMutation,
}

/// What a session counts beyond its endpoint's [`Counters`](crate::machine::Counters).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SessionCounters {
    /// Sub-requests of multi-rank requests the endpoint refused after a sibling had started:
    /// the request failed at once and the engine got its event when the siblings ended.
    pub subs_refused: u64,
    /// Live sub-requests aborted because a sibling failed.
    pub siblings_aborted: u64,
}

/// Most clock offsets a session remembers; past it the table starts over (a stale or missing
/// offset only makes the reader's expiry gate absent, never unsafe: the holder refuses a read
/// that could outlive its export on its own).
const MAX_CLOCK_OFFSETS: usize = 4096;

impl Session {
    /// A session over `endpoint`, speaking for `identity`, with `settings`.
    pub fn new(
        endpoint: Endpoint,
        identity: ConnectorIdentity,
        settings: ConnectorSettings,
    ) -> Self {
        Session {
            endpoint,
            identity,
            settings,
            peer_addresses: false,
            links: None,
            turn_links: None,
            fans: fan::Fans::default(),
            clock_offsets: BTreeMap::new(),
            ready: VecDeque::new(),
            observe: false,
            now: Time::ZERO,
            counters: SessionCounters::default(),
            refused: Vec::new(),
            mutation: ActiveMutation::default(),
        }
    }

    /// The endpoint the session drives.
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// The endpoint, for a shell's own inputs (handshakes, a test's raw engine calls). An
    /// event of a request started here without the session reaches the engine as that
    /// request's [`ConnectorEvent`] all the same.
    pub fn endpoint_mut(&mut self) -> &mut Endpoint {
        &mut self.endpoint
    }

    /// The identity the session speaks for.
    pub fn identity(&self) -> &ConnectorIdentity {
        &self.identity
    }

    /// Replaces the identity (the engine's own placement, learnt once its connector is made).
    pub fn set_identity(&mut self, identity: ConnectorIdentity) {
        self.identity = identity;
    }

    /// The connector settings.
    pub fn settings(&self) -> &ConnectorSettings {
        &self.settings
    }

    /// Replaces the settings; calls from now on use them.
    pub fn set_settings(&mut self, settings: ConnectorSettings) {
        self.settings = settings;
    }

    /// Whether peers are reached over a side channel whose addresses come with the calls
    /// (`remote_host`, `remote_port`, then required): the session then emits
    /// [`SessionOutput::PeerAddress`]. Off: peers are found by the shell itself (in process).
    pub fn set_peer_addresses(&mut self, on: bool) {
        self.peer_addresses = on;
    }

    /// Makes the session emit [`SessionOutput::Observed`] for every endpoint event.
    pub fn observe_endpoint_events(&mut self, on: bool) {
        self.observe = on;
    }

    /// Makes this rank split every push request into one sub-request per pair of ranks in
    /// `links` (see [`RankLinks`]). Set it before the first request.
    ///
    /// # Errors
    /// [`ConnectorError::InvalidParam`] for links that are not distinct ranks of the other
    /// engine ([`RankLinks::validate`]).
    pub fn set_links(&mut self, links: RankLinks) -> Result<(), ConnectorError> {
        links.validate()?;
        self.links = Some(links);
        Ok(())
    }

    /// The links set with [`Session::set_links`].
    pub fn links(&self) -> Option<&RankLinks> {
        self.links.as_ref()
    }

    /// Makes this rank split a conversation's turn calls (`keep_for_next_turn` on D,
    /// `next_turn_allocated` on P) into one export or import per pair of ranks in `links`: the
    /// pair planned the other way, D's engine the holder (`plan_pair` with the sides swapped;
    /// this rank's links in it, [`RankLinks::for_rank`] of the other side). Without them a
    /// linked rank refuses turn calls as unsupported.
    ///
    /// # Errors
    /// [`ConnectorError::InvalidParam`] for links that are not distinct ranks of the other
    /// engine ([`RankLinks::validate`]).
    pub fn set_turn_links(&mut self, links: RankLinks) -> Result<(), ConnectorError> {
        links.validate()?;
        self.turn_links = Some(links);
        Ok(())
    }

    /// Lowers the bound on multi-rank requests in progress (default [`MAX_FANS`]), for tests
    /// of the bound.
    pub fn set_fan_limit(&mut self, limit: usize) {
        self.fans.limit = limit;
    }

    /// Arms a deliberate bug, for the simulator's mutation check (also passed to the
    /// endpoint's machines and the fan-ins).
    #[cfg(feature = "mutations")]
    #[doc(hidden)]
    pub fn set_mutation(&mut self, mutation: Option<Mutation>) {
        self.mutation = ActiveMutation(mutation);
        self.endpoint.set_mutation(mutation);
    }

    /// What the session counted.
    pub fn counters(&self) -> SessionCounters {
        self.counters
    }

    /// The sub-requests of a multi-rank request that the endpoint refused in the latest call,
    /// and why, while their siblings started (the request then fails, and its one event comes when the
    /// started ones handed the blocks back).
    pub fn refused_sub_requests(&self) -> &[(crate::RequestId, crate::machine::Rejected)] {
        &self.refused
    }

    /// The side channel measured `engine`'s clock: `offset_us` microseconds ahead of ours. A
    /// reader then converts the holder's `remote_blocks_expiry_time` into its own time and
    /// declines a read that could outlive the export before asking.
    pub fn clock_measured(&mut self, engine: EngineId, offset_us: i64) {
        if self.clock_offsets.len() >= MAX_CLOCK_OFFSETS
            && !self.clock_offsets.contains_key(&engine)
        {
            self.clock_offsets.clear();
        }
        self.clock_offsets.insert(engine, offset_us);
    }

    /// The engine's call: answered at once, and on success its outputs are queued.
    ///
    /// # Errors
    /// [`ConnectorError`] for missing or invalid parameters, an unsupported request, a missing
    /// setting, or the endpoint's refusal; nothing changed then (a multi-rank request whose
    /// every sub-request was refused leaves the blocks with the engine).
    pub fn handle_call(
        &mut self,
        now: Time,
        call: ConnectorCall,
    ) -> Result<ConnectorReply, ConnectorError> {
        self.now = now;
        self.refused.clear();
        match &call {
            ConnectorCall::Abort { request } if self.fans.is_fan(request) => {
                let request = request.clone();
                return self
                    .abort_fan(now, &request)
                    .map(|()| ConnectorReply::Accepted);
            }
            _ => {}
        }
        match self.links.clone() {
            Some(links) => self.linked_call(now, call, &links),
            None => self.single_call(now, call),
        }
    }

    /// [`Session::handle_call`] with `links` for this call alone, whatever
    /// [`Session::set_links`] said: for an engine whose requests pair with different ranks of
    /// the other engine (a D engine served by P engines of several geometries, or the
    /// simulator, which draws a shape per request).
    ///
    /// # Errors
    /// As [`Session::handle_call`], and [`ConnectorError::InvalidParam`] for invalid links.
    pub fn handle_call_linked(
        &mut self,
        now: Time,
        call: ConnectorCall,
        links: &RankLinks,
    ) -> Result<ConnectorReply, ConnectorError> {
        self.now = now;
        self.refused.clear();
        links.validate()?;
        self.linked_call(now, call, links)
    }

    /// What [`Session::handle_call`] would answer `call` at `now`, checked as it checks it, with
    /// nothing handed to the endpoint: the answer an engine's scheduler gives the router
    /// before its worker makes the call (vLLM answers at the end of P's step and hands the
    /// export to the rank with the next step's metadata). The endpoint's own refusals (a full
    /// table) come only with the call itself.
    ///
    /// ```
    /// use kvhandoff_protocol::machine::{Config, Endpoint, Time};
    /// use kvhandoff_protocol::session::{
    ///     ConnectorCall, ConnectorIdentity, ConnectorSettings, KvTransferParams, Session,
    /// };
    /// use kvhandoff_protocol::{BlockIds, EngineId, RequestId};
    ///
    /// let engine = EngineId::new("prefill-0").unwrap();
    /// let endpoint = Endpoint::new(engine.clone(), 0, Config::fast()).unwrap();
    /// let identity = ConnectorIdentity::in_process(engine, 0, 1);
    /// let mut session = Session::new(endpoint, identity, ConnectorSettings::default());
    /// let call = ConnectorCall::RequestFinished {
    ///     request: RequestId::new("req-1").unwrap(),
    ///     blocks: BlockIds::single_group(vec![3, 4]),
    ///     num_tokens: 32,
    ///     params: KvTransferParams {
    ///         transfer_mode: Some("pull".into()),
    ///         ..KvTransferParams::default()
    ///     },
    /// };
    /// let early = session.preview_call(Time::ZERO, &call).unwrap();
    /// assert_eq!(session.poll_timeout(), None, "nothing filed yet");
    /// assert_eq!(session.handle_call(Time::ZERO, call), Ok(early));
    /// ```
    ///
    /// # Errors
    /// As [`Session::handle_call`] for missing or invalid parameters, an unsupported request
    /// or a missing setting.
    pub fn preview_call(
        &self,
        now: Time,
        call: &ConnectorCall,
    ) -> Result<ConnectorReply, ConnectorError> {
        let (_, _, mut reply) = self.context().prepare(now, call.clone())?;
        if self.mutation.is(Mutation::AnswerAheadWithoutAddress) {
            if let ConnectorReply::DecodeParams(params) | ConnectorReply::NextTurnParams(params) =
                &mut reply
            {
                params.remote_host = None;
                params.remote_port = None;
            }
        }
        Ok(reply)
    }

    /// A report of the network, a handshake or the transport.
    pub fn handle_event(&mut self, now: Time, event: NetEvent) {
        self.now = now;
        self.endpoint.handle_event(now, event);
    }

    /// Runs every timer due at `now`.
    pub fn handle_timeout(&mut self, now: Time) {
        self.now = now;
        self.endpoint.handle_timeout(now);
    }

    /// When [`Session::handle_timeout`] is due next.
    pub fn poll_timeout(&self) -> Option<Time> {
        self.endpoint.poll_timeout()
    }

    /// The next output, or `None` when there is none left for now. A sub-request's event is
    /// folded into its request here (aborting its siblings through the endpoint if it
    /// failed), so polling may queue more outputs: poll until `None`.
    pub fn poll_output(&mut self) -> Option<SessionOutput> {
        loop {
            if let Some(out) = self.ready.pop_front() {
                return Some(out);
            }
            let output = self.endpoint.poll_output()?;
            match route(output) {
                Routed::Transport(op) => return Some(SessionOutput::Transport(op)),
                Routed::Connect(peer) => return Some(SessionOutput::Connect(peer)),
                Routed::Event(event) => {
                    if self.observe {
                        self.ready.push_back(SessionOutput::Observed(event.clone()));
                    }
                    self.engine_event(event);
                }
            }
        }
    }

    /// What the call translation reads of the session.
    fn context(&self) -> CallContext<'_> {
        CallContext {
            identity: &self.identity,
            settings: &self.settings,
            peer_addresses: self.peer_addresses,
            clock_offsets: &self.clock_offsets,
        }
    }

    /// Takes one event of the endpoint: queues what the engine gets of it, if anything yet.
    fn engine_event(&mut self, event: EndpointEvent) {
        let Some(event) = self.fan_event(event) else {
            return;
        };
        self.ready
            .push_back(SessionOutput::Event(ConnectorEvent::from(event)));
    }

    /// One call on a rank without links.
    fn single_call(
        &mut self,
        now: Time,
        call: ConnectorCall,
    ) -> Result<ConnectorReply, ConnectorError> {
        let (input, address, reply) = self.context().prepare(now, call)?;
        self.endpoint.handle_call(now, input)?;
        // Only for an accepted call (a refused one leaves nothing behind); still ahead of the
        // endpoint's `Connect`, which `poll_output` delivers after what the session queued.
        if let Some(address) = address {
            self.ready.push_back(SessionOutput::PeerAddress(address));
        }
        Ok(reply)
    }

    /// One call on a rank with links: push and pull requests split into pair sub-requests, aborts of
    /// multi-rank requests abort every sub-request; everything else as without links.
    fn linked_call(
        &mut self,
        now: Time,
        call: ConnectorCall,
        links: &RankLinks,
    ) -> Result<ConnectorReply, ConnectorError> {
        match call {
            ConnectorCall::RequestAllocated {
                request,
                blocks,
                num_tokens,
                params,
            } => self
                .fan_allocated(now, links, &request, blocks, num_tokens, &params)
                .map(|()| ConnectorReply::Accepted),
            ConnectorCall::RequestFinished { .. } => match self.context().prepare(now, call)? {
                (crate::machine::EndpointCall::PrefillFinished(start), _, reply) => {
                    self.fan_finished(now, links, start).map(|()| reply)
                }
                (crate::machine::EndpointCall::Export(start), _, reply) => {
                    self.fan_exported(now, links, start).map(|()| reply)
                }
                _ => Err(ConnectorError::Unsupported(
                    "this call between engines of different geometries",
                )),
            },
            call @ (ConnectorCall::KeepForNextTurn { .. }
            | ConnectorCall::NextTurnAllocated { .. }) => match self.turn_links.clone() {
                Some(turn) => self.turn_call(now, call, &turn),
                None => Err(ConnectorError::Unsupported(
                    "bidirectional turns between engines of different geometries without turn links",
                )),
            },
            ConnectorCall::DeclineExport { request, params } => self
                .fan_declined(now, links, &request, &params)
                .map(|()| ConnectorReply::Accepted),
            ConnectorCall::PrefillStarted { .. } | ConnectorCall::LayersReady { .. } => {
                Err(ConnectorError::Unsupported(
                    "layer-wise push between engines of different geometries",
                ))
            }
            other @ (ConnectorCall::Abort { .. } | ConnectorCall::Shutdown) => {
                self.single_call(now, other)
            }
        }
    }

    /// Multi-rank requests in progress.
    pub fn fans_in_progress(&self) -> usize {
        self.fans.len()
    }
}

#[cfg(test)]
mod tests;
