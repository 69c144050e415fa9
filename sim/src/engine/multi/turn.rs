//! A multi-rank request's second turn, read back across the heterogeneous pair (issue 23,
//! item 4). Each D rank whose share of the first turn ended with the KV in its blocks keeps
//! them for the next turn (`keep_for_next_turn` with its turn links: the pair planned the
//! other way, this rank the holder for every P rank it served), the router forwards the answer
//! of the request's first D rank to every P rank that holds heads, and each P rank calls
//! `next_turn_allocated` with its turn links: it reads its slices back from every D rank that
//! holds them, under each holder's grant fence. The session splits both calls into one export
//! or import per pair (`FanSide::Holder` on D, `Reader` on P) and folds their ends into each
//! rank's one event; this file makes the calls as an engine's connector gets them, and
//! `turn/judge.rs` judges every part's end and each rank's one event against the ledger.

use std::collections::BTreeMap;

use kvhandoff_protocol::hetero::SideName;
use kvhandoff_protocol::machine::{export_hard_end, ImportOutcome, Rejected, SubFailure};
use kvhandoff_protocol::session::{
    sub_request_id, ConnectorCall, ConnectorError, ConnectorEvent, ConnectorReply,
    KvTransferParams, RankLinks,
};
use kvhandoff_protocol::{BlockIds, RequestId};

use super::super::{rid, Attempt, AttemptKind, Status, Sub, BLOCK_TOKENS};
use super::Tally;
use crate::ledger::Owner;
use crate::world::{micros, Ev, NodeId, World};

mod early;
mod judge;

/// The ledger's owner epoch of a P rank's blocks for the read back (its first turn's are 1),
/// as for a single request's second turn.
const TURN_EPOCH: u64 = 100;

/// What the checker follows of a multi-rank request's second turn.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub(crate) struct TurnBack {
    /// D ranks that kept their blocks, and the owner those stay leased to (their first turn's).
    pub kept: BTreeMap<NodeId, Owner>,
    /// Per rank that started its share of the turn: its parts' ends, as for the first turn.
    pub tally: BTreeMap<NodeId, Tally>,
}

/// D's engine request for the kept turn.
fn keep_id(request: usize) -> RequestId {
    rid("x", request, 1)
}

/// P's engine request for the read back.
fn read_id(request: usize) -> RequestId {
    rid("t", request, 1)
}

impl World {
    /// Whether `id` is the engine request of `request`'s second turn on either side.
    pub(in crate::engine) fn is_turn_parent(&self, request: usize, id: &RequestId) -> bool {
        self.requests[request].transfer.second.is_some()
            && (*id == keep_id(request) || *id == read_id(request))
    }

    /// `node`'s turn links for `request`: a D rank holds for the P ranks it served, a P rank
    /// reads from the D ranks that served it (the first turn's pairs, planned the other way).
    fn turn_links(&self, request: usize, node: NodeId, decode: bool) -> RankLinks {
        // The first turn's links, the sides swapped: D's ranks hold, P's read.
        let mut links = self.links_of(request, node, decode);
        links.side = match links.side {
            SideName::Prefill => SideName::Decode,
            SideName::Decode => SideName::Prefill,
        };
        links
    }

    /// A turn call on `node`'s session with this request's turn links. An engine of one
    /// geometry sets its turn links once; the simulator draws a shape per request, so it sets
    /// the request's before each turn call (the session reads them when the call comes), and
    /// passes the request's forward links with the call, as for its first turn.
    fn turn_call(
        &mut self,
        node: NodeId,
        call: ConnectorCall,
        turn: &RankLinks,
        forward: &RankLinks,
    ) -> Result<ConnectorReply, ConnectorError> {
        let now = self.now;
        let Some(session) = self.nodes[node].session.as_mut() else {
            return Err(ConnectorError::Unavailable);
        };
        session.set_turn_links(turn.clone())?;
        session.handle_call_linked(now, call, forward)
    }

    /// D rank `node`'s share of `request` ended with the KV in `flat` (leased to `owner`): if
    /// the request has a second turn, its engine keeps the blocks for the P ranks it served
    /// (true) instead of freeing them. The request's first D rank's answer goes to the router,
    /// which hands it to every P rank that holds heads after the turn's delay.
    pub(in crate::engine) fn keep_turn(
        &mut self,
        node: NodeId,
        request: usize,
        flat: &[u32],
        owner: Owner,
        event: &ConnectorEvent,
    ) -> bool {
        let r = &self.requests[request];
        let Some(second) = r.transfer.second.clone() else {
            return false;
        };
        let landed = matches!(
            event,
            ConnectorEvent::BlocksReady { .. }
                | ConnectorEvent::Imported {
                    outcome: ImportOutcome::Loaded,
                    ..
                }
        );
        let Some(multi) = r.multi.as_ref() else {
            return false;
        };
        if !landed || flat.is_empty() || self.is_prefill(node) || !self.alive(node) {
            return false;
        }
        if multi.turn.kept.contains_key(&node) {
            return false;
        }
        let first_d = self.first_keeper(request);
        let mut readers: Vec<NodeId> = multi.pairs.iter().map(|pair| pair.p).collect();
        readers.sort_unstable();
        readers.dedup();
        let parent = keep_id(request);
        let call = ConnectorCall::KeepForNextTurn {
            request: parent.clone(),
            blocks: BlockIds::single_group(flat.to_vec()),
            num_tokens: u64::from(BLOCK_TOKENS) * flat.len() as u64,
            ttl: second.ttl,
            params: KvTransferParams {
                transfer_id: Some(second.key.as_str().to_owned()),
                ..KvTransferParams::default()
            },
        };
        let links = self.turn_links(request, node, true);
        let forward = self.links_of(request, node, true);
        let ahead = self.keep_turn_ahead(request, node, &call, &links, &forward, flat, owner);
        let filed_now = ahead.is_none();
        let reply = match ahead {
            Some(reply) => reply,
            None => match self.turn_call(node, call, &links, &forward) {
                Ok(reply) => reply,
                Err(ConnectorError::Rejected(Rejected::TableFull { .. })) => {
                    self.mark("admission_refused");
                    self.check_flood_admission(node);
                    return false;
                }
                Err(error) => {
                    self.violate(format!(
                        "a kept turn of request {request} refused by D rank {node}: {error}"
                    ));
                    return false;
                }
            },
        };
        let key = self.requests[request].key.clone();
        self.record(format!(
            "engine: D rank {node} keeps {key} for a read back as {parent}"
        ));
        if first_d == Some(node) {
            self.keep_answer(&parent, reply);
            for p in readers {
                let at = second.delay + micros(&mut self.rng, 0, 3_000);
                self.schedule(at, Ev::TurnBack { request, node: p });
            }
        }
        if filed_now {
            let hard_end = export_hard_end(self.now, second.ttl, &self.cfg.machine);
            let kind = AttemptKind::Export {
                hard_end,
                renewed: false,
            };
            self.turn_parts_started(request, node, &parent, flat, owner.epoch, kind);
        }
        if let Some(multi) = self.requests[request].multi.as_mut() {
            multi.turn.kept.insert(node, owner);
        }
        true
    }

    /// P rank `node`'s engine starts its share of `request`'s second turn with D's answer: it
    /// reads its slices back from every D rank that served it, or, when the turn declines,
    /// recomputes and declines D's export at every D rank it is linked to (`decline_export`
    /// with turn links), so D's parts end at once instead of at their TTL.
    pub(crate) fn turn_back(&mut self, request: usize, node: NodeId) {
        let r = &self.requests[request];
        let Some(second) = r.transfer.second.clone() else {
            return;
        };
        let (policy, d_blocks) = (r.transfer.policy, r.d_blocks);
        let started = r
            .multi
            .as_ref()
            .is_some_and(|m| m.turn.tally.contains_key(&node));
        if started || !self.alive(node) {
            return;
        }
        let Some(answer) = self.answers.get(&keep_id(request)).cloned() else {
            return;
        };
        let key = self.requests[request].key.clone();
        let m = second.blocks.min(d_blocks);
        if second.decline || m == 0 {
            self.record(format!(
                "engine: P rank {node} recomputes the turn of {key}"
            ));
            *self
                .outcomes
                .entry("multi.turn2.recomputed".to_string())
                .or_insert(0) += 1;
            if second.decline {
                self.decline_turn(request, node, answer);
            }
            return;
        }
        let owner = Owner {
            request,
            epoch: TURN_EPOCH,
        };
        let Some(blocks) = self.allocate_on(node, m, owner) else {
            self.wait_for_blocks(node, Ev::TurnBack { request, node });
            return;
        };
        let links = self.turn_links(request, node, false);
        let mut params = answer;
        // D's ranks answer as TP 1 engines (they serve single-rank requests too); a D engine
        // of this request's geometry has as many ranks as the links say.
        params.tp_size = Some(links.remote_tp);
        if !second.gate {
            params.remote_blocks_expiry_time = None;
        }
        self.set_policy(node, policy);
        let parent = read_id(request);
        self.record(format!(
            "engine: P rank {node} reads {key} back from D ranks {:?} as {parent}",
            links.peers
        ));
        let call = ConnectorCall::NextTurnAllocated {
            request: parent.clone(),
            blocks: BlockIds::single_group(blocks.clone()),
            num_tokens: u64::from(BLOCK_TOKENS) * d_blocks as u64,
            params,
        };
        let forward = self.links_of(request, node, false);
        self.note_turn_part_reads_started(request, node);
        if let Err(error) = self.turn_call(node, call, &links, &forward) {
            // A full table: the engine recomputes the turn instead.
            self.start_refused(node, error, &blocks, owner, None);
            return;
        }
        let kind = AttemptKind::Import { read_epoch: 1 };
        self.turn_parts_started(request, node, &parent, &blocks, TURN_EPOCH, kind);
        self.last_progress = self.now;
        self.drain(node);
    }

    /// P rank `node` declines `request`'s kept turn (D's `answer`) at every D rank it is linked
    /// to. Nothing starts here and no event follows; a refusal (the session's, typed) leaves
    /// D's parts to their TTL.
    fn decline_turn(&mut self, request: usize, node: NodeId, mut answer: KvTransferParams) {
        let links = self.turn_links(request, node, false);
        answer.tp_size = Some(links.remote_tp);
        let call = ConnectorCall::DeclineExport {
            request: read_id(request),
            params: answer,
        };
        let forward = self.links_of(request, node, false);
        let label = match self.turn_call(node, call, &links, &forward) {
            Ok(_) => "multi.turn2.declined".to_string(),
            Err(error) => format!("multi.turn2.decline_refused.{error}"),
        };
        self.record(format!(
            "engine: P rank {node} declines the turn of request {request} at D ranks {:?}: {label}",
            links.peers
        ));
        *self.outcomes.entry(label).or_insert(0) += 1;
        self.drain(node);
    }

    /// The parts `node`'s session started for `parent` (one per pair of the rank, each its
    /// pair's export or import of the turn); those the endpoint refused count as failed first.
    fn turn_parts_started(
        &mut self,
        request: usize,
        node: NodeId,
        parent: &RequestId,
        blocks: &[u32],
        epoch: u64,
        kind: AttemptKind,
    ) {
        let refused: Vec<(RequestId, Rejected)> = self.nodes[node]
            .session
            .as_ref()
            .map(|s| s.refused_sub_requests().to_vec())
            .unwrap_or_default();
        for (sub, rejected) in &refused {
            if matches!(rejected, Rejected::TableFull { .. }) {
                self.mark("admission_refused");
            } else {
                self.violate(format!(
                    "part {sub} of a read back refused by node {node}: {rejected}"
                ));
            }
        }
        let decode = !self.is_prefill(node);
        let (now, inc) = (self.now, self.nodes[node].incarnation);
        let r = &self.requests[request];
        let (Some(second), Some(multi)) = (r.transfer.second.as_ref(), r.multi.as_ref()) else {
            return;
        };
        let mut parts = Vec::new();
        for pair in &multi.pairs {
            if (decode && pair.d != node) || (!decode && pair.p != node) {
                continue;
            }
            let (d_rank, p_rank) = (self.decode_rank(pair.d), self.prefill_rank(pair.p));
            let id = sub_request_id(parent, d_rank, p_rank).expect("the simulator's ids are short");
            let key = second
                .key
                .for_pair(d_rank, p_rank)
                .expect("the simulator's keys are short");
            let status = if refused.iter().any(|(sub, _)| *sub == id) {
                Status::Skipped
            } else {
                Status::Live {
                    node_inc: inc,
                    started: now,
                    fenced: None,
                }
            };
            parts.push(Attempt {
                id,
                node,
                epoch,
                blocks: blocks.to_vec(),
                status,
                kind: kind.clone(),
                sub: Some(Sub {
                    key,
                    peer: if decode { pair.p } else { pair.d },
                    turn: true,
                }),
            });
        }
        let r = &mut self.requests[request];
        if decode {
            r.d.extend(parts);
        } else {
            r.p.extend(parts);
        }
        let tally = Tally {
            started: Some(now),
            failed: refused.len(),
            first_failure: refused.first().map(|_| SubFailure::NotStarted),
            ..Tally::default()
        };
        if let Some(multi) = r.multi.as_mut() {
            multi.turn.tally.insert(node, tally);
        }
        self.fan_parents.insert((node, parent.clone()), request);
    }
}
