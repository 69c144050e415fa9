//! The early failure of a D request fenced by its P's death (`EndpointEvent::DecodeFenced`):
//! what the engine model checks when it hears it, and the promise its final event must keep.
//!
//! The engine model does not act on it beyond the checks: its only way to try a failed request
//! again is a new handoff of the same key (`events.rs`, `retry`), which the endpoint cannot
//! admit while the fenced attempt still holds the key, so the retry waits for the final event.
//! A real engine recomputes the prompt locally at the early event instead.

use kvhandoff_protocol::machine::{DecodeFailure, DecodeOutcome, EndpointEvent, FreeProof};
use kvhandoff_protocol::{Cancel, Incarnation, RequestId};

use super::Status;
use crate::ledger::Owner;
use crate::world::{NodeId, World};

/// A D attempt told fenced from a peer declared dead: the peer's dead incarnation, and whether
/// D sent it a cancel for the attempt since (L4).
#[derive(Debug, Clone)]
pub(crate) struct FencedWatch {
    p: NodeId,
    run: Incarnation,
    asked_again: bool,
}

impl World {
    /// A cancel `from` sends `to`: asks a fenced attempt's peer again, if one is watched.
    pub(crate) fn note_cancel(&mut self, from: NodeId, to: NodeId, cancel: &Cancel) {
        let watched = (from, cancel.key.clone(), cancel.epoch.0);
        if let Some(watch) = self.fenced_watch.get_mut(&watched) {
            if watch.p == to {
                watch.asked_again = true;
            }
        }
    }

    /// L4 (liveness): a D attempt fenced from a peer declared dead and freed by the fence's
    /// time alone must not have had that same incarnation connected again without being asked
    /// for its proof: a false death heals by the peer's answer within a round trip, not by the
    /// quarantine. Judged at the end, where D is still connected to the incarnation it fenced
    /// the attempt from (it could have asked) and sent it no cancel since the fence.
    pub(super) fn check_rejoined_asked(&mut self, node: NodeId, event: &EndpointEvent) {
        let EndpointEvent::Decode {
            request: id,
            key,
            epoch,
            proof,
            ..
        } = event
        else {
            return;
        };
        let Some(watch) = self.fenced_watch.remove(&(node, key.clone(), epoch.0)) else {
            return;
        };
        if watch.asked_again {
            self.mark("fenced_peer_asked_again");
            return;
        }
        if *proof == FreeProof::DeadPeerFence
            && self.connected_incarnation(node, watch.p) == Some(watch.run)
        {
            self.violate(format!(
                "L4: {id} waited out its fence though the incarnation it was fenced from \
                 ({:?}) is connected again and was never asked",
                watch.run
            ));
        }
    }

    /// F1: the early event names a live attempt of this incarnation, in its epoch, told for the
    /// first time, whose blocks the engine still holds (they stay leased to it until the final
    /// event frees them: a reuse or a double free in between is the pool's violation).
    pub(crate) fn decode_fenced(&mut self, node: NodeId, event: &EndpointEvent) {
        let EndpointEvent::DecodeFenced {
            request: id,
            key,
            epoch,
            failure,
        } = event
        else {
            return;
        };
        let Some(&request) = self.keys.get(key) else {
            self.violate(format!("F1: early event for unknown key {key}"));
            return;
        };
        let Some(ai) = self.requests[request].d.iter().position(|a| &a.id == id) else {
            self.violate(format!("F1: early event for unknown request {id}"));
            return;
        };
        let a = self.requests[request].d[ai].clone();
        let Status::Live {
            node_inc, fenced, ..
        } = a.status
        else {
            self.violate(format!("F1: {id} told fenced while {:?}", a.status));
            return;
        };
        if node_inc != self.nodes[node].incarnation {
            self.violate(format!("F1: early event for {id} from another incarnation"));
            return;
        }
        if let Some(first) = fenced {
            self.violate(format!(
                "F1: {id} told fenced twice ({first:?}, then {failure:?})"
            ));
            return;
        }
        if epoch.0 != a.epoch {
            self.violate(format!(
                "F1: {id} told fenced in epoch {epoch}, allocated in e{}",
                a.epoch
            ));
        }
        let owner = Owner {
            request,
            epoch: a.epoch,
        };
        let pool = &self.nodes[node].pool;
        let lost: Vec<u32> = a
            .blocks
            .iter()
            .copied()
            .filter(|&b| pool.state(b).and_then(|s| s.owner) != Some(owner))
            .collect();
        if !lost.is_empty() {
            self.violate(format!(
                "F1: {id} told fenced, but its blocks {lost:?} are no longer its own"
            ));
        }
        if let Status::Live { fenced, .. } = &mut self.requests[request].d[ai].status {
            *fenced = Some(*failure);
        }
        self.mark("decode_fenced_early");
        let p = a.sub.as_ref().map_or(0, |sub| sub.peer);
        let peer = self.nodes[p].addr.clone();
        if let Some(run) = self.nodes[node]
            .endpoint()
            .and_then(|e| e.fenced_run(&peer))
        {
            let watch = FencedWatch {
                p,
                run,
                asked_again: false,
            };
            self.fenced_watch
                .insert((node, key.clone(), a.epoch), watch);
        }
        // No trace line of its own: a world without multi-rank requests replays exactly as it
        // did before the early event existed (its trace hash is pinned in
        // `sim/tests/multi_source.rs`), which shows the event changes nothing it does. A
        // sub-request's reaches the engine folded into its request's (`multi/settle.rs`).
    }

    /// F1: the final event of an attempt told fenced is `Failed` with the failure it was told
    /// (an engine that recomputed on the early event must never see the request `Ready`).
    pub(super) fn check_fenced_end(
        &mut self,
        id: &RequestId,
        told: DecodeFailure,
        event: &EndpointEvent,
    ) {
        let outcome = match event {
            EndpointEvent::Decode { outcome, .. } => *outcome,
            EndpointEvent::DecodeFenced { .. }
            | EndpointEvent::Prefill { .. }
            | EndpointEvent::Export { .. }
            | EndpointEvent::Import { .. } => {
                self.violate(format!("F1: {id} told fenced, then ended by {event:?}"));
                return;
            }
        };
        if outcome != DecodeOutcome::Failed(told) {
            self.violate(format!(
                "F1: {id} was told it failed ({told:?}) while fenced, then ended {outcome:?}"
            ));
        }
    }
}
