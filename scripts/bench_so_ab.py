#!/usr/bin/env python3
"""A/B of two builds of the kernel extension in one process, alternating call by call (ABAB...):
each .so is loaded by path as its own module, and the experts' products (matmul_q8_batch, one
kernel thread) are timed in the calling thread's CPU time, so both builds see the same machine
load, caches and inputs.  Prints min and median per build and case, and each build's outputs are
compared bit for bit.

    .venv/bin/python scripts/bench_so_ab.py OLD.so NEW.so [--rounds 7] [--ts 1,4,12] [--form gemm|row|default]
"""
from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import statistics
import time

import numpy as np

from engine.gguf import quants as Q

SHAPES = {"IQ2_XXS": (2048, 4096), "Q2_K": (4096, 2048), "Q8_0": (4096, 4096)}


def load(path: str):
    loader = importlib.machinery.ExtensionFileLoader("_kernels", path)
    spec = importlib.util.spec_from_file_location("_kernels", path, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--ts", default="1,4,12")
    ap.add_argument("--types", default="IQ2_XXS,Q2_K")
    ap.add_argument("--form", default="gemm", choices=["gemm", "row", "default"])  # default: each build's crossover
    ap.add_argument("--pool", type=int, default=8)
    args = ap.parse_args()
    mods = {"old": load(args.old), "new": load(args.new)}
    for m in mods.values():
        m.set_threads(1)
    rng = np.random.default_rng(1)
    for name in args.types.split(","):
        t = getattr(Q, name)
        rows, n = SHAPES[name]
        pool = [Q.random_blocks(t, rng, rows * n // Q.FORMATS[t].block_elems, 0.05).reshape(rows, -1)
                for _ in range(args.pool)]
        for m in mods.values():
            if args.form != "default":
                m.q8_gemm_min_t(t, 1 if args.form == "gemm" else 10**6)
        for T in [int(v) for v in args.ts.split(",")]:
            x = rng.standard_normal((T, n)).astype(np.float32)
            ys = {k: [np.empty((T, rows), np.float32) for _ in pool] for k in mods}
            times = {k: [] for k in mods}
            for _ in range(args.rounds):
                for k, m in mods.items():
                    t0 = time.thread_time()
                    m.matmul_q8_batch([t] * len(pool), pool, [x] * len(pool), ys[k])
                    times[k].append((time.thread_time() - t0) / len(pool) * 1e6)
            same = all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(ys["old"], ys["new"]))
            print(f"{name} {args.form} T={T}: " + "  ".join(
                f"{k} min {min(v):.0f} med {statistics.median(v):.0f} us" for k, v in times.items())
                + f"  new/old med {statistics.median(times['new']) / statistics.median(times['old']):.3f}"
                + f"  bits {'same' if same else 'DIFFER'}")
        for m in mods.values():
            m.q8_gemm_min_t(t, 0)


if __name__ == "__main__":
    main()
