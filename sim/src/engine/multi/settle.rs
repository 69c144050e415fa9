//! The ends of a multi-rank request's sub-requests: each sub-request's hand-back is judged as
//! any single request's is (its proof against the writes of its own P rank), then fed to its
//! rank's fan-in; the shared blocks' hand-back is judged against every pair (S10).

use kvhandoff_protocol::machine::{
    DecodeOutcome, EngineEvent, FanInStep, FanOutcome, FanSide, Time,
};
use kvhandoff_protocol::BlockIds;

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
        event: &EngineEvent,
        started: Time,
    ) {
        let id = event.request().clone();
        let (decode, label) = match event {
            EngineEvent::Decode {
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
                    tally.0 += 1;
                } else {
                    tally.1 += 1;
                }
                (true, format!("sub.decode.{outcome:?}"))
            }
            EngineEvent::DecodeFenced { .. } => unreachable!("early events go to fenced.rs"),
            EngineEvent::Prefill { outcome, .. } => (false, format!("sub.prefill.{outcome:?}")),
            EngineEvent::Export { .. } | EngineEvent::Import { .. } => {
                self.violate(format!("S4: a read event for the push sub-request {id}"));
                return;
            }
        };
        self.check_life(node, decode, &id, started);
        self.record(format!("engine: {id} ended: {label}"));
        *self.outcomes.entry(label).or_insert(0) += 1;
        let r = &mut self.requests[request];
        let attempts = if decode { &mut r.d } else { &mut r.p };
        attempts[ai].status = Status::Done;
        self.last_progress = self.now;
        let multi = r.multi.as_mut().expect("multi-rank");
        match multi.fans.get_mut(&node).map(|fan| fan.on_event(event)) {
            None => self.violate(format!("no fan-in of request {request} on node {node}")),
            Some(Err(error)) => self.violate(format!(
                "fan-in of request {request} on node {node}: {error}"
            )),
            Some(Ok(step)) => self.after_fan_step(node, request, step),
        }
    }

    /// Does what the fan-in of `request` on `node` said: the shared blocks back (judged
    /// first), then the siblings' aborts (each cancels at its own peer rank; their outputs
    /// are drained by the caller).
    pub(in crate::engine) fn after_fan_step(
        &mut self,
        node: NodeId,
        request: usize,
        step: FanInStep,
    ) {
        if let Some(outcome) = &step.outcome {
            let key = &self.requests[request].key;
            let line = format!("engine: {key} on rank {node}: {outcome:?}");
            self.record(line);
        }
        if let Some(blocks) = &step.hand_back {
            self.shared_hand_back(node, request, blocks);
        }
        let aborted = self.abort_subs(node, step.abort);
        for _ in 0..aborted {
            self.mark("multi_source_sibling_aborted");
        }
        let multi = self.requests[request].multi.as_mut().expect("multi-rank");
        if multi
            .fans
            .get(&node)
            .is_some_and(|fan| fan.is_handed_back() && fan.counts().live == 0)
        {
            multi.fans.remove(&node);
        }
    }

    /// S10: a rank hands the blocks its sub-requests shared back only once each of them handed
    /// them back, so that no write of any pair can still land in them (D) or read them (P);
    /// the outcome agrees with the sub-requests' ends (D: `Ready` only if every pair was);
    /// then the blocks go back to the rank's pool.
    fn shared_hand_back(&mut self, node: NodeId, request: usize, blocks: &BlockIds) {
        let flat = blocks.groups.concat();
        let inc = self.nodes[node].incarnation;
        let decode = !self.is_prefill(node);
        let r = &self.requests[request];
        let attempts = if decode { &r.d } else { &r.p };
        let mine: Vec<_> = attempts.iter().filter(|a| a.node == node).collect();
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
        let sound = unsettled.is_empty() && in_flight == 0;
        if !sound {
            self.violate(format!(
                "S10: rank {node} handed back the shared blocks {flat:?} of request {request} \
                 before sub-request(s) {unsettled:?} handed them back ({in_flight} write(s) may \
                 still {} them)",
                if decode { "land in" } else { "read" }
            ));
        }
        let multi = self.requests[request].multi.as_ref().expect("multi-rank");
        let fan = multi.fans.get(&node).expect("the step's fan-in");
        let outcome = fan.outcome().cloned();
        let counts = fan.counts();
        let ready = outcome == Some(FanOutcome::Ready);
        let side = match fan.side() {
            FanSide::Decode => "decode",
            FanSide::Prefill => "prefill",
        };
        let key = self.requests[request].key.clone();
        let sources = multi.sources_of(node);
        if decode {
            let (ok, failed) = multi.tally.get(&node).copied().unwrap_or_default();
            if sound && ready != (failed == 0 && ok == subs) {
                self.violate(format!(
                    "S10: request {request} on rank {node}: outcome {outcome:?}, but {ok} of \
                     {subs} sub-request(s) ready and {failed} failed"
                ));
            }
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
        } else if sound && subs >= 2 && counts.succeeded >= 1 && counts.failed >= 1 {
            self.mark("multi_target_partial_failure");
        }
        let verdict = if ready { "Ready" } else { "Failed" };
        *self
            .outcomes
            .entry(format!("multi.{side}.{verdict}"))
            .or_insert(0) += 1;
        self.record(format!(
            "engine: rank {node} hands back the shared blocks of {key}"
        ));
        let frozen = super::super::events::frozen_note(self.frozen_touching(node, &flat));
        for e in self.nodes[node].pool.free(&flat, Owner { request, epoch }) {
            self.violate(format!("node {node}: {e}{frozen}"));
        }
        self.wake_waiters(node, flat.len());
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
    fn check_pair_ready(
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
