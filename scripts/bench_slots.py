#!/usr/bin/env python3
"""Issue 23's measurement at the engine level: one decode stream alone, then N concurrent streams
(one thread and one Session each, the Engine batching their steps), greedy, in the same run.

    python scripts/bench_slots.py [-m /tmp/f4.gguf] [--backend cpu] [--streams 4] [--steps 24]
                                  [--prompt 64] [--rounds 2] [--threads N] [--by-batch]

The file: the real-width 4-layer synthetic one. Where -m is absent it is made first (about 2-4
minutes, 9.5 GB) with
    ds4-gguf synth /tmp/f4.gguf --preset flash --layers 4 --ratios 0,0,4,128 --vocab full
and the script says so.

Each round, alternately (alone, then N; a drift of the machine falls on both alike):
  * alone: one Session prefills its prompt, then decodes --steps tokens greedy; the batcher is
    on, as --serve has it (a batch of one: the direct path), and the direct Engine is timed too
    (the batcher's cost for one stream);
  * N streams: N threads, each prefills its own prompt (untimed), then all decode --steps tokens
    greedy at once, each registered with Session.generating(), so each step is one batch.
Decode t/s per stream is its steps over its own decode time; the aggregate is all streams' steps
over the time from the first stream's start to the last one's end. Printed: alone, each stream,
aggregate, and the two ratios of the bar: aggregate / alone (>= 3x) and alone / slowest stream
(each stream <= 1.5x slower). --by-batch adds Model.forward_batch's own step time at B = 1..N
(no threads): where the time of a bigger batch goes.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine import Engine, Session  # noqa: E402

DEFAULT_FILE = Path("/tmp/f4.gguf")
SYNTH = ["synth", "--preset", "flash", "--layers", "4", "--ratios", "0,0,4,128", "--vocab", "full"]


def ensure_file(path: Path) -> Path:
    if path.exists():
        return path
    print(f"{path} is absent: making it (ds4-gguf {' '.join(SYNTH)}; 9.5 GB, a few minutes)", flush=True)
    tmp = path.with_name(path.name + ".part")
    subprocess.run([sys.executable, "-m", "engine.gguf.gguf_cli", SYNTH[0], str(tmp), *SYNTH[1:]],
                   check=True, cwd=ROOT)
    os.replace(tmp, path)
    return path


def _stat() -> tuple[int, int]:
    v = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    return v[3] + v[4], sum(v)          # idle + iowait, total (clock ticks over all CPUs)


class Others:
    """The share of the CPUs that other processes kept busy while the block ran (all busy time
    minus this process's own): on the shared machine a part with others at 10 % or more is noise."""

    def __enter__(self):
        self.i0, self.t0 = _stat()
        self.r0 = os.times()
        return self

    def __exit__(self, *exc):
        i1, t1 = _stat()
        r1 = os.times()
        own = (r1.user + r1.system - self.r0.user - self.r0.system) * os.sysconf("SC_CLK_TCK")
        self.share = max(0.0, ((t1 - self.t0) - (i1 - self.i0) - own) / max(t1 - self.t0, 1))


def wait_quiet(limit_s: float, busy_max: float = 0.25) -> str:
    """Wait (at most limit_s) until others keep at most busy_max of the CPUs busy; say what it was."""
    t0 = time.time()
    while True:
        i0, a0 = _stat()
        time.sleep(1.0)
        i1, a1 = _stat()
        busy = 1 - (i1 - i0) / max(a1 - a0, 1)
        if busy <= busy_max or time.time() - t0 >= limit_s:
            return f"others {busy:.0%} before, waited {time.time() - t0:.0f} s"


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lo = min(1000, vocab // 4)                 # (past the special ids of a full vocabulary)
    return [rng.integers(lo, min(vocab, 100000), length).tolist() for _ in range(n)]


def decode(s: Session, steps: int) -> tuple[list[int], float, float]:
    """Greedy steps on a prefilled session: (tokens, start, end)."""
    out = []
    with s.generating():
        t0 = time.perf_counter()
        for _ in range(steps):
            t = int(np.argmax(s.logits))
            out.append(t)
            s.eval(t)
        t1 = time.perf_counter()
    return out, t0, t1


def alone(eng: Engine, prompt: list[int], steps: int, ctx: int) -> tuple[float, list[int]]:
    s = Session(eng, ctx)
    s.sync(prompt)
    toks, t0, t1 = decode(s, steps)
    return steps / (t1 - t0), toks


def streams(eng: Engine, ps: list[list[int]], steps: int, ctx: int):
    """N threads at once: (per-stream t/s, aggregate t/s, tokens per stream)."""
    n = len(ps)
    ready = threading.Barrier(n)
    res: list = [None] * n
    errs: list = []

    def run(i):
        try:
            s = Session(eng, ctx)
            s.sync(ps[i])
            with s.generating():      # registered before the barrier: the first step waits for all
                ready.wait()
                res[i] = decode(s, steps)
        except BaseException as e:    # (printed below)
            errs.append(e)
            ready.abort()

    th = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    if errs:
        raise errs[0]
    each = [steps / (t1 - t0) for _, t0, t1 in res]
    agg = n * steps / (max(t1 for _, _, t1 in res) - min(t0 for _, t0, _ in res))
    return each, agg, [r[0] for r in res]


def by_batch(eng: Engine, n: int, prompt_len: int, ctx: int, reps: int = 3):
    """Model.forward_batch's step time at B = 1..n (median of `reps` steps, no threads), and
    where it goes: {B: (seconds, {part: seconds})}, parts timed by wrapping the ops object's
    methods (head: the output matmul; experts: ops.moe, routed + shared; attention: ops.attention;
    dense: every other matmul; rest: norms, RoPE, HC, the KV glue, Python)."""
    m, ops = eng.model, eng.model.ops
    parts: dict = {}

    def timed(name, f):
        def g(*args, **kw):
            t0 = time.perf_counter()
            try:
                return f(*args, **kw)
            finally:
                key = "head" if name == "linear" and args and args[0] is m.w.output else \
                    {"moe": "experts", "attention": "attention"}.get(name, "dense")
                parts[key] = parts.get(key, 0.0) + time.perf_counter() - t0
        return g

    names = ("linear", "linears", "grouped_linear", "moe", "attention")
    for name in names:
        setattr(ops, name, timed(name, getattr(ops, name)))
    try:
        ps = prompts(n, prompt_len, eng.config.n_vocab, seed=7)
        states = [ops.new_state(eng.config, ctx, 64) for _ in ps]
        for p, st in zip(ps, states):
            ops.logits_to_host(m.forward(np.array(p), 0, st))
        pos = [prompt_len] * n
        out = {}
        for b in range(1, n + 1):
            runs = []
            for _ in range(reps):
                parts.clear()
                c0 = resource.getrusage(resource.RUSAGE_SELF)
                t0 = time.perf_counter()
                if b == 1:
                    ops.logits_to_host(m.forward(np.array([11]), pos[0], states[0]))
                else:
                    ops.logits_to_host(m.forward_batch([11 + i for i in range(b)], pos[:b], states[:b]))
                dt = time.perf_counter() - t0
                c1 = resource.getrusage(resource.RUSAGE_SELF)
                cpu = c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime
                runs.append((dt, dict(parts, rest=dt - sum(parts.values())), cpu))
                pos = [p + 1 if i < b else p for i, p in enumerate(pos)]
            out[b] = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
        return out
    finally:
        for name in names:
            delattr(ops, name)


def report(rows):
    ratio = [agg / one for _, one, _, agg in rows]
    slow = [one / min(each) for _, one, each, _ in rows]
    cost = [direct / one for direct, one, _, _ in rows]
    print(f"median of {len(rows)}: aggregate/alone {statistics.median(ratio):.2f}x (range {min(ratio):.2f}-{max(ratio):.2f}; "
          f"bar >= 3), alone/slowest stream {statistics.median(slow):.2f}x (range {min(slow):.2f}-{max(slow):.2f}; "
          f"bar <= 1.5), direct/batcher alone {statistics.median(cost):.3f}x")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, default=DEFAULT_FILE)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--steps", type=int, default=24, help="decode tokens per stream")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per stream")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="kernel threads (default: the backend's)")
    ap.add_argument("--window-ms", type=float, default=4.0)
    ap.add_argument("--quiet-wait", type=float, default=120,
                    help="before each round wait at most this long (s) for others to leave the CPUs")
    ap.add_argument("--by-batch", action="store_true", help="also time forward_batch at B = 1..streams")
    a = ap.parse_args(argv)
    if a.streams < 1 or a.steps < 1 or a.prompt < 1 or a.rounds < 0 or (a.rounds == 0 and not a.by_batch):
        ap.error("--streams, --steps and --prompt must be >= 1, --rounds >= 1 (or 0 with --by-batch)")
    if a.prompt + a.steps + 1 >= a.ctx:
        ap.error(f"--ctx {a.ctx} is too small for --prompt {a.prompt} + --steps {a.steps}")
    path = ensure_file(a.model) if a.model == DEFAULT_FILE else a.model
    if not path.exists():
        ap.error(f"{path} does not exist")
    t0 = time.perf_counter()
    eng = Engine.open(path, backend=a.backend, threads=a.threads)
    eng.wait_resident()
    print(f"{path.name}: backend {eng.backend}, paging {eng.paging}, opened in {time.perf_counter() - t0:.1f} s; "
          f"{a.streams} streams x {a.steps} steps after {a.prompt}-token prompts; load {os.getloadavg()[0]:.1f}",
          flush=True)
    ps = prompts(a.streams, a.prompt, eng.config.n_vocab)
    # warm-up: one prefill and a few steps (first touches of the weights and the kernels' tables)
    alone(eng, ps[0], 3, a.ctx)
    rows = []
    for r in range(a.rounds):
        quiet = wait_quiet(a.quiet_wait)
        eng.stop_batching()
        with Others() as o1:
            direct, _ = alone(eng, ps[0], a.steps, a.ctx)
        eng.start_batching(window_ms=a.window_ms)
        with Others() as o2:
            one, want = alone(eng, ps[0], a.steps, a.ctx)
        with Others() as o3:
            each, agg, got = streams(eng, ps, a.steps, a.ctx)
        st = eng.batcher.stats
        same = got[0] == want
        rows.append((direct, one, each, agg))
        print(f"round {r + 1} ({quiet}; others during direct/alone/streams "
              f"{o1.share:.0%}/{o2.share:.0%}/{o3.share:.0%}): alone {one:.2f} t/s (direct {direct:.2f}); "
              f"{a.streams} streams: each {' '.join(f'{x:.2f}' for x in each)} t/s, aggregate {agg:.2f} t/s; "
              f"aggregate/alone {agg / one:.2f}x, alone/slowest {one / min(each):.2f}x; "
              f"batches: {st['decode_steps']} steps, {st['decode_rows']} rows, largest {st['max_batch']}; "
              f"stream 1 tokens as alone: {same}", flush=True)
    eng.stop_batching()
    if rows:
        report(rows)
    if a.by_batch:
        bb = by_batch(eng, a.streams, a.prompt, a.ctx)
        t1, cpu1 = bb[1][0], bb[1][2]
        for b, (t, parts, cpu) in bb.items():
            # CPU time: this process's, all threads (with one kernel thread it is the step's work
            # even where others share the cores and the wall time is theirs as much as ours)
            print(f"forward_batch B={b}: {t * 1000:.0f} ms a step ({b / t:.2f} t/s, {t / t1:.2f}x B=1; "
                  f"CPU {cpu * 1000:.0f} ms, {cpu / cpu1:.2f}x B=1): " +
                  ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in sorted(parts.items())), flush=True)
    eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
