//! Keeps of a multi-rank request's second turn answered ahead (`engine/early_keeps.rs` for
//! single ones): D's engine answers the router's `keep_for_next_turn` with its first rank's
//! answer when the request ends, and each D rank's worker hands its rank its share later,
//! after a delay of its own, so a P rank reading the turn back may ask a D rank that holds
//! nothing under the pair's key yet. The first rank's call must answer what the router
//! already has (bar the expiry); R1 holds for each part's read. Marks
//! `turn_keep_answered_early` and `turn_part_asked_before_keep`.

use kvhandoff_protocol::machine::export_hard_end;
use kvhandoff_protocol::session::{sub_request_id, ConnectorCall, ConnectorReply, RankLinks};

use super::keep_id;
use crate::engine::early_answers::{EarlyKind, TurnFiling};
use crate::engine::AttemptKind;
use crate::ledger::Owner;
use crate::world::{Ev, NodeId, World};

impl World {
    /// D rank `node` keeps `flat` (leased to `owner`) for `request`'s second turn with `call`:
    /// if the request is drawn, the session's answer now (the router keeps the first rank's)
    /// and the call later; `None` leaves the call to the usual path.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn keep_turn_ahead(
        &mut self,
        request: usize,
        node: NodeId,
        call: &ConnectorCall,
        turn: &RankLinks,
        forward: &RankLinks,
        flat: &[u32],
        owner: Owner,
    ) -> Option<ConnectorReply> {
        let eligible = self.cfg.early_answers > 0.0
            && !self.cfg.explore
            && self.early.has_room()
            && !self.early.turn_filings.contains_key(&(request, node));
        if !eligible || !self.early.draw_turn(request, self.cfg.early_answers) {
            return None;
        }
        let reply = self.nodes[node]
            .session
            .as_ref()?
            .preview_call(self.now, call)
            .ok()?;
        let key = self.requests[request].key.clone();
        self.record(format!(
            "engine: D rank {node}'s keep of {key} answered ahead of its call"
        ));
        self.mark("turn_keep_answered_early");
        for id in self.turn_part_ids(request, node) {
            self.early.answered(id, call.clone(), EarlyKind::TurnPart);
        }
        self.early.turn_filings.insert(
            (request, node),
            TurnFiling {
                call: call.clone(),
                turn: turn.clone(),
                forward: forward.clone(),
                blocks: flat.to_vec(),
                owner,
            },
        );
        let delay = self.early.filing_delay(
            self.cfg.machine.register_retry_interval,
            EarlyKind::TurnPart,
        );
        let inc = self.nodes[node].incarnation;
        self.schedule(delay, Ev::FileTurnKeep { request, node, inc });
        Some(reply)
    }

    /// D rank `node`'s worker hands the rank its share of `request`'s keep answered earlier
    /// (incarnation `inc` of the rank's process: a crash took the blocks with it).
    pub(crate) fn file_turn_keep(&mut self, request: usize, node: NodeId, inc: u32) {
        let Some(filing) = self.early.turn_filings.remove(&(request, node)) else {
            self.violate(format!(
                "D rank {node} files its keep of request {request} twice"
            ));
            return;
        };
        let kept = self.requests[request]
            .multi
            .as_ref()
            .and_then(|m| m.turn.kept.get(&node).copied());
        if !self.alive(node) || self.nodes[node].incarnation != inc {
            // The rank's process died with the kept blocks.
            return;
        }
        if kept != Some(filing.owner) {
            self.filed_after_end(node, &keep_id(request));
            return;
        }
        let Some(second) = self.requests[request].transfer.second.clone() else {
            return;
        };
        let parent = keep_id(request);
        self.record(format!("engine: D rank {node}'s worker files {parent}"));
        match self.turn_call(node, filing.call, &filing.turn, &filing.forward) {
            Ok(reply) => {
                if self.first_keeper(request) == Some(node) {
                    self.check_filed_reply(&parent, reply);
                }
                for id in self.turn_part_ids(request, node) {
                    self.early.filed(&id, self.now);
                }
                let kind = AttemptKind::Export {
                    hard_end: export_hard_end(self.now, second.ttl, &self.cfg.machine),
                    renewed: false,
                };
                let epoch = filing.owner.epoch;
                self.turn_parts_started(request, node, &parent, &filing.blocks, epoch, kind);
                self.last_progress = self.now;
                self.drain(node);
            }
            Err(error) => {
                self.filing_refused(node, &parent, error, &filing.blocks, filing.owner);
                if let Some(multi) = self.requests[request].multi.as_mut() {
                    multi.turn.kept.remove(&node);
                }
            }
        }
    }

    /// The D rank whose answer the router forwards for `request`'s keep: its first.
    pub(super) fn first_keeper(&self, request: usize) -> Option<NodeId> {
        self.requests[request].multi.as_ref().and_then(|m| {
            m.pairs
                .iter()
                .map(|pair| pair.d)
                .min_by_key(|&d| self.decode_rank(d))
        })
    }

    /// P rank `node` starts reading `request`'s turn back: each part's asks are counted from
    /// its first, for R1.
    pub(super) fn note_turn_part_reads_started(&mut self, request: usize, node: NodeId) {
        let Some(second) = self.requests[request].transfer.second.clone() else {
            return;
        };
        let Some(multi) = self.requests[request].multi.as_ref() else {
            return;
        };
        let mut parts = Vec::new();
        for pair in multi.pairs.iter().filter(|pair| pair.p == node) {
            let (d_rank, p_rank) = (self.decode_rank(pair.d), self.prefill_rank(pair.p));
            let (Ok(export), Ok(key)) = (
                sub_request_id(&keep_id(request), d_rank, p_rank),
                second.key.for_pair(d_rank, p_rank),
            ) else {
                continue;
            };
            parts.push((key, export));
        }
        for (key, export) in parts {
            self.note_turn_read_started(node, &key, &export);
        }
    }

    /// The ids of D rank `node`'s parts of `request`'s keep as its session names them.
    fn turn_part_ids(&self, request: usize, node: NodeId) -> Vec<kvhandoff_protocol::RequestId> {
        let Some(multi) = self.requests[request].multi.as_ref() else {
            return Vec::new();
        };
        multi
            .pairs
            .iter()
            .filter(|pair| pair.d == node)
            .filter_map(|pair| {
                sub_request_id(
                    &keep_id(request),
                    self.decode_rank(pair.d),
                    self.prefill_rank(pair.p),
                )
                .ok()
            })
            .collect()
    }
}
