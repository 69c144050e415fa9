//! How a call is checked and turned into the endpoint's input: the push path's inputs, and what
//! every mode shares (the other engine's rank and side-channel address). The read path's inputs
//! are in `reads`.

use crate::machine::{DecodeStart, EndpointCall, PrefillStart, Time};
use crate::{BlockIds, EngineId, PeerAddr, RequestId, TransferMode};

use super::params::{check_next_turn_mode, epoch, mode_name, pairing_key};
use super::{
    CallContext, ConnectorCall, ConnectorError, ConnectorReply, KvTransferParams, PeerAddress,
};

/// A call checked by the session: the endpoint's input, the side-channel address that
/// travels with it, and the reply it earns if accepted.
type Prepared = (EndpointCall, Option<PeerAddress>, ConnectorReply);

impl CallContext<'_> {
    /// Checks one call and turns it into the endpoint's input, the side-channel address that
    /// travels with it (if any), and the reply it earns if accepted.
    pub(super) fn prepare(
        &self,
        now: Time,
        call: ConnectorCall,
    ) -> Result<Prepared, ConnectorError> {
        match call {
            ConnectorCall::RequestAllocated {
                request,
                blocks,
                num_tokens,
                params,
            } => {
                let (input, address) = if params.transfer_mode()? == TransferMode::Pull {
                    self.check_remote_prefill(&params)?;
                    self.import_input(request, blocks, num_tokens, &params)?
                } else {
                    self.decode_input(request, blocks, num_tokens, &params)?
                };
                Ok((input, address, ConnectorReply::Accepted))
            }
            ConnectorCall::RequestFinished {
                request,
                blocks,
                num_tokens,
                params,
            } => {
                let key = pairing_key(&request, &params)?;
                let pull = params.transfer_mode()? == TransferMode::Pull;
                let mut reply = self.prefill_answer(&request, num_tokens, params);
                let input = if pull {
                    let lease = self.settings.lease_duration;
                    self.export_input(now, request, key, blocks, num_tokens, lease, &mut reply)?
                } else {
                    EndpointCall::PrefillFinished(PrefillStart {
                        request,
                        key,
                        blocks,
                    })
                };
                Ok((input, None, ConnectorReply::DecodeParams(reply)))
            }
            ConnectorCall::PrefillStarted {
                request,
                blocks,
                num_tokens,
                params,
            } => {
                let key = pairing_key(&request, &params)?;
                if params.transfer_mode()? == TransferMode::Pull {
                    return Err(ConnectorError::InvalidParam {
                        name: "transfer_mode",
                        why: "layer-wise transfer is a push: \"push\" or absent".into(),
                    });
                }
                let plan =
                    self.settings
                        .layer_plan(num_tokens)
                        .ok_or(ConnectorError::NotConfigured(
                            "layer-wise push needs the rank's geometry",
                        ))?;
                let reply = self.prefill_answer(&request, num_tokens, params);
                let start = PrefillStart {
                    request,
                    key,
                    blocks,
                };
                let input = EndpointCall::PrefillStarted { start, plan };
                Ok((input, None, ConnectorReply::DecodeParams(reply)))
            }
            ConnectorCall::LayersReady { request, ready } => Ok((
                EndpointCall::LayersReady { request, ready },
                None,
                ConnectorReply::Accepted,
            )),
            ConnectorCall::KeepForNextTurn {
                request,
                blocks,
                num_tokens,
                ttl,
                params,
            } => {
                let (input, reply) =
                    self.keep_input(now, request, blocks, num_tokens, ttl, &params)?;
                Ok((input, None, ConnectorReply::NextTurnParams(reply)))
            }
            ConnectorCall::NextTurnAllocated {
                request,
                blocks,
                num_tokens,
                params,
            } => {
                check_next_turn_mode(&params)?;
                let (input, address) = self.import_input(request, blocks, num_tokens, &params)?;
                Ok((input, address, ConnectorReply::Accepted))
            }
            ConnectorCall::DeclineExport { request, params } => {
                let (input, address) = self.decline_input(&request, &params)?;
                Ok((input, address, ConnectorReply::Accepted))
            }
            ConnectorCall::Abort { request } => Ok((
                EndpointCall::Abort { request },
                None,
                ConnectorReply::Accepted,
            )),
            ConnectorCall::Shutdown => Ok((EndpointCall::Shutdown, None, ConnectorReply::Accepted)),
        }
    }

    /// What P answers the router for a prefill it hands over by push: the decode leg's
    /// parameters.
    fn prefill_answer(
        &self,
        request: &RequestId,
        num_tokens: u64,
        params: KvTransferParams,
    ) -> KvTransferParams {
        KvTransferParams {
            do_remote_prefill: true,
            do_remote_decode: false,
            transfer_id: params.transfer_id,
            epoch: params.epoch,
            transfer_mode: Some(mode_name(TransferMode::Push).into()),
            remote_num_tokens: Some(num_tokens),
            ..self.answer_from_here(request)
        }
    }

    fn decode_input(
        &self,
        request: RequestId,
        blocks: BlockIds,
        num_tokens: u64,
        params: &KvTransferParams,
    ) -> Result<(EndpointCall, Option<PeerAddress>), ConnectorError> {
        self.check_remote_prefill(params)?;
        let (prefill, address) = self.remote_peer(params, params.tp_size)?;
        let key = pairing_key(&request, params)?;
        let epoch = epoch(params)?;
        let call = EndpointCall::DecodeAllocated(DecodeStart {
            request,
            key,
            epoch,
            prefill,
            blocks,
            num_tokens,
            expected_writes: 1,
        });
        Ok((call, address))
    }

    /// D's hook is only for a request whose prefill ran remotely.
    pub(super) fn check_remote_prefill(
        &self,
        params: &KvTransferParams,
    ) -> Result<(), ConnectorError> {
        if params.do_remote_prefill {
            return Ok(());
        }
        Err(ConnectorError::InvalidParam {
            name: "do_remote_prefill",
            why: "must be true for a request whose prefill ran remotely".into(),
        })
    }

    /// The rank of the other engine `params` name (`remote_engine_id`; this rank's index, as
    /// TP sizes must be equal), and its side-channel address if this rank needs one.
    /// `remote_tp`: the other engine's TP size (`tp_size`), required.
    pub(super) fn remote_peer(
        &self,
        params: &KvTransferParams,
        remote_tp: Option<u32>,
    ) -> Result<(PeerAddr, Option<PeerAddress>), ConnectorError> {
        let engine = remote_engine(params)?;
        let remote_tp = remote_tp.ok_or(ConnectorError::MissingParam("tp_size"))?;
        if remote_tp != self.identity.tp_size {
            return Err(ConnectorError::Unsupported(
                "P and D with different TP sizes (heterogeneous TP comes later)",
            ));
        }
        let address = self.peer_address(&engine, params, self.identity.rank)?;
        Ok((PeerAddr::new(engine, self.identity.rank), address))
    }

    /// Where rank `peer_rank` of `engine` listens, from `remote_host` and `remote_port`, for a
    /// rank that reaches its peers over a side channel (the shell resolves it); `None` for one
    /// that finds its peers by itself. `remote_port` is the engine's base port: its rank `r`
    /// listens on the base + `r`, as vLLM's side channel does (see [`ConnectorIdentity::port`](super::ConnectorIdentity::port)).
    pub(super) fn peer_address(
        &self,
        engine: &EngineId,
        params: &KvTransferParams,
        peer_rank: u32,
    ) -> Result<Option<PeerAddress>, ConnectorError> {
        if !self.peer_addresses {
            return Ok(None);
        }
        let host = params
            .remote_host
            .as_deref()
            .ok_or(ConnectorError::MissingParam("remote_host"))?;
        let port = params
            .remote_port
            .ok_or(ConnectorError::MissingParam("remote_port"))?;
        if host.is_empty() || port == 0 {
            return Err(ConnectorError::InvalidParam {
                name: if host.is_empty() {
                    "remote_host"
                } else {
                    "remote_port"
                },
                why: "empty".into(),
            });
        }
        let port = u16::try_from(u32::from(port) + peer_rank).map_err(|_| {
            ConnectorError::InvalidParam {
                name: "remote_port",
                why: format!("{port} + rank {peer_rank} is past 65535"),
            }
        })?;
        Ok(Some(PeerAddress {
            engine: engine.clone(),
            rank: peer_rank,
            host: host.to_owned(),
            port,
        }))
    }
}

/// The other engine `params` name (`remote_engine_id`, required).
pub(super) fn remote_engine(params: &KvTransferParams) -> Result<EngineId, ConnectorError> {
    let engine = params
        .remote_engine_id
        .as_deref()
        .ok_or(ConnectorError::MissingParam("remote_engine_id"))?;
    EngineId::new(engine).map_err(|e| ConnectorError::invalid("remote_engine_id", e))
}
