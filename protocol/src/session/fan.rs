//! Multi-rank requests: when the two engines' geometries differ, one engine request on this
//! rank becomes one 1:1 sub-request per (P rank → D rank) pair it takes part in, each under its
//! pair's key ([`PairingKey::for_pair`]), and a [`FanIn`] folds their events back into the one
//! event the engine expects.
//!
//! - D side (`kvhandoff::KvConnector::request_allocated` with [`RankLinks`] set): this rank registers its
//!   blocks with every P rank that writes to it; the request is `BlocksReady` only when every
//!   pair's write landed. After a failure the live siblings are aborted at once (each cancels
//!   at its own P rank), and the engine gets `Failed` only when every pair handed the blocks
//!   back, with the most cautious proof among them. If a pair is fenced by its P rank's death
//!   first, the engine gets one `DecodeFenced` for the request then (the blocks still held),
//!   with the reason its `Failed` will repeat.
//! - P side (`kvhandoff::KvConnector::request_finished`): one held request per D rank this rank writes;
//!   `BlocksFree` once every pair let the blocks go. A P rank that writes to no D rank (a
//!   replica under GQA replication) gets `BlocksFree` at once.
//!
//! Pull (`fan_reads`) splits the same way into imports and exports. Bidirectional turns and
//! layer-wise push with links set are refused as unsupported.

use std::collections::BTreeMap;

use crate::hetero::SideName;
use crate::machine::{
    DecodeFailure, DecodeStart, EndpointCall, EndpointEvent, ExportEnd, ExportOutcome, FanIn,
    FanInStep, FanOutcome, FanSide, FreeProof, ImportFailure, ImportOutcome, LoadFailurePolicy,
    Mutation, PrefillStart, ReadProof, Rejected, ReleaseCause, SubFailure, SubRequest, Time,
};
use crate::{BlockIds, PairingKey, PeerAddr, RequestId};

use super::params::{epoch, pairing_key};
use super::{ConnectorError, ConnectorEvent, KvTransferParams, Session, SessionOutput};
use crate::TransferMode;

mod rank_links;

pub use rank_links::RankLinks;

/// One multi-rank request in progress on this rank.
#[derive(Debug)]
struct Fan {
    fan: FanIn,
    /// The most cautious proof among the sub-requests handed back so far (D).
    proof: FreeProof,
    /// The same for a holder's exports.
    read_proof: ReadProof,
    /// A reader's load-failure policy when the request started: a single import keeps the
    /// one it started with (`ImportStart::policy`), and so does a multi-rank read, whatever
    /// the settings say by the time its last part ends.
    policy: LoadFailurePolicy,
}

/// Most multi-rank requests one session tracks at once (the endpoint's default request table
/// holds as many).
pub const MAX_FANS: usize = 1 << 16;

/// The fan-in bookkeeping of a session.
#[derive(Debug)]
pub(super) struct Fans {
    /// By the engine's request id.
    fans: BTreeMap<RequestId, Fan>,
    /// Sub-request id → the engine's request id.
    parents: BTreeMap<RequestId, RequestId>,
    /// Bound of `fans` ([`MAX_FANS`] unless a test lowers it).
    pub(super) limit: usize,
}

impl Default for Fans {
    fn default() -> Self {
        Fans {
            fans: BTreeMap::new(),
            parents: BTreeMap::new(),
            limit: MAX_FANS,
        }
    }
}

impl Fans {
    /// Whether `request` is a multi-rank request in progress.
    pub(super) fn is_fan(&self, request: &RequestId) -> bool {
        self.fans.contains_key(request)
    }

    /// Multi-rank requests in progress.
    pub(super) fn len(&self) -> usize {
        self.fans.len()
    }

    /// Refuses a new multi-rank request when the table is at the bound.
    fn check_room(&self) -> Result<(), ConnectorError> {
        if self.fans.len() >= self.limit {
            return Err(ConnectorError::Rejected(Rejected::TableFull {
                table: "multi-rank requests",
                limit: self.limit,
            }));
        }
        Ok(())
    }
}

/// The engine's id of `request`'s sub-request for the pair (P rank `p` → D rank `d`): what the
/// endpoint, its counters and its traces call it.
///
/// # Errors
/// [`ConnectorError::InvalidParam`] when the id would be too long.
pub fn sub_request_id(request: &RequestId, p: u32, d: u32) -> Result<RequestId, ConnectorError> {
    RequestId::new(format!("{request}#p{p}d{d}"))
        .map_err(|e| ConnectorError::invalid("request id", e))
}

impl Session {
    /// D's push request as one sub-request per P rank writing to this rank.
    pub(super) fn fan_allocated(
        &mut self,
        now: Time,
        links: &RankLinks,
        request: &RequestId,
        blocks: BlockIds,
        num_tokens: u64,
        params: &KvTransferParams,
    ) -> Result<(), ConnectorError> {
        if links.side != SideName::Decode {
            return Err(ConnectorError::Unsupported(
                "request_allocated on a rank linked as P",
            ));
        }
        if params.transfer_mode()? == TransferMode::Pull {
            return self.fan_imported(now, links, request, blocks, num_tokens, params);
        }
        self.context().check_remote_prefill(params)?;
        links.check_remote_tp(params)?;
        let engine = super::prepare::remote_engine(params)?;
        // Each P rank listens at its own address (the engine's base port + its rank): every
        // sub-request's handshake needs its own. Checked before anything starts, so a bad
        // port refuses the whole request (in process, there are none).
        let mut addresses = Vec::with_capacity(links.peers.len());
        for &p in &links.peers {
            addresses.extend(self.context().peer_address(&engine, params, p)?);
        }
        let key = pairing_key(request, params)?;
        let epoch = epoch(params)?;
        let d = links.rank;
        let mut subs = Vec::with_capacity(links.peers.len());
        let mut calls = Vec::with_capacity(links.peers.len());
        for &p in &links.peers {
            let sub = SubRequest {
                request: sub_request_id(request, p, d)?,
                key: pair_key(&key, p, d)?,
            };
            calls.push(EndpointCall::DecodeAllocated(DecodeStart {
                request: sub.request.clone(),
                key: sub.key.clone(),
                epoch,
                prefill: PeerAddr::new(engine.clone(), p),
                blocks: blocks.clone(),
                num_tokens,
                expected_writes: 1,
            }));
            subs.push(sub);
        }
        self.start_fan(now, FanSide::Decode, request, blocks, subs, calls)?;
        // As for a single request: only once the pairs started, ahead of their `Connect`s.
        self.ready
            .extend(addresses.into_iter().map(SessionOutput::PeerAddress));
        Ok(())
    }

    /// P's push request as one held sub-request per D rank this rank writes to.
    pub(super) fn fan_finished(
        &mut self,
        now: Time,
        links: &RankLinks,
        start: PrefillStart,
    ) -> Result<(), ConnectorError> {
        if links.side != SideName::Prefill {
            return Err(ConnectorError::Unsupported(
                "request_finished on a rank linked as D",
            ));
        }
        let PrefillStart {
            request,
            key,
            blocks,
        } = start;
        let p = links.rank;
        if links.peers.is_empty() {
            return self.replica_ended(request, blocks, false);
        }
        let mut subs = Vec::with_capacity(links.peers.len());
        let mut calls = Vec::with_capacity(links.peers.len());
        for &d in &links.peers {
            let sub = SubRequest {
                request: sub_request_id(&request, p, d)?,
                key: pair_key(&key, p, d)?,
            };
            calls.push(EndpointCall::PrefillFinished(PrefillStart {
                request: sub.request.clone(),
                key: sub.key.clone(),
                blocks: blocks.clone(),
            }));
            subs.push(sub);
        }
        self.start_fan(now, FanSide::Prefill, &request, blocks, subs, calls)
    }

    /// A P rank no D rank needs (a replica: its D ranks get every byte from other P ranks):
    /// the request ends at once, as sent (push) or as an export nobody needed to read (pull).
    pub(super) fn replica_ended(
        &mut self,
        request: RequestId,
        blocks: BlockIds,
        pull: bool,
    ) -> Result<(), ConnectorError> {
        if self.fans.is_fan(&request) {
            return Err(ConnectorError::Rejected(Rejected::DuplicateRequest(
                request,
            )));
        }
        let event = if pull {
            ConnectorEvent::ExportEnded {
                request,
                outcome: ExportOutcome::Released(ExportEnd::FullPrefixHit),
                proof: ReadProof::NeverGranted,
                blocks,
            }
        } else {
            ConnectorEvent::BlocksFree {
                request,
                released: None,
                blocks,
            }
        };
        self.ready.push_back(SessionOutput::Event(event));
        Ok(())
    }

    /// Starts the sub-requests in order. None accepted: the call is refused with the first
    /// refusal and the engine keeps its blocks. Some refused after others started: the fan-in
    /// counts them failed (the request cannot be `Ready`; the started ones are aborted) and
    /// the engine gets the request's one event when every started one handed the blocks back.
    pub(super) fn start_fan(
        &mut self,
        now: Time,
        side: FanSide,
        request: &RequestId,
        blocks: BlockIds,
        subs: Vec<SubRequest>,
        calls: Vec<EndpointCall>,
    ) -> Result<(), ConnectorError> {
        if self.fans.is_fan(request)
            || subs
                .iter()
                .any(|s| self.fans.parents.contains_key(&s.request))
        {
            return Err(ConnectorError::Rejected(Rejected::DuplicateRequest(
                request.clone(),
            )));
        }
        self.fans.check_room()?;
        let ids: Vec<RequestId> = subs.iter().map(|s| s.request.clone()).collect();
        let mut fan = FanIn::new(side, blocks, subs).map_err(|e| ConnectorError::InvalidParam {
            name: "links",
            why: e.to_string(),
        })?;
        #[cfg(feature = "mutations")]
        fan.set_mutation(self.mutation.0);
        let mut refused: Vec<(RequestId, Rejected)> = Vec::new();
        for (id, call) in ids.iter().zip(calls) {
            if let Err(rejected) = self.endpoint.handle_call(now, call) {
                tracing::debug!(%request, sub = %id, %rejected, "sub-request refused");
                refused.push((id.clone(), rejected));
            }
        }
        if refused.len() == ids.len() {
            // Nothing was exposed to any peer rank: the engine keeps its blocks.
            let first = refused.into_iter().next().map(|(_, rejected)| rejected);
            return Err(first.map_or(ConnectorError::Unavailable, ConnectorError::from));
        }
        let mut steps = Vec::with_capacity(refused.len());
        for (id, _) in &refused {
            match fan.not_started(id) {
                Ok(step) => steps.push(step),
                Err(error) => tracing::error!(%request, sub = %id, %error, "refusal out of place"),
            }
        }
        self.counters.subs_refused += refused.len() as u64;
        self.refused.clone_from(&refused);
        for id in &ids {
            self.fans.parents.insert(id.clone(), request.clone());
        }
        self.fans.fans.insert(
            request.clone(),
            Fan {
                fan,
                proof: FreeProof::NeverExposed,
                read_proof: ReadProof::NeverGranted,
                policy: self.settings.load_failure_policy,
            },
        );
        for step in steps {
            self.apply_step(now, request, step);
        }
        Ok(())
    }

    /// Feeds a sub-request's event to its fan; gives the event back when it is not a
    /// sub-request's (the caller turns it into the engine's event as usual).
    pub(super) fn fan_event(&mut self, event: EndpointEvent) -> Option<EndpointEvent> {
        let sub = match &event {
            EndpointEvent::Decode { request, .. }
            | EndpointEvent::DecodeFenced { request, .. }
            | EndpointEvent::Prefill { request, .. }
            | EndpointEvent::Export { request, .. }
            | EndpointEvent::Import { request, .. } => request,
        };
        let Some(parent) = self.fans.parents.get(sub).cloned() else {
            return Some(event);
        };
        let Some(fan) = self.fans.fans.get_mut(&parent) else {
            tracing::error!(request = %parent, %sub, "sub-request of no fan");
            return None;
        };
        if let EndpointEvent::Decode { proof, .. } = &event {
            fan.proof = if self.mutation.is(Mutation::FanProofOfLastPair) {
                *proof
            } else {
                fan.proof.max(*proof)
            };
        }
        if let EndpointEvent::Export { proof, .. } = &event {
            fan.read_proof = fan.read_proof.max(*proof);
        }
        match fan.fan.on_event(&event) {
            Ok(step) => self.apply_step(self.now, &parent, step),
            Err(error) => {
                tracing::error!(request = %parent, %sub, %error, "sub-request event out of place");
            }
        }
        None
    }

    /// Aborts what `step` names, tells the engine of a failure whose blocks stay fenced, and
    /// hands the request back to the engine when it says so.
    fn apply_step(&mut self, now: Time, parent: &RequestId, step: FanInStep) {
        for sub in &step.abort {
            // A refused abort means the sub-request ended meanwhile: its event is on its way.
            let abort = EndpointCall::Abort {
                request: sub.clone(),
            };
            match self.endpoint.handle_call(now, abort) {
                Ok(()) => self.counters.siblings_aborted += 1,
                Err(rejected) => {
                    tracing::debug!(request = %parent, %sub, %rejected, "sibling ended already");
                }
            }
        }
        if step.fenced {
            if let Some(fan) = self.fans.fans.get(parent) {
                let reason = decode_reason(fan.fan.outcome());
                self.ready
                    .push_back(SessionOutput::Event(ConnectorEvent::DecodeFenced {
                        request: parent.clone(),
                        reason,
                    }));
            }
        }
        let failed = matches!(step.outcome, Some(FanOutcome::Failed { .. }));
        let blocks = match step.hand_back {
            Some(blocks) => blocks,
            None if failed && self.mutation.is(Mutation::FanHandBackAtFailure) => {
                match self.fans.fans.get(parent) {
                    Some(fan) => fan.fan.blocks().clone(),
                    None => return,
                }
            }
            None => return,
        };
        self.hand_back_fan(parent, blocks);
    }

    /// The request's one final event: every sub-request handed the shared blocks back.
    fn hand_back_fan(&mut self, parent: &RequestId, blocks: BlockIds) {
        let Some(fan) = self.fans.fans.remove(parent) else {
            return;
        };
        for sub in fan.fan.subs() {
            self.fans.parents.remove(sub);
        }
        let request = parent.clone();
        let event = match (fan.fan.side(), fan.fan.outcome()) {
            (FanSide::Decode, Some(FanOutcome::Ready)) => {
                ConnectorEvent::BlocksReady { request, blocks }
            }
            (FanSide::Decode, failed) => ConnectorEvent::Failed {
                request,
                reason: decode_reason(failed),
                proof: fan.proof,
                blocks,
            },
            (FanSide::Prefill, outcome) => ConnectorEvent::BlocksFree {
                request,
                released: match outcome {
                    Some(FanOutcome::Ready) => None,
                    Some(FanOutcome::Failed {
                        failure: SubFailure::Prefill(cause),
                        ..
                    }) => Some(*cause),
                    _ => Some(ReleaseCause::Aborted),
                },
                blocks,
            },
            (FanSide::Reader, outcome) => ConnectorEvent::Imported {
                request,
                outcome: import_outcome(outcome, fan.policy),
                blocks,
            },
            (FanSide::Holder, outcome) => ConnectorEvent::ExportEnded {
                request,
                outcome: match outcome {
                    Some(FanOutcome::Ready) => ExportOutcome::Read,
                    Some(FanOutcome::Failed {
                        failure: SubFailure::Export(end),
                        ..
                    }) => ExportOutcome::Released(*end),
                    _ => ExportOutcome::Released(ExportEnd::Aborted),
                },
                proof: fan.read_proof,
                blocks,
            },
        };
        self.ready.push_back(SessionOutput::Event(event));
    }

    /// Aborts every live sub-request of the multi-rank request `request`.
    pub(super) fn abort_fan(
        &mut self,
        now: Time,
        request: &RequestId,
    ) -> Result<(), ConnectorError> {
        let Some(fan) = self.fans.fans.get_mut(request) else {
            return Err(ConnectorError::Rejected(Rejected::UnknownRequest(
                request.clone(),
            )));
        };
        for sub in fan.fan.abort_all() {
            if let Err(rejected) = self.endpoint.handle_call(
                now,
                EndpointCall::Abort {
                    request: sub.clone(),
                },
            ) {
                tracing::debug!(%request, %sub, %rejected, "sub-request ended already");
            }
        }
        Ok(())
    }
}

/// Why a failed D request failed, as its engine is told (early and at the end alike): the
/// first failed sub-request's reason, or `Aborted` for one that never started.
fn decode_reason(outcome: Option<&FanOutcome>) -> DecodeFailure {
    match outcome {
        Some(FanOutcome::Failed {
            failure: SubFailure::Decode(reason),
            ..
        }) => *reason,
        Some(FanOutcome::Failed {
            failure:
                SubFailure::Prefill(_)
                | SubFailure::Import(_)
                | SubFailure::Export(_)
                | SubFailure::NotStarted,
            ..
        })
        | Some(FanOutcome::Ready)
        | None => DecodeFailure::Aborted,
    }
}

/// What a multi-rank read brought: everything, or nothing usable. A sibling's bytes are no
/// prefix of the request (each holder rank sends other heads or layers), so a failure keeps
/// no token: `Recompute` from the start under that policy, `Failed` otherwise.
fn import_outcome(outcome: Option<&FanOutcome>, policy: LoadFailurePolicy) -> ImportOutcome {
    let failure = match outcome {
        Some(FanOutcome::Ready) => return ImportOutcome::Loaded,
        Some(FanOutcome::Failed {
            failure: SubFailure::Import(failure),
            ..
        }) => *failure,
        Some(FanOutcome::Failed {
            failure: SubFailure::Decode(_) | SubFailure::Prefill(_) | SubFailure::Export(_),
            ..
        })
        | Some(FanOutcome::Failed {
            failure: SubFailure::NotStarted,
            ..
        })
        | None => ImportFailure::Aborted,
    };
    match policy {
        LoadFailurePolicy::Fail => ImportOutcome::Failed(failure),
        LoadFailurePolicy::Recompute => ImportOutcome::Recompute {
            valid_tokens: 0,
            failure,
        },
    }
}

pub(super) fn pair_key(key: &PairingKey, p: u32, d: u32) -> Result<PairingKey, ConnectorError> {
    key.for_pair(p, d)
        .map_err(|e| ConnectorError::invalid("transfer_id", e))
}
