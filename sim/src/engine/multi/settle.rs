//! The ends of a multi-rank request: each sub-request's end, as its endpoint reported it, is
//! judged as any single request's is (its proof against the writes of its own P rank); the
//! session's one event per rank for the request — the shared blocks' hand-back — is judged
//! against every pair (S10), and only then are the blocks freed, as an engine frees them.

use kvhandoff_protocol::machine::{
    DecodeOutcome, EndpointEvent, PrefillOutcome, ReleaseCause, Time,
};
use kvhandoff_protocol::session::ConnectorEvent;
use kvhandoff_protocol::{BlockIds, ReleaseReason};

use super::super::events::Writer;
use super::super::Status;
use crate::ledger::{pattern, Owner};
use crate::world::{NodeId, World};

impl World {
    /// The terminal event of sub-request `ai` of `request` on `node` (its blocks handed back
    /// and checked against its attempt already).
    pub(in crate::engine) fn sub_event(
        &mut self,
        node: NodeId,
        request: usize,
        ai: usize,
        event: &EndpointEvent,
        started: Time,
    ) {
        let id = event.request().clone();
        let r = &self.requests[request];
        let attempts = if self.is_prefill(node) { &r.p } else { &r.d };
        if attempts[ai].sub.as_ref().is_some_and(|sub| sub.turn) {
            self.turn_part_event(node, request, ai, event, started);
            return;
        }
        let (decode, label) = match event {
            EndpointEvent::Prefill { .. } | EndpointEvent::Decode { .. }
                if self.requests[request].transfer.pull =>
            {
                self.violate(format!("S4: a push event for the pulled sub-request {id}"));
                return;
            }
            EndpointEvent::Decode {
                epoch,
                outcome,
                proof,
                ..
            } => {
                let a = self.requests[request].d[ai].clone();
                let sub = a.sub.clone().expect("a sub-request");
                if epoch.0 != a.epoch {
                    self.violate(format!(
                        "S5: {id} ended in epoch {epoch}, allocated in e{}",
                        a.epoch
                    ));
                }
                let ready = *outcome == DecodeOutcome::Ready;
                if ready {
                    self.check_pair_ready(node, request, a.epoch, &a.blocks, sub.peer);
                }
                self.step_decode_events.push(request);
                let registered = self
                    .sub_registers
                    .contains(&(node, sub.key.clone(), a.epoch));
                let writer = Writer {
                    node: sub.peer,
                    key: &sub.key,
                    registered,
                };
                self.judge_proof(node, request, a.epoch, *proof, writer);
                *self.outcomes.entry(format!("proof.{proof:?}")).or_insert(0) += 1;
                let multi = self.requests[request].multi.as_mut().expect("multi-rank");
                let tally = multi.tally.entry(node).or_default();
                if ready {
                    tally.delivered += 1;
                } else {
                    tally.failed += 1;
                }
                tally.proof = Some(tally.proof.map_or(*proof, |p| p.max(*proof)));
                (true, format!("sub.decode.{outcome:?}"))
            }
            EndpointEvent::DecodeFenced { .. } => unreachable!("early events go to fenced.rs"),
            EndpointEvent::Prefill { outcome, .. } => {
                let multi = self.requests[request].multi.as_mut().expect("multi-rank");
                let tally = multi.tally.entry(node).or_default();
                // D needed nothing more of this pair (a full prefix hit, nothing to send): as
                // good as delivered (`FanIn`'s rule, stated again here).
                let delivered = matches!(
                    outcome,
                    PrefillOutcome::Sent
                        | PrefillOutcome::Released(
                            ReleaseCause::Empty
                                | ReleaseCause::ReleasedByPeer(
                                    ReleaseReason::FullPrefixHit | ReleaseReason::ReadDone
                                )
                        )
                );
                if delivered {
                    tally.delivered += 1;
                } else {
                    tally.failed += 1;
                }
                (false, format!("sub.prefill.{outcome:?}"))
            }
            EndpointEvent::Export { .. } | EndpointEvent::Import { .. } => {
                if !self.requests[request].transfer.pull {
                    self.violate(format!("S4: a read event for the push sub-request {id}"));
                    return;
                }
                self.read_part_event(node, request, ai, event)
            }
        };
        self.check_life(node, decode, &id, started);
        self.record(format!("engine: {id} ended: {label}"));
        *self.outcomes.entry(label).or_insert(0) += 1;
        let r = &mut self.requests[request];
        let attempts = if decode { &mut r.d } else { &mut r.p };
        attempts[ai].status = Status::Done;
        self.last_progress = self.now;
    }

    /// The session's event for multi-rank request `request` on rank `node`: its early failure
    /// (once per request and rank, while the blocks are out), or its one final event, which
    /// hands the shared blocks back (judged first, S10).
    pub(crate) fn parent_event(&mut self, node: NodeId, request: usize, event: &ConnectorEvent) {
        let id = event.request().clone();
        let blocks = match event {
            ConnectorEvent::DecodeFenced { .. } => {
                if !self.parents_fenced.insert((node, id.clone())) {
                    self.violate(format!("F1: {id} on rank {node} told fenced twice"));
                }
                self.mark("multi_source_fenced_early");
                return;
            }
            ConnectorEvent::Refused { error, .. } => {
                self.violate(format!(
                    "S4: {id} refused late ({error}) with no late verdict"
                ));
                return;
            }
            ConnectorEvent::BlocksReady { blocks, .. }
            | ConnectorEvent::Failed { blocks, .. }
            | ConnectorEvent::BlocksFree { blocks, .. }
            | ConnectorEvent::ExportEnded { blocks, .. }
            | ConnectorEvent::Imported { blocks, .. } => blocks.clone(),
        };
        let key = self.requests[request].key.clone();
        self.record(format!(
            "engine: {key} on rank {node}: {}",
            parent_label(event)
        ));
        if self.fan_parents.remove(&(node, id.clone())).is_none() {
            self.violate(format!("S4: {id} on rank {node} handed back twice"));
            return;
        }
        if self.is_turn_parent(request, &id) {
            self.turn_hand_back(node, request, &blocks, event);
            return;
        }
        self.shared_hand_back(node, request, &blocks, event);
    }

    /// S10: a rank hands the blocks its sub-requests shared back only once each of them handed
    /// them back, so that no write of any pair can still land in them (D) or read them (P);
    /// the outcome agrees with the sub-requests' ends (D: `Ready` only if every pair was);
    /// then the blocks go back to the rank's pool.
    fn shared_hand_back(
        &mut self,
        node: NodeId,
        request: usize,
        blocks: &BlockIds,
        event: &ConnectorEvent,
    ) {
        let flat = blocks.groups.concat();
        let inc = self.nodes[node].incarnation;
        let decode = !self.is_prefill(node);
        let r = &self.requests[request];
        let pull = r.transfer.pull;
        let attempts = if decode { &r.d } else { &r.p };
        // This call's parts (a pulled request's retry is another engine request on the rank).
        let prefix = format!("{}#", event.request());
        let mine: Vec<_> = attempts
            .iter()
            .filter(|a| a.node == node && a.id.as_str().starts_with(&prefix))
            .collect();
        let epoch = mine.first().map_or(1, |a| a.epoch);
        let unsettled: Vec<String> = mine
            .iter()
            .filter(|a| matches!(a.status, Status::Live { .. } | Status::Pending))
            .map(|a| a.id.to_string())
            .collect();
        let subs = mine.len();
        let in_flight = self
            .writes
            .values()
            .filter(|w| w.read.is_none() && w.request == request)
            .filter(|w| {
                if decode {
                    w.target == node && w.target_inc == inc && w.epoch == epoch && w.in_flight()
                } else {
                    // NIXL reads the sources until the write's end is reported.
                    w.poster == node && w.poster_inc == inc
                }
            })
            .count();
        let owner = Owner { request, epoch };
        let reads = self.reads_touching(node, request, owner);
        let sound = unsettled.is_empty() && in_flight == 0 && reads == 0;
        if !sound {
            self.violate(format!(
                "S10: rank {node} handed back the shared blocks {flat:?} of request {request} \
                 before sub-request(s) {unsettled:?} handed them back ({in_flight} write(s) and \
                 {reads} read(s) may still {} them)",
                if decode { "land in" } else { "read" }
            ));
        }
        if pull {
            self.judge_read_parent(node, request, event, sound, &flat);
            self.free_shared(node, request, &flat, owner, event);
            return;
        }
        let multi = self.requests[request].multi.as_ref().expect("multi-rank");
        let ready = matches!(
            event,
            ConnectorEvent::BlocksReady { .. } | ConnectorEvent::BlocksFree { released: None, .. }
        );
        let side = if decode { "decode" } else { "prefill" };
        let sources = multi.sources_of(node);
        let tally = multi.tally.get(&node).copied().unwrap_or_default();
        let (ok, failed) = (tally.delivered, tally.failed);
        if sound && ready != (failed == 0 && ok == subs) {
            self.violate(format!(
                "S10: request {request} on rank {node}: the engine heard {}, but {ok} of {subs} \
                 sub-request(s) delivered and {failed} did not",
                parent_label(event)
            ));
        }
        if let ConnectorEvent::Failed { proof, .. } = event {
            if sound && tally.proof.is_some_and(|most| most != *proof) {
                self.violate(format!(
                    "S10: request {request} on rank {node} handed back with proof {proof:?}, \
                     its sub-requests' most cautious is {:?}",
                    tally.proof
                ));
            }
            let wrote = sources.iter().any(|&p| {
                let inc = self.nodes[node].incarnation;
                self.landed_pairs
                    .get(&(node, inc, request, epoch, p))
                    .is_some_and(|&n| n > 0)
            });
            if sound && wrote {
                self.mark("multi_source_failed_after_a_write");
            }
        }
        if decode {
            if ready {
                let skip = self.requests[request].p_blocks - self.requests[request].d_blocks;
                for p in sources {
                    self.check_pair_landed(node, request, epoch, p, &flat);
                }
                self.check_ready(node, request, epoch, &flat, skip);
            }
            if sound && subs >= 2 {
                if ready {
                    self.mark("multi_source_ready");
                } else if ok >= 1 && failed >= 1 {
                    self.mark("multi_source_partial_failure");
                }
            }
        } else if sound && subs >= 2 && ok >= 1 && failed >= 1 {
            self.mark("multi_target_partial_failure");
        }
        let verdict = if ready { "Ready" } else { "Failed" };
        *self
            .outcomes
            .entry(format!("multi.{side}.{verdict}"))
            .or_insert(0) += 1;
        self.free_shared(node, request, &flat, owner, event);
    }

    /// The engine frees the shared blocks its session handed back.
    fn free_shared(
        &mut self,
        node: NodeId,
        request: usize,
        flat: &[u32],
        owner: Owner,
        event: &ConnectorEvent,
    ) {
        if self.requests[request].transfer.pull {
            let label = match event {
                ConnectorEvent::Imported { outcome, .. } => format!("multi.import.{outcome:?}"),
                ConnectorEvent::ExportEnded { outcome, .. } => format!("multi.export.{outcome:?}"),
                other => format!("multi.pull.{}", parent_label(other)),
            };
            *self.outcomes.entry(label).or_insert(0) += 1;
        }
        if self.keep_turn(node, request, flat, owner, event) {
            // D's engine keeps the blocks for the request's next turn, read back across the
            // pair; they go back with the kept turn's own event.
            return;
        }
        let key = self.requests[request].key.clone();
        self.record(format!(
            "engine: rank {node} hands back the shared blocks of {key}"
        ));
        let frozen = super::super::events::frozen_note(self.frozen_touching(node, flat));
        for e in self.nodes[node].pool.free(flat, owner) {
            self.violate(format!("node {node}: {e}{frozen}"));
        }
        self.wake_waiters(node, flat.len());
        if self.requests[request].transfer.pull {
            self.maybe_retry_pull(node, request, event);
        }
    }

    /// S8 for one pair: a write of P rank `p` for the epoch really landed in this incarnation's
    /// blocks (unless D's blocks are empty: a full prefix hit needs no write).
    fn check_pair_landed(
        &mut self,
        node: NodeId,
        request: usize,
        epoch: u64,
        p: NodeId,
        blocks: &[u32],
    ) {
        let inc = self.nodes[node].incarnation;
        let key = (node, inc, request, epoch, p);
        if !blocks.is_empty() && self.landed_pairs.get(&key).copied().unwrap_or(0) == 0 {
            self.violate(format!(
                "S8: request {request} e{epoch} on rank {node}: Ready without a landed write \
                 of P rank {p}"
            ));
        }
    }

    /// S7/S8 for one sub-request: its P rank's write landed, and its slice of every block holds
    /// P's pattern.
    pub(super) fn check_pair_ready(
        &mut self,
        node: NodeId,
        request: usize,
        epoch: u64,
        blocks: &[u32],
        p: NodeId,
    ) {
        self.check_pair_landed(node, request, epoch, p, blocks);
        let r = &self.requests[request];
        let skip = r.p_blocks - r.d_blocks;
        let slice = r.multi.as_ref().expect("multi-rank").slice(p, node);
        for (j, &b) in blocks.iter().enumerate() {
            let bytes = self.nodes[node].pool.bytes(b).expect("exists");
            let ok = slice
                .clone()
                .all(|x| bytes[x] == pattern(request, 0, skip + j, x));
            if !ok {
                self.violate(format!(
                    "S7: request {request} e{epoch} from P rank {p} Ready but block {b} does \
                     not hold its slice {slice:?}"
                ));
            }
        }
    }
}

/// How the engine's event of a multi-rank request reads in the trace.
fn parent_label(event: &ConnectorEvent) -> &'static str {
    match event {
        ConnectorEvent::BlocksReady { .. } => "Ready",
        ConnectorEvent::Failed { .. } => "Failed",
        ConnectorEvent::BlocksFree { released: None, .. } => "Sent",
        ConnectorEvent::BlocksFree { .. } => "Released",
        ConnectorEvent::DecodeFenced { .. } => "Fenced",
        ConnectorEvent::Refused { .. } => "Refused",
        ConnectorEvent::ExportEnded { .. } => "ExportEnded",
        ConnectorEvent::Imported { .. } => "Imported",
    }
}
