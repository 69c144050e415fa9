//! Multi-rank requests in the engine model: a D rank fed by several P ranks, a P rank feeding
//! several D ranks, or both. Each (P rank → D rank) pair is an ordinary 1:1 sub-request under
//! its pair's key (`PairingKey::for_pair`), run by the real machines; each rank allocates its
//! blocks once and shares them between its sub-requests, with the protocol crate's `FanIn`
//! deciding which siblings to abort, the request's outcome and when the shared blocks go back.
//! This file draws the shapes and starts and aborts the sub-requests; `multi/settle.rs` takes
//! their ends and judges the shared hand-backs.

mod settle;

use std::collections::BTreeMap;
use std::ops::Range;
use std::time::Duration;

use kvhandoff_protocol::machine::{
    DecodeStart, EngineCall, FanIn, FanInStep, FanSide, PrefillStart, Rejected, SubRequest,
};
use kvhandoff_protocol::{BlockIds, Epoch, PairingKey, RequestId};
use rand::seq::SliceRandom;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

use super::{Attempt, AttemptKind, Status, Sub};
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
    /// The fan-in of each rank that started its sub-requests, until the last of them ended.
    pub fans: BTreeMap<NodeId, FanIn>,
    /// D ranks: how many of the rank's sub-requests ended `Ready` and how many failed, as the
    /// ledger reads their events (checked against the fan-in's outcome).
    pub tally: BTreeMap<NodeId, (usize, usize)>,
}

impl Multi {
    /// The slice of D's blocks that `p` writes into `d`'s (everything for a pair not listed).
    pub fn slice(&self, p: NodeId, d: NodeId) -> Range<usize> {
        self.pairs
            .iter()
            .find(|pair| pair.p == p && pair.d == d)
            .map_or(0..BLOCK_BYTES, |pair| pair.slice.clone())
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

/// The engine's id of the sub-request of `request` for pair (`p` → `d`) on `side` (`d` or `p`).
fn sub_id(side: &str, request: usize, p: NodeId, d: NodeId) -> RequestId {
    RequestId::new(format!("{side}{request}a1-p{p}d{d}")).expect("valid request id")
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
        let d_nodes: Vec<NodeId> = (1..=self.cfg.decode_engines).collect();
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
                        .for_pair(self.prefill_rank(p), (d - 1) as u32)
                        .expect("the simulator's keys are short"),
                    slice: j * BLOCK_BYTES / n..(j + 1) * BLOCK_BYTES / n,
                });
            }
        }
        let abort_p = sources[mrng.gen_range(0..sources.len())];
        Some(Multi {
            pairs,
            abort_p,
            fans: BTreeMap::new(),
            tally: BTreeMap::new(),
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
            }),
        };
        let mut d = Vec::new();
        let mut p = Vec::new();
        for pair in &multi.pairs {
            self.keys.insert(pair.key.clone(), i);
            d.push(attempt(
                sub_id("d", i, pair.p, pair.d),
                pair.d,
                &pair.key,
                pair.p,
            ));
            p.push(attempt(
                sub_id("p", i, pair.p, pair.d),
                pair.p,
                &pair.key,
                pair.d,
            ));
        }
        let mut d_nodes: Vec<NodeId> = multi.pairs.iter().map(|pair| pair.d).collect();
        let mut p_nodes: Vec<NodeId> = multi.pairs.iter().map(|pair| pair.p).collect();
        d_nodes.sort_unstable();
        d_nodes.dedup();
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
        self.start_subs(request, node, FanSide::Decode);
    }

    /// P rank `node` finished the prefill: one set of source blocks for all its sub-requests.
    pub(crate) fn sub_prefill_start(&mut self, request: usize, node: NodeId) {
        self.start_subs(request, node, FanSide::Prefill);
    }

    fn start_subs(&mut self, request: usize, node: NodeId, side: FanSide) {
        let decode = side == FanSide::Decode;
        let again = if decode {
            Ev::SubDecodeStart { request, node }
        } else {
            Ev::SubPrefillStart { request, node }
        };
        let r = &self.requests[request];
        let attempts = if decode { &r.d } else { &r.p };
        let subs: Vec<(usize, RequestId, Sub)> = attempts
            .iter()
            .enumerate()
            .filter(|(_, a)| a.node == node && a.status == Status::Pending)
            .map(|(ai, a)| (ai, a.id.clone(), a.sub.clone().expect("a sub-request")))
            .collect();
        let Some(epoch) = subs.first().map(|&(ai, ..)| attempts[ai].epoch) else {
            // Nothing to start (a duplicate start): pass the wake-up on.
            self.wake_waiters(node, 1);
            return;
        };
        let key = r.key.clone();
        let (n, d_blocks) = (if decode { r.d_blocks } else { r.p_blocks }, r.d_blocks);
        let side_name = if decode { "D" } else { "P" };
        self.record(format!(
            "engine: {side_name} rank {node} starts {} sub-request(s) of {key}",
            subs.len()
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
        let shared = BlockIds::single_group(blocks.clone());
        let sub_requests = subs.iter().map(|(_, id, sub)| SubRequest {
            request: id.clone(),
            key: sub.key.clone(),
        });
        let mut fan =
            FanIn::new(side, shared.clone(), sub_requests).expect("distinct sub-requests");
        fan.set_mutation(self.cfg.mutation);
        let mut steps: Vec<FanInStep> = Vec::new();
        let mut admitted = 0;
        for (ai, id, sub) in subs {
            let call = if decode {
                EngineCall::DecodeAllocated(DecodeStart {
                    request: id.clone(),
                    key: sub.key,
                    epoch: Epoch(epoch),
                    prefill: self.nodes[sub.peer].addr.clone(),
                    blocks: shared.clone(),
                    num_tokens: 16 * d_blocks as u64,
                    expected_writes: 1,
                })
            } else {
                EngineCall::PrefillFinished(PrefillStart {
                    request: id.clone(),
                    key: sub.key,
                    blocks: shared.clone(),
                })
            };
            let now = self.now;
            let endpoint = self.nodes[node]
                .endpoint
                .as_mut()
                .expect("allocated: alive");
            match endpoint.handle_call(now, call) {
                Ok(()) => {
                    admitted += 1;
                    let inc = self.nodes[node].incarnation;
                    let r = &mut self.requests[request];
                    let a = if decode { &mut r.d[ai] } else { &mut r.p[ai] };
                    a.blocks = blocks.clone();
                    a.status = Status::Live {
                        node_inc: inc,
                        started: now,
                        fenced: None,
                    };
                }
                Err(Rejected::TableFull { .. }) if admitted == 0 => {
                    // Nothing started yet: give the blocks back and call again a little later,
                    // as for a single request.
                    self.mark("admission_refused");
                    self.check_flood_admission(node);
                    for error in self.nodes[node].pool.free(&blocks, owner) {
                        self.violate(error);
                    }
                    self.wake_waiters(node, blocks.len());
                    let later = micros(&mut self.rng, 200_000, 1_000_000);
                    self.schedule(later, again);
                    return;
                }
                Err(rejected) => {
                    // Some siblings run already: this one never will, and the request fails.
                    if matches!(rejected, Rejected::TableFull { .. }) {
                        self.mark("admission_refused");
                        self.check_flood_admission(node);
                    } else {
                        self.violate(format!("engine input refused by node {node}: {rejected}"));
                    }
                    let r = &mut self.requests[request];
                    let a = if decode { &mut r.d[ai] } else { &mut r.p[ai] };
                    a.status = Status::Skipped;
                    match fan.not_started(&id) {
                        Ok(step) => steps.push(step),
                        Err(error) => self.violate(format!("fan-in: {error}")),
                    }
                }
            }
        }
        self.last_progress = self.now;
        let multi = self.requests[request].multi.as_mut().expect("multi-rank");
        multi.fans.insert(node, fan);
        if decode {
            multi.tally.insert(node, (0, 0));
        }
        for step in steps {
            self.after_fan_step(node, request, step);
        }
        self.drain(node);
    }

    /// The engine aborts a multi-rank request: on D's side every rank aborts all its
    /// sub-requests; on P's side, the one rank the workload chose. Each aborted sub-request
    /// cancels at its own peer rank; a rank that has not started its share yet has nothing to
    /// abort, as for a single request.
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
        let side = if decode { "D" } else { "P" };
        self.record(format!("engine: {side} aborts {} on {nodes:?}", r.key));
        for node in nodes {
            if !self.alive(node) {
                continue;
            }
            let multi = self.requests[request].multi.as_mut().expect("multi-rank");
            let Some(fan) = multi.fans.get_mut(&node) else {
                continue;
            };
            let ids = fan.abort_all();
            self.abort_subs(node, ids);
            self.drain(node);
        }
    }

    /// Aborts the sub-requests `ids` on `node` (outputs not drained). A refusal means the
    /// sub-request just ended, which is fine.
    fn abort_subs(&mut self, node: NodeId, ids: Vec<RequestId>) -> usize {
        let now = self.now;
        let Some(endpoint) = self.nodes[node].endpoint.as_mut() else {
            return 0;
        };
        ids.into_iter()
            .filter(|id| {
                endpoint
                    .handle_call(
                        now,
                        EngineCall::Abort {
                            request: id.clone(),
                        },
                    )
                    .is_ok()
            })
            .count()
    }
}
