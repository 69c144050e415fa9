//! Python values to and from the connector's types: `kv_transfer_params` dicts (through JSON,
//! whose keys are vLLM's), block ids (a list, a list per cache group, a numpy array), events.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use kvhandoff::{
    BlockIds, ConnectorEvent, ExportOutcome, ImportOutcome, KvTransferParams, RequestId,
};

use crate::errors::{raise, InvalidParams};

fn invalid(message: String) -> PyErr {
    raise::<InvalidParams>(message.clone(), message)
}

/// `kv_transfer_params` from a dict (or `None`: no parameters). Unknown keys are ignored, as
/// vLLM adds its own.
pub(crate) fn params_from(params: Option<&Bound<'_, PyAny>>) -> PyResult<KvTransferParams> {
    let Some(params) = params.filter(|p| !p.is_none()) else {
        return Ok(KvTransferParams::default());
    };
    if !params.is_instance_of::<PyDict>() {
        return Err(invalid(format!(
            "kv_transfer_params must be a dict, not {}",
            params.get_type().name()?
        )));
    }
    let json = params.py().import("json")?;
    let text: String = json
        .call_method1("dumps", (params,))
        .map_err(|e| invalid(format!("kv_transfer_params is not JSON: {e}")))?
        .extract()?;
    serde_json::from_str(&text)
        .map_err(|e| invalid(format!("kv_transfer_params: {}", name_the_key(&text, &e))))
}

/// The error, naming the key whose value it is about: each key is parsed alone until one fails.
fn name_the_key(text: &str, error: &serde_json::Error) -> String {
    let Ok(serde_json::Value::Object(map)) = serde_json::from_str::<serde_json::Value>(text) else {
        return error.to_string();
    };
    for (key, value) in map {
        let alone = serde_json::Value::Object(std::iter::once((key.clone(), value)).collect());
        if let Err(e) = serde_json::from_value::<KvTransferParams>(alone) {
            return format!("{key}: {e}");
        }
    }
    error.to_string()
}

/// The parameters as a dict, with vLLM's keys.
pub(crate) fn params_to<'py>(
    py: Python<'py>,
    params: &KvTransferParams,
) -> PyResult<Bound<'py, PyAny>> {
    let text = serde_json::to_string(params)
        .map_err(|e| invalid(format!("kv_transfer_params do not serialise: {e}")))?;
    py.import("json")?.call_method1("loads", (text,))
}

/// Block ids: a list of ints (one cache group), a list of such lists (one per group), or
/// anything with `tolist()` giving either (a numpy array).
pub(crate) fn blocks_from(blocks: &Bound<'_, PyAny>) -> PyResult<BlockIds> {
    let listed;
    let blocks = if blocks.hasattr("tolist")? {
        listed = blocks.call_method0("tolist")?;
        &listed
    } else {
        blocks
    };
    if let Ok(ids) = blocks.extract::<Vec<u32>>() {
        return Ok(BlockIds::single_group(ids));
    }
    if let Ok(groups) = blocks.extract::<Vec<Vec<u32>>>() {
        return Ok(BlockIds { groups });
    }
    // A tuple or list of per-group arrays (vLLM hands per-group lists in a tuple).
    if let Ok(items) = blocks.try_iter() {
        let mut groups = Vec::new();
        for item in items {
            let item = item?;
            let item = if item.hasattr("tolist")? {
                item.call_method0("tolist")?
            } else {
                item
            };
            groups.push(item.extract::<Vec<u32>>().map_err(|_| {
                invalid(
                    "block ids must be non-negative ints below 2**32, one list per cache group"
                        .into(),
                )
            })?);
        }
        return Ok(BlockIds { groups });
    }
    Err(invalid(
        "block ids must be a list of ints, a list per cache group, or a numpy array".into(),
    ))
}

pub(crate) fn request_id(id: &str) -> PyResult<RequestId> {
    RequestId::new(id).map_err(|e| invalid(format!("request_id: {e}")))
}

fn groups<'py>(py: Python<'py>, blocks: &BlockIds) -> PyResult<Bound<'py, PyList>> {
    PyList::new(
        py,
        blocks
            .groups
            .iter()
            .map(|g| PyList::new(py, g).map(|l| l.unbind()))
            .collect::<PyResult<Vec<_>>>()?,
    )
}

/// One event as a dict: `request_id`, `kind`, `final` (whether it hands the blocks back),
/// `blocks`, and what the kind says (`reason`, `proof`, `released`, `outcome`, `valid_tokens`).
pub(crate) fn event_to<'py>(
    py: Python<'py>,
    event: &ConnectorEvent,
) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    dict.set_item("final", event.hands_back())?;
    let none = py.None();
    for key in ["reason", "proof", "released", "outcome", "valid_tokens"] {
        dict.set_item(key, &none)?;
    }
    dict.set_item("blocks", PyList::empty(py))?;
    let (request, kind) = match event {
        ConnectorEvent::BlocksReady { request, blocks } => {
            dict.set_item("blocks", groups(py, blocks)?)?;
            (request, "blocks_ready")
        }
        ConnectorEvent::DecodeFenced { request, reason } => {
            dict.set_item("reason", format!("{reason:?}"))?;
            (request, "decode_fenced")
        }
        ConnectorEvent::Failed {
            request,
            reason,
            proof,
            blocks,
        } => {
            dict.set_item("reason", format!("{reason:?}"))?;
            dict.set_item("proof", format!("{proof:?}"))?;
            dict.set_item("blocks", groups(py, blocks)?)?;
            (request, "failed")
        }
        ConnectorEvent::Refused { request, error } => {
            dict.set_item("reason", error.to_string())?;
            (request, "refused")
        }
        ConnectorEvent::BlocksFree {
            request,
            released,
            blocks,
        } => {
            if let Some(cause) = released {
                dict.set_item("released", format!("{cause:?}"))?;
            }
            dict.set_item("blocks", groups(py, blocks)?)?;
            (request, "blocks_free")
        }
        ConnectorEvent::ExportEnded {
            request,
            outcome,
            proof,
            blocks,
        } => {
            let outcome = match outcome {
                ExportOutcome::Read => "read".to_string(),
                ExportOutcome::Released(end) => {
                    dict.set_item("released", format!("{end:?}"))?;
                    "released".to_string()
                }
            };
            dict.set_item("outcome", outcome)?;
            dict.set_item("proof", format!("{proof:?}"))?;
            dict.set_item("blocks", groups(py, blocks)?)?;
            (request, "export_ended")
        }
        ConnectorEvent::Imported {
            request,
            outcome,
            blocks,
        } => {
            match outcome {
                ImportOutcome::Loaded => dict.set_item("outcome", "loaded")?,
                ImportOutcome::Recompute {
                    valid_tokens,
                    failure,
                } => {
                    dict.set_item("outcome", "recompute")?;
                    dict.set_item("valid_tokens", *valid_tokens)?;
                    dict.set_item("reason", format!("{failure:?}"))?;
                }
                ImportOutcome::Failed(failure) => {
                    dict.set_item("outcome", "failed")?;
                    dict.set_item("reason", format!("{failure:?}"))?;
                }
            }
            dict.set_item("blocks", groups(py, blocks)?)?;
            (request, "imported")
        }
    };
    dict.set_item("request_id", request.as_str())?;
    dict.set_item("kind", kind)?;
    Ok(dict)
}
