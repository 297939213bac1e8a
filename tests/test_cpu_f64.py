"""The cpu backend's float ops sum in float64 and round to float32 once, as the NumPy reference does
(issue 22, part 1): their float32 results equal the reference's bit for bit.

Why bit for bit and not "to rounding": in ds4 numerics a one-ulp difference before a Q8 quantizer
flips an activation code now and then, and from there the cpu pass drifts away from the
reference's decisions. A product of two float32 values is exact in double, so two float64 sums of
the same products in different orders differ by far less than a float32 ulp; rounded to float32
they agree except where the exact sum lies within ~2^-29 ulp of a rounding boundary. The tests
allow that (at most 1 value in 10^5, and by one ulp), and print what they saw; a float32 sum
differs from the reference at most values, so the allowance cannot hide one.
"""
from __future__ import annotations

import numpy as np
import pytest

from engine.backends.cpu import kernels as K
from engine.backends.numpy.ops import NumpyOps
from engine.gguf import quants as Q

pytestmark = pytest.mark.skipif(not K.available(), reason="engine.backends.cpu._kernels is not built")

PLAIN = [Q.F32, Q.F16, Q.BF16]
QUANT = [Q.Q8_0, Q.Q2_K, Q.Q4_K, Q.IQ2_XXS, Q.MXFP4]
NAMES = {t: Q.FORMATS[t].name for t in PLAIN + QUANT}
REF = NumpyOps("ds4")


def _C():
    from engine.backends.cpu import _kernels
    return _kernels


@pytest.fixture
def isa_guard():
    C = _C()
    prev_isa, prev_thr, prev_inv = C.isa(), C.get_threads(), K.batch_invariant()
    yield C
    C.set_isa(prev_isa)
    C.set_threads(prev_thr)
    K.set_batch_invariant(prev_inv)


def _weights(t, rng, n_rows, n_in):
    f = Q.FORMATS[t]
    return Q.random_blocks(t, rng, n_rows * n_in // f.block_elems, 0.05).reshape(n_rows, -1)


def _same(name, got, ref, seen):
    """got == ref bit for bit, but for at most 1 value in 10^5 one ulp apart (module docstring)."""
    assert got.dtype == np.float32 == ref.dtype and got.shape == ref.shape, name
    diff = got.view(np.int32).astype(np.int64) - ref.view(np.int32).astype(np.int64)
    n = int(np.count_nonzero(diff))
    seen[0] += n
    seen[1] += got.size
    assert n <= got.size // 100_000 and np.abs(diff).max(initial=0) <= 1, (name, n, got.size)


def _report(what, seen):
    print(f"\n{what}: {seen[0]} of {seen[1]} values differ from the reference (by one ulp)")


@pytest.mark.parametrize("t", PLAIN + QUANT, ids=NAMES.get)
def test_matmul_is_the_references_float64_sum(t, isa_guard):
    """Every build, every path (T = 1, the in-register path, the panel; and the dequantize + BLAS
    path, the one without the extension), n_in with tails of the 16-value loops, against
    quants.matvec(..., accumulate=np.float64)."""
    C = isa_guard
    rng = np.random.default_rng(40 + t)
    be = Q.FORMATS[t].block_elems
    n_ins = [n for n in (256, 4096, 1000, 40) if n % be == 0]
    seen = [0, 0]
    for n_in in n_ins:
        w = _weights(t, rng, 37, n_in)
        for T in (1, 2, 3, 5, 64):
            x = rng.standard_normal((T, n_in), dtype=np.float32)
            ref = Q.matvec(t, w, x.T, accumulate=np.float64).T
            for isa in C.isas():
                C.set_isa(isa)
                for method in ("auto", "regs", "panel", "f64", "blas"):
                    if T == 1 and method in ("auto", "regs") and t not in K.F64_T1_TYPES:
                        continue               # the factored T = 1 kernels (float32; module docstring of kernels)
                    _same((NAMES[t], isa, method, n_in, T), K.matmul(t, w, x, method=method), ref, seen)
    _report(NAMES[t], seen)


@pytest.mark.parametrize("t", [Q.F16, Q.Q8_0, Q.IQ2_XXS], ids=NAMES.get)
def test_panel_column_blocks_round_once(t, isa_guard):
    """Wide inputs with many tokens go through the panel in column blocks: the partial sums stay
    float64 between blocks, so the result is still the reference's."""
    C = isa_guard
    rng = np.random.default_rng(70 + t)
    w = _weights(t, rng, 11, 3072)              # T * n_in * 4 > 1 MiB and n_in >= 2 blocks: blocked
    x = rng.standard_normal((200, 3072), dtype=np.float32)
    ref = Q.matvec(t, w, x.T, accumulate=np.float64).T
    seen = [0, 0]
    for isa in C.isas():
        C.set_isa(isa)
        _same((NAMES[t], isa), K.matmul(t, w, x, method="panel"), ref, seen)
    _report(f"{NAMES[t]} column blocks", seen)


def test_batch_invariance_holds_in_float64(isa_guard):
    """Batch-invariant mode: a token's float32 result is the same bits at T = 1, in the register
    path and in the panel (the float64 sums are taken in one order by all of them)."""
    C = isa_guard
    rng = np.random.default_rng(5)
    for isa in C.isas():
        C.set_isa(isa)
        K.set_batch_invariant(True)
        for t in (Q.F16, Q.Q4_K):
            w = _weights(t, rng, 45, 512 + 256)
            x = rng.standard_normal((70, 768), dtype=np.float32)
            full = K.matmul(t, w, x)
            for T in (1, 2, 3):
                assert np.array_equal(K.matmul(t, w, x[:T]).view(np.uint32), full[:T].view(np.uint32)), (isa, t, T)
        K.set_batch_invariant(False)


def _segments(rng, T, D, n_shared, n_perq, dense=False):
    keys = rng.standard_normal((n_shared, D)).astype(np.float32)
    mask = np.ones((T, n_shared), bool) if dense else rng.random((T, n_shared)) < 0.6
    mask[0] = False                             # query 0 attends no shared key
    kq = rng.standard_normal((T, n_perq, D)).astype(np.float32)
    mq = rng.random((T, n_perq)) < 0.8
    return [(keys, mask), (kq, mq)]


@pytest.mark.parametrize("T,H,D,n", [(1, 8, 512, 300), (3, 6, 72, 40), (64, 5, 128, 150), (70, 4, 16, 9)])
def test_attention_is_the_references(T, H, D, n, isa_guard):
    """C attention against NumpyOps.attention: shared and per-query segments, holes in the masks,
    heads not a multiple of 4, D with tails of the 8- and 32-value loops, a query that attends
    only the sink in one segment; every build with the kernel, one and two threads."""
    C = isa_guard
    rng = np.random.default_rng(T * 1000 + D)
    q = rng.standard_normal((T, H, D)).astype(np.float32) * 2
    sinks = rng.standard_normal(H).astype(np.float32)
    segs = _segments(rng, T, D, n, 7)
    scale = float(D) ** -0.5
    # the float64 form (NumpyOps' class attention): the C kernel's function. ds4 numerics at head dim
    # 128 take ds4's float32 loops instead (NumpyOps.attention_ds4, which CpuOps runs there too)
    ref = NumpyOps.attention(q, segs, sinks, scale)
    seen = [0, 0]
    for isa in C.isas():
        C.set_isa(isa)
        if not C.has_attention():
            continue
        for threads in (1, 2):
            C.set_threads(threads)
            _same((isa, threads), K.attention(q, segs, sinks, scale), ref, seen)
    assert seen[1] > 0
    _report(f"attention T={T} H={H} D={D}", seen)


def test_attention_a_query_with_only_the_sink():
    """No attended key anywhere: the sink alone, 0 (or NaN where it is -inf), as the reference."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 4, 32)).astype(np.float32)
    keys = rng.standard_normal((5, 32)).astype(np.float32)
    mask = np.zeros((2, 5), bool)
    mask[1, 2] = True
    sinks = np.array([0.5, -np.inf, 1.0, 2.0], np.float32)
    with np.errstate(invalid="ignore"):                     # (-inf - -inf in the reference)
        got, ref = K.attention(q, [(keys, mask)], sinks, 0.1), REF.attention(q, [(keys, mask)], sinks, 0.1)
    assert np.array_equal(got, ref, equal_nan=True)


def test_cpu_ops_take_the_references_indexer_scores():
    """The indexer's float64 scores go to a top-k with exact ties: the cpu backend's are the
    reference's, the same float64 bits."""
    from engine.backends.cpu.ops import CpuOps
    rng = np.random.default_rng(9)
    qi = rng.standard_normal((5, 64, 128)).astype(np.float32)
    keys = rng.standard_normal((300, 128)).astype(np.float32)
    wts = rng.standard_normal((5, 64)).astype(np.float32)
    got = CpuOps("ds4").indexer_scores(qi, keys, wts)
    assert got.dtype == np.float64 and np.array_equal(got, REF.indexer_scores(qi, keys, wts))


def test_a_cpu_pass_is_the_references(tmp_path):
    """Every op of a cpu pass in ds4 numerics is the reference's to the bit (integer kernels with
    ds4's float32 block sums, the F16 matvec in index order, ds4's float32 forms of attention, the
    HC split / sums / post / head, RoPE with cosf / sinf and the query's YaRN blend, the SwiGLU
    forms and the routed experts summed in slot order (csrc/ops_ds4.c), the reference's indexer sums): the
    logits of a 3-layer tiny model (a hash layer with the indexer, top-k routing, ratio-4 and
    ratio-128 compression) over 192 positions in chunks of 64 are identical, and so is every
    decision. (A build without the attention kernel runs the reference's own attention.)
    tests/test_cpu_fidelity.py does the same over 704 positions on three fresh models.
    The reference runs with its default q8_dot="ds4" (ds4's float32 block order, issue 33), which
    the integer kernels follow on every build."""
    from engine import Engine, Session
    from engine.gguf.synth import config_for, write_synthetic

    cfg, vocab = config_for("tiny", n_layer=3, ratios=[4, 128, 4], n_hash_layer=1, vocab=465)
    path = write_synthetic(tmp_path / "tiny.gguf", cfg, recipe="q2", vocab=vocab, seed=11).path
    logits = {}
    for backend in ("numpy", "cpu"):
        with Engine.open(path, backend=backend, numerics="ds4", paging="none") as eng:
            toks = np.random.default_rng(7).integers(0, eng.config.n_vocab, 192).tolist()
            logits[backend] = Session(eng, 200, chunk=64).sync(toks, keep_logits=True)
    assert np.array_equal(logits["cpu"], logits["numpy"])
