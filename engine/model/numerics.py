"""ds4 numerics: the rounding steps of ds4's CPU reference path, as vectorized NumPy.

ds4 (github antirez/ds4, ``ds4.c``) does not run DeepSeek V4 in plain float32:
it emulates the official graph's low-precision storage (FP8 KV rows, FP4
indexer activations, F16 caches) and quantizes activations before its Q8_0 /
k-quant matmuls.  Those roundings decide ties and quantization boundaries, so a
reimplementation that wants to land near ds4's logits has to copy them.  This
module implements each step as a pure function (spec: model.md sections 3.0,
3.5 and 3.6; ds4-oracle README "Numerics a reimplementation has to copy").

Conventions for every function here:

* input: anything ``np.asarray`` turns into numbers; it is converted to
  float32 and never modified in place; the result is a new float32 array;
* any leading batch dimensions; the operation runs along the LAST axis;
* fully vectorized (blocks become an extra axis, never a Python loop).

float32 evaluation order.  ds4 is built with ``-O3 -ffast-math`` (GCC in
``-std=c99`` mode, so no FMA contraction).  Each function documents the exact
sequence of float32 roundings it reproduces.  Where fast-math lets the
compiler rewrite an expression, the form used here is the one GCC 12 emits for
ds4's source (checked against a GCC ``-O3 -ffast-math -march=native`` build of
the relevant ds4 functions); the notes name the cases where that differs from
reading the source literally.  libm calls (``log2f``, ``logf``, ``powf``,
``cosf``, ``sinf``) are modelled as correctly rounded float32 results
(computed in float64, then rounded once to float32).
"""

from __future__ import annotations

import functools
import math

import numpy as np

# The numerics modes: the one name of the arithmetic, in EngineOptions, on Engine and on every
# ops object. "ds4" is this module's rounding steps; "exact" is plain float32, as transformers
# computes it (the golden references).
DS4, EXACT = "ds4", "exact"
NUMERICS = (DS4, EXACT)

__all__ = [
    "DS4",
    "EXACT",
    "NUMERICS",
    "f16_round",
    "fp8_e4m3_roundtrip",
    "e4m3_round",
    "e2m1_round",
    "hadamard128",
    "indexer_qat",
    "q8_0_quantize",
    "q8_0_round",
    "q8_k_quantize",
    "q8_k_round",
    "q8_0_exact",
    "q8_k_exact",
    "rmsnorm_ds4",
    "rope_thetas_ds4",
    "rope_thetas_exact",
    "apply_rope",
    "E4M3_MAX",
    "E2M1_VALUES",
]

_F32 = np.float32

E4M3_MAX = 448.0
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
# midpoints between neighbouring E2M1 magnitudes; a value exactly on a midpoint
# goes to the code with the even index (0, 2, 4, 6)
_E2M1_MIDS = (0.5 * (E2M1_VALUES[1:] + E2M1_VALUES[:-1])).astype(np.float32)

_FP8_AMAX_FLOOR = _F32(1.0e-4)
_FP4_AMAX_FLOOR = _F32(6.0 * 2.0**-126)   # 7.052966e-38, ds4's floor for the FP4 block max


def _f32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


def _blocks(x: np.ndarray, n: int, block: int, what: str) -> np.ndarray:
    """View x[..., :n] as [..., n // block, block] (n must be a multiple of block)."""
    if n % block:
        raise ValueError(f"{what}: length {n} is not a multiple of the block size {block}")
    return x[..., :n].reshape(x.shape[:-1] + (n // block, block))


def _log2f(r: np.ndarray) -> np.ndarray:
    """Correctly rounded float32 log2 of a positive float32 array."""
    return np.log2(r.astype(np.float64)).astype(np.float32)


def _pow2_scale(amax: np.ndarray, floor: np.float32, inv_top: np.float32) -> np.ndarray:
    """2^ceil(log2f(max(amax, floor) * inv_top)) in float32 (ds4's FP8 / FP4 block scale).

    ``inv_top`` is the float32 reciprocal of the top grid value (1/448 or 1/6):
    fast-math turns ds4's ``amax / 448.0f`` into ``amax * (1.0f/448.0f)``.  The
    float32 log2 matters: for r a few ulps above 2^k, log2f(r) rounds to exactly
    k, so the scale stays 2^k and the block maximum is clamped to the top value.
    """
    a = np.maximum(amax, floor)
    r = (a * inv_top).astype(np.float32)
    e = np.ceil(_log2f(r)).astype(np.int32)
    return np.ldexp(np.float32(1.0), e).astype(np.float32)


# ---------------------------------------------------------------------------
# F16


def f16_round(x) -> np.ndarray:
    """float32 -> float16 -> float32, round to nearest even, overflow to +-inf.

    ds4 rounds every cached KV row this way (``f16_round_inplace_cpu`` in
    ``kv_cache_push_raw`` / ``kv_cache_push_comp``); its software f32_to_f16 is
    RNE with gradual underflow, which is exactly NumPy's cast.
    """
    with np.errstate(over="ignore"):
        return _f32(x).astype(np.float16).astype(np.float32)


# ---------------------------------------------------------------------------
# FP8 E4M3FN


def e4m3_round(v) -> np.ndarray:
    """Nearest FP8 E4M3FN value of v (float32), saturating at +-448.

    Grid: m * 2^-9 (m = 0..7, subnormals) and (1 + m/8) * 2^(e-7) (e = 1..15),
    largest 448.  Ties go to the even mantissa (= even code, ds4's
    ``dsv4_e4m3fn_dequant_cpu``).  Sign as ds4 writes it: ``x < 0 ? -g : g``,
    so -0.0 gives +0.0 and a small negative value gives -0.0.
    """
    v = _f32(v)
    av = np.minimum(np.abs(v), _F32(E4M3_MAX))
    _, ex = np.frexp(av)                       # av = f * 2^ex, f in [0.5, 1)
    step_exp = np.maximum(ex - 1, -6) - 3      # grid spacing 2^(e-3); 2^-9 below 2^-6
    q = np.ldexp(np.rint(np.ldexp(av, -step_exp)), step_exp).astype(np.float32)
    return np.where(v < 0, -q, q).astype(np.float32)


def fp8_e4m3_roundtrip(x, n_dims: int | None = None, block: int = 64) -> np.ndarray:
    """ds4's FP8 KV storage emulation (``dsv4_fp8_kv_quantize_row_inplace_cpu``).

    Over x[..., :n_dims] (default: the whole last axis; must be a multiple of
    ``block``), per block of 64 consecutive values, in float32:

        amax  = max(max|x_b|, 1e-4)
        scale = 2^ceil(log2f(amax * (1/448)))        # see _pow2_scale
        v     = clamp(x_b / scale, -448, 448)        # exact: scale is 2^k
        x_b   = e4m3_round(v) * scale                # exact

    Values at and beyond n_dims (the RoPE tail) are returned unchanged.
    """
    x = _f32(x)
    n = x.shape[-1] if n_dims is None else int(n_dims)
    if not 0 <= n <= x.shape[-1]:
        raise ValueError(f"fp8_e4m3_roundtrip: n_dims {n} outside 0..{x.shape[-1]}")
    out = x.copy()
    if n == 0:
        return out
    b = _blocks(x, n, block, "fp8_e4m3_roundtrip")
    amax = np.max(np.abs(b), axis=-1, keepdims=True)
    scale = _pow2_scale(amax, _FP8_AMAX_FLOOR, _F32(1.0) / _F32(E4M3_MAX))
    v = np.clip(b / scale, _F32(-E4M3_MAX), _F32(E4M3_MAX))
    out[..., :n] = (e4m3_round(v) * scale).reshape(x.shape[:-1] + (n,))
    return out


# ---------------------------------------------------------------------------
# FP4 E2M1 and the indexer's Hadamard + FP4 round trip


def e2m1_round(v) -> np.ndarray:
    """Nearest of {0, .5, 1, 1.5, 2, 3, 4, 6} by magnitude (|v| clamped at 6), sign kept.

    Ties go to the even code index: 0.25->0, 0.75->1, 1.25->1, 1.75->2,
    2.5->2, 3.5->4, 5->4 (ds4 ``dsv4_e2m1fn_dequant_cpu``).  Sign as in
    ``e4m3_round`` (``v < 0 ? -g : g``).
    """
    v = _f32(v)
    av = np.minimum(np.abs(v), _F32(6.0))
    code = np.zeros(av.shape, dtype=np.int8)
    for k, mid in enumerate(_E2M1_MIDS):      # 7 constants, not a loop over data
        up = (av > mid) | ((av == mid) & (k % 2 == 1))   # tie k|k+1 -> even of the two
        code += up.astype(np.int8)
    q = E2M1_VALUES[code]
    return np.where(v < 0, -q, q).astype(np.float32)


def hadamard128(x) -> np.ndarray:
    """Orthonormal Walsh-Hadamard transform of the last axis (length a power of two).

    Natural (Sylvester) order: y[i] = sum_j (-1)^popcount(i & j) x[j] / sqrt(n).
    float32 evaluation exactly as ds4's ``dsv4_hadamard128_inplace_cpu``:
    butterflies (a + b, a - b) with stride 1, 2, 4, ... each rounded to float32,
    then one multiply by float32(1/sqrt(n)).
    """
    x = _f32(x)
    n = x.shape[-1]
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard128: last axis {n} is not a power of two")
    lead = x.shape[:-1]
    y = x.copy()
    s = 1
    while s < n:
        yb = y.reshape(lead + (n // (2 * s), 2, s))
        a = yb[..., 0, :]
        b = yb[..., 1, :]
        y = np.stack([a + b, a - b], axis=-2).reshape(lead + (n,))
        s *= 2
    return (y * _F32(1.0 / math.sqrt(n))).astype(np.float32)


def indexer_qat(x) -> np.ndarray:
    """ds4's indexer QAT (``dsv4_indexer_qat_row_inplace_cpu``): Hadamard, then FP4 per 32.

    After ``hadamard128``, per block of 32 values, in float32:

        amax  = max(max|x_b|, 6 * 2^-126)
        scale = 2^ceil(log2f(amax * (1/6)))
        x_b   = e2m1_round(clamp(x_b / scale, -6, 6)) * scale
    """
    h = hadamard128(x)
    n = h.shape[-1]
    b = _blocks(h, n, 32, "indexer_qat")
    amax = np.max(np.abs(b), axis=-1, keepdims=True)
    scale = _pow2_scale(amax, _FP4_AMAX_FLOOR, _F32(1.0) / _F32(6.0))
    v = np.clip(b / scale, _F32(-6.0), _F32(6.0))
    return (e2m1_round(v) * scale).reshape(h.shape).astype(np.float32)


# ---------------------------------------------------------------------------
# activation quantization before the quantized matmuls


def _codes(b: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """int8 codes rint(b * scale) clamped to [-127, 127], NaN -> 0 (the quantizers' decision).

    A normal block's codes are within +-127 by construction (the block maximum scales to 127),
    so the clamp decides only two cases ds4's source leaves undefined, the same way in every
    quantizer (here and the C kernels' in engine/backends/cpu/csrc):

    * a block whose largest magnitude is below ~3.7e-37: 127 / amax overflows to inf, so every
      nonzero value scales to +-inf and is clamped to +-127 (never -128: the kernels move the
      weights' sign onto the activation codes and offset them by 128, which -128 would overflow);
    * NaN products (0 * inf in such a block, or a NaN in the input): code 0, not an arbitrary
      integer (a NaN input also makes the block's scale NaN, so its values stay NaN).
    """
    with np.errstate(invalid="ignore", over="ignore"):
        v = np.rint(b * scale)
    v[np.isnan(v)] = 0.0
    return np.clip(v, -127, 127).astype(np.int8)


def q8_0_quantize(x) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 activation quantization (ds4 ``quantize_q8_0_activation``): (q, d).

    Per block of 32 along the last axis (a shorter last block when the axis is
    not a multiple of 32, as ds4 does; its missing values count as 0), float32,
    as the fast-math build evaluates the source's ``d = amax / 127.0f;
    id = 1.0f / d``:

        d  = amax * float32(1/127)     # constant division -> reciprocal multiply
        id = 127.0f / amax             # 1/(amax*C) -> (1/C)/amax; fl(1/fl(1/127)) == 127
        q  = clamp(rint(x * id), -127, 127)        # RNE; NaN -> 0 (see _codes)
        (all-zero block: id = 0, so q = 0)

    Returns q int8 [..., n_blocks, 32] (zero-padded) and d float32 [..., n_blocks].
    ``d`` differs from a true ``amax / 127`` by one ulp for about 4% of blocks;
    the ``127/amax`` form (instead of ``x / d``) decides exact ties.
    """
    x = _f32(x)
    n = x.shape[-1]
    pad = (-n) % 32
    if pad:
        x = np.concatenate([x, np.zeros(x.shape[:-1] + (pad,), np.float32)], axis=-1)
    b = x.reshape(x.shape[:-1] + ((n + pad) // 32, 32))
    amax = np.max(np.abs(b), axis=-1)
    d = (amax * (_F32(1.0) / _F32(127.0))).astype(np.float32)
    with np.errstate(divide="ignore", over="ignore"):      # (a tiny block: see _codes)
        idv = np.where(amax != 0, _F32(127.0) / amax, _F32(0.0)).astype(np.float32)
    return _codes(b, idv[..., None]), d


def q8_0_round(x) -> np.ndarray:
    """Q8_0 activation rounding: the values ``q * d`` of ``q8_0_quantize`` (float32).

    Same shape as x; an all-zero block gives zeros.  (ds4 never forms these
    values itself: its matmul takes integer dots of q with the weight codes;
    ``float(q) * d`` is the activation that matmul sees.)
    """
    x = _f32(x)
    q, d = q8_0_quantize(x)
    v = (q.astype(np.float32) * d[..., None]).astype(np.float32)
    return v.reshape(v.shape[:-2] + (-1,))[..., : x.shape[-1]]


def q8_k_quantize(x) -> tuple[np.ndarray, np.ndarray]:
    """Q8_K activation quantization (ds4 ``ds4_quantize_row_q8_K``): (q, d).

    Per block of 256 (the last axis must be a multiple of 256), float32:

        m      = the signed element of largest |x| (the first one on ties)
        iscale = -127.0f / m
        q      = clamp(rint(iscale * x), -127, 127)       # RNE; NaN -> 0 (see _codes)
        d      = 1.0f / iscale                            # as written in the source

    The fast-math build evaluates that last line as ``(1.0f / -127.0f) * m``
    (A/(B/C) -> (A/B)*C), so the scale returned here is

        d      = m * float32(-1/127)

    which differs from ``1/iscale`` by one ulp for about a quarter of the
    blocks.  ``iscale`` itself stays a true division.  An all-zero block gives
    q = 0, d = 0.  Returns q int8 [..., n_blocks, 256], d float32 [..., n_blocks].
    """
    x = _f32(x)
    b = _blocks(x, x.shape[-1], 256, "q8_k_quantize")
    idx = np.argmax(np.abs(b), axis=-1)[..., None]          # first maximum
    m = np.take_along_axis(b, idx, axis=-1)[..., 0]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = np.where(m != 0, _F32(-127.0) / m, _F32(0.0)).astype(np.float32)
    d = np.where(m != 0, m * (_F32(-1.0) / _F32(127.0)), _F32(0.0)).astype(np.float32)
    return _codes(b, iscale[..., None]), d


def q8_k_round(x) -> np.ndarray:
    """Q8_K activation rounding: the values ``q * d`` of ``q8_k_quantize`` (float32).

    Same shape as x; an all-zero block gives zeros.
    """
    x = _f32(x)
    q, d = q8_k_quantize(x)
    return (q.astype(np.float32) * d[..., None]).astype(np.float32).reshape(x.shape)


def q8_0_exact(x) -> np.ndarray:
    """The Q8_0 activation as the integer kernels see it: ``q * d`` of ``q8_0_quantize``, float64.

    Same shape as x.  A code (8 bits) times a float32 scale (24 bits) needs up to 32 bits, so the
    float32 ``q8_0_round`` rounds it; here it is exact.  ds4's quantized dot product (and the cpu
    backend's integer kernels) multiply the codes and apply ``d_w * d_x`` per block, which is a
    sum of these exact values: a matmul in float64 over them computes the same function.
    """
    x = _f32(x)
    q, d = q8_0_quantize(x)
    v = q.astype(np.float64) * d.astype(np.float64)[..., None]
    return v.reshape(v.shape[:-2] + (-1,))[..., : x.shape[-1]]


def q8_k_exact(x) -> np.ndarray:
    """The Q8_K activation ``q * d`` of ``q8_k_quantize``, exact in float64 (see ``q8_0_exact``)."""
    x = _f32(x)
    q, d = q8_k_quantize(x)
    return (q.astype(np.float64) * d.astype(np.float64)[..., None]).reshape(x.shape)


# ---------------------------------------------------------------------------
# RMSNorm


def rmsnorm_ds4(x, w, eps) -> np.ndarray:
    """ds4's RMSNorm over the last axis (``rms_norm_weight``, ``rms_norm_no_weight``,
    ``head_rms_norm_inplace``): the sum of squares in float64, then float32 steps

        scale = 1.0f / sqrtf((float)(ss / n) + eps)
        out   = (x * w) * scale          # with a weight: GCC's order for x[i] * scale * weight[i]
        out   = x * scale                # without

    (read from GCC 12's code for the x86 build, and equal to it on the values of
    tests/golden/ds4_cpu_dots.npz; the float64 sum's order changes ``(float)(ss / n)`` only when
    it lies within ~1e-16 of a float32 rounding point).
    """
    x = _f32(x)
    ms = np.mean(np.square(x, dtype=np.float64), axis=-1, keepdims=True).astype(np.float32)
    scale = (_F32(1.0) / np.sqrt(ms + _F32(eps))).astype(np.float32)
    return (x * scale).astype(np.float32) if w is None else ((x * _f32(w)) * scale).astype(np.float32)


# ---------------------------------------------------------------------------
# RoPE


def _yarn_params(yarn: dict) -> tuple[float, float, float, float]:
    try:
        return (float(yarn["factor"]), float(yarn["orig_ctx"]),
                float(yarn["beta_fast"]), float(yarn["beta_slow"]))
    except KeyError as e:
        raise ValueError(f"yarn needs factor, orig_ctx, beta_fast, beta_slow (missing {e})") from None


def _logf(v) -> np.float32:
    return _F32(math.log(float(_F32(v))))


def _ds4_yarn_corr_dims(n_rot: int, orig_ctx: float, base: float,
                        beta_fast: float, beta_slow: float) -> tuple[np.float32, np.float32]:
    """ds4's YaRN ramp ends (``rope_yarn_corr_dims``), float32 throughout."""
    def corr(beta):
        denom = _F32(_F32(_F32(beta) * _F32(2.0)) * _F32(math.pi))
        num = _F32(n_rot) * _logf(_F32(_F32(orig_ctx) / denom))
        return _F32(num / _F32(_F32(2.0) * _logf(base)))
    low = max(_F32(0.0), _F32(math.floor(corr(beta_fast))))
    high = min(_F32(n_rot - 1), _F32(math.ceil(corr(beta_slow))))
    return _F32(low), _F32(high)


def _pos_f32(pos) -> np.ndarray:
    p = np.asarray(pos)
    if p.ndim == 0:
        p = p[None]
    if p.ndim != 1:
        raise ValueError("pos must be a scalar or a 1-D array of positions")
    return p.astype(np.float32)


def rope_thetas_ds4(pos, n_rot: int, base: float, *, yarn: dict | None = None, fma_blend: bool = False) -> np.ndarray:
    """RoPE angles [len(pos), n_rot // 2] exactly as ds4's ``rope_tail_ext_inplace`` makes them.

    float32 throughout:

        theta_scale = powf(base, -2.0f / n_rot)        # 0.749894202 (10000), 0.687656045 (160000)
        e[0]   = (float)pos
        e[p]   = e[p-1] * theta_scale                  # repeated product, rounded each step
        no yarn:  theta[p] = e[p]
        yarn:     r = min(1, max(0, (p - low) * (1 / max(0.001, high - low))))
                  theta[p] = e[p] * ((1/factor) * r + (1 - r))

    The YaRN line is what the fast-math build makes of ds4's source, which
    reads ``ramp_mix = 1 - r; theta = (freq_scale*e)*(1 - ramp_mix) +
    e*ramp_mix`` with a true division for ``y``: GCC hoists the division into
    a reciprocal multiply (fl(0.1) for the standard config, which changes
    pair 24), folds ``1 - (1 - r)`` to ``r`` and factors ``e`` out of the sum.
    Pairs with r = 0 (theta = e) and r = 1 (theta = e/factor) are exact
    either way; only the blended pairs (16..24) depend on this choice.

    low/high: ds4's ``rope_yarn_corr_dims`` (15 and 25 for base 160000,
    original context 65536, beta 32 / 1, n_rot 64).  ds4 also multiplies cos
    and sin by ``attn_factor * (1 + 0.1 ln factor)`` with attn_factor the
    float32 inverse of the second factor; for factor 16 that product is
    exactly 1.0f, so it is left out here.
    """
    if n_rot % 2:
        raise ValueError("n_rot must be even")
    npair = n_rot // 2
    p = _pos_f32(pos)
    theta_scale, mult = _ds4_rope_consts(n_rot, float(base), None if yarn is None else _yarn_params(yarn))
    steps = np.empty((p.shape[0], npair), np.float32)
    steps[:, 0] = p
    steps[:, 1:] = theta_scale
    ext = np.multiply.accumulate(steps, axis=1, dtype=np.float32)   # sequential float32 products
    if mult is None:
        return ext
    if fma_blend:
        # the query rotation's copy of rope_tail_ext_inplace (ds4's q RoPE call site): GCC keeps
        # the source's blend, fma(freq_scale * e, 1 - ramp_mix, ramp_mix * e), ramp_mix = 1 - r
        fs = _F32(1.0) / _F32(yarn["factor"])
        rm = (_F32(1.0) - _ds4_yarn_r(n_rot, float(base), _yarn_params(yarn))).astype(np.float32)
        return (((fs * ext).astype(np.float64) * (_F32(1.0) - rm).astype(np.float64)
                 + (rm * ext).astype(np.float32).astype(np.float64))).astype(np.float32)
    return (ext * mult).astype(np.float32)


@functools.lru_cache(maxsize=16)
def _ds4_yarn_r(n_rot: int, base: float, yarn: tuple) -> np.ndarray:
    """The YaRN ramp r per pair, clamp((p - low) / max(0.001, high - low), 0, 1) (a true division,
    as the query RoPE's copy computes it)."""
    _, orig_ctx, beta_fast, beta_slow = yarn
    low, high = _ds4_yarn_corr_dims(n_rot, orig_ctx, base, beta_fast, beta_slow)
    y = ((np.arange(n_rot // 2, dtype=np.float32) - low) / np.maximum(_F32(0.001), _F32(high - low))).astype(np.float32)
    return np.minimum(_F32(1.0), np.maximum(_F32(0.0), y)).astype(np.float32)


@functools.lru_cache(maxsize=16)
def _ds4_rope_consts(n_rot: int, base: float, yarn: tuple | None):
    """The position-independent half of rope_thetas_ds4: theta_scale and the YaRN blend per pair
    (None without YaRN), computed once per (n_rot, base, yarn): a decode step asks for angles of
    one new position twice a pass, and only this half is costly; the blend is read-only."""
    npair = n_rot // 2
    theta_scale = _F32(float(_F32(base)) ** float(_F32(-2.0) / _F32(n_rot)))
    if yarn is None:
        return theta_scale, None
    factor, orig_ctx, beta_fast, beta_slow = yarn
    freq_scale = _F32(1.0) / _F32(factor)
    low, high = _ds4_yarn_corr_dims(n_rot, orig_ctx, base, beta_fast, beta_slow)
    inv_span = _F32(1.0) / np.maximum(_F32(0.001), _F32(high - low))
    y = (np.arange(npair, dtype=np.float32) - low) * inv_span
    r = np.minimum(_F32(1.0), np.maximum(_F32(0.0), y)).astype(np.float32)
    mult = (freq_scale * r + (_F32(1.0) - r)).astype(np.float32)
    mult.flags.writeable = False
    return theta_scale, mult


def rope_thetas_exact(pos, n_rot: int, base: float, *, yarn: dict | None = None) -> np.ndarray:
    """RoPE angles [len(pos), n_rot // 2] the transformers way (no repeated products).

    ``inv_freq = 1 / base ** (arange(0, n_rot, 2) / n_rot)`` in float32 (the pow
    rounded once to float32), and with YaRN the blend of
    ``_compute_yarn_parameters``: extrapolation ``1/pos_freqs``, interpolation
    ``1/(factor*pos_freqs)``, ``extra = 1 - clamp((arange(n_rot/2) - low) /
    (high - low), 0, 1)`` with low/high from ``find_correction_range`` (float64,
    floor/ceil, clipped to [0, n_rot-1]); ``inv = interp*(1-extra) + extrap*extra``.
    No mscale.  theta = float32(pos) * inv_freq, rounded to float32.
    """
    if n_rot % 2:
        raise ValueError("n_rot must be even")
    p = _pos_f32(pos)
    expo = (np.arange(0, n_rot, 2, dtype=np.float32) / _F32(n_rot)).astype(np.float32)
    pos_freqs = (float(base) ** expo.astype(np.float64)).astype(np.float32)
    inv = (_F32(1.0) / pos_freqs).astype(np.float32)
    if yarn is not None:
        factor, orig_ctx, beta_fast, beta_slow = _yarn_params(yarn)

        def corr(beta):
            return (n_rot * math.log(orig_ctx / (beta * 2 * math.pi))) / (2 * math.log(base))

        low = max(math.floor(corr(beta_fast)), 0)
        high = min(math.ceil(corr(beta_slow)), n_rot - 1)
        if low == high:
            high += 0.001
        ramp = (np.arange(n_rot // 2, dtype=np.float32) - _F32(low)) / _F32(high - low)
        extra = (_F32(1.0) - np.clip(ramp, 0, 1)).astype(np.float32)
        interp = (_F32(1.0) / (_F32(factor) * pos_freqs)).astype(np.float32)
        inv = (interp * (_F32(1.0) - extra) + inv * extra).astype(np.float32)
    return (p[:, None] * inv[None, :]).astype(np.float32)


def rotate_pairs(xp, x, c, s, inverse: bool = False):
    """apply_rope's rotation with the angles' float32 cosines and sines given (c, s: [*L, n_pairs],
    L a prefix of x's leading axes), in any array namespace xp with numpy's stack/concatenate (the
    mlx and cupy backends): products and sums rounded to float32 one at a time."""
    npair = c.shape[-1]
    n_rot, W = 2 * npair, x.shape[-1]
    lead_x, lead_t = x.shape[:-1], c.shape[:-1]
    shape = lead_t + (1,) * (len(lead_x) - len(lead_t)) + (npair,)
    c, s = c.reshape(shape), s.reshape(shape)
    if inverse:
        s = -s
    tail = x[..., W - n_rot:].reshape(lead_x + (npair, 2))
    x0, x1 = tail[..., 0], tail[..., 1]
    rot = xp.stack([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1).reshape(lead_x + (n_rot,))
    return rot if n_rot == W else xp.concatenate([x[..., :W - n_rot], rot], axis=-1)


@functools.lru_cache(maxsize=1)
def _libm_cos_sin():
    """The C library's float32 cosf and sinf, vectorized (None where there is no libm to load)."""
    import ctypes
    import ctypes.util
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
        cosf, sinf = lib.cosf, lib.sinf
    except (OSError, AttributeError):
        return None
    for f in (cosf, sinf):
        f.restype, f.argtypes = ctypes.c_float, [ctypes.c_float]
    return np.frompyfunc(cosf, 1, 1), np.frompyfunc(sinf, 1, 1)


@functools.lru_cache(maxsize=None)
def libm_ufunc(name: str):
    """The C library's float32 function `name` (e.g. "log1pf") as a NumPy object ufunc, or None
    where no libm loads."""
    import ctypes
    import ctypes.util
    try:
        f = getattr(ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6"), name)
    except (OSError, AttributeError):
        return None
    f.restype, f.argtypes = ctypes.c_float, [ctypes.c_float]
    return np.frompyfunc(f, 1, 1)


def libm_cos_sin(theta) -> tuple[np.ndarray, np.ndarray]:
    """cosf(theta), sinf(theta) of float32 angles as the platform's C library computes them
    (what ds4's ``rope_tail_ext_inplace`` calls: glibc's are one ulp off the correctly rounded
    value for ~1.2 % of angles); correctly rounded where no libm loads."""
    th = np.asarray(theta, dtype=np.float32)
    f = _libm_cos_sin()
    if f is None or th.size == 0:
        t64 = th.astype(np.float64)
        return np.cos(t64).astype(np.float32), np.sin(t64).astype(np.float32)
    return f[0](th).astype(np.float32), f[1](th).astype(np.float32)


def apply_rope(x, thetas, inverse: bool = False, libm: bool = False) -> np.ndarray:
    """Rotate the last n_rot = 2 * thetas.shape[-1] dims of x in interleaved pairs.

    Pair p of the tail t = x[..., W - n_rot:] is (t[2p], t[2p+1]):

        t'[2p]   = t[2p] * c - t[2p+1] * s
        t'[2p+1] = t[2p] * s + t[2p+1] * c

    with c = cosf(theta), s = sinf(theta) (float32; ``inverse`` uses -s, i.e.
    the negated angle), products and sums rounded to float32 one at a time
    (ds4 ``rope_tail_ext_inplace``).  The first W - n_rot dims are copied.
    cos/sin here are correctly rounded; glibc 2.36's cosf/sinf (what a Linux
    ds4 build calls) are off by one ulp for about 1.2% of angles, and with
    them (``libm``, ds4 numerics) this function is bit-exact with ds4's GCC build.

    Broadcasting: the leading axes of ``thetas`` line up with the LEADING axes
    of x, not the trailing ones.  thetas of shape [*L, n_pairs] with L a
    prefix of x.shape[:-1] is reshaped to [*L, 1, ..., 1, n_pairs]; e.g.
    thetas [T, 32] (from ``rope_thetas_*``) rotates x [T, W] and x [T, H, W]
    (every head of token t at angle row t); thetas [32] rotates every row.
    """
    x = _f32(x)
    th = _f32(thetas)
    npair = th.shape[-1]
    n_rot = 2 * npair
    if n_rot > x.shape[-1]:
        raise ValueError(f"apply_rope: n_rot {n_rot} exceeds the last axis {x.shape[-1]}")
    lead_t = th.shape[:-1]
    lead_x = x.shape[:-1]
    if len(lead_t) > len(lead_x) or any(a != b and a != 1 for a, b in zip(lead_t, lead_x)):
        raise ValueError(f"apply_rope: thetas {th.shape} do not line up with x {x.shape}")
    th = th.reshape(lead_t + (1,) * (len(lead_x) - len(lead_t)) + (npair,))
    if libm:                   # ds4 numerics: the C library's cosf / sinf, as ds4 calls them
        c, s = libm_cos_sin(th)
    else:
        t64 = th.astype(np.float64)
        c = np.cos(t64).astype(np.float32)
        s = np.sin(t64).astype(np.float32)
    if inverse:
        s = -s
    out = x.copy()
    tail = x[..., x.shape[-1] - n_rot:].reshape(lead_x + (npair, 2))
    x0 = tail[..., 0]
    x1 = tail[..., 1]
    r0 = x0 * c - x1 * s
    r1 = x0 * s + x1 * c
    out[..., x.shape[-1] - n_rot:] = np.stack([r0, r1], axis=-1).reshape(lead_x + (n_rot,))
    return out
