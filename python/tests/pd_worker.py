"""A prefill (P) or decode (D) engine in a process of its own, driven over a pipe; for the
two-process tests (``test_connector.py``) and shared byte-pattern helpers.

The child (:func:`engine`) owns one :class:`kvhandoff.Connector` on numpy regions and answers
the parent's commands; it forwards every event, and for D checks every byte of a request whose
KV arrived before forwarding the event. The parent drives it through :class:`Engine`, whose every
wait has a deadline; :meth:`Engine.stop` kills the child if it does not exit in time.

Commands (tuples sent by the parent) and replies (sent by the child)::

    ("finish", rid, index, ids, params, num_tokens)   P: fill, request_finished -> ("answer", rid, params)
    ("allocate", rid, index, ids, params, num_tokens) D: request_allocated      -> ("allocated", rid)
    ("abort", rid)                                    either                    -> ("aborted", rid)
    ("add_peer", engine_id, address)                  either                    -> ("ok",)
    ("metrics",)                                      either                    -> ("metrics", dict)
    ("close",)                                        either: close and exit    -> ("closed",)

A failed call replies ``("error", rid, exception class name, message)``. Events come as
``("event", event, verdict)``: ``verdict`` is None, or for a D event that hands over KV
(``blocks_ready``, ``imported`` with ``outcome == "loaded"``) ``"ok"`` or what was wrong.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

BLOCK_TOKENS = 16


def pattern(index: int, region: int, nth: int, block_bytes: int) -> np.ndarray:
    """The bytes of the ``nth`` block of request ``index`` in ``region`` (the Rust example's)."""
    o = np.arange(block_bytes, dtype=np.int64)
    return ((index * 131 + region * 31 + nth * 17 + o * 7 + o // 251) & 0xFF).astype(np.uint8)


def fill(regions: list[np.ndarray], index: int, ids: list[int]) -> None:
    """P's "prefill": every byte of every block of the request, in every region."""
    for r, region in enumerate(regions):
        for nth, block in enumerate(ids):
            region[block] = pattern(index, r, nth, region.shape[1])


def check(regions: list[np.ndarray], index: int, ids: list[int]) -> str | None:
    """None if every byte of the request's blocks is P's, else what is wrong."""
    for r, region in enumerate(regions):
        for nth, block in enumerate(ids):
            want = pattern(index, r, nth, region.shape[1])
            wrong = np.flatnonzero(region[block] != want)
            if wrong.size:
                return f"region {r} block {block}: {wrong.size} wrong bytes from offset {wrong[0]}"
    return None


def flat(blocks: Any) -> list[int]:
    """An event's block groups as one list."""
    return [b for group in blocks for b in group]


# ---------------------------------------------------------------------------------------------
# The child.


def engine(
    pipe: Connection,
    role: str,
    engine_id: str,
    num_blocks: int = 64,
    block_bytes: int = 1024,
    num_regions: int = 2,
    **kwargs: Any,
) -> None:
    """The child's main: one rank on ``num_regions`` numpy regions, serving ``pipe``."""
    import kvhandoff

    regions = [np.zeros((num_blocks, block_bytes), dtype=np.uint8) for _ in range(num_regions)]
    try:
        conn = kvhandoff.Connector(
            role, engine_id, regions=regions, block_bytes=block_bytes, **kwargs
        )
    except Exception as e:  # noqa: BLE001 - reported to the parent
        pipe.send(("error", None, type(e).__name__, f"{e}\n{traceback.format_exc()}"))
        return
    pipe.send(("ready", conn.address, os.getpid()))
    index_of: dict[str, int] = {}
    try:
        while True:
            while pipe.poll(0):
                cmd = pipe.recv()
                if cmd[0] == "close":
                    conn.close()
                    pipe.send(("closed",))
                    return
                pipe.send(_handle(conn, regions, index_of, cmd))
            for event in conn.wait_events(0.002):
                verdict = None
                delivered = event["kind"] == "blocks_ready" or (
                    event["kind"] == "imported" and event.get("outcome") == "loaded"
                )
                if role == "decode" and delivered:
                    index = index_of.get(event["request_id"])
                    if index is None:
                        verdict = "an event for a request this engine did not allocate"
                    else:
                        verdict = check(regions, index, flat(event["blocks"])) or "ok"
                pipe.send(("event", dict(event), verdict))
    except (EOFError, BrokenPipeError):
        pass  # the parent is gone
    finally:
        conn.close()


def _handle(conn: Any, regions: list[np.ndarray], index_of: dict[str, int], cmd: tuple) -> tuple:
    op = cmd[0]
    rid = cmd[1] if len(cmd) > 1 else None
    try:
        if op == "finish":
            _, rid, index, ids, params, num_tokens = cmd
            fill(regions, index, ids)
            return ("answer", rid, conn.request_finished(rid, ids, params, num_tokens))
        if op == "allocate":
            _, rid, index, ids, params, num_tokens = cmd
            index_of[rid] = index
            conn.request_allocated(rid, ids, params, num_tokens)
            return ("allocated", rid)
        if op == "abort":
            conn.abort(rid)
            return ("aborted", rid)
        if op == "add_peer":
            conn.add_peer(cmd[1], cmd[2])
            return ("ok",)
        if op == "metrics":
            import kvhandoff

            return ("metrics", kvhandoff.metrics())
        return ("error", rid, "ValueError", f"unknown command {op!r}")
    except Exception as e:  # noqa: BLE001 - reported to the parent
        return ("error", rid, type(e).__name__, str(e))


# ---------------------------------------------------------------------------------------------
# The parent's handle.


class EngineError(AssertionError):
    """The child answered a call with an error, died, or did not answer in time."""


class Engine:
    """A child engine: start it, call it, collect its events; every wait has a deadline."""

    def __init__(
        self, role: str, engine_id: str, start_timeout: float = 60.0, **kwargs: Any
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.role, self.engine_id = role, engine_id
        self.pipe, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=engine, args=(child, role, engine_id), kwargs=kwargs, daemon=True
        )
        self.proc.start()
        child.close()
        self.events: list[tuple[dict, str | None]] = []
        try:
            ready = self._next(start_timeout)
            if ready[0] != "ready":
                raise EngineError(f"{engine_id} did not start: {ready}")
        except BaseException:
            self.stop(0)
            raise
        self.address: str = ready[1]
        self.pid: int = ready[2]

    def _next(self, timeout: float) -> tuple:
        """The child's next message (an event or a reply), or an error at the deadline."""
        if not self.pipe.poll(max(timeout, 0)):
            raise EngineError(f"{self.engine_id}: nothing within {timeout:.1f} s")
        try:
            return self.pipe.recv()
        except EOFError:
            raise EngineError(
                f"{self.engine_id} died (exit code {self.proc.exitcode})"
            ) from None

    def call(self, *cmd: Any, timeout: float = 30.0) -> tuple:
        """Sends a command and returns its reply, keeping the events that came before it.
        Raises :class:`EngineError` on an ``("error", ...)`` reply."""
        self.pipe.send(cmd)
        deadline = time.monotonic() + timeout
        while True:
            msg = self._next(deadline - time.monotonic())
            if msg[0] == "event":
                self.events.append((msg[1], msg[2]))
                continue
            if msg[0] == "error":
                raise EngineError(f"{self.engine_id} {cmd[0]}({cmd[1:2]}): {msg[2]}: {msg[3]}")
            return msg

    def try_call(self, *cmd: Any, timeout: float = 30.0) -> tuple:
        """As :meth:`call`, but returns an ``("error", ...)`` reply instead of raising."""
        try:
            return self.call(*cmd, timeout=timeout)
        except EngineError as e:
            return ("error", str(e))

    def wait(self, until: Any, timeout: float) -> list[tuple[dict, str | None]]:
        """Collects events until ``until(events)`` is true, then returns (and forgets) them all."""
        deadline = time.monotonic() + timeout
        while not until(self.events):
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineError(
                    f"{self.engine_id}: condition not met within {timeout:.1f} s; events: "
                    f"{[(e['request_id'], e['kind'], e.get('reason')) for e, _ in self.events]}"
                )
            if self.pipe.poll(min(left, 0.05)):
                msg = self._next(1.0)
                if msg[0] == "event":
                    self.events.append((msg[1], msg[2]))
                else:
                    raise EngineError(f"{self.engine_id}: unexpected {msg}")
        events, self.events = self.events, []
        return events

    def wait_final(self, n: int, timeout: float) -> list[tuple[dict, str | None]]:
        """Waits for ``n`` final events (and returns every event until then)."""
        return self.wait(lambda evs: sum(1 for e, _ in evs if e["final"]) >= n, timeout)

    def kill(self) -> None:
        """SIGKILL, no goodbye."""
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def stop(self, timeout: float = 10.0) -> None:
        """Asks the child to close and exit; kills it if it does not in time. Never raises."""
        try:
            if self.proc.is_alive() and timeout > 0:
                self.pipe.send(("close",))
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline and self.proc.is_alive():
                    if self.pipe.poll(0.05):
                        if self.pipe.recv()[0] == "closed":
                            break
        except (EOFError, OSError, BrokenPipeError):
            pass
        finally:
            self.proc.join(2)
            if self.proc.is_alive():
                self.kill()
            self.pipe.close()
