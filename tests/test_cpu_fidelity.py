"""Fidelity of the cpu backend to the NumPy reference on models it has never seen (issue 22, part 1).

The reference here is NumpyOps' default (q8_dot="ds4"): a Q8 matmul's blocks summed in float32 in
ds4's order (issue 33), which the cpu backend's integer kernels compute bit for bit.

Three freshly synthesized tiny models (their own seeds; 3 layers: a hash-routed layer with the
ratio-4 indexer, a top-k routed ratio-128 layer, a top-k routed ratio-4 layer), 704 positions each,
prefilled in chunks of 64 in ds4 numerics. Per (position, layer) the test records the decisions:
the routed experts of the top-k layers and the compressed rows the indexer picks.

* The decisions themselves: the cpu backend's ops, given the reference's own inputs at each
  decision (the same hidden state, cache and weights), pick what the reference picks. This is
  what the cpu backend computes differently in the decision's inputs (router logits from float32
  kernels, float32 indexer scores), and it must never turn a decision.
* The Q8 matmuls: a reference pass whose Q8_0 linears and routed-expert products run on the cpu
  backend's integer kernels is bit-identical to the reference pass (logits and every decision).
  Both compute ds4's function (exact integer dots per block, times the float32 scale product,
  added in float32 in block order: model/ds4_matmul.py).
* End to end, the issue's bar: the cpu pass's own decisions equal the reference's at >= 99.5 % of
  the pairs and its logits' p90 max-abs is <= 0.25. Every op before a quantizer now computes the
  reference's function (the integer kernels' block sums in ds4's float32 order; each other
  reduction as if exact, rounded to float32 once: the float kernels' and attention's float64 sums, the reference's own
  indexer einsums), so the two passes are bit-identical in practice: on AVX-512 all three seeds give
  100 % of the decisions and logits equal to the last bit (the test asks for the bar). A single ulp anywhere would flip a Q8 code now
  and then and the passes would drift apart (~1e-2 within a layer or two, turning near-ties in
  routing and the FP4-quantized indexer scores: 97-98 % / 63-70 % / p90 0.24-0.29 before).
"""
from __future__ import annotations

import numpy as np
import pytest

from engine.backends.cpu import kernels as K

pytestmark = pytest.mark.skipif(not K.available(), reason="engine.backends.cpu._kernels is not built")

SEEDS = (101, 202, 303)
POSITIONS = 704
CHUNK = 64
CONFIG = dict(n_layer=3, ratios=[4, 128, 4], n_hash_layer=1, vocab=465)


def _record(path, backend: str, twin=None, patch=None) -> dict:
    """One ds4-numerics prefill of POSITIONS tokens: logits [T, vocab] and the decisions per
    (position, layer). With `twin` (an ops object), every decision is also taken by twin's ops on
    this pass's own inputs at that moment ("twin_routes", "twin_picks"). `patch(ops)` may replace
    some of the backend's ops first."""
    from engine import Engine, Session
    from engine.model.model import Model

    rec = {"routes": {}, "picks": {}, "twin_routes": {}, "twin_picks": {}}
    fwd, isel = Model.forward, Model._indexer_select
    at = {"pos0": 0}

    def forward(self, tokens, pos0, state, all_logits=False):
        at["pos0"] = pos0
        return fwd(self, tokens, pos0, state, all_logits)

    def indexer_select(self, lw, ls, h, qr, pos, th_fn):
        got = isel(self, lw, ls, h, qr, pos, th_fn)
        if got is None:                      # every visible row is used: no decision
            return got
        rec["picks"].update(_picks(got, pos, lw.il))
        if twin is not None:
            own, self.ops = self.ops, twin
            try:
                rec["twin_picks"].update(_picks(isel(self, lw, ls, h, qr, pos, th_fn), pos, lw.il))
            finally:
                self.ops = own
        return got

    with Engine.open(path, backend=backend, numerics="ds4", paging="none") as eng:
        ops, c = eng.model.ops, eng.config
        if patch is not None:
            patch(ops)
        moe = ops.moe

        def routed_moe(lw, u, sel, wsel, limit):
            if lw.tid2eid is None:           # top-k layers (a hash layer's choice is a table lookup)
                rec["routes"].update(_routes(sel, at["pos0"], lw.il))
                if twin is not None:
                    p = np.sqrt(twin.softplus(twin.linear(lw.gate_inp, u)))
                    p = p + lw.bias if lw.bias is not None else p
                    rec["twin_routes"].update(_routes(twin.topk_lowest_index(p, c.n_expert_used), at["pos0"], lw.il))
            return moe(lw, u, sel, wsel, limit)

        ops.moe = routed_moe
        Model.forward, Model._indexer_select = forward, indexer_select
        try:
            toks = np.random.default_rng(7).integers(0, c.n_vocab, POSITIONS).tolist()
            rec["logits"] = Session(eng, POSITIONS + 8, chunk=CHUNK).sync(toks, keep_logits=True)
        finally:
            Model.forward, Model._indexer_select = fwd, isel
    return rec


def _routes(sel, pos0, il):
    sel = np.asarray(sel)
    return {(pos0 + t, il): tuple(sorted(sel[t].tolist())) for t in range(sel.shape[0])}


def _picks(got, pos, il):
    idx, ok = (np.asarray(a) for a in got)
    return {(int(p), il): tuple(idx[t][ok[t]].tolist()) for t, p in enumerate(pos)}


def _agreement(a: dict, b: dict) -> tuple[float, int]:
    assert a.keys() == b.keys() and a
    same = sum(a[k] == b[k] for k in a)
    return same / len(a), len(a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from engine.backends.cpu.ops import CpuOps
    from engine.gguf.synth import config_for, write_synthetic

    out = {}
    folder = tmp_path_factory.mktemp("fidelity")
    cfg, vocab = config_for("tiny", **CONFIG)
    for seed in SEEDS:
        path = write_synthetic(folder / f"tiny-{seed}.gguf", cfg, recipe="q2", vocab=vocab, seed=seed).path
        out[seed] = (_record(path, "numpy", twin=CpuOps("ds4")), path)
    return out


def test_the_models_take_every_kind_of_decision(runs):
    for seed, (ref, _) in runs.items():
        layers_r = {il for _, il in ref["routes"]}
        layers_p = {il for _, il in ref["picks"]}
        assert layers_r == {1, 2} and layers_p == {0, 2}, seed           # top-k routing, indexer top-k
        assert len(ref["routes"]) == 2 * POSITIONS
        assert len(ref["picks"]) > POSITIONS                              # (from position 67 on)


def test_cpu_decisions_on_the_references_inputs_equal_the_references(runs):
    for seed, (ref, _) in runs.items():
        r, n_r = _agreement(ref["routes"], ref["twin_routes"])
        p, n_p = _agreement(ref["picks"], ref["twin_picks"])
        print(f"seed {seed}: cpu ops on the reference's inputs: routing {100 * r:.2f} % of {n_r}, "
              f"indexer {100 * p:.2f} % of {n_p}")
        assert r >= 0.995 and p >= 0.995, seed


def _cpu_q8_matmuls(ops):
    """ops' Q8 matmuls (Q8_0 linears, the routed experts' Q8_K / Q8_0 products) replaced by the
    cpu backend's integer kernels; every other op stays ops' own (linears, grouped_linear and
    routed reach these through the instance)."""
    from engine.backends.cpu.ops import CpuOps
    from engine.gguf import quants as Q
    cpu = CpuOps("ds4")
    linear, act, elin = ops.linear, ops.expert_act, ops.expert_linear

    def linear_q8(w, x, rows=None):
        return cpu.linear(w, x, rows) if w.type_id == Q.Q8_0 else linear(w, x, rows)

    def expert_act_q8(w, x):
        return cpu.expert_act(w, x) if w.type_id in K.Q8_ACT_BLOCK else act(w, x)

    def expert_linear_q8(w, x):
        return cpu.expert_linear(w, x) if w.type_id in K.Q8_ACT_BLOCK else elin(w, x)

    ops.linear, ops.expert_act, ops.expert_linear = linear_q8, expert_act_q8, expert_linear_q8


def test_cpu_q8_matmuls_leave_a_reference_pass_bit_identical(runs):
    """The integer kernels compute the reference's function (ds4's float32 block order;
    tests/test_kernels_q8_exact.py): a reference pass whose every Q8 matmul runs on
    them is the reference pass, logits bit for bit and every decision, over 704 positions. (Before,
    these matmuls alone moved the indexer's decisions to ~71 %: docs/cpu-kernels.md, "Fidelity".)"""
    seed = SEEDS[0]
    ref, path = runs[seed]
    got = _record(path, "numpy", patch=_cpu_q8_matmuls)
    r, _ = _agreement(ref["routes"], got["routes"])
    p, _ = _agreement(ref["picks"], got["picks"])
    same = np.mean(np.all(got["logits"] == ref["logits"], axis=1))
    print(f"seed {seed}: reference pass with the cpu Q8 matmuls: routing {100 * r:.2f} %, indexer {100 * p:.2f} %, "
          f"positions with bit-identical logits {100 * same:.2f} %")
    assert r == 1.0 and p == 1.0 and same == 1.0


def test_cpu_pass_takes_the_references_decisions_and_logits(runs):
    worst = []
    for seed, (ref, path) in runs.items():
        got = _record(path, "cpu")
        r, _ = _agreement(ref["routes"], got["routes"])
        p, _ = _agreement(ref["picks"], got["picks"])
        err = np.abs(got["logits"] - ref["logits"]).max(axis=1)
        p90 = float(np.percentile(err, 90))
        print(f"seed {seed}: cpu pass vs reference: routing {100 * r:.2f} %, indexer {100 * p:.2f} %, "
              f"logits max-abs median {np.median(err):.3f} p90 {p90:.3f} max {err.max():.3f}")
        worst.append((min(r, p), p90))
    # the bar. What the float64 sums gave on AVX-512 (2026-12-02) is identity: 100 %, 0.000;
    # a float64 rounding that survives the float32 one (rare, build-dependent) would start a drift,
    # so the assertion is the bar, not the identity
    assert min(w[0] for w in worst) >= 0.995 and max(w[1] for w in worst) <= 0.25, worst
