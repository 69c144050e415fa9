//! The endpoint's D side: admitting a request whose prefill runs on a remote P, a full prefix
//! hit, stepping D's requests, reporting the ended ones, and routing P's answers to them.

use crate::{Epoch, Message, PairingKey, Release, ReleaseReason};

use super::Endpoint;
use crate::machine::decode::{DecodeCommon, DecodeCtx, DecodeEnded, DecodeInput};
use crate::machine::peer::{Peer, PeerInput};
use crate::machine::types::{
    DecodeFailure, DecodeOutcome, DecodeStart, DropReason, EndpointEvent, FreeProof, Output,
    Rejected, Time,
};
use crate::machine::Mutation;
use crate::PeerAddr;

impl Endpoint {
    pub(super) fn decode_allocated(
        &mut self,
        now: Time,
        start: DecodeStart,
    ) -> Result<(), Rejected> {
        let on_prefill_side = self.prefills.has_request(&start.request)
            || self.exports.has_request(&start.request)
            || self.imports.has_request(&start.request);
        let start = self.decodes.admit(
            now,
            start,
            on_prefill_side,
            &self.own.engine,
            &self.config,
            self.mutation,
        )?;
        if start.blocks.is_empty() {
            return self.full_prefix_hit(now, start);
        }
        let key = start.key.clone();
        let peer = start.prefill.clone();
        let common = DecodeCommon::from_start(
            start,
            now + self.config.decode_deadline,
            self.traces.next_id(),
        );
        tracing::debug!(key = %key, epoch = %common.epoch, trace_id = %common.trace, peer = %peer,
            "decode request allocated");
        self.decodes.insert(common, &self.config);
        if self.peers.get(&peer).is_some_and(Peer::is_connected) {
            self.step_decode(now, &key, DecodeInput::PeerConnected);
        } else {
            self.peer_input(now, &peer, PeerInput::ConnectRequested);
        }
        Ok(())
    }

    /// D already holds every token: P may free its blocks, and D is ready at once.
    pub(super) fn full_prefix_hit(
        &mut self,
        now: Time,
        start: DecodeStart,
    ) -> Result<(), Rejected> {
        let release = Message::Release(Release {
            key: start.key.clone(),
            epoch: start.epoch,
            reason: ReleaseReason::FullPrefixHit,
        });
        self.send_or_queue(now, &start.prefill, release);
        self.decodes.remember(
            now,
            start.key.clone(),
            start.epoch,
            &self.config,
            self.mutation,
        );
        self.outbox
            .out
            .push_back(Output::Event(EndpointEvent::Decode {
                request: start.request,
                key: start.key,
                epoch: start.epoch,
                outcome: DecodeOutcome::Ready,
                proof: FreeProof::NeverExposed,
                blocks: start.blocks,
            }));
        Ok(())
    }

    pub(super) fn step_decode(&mut self, now: Time, key: &PairingKey, input: DecodeInput) {
        let ctx = DecodeCtx {
            now,
            own: &self.own,
            config: &self.config,
            mutation: self.mutation,
        };
        if let Some(ended) = self.decodes.step(&ctx, key, input, &mut self.outbox) {
            self.decode_ended(now, ended);
        }
    }

    /// Reports a D request that ended (the table has done its bookkeeping), first letting P
    /// free blocks it may hold for a request that never registered.
    pub(super) fn decode_ended(&mut self, now: Time, ended: DecodeEnded) {
        let DecodeEnded {
            common,
            outcome,
            proof,
            announced,
        } = ended;
        if let Some(failure) = announced {
            // The promise of `EndpointEvent::DecodeFenced`: the final event repeats its failure
            // (an engine that recomputed must never see the request `Ready` after all).
            assert_eq!(
                outcome,
                DecodeOutcome::Failed(failure),
                "a request told of early ends as it was told"
            );
        }
        let gave_up_before_registering = proof == FreeProof::NeverExposed
            && matches!(
                outcome,
                DecodeOutcome::Failed(
                    DecodeFailure::Aborted | DecodeFailure::Deadline | DecodeFailure::Shutdown
                )
            );
        if gave_up_before_registering {
            // P may hold blocks for this key already: let it free them now, not at lease end.
            let release = Message::Release(Release {
                key: common.key.clone(),
                epoch: common.epoch,
                reason: ReleaseReason::Aborted,
            });
            self.send_or_queue(now, &common.prefill, release);
        }
        self.outbox
            .out
            .push_back(Output::Event(EndpointEvent::Decode {
                request: common.request,
                key: common.key,
                epoch: common.epoch,
                outcome,
                proof,
                blocks: common.blocks,
            }));
    }

    /// Delivers a P→D message naming P rank `rank` to the live request of `key` if it is for
    /// its epoch and from one of its sources; counts why not otherwise.
    pub(super) fn route_to_decode(
        &mut self,
        now: Time,
        from: &PeerAddr,
        rank: u32,
        key: &PairingKey,
        epoch: Epoch,
        input: DecodeInput,
    ) {
        let Some(request) = self.decodes.get(key) else {
            let reason = if self.decodes.ended_recently(key) {
                DropReason::Late
            } else {
                DropReason::UnknownKey
            };
            self.outbox.counters.drop(reason);
            return;
        };
        let common = request.common();
        // Each source rank settles its own share, so the rank a message is counted for must be
        // the rank that sent it: a rank of the P engine (the one D registered with when it
        // expects one write; D holds only the count of several), speaking for itself.
        let source = if common.expected_writes > 1 {
            from.engine == common.prefill.engine
        } else {
            *from == common.prefill
        };
        let from_source =
            (source && from.rank == rank) || self.mutation.is(Mutation::TrustNamedRank);
        if common.prefill.engine != from.engine || !from_source {
            self.outbox.counters.drop(DropReason::Unexpected);
            return;
        }
        let stale_accepted = self.mutation.is(Mutation::AcceptStaleWriteDone)
            && matches!(input, DecodeInput::WriteDone { .. });
        if epoch < common.epoch && !stale_accepted {
            self.outbox.counters.drop(DropReason::StaleEpoch);
            return;
        }
        if epoch > common.epoch {
            self.outbox.counters.drop(DropReason::FutureEpoch);
            return;
        }
        self.step_decode(now, key, input);
    }
}

#[cfg(test)]
mod tests;
