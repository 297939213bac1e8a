"""The CuPy backend's CUDA kernels (cuda_kernels/*.cu), run by the host emulation
(engine/backends/cupy/emu.py: each .cu compiled as C++ with a CUDA compat header, a fiber per
thread, strict __syncthreads and warp collectives, guard pages, NaN-filled outputs, two thread
orders) and compared with the NumPy reference. This proves the kernels' indexing, decoding and
arithmetic on small shapes with partial tiles; not that they are fast (docs/cuda.md).

Tolerances: decoded weights bit for bit (the row dequantizer, and one-hot inputs through the
matvec and GEMM); rmsnorm and rope bit for bit; topk exactly; products (matvec, GEMM, attention,
indexer scores) within 2e-6 relative to the float64 reference (max-abs error over the
reference's largest magnitude; float32 sums of a few hundred terms), the GEMM within 5e-6 (one
running float32 sum per output); hc_split within 1e-6 (its expf is not NumPy's float32 exp).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from engine.backends.cupy import emu
from engine.backends.numpy.ops import NumpyOps
from engine.model import ds4_matmul as DM
from engine.model import numerics as N

sys.path.insert(0, str(Path(__file__).resolve().parent / "cuda_emu"))
from harness import FORMATS, Kernels, cupy_device, rel_err, weights  # noqa: E402

# the comparisons run on the emulation, and where CuPy sees a CUDA device on the device as well
# (scripts/gpu_check.sh); the tests that break a kernel or rely on the emulation's reports are
# emulation-only (they skip without g++: the harness's Kernels(runner="emu") says why). A GPU
# machine without g++ still runs every comparison on the device.
RUNNERS = (["emu"] if emu.compiler() is not None else []) + (["cupy"] if cupy_device() else [])
pytestmark = pytest.mark.skipif(not RUNNERS, reason="neither g++ (the CUDA emulation) nor a CUDA device")

PRODUCT_TOL = 2e-6
GEMM_TOL = 5e-6          # one float32 running sum per output over n_in (measured up to 1.7e-6 here)
BLOCK_32 = {"q8_0", "f16", "mxfp4"}       # formats of 32-value blocks (the others: 256)


@pytest.fixture(scope="module", params=RUNNERS)
def K(request):
    return Kernels(runner=request.param)


@pytest.fixture(scope="module")
def E():
    """The emulation only (its own checks of the arguments)."""
    return Kernels()


def _n_in(fmt, blocks=2):
    return (32 if fmt in BLOCK_32 else 256) * blocks


# -- decoders and matvecs -----------------------------------------------------------------------
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_dequant_rows_decode_bit_for_bit(K, fmt):
    rng = np.random.default_rng(1)
    n_in = _n_in(fmt, 8 if fmt in BLOCK_32 else 2)
    raw, W = weights(fmt, rng, 1, 9, n_in, any_bytes=True)
    rows = np.array([3, 0, 8, 3], np.int32)
    got = K.dequant_rows(fmt, raw[0], rows, n_in)
    assert got.tobytes() == W[0][rows].tobytes()


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_matvec_experts_match_the_reference(K, fmt):
    rng = np.random.default_rng(2)
    n_in = _n_in(fmt, 40 if fmt in BLOCK_32 else 3)      # more groups than a warp has lanes
    raw, W = weights(fmt, rng, 3, 10, n_in)               # 10 rows: a partial block of 4
    x = rng.standard_normal((4, n_in), dtype=np.float32)
    experts, toks = np.array([2, 0, 1, 2, 0], np.int32), np.array([0, 3, 1, 2, 0], np.int32)
    got = K.matvec_experts(fmt, raw, x, experts, toks)
    ref = np.einsum("pod,pd->po", W[experts].astype(np.float64), x[toks].astype(np.float64))
    assert rel_err(got, ref) < PRODUCT_TOL


@pytest.mark.parametrize("fmt", ["q2_k", "iq2_xxs", "q4_k", "mxfp4"])
def test_matvec_and_gemm_give_decoded_weights_exactly_for_one_hot_inputs(K, fmt):
    """x = one-hot columns: each output is one decoded weight, so it must be bit for bit."""
    rng = np.random.default_rng(3)
    n_in = _n_in(fmt, 1)
    raw, W = weights(fmt, rng, 2, 5, n_in, any_bytes=True)
    cols = np.arange(0, n_in, 7)
    x = np.zeros((len(cols), n_in), np.float32)
    x[np.arange(len(cols)), cols] = 1.0
    toks = np.arange(len(cols), dtype=np.int32)
    experts = (toks % 2).astype(np.int32)
    ref = W[experts][:, :, cols].diagonal(axis1=0, axis2=2).T          # [P, n_out]
    for got in (K.matvec_experts(fmt, raw, x, experts, toks), K.gemm_experts(fmt, raw, x, experts, toks)):
        assert got.tobytes() == np.ascontiguousarray(ref).tobytes()


@pytest.mark.parametrize("fmt", ["q8_0", "f16"])
def test_matvec_dense(K, fmt):
    rng = np.random.default_rng(4)
    raw, W = weights(fmt, rng, 1, 7, 96)
    x = rng.standard_normal((3, 96), dtype=np.float32)
    got = K.matvec_dense(fmt, raw[0], x)
    assert rel_err(got, x.astype(np.float64) @ W[0].T.astype(np.float64)) < PRODUCT_TOL


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_gemm_experts_grouped_by_expert(K, fmt):
    rng = np.random.default_rng(5)
    n_in = _n_in(fmt, 3 if fmt in BLOCK_32 else 1)
    raw, W = weights(fmt, rng, 3, 70, n_in)          # 70 rows: a partial tile of 64
    x = rng.standard_normal((6, n_in), dtype=np.float32)
    experts = np.array([0] * 19 + [2] * 5 + [1] * 3, np.int32)[rng.permutation(27)]   # a chunk of 16 + 3
    toks = rng.integers(0, 6, 27).astype(np.int32)
    got = K.gemm_experts(fmt, raw, x, experts, toks)
    ref = np.einsum("pod,pd->po", W[experts].astype(np.float64), x[toks].astype(np.float64))
    assert rel_err(got, ref) < GEMM_TOL


# -- ds4's dot products ---------------------------------------------------------------------------
def test_ds4_q8_0_dot_bit_for_bit_with_the_reference(K):
    rng = np.random.default_rng(18)
    n_in = 32 * 40                                        # more blocks than a warp has lanes
    raw, _ = weights("q8_0", rng, 1, 9, n_in, any_bytes=True)
    x = rng.standard_normal((3, n_in), dtype=np.float32) * np.float32(3)
    act = DM.q8_0_act(x)
    T = x.shape[0]
    got = K.ds4_matvec("q8_0", raw, act.q.reshape(T, -1), act.d, np.zeros(T, np.int32), np.arange(T, dtype=np.int32))
    assert got.tobytes() == DM.q8_0_matmul(raw[0], act).tobytes()


@pytest.mark.parametrize("fmt", ["iq2_xxs", "q2_k"])
def test_ds4_q8_k_dots_bit_for_bit_with_the_reference(K, fmt):
    rng = np.random.default_rng(19)
    raw, _ = weights(fmt, rng, 3, 6, 512, any_bytes=True)
    x = rng.standard_normal((4, 512), dtype=np.float32)
    act = DM.q8_k_act(x)
    experts, toks = np.array([2, 0, 1, 2, 0], np.int32), np.array([0, 3, 1, 2, 0], np.int32)
    got = K.ds4_matvec(fmt, raw, act.q.reshape(4, -1), act.d, experts, toks)
    ref = np.stack([DM.q8_k_matmul(FORMATS[fmt], raw[e], act[t:t + 1])[0] for e, t in zip(experts, toks)])
    assert got.tobytes() == ref.tobytes()


# -- attention ------------------------------------------------------------------------------------
def _attention_case(rng, T=3, H=2, D=64):
    q = rng.standard_normal((T, H, D), dtype=np.float32)
    raw = rng.standard_normal((T, 9, D), dtype=np.float32)          # per query
    comp = rng.standard_normal((11, D), dtype=np.float32)           # shared
    pool = rng.standard_normal((20, D), dtype=np.float32)           # read by index
    m_raw = rng.random((T, 9)) < 0.7
    m_comp = rng.random((T, 11)) < 0.5
    m_comp[1] = False                                               # a query that sees no compressed row
    idx = rng.integers(0, 20, (T, 5)).astype(np.int32)
    m_idx = rng.random((T, 5)) < 0.8
    sinks = rng.standard_normal(H).astype(np.float32)
    return q, [(raw, m_raw), (comp, m_comp), (pool, m_idx, idx)], sinks


@pytest.mark.parametrize("warps", [1, 4, 16])
def test_attention_over_three_kinds_of_segments(K, warps):
    rng = np.random.default_rng(6)
    q, segs, sinks = _attention_case(rng)
    got = K.attention(q, segs, sinks, 0.125, warps=warps)
    assert rel_err(got, NumpyOps.attention(q, segs, sinks, 0.125)) < PRODUCT_TOL


def test_attention_with_no_visible_key_gives_zero_and_a_large_sink_does_not_overflow(K):
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, 1, 32), dtype=np.float32)
    keys = rng.standard_normal((4, 32), dtype=np.float32)
    mask = np.array([[False] * 4, [True, False, True, True]])
    sinks = np.array([200.0], np.float32)
    got = K.attention(q, [(keys, mask)], sinks, 1.0)
    ref = NumpyOps.attention(q, [(keys, mask)], sinks, 1.0)
    assert np.all(got[0] == 0) and np.all(np.isfinite(got))
    assert np.allclose(got, ref, rtol=1e-5, atol=1e-30)


# -- norms, rope, hc, top-k, indexer --------------------------------------------------------------
def test_rmsnorm_bit_for_bit(K):
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((5, 300)) * 3).astype(np.float32)
    w = rng.standard_normal(300).astype(np.float32)
    for wt in (w, None):
        assert K.rmsnorm(x, wt, 1e-6).tobytes() == NumpyOps.rmsnorm(x, wt, 1e-6).tobytes()


def test_rmsnorm_ds4_bit_for_bit(K):
    ref = getattr(N, "rmsnorm_ds4", None)
    if ref is None:
        pytest.skip("engine.model.numerics has no rmsnorm_ds4 in this checkout")
    rng = np.random.default_rng(16)
    x = (rng.standard_normal((5, 300)) * 3).astype(np.float32)
    w = rng.standard_normal(300).astype(np.float32)
    for wt in (w, None):
        assert K.rmsnorm(x, wt, 1e-6, ds4=True).tobytes() == ref(x, wt, 1e-6).tobytes()


@pytest.mark.parametrize("inverse", [False, True])
def test_rope_bit_for_bit(K, inverse):
    rng = np.random.default_rng(9)
    x = rng.standard_normal((3, 4, 40), dtype=np.float32)
    th = (rng.standard_normal((3, 8)) * 5).astype(np.float32)
    assert K.rope(x, th, inverse).tobytes() == N.apply_rope(x, th, inverse=inverse).tobytes()
    x2 = rng.standard_normal((3, 20), dtype=np.float32)                 # one row of angles for all
    assert K.rope(x2, th[0], inverse).tobytes() == N.apply_rope(x2, th[0], inverse=inverse).tobytes()


def test_hc_split(K):
    rng = np.random.default_rng(10)
    n, T = 4, 130                                                        # two blocks of threads
    mix = rng.standard_normal((T, 2 * n + n * n), dtype=np.float32)
    scale = rng.standard_normal(3).astype(np.float32)
    base = rng.standard_normal(2 * n + n * n).astype(np.float32)
    got = K.hc_split(mix, n, scale, base, 1e-6, 20)
    ref = NumpyOps().hc_split(mix, n, scale, base, np.float32(1e-6), 20)
    for g, r in zip(got, ref):
        assert rel_err(g, r) < 1e-6


@pytest.mark.parametrize("k", [1, 37, 300])
def test_topk_ties_inf_and_signed_zero(K, k):
    rng = np.random.default_rng(11)
    s = rng.integers(-5, 5, (3, 300)).astype(np.float32)                  # many ties
    s[0, ::17] = -np.inf
    s[1, ::5] = -0.0
    s[2] = rng.standard_normal(300)
    assert np.array_equal(K.topk(s, k), NumpyOps.topk_lowest_index(s, k))


def test_indexer_scores(K):
    rng = np.random.default_rng(12)
    qi = rng.standard_normal((3, 4, 64), dtype=np.float32)
    keys = rng.standard_normal((9, 64), dtype=np.float32)
    wts = rng.standard_normal((3, 4), dtype=np.float32)
    assert rel_err(K.indexer_scores(qi, keys, wts), NumpyOps.indexer_scores(qi, keys, wts)) < PRODUCT_TOL


# -- the checks can fail ----------------------------------------------------------------------------
BROKEN_INDEX = {   # a wrong index in three kernels: the comparisons above must catch each
    "q4_k_scale": ("common.cuh", ("mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);", "mn = (s[j + 4] >> 4) | ((s[j - 4] >> 6) << 4);")),
    "gemm_tile_row": ("gemm.cu", ("const float w = wt[r][k];", "const float w = wt[r ^ 1][k];")),
    "attention_key_row": ("attention.cu", ("(long long)t * K + k :", "(long long)t * K + (k ^ 1) :")),
}


@pytest.mark.parametrize("name", sorted(BROKEN_INDEX))
def test_a_broken_index_fails_the_comparison(name):
    file, edit = BROKEN_INDEX[name]
    K = Kernels({file: edit})
    rng = np.random.default_rng(13)
    if name == "q4_k_scale":
        raw, W = weights("q4_k", rng, 1, 3, 256, any_bytes=True)
        got = K.dequant_rows("q4_k", raw[0], np.arange(3, dtype=np.int32), 256)
        assert got.tobytes() != W[0].tobytes()
    elif name == "gemm_tile_row":
        raw, W = weights("q8_0", rng, 2, 8, 64)
        x = rng.standard_normal((2, 64), dtype=np.float32)
        e, t = np.zeros(4, np.int32), np.array([0, 1, 1, 0], np.int32)
        ref = np.einsum("pod,pd->po", W[e].astype(np.float64), x[t].astype(np.float64))
        assert rel_err(K.gemm_experts("q8_0", raw, x, e, t), ref) > 1e-2
    else:
        q, segs, sinks = _attention_case(rng)
        assert rel_err(K.attention(q, segs[:1], sinks, 0.125), NumpyOps.attention(q, segs[:1], sinks, 0.125)) > 1e-2


FAULTS = {   # mistakes the emulation reports itself, instead of hanging or reading a neighbour
    "early_return": ("hc_topk.cu", ("const unsigned thr = prefix;", "const unsigned thr = prefix;\nif (tid == 1) return;"),
                     "only some"),
    "past_end": ("matvec.cu", ("out[(long long)p * n_out + row] = s;", "out[(long long)p * n_out + row + 64] = s;"),
                 "signal 11"),
    "missing_barrier": ("gemm.cu", ("__syncthreads();                     // the tiles", "//"),
                        "order threads run in"),
    "partial_mask": ("common.cuh", ("v += __shfl_xor_sync(0xFFFFFFFFu, v, o);", "v += __shfl_xor_sync(0x7FFFFFFFu, v, o);"),
                     "mask"),
}


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_the_emulation_reports_races_overruns_and_bad_warp_masks(name):
    file, edit, message = FAULTS[name]
    K = Kernels({file: edit})
    rng = np.random.default_rng(14)
    with pytest.raises(emu.EmulationError, match=message):
        if name == "early_return":
            K.topk(rng.standard_normal((2, 300), dtype=np.float32), 5)
        elif name == "missing_barrier":     # several groups of 32: the tiles are rewritten while read
            raw, _ = weights("q8_0", rng, 1, 8, 128)
            K.gemm_experts("q8_0", raw, rng.standard_normal((2, 128), dtype=np.float32),
                           np.zeros(4, np.int32), np.array([0, 1, 1, 0], np.int32))
        else:
            raw, _ = weights("q2_k", rng, 1, 8, 256)
            K.matvec_experts("q2_k", raw, rng.standard_normal((2, 256), dtype=np.float32),
                             np.zeros(3, np.int32), np.array([0, 1, 0], np.int32))


def test_arguments_of_the_wrong_type_are_refused(E):
    fn = E.fn("norm_rope.cu", "rmsnorm")
    x = np.zeros((2, 8), np.float32)
    good = (x, np.zeros(8, np.float32), x.copy(), np.int32(2), np.int32(8), np.float64(1e-6), np.int32(1))
    for i, bad in [(3, 2), (5, np.float32(1e-6)), (0, x.astype(np.float64)), (2, np.zeros((8, 2), np.float32).T)]:
        args = list(good)
        args[i] = bad
        with pytest.raises(TypeError):
            fn((2, 1, 1), (256, 1, 1), tuple(args))
    with pytest.raises(emu.EmulationError, match="invalid launch"):
        fn((0, 1, 1), (256, 1, 1), good)


def test_a_stray_write_is_reported_in_process_and_in_a_forked_child(monkeypatch):
    K = Kernels({"matvec.cu": FAULTS["past_end"][1]})
    rng = np.random.default_rng(15)
    raw, _ = weights("q8_0", rng, 1, 8, 64)
    x = rng.standard_normal((2, 64), dtype=np.float32)
    for isolate in ("0", "1"):
        monkeypatch.setenv("DS4_CUDA_EMU_ISOLATE", isolate)
        with pytest.raises(emu.EmulationError, match="signal 11"):
            K.matvec_experts("q8_0", raw, x, np.zeros(3, np.int32), np.array([0, 1, 0], np.int32))
    monkeypatch.setenv("DS4_CUDA_EMU_ISOLATE", "1")          # and a good launch through the child
    good = Kernels().matvec_experts("q8_0", raw, x, np.zeros(1, np.int32), np.zeros(1, np.int32))
    assert np.isfinite(good).all()


# -- the emulation's warp rules, on small kernels of their own ----------------------------------------
WARP_RULES = r'''
extern "C" __global__ void halves(float* x, int n) {            // two half-warps, disjoint masks
  const unsigned lane = threadIdx.x & 31, mask = lane < 16 ? 0x0000FFFFu : 0xFFFF0000u;
  float v = x[threadIdx.x];
  for (int o = 8; o; o >>= 1) v += __shfl_xor_sync(mask, v, o);
  x[threadIdx.x] = v;
}
extern "C" __global__ void overlapping(float* x, int n) {       // lane 0 waits with another mask
  const unsigned mask = (threadIdx.x & 31) == 0 ? 0x3u : 0xFFFFFFFFu;
  x[threadIdx.x] = __shfl_xor_sync(mask, x[threadIdx.x], 1);
}
extern "C" __global__ void outside(float* x, int n) {           // reads lane 20 with lanes 0..15 only
  if ((threadIdx.x & 31) < 16) x[threadIdx.x] = __shfl_sync(0x0000FFFFu, x[threadIdx.x], 20);
}
extern "C" __global__ void split_barrier(float* x, int n) {   // two __syncthreads, half the block at each
  if (threadIdx.x < 16) { x[threadIdx.x] = 1.0f; __syncthreads(); }
  else { __syncthreads(); x[threadIdx.x] = 2.0f; }
}
extern "C" __global__ void unwritten(float* x, int n) {       // reads a shared slot no thread wrote
  __shared__ float s[64];
  float* xb = x + blockIdx.x * 64;
  if (threadIdx.x < 32) s[threadIdx.x] = xb[threadIdx.x];
  __syncthreads();
  xb[threadIdx.x] = s[threadIdx.x];
}
extern "C" __global__ void votes(float* x, int n) {             // ballot / any / all over a partial block
  const unsigned b = __ballot_sync(0xFFFFFFFFu, x[threadIdx.x] > 0.0f);
  x[threadIdx.x] = float(b) + (__any_sync(0xFFFFFFFFu, x[threadIdx.x] > 5.0f) ? 0.5f : 0.0f)
                   + (__all_sync(0xFFFFFFFFu, x[threadIdx.x] > -1.0f) ? 0.25f : 0.0f);
}
'''


@pytest.fixture(scope="module")
def rules():
    if emu.compiler() is None:
        pytest.skip("g++ is not installed: the CUDA emulation needs it")
    return emu.load_module(code=WARP_RULES, opt="-O0")


def test_disjoint_half_warp_shuffles_are_allowed(rules):
    x = np.arange(64, dtype=np.float32)
    rules.get_function("halves")((1, 1, 1), (64, 1, 1), (x, np.int32(64)))
    ref = np.arange(64, dtype=np.float32).reshape(4, 16).sum(axis=1).repeat(16)
    assert np.array_equal(x, ref)


@pytest.mark.parametrize("kernel,message", [("overlapping", "different, overlapping masks"),
                                            ("outside", "outside its mask"),
                                            ("split_barrier", "different group barriers")])
def test_warp_masks_that_cannot_work_on_hardware_are_errors(rules, kernel, message):
    with pytest.raises(emu.EmulationError, match=message):
        rules.get_function(kernel)((1, 1, 1), (32, 1, 1), (np.ones(32, np.float32), np.int32(32)))


def test_shared_memory_starts_as_poison_in_every_block(rules):
    x = np.arange(128, dtype=np.float32)
    rules.get_function("unwritten")((2, 1, 1), (64, 1, 1), (x, np.int32(64)))
    assert np.array_equal(x[:32], np.arange(32)) and np.isnan(x[32:64]).all()   # not block 0's values
    assert np.array_equal(x[64:96], np.arange(64, 96)) and np.isnan(x[96:]).all()


def test_votes(rules):
    x = np.array([1, -0.5, 6, 2, 0, -2] + [0] * 26, np.float32)
    rules.get_function("votes")((1, 1, 1), (32, 1, 1), (x, np.int32(32)))
    assert np.all(x == np.float32(0b1101 + 0.5))             # ballot of lanes 0, 2, 3; any > 5; not all > -1
    y = np.array([1, -0.5, 6, 2] + [0] * 28, np.float32)
    rules.get_function("votes")((1, 1, 1), (32, 1, 1), (y, np.int32(32)))
    assert np.all(y == np.float32(0b1101 + 0.5 + 0.25))


def test_an_array_passed_twice_is_one_buffer_as_on_the_device(E):
    """rmsnorm in place (out = x): the kernel must see one buffer, as a GPU would."""
    rng = np.random.default_rng(17)
    x = rng.standard_normal((3, 64), dtype=np.float32)
    ref = NumpyOps.rmsnorm(x, None, 1e-6)
    fn = E.fn("norm_rope.cu", "rmsnorm")
    args = (x, np.zeros(1, np.float32), x, np.int32(3), np.int32(64), np.float64(1e-6), np.int32(0))
    fn((3, 1, 1), (256, 1, 1), args)
    assert x.tobytes() == ref.tobytes()
    y = np.zeros(128, np.float32)
    with pytest.raises(emu.EmulationError, match="overlap"):
        fn((1, 1, 1), (256, 1, 1), (y[:64], np.zeros(1, np.float32), y[32:96], np.int32(1), np.int32(64),
                                    np.float64(1e-6), np.int32(0)))
