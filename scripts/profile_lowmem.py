"""Where a `lowmem` decode step waits: per layer, the time and the bytes read from disk in the
attention sublayer (dense matrices) and in the FFN sublayer (routing, the routed experts, the
shared expert), over a prefill and a few greedy decode steps.

    python scripts/profile_lowmem.py -m f.gguf [--prefill 32] [--gen 8] [--threads 2]
    scripts/run_memory_limited.sh 2147483648 python scripts/profile_lowmem.py -m f.gguf

Bytes come from /proc/self/io read_bytes (what this process made the block layer read,
readahead included), faults from getrusage's ru_majflt. The bytes a step needs are printed
beside them (the layer's dense matrices and the experts it routed to), so readahead that pulls in
bytes nobody uses shows as read/needed above 1. The sublayers are timed by wrapping
Model._attention and Model._ffn in this script (the engine carries no timers).
"""
from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # (run from a checkout: its engine)

from engine.model import model as M                     # noqa: E402
from engine.runtime.session import Engine, Session      # noqa: E402
from engine.bench import default_prompt_file            # noqa: E402


def _sched() -> tuple[float, float]:
    """This thread's CPU time and time spent runnable but waiting for a CPU (s): the rest of a
    step's wall time is time it slept (page faults waiting for the disk, OpenMP joins), which a
    loaded machine does not inflate the way it inflates wall time."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            cpu, wait = f.read().split()[:2]
        return int(cpu) / 1e9, int(wait) / 1e9
    except (OSError, ValueError):
        return 0.0, 0.0


def _io() -> tuple[int, int]:
    with open("/proc/self/io") as f:
        rb = next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))
    return rb, resource.getrusage(resource.RUSAGE_SELF).ru_majflt


class Probe:
    """Accumulates (seconds, bytes read, major faults) per (layer, part) for the current step."""

    def __init__(self):
        self.rows: dict = {}

    def wrap(self, name: str, part: str):
        orig = getattr(M.Model, name)

        def timed(model, lw, *a, **k):
            t0, (b0, f0) = time.perf_counter(), _io()
            out = orig(model, lw, *a, **k)
            t1, (b1, f1) = time.perf_counter(), _io()
            r = self.rows.setdefault((lw.il, part), [0.0, 0, 0])
            r[0] += t1 - t0
            r[1] += b1 - b0
            r[2] += f1 - f0
            return out
        setattr(M.Model, name, timed)


def _needed(eng, il: int) -> int:
    from engine.model.weights import dense_arrays
    return sum(a.nbytes for a in dense_arrays(eng.model.w.layers[il]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", required=True)
    p.add_argument("--prefill", type=int, default=32)
    p.add_argument("--gen", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--paging", default="lowmem")
    p.add_argument("--no-hash-ahead", action="store_true",
                   help="A/B: ask for the hash layers' experts at their own layer, not at the step's start")
    a = p.parse_args()
    if a.no_hash_ahead and hasattr(M.Model, "_hint_step"):
        def no_hash(model, tokens):
            begin = getattr(model.pager, "begin_step", None)
            if begin is not None:
                begin(len(tokens))
            model.pager(model._dense[0])
        M.Model._hint_step = no_hash
    probe = Probe()
    probe.wrap("_attention", "attn")
    probe.wrap("_ffn", "ffn")
    t0 = time.perf_counter()
    eng = Engine.open(a.model, backend="cpu", threads=a.threads, paging=a.paging)
    print(f"open {time.perf_counter() - t0:.2f} s, paging {eng.paging}, map at {eng.file.gguf._map_address():#x}")
    pager_s = [0.0]
    if eng.model.pager is not None:           # the hints' own time (their syscalls, in this thread)
        inner = eng.model.pager

        def timed_pager(arrays):
            t = time.perf_counter()
            inner(arrays)
            pager_s[0] += time.perf_counter() - t
        eng.model.pager = timed_pager
    text = Path(default_prompt_file()).read_text(encoding="utf-8")
    toks = eng.tokenizer.encode(text)[:a.prefill]
    s = Session(eng, a.prefill + a.gen + 8)
    n_layer = eng.config.n_layer
    expert_bytes = sum(t.expert_data(0).nbytes for t in
                       (eng.model.w.layers[0].gate_exps, eng.model.w.layers[0].up_exps, eng.model.w.layers[0].down_exps))
    dense = [_needed(eng, il) for il in range(n_layer)]
    print(f"per layer: dense {dense[0] / 1e6:.1f} MB, one expert's three matrices {expert_bytes / 1e6:.2f} MB, "
          f"{eng.config.n_expert_used} routed a token")
    steps = []
    for step in range(a.gen + 1):
        probe.rows = {}
        pager_s[0] = 0.0
        b0, f0 = _io()
        c0, w0 = _sched()
        t0 = time.perf_counter()
        if step == 0:
            s.sync(toks)
        else:
            s.eval(int(np.argmax(s.logits)))
        dt = time.perf_counter() - t0
        b1, f1 = _io()
        c1, w1 = _sched()
        slept = dt - (c1 - c0) - (w1 - w0)
        steps.append((dt, b1 - b0, f1 - f0, dict(probe.rows), slept))
        kind = f"prefill {len(toks)}" if step == 0 else f"decode {step}"
        print(f"{kind}: {dt * 1e3:.0f} ms, read {(b1 - b0) / 1e6:.1f} MB, {f1 - f0} major faults, {pager_s[0] * 1e3:.1f} ms in paging hints, "
              f"main thread: {(c1 - c0) * 1e3:.0f} ms on a CPU, {(w1 - w0) * 1e3:.0f} ms waiting for one, {slept * 1e3:.0f} ms asleep")
    dec = steps[1:]
    if dec:
        need_exp = eng.config.n_expert_used * expert_bytes
        print(f"\ndecode, mean of {len(dec)} steps, per layer (ms | MB read | major faults); needed a "
              f"step: dense {dense[0] / 1e6:.0f} MB, experts {need_exp / 1e6:.1f} MB")
        for il in range(n_layer):
            cells = []
            for part in ("attn", "ffn"):
                v = np.mean([d[3].get((il, part), [0, 0, 0]) for d in dec], axis=0)
                cells.append(f"{part} {v[0] * 1e3:6.1f} ms {v[1] / 1e6:7.1f} MB {v[2]:6.0f} flt")
            print(f"layer {il}: " + " | ".join(cells))
        tot = np.mean([d[0] for d in dec]), np.mean([d[1] for d in dec])
        print(f"step: {tot[0] * 1e3:.0f} ms, {tot[1] / 1e6:.1f} MB read ({tot[1] / tot[0] / 1e6:.0f} MB/s while decoding); "
              f"main thread asleep {np.mean([d[4] for d in dec]) * 1e3:.0f} ms a step (median {np.median([d[4] for d in dec]) * 1e3:.0f})")
    eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
