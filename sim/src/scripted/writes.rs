//! NIXL writes in the scripted world. The test decides when each posted write lands, completes
//! or fails; everything else follows the measured table of `crate::nixl::measured`, as the
//! seeded world does: an abandon or an invalidation does not stop a posted write, a write to a
//! dead target fails, a dead poster's writes vanish, a post without the target's metadata is
//! refused, and a write the test leaves pending has failed by its `max_write_life`.

use kvhandoff_protocol::machine::{EndpointEvent, NetEvent, Time, WriteOrder};
use kvhandoff_protocol::{BlockIds, Epoch, PairingKey, PeerAddr, WriteFailure, WriteId};

use super::{Envelope, Harness};
use crate::nixl::measured::{
    effect, evidence, Effect, Happening, POST_WITHOUT_METADATA_IS_REFUSED,
};

/// A posted write the test has not resolved yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingWrite {
    /// The rank that posted it.
    pub from: PeerAddr,
    /// Which incarnation of that rank (a restart makes a new one).
    pub incarnation: u32,
    /// The order.
    pub order: WriteOrder,
    /// The data has landed (the completion is not reported yet).
    pub landed: bool,
    /// The poster asked to abandon it; NIXL went on with it.
    pub abandoned: bool,
    /// The poster or the target invalidated the other after the post; NIXL went on with it.
    pub outlived_invalidation: bool,
    /// It has ended by then (the fabric's bound, `max_write_life` of the poster): if the test
    /// has not resolved it, it fails then.
    pub ends_by: Time,
}

/// Data that landed in a target's blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Landing {
    /// When.
    pub at: Time,
    /// The rank that wrote.
    pub from: PeerAddr,
    /// Target.
    pub to: PeerAddr,
    /// Pairing key.
    pub key: PairingKey,
    /// Epoch.
    pub epoch: Epoch,
    /// Target blocks written.
    pub blocks: BlockIds,
    /// It landed after an invalidation between the pair or after its poster abandoned it.
    pub late: bool,
}

impl Harness {
    /// Ids of the pending writes, in order.
    pub fn pending_writes(&self) -> Vec<(PeerAddr, WriteId)> {
        self.writes.keys().cloned().collect()
    }

    /// The one pending write (panics unless exactly one).
    pub fn the_write(&self) -> (PeerAddr, WriteId) {
        let ids = self.pending_writes();
        assert_eq!(ids.len(), 1, "expected exactly one pending write: {ids:?}");
        ids[0].clone()
    }

    /// Lands the write's data and its notification, but does not report the completion to the
    /// writer yet.
    pub fn land_write(&mut self, id: &(PeerAddr, WriteId)) {
        let w = self.writes.get_mut(id).expect("no such pending write");
        assert!(!w.landed, "the write already landed");
        w.landed = true;
        let w = w.clone();
        self.land(&w);
        self.run_until_quiet();
    }

    /// Completes a write: its data lands (unless it did), the writer learns, and the
    /// notification goes to the target after the data.
    pub fn complete_write(&mut self, id: &(PeerAddr, WriteId)) {
        let w = self.writes.remove(id).expect("no such pending write");
        if !w.landed {
            self.land(&w);
        }
        self.report(&w, None);
        self.run_until_quiet();
    }

    /// Completes every pending write, oldest first.
    pub fn complete_writes(&mut self) {
        for id in self.pending_writes() {
            if self.writes.contains_key(&id) {
                self.complete_write(&id);
            }
        }
    }

    /// Fails a write that has not landed.
    pub fn fail_write(&mut self, id: &(PeerAddr, WriteId), failure: WriteFailure) {
        let w = self.writes.remove(id).expect("no such pending write");
        assert!(!w.landed, "a landed write cannot fail");
        self.report(&w, Some(failure));
        self.run_until_quiet();
    }

    /// Fails every pending write that has not landed, oldest first; returns how many.
    pub fn fail_writes(&mut self, failure: WriteFailure) -> usize {
        let ids: Vec<_> = self
            .writes
            .iter()
            .filter(|(_, w)| !w.landed)
            .map(|(id, _)| id.clone())
            .collect();
        for id in &ids {
            self.fail_write(id, failure);
        }
        ids.len()
    }

    /// The earliest bound by which a pending write has ended.
    pub(super) fn next_write_end(&self) -> Option<Time> {
        self.writes
            .values()
            .filter(|w| !self.is_stalled(&w.from))
            .map(|w| w.ends_by)
            .min()
    }

    /// Ends every pending write whose bound has come: one the test left unresolved fails then
    /// (a landed one completes).
    pub(super) fn end_expired_writes(&mut self) {
        const _: () = assert!(matches!(effect(Happening::LifeBound), Effect::HasEnded));
        let now = self.now;
        let due: Vec<_> = self
            .writes
            .iter()
            // A stalled poster's write has its life clock stopped (see `Harness::stall`).
            .filter(|(_, w)| w.ends_by <= now && !self.is_stalled(&w.from))
            .map(|(id, _)| id.clone())
            .collect();
        for id in due {
            let w = self.writes.remove(&id).expect("listed above");
            let failure = (!w.landed).then_some(WriteFailure::TransferFailed);
            self.report(&w, failure);
        }
    }

    pub(super) fn post(&mut self, from: &PeerAddr, order: WriteOrder) {
        self.posted.push((self.now, order.clone()));
        let ends_by = self.now + self.node(from).ep.config().max_write_life;
        let w = PendingWrite {
            from: from.clone(),
            incarnation: self.node(from).incarnation,
            order,
            landed: false,
            abandoned: false,
            outlived_invalidation: false,
            ends_by,
        };
        let to = w.order.to.clone();
        let unloaded = self.unloaded.contains(&(from.clone(), to.clone()));
        const _: () = assert!(POST_WITHOUT_METADATA_IS_REFUSED);
        if let Some(failure) = self.reject_posts {
            self.report(&w, Some(failure));
        } else if unloaded {
            self.report(&w, Some(WriteFailure::PostFailed));
        } else if !self.reaches(from, &to) {
            const _: () = assert!(matches!(effect(Happening::TargetDies), Effect::Fails));
            self.report(&w, Some(WriteFailure::TransferFailed));
        } else {
            let id = (from.clone(), w.order.write);
            assert!(
                self.writes.insert(id, w).is_none(),
                "write ids are unique per endpoint"
            );
        }
    }

    /// True if what `from` posts to `to` reaches live memory: `to` is alive and is the
    /// incarnation `from` last shook hands with.
    pub(super) fn reaches(&self, from: &PeerAddr, to: &PeerAddr) -> bool {
        let Some(target) = self.nodes.get(to).filter(|n| n.alive) else {
            return false;
        };
        self.known
            .get(&(from.clone(), to.clone()))
            .is_none_or(|&inc| inc == target.incarnation)
    }

    /// The poster abandons a write: NIXL goes on with it.
    pub(super) fn abandon(&mut self, from: &PeerAddr, write: WriteId) {
        const _: () = assert!(matches!(effect(Happening::PosterAbandons), Effect::GoesOn));
        if let Some(w) = self.writes.get_mut(&(from.clone(), write)) {
            w.abandoned = true;
        }
    }

    /// `by` unloaded `peer`'s metadata: its later posts to `peer` are refused until a new
    /// handshake, but nothing posted between the two stops.
    pub(super) fn invalidated(&mut self, by: &PeerAddr, peer: &PeerAddr) {
        const _: () = assert!(matches!(effect(Happening::Invalidation), Effect::GoesOn));
        self.unloaded.insert((by.clone(), peer.clone()));
        for w in self.writes.values_mut() {
            if (&w.from == by && &w.order.to == peer) || (&w.from == peer && &w.order.to == by) {
                w.outlived_invalidation = true;
            }
        }
    }

    /// `addr`'s process died: writes to it fail (their live posters are told), its own writes
    /// vanish.
    pub(super) fn writes_of_dead(&mut self, addr: &PeerAddr) {
        const _: () = assert!(matches!(effect(Happening::TargetDies), Effect::Fails));
        const _: () = assert!(matches!(effect(Happening::PosterDies), Effect::Vanishes));
        let touched: Vec<_> = self
            .writes
            .iter()
            .filter(|(_, w)| &w.from == addr || &w.order.to == addr)
            .map(|(id, _)| id.clone())
            .collect();
        for id in touched {
            let w = self.writes.remove(&id).expect("listed above");
            if &w.from != addr {
                let failure = (!w.landed).then_some(WriteFailure::TransferFailed);
                self.report(&w, failure);
            }
        }
    }

    /// Tells the writer how its write ended (if it is still the incarnation that posted it).
    pub(super) fn report(&mut self, w: &PendingWrite, failure: Option<WriteFailure>) {
        let node = self.node(&w.from);
        if !node.alive || node.incarnation != w.incarnation {
            return;
        }
        let write = w.order.write;
        let input = match failure {
            None => NetEvent::WriteCompleted { write },
            Some(failure) => NetEvent::WriteFailed { write, failure },
        };
        self.feed(&w.from, input);
    }

    /// The data lands in the target's blocks, then the notification follows it.
    fn land(&mut self, w: &PendingWrite) {
        let o = &w.order;
        if let Some(target) = self.nodes.get(&o.to) {
            let used = target.events.iter().any(|(_, e)| {
                matches!(e, EndpointEvent::Decode { key, epoch, .. } if key == &o.key && *epoch == o.epoch)
            });
            if used {
                // Say why the write could still land, so the scenario's reader need not guess.
                let why = if w.outlived_invalidation {
                    format!(
                        " (it outlived an invalidation: {})",
                        evidence(Happening::Invalidation)
                    )
                } else if w.abandoned {
                    format!(
                        " (it outlived its abandon: {})",
                        evidence(Happening::PosterAbandons)
                    )
                } else {
                    String::new()
                };
                self.violations.push(format!(
                    "at {}: write {} from {} landed in {} blocks {:?} of {} {} after D handed them back{why}",
                    self.now, o.write, w.from, o.to, o.remote, o.key, o.epoch
                ));
            }
        }
        self.landings.push(Landing {
            at: self.now,
            from: w.from.clone(),
            to: o.to.clone(),
            key: o.key.clone(),
            epoch: o.epoch,
            blocks: o.remote.clone(),
            late: w.abandoned || w.outlived_invalidation,
        });
        let env = Envelope {
            from: w.from.clone(),
            to: o.to.clone(),
            message: o.notification.clone(),
        };
        self.enqueue(env);
    }
}
