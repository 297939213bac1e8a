#!/usr/bin/env python3
"""Where a batched decode step's CPU goes, B = 1..N, this tree's _kernels against another build's,
alternating step by step in one process (issue 23; a shared machine's drift falls on both alike).

    python scripts/bench_batch_parts.py [-m /tmp/f4.gguf] [--old /path/to/other/_kernels.so]
                                        [--streams 4] [--reps 3] [--prompt 64]

One kernel thread (the kernels then run on the calling thread, so its CPU time is the step's
work even on a loaded machine). Each rep runs, per build, one step at B = 1 (Model.forward) and
B = 2..N (Model.forward_batch) on N prefilled sessions; the build is swapped by pointing
engine.backends.cpu.kernels._K at the other module (the Python is this tree's for both).
Parts (CPU ms of the calling thread, by wrapping the ops object's methods): head (the output
matmul), experts (ops.moe: routed + shared), q8 (other Q8_0 matmuls), f16 (matmuls of F16
weights: compressors, router, HC), attention, rest (norms, RoPE, HC mixing, KV glue, Python).
Prints the median of the reps per (build, B) and the step's ratio to B = 1.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine import Engine  # noqa: E402
from engine.backends.cpu import kernels as K  # noqa: E402
from engine.gguf import quants as Q  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts"))
from bench_q8_batch import load_build  # noqa: E402

PARTS = ("head", "experts", "q8", "f16", "attention", "rest")


def wrap(ops, m, parts: dict, clock=time.thread_time):
    def timed(name, f):
        def g(*args, **kw):
            t0 = clock()
            try:
                return f(*args, **kw)
            finally:
                w = args[0] if args else None
                if name == "moe":
                    key = "experts"
                elif name == "attention":
                    key = "attention"
                elif w is m.w.output:
                    key = "head"
                else:
                    w0 = w[0] if isinstance(w, list) else w
                    key = "q8" if getattr(w0, "type_id", None) == Q.Q8_0 else "f16"
                parts[key] = parts.get(key, 0.0) + clock() - t0
        return g
    names = ("linear", "linears", "grouped_linear", "moe", "attention")
    for name in names:
        setattr(ops, name, timed(name, getattr(ops, name)))
    return names


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", default="/tmp/f4.gguf")
    ap.add_argument("--old", default=None)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1,
                    help="kernel threads; above 1 every figure is wall time (the other threads' work is not "
                         "the calling thread's CPU time), so run it on a quiet machine")
    a = ap.parse_args()
    clock = time.thread_time if a.threads == 1 else time.perf_counter
    eng = Engine.open(a.m, backend="cpu", threads=a.threads)
    eng.wait_resident()
    m, ops = eng.model, eng.model.ops
    builds = [("new", K._K)] + ([("old", load_build(a.old))] if a.old else [])
    for _, mod in builds:
        mod.set_threads(a.threads)
    print(f"isa {K.isa()}, paging {eng.paging}, {a.threads} thread(s) ({'CPU' if a.threads == 1 else 'wall'} ms), "
          f"{a.reps} reps; load {os.getloadavg()}", flush=True)
    rng = np.random.default_rng(7)
    ps = [rng.integers(1000, 100000, a.prompt) for _ in range(a.streams)]
    states = [ops.new_state(eng.config, a.ctx, 64) for _ in ps]
    for p, st in zip(ps, states):
        ops.logits_to_host(m.forward(np.array(p), 0, st))
    pos = [a.prompt] * a.streams
    parts: dict = {}
    names = wrap(ops, m, parts, clock)
    res = {(n, b): [] for n, _ in builds for b in range(1, a.streams + 1)}
    try:
        for _ in range(a.reps):
            for n, mod in builds:
                K._K = mod
                for b in range(1, a.streams + 1):
                    parts.clear()
                    t0 = clock()
                    if b == 1:
                        ops.logits_to_host(m.forward(np.array([11]), pos[0], states[0]))
                    else:
                        ops.logits_to_host(m.forward_batch([11 + i for i in range(b)], pos[:b], states[:b]))
                    dt = clock() - t0
                    res[(n, b)].append((dt, dict(parts, rest=dt - sum(parts.values()))))
                    pos = [p + 1 if i < b else p for i, p in enumerate(pos)]
    finally:
        K._K = builds[0][1]
        for name in names:
            delattr(ops, name)
    print(f"load after {os.getloadavg()}")
    print("build B  step_ms  vs_B1  " + "  ".join(f"{p:>9s}" for p in PARTS))
    for n, _ in builds:
        base = None
        for b in range(1, a.streams + 1):
            runs = res[(n, b)]
            step = statistics.median(r[0] for r in runs) * 1e3
            base = base or step
            cols = [statistics.median(r[1].get(p, 0.0) for r in runs) * 1e3 for p in PARTS]
            print(f"{n:5s} {b}  {step:7.1f}  {step / base:5.2f}  " + "  ".join(f"{c:9.1f}" for c in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
