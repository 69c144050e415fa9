//! Which run (incarnation) of a D rank P's memory of a key speaks for.
//!
//! A restarted D starts its attempts again — a router retries with its default epoch 1 — while
//! P may still remember the dead incarnation's attempt at the same key and epoch: its floor would
//! swallow the retry, its replay would answer it with the old attempt's `WriteFailed`. So every
//! record carries the run it was written for, and a record of a run that a newer incarnation of
//! its rank replaced stops judging anything once that run's messages can no longer arrive.
//!
//! When can they no longer arrive? A message names no incarnation on the wire, and the shells do
//! not order them by incarnation: a NIXL notification names only the agent, which keeps its name
//! across restarts, so one the old process sent before it died may be polled after the new
//! process's handshake, and the rank actor may handle a feed queued before that handshake after
//! it. P then takes it as the new incarnation's. Every message arrives within
//! `max_message_delay` of being sent or never, and the old process sent it before it died, so
//! before the new one connected: from `max_message_delay` after P connected to the new
//! incarnation, nothing of the old one can come. Until then (the *restart window*) P leaves
//! unanswered every registration of the restarted rank (it may be a late copy of the old one's,
//! naming blocks the new process gave to something else) and every message that a record of the
//! old run would judge (`DropReason::PriorIncarnation`); D repeats its registration past the
//! window (`max_register_retries × register_retry_interval` spans it with the defaults). After
//! it, a record of the replaced run is dropped when a message of its key arrives, and does not
//! release the blocks of a new prefill of the key.
//!
//! A reconnection of the *same* run (a false death healed: P or D declared the other dead, say
//! after a stall, and they shook hands again) opens the same window for registrations: one of
//! the old session may still arrive, or sit in a stalled P's queue, while D has fenced and
//! reused the blocks it names (simulator seed 92 of the stall sweeps). D repeats its live
//! registrations past the window.

use std::collections::BTreeMap;
use std::time::Duration;

use super::PrefillTable;
use crate::machine::effects::Outbox;
use crate::machine::types::{DropReason, Time};
use crate::machine::{Config, Mutation};
use crate::{Incarnation, PairingKey, PeerAddr};

/// The D rank a message came from, and the incarnation P's connection to it reaches (the
/// message is taken as that incarnation's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Sender {
    pub(crate) addr: PeerAddr,
    pub(crate) run: Incarnation,
}

/// The incarnation of a rank P connected to last.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Current {
    run: Incarnation,
    /// When P connected to it (the least recent is forgotten first at capacity).
    since: Time,
    /// Until when a message of the incarnation it replaced may still arrive; `None` if it
    /// replaced none P knew of.
    prior_until: Option<Time>,
}

/// What P knows of D ranks' incarnations. Bounded by `max_peers` on both maps; forgetting an
/// entry at capacity only makes P judge by old records as it did before incarnations were
/// tracked (a liveness cost, never a safety one: a record that judges stops registrations).
#[derive(Debug)]
pub(super) struct Runs {
    current: BTreeMap<PeerAddr, Current>,
    /// Incarnations replaced by a newer one of their rank, with the end of their restart window.
    replaced: BTreeMap<Incarnation, Time>,
    limit: usize,
    delay: Duration,
}

/// How a record of `run` may judge a message about its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RunVerdict {
    /// The record's run is live or unknown (or none): it judges as written.
    Judge,
    /// The run was replaced and its messages may still arrive (taken as the new run's): the
    /// message may be the old run's; it is left unanswered.
    Ambiguous,
    /// The run was replaced and can send nothing more: the record speaks for nobody.
    Discard,
}

impl Runs {
    pub(super) fn new(config: &Config) -> Self {
        Runs {
            current: BTreeMap::new(),
            replaced: BTreeMap::new(),
            limit: config.max_peers,
            delay: config.max_message_delay,
        }
    }

    /// P connected to incarnation `run` of `peer`; `rejoin_window`: a reconnection of the run
    /// P knew opens a window too (off only under the deliberate bug
    /// `serve_rejoined_session_at_once`).
    pub(super) fn connected(
        &mut self,
        now: Time,
        peer: &PeerAddr,
        run: Incarnation,
        rejoin_window: bool,
    ) {
        let known = self.current.get(peer).copied();
        // A run that is current again (a replayed handshake) is no longer replaced.
        self.replaced.remove(&run);
        let prior_until = match known {
            Some(old) if old.run != run => {
                let until = now + self.delay;
                self.note_replaced(old.run, until);
                Some(until)
            }
            // The same run again: its previous connection ended (a false death healed — a
            // repeated handshake of a live connection never reaches here), and a registration
            // of that old session may still arrive (or sit in this process's queue through a
            // stall) and name blocks D fenced and reused since. The same window as a restart's
            // keeps registrations out until the old session's messages can no longer arrive.
            Some(old) if rejoin_window => {
                let until = now + self.delay;
                Some(old.prior_until.map_or(until, |prior| prior.max(until)))
            }
            Some(old) => old.prior_until,
            None => None,
        };
        if known.is_none() && self.current.len() >= self.limit {
            let oldest = self
                .current
                .iter()
                .min_by_key(|(_, c)| c.since)
                .map(|(addr, _)| addr.clone());
            if let Some(oldest) = oldest {
                self.current.remove(&oldest);
            }
        }
        self.current.insert(
            peer.clone(),
            Current {
                run,
                since: now,
                prior_until,
            },
        );
    }

    fn note_replaced(&mut self, run: Incarnation, until: Time) {
        if !self.replaced.contains_key(&run) && self.replaced.len() >= self.limit {
            let oldest = self
                .replaced
                .iter()
                .min_by_key(|(_, until)| **until)
                .map(|(run, _)| *run);
            if let Some(oldest) = oldest {
                self.replaced.remove(&oldest);
            }
        }
        self.replaced.insert(run, until);
    }

    /// Whether `peer` restarted less than `max_message_delay` ago (as P knows it): a message
    /// taken as its new incarnation's may be the old one's.
    pub(super) fn in_restart_window(&self, now: Time, peer: &PeerAddr) -> bool {
        self.current
            .get(peer)
            .and_then(|c| c.prior_until)
            .is_some_and(|until| now < until)
    }

    /// Whether `run` was replaced by a newer incarnation of its rank.
    pub(super) fn is_replaced(&self, run: Option<Incarnation>) -> bool {
        run.is_some_and(|run| self.replaced.contains_key(&run))
    }

    /// How a record written for `run` may judge a message arriving now.
    pub(super) fn verdict(&self, now: Time, run: Option<Incarnation>) -> RunVerdict {
        match run.and_then(|run| self.replaced.get(&run)) {
            None => RunVerdict::Judge,
            Some(until) if now < *until => RunVerdict::Ambiguous,
            Some(_) => RunVerdict::Discard,
        }
    }

    pub(super) fn check_invariants(&self) {
        assert!(self.current.len() <= self.limit);
        assert!(self.replaced.len() <= self.limit);
        for current in self.current.values() {
            assert!(
                !self.replaced.contains_key(&current.run),
                "a current run is not replaced"
            );
        }
    }
}

impl PrefillTable {
    /// P connected to incarnation `run` of the D rank `peer` (a first connection, a
    /// reconnection, or a restart).
    pub(crate) fn on_peer_connected(&mut self, now: Time, peer: &PeerAddr, run: Incarnation) {
        let rejoin_window = !self.mutation.is(Mutation::ServeRejoinedSessionAtOnce);
        self.runs.connected(now, peer, run, rejoin_window);
    }

    /// Whether a message of `from` about `key` may be handled: left unanswered (and counted) if
    /// it may be a late message of a replaced incarnation; otherwise a record of the key written
    /// for a replaced run that can send nothing more is forgotten first, so that what follows
    /// sees the key as new. `registration`: a registration, which names blocks, is also left
    /// unanswered through the whole restart window of its rank, record or not.
    pub(super) fn admit_run(
        &mut self,
        now: Time,
        key: &PairingKey,
        from: &Sender,
        registration: bool,
        fx: &mut Outbox,
    ) -> bool {
        let trusting = self.mutation.is(Mutation::AcceptPriorIncarnation);
        if registration && !trusting && self.runs.in_restart_window(now, &from.addr) {
            fx.drop_input(DropReason::PriorIncarnation);
            return false;
        }
        let run = self.tombstones.get(key).and_then(|record| record.run);
        match self.runs.verdict(now, run) {
            RunVerdict::Judge => true,
            RunVerdict::Ambiguous if !trusting => {
                fx.drop_input(DropReason::PriorIncarnation);
                false
            }
            RunVerdict::Ambiguous | RunVerdict::Discard => {
                self.tombstones.remove(key);
                true
            }
        }
    }
}

#[cfg(test)]
impl Sender {
    /// The incarnation table tests take every bare address to be.
    pub(crate) const TEST_RUN: Incarnation = Incarnation(0x7e57);
}

/// Table tests name a bare address; it is taken as [`Sender::TEST_RUN`].
#[cfg(test)]
impl From<PeerAddr> for Sender {
    fn from(addr: PeerAddr) -> Sender {
        Sender {
            addr,
            run: Sender::TEST_RUN,
        }
    }
}

#[cfg(test)]
impl From<&PeerAddr> for Sender {
    fn from(addr: &PeerAddr) -> Sender {
        Sender::from(addr.clone())
    }
}
