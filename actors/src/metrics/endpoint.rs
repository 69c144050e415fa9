//! The endpoint counters of this process's ranks, published where a scrape can read them
//! without asking the rank actors.
//!
//! Each rank copies its endpoint's [`Counters`] into its own slot after every step that may
//! have changed them (only when they did change: a comparison, no allocation otherwise), and a
//! rank that ends folds its last figures into the process's retired totals, under the same lock
//! a scrape takes. So a scrape never blocks on an actor (it may run on any thread, the
//! runtime's included), a figure never goes down when a rank ends (Prometheus would read a
//! drop as a counter reset), and once a rank has stopped its figures are exact.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use kvhandoff_protocol::machine::{Counters, DropReason, Gauges};

/// The endpoint counters of every rank this process has run, summed ([`endpoint_snapshot`]):
/// the live ranks' figures as they last published them, plus the ended ranks' last figures.
/// Every figure but the gauges ([`EndpointMetrics::live_ranks`], the blocks in quarantine
/// and the peers by state, summed over the live ranks only) only grows.
///
/// ```
/// // No rank runs in this process yet: nothing published, nothing counted.
/// let m = kvhandoff_actors::metrics::endpoint_snapshot();
/// assert_eq!(m.live_ranks, 0);
/// assert_eq!(m.stuck_writes, 0);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EndpointMetrics {
    /// Ranks running now (a gauge: it goes down when a rank ends).
    pub live_ranks: u64,
    /// Logical blocks of the live ranks' D requests that wait for a proof or their
    /// quarantine ([`Gauges::blocks_quarantined`]; a gauge, as each rank last published it).
    pub blocks_quarantined: u64,
    /// The live ranks' peers whose handshake is in progress (a gauge).
    pub peers_connecting: u64,
    /// The live ranks' connected peers (a gauge).
    pub peers_connected: u64,
    /// The live ranks' peers declared dead and still remembered (a gauge).
    pub peers_dead: u64,
    /// Inputs from outside the rank that it ignored, by reason ([`Counters::dropped`]).
    pub dropped: BTreeMap<DropReason, u64>,
    /// [`Counters::writes_posted`].
    pub writes_posted: u64,
    /// [`Counters::writes_abandoned`].
    pub writes_abandoned: u64,
    /// [`Counters::stuck_writes`]: writes whose abandon the transport did not confirm in time.
    pub stuck_writes: u64,
    /// [`Counters::reads_posted`].
    pub reads_posted: u64,
    /// [`Counters::reads_failed`].
    pub reads_failed: u64,
    /// [`Counters::reads_abandoned`].
    pub reads_abandoned: u64,
    /// [`Counters::stuck_reads`].
    pub stuck_reads: u64,
    /// [`Counters::reads_declined_near_expiry`].
    pub reads_declined_near_expiry: u64,
    /// [`Counters::reads_asked_again`]: asks a reader sent again soon because the holder did
    /// not have the export yet.
    pub reads_asked_again: u64,
    /// [`Counters::expired_leases_refused`].
    pub expired_leases_refused: u64,
    /// [`Counters::stale_messages_refused`].
    pub stale_messages_refused: u64,
    /// [`Counters::peers_declared_dead`].
    pub peers_declared_dead: u64,
    /// [`Counters::peer_restarts`].
    pub peer_restarts: u64,
    /// [`Counters::peers_rejoined`].
    pub peers_rejoined: u64,
    /// [`Counters::tombstones_evicted`].
    pub tombstones_evicted: u64,
    /// [`Counters::quarantine_frees`].
    pub quarantine_frees: u64,
    /// [`Counters::fence_frees`].
    pub fence_frees: u64,
    /// [`Counters::stalls_past_allowance`].
    pub stalls_past_allowance: u64,
    /// [`Counters::digest_mismatches`]: writes whose landed bytes failed their integrity
    /// digests.
    pub digest_mismatches: u64,
}

impl EndpointMetrics {
    const ZERO: EndpointMetrics = EndpointMetrics {
        live_ranks: 0,
        blocks_quarantined: 0,
        peers_connecting: 0,
        peers_connected: 0,
        peers_dead: 0,
        dropped: BTreeMap::new(),
        writes_posted: 0,
        writes_abandoned: 0,
        stuck_writes: 0,
        reads_posted: 0,
        reads_failed: 0,
        reads_abandoned: 0,
        stuck_reads: 0,
        reads_declined_near_expiry: 0,
        reads_asked_again: 0,
        expired_leases_refused: 0,
        stale_messages_refused: 0,
        peers_declared_dead: 0,
        peer_restarts: 0,
        peers_rejoined: 0,
        tombstones_evicted: 0,
        quarantine_frees: 0,
        fence_frees: 0,
        stalls_past_allowance: 0,
        digest_mismatches: 0,
    };

    /// Adds one live rank's gauges.
    fn add_gauges(&mut self, g: &Gauges) {
        self.blocks_quarantined = self.blocks_quarantined.saturating_add(g.blocks_quarantined);
        self.peers_connecting = self.peers_connecting.saturating_add(g.peers_connecting);
        self.peers_connected = self.peers_connected.saturating_add(g.peers_connected);
        self.peers_dead = self.peers_dead.saturating_add(g.peers_dead);
    }

    /// Adds one rank's counters (not [`EndpointMetrics::live_ranks`]).
    fn add(&mut self, c: &Counters) {
        for (reason, n) in &c.dropped {
            let slot = self.dropped.entry(*reason).or_insert(0);
            *slot = slot.saturating_add(*n);
        }
        let pairs = [
            (&mut self.writes_posted, c.writes_posted),
            (&mut self.writes_abandoned, c.writes_abandoned),
            (&mut self.stuck_writes, c.stuck_writes),
            (&mut self.digest_mismatches, c.digest_mismatches),
            (&mut self.reads_posted, c.reads_posted),
            (&mut self.reads_failed, c.reads_failed),
            (&mut self.reads_abandoned, c.reads_abandoned),
            (&mut self.stuck_reads, c.stuck_reads),
            (
                &mut self.reads_declined_near_expiry,
                c.reads_declined_near_expiry,
            ),
            (&mut self.reads_asked_again, c.reads_asked_again),
            (&mut self.expired_leases_refused, c.expired_leases_refused),
            (&mut self.stale_messages_refused, c.stale_messages_refused),
            (&mut self.peers_declared_dead, c.peers_declared_dead),
            (&mut self.peer_restarts, c.peer_restarts),
            (&mut self.peers_rejoined, c.peers_rejoined),
            (&mut self.tombstones_evicted, c.tombstones_evicted),
            (&mut self.quarantine_frees, c.quarantine_frees),
            (&mut self.fence_frees, c.fence_frees),
            (&mut self.stalls_past_allowance, c.stalls_past_allowance),
        ];
        for (total, n) in pairs {
            *total = total.saturating_add(n);
        }
    }
}

/// The live ranks' slots and the ended ranks' totals, behind one lock so that a rank's figures
/// move from one to the other atomically with respect to a scrape.
struct Published {
    live: Vec<Arc<Mutex<Slot>>>,
    retired: EndpointMetrics,
}

/// What one live rank last published.
#[derive(Debug, Default)]
struct Slot {
    counters: Counters,
    gauges: Gauges,
}

static PUBLISHED: Mutex<Published> = Mutex::new(Published {
    live: Vec::new(),
    retired: EndpointMetrics::ZERO,
});

/// A poisoned lock only means a thread panicked while holding it; the counters stay usable.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The endpoint counters of every rank of this process, summed (see [`EndpointMetrics`]).
/// Never blocks on a rank: it reads what each rank last published, so it may run on any
/// thread. A live rank's figures are those of its last step (they change only in steps).
pub fn endpoint_snapshot() -> EndpointMetrics {
    let published = lock(&PUBLISHED);
    let mut total = published.retired.clone();
    for slot in &published.live {
        let slot = lock(slot);
        total.add(&slot.counters);
        total.add_gauges(&slot.gauges);
    }
    total.live_ranks = published.live.len() as u64;
    total
}

/// One rank's slot: registered when the rank's counter is made, retired when the rank (the
/// last clone of its counter) is dropped.
#[derive(Debug)]
pub(crate) struct EndpointSlot {
    slot: Arc<Mutex<Slot>>,
}

impl EndpointSlot {
    pub(crate) fn register() -> EndpointSlot {
        let slot = Arc::new(Mutex::new(Slot::default()));
        lock(&PUBLISHED).live.push(slot.clone());
        EndpointSlot { slot }
    }

    /// Copies `counters` into the slot if they changed since the last copy.
    pub(crate) fn publish(&self, counters: &Counters) {
        let mut slot = lock(&self.slot);
        if slot.counters != *counters {
            slot.counters.clone_from(counters);
        }
    }

    /// Replaces the slot's gauges.
    pub(crate) fn publish_gauges(&self, gauges: Gauges) {
        lock(&self.slot).gauges = gauges;
    }
}

impl Drop for EndpointSlot {
    fn drop(&mut self) {
        let mut published = lock(&PUBLISHED);
        published.live.retain(|slot| !Arc::ptr_eq(slot, &self.slot));
        // The counters stay in the totals; the gauges leave with the rank.
        let last = lock(&self.slot).counters.clone();
        published.retired.add(&last);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ended_ranks_figures_stay_in_the_totals() {
        let slot = EndpointSlot::register();
        let mut c = Counters {
            stuck_writes: 3,
            ..Counters::default()
        };
        c.dropped.insert(DropReason::Late, 2);
        let before = endpoint_snapshot();
        slot.publish(&c);
        let live = endpoint_snapshot();
        // Other tests of this binary may publish at the same time: at least ours.
        assert!(live.stuck_writes >= before.stuck_writes + 3);
        drop(slot);
        let after = endpoint_snapshot();
        assert!(after.stuck_writes >= before.stuck_writes + 3);
        assert!(after.dropped.get(&DropReason::Late).copied().unwrap_or(0) >= 2);
    }

    #[test]
    fn a_ranks_gauges_count_while_it_lives_and_leave_with_it() {
        // A figure no other test publishes: ours is told apart from theirs.
        const MANY: u64 = 1 << 40;
        let slot = EndpointSlot::register();
        slot.publish_gauges(Gauges {
            blocks_quarantined: MANY,
            peers_connected: MANY,
            ..Gauges::default()
        });
        let live = endpoint_snapshot();
        assert!(live.blocks_quarantined >= MANY);
        assert!(live.peers_connected >= MANY);
        drop(slot);
        let after = endpoint_snapshot();
        assert!(after.blocks_quarantined < MANY, "{after:?}");
        assert!(after.peers_connected < MANY, "{after:?}");
    }
}
