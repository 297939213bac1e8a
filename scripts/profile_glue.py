"""The Python glue of one prefill on the cpu backend: cProfile with the main thread's CPU time as
the timer (other processes' load does not inflate it), split into the C kernels' own time and the
rest. One JSON line per prefill: wall, every thread's CPU (proc_cpu), main-thread cpu, kernels,
glue and the own time of the glue functions that mattered (docs/performance.md, "The prefill's
Python glue").

    python scripts/profile_glue.py MODEL [--tokens 512] [--reps 2] [--threads 2]

Run it from the tree to measure (cwd first on sys.path: PYTHONPATH=. for another worktree)."""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time

import numpy as np

GLUE = ("_attend", "_experts", "_experts_rows", "_routed_mid", "swiglu", "ascontiguousarray", "astype",
        "repeat", "concatenate", "take", "grouped_linear", "_compress_store", "clip")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    from engine import Engine, EngineOptions
    from engine.runtime.session import Session
    try:
        eng = Engine.open(a.model, EngineOptions(backend="cpu", paging="prefault", threads=a.threads))
    except (OSError, ValueError) as e:
        print(f"profile_glue: {e}", file=sys.stderr)
        return 2
    toks = [int(t) for t in np.random.default_rng(0).integers(100, min(120000, eng.config.n_vocab), a.tokens)]
    Session(eng, 2 * a.tokens).sync(toks[:64])                       # warm: first-call costs
    for _ in range(a.reps):
        s = Session(eng, 2 * a.tokens)
        pr = cProfile.Profile(timer=time.thread_time)
        t0, p0 = time.perf_counter(), time.process_time()
        pr.enable()
        s.sync(toks)
        pr.disable()
        wall, proc = time.perf_counter() - t0, time.process_time() - p0     # proc: every thread's CPU
        st = pstats.Stats(pr).stats
        total = sum(v[2] for v in st.values())
        kern = sum(v[2] for k, v in st.items() if "_kernels" in k[2])
        own: dict = {}
        for (_, _, name), v in st.items():
            for g in GLUE:
                if name in (g, f"<built-in method numpy.{g}>", f"<method '{g}' of 'numpy.ndarray' objects>"):
                    own[g] = round(own.get(g, 0.0) + v[2], 4)
        print(json.dumps(dict(wall=round(wall, 3), proc_cpu=round(proc, 3), cpu=round(total, 3), kernels=round(kern, 3),
                              glue=round(total - kern, 3), own=own)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
