//! A reader declining a multi-rank export: the engine will not read what the holders exported
//! (it recomputes, or a sibling request with the same parameters reacts to an error), so every
//! holder rank it would have read from lets its part go at once instead of at its lease's end.

use crate::hetero::SideName;
use crate::machine::{EndpointCall, Mutation, Rejected, Time};
use crate::{PeerAddr, RequestId};

use super::fan::pair_key;
use super::params::{epoch, pairing_key};
use super::prepare::remote_engine;
use super::{ConnectorError, KvTransferParams, RankLinks, Session, SessionOutput};

#[cfg(test)]
mod tests;

impl Session {
    /// One decline per holder rank of the export `params` describe, under each pair's key; all
    /// or none: while any part of it is being read here, the whole decline is refused
    /// ([`Rejected::ImportInProgress`]) and nothing is sent, so that no holder ends a part a
    /// live read of this rank still needs. No event follows: nothing was started here.
    pub(super) fn fan_declined(
        &mut self,
        now: Time,
        links: &RankLinks,
        request: &RequestId,
        params: &KvTransferParams,
    ) -> Result<(), ConnectorError> {
        let links = self.reader_links(links)?;
        links.check_remote_tp(params)?;
        let engine = remote_engine(params)?;
        let key = pairing_key(request, params)?;
        let epoch = epoch(params)?;
        let mut parts = Vec::with_capacity(links.peers.len());
        for &holder in &links.peers {
            let part = pair_key(&key, holder, links.rank)?;
            let holder = PeerAddr::new(engine.clone(), holder);
            if self.endpoint.is_reading(&part, &holder)
                && !self.mutation.is(Mutation::DeclineDuringRead)
            {
                return Err(Rejected::ImportInProgress(part).into());
            }
            let address = self.context().peer_address(&engine, params, holder.rank)?;
            parts.push((part, holder, address));
        }
        for (key, holder, address) in parts {
            if let Some(address) = address {
                self.ready.push_back(SessionOutput::PeerAddress(address));
            }
            self.endpoint
                .handle_call(now, EndpointCall::DeclineExport { key, epoch, holder })?;
        }
        Ok(())
    }

    /// The links of this rank as a reader: the call's (`links`) when it reads first turns (a D
    /// rank in pull mode), else its turn links when it reads kept turns back (a P rank).
    fn reader_links(&self, links: &RankLinks) -> Result<RankLinks, ConnectorError> {
        [Some(links), self.turn_links.as_ref()]
            .into_iter()
            .flatten()
            .find(|links| links.side == SideName::Decode)
            .cloned()
            .ok_or(ConnectorError::Unsupported(
                "declining on a rank linked to read nothing (neither D's links nor turn links)",
            ))
    }
}
