"""Custom Metal kernels of the mlx backend, built lazily with mx.fast.metal_kernel.

The kernel bodies live in the top-level metal_kernels/*.metal (package data), with common.metal as the shared
`header=`. The same files compile on the host, as C++, in tests/metal_emu: docs/metal-kernels.md
says what that proves. Nothing here runs without Metal: `available()` says whether it can.
KERNELS names each kernel's inputs and outputs (MLX writes the signature from them); the tests
read it too, so the emulated signature cannot drift from the real one.
"""
from __future__ import annotations

import functools

import numpy as np

from ..kernel_sources import read_source

# name -> (body file, input names, output names)
KERNELS = {
    "gather_matvec_decode": ("gather_matvec_decode.metal", ("raw", "x", "experts", "toks", "dims"), ("out",)),
    "gather_matvec_batched": ("gather_matvec_batched.metal",
                              ("raw", "x", "experts", "toks", "perm", "chunks", "dims"), ("out",)),
    "hc_split": ("hc_split.metal", ("mix", "scale", "base", "eps", "iters", "dims"), ("pre", "post", "C")),
    "attention": ("attention.metal", ("q", "keys", "mask", "sinks", "scale", "dims"), ("out",)),
    "topk": ("topk.metal", ("scores", "dims"), ("out",)),
}
KINDS = {"iq2_xxs": (0, 66), "q2_k": (1, 84)}     # kind -> (KIND template value, block bytes)
BATCH_TILE_ROWS, BATCH_TILE_PAIRS = 16, 8          # gather_matvec_batched.metal's TR and TP
DECODE_ROWS_PER_TG = 4                              # simdgroups (rows) per decode threadgroup
ATTN_SIMDGROUPS = 8                                 # attention.metal's SMAX
TOPK_MAX, TOPK_THREADS = 1024, 512                  # common.metal's TOPK_MAX


def source(file: str) -> str:
    return read_source("metal_kernels", file)


def available() -> bool:
    try:
        import mlx.core as mx
    except ImportError:
        return False
    return bool(mx.metal.is_available())


@functools.cache
def _kernel(name: str):
    import mlx.core as mx
    file, inputs, outputs = KERNELS[name]
    return mx.fast.metal_kernel(name=name, input_names=list(inputs), output_names=list(outputs),
                                source=source(file), header=source("common.metal"))


def batch_plan(experts: np.ndarray, tile_pairs: int = BATCH_TILE_PAIRS) -> tuple[np.ndarray, np.ndarray]:
    """The batched form's schedule: perm (pair indices sorted by expert, stable) and chunks
    [n, 2] = (start, count) in perm, each of one expert and at most tile_pairs long."""
    experts = np.asarray(experts).reshape(-1)
    perm = np.argsort(experts, kind="stable").astype(np.int32)
    sorted_e = experts[perm]
    starts = np.flatnonzero(np.r_[True, sorted_e[1:] != sorted_e[:-1]]) if len(perm) else np.zeros(0, int)
    ends = np.r_[starts[1:], len(perm)]
    chunks = [(s, min(tile_pairs, e - s)) for s0, e in zip(starts, ends) for s in range(s0, e, tile_pairs)]
    return perm, np.array(chunks, dtype=np.int32).reshape(-1, 2)


BATCH_MIN_PAIRS = 16     # fewer pairs always take the decode form


def use_batched(experts: np.ndarray) -> bool:
    """Batched when pairs share experts enough to reuse a dequantized tile (mean run >= 2)."""
    experts = np.asarray(experts).reshape(-1)
    return len(experts) >= BATCH_MIN_PAIRS and len(experts) >= 2 * len(np.unique(experts))


def gather_matvec(kind: str, raw, x, experts, toks):
    """out[p] = dequant(raw[experts[p]]) @ x[toks[p]]: raw uint8 [E, n_out, row_bytes] (GGUF
    blocks as stored), x float32 [T, n_in], experts and toks int32 [P] -> float32 [P, n_out]."""
    import mlx.core as mx
    kval, bb = KINDS[kind]
    _, n_out, row_bytes = raw.shape
    n_in = x.shape[1]
    if row_bytes != n_in // 256 * bb or n_in % 256:
        raise ValueError(f"{kind}: rows of {row_bytes} bytes do not hold {n_in} values")
    P = experts.shape[0]
    if P == 0:                   # an empty grid is not a launch
        return mx.zeros((0, n_out), dtype=mx.float32)
    dims = mx.array([n_out, n_in, row_bytes], dtype=mx.int32)
    raw, x = raw.astype(mx.uint8), x.astype(mx.float32)
    experts, toks = experts.astype(mx.int32), toks.astype(mx.int32)
    # the batched plan reads the experts on the host (a sync); a decode step's few pairs never
    # batch, so it launches without reading them
    e_host = np.array(experts) if P >= BATCH_MIN_PAIRS else None
    if e_host is not None and use_batched(e_host):
        perm, chunks = batch_plan(e_host)
        inputs = [raw, x, experts, toks, mx.array(perm), mx.array(chunks), dims]
        grid = (128 * -(-n_out // BATCH_TILE_ROWS), len(chunks), 1)
        tg, name = (128, 1, 1), "gather_matvec_batched"
    else:
        inputs = [raw, x, experts, toks, dims]
        grid = (32 * DECODE_ROWS_PER_TG * -(-n_out // DECODE_ROWS_PER_TG), P, 1)
        tg, name = (32 * DECODE_ROWS_PER_TG, 1, 1), "gather_matvec_decode"
    return _kernel(name)(inputs=inputs, template=[("KIND", kval)], grid=grid, threadgroup=tg,
                         output_shapes=[(P, n_out)], output_dtypes=[mx.float32])[0]


def hc_split(mix, n: int, scale, base, eps: float, iters: int):
    """NumpyOps.hc_split on the GPU: (pre [T, n], post [T, n], C [T, n, n])."""
    import mlx.core as mx
    T = mix.shape[0]
    inputs = [mix.astype(mx.float32), scale.astype(mx.float32), base.astype(mx.float32),
              mx.array([eps], dtype=mx.float32), mx.array([iters], dtype=mx.int32), mx.array([T], dtype=mx.int32)]
    tg = max(1, min(256, T))     # no barriers or simd ops: any size works
    return tuple(_kernel("hc_split")(inputs=inputs, template=[("N", n)], grid=(T, 1, 1), threadgroup=(tg, 1, 1),
                                     output_shapes=[(T, n), (T, n), (T, n, n)],
                                     output_dtypes=[mx.float32] * 3))


def attention(q, keys, mask, sinks, scale: float):
    """NumpyOps.attention with one key segment: q [T, H, D], keys [K, D] or [T, K, D], mask [T, K]."""
    import mlx.core as mx
    T, H, D = q.shape
    K = keys.shape[-2]
    if D % 32 or D > 512:
        raise ValueError(f"attention: D = {D} must be a multiple of 32, at most 512")
    dims = mx.array([T, H, D, K, int(keys.ndim == 3)], dtype=mx.int32)
    inputs = [q.astype(mx.float32), keys.astype(mx.float32), mask.astype(mx.uint8),
              sinks.astype(mx.float32), mx.array([scale], dtype=mx.float32), dims]
    tg = 32 * ATTN_SIMDGROUPS
    return _kernel("attention")(inputs=inputs, grid=(tg, T * H, 1), threadgroup=(tg, 1, 1),
                                output_shapes=[(T, H, D)], output_dtypes=[mx.float32])[0]


def topk(scores, k: int):
    """NumpyOps.topk_lowest_index: int32 [T, k], the k largest per row, ties to the lowest index."""
    import mlx.core as mx
    T, C = scores.shape
    if not 0 < k <= min(C, TOPK_MAX):
        raise ValueError(f"topk: k = {k} must be in 1..min(C = {C}, {TOPK_MAX})")
    dims = mx.array([T, C, k], dtype=mx.int32)
    return _kernel("topk")(inputs=[scores.astype(mx.float32), dims], grid=(TOPK_THREADS, T, 1),
                           threadgroup=(TOPK_THREADS, 1, 1), output_shapes=[(T, k)], output_dtypes=[mx.int32])[0]
