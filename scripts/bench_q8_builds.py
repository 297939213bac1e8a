#!/usr/bin/env python3
"""Time the integer-activation kernels (kernels.matmul_q8) of two checkouts, alternating, and print
new / old time ratios: for a change to the kernels (e.g. float64 block sums) measured on the same
machine in the same minutes.

Each round runs one worker process per checkout (old, then new); a worker imports `engine` from its
checkout (built in place: `setup.py build_ext --inplace`), decodes nothing, and times matmul_q8 on
ds4 shapes (Q8_0 4096 x 4096, the experts' IQ2_XXS 2048 x 4096 and Q2_K 4096 x 2048) for each T,
with the row kernels forced and, where the build has it, the GEMM form forced; best of --reps.
The ratio printed per case is the median over rounds of new best / old best, with the spread.

--clock cpu (one kernel thread) times the calling thread's CPU time (time.thread_time) instead of
wall time: on a machine shared with other jobs, wall times carry every preemption (tens of ms on
a loaded 2-core VM), while the thread's CPU time counts the kernel's own work only (cache and
memory contention from the others still show).

    .venv/bin/python scripts/bench_q8_builds.py OLD_ROOT NEW_ROOT [--rounds 3] [--threads 2] [--clock cpu]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SHAPES = {"Q8_0": (4096, 4096), "IQ2_XXS": (2048, 4096), "Q2_K": (4096, 2048)}
TS = (1, 8, 16, 64, 512)
# decode from DRAM: one token through a pool of matrices larger than the L3 cache, cycled (Q8_0: an
# output-head-sized 32768 x 4096; the experts' shapes above)
COLD = {"Q8_0": (32768, 4096, 3), "IQ2_XXS": (2048, 4096, 130), "Q2_K": (4096, 2048, 100)}


def worker(reps: int, threads: int, clock: str, only: str) -> None:
    import numpy as np
    from engine.backends.cpu import kernels as K
    from engine.gguf import quants as Q
    C = K._K
    C.set_threads(1 if clock == "cpu" else threads)
    now = time.thread_time if clock == "cpu" else time.perf_counter
    out = {"isa": K.isa()}
    for name, (rows, n_in) in SHAPES.items():
        t = getattr(Q, name)
        rng = np.random.default_rng(1)
        w = Q.random_blocks(t, rng, rows * n_in // Q.FORMATS[t].block_elems, 0.05).reshape(rows, -1)
        forms = [("row", 10**6)] + ([("gemm", 1)] if K.q8_gemm_min_t(t) else [])
        for form, gmin in forms:
            C.q8_gemm_min_t(t, gmin)
            for T in TS:
                if form == "row" and T > 16:
                    continue                          # (the row kernels serve prefill only without a GEMM form)
                if only not in f"{name} {form} T={T}":
                    continue
                x = rng.standard_normal((T, n_in)).astype(np.float32)
                K.matmul_q8(t, w, x)
                best = float("inf")
                for _ in range(reps):
                    t0 = now()
                    K.matmul_q8(t, w, x)
                    best = min(best, now() - t0)
                out[f"{name} {form} T={T}"] = best
        C.q8_gemm_min_t(t, 0)
    for name, (rows, n_in, k) in COLD.items():
        if only not in f"{name} cold T=1":
            continue
        t = getattr(Q, name)
        rng = np.random.default_rng(2)
        pool = [Q.random_blocks(t, rng, rows * n_in // Q.FORMATS[t].block_elems, 0.05).reshape(rows, -1)
                for _ in range(k)]
        x = rng.standard_normal((1, n_in)).astype(np.float32)
        best = float("inf")
        for _ in range(max(2, reps // 2)):
            t0 = now()
            for w in pool:
                K.matmul_q8(t, w, x)
            best = min(best, (now() - t0) / k)
        out[f"{name} cold T=1"] = best
        del pool
    print(json.dumps(out))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: the calling thread's CPU time, one kernel thread (a shared machine)")
    ap.add_argument("--only", default="", help="only the cases whose name contains this (e.g. 'gemm T=512')")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.reps, a.threads, a.clock, a.only)
        return 0
    runs = {"old": [], "new": []}
    for r in range(a.rounds):
        for which in ("old", "new"):
            root = os.path.abspath(getattr(a, which))
            env = dict(os.environ, PYTHONPATH=root, OPENBLAS_NUM_THREADS="1")
            p = subprocess.run([sys.executable, os.path.abspath(__file__), root, root, "--worker",
                                "--reps", str(a.reps), "--threads", str(a.threads), "--clock", a.clock, "--only", a.only],
                               cwd=root, env=env, capture_output=True, text=True, check=True)
            runs[which].append(json.loads(p.stdout))
            print(f"round {r + 1} {which} done ({runs[which][-1]['isa']}, load {os.getloadavg()[0]:.1f})", file=sys.stderr)
    keys = [k for k in runs["old"][0] if k != "isa"]
    print(f"{'case':28s} {'old ms':>9s} {'new ms':>9s} {'new/old median':>15s} {'spread':>14s}")
    for k in keys:
        ratios = [n[k] / o[k] for o, n in zip(runs["old"], runs["new"])]
        o = min(x[k] for x in runs["old"]) * 1e3
        n = min(x[k] for x in runs["new"]) * 1e3
        print(f"{k:28s} {o:9.3f} {n:9.3f} {statistics.median(ratios):15.3f} {min(ratios):6.3f}-{max(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
