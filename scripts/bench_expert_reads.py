"""How fast the expert cache's reader fills slots: O_DIRECT against buffered preads, by queue depth.

    python scripts/bench_expert_reads.py MODEL.gguf [--experts 48] [--depths 1,4,16,32]

Reads `--experts` routed experts picked at random (seeded) over every layer, each expert's gate,
up and down bytes into a slot, as ExpertCache does, cold: the file's pages are dropped from the
page cache before each run (POSIX_FADV_DONTNEED; pages another process holds mapped stay). Prints
GB/s of expert bytes per mode and depth, and the plain O_DIRECT speed the bench's floor uses.
"""
from __future__ import annotations

import argparse
import mmap
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.gguf.expert_cache import MATRICES, _Layer  # noqa: E402
from engine.gguf.expert_reader import ExpertReader, direct_read_speed, region_bytes, split  # noqa: E402
from engine.gguf.model_file import ModelFile  # noqa: E402


def _layers(m: ModelFile):
    c = m.config
    tensors, infos = [], []
    for il in range(c.n_layer):
        ts = [m.tensor(f"blk.{il}.ffn_{k.split('_')[0]}_exps.weight") for k in MATRICES]
        tensors.append(ts)
        infos.append([m.layout.present[t.name] for t in ts])
    region = [max(region_bytes(ti[k].nbytes // ts[k].dims[2]) for ts, ti in zip(tensors, infos)) for k in range(3)]
    return [_Layer(ts, ti, region) for ts, ti in zip(tensors, infos)], sum(region)


def run(path: str, layers, slot: int, picks, direct: bool, depth: int, piece: int = 0, n_slots: int = 16) -> float:
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    mem = mmap.mmap(-1, n_slots * slot)
    r = ExpertReader(path, memoryview(mem), direct=direct, depth=depth)
    if direct and not r.direct:
        r.close()
        return float("nan")
    t0 = time.perf_counter()
    # a decode step's pattern: a layer's experts asked together, then waited for
    futs = []
    for i, (il, e) in enumerate(picks):
        spans = layers[il].reads(e, (i % n_slots) * slot)
        futs.append(r.submit([p for s in spans for p in split(s, piece)]))
        if len(futs) == n_slots:
            for f in futs:
                f.result()
            futs = []
    for f in futs:
        f.result()
    dt = time.perf_counter() - t0
    got = sum(layers[il].bytes for il, _ in picks)
    r.close()

    return got / dt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--experts", type=int, default=48)
    ap.add_argument("--depths", default="1,4,16,32")
    ap.add_argument("--pieces", default="0", help="reads cut into pieces of these sizes (0: whole matrices)")
    a = ap.parse_args(argv)
    with ModelFile.open(a.model) as m:
        layers, slot = _layers(m)
        rng = np.random.default_rng(0)
        c = m.config
        depths = [int(d) for d in a.depths.split(",")]
        print(f"{a.experts} experts of {layers[0].bytes / 1e6:.2f} MB, cold; GB/s of expert bytes")
        print("| depth | piece | O_DIRECT | buffered |")
        print("| --- | --- | --- | --- |")
        for d in depths:
            for pc in [int(x) for x in a.pieces.split(",")]:
                picks = [(int(rng.integers(c.n_layer)), int(rng.integers(c.n_expert))) for _ in range(a.experts)]
                dr = run(a.model, layers, slot, picks, True, d, pc)
                bu = run(a.model, layers, slot, picks, False, d, pc)
                print(f"| {d} | {pc or 'whole'} | {dr / 1e9:.2f} | {bu / 1e9:.2f} |")
        sp = direct_read_speed(a.model)
        print(f"plain O_DIRECT read (the bench's disk speed): {sp / 1e9:.2f} GB/s" if sp else "O_DIRECT refused")
    return 0


if __name__ == "__main__":
    sys.exit(main())
