"""The C attention's register tiles (issue 22: 8 heads a tile on AVX-512, 4 on AVX2) and its units
of 8 or 16 heads (ops.c picks by T and threads) leave every value's float64 sum in the order it
always had. So the output does not depend on how many heads a call takes or how the units fall
over the threads, bit for bit, and it is the reference's (tests/test_cpu_f64.py's allowance: one
ulp at no more than 1 value in 10^5).

The shapes are the ones the tiles can get wrong: the model's 64 heads (several tiles a unit), head
counts that leave a part tile (padding heads whose results must be dropped), key counts that leave
a part key tile, and D with a tail past the 16-value and 8-value loops.
"""
from __future__ import annotations

import numpy as np
import pytest

from engine.backends.cpu import kernels as K
from engine.backends.numpy.ops import NumpyOps

pytestmark = pytest.mark.skipif(not K.available(), reason="engine.backends.cpu._kernels is not built")

REF = NumpyOps("ds4")


@pytest.fixture
def C():
    from engine.backends.cpu import _kernels
    prev_isa, prev_thr = _kernels.isa(), _kernels.get_threads()
    yield _kernels
    _kernels.set_isa(prev_isa)
    _kernels.set_threads(prev_thr)


def _case(T, H, D, n, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((T, H, D)).astype(np.float32) * 2
    sinks = rng.standard_normal(H).astype(np.float32)
    keys = rng.standard_normal((n, D)).astype(np.float32)
    mask = rng.random((T, n)) < 0.7
    kq = rng.standard_normal((T, 5, D)).astype(np.float32)
    mq = rng.random((T, 5)) < 0.8
    return q, [(keys, mask), (kq, mq)], sinks, float(D) ** -0.5


def _ulps(got, ref):
    return np.abs(got.view(np.int32).astype(np.int64) - ref.view(np.int32).astype(np.int64))


@pytest.mark.parametrize("T,H,D,n", [(1, 64, 512, 131), (2, 20, 72, 33), (3, 13, 515, 150), (1, 9, 24, 1)])
def test_attention_units_and_tiles_keep_the_bits(C, T, H, D, n):
    q, segs, sinks, scale = _case(T, H, D, n, seed=T * 7919 + H * 31 + D)
    ref = REF.attention(q, segs, sinks, scale)
    ran = 0
    for isa in C.isas():
        C.set_isa(isa)
        if not C.has_attention():
            continue
        outs = []
        # 1 thread: units of 16 heads; 32 threads: units of 8 (too few units of 16 to share)
        for threads in (1, 2, 32):
            C.set_threads(threads)
            outs.append(K.attention(q, segs, sinks, scale))
        for got in outs[1:]:
            assert np.array_equal(got.view(np.int32), outs[0].view(np.int32)), (isa, T, H, D, n)
        d = _ulps(outs[0], ref)
        assert d.max(initial=0) <= 1 and np.count_nonzero(d) <= outs[0].size // 100_000, (isa, int(np.count_nonzero(d)))
        ran += 1
    if ran == 0:
        pytest.skip("no build here has the attention kernel")


def test_attention_heads_split_over_calls_equal_one_call(C):
    """A query's heads in one call or in slices (one call per head group): the same bits, so a
    head's result depends on nothing but its own query, keys and sink."""
    q, segs, sinks, scale = _case(2, 24, 128, 70, seed=5)
    for isa in C.isas():
        C.set_isa(isa)
        if not C.has_attention():
            continue
        C.set_threads(1)
        whole = K.attention(q, segs, sinks, scale)
        for h0, h1 in ((0, 3), (3, 11), (11, 24)):
            part = K.attention(np.ascontiguousarray(q[:, h0:h1]), segs, sinks[h0:h1], scale)
            assert np.array_equal(part.view(np.int32), whole[:, h0:h1].view(np.int32)), (isa, h0, h1)
