//! What the world reports about its requests: the machines' counters summed over incarnations,
//! what keeps a world from being quiescent, and who holds each leaked block.

use kvhandoff_protocol::machine::Endpoint;

use super::Status;
use crate::world::World;

impl World {
    pub(crate) fn absorb_counters(&mut self, endpoint: &Endpoint) {
        let c = endpoint.counters();
        self.counters.decode_registered_first += c.decode_registered_first;
        self.counters.prefill_finished_first += c.prefill_finished_first;
        self.counters.quarantine_frees += c.quarantine_frees;
        self.counters.peers_declared_dead += c.peers_declared_dead;
        self.counters.peer_restarts += c.peer_restarts;
        self.counters.repeated_handshakes += c.repeated_handshakes;
        self.counters.writes_abandoned += c.writes_abandoned;
        self.counters.cancel_resends += c.cancel_resends;
        self.counters.register_resends += c.register_resends;
        self.counters.register_resends_skipped += c.register_resends_skipped;
        self.counters.reads_asked_again += c.reads_asked_again;
        self.counters.stale_settles_ignored += c.stale_settles_ignored;
        self.counters.fence_frees += c.fence_frees;
        self.counters.decodes_fenced += c.decodes_fenced;
        self.counters.cancels_unanswered += c.cancels_unanswered;
        self.counters.stuck_writes += c.stuck_writes;
        self.counters.reads_granted += c.reads_granted;
        self.counters.reads_declined_near_expiry += c.reads_declined_near_expiry;
        self.counters.exports_renewed += c.exports_renewed;
        self.counters.grant_fence_frees += c.grant_fence_frees;
        self.counters.reads_posted += c.reads_posted;
        self.counters.reads_failed += c.reads_failed;
        self.counters.stale_messages_refused += c.stale_messages_refused;
        self.counters.expired_leases_refused += c.expired_leases_refused;
        self.counters.stale_grants_refused += c.stale_grants_refused;
        self.counters.late_reads_distrusted += c.late_reads_distrusted;
        self.tombstones_evicted += endpoint.tombstones_evicted();
        for (reason, n) in &c.dropped {
            *self.counters.dropped.entry(*reason).or_insert(0) += n;
        }
    }

    /// What keeps the world from being quiescent (for liveness violations).
    pub(crate) fn unfinished(&self) -> String {
        let mut parts = Vec::new();
        for r in &self.requests {
            for a in r.d.iter().chain(&r.p) {
                if matches!(a.status, Status::Pending | Status::Live { .. }) {
                    parts.push(format!("{} {:?}", a.id, a.status));
                }
            }
        }
        for (seq, w) in &self.writes {
            parts.push(format!("write#{seq} {} {:?}", w.id, w.phase));
        }
        for (i, n) in self.nodes.iter().enumerate() {
            match n.endpoint() {
                Some(e) => parts.push(format!(
                    "node{i} leased={} {:?}",
                    n.pool.leased(),
                    e.stats()
                )),
                None => parts.push(format!("node{i} down")),
            }
        }
        parts.join("; ")
    }

    /// Who holds each block still leased: the node, the block, its owner's attempt and where
    /// that attempt is (and, for a live D request, that its machine still has it).
    pub(crate) fn explain_leaks(&self) -> Vec<String> {
        let mut leaks = Vec::new();
        for (n, node) in self.nodes.iter().enumerate() {
            for (block, owner) in node.pool.leased_blocks() {
                let r = &self.requests[owner.request];
                let attempts = if self.is_prefill(n) { &r.p } else { &r.d };
                let attempt = attempts
                    .iter()
                    .find(|a| a.node == n && a.epoch == owner.epoch);
                let held_by = match attempt {
                    Some(a) => {
                        let in_machine = node.endpoint().is_some_and(|e| {
                            e.live_decode_blocks().any(|(id, _)| id == &a.id)
                                || e.live_prefill_requests().any(|id| id == &a.id)
                        });
                        let machine = if in_machine {
                            "its machine still holds the request"
                        } else {
                            "no machine holds the request"
                        };
                        format!("{} ({:?}; {machine})", a.id, a.status)
                    }
                    None => format!("unknown attempt {owner:?}"),
                };
                leaks.push(format!("node {n} ({}) block {block}: {held_by}", node.addr));
            }
        }
        leaks
    }

    /// Every attempt ended, nothing is queued, every table and pool is empty.
    pub(crate) fn quiescent(&self) -> bool {
        let attempts_done = self.requests.iter().all(|r| {
            r.d.iter()
                .chain(&r.p)
                .all(|a| matches!(a.status, Status::Done | Status::Lost | Status::Skipped))
        });
        attempts_done
            && self.writes.is_empty()
            && self.nodes.iter().all(|n| {
                n.pool.leased() == 0
                    && n.endpoint().is_some_and(|e| {
                        let s = e.stats();
                        s.decode_requests
                            + s.prefill_requests
                            + s.pending_registrations
                            + s.writes_in_flight
                            + s.queued_outputs
                            + s.exports
                            + s.imports
                            + s.reads_in_flight
                            == 0
                    })
            })
    }
}
