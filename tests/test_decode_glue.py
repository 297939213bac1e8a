"""The decode step's glue cuts (docs/performance.md, "The decode step's Python glue"): each short
form gives the bits of the form it replaces, and bad input still gets a ValueError."""
from __future__ import annotations

# Both numerics where the C path has a ds4 form (RoPE: cosf / sinf tables and the query's YaRN
# blend; csrc/ops_ds4.c and tests/test_kernels_bitexact.py hold the rest of ds4's loops).
import numpy as np
import pytest

from engine.backends.cpu import fast, kernels as K
from engine.backends.cpu.ops import CpuOps
from engine.backends.numpy.ops import NumpyOps
from engine.gguf import quants as Q
from engine.gguf.model_file import QTensor
from engine.model import numerics as N
from engine.model.model import _key_segments

needs_kernels = pytest.mark.skipif(not K.available(), reason="engine.backends.cpu._kernels is not built")
RNG = np.random.default_rng(7)


def _same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype
    assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


@needs_kernels
@pytest.mark.parametrize("shape, heads", [((3, 96), False), ((2, 5, 96), True), ((1, 8, 64), True)])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("numerics", ["exact", "ds4"])
def test_rope_plan_equals_reference(shape, heads, inverse, numerics):
    ops, libm = CpuOps(numerics), numerics == "ds4"       # ds4: the C library's cosf / sinf
    pos = np.arange(100, 100 + shape[0])
    th = ops.rope_thetas(pos, 32, 10000.0, None)
    th = th[:, None, :] if heads else th
    x = RNG.standard_normal(shape).astype(np.float32)
    want = N.apply_rope(x, th, inverse, libm)
    first = ops.rope(x, th, inverse=inverse)              # makes the plan
    assert (id(th), x.shape, inverse, libm) in fast._PLANS
    second = ops.rope(x, th, inverse=inverse)             # takes it
    y = x.copy()
    third = ops.rope(y, th, inverse=inverse, inplace=True)
    assert third is y
    for got in (first, second, third):
        _same(got, want)
    # another x shape with the same table: its own plan, not the first one's
    if not heads:
        x2 = RNG.standard_normal((shape[0], 128)).astype(np.float32)
        _same(ops.rope(x2, th, inverse=inverse), N.apply_rope(x2, th, inverse, libm))
        _same(ops.rope(x2, th, inverse=inverse), N.apply_rope(x2, th, inverse, libm))


@needs_kernels
def test_rope_plan_needs_the_same_table_object():
    ops = CpuOps("exact")
    th = ops.rope_thetas(np.arange(4), 16, 10000.0, None)
    x = RNG.standard_normal((4, 40)).astype(np.float32)
    ops.rope(x, th)
    other = np.asarray(th) * 2                            # not this backend's table: never planned
    _same(ops.rope(x, other), N.apply_rope(x, other))
    _same(ops.rope(x, other), N.apply_rope(x, other))


@needs_kernels
@pytest.mark.parametrize("shape", [(64,), (1, 64), (3, 64), (2, 4, 64)])
@pytest.mark.parametrize("weighted", [False, True])
def test_rmsnorm_equals_kernels_wrapper(shape, weighted):
    x = RNG.standard_normal(shape).astype(np.float32)
    w = RNG.standard_normal(64).astype(np.float32) if weighted else None
    want = K.rmsnorm(x, w, 1e-6)
    _same(CpuOps.rmsnorm(x, w, 1e-6), want)
    if weighted:                                          # a float64 or strided weight: converted
        _same(CpuOps.rmsnorm(x, w.astype(np.float64), 1e-6), want)
        w2 = np.repeat(w, 2)[::2]
        _same(CpuOps.rmsnorm(x, w2, 1e-6), want)
    with pytest.raises(ValueError):
        CpuOps.rmsnorm(x, np.ones(63, np.float32), 1e-6)


@needs_kernels
@pytest.mark.parametrize("tid", [Q.F16, Q.F32, Q.BF16])
@pytest.mark.parametrize("T", [1, 3])
def test_float_matmul_equals_kernels_matmul(tid, T):
    rows, n_in = 40, 256
    raw = Q.random_blocks(tid, RNG, rows * n_in // Q.FORMATS[tid].block_elems, 0.05).reshape(rows, -1)
    w = QTensor("w", tid, (n_in, rows), raw)
    x = RNG.standard_normal((T, n_in)).astype(np.float32)
    ops = CpuOps("exact")
    _same(ops.linear(w, x), K.matmul(tid, raw, x))
    _same(ops.linear(w, x[0]), K.matmul(tid, raw, x[:1])[0])
    with pytest.raises(ValueError):
        ops.linear(w, np.ones((T, n_in + 32), np.float32))


@needs_kernels
@pytest.mark.parametrize("T", [1, 4])
def test_hc_ops_equal_kernels_wrappers(T):
    n, E = 4, 96
    ops = CpuOps("exact")
    mix = RNG.standard_normal((T, 2 * n + n * n)).astype(np.float32)
    scale = RNG.standard_normal(3).astype(np.float32)
    base = RNG.standard_normal(2 * n + n * n).astype(np.float32)
    want = K.hc_split(mix, n, scale, base, 1e-6, 20)
    for _ in range(2):                                    # the second call takes the kept rows
        got = ops.hc_split(mix, n, scale, base, np.float32(1e-6), 20)
        for a, b in zip(got, want):
            _same(a, b)
    base[0] += 1.0                                        # the kept rows are views: they follow
    for a, b in zip(ops.hc_split(mix, n, scale, base, 1e-6, 20), K.hc_split(mix, n, scale, base, 1e-6, 20)):
        _same(a, b)
    pre, post, C = want
    X = RNG.standard_normal((T, n, E)).astype(np.float32)
    y = RNG.standard_normal((T, E)).astype(np.float32)
    _same(CpuOps.hc_pre_mix(pre, X), K.hc_pre_mix(pre, X))
    _same(CpuOps.hc_post(y, X, post, C), K.hc_post(y, X, post, C))
    _same(CpuOps.hc_post(y, X, post, C), NumpyOps.hc_post(y, X, post, C))
    with pytest.raises(ValueError):
        CpuOps.hc_post(y[:, :-1], X, post, C)


class _LW:
    def __init__(self, ratio):
        self.ratio = ratio


class _LS:
    comp = np.arange(300, dtype=np.float32).reshape(100, 3)


@pytest.mark.parametrize("ratio", [0, 4, 128])
@pytest.mark.parametrize("p", [0, 3, 127, 128, 130, 400])
def test_one_query_segments_equal_the_general_masks(ratio, p):
    n_swa = 128
    lo = max(0, p - n_swa + 1)
    raw = np.arange(4 * (p + 1 - lo), dtype=np.float32).reshape(-1, 4)
    pos = np.array([p])
    got = _key_segments(_LW(ratio), _LS(), raw, lo, pos, 0, 1, n_swa, True)
    # the general form (model.py before the one-query case), written out
    tq = pos
    k0 = max(lo, tq[0] - n_swa + 1)
    kpos = np.arange(k0, tq[-1] + 1)
    want = [(raw[k0 - lo: tq[-1] + 1 - lo], (kpos[None, :] <= tq[:, None]) & (kpos[None, :] > tq[:, None] - n_swa))]
    if ratio:
        n_vis = (tq + 1) // ratio
        nmax = int(n_vis[-1])
        want.append((_LS.comp[:nmax], np.arange(nmax)[None, :] < n_vis[:, None]))
    assert len(got) == len(want)
    for (ka, ma), (kb, mb) in zip(got, want):
        _same(ka, kb)
        _same(ma, mb)
    assert len(_key_segments(_LW(ratio), _LS(), raw, lo, pos, 0, 1, n_swa, False)) == 1
