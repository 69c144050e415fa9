//! `ExportRequest`: blocks one side holds for a remote reader (P in pull mode; D between the
//! turns of a bidirectional conversation), from the export to its one outcome.
//!
//! ```text
//!   Offered --ReadAsk within the lease/send ReadGrant--> Granted
//!     |  \--ReadAsk after the lease/send ReadRefused(Expired)--> [LeaseExpired]
//!     |--reader's heartbeat: lease renewed (never past twice its length)
//!     |--Release (declined, full hit, aborted)--> [Released]      Granted --Release--> [Read /
//!     |--lease ended / abort--> [Released]                          Released]
//!                                                                Granted --fence--> [GrantFenced]
//! ```
//!
//! The rule this machine exists for: once a grant has been sent, the blocks are handed back
//! only when the granted reader says none of its reads is in flight, or when the grant's fence
//! has passed. Every export ends by its hard end (`created + 2 × lease + read span`): renewals
//! never take the lease past twice its length, and grants are refused that could outlive the
//! hard end (an ask within the lease always fits).

use crate::{BlockIds, Epoch, Message, PairingKey, ReadGrant, ReadRefusal, ReadRefused};
use crate::{ReleaseReason, RequestId};

use super::effects::{Outbox, Step};
pub(crate) use super::read_types::read_span;
use super::read_types::{export_hard_end, ExportEnd, ExportOutcome, ExportStart, ReadProof};
use super::shape::Machine;
use super::types::{DropReason, Time};
use super::{ActiveMutation, Config, Mutation};
use crate::PeerAddr;

/// What every state of an export knows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ExportCommon {
    pub(crate) request: RequestId,
    pub(crate) key: PairingKey,
    pub(crate) blocks: BlockIds,
    pub(crate) num_tokens: u64,
    /// The latest its lease can run (twice the lease after the start): no renewal goes past
    /// it, so an ask is never taken later.
    pub(crate) renew_cap: Time,
    /// The export's hard end: the renewal cap plus a read's span. No grant is made that could
    /// outlive it (an ask within the lease always fits), so the blocks are back by then
    /// whatever happens.
    pub(crate) hard_end: Time,
    /// The engine aborted the export (the outcome says so, whatever the reader does).
    pub(crate) aborted: bool,
}

/// Waiting for a reader.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Offered {
    pub(crate) common: ExportCommon,
    /// When the blocks are let go if no reader asked (renewed by heartbeats).
    pub(crate) lease_until: Time,
}

/// Bound to one reader's attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Granted {
    pub(crate) common: ExportCommon,
    pub(crate) reader: PeerAddr,
    pub(crate) epoch: Epoch,
    /// After this no read posted under the grant can still run.
    pub(crate) fence: Time,
    /// The trace id of the reader's attempt, from its ask.
    pub(crate) trace: crate::TraceId,
}

/// A live export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ExportRequest {
    Offered(Offered),
    Granted(Granted),
}

/// An export's terminal record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ExportEnded {
    pub(crate) common: ExportCommon,
    pub(crate) outcome: ExportOutcome,
    pub(crate) proof: ReadProof,
}

/// What can happen to a live export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ExportInput {
    /// A reader asks to read for its attempt `epoch`.
    Ask {
        from: PeerAddr,
        epoch: Epoch,
        /// Which ask of the reader's attempt (its grant names it back).
        ask: u32,
        /// The trace id of the reader's attempt.
        trace: crate::TraceId,
    },
    /// A reader lets go of the blocks.
    Release {
        from: PeerAddr,
        epoch: Epoch,
        reason: ReleaseReason,
    },
    /// A heartbeat of `from` names the key: the reader still waits.
    Renew {
        from: PeerAddr,
    },
    /// The engine aborts the export (or shuts down).
    Abort,
    Timeout,
}

pub(crate) type ExportStep = Step<ExportRequest, ExportEnded>;

/// Context a transition needs besides its own state.
pub(crate) struct ExportCtx<'a> {
    pub(crate) now: Time,
    pub(crate) own: &'a PeerAddr,
    pub(crate) config: &'a Config,
    pub(crate) mutation: ActiveMutation,
}

impl ExportCtx<'_> {
    /// When a grant made now is fenced.
    fn fence(&self) -> Time {
        if self.mutation.is(Mutation::ShortGrantFence) {
            // The deliberate bug: the grant's delivery only, not the read's own life.
            return self.now + self.config.max_message_delay;
        }
        if self.mutation.is(Mutation::LongGrantFence) {
            // The deliberate bug: the push path's fence for a peer that may still write.
            return self.now + self.config.quarantine;
        }
        self.now + read_span(self.config)
    }
}

impl ExportCommon {
    pub(crate) fn from_start(start: ExportStart, now: Time, config: &Config) -> Self {
        ExportCommon {
            request: start.request,
            key: start.key,
            blocks: start.blocks,
            num_tokens: start.num_tokens,
            renew_cap: now + start.lease * 2,
            hard_end: export_hard_end(now, start.lease, config),
            aborted: false,
        }
    }

    fn end(self, outcome: ExportOutcome, proof: ReadProof) -> ExportStep {
        let outcome = match outcome {
            ExportOutcome::Read | ExportOutcome::Released(_) if self.aborted => {
                ExportOutcome::Released(ExportEnd::Aborted)
            }
            ExportOutcome::Read | ExportOutcome::Released(_) => outcome,
        };
        Step::Ended(ExportEnded {
            common: self,
            outcome,
            proof,
        })
    }

    fn refuse(&self, ctx: &ExportCtx<'_>, epoch: Epoch, reason: ReadRefusal) -> Message {
        Message::ReadRefused(ReadRefused {
            key: self.key.clone(),
            epoch,
            holder_rank: ctx.own.rank,
            reason,
        })
    }

    fn grant(&self, ctx: &ExportCtx<'_>, epoch: Epoch, ask: u32) -> Message {
        Message::ReadGrant(Box::new(ReadGrant {
            key: self.key.clone(),
            epoch,
            holder_rank: ctx.own.rank,
            blocks: self.blocks.clone(),
            num_tokens: self.num_tokens,
            ask,
            // The machine leaves the memory out: only the holder's route knows where it is.
            memory: Vec::new(),
        }))
    }

    /// Whether a grant made now could outlive the hard end.
    fn too_late_to_grant(&self, ctx: &ExportCtx<'_>) -> bool {
        ctx.now + read_span(ctx.config) > self.hard_end
    }
}

/// What a reader's release says about how the export ended.
fn released_outcome(reason: ReleaseReason) -> ExportOutcome {
    match reason {
        ReleaseReason::ReadDone => ExportOutcome::Read,
        ReleaseReason::ReadFailed => ExportOutcome::Released(ExportEnd::ReaderFailed),
        ReleaseReason::Declined => ExportOutcome::Released(ExportEnd::Declined),
        ReleaseReason::FullPrefixHit => ExportOutcome::Released(ExportEnd::FullPrefixHit),
        ReleaseReason::Aborted => ExportOutcome::Released(ExportEnd::ReaderAborted),
    }
}

impl ExportRequest {
    /// The reader's attempt and its trace id, once granted.
    pub(crate) fn granted_attempt(&self) -> Option<(Epoch, crate::TraceId)> {
        match self {
            ExportRequest::Offered(_) => None,
            ExportRequest::Granted(g) => Some((g.epoch, g.trace)),
        }
    }

    /// A new export, waiting for its reader until `lease_until`.
    pub(crate) fn new(common: ExportCommon, lease_until: Time) -> Self {
        assert!(!common.blocks.is_empty(), "an empty export ends at once");
        assert!(lease_until <= common.renew_cap);
        ExportRequest::Offered(Offered {
            common,
            lease_until,
        })
    }

    pub(crate) fn common(&self) -> &ExportCommon {
        match self {
            ExportRequest::Offered(s) => &s.common,
            ExportRequest::Granted(s) => &s.common,
        }
    }

    fn check(&self) {
        match self {
            ExportRequest::Offered(s) => {
                assert!(s.lease_until <= s.common.renew_cap);
                assert!(s.common.renew_cap <= s.common.hard_end);
            }
            ExportRequest::Granted(s) => assert!(
                s.fence <= s.common.hard_end,
                "a grant never outlives the export's hard end"
            ),
        }
    }
}

impl Machine for ExportRequest {
    type Ctx<'a> = ExportCtx<'a>;
    type Input = ExportInput;
    type Next = ExportStep;

    fn next_timer(&self, _config: &Config) -> Time {
        match self {
            ExportRequest::Offered(s) => s.lease_until,
            ExportRequest::Granted(s) => s.fence,
        }
    }

    fn handle(self, ctx: &Self::Ctx<'_>, input: Self::Input, fx: &mut Outbox) -> Self::Next {
        let mut next = match self {
            ExportRequest::Offered(s) => s.handle(ctx, input, fx),
            ExportRequest::Granted(s) => s.handle(ctx, input, fx),
        };
        if let Step::Live(ExportRequest::Granted(s)) = &mut next {
            if ctx.mutation.is(Mutation::LongGrantFence) {
                // The same bug's second half: the hard end is moved out to the fence, so the
                // machine stays consistent with itself and its own check (below) passes. Only a
                // checker that remembers the bound promised at the export's start
                // (`export_hard_end`, the simulator's L3) sees the blocks held past it.
                s.common.hard_end = s.common.hard_end.max(s.fence);
            }
        }
        if let Step::Live(live) = &next {
            live.check();
        }
        next
    }
}

impl Offered {
    fn handle(self, ctx: &ExportCtx<'_>, input: ExportInput, fx: &mut Outbox) -> ExportStep {
        match input {
            ExportInput::Ask { from, epoch, .. } if ctx.now >= self.lease_until => {
                // The lease has ended (its timer has not run yet): as if it had.
                let refusal = self.common.refuse(ctx, epoch, ReadRefusal::Expired);
                fx.send(&from, refusal);
                self.common.end(
                    ExportOutcome::Released(ExportEnd::LeaseExpired),
                    ReadProof::NeverGranted,
                )
            }
            ExportInput::Ask {
                from,
                epoch,
                ask,
                trace,
            } => {
                // Within the lease, which never runs past the renewal cap, a grant always fits
                // before the hard end.
                assert!(
                    !self.common.too_late_to_grant(ctx),
                    "an ask within the lease fits before the hard end"
                );
                fx.send(&from, self.common.grant(ctx, epoch, ask));
                fx.counters.reads_granted += 1;
                Step::Live(ExportRequest::Granted(Granted {
                    fence: ctx.fence(),
                    common: self.common,
                    reader: from,
                    epoch,
                    trace,
                }))
            }
            ExportInput::Release { reason, .. } => self
                .common
                .end(released_outcome(reason), ReadProof::NeverGranted),
            ExportInput::Renew { .. } => {
                let renewed = (ctx.now + ctx.config.lease_extension).min(self.common.renew_cap);
                let lease_until = self.lease_until.max(renewed);
                if lease_until > self.lease_until {
                    fx.counters.exports_renewed += 1;
                }
                Step::Live(ExportRequest::Offered(Offered {
                    lease_until,
                    ..self
                }))
            }
            ExportInput::Abort => self.common.end(
                ExportOutcome::Released(ExportEnd::Aborted),
                ReadProof::NeverGranted,
            ),
            ExportInput::Timeout if ctx.now >= self.lease_until => self.common.end(
                ExportOutcome::Released(ExportEnd::LeaseExpired),
                ReadProof::NeverGranted,
            ),
            ExportInput::Timeout => Step::Live(ExportRequest::Offered(self)),
        }
    }
}

impl Granted {
    fn handle(mut self, ctx: &ExportCtx<'_>, input: ExportInput, fx: &mut Outbox) -> ExportStep {
        match input {
            ExportInput::Ask {
                from, epoch, ask, ..
            } if from == self.reader && epoch == self.epoch => {
                // A copy of the ask, or a resend whose grant was lost: the same grant again. A
                // read under the copy may start only when it arrives, so the fence moves with
                // it; a copy that could outlive the hard end is refused instead (a read under
                // the first copy, if any, is covered by the fence as it stands).
                if self.common.too_late_to_grant(ctx) {
                    fx.counters.reads_declined_near_expiry += 1;
                    let refusal = self.common.refuse(ctx, epoch, ReadRefusal::NearExpiry);
                    fx.send(&from, refusal);
                    return Step::Live(ExportRequest::Granted(self));
                }
                self.fence = self.fence.max(ctx.fence());
                fx.send(&from, self.common.grant(ctx, epoch, ask));
                Step::Live(ExportRequest::Granted(self))
            }
            ExportInput::Ask { from, epoch, .. }
                if from == self.reader && epoch > self.epoch && self.common.aborted =>
            {
                // The engine gave the export up: no new attempt is served.
                let refusal = self.common.refuse(ctx, epoch, ReadRefusal::Aborted);
                fx.send(&from, refusal);
                Step::Live(ExportRequest::Granted(self))
            }
            ExportInput::Ask {
                from,
                epoch,
                ask,
                trace,
            } if from == self.reader && epoch > self.epoch => {
                // The reader ends an attempt only after its reads ended, so a newer attempt
                // means none of the older one's is in flight: grant it afresh, fence from now.
                if self.common.too_late_to_grant(ctx) {
                    fx.counters.reads_declined_near_expiry += 1;
                    let refusal = self.common.refuse(ctx, epoch, ReadRefusal::NearExpiry);
                    fx.send(&from, refusal);
                    return Step::Live(ExportRequest::Granted(self));
                }
                fx.send(&from, self.common.grant(ctx, epoch, ask));
                fx.counters.reads_granted += 1;
                self.epoch = epoch;
                self.fence = ctx.fence();
                self.trace = trace;
                Step::Live(ExportRequest::Granted(self))
            }
            ExportInput::Ask { from, epoch, .. } => {
                let reason = if from == self.reader {
                    ReadRefusal::StaleEpoch
                } else {
                    ReadRefusal::Busy
                };
                let refusal = self.common.refuse(ctx, epoch, reason);
                fx.send(&from, refusal);
                Step::Live(ExportRequest::Granted(self))
            }
            ExportInput::Release {
                from,
                epoch,
                reason,
            } => {
                if from != self.reader {
                    fx.drop_input(DropReason::Unexpected);
                    return Step::Live(ExportRequest::Granted(self));
                }
                if epoch < self.epoch {
                    // An older attempt's release: the current grant may still be read.
                    fx.drop_input(DropReason::StaleEpoch);
                    return Step::Live(ExportRequest::Granted(self));
                }
                if epoch > self.epoch {
                    // A newer attempt the reader never asked for: it read nothing under it, and
                    // it says nothing about the current grant.
                    fx.drop_input(DropReason::FutureEpoch);
                    return Step::Live(ExportRequest::Granted(self));
                }
                self.common
                    .end(released_outcome(reason), ReadProof::ReaderReleased)
            }
            ExportInput::Renew { .. } => Step::Live(ExportRequest::Granted(self)),
            ExportInput::Abort => {
                // The reader may be reading: the blocks stay until it releases or the fence.
                self.common.aborted = true;
                Step::Live(ExportRequest::Granted(self))
            }
            ExportInput::Timeout if ctx.now >= self.fence => {
                fx.counters.grant_fence_frees += 1;
                self.common.end(
                    ExportOutcome::Released(ExportEnd::GrantFenced),
                    ReadProof::GrantFence,
                )
            }
            ExportInput::Timeout => Step::Live(ExportRequest::Granted(self)),
        }
    }
}

#[cfg(test)]
mod tests;
