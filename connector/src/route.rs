//! [`PlannedRoute`]: the [`TransferRoute`] of one rank of a heterogeneous pair (engines of
//! different TP, kernel block size or layout), in one process or across processes.
//!
//! It accepts exactly the other engine's rank geometries of its [`PairPlan`], and places each
//! transfer by its pairing key: P's writes (push) and D's reads (pull). The owner (P's engine
//! for a write, D's for a read) files, before it calls `request_finished` (or
//! `request_allocated`), either
//! - the descriptors of a sub-request's link, together with the block ids they were planned
//!   for ([`PlannedRoute::file`]): the route hands them to the driver only for a write whose own
//!   and registered block ids are exactly those. An in-process pair does this: P's engine knows
//!   D's memory.
//! - or a planner ([`PlannedRoute::file_planner`]) that the route runs at post time with D's
//!   registration: its block ids and the memory it named ([`Register::memory`](kvhandoff_protocol::Register::memory)),
//!   which D's route filed ([`PlannedRoute::file_memory`]) and D's shell put on the wire. A
//!   pair across processes does this. Every piece the planner returns must land inside the
//!   memory D named, and that memory inside the buffers D's handshake advertised: a peer that
//!   names other memory gets no write.
//!
//! A read is placed the same way, with the roles swapped: D files the pieces (or a planner),
//! and P's route files the memory its grant names ([`ReadGrant::memory`](kvhandoff_protocol::ReadGrant::memory)):
//! where the request's blocks are.
//!
//! A later turn's read-back (P reading D's kept blocks) is placed the same way, with the pair
//! planned the other way.
//!
//! Whatever else comes (an unknown key, the peer naming other blocks, a write on D) is refused,
//! and the protocol fails the transfer (`PostFailed`). A rank gets its route from
//! [`RankBuilder::pairing`](crate::RankBuilder::pairing) ([`EngineRank::route`](crate::EngineRank::route));
//! the per-request plan comes from `kvhandoff_protocol::hetero` (what `kvhandoff demo --model`
//! and `kvhandoff node --model` run).

use std::collections::BTreeMap;
use std::sync::Mutex;

use kvhandoff_protocol::driver::{RouteDirection, RouteError, RouteRequest, TransferRoute};
use kvhandoff_protocol::hetero::{PairPlan, SideName};
use kvhandoff_protocol::planner::Descriptor;
use kvhandoff_protocol::{BlockIds, KvGeometry, MemorySpan, PairingKey, MAX_REGISTER_SPANS};

/// Most writes filed and not yet posted on one rank.
pub const MAX_FILED: usize = 4096;

/// The staging work of one link, run by the route right before the link's write.
pub type Staging = Box<dyn FnOnce() -> Result<(), String> + Send>;

/// Plans one write at post time from D's registration (see the module documentation): the
/// descriptors, or why not. It runs P's staging for the write first, if the plan has any.
pub type Planner = Box<dyn FnOnce(&RouteRequest<'_>) -> Result<Vec<Descriptor>, String> + Send>;

/// How a filed write is placed.
enum Placement {
    /// Planned ahead for D's `remote` blocks.
    Ahead {
        remote: BlockIds,
        descriptors: Vec<Descriptor>,
        staging: Option<Staging>,
    },
    /// Planned at post time.
    AtPost(Planner),
}

/// One write filed ahead of its post.
struct Filed {
    local: BlockIds,
    placement: Placement,
}

impl std::fmt::Debug for Filed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut out = f.debug_struct("Filed");
        out.field("local", &self.local);
        match &self.placement {
            Placement::Ahead {
                remote,
                descriptors,
                staging,
            } => out
                .field("remote", remote)
                .field("descriptors", &descriptors.len())
                .field("staging", &staging.is_some()),
            Placement::AtPost(_) => out.field("planner", &true),
        }
        .finish()
    }
}

/// The route of one rank of a heterogeneous pair (see the module documentation).
#[derive(Debug)]
pub struct PlannedRoute {
    /// The peer geometries this rank pairs with: the other side's ranks.
    peers: Vec<KvGeometry>,
    side: SideName,
    filed: Mutex<BTreeMap<PairingKey, Filed>>,
    /// D: the memory each registration names.
    memory: Mutex<BTreeMap<PairingKey, Vec<MemorySpan>>>,
}

impl PlannedRoute {
    /// The route of a rank of `side` in `pair`.
    pub fn new(pair: &PairPlan, side: SideName) -> PlannedRoute {
        let other = match side {
            SideName::Prefill => &pair.decode,
            SideName::Decode => &pair.prefill,
        };
        PlannedRoute {
            peers: other.ranks.iter().map(|r| r.geometry.clone()).collect(),
            side,
            filed: Mutex::new(BTreeMap::new()),
            memory: Mutex::new(BTreeMap::new()),
        }
    }

    /// Files the descriptors of the write under `key`, planned for P's `local` and D's `remote`
    /// block ids, with the staging work to run right before it.
    ///
    /// # Errors
    /// A key filed already, or [`MAX_FILED`] writes waiting.
    pub fn file(
        &self,
        key: PairingKey,
        local: BlockIds,
        remote: BlockIds,
        descriptors: Vec<Descriptor>,
        staging: Option<Staging>,
    ) -> Result<(), RouteError> {
        let placement = Placement::Ahead {
            remote,
            descriptors,
            staging,
        };
        self.insert(key, Filed { local, placement })
    }

    /// Files a planner for the write under `key` from P's `local` block ids: it runs when D's
    /// registration has come, with its block ids and the memory it named.
    ///
    /// # Errors
    /// A key filed already, or [`MAX_FILED`] writes waiting.
    pub fn file_planner(
        &self,
        key: PairingKey,
        local: BlockIds,
        planner: Planner,
    ) -> Result<(), RouteError> {
        let placement = Placement::AtPost(planner);
        self.insert(key, Filed { local, placement })
    }

    /// D: files the memory D's registration of `key` names (its request's buffers, in the
    /// order the pair's plan names them).
    ///
    /// # Errors
    /// A key filed already, more than [`MAX_REGISTER_SPANS`] spans or an empty one, or
    /// [`MAX_FILED`] keys waiting.
    pub fn file_memory(&self, key: PairingKey, spans: Vec<MemorySpan>) -> Result<(), RouteError> {
        if spans.len() > MAX_REGISTER_SPANS || spans.iter().any(|s| s.len == 0) {
            return Err(RouteError(format!(
                "{key}: a registration names 1 to {MAX_REGISTER_SPANS} non-empty spans"
            )));
        }
        let mut memory = self
            .memory
            .lock()
            .map_err(|_| RouteError("the route's table is poisoned".into()))?;
        if memory.len() >= MAX_FILED {
            return Err(RouteError(format!("{MAX_FILED} registrations filed")));
        }
        if memory.contains_key(&key) {
            return Err(RouteError(format!("{key} is filed already")));
        }
        memory.insert(key, spans);
        Ok(())
    }

    fn insert(&self, key: PairingKey, entry: Filed) -> Result<(), RouteError> {
        let mut filed = self.lock()?;
        if filed.len() >= MAX_FILED {
            return Err(RouteError(format!(
                "{MAX_FILED} writes filed and not posted"
            )));
        }
        if filed.contains_key(&key) {
            return Err(RouteError(format!("{key} is filed already")));
        }
        filed.insert(key, entry);
        Ok(())
    }

    /// Drops what is filed under `key`: a request that ended without its write (P), or that
    /// ended (D: its registration is not sent again).
    pub fn withdraw(&self, key: &PairingKey) {
        if let Ok(mut filed) = self.filed.lock() {
            filed.remove(key);
        }
        if let Ok(mut memory) = self.memory.lock() {
            memory.remove(key);
        }
    }

    /// Writes filed and not posted, and registrations' memory filed and not withdrawn.
    pub fn pending(&self) -> usize {
        self.filed.lock().map_or(0, |f| f.len()) + self.memory.lock().map_or(0, |m| m.len())
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, BTreeMap<PairingKey, Filed>>, RouteError> {
        self.filed
            .lock()
            .map_err(|_| RouteError("the route's table is poisoned".into()))
    }
}

impl TransferRoute for PlannedRoute {
    fn accepts(&self, own: &KvGeometry, peer: &KvGeometry) -> Result<(), RouteError> {
        if self.peers.iter().any(|g| g == peer) {
            return Ok(());
        }
        Err(RouteError(format!(
            "a {} rank (TP {} rank {}) pairs only with the planned ranks of the other engine, \
             not with TP {} rank {} of block {} and layout {:?}",
            self.side,
            own.tp_size,
            own.tp_rank,
            peer.tp_size,
            peer.tp_rank,
            peer.kernel_block_size,
            peer.layout
        )))
    }

    fn descriptors(
        &self,
        request: &RouteRequest<'_>,
        out: &mut Vec<Descriptor>,
    ) -> Result<(), RouteError> {
        match (request.direction, self.side) {
            // P writes (push), D reads (pull), P reads D's kept blocks back (a later turn).
            (RouteDirection::Write, SideName::Prefill) | (RouteDirection::Read, _) => {}
            (RouteDirection::Write, SideName::Decode) => {
                return Err(RouteError(
                    "between different geometries D never writes into P".into(),
                ))
            }
        }
        let mut filed = self.lock()?;
        let Some(entry) = filed.get(request.key) else {
            return Err(RouteError(format!("nothing is filed for {}", request.key)));
        };
        let same_blocks = &entry.local == request.local
            && match &entry.placement {
                Placement::Ahead { remote, .. } => remote == request.remote,
                Placement::AtPost(_) => true,
            };
        if !same_blocks {
            return Err(RouteError(format!(
                "{}: the write names other blocks than were planned",
                request.key
            )));
        }
        let Some(entry) = filed.remove(request.key) else {
            return Ok(());
        };
        drop(filed);
        match entry.placement {
            Placement::Ahead {
                descriptors,
                staging,
                ..
            } => {
                // P's transforms for this link, now that D's registration named the planned
                // blocks.
                if let Some(staging) = staging {
                    staging().map_err(|why| {
                        RouteError(format!("{}: P's staging failed: {why}", request.key))
                    })?;
                }
                out.extend_from_slice(&descriptors);
            }
            Placement::AtPost(planner) => {
                check_named_memory(request)?;
                let descriptors = planner(request)
                    .map_err(|why| RouteError(format!("{}: {why}", request.key)))?;
                if let Some(bad) = descriptors.iter().find(|d| {
                    !request
                        .remote_memory
                        .iter()
                        .any(|span| span.contains(d.remote_addr, d.len))
                }) {
                    return Err(RouteError(format!(
                        "{}: a piece at the peer's {:#x}+{} lies outside the memory it named",
                        request.key, bad.remote_addr, bad.len
                    )));
                }
                out.extend_from_slice(&descriptors);
            }
        }
        Ok(())
    }

    fn named_memory(&self, key: &PairingKey) -> Vec<MemorySpan> {
        self.memory
            .lock()
            .ok()
            .and_then(|memory| memory.get(key).cloned())
            .unwrap_or_default()
    }
}

/// A transfer planned at post time needs the peer to have named its memory (D in its
/// registration, a holder in its grant), inside the buffers its handshake advertised.
fn check_named_memory(request: &RouteRequest<'_>) -> Result<(), RouteError> {
    if request.remote_memory.is_empty() {
        return Err(RouteError(format!(
            "{}: the peer names no memory for the pieces",
            request.key
        )));
    }
    for span in request.remote_memory {
        let advertised = request.peer.regions.iter().any(|r| {
            MemorySpan {
                addr: r.base,
                len: r.len,
            }
            .contains(span.addr, span.len)
        });
        if !advertised {
            return Err(RouteError(format!(
                "{}: the peer names {:#x}+{}, outside every buffer its handshake advertised",
                request.key, span.addr, span.len
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
