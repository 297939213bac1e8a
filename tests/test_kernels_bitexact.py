"""The cpu backend's C RoPE and hyper-connection ops (and in ds4 numerics SwiGLU and attention): bit-identical
to the NumPy reference.

In ds4 numerics one ulp before a Q8 quantizer sometimes flips an activation code, and the cpu
pass then drifts from the reference's (docs/cpu-kernels.md, "Fidelity to the reference"). So
these two are held to equality, not a tolerance. Before they were rewritten, NumPy's complex64
multiply left ~11 % of RoPE outputs one ulp away, and libm's expf 10-75 % of the split's.
"""
from __future__ import annotations

# `exact` numerics' C forms first (correctly rounded cos/sin, float64 HC sums); then ds4 numerics'
# (csrc/ops_ds4.c: ds4's compiled float32 loops, engine/model/ds4_float.py), against NumpyOps("ds4").
import numpy as np
import pytest

from engine.backends.cpu import kernels as K
from engine.backends.numpy.ops import NumpyOps

pytestmark = pytest.mark.skipif(not K.available(), reason="engine.backends.cpu._kernels is not built")

REF = NumpyOps("exact")


def _cpu():
    from engine.backends.cpu.ops import CpuOps
    return CpuOps("exact")


@pytest.mark.parametrize("xshape,tshape", [((5, 8, 128), (5, 1, 32)), ((5, 128), (5, 32)), ((7, 512), (7, 32)),
                                           ((3, 64), (32,)), ((256, 4, 192), (256, 1, 32))])
def test_rope_bit_identical_to_the_reference(xshape, tshape):
    ops = _cpu()
    rng = np.random.default_rng(sum(xshape))
    x = (rng.standard_normal(xshape) * 3).astype(np.float32)
    T = tshape[0] if len(tshape) > 1 else 1
    th = ops.rope_thetas(np.arange(1000, 1000 + T), 2 * tshape[-1], 160000.0,
                         dict(factor=16.0, orig_ctx=65536, beta_fast=32.0, beta_slow=1.0))
    th = th.reshape(tshape) if len(tshape) > 1 else th[0]
    for inv in (False, True):
        want = REF.rope(x, th, inverse=inv)
        got = ops.rope(x, th, inverse=inv)
        assert got.view(np.uint32).tolist() == want.view(np.uint32).tolist(), (xshape, inv)
        xc = x.copy()
        assert ops.rope(xc, th, inverse=inv, inplace=True) is xc and np.array_equal(xc, want)
    assert np.array_equal(ops.rope(np.asfortranarray(x), th), REF.rope(x, th))    # not unit-stride


def test_rope_kernel_rejects_bad_shapes():
    x, out = np.zeros((4, 64), np.float32), np.zeros((4, 64), np.float32)
    cs = np.zeros((2, 16), np.complex64)
    with pytest.raises(ValueError):
        K.rope(x, cs, 3, out)                       # 3 does not divide 4 rows
    with pytest.raises(ValueError):
        K.rope(x, np.zeros((2, 40), np.complex64), 2, out)     # 80 rotated values > 64
    with pytest.raises(ValueError):
        K.rope(x, cs, 2, np.zeros((4, 32), np.float32))


@pytest.mark.parametrize("T", [1, 5, 64])
def test_hc_split_bit_identical_to_the_reference(T):
    ops = _cpu()
    rng = np.random.default_rng(T)
    n = 4
    mix = (rng.standard_normal((T, 2 * n + n * n)) * rng.choice([0.1, 1.0, 30.0], (T, 1))).astype(np.float32)
    scale = (1 + rng.standard_normal(3) * 0.2).astype(np.float32)
    base = (rng.standard_normal(2 * n + n * n) * 0.5).astype(np.float32)
    eps = np.float32(1e-6)
    with np.errstate(over="ignore"):                  # exp(-z) = inf for z < -88: sigmoid 0, on both sides
        pairs = list(zip(ops.hc_split(mix, n, scale, base, eps, 20), REF.hc_split(mix, n, scale, base, eps, 20)))
    for got, want in pairs:
        assert got.shape == want.shape and got.dtype == np.float32
        assert got.view(np.uint32).tolist() == want.view(np.uint32).tolist(), T


# -- ds4 numerics: ds4's float32 loops in C (csrc/ops_ds4.c) against the reference's NumPy forms --

DS4 = NumpyOps("ds4")
YARN = dict(factor=16.0, orig_ctx=65536, beta_fast=32.0, beta_slow=1.0)


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint32).tolist()


def _cpu_ds4():
    from engine.backends.cpu import ds4_ops
    from engine.backends.cpu.ops import CpuOps
    if not ds4_ops.available():
        pytest.skip("this build has no ds4 forms (csrc/ops_ds4.c)")
    return CpuOps("ds4")


@pytest.mark.parametrize("yarn", [None, YARN])
@pytest.mark.parametrize("query", [False, True])
def test_ds4_rope_is_the_references(yarn, query):
    """cosf / sinf tables on the C kernel, the query's YaRN blend (rope_thetas(query=True)), forward
    and inverse, per-head and row angles, in place, and again from the kept plan."""
    ops = _cpu_ds4()
    rng = np.random.default_rng(3)
    pos = np.array([0, 1, 77, 3000, 65537, 1 << 20])
    th, ref = ops.rope_thetas(pos, 64, 160000.0, yarn, query), DS4.rope_thetas(pos, 64, 160000.0, yarn, query)
    assert _bits(th) == _bits(ref)
    for x, t, r in (((rng.standard_normal((6, 8, 128)) * 3).astype(np.float32), th[:, None, :], ref[:, None, :]),
                    ((rng.standard_normal((6, 192)) * 3).astype(np.float32), th, ref)):
        for inv in (False, True):
            want = DS4.rope(x, r, inverse=inv)
            for _ in range(2):                                  # the second call takes the kept plan
                assert _bits(ops.rope(x, t, inverse=inv)) == _bits(want), (x.shape, inv)
            xc = x.copy()
            assert ops.rope(xc, t, inverse=inv, inplace=True) is xc and _bits(xc) == _bits(want)


@pytest.mark.parametrize("T", [1, 5, 64])
def test_ds4_hc_ops_are_the_references(T):
    """ds4's HC split (Sinkhorn), weighted sum, post and the head's collapse, bit for bit."""
    ops = _cpu_ds4()
    rng = np.random.default_rng(100 + T)
    mix = (rng.standard_normal((T, 24)) * rng.choice([0.1, 1.0, 30.0], (T, 1))).astype(np.float32)
    scale = (1 + rng.standard_normal(3) * 0.2).astype(np.float32)
    base = (rng.standard_normal(24) * 0.5).astype(np.float32)
    with np.errstate(over="ignore"):
        for got, want in zip(ops.hc_split(mix, 4, scale, base, 1e-6, 20), DS4.hc_split(mix, 4, scale, base, 1e-6, 20)):
            assert got.shape == want.shape and _bits(got) == _bits(want)
        pre, post, C = DS4.hc_split(mix, 4, scale, base, 1e-6, 20)
    E = 1000                                                    # (a tail after the vector loops)
    X = (rng.standard_normal((T, 4, E)) * 4).astype(np.float32)
    y = (rng.standard_normal((T, E)) * 4).astype(np.float32)
    assert _bits(ops.hc_pre_mix(pre, X)) == _bits(DS4.hc_pre_mix(pre, X))
    assert _bits(ops.hc_post(y, X, post, C)) == _bits(DS4.hc_post(y, X, post, C))
    hm = rng.standard_normal((T, 4)).astype(np.float32)
    hb = rng.standard_normal(4).astype(np.float32)
    assert _bits(ops.hc_head(hm, np.float32(0.7), hb, 1e-6, X)) == _bits(DS4.hc_head(hm, np.float32(0.7), hb, 1e-6, X))


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning")
def test_ds4_swiglu_forms_are_the_references():
    """The shared expert's SwiGLU and the routed experts' weighted one (routed_mid), clamped."""
    from engine.backends.cpu import ds4_ops
    from engine.model import ds4_float as F
    _cpu_ds4()
    rng = np.random.default_rng(5)
    g = (rng.standard_normal((9, 300)) * 12).astype(np.float32)
    u = (rng.standard_normal((9, 300)) * 12).astype(np.float32)
    g[0, :3] = [-200.0, 0.0, -0.0]
    w = rng.random(9).astype(np.float32)
    for limit in (np.float32(10.0), np.float32(0.0)):          # 0: no clamp (ds4: limit > 1e-6)
        assert _bits(ds4_ops.swiglu(g, u, limit)) == _bits(F.swiglu(g, u, limit))
        for w0 in (0, 4):
            want = np.concatenate([F.swiglu(g[:w0], u[:w0], limit), F.routed_mid(g[w0:], u[w0:], w[w0:, None], limit)])
            assert _bits(ds4_ops.swiglu(g, u, limit, w[w0:], w0)) == _bits(want), (limit, w0)


@pytest.mark.parametrize("T", [1, 7])
def test_ds4_attention_is_the_references(T):
    """ds4's per-key attention (head dim 128): shared, per-query and by-index segments, masks with
    holes, a query that sees no key at all."""
    ops = _cpu_ds4()
    rng = np.random.default_rng(T)
    H, D = 4, 128
    q = (rng.standard_normal((T, H, D)) * 0.3).astype(np.float32)
    raw = rng.standard_normal((T + 20, D)).astype(np.float32)
    mraw = rng.random((T, T + 20)) < 0.6
    mraw[0] = False
    keys = rng.standard_normal((40, D)).astype(np.float32)
    idx = rng.integers(0, 40, (T, 9)).astype(np.int64)
    ok = rng.random((T, 9)) < 0.7
    ok[0] = False
    sinks = rng.standard_normal(H).astype(np.float32)
    segs = [(raw, mraw), (keys, ok, idx)]
    scale = 1.0 / np.sqrt(D)
    assert _bits(ops.attention(q, segs, sinks, scale)) == _bits(DS4.attention(q, segs, sinks, scale))
