"""The cupy backend's ops: the forward pass on a CUDA device (spec: engine/backends/numpy/ops.py).

Written against `xp`, the array namespace: CuPy on a GPU, or with DS4_CUDA_EMULATE=1 the NumPy-backed
stand-in (standin.py) whose RawModule launches run the kernels' host emulation. Weights are
uploaded once at open (bind.py: the raw GGUF blocks, which the kernels read in place); the KV
state lives in device arrays and reaches the host only through state_to_host / state_from_host;
logits reach the host only in logits_to_host, for sampling.

Every op has an array-op form (the reference's own steps in xp: float64 where it sums in float64,
ds4's rounding rules from numerics.py), correct everywhere. Where the kernels are loaded
(kernels.py: cuda_kernels/*.cu through RawModule) the quantized products, the experts, attention,
RMSNorm, RoPE, the HC split, the indexer and its top-k launch them instead; an op whose kernel is
missing keeps its array-op form (docs/backends.md).

Inputs may be host (NumPy) arrays and host QTensors: the conformance suite calls ops directly with
those, and they are uploaded (a QTensor once, cached).
"""
from __future__ import annotations

import time

import numpy as np

from ...gguf import quants as Q
from ...gguf.model_file import QTensor
from ...model import numerics as N
from ...model.kv_state import KVState
from ...model.numerics import DS4, NUMERICS
from ..protocol import BindReport
from . import ds4_dot
from . import numerics as DN
from . import quant
from .bind import bind_device
from .graphs import DecodeGraphs
from .graphs import enabled as graphs_enabled
from .kernels import GEMM_TILE_PAIRS
from .quant import DevTensor

_EXPERT_ACT_Q8_0 = frozenset({Q.MXFP4, Q.Q8_0})
_DENSE = frozenset({Q.F32, Q.F16, Q.BF16})
_F32 = np.float32
GEMM_MIN_ROWS = 16        # tokens from which a dense product decodes its weight once and runs a GEMM


class CupyOps:
    name = "cupy"

    def __init__(self, numerics: str, xp, kernels=None, progress=None):
        """xp: cupy or the stand-in; kernels: a kernels.Kernels (None: array-op forms only);
        progress(done_bytes, total_bytes): called while the weights upload."""
        if numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {NUMERICS}, got {numerics!r}")
        self.numerics = numerics
        self._ds4 = numerics == DS4
        self.xp = xp
        self.k = kernels
        self.progress = progress
        self._uploaded: dict = {}     # id(host object) -> (object, device copy): host inputs met in a call
        self._rot: dict = {}          # id(thetas) -> (thetas, cos, sin): this pass's rotations
        # the attention kernel reads the indexer's picks in place (segments (keys, mask, idx))
        self.attention_index = kernels is not None and kernels.has("attn_segment")
        self.graphs = DecodeGraphs(xp) if kernels is not None and graphs_enabled() else None
        if self._ds4:   # as the reference: ds4's RMSNorm in ds4 numerics (an instance attribute)
            self.rmsnorm = self.rmsnorm_ds4

    # -- set-up and hand-offs --------------------------------------------------------------------
    def bind_weights(self, model_file):
        """Every matrix's raw blocks and every vector uploaded (bind.py)."""
        t0 = time.perf_counter()
        weights, nbytes = bind_device(self.xp, model_file, self.progress)
        self.xp.cuda.Device().synchronize()
        return weights, BindReport(time.perf_counter() - t0, nbytes)

    def new_state(self, config, ctx: int, rewind_cap: int) -> KVState:
        return KVState(config, ctx, rewind_cap, xp=self.xp)

    def state_to_host(self, state: KVState) -> KVState:
        return state.copy_to(np, lambda a: self.xp.asnumpy(a).astype(np.float32, copy=False))

    def state_from_host(self, host: KVState) -> KVState:
        return host.copy_to(self.xp, lambda a: self.xp.asarray(np.asarray(a, np.float32)))

    def embed(self, embd, tokens):
        """The rows of `tokens` (host int64 [T]), decoded on the device: only those rows."""
        w = self._w(embd)
        idx = self.xp.asarray(np.asarray(tokens, np.int64))
        if self.k is not None and self.k.has_dequant(w):
            return self.k.dequant_rows(w, idx)
        return quant.dequantize(self.xp, w.type_id, w.data[idx])

    def logits_to_host(self, logits) -> np.ndarray:
        self._rot.clear()                 # the pass is over: its rotations go
        if isinstance(logits, np.ndarray):
            return logits.astype(np.float32, copy=False)
        return self.xp.asnumpy(logits).astype(np.float32, copy=False)

    def device_line(self) -> str:
        """Where this runs, one line (ds4-bench's device line)."""
        kern = "off" if self.k is None else "on"
        if getattr(self.xp.cuda, "emulated", False):
            return f"cupy on the CuPy stand-in (DS4_CUDA_EMULATE=1: the kernels' host emulation), kernels {kern}"
        import cupy
        p = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        name = p["name"].decode() if isinstance(p["name"], bytes) else p["name"]
        return (f"cupy {cupy.__version__} on {name} (sm_{p['major']}{p['minor']}, "
                f"{p['totalGlobalMem'] / 2**30:.0f} GiB), kernels {kern}")

    # -- host inputs -----------------------------------------------------------------------------
    def _a(self, x):
        """A device array of x (host arrays uploaded; device arrays as they are)."""
        return x if isinstance(x, self.xp.ndarray) else self.xp.asarray(x)

    def _w(self, w):
        """A DevTensor of w (a host QTensor is uploaded once and cached)."""
        if isinstance(w, QTensor):
            hit = self._uploaded.get(id(w))
            if hit is None or hit[0] is not w:
                dev = DevTensor(w.name, w.type_id, tuple(w.dims), self.xp.asarray(np.asarray(w.data)))
                hit = self._uploaded[id(w)] = (w, dev)
            return hit[1]
        return w

    # -- matmuls -------------------------------------------------------------------------------
    def linear(self, w, x, rows=None):
        """x [T, in] -> [T, out] with W's rows `rows`. ds4 numerics, Q8_0 weight: ds4's Q8_0
        activation codes and ds4's integer block dots, the reference's bit for bit, on the kernels
        (ds4_matvec_q8_0; a prefill chunk: the tensor-core ds4_gemm_q8_0) or in array ops (ds4_dot)."""
        xp = self.xp
        w, x = self._w(w), self._a(x).astype(xp.float32)
        q8 = self._ds4 and w.type_id == Q.Q8_0
        if q8 and self.k is not None and self.k.has_ds4(w):      # ds4's own dots, the reference's bits
            return self.k.ds4_dense(w, *self._codes(Q.Q8_0, x), rows)
        if self.k is not None and self.k.has_dense(w):
            xin = DN.q8_0_round(xp, x) if q8 else x
            if x.shape[0] >= GEMM_MIN_ROWS and self.k.has_dequant(w):
                # a prefill chunk: the rows decoded once by the kernel, then a float32 GEMM (cuBLAS);
                # the matvec would read every weight row once per token
                return self.k.gemm_dense(w, xin, rows)
            return self.k.matvec_dense(w, xin, rows)
        if q8:
            return ds4_dot.matmul(xp, w, ds4_dot.act_for(xp, Q.Q8_0, x), rows)
        return quant.matmul(xp, w, x, rows)

    def linears(self, ws, x):
        return [self.linear(w, x) for w in ws]

    def grouped_linear(self, w, x, groups):
        w, x = self._w(w), self._a(x)
        gi, gr = x.shape[1] // groups, w.n_rows // groups
        return self.xp.concatenate([self.linear(w, x[:, g * gi:(g + 1) * gi], rows=slice(g * gr, (g + 1) * gr))
                                    for g in range(groups)], axis=1)

    # -- norms and elementwise -----------------------------------------------------------------
    def rmsnorm(self, x, w, eps):
        xp, x = self.xp, self._a(x)
        if self.k is not None and self.k.has("rmsnorm") and x.dtype == xp.float32:
            return self.k.rmsnorm(x, None if w is None else self._a(w), eps)
        ms = xp.mean(xp.square(x.astype(xp.float64)), axis=-1, keepdims=True)
        y = (x * (1.0 / xp.sqrt(ms + eps)).astype(xp.float32)).astype(xp.float32)
        return y if w is None else (y * self._a(w)).astype(xp.float32)

    def rmsnorm_ds4(self, x, w, eps):
        """numerics.rmsnorm_ds4 (ds4.c rms_norm_weight): the mean of squares in float64, then a
        float32 scale 1 / sqrt(ms + eps), (x * w) * scale."""
        xp, x = self.xp, self._a(x).astype(self.xp.float32)
        if self.k is not None and self.k.has("rmsnorm_ds4"):      # the kernel: the same steps, one launch
            return self.k.rmsnorm(x, None if w is None else self._a(w), eps, "rmsnorm_ds4")
        ms = xp.mean(xp.square(x.astype(xp.float64)), axis=-1, keepdims=True).astype(xp.float32)
        scale = (_F32(1.0) / xp.sqrt(ms + _F32(eps))).astype(xp.float32)
        return (x * scale).astype(xp.float32) if w is None else ((x * self._a(w)) * scale).astype(xp.float32)

    def sigmoid(self, x):
        xp = self.xp
        return (1.0 / (1.0 + xp.exp(-self._a(x)))).astype(xp.float32)

    def softplus(self, x):
        xp, x = self.xp, self._a(x)
        return xp.where(x > 20.0, x, xp.log1p(xp.exp(xp.minimum(x, 20.0)))).astype(xp.float32)

    def softmax(self, x, axis=-1):
        xp, x = self.xp, self._a(x)
        m = xp.max(x, axis=axis, keepdims=True)
        m = xp.where(xp.isfinite(m), m, 0.0)
        e = xp.exp(x - m)
        return (e / xp.sum(e, axis=axis, keepdims=True)).astype(xp.float32)

    def compress_pool(self, kv, sc, first, has_prev, r, hd, overlap):
        """Model._compress_store's pooling of closed windows on the compress_pool kernel (None:
        no kernel, the glue's array-op form serves)."""
        if self.k is None:
            return None
        return self.k.compress_pool(self._a(kv), self._a(sc), first, has_prev, r, hd, overlap)

    # -- KV-row numerics -----------------------------------------------------------------------
    def store_kv(self, rows, n_nope):
        rows = self._a(rows)
        if not self._ds4:
            return rows
        got = None if self.k is None or rows.dtype != self.xp.float32 else self.k.kv_store(rows, n_nope)
        return got if got is not None else DN.f16_round(self.xp, DN.fp8_e4m3_roundtrip(self.xp, rows, n_nope))

    def index_qat(self, rows):
        rows = self._a(rows)
        return DN.indexer_qat(self.xp, rows) if self._ds4 else rows

    def store_index(self, rows):
        rows = self._a(rows)
        return DN.f16_round(self.xp, DN.indexer_qat(self.xp, rows)) if self._ds4 else rows

    # -- RoPE ----------------------------------------------------------------------------------
    def rope_thetas(self, pos, n_rot, base, yarn, query: bool = False):
        """The angle tables are built on the host (a few KB; the reference's exact float32
        steps) and uploaded with their cosines and sines, kept for this pass's rotations. In ds4
        numerics the cosines and sines are the C library's cosf / sinf (numerics.libm_cos_sin, as
        ds4's rope_tail_ext_inplace calls them), and a query's rotation (`query`) with YaRN takes
        its own FMA-blend angles (NumpyOps.rope_thetas_ds4: GCC compiled the two call sites
        differently)."""
        if self._ds4:
            th = N.rope_thetas_ds4(np.asarray(pos), n_rot, base, yarn=yarn, fma_blend=query and yarn is not None)
        else:
            th = N.rope_thetas_exact(np.asarray(pos), n_rot, base, yarn=yarn)
        out = self.xp.asarray(th)
        if self._ds4:
            c, s = N.libm_cos_sin(th)
        else:
            t64 = np.asarray(th, np.float64)
            c, s = np.cos(t64).astype(_F32), np.sin(t64).astype(_F32)
        self._rot[id(out)] = (out, self.xp.asarray(c), self.xp.asarray(s))
        return out

    def _cos_sin(self, thetas):
        """cos, sin of a table rope_thetas made, or of a view of one (th[:, None, :]: the glue
        passes the same view to every layer, so it is derived once a pass)."""
        hit = self._rot.get(id(thetas))
        if hit is None or hit[0] is not thetas:
            hit = self._rot[id(thetas)] = self._rotations_of(thetas)
        return hit[1:3]

    def _rotations_of(self, thetas) -> tuple:
        xp = self.xp
        th = self._a(thetas)
        if self._ds4:
            c, s = N.libm_cos_sin(xp.asnumpy(th))
            return thetas, xp.asarray(c), xp.asarray(s)
        t64 = th.astype(xp.float64)
        return thetas, xp.cos(t64).astype(xp.float32), xp.sin(t64).astype(xp.float32)

    def rope(self, x, thetas, inverse=False, inplace=False):
        """Rotate the last 2 * thetas.shape[-1] dims of x in interleaved pairs (numerics.apply_rope);
        `inplace`: the caller drops x, so the kernel may rotate it where it lies. In ds4 numerics
        the rotation takes the host's libm tables (a device's sincosf is not glibc's), so it runs
        as array ops, not the kernel that computes its own."""
        x = self._a(x).astype(self.xp.float32)
        if not self._ds4 and self.k is not None and self.k.has("rope"):
            return self.k.rope(x, self._a(thetas), inverse, inplace)
        c, s = self._cos_sin(thetas)
        return DN.apply_rope(self.xp, x, c, s, inverse)

    # -- attention -----------------------------------------------------------------------------
    def attention(self, q, segments, sinks, scale):
        """Softmax attention with per-head sinks, K = V, over concatenated key segments (see the
        reference): the kernel's online softmax, or the reference's float64 steps."""
        xp = self.xp
        q, sinks = self._a(q), self._a(sinks)
        segs = [tuple(self._a(a) for a in s) for s in segments]
        if self.k is not None and self.k.has("attn_segment"):
            return self.k.attention(q, segs, sinks, scale)
        segs = [(s[0][s[2]], s[1]) if len(s) > 2 else s for s in segs]        # (keys, mask, idx): gathered
        q64 = q.astype(xp.float64)
        scores = []
        for keys, mask in segs:
            k64 = keys.astype(xp.float64)
            s = (q64 @ (k64.T if keys.ndim == 2 else xp.swapaxes(k64, 1, 2))) * scale     # [T, H, K]
            scores.append(xp.where(mask.astype(xp.bool_)[:, None, :], s, -xp.inf))
        s = xp.concatenate(scores, axis=-1)
        s64 = sinks.astype(xp.float64)
        m = xp.maximum(xp.max(s, axis=-1), s64[None, :])
        p = xp.exp(s - m[..., None])
        den = xp.sum(p, axis=-1) + xp.exp(s64[None, :] - m)
        o, k0 = None, 0
        for keys, _ in segs:
            k1 = k0 + keys.shape[-2]
            part = p[..., k0:k1] @ keys.astype(xp.float64)
            o = part if o is None else o + part
            k0 = k1
        return (o / den[..., None]).astype(xp.float32)

    def indexer_scores(self, qi, keys, wts):
        """[T, C] = sum_h wts[t, h] * relu(qi[t, h] . keys[c]) (float64 sums; queries in blocks so
        the [t, h, c] products stay under ~16M values)."""
        xp = self.xp
        qi, keys, wts = self._a(qi), self._a(keys), self._a(wts)
        if self.k is not None and self.k.has("indexer_scores"):
            return self.k.indexer_scores(qi, keys, wts)
        T, H, _ = qi.shape
        step = max(1, (1 << 24) // max(1, H * keys.shape[0]))
        k64 = keys.astype(xp.float64).T
        out = []
        for t0 in range(0, T, step):
            s = xp.maximum(qi[t0:t0 + step].astype(xp.float64) @ k64, 0.0)                # [t, H, C]
            out.append((wts[t0:t0 + step].astype(xp.float64)[:, None, :] @ s)[:, 0, :])
        return out[0] if len(out) == 1 else xp.concatenate(out, axis=0)

    def topk_lowest_index(self, scores, k):
        """Indices of the k largest per row, ties to the lowest index: CuPy's sorts are stable."""
        scores = self._a(scores)
        if self.k is not None and self.k.has("topk") and scores.dtype == self.xp.float32 and k <= min(scores.shape[-1], 1024):
            return self.k.topk(scores, k)
        return self.xp.argsort(-scores, axis=-1)[..., :k]

    # -- hyper-connections -------------------------------------------------------------------------
    def hc_split(self, mix, n, scale, base, eps, iters):
        xp = self.xp
        mix, scale, base = self._a(mix), self._a(scale), self._a(base)
        if self.k is not None and self.k.has("hc_split") and n <= 8:
            return self.k.hc_split(mix, n, scale, base, eps, iters)
        T, eps = mix.shape[0], _F32(eps)
        pre = self.sigmoid(mix[:, :n] * scale[0] + base[:n]) + eps
        post = 2.0 * self.sigmoid(mix[:, n:2 * n] * scale[1] + base[n:2 * n])
        logits = (mix[:, 2 * n:] * scale[2] + base[2 * n:]).reshape(T, n, n)
        C = self.softmax(logits, axis=-1) + eps
        C = C / (C.sum(axis=1, keepdims=True) + eps)
        for _ in range(iters - 1):
            C = C / (C.sum(axis=2, keepdims=True) + eps)
            C = C / (C.sum(axis=1, keepdims=True) + eps)
        return pre.astype(xp.float32), post.astype(xp.float32), C.astype(xp.float32)

    def hc_pre_mix(self, pre, X):
        xp = self.xp
        pre, X = self._a(pre), self._a(X)
        return (pre.astype(xp.float64)[:, None, :] @ X.astype(xp.float64))[:, 0, :].astype(xp.float32)

    def hc_post(self, y, X, post, C):
        xp = self.xp
        y, X, post, C = self._a(y), self._a(X), self._a(post), self._a(C)
        mixed = xp.swapaxes(C.astype(xp.float64), 1, 2) @ X.astype(xp.float64)
        return (post[:, :, None] * y[:, None, :] + mixed).astype(xp.float32)

    # -- experts -------------------------------------------------------------------------------
    def _act(self, w, x, kern: bool):
        """ds4: a routed-expert input's Q8 activation; identity in exact numerics. For a kernel its
        float32 values; for the array-op form what the reference takes: ds4's codes (ds4_dot.Act)
        where ds4 has an integer dot (IQ2_XXS, Q2_K, Q8_0), else the exact float64 values."""
        xp = self.xp
        if not self._ds4 or w.type_id in _DENSE:
            return x
        q8_0 = w.type_id in _EXPERT_ACT_Q8_0
        if kern:
            return DN.q8_0_round(xp, x) if q8_0 else DN.q8_k_round(xp, x)
        if ds4_dot.has_dot(w.type_id):
            return ds4_dot.act_for(xp, w.type_id, x)
        return DN.q8_0_round(xp, x, np.float64) if q8_0 else DN.q8_k_round(xp, x, np.float64)

    def _emm(self, w, x):
        """One expert's product in the array-op form (x from _act)."""
        if isinstance(x, ds4_dot.Act):
            return ds4_dot.matmul(self.xp, w, x)
        return quant.matmul(self.xp, w, x)

    @staticmethod
    def _swiglu(xp, g, v, limit):
        g = xp.minimum(g, limit)
        v = xp.clip(v, -limit, limit)
        return (g * (1.0 / (1.0 + xp.exp(-g))).astype(xp.float32)).astype(xp.float32) * v

    def moe(self, lw, u, sel, wsel, limit):
        """The routed experts plus the shared one (NumpyOps.moe): with the kernels, the
        selected experts' gathered products (kernels.experts); else expert by expert. A decode
        step's (fewer than GEMM_TILE_PAIRS pairs: no host-side plan) runs from a CUDA graph
        captured once per layer and shape (graphs.py)."""
        u, sel, wsel, limit = self._a(u), self._a(sel), self._a(wsel), _F32(limit)
        gate, up, down = self._w(lw.gate_exps), self._w(lw.up_exps), self._w(lw.down_exps)
        kern = self.k is not None and self.k.has_experts(gate) and self.k.has_experts(down)
        if kern and self.graphs is not None and sel.size < GEMM_TILE_PAIRS:
            return self.graphs.run(lw, lambda u_, s_, w_: self._moe(lw, gate, up, down, u_, s_, w_, limit, True),
                                   (u, sel, wsel))
        return self._moe(lw, gate, up, down, u, sel, wsel, limit, kern)

    def expert_weights(self, wsel, scale, hashed: bool):
        """The routed weights normalized (Model._ffn's own form: the sum floored at 2^-14 in ds4
        numerics, + 1e-20 in exact), with its constants as scalars of the kernel, not uploaded
        0-d arrays: a host -> device copy cannot be part of the FFN's CUDA graph."""
        xp = self.xp
        wsel = self._a(wsel)
        tot = wsel.sum(axis=1, keepdims=True)
        tot = xp.maximum(tot, _F32(2.0 ** -14)) if self._ds4 else tot + _F32(1e-20)
        return (wsel / tot * _F32(scale)).astype(xp.float32)

    def decode_block(self, owner, fn, inputs: tuple):
        """fn(*inputs) -> a device array or a tuple of them, for a position-independent block of
        a one-token step (Model: a layer's FFN sublayer, its attention's front and back): from a
        CUDA graph keyed by owner and the inputs' shapes (graphs.py; the MoE graph inside the FFN
        becomes part of it). Eager where graphs are off, the kernels are missing or the rows are
        several (their MoE may plan on the host)."""
        inputs = tuple(self._a(a) for a in inputs)
        if self.graphs is None or inputs[0].shape[0] != 1:
            return fn(*inputs)
        return self.graphs.run(owner, fn, inputs)

    def _moe(self, lw, gate, up, down, u, sel, wsel, limit, kern):
        routed = (self._routed_kernels if kern else self._routed_arrays)(gate, up, down, u, sel, wsel, limit)
        sh = self._swiglu(self.xp, *self.linears([lw.sh_gate, lw.sh_up], u), limit)
        return routed + self.linear(lw.sh_down, sh)

    def _routed_arrays(self, gate, up, down, u, sel, wsel, limit):
        xp = self.xp
        out = xp.zeros(u.shape, dtype=xp.float32)
        ua = self._act(gate, u, False)
        sel_h = xp.asnumpy(sel)                     # (the expert loop runs on the host)
        for e in np.unique(sel_h):
            rows_h, slot_h = np.nonzero(sel_h == e)
            rows, slot = xp.asarray(rows_h), xp.asarray(slot_h)
            we = wsel[rows, slot][:, None]
            xe = ua[rows]
            g = self._emm(gate.expert(int(e)), xe)
            v = self._emm(up.expert(int(e)), xe)
            m = self._swiglu(xp, g, v, limit)
            if self._ds4:
                d = self._emm(down.expert(int(e)), self._act(down, m * we, False))
            else:
                d = quant.matmul(xp, down.expert(int(e)), m) * we
            out[rows] = out[rows] + d
        return out

    def _kexperts(self, w, x, experts, toks):
        """One matrix's gathered expert products on the kernels. ds4 numerics with ds4's integer
        dot for w (Q8_0, IQ2_XXS, Q2_K): x is the float input, quantized here to ds4's codes for
        ds4_matvec / ds4_gemm (the reference's bits); else x as _act gives it."""
        if self._ds4 and self.k.has_ds4(w):
            return self.k.ds4_experts(w, *self._codes(w.type_id, x), experts, toks)
        return self.k.experts(w, self._act(w, x, True), experts, toks)

    def _codes(self, type_id, x):
        """ds4's activation codes of x [T, n] for a `type_id` weight (Q8_0 blocks, or Q8_K):
        (q int8 [T, n], d float32 [T, n / block]) from the quantize kernel, else its array-op form."""
        x = x.astype(self.xp.float32)
        got = self.k.quantize(x, 32 if type_id == Q.Q8_0 else 256)
        if got is not None:
            return got
        q, d = (DN.q8_0_quantize if type_id == Q.Q8_0 else DN.q8_k_quantize)(self.xp, x)
        return q.reshape(x.shape[0], -1), d

    def _routed_kernels(self, gate, up, down, u, sel, wsel, limit):
        """Pairs (token, expert) in token-major order, each token's experts ascending so its
        outputs are summed in the reference's order; one gathered product per matrix."""
        xp = self.xp
        T, k = sel.shape
        slot = _stable_order(xp, sel)
        sel_s, w_s = xp.take_along_axis(sel, slot, axis=1), xp.take_along_axis(wsel, slot, axis=1)
        experts = sel_s.reshape(-1).astype(xp.int32)
        toks = xp.repeat(xp.arange(T, dtype=xp.int32), k)
        we = w_s.reshape(-1)[:, None].astype(xp.float32)
        g = self._kexperts(gate, u, experts, toks)
        v = self._kexperts(up, u, experts, toks)
        m = self._swiglu(xp, g, v, limit)
        pairs = xp.arange(T * k, dtype=xp.int32)
        if self._ds4:
            d = self._kexperts(down, m * we, experts, pairs)
        else:
            d = self.k.experts(down, m, experts, pairs) * we
        d = d.reshape(T, k, -1)
        routed = d[:, 0]
        for j in range(1, k):
            routed = routed + d[:, j]
        return routed


def _stable_order(xp, sel):
    """argsort(sel, axis=1, stable) for a few columns, in elementwise ops and a reduction: a
    capture-safe form (CuPy's argsort runs Thrust, which synchronizes: not allowed in a graph)."""
    k = sel.shape[1]
    i = xp.arange(k)
    before = (sel[:, None, :] < sel[:, :, None]) | ((sel[:, None, :] == sel[:, :, None]) & (i[None, :] < i[:, None])[None])
    rank = before.sum(axis=2)                                           # [T, j]: j's place
    return xp.argmax(rank[:, :, None] == i[None, None, :], axis=1)      # [T, r]: the j at place r
