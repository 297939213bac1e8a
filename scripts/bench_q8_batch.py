#!/usr/bin/env python3
"""Issue 23's kernel-level measurement: the integer (ds4 numerics) matmuls of a decode step at
T = 1..8 rows, this tree's _kernels against another build's, alternating call by call in one
process (a shared machine's drift falls on both alike), in CPU time of the calling thread.

    python scripts/bench_q8_batch.py [-m /tmp/f4.gguf] [--old /path/to/other/_kernels.so]
                                     [--threads 1] [--reps 5] [--ts 1,2,3,4,8] [--which head,...]

Matrices (layer 1 of the real-width 4-layer file): the output head (Q8_0, 563 MB), attn_q_b
and attn_output_a (Q8_0, 36 MB), the shared expert (3 x Q8_0, 9 MB), and a layer's routed experts
as forward_batch runs them (6 distinct experts a row, B rows: gate+up IQ2_XXS in one batched call,
down Q2_K in another). Prints the median CPU ms of each (matrix, T) per build, the ratio to T = 1
and new / old. Every output is checked equal between the builds (0 differing values, else it says
so). Without --old only this tree's build runs.
"""
from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.backends.cpu import kernels as K  # noqa: E402
from engine.gguf import quants as Q  # noqa: E402
from engine.gguf.model_file import ModelFile  # noqa: E402


def load_build(path: str):
    """another _kernels build as its own module (its own globals: threads, ISA)"""
    loader = importlib.machinery.ExtensionFileLoader("_kernels", path)
    spec = importlib.util.spec_from_file_location("_kernels", path, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def products(mf: ModelFile, which: str, T: int, rng):
    """(types, ws, xs) of one matmul_q8_batch call, fresh inputs"""
    def t(name):
        return mf.tensor(name)
    if which == "experts":
        ge, ue, de = t("blk.1.ffn_gate_exps.weight"), t("blk.1.ffn_up_exps.weight"), t("blk.1.ffn_down_exps.weight")
        sel = np.stack([rng.choice(256, 6, replace=False) for _ in range(T)])
        calls = []
        gu, dn = [], []
        for e in np.unique(sel):
            rows = np.nonzero(sel == e)[0]
            x = rng.standard_normal((len(rows), ge.data.shape[1] * 256 // 66), dtype=np.float32)
            gu += [(ge.type_id, ge.expert_data(e), x), (ue.type_id, ue.expert_data(e), x)]
            dn.append((de.type_id, de.expert_data(e), rng.standard_normal((len(rows), 2048), dtype=np.float32)))
        calls.append(tuple(zip(*gu)))
        calls.append(tuple(zip(*dn)))
        return calls
    names = {"head": ["output.weight"], "q_b": ["blk.1.attn_q_b.weight"], "out_a": ["blk.1.attn_output_a.weight"],
             "shexp": ["blk.1.ffn_gate_shexp.weight", "blk.1.ffn_up_shexp.weight"]}[which]
    ws = [t(n) for n in names]
    x = rng.standard_normal((T, ws[0].dims[0]), dtype=np.float32) * 0.1
    return [([w.type_id for w in ws], [w.data for w in ws], [x] * len(ws))]


def run(mod, calls, threads):
    ys_all = []
    t0 = time.thread_time()
    for types, ws, xs in calls:
        ys = [np.empty((x.shape[0], w.shape[0]), np.float32) for w, x in zip(ws, xs)]
        mod.matmul_q8_batch(list(types), list(ws), list(xs), ys, threads)
        ys_all += ys
    return time.thread_time() - t0, ys_all


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", default="/tmp/f4.gguf")
    ap.add_argument("--old", default=None, help="another build's _kernels .so to alternate with")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ts", default="1,2,3,4,8")
    ap.add_argument("--which", default="head,q_b,out_a,shexp,experts")
    a = ap.parse_args()
    if not K.available():
        print("no _kernels build here")
        return 1
    if a.threads != 1:
        print("(CPU time of the calling thread counts one thread only: use --threads 1)")
    builds = [("new", K._K)] + ([("old", load_build(a.old))] if a.old else [])
    for _, mod in builds:
        mod.set_threads(a.threads)
    print(f"isa {K.isa()}; threads {a.threads}; reps {a.reps}; loadavg {open('/proc/loadavg').read().split()[:3]}")
    mf = ModelFile.open(a.m)
    ts = [int(v) for v in a.ts.split(",")]
    for which in a.which.split(","):
        base = {}
        for T in ts:
            rng = np.random.default_rng(T)
            calls = products(mf, which, T, rng)
            times = {n: [] for n, _ in builds}
            for _, mod in builds:                  # warm (page in)
                run(mod, calls, a.threads)
            same = True
            for _ in range(a.reps):
                outs = []
                for n, mod in builds:
                    dt, ys = run(mod, calls, a.threads)
                    times[n].append(dt * 1e3)
                    outs.append(ys)
                if len(outs) == 2:
                    same &= all(np.array_equal(p, q, equal_nan=True) for p, q in zip(*outs))
            med = {n: statistics.median(v) for n, v in times.items()}
            for n in med:
                base.setdefault(n, med[n])
            parts = [f"{n} {med[n]:7.2f} ms ({med[n] / base[n]:.2f}x T=1)" for n in med]
            ratio = f"  new/old {med['new'] / med['old']:.2f}" if "old" in med else ""
            print(f"{which:8s} T={T}: " + "  ".join(parts) + ratio + ("" if same else "  OUTPUTS DIFFER"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
