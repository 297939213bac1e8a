"""mlx's ds4 quantized dot products (engine/backends/mlx/ds4_dot.py) against ds4's own bits
(tests/golden/ds4_cpu_dots.npz, outputs of ds4's compiled functions) and the reference
(engine/model/ds4_matmul.py) on random data: bit for bit, on MLX's CPU device (issue 33)."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install -e '.[mlx]')")

from engine.backends.mlx import ds4_dot as DD, quant  # noqa: E402
from engine.gguf import quants as Q  # noqa: E402
from engine.model import ds4_matmul as D  # noqa: E402

FIX = np.load(Path(__file__).parent / "golden" / "ds4_cpu_dots.npz")
pytestmark = pytest.mark.skipif(not DD.cpu_float64(), reason="the bit-for-bit rules hold on MLX's CPU device")


def _q8_0(data: np.ndarray, x: np.ndarray, rows=None) -> np.ndarray:
    n_out, n_in = data.shape[0], x.shape[1]
    w = quant.repack(SimpleNamespace(name="w", type_id=Q.Q8_0, dims=(n_in, n_out), data=data))
    if rows is not None:
        w = SimpleNamespace(w=w.w[rows], scales=w.scales[rows])
    return np.array(DD.q8_0_matmul(w.w, w.scales, mx.array(x)))


def _q8_k(name: str, data: np.ndarray, x: np.ndarray) -> np.ndarray:
    from engine.backends.mlx import numerics as MN
    q, d = MN.q8_k_codes(mx.array(x))
    return np.array(DD.q8_k_matmul(getattr(Q, name.upper()), mx.array(data), q, d, f64=True))


def _same(got, want) -> bool:
    return np.array_equal(np.asarray(got, np.float32).view(np.uint32), np.asarray(want, np.float32).view(np.uint32))


@pytest.mark.parametrize("name", ["q8_0", "iq2_xxs", "q2_k"])
def test_mlx_dots_are_ds4s_bit_for_bit(name):
    data = FIX[f"{name}_w"]
    got = _q8_0(data, FIX["x"]) if name == "q8_0" else _q8_k(name, data, FIX["x"])
    assert _same(got, FIX[f"{name}_y"]), (name, np.abs(got - FIX[f"{name}_y"]).max())


@pytest.mark.parametrize("name", ["q8_0", "iq2_xxs", "q2_k"])
def test_mlx_dots_match_the_reference_on_random_data(name):
    rng = np.random.default_rng(7)
    tid = getattr(Q, name.upper())
    n_in, n_out, T = 1024, 48, 3
    data = Q.random_blocks(tid, rng, n_out * n_in // Q._format(tid).block_elems, 0.05).reshape(n_out, -1)
    # activations with a wide range, so the block sums cancel and their order shows
    x = (rng.standard_normal((T, n_in)) * np.exp(rng.standard_normal((T, n_in)))).astype(np.float32)
    if name == "q8_0":
        want = D.q8_0_matmul(data, D.q8_0_act(x))
        got = _q8_0(data, x)
        assert _same(_q8_0(data, x, slice(8, 24)), want[:, 8:24])
    else:
        want, got = D.q8_k_matmul(tid, data, D.q8_k_act(x)), _q8_k(name, data, x)
    assert _same(got, want), (name, np.abs(got - want).max())


@pytest.mark.parametrize("name", ["iq2_xxs", "q2_k"])
def test_mlx_pair_dots_are_each_experts_dot(name):
    """The batched form (one expert's rows per pair, as the routed experts use it) gives each
    pair's dot bit for bit."""
    from engine.backends.mlx import numerics as MN
    rng = np.random.default_rng(3)
    tid = getattr(Q, name.upper())
    E, n_in, n_out, P = 4, 512, 16, 5
    data = Q.random_blocks(tid, rng, E * n_out * n_in // 256, 0.05).reshape(E, n_out, -1)
    x = rng.standard_normal((P, n_in)).astype(np.float32)
    experts = np.array([2, 0, 3, 2, 1])
    q, d = MN.q8_k_codes(mx.array(x))
    got = np.array(DD.q8_k_matmul(tid, mx.array(data)[mx.array(experts)], q, d, f64=True))
    for p, e in enumerate(experts):
        assert _same(got[p], D.q8_k_matmul(tid, data[e], D.q8_k_act(x[p:p + 1]))[0]), (name, p)


def test_mlx_q4_k_dot_is_the_references():
    """The q4 oracles' Q4_K dot (ds4_matmul.q8_k_matmul's Q4_K form) from the affine4 binding:
    sc and m recovered from the bound products, bit for bit on random blocks."""
    from engine.backends.mlx import numerics as MN
    rng = np.random.default_rng(5)
    E, n_in, n_out = 3, 512, 24
    data = Q.random_blocks(Q.Q4_K, rng, E * n_out * n_in // 256, 0.05).reshape(E * n_out, -1)
    w = quant.repack(SimpleNamespace(name="w", type_id=Q.Q4_K, dims=(n_in, n_out, E), data=data))
    x = (rng.standard_normal((4, n_in)) * np.exp(rng.standard_normal((4, n_in)))).astype(np.float32)
    q, d = MN.q8_k_codes(mx.array(x))
    for e in range(E):
        want = D.q8_k_matmul(Q.Q4_K, data[e * n_out:(e + 1) * n_out], D.q8_k_act(x))
        assert _same(np.array(DD.q4_k_matmul(w, e, q, d)), want), e
