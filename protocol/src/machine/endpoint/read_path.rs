//! The endpoint's read path (pull, and the later turns of bidirectional conversations): engine
//! calls that export or import blocks, routing of asks, grants, refusals and releases, read
//! completions, and what the peers' fates mean for imports.

use crate::{Epoch, LeaseRef, Message, PairingKey, ReadRefused, ReleaseReason};

use super::Endpoint;
use crate::machine::export::{ExportCtx, ExportEnded, ExportInput};
use crate::machine::import::{release_message, ImportCommon, ImportEnded, ImportInput};
use crate::machine::peer::{Peer, PeerInput};
use crate::machine::read_tables::ImportStepAt;
use crate::machine::read_types::{
    ExportEnd, ExportOutcome, ExportStart, ImportOutcome, ImportStart, ReadProof,
};
use crate::machine::types::{DropReason, EndpointEvent, Output, Rejected, Time};
use crate::machine::Mutation;
use crate::{PeerAddr, WriteId};

impl Endpoint {
    pub(super) fn export_call(&mut self, now: Time, start: ExportStart) -> Result<(), Rejected> {
        let elsewhere = self.request_live_elsewhere(&start.request);
        let Some(empty) = self.exports.admit(now, start, elsewhere, &self.config)? else {
            return Ok(());
        };
        self.outbox
            .out
            .push_back(Output::Event(EndpointEvent::Export {
                request: empty.request,
                key: empty.key,
                outcome: ExportOutcome::Released(ExportEnd::Empty),
                proof: ReadProof::NeverGranted,
                blocks: empty.blocks,
            }));
        Ok(())
    }

    pub(super) fn import_call(&mut self, now: Time, start: ImportStart) -> Result<(), Rejected> {
        let elsewhere = self.request_live_elsewhere(&start.request);
        let start = self
            .imports
            .admit(now, start, elsewhere, &self.own.engine, &self.config)?;
        if start.blocks.is_empty() {
            // The engine holds every token: the holder may let go now.
            let release = release_message(&start.key, start.epoch, ReleaseReason::FullPrefixHit);
            self.send_or_queue(now, &start.holder, release);
            self.imports
                .remember(now, start.key.clone(), start.epoch, &self.config);
            self.outbox
                .out
                .push_back(Output::Event(EndpointEvent::Import {
                    request: start.request,
                    key: start.key,
                    epoch: start.epoch,
                    outcome: ImportOutcome::Loaded,
                    blocks: start.blocks,
                }));
            return Ok(());
        }
        if let Some(expires) = start.expires {
            if now + crate::machine::read_span(&self.config) > expires {
                return self.decline_near_expiry(now, start);
            }
        }
        let key = start.key.clone();
        let holder = start.holder.clone();
        let common = ImportCommon::from_start(
            start,
            now + self.config.decode_deadline,
            self.traces.next_id(),
        );
        tracing::debug!(key = %key, epoch = %common.epoch, trace_id = %common.trace, holder = %holder,
            "import allocated");
        self.imports.insert(common, &self.config);
        if self.peers.get(&holder).is_some_and(Peer::is_connected) {
            self.step_import(now, &key, ImportInput::PeerConnected);
        } else {
            self.peer_input(now, &holder, PeerInput::ConnectRequested);
        }
        Ok(())
    }

    /// A read starting now could outlive the export: decline before asking, and let the holder
    /// go at once.
    fn decline_near_expiry(&mut self, now: Time, start: ImportStart) -> Result<(), Rejected> {
        self.outbox.counters.reads_declined_near_expiry += 1;
        let release = release_message(&start.key, start.epoch, ReleaseReason::Declined);
        self.send_or_queue(now, &start.holder, release);
        self.imports
            .remember(now, start.key.clone(), start.epoch, &self.config);
        let common = ImportCommon::from_start(start, now, self.traces.next_id());
        let failure = crate::machine::read_types::ImportFailure::DeclinedNearExpiry;
        let outcome = common.outcome_of(failure, 0);
        self.import_event(common, outcome);
        Ok(())
    }

    pub(super) fn decline_export(
        &mut self,
        now: Time,
        key: PairingKey,
        epoch: Epoch,
        holder: PeerAddr,
    ) -> Result<(), Rejected> {
        if !epoch.is_valid() {
            return Err(Rejected::EpochOutOfRange(epoch));
        }
        if holder.engine == self.own.engine {
            return Err(Rejected::Invalid("the holder is this engine"));
        }
        // A sibling request with the same transfer parameters (or the engine reacting to an
        // error) declines an export this rank is reading: the holder would end the export and
        // reuse the blocks while our reads still land from them. Whatever the epochs, the
        // import's own release lets the holder go once no read of it is in flight.
        if self.is_reading(&key, &holder) && !self.mutation.is(Mutation::DeclineDuringRead) {
            self.outbox.counters.declines_refused_while_reading += 1;
            return Err(Rejected::ImportInProgress(key));
        }
        let release = release_message(&key, epoch, ReleaseReason::Declined);
        self.send_or_queue(now, &holder, release);
        Ok(())
    }

    /// Whether `request` is live in any table of this endpoint.
    pub(super) fn request_live_elsewhere(&self, request: &crate::RequestId) -> bool {
        self.prefills.has_request(request)
            || self.decodes.key_of(request).is_some()
            || self.exports.has_request(request)
            || self.imports.has_request(request)
    }

    pub(super) fn step_export(&mut self, now: Time, key: &PairingKey, input: ExportInput) {
        let ctx = ExportCtx {
            now,
            own: &self.own,
            config: &self.config,
            mutation: self.mutation,
        };
        if let Some(ended) = self.exports.step(&ctx, key, input, &mut self.outbox) {
            let ExportEnded {
                common,
                outcome,
                proof,
            } = ended;
            self.outbox
                .out
                .push_back(Output::Event(EndpointEvent::Export {
                    request: common.request,
                    key: common.key,
                    outcome,
                    proof,
                    blocks: common.blocks,
                }));
        }
    }

    pub(super) fn step_import(&mut self, now: Time, key: &PairingKey, input: ImportInput) {
        let at = ImportStepAt {
            now,
            own: &self.own,
            config: &self.config,
            mutation: self.mutation,
        };
        let ended = self.imports.step(at, key, input, &mut self.outbox);
        let Some(ImportEnded {
            common,
            outcome,
            release,
            ..
        }) = ended
        else {
            return;
        };
        if let Some(reason) = release {
            // Only to a holder we can reach now: one we cannot is dead or unknown, and its
            // grant's fence frees its blocks.
            if self
                .peers
                .get(&common.holder)
                .is_some_and(Peer::is_connected)
            {
                let message = release_message(&common.key, common.epoch, reason);
                self.outbox.send(&common.holder, message);
            }
        }
        self.import_event(common, outcome);
    }

    /// Tells the engine an import ended, handing its blocks back.
    fn import_event(&mut self, common: ImportCommon, outcome: ImportOutcome) {
        self.outbox
            .out
            .push_back(Output::Event(EndpointEvent::Import {
                request: common.request,
                key: common.key,
                epoch: common.epoch,
                outcome,
                blocks: common.blocks,
            }));
    }

    /// A read's end, from the transport.
    pub(super) fn read_result(&mut self, now: Time, read: WriteId, failed: bool) {
        let Some(key) = self.imports.key_of_read(read).cloned() else {
            self.outbox.counters.drop(DropReason::UnknownWrite);
            return;
        };
        let input = if failed {
            ImportInput::ReadFailed { read }
        } else {
            ImportInput::ReadDone { read }
        };
        self.step_import(now, &key, input);
    }

    /// A message of the read path from a connected peer.
    pub(super) fn received_read_path(&mut self, now: Time, from: PeerAddr, message: Message) {
        match message {
            Message::ReadAsk(ask) => {
                if self.exports.contains(&ask.key) {
                    let input = ExportInput::Ask {
                        from,
                        epoch: ask.epoch,
                        ask: ask.ask,
                        trace: ask.trace_id,
                    };
                    self.step_export(now, &ask.key, input);
                } else {
                    let reason = self.exports.refusal_for(&ask.key);
                    let refusal = Message::ReadRefused(ReadRefused {
                        key: ask.key,
                        epoch: ask.epoch,
                        holder_rank: self.own.rank,
                        reason,
                    });
                    self.outbox.send(&from, refusal);
                }
            }
            Message::ReadGrant(grant) => {
                let (key, epoch) = (grant.key.clone(), grant.epoch);
                let input = ImportInput::Grant {
                    blocks: grant.blocks,
                    ask: grant.ask,
                    memory: grant.memory,
                };
                if !self.route_to_import(now, &from, &key, epoch, input) {
                    // Not for a live attempt (late, duplicated, or ours ended): nothing was or
                    // will be read under it, so the holder may let go of it.
                    let release = release_message(&key, epoch, ReleaseReason::Declined);
                    self.outbox.send(&from, release);
                }
            }
            Message::ReadRefused(refused) => {
                let input = ImportInput::Refused {
                    reason: refused.reason,
                };
                self.route_to_import(now, &from, &refused.key, refused.epoch, input);
            }
            Message::Release(release) if self.exports.contains(&release.key) => {
                let input = ExportInput::Release {
                    from,
                    epoch: release.epoch,
                    reason: release.reason,
                };
                self.step_export(now, &release.key, input);
            }
            other => unreachable!("not a read-path message: {other:?}"),
        }
    }

    /// Delivers a holder's message to the live import of `key` if it is for its epoch and from
    /// its holder; false (and counted) otherwise.
    fn route_to_import(
        &mut self,
        now: Time,
        from: &PeerAddr,
        key: &PairingKey,
        epoch: Epoch,
        input: ImportInput,
    ) -> bool {
        let Some(import) = self.imports.get(key) else {
            self.outbox.counters.drop(DropReason::UnknownKey);
            return false;
        };
        let common = import.common();
        if &common.holder != from {
            self.outbox.counters.drop(DropReason::Unexpected);
            return false;
        }
        if epoch != common.epoch {
            let reason = if epoch < common.epoch {
                DropReason::StaleEpoch
            } else {
                DropReason::FutureEpoch
            };
            self.outbox.counters.drop(reason);
            return false;
        }
        self.step_import(now, key, input);
        true
    }

    /// Splits a heartbeat's leases: exports this rank holds are renewed here; the rest are P's
    /// pending registrations (push).
    pub(super) fn renew_exports(
        &mut self,
        now: Time,
        from: &PeerAddr,
        leases: Vec<LeaseRef>,
    ) -> Vec<LeaseRef> {
        let (exports, rest): (Vec<LeaseRef>, Vec<LeaseRef>) = leases
            .into_iter()
            .partition(|lease| self.exports.contains(&lease.key));
        for lease in exports {
            let input = ExportInput::Renew { from: from.clone() };
            self.step_export(now, &lease.key, input);
        }
        rest
    }

    /// Imports waiting on `peer` for a grant, as heartbeat leases (the export's lease is kept
    /// while they wait).
    pub(super) fn import_leases(&self, peer: &PeerAddr) -> Vec<LeaseRef> {
        self.imports
            .iter()
            .filter(|(_, i)| &i.common().holder == peer && i.waits_for_grant())
            .map(|(key, i)| LeaseRef {
                key: key.clone(),
                epoch: i.common().epoch,
            })
            .collect()
    }

    pub(super) fn imports_bound_to(&self, peer: &PeerAddr) -> Vec<PairingKey> {
        self.imports
            .iter()
            .filter(|(_, i)| &i.common().holder == peer)
            .map(|(k, _)| k.clone())
            .collect()
    }

    pub(super) fn imports_peer_input(&mut self, now: Time, peer: &PeerAddr, input: ImportInput) {
        for key in self.imports_bound_to(peer) {
            let waiting = self.imports.get(&key).is_some_and(|i| i.waits_for_grant());
            let applies = match input {
                ImportInput::PeerConnected | ImportInput::PeerConnectFailed => waiting,
                _ => true,
            };
            if applies {
                self.step_import(now, &key, input.clone());
            }
        }
    }
}
