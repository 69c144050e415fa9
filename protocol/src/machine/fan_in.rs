//! The fan-in of one multi-rank request on one rank.
//!
//! With heterogeneous tensor parallelism a D rank may receive from several P ranks (P has more
//! ranks than D), or a P rank may write to several D ranks (P has fewer). Such a request is
//! split into one ordinary 1:1 sub-request per (P rank → D rank) pair, under the pair's own key
//! ([`PairingKey::for_pair`](crate::PairingKey::for_pair)): each sub-request is a plain
//! `DecodeAllocated` with `expected_writes: 1` on D and a plain `PrefillFinished` on P, run by
//! the machines that already register, cancel and fence for one peer. What is new is only the
//! bookkeeping above them, kept here, pure:
//!
//! - the sub-requests of one rank share its blocks (D: the targets every pair writes a slice
//!   of; P: the sources every pair reads), allocated once;
//! - when one sub-request fails, its live siblings are to be aborted at once, so that each
//!   cancels at its own peer rank instead of waiting for its deadline;
//! - the request is `Ready` only when every sub-request succeeded, and otherwise failed with
//!   the first failure;
//! - the shared blocks go back only once **every** sub-request handed them back: each
//!   sub-request's hand-back is the proof (its `FreeProof`, or its write's end on P) that its
//!   own peer rank can no longer write (or read) them, and no other proof covers that rank.
//!
//! A D sub-request fenced by its P rank's death tells its failure early
//! ([`EndpointEvent::DecodeFenced`]): the fan-in takes it as the sub-request's failure (the
//! request's outcome, the siblings' aborts) but not as its hand-back, and says once, for the
//! whole request, that it failed with its blocks still out ([`FanInStep::fenced`]).
//!
//! The engine (or its connector) owns one [`FanIn`] per multi-rank request per rank, feeds it
//! every event of the request's sub-requests, and does what each [`FanInStep`] says.

use std::collections::BTreeMap;

use crate::{BlockIds, PairingKey, ReleaseReason, RequestId};

use super::read_types::{ExportEnd, ExportOutcome, ImportOutcome};
use super::types::{DecodeOutcome, EndpointEvent, PrefillOutcome, ReleaseCause};
use super::{ActiveMutation, DecodeFailure, Mutation};

mod fenced;
#[cfg(test)]
mod tests;
mod types;

pub use types::{FanCounts, FanInError, FanInStep, FanOutcome, FanSide, SubFailure, SubRequest};

/// Most sub-requests one fan-in tracks: the P ranks feeding one D rank, or the D ranks one P
/// rank writes, are at most one side's TP ranks ([`MAX_PARALLEL`](crate::MAX_PARALLEL)).
pub const MAX_SUB_REQUESTS: usize = crate::MAX_PARALLEL as usize;

/// Where one sub-request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum SubState {
    /// Started, not ended.
    Live,
    /// Started, not ended, and already named for abort (by a sibling's failure or by
    /// [`FanIn::abort_all`]): never named again.
    Aborting,
    /// Failed (its peer rank died, [`EndpointEvent::DecodeFenced`]) but not ended: its blocks
    /// stay out until its final event, which repeats the failure. Not named for abort: an
    /// abort cannot free them sooner.
    Fenced(SubFailure),
    /// Ended well, its blocks handed back.
    Succeeded,
    /// Ended in failure (or never started), its blocks handed back.
    Failed(SubFailure),
}

impl SubState {
    fn ended(self) -> bool {
        match self {
            SubState::Live | SubState::Aborting | SubState::Fenced(_) => false,
            SubState::Succeeded | SubState::Failed(_) => true,
        }
    }
}

/// The fan-in of one multi-rank request on one rank: see the module documentation.
///
/// ```
/// use kvhandoff_protocol::machine::{
///     DecodeFailure, DecodeOutcome, EndpointEvent, FanIn, FanOutcome, FanSide, FreeProof,
///     SubFailure, SubRequest,
/// };
/// use kvhandoff_protocol::{BlockIds, Epoch, PairingKey, RequestId};
///
/// let key = PairingKey::new("cmpl-7").unwrap();
/// let blocks = BlockIds::single_group(vec![4, 5]);
/// let sub = |p: u32| SubRequest {
///     request: RequestId::new(format!("d7-from-p{p}")).unwrap(),
///     key: key.for_pair(p, 0).unwrap(),
/// };
/// let mut fan = FanIn::new(FanSide::Decode, blocks.clone(), [sub(0), sub(1)]).unwrap();
/// let ended = |p: u32, outcome, proof| EndpointEvent::Decode {
///     request: sub(p).request,
///     key: sub(p).key,
///     epoch: Epoch::FIRST,
///     outcome,
///     proof,
///     blocks: blocks.clone(),
/// };
/// // P rank 0's write landed; P rank 1 died: D fails the request at once, but the blocks
/// // stay held until rank 1's sub-request hands them back (after its fence).
/// let failed = DecodeOutcome::Failed(DecodeFailure::PeerDead);
/// let step = fan.on_event(&ended(0, DecodeOutcome::Ready, FreeProof::WritesCompleted)).unwrap();
/// assert_eq!((step.outcome, step.hand_back), (None, None));
/// let step = fan.on_event(&ended(1, failed, FreeProof::DeadPeerFence)).unwrap();
/// assert_eq!(
///     step.outcome,
///     Some(FanOutcome::Failed {
///         request: sub(1).request,
///         failure: SubFailure::Decode(DecodeFailure::PeerDead),
///     })
/// );
/// assert_eq!(step.hand_back, Some(blocks.clone()));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct FanIn {
    side: FanSide,
    blocks: BlockIds,
    subs: BTreeMap<RequestId, (PairingKey, SubState)>,
    outcome: Option<FanOutcome>,
    handed_back: bool,
    /// [`FanInStep::fenced`] was reported.
    fenced: bool,
    mutation: ActiveMutation,
}

impl FanIn {
    /// A fan-in over `subs`, all started (or about to be) on this rank over `blocks`.
    ///
    /// # Errors
    /// [`FanInError::NoSubRequests`], or a duplicate id or key.
    pub fn new(
        side: FanSide,
        blocks: BlockIds,
        subs: impl IntoIterator<Item = SubRequest>,
    ) -> Result<FanIn, FanInError> {
        let mut table = BTreeMap::new();
        let mut keys = std::collections::BTreeSet::new();
        for sub in subs {
            if table.len() == MAX_SUB_REQUESTS {
                return Err(FanInError::TooManySubRequests);
            }
            if !keys.insert(sub.key.clone()) {
                return Err(FanInError::DuplicateKey(sub.key));
            }
            if table.contains_key(&sub.request) {
                return Err(FanInError::DuplicateRequest(sub.request));
            }
            table.insert(sub.request, (sub.key, SubState::Live));
        }
        if table.is_empty() {
            return Err(FanInError::NoSubRequests);
        }
        Ok(FanIn {
            side,
            blocks,
            subs: table,
            outcome: None,
            handed_back: false,
            fenced: false,
            mutation: ActiveMutation::default(),
        })
    }

    /// Runs this fan-in with a deliberate bug, for the simulator's mutation check.
    #[cfg(feature = "mutations")]
    #[doc(hidden)]
    pub fn set_mutation(&mut self, mutation: Option<Mutation>) {
        self.mutation = ActiveMutation(mutation);
    }

    /// The side this fan-in tracks.
    pub fn side(&self) -> FanSide {
        self.side
    }

    /// The shared blocks.
    pub fn blocks(&self) -> &BlockIds {
        &self.blocks
    }

    /// The outcome, once decided.
    pub fn outcome(&self) -> Option<&FanOutcome> {
        self.outcome.as_ref()
    }

    /// Whether the shared blocks were handed back.
    pub fn is_handed_back(&self) -> bool {
        self.handed_back
    }

    /// Whether [`FanInStep::fenced`] was reported: the request failed with its blocks out.
    pub fn is_fenced(&self) -> bool {
        self.fenced
    }

    /// How many sub-requests are live, succeeded and failed.
    pub fn counts(&self) -> FanCounts {
        let mut counts = FanCounts::default();
        for (_, state) in self.subs.values() {
            match state {
                SubState::Live | SubState::Aborting | SubState::Fenced(_) => counts.live += 1,
                SubState::Succeeded => counts.succeeded += 1,
                SubState::Failed(_) => counts.failed += 1,
            }
        }
        counts
    }

    /// The sub-requests not ended yet, in id order.
    pub fn live(&self) -> impl Iterator<Item = &RequestId> + '_ {
        self.subs
            .iter()
            .filter(|(_, (_, state))| !state.ended())
            .map(|(id, _)| id)
    }

    /// Every sub-request, in id order.
    pub fn subs(&self) -> impl Iterator<Item = &RequestId> + '_ {
        self.subs.keys()
    }

    /// The engine aborts the whole request: the live sub-requests not yet named for abort, which
    /// the engine aborts now (each then ends with its own event). The outcome is decided by the
    /// first of those events, as for any failure.
    pub fn abort_all(&mut self) -> Vec<RequestId> {
        let mut abort = Vec::new();
        for (id, (_, state)) in &mut self.subs {
            if *state == SubState::Live {
                *state = SubState::Aborting;
                abort.push(id.clone());
            }
        }
        abort
    }

    /// A sub-request's event: its terminal one (its blocks handed back), or the early failure
    /// of a D sub-request fenced by its peer rank's death. What the engine does next.
    ///
    /// # Errors
    /// [`FanInError`] for an event that is not the first terminal event of one of this
    /// fan-in's sub-requests, with its key and the shared blocks (or its first early failure,
    /// with its key), or a terminal event that breaks the early failure's promise; nothing
    /// changed then.
    pub fn on_event(&mut self, event: &EndpointEvent) -> Result<FanInStep, FanInError> {
        let (request, key, blocks, result) = match (self.side, event) {
            (
                FanSide::Decode,
                EndpointEvent::DecodeFenced {
                    request,
                    key,
                    failure,
                    ..
                },
            ) => return self.on_fenced(request, key, *failure),
            (
                FanSide::Decode,
                EndpointEvent::Decode {
                    request,
                    key,
                    outcome,
                    blocks,
                    ..
                },
            ) => {
                let result = match outcome {
                    DecodeOutcome::Ready => SubState::Succeeded,
                    DecodeOutcome::Failed(failure) => {
                        SubState::Failed(SubFailure::Decode(*failure))
                    }
                };
                (request, key, blocks, result)
            }
            (
                FanSide::Prefill,
                EndpointEvent::Prefill {
                    request,
                    key,
                    outcome,
                    blocks,
                },
            ) => (request, key, blocks, prefill_result(*outcome)),
            (
                FanSide::Reader,
                EndpointEvent::Import {
                    request,
                    key,
                    outcome,
                    blocks,
                    ..
                },
            ) => {
                let result = match outcome {
                    ImportOutcome::Loaded => SubState::Succeeded,
                    ImportOutcome::Recompute { failure, .. } | ImportOutcome::Failed(failure) => {
                        SubState::Failed(SubFailure::Import(*failure))
                    }
                };
                (request, key, blocks, result)
            }
            (
                FanSide::Holder,
                EndpointEvent::Export {
                    request,
                    key,
                    outcome,
                    blocks,
                    ..
                },
            ) => (request, key, blocks, export_result(*outcome)),
            (expected, EndpointEvent::Decode { .. }) => {
                return Err(FanInError::WrongSide {
                    expected,
                    got: "decode",
                })
            }
            (expected, EndpointEvent::DecodeFenced { .. }) => {
                return Err(FanInError::WrongSide {
                    expected,
                    got: "decode-fenced",
                })
            }
            (expected, EndpointEvent::Prefill { .. }) => {
                return Err(FanInError::WrongSide {
                    expected,
                    got: "prefill",
                })
            }
            (expected, EndpointEvent::Export { .. }) => {
                return Err(FanInError::WrongSide {
                    expected,
                    got: "export",
                })
            }
            (expected, EndpointEvent::Import { .. }) => {
                return Err(FanInError::WrongSide {
                    expected,
                    got: "import",
                })
            }
        };
        let expected = self.live_key(request)?;
        if expected != key {
            return Err(FanInError::KeyMismatch {
                request: request.clone(),
                expected: expected.clone(),
                got: key.clone(),
            });
        }
        if *blocks != self.blocks {
            return Err(FanInError::BlocksMismatch(request.clone()));
        }
        if let Some((_, SubState::Fenced(failure))) = self.subs.get(request) {
            if result != SubState::Failed(*failure) {
                return Err(FanInError::FencedOutcomeChanged(request.clone()));
            }
        }
        Ok(self.end(request, result))
    }

    /// The endpoint refused to start `request` (its call was rejected): it counts as failed
    /// and handed back, since its peer rank never learned of the blocks.
    ///
    /// # Errors
    /// [`FanInError::UnknownRequest`] or [`FanInError::AlreadyEnded`].
    pub fn not_started(&mut self, request: &RequestId) -> Result<FanInStep, FanInError> {
        self.live_key(request)?;
        Ok(self.end(request, SubState::Failed(SubFailure::NotStarted)))
    }

    /// The key of the live sub-request `request`.
    fn live_key(&self, request: &RequestId) -> Result<&PairingKey, FanInError> {
        match self.subs.get(request) {
            None => Err(FanInError::UnknownRequest(request.clone())),
            Some((_, state)) if state.ended() => Err(FanInError::AlreadyEnded(request.clone())),
            Some((key, _)) => Ok(key),
        }
    }

    fn end(&mut self, request: &RequestId, result: SubState) -> FanInStep {
        let slot = self
            .subs
            .get_mut(request)
            .expect("checked live by the caller");
        slot.1 = result;
        let mut step = FanInStep::default();
        // The deliberate bug: a reader decides `Ready` at its first loaded part, so a later
        // failure of another holder rank's part neither fails the read nor aborts a sibling.
        if self.side == FanSide::Reader
            && result == SubState::Succeeded
            && self.outcome.is_none()
            && self.mutation.is(Mutation::ReaderReadyOnFirstPart)
        {
            self.outcome = Some(FanOutcome::Ready);
            step.outcome = Some(FanOutcome::Ready);
        }
        if let SubState::Failed(failure) = result {
            if self.outcome.is_none() {
                let outcome = FanOutcome::Failed {
                    request: request.clone(),
                    failure,
                };
                self.outcome = Some(outcome.clone());
                step.outcome = Some(outcome);
                // The request cannot be ready any more: every sibling still live would only
                // hold its peer rank (and the shared blocks) until its deadline.
                step.abort = self.abort_all();
            }
        }
        let all_ended = self.subs.values().all(|(_, state)| state.ended());
        if all_ended && self.outcome.is_none() {
            self.outcome = Some(FanOutcome::Ready);
            step.outcome = Some(FanOutcome::Ready);
        }
        // The deliberate bug: a failed sub-request's hand-back is taken for all of them.
        let early = self.mutation.is(Mutation::FreeOnFirstSourceSettled)
            && matches!(result, SubState::Failed(_));
        if !self.handed_back && (all_ended || early) {
            self.handed_back = true;
            step.hand_back = Some(self.blocks.clone());
        }
        self.check_invariants();
        step
    }

    /// The fan-in's own rules, checked after every change.
    fn check_invariants(&self) {
        let all_ended = self.subs.values().all(|(_, state)| state.ended());
        let all_succeeded = self
            .subs
            .values()
            .all(|(_, state)| *state == SubState::Succeeded);
        if !self.mutation.is(Mutation::FreeOnFirstSourceSettled) {
            assert_eq!(
                self.handed_back, all_ended,
                "the shared blocks go back exactly when every sub-request handed them back"
            );
        }
        match &self.outcome {
            None => assert!(
                !all_ended,
                "a request whose sub-requests all ended has an outcome"
            ),
            Some(FanOutcome::Ready) => assert!(
                all_succeeded || self.mutation.is(Mutation::ReaderReadyOnFirstPart),
                "Ready needs every sub-request"
            ),
            Some(FanOutcome::Failed { request, failure }) => assert!(
                matches!(
                    self.subs.get(request).map(|(_, state)| *state),
                    Some(SubState::Failed(f) | SubState::Fenced(f)) if f == *failure
                ),
                "the outcome names a failed sub-request"
            ),
        }
        let any_fenced = self
            .subs
            .values()
            .any(|(_, state)| matches!(state, SubState::Fenced(_)));
        if self.fenced || any_fenced {
            assert!(
                matches!(self.outcome, Some(FanOutcome::Failed { .. })),
                "a request told fenced has failed, and never becomes Ready"
            );
        }
    }
}

/// What an export's end means to the request: read, or not needed (the reader's own prefix
/// cache held it all, or there was nothing to read), is a success.
fn export_result(outcome: ExportOutcome) -> SubState {
    match outcome {
        ExportOutcome::Read
        | ExportOutcome::Released(ExportEnd::FullPrefixHit | ExportEnd::Empty) => {
            SubState::Succeeded
        }
        ExportOutcome::Released(
            end @ (ExportEnd::LeaseExpired
            | ExportEnd::Declined
            | ExportEnd::ReaderFailed
            | ExportEnd::ReaderAborted
            | ExportEnd::Aborted
            | ExportEnd::GrantFenced),
        ) => SubState::Failed(SubFailure::Export(end)),
    }
}

/// What a P sub-request's end means to the request: a completed write, or a release by which
/// its D rank needed nothing (a full prefix hit, nothing to send, already read), is a success.
fn prefill_result(outcome: PrefillOutcome) -> SubState {
    let failed = |cause| SubState::Failed(SubFailure::Prefill(cause));
    match outcome {
        PrefillOutcome::Sent => SubState::Succeeded,
        PrefillOutcome::Released(cause) => match cause {
            ReleaseCause::Empty
            | ReleaseCause::ReleasedByPeer(ReleaseReason::FullPrefixHit)
            | ReleaseCause::ReleasedByPeer(ReleaseReason::ReadDone) => SubState::Succeeded,
            ReleaseCause::ReleasedByPeer(
                ReleaseReason::Aborted | ReleaseReason::ReadFailed | ReleaseReason::Declined,
            )
            | ReleaseCause::LeaseExpired
            | ReleaseCause::CancelledByPeer
            | ReleaseCause::Aborted
            | ReleaseCause::PeerDead
            | ReleaseCause::WriteFailed(_)
            | ReleaseCause::Rejected => failed(cause),
        },
    }
}
