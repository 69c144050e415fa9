//! `PrefillRequest`: one request on P, from finished prefill to its one outcome.
//!
//! ```text
//!   Held --Register(fits)/post write--> Writing --WriteCompleted--> [Sent]
//!    |  \--Register(misfit)---------> [Released(Rejected)]   \--WriteFailed--> [Released]
//!    |--lease end / Cancel / Release / Abort --> [Released]   |
//!                         Cancel / Abort / PeerDead / write deadline
//!                                                             v
//!                                         Draining --completion or failure--> [Sent | Released]
//! ```
//!
//! P never frees blocks that a posted write may still read, and never answers a cancel before
//! the epoch's write is drained. An abandon the transport does not confirm leaves the request
//! `Draining` (counted in `Counters::stuck_writes`) until the transport reports the write's end:
//! NIXL cannot stop a posted write, so no deadline may free its source blocks.

use crate::{
    BlockIds, CancelAck, Epoch, Message, PairingKey, Register, ReleaseReason, RequestId, WriteDone,
    WriteFailed, WriteFailure,
};

mod draining;
mod pairing;
mod writing;

use super::effects::{Outbox, Step};
use super::shape::Machine;
use super::types::{
    DropReason, LayerPlan, Output, PrefillOutcome, ReleaseCause, StreamedLayers, Time, WriteOrder,
};
use super::{ActiveMutation, Config, Mutation};
use crate::{PeerAddr, WriteId};
pub(crate) use pairing::pair_blocks;

/// What every state of a P request knows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PrefillCommon {
    pub(crate) request: RequestId,
    pub(crate) key: PairingKey,
    pub(crate) blocks: BlockIds,
    /// A layer-wise request whose last part is not posted yet; `None` for a whole-request
    /// push, and once the last part of a layer-wise one is posted.
    pub(crate) producing: Option<Producing>,
}

/// Where a layer-wise request's prefill and its write parts are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Producing {
    pub(crate) plan: LayerPlan,
    /// Layers `0 .. ready` hold their KV.
    pub(crate) ready: u32,
    /// Layers `0 .. posted` are posted (`posted <= ready`).
    pub(crate) posted: u32,
    /// Once bound: until when D's registration is known to stand (renewed by D's heartbeats,
    /// by `registration_ttl`, as a pending registration is). No part is posted after it: D may
    /// have given up and fenced its blocks by its quarantine, which is sized on that TTL.
    pub(crate) registration_until: Option<Time>,
}

impl Producing {
    /// A layer-wise request whose prefill starts.
    pub(crate) fn start(plan: LayerPlan) -> Self {
        assert!(plan.layers >= 1 && (1..=plan.layers).contains(&plan.part_layers));
        Producing {
            plan,
            ready: 0,
            posted: 0,
            registration_until: None,
        }
    }

    /// The end of the part due now, if one is: all new layers once a part's worth is ready,
    /// or the rest once the last layer is.
    fn due(&self) -> Option<u32> {
        let last = self.ready == self.plan.layers;
        let new = self.ready - self.posted;
        (new > 0 && (last || new >= self.plan.part_layers)).then_some(self.ready)
    }

    /// The prefill produced layers `0 .. ready` (a smaller count than known changes nothing).
    fn advance(&mut self, ready: u32) {
        self.ready = self.ready.max(ready.min(self.plan.layers));
        assert!(self.posted <= self.ready && self.ready <= self.plan.layers);
    }

    /// Whether the engine still produces layers into the blocks.
    pub(crate) fn still_computing(&self) -> bool {
        self.ready < self.plan.layers
    }
}

/// Finished, waiting for D's registration, under a lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Held {
    pub(crate) common: PrefillCommon,
    pub(crate) lease_until: Time,
}

/// Where an epoch's write goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Binding {
    pub(crate) epoch: Epoch,
    pub(crate) to: PeerAddr,
    pub(crate) write: WriteId,
    /// The trace id of D's attempt, from its registration.
    pub(crate) trace: crate::TraceId,
}

/// A write is posted for one epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Writing {
    pub(crate) common: PrefillCommon,
    pub(crate) binding: Binding,
    pub(crate) write_deadline: Time,
}

/// Why a write is being drained instead of awaited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DrainCause {
    Cancelled,
    Aborted,
    PeerDead,
    TimedOut,
}

/// The write must stop; waiting for the transport to say it cannot land any more.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Draining {
    pub(crate) common: PrefillCommon,
    pub(crate) binding: Binding,
    pub(crate) cause: DrainCause,
    /// Whether D asked to cancel: it gets a `CancelAck` once drained.
    pub(crate) cancel_requested: bool,
    /// Whether the transport was told to abandon the write.
    pub(crate) abandoned: bool,
    /// Whether the abandon went unconfirmed past `abandon_timeout` (counted once).
    pub(crate) stuck: bool,
    /// When to abandon (if not yet) or give up on the transport (if abandoned).
    pub(crate) deadline: Time,
}

/// A live P request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PrefillRequest {
    Held(Held),
    Writing(Writing),
    Draining(Draining),
}

/// A P request's terminal record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PrefillEnded {
    pub(crate) common: PrefillCommon,
    pub(crate) outcome: PrefillOutcome,
    /// The epoch the blocks were bound to, if any.
    pub(crate) epoch: Option<Epoch>,
}

/// What can happen to a live P request. The prefill table routes by key; epochs are compared here
/// because P learns its epoch from the registration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PrefillInput {
    Registered {
        from: PeerAddr,
        register: Box<Register>,
    },
    Heartbeat,
    /// Layer-wise: the prefill produced layers `0 .. ready`.
    LayersReady {
        ready: u32,
    },
    Cancel {
        from: PeerAddr,
        epoch: Epoch,
    },
    Release {
        epoch: Epoch,
        reason: ReleaseReason,
    },
    Abort,
    WriteCompleted,
    WriteFailed {
        failure: WriteFailure,
    },
    PeerDead {
        peer: PeerAddr,
    },
    Timeout,
}

pub(crate) type PrefillStep = Step<PrefillRequest, PrefillEnded>;

/// Context a transition needs besides its own state.
pub(crate) struct PrefillCtx<'a> {
    pub(crate) now: Time,
    pub(crate) own_rank: u32,
    pub(crate) config: &'a Config,
    /// The id the next posted write gets; the prefill table advances it when one is used.
    pub(crate) next_write: WriteId,
    pub(crate) mutation: ActiveMutation,
}

impl PrefillCommon {
    fn end(self, outcome: PrefillOutcome, epoch: Option<Epoch>) -> PrefillStep {
        Step::Ended(PrefillEnded {
            common: self,
            outcome,
            epoch,
        })
    }
}

fn write_failed(key: &PairingKey, epoch: Epoch, rank: u32, reason: WriteFailure) -> Message {
    Message::WriteFailed(WriteFailed {
        key: key.clone(),
        epoch,
        prefill_rank: rank,
        reason,
    })
}

fn cancel_ack(key: &PairingKey, epoch: Epoch, rank: u32) -> Message {
    Message::CancelAck(CancelAck {
        key: key.clone(),
        epoch,
        prefill_rank: rank,
    })
}

/// A registration for a key whose blocks are already bound to an epoch: a duplicate or a stale
/// one is dropped; a newer attempt is told the blocks are unavailable (they serve one attempt).
/// The answer goes to the registrant (`from`), which need not be the rank the blocks are bound to.
fn refuse_other_registration(
    ctx: &PrefillCtx<'_>,
    key: &PairingKey,
    binding: &Binding,
    from: &PeerAddr,
    register: &Register,
    fx: &mut Outbox,
) {
    if register.epoch == binding.epoch {
        fx.drop_input(DropReason::Duplicate);
    } else if register.epoch < binding.epoch {
        fx.drop_input(DropReason::StaleEpoch);
    } else {
        fx.drop_input(DropReason::FutureEpoch);
        fx.send(
            from,
            write_failed(key, register.epoch, ctx.own_rank, WriteFailure::Unavailable),
        );
    }
}

impl PrefillRequest {
    /// A finished request waiting for its registration.
    pub(crate) fn held(common: PrefillCommon, now: Time, config: &Config) -> Self {
        assert!(!common.blocks.is_empty(), "an empty P request ends at once");
        PrefillRequest::Held(Held {
            common,
            lease_until: now + config.lease_duration,
        })
    }

    pub(crate) fn common(&self) -> &PrefillCommon {
        match self {
            PrefillRequest::Held(s) => &s.common,
            PrefillRequest::Writing(s) => &s.common,
            PrefillRequest::Draining(s) => &s.common,
        }
    }

    /// The epoch the blocks are bound to, once a registration was matched.
    pub(crate) fn bound_epoch(&self) -> Option<Epoch> {
        match self {
            PrefillRequest::Held(_) => None,
            PrefillRequest::Writing(s) => Some(s.binding.epoch),
            PrefillRequest::Draining(s) => Some(s.binding.epoch),
        }
    }

    /// The trace id of the attempt the blocks are bound to, once a registration was matched.
    pub(crate) fn bound_trace(&self) -> Option<crate::TraceId> {
        match self {
            PrefillRequest::Held(_) => None,
            PrefillRequest::Writing(s) => Some(s.binding.trace),
            PrefillRequest::Draining(s) => Some(s.binding.trace),
        }
    }

    /// The peer the blocks are bound to, once a registration was matched.
    pub(crate) fn bound_peer(&self) -> Option<&PeerAddr> {
        match self {
            PrefillRequest::Held(_) => None,
            PrefillRequest::Writing(s) => Some(&s.binding.to),
            PrefillRequest::Draining(s) => Some(&s.binding.to),
        }
    }

    /// The write in flight, if any.
    pub(crate) fn write(&self) -> Option<WriteId> {
        match self {
            PrefillRequest::Held(_) => None,
            PrefillRequest::Writing(s) => Some(s.binding.write),
            PrefillRequest::Draining(s) => Some(s.binding.write),
        }
    }
}

impl Machine for PrefillRequest {
    type Ctx<'a> = PrefillCtx<'a>;
    type Input = PrefillInput;
    type Next = PrefillStep;

    /// When this request next needs [`PrefillInput::Timeout`].
    fn next_timer(&self, _config: &Config) -> Time {
        match self {
            PrefillRequest::Held(s) => s.lease_until,
            PrefillRequest::Writing(s) => s
                .common
                .producing
                .and_then(|p| p.registration_until)
                .map_or(s.write_deadline, |until| until.min(s.write_deadline)),
            PrefillRequest::Draining(s) => s.deadline,
        }
    }

    fn handle(self, ctx: &Self::Ctx<'_>, input: Self::Input, fx: &mut Outbox) -> Self::Next {
        match self {
            PrefillRequest::Held(s) => s.handle(ctx, input, fx),
            PrefillRequest::Writing(s) => s.handle(ctx, input, fx),
            PrefillRequest::Draining(s) => s.handle(ctx, input, fx),
        }
    }
}

impl Held {
    /// Answers a registration `WriteFailed(failure)` and releases the blocks (`cause`) without
    /// writing: the attempt's epoch becomes the key's floor.
    fn refuse(
        self,
        ctx: &PrefillCtx<'_>,
        from: &PeerAddr,
        register: &Register,
        (failure, cause): (WriteFailure, ReleaseCause),
        fx: &mut Outbox,
    ) -> PrefillStep {
        let answer = write_failed(&register.key, register.epoch, ctx.own_rank, failure);
        fx.send(from, answer);
        self.common
            .end(PrefillOutcome::Released(cause), Some(register.epoch))
    }

    /// Starts the write for a registration, or rejects a registration that does not fit.
    fn start_write(
        mut self,
        ctx: &PrefillCtx<'_>,
        from: PeerAddr,
        register: Register,
        fx: &mut Outbox,
    ) -> PrefillStep {
        let Some(local) = pair_blocks(
            &self.common.blocks,
            &register.blocks,
            ctx.config.block_pairing,
        ) else {
            let refused = (WriteFailure::PlanMismatch, ReleaseCause::Rejected);
            return self.refuse(ctx, &from, &register, refused, fx);
        };
        let write = ctx.next_write;
        let registration_until = ctx.now + ctx.config.registration_ttl;
        let stream = self.common.producing.as_mut().map(|p| {
            p.registration_until = Some(registration_until);
            p.posted = p.due().unwrap_or(0);
            StreamedLayers {
                layers: p.plan.layers,
                posted: p.posted,
            }
        });
        if stream.is_some_and(|s| s.posted == s.layers) {
            self.common.producing = None;
        }
        let trace = register.trace_id;
        fx.emit(Output::PostWrite(Box::new(WriteOrder {
            write,
            to: from.clone(),
            key: register.key.clone(),
            epoch: register.epoch,
            local,
            remote: register.blocks,
            remote_memory: register.memory,
            notification: Message::WriteDone(WriteDone {
                key: register.key,
                epoch: register.epoch,
                prefill_rank: ctx.own_rank,
                // The shell digests the bytes it posts (`Config::integrity_digest`).
                digests: Vec::new(),
            }),
            stream,
        })));
        fx.counters.writes_posted += 1;
        Step::Live(PrefillRequest::Writing(Writing {
            common: self.common,
            binding: Binding {
                epoch: register.epoch,
                to: from,
                write,
                trace,
            },
            write_deadline: ctx.now + ctx.config.write_timeout,
        }))
    }

    fn handle(mut self, ctx: &PrefillCtx<'_>, input: PrefillInput, fx: &mut Outbox) -> PrefillStep {
        // The lease ended and its timer has not run (this process was stalled): the blocks are
        // released as the timer would have, whatever the late input says. D may have fenced
        // and reused the blocks it registered since.
        let lapsed = ctx.now >= self.lease_until && !ctx.mutation.is(Mutation::WriteOnExpiredLease);
        match input {
            PrefillInput::Registered { from, register } if lapsed => {
                fx.counters.expired_leases_refused += 1;
                let refused = (WriteFailure::LeaseExpired, ReleaseCause::LeaseExpired);
                self.refuse(ctx, &from, &register, refused, fx)
            }
            PrefillInput::Heartbeat | PrefillInput::LayersReady { .. } if lapsed => {
                fx.counters.expired_leases_refused += 1;
                self.common
                    .end(PrefillOutcome::Released(ReleaseCause::LeaseExpired), None)
            }
            PrefillInput::Registered { from, register } => {
                self.start_write(ctx, from, *register, fx)
            }
            PrefillInput::Heartbeat => {
                self.lease_until = self.lease_until.max(ctx.now + ctx.config.lease_extension);
                fx.counters.leases_renewed += 1;
                Step::Live(PrefillRequest::Held(self))
            }
            // The prefill goes on: the blocks wait for D under a lease that runs from the
            // latest layer (the engine's progress is its heartbeat).
            PrefillInput::LayersReady { ready } => {
                match self.common.producing.as_mut() {
                    Some(producing) => {
                        producing.advance(ready);
                        self.lease_until =
                            self.lease_until.max(ctx.now + ctx.config.lease_duration);
                    }
                    None => fx.drop_input(DropReason::Unexpected),
                }
                Step::Live(PrefillRequest::Held(self))
            }
            PrefillInput::Cancel { from, epoch } => {
                // D gave up before P saw its registration (a cancel overtaking a registration
                // lands here too): nothing was posted, so acknowledge at once.
                fx.send(&from, cancel_ack(&self.common.key, epoch, ctx.own_rank));
                self.common.end(
                    PrefillOutcome::Released(ReleaseCause::CancelledByPeer),
                    Some(epoch),
                )
            }
            PrefillInput::Release { epoch, reason } => self.common.end(
                PrefillOutcome::Released(ReleaseCause::ReleasedByPeer(reason)),
                Some(epoch),
            ),
            PrefillInput::Abort => self
                .common
                .end(PrefillOutcome::Released(ReleaseCause::Aborted), None),
            PrefillInput::Timeout if ctx.now >= self.lease_until => self
                .common
                .end(PrefillOutcome::Released(ReleaseCause::LeaseExpired), None),
            PrefillInput::Timeout => Step::Live(PrefillRequest::Held(self)),
            // Held blocks are not bound to any peer yet.
            PrefillInput::PeerDead { .. } => Step::Live(PrefillRequest::Held(self)),
            PrefillInput::WriteCompleted | PrefillInput::WriteFailed { .. } => {
                fx.drop_input(DropReason::UnknownWrite);
                Step::Live(PrefillRequest::Held(self))
            }
        }
    }
}

#[cfg(test)]
mod tests;
