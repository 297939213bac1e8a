"""ds4's rounding steps (engine/model/numerics.py) on device arrays, the same operations in the
same order, so the results are bit for bit the spec's.

Every function takes `xp` (cupy, or the NumPy-backed stand-in) and a float32 device array, works
along the last axis (blocked where the spec blocks) and returns a new float32 device array. CUDA
has float64, so the one float64 step of the spec (log2 in `_pow2_scale`) is done as written there;
the docstrings of the spec say why each step is what it is.
"""
from __future__ import annotations

import math

import numpy as np

from ...model import numerics as N

_F32 = np.float32
_INV_127 = _F32(1.0) / _F32(127.0)
_NEG_INV_127 = _F32(-1.0) / _F32(127.0)
_INV_448 = _F32(1.0) / _F32(N.E4M3_MAX)
_INV_6 = _F32(1.0) / _F32(6.0)
_MIDS = [_F32(m) for m in N._E2M1_MIDS]


def _f32(xp, x):
    return xp.asarray(x, dtype=xp.float32)


def _blocks(x, n: int, block: int, what: str):
    if n % block:
        raise ValueError(f"{what}: length {n} is not a multiple of the block size {block}")
    return x[..., :n].reshape(x.shape[:-1] + (n // block, block))


def _pow2_scale(xp, amax, floor, inv_top):
    """N._pow2_scale: 2^ceil(log2f(max(amax, floor) * inv_top)), log2 in float64 rounded once."""
    r = (xp.maximum(amax, floor) * inv_top).astype(xp.float32)
    e = xp.ceil(xp.log2(r.astype(xp.float64)).astype(xp.float32)).astype(xp.int32)
    return xp.ldexp(xp.ones(e.shape, dtype=xp.float32), e).astype(xp.float32)


def f16_round(xp, x):
    return _f32(xp, x).astype(xp.float16).astype(xp.float32)


def e4m3_round(xp, v):
    v = _f32(xp, v)
    av = xp.minimum(xp.abs(v), _F32(N.E4M3_MAX))
    _, ex = xp.frexp(av)
    step = xp.maximum(ex - 1, -6) - 3
    q = xp.ldexp(xp.rint(xp.ldexp(av, -step)), step).astype(xp.float32)
    return xp.where(v < 0, -q, q).astype(xp.float32)


def fp8_e4m3_roundtrip(xp, x, n_dims: int | None = None, block: int = 64):
    x = _f32(xp, x)
    n = x.shape[-1] if n_dims is None else int(n_dims)
    if not 0 <= n <= x.shape[-1]:
        raise ValueError(f"fp8_e4m3_roundtrip: n_dims {n} outside 0..{x.shape[-1]}")
    if n == 0:
        return x.copy()
    b = _blocks(x, n, block, "fp8_e4m3_roundtrip")
    scale = _pow2_scale(xp, xp.max(xp.abs(b), axis=-1, keepdims=True), N._FP8_AMAX_FLOOR, _INV_448)
    v = xp.clip(b / scale, _F32(-N.E4M3_MAX), _F32(N.E4M3_MAX))
    head = (e4m3_round(xp, v) * scale).reshape(x.shape[:-1] + (n,))
    return head if n == x.shape[-1] else xp.concatenate([head, x[..., n:]], axis=-1)


def e2m1_round(xp, v):
    v = _f32(xp, v)
    av = xp.minimum(xp.abs(v), _F32(6.0))
    code = xp.zeros(av.shape, dtype=xp.int32)
    for k, mid in enumerate(_MIDS):                  # 7 constants, not a loop over data
        up = (av > mid) | ((av == mid) & (k % 2 == 1))
        code = code + up.astype(xp.int32)
    q = xp.take(xp.asarray(N.E2M1_VALUES), code)
    return xp.where(v < 0, -q, q).astype(xp.float32)


def hadamard128(xp, x):
    y = _f32(xp, x)
    n = y.shape[-1]
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard128: last axis {n} is not a power of two")
    lead = y.shape[:-1]
    s = 1
    while s < n:
        yb = y.reshape(lead + (n // (2 * s), 2, s))
        a, b = yb[..., 0, :], yb[..., 1, :]
        y = xp.stack([a + b, a - b], axis=-2).reshape(lead + (n,))
        s *= 2
    return (y * _F32(1.0 / math.sqrt(n))).astype(xp.float32)


def indexer_qat(xp, x):
    h = hadamard128(xp, x)
    b = _blocks(h, h.shape[-1], 32, "indexer_qat")
    scale = _pow2_scale(xp, xp.max(xp.abs(b), axis=-1, keepdims=True), N._FP4_AMAX_FLOOR, _INV_6)
    v = xp.clip(b / scale, _F32(-6.0), _F32(6.0))
    return (e2m1_round(xp, v) * scale).reshape(h.shape).astype(xp.float32)


def _codes(xp, b, scale):
    """N._codes: rint(b * scale), NaN -> 0, clamped to [-127, 127], as float32 integers."""
    v = xp.rint(b * scale)
    v = xp.where(xp.isnan(v), _F32(0.0), v)
    return xp.clip(v, -127, 127).astype(xp.int8)


def q8_0_quantize(xp, x):
    x = _f32(xp, x)
    n = x.shape[-1]
    pad = (-n) % 32
    if pad:
        x = xp.concatenate([x, xp.zeros(x.shape[:-1] + (pad,), dtype=xp.float32)], axis=-1)
    b = x.reshape(x.shape[:-1] + ((n + pad) // 32, 32))
    amax = xp.max(xp.abs(b), axis=-1)
    d = (amax * _INV_127).astype(xp.float32)
    safe = xp.where(amax != 0, amax, _F32(1.0))
    idv = xp.where(amax != 0, _F32(127.0) / safe, _F32(0.0)).astype(xp.float32)
    return _codes(xp, b, idv[..., None]), d


def _exact_or_round(xp, q, d, dtype):
    return q.astype(dtype) * d.astype(dtype)[..., None]


def q8_0_round(xp, x, dtype=np.float32):
    """N.q8_0_round (float32), or with dtype float64 N.q8_0_exact."""
    x = _f32(xp, x)
    q, d = q8_0_quantize(xp, x)
    v = _exact_or_round(xp, q, d, dtype)
    return v.reshape(v.shape[:-2] + (-1,))[..., :x.shape[-1]]


def q8_k_quantize(xp, x):
    x = _f32(xp, x)
    b = _blocks(x, x.shape[-1], 256, "q8_k_quantize")
    idx = xp.argmax(xp.abs(b), axis=-1)[..., None]          # the first maximum
    m = xp.take_along_axis(b, idx, axis=-1)[..., 0]
    safe = xp.where(m != 0, m, _F32(1.0))
    iscale = xp.where(m != 0, _F32(-127.0) / safe, _F32(0.0)).astype(xp.float32)
    d = xp.where(m != 0, m * _NEG_INV_127, _F32(0.0)).astype(xp.float32)
    return _codes(xp, b, iscale[..., None]), d


def q8_k_round(xp, x, dtype=np.float32):
    """N.q8_k_round (float32), or with dtype float64 N.q8_k_exact."""
    x = _f32(xp, x)
    q, d = q8_k_quantize(xp, x)
    return _exact_or_round(xp, q, d, dtype).reshape(x.shape)


apply_rope = N.rotate_pairs     # N.apply_rope with the cosines and sines given
