#!/usr/bin/env python3
"""Benchmark: opening a ~4 GB synthetic DeepSeek V4 GGUF must cost O(metadata).

Writes a real-width file with random weights (2 layers, ratios 4 and 128, 160 experts, full
129,280-token vocabulary: about 4.3 GB), then in a fresh process measures the wall time of
`ModelFile.open` (parse + config + full layout validation) and how much the resident set grows,
and prints them as ratios against the budgets of the foundation issue (1 s, 64 MiB). For a peer it
also times `gguf.GGUFReader` on the same file.

    python scripts/bench_open.py [--path /tmp/bench-4g.gguf] [--keep]

With --engine FILE it times `Engine.open` itself (cpu backend, 2 threads) on an existing file, in
each paging mode, one open per fresh process (the first call's lazy imports count, the imports
before it do not), wall clock and the calling thread's CPU time. With --baseline DIR (a worktree
of another commit, its extension built) each round runs the two trees alternately, baseline
first on even rounds, so a busy minute hits both; each child runs from its tree's root with that
tree first on sys.path.

    python scripts/bench_open.py --engine /tmp/f4.gguf --baseline /tmp/wt-c0 --rounds 5

With --serve as well it times `ds4-agent --serve` instead, from the process's start (imports
included) to the first request it answers (GET /v1/models), `--paging none`.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, resource, sys, time
def rss():
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith('VmRSS:'):
                return int(line.split()[1]) * 1024
import numpy, gguf  # imports are not part of opening a file
from engine import ModelFile
which, path = sys.argv[1], sys.argv[2]
r0 = rss(); t0 = time.perf_counter()
if which == 'ours':
    m = ModelFile.open(path)
    n = len(m.gguf.tensors)
else:
    m = gguf.GGUFReader(path)
    n = len(m.tensors)
dt = time.perf_counter() - t0
print(json.dumps({'seconds': dt, 'rss_growth': rss() - r0, 'tensors': n}))
"""


ENGINE_CHILD = r"""
import json, sys, time, warnings
warnings.simplefilter("ignore")
import numpy, gguf, tokenizers  # imports are not part of opening a file
from engine import Engine, EngineOptions
path, paging = sys.argv[1], sys.argv[2]
opts = EngineOptions(backend="cpu", paging=paging, threads=2)
t0, c0 = time.perf_counter(), time.thread_time()
eng = Engine.open(path, opts)
dt, dc = time.perf_counter() - t0, time.thread_time() - c0
print(json.dumps({"seconds": dt, "cpu": dc, "paging": eng.paging}))
eng.close()
"""


def _tree_env(tree, **extra):
    # compiled bytecode as an installed package has it (PYTHONDONTWRITEBYTECODE would compile every
    # module again in each child), cached per tree outside it
    env = dict(os.environ, PYTHONPATH=tree, PYTHONPYCACHEPREFIX=os.path.join(
        tempfile.gettempdir(), "ds4-bench-open-pyc", tree.strip(os.sep).replace(os.sep, "+")), **extra)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def serve_child(tree, path, port):
    """Seconds from starting `ds4-agent --serve` to its first answered request."""
    import urllib.request
    home = tempfile.mkdtemp(prefix="bench-open-home-")
    argv = ["--serve", "--model", path, "--port", str(port), "--backend", "cpu", "-t", "2", "--paging", "none",
            "--ctx", "4096"]
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-W", "ignore", "-c",
                          "import sys; from ds4agent.cli import main; sys.exit(main(sys.argv[1:]))", *argv],
                         cwd=tree, env=_tree_env(tree, DS4_AGENT_HOME=home), stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE)
    try:
        while time.perf_counter() - t0 < 120:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1):
                    return {"seconds": time.perf_counter() - t0, "cpu": float("nan"), "paging": "none"}
            except OSError:
                if p.poll() is not None:
                    raise SystemExit(f"{tree}: ds4-agent --serve exited: {p.stderr.read().decode()[-300:]}")
                time.sleep(0.01)
        raise SystemExit(f"{tree}: ds4-agent --serve answered nothing in 120 s")
    finally:
        p.terminate()
        p.wait(10)


def engine_child(tree, path, paging):
    env = _tree_env(tree)
    out = subprocess.run([sys.executable, "-c", ENGINE_CHILD, path, paging], capture_output=True, text=True,
                         check=True, cwd=tree, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_engine(a):
    """Engine.open in each paging mode, this tree against --baseline, alternating."""
    import statistics
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = [("new", here)] + ([("old", os.path.abspath(a.baseline))] if a.baseline else [])
    modes = a.modes.split(",")
    if a.serve:
        modes = ["serve"]
    got = {(t, m): [] for t, _ in trees for m in modes}
    for _, tree in trees:
        engine_child(tree, a.engine, "none")        # (writes the bytecode; not timed)
    for r in range(a.rounds):
        order = trees if r % 2 else trees[::-1]
        for m in modes:
            for i, (name, tree) in enumerate(order):
                got[name, m].append(serve_child(tree, a.engine, a.port + i) if a.serve
                                    else engine_child(tree, a.engine, m))
    what = "ds4-agent --serve to its first answer" if a.serve else "Engine.open, one open per process"
    print(f"{what} ({a.engine}), {a.rounds} rounds; seconds min / median")
    print("| paging | tree | wall min | wall median | CPU min | CPU median |")
    print("| --- | --- | --- | --- | --- | --- |")
    for m in modes:
        for name, _ in trees:
            w = [x["seconds"] for x in got[name, m]]
            c = [x["cpu"] for x in got[name, m]]
            cpu = "- | -" if a.serve else f"{min(c):.3f} | {statistics.median(c):.3f}"   # (another process's)
            print(f"| {m} ({got[name, m][0]['paging']}) | {name} | {min(w):.3f} | {statistics.median(w):.3f} | {cpu} |")


def child(which, path):
    out = subprocess.run([sys.executable, "-c", CHILD, which, path], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--path", default="/tmp/ds4-bench-4g.gguf")
    ap.add_argument("--keep", action="store_true", help="keep the file afterwards")
    ap.add_argument("--engine", metavar="FILE", help="time Engine.open on this existing file instead")
    ap.add_argument("--baseline", metavar="DIR", help="with --engine: a worktree to alternate with")
    ap.add_argument("--modes", default="resident,prefault,none,lowmem,auto", help="with --engine: paging modes")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--serve", action="store_true", help="with --engine: time ds4-agent --serve's start instead")
    ap.add_argument("--port", type=int, default=18231, help="with --serve: the first of two ports to use")
    a = ap.parse_args()
    if a.engine:
        return bench_engine(a)
    from engine.gguf.synth import config_for, write_synthetic
    if not os.path.exists(a.path):
        cfg, vocab = config_for("flash", n_layer=2, ratios=[4, 128], n_expert=160, n_hash_layer=1)
        t0 = time.perf_counter()
        write_synthetic(a.path, cfg, recipe="q2", vocab=vocab, seed=0)
        print(f"wrote {a.path} in {time.perf_counter() - t0:.1f} s")
    size = os.path.getsize(a.path)
    # drop nothing from the page cache on purpose: opening must not read data either way
    ours = min((child("ours", a.path) for _ in range(3)), key=lambda r: r["seconds"])
    peer = child("gguf", a.path)
    print(f"file: {size / 1e9:.2f} GB, {ours['tensors']} tensors")
    print(f"ModelFile.open: {ours['seconds'] * 1000:.1f} ms (ratio to the 1 s budget: {ours['seconds']:.3f}), "
          f"RSS growth {ours['rss_growth'] / 2**20:.1f} MiB (ratio to the 64 MiB budget: "
          f"{ours['rss_growth'] / (64 * 2**20):.3f})")
    print(f"peer gguf.GGUFReader: {peer['seconds'] * 1000:.1f} ms, RSS growth {peer['rss_growth'] / 2**20:.1f} MiB "
          f"(ours is {peer['seconds'] / ours['seconds']:.1f}x faster)")
    if not a.keep:
        os.unlink(a.path)


if __name__ == "__main__":
    main()
