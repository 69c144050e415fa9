//! The read path's calls (pull, and the turns of bidirectional conversations): what the
//! connector hands the endpoint to export blocks, to read an export, or to decline one, and the
//! parameters an export answers with.

use std::time::Duration;

use kvhandoff_actors::system::AddPeerAddress;
use kvhandoff_protocol::machine::{EngineCall, ExportStart, ImportStart};
use kvhandoff_protocol::{BlockIds, PairingKey, RequestId};

use super::KvConnector;
use crate::params::{epoch, mode_name, pairing_key, remote_blocks};
use crate::{ConnectorError, KvTransferParams, TransferMode};

/// vLLM's pull connector reads `tp_size` as 1 when the holder did not send it.
const PULL_DEFAULT_TP: u32 = 1;

impl KvConnector {
    /// The export of `blocks` under `key` for `lease`, and what the answer to the router adds:
    /// the blocks, their tokens and the export's hard end.
    pub(super) fn export_input(
        &self,
        request: RequestId,
        key: PairingKey,
        blocks: BlockIds,
        num_tokens: u64,
        lease: Duration,
        reply: &mut KvTransferParams,
    ) -> Result<EngineCall, ConnectorError> {
        reply.transfer_mode = Some(mode_name(TransferMode::Pull).into());
        reply.remote_block_ids = Some(blocks.groups.clone());
        reply.remote_num_tokens = Some(num_tokens);
        // The export's hard end (twice the lease and a read's span after its start, see
        // `export_hard_end`); it starts a moment after now, so this is a lower bound.
        let hard_end = lease.saturating_mul(2) + self.settings.read_span;
        reply.remote_blocks_expiry_time = Some(Self::clock_secs() + hard_end.as_secs_f64());
        Ok(EngineCall::Export(ExportStart {
            request,
            key,
            blocks,
            num_tokens,
            lease,
        }))
    }

    /// D keeps a finished turn's blocks for the next turn's reader.
    pub(super) fn keep_input(
        &self,
        request: RequestId,
        blocks: BlockIds,
        num_tokens: u64,
        ttl: Duration,
        params: &KvTransferParams,
    ) -> Result<(EngineCall, KvTransferParams), ConnectorError> {
        let key = pairing_key(&request, params)?;
        let mut reply = KvTransferParams {
            do_remote_prefill: false,
            do_remote_decode: true,
            remote_engine_id: Some(self.identity.engine.to_string()),
            remote_host: Some(self.identity.host.clone()),
            remote_port: Some(self.identity.port),
            remote_request_id: Some(request.to_string()),
            tp_size: Some(self.identity.tp_size),
            // The next turn is another request: it pairs by the key, not by its own id.
            transfer_id: Some(key.as_str().to_owned()),
            epoch: None,
            ..KvTransferParams::default()
        };
        let input = self.export_input(request, key, blocks, num_tokens, ttl, &mut reply)?;
        Ok((input, reply))
    }

    /// A read of the export `params` describe into `blocks` (D in pull mode, P on a later
    /// turn): the holder is the engine the parameters name.
    pub(super) fn import_input(
        &self,
        request: RequestId,
        blocks: BlockIds,
        num_tokens: u64,
        params: &KvTransferParams,
    ) -> Result<(EngineCall, Option<AddPeerAddress>), ConnectorError> {
        let tp = params.tp_size.or(Some(PULL_DEFAULT_TP));
        let (holder, address) = self.remote_peer(params, tp)?;
        let remote_blocks = remote_blocks(params, &blocks)?;
        let key = pairing_key(&request, params)?;
        let epoch = epoch(params)?;
        let block_tokens = self
            .settings
            .block_tokens
            .ok_or(ConnectorError::NotConfigured("block_tokens"))?;
        let call = EngineCall::Import(ImportStart {
            request,
            key,
            epoch,
            holder,
            blocks,
            remote_blocks,
            num_tokens,
            block_tokens,
            policy: self.settings.load_failure_policy,
            // The holder's expiry is in its own clock; without the clocks' offset the holder's
            // refusal of a read that could outlive its export is the guard.
            expires: None,
        });
        Ok((call, address))
    }

    /// The reader will not read the export `params` describe.
    pub(super) fn decline_input(
        &self,
        request: &RequestId,
        params: &KvTransferParams,
    ) -> Result<(EngineCall, Option<AddPeerAddress>), ConnectorError> {
        let tp = params.tp_size.or(Some(PULL_DEFAULT_TP));
        let (holder, address) = self.remote_peer(params, tp)?;
        let key = pairing_key(request, params)?;
        let epoch = epoch(params)?;
        Ok((EngineCall::DeclineExport { key, epoch, holder }, address))
    }
}
