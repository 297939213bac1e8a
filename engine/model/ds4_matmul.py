"""ds4's quantized dot products (its CPU path, x86 build), as vectorized NumPy.

In ``ds4`` numerics a Q8_0-weight matmul and a routed expert's IQ2_XXS / Q2_K matmul do not see
float activations: ds4 quantizes the activation (``numerics.q8_0_quantize`` /
``numerics.q8_k_quantize``), takes integer dot products of the codes block by block, and turns
each block's integer into float32 with the two scales, summing the blocks in float32 in block
order.  This module computes exactly that, bit for bit with ds4's GCC ``-O3 -ffast-math
-march=native -std=c99`` build (the portable branch of each function: the NEON branches are
ARM only).  Sources, github antirez/ds4 ``ds4.c`` at commit 8d57664:

* Q8_0 (``dot_q8_0_row``, the generic branch; every Q8_0 matvec and batch form calls it on x86):
  ``acc = 0; for each block b: acc += f16(d_w[b]) * d_x[b] * (float)dot_i8(w[b], x[b])``:
  the scale product first, then times the integer, then added, each rounded to float32 (no FMA:
  ``-std=c99`` turns contraction off).
* IQ2_XXS (``ds4_vec_dot_iq2_xxs_q8_K``, generic branch): per 256-block the integer
  ``bsum = sum_g (2 s_g + 1) * dot(grid*sign, x)`` over its 8 groups, ``sumf += (f16(d_w) * d_x)
  * (float)bsum``; the result is ``0.125f * sumf``.
* Q2_K (``ds4_vec_dot_q2_K_q8_K``, generic branch): per 256-block ``isum = sum_j (sc_j & 15) *
  dot16(q_j, x_j)`` and ``summs = sum_j (sc_j >> 4) * bsum_j`` (integers), and the source reads
  ``sumf += (d_x * f16(d)) * (float)isum - (d_x * f16(dmin)) * (float)summs``.  GCC 12 compiles
  that line (read from its x86-64 code, and checked on random blocks: 400 of 400 bit for bit,
  where the literal reading matched 158) as ``fma((float)isum, d_x * f16(d), -(((float)summs *
  d_x) * f16(dmin)))``: one fused multiply-add, the minimum term reassociated.  Here the FMA is
  a float64 product (exact: 21 + 24 bits) minus the float32 minimum term, rounded to float32
  (a double rounding that differs from a true FMA only at a float32 midpoint: ~2^-29).

The integer dots are exact here (float64 products of small integers, |sum| < 2^53); the
conversion ``(float)`` of an int32 is round-to-nearest-even, as NumPy's float64 -> float32 cast.
Q4_K and MXFP4 have no integer dot in ds4's CPU path (its CPU path refuses Q4_K experts), so
they keep the float kernels (NumpyOps.expert_linear).
"""
from __future__ import annotations

import numpy as np

from ..gguf import quants as Q
from . import numerics as N

_F32 = np.float32
_ROWS = 256                     # weight rows decoded at a time


class Q8Act:
    """A quantized activation: codes q int8 [T, n_blocks, block] and scales d float32
    [T, n_blocks] (``numerics.q8_0_quantize`` / ``q8_k_quantize``). Indexing selects tokens."""

    __slots__ = ("q", "d")

    def __init__(self, q: np.ndarray, d: np.ndarray):
        self.q, self.d = q, d

    def __getitem__(self, rows) -> "Q8Act":
        return Q8Act(self.q[rows], self.d[rows])

    @property
    def shape(self) -> tuple:
        return (self.q.shape[0], self.q.shape[1] * self.q.shape[2])


def q8_0_act(x) -> Q8Act:
    """ds4's ``quantize_q8_0_activation`` of x [T, n] (ds4.c)."""
    return Q8Act(*N.q8_0_quantize(np.asarray(x, np.float32)))


def q8_k_act(x) -> Q8Act:
    """ds4's ``ds4_quantize_row_q8_K`` of x [T, n] (n a multiple of 256; ds4.c)."""
    return Q8Act(*N.q8_k_quantize(np.asarray(x, np.float32)))


def _blocks(data2d: np.ndarray, type_id: int) -> np.ndarray:
    f = Q._format(type_id)
    data2d = np.asarray(data2d, dtype=np.uint8)
    return data2d.reshape(data2d.shape[0], -1, f.block_bytes)


def _f16(col: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(col).view(np.float16)[..., 0].astype(np.float32)


def _with_scales(blocks: np.ndarray, at: tuple, values: tuple) -> np.ndarray:
    """A copy of the blocks with the F16 scale fields at byte offsets `at` set to `values`: the
    decoder then gives the blocks' integer parts (e.g. IQ2_XXS with d = 8: (2s + 1) * grid)."""
    b = blocks.copy()
    for off, v in zip(at, values):
        b[..., off:off + 2] = np.frombuffer(np.float16(v).tobytes(), np.uint8)
    return b


def _decode_int(type_id: int, blocks: np.ndarray) -> np.ndarray:
    """Decode blocks [rows, nb, bb] -> float64 [rows, nb, block_elems] (integer values)."""
    r, nb, _ = blocks.shape
    return Q.dequantize(type_id, blocks.reshape(r, -1)).astype(np.float64).reshape(r, nb, -1)


def _idots(xq: np.ndarray, wi: np.ndarray) -> np.ndarray:
    """Integer dots per block: xq [T, nb, k] codes, wi [R, nb, k] integers -> [nb, T, R] float64."""
    return np.matmul(xq.astype(np.float64).transpose(1, 0, 2), wi.transpose(1, 2, 0))


def q8_0_matmul(data2d: np.ndarray, a: Q8Act, rows: slice | None = None) -> np.ndarray:
    """ds4's Q8_0 matmul (``dot_q8_0_row``) of a Q8_0 weight [out, in] (raw rows) with the
    Q8_0 activation a -> float32 [T, out] (only `rows` when given)."""
    blocks = _blocks(data2d if rows is None else np.asarray(data2d)[rows], Q.Q8_0)
    T, R, nb = a.q.shape[0], blocks.shape[0], a.q.shape[1]
    if blocks.shape[1] != nb:
        raise ValueError(f"Q8_0 weight of {blocks.shape[1]} blocks a row, activation of {nb}")
    out = np.empty((T, R), np.float32)
    for r0 in range(0, R, _ROWS):
        b = blocks[r0:r0 + _ROWS]
        dw = _f16(b[..., 0:2])                                         # [r, nb]
        dots = _idots(a.q, b[..., 2:].view(np.int8).astype(np.float64)).astype(np.float32)
        acc = np.zeros((T, b.shape[0]), np.float32)
        for k in range(nb):
            acc += (dw[None, :, k] * a.d[:, k, None]) * dots[k]       # (d_w * d_x) * dot, then +
        out[:, r0:r0 + _ROWS] = acc
    return out


def q8_k_matmul(type_id: int, data2d: np.ndarray, a: Q8Act) -> np.ndarray:
    """ds4's IQ2_XXS / Q2_K dot products (``ds4_vec_dot_iq2_xxs_q8_K``, ``ds4_vec_dot_q2_K_q8_K``)
    of one expert's weight [out, in] (raw rows) with the Q8_K activation a -> float32 [T, out]."""
    if type_id not in (Q.IQ2_XXS, Q.Q2_K, Q.Q4_K):
        raise ValueError(f"no ds4 Q8_K dot product for {Q.type_name(type_id)}")
    blocks = _blocks(data2d, type_id)
    T, R, nb = a.q.shape[0], blocks.shape[0], a.q.shape[1]
    if blocks.shape[1] != nb:
        raise ValueError(f"{Q.type_name(type_id)} weight of {blocks.shape[1]} blocks a row, activation of {nb}")
    out = np.empty((T, R), np.float32)
    for r0 in range(0, R, _ROWS):
        b = blocks[r0:r0 + _ROWS]
        acc = np.zeros((T, b.shape[0]), np.float32)
        if type_id == Q.IQ2_XXS:
            dots = _idots(a.q, _decode_int(type_id, _with_scales(b, (0,), (8.0,)))).astype(np.float32)
            dw = _f16(b[..., 0:2])
            for k in range(nb):
                acc += (dw[None, :, k] * a.d[:, k, None]) * dots[k]
            acc = _F32(0.125) * acc
        else:   # Q2_K (d, dmin at bytes 80, 82) or Q4_K (at 0, 2): the q4 oracles' block dot, which
            # the oracle build writes in the form of ds4's Q2_K one (scripts/build_ds4_oracle.py, edit 6)
            at = (80, 82) if type_id == Q.Q2_K else (0, 2)
            isum = _idots(a.q, _decode_int(type_id, _with_scales(b, at, (1.0, 0.0)))).astype(np.float32)
            summs = -_idots(a.q, _decode_int(type_id, _with_scales(b, at, (0.0, 1.0)))).astype(np.float32)
            d, dmin = _f16(b[..., at[0]:at[0] + 2]), _f16(b[..., at[1]:at[1] + 2])
            for k in range(nb):     # fma(isum, d_x * d, -((summs * d_x) * dmin)): see the module doc
                mins = (summs[k] * a.d[:, k, None]) * dmin[None, :, k]
                if type_id == Q.Q4_K:      # as GCC builds the oracle's Q4_K line: fma(isum * d_x, d, -mins)
                    acc += ((isum[k] * a.d[:, k, None]).astype(np.float64) * d[None, :, k] - mins).astype(np.float32)
                    continue
                dall = (a.d[:, k, None] * d[None, :, k]).astype(np.float64)
                acc += (isum[k].astype(np.float64) * dall - mins).astype(np.float32)
        out[:, r0:r0 + _ROWS] = acc
    return out
