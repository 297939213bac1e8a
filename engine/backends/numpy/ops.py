"""The NumPy reference backend: every op the forward pass needs, in float32.

The forward pass (model.py) is written once against this small set of ops; other backends (MLX,
CuPy) implement the same methods and are tested against this one. Two numerics modes:

* "exact": plain float32, the function transformers computes (dequantized weights, float
  activations, float32 KV rows, transformers' RoPE angles).
* "ds4": the numerics of ds4's CPU reference path — Q8_0 rounding of the input of every Q8_0-weight
  matmul, Q8_K rounding of the routed experts' input and weighted SwiGLU output, FP8 E4M3 round
  trip of the non-RoPE KV dims, F16 rounding of every cached row, Hadamard + FP4 round trip of the
  indexer's queries and keys, RoPE angles built by repeated float32 products, ds4's RMSNorm.

Weights are QTensors: bytes in the map, decoded a chunk of rows at a time, never whole. Matmuls
accumulate in float64 and round once, so a token's result does not depend on how many tokens share
the batch: chunked prefill and decode agree to the last bit far more often than float32 sums would,
which matters in ds4 mode, where a one-ulp change can move an activation across a Q8 rounding step.
In ds4 mode the Q8_0, IQ2_XXS and Q2_K matmuls are ds4's own: integer dots of the activation
codes per block, times the scales, summed over the blocks in float32 in ds4's order
(model/ds4_matmul.py; docs/numerics.md has every rule with its ds4 function). That order does not
depend on the batch either: each output is summed over its own blocks.
"""
from __future__ import annotations

import time

import numpy as np

from ...gguf import quants as Q
from ...gguf.model_file import QTensor
from ...model import ds4_float as F
from ...model import ds4_matmul as D
from ...model import numerics as N
from ...model.kv_state import KVState
from ...model.weights import bind
from ...model.numerics import DS4, NUMERICS
from ..protocol import BindReport

# Routed-expert activations: ggml's K-quant and IQ dot products take Q8_K (256-value) activations;
# MXFP4's takes Q8_0 (32-value) ones.
_EXPERT_ACT_Q8_0 = frozenset({Q.MXFP4, Q.Q8_0})
# weights with ds4's integer dot product (ds4.c: dot_q8_0_row, ds4_vec_dot_{iq2_xxs,q2_K}_q8_K)
_DS4_DOT = frozenset({Q.Q8_0, Q.IQ2_XXS, Q.Q2_K, Q.Q4_K})   # Q4_K: the q4 oracles's own dot (ds4_matmul)


def _f32(x):
    return np.asarray(x, dtype=np.float32)


class NumpyOps:
    name = "numpy"
    xp = np            # the array namespace of the model's glue

    def __init__(self, numerics: str = DS4, q8_dot: str = "ds4"):
        """q8_dot (ds4 numerics only): "ds4" sums a Q8 matmul's blocks in float32 in ds4's order
        (ds4.c, model/ds4_matmul.py); "exact" rounds the exact sum of the code * scale products
        once, the function the cpu backend's integer kernels compute (docs/numerics.md)."""
        if numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {NUMERICS}, got {numerics!r}")
        if q8_dot not in ("ds4", "exact"):
            raise ValueError(f"q8_dot must be 'ds4' or 'exact', got {q8_dot!r}")
        self.numerics = numerics
        self._ds4 = numerics == DS4     # (a shorthand inside the ops; `numerics` is the one public name)
        self._dot = self._ds4 and q8_dot == "ds4"
        if self._ds4:   # instance attributes: the class's static forms stay exact numerics'
            self.rmsnorm = self.rmsnorm_ds4
            # ds4's float32 loops as its compiled code runs them (model/ds4_float.py)
            self.sigmoid, self.silu, self.softplus = F.sigmoid_stable, F.silu, F.softplus
            self.hc_pre_mix, self.hc_post = F.hc_weighted_sum, F.hc_post
            self.attention = self.attention_ds4
            self.hc_head = F.hc_head     # the output head's HC collapse (model.Model._head)
            self.rope, self.rope_thetas = self.rope_ds4, self.rope_thetas_ds4
            self.expert_weights = F.expert_weights    # the routed weights' normalization (Model._ffn)

    # -- set-up and hand-offs (host memory: nothing to upload or copy) ---------------------------
    def bind_weights(self, model_file) -> tuple:
        """The weights as views of the file's map (decoded a chunk of rows at a time when used)."""
        t0 = time.perf_counter()
        weights = bind(model_file)
        return weights, BindReport(time.perf_counter() - t0, 0)

    def new_state(self, config, ctx: int, rewind_cap: int) -> KVState:
        return KVState(config, ctx, rewind_cap)

    @staticmethod
    def state_to_host(state: KVState) -> KVState:
        return state             # host memory already: a snapshot reads it in place

    @staticmethod
    def state_from_host(host: KVState) -> KVState:
        return host

    @staticmethod
    def embed(embd: QTensor, tokens: np.ndarray) -> np.ndarray:
        """The rows of `tokens`, decoded from the map (only those rows)."""
        return Q.dequantize(embd.type_id, embd.data[tokens])

    @staticmethod
    def logits_to_host(logits) -> np.ndarray:
        return np.asarray(logits, dtype=np.float32)

    # -- matmuls -------------------------------------------------------------------------------
    def linear(self, w: QTensor, x: np.ndarray, rows: slice | None = None) -> np.ndarray:
        """x [T, in] -> [T, out] with W's rows (output units) `rows`. In ds4 numerics a Q8_0
        weight meets ds4's Q8_0 activation codes: integer dots per 32-block, times the two
        scales, summed over the blocks in float32 in block order (ds4.c dot_q8_0_row;
        model/ds4_matmul.py). Other weights: float64 sums rounded once."""
        if self._dot and w.type_id == Q.Q8_0:
            return D.q8_0_matmul(w.data, D.q8_0_act(x), rows)
        if self._ds4 and w.type_id == Q.F16:      # ds4.c matvec_f16: float32 sums in index order
            w16 = np.asarray(w.data).view(np.float16)
            return F.f16_matvec(w16 if rows is None else w16[rows], x)
        x = N.q8_0_exact(x) if self._ds4 and w.type_id == Q.Q8_0 else _f32(x)
        return Q.matvec(w.type_id, w.data, x.T, rows, accumulate=np.float64).T

    def linears(self, ws: list, x: np.ndarray) -> list:
        """[linear(w, x) for w in ws]: several weights applied to the same input."""
        return [self.linear(w, x) for w in ws]

    def grouped_linear(self, w: QTensor, x: np.ndarray, groups: int) -> np.ndarray:
        """The grouped attention output projection: x [T, groups * gi] and W's rows split in
        `groups` equal blocks; block g multiplies x's g-th slice of gi columns; results side by side."""
        gi, gr = x.shape[1] // groups, w.data.shape[0] // groups
        return np.concatenate([self.linear(w, x[:, g * gi:(g + 1) * gi], rows=slice(g * gr, (g + 1) * gr))
                               for g in range(groups)], axis=1)

    def expert_act(self, w: QTensor, x: np.ndarray):
        """Activation rounding of a routed-expert matmul input (identity in exact mode). ds4
        numerics: IQ2_XXS / Q2_K / Q8_0 weights get ds4's activation codes (a ds4_matmul.Q8Act,
        Q8_K or Q8_0 blocks), for ds4's integer dot products in expert_linear. Q4_K and MXFP4
        have none in ds4's CPU path (it refuses them): their input is the exact code * scale
        (float64), and expert_linear's float64 matmul rounds the exact sum once (as every Q8
        weight's with q8_dot="exact")."""
        if not self._ds4 or w.type_id in (Q.F32, Q.F16, Q.BF16):
            return x
        if self._dot and w.type_id in _DS4_DOT:
            return D.q8_0_act(x) if w.type_id == Q.Q8_0 else D.q8_k_act(x)
        return N.q8_0_exact(x) if w.type_id in _EXPERT_ACT_Q8_0 else N.q8_k_exact(x)

    def expert_linear(self, w: QTensor, x_rounded) -> np.ndarray:
        """x [T, in] (from expert_act: a Q8Act, or float64 exact values, or float) -> [T, out]
        for one expert's matrix."""
        if isinstance(x_rounded, D.Q8Act):
            if w.type_id == Q.Q8_0:
                return D.q8_0_matmul(w.data, x_rounded)
            return D.q8_k_matmul(w.type_id, w.data, x_rounded)
        x = x_rounded if x_rounded.dtype == np.float64 else _f32(x_rounded)
        return Q.matvec(w.type_id, w.data, x.T, accumulate=np.float64).T

    # -- norms and elementwise -----------------------------------------------------------------
    @staticmethod
    def rmsnorm_ds4(x, w, eps):
        """ds4 numerics' rmsnorm (ds4.c rms_norm_weight: float32 scale, (x * w) * scale)."""
        return N.rmsnorm_ds4(x, w, eps)

    @staticmethod
    def rmsnorm(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
        # mean of squares accumulated in float64 (as ds4 does); the result is float32
        ms = np.mean(np.square(x, dtype=np.float64), axis=-1, keepdims=True)
        y = (x * (1.0 / np.sqrt(ms + eps)).astype(np.float32)).astype(np.float32)
        return y if w is None else (y * w).astype(np.float32)

    @staticmethod
    def sigmoid(x):
        return (1.0 / (1.0 + np.exp(-x))).astype(np.float32)

    @staticmethod
    def softplus(x):
        # torch's threshold form: x above 20 is returned as is
        return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0)))).astype(np.float32)

    @staticmethod
    def softmax(x, axis=-1):
        m = np.max(x, axis=axis, keepdims=True)
        m = np.where(np.isfinite(m), m, 0.0)
        e = np.exp(x - m)
        return (e / np.sum(e, axis=axis, keepdims=True)).astype(np.float32)

    def silu(self, x):
        return (x * self.sigmoid(x)).astype(np.float32)

    # -- KV-row numerics -----------------------------------------------------------------------
    def store_kv(self, rows: np.ndarray, n_nope: int) -> np.ndarray:
        """An attention KV row (raw or compressed) as it is cached: FP8 on the non-RoPE dims, then F16."""
        if not self._ds4:
            return rows
        return N.f16_round(N.fp8_e4m3_roundtrip(rows, n_nope))

    def index_qat(self, rows: np.ndarray) -> np.ndarray:
        """Indexer queries and keys: 128-point Hadamard + FP4 round trip (ds4 / the official graph)."""
        return N.indexer_qat(rows) if self._ds4 else rows

    def store_index(self, rows: np.ndarray) -> np.ndarray:
        return N.f16_round(N.indexer_qat(rows)) if self._ds4 else rows

    # -- RoPE ----------------------------------------------------------------------------------
    def rope_thetas(self, pos: np.ndarray, n_rot: int, base: float, yarn: dict | None,
                    query: bool = False) -> np.ndarray:
        """The angles [T, n_rot / 2] at positions pos; `query`: those of a query's rotation (the
        caller knows which rotation is the query's: Model._attention), the same in exact numerics."""
        f = N.rope_thetas_ds4 if self._ds4 else N.rope_thetas_exact
        return f(np.asarray(pos), n_rot, base, yarn=yarn)

    @staticmethod
    def rope(x, thetas, inverse=False, inplace=False):
        """inplace: the caller drops x, so a backend may rotate it in place (the reference copies)."""
        return N.apply_rope(x, thetas, inverse=inverse)

    @staticmethod
    def rope_thetas_ds4(pos, n_rot, base, yarn, query: bool = False):
        """ds4 numerics' angles (numerics.rope_thetas_ds4); with YaRN a query's rotation (`query`)
        takes its own blend (ds4's q RoPE call site compiles it with an FMA where the KV row's
        factors it: each copy of rope_tail_ext_inplace as GCC built it)."""
        return N.rope_thetas_ds4(np.asarray(pos), n_rot, base, yarn=yarn, fma_blend=query and yarn is not None)

    @staticmethod
    def rope_ds4(x, thetas, inverse=False, inplace=False):
        """ds4 numerics' RoPE: the C library's cosf / sinf of each angle (numerics.apply_rope)."""
        return N.apply_rope(x, thetas, inverse=inverse, libm=True)

    # -- attention -----------------------------------------------------------------------------
    @staticmethod
    def attention(q, segments, sinks, scale):
        """Softmax attention with per-head sinks, K = V, over concatenated key segments.

        q [T, H, D]; segments: (keys, mask) pairs, keys [K, D] shared by all queries or [T, K, D]
        per query, mask [T, K] bool (True = attend); or (keys, mask, idx) triples, idx [T, K]
        int: query t's key k is keys[idx[t, k]] (keys [N, D]; a backend may read the rows in
        place, this definition gathers them). The sink logit enters the denominator only.
        Returns [T, H, D].
        """
        segments = [(s[0][s[2]], s[1]) if len(s) > 2 else s for s in segments]
        # float64 inside: a query's result must not depend on how many queries share the call
        q = q.astype(np.float64)
        segments = [(keys.astype(np.float64), mask) for keys, mask in segments]
        scores = []
        for keys, mask in segments:
            eq = "thd,kd->thk" if keys.ndim == 2 else "thd,tkd->thk"
            s = np.einsum(eq, q, keys, optimize=True) * scale
            scores.append(np.where(mask[:, None, :], s, -np.inf))
        s = np.concatenate(scores, axis=-1)
        sinks = sinks.astype(np.float64)
        m = np.maximum(np.max(s, axis=-1), sinks[None, :])                       # [T, H]
        p = np.exp(s - m[..., None])
        den = np.sum(p, axis=-1) + np.exp(sinks[None, :] - m)
        o, k0 = 0.0, 0
        for keys, _ in segments:
            k1 = k0 + keys.shape[-2]
            eq = "thk,kd->thd" if keys.ndim == 2 else "thk,tkd->thd"
            o = o + np.einsum(eq, p[..., k0:k1], keys, optimize=True)
            k0 = k1
        return (o / den[..., None]).astype(np.float32)

    def attention_ds4(self, q, segments, sinks, scale):
        """ds4 numerics' attention (model/ds4_float.attention: ds4's float32 loops as compiled,
        read at head dim 128); other widths keep the class's own form."""
        if q.shape[-1] != 128:
            return type(self).attention(q, segments, sinks, scale)
        segments = [(s[0][s[2]], s[1]) if len(s) > 2 else s for s in segments]
        # ds4's kq_scale is 1.0f / sqrtf(128): the float32 rounding of the model's 1 / sqrt(128)
        return F.attention(q, segments, sinks, np.float32(scale))

    # -- hyper-connections (§3.2, §3.3) ----------------------------------------------------------
    def hc_split(self, mix, n: int, scale, base, eps, iters: int):
        """The HC mixing weights from mix [T, 2n + n*n]: pre [T, n], post [T, n] and the
        Sinkhorn-normalised combination C [T, n, n] (columns first, then `iters - 1` row/column rounds)."""
        if self._ds4:          # ds4.c hc_split_sinkhorn_one as compiled (model/ds4_float.py)
            return F.hc_split(mix, n, scale, base, eps, iters)
        T, sc = mix.shape[0], scale
        pre = self.sigmoid(mix[:, :n] * sc[0] + base[:n]) + eps
        post = 2.0 * self.sigmoid(mix[:, n:2 * n] * sc[1] + base[n:2 * n])
        logits = (mix[:, 2 * n:] * sc[2] + base[2 * n:]).reshape(T, n, n)
        C = self.softmax(logits, axis=-1) + eps
        C = C / (C.sum(axis=1, keepdims=True) + eps)           # columns first
        for _ in range(iters - 1):
            C = C / (C.sum(axis=2, keepdims=True) + eps)       # rows
            C = C / (C.sum(axis=1, keepdims=True) + eps)       # columns
        return pre, post, C

    @staticmethod
    def hc_pre_mix(pre, X):
        """sum_i pre[t, i] * X[t, i, :]: pre [T, n], X [T, n, E] -> [T, E] (float64 inside)."""
        return np.einsum("ti,tid->td", pre.astype(np.float64), X).astype(np.float32)

    @staticmethod
    def hc_post(y, X, post, C):
        """X_new[t, k] = post[t, k] * y[t] + sum_j C[t, j, k] * X[t, j]   (C used transposed);
        y [T, E], X [T, n, E], post [T, n], C [T, n, n] -> [T, n, E]."""
        mixed = np.einsum("tjk,tjd->tkd", C.astype(np.float64), X)
        return (post[:, :, None] * y[:, None, :] + mixed).astype(np.float32)

    @staticmethod
    def indexer_scores(qi, keys, wts):
        """The indexer's score of every compressed row for every query: qi [T, H, D] (queries per
        indexer head), keys [C, D], wts [T, H] -> [T, C] = sum_h wts[t, h] * relu(qi[t, h] . keys[c]),
        in float64. Queries go in blocks so the [t, h, c] products stay under ~16M values (a
        2048-token chunk at 32K context would otherwise need [2048, 64, 8192] of them)."""
        T, H, _ = qi.shape
        out = np.empty((T, keys.shape[0]), dtype=np.float64)
        step = max(1, (1 << 24) // max(1, H * keys.shape[0]))
        k64 = keys.astype(np.float64)
        for t0 in range(0, T, step):
            t1 = min(T, t0 + step)
            s = np.einsum("thd,cd->thc", qi[t0:t1].astype(np.float64), k64, optimize=True)
            out[t0:t1] = np.einsum("th,thc->tc", wts[t0:t1].astype(np.float64), np.maximum(s, 0.0), optimize=True)
        return out

    @staticmethod
    def topk_lowest_index(scores: np.ndarray, k: int) -> np.ndarray:
        """Indices of the k largest scores per row, ties to the lowest index (ds4's repeated argmax)."""
        order = np.argsort(-scores, axis=-1, kind="stable")
        return order[..., :k]

    # -- routed experts (§3.11) ----------------------------------------------------------------
    def swiglu(self, g, v, limit):
        if self._ds4:      # ds4.c swiglu as compiled (model/ds4_float.py)
            return F.swiglu(g, v, limit)
        g = np.minimum(g, limit)
        v = np.clip(v, -limit, limit)
        return self.silu(g) * v

    def moe(self, lw, u, sel, wsel, limit):
        """The FFN's experts on u [T, E]: the routed experts (sel, wsel) plus the shared one."""
        return self.routed(lw, u, sel, wsel, limit) + self.shared_expert(lw, u, limit)

    def shared_expert(self, lw, u, limit):
        m = self.swiglu(*self.linears([lw.sh_gate, lw.sh_up], u), limit)
        return self.linear(lw.sh_down, m)

    def routed(self, lw, u, sel, wsel, limit):
        """sum over each token's selected experts of weight * down(swiglu(gate u, up u)).
        u [T, E]; sel, wsel [T, k] (expert ids, weights); lw: the layer's weights. One expert at
        a time, over the tokens that picked it. ds4 numerics add the experts' outputs in slot
        order from 0 (ds4.c matvec_q2_k_accum_worker: ``acc += v`` per selected expert)."""
        ua = self.expert_act(lw.gate_exps, u)          # ds4: one Q8_K rounding shared by all experts
        if self._ds4:
            ys = np.zeros((u.shape[0], sel.shape[1], u.shape[1]), dtype=np.float32)
            for e in np.unique(sel):
                rows, slot = np.nonzero(sel == e)
                ys[rows, slot] = self.expert_out(lw, e, ua[rows], wsel[rows, slot][:, None], limit)
            return np.add.accumulate(ys, axis=1, dtype=np.float32)[:, -1]
        out = np.zeros_like(u)
        for e in np.unique(sel):
            rows, slot = np.nonzero(sel == e)
            out[rows] += self.expert_out(lw, e, ua[rows], wsel[rows, slot][:, None], limit)
        return out                                      # (a token picks an expert at most once)

    def expert_out(self, lw, e, xe, we, limit):
        """Expert e's weighted output for its tokens: xe [n, E] (after expert_act), we [n, 1]."""
        g = self.expert_linear(lw.gate_exps.expert(e), xe)
        v = self.expert_linear(lw.up_exps.expert(e), xe)
        if self._ds4:   # ds4 weights the SwiGLU output before the down projection (and rounds it)
            m = F.routed_mid(g, v, we, limit)
            return self.expert_linear(lw.down_exps.expert(e), self.expert_act(lw.down_exps, m))
        m = self.swiglu(g, v, limit)
        return self.expert_linear(lw.down_exps.expert(e), m) * we     # transformers: the output
