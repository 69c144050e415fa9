//! The `Writing` state of a P request: its write (or, layer-wise, the parts produced so far)
//! is posted, and it waits for the write's end, a cancel, D's death or the deadline.

use super::{
    cancel_ack, refuse_other_registration, write_failed, DrainCause, Draining, DropReason,
    Mutation, Outbox, Output, PrefillCtx, PrefillInput, PrefillOutcome, PrefillRequest,
    PrefillStep, ReleaseCause, Step, Time, WriteFailure, Writing,
};

impl Writing {
    fn drain(self, ctx: &PrefillCtx<'_>, cause: DrainCause, fx: &mut Outbox) -> PrefillStep {
        // A layer-wise write whose last part will now never be posted cannot end on its own:
        // abandon it, and its end comes once the parts posted ended.
        let abandon_now = matches!(cause, DrainCause::PeerDead | DrainCause::TimedOut)
            || self.common.producing.is_some();
        if abandon_now {
            fx.emit(Output::AbandonWrite {
                write: self.binding.write,
            });
            fx.counters.writes_abandoned += 1;
        }
        let deadline = if abandon_now {
            ctx.now + ctx.config.abandon_timeout
        } else {
            // Let the write finish on its own until its deadline; abandon it then.
            self.write_deadline
        };
        Step::Live(PrefillRequest::Draining(Draining {
            common: self.common,
            binding: self.binding,
            cause,
            cancel_requested: cause == DrainCause::Cancelled,
            abandoned: abandon_now,
            stuck: false,
            deadline,
        }))
    }

    /// Whether the registration of a layer-wise write still waiting for parts lapsed (this
    /// process was stalled past D's heartbeats): no part may be posted into it any more.
    fn registration_lapsed(&self, ctx: &PrefillCtx<'_>) -> bool {
        self.registration_passed(ctx.now) && !ctx.mutation.is(Mutation::ExtendLapsedRegistration)
    }

    fn registration_passed(&self, now: Time) -> bool {
        self.common
            .producing
            .and_then(|p| p.registration_until)
            .is_some_and(|until| now >= until)
    }

    /// Posts the part the prefill's progress made due, if any.
    fn extend(&mut self, ctx: &PrefillCtx<'_>, ready: u32, fx: &mut Outbox) {
        let Some(producing) = self.common.producing.as_mut() else {
            fx.drop_input(DropReason::Unexpected);
            return;
        };
        producing.advance(ready);
        // While the prefill runs, the write's deadline bounds the engine's silence; from the
        // last part on, the transfer's.
        self.write_deadline = ctx.now + ctx.config.write_timeout;
        if let Some(to) = producing.due() {
            fx.emit(Output::ExtendWrite {
                write: self.binding.write,
                from: producing.posted,
                to,
            });
            producing.posted = to;
        }
        if producing.posted == producing.plan.layers {
            self.common.producing = None;
        }
    }

    pub(super) fn handle(
        mut self,
        ctx: &PrefillCtx<'_>,
        input: PrefillInput,
        fx: &mut Outbox,
    ) -> PrefillStep {
        let epoch = self.binding.epoch;
        match input {
            // The shell reports a layer-wise write's end only after its last part (or an
            // abandon): an end before it cannot prove the whole request landed.
            PrefillInput::WriteCompleted if self.common.producing.is_some() => {
                fx.drop_input(DropReason::Unexpected);
                let failure = WriteFailure::TransferFailed;
                self.handle(ctx, PrefillInput::WriteFailed { failure }, fx)
            }
            PrefillInput::WriteCompleted => self.common.end(PrefillOutcome::Sent, Some(epoch)),
            PrefillInput::LayersReady { .. } | PrefillInput::Timeout
                if self.registration_lapsed(ctx) =>
            {
                fx.counters.expired_leases_refused += 1;
                self.drain(ctx, DrainCause::TimedOut, fx)
            }
            PrefillInput::Timeout if self.registration_passed(ctx.now) => {
                // Only the deliberate bug gets here: it forgets the lapse (and its timer).
                if let Some(producing) = self.common.producing.as_mut() {
                    producing.registration_until = None;
                }
                Step::Live(PrefillRequest::Writing(self))
            }
            PrefillInput::LayersReady { ready } => {
                self.extend(ctx, ready, fx);
                Step::Live(PrefillRequest::Writing(self))
            }
            PrefillInput::Heartbeat if self.common.producing.is_some() => {
                let until = ctx.now + ctx.config.registration_ttl;
                if let Some(producing) = self.common.producing.as_mut() {
                    producing.registration_until = Some(until);
                    fx.counters.leases_renewed += 1;
                }
                Step::Live(PrefillRequest::Writing(self))
            }
            PrefillInput::Cancel {
                from,
                epoch: cancelled,
            } if cancelled == epoch
                && self.common.producing.is_some()
                && ctx.mutation.is(Mutation::AckPartialWriteAtOnce) =>
            {
                // The deliberate bug: parts already posted may still land.
                fx.send(&from, cancel_ack(&self.common.key, epoch, ctx.own_rank));
                self.common.end(
                    PrefillOutcome::Released(ReleaseCause::CancelledByPeer),
                    Some(epoch),
                )
            }
            PrefillInput::WriteFailed { failure } => {
                fx.send(
                    &self.binding.to,
                    write_failed(&self.common.key, epoch, ctx.own_rank, failure),
                );
                self.common.end(
                    PrefillOutcome::Released(ReleaseCause::WriteFailed(failure)),
                    Some(epoch),
                )
            }
            PrefillInput::Registered { from, register } => {
                let binding = &self.binding;
                refuse_other_registration(ctx, &self.common.key, binding, &from, &register, fx);
                Step::Live(PrefillRequest::Writing(self))
            }
            PrefillInput::Cancel {
                from,
                epoch: cancelled,
            } if cancelled != epoch => {
                // Nothing of that epoch is in flight here.
                fx.send(&from, cancel_ack(&self.common.key, cancelled, ctx.own_rank));
                Step::Live(PrefillRequest::Writing(self))
            }
            PrefillInput::Cancel { .. } => self.drain(ctx, DrainCause::Cancelled, fx),
            // D releases only keys it never registered; a release next to a registration is a
            // confused or stale peer, and the registration wins.
            PrefillInput::Release {
                epoch: released, ..
            } => {
                fx.drop_input(if released < epoch {
                    DropReason::StaleEpoch
                } else {
                    DropReason::Unexpected
                });
                Step::Live(PrefillRequest::Writing(self))
            }
            PrefillInput::Abort => self.drain(ctx, DrainCause::Aborted, fx),
            PrefillInput::PeerDead { peer } if peer == self.binding.to => {
                self.drain(ctx, DrainCause::PeerDead, fx)
            }
            PrefillInput::PeerDead { .. } => Step::Live(PrefillRequest::Writing(self)),
            PrefillInput::Timeout if ctx.now >= self.write_deadline => {
                self.drain(ctx, DrainCause::TimedOut, fx)
            }
            // The lease does not end while a write reads the blocks; the write deadline bounds it.
            PrefillInput::Timeout | PrefillInput::Heartbeat => {
                Step::Live(PrefillRequest::Writing(self))
            }
        }
    }
}
