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


def _decode(path, toks, dec, moe_only=False):
    """Prefill toks, then decode dec one token a step on the emulated cupy backend (ds4
    numerics): the logits, the engine, and per step what the stand-in counted (xp.OPS)."""
    from engine import Engine, Session
    with Engine.open(path, backend="cupy", numerics="ds4") as e:
        if moe_only:                    # the model finds no block graphs: the MoE graphs alone
            e.model.ops.decode_block = None
        hashed = [lw.tid2eid is not None for lw in e.model.w.layers]
        s = Session(e, 64)
        s.sync(toks, keep_logits=True)
        out, ops = [], []
        for t in dec:
            xp.OPS = {}
            try:
                out.append(s.eval(t).copy())
                ops.append(xp.OPS)
            finally:
                xp.OPS = None
        return np.array(out), e, ops, hashed


@pytest.fixture(scope="module")
def hash_and_topk(tmp_path_factory):
    """two_layers' kinds (ratio 4 with the indexer, ratio 128), layer 0 routed by token id (a
    hash layer), layer 1 by top-k: both routings inside a graph."""
    from engine.gguf.synth import config_for, write_synthetic
    cfg, vocab = config_for("tiny", n_layer=2, ratios=[4, 128], vocab=300, n_hash_layer=1)
    return write_synthetic(tmp_path_factory.mktemp("graphs") / "h1.gguf", cfg, recipe="q2", vocab=vocab, seed=7).path


@need_emulation
def test_decode_logits_with_graphs_are_the_eager_ones(emulate, monkeypatch, hash_and_topk):
    """Each layer's FFN sublayer (HC, norm, router, experts, HC; the MoE graph inside it) and its
    attention's front (HC, norms, projections) and back (output projections, HC) are CUDA graphs
    of a decode step (ops.decode_block); logits bit for bit the eager ones, and the ops issued
    per step from Python counted on the stand-in (printed: docs/cuda.md's figures)."""
    toks, dec = list(range(3, 7)), [7, 11, 2]          # warm-up, capture, replay
    got, e, ops, hashed = _decode(hash_and_topk, toks, dec)
    assert hashed == [True, False]
    g = e.model.ops.graphs
    # 2 layers, 3 graphs each: the attention's front and back, the FFN sublayer
    assert g is not None and g.captures == 6 and g.replays == 6 * (len(dec) - 1)
    moe, e1, ops_moe, _ = _decode(hash_and_topk, toks, dec, moe_only=True)
    monkeypatch.setenv(graphs.ENV, "0")
    want, e0, ops_eager, _ = _decode(hash_and_topk, toks, dec)
    assert e0.model.ops.graphs is None
    assert got.tobytes() == want.tobytes() == moe.tobytes()
    # step 3 (a replay in both graph forms; no compressor window closes at position 6)
    print("ops issued a decode step (2 layers): eager", ops_eager[2], "MoE graphs", ops_moe[2],
          "block graphs", ops[2])
    assert ops[2]["graphs"] == 6 and ops_moe[2]["graphs"] == 2 and "graphs" not in ops_eager[2]
    assert ops[2]["issued"] < ops_moe[2]["issued"] < ops_eager[2]["issued"]
    assert ops[2]["in_graphs"] > ops_moe[2]["in_graphs"]
