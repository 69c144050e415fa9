"""A vLLM KV connector on kvhandoff: ``kvhandoff.vllm.KvHandoffConnector``.

Load it with (vLLM 0.32.0)::

    LLM(..., kv_transfer_config={
        "kv_connector": "KvHandoffConnector",
        "kv_connector_module_path": "kvhandoff.vllm",
        "kv_role": "kv_producer",              # P; "kv_consumer" on D
        "kv_connector_extra_config": {},       # optional, see below
    })

The router does what vLLM's P/D proxy does: it sends the prompt to P with ``max_tokens=1`` and
``kv_transfer_params={"do_remote_decode": True}`` (plus ``"transfer_mode": "pull"`` to have D
read P's export instead of P writing into D's blocks, and optionally a ``transfer_id``), then
the same prompt to D with the ``kv_transfer_params`` P's output returned.

How the hooks map onto kvhandoff (the asynchronous paths vLLM's NIXL connector uses):

- P, scheduler: ``request_finished`` of a ``do_remote_decode`` request that finished (length
  capped or stopped) returns ``(True, params)``: P's worker rank (engine id, side-channel
  host and port, learnt through vLLM's handshake-metadata path), P's request id, and a
  ``transfer_id`` (the router's, else P's request id) that pairs the two sides. The next step's
  metadata hands the request to P's worker, which calls the native ``request_finished``; the
  blocks are freed when the rank's ``blocks_free`` / ``export_ended`` event came back
  (``finished_sending``). ``has_pending_push_work`` keeps P stepping meanwhile.
- P with ``"layerwise": true``, a push prefill leg (``max_tokens`` 1): ``build_connector_meta``
  of the step that schedules the prompt's last chunk hands the request (its blocks, params,
  token count and the answer) to the worker, which calls the native ``prefill_started`` before
  the first layer and ``layers_ready(request, i + 1)`` from ``save_kv_layer`` of layer ``i``
  (``register_kv_caches``' order; ``wait_for_save`` reports the rest). ``request_finished``
  returns that answer (``(True, None)`` and an abort on the rank if the request ended
  otherwise) without calling the rank again; the next step's metadata tells the worker, which
  only then reports the rank's ``blocks_free`` in ``finished_sending``: vLLM frees whatever is
  named there, and must not free a request it has not finished.
- D, scheduler: ``get_num_new_matched_tokens`` answers ``(prompt - computed, True)`` for a
  ``do_remote_prefill`` request; ``update_state_after_alloc`` records the blocks and clears
  ``do_remote_prefill``; the worker calls the native ``request_allocated``; the request
  finishes receiving on ``blocks_ready`` / ``imported`` (``finished_recving``), and a
  ``failed`` event (or an import that did not load) is also reported in ``failed_recving``,
  which vLLM 0.32's scheduler treats per ``kv_load_failure_policy`` (``fail``: the request
  ends with ``FINISHED_ERROR``; ``recompute``: it is recomputed from scratch). A request the
  rank fences (``decode_fenced``: its P died after D registered) is reported in
  ``failed_recving`` at once but in ``finished_recving`` (which frees its blocks) only with
  its final ``failed`` event, when no write from the old P can land any more.
- Aborts: a D request aborted while waiting for its KV is aborted on the rank; its blocks are
  freed when the rank's final event came back. A D request aborted before it got blocks lets
  P go (push: an empty allocation, which the rank answers at once; pull: ``decline_export``).
  A P request that ended otherwise than by length or stop was never handed to the rank: its
  blocks are freed at once and no parameters are returned.

``kv_connector_extra_config`` keys, all optional: ``transport`` (``"nixl"``, default, or
``"mem"``), ``listen`` (default ``"127.0.0.1:0"``), ``advertise_host``, ``engine_id`` (default:
vLLM's ``engine_id``), ``model``, ``dtype``, ``layerwise`` (P: ``true`` or ``false``, the
default), any of the native connector's settings (``layerwise_parts``,
``layerwise_min_tokens``, ``lease_ms``, ``quarantine_ms``, ``peer_timeout_ms``,
``heartbeat_interval_ms``, ``handshake_timeout_ms``, ``call_timeout_ms``, ... : see ``kvhandoff.Connector``; an unknown key
is an error naming it), and, for tests only, ``fault``: ``"corrupt"`` (P's worker
overwrites the request's blocks with random values just before handing them over) or
``"drop"`` (P's worker hands the request over and aborts it at once, so D's load fails), or
``"params"`` (each request's ``kvhandoff_fault`` key in the router's params picks one of those).

The module imports without vLLM (the mapping lives in :class:`SchedulerSide` and
:class:`WorkerSide`, which tests drive with fakes); :class:`KvHandoffConnector` exists only
when vLLM is importable.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from ._vllm_sides import (
    HAVE_VLLM,
    Handshake,
    KVConnectorTransferResults,
    SchedulerSide,
    Settings,
    StepMetadata,
    TransferResults,
    _Base,
    _Role,
)
from ._vllm_worker import WorkerSide, _default_factory, handover_counts

logger = logging.getLogger("kvhandoff.vllm")

__all__ = [
    "HAVE_VLLM",
    "Settings",
    "Handshake",
    "StepMetadata",
    "SchedulerSide",
    "WorkerSide",
    "TransferResults",
    "KvHandoffHooks",
    "KvHandoffConnector",
    "handover_counts",
]

# --------------------------------------------------------------------------------------------
# The vLLM connector
# --------------------------------------------------------------------------------------------


def _settings_from_vllm(vllm_config: Any) -> Settings:
    kvc = vllm_config.kv_transfer_config
    model_config = getattr(vllm_config, "model_config", None)
    cache_config = getattr(vllm_config, "cache_config", None)
    parallel = getattr(vllm_config, "parallel_config", None)
    return Settings.from_config(
        kvc.kv_role,
        getattr(kvc, "engine_id", None),
        getattr(kvc, "kv_connector_extra_config", None),
        load_failure_policy=getattr(kvc, "kv_load_failure_policy", None),
        block_tokens=getattr(cache_config, "block_size", None),
        tp_size=int(getattr(parallel, "tensor_parallel_size", 1) or 1),
        model=str(getattr(model_config, "model", "opaque")),
        dtype=str(getattr(model_config, "dtype", "opaque")),
    )


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001
        return 0


class KvHandoffHooks:
    """vLLM's connector hooks on :class:`SchedulerSide` / :class:`WorkerSide`, without vLLM
    (:class:`KvHandoffConnector` adds vLLM's base class; tests drive this one with fakes)."""

    scheduler: SchedulerSide | None
    worker: WorkerSide | None
    _connector_metadata: Any

    def _init_hooks(
        self,
        settings: Settings,
        scheduler_role: bool,
        rank: int = 0,
        factory: Callable[[Settings, list[Any], int, int], Any] | None = None,
    ) -> None:
        self.settings = settings
        self.scheduler = SchedulerSide(settings) if scheduler_role else None
        self.worker = (
            None if scheduler_role else WorkerSide(settings, rank=rank, factory=factory or _default_factory)
        )
        if not hasattr(self, "_connector_metadata"):
            self._connector_metadata = None

    # -- scheduler -----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> StepMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        assert self.scheduler is not None
        self.scheduler.update_connector_output(
            getattr(connector_output, "finished_sending", None),
            getattr(connector_output, "finished_recving", None),
        )

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_pending_work()

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        if self.scheduler is not None:
            self.scheduler.set_handshake(metadata)

    # -- worker --------------------------------------------------------------------------

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> Handshake | None:
        return None if self.worker is None else self.worker.handshake()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self.worker is not None
        self.worker.process(self._connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # whole requests arrive before they are scheduled: nothing per layer

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        # Whole requests are handed over after they finished; layer-wise ones (P with
        # ``layerwise``) report each layer as the forward pass writes it.
        meta = self._connector_metadata
        if self.worker is None or (not self.worker.producing and not (meta is not None and meta.starts)):
            return
        if meta is not None and meta.starts:
            self.worker.process(meta)  # the starts go before the first layer's report
        self.worker.layer_saved(layer_name)

    def wait_for_save(self) -> None:
        if self.worker is not None:
            self.worker.process(self._connector_metadata)
            self.worker.forward_done()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self.worker is not None
        r = self.worker.get_transfer_results()
        if r.failed_recving:
            logger.error("KvHandoffConnector: failed receives %s reported as finished only", r.failed_recving)
        return (r.finished_sending or None), (r.finished_recving or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        assert self.worker is not None
        r = self.worker.get_transfer_results()
        if KVConnectorTransferResults is None:
            return r
        return KVConnectorTransferResults(
            finished_sending=r.finished_sending,
            finished_recving=r.finished_recving,
            failed_recving=r.failed_recving,
        )

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()


if HAVE_VLLM:

    class KvHandoffConnector(KvHandoffHooks, _Base):  # type: ignore[misc,valid-type]
        """vLLM 0.32's KV connector on kvhandoff (see the module's docstring)."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            _Base.__init__(self, vllm_config, role, kv_cache_config)
            self._init_hooks(_settings_from_vllm(vllm_config), role == _Role.SCHEDULER, rank=_tp_rank())

else:  # pragma: no cover - without vLLM there is no connector class to load

    class KvHandoffConnector:  # type: ignore[no-redef]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise ImportError("kvhandoff.vllm.KvHandoffConnector needs vLLM (0.32.0)")
