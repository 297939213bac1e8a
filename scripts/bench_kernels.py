#!/usr/bin/env python3
"""Benchmark of the C matmul kernels (engine.backends.cpu.kernels) on realistic ds4 shapes.

Prints, per weight format:
* decode (T = 1): GB/s of weight bytes read, weights cold (a pool of copies larger than the L3
  cache is cycled, so every call reads its weights from DRAM) and hot (one matrix, cache-resident
  when it fits), and the ratio to the machine's read floor;
* the read floor: bytes/s of a multi-threaded sum over 1 GiB (engine.backends.cpu._kernels.read_sum), and of
  NumPy's single-threaded sum and copy, for reference;
* batched T (default 2 .. 512): GFLOP/s (2 * T * rows * cols per call) of the fused kernels and of
  the "blas" path (C dequantizer + np.matmul), next to np.matmul on the already-decoded float32
  matrix (the BLAS ceiling), and which path is faster at each T;
* for the formats with integer-activation kernels (ds4 numerics: Q8_0, Q2_K, IQ2_XXS), the same
  figures for matmul_q8 (x quantized inside the call) and the largest T at which it beats the
  float kernels (kernels.Q8_MAX_T is set from it); where the build has the integer GEMM form
  (AVX-512 VNNI, AVX2), the row kernels and the GEMM form each forced, and the first T at which the
  GEMM form wins (its default minimum, kern_gemm_body.h / kern_gemm_avx2.h, is set from it).

Timings are the best of several samples, counting only samples during which other processes
were (nearly) idle: the machine may be shared (medians are printed too).

    .venv/bin/python scripts/bench_kernels.py [--threads 2] [--formats Q8_0,IQ2_XXS] [--quick]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

# OpenBLAS gets as many threads as the kernels (--threads N), so the comparison is like for like;
# it reads the variable when numpy is imported
for _i, _a in enumerate(sys.argv):
    if _a == "--threads" and _i + 1 < len(sys.argv):
        os.environ.setdefault("OPENBLAS_NUM_THREADS", sys.argv[_i + 1])
    elif _a.startswith("--threads="):
        os.environ.setdefault("OPENBLAS_NUM_THREADS", _a.split("=", 1)[1])

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.backends.cpu import kernels as K  # noqa: E402
from engine.gguf import quants as Q  # noqa: E402

# (rows, cols) of the matrices benchmarked per format: attention/shared projections are Q8_0
# 4096-wide; routed experts (IQ2_XXS / Q2_K in the published files) are 2048 x 4096 (gate, up) and
# 4096 x 2048 (down)
SHAPES = {
    "F32": [(4096, 4096)], "F16": [(4096, 4096)], "BF16": [(4096, 4096)], "Q8_0": [(4096, 4096)],
    "Q2_K": [(2048, 4096), (4096, 2048)], "Q4_K": [(4096, 4096)],
    "IQ2_XXS": [(2048, 4096), (4096, 2048)], "MXFP4": [(4096, 4096)],
}
POOL_BYTES = 512 << 20  # > L3: cycling through this many bytes of copies reads from DRAM


def _busy_cpu_seconds() -> float:
    """CPU seconds spent by everything on the machine (non-idle jiffies of /proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(a) for a in f.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


QUIET = 0.10  # a sample counts when other processes used under 10% of one CPU meanwhile
_stats = {"quiet": 0, "noisy": 0}


def timeit(fn, min_time=0.5, max_time=8.0, want_quiet=3, sample_time=0.05):
    """Best and median seconds per call over *quiet* samples.

    The machine may be shared: a sample (enough calls to last ~sample_time) counts only when
    other processes used little CPU meanwhile (from /proc/stat and this process's CPU time).
    Samples are taken until min_time has passed and want_quiet quiet samples exist, or max_time
    has passed; without any quiet sample the best noisy one is returned (counted in _stats)."""
    fn()
    t0 = time.perf_counter()
    fn()
    k = max(1, int(sample_time / max(time.perf_counter() - t0, 1e-6)))
    quiet, noisy = [], []
    start = time.perf_counter()
    while True:
        b0, o0, t0 = _busy_cpu_seconds(), _own_cpu_seconds(), time.perf_counter()
        for _ in range(k):
            fn()
        dt = time.perf_counter() - t0
        other = (_busy_cpu_seconds() - b0) - (_own_cpu_seconds() - o0)
        (quiet if other < QUIET * dt else noisy).append(dt / k)
        el = time.perf_counter() - start
        if (el >= min_time and len(quiet) >= want_quiet) or el >= max_time:
            break
    _stats["quiet" if quiet else "noisy"] += 1
    got = quiet or noisy
    return min(got), statistics.median(got)


def read_floor(threads: int) -> dict[str, float]:
    from engine.backends.cpu import _kernels as C
    buf = np.ones(1 << 30, dtype=np.uint8)
    out = {}
    prev = C.get_threads()
    for th in sorted({1, threads}):
        C.set_threads(th)
        best, _ = timeit(lambda: C.read_sum(buf), min_time=1.0, sample_time=0.2)
        out[f"read_sum x{th}"] = buf.nbytes / best / 1e9
    C.set_threads(prev)
    best, _ = timeit(lambda: buf.view(np.uint64).sum(), min_time=1.0, sample_time=0.2)
    out["numpy sum x1"] = buf.nbytes / best / 1e9
    dst = np.empty(256 << 20, dtype=np.uint8)
    src = buf[:dst.nbytes]
    best, _ = timeit(lambda: np.copyto(dst, src), min_time=1.0, sample_time=0.2)
    out["numpy copy x1 (read+write)"] = 2 * dst.nbytes / best / 1e9
    return out


def decode(t: int, shape, rng, floor: float):
    f = Q.FORMATS[t]
    rows, cols = shape
    w = Q.random_blocks(t, rng, rows * cols // f.block_elems, 0.02).reshape(rows, -1)
    x = rng.standard_normal((1, cols), dtype=np.float32)
    n_copies = max(2, POOL_BYTES // w.nbytes)
    pool = np.empty((n_copies,) + w.shape, dtype=np.uint8)
    pool[:] = w
    i = [0]

    def cold():
        K.matmul(t, pool[i[0] % n_copies], x)
        i[0] += 1

    def cold_q8():
        K.matmul_q8(t, pool[i[0] % n_copies], x)
        i[0] += 1

    for label, fn, hot in (("float", cold, lambda: K.matmul(t, w, x)),
                           ("q8", cold_q8, lambda: K.matmul_q8(t, w, x))):
        if label == "q8" and not K.has_q8(t):
            break
        best_c, med_c = timeit(fn, sample_time=0.1)
        best_h, med_h = timeit(hot)
        gbs = w.nbytes / best_c / 1e9
        print(f"  {f.name:8s} {label:5s} {rows:5d}x{cols:<5d} {w.nbytes / 2**20:6.1f} MiB  cold {gbs:6.2f} GB/s "
              f"(median {w.nbytes / med_c / 1e9:6.2f})  hot {w.nbytes / best_h / 1e9:6.2f} GB/s  "
              f"{gbs / floor:5.0%} of floor  {best_c * 1e3:6.2f} ms/call", flush=True)


def batched(names, types, rng, Ts):
    """Fused kernels first for every format and T, then the BLAS path and np.matmul: busy-waiting
    OpenBLAS threads left over from a np.matmul call would otherwise slow the next fused
    measurement (and spinning OpenMP threads the next BLAS one)."""
    cases = []
    for name in names:
        t = types[name]
        f = Q.FORMATS[t]
        rows, cols = SHAPES[name][0]
        w = Q.random_blocks(t, rng, rows * cols // f.block_elems, 0.02).reshape(rows, -1)
        for T in Ts:
            cases.append((name, t, w, T, rng.standard_normal((T, cols), dtype=np.float32)))
    fused, q8, q8rows, q8gemm = {}, {}, {}, {}
    for name, t, w, T, x in cases:
        fused[name, T], _ = timeit(lambda: K.matmul(t, w, x, method="fused"))
        if K.has_q8(t):
            q8[name, T], _ = timeit(lambda: K.matmul_q8(t, w, x))
            default = K.q8_gemm_min_t(t)
            if default:                      # the row kernels and the GEMM form, each forced
                for forced, store in ((10**6, q8rows), (1, q8gemm)):
                    K._K.q8_gemm_min_t(t, forced)
                    store[name, T], _ = timeit(lambda: K.matmul_q8(t, w, x))
                K._K.q8_gemm_min_t(t, 0)     # each build's own default
    time.sleep(1.0)
    blas, npf = {}, {}
    for name, t, w, T, x in cases:
        wf = K.dequantize_rows(t, w)
        blas[name, T], _ = timeit(lambda: K.matmul(t, w, x, method="blas"))
        npf[name, T], _ = timeit(lambda: np.matmul(x, wf.T))
    res = {}
    for name, t, w, T, x in cases:
        rows, cols = SHAPES[name][0]
        flop = 2.0 * T * rows * cols
        fu, bl, nf = (flop / d[name, T] / 1e9 for d in (fused, blas, npf))
        qq = flop / q8[name, T] / 1e9 if (name, T) in q8 else None
        qr = flop / q8rows[name, T] / 1e9 if (name, T) in q8rows else None
        qg = flop / q8gemm[name, T] / 1e9 if (name, T) in q8gemm else None
        res.setdefault(name, []).append((T, fu, bl, nf, qq, qr, qg))
        print(f"  {name:8s} {rows}x{cols} T={T:4d}: fused {fu:7.1f}  blas {bl:7.1f}  np.matmul f32 {nf:7.1f} GFLOP/s"
              f"   fused/np.matmul {fu / nf:5.2f}x  faster: {'fused' if fu >= bl else 'blas'}"
              + (f"   q8 {qq:7.1f} ({'q8' if qq >= fu else 'fused'} faster)" if qq else "")
              + (f"  [rows {qr:6.1f} / GEMM form {qg:6.1f}: {qg / qr:4.2f}x]" if qr else ""), flush=True)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None, help="kernel threads (default: kernels' default)")
    ap.add_argument("--formats", default=",".join(SHAPES), help="comma-separated format names")
    ap.add_argument("--T", default="2,4,8,16,32,64,128,512", help="batched token counts")
    ap.add_argument("--quick", action="store_true", help="first shape per format, T = 64,512 only")
    ap.add_argument("--no-batched", action="store_true")
    args = ap.parse_args(argv)
    if not K.available():
        print("engine.backends.cpu._kernels is not built; nothing to benchmark")
        return 1
    if args.threads:
        K.set_threads(args.threads)
    threads = K.get_threads()
    names = [n.strip().upper() for n in args.formats.split(",") if n.strip()]
    types = {Q.FORMATS[t].name: t for t in Q.FORMATS}
    Ts = [64, 512] if args.quick else [int(v) for v in args.T.split(",")]
    print(f"kernels: isa={K.isa()} threads={threads}  cpus={len(os.sched_getaffinity(0))}  "
          f"load={open('/proc/loadavg').read().split()[:3]}")
    floors = read_floor(threads)
    print("read floor: " + ",  ".join(f"{k} {v:.1f} GB/s" for k, v in floors.items()))
    floor = floors[f"read_sum x{threads}"]
    rng = np.random.default_rng(0)
    print(f"\ndecode (T = 1), {threads} threads; weight bytes read per second:")
    for name in names:
        for shape in SHAPES[name][: 1 if args.quick else None]:
            decode(types[name], shape, rng, floor)
    if args.no_batched:
        print(f"\nmeasurements from quiet samples: {_stats['quiet']}, from noisy ones only: {_stats['noisy']}")
        return 0
    print(f"\nbatched, {threads} threads (np.matmul: the float32 weights already decoded; "
          f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}):")
    crossover, q8_last, gemm_first = {}, {}, {}
    for name, res in batched(names, types, rng, Ts).items():
        blas_wins = [T for T, fu, bl, *_ in res if bl > fu]
        crossover[name] = min(blas_wins) if blas_wins else None
        if res[0][4] is not None:
            q8_wins = [T for T, fu, _, _, qq, *_ in res if qq >= fu]
            q8_last[name] = max(q8_wins) if q8_wins else None
        if res[0][5] is not None:
            g_wins = [T for T, *_, qr, qg in res if qg > qr]
            gemm_first[name] = (min(g_wins) if g_wins else None, K.q8_gemm_min_t(types[name]))
    print("\nfirst T where dequantize + BLAS beat the fused kernel: " +
          ", ".join(f"{k} {v if v is not None else 'never'}" for k, v in crossover.items()))
    if q8_last:
        print(f"largest T where the integer kernels beat the float ones (kernels.Q8_MAX_T = {K.Q8_MAX_T}): " +
              ", ".join(f"{k} {v if v is not None else 'none'}" for k, v in q8_last.items()))
    if gemm_first:
        print("first T where the integer GEMM form beats the integer row kernels (its default minimum): " +
              ", ".join(f"{k} {v if v is not None else 'never'} ({d})" for k, (v, d) in gemm_first.items()))
    print(f"\nmeasurements from quiet samples: {_stats['quiet']}, from noisy ones only: {_stats['noisy']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
