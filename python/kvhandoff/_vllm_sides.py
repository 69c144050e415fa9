"""The vLLM adapter's mapping, without vLLM: its settings, what travels between vLLM's scheduler
and worker roles, and the two roles' logic (:class:`SchedulerSide`, :class:`WorkerSide`).
``kvhandoff.vllm`` puts vLLM's connector class on top; tests drive these with fakes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

logger = logging.getLogger("kvhandoff.vllm")

try:  # vLLM is optional: the mapping below runs without it.
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1 as _Base,
        KVConnectorHandshakeMetadata as _HandshakeBase,
        KVConnectorMetadata as _MetadataBase,
        KVConnectorRole as _Role,
    )

    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
    except ImportError:  # before vLLM 0.32
        KVConnectorTransferResults = None  # type: ignore[assignment,misc]
    HAVE_VLLM = True
except Exception:  # noqa: BLE001 - any failure to import vLLM means "no vLLM"
    _Base = None  # type: ignore[assignment,misc]
    _Role = None  # type: ignore[assignment]
    KVConnectorTransferResults = None  # type: ignore[assignment,misc]

    class _HandshakeBase:  # type: ignore[no-redef]
        pass

    class _MetadataBase:  # type: ignore[no-redef]
        pass

    HAVE_VLLM = False


# The statuses of a P request whose prefill really finished (vLLM's RequestStatus names).
_FINISHED_OK = frozenset({"FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED"})
# The events that hand a request's blocks back (when ``final`` is missing from an event).
_FINAL_KINDS = frozenset({"blocks_ready", "failed", "blocks_free", "export_ended", "imported", "refused"})
_FAULTS = (None, "", "corrupt", "drop", "params")
#: The adapter's side-channel handshake timeout unless the extra config sets one.
_HANDSHAKE_TIMEOUT_MS = 30_000
# The extra-config keys the adapter reads itself, and those it passes to the native connector.
_ADAPTER_KEYS = frozenset({
    "transport", "listen", "advertise_host", "engine_id", "model", "dtype", "fault", "layerwise",
})


#: This process's P-side native calls by kind (diagnostics: how requests were handed over,
#: whole or layer-wise). Read with :func:`handover_counts`.
_COUNTS = {"request_finished": 0, "prefill_started": 0, "layers_ready": 0}


def handover_counts() -> dict[str, int]:
    """How many ``request_finished`` (whole handovers), ``prefill_started`` (layer-wise ones)
    and ``layers_ready`` calls this process's P workers made."""
    return dict(_COUNTS)


def _status_name(status: Any) -> str:
    return getattr(status, "name", None) or str(status).rsplit(".", 1)[-1]


def _groups(block_ids: Any) -> list[list[int]]:
    """vLLM's block ids (a flat list, or a tuple of per-group lists) as a list of lists."""
    ids = list(block_ids or [])
    if ids and isinstance(ids[0], (list, tuple)):
        return [[int(b) for b in g] for g in ids]
    return [[int(b) for b in ids]]


# --------------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------------


@dataclass
class Settings:
    """What the connector reads from vLLM's config (``kv_transfer_config`` and its
    ``kv_connector_extra_config``)."""

    role: str  # "prefill" or "decode"
    engine_id: str
    transport: str = "nixl"
    listen: str = "127.0.0.1:0"
    advertise_host: str | None = None
    #: The native connector's own settings (``lease_ms``, ``quarantine_ms``, ...), passed on.
    native: dict[str, Any] = field(default_factory=dict)
    load_failure_policy: str = "fail"
    block_tokens: int = 16
    tp_size: int = 1
    model: str = "opaque"
    dtype: str = "opaque"
    fault: str | None = None
    #: P: hand push requests over layer-wise (the native ``prefill_started``/``layers_ready``)
    #: instead of whole after the prefill. Ignored on D (which needs nothing for it).
    layerwise: bool = False

    @classmethod
    def from_config(
        cls,
        kv_role: str,
        engine_id: str | None,
        extra: dict[str, Any] | None,
        *,
        load_failure_policy: str | None = None,
        block_tokens: int | None = None,
        tp_size: int = 1,
        model: str | None = None,
        dtype: str | None = None,
    ) -> "Settings":
        extra = dict(extra or {})
        if kv_role == "kv_producer":
            role = "prefill"
        elif kv_role == "kv_consumer":
            role = "decode"
        else:
            raise ValueError(
                f"KvHandoffConnector: kv_role {kv_role!r} is not supported: use kv_producer (P) "
                "or kv_consumer (D)"
            )
        fault = extra.get("fault") or None
        if fault not in _FAULTS:
            raise ValueError(f"KvHandoffConnector: fault {fault!r} is none of corrupt, drop, params")
        layerwise = extra.get("layerwise", False)
        if not isinstance(layerwise, bool):
            raise ValueError(f"KvHandoffConnector: layerwise must be true or false (got {layerwise!r})")
        eid = extra.get("engine_id") or engine_id
        if not eid:
            raise ValueError("KvHandoffConnector: no engine_id (neither vLLM's nor extra config's)")

        # Every setting the native connector takes (its own list, so the two cannot drift
        # apart); the native layer checks each value, naming the key. Without the extension (the
        # adapter's logic tested alone) every other key is passed on, for the native connector
        # to refuse when the rank starts.
        try:
            from ._native import SETTING_KEYS

            native_keys = frozenset(SETTING_KEYS)
        except ImportError:
            native_keys = frozenset(extra) - _ADAPTER_KEYS
        unknown = sorted(set(extra) - _ADAPTER_KEYS - native_keys)
        if unknown:
            raise ValueError(
                f"KvHandoffConnector: unknown kv_connector_extra_config key(s) {unknown}; known: "
                f"{sorted(_ADAPTER_KEYS | native_keys)}"
            )
        native = {k: v for k, v in extra.items() if k in native_keys and v is not None}
        # The first request to a new peer waits for the side-channel handshake (NIXL metadata
        # loaded on both sides); on a loaded host that took more than the runtime's 5 s default
        # (python/tests/vllm_pd/serve_pd.py, three vLLM servers on 2 cores), failing the request.
        # A default beneath a settings file and the environment, which may override it.
        defaults = native.get("defaults", {})
        if not isinstance(defaults, dict):
            raise ValueError(f"KvHandoffConnector: defaults must be an object (got {defaults!r})")
        native["defaults"] = {"handshake_timeout_ms": _HANDSHAKE_TIMEOUT_MS, **defaults}

        return cls(
            role=role,
            engine_id=str(eid),
            transport=str(extra.get("transport", "nixl")),
            listen=str(extra.get("listen", "127.0.0.1:0")),
            advertise_host=extra.get("advertise_host"),
            native=native,
            load_failure_policy=load_failure_policy or "fail",
            block_tokens=int(block_tokens or 16),
            tp_size=int(tp_size),
            model=str(extra.get("model", model or "opaque")),
            dtype=str(extra.get("dtype", dtype or "opaque")),
            fault=fault,
            layerwise=layerwise,
        )

    def static_address(self) -> tuple[str, int] | None:
        """The side channel's address when ``listen`` names a fixed port (the fallback when
        vLLM hands the scheduler no handshake metadata)."""
        host, _, port = self.listen.rpartition(":")
        if not port.isdigit() or int(port) == 0:
            return None
        return (self.advertise_host or host.strip("[]") or "127.0.0.1", int(port))


# --------------------------------------------------------------------------------------------
# What travels between the roles
# --------------------------------------------------------------------------------------------


@dataclass
class Handshake(_HandshakeBase):
    """A worker rank's side channel, from the worker to the scheduler (vLLM's
    ``get_handshake_metadata`` → ``set_xfer_handshake_metadata``)."""

    engine_id: str
    host: str
    port: int
    rank: int = 0


@dataclass
class SendReq:
    request_id: str
    block_ids: list[list[int]]
    params: dict[str, Any]  # what the worker passes to the native request_finished
    num_tokens: int
    answer: dict[str, Any]  # what the scheduler returned to the router


@dataclass
class RecvReq:
    request_id: str
    block_ids: list[list[int]]
    params: dict[str, Any]
    num_tokens: int


@dataclass
class StepMetadata(_MetadataBase):
    """The scheduler's orders for one step of the worker."""

    sends: list[SendReq] = field(default_factory=list)
    recvs: list[RecvReq] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    declines: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    #: P, layer-wise: requests whose prefill completes in this step (the native
    #: ``prefill_started`` before the forward pass, ``layers_ready`` as it goes).
    starts: list[SendReq] = field(default_factory=list)
    #: P, layer-wise: started requests the scheduler has since finished with their blocks
    #: held: only now may the worker report them in ``finished_sending`` (vLLM frees the
    #: blocks of whatever it names there, and a request still running must keep them).
    confirmed: list[str] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.sends or self.recvs or self.aborts or self.declines or self.starts
                    or self.confirmed)


@dataclass
class TransferResults:
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


# --------------------------------------------------------------------------------------------
# Scheduler side
# --------------------------------------------------------------------------------------------


class SchedulerSide:
    """The scheduler role's bookkeeping, on vLLM-like request objects (``request_id``,
    ``kv_transfer_params``, ``prompt_token_ids``, ``num_computed_tokens``, ``status``)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.ranks: dict[int, Handshake] = {}
        self._sends: list[SendReq] = []
        self._recvs: list[RecvReq] = []
        self._aborts: list[str] = []
        self._declines: list[tuple[str, dict[str, Any]]] = []
        # P: requests whose blocks wait for finished_sending. D: requests waiting for their KV.
        self.sending: set[str] = set()
        self.recving: set[str] = set()
        self.aborted_recving: set[str] = set()
        # P, layer-wise: push requests that may start layer-wise (request objects, and their
        # blocks as the scheduler's outputs gave them), and those started (what the worker was
        # told, and the answer request_finished returns).
        self._lw_candidates: dict[str, tuple[Any, list[list[int]]]] = {}
        self.started: dict[str, SendReq] = {}
        self._starts: list[SendReq] = []
        self._confirmed: list[str] = []

    # -- the worker's address ---------------------------------------------------------------

    def set_handshake(self, metadata: dict[Any, Any]) -> None:
        for key, meta in (metadata or {}).items():
            if meta is None:
                continue
            rank = key[1] if isinstance(key, tuple) else int(key)
            if isinstance(meta, dict):
                meta = Handshake(**meta)
            self.ranks[int(rank)] = meta
        logger.info("KvHandoffConnector scheduler: worker ranks %s", self.ranks)

    def _here(self) -> tuple[str, str, int]:
        if 0 in self.ranks:
            h = self.ranks[0]
            return h.engine_id, h.host, int(h.port)
        static = self.settings.static_address()
        if static is None:
            raise RuntimeError(
                "KvHandoffConnector: the scheduler knows no worker side channel (no handshake "
                "metadata arrived and `listen` names no fixed port)"
            )
        return self.settings.engine_id, static[0], static[1]

    # -- matching and allocation -------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if self.settings.role == "decode" and params and params.get("do_remote_prefill"):
            count = len(request.prompt_token_ids or ()) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if self.settings.role == "prefill":
            self._lw_candidate(request, blocks)
            return
        if self.settings.role != "decode" or not params or not params.get("do_remote_prefill"):
            return
        if num_external_tokens <= 0:
            return  # nothing to receive (a full local hit): request_finished lets P go
        if hasattr(blocks, "get_unhashed_block_ids_all_groups"):
            block_ids = _groups(blocks.get_unhashed_block_ids_all_groups())
        else:
            block_ids = _groups(blocks)
        num_tokens = int(request.num_computed_tokens) + int(num_external_tokens)
        self._recvs.append(RecvReq(request.request_id, block_ids, dict(params), num_tokens))
        self.recving.add(request.request_id)
        params["do_remote_prefill"] = False  # consumed: no second load after a preemption

    # -- each step ---------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any = None) -> StepMetadata:
        if self._lw_candidates and scheduler_output is not None:
            self._lw_plan(scheduler_output)
        meta = StepMetadata(self._sends, self._recvs, self._aborts, self._declines,
                            self._starts, self._confirmed)
        self._sends, self._recvs, self._aborts, self._declines = [], [], [], []
        self._starts, self._confirmed = [], []
        return meta

    # -- P, layer-wise ----------------------------------------------------------------------

    def _lw_candidate(self, request: Any, blocks: Any) -> None:
        """Records a push request of a layer-wise P, to start when its prefill's last chunk
        is scheduled."""
        params = request.kv_transfer_params
        if not self.settings.layerwise or not params or not params.get("do_remote_decode"):
            return
        if str(params.get("transfer_mode") or "push").lower() != "push":
            return  # pull: P exports the blocks whole once the prefill finished
        fault = self.settings.fault
        if fault == "params":
            fault = params.get("kvhandoff_fault") or None
        if fault == "corrupt":
            return  # the test fault overwrites whole blocks before a whole-request handover
        # Only a prefill leg (max_tokens 1, as the router sends it) ends in the step its prefill
        # completes. A longer request could be preempted while its parts are written, and
        # vLLM frees a preempted request's blocks without telling the connector.
        sampling = getattr(request, "sampling_params", None)
        if sampling is not None and getattr(sampling, "max_tokens", 1) != 1:
            return
        if hasattr(blocks, "get_block_ids"):
            groups = _groups(blocks.get_block_ids())
        elif hasattr(blocks, "get_unhashed_block_ids_all_groups"):
            groups = _groups(blocks.get_unhashed_block_ids_all_groups())
        else:
            groups = _groups(blocks)
        self._lw_candidates[request.request_id] = (request, groups)

    def _lw_plan(self, out: Any) -> None:
        """Starts the candidates whose prefill completes in the step ``out`` schedules."""
        for new in getattr(out, "scheduled_new_reqs", None) or ():
            if new.req_id in self._lw_candidates:
                request, _ = self._lw_candidates[new.req_id]
                self._lw_candidates[new.req_id] = (request, _groups(new.block_ids))
        cached = getattr(out, "scheduled_cached_reqs", None)
        resumed = getattr(cached, "resumed_req_ids", None) or set()
        for i, rid in enumerate(getattr(cached, "req_ids", None) or ()):
            if rid not in self._lw_candidates or cached.new_block_ids[i] is None:
                continue
            request, groups = self._lw_candidates[rid]
            more = _groups(cached.new_block_ids[i])
            if rid in resumed:  # a resumed request's block ids are all of them
                groups = more
            else:
                groups = [g + m for g, m in zip(groups, more)] + more[len(groups):]
            self._lw_candidates[rid] = (request, groups)
        for rid in getattr(out, "finished_req_ids", None) or ():
            self._lw_candidates.pop(rid, None)
        scheduled = getattr(out, "num_scheduled_tokens", None) or {}
        for rid, (request, groups) in list(self._lw_candidates.items()):
            n = int(scheduled.get(rid, 0))
            prompt = int(getattr(request, "num_prompt_tokens", None) or len(request.prompt_token_ids or ()))
            computed = int(request.num_computed_tokens)  # before this step
            if n <= 0 or computed >= prompt or computed + n < prompt:
                continue  # not scheduled, or not its prefill's last chunk
            del self._lw_candidates[rid]
            # The prompt's blocks: what request_finished would be handed (blocks of computed
            # tokens), not a block allocated ahead for the token sampled after it.
            keep = -(-prompt // max(1, self.settings.block_tokens))
            groups = [g[:keep] for g in groups]
            if not any(groups):
                continue
            try:
                send = self._send(request, groups, prompt)
            except RuntimeError as e:
                logger.error("KvHandoffConnector P: %s: %s; handed over whole instead", rid, e)
                continue
            self.started[rid] = send
            self._starts.append(send)
            self.sending.add(rid)

    def _lw_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished`` of a request started layer-wise: the rank has had it since its
        prefill step; the blocks stay until the worker reports it in ``finished_sending``."""
        rid = request.request_id
        send = self.started.pop(rid)
        self._confirmed.append(rid)
        if _status_name(request.status) not in _FINISHED_OK:
            # Ended otherwise (aborted): let the rank go; its parts may still be reading.
            self._aborts.append(rid)
            return True, None
        given = _groups(block_ids)
        if [g[: len(s)] for g, s in zip(given, send.block_ids)] != send.block_ids:
            logger.error("KvHandoffConnector P: %s finished with blocks %s, started with %s",
                         rid, given, send.block_ids)
        return True, dict(send.answer)

    def update_connector_output(
        self, finished_sending: Iterable[str] | None, finished_recving: Iterable[str] | None
    ) -> None:
        for rid in finished_sending or ():
            self.sending.discard(rid)
            self.started.pop(rid, None)
        for rid in finished_recving or ():
            self.recving.discard(rid)
            self.aborted_recving.discard(rid)

    def has_pending_work(self) -> bool:
        return bool(self.sending or self.aborted_recving or self._sends or self._aborts
                    or self._starts or self._confirmed)

    # -- the end of a request ----------------------------------------------------------------

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        rid = request.request_id
        if not params:
            return False, None
        if self.settings.role == "decode":
            return self._decode_finished(request, params)
        if rid in self.started:
            return self._lw_finished(request, block_ids)
        self._lw_candidates.pop(rid, None)
        if not params.get("do_remote_decode"):
            return False, None
        status = _status_name(request.status)
        if status not in _FINISHED_OK:
            # Aborted (or failed) before its prefill finished: never handed to the rank.
            logger.debug("KvHandoffConnector P: %s ended %s; nothing to hand over", rid, status)
            return False, None
        groups = _groups(block_ids)
        if not any(groups):
            logger.warning("KvHandoffConnector P: %s finished with no blocks; nothing to hand over", rid)
            return False, None
        try:
            send = self._send(request, groups, int(request.num_computed_tokens))
        except RuntimeError as e:
            logger.error("KvHandoffConnector P: %s: %s; its blocks are freed, no params", rid, e)
            return False, None
        self._sends.append(send)
        self.sending.add(rid)
        return True, dict(send.answer)

    def _send(self, request: Any, groups: list[list[int]], num_tokens: int) -> SendReq:
        """What the worker hands the rank for a P request, with the answer the router gets
        (the rank's answer, which the worker checks against it: the scheduler cannot wait for
        the worker's)."""
        rid = request.request_id
        params = request.kv_transfer_params
        engine_id, host, port = self._here()
        mode = str(params.get("transfer_mode") or "push").lower()
        transfer_id = params.get("transfer_id") or rid
        worker_params = dict(params)
        worker_params["transfer_id"] = transfer_id
        answer: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": engine_id,
            "remote_host": host,
            "remote_port": port,
            "remote_request_id": rid,
            "tp_size": self.settings.tp_size,
            "transfer_id": transfer_id,
            "transfer_mode": mode,
            "remote_num_tokens": num_tokens,
        }
        if params.get("epoch") is not None:
            answer["epoch"] = params["epoch"]
        if mode == "pull":
            answer["remote_block_ids"] = [list(g) for g in groups]
        return SendReq(rid, groups, worker_params, num_tokens, answer)

    def _decode_finished(self, request: Any, params: dict[str, Any]) -> tuple[bool, None]:
        rid = request.request_id
        if rid in self.recving:
            # Finished while its KV was still on its way (aborted, or ended by an error):
            # the rank lets go; vLLM holds the blocks until the request's finished_recving.
            if rid not in self.aborted_recving:
                self.aborted_recving.add(rid)
                self._aborts.append(rid)
            return False, None
        if params.get("do_remote_prefill"):
            # Ended before it got blocks: let P free its copy now rather than at its lease.
            # (The copy keeps do_remote_prefill: the rank reads it as "P's answer".)
            self._declines.append((rid, dict(params)))
            params["do_remote_prefill"] = False
        return False, None


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------


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
        for req in meta.sends:
            self._finished(req)
        for rid in meta.aborts:
            self._abort(rid)
        for rid in meta.confirmed:
            self.unconfirmed.discard(rid)
            if rid in self.ended_unconfirmed:
                self.ended_unconfirmed.discard(rid)
                self._results.finished_sending.add(rid)

    # -- P, layer-wise ----------------------------------------------------------------------

    def _start(self, req: SendReq) -> None:
        rid = req.request_id
        fault = self.settings.fault
        if fault == "params":  # test only: the router's params choose the fault per request
            fault = req.params.get("kvhandoff_fault") or None
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
        fault = self.settings.fault
        if fault == "params":  # test only: the router's params choose the fault per request
            fault = req.params.get("kvhandoff_fault") or None
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
