"""The integer kernels compute the NumPy reference's exact-sum function, bit for bit (issue 22, part 1).

That function is NumpyOps("ds4", q8_dot="exact"). The reference's default (q8_dot="ds4", issue 33)
is ds4's own: float32 block sums in ds4's order (model/ds4_matmul.py), which the kernels do not
follow yet (docs/numerics.md says how far apart the two are).

In ds4 numerics the reference multiplies the exact Q8 activations (code * scale in float64,
numerics.q8_*_exact) by the exactly decoded weights in float64 and rounds once; the kernels take
exact integer dots per block, apply (double) d_w * d_x (exact) and sum the blocks in float64, then
round once. Both are the exact sum rounded to float32 but for the float64 rounding inside the sums,
which moves a float32 result only when the exact value lies within ~1e-16 relative of a float32
rounding boundary: about 2^-29 of values. So every build (portable, AVX2, AVX-512, VBMI), every
form (row kernels, GEMM), every token count must agree with the reference's own ops bit for bit,
but for at most a handful of one-ulp differences per million outputs (counted and printed).

Also here: the float64 decode of the formats whose float32 decode may round (Q2_K, Q4_K: a
minimum subtracted from a product of another exponent) is exact.
"""
from __future__ import annotations

from fractions import Fraction
from types import SimpleNamespace

import numpy as np
import pytest

from engine.backends.cpu import kernels as K
from engine.backends.numpy.ops import NumpyOps
from engine.gguf import quants as Q
from engine.model import numerics as N

from test_kernels import isa_guard, needs_ext, weights  # noqa: F401 (fixture)

Q8_TYPES = [Q.Q8_0, Q.IQ2_XXS, Q.Q2_K]
NAMES = {t: Q.FORMATS[t].name for t in Q8_TYPES}
# (rows, n_in, T): decode, a few tokens, the row kernels' 8-token pass, a prefill chunk, odd shapes
# around the GEMM panels (AVX-512 16 / 32 rows, AVX2 8 / 16) and tiles (4 / 2 tokens)
SHAPES = [(37, 4096, 1), (50, 1024, 3), (33, 2048, 8), (17, 512, 64), (1, 256, 5), (15, 768, 9), (300, 2048, 2)]
ALLOWED_PER_MILLION = 5


def _reference(ref: NumpyOps, t: int, w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The reference's own op: linear for a Q8_0 weight, expert_act + expert_linear for the experts."""
    qt = SimpleNamespace(type_id=t, data=w)
    if t == Q.Q8_0:
        return ref.linear(qt, x)
    return ref.expert_linear(qt, ref.expert_act(qt, x))


def _ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Distance in float32 steps (same-sign finite values; zeros and signs compared exactly)."""
    ia, ib = a.view(np.int32).astype(np.int64), b.view(np.int32).astype(np.int64)
    return np.where(np.sign(a) == np.sign(b), np.abs(ia - ib), np.int64(1) << 40)


def _forms(C, t):
    """(label, GEMM minimum) of each form a build has for t: the row kernels at every T, and the
    GEMM form at every T where the build has one."""
    C.q8_gemm_min_t(t, 0)
    yield "row", 10**6
    if K.q8_gemm_min_t(t):
        yield "gemm", 1


@needs_ext
@pytest.mark.parametrize("t", Q8_TYPES, ids=NAMES.get)
def test_integer_kernels_equal_the_exact_reference(t, isa_guard):
    C = isa_guard
    ref = NumpyOps("ds4", q8_dot="exact")
    rng = np.random.default_rng(700 + t)
    cases = []
    for n_rows, n_in, T in SHAPES:
        w = weights(t, rng, n_rows, n_in)
        x = (rng.standard_normal((T, n_in)) * rng.choice([0.01, 1.0, 30.0], (T, 1))).astype(np.float32)
        x[0, :32] = 0.0                                      # an all-zero activation block
        cases.append((w, x, _reference(ref, t, w, x)))
    report = []
    try:
        for isa in C.isas():
            C.set_isa(isa)
            for form, gemm_min in list(_forms(C, t)):
                C.q8_gemm_min_t(t, gemm_min)
                n = diff = 0
                for w, x, want in cases:
                    got = K.matmul_q8(t, w, x)
                    assert got.shape == want.shape
                    ne = got.view(np.uint32) != want.view(np.uint32)
                    assert (_ulps(got[ne], want[ne]) <= 1).all(), (isa, form, w.shape, x.shape)
                    n, diff = n + got.size, diff + int(ne.sum())
                report.append(f"{isa}/{form} {diff} of {n}")
                assert diff <= max(1, ALLOWED_PER_MILLION * n // 10**6), (isa, form, diff, n)
    finally:
        C.q8_gemm_min_t(t, 0)
    print(f"\n{NAMES[t]}: values differing from the reference (1 ulp each): " + ", ".join(report))


@needs_ext
def test_cpu_ops_q8_paths_equal_the_reference_ops(isa_guard):
    """CpuOps in ds4 numerics takes the integer kernels at every T (the float kernels over the
    rounded activations would compute another function): its Q8_0 linear and its expert matmuls
    equal NumpyOps' bit for bit, at 1, 5 and 40 tokens, on the build this machine selects."""
    from engine.backends.cpu.ops import CpuOps
    cpu, ref = CpuOps("ds4"), NumpyOps("ds4", q8_dot="exact")
    rng = np.random.default_rng(710)
    for t in Q8_TYPES:
        w = SimpleNamespace(type_id=t, data=weights(t, rng, 48, 1024))
        for T in (1, 5, 40):
            x = rng.standard_normal((T, 1024)).astype(np.float32)
            if t == Q.Q8_0:
                got, want = cpu.linear(w, x), ref.linear(w, x)
            else:
                got = cpu.expert_linear(w, cpu.expert_act(w, x))
                want = ref.expert_linear(w, ref.expert_act(w, x))
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (NAMES[t], T)


def test_exact_activations_are_the_codes_times_the_scales():
    rng = np.random.default_rng(720)
    x = (rng.standard_normal((3, 512)) * 7).astype(np.float32)
    for exact, quant, rounded in ((N.q8_0_exact, N.q8_0_quantize, N.q8_0_round),
                                  (N.q8_k_exact, N.q8_k_quantize, N.q8_k_round)):
        q, d = quant(x)
        e = exact(x)
        assert e.dtype == np.float64 and e.shape == x.shape
        assert np.array_equal(e.reshape(q.shape), q.astype(np.float64) * d.astype(np.float64)[..., None])
        assert np.array_equal(e.astype(np.float32), rounded(x))          # float32 rounds the same value
        assert not np.array_equal(e, rounded(x).astype(np.float64))      # ... and float32 does round it
    # a short last Q8_0 block (zero-padded) as q8_0_round has it
    assert N.q8_0_exact(x[:, :40]).shape == (3, 40)
    assert np.array_equal(N.q8_0_exact(x[:, :40]).astype(np.float32), N.q8_0_round(x[:, :40]))


def _exact_k_values(t: int, blocks: np.ndarray) -> list:
    """The exact values of Q2_K / Q4_K blocks as Fractions, from the format's definition."""
    out = []
    for b in blocks:
        if t == Q.Q2_K:
            d, dmin = (Fraction(float(v)) for v in b[80:84].view(np.float16))
            for e in range(256):
                h, j, l = e >> 7, (e >> 5) & 3, e & 31
                q = (int(b[16 + 32 * h + l]) >> (2 * j)) & 3
                sc = int(b[e >> 4])
                out.append(d * (sc & 15) * q - dmin * (sc >> 4))
        else:
            d, dmin = (Fraction(float(v)) for v in b[0:4].view(np.float16))
            sc, mn = Q._q4_k_scale_min(b[None, 4:16])
            for e in range(256):
                p, h, l = e >> 6, (e >> 5) & 1, e & 31
                q = (int(b[16 + 32 * p + l]) >> (4 * h)) & 15
                out.append(d * int(sc[0, e >> 5]) * q - dmin * int(mn[0, e >> 5]))
    return out


@pytest.mark.parametrize("t", [Q.Q2_K, Q.Q4_K], ids=lambda t: Q.FORMATS[t].name)
def test_float64_decode_is_exact_where_float32_rounds(t):
    rng = np.random.default_rng(730 + t)
    blocks = Q.random_blocks(t, rng, 6, 0.05).reshape(6, -1).copy()
    # scales far apart (d = 1, dmin = 2^-14 + 2^-24): d * sc * q - dmin * m needs more than 24 bits
    dpos, mpos = (80, 82) if t == Q.Q2_K else (0, 2)
    blocks[:3, dpos:dpos + 2] = np.array([1.0], np.float16).view(np.uint8)
    blocks[:3, mpos:mpos + 2] = np.array([2.0**-14 + 2.0**-24], np.float16).view(np.uint8)
    exact = np.array([float(v) for v in _exact_k_values(t, blocks)])
    got64 = Q.dequantize(t, blocks, np.float64).reshape(-1)
    got32 = Q.dequantize(t, blocks).reshape(-1)
    assert np.array_equal(got64, exact)                                    # every value exact
    assert not np.array_equal(got32.astype(np.float64), exact)            # float32 rounds some
    assert np.array_equal(got32, Q.dequantize(t, blocks, np.float32).reshape(-1))
    # the other formats' float64 decode is their float32 one, widened (exact already)
    for other in (Q.Q8_0, Q.IQ2_XXS, Q.MXFP4):
        w = Q.random_blocks(other, rng, 8, 0.05)
        assert np.array_equal(Q.dequantize(other, w, np.float64), Q.dequantize(other, w).astype(np.float64))
    with pytest.raises(ValueError, match="dtype"):
        Q.dequantize(t, blocks, np.float16)


@needs_ext
@pytest.mark.parametrize("t", Q8_TYPES, ids=NAMES.get)
def test_integer_kernels_equal_the_exact_reference_per_million(t, isa_guard):
    """The rate itself: about a million outputs a form on the build this machine selects (row
    kernels and GEMM form at 64 tokens, the one-token rows), at most ALLOWED_PER_MILLION one-ulp
    differences (3-4 s a format on 2 cores; 0 differences of 1,064,960 per form when written)."""
    C = isa_guard
    ref = NumpyOps("ds4", q8_dot="exact")
    rng = np.random.default_rng(740 + t)
    cases = []
    for _ in range(4):
        w = weights(t, rng, 4096, 2048)
        x = (rng.standard_normal((64, 2048)) * rng.choice([0.01, 1.0, 30.0], (64, 1))).astype(np.float32)
        cases.append((w, x, _reference(ref, t, w, x)))
    report = []
    try:
        for form, gemm_min in list(_forms(C, t)):
            C.q8_gemm_min_t(t, gemm_min)
            n = diff = 0
            for w, x, want in cases:
                for got, exp in ((K.matmul_q8(t, w, x), want), (K.matmul_q8(t, w, x[:1]), want[:1])):
                    ne = got.view(np.uint32) != exp.view(np.uint32)
                    assert (_ulps(got[ne], exp[ne]) <= 1).all(), form
                    n, diff = n + got.size, diff + int(ne.sum())
            report.append(f"{form} {diff} of {n}")
            assert diff <= ALLOWED_PER_MILLION * n // 10**6 + 1, (form, diff, n)
    finally:
        C.q8_gemm_min_t(t, 0)
    print(f"\n{NAMES[t]} ({K.isa()}): values differing from the reference (1 ulp each): " + ", ".join(report))
