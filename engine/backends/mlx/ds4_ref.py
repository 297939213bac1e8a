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

import mlx.core as mx
import numpy as np

from ...gguf import quants as Q
from . import ds4_dot as DD
from . import numerics as MN
from . import quant

_F64, _F32 = mx.float64, mx.float32
_DENSE = frozenset({Q.F32, Q.F16, Q.BF16})
_K_DOT = frozenset({Q.IQ2_XXS, Q.Q2_K})


def _exact_act(w, x):
    """The reference's exact activation of a weight with no ds4 dot (N.q8_0_exact / q8_k_exact)."""
    q, d = (MN.q8_0_codes(x) if w.type_id in (Q.MXFP4, Q.Q8_0) else MN.q8_k_codes(x))
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
        for name in ("sigmoid", "softplus", "softmax", "attention", "hc_split", "hc_pre_mix",
                     "hc_post", "indexer_scores"):
            setattr(self, name, getattr(self, name + "_ref"))

    # -- matmuls -----------------------------------------------------------------------------
    def linear_ref(self, w, x, rows=None):
        """NumpyOps.linear: ds4's Q8_0 dot; other weights: a float64 matmul rounded once."""
        if w.type_id == Q.Q8_0:
            cut = (lambda a: a) if rows is None else (lambda a: a[rows])
            return DD.q8_0_matmul(cut(w.w), cut(w.scales), x)
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
    def sigmoid_ref(x):
        return mx.array(1.0, _F32) / (mx.array(1.0, _F32) + MN.expf(-MN._f32(x)))

    @staticmethod
    def softplus_ref(x):
        x = MN._f32(x)
        e = MN.expf(mx.minimum(x, 20.0))
        return mx.where(x > 20.0, x, mx.log1p(e.astype(_F64)).astype(_F32))

    @staticmethod
    def softmax_ref(x, axis=-1):
        x = MN._f32(x)
        m = mx.max(x, axis=axis, keepdims=True)
        m = mx.where(mx.isinf(m) | mx.isnan(m), 0.0, m)
        e = MN.expf(x - m)
        return e / mx.sum(e, axis=axis, keepdims=True)

    def swiglu_ref(self, g, v, limit):
        g = mx.minimum(g, limit)
        v = mx.clip(v, -limit, limit)
        return (g * self.sigmoid_ref(g)) * v

    # -- float64 steps -----------------------------------------------------------------------
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
        """NumpyOps.hc_split (float32 steps), with libm's expf."""
        mix, sc, base = MN._f32(mix), MN._f32(scale), MN._f32(base)
        eps = mx.array(np.float32(eps), _F32)
        T = mix.shape[0]
        pre = self.sigmoid_ref(mix[:, :n] * sc[0] + base[:n]) + eps
        post = mx.array(2.0, _F32) * self.sigmoid_ref(mix[:, n:2 * n] * sc[1] + base[n:2 * n])
        logits = (mix[:, 2 * n:] * sc[2] + base[2 * n:]).reshape(T, n, n)
        C = self.softmax_ref(logits, axis=-1) + eps
        C = C / (C.sum(axis=1, keepdims=True) + eps)
        for _ in range(iters - 1):
            C = C / (C.sum(axis=2, keepdims=True) + eps)
            C = C / (C.sum(axis=1, keepdims=True) + eps)
        return pre, post, C

    @staticmethod
    def hc_pre_mix_ref(pre, X):
        pre, X = MN._f32(pre), MN._f32(X)
        return (pre.astype(_F64)[:, None, :] @ X.astype(_F64))[:, 0, :].astype(_F32)

    @staticmethod
    def hc_post_ref(y, X, post, C):
        y, X, post, C = (MN._f32(a) for a in (y, X, post, C))
        mixed = mx.swapaxes(C.astype(_F64), 1, 2) @ X.astype(_F64)
        return ((post[:, :, None] * y[:, None, :]).astype(_F64) + mixed).astype(_F32)

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
        if w.type_id in _K_DOT:
            return ("k",) + MN.q8_k_codes(x)
        if w.type_id == Q.Q8_0:
            return ("q8", x)
        return ("f64", _exact_act(w, x))

    def _expert_linear_ref(self, w, e, a, rows):
        kind = a[0]
        if kind == "k":
            return DD.q8_k_matmul(w.type_id, w.w[e], a[1][rows], a[2][rows], True)
        if kind == "q8":
            return DD.q8_0_matmul(w.w[e], w.scales[e], a[1][rows])
        return _f64_matmul(w, a[1][rows].astype(_F64), expert=e)

    def moe_ref(self, lw, u, sel, wsel, limit):
        """NumpyOps.moe: routed experts one at a time in ascending order (each token's outputs
        added in that order), then the shared expert."""
        gate, up, down = self._w(lw.gate_exps), self._w(lw.up_exps), self._w(lw.down_exps)
        lim = mx.array(limit, _F32)
        out = mx.zeros(u.shape, _F32)
        ua = self._expert_act_ref(gate, u)
        for e, rows, slot in DD.unique_experts(np.array(sel)):
            ri = mx.array(rows.astype(np.int32))
            m = self.swiglu_ref(self._expert_linear_ref(gate, e, ua, ri),
                                self._expert_linear_ref(up, e, ua, ri), lim)
            mid = m * wsel[ri, mx.array(slot.astype(np.int32))][:, None]
            d = self._expert_linear_ref(down, e, self._expert_act_ref(down, mid), slice(None))
            out = out.at[ri].add(d)
        sh = self.swiglu_ref(*self.linears([lw.sh_gate, lw.sh_up], u), lim)
        return out + self.linear(lw.sh_down, sh)
