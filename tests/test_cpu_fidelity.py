"""Fidelity of the cpu backend to the NumPy reference on models it has never seen (issue 22, part 1).

Three freshly synthesized tiny models (their own seeds; 3 layers: a hash-routed layer with the
ratio-4 indexer, a top-k routed ratio-128 layer, a top-k routed ratio-4 layer), 704 positions each,
prefilled in chunks of 64 in ds4 numerics. Per (position, layer) the test records the decisions:
the routed experts of the top-k layers and the compressed rows the indexer picks.

* The decisions themselves: the cpu backend's ops, given the reference's own inputs at each
  decision (the same hidden state, cache and weights), pick what the reference picks. This is
  what the cpu backend computes differently in the decision's inputs (router logits from float32
  kernels, float32 indexer scores), and it must never turn a decision.
* End to end, the issue's bar: the cpu pass's own decisions equal the reference's at >= 99.5 % of
  the pairs and its logits' p90 max-abs is <= 0.25. Not met today (strict xfail, the numbers are
  printed): both passes are deterministic, but a one-ulp difference anywhere before a Q8
  quantizer flips an activation code now and then (1/127 of a block's maximum), and from there
  the two passes drift apart by ~1e-2 relative within a layer or two, enough to turn near-ties in
  the routing and the FP4-quantized indexer scores. Meeting it takes every op before a
  quantizer bit-identical to the reference; docs/cpu-kernels.md ("Fidelity") lists which are
  and which are not, and why the Q8 matmuls cannot be against today's reference.
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


def _record(path, backend: str, twin=None) -> dict:
    """One ds4-numerics prefill of POSITIONS tokens: logits [T, vocab] and the decisions per
    (position, layer). With `twin` (an ops object), every decision is also taken by twin's ops on
    this pass's own inputs at that moment ("twin_routes", "twin_picks")."""
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


@pytest.mark.xfail(strict=True, reason="issue 22: one-ulp differences before Q8 quantizers (float32 "
                   "matmuls and attention against the reference's float64, Q8 activations as integer "
                   "codes against the reference's float32 q * d) grow into different decisions; see the docstring")
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
    assert min(w[0] for w in worst) >= 0.995 and max(w[1] for w in worst) <= 0.25
