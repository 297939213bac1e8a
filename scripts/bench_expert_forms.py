#!/usr/bin/env python3
"""Per-product cost of the routed experts' integer kernels at few tokens, row kernels against the
GEMM form, for one or two checkouts alternating (old, new, old, new, ...): where the GEMM form
should take over (kern_isa.q8g_min_t) and what a kernel change gained.

A prefill chunk gives each routed expert a handful of tokens (512 tokens x 6 of 256 experts: ~12
on average, Poisson-like), so each expert's weights are decoded once for a few products.  A
worker imports `engine` from its checkout (built in place), makes a pool of expert matrices of the
file's shapes (gate/up: IQ2_XXS 2048 x 4096; down: Q2_K 4096 x 2048; 8 of each, cycled so that the
weights come from L3/DRAM as in a prefill) and times K.matmul_q8 per matrix at each T with the row
kernels forced and with the GEMM form forced, on one kernel thread, in the calling thread's CPU
time (time.thread_time: other jobs' preemptions do not count).  Printed per case: min and median
over rounds of each checkout's best-of-reps time, in microseconds a product.

    .venv/bin/python scripts/bench_expert_forms.py ROOT [ROOT2] [--rounds 5] [--ts 1,2,4,6,8,12,16,32]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SHAPES = {"IQ2_XXS": (2048, 4096), "Q2_K": (4096, 2048)}
POOL = 8


def worker(ts: list[int], reps: int, only: str) -> None:
    import numpy as np
    from engine.backends.cpu import kernels as K
    from engine.gguf import quants as Q
    C = K._K
    C.set_threads(1)
    out = {"isa": K.isa()}
    for name, (rows, n_in) in SHAPES.items():
        if only and only not in name:
            continue
        t = getattr(Q, name)
        rng = np.random.default_rng(1)
        pool = [Q.random_blocks(t, rng, rows * n_in // Q.FORMATS[t].block_elems, 0.05).reshape(rows, -1)
                for _ in range(POOL)]
        forms = [("row", 10**6)] + ([("gemm", 1)] if K.q8_gemm_min_t(t) else [])
        for form, gmin in forms:
            C.q8_gemm_min_t(t, gmin)
            for T in ts:
                x = rng.standard_normal((T, n_in)).astype(np.float32)
                K.matmul_q8(t, pool[0], x)
                best = float("inf")
                for _ in range(reps):
                    t0 = time.thread_time()
                    for w in pool:
                        K.matmul_q8(t, w, x)
                    best = min(best, (time.thread_time() - t0) / POOL)
                out[f"{name} {form} T={T}"] = best
        C.q8_gemm_min_t(t, 0)
    print(json.dumps(out))


def run(root: str, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--ts", args.ts, "--reps", str(args.reps),
           "--only", args.only]
    res = subprocess.run(cmd, cwd=root, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": root})
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("roots", nargs="*")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ts", default="1,2,4,6,8,12,16,32")
    ap.add_argument("--only", default="")
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args()
    if args.worker:
        worker([int(v) for v in args.ts.split(",")], args.reps, args.only)
        return
    if not 1 <= len(args.roots) <= 2:
        sys.exit("give one or two checkout roots")
    res: dict[str, list[dict]] = {r: [] for r in args.roots}
    for _ in range(args.rounds):
        for r in args.roots:
            res[r].append(run(r, args))
    keys = [k for k in res[args.roots[0]][0] if k != "isa"]
    print("case".ljust(22) + "".join(f"{os.path.basename(r)[:14] + ' min/med us':>28}" for r in args.roots))
    for k in keys:
        cols = []
        for r in args.roots:
            v = [1e6 * d[k] for d in res[r]]
            cols.append(f"{min(v):>14.0f}{statistics.median(v):>14.0f}")
        print(k.ljust(22) + "".join(cols))


if __name__ == "__main__":
    main()
