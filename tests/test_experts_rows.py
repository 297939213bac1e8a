"""Issue 23: a batched decode step's routed experts (B rows x k experts) on the cpu backend in ds4
numerics take CpuOps._experts_rows: two kernel calls and a few NumPy calls a layer, bit for bit
what the general path (an expert at a time, out[rows] += d) computes, including experts that
several rows share (one product of those rows)."""
from __future__ import annotations

import numpy as np
import pytest

from engine import Engine
from engine.backends.cpu import kernels
from engine.backends.cpu import ops as cpu_ops
from engine.gguf import quants as Q

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="engine.backends.cpu._kernels is not built")


def _case(rng, c, B, shared_pick, k):
    u = rng.standard_normal((B, c.n_embd)).astype(np.float32)
    sel = np.stack([rng.choice(c.n_expert, k, replace=False) for _ in range(B)])
    if shared_pick:                                   # rows 0 and B-1 both pick row 0's first expert
        e = sel[0, 0]
        if e not in sel[B - 1]:
            sel[B - 1, 1] = e
    wsel = rng.random(sel.shape).astype(np.float32)
    return u, sel, wsel


@needs_kernels
def test_few_rows_experts_equal_the_general_path(small_model, monkeypatch):
    with Engine.open(small_model, backend="cpu", numerics="ds4") as e:
        ops, c = e.model.ops, e.config
        lw = next(lw for lw in e.model.w.layers if lw.tid2eid is None)
        if not (lw.sh_gate.type_id == Q.Q8_0 and ops._batched_experts(lw)):
            pytest.skip("the small model's shared expert is not Q8_0 / its experts have no integer kernel")
        rng = np.random.default_rng(23)
        limit = np.float32(c.swiglu_clamp[lw.il])
        # k = 4 of the tiny model's 8 experts besides its own 2: a row's sum of 4 float32 terms
        # depends on their order (of 2 it does not)
        cases = [_case(rng, c, B, shared_pick, k) for B in (2, 3, 4, 8, 16) for shared_pick in (False, True)
                 for k in sorted({c.n_expert_used, min(4, c.n_expert)})]
        fast = []
        for u, sel, wsel in cases:
            for shared in (True, False):
                got = ops._experts_rows(lw, u, sel, wsel, limit, shared)
                assert got is not None
                fast.append(got)
                # and through the public ops, which must pick this path at these row counts
                pub = ops.moe(lw, u, sel, wsel, limit) if shared else ops.routed(lw, u, sel, wsel, limit)
                assert np.array_equal(pub.view(np.uint32), got.view(np.uint32)), (u.shape, shared)
        monkeypatch.setattr(cpu_ops, "ROWS_MAX", 0)      # the general path, expert by expert
        i = 0
        for u, sel, wsel in cases:
            for shared in (True, False):
                want = ops.moe(lw, u, sel, wsel, limit) if shared else ops.routed(lw, u, sel, wsel, limit)
                assert np.array_equal(fast[i].view(np.uint32), want.view(np.uint32)), (u.shape, shared)
                i += 1
        # a row that picks an expert twice (hash routing could) is left to the general path
        u, sel, wsel = cases[2]
        sel = sel.copy()
        sel[1, 1] = sel[1, 0]
        monkeypatch.setattr(cpu_ops, "ROWS_MAX", 16)
        calls = []
        monkeypatch.setattr(ops, "_experts_rows", lambda *a: calls.append(a))
        ops.moe(lw, u, sel, wsel, limit)
        assert calls == []
