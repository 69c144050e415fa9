//! The transfer parameters that travel through the router, and what the connector reads from
//! them.

use crate::{BlockIds, Epoch, PairingKey, RequestId, TransferMode};
use serde::{Deserialize, Deserializer, Serialize};

use super::ConnectorError;

/// The transfer parameters that travel through the router between P and D, with vLLM's key
/// names (0.33, `kv_transfer_params`) plus ours (`transfer_id`, `epoch`). Unknown keys are
/// ignored; the read-path keys (`remote_block_ids`, `remote_num_tokens`,
/// `remote_blocks_expiry_time`) are left out of the JSON when absent.
///
/// ```
/// use kvhandoff_protocol::session::KvTransferParams;
/// let params: KvTransferParams = serde_json::from_str(r#"{
///     "do_remote_prefill": true, "remote_engine_id": "prefill-0",
///     "remote_host": "10.0.0.1", "remote_port": 5600, "tp_size": 1,
///     "transfer_mode": "pull", "remote_block_ids": [[4, 5, 6]],
///     "remote_num_tokens": 40, "remote_blocks_expiry_time": 1234.5
/// }"#).unwrap();
/// assert!(params.do_remote_prefill);
/// assert_eq!(params.epoch, None);
/// assert_eq!(params.transfer_mode().unwrap(), kvhandoff_protocol::TransferMode::Pull);
/// assert_eq!(params.remote_block_ids, Some(vec![vec![4, 5, 6]]));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct KvTransferParams {
    /// D: the prefill ran remotely and its KV must be received.
    #[serde(default)]
    pub do_remote_prefill: bool,
    /// P: the decode runs remotely and the KV must be kept for it. In the parameters a D
    /// returns from `kvhandoff::KvConnector::keep_for_next_turn`:
    /// D keeps the KV for the next turn's prefill.
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
    /// How the KV moves: `"push"` (P writes into D's blocks) or `"pull"` (the holder exports
    /// its blocks and the other side reads them). From the router: the mode to use (absent:
    /// push). From an engine's connector: the mode it used. See [`TransferMode`].
    #[serde(default)]
    pub transfer_mode: Option<String>,
    /// Pull and bidirectional: the holder's blocks, one list per cache group (vLLM's tuple of
    /// per-group lists; a flat list is read as one group). Required to read.
    #[serde(
        default,
        deserialize_with = "block_groups",
        skip_serializing_if = "Option::is_none"
    )]
    pub remote_block_ids: Option<Vec<Vec<u32>>>,
    /// Pull and bidirectional: how many tokens the holder's blocks hold.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_num_tokens: Option<u64>,
    /// Pull and bidirectional: when the holder's export ends at the latest, in seconds of the
    /// holder's own monotonic clock (`kvhandoff::KvConnector::clock_secs`
    /// of the holder's process): only comparable with that clock, so a reader in another
    /// process needs the clocks' offset to use it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_blocks_expiry_time: Option<f64>,
}

impl KvTransferParams {
    /// The transfer mode these parameters ask for: [`TransferMode::Push`] when
    /// `transfer_mode` is absent, [`TransferMode::Pull`] for `"pull"`; never another.
    ///
    /// # Errors
    /// [`ConnectorError::InvalidParam`] for a `transfer_mode` other than `"push"` or `"pull"`
    /// (in any letter case).
    pub fn transfer_mode(&self) -> Result<TransferMode, ConnectorError> {
        match self.transfer_mode.as_deref() {
            None => Ok(TransferMode::Push),
            Some(mode) if mode.eq_ignore_ascii_case("push") => Ok(TransferMode::Push),
            Some(mode) if mode.eq_ignore_ascii_case("pull") => Ok(TransferMode::Pull),
            Some(mode) => Err(ConnectorError::InvalidParam {
                name: "transfer_mode",
                why: format!("{mode:?} is neither \"push\" nor \"pull\""),
            }),
        }
    }
}

/// A later turn reads the previous turns' KV: its `transfer_mode` is `"pull"` or absent (the
/// read this call is); only an explicit `"push"` is refused.
pub(crate) fn check_next_turn_mode(params: &KvTransferParams) -> Result<(), ConnectorError> {
    if params.transfer_mode.is_some() && params.transfer_mode()? == TransferMode::Push {
        return Err(ConnectorError::InvalidParam {
            name: "transfer_mode",
            why: "a later turn reads the previous turns' KV: \"pull\" or absent".into(),
        });
    }
    Ok(())
}

/// How `transfer_mode` spells `mode` (`"push"` or `"pull"`; the handshake-only modes by their
/// own names).
pub(crate) fn mode_name(mode: TransferMode) -> &'static str {
    match mode {
        TransferMode::Push => "push",
        TransferMode::Pull => "pull",
        TransferMode::LayerwisePush => "layerwise_push",
        TransferMode::Bidirectional => "bidirectional",
    }
}

/// The wire forms of `remote_block_ids`.
#[derive(Deserialize)]
#[serde(untagged)]
enum BlockGroups {
    /// One list per cache group (vLLM 0.33).
    Groups(Vec<Vec<u32>>),
    /// One flat list (older vLLM, one cache group).
    Flat(Vec<u32>),
}

fn block_groups<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<Vec<u32>>>, D::Error> {
    Ok(
        Option::<BlockGroups>::deserialize(d)?.map(|groups| match groups {
            BlockGroups::Groups(groups) => groups,
            BlockGroups::Flat(ids) => vec![ids],
        }),
    )
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

/// The holder's blocks (`remote_block_ids`), checked against the reader's `local` blocks: the
/// same number of cache groups, and no local group longer than the holder's (a reader with a
/// partial prefix hit reads the tail of each group). All-empty `local` blocks (a full prefix
/// hit) read nothing and fit any export.
pub(crate) fn remote_blocks(
    params: &KvTransferParams,
    local: &BlockIds,
) -> Result<BlockIds, ConnectorError> {
    let groups = params
        .remote_block_ids
        .clone()
        .ok_or(ConnectorError::MissingParam("remote_block_ids"))?;
    let bad = |why: String| ConnectorError::InvalidParam {
        name: "remote_block_ids",
        why,
    };
    if groups.is_empty() {
        return Err(bad("no cache group".into()));
    }
    let remote = BlockIds { groups };
    remote.validate().map_err(|e| bad(e.to_string()))?;
    if local.is_empty() {
        return Ok(remote);
    }
    if remote.groups.len() != local.groups.len() {
        return Err(bad(format!(
            "{} cache groups; the local blocks have {}",
            remote.groups.len(),
            local.groups.len()
        )));
    }
    for (g, (theirs, ours)) in remote.groups.iter().zip(&local.groups).enumerate() {
        if ours.len() > theirs.len() {
            return Err(bad(format!(
                "group {g} has {} blocks, fewer than the {} local ones to fill",
                theirs.len(),
                ours.len()
            )));
        }
    }
    Ok(remote)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> KvTransferParams {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn transfer_modes() {
        let mode = |m: Option<&str>| {
            KvTransferParams {
                transfer_mode: m.map(String::from),
                ..KvTransferParams::default()
            }
            .transfer_mode()
        };
        assert_eq!(mode(None), Ok(TransferMode::Push));
        assert_eq!(mode(Some("push")), Ok(TransferMode::Push));
        assert_eq!(mode(Some("PULL")), Ok(TransferMode::Pull));
        assert!(matches!(
            mode(Some("carrier-pigeon")),
            Err(ConnectorError::InvalidParam {
                name: "transfer_mode",
                ..
            })
        ));
    }

    #[test]
    fn remote_block_ids_as_groups_or_flat() {
        assert_eq!(
            parse(r#"{"remote_block_ids": [[1, 2], [7]]}"#).remote_block_ids,
            Some(vec![vec![1, 2], vec![7]])
        );
        assert_eq!(
            parse(r#"{"remote_block_ids": [1, 2]}"#).remote_block_ids,
            Some(vec![vec![1, 2]])
        );
        assert_eq!(
            parse(r#"{"remote_block_ids": null}"#).remote_block_ids,
            None
        );
        assert_eq!(parse("{}").remote_block_ids, None);
        assert!(
            serde_json::from_str::<KvTransferParams>(r#"{"remote_block_ids": "1,2"}"#).is_err()
        );
    }

    #[test]
    fn read_keys_are_left_out_when_absent_and_round_trip_when_present() {
        let json = serde_json::to_string(&KvTransferParams::default()).unwrap();
        for key in [
            "remote_block_ids",
            "remote_num_tokens",
            "remote_blocks_expiry_time",
        ] {
            assert!(!json.contains(key), "{json}");
        }
        let params = KvTransferParams {
            transfer_mode: Some("pull".into()),
            remote_block_ids: Some(vec![vec![3, 4]]),
            remote_num_tokens: Some(20),
            remote_blocks_expiry_time: Some(61.25),
            ..KvTransferParams::default()
        };
        let json = serde_json::to_string(&params).unwrap();
        assert!(json.contains(r#""remote_block_ids":[[3,4]]"#), "{json}");
        assert!(
            json.contains(r#""remote_blocks_expiry_time":61.25"#),
            "{json}"
        );
        assert_eq!(parse(&json), params);
    }

    #[test]
    fn remote_blocks_are_checked_against_the_local_ones() {
        let with = |groups: Option<Vec<Vec<u32>>>| KvTransferParams {
            remote_block_ids: groups,
            ..KvTransferParams::default()
        };
        let local = BlockIds::single_group(vec![10, 11]);
        assert_eq!(
            remote_blocks(&with(None), &local),
            Err(ConnectorError::MissingParam("remote_block_ids"))
        );
        let invalid = |p: &KvTransferParams, local: &BlockIds| {
            matches!(
                remote_blocks(p, local),
                Err(ConnectorError::InvalidParam {
                    name: "remote_block_ids",
                    ..
                })
            )
        };
        assert!(invalid(&with(Some(vec![])), &local));
        assert!(invalid(&with(Some(vec![vec![1, 1, 2]])), &local));
        assert!(invalid(&with(Some(vec![vec![1]])), &local));
        assert!(invalid(&with(Some(vec![vec![1, 2], vec![3, 4]])), &local));
        // A partial prefix hit reads the tail; a full one reads nothing.
        let remote = remote_blocks(&with(Some(vec![vec![1, 2, 3]])), &local).unwrap();
        assert_eq!(remote, BlockIds::single_group(vec![1, 2, 3]));
        assert!(remote_blocks(&with(Some(vec![vec![1, 2, 3]])), &BlockIds::default()).is_ok());
    }
}
