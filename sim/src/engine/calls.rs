//! The engine model's calls, as an engine makes them: through the rank's session, with the
//! router's parameters (`KvTransferParams`) — never the endpoint's own inputs — so the sweeps
//! run the code an engine's connector runs.

use kvhandoff_protocol::machine::Rejected;
use kvhandoff_protocol::session::{
    ConnectorCall, ConnectorError, ConnectorReply, KvTransferParams, RankLinks,
};
use kvhandoff_protocol::{PairingKey, RequestId};

use crate::ledger::Owner;
use crate::world::{micros, Ev, NodeId, World};

impl World {
    /// What a router sends with a request of `key`, attempt `epoch`, whose other engine is
    /// `remote`'s: the key as `transfer_id`, so both sides pair on it.
    pub(super) fn router_params(
        &self,
        key: &PairingKey,
        epoch: u64,
        remote: NodeId,
    ) -> KvTransferParams {
        KvTransferParams {
            do_remote_prefill: true,
            remote_engine_id: Some(self.nodes[remote].addr.engine.to_string()),
            tp_size: Some(1),
            transfer_id: Some(key.as_str().to_owned()),
            epoch: Some(epoch),
            ..KvTransferParams::default()
        }
    }

    /// One engine call on `node`'s session (outputs not drained); `Unavailable` if the
    /// process is down.
    pub(super) fn call(
        &mut self,
        node: NodeId,
        call: ConnectorCall,
    ) -> Result<ConnectorReply, ConnectorError> {
        let now = self.now;
        match self.nodes[node].session.as_mut() {
            Some(session) => session.handle_call(now, call),
            None => Err(ConnectorError::Unavailable),
        }
    }

    /// [`World::call`] with links drawn for this request (a multi-rank request).
    pub(super) fn call_linked(
        &mut self,
        node: NodeId,
        call: ConnectorCall,
        links: &RankLinks,
    ) -> Result<ConnectorReply, ConnectorError> {
        let now = self.now;
        match self.nodes[node].session.as_mut() {
            Some(session) => session.handle_call_linked(now, call, links),
            None => Err(ConnectorError::Unavailable),
        }
    }

    /// An engine's start call with `blocks` allocated: its reply if the session took it (its
    /// outputs are not drained yet). Refused for lack of table room (admission control), the
    /// engine gives the blocks back and calls again a little later (`retry`), as a scheduler
    /// would; any other refusal is a violation.
    pub(super) fn engine_call(
        &mut self,
        node: NodeId,
        call: ConnectorCall,
        blocks: &[u32],
        owner: Owner,
        retry: Option<Ev>,
    ) -> Option<ConnectorReply> {
        if !self.alive(node) {
            return None;
        }
        match self.call(node, call) {
            Ok(reply) => Some(reply),
            Err(error) => {
                self.start_refused(node, error, blocks, owner, retry);
                None
            }
        }
    }

    /// A start call refused: a full table is admission control (the blocks go back and the
    /// engine tries again later); anything else is a violation.
    pub(super) fn start_refused(
        &mut self,
        node: NodeId,
        error: ConnectorError,
        blocks: &[u32],
        owner: Owner,
        retry: Option<Ev>,
    ) {
        if !matches!(error, ConnectorError::Rejected(Rejected::TableFull { .. })) {
            self.violate(format!("engine call refused by node {node}: {error}"));
            return;
        }
        self.mark("admission_refused");
        self.check_flood_admission(node);
        for error in self.nodes[node].pool.free(blocks, owner) {
            self.violate(error);
        }
        self.wake_waiters(node, blocks.len());
        if let Some(retry) = retry {
            let later = micros(&mut self.rng, 200_000, 1_000_000);
            self.schedule(later, retry);
        }
    }

    /// Keeps the parameters an export answered with (`request` is the export), for the router
    /// to hand to the reader.
    pub(super) fn keep_answer(&mut self, request: &RequestId, reply: ConnectorReply) {
        match reply {
            ConnectorReply::DecodeParams(params) | ConnectorReply::NextTurnParams(params) => {
                self.answers.insert(request.clone(), params);
            }
            ConnectorReply::Accepted => {
                self.violate(format!("export {request} answered with no parameters"));
            }
        }
    }
}
