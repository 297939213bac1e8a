"""`ds4` numerics on MLX's CPU device: the reference's own steps (engine/backends/numpy/ops.py).

MLX's CPU device computes float64 (matmuls, sums, elementwise: mlx 0.32), so there the mlx
backend does what the NumPy reference does, step for step (issue 33: before this, float32 sums
made mlx leave the reference by ~0.1 max-abs from the first token):

* ds4's quantized matmuls (Q8_0, IQ2_XXS, Q2_K) in ds4's block order (ds4_dot.py); the other
  weights (F16/F32 and the Q4_K / MXFP4 experts, which have no dot in ds4's CPU path) as the
  reference computes them: the exact float64 activation, a float64 matmul rounded once;
* RMSNorm's float64 mean of squares; attention, the HC mixes and the indexer scores in float64;
* the routed experts one expert at a time, in ascending expert order, each token's outputs added
  in that order (as NumpyOps.routed);
* exp where the reference takes one: float64 exp (MN.exp64) in the float64 steps; the float32
  ones (sigmoid, SwiGLU, softplus, softmax, the HC split) take MN.expf, libm's expf (ds4's): the
  exact value rounded once. NumPy's own float32 exp is a SIMD approximation (it differs from the
  rounded value for ~39 % of inputs on x86-64 with AVX-512) that MLX cannot reproduce; these ops
  match the reference bit for bit where it takes libm's values (docs/mlx.md, "Numerics").

On Metal (no float64) none of this applies: the backend keeps its float32 forms (ops.py).
"""
from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from ...gguf import quants as Q
from . import ds4_dot as DD
from . import ds4_float as DF
from . import numerics as MN
from . import quant

_F64, _F32 = mx.float64, mx.float32
_DENSE = frozenset({Q.F32, Q.F16, Q.BF16})
_K_DOT = frozenset({Q.IQ2_XXS, Q.Q2_K})


def _exact_act(w, x):
    """The reference's exact activation of a weight with no ds4 dot (N.q8_0_exact / q8_k_exact)."""
    q, d = (MN.q8_0_codes(x) if w.type_id in (Q.MXFP4, Q.Q8_0) else DD.q8_k_codes(MN._f32(x)))
    v = (q.astype(_F64) * d.astype(_F64)[..., None]).reshape(x.shape[0], -1)
    return v[:, :x.shape[1]]


def _f64_matmul(w, x64, rows=None, expert=None):
    wd = quant.dequantize(w, expert) if expert is not None else quant.dequantize(w)
    if rows is not None:
        wd = wd[rows]
    return (x64 @ wd.astype(_F64).T).astype(_F32)


class Ds4RefOps:
    """Mixed into MlxOps: the reference's forms, on the CPU device in ds4 numerics."""

    def use_reference_steps(self):
        """The reference's ds4-numerics forms as instance attributes (NumpyOps.__init__ does the
        same): ds4's compiled float32 loops (ds4_float.py) and the reference's float64 steps."""
        self.sigmoid, self.softplus, self.softmax = DF.sigmoid_stable, DF.softplus, self.softmax_ref
        self.hc_pre_mix, self.hc_post, self.hc_head = DF.hc_weighted_sum, DF.hc_post, DF.hc_head
        self.hc_split, self.attention = self.hc_split_ref, self.attention_ds4
        self.indexer_scores = self.indexer_scores_ref
        self.expert_weights = DF.expert_weights

    # -- matmuls -----------------------------------------------------------------------------
    def linear_ref(self, w, x, rows=None):
        """NumpyOps.linear: ds4's Q8_0 dot; other weights: a float64 matmul rounded once."""
        cut = (lambda a: a) if rows is None else (lambda a: a[rows])    # noqa: E731
        if w.type_id == Q.Q8_0:
            return DD.q8_0_matmul(cut(w.w), cut(w.scales), x)
        if w.type_id == Q.F16:            # ds4.c matvec_f16: float32 sums in index order
            return DF.f16_matvec(cut(w.w), x)
        return _f64_matmul(w, x.astype(_F64), rows)

    @staticmethod
    def rmsnorm_f64(x, w, eps):
        """N.rmsnorm_ds4: float64 mean of squares, then ds4's float32 scale and (x * w) * scale."""
        x = MN._f32(x)
        ms = (mx.sum(mx.square(x.astype(_F64)), axis=-1, keepdims=True) / x.shape[-1]).astype(_F32)
        scale = mx.array(1.0, _F32) / mx.sqrt(ms + mx.array(eps, _F32))
        return x * scale if w is None else (x * MN._f32(w)) * scale

    # -- elementwise, with libm's expf -------------------------------------------------------
    @staticmethod
    def softmax_ref(x, axis=-1):
        """NumpyOps.softmax, computed as it computes it: with NumPy, on the host (a sync; the
        compressors' pooling weights, a few hundred values a token). Its float32 `exp` is NumPy's
        SIMD approximation (not libm's: ds4's pool is not yet the reference's rule), which MLX's
        ops cannot reproduce; its sums are NumPy's pairwise ones."""
        h = np.array(MN._f32(x))
        m = np.max(h, axis=axis, keepdims=True)
        m = np.where(np.isfinite(m), m, 0.0)
        e = np.exp(h - m)
        return mx.array((e / np.sum(e, axis=axis, keepdims=True)).astype(np.float32))

    # -- attention and the HC split ------------------------------------------------------------
    def attention_ds4(self, q, segments, sinks, scale):
        """NumpyOps.attention_ds4: ds4's float32 loops at head dim 128 (the scale rounded to
        float32), the reference's float64 form at other widths."""
        if q.shape[-1] != 128:
            return self.attention_ref(q, segments, sinks, scale)
        return DF.attention(q, segments, sinks, np.float32(scale))      # (as the reference: float32)

    @staticmethod
    def attention_ref(q, segments, sinks, scale):
        """NumpyOps.attention: float64 inside, one rounding at the end."""
        q = MN._f32(q).astype(_F64)
        segs = [(MN._f32(k).astype(_F64), mx.array(m) if not isinstance(m, mx.array) else m)
                for k, m in segments]
        scores = []
        for keys, mask in segs:
            s = (q @ keys.T if keys.ndim == 2 else q @ mx.swapaxes(keys, 1, 2)) * scale
            scores.append(mx.where(mask.astype(mx.bool_)[:, None, :], s, -mx.inf))
        s = mx.concatenate(scores, axis=-1)
        sinks = MN._f32(sinks).astype(_F64)
        m = mx.maximum(mx.max(s, axis=-1), sinks[None, :])
        p = MN.exp64(s - m[..., None])
        den = mx.sum(p, axis=-1) + MN.exp64(sinks[None, :] - m)
        o, k0 = None, 0
        for keys, _ in segs:
            k1 = k0 + keys.shape[-2]
            part = p[..., k0:k1] @ keys
            o = part if o is None else o + part
            k0 = k1
        return (o / den[..., None]).astype(_F32)

    def hc_split_ref(self, mix, n, scale, base, eps, iters):
        """NumpyOps.hc_split in ds4 numerics (ds4_float.hc_split), compiled per (n, eps, iters)."""
        return _hc_split_compiled(n, float(np.float32(eps)), int(iters))(MN._f32(mix), MN._f32(scale), MN._f32(base))

    @staticmethod
    def indexer_scores_ref(qi, keys, wts):
        """NumpyOps.indexer_scores: float64 (and float64 out, as the reference's)."""
        qi, keys, wts = MN._f32(qi).astype(_F64), MN._f32(keys).astype(_F64), MN._f32(wts).astype(_F64)
        T, H, _ = qi.shape
        step = max(1, (1 << 24) // max(1, H * keys.shape[0]))
        out = [(wts[t0:t0 + step, None, :] @ mx.maximum(qi[t0:t0 + step] @ keys.T, 0.0))[:, 0, :]
               for t0 in range(0, T, step)]
        return out[0] if len(out) == 1 else mx.concatenate(out, axis=0)

    # -- routed experts ----------------------------------------------------------------------
    def _expert_act_ref(self, w, x):
        if w.type_id in _DENSE:
            return ("f32", x)
        if w.type_id in _K_DOT or w.type_id == Q.Q4_K:
            return ("k",) + DD.q8_k_codes(MN._f32(x))
        if w.type_id == Q.Q8_0:
            return ("q8", x)
        return ("f64", _exact_act(w, x))

    def _expert_linear_ref(self, w, e, a, rows):
        kind = a[0]
        if kind == "k" and w.type_id == Q.Q4_K:
            return DD.q4_k_matmul(w, e, a[1][rows], a[2][rows])
        if kind == "k":
            return DD.q8_k_matmul(w.type_id, w.w[e], a[1][rows], a[2][rows], True)
        if kind == "q8":
            return DD.q8_0_matmul(w.w[e], w.scales[e], a[1][rows])
        return _f64_matmul(w, a[1][rows].astype(_F64), expert=e)

    def _routed_pairs(self, gate, up, down, u, sel, wsel, limit):
        """IQ2_XXS / Q2_K experts, every (token, slot) pair at once: [T, k, E] in slot order.
        Each pair gathers its expert's raw rows (no host sync, no per-expert loop)."""
        T, k = sel.shape
        experts = sel.reshape(-1).astype(mx.int32)
        slots = getattr(gate, "slot_rows", None)          # (the expert cache: its slots hold them)
        if slots is not None:
            experts = slots(experts)
        toks = mx.repeat(mx.arange(T, dtype=mx.int32), k)
        q, d = DD.q8_k_codes(MN._f32(u))
        qp, dp = q[toks], d[toks]
        g = DD.q8_k_matmul(gate.type_id, gate.w[experts], qp, dp, True)
        v = DD.q8_k_matmul(up.type_id, up.w[experts], qp, dp, True)
        mid = DF.routed_mid(g, v, wsel.reshape(-1, 1), limit)
        q2, d2 = DD.q8_k_codes(mid)
        return DD.q8_k_matmul(down.type_id, down.w[experts], q2, d2, True).reshape(T, k, -1)

    def _routed_loop(self, gate, up, down, u, sel, wsel, limit):
        """Other expert formats: one expert at a time over the tokens that picked it (as
        NumpyOps.routed), into [T, k, E] in slot order."""
        T, k = sel.shape
        ys = mx.zeros((T * k, u.shape[1]), _F32)
        ua = self._expert_act_ref(gate, u)
        for e, rows, slot in DD.unique_experts(np.array(sel)):
            ri = mx.array(rows.astype(np.int32))
            we = wsel[ri, mx.array(slot.astype(np.int32))][:, None]
            mid = DF.routed_mid(self._expert_linear_ref(gate, e, ua, ri),
                                self._expert_linear_ref(up, e, ua, ri), we, limit)
            y = self._expert_linear_ref(down, e, self._expert_act_ref(down, mid), slice(None))
            ys = ys.at[mx.array((rows * k + slot).astype(np.int32))].add(y)
        return ys.reshape(T, k, -1)

    def moe_ref(self, lw, u, sel, wsel, limit):
        """NumpyOps.moe in ds4 numerics: each token's routed outputs added in slot order from
        slot 0 (ds4.c matvec_q2_k_accum_worker), plus the shared expert."""
        gate, up, down = self._w(lw.gate_exps), self._w(lw.up_exps), self._w(lw.down_exps)
        pairs = all(w.type_id in _K_DOT for w in (gate, up, down))
        ys = (self._routed_pairs if pairs else self._routed_loop)(gate, up, down, u, sel, wsel, limit)
        routed = mx.cumsum(ys, axis=1)[:, -1]
        sh = DF.swiglu(*self.linears([lw.sh_gate, lw.sh_up], u), limit)
        return routed + self.linear(lw.sh_down, sh)


@functools.lru_cache(maxsize=8)
def _hc_split_compiled(n: int, eps: float, iters: int):
    """ds4_float.hc_split for one (n, eps, iters); compiled, its ~300 small steps fuse (the same
    bits: tests/test_mlx_ds4_float.py compares them with the spec's)."""
    return mx.compile(lambda mix, sc, base: DF.hc_split(mix, n, sc, base, eps, iters))
