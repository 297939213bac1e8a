"""ds4's quantized dot products (engine/model/ds4_matmul.py) on mx arrays, for `ds4` numerics.

The reference's Q8_0, IQ2_XXS and Q2_K matmuls are ds4's (ds4.c ``dot_q8_0_row``,
``ds4_vec_dot_iq2_xxs_q8_K``, ``ds4_vec_dot_q2_K_q8_K``): per block an integer dot of the
activation's codes with the weight's integer parts, turned into float32 with the two scales, the
blocks added one by one in float32 in block order. Here the same steps in MLX ops:

* the integer dots are float32 matmuls of integer-valued arrays. Each is exact in any summation
  order while its terms stay under 2^24: a Q8_0 block (32 x 127 x 127 = 516,128), a Q2_K block
  (256 x 15 x 3 x 127 = 1.5M) and a quarter of an IQ2_XXS block (64 x 31 x 43 x 127 = 10.8M: the
  whole block could reach 43M, so its four quarters are added as int32);
* the float32 sum over blocks in order is ``mx.cumsum`` along the block axis, read at the end: on
  the CPU device a sequential float32 scan (checked against the reference bit for bit in
  tests/test_mlx_ds4_dot.py). A Metal scan adds in another order: on a GPU the sums are float32
  in MLX's order, not ds4's (and ds4's own Metal path has no integer dots: docs/ds4-metal-numerics.md);
* Q2_K's scale term is fused in GCC's build (``fma``): a float64 product and difference rounded
  once to float32, as the reference does. Metal has no float64: there the unfused float32 form.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from engine.gguf import quants as Q

from . import numerics as MN
from .quant_twin import _f16_field, _signed_grid, _u32_words

_TERMS_BUDGET = 16 << 20          # float32 values of one [blocks, tokens, rows] slab of terms


def cpu_float64() -> bool:
    """Whether the default device computes float64 (MLX's CPU device; Metal has none)."""
    return mx.default_device().type == mx.DeviceType.cpu


def _row_step(nb: int, T: int) -> int:
    return max(1, _TERMS_BUDGET // max(1, nb * T))


def _ordered_sum(terms: mx.array) -> mx.array:
    """terms [nb, T, R] -> [T, R]: ((t0 + t1) + t2) + ... in float32 (ds4's block order)."""
    return mx.cumsum(terms, axis=0)[-1]


_ELEM_ROWS = 2                    # up to this many activation rows: per-block dots as products and sums


def _dots(q: mx.array, w: mx.array) -> mx.array:
    """q [T, nb, k], w [R, nb, k] integer-valued float32 -> [nb, T, R] per-block dots (exact).
    A decode step's one row: products and a sum over k, as a [T, nb, k] @ [nb, k, R] matmul is nb
    tiny matrix-vector calls and a transposed copy of the whole weight (2-5x slower at T = 1; any
    order of the integer sums gives the same bits)."""
    if q.shape[0] <= _ELEM_ROWS:
        return mx.transpose((q[:, None] * w[None]).sum(axis=-1), (2, 0, 1))
    return mx.swapaxes(q, 0, 1) @ mx.transpose(w, (1, 2, 0))


def _scaled(dw: mx.array, dx: mx.array, dots: mx.array) -> mx.array:
    """(d_w * d_x) * dot per block: dw [R, nb], dx [T, nb], dots [nb, T, R]."""
    return (dw.T[:, None, :] * dx.T[:, :, None]) * dots


def q8_0_matmul(wq: mx.array, dw: mx.array, x) -> mx.array:
    """ds4's Q8_0 matmul: an affine8 weight's packed codes wq uint32 [R, n_in / 4] (code + 128 a
    byte) and its scales dw [R, nb]; x float32 [T, n_in] (quantized here, N.q8_0_quantize)
    -> float32 [T, R]. The weight's codes are unpacked a slab of rows at a time."""
    return _q8_0_matmul_c(wq, dw, MN._f32(x))


def _q8_0_matmul(wq: mx.array, dw: mx.array, x: mx.array) -> mx.array:
    q, dx = MN.q8_0_codes(x)
    T, nb = q.shape[0], q.shape[1]
    step = _row_step(nb, T)
    parts = []
    for r0 in range(0, wq.shape[0], step):
        codes = (wq[r0:r0 + step].view(mx.uint8).astype(mx.float32) - 128.0).reshape(-1, nb, 32)
        parts.append(_ordered_sum(_scaled(dw[r0:r0 + step].astype(mx.float32), dx, _dots(q, codes))))
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)


# compiled (a graph traced once per shape): a decode step's ~25 small steps a call cost more in
# dispatch than in arithmetic (the same bits: no step here is a float multiply-add that could fuse)
_q8_0_matmul_c = mx.compile(_q8_0_matmul)
q8_k_codes = mx.compile(MN.q8_k_codes)


# -- the Q8_K formats: integer parts of a block ------------------------------------------------

def _iq2_xxs_int(blocks: mx.array) -> tuple[mx.array, mx.array]:
    """uint8 [n, 66] -> ((2 s + 1) * signed grid as float32 [n, 256], f16 d [n])."""
    n = blocks.shape[0]
    groups = blocks[:, 2:66].reshape(n, 8, 8)
    a1 = _u32_words(groups[:, :, 4:8])[:, :, 0]
    mult = (2 * (a1 >> 28) + 1).astype(mx.float32)                                 # [n, 8]
    sign_idx = (a1[:, :, None] >> (mx.arange(4, dtype=mx.uint32) * 7)) & 127
    row = (groups[:, :, 0:4].astype(mx.uint32) << 7) | sign_idx
    vals = mx.take(_signed_grid(), row.reshape(-1)).view(mx.int8).reshape(n, 8, 32)
    return (mult[:, :, None] * vals.astype(mx.float32)).reshape(n, 256), _f16_field(blocks, 0)[:, 0]


def _q2_k_int(blocks: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """uint8 [n, 84] -> ((sc & 15) * q [n, 256], (sc >> 4) per value [n, 256], d [n], dmin [n])."""
    n = blocks.shape[0]
    sc = blocks[:, 0:16]
    qs = blocks[:, 16:80].reshape(n, 2, 1, 32)
    q = ((qs >> (mx.arange(4, dtype=mx.uint8) * 2).reshape(1, 1, 4, 1)) & 3).reshape(n, 16, 16)
    lo = ((sc & 15).astype(mx.float32)[:, :, None] * q.astype(mx.float32)).reshape(n, 256)
    hi = mx.broadcast_to((sc >> 4).astype(mx.float32)[:, :, None], (n, 16, 16)).reshape(n, 256)
    return lo, hi, _f16_field(blocks, 80)[:, 0], _f16_field(blocks, 82)[:, 0]


def _dots_w(q: mx.array, w: mx.array) -> mx.array:
    """Per-block dots with shared rows (w [R, nb, k], q [T, nb, k]) or one weight per row of q
    (w [P, R, nb, k], q [P, nb, k]) -> [nb, T or P, R]."""
    if w.ndim == 3:
        return _dots(q, w)
    return mx.transpose((q[:, None] * w).sum(axis=-1), (2, 0, 1))    # as _dots' one-row form


def _per_block(a: mx.array, lead: tuple) -> mx.array:
    """A weight's per-block value [(P,) R * nb] -> [nb, 1 or P, R], to broadcast against [nb, T, R]."""
    a = a.reshape(*lead, -1)                                     # [(P,) R, nb]
    return mx.moveaxis(a, -1, 0) if len(lead) == 2 else a.T[:, None, :]


def q8_k_matmul(type_id: int, raw: mx.array, q: mx.array, dx: mx.array, f64: bool) -> mx.array:
    """ds4's IQ2_XXS / Q2_K dot of an expert's raw rows uint8 [R, row_bytes] with Q8_K codes
    q float32 [T, nb, 256] and scales dx [T, nb] (MN.q8_k_codes) -> float32 [T, R]; or, with raw
    [P, R, row_bytes] (one expert per pair), of pair p's rows with q[p] -> [P, R]."""
    lead, (T, nb) = raw.shape[:-1], dx.shape
    R = lead[-1]
    blocks = raw.reshape(-1, raw.shape[-1] // nb)
    dxt = dx.T[:, :, None]                                                          # [nb, T, 1]
    if type_id == Q.IQ2_XXS:
        wi, dw = _iq2_xxs_int(blocks)
        quarters = _dots_w(q.reshape(T, nb * 4, 64), wi.reshape(*lead, nb * 4, 64))  # [4 nb, T, R]
        dots = quarters.astype(mx.int32).reshape(nb, 4, T, R).sum(axis=1).astype(mx.float32)
        return mx.array(0.125, mx.float32) * _ordered_sum((_per_block(dw, lead) * dxt) * dots)
    if type_id != Q.Q2_K:
        raise ValueError(f"no ds4 Q8_K dot product for {Q.type_name(type_id)}")
    lo, hi, d, dmin = _q2_k_int(blocks)
    isum = _dots_w(q, lo.reshape(*lead, nb, 256))                                   # [nb, T, R]
    summs = _dots_w(q, hi.reshape(*lead, nb, 256))
    dall = dxt * _per_block(d, lead)
    mins = (summs * dxt) * _per_block(dmin, lead)
    if f64:   # GCC's fma(isum, dall, -mins): exact product, one rounding (as the reference)
        terms = (isum.astype(mx.float64) * dall.astype(mx.float64) - mins.astype(mx.float64)).astype(mx.float32)
    else:
        terms = isum * dall - mins
    return _ordered_sum(terms)


def q4_k_matmul(w, e: int, q: mx.array, dx: mx.array) -> mx.array:
    """The q4 oracles' Q4_K dot (engine/model/ds4_matmul.py: ds4's Q2_K form, d and dmin at the
    block's head, GCC's ``fma(isum * d_x, d, -mins)``) of expert e of an affine4 Q4_K MxWeight with
    Q8_K codes q [T, nb, 256], dx [T, nb] -> float32 [T, R]. The weight's 4-bit codes come from
    MLX's dequantize with unit scales (exact), sc and m from the bound products over d and dmin
    (d * sc is exact in float32, so the quotient is sc itself); the float64 steps need the CPU device."""
    e = int(e)
    T, nb = dx.shape
    sc, bias = w.scales[e].astype(mx.float32), w.biases[e].astype(mx.float32)      # [R, 8 nb]
    R = sc.shape[0]
    ones = mx.ones(sc.shape, mx.float32)
    codes = mx.dequantize(w.w[e], ones, mx.zeros(sc.shape, mx.float32), group_size=32, bits=4,
                          dtype=mx.float32).reshape(R, nb * 8, 32)
    d, dmin = (a[e].astype(mx.float32) for a in w.dmins)                          # [R, nb]
    per_group = lambda v: mx.repeat(v, 8, axis=1)   # noqa: E731
    sc_i = mx.where(per_group(d) != 0, sc / per_group(d), 0.0)
    m_i = mx.where(per_group(dmin) != 0, -bias / per_group(dmin), 0.0)
    lo = (codes * sc_i[..., None]).reshape(R, nb * 4, 64)
    hi = mx.broadcast_to(m_i[..., None], (R, nb * 8, 32)).reshape(R, nb, 256)
    quarters = _dots(q.reshape(T, nb * 4, 64), lo)                                  # [4 nb, T, R]
    isum = quarters.astype(mx.int32).reshape(nb, 4, T, R).sum(axis=1).astype(mx.float32)
    summs = _dots(q, hi)
    dxt = dx.T[:, :, None]
    mins = (summs * dxt) * dmin.T[:, None, :]
    terms = ((isum * dxt).astype(mx.float64) * d.T[:, None, :].astype(mx.float64)
             - mins.astype(mx.float64)).astype(mx.float32)
    return _ordered_sum(terms)


def unique_experts(sel: np.ndarray):
    """(expert, token rows, slot) per expert the tokens picked, in ascending expert order."""
    for e in np.unique(sel):
        rows, slot = np.nonzero(sel == e)
        yield int(e), rows, slot
