//! `PrefillTable`: P's table for one rank. It matches D's registrations with P's finished blocks,
//! whichever arrives first, and hosts the `PrefillRequest` machines.
//!
//! Both races are ordinary:
//! - *D registers first*: the registration waits in `pending` (bounded, with a TTL renewed by
//!   D's heartbeats) until the prefill finishes;
//! - *P finishes first*: the request waits `Held` under its lease until the registration comes.
//!
//! Ended keys leave a tombstone so that a late registration is answered (or swallowed, if D
//! already cancelled it) instead of waiting forever.

mod budget;
mod from_decode;
mod runs;
mod tombstones;

use std::collections::BTreeMap;

use crate::{
    CancelAck, Epoch, Incarnation, LeaseRef, Message, PairingKey, Register, ReleaseReason,
    RequestId, WriteFailed, WriteFailure,
};

use super::effects::{Outbox, Step};
use super::prefill::{
    PrefillCommon, PrefillCtx, PrefillEnded, PrefillInput, PrefillRequest, Producing,
};
use super::shape::Machine;
use super::tables::{Machines, TimerIndex, Tombstones};
use super::types::{
    DropReason, LayerPlan, PrefillOutcome, PrefillStart, Rejected, ReleaseCause, Time,
};
use super::{ActiveMutation, Config, Mutation};
use crate::{PeerAddr, WriteId};

use budget::PeerBudget;
use runs::Runs;
pub(crate) use runs::Sender;
pub(crate) use tombstones::PrefillTombstone;
pub(crate) use tombstones::{assert_old_record_to_evict, young_cutoff};
use tombstones::{floor_of, Record};

/// A registration that arrived before its prefill finished.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PendingRegistration {
    pub(crate) from: Sender,
    pub(crate) register: Box<Register>,
    pub(crate) expires: Time,
}

/// P's matching table and request machines for one rank.
#[derive(Debug)]
pub(crate) struct PrefillTable {
    rank: u32,
    config: Config,
    requests: Machines<PairingKey, PrefillRequest>,
    by_request: BTreeMap<RequestId, PairingKey>,
    pending: BTreeMap<PairingKey, PendingRegistration>,
    writes: BTreeMap<WriteId, PairingKey>,
    pending_timers: TimerIndex<PairingKey>,
    tombstones: Tombstones<PairingKey, Record>,
    /// The D run each request bound to a registration serves (its record is written for it).
    bound: BTreeMap<PairingKey, Incarnation>,
    /// Records written on peers' behalf for keys P held nothing for.
    budget: PeerBudget,
    /// What P knows of D ranks' incarnations.
    runs: Runs,
    next_write: u64,
    mutation: ActiveMutation,
    /// Layer-wise requests that ended while their prefill still ran, with their layer count:
    /// the engine's later progress calls for them are taken and do nothing (until the last
    /// layer). Bounded by `max_requests`.
    ended_computing: BTreeMap<RequestId, u32>,
}

impl PrefillTable {
    pub(crate) fn new(rank: u32, config: &Config) -> Self {
        PrefillTable {
            rank,
            config: config.clone(),
            requests: Machines::default(),
            by_request: BTreeMap::new(),
            pending: BTreeMap::new(),
            writes: BTreeMap::new(),
            pending_timers: TimerIndex::default(),
            tombstones: Tombstones::new(config.max_tombstones),
            bound: BTreeMap::new(),
            budget: PeerBudget::new(config),
            runs: Runs::new(config),
            next_write: 1,
            ended_computing: BTreeMap::new(),
            mutation: ActiveMutation::default(),
        }
    }

    #[cfg(feature = "mutations")]
    pub(crate) fn set_mutation(&mut self, mutation: ActiveMutation) {
        self.mutation = mutation;
    }

    /// Tombstones evicted at capacity so far.
    pub(crate) fn tombstones_evicted(&self) -> u64 {
        self.tombstones.evicted()
    }

    pub(crate) fn live_requests(&self) -> usize {
        self.requests.len()
    }

    pub(crate) fn pending_registrations(&self) -> usize {
        self.pending.len()
    }

    pub(crate) fn pending_of(&self, key: &PairingKey) -> Option<(&PeerAddr, Epoch, Time)> {
        self.pending
            .get(key)
            .map(|p| (&p.from.addr, p.register.epoch, p.expires))
    }

    pub(crate) fn writes_in_flight(&self) -> usize {
        self.writes.len()
    }

    pub(crate) fn tombstones(&self) -> usize {
        self.tombstones.len()
    }

    pub(crate) fn has_request(&self, request: &RequestId) -> bool {
        self.by_request.contains_key(request)
    }

    /// The engine ids of every live request, in order, borrowed.
    pub(crate) fn live_request_iter(&self) -> impl Iterator<Item = &RequestId> {
        self.by_request.keys()
    }

    /// The engine ids of every live request, in order, owned (for callers that then step them).
    pub(crate) fn live_request_ids(&self) -> Vec<RequestId> {
        self.live_request_iter().cloned().collect()
    }

    pub(crate) fn next_timer(&self) -> Option<Time> {
        [
            self.requests.next_timer(),
            self.pending_timers.next(),
            self.tombstones.next_expiry(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Runs one input through the request for `key` and files the result.
    fn step(&mut self, now: Time, key: &PairingKey, input: PrefillInput, fx: &mut Outbox) {
        let ctx = PrefillCtx {
            now,
            own_rank: self.rank,
            config: &self.config,
            next_write: WriteId(self.next_write),
            mutation: self.mutation,
        };
        let (mut before, mut after) = (None, None);
        let span = tracing::debug_span!(
            "prefill",
            key = %key,
            rank = ctx.own_rank,
            epoch = tracing::field::Empty,
            trace_id = tracing::field::Empty
        );
        // Entered over the filing too, so the request's end is recorded in its span.
        let _entered = span.enter();
        let transition = |request: PrefillRequest| {
            before = request.write();
            // A registration names the attempt it may bind; otherwise the one bound, if any.
            let (epoch, trace) = match &input {
                PrefillInput::Registered { register, .. } => {
                    (Some(register.epoch), Some(register.trace_id))
                }
                _ => (request.bound_epoch(), request.bound_trace()),
            };
            super::spans::record_attempt(&span, epoch, trace);
            match request.handle(&ctx, input, fx) {
                Step::Live(next) => {
                    after = next.write();
                    (Some(next), None)
                }
                Step::Ended(ended) => (None, Some(ended)),
            }
        };
        let Some(ended) = self.requests.step(key, &self.config, transition) else {
            return;
        };
        match ended {
            None if after != before => {
                assert_eq!(before, None, "a request posts at most one write");
                if let Some(write) = after {
                    assert_eq!(write, WriteId(self.next_write));
                    self.next_write += 1;
                    self.writes.insert(write, key.clone());
                }
            }
            None => {}
            Some(ended) => {
                if let Some(write) = before {
                    self.writes.remove(&write);
                }
                self.file_ended(now, ended, fx);
            }
        }
    }

    /// P's engine finished a prefill.
    pub(crate) fn finished(
        &mut self,
        now: Time,
        start: PrefillStart,
        fx: &mut Outbox,
    ) -> Result<(), Rejected> {
        self.admit(now, start, None, fx)
    }

    /// P's engine starts a layer-wise prefill.
    pub(crate) fn started(
        &mut self,
        now: Time,
        start: PrefillStart,
        plan: LayerPlan,
        fx: &mut Outbox,
    ) -> Result<(), Rejected> {
        if plan.layers == 0 || plan.layers > crate::MAX_WRITE_LAYERS {
            return Err(Rejected::Invalid(
                "layer-wise layers out of 1..=MAX_WRITE_LAYERS",
            ));
        }
        if !(1..=plan.layers).contains(&plan.part_layers) {
            return Err(Rejected::Invalid("layers per part out of 1..=layers"));
        }
        if self.ended_computing.contains_key(&start.request) {
            return Err(Rejected::DuplicateRequest(start.request));
        }
        self.admit(now, start, Some(Producing::start(plan)), fx)
    }

    /// P's engine produced layers `0 .. ready` of a layer-wise request.
    pub(crate) fn layers_ready(
        &mut self,
        now: Time,
        request: &RequestId,
        ready: u32,
        fx: &mut Outbox,
    ) -> Result<(), Rejected> {
        if let Some(key) = self.by_request.get(request).cloned() {
            let layer_wise = self
                .requests
                .get(&key)
                .is_some_and(|r| r.common().producing.is_some());
            if layer_wise {
                self.step(now, &key, PrefillInput::LayersReady { ready }, fx);
            } else {
                // A whole-request push, or a layer-wise one whose parts are all posted.
                fx.drop_input(DropReason::Duplicate);
            }
            return Ok(());
        }
        match self.ended_computing.get(request) {
            Some(&layers) => {
                if ready >= layers {
                    self.ended_computing.remove(request);
                }
                Ok(())
            }
            None => Err(Rejected::UnknownRequest(request.clone())),
        }
    }

    /// Admits a finished prefill (`producing` `None`) or a layer-wise one that starts.
    fn admit(
        &mut self,
        now: Time,
        start: PrefillStart,
        producing: Option<Producing>,
        fx: &mut Outbox,
    ) -> Result<(), Rejected> {
        self.expire_pending_before_use(now, fx);
        // A list past the wire limits could never be sent to D: refuse it here, typed.
        start.blocks.validate().map_err(Rejected::BlockList)?;
        if self.by_request.contains_key(&start.request) {
            return Err(Rejected::DuplicateRequest(start.request));
        }
        if self.requests.contains_key(&start.key) {
            return Err(Rejected::DuplicateKey(start.key));
        }
        if self.requests.len() >= self.config.max_requests {
            return Err(Rejected::TableFull {
                table: "prefill requests",
                limit: self.config.max_requests,
            });
        }
        if !self.tombstone_room(now) {
            // Every live request must be able to leave a tombstone without evicting a young
            // one (see `tombstone_room`): the engine retries once older records have aged.
            return Err(Rejected::TableFull {
                table: "prefill tombstones (young)",
                limit: self.config.max_tombstones,
            });
        }
        let common = PrefillCommon {
            request: start.request,
            key: start.key,
            blocks: start.blocks,
            producing,
        };
        // A registration for a newer attempt than the one D gave up on (`on_register` lets it
        // past the tombstone) still wants the blocks: it supersedes the tombstone.
        let pending_epoch = self.pending.get(&common.key).map(|p| p.register.epoch);
        let superseded = |epoch: Epoch| pending_epoch.is_some_and(|pending| pending > epoch);
        let record = self.tombstones.get(&common.key).copied();
        // A give-up of a run its rank's newer incarnation replaced says nothing of these blocks:
        // they may be a retry's, for the new run. They are held; the record stays their floor.
        let dead_run = self.runs.is_replaced(record.and_then(|r| r.run));
        let tombstone = record.map(|r| r.tombstone);
        let settled_by_peer = match tombstone {
            Some(PrefillTombstone::GaveUpEarly { epoch, cause })
                if !superseded(epoch) && !dead_run =>
            {
                Some((cause, epoch))
            }
            Some(
                PrefillTombstone::GaveUpEarly { .. }
                | PrefillTombstone::Answered { .. }
                | PrefillTombstone::Ended { .. },
            )
            | None => None,
        };
        if let Some((cause, epoch)) = settled_by_peer {
            // D gave up on (or never needed) this key before P finished: free at once. A
            // registration still pending is for an attempt D gave up on: nobody waits for it.
            if pending_epoch.is_some() {
                self.take_pending(&common.key);
            }
            self.file_ended(
                now,
                PrefillEnded {
                    common,
                    outcome: PrefillOutcome::Released(cause),
                    epoch: Some(epoch),
                },
                fx,
            );
            return Ok(());
        }
        // The tombstone of an older request for the key stays while this one lives if it has an
        // epoch: a floor below which registrations are overtaken ones (see `on_register`).
        if tombstone.is_some_and(|old| floor_of(&old).is_none()) {
            self.tombstones.remove(&common.key);
        }
        if common.blocks.is_empty() {
            let key = common.key.clone();
            self.file_ended(
                now,
                PrefillEnded {
                    common,
                    outcome: PrefillOutcome::Released(ReleaseCause::Empty),
                    epoch: None,
                },
                fx,
            );
            if let Some(pending) = pending_epoch.and_then(|_| self.take_pending(&key)) {
                let epoch = pending.register.epoch;
                let failure = WriteFailure::Unavailable;
                self.answer_unbound(now, &pending.from, &key, epoch, failure, fx);
            }
            return Ok(());
        }
        let key = common.key.clone();
        self.by_request.insert(common.request.clone(), key.clone());
        let request = PrefillRequest::held(common, now, &self.config);
        self.requests.insert(key.clone(), request, &self.config);
        // Only a registration seen above can be pending: nothing ran in between.
        if let Some(pending) = pending_epoch.and_then(|_| self.take_pending(&key)) {
            fx.counters.decode_registered_first += 1;
            self.step_registered(now, &key, pending.from, pending.register, fx);
        }
        Ok(())
    }

    /// Runs a registration of `from` through the request of `key`, noting the run its blocks
    /// are bound to if it binds them (their record is written for that run).
    fn step_registered(
        &mut self,
        now: Time,
        key: &PairingKey,
        from: Sender,
        register: Box<Register>,
        fx: &mut Outbox,
    ) {
        let binds = matches!(self.requests.get(key), Some(PrefillRequest::Held(_)));
        if binds {
            self.bound.insert(key.clone(), from.run);
        }
        let input = PrefillInput::Registered {
            from: from.addr,
            register,
        };
        self.step(now, key, input, fx);
        if binds
            && self
                .requests
                .get(key)
                .is_some_and(|r| r.bound_epoch().is_none())
        {
            self.bound.remove(key);
        }
    }

    fn take_pending(&mut self, key: &PairingKey) -> Option<PendingRegistration> {
        self.pending_timers.clear(key);
        self.pending.remove(key)
    }

    /// P's engine aborted a request.
    pub(crate) fn abort(
        &mut self,
        now: Time,
        request: &RequestId,
        fx: &mut Outbox,
    ) -> Result<(), Rejected> {
        let Some(key) = self.by_request.get(request).cloned() else {
            return Err(Rejected::UnknownRequest(request.clone()));
        };
        self.step(now, &key, PrefillInput::Abort, fx);
        Ok(())
    }

    /// The transport finished (or failed, or abandoned) a write.
    pub(crate) fn on_write_result(
        &mut self,
        now: Time,
        write: WriteId,
        failure: Option<WriteFailure>,
        fx: &mut Outbox,
    ) {
        let Some(key) = self.writes.get(&write).cloned() else {
            fx.drop_input(DropReason::UnknownWrite);
            return;
        };
        let input = match failure {
            None => PrefillInput::WriteCompleted,
            Some(failure) => PrefillInput::WriteFailed { failure },
        };
        self.step(now, &key, input, fx);
    }

    /// A D peer was declared dead (its connection is already invalidated).
    pub(crate) fn on_peer_dead(&mut self, now: Time, peer: &PeerAddr, fx: &mut Outbox) {
        let dropped: Vec<PairingKey> = self
            .pending
            .iter()
            .filter(|(_, p)| &p.from.addr == peer)
            .map(|(k, _)| k.clone())
            .collect();
        for key in dropped {
            if let Some(pending) = self.take_pending(&key) {
                // Nobody will claim these blocks: release them the moment they finish rather
                // than at the end of their lease.
                let gave_up = PrefillTombstone::GaveUpEarly {
                    epoch: pending.register.epoch,
                    cause: ReleaseCause::PeerDead,
                };
                self.remember(now, key, gave_up, Some(pending.from.run));
            }
        }
        let bound: Vec<PairingKey> = self.writes.values().cloned().collect();
        for key in bound {
            let input = PrefillInput::PeerDead { peer: peer.clone() };
            self.step(now, &key, input, fx);
        }
    }

    /// Fires every timer due at `now`.
    pub(crate) fn on_timeout(&mut self, now: Time, fx: &mut Outbox) {
        for key in self.requests.take_due(now) {
            self.step(now, &key, PrefillInput::Timeout, fx);
        }
        self.expire_pending(now, fx);
        self.tombstones.expire(now);
    }

    /// Answers every registration whose wait ended by `now`. Run before anything uses the
    /// pending table, not only on the timer: a shell that runs late (a stalled process, a busy
    /// loop) must not match a registration D may already have given up on — D's fence counts
    /// on it expiring `registration_ttl` after D's last renewal.
    fn expire_pending_before_use(&mut self, now: Time, fx: &mut Outbox) {
        if !self.mutation.is(Mutation::MatchExpiredRegistration) {
            self.expire_pending(now, fx);
        }
    }

    /// Answers every registration whose wait ended by `now` (the timer's half).
    fn expire_pending(&mut self, now: Time, fx: &mut Outbox) {
        for key in self.pending_timers.take_due(now) {
            if let Some(pending) = self.pending.remove(&key) {
                // Nothing was posted for it: D may fail fast.
                let epoch = pending.register.epoch;
                let failure = WriteFailure::RegistrationExpired;
                self.answer_unbound(now, &pending.from, &key, epoch, failure, fx);
            }
        }
    }

    /// Checks the table's invariants (cheap enough for every step in debug builds).
    pub(crate) fn check_invariants(&self) {
        let config = &self.config;
        assert!(self.requests.len() <= config.max_requests);
        assert!(self.pending.len() <= self.config.max_pending_registrations);
        assert!(self.tombstones.len() <= self.config.max_tombstones);
        assert_eq!(self.requests.len(), self.by_request.len());
        assert!(self.requests.all_armed(), "every P request has a timer");
        assert_eq!(self.pending.len(), self.pending_timers.len());
        for (key, request) in self.requests.iter() {
            assert_eq!(&request.common().key, key);
            assert_eq!(self.by_request.get(&request.common().request), Some(key));
            assert!(
                !self.pending.contains_key(key),
                "a key is matched or pending, not both"
            );
            assert_eq!(
                self.bound.contains_key(key),
                request.bound_epoch().is_some(),
                "a request bound to a registration knows its run"
            );
            if let Some(write) = request.write() {
                assert_eq!(self.writes.get(&write), Some(key));
            }
        }
        assert_eq!(
            self.writes.len(),
            self.requests
                .values()
                .filter(|r| r.write().is_some())
                .count()
        );
        assert!(self.bound.keys().all(|key| self.requests.contains_key(key)));
        self.budget.check_invariants();
        self.runs.check_invariants();
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

fn cancel_ack_message(key: &PairingKey, epoch: Epoch, prefill_rank: u32) -> Message {
    Message::CancelAck(CancelAck {
        key: key.clone(),
        epoch,
        prefill_rank,
    })
}

#[cfg(test)]
mod tests;
