"""The vLLM adapter's mapping, without vLLM: its settings, what travels between vLLM's scheduler
and worker roles, and the scheduler role's logic (:class:`SchedulerSide`; the worker role's is in
``_vllm_worker``). ``kvhandoff.vllm`` puts vLLM's connector class on top; tests drive these with
fakes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Iterable

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
_FAULTS = (None, "", "corrupt", "drop", "late_export", "params")
#: The adapter's side-channel handshake timeout unless the extra config sets one.
_HANDSHAKE_TIMEOUT_MS = 30_000
# The extra-config keys the adapter reads itself, and those it passes to the native connector.
_ADAPTER_KEYS = frozenset({
    "transport", "listen", "advertise_host", "engine_id", "model", "dtype", "fault", "layerwise",
})


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
            raise ValueError(
                f"KvHandoffConnector: fault {fault!r} is none of corrupt, drop, late_export, params"
            )
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
