"""ds4's float32 loops outside the matmuls (engine/model/ds4_float.py) on mx arrays.

The spec is engine/model/ds4_float.py: each function there follows the x86 code of ds4's compiled
CPU path (GCC's FMAs and pairings). Here the same steps in MLX ops, for MLX's CPU device, where
float64 exists: an FMA is the float64 product of two float32 values (exact) plus the addend,
rounded once, as the spec models it; expf is MN.expf (the float64 exp rounded once, as the spec's
``np.exp`` in float64). tests/test_mlx_ds4_float.py compares every function with the spec's bits.
"""
from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from ...model import numerics as N
from . import numerics as MN

_F32, _F64 = mx.float32, mx.float64


def _f32(x) -> mx.array:
    return MN._f32(x)


def _c(v) -> mx.array:
    return mx.array(v, dtype=_F32)


def fma(a, b, c) -> mx.array:
    """fmaf(a, b, c): the exact a * b + c rounded once to float32."""
    return (_f32(a).astype(_F64) * _f32(b).astype(_F64) + _f32(c).astype(_F64)).astype(_F32)


# compiled (traced once per shape): exp's ~30 float64 steps in one pass, not ~30 dispatches
# (the same bits: its Horner steps are a product rounded, then a sum: g++ fuses no multiply-add
# without -mfma, and MLX builds its CPU kernels without it)
_expf = mx.compile(MN.expf)


def expf(x) -> mx.array:
    return _expf(_f32(x))


def _sigmoid(x: mx.array) -> mx.array:
    e = MN.expf(-mx.abs(x))
    den = _c(1.0) + e
    return mx.where(x >= 0, _c(1.0) / den, e / den)


_sigmoid_c = mx.compile(_sigmoid)


def sigmoid_stable(x) -> mx.array:
    return _sigmoid_c(_f32(x))


def silu(x) -> mx.array:
    x = _f32(x)
    return x * sigmoid_stable(x)


def log1pf(x) -> mx.array:
    """The C library's log1pf, as the spec takes it (glibc's is one ulp off the correctly rounded
    value now and then, and a router weight moves with it): computed on the host, on the values
    (a sync; the router's [T, n_expert] logits once a layer). Correctly rounded where no libm loads."""
    x = _f32(x)
    f = _libm("log1pf")
    if f is None or x.size == 0:
        return mx.log1p(x.astype(_F64)).astype(_F32)
    return mx.array(np.asarray(f(np.array(x)), dtype=np.float32))


@functools.lru_cache(maxsize=4)
def _libm(name: str):
    get = getattr(N, "libm_ufunc", None)
    return None if get is None else get(name)


def softplus(x) -> mx.array:
    x = _f32(x)
    e = expf(x)
    return mx.where(x > 20.0, x, mx.where(x < -20.0, e, log1pf(e)))


_F16_CHUNK = 1 << 24


def f16_matvec(w, x) -> mx.array:
    """``acc += w[i] * x[i]`` in float32 in index order (a sequential cumsum): w [out, in] (F16
    values), x [T, in] -> [T, out]."""
    x, w = _f32(x), w.astype(_F32)
    T, (n_out, n_in) = x.shape[0], w.shape
    step = max(1, _F16_CHUNK // max(1, n_out * n_in))
    parts = [mx.cumsum(x[t0:t0 + step, None, :] * w[None, :, :], axis=-1)[..., -1]
             for t0 in range(0, T, step)]
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)


def _row_sums(C) -> mx.array:
    """(c0 + c1) + (c2 + c3) along the last axis of [T, 4, 4]: sums over axes of 2, one add each."""
    return C.reshape(*C.shape[:-1], 2, 2).sum(axis=-1).sum(axis=-1)


def _col_sums(C) -> mx.array:
    """(r0 + r1) + (r2 + r3) over the rows of [T, 4, 4]."""
    return C.reshape(C.shape[0], 2, 2, C.shape[-1]).sum(axis=2).sum(axis=1)


_LAST_ROW_PAIRS = mx.array([[[0, 1, 2, 3]] * 3 + [[1, 2, 0, 3]]], dtype=mx.int32)


def hc_split(mix, n: int, scale, base, eps, iters: int):
    """The spec's hc_split (ds4.c hc_split_sinkhorn_one as compiled, n = 4)."""
    if n != 4:
        raise ValueError(f"ds4's compiled HC split is the 4-stream one (n_hc = {n})")
    mix, scale, base, eps = _f32(mix), _f32(scale), _f32(base), _c(float(eps))
    T = mix.shape[0]
    sc = mx.concatenate([mx.broadcast_to(scale[0], (n,)), mx.broadcast_to(scale[1], (n,)),
                         mx.broadcast_to(scale[2], (n * n,))])
    z = fma(mix, sc, base)
    pre = _c(1.0) / (_c(1.0) + expf(-z[:, :n])) + eps
    post = _c(2.0) / (_c(1.0) + expf(-z[:, n:2 * n]))
    C = z[:, 2 * n:].reshape(T, n, n)
    C = expf(C - C.max(axis=2, keepdims=True))
    C = fma(C, (_c(1.0) / _row_sums(C))[:, :, None], eps)
    C = C * (_c(1.0) / (_col_sums(C) + eps))[:, None, :]
    for _ in range(iters - 1):
        # GCC pairs the last row's sum (1+2)+(0+3) in these rounds: its columns reordered first
        C = C * (_c(1.0) / (_row_sums(mx.take_along_axis(C, _LAST_ROW_PAIRS, axis=2)) + eps))[:, :, None]
        C = C * (_c(1.0) / (_col_sums(C) + eps))[:, None, :]
    return pre, post, C


def hc_weighted_sum(w, X) -> mx.array:
    w, X = _f32(w)[:, :, None], _f32(X)
    a = fma(X[:, 0], w[:, 0], X[:, 1] * w[:, 1])
    b = fma(X[:, 2], w[:, 2], X[:, 3] * w[:, 3])
    return a + b


def hc_post(y, X, post, C) -> mx.array:
    y, X, post, C = _f32(y)[:, None, :], _f32(X), _f32(post)[:, :, None], _f32(C)
    c = lambda j: C[:, j, :, None]        # noqa: E731
    x = lambda j: X[:, j][:, None, :]     # noqa: E731
    a = fma(post, y, c(0) * x(0))
    b = fma(c(1), x(1), c(2) * x(2))
    return fma(c(3), x(3), a + b)


def _clamp(g, u, limit: float):
    g, u = _f32(g), _f32(u)
    if limit > 1.0e-6:
        lim = _c(limit)
        g = mx.minimum(g, lim)
        u = mx.maximum(mx.minimum(u, lim), -lim)
    return g, u


def swiglu(g, u, limit: float) -> mx.array:
    g, u = _clamp(g, u, limit)
    return sigmoid_stable(g) * (g * u)


def routed_mid(g, u, w, limit: float) -> mx.array:
    g, u = _clamp(g, u, limit)
    return (sigmoid_stable(g) * u) * (g * _f32(w))


def _dot128(q, k) -> mx.array:
    p = lambda j: (q[..., 16 * j:16 * j + 16], k[..., 16 * j:16 * j + 16])   # noqa: E731
    f = lambda a, b: fma(*p(a), mx.multiply(*p(b)))                          # noqa: E731
    v = (f(6, 7) + f(4, 5)) + (f(0, 1) + f(2, 3))
    for half in (8, 4, 2, 1):
        v = v[..., :half] + v[..., half:2 * half]
    return v[..., 0]


_ATT_PRODUCTS = 1 << 21          # float64 products (16 MB) attention makes at once


def attention(q, segments, sinks, kq_scale) -> mx.array:
    """The spec's attention (head dim 128): q [T, H, D]; segments (keys [K, D] or [T, K, D],
    mask [T, K]); one fma per key, in order (a loop over the keys)."""
    q, sinks, kq_scale = _f32(q), _f32(sinks), _c(float(kq_scale))
    T, H, D = q.shape
    keys = [mx.broadcast_to(_f32(k)[None] if k.ndim == 2 else _f32(k), (T,) + tuple(k.shape[-2:]))
            for k, _ in segments]
    mask = mx.concatenate([mx.broadcast_to(mx.array(m).astype(mx.bool_), (T, k.shape[1]))
                           for (_, m), k in zip(segments, keys)], axis=1)
    keys = mx.concatenate(keys, axis=1)                                          # [T, K, D]
    K = keys.shape[1]
    s = _dot128(q[:, :, None, :], keys[:, None, :, :]) * kq_scale                # [T, H, K]
    s = mx.where(mask[:, None, :], s, -mx.inf)
    m = mx.maximum(s.max(axis=2), sinks[None, :])
    w = mx.where(mask[:, None, :], expf(s - m[..., None]), _c(0.0))
    den = mx.concatenate([expf(sinks[None, :] - m)[..., None], w], axis=2)
    den = mx.cumsum(den, axis=2)[..., -1]
    # o = fma(w_r, k_r, o) key by key: one add and one rounding a key, the exact products made
    # all at once where they fit in _ATT_PRODUCTS (a decode step), else a key at a time (prefill)
    w64, k64 = w.astype(_F64), keys.astype(_F64)
    o = mx.zeros((T, H, D), dtype=_F64)
    if T * H * K * D <= _ATT_PRODUCTS:
        prod = mx.moveaxis(w64[..., None] * k64[:, None], 2, 0)                      # [K, T, H, D]
        for r in range(K):
            o = (prod[r] + o).astype(_F32).astype(_F64)
    else:
        for r in range(K):
            o = (w64[:, :, r, None] * k64[:, None, r, :] + o).astype(_F32).astype(_F64)
    return o.astype(_F32) * (_c(1.0) / den)[..., None]


def hc_head(mix, scale, base, eps, X) -> mx.array:
    w = (sigmoid_stable(fma(_f32(mix), _f32(scale), _f32(base))) + _c(float(eps)))[:, :, None]
    X = _f32(X)
    a = fma(X[:, 0], w[:, 0], X[:, 3] * w[:, 3])
    b = fma(X[:, 1], w[:, 1], X[:, 2] * w[:, 2])
    return b + a


def expert_weights(w, scale, hashed: bool) -> mx.array:
    """The spec's routed weights' normalization (ds4.c layer_*_router_weights as compiled): for
    k = 4 the sum paired (0+1)+(2+3) (hash layers) or (0+2)+(1+3) (top-k), (w * scale) * (1/sum);
    other k: w / sum * scale with the sum in order. The sum is floored at 2^-14."""
    w, scale, floor = _f32(w), _c(float(np.float32(scale))), _c(6.103515625e-5)
    if w.shape[-1] == 4:
        a, b, c, d = (0, 1, 2, 3) if hashed else (0, 2, 1, 3)
        s = (w[:, a] + w[:, b]) + (w[:, c] + w[:, d])
        return (w * scale) * (_c(1.0) / mx.maximum(s, floor))[:, None]
    s = mx.cumsum(w, axis=1)[:, -1]
    return w / mx.maximum(s, floor)[:, None] * scale
