"""Type stubs of kvhandoff's native extension (``kvhandoff._native``, built from ``python/src``).

Import from ``kvhandoff``, which re-exports everything here and adds :class:`kvhandoff.Connector`'s
region handling (buffers, torch tensors) on top of :class:`NativeConnector`.
"""

import os
from typing import Any, Literal, Sequence, TypedDict

BlockIdsLike = Sequence[int] | Sequence[Sequence[int]] | Any  # a list, a list per group, a numpy array

class KvHandoffError(Exception):
    """Every kvhandoff error. ``cause`` is the Rust error's message (its whole chain)."""

    cause: str

class ConfigError(KvHandoffError):
    """A constructor argument or setting is invalid (names the argument), or the rank could not start."""

class InvalidParams(KvHandoffError):
    """``kv_transfer_params`` lack a key this call needs, or hold an invalid value (names the key)."""

class Rejected(KvHandoffError):
    """The endpoint refused the call (duplicate or unknown request, full table, shut down); nothing changed."""

class Unsupported(KvHandoffError):
    """The call asks for something this rank cannot do (e.g. a TP ratio it cannot pair)."""

class Unavailable(KvHandoffError):
    """The runtime is not running (closed, or stopped) or did not answer in time."""

class VerdictLate(KvHandoffError):
    """The runtime took the call but did not answer in time: the request's event will tell
    (``kind == "refused"`` if it was refused after all). Do not reuse its blocks until then."""

class RegionError(KvHandoffError):
    """``read_block``/``write_block`` out of range, or a buffer that cannot be a region."""

class Event(TypedDict, total=False):
    """One event of :meth:`NativeConnector.poll_events`.

    ``kind`` is one of ``"blocks_ready"`` (D: the KV arrived), ``"decode_fenced"`` (D: the request
    failed, blocks still held until its ``"failed"``), ``"failed"`` (D: the KV will not arrive;
    blocks free), ``"blocks_free"`` (P: blocks may be freed; ``released`` is None when the KV was
    sent), ``"export_ended"`` (the holder of an export: blocks may be freed), ``"imported"`` (the
    reader of an export: ``outcome`` is ``"loaded"``, ``"recompute"`` with ``valid_tokens``, or
    ``"failed"``), ``"refused"`` (a call whose verdict came late was refused after all).
    ``final`` is True for the request's one event that hands its blocks back.
    """

    request_id: str
    kind: str
    final: bool
    blocks: list[list[int]]
    reason: str | None
    proof: str | None
    released: str | None
    outcome: str | None
    valid_tokens: int | None

def metrics() -> dict[str, int]:
    """This process's counters (every rank of it), as the runtime counts them when it hands a
    request's final event to the engine: ``requests_ready`` (D's ``blocks_ready``, a reader's
    ``imported``/loaded), ``requests_failed``, ``requests_recomputed``, ``requests_sent`` (P's
    ``blocks_free`` after the write, an export that was read), ``requests_released`` (let go
    unsent), ``requests_fenced`` (``decode_fenced``), ``requests_expired`` (let go because the
    holder's lease ran out unasked), ``calls_refused_late``, ``bytes_sent`` and
    ``bytes_received`` (the KV bytes of the sent and ready requests), and the ranks'
    ``reads_asked_again`` (asks a reader sent again soon because the holder's rank did not have
    the export yet)."""

def prometheus_text() -> str:
    """The same figures and the ranks' endpoint counters as Prometheus text exposition (what
    ``kvhandoff node --metrics-addr`` serves; names in docs/operations.md), for an engine that
    serves its own ``/metrics``."""

def threads_outside() -> int:
    """Threads now in a connector call with the GIL released (the exit hook waits for none)."""

#: Every keyword setting :class:`NativeConnector` takes (the rank's, then the shell's own).
SETTING_KEYS: tuple[str, ...]

def clock_secs() -> float:
    """The monotonic clock that ``remote_blocks_expiry_time`` is written in (this process)."""

class NativeConnector:
    """One engine rank (prefill or decode) on memory the engine owns. Use :class:`kvhandoff.Connector`.

    ``regions`` are ``(address, length, owner)`` triples: ``length`` bytes of host memory at
    ``address``, kept alive by ``owner`` (held by the connector until the rank stopped). Block ``b``
    is the ``b``-th ``block_bytes`` slice of every region.
    Every call that waits on the runtime releases the GIL.
    """

    def __init__(
        self,
        role: Literal["prefill", "decode"],
        engine_id: str,
        regions: Sequence[tuple[int, int, Any]],
        block_bytes: int,
        *,
        rank: int = 0,
        listen: str = "127.0.0.1:0",
        advertise_host: str | None = None,
        transport: Literal["mem", "nixl"] = "nixl",
        block_tokens: int = 16,
        model: str = "opaque",
        dtype: str = "opaque",
        peers: Sequence[tuple[str, str]] | None = None,
        accept_any: bool = False,
        tp_size: int = 1,
        psk_file: str | os.PathLike[str] | None = None,
        **config: Any,
    ) -> None:
        """Starts the rank (its runtime, transport agent and side channel).

        ``peers``: ``(engine_id, "host:port")`` of engines this rank dials or takes handshakes
        from; ``accept_any=True`` takes handshakes from any engine (a prefill rank whose decode
        engines are not known in advance; only where every host that reaches the port is
        trusted). ``model``/``dtype`` must match the peer's (they enter the compatibility check).
        ``rank``/``tp_size``: TP 1 only (opaque blocks carry no per-head geometry): other values
        raise :class:`Unsupported`.
        ``psk_file``: a file holding the side channel's pre-shared key (16 to 1024 bytes, one
        trailing newline trimmed): every handshake is authenticated with it (HMAC-SHA256
        challenge-response) and refused by a peer with another key or none. A bad file raises
        ``ConfigError``. It authenticates the handshake only, not the NIXL data path.

        ``**config`` (all optional; a ``ConfigError`` names an unknown key or invalid value):
        durations in milliseconds ``lease_ms``, ``lease_extension_ms``,
        ``heartbeat_interval_ms``, ``peer_timeout_ms``, ``connect_timeout_ms``,
        ``decode_deadline_ms``, ``registration_ttl_ms``, ``write_timeout_ms``,
        ``abandon_timeout_ms``, ``max_write_life_ms``, ``max_message_delay_ms``,
        ``quarantine_ms``, ``tombstone_ttl_ms`` (the protocol's ``Config``),
        ``handshake_timeout_ms`` (the side channel), ``call_timeout_ms`` (how long a call waits
        for the runtime's verdict), ``close_timeout_ms`` (how long :meth:`close` waits for
        requests in progress); ``load_failure_policy`` (``"fail"`` or ``"recompute"``),
        ``next_turn_ttl_s``, ``max_requests``; layer-wise push (:meth:`prefill_started`):
        ``layerwise_parts`` (how many parts a request's layers are written in, default 8, at
        most one per layer) and ``layerwise_min_tokens`` (prompts of fewer tokens go as one part
        with the last layer, default 256); every other key of ``kvhandoff::RankSettings``
        (``SETTING_KEYS`` lists them all: retries, table bounds, ``block_pairing``,
        ``integrity_digest``, ``recompute_threshold``, ``poll_interval_us``, ...).

        Layers, lowest first: the protocol's defaults; ``defaults`` (a dict of settings, for an
        adapter's own defaults); ``config_file`` (a TOML file's ``[rank]`` table, the file the
        ``kvhandoff`` command line reads too); ``KVHANDOFF_RANK_<KEY>`` environment variables;
        the keywords themselves. Errors name the key and the layer it came from.
        """
    @property
    def address(self) -> str:
        """``"host:port"`` of this rank's side channel (what P's ``remote_host``/``remote_port`` say)."""
    @property
    def engine_id(self) -> str: ...
    @property
    def role(self) -> str: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def block_bytes(self) -> int: ...
    @property
    def block_tokens(self) -> int: ...
    @property
    def layers(self) -> int:
        """This rank's layers: one per region. ``ready`` equal to it ends a layer-wise prefill."""
    def add_peer(self, engine_id: str, address: str) -> None: ...
    def warm_up(self, engine_id: str, timeout: float = 10.0) -> None: ...
    def request_allocated(
        self,
        request_id: str,
        block_ids: BlockIdsLike,
        kv_transfer_params: dict[str, Any],
        num_tokens: int | None = None,
    ) -> None:
        """D: blocks were allocated for a request whose prefill ran on the engine the params name."""
    def request_finished(
        self,
        request_id: str,
        block_ids: BlockIdsLike,
        kv_transfer_params: dict[str, Any] | None = None,
        num_tokens: int | None = None,
    ) -> dict[str, Any]:
        """P: the prefill finished; returns the ``kv_transfer_params`` for the router's decode leg."""
    def prefill_started(
        self,
        request_id: str,
        block_ids: BlockIdsLike,
        kv_transfer_params: dict[str, Any] | None = None,
        num_tokens: int | None = None,
    ) -> dict[str, Any]:
        """P, layer-wise push: the prefill starts into these blocks; report its layers with
        :meth:`layers_ready` as the forward pass writes them. In place of
        :meth:`request_finished` (which must not follow), answered as it is; the blocks come
        back with ``blocks_free``. Push only: ``transfer_mode: "pull"`` raises
        :class:`InvalidParams`; a duplicate request :class:`Rejected`."""
    def layers_ready(self, request_id: str, ready: int) -> None:
        """P, layer-wise push: layers ``0 .. ready`` (region indices) of the request's blocks hold
        their KV; ``ready == layers`` ends the prefill. Each part goes to D as soon as its layers
        are ready (once D registered). Taken, doing nothing, for a request that already ended
        (D gave up); :class:`Rejected` for a request never started layer-wise;
        :class:`InvalidParams` for ``ready`` above :attr:`layers`."""
    def keep_for_next_turn(
        self,
        request_id: str,
        block_ids: BlockIdsLike,
        kv_transfer_params: dict[str, Any] | None = None,
        num_tokens: int | None = None,
        ttl_s: float | None = None,
    ) -> dict[str, Any]:
        """D, bidirectional: keep the turn's blocks for the next turn's prefill to read."""
    def next_turn_allocated(
        self,
        request_id: str,
        block_ids: BlockIdsLike,
        kv_transfer_params: dict[str, Any],
        num_tokens: int | None = None,
    ) -> None:
        """P, bidirectional: read the previous turns' KV from the D that kept it."""
    def decline_export(self, request_id: str, kv_transfer_params: dict[str, Any]) -> None:
        """Reader: will not read this export (recomputes instead); the holder lets it go."""
    def abort(self, request_id: str) -> None: ...
    def poll_events(self) -> list[Event]: ...
    def wait_events(self, timeout_s: float) -> list[Event]:
        """Waits (GIL released) up to ``timeout_s`` for at least one event."""
    def has_pending_work(self) -> bool:
        """True while a request accepted here has not had its final event; False once closed."""
    def write_block(self, region: int, block: int, data: bytes) -> None:
        """Copies one whole block into the engine's memory (tests, examples)."""
    def read_block(self, region: int, block: int) -> bytes: ...
    def close(self) -> None:
        """Shuts the rank down: requests in progress give up; idempotent."""
    @property
    def closed(self) -> bool: ...
