//! The budget of records P writes on a peer's behalf for keys it holds nothing for: a cancel or
//! release of a key P has no request and no pending registration for, a newer registration of
//! an ended key, an answer to a registration the pending table has no room for.
//!
//! Admission control counts every young record (`requests + pending + young < max_tombstones`),
//! so without a budget any accepted peer could fill the table with records of keys it made up,
//! and P would refuse its own engine's prefills (`Rejected::TableFull`) for `tombstone_min_life`.
//! Two caps: the peers together write at most half the table ([`PeerBudget::total_cap`]), so the
//! engine's requests and the pending registrations always keep the other half; one peer writes
//! at most a quarter ([`PeerBudget::peer_cap`]), so one peer cannot use up the others' share. A
//! message whose record would go over a cap is left unanswered and counted
//! (`DropReason::TombstoneBudget`), as when the table has no room: D repeats it, or frees by its
//! quarantine (which already covers a registration that arrives after its cancel).

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use super::PrefillTable;
use crate::machine::effects::Outbox;
use crate::machine::types::{DropReason, Time};
use crate::machine::{Config, Mutation};
use crate::PeerAddr;

/// The young records written on peers' behalf for keys P held nothing for, oldest first, and
/// how many each peer wrote. Bounded: a write over a cap is refused before it is charged, so
/// `writes` holds at most `total_cap` entries and `per_peer` at most that many peers.
#[derive(Debug)]
pub(super) struct PeerBudget {
    writes: VecDeque<(Time, PeerAddr)>,
    per_peer: BTreeMap<PeerAddr, usize>,
    total_cap: usize,
    peer_cap: usize,
    /// How long a record stays young (`Config::tombstone_min_life`).
    young_for: Duration,
}

impl PeerBudget {
    pub(super) fn new(config: &Config) -> Self {
        PeerBudget {
            writes: VecDeque::new(),
            per_peer: BTreeMap::new(),
            total_cap: Self::total_cap(config),
            peer_cap: Self::peer_cap(config),
            young_for: config.tombstone_min_life(),
        }
    }

    /// Young records all peers together may have written: half the table, so that the engine's
    /// own requests and the pending registrations always keep the other half.
    pub(super) fn total_cap(config: &Config) -> usize {
        (config.max_tombstones / 2).max(1)
    }

    /// Young records one peer may have written: a quarter of the table, half of the peers'
    /// share, so that one misbehaving peer always leaves the others half of it (it takes two
    /// at their cap to use it up). An eighth left the simulator's honest D ranks, which have
    /// a 24-record table and one or two peers, short of early cancels and releases (54 left
    /// unanswered in seed 399 at 200 requests); a quarter is 32,768 per 25 s with the
    /// defaults, about 1,300 a second per peer. At least one, so that a tiny table still takes
    /// a cancel.
    pub(super) fn peer_cap(config: &Config) -> usize {
        (config.max_tombstones / 4).max(1)
    }

    /// Forgets the writes that are no longer young at `now`.
    fn forget_old(&mut self, now: Time) {
        while self
            .writes
            .front()
            .is_some_and(|(at, _)| *at + self.young_for <= now)
        {
            let Some((_, peer)) = self.writes.pop_front() else {
                break;
            };
            if let Some(count) = self.per_peer.get_mut(&peer) {
                *count -= 1;
                if *count == 0 {
                    self.per_peer.remove(&peer);
                }
            }
        }
    }

    /// Whether `peer` may have one more record written on its behalf now.
    pub(super) fn allows(&mut self, now: Time, peer: &PeerAddr) -> bool {
        self.forget_old(now);
        self.writes.len() < self.total_cap && self.young_of(peer) < self.peer_cap
    }

    /// Counts a record written on `peer`'s behalf now (after [`Self::allows`] said yes).
    pub(super) fn charge(&mut self, now: Time, peer: &PeerAddr) {
        self.forget_old(now);
        self.writes.push_back((now, peer.clone()));
        *self.per_peer.entry(peer.clone()).or_insert(0) += 1;
    }

    /// Young records charged to `peer` (as of the last check).
    pub(super) fn young_of(&self, peer: &PeerAddr) -> usize {
        self.per_peer.get(peer).copied().unwrap_or(0)
    }

    pub(super) fn check_invariants(&self) {
        assert!(
            self.writes.len() <= self.total_cap,
            "peers wrote more than their share"
        );
        assert!(self.per_peer.values().all(|&n| n > 0 && n <= self.peer_cap));
        assert_eq!(self.per_peer.values().sum::<usize>(), self.writes.len());
    }
}

impl PrefillTable {
    /// Whether a record for a key P holds nothing for may be written on `peer`'s behalf; counts
    /// the drop if not.
    pub(super) fn peer_budget_allows(
        &mut self,
        now: Time,
        peer: &PeerAddr,
        fx: &mut Outbox,
    ) -> bool {
        if self.mutation.is(Mutation::UnboundedPeerTombstones) || self.budget.allows(now, peer) {
            return true;
        }
        fx.drop_input(DropReason::TombstoneBudget);
        false
    }

    /// Counts a record just written on `peer`'s behalf for a key P held nothing for.
    pub(super) fn charge_peer(&mut self, now: Time, peer: &PeerAddr) {
        if !self.mutation.is(Mutation::UnboundedPeerTombstones) {
            self.budget.charge(now, peer);
        }
    }
}
