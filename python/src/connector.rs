//! `NativeConnector`: one engine rank on memory the engine owns, driven from Python.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use kvhandoff::{
    AcceptPolicy, ConnectorEvent, EngineId, EngineRank, KvGeometry, ModelIdentity, PeerAddr, Psk,
    RankBuilder, SideChannel, SideChannelConfig,
};

use crate::convert::{params_from, params_to, request_id as parse_request};
use crate::errors::{self, config};
use crate::options::Options;

mod calls;
mod setup;

use setup::{adopt_regions, parse_listen, parse_role, peer_list, transport_kind, PyRegion, Role};

/// Threads now outside the interpreter in a connector call (the GIL released). The package's
/// exit hook waits for it to drop to zero after closing every connector: a thread still out
/// there when the interpreter finalises would be torn down inside native code.
static OUTSIDE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// How many threads are in a connector call with the GIL released, now.
#[pyfunction]
pub fn threads_outside() -> usize {
    OUTSIDE.load(std::sync::atomic::Ordering::Acquire)
}

/// Runs `f` with the GIL released, counted in [`OUTSIDE`] until the GIL is back.
fn outside<T: Send>(py: Python<'_>, f: impl FnOnce() -> T + Send) -> T {
    OUTSIDE.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    let result = py.detach(f);
    OUTSIDE.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    result
}

/// One engine rank (prefill or decode) on memory the engine owns: see `kvhandoff.Connector`.
#[pyclass(subclass, module = "kvhandoff._native", name = "NativeConnector")]
pub struct NativeConnector {
    rank: Mutex<Option<EngineRank>>,
    role: Role,
    engine_id: String,
    address: String,
    num_blocks: u32,
    block_bytes: u64,
    block_tokens: u32,
    /// This rank's layers (one region per layer in the opaque geometry): the `ready` that ends
    /// a layer-wise prefill.
    layers: u32,
    close_timeout: Duration,
}

#[pymethods]
impl NativeConnector {
    #[new]
    #[pyo3(signature = (
        role, engine_id, regions, block_bytes, *, rank = 0, listen = "127.0.0.1:0",
        advertise_host = None, transport = "nixl", block_tokens = 16, model = "opaque",
        dtype = "opaque", peers = None, accept_any = false, tp_size = 1, psk_file = None,
        **config
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        role: &str,
        engine_id: &str,
        regions: Vec<PyRegion>,
        block_bytes: u64,
        rank: u32,
        listen: &str,
        advertise_host: Option<String>,
        transport: &str,
        block_tokens: u32,
        model: &str,
        dtype: &str,
        peers: Option<&Bound<'_, PyAny>>,
        accept_any: bool,
        tp_size: u32,
        psk_file: Option<std::path::PathBuf>,
        config: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<NativeConnector> {
        let role = parse_role(role)?;
        let engine =
            EngineId::new(engine_id).map_err(|e| self::config(format!("engine_id: {e}")))?;
        if tp_size != 1 || rank != 0 {
            return Err(errors::raise::<errors::Unsupported>(
                format!("rank {rank} of TP {tp_size}: blocks moved as opaque bytes pair TP-1 engines only"),
                "opaque blocks carry no per-head geometry to split across TP ranks".into(),
            ));
        }
        let options = Options::from_kwargs(config)?;
        let geometry = KvGeometry::opaque_blocks(
            u32::try_from(regions.len()).map_err(|_| self::config("too many regions"))?,
            block_bytes,
            block_tokens,
        )
        .map_err(|e| self::config(format!("block_bytes / block_tokens / regions: {e}")))?;
        let (regions, num_blocks) = adopt_regions(regions, block_bytes)?;
        let transport = transport_kind(transport)?;
        let mut side = SideChannelConfig::new(parse_listen(listen)?);
        if accept_any {
            side.accept = AcceptPolicy::AnyEngine;
        }
        if let Some(path) = psk_file {
            let key = Psk::from_file(&path).map_err(|e| self::config(format!("psk_file: {e}")))?;
            side.psk = Some(key);
        }
        let mut peer_addrs = Vec::new();
        for (peer, addr) in peer_list(peers)? {
            let id = EngineId::new(&peer).map_err(|e| self::config(format!("peers: {e}")))?;
            peer_addrs.push((id, parse_listen(&addr)?));
        }
        let model = ModelIdentity {
            model: model.into(),
            dtype: dtype.into(),
            cache_dtype: dtype.into(),
        };
        let settings = options.settings(&geometry);
        let layers = settings.layers.unwrap_or(0);
        let mut builder = RankBuilder::new(engine, geometry, model)
            .regions(regions)
            .transport(transport)
            .side_channel(SideChannel::Tcp(side))
            .config(options.config.clone())
            .connector_settings(settings)
            .shell(options.shell.clone());
        if let Some(host) = advertise_host {
            builder = builder.advertise_host(host);
        }
        for (peer, addr) in peer_addrs {
            builder = builder.peer(peer, addr);
        }
        let mut started = outside(py, || builder.start()).map_err(errors::start)?;
        if let Some(timeout) = options.call_timeout {
            started.connector_mut().set_call_timeout(timeout);
        }
        let identity = started.identity();
        let address = format!("{}:{}", identity.host, identity.port);
        Ok(NativeConnector {
            rank: Mutex::new(Some(started)),
            role,
            engine_id: engine_id.to_string(),
            address,
            num_blocks,
            block_bytes,
            block_tokens,
            layers,
            close_timeout: options.close_timeout,
        })
    }

    /// `"host:port"` of this rank's side channel.
    #[getter]
    fn address(&self) -> &str {
        &self.address
    }

    #[getter]
    fn engine_id(&self) -> &str {
        &self.engine_id
    }

    #[getter]
    fn role(&self) -> &'static str {
        self.role.name()
    }

    #[getter]
    fn num_blocks(&self) -> u32 {
        self.num_blocks
    }

    #[getter]
    fn block_bytes(&self) -> u64 {
        self.block_bytes
    }

    #[getter]
    fn block_tokens(&self) -> u32 {
        self.block_tokens
    }

    /// This rank's layers: one per region (the opaque geometry), the `ready` of a layer-wise
    /// prefill's last [`NativeConnector::layers_ready`].
    #[getter]
    fn layers(&self) -> u32 {
        self.layers
    }

    #[getter]
    fn closed(&self) -> bool {
        self.rank
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_none()
    }

    /// Tells the rank where `engine_id`'s side channel listens (and accepts its handshakes).
    fn add_peer(&self, py: Python<'_>, engine_id: &str, address: &str) -> PyResult<()> {
        let engine = EngineId::new(engine_id).map_err(|e| config(format!("engine_id: {e}")))?;
        let addr = parse_listen(address)?;
        if self.closed() {
            return Err(errors::closed());
        }
        outside(py, || {
            let guard = self.locked()?;
            let rank = guard.as_ref().ok_or_else(errors::closed)?;
            rank.add_peer(&engine, addr).map_err(errors::start)
        })
    }

    /// Makes the handshake with `engine_id` (rank 0: opaque blocks pair TP-1 engines) now,
    /// so that its first request does not pay it; its address must be known (`peers` or
    /// `add_peer`). Raises `Unavailable` if the peer refused or did not answer within
    /// `timeout` seconds (the connector is unaffected).
    #[pyo3(signature = (engine_id, timeout = 10.0))]
    fn warm_up(&self, py: Python<'_>, engine_id: &str, timeout: f64) -> PyResult<()> {
        let engine = EngineId::new(engine_id).map_err(|e| config(format!("engine_id: {e}")))?;
        if !(timeout.is_finite() && timeout > 0.0 && timeout <= 3600.0) {
            return Err(config(format!("timeout: {timeout} s is not in (0, 3600]")));
        }
        if self.closed() {
            return Err(errors::closed());
        }
        outside(py, || {
            let guard = self.locked()?;
            let rank = guard.as_ref().ok_or_else(errors::closed)?;
            rank.warm_up(&PeerAddr::new(engine, 0), Duration::from_secs_f64(timeout))
                .map_err(errors::warm_up)
        })
    }

    /// D: blocks were allocated for `request_id`, whose prefill ran on the engine the params name.
    #[pyo3(signature = (request_id, block_ids, kv_transfer_params, num_tokens = None))]
    fn request_allocated(
        &self,
        py: Python<'_>,
        request_id: &str,
        block_ids: &Bound<'_, PyAny>,
        kv_transfer_params: &Bound<'_, PyAny>,
        num_tokens: Option<u64>,
    ) -> PyResult<()> {
        let (request, blocks, params, tokens) =
            self.call_args(request_id, block_ids, Some(kv_transfer_params), num_tokens)?;
        self.with_connector(py, |c| {
            c.request_allocated(&request, blocks, tokens, &params)
        })
    }

    /// P: the prefill of `request_id` finished with its KV in `block_ids`; returns the
    /// parameters for the router's decode leg.
    #[pyo3(signature = (request_id, block_ids, kv_transfer_params = None, num_tokens = None))]
    fn request_finished<'py>(
        &self,
        py: Python<'py>,
        request_id: &str,
        block_ids: &Bound<'py, PyAny>,
        kv_transfer_params: Option<&Bound<'py, PyAny>>,
        num_tokens: Option<u64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let (request, blocks, params, tokens) =
            self.call_args(request_id, block_ids, kv_transfer_params, num_tokens)?;
        let answer = self.with_connector(py, |c| {
            c.request_finished(&request, blocks, tokens, &params)
        })?;
        params_to(py, &answer)
    }

    /// P, layer-wise push: the prefill of `request_id` starts into `block_ids` (`num_tokens`
    /// prompt tokens); its layers follow in [`NativeConnector::layers_ready`]. In place of
    /// `request_finished` (which must not follow), and answered as it is. Push only: `"pull"`
    /// in the params is `InvalidParams`.
    #[pyo3(signature = (request_id, block_ids, kv_transfer_params = None, num_tokens = None))]
    fn prefill_started<'py>(
        &self,
        py: Python<'py>,
        request_id: &str,
        block_ids: &Bound<'py, PyAny>,
        kv_transfer_params: Option<&Bound<'py, PyAny>>,
        num_tokens: Option<u64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let (request, blocks, params, tokens) =
            self.call_args(request_id, block_ids, kv_transfer_params, num_tokens)?;
        let answer =
            self.with_connector(py, |c| c.prefill_started(&request, blocks, tokens, &params))?;
        params_to(py, &answer)
    }

    /// P, layer-wise push: layers `0 .. ready` of `request_id`'s blocks hold their KV (`ready`
    /// equal to [`NativeConnector::layers`] ends the prefill). A request that already ended (D
    /// gave up) takes it and does nothing; one never started layer-wise is `Rejected`.
    fn layers_ready(&self, py: Python<'_>, request_id: &str, ready: u32) -> PyResult<()> {
        let request = parse_request(request_id)?;
        // Past the last layer is a caller's bug, not a count to clamp: say so before the call.
        if ready > self.layers {
            let cause = format!("ready: {ready} layers, but this rank has {}", self.layers);
            return Err(errors::raise::<errors::InvalidParams>(cause.clone(), cause));
        }
        self.with_connector(py, |c| c.layers_ready(&request, ready))
    }

    /// D, bidirectional: keeps the turn's blocks for the next turn's prefill to read.
    #[pyo3(signature = (request_id, block_ids, kv_transfer_params = None, num_tokens = None, ttl_s = None))]
    fn keep_for_next_turn<'py>(
        &self,
        py: Python<'py>,
        request_id: &str,
        block_ids: &Bound<'py, PyAny>,
        kv_transfer_params: Option<&Bound<'py, PyAny>>,
        num_tokens: Option<u64>,
        ttl_s: Option<f64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let (request, blocks, params, tokens) =
            self.call_args(request_id, block_ids, kv_transfer_params, num_tokens)?;
        let ttl = match ttl_s {
            None => None,
            Some(s) if s.is_finite() && s > 0.0 && s < 1.0e7 => Some(Duration::from_secs_f64(s)),
            Some(s) => {
                return Err(config(format!(
                    "ttl_s must be positive and finite (got {s})"
                )))
            }
        };
        let answer = self.with_connector(py, |c| {
            let ttl = ttl.unwrap_or(c.settings().next_turn_ttl);
            c.keep_for_next_turn(&request, blocks, tokens, ttl, &params)
        })?;
        params_to(py, &answer)
    }

    /// P, bidirectional: reads the previous turns' KV from the D that kept it.
    #[pyo3(signature = (request_id, block_ids, kv_transfer_params, num_tokens = None))]
    fn next_turn_allocated(
        &self,
        py: Python<'_>,
        request_id: &str,
        block_ids: &Bound<'_, PyAny>,
        kv_transfer_params: &Bound<'_, PyAny>,
        num_tokens: Option<u64>,
    ) -> PyResult<()> {
        let (request, blocks, params, tokens) =
            self.call_args(request_id, block_ids, Some(kv_transfer_params), num_tokens)?;
        self.with_connector(py, |c| {
            c.next_turn_allocated(&request, blocks, tokens, &params)
        })
    }

    /// Reader: will not read the export the params describe; the holder lets it go.
    fn decline_export(
        &self,
        py: Python<'_>,
        request_id: &str,
        kv_transfer_params: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let request = parse_request(request_id)?;
        let params = params_from(Some(kv_transfer_params))?;
        self.with_connector(py, |c| c.decline_export(&request, &params))
    }

    /// Either side: the engine aborted `request_id`; its blocks come back in its final event.
    fn abort(&self, py: Python<'_>, request_id: &str) -> PyResult<()> {
        let request = parse_request(request_id)?;
        self.with_connector(py, |c| c.abort(&request))
    }

    /// Every event since the last call (never waits).
    fn poll_events<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let events = self.with_connector(py, |c| Ok(c.poll_events()))?;
        Self::events_to(py, &events)
    }

    /// Waits (GIL released) up to `timeout_s` for at least one event; returns all queued.
    fn wait_events<'py>(&self, py: Python<'py>, timeout_s: f64) -> PyResult<Bound<'py, PyList>> {
        if !timeout_s.is_finite() || !(0.0..=1.0e7).contains(&timeout_s) {
            return Err(config(format!(
                "timeout_s must be finite and not negative (got {timeout_s})"
            )));
        }
        if self.closed() {
            return Err(errors::closed());
        }
        let deadline = Instant::now() + Duration::from_secs_f64(timeout_s);
        // Waits in short slices, each under the lock, so that other threads' calls get in.
        let events = outside(py, || -> PyResult<Vec<ConnectorEvent>> {
            loop {
                let slice = deadline
                    .saturating_duration_since(Instant::now())
                    .min(Duration::from_millis(5));
                let events = {
                    let mut guard = self.locked()?;
                    let rank = guard.as_mut().ok_or_else(errors::closed)?;
                    rank.connector_mut().wait_events(slice)
                };
                if !events.is_empty() || Instant::now() >= deadline {
                    return Ok(events);
                }
            }
        })?;
        Self::events_to(py, &events)
    }

    /// True while a request accepted here has not had its final event (and the rank runs).
    /// False once closed: nothing more can come.
    fn has_pending_work(&self, py: Python<'_>) -> PyResult<bool> {
        if self.closed() {
            return Ok(false);
        }
        self.with_connector(py, |c| Ok(c.has_pending_work()))
    }

    /// Copies `data` (one whole block) into block `block` of region `region`.
    fn write_block(&self, py: Python<'_>, region: usize, block: u32, data: &[u8]) -> PyResult<()> {
        let data = data.to_vec();
        if self.closed() {
            return Err(errors::closed());
        }
        outside(py, || {
            let guard = self.locked()?;
            let rank = guard.as_ref().ok_or_else(errors::closed)?;
            rank.kv()
                .write_block(region, block, &data)
                .map_err(errors::cache)
        })
    }

    /// A copy of block `block` of region `region`.
    fn read_block<'py>(
        &self,
        py: Python<'py>,
        region: usize,
        block: u32,
    ) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
        if self.closed() {
            return Err(errors::closed());
        }
        let bytes = outside(py, || {
            let guard = self.locked()?;
            let rank = guard.as_ref().ok_or_else(errors::closed)?;
            let len = rank.kv().block_len(region).map_err(errors::cache)?;
            let mut buf = vec![0u8; usize::try_from(len).map_err(|_| config("block too large"))?];
            rank.kv()
                .read_block(region, block, &mut buf)
                .map_err(errors::cache)?;
            Ok::<_, PyErr>(buf)
        })?;
        Ok(pyo3::types::PyBytes::new(py, &bytes))
    }

    /// Shuts the rank down: requests in progress give up (waiting up to the `close_timeout_ms`
    /// setting for their blocks to be safe), then the runtime stops and the regions' owners
    /// are released. Idempotent.
    fn close(&self, py: Python<'_>) {
        let taken = self
            .rank
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        let Some(mut rank) = taken else {
            return;
        };
        let timeout = self.close_timeout;
        outside(py, move || {
            let connector = rank.connector_mut();
            if connector.shutdown().is_ok() {
                let deadline = Instant::now() + timeout;
                while connector.has_pending_work() && Instant::now() < deadline {
                    connector.wait_events(Duration::from_millis(10));
                }
            }
            rank.shutdown();
        });
    }
}

impl Drop for NativeConnector {
    fn drop(&mut self) {
        if let Some(rank) = self
            .rank
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
        {
            rank.shutdown();
        }
    }
}
