"""The integer kernels compute the NumPy reference's Q8 matmuls bit for bit (issue 22; issue 33).

That function is NumpyOps("ds4")'s default (q8_dot="ds4"): ds4's own dot products
(model/ds4_matmul.py, from ds4.c's dot_q8_0_row / ds4_vec_dot_{iq2_xxs,q2_K}_q8_K): exact integer
dots per block, each times the float32 product of the weight and activation scales, added in
float32 in block order (Q2_K: one FMA per block with the minimums). Every build (portable, AVX2,
AVX-512, VBMI), every form (row kernels, GEMM), every token count must equal it with no exception,
and these cases tell the orders apart: the exact sum rounded once (q8_dot="exact", what the kernels
computed before issue 33) or the blocks summed in reverse order miss it at many outputs.

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
from engine.model import ds4_matmul as D
from engine.model import numerics as N

from test_kernels import isa_guard, needs_ext, weights  # noqa: F401 (fixture)

Q8_TYPES = [Q.Q8_0, Q.IQ2_XXS, Q.Q2_K]
NAMES = {t: Q.FORMATS[t].name for t in Q8_TYPES}
# (rows, n_in, T): decode, a few tokens, the row kernels' 8-token pass, a prefill chunk, odd shapes
# around the GEMM panels (AVX-512 16 / 32 rows, AVX2 8 / 16) and tiles (4 / 2 tokens)
SHAPES = [(37, 4096, 1), (50, 1024, 3), (33, 2048, 8), (17, 512, 64), (1, 256, 5), (15, 768, 9), (300, 2048, 2),
          (5, 2560, 1)]


def _reference(ref: NumpyOps, t: int, w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The reference's own op: linear for a Q8_0 weight, expert_act + expert_linear for the experts."""
    qt = SimpleNamespace(type_id=t, data=w)
    if t == Q.Q8_0:
        return ref.linear(qt, x)
    return ref.expert_linear(qt, ref.expert_act(qt, x))


def _forms(C, t):
    """(label, GEMM minimum) of each form a build has for t: the row kernels at every T, and the
    GEMM form at every T where the build has one."""
    C.q8_gemm_min_t(t, 0)
    yield "row", 10**6
    if K.q8_gemm_min_t(t):
        yield "gemm", 1


def _cases(t, rng, shapes, ref):
    cases = []
    for n_rows, n_in, T in shapes:
        w = weights(t, rng, n_rows, n_in)
        x = (rng.standard_normal((T, n_in)) * rng.choice([0.01, 1.0, 30.0], (T, 1))).astype(np.float32)
        x[0, :32] = 0.0                                      # an all-zero activation block
        cases.append((w, x, _reference(ref, t, w, x)))
    return cases


def _differing(cases, fn) -> tuple:
    """(outputs differing from the reference in their bits, outputs) of fn(w, x) over the cases."""
    n = diff = 0
    for w, x, want in cases:
        got = fn(w, x)
        assert got.shape == want.shape
        n, diff = n + got.size, diff + int((got.view(np.uint32) != want.view(np.uint32)).sum())
    return diff, n


@needs_ext
@pytest.mark.parametrize("t", Q8_TYPES, ids=NAMES.get)
def test_integer_kernels_equal_the_reference_bit_for_bit(t, isa_guard):
    C = isa_guard
    cases = _cases(t, np.random.default_rng(700 + t), SHAPES, NumpyOps("ds4"))
    report = []
    try:
        for isa in C.isas():
            C.set_isa(isa)
            for form, gemm_min in list(_forms(C, t)):
                C.q8_gemm_min_t(t, gemm_min)
                diff, n = _differing(cases, lambda w, x: K.matmul_q8(t, w, x))
                report.append(f"{isa}/{form} {diff} of {n}")
                assert diff == 0, (isa, form, diff, n)
    finally:
        C.q8_gemm_min_t(t, 0)
    print(f"\n{NAMES[t]}: values differing from the reference: " + ", ".join(report))


def _reversed_blocks(t: int, w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """ds4_matmul's function with the blocks added in reverse order (weights and codes reversed)."""
    blocks = np.asarray(w).reshape(w.shape[0], -1, Q.FORMATS[t].block_bytes)
    rev = np.ascontiguousarray(blocks[:, ::-1]).reshape(w.shape)
    a = D.q8_0_act(x) if t == Q.Q8_0 else D.q8_k_act(x)
    a = D.Q8Act(np.ascontiguousarray(a.q[:, ::-1]), np.ascontiguousarray(a.d[:, ::-1]))
    return D.q8_0_matmul(rev, a) if t == Q.Q8_0 else D.q8_k_matmul(t, rev, a)


@pytest.mark.parametrize("t", Q8_TYPES, ids=NAMES.get)
def test_the_cases_tell_summation_orders_apart(t):
    """A kernel that summed in another order would fail the test above: on its cases the exact sum
    rounded once (the kernels' function before issue 33) and the same block products added in
    reverse order each miss the reference at many outputs."""
    cases = _cases(t, np.random.default_rng(700 + t), SHAPES, NumpyOps("ds4"))
    exact = NumpyOps("ds4", q8_dot="exact")
    d_exact, n = _differing(cases, lambda w, x: _reference(exact, t, w, x))
    d_rev, _ = _differing(cases, lambda w, x: _reversed_blocks(t, w, x))
    print(f"\n{NAMES[t]}: of {n} outputs the exact sum misses {d_exact}, the reversed block order {d_rev}")
    assert d_exact > n // 20 and d_rev > n // 20


@needs_ext
def test_cpu_ops_q8_paths_equal_the_reference_ops(isa_guard):
    """CpuOps in ds4 numerics takes the integer kernels at every T (the float kernels over the
    rounded activations would compute another function): its Q8_0 linear and its expert matmuls
    equal NumpyOps' bit for bit, at 1, 5 and 40 tokens, on the build this machine selects."""
    from engine.backends.cpu.ops import CpuOps
    cpu, ref = CpuOps("ds4"), NumpyOps("ds4")
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
@pytest.mark.slow
@pytest.mark.parametrize("t", Q8_TYPES, ids=NAMES.get)
def test_integer_kernels_equal_the_reference_on_a_million_outputs(t, isa_guard):
    """About a million outputs a form on the build this machine selects (row kernels and GEMM form
    at 64 tokens, the one-token rows): not one differs from the reference (slow: the reference's
    block-order loop takes 10-30 s a format on a loaded 2-core machine)."""
    C = isa_guard
    ref = NumpyOps("ds4")
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
                    n, diff = n + got.size, diff + int((got.view(np.uint32) != exp.view(np.uint32)).sum())
            report.append(f"{form} {diff} of {n}")
            assert diff == 0, (form, diff, n)
    finally:
        C.q8_gemm_min_t(t, 0)
    print(f"\n{NAMES[t]} ({K.isa()}): values differing from the reference: " + ", ".join(report))
