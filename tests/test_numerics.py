"""Tests for engine.model.numerics: ds4's rounding steps, against formulas, references and hand-worked values."""

import math

import numpy as np
import pytest

from engine.model import numerics as nm

f32 = np.float32
YARN = dict(factor=16, orig_ctx=65536, beta_fast=32, beta_slow=1)


def bits(a):
    return np.asarray(a, dtype=np.float32).view(np.uint32)


def same_bits(a, b):
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(bits(a), bits(b))


def e4m3_grid():
    """All non-negative finite E4M3FN magnitudes (codes 0..126), float64."""
    vals = [m * 2.0**-9 for m in range(8)]
    vals += [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8)]
    return np.array(vals[:127])


# ---------------------------------------------------------------------------
# generic contract: float32 out, input untouched, leading dims


CALLS = [
    ("f16_round", lambda x: nm.f16_round(x), 256),
    ("fp8", lambda x: nm.fp8_e4m3_roundtrip(x, n_dims=192), 256),
    ("e2m1", lambda x: nm.e2m1_round(x), 256),
    ("hadamard", lambda x: nm.hadamard128(x), 128),
    ("qat", lambda x: nm.indexer_qat(x), 128),
    ("q8_0", lambda x: nm.q8_0_round(x), 256),
    ("q8_k", lambda x: nm.q8_k_round(x), 256),
    ("rope", lambda x: nm.apply_rope(x, nm.rope_thetas_ds4([5], 64, 1e4)[0]), 256),
]


@pytest.mark.parametrize("name,fn,width", CALLS, ids=[c[0] for c in CALLS])
def test_contract_batch_dims_and_no_mutation(name, fn, width):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((2, 3, width)) * 2).astype(np.float32)
    keep = x.copy()
    y = fn(x)
    assert y.dtype == np.float32 and y.shape == x.shape
    assert same_bits(x, keep), "input was modified"
    # the result of a batch equals the result row by row
    rows = np.stack([np.stack([fn(x[i:i + 1, j:j + 1])[0, 0] for j in range(3)]) for i in range(2)])
    assert same_bits(y, rows)


# ---------------------------------------------------------------------------
# F16


def test_f16_round_matches_numpy_cast():
    rng = np.random.default_rng(2)
    x = np.concatenate([
        (rng.standard_normal(5000) * np.exp(rng.uniform(-20, 12, 5000))).astype(np.float32),
        np.array([65504, 65519.99, 65520, 1e6, -1e6, 2.0**-24, 2.0**-25, 3 * 2.0**-26,
                  2.0**-26, 1 + 2.0**-11, 1 + 3 * 2.0**-11, -0.0, 0.0], np.float32),
    ])
    y = nm.f16_round(x)
    with np.errstate(over="ignore"):
        assert same_bits(y, x.astype(np.float16).astype(np.float32))
    assert y[-13 + 2] == np.inf and y[-13 + 4] == -np.inf           # 65520 and beyond overflow
    assert y[-13 + 6] == 0 and y[-13 + 7] == 2.0**-24               # 2^-25 tie -> 0, 3*2^-26 -> 2^-24
    assert y[-13 + 9] == 1 and y[-13 + 10] == 1 + 2 * 2.0**-10      # ties to even mantissa


# ---------------------------------------------------------------------------
# FP8 E4M3FN


def test_e4m3_round_exhaustive_midpoints_and_neighbours():
    g = e4m3_grid()
    mids = (g[1:] + g[:-1]) / 2
    pts = np.concatenate([g, mids]).astype(np.float32)
    pts = np.concatenate([pts, np.nextafter(pts, f32(0)), np.nextafter(pts, f32(1000))])
    pts = np.concatenate([pts, -pts])
    got = nm.e4m3_round(pts).astype(np.float64)
    # reference: nearest grid value, ties to the even code (= even mantissa)
    a = np.minimum(np.abs(pts.astype(np.float64)), 448.0)
    dist = np.abs(a[:, None] - g[None, :])
    best = dist.min(axis=1, keepdims=True)
    cand = dist == best
    codes = np.arange(127)
    code = np.where(cand.sum(1) == 2, np.where(cand & (codes % 2 == 0), codes, 999).min(1), dist.argmin(1))
    ref = np.sign(pts) * g[code]
    np.testing.assert_array_equal(got, ref)


def test_e4m3_round_matches_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(3)
    v = (rng.standard_normal(20000) * np.exp(rng.uniform(-12, 6, 20000))).astype(np.float32)
    v = np.clip(v, -448, 448)   # ml_dtypes' cast does not saturate (>= 464 -> NaN)
    ref = v.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(nm.e4m3_round(v), ref)


def test_e4m3_hand_worked():
    cases = {
        0.06640625: 0.0625,        # tie 0.0625 | 0.0703125 -> 0.0625 (mantissa 0)
        0.060546875: 0.0625,       # tie 0.05859375 (m=7) | 0.0625 (m=0) -> 0.0625
        0.07421875: 0.078125,      # tie 0.0703125 (m=1) | 0.078125 (m=2) -> m=2
        0.0625 + 2.0**-9: 0.0625,  # below the tie
        2.0**-10: 0.0,             # subnormal tie 0 | 2^-9 -> 0
        3 * 2.0**-10: 2.0**-8,     # tie 2^-9 (m=1) | 2*2^-9 (m=2) -> m=2
        7.5 * 2.0**-9: 2.0**-6,    # top subnormal tie -> smallest normal
        2.0**-11: 0.0,
        448.0: 448.0,
        464.0: 448.0,              # would round to 480, which E4M3FN lacks: saturate
        1000.0: 448.0,
        -1000.0: -448.0,
        -3 * 2.0**-10: -(2.0**-8),
        17.0: 16.0,                # tie 16 | 18 -> 16
        19.0: 20.0,                # tie 18 | 20 -> 20
    }
    x = np.array(list(cases), np.float32)
    np.testing.assert_array_equal(nm.e4m3_round(x), np.array(list(cases.values()), np.float32))


def fp8_reference(row, n_dims, block=64):
    """Per-block loop with float32 scalars (fast-math form: amax * fl(1/448))."""
    out = np.array(row, np.float32).copy()
    inv448 = f32(1) / f32(448)
    for o in range(0, n_dims, block):
        b = out[o:o + block].copy()
        amax = max(f32(np.max(np.abs(b))), f32(1e-4))
        r = f32(amax * inv448)
        e = math.ceil(float(f32(math.log2(float(r)))))
        scale = f32(2.0**e)
        for i in range(block):
            v = min(max(f32(b[i] / scale), f32(-448)), f32(448))
            out[o + i] = f32(nm.e4m3_round(np.array([v]))[0] * scale)
    return out


def test_fp8_roundtrip_against_reference_loop_and_ml_dtypes():
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((6, 512)) * np.exp(rng.uniform(-9, 5, (6, 1)))).astype(np.float32)
    x[0, :64] = 0.0                            # all-zero block
    y = nm.fp8_e4m3_roundtrip(x, n_dims=448)
    for r in range(6):
        assert same_bits(y[r], fp8_reference(x[r], 448))
    ml_dtypes = pytest.importorskip("ml_dtypes")
    b = x[:, :448].reshape(6, 7, 64)
    amax = np.maximum(np.abs(b).max(-1, keepdims=True), f32(1e-4))
    scale = np.exp2(np.ceil(np.log2((amax * (f32(1) / f32(448))).astype(np.float64)).astype(np.float32)))
    v = np.clip(b / scale.astype(np.float32), -448, 448)
    ref = (v.astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale).reshape(6, 448)
    np.testing.assert_array_equal(y[:, :448], ref)


def test_fp8_tail_untouched_and_scale_power_of_two():
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((4, 3, 512)) * 7).astype(np.float32)
    x[0, 0, 500] = np.nan
    y = nm.fp8_e4m3_roundtrip(x, n_dims=448)
    assert same_bits(y[..., 448:], x[..., 448:])
    assert same_bits(nm.fp8_e4m3_roundtrip(x, n_dims=0), x)
    g = e4m3_grid()
    b = y[..., :448].reshape(-1, 64)
    xb = x[..., :448].reshape(-1, 64)
    amax = np.abs(xb).max(-1)
    scale = 2.0 ** np.ceil(np.log2(amax / 448))
    q = np.abs(b) / scale[:, None]
    assert np.all(np.isin(q, g)), "values are not scale * E4M3 grid"
    assert np.all((q.max(-1) >= 224) & (q.max(-1) <= 448))
    with pytest.raises(ValueError):
        nm.fp8_e4m3_roundtrip(x, n_dims=100)


def test_fp8_block_with_amax_448_keeps_grid_values():
    g = e4m3_grid().astype(np.float32)
    vals = np.concatenate([g, -g, np.zeros(2 * 64 * 2 - 254, np.float32)]).reshape(4, 64)
    vals[:, 0] = 448.0                                # every block: amax 448 -> scale 1
    np.testing.assert_array_equal(nm.fp8_e4m3_roundtrip(vals), vals)
    # scaling a block by 2^k scales the result by 2^k (scale is a power of two)
    np.testing.assert_array_equal(nm.fp8_e4m3_roundtrip(vals * f32(2.0**-7)), vals * f32(2.0**-7))
    # ds4 writes the sign as x < 0 ? -g : g, so -0.0 comes back as +0.0
    assert not np.signbit(nm.fp8_e4m3_roundtrip(-np.zeros(64, np.float32))).any()


def test_fp8_float32_log2_keeps_scale_and_saturates():
    # amax one ulp above 1.75 = 448 * 2^-8: r = amax * fl(1/448) = 2^-8 * (1 + 2^-23), and
    # float32 log2 of that rounds to exactly -8, so scale = 2^-8 (an exact log2 would give
    # -7.99999983 -> scale 2^-7).  The max maps to 448.00005 and saturates at 448 -> 1.75,
    # and 2^-17 is still the smallest subnormal 2^-9 * 2^-8 and survives.
    b = np.zeros(64, np.float32)
    b[0] = np.nextafter(f32(1.75), f32(2))
    b[1] = 2.0**-17
    y = nm.fp8_e4m3_roundtrip(b)
    assert y[0] == 1.75 and y[1] == 2.0**-17
    # two ulps above: log2f gives -7.9999995, scale 2^-7, and 2^-17 is a tie 0 | 2^-16 -> 0
    b[0] = np.nextafter(b[0], f32(2))
    y = nm.fp8_e4m3_roundtrip(b)
    assert y[0] == 1.75 and y[1] == 0.0
    # all-zero block: amax floored at 1e-4, stays zero
    assert np.all(nm.fp8_e4m3_roundtrip(np.zeros(64, np.float32)) == 0)
    # a block whose values are tiny uses the 1e-4 floor: scale 2^ceil(log2(1e-4/448)) = 2^-22
    t = np.zeros(64, np.float32)
    t[0] = 2.0**-30
    t[1] = 1.5 * 2.0**-31      # on the 2^-9 * 2^-22 = 2^-31 subnormal grid: tie 2^-31 | 2^-30 -> 2^-30
    t[2] = 2.0**-33            # a quarter step -> 0
    t[3] = 3 * 2.0**-31        # a grid value
    y = nm.fp8_e4m3_roundtrip(t)
    np.testing.assert_array_equal(y[:4], [2.0**-30, 2.0**-30, 0.0, 3 * 2.0**-31])


# ---------------------------------------------------------------------------
# FP4 E2M1 and the indexer QAT


def test_e2m1_ties_and_signs():
    table = {0.25: 0, 0.75: 1, 1.25: 1, 1.75: 2, 2.5: 2, 3.5: 4, 5.0: 4,
             0.2: 0, 0.3: 0.5, 0.8: 1, 2.6: 3, 4.9: 4, 5.1: 6, 6.0: 6, 7.0: 6, 100.0: 6, 0.0: 0}
    x = np.array(list(table), np.float32)
    want = np.array(list(table.values()), np.float32)
    np.testing.assert_array_equal(nm.e2m1_round(x), want)
    np.testing.assert_array_equal(nm.e2m1_round(-x), -want)
    grid = nm.E2M1_VALUES
    np.testing.assert_array_equal(nm.e2m1_round(grid), grid)
    # sign as ds4 writes it (x < 0 ? -g : g): small negatives give -0.0, -0.0 gives +0.0
    z = nm.e2m1_round(np.array([-0.1, -0.0], np.float32))
    assert np.signbit(z[0]) and not np.signbit(z[1])


def explicit_hadamard(n):
    i = np.arange(n)
    pc = np.vectorize(lambda v: bin(v).count("1"))(i[:, None] & i[None, :])
    return np.where(pc % 2 == 0, 1.0, -1.0) / math.sqrt(n)


def test_hadamard128_matrix_orthonormal_and_involution():
    H = explicit_hadamard(128)
    M = nm.hadamard128(np.eye(128, dtype=np.float32))   # row i = transform of e_i = column i of H
    np.testing.assert_allclose(M, H.T, atol=1e-7)
    np.testing.assert_allclose(H @ H, np.eye(128), atol=1e-12)
    np.testing.assert_allclose(M.astype(np.float64) @ M.astype(np.float64), np.eye(128), atol=1e-6)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((5, 128)).astype(np.float32)
    np.testing.assert_allclose(nm.hadamard128(x), x.astype(np.float64) @ H.T, atol=2e-6)
    np.testing.assert_allclose(nm.hadamard128(nm.hadamard128(x)), x, atol=2e-6)
    for n in (1, 2, 4, 32, 256):
        v = rng.standard_normal((3, n)).astype(np.float32)
        np.testing.assert_allclose(nm.hadamard128(v), v @ explicit_hadamard(n).T, atol=2e-6)
    with pytest.raises(ValueError):
        nm.hadamard128(np.zeros(96, np.float32))


def test_hadamard_float32_butterfly_order():
    # one stage at a time in float32, stride 1 first, then the 1/sqrt(n) multiply
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(128) * 1e3).astype(np.float32)
    y = x.copy()
    s = 1
    while s < 128:
        for base in range(0, 128, 2 * s):
            a = y[base:base + s].copy()
            b = y[base + s:base + 2 * s].copy()
            y[base:base + s] = a + b
            y[base + s:base + 2 * s] = a - b
        s *= 2
    y = y * f32(0.08838834764831845)
    assert same_bits(nm.hadamard128(x), y)


def test_indexer_qat_hand_worked():
    # e_0 -> every Hadamard value is fl(1/sqrt(128)) = 0.08838835; amax/6 = 0.01473 -> scale 2^-6;
    # 0.08838835 / 2^-6 = 5.657 -> nearest E2M1 value 6 -> 6/64 = 0.09375
    e0 = np.zeros(128, np.float32)
    e0[0] = 1
    np.testing.assert_array_equal(nm.indexer_qat(e0), np.full(128, 0.09375, np.float32))
    np.testing.assert_array_equal(nm.indexer_qat(-e0), np.full(128, -0.09375, np.float32))
    e1 = np.zeros(128, np.float32)
    e1[1] = 1
    np.testing.assert_array_equal(nm.indexer_qat(e1), np.where(np.arange(128) % 2, -0.09375, 0.09375))
    np.testing.assert_array_equal(nm.indexer_qat(np.zeros((2, 128), np.float32)), 0)


def test_indexer_qat_values_on_grid_and_dots_roughly_kept():
    rng = np.random.default_rng(8)
    q = rng.standard_normal((64, 128)).astype(np.float32)
    k = rng.standard_normal((64, 128)).astype(np.float32)
    qq, kk = nm.indexer_qat(q), nm.indexer_qat(k)
    h = nm.hadamard128(q).reshape(64, 4, 32)
    amax = np.abs(h).max(-1, keepdims=True)
    scale = 2.0 ** np.ceil(np.log2(amax / 6))
    r = qq.reshape(64, 4, 32) / scale
    assert np.all(np.isin(np.abs(r), nm.E2M1_VALUES)) and np.all(np.abs(r).max(-1) >= 3)
    exact = (q @ k.T).astype(np.float64)
    approx = (qq @ kk.T).astype(np.float64)
    norms = np.linalg.norm(q, axis=1)[:, None] * np.linalg.norm(k, axis=1)[None, :]
    err = np.abs(approx - exact) / norms               # FP4: ~1% of |q| |k|
    assert np.median(err) < 0.02 and err.max() < 0.1
    assert np.corrcoef(exact.ravel(), approx.ravel())[0, 1] > 0.98


# ---------------------------------------------------------------------------
# activation quantization


def q8_0_reference(x):
    """Per-block loop, float32 scalars, ds4's fast-math form: d = amax*fl(1/127), id = 127/amax."""
    x = np.asarray(x, np.float32)
    out = np.zeros_like(x)
    for o in range(0, x.size, 32):
        b = x[o:o + 32]
        amax = f32(np.max(np.abs(b)))
        d = f32(amax * (f32(1) / f32(127)))
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            idv = f32(f32(127) / amax) if amax != 0 else f32(0)
        for i, v in enumerate(b):
            with np.errstate(invalid="ignore"):          # 0 * inf in a tiny block
                p = f32(v * idv)
            q = 0 if np.isnan(p) else int(min(max(np.rint(p), -127), 127))
            out[o + i] = f32(f32(q) * d)
    return out


def q8_k_reference(x):
    """Per-block loop, float32 scalars: first largest |x|, iscale = -127/m, d = m * fl(-1/127)."""
    x = np.asarray(x, np.float32)
    out = np.zeros_like(x)
    for o in range(0, x.size, 256):
        b = x[o:o + 256]
        amax, m = f32(0), f32(0)
        for v in b:
            if abs(v) > amax:
                amax, m = abs(v), v
        if amax == 0:
            continue
        with np.errstate(over="ignore"):
            iscale = f32(f32(-127) / m)
        d = f32(m * (f32(-1) / f32(127)))
        for i, v in enumerate(b):
            with np.errstate(invalid="ignore"):          # 0 * inf in a tiny block
                p = f32(iscale * v)
            q = 0 if np.isnan(p) else int(min(max(np.rint(p), -127), 127))
            out[o + i] = f32(f32(q) * d)
    return out


def test_q8_0_against_reference_loop():
    rng = np.random.default_rng(9)
    x = (rng.standard_normal(40 * 32 + 8) * np.repeat(np.exp(rng.uniform(-6, 6, 41)), 32)[:1288]).astype(np.float32)
    x[64:96] = 0                                     # all-zero block
    y = nm.q8_0_round(x)                             # 40 full blocks + a short block of 8
    assert same_bits(y, q8_0_reference(x))
    q, d = nm.q8_0_quantize(x)
    assert q.shape == (41, 32) and q.dtype == np.int8 and d.shape == (41,)
    assert np.all(q[-1, 8:] == 0) and np.all(q[2] == 0) and d[2] == 0


def test_q8_0_ties_round_half_even():
    b = np.zeros(32, np.float32)
    b[:8] = [127, 2.5, 3.5, -2.5, -0.5, 0.5, 1.5, -127]   # amax 127: id = 1, ties are exact
    q, d = nm.q8_0_quantize(b)
    assert d[0] == f32(127) * (f32(1) / f32(127))
    np.testing.assert_array_equal(q[0, :8], [127, 2, 4, -2, 0, 0, 2, -127])


def test_q8_0_fast_math_form_decides_a_crafted_tie():
    # amax = 1.4442534, x = 0.13077885.  With ds4's fast-math id = 127/amax, x * id is exactly
    # 11.5 in float32 -> RNE gives 12.  The literal source form (x * (1/d) with d = amax/127) or
    # x / d lands on 11.499999 -> 11.  ds4's build uses the first (README: "this decides exact ties").
    amax, x = f32(1.4442534), f32(0.13077885)
    id_fast = f32(127) / amax
    d_true = f32(amax / f32(127))
    assert f32(x * id_fast) == 11.5
    assert f32(x * f32(f32(1) / d_true)) < 11.5 and f32(x / d_true) < 11.5
    b = np.zeros(32, np.float32)
    b[0], b[1], b[2] = amax, x, -x
    q, d = nm.q8_0_quantize(b)
    assert q[0, 1] == 12 and q[0, 2] == -12 and q[0, 0] == 127
    assert same_bits(nm.q8_0_round(b), q8_0_reference(b))


def test_q8_k_against_reference_loop():
    rng = np.random.default_rng(10)
    x = (rng.standard_normal((2, 4, 256)) * np.exp(rng.uniform(-6, 6, (2, 4, 1)))).astype(np.float32)
    x[0, 1] = 0
    x[1, 2, 10], x[1, 2, 20] = -50.0, 50.0          # largest magnitude tie: the first (-50) is m
    y = nm.q8_k_round(x)
    assert same_bits(y, q8_k_reference(x.ravel()).reshape(x.shape))
    q, d = nm.q8_k_quantize(x)
    assert q.shape == (2, 4, 1, 256) and d.shape == (2, 4, 1)
    assert d[0, 1, 0] == 0 and not np.signbit(d[0, 1, 0]) and np.all(q[0, 1] == 0)
    assert not np.signbit(y[0, 1]).any()
    assert d[1, 2, 0] == f32(-50) * (f32(-1) / f32(127)) and d[1, 2, 0] > 0
    assert q[1, 2, 0, 10] == -127 and q[1, 2, 0, 20] == 127
    with pytest.raises(ValueError):
        nm.q8_k_round(np.zeros(100, np.float32))


def test_q8_k_scale_fast_math_form():
    # m = 1.2: the source's d = 1/iscale = 1/fl(-127/1.2) is -0.00944882, the fast-math build's
    # (1/-127)*m is -0.009448819 (one ulp apart); value of the maximum element = -127 * d
    b = np.zeros(256, np.float32)
    b[0] = f32(1.2)
    b[1] = f32(0.5)
    q, d = nm.q8_k_quantize(b)
    fast = f32(f32(1.2) * (f32(-1) / f32(127)))
    literal = f32(f32(1) / f32(f32(-127) / f32(1.2)))
    assert fast != literal and d[0] == fast
    assert q[0, 0] == -127 and q[0, 1] == int(np.rint(f32(f32(-127) / f32(1.2)) * f32(0.5)))
    assert nm.q8_k_round(b)[0] == f32(f32(-127) * fast)


def _tiny_block(n):
    """One block whose largest magnitude (2e-38) is below 127 / FLT_MAX ~ 3.7e-37, so 127 / amax
    overflows to inf: positives, negatives and zeros."""
    b = np.zeros(n, np.float32)
    b[0], b[1], b[2], b[5] = 2e-38, -2e-38, -1e-39, 3e-39
    return b


@pytest.mark.parametrize("quantize", [nm.q8_0_quantize, nm.q8_k_quantize], ids=["q8_0", "q8_k"])
def test_q8_codes_of_a_tiny_block_clamp_to_127_and_zeros_stay_0(quantize):
    # the decision: inf-scaled values clamp to +-127 (never -128: the C kernels move signs onto the
    # codes and offset them by 128), and 0 * inf = NaN gives code 0 (it was 127 for every zero)
    n = 32 if quantize is nm.q8_0_quantize else 256
    b = _tiny_block(n)
    q, d = quantize(b)
    q = q.reshape(-1)
    sign = 1 if quantize is nm.q8_0_quantize else -1        # Q8_K scales by -127 / m, m = 2e-38 here
    assert q[0] == 127 * sign and q[1] == -127 * sign and q[2] == -127 * sign and q[5] == 127 * sign
    assert np.all(np.delete(q, [0, 1, 2, 5]) == 0) and q.min() >= -127
    assert np.isfinite(d).all() and d[0] != 0
    ref = q8_0_reference(b) if n == 32 else q8_k_reference(b)
    rounded = nm.q8_0_round(b) if n == 32 else nm.q8_k_round(b)
    assert same_bits(rounded, ref)


@pytest.mark.parametrize("quantize", [nm.q8_0_quantize, nm.q8_k_quantize], ids=["q8_0", "q8_k"])
def test_q8_codes_of_a_nan_block_are_0(quantize):
    # a NaN in a block: its scale is NaN (the values stay NaN), every code of the block is 0,
    # the other blocks are untouched
    n = 32 if quantize is nm.q8_0_quantize else 256
    rng = np.random.default_rng(3)
    x = rng.standard_normal(2 * n).astype(np.float32)
    clean_q, clean_d = quantize(x)
    x[n + 7] = np.nan
    q, d = quantize(x)
    assert np.all(q[1] == 0) and np.isnan(d[1])
    assert np.array_equal(q[0], clean_q[0]) and d[0] == clean_d[0]


# ---------------------------------------------------------------------------
# RoPE


def test_rope_theta_scale_and_repeated_products():
    for base, want in ((10000.0, 0.749894202), (160000.0, 0.687656045)):
        th = nm.rope_thetas_ds4([1], 64, base)
        assert th[0, 0] == 1 and th[0, 1] == f32(want)
        ts = f32(want)
        th = nm.rope_thetas_ds4([7, 1000], 64, base)
        for r, p in enumerate((7, 1000)):
            acc = f32(p)
            for i in range(32):
                assert th[r, i] == acc
                acc = f32(acc * ts)


def test_rope_ds4_vs_exact_small_positions():
    pos = np.arange(16)
    for base, yarn in ((10000.0, None), (160000.0, YARN)):
        a = nm.rope_thetas_ds4(pos, 64, base, yarn=yarn)
        b = nm.rope_thetas_exact(pos, 64, base, yarn=yarn)
        assert a.shape == b.shape == (16, 32) and a.dtype == b.dtype == np.float32
        # pair p carries p float32 roundings of the repeated product
        np.testing.assert_allclose(a, b, rtol=40 * 2.0**-24, atol=0)
    exact = np.arange(16)[:, None] * 10000.0 ** (-np.arange(32) / 32)
    np.testing.assert_allclose(nm.rope_thetas_exact(np.arange(16), 64, 10000.0), exact, rtol=2.0**-22)


def test_rope_yarn_ramp():
    low, high = nm._ds4_yarn_corr_dims(64, 65536, 160000.0, 32, 1)
    assert (low, high) == (15, 25)
    pos = np.array([1, 5, 100, 4096, 65535])
    plain = nm.rope_thetas_ds4(pos, 64, 160000.0)
    for fn in (nm.rope_thetas_ds4, nm.rope_thetas_exact):
        y = fn(pos, 64, 160000.0, yarn=YARN)
        p = fn(pos, 64, 160000.0)
        assert same_bits(y[:, :16], p[:, :16])                  # pairs 0..15 unscaled
        assert same_bits(y[:, 25:], p[:, 25:] / f32(16))        # pairs 25..31 divided by 16
        r = np.clip((np.arange(32) - 15) / 10, 0, 1)
        want = p.astype(np.float64) * ((1 - r) + r / 16)
        np.testing.assert_allclose(y, want, rtol=4e-7)
    assert same_bits(nm.rope_thetas_ds4(pos, 64, 160000.0, yarn=YARN)[:, :16], plain[:, :16])


def test_rope_yarn_magnitude_factor_cancels_in_float32():
    # ds4 multiplies cos/sin by fl(1/k) * k with k = 1 + 0.1*ln(16); that is exactly 1.0f
    k = f32(f32(1) + f32(f32(0.1) * f32(math.log(16.0))))
    assert f32(f32(f32(1) / k) * k) == 1.0


def test_apply_rope_complex_rotation_inverse_and_untouched_head():
    rng = np.random.default_rng(11)
    T, H, W = 5, 3, 128
    pos = np.array([0, 1, 17, 300, 70000])
    th = nm.rope_thetas_ds4(pos, 64, 160000.0, yarn=YARN)
    x = rng.standard_normal((T, H, W)).astype(np.float32)
    y = nm.apply_rope(x, th)
    assert same_bits(y[..., :64], x[..., :64])
    z = (x[..., 64::2] + 1j * x[..., 65::2]).astype(np.complex128)
    rot = z * np.exp(1j * th.astype(np.float64))[:, None, :]
    np.testing.assert_allclose(y[..., 64::2], rot.real, atol=2e-6)
    np.testing.assert_allclose(y[..., 65::2], rot.imag, atol=2e-6)
    np.testing.assert_allclose(nm.apply_rope(y, th, inverse=True), x, atol=1e-6)
    # position 0 is the identity
    assert same_bits(y[0], x[0])
    # broadcasting: [T, P] thetas line up with the leading axis of [T, H, W]; [P] applies to all
    for h in range(H):
        assert same_bits(y[:, h], nm.apply_rope(x[:, h], th))
    assert same_bits(nm.apply_rope(x[3], th[3]), y[3])
    with pytest.raises(ValueError):
        nm.apply_rope(x, th[:4])


def test_apply_rope_float32_operation_order():
    # t0' = t0*c - t1*s, t1' = t0*s + t1*c, each product and sum rounded to float32,
    # c/s the float32 roundings of cos/sin of the float32 angle
    rng = np.random.default_rng(12)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    th = nm.rope_thetas_ds4([3, 50, 999, 123456], 64, 10000.0)
    c = np.cos(th.astype(np.float64)).astype(np.float32)
    s = np.sin(th.astype(np.float64)).astype(np.float32)
    want = np.empty_like(x)
    want[:, 0::2] = x[:, 0::2] * c - x[:, 1::2] * s
    want[:, 1::2] = x[:, 0::2] * s + x[:, 1::2] * c
    assert same_bits(nm.apply_rope(x, th), want)
    wanti = np.empty_like(x)
    wanti[:, 0::2] = x[:, 0::2] * c - x[:, 1::2] * (-s)
    wanti[:, 1::2] = x[:, 0::2] * (-s) + x[:, 1::2] * c
    assert same_bits(nm.apply_rope(x, th, inverse=True), wanti)
