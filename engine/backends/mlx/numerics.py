"""ds4's rounding steps (engine/model/numerics.py) on mx arrays, bit-identical to the NumPy spec.

Every function takes a float32 mx array of any leading shape, works along the LAST axis (blocked
where the spec blocks) and returns a new float32 mx array. The float32 operation sequence is the
spec's own (see each docstring there); the notes here only say where the MLX form differs.

The one float64 step of the spec is ``_pow2_scale``'s ``ceil(log2f(r))`` (log2 in float64, rounded
once to float32). MLX's CPU device has no float64, so it is done exactly in integers instead:
r = (1 + j 2^-23) 2^E is a normal float32 (the spec's floors keep it >= 2^-126), so
ceil(log2f(r)) is E when log2f(r) rounds down onto E, which happens iff the mantissa bits j are at
most a threshold per exponent, and E + 1 otherwise. The thresholds come from the spec's own float64
formula at import (254 exponents x a few dozen mantissas), so the result is identical by
construction; the test sweeps every exponent across its threshold.
"""
from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from engine.model import numerics as N

__all__ = ["f16_round", "q8_0_codes", "q8_0_round", "q8_k_codes", "q8_k_round", "exp64", "expf", "e4m3_round", "fp8_e4m3_roundtrip",
           "e2m1_round", "hadamard128", "indexer_qat"]

_F32 = np.float32


def _c(v) -> mx.array:
    """A float32 scalar constant, rounded by NumPy exactly as the spec rounds it."""
    return mx.array(_F32(v), dtype=mx.float32)


_INV_127 = _c(_F32(1.0) / _F32(127.0))
_NEG_INV_127 = _c(_F32(-1.0) / _F32(127.0))
_INV_448 = _c(_F32(1.0) / _F32(N.E4M3_MAX))
_INV_6 = _c(_F32(1.0) / _F32(6.0))
_FP8_FLOOR = _c(N._FP8_AMAX_FLOOR)
_FP4_FLOOR = _c(N._FP4_AMAX_FLOOR)
_E2M1 = mx.array(N.E2M1_VALUES)
_MIDS = [float(m) for m in N._E2M1_MIDS]   # exact float32 values (0.25, 0.75, ...)


def _log2_thresholds() -> np.ndarray:
    """int32 [256]: for biased exponent b (E = b - 127), the largest mantissa j with
    ceil(spec_log2f((1 + j 2^-23) 2^E)) == E. log2f(1 + eps) ~ eps / ln 2 rounds onto E only while
    it is under half an ulp of E, so j stays below 2^-17 * ln 2 * 2^23 ~ 45; 256 is a safe bound."""
    j = np.arange(256, dtype=np.uint32)
    thr = np.zeros(256, dtype=np.int32)
    for b in range(1, 255):
        r = ((np.uint32(b) << np.uint32(23)) | j).view(np.float32)
        e = np.ceil(N._log2f(r)).astype(np.int64)
        above = np.nonzero(e != b - 127)[0]
        if len(above) == 0 or np.any(e[above[0]:] != b - 126):   # one step, and it stays up
            raise AssertionError(f"log2 threshold table: exponent {b - 127} is not a single step")
        thr[b] = above[0] - 1
    return thr


_LOG2_THR = mx.array(_log2_thresholds())


def _pow2(k: mx.array) -> mx.array:
    """2^k as float32 for int32 k in [-126, 127] (built from the exponent bits: exact)."""
    return ((k + 127).astype(mx.uint32) << 23).view(mx.float32)


def _pow2_scale(amax: mx.array, floor: mx.array, inv_top: mx.array) -> mx.array:
    """N._pow2_scale without float64: 2^ceil(log2f(max(amax, floor) * inv_top))."""
    r = mx.maximum(amax, floor) * inv_top
    bits = r.view(mx.uint32)
    b = ((bits >> 23) & 255).astype(mx.int32)
    j = (bits & 0x7FFFFF).astype(mx.int32)
    e = (b - 127) + (j > mx.take(_LOG2_THR, b)).astype(mx.int32)
    return _pow2(e)


def _blocks(x: mx.array, n: int, block: int, what: str) -> mx.array:
    if n % block:
        raise ValueError(f"{what}: length {n} is not a multiple of the block size {block}")
    return x[..., :n].reshape(*x.shape[:-1], n // block, block)


def _f32(x) -> mx.array:
    x = x if isinstance(x, mx.array) else mx.array(np.asarray(x, dtype=np.float32))
    return x.astype(mx.float32)


def f16_round(x) -> mx.array:
    """float32 -> float16 (RNE, overflow to inf, gradual underflow) -> float32."""
    return _f32(x).astype(mx.float16).astype(mx.float32)


def _int_valued(q: mx.array) -> mx.array:
    """The spec casts the rounded codes to int8 and back: that turns -0.0 into +0.0."""
    return q.astype(mx.int32).astype(mx.float32)


def _codes(scaled: mx.array) -> mx.array:
    """N._codes: rint, NaN -> 0, clamped to [-127, 127] (the quantizers' decision on tiny and NaN
    blocks), as float32 integers."""
    q = mx.round(scaled)
    return _int_valued(mx.clip(mx.where(mx.isnan(q), _c(0.0), q), -127, 127))


def q8_0_codes(x) -> tuple[mx.array, mx.array]:
    """N.q8_0_quantize: per 32 (a short last block padded with zeros), d = amax * fl(1/127),
    q = clamp(rint(x * (127 / amax)), -127, 127) (NaN -> 0). Returns the codes as float32
    integers [..., n_blocks, 32] and d float32 [..., n_blocks]."""
    x = _f32(x)
    n = x.shape[-1]
    pad = (-n) % 32
    if pad:
        x = mx.concatenate([x, mx.zeros((*x.shape[:-1], pad), dtype=mx.float32)], axis=-1)
    b = x.reshape(*x.shape[:-1], (n + pad) // 32, 32)
    amax = mx.max(mx.abs(b), axis=-1, keepdims=True)
    d = amax * _INV_127
    idv = mx.where(amax != 0, _c(127.0) / amax, _c(0.0))
    return _codes(b * idv), d[..., 0]


def q8_0_round(x) -> mx.array:
    """N.q8_0_round: the value q * d of q8_0_codes, rounded to float32."""
    x = _f32(x)
    n = x.shape[-1]
    q, d = q8_0_codes(x)
    v = (q * d[..., None]).reshape(*x.shape[:-1], q.shape[-2] * 32)
    return v[..., :n]


def q8_k_codes(x) -> tuple[mx.array, mx.array]:
    """N.q8_k_quantize: per 256, m = the first element of largest |x|, q = clamp(rint((-127/m) x)),
    d = m * fl(-1/127); an all-zero block gives zeros. Codes float32 [..., nb, 256], d [..., nb]."""
    x = _f32(x)
    b = _blocks(x, x.shape[-1], 256, "q8_k_round")
    idx = mx.argmax(mx.abs(b), axis=-1, keepdims=True)       # MLX's argmax returns the first maximum
    m = mx.take_along_axis(b, idx, axis=-1)
    nz = m != 0
    iscale = mx.where(nz, _c(-127.0) / m, _c(0.0))
    d = mx.where(nz, m * _NEG_INV_127, _c(0.0))
    return _codes(iscale * b), d[..., 0]


def q8_k_round(x) -> mx.array:
    """N.q8_k_round: the value q * d of q8_k_codes, rounded to float32."""
    x = _f32(x)
    q, d = q8_k_codes(x)
    return (q * d[..., None]).reshape(x.shape)


def e4m3_round(v) -> mx.array:
    """N.e4m3_round: nearest E4M3FN value (ties to even), saturating at 448, sign as ``v < 0 ? -g : g``.

    The spec's frexp exponent is read from the float32 exponent bits; subnormal inputs (exponent 0)
    are all below 2^-6, where the grid step is 2^-9 either way.
    """
    v = _f32(v)
    av = mx.minimum(mx.abs(v), _c(N.E4M3_MAX))
    ex = ((av.view(mx.uint32) >> 23) & 255).astype(mx.int32) - 126       # av = f 2^ex, f in [0.5, 1)
    step = mx.maximum(ex - 1, -6) - 3
    q = mx.round(av * _pow2(-step)) * _pow2(step)                          # power-of-two scalings: exact
    return mx.where(v < 0, -q, q)


def fp8_e4m3_roundtrip(x, n_dims: int | None = None, block: int = 64) -> mx.array:
    """N.fp8_e4m3_roundtrip: per block of 64 of x[..., :n_dims], scale 2^ceil(log2f(amax/448))
    (amax >= 1e-4), e4m3_round(clamp(x / scale)) * scale; the tail past n_dims unchanged."""
    x = _f32(x)
    n = x.shape[-1] if n_dims is None else int(n_dims)
    if not 0 <= n <= x.shape[-1]:
        raise ValueError(f"fp8_e4m3_roundtrip: n_dims {n} outside 0..{x.shape[-1]}")
    if n == 0:
        return x
    b = _blocks(x, n, block, "fp8_e4m3_roundtrip")
    scale = _pow2_scale(mx.max(mx.abs(b), axis=-1, keepdims=True), _FP8_FLOOR, _INV_448)
    v = mx.clip(b / scale, -N.E4M3_MAX, N.E4M3_MAX)
    head = (e4m3_round(v) * scale).reshape(*x.shape[:-1], n)
    return head if n == x.shape[-1] else mx.concatenate([head, x[..., n:]], axis=-1)


def e2m1_round(v) -> mx.array:
    """N.e2m1_round: nearest of {0, .5, 1, 1.5, 2, 3, 4, 6} by magnitude (clamped at 6), ties to
    the even code index, sign as ``v < 0 ? -g : g``."""
    v = _f32(v)
    av = mx.minimum(mx.abs(v), _c(6.0))
    code = mx.zeros(av.shape, dtype=mx.int32)
    for k, mid in enumerate(_MIDS):          # 7 constants, not a loop over data
        up = (av > mid) | ((av == mid) & (k % 2 == 1))
        code = code + up.astype(mx.int32)
    q = mx.take(_E2M1, code)
    return mx.where(v < 0, -q, q)


def hadamard128(x) -> mx.array:
    """N.hadamard128: butterflies (a + b, a - b) with stride 1, 2, 4, ..., each rounded to float32,
    then one multiply by fl(1/sqrt(n))."""
    y = _f32(x)
    n = y.shape[-1]
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard128: last axis {n} is not a power of two")
    lead = y.shape[:-1]
    s = 1
    while s < n:
        yb = y.reshape(*lead, n // (2 * s), 2, s)
        a, b = yb[..., 0, :], yb[..., 1, :]
        y = mx.stack([a + b, a - b], axis=-2).reshape(*lead, n)
        s *= 2
    return y * _c(1.0 / math.sqrt(n))


def indexer_qat(x) -> mx.array:
    """N.indexer_qat: hadamard128, then per 32: scale 2^ceil(log2f(max(amax, 6 2^-126) / 6)),
    e2m1_round(clamp(x / scale, -6, 6)) * scale."""
    h = hadamard128(x)
    b = _blocks(h, h.shape[-1], 32, "indexer_qat")
    scale = _pow2_scale(mx.max(mx.abs(b), axis=-1, keepdims=True), _FP4_FLOOR, _INV_6)
    v = mx.clip(b / scale, -6.0, 6.0)
    return (e2m1_round(v) * scale).reshape(h.shape)


# ---------------------------------------------------------------------------
# exp with the reference's precision. MLX's exp is a float32 approximation (on float64 input too:
# measured, 81 % of float32 results differ from the correctly rounded ones); the reference's float64
# steps need float64 exp, and libm's expf (ds4's) is within 0.502 ulp of the true value. Here:
# k = rint(x / ln 2), r = x - k ln2_hi - k ln2_lo (Cody-Waite, exact for |k| < 2^20), exp(r) by
# its Taylor series to r^13 (|r| <= 0.35: truncation below 4e-18), times 2^k from the exponent bits.

_LN2_HI, _LN2_LO = 6.93147180369123816490e-01, 1.90821492927058770002e-10
_INV_FACT = [1.0 / math.factorial(i) for i in range(14)]


def exp64(x: mx.array) -> mx.array:
    """exp of a float64 mx array to ~1 ulp (the CPU device: Metal has no float64); 0 below -746
    (-inf included), inf above 709.79."""
    xin = x
    x = mx.clip(x, -746.0, 709.78)
    k = mx.round(x * (1.0 / math.log(2.0)))
    r = (x - k * _LN2_HI) - k * _LN2_LO
    p = mx.array(_INV_FACT[13], dtype=mx.float64)
    for c in reversed(_INV_FACT[:13]):
        p = p * r + c
    ki = k.astype(mx.int64)
    k1 = ki // 2                                  # 2^k as two factors: each stays a normal float64
    two = lambda e: ((e + 1023) << 52).view(mx.float64)   # noqa: E731
    y = p * two(k1) * two(ki - k1)
    return mx.where(xin < -746.0, 0.0, mx.where(xin > 709.79, mx.inf, y))


def expf(x) -> mx.array:
    """float32 exp as libm's expf gives it (the exact value rounded once, up to float64 ties)."""
    x = _f32(x)
    return exp64(x.astype(mx.float64)).astype(mx.float32)
