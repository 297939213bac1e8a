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
    assert cu.k.launches == ({"ds4_gemm_q8_0": 1} if T >= 16 else {"ds4_matvec_q8_0": 1})


@pytest.mark.parametrize("T", [2, 24])
def test_routed_experts_are_the_reference_bit_for_bit(ops_pair, T):
    cu, ref, lw = ops_pair
    rng = np.random.default_rng(100 + T)
    n_exp, k = lw.gate_exps.dims[2], 2
    u = rng.standard_normal((T, lw.gate_exps.dims[0]), dtype=np.float32)
    sel = np.stack([rng.choice(min(n_exp, 3), k, replace=False) for _ in range(T)]).astype(np.int64)
    wsel = rng.random((T, k)).astype(np.float32)
    cu.k.launches.clear()
    got = xp.asnumpy(cu._routed_kernels(cu._w(lw.gate_exps), cu._w(lw.up_exps), cu._w(lw.down_exps),
                                        xp.asarray(u), xp.asarray(sel), xp.asarray(wsel), np.float32(7.0)))
    want = ref.routed(lw, u, sel, wsel, np.float32(7.0))
    assert got.tobytes() == want.tobytes()
    names = set(cu.k.launches)
    assert names and all(n.startswith("ds4_gemm_" if T >= 16 else "ds4_matvec_") for n in names), names
