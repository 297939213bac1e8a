"""engine/backends/mlx/numerics.py against the NumPy spec engine/model/numerics.py: bit equality.

Inputs mix normal data at many magnitudes with the edge cases that decide roundings: zeros and -0.0,
all-equal blocks, huge and subnormal values, exact ties at rounding boundaries, and block maxima just
above powers of two (where the spec's float32 log2 decides the scale).
"""
from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install -e '.[mlx]')")

from engine.backends.mlx import numerics as M  # noqa: E402
from engine.model import numerics as N  # noqa: E402

# the NumPy spec itself warns on the huge and subnormal blocks (127 / amax overflows to inf, 2^128)
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]


def _bits_equal(got, ref, what: str) -> None:
    g = np.array(got).astype(np.float32)
    r = np.asarray(ref, dtype=np.float32)
    assert g.shape == r.shape, (what, g.shape, r.shape)
    bad = np.nonzero(g.view(np.uint32) != r.view(np.uint32))
    assert bad[0].size == 0, f"{what}: {bad[0].size} values differ, e.g. got {g[bad][:4]} want {r[bad][:4]}"


def _data(rng: np.random.Generator, rows: int, width: int, block: int) -> np.ndarray:
    """float32 [rows, width]: per block a random magnitude in 2^-30..2^30, plus edge-case blocks."""
    x = rng.standard_normal((rows, width)).astype(np.float32)
    mag = np.exp2(rng.integers(-30, 31, size=(rows, width // block, 1))).astype(np.float32)
    x = (x.reshape(rows, -1, block) * mag).reshape(rows, width)
    x[0] = 0.0
    x[1] = -0.0
    x[2] = np.float32(1.5)                                   # all equal
    x[3] = -np.float32(3.0e-41)                              # subnormal, negative
    x[4, ::3] = np.float32(1e35)                             # huge (hadamard sums stay finite)
    x[5] = rng.standard_normal(width).astype(np.float32) * np.float32(1e-39)
    x[6, 1::2] = -0.0
    x[7] = rng.integers(-200, 200, size=width).astype(np.float32) * np.float32(0.5)   # many ties
    return x


@pytest.fixture(scope="module")
def rng():
    return np.random.default_rng(20)


def test_f16_round(rng):
    x = _data(rng, 16, 256, 32)
    x[8, :6] = [65504.0, 65519.0, 65520.0, 1e6, 2.0**-25, 2.0**-24 * 1.5]   # max, tie to max, inf, under
    _bits_equal(M.f16_round(mx.array(x)), N.f16_round(x), "f16_round")


@pytest.mark.parametrize("width", [256, 96, 70])
def test_q8_0_round(rng, width):
    x = _data(rng, 16, 256, 32)[:, :width].copy()
    # exact ties of x * (127 / amax): amax 127 -> id 1, values k + 0.5
    x[9, :32] = np.arange(-15.5, 16.5, 1.0, dtype=np.float32)[:32]
    x[9, 31] = 127.0
    _bits_equal(M.q8_0_round(mx.array(x)), N.q8_0_round(x), f"q8_0_round width {width}")


def test_q8_0_round_near_code_boundaries(rng):
    """Values within an ulp of (k + 1/2) * amax / 127: which code they get depends on computing
    id = 127 / amax (the spec) rather than 1 / d."""
    amax = np.exp2(rng.uniform(-20, 20, size=(4000, 1))).astype(np.float32)
    k = np.arange(-16, 15, dtype=np.float64) + 0.5
    x = (amax.astype(np.float64) * k / 127.0).astype(np.float32)
    x = np.concatenate([x, amax], axis=1)                              # 31 probes + the max: 32
    _bits_equal(M.q8_0_round(mx.array(x)), N.q8_0_round(x), "q8_0_round near boundaries")


def test_q8_k_round(rng):
    x = _data(rng, 16, 512, 256)
    x[10, 3] = 7.0                       # first maximum wins over a later one of equal |x|
    x[10, 200] = -7.0
    x[11, :] = np.float32(0.25)
    x[11, 17] = np.float32(-0.5)
    _bits_equal(M.q8_k_round(mx.array(x)), N.q8_k_round(x), "q8_k_round")


def test_e4m3_round_grid_and_ties():
    grid = np.unique(np.abs(N.e4m3_round(np.linspace(-448, 448, 20001, dtype=np.float32))))
    mids = (0.5 * (grid[1:] + grid[:-1])).astype(np.float32)
    probe = np.concatenate([grid, mids, np.nextafter(mids, 0), np.nextafter(mids, 1000),
                            [449.0, 1e9, 2.0**-10, 2.0**-11, 3.0 * 2.0**-11, 1e-45]]).astype(np.float32)
    v = np.concatenate([probe, -probe, [0.0, -0.0]]).astype(np.float32)
    _bits_equal(M.e4m3_round(mx.array(v)), N.e4m3_round(v), "e4m3_round")


@pytest.mark.parametrize("n_dims", [None, 448, 0])
def test_fp8_roundtrip(rng, n_dims):
    x = _data(rng, 16, 512, 64)
    _bits_equal(M.fp8_e4m3_roundtrip(mx.array(x), n_dims), N.fp8_e4m3_roundtrip(x, n_dims),
                f"fp8 n_dims {n_dims}")


def test_pow2_scale_every_exponent_across_its_threshold():
    """The float64-free ceil(log2f(r)) equals the spec's at every exponent, for mantissas 0..511
    (the thresholds are < 45) and a random sample of the rest."""
    rng = np.random.default_rng(1)
    j = np.concatenate([np.arange(512), rng.integers(512, 1 << 23, 64)]).astype(np.uint32)
    b = np.arange(1, 255, dtype=np.uint32)
    r = ((b[:, None] << np.uint32(23)) | j[None, :]).view(np.float32).reshape(-1)
    one = np.float32(1.0)
    for floor in (np.float32(0.0), N._FP8_AMAX_FLOOR):
        ref = N._pow2_scale(r, floor, one)
        got = M._pow2_scale(mx.array(r), mx.array(floor), mx.array(one))
        _bits_equal(got, ref, f"pow2 scale, floor {floor}")
    # the floors keep r normal: the smallest r each caller can form is >= 2^-126
    assert N._FP4_AMAX_FLOOR * (np.float32(1.0) / np.float32(6.0)) >= np.float32(2.0**-126)
    assert N._FP8_AMAX_FLOOR * (np.float32(1.0) / np.float32(448.0)) >= np.float32(2.0**-126)


def test_fp8_block_max_just_above_power_of_two():
    """Block maxima 448 * 2^k * (1 + j 2^-23): the float32 log2 keeps the scale at 2^k for small j."""
    k = np.arange(-10, 11)
    jj = np.array([0, 1, 2, 5, 10, 20, 40, 60, 100])
    amax = (448.0 * np.exp2(k)[:, None] * (1.0 + jj[None, :] * 2.0**-23)).astype(np.float32).reshape(-1)
    x = np.tile(np.linspace(-1, 1, 64, dtype=np.float32), (amax.size, 1)) * amax[:, None]
    x[:, 0] = amax
    _bits_equal(M.fp8_e4m3_roundtrip(mx.array(x)), N.fp8_e4m3_roundtrip(x), "fp8 near powers of two")


def test_e2m1_round_ties():
    vals = N.E2M1_VALUES
    mids = N._E2M1_MIDS
    probe = np.concatenate([vals, mids, np.nextafter(mids, 0), np.nextafter(mids, 10), [6.5, 1e30, 1e-40]])
    v = np.concatenate([probe, -probe, [0.0, -0.0]]).astype(np.float32)
    _bits_equal(M.e2m1_round(mx.array(v)), N.e2m1_round(v), "e2m1_round")


def test_hadamard128(rng):
    x = _data(rng, 16, 256, 128).reshape(16, 2, 128)
    _bits_equal(M.hadamard128(mx.array(x)), N.hadamard128(x), "hadamard128")
    with pytest.raises(ValueError):
        M.hadamard128(mx.zeros((2, 96)))


def test_indexer_qat(rng):
    x = _data(rng, 16, 256, 128).reshape(4, 4, 256)
    _bits_equal(M.indexer_qat(mx.array(x)), N.indexer_qat(x), "indexer_qat")
    # blocks whose Hadamard outputs sit exactly on E2M1 midpoints of a power-of-two scale
    t = np.zeros((3, 128), np.float32)
    t[0, 0] = 128.0 * np.sqrt(128.0, dtype=np.float32) / 12.0
    t[1, :2] = [3.0, 1.0]
    t[2, :4] = [5.0, 1.0, -2.0, 0.5]
    _bits_equal(M.indexer_qat(mx.array(t)), N.indexer_qat(t), "indexer_qat ties")
