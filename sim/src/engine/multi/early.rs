//! Answers ahead of exports for multi-rank pulls (`engine/early_answers.rs` for single ones).
//! P's engine answers the router once, with its rank 0's answer (which vLLM's proxy forwards
//! to every D rank), at the end of the step; each P rank's worker hands the rank its share
//! with a later step's metadata, each after a delay of its own. A D rank may so ask a P rank
//! that has nothing under the pair's key yet, and a P rank may get its share long after the
//! first parts were read.
//!
//! The answer is the session's own ([`Session::preview_call`] on rank 0); rank 0's call, when
//! it comes, must answer the same (bar the expiry). Check R1 holds for every part's read as
//! for a single read. Marks `sub_export_answered_early` (a multi-rank pull answered ahead) and
//! `part_asked_before_export` (a P rank handled a D rank's ask for its share before it had it).
//!
//! [`Session::preview_call`]: kvhandoff_protocol::session::Session::preview_call

use kvhandoff_protocol::machine::export_hard_end;
use kvhandoff_protocol::session::{ConnectorCall, RankLinks};

use super::parent_id;
use crate::engine::early_answers::{EarlyKind, SubFiling};
use crate::engine::{AttemptKind, Status};
use crate::ledger::Owner;
use crate::world::{Ev, NodeId, World};

impl World {
    /// P rank `node` finished attempt `epoch` of multi-rank pull `request` into `blocks`, and
    /// its worker is to make `call` with `links`: if the request is drawn, the router gets rank
    /// 0's answer now (when `node` is rank 0) and the rank gets the call later (true); false
    /// leaves the call to the usual path.
    pub(super) fn file_subs_later(
        &mut self,
        request: usize,
        node: NodeId,
        epoch: u64,
        call: &ConnectorCall,
        links: &RankLinks,
        blocks: &[u32],
    ) -> bool {
        let eligible = self.cfg.early_answers > 0.0
            && !self.cfg.explore
            && self.early.has_room()
            && !self.early.sub_filings.contains_key(&(request, node));
        if !eligible
            || !self
                .early
                .draw_multi(request, epoch, self.cfg.early_answers)
        {
            return false;
        }
        let answered = self.pull_answer(request).is_some();
        if node == 0 && !answered {
            let Some(session) = self.nodes[node].session.as_ref() else {
                return false;
            };
            let Ok(reply) = session.preview_call(self.now, call) else {
                return false;
            };
            self.keep_answer(&parent_id("p", request), reply);
        }
        let pending: Vec<usize> = self.requests[request]
            .p
            .iter()
            .enumerate()
            .filter(|(_, a)| a.node == node && a.status == Status::Pending)
            .map(|(ai, _)| ai)
            .collect();
        let key = self.requests[request].key.clone();
        self.record(format!(
            "engine: P rank {node}'s share of {key} answered ahead of its export"
        ));
        self.mark("sub_export_answered_early");
        let inc = self.nodes[node].incarnation;
        let hard_end =
            export_hard_end(self.now, self.cfg.machine.lease_duration, &self.cfg.machine);
        for &ai in &pending {
            let a = &mut self.requests[request].p[ai];
            self.early
                .answered(a.id.clone(), call.clone(), EarlyKind::Part);
            a.blocks = blocks.to_vec();
            a.export_live(inc, self.now, hard_end);
        }
        self.early.sub_filings.insert(
            (request, node),
            SubFiling {
                call: call.clone(),
                links: links.clone(),
                blocks: blocks.to_vec(),
                pending,
                epoch,
            },
        );
        let delay = self
            .early
            .filing_delay(self.cfg.machine.register_retry_interval, EarlyKind::Part);
        self.schedule(delay, Ev::FileSubExports { request, node, inc });
        self.last_progress = self.now;
        true
    }

    /// P rank `node`'s worker hands the rank its share of `request` answered earlier
    /// (incarnation `inc` of the rank's process: a crash took the prefill with it).
    pub(crate) fn file_sub_exports(&mut self, request: usize, node: NodeId, inc: u32) {
        let Some(filing) = self.early.sub_filings.remove(&(request, node)) else {
            self.violate(format!(
                "P rank {node} files a share of request {request} twice"
            ));
            return;
        };
        if !self.alive(node) || self.nodes[node].incarnation != inc {
            // The rank's process died with the prefill.
            return;
        }
        let ended = filing.pending.iter().find(|&&ai| {
            let a = &self.requests[request].p[ai];
            !matches!(a.status, Status::Live { node_inc, .. } if node_inc == inc)
        });
        if let Some(&ai) = ended {
            let id = self.requests[request].p[ai].id.clone();
            self.filed_after_end(node, &id);
            return;
        }
        let key = self.requests[request].key.clone();
        self.record(format!(
            "engine: P rank {node}'s worker files its share of {key}"
        ));
        match self.call_linked(node, filing.call, &filing.links) {
            Ok(reply) => {
                if node == 0 {
                    self.check_filed_reply(&parent_id("p", request), reply);
                }
                for &ai in &filing.pending {
                    let id = self.requests[request].p[ai].id.clone();
                    self.early.filed(&id, self.now);
                }
                // The parts' hard ends count from the call.
                let r = &mut self.requests[request];
                for &ai in &filing.pending {
                    r.p[ai].kind = AttemptKind::Push;
                }
                self.subs_started(
                    request,
                    node,
                    false,
                    filing.epoch,
                    &filing.pending,
                    filing.blocks,
                );
            }
            Err(error) => {
                let owner = Owner {
                    request,
                    epoch: filing.epoch,
                };
                self.filing_refused(node, &parent_id("p", request), error, &filing.blocks, owner);
                for &ai in &filing.pending {
                    self.requests[request].p[ai].status = Status::Skipped;
                }
            }
        }
    }

    /// D rank `node` starts its reads of `request` (its attempts `pending`): each part's asks
    /// are counted from now, for R1.
    pub(super) fn note_sub_reads_started(
        &mut self,
        request: usize,
        node: NodeId,
        pending: &[usize],
    ) {
        for &ai in pending {
            let r = &self.requests[request];
            let a = &r.d[ai];
            let Some(sub) = a.sub.as_ref() else {
                continue;
            };
            let export = r
                .p
                .iter()
                .find(|p| p.node == sub.peer && p.sub.as_ref().is_some_and(|s| s.key == sub.key))
                .map(|p| p.id.clone());
            if let Some(export) = export {
                let (key, epoch) = (sub.key.clone(), a.epoch);
                self.note_read_started(node, &key, epoch, &export);
            }
        }
    }
}
