#!/usr/bin/env python3
"""A prefill (P) and a decode (D) engine handing KV over with kvhandoff's Python API: the loops
an engine integration runs, on KV memory the engines allocated themselves (numpy arrays).

P fills each request's blocks with a per-request byte pattern and hands them over
(``request_finished``); the router (here the parent process) carries P's answer, its
``kv_transfer_params``, to D, which allocates blocks (``request_allocated``) and, once they
arrived, checks every byte. Prints one line per request and ``all N requests verified``; exits
non-zero on any mismatch, failure or timeout.

Over NIXL (the default) P and D are two processes (multiprocessing, spawn); over ``mem`` (the
in-process transport) they are two threads of this process, with the same loops and router::

    source scripts/nixl-env.sh                     # the NIXL runtime (not needed for --transport mem)
    python examples/python/handoff.py                          # NIXL, push, 32 requests
    python examples/python/handoff.py --mode pull --requests 100
    python examples/python/handoff.py --transport mem

The Rust twin of this example is ``connector/examples/handoff.rs``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import threading
import time
import traceback
from collections import deque
from multiprocessing.connection import Connection, wait

import numpy as np

POOL_BLOCKS = 64
BLOCK_TOKENS = 16
# 4 layers, K and V each: 8 regions; 2 KV heads of 32 bf16 elements, 16 tokens a block.
REGIONS = 8
BLOCK_BYTES = 2 * 32 * 2 * BLOCK_TOKENS
TIMEOUT_S = 60.0


def pattern(request: int, region: int, nth: int) -> np.ndarray:
    """The bytes of the ``nth`` block of ``request`` in ``region`` (the Rust example's)."""
    o = np.arange(BLOCK_BYTES, dtype=np.int64)
    return ((request * 131 + region * 31 + nth * 17 + o * 7 + o // 251) & 0xFF).astype(np.uint8)


def shape(i: int) -> tuple[int, int]:
    """Request ``i``'s blocks (1 to 4) and tokens (not always a whole number of blocks)."""
    blocks = 1 + i % 4
    return blocks, blocks * BLOCK_TOKENS - i % BLOCK_TOKENS


def engine_memory() -> list[np.ndarray]:
    """The engine's KV cache: one array per region, allocated by the engine (in a real engine:
    its KV tensors), handed to the connector as is."""
    return [np.zeros((POOL_BLOCKS, BLOCK_BYTES), dtype=np.uint8) for _ in range(REGIONS)]


def flat(groups: list[list[int]]) -> list[int]:
    return [b for group in groups for b in group]


# ---------------------------------------------------------------------------------------------
# P: prefill, fill the blocks, hand them over, free them when the connector says so.


def prefill_engine(router: Connection, transport: str, mode: str, n: int) -> None:
    import kvhandoff

    try:
        kv = engine_memory()
        with kvhandoff.Connector("prefill", "prefill-0", regions=kv, block_bytes=BLOCK_BYTES,
                                 transport=transport, block_tokens=BLOCK_TOKENS) as p:
            router.send(("address", p.address))
            _, d_id, d_address = router.recv()  # the router tells P where D is
            p.add_peer(d_id, d_address)
            free = deque(range(POOL_BLOCKS))
            nxt = done = 0
            deadline = time.monotonic() + TIMEOUT_S
            while done < n:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"P: timed out with {done} of {n} requests done")
                if router.poll(0):  # the router gave up: stop
                    return
                blocks, tokens = shape(nxt)
                if nxt < n and len(free) >= blocks:
                    ids = [free.popleft() for _ in range(blocks)]
                    for r, region in enumerate(kv):  # the "prefill"
                        for nth, block in enumerate(ids):
                            region[block] = pattern(nxt, r, nth)
                    # What the router sends with the prefill leg: keep the KV for a remote decode.
                    leg = {"do_remote_decode": True, "transfer_mode": mode}
                    answer = p.request_finished(f"req-{nxt}", ids, leg, tokens)
                    router.send(("handoff", f"req-{nxt}", blocks, answer))
                    nxt += 1
                    continue
                for event in p.wait_events(0.005):
                    sent = event["kind"] == "blocks_free" and event["released"] is None
                    if not (sent or event["kind"] == "export_ended"):
                        raise RuntimeError(f"P: {event}")
                    free.extend(flat(event["blocks"]))
                    done += 1
            router.send(("done", done))
            router.recv()  # stay up until the router lets P go (D has everything)
    except BaseException:
        router.send(("error", traceback.format_exc()))


# ---------------------------------------------------------------------------------------------
# D: allocate blocks for each request P handed over, check them when they arrived, free them.


def decode_engine(router: Connection, transport: str, n: int) -> None:
    import kvhandoff

    try:
        kv = engine_memory()
        with kvhandoff.Connector("decode", "decode-0", regions=kv, block_bytes=BLOCK_BYTES,
                                 transport=transport, block_tokens=BLOCK_TOKENS) as d:
            router.send(("address", d.address))
            _, p_id, p_address = router.recv()
            d.add_peer(p_id, p_address)
            free = deque(range(POOL_BLOCKS))
            waiting: deque = deque()
            verified = 0
            deadline = time.monotonic() + TIMEOUT_S
            while verified < n:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"D: timed out with {verified} of {n} requests verified")
                while router.poll(0):
                    msg = router.recv()
                    if msg[0] == "exit":  # the router gave up: stop
                        return
                    _, request, blocks, answer = msg
                    waiting.append((request, blocks, answer))
                if waiting and len(free) >= waiting[0][1]:
                    request, blocks, answer = waiting.popleft()
                    ids = [free.popleft() for _ in range(blocks)]
                    d.request_allocated(request, ids, answer, answer["remote_num_tokens"])
                for event in d.wait_events(0.005):
                    arrived = event["kind"] == "blocks_ready" or (
                        event["kind"] == "imported" and event["outcome"] == "loaded"
                    )
                    if not arrived:
                        raise RuntimeError(f"D: {event}")
                    ids = flat(event["blocks"])
                    check(kv, event["request_id"], ids)
                    router.send(("verified", event["request_id"], len(ids)))
                    free.extend(ids)
                    verified += 1
            router.send(("done", verified))
    except BaseException:
        router.send(("error", traceback.format_exc()))


def check(kv: list[np.ndarray], request: str, ids: list[int]) -> None:
    """D's check: every byte of every block of the request, in every region, is P's."""
    index = int(request.removeprefix("req-"))
    for r, region in enumerate(kv):
        for nth, block in enumerate(ids):
            wrong = np.flatnonzero(region[block] != pattern(index, r, nth))
            if wrong.size:
                raise RuntimeError(
                    f"{request}: region {r} block {block}: {wrong.size} wrong bytes from {wrong[0]}"
                )


# ---------------------------------------------------------------------------------------------
# The router: starts both engines, carries P's answers to D.


def run(transport: str, mode: str, n: int) -> int:
    if transport == "nixl" and not os.environ.get("NIXL_PLUGIN_DIR"):
        print("the NIXL runtime is not set up: `source scripts/nixl-env.sh` first "
              "(or use --transport mem)", file=sys.stderr)
        return 2
    p_link, p_end = mp.Pipe()
    d_link, d_end = mp.Pipe()
    if transport == "nixl":  # two processes
        ctx = mp.get_context("spawn")
        engines = [
            ctx.Process(target=prefill_engine, args=(p_end, transport, mode, n), daemon=True),
            ctx.Process(target=decode_engine, args=(d_end, transport, n), daemon=True),
        ]
    else:  # the in-process transport: two threads of this process
        engines = [
            threading.Thread(target=prefill_engine, args=(p_end, transport, mode, n)),
            threading.Thread(target=decode_engine, args=(d_end, transport, n)),
        ]
    for engine in engines:
        engine.start()
    started = time.monotonic()
    deadline = started + TIMEOUT_S + 30
    try:
        addresses = {}
        for name, link in (("P", p_link), ("D", d_link)):
            if not link.poll(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"{name} did not start")
            msg = link.recv()
            if msg[0] != "address":
                raise RuntimeError(f"{name} did not start:\n{msg[1]}")
            addresses[name] = msg[1]
        p_link.send(("peer", "decode-0", addresses["D"]))
        d_link.send(("peer", "prefill-0", addresses["P"]))
        handed = verified = 0
        d_done = p_done = False
        while not (d_done and p_done):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{handed} handed over, {verified} verified of {n}")
            for link in wait([p_link, d_link], timeout=min(left, 1.0)):
                msg = link.recv()
                if msg[0] == "error":
                    raise RuntimeError(("P" if link is p_link else "D") + " failed:\n" + msg[1])
                if msg[0] == "handoff":  # P's answer, to D with the decode leg
                    d_link.send(msg)
                    handed += 1
                elif msg[0] == "verified":
                    verified += 1
                    print(f"{msg[1]}: {msg[2]} blocks verified ({mode})", flush=True)
                elif msg[0] == "done" and link is d_link:
                    d_done = True
                elif msg[0] == "done":
                    p_done = True
        took = time.monotonic() - started
        if verified != n:
            raise RuntimeError(f"{verified} of {n} requests verified")
        print(f"all {n} requests verified ({transport}, {mode}, {took:.2f} s)", flush=True)
        return 0
    except (RuntimeError, TimeoutError, EOFError, OSError) as e:
        print(f"handoff FAILED: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        for link in (p_link, d_link):  # P stays up until now: D has all its KV
            try:
                link.send(("exit",))
            except OSError:
                pass
        for engine in engines:
            engine.join(10)
            if isinstance(engine, mp.process.BaseProcess) and engine.is_alive():
                engine.kill()
                engine.join(5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transport", choices=["nixl", "mem"], default="nixl")
    parser.add_argument("--mode", choices=["push", "pull"], default="push")
    parser.add_argument("--requests", type=int, default=32)
    args = parser.parse_args()
    if args.requests <= 0:
        parser.error("--requests must be positive")
    return run(args.transport, args.mode, args.requests)


if __name__ == "__main__":
    sys.exit(main())
