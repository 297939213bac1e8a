"""The cupy backend's `ds4` numerics on its kernels (host emulation): the Q8_0 products and the
routed experts (IQ2_XXS / Q2_K with the q2 recipe) go through ds4's own dot products on the device
(cuda_kernels/ds4_dot.cu for a decode step, the tensor-core ds4_mma.cu for a prefill chunk) and give
the NumPy reference's bits (engine/model/ds4_matmul.py's block order), not just values within a
tolerance. Before these kernels were wired in, the kernel path summed the Q8-rounded activations in
float32 in another order and these comparisons failed.
"""
from __future__ import annotations

import numpy as np
import pytest

from engine.backends.cupy import device, standin as xp
from engine.backends.numpy.ops import NumpyOps
from engine.gguf.model_file import ModelFile

from test_cupy_backend import EMULATION, _synth

pytestmark = pytest.mark.skipif(not EMULATION, reason="a CUDA device serves here (or no C++ compiler "
                                "for the emulation): tests/test_cuda_mma.py runs these kernels on it")


@pytest.fixture(scope="module")
def ops_pair(tmp_path_factory):
    """(cupy ops on the emulated kernels, numpy ops, the layer weights of a q2-recipe model)."""
    mp = pytest.MonkeyPatch()
    mp.setenv(device.EMULATE_ENV, "1")
    mp.setenv("DS4_CUDA_EMU_ORDERS", "1")
    mp.setenv("DS4_CUDA_EMU_ISOLATE", "0")
    from engine.backends.cupy import kernels
    from engine.backends.cupy.ops import CupyOps
    path = _synth(tmp_path_factory.mktemp("cupy_ds4"), 11, ratios=[4])
    mf = ModelFile.open(path)
    ref = NumpyOps("ds4")
    w, _ = ref.bind_weights(mf)
    yield CupyOps("ds4", xp, kernels.load(xp)), ref, w.layers[0]
    mf.close()
    mp.undo()


@pytest.mark.parametrize("T", [3, 20])      # a decode-size batch (ds4_matvec), a prefill chunk (ds4_gemm)
def test_q8_0_linear_is_the_reference_bit_for_bit(ops_pair, T):
    cu, ref, lw = ops_pair
    rng = np.random.default_rng(T)
    x = rng.standard_normal((T, lw.q_a.dims[0]), dtype=np.float32)
    cu.k.launches.clear()
    got = xp.asnumpy(cu.linear(lw.q_a, x))
    assert got.tobytes() == ref.linear(lw.q_a, x).tobytes()
    # the activation's codes from the quantize kernel, then ds4's dots: two launches
    assert cu.k.launches == {"q8_0_quantize": 1, ("ds4_gemm_q8_0" if T >= 16 else "ds4_matvec_q8_0"): 1}


@pytest.mark.parametrize("P", [6, 24])     # a decode step's pairs (ds4_matvec), a prefill's (ds4_gemm)
@pytest.mark.parametrize("which", ["gate_exps", "down_exps"])      # IQ2_XXS (Q8_K codes), Q2_K
def test_expert_products_are_the_reference_bit_for_bit(ops_pair, P, which):
    cu, ref, lw = ops_pair
    w = getattr(lw, which)
    rng = np.random.default_rng(100 + P)
    x = rng.standard_normal((P, w.dims[0]), dtype=np.float32)
    experts = rng.integers(0, min(w.dims[2], 3), P).astype(np.int32)       # pairs share experts
    toks = rng.permutation(P).astype(np.int32)
    cu.k.launches.clear()
    got = xp.asnumpy(cu._kexperts(cu._w(w), xp.asarray(x), xp.asarray(experts), xp.asarray(toks)))
    want = np.stack([ref.expert_linear(w.expert(int(e)), ref.expert_act(w, x[t:t + 1]))[0]
                     for e, t in zip(experts, toks)])
    assert got.tobytes() == want.tobytes()
    kind = {16: "iq2_xxs", 10: "q2_k"}[w.type_id]
    assert cu.k.launches == {"q8_k_quantize": 1, (f"ds4_gemm_{kind}" if P >= 16 else f"ds4_matvec_{kind}"): 1}


@pytest.mark.parametrize("with_w", [True, False])
def test_rmsnorm_ds4_runs_its_kernel_bit_for_bit(ops_pair, with_w):
    cu, ref, lw = ops_pair
    rng = np.random.default_rng(7)
    x = rng.standard_normal((5, 256), dtype=np.float32) * np.float32(3)
    w = rng.standard_normal(256, dtype=np.float32) if with_w else None
    cu.k.launches.clear()
    got = xp.asnumpy(cu.rmsnorm(xp.asarray(x), None if w is None else xp.asarray(w), 1e-6))
    assert got.tobytes() == ref.rmsnorm(x, w, 1e-6).tobytes()
    assert cu.k.launches == {"rmsnorm_ds4": 1}       # one launch, not the ~12 array ops of its form


def test_store_kv_runs_its_kernel_bit_for_bit(ops_pair):
    cu, ref, lw = ops_pair
    rows = np.random.default_rng(8).standard_normal((3, 192), dtype=np.float32) * np.float32(9)
    cu.k.launches.clear()
    got = xp.asnumpy(cu.store_kv(xp.asarray(rows), 128))
    assert got.tobytes() == ref.store_kv(rows, 128).tobytes()
    assert cu.k.launches == {"kv_store_ds4": 1}
