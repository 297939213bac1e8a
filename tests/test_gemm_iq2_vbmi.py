"""The VBMI build's IQ2_XXS and Q2_K GEMM forms (kern_iq2_vbmi.h) decode straight into their panels
in the row kernels' orders, with the activations arranged to match once a job:
- IQ2_XXS (g_pack_iq2v, g_tile_iq2u): code-byte order, the weights as w + 64 against signed codes
  (iq2v_gemm_arrange) and 64 * sum(x) of each group taken off from the Q8_K block sums;
- Q2_K (g_pack_q2kv): the pair order of q2k_pair_x, codes times sub-block scale by one vpermb.
Both must give the plain AVX-512 build's GEMM (value order) bit for bit: the same exact integer
group / block sums, scales and float64 multiply-adds.  Covered: rows around the
16 / 32-row panels, several blocks, odd T around the 4-token tiles, and batches that mix weight
types, forms (row kernels and GEMM) and shared inputs (gate / up read one x)."""
from __future__ import annotations

import numpy as np
import pytest

from engine.backends.cpu import kernels as K
from engine.gguf import quants as Q
from test_kernels import isa_guard, needs_ext, weights  # noqa: F401 (fixture)

IQ2 = Q.IQ2_XXS


def _builds(C) -> None:
    if not {"avx512", "avx512vbmi"} <= set(C.isas()):
        pytest.skip("needs a CPU with AVX-512 VNNI and VBMI + GFNI")


def _run(C, isa: str, gemm_min: dict, fn):
    """fn() on build isa with the GEMM form from gemm_min[type] tokens (restored after)."""
    C.set_isa(isa)
    try:
        for t, m in gemm_min.items():
            C.q8_gemm_min_t(t, m)
        return fn()
    finally:
        for t in gemm_min:
            C.q8_gemm_min_t(t, 0)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@needs_ext
@pytest.mark.parametrize("t", [IQ2, Q.Q2_K], ids=["IQ2_XXS", "Q2_K"])
@pytest.mark.parametrize("rows,n_in", [(1, 256), (7, 512), (16, 256), (17, 768), (33, 1024), (50, 2048)])
def test_vbmi_gemm_equals_value_order_gemm(t, rows, n_in, isa_guard):
    C = isa_guard
    _builds(C)
    rng = np.random.default_rng(rows * 1000 + n_in)
    w = weights(t, rng, rows, n_in)
    for T in (1, 2, 3, 5, 9, 14):
        x = (rng.standard_normal((T, n_in)) * rng.choice([0.01, 1.0, 30.0], (T, 1))).astype(np.float32)
        x[0, :64] = 0.0                                       # an all-zero group pair (its block sums: 0)
        want = _run(C, "avx512", {t: 1}, lambda: K.matmul_q8(t, w, x))
        got = _run(C, "avx512vbmi", {t: 1}, lambda: K.matmul_q8(t, w, x))
        assert _same_bits(got, want), (rows, n_in, T)


@needs_ext
@pytest.mark.parametrize("t", [IQ2, Q.Q2_K], ids=["IQ2_XXS", "Q2_K"])
def test_vbmi_gemm_extreme_codes(t, isa_guard):
    """Activations at +-127 everywhere: the IQ2_XXS w + 64 products and the 64 * sum(x)
    correction, the Q2_K products of the largest sub-block scales, stay exact in int32 (and match
    the value-order form)."""
    C = isa_guard
    _builds(C)
    rng = np.random.default_rng(3)
    w = weights(t, rng, 40, 1024, std=1.0)
    if t == Q.Q2_K:                                                            # scales and minimums 15
        w.reshape(-1, 84)[:5, :16] = 0xFF
    x = np.where(rng.random((6, 1024)) < 0.5, -1.0, 1.0).astype(np.float32)   # every code +-127
    x[1] = 1.0                                                                 # all +127
    x[2] = -1.0                                                                # all -127
    want = _run(C, "avx512", {t: 1}, lambda: K.matmul_q8(t, w, x))
    got = _run(C, "avx512vbmi", {t: 1}, lambda: K.matmul_q8(t, w, x))
    assert _same_bits(got, want)


@needs_ext
@pytest.mark.parametrize("threads", [1, 2])
def test_mixed_batch_of_forms_and_types(threads, isa_guard):
    """One batch call: the routed experts' gate and up (IQ2_XXS, one x: arranged once, shared), an
    IQ2_XXS expert below the GEMM minimum (row kernels, their own order), an odd-T one in GEMM
    form, Q2_K downs in both forms (one x: the row kernels' and the GEMM's copies of the arranged
    codes are separate) and a Q8_0 shared expert. Each output equals the same product computed
    alone on the plain AVX-512 build, bit for bit."""
    C = isa_guard
    _builds(C)
    C.set_threads(threads)
    rng = np.random.default_rng(11 + threads)
    x_gu = rng.standard_normal((7, 512)).astype(np.float32)
    x_few = rng.standard_normal((2, 512)).astype(np.float32)
    x_odd = rng.standard_normal((11, 768)).astype(np.float32)
    x_dn = rng.standard_normal((5, 256)).astype(np.float32)
    x_sh = rng.standard_normal((9, 320)).astype(np.float32)
    jobs = [(IQ2, weights(IQ2, rng, 48, 512), x_gu), (IQ2, weights(IQ2, rng, 48, 512), x_gu),
            (IQ2, weights(IQ2, rng, 21, 512), x_few), (IQ2, weights(IQ2, rng, 35, 768), x_odd),
            (Q.Q2_K, weights(Q.Q2_K, rng, 512, 256), x_dn), (Q.Q2_K, weights(Q.Q2_K, rng, 37, 512), x_few),
            (Q.Q2_K, weights(Q.Q2_K, rng, 21, 512), x_few), (Q.Q8_0, weights(Q.Q8_0, rng, 19, 320), x_sh),
            (Q.Q2_K, weights(Q.Q2_K, rng, 24, 768), x_odd)]   # GEMM on IQ2_XXS's x: its own arrangement
    mins = {IQ2: 3, Q.Q2_K: 3, Q.Q8_0: 1}
    want = [_run(C, "avx512", mins, lambda t=t, w=w, x=x: K.matmul_q8(t, w, x)) for t, w, x in jobs]
    got = _run(C, "avx512vbmi", mins, lambda: K.matmul_q8_mixed(*zip(*jobs)))
    for i, (g, e) in enumerate(zip(got, want)):
        assert _same_bits(g, e), i
