#!/usr/bin/env python3
"""Random heterogeneous pairs through `kvhandoff cluster` in every mode: each rank and the
router a process of its own over NIXL. Prints one line per run and exits 1 if any run was not
OK (every request verified on every D rank, no byte wrong, nothing leaked, every process
exited; in bidir every next turn read back).

    source scripts/nixl-env.sh && cargo build --release --features nixl -p kvhandoff-cli
    python3 scripts/cluster-sweep.py --seed 4242 --pairs 6
"""
import argparse
import json
import random
import subprocess
import sys

MODELS = ["gqa8", "gqa2", "mla", "swa", "mamba"]
MODES = ["push", "pull", "mixed", "bidir"]


def spec(rng):
    tp, pp = rng.choice([1, 2, 4]), rng.choice([1, 1, 2])
    text = f"tp={tp},block={rng.choice([16, 32, 64])},layout={rng.choice(['NHD', 'HND'])}"
    return (text + (f",pp={pp}" if pp > 1 else ""), tp * pp)


def main():
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--seed", type=int, default=20261128)
    args.add_argument("--pairs", type=int, default=6)
    args.add_argument("--requests", type=int, default=24)
    args.add_argument("--max-processes", type=int, default=6, help="ranks of both engines")
    args.add_argument("--bin", default="target/release/kvhandoff")
    a = args.parse_args()
    rng = random.Random(a.seed)
    failed, ran, tried = 0, 0, 0
    while ran < a.pairs and tried < 50 * a.pairs:
        tried += 1
        model = rng.choice(MODELS)
        (p, pn), (d, dn) = spec(rng), spec(rng)
        if p == d or pn + dn > a.max_processes:
            continue
        for mode in MODES:
            cmd = [a.bin, "cluster", "--json", "--model", model, "--prefill", p, "--decode", d,
                   "--mode", mode, "--requests", str(a.requests),
                   "--seed", str(rng.randint(1, 10**6)), "--timeout-secs", "60"]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode == 2:
                print(f"{model} {p} -> {d}: refused by the planner: {out.stderr.strip()[:160]}")
                break
            try:
                r = json.loads(out.stdout)
            except ValueError:
                failed += 1
                print(f"FAILED {model} {p} -> {d} {mode}: no report\n{out.stderr[-400:]}")
                continue
            turns = [x.get("read_back") for x in r["ranks"] if x["engine"] != "router"]
            ok = (r["ok"] and r["verified"] == r["requests"] and r["byte_errors"] == 0
                  and r["leaked_blocks"] == 0 and r["all_exited"]
                  and (mode != "bidir" or all(t == r["requests"] for t in turns)))
            failed += 0 if ok else 1
            print(f"{'OK    ' if ok else 'FAILED'} {model} {p} -> {d} {mode}: {r['processes']} "
                  f"processes, verified {r['verified']}/{r['requests']}, byte errors "
                  f"{r['byte_errors']}, leaked {r['leaked_blocks']}, all exited "
                  f"{r['all_exited']}, {r['wall_s']:.1f} s", flush=True)
        else:
            ran += 1
    print(f"{ran} pairs, {failed} runs not OK")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
