//! Keeps answered ahead (`engine/early_answers.rs` for pulls): D's engine hands the router its
//! answer for a request's next turn (`keep_for_next_turn`) when the request ends, and its
//! worker hands the rank the kept blocks with a later step's metadata. Most second turns
//! start within 50 ms, so P may ask D for a keep its rank does not hold yet, and D answers
//! that it exports nothing under the key.
//!
//! The answer is the session's own ([`Session::preview_call`]); the call follows with the
//! delays of pulls, and its reply must be the answer the router already has (bar the expiry).
//! Check R1 holds for P's read of the turn. Marks `keep_answered_early` and
//! `turn_asked_before_keep` (D handled P's ask for a keep answered but not filed yet).
//!
//! [`Session::preview_call`]: kvhandoff_protocol::session::Session::preview_call

use kvhandoff_protocol::machine::export_hard_end;
use kvhandoff_protocol::session::{ConnectorCall, ConnectorReply};
use kvhandoff_protocol::RequestId;

use super::early_answers::EarlyKind;
use super::{rid, Status};
use crate::ledger::Owner;
use crate::world::{Ev, NodeId, World};

impl World {
    /// D `node`'s engine keeps request `request`'s blocks for its second turn as `id` (its
    /// attempt `epoch`): if drawn, the router gets the session's answer to `call` now and the
    /// rank the call later (true); false leaves the call to the usual path (not drawn, or the
    /// session refuses it, which the call itself then reports).
    pub(super) fn keep_ahead(
        &mut self,
        node: NodeId,
        request: usize,
        epoch: u64,
        id: &RequestId,
        call: &ConnectorCall,
    ) -> bool {
        let eligible = self.cfg.early_answers > 0.0 && !self.cfg.explore && self.early.has_room();
        if !eligible || !self.early.draw_keep(self.cfg.early_answers) {
            return false;
        }
        let Some(session) = self.nodes[node].session.as_ref() else {
            return false;
        };
        let Ok(reply) = session.preview_call(self.now, call) else {
            return false;
        };
        self.keep_answer(id, reply);
        self.mark("keep_answered_early");
        self.early
            .answered(id.clone(), call.clone(), EarlyKind::Keep);
        let delay = self
            .early
            .filing_delay(self.cfg.machine.register_retry_interval, EarlyKind::Keep);
        let inc = self.nodes[node].incarnation;
        self.schedule(
            delay,
            Ev::FileKeep {
                request,
                node,
                epoch,
                inc,
            },
        );
        true
    }

    /// D `node`'s worker hands the rank the keep of `request` (D's attempt `epoch`) its engine
    /// answered earlier (incarnation `inc` of D's process: a crash took the blocks with it).
    pub(crate) fn file_keep(&mut self, request: usize, node: NodeId, epoch: u64, inc: u32) {
        let id = rid("x", request, epoch);
        let Some(ai) = self.requests[request].d.iter().position(|a| a.id == id) else {
            self.violate(format!("keep {id} filed without its attempt"));
            return;
        };
        let a = self.requests[request].d[ai].clone();
        if !self.alive(node) || self.nodes[node].incarnation != inc {
            // The process died with the kept blocks.
            return;
        }
        if !matches!(a.status, Status::Live { node_inc, .. } if node_inc == inc) {
            self.filed_after_end(node, &id);
            return;
        }
        let Some(call) = self.early.call_of(&id) else {
            self.violate(format!("keep {id} filed without its answer"));
            return;
        };
        let ttl = match &call {
            ConnectorCall::KeepForNextTurn { ttl, .. } => *ttl,
            other => {
                self.violate(format!("keep {id} answered ahead of {other:?}"));
                return;
            }
        };
        self.record(format!("engine: D's worker files {id}"));
        match self.call(node, call) {
            Ok(reply @ ConnectorReply::NextTurnParams(_)) => {
                self.check_filed_reply(&id, reply);
                self.early.filed(&id, self.now);
                let hard_end = export_hard_end(self.now, ttl, &self.cfg.machine);
                self.requests[request].d[ai].export_live(inc, self.now, hard_end);
                self.last_progress = self.now;
                self.drain(node);
            }
            Ok(reply) => self.violate(format!("keep {id} answered {reply:?}")),
            Err(error) => {
                self.filing_refused(node, &id, error, &a.blocks, Owner { request, epoch });
                self.requests[request].d[ai].status = Status::Skipped;
            }
        }
    }
}
