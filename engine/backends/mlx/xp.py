"""The NumPy-like namespace the model's glue and the KV state use on the mlx backend (`ops.xp`).

engine/model/model.py writes its small index glue against `xp` (asarray, concatenate, where, sort,
take_along_axis, ...), and engine/model/kv_state.py its rings (full, zeros, concatenate). mlx.core
has all of them under NumPy's names but `asarray`; this module adds it (host arrays -> mx arrays,
float64 -> float32: the GPU has no float64) and re-exports the rest, so the glue is the same text
on every backend.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

float32, float16, int32, int64, bool_ = mx.float32, mx.float16, mx.int32, mx.int64, mx.bool_
inf = float("inf")

full, zeros, concatenate, where, maximum, sqrt = mx.full, mx.zeros, mx.concatenate, mx.where, mx.maximum, mx.sqrt
sort, take_along_axis, repeat, arange, stack = mx.sort, mx.take_along_axis, mx.repeat, mx.arange, mx.stack


def asarray(a, dtype=None):
    """An mx array of `a` (an mx array is returned as it is, or cast)."""
    if isinstance(a, mx.array):
        return a if dtype is None or a.dtype == dtype else a.astype(dtype)
    a = np.asarray(a)
    if dtype is None and a.dtype == np.float64:
        dtype = mx.float32
    return mx.array(a) if dtype is None else mx.array(a, dtype=dtype)
