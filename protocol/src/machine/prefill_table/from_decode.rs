//! What P's table does with D's messages: registrations, cancels, releases and heartbeats.

use super::*;

impl PrefillTable {
    /// D's registration arrived. (`Into`: table tests name a bare address.)
    pub(crate) fn on_register(
        &mut self,
        now: Time,
        from: impl Into<Sender>,
        register: Box<Register>,
        fx: &mut Outbox,
    ) {
        let from = from.into();
        self.expire_pending_before_use(now, fx);
        if register.decode_engine != from.addr.engine || register.decode_rank != from.addr.rank {
            // A registration must come from the rank whose blocks it names.
            fx.drop_input(DropReason::Unexpected);
            return;
        }
        let key = register.key.clone();
        if !self.admit_run(now, &key, &from, true, fx) {
            return;
        }
        let request = self.requests.get(&key);
        if request.is_some()
            && !self.mutation.is(Mutation::SkipEpochFloor)
            && self
                .epoch_floor(&key)
                .is_some_and(|floor| register.epoch <= floor)
        {
            // A registration for an attempt an older request of this key already served or
            // gave up, overtaken on the way: it must not reach the new request's blocks.
            fx.drop_input(DropReason::Late);
            return;
        }
        if let Some(bound) = request.and_then(PrefillRequest::bound_epoch) {
            if register.epoch > bound {
                // The blocks serve one attempt; a newer one cannot have them. Answered here,
                // not by the request, so that the answer raises the key's floor.
                fx.drop_input(DropReason::FutureEpoch);
                let failure = WriteFailure::Unavailable;
                self.answer_unbound(now, &from, &key, register.epoch, failure, fx);
                return;
            }
        }
        if let Some(request) = request {
            match request {
                // Only a first registration meeting held blocks is the race; a repeat is not.
                PrefillRequest::Held(_) => fx.counters.prefill_finished_first += 1,
                PrefillRequest::Writing(_) | PrefillRequest::Draining(_) => {}
            }
            self.step_registered(now, &key, from, register, fx);
            return;
        }
        match self.tombstone(&key) {
            Some(PrefillTombstone::GaveUpEarly { epoch, .. }) if register.epoch <= epoch => {
                // D already gave up on this attempt; this registration was overtaken.
                fx.drop_input(DropReason::Late);
                self.refresh(now, &key);
                return;
            }
            Some(PrefillTombstone::Ended {
                epoch,
                replay,
                newer,
            }) => {
                let same_attempt = epoch.is_some_and(|bound| register.epoch <= bound);
                if !same_attempt && !self.tombstone_room(now) {
                    // The answer would raise the floor, which makes the record young again;
                    // without room for that, no answer (D repeats, or gives up at its deadline).
                    fx.drop_input(DropReason::TableFull);
                    return;
                }
                // P holds nothing for the key: the raised floor is written on D's behalf.
                if !same_attempt && !self.peer_budget_allows(now, &from.addr, fx) {
                    return;
                }
                let answer = if same_attempt { replay } else { Some(newer) };
                fx.drop_input(if same_attempt && epoch == Some(register.epoch) {
                    DropReason::Duplicate
                } else {
                    DropReason::Late
                });
                if let Some(failure) = answer {
                    fx.send(
                        &from.addr,
                        write_failed(&key, register.epoch, self.rank, failure),
                    );
                }
                if !same_attempt {
                    // Every epoch P answers raises the floor, so that a copy of this
                    // registration can never reach blocks a later request of the key holds.
                    let raised = PrefillTombstone::Ended {
                        epoch: Some(register.epoch),
                        replay,
                        newer,
                    };
                    self.remember(now, key, raised, Some(from.run));
                    self.charge_peer(now, &from.addr);
                } else {
                    self.refresh(now, &key);
                }
                return;
            }
            Some(PrefillTombstone::Answered { epoch, replay }) if register.epoch <= epoch => {
                fx.drop_input(if register.epoch == epoch {
                    DropReason::Duplicate
                } else {
                    DropReason::Late
                });
                fx.send(
                    &from.addr,
                    write_failed(&key, register.epoch, self.rank, replay),
                );
                self.refresh(now, &key);
                return;
            }
            Some(PrefillTombstone::GaveUpEarly { .. } | PrefillTombstone::Answered { .. })
            | None => {}
        }
        if let Some(existing) = self.pending.get(&key) {
            if register.epoch <= existing.register.epoch {
                fx.drop_input(if register.epoch == existing.register.epoch {
                    DropReason::Duplicate
                } else {
                    DropReason::StaleEpoch
                });
                return;
            }
        } else if !self.tombstone_room(now) {
            // No room to remember an answer, nor to admit the registration: left unanswered
            // (D repeats it, or gives up at its deadline).
            fx.drop_input(DropReason::TableFull);
            return;
        } else if self.pending.len() >= self.config.max_pending_registrations {
            // The answer's record is written on D's behalf for a key P holds nothing for.
            let records = self.floor_below(&key, register.epoch);
            if records && !self.peer_budget_allows(now, &from.addr, fx) {
                return;
            }
            fx.drop_input(DropReason::TableFull);
            let failure = WriteFailure::Unavailable;
            if self.answer_unbound(now, &from, &key, register.epoch, failure, fx) {
                self.charge_peer(now, &from.addr);
            }
            return;
        }
        let expires = now + self.config.registration_ttl;
        self.pending_timers.set(key.clone(), expires);
        self.pending.insert(
            key,
            PendingRegistration {
                from,
                register,
                expires,
            },
        );
    }

    /// D cancelled an attempt. Answered in every state (unless there is no room or budget
    /// for the record the answer needs, or the cancel may be a replaced run's).
    pub(crate) fn on_cancel(
        &mut self,
        now: Time,
        from: impl Into<Sender>,
        key: PairingKey,
        epoch: Epoch,
        fx: &mut Outbox,
    ) {
        let from = from.into();
        self.expire_pending_before_use(now, fx);
        if !self.may_settle(&key, &from.addr) {
            // Only the D that registered the key may cancel it: another peer's cancel would
            // free blocks, or stop a write, that a different request waits for.
            fx.drop_input(DropReason::Unexpected);
            return;
        }
        if !self.admit_run(now, &key, &from, false, fx) {
            return;
        }
        if self.settled_before(&key, epoch) {
            // A cancel of an attempt an older request of the key settled (a late copy): the
            // live request serves a newer attempt and must not end. Nothing of that epoch is in
            // flight here, so it is still acknowledged.
            fx.counters.stale_settles_ignored += 1;
            fx.drop_input(DropReason::StaleEpoch);
            fx.send(&from.addr, cancel_ack_message(&key, epoch, self.rank));
            return;
        }
        if self.requests.contains_key(&key) {
            let input = PrefillInput::Cancel {
                from: from.addr.clone(),
                epoch,
            };
            self.step(now, &key, input, fx);
            // Whatever the request did with it, the cancelled epoch is settled for the key.
            self.raise_floor(now, &key, epoch, from.run);
            return;
        }
        let holds_nothing = !self.pending.contains_key(&key);
        if holds_nothing && !self.tombstone_room(now) {
            // Acknowledging needs a tombstone record (the floor that swallows the registration
            // this cancel may have overtaken: a new record, or an old one made young again),
            // and none can be made without evicting a young one: no answer; D frees at its
            // quarantine.
            fx.drop_input(DropReason::TableFull);
            return;
        }
        let records = self.floor_below(&key, epoch);
        if holds_nothing && records && !self.peer_budget_allows(now, &from.addr, fx) {
            // Nor on the peer's budget: no answer, as above.
            return;
        }
        if self
            .pending
            .get(&key)
            .is_some_and(|p| p.register.epoch <= epoch)
        {
            self.take_pending(&key);
        }
        // Nothing of this epoch is or will be in flight: remember the cancel so that a
        // registration it overtook is swallowed, and acknowledge.
        if self.raise_floor(now, &key, epoch, from.run) && holds_nothing {
            self.charge_peer(now, &from.addr);
        }
        fx.send(&from.addr, cancel_ack_message(&key, epoch, self.rank));
    }

    /// Whether a cancel or release for `epoch` of `key` is about an attempt that an older
    /// request of the key already settled, while a newer request of the key holds blocks that
    /// no attempt claimed yet. (A request bound to an attempt tells epochs apart itself.)
    fn settled_before(&self, key: &PairingKey, epoch: Epoch) -> bool {
        let unbound = self
            .requests
            .get(key)
            .is_some_and(|r| r.bound_epoch().is_none());
        unbound && self.epoch_floor(key).is_some_and(|floor| epoch <= floor)
    }

    /// D does not need P's blocks for `key`.
    pub(crate) fn on_release(
        &mut self,
        now: Time,
        from: impl Into<Sender>,
        key: PairingKey,
        epoch: Epoch,
        reason: ReleaseReason,
        fx: &mut Outbox,
    ) {
        let from = from.into();
        self.expire_pending_before_use(now, fx);
        if !self.may_settle(&key, &from.addr) {
            fx.drop_input(DropReason::Unexpected);
            return;
        }
        if !self.admit_run(now, &key, &from, false, fx) {
            return;
        }
        if self.settled_before(&key, epoch) {
            // As for a cancel: an older attempt's release must not end a newer request.
            fx.counters.stale_settles_ignored += 1;
            fx.drop_input(DropReason::StaleEpoch);
            return;
        }
        if self.requests.contains_key(&key) {
            self.step(now, &key, PrefillInput::Release { epoch, reason }, fx);
            return;
        }
        if self.tombstone(&key).is_some() {
            fx.drop_input(DropReason::Late);
            return;
        }
        let holds_nothing = !self.pending.contains_key(&key);
        if holds_nothing && !self.tombstone_room(now) {
            // No room for the record: the blocks, when they finish, wait for their lease.
            fx.drop_input(DropReason::TableFull);
            return;
        }
        if holds_nothing && !self.peer_budget_allows(now, &from.addr, fx) {
            // Nor on the peer's budget: the blocks wait for their lease, as above.
            return;
        }
        // P has not finished yet: remember, so its blocks are released as soon as they finish.
        let gave_up = PrefillTombstone::GaveUpEarly {
            epoch,
            cause: ReleaseCause::ReleasedByPeer(reason),
        };
        self.remember(now, key, gave_up, Some(from.run));
        if holds_nothing {
            self.charge_peer(now, &from.addr);
        }
    }

    /// D renews leases. A pending registration is renewed only by the rank that sent it, for
    /// its own epoch: another D's heartbeat (a second D with the same key, or a retry's newer
    /// epoch) must not keep alive a registration whose D may have freed its blocks.
    pub(crate) fn on_heartbeat(
        &mut self,
        now: Time,
        from: &PeerAddr,
        leases: Vec<LeaseRef>,
        fx: &mut Outbox,
    ) {
        self.expire_pending_before_use(now, fx);
        let any_sender = self.mutation.is(Mutation::IgnoreHeartbeatSender);
        for lease in leases {
            if self.requests.contains_key(&lease.key) {
                self.step(now, &lease.key, PrefillInput::Heartbeat, fx);
            } else if let Some(pending) = self.pending.get_mut(&lease.key) {
                let own = &pending.from.addr == from && pending.register.epoch == lease.epoch;
                if !own && !any_sender {
                    fx.drop_input(DropReason::Unexpected);
                    continue;
                }
                pending.expires = pending.expires.max(now + self.config.registration_ttl);
                self.pending_timers.set(lease.key, pending.expires);
                fx.counters.leases_renewed += 1;
            }
        }
    }
}
