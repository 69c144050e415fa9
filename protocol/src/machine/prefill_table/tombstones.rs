//! What P remembers about keys it holds no blocks for ([`PrefillTombstone`]): filing an ended
//! request, and the rules that keep a key's epoch floor (an ended, cancelled or answered attempt
//! never reaches blocks again).

use std::hash::Hash;

use crate::{Epoch, Incarnation, PairingKey, WriteFailure};

use super::{write_failed, PrefillTable, Sender};
use crate::machine::effects::Outbox;
use crate::machine::prefill::{PrefillEnded, PrefillRequest};
use crate::machine::tables::Tombstones;
use crate::machine::types::{EndpointEvent, Output, PrefillOutcome, ReleaseCause, Time};
use crate::machine::{Config, Mutation};
use crate::PeerAddr;

/// What P remembers about a key it holds no blocks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PrefillTombstone {
    /// D gave up on `epoch` (a cancel, or a release) before P's prefill finished: blocks that
    /// finish for the key are released at once with `cause`, unless a registration for a newer
    /// attempt waits; a registration for `epoch` or older was overtaken and is swallowed.
    GaveUpEarly { epoch: Epoch, cause: ReleaseCause },
    /// P answered a registration for `epoch` with `WriteFailed(replay)` without ever binding
    /// blocks to it (its wait expired, or the table was full): a registration for `epoch` or
    /// older — a duplicate or a late copy — gets the same answer and never reaches blocks; a
    /// newer one is served normally.
    Answered { epoch: Epoch, replay: WriteFailure },
    /// P's request for the key ended and its blocks are gone.
    Ended {
        /// The attempt the blocks were bound to, if any.
        epoch: Option<Epoch>,
        /// What a registration for that attempt (or an older one) is told again; `None`
        /// swallows it (the attempt was served or cancelled: D already knows).
        replay: Option<WriteFailure>,
        /// What a registration for any other attempt is told.
        newer: WriteFailure,
    },
}

/// A tombstone, and the run of the D rank it was written for (see `runs.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Record {
    pub(crate) tombstone: PrefillTombstone,
    /// The incarnation of the D rank whose registration, cancel or release the record settles;
    /// `None` where no D was involved (P's own abort of blocks nobody claimed). A record of a
    /// run its rank's newer incarnation replaced stops judging once that run can send nothing.
    pub(crate) run: Option<Incarnation>,
}

pub(super) fn tombstone_for(outcome: PrefillOutcome, epoch: Option<Epoch>) -> PrefillTombstone {
    let (replay, newer) = match outcome {
        PrefillOutcome::Sent
        | PrefillOutcome::Released(ReleaseCause::CancelledByPeer)
        | PrefillOutcome::Released(ReleaseCause::ReleasedByPeer(_))
        | PrefillOutcome::Released(ReleaseCause::PeerDead)
        | PrefillOutcome::Released(ReleaseCause::Empty) => (None, WriteFailure::Unavailable),
        PrefillOutcome::Released(ReleaseCause::LeaseExpired) => {
            (Some(WriteFailure::LeaseExpired), WriteFailure::LeaseExpired)
        }
        PrefillOutcome::Released(ReleaseCause::Aborted) => (
            Some(WriteFailure::PrefillAborted),
            WriteFailure::PrefillAborted,
        ),
        PrefillOutcome::Released(ReleaseCause::Rejected) => {
            (Some(WriteFailure::PlanMismatch), WriteFailure::Unavailable)
        }
        PrefillOutcome::Released(ReleaseCause::WriteFailed(failure)) => {
            (Some(failure), WriteFailure::Unavailable)
        }
    };
    PrefillTombstone::Ended {
        epoch,
        replay,
        newer,
    }
}

/// Records of a table expiring after this were written less than `tombstone_min_life` ago
/// (every record lives `tombstone_ttl`, which `Config::validate` keeps above it).
pub(crate) fn young_cutoff(now: Time, config: &Config) -> Time {
    now + (config.tombstone_ttl - config.tombstone_min_life())
}

/// The rule admission control keeps, on either side: a new record in a full table evicts an
/// old record, never a young one.
pub(crate) fn assert_old_record_to_evict<K: Hash + Eq + Clone, V>(
    table: &mut Tombstones<K, V>,
    now: Time,
    key: &K,
    config: &Config,
) {
    if table.is_full() && !table.contains(key) {
        let oldest = table.oldest_expiry();
        assert!(
            oldest.is_some_and(|expiry| expiry <= young_cutoff(now, config)),
            "a full tombstone table would evict a young record (expiring at {oldest:?}, now {now})"
        );
    }
}

/// The highest epoch `tombstone` settled (see [`PrefillTable::epoch_floor`]).
pub(super) fn floor_of(tombstone: &PrefillTombstone) -> Option<Epoch> {
    match tombstone {
        PrefillTombstone::GaveUpEarly { epoch, .. } | PrefillTombstone::Answered { epoch, .. } => {
            Some(*epoch)
        }
        PrefillTombstone::Ended { epoch, .. } => *epoch,
    }
}

// Admission control. A record written (made or refreshed: a raised floor makes a record young
// again) less than `Config::tombstone_min_life` ago may still be the only thing between a late
// registration copy and a later prefill's blocks, so it is never evicted: P admits a request or
// a pending registration only while every live one can still leave a record without evicting a
// young one (`requests + pending + young < max_tombstones`), and leaves unanswered the peer
// messages whose answer would write a record when there is no such room. Then the table, when
// full, always holds an old record to evict.
impl PrefillTable {
    /// Tombstone writes within the last `tombstone_min_life`: at least the young records (a
    /// record written twice, or removed early, still counts: an over-estimate, on the safe
    /// side).
    pub(super) fn young_tombstones(&mut self, now: Time) -> usize {
        self.tombstones
            .written_after(young_cutoff(now, &self.config))
    }

    /// Whether P can take on one more thing that may end in a new tombstone (a request, a
    /// pending registration, an answer or a cancel for a key it holds nothing for).
    pub(super) fn tombstone_room(&mut self, now: Time) -> bool {
        if self.mutation.is(Mutation::EvictYoungTombstones) {
            return true;
        }
        let reserved = self.requests.len() + self.pending.len();
        reserved + self.young_tombstones(now) < self.config.max_tombstones
    }

    /// Remembers `tombstone` for `key`, written for the D run `run`. Admission kept room: a
    /// new record in a full table evicts an old one, never a young one.
    pub(super) fn remember(
        &mut self,
        now: Time,
        key: PairingKey,
        tombstone: PrefillTombstone,
        run: Option<Incarnation>,
    ) {
        if !self.mutation.is(Mutation::EvictYoungTombstones) {
            assert_old_record_to_evict(&mut self.tombstones, now, &key, &self.config);
        }
        let record = Record { tombstone, run };
        self.tombstones
            .insert(key, record, now + self.config.tombstone_ttl);
    }

    /// The record of `key` refused a registration: it is written again, so that it outlives
    /// that registration's copies and resends as a new record would. Each D counts the span
    /// of its own sends from its first one (`Config::tombstone_min_life`), and a sibling D of
    /// the key (a decode leg the router sent twice) may start sending long after the record
    /// was written. Without room for a young record the record stays as it is (admission
    /// control never lets young records fill the table).
    pub(super) fn refresh(&mut self, now: Time, key: &PairingKey) {
        if self.mutation.is(Mutation::SkipRecordRefresh) || !self.tombstone_room(now) {
            return;
        }
        if let Some(Record { tombstone, run }) = self.tombstones.get(key).copied() {
            self.remember(now, key.clone(), tombstone, run);
        }
    }

    pub(super) fn file_ended(&mut self, now: Time, ended: PrefillEnded, fx: &mut Outbox) {
        let PrefillEnded {
            common,
            outcome,
            epoch,
        } = ended;
        tracing::debug!(key = %common.key, ?epoch, ?outcome, "prefill request ended");
        self.by_request.remove(&common.request);
        if let Some(producing) = common.producing.filter(|p| p.still_computing()) {
            // The engine goes on reporting layers of a request that ended here (D gave up).
            if self.ended_computing.len() >= self.config.max_requests {
                self.ended_computing.pop_first();
            }
            let layers = producing.plan.layers;
            self.ended_computing.insert(common.request.clone(), layers);
        }
        // The run the blocks were bound to; else the run an older record of the key speaks for
        // (the floor, or the early give-up, this request ended by).
        let bound = self.bound.remove(&common.key);
        // The record speaks for the blocks' run, unless a newer incarnation replaced that run
        // and an older record of the key speaks for a live one: an answer P gave the live run
        // while this request held the blocks (a restarted D's registration for a newer
        // attempt) raised the floor on its behalf, and a record of the replaced run would
        // stop judging that run's copies, which would then wait for a later prefill of the key
        // in blocks D already freed on the answer. The replaced run's own late messages are
        // taken as the live run's and meet the same floor.
        let older_run = self.tombstones.get(&common.key).and_then(|old| old.run);
        let run = if self.runs.is_replaced(bound)
            && older_run.is_some()
            && !self.runs.is_replaced(older_run)
        {
            older_run
        } else {
            bound.or(older_run)
        };
        // Never lower the floor an older request of the key left behind. The request's
        // admission reserved room for this record (see `tombstone_room`).
        if !self.mutation.is(Mutation::EvictYoungTombstones) {
            assert_old_record_to_evict(&mut self.tombstones, now, &common.key, &self.config);
        }
        self.tombstones
            .upsert(common.key.clone(), now + self.config.tombstone_ttl, |old| {
                let floor = old.and_then(|old| floor_of(&old.tombstone));
                Record {
                    tombstone: tombstone_for(outcome, epoch.max(floor)),
                    run,
                }
            });
        fx.emit(Output::Event(EndpointEvent::Prefill {
            request: common.request,
            key: common.key,
            outcome,
            blocks: common.blocks,
        }));
    }

    /// The highest epoch an ended request of `key` (or an early cancel, release or answer)
    /// settled.
    pub(super) fn epoch_floor(&self, key: &PairingKey) -> Option<Epoch> {
        floor_of(&self.tombstones.get(key)?.tombstone)
    }

    /// What P remembers about `key`, if anything.
    pub(super) fn tombstone(&self, key: &PairingKey) -> Option<PrefillTombstone> {
        self.tombstones.get(key).map(|record| record.tombstone)
    }

    /// Whether `from` may cancel or release `key`: the peer the key's blocks are bound to (or
    /// whose registration waits), or anyone while no peer has claimed the key.
    pub(super) fn may_settle(&self, key: &PairingKey, from: &PeerAddr) -> bool {
        let owner = self
            .requests
            .get(key)
            .and_then(PrefillRequest::bound_peer)
            .or_else(|| self.pending.get(key).map(|p| &p.from.addr));
        owner.is_none_or(|owner| owner == from)
    }

    /// Whether [`Self::raise_floor`] for `epoch` would write a record (the key's floor is below
    /// it, or there is none).
    pub(super) fn floor_below(&self, key: &PairingKey, epoch: Epoch) -> bool {
        self.epoch_floor(key).is_none_or(|floor| floor < epoch)
    }

    /// Makes sure registrations for `epoch` or older of `key` never reach blocks again (D's run
    /// `run` cancelled that epoch): raises the key's floor, keeping what the tombstone says
    /// otherwise. True if it wrote a record.
    pub(super) fn raise_floor(
        &mut self,
        now: Time,
        key: &PairingKey,
        epoch: Epoch,
        run: Incarnation,
    ) -> bool {
        let cancelled = PrefillTombstone::GaveUpEarly {
            epoch,
            cause: ReleaseCause::CancelledByPeer,
        };
        let raised = match self.tombstone(key) {
            Some(
                PrefillTombstone::GaveUpEarly { epoch: old, .. }
                | PrefillTombstone::Answered { epoch: old, .. }
                | PrefillTombstone::Ended {
                    epoch: Some(old), ..
                },
            ) if epoch <= old => None,
            // D gave up on a newer attempt than the one P remembers, before P finished it.
            Some(PrefillTombstone::GaveUpEarly { .. } | PrefillTombstone::Answered { .. })
            | None => Some(cancelled),
            // P's blocks are gone; keep what a registration is told, raise the floor.
            Some(PrefillTombstone::Ended { replay, newer, .. }) => Some(PrefillTombstone::Ended {
                epoch: Some(epoch),
                replay,
                newer,
            }),
        };
        let Some(tombstone) = raised else {
            return false;
        };
        self.remember(now, key.clone(), tombstone, Some(run));
        true
    }

    /// Answers a registration (of `to`) P will never serve, and remembers the answer
    /// so that a copy of the registration arriving later cannot reach blocks that finish
    /// afterwards. True if it wrote a record (see [`Self::floor_below`]).
    pub(super) fn answer_unbound(
        &mut self,
        now: Time,
        to: &Sender,
        key: &PairingKey,
        epoch: Epoch,
        failure: WriteFailure,
        fx: &mut Outbox,
    ) -> bool {
        fx.send(&to.addr, write_failed(key, epoch, self.rank, failure));
        if !self.floor_below(key, epoch) {
            return false;
        }
        let answered = PrefillTombstone::Answered {
            epoch,
            replay: failure,
        };
        self.remember(now, key.clone(), answered, Some(to.run));
        true
    }
}
