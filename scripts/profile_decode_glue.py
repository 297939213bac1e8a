"""The Python glue of a decode step on the cpu backend: N greedy steps after a prefill, under
cProfile with the main thread's CPU time as the timer (other processes' load does not inflate it),
split into the C kernels' own time and the rest. One JSON line per rep: wall per token, every
thread's CPU per token (proc_cpu), main-thread cpu, kernels and glue per token (ms), Python calls
per token, and the top glue functions by own time (us a token, calls a token)
(docs/performance.md, "The decode step's Python glue").

    python scripts/profile_decode_glue.py MODEL [--ctx 512] [--steps 32] [--reps 3] [--threads 2] [--top 25]

Run it from the tree to measure (cwd first on sys.path: PYTHONPATH=. for another worktree).
--no-profile times the steps without cProfile (thread CPU of the decoding thread, per token)."""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time

import numpy as np


def _label(k) -> str:
    f, line, name = k
    return name if f == "~" else f"{f.rsplit('/', 1)[-1]}:{line}:{name}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--no-profile", action="store_true")
    a = ap.parse_args(argv)
    from engine import Engine, EngineOptions
    from engine.bench import greedy_no_eos
    from engine.runtime.session import Session
    try:
        eng = Engine.open(a.model, EngineOptions(backend="cpu", paging="prefault", threads=a.threads))
    except (OSError, ValueError) as e:
        print(f"profile_decode_glue: {e}", file=sys.stderr)
        return 2
    toks = [int(t) for t in np.random.default_rng(0).integers(100, min(120000, eng.config.n_vocab), a.ctx)]
    s = Session(eng, a.ctx + (a.reps + 1) * a.steps + 8)
    s.sync(toks)
    greedy_no_eos(s, 4, None)                                        # warm: first-call costs
    for _ in range(a.reps):
        n = a.steps
        t0, p0, c0 = time.perf_counter(), time.process_time(), time.thread_time()
        if a.no_profile:
            greedy_no_eos(s, n, None)
        else:
            pr = cProfile.Profile(timer=time.thread_time)
            pr.enable()
            greedy_no_eos(s, n, None)
            pr.disable()
        wall, proc, cpu = time.perf_counter() - t0, time.process_time() - p0, time.thread_time() - c0
        row = dict(wall_ms=round(1e3 * wall / n, 3), proc_cpu_ms=round(1e3 * proc / n, 3),
                   cpu_ms=round(1e3 * cpu / n, 3))
        if not a.no_profile:
            st = pstats.Stats(pr).stats
            total = sum(v[2] for v in st.values())
            kern = sum(v[2] for k, v in st.items() if "_kernels" in k[2])
            calls = sum(v[1] for v in st.values())
            glue = sorted(((v[2], v[1], _label(k)) for k, v in st.items() if "_kernels" not in k[2]), reverse=True)
            row.update(prof_cpu_ms=round(1e3 * total / n, 3), kernels_ms=round(1e3 * kern / n, 3),
                       glue_ms=round(1e3 * (total - kern) / n, 3), calls=round(calls / n),
                       top=[(name, round(1e6 * t / n, 1), round(c / n, 1)) for t, c, name in glue[:a.top]])
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
