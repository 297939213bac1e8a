"""Fast CPU kernels for matmuls with GGUF block-format weights (the C extension engine.backends.cpu._kernels).

    matmul(type_id, w, x)       -> float32 [T, n_rows] = x @ W.T
    dequantize_rows(type_id, w) -> float32 [n_rows, n_in], bit-exact with quants.dequantize

``w`` is the packed weight as stored in the GGUF: uint8 [n_rows, row_bytes] whose rows are
contiguous (an np.memmap slice is read in place, never copied); ``x`` is float32 [T, n_in],
C-contiguous.  Formats: F32, F16, BF16, Q8_0, Q2_K, Q4_K, IQ2_XXS, MXFP4 (engine/gguf/quants.py).

Paths (``method``):

* "fused" (the C kernels; "auto" picks it): by the token count T,
  - T = 1: every weight row is decoded in registers a block at a time; block and sub-block scales
    multiply partial sums, the K-quant minimums use per-call sums of x;
  - 2 <= T <= 3 ("regs"): rows decoded in registers to their exact weights, applied to up to 4
    tokens per pass (the row stays in L1 between passes);
  - larger T ("panel"): a panel of rows is decoded (exact dequantizer) into a float buffer that
    stays in L2, and register tiles of 4 rows x 4 tokens run over it.
  Each weight is read from memory once per call whatever T.  Rows are split statically over
  OpenMP threads (set_threads; default: the CPUs this process may run on).  Float64 accumulation
  of the exact float32 products, rounded to float32 once, as quants.matvec(...,
  accumulate=np.float64): the results are the reference's bit for bit (but for a sum within
  ~2^-29 ulp of a float32 rounding boundary), on every path for F32 / F16 / BF16 and on the
  "regs" and "panel" paths for every format. The exception: the factored T = 1 kernels of the
  quant formats (F64_T1_TYPES lists the types without it) sum in float32, as the exact-weight
  float64 form is 1.6-3.4x slower from cache there (docs/cpu-kernels.md, "Float kernels").
  With set_batch_invariant(True) a token's result does not depend on T, path or threads.
* "f64": "fused", but T = 1 of a quant format takes the float64 in-register path: every result
  is the exact sum of the float32 products rounded once (tests; CpuOps does not use it: a quant
  format without an integer kernel meets rounded activations in ds4 numerics anyway).
* "blas": the C dequantizer decodes a chunk of rows (one call, one thread: OpenMP and OpenBLAS
  threads fighting over the same cores is much slower), then np.matmul multiplies it in float64
  (the reference's arithmetic: the same float32 results as the fused paths).
  On the development machine (2-core Zen 4) the fused kernels beat it at every T measured (1 to
  512; scripts/bench_kernels.py), so "auto" uses it only from BLAS_MIN_T tokens (None: never).
* "regs" / "panel" force one fused sub-path (tests, benchmarks).

matmul_q8 / matmul_q8_batch (ds4 numerics) quantize x to Q8_0 / Q8_K blocks and take exact
integer dot products per block, each times the float32 product of the two scales and added in
float32 in block order, as ds4's CPU path (engine/model/ds4_matmul.py, the NumPy reference's
default, bit for bit on every build and form): row kernels for a few tokens (a weight block decoded in registers, up to 8
tokens per pass), and on the AVX-512 VNNI and AVX2 builds a GEMM form from q8_gemm_min_t(type)
tokens (16-row panels decoded once, repacked with rows in the lanes: one vpdpbusd per 64 products,
or maddubs + madd per 32 on AVX2).

Without the extension (no C compiler at install time) available() is False and both functions
still work: matmul through quants.dequantize + np.matmul, matmul_q8 through ds4_matmul.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np

from ...gguf import quants as Q
from ...model import ds4_float as _F
from ...model import ds4_matmul as _D

# OpenMP's wait policy, read once when libgomp loads with the extension: passive (a thread that
# waits at a barrier sleeps) unless the user set OMP_WAIT_POLICY.  With 2 threads on 2 cores that
# others also use, libgomp's default spin let a waiting thread burn the core its partner needed:
# a 4-layer real-width decode (AVX2 build, Zen 4 VM at load average 15-22) ran 0.49-0.59 t/s with
# the default and 0.43-0.50 with ACTIVE, 1.88-3.42 with PASSIVE, 1.53-1.96 with GOMP_SPINCOUNT=10000
# (docs/performance.md, issue 36).  Set for the import only: child processes keep the user's env.
_SET_WAIT = "OMP_WAIT_POLICY" not in os.environ
if _SET_WAIT:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
try:  # built by setup.py (optional extension)
    from . import _kernels as _K
except ImportError:  # pragma: no cover - depends on the install
    _K = None
finally:
    if _SET_WAIT:
        os.environ.pop("OMP_WAIT_POLICY", None)

__all__ = ["available", "isa", "set_threads", "get_threads", "set_batch_invariant", "matmul", "matmul_q8",
           "matmul_q8_batch", "matmul_q8_mixed", "round_q8", "has_q8", "q8_gemm_min_t", "q8_beats_float", "dequantize_rows", "BLAS_MIN_T", "Q8_MAX_T", "F64_T1_TYPES"]

#: the token count from which method="auto" uses dequantize + BLAS instead of the fused kernels;
#: None: never (scripts/bench_kernels.py measures both and prints the crossover, if any)
BLAS_MIN_T: int | None = None

_PATHS = {"fused": 0, "regs": 1, "panel": 2, "f64": 3}

#: integer-activation kernels (ds4 numerics): the weight types that have one, with the activation
#: block they quantize x to (Q8_0: 32 values, Q8_K: 256), and the largest T they are used for
#: by CpuOps (beyond it the float panel kernels over the rounded activations are faster:
#: scripts/bench_kernels.py prints the crossover: about 8 tokens on a 2-core Zen 4)
Q8_ACT_BLOCK = {Q.Q8_0: 32, Q.IQ2_XXS: 256, Q.Q2_K: 256}
Q8_MAX_T = 8

# decoded floats per chunk of the BLAS path (4 MiB: stays in L3 between decode and matmul)
_BLAS_CHUNK_ELEMS = 1 << 20

_TYPES = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q2_K, Q.Q4_K, Q.IQ2_XXS, Q.MXFP4})

#: the weight types whose T = 1 kernel sums in float64 too (the reference's bits at every T); the
#: quant formats' T = 1 kernels apply block scales to float32 partial sums (method="f64" and
#: set_batch_invariant(True) take them through the float64 in-register path instead)
F64_T1_TYPES = frozenset({Q.F32, Q.F16, Q.BF16})


def build_is_current() -> bool | None:
    """Whether the loaded extension was built from the C sources next to this package (their
    hash is compiled in). None without the extension or without the sources.
    False means a rebuild failed and pip kept the old binary (the extension is optional)."""
    if _K is None:
        return None
    from .kernel_sources import source_hash
    h = source_hash(str(Path(__file__).resolve().parents[3]))
    return None if h is None else getattr(_K, "source_hash", "") == h


def available() -> bool:
    """True when the compiled kernels are importable (else the NumPy fallback is used)."""
    return _K is not None


def isa() -> str | None:
    """The kernel build in use ("avx512vbmi", "avx512", "avx2", "generic"), None without the extension."""
    return _K.isa() if _K is not None else None


def set_isa(name: str) -> None:
    """Use the kernel build `name` ("generic", "avx2", "avx512", "avx512vbmi": one this machine runs,
    e.g. the AVX2 build on an AVX-512 machine, to measure what an AVX2-only machine gets). The
    environment variable DS4_CPU_ISA does the same when this module loads (ds4-bench --isa)."""
    have = list(_K.isas()) if _K is not None else []
    if name not in have:
        raise ValueError(f"kernel build {name!r} is not available here (this machine runs: {', '.join(have) or 'none'})")
    _K.set_isa(name)


def set_threads(n: int) -> None:
    """Threads used by the C kernels (matmul's fused path, dequantize_rows)."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= int(n) <= 1024:
        raise ValueError(f"thread count must be an integer in 1..1024, got {n!r}")
    if _K is not None:
        _K.set_threads(int(n))


def get_threads() -> int:
    return _K.get_threads() if _K is not None else 1


def set_batch_invariant(on: bool) -> bool:
    """Batch invariance of the fused kernels (default off); returns the previous setting.

    On: T = 1 uses the exact-weight in-register kernel instead of the faster factored one, and
    every fused path then sums each (row, token) in the same order, so a token's float32 result
    is bit-identical whatever T, path ("regs" / "panel") or thread count (the "blas" path is
    not).  Off: results of different T differ by rounding.  The integer kernels: on, the GEMM
    form is off and q8_beats_float says yes at every T (the row kernels sum each (row, token) in
    the same order whatever T; a switch to the float kernels at 9+ tokens would not)."""
    return bool(_K.set_batch_invariant(bool(on))) if _K is not None else False


def batch_invariant() -> bool:
    """The current set_batch_invariant setting."""
    return _K is not None and bool(_K.batch_invariant())


def _default_threads() -> int:
    env = os.environ.get("DS4_KERNEL_THREADS")
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            pass
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


if _K is not None:
    _K.set_threads(_default_threads())
    if os.environ.get("DS4_CPU_ISA"):
        try:
            set_isa(os.environ["DS4_CPU_ISA"])
        except ValueError as e:
            warnings.warn(f"DS4_CPU_ISA: {e}; keeping {_K.isa()}", RuntimeWarning)
    if build_is_current() is False:
        warnings.warn("engine.backends.cpu._kernels was built from older C sources (a failed rebuild keeps the old "
                      "binary): run `pip install -e .` and read the compiler's errors", RuntimeWarning)


def _format(type_id) -> Q.BlockFormat:
    if isinstance(type_id, bool) or not isinstance(type_id, (int, np.integer)):
        raise ValueError(f"type_id must be an integer ggml type id, got {type_id!r}")
    if int(type_id) not in _TYPES:
        raise ValueError(f"unsupported weight type {Q.type_name(int(type_id))}")
    return Q.FORMATS[int(type_id)]


def _check_w(f: Q.BlockFormat, w) -> tuple[np.ndarray, int]:
    if not isinstance(w, np.ndarray):
        raise ValueError(f"w must be a numpy uint8 array (or np.memmap), got {type(w).__name__}")
    if w.dtype != np.uint8:
        raise ValueError(f"w must have dtype uint8 (packed {f.name} rows), got {w.dtype}")
    if w.ndim != 2:
        raise ValueError(f"w must be 2-D [n_rows, row_bytes], got shape {w.shape}")
    if w.shape[1] > 1 and w.strides[1] != 1:
        raise ValueError("w rows must be contiguous (stride 1 along the last axis)")
    if w.shape[1] % f.block_bytes:
        raise ValueError(f"{f.name}: rows of {w.shape[1]} bytes are not a multiple of the block size {f.block_bytes}")
    return w, w.shape[1] // f.block_bytes * f.block_elems


def _check_x(x, n_in: int) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        raise ValueError(f"x must be a numpy float32 array, got {type(x).__name__}")
    if x.dtype != np.float32:
        raise ValueError(f"x must have dtype float32, got {x.dtype}")
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D [T, n_in], got shape {x.shape}")
    if x.shape[1] != n_in:
        raise ValueError(f"x has {x.shape[1]} columns, the weight rows have {n_in} values")
    if not x.flags.c_contiguous:
        raise ValueError("x must be C-contiguous")
    return x


def _dequantize_into(type_id: int, w: np.ndarray, out: np.ndarray, threads: int = 0) -> None:
    if _K is not None:
        _K.dequantize(type_id, w, out, threads)
    else:
        out[...] = Q.dequantize(type_id, w)


def dequantize_rows(type_id: int, w: np.ndarray) -> np.ndarray:
    """Decode every row of a packed 2-D weight: uint8 [n_rows, row_bytes] -> float32 [n_rows, n_in]
    (multi-threaded; bit-exact with quants.dequantize)."""
    f = _format(type_id)
    w, n_in = _check_w(f, w)
    out = np.empty((w.shape[0], n_in), dtype=np.float32)
    if out.size:
        _dequantize_into(f.type_id, w, out)
    return out


def _matmul_blas(type_id: int, w: np.ndarray, x: np.ndarray, n_in: int) -> np.ndarray:
    n_rows, T = w.shape[0], x.shape[0]
    yT = np.empty((n_rows, T), dtype=np.float32)
    if n_rows == 0 or T == 0:
        return np.ascontiguousarray(yT.T)
    if n_in == 0:
        return np.zeros((T, n_rows), dtype=np.float32)
    chunk = max(1, min(n_rows, _BLAS_CHUNK_ELEMS // n_in))
    buf = np.empty((chunk, n_in), dtype=np.float32)
    xT = x.T.astype(np.float64)                # float64 products and sums, one rounding (as quants.matvec)
    for r0 in range(0, n_rows, chunk):
        r1 = min(n_rows, r0 + chunk)
        b = buf[:r1 - r0]
        _dequantize_into(type_id, w[r0:r1], b, 1)
        yT[r0:r1] = np.matmul(b.astype(np.float64), xT)
    return np.ascontiguousarray(yT.T)


def has_q8(type_id: int) -> bool:
    """True when matmul_q8 has a compiled integer kernel for this weight type."""
    return _K is not None and int(type_id) in Q8_ACT_BLOCK and bool(_K.has_q8(int(type_id)))


def q8_gemm_min_t(type_id: int) -> int:
    """The smallest token count from which matmul_q8 / matmul_q8_batch take the integer GEMM form
    (weight panels decoded and repacked once, 64 products per VNNI instruction: AVX-512 VNNI build
    only); 0 when there is none (other builds, batch-invariant mode, no extension)."""
    if _K is None or int(type_id) not in Q8_ACT_BLOCK:
        return 0
    return int(_K.q8_gemm_min_t(int(type_id)))


def q8_beats_float(type_id: int, T: int) -> bool:
    """Whether the integer kernels are the faster way to take T tokens through a weight of this
    type (ds4 numerics): the row kernels up to Q8_MAX_T tokens, the GEMM form from its minimum;
    otherwise the float kernels over the rounded activations are faster."""
    if not has_q8(type_id):
        return False
    if T <= Q8_MAX_T:                         # (decode asks ~20 times a token: no more calls)
        return True
    g = q8_gemm_min_t(type_id)
    return (g > 0 and T >= g) or batch_invariant()


def round_q8(x: np.ndarray, block: int) -> np.ndarray:
    """numerics.q8_0_round (block 32) / q8_k_round (block 256) of a 2-D float32 x, bit-exact, in C
    (multi-threaded over rows); the NumPy functions without the extension."""
    from ...model import numerics as N
    if block not in (32, 256):
        raise ValueError(f"block must be 32 (Q8_0) or 256 (Q8_K), got {block!r}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    if _K is None or x.ndim != 2 or x.shape[1] % block:
        return N.q8_0_round(x) if block == 32 else N.q8_k_round(x)
    out = np.empty_like(x)
    if x.size:
        _K.round_q8(block, x, out)
    return out


def rmsnorm(x: np.ndarray, w, eps: float):
    """NumpyOps.rmsnorm over the last axis of x, in C (float64 sums, multi-threaded over rows);
    None without the extension."""
    if _K is None:
        return None
    x = np.ascontiguousarray(x, dtype=np.float32)
    x2 = x.reshape(-1, x.shape[-1]) if x.ndim != 2 else x
    out = np.empty_like(x2)
    if x2.size:
        wv = None if w is None else np.ascontiguousarray(w, dtype=np.float32).reshape(1, -1)
        _K.rmsnorm(x2, wv, float(eps), out)
    return out.reshape(x.shape)


def hc_split(mix: np.ndarray, n: int, scale, base, eps: float, iters: int):
    """The hyper-connection weights (pre [T, n], post [T, n], C [T, n, n]) of NumpyOps.hc_split
    in float32 C, one token at a time, bit for bit: the exponentials are NumPy's (np.exp, called
    from C between the two halves), whose last bit differs from libm's expf; None without the
    extension."""
    if _K is None:
        return None
    mix = np.ascontiguousarray(mix, dtype=np.float32)
    T = mix.shape[0]
    pre, post = np.empty((T, n), np.float32), np.empty((T, n), np.float32)
    c = np.empty((T, n * n), np.float32)
    a = np.empty((T, 2 * n + n * n), np.float32)
    _K.hc_split(mix, int(n), np.ascontiguousarray(scale, dtype=np.float32).reshape(1, -1)[:, :3],
                np.ascontiguousarray(base, dtype=np.float32).reshape(1, -1), float(eps), int(iters), pre, post, c,
                a, np.exp)
    return pre, post, c.reshape(T, n, n)


def rope(x: np.ndarray, cs: np.ndarray, per: int, out: np.ndarray) -> np.ndarray | None:
    """numerics.apply_rope (NumpyOps.rope bit for bit) on x [R, W] into out [R, W] (may be x):
    the last 2 * npair values of row r rotated by cs [R / per, npair] (complex64 cos + i sin,
    conjugated for the inverse); None without the extension."""
    if _K is None:
        return None
    _K.rope(x, np.ascontiguousarray(cs).view(np.float32), int(per), out)
    return out


def hc_post(y: np.ndarray, X: np.ndarray, post: np.ndarray, C: np.ndarray):
    """NumpyOps.hc_post (float64 sums over the streams, the same roundings) in C, multi-threaded;
    y [T, E], X [T, n, E], post [T, n], C [T, n, n] -> [T, n, E]; None without the extension."""
    if _K is None:
        return None
    X = np.ascontiguousarray(X, dtype=np.float32)
    T, n, E = X.shape
    out = np.empty((T, n, E), np.float32)
    _K.hc_post(np.ascontiguousarray(y, dtype=np.float32).reshape(T, E), X.reshape(T * n, E),
               np.ascontiguousarray(post, dtype=np.float32).reshape(T, n),
               np.ascontiguousarray(C, dtype=np.float32).reshape(T, n * n), out.reshape(T * n, E))
    return out


def hc_pre_mix(pre: np.ndarray, X: np.ndarray):
    """NumpyOps.hc_pre_mix (float64 sums over the streams, in order, one rounding) in C; pre
    [T, n], X [T, n, E] -> [T, E]; None without the extension."""
    if _K is None:
        return None
    X = np.ascontiguousarray(X, dtype=np.float32)
    T, n, E = X.shape
    out = np.empty((T, E), np.float32)
    _K.hc_pre_mix(np.ascontiguousarray(pre, dtype=np.float32).reshape(T, n), X.reshape(T * n, E), out)
    return out


def attention(q: np.ndarray, segments, sinks: np.ndarray, scale: float):
    """NumpyOps.attention (q [T, H, D]; segments: (keys [K, D] or [T, K, D], mask [T, K] bool);
    the sink logit in the denominator only; K = V) in C: per query and up to 16 heads, the scores
    (q . key) * scale, the softmax and the weighted sum of the attended keys in float64 (register
    tiles), the output rounded to float32 once, as the reference, so the two agree to the last bit
    but for a value whose float64 sums straddle a float32 rounding boundary (~2^-29 a value);
    units over the threads. None where this build has no attention kernel (the portable one)."""
    if _K is None or not _K.has_attention():
        return None
    q = np.asarray(q, dtype=np.float32)
    T, H, D = q.shape
    qs = np.ascontiguousarray(q).reshape(T * H, D)
    segs = []
    for keys, mask in segments:
        mask = np.ascontiguousarray(mask, dtype=bool)
        if mask.shape[1] == 0:
            continue
        keys = np.ascontiguousarray(keys, dtype=np.float32)
        per_query = keys.ndim == 3
        segs.append((keys.reshape(-1, D), mask.view(np.uint8), per_query))
    out = np.empty((T * H, D), np.float32)
    _K.attention(qs, np.ascontiguousarray(sinks, dtype=np.float32).reshape(1, H), out, segs, float(scale))
    return out.reshape(T, H, D)


def store_kv(rows: np.ndarray, n_nope: int):
    """numerics.f16_round(numerics.fp8_e4m3_roundtrip(rows, n_nope)) in C, bit-identical (the same
    float32 operations); rows [..., D]; None without the extension."""
    if _K is None:
        return None
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    flat = rows.reshape(-1, rows.shape[-1]) if rows.ndim != 2 else rows
    out = np.empty_like(flat)
    _K.store_kv(flat, int(n_nope), out)
    return out.reshape(rows.shape)


def matmul_q8(type_id: int, w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """y = q8(x) @ W.T, ds4's quantized dot product: each token of x is quantized to Q8_0 blocks
    (Q8_0 weights) or Q8_K blocks (Q2_K, IQ2_XXS weights) exactly as numerics.q8_0_quantize /
    q8_k_quantize do, and the integer codes are multiplied with the weight codes (exact int32
    sums per block, times the float32 product of the scales, added in float32 in block order:
    ds4's dot_q8_0_row / ds4_vec_dot_{iq2_xxs,q2_K}_q8_K).  Equal to ds4_matmul.q8_0_matmul /
    q8_k_matmul bit for bit, which also run without a kernel for the type (or the extension)."""
    f = _format(type_id)
    if f.type_id not in Q8_ACT_BLOCK:
        raise ValueError(f"{f.name} weights have no quantized-activation product (Q8_0, Q2_K, IQ2_XXS do)")
    w, n_in = _check_w(f, w)
    x = _check_x(x, n_in)
    if not has_q8(f.type_id):
        if f.type_id == Q.Q8_0:
            return _D.q8_0_matmul(w, _D.q8_0_act(x))
        return _D.q8_k_matmul(f.type_id, w, _D.q8_k_act(x))
    y = np.empty((x.shape[0], w.shape[0]), dtype=np.float32)
    _K.matmul_q8_batch(f.type_id, [w], [x], [y])
    return y


def matmul_q8_batch(type_id: int, ws, xs) -> list[np.ndarray]:
    """[matmul_q8(type_id, w, x) for w, x in zip(ws, xs)] in one call: one parallel region whose
    threads share the rows of every matrix (a layer's routed experts: a handful of small
    matrices, for which a fork/join per matrix costs as much as the arithmetic)."""
    f = _format(type_id)
    if f.type_id not in Q8_ACT_BLOCK:       # (checked here too: an empty batch has no product to check)
        raise ValueError(f"{f.name} weights have no quantized-activation product (Q8_0, Q2_K, IQ2_XXS do)")
    ws = list(ws)
    return matmul_q8_mixed([f.type_id] * len(ws), ws, xs)


def matmul_q8_mixed(types, ws, xs) -> list[np.ndarray]:
    """matmul_q8_batch with a weight type per product: one parallel region for, e.g., a layer's
    shared expert (Q8_0) and its routed experts (IQ2_XXS / Q2_K) together, so the threads stream
    the memory-bound matrices while decoding the compute-bound ones."""
    types, ws, xs = [int(t) for t in types], list(ws), list(xs)
    if not (len(types) == len(ws) == len(xs)):
        raise ValueError(f"{len(types)} types, {len(ws)} weights and {len(xs)} inputs")
    checked = []
    for t, w, x in zip(types, ws, xs):
        f = _format(t)
        if f.type_id not in Q8_ACT_BLOCK:
            raise ValueError(f"{f.name} weights have no quantized-activation product (Q8_0, Q2_K, IQ2_XXS do)")
        w, n_in = _check_w(f, w)
        checked.append((w, _check_x(x, n_in)))
    if not all(has_q8(t) for t in types):
        return [matmul_q8(t, w, x) for t, (w, x) in zip(types, checked)]
    ys = [np.empty((x.shape[0], w.shape[0]), dtype=np.float32) for w, x in checked]
    _K.matmul_q8_batch(types, [w for w, _ in checked], [x for _, x in checked], ys)
    return ys


def matmul_q8_into(types, ws, xs, ys) -> None:
    """matmul_q8_mixed into given outputs (C-contiguous float32 [T, n_rows] each, e.g. the rows of
    one buffer), for callers whose arrays are already right: the extension checks every argument
    (ValueError naming it) but nothing is converted here. Needs the extension and a kernel for
    every type (has_q8). One token a product: xs may be one C-contiguous float32 array [1, n_in]
    (every product's input) or [n, n_in] (product i's in row i), and ys one [n, n_rows] (product
    i's output in row i). Products that read the same input in the same format share its
    quantization."""
    _K.matmul_q8_batch(types, ws, xs, ys)


def matmul_f16_seq(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """ds4 numerics' F16 matvec (ds4.c matvec_f16 / dot_f16_row on x86): y = x @ W.T with each
    product and partial sum rounded to float32, in index order; bit for bit ds4_float.f16_matvec,
    which also runs without the extension. w: F16 rows as uint8 [n_rows, 2 * n_in] (or float16
    [n_rows, n_in]), x float32 [T, n_in] -> float32 [T, n_rows]."""
    w16 = np.asarray(w)
    w16 = w16.view(np.float16) if w16.dtype == np.uint8 else w16
    if w16.dtype != np.float16 or w16.ndim != 2:
        raise ValueError(f"w must be F16 rows (uint8 [rows, 2 * n_in] or float16 [rows, n_in]), got {w16.dtype} {w16.shape}")
    x = _check_x(np.ascontiguousarray(x, dtype=np.float32), w16.shape[1])   # (the reference's float32 x)
    if _K is None or not hasattr(_K, "f16_seq"):
        return _F.f16_matvec(w16, x)
    y = np.empty((x.shape[0], w16.shape[0]), dtype=np.float32)
    _K.f16_seq(np.ascontiguousarray(w16), x, y, w16.shape[1])
    return y


def matmul(type_id: int, w: np.ndarray, x: np.ndarray, *, method: str = "auto") -> np.ndarray:
    """y = x @ W.T: w uint8 [n_rows, row_bytes] (packed rows of ``type_id``), x float32 [T, n_in]
    C-contiguous -> float32 [T, n_rows] (C-contiguous).
    method: "auto" (default), "fused", "regs", "panel", "f64" or "blas" (module docstring)."""
    f = _format(type_id)
    w, n_in = _check_w(f, w)
    x = _check_x(x, n_in)
    T = x.shape[0]
    if method == "auto":
        method = "fused" if _K is not None and (BLAS_MIN_T is None or T < BLAS_MIN_T) else "blas"
    elif method == "f64" and _K is None:
        method = "blas"                          # (float64 as well)
    if method in _PATHS:
        if _K is None:
            raise RuntimeError("engine.backends.cpu._kernels is not built (no C compiler at install time?)")
        y = np.empty((T, w.shape[0]), dtype=np.float32)
        _K.matmul(f.type_id, w, x, y, 0, _PATHS[method])
        return y
    if method == "blas":
        return _matmul_blas(f.type_id, w, x, n_in)
    raise ValueError(f"method must be 'auto', 'fused', 'regs', 'panel', 'f64' or 'blas', got {method!r}")
