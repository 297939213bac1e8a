"""ds4's own dot products, bit for bit: the reference's `ds4` numerics against ds4's compiled code.

`tests/golden/ds4_cpu_dots.npz` holds the outputs of ds4's CPU-path functions themselves (ds4.c
at 8d57664 built with its Makefile's flags; tests/golden/README.md). The reference must give the
same float32 bits, and the rule each test pins must matter: the exact sum rounded once (the rule
before issue 33, NumpyOps(q8_dot="exact")) differs from ds4 at some of these outputs.
docs/numerics.md lists every rule with its ds4 function.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from engine.backends.numpy.ops import NumpyOps
from engine.gguf import quants as Q
from engine.model import ds4_matmul as D

FIX = np.load(Path(__file__).parent / "golden" / "ds4_cpu_dots.npz")
FORMATS = {"q8_0": Q.Q8_0, "iq2_xxs": Q.IQ2_XXS, "q2_k": Q.Q2_K}


def _matmul(ops: NumpyOps, name: str) -> np.ndarray:
    w = SimpleNamespace(type_id=FORMATS[name], data=FIX[f"{name}_w"])
    if name == "q8_0":
        return ops.linear(w, FIX["x"])
    return ops.expert_linear(w, ops.expert_act(w, FIX["x"]))


@pytest.mark.parametrize("name", list(FORMATS))
def test_reference_matmuls_are_ds4s_bit_for_bit(name):
    got = _matmul(NumpyOps("ds4"), name)
    want = FIX[f"{name}_y"]
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (name, np.abs(got - want).max())


@pytest.mark.parametrize("name", list(FORMATS))
def test_the_exact_sum_is_not_ds4s(name):
    """What the fixture can tell apart: the exact sum rounded once misses ds4's bits somewhere."""
    exact = _matmul(NumpyOps("ds4", q8_dot="exact"), name)
    assert (exact.view(np.uint32) != FIX[f"{name}_y"].view(np.uint32)).any(), name


def test_q2_k_fuses_the_scale_term():
    """ds4's Q2_K line as GCC compiles it (one FMA, the minimum term reassociated) is what gives
    ds4's bits; the source read literally (two rounded products) does not, at some outputs."""
    a = D.q8_k_act(FIX["x"])
    b = D._blocks(FIX["q2_k_w"], Q.Q2_K)
    isum = D._idots(a.q, D._decode_int(Q.Q2_K, D._with_scales(b, (80, 82), (1.0, 0.0)))).astype(np.float32)
    summs = -D._idots(a.q, D._decode_int(Q.Q2_K, D._with_scales(b, (80, 82), (0.0, 1.0)))).astype(np.float32)
    d, dmin = D._f16(b[..., 80:82]), D._f16(b[..., 82:84])
    literal = np.zeros(FIX["q2_k_y"].shape, np.float32)
    for k in range(a.q.shape[1]):
        literal += (a.d[:, k, None] * d[None, :, k]) * isum[k] - (a.d[:, k, None] * dmin[None, :, k]) * summs[k]
    assert (literal.view(np.uint32) != FIX["q2_k_y"].view(np.uint32)).any()


def test_q8_act_selects_tokens():
    a = D.q8_0_act(FIX["x"])
    assert a.shape == FIX["x"].shape and a[1:].q.shape[0] == 2
    with pytest.raises(ValueError):
        D.q8_k_matmul(Q.Q4_K, FIX["q2_k_w"], D.q8_k_act(FIX["x"]))


def _experts(rng, E=256, F=256, n=4):
    """q2-recipe experts (IQ2_XXS gate/up, Q2_K down) as the ops read them (.expert(e))."""
    def qt(t, rows, cols):
        data = Q.random_blocks(t, rng, n * rows * cols // 256, 0.05).reshape(n, rows, -1)
        return SimpleNamespace(type_id=t, data=data, expert=lambda e: SimpleNamespace(type_id=t, data=data[e]))
    return SimpleNamespace(gate_exps=qt(Q.IQ2_XXS, F, E), up_exps=qt(Q.IQ2_XXS, F, E), down_exps=qt(Q.Q2_K, E, F))


def test_routed_expert_weights_the_swiglu_output_before_its_q8_k_rounding():
    """ds4 (matvec_iq2_xxs_mid_worker, then quantize_mid_pairs_worker): mid = silu(gate) * up *
    weight, clamped gate <= c and |up| <= c first, then Q8_K-rounded for the down projection.
    Weighting after the down projection (transformers' order) gives other bits."""
    rng = np.random.default_rng(3)
    lw, ops = _experts(rng), NumpyOps("ds4")
    u = rng.standard_normal((2, 256)).astype(np.float32) * 3
    we = np.array([[0.37], [1.21]], np.float32)
    xe = ops.expert_act(lw.gate_exps, u)
    got = ops.expert_out(lw, 1, xe, we, np.float32(10.0))
    g = ops.expert_linear(lw.gate_exps.expert(1), xe)
    v = ops.expert_linear(lw.up_exps.expert(1), xe)
    mid = (ops.silu(np.minimum(g, 10)) * np.clip(v, -10, 10)) * we
    want = D.q8_k_matmul(Q.Q2_K, lw.down_exps.data[1], D.q8_k_act(mid))
    assert np.array_equal(got, want)
    after = ops.expert_linear(lw.down_exps.expert(1), ops.expert_act(lw.down_exps, mid / we)) * we
    assert not np.array_equal(got, after)


def test_topk_ties_go_to_the_lowest_index():
    """ds4's topk_desc and its indexer selection: repeated argmax with a strict '>', so among
    equal scores the lowest index wins."""
    s = np.array([[1.0, 3.0, 3.0, 0.5, 3.0]], np.float32)
    assert NumpyOps.topk_lowest_index(s, 2).tolist() == [[1, 2]]


def test_rmsnorm_is_ds4s_bit_for_bit():
    """ds4.c rms_norm_weight: float64 sum of squares, then a float32 scale 1 / sqrtf(ss/n + eps),
    then (x * w) * scale. The float64 scale rounded once and (x * scale) * w (the exact-numerics
    form) miss ds4's bits at many values."""
    got = NumpyOps("ds4").rmsnorm(FIX["x"], FIX["rms_w"], 1e-6)
    assert np.array_equal(got.view(np.uint32), FIX["rms_y"].view(np.uint32))
    assert (NumpyOps.rmsnorm(FIX["x"], FIX["rms_w"], 1e-6) != FIX["rms_y"]).mean() > 0.1


def test_cpu_rmsnorm_follows_in_ds4_numerics():
    from engine.backends.cpu import kernels as K
    from engine.backends.cpu.ops import CpuOps
    if K._K is None:
        pytest.skip("engine.backends.cpu._kernels is not built")
    rng = np.random.default_rng(9)
    cpu, ref = CpuOps("ds4"), NumpyOps("ds4")
    for shape in ((1, 256), (5, 4, 128), (3, 1024)):
        x = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 3)).astype(np.float32)
        w = rng.standard_normal(shape[-1]).astype(np.float32)
        for ww in (None, w):
            assert np.array_equal(cpu.rmsnorm(x, ww, 1e-6), ref.rmsnorm(x, ww, 1e-6)), (shape, ww is None)
