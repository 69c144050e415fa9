//! The checker's side of a read back across a multi-rank pair (`turn.rs` makes the calls):
//! every part's end as a single read's or export's, and each rank's one event against every
//! part (S10), P's bytes against what D held (S7/S8), then the blocks go back to the pool.

use kvhandoff_protocol::machine::{
    EndpointEvent, ExportEnd, ExportOutcome, ImportOutcome, SubFailure, Time,
};
use kvhandoff_protocol::session::ConnectorEvent;
use kvhandoff_protocol::BlockIds;

use super::super::super::events::frozen_note;
use super::super::super::{Attempt, AttemptKind, Status, BLOCK_TOKENS};
use super::TURN_EPOCH;
use crate::ledger::{pattern, Owner, BLOCK_BYTES};
use crate::world::{NodeId, World};

impl World {
    /// A part of the read back ended at its endpoint: D's export by its hard end; P's import
    /// with no read of it still landing, and, `Loaded`, its slice of every block from a read
    /// of its D rank that landed, holding what D kept.
    pub(in crate::engine) fn turn_part_event(
        &mut self,
        node: NodeId,
        request: usize,
        ai: usize,
        event: &EndpointEvent,
        started: Time,
    ) {
        let id = event.request().clone();
        let (decode, failure, label) = match event {
            EndpointEvent::Export { outcome, proof, .. } if !self.is_prefill(node) => {
                let a = self.requests[request].d[ai].clone();
                self.check_hard_end(node, &a);
                *self
                    .outcomes
                    .entry(format!("read_proof.{proof:?}"))
                    .or_insert(0) += 1;
                let multi = self.requests[request].multi.as_mut().expect("multi-rank");
                let tally = multi.turn.tally.entry(node).or_default();
                tally.read_proof = Some(tally.read_proof.map_or(*proof, |p| p.max(*proof)));
                let failure = match outcome {
                    ExportOutcome::Read
                    | ExportOutcome::Released(ExportEnd::FullPrefixHit | ExportEnd::Empty) => None,
                    ExportOutcome::Released(end) => Some(SubFailure::Export(*end)),
                };
                if *outcome == ExportOutcome::Released(ExportEnd::Declined) {
                    // P's multi-rank decline reached this part (the hard-end check above
                    // already held it to its bound).
                    self.mark("hetero_turn2_declined");
                }
                (
                    true,
                    failure,
                    format!("multi.turn2.part.export.{outcome:?}"),
                )
            }
            EndpointEvent::Import { epoch, outcome, .. } if self.is_prefill(node) => {
                let a = self.requests[request].p[ai].clone();
                let holder = a.sub.as_ref().map_or(0, |s| s.peer);
                let (in_flight, frozen) = self.part_reads_into(node, request, epoch.0, holder);
                if in_flight > 0 {
                    self.violate(format!(
                        "proof: part {} of a read back handed its blocks back while \
                         {in_flight} read(s) of it may still land{}",
                        a.id,
                        frozen_note(frozen)
                    ));
                }
                self.requests[request].p[ai].kind = AttemptKind::Import {
                    read_epoch: epoch.0,
                };
                let skip = self.requests[request]
                    .p_blocks
                    .saturating_sub(a.blocks.len());
                let failure = match outcome {
                    ImportOutcome::Loaded => {
                        self.check_turn_slice(node, request, epoch.0, &a.blocks, holder, skip);
                        None
                    }
                    ImportOutcome::Recompute {
                        valid_tokens,
                        failure,
                    } => {
                        let valid = (*valid_tokens / u64::from(BLOCK_TOKENS)) as usize;
                        let valid = &a.blocks[..valid.min(a.blocks.len())];
                        if !valid.is_empty() {
                            self.check_turn_slice(node, request, epoch.0, valid, holder, skip);
                        }
                        Some(SubFailure::Import(*failure))
                    }
                    ImportOutcome::Failed(failure) => Some(SubFailure::Import(*failure)),
                };
                if let (Some(sub), Some(SubFailure::Import(f))) = (a.sub.as_ref(), failure) {
                    self.check_gave_up_early(node, &sub.key, epoch.0, Some(f));
                }
                (
                    false,
                    failure,
                    format!("multi.turn2.part.import.{outcome:?}"),
                )
            }
            other => {
                self.violate(format!(
                    "S4: part {id} of a read back on node {node} ended with {other:?}"
                ));
                return;
            }
        };
        let multi = self.requests[request].multi.as_mut().expect("multi-rank");
        let tally = multi.turn.tally.entry(node).or_default();
        match failure {
            None => tally.delivered += 1,
            Some(failure) => {
                tally.failed += 1;
                tally.first_failure.get_or_insert(failure);
            }
        }
        self.check_life(node, decode, &id, started);
        self.record(format!("engine: {id} ended: {label}"));
        *self.outcomes.entry(label).or_insert(0) += 1;
        let r = &mut self.requests[request];
        let attempts = if decode { &mut r.d } else { &mut r.p };
        attempts[ai].status = Status::Done;
        self.last_progress = self.now;
    }

    /// S7/S8 for one part of a read back into P rank `node`'s `blocks`: a read of D rank
    /// `holder` for the wire `epoch` landed, and the part's slice of every block holds D's
    /// bytes (D's tail: the first turn's blocks from `skip` on, which D held whole).
    fn check_turn_slice(
        &mut self,
        node: NodeId,
        request: usize,
        epoch: u64,
        blocks: &[u32],
        holder: NodeId,
        skip: usize,
    ) {
        let inc = self.nodes[node].incarnation;
        let landed = self
            .landed_pairs
            .get(&(node, inc, request, epoch, holder))
            .copied()
            .unwrap_or(0);
        if !blocks.is_empty() && landed == 0 {
            self.violate(format!(
                "S8: read back of request {request} e{epoch} on P rank {node}: a part \
                 loaded without a landed read of D rank {holder}"
            ));
        }
        let multi = self.requests[request].multi.as_ref().expect("multi-rank");
        let slice = multi.turn_slice(holder, node);
        for (j, &b) in blocks.iter().enumerate() {
            let ok = self.nodes[node].pool.bytes(b).is_some_and(|bytes| {
                slice
                    .clone()
                    .all(|x| bytes[x] == pattern(request, 0, skip + j, x))
            });
            if !ok {
                self.violate(format!(
                    "S7: read back of request {request} e{epoch} from D rank {holder} loaded, \
                     but P rank {node}'s block {b} does not hold its slice {slice:?} of D's bytes"
                ));
            }
        }
    }

    /// The session's one event for `request`'s second turn on rank `node` (its blocks handed
    /// back), judged against every part (S10), then the blocks go back to the rank's pool. P:
    /// `Loaded` exactly when every part loaded, and then every byte of every block is what D
    /// held; otherwise the first failed part's failure by the engine's policy, no token kept.
    /// D: `Read` exactly when every part was, otherwise released with the first part's end,
    /// with the most cautious proof.
    pub(in crate::engine) fn turn_hand_back(
        &mut self,
        node: NodeId,
        request: usize,
        blocks: &BlockIds,
        event: &ConnectorEvent,
    ) {
        let flat = blocks.groups.concat();
        let decode = !self.is_prefill(node);
        let inc = self.nodes[node].incarnation;
        let r = &self.requests[request];
        let multi = r.multi.as_ref().expect("multi-rank");
        let prefix = format!("{}#", event.request());
        let attempts = if decode { &r.d } else { &r.p };
        let mine: Vec<&Attempt> = attempts
            .iter()
            .filter(|a| a.node == node && a.id.as_str().starts_with(&prefix))
            .collect();
        let unsettled: Vec<String> = mine
            .iter()
            .filter(|a| matches!(a.status, Status::Live { .. } | Status::Pending))
            .map(|a| a.id.to_string())
            .collect();
        let parts: Vec<(NodeId, u64)> = mine
            .iter()
            .filter_map(|a| match (&a.sub, &a.kind) {
                (Some(sub), AttemptKind::Import { read_epoch }) => Some((sub.peer, *read_epoch)),
                _ => None,
            })
            .collect();
        let given = mine.first().map(|a| a.blocks.clone()).unwrap_or_default();
        let (subs, policy, p_blocks) = (mine.len(), r.transfer.policy, r.p_blocks);
        let tally = multi.turn.tally.get(&node).copied().unwrap_or_default();
        let owner = match multi.turn.kept.get(&node) {
            Some(owner) if decode => *owner,
            _ => Owner {
                request,
                epoch: TURN_EPOCH,
            },
        };
        let reads = self
            .writes
            .values()
            .filter(|w| w.request == request && w.read.is_some() && w.in_flight())
            .filter(|w| {
                if decode {
                    w.target == node && w.target_inc == inc && w.d_pinned
                } else {
                    w.poster == node && w.poster_inc == inc && w.read == Some(owner)
                }
            })
            .count();
        let sound = unsettled.is_empty() && reads == 0;
        if !sound {
            self.violate(format!(
                "S10: rank {node} handed back the blocks {flat:?} of request {request}'s read \
                 back before part(s) {unsettled:?} ended ({reads} read(s) may still {} them)",
                if decode { "read" } else { "land in" }
            ));
        }
        if flat != given {
            self.violate(format!(
                "S3: the read back of request {request} on rank {node} handed back {flat:?}, \
                 its parts were given {given:?}"
            ));
        }
        let all = tally.failed == 0 && tally.delivered == subs;
        let (ok, failed) = (tally.delivered, tally.failed);
        let first_failure = tally.first_failure.unwrap_or(SubFailure::NotStarted);
        let label = match event {
            ConnectorEvent::Imported { outcome, .. } if !decode => {
                let loaded = *outcome == ImportOutcome::Loaded;
                if sound && loaded != all {
                    self.violate(format!(
                        "S10: read back of request {request} on P rank {node}: the engine heard \
                         {outcome:?}, but {ok} of {subs} part(s) loaded and {failed} did not"
                    ));
                }
                let skip = p_blocks.saturating_sub(flat.len());
                if loaded {
                    for &(holder, epoch) in &parts {
                        self.check_turn_slice(node, request, epoch, &flat, holder, skip);
                    }
                    self.check_turn_whole(node, request, &flat, skip);
                    if sound && parts.len() >= 2 && !flat.is_empty() {
                        self.mark("hetero_turn2_read_back");
                    }
                } else if sound {
                    let expected = super::super::reader_fan_outcome(first_failure, policy);
                    if *outcome != expected {
                        self.violate(format!(
                            "S10: read back of request {request} on P rank {node} ended \
                             {outcome:?}; its first failed part and its policy {policy:?} say \
                             {expected:?} (no part is a prefix of the turn)"
                        ));
                    } else if parts.len() >= 2 && failed >= 1 {
                        self.mark("hetero_turn2_read_back_part_failed");
                    }
                }
                format!("multi.turn2.import.{outcome:?}")
            }
            ConnectorEvent::ExportEnded { outcome, proof, .. } if decode => {
                let read = *outcome == ExportOutcome::Read;
                if sound && read != all {
                    self.violate(format!(
                        "S10: kept turn of request {request} on D rank {node}: the engine heard \
                         {outcome:?}, but {ok} of {subs} part(s) were read and {failed} not"
                    ));
                }
                if sound && !read {
                    let end = match first_failure {
                        SubFailure::Export(end) => end,
                        _ => ExportEnd::Aborted,
                    };
                    if *outcome != ExportOutcome::Released(end) {
                        self.violate(format!(
                            "S10: kept turn of request {request} on D rank {node} ended \
                             {outcome:?}, its first failed part {end:?}"
                        ));
                    }
                }
                if sound && tally.read_proof.is_some_and(|most| most != *proof) {
                    self.violate(format!(
                        "S10: kept turn of request {request} on D rank {node} handed back with \
                         proof {proof:?}, its parts' most cautious is {:?}",
                        tally.read_proof
                    ));
                }
                format!("multi.turn2.export.{outcome:?}")
            }
            other => {
                self.violate(format!(
                    "S4: the turn of request {request} on rank {node} ended with {other:?}"
                ));
                "multi.turn2.other".to_string()
            }
        };
        *self.outcomes.entry(label).or_insert(0) += 1;
        let key = self.requests[request].key.clone();
        self.record(format!(
            "engine: rank {node} hands back the turn's blocks of {key}"
        ));
        let frozen = frozen_note(self.frozen_touching(node, &flat));
        for e in self.nodes[node].pool.free(&flat, owner) {
            self.violate(format!("node {node}: {e}{frozen}"));
        }
        self.wake_waiters(node, flat.len());
    }

    /// S7 for a whole read back: every byte of every block is what D held (this request's, at
    /// the block's position), so no poison of a slice that never arrived.
    fn check_turn_whole(&mut self, node: NodeId, request: usize, blocks: &[u32], skip: usize) {
        for (j, &b) in blocks.iter().enumerate() {
            let ok = self.nodes[node].pool.bytes(b).is_some_and(|bytes| {
                (0..BLOCK_BYTES).all(|x| bytes[x] == pattern(request, 0, skip + j, x))
            });
            if !ok {
                self.violate(format!(
                    "S7: read back of request {request} Loaded on P rank {node} but block {b} \
                     does not hold D's bytes"
                ));
            }
        }
    }
}
