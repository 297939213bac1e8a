"""The cpu backend's prefill glue fast paths against their reference definitions, bit for bit.

* attention segments (keys, mask, idx): the C kernel reads row idx[t, k] of keys in place;
  NumpyOps.attention's definition gathers keys[idx]. Both equal the gathered form.
* CpuOps.query_block: the model hands the C kernel a whole chunk's queries in one call (no
  per-256-query blocks, no concatenation): a forward pass gives the logits of the 256-query blocks
  with the model's own gather, on layers of every ratio (0, 4 with the indexer picking, 128).
* the expert step's forms in ds4 numerics: the reference's (NumpyOps.moe / routed).
* _experts_rows for a prefill chunk's rows (STACK_MIN and up): the expert-by-expert form's bits.
"""
from __future__ import annotations

import numpy as np
import pytest

from engine.backends.cpu import kernels as K
from engine.backends.cpu import ops as cpu_ops
from engine.backends.cpu.fast import FastOps
from engine.backends.numpy.ops import NumpyOps

pytestmark = pytest.mark.skipif(not K.available(), reason="engine.backends.cpu._kernels is not built")
needs_attn = pytest.mark.skipif(not (K.available() and K._K.has_attention()),
                                reason="this build has no attention kernel")


def _bits(a):
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _attn_case(rng, T, H=8, D=64, N=37, k=11):
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    keys = rng.standard_normal((N, D)).astype(np.float32)
    idx = rng.integers(0, N, (T, k)).astype(np.int64)
    idx[:, 1] = idx[:, 0]                               # a row picked twice by a query counts twice
    ok = rng.random((T, k)) < 0.7
    ok[0] = False                                       # a query with no picked row: raw keys alone
    raw = rng.standard_normal((T + 5, D)).astype(np.float32)
    mraw = rng.random((T, T + 5)) < 0.5
    sinks = rng.standard_normal(H).astype(np.float32)
    return q, keys, idx, ok, raw, mraw, sinks


@needs_attn
@pytest.mark.parametrize("T", [1, 3, 257])
def test_attention_by_index_equals_the_gathered_keys(T):
    rng = np.random.default_rng(T)
    q, keys, idx, ok, raw, mraw, sinks = _attn_case(rng, T)
    by_idx = [(raw, mraw), (keys, ok, idx)]
    gathered = [(raw, mraw), (keys[idx], ok)]
    got = cpu_ops.CpuOps.attention(q, by_idx, sinks, 0.125)
    want = cpu_ops.CpuOps.attention(q, gathered, sinks, 0.125)     # the C kernel's per-query keys
    assert np.array_equal(_bits(got), _bits(want))
    ref = NumpyOps.attention(q, by_idx, sinks, 0.125)
    assert np.array_equal(_bits(ref), _bits(NumpyOps.attention(q, gathered, sinks, 0.125)))
    assert np.array_equal(_bits(got), _bits(ref))


@needs_attn
def test_attention_index_errors_are_one_line_value_errors():
    rng = np.random.default_rng(0)
    q, keys, idx, ok, raw, mraw, sinks = _attn_case(rng, 4)
    bad = idx.copy()
    bad[2, 3] = keys.shape[0]                           # one past the last row (even where not attended)
    ok[2, 3] = False
    with pytest.raises(ValueError, match="not a row"):
        cpu_ops.CpuOps.attention(q, [(keys, ok, bad)], sinks, 0.125)
    bad[2, 3] = -1
    with pytest.raises(ValueError, match="not a row"):
        cpu_ops.CpuOps.attention(q, [(keys, ok, bad)], sinks, 0.125)
    with pytest.raises(ValueError, match="idx must be int64"):
        cpu_ops.CpuOps.attention(q, [(keys, ok, idx[:, :5])], sinks, 0.125)


def test_ds4_experts_are_the_references(tmp_path):
    """Every form of the cpu backend's expert step in ds4 numerics (one token, a few rows, a
    prefill chunk's stacked rows) is the reference's: ds4's SwiGLU for the shared expert, its
    weighted one for the routed experts, each row's experts summed in slot order, then the shared
    expert added (NumpyOps.moe / routed), bit for bit. Four experts a token: the order of two
    float32 terms cannot show."""
    from engine import Engine
    from engine.gguf.synth import config_for, write_synthetic
    cfg, vocab = config_for("tiny", n_layer=1, ratios=[0], n_hash_layer=0, n_expert_used=4, vocab=465)
    path = write_synthetic(tmp_path / "k4.gguf", cfg, recipe="q2", vocab=vocab, seed=4).path
    with Engine.open(path, backend="cpu", numerics="ds4") as e:
        ops, c, ref = e.model.ops, e.config, NumpyOps("ds4")
        lw = next(lw for lw in e.model.w.layers if lw.tid2eid is None)
        if not ops._batched_experts(lw):
            pytest.skip("the small model's experts have no integer kernel")
        rng = np.random.default_rng(12)
        limit = np.float32(c.swiglu_clamp[lw.il])
        for T in (1, 3, cpu_ops.STACK_MIN + 2):
            u = rng.standard_normal((T, c.n_embd)).astype(np.float32)
            sel = np.stack([rng.choice(c.n_expert, c.n_expert_used, replace=False) for _ in range(T)])
            wsel = rng.random(sel.shape).astype(np.float32)
            for f in ("moe", "routed"):
                got, want = getattr(ops, f)(lw, u, sel, wsel, limit), getattr(ref, f)(lw, u, sel, wsel, limit)
                assert np.array_equal(_bits(got), _bits(want)), (f, T)


def test_stacked_experts_equal_the_expert_by_expert_form(small_model, monkeypatch):
    from engine import Engine
    from engine.gguf import quants as Q
    with Engine.open(small_model, backend="cpu", numerics="ds4") as e:
        ops, c = e.model.ops, e.config
        lw = next(lw for lw in e.model.w.layers if lw.tid2eid is None)
        if not (lw.sh_gate.type_id == Q.Q8_0 and ops._batched_experts(lw)):
            pytest.skip("the small model's experts have no integer kernel")
        rng = np.random.default_rng(11)
        limit = np.float32(c.swiglu_clamp[lw.il])
        for T in (cpu_ops.STACK_MIN, 40, 301):
            u = rng.standard_normal((T, c.n_embd)).astype(np.float32)
            sel = np.stack([rng.choice(c.n_expert, c.n_expert_used, replace=False) for _ in range(T)])
            wsel = rng.random(sel.shape).astype(np.float32)
            got = [ops.moe(lw, u, sel, wsel, limit), ops.routed(lw, u, sel, wsel, limit)]
            with monkeypatch.context() as m:
                m.setattr(cpu_ops, "STACK_MIN", 1 << 30)           # the expert-by-expert form
                m.setattr(ops, "_experts_rows", None)              # (and it must not be called)
                want = [ops.moe(lw, u, sel, wsel, limit), ops.routed(lw, u, sel, wsel, limit)]
            for a, b in zip(got, want):
                assert np.array_equal(_bits(a), _bits(b)), T


def _prefill_logits(path, tokens, old_glue: bool, monkeypatch):
    from engine import Engine
    with Engine.open(path, backend="cpu", numerics="ds4") as e, monkeypatch.context() as m:
        if old_glue:        # the model's 256-query blocks and its own [block, k, D] gather
            m.setattr(cpu_ops.CpuOps, "query_block", None)
            m.setattr(cpu_ops.CpuOps, "attention_index", False)
        st = e.model.ops.new_state(e.config, 1024, 0)
        return e.model.forward(np.asarray(tokens), 0, st, all_logits=True), e.config


@needs_attn
def test_one_call_attention_and_by_index_picks_keep_the_forward_bits(tmp_path, monkeypatch):
    from engine.gguf.synth import config_for, write_synthetic
    cfg, vocab = config_for("tiny", n_layer=3, ratios=[0, 4, 128], vocab=465, idx_n_head=16)
    path = write_synthetic(tmp_path / "r.gguf", cfg, recipe="q2", vocab=vocab, seed=3).path
    rng = np.random.default_rng(5)
    toks = rng.integers(0, 465, 301)                    # > 256 queries, not a multiple of 256
    new, c = _prefill_logits(path, toks, False, monkeypatch)
    assert (len(toks) // 4) > c.idx_topk                # the ratio-4 layer's indexer picks rows
    old, _ = _prefill_logits(path, toks, True, monkeypatch)
    assert np.array_equal(_bits(new), _bits(old))
    one, _ = _prefill_logits(path, toks[:1], False, monkeypatch)        # T = 1
    assert np.array_equal(_bits(one[0]), _bits(new[0]))
