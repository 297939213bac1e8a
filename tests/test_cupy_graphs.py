"""CUDA graphs of the decode step's MoE blocks (engine/backends/cupy/graphs.py) on the CuPy
stand-in, which models capture and replay step for step (standin.Graph):

* the stand-in's model itself: a replay recomputes every captured op and kernel launch on the
  buffers the capture used (new input values are read, Python scalars stay baked in), and a host
  transfer or a capture on the null stream is an error, as on a device;
* the backend: decode logits with graphs are the eager ones bit for bit, the replayed launch
  sequence is the eager one (same kernels, grids, blocks, scalar arguments), and a new shape gets
  its own graph (warm-up, capture) instead of replaying another shape's.
"""
from __future__ import annotations

import numpy as np
import pytest

from engine.backends.cupy import device, graphs, standin as xp

from test_cupy_backend import EMULATION, _logits, two_layers  # noqa: F401  (two_layers: a fixture)

need_emulation = pytest.mark.skipif(not EMULATION, reason="a CUDA device serves here (or no C++ compiler "
                                    "for the emulation)")


# -- the stand-in's capture model -------------------------------------------------------------------
def test_a_replay_reads_the_captured_buffers_and_bakes_python_scalars():
    x = xp.asarray(np.arange(4, dtype=np.float32))
    w = xp.asarray(np.full(4, 2, dtype=np.float32))
    s = xp.cuda.Stream(non_blocking=True)
    pos = 5
    with s:
        s.begin_capture()
        y = (x * w + pos).astype(xp.float32)
        z = xp.zeros(4, dtype=xp.float32)
        z[1:3] = y[1:3]                          # an in-place write inside the graph
        total = z.sum()
        g = s.end_capture()
    assert np.isnan(y.get()).all() and np.isnan(float(total))      # nothing has run yet
    g.launch()
    assert y.get().tolist() == [5, 7, 9, 11] and z.get().tolist() == [0, 7, 9, 0] and float(total) == 16.0
    x[...] = xp.asarray(np.full(4, 10, dtype=np.float32))     # new input values, same buffer
    pos = 100                                                   # a Python value: baked at capture
    g.launch()
    assert y.get().tolist() == [25] * 4 and z.get().tolist() == [0, 25, 25, 0] and float(total) == 50.0
    assert pos == 100


@pytest.mark.parametrize("what", ["asnumpy", "upload", "float", "sync"])
def test_a_host_transfer_inside_a_capture_is_an_error(what):
    x = xp.asarray(np.arange(3, dtype=np.float32))
    s = xp.cuda.Stream(non_blocking=True)
    s.begin_capture()
    try:
        with pytest.raises(RuntimeError, match="graph capture"):
            {"asnumpy": lambda: xp.asnumpy(x), "upload": lambda: xp.asarray(np.ones(3)),
             "float": lambda: float(x.sum()), "sync": lambda: s.synchronize()}[what]()
    finally:
        s.end_capture()
    with pytest.raises(RuntimeError, match="null"):
        xp.cuda.Stream.null.begin_capture()


# -- the backend ------------------------------------------------------------------------------------
@pytest.fixture
def emulate(monkeypatch):
    monkeypatch.setenv(device.EMULATE_ENV, "1")
    monkeypatch.setenv("DS4_CUDA_EMU_ORDERS", "1")
    monkeypatch.setenv("DS4_CUDA_EMU_ISOLATE", "0")


def _moe_calls(ops, lw, calls):
    """ops.moe over (u, sel, wsel) host triples: the outputs and each call's launch log."""
    outs, logs = [], []
    for u, sel, wsel in calls:
        xp.LAUNCH_LOG = []
        try:
            outs.append(xp.asnumpy(ops.moe(lw, xp.asarray(u), xp.asarray(sel), xp.asarray(wsel), 7.0)))
            logs.append(xp.LAUNCH_LOG)
        finally:
            xp.LAUNCH_LOG = None
    return outs, logs


@need_emulation
@pytest.mark.parametrize("numerics", ["ds4", "exact"])
def test_moe_replays_the_eager_launches_and_results_and_a_new_shape_gets_its_own_graph(
        emulate, monkeypatch, two_layers, numerics):
    from engine.backends.cupy import kernels
    from engine.backends.cupy.ops import CupyOps
    from engine.gguf.model_file import ModelFile
    from engine.backends.numpy.ops import NumpyOps
    rng = np.random.default_rng(3)
    with ModelFile.open(two_layers) as mf:
        lw = NumpyOps(numerics).bind_weights(mf)[0].layers[0]
        n_in, n_exp = lw.gate_exps.dims[0], lw.gate_exps.dims[2]

        def call(T):
            sel = np.stack([rng.choice(n_exp, 2, replace=False) for _ in range(T)]).astype(np.int64)
            return (rng.standard_normal((T, n_in), dtype=np.float32), sel, rng.random((T, 2)).astype(np.float32))
        calls = [call(1) for _ in range(4)] + [call(2), call(2), call(2), call(1)]
        k = kernels.load(xp)
        on = CupyOps(numerics, xp, k)
        monkeypatch.setenv(graphs.ENV, "0")
        off = CupyOps(numerics, xp, k)
        assert on.graphs is not None and off.graphs is None
        got, got_log = _moe_calls(on, lw, calls)
        want, want_log = _moe_calls(off, lw, calls)
    for g, w in zip(got, want):
        assert g.tobytes() == w.tobytes()
    # T = 1: warm-up, capture, then replays; T = 2 the same again; the last T = 1 replays
    assert (on.graphs.captures, on.graphs.replays) == (2, 6)
    assert got_log == want_log and all(got_log)
    assert got_log[2] == got_log[0] != got_log[4]      # a replay launches what the eager call did


@need_emulation
def test_decode_logits_with_graphs_are_the_eager_ones(emulate, monkeypatch, two_layers):
    toks, dec = list(range(3, 9)), [7, 11, 2, 5]
    pre, got, e = _logits(two_layers, "cupy", toks, "ds4", decode=dec)
    g = e.model.ops.graphs
    assert g is not None and g.captures == 2 and g.replays == 2 * (len(dec) - 1)     # 2 layers
    monkeypatch.setenv(graphs.ENV, "0")
    pre0, want, e0 = _logits(two_layers, "cupy", toks, "ds4", decode=dec)
    assert e0.model.ops.graphs is None
    assert got.tobytes() == want.tobytes() and pre.tobytes() == pre0.tobytes()
