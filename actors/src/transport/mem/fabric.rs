//! The fabric's engine: checking and queueing posts, landing due transfers, delivering
//! notifications. Everything here runs under the fabric's one lock.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, MutexGuard};
use std::time::Instant;

use kvhandoff_protocol::AgentName;

use super::{
    AddrRange, AgentState, Completion, Descriptor, Done, Fabric, Fate, Op, Peer, TransportError,
    Xfer,
};
use kvhandoff_protocol::{PeerAddr, WriteId};

/// Releases the fabric's lock, then calls the arrival hooks the locked work collected (a hook
/// may do anything but touch the fabric while it is locked).
pub(super) fn unlock_and_announce(mut fab: MutexGuard<'_, Fabric>) {
    let hooks = std::mem::take(&mut fab.arrivals);
    drop(fab);
    for hook in hooks {
        hook();
    }
}

/// Whether `[addr, addr + len)` lies inside one of `regions` (base -> len).
fn within(regions: &BTreeMap<u64, u64>, addr: u64, len: u64) -> bool {
    regions
        .range(..=addr)
        .next_back()
        .is_some_and(|(&base, &rlen)| AddrRange { base, len: rlen }.contains(addr, len))
}

impl Fabric {
    pub(super) fn me(&self, name: &AgentName, incarnation: u64) -> &AgentState {
        let agent = self
            .agents
            .get(name)
            .expect("invariant: a live transport's agent exists");
        assert!(
            agent.is(incarnation),
            "invariant: a live transport's agent is alive"
        );
        agent
    }

    pub(super) fn me_mut(&mut self, name: &AgentName, incarnation: u64) -> &mut AgentState {
        let agent = self
            .agents
            .get_mut(name)
            .expect("invariant: a live transport's agent exists");
        assert!(
            agent.is(incarnation),
            "invariant: a live transport's agent is alive"
        );
        agent
    }

    /// Whether `[addr, addr + len)` lies inside one region registered by this incarnation.
    fn local_within(&self, name: &AgentName, incarnation: u64, addr: u64, len: u64) -> bool {
        self.regions
            .range(..=addr)
            .next_back()
            .is_some_and(|(&base, r)| {
                r.registered
                    && &r.owner == name
                    && r.incarnation == incarnation
                    && AddrRange { base, len: r.len }.contains(addr, len)
            })
    }

    /// Checks and queues a transfer; `Ok(true)` when it is due at once.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn post(
        &mut self,
        name: &AgentName,
        incarnation: u64,
        op: Op,
        write: WriteId,
        peer: &PeerAddr,
        descriptors: &[Descriptor],
        notification: Option<Vec<u8>>,
    ) -> Result<bool, TransportError> {
        let limits = &self.limits;
        if let Some(n) = &notification {
            if n.len() > limits.max_notification_len {
                return Err(TransportError::NotificationTooLarge {
                    len: n.len(),
                    limit: limits.max_notification_len,
                });
            }
        }
        if descriptors.is_empty() {
            return Err(TransportError::NoDescriptors);
        }
        if descriptors.len() > limits.max_descriptors {
            return Err(TransportError::TooManyDescriptors {
                count: descriptors.len(),
                limit: limits.max_descriptors,
            });
        }
        let max_in_flight = limits.max_in_flight;
        let me = self.me(name, incarnation);
        let pending = me.in_flight.iter().any(|x| x.id == write)
            || me.done.iter().any(|d| d.completion.write == write);
        if pending {
            return Err(TransportError::DuplicateWrite { write });
        }
        if me.in_flight.len() + me.done.len() >= max_in_flight {
            return Err(TransportError::TooManyInFlight {
                limit: max_in_flight,
            });
        }
        let md = match me.peers.get(peer) {
            None => return Err(TransportError::UnknownPeer { peer: peer.clone() }),
            Some(Peer::Invalidated) => {
                return Err(TransportError::PeerInvalidated { peer: peer.clone() })
            }
            Some(Peer::Loaded(md)) => md,
        };
        for (index, d) in descriptors.iter().enumerate() {
            if d.len == 0 {
                return Err(TransportError::EmptyDescriptor { index });
            }
            if !self.local_within(name, incarnation, d.local_addr, d.len) {
                return Err(TransportError::LocalOutOfRange {
                    index,
                    addr: d.local_addr,
                    len: d.len,
                });
            }
            if !within(&md.regions, d.remote_addr, d.len) {
                return Err(TransportError::RemoteOutOfRange {
                    index,
                    addr: d.remote_addr,
                    len: d.len,
                });
            }
        }
        let (target, target_incarnation) = (md.agent.clone(), md.incarnation);
        let me = self.me_mut(name, incarnation);
        let faults = &mut me.faults;
        if faults.fail_next_posts > 0 {
            faults.fail_next_posts -= 1;
            return Err(TransportError::PostFailed {
                reason: "injected post failure".into(),
            });
        }
        let fate = if faults.fail_next_transfers > 0 {
            faults.fail_next_transfers -= 1;
            Fate::Fail
        } else if faults.partial_next_transfers > 0 {
            faults.partial_next_transfers -= 1;
            Fate::Partial
        } else if faults.hang_next_transfers > 0 {
            faults.hang_next_transfers -= 1;
            Fate::Hang
        } else if faults.corrupt_next_transfers > 0 {
            faults.corrupt_next_transfers -= 1;
            Fate::Corrupt
        } else {
            Fate::Land
        };
        let due_time = (!faults.land_after.is_zero()).then(|| Instant::now() + faults.land_after);
        let land_now = faults.land_after_polls == 0;
        let due_poll = me.polls + u64::from(faults.land_after_polls);
        me.in_flight.push_back(Xfer {
            id: write,
            op,
            peer: peer.clone(),
            target,
            target_incarnation,
            descriptors: descriptors.to_vec(),
            notification,
            fate,
            due_poll,
            due_time,
        });
        Ok(land_now)
    }

    /// Lands every due transfer of agent `name` (only `only`, if given), in post order.
    pub(super) fn progress(&mut self, name: &AgentName, incarnation: u64, only: Option<WriteId>) {
        let pending = std::mem::take(&mut self.me_mut(name, incarnation).in_flight);
        let mut keep = VecDeque::with_capacity(pending.len());
        let mut now = None;
        for xfer in pending {
            let chosen = only.is_none_or(|id| id == xfer.id);
            if chosen && self.due(name, incarnation, &xfer, &mut now) {
                self.finish(name, incarnation, xfer);
            } else {
                keep.push_back(xfer);
            }
        }
        self.me_mut(name, incarnation).in_flight = keep;
    }

    /// Whether a pending transfer finishes now.
    fn due(&self, name: &AgentName, incarnation: u64, x: &Xfer, now: &mut Option<Instant>) -> bool {
        let me = self.me(name, incarnation);
        if me.faults.stall || x.fate == Fate::Hang || me.polls < x.due_poll {
            return false;
        }
        if let Some(due) = x.due_time {
            if *now.get_or_insert_with(Instant::now) < due {
                return false;
            }
        }
        // A notification that will be delivered needs room in the target's queue: wait for it.
        let delivers = x.fate == Fate::Land && me.faults.drop_next_notifications == 0;
        match (&x.notification, self.agents.get(&x.target)) {
            (Some(n), Some(target)) if delivers && target.is(x.target_incarnation) => {
                self.inbox_has_room(target, n.len())
            }
            _ => true,
        }
    }

    fn inbox_has_room(&self, target: &AgentState, len: usize) -> bool {
        target.inbox.len() < self.limits.max_inbox
            && target.inbox_bytes.saturating_add(len) <= self.limits.max_inbox_bytes
    }

    /// Finishes a due transfer: copies its bytes, delivers its notification, queues its
    /// completion.
    fn finish(&mut self, name: &AgentName, incarnation: u64, x: Xfer) {
        let reachable = self
            .agents
            .get(&x.target)
            .is_some_and(|t| t.is(x.target_incarnation));
        let total: u64 = x.descriptors.iter().map(|d| d.len).sum();
        let (result, copied) = match x.fate {
            Fate::Hang => unreachable!("a hung transfer is never due"),
            Fate::Fail => (Err(failed("injected transfer failure")), 0),
            Fate::Land | Fate::Partial | Fate::Corrupt if !reachable => (
                Err(TransportError::PeerUnreachable {
                    agent: x.target.clone(),
                }),
                0,
            ),
            Fate::Partial => {
                let copied = self.copy(&x, total / 2);
                let why = format!("injected partial transfer: {copied} of {total} bytes landed");
                (Err(failed(&why)), copied)
            }
            Fate::Land | Fate::Corrupt => {
                let copied = self.copy(&x, total);
                if x.fate == Fate::Corrupt {
                    self.corrupt_one_byte(&x);
                }
                if let Some(bytes) = x.notification {
                    self.deliver(name, incarnation, &x.target, bytes);
                }
                (Ok(()), copied)
            }
        };
        let me = self.me_mut(name, incarnation);
        me.stats.bytes_landed += copied;
        if result.is_ok() {
            me.stats.landed += 1;
        } else {
            me.stats.failed += 1;
        }
        me.done.push_back(Done {
            report_at: me.polls + u64::from(me.faults.completion_lag_polls),
            completion: Completion {
                write: x.id,
                result,
            },
        });
    }

    /// Flips every bit of the middle byte of a landed transfer's first descriptor, at its
    /// destination (the corruption fault: the bytes moved, one of them wrong).
    fn corrupt_one_byte(&mut self, x: &Xfer) {
        let Some(d) = x.descriptors.first() else {
            return;
        };
        let dst = match x.op {
            Op::Write => d.remote_addr,
            Op::Read => d.local_addr,
        };
        let Some((base, at)) = self.span(dst + d.len / 2, 1) else {
            return;
        };
        if let Some(region) = self.regions.get_mut(&base) {
            let mut byte = [0u8];
            region.read_at(at, &mut byte);
            region.write_at(at, &[!byte[0]]);
        }
    }

    /// Copies up to `budget` bytes of a transfer, in descriptor order; returns the bytes copied.
    fn copy(&mut self, x: &Xfer, budget: u64) -> u64 {
        let mut left = budget;
        for d in &x.descriptors {
            if left == 0 {
                break;
            }
            let len = d.len.min(left);
            let (src, dst) = match x.op {
                Op::Write => (d.local_addr, d.remote_addr),
                Op::Read => (d.remote_addr, d.local_addr),
            };
            let mut data = std::mem::take(&mut self.scratch);
            data.clear();
            data.resize(len as usize, 0);
            let moved = self
                .span(src, len)
                .map(|(base, at)| self.regions[&base].read_at(at, &mut data))
                .and_then(|()| self.span(dst, len))
                .and_then(|(base, at)| {
                    let region = self.regions.get_mut(&base)?;
                    region.write_at(at, &data);
                    Some(())
                })
                .is_some();
            self.scratch = data;
            if !moved {
                // Memory released under the transfer (not reachable while both agents live).
                break;
            }
            left -= len;
        }
        budget - left
    }

    /// The region holding `[addr, addr + len)` (which posting proved lies inside one) and the
    /// span's offset in it; `None` if that region's adopted memory is gone.
    pub(super) fn span(&self, addr: u64, len: u64) -> Option<(u64, usize)> {
        let (&base, region) = self.regions.range(..=addr).next_back()?;
        let inside = AddrRange {
            base,
            len: region.len,
        }
        .contains(addr, len);
        (inside && region.is_live()).then_some((base, usize::try_from(addr - base).ok()?))
    }

    /// Puts a notification from agent `name` in `target`'s queue, unless the drop fault eats it.
    /// The caller checked that the target is reachable and has room.
    fn deliver(&mut self, name: &AgentName, incarnation: u64, target: &AgentName, bytes: Vec<u8>) {
        let me = self.me_mut(name, incarnation);
        if me.faults.drop_next_notifications > 0 {
            me.faults.drop_next_notifications -= 1;
            me.stats.notifications_dropped += 1;
            return;
        }
        me.stats.notifications_sent += 1;
        let target = self
            .agents
            .get_mut(target)
            .expect("invariant: the caller checked the target");
        target.inbox_bytes += bytes.len();
        target.inbox.push_back((name.clone(), bytes));
        target.stats.notifications_received += 1;
        if target.inbox.len() == 1 {
            // The first since the target last polled: tell it (once the lock is released).
            if let Some(hook) = &target.arrival_hook {
                self.arrivals.push(Arc::clone(hook));
            }
        }
    }

    pub(super) fn notify(
        &mut self,
        name: &AgentName,
        incarnation: u64,
        peer: &PeerAddr,
        bytes: Vec<u8>,
    ) -> Result<(), TransportError> {
        if bytes.len() > self.limits.max_notification_len {
            return Err(TransportError::NotificationTooLarge {
                len: bytes.len(),
                limit: self.limits.max_notification_len,
            });
        }
        let md = match self.me(name, incarnation).peers.get(peer) {
            None => return Err(TransportError::UnknownPeer { peer: peer.clone() }),
            Some(Peer::Invalidated) => {
                return Err(TransportError::PeerInvalidated { peer: peer.clone() })
            }
            Some(Peer::Loaded(md)) => md,
        };
        let target_name = md.agent.clone();
        let target = self
            .agents
            .get(&target_name)
            .filter(|t| t.is(md.incarnation))
            .ok_or_else(|| TransportError::PeerUnreachable {
                agent: target_name.clone(),
            })?;
        let dropping = self.me(name, incarnation).faults.drop_next_notifications > 0;
        if !dropping && !self.inbox_has_room(target, bytes.len()) {
            return Err(TransportError::PeerInboxFull { agent: target_name });
        }
        self.deliver(name, incarnation, &target_name, bytes);
        Ok(())
    }
}

fn failed(reason: &str) -> TransportError {
    TransportError::TransferFailed {
        reason: reason.to_owned(),
    }
}
