//! What a fan-in is given and what it answers: the sides, the sub-requests, their failures,
//! the request's outcome, each step's orders to the engine, and the typed refusals.

use crate::machine::read_types::{ExportEnd, ImportFailure};
use crate::machine::types::ReleaseCause;
use crate::machine::DecodeFailure;
use crate::{BlockIds, PairingKey, RequestId};

#[cfg(doc)]
use super::FanIn;
use super::MAX_SUB_REQUESTS;
#[cfg(doc)]
use crate::machine::types::EndpointEvent;

/// Which side of the handoff a fan-in tracks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FanSide {
    /// A D rank fed by several P ranks: the sub-requests are D requests sharing the rank's
    /// target blocks.
    Decode,
    /// A P rank writing to several D ranks: the sub-requests are P requests sharing the rank's
    /// source blocks.
    Prefill,
    /// A reader (pull: a D rank) reading from several holder ranks: the sub-requests are
    /// imports sharing the rank's target blocks.
    Reader,
    /// A holder (pull: a P rank) read by several reader ranks: the sub-requests are exports
    /// sharing the rank's source blocks.
    Holder,
}

/// One sub-request of a multi-rank request, as the engine started it on this rank.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SubRequest {
    /// The engine's id of the sub-request on this rank.
    pub request: RequestId,
    /// The pair's key ([`PairingKey::for_pair`](crate::PairingKey::for_pair)).
    pub key: PairingKey,
}

/// Why a sub-request failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SubFailure {
    /// A D sub-request failed.
    Decode(DecodeFailure),
    /// A P sub-request let its blocks go without delivering anything its D rank needed.
    Prefill(ReleaseCause),
    /// An import ended without every block (its policy's `Recompute` included: a part of a
    /// multi-rank read is no prefix of the request).
    Import(ImportFailure),
    /// An export let its blocks go without its reader reading them.
    Export(ExportEnd),
    /// The endpoint refused to start it: nothing of it was ever exposed to its peer rank.
    NotStarted,
}

/// How a multi-rank request ended on this rank.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum FanOutcome {
    /// Every sub-request succeeded (D: every pair's write landed; P: every pair's write
    /// completed, or its D rank needed none).
    Ready,
    /// A sub-request failed: the first one that did.
    Failed {
        /// The first sub-request that failed.
        request: RequestId,
        /// Why it failed.
        failure: SubFailure,
    },
}

/// What the engine does after a sub-request ended.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FanInStep {
    /// Live sub-requests to abort now (`EndpointCall::Abort`): a sibling failed, so the request
    /// cannot be `Ready`, and each of these would otherwise hold its peer rank until its
    /// deadline. Every sub-request is named at most once over the fan-in's life.
    pub abort: Vec<RequestId>,
    /// The request's outcome, the moment it is decided: at the first failure, or when the last
    /// sub-request succeeded. Reported once.
    pub outcome: Option<FanOutcome>,
    /// The shared blocks, once every sub-request handed them back: no peer rank can write (D)
    /// or read (P) them any more. On `Ready` (D) they hold the prompt's KV; otherwise they may
    /// go back to the pool. Reported once.
    pub hand_back: Option<BlockIds>,
    /// D: the request has failed (its outcome, reported in this step or an earlier one, is
    /// `Failed`) and its shared blocks stay out, because a sub-request was fenced by its P
    /// rank's death ([`EndpointEvent::DecodeFenced`]). The engine may recompute the prompt
    /// elsewhere now, and must neither read nor reuse the blocks until `hand_back`, which
    /// always follows in a later step. Reported at most once per request: for the first
    /// sub-request fenced, and only while the blocks are out.
    pub fenced: bool,
}

/// Why the fan-in refused an input. A refused input changed nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FanInError {
    /// A fan-in needs at least one sub-request.
    #[error("a multi-rank request needs at least one sub-request")]
    NoSubRequests,
    /// More sub-requests than [`MAX_SUB_REQUESTS`].
    #[error("a multi-rank request has at most {MAX_SUB_REQUESTS} sub-requests")]
    TooManySubRequests,
    /// Two sub-requests share an id.
    #[error("sub-request {0} is listed twice")]
    DuplicateRequest(RequestId),
    /// Two sub-requests share a pairing key.
    #[error("pairing key {0} is listed twice")]
    DuplicateKey(PairingKey),
    /// The event or call names no sub-request of this fan-in.
    #[error("{0} is not a sub-request of this request")]
    UnknownRequest(RequestId),
    /// The sub-request ended already (a second terminal event).
    #[error("sub-request {0} already ended")]
    AlreadyEnded(RequestId),
    /// The event names another key than the sub-request was started with.
    #[error("sub-request {request} ended under key {got}, was started under {expected}")]
    KeyMismatch {
        /// The sub-request.
        request: RequestId,
        /// Its key at the start.
        expected: PairingKey,
        /// The key of the event.
        got: PairingKey,
    },
    /// The event hands back other blocks than the shared ones.
    #[error("sub-request {0} handed back other blocks than the shared ones")]
    BlocksMismatch(RequestId),
    /// A second [`EndpointEvent::DecodeFenced`] for a sub-request.
    #[error("sub-request {0} was already told fenced")]
    AlreadyFenced(RequestId),
    /// A sub-request told fenced ended otherwise than `Failed` with the failure it was told
    /// (the endpoint promises it does).
    #[error("sub-request {0} ended otherwise than its early failure said")]
    FencedOutcomeChanged(RequestId),
    /// An event of another kind than the fan-in's side (a prefill event on D's side, an export
    /// or import anywhere).
    #[error("a {got} event cannot end a sub-request of a {expected:?} fan-in")]
    WrongSide {
        /// The fan-in's side.
        expected: FanSide,
        /// The kind of event given.
        got: &'static str,
    },
}

/// How many sub-requests are in each state (see [`FanIn::counts`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FanCounts {
    /// Not ended yet (aborting and fenced ones included).
    pub live: usize,
    /// Ended well.
    pub succeeded: usize,
    /// Ended in failure or never started.
    pub failed: usize,
}
