//! The transfer parameters that travel through the router, and what the connector reads from
//! them.

use kvhandoff_protocol::{Epoch, PairingKey, RequestId};
use serde::{Deserialize, Serialize};

use crate::ConnectorError;

/// The transfer parameters that travel through the router between P and D, with vLLM's key
/// names plus ours (`transfer_id`, `epoch`). Unknown keys are ignored.
///
/// ```
/// use kvhandoff::KvTransferParams;
/// let params: KvTransferParams = serde_json::from_str(r#"{
///     "do_remote_prefill": true, "remote_engine_id": "prefill-0",
///     "remote_host": "10.0.0.1", "remote_port": 5600, "tp_size": 1
/// }"#).unwrap();
/// assert!(params.do_remote_prefill);
/// assert_eq!(params.epoch, None);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvTransferParams {
    /// D: the prefill ran remotely and its KV must be received.
    #[serde(default)]
    pub do_remote_prefill: bool,
    /// P: the decode runs remotely and the KV must be kept for it.
    #[serde(default)]
    pub do_remote_decode: bool,
    /// The other engine.
    #[serde(default)]
    pub remote_engine_id: Option<String>,
    /// The other engine's side-channel host.
    #[serde(default)]
    pub remote_host: Option<String>,
    /// The other engine's side-channel port.
    #[serde(default)]
    pub remote_port: Option<u16>,
    /// The other engine's id of the request.
    #[serde(default)]
    pub remote_request_id: Option<String>,
    /// The other engine's TP size.
    #[serde(default)]
    pub tp_size: Option<u32>,
    /// An explicit pairing key chosen by the router; preferred over request-id pairing.
    #[serde(default)]
    pub transfer_id: Option<String>,
    /// The attempt, chosen by the router on retries (default 1).
    #[serde(default)]
    pub epoch: Option<u64>,
    /// `"push"` for this connector.
    #[serde(default)]
    pub transfer_mode: Option<String>,
}

/// The pairing key of `request`: the router's `transfer_id` when it sent one.
pub(crate) fn pairing_key(
    request: &RequestId,
    params: &KvTransferParams,
) -> Result<PairingKey, ConnectorError> {
    match &params.transfer_id {
        Some(id) => {
            PairingKey::from_transfer_id(id).map_err(|e| ConnectorError::invalid("transfer_id", e))
        }
        None => Ok(PairingKey::from_request_id(request)),
    }
}

/// The attempt `params` name (the first when none).
pub(crate) fn epoch(params: &KvTransferParams) -> Result<Epoch, ConnectorError> {
    match params.epoch.map(Epoch) {
        None => Ok(Epoch::FIRST),
        Some(epoch) if epoch.is_valid() => Ok(epoch),
        Some(epoch) => Err(ConnectorError::InvalidParam {
            name: "epoch",
            why: format!("{epoch} is out of range: epochs run 1..={}", Epoch::MAX),
        }),
    }
}
