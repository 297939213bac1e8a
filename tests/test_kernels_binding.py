"""The C module's argument checks (csrc/binding.c): each bad call is a ValueError naming the
problem, and the buffers a refused call had taken are released (a held buffer keeps a reference
to its array: the arrays' reference counts come back to what they were)."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from engine.backends.cpu import kernels as K
from engine.gguf import quants as Q

pytestmark = pytest.mark.skipif(not K.available(), reason="engine.backends.cpu._kernels is not built")


def _C():
    from engine.backends.cpu import _kernels
    return _kernels


def _q8_weights(rng, rows, n_in):
    return Q.random_blocks(Q.Q8_0, rng, rows * n_in // 32, 0.05).reshape(rows, -1)


def test_matmul_q8_batch_refuses_each_bad_product_and_releases_what_it_held():
    C, rng = _C(), np.random.default_rng(3)
    w = _q8_weights(rng, 16, 64)
    x = rng.standard_normal((1, 64)).astype(np.float32)
    y = np.empty((1, 16), np.float32)
    refs = [sys.getrefcount(a) for a in (w, x, y)]
    with pytest.raises(ValueError, match="xs has 32 columns, product 0 takes 64"):
        C.matmul_q8_batch(Q.Q8_0, [w], np.zeros((1, 32), np.float32), np.empty((1, 16), np.float32))
    with pytest.raises(ValueError, match="ys as one array takes one token"):
        C.matmul_q8_batch(Q.Q8_0, [w], [np.zeros((2, 64), np.float32)], np.empty((1, 16), np.float32))
    with pytest.raises(ValueError, match="no integer-activation kernel for ggml type 0"):
        C.matmul_q8_batch(Q.F32, [w], [x], [y])
    with pytest.raises(ValueError, match="unsupported ggml type 7"):
        C.matmul_q8_batch([Q.Q8_0, 7], [w, w], [x, x], [y, y.copy()])
    with pytest.raises(ValueError, match="y has shape"):
        C.matmul_q8_batch(Q.Q8_0, [w, w], [x, x], [y, np.empty((1, 8), np.float32)])
    with pytest.raises(ValueError, match="y has shape"):
        C.matmul_q8_batch(Q.Q8_0, [w], [x], [np.empty((2, 16), np.float32)])
    assert [sys.getrefcount(a) for a in (w, x, y)] == refs
    C.matmul_q8_batch(Q.Q8_0, [w], [x], [y])
    assert np.array_equal(y, K.matmul_q8(Q.Q8_0, w, x))


def test_attention_refuses_a_bad_segment_and_releases_the_good_ones():
    C, rng = _C(), np.random.default_rng(4)
    if not C.has_attention():
        pytest.skip("this build has no attention kernel")
    T, H, D, Kn = 2, 4, 64, 5
    q = rng.standard_normal((T * H, D)).astype(np.float32)
    sinks = np.zeros((1, H), np.float32)
    out = np.empty((T * H, D), np.float32)
    keys = rng.standard_normal((Kn, D)).astype(np.float32)
    mask = np.ones((T, Kn), np.uint8)
    refs = [sys.getrefcount(a) for a in (q, sinks, out, keys, mask)]
    with pytest.raises(ValueError, match="a mask must be uint8"):
        C.attention(q, sinks, out, [(keys, mask, False), (keys, np.ones((T + 1, Kn), np.uint8), False)], 0.125)
    with pytest.raises(ValueError, match="a mask must be uint8"):
        C.attention(q, sinks, out, [(keys, mask, True)], 0.125)        # per-query keys need T * K rows
    with pytest.raises(TypeError):
        C.attention(q, sinks, out, [(keys, mask)], 0.125)
    assert [sys.getrefcount(a) for a in (q, sinks, out, keys, mask)] == refs
    C.attention(q, sinks, out, [(keys, mask, False)], 0.125)
    assert np.isfinite(out).all()
