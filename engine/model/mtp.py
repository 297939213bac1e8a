"""DeepSeek V4 Flash's MTP block as a drafter (spec/model.md §7), on any backend's ops.

One draft step at position p takes an HC state H [n_hc, E] (the main model's final HC rows of the
token at p, or the MTP's own output for a chained draft) and the embedding of the token that
follows it, and proposes the token after that:

    e      = e_proj @ rmsnorm(embed(token), enorm)
    Hin[s] = e + h_proj @ rmsnorm(H[s], hnorm)                 for each HC stream s
    Hout   = the V4 block (ratio 0: raw sliding-window attention on the MTP's OWN raw rows)
    logits = output @ rmsnorm(hc_head(Hout), norm)               (the main model's output matrix)

The block is evaluated as ds4 does, as layer 1 (its SwiGLU clamp), always with biased top-k
routing (no hash table), RoPE at the main model's base. The MTP keeps only raw rows, as ds4 and
llama.cpp do; rows written for drafts the main model then rejected are dropped by `keep_upto`
(ds4's DS4_MTP_KEEP_ACCEPTED): a counter, the ring's slots are simply written again.

Every array operation goes through the backend's ops (the same protocol the main model uses), so
each backend that runs the model runs the drafter too.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..gguf.mtp_file import MTP_LAYER, MTPFile
from ..gguf.model_file import QTensor
from .kv_state import PosRing
from .weights import HCWeights, LayerWeights, _vec

SLACK = 64   # ring rows past the window: a rejected draft chain (<= 16) never overwrites kept rows


@dataclass
class MTPWeights:
    e_proj: QTensor
    h_proj: QTensor
    enorm: object
    hnorm: object
    norm: object
    hc_head_fn: QTensor
    hc_head_scale: object
    hc_head_base: object
    block: LayerWeights


def bind_mtp(f: MTPFile, xp=np) -> MTPWeights:
    """The MTP file's weights: matrices as views of its map (each backend's ops take a host
    QTensor and keep their own copy, as they do for the main model's), vectors as xp arrays."""
    c, t = f.config, f.tensor

    def v(name):
        return xp.asarray(_vec(t(name)))

    def hc(sub):
        return HCWeights(t(f"hc_{sub}_fn.weight"), _vec(t(f"hc_{sub}_scale.weight")), v(f"hc_{sub}_base.weight"))

    block = LayerWeights(
        il=min(MTP_LAYER, c.n_layer - 1), ratio=0, hc_attn=hc("attn"), hc_ffn=hc("ffn"),
        attn_norm=v("attn_norm.weight"), q_a=t("attn_q_a.weight"), q_a_norm=v("attn_q_a_norm.weight"),
        q_b=t("attn_q_b.weight"), kv=t("attn_kv.weight"), kv_norm=v("attn_kv_a_norm.weight"),
        sinks=v("attn_sinks.weight"), out_a=t("attn_output_a.weight"), out_b=t("attn_output_b.weight"),
        comp=None, indexer=None, ffn_norm=v("ffn_norm.weight"), gate_inp=t("ffn_gate_inp.weight"),
        bias=v("exp_probs_b.bias"), tid2eid=None, gate_exps=t("ffn_gate_exps.weight"),
        up_exps=t("ffn_up_exps.weight"), down_exps=t("ffn_down_exps.weight"),
        sh_gate=t("ffn_gate_shexp.weight"), sh_up=t("ffn_up_shexp.weight"), sh_down=t("ffn_down_shexp.weight"))
    return MTPWeights(t("e_proj.weight"), t("h_proj.weight"), v("enorm.weight"), v("hnorm.weight"),
                      v("norm.weight"), t("hc_head_fn.weight"), _vec(t("hc_head_scale.weight")),
                      v("hc_head_base.weight"), block)


class MTPState:
    """The MTP block's raw rows: a ring by position, and how many rows up to `hi` are valid
    (contiguous, written by draft steps whose tokens the main model kept)."""

    def __init__(self, c, xp=np):
        self.window = c.n_swa
        self.raw = PosRing(c.n_swa + SLACK, c.head_dim, mirror=c.n_swa, xp=xp)
        self.hi = 0          # the position after the newest valid row
        self.n_valid = 0     # valid rows ending at hi (at most the window)

    def start(self, p: int) -> int:
        """Before a row is written at p: the valid rows it may attend to, and the count then."""
        if p > self.hi:
            self.n_valid = 0                       # a gap: positions no draft step has seen
        elif p < self.hi:
            self.n_valid = max(0, self.n_valid - (self.hi - p))
        self.hi = p + 1
        self.n_valid = min(self.n_valid + 1, self.window)
        return self.n_valid

    def keep_upto(self, end: int):
        """Rows at positions >= end are not the timeline's: forget them."""
        if self.hi > end:
            self.n_valid = max(0, self.n_valid - (self.hi - end))
            self.hi = end

    def reset(self):
        self.hi = self.n_valid = 0


class MTPBlock:
    """The MTP block bound to a main Model (its embedding, output matrix, ops and config)."""

    def __init__(self, model, weights: MTPWeights):
        self.model, self.w, self.ops, self.c = model, weights, model.ops, model.c

    def new_state(self) -> MTPState:
        return MTPState(self.c, self.model.xp)

    def step(self, state: MTPState, H, token: int, pos: int):
        """One draft step: (logits [vocab] as the backend's array, Hout [1, n_hc, E])."""
        c, ops, w, m = self.c, self.ops, self.w, self.model
        xp = m.xp
        tok = np.asarray([int(token)], dtype=np.int64)
        e = xp.asarray(ops.embed(m.w.embd, tok), dtype=xp.float32)                    # [1, E]
        e = ops.linear(w.e_proj, ops.rmsnorm(e, w.enorm, c.rms_eps))
        hp = ops.linear(w.h_proj, ops.rmsnorm(xp.asarray(H).reshape(c.n_hc, c.n_embd), w.hnorm, c.rms_eps))
        X = (e + hp)[None, :, :].astype(xp.float32)                                    # [1, n_hc, E]
        X = self._attention(state, X, pos)
        X = self._ffn(X)
        return self._head(X)[0], X

    def _attention(self, state: MTPState, X, pos: int):
        c, ops, lw, m = self.c, self.ops, self.w.block, self.model
        x, post, C = m._hc_pre(lw.hc_attn, X)
        h = ops.rmsnorm(x, lw.attn_norm, c.rms_eps)
        qa, kv = ops.linears([lw.q_a, lw.kv], h)
        qr = ops.rmsnorm(qa, lw.q_a_norm, c.rms_eps)
        q = ops.rmsnorm(ops.linear(lw.q_b, qr).reshape(1, c.n_head, c.head_dim), None, c.rms_eps)
        kv = ops.rmsnorm(kv, lw.kv_norm, c.rms_eps)
        th = ops.rope_thetas(np.asarray([pos]), c.n_rot, c.rope_base, None)           # ratio 0: plain RoPE
        th_h = th[:, None, :]
        q = ops.rope(q, th_h, inplace=True)
        kv = ops.store_kv(ops.rope(kv, th), c.n_nope)
        n = state.start(pos)
        state.raw.write(pos, kv)
        keys = state.raw.window(pos + 1 - n, pos + 1)
        o = ops.attention(q, [(keys, np.ones((1, n), dtype=bool))], lw.sinks, 1.0 / np.sqrt(c.head_dim))
        o = ops.rope(o, th_h, inverse=True, inplace=True).reshape(1, c.n_head * c.head_dim)
        y = ops.linear(lw.out_b, ops.grouped_linear(lw.out_a, o, c.o_groups))
        return m._hc_post(y, X, post, C)

    def _ffn(self, X):
        """The block's FFN (Model._ffn for a layer with biased top-k routing), on the backend's
        moe op directly: the main model's expert cache holds the main layers' experts only."""
        c, ops, lw, m = self.c, self.ops, self.w.block, self.model
        xp = m.xp
        x, post, C = m._hc_pre(lw.hc_ffn, X)
        u = ops.rmsnorm(x, lw.ffn_norm, c.rms_eps)
        p = xp.sqrt(ops.softplus(ops.linear(lw.gate_inp, u)))
        sel = ops.topk_lowest_index(p + lw.bias, c.n_expert_used)
        wsel = xp.take_along_axis(p, sel, axis=1)
        tot = wsel.sum(axis=1, keepdims=True)
        f32 = xp.float32
        tot = xp.maximum(tot, xp.asarray(2.0 ** -14, dtype=f32)) if ops.numerics == "ds4" else tot + xp.asarray(1e-20, dtype=f32)
        wsel = (wsel / tot * xp.asarray(c.expert_weights_scale, dtype=f32)).astype(f32)
        y = ops.moe(lw, u, sel, wsel, np.float32(c.swiglu_clamp[lw.il]))
        return m._hc_post(y, X, post, C)

    def _head(self, X):
        c, ops, w, m = self.c, self.ops, self.w, self.model
        xp = m.xp
        flat = ops.rmsnorm(X.reshape(1, c.n_hc * c.n_embd), None, c.rms_eps)
        mix = ops.linear(w.hc_head_fn, flat)
        pre = ops.sigmoid(mix * w.hc_head_scale[0] + w.hc_head_base) + xp.asarray(c.hc_eps, dtype=xp.float32)
        x = ops.rmsnorm(ops.hc_pre_mix(pre, X), w.norm, c.rms_eps)
        return ops.linear(m.w.output, x)
