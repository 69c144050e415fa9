"""Helpers of the connector's tests (``test_connector.py``): engines' memory, a P and a D in one
process over transport="mem", waiting for events with a deadline, and the NIXL runtime check.
The two-process helpers are in ``pd_worker.py``."""

from __future__ import annotations

import itertools
import os
import time
from typing import Any, Iterator

import numpy as np
import pytest

from pd_worker import BLOCK_TOKENS, check, fill, flat, pattern  # noqa: F401 - re-exported

try:  # shared with the other tests of this folder: never skip them from here
    import kvhandoff
except ImportError:  # test_connector.py skips itself
    kvhandoff = None

#: Every wait of the tests ends by this.
DEADLINE_S = 30.0

_ids = itertools.count()


def unique(prefix: str) -> str:
    """An engine or request id no other test of this process uses."""
    return f"{prefix}-{os.getpid()}-{next(_ids)}"


def nixl_ready() -> bool:
    """Whether the NIXL runtime env is set (``source scripts/nixl-env.sh``)."""
    return bool(os.environ.get("NIXL_PLUGIN_DIR")) and os.path.isdir(os.environ["NIXL_PLUGIN_DIR"])


if os.environ.get("CI") and not nixl_ready():
    # CI runs the NIXL tests, never skips them (scripts/test.sh sources the env).
    raise RuntimeError("CI is set but the NIXL runtime env is not: source scripts/nixl-env.sh")

needs_nixl = pytest.mark.skipif(
    not nixl_ready(), reason="NIXL runtime env not set: source scripts/nixl-env.sh"
)


def regions(num_blocks: int = 64, block_bytes: int = 512, count: int = 2) -> list[np.ndarray]:
    """An engine's KV memory: ``count`` numpy regions of ``num_blocks`` blocks."""
    return [np.zeros((num_blocks, block_bytes), dtype=np.uint8) for _ in range(count)]


def wait_final(conn: Any, n: int, timeout: float = DEADLINE_S) -> list[dict]:
    """Polls ``conn`` until ``n`` final events came (returns every event until then); fails at
    the deadline with what came."""
    events: list[dict] = []
    deadline = time.monotonic() + timeout
    while sum(1 for e in events if e["final"]) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            pytest.fail(f"{conn!r}: {n} final events expected within {timeout} s, got {events}")
        events.extend(conn.wait_events(min(left, 0.05)))
    return events


def quiet(conn: Any, seconds: float) -> list[dict]:
    """Every event of ``conn`` over ``seconds`` (for "nothing happens" checks)."""
    events: list[dict] = []
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        events.extend(conn.wait_events(left))
    return events


def norm(text: str | None) -> str:
    """A typed reason or outcome in one spelling: ``"PeerDead"``, ``"peer_dead"`` → ``"peerdead"``."""
    return "".join(c for c in (text or "").lower() if c.isalnum())


class Pair:
    """A P and a D connector in this process over transport="mem", each knowing the other."""

    def __init__(
        self,
        p_regions: list[Any],
        d_regions: list[Any],
        block_bytes: int,
        **kwargs: Any,
    ) -> None:
        self.block_bytes = block_bytes
        self.p = kvhandoff.Connector(
            "prefill", unique("prefill"), regions=p_regions, block_bytes=block_bytes,
            transport="mem", **kwargs,
        )
        try:
            self.d = kvhandoff.Connector(
                "decode", unique("decode"), regions=d_regions, block_bytes=block_bytes,
                transport="mem", **kwargs,
            )
            self.d.add_peer(self.p.engine_id, self.p.address)  # (peers= is tested elsewhere)
            self.p.add_peer(self.d.engine_id, self.d.address)
        except BaseException:
            self.p.close()
            raise

    def prefill_params(self, **extra: Any) -> dict[str, Any]:
        """What D needs to register before P finished (D first): P's address by hand."""
        host, port = self.p.address.rsplit(":", 1)
        return {
            "do_remote_prefill": True,
            "remote_engine_id": self.p.engine_id,
            "remote_host": host,
            "remote_port": int(port),
            "tp_size": 1,
            **extra,
        }

    def close(self) -> None:
        for conn in (self.d, self.p):
            conn.close()


def make_pair(num_blocks: int = 64, block_bytes: int = 512, count: int = 2, **kwargs: Any):
    """A :class:`Pair` with its regions: ``(pair, p_regions, d_regions)``."""
    pr, dr = regions(num_blocks, block_bytes, count), regions(num_blocks, block_bytes, count)
    return Pair(pr, dr, block_bytes, **kwargs), pr, dr


@pytest.fixture
def mem_pair() -> Iterator[tuple[Pair, list[np.ndarray], list[np.ndarray]]]:
    """P and D over transport="mem", 64 blocks of 512 B in 2 numpy regions each:
    ``(pair, p_regions, d_regions)``."""
    pair, pr, dr = make_pair()
    try:
        yield pair, pr, dr
    finally:
        pair.close()
