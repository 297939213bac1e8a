"""engine/backends/cpu/fast.py's FastOps (float32, vectorized) against the NumPy reference's methods, op by op,
on random inputs of small but realistic shapes; the whole-forward agreement of the cpu backend
(which uses FastOps) with the reference is tests/test_ops_cpu.py's. Bounds are relative to the
largest reference magnitude and sized for float32 rounding (measured errors are ~1e-7..1e-6)."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

from engine.backends.cpu.fast import FastOps
from engine.backends.numpy.ops import NumpyOps

REL = 1e-5


class Fast(FastOps, NumpyOps):
    pass


REF, FAST = NumpyOps("exact"), Fast("exact")


def _rng(seed):
    return np.random.default_rng(seed)


def f32(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def check(name, got, ref, rel=REL):
    got, ref = np.asarray(got), np.asarray(ref)
    assert got.shape == ref.shape and got.dtype == np.float32 == ref.dtype, (name, got.shape, ref.shape, got.dtype)
    fin = np.isfinite(ref)
    assert np.array_equal(got[~fin], ref[~fin], equal_nan=True), f"{name}: non-finite values differ"
    err = float(np.abs(got[fin].astype(np.float64) - ref[fin]).max()) if fin.any() else 0.0
    r = err / max(float(np.abs(ref[fin]).max()) if fin.any() else 0.0, 1e-30)
    print(f"{name}: max-abs {err:.3g} rel {r:.3g}")
    assert r <= rel, (name, err, r)


def _unit_rows(rng, *shape):
    # keys and queries as the model feeds them: rmsnorm'd rows (|x|^2 = D), so scores are O(sqrt(D))
    return REF.rmsnorm(f32(rng, *shape), None, 1e-6)


@pytest.mark.parametrize("T", [1, 7])
def test_attention_shared_and_per_query_segments(T):
    rng = _rng(T)
    H, D = 8, 128
    q = _unit_rows(rng, T, H, D)
    sinks = f32(rng, H) * 2
    raw = _unit_rows(rng, 5 + T, D)                                    # shared [K, D], sliding mask
    kpos = np.arange(5 + T)
    tq = np.arange(5, 5 + T)
    mraw = (kpos[None] <= tq[:, None]) & (kpos[None] > tq[:, None] - 4)
    comp = _unit_rows(rng, T, 6, D)                                    # per query [T, K, D]
    mcomp = rng.random((T, 6)) < 0.6
    mcomp[0] = False                                                   # a query with no compressed row
    shared = _unit_rows(rng, 3, D)                                     # shared, every row visible
    for segs in ([(raw, mraw)], [(raw, mraw), (comp, mcomp)], [(raw, mraw), (shared, np.ones((T, 3), bool))],
                 [(raw, mraw), (comp, mcomp), (shared, np.ones((T, 3), bool))],
                 [(raw, mraw), (raw[:0], np.zeros((T, 0), bool))]):  # an empty segment (no compressed rows yet)
        scale = 1.0 / np.sqrt(D)
        check(f"attention T={T} {len(segs)} segments", FAST.attention(q, segs, sinks, scale),
              REF.attention(q, segs, sinks, scale))


def _window_segments(rng, tq, D, W=3):
    """Segments as the model builds them for queries at positions tq: the raw window's keys as one
    segment with a band mask, compressed rows with a causal prefix mask (the first query sees none;
    column 2 attended by nobody), indexer-style per-query keys with some invalid picks."""
    T = len(tq)
    kpos = np.arange(tq[0] - W + 1, tq[-1] + 1)
    raw = _unit_rows(rng, len(kpos), D)
    band = (kpos[None] <= tq[:, None]) & (kpos[None] > tq[:, None] - W)
    comp = _unit_rows(rng, 7, D)
    causal = np.arange(7)[None] < ((tq + 1) // 2 - 10)[:, None]
    causal[:, 2] = False
    per_q = _unit_rows(rng, T, 5, D)
    valid = rng.random((T, 5)) < 0.7
    return [(raw, band), (comp, causal), (per_q, valid)]


def test_attention_key_spans_and_batch_invariance():
    # each query's keys are cut to its attended span: a band, a causal prefix with a hole, per-query
    # keys; and a query's result is bit-identical whether it is computed alone or in a batch
    rng = _rng(5)
    T, H, D = 9, 4, 64
    q = _unit_rows(rng, T, H, D)
    sinks = f32(rng, H)
    segs = _window_segments(rng, np.arange(20, 20 + T), D)
    got = FAST.attention(q, segs, sinks, 0.125)
    check("attention key spans", got, REF.attention(q, segs, sinks, 0.125))
    for t in (0, 4, 8):
        one = [(k if k.ndim == 2 else k[t:t + 1], m[t:t + 1]) for k, m in segs]
        assert np.array_equal(FAST.attention(q[t:t + 1], one, sinks, 0.125)[0], got[t])
    # the decode form of query 8: only its own window rows and visible compressed rows, all attended
    raw, band = segs[0]
    comp, causal = segs[1]
    dec = [(raw[band[8]], np.ones((1, 3), bool)), (comp[:4], causal[8:9, :4]), (segs[2][0][8:9], segs[2][1][8:9])]
    assert np.array_equal(FAST.attention(q[8:9], dec, sinks, 0.125)[0], got[8])


def test_attention_fully_masked_rows_and_infinite_sinks():
    rng = _rng(3)
    T, H, D = 4, 4, 64
    q, keys = _unit_rows(rng, T, H, D), _unit_rows(rng, 9, D)
    mask = rng.random((T, 9)) < 0.5
    mask[1] = False                                       # row 1 sees only the sink: output exactly 0
    sinks = np.array([0.5, -np.inf, 3.0, -2.0], np.float32)  # head 1: no sink (-inf)
    with np.errstate(invalid="ignore", divide="ignore"):
        ref = REF.attention(q, [(keys, mask)], sinks, 0.125)
        got = FAST.attention(q, [(keys, mask)], sinks, 0.125)
    # query 1, head 1: nothing to attend and no sink: 0/0 in both
    assert np.isnan(ref[1, 1]).all() and np.isnan(got[1, 1]).all()
    assert (got[1, [0, 2, 3]] == 0).all() and (ref[1, [0, 2, 3]] == 0).all()
    ok = np.ones((T, H), bool)
    ok[1, 1] = False
    check("attention masked rows", got[ok], ref[ok])


def test_attention_large_scores_stay_finite():
    # scores of ~±80 (exp overflows float32 without the max subtraction)
    rng = _rng(4)
    T, H, D = 3, 2, 32
    q, keys = f32(rng, T, H, D) * 8, f32(rng, 5, D) * 8
    sinks = np.float32([100.0, -100.0])
    m = np.ones((T, 5), bool)
    check("attention large scores", FAST.attention(q, [(keys, m)], sinks, 1.0 / np.sqrt(D)),
          REF.attention(q, [(keys, m)], sinks, 1.0 / np.sqrt(D)))


@pytest.mark.parametrize("shape", [(1, 1024), (5, 1024), (3, 4, 128), (256,)])
def test_rmsnorm(shape):
    rng = _rng(len(shape))
    x = f32(rng, *shape) * 3
    w = f32(rng, shape[-1])
    for ww in (None, w):
        check(f"rmsnorm {shape} w={ww is not None}", FAST.rmsnorm(x, ww, 1e-6), REF.rmsnorm(x, ww, 1e-6))
    # a zero row: eps keeps it finite (0)
    z = np.zeros((2, 64), np.float32)
    assert (FAST.rmsnorm(z, None, 1e-6) == 0).all()


@pytest.mark.parametrize("T", [1, 6])
def test_hc_ops(T):
    rng = _rng(10 + T)
    n, E = 4, 256
    X = f32(rng, T, n, E)
    pre = rng.random((T, n)).astype(np.float32) + 1e-6
    post = 2 * rng.random((T, n)).astype(np.float32)
    C = rng.random((T, n, n)).astype(np.float32)
    y = f32(rng, T, E)
    check(f"hc_pre_mix T={T}", FAST.hc_pre_mix(pre, X), REF.hc_pre_mix(pre, X))
    check(f"hc_post T={T}", FAST.hc_post(y, X, post, C), REF.hc_post(y, X, post, C))


@pytest.mark.parametrize("T", [1, 5])
def test_hc_split(T):
    rng = _rng(20 + T)
    n = 4
    mix = f32(rng, T, 2 * n + n * n) * 4
    mix[0, 2 * n:2 * n + n] = [30, -30, 0, 1]             # a peaked softmax row
    scale, base, eps = rng.random(3).astype(np.float32) + 0.5, f32(rng, 2 * n + n * n), np.float32(1e-6)
    got = FAST.hc_split(mix, n, scale, base, eps, 20)
    ref = REF.hc_split(mix, n, scale, base, eps, 20)
    for name, g, r in zip(("pre", "post", "C"), got, ref):
        check(f"hc_split {name} T={T}", g, r)
    # the same float32 operations in the same order: bit-identical today (the bound above is what counts)
    assert all(np.array_equal(g, r) for g, r in zip(got, ref))


@pytest.mark.parametrize("xshape,tshape", [((3, 4, 128), (3, 1, 32)), ((3, 128), (3, 32)), ((2, 64), (32,))])
def test_rope(xshape, tshape):
    rng = _rng(30)
    x = f32(rng, *xshape)
    th = (rng.random(tshape) * 100).astype(np.float32)
    for inv in (False, True):
        got, ref = FAST.rope(x, th, inverse=inv), REF.rope(x, th, inverse=inv)
        check(f"rope {xshape} inverse={inv}", got, ref)
        assert np.array_equal(got[..., :xshape[-1] - 2 * tshape[-1]], x[..., :xshape[-1] - 2 * tshape[-1]])
    y = FAST.rope(np.asfortranarray(x), th)                   # lanes not unit-stride: still right
    check("rope strided", y, REF.rope(x, th))
    for inv in (False, True):                                 # in place: the same values, x overwritten
        xc = x.copy()
        got = FAST.rope(xc, th, inverse=inv, inplace=True)
        assert got is xc and np.array_equal(got, FAST.rope(x, th, inverse=inv))
        assert np.array_equal(REF.rope(x, th, inverse=inv, inplace=True), REF.rope(x, th, inverse=inv))
    with pytest.raises(ValueError):
        FAST.rope(np.zeros((2, 16), np.float32), np.zeros((2, 16), np.float32))


def test_rope_rotations_of_the_backends_own_tables_are_reused_and_right():
    """The angle tables FastOps.rope_thetas built (the model's per-pass angles) have their
    rotations kept, by the array object: the same values as computed afresh, for the inverse and
    for another view of the same table; any other array, read-only or not, is never kept (the
    backend cannot know it will not change); the store stays small."""
    from engine.backends.cpu import fast as ops_fast
    rng = _rng(31)
    x = f32(rng, 3, 4, 128)
    pos = np.arange(40, 43)
    ro = FAST.rope_thetas(pos, 64, 10000.0, None)
    th = ro.copy()                                          # the same values, not the backend's
    assert not ro.flags.writeable and np.array_equal(ro, REF.rope_thetas(pos, 64, 10000.0, None))
    fresh = {inv: FAST.rope(x, th[:, None, :], inverse=inv) for inv in (False, True)}
    fresh_kv = FAST.rope(x[:, 0], th)
    ro_h = ro[:, None, :]
    for _ in range(2):                                      # computed, then found
        for inv in (False, True):
            assert np.array_equal(FAST.rope(x, ro_h, inverse=inv), fresh[inv])
        assert np.array_equal(FAST.rope(x[:, 0], ro), fresh_kv)
    assert len(ops_fast._ROTATIONS[id(ro_h)][1]) == 2 and len(ops_fast._ROTATIONS[id(ro)][1]) == 1
    assert np.array_equal(FAST.rope(x[1:], ro[1:, None, :]), fresh[False][1:])   # another view of it
    w = th.copy()
    other = th.copy()
    other.flags.writeable = False                           # read-only, but not the backend's table
    for arr in (w[:, None, :], other[:, None, :], other):
        got = FAST.rope(x if arr.ndim == 3 else x[:, 0], arr)
        assert id(arr) not in ops_fast._ROTATIONS
        assert np.array_equal(got, fresh[False] if arr.ndim == 3 else fresh_kv)
    view = w[:, None, :]
    w += 1.0                                                # changed: a new rotation, not a kept one
    assert np.array_equal(FAST.rope(x, view), FAST.rope(x, w.copy()[:, None, :]))
    for i in range(2 * ops_fast._ROTATION_KEEP):
        r = FAST.rope_thetas(np.arange(i, i + 3), 64, 10000.0, None)
        FAST.rope(x, r[:, None, :])
    assert len(ops_fast._ROTATIONS) <= ops_fast._ROTATION_KEEP
    assert len(ops_fast._TABLES) <= ops_fast._TABLE_KEEP


def test_cpu_backend_uses_fast_ops():
    # (hc_pre_mix, hc_post, rmsnorm and attention have C forms of their own, tested above)
    # in exact numerics; ds4 numerics take ds4's forms (csrc/ops_ds4.c, tests/test_kernels_bitexact.py)
    from engine.backends.cpu.ops import CpuOps
    ops = CpuOps("exact")
    assert CpuOps.rope is FastOps.rope and ops.rope is FastOps.rope
    g, v = np.linspace(-30, 30, 64, dtype=np.float32).reshape(2, 32), np.ones((2, 32), np.float32)
    with np.errstate(over="ignore"):
        assert np.array_equal(ops.swiglu(g, v, np.float32(7.0)), FastOps.swiglu(g, v, np.float32(7.0)))


def test_a_tokens_result_does_not_depend_on_the_batch():
    # every FastOps op computes a token's row from that token's inputs alone, in the same order
    # whatever T (so chunked prefill and decode see the same float32 values, as far as these ops go)
    rng = _rng(40)
    T, n, E = 6, 4, 256
    X, w, y = f32(rng, T, n, E), f32(rng, E), f32(rng, T, E)
    q = f32(rng, T, 4, 128)
    th = (rng.random((T, 32)) * 100).astype(np.float32)
    pre, post = rng.random((T, n)).astype(np.float32), rng.random((T, n)).astype(np.float32)
    C, mix = rng.random((T, n, n)).astype(np.float32), f32(rng, T, 2 * n + n * n)
    sc, base, eps = rng.random(3).astype(np.float32), f32(rng, 2 * n + n * n), np.float32(1e-6)
    ops = {
        "rmsnorm": lambda s: FAST.rmsnorm(X[s].reshape(-1, n * E), None, 1e-6),
        "rmsnorm w": lambda s: FAST.rmsnorm(X[s, 0], w, 1e-6),
        "rope": lambda s: FAST.rope(q[s], th[s, None, :]),
        "hc_pre_mix": lambda s: FAST.hc_pre_mix(pre[s], X[s]),
        "hc_post": lambda s: FAST.hc_post(y[s], X[s], post[s], C[s]),
        "hc_split": lambda s: np.concatenate([a.reshape(len(a), -1)
                                              for a in FAST.hc_split(mix[s], n, sc, base, eps, 20)], 1),
    }
    for name, f in ops.items():
        full = f(slice(None))
        for t in range(T):
            assert np.array_equal(f(slice(t, t + 1))[0], full[t]), (name, t)


@pytest.mark.parametrize("T", [1, 7])
def test_hc_split_in_c(T):
    """The cpu backend's C hc_split (kernels.hc_split) against the reference: the same float32
    steps with libm's expf for NumPy's exp, so equal up to float32 rounding."""
    from engine.backends.cpu import kernels
    if not kernels.available():
        pytest.skip("engine.backends.cpu._kernels is not built")
    rng = _rng(40 + T)
    n = 4
    mix = f32(rng, T, 2 * n + n * n) * 4
    mix[0, 2 * n:2 * n + n] = [30, -30, 0, 1]             # a peaked softmax row
    scale, base, eps = rng.random(3).astype(np.float32) + 0.5, f32(rng, 2 * n + n * n), np.float32(1e-6)
    for iters in (1, 20):
        got = kernels.hc_split(mix, n, scale, base, eps, iters)
        ref = REF.hc_split(mix, n, scale, base, eps, iters)
        for name, g, r in zip(("pre", "post", "C"), got, ref):
            check(f"C hc_split {name} T={T} iters={iters}", g, r)


@pytest.mark.parametrize("shape", [(1, 16384), (7, 64, 512), (300, 1000), (2, 3)])
def test_rmsnorm_in_c(shape):
    """The cpu backend's C rmsnorm sums the squares in float64 as the reference does (in another
    order), so it is the reference's result bit for bit except in rare last-bit cases."""
    from engine.backends.cpu import kernels
    from engine.backends.cpu.ops import CpuOps
    if not kernels.available():
        pytest.skip("engine.backends.cpu._kernels is not built")
    rng = _rng(sum(shape))
    x = (rng.standard_normal(shape) * rng.choice([1e-4, 1.0, 300.0], shape[:-1] + (1,))).astype(np.float32)
    w = f32(rng, shape[-1])
    for ww in (None, w):
        got, ref = CpuOps.rmsnorm(x, ww, 1e-6), REF.rmsnorm(x, ww, 1e-6)
        check(f"C rmsnorm {shape} w={ww is not None}", got, ref)
        assert np.mean(got.view(np.uint32) == ref.view(np.uint32)) >= 0.999
    assert CpuOps.rmsnorm(x[0], w, 1e-6).shape == x[0].shape


@pytest.mark.parametrize("T,H,D", [(1, 64, 512), (9, 8, 128), (5, 3, 40), (3, 5, 100)])
def test_attention_in_c(T, H, D):
    """The cpu backend's C attention against the reference: shared and per-query key segments,
    an empty segment, a query that attends nothing (0 with a finite sink, NaN with a -inf one, as
    the reference), head counts and widths off the 4-head / 16-value tiles; a query's result is
    the same alone or in the batch, and whatever the thread count."""
    from engine.backends.cpu import kernels
    from engine.backends.cpu.ops import CpuOps
    if not kernels.available():
        pytest.skip("engine.backends.cpu._kernels is not built")
    rng = _rng(T * H + D)
    q = f32(rng, T, H, D) / np.float32(np.sqrt(D))
    kr, mr = f32(rng, 20, D), rng.random((T, 20)) < 0.6
    kp, mp = f32(rng, T, 7, D), rng.random((T, 7)) < 0.5
    mr[0], mp[0] = False, False                                  # query 0: only the sink
    sinks = f32(rng, H)
    sinks[0] = -np.inf
    segs = [(kr, mr), (kp, mp), (np.zeros((0, D), np.float32), np.zeros((T, 0), bool))]
    with np.errstate(invalid="ignore"):                          # the reference's -inf - -inf
        ref = REF.attention(q, segs, sinks, 0.7)
    got = CpuOps.attention(q, segs, sinks, 0.7)
    check(f"C attention T={T} H={H} D={D}", got, ref)           # (NaN where the reference has NaN)
    assert (got[0, 1:] == 0).all()
    for t in range(T):
        one = CpuOps.attention(q[t:t + 1], [(kr, mr[t:t + 1]), (kp[t:t + 1], mp[t:t + 1])], sinks, 0.7)
        assert np.array_equal(one[0], got[t], equal_nan=True), t
    prev = kernels.get_threads()
    try:
        kernels.set_threads(1)
        assert np.array_equal(CpuOps.attention(q, segs, sinks, 0.7), got, equal_nan=True)
    finally:
        kernels.set_threads(prev)
    # the portable build has no attention kernel: the backend falls back to FastOps' form
    C = kernels._K
    prev_isa = C.set_isa("generic")
    try:
        assert kernels.attention(q, segs, sinks, 0.7) is None
        with warnings.catch_warnings():        # FastOps' -inf - -inf (the sink-only query), on its threads too
            warnings.simplefilter("ignore", RuntimeWarning)
            check(f"attention fallback T={T}", CpuOps.attention(q, segs, sinks, 0.7), ref)
    finally:
        C.set_isa(prev_isa)


def test_swiglu_bit_identical():
    rng = _rng(60)
    for shape in ((1, 2048), (7, 300)):
        g, v = f32(rng, *shape) * 8, f32(rng, *shape) * 8
        g[0, :3] = [100.0, -100.0, np.inf]                       # clamped above, exp overflow below
        for limit in (np.float32(7.0), np.float32(np.inf)):
            with np.errstate(over="ignore", invalid="ignore"):   # the reference's exp overflow
                ref = REF.swiglu(g, v, limit)
            got = FAST.swiglu(g, v, limit)
            assert got.dtype == np.float32 and np.array_equal(got, ref, equal_nan=True), (shape, limit)


def test_store_kv_in_c():
    """The cpu backend's C KV storage rounding (FP8 E4M3 blocks of 64 on the non-RoPE dims, then
    F16) is numerics.py's, bit for bit: block scales across magnitudes, zero and signed-zero blocks,
    ties on both grids, F16 overflow at 65520, inf and NaN values."""
    from engine.backends.cpu import kernels
    from engine.model import numerics as N
    from engine.backends.cpu.ops import CpuOps
    if not kernels.available():
        pytest.skip("engine.backends.cpu._kernels is not built")
    rng = _rng(50)
    cases = [(rng.standard_normal((20, 512)) * s).astype(np.float32) for s in (1e-8, 1e-3, 1, 1000, 1e5, 1e30)]
    x = rng.standard_normal((12, 512)).astype(np.float32)
    x[0, :64], x[1, 5], x[2, 7], x[3, 100], x[4, :64] = 0, np.inf, np.nan, -np.inf, -0.0
    x[5, 448:], x[6, 448:], x[7, 448:], x[8, :64] = 70000, 65519.9, 65520, 448 * 2.0 ** -20
    x[9] = np.float32(2.0) ** rng.integers(-30, 20, 512).astype(np.float32) * rng.choice([-1, 1], 512)
    x[10] = np.resize(np.arange(-256, 256, dtype=np.float32) / 64, 512)       # exact ties
    cases.append(x)
    ops = CpuOps("ds4")
    for c in cases:
        for n_nope in (0, 64, 448, 512):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)       # the reference's inf / NaN casts
                ref = N.f16_round(N.fp8_e4m3_roundtrip(c, n_nope))
            got = ops.store_kv(c, n_nope)
            same = (got.view(np.uint32) == ref.view(np.uint32)) | (np.isnan(got) & np.isnan(ref))
            assert same.all(), (n_nope, np.argwhere(~same)[:3])
    assert ops.store_kv(x[None, :3], 448).shape == (1, 3, 512)
    assert CpuOps("exact").store_kv(x, 448) is x
    with pytest.raises(ValueError, match="multiple of 64"):
        ops.store_kv(x, 100)


@pytest.mark.parametrize("T,n,E", [(1, 4, 4096), (9, 4, 300), (3, 1, 7), (2, 16, 65), (70, 4, 1031)])
def test_hc_pre_mix_in_c(T, n, E):
    """The cpu backend's C hc_pre_mix takes the reference's arithmetic (float64 products summed
    over the streams in order, one rounding): bit for bit the reference's result."""
    from engine.backends.cpu import kernels
    from engine.backends.cpu.ops import CpuOps
    if not kernels.available():
        pytest.skip("engine.backends.cpu._kernels is not built")
    rng = _rng(7 * T + n + E)
    X, pre = f32(rng, T, n, E) * 3, 2 * rng.random((T, n)).astype(np.float32)
    got, ref = CpuOps.hc_pre_mix(pre, X), REF.hc_pre_mix(pre, X)
    check(f"C hc_pre_mix T={T} n={n} E={E}", got, ref)
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))
    assert not np.array_equal(CpuOps.hc_pre_mix(pre[:, ::-1].copy(), X), ref) or n == 1   # stream order counts
    with pytest.raises(ValueError, match="X"):
        kernels._K.hc_pre_mix(pre, X.reshape(T * n, E)[:-1], np.empty((T, E), np.float32))


@pytest.mark.parametrize("T,n,E", [(1, 4, 4096), (9, 4, 300), (3, 1, 7), (2, 16, 65)])
def test_hc_post_in_c(T, n, E):
    """The cpu backend's C hc_post takes the reference's arithmetic (float32 post * y, float64
    stream sums, one rounding): bit for bit the reference's result (checked at 100 %)."""
    from engine.backends.cpu import kernels
    from engine.backends.cpu.ops import CpuOps
    if not kernels.available():
        pytest.skip("engine.backends.cpu._kernels is not built")
    rng = _rng(T * n + E)
    X, y = f32(rng, T, n, E) * 3, f32(rng, T, E)
    post, C = 2 * rng.random((T, n)).astype(np.float32), rng.random((T, n, n)).astype(np.float32)
    got, ref = CpuOps.hc_post(y, X, post, C), REF.hc_post(y, X, post, C)
    check(f"C hc_post T={T} n={n} E={E}", got, ref)
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))
    # streams mixed by C transposed (C[t, j, k] weighs stream j into k): a swap is caught
    assert not np.array_equal(CpuOps.hc_post(y, X, post, np.swapaxes(C, 1, 2)), ref) or n == 1


@pytest.mark.parametrize("T,C", [(1, 700), (5, 33), (60, 5000)])
def test_indexer_scores(T, C):
    rng = _rng(T + C)
    H, D = 64, 128
    qi, keys, wts = f32(rng, T, H, D), f32(rng, C, D), np.abs(f32(rng, T, H))
    got, ref = FAST.indexer_scores(qi, keys, wts), REF.indexer_scores(qi, keys, wts)
    # the reference's float64 scores, bit for bit: they go to a top-k whose exact ties are common
    assert got.dtype == np.float64 and np.array_equal(got, ref)
    # the reference's query blocks (16M products each: 2 blocks at T=60, C=5000) change nothing
    full = np.einsum("th,thc->tc", wts.astype(np.float64),
                     np.maximum(np.einsum("thd,cd->thc", qi.astype(np.float64), keys.astype(np.float64)), 0.0))
    assert np.allclose(ref, full, rtol=1e-12, atol=1e-9)


def test_attention_threads_change_nothing():
    """Blocks of 8+ queries run on the kernels' thread count (Python threads, strided shares):
    the same values bit for bit as one thread (each query is computed alone either way)."""
    from engine.backends.cpu import kernels
    if not kernels.available():
        pytest.skip("engine.backends.cpu._kernels is not built (the thread count is the kernels')")
    rng = _rng(6)
    T, H, D = 20, 4, 64
    q, keys = _unit_rows(rng, T, H, D), _unit_rows(rng, 30, D)
    mask = rng.random((T, 30)) < 0.6
    sinks = f32(rng, H)
    prev = kernels.get_threads()
    try:
        got = {}
        for n in (1, 2, 3):
            kernels.set_threads(n)
            got[n] = FAST.attention(q, [(keys, mask)], sinks, 0.125)
    finally:
        kernels.set_threads(prev)
    assert np.array_equal(got[1], got[2]) and np.array_equal(got[1], got[3])
    check("attention threaded", got[2], REF.attention(q, [(keys, mask)], sinks, 0.125))
