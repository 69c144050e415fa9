//! Multi-rank requests in the engine model: a D rank fed by several P ranks, a P rank feeding
//! several D ranks, or both. Each rank's engine makes one call for the request, with the links
//! of this request's shape (`Session::handle_call_linked`), and the rank's session splits it
//! into one 1:1 sub-request per pair under the pair's key (`PairingKey::for_pair`), decides
//! which siblings to abort, the request's outcome and when the shared blocks go back — the
//! code an engine's connector runs. This file draws the shapes and makes the calls;
//! `multi/settle.rs` judges each pair's end and the request's one event per rank, and
//! `multi/pull.rs` what is particular to pulled ones (the router's answer, replicas, reads).
//! A multi-rank request is pushed or pulled as its transfer draws.

mod early;
mod pull;
mod settle;
mod turn;

pub(crate) use turn::TurnBack;

use std::collections::BTreeMap;
use std::ops::Range;
use std::time::Duration;

use kvhandoff_protocol::hetero::SideName;
use kvhandoff_protocol::machine::{FreeProof, ReadProof, Rejected, SubFailure, Time};
use kvhandoff_protocol::session::{sub_request_id, ConnectorCall, RankLinks};
use kvhandoff_protocol::{BlockIds, PairingKey, RequestId};
use rand::seq::SliceRandom;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

use super::{rid, Attempt, AttemptKind, Status, Sub, BLOCK_TOKENS};
use crate::ledger::{Owner, BLOCK_BYTES};
use crate::world::{micros, Ev, NodeId, World};

/// P ranks of a world that runs multi-rank requests (rank 0 and three more).
pub const MULTI_SOURCE_PREFILL_RANKS: usize = 4;

/// One (P rank → D rank) pair of a multi-rank request.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Pair {
    /// The P rank.
    pub p: NodeId,
    /// The D rank.
    pub d: NodeId,
    /// The pair's key.
    pub key: PairingKey,
    /// The bytes of every D block that this pair's P rank writes: with several P ranks per D
    /// rank each writes its own slice (its heads), so D's blocks are whole only when every
    /// pair landed.
    pub slice: Range<usize>,
}

/// The shape of a multi-rank request and the fan-ins of its ranks.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Multi {
    /// Its pairs, in (P rank, D rank) order.
    pub pairs: Vec<Pair>,
    /// The P rank whose engine aborts the request, if the workload aborts it on P's side.
    pub abort_p: NodeId,
    /// Per rank that started its share: how many of its sub-requests delivered (D `Ready`, P
    /// `Sent`) and how many did not, as the checker reads their endpoint events, and the most
    /// cautious proof of D's (checked against the session's one event for the rank).
    pub tally: BTreeMap<NodeId, Tally>,
    /// Pulled (`multi/pull.rs`): P ranks that take part in the request with no D rank reading
    /// from them (replicas: their export ends at once). P rank 0 is always in a pulled request,
    /// as a source or a replica, since the router forwards its answer.
    pub replicas: Vec<NodeId>,
    /// Pulled: D's try of the request (1, then the router's retries); its engine request id on
    /// D's ranks is `d{request}a{round}` and D's blocks are leased to epoch `round`.
    pub round: u64,
    /// The second turn read back across the pair, if the request has one (`multi/turn.rs`).
    pub turn: TurnBack,
}

/// What one rank's sub-requests of a multi-rank request ended with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub(crate) struct Tally {
    pub delivered: usize,
    pub failed: usize,
    pub proof: Option<FreeProof>,
    /// Pulled: the first part that failed, in the order the session's fan-in saw the parts end
    /// (a part the endpoint refused to start counts first, as `NotStarted`).
    pub first_failure: Option<SubFailure>,
    /// Pulled, a holder rank: the most cautious proof among its parts.
    pub read_proof: Option<ReadProof>,
    /// When the rank's call started its share.
    pub started: Option<Time>,
}

impl Multi {
    /// The slice of D's blocks that `p` writes into `d`'s (everything for a pair not listed).
    pub fn slice(&self, p: NodeId, d: NodeId) -> Range<usize> {
        self.pairs
            .iter()
            .find(|pair| pair.p == p && pair.d == d)
            .map_or(0..BLOCK_BYTES, |pair| pair.slice.clone())
    }

    /// The slice of every block that P rank `p` reads back from D rank `d` in a second turn:
    /// with several D ranks serving `p`, each holds its share of `p`'s heads, so P's blocks
    /// are whole only when every D rank's part landed (everything for a pair not listed).
    pub fn turn_slice(&self, d: NodeId, p: NodeId) -> Range<usize> {
        let holders: Vec<NodeId> = self
            .pairs
            .iter()
            .filter(|pair| pair.p == p)
            .map(|pair| pair.d)
            .collect();
        let n = holders.len();
        match holders.iter().position(|&x| x == d) {
            Some(j) => j * BLOCK_BYTES / n..(j + 1) * BLOCK_BYTES / n,
            None => 0..BLOCK_BYTES,
        }
    }

    /// The P ranks that write into `d`.
    pub fn sources_of(&self, d: NodeId) -> Vec<NodeId> {
        self.pairs
            .iter()
            .filter(|p| p.d == d)
            .map(|p| p.p)
            .collect()
    }
}

/// The engine's id of multi-rank request `request` on `side` (`d` or `p`).
fn parent_id(side: &str, request: usize) -> RequestId {
    rid(side, request, 1)
}

impl World {
    /// The rank number of P's node `p` (node 0 is rank 0; the others follow the D engines).
    fn prefill_rank(&self, p: NodeId) -> u32 {
        if p == 0 {
            0
        } else {
            (p - self.cfg.decode_engines) as u32
        }
    }

    /// The rank number of D's node `d` in a multi-rank request (node 1 is rank 0).
    fn decode_rank(&self, d: NodeId) -> u32 {
        let nodes = self.decode_rank_nodes();
        nodes.iter().position(|&n| n == d).unwrap_or(d - 1) as u32
    }

    /// The D node that serves as the D rank of a multi-rank request drawn for D engine node
    /// `d_node` (itself, unless turns are read back across ranks: then `decode-0`'s rank).
    pub(super) fn multi_decode_node(&self, d_node: NodeId) -> NodeId {
        self.decode_rank_nodes()
            .get(d_node.saturating_sub(1))
            .copied()
            .unwrap_or(d_node)
    }

    /// Whether request `i` is multi-rank, and its pairs: a D rank fed by 2–4 P ranks (most),
    /// one P rank feeding every D rank, or two P ranks each feeding every D rank.
    pub(super) fn draw_multi(
        &self,
        mrng: &mut ChaCha8Rng,
        key: &PairingKey,
        d_node: NodeId,
    ) -> Option<Multi> {
        if self.cfg.explore || self.cfg.multi_source <= 0.0 {
            return None;
        }
        if !mrng.gen_bool(self.cfg.multi_source.min(1.0)) {
            return None;
        }
        let mut p_nodes = self.prefill_nodes();
        let d_nodes = self.decode_rank_nodes();
        p_nodes.shuffle(mrng);
        let (sources, targets) = match mrng.gen_range(0..10) {
            0..=5 => {
                let k = mrng.gen_range(2..=4).min(p_nodes.len());
                (p_nodes[..k].to_vec(), vec![d_node])
            }
            6 | 7 => (p_nodes[..1].to_vec(), d_nodes),
            _ => (p_nodes[..2.min(p_nodes.len())].to_vec(), d_nodes),
        };
        let mut sources = sources;
        sources.sort_unstable();
        let mut pairs = Vec::new();
        let n = sources.len();
        for (j, &p) in sources.iter().enumerate() {
            for &d in &targets {
                pairs.push(Pair {
                    p,
                    d,
                    key: key
                        .for_pair(self.prefill_rank(p), self.decode_rank(d))
                        .expect("the simulator's keys are short"),
                    slice: j * BLOCK_BYTES / n..(j + 1) * BLOCK_BYTES / n,
                });
            }
        }
        let abort_p = sources[mrng.gen_range(0..sources.len())];
        Some(Multi {
            pairs,
            abort_p,
            tally: BTreeMap::new(),
            replicas: Vec::new(),
            round: 1,
            turn: TurnBack::default(),
        })
    }

    /// Lays out request `i`'s sub-requests and schedules each rank's start: D's ranks around
    /// `d_at`, P's ranks (one TP group, finishing together) around `p_at`.
    pub(super) fn setup_multi(
        &mut self,
        mrng: &mut ChaCha8Rng,
        i: usize,
        multi: Multi,
        d_at: Duration,
        p_at: Duration,
    ) {
        let attempt = |id: RequestId, node: NodeId, key: &PairingKey, peer: NodeId| Attempt {
            id,
            node,
            epoch: 1,
            blocks: vec![],
            status: Status::Pending,
            kind: AttemptKind::Push,
            sub: Some(Sub {
                key: key.clone(),
                peer,
                turn: false,
            }),
        };
        let mut d = Vec::new();
        let mut p = Vec::new();
        let turn_key = self.requests[i]
            .transfer
            .second
            .as_ref()
            .map(|s| s.key.clone());
        for pair in &multi.pairs {
            self.keys.insert(pair.key.clone(), i);
            if let Some(key) = &turn_key {
                // The turn's pair, planned the other way: D's rank holds, P's rank reads.
                let key = key
                    .for_pair(self.decode_rank(pair.d), self.prefill_rank(pair.p))
                    .expect("the simulator's keys are short");
                self.keys.insert(key, i);
            }
            let (p_rank, d_rank) = (self.prefill_rank(pair.p), self.decode_rank(pair.d));
            let sub = |side| {
                sub_request_id(&parent_id(side, i), p_rank, d_rank)
                    .expect("the simulator's ids are short")
            };
            d.push(attempt(sub("d"), pair.d, &pair.key, pair.p));
            p.push(attempt(sub("p"), pair.p, &pair.key, pair.d));
            self.fan_parents.insert((pair.d, parent_id("d", i)), i);
            self.fan_parents.insert((pair.p, parent_id("p", i)), i);
        }
        let mut d_nodes: Vec<NodeId> = multi.pairs.iter().map(|pair| pair.d).collect();
        let mut p_nodes: Vec<NodeId> = multi.pairs.iter().map(|pair| pair.p).collect();
        d_nodes.sort_unstable();
        d_nodes.dedup();
        for &replica in &multi.replicas {
            self.fan_parents.insert((replica, parent_id("p", i)), i);
            p_nodes.push(replica);
        }
        p_nodes.sort_unstable();
        p_nodes.dedup();
        let d_node = self.requests[i].d_node;
        let r = &mut self.requests[i];
        r.d = d;
        r.p = p;
        r.multi = Some(Box::new(multi));
        for node in d_nodes {
            let at = if node == d_node {
                d_at
            } else {
                d_at + micros(mrng, 0, 5_000)
            };
            self.schedule(at, Ev::SubDecodeStart { request: i, node });
        }
        for node in p_nodes {
            let at = p_at + micros(mrng, 0, 3_000);
            self.schedule(at, Ev::SubPrefillStart { request: i, node });
        }
    }

    /// D rank `node` allocates the request's blocks once and starts its sub-requests.
    pub(crate) fn sub_decode_start(&mut self, request: usize, node: NodeId) {
        self.start_subs(request, node, true);
    }

    /// P rank `node` finished the prefill: one set of source blocks for all its sub-requests.
    pub(crate) fn sub_prefill_start(&mut self, request: usize, node: NodeId) {
        self.start_subs(request, node, false);
    }

    fn start_subs(&mut self, request: usize, node: NodeId, decode: bool) {
        let again = if decode {
            Ev::SubDecodeStart { request, node }
        } else {
            Ev::SubPrefillStart { request, node }
        };
        let r = &self.requests[request];
        let pull = r.transfer.pull;
        let attempts = if decode { &r.d } else { &r.p };
        let pending: Vec<usize> = attempts
            .iter()
            .enumerate()
            .filter(|(_, a)| a.node == node && a.status == Status::Pending)
            .map(|(ai, _)| ai)
            .collect();
        let epoch = pending
            .first()
            .map(|&ai| attempts[ai].epoch)
            .or_else(|| (!decode && self.replica_pending(request, node)).then_some(1));
        let Some(epoch) = epoch else {
            // Nothing to start (a duplicate start): pass the wake-up on.
            self.wake_waiters(node, 1);
            return;
        };
        if decode && pull && self.pull_answer(request).is_none() {
            // The router has not had P rank 0's answer yet: D's ranks wait for it.
            let later = micros(&mut self.rng, 2_000, 20_000);
            self.schedule(later, again);
            return;
        }
        let r = &self.requests[request];
        let key = r.key.clone();
        let (n, d_blocks) = (if decode { r.d_blocks } else { r.p_blocks }, r.d_blocks);
        let side_name = if decode { "D" } else { "P" };
        self.record(format!(
            "engine: {side_name} rank {node} starts {} sub-request(s) of {key}",
            pending.len()
        ));
        let owner = Owner { request, epoch };
        let Some(blocks) = self.allocate_on(node, n, owner) else {
            self.wait_for_blocks(node, again);
            return;
        };
        if !decode {
            for (index, &b) in blocks.iter().enumerate() {
                self.nodes[node].pool.fill(b, request, 0, index);
            }
        }
        let links = self.links_of(request, node, decode);
        let shared = BlockIds::single_group(blocks.clone());
        let call = if pull {
            self.pull_call(request, node, decode, shared, &links)
        } else if decode {
            let mut params = self.router_params(&key, epoch, 0);
            params.tp_size = Some(links.remote_tp);
            ConnectorCall::RequestAllocated {
                request: parent_id("d", request),
                blocks: shared,
                num_tokens: u64::from(BLOCK_TOKENS) * d_blocks as u64,
                params,
            }
        } else {
            ConnectorCall::RequestFinished {
                request: parent_id("p", request),
                blocks: shared,
                num_tokens: u64::from(BLOCK_TOKENS) * n as u64,
                params: self.router_params(&key, epoch, 1),
            }
        };
        if pull && !decode && self.file_subs_later(request, node, epoch, &call, &links, &blocks) {
            return;
        }
        if pull && decode {
            self.note_sub_reads_started(request, node, &pending);
        }
        let reply = match self.call_linked(node, call, &links) {
            Ok(reply) => reply,
            Err(error) => {
                // Nothing started: the blocks go back and the engine calls again later (a
                // full table), as for a single request.
                self.start_refused(node, error, &blocks, owner, Some(again));
                return;
            }
        };
        if pull && !decode && node == 0 {
            // The router forwards P rank 0's answer to every D rank (as vLLM's proxy does).
            self.keep_answer(&parent_id("p", request), reply);
        }
        self.subs_started(request, node, decode, epoch, &pending, blocks);
    }

    /// Rank `node`'s session took the call for `pending` (its attempts at `request`, attempt or
    /// epoch `epoch`) with `blocks`: the attempts run, save the sub-requests it refused, and
    /// the rank's tally starts.
    fn subs_started(
        &mut self,
        request: usize,
        node: NodeId,
        decode: bool,
        epoch: u64,
        pending: &[usize],
        blocks: Vec<u32>,
    ) {
        let pull = self.requests[request].transfer.pull;
        if pull && decode {
            self.schedule_sibling_decline(request, node, false);
        }
        let refused: Vec<(RequestId, Rejected)> = self.nodes[node]
            .session
            .as_ref()
            .map(|s| s.refused_sub_requests().to_vec())
            .unwrap_or_default();
        for (sub, rejected) in &refused {
            // Some siblings run already: this one never will, and the request fails.
            if matches!(rejected, Rejected::TableFull { .. }) {
                self.mark("multi_source_sub_refused");
                self.mark("admission_refused");
                self.check_flood_admission(node);
            } else {
                self.violate(format!(
                    "sub-request {sub} refused by node {node}: {rejected}"
                ));
            }
        }
        let now = self.now;
        let inc = self.nodes[node].incarnation;
        for &ai in pending {
            let r = &mut self.requests[request];
            let a = if decode { &mut r.d[ai] } else { &mut r.p[ai] };
            if refused.iter().any(|(sub, _)| sub == &a.id) {
                a.status = Status::Skipped;
                continue;
            }
            a.blocks = blocks.clone();
            a.status = Status::Live {
                node_inc: inc,
                started: now,
                fenced: None,
            };
        }
        if pull {
            self.pull_kinds(request, node, decode);
        } else if !decode {
            // A pushing P part holds D's blocks under its lease (L5).
            self.lease_started(node, request, epoch);
        }
        self.last_progress = self.now;
        let multi = self.requests[request].multi.as_mut().expect("multi-rank");
        // Parts the endpoint refused count as failed, and first: the session's fan-in took
        // them so before any part could end.
        let tally = Tally {
            started: Some(now),
            failed: if pull { refused.len() } else { 0 },
            first_failure: refused.first().map(|_| SubFailure::NotStarted),
            ..Tally::default()
        };
        multi.tally.insert(node, tally);
        self.drain(node);
    }

    /// This request's links of rank `node`: the other side's ranks it pairs with.
    pub(super) fn links_of(&self, request: usize, node: NodeId, decode: bool) -> RankLinks {
        let multi = self.requests[request].multi.as_ref().expect("multi-rank");
        let mut peers: Vec<u32> = multi
            .pairs
            .iter()
            .filter(|pair| {
                if decode {
                    pair.d == node
                } else {
                    pair.p == node
                }
            })
            .map(|pair| {
                if decode {
                    self.prefill_rank(pair.p)
                } else {
                    self.decode_rank(pair.d)
                }
            })
            .collect();
        peers.sort_unstable();
        peers.dedup();
        let (side, rank, remote) = if decode {
            let ranks = self.prefill_nodes().len() as u32;
            (SideName::Decode, self.decode_rank(node), ranks)
        } else {
            let ranks = self.decode_rank_nodes().len() as u32;
            (SideName::Prefill, self.prefill_rank(node), ranks)
        };
        RankLinks {
            side,
            rank,
            remote_tp: remote,
            remote_ranks: remote,
            peers,
        }
    }

    /// The engine aborts a multi-rank request: on D's side every rank aborts its share; on
    /// P's side, the one rank the workload chose. The session aborts each live sub-request,
    /// which cancels at its own peer rank; a rank that has not started its share yet has
    /// nothing to abort, as for a single request.
    pub(crate) fn multi_abort(&mut self, request: usize, decode: bool) {
        let r = &self.requests[request];
        let multi = r.multi.as_ref().expect("multi-rank");
        let mut nodes: Vec<NodeId> = if decode {
            multi.pairs.iter().map(|pair| pair.d).collect()
        } else {
            vec![multi.abort_p]
        };
        nodes.sort_unstable();
        nodes.dedup();
        let id = if decode {
            rid("d", request, multi.round)
        } else {
            parent_id("p", request)
        };
        let side = if decode { "D" } else { "P" };
        self.record(format!("engine: {side} aborts {} on {nodes:?}", r.key));
        for node in nodes {
            let started = self.requests[request]
                .multi
                .as_ref()
                .is_some_and(|m| m.tally.contains_key(&node));
            if !self.alive(node) || !started {
                continue;
            }
            // Refused only if the request ended meanwhile, which is fine.
            let _ = self.call(
                node,
                ConnectorCall::Abort {
                    request: id.clone(),
                },
            );
            self.drain(node);
        }
    }

    /// The siblings `node`'s session aborted since last seen, for the coverage marks.
    pub(crate) fn note_siblings_aborted(&mut self, node: NodeId) {
        let Some(session) = self.nodes[node].session.as_ref() else {
            return;
        };
        let now = session.counters().siblings_aborted;
        let seen = std::mem::replace(&mut self.nodes[node].siblings_aborted, now);
        for _ in seen..now {
            self.mark("multi_source_sibling_aborted");
        }
    }
}

/// What a reader's fan-in must tell the engine when a part failed: the first failed part's
/// failure by the engine's policy, with no token kept (no part is a prefix of the request).
fn reader_fan_outcome(
    first: kvhandoff_protocol::machine::SubFailure,
    policy: kvhandoff_protocol::machine::LoadFailurePolicy,
) -> kvhandoff_protocol::machine::ImportOutcome {
    use kvhandoff_protocol::machine::{
        ImportFailure, ImportOutcome, LoadFailurePolicy, SubFailure,
    };
    let failure = match first {
        SubFailure::Import(failure) => failure,
        _ => ImportFailure::Aborted,
    };
    match policy {
        LoadFailurePolicy::Fail => ImportOutcome::Failed(failure),
        LoadFailurePolicy::Recompute => ImportOutcome::Recompute {
            valid_tokens: 0,
            failure,
        },
    }
}
