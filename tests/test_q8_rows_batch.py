"""Issue 23: the Q8_0 row kernels at T = 1..8 tokens (a batched decode step's rows) and the F16
in-register path at 4 tokens.

The AVX-512 Q8_0 row kernel sums 8 blocks' integer dots across registers, then adds their 8
products with the scales in block order; every build's row kernel must still be the reference's
function (NumpyOps in ds4 numerics: ds4's float32 block sums, model/ds4_matmul.py) bit for bit at
every T, on row lengths that are and are not multiples of 8 blocks, with the codes' edge values
(-128 weights, zero blocks, tiny and huge activation scales); and a token's result must not depend
on how many tokens share the call (each token's sums run in the same order at every T).
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from engine.backends.cpu import kernels as K
from engine.backends.numpy.ops import NumpyOps
from engine.gguf import quants as Q

from test_kernels import isa_guard, needs_ext, weights  # noqa: F401 (fixture)

# (rows, n_in): whole 8-block groups, a group plus a tail, a tail alone, one block, a head-sized row
SHAPES = [(19, 1024), (13, 288), (7, 224), (5, 32), (9, 4096 + 96)]


def _edge_weights(rng, n_rows, n_in):
    """Q8_0 rows with -128 codes, all-zero blocks and a zero scale among the random ones."""
    w = weights(Q.Q8_0, rng, n_rows, n_in).copy()
    blocks = w.reshape(-1, 34)
    codes = blocks[:, 2:].view(np.int8)
    codes[::3, ::5] = -128                                     # |w| = 128 as the unsigned operand
    codes[1::7, :] = 0                                         # an all-zero block
    blocks[2::11, 0:2] = 0                                     # scale +0
    return w


def _x(rng, T, n_in):
    x = (rng.standard_normal((T, n_in)) * rng.choice([1e-3, 1.0, 40.0], (T, 1))).astype(np.float32)
    x[0, :32] = 0.0                                            # an all-zero activation block
    if n_in >= 64:
        x[T - 1, 32:64] *= np.float32(1e-30)                   # a tiny block scale
    return x


@needs_ext
def test_q8_0_rows_equal_the_reference_at_every_t_on_every_build(isa_guard):
    C = isa_guard
    ref = NumpyOps("ds4")                     # ds4's block order, which the integer kernels compute (issue 33)
    rng = np.random.default_rng(2301)
    cases = []
    for n_rows, n_in in SHAPES:
        w = _edge_weights(rng, n_rows, n_in)
        x = _x(rng, 8, n_in)
        cases.append((w, x, ref.linear(SimpleNamespace(type_id=Q.Q8_0, data=w), x)))
    try:
        C.q8_gemm_min_t(Q.Q8_0, 10**6)                         # the row kernels at every T
        for isa in C.isas():
            C.set_isa(isa)
            for w, x, want in cases:
                for T in range(1, 9):
                    got = K.matmul_q8(Q.Q8_0, w, np.ascontiguousarray(x[:T]))
                    # the reference rows are the tokens' own: a token's result whatever T
                    ne = got.view(np.uint32) != want[:T].view(np.uint32)
                    assert not ne.any(), (isa, w.shape, T, int(ne.sum()))
    finally:
        C.q8_gemm_min_t(Q.Q8_0, 0)                             # each build's default


@needs_ext
def test_q8_0_rows_past_one_pass_and_in_batches(isa_guard):
    """9-16 tokens take two passes of the row kernel; a batched call (several products, one
    parallel region, two threads) gives each product what it gives alone."""
    C = isa_guard
    rng = np.random.default_rng(2302)
    w1, w2 = _edge_weights(rng, 40, 2048), _edge_weights(rng, 24, 512)
    x1, x2 = _x(rng, 16, 2048), _x(rng, 3, 512)
    try:
        C.q8_gemm_min_t(Q.Q8_0, 10**6)
        for isa in C.isas():
            C.set_isa(isa)
            one = np.concatenate([K.matmul_q8(Q.Q8_0, w1, np.ascontiguousarray(x1[t:t + 1])) for t in range(16)])
            for T in (9, 13, 16):
                assert np.array_equal(K.matmul_q8(Q.Q8_0, w1, np.ascontiguousarray(x1[:T])).view(np.uint32),
                                      one[:T].view(np.uint32)), (isa, T)
            C.set_threads(2)
            y1, y2 = K.matmul_q8_batch(Q.Q8_0, [w1, w2], [x1[:5].copy(), x2])
            assert np.array_equal(y1.view(np.uint32), one[:5].view(np.uint32)), isa
            assert np.array_equal(y2.view(np.uint32), K.matmul_q8(Q.Q8_0, w2, x2).view(np.uint32)), isa
            C.set_threads(1)
    finally:
        C.q8_gemm_min_t(Q.Q8_0, 0)                             # each build's default


@needs_ext
@pytest.mark.parametrize("T", [2, 3, 4, 5])
def test_f16_few_tokens_equal_the_reference(T, isa_guard):
    """F16 weights at a batched decode step's token counts (the AVX-512 build takes 4 tokens in
    registers, not the panel): every path is the reference's float64 sum rounded once."""
    C = isa_guard
    rng = np.random.default_rng(2303 + T)
    w = weights(Q.F16, rng, 37, 1024)
    x = rng.standard_normal((T, 1024)).astype(np.float32)
    want = Q.matvec(Q.F16, w, x.T, accumulate=np.float64).T
    for isa in C.isas():
        C.set_isa(isa)
        for method in ("auto", "regs", "panel"):
            got = K.matmul(Q.F16, w, x, method=method)
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (isa, method, T)
