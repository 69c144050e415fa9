//! The in-memory transport: agents of one process on a shared [`MemFabric`], moving real bytes.
//!
//! # Model
//!
//! - **Memory.** [`MemTransport::alloc_region`] allocates zeroed bytes in the fabric and hands back
//!   a [`MemRegion`], through which the engine reads and writes them (no `unsafe`);
//!   [`MemTransport::adopt_region`] does the same for memory the engine allocated itself (any
//!   [`RegionMemory`]: a `Vec<u8>`, a `Box<[u8]>`, ...), which the fabric then reads and writes
//!   in place, without a copy, and releases when the agent dies. Every region
//!   gets a synthetic address, unique on the fabric, page aligned, with an unmapped page after it,
//!   so a span that runs past a region's end never falls into the next one. A region must be
//!   registered ([`Transport::register_region`]) before transfers may touch it. Allocated region
//!   memory lives as long as the fabric (bounded by [`MemLimits::max_fabric_bytes`]); adopted
//!   memory until its agent dies (it does not count against that bound).
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

mod fabric;
mod limits;
mod mem_transport;
mod metadata;

pub use limits::{MemFaults, MemLimits, MemStats};

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use kvhandoff_protocol::AgentName;

use super::{
    AddrRange, ArrivalHook, Completion, Descriptor, Notification, Transport, TransportError,
};
use kvhandoff_protocol::{PeerAddr, WriteId};

/// Address of the first region of every fabric.
const FIRST_ADDR: u64 = 0x1_0000_0000;
/// Alignment of region bases, and the unmapped gap after each region.
const PAGE: u64 = 4096;
/// First bytes of every [`MemTransport`] metadata blob.
const METADATA_MAGIC: [u8; 8] = *b"KVHMEM01";

/// Source of fabric ids, so that metadata from one fabric is refused by another.
static NEXT_FABRIC_ID: AtomicU64 = AtomicU64::new(1);

/// Memory an engine allocated that a fabric region can be backed by
/// ([`MemTransport::adopt_region`]): the fabric reads and writes it in place, under its lock, and
/// drops it when the agent that adopted it dies.
///
/// ```
/// use kvhandoff_actors::transport::mem::MemFabric;
/// use kvhandoff_protocol::AgentName;
///
/// let fabric = MemFabric::new();
/// let mut agent = fabric.agent(AgentName::new("engine-rank0").unwrap()).unwrap();
/// // The engine's own buffer becomes the region: no copy.
/// let region = agent.adopt_region(Box::new(vec![5u8; 64])).unwrap();
/// let mut buf = [0u8; 4];
/// region.read(60, &mut buf).unwrap();
/// assert_eq!(buf, [5; 4]);
/// ```
pub trait RegionMemory: Send + 'static {
    /// Bytes in the memory; the same on every call.
    fn len(&self) -> usize;

    /// Whether the memory has no bytes (a fabric refuses it).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies the bytes at `offset` into `buf`. The fabric calls it only for spans inside
    /// [`RegionMemory::len`], under its lock; an implementation may panic outside them.
    fn read_at(&self, offset: usize, buf: &mut [u8]);

    /// Copies `bytes` to `offset`, as [`RegionMemory::read_at`].
    fn write_at(&mut self, offset: usize, bytes: &[u8]);
}

impl RegionMemory for Vec<u8> {
    fn len(&self) -> usize {
        self.as_slice().len()
    }

    fn read_at(&self, offset: usize, buf: &mut [u8]) {
        buf.copy_from_slice(&self[offset..offset + buf.len()]);
    }

    fn write_at(&mut self, offset: usize, bytes: &[u8]) {
        self[offset..offset + bytes.len()].copy_from_slice(bytes);
    }
}

impl RegionMemory for Box<[u8]> {
    fn len(&self) -> usize {
        <[u8]>::len(self)
    }

    fn read_at(&self, offset: usize, buf: &mut [u8]) {
        buf.copy_from_slice(&self[offset..offset + buf.len()]);
    }

    fn write_at(&mut self, offset: usize, bytes: &[u8]) {
        self[offset..offset + bytes.len()].copy_from_slice(bytes);
    }
}

/// A shared in-process fabric on which [`MemTransport`] agents live. Cheap to clone (all clones
/// are the same fabric); `Send + Sync`.
///
/// ```
/// use kvhandoff_actors::transport::mem::MemFabric;
/// use kvhandoff_actors::transport::{Descriptor, Transport};
/// use kvhandoff_protocol::{PeerAddr, WriteId};
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
            scratch: Vec::new(),
            arrivals: Vec::new(),
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
    /// [`TransportError::RegionOutOfBounds`] when the span leaves the region;
    /// [`TransportError::ForeignRegion`] when the region's adopted memory was released (its agent
    /// died).
    pub fn write(&self, offset: u64, bytes: &[u8]) -> Result<(), TransportError> {
        let mut fab = self.fabric.lock();
        let span = self.span(offset, bytes.len())?;
        self.region(&mut fab)?.write_at(span.start, bytes);
        Ok(())
    }

    /// Copies bytes at `offset` into `buf` (filling it).
    ///
    /// # Errors
    /// As [`MemRegion::write`].
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), TransportError> {
        let mut fab = self.fabric.lock();
        let span = self.span(offset, buf.len())?;
        self.region(&mut fab)?.read_at(span.start, buf);
        Ok(())
    }

    /// A copy of the whole region (empty once adopted memory was released).
    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = vec![0; self.len as usize];
        match self.read(0, &mut out) {
            Ok(()) => out,
            Err(_) => Vec::new(),
        }
    }

    /// Sets every byte of the region to `byte` (nothing once adopted memory was released).
    pub fn fill(&self, byte: u8) {
        let _ = self.write(0, &vec![byte; self.len as usize]);
    }

    /// Whether the region's memory is still there: always for allocated regions, until its
    /// agent dies for adopted ones ([`MemTransport::adopt_region`]).
    pub fn is_live(&self) -> bool {
        let mut fab = self.fabric.lock();
        self.region(&mut fab).is_ok()
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

    fn region<'f>(&self, fab: &'f mut Fabric) -> Result<&'f mut Region, TransportError> {
        fab.regions
            .get_mut(&self.base)
            .filter(|r| r.is_live())
            .ok_or(TransportError::ForeignRegion { base: self.base })
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
        // Adopted memory goes back to its owner with the agent (whatever its registration).
        let released: Vec<Backing> = fab
            .regions
            .values_mut()
            .filter(|r| r.owner == self.name && r.incarnation == self.incarnation)
            .filter(|r| matches!(r.bytes, Backing::Engine(_)))
            .map(|r| {
                r.registered = false;
                std::mem::replace(&mut r.bytes, Backing::Released)
            })
            .collect();
        drop(fab);
        // Dropped outside the lock: an owner's drop may do anything.
        drop(released);
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
    /// Bytes on their way from one span to another (the two may share a region).
    scratch: Vec<u8>,
    /// Arrival hooks to call once the fabric's lock is released.
    arrivals: Vec<ArrivalHook>,
}

struct Region {
    owner: AgentName,
    incarnation: u64,
    registered: bool,
    /// Bytes in the region (what its memory had when it was made).
    len: u64,
    bytes: Backing,
}

/// What a region's bytes live in.
enum Backing {
    /// Allocated by the fabric ([`MemTransport::alloc_region`]); never freed.
    Fabric(Vec<u8>),
    /// The engine's own memory ([`MemTransport::adopt_region`]), until its agent dies.
    Engine(Box<dyn RegionMemory>),
    /// Adopted memory, released when its agent died.
    Released,
}

impl Region {
    /// Whether its memory is there (adopted memory goes when its agent dies, or is treated as
    /// gone if it changed length).
    fn is_live(&self) -> bool {
        match &self.bytes {
            Backing::Fabric(bytes) => bytes.len() as u64 == self.len,
            Backing::Engine(memory) => memory.len() as u64 == self.len,
            Backing::Released => false,
        }
    }

    /// Copies the bytes at `offset` into `buf`; the caller checked the span and liveness.
    fn read_at(&self, offset: usize, buf: &mut [u8]) {
        match &self.bytes {
            Backing::Fabric(bytes) => buf.copy_from_slice(&bytes[offset..offset + buf.len()]),
            Backing::Engine(memory) => memory.read_at(offset, buf),
            Backing::Released => {}
        }
    }

    /// Copies `bytes` to `offset`; the caller checked the span and liveness.
    fn write_at(&mut self, offset: usize, bytes: &[u8]) {
        match &mut self.bytes {
            Backing::Fabric(mine) => mine[offset..offset + bytes.len()].copy_from_slice(bytes),
            Backing::Engine(memory) => memory.write_at(offset, bytes),
            Backing::Released => {}
        }
    }
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
    /// Called when a notification reaches an empty inbox.
    arrival_hook: Option<ArrivalHook>,
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
            arrival_hook: None,
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
        self.arrival_hook = None;
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
    /// Lands, with one byte flipped ([`MemFaults::corrupt_next_transfers`]).
    Corrupt,
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
