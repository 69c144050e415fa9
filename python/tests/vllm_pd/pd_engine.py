"""One vLLM engine (a single instance, P or D) in its own OS process, driven over a pipe by
``run_pd.py``. Importable (by the driver's spawned child and by vLLM's worker processes, for
``worker_metrics``); it imports vLLM only inside the functions.

Commands (tuples) on the pipe: ``("submit", [req, ...])`` with ``req`` a dict ``{"id",
"prompt", "max_tokens", "params" (kv_transfer_params or None), "abort_after_s" (optional)}``;
``("metrics",)``; ``("quit",)``. Replies: ``("ready", startup_s)``, ``("done", id, tokens,
finish_reason, kv_transfer_params)`` per request, ``("metrics", dict)``, ``("error", text)``.
"""

from __future__ import annotations

import os
import time
import traceback


def worker_metrics(*_args, **_kwargs):
    """kvhandoff's counters in the process that runs it (a vLLM worker, via collective_rpc)."""
    import kvhandoff
    from kvhandoff.vllm import handover_counts

    m = dict(kvhandoff.metrics())
    m.update({f"p_{k}": v for k, v in handover_counts().items()})
    m["worker_pid"] = os.getpid()
    m["worker_parent_pid"] = os.getppid()  # the executor's process: where the scheduler runs
    return m


class KvhMetricsExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``): ``collective_rpc(
    "kvhandoff_metrics")`` then needs no pickled function across EngineCore's channel."""

    def kvhandoff_metrics(self):
        return worker_metrics()


def engine_main(conn, name, role, model, extra, policy, mp_layout, block_size):
    try:
        _engine_main(conn, name, role, model, extra, policy, mp_layout, block_size)
    except BaseException:  # noqa: BLE001 - report anything to the driver, then die
        try:
            conn.send(("error", f"{name}: {traceback.format_exc()}"))
        except Exception:  # noqa: BLE001
            pass
        raise


def _engine_main(conn, name, role, model, extra, policy, mp_layout, block_size):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(
        model=model,
        skip_tokenizer_init=True,
        dtype="float32",
        seed=0,
        max_model_len=512,
        enforce_eager=True,
        max_num_seqs=8,
        block_size=block_size,
        enable_prefix_caching=False,
    )
    if role != "single":
        kw["kv_transfer_config"] = {
            "kv_connector": "KvHandoffConnector",
            "kv_connector_module_path": "kvhandoff.vllm",
            "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
            "kv_connector_extra_config": dict(extra or {}),
            "kv_load_failure_policy": policy,
        }
    if mp_layout:
        kw["distributed_executor_backend"] = "mp"
        kw["worker_extension_cls"] = "pd_engine.KvhMetricsExtension"
    t0 = time.monotonic()
    llm = LLM(**kw)
    engine = llm.llm_engine
    core = getattr(engine.engine_core, "engine_core", None)  # in-process: the EngineCore
    sched = getattr(core, "scheduler", None)
    conn.send(("ready", round(time.monotonic() - t0, 1), os.getpid()))

    live: dict[str, dict] = {}  # id -> {"abort_after": seconds | None, "t": submitted at}

    def metrics():
        if mp_layout:
            out = llm.collective_rpc("kvhandoff_metrics")
            m = dict(out[0])
        else:
            m = worker_metrics()
        m["scheduler_busy"] = bool(sched.has_requests()) if sched is not None else None
        m["pid"] = os.getpid()
        return m

    while True:
        busy = bool(live) or (sched is not None and sched.has_requests())
        if conn.poll(0 if busy else 0.2):
            cmd = conn.recv()
            if cmd[0] == "quit":
                break
            if cmd[0] == "metrics":
                conn.send(("metrics", metrics()))
                continue
            if cmd[0] == "submit":
                for r in cmd[1]:
                    extra_args = {"kv_transfer_params": r["params"]} if r.get("params") is not None else None
                    sp = SamplingParams(
                        temperature=0,
                        max_tokens=r["max_tokens"],
                        ignore_eos=True,
                        detokenize=False,
                        extra_args=extra_args,
                    )
                    engine.add_request(r["id"], TokensPrompt(prompt_token_ids=list(r["prompt"])), sp)
                    live[r["id"]] = {"abort_after": r.get("abort_after_s"), "t": time.monotonic()}
                continue
        if not busy:
            continue
        oq = getattr(engine.engine_core, "outputs_queue", None)  # vLLM's EngineCore process layout
        if sched is None and oq is not None and oq.empty():
            outs = []  # step() would block until EngineCore sends something: poll instead
        else:
            outs = engine.step()
        for o in outs:
            if o.finished and o.request_id in live:
                live.pop(o.request_id)
                c = o.outputs[0] if o.outputs else None
                conn.send((
                    "done",
                    o.request_id,
                    list(c.token_ids) if c is not None else [],
                    (c.finish_reason if c is not None else None),
                    o.kv_transfer_params,
                ))
        for rid, st in list(live.items()):
            if st["abort_after"] is not None and time.monotonic() - st["t"] > st["abort_after"]:
                engine.abort_request([rid])
                live.pop(rid)
                conn.send(("done", rid, None, "aborted_by_driver", None))
        if not outs:
            time.sleep(0.001)  # only connector work left: do not spin the 2 cores flat out
    conn.send(("bye",))
