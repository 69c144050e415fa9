//! `ImportRequest`: one read of a remote export into this rank's blocks (D in pull mode; P on a
//! bidirectional turn), from the allocation to its one outcome.
//!
//! ```text
//!   Connecting --PeerConnected/send ReadAsk--> Asking --ReadGrant/post reads--> Reading
//!     |                                          |  resend timer: ReadAsk again    |
//!     |                                          |  ReadRefused(Unavailable) soon  |
//!     |                                          |    after the first ask: again   |
//!     |--fail/dead/abort/deadline--> [Failed]    |--ReadRefused--> [Failed]        |
//!                                                |--dead/abort/deadline--> [Failed]|
//!                           every read reported (or the fabric's bound passed):    |
//!                           send Release(ReadDone | ReadFailed) --> [Loaded | Recompute | Failed]
//! ```
//!
//! The rules this machine exists for: no read is posted before the holder's grant, and the
//! holder is told to let go (`Release`) only once no read of the attempt is in flight — the
//! reader's own blocks come back to its engine at the same moment, never while a read may still
//! land in them.

use std::cell::Cell;
use std::collections::BTreeMap;

use crate::{BlockIds, Epoch, Message, PairingKey, ReadAsk, ReadRefusal, Release, ReleaseReason};
use crate::{MemorySpan, RequestId, WriteId};

use super::effects::{Outbox, Step};
use super::read_types::{
    read_span, ImportFailure, ImportOutcome, ImportStart, LoadFailurePolicy, ReadOrder,
};
use super::shape::Machine;
use super::types::{DropReason, Output, Time};
use super::{ActiveMutation, BlockPairing, Config, Mutation};
use crate::PeerAddr;

mod reading;

/// What every state of an import knows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ImportCommon {
    pub(crate) request: RequestId,
    pub(crate) key: PairingKey,
    pub(crate) epoch: Epoch,
    pub(crate) holder: PeerAddr,
    pub(crate) blocks: BlockIds,
    pub(crate) num_tokens: u64,
    pub(crate) block_tokens: u32,
    pub(crate) policy: LoadFailurePolicy,
    /// When the import stops waiting for a grant.
    pub(crate) deadline: Time,
    /// The attempt's trace id, made here and sent in the ask.
    pub(crate) trace: crate::TraceId,
}

/// Waiting for the handshake with the holder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Connecting {
    pub(crate) common: ImportCommon,
}

/// The ask is sent; nothing is read before the grant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Asking {
    pub(crate) common: ImportCommon,
    pub(crate) next_ask: Time,
    pub(crate) asks_left: u32,
    /// When each ask of the attempt was sent, in order (at most `max_register_retries + 1`).
    /// The holder grants (or grants again, moving its fence) on every copy of an ask it gets,
    /// names the ask in the grant, and fences the grant a read's span after sending it, so a
    /// grant handled within `max_message_delay` of the ask it answers is read before the fence;
    /// one handled later sat in a stopped process's queue, and is not read under. Judged by the
    /// ask the grant names, not the latest: a resend on the resume of a stopped reader must not
    /// make the grant of an ask sent before the stop look fresh.
    pub(crate) asked_at: Vec<Time>,
}

/// Reads are posted under a grant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Reading {
    pub(crate) common: ImportCommon,
    /// Reads not yet reported, with the index of the first local block each one covers.
    pub(crate) pending: BTreeMap<WriteId, usize>,
    /// The lowest first-block index of a read that failed.
    pub(crate) first_failed_block: Option<usize>,
    /// Why the import cannot load, if something other than a failed read says so.
    pub(crate) failure: Option<ImportFailure>,
    /// After this every read posted has ended (posted at the grant, each ends within the
    /// fabric's bound), reported or not (plus a margin for the report).
    pub(crate) reads_end_by: Time,
    /// The earliest the holder's fence can be: the holder fences a grant a read's span
    /// (`max_message_delay + max_write_life`) after the ask it answers, the latest one sent.
    /// A read reported done later than this may have run after the fence (only a stall of
    /// this process explains it: the bytes moved after the resume), so its bytes are not
    /// trusted.
    pub(crate) trusted_until: Time,
    /// The reads still pending at `reads_end_by` were abandoned; the import now waits for the
    /// transport's report of each (a read frozen by a stall of this process moves again on
    /// the resume and may still land: its blocks are not handed back before it ended).
    pub(crate) abandoned: bool,
}

/// A live import.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ImportRequest {
    Connecting(Connecting),
    Asking(Asking),
    Reading(Reading),
}

/// An import's terminal record. `release` says what the endpoint must tell the holder (if it
/// can reach it): `None` when the holder must not or need not hear (it refused, or it died).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ImportEnded {
    pub(crate) common: ImportCommon,
    pub(crate) outcome: ImportOutcome,
    pub(crate) release: Option<ReleaseReason>,
    /// A read was posted (the holder's blocks were read from).
    pub(crate) read: bool,
}

/// What can happen to a live import; epochs are checked by the endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ImportInput {
    PeerConnected,
    PeerConnectFailed,
    PeerDead,
    Grant {
        blocks: BlockIds,
        ask: u32,
        /// The memory the grant named (a routed holder's), carried untouched into the reads.
        memory: Vec<MemorySpan>,
    },
    Refused {
        reason: ReadRefusal,
    },
    ReadDone {
        read: WriteId,
    },
    ReadFailed {
        read: WriteId,
    },
    Abort,
    Shutdown,
    Timeout,
}

pub(crate) type ImportStep = Step<ImportRequest, ImportEnded>;

/// Context a transition needs besides its own state.
pub(crate) struct ImportCtx<'a> {
    pub(crate) now: Time,
    pub(crate) own: &'a PeerAddr,
    pub(crate) config: &'a Config,
    /// The next free read id (the table's counter).
    pub(crate) next_read: &'a Cell<u64>,
    pub(crate) mutation: ActiveMutation,
}

impl ImportCommon {
    pub(crate) fn from_start(start: ImportStart, deadline: Time, trace: crate::TraceId) -> Self {
        ImportCommon {
            request: start.request,
            key: start.key,
            epoch: start.epoch,
            holder: start.holder,
            blocks: start.blocks,
            num_tokens: start.num_tokens,
            block_tokens: start.block_tokens,
            policy: start.policy,
            deadline,
            trace,
        }
    }

    /// The number of this attempt's first ask (its later asks follow it): the low bits of its
    /// trace id, not 0. A reader's record of an ended attempt (the tombstone that lifts the
    /// next attempt's epoch) lives a bounded time, but a grant may sit in a stopped process's
    /// queue for longer: an attempt at the same key and epoch started after the record went
    /// (a router retrying with the very parameters, epoch 1) would take that grant, naming the
    /// ask numbers every attempt used, for an answer to its own ask, and read blocks the holder
    /// freed long ago. With asks numbered from the trace id an earlier attempt's grant names no
    /// ask of this one (but for a 2^-32 coincidence) and is refused as stale. The holder echoes
    /// the number, whatever it is, so the wire is unchanged.
    pub(crate) fn first_ask(&self) -> u32 {
        // Truncation intended: any 32 bits of the (hashed) trace id do.
        self.trace.as_u128() as u32
    }

    /// Which ask of this attempt (0: the first) the ask number `ask` is.
    fn ask_index(&self, ask: u32) -> usize {
        ask.wrapping_sub(self.first_ask()) as usize
    }

    /// Ends the import: with nothing read, `failure` means the same under either policy,
    /// except that `Recompute` keeps the request alive with nothing valid.
    fn fail(self, failure: ImportFailure, release: Option<ReleaseReason>) -> ImportStep {
        let outcome = self.outcome_of(failure, 0);
        Step::Ended(ImportEnded {
            common: self,
            outcome,
            release,
            read: false,
        })
    }

    /// What `failure` means under the engine's policy, `valid_tokens` having arrived.
    pub(crate) fn outcome_of(&self, failure: ImportFailure, valid_tokens: u64) -> ImportOutcome {
        match (self.policy, failure) {
            // The engine's own decisions end the request whatever the policy.
            (_, ImportFailure::Aborted | ImportFailure::Shutdown) => ImportOutcome::Failed(failure),
            (LoadFailurePolicy::Fail, _) => ImportOutcome::Failed(failure),
            (LoadFailurePolicy::Recompute, _) => ImportOutcome::Recompute {
                valid_tokens: valid_tokens.min(self.num_tokens),
                failure,
            },
        }
    }

    fn ask_message(&self, own: &PeerAddr, ask: u32) -> Message {
        Message::ReadAsk(ReadAsk {
            key: self.key.clone(),
            epoch: self.epoch,
            reader_request: self.request.clone(),
            reader_rank: own.rank,
            ask,
            trace_id: self.trace,
        })
    }
}

/// The message that tells the holder to let go.
pub(crate) fn release_message(key: &PairingKey, epoch: Epoch, reason: ReleaseReason) -> Message {
    Message::Release(Release {
        key: key.clone(),
        epoch,
        reason,
    })
}

impl ImportRequest {
    /// A new import, waiting for the handshake with its holder.
    pub(crate) fn new(common: ImportCommon) -> Self {
        assert!(
            !common.blocks.is_empty(),
            "an import of nothing ends at once"
        );
        ImportRequest::Connecting(Connecting { common })
    }

    pub(crate) fn common(&self) -> &ImportCommon {
        match self {
            ImportRequest::Connecting(s) => &s.common,
            ImportRequest::Asking(s) => &s.common,
            ImportRequest::Reading(s) => &s.common,
        }
    }

    /// True while the import waits for the holder (its heartbeats keep the export's lease).
    pub(crate) fn waits_for_grant(&self) -> bool {
        match self {
            ImportRequest::Connecting(_) | ImportRequest::Asking(_) => true,
            ImportRequest::Reading(_) => false,
        }
    }

    /// Reads posted and not yet reported.
    pub(crate) fn pending_reads(&self) -> impl Iterator<Item = &WriteId> {
        match self {
            ImportRequest::Connecting(_) | ImportRequest::Asking(_) => None,
            ImportRequest::Reading(s) => Some(s.pending.keys()),
        }
        .into_iter()
        .flatten()
    }
}

impl Machine for ImportRequest {
    type Ctx<'a> = ImportCtx<'a>;
    type Input = ImportInput;
    type Next = ImportStep;

    fn next_timer(&self, _config: &Config) -> Time {
        match self {
            ImportRequest::Connecting(s) => s.common.deadline,
            ImportRequest::Asking(s) if s.asks_left > 0 => s.next_ask.min(s.common.deadline),
            ImportRequest::Asking(s) => s.common.deadline,
            ImportRequest::Reading(s) => s.reads_end_by,
        }
    }

    fn handle(self, ctx: &Self::Ctx<'_>, input: Self::Input, fx: &mut Outbox) -> Self::Next {
        match self {
            ImportRequest::Connecting(s) => s.handle(ctx, input, fx),
            ImportRequest::Asking(s) => s.handle(ctx, input, fx),
            ImportRequest::Reading(s) => s.handle(ctx, input, fx),
        }
    }
}

impl Connecting {
    fn handle(self, ctx: &ImportCtx<'_>, input: ImportInput, fx: &mut Outbox) -> ImportStep {
        let aborted = Some(ReleaseReason::Aborted);
        match input {
            ImportInput::PeerConnected => {
                let first = self.common.first_ask();
                fx.send(&self.common.holder, self.common.ask_message(ctx.own, first));
                Step::Live(ImportRequest::Asking(Asking {
                    next_ask: ctx.now + ctx.config.register_retry_interval,
                    asks_left: ctx.config.max_register_retries,
                    asked_at: vec![ctx.now],
                    common: self.common,
                }))
            }
            ImportInput::PeerConnectFailed => {
                self.common.fail(ImportFailure::HandshakeFailed, None)
            }
            ImportInput::PeerDead => self.common.fail(ImportFailure::PeerDead, None),
            ImportInput::Abort => self.common.fail(ImportFailure::Aborted, aborted),
            ImportInput::Shutdown => self.common.fail(ImportFailure::Shutdown, aborted),
            ImportInput::Timeout if ctx.now >= self.common.deadline => {
                self.common.fail(ImportFailure::Deadline, aborted)
            }
            ImportInput::Timeout => Step::Live(ImportRequest::Connecting(self)),
            ImportInput::Grant { .. }
            | ImportInput::Refused { .. }
            | ImportInput::ReadDone { .. }
            | ImportInput::ReadFailed { .. } => {
                fx.drop_input(DropReason::Unexpected);
                Step::Live(ImportRequest::Connecting(self))
            }
        }
    }
}

impl Asking {
    fn handle(mut self, ctx: &ImportCtx<'_>, input: ImportInput, fx: &mut Outbox) -> ImportStep {
        // The holder may have granted in a message still on its way: tell it to let go.
        let aborted = Some(ReleaseReason::Aborted);
        match input {
            ImportInput::Grant { ask, .. }
                if self.stale(ctx, ask) && !ctx.mutation.is(Mutation::ReadOnStaleGrant) =>
            {
                // Nothing is read under it, so the holder may let go at once.
                fx.counters.stale_grants_refused += 1;
                self.common
                    .fail(ImportFailure::StaleGrant, Some(ReleaseReason::Declined))
            }
            ImportInput::Grant {
                blocks,
                ask,
                memory,
            } => self.granted(ctx, blocks, ask, memory, fx),
            ImportInput::Refused {
                reason: ReadRefusal::Unavailable,
            } if self.may_be_early(ctx) => {
                // The holder's engine may have handed the router its answer before its rank
                // had the export (vLLM's scheduler answers, its worker hands the blocks over
                // at its next step): ask again soon, within the asks this attempt has.
                fx.counters.reads_asked_again += 1;
                self.next_ask = self.next_ask.min(ctx.now + ctx.config.ask_again_after());
                Step::Live(ImportRequest::Asking(self))
            }
            ImportInput::Refused { reason } => {
                self.common.fail(ImportFailure::Refused(reason), None)
            }
            ImportInput::PeerDead => self.common.fail(ImportFailure::PeerDead, None),
            ImportInput::Abort => self.common.fail(ImportFailure::Aborted, aborted),
            ImportInput::Shutdown => self.common.fail(ImportFailure::Shutdown, aborted),
            ImportInput::Timeout if ctx.now >= self.common.deadline => {
                self.common.fail(ImportFailure::Deadline, aborted)
            }
            ImportInput::Timeout => {
                if self.asks_left > 0 && ctx.now >= self.next_ask {
                    let ask = self
                        .common
                        .first_ask()
                        .wrapping_add(self.asked_at.len() as u32);
                    fx.send(&self.common.holder, self.common.ask_message(ctx.own, ask));
                    self.asks_left -= 1;
                    self.asked_at.push(ctx.now);
                    self.next_ask = ctx.now + ctx.config.register_retry_interval;
                }
                Step::Live(ImportRequest::Asking(self))
            }
            ImportInput::PeerConnected | ImportInput::PeerConnectFailed => {
                Step::Live(ImportRequest::Asking(self))
            }
            ImportInput::ReadDone { .. } | ImportInput::ReadFailed { .. } => {
                fx.drop_input(DropReason::Unexpected);
                Step::Live(ImportRequest::Asking(self))
            }
        }
    }

    /// Whether a holder's "nothing under this key" may only mean that its export is not
    /// filed yet: it came within a `register_retry_interval` of the first ask, and an ask is
    /// left to send. A holder that never had the export, or let it go, gives the same answer
    /// to every ask, and the attempt fails once its asks are spent.
    fn may_be_early(&self, ctx: &ImportCtx<'_>) -> bool {
        !ctx.mutation.is(Mutation::GiveUpOnEarlyRefusal)
            && self.asks_left > 0
            && self
                .asked_at
                .first()
                .is_some_and(|&first| ctx.now < first + ctx.config.register_retry_interval)
    }

    /// Whether a grant naming `ask` cannot be read under: the ask is unknown (a peer's bug, or
    /// the grant of an earlier attempt at this key and epoch, see
    /// [`ImportCommon::first_ask`]), or the grant is handled later than `max_message_delay`
    /// after that ask was sent.
    fn stale(&self, ctx: &ImportCtx<'_>, ask: u32) -> bool {
        self.asked_at
            .get(self.common.ask_index(ask))
            .is_none_or(|&sent| ctx.now > sent + ctx.config.max_message_delay)
    }

    /// The grant came: check that the holder's blocks fit ours and post the reads. The reader
    /// may hold fewer blocks than the holder (its own prefix cache had the start): it reads the
    /// holder's last blocks of each group.
    fn granted(
        self,
        ctx: &ImportCtx<'_>,
        remote: BlockIds,
        ask: u32,
        memory: Vec<MemorySpan>,
        fx: &mut Outbox,
    ) -> ImportStep {
        // An unknown ask reaches here only under the stale-grant mutation: the latest stands in.
        let asked = self
            .asked_at
            .get(self.common.ask_index(ask))
            .or(self.asked_at.last());
        let Some(&asked) = asked else {
            unreachable!("an import asks before it waits for a grant");
        };
        let trusted_until = asked + read_span(ctx.config);
        let common = self.common;
        // As given (a heterogeneous pair): the route pairs the two lists, whose block sizes
        // differ, so they need only name the same cache groups, and one read carries them.
        let as_given = ctx.config.block_pairing == BlockPairing::AsGiven;
        let fits = remote.groups.len() == common.blocks.groups.len()
            && (as_given
                || remote
                    .groups
                    .iter()
                    .zip(&common.blocks.groups)
                    .all(|(theirs, ours)| ours.len() <= theirs.len()));
        if !fits {
            tracing::warn!(key = %common.key, epoch = %common.epoch, "granted blocks do not fit ours");
            return common.fail(ImportFailure::PlanMismatch, Some(ReleaseReason::ReadFailed));
        }
        let mut pending = BTreeMap::new();
        let chunks = if as_given {
            vec![(0, common.blocks.clone(), remote)]
        } else {
            let tail: Vec<Vec<u32>> = remote
                .groups
                .iter()
                .zip(&common.blocks.groups)
                .map(|(theirs, ours)| theirs[theirs.len() - ours.len()..].to_vec())
                .collect();
            chunks(&common.blocks, &tail, ctx.config.read_chunk_blocks)
        };
        let last = chunks.len().saturating_sub(1);
        for (i, (first, local, remote)) in chunks.into_iter().enumerate() {
            let read = WriteId(ctx.next_read.get());
            ctx.next_read.set(read.0 + 1);
            pending.insert(read, first);
            fx.counters.reads_posted += 1;
            if i == last && ctx.mutation.is(Mutation::LoseLastReadPost) {
                // The deliberate bug: counted and awaited, never posted. Nothing unsafe
                // follows (the read waits out its bound and the import recomputes), so only
                // the accounting of reads posted against the shell's posts can see it.
                continue;
            }
            fx.emit(Output::PostRead(Box::new(ReadOrder {
                read,
                from: common.holder.clone(),
                key: common.key.clone(),
                epoch: common.epoch,
                local,
                remote,
                remote_memory: memory.clone(),
            })));
        }
        Step::Live(ImportRequest::Reading(Reading {
            pending,
            first_failed_block: None,
            failure: None,
            // The fabric ends every read within `max_write_life` of its post; the transport's
            // report of a read that ended right at that bound is given `abandon_timeout` to
            // arrive before the reader stops waiting.
            reads_end_by: ctx.now + ctx.config.max_write_life + ctx.config.abandon_timeout,
            trusted_until,
            abandoned: false,
            common,
        }))
    }
}

/// Splits the local blocks and the matching remote tail into reads of at most `chunk` blocks:
/// a single group in order (so a failure says which prefix arrived), several groups in one
/// read. Yields (index of the read's first local block, local, remote).
fn chunks(local: &BlockIds, remote: &[Vec<u32>], chunk: u32) -> Vec<(usize, BlockIds, BlockIds)> {
    if local.groups.len() != 1 {
        let remote = BlockIds {
            groups: remote.to_vec(),
        };
        return vec![(0, local.clone(), remote)];
    }
    let chunk = (chunk as usize).max(1);
    local.groups[0]
        .chunks(chunk)
        .zip(remote[0].chunks(chunk))
        .enumerate()
        .map(|(i, (l, r))| {
            (
                i * chunk,
                BlockIds::single_group(l.to_vec()),
                BlockIds::single_group(r.to_vec()),
            )
        })
        .collect()
}

#[cfg(test)]
mod tests;
