"""The proof with a real vLLM (0.32.0, CPU): P and D as two OS processes hand KV over through
``kvhandoff.vllm.KvHandoffConnector``, and D's greedy tokens equal a single instance's.

    python run_pd.py --part main   # single instance, then P+D in-process layout: push, pull,
                                   # negative controls, aborts, P killed, a new P handing
                                   # over layer-wise (extra config "layerwise": true)
    python run_pd.py --part mp     # P and D with scheduler and worker in different processes
                                   # (KVH_MP_ENGINE_CORE=1: vLLM's full layout, API process,
                                   # EngineCore process with the scheduler, worker process)

The driver is the router: it sends each prompt to P with ``max_tokens=1`` and
``kv_transfer_params={"do_remote_decode": True}``, then the original prompt to D with P's
returned ``kv_transfer_params``. Every wait has a deadline; a hung engine is killed.
Prints ``PASS``/``FAIL`` lines and exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import pd_engine  # noqa: E402
from make_checkpoint import make_checkpoint  # noqa: E402

BLOCK = 32
MAX_TOKENS = 16
START_DEADLINE = float(os.environ.get("KVH_START_DEADLINE", "300"))
RUN_DEADLINE = float(os.environ.get("KVH_RUN_DEADLINE", "120"))

RESULTS: list[tuple[str, bool, str]] = []


def check(name: str, ok: bool, detail: str = "") -> bool:
    RESULTS.append((name, bool(ok), detail))
    print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
    return ok


def prompts() -> list[list[int]]:
    """Mixed lengths, none a block multiple, some over one block, two sharing a prefix."""
    rng = random.Random(0)
    lens = [5, 23, 40, 57, 70, 101]
    ps = [[rng.randrange(3, 1000) for _ in range(n)] for n in lens]
    ps.append(ps[3][:45] + [rng.randrange(3, 1000) for _ in range(8)])  # shares 45 tokens with #3
    return ps


class Engine:
    """One engine process; every wait has a deadline, after which the process is killed."""

    def __init__(self, name, role, model, extra=None, policy="fail", mp_layout=False, env=None):
        self.name = name
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        old = {k: os.environ.get(k) for k in (env or {})}
        os.environ.update(env or {})
        try:
            self.proc = ctx.Process(
                target=pd_engine.engine_main,
                args=(child, name, role, model, extra, policy, mp_layout, BLOCK),
                name=name,
                daemon=False,
            )
            self.proc.start()
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        child.close()
        self.startup_s = None
        self.t0 = time.monotonic()

    def _recv(self, deadline: float):
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise TimeoutError(f"{self.name}: no answer before the deadline (killed)")
            if self.conn.poll(min(left, 1.0)):
                msg = self.conn.recv()
                if msg[0] == "error":
                    self.kill()
                    raise RuntimeError(msg[1])
                return msg
            if not self.proc.is_alive():
                raise RuntimeError(f"{self.name}: the process died (exit {self.proc.exitcode})")

    def wait_ready(self, timeout=START_DEADLINE):
        msg = self._recv(time.monotonic() + timeout)
        assert msg[0] == "ready", msg
        self.startup_s = msg[1]
        print(f"  {self.name} ready in {self.startup_s} s (pid {msg[2]})", flush=True)
        return self

    def run(self, reqs, timeout=RUN_DEADLINE):
        """Submits ``reqs`` and returns {id: (tokens, finish_reason, kv_transfer_params)}."""
        self.submit(reqs)
        return self.collect([r["id"] for r in reqs], timeout)

    def submit(self, reqs):
        self.conn.send(("submit", reqs))

    def collect(self, ids, timeout=RUN_DEADLINE):
        out = {}
        deadline = time.monotonic() + timeout
        while len(out) < len(ids):
            msg = self._recv(deadline)
            if msg[0] == "done":
                out[msg[1]] = (msg[2], msg[3], msg[4])
        return out

    def metrics(self, timeout=60):
        self.conn.send(("metrics",))
        deadline = time.monotonic() + timeout
        while True:
            msg = self._recv(deadline)
            if msg[0] == "metrics":
                return msg[1]

    def wait_idle(self, timeout=30):
        """Until the engine's scheduler holds no request (blocks all handed back)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = self.metrics()
            if not m.get("scheduler_busy"):
                return m
            time.sleep(0.2)
        return self.metrics()

    def quit(self, timeout=60):
        if not self.proc.is_alive():
            return
        try:
            self.conn.send(("quit",))
        except Exception:  # noqa: BLE001
            pass
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.kill()

    def kill(self):
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.join(10)


def p_leg(p: Engine, tag: str, ps, extra_params=None):
    """The router's first leg: P prefills each prompt, returns the params for D."""
    reqs = []
    for i, pr in enumerate(ps):
        params = {"do_remote_decode": True}
        params.update(extra_params or {})
        reqs.append({"id": f"{tag}-{i}", "prompt": pr, "max_tokens": 1, "params": params})
    out = p.run(reqs)
    return [out[f"{tag}-{i}"] for i in range(len(ps))]


def d_leg(d: Engine, tag: str, ps, p_out, timeout=RUN_DEADLINE):
    reqs = [
        {"id": f"{tag}-{i}", "prompt": pr, "max_tokens": MAX_TOKENS, "params": p_out[i][2]}
        for i, pr in enumerate(ps)
    ]
    out = d.run(reqs, timeout=timeout)
    return [out[f"{tag}-{i}"] for i in range(len(ps))]


def reference(model: str, ps, env) -> list[list[int]]:
    single = Engine("single", "single", model, env=env).wait_ready()
    out = single.run([{"id": f"ref-{i}", "prompt": pr, "max_tokens": MAX_TOKENS, "params": None}
                      for i, pr in enumerate(ps)])
    single.quit()
    return [out[f"ref-{i}"][0] for i in range(len(ps))]


def handoff(p, d, tag, ps, ref, extra_params=None):
    """Push (or pull) the batch through P and D; checks equality and D's counters."""
    before = d.metrics()
    p_out = p_leg(p, tag, ps, extra_params)
    ok_p = all(o[2] and o[2].get("do_remote_prefill") for o in p_out)
    check(f"{tag}: P returned kv_transfer_params for every prompt", ok_p,
          "" if ok_p else str([o[2] for o in p_out]))
    check(f"{tag}: P's one token equals the single instance's first",
          all(o[0] == r[:1] for o, r in zip(p_out, ref)))
    if not ok_p:
        return None
    d_out = d_leg(d, tag, ps, p_out)
    eq = [o[0] == r for o, r in zip(d_out, ref)]
    check(f"{tag}: D's tokens equal the single instance's ({sum(eq)}/{len(ps)})", all(eq),
          "" if all(eq) else str([(o[0], o[1], r) for o, r, e in zip(d_out, ref, eq) if not e][:2]))
    after = d.metrics()
    ready = after["requests_ready"] - before["requests_ready"]
    got = after["bytes_received"] - before["bytes_received"]
    check(f"{tag}: D loaded the KV (requests_ready +{ready}, bytes_received +{got})",
          ready == len(ps) and got > 0)
    return d_out


def part_main(model, env, ref_path):
    ps = prompts()
    t = time.monotonic()
    # Start P and D first (slow), compute the reference meanwhile.
    p = Engine("P", "prefill", model, extra={"fault": "params"}, env=env)
    d = Engine("D", "decode", model, extra={"handshake_timeout_ms": 3000}, env=env)
    try:
        ref = reference(model, ps, env)
        with open(ref_path, "w") as f:
            json.dump({"prompts": ps, "ref": ref}, f)
        check("single instance produced varied tokens", len({tuple(r) for r in ref}) == len(ref))
        p.wait_ready()
        d.wait_ready()
        print(f"  [main] engines ready after {time.monotonic() - t:.0f} s", flush=True)

        handoff(p, d, "push", ps, ref)
        handoff(p, d, "pull", ps, ref, {"transfer_mode": "pull"})

        # vLLM's P scheduler answers the router before its worker hands the export to the
        # rank (with the next step's metadata). Here P's worker hands them over a second late
        # (test fault late_export): D's first asks find nothing under the key, and D must ask
        # again, then load. Before the reader asked again, such requests failed.
        asked = d.metrics().get("reads_asked_again", 0)
        handoff(p, d, "pull-late", ps, ref, {"transfer_mode": "pull", "kvhandoff_fault": "late_export"})
        again = d.metrics().get("reads_asked_again", 0) - asked
        check(f"pull-late: D asked again while P's rank did not have the exports yet (+{again})",
              again > 0)

        # Negative control 1: P overwrites the blocks before handing them over.
        p_out = p_leg(p, "corrupt", ps, {"kvhandoff_fault": "corrupt"})
        d_out = d_leg(d, "corrupt", ps, p_out)
        same = [o[0] == r for o, r in zip(d_out, ref)]
        check(f"corrupt: D's tokens differ from the single instance's ({len(ps) - sum(same)}/{len(ps)} differ)",
              not any(same), str([o[1] for o in d_out]))

        # Negative control 2: P drops (aborts) the hand-over: D's loads fail (policy "fail").
        # P aborts right after handing over; a write that completed before the abort (D had
        # registered first) is a real, intact load: then D's tokens must equal the reference.
        # Which side wins is timing, so the control runs again (up to three rounds) until a
        # load failed: the precondition it exists for. Every round must be failed-or-intact.
        failed, intact, rounds, wrong, counted = [], [], 0, [], True
        while rounds < 3 and not any(failed):
            before = d.metrics()
            tag = "drop" if rounds == 0 else f"drop-r{rounds}"
            p_out = p_leg(p, tag, ps[:3], {"kvhandoff_fault": "drop"})
            d_out = d_leg(d, tag, ps[:3], p_out)
            after = d.metrics()
            round_failed = [o[1] == "error" and not o[0] for o in d_out]
            round_intact = [o[0] == r for o, r in zip(d_out, ref)]
            wrong += [(o[0], o[1]) for o, f, i in zip(d_out, round_failed, round_intact)
                      if not (f or i)]
            counted &= after["requests_failed"] - before["requests_failed"] == sum(round_failed)
            failed += round_failed
            intact += round_intact
            rounds += 1
        check(f"drop: every D request failed (FINISHED_ERROR, no tokens: {sum(failed)}/{len(failed)}) or "
              f"loaded intact KV ({sum(intact)}/{len(intact)}), never a wrong success; at least one "
              f"failed ({rounds} round(s))",
              not wrong and any(failed), str(wrong))
        check("drop: D counted the failures (requests_failed up by each round's failures)", counted)
        check("drop: D handed every block back", not d.wait_idle()["scheduler_busy"])
        check("drop: P handed every block back", not p.wait_idle()["scheduler_busy"])

        # Abort on P: a remote-decode request aborted before it finished.
        out = p.run([{"id": "p-abort", "prompt": ps[4], "max_tokens": 200,
                      "params": {"do_remote_decode": True}, "abort_after_s": 0.3}])
        check("abort on P: aborted, no params", out["p-abort"][1] == "aborted_by_driver")
        check("abort on P: P handed its blocks back", not p.wait_idle()["scheduler_busy"])

        # Abort on D while waiting for KV no P will send (a transfer id P never saw).
        p_out = p_leg(p, "dabort-src", ps[1:2])
        params = dict(p_out[0][2], transfer_id="never-sent-by-p")
        before = d.metrics()
        out = d.run([{"id": "d-abort", "prompt": ps[1], "max_tokens": MAX_TOKENS, "params": params,
                      "abort_after_s": 1.0}])
        check("abort on D: aborted while waiting", out["d-abort"][1] == "aborted_by_driver")
        m = d.wait_idle()
        check("abort on D: D handed the blocks back", not m["scheduler_busy"], str(m))
        # The prefill of dabort-src is still held by P: a D for it now still works.
        d_out = d_leg(d, "dabort-src", ps[1:2], p_out)
        check("after the aborts: P and D still hand over", d_out[0][0] == ref[1])
        check("after the aborts: P handed every block back", not p.wait_idle()["scheduler_busy"])

        # P killed (SIGKILL): one D request registered and waiting at that moment (for a
        # transfer P never finishes), three more whose prefill P finished just before.
        p_out = p_leg(p, "kill", ps[:3])
        d.submit([{"id": "kill-waiting", "prompt": ps[1], "max_tokens": MAX_TOKENS,
                   "params": dict(p_out[1][2], transfer_id="never-finished-by-p")}])
        time.sleep(1.0)
        t_kill = time.monotonic()
        p.kill()
        waiting = d.collect(["kill-waiting"], timeout=90)["kill-waiting"]
        check(f"P killed: D's waiting request failed cleanly in {time.monotonic() - t_kill:.1f} s",
              waiting[1] == "error" and not waiting[0], str(waiting[:2]))
        t_kill = time.monotonic()
        d_out = d_leg(d, "kill", ps[:3], p_out, timeout=90)
        check(f"P killed: D's requests for the dead P failed cleanly in {time.monotonic() - t_kill:.1f} s",
              all(o[1] == "error" and not o[0] for o in d_out), str([(o[0], o[1]) for o in d_out]))
        m = d.metrics()
        print(f"  P killed: D fenced {m['requests_fenced']} request(s); their blocks come back after the "
              f"rank's quarantine (200 s by default), not waited for here", flush=True)
        out = d.run([{"id": "local", "prompt": ps[2], "max_tokens": MAX_TOKENS, "params": None}])
        check("P killed: D serves a request without remote prefill", out["local"][0] == ref[2])

        # A new P, handing over layer-wise (the prompts of 32 tokens and more in two parts,
        # one per layer; shorter ones as one part), serves D afterwards: the same 7 prompts.
        # Then a D under kv_load_failure_policy="recompute".
        p = Engine("P2", "prefill", model, env=env,
                   extra={"fault": "params", "layerwise": True, "layerwise_min_tokens": BLOCK})
        d2 = Engine("D2", "decode", model, policy="recompute", env=env)
        p.wait_ready()
        before = p.metrics()
        handoff(p, d, "layerwise", ps, ref)
        after = p.metrics()
        started = after["p_prefill_started"] - before["p_prefill_started"]
        reports = after["p_layers_ready"] - before["p_layers_ready"]
        whole = after["p_request_finished"] - before["p_request_finished"]
        check(f"layerwise: P started every prompt layer-wise (prefill_started +{started}, layers_ready "
              f"+{reports}, whole handovers +{whole})",
              started == len(ps) and reports == 2 * len(ps) and whole == 0)
        check("layerwise: P handed every block back", not p.wait_idle()["scheduler_busy"])
        d2.wait_ready()
        before = d2.metrics()
        # (P2 is layer-wise: "drop" aborts each request right after its prefill_started.)
        p_out = p_leg(p, "drop-recompute", ps[:3], {"kvhandoff_fault": "drop"})
        d_out = d_leg(d2, "drop-recompute", ps[:3], p_out)
        after = d2.metrics()
        failed = after["requests_failed"] - before["requests_failed"]
        loaded = after["requests_ready"] - before["requests_ready"]
        check(f"drop, policy recompute: D's tokens equal the reference ({failed} load(s) failed and were "
              f"recomputed, {loaded} loaded)",
              all(o[0] == r for o, r in zip(d_out, ref)) and failed + loaded == 3 and failed >= 1,
              str([(o[0][:3], o[1]) for o in d_out]))
    finally:
        for e in (p, d) + ((d2,) if "d2" in locals() else ()):
            e.quit()


def part_mp(model, env, ref_path):
    ps = prompts()[1:4]
    if os.path.exists(ref_path):
        with open(ref_path) as f:
            data = json.load(f)
        ref = data["ref"][1:4]
        assert data["prompts"][1:4] == ps
    else:
        ref = reference(model, ps, env)
    # The scheduler runs in the engine's process (or, with KVH_MP_ENGINE_CORE=1, in vLLM's
    # EngineCore process), the worker in a process of vLLM's multiprocess executor.
    engine_core_proc = os.environ.get("KVH_MP_ENGINE_CORE") == "1"
    mp_env = dict(env, VLLM_ENABLE_V1_MULTIPROCESSING="1" if engine_core_proc else "0")
    p = Engine("P-mp", "prefill", model, mp_layout=True, env=mp_env)
    d = Engine("D-mp", "decode", model, mp_layout=True, env=mp_env)
    try:
        p.wait_ready()
        d.wait_ready()
        for e in (p, d):
            m = e.metrics()
            where = "vLLM's EngineCore process" if engine_core_proc else "the LLM process"
            check(f"mp: {e.name}'s worker (pid {m['worker_pid']}) runs apart from its scheduler "
                  f"(pid {m['worker_parent_pid']}, {where}; LLM process pid {m['pid']})",
                  m["worker_pid"] not in (m["worker_parent_pid"], m["pid"])
                  and (m["worker_parent_pid"] != m["pid"]) == engine_core_proc)
        handoff(p, d, "mp-push", ps, ref)
        handoff(p, d, "mp-pull", ps, ref, {"transfer_mode": "pull"})
        # An abort on D while it waits for KV (a transfer P never finishes), across processes.
        p_out = p_leg(p, "mp-dabort-src", ps[:1])
        before = d.metrics()
        out = d.run([{"id": "mp-d-abort", "prompt": ps[0], "max_tokens": MAX_TOKENS,
                      "params": dict(p_out[0][2], transfer_id="never-sent-by-p"), "abort_after_s": 1.0}])
        time.sleep(1.0)
        after = d.metrics()
        check("mp: abort on D while waiting: the rank failed it "
              f"(requests_failed +{after['requests_failed'] - before['requests_failed']})",
              out["mp-d-abort"][1] == "aborted_by_driver"
              and after["requests_failed"] - before["requests_failed"] == 1)
        d_out = d_leg(d, "mp-dabort-src", ps[:1], p_out)
        check("mp: after the abort, D still loads from P", d_out[0][0] == ref[0])
        if not engine_core_proc:  # the scheduler is reachable only in this process
            check("mp: P handed every block back", not p.wait_idle()["scheduler_busy"])
    finally:
        for e in (p, d):
            e.quit()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=["main", "mp"], default="main")
    ap.add_argument("--model", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "kvhandoff-tiny-llama"))
    ap.add_argument("--ref", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "kvhandoff-pd-ref.json"))
    args = ap.parse_args()
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "PYTHONPATH": os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")])),
    }
    os.environ.update(env)
    t = time.monotonic()
    model = make_checkpoint(args.model)
    try:
        (part_main if args.part == "main" else part_mp)(model, env, args.ref)
    except Exception as e:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        check(f"{args.part}: ran to the end", False, f"{type(e).__name__}: {e}")
    failed = [r for r in RESULTS if not r[1]]
    print(f"[{args.part}] {len(RESULTS) - len(failed)}/{len(RESULTS)} checks passed in "
          f"{time.monotonic() - t:.0f} s", flush=True)
    sys.exit(1 if failed or not RESULTS else 0)


if __name__ == "__main__":
    main()
