"""ds4's quantized dot products (engine/model/ds4_matmul.py) on device arrays: the array-op form of
the cupy backend's ds4-numerics Q8_0 matmuls and IQ2_XXS / Q2_K expert matmuls, step for step the
reference's, so its results are the reference's bit for bit.

An activation is its codes and scales, `Act(q, d)` (numerics.q8_0_quantize / q8_k_quantize on the
device): per block the integer dot of the codes with the weight's integer parts (float64, exact),
then the float32 steps of ds4.c in block order. The loop over blocks is a Python loop of small
launches: slow on a GPU, which runs the kernels instead (kernels.py); this form is the referee.
"""
from __future__ import annotations

import numpy as np

from ...gguf import quants as Q
from . import numerics as DN
from . import quant

_F32 = np.float32
_DOT = frozenset({Q.Q8_0, Q.IQ2_XXS, Q.Q2_K})


class Act:
    """Codes q int8 [T, n_blocks, block] and scales d float32 [T, n_blocks]; indexing selects tokens."""
    __slots__ = ("q", "d")

    def __init__(self, q, d):
        self.q, self.d = q, d

    def __getitem__(self, rows) -> "Act":
        return Act(self.q[rows], self.d[rows])


def has_dot(type_id: int) -> bool:
    return type_id in _DOT


def act_for(xp, type_id: int, x) -> Act:
    """The activation codes ds4 gives a `type_id` weight's input (Q8_0 blocks, or Q8_K)."""
    return Act(*(DN.q8_0_quantize(xp, x) if type_id == Q.Q8_0 else DN.q8_k_quantize(xp, x)))


def _blocks(xp, data, type_id):
    f = Q.FORMATS[type_id]
    return xp.ascontiguousarray(data).reshape(data.shape[0], -1, f.block_bytes)


def _f16(xp, col):
    return xp.ascontiguousarray(col).view(xp.float16)[..., 0].astype(xp.float32)


def _idots(xp, q, wi):
    """Integer dots per block: q [T, nb, k], wi [R, nb, k] -> [nb, T, R] (float64, exact)."""
    return xp.matmul(xp.swapaxes(q.astype(xp.float64), 0, 1), xp.transpose(wi, (1, 2, 0)))


def _with_scales(xp, b, at, values):
    """The blocks with the F16 scale fields at byte offsets `at` set to `values` (the decoder then
    gives their integer parts)."""
    b = b.copy()
    for off, v in zip(at, values):
        b[..., off:off + 2] = xp.asarray(np.frombuffer(np.float16(v).tobytes(), np.uint8))
    return b


def _decode_int(xp, type_id, b):
    R, nb, _ = b.shape
    return quant.dequantize(xp, type_id, b.reshape(R, -1)).astype(xp.float64).reshape(R, nb, -1)


def matmul(xp, w, a: Act, rows=None):
    """ds4's matmul of weight w (a DevTensor: Q8_0, IQ2_XXS or Q2_K) with activation a ->
    float32 [T, out] (ds4_matmul.q8_0_matmul / q8_k_matmul)."""
    b = _blocks(xp, w.data if rows is None else w.data[rows], w.type_id)
    T, R, nb = a.q.shape[0], b.shape[0], a.q.shape[1]
    if b.shape[1] != nb:
        raise ValueError(f"{Q.type_name(w.type_id)} weight of {b.shape[1]} blocks a row, activation of {nb}")
    acc = xp.zeros((T, R), dtype=xp.float32)
    if w.type_id == Q.Q2_K:
        isum = _idots(xp, a.q, _decode_int(xp, w.type_id, _with_scales(xp, b, (80, 82), (1.0, 0.0)))).astype(xp.float32)
        summs = (-_idots(xp, a.q, _decode_int(xp, w.type_id, _with_scales(xp, b, (80, 82), (0.0, 1.0))))).astype(xp.float32)
        d, dmin = _f16(xp, b[..., 80:82]), _f16(xp, b[..., 82:84])
        for k in range(nb):     # fma(isum, d_x * d, -((summs * d_x) * dmin)) as ds4_matmul computes it
            dall = (a.d[:, k, None] * d[None, :, k]).astype(xp.float64)
            mins = (summs[k] * a.d[:, k, None]) * dmin[None, :, k]
            acc = acc + (isum[k].astype(xp.float64) * dall - mins).astype(xp.float32)
        return acc
    if w.type_id == Q.IQ2_XXS:
        wi = _decode_int(xp, w.type_id, _with_scales(xp, b, (0,), (8.0,)))
    else:
        wi = xp.ascontiguousarray(b[..., 2:]).view(xp.int8).astype(xp.float64)
    dots = _idots(xp, a.q, wi).astype(xp.float32)
    dw = _f16(xp, b[..., 0:2])
    for k in range(nb):
        acc = acc + (dw[None, :, k] * a.d[:, k, None]) * dots[k]
    return (_F32(0.125) * acc).astype(xp.float32) if w.type_id == Q.IQ2_XXS else acc
