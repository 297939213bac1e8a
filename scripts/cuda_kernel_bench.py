#!/usr/bin/env python3
"""Times the cupy backend's expert kernels at DeepSeek V4 Flash's widths on a CUDA device, and checks
them on it. scripts/gpu_check.sh runs it; no GPU was lent to the work that wrote it.

* decode: one token's 6 experts, ds4's dot products (ds4_matvec_*) and the float path
  (matvec_experts_*): GB/s of weights read, beside the HBM read floor when --floor is given;
* prefill: T tokens x 6 experts grouped by expert, ds4's int8 tensor-core GEMM (ds4_gemm_*) beside
  the FMA tiles (gemm_experts_*): TOP/s;
* check: ds4_gemm's outputs equal ds4_matvec's bit for bit at full size (both are ds4_matmul's
  function; this holds the mma fragment layout to the hardware's), and exit 1 if not;
* --graphs MODEL: a model's decode with the MoE CUDA graphs and without, timed, the logits compared
  bit for bit (exit 1 if they differ or nothing was replayed).

    python scripts/cuda_kernel_bench.py [--tokens 2048] [--floor BYTES_PER_S]
    python scripts/cuda_kernel_bench.py --graphs flash-6.gguf [--graph-tokens 32]
    DS4_CUDA_EMULATE=1 python scripts/cuda_kernel_bench.py --tiny    # the script itself, on the host
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.backends.cupy import kernels as KM  # noqa: E402
from engine.backends.cupy import numerics as DN  # noqa: E402
from engine.backends.cupy.quant import DevTensor  # noqa: E402
from engine.backends.kernel_sources import kernel_dir  # noqa: E402
from engine.gguf import quants as Q  # noqa: E402

SCALE_AT = {Q.IQ2_XXS: (0,), Q.Q2_K: (80, 82)}          # f16 scale fields in a block
FLASH = dict(n_embd=4096, n_ff=2048, n_expert=256, k=6)
TINY = dict(n_embd=256, n_ff=256, n_expert=8, k=2)


def namespace(tiny: bool):
    if os.environ.get("DS4_CUDA_EMULATE", "").strip() == "1":
        if not tiny:
            raise SystemExit("cuda_kernel_bench: the emulation runs only --tiny")
        from engine.backends.cupy import standin
        return standin
    import cupy
    return cupy


def expert_weight(xp, rng, type_id: int, E: int, n_out: int, n_in: int) -> DevTensor:
    """Random blocks with sane f16 scales (0.01), uploaded: [E * n_out, row_bytes]."""
    f = Q.FORMATS[type_id]
    rb = Q.row_bytes(type_id, n_in)
    raw = rng.integers(0, 256, (E * n_out, n_in // f.block_elems, f.block_bytes), dtype=np.uint8)
    for off in SCALE_AT[type_id]:
        raw[..., off:off + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return DevTensor("bench", type_id, (n_in, n_out, E), xp.asarray(raw.reshape(E * n_out, rb)))


def timer(xp, fn, reps: int) -> float:
    """Best seconds of reps calls (after one warm-up): CUDA events on a device, the clock here."""
    fn()
    best = float("inf")
    for _ in range(reps):
        if getattr(xp.cuda, "emulated", False):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
            continue
        e0, e1 = xp.cuda.Event(), xp.cuda.Event()
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        best = min(best, xp.cuda.get_elapsed_time(e0, e1) / 1e3)
    return best


def launcher(k, xp, name, w, xq, xd, x, experts, toks):
    """A no-argument call of one kernel over the pairs (the grid of kernels.py), and its output."""
    raw = xp.ascontiguousarray(w.experts3())
    P, n_out, n_in = int(experts.shape[0]), w.dims[1], w.dims[0]
    out = xp.empty((P, n_out), dtype=xp.float32)
    i32 = np.int32
    if name.startswith(("ds4_gemm_", "gemm_experts_")):
        perm, chunks = KM.batch_plan(xp.asnumpy(experts), KM.MMA_TILE_PAIRS if name.startswith("ds4_") else KM.GEMM_TILE_PAIRS)
        perm, chunks = xp.asarray(perm), xp.asarray(chunks)
        grid = (KM._cdiv(n_out, KM.GEMM_ROWS), int(chunks.shape[0]), 1)
        head = (raw, xq, xd) if name.startswith("ds4_") else (raw, x)
        args = head + (experts, toks, perm, chunks, out, i32(n_out), i32(n_in), i32(chunks.shape[0]))
    else:
        grid = (KM._cdiv(n_out, KM.ROWS_PER_BLOCK), P, 1)
        head = (raw, xq, xd) if name.startswith("ds4_") else (raw, x)
        args = head + (experts, toks, out, i32(n_out), i32(n_in), i32(P))
    fn = k.fn(name)
    return (lambda: fn(grid, KM.BLOCK, args)), out


def run(xp, dims: dict, tokens: int, floor: float | None, reps: int) -> int:
    rng = np.random.default_rng(0)
    k = KM.Kernels(xp, kernel_dir("cuda_kernels"))
    E, kk, n_embd, n_ff = dims["n_expert"], dims["k"], dims["n_embd"], dims["n_ff"]
    mats = {"gate/up iq2_xxs": expert_weight(xp, rng, Q.IQ2_XXS, E, n_ff, n_embd),
            "down q2_k": expert_weight(xp, rng, Q.Q2_K, E, n_embd, n_ff)}
    bad = 0
    print(f"{'kernel':<22} {'matrix':<16} {'shape':<26} {'ms':>8} {'rate':>16}")
    for label, w in mats.items():
        kind, n_out, n_in = w.kind, w.dims[1], w.dims[0]
        x = xp.asarray(rng.standard_normal((tokens, n_in), dtype=np.float32))
        xq, xd = DN.q8_k_quantize(xp, x)
        xq = xp.ascontiguousarray(xq.reshape(tokens, n_in))
        # decode: one token, kk distinct experts
        e1 = xp.asarray(rng.choice(E, kk, replace=False).astype(np.int32))
        t1 = xp.zeros(kk, dtype=xp.int32)
        for name in (f"ds4_matvec_{kind}", f"matvec_experts_{kind}"):
            fn, _ = launcher(k, xp, name, w, xq, xd, x, e1, t1)
            s = timer(xp, fn, reps)
            gbs = kk * n_out * Q.row_bytes(w.type_id, n_in) / s
            extra = f" ({gbs / floor:.0%} of floor)" if floor else ""
            print(f"{name:<22} {label:<16} {f'{kk} pairs x {n_out}x{n_in}':<26} {s * 1e3:8.3f} "
                  f"{gbs / 1e9:10.1f} GB/s{extra}")
        # prefill: tokens x kk experts, grouped by expert
        sel = np.stack([rng.choice(E, kk, replace=False) for _ in range(tokens)]).astype(np.int32)
        ep = xp.asarray(sel.reshape(-1))
        tp = xp.asarray(np.repeat(np.arange(tokens, dtype=np.int32), kk))
        P = tokens * kk
        outs = {}
        for name in (f"ds4_gemm_{kind}", f"gemm_experts_{kind}", f"ds4_matvec_{kind}"):
            fn, out = launcher(k, xp, name, w, xq, xd, x, ep, tp)
            s = timer(xp, fn, reps if name != f"ds4_matvec_{kind}" else 1)
            outs[name] = out
            print(f"{name:<22} {label:<16} {f'{P} pairs x {n_out}x{n_in}':<26} {s * 1e3:8.3f} "
                  f"{2 * P * n_out * n_in / s / 1e12:10.2f} TOP/s")
        same = xp.asnumpy(outs[f"ds4_gemm_{kind}"]).tobytes() == xp.asnumpy(outs[f"ds4_matvec_{kind}"]).tobytes()
        print(f"check: ds4_gemm_{kind} == ds4_matvec_{kind} bit for bit over {P} pairs: {'ok' if same else 'MISMATCH'}")
        bad += not same
    return 1 if bad else 0


def graphs_check(path: str, prompt: int, n: int) -> int:
    """Decode n tokens of the model at `path` after a prompt-token prefill, with the MoE graphs
    (graphs.py) and without: the logits must be the same bits; prints both rates."""
    from engine import Engine, Session
    from engine.backends.cupy import graphs
    res = {}
    for on in (True, False):
        os.environ[graphs.ENV] = "1" if on else "0"
        with Engine.open(path, backend="cupy") as e:
            s = Session(e, prompt + n + 8)
            s.sync(list(range(3, 3 + prompt)))
            tok, logits = 7, []
            s.eval(tok)                                  # (the first decode step: warm-ups)
            t0 = time.perf_counter()
            for _ in range(n):
                logits.append(s.eval(tok).copy())
                tok = int(np.argmax(logits[-1]))
            res[on] = (n / (time.perf_counter() - t0), np.array(logits), e.model.ops.graphs)
    os.environ.pop(graphs.ENV, None)
    same = res[True][1].tobytes() == res[False][1].tobytes()
    g = res[True][2]
    print(f"decode with MoE graphs {res[True][0]:.2f} t/s ({g.captures} captured, {g.replays} replays), "
          f"without {res[False][0]:.2f} t/s; logits bit for bit: {'ok' if same else 'MISMATCH'}")
    return 0 if same and g.replays > 0 else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048, help="prefill tokens (default 2048)")
    ap.add_argument("--floor", type=float, default=None, help="the HBM read floor, bytes/s")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="small widths (the host emulation's check)")
    ap.add_argument("--graphs", metavar="GGUF", default=None,
                    help="instead: decode this model with and without the MoE graphs, compare and time")
    ap.add_argument("--graph-tokens", type=int, default=32, help="decode tokens for --graphs")
    a = ap.parse_args(argv)
    if a.graphs:
        return graphs_check(a.graphs, 16, a.graph_tokens)
    xp = namespace(a.tiny)
    dims = TINY if a.tiny else FLASH
    return run(xp, dims, min(a.tokens, 8) if a.tiny else a.tokens, a.floor, 1 if a.tiny else a.reps)


if __name__ == "__main__":
    sys.exit(main())
