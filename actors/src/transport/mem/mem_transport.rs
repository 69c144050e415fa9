//! [`MemTransport`]'s own methods and its [`Transport`] implementation: thin wrappers that take
//! the fabric's lock and hand the work to `Fabric`.

use std::collections::VecDeque;

use kvhandoff_protocol::AgentName;

use super::fabric::unlock_and_announce;
use super::metadata::{decode_metadata, encode_metadata};
#[cfg(doc)]
use super::MemLimits;
use super::{
    AddrRange, ArrivalHook, Backing, Completion, Descriptor, Done, MemFabric, MemFaults, MemRegion,
    MemStats, MemTransport, Notification, Op, Peer, Region, RegionMemory, RemoteMd, Transport,
    TransportError, Xfer, PAGE,
};
use kvhandoff_protocol::{PeerAddr, WriteId};

impl MemTransport {
    /// The fabric this agent lives on.
    pub fn fabric(&self) -> &MemFabric {
        &self.fabric
    }

    /// Allocates `len` zeroed bytes of fabric memory owned by this agent (not yet registered).
    ///
    /// # Errors
    /// [`TransportError::BadRegionLen`] for zero bytes or more than the address space holds;
    /// [`TransportError::OutOfMemory`] above [`MemLimits::max_fabric_bytes`].
    pub fn alloc_region(&mut self, len: u64) -> Result<MemRegion, TransportError> {
        let mut fab = self.fabric.lock();
        if len == 0 || usize::try_from(len).is_err() {
            return Err(TransportError::BadRegionLen { len });
        }
        let available = fab.limits.max_fabric_bytes.saturating_sub(fab.allocated);
        if len > available {
            return Err(TransportError::OutOfMemory {
                requested: len,
                available,
            });
        }
        let base = fab.next_addr;
        let next = base
            .checked_add(len)
            .and_then(|end| end.checked_next_multiple_of(PAGE))
            .and_then(|end| end.checked_add(PAGE))
            .ok_or(TransportError::BadRegionLen { len })?;
        let bytes = vec![0u8; len as usize];
        fab.next_addr = next;
        fab.allocated += len;
        fab.regions.insert(
            base,
            Region {
                owner: self.name.clone(),
                incarnation: self.incarnation,
                registered: false,
                len,
                bytes: Backing::Fabric(bytes),
            },
        );
        Ok(MemRegion {
            fabric: self.fabric.clone(),
            base,
            len,
        })
    }

    /// Makes `memory`, which the engine allocated, a region of this agent (not yet
    /// registered), without copying it: transfers and the returned [`MemRegion`] read and write
    /// it in place. The fabric drops `memory` when this agent dies (the transport is dropped);
    /// the region's handles then fail ([`TransportError::ForeignRegion`]). It does not count
    /// against [`MemLimits::max_fabric_bytes`].
    ///
    /// # Errors
    /// [`TransportError::BadRegionLen`] for zero bytes or more than the address space holds.
    pub fn adopt_region(
        &mut self,
        memory: Box<dyn RegionMemory>,
    ) -> Result<MemRegion, TransportError> {
        let len = memory.len() as u64;
        let mut fab = self.fabric.lock();
        if len == 0 {
            return Err(TransportError::BadRegionLen { len });
        }
        let base = fab.next_addr;
        let next = base
            .checked_add(len)
            .and_then(|end| end.checked_next_multiple_of(PAGE))
            .and_then(|end| end.checked_add(PAGE))
            .ok_or(TransportError::BadRegionLen { len })?;
        fab.next_addr = next;
        fab.regions.insert(
            base,
            Region {
                owner: self.name.clone(),
                incarnation: self.incarnation,
                registered: false,
                len,
                bytes: Backing::Engine(memory),
            },
        );
        Ok(MemRegion {
            fabric: self.fabric.clone(),
            base,
            len,
        })
    }

    /// This agent's fault switches.
    pub fn faults(&self) -> MemFaults {
        self.fabric
            .lock()
            .me(&self.name, self.incarnation)
            .faults
            .clone()
    }

    /// Replaces this agent's fault switches.
    pub fn set_faults(&mut self, faults: MemFaults) {
        self.update_faults(|f| *f = faults);
    }

    /// Changes this agent's fault switches in place, e.g. `t.update_faults(|f| f.stall = true)`.
    pub fn update_faults(&mut self, change: impl FnOnce(&mut MemFaults)) {
        let mut fab = self.fabric.lock();
        change(&mut fab.me_mut(&self.name, self.incarnation).faults);
    }

    /// This agent's counters.
    pub fn stats(&self) -> MemStats {
        self.fabric
            .lock()
            .me(&self.name, self.incarnation)
            .stats
            .clone()
    }

    fn post(
        &mut self,
        op: Op,
        write: WriteId,
        peer: &PeerAddr,
        descriptors: &[Descriptor],
        notification: Option<Vec<u8>>,
    ) -> Result<(), TransportError> {
        let mut guard = self.fabric.lock();
        let fab = &mut *guard;
        let result = fab.post(
            &self.name,
            self.incarnation,
            op,
            write,
            peer,
            descriptors,
            notification,
        );
        let me = fab.me_mut(&self.name, self.incarnation);
        let result = match result {
            Ok(land_now) => {
                me.stats.posted += 1;
                if land_now {
                    fab.progress(&self.name, self.incarnation, Some(write));
                }
                Ok(())
            }
            Err(err) => {
                me.stats.post_errors += 1;
                Err(err)
            }
        };
        unlock_and_announce(guard);
        result
    }
}

impl Transport for MemTransport {
    type Region = MemRegion;

    fn agent_name(&self) -> &AgentName {
        &self.name
    }

    fn register_region(&mut self, region: &MemRegion) -> Result<AddrRange, TransportError> {
        let foreign = TransportError::ForeignRegion { base: region.base };
        if !self.fabric.same(&region.fabric) {
            return Err(foreign);
        }
        let mut guard = self.fabric.lock();
        let fab = &mut *guard;
        let limit = fab.limits.max_regions;
        let me = fab
            .agents
            .get_mut(&self.name)
            .expect("invariant: a live transport's agent exists");
        let r = fab
            .regions
            .get_mut(&region.base)
            .expect("invariant: fabric regions are never freed");
        if r.owner != self.name || r.incarnation != self.incarnation {
            return Err(foreign);
        }
        if r.registered {
            return Err(TransportError::AlreadyRegistered { base: region.base });
        }
        if me.registered >= limit {
            return Err(TransportError::TooManyRegions { limit });
        }
        r.registered = true;
        me.registered += 1;
        Ok(region.range())
    }

    fn read_local(&self, addr: u64, len: u64, out: &mut Vec<u8>) -> Result<(), TransportError> {
        let fab = self.fabric.lock();
        let out_of_range = TransportError::LocalOutOfRange {
            index: 0,
            addr,
            len,
        };
        let Some((base, at)) = fab.span(addr, len) else {
            return Err(out_of_range);
        };
        let region = &fab.regions[&base];
        if !region.registered || region.owner != self.name || region.incarnation != self.incarnation
        {
            return Err(out_of_range);
        }
        // `span` proved the bytes lie inside the region's memory, so `len` fits in `usize`.
        let start = out.len();
        out.resize(start + len as usize, 0);
        region.read_at(at, &mut out[start..]);
        Ok(())
    }

    fn local_metadata(&self) -> Result<Vec<u8>, TransportError> {
        let fab = self.fabric.lock();
        let regions: Vec<AddrRange> = fab
            .regions
            .iter()
            .filter(|(_, r)| {
                r.registered && r.owner == self.name && r.incarnation == self.incarnation
            })
            .map(|(&base, r)| AddrRange { base, len: r.len })
            .collect();
        Ok(encode_metadata(
            fab.id,
            &self.name,
            self.incarnation,
            &regions,
        ))
    }

    fn load_remote(
        &mut self,
        peer: &PeerAddr,
        agent: &AgentName,
        metadata: &[u8],
    ) -> Result<(), TransportError> {
        let mut guard = self.fabric.lock();
        let fab = &mut *guard;
        let md = decode_metadata(metadata, fab.limits.max_regions)?;
        if md.fabric != fab.id {
            return Err(TransportError::BadMetadata {
                why: "it comes from another fabric",
            });
        }
        if &md.agent != agent {
            return Err(TransportError::MetadataMismatch {
                expected: agent.clone(),
                found: md.agent,
            });
        }
        for range in &md.regions {
            let genuine = fab.regions.get(&range.base).is_some_and(|r| {
                r.registered
                    && r.owner == md.agent
                    && r.incarnation == md.incarnation
                    && r.len == range.len
            });
            if !genuine {
                return Err(TransportError::BadMetadata {
                    why: "it names memory its agent did not register",
                });
            }
        }
        let max_peers = fab.limits.max_peers;
        let me = fab.me_mut(&self.name, self.incarnation);
        let conflict = || TransportError::LoadConflict {
            peer: peer.clone(),
            agent: agent.clone(),
        };
        let already_loaded = match me.peers.get(peer) {
            Some(Peer::Loaded(old)) if &old.agent != agent => return Err(conflict()),
            Some(Peer::Loaded(_)) => true,
            Some(Peer::Invalidated) | None => false,
        };
        if me.by_agent.get(agent).is_some_and(|p| p != peer) {
            return Err(conflict());
        }
        if !already_loaded && me.by_agent.len() >= max_peers {
            return Err(TransportError::TooManyPeers { limit: max_peers });
        }
        me.tombstones.retain(|p| p != peer);
        me.by_agent.insert(agent.clone(), peer.clone());
        let regions = md.regions.iter().map(|r| (r.base, r.len)).collect();
        me.peers.insert(
            peer.clone(),
            Peer::Loaded(RemoteMd {
                agent: md.agent,
                incarnation: md.incarnation,
                regions,
            }),
        );
        Ok(())
    }

    fn invalidate_remote(&mut self, peer: &PeerAddr) {
        let mut guard = self.fabric.lock();
        let fab = &mut *guard;
        let max_peers = fab.limits.max_peers;
        let me = fab.me_mut(&self.name, self.incarnation);
        if let Some(Peer::Loaded(md)) = me.peers.insert(peer.clone(), Peer::Invalidated) {
            me.by_agent.remove(&md.agent);
        }
        if !me.tombstones.contains(peer) {
            me.tombstones.push_back(peer.clone());
        }
        while me.tombstones.len() > max_peers {
            if let Some(old) = me.tombstones.pop_front() {
                me.peers.remove(&old);
            }
        }
        let (dead, alive): (VecDeque<Xfer>, VecDeque<Xfer>) =
            me.in_flight.drain(..).partition(|x| &x.peer == peer);
        me.in_flight = alive;
        for xfer in dead {
            me.stats.invalidated += 1;
            me.done.push_back(Done {
                report_at: me.polls,
                completion: Completion {
                    write: xfer.id,
                    result: Err(TransportError::PeerInvalidated { peer: peer.clone() }),
                },
            });
        }
    }

    fn post_write(
        &mut self,
        write: WriteId,
        peer: &PeerAddr,
        descriptors: &[Descriptor],
        notification: Option<Vec<u8>>,
    ) -> Result<(), TransportError> {
        self.post(Op::Write, write, peer, descriptors, notification)
    }

    fn post_read(
        &mut self,
        write: WriteId,
        peer: &PeerAddr,
        descriptors: &[Descriptor],
        notification: Option<Vec<u8>>,
    ) -> Result<(), TransportError> {
        self.post(Op::Read, write, peer, descriptors, notification)
    }

    fn abandon_write(&mut self, write: WriteId) -> Result<(), TransportError> {
        let mut fab = self.fabric.lock();
        let me = fab.me_mut(&self.name, self.incarnation);
        if me.done.iter().any(|d| d.completion.write == write) {
            // Finished already (landed, failed or abandoned): its one completion is queued.
            return Ok(());
        }
        let Some(at) = me.in_flight.iter().position(|x| x.id == write) else {
            return Err(TransportError::UnknownWrite { write });
        };
        if me.faults.refuse_abandon {
            return Err(TransportError::AbandonRefused { write });
        }
        me.in_flight.remove(at);
        me.stats.abandoned += 1;
        me.done.push_back(Done {
            report_at: me.polls,
            completion: Completion {
                write,
                result: Err(TransportError::Abandoned),
            },
        });
        Ok(())
    }

    fn poll_completions(&mut self, out: &mut Vec<Completion>) {
        let mut guard = self.fabric.lock();
        let fab = &mut *guard;
        let me = fab.me_mut(&self.name, self.incarnation);
        me.polls += 1;
        me.stats.polls += 1;
        fab.progress(&self.name, self.incarnation, None);
        let me = fab.me_mut(&self.name, self.incarnation);
        let polls = me.polls;
        let before = out.len();
        let mut later = VecDeque::new();
        for done in me.done.drain(..) {
            if done.report_at <= polls {
                out.push(done.completion);
            } else {
                later.push_back(done);
            }
        }
        me.done = later;
        me.stats.completions += (out.len() - before) as u64;
        unlock_and_announce(guard);
    }

    fn send_notification(&mut self, peer: &PeerAddr, bytes: Vec<u8>) -> Result<(), TransportError> {
        let mut fab = self.fabric.lock();
        let result = fab.notify(&self.name, self.incarnation, peer, bytes);
        if result.is_err() {
            fab.me_mut(&self.name, self.incarnation)
                .stats
                .notification_errors += 1;
        }
        unlock_and_announce(fab);
        result
    }

    fn poll_notifications(&mut self, out: &mut Vec<Notification>) {
        let mut fab = self.fabric.lock();
        let me = fab.me_mut(&self.name, self.incarnation);
        me.inbox_bytes = 0;
        for (from, bytes) in me.inbox.drain(..) {
            let peer = me.by_agent.get(&from).cloned();
            out.push(Notification { from, peer, bytes });
        }
    }

    fn max_notification_len(&self) -> usize {
        self.fabric.lock().limits.max_notification_len
    }

    fn set_arrival_hook(&mut self, hook: ArrivalHook) {
        let mut fab = self.fabric.lock();
        fab.me_mut(&self.name, self.incarnation).arrival_hook = Some(hook);
    }
}
