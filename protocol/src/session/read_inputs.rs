//! The read path's calls (pull, and the turns of bidirectional conversations): what the
//! connector hands the endpoint to export blocks, to read an export, or to decline one, and the
//! parameters an export answers with.

use std::time::Duration;

use crate::machine::{EndpointCall, ExportStart, ImportStart, Rejected, Time, MAX_EXPORT_LEASE};
use crate::{BlockIds, EngineId, PairingKey, RequestId, TransferMode};

use super::params::{epoch, mode_name, pairing_key, remote_blocks};
use super::{CallContext, ConnectorError, KvTransferParams, PeerAddress};

/// vLLM's pull connector reads `tp_size` as 1 when the holder did not send it.
const PULL_DEFAULT_TP: u32 = 1;

impl CallContext<'_> {
    /// The export of `blocks` under `key` for `lease`, and what the answer to the router adds:
    /// the blocks, their tokens and the export's hard end.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn export_input(
        &self,
        now: Time,
        request: RequestId,
        key: PairingKey,
        blocks: BlockIds,
        num_tokens: u64,
        lease: Duration,
        reply: &mut KvTransferParams,
    ) -> Result<EndpointCall, ConnectorError> {
        // The endpoint refuses such a lease too; checked here first because the expiry below
        // is computed from it.
        if lease > MAX_EXPORT_LEASE {
            return Err(ConnectorError::Rejected(Rejected::TooLong {
                what: "an export's lease",
                given: lease,
                max: MAX_EXPORT_LEASE,
            }));
        }
        reply.transfer_mode = Some(mode_name(TransferMode::Pull).into());
        reply.remote_block_ids = Some(blocks.groups.clone());
        reply.remote_num_tokens = Some(num_tokens);
        // The export's hard end (twice the lease and a read's span after its start, see
        // `export_hard_end`); it starts a moment after now, so this is a lower bound.
        let hard_end = lease
            .saturating_mul(2)
            .saturating_add(self.settings.read_span);
        reply.remote_blocks_expiry_time = Some((now.since_origin() + hard_end).as_secs_f64());
        Ok(EndpointCall::Export(ExportStart {
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
        now: Time,
        request: RequestId,
        blocks: BlockIds,
        num_tokens: u64,
        ttl: Duration,
        params: &KvTransferParams,
    ) -> Result<(EndpointCall, KvTransferParams), ConnectorError> {
        let key = pairing_key(&request, params)?;
        let mut reply = KvTransferParams {
            do_remote_prefill: false,
            do_remote_decode: true,
            // The next turn is another request: it pairs by the key, not by its own id.
            transfer_id: Some(key.as_str().to_owned()),
            epoch: None,
            ..self.answer_from_here(&request)
        };
        let input = self.export_input(now, request, key, blocks, num_tokens, ttl, &mut reply)?;
        Ok((input, reply))
    }

    /// The parameters every answer of this rank about `request` carries: where to find this
    /// rank (engine, side channel, TP size) and the request's id here.
    pub(super) fn answer_from_here(&self, request: &RequestId) -> KvTransferParams {
        KvTransferParams {
            remote_engine_id: Some(self.identity.engine.to_string()),
            remote_host: Some(self.identity.host.clone()),
            // The engine's base port: rank r listens on base + r.
            remote_port: Some(
                self.identity
                    .port
                    .saturating_sub(u16::try_from(self.identity.rank).unwrap_or(u16::MAX)),
            ),
            remote_request_id: Some(request.to_string()),
            tp_size: Some(self.identity.tp_size),
            ..KvTransferParams::default()
        }
    }

    /// A read of the export `params` describe into `blocks` (D in pull mode, P on a later
    /// turn): the holder is the engine the parameters name.
    pub(super) fn import_input(
        &self,
        request: RequestId,
        blocks: BlockIds,
        num_tokens: u64,
        params: &KvTransferParams,
    ) -> Result<(EndpointCall, Option<PeerAddress>), ConnectorError> {
        let tp = params.tp_size.or(Some(PULL_DEFAULT_TP));
        let (holder, address) = self.remote_peer(params, tp)?;
        let remote_blocks = remote_blocks(params, &blocks)?;
        let key = pairing_key(&request, params)?;
        let epoch = epoch(params)?;
        let block_tokens = self
            .settings
            .block_tokens
            .ok_or(ConnectorError::NotConfigured("block_tokens"))?;
        // The holder's expiry, in our time, when the side channel measured its clock: the
        // endpoint then declines a read that could outlive the export before asking. Without
        // it, the holder's own refusal of such a read is the guard.
        let expires = match params.remote_blocks_expiry_time {
            Some(secs) => self.local_time_of(&holder.engine, secs),
            None => None,
        };
        let call = EndpointCall::Import(ImportStart {
            request,
            key,
            epoch,
            holder,
            blocks,
            remote_blocks,
            num_tokens,
            block_tokens,
            policy: self.settings.load_failure_policy,
            expires,
        });
        Ok((call, address))
    }

    /// `remote_secs` on `engine`'s clock as a time of this session's clock, with the offset the
    /// side channel measured ([`Session::clock_measured`]); `None` if it has none (no handshake
    /// yet: the holder's own refusal of a read that could outlive its export is then the guard).
    pub(super) fn local_time_of(&self, engine: &EngineId, remote_secs: f64) -> Option<Time> {
        let offset_us = *self.clock_offsets.get(engine)?;
        remote_to_local(remote_secs, offset_us)
    }

    /// The reader will not read the export `params` describe.
    pub(super) fn decline_input(
        &self,
        request: &RequestId,
        params: &KvTransferParams,
    ) -> Result<(EndpointCall, Option<PeerAddress>), ConnectorError> {
        let tp = params.tp_size.or(Some(PULL_DEFAULT_TP));
        let (holder, address) = self.remote_peer(params, tp)?;
        let key = pairing_key(request, params)?;
        let epoch = epoch(params)?;
        Ok((EndpointCall::DeclineExport { key, epoch, holder }, address))
    }
}

/// `remote_secs` on a clock `offset_us` ahead of ours (peer minus ours), as our time; `None` for
/// a value that is no time (not finite, or beyond `Duration`). Before our origin is 0.
fn remote_to_local(remote_secs: f64, offset_us: i64) -> Option<Time> {
    let local_secs = remote_secs - offset_us as f64 / 1e6;
    if !local_secs.is_finite() {
        return None;
    }
    let local = Duration::try_from_secs_f64(local_secs.max(0.0)).ok()?;
    Some(Time::from_duration(local))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_holders_expiry_converts_with_the_measured_offset() {
        let secs = |s: u64| Some(Time::from_duration(Duration::from_secs(s)));
        // The holder's clock runs 30 s ahead of ours: its 100 s is our 70 s.
        assert_eq!(remote_to_local(100.0, 30_000_000), secs(70));
        // Behind by 5 s: its 100 s is our 105 s.
        assert_eq!(remote_to_local(100.0, -5_000_000), secs(105));
        // An expiry before our origin is our origin (long expired).
        assert_eq!(remote_to_local(1.0, 30_000_000), secs(0));
        assert_eq!(remote_to_local(f64::NAN, 0), None);
        assert_eq!(remote_to_local(f64::INFINITY, 0), None);
    }
}
