//! Values of the read path (pull mode, and bidirectional turns): what the engine hands in to
//! export blocks or to read them, and what it learns back.
//!
//! One side **exports** blocks it holds (P after a pull prefill; D after a turn it keeps for
//! the next one), the other **imports** them by NIXL READs into its own blocks. The exporter
//! grants one reader attempt at a time and keeps the blocks until that reader releases them or
//! until the grant's fence has passed (no read posted under the grant can still be running).

use std::time::Duration;

use crate::{BlockIds, Epoch, PairingKey, ReadRefusal, RequestId};

use super::types::Time;
use super::Config;
use crate::{PeerAddr, WriteId};

/// The local engine exports blocks for a remote reader.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportStart {
    /// The engine's own id of the request.
    pub request: RequestId,
    /// The pairing key the reader will name.
    pub key: PairingKey,
    /// The blocks, one list per cache group. All empty: nothing to export, the request ends
    /// at once.
    pub blocks: BlockIds,
    /// Tokens the blocks hold.
    pub num_tokens: u64,
    /// How long the blocks wait for a reader (a pull lease, or a bidirectional TTL). A reader's
    /// heartbeats naming the key renew it, up to twice this from the start; the blocks are back
    /// by [`export_hard_end`] whatever happens.
    pub lease: Duration,
}

/// What the reader does when a read fails (vLLM's `kv_load_failure_policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum LoadFailurePolicy {
    /// The request fails.
    #[default]
    Fail,
    /// The engine recomputes from the first block that did not arrive.
    Recompute,
}

/// The local engine allocated blocks to read a remote export into.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImportStart {
    /// The engine's own id of the request.
    pub request: RequestId,
    /// The pairing key of the export.
    pub key: PairingKey,
    /// This reader's attempt.
    pub epoch: Epoch,
    /// The rank that exports.
    pub holder: PeerAddr,
    /// Where the KV goes, one list per cache group. All empty: the engine needs nothing (a full
    /// prefix hit); the holder is told to let go at once.
    pub blocks: BlockIds,
    /// The holder's blocks as the router passed them (`remote_block_ids`): advisory, checked as
    /// a block list only. The grant's list is authoritative: a reader never reads blocks the
    /// holder did not grant, whatever a stale or tampered parameter says.
    pub remote_blocks: BlockIds,
    /// Tokens to read.
    pub num_tokens: u64,
    /// Tokens per logical block (for the recompute position).
    pub block_tokens: u32,
    /// What a failed read means.
    pub policy: LoadFailurePolicy,
    /// When the export ends, in this endpoint's clock (converted from the holder's exported
    /// expiry with the handshake's clock offset), if known: a read that could outlive it is
    /// declined before it starts.
    pub expires: Option<Time>,
}

/// Why an import did not load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ImportFailure {
    /// The holder refused the read.
    Refused(ReadRefusal),
    /// The export would end before a read could: declined before it started.
    DeclinedNearExpiry,
    /// A read failed in the transport.
    ReadFailed,
    /// The holder died or was declared dead.
    PeerDead,
    /// No grant came before the deadline, or reads did not end in time.
    Deadline,
    /// The engine aborted the request.
    Aborted,
    /// The engine is shutting down.
    Shutdown,
    /// The handshake with the holder failed.
    HandshakeFailed,
    /// The holder's blocks do not fit the reader's (count or shape).
    PlanMismatch,
    /// The grant arrived later than a grant can travel after the ask (this process was
    /// stalled with it queued): the holder may have fenced it, so nothing was read.
    StaleGrant,
    /// A read was reported done later than the fabric's bound on it (this process was stalled
    /// while it was in flight): the holder may have reused the blocks first, so its bytes are
    /// not trusted.
    LateRead,
}

/// The one terminal outcome of an import.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ImportOutcome {
    /// Every block arrived.
    Loaded,
    /// Policy `Recompute`: the first `valid_tokens` tokens arrived; the engine recomputes the
    /// rest (all of them when `valid_tokens` is 0).
    Recompute {
        /// Tokens that arrived, from the start.
        valid_tokens: u64,
        /// Why the rest did not.
        failure: ImportFailure,
    },
    /// Policy `Fail`, or nothing to recompute from: the request fails.
    Failed(ImportFailure),
}

/// Why an export ended without its reader reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ExportEnd {
    /// No reader asked before the lease ended.
    LeaseExpired,
    /// The reader declined (recompute, or too close to the lease's end).
    Declined,
    /// The reader needed nothing (a full prefix hit).
    FullPrefixHit,
    /// The reader's reads failed.
    ReaderFailed,
    /// The reader gave up before reading.
    ReaderAborted,
    /// The engine aborted the export.
    Aborted,
    /// A grant's fence passed without the reader's release (it died, or its release was lost).
    GrantFenced,
    /// There were no blocks.
    Empty,
}

/// The one terminal outcome of an export.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ExportOutcome {
    /// The reader read every block and released them.
    Read,
    /// The blocks were let go otherwise.
    Released(ExportEnd),
}

/// What made it safe to hand an exporter's blocks back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ReadProof {
    /// No read was ever granted.
    NeverGranted,
    /// The granted reader released them: none of its reads is in flight.
    ReaderReleased,
    /// The grant's fence passed: every read posted under it has ended (`max_message_delay`
    /// for the grant to arrive, `max_write_life` for a read posted on its arrival). A
    /// deadline, not a proof.
    GrantFence,
}

/// One read for the transport to post: `remote` blocks of `from` into `local` blocks of this
/// rank, pairwise per cache group. No notification: the reader releases with a message once
/// every read of the attempt has ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadOrder {
    /// The read's id (from the upper half of the transfer id space; completions name it).
    pub read: WriteId,
    /// The holder.
    pub from: PeerAddr,
    /// The pairing key.
    pub key: PairingKey,
    /// The reader's attempt.
    pub epoch: Epoch,
    /// Local logical blocks, per group; same lengths as `remote`.
    pub local: BlockIds,
    /// The holder's logical blocks, per group.
    pub remote: BlockIds,
    /// Where the holder's grant said the blocks' bytes are (a routed holder's
    /// [`ReadGrant::memory`](crate::ReadGrant::memory)); empty otherwise.
    pub remote_memory: Vec<crate::MemorySpan>,
}

/// The longest lease an export may have (a day): a kept conversation turn waits minutes, not
/// days, and the export's hard end (twice the lease plus a read's span) stays far from the end
/// of time.
pub const MAX_EXPORT_LEASE: std::time::Duration = std::time::Duration::from_secs(24 * 3600);

/// How long after a grant is sent a read posted under it may still run: the grant's delivery
/// (`max_message_delay`), then the fabric's bound on a transfer posted on its arrival
/// (`max_write_life`).
pub fn read_span(config: &Config) -> Duration {
    config.max_message_delay + config.max_write_life
}

/// When an export started at `start` with `lease` has certainly ended, its blocks back with its
/// holder: renewals never take the lease past twice its length, and a read granted at the
/// latest then ends within [`read_span`]. What a holder exports as its expiry
/// (`remote_blocks_expiry_time`).
///
/// ```
/// use std::time::Duration;
/// use kvhandoff_protocol::machine::{export_hard_end, Config, Time};
/// let config = Config::default(); // 10 s message delay, 60 s write life
/// let end = export_hard_end(Time::ZERO, Duration::from_secs(30), &config);
/// assert_eq!(end, Time::from_duration(Duration::from_secs(130)));
/// ```
pub fn export_hard_end(start: Time, lease: Duration, config: &Config) -> Time {
    start + lease * 2 + read_span(config)
}

/// Transfer ids at or above this are reads; below, writes. One endpoint allocates both, so a
/// completion names exactly one of them.
pub const FIRST_READ_ID: u64 = 1 << 63;

/// Whether a transfer id names a read.
pub fn is_read(id: WriteId) -> bool {
    id.0 >= FIRST_READ_ID
}
