"""kvhandoff for Python: hand KV cache from a prefill engine to a decode engine.

:class:`Connector` is one engine rank on the engine's own KV memory (no copy). The engine calls it
from its hooks, and the router carries the ``kv_transfer_params`` it returns between the engines::

    import numpy as np, kvhandoff
    kv = np.zeros((64, 4096), dtype=np.uint8)          # 64 blocks of 4 KiB, the engine's memory
    with kvhandoff.Connector("prefill", "prefill-0", regions=[kv], block_bytes=4096,
                             transport="mem") as p:
        print(p.address)

``kvhandoff.vllm.KvHandoffConnector`` is a vLLM KV connector built on it.
"""

from __future__ import annotations

import atexit
import weakref
from typing import Any, Iterable

from ._native import (
    ConfigError,
    InvalidParams,
    KvHandoffError,
    NativeConnector,
    RegionError,
    Rejected,
    SETTING_KEYS,
    Unavailable,
    Unsupported,
    VerdictLate,
    clock_secs,
    metrics,
    prometheus_text,
)

__all__ = [
    "Connector",
    "RawRegion",
    "KvHandoffError",
    "ConfigError",
    "InvalidParams",
    "Rejected",
    "Unsupported",
    "Unavailable",
    "VerdictLate",
    "SETTING_KEYS",
    "RegionError",
    "metrics",
    "prometheus_text",
    "clock_secs",
]


class RawRegion:
    """Memory the engine keeps, by address: ``nbytes`` bytes of host memory at ``ptr``.

    The one raw-pointer entry, and its contract: ``[ptr, ptr + nbytes)`` is one allocation,
    readable and writable, that stays valid (not freed, moved or unmapped) for as long as
    ``owner`` lives; the connector keeps a reference to ``owner`` until its rank has stopped
    (after :meth:`Connector.close`). Between handing a request's blocks to the connector and
    getting them back in the request's final event, the engine must not write them (and, on the
    decode side, not read them either): transfers touch them from other threads, as DMA would.
    """

    __slots__ = ("ptr", "nbytes", "owner")

    def __init__(self, ptr: int, nbytes: int, owner: Any = None) -> None:
        if ptr <= 0 or nbytes <= 0:
            raise ConfigError(f"a raw region needs a positive address and size (got {ptr:#x}, {nbytes})")
        self.ptr = int(ptr)
        self.nbytes = int(nbytes)
        self.owner = owner

    def __repr__(self) -> str:
        return f"RawRegion(ptr={self.ptr:#x}, nbytes={self.nbytes})"


def _as_region(region: Any, index: int) -> tuple[int, int, Any]:
    """``(address, length, owner)`` for a region given as a torch tensor, a buffer or a RawRegion."""
    if isinstance(region, RawRegion):
        return (region.ptr, region.nbytes, region.owner if region.owner is not None else region)
    if hasattr(region, "data_ptr") and hasattr(region, "element_size"):
        # A torch tensor: its storage, by address. It must be contiguous on the CPU.
        if getattr(region, "device", None) is not None and str(region.device) != "cpu":
            raise ConfigError(f"regions[{index}]: a tensor on {region.device}; only host memory is supported")
        if not region.is_contiguous():
            raise ConfigError(f"regions[{index}]: the tensor is not contiguous")
        nbytes = region.numel() * region.element_size()
        return (int(region.data_ptr()), int(nbytes), region)
    try:
        view = memoryview(region)
    except TypeError:
        raise ConfigError(
            f"regions[{index}]: {type(region).__name__} is neither a buffer, a torch tensor nor a RawRegion"
        ) from None
    if view.readonly:
        raise ConfigError(f"regions[{index}]: the buffer is read-only")
    if not view.c_contiguous:
        raise ConfigError(f"regions[{index}]: the buffer is not C-contiguous")
    flat = view.cast("B") if view.ndim != 1 or view.format != "B" else view
    if flat.nbytes == 0:
        raise ConfigError(f"regions[{index}]: the buffer is empty")
    # The address of a writable buffer, without copying: ctypes maps it in place.
    import ctypes

    address = ctypes.addressof(ctypes.c_char.from_buffer(flat))
    return (address, flat.nbytes, (region, flat))


_LIVE: "weakref.WeakSet[Connector]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    # Before the interpreter finalises: a thread still waiting in a connector call then returns
    # at once (closed) instead of being torn down inside native code by the finalisation.
    for connector in list(_LIVE):
        connector.close()
    # Let threads still in a connector call come back into the interpreter (they find it
    # closed) before it finalises; bounded, so a stuck call cannot hold the exit.
    import time

    from ._native import threads_outside

    deadline = time.monotonic() + 2.0
    while threads_outside() > 0 and time.monotonic() < deadline:
        time.sleep(0.001)


class Connector(NativeConnector):
    """One engine rank, prefill (``role="prefill"``) or decode (``role="decode"``), on KV memory
    the engine owns.

    ``regions``: the engine's KV memory, each a buffer (``bytearray``, a numpy array,
    ``memoryview``: writable and C-contiguous), a CPU torch tensor (by ``data_ptr()``) or a
    :class:`RawRegion`. None is copied; the connector keeps each alive until :meth:`close`.
    Block ``b`` is the ``b``-th ``block_bytes`` slice of every region (as vLLM's block ids index
    every layer), so every region holds the same number of blocks.

    ``listen`` is the side channel's ``"HOST:PORT"`` (port 0: any free port; :attr:`address`
    tells). ``transport`` is ``"nixl"`` (UCX, between processes) or ``"mem"`` (within this
    process). Other keywords: see :class:`kvhandoff._native.NativeConnector`.

    Use it as a context manager, or call :meth:`close`.
    """

    def __new__(cls, role: str, engine_id: str, *args: Any, regions: Iterable[Any] = (), **kwargs: Any):
        native = [_as_region(r, i) for i, r in enumerate(regions)]
        connector = super().__new__(cls, role, engine_id, native, *args, **kwargs)
        _LIVE.add(connector)
        return connector

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # the native __new__ did the work
        pass

    def __enter__(self) -> "Connector":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else self.address
        return f"kvhandoff.Connector({self.role}, {self.engine_id!r}, {state})"
