//! The simulated world: engine ranks running real [`Endpoint`]s, a virtual clock, one queue of
//! future events, and the checks that run after every step.

mod config;
mod hostile;
mod net;
mod node;
mod schedule;
mod stall;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use kvhandoff_protocol::driver::TransportOp;
use kvhandoff_protocol::machine::{NetEvent, Time};
use kvhandoff_protocol::session::{KvTransferParams, Session, SessionOutput};
use kvhandoff_protocol::{EngineId, PairingKey, RequestId};
use kvhandoff_protocol::{PeerAddr, WriteId};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use sha2::{Digest, Sha256};

use crate::engine::Request;
use crate::ledger::Pool;
use crate::nixl::SimWrite;

pub use config::{
    WorldConfig, DEFAULT_LAYERWISE, DEFAULT_STALLS, DEFAULT_STALL_FREEZE,
    DEFAULT_STALL_MESSAGES_FIRST, FLOOD_MARKS, LAYERWISE_MARKS, MISNAME_MARKS, STALL_MARKS,
};
pub(crate) use net::{describe, is_notification};
pub(crate) use node::{incarnation_of, new_session, Node};
pub(crate) use schedule::{Ev, NetMsg, Rates};
pub(crate) use stall::Stall;

/// Index of an engine rank in the world: 0 is P's rank 0, `1..=decode_engines` are the D
/// engines, any further nodes are P's ranks 1.. (multi-rank worlds only), and then D's rank 1
/// where multi-rank turns are read back (`WorldConfig::multi_rank_turns`).
pub type NodeId = usize;

/// How many steps of trace a violation keeps.
const TRACE_LEN: usize = 24;

/// A broken invariant.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Violation {
    /// The seed of the run (0 in explore mode).
    pub seed: u64,
    /// The step at which it was seen.
    pub step: u64,
    /// What broke.
    pub message: String,
    /// The last steps before it.
    pub trace: Vec<String>,
}

/// The simulated world.
#[derive(Debug)]
pub struct World {
    pub(crate) cfg: WorldConfig,
    pub(crate) seed: u64,
    pub(crate) rng: ChaCha8Rng,
    pub(crate) rates: Rates,
    pub(crate) now: Time,
    pub(crate) heal: Time,
    pub(crate) nodes: Vec<Node>,
    pub(crate) by_addr: BTreeMap<PeerAddr, NodeId>,
    pub(crate) queue: BTreeMap<u64, (Time, Ev)>,
    pub(crate) due: BTreeSet<(Time, u64)>,
    pub(crate) next_seq: u64,
    pub(crate) writes: BTreeMap<u64, SimWrite>,
    pub(crate) active_writes: BTreeMap<(NodeId, u32, WriteId), u64>,
    pub(crate) partitions: Vec<(NodeId, Time, Time)>,
    /// Generation of the connection between two nodes (smaller id first): bumped by every
    /// handshake and every invalidation. What travels on an older generation is lost.
    pub(crate) conns: BTreeMap<(NodeId, NodeId), u64>,
    /// The generation each node's last handshake with a peer made (what it sends and posts on).
    pub(crate) views: BTreeMap<(NodeId, NodeId), u64>,
    /// The incarnation of `b` that `a` met at its last handshake with `b`: what `a`'s writes and
    /// messages are aimed at (a restarted `b` is another agent, with other memory).
    pub(crate) known: BTreeMap<(NodeId, NodeId), u32>,
    pub(crate) requests: Vec<Request>,
    pub(crate) keys: BTreeMap<PairingKey, usize>,
    pub(crate) crashes_left: u32,
    pub(crate) step: u64,
    pub(crate) trace: VecDeque<String>,
    pub(crate) hasher: Sha256,
    pub(crate) violations: Vec<Violation>,
    pub(crate) coverage: BTreeMap<&'static str, u64>,
    pub(crate) outcomes: BTreeMap<String, u64>,
    pub(crate) stale_writes: u64,
    /// Keys whose P→D answers are being lost (see `Rates::mute_answers`), and keys decided.
    pub(crate) muted: BTreeSet<PairingKey>,
    pub(crate) mute_decided: BTreeSet<PairingKey>,
    /// Decode keys that got a terminal event during the current step.
    pub(crate) step_decode_events: Vec<usize>,
    /// Registrations sent and delivered, by (sending D node, request, epoch).
    pub(crate) registers_sent: BTreeSet<(NodeId, u32, usize, u64)>,
    pub(crate) registers_delivered: BTreeSet<(NodeId, u32, usize, u64)>,
    /// `WriteDone`s delivered, by (D node, its incarnation, request, epoch, P node).
    pub(crate) notifs_delivered: BTreeMap<(NodeId, u32, usize, u64, NodeId), u32>,
    pub(crate) landed: BTreeMap<(NodeId, u32, usize, u64), u32>,
    /// Layers of layer-wise parts landed per (request, epoch) (the partial-set coverage mark).
    pub(crate) parts_landed: BTreeMap<(usize, u64), u32>,
    /// Writes landed whole, by (D node, its incarnation, request, epoch, P node): S8 for one
    /// sub-request of a multi-rank request.
    pub(crate) landed_pairs: BTreeMap<(NodeId, u32, usize, u64, NodeId), u32>,
    /// Registrations sent for the sub-requests of multi-rank requests, by (D node, pair key,
    /// epoch): several sub-requests of one request share a D node and an epoch.
    pub(crate) sub_registers: BTreeSet<(NodeId, PairingKey, u64)>,
    pub(crate) counters: kvhandoff_protocol::machine::Counters,
    /// Tombstones the endpoints evicted at capacity (summed over incarnations).
    pub(crate) tombstones_evicted: u64,
    /// Block-microseconds D blocks were held by a fence or quarantine (the fence's cost).
    pub(crate) fenced_block_us: u64,
    /// When an attempt last started or ended (the liveness window runs from here).
    pub(crate) last_progress: Time,
    /// Per node: starts waiting for free blocks (or for the process), oldest first, each as
    /// the event that starts it again.
    pub(crate) alloc_waiters: Vec<VecDeque<Ev>>,
    /// Stalls that began, and the transfers they froze.
    pub(crate) stalls_run: u64,
    /// Stalls started right after a post (`WorldConfig::stall_after_post`).
    pub(crate) post_stalls: u32,
    /// D attempts told fenced from a peer declared dead, by (D node, key, epoch): what L4
    /// checks at their end (`engine/fenced.rs`).
    pub(crate) fenced_watch: BTreeMap<(NodeId, PairingKey, u64), crate::engine::FencedWatch>,
    pub(crate) stall_frozen: u64,
    /// What each export answered the router with, by the export's request id: the reader's
    /// engine is handed these parameters (`engine/calls.rs`).
    pub(crate) answers: BTreeMap<RequestId, KvTransferParams>,
    /// Requests whose endpoint event the checker judged, by (node, request id): the blocks
    /// the engine frees when the session's event for the request comes (`engine/events.rs`).
    pub(crate) hand_backs: BTreeMap<(NodeId, RequestId), crate::engine::PendingHandBack>,
    /// Multi-rank requests by (rank, the engine's request id): the request's index.
    pub(crate) fan_parents: BTreeMap<(NodeId, RequestId), usize>,
    /// Multi-rank requests the session told fenced early, by (rank, request id).
    pub(crate) parents_fenced: BTreeSet<(NodeId, RequestId)>,
    /// Attempts the router sent again after their D's crash, without an epoch.
    pub(crate) router_retry_epochs: BTreeSet<(usize, RequestId)>,
    /// P's push leases as the checker computes them (L5, `engine/leases.rs`).
    pub(crate) p_leases: BTreeMap<crate::engine::LeaseKey, crate::engine::PLease>,
    /// Requests whose D the router hands the request about when P's lease ends, not yet met by
    /// their aimed stall (`WorldConfig::late_register`).
    pub(crate) late_registers: BTreeSet<usize>,
    /// The (D node, key) pairs whose cancels the network loses: orphaned registrations with
    /// a sibling (`WorldConfig::orphaned_registrations`).
    pub(crate) lost_cancels: crate::engine::LostCancels,
    /// Asks and grants sent, and readers met by the aimed late-grant stalls
    /// (`WorldConfig::late_grant`).
    pub(crate) late_grants: crate::engine::LateGrants,
    /// Exports answered ahead of their filing, and the asks of their readers
    /// (`WorldConfig::early_answers`).
    pub(crate) early: crate::engine::EarlyAnswers,
    /// Sibling D engines timed to register as their key's record ages
    /// (`WorldConfig::late_siblings`).
    pub(crate) siblings: crate::engine::LateSiblings,
    /// Layer-wise writers stopped between parts (`WorldConfig::stall_mid_layers`).
    pub(crate) mid_layer_stalls: crate::engine::MidLayerStalls,
    /// P ranks stopped with a registration pending (`WorldConfig::stall_pending_registration`).
    pub(crate) pending_stalls: crate::engine::PendingStalls,
    /// The hostile peers' streams and what the checks saw of them (`world/hostile.rs`).
    pub(crate) hostile: hostile::Hostile,
    /// Print every step to stderr (`KVHANDOFF_SIM_TRACE=1`).
    pub print_trace: bool,
}

/// Uniform duration in `[lo, hi]` microseconds.
pub(crate) fn micros(rng: &mut ChaCha8Rng, lo: u64, hi: u64) -> Duration {
    Duration::from_micros(rng.gen_range(lo..=hi))
}

impl World {
    /// A world for `seed`. In seeded mode, the fault rates, request shapes and start times are
    /// drawn from the seed's ChaCha8 stream; so is every later choice.
    pub fn new(cfg: WorldConfig, seed: u64) -> World {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let rates = if cfg.explore {
            Rates::default()
        } else {
            let mut rates = crate::engine::draw_rates(&mut rng, cfg.faults);
            if cfg.swarm {
                crate::swarm::draw_rates(seed, cfg.faults, &mut rates);
                if !cfg.late_completions {
                    rates.slow_write_done = 0.0;
                }
            }
            rates
        };
        let mut nodes = Vec::new();
        let mut by_addr = BTreeMap::new();
        let p_ranks = cfg.prefill_ranks.max(1);
        let d_rank_1 = usize::from(cfg.reads_turns_back_across_ranks());
        for i in 0..cfg.decode_engines + p_ranks + d_rank_1 {
            let (name, rank) = if i == 0 {
                ("prefill-0".to_string(), 0)
            } else if i <= cfg.decode_engines {
                (format!("decode-{}", i - 1), 0)
            } else if i < cfg.decode_engines + p_ranks {
                ("prefill-0".to_string(), (i - cfg.decode_engines) as u32)
            } else {
                // D's rank 1 for multi-rank requests read back across the pair.
                ("decode-0".to_string(), 1)
            };
            let addr = PeerAddr::new(EngineId::new(name).expect("valid engine id"), rank);
            by_addr.insert(addr.clone(), i);
            let session = new_session(&addr, &cfg);
            let info =
                crate::transport::peer_info(i, &addr, incarnation_of(i, 0), 0, cfg.pool_blocks);
            nodes.push(Node {
                shell: Some(crate::transport::shell(i, info)),
                addr,
                session: Some(session),
                incarnation: 0,
                pool: Pool::new(cfg.pool_blocks),
                posts_seen: 0,
                reads_seen: 0,
                stall: None,
                stalled_spans: Vec::new(),
                siblings_aborted: 0,
            });
        }
        let heal = Time::ZERO + cfg.span + Duration::from_millis(200);
        let cfg_marks = cfg.required_marks();
        let hostile = hostile::Hostile::new(seed, cfg.machine.heartbeat_interval);
        let mut world = World {
            crashes_left: cfg.max_crashes,
            cfg,
            seed,
            rng,
            rates,
            now: Time::ZERO,
            heal,
            nodes,
            by_addr,
            queue: BTreeMap::new(),
            due: BTreeSet::new(),
            next_seq: 0,
            writes: BTreeMap::new(),
            active_writes: BTreeMap::new(),
            partitions: Vec::new(),
            conns: BTreeMap::new(),
            views: BTreeMap::new(),
            known: BTreeMap::new(),
            requests: Vec::new(),
            keys: BTreeMap::new(),
            step: 0,
            trace: VecDeque::new(),
            hasher: Sha256::new(),
            violations: Vec::new(),
            coverage: cfg_marks.into_iter().map(|m| (m, 0)).collect(),
            outcomes: BTreeMap::new(),
            stale_writes: 0,
            muted: BTreeSet::new(),
            mute_decided: BTreeSet::new(),
            step_decode_events: Vec::new(),
            registers_sent: BTreeSet::new(),
            registers_delivered: BTreeSet::new(),
            notifs_delivered: BTreeMap::new(),
            landed: BTreeMap::new(),
            parts_landed: BTreeMap::new(),
            landed_pairs: BTreeMap::new(),
            sub_registers: BTreeSet::new(),
            counters: Default::default(),
            tombstones_evicted: 0,
            fenced_block_us: 0,
            last_progress: Time::ZERO,
            alloc_waiters: Vec::new(),
            stalls_run: 0,
            post_stalls: 0,
            fenced_watch: BTreeMap::new(),
            answers: BTreeMap::new(),
            hand_backs: BTreeMap::new(),
            fan_parents: BTreeMap::new(),
            parents_fenced: BTreeSet::new(),
            router_retry_epochs: BTreeSet::new(),
            p_leases: BTreeMap::new(),
            late_registers: BTreeSet::new(),
            lost_cancels: BTreeSet::new(),
            late_grants: crate::engine::LateGrants::new(seed),
            early: crate::engine::EarlyAnswers::new(seed),
            siblings: crate::engine::LateSiblings::new(seed),
            mid_layer_stalls: crate::engine::MidLayerStalls::new(seed),
            pending_stalls: crate::engine::PendingStalls::new(seed),
            stall_frozen: 0,
            hostile,
            print_trace: std::env::var_os("KVHANDOFF_SIM_TRACE").is_some(),
        };
        world.alloc_waiters = vec![VecDeque::new(); world.nodes.len()];
        world.setup_requests();
        world
    }

    /// Current virtual time.
    pub fn now(&self) -> Time {
        self.now
    }

    /// Violations found so far (a run stops at the first).
    pub fn violations(&self) -> &[Violation] {
        &self.violations
    }

    /// Coverage marks hit so far.
    pub fn coverage(&self) -> &BTreeMap<&'static str, u64> {
        &self.coverage
    }

    /// Steps taken.
    pub fn steps(&self) -> u64 {
        self.step
    }

    pub(crate) fn schedule(&mut self, after: Duration, ev: Ev) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        let at = self.now + after;
        self.queue.insert(seq, (at, ev));
        self.due.insert((at, seq));
        seq
    }

    pub(crate) fn unschedule(&mut self, seq: u64) -> Option<(Time, Ev)> {
        let (at, ev) = self.queue.remove(&seq)?;
        self.due.remove(&(at, seq));
        Some((at, ev))
    }

    pub(crate) fn mark(&mut self, name: &'static str) {
        *self.coverage.entry(name).or_insert(0) += 1;
    }

    pub(crate) fn faulty(&self) -> bool {
        !self.cfg.explore && self.now < self.heal
    }

    /// True with probability `p` while faults are on (seeded mode only).
    pub(crate) fn chance(&mut self, p: f64) -> bool {
        self.faulty() && p > 0.0 && self.rng.gen_bool(p.min(1.0))
    }

    pub(crate) fn violate(&mut self, message: String) {
        if self.violations.len() >= 8 {
            return;
        }
        self.violations.push(Violation {
            seed: self.seed,
            step: self.step,
            message,
            trace: self.trace.iter().cloned().collect(),
        });
    }

    /// Records one step's description in the trace and the trace hash.
    pub(crate) fn record(&mut self, what: String) {
        self.step += 1;
        let line = format!("#{} t={} {}", self.step, self.now, what);
        self.hasher.update(line.as_bytes());
        if self.print_trace {
            eprintln!("[seed {}] {line}", self.seed);
        }
        self.hasher.update(b"\n");
        if self.trace.len() == TRACE_LEN {
            self.trace.pop_front();
        }
        self.trace.push_back(line);
    }

    /// The SHA-256 of every step's description so far.
    pub fn trace_hash(&self) -> [u8; 32] {
        self.hasher.clone().finalize().into()
    }

    /// Whether `node` is one of P's ranks.
    pub(crate) fn is_prefill(&self, node: NodeId) -> bool {
        let d = self.cfg.decode_engines;
        node == 0 || (node > d && node < d + self.cfg.prefill_ranks.max(1))
    }

    /// P's ranks, in rank order.
    pub(crate) fn prefill_nodes(&self) -> Vec<NodeId> {
        let d = self.cfg.decode_engines;
        std::iter::once(0)
            .chain(d + 1..d + self.cfg.prefill_ranks.max(1))
            .collect()
    }

    /// The D ranks of multi-rank requests, in rank order: the D engines, or, where turns are
    /// read back across the pair, `decode-0`'s ranks 0 and 1 (its own last node).
    pub(crate) fn decode_rank_nodes(&self) -> Vec<NodeId> {
        if self.cfg.reads_turns_back_across_ranks() {
            vec![1, self.nodes.len() - 1]
        } else {
            (1..=self.cfg.decode_engines).collect()
        }
    }

    pub(crate) fn alive(&self, node: NodeId) -> bool {
        self.nodes[node].session.is_some()
    }

    /// Feeds `event` to `node`'s endpoint and acts on everything it outputs; false if the
    /// node is down.
    pub(crate) fn feed(&mut self, node: NodeId, event: NetEvent) -> bool {
        let now = self.now;
        let Some(session) = self.nodes[node].session.as_mut() else {
            return false;
        };
        session.handle_event(now, event);
        self.drain(node);
        true
    }

    /// Acts on every output of `node`, in order.
    pub(crate) fn drain(&mut self, node: NodeId) {
        loop {
            let Some(output) = self.nodes[node]
                .session
                .as_mut()
                .and_then(Session::poll_output)
            else {
                self.note_siblings_aborted(node);
                return;
            };
            // Handled as the actix shell handles them; transport outputs go through the shell's
            // own driver (`transport.rs`).
            match output {
                SessionOutput::Transport(TransportOp::Invalidate(peer)) => {
                    if let Some(&other) = self.by_addr.get(&peer) {
                        if self.alive(other) {
                            // Declared dead while its process runs (a partition, lost
                            // heartbeats): its writes go on.
                            self.mark("false_death_peer_alive");
                        }
                        self.invalidate(node, other);
                    }
                    self.shell_op(node, TransportOp::Invalidate(peer));
                }
                SessionOutput::Transport(op) => self.shell_op(node, op),
                SessionOutput::Connect(peer) => self.connect(node, &peer),
                SessionOutput::PeerAddress(address) => self.violate(format!(
                    "node {node} asked for the side channel of {} in process",
                    address.engine
                )),
                SessionOutput::Observed(event) => self.endpoint_event(node, event),
                SessionOutput::Event(event) => self.connector_event(node, event),
            }
        }
    }

    /// Runs every step-end check: allocator conservation and NIXL post accounting.
    pub(crate) fn check_step(&mut self) {
        for node in 0..self.nodes.len() {
            if let Err(e) = self.nodes[node].pool.check() {
                self.violate(format!("node {node}: {e}"));
            }
            if let Some(endpoint) = self.nodes[node].endpoint() {
                let posted = endpoint.counters().writes_posted;
                let reads = endpoint.counters().reads_posted;
                if reads != self.nodes[node].reads_seen {
                    let seen = self.nodes[node].reads_seen;
                    self.violate(format!(
                        "posts: node {node} counts {reads} reads posted but posted {seen}"
                    ));
                }
                if posted != self.nodes[node].posts_seen {
                    let seen = self.nodes[node].posts_seen;
                    // Accounting of the simulator against the machine's counter, not S8 (S8
                    // checks each `Ready` against the writes that really landed).
                    self.violate(format!(
                        "posts: node {node} counts {posted} writes posted but posted {seen}"
                    ));
                }
            }
        }
    }

    /// Fires `node`'s due timers.
    pub(crate) fn fire_timer(&mut self, node: NodeId) {
        let now = self.now;
        let line = format!("timer {}", self.nodes[node].addr);
        self.record(line);
        if let Some(session) = self.nodes[node].session.as_mut() {
            session.handle_timeout(now);
        }
        self.drain(node);
        self.check_step();
    }

    /// The earliest endpoint timer of a running process: (time, node). A stalled process runs
    /// no timer until it resumes.
    pub(crate) fn next_timer(&self) -> Option<(Time, NodeId)> {
        (0..self.nodes.len())
            .filter(|&n| !self.stalled(n))
            .filter_map(|n| Some((self.nodes[n].endpoint()?.poll_timeout()?, n)))
            .min()
    }

    /// One step of the seeded scheduler: the earliest event or timer. False when nothing is
    /// left to do.
    pub(crate) fn step_seeded(&mut self) -> bool {
        let event = self.due.first().copied();
        let timer = self.next_timer();
        if self.flood_step(event.map(|(at, _)| at), timer.map(|(t, _)| t)) {
            return true;
        }
        match (event, timer) {
            (None, None) => false,
            (Some((at, _)), Some((t, node))) if t <= at => {
                self.now = self.now.max(t);
                self.fire_timer(node);
                true
            }
            (None, Some((t, node))) => {
                self.now = self.now.max(t);
                self.fire_timer(node);
                true
            }
            (Some((at, seq)), _) => {
                self.now = self.now.max(at);
                let (_, ev) = self.unschedule(seq).expect("indexed");
                self.run_event(ev);
                true
            }
        }
    }

    /// Performs one event (dequeued already).
    pub(crate) fn run_event(&mut self, ev: Ev) {
        self.step_decode_events.clear();
        if let Some(node) = self.held_by_stall(&ev) {
            self.hold(node, ev);
            return;
        }
        match ev {
            Ev::Deliver(msg) => self.deliver(msg),
            Ev::Handle(msg) => self.handle_held(msg),
            Ev::Land { write } => self.land(write, false),
            Ev::Report { write, failure } => self.report(write, failure),
            Ev::Connect {
                from,
                from_inc,
                to,
                ok,
            } => {
                // A dial to a stopped process gets no answer: the side channel's deadline
                // fails it (the dialler tries again later).
                let ok = ok && !self.stalled(to);
                self.connect_done(from, from_inc, to, ok);
            }
            Ev::DecodeStart { request } => self.decode_start(request),
            Ev::PrefillStart { request } => self.prefill_start(request),
            Ev::FileExport {
                request,
                attempt,
                inc,
            } => self.file_export(request, attempt, inc),
            Ev::FileKeep {
                request,
                node,
                epoch,
                inc,
            } => self.file_keep(request, node, epoch, inc),
            Ev::FileSubExports { request, node, inc } => self.file_sub_exports(request, node, inc),
            Ev::FileTurnKeep { request, node, inc } => self.file_turn_keep(request, node, inc),
            Ev::LayersReady {
                request,
                attempt,
                inc,
                ready,
            } => self.layers_ready(request, attempt, inc, ready),
            Ev::SubDecodeStart { request, node } => self.sub_decode_start(request, node),
            Ev::SubPrefillStart { request, node } => self.sub_prefill_start(request, node),
            Ev::Abort { request, decode } => self.abort(request, decode),
            Ev::Crash { node } => self.crash(node),
            Ev::Restart { node } => self.restart(node),
            Ev::SecondDecode { request } => self.second_decode(request),
            Ev::SecondTurn { request } => self.second_turn(request),
            Ev::TurnBack { request, node } => self.turn_back(request, node),
            Ev::SiblingDecline {
                request,
                node,
                second_turn,
            } => self.sibling_decline(request, node, second_turn),
            Ev::Stall {
                node,
                length,
                freeze,
                messages_first,
            } => self.stall(node, length, freeze, messages_first),
            Ev::Resume { node, since } => self.resume(node, since),
            Ev::RepeatHandshake { a, b } => {
                let line = format!("repeat handshake {a}<->{b}");
                self.record(line);
                if self.alive(a) {
                    let inc = self.nodes[a].incarnation;
                    self.connect_done(a, inc, b, true);
                }
            }
        }
        self.check_step();
    }
}
