//! The in-memory transport: agents of one process on a shared [`MemFabric`], moving real bytes.
//!
//! # Model
//!
//! - **Memory.** [`MemTransport::alloc_region`] allocates zeroed bytes in the fabric and hands back
//!   a [`MemRegion`], through which the engine reads and writes them (no `unsafe`). Every region
//!   gets a synthetic address, unique on the fabric, page aligned, with an unmapped page after it,
//!   so a span that runs past a region's end never falls into the next one. A region must be
//!   registered ([`Transport::register_region`]) before transfers may touch it. Region memory
//!   lives as long as the fabric (bounded by [`MemLimits::max_fabric_bytes`]).
//! - **Landing.** A posted transfer is queued on its initiator. It lands (its bytes are copied,
//!   reading the source at that moment) during the initiator's
//!   [`MemFaults::land_after_polls`]-th call of [`Transport::poll_completions`] after the post
//!   (0: inside the post itself), and not before [`MemFaults::land_after`] has passed (zero by
//!   default, and then no clock is read). Then its notification is put in the target's queue, and
//!   then its completion is reported by that same poll (or
//!   [`MemFaults::completion_lag_polls`] polls later). Transfers land in post order among those
//!   that are due. Nothing random: every order is a function of call order.
//! - **Back-pressure.** A transfer whose notification does not fit in the target's queue waits
//!   (stays in flight) until it does.
//! - **Death.** Dropping a [`MemTransport`] kills its agent: its pending transfers never land, its
//!   queues are emptied. Transfers to a dead agent complete with
//!   [`TransportError::PeerUnreachable`]; notifications to it are refused with that error. The
//!   name can then be used again by a new agent (a new incarnation, whose metadata differs).
//!
//! # Faults
//!
//! [`MemFaults`] holds per-agent switches, settable at any time through
//! [`MemTransport::set_faults`] or, from outside the owner, [`MemFabric::set_faults`]. Counters
//! (`*_next_*`) are consumed one per event; `u32::MAX` means "always" in practice.

#![forbid(unsafe_code)]

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvhandoff_protocol::{AgentName, MAX_REGIONS};

use super::{
    AddrRange, Completion, Descriptor, Notification, Transport, TransportError,
    MAX_NOTIFICATION_LEN,
};
use crate::{PeerAddr, WriteId};

/// Address of the first region of every fabric.
const FIRST_ADDR: u64 = 0x1_0000_0000;
/// Alignment of region bases, and the unmapped gap after each region.
const PAGE: u64 = 4096;
/// First bytes of every [`MemTransport`] metadata blob.
const METADATA_MAGIC: [u8; 8] = *b"KVHMEM01";

/// Source of fabric ids, so that metadata from one fabric is refused by another.
static NEXT_FABRIC_ID: AtomicU64 = AtomicU64::new(1);

/// Bounds of a [`MemFabric`]; every queue and table is bounded by one of these.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemLimits {
    /// Most transfers pending per agent (posted and not yet reported).
    pub max_in_flight: usize,
    /// Most descriptors per transfer.
    pub max_descriptors: usize,
    /// Most bytes per notification.
    pub max_notification_len: usize,
    /// Most notifications queued per receiving agent.
    pub max_inbox: usize,
    /// Most notification bytes queued per receiving agent.
    pub max_inbox_bytes: usize,
    /// Most peers loaded per agent (invalidated peers are remembered up to the same number).
    pub max_peers: usize,
    /// Most regions registered per agent.
    pub max_regions: usize,
    /// Most bytes of region memory on the whole fabric.
    pub max_fabric_bytes: u64,
}

impl Default for MemLimits {
    fn default() -> Self {
        Self {
            max_in_flight: 1024,
            max_descriptors: 1 << 16,
            max_notification_len: MAX_NOTIFICATION_LEN,
            max_inbox: 4096,
            max_inbox_bytes: 64 << 20,
            max_peers: 1024,
            max_regions: MAX_REGIONS,
            max_fabric_bytes: 1 << 30,
        }
    }
}

/// Per-agent fault switches and latency settings. The default is a healthy agent whose transfers
/// land on the first poll after posting.
///
/// Switches about transfers apply to the agent's own posts (it is the initiator). A post takes at
/// most one of `fail_next_transfers`, `partial_next_transfers` and `hang_next_transfers`, in that
/// order of precedence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemFaults {
    /// A transfer lands during this many-th `poll_completions` after its post; 0 lands it inside
    /// the post (like NIXL completing a small transfer immediately). Read at post time, so
    /// raising it delays the transfers posted afterwards ("delay landing by K polls": 1 + K).
    pub land_after_polls: u32,
    /// A transfer also waits this long after its post (measured with [`Instant`]). Zero (the
    /// default) never reads the clock.
    pub land_after: Duration,
    /// The next this-many posts return [`TransportError::PostFailed`]; nothing is posted.
    pub fail_next_posts: u32,
    /// The next this-many posted transfers complete with [`TransportError::TransferFailed`]
    /// when due; no byte lands and no notification is delivered.
    pub fail_next_transfers: u32,
    /// The next this-many posted transfers land only the first half of their bytes (in
    /// descriptor order), then complete with [`TransportError::TransferFailed`]; no notification.
    pub partial_next_transfers: u32,
    /// The next this-many posted transfers never land: they stay pending until abandoned or
    /// their peer is invalidated.
    pub hang_next_transfers: u32,
    /// While set, nothing this agent posted lands (pending transfers resume when cleared).
    pub stall: bool,
    /// The next this-many notifications this agent sends (standalone, or attached to its
    /// transfers) are silently lost; the transfers themselves still land and complete `Ok`.
    pub drop_next_notifications: u32,
    /// A landed transfer's completion is reported this many polls after the landing, leaving a
    /// window in which the data (and notification) arrived but the initiator does not know yet.
    pub completion_lag_polls: u32,
    /// While set, [`Transport::abandon_write`] on a transfer that has not landed returns
    /// [`TransportError::AbandonRefused`] (as a NIXL transport must for in-flight RDMA).
    pub refuse_abandon: bool,
}

impl Default for MemFaults {
    fn default() -> Self {
        Self {
            land_after_polls: 1,
            land_after: Duration::ZERO,
            fail_next_posts: 0,
            fail_next_transfers: 0,
            partial_next_transfers: 0,
            hang_next_transfers: 0,
            stall: false,
            drop_next_notifications: 0,
            completion_lag_polls: 0,
            refuse_abandon: false,
        }
    }
}

/// Counters of one agent (writes and reads are both "transfers").
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MemStats {
    /// Calls of `poll_completions`.
    pub polls: u64,
    /// Transfers posted.
    pub posted: u64,
    /// Posts refused (by a check or an injected fault).
    pub post_errors: u64,
    /// Transfers whose every byte landed.
    pub landed: u64,
    /// Transfers that completed with a transfer failure (injected, partial, unreachable peer).
    pub failed: u64,
    /// Transfers abandoned before landing.
    pub abandoned: u64,
    /// Transfers failed by invalidating their peer.
    pub invalidated: u64,
    /// Bytes copied by this agent's transfers, partial ones included.
    pub bytes_landed: u64,
    /// Completions reported.
    pub completions: u64,
    /// Notifications this agent put in a peer's queue (standalone and attached).
    pub notifications_sent: u64,
    /// Notifications this agent sent that the drop fault lost.
    pub notifications_dropped: u64,
    /// `send_notification` calls refused.
    pub notification_errors: u64,
    /// Notifications put in this agent's queue.
    pub notifications_received: u64,
}

/// A shared in-process fabric on which [`MemTransport`] agents live. Cheap to clone (all clones
/// are the same fabric); `Send + Sync`.
///
/// ```
/// use kvhandoff_actors::transport::mem::MemFabric;
/// use kvhandoff_actors::transport::{Descriptor, Transport};
/// use kvhandoff_actors::{PeerAddr, WriteId};
/// use kvhandoff_protocol::{AgentName, EngineId};
///
/// let fabric = MemFabric::new();
/// let p_name = AgentName::new("prefill-0/0").unwrap();
/// let d_name = AgentName::new("decode-0/0").unwrap();
/// let mut p = fabric.agent(p_name.clone()).unwrap();
/// let mut d = fabric.agent(d_name.clone()).unwrap();
///
/// // Each side allocates and registers memory; P fills its source.
/// let src = p.alloc_region(64).unwrap();
/// let dst = d.alloc_region(64).unwrap();
/// let src_range = p.register_region(&src).unwrap();
/// let dst_range = d.register_region(&dst).unwrap();
/// src.write(0, &[7; 64]).unwrap();
///
/// // Handshake: P loads D's metadata.
/// let d_addr = PeerAddr::new(EngineId::new("decode-0").unwrap(), 0);
/// p.load_remote(&d_addr, &d_name, &d.local_metadata().unwrap()).unwrap();
///
/// // Post a write with a notification; it lands on P's next poll.
/// let desc = Descriptor { local_addr: src_range.base, remote_addr: dst_range.base, len: 64 };
/// p.post_write(WriteId(1), &d_addr, &[desc], Some(b"done".to_vec())).unwrap();
/// let mut notes = Vec::new();
/// d.poll_notifications(&mut notes);
/// assert!(notes.is_empty()); // not landed yet
/// assert_eq!(dst.to_vec(), vec![0; 64]);
///
/// let mut done = Vec::new();
/// p.poll_completions(&mut done);
/// assert_eq!(done.len(), 1);
/// assert_eq!(done[0].result, Ok(()));
/// assert_eq!(dst.to_vec(), vec![7; 64]);
/// d.poll_notifications(&mut notes);
/// assert_eq!(notes[0].from, p_name);
/// assert_eq!(notes[0].bytes, b"done");
/// ```
#[derive(Clone)]
pub struct MemFabric {
    inner: Arc<Mutex<Fabric>>,
}

impl Default for MemFabric {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for MemFabric {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let fab = self.lock();
        f.debug_struct("MemFabric")
            .field("id", &fab.id)
            .field("agents", &fab.agents.len())
            .field("regions", &fab.regions.len())
            .finish()
    }
}

impl MemFabric {
    /// A fabric with the default [`MemLimits`].
    pub fn new() -> Self {
        Self::with_limits(MemLimits::default())
    }

    /// A fabric with the given bounds.
    pub fn with_limits(limits: MemLimits) -> Self {
        let fabric = Fabric {
            id: NEXT_FABRIC_ID.fetch_add(1, Ordering::Relaxed),
            limits,
            next_addr: FIRST_ADDR,
            allocated: 0,
            next_incarnation: 1,
            regions: BTreeMap::new(),
            agents: BTreeMap::new(),
        };
        Self {
            inner: Arc::new(Mutex::new(fabric)),
        }
    }

    /// The fabric's bounds.
    pub fn limits(&self) -> MemLimits {
        self.lock().limits.clone()
    }

    /// Creates the agent `name` on this fabric. A name can be used again once its previous
    /// agent was dropped (the new agent is a new incarnation).
    ///
    /// # Errors
    /// [`TransportError::AgentNameInUse`] while an agent of that name is alive.
    pub fn agent(&self, name: AgentName) -> Result<MemTransport, TransportError> {
        let mut fab = self.lock();
        if fab.agents.get(&name).is_some_and(|a| a.alive) {
            return Err(TransportError::AgentNameInUse { agent: name });
        }
        let incarnation = fab.next_incarnation;
        fab.next_incarnation += 1;
        fab.agents
            .insert(name.clone(), AgentState::new(incarnation));
        drop(fab);
        Ok(MemTransport {
            fabric: self.clone(),
            name,
            incarnation,
        })
    }

    /// The fault switches of agent `name` (its latest incarnation).
    pub fn faults(&self, name: &AgentName) -> Option<MemFaults> {
        self.lock().agents.get(name).map(|a| a.faults.clone())
    }

    /// Replaces the fault switches of agent `name`, e.g. from a test while a shell owns the
    /// transport.
    ///
    /// # Errors
    /// [`TransportError::UnknownAgent`] when no agent of that name was ever created.
    pub fn set_faults(&self, name: &AgentName, faults: MemFaults) -> Result<(), TransportError> {
        let mut fab = self.lock();
        let agent = fab
            .agents
            .get_mut(name)
            .ok_or_else(|| TransportError::UnknownAgent {
                agent: name.clone(),
            })?;
        agent.faults = faults;
        Ok(())
    }

    /// The counters of agent `name` (its latest incarnation, dead or alive).
    pub fn stats(&self, name: &AgentName) -> Option<MemStats> {
        self.lock().agents.get(name).map(|a| a.stats.clone())
    }

    fn lock(&self) -> MutexGuard<'_, Fabric> {
        // A panic while holding the lock (e.g. a failed assertion in another test thread) must
        // not turn every later call into a second panic.
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn same(&self, other: &MemFabric) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

/// A region of fabric memory, allocated by [`MemTransport::alloc_region`]. Clones are handles to
/// the same bytes. Every access goes through the fabric's lock, so it never races a landing.
#[derive(Clone)]
pub struct MemRegion {
    fabric: MemFabric,
    base: u64,
    len: u64,
}

impl fmt::Debug for MemRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MemRegion({:#x}+{})", self.base, self.len)
    }
}

impl MemRegion {
    /// The region's first address.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Bytes in the region.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always `false`: regions are never empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The region's address range.
    pub fn range(&self) -> AddrRange {
        AddrRange {
            base: self.base,
            len: self.len,
        }
    }

    /// Copies `bytes` into the region at `offset`.
    ///
    /// # Errors
    /// [`TransportError::RegionOutOfBounds`] when the span leaves the region.
    pub fn write(&self, offset: u64, bytes: &[u8]) -> Result<(), TransportError> {
        let mut fab = self.fabric.lock();
        let span = self.span(offset, bytes.len())?;
        self.bytes_mut(&mut fab)[span].copy_from_slice(bytes);
        Ok(())
    }

    /// Copies bytes at `offset` into `buf` (filling it).
    ///
    /// # Errors
    /// [`TransportError::RegionOutOfBounds`] when the span leaves the region.
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), TransportError> {
        let mut fab = self.fabric.lock();
        let span = self.span(offset, buf.len())?;
        buf.copy_from_slice(&self.bytes_mut(&mut fab)[span]);
        Ok(())
    }

    /// A copy of the whole region.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut fab = self.fabric.lock();
        self.bytes_mut(&mut fab).clone()
    }

    /// Sets every byte of the region to `byte`.
    pub fn fill(&self, byte: u8) {
        let mut fab = self.fabric.lock();
        self.bytes_mut(&mut fab).fill(byte);
    }

    fn span(&self, offset: u64, len: usize) -> Result<std::ops::Range<usize>, TransportError> {
        let out = || TransportError::RegionOutOfBounds {
            base: self.base,
            offset,
            len: len as u64,
        };
        let end = offset.checked_add(len as u64).ok_or_else(out)?;
        if end > self.len {
            return Err(out());
        }
        // Both fit: `end <= self.len`, which is the length of an allocated `Vec`.
        Ok(offset as usize..end as usize)
    }

    fn bytes_mut<'f>(&self, fab: &'f mut Fabric) -> &'f mut Vec<u8> {
        &mut fab
            .regions
            .get_mut(&self.base)
            .expect("invariant: fabric regions are never freed")
            .bytes
    }
}

/// One agent on a [`MemFabric`]; implements [`Transport`]. Dropping it kills the agent.
pub struct MemTransport {
    fabric: MemFabric,
    name: AgentName,
    incarnation: u64,
}

impl fmt::Debug for MemTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemTransport")
            .field("name", &self.name)
            .field("incarnation", &self.incarnation)
            .finish()
    }
}

impl Drop for MemTransport {
    fn drop(&mut self) {
        let mut fab = self.fabric.lock();
        if let Some(agent) = fab.agents.get_mut(&self.name) {
            if agent.incarnation == self.incarnation {
                agent.die();
            }
        }
    }
}

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
                bytes,
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
        match result {
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
        }
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

    fn local_metadata(&self) -> Result<Vec<u8>, TransportError> {
        let fab = self.fabric.lock();
        let regions: Vec<AddrRange> = fab
            .regions
            .iter()
            .filter(|(_, r)| {
                r.registered && r.owner == self.name && r.incarnation == self.incarnation
            })
            .map(|(&base, r)| AddrRange {
                base,
                len: r.bytes.len() as u64,
            })
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
                    && r.bytes.len() as u64 == range.len
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
        let mut fab = self.fabric.lock();
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
    }

    fn send_notification(&mut self, peer: &PeerAddr, bytes: Vec<u8>) -> Result<(), TransportError> {
        let mut fab = self.fabric.lock();
        let result = fab.notify(&self.name, self.incarnation, peer, bytes);
        if result.is_err() {
            fab.me_mut(&self.name, self.incarnation)
                .stats
                .notification_errors += 1;
        }
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
}

// ---------------------------------------------------------------------------------------------
// Fabric state (all of it behind the one lock).
// ---------------------------------------------------------------------------------------------

struct Fabric {
    id: u64,
    limits: MemLimits,
    next_addr: u64,
    allocated: u64,
    next_incarnation: u64,
    regions: BTreeMap<u64, Region>,
    agents: BTreeMap<AgentName, AgentState>,
}

struct Region {
    owner: AgentName,
    incarnation: u64,
    registered: bool,
    bytes: Vec<u8>,
}

struct AgentState {
    incarnation: u64,
    alive: bool,
    faults: MemFaults,
    stats: MemStats,
    polls: u64,
    registered: usize,
    peers: BTreeMap<PeerAddr, Peer>,
    /// Loaded peers by agent name (the reverse of the `Loaded` entries of `peers`).
    by_agent: BTreeMap<AgentName, PeerAddr>,
    /// Invalidated peers, oldest first (bounded by `max_peers`).
    tombstones: VecDeque<PeerAddr>,
    /// Posted transfers that have not finished, in post order.
    in_flight: VecDeque<Xfer>,
    /// Finished transfers whose completion is not reported yet, in finishing order.
    done: VecDeque<Done>,
    inbox: VecDeque<(AgentName, Vec<u8>)>,
    inbox_bytes: usize,
}

impl AgentState {
    fn new(incarnation: u64) -> Self {
        Self {
            incarnation,
            alive: true,
            faults: MemFaults::default(),
            stats: MemStats::default(),
            polls: 0,
            registered: 0,
            peers: BTreeMap::new(),
            by_agent: BTreeMap::new(),
            tombstones: VecDeque::new(),
            in_flight: VecDeque::new(),
            done: VecDeque::new(),
            inbox: VecDeque::new(),
            inbox_bytes: 0,
        }
    }

    fn die(&mut self) {
        self.alive = false;
        self.peers.clear();
        self.by_agent.clear();
        self.tombstones.clear();
        self.in_flight.clear();
        self.done.clear();
        self.inbox.clear();
        self.inbox_bytes = 0;
    }

    fn is(&self, incarnation: u64) -> bool {
        self.alive && self.incarnation == incarnation
    }
}

enum Peer {
    Loaded(RemoteMd),
    Invalidated,
}

struct RemoteMd {
    agent: AgentName,
    incarnation: u64,
    /// Registered regions of the peer at metadata time: base -> len.
    regions: BTreeMap<u64, u64>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Op {
    Write,
    Read,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Fate {
    Land,
    Fail,
    Partial,
    Hang,
}

struct Xfer {
    id: WriteId,
    op: Op,
    peer: PeerAddr,
    target: AgentName,
    target_incarnation: u64,
    descriptors: Vec<Descriptor>,
    notification: Option<Vec<u8>>,
    fate: Fate,
    due_poll: u64,
    due_time: Option<Instant>,
}

struct Done {
    report_at: u64,
    completion: Completion,
}

/// Whether `[addr, addr + len)` lies inside one of `regions` (base -> len).
fn within(regions: &BTreeMap<u64, u64>, addr: u64, len: u64) -> bool {
    regions
        .range(..=addr)
        .next_back()
        .is_some_and(|(&base, &rlen)| AddrRange { base, len: rlen }.contains(addr, len))
}

impl Fabric {
    fn me(&self, name: &AgentName, incarnation: u64) -> &AgentState {
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

    fn me_mut(&mut self, name: &AgentName, incarnation: u64) -> &mut AgentState {
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
                    && AddrRange {
                        base,
                        len: r.bytes.len() as u64,
                    }
                    .contains(addr, len)
            })
    }

    /// Checks and queues a transfer; `Ok(true)` when it is due at once.
    #[allow(clippy::too_many_arguments)]
    fn post(
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
    fn progress(&mut self, name: &AgentName, incarnation: u64, only: Option<WriteId>) {
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
            Fate::Land | Fate::Partial if !reachable => (
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
            Fate::Land => {
                let copied = self.copy(&x, total);
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
            let data = self.slice(src, len).to_vec();
            self.slice(dst, len).copy_from_slice(&data);
            left -= len;
        }
        budget - left
    }

    /// The bytes at `[addr, addr + len)`, which posting proved lie inside one region.
    fn slice(&mut self, addr: u64, len: u64) -> &mut [u8] {
        let (&base, region) = self
            .regions
            .range_mut(..=addr)
            .next_back()
            .expect("invariant: a posted span lies inside a region");
        let start = (addr - base) as usize;
        &mut region.bytes[start..start + len as usize]
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
    }

    fn notify(
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

// ---------------------------------------------------------------------------------------------
// Metadata: magic, fabric id, incarnation, agent name, registered regions; little endian.
// ---------------------------------------------------------------------------------------------

struct DecodedMd {
    fabric: u64,
    agent: AgentName,
    incarnation: u64,
    regions: Vec<AddrRange>,
}

fn encode_metadata(
    fabric: u64,
    agent: &AgentName,
    incarnation: u64,
    regions: &[AddrRange],
) -> Vec<u8> {
    let name = agent.as_str().as_bytes();
    let mut out = Vec::with_capacity(32 + name.len() + 16 * regions.len());
    out.extend_from_slice(&METADATA_MAGIC);
    out.extend_from_slice(&fabric.to_le_bytes());
    out.extend_from_slice(&incarnation.to_le_bytes());
    // Agent names are at most `MAX_ID_LEN` bytes and regions at most `max_regions`.
    out.extend_from_slice(&(name.len() as u32).to_le_bytes());
    out.extend_from_slice(name);
    out.extend_from_slice(&(regions.len() as u32).to_le_bytes());
    for r in regions {
        out.extend_from_slice(&r.base.to_le_bytes());
        out.extend_from_slice(&r.len.to_le_bytes());
    }
    out
}

fn decode_metadata(bytes: &[u8], max_regions: usize) -> Result<DecodedMd, TransportError> {
    let bad = |why| TransportError::BadMetadata { why };
    let mut cur = Cursor { bytes };
    if cur.take(METADATA_MAGIC.len())? != METADATA_MAGIC {
        return Err(bad("bad magic"));
    }
    let fabric = cur.u64()?;
    let incarnation = cur.u64()?;
    let name_len = cur.u32()? as usize;
    let name =
        std::str::from_utf8(cur.take(name_len)?).map_err(|_| bad("agent name is not UTF-8"))?;
    let agent = AgentName::new(name).map_err(|_| bad("invalid agent name"))?;
    let count = cur.u32()? as usize;
    if count > max_regions {
        return Err(bad("too many regions"));
    }
    let mut regions = Vec::with_capacity(count);
    for _ in 0..count {
        let range = AddrRange {
            base: cur.u64()?,
            len: cur.u64()?,
        };
        regions.push(range);
    }
    if !cur.bytes.is_empty() {
        return Err(bad("trailing bytes"));
    }
    Ok(DecodedMd {
        fabric,
        agent,
        incarnation,
        regions,
    })
}

struct Cursor<'a> {
    bytes: &'a [u8],
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], TransportError> {
        if self.bytes.len() < n {
            return Err(TransportError::BadMetadata { why: "truncated" });
        }
        let (head, tail) = self.bytes.split_at(n);
        self.bytes = tail;
        Ok(head)
    }

    fn u32(&mut self) -> Result<u32, TransportError> {
        let mut b = [0; 4];
        b.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(b))
    }

    fn u64(&mut self) -> Result<u64, TransportError> {
        let mut b = [0; 8];
        b.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(b))
    }
}
