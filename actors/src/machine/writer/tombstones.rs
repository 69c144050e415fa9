//! What P remembers about keys it holds no blocks for ([`PrefillTombstone`]): filing an ended
//! request, and the rules that keep a key's epoch floor (an ended, cancelled or answered attempt
//! never reaches blocks again).

use kvhandoff_protocol::{Epoch, PairingKey, WriteFailure};

use super::{write_failed, Writer};
use crate::machine::effects::Effects;
use crate::machine::prefill::{PrefillEnded, PrefillRequest};
use crate::machine::types::{EngineEvent, Output, PrefillOutcome, ReleaseCause, Time};
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

/// The highest epoch `tombstone` settled (see [`Writer::epoch_floor`]).
pub(super) fn floor_of(tombstone: &PrefillTombstone) -> Option<Epoch> {
    match tombstone {
        PrefillTombstone::GaveUpEarly { epoch, .. } | PrefillTombstone::Answered { epoch, .. } => {
            Some(*epoch)
        }
        PrefillTombstone::Ended { epoch, .. } => *epoch,
    }
}

impl Writer {
    pub(super) fn file_ended(&mut self, now: Time, ended: PrefillEnded, fx: &mut Effects<'_>) {
        let PrefillEnded {
            common,
            outcome,
            epoch,
        } = ended;
        tracing::debug!(key = %common.key, ?epoch, ?outcome, "prefill request ended");
        self.by_request.remove(&common.request);
        // Never lower the floor an older request of the key left behind.
        self.tombstones
            .upsert(common.key.clone(), now + self.config.tombstone_ttl, |old| {
                tombstone_for(outcome, epoch.max(old.and_then(floor_of)))
            });
        fx.emit(Output::Event(EngineEvent::Prefill {
            request: common.request,
            key: common.key,
            outcome,
            blocks: common.blocks,
        }));
    }

    /// The highest epoch an ended request of `key` (or an early cancel, release or answer)
    /// settled.
    pub(super) fn epoch_floor(&self, key: &PairingKey) -> Option<Epoch> {
        floor_of(self.tombstones.get(key)?)
    }

    /// Whether `from` may cancel or release `key`: the peer the key's blocks are bound to (or
    /// whose registration waits), or anyone while no peer has claimed the key.
    pub(super) fn may_settle(&self, key: &PairingKey, from: &PeerAddr) -> bool {
        let owner = self
            .requests
            .get(key)
            .and_then(PrefillRequest::bound_peer)
            .or_else(|| self.pending.get(key).map(|p| &p.from));
        owner.is_none_or(|owner| owner == from)
    }

    /// Makes sure registrations for `epoch` or older of `key` never reach blocks again (D
    /// cancelled that epoch): raises the key's floor, keeping what the tombstone says otherwise.
    pub(super) fn raise_floor(&mut self, now: Time, key: &PairingKey, epoch: Epoch) {
        let cancelled = PrefillTombstone::GaveUpEarly {
            epoch,
            cause: ReleaseCause::CancelledByPeer,
        };
        let raised = match self.tombstones.get(key).copied() {
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
        if let Some(tombstone) = raised {
            self.tombstones
                .insert(key.clone(), tombstone, now + self.config.tombstone_ttl);
        }
    }

    /// Answers a registration P will never serve, and remembers the answer so that a copy of
    /// the registration arriving later cannot reach blocks that finish afterwards.
    pub(super) fn answer_unbound(
        &mut self,
        now: Time,
        to: &PeerAddr,
        key: &PairingKey,
        epoch: Epoch,
        failure: WriteFailure,
        fx: &mut Effects<'_>,
    ) {
        fx.send(to, write_failed(key, epoch, self.rank, failure));
        if self.epoch_floor(key).is_some_and(|floor| floor >= epoch) {
            return;
        }
        self.tombstones.insert(
            key.clone(),
            PrefillTombstone::Answered {
                epoch,
                replay: failure,
            },
            now + self.config.tombstone_ttl,
        );
    }
}
