//! The one terminal event of a request on one side: the checks its endpoint event must pass
//! (the checker sees every endpoint event, [`SessionOutput::Observed`]), D's retry with a new
//! epoch, and the engine's side: the blocks go back to the pool when the session's event for
//! the request comes, as a real engine frees them on its connector's event.
//!
//! [`SessionOutput::Observed`]: kvhandoff_protocol::session::SessionOutput::Observed

use std::time::Duration;

use kvhandoff_protocol::machine::{DecodeOutcome, EndpointEvent, FreeProof, Time};
use kvhandoff_protocol::session::ConnectorEvent;

use super::{rid, Attempt, AttemptKind, Status};
use crate::ledger::{judge_hand_back, pattern, HandBack, Owner, BLOCK_BYTES};
use crate::world::{micros, Ev, NodeId, World};
use kvhandoff_protocol::{PairingKey, RequestId};

/// A request the checker saw end at its endpoint, whose blocks the engine gets back with the
/// session's event for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PendingHandBack {
    pub owner: Owner,
    pub blocks: Vec<u32>,
    /// The engine keeps the blocks (a second turn exports them) instead of freeing them.
    pub kept: bool,
    /// A failed D attempt the engine may try again with the next epoch.
    pub may_retry: bool,
}

impl World {
    /// The session's event for the engine: a single request's frees the blocks its endpoint
    /// event was judged with (and must hand back the same ones); a multi-rank request's is
    /// judged against every pair of the rank (`multi/settle.rs`).
    pub(crate) fn connector_event(&mut self, node: NodeId, event: ConnectorEvent) {
        let id = event.request().clone();
        if let Some(&request) = self.fan_parents.get(&(node, id.clone())) {
            self.parent_event(node, request, &event);
            return;
        }
        match &event {
            ConnectorEvent::DecodeFenced { .. } => return, // judged on the endpoint's (F1)
            ConnectorEvent::Refused { error, .. } => {
                self.violate(format!(
                    "S4: {id} refused late ({error}) with no late verdict"
                ));
                return;
            }
            ConnectorEvent::BlocksReady { .. }
            | ConnectorEvent::Failed { .. }
            | ConnectorEvent::BlocksFree { .. }
            | ConnectorEvent::ExportEnded { .. }
            | ConnectorEvent::Imported { .. } => {}
        }
        let Some(hand_back) = self.hand_backs.remove(&(node, id.clone())) else {
            self.violate(format!(
                "S4: the engine heard {id} end ({event:?}) though its endpoint did not"
            ));
            return;
        };
        let flat = hand_back_blocks(&event).concat();
        if flat != hand_back.blocks {
            self.violate(format!(
                "S3: the session handed {id}'s blocks back as {flat:?}, its endpoint as {:?}",
                hand_back.blocks
            ));
        }
        if !hand_back.kept {
            let frozen = frozen_note(self.frozen_touching(node, &hand_back.blocks));
            for e in self.nodes[node]
                .pool
                .free(&hand_back.blocks, hand_back.owner)
            {
                self.violate(format!("node {node}: {e}{frozen}"));
            }
            self.wake_waiters(node, hand_back.blocks.len());
        }
        let owner = hand_back.owner;
        if hand_back.may_retry && self.chance(self.rates.retry) {
            self.retry(owner.request, owner.epoch + 1);
        }
    }

    /// The one terminal event of a request on one side, as its endpoint reported it: checks
    /// S3, S4, S7, S8. A D request's early failure (`DecodeFenced`, not terminal) goes to
    /// `fenced.rs`.
    pub(crate) fn endpoint_event(&mut self, node: NodeId, event: EndpointEvent) {
        let (id, key, blocks, decode) = match &event {
            EndpointEvent::DecodeFenced { .. } => {
                self.decode_fenced(node, &event);
                return;
            }
            EndpointEvent::Decode {
                request,
                key,
                blocks,
                ..
            } => (request.clone(), key.clone(), blocks.clone(), true),
            EndpointEvent::Prefill {
                request,
                key,
                blocks,
                ..
            } => (request.clone(), key.clone(), blocks.clone(), false),
            EndpointEvent::Export {
                request,
                key,
                blocks,
                ..
            }
            | EndpointEvent::Import {
                request,
                key,
                blocks,
                ..
            } => (
                request.clone(),
                key.clone(),
                blocks.clone(),
                !self.is_prefill(node),
            ),
        };
        let Some(&request) = self.keys.get(&key) else {
            self.violate(format!("event for unknown key {key}"));
            return;
        };
        let r = self.requests[request].clone();
        let attempts = if decode { &r.d } else { &r.p };
        let Some(ai) = attempts.iter().position(|a| a.id == id) else {
            self.violate(format!("S4: event for unknown request {id}"));
            return;
        };
        let a = attempts[ai].clone();
        let inc = self.nodes[node].incarnation;
        let Status::Live {
            node_inc,
            started,
            fenced,
        } = a.status
        else {
            self.violate(format!(
                "S4: second terminal event for {id} ({:?})",
                a.status
            ));
            return;
        };
        if node_inc != inc {
            self.violate(format!("S4: event for {id} from another incarnation"));
            return;
        }
        let flat = blocks.groups.concat();
        if flat != a.blocks {
            self.violate(format!(
                "S3: {id} handed back {flat:?}, was given {:?}",
                a.blocks
            ));
        }
        if let Some(told) = fenced {
            self.check_fenced_end(&id, told, &event);
        }
        self.check_rejoined_asked(node, &event);
        if a.sub.is_some() {
            self.sub_event(node, request, ai, &event, started);
            return;
        }
        let owner = Owner {
            request,
            epoch: a.epoch,
        };
        let (d_blocks, p_blocks) = (r.d_blocks, r.p_blocks);
        let mut kept_blocks = false;
        let label = match &event {
            EndpointEvent::Decode {
                epoch,
                outcome,
                proof,
                ..
            } => {
                if epoch.0 != a.epoch {
                    self.violate(format!(
                        "S5: {id} ended in epoch {epoch}, allocated in e{}",
                        a.epoch
                    ));
                }
                if *outcome == DecodeOutcome::Ready {
                    self.check_ready(node, request, a.epoch, &flat, p_blocks - d_blocks);
                    kept_blocks = self.keep_for_second_turn(node, request, &a);
                }
                let ready = *outcome == DecodeOutcome::Ready;
                self.layerwise_marks(request, a.epoch, ready);
                self.step_decode_events.push(request);
                self.check_proof(node, request, a.epoch, *proof, started);
                *self.outcomes.entry(format!("proof.{proof:?}")).or_insert(0) += 1;
                format!("decode.{outcome:?}")
            }
            EndpointEvent::DecodeFenced { .. } => unreachable!("early events return above"),
            EndpointEvent::Prefill { outcome, .. } => {
                self.maybe_late_sibling(request, *outcome);
                format!("prefill.{outcome:?}")
            }
            EndpointEvent::Export { .. } | EndpointEvent::Import { .. } => {
                let (label, kept) = self.read_event_checks(node, request, &a, &event, &flat);
                kept_blocks = kept;
                label
            }
        };
        self.check_life(node, decode, &id, started);
        self.record(format!("engine: {id} ended: {label}"));
        *self.outcomes.entry(label).or_insert(0) += 1;
        let r = &mut self.requests[request];
        let attempts = if decode { &mut r.d } else { &mut r.p };
        attempts[ai].status = Status::Done;
        self.last_progress = self.now;
        let failed = matches!(
            &event,
            EndpointEvent::Decode {
                outcome: DecodeOutcome::Failed(_),
                ..
            } | EndpointEvent::Import {
                outcome: kvhandoff_protocol::machine::ImportOutcome::Failed(_),
                ..
            }
        );
        let primary = a.node == r.d_node;
        let pending = PendingHandBack {
            owner,
            blocks: flat,
            kept: kept_blocks,
            may_retry: decode && primary && failed && a.epoch < 3,
        };
        if let Some(earlier) = self.hand_backs.insert((node, id.clone()), pending) {
            self.violate(format!(
                "S4: {id} ended twice before the engine heard ({earlier:?})"
            ));
        }
    }

    /// L1: the longest a request may legally take. D waits for its deadline, then at worst for
    /// the quarantine (every answer lost); P is bounded by its lease, D's renewals until D's
    /// deadline, and one write's life. Time `node`'s process spent stalled since the start is
    /// added: its own deadlines could not run then.
    pub(super) fn check_life(&mut self, node: NodeId, decode: bool, id: &RequestId, started: Time) {
        let m = &self.cfg.machine;
        let limit = if decode {
            m.connect_timeout + m.decode_deadline + m.quarantine + Duration::from_secs(1)
        } else {
            m.lease_duration
                + m.decode_deadline
                + m.lease_extension
                + m.write_timeout
                + m.abandon_timeout
                + Duration::from_secs(10)
        };
        let limit = limit + self.stalled_since(node, started);
        if !self.cfg.explore && self.now.saturating_since(started) > limit {
            self.violate(format!(
                "L1: {id} took {:?} to end",
                self.now.saturating_since(started)
            ));
        }
    }

    /// The ledger's check of D's `FreeProof` against the ghost state (see [`Self::judge_proof`]),
    /// and what a fenced request cost.
    fn check_proof(
        &mut self,
        node: NodeId,
        request: usize,
        epoch: u64,
        proof: FreeProof,
        started: Time,
    ) {
        let key = self.requests[request].key.clone();
        let inc = self.nodes[node].incarnation;
        let registered = self.registers_sent.contains(&(node, inc, request, epoch));
        let writer = Writer {
            node: 0,
            key: &key,
            registered,
        };
        self.judge_proof(node, request, epoch, proof, writer);
        if matches!(proof, FreeProof::DeadPeerFence | FreeProof::Quarantine) {
            let blocks = self.requests[request].d_blocks as u64;
            let held = self.now.saturating_since(started).as_micros() as u64;
            self.fenced_block_us += blocks * held;
        }
    }

    /// The ledger's check of one D hand-back's `FreeProof` against the ghost state: a request
    /// freed as never exposed sent no registration; any other proof needs that no write of the
    /// attempt from its P rank (`writer`) can still land in its blocks (the simulated NIXL
    /// knows every write in flight), and that this P rank holds no registration of it.
    pub(super) fn judge_proof(
        &mut self,
        node: NodeId,
        request: usize,
        epoch: u64,
        proof: FreeProof,
        writer: Writer<'_>,
    ) {
        let inc = self.nodes[node].incarnation;
        let in_flight: Vec<bool> = self
            .writes
            .values()
            .filter(|w| {
                w.read.is_none()
                    && w.poster == writer.node
                    && w.target == node
                    && w.target_inc == inc
                    && w.request == request
                    && w.epoch == epoch
                    && w.in_flight()
            })
            .map(|w| w.frozen)
            .collect();
        let writes_in_flight = in_flight.len();
        let frozen = in_flight.iter().filter(|&&f| f).count();
        let d_addr = &self.nodes[node].addr;
        let now = self.now;
        let p_holds = self.nodes[writer.node]
            .endpoint()
            .and_then(|p| p.pending_registration(writer.key))
            .is_some_and(|(from, e, expires)| from == d_addr && e.0 == epoch && expires > now);
        let hand_back = HandBack {
            proof,
            registered: writer.registered,
            writes_in_flight,
            p_holds_registration: p_holds && self.known_incarnation(writer.node, node) == inc,
        };
        for fault in judge_hand_back(&hand_back) {
            self.violate(format!(
                "proof: request {request} e{epoch} {fault}{}",
                frozen_note(frozen)
            ));
        }
        if proof == FreeProof::DeadPeerFence {
            self.mark("fence_free");
        }
    }

    /// S7/S8: every byte D expects is P's pattern, written in this epoch, by a landed write.
    pub(super) fn check_ready(
        &mut self,
        node: NodeId,
        request: usize,
        epoch: u64,
        blocks: &[u32],
        skip: usize,
    ) {
        if blocks.is_empty() {
            return;
        }
        let inc = self.nodes[node].incarnation;
        if self
            .landed
            .get(&(node, inc, request, epoch))
            .copied()
            .unwrap_or(0)
            == 0
        {
            self.violate(format!(
                "S8: request {request} e{epoch} Ready without a landed write"
            ));
        }
        for (j, &b) in blocks.iter().enumerate() {
            let pool = &self.nodes[node].pool;
            let written = pool.state(b).is_some_and(|s| s.written);
            let bytes = pool.bytes(b).expect("exists");
            let ok = (0..BLOCK_BYTES).all(|x| bytes[x] == pattern(request, 0, skip + j, x));
            if !written || !ok {
                self.violate(format!(
                    "S7: request {request} e{epoch} Ready but block {b} written={written} bytes_ok={ok}"
                ));
            }
        }
    }

    fn retry(&mut self, request: usize, epoch: u64) {
        let r = &mut self.requests[request];
        let d_node = r.d_node;
        let mut id = rid("d", request, epoch);
        if r.d.iter().any(|a| a.id == id) {
            // The epoch repeats one of a run before D's crash (the router's retry there started
            // at epoch 1 again): the engine's new request has an id of its own.
            id = RequestId::new(format!("{id}n{}", r.d.len())).expect("valid request id");
        }
        r.d.push(Attempt {
            id,
            node: d_node,
            epoch,
            blocks: vec![],
            status: Status::Pending,
            kind: AttemptKind::Push,
            sub: None,
        });
        let d_at = micros(&mut self.rng, 1_000, 20_000);
        self.schedule(d_at, Ev::DecodeStart { request });
        let r = &mut self.requests[request];
        if r.p.iter().all(|a| a.status != Status::Pending) {
            // P runs the prefill again (a live attempt for the key makes it a skip).
            let p_next = r.p.len() as u64 + 1;
            r.p.push(Attempt {
                id: rid("p", request, p_next),
                node: 0,
                epoch: p_next,
                blocks: vec![],
                status: Status::Pending,
                kind: AttemptKind::Push,
                sub: None,
            });
            let p_at = micros(&mut self.rng, 0, 10_000);
            self.schedule(p_at, Ev::PrefillStart { request });
        }
    }
}

/// What a violation about transfers still in flight adds when a stall froze some of them: their
/// life clock stopped with their poster, so no time bound on them held.
pub(super) fn frozen_note(frozen: usize) -> String {
    if frozen == 0 {
        String::new()
    } else {
        format!(
            " ({frozen} frozen by their poster's stall: past max_write_life, no time fence holds)"
        )
    }
}

/// The P rank whose writes a D hand-back must have outlived: its node, the key it knows the
/// attempt by, and whether D's rank sent it a registration for the attempt.
pub(super) struct Writer<'a> {
    pub node: NodeId,
    pub key: &'a PairingKey,
    pub registered: bool,
}

/// The blocks a final event of the engine hands back, per cache group (none for an early one).
fn hand_back_blocks(event: &ConnectorEvent) -> Vec<Vec<u32>> {
    match event {
        ConnectorEvent::BlocksReady { blocks, .. }
        | ConnectorEvent::Failed { blocks, .. }
        | ConnectorEvent::BlocksFree { blocks, .. }
        | ConnectorEvent::ExportEnded { blocks, .. }
        | ConnectorEvent::Imported { blocks, .. } => blocks.groups.clone(),
        ConnectorEvent::DecodeFenced { .. } | ConnectorEvent::Refused { .. } => Vec::new(),
    }
}
