//! The plumbing every `NativeConnector` call shares: the rank locked, the GIL released around
//! the connector, and a call's block ids checked against the pool. Kept apart from the Python
//! methods so that those read as the calls they are.

use std::sync::MutexGuard;

use pyo3::prelude::*;
use pyo3::types::PyList;

use kvhandoff::{ConnectorEvent, EngineRank, KvConnector};

use super::{outside, NativeConnector};
use crate::convert::{blocks_from, event_to, params_from, request_id as parse_request};
use crate::errors;

impl NativeConnector {
    /// Every block id below the pool's size: an id past it is refused before any transfer.
    fn check_blocks(&self, blocks: &kvhandoff::BlockIds) -> PyResult<()> {
        for ids in &blocks.groups {
            if let Some(bad) = ids.iter().find(|&&id| id >= self.num_blocks) {
                let cause = format!(
                    "block id {bad} is outside this rank's pool of {} blocks",
                    self.num_blocks
                );
                return Err(errors::raise::<errors::RegionError>(cause.clone(), cause));
            }
        }
        Ok(())
    }

    /// The rank, locked; `Unavailable` once closed.
    pub(super) fn locked(&self) -> PyResult<MutexGuard<'_, Option<EngineRank>>> {
        let guard = self
            .rank
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if guard.is_none() {
            return Err(errors::closed());
        }
        Ok(guard)
    }

    /// Runs `f` on the connector with the GIL released.
    pub(super) fn with_connector<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut KvConnector) -> Result<T, kvhandoff::ConnectorError> + Send,
    ) -> PyResult<T> {
        // Closed: answer without leaving the interpreter (a thread that waits outside it when
        // the interpreter finalises is torn down there).
        if self.closed() {
            return Err(errors::closed());
        }
        outside(py, || {
            let mut guard = self.locked()?;
            let rank = guard.as_mut().ok_or_else(errors::closed)?;
            f(rank.connector_mut()).map_err(errors::connector)
        })
    }

    /// A block-carrying call's arguments, checked: the request id, its blocks (inside the
    /// pool), the router's parameters, and the token count (default: whole blocks).
    pub(super) fn call_args(
        &self,
        request_id: &str,
        block_ids: &Bound<'_, PyAny>,
        params: Option<&Bound<'_, PyAny>>,
        num_tokens: Option<u64>,
    ) -> PyResult<(
        kvhandoff::RequestId,
        kvhandoff::BlockIds,
        kvhandoff::KvTransferParams,
        u64,
    )> {
        let request = parse_request(request_id)?;
        let blocks = blocks_from(block_ids)?;
        self.check_blocks(&blocks)?;
        let params = params_from(params)?;
        let tokens = self.tokens_of(&blocks, num_tokens);
        Ok((request, blocks, params, tokens))
    }

    fn tokens_of(&self, blocks: &kvhandoff::BlockIds, num_tokens: Option<u64>) -> u64 {
        num_tokens.unwrap_or_else(|| {
            let first = blocks.groups.first().map_or(0, Vec::len) as u64;
            first * u64::from(self.block_tokens)
        })
    }

    pub(super) fn events_to<'py>(
        py: Python<'py>,
        events: &[ConnectorEvent],
    ) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        for event in events {
            list.append(event_to(py, event)?)?;
        }
        Ok(list)
    }
}
