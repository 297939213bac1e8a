"""engine/backends/mlx/quant.py (+ quant_twin.py): GGUF weights bound to MLX, and the products.

* dequantize of every binding is bit-identical to engine.gguf.quants.dequantize (2-D and experts);
* matmul / gather_matmul agree with float64 NumPy products of the GGUF decode within the float32
  accumulation bound n_in * 2^-24 * (|W| @ |x|) (the printed max abs / rel errors are the report);
* rows= slicing, unsorted / out-of-range experts refused, the scale dtype choice, the MXFP4 E8M0-255
  fallback, the bounded-slab repack (tracemalloc peak) and the bounded-step twin.
"""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install -e '.[mlx]')")

from engine.backends.mlx import quant as MQ  # noqa: E402
from engine.backends.mlx import quant_twin as TW  # noqa: E402
from engine.gguf import quants as Q  # noqa: E402
from engine.gguf.model_file import QTensor  # noqa: E402

TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_K, Q.MXFP4, Q.IQ2_XXS, Q.Q2_K]
KIND = {Q.F32: "dense", Q.F16: "dense", Q.BF16: "dense", Q.Q8_0: "affine8", Q.Q4_K: "affine4",
        Q.MXFP4: "mxfp4", Q.IQ2_XXS: "iq2_xxs", Q.Q2_K: "q2_k"}
N_IN, N_OUT, N_EXP = 512, 40, 5


def _tensor(tid: int, rng, n_in=N_IN, n_out=N_OUT, n_exp=0, std=0.05) -> QTensor:
    f = Q.FORMATS[tid]
    rows = n_out * max(1, n_exp)
    raw = Q.random_blocks(tid, rng, rows * n_in // f.block_elems, std).reshape(rows, -1)
    dims = (n_in, n_out, n_exp) if n_exp else (n_in, n_out)
    return QTensor(f"t_{Q.type_name(tid)}", tid, dims, raw)


def _bits(a) -> np.ndarray:
    return np.ascontiguousarray(np.array(a), dtype=np.float32).view(np.uint32)


def _assert_bits_equal(got, ref, what):
    g, r = _bits(got), _bits(ref)
    assert g.shape == r.shape, (what, g.shape, r.shape)
    n_bad = int(np.count_nonzero(g != r))
    assert n_bad == 0, f"{what}: {n_bad} of {g.size} values differ"


def _check_product(got, w64: np.ndarray, x64: np.ndarray, what: str) -> None:
    """got [P, n_out] vs w64 [P, n_out, n_in] . x64 [P, n_in] in float64, float32 accumulation bound."""
    assert got.dtype == mx.float32, f"{what}: result is {got.dtype}"   # f16 scales must not leak out
    got = np.array(got).astype(np.float64)
    ref = np.einsum("poi,pi->po", w64, x64)
    bound = w64.shape[-1] * 2.0**-24 * np.einsum("poi,pi->po", np.abs(w64), np.abs(x64)) + 1e-30
    err = np.abs(got - ref)
    rel = err.max() / np.abs(ref).max()
    print(f"{what}: max abs err {err.max():.3g}, max rel err {rel:.3g}, worst err/bound {np.max(err / bound):.3g}")
    assert got.shape == ref.shape
    assert np.all(err <= bound), f"{what}: error above the float32 accumulation bound"


@pytest.fixture(scope="module")
def rng():
    return np.random.default_rng(2020)


@pytest.mark.parametrize("tid", TYPES, ids=Q.type_name)
def test_dequantize_bit_exact_2d_and_experts(tid, rng):
    t2 = _tensor(tid, rng)
    w2 = MQ.repack(t2)
    assert (w2.kind, w2.n_in, w2.n_out, w2.n_expert) == (KIND[tid], N_IN, N_OUT, 0)
    _assert_bits_equal(MQ.dequantize(w2), Q.dequantize(tid, t2.data), f"{Q.type_name(tid)} 2-D")
    t3 = _tensor(tid, rng, n_exp=N_EXP)
    w3 = MQ.repack(t3)
    assert w3.w.shape[:2] == (N_EXP, N_OUT)
    ref = Q.dequantize(tid, t3.data).reshape(N_EXP, N_OUT, N_IN)
    _assert_bits_equal(MQ.dequantize(w3), ref, f"{Q.type_name(tid)} experts")
    _assert_bits_equal(MQ.dequantize(w3, expert=3), ref[3], f"{Q.type_name(tid)} expert 3")
    ratio = w3.nbytes() / t3.data.nbytes
    print(f"{Q.type_name(tid)}: bound {w3.nbytes()} B for {t3.data.nbytes} GGUF B (x{ratio:.3f}),"
          f" scales {None if w3.scales is None else w3.scales.dtype}")
    # f16 Q8_0 scales; f32 Q4_K scales and biases, and each block's d and dmin (ds4's integer dot)
    expected = {Q.Q8_0: 36 / 34, Q.Q4_K: 200 / 144}.get(tid, 1.0)
    assert ratio == pytest.approx(expected)


@pytest.mark.parametrize("tid", TYPES, ids=Q.type_name)
def test_matmul_and_rows(tid, rng):
    t = _tensor(tid, rng)
    w = MQ.repack(t)
    w64 = Q.dequantize(tid, t.data).astype(np.float64)
    x = rng.standard_normal((7, N_IN)).astype(np.float32)
    x64 = x.astype(np.float64)
    bx = lambda wm: (np.broadcast_to(wm, (7,) + wm.shape), x64)   # noqa: E731
    _check_product(MQ.matmul(w, mx.array(x)), *bx(w64), f"{Q.type_name(tid)} matmul")
    _check_product(MQ.matmul(w, mx.array(x), rows=slice(5, 31)), *bx(w64[5:31]),
                   f"{Q.type_name(tid)} matmul rows 5:31")
    _check_product(MQ.matmul(w, mx.array(x[:1]), rows=slice(0, N_OUT, 3)), np.broadcast_to(w64[::3], (1,) + w64[::3].shape),
                   x64[:1], f"{Q.type_name(tid)} matmul rows ::3")


def _routing(rng, n_tok: int, n_exp: int, k: int):
    """Sorted (expert, token) pairs of a top-k routing: k distinct experts per token, some unused."""
    used = rng.permutation(n_exp)[: max(2, n_exp - 2)]
    pairs = [(int(e), t) for t in range(n_tok) for e in rng.choice(used, size=k, replace=False)]
    pairs.sort()
    e, t = np.array(pairs, dtype=np.int32).T
    return e, t


@pytest.mark.parametrize("tid", TYPES, ids=Q.type_name)
def test_gather_matmul(tid, rng):
    t = _tensor(tid, rng, n_exp=N_EXP)
    w = MQ.repack(t)
    w64 = Q.dequantize(tid, t.data).reshape(N_EXP, N_OUT, N_IN).astype(np.float64)
    x = rng.standard_normal((6, N_IN)).astype(np.float32)
    e, tok = _routing(rng, 6, N_EXP, 3)
    y = MQ.gather_matmul(w, mx.array(x), mx.array(e), mx.array(tok))
    _check_product(y, w64[e], x[tok].astype(np.float64), f"{Q.type_name(tid)} gather_matmul")
    y2 = MQ.gather_matmul(w, mx.array(x), mx.array(e), mx.array(tok), check_sorted=False)
    _assert_bits_equal(y2, y, "check_sorted=False")
    assert MQ.gather_matmul(w, mx.array(x), mx.array(e[:0]), mx.array(tok[:0])).shape == (0, N_OUT)


@pytest.mark.parametrize("tid", [Q.Q4_K, Q.IQ2_XXS], ids=Q.type_name)
def test_gather_matmul_refuses_unsorted_and_out_of_range(tid, rng):
    w = MQ.repack(_tensor(tid, rng, n_exp=N_EXP))
    x = mx.array(rng.standard_normal((3, N_IN)).astype(np.float32))
    toks = mx.array(np.array([0, 1, 2], np.int32))
    for bad in ([2, 0, 1], [0, 1, N_EXP], [-1, 0, 1]):
        with pytest.raises(ValueError, match="sorted"):
            MQ.gather_matmul(w, x, mx.array(np.array(bad, np.int32)), toks)
    with pytest.raises(ValueError):
        MQ.matmul(w, x)


def test_twin_steps_bounded(rng, monkeypatch):
    """A tiny decode budget forces the twin through many row slabs and expert steps: same results."""
    for tid in (Q.IQ2_XXS, Q.Q2_K):
        t2, t3 = _tensor(tid, rng), _tensor(tid, rng, n_exp=N_EXP)
        w2, w3 = MQ.repack(t2), MQ.repack(t3)
        x = mx.array(rng.standard_normal((4, N_IN)).astype(np.float32))
        e, tok = _routing(rng, 4, N_EXP, 2)
        y2, y3 = MQ.matmul(w2, x), MQ.gather_matmul(w3, x, mx.array(e), mx.array(tok))
        monkeypatch.setattr(TW, "_DECODE_BUDGET", 4 * N_IN * 7)   # 7 rows, less than one expert
        _assert_bits_equal(MQ.matmul(w2, x), y2, "twin matmul in slabs")
        _assert_bits_equal(MQ.gather_matmul(w3, x, mx.array(e), mx.array(tok)), y3, "twin gather in steps")
        monkeypatch.undo()


def test_q8_0_scale_dtype_and_negative_d(rng):
    t = _tensor(Q.Q8_0, rng)
    blocks = t.data.reshape(-1, 34)
    d = blocks[:, 0:2].view(np.float16)
    d[1::2] = -d[1::2]                                     # negative scales
    assert MQ.repack(t).scales.dtype == mx.float16
    ref = Q.dequantize(Q.Q8_0, t.data)
    got = np.array(MQ.dequantize(MQ.repack(t)))
    diff = _bits(got) != _bits(ref)
    # the one documented difference: q = 0 under a negative d is -0.0 in ggml, +0.0 here
    assert np.all(ref[diff] == 0) and np.all(np.signbit(ref[diff])) and not np.any(np.signbit(got[diff]))
    assert np.array_equal(got, ref)
    d[0] = np.float16(600.0)                               # -128 * 600 overflows f16 -> float32 scales
    w = MQ.repack(t)
    assert w.scales.dtype == mx.float32
    assert np.array_equal(np.array(MQ.dequantize(w)), Q.dequantize(Q.Q8_0, t.data))


def test_q4_k_scales_f16_when_exact(rng):
    t = _tensor(Q.Q4_K, rng)
    b = t.data.reshape(-1, 144)
    b[:, 0:2] = np.frombuffer(np.float16(2.0**-10).tobytes(), np.uint8)   # d * sc: <= 6 significant bits
    b[:, 2:4] = np.frombuffer(np.float16(-2.0**-12).tobytes(), np.uint8)
    w = MQ.repack(t)
    assert w.scales.dtype == mx.float16 and w.biases.dtype == mx.float16
    _assert_bits_equal(MQ.dequantize(w), Q.dequantize(Q.Q4_K, t.data), "Q4_K with f16 scales")
    x = rng.standard_normal((3, N_IN)).astype(np.float32)
    _check_product(MQ.matmul(w, mx.array(x)), np.broadcast_to(Q.dequantize(Q.Q4_K, t.data).astype(np.float64),
                   (3, N_OUT, N_IN)), x.astype(np.float64), "Q4_K f16 scales matmul")


@pytest.mark.filterwarnings("ignore:overflow encountered")   # e = 254 times code 12 is inf in both
def test_mxfp4_edge_exponents_and_codes(rng):
    t = _tensor(Q.MXFP4, rng)
    b = t.data.reshape(-1, 17)
    b[0, 0], b[1, 0], b[2, 0], b[3, 0] = 0, 1, 254, 2      # subnormal and largest scales
    b[4, 1:] = 0x88                                        # code 8: ggml +0.0, MLX -0.0 unless remapped
    w = MQ.repack(t)
    assert w.kind == "mxfp4"
    _assert_bits_equal(MQ.dequantize(w), Q.dequantize(Q.MXFP4, t.data), "MXFP4 edge scales")
    b[5, 0] = 255                                          # MLX reads E8M0 255 as NaN/inf: dense f32
    w = MQ.repack(t)
    assert w.kind == "dense" and w.w.dtype == mx.float32
    _assert_bits_equal(MQ.dequantize(w), Q.dequantize(Q.MXFP4, t.data), "MXFP4 with E8M0 255")


@pytest.mark.parametrize("tid", [Q.Q8_0, Q.Q4_K, Q.MXFP4], ids=Q.type_name)
def test_repack_in_slabs_bounded_memory(tid, rng, monkeypatch):
    """Many slabs give the same arrays; NumPy's peak while binding stays O(slab), not O(tensor)."""
    t = _tensor(tid, rng, n_in=2048, n_out=2048)            # 2-4 MiB of GGUF bytes
    monkeypatch.setattr(MQ, "_SLAB_BYTES", 1 << 16)
    monkeypatch.setattr(MQ, "_WORKERS", 2)
    tracemalloc.start()
    w = MQ.repack(t)
    mx.eval(w.w, w.scales)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(f"{Q.type_name(tid)}: {t.data.nbytes} GGUF B, NumPy peak while binding {peak} B (slab 64 KiB)")
    # the converters' temporaries are a few times one slab per worker thread (Q4_K's codes: 4 bytes
    # per input byte); the tensor is 34-68 slabs, so a peak proportional to it would be far above this
    assert t.data.nbytes >= 32 * (1 << 16) and peak < 2 * 8 * (1 << 16)
    _assert_bits_equal(MQ.dequantize(w), Q.dequantize(tid, t.data), f"{Q.type_name(tid)} slabbed")


def test_repack_refuses_bad_shapes(rng):
    t = _tensor(Q.Q8_0, rng)
    with pytest.raises(ValueError):
        MQ.repack(QTensor("bad", Q.Q8_0, (N_IN, N_OUT + 1), t.data))
    with pytest.raises(ValueError):
        MQ.repack(QTensor("vec", Q.F32, (N_IN,), t.data))
