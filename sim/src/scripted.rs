//! The simulator's scripted mode: a deterministic world of real [`Endpoint`]s in which the
//! test is the scheduler. The seeded world ([`crate::World`]) draws every choice from a seed;
//! here each scenario makes them one by one, to reach an exact interleaving and assert on it.
//! Both worlds follow one table of NIXL's measured behaviour (`crate::nixl::measured`) and
//! judge D's hand-backs through one ledger check (`judge_hand_back` in `ledger.rs`).
//!
//! - **Clock**: one virtual [`Time`]; [`Harness::advance`] fires every endpoint's timers at the
//!   instants they ask for ([`Endpoint::poll_timeout`]), delivering traffic in between.
//! - **Network**: every `Output::Send` becomes an [`Envelope`]. A test filter ([`Rule`]) decides
//!   whether it is delivered (FIFO, automatically), held for the test to deliver one by one, in
//!   any order, dropped, or duplicated.
//! - **Handshakes**: `Output::Connect` is answered with `PeerConnected` on both sides, held, or
//!   failed ([`ConnectMode`]).
//! - **NIXL writes** (`writes.rs`): `Output::PostWrite` becomes a [`PendingWrite`]; the test
//!   lands, completes or fails it. Completion lands the data, reports `WriteCompleted` to the
//!   writer and then sends the write's notification to the target (after the data, as NIXL
//!   does). As measured, neither `AbandonWrite` nor `Output::Invalidate` stops a posted write;
//!   a write to a dead target fails, a dead poster's writes vanish, a post after the poster
//!   unloaded the target is refused, and a write left pending fails at its `max_write_life`.
//! - **Safety ghost** (`ghost.rs`): a landing into `(target, key, epoch)` after the target's
//!   engine event for that key and epoch, or a hand-back of D's blocks that the ledger's
//!   judgement rejects (a write may still land, P still holds the registration, a
//!   `NeverExposed` after a `Register`), is a violation; a harness with violations panics when
//!   dropped.
//!
//! - **Stalls**: [`Harness::stall`] stops a process (SIGSTOP, a paused VM): no timer, no input,
//!   no engine call; what reaches it is held, and the life clock of its pending transfers stops.
//!   [`Harness::resume`] runs its due timers first, then hands it what was held, in order (the
//!   shell's order since issue 19).
//!
//! Every public action runs the world until it is quiet (no output left, no auto-delivered
//! message in flight) before returning.

mod ghost;
mod names;
mod scripted_net;
mod scripted_reads;
mod writes;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use kvhandoff_protocol::machine::{
    Config, ConnectFailure, DecodeStart, Endpoint, EndpointCall, EndpointEvent, ExportStart,
    ImportStart, Mutation, NetEvent, Output, PrefillStart, ReadOrder, Rejected, Time, WriteOrder,
};
use kvhandoff_protocol::{Message, PeerAddr, RequestId, WriteFailure, WriteId};

pub use names::*;
pub use scripted_reads::PendingRead;
pub use writes::{Landing, PendingWrite};

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

/// One engine rank.
#[derive(Debug)]
pub struct Node {
    /// Its endpoint.
    pub ep: Endpoint,
    /// False once crashed: no input, no timer, traffic to it is lost.
    pub alive: bool,
    /// Bumped by each restart.
    pub incarnation: u32,
    /// Engine events that end a request and hand its blocks back, with the time they were
    /// emitted.
    pub events: Vec<(Time, EndpointEvent)>,
    /// Early failures of D requests whose blocks stay fenced (`EndpointEvent::DecodeFenced`),
    /// with their time: not ends, so kept apart from `events`.
    pub early: Vec<(Time, EndpointEvent)>,
    /// `Output::Invalidate`s, with their time.
    pub invalidated: Vec<(Time, PeerAddr)>,
    /// Requests the engine started (accepted `DecodeAllocated` / `PrefillFinished`).
    pub started: Vec<RequestId>,
    /// When the process stopped, while it is stalled.
    pub stalled_since: Option<Time>,
    /// What reached the stalled process, in arrival order (handed over at the resume).
    pub held: VecDeque<NetEvent>,
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
    /// Posted reads not yet resolved, by (reader, id).
    pub reads: BTreeMap<(PeerAddr, WriteId), PendingRead>,
    /// Every read posted, with its time.
    pub reads_posted: Vec<(Time, ReadOrder)>,
    /// Every read that landed (from the holder into the reader's blocks).
    pub read_landings: Vec<Landing>,
    /// (poster, target) pairs where the poster unloaded the target's metadata (invalidated
    /// it), until they shake hands again: the poster's posts to the target are refused.
    unloaded: BTreeSet<(PeerAddr, PeerAddr)>,
    /// (a, b) → the incarnation of `b` that `a` last shook hands with: what `a`'s writes are
    /// aimed at.
    known: BTreeMap<(PeerAddr, PeerAddr), u32>,
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
            reads: BTreeMap::new(),
            reads_posted: Vec::new(),
            read_landings: Vec::new(),
            unloaded: BTreeSet::new(),
            known: BTreeMap::new(),
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
                early: Vec::new(),
                invalidated: Vec::new(),
                started: Vec::new(),
                stalled_since: None,
                held: VecDeque::new(),
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

    /// Messages sent by `from` for which `pred` holds.
    pub fn count_sent(&self, from: &PeerAddr, pred: impl Fn(&Message) -> bool) -> usize {
        self.sent
            .iter()
            .filter(|(_, e)| &e.from == from && pred(&e.message))
            .count()
    }

    // ---- engine and transport inputs ---------------------------------------------------------

    /// The engine at `addr` makes `call`, then the world runs until quiet.
    pub fn call(&mut self, addr: &PeerAddr, call: EndpointCall) -> Result<(), Rejected> {
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
        self.call(&d_addr(), EndpointCall::DecodeAllocated(start))
    }

    /// P's engine finished a prefill.
    pub fn prefill(&mut self, start: PrefillStart) -> Result<(), Rejected> {
        self.call(&p_addr(), EndpointCall::PrefillFinished(start))
    }

    /// The engine at `addr` exports blocks for a remote reader.
    pub fn export(&mut self, addr: &PeerAddr, start: ExportStart) -> Result<(), Rejected> {
        self.call(addr, EndpointCall::Export(start))
    }

    /// The engine at `addr` reads a remote export into its blocks.
    pub fn import(&mut self, addr: &PeerAddr, start: ImportStart) -> Result<(), Rejected> {
        self.call(addr, EndpointCall::Import(start))
    }

    /// The engine at `addr` aborts `request`.
    pub fn abort(&mut self, addr: &PeerAddr, request: RequestId) -> Result<(), Rejected> {
        self.call(addr, EndpointCall::Abort { request })
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

    /// `addr` stops: no inputs, no timers; traffic to it is lost. Its posted writes stay in
    /// flight (they may still land until the target invalidates the connection).
    pub fn crash(&mut self, addr: &PeerAddr) {
        let node = self.node_mut(addr);
        node.alive = false;
        // A stopped process can be killed: what it held dies with it.
        node.stalled_since = None;
        node.held.clear();
        self.writes_of_dead(addr);
        self.reads_of_dead(addr);
        self.run_until_quiet();
    }

    /// `addr` comes back as a fresh endpoint (a new incarnation: another agent with other
    /// memory) and handshakes with `peer` (both get `PeerConnected`). A running `addr` dies
    /// first. The old incarnation's requests and events are gone with it.
    pub fn restart(&mut self, addr: &PeerAddr, config: Config, peer: &PeerAddr) {
        let node = self.node(addr);
        let (incarnation, was_alive) = (node.incarnation + 1, node.alive);
        if was_alive {
            self.node_mut(addr).alive = false;
            self.writes_of_dead(addr);
            self.reads_of_dead(addr);
        }
        self.add_endpoint(addr.clone(), config);
        self.node_mut(addr).incarnation = incarnation;
        self.connect(addr, peer);
    }

    /// `addr`'s process stops (SIGSTOP, a paused VM, a long GC pause): its endpoint runs no
    /// timer and gets no input until [`Harness::resume`]; messages and transfer reports for it
    /// are held, in arrival order; its engine makes no call (a call panics). Its pending writes
    /// and reads stay pending for the test to land or fail (bytes may move without the poster's
    /// CPU, or not), and the clock of their `max_write_life` stops with the process.
    pub fn stall(&mut self, addr: &PeerAddr) {
        self.run_until_quiet();
        let now = self.now;
        let node = self.node_mut(addr);
        assert!(node.alive, "{addr} is not running");
        node.stalled_since.get_or_insert(now);
    }

    /// `addr`'s process runs again: the life clock of its pending transfers moves on from where
    /// it stopped, its due timers run first, and then it is handed what was held, in order.
    pub fn resume(&mut self, addr: &PeerAddr) {
        self.resume_timers(addr);
        self.hand_over_held(addr);
    }

    /// The first half of [`Harness::resume`]: `addr` runs again and its due timers run, but what
    /// it held stays held until [`Harness::hand_over_held`], so that a test can let something
    /// else reach it first (a handshake its side channel completes before the shell feeds the
    /// queued notifications).
    pub fn resume_timers(&mut self, addr: &PeerAddr) {
        let now = self.now;
        let node = self.node_mut(addr);
        let Some(since) = node.stalled_since.take() else {
            return;
        };
        let stopped = now.saturating_since(since);
        for w in self.writes.values_mut().filter(|w| &w.from == addr) {
            w.ends_by = w.ends_by + stopped;
        }
        for r in self.reads.values_mut().filter(|r| &r.reader == addr) {
            r.ends_by = r.ends_by + stopped;
        }
        // Timers first: each round runs every timer due by now (a few at most).
        for _ in 0..16 {
            let node = self.node_mut(addr);
            if node.ep.poll_timeout().is_none_or(|t| t > now) {
                break;
            }
            node.ep.handle_timeout(now);
            self.run_until_quiet();
        }
    }

    /// Hands resumed `addr` what it held through its stall, in arrival order.
    pub fn hand_over_held(&mut self, addr: &PeerAddr) {
        let held = std::mem::take(&mut self.node_mut(addr).held);
        for event in held {
            self.feed(addr, event);
            self.run_until_quiet();
        }
    }

    /// Whether `addr`'s process is stalled.
    pub fn is_stalled(&self, addr: &PeerAddr) -> bool {
        self.node(addr).stalled_since.is_some()
    }

    /// The endpoint now at `addr` runs with the deliberate bug
    /// `mutation` (the ghost's own mutation check).
    pub fn set_mutation(&mut self, addr: &PeerAddr, mutation: Option<Mutation>) {
        self.node_mut(addr).ep.set_mutation(mutation);
    }

    // ---- time --------------------------------------------------------------------------------

    /// The earliest timer of any live endpoint.
    pub fn next_timeout(&self) -> Option<Time> {
        self.nodes
            .values()
            .filter(|n| n.alive && n.stalled_since.is_none())
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
        loop {
            let next = [
                self.next_timeout(),
                self.next_write_end(),
                self.next_read_end(),
            ]
            .into_iter()
            .flatten()
            .min();
            let Some(next) = next else {
                break;
            };
            if next > target {
                break;
            }
            steps += 1;
            assert!(steps < 1_000_000, "timers do not advance (stuck at {next})");
            self.now = self.now.max(next);
            // A write has ended by its bound: that comes before what the timers do then.
            self.end_expired_writes();
            self.end_expired_reads();
            self.run_until_quiet();
            let due: Vec<PeerAddr> = self
                .nodes
                .iter()
                .filter(|(_, n)| n.alive && n.stalled_since.is_none())
                .filter(|(_, n)| n.ep.poll_timeout().is_some_and(|t| t <= self.now))
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

    // ---- internals ---------------------------------------------------------------------------

    fn push_call(&mut self, addr: &PeerAddr, call: EndpointCall) -> Result<(), Rejected> {
        let now = self.now;
        let node = self.node_mut(addr);
        if !node.alive {
            return Ok(());
        }
        assert!(
            node.stalled_since.is_none(),
            "the engine of stalled {addr} makes no call"
        );
        let started = match &call {
            EndpointCall::DecodeAllocated(s) => Some(s.request.clone()),
            EndpointCall::PrefillFinished(s) => Some(s.request.clone()),
            EndpointCall::PrefillStarted { start, .. } => Some(start.request.clone()),
            EndpointCall::Export(s) => Some(s.request.clone()),
            EndpointCall::Import(s) => Some(s.request.clone()),
            EndpointCall::Shutdown
            | EndpointCall::LayersReady { .. }
            | EndpointCall::Abort { .. }
            | EndpointCall::DeclineExport { .. } => None,
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
        if !node.alive {
            return;
        }
        if node.stalled_since.is_some() {
            node.held.push_back(event);
            return;
        }
        node.ep.handle_event(now, event);
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
            Output::PostWrite(order) => {
                assert!(
                    order.stream.is_none(),
                    "the scripted world posts whole writes only; layer-wise writes run in the \
                     seeded world, through the shell's driver"
                );
                self.post(from, *order);
            }
            Output::ExtendWrite { .. } => {
                panic!("the scripted world posts whole writes only (see Output::PostWrite)")
            }
            Output::PostRead(order) => self.post_read(from, *order),
            Output::AbandonWrite { write } => self.abandon(from, write),
            Output::Invalidate { peer } => {
                self.node_mut(from).invalidated.push((now, peer.clone()));
                self.invalidated(from, &peer);
            }
            Output::Event(event) => {
                self.check_event(from, &event);
                let node = self.node_mut(from);
                if event.hands_back() {
                    node.events.push((now, event));
                } else {
                    node.early.push((now, event));
                }
            }
        }
    }
}

impl Default for Harness {
    fn default() -> Self {
        Harness::new()
    }
}
