"""Exact numerics against transformers' DeepseekV4ForCausalLM (golden logits, no torch needed).

tests/golden/tf_tiny_{q2,q4}.npz were made by tests/reference/make_golden.py (README there): the
project's synthesizer writes a tiny GGUF, transformers 5.23 runs its dequantized weights in fp32
over 640 tokens. Here the same GGUF is synthesized again (its sha256 must match, or the golden
files are stale) and the engine must reproduce every position to 1e-3 with the same argmax: in
one full prefill, token by token (= chunk size 1), and in chunks of 7, 64 and 256.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from engine import Engine, Session
from engine.gguf.synth import config_for, write_synthetic

GOLDEN = Path(__file__).parent / "golden"
TOL = 1e-4  # the issue asks 1e-3; float64 accumulation lands at ~6e-6


def recipes(*fast: str):
    """The golden recipes as `golden`'s parameters, those not in `fast` slow-marked."""
    return [pytest.param(r, marks=() if r in fast else pytest.mark.slow) for r in ("q2", "q4", "mxfp4")]


# The default run holds q2 to the golden logits token by token and in chunks: how a pass is cut does
# not depend on the experts' format, so q4's and mxfp4's decode and chunked runs are slow. The full
# prefill of every recipe is held to the same tolerance and argmax on every backend (the NumPy
# reference's row is this test, the same model and check) by test_backend_conformance's
# test_exact_forward_within_the_golden_tolerance in every run, so here it is slow too.
@pytest.fixture(scope="module")
def golden(request, tmp_path_factory):
    d = np.load(GOLDEN / f"tf_tiny_{request.param}.npz")
    a = json.loads(str(d["synth_args"]))
    cfg, vocab = config_for(a["preset"], vocab=a["vocab"], **a["overrides"])
    path = tmp_path_factory.mktemp("golden") / f"tiny-{a['recipe']}.gguf"
    write_synthetic(path, cfg, recipe=a["recipe"], vocab=vocab, seed=a["seed"])
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    assert sha == str(d["gguf_sha256"]), ("the synthesizer's output changed: regenerate the golden "
                                          "files with tests/reference/make_golden.py")
    with Engine.open(path, numerics="exact") as e:
        yield request.param, e, d["token_ids"].tolist(), d["logits"]


def _check(name, ours, ref):
    d = np.abs(ours - ref).max(axis=1)
    print(f"{name}: max-abs {d.max():.2e} (median {np.median(d):.2e}), "
          f"relative {d.max() / np.abs(ref).max():.2e}, argmax agree {(ours.argmax(1) == ref.argmax(1)).mean():.3f}")
    assert d.max() <= TOL and (ours.argmax(1) == ref.argmax(1)).all()


@pytest.mark.parametrize("golden", recipes(), indirect=True)
def test_full_prefill(golden):
    recipe, e, toks, ref = golden
    _check(f"{recipe} full prefill", Session(e, 1024).sync(toks, keep_logits=True), ref)


@pytest.mark.parametrize("golden", recipes("q2"), indirect=True)
def test_token_by_token_decode(golden):
    recipe, e, toks, ref = golden
    s = Session(e, 1024)
    _check(f"{recipe} decode", np.array([s.eval(t).copy() for t in toks]), ref)


@pytest.mark.parametrize("golden", recipes("q2"), indirect=True)
@pytest.mark.parametrize("chunk", [7, 64, 256])
def test_chunked_prefill(golden, chunk):
    recipe, e, toks, ref = golden
    _check(f"{recipe} chunk {chunk}", Session(e, 1024, chunk=chunk).sync(toks, keep_logits=True), ref)
