"""ds4 numerics' non-matmul ops on the cpu backend, in C (csrc/ops_ds4.c): the forms of ds4's
compiled float32 loops that the reference runs in NumPy (engine/model/ds4_float.py), bit for bit
(tests/test_decode_glue.py, tests/test_kernels_bitexact.py). CpuOps installs them in ds4 numerics
where the extension has them (`available()`); each falls back to the reference's form for shapes
the C form does not cover (HC streams other than 4, attention head dims other than 128)."""
from __future__ import annotations

import numpy as np

from . import kernels as K
from ...model import ds4_float as F

_F32 = np.float32


def available() -> bool:
    return K._K is not None and hasattr(K._K, "ds4_hc_split")


def _c32(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=_F32)


def hc_split(mix, scale_row, base_row, eps, iters: int):
    """ds4_float.hc_split for 4 streams: mix [T, 24] -> pre [T, 4], post [T, 4], C [T, 4, 4]."""
    mix = _c32(mix)
    T = mix.shape[0]
    pre, post, C = np.empty((T, 4), _F32), np.empty((T, 4), _F32), np.empty((T, 4, 4), _F32)
    K._K.ds4_hc_split(T, mix, scale_row, base_row, float(eps), int(iters), pre, post, C)
    return pre, post, C


def hc_sum4(w, X, head: bool = False) -> np.ndarray:
    """ds4_float.hc_weighted_sum (head: hc_head's inlined pairing) of X [T, 4, E] with w [T, 4]."""
    X = _c32(X)
    T, _, E = X.shape
    out = np.empty((T, E), _F32)
    K._K.ds4_hc_sum4(_c32(w), X, out, T, E, head)
    return out


def hc_post(y, X, post, C) -> np.ndarray:
    """ds4_float.hc_post: y [T, E], X [T, 4, E], post [T, 4], C [T, 4, 4] -> [T, 4, E]."""
    X = _c32(X)
    T, _, E = X.shape
    out = np.empty((T, 4, E), _F32)
    K._K.ds4_hc_post(_c32(y), X, _c32(post), _c32(C), out, T, E)
    return out


def hc_head(mix, scale, base, eps, X) -> np.ndarray:
    """ds4_float.hc_head: the [T, 4] weights in NumPy (its steps), the sum over E in C."""
    w = (F.sigmoid_stable(F.fma(_c32(mix), _c32(scale), _c32(base))) + _F32(eps)).astype(_F32)
    return hc_sum4(w, X, head=True)


def swiglu(g, u, limit, w=None, w0: int = 0, out=None) -> np.ndarray:
    """ds4_float.swiglu (the shared expert) on rows < w0, ds4_float.routed_mid with routing weight
    w[r - w0] on rows r >= w0 (all rows when w is None: swiglu); g, u [R, n]; out may be g."""
    g, u = _c32(g), _c32(u)
    R, n = g.shape
    if out is None:
        out = np.empty((R, n), _F32)
    K._K.ds4_swiglu(g, u, out, R, n, float(_F32(limit)), None if w is None else _c32(w), int(w0))
    return out
