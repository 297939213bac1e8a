"""The integer-activation kernels (ds4 numerics): engine.backends.cpu.kernels.matmul_q8 and its quantizers.

ds4 quantizes the input of a Q8_0-weight matmul to Q8_0 blocks and the routed experts' input to
Q8_K blocks, then takes integer dot products.  The kernels do the same, so:

* the C quantizers equal engine/model/numerics.py's q8_0_quantize / q8_k_quantize bit for bit (codes,
  scale bit patterns, and the Q8_K sums of 16 codes), including ties and all-zero blocks;
* matmul_q8(t, w, x) equals quants.matvec(t, w, numerics.q8_*_round(x)) in float64 up to the
  float32 accumulation of the per-block products (the integer sums are exact), for every kernel
  build this machine can run and every token count of the 4-token passes;
* the thread count does not change a result, bad arguments are ValueErrors, and without the
  extension matmul_q8 is the rounding followed by the float matmul.
"""
from __future__ import annotations

import numpy as np
import pytest

from engine.backends.cpu import kernels as K
from engine.model import numerics as N
from engine.gguf import quants as Q

from test_kernels import U, abs_weights, isa_guard, needs_ext, weights  # noqa: F401 (fixture)

Q8_TYPES = [Q.Q8_0, Q.IQ2_XXS, Q.Q2_K]
NAMES = {t: Q.FORMATS[t].name for t in Q8_TYPES}


def _C():
    from engine.backends.cpu import _kernels
    return _kernels


def tricky_rows(rng, n):
    """Rows that exercise the quantizers' edge cases."""
    rows = [rng.standard_normal(n) * 3,
            np.zeros(n),                                              # all-zero blocks
            np.tile([0.5, -0.5, 1.5, -1.0], n // 4) * 127 / 127,     # exact ties of x * 127 / amax
            np.tile([-2.0, 2.0, 1.0, 0.0], n // 4),                   # |max| tie: the first one wins (negative)
            rng.standard_normal(n) * 1e-30,                           # tiny (subnormal products)
            rng.standard_normal(n) * 1e30,
            np.where(rng.random(n) < 0.9, 0.0, rng.standard_normal(n))]  # sparse
    r = rng.standard_normal(n)
    r[::32] = 127.0 / 2                                               # x * id exactly on .5 steps
    rows.append(r)
    return np.array(rows, dtype=np.float32)


@needs_ext
@pytest.mark.parametrize("block", [32, 256])
def test_quantizers_bit_exact(block, isa_guard):
    C = isa_guard
    rng = np.random.default_rng(block)
    ref_fn = N.q8_0_quantize if block == 32 else N.q8_k_quantize
    for isa in C.isas():                 # each build's quantizer loops (set_isa switches them)
        C.set_isa(isa)
        for row in tricky_rows(rng, 1024):
            q, d, s = C.quantize_q8(block, row)
            q = np.frombuffer(q, np.int8)
            d = np.frombuffer(d, np.float32)
            rq, rd = ref_fn(row)
            assert np.array_equal(q, rq.reshape(-1)), isa
            assert np.array_equal(d.view(np.uint32), rd.reshape(-1).view(np.uint32)), isa
            assert q.min() >= -127        # the kernels' sign trick relies on it
            if block == 256:
                sums = rq.reshape(-1, 16).astype(np.int32).sum(axis=1)
                assert np.array_equal(np.frombuffer(s, np.int16), sums), isa
    with pytest.raises(ValueError):
        C.quantize_q8(64, np.zeros(64, np.float32))
    with pytest.raises(ValueError):
        C.quantize_q8(256, np.zeros(100, np.float32))


@needs_ext
@pytest.mark.parametrize("block", [32, 256])
def test_quantizers_decide_tiny_and_nan_blocks_as_numerics(block, isa_guard):
    # a block whose largest magnitude is below ~3.7e-37 (127 / amax overflows to inf) and a block
    # with a NaN: every build's codes equal numerics' decision (+-127, never -128; NaN -> 0)
    C = isa_guard
    rng = np.random.default_rng(40 + block)
    x = rng.standard_normal(4 * block).astype(np.float32)
    x[block:2 * block] *= np.float32(1e-38)                  # tiny, with zeros among them
    x[block + 3 :: 5][:block // 5 - 1] = 0.0
    x[2 * block + 9] = np.nan
    ref_fn = N.q8_0_quantize if block == 32 else N.q8_k_quantize
    rq, rd = ref_fn(x)
    rq, rd = rq.reshape(-1), rd.reshape(-1)
    assert rq.min() == -127 and rq.max() == 127 and np.all(rq[2 * block:3 * block] == 0)
    assert np.any(rq[block:2 * block] == 0)                  # the zeros of the tiny block stay 0
    for isa in C.isas():
        C.set_isa(isa)
        q, d, s = C.quantize_q8(block, x)
        q, d = np.frombuffer(q, np.int8), np.frombuffer(d, np.float32)
        assert np.array_equal(q, rq), isa
        assert np.array_equal(np.isnan(d), np.isnan(rd)) and np.array_equal(d[~np.isnan(d)], rd[~np.isnan(rd)]), isa
        if block == 256:
            assert np.array_equal(np.frombuffer(s, np.int16), rq.reshape(-1, 16).astype(np.int32).sum(axis=1)), isa
        got = K.round_q8(x[None], block)[0]
        want = N.q8_0_round(x) if block == 32 else N.q8_k_round(x)
        assert np.array_equal(got, want, equal_nan=True), isa


def _round(t, x):
    return N.q8_0_round(x) if t == Q.Q8_0 else N.q8_k_round(x)


def _check_q8_against_reference(t, rng, rows, n_ins, Ts, isas, label):
    """matmul_q8 on random weights and activations (scaled by 0.01 / 1 / 30 per token, the first
    token's first block all zeros) against quants.matvec(float64) of the rounded activations,
    within the float32 bound, on every build in isas."""
    worst = worst_rel = 0.0
    for n_rows in rows:
        for n_in in n_ins:
            w = weights(t, rng, n_rows, n_in)
            aw = abs_weights(t, w)
            for T in Ts:
                x = (rng.standard_normal((T, n_in)) * rng.choice([0.01, 1.0, 30.0], (T, 1))).astype(np.float32)
                x[0, :32] = 0.0
                xr = _round(t, x)
                ref = Q.matvec(t, w, xr.T, accumulate=np.float64).T
                # exact integer sums per block; float32 accumulation of one product per block
                # (or 16 sub-block terms for the Q2_K minimums) plus the horizontal sum
                bound = (n_in / 16 + 64) * U * (np.abs(xr.astype(np.float64)) @ aw.T) + U * np.abs(ref) + 1e-30
                for isa in isas():
                    y = K.matmul_q8(t, w, x)
                    assert y.shape == (T, n_rows) and y.dtype == np.float32
                    diff = np.abs(y.astype(np.float64) - ref)
                    assert not (diff > bound).any(), (isa, n_rows, n_in, T, diff.max())
                    worst = max(worst, float(np.max(diff / bound)))
                    worst_rel = max(worst_rel, float(diff.max() / max(np.abs(ref).max(), 1e-30)))
    print(f"\n{NAMES[t]} x q8 {label}: max |diff|/bound = {worst:.3g}, max |diff|/max|ref| = {worst_rel:.3g}")
    assert worst_rel < 3e-5     # a backstop to the bound; summation order differs per build


def _switching(C, isas):
    """each of these kernel builds in turn, made current"""
    for isa in isas:
        C.set_isa(isa)
        yield isa


@needs_ext
@pytest.mark.parametrize("t", Q8_TYPES, ids=NAMES.get)
def test_matmul_q8_matches_rounded_reference(t, isa_guard):
    C = isa_guard
    assert K.has_q8(t)
    _check_q8_against_reference(t, np.random.default_rng(300 + t), (1, 7, 37),
                                [256, 512, 4096] + ([32, 96] if t == Q.Q8_0 else []), (1, 2, 3, 4, 5, 9),
                                lambda: _switching(C, C.isas()), "row kernels")


@needs_ext
def test_matmul_q8_threads_and_strided_rows(isa_guard):
    C = isa_guard
    rng = np.random.default_rng(5)
    for t in Q8_TYPES:
        w = weights(t, rng, 96, 1024)
        x = rng.standard_normal((3, 1024), dtype=np.float32)
        C.set_threads(1)
        y1 = K.matmul_q8(t, w, x)
        C.set_threads(2)
        assert np.array_equal(y1, K.matmul_q8(t, w, x))
        # a row slice of a larger matrix is read in place (rows 10..59)
        assert np.array_equal(K.matmul_q8(t, w[10:60], x), y1[:, 10:60])


@needs_ext
def test_matmul_q8_bad_arguments():
    rng = np.random.default_rng(6)
    w = weights(Q.Q8_0, rng, 4, 64)
    with pytest.raises(ValueError, match="no quantized-activation"):
        K.matmul_q8(Q.Q4_K, weights(Q.Q4_K, rng, 4, 256), np.zeros((1, 256), np.float32))
    with pytest.raises(ValueError, match="columns"):
        K.matmul_q8(Q.Q8_0, w, np.zeros((1, 32), np.float32))
    with pytest.raises(ValueError, match="float32"):
        K.matmul_q8(Q.Q8_0, w, np.zeros((1, 64), np.float64))
    with pytest.raises(ValueError):
        _C().matmul_q8_batch(Q.Q4_K, [weights(Q.Q4_K, rng, 4, 256)], [np.zeros((1, 256), np.float32)],
                             [np.zeros((1, 4), np.float32)])
    assert K.matmul_q8(Q.Q8_0, w, np.zeros((0, 64), np.float32)).shape == (0, 4)


def test_matmul_q8_fallback_without_extension(monkeypatch):
    rng = np.random.default_rng(7)
    w = weights(Q.IQ2_XXS, rng, 9, 512)
    x = rng.standard_normal((2, 512), dtype=np.float32)
    ref = Q.matvec(Q.IQ2_XXS, w, N.q8_k_round(x).T, accumulate=np.float64).T
    monkeypatch.setattr(K, "_K", None)
    assert not K.has_q8(Q.IQ2_XXS)
    assert np.max(np.abs(K.matmul_q8(Q.IQ2_XXS, w, x) - ref)) <= 1e-5 * np.max(np.abs(ref))


@needs_ext
def test_matmul_q8_batch_equals_separate_calls(isa_guard):
    C = isa_guard
    rng = np.random.default_rng(8)
    for t in Q8_TYPES:
        ws = [weights(t, rng, n, 512) for n in (16, 7, 64, 1, 33)]
        xs = [rng.standard_normal((T, 512), dtype=np.float32) for T in (1, 3, 0, 5, 1)]
        for isa in C.isas():
            C.set_isa(isa)
            for thr in (1, 2, 3):
                C.set_threads(thr)
                ys = K.matmul_q8_batch(t, ws, xs)
                for w, x, y in zip(ws, xs, ys):
                    assert y.shape == (x.shape[0], w.shape[0])
                    assert np.array_equal(y, K.matmul_q8(t, w, x)), (isa, thr, t)
    assert K.matmul_q8_batch(Q.Q8_0, [], []) == []
    with pytest.raises(ValueError, match="inputs"):
        K.matmul_q8_batch(Q.Q8_0, ws[:2], xs[:1])
    with pytest.raises(ValueError, match="columns"):
        K.matmul_q8_batch(Q.Q8_0, [weights(Q.Q8_0, rng, 4, 64)], [np.zeros((1, 32), np.float32)])


@needs_ext
@pytest.mark.parametrize("block", [32, 256])
def test_round_q8_bit_exact(block, isa_guard):
    C = isa_guard
    rng = np.random.default_rng(9 + block)
    x = np.concatenate([tricky_rows(rng, 1024), rng.standard_normal((40, 1024)).astype(np.float32)])
    ref = N.q8_0_round(x) if block == 32 else N.q8_k_round(x)
    for isa in C.isas():
        C.set_isa(isa)
        for thr in (1, 2):
            C.set_threads(thr)
            got = K.round_q8(x, block)
            assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), (isa, thr)
    assert K.round_q8(x[:0], block).shape == (0, 1024)
    with pytest.raises(ValueError):
        K.round_q8(x, 64)


# ---- the GEMM form (many tokens; AVX-512 VNNI and AVX2 builds): weight panels decoded and repacked once ----

def _gemm_isas(C):
    """the builds with the GEMM form (avx2, avx512, and avx512vbmi with its own IQ2_XXS decoder)"""
    return [isa for isa in C.isas() if (C.set_isa(isa), K.q8_gemm_min_t(Q.Q8_0))[1]]


@needs_ext
def test_every_simd_build_has_the_gemm_form(isa_guard):
    """The AVX2 and AVX-512 builds carry the GEMM form for all three integer formats, with a minimum
    past the row kernels' first tokens (the GEMM tests above skip where no build has it, so losing
    a build's form would otherwise pass unnoticed); the portable build has none."""
    C = isa_guard
    for isa in C.isas():
        C.set_isa(isa)
        mins = {t: K.q8_gemm_min_t(t) for t in Q8_TYPES}
        if isa == "generic":
            assert set(mins.values()) == {0}, mins
        else:
            assert all(2 <= m <= 16 for m in mins.values()), (isa, mins)


@pytest.fixture
def gemm_forced(isa_guard):
    """The GEMM form for every T (its minimum set to 1), restored afterwards; skips where this
    machine has no build with it."""
    C = isa_guard
    have = _gemm_isas(C)
    if not have:
        C.set_isa(C.isas()[-1])
        pytest.skip("no kernel build with the integer GEMM form on this machine (it needs AVX2 or AVX-512 VNNI)")
    C.set_isa(have[0])
    prev = {t: C.q8_gemm_min_t(t) for t in Q8_TYPES}
    for t in Q8_TYPES:
        C.q8_gemm_min_t(t, 1)
    yield C
    for t in prev:
        C.q8_gemm_min_t(t, 0)


@needs_ext
def test_q8_gemm_min_t_reset_restores_each_builds_default(isa_guard):
    """q8_gemm_min_t(t, n) sets every build's minimum; n = 0 puts back each build's own default
    (the builds differ: the VBMI IQ2_XXS row kernel moves its crossover)."""
    C = isa_guard
    have = _gemm_isas(C)
    if not have:
        pytest.skip("no kernel build with the integer GEMM form on this machine (it needs AVX2 or AVX-512 VNNI)")
    before = {(isa, t): (C.set_isa(isa), C.q8_gemm_min_t(t))[1] for isa in have for t in Q8_TYPES}
    assert all(v >= 1 for v in before.values())
    for t in Q8_TYPES:
        C.q8_gemm_min_t(t, 3)
    assert all((C.set_isa(isa), C.q8_gemm_min_t(t))[1] == 3 for isa in have for t in Q8_TYPES)
    for t in Q8_TYPES:
        C.q8_gemm_min_t(t, 0)
    assert {(isa, t): (C.set_isa(isa), C.q8_gemm_min_t(t))[1] for isa in have for t in Q8_TYPES} == before


@needs_ext
@pytest.mark.parametrize("t", Q8_TYPES, ids=NAMES.get)
def test_q8_gemm_matches_rounded_reference(t, gemm_forced):
    """Row counts around the panels (AVX-512: 16 and 32 rows, AVX2: 8 and 16; tails are masked),
    n_in not a multiple of 64 (Q8_0: padded codes), token counts around the tiles (4 and 2 tokens)."""
    C = gemm_forced
    _check_q8_against_reference(t, np.random.default_rng(400 + t), (1, 15, 16, 17, 33, 50),
                                [256, 1024] + ([32, 96, 4096] if t == Q.Q8_0 else []), (1, 3, 4, 5, 9),
                                lambda: _switching(C, _gemm_isas(C)), "GEMM form")


@needs_ext
@pytest.mark.parametrize("t", Q8_TYPES, ids=NAMES.get)
def test_q8_row_kernels_match_reference_at_many_tokens(t, isa_guard):
    """The row kernels take 8 tokens per pass (AVX-512) and the rest in a tail; with the GEMM form
    off they serve every T (as in batch-invariant mode)."""
    C = isa_guard
    C.q8_gemm_min_t(t, 1000)
    try:
        _check_q8_against_reference(t, np.random.default_rng(500 + t), (3, 17), [512], (8, 12, 17),
                                    lambda: _switching(C, C.isas()), "row kernels, many tokens")
    finally:
        C.q8_gemm_min_t(t, 0)


@needs_ext
def test_q8_gemm_token_results_do_not_depend_on_T_or_threads(gemm_forced):
    """A token's sums run in the same order whatever its tile, its place in it, T or the threads."""
    C = gemm_forced
    rng = np.random.default_rng(11)
    for t in Q8_TYPES:
        w = weights(t, rng, 48, 512)
        x = rng.standard_normal((11, 512)).astype(np.float32)
        C.set_threads(2)
        y = K.matmul_q8(t, w, x)
        for i in range(11):
            assert np.array_equal(K.matmul_q8(t, w, x[i:i + 1])[0], y[i]), (t, i)
        C.set_threads(1)
        assert np.array_equal(K.matmul_q8(t, w, x[3:10]), y[3:10])
        # a batch mixing the GEMM form with row-kernel jobs (min T above some of them) is the same
        C.q8_gemm_min_t(t, 4)
        ys = K.matmul_q8_batch(t, [w, w[5:40], w], [x, x[:2], x[:4]])
        assert np.array_equal(ys[0], y) and np.array_equal(ys[2], y[:4])
        C.q8_gemm_min_t(t, 100)
        assert np.array_equal(ys[1], K.matmul_q8(t, w[5:40], x[:2]))
        C.q8_gemm_min_t(t, 1)


@needs_ext
def test_q8_gemm_off_in_batch_invariant_mode(isa_guard):
    """Batch-invariant mode keeps one kernel for every T, the row kernels: the GEMM form is off, the
    integer kernels are chosen at every T, and a token's result does not depend on T."""
    rng = np.random.default_rng(13)
    prev = K.set_batch_invariant(True)
    try:
        assert K.batch_invariant()
        for t in Q8_TYPES:
            assert K.q8_gemm_min_t(t) == 0 and K.q8_beats_float(t, 512)
            w = weights(t, rng, 40, 512)
            x = rng.standard_normal((20, 512)).astype(np.float32)
            y = K.matmul_q8(t, w, x)
            assert all(np.array_equal(K.matmul_q8(t, w, x[i:i + 1])[0], y[i]) for i in range(20)), t
    finally:
        K.set_batch_invariant(prev)
    assert not K.batch_invariant() or prev


@needs_ext
def test_q8_one_token_rows_equal_the_many_token_rows(isa_guard):
    """One token (decode) takes its own row paths on some builds (AVX-512: Q8_0 block pairs; VBMI:
    IQ2_XXS two rows packed per block): bit for bit the row kernels at more tokens, on every build,
    odd and even row counts, row slices of a larger matrix."""
    C = isa_guard
    rng = np.random.default_rng(14)
    prev = K.set_batch_invariant(True)          # the row kernels at every T
    try:
        for isa in C.isas():
            C.set_isa(isa)
            for t in Q8_TYPES:
                for n_rows, n_in in ((1, 256), (2, 512), (7, 1024), (33, 2304)):
                    w = weights(t, rng, n_rows + 3, n_in)[2:2 + n_rows]
                    x = rng.standard_normal((6, n_in)).astype(np.float32)
                    y = K.matmul_q8(t, w, x)
                    for i in (0, 5):
                        assert np.array_equal(K.matmul_q8(t, w, x[i:i + 1])[0], y[i]), (isa, t, n_rows, n_in, i)
    finally:
        K.set_batch_invariant(prev)


@needs_ext
def test_matmul_q8_batch_one_token_array_forms(isa_guard):
    """One token a product: xs as one array (shared [1, n_in] or a row each) and ys as one array
    (a row each) give each product's own result bit for bit, on every build; a shared input is
    quantized once a format (Q8_0 / Q8_K, and each row kernel's order), which changes nothing."""
    C = isa_guard
    rng = np.random.default_rng(15)
    types = [Q.Q8_0, Q.Q8_0, Q.IQ2_XXS, Q.IQ2_XXS, Q.Q2_K, Q.IQ2_XXS, Q.Q2_K, Q.Q8_0]
    ws = [weights(t, rng, 24, 512) for t in types]
    x1 = rng.standard_normal((1, 512)).astype(np.float32)
    xn = rng.standard_normal((len(types), 512)).astype(np.float32)
    for isa in C.isas():
        C.set_isa(isa)
        for thr in (1, 2):
            C.set_threads(thr)
            for xs in (x1, xn):
                ref = [K.matmul_q8(t, w, xs[min(i, len(xs) - 1):][:1]) for i, (t, w) in enumerate(zip(types, ws))]
                Y = np.full((len(types), 24), np.nan, np.float32)
                K.matmul_q8_into(types, ws, xs, Y)
                assert all(np.array_equal(Y[i], r[0]) for i, r in enumerate(ref)), (isa, thr, len(xs))
                ys = [np.empty((1, 24), np.float32) for _ in types]
                K.matmul_q8_into(types, ws, [xs[min(i, len(xs) - 1):][:1] for i in range(len(types))], ys)
                assert all(np.array_equal(y, r) for y, r in zip(ys, ref)), (isa, thr, len(xs))
    with pytest.raises(ValueError, match="1 or 8 rows"):
        K.matmul_q8_into(types, ws, xn[:3], np.empty((8, 24), np.float32))
    with pytest.raises(ValueError, match="columns"):
        K.matmul_q8_into(types, ws, np.zeros((1, 256), np.float32), np.empty((8, 24), np.float32))
    with pytest.raises(ValueError, match="ys"):
        K.matmul_q8_into(types, ws, x1, np.empty((8, 23), np.float32))
    with pytest.raises(ValueError, match="ys"):          # a list of inputs of 2 tokens into one array
        K.matmul_q8_into(types, ws, [np.zeros((2, 512), np.float32)] * 8, np.empty((8, 24), np.float32))
    with pytest.raises(ValueError, match="xs"):
        K.matmul_q8_into(types, ws, np.zeros((1, 512), np.float64), np.empty((8, 24), np.float32))


@needs_ext
def test_matmul_q8_mixed_equals_separate_calls(isa_guard):
    """Products of different weight types in one parallel region give each product's own result,
    bit for bit (rows are split over threads by unit; a unit's arithmetic does not depend on it)."""
    C = isa_guard
    rng = np.random.default_rng(12)
    types = [Q.Q8_0, Q.IQ2_XXS, Q.Q2_K, Q.Q8_0, Q.IQ2_XXS]
    ws = [weights(t, rng, n, 512) for t, n in zip(types, (40, 16, 33, 7, 64))]
    for T in (1, 3, 12):
        xs = [rng.standard_normal((T, 512)).astype(np.float32) for _ in types]
        for thr in (1, 2):
            C.set_threads(thr)
            ys = K.matmul_q8_mixed(types, ws, xs)
            for t, w, x, y in zip(types, ws, xs, ys):
                assert np.array_equal(y, K.matmul_q8(t, w, x)), (t, T, thr)
    with pytest.raises(ValueError, match="types"):
        K.matmul_q8_mixed(types[:2], ws, xs)
    with pytest.raises(ValueError, match="no quantized-activation"):
        K.matmul_q8_mixed([Q.Q4_K], [weights(Q.Q4_K, rng, 4, 256)], [np.zeros((1, 256), np.float32)])
    with pytest.raises(ValueError):   # a weight of another format than its type says
        _C().matmul_q8_batch([Q.Q8_0, Q.Q2_K], ws[:2], xs[:2], [np.zeros((12, 40), np.float32)] * 2)
