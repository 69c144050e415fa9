#!/usr/bin/env python3
"""The Python API's cost per request lifecycle, both sides, over transport="mem" in one process.

A prefill (P) and a decode (D) connector on 1-region numpy pools; every request is one block.

- ``serial``: one request in flight at a time, in vLLM's order (P's ``request_finished``, the
  router, D's ``request_allocated``), or D first (``--order d-first``: D registers with a
  ``transfer_id``, then P finishes). Per request it times each call and the poll loops:
  the **P side** is ``request_finished`` + polling P until its ``blocks_free``; the **D side**
  is ``request_allocated`` + polling D until its ``blocks_ready``; the **lifecycle** is from
  the first call to the last event (both sides, one thread). The poll loops include waiting for
  the runtime (the side channel and the in-memory transport on the rank's threads): they are
  latencies, not CPU. ``poll_events`` on an empty queue is timed apart (``empty_poll``).
- ``pipelined``: ``--batch`` requests in flight (P finishes the batch, D allocates it, both
  are polled until every event came), the throughput an engine step with many requests sees:
  µs per lifecycle = wall time ÷ requests.

Every figure is per request, in µs: p50, mean and p99 over all requests of all rounds, and the
median of the rounds' means. Prints one JSON object::

    python python/bench_lifecycle.py                    # 2,000 requests × 5 rounds, both modes
    python python/bench_lifecycle.py --requests 500 --rounds 3 --order d-first

Polling: ``--poll busy`` (default) calls ``poll_events`` in a loop (an engine loop that polls
each step, with nothing else to do); ``--poll wait`` uses ``wait_events`` (sleeps in the
runtime, GIL released; it checks every ~200 µs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np

try:
    import kvhandoff
except ImportError:  # run from a checkout without installing: python/ on the path
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import kvhandoff

BLOCK_BYTES = 4096
POOL = 1024
LEG = {"do_remote_decode": True}
NS = 1e-3  # ns -> µs


def summary(values_ns: list[int], round_means: list[float] | None = None) -> dict[str, float]:
    arr = np.asarray(values_ns, dtype=np.float64) * NS
    out = {
        "p50": round(float(np.percentile(arr, 50)), 2),
        "mean": round(float(arr.mean()), 2),
        "p99": round(float(np.percentile(arr, 99)), 2),
    }
    if round_means:
        out["median_of_round_means"] = round(statistics.median(round_means), 2)
    return out


class Bench:
    def __init__(self, poll: str) -> None:
        self.p_kv = np.zeros((POOL, BLOCK_BYTES), dtype=np.uint8)
        self.d_kv = np.zeros((POOL, BLOCK_BYTES), dtype=np.uint8)
        self.p = kvhandoff.Connector("prefill", f"bench-prefill-{os.getpid()}",
                                     regions=[self.p_kv], block_bytes=BLOCK_BYTES, transport="mem")
        self.d = kvhandoff.Connector("decode", f"bench-decode-{os.getpid()}",
                                     regions=[self.d_kv], block_bytes=BLOCK_BYTES, transport="mem")
        self.d.add_peer(self.p.engine_id, self.p.address)
        self.p.add_peer(self.d.engine_id, self.d.address)
        host, port = self.p.address.rsplit(":", 1)
        self.d_first_params = {
            "do_remote_prefill": True, "remote_engine_id": self.p.engine_id,
            "remote_host": host, "remote_port": int(port), "tp_size": 1,
        }
        self.poll_mode = poll
        self.seq = 0

    def close(self) -> None:
        self.d.close()
        self.p.close()

    def poll(self, conn: Any) -> tuple[list[dict], int]:
        """Polls until at least one event; returns them and how many calls it took."""
        calls = 0
        deadline = time.monotonic() + 30
        while True:
            if time.monotonic() > deadline:
                raise RuntimeError("no event within 30 s")
            calls += 1
            events = conn.poll_events() if self.poll_mode == "busy" else conn.wait_events(1.0)
            if events:
                return events, calls

    def expect(self, events: list[dict], kind: str, rid: str) -> None:
        if len(events) != 1 or events[0]["kind"] != kind or events[0]["request_id"] != rid:
            raise RuntimeError(f"expected one {kind} of {rid}, got {events}")

    # -----------------------------------------------------------------------------------------

    def serial(self, n: int, order: str) -> dict[str, list[int]]:
        """``n`` requests one at a time; per request the times of each part, in ns."""
        clock = time.perf_counter_ns
        parts: dict[str, list[int]] = {k: [] for k in (
            "p_call", "d_call", "p_poll", "d_poll", "p_side", "d_side", "lifecycle",
        )}
        polls = {"p": 0, "d": 0}
        for i in range(n):
            self.seq += 1
            rid, block = f"s{self.seq}", i % POOL
            if order == "p-first":
                t0 = clock()
                answer = self.p.request_finished(rid, [block], LEG, 16)
                t1 = clock()
                self.d.request_allocated(rid, [block], answer, 16)
                t2 = clock()
                p_call, d_call = t1 - t0, t2 - t1
            else:
                params = {**self.d_first_params, "transfer_id": rid}
                t0 = clock()
                self.d.request_allocated(rid, [block], params, 16)
                t1 = clock()
                self.p.request_finished(rid, [block], {**LEG, "transfer_id": rid}, 16)
                t2 = clock()
                d_call, p_call = t1 - t0, t2 - t1
            events, calls = self.poll(self.d)
            t3 = clock()
            polls["d"] += calls
            self.expect(events, "blocks_ready", rid)
            events, calls = self.poll(self.p)
            t4 = clock()
            polls["p"] += calls
            self.expect(events, "blocks_free", rid)
            parts["p_call"].append(p_call)
            parts["d_call"].append(d_call)
            parts["d_poll"].append(t3 - t2)
            parts["p_poll"].append(t4 - t3)
            parts["d_side"].append(d_call + (t3 - t2))
            parts["p_side"].append(p_call + (t4 - t3))
            parts["lifecycle"].append(t4 - t0)
        parts["_polls_per_request_d"] = [polls["d"] / n]  # type: ignore[list-item]
        parts["_polls_per_request_p"] = [polls["p"] / n]  # type: ignore[list-item]
        return parts

    def pipelined(self, n: int, batch: int) -> float:
        """``n`` requests, ``batch`` in flight; returns µs per lifecycle (wall ÷ n)."""
        start = time.perf_counter_ns()
        done = 0
        while done < n:
            size = min(batch, n - done)
            rids = []
            for k in range(size):
                self.seq += 1
                rid = f"b{self.seq}"
                answer = self.p.request_finished(rid, [k], LEG, 16)
                self.d.request_allocated(rid, [k], answer, 16)
                rids.append(rid)
            want_d = want_p = size
            deadline = time.monotonic() + 30
            while want_d or want_p:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"batch stuck: {want_d} D and {want_p} P events missing")
                for e in self.d.poll_events() if self.poll_mode == "busy" else self.d.wait_events(0.01):
                    if e["kind"] != "blocks_ready":
                        raise RuntimeError(f"D: {e}")
                    want_d -= 1
                for e in self.p.poll_events():
                    if e["kind"] != "blocks_free" or e["released"] is not None:
                        raise RuntimeError(f"P: {e}")
                    want_p -= 1
            done += size
        return (time.perf_counter_ns() - start) * NS / n

    def empty_poll(self, n: int = 20_000) -> list[int]:
        out = []
        clock = time.perf_counter_ns
        for _ in range(n):
            t = clock()
            self.p.poll_events()
            out.append(clock() - t)
        return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64, help="requests in flight (pipelined)")
    parser.add_argument("--order", choices=["p-first", "d-first"], default="p-first")
    parser.add_argument("--poll", choices=["busy", "wait"], default="busy")
    parser.add_argument("--mode", choices=["both", "serial", "pipelined"], default="both")
    args = parser.parse_args()
    if args.batch > POOL or args.requests <= 0 or args.rounds <= 0:
        parser.error(f"--requests and --rounds > 0, --batch <= {POOL}")

    bench = Bench(args.poll)
    try:
        bench.serial(200, args.order)  # warm: connections, allocations, caches
        result: dict[str, Any] = {
            "bench": "python_lifecycle",
            "transport": "mem",
            "requests_per_round": args.requests,
            "rounds": args.rounds,
            "blocks_per_request": 1,
            "block_bytes": BLOCK_BYTES,
            "order": args.order,
            "poll": args.poll,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "unit": "us",
        }
        if args.mode in ("both", "serial"):
            rounds = [bench.serial(args.requests, args.order) for _ in range(args.rounds)]
            serial: dict[str, Any] = {}
            for key in rounds[0]:
                if key.startswith("_"):
                    serial[key[1:]] = round(statistics.mean(r[key][0] for r in rounds), 2)
                    continue
                every = [v for r in rounds for v in r[key]]
                means = [statistics.mean(r[key]) * NS for r in rounds]
                serial[key] = summary(every, means)
            serial["empty_poll"] = summary(bench.empty_poll())
            result["serial"] = serial
        if args.mode in ("both", "pipelined"):
            per = [bench.pipelined(args.requests, args.batch) for _ in range(args.rounds)]
            result["pipelined"] = {
                "batch": args.batch,
                "us_per_lifecycle_rounds": [round(x, 2) for x in per],
                "us_per_lifecycle_median": round(statistics.median(per), 2),
                "lifecycles_per_sec_median": round(1e6 / statistics.median(per)),
            }
        result["metrics"] = {k: v for k, v in kvhandoff.metrics().items()
                             if k in ("requests_ready", "requests_sent", "bytes_sent")}
        print(json.dumps(result, indent=2))
        return 0
    finally:
        bench.close()


if __name__ == "__main__":
    sys.exit(main())
