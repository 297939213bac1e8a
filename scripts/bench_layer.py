#!/usr/bin/env python3
"""Benchmark: one backend on one real-width DeepSeek V4 layer (ms per layer).

Writes a 1-layer file with the published widths (ratio-4 CSA layer, 256 q2 experts, random
weights; the vocabulary is shrunk to 4,096 ids so the output head does not dominate), then times
prefill of a 256-token chunk and single-token decode steps, splitting the time into the layer's
attention and FFN halves and the rest (embedding, output head). The floor it prints is the time
to stream the weight bytes one decode step reads at the machine's measured memory bandwidth, so
the ratio says how far the backend is from a bandwidth-bound kernel.

    python scripts/bench_layer.py [--backend numpy|cpu] [--numerics ds4|exact] [--threads N]
                                  [--path /tmp/ds4-bench-layer.gguf] [--keep]

The engine flags are every command's (engine/options.py); a bad value is one `error:` line.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np


def bandwidth_gbs() -> float:
    a = np.ones(64 << 20, dtype=np.float32)  # 256 MiB
    a.sum()
    t = time.perf_counter()
    for _ in range(3):
        a.sum()
    return 3 * a.nbytes / (time.perf_counter() - t) / 1e9


def build_parser() -> argparse.ArgumentParser:
    from engine.options import add_engine_flags
    ap = argparse.ArgumentParser(prog="bench_layer.py", description=__doc__.splitlines()[0])
    ap.add_argument("--path", default="/tmp/ds4-bench-layer.gguf")
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--decode", type=int, default=8)
    ap.add_argument("--keep", action="store_true")
    add_engine_flags(ap)
    return ap


def main(argv=None) -> int:
    from engine.options import EngineOptions
    a = build_parser().parse_args(argv)
    try:
        options = EngineOptions.from_args(a)
        options.check()             # before the model file is written
    except ValueError as e:         # BackendError is one
        print(f"error: {e}", file=sys.stderr)
        return 1
    from engine import Engine, ModelFile, Session
    from engine.gguf.inspect import report
    from engine.model.model import Model
    from engine.gguf.synth import config_for, write_synthetic
    if not os.path.exists(a.path):
        cfg, vocab = config_for("flash", n_layer=1, ratios=[4], n_hash_layer=0, vocab=4049)
        t0 = time.perf_counter()
        write_synthetic(a.path, cfg, recipe="q2", vocab=vocab, seed=0)
        print(f"wrote {a.path} ({os.path.getsize(a.path) / 2**30:.2f} GiB) in {time.perf_counter() - t0:.1f} s")
    with ModelFile.open(a.path) as m:
        step_bytes = report(m)["layers"][0]["bytes_per_token"]
    layer_bytes = sum(step_bytes.values())
    timers = {"attention": 0.0, "ffn": 0.0}
    for name, attr in (("attention", "_attention"), ("ffn", "_ffn")):
        orig = getattr(Model, attr)

        def timed(self, *args, _orig=orig, _name=name):
            t = time.perf_counter()
            try:
                return _orig(self, *args)
            finally:
                timers[_name] += time.perf_counter() - t
        setattr(Model, attr, timed)
    try:
        e = Engine.open(a.path, options)
    except ValueError as err:       # a backend that cannot serve here, or a paging it refuses
        print(f"error: {err}", file=sys.stderr)
        return 1
    s = Session(e, 4096)
    toks = np.random.default_rng(0).integers(0, e.config.n_vocab, a.prefill + a.decode).tolist()
    s.sync(toks[:8])  # page the weights in and warm up
    s.reset()
    for k in timers:
        timers[k] = 0.0
    t = time.perf_counter()
    s.sync(toks[:a.prefill])
    total = time.perf_counter() - t
    n = a.prefill
    print(f"prefill {n} tokens: {total * 1000 / n:.1f} ms/token; layer {sum(timers.values()) * 1000 / n:.1f} ms/token "
          f"(attention {timers['attention'] * 1000 / n:.1f}, ffn {timers['ffn'] * 1000 / n:.1f})")
    for k in timers:
        timers[k] = 0.0
    t = time.perf_counter()
    for tok in toks[a.prefill:]:
        s.eval(tok)
    total = time.perf_counter() - t
    n = a.decode
    layer_ms = sum(timers.values()) * 1000 / n
    bw = bandwidth_gbs()
    floor_ms = layer_bytes / (bw * 1e9) * 1000
    print(f"decode: {total * 1000 / n:.1f} ms/step; layer {layer_ms:.1f} ms (attention {timers['attention'] * 1000 / n:.1f}, "
          f"ffn {timers['ffn'] * 1000 / n:.1f}); the layer reads {layer_bytes / 2**20:.0f} MiB of weights per step")
    print(f"floor: {floor_ms:.1f} ms at {bw:.1f} GB/s read bandwidth -> the reference is {layer_ms / floor_ms:.1f}x the floor; "
          f"43 such layers would take {43 * layer_ms / 1000:.1f} s per token")
    e.close()
    if not a.keep:
        os.unlink(a.path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
