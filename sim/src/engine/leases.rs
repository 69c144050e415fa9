//! P's push leases as the checker computes them (L5), and the aimed draw that makes a
//! registration meet a lease that ran out while P's process was stopped.
//!
//! A finished prefill's blocks wait for D's registration under a lease of `lease_duration` from
//! the finish, which D's heartbeats (by `lease_extension`) and a layer-wise prefill's layers (by
//! `lease_duration`) renew while it stands. Once it ended, D may have fenced and reused the
//! blocks it registered, so P must not post a write under it (`docs/architecture.md`, "A
//! stalled process": `Held` in the protocol's `prefill.rs` refuses a late registration even
//! when its timer has not run). The checker
//! keeps its own record from what it sees the engine and the network do, not the machine's:
//! every renewal the machine could have made is counted (from any heartbeat naming the key,
//! before the machine judges it), so the record never ends before the machine's lease does and
//! a write the machine was allowed to post never fails L5.
//!
//! Pushed requests register within milliseconds of P's finish, so a registration rarely
//! waits out a lease in a queue: only a few seeds in 300 meet the lease check by chance. The
//! swarm draws worlds (`WorldConfig::late_register`) in which some routers hand D its request
//! about when P's lease ends, and P stops from the registration's arrival until just past that
//! end, shorter than the peer timeout, so that the overdue-peer guard does not refuse it first;
//! the resume hands the queued registration over before the lease's timer runs.

use std::time::Duration;

use kvhandoff_protocol::machine::{Config, Time, WriteOrder};
use kvhandoff_protocol::Message;

use super::Status;
use crate::world::{micros, NetMsg, NodeId, World};

/// The checker's record of one P attempt's lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PLease {
    /// When the prefill finished (the lease began).
    pub finished: Time,
    /// The latest end any renewal the machine may have made gives it.
    pub until: Time,
    /// Renewed at least once.
    pub renewed: bool,
    /// A write of the attempt was posted (its blocks no longer wait under the lease).
    pub posted: bool,
}

/// What P's lease records are keyed by: (P node, its incarnation, request, attempt number).
pub(crate) type LeaseKey = (NodeId, u32, usize, u64);

/// The longest P may stop with a peer's message queued and not find that peer overdue on its
/// resume: D's last heartbeat may have come a heartbeat interval before the stop, plus a few
/// milliseconds of its travel.
pub(crate) fn quiet_stall_budget(m: &Config) -> Duration {
    m.peer_timeout
        .saturating_sub(m.heartbeat_interval + Duration::from_millis(5))
}

impl World {
    /// P attempt `epoch` of `request` finished on `node` now: its lease starts.
    pub(crate) fn lease_started(&mut self, node: NodeId, request: usize, epoch: u64) {
        let inc = self.nodes[node].incarnation;
        let lease = PLease {
            finished: self.now,
            until: self.now + self.cfg.machine.lease_duration,
            renewed: false,
            posted: false,
        };
        self.p_leases.insert((node, inc, request, epoch), lease);
    }

    /// `node` is about to handle a heartbeat naming `keys`: each lease of those keys' requests
    /// on `node` that still stands may be renewed by it (counted before the machine runs, and
    /// whether or not the machine takes it, so the record only errs late).
    pub(crate) fn lease_heartbeat(&mut self, node: NodeId, message: &Message) {
        let Message::Heartbeat(heartbeat) = message else {
            return;
        };
        let requests: Vec<usize> = heartbeat
            .leases
            .iter()
            .filter_map(|lease| self.keys.get(&lease.key).copied())
            .collect();
        let extension = self.cfg.machine.lease_extension;
        for request in requests {
            self.renew_leases(node, |key| key.2 == request, extension);
        }
    }

    /// P's engine is about to report layers of attempt `epoch` of `request` on node 0: a
    /// layer-wise prefill's lease runs from its latest layer.
    pub(crate) fn lease_layers(&mut self, request: usize, epoch: u64) {
        let duration = self.cfg.machine.lease_duration;
        self.renew_leases(0, |key| key.2 == request && key.3 == epoch, duration);
    }

    fn renew_leases(&mut self, node: NodeId, of: impl Fn(&LeaseKey) -> bool, by: Duration) {
        let (now, inc) = (self.now, self.nodes[node].incarnation);
        for (key, lease) in self.p_leases.iter_mut() {
            if key.0 == node && key.1 == inc && of(key) && now < lease.until {
                lease.until = lease.until.max(now + by);
                lease.renewed = true;
            }
        }
    }

    /// L5: `node`'s machine posts `order` now; the attempt whose blocks it reads must still be
    /// under its lease.
    pub(crate) fn check_lease_at_post(&mut self, node: NodeId, order: &WriteOrder) {
        let first = order.local.groups.iter().flatten().next().copied();
        let owner = first.and_then(|b| self.nodes[node].pool.state(b).and_then(|s| s.owner));
        let Some(owner) = owner else {
            // S2 judges a write of blocks P does not hold.
            return;
        };
        let key = (
            node,
            self.nodes[node].incarnation,
            owner.request,
            owner.epoch,
        );
        let now = self.now;
        let Some(lease) = self.p_leases.get_mut(&key) else {
            return;
        };
        lease.posted = true;
        if now >= lease.until {
            let lease = *lease;
            self.violate(format!(
                "L5: node {node} posted write {} of {} at {now}, after its lease ended at {} \
                 (finished at {}, {})",
                order.write,
                order.key,
                lease.until,
                lease.finished,
                if lease.renewed {
                    "renewed"
                } else {
                    "never renewed"
                }
            ));
        }
    }

    /// The lease of `request`'s live P attempt on `node` if no write was posted under it yet:
    /// its key and its end.
    fn waiting_lease(&self, node: NodeId, request: usize) -> Option<(LeaseKey, Time)> {
        let inc = self.nodes[node].incarnation;
        self.requests[request]
            .p
            .iter()
            .filter(|a| a.node == node)
            .filter(|a| matches!(a.status, Status::Live { node_inc, .. } if node_inc == inc))
            .find_map(|a| {
                let key = (node, inc, request, a.epoch);
                let lease = self.p_leases.get(&key)?;
                (!lease.posted).then_some((key, lease.until))
            })
    }

    /// Before `msg` is handled: if it is a registration that reaches a lease already ended, the
    /// lease's key and the count of refusals so far (for [`World::note_register_past_lease`]).
    pub(crate) fn register_past_lease(&self, msg: &NetMsg) -> Option<(LeaseKey, u64)> {
        let Message::Register(register) = &msg.message else {
            return None;
        };
        if !self.is_prefill(msg.to) {
            return None;
        }
        let &request = self.keys.get(&register.key)?;
        let (key, until) = self.waiting_lease(msg.to, request)?;
        (self.now >= until).then(|| (key, self.expired_leases_refused(msg.to)))
    }

    /// After a registration that reached an ended lease was handled: the machine's lease check
    /// was asked (it refused, or under `write_on_expired_lease` posted the write) unless the
    /// overdue-peer guard refused the sender first.
    pub(crate) fn note_register_past_lease(
        &mut self,
        node: NodeId,
        (key, refused): (LeaseKey, u64),
    ) {
        let posted = self.p_leases.get(&key).is_some_and(|l| l.posted);
        if posted || self.expired_leases_refused(node) > refused {
            self.mark("register_after_lease_end");
        }
    }

    fn expired_leases_refused(&self, node: NodeId) -> u64 {
        self.nodes[node]
            .endpoint()
            .map_or(0, |e| e.counters().expired_leases_refused)
    }

    /// The aimed stall: a registration of a request whose D the router handed it late reaches
    /// P before P's lease ends; P stops now, until just past the end, if that is short enough
    /// for D to look alive on the resume. The resume hands the registration over first where
    /// this world's shell may do so (`stall_messages_first`): with the timers first, the
    /// lease's timer releases the blocks and the registration finds nothing to write.
    pub(crate) fn maybe_stall_at_lease_end(&mut self, msg: &NetMsg) {
        let node = msg.to;
        let Message::Register(register) = &msg.message else {
            return;
        };
        if self.cfg.late_register <= 0.0
            || !self.cfg.may_stall()
            || !self.faulty()
            || !self.is_prefill(node)
            || !self.alive(node)
            || self.stalled(node)
        {
            return;
        }
        let Some(&request) = self.keys.get(&register.key) else {
            return;
        };
        if !self.late_registers.contains(&request) {
            return;
        }
        let Some((_, until)) = self.waiting_lease(node, request) else {
            return;
        };
        if self.now >= until {
            return;
        }
        let budget = quiet_stall_budget(&self.cfg.machine);
        let past = micros(
            &mut self.rng,
            1_000,
            (budget.as_micros() as u64 / 5).max(1_000),
        );
        let length = until.saturating_since(self.now) + past;
        if length > budget {
            return;
        }
        self.late_registers.remove(&request);
        self.stall(node, length, false, self.cfg.stall_messages_first > 0.0);
        self.heal = self
            .heal
            .max(self.now + length + Duration::from_millis(200));
    }
}
