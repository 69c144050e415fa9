"""The vLLM adapter's worker role, without vLLM: one native rank on vLLM's own KV tensors,
driven by the step metadata the scheduler role builds (:class:`WorkerSide`). Kept apart from the
scheduler role (``_vllm_sides``) because vLLM runs the two in different processes.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from ._vllm_sides import (
    _FINAL_KINDS,
    Handshake,
    RecvReq,
    SendReq,
    Settings,
    StepMetadata,
    TransferResults,
    _groups,
)

logger = logging.getLogger("kvhandoff.vllm")

#: This process's P-side native calls by kind (diagnostics: how requests were handed over,
#: whole or layer-wise). Read with :func:`handover_counts`.
_COUNTS = {"request_finished": 0, "prefill_started": 0, "layers_ready": 0}
#: How late the test fault ``late_export`` hands a step's exports to the rank: past a reader's
#: first asks, well inside the window in which it asks again (``register_retry_interval``).
_LATE_EXPORT_S = 1.0


def handover_counts() -> dict[str, int]:
    """How many ``request_finished`` (whole handovers), ``prefill_started`` (layer-wise ones)
    and ``layers_ready`` calls this process's P workers made."""
    return dict(_COUNTS)


def _default_factory(settings: Settings, regions: list[Any], block_bytes: int, rank: int) -> Any:
    import kvhandoff  # the native extension: needed only once a worker registers its caches

    kwargs: dict[str, Any] = dict(
        regions=regions,
        block_bytes=block_bytes,
        rank=rank,
        listen=settings.listen,
        transport=settings.transport,
        block_tokens=settings.block_tokens,
        model=settings.model,
        dtype=settings.dtype,
        accept_any=settings.role == "prefill",
        load_failure_policy=settings.load_failure_policy,
    )
    if settings.advertise_host is not None:
        kwargs["advertise_host"] = settings.advertise_host
    kwargs.update(settings.native)
    return kvhandoff.Connector(settings.role, settings.engine_id, **kwargs)


class WorkerSide:
    """The worker role: one native rank on vLLM's own KV tensors, driven by the step metadata."""

    def __init__(
        self,
        settings: Settings,
        rank: int = 0,
        factory: Callable[[Settings, list[Any], int, int], Any] = _default_factory,
    ) -> None:
        self.settings = settings
        self.rank = rank
        self.factory = factory
        self.native: Any = None
        self.layers: list[Any] = []
        self.block_bytes = 0
        self.sending: dict[str, SendReq] = {}
        self.recving: dict[str, RecvReq] = {}
        self.declined: set[str] = set()
        self.failed: set[str] = set()  # D requests whose receive did not load
        self.told_failed: set[str] = set()  # ... and vLLM was told so before their blocks came back
        self._results = TransferResults()
        self._done_meta: StepMetadata | None = None
        self.mismatches = 0
        # P, layer-wise: each KV layer's index (register_kv_caches' order, the regions'), the
        # requests started this step (-> layers reported), the layers saved this step, the
        # started requests the scheduler has not yet finished (their blocks must not be
        # reported free before it did), and those among them whose final event already came.
        self.layer_index: dict[str, int] = {}
        self.producing: dict[str, int] = {}
        self._saved: set[int] = set()
        self.unconfirmed: set[str] = set()
        self.ended_unconfirmed: set[str] = set()

    # -- start-up ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        layers = list(kv_caches.values())
        if not layers:
            raise ValueError("KvHandoffConnector: no KV cache layers to register")
        first = layers[0]
        block_bytes = int(first[0].numel() * first.element_size())
        for name, t in kv_caches.items():
            if str(getattr(t, "device", "cpu")) != "cpu":
                raise ValueError(f"KvHandoffConnector: layer {name} is on {t.device}; host memory only")
            if not t.is_contiguous():
                raise ValueError(f"KvHandoffConnector: layer {name}'s KV tensor is not contiguous")
            if int(t[0].numel() * t.element_size()) != block_bytes:
                raise ValueError(f"KvHandoffConnector: layer {name}'s blocks differ in size from the first layer's")
            if int(t.numel() * t.element_size()) != int(t.shape[0]) * block_bytes:
                raise ValueError(f"KvHandoffConnector: layer {name} is not [num_blocks, ...]")
        self.layers = layers
        self.layer_index = {name: i for i, name in enumerate(kv_caches)}
        self.block_bytes = block_bytes
        # One region per layer, no copy: block b of layer l is the b-th block_bytes slice.
        self.native = self.factory(self.settings, layers, block_bytes, self.rank)
        logger.info(
            "KvHandoffConnector worker: %s rank %d on %d layers x %d blocks of %d bytes at %s",
            self.settings.role,
            self.rank,
            len(layers),
            int(first.shape[0]),
            block_bytes,
            self.native.address,
        )

    def handshake(self) -> Handshake | None:
        if self.native is None:
            return None
        host, _, port = str(self.native.address).rpartition(":")
        return Handshake(str(self.native.engine_id), host.strip("[]"), int(port), self.rank)

    # -- each step ---------------------------------------------------------------------------

    def process(self, meta: StepMetadata | None) -> None:
        """Makes the native calls for ``meta`` (once per step, whichever hook comes first)."""
        if meta is None or meta is self._done_meta:
            return
        self._done_meta = meta
        if meta.is_empty():
            return
        if meta.starts:
            self._saved = set()
        for req in meta.starts:  # first: the forward pass reports their layers
            self._start(req)
        for req in meta.recvs:
            self._allocated(req)
        for rid, params in meta.declines:
            self._decline(rid, params)
        if any(self._fault(req) == "late_export" for req in meta.sends):
            # Test only: the worker hands this step's exports over late, as a worker stalled
            # or behind its scheduler would. The router, and D, have P's answer already, so
            # D's first asks find nothing under the key yet.
            logger.warning("KvHandoffConnector P: fault=late_export: exports %.1f s late", _LATE_EXPORT_S)
            time.sleep(_LATE_EXPORT_S)
        for req in meta.sends:
            self._finished(req)
        for rid in meta.aborts:
            self._abort(rid)
        for rid in meta.confirmed:
            self.unconfirmed.discard(rid)
            if rid in self.ended_unconfirmed:
                self.ended_unconfirmed.discard(rid)
                self._results.finished_sending.add(rid)

    def _fault(self, req: SendReq) -> str | None:
        """The test fault for P request ``req``: the extra config's, or with ``params`` the
        router's choice for the request (test only)."""
        fault = self.settings.fault
        if fault == "params":
            fault = req.params.get("kvhandoff_fault") or None
        return fault

    # -- P, layer-wise ----------------------------------------------------------------------

    def _start(self, req: SendReq) -> None:
        rid = req.request_id
        fault = self._fault(req)
        self.sending[rid] = req
        self.unconfirmed.add(rid)
        try:
            _COUNTS["prefill_started"] += 1
            answer = self.native.prefill_started(rid, req.block_ids, req.params, req.num_tokens)
        except Exception as e:  # noqa: BLE001
            if type(e).__name__ == "VerdictLate":
                logger.warning("KvHandoffConnector P: %s: late verdict; its event will tell", rid)
                return
            logger.error(
                "KvHandoffConnector P: prefill_started(%s, %s, %s, %d) failed: %s: %s",
                rid, req.block_ids, req.params, req.num_tokens, type(e).__name__, e,
            )
            self.sending.pop(rid, None)
            self._ended(rid)  # nothing holds the blocks: free them once the scheduler let go
            return
        self._check_answer(rid, req.answer, answer)
        self.producing[rid] = 0
        if fault == "drop":
            logger.warning("KvHandoffConnector P: fault=drop: aborting %s", rid)
            self._abort(rid)

    def layer_saved(self, layer_name: str) -> None:
        """The forward pass wrote layer ``layer_name`` of this step: reports the layers done so
        far (the longest run from layer 0) for the requests started this step."""
        if not self.producing:
            return
        index = self.layer_index.get(layer_name)
        if index is None:
            return
        self._saved.add(index)
        ready = 0
        while ready in self._saved:
            ready += 1
        self._report(ready)

    def forward_done(self) -> None:
        """The step's forward pass is over (``wait_for_save``): every layer of the requests
        started this step is written, whatever ``save_kv_layer`` saw."""
        if self.producing:
            self._report(len(self.layers))
        self.producing.clear()
        self._saved = set()

    def _report(self, ready: int) -> None:
        for rid, told in list(self.producing.items()):
            if ready <= told:
                continue
            self.producing[rid] = ready
            try:
                _COUNTS["layers_ready"] += 1
                self.native.layers_ready(rid, ready)
            except Exception as e:  # noqa: BLE001
                # E.g. Rejected: a late verdict refused the start; its event tells the rest.
                logger.warning("KvHandoffConnector P: layers_ready(%s, %d): %s: %s",
                               rid, ready, type(e).__name__, e)
                self.producing.pop(rid, None)
                continue
            if ready >= len(self.layers):
                self.producing.pop(rid, None)

    def _ended(self, rid: str) -> None:
        """A P request's blocks are back from the rank: reported in finished_sending, but for a
        layer-wise request only once the scheduler finished it (vLLM frees what is reported)."""
        if rid in self.unconfirmed:
            self.ended_unconfirmed.add(rid)
        else:
            self._results.finished_sending.add(rid)

    def _allocated(self, req: RecvReq) -> None:
        self.recving[req.request_id] = req
        try:
            self.native.request_allocated(req.request_id, req.block_ids, req.params, req.num_tokens)
        except Exception as e:  # noqa: BLE001
            if type(e).__name__ == "VerdictLate":
                logger.warning("KvHandoffConnector D: %s: late verdict; its event will tell", req.request_id)
                return
            logger.error(
                "KvHandoffConnector D: request_allocated(%s, %s, %s, %d) failed: %s: %s",
                req.request_id, req.block_ids, req.params, req.num_tokens, type(e).__name__, e,
            )
            self.recving.pop(req.request_id, None)
            self._results.finished_recving.add(req.request_id)
            self._results.failed_recving.add(req.request_id)

    def _decline(self, rid: str, params: dict[str, Any]) -> None:
        try:
            if str(params.get("transfer_mode") or "push").lower() == "pull":
                self.native.decline_export(rid, params)
            else:
                # An empty allocation: the rank answers at once and tells P to free its copy.
                self.declined.add(rid)
                self.native.request_allocated(rid, [[]], params, 0)
        except Exception as e:  # noqa: BLE001
            self.declined.discard(rid)
            logger.warning("KvHandoffConnector D: letting P go for %s failed: %s: %s", rid, type(e).__name__, e)

    def _finished(self, req: SendReq) -> None:
        rid = req.request_id
        fault = self._fault(req)
        if fault == "corrupt":
            logger.warning("KvHandoffConnector P: fault=corrupt: overwriting %s's blocks", rid)
            self._corrupt(req.block_ids)
        self.sending[rid] = req
        try:
            _COUNTS["request_finished"] += 1
            answer = self.native.request_finished(rid, req.block_ids, req.params, req.num_tokens)
        except Exception as e:  # noqa: BLE001
            if type(e).__name__ == "VerdictLate":
                logger.warning("KvHandoffConnector P: %s: late verdict; its event will tell", rid)
                return
            logger.error(
                "KvHandoffConnector P: request_finished(%s, %s, %s, %d) failed: %s: %s",
                rid, req.block_ids, req.params, req.num_tokens, type(e).__name__, e,
            )
            self.sending.pop(rid, None)
            self._results.finished_sending.add(rid)  # nothing holds the blocks: free them
            return
        self._check_answer(rid, req.answer, answer)
        if fault == "drop":
            logger.warning("KvHandoffConnector P: fault=drop: aborting %s", rid)
            self._abort(rid)

    def _check_answer(self, rid: str, ours: dict[str, Any], native: Any) -> None:
        if not isinstance(native, dict):
            return
        keys = ["remote_engine_id", "remote_host", "remote_port", "remote_request_id", "transfer_id"]
        if "remote_block_ids" in native or "remote_block_ids" in ours:
            keys.append("remote_block_ids")
        diff = {}
        for k in keys:
            a, b = ours.get(k), native.get(k)
            if k == "remote_block_ids":
                a, b = _groups(a), _groups(b)
            if a != b:
                diff[k] = (a, b)
        if diff:
            self.mismatches += 1
            logger.error(
                "KvHandoffConnector P: %s: the scheduler's kv_transfer_params differ from the rank's: %s",
                rid, diff,
            )

    def _corrupt(self, block_ids: list[list[int]]) -> None:
        import torch

        gen = torch.Generator().manual_seed(1234)
        for layer in self.layers:
            for group in block_ids:
                for b in group:
                    blk = layer[b]
                    if blk.is_floating_point():
                        blk.copy_(torch.randn(blk.shape, generator=gen, dtype=blk.dtype))
                    else:
                        blk.copy_(torch.randint(-128, 127, blk.shape, generator=gen, dtype=blk.dtype))

    def _abort(self, rid: str) -> None:
        if rid not in self.recving and rid not in self.sending:
            return  # already handed back (its final event came first): nothing to abort
        if rid in self.told_failed:
            return  # fenced: already failing; its final event hands the blocks back
        try:
            self.native.abort(rid)
        except Exception as e:  # noqa: BLE001
            # E.g. Rejected: the request ended meanwhile; its final event is on its way.
            logger.warning("KvHandoffConnector: abort(%s): %s: %s", rid, type(e).__name__, e)

    def get_transfer_results(self) -> TransferResults:
        """The requests whose blocks came back since the last call (polls, never blocks)."""
        if self.native is not None and (self.sending or self.recving or self.declined):
            for ev in self.native.poll_events():
                self._on_event(ev)
        out, self._results = self._results, TransferResults()
        return out

    def _on_event(self, ev: dict[str, Any]) -> None:
        rid = ev.get("request_id")
        kind = ev.get("kind")
        final = ev.get("final")
        if final is None:
            final = kind in _FINAL_KINDS
        if rid in self.recving:
            if kind in ("failed", "decode_fenced", "refused") or (
                kind == "imported" and ev.get("outcome") not in (None, "loaded")
            ):
                if rid not in self.failed:
                    logger.warning(
                        "KvHandoffConnector D: %s did not load: %s (%s)", rid, kind,
                        ev.get("reason") or ev.get("outcome"),
                    )
                self.failed.add(rid)
            if rid in self.failed and not final and rid not in self.told_failed:
                # Fenced: the request failed, but its blocks stay out of use until the final
                # "failed" (a write from the old P could still land). vLLM is told the failure
                # now (failed_recving alone: under "fail" the request ends at once with its
                # blocks held), and the blocks go back with finished_recving later.
                self.told_failed.add(rid)
                self._results.failed_recving.add(rid)
            if final:
                self.recving.pop(rid, None)
                self.told_failed.discard(rid)
                self._results.finished_recving.add(rid)
                if rid in self.failed:
                    self.failed.discard(rid)
                    self._results.failed_recving.add(rid)
        elif rid in self.sending:
            if kind == "blocks_free" and ev.get("released"):
                logger.warning("KvHandoffConnector P: %s released without sending: %s", rid, ev.get("released"))
            if final:
                self.sending.pop(rid, None)
                self.producing.pop(rid, None)
                self._ended(rid)
        elif rid in self.declined:
            if final:
                self.declined.discard(rid)
        else:
            logger.debug("KvHandoffConnector: event for an unknown request: %s", ev)

    def has_pending_work(self) -> bool:
        return bool(self.sending or self.recving)

    def close(self) -> None:
        if self.native is not None:
            try:
                self.native.close()
            except Exception as e:  # noqa: BLE001
                logger.warning("KvHandoffConnector: close: %s", e)
