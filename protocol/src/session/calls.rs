//! What an engine hands the connector and what it gets back: calls, replies, events, errors,
//! and the identity a connector speaks for.

use std::time::Duration;

use crate::machine::{
    DecodeFailure, ExportOutcome, FreeProof, ImportOutcome, ReadProof, Rejected, ReleaseCause,
};
use crate::{BlockIds, EngineId, IdError, RequestId};

use super::KvTransferParams;

/// Why a connector call failed. Nothing changed — except for [`ConnectorError::VerdictLate`],
/// which says that it is not known yet.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConnectorError {
    /// The endpoint refused the input.
    #[error(transparent)]
    Rejected(#[from] Rejected),
    /// A required transfer parameter is missing.
    #[error("kv_transfer_params lacks {0}")]
    MissingParam(&'static str),
    /// A transfer parameter or id is invalid.
    #[error("invalid {name}: {why}")]
    InvalidParam {
        /// The parameter.
        name: &'static str,
        /// Why.
        why: String,
    },
    /// The request asks for something this build does not do yet.
    #[error("unsupported: {0}")]
    Unsupported(&'static str),
    /// The call needs a connector setting that was not given
    /// ([`ConnectorSettings`](super::ConnectorSettings); e.g. `block_tokens` to read).
    #[error("the connector's {0} setting is not set")]
    NotConfigured(&'static str),
    /// The runtime is gone (or refused the call before taking it): nothing changed.
    #[error("the kvhandoff runtime is not running")]
    Unavailable,
    /// The runtime took the call but gave no verdict within `kvhandoff::KvConnector::CALL_TIMEOUT`. The
    /// call may still be applied, so nothing may be assumed: keep the request's blocks. Its
    /// fate comes through `kvhandoff::KvConnector::poll_events` — the request's one event if it was
    /// accepted, or [`ConnectorEvent::Refused`] if not — and
    /// `kvhandoff::KvConnector::has_pending_work` stays true until then.
    #[error("the kvhandoff runtime took the call but has not answered yet; its event will tell")]
    VerdictLate,
    /// The rank took the call and stopped (it panicked, or was shut down) before answering:
    /// the call may or may not have been applied, and no event will come for it. Keep the
    /// request's blocks out of use for the life of this process (a peer may still write or read
    /// them); `kvhandoff::KvConnector::rank_stopped` is then true.
    #[error(
        "the kvhandoff rank stopped while handling the call; whether it was applied is unknown"
    )]
    VerdictUnknown,
}

impl ConnectorError {
    pub(crate) fn invalid(name: &'static str, err: IdError) -> Self {
        ConnectorError::InvalidParam {
            name,
            why: err.to_string(),
        }
    }
}

/// What the engine learns each step: exactly one *final* event per request, the one that hands
/// its blocks back ([`ConnectorEvent::hands_back`]); a D request may first get one
/// [`ConnectorEvent::DecodeFenced`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConnectorEvent {
    /// D: the request's KV has arrived in its blocks; schedule it.
    BlocksReady {
        /// The request.
        request: RequestId,
        /// Its blocks, now holding the prompt's KV.
        blocks: BlockIds,
    },
    /// D: the request has failed, but its blocks are **still held**: its P was declared dead
    /// (or restarted) after the blocks were exposed to it, and a write of the old P, which
    /// nothing can stop, may still land in them. Sent at most once per request, when the
    /// death fences it, so that the engine can recompute the prompt into other blocks now
    /// instead of waiting for the fence (`Config::quarantine`, minutes by default).
    ///
    /// Do not read, reuse or free the request's blocks yet: they are handed back only by the
    /// request's [`ConnectorEvent::Failed`], which always follows, with the same `reason`.
    DecodeFenced {
        /// The request.
        request: RequestId,
        /// Why it failed: `PeerDead`, or what it was already giving up for (a deadline, an
        /// abort, ...) when the death fenced it. Its `Failed` event repeats it.
        reason: DecodeFailure,
    },
    /// D: the request's KV will not arrive; the blocks are free again. The request's final
    /// event, after its [`ConnectorEvent::DecodeFenced`] if it had one.
    Failed {
        /// The request.
        request: RequestId,
        /// Why.
        reason: DecodeFailure,
        /// What made it safe to hand the blocks back (`DeadPeerFence` or `Quarantine`: a
        /// deadline passed, not a proof; the request waited for it).
        proof: FreeProof,
        /// The blocks, free to reuse.
        blocks: BlockIds,
    },
    /// A call whose verdict came late ([`ConnectorError::VerdictLate`]) was refused after all:
    /// nothing changed, and its blocks are the engine's again.
    Refused {
        /// The request of the refused call.
        request: RequestId,
        /// Why.
        error: ConnectorError,
    },
    /// P: the request's blocks may be freed.
    BlocksFree {
        /// The request.
        request: RequestId,
        /// `None` when the KV was sent; otherwise why it was released unsent.
        released: Option<ReleaseCause>,
        /// The blocks, free to reuse.
        blocks: BlockIds,
    },
    /// The holder of an export (P in pull mode, D between bidirectional turns): the exported
    /// blocks may be freed; no read of them can still run.
    ExportEnded {
        /// The request.
        request: RequestId,
        /// Whether the reader read them, or why not.
        outcome: ExportOutcome,
        /// What made it safe (a reader's release, or the grant's fence).
        proof: ReadProof,
        /// The blocks, free to reuse.
        blocks: BlockIds,
    },
    /// The reader of an export (D in pull mode, P on a later bidirectional turn): every read has
    /// ended, and the blocks are the engine's again. On `Loaded` they hold the KV (schedule the
    /// request); on `Recompute` their first `valid_tokens` tokens do; on `Failed` nothing
    /// arrived that may be used.
    Imported {
        /// The request.
        request: RequestId,
        /// What arrived.
        outcome: ImportOutcome,
        /// The blocks.
        blocks: BlockIds,
    },
}

/// One engine hook call, for `kvhandoff::KvConnector::submit`.
#[derive(Debug, Clone, PartialEq)]
pub enum ConnectorCall {
    /// D side, as `kvhandoff::KvConnector::request_allocated`.
    RequestAllocated {
        /// The request.
        request: RequestId,
        /// Its allocated blocks.
        blocks: BlockIds,
        /// Tokens expected.
        num_tokens: u64,
        /// The router's parameters.
        params: KvTransferParams,
    },
    /// P side, as `kvhandoff::KvConnector::request_finished`.
    RequestFinished {
        /// The request.
        request: RequestId,
        /// Its blocks, holding the KV.
        blocks: BlockIds,
        /// Tokens the blocks hold (`remote_num_tokens` of the reply).
        num_tokens: u64,
        /// The router's parameters for the prefill leg.
        params: KvTransferParams,
    },
    /// P side, layer-wise push, as `kvhandoff::KvConnector::prefill_started`: the prefill
    /// starts into these blocks; its layers follow in [`ConnectorCall::LayersReady`]. In place
    /// of `RequestFinished` (and answered as it is).
    PrefillStarted {
        /// The request.
        request: RequestId,
        /// Its blocks, which the prefill fills.
        blocks: BlockIds,
        /// Tokens the blocks will hold (the prompt).
        num_tokens: u64,
        /// The router's parameters for the prefill leg (push).
        params: KvTransferParams,
    },
    /// P side, layer-wise push, as `kvhandoff::KvConnector::layers_ready`: layers `0 .. ready`
    /// of the request's blocks hold their KV; `ready` equal to the rank's layers ends the
    /// prefill.
    LayersReady {
        /// The request.
        request: RequestId,
        /// Layers ready, from layer 0.
        ready: u32,
    },
    /// D side, after a turn, as
    /// `kvhandoff::KvConnector::keep_for_next_turn`.
    KeepForNextTurn {
        /// The request whose turn ended.
        request: RequestId,
        /// Its blocks, holding the conversation's KV.
        blocks: BlockIds,
        /// Tokens the blocks hold.
        num_tokens: u64,
        /// How long the blocks wait for the next turn's reader (renewed by its heartbeats up
        /// to twice this).
        ttl: Duration,
        /// The parameters the turn came with (for `transfer_id`).
        params: KvTransferParams,
    },
    /// P side, on a later turn, as
    /// `kvhandoff::KvConnector::next_turn_allocated`.
    NextTurnAllocated {
        /// The new turn's request.
        request: RequestId,
        /// Blocks allocated for the previous turns' KV (all empty: a full prefix hit).
        blocks: BlockIds,
        /// Tokens to read.
        num_tokens: u64,
        /// The parameters D returned from `keep_for_next_turn`.
        params: KvTransferParams,
    },
    /// Reader side, as `kvhandoff::KvConnector::decline_export`.
    DeclineExport {
        /// The reader's request.
        request: RequestId,
        /// The export's parameters (the holder's answer).
        params: KvTransferParams,
    },
    /// Either side, as `kvhandoff::KvConnector::abort`.
    Abort {
        /// The request.
        request: RequestId,
    },
    /// Either side, as `kvhandoff::KvConnector::shutdown`.
    Shutdown,
}

impl ConnectorEvent {
    /// The request the event is about.
    pub fn request(&self) -> &RequestId {
        match self {
            ConnectorEvent::BlocksReady { request, .. }
            | ConnectorEvent::DecodeFenced { request, .. }
            | ConnectorEvent::Failed { request, .. }
            | ConnectorEvent::Refused { request, .. }
            | ConnectorEvent::BlocksFree { request, .. }
            | ConnectorEvent::ExportEnded { request, .. }
            | ConnectorEvent::Imported { request, .. } => request,
        }
    }

    /// Whether this is its request's final event, the one that hands the blocks back (or,
    /// for `Refused`, leaves them with the engine): every event but
    /// [`ConnectorEvent::DecodeFenced`].
    pub fn hands_back(&self) -> bool {
        match self {
            ConnectorEvent::DecodeFenced { .. } => false,
            ConnectorEvent::BlocksReady { .. }
            | ConnectorEvent::Failed { .. }
            | ConnectorEvent::Refused { .. }
            | ConnectorEvent::BlocksFree { .. }
            | ConnectorEvent::ExportEnded { .. }
            | ConnectorEvent::Imported { .. } => true,
        }
    }
}

impl ConnectorCall {
    /// The request the call is about (none for `Shutdown`).
    pub fn request(&self) -> Option<&RequestId> {
        match self {
            ConnectorCall::RequestAllocated { request, .. }
            | ConnectorCall::RequestFinished { request, .. }
            | ConnectorCall::PrefillStarted { request, .. }
            | ConnectorCall::LayersReady { request, .. }
            | ConnectorCall::KeepForNextTurn { request, .. }
            | ConnectorCall::NextTurnAllocated { request, .. }
            | ConnectorCall::DeclineExport { request, .. }
            | ConnectorCall::Abort { request } => Some(request),
            ConnectorCall::Shutdown => None,
        }
    }
}

impl ConnectorCall {
    /// Whether the call, once accepted, owes the engine exactly one final event of its request
    /// (`Abort`, `Shutdown` and `DeclineExport` start nothing).
    pub fn starts_request(&self) -> bool {
        match self {
            ConnectorCall::RequestAllocated { .. }
            | ConnectorCall::RequestFinished { .. }
            | ConnectorCall::PrefillStarted { .. }
            | ConnectorCall::KeepForNextTurn { .. }
            | ConnectorCall::NextTurnAllocated { .. } => true,
            ConnectorCall::LayersReady { .. }
            | ConnectorCall::DeclineExport { .. }
            | ConnectorCall::Abort { .. }
            | ConnectorCall::Shutdown => false,
        }
    }
}

/// What an accepted [`ConnectorCall`] returns.
#[derive(Debug, Clone, PartialEq)]
pub enum ConnectorReply {
    /// Accepted (`RequestAllocated`, `NextTurnAllocated`, `LayersReady`, `DeclineExport`,
    /// `Abort`, `Shutdown`).
    Accepted,
    /// Accepted (`RequestFinished`, `PrefillStarted`): the parameters for the router to send
    /// with the decode leg.
    DecodeParams(KvTransferParams),
    /// Accepted (`KeepForNextTurn`): the parameters for the router to send with the next
    /// turn's prefill leg.
    NextTurnParams(KvTransferParams),
}

/// Identity and placement of the engine rank a connector serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectorIdentity {
    /// The engine.
    pub engine: EngineId,
    /// This rank.
    pub rank: u32,
    /// The engine's TP size.
    pub tp_size: u32,
    /// The side-channel address advertised to the router.
    pub host: String,
    /// This rank's side-channel port. Ranks of one engine listen on consecutive ports, rank
    /// `r` on a base + `r` (vLLM's convention): the answers to the router advertise the base
    /// (this port − `rank`), and a rank reaches rank `r` of another engine at the base that
    /// engine's parameters name + `r`. At TP 1 the base is the port.
    pub port: u16,
}

impl ConnectorIdentity {
    /// Rank `rank` of `engine` (TP size `tp_size`), reached in process: no side-channel address
    /// to advertise (empty host, port 0).
    pub fn in_process(engine: EngineId, rank: u32, tp_size: u32) -> Self {
        ConnectorIdentity {
            engine,
            rank,
            tp_size,
            host: String::new(),
            port: 0,
        }
    }
}
