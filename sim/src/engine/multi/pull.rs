//! Multi-rank pulls (issue 23): a heterogeneous pair's read path, driven through the session
//! as an engine drives its connector. Every P rank of the request calls `request_finished` in
//! pull mode with its links (the D ranks that read from it; none for a replica), the router
//! forwards P rank 0's answer to every D rank as vLLM's proxy does, and each D rank calls
//! `request_allocated` in pull mode with its links (the P ranks it reads from). The session
//! starts one import or export per pair under the pair's key and folds their ends into the
//! rank's one `Imported` or `ExportEnded` (`FanSide::Reader`/`Holder`); this file judges each
//! part's end and that one event, and plays the router's retry.

use kvhandoff_protocol::machine::{
    export_hard_end, EndpointEvent, ExportEnd, ExportOutcome, ImportFailure, ImportOutcome,
    Rejected, SubFailure,
};
use kvhandoff_protocol::session::{
    sub_request_id, ConnectorCall, ConnectorError, ConnectorEvent, RankLinks,
};
use kvhandoff_protocol::{BlockIds, RequestId};
use rand::seq::SliceRandom;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

use super::super::events::frozen_note;
use super::super::{rid, Attempt, AttemptKind, Status, Sub, BLOCK_TOKENS};
use super::{parent_id, Multi};
use crate::ledger::{pattern, Owner, BLOCK_BYTES};
use crate::world::{micros, Ev, NodeId, World};

/// Most tries of a multi-rank pull on D's side (the first and the router's retries).
const MAX_ROUNDS: u64 = 3;

impl World {
    /// The P ranks of pulled request `multi` that no D rank reads from: P rank 0 when it is no
    /// source (the router needs its answer, so it always takes part), and now and then one
    /// more rank (a replica under GQA replication).
    pub(in crate::engine) fn draw_replicas(&self, mrng: &mut ChaCha8Rng, multi: &mut Multi) {
        let sources: Vec<NodeId> = multi.pairs.iter().map(|pair| pair.p).collect();
        let mut others: Vec<NodeId> = self
            .prefill_nodes()
            .into_iter()
            .filter(|p| !sources.contains(p))
            .collect();
        if others.contains(&0) {
            multi.replicas.push(0);
            others.retain(|&p| p != 0);
        }
        if !others.is_empty() && mrng.gen_bool(0.3) {
            let extra = *others.choose(mrng).expect("not empty");
            multi.replicas.push(extra);
        }
        multi.replicas.sort_unstable();
    }

    /// Whether `node` is a replica of pulled request `request` that has not started its share.
    pub(super) fn replica_pending(&self, request: usize, node: NodeId) -> bool {
        self.requests[request]
            .multi
            .as_ref()
            .is_some_and(|m| m.replicas.contains(&node) && !m.tally.contains_key(&node))
            && !self.early.sub_filings.contains_key(&(request, node))
    }

    /// P rank 0's answer to pulled request `request`, once its engine called.
    pub(super) fn pull_answer(
        &self,
        request: usize,
    ) -> Option<&kvhandoff_protocol::session::KvTransferParams> {
        self.answers.get(&parent_id("p", request))
    }

    /// The engine's call on rank `node` for its share of pulled request `request` over
    /// `blocks`: P exports (the router's parameters in pull mode), D reads (P rank 0's answer,
    /// which the caller checked is there).
    pub(super) fn pull_call(
        &mut self,
        request: usize,
        node: NodeId,
        decode: bool,
        blocks: BlockIds,
        links: &RankLinks,
    ) -> ConnectorCall {
        let r = &self.requests[request];
        let (key, p_blocks, transfer) = (r.key.clone(), r.p_blocks, r.transfer.clone());
        let num_tokens = u64::from(BLOCK_TOKENS) * p_blocks as u64;
        if !decode {
            let mut params = self.router_params(&key, 1, 1);
            params.do_remote_prefill = false;
            params.do_remote_decode = true;
            params.transfer_mode = Some("pull".into());
            return ConnectorCall::RequestFinished {
                request: parent_id("p", request),
                blocks,
                num_tokens,
                params,
            };
        }
        // The router hands every try the very answer P gave (its epoch 1 included: a router
        // knows nothing of epochs; each pair's reader lifts it past the try before).
        let mut params = self.pull_answer(request).cloned().unwrap_or_default();
        // The world's P ranks answer as TP 1 engines (they serve single-rank requests too); a
        // P engine of this request's geometry has as many ranks as the links say.
        params.tp_size = Some(links.remote_tp);
        if !transfer.gate {
            params.remote_blocks_expiry_time = None;
        }
        self.set_policy(node, transfer.policy);
        let round = self.requests[request].multi.as_ref().map_or(1, |m| m.round);
        ConnectorCall::RequestAllocated {
            request: rid("d", request, round),
            blocks,
            num_tokens,
            params,
        }
    }

    /// A sibling of D rank `node`'s multi-rank read of `request` declines the export with the
    /// very answer the router handed the read: while any part of the read is live the session
    /// must refuse the whole decline; once the read ended the declines go out and change nothing.
    pub(in crate::engine) fn multi_sibling_decline(&mut self, request: usize, node: NodeId) {
        let Some(mut params) = self.pull_answer(request).cloned() else {
            return;
        };
        if self.nodes[node].session.is_none() {
            return;
        }
        let links = self.links_of(request, node, true);
        params.tp_size = Some(links.remote_tp);
        if !self.requests[request].transfer.gate {
            params.remote_blocks_expiry_time = None;
        }
        let round = self.requests[request].multi.as_ref().map_or(1, |m| m.round);
        let key = self.requests[request].key.clone();
        self.record(format!(
            "engine: a sibling on D rank {node} declines {key} at P ranks {:?}",
            links.peers
        ));
        let decline = ConnectorCall::DeclineExport {
            request: rid("s", request, round),
            params,
        };
        match self.call_linked(node, decline, &links) {
            Ok(_) => self.mark("hetero_sibling_decline_sent"),
            Err(ConnectorError::Rejected(Rejected::ImportInProgress(_))) => {
                self.mark("hetero_decline_refused_while_reading")
            }
            Err(error) => self.violate(format!("multi-rank sibling decline refused: {error}")),
        }
        self.drain(node);
    }

    /// The parts `node` just started are imports (D) or exports (P, until their hard end).
    pub(super) fn pull_kinds(&mut self, request: usize, node: NodeId, decode: bool) {
        let hard_end =
            export_hard_end(self.now, self.cfg.machine.lease_duration, &self.cfg.machine);
        let r = &mut self.requests[request];
        let attempts = if decode { &mut r.d } else { &mut r.p };
        for a in attempts.iter_mut().filter(|a| a.node == node) {
            if matches!(a.status, Status::Live { .. }) && a.kind == AttemptKind::Push {
                a.kind = if decode {
                    AttemptKind::Import { read_epoch: 1 }
                } else {
                    AttemptKind::Export {
                        hard_end,
                        renewed: false,
                    }
                };
            }
        }
    }

    /// A part's end (an import on D, an export on P), judged as a single read's or export's
    /// is against its own pair: no read of it may still land in D's blocks, a `Loaded` part's
    /// slice of every block holds its P rank's bytes from a read that landed, and an export
    /// ends by its hard end. Returns (D's side, the outcome's label).
    pub(super) fn read_part_event(
        &mut self,
        node: NodeId,
        request: usize,
        ai: usize,
        event: &EndpointEvent,
    ) -> (bool, String) {
        let (decode, failure, label) = match event {
            EndpointEvent::Import { epoch, outcome, .. } => {
                let a = self.requests[request].d[ai].clone();
                let holder = a.sub.as_ref().map_or(0, |s| s.peer);
                let (in_flight, frozen) = self.part_reads_into(node, request, epoch.0, holder);
                if in_flight > 0 {
                    self.violate(format!(
                        "proof: part {} handed its blocks back while {in_flight} read(s) of it \
                         may still land{}",
                        a.id,
                        frozen_note(frozen)
                    ));
                }
                self.requests[request].d[ai].kind = AttemptKind::Import {
                    read_epoch: epoch.0,
                };
                let failure = match outcome {
                    ImportOutcome::Loaded => {
                        self.check_pair_ready(node, request, epoch.0, &a.blocks, holder);
                        None
                    }
                    ImportOutcome::Recompute {
                        valid_tokens,
                        failure,
                    } => {
                        let valid = (*valid_tokens / u64::from(BLOCK_TOKENS)) as usize;
                        let valid = valid.min(a.blocks.len());
                        if valid > 0 {
                            self.check_pair_ready(
                                node,
                                request,
                                epoch.0,
                                &a.blocks[..valid],
                                holder,
                            );
                        }
                        Some(SubFailure::Import(*failure))
                    }
                    ImportOutcome::Failed(failure) => Some(SubFailure::Import(*failure)),
                };
                if let (Some(sub), Some(SubFailure::Import(f))) = (a.sub.as_ref(), failure) {
                    self.check_gave_up_early(node, &sub.key, epoch.0, Some(f));
                }
                (true, failure, format!("sub.import.{outcome:?}"))
            }
            EndpointEvent::Export { outcome, proof, .. } => {
                let a = self.requests[request].p[ai].clone();
                self.check_hard_end(node, &a);
                *self
                    .outcomes
                    .entry(format!("read_proof.{proof:?}"))
                    .or_insert(0) += 1;
                let multi = self.requests[request].multi.as_mut().expect("multi-rank");
                let tally = multi.tally.entry(node).or_default();
                tally.read_proof = Some(tally.read_proof.map_or(*proof, |p| p.max(*proof)));
                // Read, or not needed by its reader: a success (the fan-in's rule, stated
                // again here).
                let failure = match outcome {
                    ExportOutcome::Read
                    | ExportOutcome::Released(ExportEnd::FullPrefixHit | ExportEnd::Empty) => None,
                    ExportOutcome::Released(end) => Some(SubFailure::Export(*end)),
                };
                (false, failure, format!("sub.export.{outcome:?}"))
            }
            EndpointEvent::Decode { .. }
            | EndpointEvent::DecodeFenced { .. }
            | EndpointEvent::Prefill { .. } => {
                unreachable!("push parts are judged in settle.rs")
            }
        };
        let multi = self.requests[request].multi.as_mut().expect("multi-rank");
        let tally = multi.tally.entry(node).or_default();
        let first = tally.first_failure;
        match failure {
            None => tally.delivered += 1,
            Some(failure) => {
                tally.failed += 1;
                tally.first_failure.get_or_insert(failure);
            }
        }
        // A part aborted after a sibling failed otherwise (an engine's abort would have come
        // first, and failed the request as `Aborted` itself): the fan-in aborted it.
        let aborted = matches!(
            failure,
            Some(
                SubFailure::Import(ImportFailure::Aborted) | SubFailure::Export(ExportEnd::Aborted)
            )
        );
        let sibling_failed = first.is_some_and(|f| {
            !matches!(
                f,
                SubFailure::Import(ImportFailure::Aborted)
                    | SubFailure::Export(ExportEnd::Aborted)
                    | SubFailure::NotStarted
            )
        });
        if aborted && sibling_failed {
            self.mark("hetero_read_sibling_aborted");
        }
        (decode, label)
    }

    /// Reads of `node` for (`request`, wire `epoch`) from `holder` still in flight into its
    /// blocks, and how many of them a stall froze.
    pub(super) fn part_reads_into(
        &self,
        node: NodeId,
        request: usize,
        epoch: u64,
        holder: NodeId,
    ) -> (usize, usize) {
        let inc = self.nodes[node].incarnation;
        let reads: Vec<bool> = self
            .writes
            .values()
            .filter(|w| w.read.is_some() && w.poster == node && w.poster_inc == inc)
            .filter(|w| w.request == request && w.epoch == epoch && w.target == holder)
            .filter(|w| w.in_flight())
            .map(|w| w.frozen)
            .collect();
        (reads.len(), reads.iter().filter(|&&f| f).count())
    }

    /// Reads that may still touch `node`'s shared blocks of `request` (D: still landing in
    /// the try leased to `owner`; P: still pinning its sources). A frozen read no longer pins
    /// the holder's blocks (its reader distrusts what it copies), as for a single export.
    pub(super) fn reads_touching(&self, node: NodeId, request: usize, owner: Owner) -> usize {
        let inc = self.nodes[node].incarnation;
        let decode = !self.is_prefill(node);
        self.writes
            .values()
            .filter(|w| w.request == request && w.in_flight())
            .filter(|w| {
                if decode {
                    w.read == Some(owner) && w.poster == node && w.poster_inc == inc
                } else {
                    w.read.is_some() && w.target == node && w.target_inc == inc && w.d_pinned
                }
            })
            .count()
    }

    /// The session's one event for pulled request `request` on rank `node` (its shared blocks
    /// handed back, `sound` if every part had ended with no read still touching them): D is
    /// `Loaded` exactly when every part loaded, and its blocks then hold every P rank's slice
    /// from reads that landed; otherwise the outcome keeps no token (`Failed` with the first
    /// failure, or `Recompute` from token 0, by the request's policy). P's export is `Read`
    /// exactly when every part was, otherwise released with the first part's end, with the
    /// most cautious proof; a replica's ends at once, unread.
    pub(super) fn judge_read_parent(
        &mut self,
        node: NodeId,
        request: usize,
        event: &ConnectorEvent,
        sound: bool,
        flat: &[u32],
    ) {
        let r = &self.requests[request];
        let multi = r.multi.as_ref().expect("multi-rank");
        let tally = multi.tally.get(&node).copied().unwrap_or_default();
        let (policy, skip) = (r.transfer.policy, r.p_blocks - r.d_blocks);
        let prefix = format!("{}#", event.request());
        // Each part's holder and the epoch its reads ran under (lifted past an earlier try).
        let parts: Vec<(NodeId, u64)> = r
            .d
            .iter()
            .filter(|a| a.node == node && a.id.as_str().starts_with(&prefix))
            .filter_map(|a| match (&a.sub, &a.kind) {
                (Some(sub), AttemptKind::Import { read_epoch }) => Some((sub.peer, *read_epoch)),
                _ => None,
            })
            .collect();
        // Every part of the call, refused ones included (they count as failed).
        let attempts = if self.is_prefill(node) { &r.p } else { &r.d };
        let subs = attempts
            .iter()
            .filter(|a| a.node == node && a.id.as_str().starts_with(&prefix))
            .count();
        let all = tally.failed == 0 && tally.delivered == subs;
        let (ok, failed) = (tally.delivered, tally.failed);
        let expected_failure = tally.first_failure.unwrap_or(SubFailure::NotStarted);
        match event {
            ConnectorEvent::Imported { outcome, .. } => {
                let loaded = *outcome == ImportOutcome::Loaded;
                if sound && loaded != all {
                    self.violate(format!(
                        "S10: pulled request {request} on rank {node}: the engine heard \
                         {outcome:?}, but {ok} of {subs} part(s) loaded and {failed} did not"
                    ));
                }
                if loaded {
                    for &(p, epoch) in &parts {
                        self.check_pair_ready(node, request, epoch, flat, p);
                    }
                    self.check_whole(node, request, flat, skip);
                    if sound && parts.len() >= 2 && !flat.is_empty() {
                        self.mark("hetero_read");
                    }
                } else if sound {
                    let expected = super::reader_fan_outcome(expected_failure, policy);
                    if *outcome != expected {
                        self.violate(format!(
                            "S10: pulled request {request} on rank {node} ended {outcome:?}; \
                             its first failed part and its policy {policy:?} say {expected:?} \
                             (no part is a prefix of the request)"
                        ));
                    }
                }
            }
            ConnectorEvent::ExportEnded { outcome, proof, .. } if subs == 0 => {
                let at_once = tally.started == Some(self.now);
                let unread = *outcome == ExportOutcome::Released(ExportEnd::FullPrefixHit)
                    && *proof == kvhandoff_protocol::machine::ReadProof::NeverGranted;
                if !at_once || !unread {
                    self.violate(format!(
                        "S10: replica P rank {node} of request {request} ended {outcome:?} \
                         ({proof:?}), started at {:?}, now {}: a replica ends at once, unread",
                        tally.started, self.now
                    ));
                } else {
                    self.mark("hetero_read_replica_holder");
                }
            }
            ConnectorEvent::ExportEnded { outcome, proof, .. } => {
                let read = *outcome == ExportOutcome::Read;
                if sound && read != all {
                    self.violate(format!(
                        "S10: pulled request {request} on P rank {node}: the engine heard \
                         {outcome:?}, but {ok} of {subs} part(s) were read and {failed} not"
                    ));
                }
                if sound && !read {
                    let end = match expected_failure {
                        SubFailure::Export(end) => end,
                        _ => ExportEnd::Aborted,
                    };
                    if *outcome != ExportOutcome::Released(end) {
                        self.violate(format!(
                            "S10: pulled request {request} on P rank {node} ended {outcome:?}, \
                             its first failed part {end:?}"
                        ));
                    }
                }
                if sound && tally.read_proof.is_some_and(|most| most != *proof) {
                    self.violate(format!(
                        "S10: pulled request {request} on P rank {node} handed back with proof \
                         {proof:?}, its parts' most cautious is {:?}",
                        tally.read_proof
                    ));
                }
            }
            other => {
                self.violate(format!(
                    "S4: pulled request {request} on rank {node} ended with a push event \
                     {other:?}"
                ));
            }
        }
    }

    /// S7 for a whole read: every byte of every block is P's (this request's, at the block's
    /// position), so no other request's bytes and no poison of a slice that never arrived.
    fn check_whole(&mut self, node: NodeId, request: usize, blocks: &[u32], skip: usize) {
        for (j, &b) in blocks.iter().enumerate() {
            let ok = self.nodes[node].pool.bytes(b).is_some_and(|bytes| {
                (0..BLOCK_BYTES).all(|x| bytes[x] == pattern(request, 0, skip + j, x))
            });
            if !ok {
                self.violate(format!(
                    "S7: pulled request {request} Loaded on rank {node} but block {b} does not \
                     hold P's bytes"
                ));
            }
        }
    }

    /// The router tries a failed multi-rank pull again on its D rank (a request with one D
    /// rank, by chance `Rates::retry`): a new engine request with the very parameters of the
    /// first (P rank 0's answer, epoch 1), its blocks allocated again.
    pub(super) fn maybe_retry_pull(
        &mut self,
        node: NodeId,
        request: usize,
        event: &ConnectorEvent,
    ) {
        let failed = matches!(
            event,
            ConnectorEvent::Imported { outcome, .. } if *outcome != ImportOutcome::Loaded
        );
        let Some(multi) = self.requests[request].multi.as_ref() else {
            return;
        };
        let one_rank = multi.pairs.iter().all(|pair| pair.d == node);
        let round = multi.round + 1;
        if !failed || !one_rank || round > MAX_ROUNDS || !self.alive(node) {
            return;
        }
        if !self.chance(self.rates.retry) {
            return;
        }
        let Some(multi) = self.requests[request].multi.as_ref() else {
            return;
        };
        let parent = rid("d", request, round);
        let mut attempts = Vec::new();
        for pair in &multi.pairs {
            let id: RequestId =
                sub_request_id(&parent, self.prefill_rank(pair.p), self.decode_rank(node))
                    .expect("the simulator's ids are short");
            attempts.push(Attempt {
                id,
                node,
                epoch: round,
                blocks: vec![],
                status: Status::Pending,
                kind: AttemptKind::Push,
                sub: Some(Sub {
                    key: pair.key.clone(),
                    peer: pair.p,
                    turn: false,
                }),
            });
        }
        let key = self.requests[request].key.clone();
        self.record(format!("router: retries {key} on rank {node} as {parent}"));
        *self
            .outcomes
            .entry("multi.pull.retried".to_string())
            .or_insert(0) += 1;
        let r = &mut self.requests[request];
        r.d.extend(attempts);
        if let Some(multi) = r.multi.as_mut() {
            multi.round = round;
        }
        self.fan_parents.insert((node, parent), request);
        let at = micros(&mut self.rng, 1_000, 20_000);
        self.schedule(at, Ev::SubDecodeStart { request, node });
    }
}
