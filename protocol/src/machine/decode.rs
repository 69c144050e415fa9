//! `DecodeRequest`: one request on D, from block allocation to its one outcome.
//!
//! ```text
//!   Connecting --PeerConnected/send Register--> Registered --all WriteDone--> [Ready]
//!       |                             resend timer |   \--WriteFailed(all)-----> [Failed]
//!       |          (nothing landed yet, bounded):  |
//!       |          send Register again             |
//!       |--fail/abort/deadline/dead--> [Failed]    |--PeerDead: emit DecodeFenced----+
//!                                                  |--deadline/abort: send Cancel     |
//!                                                  v                                  v
//!                                              Cancelling --CancelAck / WriteFailed / WriteDone
//!                                                  |           / quarantine --> [Failed]
//!                                                  |--PeerDead: emit DecodeFenced (if not yet)
//!                                                  |--last resend: emit DecodeFenced (if not yet)
//!                                                  '--resend timer: send Cancel again
//!   Registered --PeerDead--> Cancelling (no cancel to send; the engine told at once: fenced
//!                            until the quarantine ends or a proof from the old incarnation
//!                            arrives, then [Failed] with the failure told)
//! ```
//!
//! The rule this machine exists for: once a `Register` naming D's blocks has been sent, the
//! blocks are handed back only with a proof that no write of this epoch can still land
//! ([`FreeProof`]).
//!
//! A proof from a dead P may take the whole fence (`Config::quarantine`, minutes), so the
//! request's failure is told apart from its hand-back: the moment a peer's death fences a
//! request, the engine gets [`EndpointEvent::DecodeFenced`] (once, no blocks) and may recompute
//! elsewhere; the final `Decode` event, always `Failed` with the same failure, hands the blocks
//! back later. A request cancelling for another reason (deadline, abort, a partial
//! `WriteFailed`) waits for a live P's answer, which comes within a round trip; if P stops
//! answering it is declared dead within `peer_timeout`, which fences the request and tells the
//! engine then; and if P stays alive but answers none of the cancel's resends (its answers
//! lost, or a write it cannot abandon), the engine is told when the last resend goes out. So
//! the engine hears of every such failure within its deadline plus `peer_timeout`, or plus the
//! cancel's resends, never a fence later.

use std::collections::BTreeSet;

use crate::{
    BlockIds, Cancel, CancelReason, Epoch, Message, PairingKey, Register, RequestId, WriteFailure,
};

use super::effects::{Outbox, Step};
use super::shape::Machine;
use super::types::{
    DecodeFailure, DecodeOutcome, DecodeStart, DropReason, EndpointEvent, FreeProof, Output, Time,
};
use super::{ActiveMutation, Config, Mutation};
use crate::PeerAddr;

mod cancelling;
mod parts;

pub(crate) use parts::PartTally;
use parts::PartVerdict;

/// What every state of a D request knows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DecodeCommon {
    pub(crate) request: RequestId,
    pub(crate) key: PairingKey,
    pub(crate) epoch: Epoch,
    pub(crate) prefill: PeerAddr,
    pub(crate) blocks: BlockIds,
    pub(crate) num_tokens: u64,
    pub(crate) expected_writes: u32,
    /// When D stops waiting for P's data.
    pub(crate) deadline: Time,
    /// The parts of layer-wise writes that landed, per P rank.
    pub(crate) parts: PartTally,
    /// The attempt's trace id, made here and sent in the registration.
    pub(crate) trace: crate::TraceId,
}

/// Waiting for the handshake with P; the blocks are not exposed yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Connecting {
    pub(crate) common: DecodeCommon,
}

/// The registration is sent; P may write at any time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Registered {
    pub(crate) common: DecodeCommon,
    /// P ranks whose writes of this epoch have landed.
    pub(crate) landed: BTreeSet<u32>,
    /// When the registration is sent again if nothing landed by then: the first send's time
    /// plus as many intervals as resends were due, so that late timers do not push the
    /// resends later and later.
    pub(crate) next_register: Time,
    /// Resends of the registration left.
    pub(crate) registers_left: u32,
}

impl Registered {
    /// Whether the registration is due again: nothing answered it, and resends are left.
    fn register_due(&self, now: Time) -> bool {
        self.registers_left > 0 && self.nothing_landed() && now >= self.next_register
    }

    /// Takes the resend that is due: whether it may leave now. A resend leaves at most
    /// [`Config::register_resend_grace`] after its time, so that the last copy leaves within
    /// the span P's records count on ([`Config::tombstone_min_life`]); the resends a stall of
    /// this process carried past that are skipped, not sent on its resume (a copy sent then
    /// could reach P after its record of the key had gone, and P would hold it for a later
    /// prefill of the key). Returns how many it skipped beside whether one leaves.
    fn take_resend(&mut self, config: &Config, now: Time) -> (bool, u64) {
        let interval = config.register_retry_interval;
        let mut skipped = 0;
        // The resends whose whole interval a stall passed.
        while self.registers_left > 0 && self.next_register + interval <= now {
            self.registers_left -= 1;
            self.next_register = self.next_register + interval;
            skipped += 1;
        }
        if self.registers_left == 0 {
            return (false, skipped);
        }
        let on_time = now <= self.next_register + config.register_resend_grace();
        self.registers_left -= 1;
        self.next_register = self.next_register + interval;
        (on_time, skipped + u64::from(!on_time))
    }

    fn nothing_landed(&self) -> bool {
        self.landed.is_empty() && !self.common.parts.any()
    }

    fn next_timer(&self) -> Time {
        if self.registers_left > 0 && self.nothing_landed() {
            self.next_register.min(self.common.deadline)
        } else {
            self.common.deadline
        }
    }
}

/// D gave up; waiting for proof that no write can still land.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Cancelling {
    pub(crate) common: DecodeCommon,
    pub(crate) reason: DecodeFailure,
    /// P ranks known to have nothing in flight (landed or quiesced).
    pub(crate) settled: BTreeSet<u32>,
    pub(crate) next_resend: Time,
    pub(crate) resends_left: u32,
    pub(crate) quarantine_until: Time,
    /// The engine was told of the failure while the blocks stay fenced
    /// ([`EndpointEvent::DecodeFenced`]): never told twice.
    pub(crate) announced: bool,
}

/// A live D request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum DecodeRequest {
    Connecting(Connecting),
    Registered(Registered),
    Cancelling(Cancelling),
}

/// A D request's terminal record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DecodeEnded {
    pub(crate) common: DecodeCommon,
    pub(crate) outcome: DecodeOutcome,
    pub(crate) proof: FreeProof,
    /// The failure the engine was told of early ([`EndpointEvent::DecodeFenced`]), if it was:
    /// the outcome must repeat it.
    pub(crate) announced: Option<DecodeFailure>,
}

/// What can happen to a live D request. Epochs are checked by the endpoint before routing: these
/// inputs are all for the request's current epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum DecodeInput {
    PeerConnected,
    PeerConnectFailed,
    PeerDead,
    WriteDone {
        rank: u32,
    },
    /// Layers `first .. first + count` of `of` of the rank's layer-wise write landed.
    PartDone {
        rank: u32,
        first: u32,
        count: u32,
        of: u32,
    },
    WriteFailed {
        rank: u32,
        reason: WriteFailure,
    },
    CancelAck {
        rank: u32,
    },
    Abort,
    Shutdown,
    Timeout,
}

pub(crate) type DecodeStep = Step<DecodeRequest, DecodeEnded>;

impl DecodeCommon {
    pub(crate) fn from_start(start: DecodeStart, deadline: Time, trace: crate::TraceId) -> Self {
        DecodeCommon {
            request: start.request,
            key: start.key,
            epoch: start.epoch,
            prefill: start.prefill,
            blocks: start.blocks,
            num_tokens: start.num_tokens,
            expected_writes: start.expected_writes,
            deadline,
            parts: PartTally::default(),
            trace,
        }
    }

    fn end(self, outcome: DecodeOutcome, proof: FreeProof) -> DecodeStep {
        Step::Ended(DecodeEnded {
            common: self,
            outcome,
            proof,
            announced: None,
        })
    }

    /// Tells the engine that the request failed while its blocks stay fenced.
    fn announce_fenced(&self, failure: DecodeFailure, fx: &mut Outbox) {
        fx.emit(Output::Event(EndpointEvent::DecodeFenced {
            request: self.request.clone(),
            key: self.key.clone(),
            epoch: self.epoch,
            failure,
        }));
        fx.counters.decodes_fenced += 1;
    }

    fn register_message(&self, own: &PeerAddr) -> Message {
        Message::Register(Box::new(Register {
            key: self.key.clone(),
            epoch: self.epoch,
            decode_engine: own.engine.clone(),
            decode_request: self.request.clone(),
            decode_rank: own.rank,
            blocks: self.blocks.clone(),
            num_tokens: self.num_tokens,
            trace_id: self.trace,
            // D's shell names its memory from its route as it sends (`TransportDriver::perform`).
            memory: Vec::new(),
        }))
    }

    /// Counts a part of `rank`'s layer-wise write (`first`, `count`, `of`): the rank, once its
    /// parts cover every layer (as its `WriteDone`); a refused part is counted as dropped.
    fn count_part(
        &mut self,
        ctx: &DecodeCtx<'_>,
        rank: u32,
        part: (u32, u32, u32),
        fx: &mut Outbox,
    ) -> Option<u32> {
        let early = ctx.mutation(Mutation::ReadyOnFirstPart);
        match self.parts.add(rank, part, early) {
            PartVerdict::Complete => Some(rank),
            PartVerdict::Partial => None,
            PartVerdict::Refused(reason) => {
                fx.drop_input(reason);
                None
            }
        }
    }

    fn cancel_message(&self, reason: CancelReason) -> Message {
        Message::Cancel(Cancel {
            key: self.key.clone(),
            epoch: self.epoch,
            reason,
        })
    }
}

fn cancel_reason(reason: DecodeFailure) -> CancelReason {
    match reason {
        DecodeFailure::Deadline => CancelReason::Deadline,
        DecodeFailure::Shutdown => CancelReason::Shutdown,
        DecodeFailure::Aborted
        | DecodeFailure::PeerDead
        | DecodeFailure::WriteFailed(_)
        | DecodeFailure::HandshakeFailed
        | DecodeFailure::Incompatible => CancelReason::Aborted,
    }
}

/// Context a transition needs besides its own state.
pub(crate) struct DecodeCtx<'a> {
    pub(crate) now: Time,
    pub(crate) own: &'a PeerAddr,
    pub(crate) config: &'a Config,
    pub(crate) mutation: ActiveMutation,
}

impl DecodeCtx<'_> {
    fn mutation(&self, which: Mutation) -> bool {
        self.mutation.is(which)
    }
}

impl DecodeRequest {
    /// A new request, waiting for the handshake with P.
    pub(crate) fn new(common: DecodeCommon) -> Self {
        assert!(common.expected_writes >= 1, "a D request expects a write");
        assert!(
            !common.blocks.is_empty(),
            "a D request with no blocks is a full hit"
        );
        DecodeRequest::Connecting(Connecting { common })
    }

    pub(crate) fn common(&self) -> &DecodeCommon {
        match self {
            DecodeRequest::Connecting(s) => &s.common,
            DecodeRequest::Registered(s) => &s.common,
            DecodeRequest::Cancelling(s) => &s.common,
        }
    }

    /// True while P may hold this request's lease (the registration was sent and not settled).
    pub(crate) fn holds_lease(&self) -> bool {
        match self {
            // A request that gave up must not keep P's registration alive: the quarantine is
            // sized on the assumption that renewals stop at the cancel.
            DecodeRequest::Connecting(_) | DecodeRequest::Cancelling(_) => false,
            DecodeRequest::Registered(_) => true,
        }
    }
}

impl Machine for DecodeRequest {
    type Ctx<'a> = DecodeCtx<'a>;
    type Input = DecodeInput;
    type Next = DecodeStep;

    /// When this request next needs [`DecodeInput::Timeout`].
    fn next_timer(&self, _config: &Config) -> Time {
        match self {
            DecodeRequest::Connecting(s) => s.common.deadline,
            DecodeRequest::Registered(s) => s.next_timer(),
            DecodeRequest::Cancelling(s) => {
                if s.resends_left > 0 {
                    s.next_resend.min(s.quarantine_until)
                } else {
                    s.quarantine_until
                }
            }
        }
    }

    fn handle(self, ctx: &Self::Ctx<'_>, input: Self::Input, fx: &mut Outbox) -> Self::Next {
        match self {
            DecodeRequest::Connecting(s) => s.handle(ctx, input, fx),
            DecodeRequest::Registered(s) => s.handle(ctx, input, fx),
            DecodeRequest::Cancelling(s) => s.handle(ctx, input, fx),
        }
    }
}

impl Connecting {
    fn handle(self, ctx: &DecodeCtx<'_>, input: DecodeInput, fx: &mut Outbox) -> DecodeStep {
        let failed = |s: Self, reason| {
            s.common
                .end(DecodeOutcome::Failed(reason), FreeProof::NeverExposed)
        };
        match input {
            DecodeInput::PeerConnected => {
                fx.send(&self.common.prefill, self.common.register_message(ctx.own));
                Step::Live(DecodeRequest::Registered(Registered {
                    common: self.common,
                    landed: BTreeSet::new(),
                    next_register: ctx.now + ctx.config.register_retry_interval,
                    registers_left: ctx.config.max_register_retries,
                }))
            }
            DecodeInput::PeerConnectFailed => failed(self, DecodeFailure::HandshakeFailed),
            DecodeInput::PeerDead => failed(self, DecodeFailure::PeerDead),
            DecodeInput::Abort => failed(self, DecodeFailure::Aborted),
            DecodeInput::Shutdown => failed(self, DecodeFailure::Shutdown),
            DecodeInput::Timeout if ctx.now >= self.common.deadline => {
                failed(self, DecodeFailure::Deadline)
            }
            DecodeInput::Timeout => Step::Live(DecodeRequest::Connecting(self)),
            // Nothing was registered, so P cannot have written or acknowledged anything.
            DecodeInput::WriteDone { .. }
            | DecodeInput::PartDone { .. }
            | DecodeInput::WriteFailed { .. }
            | DecodeInput::CancelAck { .. } => {
                fx.drop_input(DropReason::Unexpected);
                Step::Live(DecodeRequest::Connecting(self))
            }
        }
    }
}

impl Registered {
    /// P is declared dead or replaced: nothing can be sent to it, so no cancel; the blocks
    /// wait for the fence (`quarantine`) or for a proof the old incarnation still sends. The
    /// engine hears of the failure now: it need not wait out the fence to recompute.
    fn fence(self, ctx: &DecodeCtx<'_>, fx: &mut Outbox) -> DecodeStep {
        self.common.announce_fenced(DecodeFailure::PeerDead, fx);
        Step::Live(DecodeRequest::Cancelling(Cancelling {
            common: self.common,
            reason: DecodeFailure::PeerDead,
            settled: self.landed,
            next_resend: ctx.now,
            resends_left: 0,
            quarantine_until: ctx.now + ctx.config.quarantine,
            announced: true,
        }))
    }

    fn cancel(self, ctx: &DecodeCtx<'_>, reason: DecodeFailure, fx: &mut Outbox) -> DecodeStep {
        fx.send(
            &self.common.prefill,
            self.common.cancel_message(cancel_reason(reason)),
        );
        Step::Live(DecodeRequest::Cancelling(Cancelling {
            common: self.common,
            reason,
            settled: self.landed,
            next_resend: ctx.now + ctx.config.cancel_retry_interval,
            resends_left: ctx.config.max_cancel_retries,
            quarantine_until: ctx.now + ctx.config.quarantine,
            announced: false,
        }))
    }

    fn handle(mut self, ctx: &DecodeCtx<'_>, input: DecodeInput, fx: &mut Outbox) -> DecodeStep {
        match input {
            DecodeInput::PartDone {
                rank,
                first,
                count,
                of,
            } => match self.common.count_part(ctx, rank, (first, count, of), fx) {
                Some(rank) => self.handle(ctx, DecodeInput::WriteDone { rank }, fx),
                None => Step::Live(DecodeRequest::Registered(self)),
            },
            DecodeInput::WriteDone { rank } => {
                if !self.landed.insert(rank) {
                    fx.drop_input(DropReason::Duplicate);
                    return Step::Live(DecodeRequest::Registered(self));
                }
                if self.landed.len() >= self.common.expected_writes as usize {
                    return self
                        .common
                        .end(DecodeOutcome::Ready, FreeProof::WritesCompleted);
                }
                Step::Live(DecodeRequest::Registered(self))
            }
            DecodeInput::WriteFailed { rank, reason } => {
                let failure = DecodeFailure::WriteFailed(reason);
                self.landed.insert(rank);
                if self.landed.len() >= self.common.expected_writes as usize {
                    // Every source rank has either landed or promised nothing is in flight.
                    return self
                        .common
                        .end(DecodeOutcome::Failed(failure), FreeProof::PeerQuiesced);
                }
                self.cancel(ctx, failure, fx)
            }
            DecodeInput::PeerDead if ctx.mutation(Mutation::FreeOnPeerDead) => {
                // The deliberate bug: trusts the invalidation to stop P's writes.
                self.common.end(
                    DecodeOutcome::Failed(DecodeFailure::PeerDead),
                    FreeProof::DeadPeerFence,
                )
            }
            // NIXL cannot stop P's writes, and a peer declared dead may be alive (a partition,
            // a stall): the blocks are fenced, not freed (see `Cancelling`).
            DecodeInput::PeerDead => self.fence(ctx, fx),
            DecodeInput::Abort => self.cancel(ctx, DecodeFailure::Aborted, fx),
            DecodeInput::Shutdown => self.cancel(ctx, DecodeFailure::Shutdown, fx),
            DecodeInput::Timeout
                if ctx.now >= self.common.deadline && ctx.mutation(Mutation::FreeOnDeadline) =>
            {
                // The deliberate bug of the mutation check: no proof that P stopped writing.
                fx.send(
                    &self.common.prefill,
                    self.common.cancel_message(CancelReason::Deadline),
                );
                self.common.end(
                    DecodeOutcome::Failed(DecodeFailure::Deadline),
                    FreeProof::Quarantine,
                )
            }
            DecodeInput::Timeout if ctx.now >= self.common.deadline => {
                self.cancel(ctx, DecodeFailure::Deadline, fx)
            }
            DecodeInput::Timeout if self.register_due(ctx.now) => {
                // A lost `Register` must not cost the whole deadline. P takes a copy of a
                // registration it holds as a duplicate.
                let (send, skipped) = self.take_resend(ctx.config, ctx.now);
                if send {
                    fx.send(&self.common.prefill, self.common.register_message(ctx.own));
                    fx.counters.register_resends += 1;
                }
                fx.counters.register_resends_skipped += skipped;
                Step::Live(DecodeRequest::Registered(self))
            }
            DecodeInput::Timeout => Step::Live(DecodeRequest::Registered(self)),
            // A reconnect does not change what was registered.
            DecodeInput::PeerConnected | DecodeInput::PeerConnectFailed => {
                Step::Live(DecodeRequest::Registered(self))
            }
            DecodeInput::CancelAck { .. } => {
                fx.drop_input(DropReason::Unexpected);
                Step::Live(DecodeRequest::Registered(self))
            }
        }
    }
}

#[cfg(test)]
mod tests;
