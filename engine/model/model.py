"""The DeepSeek V4 Flash forward pass, written once in model order (spec/model.md §3).

`Model.forward(tokens, pos0, state)` runs a chunk of T tokens at positions pos0..pos0+T-1 through
all layers, layer-major (as ds4's prefill does): per layer the token-independent work (HC, norms,
projections, FFN) is batched over the chunk, and the cache-dependent work (KV rows, compressor
windows, indexer selection, attention) is done in the equivalent parallel form with causal masks.
A chunk of one token is a decode step; any chunking gives the same function up to float32
summation order, which the tests check.

Where arrays live: activations, weights and the KV state are the backend's (`ops.xp` arrays:
NumPy on the host backends, mx arrays on MLX). What follows from positions alone -- token ids,
positions, masks, window rows -- is computed here on the host with NumPy (it is known before any
kernel runs, and small) and handed over with `xp.asarray`, a no-op on the host backends.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..gguf.config import CSA_RATIO, ModelConfig
from ..gguf.model_file import QTensor
from ..gguf.prefetch import EXPERT_HINT_TOKENS
from .kv_state import KVState, LayerState, frontier_start
from ..backends.protocol import Ops
from .weights import CompressorWeights, HCWeights, LayerWeights, ModelWeights, dense_arrays

QUERY_BLOCK = 256  # queries per attention block: bounds the [T, H, keys] score tensor


class Segment(NamedTuple):
    """Rows r0..r1-1 of a pass's stacked rows: one timeline's tokens at positions pos0.., on `state`."""
    r0: int
    r1: int
    pos0: int
    state: KVState


class Model:
    def __init__(self, config: ModelConfig, weights: ModelWeights, ops: Ops):
        self.c, self.w, self.ops = config, weights, ops
        self.xp = ops.xp      # the backend's array namespace: the glue below is written against it
        c = config
        self.yarn = dict(factor=c.rope_scale_factor, orig_ctx=c.rope_orig_ctx,
                         beta_fast=c.yarn_beta_fast, beta_slow=c.yarn_beta_slow)
        # paging hints (lowmem: Engine sets pager to prefetch.StepHints): each layer's dense
        # matrices are asked for one layer ahead, the output head during the last layer, a
        # layer's selected experts as soon as routing has picked them (a hash layer's at the
        # step's start: its routing is the token ids')
        self.pager = None
        # MTP (engine/runtime/speculative.py): keep_hc > 0 keeps a pass's last keep_hc final HC
        # rows in last_hc, for the draft that starts from them; last_hc_at says whose they are:
        # (id(state), position after the last row), None after a pass of several timelines
        self.keep_hc = 0
        self.last_hc = self.last_hc_at = None
        # the routed experts' bounded cache (engine/gguf/expert_cache.py; --expert-cache): it
        # holds a layer's experts in its slots for ops.moe and reads hash layers' ahead
        self.experts = None
        self._theta_cache: dict = {}
        head = [t.data for t in (weights.hc_head_fn, weights.output) if isinstance(t, QTensor)]   # (map views)
        self._dense = [dense_arrays(lw) for lw in weights.layers] + [head]

    # ------------------------------------------------------------------------------------------
    def forward(self, tokens: np.ndarray, pos0: int, state: KVState, all_logits: bool = False) -> np.ndarray:
        """Logits [T, vocab] (all_logits) or [vocab] for the last token."""
        tokens = np.asarray(tokens, dtype=np.int64)             # host: the hash layers index a host table
        return self._run(tokens, [Segment(0, len(tokens), int(pos0), state)], all_logits)

    def forward_batch(self, tokens, positions, states) -> "np.ndarray":
        """One decode step of B sessions at once: token b at position positions[b] on states[b]
        (each its own timeline). Returns the logits [B, vocab], row b what
        forward([tokens[b]], positions[b], states[b]) gives, to rounding (bit for bit where a
        backend's kernels sum each row alike whatever the rows: numpy, mlx, and cpu with
        kernels.set_batch_invariant). Each weight is read once for the B rows; the KV rows,
        compressor frontier, indexer and attention are each session's own."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        positions = [int(p) for p in positions]
        states = list(states)
        if not (len(tokens) == len(positions) == len(states)) or not len(tokens):
            raise ValueError(f"forward_batch needs one position and one state per token "
                             f"(got {len(tokens)} tokens, {len(positions)} positions, {len(states)} states)")
        if len({id(s) for s in states}) != len(states):
            raise ValueError("forward_batch got one state twice: a timeline advances one token a step")
        return self._run(tokens, [Segment(b, b + 1, p, s) for b, (p, s) in enumerate(zip(positions, states))], True)

    def forward_verify(self, tokens, pos0: int, state: KVState):
        """Logits [T, vocab] of T tokens at positions pos0.. on one timeline, every row computed as
        a decode step of it computes it (one segment a row, in order, on the same state: each
        row's KV work follows the row before it), while each weight is read once for all rows:
        the MTP verify step, whose accepted rows must equal plain decoding's bit for bit."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        segs = [Segment(t, t + 1, int(pos0) + t, state) for t in range(len(tokens))]
        return self._run(tokens, segs, True)

    def _run(self, tokens: np.ndarray, segs: list, all_logits: bool):
        """The layers over the rows of every segment stacked ([N, ...], N = len(tokens)): the
        token-independent work once over all rows, each segment's cache-dependent work on its own
        state. One segment: logits [T, vocab] (all_logits) or [vocab]; several: [N, vocab]."""
        c = self.c
        xp = self.xp
        self._theta_cache = {}
        pos = np.concatenate([np.arange(g.pos0, g.pos0 + g.r1 - g.r0) for g in segs]) if len(segs) > 1 \
            else np.arange(segs[0].pos0, segs[0].pos0 + len(tokens))             # host: every row's position
        e = self.ops.embed(self.w.embd, tokens)                                    # [N, E]
        # [N, n_hc, E]: one copy (asarray is no copy where e is float32 already; repeat, then
        # astype, copied the [N, n_hc, E] array twice)
        X = xp.repeat(xp.asarray(e, dtype=xp.float32)[:, None, :], c.n_hc, axis=1)
        if self.pager:
            self._hint_step(tokens)
        if self.experts is not None:
            self.experts.begin_step(self.w.layers, tokens)
        for i, lw in enumerate(self.w.layers):
            if self.pager:
                self.pager(self._dense[i + 1])
            X = self._attention(lw, i, X, segs, pos)
            X = self._ffn_block(lw, X, tokens)
        if self.keep_hc:
            last = X[-self.keep_hc:]
            self.last_hc = last.copy() if hasattr(last, "copy") else last * 1
            one = len({id(g.state) for g in segs}) == 1
            self.last_hc_at = (id(segs[-1].state), segs[-1].pos0 + segs[-1].r1 - segs[-1].r0) if one else None
        if len(segs) > 1:
            return self._head(X)
        if not all_logits:
            X = X[-1:]
        logits = self._head(X)
        return logits if all_logits else logits[0]

    def _hint_step(self, tokens: np.ndarray) -> None:
        """The paging hints known before a step computes anything: layer 0's dense matrices, then
        every hash layer's routed experts (the table lookup needs only the token ids), so their
        reads overlap the layers before them."""
        begin = getattr(self.pager, "begin_step", None)
        if begin is not None:
            begin(len(tokens))
        self.pager(self._dense[0])
        if len(tokens) <= EXPERT_HINT_TOKENS and self.experts is None:
            for lw in self.w.layers:
                if lw.tid2eid is not None:
                    self.pager(_expert_views(lw, np.unique(lw.tid2eid[tokens])))

    # -- hyper-connections (§3.2, §3.3) ----------------------------------------------------------
    def _hc_pre(self, hc: HCWeights, X):
        c, ops = self.c, self.ops
        xp = self.xp
        T, n = X.shape[0], c.n_hc
        flat = ops.rmsnorm(X.reshape(T, n * c.n_embd), None, c.rms_eps)
        mix = ops.linear(hc.fn, flat)                                             # [T, hc_mix]
        pre, post, C = ops.hc_split(mix, n, hc.scale, hc.base, np.float32(c.hc_eps), c.sinkhorn_iters)
        x = ops.hc_pre_mix(pre, X)
        # float32 already on the host backends: no copies (nothing writes to post or C)
        f32 = xp.float32
        return x, post if post.dtype == f32 else post.astype(f32), C if C.dtype == f32 else C.astype(f32)

    def _hc_post(self, y, X, post, C):
        # X_new[k] = post[k] * y + sum_j C[j, k] * X[j]   (C used transposed)
        return self.ops.hc_post(y, X, post, C)

    # -- attention sublayer (§3.4) -------------------------------------------------------------
    def _thetas(self, ratio: int, pos: np.ndarray, n_rot: int, heads: bool = False, query: bool = False):
        # the same positions recur in every layer of a forward pass (two kinds: plain and
        # compressed-layer YaRN angles): computed once per pass; `heads`: the [T, 1, n_rot/2]
        # view that broadcasts over heads, also kept, so every layer passes the same array
        # objects (a backend may keep what it derives from its tables: the cpu backend's rotations).
        # `query`: the angles of the queries' rotation (attention's and the indexer's), which ds4
        # numerics blend differently with YaRN (rope_thetas(query=True)); plain angles have one form
        c = self.c
        query = query and ratio != 0
        key = (ratio != 0, n_rot, pos.tobytes(), query)
        th = self._theta_cache.get(key)
        if th is None:
            if ratio == 0:
                th = self.ops.rope_thetas(pos, n_rot, c.rope_base, None)
            elif query:
                th = self.ops.rope_thetas(pos, n_rot, c.compress_rope_base, self.yarn, query=True)
            else:
                th = self.ops.rope_thetas(pos, n_rot, c.compress_rope_base, self.yarn)
            self._theta_cache[key] = th
            self._theta_cache[key + (True,)] = th[:, None, :]
        return self._theta_cache[key + (True,)] if heads else th

    def _attention(self, lw: LayerWeights, il: int, X, segs: list, pos: np.ndarray):
        """The attention sublayer in three parts: the front (HC, norms, projections, RoPE at each
        row's position, the compressors' and indexer's projections) and the back (inverse RoPE,
        output projections, HC) over every row at once; between them each segment's own KV work."""
        c, ops = self.c, self.ops
        xp = self.xp
        N = X.shape[0]
        # the position-independent front and back run through a backend's graph of them where
        # it has one (ops.decode_block, as the FFN sublayer: _ffn_block)
        h, qr, q, kv, post, C = self._block(lw.hc_attn, lambda X_: self._attn_front(lw, X_), (X,))
        th = self._thetas(lw.ratio, pos, c.n_rot)                                  # [N, n_rot/2]
        th_h = self._thetas(lw.ratio, pos, c.n_rot, heads=True)                   # [N, 1, n_rot/2]
        q = ops.rope(q, self._thetas(lw.ratio, pos, c.n_rot, heads=True, query=True), inplace=True)
        kv = ops.store_kv(ops.rope(kv, th), c.n_nope)
        comp = self._compress_proj(lw.comp, h, pos) if lw.ratio else None
        icomp = iproj = None
        if lw.ratio == CSA_RATIO:
            icomp = self._compress_proj(lw.indexer.comp, h, pos)
            iproj = self._indexer_proj(lw, segs, h, qr)

        # each segment's KV rows, compressed rows, indexer picks and attention on its own state
        # (one segment takes the arrays themselves: forward's pass is the one it always was)
        o = []
        for j, g in enumerate(segs):
            rows = (lambda a: a) if len(segs) == 1 else (lambda a, g=g: a[g.r0:g.r1])
            o.append(self._attend(lw, g.state.layers[il], rows(q), rows(kv),
                                  None if comp is None else tuple(map(rows, comp)),
                                  None if icomp is None else tuple(map(rows, icomp)),
                                  None if iproj is None else iproj[j], g.pos0))
        o = o[0] if len(o) == 1 else xp.concatenate(o, axis=0)
        o = ops.rope(o, th_h, inverse=True, inplace=True).reshape(N, c.n_head * c.head_dim)
        return self._block(lw.out_b, lambda o_, X_, p_, C_: self._attn_back(lw, o_, X_, p_, C_), (o, X, post, C))

    def _block(self, owner, fn, inputs: tuple):
        """fn(*inputs) (device arrays -> an array or a tuple of them), from the backend's graph
        of it keyed by owner where it has one (ops.decode_block), else as it is."""
        block = getattr(self.ops, "decode_block", None)
        return fn(*inputs) if block is None else block(owner, fn, inputs)

    def _attn_front(self, lw: LayerWeights, X):
        """HC, norms and projections of the attention sublayer (no position yet)."""
        c, ops = self.c, self.ops
        N = X.shape[0]
        x, post, C = self._hc_pre(lw.hc_attn, X)
        h = ops.rmsnorm(x, lw.attn_norm, c.rms_eps)
        qa, kv = ops.linears([lw.q_a, lw.kv], h)                                   # both read h
        qr = ops.rmsnorm(qa, lw.q_a_norm, c.rms_eps)
        q = ops.linear(lw.q_b, qr).reshape(N, c.n_head, c.head_dim)
        q = ops.rmsnorm(q, None, c.rms_eps)                                        # per head, no weight
        kv = ops.rmsnorm(kv, lw.kv_norm, c.rms_eps)
        return h, qr, q, kv, post, C

    def _attn_back(self, lw: LayerWeights, o, X, post, C):
        """The output projections and HC of the attention sublayer (o after the inverse RoPE)."""
        z = self.ops.grouped_linear(lw.out_a, o, self.c.o_groups)
        y = self.ops.linear(lw.out_b, z)
        return self._hc_post(y, X, post, C)

    def _attend(self, lw: LayerWeights, ls: LayerState, q, kv, comp, icomp, iproj, pos0: int):
        """One segment's attention at positions pos0..: its rows q [T, H, D] and kv [T, D] (after
        RoPE), the compressors' projections of its rows, the indexer's (None: not needed)."""
        c, ops = self.c, self.ops
        xp = self.xp
        T = q.shape[0]
        pos = np.arange(pos0, pos0 + T)                                            # host
        # raw rows this chunk can see: the n_swa-1 before it, then its own
        lo = max(0, pos0 - c.n_swa + 1)
        raw = ls.raw.write_window(lo, pos0, kv)                                    # positions lo..pos0+T-1

        if lw.ratio:
            self._compress_store(lw.comp, ls, *comp, pos0, index=False)
        sel = None
        if lw.ratio == CSA_RATIO:
            self._compress_store(lw.indexer.comp, ls, *icomp, pos0, index=True)
            if iproj is not None:
                sel = self._indexer_select(lw, ls, *iproj, pos,
                                           th_fn=lambda p: self._thetas(CSA_RATIO, p, c.n_rot, heads=True, query=True))

        o = []
        scale = 1.0 / np.sqrt(c.head_dim)
        # a backend whose attention reads the indexer's picks in place (attention_index: a
        # segment (keys [N, D], mask, idx [T, k])) needs no [block, k, D] gather, and one whose
        # attention needs no [T, H, keys] scores may take more queries a call (query_block: the
        # cpu kernel, one call and no concatenation for a whole chunk)
        by_index = getattr(ops, "attention_index", False)
        qb = (getattr(ops, "query_block", None) if sel is None or by_index else None) or QUERY_BLOCK
        for b0 in range(0, T, qb):
            b1 = min(T, b0 + qb)
            segments = _key_segments(lw, ls, raw, lo, pos, b0, b1, c.n_swa, sel is None)
            if sel is not None:                                                     # indexer picks (ratio 4)
                idx, ok = sel[0][b0:b1], sel[1][b0:b1]
                segments.append((ls.comp, ok, idx) if by_index else (ls.comp[idx], ok))
            o.append(ops.attention(q[b0:b1], segments, lw.sinks, scale))
        return o[0] if len(o) == 1 else xp.concatenate(o, axis=0)

    # -- compressors (§3.7) --------------------------------------------------------------------
    def _compress_proj(self, cw: CompressorWeights, h, pos: np.ndarray):
        """The compressor's projections of rows h at positions pos: (kv [N, w], score [N, w])."""
        ops, xp = self.ops, self.xp
        kvp = ops.linear(cw.kv, h)                                                 # [N, w]
        scp = (ops.linear(cw.gate, h) + xp.asarray(cw.ape[pos % cw.ratio])).astype(xp.float32)   # ape: host
        return kvp, scp

    def _compress_store(self, cw: CompressorWeights, ls: LayerState, kvp, scp, pos0: int, index: bool):
        """Put a segment's projections (positions pos0..) into the frontier and emit a row for
        every window they close."""
        c, ops = self.c, self.ops
        r, hd = cw.ratio, cw.hd
        T = kvp.shape[0]
        pos = np.arange(pos0, pos0 + T)                                            # host
        ring_kv, ring_sc = (ls.iproj_kv, ls.iproj_sc) if index else (ls.proj_kv, ls.proj_sc)
        lo = frontier_start(pos0, r)
        all_kv = ring_kv.write_window(lo, pos0, kvp)                               # positions lo..pos0+T-1
        all_sc = ring_sc.write_window(lo, pos0, scp)
        ends = pos[(pos + 1) % r == 0]
        if len(ends) == 0:
            return
        ws = ends + 1 - r                                                          # window starts
        # a backend's own pooling (the cupy backend's compress_pool kernel): the same softmax and
        # weighted sum from the frontier's rows, given each window's first row and whether a
        # previous window exists (overlap); None: the array-op form
        pool = getattr(ops, "compress_pool", None)
        pooled = None if pool is None else pool(all_kv, all_sc, ws - lo, ws >= r, r, hd, r == CSA_RATIO)
        if pooled is None:
            pooled = self._pool_arrays(all_kv, all_sc, ws, lo, r, hd)
        # (x * scale) * w: ds4's compressor norms inline (compressor_decode_one), where every other
        # norm is rms_norm_weight's (x * w) * scale in ds4 numerics (docs/numerics.md, rule 12)
        rows = ops.rmsnorm(pooled, None, c.rms_eps) * cw.norm
        rows = ops.rope(rows, self._thetas(r, ws, c.n_rot))                       # at the window's first position
        # row i holds the window starting at i * r: placed by position, not appended, so a step
        # run again (the batcher's retry after a failed batch) writes the same rows
        i0 = int(ws[0]) // r
        if index:
            rows = ops.store_index(rows)
            ls.index[i0:i0 + len(rows)] = rows
            ls.n_index = i0 + len(rows)
        else:
            rows = ops.store_kv(rows, hd - c.n_rot)
            ls.comp[i0:i0 + len(rows)] = rows
            ls.n_comp = i0 + len(rows)

    def _pool_arrays(self, all_kv, all_sc, ws: np.ndarray, lo: int, r: int, hd: int):
        """The closed windows (starting at positions ws) pooled [n, hd] float32: a softmax of the
        scores over each window's rows weighting its values, column by column."""
        xp = self.xp
        cur = ws[:, None] + np.arange(r)[None, :] - lo                             # [n, r] rows of all_*
        if r == CSA_RATIO:
            # overlapping windows: previous window's first half + this window's second half
            cur_x = xp.asarray(cur)
            kv_c, sc_c = all_kv[cur_x][:, :, hd:], all_sc[cur_x][:, :, hd:]
            prev = xp.asarray(np.maximum(cur - r, 0))
            has_prev = xp.asarray((ws >= r)[:, None, None])
            kv_p = xp.where(has_prev, all_kv[prev][:, :, :hd], 0.0)
            sc_p = xp.where(has_prev, all_sc[prev][:, :, :hd], -np.inf)
            kvs, scs = xp.concatenate([kv_p, kv_c], axis=1), xp.concatenate([sc_p, sc_c], axis=1)
        else:
            cur_x = xp.asarray(cur)
            kvs, scs = all_kv[cur_x], all_sc[cur_x]
        a = self.ops.softmax(scs, axis=1)
        return (a * kvs).sum(axis=1)

    # -- indexer (§3.8) ------------------------------------------------------------------------
    def _indexer_proj(self, lw: LayerWeights, segs: list, h, qr) -> list:
        """Per segment, the indexer's projections of its rows (qi [T, heads, dim] before RoPE,
        weights [T, heads]), or None where its queries see at most top_k rows (all are used).
        Computed once over the rows of every segment that needs them."""
        c, ops = self.c, self.ops
        xp = self.xp
        need = [(g.pos0 + g.r1 - g.r0) // CSA_RATIO > c.idx_topk for g in segs]
        if not any(need):
            return [None] * len(segs)
        if all(need):
            hs, qs = h, qr
        else:
            rows = np.concatenate([np.arange(g.r0, g.r1) for g, n in zip(segs, need) if n])
            rx = xp.asarray(rows)
            hs, qs = h[rx], qr[rx]
        M = hs.shape[0]
        qi = ops.linear(lw.indexer.q_b, qs).reshape(M, c.idx_n_head, c.idx_head_dim)
        wts = ops.linear(lw.indexer.proj, hs) * xp.asarray(1.0 / np.sqrt(c.idx_head_dim * c.idx_n_head), dtype=xp.float32)
        if len(segs) == 1:
            return [(qi, wts)]
        out, k = [], 0
        for g, n in zip(segs, need):
            if n:
                t = g.r1 - g.r0
                out.append((qi[k:k + t], wts[k:k + t]))
                k += t
            else:
                out.append(None)
        return out

    def _indexer_select(self, lw: LayerWeights, ls: LayerState, qi, wts, pos, th_fn):
        """Per query: (indices [T, k], valid [T, k]) of the compressed rows it attends; qi and
        wts: the indexer's projections of these queries (_indexer_proj)."""
        c, ops = self.c, self.ops
        xp = self.xp
        k = c.idx_topk
        n_vis = (pos + 1) // CSA_RATIO
        qi = ops.index_qat(ops.rope(qi, th_fn(pos)))
        keys = ls.index[:int(n_vis[-1])]
        score = ops.indexer_scores(qi, keys, wts)                                  # [T, n rows]
        vis = xp.asarray(np.arange(keys.shape[0])[None, :] < n_vis[:, None])
        score = xp.where(vis, score, -np.inf)
        # the picks in row order: where a chunk's early queries see no more than k rows, the
        # indexer picks all of them, and they must come in the order a query that skips the
        # indexer (every visible row, row order) uses, or float32 attention sums depend on chunking
        idx = xp.sort(ops.topk_lowest_index(score, k), axis=1)                     # [T, k]
        ok = xp.take_along_axis(vis, idx, axis=1)                                  # picks on invisible rows drop
        return idx, ok

    # -- FFN sublayer (§3.11) ------------------------------------------------------------------
    def _ffn_block(self, lw: LayerWeights, X, tokens):
        """The FFN sublayer, through a backend's graph of it where it has one (ops.decode_block:
        the cupy backend's CUDA graphs; the sublayer depends on no position, and a hash layer's
        routing by token id comes in as device data). The paging hints and the expert cache act
        on the host mid-sublayer: then it runs as it is."""
        if getattr(self.ops, "decode_block", None) is None or self.pager or self.experts is not None:
            return self._ffn(lw, X, tokens)
        if lw.tid2eid is None:
            return self._block(lw.hc_ffn, lambda X_: self._ffn(lw, X_, tokens), (X,))
        hsel = self.xp.asarray(lw.tid2eid[tokens].astype(np.int64))
        return self._block(lw.hc_ffn, lambda X_, h_: self._ffn(lw, X_, tokens, h_), (X, hsel))

    def _ffn(self, lw: LayerWeights, X, tokens, hsel=None):
        c, ops = self.c, self.ops
        xp = self.xp
        x, post, C = self._hc_pre(lw.hc_ffn, X)
        u = ops.rmsnorm(x, lw.ffn_norm, c.rms_eps)
        p = xp.sqrt(ops.softplus(ops.linear(lw.gate_inp, u)))                     # [T, n_expert]
        if hsel is not None:
            sel = hsel                                                             # (device data: _ffn_block)
        elif lw.tid2eid is not None:
            sel = xp.asarray(lw.tid2eid[tokens].astype(np.int64))                  # hash routing by token id (host table)
        else:
            biased = p + lw.bias if lw.bias is not None else p
            sel = ops.topk_lowest_index(biased, c.n_expert_used)
        wsel = xp.take_along_axis(p, sel, axis=1)
        f32 = xp.float32
        norm = getattr(ops, "expert_weights", None)     # a backend's own form (ds4 numerics)
        if norm is not None:
            wsel = norm(wsel, c.expert_weights_scale, lw.tid2eid is not None)
        else:
            tot = wsel.sum(axis=1, keepdims=True)
            tot = xp.maximum(tot, xp.asarray(2.0 ** -14, dtype=f32)) if ops.numerics == "ds4" else tot + xp.asarray(1e-20, dtype=f32)
            wsel = (wsel / tot * xp.asarray(c.expert_weights_scale, dtype=f32)).astype(f32)
        if self.pager and len(tokens) <= EXPERT_HINT_TOKENS and self.experts is None:
            # asked for in this thread (the next thing read); a hash layer's were asked for
            # ahead at the step's start, and again here in case that thread fell behind
            now = getattr(self.pager, "now", None)
            if now is not None:
                now(_expert_views(lw, xp.unique(sel)))
            elif lw.tid2eid is None:
                self.pager(_expert_views(lw, xp.unique(sel)))
        limit = np.float32(self.c.swiglu_clamp[lw.il])
        if self.experts is not None:                                               # (slots: read now)
            y = self.experts.moe(ops, lw, u, sel, wsel, limit)
        else:
            y = ops.moe(lw, u, sel, wsel, limit)                                   # routed + shared
        return self._hc_post(y, X, post, C)

    # -- output head (§3.12) -------------------------------------------------------------------
    def _head(self, X):
        c, ops, w = self.c, self.ops, self.w
        xp = self.xp
        T = X.shape[0]
        flat = ops.rmsnorm(X.reshape(T, c.n_hc * c.n_embd), None, c.rms_eps)
        mix = ops.linear(w.hc_head_fn, flat)                                      # [T, n_hc]
        head = getattr(ops, "hc_head", None)     # a backend's own form of the collapse (ds4 numerics)
        if head is not None:
            x = head(mix, w.hc_head_scale[0], w.hc_head_base, c.hc_eps, X)
        else:
            pre = ops.sigmoid(mix * w.hc_head_scale[0] + w.hc_head_base) + xp.asarray(c.hc_eps, dtype=xp.float32)
            x = ops.hc_pre_mix(pre, X)
        x = ops.rmsnorm(x, w.out_norm, c.rms_eps)
        return ops.linear(w.output, x)


def _key_segments(lw: LayerWeights, ls: LayerState, raw, lo: int, pos: np.ndarray, b0: int, b1: int,
                  n_swa: int, all_rows: bool) -> list:
    """Queries b0..b1-1's raw keys (rows of `raw`, which starts at position lo) with their band
    mask, and with `all_rows` on a compressed layer every visible compressed row with its mask."""
    if b1 - b0 == 1:
        # one query (a decode step) sees every key of its window and every visible row: the masks
        # are all True (the general form's ~10 NumPy calls on one-row arrays give the same masks)
        p = int(pos[b0])
        k0 = max(lo, p - n_swa + 1)
        segments = [(raw[k0 - lo:p + 1 - lo], np.ones((1, p + 1 - k0), dtype=bool))]
        if lw.ratio and all_rows:
            nmax = (p + 1) // lw.ratio
            segments.append((ls.comp[:nmax], np.ones((1, nmax), dtype=bool)))
        return segments
    tq = pos[b0:b1]
    # raw keys of this block: positions [tq0 - n_swa + 1, tq_last]
    k0 = max(lo, tq[0] - n_swa + 1)
    kpos = np.arange(k0, tq[-1] + 1)
    mraw = (kpos[None, :] <= tq[:, None]) & (kpos[None, :] > tq[:, None] - n_swa)
    segments = [(raw[k0 - lo: tq[-1] + 1 - lo], mraw)]
    if lw.ratio and all_rows:
        n_vis = (tq + 1) // lw.ratio                                                # visible rows per query
        nmax = int(n_vis[-1])
        segments.append((ls.comp[:nmax], np.arange(nmax)[None, :] < n_vis[:, None]))
    return segments


def _expert_views(lw: LayerWeights, experts) -> list:
    """The map views of these experts' gate, up and down matrices (paging hints)."""
    return [t.expert_data(int(e)) for e in experts for t in (lw.gate_exps, lw.up_exps, lw.down_exps)]
