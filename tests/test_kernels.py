"""Tests for the C kernels (engine.backends.cpu._kernels via engine.backends.cpu.kernels) against the NumPy reference.

* dequantize_rows is bit-exact with quants.dequantize (compared as uint32 bit patterns), for every
  kernel build this machine can run (generic C, AVX2, AVX-512).
* matmul agrees with quants.matvec(..., accumulate=np.float64) to rounding: the reference sums in
  float64 and rounds once; the kernels accumulate in float32.  Bound, per output:

      |y - ref| <= (n_in / 16 + 64) * 2**-24 * A + 2**-24 * |ref|

  A = sum_k (|dl_k q_k| + |ml_k|) |x_k| is the sum of the magnitudes of everything the kernels add
  up (w = dl*q - ml for Q2_K/Q4_K, whose T = 1 kernels sum dl*q*x and ml*x separately; A = sum
  |w_k x_k| for the other formats).  Float32 summation of m terms errs by at most about
  m * 2**-24 times the sum of their magnitudes; the kernels keep 16-lane vector accumulators, so
  each lane adds at most n_in / 16 terms, and 64 covers the rest: the horizontal sum (4 levels),
  scale products, sub-block partial sums (up to 32 terms) and the per-call sums of x.  The
  observed error is far below (printed with -s).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.backends.cpu import kernels as K
from engine.gguf import quants as Q

needs_ext = pytest.mark.skipif(
    not K.available(), reason="engine.backends.cpu._kernels is not built (pip install -e . builds it when a C compiler is present)")

FORMATS = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q2_K, Q.Q4_K, Q.IQ2_XXS, Q.MXFP4]
NAMES = {t: Q.FORMATS[t].name for t in FORMATS}
U = 2.0 ** -24
# where the quant codes sit in a block (zeroing them leaves -ml per value: Q2_K/Q4_K minimums)
QS_BYTES = {Q.Q2_K: slice(16, 80), Q.Q4_K: slice(16, 144)}


def _C():
    from engine.backends.cpu import _kernels
    return _kernels


@pytest.fixture
def isa_guard():
    """Restore the kernel build and thread count after a test that changes them."""
    C = _C()
    prev_isa, prev_thr = C.isa(), C.get_threads()
    yield C
    C.set_isa(prev_isa)
    C.set_threads(prev_thr)


def weights(t, rng, n_rows, n_in, std=0.05):
    f = Q.FORMATS[t]
    return Q.random_blocks(t, rng, n_rows * n_in // f.block_elems, std).reshape(n_rows, -1)


def abs_weights(t, w):
    """float64 |dl*q| + |ml| per value (|w| for formats without minimums)."""
    deq = Q.dequantize(t, w).astype(np.float64)
    if t not in QS_BYTES:
        return np.abs(deq)
    f = Q.FORMATS[t]
    blocks = w.reshape(-1, f.block_bytes).copy()
    blocks[:, QS_BYTES[t]] = 0
    neg_ml = Q.dequantize(t, blocks.reshape(w.shape)).astype(np.float64)
    return np.abs(deq - neg_ml) + np.abs(neg_ml)


def shapes_for(t):
    be = Q.FORMATS[t].block_elems
    n_ins = [n for n in (256, 512, 4096) if n % be == 0]
    if be == 1:
        n_ins += [1, 33, 100]   # tails of the 16/32-wide loops
    elif be == 32:
        n_ins += [32, 96]
    return [(r, n) for r in (1, 7, 64) for n in n_ins]


# ---------------------------------------------------------------------------------------------


@needs_ext
def test_tables_match_quants():
    grid, ksigns = _C().tables()
    assert np.array_equal(np.frombuffer(grid, np.uint8).reshape(256, 8), Q.IQ2XXS_GRID_BYTES)
    assert np.array_equal(np.frombuffer(ksigns, np.uint8), Q.KSIGNS_IQ2XS)


@needs_ext
def test_isas():
    C = _C()
    assert "generic" in C.isas()
    assert C.isa() in C.isas()
    assert K.isa() == C.isa()
    with pytest.raises(ValueError):
        C.set_isa("no-such-isa")


def finite_f16_bits(rng, n):
    bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
    inf_nan = ((bits >> 10) & 31) == 31
    bits[inf_nan] ^= np.uint16(0x4000)
    return bits.view(np.uint8).reshape(n, 2)


def random_raw(t, rng, n_rows, n_in):
    """Uniformly random codes with finite scale fields (both signs, subnormal scales): the whole
    code space, not only the values random_blocks draws."""
    f = Q.FORMATS[t]
    n_blocks = n_rows * n_in // f.block_elems
    b = rng.integers(0, 256, size=(n_blocks, f.block_bytes), dtype=np.uint8)
    if t == Q.F32:
        b[:] = rng.standard_normal(n_blocks).astype(np.float32).view(np.uint8).reshape(n_blocks, 4)
    elif t == Q.F16:
        b[:] = finite_f16_bits(rng, n_blocks)
    elif t in (Q.Q8_0, Q.IQ2_XXS, Q.Q4_K):
        b[:, 0:2] = finite_f16_bits(rng, n_blocks)
        if t == Q.Q4_K:
            b[:, 2:4] = finite_f16_bits(rng, n_blocks)
    elif t == Q.Q2_K:
        b[:, 80:82] = finite_f16_bits(rng, n_blocks)
        b[:, 82:84] = finite_f16_bits(rng, n_blocks)
    return b.reshape(n_rows, -1)


def assert_bits_equal(a, b):
    assert a.dtype == np.float32 and b.dtype == np.float32 and a.shape == b.shape
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


@needs_ext
@pytest.mark.parametrize("t", FORMATS, ids=NAMES.get)
def test_dequantize_bit_exact(t, isa_guard):
    C = isa_guard
    rng = np.random.default_rng(100 + t)
    be = Q.FORMATS[t].block_elems
    cases = [weights(t, rng, 7, 512), weights(t, rng, 3, 4096, std=3.0), random_raw(t, rng, 5, 1024),
             random_raw(t, rng, 1, max(be, 32))]
    if t == Q.MXFP4:  # every exponent byte, including the subnormal 0 and 1 and the largest
        raw = random_raw(t, rng, 256, 32)
        raw[:, 0] = np.arange(256, dtype=np.uint8)
        cases.append(raw)
    if t in (Q.F16, Q.BF16):  # every 16-bit pattern: subnormals, infinities, NaNs
        cases.append(np.arange(1 << 16, dtype=np.uint16).view(np.uint8).reshape(64, -1))
    for isa in C.isas():
        C.set_isa(isa)
        for raw in cases:
            with np.errstate(over="ignore"):  # MXFP4 exponent 255 times 12 is inf
                ref = Q.dequantize(t, raw)
            assert_bits_equal(K.dequantize_rows(t, raw), ref)
        for th in (1, 2):
            C.set_threads(th)
            assert_bits_equal(K.dequantize_rows(t, cases[2]), Q.dequantize(t, cases[2]))


@needs_ext
@pytest.mark.parametrize("t", FORMATS, ids=NAMES.get)
def test_matmul_matches_reference(t, isa_guard):
    C = isa_guard
    rng = np.random.default_rng(200 + t)
    worst = 0.0      # max |diff| / bound
    worst_rel = 0.0  # max |diff| / max |ref|
    for n_rows, n_in in shapes_for(t):
        w = weights(t, rng, n_rows, n_in)
        aw = abs_weights(t, w)
        for T in (1, 3, 17):
            x = rng.standard_normal((T, n_in), dtype=np.float32)
            ref = Q.matvec(t, w, x.T, accumulate=np.float64).T
            A = np.abs(x.astype(np.float64)) @ aw.T
            bound = (n_in / 16 + 64) * U * A + U * np.abs(ref) + 1e-30
            for isa in C.isas():
                C.set_isa(isa)
                for method in ("auto", "regs", "panel"):
                    y = K.matmul(t, w, x, method=method)
                    assert y.shape == (T, n_rows) and y.dtype == np.float32 and y.flags.c_contiguous
                    diff = np.abs(y.astype(np.float64) - ref)
                    bad = diff > bound
                    assert not bad.any(), (isa, method, n_rows, n_in, T, diff[bad][:4], bound[bad][:4])
                    worst = max(worst, float(np.max(diff / bound)))
                    worst_rel = max(worst_rel, float(diff.max() / max(np.abs(ref).max(), 1e-30)))
    print(f"\n{NAMES[t]}: max |diff|/bound = {worst:.3g}, max |diff|/max|ref| = {worst_rel:.3g}")
    assert worst_rel < 1e-5


@needs_ext
@pytest.mark.parametrize("t", [Q.Q8_0, Q.IQ2_XXS, Q.F16])
def test_blas_path(t):
    rng = np.random.default_rng(300 + t)
    w = weights(t, rng, 300, 512)
    x = rng.standard_normal((5, 512), dtype=np.float32)
    ref = Q.matvec(t, w, x.T, accumulate=np.float64).T
    y = K.matmul(t, w, x, method="blas")
    assert y.shape == (5, 300) and y.flags.c_contiguous
    assert np.max(np.abs(y - ref)) <= 1e-5 * np.max(np.abs(ref))


@needs_ext
def test_memmap_and_strided_rows(tmp_path):
    rng = np.random.default_rng(7)
    t = Q.Q2_K
    w = weights(t, rng, 64, 1024)
    path = tmp_path / "w.bin"
    w.tofile(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r", shape=w.shape)
    x = rng.standard_normal((3, 1024), dtype=np.float32)
    for view, plain in ((mm, w), (mm[5:40], w[5:40]), (mm[::3], w[::3]), (mm[::-2], w[::-2])):
        for T in (1, 3, 17):
            xt = np.ascontiguousarray(np.resize(x, (T, 1024)))
            for method in ("auto", "regs", "panel"):
                assert np.array_equal(K.matmul(t, view, xt, method=method),
                                      K.matmul(t, np.ascontiguousarray(plain), xt, method=method))
        assert_bits_equal(K.dequantize_rows(t, view), Q.dequantize(t, np.ascontiguousarray(plain)))
    del mm


@needs_ext
def test_threads_give_identical_results(isa_guard):
    C = isa_guard
    rng = np.random.default_rng(8)
    for t in (Q.Q8_0, Q.IQ2_XXS, Q.Q4_K, Q.BF16):
        w = weights(t, rng, 203, 1024)
        for T in (1, 2, 9):
            x = rng.standard_normal((T, 1024), dtype=np.float32)
            out = []
            for th in (1, 2, 3):
                K.set_threads(th)
                assert K.get_threads() == th
                out.append(K.matmul(t, w, x))
                out.append(K.dequantize_rows(t, w))
            assert np.array_equal(out[0], out[2]) and np.array_equal(out[0], out[4])
            assert np.array_equal(out[1], out[3]) and np.array_equal(out[1], out[5])


@needs_ext
def test_batch_invariance(isa_guard):
    """set_batch_invariant(True): every token's row of the result is bit-identical whatever T,
    path or thread count."""
    C = isa_guard
    rng = np.random.default_rng(12)
    prev = K.set_batch_invariant(True)
    try:
        for isa in C.isas():
            C.set_isa(isa)
            for t in FORMATS:
                be = Q.FORMATS[t].block_elems
                n_in = 1024 + (40 if be == 1 else 0)
                w = weights(t, rng, 70, n_in)
                x = rng.standard_normal((11, n_in), dtype=np.float32)
                single = np.concatenate([K.matmul(t, w, x[i:i + 1]) for i in range(11)])
                for T in (2, 3, 5, 11):
                    for method in ("auto", "regs", "panel"):
                        for th in (1, 2):
                            K.set_threads(th)
                            y = K.matmul(t, w, x[:T], method=method)
                            assert np.array_equal(y, single[:T]), (isa, NAMES[t], T, method, th)
    finally:
        K.set_batch_invariant(prev)


@needs_ext
@pytest.mark.parametrize("bad", [0, -1, 1025, 1.5, "2", True, None])
def test_set_threads_rejects(bad):
    with pytest.raises(ValueError):
        K.set_threads(bad)


@needs_ext
def test_bad_arguments():
    rng = np.random.default_rng(9)
    w = weights(Q.Q8_0, rng, 8, 256)
    x = rng.standard_normal((2, 256), dtype=np.float32)
    bad_calls = [
        lambda: K.matmul(Q.Q8_0, w, x.astype(np.float64)),               # x dtype
        lambda: K.matmul(Q.Q8_0, w, np.asfortranarray(np.resize(x, (3, 256)))),  # x not C-contiguous
        lambda: K.matmul(Q.Q8_0, w, np.resize(x, (2, 512))[:, ::2]),     # x strided
        lambda: K.matmul(Q.Q8_0, w, x[0]),                               # x 1-D
        lambda: K.matmul(Q.Q8_0, w, x[:, :128]),                          # n_in mismatch
        lambda: K.matmul(Q.Q8_0, w.view(np.int8), x),                    # w dtype
        lambda: K.matmul(Q.Q8_0, w.reshape(2, 4, -1), x),                # w 3-D
        lambda: K.matmul(Q.Q8_0, w[:, :-1], x),                          # partial block
        lambda: K.matmul(Q.Q8_0, np.repeat(w, 2, axis=1)[:, ::2], x),    # row bytes strided
        lambda: K.matmul(Q.Q8_0, w.tolist(), x),                          # not an array
        lambda: K.matmul(Q.I32, w, x),                                    # not a float format
        lambda: K.matmul(13, w, x),                                       # unknown type
        lambda: K.matmul("Q8_0", w, x),
        lambda: K.matmul(Q.Q8_0, w, x, method="fast"),
        lambda: K.dequantize_rows(Q.Q8_0, w[:, :-2]),
        lambda: K.dequantize_rows(Q.Q8_0, w.astype(np.uint16)),
    ]
    for call in bad_calls:
        with pytest.raises(ValueError):
            call()
    # the C layer checks too (callers that bypass the wrapper)
    C = _C()
    y = np.empty((2, 8), np.float32)
    with pytest.raises(ValueError):
        C.matmul(Q.Q8_0, w, x, np.empty((2, 7), np.float32))
    with pytest.raises(ValueError):
        C.matmul(Q.Q8_0, w, x, np.empty((2, 8), np.float64))
    ro = np.empty((2, 8), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError):
        C.matmul(Q.Q8_0, w, x, ro)
    with pytest.raises(ValueError):
        C.matmul(Q.Q8_0, w, x.astype(np.float64), y)
    with pytest.raises(ValueError):
        C.matmul(Q.Q8_0, w[:, :-1], x, y)
    with pytest.raises(ValueError):
        C.matmul(99, w, x, y)
    with pytest.raises(ValueError):
        C.matmul(Q.Q8_0, w, x, y, 0, 7)


@needs_ext
def test_empty_shapes():
    rng = np.random.default_rng(10)
    w = weights(Q.Q4_K, rng, 6, 512)
    for method in ("auto", "regs", "panel", "blas"):
        assert K.matmul(Q.Q4_K, w, np.zeros((0, 512), np.float32), method=method).shape == (0, 6)
        assert K.matmul(Q.Q4_K, w[:0], np.ones((3, 512), np.float32), method=method).shape == (3, 0)
        y = K.matmul(Q.F32, np.zeros((4, 0), np.uint8), np.zeros((2, 0), np.float32), method=method)
        assert y.shape == (2, 4) and not y.any()
    assert K.dequantize_rows(Q.Q4_K, w[:0]).shape == (0, 512)


def test_numpy_fallback_without_extension(monkeypatch):
    rng = np.random.default_rng(11)
    w = weights(Q.IQ2_XXS, rng, 9, 512)
    x = rng.standard_normal((4, 512), dtype=np.float32)
    ref = Q.matvec(Q.IQ2_XXS, w, x.T, accumulate=np.float64).T
    monkeypatch.setattr(K, "_K", None)
    assert not K.available() and K.isa() is None
    assert np.max(np.abs(K.matmul(Q.IQ2_XXS, w, x) - ref)) <= 1e-5 * np.max(np.abs(ref))
    assert_bits_equal(K.dequantize_rows(Q.IQ2_XXS, w), Q.dequantize(Q.IQ2_XXS, w))
    with pytest.raises(RuntimeError):
        K.matmul(Q.IQ2_XXS, w, x, method="fused")


@needs_ext
def test_extension_built_from_these_sources():
    # the extension is optional: a rebuild that fails leaves the previous binary in place, and
    # every other test here would then test old code
    assert K.build_is_current() is not False, "engine.backends.cpu._kernels is stale: rebuild with pip install -e ."


@needs_ext
@pytest.mark.parametrize("t", [Q.F16, Q.Q8_0, Q.Q2_K, Q.IQ2_XXS], ids=NAMES.get)
def test_panel_column_blocks(t, isa_guard):
    """Wide inputs with many tokens take the panel path in column blocks (partial sums added into
    y): still the reference to rounding, and the same bound."""
    C = isa_guard
    rng = np.random.default_rng(500 + t)
    n_rows, n_in, T = 9, 3072, 200           # T * n_in * 4 > 1 MiB and n_in >= 2 blocks: blocked
    w = weights(t, rng, n_rows, n_in)
    aw = abs_weights(t, w)
    x = rng.standard_normal((T, n_in), dtype=np.float32)
    ref = Q.matvec(t, w, x.T, accumulate=np.float64).T
    bound = (n_in / 16 + 64) * U * (np.abs(x.astype(np.float64)) @ aw.T) + U * np.abs(ref) + 1e-30
    for isa in C.isas():
        C.set_isa(isa)
        y = K.matmul(t, w, x, method="panel")
        diff = np.abs(y.astype(np.float64) - ref)
        assert not (diff > bound).any(), (isa, diff.max())
        assert diff.max() / np.abs(ref).max() < 1e-5


def test_kernel_sources_read_no_uninitialized_variable():
    """The C sources compile without an uninitialized-variable warning in our own files. Such a read
    cannot show in results when it only repeats work (a macro's `for (r = (R0)...)` given `r` read
    r = r and recomputed rows from wherever r pointed: same values, 1.4-30x the time), so the
    compiler's flow analysis is the test (-O2 -Wuninitialized -Winit-self; the system headers'
    own warnings are ignored)."""
    import os
    import shutil
    import subprocess
    import sysconfig

    from engine.backends.cpu.kernel_sources import SOURCES
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if not shutil.which(cc):
        pytest.skip(f"no C compiler ({cc}) to analyse the kernel sources with")
    root = str(Path(K.__file__).resolve().parents[3])   # the project root: engine/backends/cpu/kernels.py
    if not all(os.path.exists(os.path.join(root, s)) for s in SOURCES):
        pytest.skip("the C sources are not next to the package (an installed wheel)")
    procs = {src: subprocess.Popen([cc, "-O2", "-std=gnu11", "-fopenmp", "-Wuninitialized", "-Winit-self", "-c",
                                    "-o", os.devnull, f"-I{sysconfig.get_paths()['include']}", os.path.join(root, src)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=root)
             for src in SOURCES}                  # (all at once: ~4 s on 2 cores)
    done = {src: (p.communicate()[1], p.returncode) for src, p in procs.items()}
    found = []
    for src, (err, rc) in done.items():
        if rc:
            pytest.skip(f"{cc} cannot compile {src} here: {err.strip()[-300:]}")
        found += [ln for ln in err.splitlines() if "uninitialized" in ln and "engine/" in ln]
    assert not found, "\n".join(found)
