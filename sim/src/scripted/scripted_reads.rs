//! NIXL reads in the scripted world (pull and bidirectional turns). As for writes, the test
//! decides when each posted read completes or fails, and the measured table decides the rest: a
//! read from a dead holder fails, a dead reader's reads vanish, a post without the holder's
//! metadata is refused, and a read left pending fails at its `max_write_life`.
//!
//! The ghost checks both ends of every read: the holder must not hand its blocks back while a
//! read of them may still run (the data read would be whatever the engine put there next), and
//! the reader must not hand its blocks back while a read may still land in them.

use kvhandoff_protocol::machine::{EndpointEvent, NetEvent, ReadOrder, Time};
use kvhandoff_protocol::{PeerAddr, WriteFailure, WriteId};

use super::{Harness, Landing};
use crate::nixl::measured::{effect, Effect, Happening, POST_WITHOUT_METADATA_IS_REFUSED};

/// A posted read the test has not resolved yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingRead {
    /// The rank that posted it (the reader).
    pub reader: PeerAddr,
    /// Which incarnation of the reader.
    pub incarnation: u32,
    /// The order.
    pub order: ReadOrder,
    /// It has ended by then; if the test has not resolved it, it fails then.
    pub ends_by: Time,
}

impl Harness {
    /// Ids of the pending reads, in order.
    pub fn pending_reads(&self) -> Vec<(PeerAddr, WriteId)> {
        self.reads.keys().cloned().collect()
    }

    /// The one pending read (panics unless exactly one).
    pub fn the_read(&self) -> (PeerAddr, WriteId) {
        let ids = self.pending_reads();
        assert_eq!(ids.len(), 1, "expected exactly one pending read: {ids:?}");
        ids[0].clone()
    }

    /// Completes a read: the holder's data lands in the reader's blocks, and the reader's
    /// transport reports it.
    pub fn complete_read(&mut self, id: &(PeerAddr, WriteId)) {
        let r = self.reads.remove(id).expect("no such pending read");
        self.land_read(&r);
        self.report_read(&r, None);
        self.run_until_quiet();
    }

    /// Completes every pending read, oldest first.
    pub fn complete_reads(&mut self) {
        for id in self.pending_reads() {
            if self.reads.contains_key(&id) {
                self.complete_read(&id);
            }
        }
    }

    /// Fails a read.
    pub fn fail_read(&mut self, id: &(PeerAddr, WriteId)) {
        let r = self.reads.remove(id).expect("no such pending read");
        self.report_read(&r, Some(WriteFailure::TransferFailed));
        self.run_until_quiet();
    }

    pub(super) fn post_read(&mut self, reader: &PeerAddr, order: ReadOrder) {
        self.reads_posted.push((self.now, order.clone()));
        let r = PendingRead {
            reader: reader.clone(),
            incarnation: self.node(reader).incarnation,
            ends_by: self.now + self.node(reader).ep.config().max_write_life,
            order,
        };
        let holder = r.order.from.clone();
        const _: () = assert!(POST_WITHOUT_METADATA_IS_REFUSED);
        if let Some(failure) = self.reject_posts {
            self.report_read(&r, Some(failure));
        } else if self.unloaded.contains(&(reader.clone(), holder.clone())) {
            self.report_read(&r, Some(WriteFailure::PostFailed));
        } else if !self.reaches(reader, &holder) {
            const _: () = assert!(matches!(effect(Happening::TargetDies), Effect::Fails));
            self.report_read(&r, Some(WriteFailure::TransferFailed));
        } else {
            let id = (reader.clone(), r.order.read);
            assert!(self.reads.insert(id, r).is_none(), "read ids are unique");
        }
    }

    pub(super) fn next_read_end(&self) -> Option<Time> {
        self.reads
            .values()
            .filter(|r| !self.is_stalled(&r.reader))
            .map(|r| r.ends_by)
            .min()
    }

    /// Fails every pending read whose bound has come.
    pub(super) fn end_expired_reads(&mut self) {
        let now = self.now;
        let due: Vec<_> = self
            .reads
            .iter()
            .filter(|(_, r)| r.ends_by <= now && !self.is_stalled(&r.reader))
            .map(|(id, _)| id.clone())
            .collect();
        for id in due {
            let r = self.reads.remove(&id).expect("listed above");
            self.report_read(&r, Some(WriteFailure::TransferFailed));
        }
    }

    /// `addr` died: reads from it (as holder) fail, its own reads vanish.
    pub(super) fn reads_of_dead(&mut self, addr: &PeerAddr) {
        let touched: Vec<_> = self
            .reads
            .iter()
            .filter(|(_, r)| &r.reader == addr || &r.order.from == addr)
            .map(|(id, _)| id.clone())
            .collect();
        for id in touched {
            let r = self.reads.remove(&id).expect("listed above");
            if &r.reader != addr {
                self.report_read(&r, Some(WriteFailure::TransferFailed));
            }
        }
    }

    fn report_read(&mut self, r: &PendingRead, failure: Option<WriteFailure>) {
        let node = self.node(&r.reader);
        if !node.alive || node.incarnation != r.incarnation {
            return;
        }
        let write = r.order.read;
        let event = match failure {
            None => NetEvent::WriteCompleted { write },
            Some(failure) => NetEvent::WriteFailed { write, failure },
        };
        self.feed(&r.reader, event);
    }

    /// The holder's blocks land in the reader's: neither side may have handed them back.
    fn land_read(&mut self, r: &PendingRead) {
        let o = &r.order;
        let holder_freed = self.nodes.get(&o.from).is_some_and(|n| {
            n.events
                .iter()
                .any(|(_, e)| matches!(e, EndpointEvent::Export { key, .. } if key == &o.key))
        });
        if holder_freed {
            self.violations.push(format!(
                "at {}: read {} by {} of {} {:?} ({}) completed after the holder handed them back",
                self.now, o.read, r.reader, o.from, o.remote, o.key
            ));
        }
        let reader_freed = self.nodes.get(&r.reader).is_some_and(|n| {
            n.events.iter().any(|(_, e)| {
                matches!(e, EndpointEvent::Import { key, epoch, .. } if key == &o.key && *epoch == o.epoch)
            })
        });
        if reader_freed {
            self.violations.push(format!(
                "at {}: read {} landed in {} blocks {:?} of {} {} after the reader handed them back",
                self.now, o.read, r.reader, o.local, o.key, o.epoch
            ));
        }
        self.read_landings.push(Landing {
            at: self.now,
            from: o.from.clone(),
            to: r.reader.clone(),
            key: o.key.clone(),
            epoch: o.epoch,
            blocks: o.local.clone(),
            late: false,
        });
    }
}
