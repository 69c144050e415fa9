//! The read path's messages (pull mode, bidirectional turns): a reader's ask, the holder's
//! grant or refusal. The reader's release is the shared [`Release`](super::Release).

use serde::{Deserialize, Serialize};

use super::BlockIds;
use crate::ids::{Epoch, PairingKey, RequestId};
use crate::trace::TraceId;

/// Reader → holder (pull: D → P; bidirectional: P → D): the reader wants to read the blocks
/// exported under `key` for its attempt `epoch`. It reads nothing before a [`ReadGrant`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadAsk {
    /// The pairing key.
    pub key: PairingKey,
    /// The reader's attempt.
    pub epoch: Epoch,
    /// The reader's own id of the request, for logs on the holder.
    pub reader_request: RequestId,
    /// The reader's TP rank.
    pub reader_rank: u32,
    /// Which ask of the attempt this is (0 for the first, 1 for the first resend...). The holder
    /// names it in its grant, so the reader knows how old the ask is that the grant answers: a
    /// grant that waited in a stopped reader's queue must not pass for the answer to a resend.
    pub ask: u32,
    /// The attempt's trace id, made by the reader when the attempt started; the holder's
    /// records of it carry it.
    pub trace_id: TraceId,
}

/// Holder → reader: the blocks are bound to the reader's `epoch` until it releases them (or,
/// if it never does, until the grant's fence). Carries the holder's authoritative block list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadGrant {
    /// The pairing key.
    pub key: PairingKey,
    /// The reader's attempt the grant is for.
    pub epoch: Epoch,
    /// The holder's TP rank.
    pub holder_rank: u32,
    /// The holder's logical block ids, one list per cache group.
    pub blocks: BlockIds,
    /// Tokens the blocks hold.
    pub num_tokens: u64,
    /// The ask this grant answers (`ReadAsk::ask`).
    pub ask: u32,
    /// Where in the holder's registered memory a routed reader finds the blocks' bytes (a
    /// holder of a heterogeneous pair, whose reader plans its pieces from them and from the
    /// buffers the holder's handshake advertised); empty otherwise. At most
    /// [`MAX_REGISTER_SPANS`](crate::MAX_REGISTER_SPANS).
    pub memory: Vec<super::MemorySpan>,
}

/// Why a holder will not let a reader read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum ReadRefusal {
    /// The holder exports nothing under the key (never did, or let go already).
    Unavailable,
    /// The export's lease (or TTL) has ended.
    Expired,
    /// A read starting now could outlive the export's lease: declined before it starts.
    NearExpiry,
    /// The attempt is older than one the holder has already served or refused.
    StaleEpoch,
    /// The blocks are granted to another reader or attempt.
    Busy,
    /// The holder's engine aborted the export.
    Aborted,
}

/// Holder → reader: no read of `epoch` may start; nothing was granted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadRefused {
    /// The pairing key.
    pub key: PairingKey,
    /// The reader's attempt.
    pub epoch: Epoch,
    /// The holder's TP rank.
    pub holder_rank: u32,
    /// Why.
    pub reason: ReadRefusal,
}
