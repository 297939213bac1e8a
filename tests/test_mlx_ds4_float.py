"""mlx's ds4 float32 loops (engine/backends/mlx/ds4_float.py) and ds4-numerics ops against the
reference's (engine/model/ds4_float.py, NumpyOps("ds4")), bit for bit on MLX's CPU device
(issue 33). Inputs are random, with signs, magnitudes and masks that reach every branch."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install -e '.[mlx]')")
F = pytest.importorskip("engine.model.ds4_float", reason="the reference's ds4 float32 loops are not in this tree")

from engine.backends.mlx import ds4_dot as DD, ds4_float as DF, numerics as MN  # noqa: E402
from engine.backends.mlx.ops import MlxOps  # noqa: E402
from engine.backends.numpy.ops import NumpyOps  # noqa: E402
from engine.gguf import quants as Q  # noqa: E402
from engine.gguf.model_file import QTensor  # noqa: E402

pytestmark = pytest.mark.skipif(not DD.cpu_float64(), reason="the bit-for-bit rules hold on MLX's CPU device")
RNG = np.random.default_rng(11)


def _same(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, (got.shape, want.shape)
    ne = got.view(np.uint32) != want.view(np.uint32)
    assert not ne.any(), f"{ne.sum()} of {ne.size} differ, max {np.abs(got - want)[ne].max()}"


def _wide(*shape):
    """float32 values over many magnitudes, both signs (and some past the branch points +-20)."""
    return (RNG.standard_normal(shape) * np.exp(RNG.uniform(-3, 3.5, shape))).astype(np.float32)


@pytest.mark.filterwarnings("ignore:overflow")
def test_expf_is_the_rounded_float64_exp():
    x = np.concatenate([_wide(20000), np.float32([-104.0, -87.5, 0.0, 88.7, 89.0, -np.inf])])
    _same(MN.expf(mx.array(x)), F.expf(x))


@pytest.mark.parametrize("name", ["sigmoid_stable", "silu", "softplus"])
def test_elementwise(name):
    x = _wide(20000)
    _same(getattr(DF, name)(mx.array(x)), getattr(F, name)(x))


def test_f16_matvec_sums_in_index_order():
    w = (RNG.standard_normal((24, 1024)) * 0.05).astype(np.float16)
    x = _wide(3, 1024)
    _same(DF.f16_matvec(mx.array(w), mx.array(x)), F.f16_matvec(w, x))


def test_hc_split_and_mixes():
    T, n, E = 3, 4, 64
    mix, scale, base = _wide(T, 2 * n + n * n), RNG.uniform(0.1, 2, 3).astype(np.float32), _wide(2 * n + n * n)
    eps = np.float32(1e-6)
    for a, b in zip(DF.hc_split(mx.array(mix), n, mx.array(scale), mx.array(base), eps, 20),
                    F.hc_split(mix, n, scale, base, eps, 20)):
        _same(a, b)
    w, X, y, post, C = _wide(T, n), _wide(T, n, E), _wide(T, E), _wide(T, n), _wide(T, n, n)
    _same(DF.hc_weighted_sum(mx.array(w), mx.array(X)), F.hc_weighted_sum(w, X))
    _same(DF.hc_post(*map(mx.array, (y, X, post, C))), F.hc_post(y, X, post, C))
    _same(DF.hc_head(mx.array(mix[:, :n]), mx.array(scale[0]), mx.array(base[:n]), eps, mx.array(X)),
          F.hc_head(mix[:, :n], scale[0], base[:n], eps, X))


def test_swiglu_forms():
    g, u, w = _wide(4, 256), _wide(4, 256), RNG.uniform(0, 1, (4, 1)).astype(np.float32)
    _same(DF.swiglu(mx.array(g), mx.array(u), 10.0), F.swiglu(g, u, 10.0))
    _same(DF.routed_mid(mx.array(g), mx.array(u), mx.array(w), 10.0), F.routed_mid(g, u, w, 10.0))


@pytest.mark.parametrize("products", [1 << 21, 0], ids=["decode-form", "key-at-a-time"])
def test_attention_head_dim_128(products, monkeypatch):
    monkeypatch.setattr(DF, "_ATT_PRODUCTS", products)
    T, H, D, K1, K2 = 2, 3, 128, 7, 5
    q = _wide(T, H, D) * np.float32(0.1)
    k1 = MN.f16_round(mx.array(_wide(K1, D) * np.float32(0.1)))       # cached rows are F16 values
    k2 = MN.f16_round(mx.array(_wide(T, K2, D) * np.float32(0.1)))
    m1, m2 = RNG.uniform(size=(T, K1)) < 0.7, RNG.uniform(size=(T, K2)) < 0.5
    m1[:, 0] = True
    sinks = _wide(H)
    segs = [(np.array(k1), m1), (np.array(k2), m2)]
    got = DF.attention(mx.array(q), [(mx.array(k), mx.array(m)) for k, m in segs], mx.array(sinks), 0.0883883)
    _same(got, F.attention(q, segs, sinks, 0.0883883))


def _qt(tid, rows, cols):
    data = Q.random_blocks(tid, RNG, rows * cols // Q._format(tid).block_elems, 0.05)
    return QTensor("w", tid, (cols, rows), data.reshape(rows, -1))


@pytest.mark.parametrize("tid", [Q.Q8_0, Q.F16, Q.F32])
def test_linear_is_the_references(tid):
    w, x = _qt(tid, 48, 256), _wide(3, 256)
    _same(MlxOps("ds4").linear(w, x), NumpyOps("ds4").linear(w, x))


def test_rmsnorm_is_the_references():
    x, w = _wide(5, 512), _wide(512)
    _same(MlxOps("ds4").rmsnorm(x, w, 1e-6), NumpyOps("ds4").rmsnorm(x, w, 1e-6))
    _same(MlxOps("ds4").rmsnorm(x, None, 1e-6), NumpyOps("ds4").rmsnorm(x, None, 1e-6))


def _experts(gate_t, down_t, E=4, F_=256, n=256):
    def qt(t, rows, cols):
        data = Q.random_blocks(t, RNG, E * rows * cols // Q._format(t).block_elems, 0.05)
        return QTensor("e", t, (cols, rows, E), data.reshape(E * rows, -1))
    return SimpleNamespace(gate_exps=qt(gate_t, F_, n), up_exps=qt(gate_t, F_, n), down_exps=qt(down_t, n, F_),
                           sh_gate=_qt(Q.Q8_0, F_, n), sh_up=_qt(Q.Q8_0, F_, n), sh_down=_qt(Q.Q8_0, n, F_))


@pytest.mark.parametrize("kinds", [(Q.IQ2_XXS, Q.Q2_K), (Q.Q4_K, Q.Q4_K)], ids=["q2", "q4"])
def test_moe_is_the_references(kinds):
    """The routed experts (batched per pair for IQ2_XXS / Q2_K, one expert at a time else), their
    outputs added in slot order, and the shared expert."""
    lw = _experts(*kinds)
    T, k = 3, 2
    u = _wide(T, 256) * np.float32(0.1)
    sel = np.array([[3, 1], [0, 3], [2, 1]])
    wsel = RNG.uniform(0.1, 1.0, (T, k)).astype(np.float32)
    _same(MlxOps("ds4").moe(lw, u, sel, wsel, 10.0), NumpyOps("ds4").moe(lw, u, sel, wsel, 10.0))


def test_softmax_is_the_references():
    """The compressors' pooling softmax (NumPy's float32 exp and pairwise sums, on the host)."""
    x = _wide(3, 8, 64)
    x[0, :, 5] = -np.inf
    for axis in (1, -1):
        _same(MlxOps("ds4").softmax(x, axis=axis), NumpyOps("ds4").softmax(x, axis=axis))


@pytest.mark.parametrize("k,hashed", [(4, True), (4, False), (2, False), (6, True)])
def test_expert_weights_are_the_references(k, hashed):
    w = RNG.uniform(0, 1, (5, k)).astype(np.float32)
    w[0] = 1e-9                                   # under the 2^-14 floor
    _same(DF.expert_weights(mx.array(w), 1.5, hashed), F.expert_weights(w, 1.5, hashed))


def test_query_rope_takes_the_yarn_query_angles():
    """A query's rotation (rope_thetas(query=True), as Model._attention asks for it) at YaRN
    angles takes the fma-blend angles, the KV rows and the inverse the factored ones, as
    NumpyOps.rope_thetas_ds4 makes them; the two tables differ (at the blended pairs)."""
    yarn = dict(factor=16.0, orig_ctx=64, beta_fast=32.0, beta_slow=1.0)
    pos = np.arange(3000, 3003)
    mo, no = MlxOps("ds4"), NumpyOps("ds4")
    tm, tn = mo.rope_thetas(pos, 64, 160000.0, yarn), no.rope_thetas(pos, 64, 160000.0, yarn)
    qm, qn = mo.rope_thetas(pos, 64, 160000.0, yarn, query=True), no.rope_thetas(pos, 64, 160000.0, yarn, query=True)
    assert not np.array_equal(qn, tn)
    q, kv = _wide(3, 8, 128), _wide(3, 128)
    _same(mo.rope(q, qm[:, None, :]), no.rope(q, qn[:, None, :]))
    _same(mo.rope(q, tm[:, None, :], inverse=True), no.rope(q, tn[:, None, :], inverse=True))
    _same(mo.rope(kv, tm), no.rope(kv, tn))
