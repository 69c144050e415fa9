//! Multi-rank pulls: a heterogeneous pair's read path. D's request becomes one import per P
//! rank it reads from, P's one export per D rank that reads from it, each under its pair's key,
//! and a [`FanIn`](crate::machine::FanIn) of side `Reader` or `Holder` folds their ends into
//! the one `Imported` or `ExportEnded` the engine expects.
//!
//! The parts are the machines' ordinary imports and exports, so the grant fence, epochs,
//! stale grants and late reads guard each pair as they guard a 1:1 read. What the fan adds is
//! the bookkeeping: the shared blocks go back when every part ended, and a failed part aborts
//! its live siblings (each releases its own holder at once instead of at its deadline).

use crate::hetero::SideName;
use crate::machine::{
    EndpointCall, ExportStart, FanSide, ImportStart, LoadFailurePolicy, Mutation, SubRequest, Time,
};
use crate::{BlockIds, PeerAddr, RequestId};

use super::fan::{pair_key, sub_request_id};
use super::params::{check_next_turn_mode, epoch, pairing_key};
use super::prepare::remote_engine;
use super::{
    ConnectorCall, ConnectorError, ConnectorReply, KvTransferParams, RankLinks, Session,
    SessionOutput,
};

impl Session {
    /// D's pull request as one import per P rank it reads from.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn fan_imported(
        &mut self,
        now: Time,
        links: &RankLinks,
        request: &RequestId,
        blocks: BlockIds,
        num_tokens: u64,
        params: &KvTransferParams,
    ) -> Result<(), ConnectorError> {
        self.context().check_remote_prefill(params)?;
        self.fan_read(now, links, request, blocks, num_tokens, params)
    }

    /// A conversation's turn calls on a linked rank, with the turn links (the pair planned the
    /// other way): D keeps its blocks as one export per P rank that reads them back; P's next
    /// turn reads them as one import per D rank it needs.
    pub(super) fn turn_call(
        &mut self,
        now: Time,
        call: ConnectorCall,
        links: &RankLinks,
    ) -> Result<ConnectorReply, ConnectorError> {
        match call {
            ConnectorCall::KeepForNextTurn {
                request,
                blocks,
                num_tokens,
                ttl,
                params,
            } => {
                let (input, reply) = self
                    .context()
                    .keep_input(now, request, blocks, num_tokens, ttl, &params)?;
                let EndpointCall::Export(start) = input else {
                    return Err(ConnectorError::Unsupported("a kept turn that is no export"));
                };
                self.fan_exported(now, links, start)
                    .map(|()| ConnectorReply::NextTurnParams(reply))
            }
            ConnectorCall::NextTurnAllocated {
                request,
                blocks,
                num_tokens,
                params,
            } => {
                check_next_turn_mode(&params)?;
                if links.side != SideName::Decode {
                    return Err(ConnectorError::Unsupported(
                        "next_turn_allocated on a rank whose turn links hold the blocks",
                    ));
                }
                let mut links = links.clone();
                if self.mutation.is(Mutation::ReadBackFromFirstRank) {
                    links.peers.truncate(1);
                }
                self.fan_read(now, &links, &request, blocks, num_tokens, &params)
                    .map(|()| ConnectorReply::Accepted)
            }
            ConnectorCall::RequestAllocated { .. }
            | ConnectorCall::RequestFinished { .. }
            | ConnectorCall::PrefillStarted { .. }
            | ConnectorCall::LayersReady { .. }
            | ConnectorCall::DeclineExport { .. }
            | ConnectorCall::Abort { .. }
            | ConnectorCall::Shutdown => Err(ConnectorError::Unsupported("not a turn call")),
        }
    }

    /// One import per rank in `links` (the reader's side of a multi-rank read).
    fn fan_read(
        &mut self,
        now: Time,
        links: &RankLinks,
        request: &RequestId,
        blocks: BlockIds,
        num_tokens: u64,
        params: &KvTransferParams,
    ) -> Result<(), ConnectorError> {
        links.check_remote_tp(params)?;
        let engine = remote_engine(params)?;
        let remote_blocks = remote_groups(params, &blocks)?;
        let block_tokens = self
            .settings
            .block_tokens
            .ok_or(ConnectorError::NotConfigured("block_tokens"))?;
        let expires = params
            .remote_blocks_expiry_time
            .and_then(|secs| self.context().local_time_of(&engine, secs));
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
            calls.push(EndpointCall::Import(ImportStart {
                request: sub.request.clone(),
                key: sub.key.clone(),
                epoch,
                holder: PeerAddr::new(engine.clone(), p),
                blocks: blocks.clone(),
                remote_blocks: remote_blocks.clone(),
                num_tokens,
                block_tokens,
                // A part's prefix is no prefix of the request: the fan applies the policy.
                policy: LoadFailurePolicy::Fail,
                expires,
            }));
            subs.push(sub);
        }
        self.start_fan(now, FanSide::Reader, request, blocks, subs, calls)?;
        self.ready
            .extend(addresses.into_iter().map(SessionOutput::PeerAddress));
        Ok(())
    }

    /// P's pull request as one export per D rank that reads from this rank; a rank no D rank
    /// reads from (a replica) ends at once, its blocks unread and not needed.
    pub(super) fn fan_exported(
        &mut self,
        now: Time,
        links: &RankLinks,
        start: ExportStart,
    ) -> Result<(), ConnectorError> {
        if links.side != SideName::Prefill {
            return Err(ConnectorError::Unsupported(
                "request_finished on a rank linked as D",
            ));
        }
        let ExportStart {
            request,
            key,
            blocks,
            num_tokens,
            lease,
        } = start;
        if links.peers.is_empty() {
            return self.replica_ended(request, blocks, true);
        }
        let p = links.rank;
        let mut subs = Vec::with_capacity(links.peers.len());
        let mut calls = Vec::with_capacity(links.peers.len());
        for &d in &links.peers {
            let sub = SubRequest {
                request: sub_request_id(&request, p, d)?,
                key: pair_key(&key, p, d)?,
            };
            calls.push(EndpointCall::Export(ExportStart {
                request: sub.request.clone(),
                key: sub.key.clone(),
                blocks: blocks.clone(),
                num_tokens,
                lease,
            }));
            subs.push(sub);
        }
        self.start_fan(now, FanSide::Holder, &request, blocks, subs, calls)
    }
}

/// The holder's blocks the router passed (`remote_block_ids`), for a pair whose block sizes
/// may differ: a valid list with as many cache groups as ours, whatever the counts.
fn remote_groups(params: &KvTransferParams, local: &BlockIds) -> Result<BlockIds, ConnectorError> {
    let groups = params
        .remote_block_ids
        .clone()
        .ok_or(ConnectorError::MissingParam("remote_block_ids"))?;
    let bad = |why: String| ConnectorError::InvalidParam {
        name: "remote_block_ids",
        why,
    };
    let remote = BlockIds { groups };
    remote.validate().map_err(|e| bad(e.to_string()))?;
    if remote.groups.len() != local.groups.len() {
        return Err(bad(format!(
            "{} cache groups; the local blocks have {}",
            remote.groups.len(),
            local.groups.len()
        )));
    }
    Ok(remote)
}

#[cfg(test)]
mod tests;
