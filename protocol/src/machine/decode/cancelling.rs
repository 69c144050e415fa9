//! The `Cancelling` state of a D request: D gave up on the attempt and waits for P's answer
//! (its ack, or the write's end) or for its fence, before the blocks may be handed back.

use super::{
    cancel_reason, Cancelling, DecodeCtx, DecodeEnded, DecodeFailure, DecodeInput, DecodeOutcome,
    DecodeRequest, DecodeStep, DropReason, FreeProof, Mutation, Outbox, Step,
};

impl Cancelling {
    /// The one way a cancelling request ends: failed for its first reason, whatever proof
    /// frees it — so a request the engine was told of early ends as it was told, never
    /// `Ready` (a late `WriteDone` only proves that the write is over).
    fn end(self, proof: FreeProof) -> DecodeStep {
        Step::Ended(DecodeEnded {
            outcome: DecodeOutcome::Failed(self.reason),
            proof,
            announced: self.announced.then_some(self.reason),
            common: self.common,
        })
    }

    fn settle(mut self, rank: u32, proof: FreeProof, fx: &mut Outbox) -> DecodeStep {
        if !self.settled.insert(rank) {
            // As in `Registered`: the rank already settled; counted, and nothing changes.
            fx.drop_input(DropReason::Duplicate);
            return Step::Live(DecodeRequest::Cancelling(self));
        }
        if self.settled.len() >= self.common.expected_writes as usize {
            return self.end(proof);
        }
        Step::Live(DecodeRequest::Cancelling(self))
    }

    pub(super) fn handle(
        mut self,
        ctx: &DecodeCtx<'_>,
        input: DecodeInput,
        fx: &mut Outbox,
    ) -> DecodeStep {
        match input {
            // Each source rank acknowledges for itself; the blocks come back once every rank
            // that may write has settled.
            DecodeInput::CancelAck { rank } => self.settle(rank, FreeProof::CancelAcknowledged, fx),
            DecodeInput::PeerDead if ctx.mutation(Mutation::FreeOnPeerDead) => {
                self.end(FreeProof::DeadPeerFence)
            }
            // Nobody to resend the cancel to; the quarantine already runs from the cancel, when
            // renewals stopped, so it bounds the old incarnation's writes too. The request is
            // now fenced by the death like one fenced from `Registered`, so the engine hears
            // of it now (once: a second death, after a rejoin, tells it nothing new).
            DecodeInput::PeerDead => {
                self.resends_left = 0;
                if !self.announced || ctx.mutation(Mutation::TellFencedTwice) {
                    self.common.announce_fenced(self.reason, fx);
                    self.announced = true;
                }
                Step::Live(DecodeRequest::Cancelling(self))
            }
            DecodeInput::WriteDone { rank } => self.settle(rank, FreeProof::WritesCompleted, fx),
            // Only every part of a rank's write proves that none of it is still in flight.
            DecodeInput::PartDone {
                rank,
                first,
                count,
                of,
            } => match self.common.count_part(ctx, rank, (first, count, of), fx) {
                Some(rank) => self.settle(rank, FreeProof::WritesCompleted, fx),
                None => Step::Live(DecodeRequest::Cancelling(self)),
            },
            DecodeInput::WriteFailed { rank, .. } => self.settle(rank, FreeProof::PeerQuiesced, fx),
            DecodeInput::Timeout if ctx.now >= self.quarantine_until => {
                let proof = match self.reason {
                    DecodeFailure::PeerDead => FreeProof::DeadPeerFence,
                    DecodeFailure::Deadline
                    | DecodeFailure::WriteFailed(_)
                    | DecodeFailure::Aborted
                    | DecodeFailure::Shutdown
                    | DecodeFailure::HandshakeFailed
                    | DecodeFailure::Incompatible => FreeProof::Quarantine,
                };
                self.end(proof)
            }
            DecodeInput::Timeout if self.resends_left > 0 && ctx.now >= self.next_resend => {
                fx.send(
                    &self.common.prefill,
                    self.common.cancel_message(cancel_reason(self.reason)),
                );
                fx.counters.cancel_resends += 1;
                self.resends_left -= 1;
                self.next_resend = ctx.now + ctx.config.cancel_retry_interval;
                if self.resends_left == 0 && !self.announced {
                    // The last resend, and nothing answered the others while P is not declared
                    // dead (its heartbeats get through, its answers do not, or it is stuck on a
                    // write it cannot abandon): if this one goes unanswered too the blocks wait
                    // for the quarantine, so the engine hears of the failure now. Harmless if an
                    // answer comes after all: the blocks come back with it.
                    fx.counters.cancels_unanswered += 1;
                    self.common.announce_fenced(self.reason, fx);
                    self.announced = true;
                }
                Step::Live(DecodeRequest::Cancelling(self))
            }
            DecodeInput::Timeout => Step::Live(DecodeRequest::Cancelling(self)),
            // The endpoint feeds this only when the incarnation that was declared dead
            // connected again (a false death healed): it can answer for its writes, so ask it
            // again rather than wait out the fence.
            DecodeInput::PeerConnected => {
                fx.send(
                    &self.common.prefill,
                    self.common.cancel_message(cancel_reason(self.reason)),
                );
                fx.counters.cancel_resends += 1;
                self.resends_left = ctx.config.max_cancel_retries;
                self.next_resend = ctx.now + ctx.config.cancel_retry_interval;
                Step::Live(DecodeRequest::Cancelling(self))
            }
            // Already giving up; the first reason stands.
            DecodeInput::Abort | DecodeInput::Shutdown | DecodeInput::PeerConnectFailed => {
                Step::Live(DecodeRequest::Cancelling(self))
            }
        }
    }
}
