//! The `Draining` state of a P request: its write can no longer be trusted to matter (a
//! cancel, D's death, an abort or the deadline), but it may still read the blocks, so the
//! request waits for the write's end before it frees them or answers a cancel.

use super::{
    cancel_ack, refuse_other_registration, write_failed, DrainCause, Draining, DropReason,
    Mutation, Outbox, Output, PrefillCtx, PrefillInput, PrefillOutcome, PrefillRequest,
    PrefillStep, ReleaseCause, Step, WriteFailure,
};

impl Draining {
    /// The write can no longer land (`landed` says whether it did): tell D what it needs and end.
    fn finish(
        self,
        ctx: &PrefillCtx<'_>,
        landed: bool,
        failure: WriteFailure,
        fx: &mut Outbox,
    ) -> PrefillStep {
        let epoch = self.binding.epoch;
        let key = &self.common.key;
        let peer_alive = self.cause != DrainCause::PeerDead;
        if peer_alive && !landed {
            let reason = match self.cause {
                DrainCause::Aborted => WriteFailure::PrefillAborted,
                DrainCause::TimedOut => WriteFailure::TransferTimedOut,
                DrainCause::Cancelled | DrainCause::PeerDead => failure,
            };
            fx.send(
                &self.binding.to,
                write_failed(key, epoch, ctx.own_rank, reason),
            );
        }
        if peer_alive && self.cancel_requested {
            fx.send(&self.binding.to, cancel_ack(key, epoch, ctx.own_rank));
        }
        let outcome = match (self.cause, landed) {
            (DrainCause::Cancelled, _) => PrefillOutcome::Released(ReleaseCause::CancelledByPeer),
            (DrainCause::PeerDead, false) => PrefillOutcome::Released(ReleaseCause::PeerDead),
            (DrainCause::Aborted, false) => PrefillOutcome::Released(ReleaseCause::Aborted),
            (DrainCause::TimedOut, false) => {
                PrefillOutcome::Released(ReleaseCause::WriteFailed(WriteFailure::TransferTimedOut))
            }
            (DrainCause::PeerDead | DrainCause::Aborted | DrainCause::TimedOut, true) => {
                PrefillOutcome::Sent
            }
        };
        self.common.end(outcome, Some(epoch))
    }

    pub(super) fn handle(
        mut self,
        ctx: &PrefillCtx<'_>,
        input: PrefillInput,
        fx: &mut Outbox,
    ) -> PrefillStep {
        let epoch = self.binding.epoch;
        match input {
            PrefillInput::WriteCompleted => {
                self.finish(ctx, true, WriteFailure::TransferFailed, fx)
            }
            PrefillInput::WriteFailed { failure } => self.finish(ctx, false, failure, fx),
            PrefillInput::Cancel {
                from,
                epoch: cancelled,
            } if cancelled != epoch => {
                fx.send(&from, cancel_ack(&self.common.key, cancelled, ctx.own_rank));
                Step::Live(PrefillRequest::Draining(self))
            }
            PrefillInput::Cancel { .. } => {
                self.cancel_requested = true;
                Step::Live(PrefillRequest::Draining(self))
            }
            PrefillInput::PeerDead { peer } if peer == self.binding.to => {
                self.cause = DrainCause::PeerDead;
                if !self.abandoned {
                    fx.emit(Output::AbandonWrite {
                        write: self.binding.write,
                    });
                    fx.counters.writes_abandoned += 1;
                    self.abandoned = true;
                    self.deadline = ctx.now + ctx.config.abandon_timeout;
                }
                Step::Live(PrefillRequest::Draining(self))
            }
            PrefillInput::Timeout if ctx.now >= self.deadline && !self.abandoned => {
                fx.emit(Output::AbandonWrite {
                    write: self.binding.write,
                });
                fx.counters.writes_abandoned += 1;
                self.abandoned = true;
                self.deadline = ctx.now + ctx.config.abandon_timeout;
                Step::Live(PrefillRequest::Draining(self))
            }
            PrefillInput::Timeout
                if ctx.now >= self.deadline && ctx.mutation.is(Mutation::FreeSourceOnAbandon) =>
            {
                // The deliberate bug: trusts an invalidation to stop the write's reads.
                fx.emit(Output::Invalidate {
                    peer: self.binding.to.clone(),
                });
                self.finish(ctx, false, WriteFailure::TransferTimedOut, fx)
            }
            PrefillInput::Timeout if ctx.now >= self.deadline => {
                // The transport has not confirmed the abandon: NIXL cannot stop a posted write
                // (nor does invalidating the peer), so the write may still read these blocks
                // and land with its notification. They stay held until the transport reports
                // the write's end; the fabric bounds that by `max_write_life`.
                if !self.stuck {
                    self.stuck = true;
                    fx.counters.stuck_writes += 1;
                    tracing::warn!(key = %self.common.key, epoch = %epoch, write = %self.binding.write,
                        "abandoned write not confirmed; its source blocks stay held");
                }
                self.deadline = ctx.now + ctx.config.max_write_life;
                Step::Live(PrefillRequest::Draining(self))
            }
            PrefillInput::Registered { from, register } => {
                let binding = &self.binding;
                refuse_other_registration(ctx, &self.common.key, binding, &from, &register, fx);
                Step::Live(PrefillRequest::Draining(self))
            }
            // As in `Writing`: a release next to a registration changes nothing, but is counted.
            PrefillInput::Release {
                epoch: released, ..
            } => {
                fx.drop_input(if released < epoch {
                    DropReason::StaleEpoch
                } else {
                    DropReason::Unexpected
                });
                Step::Live(PrefillRequest::Draining(self))
            }
            PrefillInput::Abort | PrefillInput::Heartbeat => {
                Step::Live(PrefillRequest::Draining(self))
            }
            // Nothing more is posted; the engine's progress only tells whether it still
            // computes into the blocks.
            PrefillInput::LayersReady { ready } => {
                if let Some(producing) = self.common.producing.as_mut() {
                    producing.ready = producing.ready.max(ready.min(producing.plan.layers));
                }
                Step::Live(PrefillRequest::Draining(self))
            }
            PrefillInput::PeerDead { .. } | PrefillInput::Timeout => {
                Step::Live(PrefillRequest::Draining(self))
            }
        }
    }
}
