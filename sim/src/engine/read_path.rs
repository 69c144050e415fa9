//! The engine model of the read path: a pulled request (P exports, D reads once the router
//! handed it P's answer), a second turn (D keeps its blocks, P reads them back or declines),
//! and the checks on every export's and import's terminal event.

use kvhandoff_protocol::machine::{
    export_hard_end, EndpointEvent, ImportFailure, ImportOutcome, Rejected,
};
use kvhandoff_protocol::session::{ConnectorCall, ConnectorError, KvTransferParams};
use kvhandoff_protocol::{BlockIds, ReadRefusal, RequestId};

use super::events::frozen_note;
use super::{rid, Attempt, AttemptKind, Status, BLOCK_TOKENS};
use crate::ledger::Owner;
use crate::world::{micros, Ev, NodeId, World};

impl World {
    /// D attempt `attempt` of a pulled request: it needs P's answer (a live export) first, as
    /// the router forwards it; then it allocates and imports.
    pub(super) fn pull_decode_start(&mut self, request: usize, attempt: usize) {
        let r = self.requests[request].clone();
        let a = r.d[attempt].clone();
        let node = a.node;
        let export =
            r.p.iter()
                .rev()
                .find(|x| matches!(x.kind, AttemptKind::Export { .. }))
                .filter(|x| matches!(x.status, Status::Live { .. }))
                .cloned();
        let Some(export) = export else {
            if !r
                .p
                .iter()
                .any(|x| matches!(x.status, Status::Pending | Status::Live { .. }))
            {
                // P's export ended (read, refused, expired): P prefills again.
                let next = r.p.len() as u64 + 1;
                self.requests[request].p.push(Attempt {
                    id: rid("p", request, next),
                    node: 0,
                    epoch: next,
                    blocks: vec![],
                    status: Status::Pending,
                    kind: AttemptKind::Push,
                    sub: None,
                });
                let at = micros(&mut self.rng, 0, 10_000);
                self.schedule(at, Ev::PrefillStart { request });
            }
            let later = micros(&mut self.rng, 2_000, 20_000);
            self.schedule(later, Ev::DecodeStart { request });
            return;
        };
        self.record(format!("engine: D allocates to read {} {}", r.key, a.id));
        let owner = Owner {
            request,
            epoch: a.epoch,
        };
        let blocks = self.allocate_on(node, r.d_blocks, owner);
        let Some(blocks) = blocks else {
            self.wait_for_blocks(node, super::start_event(request, true));
            return;
        };
        // What the router hands D: P's answer, with D's attempt as the epoch.
        let mut params = self.read_params(&export.id, r.transfer.gate);
        params.epoch = Some(a.epoch);
        self.set_policy(node, r.transfer.policy);
        let call = ConnectorCall::RequestAllocated {
            request: a.id,
            blocks: BlockIds::single_group(blocks.clone()),
            num_tokens: u64::from(BLOCK_TOKENS) * r.p_blocks as u64,
            params,
        };
        let retry = Some(Ev::DecodeStart { request });
        self.note_read_started(node, &r.key, a.epoch, &export.id);
        if self
            .engine_call(node, call, &blocks, owner, retry)
            .is_none()
        {
            return;
        }
        let inc = self.nodes[node].incarnation;
        let a = &mut self.requests[request].d[attempt];
        a.blocks = blocks;
        a.kind = AttemptKind::Import {
            read_epoch: a.epoch,
        };
        a.status = Status::Live {
            node_inc: inc,
            started: self.now,
            fenced: None,
        };
        self.last_progress = self.now;
        self.schedule_sibling_decline(request, node, false);
        self.drain(node);
    }

    /// The parameters the router hands the reader of export `export`: the holder's answer,
    /// without its expiry if the router does not forward it (`gate` off).
    fn read_params(&mut self, export: &RequestId, gate: bool) -> KvTransferParams {
        let Some(mut params) = self.answers.get(export).cloned() else {
            self.violate(format!("no answer of export {export}"));
            return KvTransferParams::default();
        };
        if !gate {
            params.remote_blocks_expiry_time = None;
        }
        params
    }

    /// The reader's engine's load-failure policy for its next read (drawn per request).
    pub(super) fn set_policy(
        &mut self,
        node: NodeId,
        policy: kvhandoff_protocol::machine::LoadFailurePolicy,
    ) {
        if let Some(session) = self.nodes[node].session.as_mut() {
            let mut settings = *session.settings();
            settings.load_failure_policy = policy;
            session.set_settings(settings);
        }
    }

    /// D's attempt ended with the KV in its blocks: if the request has a second turn, D's
    /// engine keeps the blocks and exports them for P (true), instead of freeing them.
    pub(super) fn keep_for_second_turn(
        &mut self,
        node: NodeId,
        request: usize,
        a: &Attempt,
    ) -> bool {
        let r = &self.requests[request];
        let Some(second) = r.transfer.second.clone() else {
            return false;
        };
        if node != r.d_node || a.blocks.is_empty() || !self.alive(node) {
            return false;
        }
        if r.d
            .iter()
            .any(|x| matches!(x.kind, AttemptKind::Export { .. }))
        {
            return false;
        }
        let id = rid("x", request, a.epoch);
        let call = ConnectorCall::KeepForNextTurn {
            request: id.clone(),
            blocks: BlockIds::single_group(a.blocks.clone()),
            num_tokens: u64::from(BLOCK_TOKENS) * a.blocks.len() as u64,
            ttl: second.ttl,
            params: KvTransferParams {
                transfer_id: Some(second.key.as_str().to_owned()),
                ..KvTransferParams::default()
            },
        };
        let now = self.now;
        if !self.keep_ahead(node, request, a.epoch, &id, &call) {
            match self.call(node, call) {
                Ok(reply) => self.keep_answer(&id, reply),
                Err(ConnectorError::Rejected(Rejected::TableFull { .. })) => {
                    self.mark("admission_refused");
                    self.check_flood_admission(node);
                    return false;
                }
                Err(error) => {
                    self.violate(format!("export refused by node {node}: {error}"));
                    return false;
                }
            }
        }
        let key = &self.requests[request].key;
        self.record(format!("engine: D keeps {key} for a second turn as {id}"));
        let inc = self.nodes[node].incarnation;
        self.requests[request].d.push(Attempt {
            id,
            node,
            epoch: a.epoch,
            blocks: a.blocks.clone(),
            status: Status::Live {
                node_inc: inc,
                started: now,
                fenced: None,
            },
            kind: AttemptKind::Export {
                hard_end: export_hard_end(now, second.ttl, &self.cfg.machine),
                renewed: false,
            },
            sub: None,
        });
        self.schedule(second.delay, Ev::SecondTurn { request });
        true
    }

    /// P's engine starts the request's second turn: it reads D's kept blocks back, or declines
    /// (it recomputes instead).
    pub(crate) fn second_turn(&mut self, request: usize) {
        let r = self.requests[request].clone();
        let Some(second) = r.transfer.second.clone() else {
            return;
        };
        let Some(export) =
            r.d.iter()
                .rev()
                .find(|x| matches!(x.kind, AttemptKind::Export { .. }))
                .cloned()
        else {
            return;
        };
        if !self.alive(0) {
            return;
        }
        let m = second.blocks.min(export.blocks.len());
        if second.decline || m == 0 {
            self.record(format!("engine: P declines the second turn of {}", r.key));
            *self
                .outcomes
                .entry("turn2.recomputed".to_string())
                .or_insert(0) += 1;
            let decline = ConnectorCall::DeclineExport {
                request: rid("t", request, 0),
                params: self.read_params(&export.id, second.gate),
            };
            if let Err(error) = self.call(0, decline) {
                self.violate(format!("decline refused by P: {error}"));
            }
            self.drain(0);
            return;
        }
        let k =
            r.p.iter()
                .filter(|x| matches!(x.kind, AttemptKind::Import { .. }))
                .count() as u64;
        if k > 0 {
            return;
        }
        let owner = Owner {
            request,
            epoch: 100 + k,
        };
        let Some(blocks) = self.nodes[0].pool.allocate(m, owner) else {
            let later = micros(&mut self.rng, 2_000, 10_000);
            self.schedule(later, Ev::SecondTurn { request });
            return;
        };
        let id = rid("t", request, k + 1);
        self.record(format!(
            "engine: P reads the second turn of {} as {id}",
            r.key
        ));
        self.set_policy(0, r.transfer.policy);
        let call = ConnectorCall::NextTurnAllocated {
            request: id.clone(),
            blocks: BlockIds::single_group(blocks.clone()),
            num_tokens: u64::from(BLOCK_TOKENS) * export.blocks.len() as u64,
            params: self.read_params(&export.id, second.gate),
        };
        let retry = Some(Ev::SecondTurn { request });
        self.note_turn_read_started(0, &second.key, &export.id);
        if self.engine_call(0, call, &blocks, owner, retry).is_none() {
            return;
        }
        let inc = self.nodes[0].incarnation;
        self.requests[request].p.push(Attempt {
            id,
            node: 0,
            epoch: owner.epoch,
            blocks,
            status: Status::Live {
                node_inc: inc,
                started: self.now,
                fenced: None,
            },
            kind: AttemptKind::Import { read_epoch: 1 },
            sub: None,
        });
        self.last_progress = self.now;
        self.schedule_sibling_decline(request, 0, true);
        self.drain(0);
    }

    /// If the request has a sibling that declines, it does so a while after this read started.
    pub(in crate::engine) fn schedule_sibling_decline(
        &mut self,
        request: usize,
        node: NodeId,
        second_turn: bool,
    ) {
        if let Some(after) = self.requests[request].transfer.sibling_decline {
            let ev = Ev::SiblingDecline {
                request,
                node,
                second_turn,
            };
            self.schedule(after, ev);
        }
    }

    /// A sibling of the read `node` runs for `request` declines the export, with the very
    /// parameters the read was started with (key, epoch, holder). While the read is live the
    /// endpoint must refuse it; once it ended the decline goes out and changes nothing.
    pub(crate) fn sibling_decline(&mut self, request: usize, node: NodeId, second_turn: bool) {
        if self.requests[request].multi.is_some() {
            return self.multi_sibling_decline(request, node);
        }
        let r = &self.requests[request];
        let holders = if second_turn { &r.d } else { &r.p };
        let Some(export) = holders
            .iter()
            .rev()
            .find(|x| matches!(x.kind, AttemptKind::Export { .. }))
        else {
            return;
        };
        let export = export.id.clone();
        let key = if second_turn {
            let Some(second) = &r.transfer.second else {
                return;
            };
            second.key.clone()
        } else {
            r.key.clone()
        };
        let attempts = if second_turn { &r.p } else { &r.d };
        let Some(epoch) = attempts.iter().rev().find_map(|x| match x.kind {
            AttemptKind::Import { read_epoch } if x.node == node => Some(read_epoch),
            AttemptKind::Import { .. } | AttemptKind::Push | AttemptKind::Export { .. } => None,
        }) else {
            return;
        };
        if self.nodes[node].session.is_none() {
            return;
        }
        self.record(format!("engine: a sibling on node {node} declines {key}"));
        // The very parameters the read was started with.
        let mut params = self.read_params(&export, true);
        params.epoch = Some(epoch);
        let decline = ConnectorCall::DeclineExport {
            request: rid("s", request, epoch),
            params,
        };
        match self.call(node, decline) {
            Ok(_) => self.mark("sibling_decline_sent"),
            Err(ConnectorError::Rejected(Rejected::ImportInProgress(_))) => {
                self.mark("decline_refused_while_reading")
            }
            Err(error) => self.violate(format!("sibling decline refused: {error}")),
        }
        self.drain(node);
    }

    /// The checks of an export's or an import's terminal event (the shared ones, S3 and S4,
    /// ran already); true if the engine keeps the blocks (a second turn), false if it frees
    /// them.
    pub(super) fn read_event_checks(
        &mut self,
        node: NodeId,
        request: usize,
        a: &Attempt,
        event: &EndpointEvent,
        flat: &[u32],
    ) -> (String, bool) {
        let p_blocks = self.requests[request].p_blocks;
        match event {
            EndpointEvent::Export { outcome, proof, .. } => {
                self.check_hard_end(node, a);
                *self
                    .outcomes
                    .entry(format!("read_proof.{proof:?}"))
                    .or_insert(0) += 1;
                (format!("export.{outcome:?}"), false)
            }
            EndpointEvent::Import { epoch, outcome, .. } => {
                let (in_flight, frozen) = self.reads_into(node, request, epoch.0);
                if in_flight > 0 {
                    self.violate(format!(
                        "proof: import {} handed its blocks back while {in_flight} read(s) may still land{}",
                        a.id,
                        frozen_note(frozen)
                    ));
                }
                let second_turn = node == 0;
                let skip = p_blocks.saturating_sub(flat.len());
                let failure = match outcome {
                    ImportOutcome::Loaded => {
                        self.check_ready(node, request, epoch.0, flat, skip);
                        if !flat.is_empty() && !second_turn {
                            self.mark("pull_read_completed");
                            let renewed = self.requests[request].p.iter().any(|x| {
                                matches!(x.kind, AttemptKind::Export { renewed: true, .. })
                            });
                            if renewed {
                                self.mark("pull_read_after_lease_renewal");
                            }
                        }
                        None
                    }
                    ImportOutcome::Recompute {
                        valid_tokens,
                        failure,
                    } => {
                        let valid = (*valid_tokens / u64::from(BLOCK_TOKENS)) as usize;
                        if valid > 0 {
                            self.check_ready(node, request, epoch.0, &flat[..valid], skip);
                        }
                        if matches!(failure, ImportFailure::ReadFailed | ImportFailure::Deadline) {
                            self.mark("load_failure_recompute");
                        }
                        Some(*failure)
                    }
                    ImportOutcome::Failed(failure) => Some(*failure),
                };
                // A second turn's read is under the turn's key.
                let key = match &self.requests[request].transfer.second {
                    Some(second) if second_turn => second.key.clone(),
                    _ => self.requests[request].key.clone(),
                };
                self.check_gave_up_early(node, &key, epoch.0, failure);
                match failure {
                    Some(ImportFailure::Refused(ReadRefusal::Expired)) => {
                        self.mark("read_racing_ttl_expiry");
                    }
                    Some(
                        ImportFailure::DeclinedNearExpiry
                        | ImportFailure::Refused(ReadRefusal::NearExpiry),
                    ) if second_turn => self.mark("turn2_read_declined_near_expiry"),
                    _ => {}
                }
                if second_turn {
                    let one_key = self.requests[request]
                        .transfer
                        .second
                        .as_ref()
                        .is_some_and(|second| second.key == self.requests[request].key);
                    if failure.is_none() && one_key {
                        self.mark("turn2_read_under_first_key");
                    }
                    let turn = match failure {
                        None => "turn2.pulled_from_decode",
                        Some(
                            ImportFailure::DeclinedNearExpiry
                            | ImportFailure::Refused(ReadRefusal::NearExpiry),
                        ) => "turn2.declined_near_expiry",
                        Some(_) => "turn2.recomputed",
                    };
                    *self.outcomes.entry(turn.to_string()).or_insert(0) += 1;
                }
                let kept = outcome == &ImportOutcome::Loaded
                    && !second_turn
                    && self.keep_for_second_turn(node, request, a);
                (format!("import.{outcome:?}"), kept)
            }
            EndpointEvent::Decode { .. }
            | EndpointEvent::DecodeFenced { .. }
            | EndpointEvent::Prefill { .. } => {
                unreachable!("push events are checked in events.rs")
            }
        }
    }

    /// L3: export `a` on `node` ended by its hard end (computed at its start from its lease,
    /// not the machine's own record).
    pub(super) fn check_hard_end(&mut self, node: NodeId, a: &Attempt) {
        if let AttemptKind::Export { hard_end, .. } = a.kind {
            // A holder stalled past its hard end ends the export when it runs again (late, so
            // safe for the reader): the bound moves by the stall.
            let stalled = match a.status {
                Status::Live { started, .. } => self.stalled_since(node, started),
                Status::Pending | Status::Done | Status::Lost | Status::Skipped => {
                    std::time::Duration::ZERO
                }
            };
            if self.now > hard_end + stalled {
                self.violate(format!(
                    "L3: export {} ended at {} after its hard end {hard_end}",
                    a.id, self.now
                ));
            }
        }
    }

    /// A heartbeat `node` took renewed exports it holds (its counter moved): note which, for
    /// the coverage marks.
    pub(crate) fn note_renewals(&mut self, node: NodeId, keys: &[kvhandoff_protocol::PairingKey]) {
        for key in keys {
            let Some(&request) = self.keys.get(key) else {
                continue;
            };
            // A multi-rank pull's P ranks other than rank 0 are nodes after the D engines.
            let holder_d = !self.is_prefill(node);
            let r = &mut self.requests[request];
            let attempts = if holder_d { &mut r.d } else { &mut r.p };
            for a in attempts.iter_mut().filter(|a| a.node == node) {
                if let AttemptKind::Export { renewed, .. } = &mut a.kind {
                    if matches!(a.status, Status::Live { .. }) {
                        *renewed = true;
                    }
                }
            }
            if holder_d {
                self.mark("d_ttl_renewed_by_p");
            }
        }
    }
}
