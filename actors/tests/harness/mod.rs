//! A deterministic world of real [`Endpoint`]s for end-to-end scenarios.
//!
//! - **Clock**: one virtual [`Time`]; [`Harness::advance`] fires every endpoint's timers at the
//!   instants they ask for ([`Endpoint::poll_timeout`]), delivering traffic in between.
//! - **Network**: every `Output::Send` becomes an [`Envelope`]. A test filter ([`Rule`]) decides
//!   whether it is delivered (FIFO, automatically), held for the test to deliver one by one, in
//!   any order, dropped, or duplicated.
//! - **Handshakes**: `Output::Connect` is answered with `PeerConnected` on both sides, held, or
//!   failed ([`ConnectMode`]).
//! - **NIXL writes**: `Output::PostWrite` becomes a [`PendingWrite`]; the test completes or fails
//!   it. Completion lands the data, reports `WriteCompleted` to the writer and then sends the
//!   write's notification to the target (after the data, as NIXL does). `AbandonWrite` fails a
//!   write that has not landed. `Output::Invalidate` cuts the pair: nothing posted between them
//!   can land any more.
//! - **Safety ghost**: a landing into `(target, key, epoch)` after the target's engine event for
//!   that key and epoch, or an engine event on D while a write into its blocks may still land,
//!   is a violation; a harness with violations panics when dropped.
//!
//! Every public action runs the world until it is quiet (no output left, no auto-delivered
//! message in flight) before returning.
#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use kvhandoff_protocol::machine::{
    Config, ConnectFailure, DecodeOutcome, DecodeStart, Endpoint, EngineCall, EngineEvent,
    FreeProof, NetEvent, Output, PrefillOutcome, PrefillStart, Rejected, Time, WriteOrder,
};
use kvhandoff_protocol::{BlockIds, EngineId, Epoch, Message, PairingKey, RequestId, WriteFailure};
use kvhandoff_protocol::{PeerAddr, WriteId};

// ---------------------------------------------------------------------------------------------
// Names and builders
// ---------------------------------------------------------------------------------------------

/// An engine id.
pub fn engine(name: &str) -> EngineId {
    EngineId::new(name).expect("valid engine id")
}

/// P's rank 0.
pub fn p_addr() -> PeerAddr {
    PeerAddr::new(engine("prefill"), 0)
}

/// P's rank 1 (only present after [`Harness::add_endpoint`]).
pub fn p1_addr() -> PeerAddr {
    PeerAddr::new(engine("prefill"), 1)
}

/// D's rank 0.
pub fn d_addr() -> PeerAddr {
    PeerAddr::new(engine("decode"), 0)
}

/// The uuid of request number `n`.
pub fn uuid(n: u32) -> String {
    format!("{n:08x}-aaaa-bbbb-cccc-1234567890ab")
}

/// P's id of request `n`: `cmpl-<uuid>-0-aaaaaaaa` (vLLM's random suffix).
pub fn p_request(n: u32) -> RequestId {
    RequestId::new(format!("cmpl-{}-0-aaaaaaaa", uuid(n))).expect("valid id")
}

/// D's id of request `n`: `cmpl-<uuid>-0-bbbbbbbb` (another random suffix).
pub fn d_request(n: u32) -> RequestId {
    RequestId::new(format!("cmpl-{}-0-bbbbbbbb", uuid(n))).expect("valid id")
}

/// The pairing key both sides derive for request `n`.
pub fn key(n: u32) -> PairingKey {
    PairingKey::from_request_id(&d_request(n))
}

/// One cache group.
pub fn blocks(ids: &[u32]) -> BlockIds {
    BlockIds::single_group(ids.to_vec())
}

/// D allocated `ids` for request `n`, to be written by P's rank 0 (epoch 1, one write).
pub fn decode_start(n: u32, ids: &[u32]) -> DecodeStart {
    let request = d_request(n);
    DecodeStart {
        key: PairingKey::from_request_id(&request),
        request,
        epoch: Epoch::FIRST,
        prefill: p_addr(),
        blocks: blocks(ids),
        num_tokens: 16 * ids.len() as u64,
        expected_writes: 1,
    }
}

/// P finished request `n` with `ids`.
pub fn prefill_start(n: u32, ids: &[u32]) -> PrefillStart {
    let request = p_request(n);
    PrefillStart {
        key: PairingKey::from_request_id(&request),
        request,
        blocks: blocks(ids),
    }
}

/// Milliseconds.
pub fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// `(outcome, proof)` of a D event; panics on a P event.
pub fn decode_result(event: &EngineEvent) -> (DecodeOutcome, FreeProof) {
    match event {
        EngineEvent::Decode { outcome, proof, .. } => (*outcome, *proof),
        EngineEvent::Prefill { .. } => panic!("expected a decode event, got {event:?}"),
    }
}

/// The outcome of a P event; panics on a D event.
pub fn prefill_result(event: &EngineEvent) -> PrefillOutcome {
    match event {
        EngineEvent::Prefill { outcome, .. } => *outcome,
        EngineEvent::Decode { .. } => panic!("expected a prefill event, got {event:?}"),
    }
}

/// P ranks 0 and 1 both finished request 1 ([10, 11] and [20, 21]); D allocated [500, 501]
/// expecting two writes, and its registration reached both ranks (D sends it to P rank 0; the
/// harness fans it out to rank 1). Both writes are posted and pending.
pub fn two_writers() -> Harness {
    let mut h = Harness::new();
    h.add_endpoint(p1_addr(), Config::fast());
    h.connect(&d_addr(), &p1_addr());
    h.prefill(prefill_start(1, &[10, 11])).unwrap();
    h.call(
        &p1_addr(),
        EngineCall::PrefillFinished(prefill_start(1, &[20, 21])),
    )
    .unwrap();
    let mut start = decode_start(1, &[500, 501]);
    start.expected_writes = 2;
    h.decode(start).unwrap();
    let register = h
        .sent
        .iter()
        .find(|(_, e)| matches!(e.message, Message::Register(_)))
        .map(|(_, e)| e.message.clone())
        .expect("D registered");
    h.inject(&d_addr(), &p1_addr(), register);
    assert_eq!(h.writes.len(), 2, "both ranks posted their write");
    h
}

// ---------------------------------------------------------------------------------------------
// The world
// ---------------------------------------------------------------------------------------------

/// A control message on the wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Envelope {
    /// Sender.
    pub from: PeerAddr,
    /// Receiver.
    pub to: PeerAddr,
    /// The message.
    pub message: Message,
}

/// What the network does with a message the filter looks at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    /// Deliver it in order, automatically.
    Deliver,
    /// Keep it in [`Harness::held`] until the test delivers or drops it.
    Hold,
    /// Lose it.
    Drop,
    /// Deliver it twice.
    Duplicate,
}

/// How the harness answers `Output::Connect`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConnectMode {
    /// `PeerConnected` on both sides at once.
    Auto,
    /// Keep the request in [`Harness::pending_connects`] until [`Harness::complete_connects`].
    Hold,
    /// `PeerConnectFailed` to the side that asked.
    Fail(ConnectFailure),
}

/// A posted write the test has not resolved yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingWrite {
    /// The rank that posted it.
    pub from: PeerAddr,
    /// Which incarnation of that rank (a restart makes a new one).
    pub incarnation: u32,
    /// The order.
    pub order: WriteOrder,
    /// The data has landed (the completion is not reported yet).
    pub landed: bool,
}

/// Data that landed in a target's blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Landing {
    /// When.
    pub at: Time,
    /// The rank that wrote.
    pub from: PeerAddr,
    /// Target.
    pub to: PeerAddr,
    /// Pairing key.
    pub key: PairingKey,
    /// Epoch.
    pub epoch: Epoch,
    /// Target blocks written.
    pub blocks: BlockIds,
}

/// One engine rank.
#[derive(Debug)]
pub struct Node {
    /// Its endpoint.
    pub ep: Endpoint,
    /// False once crashed: no input, no timer, traffic to it is lost.
    pub alive: bool,
    /// Bumped by each restart.
    pub incarnation: u32,
    /// Engine events, with the time they were emitted.
    pub events: Vec<(Time, EngineEvent)>,
    /// `Output::Invalidate`s, with their time.
    pub invalidated: Vec<(Time, PeerAddr)>,
    /// Requests the engine started (accepted `DecodeAllocated` / `PrefillFinished`).
    pub started: Vec<RequestId>,
}

type Filter = Box<dyn FnMut(&mut Envelope) -> Rule>;

/// The deterministic world.
pub struct Harness {
    /// Virtual time.
    pub now: Time,
    /// Every endpoint, by address.
    pub nodes: BTreeMap<PeerAddr, Node>,
    /// Messages on their way, delivered in order by [`Harness::run_until_quiet`].
    net: VecDeque<Envelope>,
    /// Messages the filter held; the test delivers them.
    pub held: VecDeque<Envelope>,
    filter: Option<Filter>,
    /// How handshakes are answered.
    pub connect_mode: ConnectMode,
    /// Handshakes held by [`ConnectMode::Hold`]: (asked by, peer).
    pub pending_connects: Vec<(PeerAddr, PeerAddr)>,
    /// When set, every posted write fails to post with this failure at once.
    pub reject_posts: Option<WriteFailure>,
    /// Posted writes not yet resolved.
    pub writes: BTreeMap<(PeerAddr, WriteId), PendingWrite>,
    /// Invalidated pairs (stored both ways) until they reconnect.
    cut: BTreeSet<(PeerAddr, PeerAddr)>,
    /// Every message sent (before the filter), with its time.
    pub sent: Vec<(Time, Envelope)>,
    /// Every write posted, with its time.
    pub posted: Vec<(Time, WriteOrder)>,
    /// Every landing.
    pub landings: Vec<Landing>,
    /// Messages that reached a crashed node.
    pub lost: Vec<Envelope>,
    /// Messages dropped by the filter or by the test.
    pub dropped: Vec<Envelope>,
    /// Safety violations seen by the ghost.
    pub violations: Vec<String>,
}

impl Drop for Harness {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            assert!(
                self.violations.is_empty(),
                "safety violations: {:#?}",
                self.violations
            );
        }
    }
}

impl Harness {
    /// P (`prefill`/0) and D (`decode`/0) with `Config::fast()`.
    pub fn new() -> Harness {
        Harness::with_config(Config::fast())
    }

    /// P and D with `config`.
    pub fn with_config(config: Config) -> Harness {
        let mut h = Harness {
            now: Time::ZERO,
            nodes: BTreeMap::new(),
            net: VecDeque::new(),
            held: VecDeque::new(),
            filter: None,
            connect_mode: ConnectMode::Auto,
            pending_connects: Vec::new(),
            reject_posts: None,
            writes: BTreeMap::new(),
            cut: BTreeSet::new(),
            sent: Vec::new(),
            posted: Vec::new(),
            landings: Vec::new(),
            lost: Vec::new(),
            dropped: Vec::new(),
            violations: Vec::new(),
        };
        h.add_endpoint(p_addr(), config.clone());
        h.add_endpoint(d_addr(), config);
        h
    }

    /// Adds an endpoint (e.g. P's rank 1).
    pub fn add_endpoint(&mut self, addr: PeerAddr, config: Config) {
        let ep = Endpoint::new(addr.engine.clone(), addr.rank, config).expect("valid config");
        self.nodes.insert(
            addr,
            Node {
                ep,
                alive: true,
                incarnation: 0,
                events: Vec::new(),
                invalidated: Vec::new(),
                started: Vec::new(),
            },
        );
    }

    // ---- access ------------------------------------------------------------------------------

    /// The endpoint at `addr`.
    pub fn ep(&self, addr: &PeerAddr) -> &Endpoint {
        &self.node(addr).ep
    }

    /// P's rank 0 endpoint.
    pub fn p(&self) -> &Endpoint {
        self.ep(&p_addr())
    }

    /// D's rank 0 endpoint.
    pub fn d(&self) -> &Endpoint {
        self.ep(&d_addr())
    }

    fn node(&self, addr: &PeerAddr) -> &Node {
        self.nodes
            .get(addr)
            .unwrap_or_else(|| panic!("no endpoint {addr}"))
    }

    fn node_mut(&mut self, addr: &PeerAddr) -> &mut Node {
        self.nodes
            .get_mut(addr)
            .unwrap_or_else(|| panic!("no endpoint {addr}"))
    }

    /// Engine events of `addr`, in order.
    pub fn events_of(&self, addr: &PeerAddr) -> Vec<EngineEvent> {
        self.node(addr)
            .events
            .iter()
            .map(|(_, e)| e.clone())
            .collect()
    }

    /// D's engine events.
    pub fn events_d(&self) -> Vec<EngineEvent> {
        self.events_of(&d_addr())
    }

    /// P's engine events.
    pub fn events_p(&self) -> Vec<EngineEvent> {
        self.events_of(&p_addr())
    }

    /// `(outcome, proof)` of every D event.
    pub fn d_results(&self) -> Vec<(DecodeOutcome, FreeProof)> {
        self.events_d().iter().map(decode_result).collect()
    }

    /// Outcome of every P event.
    pub fn p_results(&self) -> Vec<PrefillOutcome> {
        self.events_p().iter().map(prefill_result).collect()
    }

    /// When `addr` emitted its event about `request`.
    pub fn event_time(&self, addr: &PeerAddr, request: &RequestId) -> Option<Time> {
        self.node(addr)
            .events
            .iter()
            .find(|(_, e)| e.request() == request)
            .map(|(t, _)| *t)
    }

    /// Messages sent by `from` for which `pred` holds.
    pub fn count_sent(&self, from: &PeerAddr, pred: impl Fn(&Message) -> bool) -> usize {
        self.sent
            .iter()
            .filter(|(_, e)| &e.from == from && pred(&e.message))
            .count()
    }

    /// Ids of the pending writes, in order.
    pub fn pending_writes(&self) -> Vec<(PeerAddr, WriteId)> {
        self.writes.keys().cloned().collect()
    }

    /// The one pending write (panics unless exactly one).
    pub fn the_write(&self) -> (PeerAddr, WriteId) {
        let ids = self.pending_writes();
        assert_eq!(ids.len(), 1, "expected exactly one pending write: {ids:?}");
        ids[0].clone()
    }

    // ---- network control ---------------------------------------------------------------------

    /// Routes every new message through `filter` (replacing any previous one). The filter may
    /// also rewrite the message.
    pub fn set_filter(&mut self, filter: impl FnMut(&mut Envelope) -> Rule + 'static) {
        self.filter = Some(Box::new(filter));
    }

    /// Back to plain in-order delivery.
    pub fn clear_filter(&mut self) {
        self.filter = None;
    }

    /// Holds every new message.
    pub fn hold_all(&mut self) {
        self.set_filter(|_| Rule::Hold);
    }

    /// Delivers the oldest held message; returns it.
    pub fn deliver_held_next(&mut self) -> Option<Envelope> {
        let env = self.held.pop_front()?;
        self.deliver(env.clone());
        self.run_until_quiet();
        Some(env)
    }

    /// Delivers the oldest held message matching `pred` (overtaking older ones).
    pub fn deliver_held_where(&mut self, pred: impl Fn(&Envelope) -> bool) -> Option<Envelope> {
        let at = self.held.iter().position(pred)?;
        let env = self.held.remove(at).expect("position is valid");
        self.deliver(env.clone());
        self.run_until_quiet();
        Some(env)
    }

    /// Delivers every held message, oldest first (including those held meanwhile).
    pub fn deliver_all_held(&mut self) {
        while self.deliver_held_next().is_some() {}
    }

    /// Drops every held message matching `pred`; returns how many.
    pub fn drop_held_where(&mut self, pred: impl Fn(&Envelope) -> bool) -> usize {
        let (gone, kept): (Vec<_>, Vec<_>) = self.held.drain(..).partition(|e| pred(e));
        self.held = kept.into();
        let n = gone.len();
        self.dropped.extend(gone);
        n
    }

    /// Copies every held message matching `pred` to the end of the held queue.
    pub fn duplicate_held_where(&mut self, pred: impl Fn(&Envelope) -> bool) -> usize {
        let copies: Vec<Envelope> = self.held.iter().filter(|e| pred(e)).cloned().collect();
        let n = copies.len();
        self.held.extend(copies);
        n
    }

    /// Answers every held handshake with success.
    pub fn complete_connects(&mut self) {
        for (from, to) in std::mem::take(&mut self.pending_connects) {
            self.connect_pair(&from, &to);
        }
        self.run_until_quiet();
    }

    /// Answers every held handshake with failure.
    pub fn fail_connects(&mut self, reason: ConnectFailure) {
        for (from, to) in std::mem::take(&mut self.pending_connects) {
            self.feed(
                &from,
                NetEvent::PeerConnectFailed {
                    peer: to,
                    reason: reason.clone(),
                },
            );
        }
        self.run_until_quiet();
    }

    /// Connects `a` and `b` (both get `PeerConnected`), as a handshake `a` started.
    pub fn connect(&mut self, a: &PeerAddr, b: &PeerAddr) {
        self.connect_pair(a, b);
        self.run_until_quiet();
    }

    // ---- engine and transport inputs ---------------------------------------------------------

    /// The engine at `addr` makes `call`, then the world runs until quiet.
    pub fn call(&mut self, addr: &PeerAddr, call: EngineCall) -> Result<(), Rejected> {
        let result = self.push_call(addr, call);
        self.run_until_quiet();
        result
    }

    /// Hands `event` to `addr` as its network or transport would, then runs until quiet.
    pub fn event(&mut self, addr: &PeerAddr, event: NetEvent) {
        self.feed(addr, event);
        self.run_until_quiet();
    }

    /// D's engine allocated blocks.
    pub fn decode(&mut self, start: DecodeStart) -> Result<(), Rejected> {
        self.call(&d_addr(), EngineCall::DecodeAllocated(start))
    }

    /// P's engine finished a prefill.
    pub fn prefill(&mut self, start: PrefillStart) -> Result<(), Rejected> {
        self.call(&p_addr(), EngineCall::PrefillFinished(start))
    }

    /// The engine at `addr` aborts `request`.
    pub fn abort(&mut self, addr: &PeerAddr, request: RequestId) -> Result<(), Rejected> {
        self.call(addr, EngineCall::Abort { request })
    }

    /// Hands `message` to `to` as if `from` had sent it (bypassing the network).
    pub fn inject(&mut self, from: &PeerAddr, to: &PeerAddr, message: Message) {
        self.feed(
            to,
            NetEvent::Received {
                from: from.clone(),
                message,
            },
        );
        self.run_until_quiet();
    }

    /// Lands the write's data and its notification, but does not report the completion to the
    /// writer yet.
    pub fn land_write(&mut self, id: &(PeerAddr, WriteId)) {
        let w = self.writes.get_mut(id).expect("no such pending write");
        assert!(!w.landed, "the write already landed");
        w.landed = true;
        let w = w.clone();
        self.land(&w);
        self.run_until_quiet();
    }

    /// Completes a write: its data lands (unless it did), the writer learns, and the
    /// notification goes to the target after the data.
    pub fn complete_write(&mut self, id: &(PeerAddr, WriteId)) {
        let w = self.writes.remove(id).expect("no such pending write");
        if !w.landed {
            self.land(&w);
        }
        self.report(&w, None);
        self.run_until_quiet();
    }

    /// Completes every pending write, oldest first.
    pub fn complete_writes(&mut self) {
        for id in self.pending_writes() {
            if self.writes.contains_key(&id) {
                self.complete_write(&id);
            }
        }
    }

    /// Fails a write that has not landed.
    pub fn fail_write(&mut self, id: &(PeerAddr, WriteId), failure: WriteFailure) {
        let w = self.writes.remove(id).expect("no such pending write");
        assert!(!w.landed, "a landed write cannot fail");
        self.report(&w, Some(failure));
        self.run_until_quiet();
    }

    /// `addr` stops: no inputs, no timers; traffic to it is lost. Its posted writes stay in
    /// flight (they may still land until the target invalidates the connection).
    pub fn crash(&mut self, addr: &PeerAddr) {
        self.node_mut(addr).alive = false;
        self.run_until_quiet();
    }

    /// `addr` comes back as a fresh endpoint and handshakes with `peer` (both get
    /// `PeerConnected`). As `NetEvent::PeerConnected` requires, the peer's transport replaces the
    /// old incarnation first: nothing the old one posted can land any more. The old
    /// incarnation's requests and events are gone with it.
    pub fn restart(&mut self, addr: &PeerAddr, config: Config, peer: &PeerAddr) {
        let incarnation = self.node(addr).incarnation + 1;
        self.add_endpoint(addr.clone(), config);
        self.node_mut(addr).incarnation = incarnation;
        self.cut_pair(addr, peer);
        self.connect(addr, peer);
    }

    // ---- time --------------------------------------------------------------------------------

    /// The earliest timer of any live endpoint.
    pub fn next_timeout(&self) -> Option<Time> {
        self.nodes
            .values()
            .filter(|n| n.alive)
            .filter_map(|n| n.ep.poll_timeout())
            .min()
    }

    /// Moves time forward by `by`, firing every timer at the instant it asks for and running
    /// the world until quiet after each.
    pub fn advance(&mut self, by: Duration) {
        let target = self.now + by;
        self.advance_to(target);
    }

    /// Moves time forward to `target`.
    pub fn advance_to(&mut self, target: Time) {
        self.run_until_quiet();
        let mut steps = 0u32;
        while let Some(at) = self.next_timeout() {
            if at > target {
                break;
            }
            steps += 1;
            assert!(steps < 1_000_000, "timers do not advance (stuck at {at})");
            self.now = self.now.max(at);
            let due: Vec<PeerAddr> = self
                .nodes
                .iter()
                .filter(|(_, n)| n.alive && n.ep.poll_timeout().is_some_and(|t| t <= self.now))
                .map(|(a, _)| a.clone())
                .collect();
            for addr in due {
                let now = self.now;
                self.node_mut(&addr).ep.handle_timeout(now);
            }
            self.run_until_quiet();
        }
        self.now = self.now.max(target);
    }

    /// Drains every output and delivers every auto-delivered message until nothing moves.
    pub fn run_until_quiet(&mut self) {
        let mut steps = 0u32;
        loop {
            steps += 1;
            assert!(steps < 1_000_000, "the world does not quiesce");
            if self.pump() {
                continue;
            }
            match self.net.pop_front() {
                Some(env) => self.deliver(env),
                None => break,
            }
        }
    }

    // ---- checks ------------------------------------------------------------------------------

    /// The ledger: every request an engine started got exactly one event and nothing else did;
    /// no live request, pending registration or write is left on any live endpoint; the
    /// transport has nothing pending; the ghost saw no violation.
    pub fn assert_no_leak(&self) {
        for (addr, node) in &self.nodes {
            if !node.alive {
                continue;
            }
            let mut counts: BTreeMap<&RequestId, usize> = BTreeMap::new();
            for (_, event) in &node.events {
                *counts.entry(event.request()).or_insert(0) += 1;
            }
            for request in &node.started {
                assert_eq!(
                    counts.remove(request),
                    Some(1),
                    "{addr}: request {request} must end in exactly one event; events: {:#?}",
                    node.events
                );
            }
            assert!(
                counts.is_empty(),
                "{addr}: events for requests the engine never started: {counts:?}"
            );
            let stats = node.ep.stats();
            assert_eq!(
                stats.decode_requests, 0,
                "{addr}: live D requests: {stats:?}"
            );
            assert_eq!(
                stats.prefill_requests, 0,
                "{addr}: live P requests: {stats:?}"
            );
            assert_eq!(
                stats.pending_registrations, 0,
                "{addr}: pending registrations: {stats:?}"
            );
            assert_eq!(
                stats.writes_in_flight, 0,
                "{addr}: writes in flight: {stats:?}"
            );
            assert_eq!(
                stats.queued_outputs, 0,
                "{addr}: unpolled outputs: {stats:?}"
            );
            assert!(
                !node.ep.has_pending_work(),
                "{addr}: still has pending work"
            );
        }
        assert!(
            self.writes.is_empty(),
            "writes still pending: {:?}",
            self.writes
        );
        assert!(
            self.violations.is_empty(),
            "violations: {:#?}",
            self.violations
        );
    }

    // ---- internals ---------------------------------------------------------------------------

    fn push_call(&mut self, addr: &PeerAddr, call: EngineCall) -> Result<(), Rejected> {
        let now = self.now;
        let node = self.node_mut(addr);
        if !node.alive {
            return Ok(());
        }
        let started = match &call {
            EngineCall::DecodeAllocated(s) => Some(s.request.clone()),
            EngineCall::PrefillFinished(s) => Some(s.request.clone()),
            EngineCall::Shutdown | EngineCall::Abort { .. } => None,
        };
        let result = node.ep.handle_call(now, call);
        if let (Ok(()), Some(request)) = (&result, started) {
            node.started.push(request);
        }
        result
    }

    /// Feeds a network or transport event (never refused).
    fn feed(&mut self, addr: &PeerAddr, event: NetEvent) {
        let now = self.now;
        let node = self.node_mut(addr);
        if node.alive {
            node.ep.handle_event(now, event);
        }
    }

    /// Drains every endpoint's outputs once; true if any output was handled.
    fn pump(&mut self) -> bool {
        let mut moved = false;
        let addrs: Vec<PeerAddr> = self.nodes.keys().cloned().collect();
        for addr in addrs {
            while let Some(output) = {
                let node = self.node_mut(&addr);
                if node.alive {
                    node.ep.poll_output()
                } else {
                    None
                }
            } {
                moved = true;
                self.on_output(&addr, output);
            }
        }
        moved
    }

    fn on_output(&mut self, from: &PeerAddr, output: Output) {
        let now = self.now;
        match output {
            Output::Send { to, message } => {
                let env = Envelope {
                    from: from.clone(),
                    to,
                    message,
                };
                self.sent.push((now, env.clone()));
                self.enqueue(env);
            }
            Output::Connect { peer } => match self.connect_mode.clone() {
                ConnectMode::Auto => {
                    let reachable = self.nodes.get(&peer).is_some_and(|n| n.alive);
                    if reachable {
                        self.connect_pair(from, &peer);
                    } else {
                        let reason = ConnectFailure::Refused("unreachable".into());
                        self.feed(from, NetEvent::PeerConnectFailed { peer, reason });
                    }
                }
                ConnectMode::Hold => self.pending_connects.push((from.clone(), peer)),
                ConnectMode::Fail(reason) => {
                    self.feed(from, NetEvent::PeerConnectFailed { peer, reason });
                }
            },
            Output::PostWrite(order) => self.post(from, *order),
            Output::AbandonWrite { write } => {
                let id = (from.clone(), write);
                if let Some(w) = self.writes.remove(&id) {
                    // NIXL cannot cancel: the transport waits until the write can no longer
                    // land. A landed write is reported as completed.
                    let failure = (!w.landed).then_some(WriteFailure::TransferFailed);
                    self.report(&w, failure);
                }
            }
            Output::Invalidate { peer } => {
                self.node_mut(from).invalidated.push((now, peer.clone()));
                self.cut_pair(from, &peer);
            }
            Output::Event(event) => {
                self.check_event(from, &event);
                self.node_mut(from).events.push((now, event));
            }
        }
    }

    fn enqueue(&mut self, mut env: Envelope) {
        let rule = match self.filter.as_mut() {
            Some(filter) => filter(&mut env),
            None => Rule::Deliver,
        };
        match rule {
            Rule::Deliver => self.net.push_back(env),
            Rule::Hold => self.held.push_back(env),
            Rule::Drop => self.dropped.push(env),
            Rule::Duplicate => {
                self.net.push_back(env.clone());
                self.net.push_back(env);
            }
        }
    }

    fn deliver(&mut self, env: Envelope) {
        if !self.nodes.get(&env.to).is_some_and(|n| n.alive) {
            self.lost.push(env);
            return;
        }
        let input = NetEvent::Received {
            from: env.from,
            message: env.message,
        };
        self.feed(&env.to, input);
    }

    fn connect_pair(&mut self, a: &PeerAddr, b: &PeerAddr) {
        self.cut.remove(&(a.clone(), b.clone()));
        self.cut.remove(&(b.clone(), a.clone()));
        // The accepting side learns first, so it already knows the peer when its first message
        // arrives.
        let incarnation_of = |w: &Self, x: &PeerAddr| {
            kvhandoff_protocol::Incarnation(u128::from(w.node(x).incarnation))
        };
        let (of_a, of_b) = (incarnation_of(self, a), incarnation_of(self, b));
        self.feed(
            b,
            NetEvent::PeerConnected {
                peer: a.clone(),
                incarnation: of_a,
            },
        );
        self.feed(
            a,
            NetEvent::PeerConnected {
                peer: b.clone(),
                incarnation: of_b,
            },
        );
    }

    fn post(&mut self, from: &PeerAddr, order: WriteOrder) {
        self.posted.push((self.now, order.clone()));
        let w = PendingWrite {
            from: from.clone(),
            incarnation: self.node(from).incarnation,
            order,
            landed: false,
        };
        let cut = self.cut.contains(&(from.clone(), w.order.to.clone()));
        if let Some(failure) = self.reject_posts {
            self.report(&w, Some(failure));
        } else if cut {
            self.report(&w, Some(WriteFailure::TransferFailed));
        } else {
            let id = (from.clone(), w.order.write);
            assert!(
                self.writes.insert(id, w).is_none(),
                "write ids are unique per endpoint"
            );
        }
    }

    /// Tells the writer how its write ended (if it is still the incarnation that posted it).
    fn report(&mut self, w: &PendingWrite, failure: Option<WriteFailure>) {
        let node = self.node(&w.from);
        if !node.alive || node.incarnation != w.incarnation {
            return;
        }
        let write = w.order.write;
        let input = match failure {
            None => NetEvent::WriteCompleted { write },
            Some(failure) => NetEvent::WriteFailed { write, failure },
        };
        self.feed(&w.from, input);
    }

    /// The data lands in the target's blocks, then the notification follows it.
    fn land(&mut self, w: &PendingWrite) {
        let o = &w.order;
        if let Some(target) = self.nodes.get(&o.to) {
            let used = target.events.iter().any(|(_, e)| {
                matches!(e, EngineEvent::Decode { key, epoch, .. } if key == &o.key && *epoch == o.epoch)
            });
            if used {
                self.violations.push(format!(
                    "at {}: write {} from {} landed in {} blocks {:?} of {} {} after D handed them back",
                    self.now, o.write, w.from, o.to, o.remote, o.key, o.epoch
                ));
            }
        }
        self.landings.push(Landing {
            at: self.now,
            from: w.from.clone(),
            to: o.to.clone(),
            key: o.key.clone(),
            epoch: o.epoch,
            blocks: o.remote.clone(),
        });
        let env = Envelope {
            from: w.from.clone(),
            to: o.to.clone(),
            message: o.notification.clone(),
        };
        self.enqueue(env);
    }

    /// Invalidation: nothing posted between the pair can land any more; the transport fails
    /// those writes to their writers.
    fn cut_pair(&mut self, a: &PeerAddr, b: &PeerAddr) {
        self.cut.insert((a.clone(), b.clone()));
        self.cut.insert((b.clone(), a.clone()));
        let doomed: Vec<(PeerAddr, WriteId)> = self
            .writes
            .iter()
            .filter(|(_, w)| {
                (&w.from == a && &w.order.to == b) || (&w.from == b && &w.order.to == a)
            })
            .map(|(id, _)| id.clone())
            .collect();
        for id in doomed {
            let w = self.writes.remove(&id).expect("listed above");
            let failure = (!w.landed).then_some(WriteFailure::TransferFailed);
            self.report(&w, failure);
        }
    }

    /// D hands blocks back: no write into them for that key and epoch may still land.
    fn check_event(&mut self, at: &PeerAddr, event: &EngineEvent) {
        let EngineEvent::Decode {
            key, epoch, proof, ..
        } = event
        else {
            return;
        };
        if *proof == FreeProof::Quarantine {
            // A deadline, not a proof: the harness checks landings instead.
            return;
        }
        for (id, w) in &self.writes {
            let o = &w.order;
            if &o.to == at && &o.key == key && o.epoch == *epoch && !w.landed {
                self.violations.push(format!(
                    "at {}: {at} handed back {key} {epoch} ({proof:?}) while write {:?} may still land",
                    self.now, id
                ));
            }
        }
    }
}

impl Default for Harness {
    fn default() -> Self {
        Harness::new()
    }
}
