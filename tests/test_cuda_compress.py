"""compress.cu: the compressors' pooling on the device (Model._compress_store's ops.compress_pool
hook) against the glue's own array-op form (Model._pool_arrays on NumpyOps), on the host emulation.

The kernel takes the reference's float32 steps one by one (max, exp, the row-order sums, the
division and product rounded apart), so the only difference is expf's (NumPy's float32 exp is its
own SIMD code; the emulation's is the C library's, a device's its own): against the reference as
it is, the pooled rows are held to POOL_TOL; with the C library's expf put into the reference's
softmax, they must be its bits.
"""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from engine.backends.cupy import emu
from engine.backends.numpy.ops import NumpyOps
from engine.model.model import Model

sys.path.insert(0, str(Path(__file__).parent / "cuda_emu"))
from harness import Kernels, cupy_device, rel_err  # noqa: E402

# the emulation, and where CuPy sees a CUDA device the device too (scripts/gpu_check.sh): there
# the tolerance holds and the bit-for-bit check with the C library's expf is the emulation's only
RUNNERS = (["emu"] if emu.compiler() is not None else []) + (["cupy"] if cupy_device() else [])
pytestmark = pytest.mark.skipif(not RUNNERS, reason="neither g++ (the CUDA emulation) nor a CUDA device")

POOL_TOL = 1e-6        # relative (max-abs error over the largest |value|): expf within a few ulp


@pytest.fixture(scope="module", params=RUNNERS)
def K(request):
    return Kernels(runner=request.param)


def _case(rng, r, hd, n_win, lo_rows):
    """The frontier's rows (positions lo..) and n_win closed windows at its end, the first of them
    at position 0 where lo_rows is 0 (no previous window: ratio 4's -inf scores)."""
    w = 2 * hd if r == 4 else hd
    rows = lo_rows + n_win * r
    kv = rng.standard_normal((rows, w)).astype(np.float32)
    sc = (rng.standard_normal((rows, w)) * 4).astype(np.float32)
    lo = 0 if lo_rows == 0 else 1000 * r - lo_rows          # absolute position of row 0
    ws = lo + lo_rows + np.arange(n_win) * r                   # window starts (absolute)
    return kv, sc, ws, lo


def _reference(kv, sc, ws, lo, r, hd):
    glue = SimpleNamespace(xp=np, ops=NumpyOps())
    return Model._pool_arrays(glue, kv, sc, ws, lo, r, hd)


def _libm_expf():
    import ctypes
    import ctypes.util
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.expf.restype, libm.expf.argtypes = ctypes.c_float, [ctypes.c_float]
    return np.vectorize(lambda v: np.float32(libm.expf(float(v))), otypes=[np.float32])


@pytest.mark.parametrize("r,hd,n_win,lo_rows", [(4, 64, 3, 0), (4, 200, 2, 4), (128, 72, 2, 0)])
def test_compress_pool_matches_the_glue(K, monkeypatch, r, hd, n_win, lo_rows):
    rng = np.random.default_rng(r + hd)
    kv, sc, ws, lo = _case(rng, r, hd, n_win, lo_rows)
    got = K.compress_pool(kv, sc, ws - lo, ws >= r, r, hd, r == 4)
    assert not np.isnan(got).any()
    err = rel_err(got, _reference(kv, sc, ws, lo, r, hd))
    print(f"compress_pool r={r} hd={hd}: rel err {err:.2e} against NumPy's exp")
    assert err <= POOL_TOL
    if K.runner != "emu":
        return                          # a device's expf is its own
    # with the C library's expf in the reference's softmax (the emulation's expf), bit for bit
    exp, expf = np.exp, _libm_expf()
    monkeypatch.setattr(np, "exp", lambda x, *a, **k: expf(x) if np.asarray(x).dtype == np.float32 else exp(x, *a, **k))
    assert got.tobytes() == _reference(kv, sc, ws, lo, r, hd).tobytes()


def test_a_wrong_previous_window_fails():
    """The overlap's first half read from the window itself instead of the previous one."""
    if "emu" not in RUNNERS:
        pytest.skip("g++ is not installed: the broken kernel is built by the emulation")
    K = Kernels()
    bad = Kernels(patch={"compress.cu": ("(long long)(first - r + k) * w + j", "(long long)(first + k) * w + j")})
    rng = np.random.default_rng(3)
    kv, sc, ws, lo = _case(rng, 4, 64, 3, 4)
    ref = _reference(kv, sc, ws, lo, 4, 64)
    assert rel_err(K.compress_pool(kv, sc, ws - lo, ws >= 4, 4, 64, True), ref) <= POOL_TOL
    assert rel_err(bad.compress_pool(kv, sc, ws - lo, ws >= 4, 4, 64, True), ref) > 1e-3
