//! The engine model: requests arriving on D and P (either first), block allocation, engine
//! aborts, retries with a new epoch, crashes and restarts, and the checks on every terminal
//! event.

mod calls;
mod early_answers;
mod early_keeps;
mod events;
mod expired_registrations;
mod fenced;
mod lapsed_layers;
mod late_copies;
mod late_grants;
mod late_siblings;
mod layerwise;
mod leases;
mod orphans;
pub(crate) use early_answers::EarlyAnswers;
pub(crate) use events::PendingHandBack;
pub(crate) use expired_registrations::PendingStalls;
pub(crate) use fenced::FencedWatch;
pub(crate) use lapsed_layers::MidLayerStalls;
pub(crate) use late_grants::LateGrants;
pub(crate) use late_siblings::LateSiblings;
pub(crate) use leases::{quiet_stall_budget, LeaseKey, PLease};
pub(crate) use orphans::LostCancels;
mod multi;
mod read_path;
mod report;
mod workload;

pub(crate) use multi::Multi;
pub use multi::MULTI_SOURCE_PREFILL_RANKS;
pub(crate) use workload::draw_rates;

use std::time::Duration;

use kvhandoff_protocol::machine::{DecodeFailure, LoadFailurePolicy, Time};
use kvhandoff_protocol::session::ConnectorCall;
use kvhandoff_protocol::{BlockIds, Message, PairingKey, RequestId};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::ledger::{Owner, Pool};
use crate::world::{micros, Ev, NetMsg, NodeId, Rates, World};
use crate::Faults;

/// Where one side's attempt at a request is.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Status {
    Pending,
    /// Started on incarnation `node_inc` of its node at `started`; `fenced` once a D attempt
    /// was told it failed while its blocks stay out (`EndpointEvent::DecodeFenced`), with the
    /// failure its final event must repeat.
    Live {
        node_inc: u32,
        started: Time,
        fenced: Option<DecodeFailure>,
    },
    Done,
    Lost,
    Skipped,
}

/// One attempt on one side.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Attempt {
    pub id: RequestId,
    /// The node it runs on: P's, the request's D, or another D (a second decode of the key).
    pub node: NodeId,
    /// D: the epoch; P: the attempt number.
    pub epoch: u64,
    pub blocks: Vec<u32>,
    pub status: Status,
    pub kind: AttemptKind,
    /// The pair this attempt serves, if it is a sub-request of a multi-rank request.
    pub sub: Option<Sub>,
}

impl Attempt {
    /// Live on incarnation `inc` of its node since `now`, exporting until `hard_end`.
    pub(crate) fn export_live(&mut self, inc: u32, now: Time, hard_end: Time) {
        self.kind = AttemptKind::Export {
            hard_end,
            renewed: false,
        };
        self.status = Status::Live {
            node_inc: inc,
            started: now,
            fenced: None,
        };
    }
}

/// One sub-request of a multi-rank request: an ordinary 1:1 handoff under its pair's key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Sub {
    /// The pair's key (`PairingKey::for_pair`).
    pub key: PairingKey,
    /// The rank on the other side of the pair (D's sub-request: its P rank; P's: its D rank).
    pub peer: NodeId,
    /// A part of the request's second turn read back across the pair (`multi/turn.rs`): D's
    /// export of its kept blocks, or P's import of them.
    pub turn: bool,
}

/// What an attempt does.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum AttemptKind {
    /// Push: D registers (`d`), P writes (`p`).
    Push,
    /// Exports blocks for a reader until `hard_end`; `renewed` once a waiting reader's
    /// heartbeat renewed it.
    Export { hard_end: Time, renewed: bool },
    /// Reads an export under attempt `read_epoch` (the key's epoch on the wire; `epoch` is the
    /// ledger's owner of the blocks).
    Import { read_epoch: u64 },
}

/// A second turn of a request: D keeps its blocks for `ttl` and P reads them back after
/// `delay` into `blocks` blocks (or declines).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct SecondTurn {
    pub key: PairingKey,
    pub ttl: Duration,
    pub delay: Duration,
    pub blocks: usize,
    pub decline: bool,
    pub gate: bool,
}

/// How a request moves its KV.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Transfer {
    /// The first turn is pulled (D reads P), not pushed.
    pub pull: bool,
    /// What a failed read means to the reader's engine.
    pub policy: LoadFailurePolicy,
    /// The reader passes the export's expiry (its own gate declines a read too near it).
    pub gate: bool,
    /// A second turn, if the request has one.
    pub second: Option<SecondTurn>,
    /// How long after a read of this request starts a sibling with the same transfer
    /// parameters declines the export it reads (real engines run siblings: `n > 1`, retries).
    pub sibling_decline: Option<Duration>,
    /// P hands the first turn over layer-wise (single-source push only).
    pub layerwise: bool,
}

/// One request of the workload.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Request {
    pub key: PairingKey,
    pub d_node: NodeId,
    pub p_blocks: usize,
    pub d_blocks: usize,
    pub d: Vec<Attempt>,
    pub p: Vec<Attempt>,
    pub transfer: Transfer,
    /// The pairs and fan-ins of a multi-rank request (then `d` and `p` hold its sub-requests).
    pub multi: Option<Box<Multi>>,
}

/// Tokens per simulated block.
pub(crate) const BLOCK_TOKENS: u32 = 16;

/// The engine event that (re)tries to start `request` on D (`decode`) or P.
fn start_event(request: usize, decode: bool) -> Ev {
    if decode {
        Ev::DecodeStart { request }
    } else {
        Ev::PrefillStart { request }
    }
}

fn rid(side: &str, request: usize, attempt: u64) -> RequestId {
    RequestId::new(format!("{side}{request}a{attempt}")).expect("valid request id")
}

impl World {
    pub(crate) fn decode_start(&mut self, request: usize) {
        let r = &self.requests[request];
        let node = r.d_node;
        let pending =
            r.d.iter()
                .position(|a| a.node == node && a.status == Status::Pending);
        let Some(attempt) = pending else {
            // Nothing to start (a duplicate start): pass the wake-up on.
            self.wake_waiters(node, 1);
            return;
        };
        self.decode_start_at(request, attempt, true);
    }

    /// A second D engine allocates for a key another D engine serves (the router sent the
    /// decode leg twice, or failed over): same key, the current epoch, its own blocks. P serves
    /// one of the two registrations; the other D waits for its deadline and the fence.
    pub(crate) fn second_decode(&mut self, request: usize) {
        let r = &self.requests[request];
        if r.transfer.pull || r.multi.is_some() {
            // A pulled request's router hands P's answer to one D, and a multi-rank request's
            // D ranks are its pairs: no second decode.
            return;
        }
        let Some(current) = r.d.iter().rev().find(|a| a.node == r.d_node) else {
            return;
        };
        let epoch = current.epoch;
        let node = 1 + (r.d_node % self.cfg.decode_engines);
        if node == r.d_node || r.d.iter().any(|a| a.node == node) {
            return;
        }
        self.requests[request].d.push(Attempt {
            id: rid("d2-", request, epoch),
            node,
            epoch,
            blocks: vec![],
            status: Status::Pending,
            kind: AttemptKind::Push,
            sub: None,
        });
        let attempt = self.requests[request].d.len() - 1;
        self.decode_start_at(request, attempt, false);
        if matches!(
            self.requests[request].d[attempt].status,
            Status::Live { .. }
        ) {
            self.mark("second_decode_same_key");
        }
    }

    /// Starts D attempt `attempt` of `request` on its node. A primary attempt that finds no
    /// blocks (or no room for its tombstone) waits and tries again; a second decode gives up.
    fn decode_start_at(&mut self, request: usize, attempt: usize, primary: bool) {
        if self.requests[request].transfer.pull {
            self.pull_decode_start(request, attempt);
            return;
        }
        let r = self.requests[request].clone();
        let a = r.d[attempt].clone();
        let node = a.node;
        self.record(format!("engine: D allocates {} {}", r.key, a.id));
        let owner = Owner {
            request,
            epoch: a.epoch,
        };
        let blocks = self.allocate_on(node, r.d_blocks, owner);
        let Some(blocks) = blocks else {
            if !primary {
                self.requests[request].d[attempt].status = Status::Skipped;
                return;
            }
            // No memory or no process: the engine waits until blocks are freed (or the
            // process is back), as a real scheduler's queue does.
            self.wait_for_blocks(node, start_event(request, true));
            return;
        };
        let mut params = self.router_params(&r.key, a.epoch, 0);
        if self.router_retry_epochs.contains(&(request, a.id.clone())) {
            // A router that knows nothing of epochs sends none.
            params.epoch = None;
            self.mark("router_retry_at_epoch_one");
        }
        let call = ConnectorCall::RequestAllocated {
            request: a.id,
            blocks: BlockIds::single_group(blocks.clone()),
            num_tokens: u64::from(BLOCK_TOKENS) * r.d_blocks as u64,
            params,
        };
        let retry = primary.then(|| start_event(request, true));
        if self
            .engine_call(node, call, &blocks, owner, retry)
            .is_none()
        {
            if !primary {
                self.requests[request].d[attempt].status = Status::Skipped;
            }
            return;
        }
        let inc = self.nodes[node].incarnation;
        let r = &mut self.requests[request];
        r.d[attempt].blocks = blocks;
        r.d[attempt].status = Status::Live {
            node_inc: inc,
            started: self.now,
            fenced: None,
        };
        self.last_progress = self.now;
        self.drain(node);
    }

    pub(crate) fn prefill_start(&mut self, request: usize) {
        let r = self.requests[request].clone();
        let Some(attempt) = r.p.iter().position(|a| a.status == Status::Pending) else {
            self.wake_waiters(0, 1);
            return;
        };
        let a = r.p[attempt].clone();
        self.record(format!("engine: P finishes {} {}", r.key, a.id));
        if r.p.iter().any(|x| matches!(x.status, Status::Live { .. })) {
            self.requests[request].p[attempt].status = Status::Skipped;
            *self.outcomes.entry("prefill.skipped".into()).or_insert(0) += 1;
            self.wake_waiters(0, 1);
            return;
        }
        let owner = Owner {
            request,
            epoch: a.epoch,
        };
        let n = r.p_blocks;
        let blocks = self.allocate_on(0, n, owner);
        let Some(blocks) = blocks else {
            self.wait_for_blocks(0, start_event(request, false));
            return;
        };
        for (index, &b) in blocks.iter().enumerate() {
            self.nodes[0].pool.fill(b, request, 0, index);
        }
        let mut params = self.router_params(&r.key, a.epoch, 1);
        params.do_remote_prefill = false;
        params.do_remote_decode = true;
        if r.transfer.pull {
            params.transfer_mode = Some("pull".into());
        }
        let (request_id, blocks_ids) = (a.id.clone(), BlockIds::single_group(blocks.clone()));
        let num_tokens = u64::from(BLOCK_TOKENS) * n as u64;
        let call = if r.transfer.layerwise {
            ConnectorCall::PrefillStarted {
                request: request_id,
                blocks: blocks_ids,
                num_tokens,
                params,
            }
        } else {
            ConnectorCall::RequestFinished {
                request: request_id,
                blocks: blocks_ids,
                num_tokens,
                params,
            }
        };
        if r.transfer.pull && self.answer_ahead(request, attempt, &call, &blocks) {
            self.last_progress = self.now;
            return;
        }
        let retry = Some(Ev::PrefillStart { request });
        self.note_finish_with_expired_registration(0, &r.key);
        let Some(reply) = self.engine_call(0, call, &blocks, owner, retry) else {
            return;
        };
        if r.transfer.pull {
            self.keep_answer(&a.id, reply);
        }
        let inc = self.nodes[0].incarnation;
        let hard_end = kvhandoff_protocol::machine::export_hard_end(
            self.now,
            self.cfg.machine.lease_duration,
            &self.cfg.machine,
        );
        let r = &mut self.requests[request];
        if r.transfer.pull {
            r.p[attempt].kind = AttemptKind::Export {
                hard_end,
                renewed: false,
            };
        }
        r.p[attempt].blocks = blocks;
        r.p[attempt].status = Status::Live {
            node_inc: inc,
            started: self.now,
            fenced: None,
        };
        let (pull, layerwise) = (r.transfer.pull, r.transfer.layerwise);
        if !pull {
            self.lease_started(0, request, a.epoch);
        }
        if layerwise {
            self.next_layer(request, attempt, inc, 0);
        }
        self.last_progress = self.now;
        self.drain(0);
    }

    /// `n` blocks of `node`'s pool for `owner`, if its process runs and has them.
    fn allocate_on(&mut self, node: NodeId, n: usize, owner: Owner) -> Option<Vec<u32>> {
        if !self.alive(node) {
            return None;
        }
        self.nodes[node].pool.allocate(n, owner)
    }

    /// The start `again` found no blocks (or no process) on `node`: it runs again once blocks
    /// are freed there (or a little later, with `poll_allocations`).
    fn wait_for_blocks(&mut self, node: NodeId, again: Ev) {
        if self.cfg.poll_allocations {
            let later = micros(&mut self.rng, 2_000, 10_000);
            self.schedule(later, again);
        } else {
            self.alloc_waiters[node].push_back(again);
        }
    }

    /// `freed` blocks came back on `node` (or the node restarted, `usize::MAX`): the engine
    /// retries that many waiting allocations, oldest first.
    pub(crate) fn wake_waiters(&mut self, node: NodeId, freed: usize) {
        if self.cfg.poll_allocations {
            return;
        }
        for _ in 0..freed {
            let Some(again) = self.alloc_waiters[node].pop_front() else {
                return;
            };
            let later = micros(&mut self.rng, 0, 2_000);
            self.schedule(later, again);
        }
    }

    pub(crate) fn abort(&mut self, request: usize, decode: bool) {
        if self.requests[request].multi.is_some() {
            self.multi_abort(request, decode);
            return;
        }
        let r = &self.requests[request];
        let (node, a) = if decode {
            (r.d_node, r.d.iter().rev().find(|a| a.node == r.d_node))
        } else {
            (0, r.p.last())
        };
        let a = a.expect("one attempt at least").clone();
        self.record(format!("engine: abort {}", a.id));
        if matches!(a.status, Status::Live { .. }) && self.alive(node) {
            // Refused only if the request just ended, which is fine.
            let _ = self.call(node, ConnectorCall::Abort { request: a.id });
            self.drain(node);
        }
    }

    pub(crate) fn crash(&mut self, node: NodeId) {
        self.record(format!("crash {}", self.nodes[node].addr));
        let Some(session) = self.nodes[node].session.take() else {
            return;
        };
        let endpoint = session.endpoint();
        self.mark("crash_restart");
        self.nodes[node].shell = None;
        let agent =
            crate::transport::agent_name(&self.nodes[node].addr, self.nodes[node].incarnation);
        for other in self.nodes.iter_mut() {
            if let Some(shell) = other.shell.as_mut() {
                shell.transport_mut().agent_died(agent.clone());
            }
        }
        self.absorb_counters(endpoint);
        self.writes_of_crashed(node);
        // Its connections die with the process: nothing in flight on them arrives.
        for peer in 0..self.nodes.len() {
            if peer != node {
                self.bump_conn(node, peer);
            }
        }
        self.nodes[node].incarnation += 1;
        self.nodes[node].pool = Pool::new(self.cfg.pool_blocks);
        self.nodes[node].posts_seen = 0;
        self.nodes[node].reads_seen = 0;
        let prefill = self.is_prefill(node);
        for r in &mut self.requests {
            let attempts = if prefill { &mut r.p } else { &mut r.d };
            for a in attempts.iter_mut().filter(|a| a.node == node) {
                if matches!(a.status, Status::Live { .. }) {
                    a.status = Status::Lost;
                    let side = if prefill { "prefill" } else { "decode" };
                    *self
                        .outcomes
                        .entry(format!("{side}.lost_in_crash"))
                        .or_insert(0) += 1;
                }
            }
        }
        // A stopped process can be killed: what it held is judged against its death.
        self.end_stall_by_crash(node);
        let later = micros(&mut self.rng, 20_000, 400_000);
        self.schedule(later, Ev::Restart { node });
    }

    pub(crate) fn restart(&mut self, node: NodeId) {
        self.record(format!("restart {}", self.nodes[node].addr));
        if self.alive(node) {
            return;
        }
        let session = crate::world::new_session(&self.nodes[node].addr, &self.cfg);
        self.nodes[node].session = Some(session);
        self.router_retries(node);
        let info = self.info_of(node);
        self.nodes[node].shell = Some(crate::transport::shell(node, info));
        self.wake_waiters(node, usize::MAX);
    }

    /// D `node` is back from a crash: the router sends each push request it lost there again
    /// (by chance, `Rates::router_retry`), as a router that knows nothing of epochs does: a new
    /// request id, the same `transfer_id`, epoch 1. The new incarnation admits epoch 1, and P
    /// serves it once the old incarnation's records stop judging (`docs/protocol.md` §3.1.1).
    fn router_retries(&mut self, node: NodeId) {
        if self.rates.router_retry <= 0.0 || self.is_prefill(node) {
            return;
        }
        for request in 0..self.requests.len() {
            let r = &self.requests[request];
            let lost = r.d_node == node
                && !r.transfer.pull
                && r.multi.is_none()
                && r.d
                    .last()
                    .is_some_and(|a| a.node == node && a.status == Status::Lost);
            if !lost || !self.chance(self.rates.router_retry) {
                continue;
            }
            let n = self.requests[request].d.len() as u64;
            self.requests[request].d.push(Attempt {
                id: rid("r", request, n),
                node,
                epoch: 1,
                blocks: vec![],
                status: Status::Pending,
                kind: AttemptKind::Push,
                sub: None,
            });
            let id = rid("r", request, n);
            self.router_retry_epochs.insert((request, id));
            let at = micros(&mut self.rng, 1_000, 50_000);
            self.schedule(at, Ev::DecodeStart { request });
        }
    }

    pub(crate) fn p_attempt_live(&self, owner: Owner) -> bool {
        self.requests[owner.request]
            .p
            .iter()
            .any(|a| a.epoch == owner.epoch && matches!(a.status, Status::Live { .. }))
    }

    /// Notes what a sent message means for the coverage marks.
    pub(crate) fn note_sent(&mut self, from: NodeId, message: &Message) {
        match message {
            Message::Register(r) => {
                if let Some(&i) = self.keys.get(&r.key) {
                    let inc = self.nodes[from].incarnation;
                    self.registers_sent.insert((from, inc, i, r.epoch.0));
                    if self.requests[i].multi.is_some() {
                        self.sub_registers.insert((from, r.key.clone(), r.epoch.0));
                    }
                }
            }
            Message::Cancel(c) if c.reason == kvhandoff_protocol::CancelReason::Deadline => {
                let Some(&i) = self.keys.get(&c.key) else {
                    return;
                };
                let in_flight = self.writes.values().any(|w| {
                    w.read.is_none()
                        && w.target == from
                        && w.request == i
                        && w.epoch == c.epoch.0
                        && w.in_flight()
                });
                if in_flight {
                    self.mark("deadline_during_write");
                }
            }
            _ => {}
        }
    }

    /// Notes a delivery for coverage; returns the request index and the message's key if the
    /// message is a P→D message whose epoch is not the one D holds for its key (it must change
    /// nothing).
    pub(crate) fn note_delivered(&mut self, msg: &NetMsg) -> Option<(usize, PairingKey)> {
        let (key, epoch) = match &msg.message {
            Message::Register(r) => {
                let i = *self.keys.get(&r.key)?;
                self.registers_delivered
                    .insert((msg.from, msg.from_inc, i, r.epoch.0));
                return None;
            }
            Message::Cancel(c) => {
                let i = *self.keys.get(&c.key)?;
                let pair = (msg.from, msg.from_inc, i, c.epoch.0);
                if self.registers_sent.contains(&pair) && !self.registers_delivered.contains(&pair)
                {
                    self.mark("cancel_overtook_registration");
                }
                return None;
            }
            Message::WriteDone(m) => (&m.key, m.epoch.0),
            Message::WritePartDone(m) => (&m.key, m.epoch.0),
            Message::WriteFailed(m) => (&m.key, m.epoch.0),
            Message::CancelAck(m) => (&m.key, m.epoch.0),
            _ => return None,
        };
        let i = *self.keys.get(key)?;
        // The epoch the receiving D holds for the key (a second decode on another D engine
        // holds its own; a sub-request of a multi-rank request, its pair's).
        let live = self.requests[i]
            .d
            .iter()
            .find(|a| {
                a.node == msg.to
                    && matches!(a.status, Status::Live { .. })
                    && a.sub.as_ref().is_none_or(|s| &s.key == key)
            })
            .map(|a| a.epoch);
        if matches!(msg.message, Message::WriteDone(_)) {
            let count = self
                .notifs_delivered
                .entry((msg.to, msg.to_inc, i, epoch, msg.from))
                .or_insert(0);
            *count += 1;
            if *count >= 2 {
                self.mark("duplicate_notification");
            }
            if live != Some(epoch) {
                self.mark("completion_after_lease");
            }
        }
        if live.is_some_and(|e| e != epoch) {
            self.mark("stale_epoch_message");
        }
        (live != Some(epoch)).then(|| (i, key.clone()))
    }
}
