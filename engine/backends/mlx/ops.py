"""The mlx backend's ops: the forward pass's operations in mlx.core (spec: engine/backends/numpy/ops.py).

Everything here is lazy: an op adds to MLX's graph and nothing runs until `mx.eval`, which happens
at the token and chunk boundaries -- `logits_to_host` evaluates the logits together with every live
KV state (so a state never carries the graph of an earlier forward), and `state_to_host` its state.

Weights are bound once at open (quant.repack: MLX's own quantized layouts where the mapping is
exact, raw GGUF blocks for IQ2_XXS and Q2_K). Each op has an MLX-ops form, which is the reference
everywhere and the path used off Apple; on Apple a few call custom Metal kernels instead (metal.py:
the IQ2_XXS / Q2_K expert matvecs, the HC Sinkhorn split, decode attention, the indexer's top-k),
which tests hold to the same NumPy reference through a C++ emulation.

Inputs may also be host (NumPy) arrays and unbound QTensors: the conformance suite calls ops
directly with those, and they are converted (a QTensor is repacked once and cached).
"""
from __future__ import annotations

import functools
import threading
import time
import weakref

import mlx.core as mx
import numpy as np

from ...console import threads_kept
from ...gguf import quants as Q
from ...gguf.model_file import QTensor
from ...model import numerics as N
from ...model.kv_state import KVState
from ...model.numerics import DS4, NUMERICS
from ..protocol import BindReport
from . import ds4_dot as DD
from . import numerics as MN
from . import quant, xp as XP
from .ds4_ref import Ds4RefOps
from .bind import bind_mlx, take_rows

# Routed-expert activations: ggml's K-quant and IQ dot products take Q8_K (256-value) activations;
# MXFP4's and Q8_0's take Q8_0 (32-value) ones (as the reference).
_EXPERT_ACT_Q8_0 = frozenset({Q.MXFP4, Q.Q8_0})
_DENSE = frozenset({Q.F32, Q.F16, Q.BF16})
_METAL_KINDS = frozenset({"iq2_xxs", "q2_k"})


def _a(x):
    """An mx array of x (host arrays are uploaded; float64 becomes float32)."""
    return XP.asarray(x)


def _metal():
    """The Metal kernels where they can run (Apple with a Metal device), else None."""
    from . import metal
    return metal if metal.available() else None


class MlxOps(Ds4RefOps):
    name = "mlx"
    xp = XP
    # a thread that ran MLX work should live as long as the process: MLX 0.32 can abort the process
    # when such a thread exits (its per-thread stream's teardown); long-lived workers park instead
    keep_threads = True

    def __init__(self, numerics: str = DS4):
        if numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {NUMERICS}, got {numerics!r}")
        self.numerics = numerics
        self._ds4 = numerics == DS4
        self._states = weakref.WeakSet()     # evaluated with every logits_to_host
        self._states_lock = threading.Lock()  # (sessions on several threads add to it)
        self._repacked: dict = {}            # id(QTensor) -> (QTensor, MxWeight): host weights met in a call
        # tensors bind_weights leaves on the map: the routed experts under --expert-cache (the
        # cache's slots are their arrays: expert_slots); set by Engine.open before the bind
        self.unbound: frozenset = frozenset()
        self._rot: dict = {}                 # id(thetas) -> (thetas, cos, sin): this pass's rotations
        self.metal = _metal()
        # ds4 numerics on the CPU device (no Metal): the reference's steps, float64 ones included
        # (ds4_ref.py); on a GPU the float32 forms below and the Metal kernels
        self._f64 = self._ds4 and self.metal is None and DD.cpu_float64()
        threads_kept()            # the console command ends through os._exit (engine/console.py)
        if self._ds4:   # as the reference: ds4's rmsnorm in ds4 numerics, the class's static form else
            self.rmsnorm = self.rmsnorm_f64 if self._f64 else self.rmsnorm_ds4
        if self._f64:
            self.use_reference_steps()

    # -- set-up and hand-offs --------------------------------------------------------------------
    def bind_weights(self, model_file):
        """Every matrix repacked into MLX memory (quant.repack), the small vectors uploaded."""
        t0 = time.perf_counter()
        weights, nbytes = bind_mlx(model_file, self.unbound)
        return weights, BindReport(time.perf_counter() - t0, nbytes)

    def new_state(self, config, ctx: int, rewind_cap: int) -> KVState:
        st = KVState(config, ctx, rewind_cap, xp=XP)
        # evaluated now: an unevaluated mx array belongs to the stream of the thread that made it,
        # and the shim makes its session on the main thread and runs it on its worker
        mx.eval(*_state_arrays(st))
        with self._states_lock:
            self._states.add(st)
        return st

    def state_to_host(self, state: KVState) -> KVState:
        arrays = _state_arrays(state)
        mx.eval(*arrays)
        return state.copy_to(np, lambda a: np.array(a, dtype=np.float32))

    def state_from_host(self, host: KVState) -> KVState:
        st = host.copy_to(XP, lambda a: mx.array(a))
        mx.eval(*_state_arrays(st))
        with self._states_lock:
            self._states.add(st)
        return st

    def embed(self, embd, tokens):
        """The rows of `tokens` (host int64 [T]), decoded: only those rows."""
        return take_rows(self._w(embd), _a(np.asarray(tokens)).astype(mx.int32))

    def logits_to_host(self, logits) -> np.ndarray:
        logits = _a(logits)
        # the token boundary: run the graph, and cut every state's history with it
        with self._states_lock:
            states = list(self._states)
        mx.eval(logits, *[a for st in states for a in _state_arrays(st)])
        self._rot.clear()
        return np.array(logits.astype(mx.float32), copy=False)

    # -- matmuls -------------------------------------------------------------------------------
    def _w(self, w):
        if isinstance(w, QTensor):
            hit = self._repacked.get(id(w))
            if hit is None or hit[0] is not w:
                hit = self._repacked[id(w)] = (w, quant.repack(w))
            return hit[1]
        return w

    def linear(self, w, x, rows=None):
        w, x = self._w(w), _a(x)
        if self._f64:
            return self.linear_ref(w, x, rows)
        if self._ds4 and w.type_id == Q.Q8_0:
            x = MN.q8_0_round(x)
        return quant.matmul(w, x, rows)

    def linears(self, ws, x):
        return [self.linear(w, x) for w in ws]

    def grouped_linear(self, w, x, groups):
        w, x = self._w(w), _a(x)
        gi, gr = x.shape[1] // groups, w.n_out // groups
        return mx.concatenate([self.linear(w, x[:, g * gi:(g + 1) * gi], rows=slice(g * gr, (g + 1) * gr))
                               for g in range(groups)], axis=1)

    # -- norms and elementwise -----------------------------------------------------------------
    @staticmethod
    def rmsnorm_ds4(x, w, eps):
        """numerics.rmsnorm_ds4 (ds4.c rms_norm_weight: float32 scale 1 / sqrt(ms + eps), then
        (x * w) * scale), with the mean of squares in float32: MLX has no float64."""
        x = _a(x)
        scale = 1.0 / mx.sqrt(mx.mean(mx.square(x), axis=-1, keepdims=True) + eps)
        return x * scale if w is None else (x * _a(w)) * scale

    @staticmethod
    def rmsnorm(x, w, eps):
        x = _a(x)
        ms = mx.mean(mx.square(x), axis=-1, keepdims=True)
        y = x * mx.rsqrt(ms + eps)
        return y if w is None else y * _a(w)

    @staticmethod
    def sigmoid(x):
        return mx.sigmoid(_a(x))

    @staticmethod
    def softplus(x):
        x = _a(x)
        # torch's threshold form: x above 20 is returned as is
        return mx.where(x > 20.0, x, mx.log1p(mx.exp(mx.minimum(x, 20.0))))

    @staticmethod
    def softmax(x, axis=-1):
        x = _a(x)
        m = mx.max(x, axis=axis, keepdims=True)
        m = mx.where(mx.isinf(m) | mx.isnan(m), 0.0, m)
        e = mx.exp(x - m)
        return e / mx.sum(e, axis=axis, keepdims=True)

    # -- KV-row numerics -----------------------------------------------------------------------
    def store_kv(self, rows, n_nope):
        rows = _a(rows)
        return MN.f16_round(MN.fp8_e4m3_roundtrip(rows, n_nope)) if self._ds4 else rows

    def index_qat(self, rows):
        rows = _a(rows)
        return MN.indexer_qat(rows) if self._ds4 else rows

    def store_index(self, rows):
        rows = _a(rows)
        return MN.f16_round(MN.indexer_qat(rows)) if self._ds4 else rows

    # -- RoPE ----------------------------------------------------------------------------------
    def rope_thetas(self, pos, n_rot, base, yarn, query: bool = False):
        """The angle tables are built on the host (a few KB; the exact float32 steps of the
        reference), with their cosines and sines, kept for this pass's rotations; `query`: a
        query rotation's angles (NumpyOps.rope_thetas_ds4: in ds4 numerics with YaRN, ds4's q RoPE
        call site compiles the blend with an FMA)."""
        if self._ds4:
            th = N.rope_thetas_ds4(np.asarray(pos), n_rot, base, yarn=yarn, fma_blend=query and yarn is not None)
        else:
            th = N.rope_thetas_exact(np.asarray(pos), n_rot, base, yarn=yarn)
        out = mx.array(th)
        self._keep_rot(out, th)
        return out

    def _keep_rot(self, key, th_host):
        libm = getattr(N, "libm_cos_sin", None) if self._ds4 else None
        if libm is not None:      # ds4 numerics: the C library's cosf / sinf, as the reference (rope_ds4)
            c, s = libm(th_host)
        else:
            t64 = np.asarray(th_host, np.float64)
            c, s = np.cos(t64).astype(np.float32), np.sin(t64).astype(np.float32)
        self._rot[id(key)] = (key, mx.array(c), mx.array(s))

    def rope(self, x, thetas, inverse=False, inplace=False):
        """Rotate the last 2 * thetas.shape[-1] dims of x in interleaved pairs (numerics.apply_rope)."""
        x = _a(x)
        hit = self._rot.get(id(thetas))
        if hit is None or hit[0] is not thetas:          # a view the glue made of a table: once a pass
            if not isinstance(thetas, mx.array):
                thetas = mx.array(np.asarray(thetas, np.float32))
            self._keep_rot(thetas, np.array(thetas))
            hit = self._rot[id(thetas)]
        _, c, s = hit
        return N.rotate_pairs(mx, x, c, s, inverse)

    # -- attention -----------------------------------------------------------------------------
    def attention(self, q, segments, sinks, scale):
        """Softmax attention with per-head sinks, K = V, over concatenated key segments (see the
        reference). A decode step on Apple runs the Metal kernel over the segments joined."""
        q, sinks = _a(q), _a(sinks)
        segments = [(_a(k), _a(m).astype(mx.bool_)) for k, m in segments]
        D = q.shape[-1]
        if self.metal is not None and q.shape[0] == 1 and D % 32 == 0 and D <= 512:      # (the kernel's tiling)
            keys = mx.concatenate([k.reshape(-1, k.shape[-1]) for k, _ in segments], axis=0)
            mask = mx.concatenate([m.reshape(1, -1) for _, m in segments], axis=1)
            return self.metal.attention(q, keys, mask, sinks, scale)
        return attention_twin(q, segments, sinks, scale)

    def indexer_scores(self, qi, keys, wts):
        """[T, C] = sum_h wts[t, h] * relu(qi[t, h] . keys[c]); queries in blocks so the
        [t, h, c] products stay under ~16M values."""
        qi, keys, wts = _a(qi), _a(keys), _a(wts)
        T, H, _ = qi.shape
        step = max(1, (1 << 24) // max(1, H * keys.shape[0]))
        kt = keys.T
        out = []
        for t0 in range(0, T, step):
            s = mx.maximum(qi[t0:t0 + step] @ kt, 0.0)                          # [t, H, C]
            out.append((wts[t0:t0 + step, None, :] @ s)[:, 0, :])               # [t, C]
        return out[0] if len(out) == 1 else mx.concatenate(out, axis=0)

    def topk_lowest_index(self, scores, k):
        """Indices of the k largest per row, ties to the lowest index: MLX's sort is stable on
        the CPU device (checked by the conformance suite); on Apple the Metal kernel."""
        scores = _a(scores)
        if self.metal is not None and k <= min(scores.shape[-1], self.metal.TOPK_MAX):
            return self.metal.topk(scores, k)
        return mx.argsort(-scores, axis=-1)[..., :k]

    # -- hyper-connections -------------------------------------------------------------------------
    def hc_split(self, mix, n, scale, base, eps, iters):
        mix, scale, base = _a(mix), _a(scale), _a(base)
        if self.metal is not None:
            return self.metal.hc_split(mix, n, scale, base, float(eps), iters)
        return _hc_split_compiled(n, float(eps), iters)(mix, scale, base)

    @staticmethod
    def hc_pre_mix(pre, X):
        pre, X = _a(pre), _a(X)
        return (pre[:, None, :] @ X)[:, 0, :]

    @staticmethod
    def hc_post(y, X, post, C):
        y, X, post, C = _a(y), _a(X), _a(post), _a(C)
        return post[:, :, None] * y[:, None, :] + mx.swapaxes(C, 1, 2) @ X

    # -- experts -------------------------------------------------------------------------------
    def _act(self, w, x):
        """ds4: the activation rounding of an expert matmul's input (identity in exact)."""
        if not self._ds4 or w.type_id in _DENSE:
            return x
        return MN.q8_0_round(x) if w.type_id in _EXPERT_ACT_Q8_0 else MN.q8_k_round(x)

    def _gmm(self, w, x, experts, toks):
        if self.metal is not None and w.kind in _METAL_KINDS:
            slots = getattr(w, "slot_rows", None)       # (the expert cache: its slots hold them)
            return self.metal.gather_matvec(w.kind, w.w, x, experts if slots is None else slots(experts), toks)
        return quant.gather_matmul(w, x, experts, toks, check_sorted=False)      # (moe sorts them)

    @staticmethod
    def _swiglu(g, v, limit):
        return _swiglu(g, v, mx.array(limit, dtype=mx.float32))

    @staticmethod
    def expert_slots(tensors):
        """The expert cache's slots as MLX arrays (expert_slots.py; engine/gguf/expert_cache.attach)."""
        from .expert_slots import MlxSlots
        return MlxSlots(tensors)

    def moe(self, lw, u, sel, wsel, limit):
        """The routed experts (tokens grouped by expert, one gathered matmul per matrix) plus the
        shared one."""
        u, sel, wsel, limit = _a(u), _a(sel), _a(wsel), float(limit)
        if self._f64:
            return self.moe_ref(lw, u, sel, wsel, limit)
        gate, up, down = self._w(lw.gate_exps), self._w(lw.up_exps), self._w(lw.down_exps)
        T, k = sel.shape
        # each token's experts in ascending order: its outputs are summed in that order below, as
        # the reference adds them (and never with a scatter-add, whose atomics on Metal would add
        # them in arrival order, a different sum from run to run)
        slot = mx.argsort(sel, axis=1)
        sel, wsel = mx.take_along_axis(sel, slot, axis=1), mx.take_along_axis(wsel, slot, axis=1)
        flat = sel.reshape(-1)
        order = mx.argsort(flat)                                   # pairs grouped by expert
        experts = flat[order].astype(mx.int32)
        toks = (order // k).astype(mx.int32)
        we = wsel.reshape(-1)[order][:, None]
        ua = self._act(gate, u)                                    # one rounding shared by all experts
        m = self._swiglu(self._gmm(gate, ua, experts, toks), self._gmm(up, ua, experts, toks), limit)
        pairs = mx.arange(m.shape[0], dtype=mx.int32)
        if self._ds4:    # ds4 weights the SwiGLU output before the down projection (and rounds it)
            d = self._gmm(down, self._act(down, m * we), experts, pairs)
        else:
            d = self._gmm(down, m, experts, pairs) * we
        d = d[mx.argsort(order)].reshape(T, k, -1)               # back to token-major
        routed = d[:, 0]
        for j in range(1, k):
            routed = routed + d[:, j]
        sh = self._swiglu(*self.linears([lw.sh_gate, lw.sh_up], u), limit)
        return routed + self.linear(lw.sh_down, sh)


@mx.compile
def _swiglu(g, v, limit):
    # compiled: one fused elementwise pass instead of five (values unchanged)
    g = mx.minimum(g, limit)
    v = mx.clip(v, -limit, limit)
    return g * mx.sigmoid(g) * v


@functools.lru_cache(maxsize=8)
def _hc_split_compiled(n: int, eps: float, iters: int):
    """hc_split_twin compiled for one (n, eps, iters): its ~120 small elementwise steps fuse
    (2.3x on a decode step's [1, 24] mix on the CPU device; the same values)."""
    return mx.compile(lambda mix, scale, base: hc_split_twin(mix, n, scale, base, eps, iters))


def _state_arrays(st: KVState) -> list:
    out = []
    for ls in st.layers:
        out += [r.rows for r in ls.rings()]
        if ls.ratio:
            out.append(ls.comp)
        if getattr(ls, "index", None) is not None:
            out.append(ls.index)
    return out


def attention_twin(q, segments, sinks, scale):
    """The MLX-ops form of attention (the reference's math in float32)."""
    scores = []
    for keys, mask in segments:
        s = (q @ keys.T if keys.ndim == 2 else q @ mx.swapaxes(keys, 1, 2)) * scale   # [T, H, K]
        scores.append(mx.where(mask[:, None, :], s, -mx.inf))
    s = mx.concatenate(scores, axis=-1)
    m = mx.maximum(mx.max(s, axis=-1), sinks[None, :])                              # [T, H]
    p = mx.exp(s - m[..., None])
    den = mx.sum(p, axis=-1) + mx.exp(sinks[None, :] - m)
    o, k0 = None, 0
    for keys, _ in segments:
        k1 = k0 + keys.shape[-2]
        part = p[..., k0:k1] @ keys                                                 # [T, H, D]
        o = part if o is None else o + part
        k0 = k1
    return o / den[..., None]


def hc_split_twin(mix, n, scale, base, eps, iters):
    """The MLX-ops form of the HC Sinkhorn split (the reference's steps, in float32)."""
    T = mix.shape[0]
    pre = mx.sigmoid(mix[:, :n] * scale[0] + base[:n]) + eps
    post = 2.0 * mx.sigmoid(mix[:, n:2 * n] * scale[1] + base[n:2 * n])
    logits = (mix[:, 2 * n:] * scale[2] + base[2 * n:]).reshape(T, n, n)
    C = mx.softmax(logits, axis=-1, precise=True) + eps
    C = C / (C.sum(axis=1, keepdims=True) + eps)                # columns first
    for _ in range(iters - 1):
        C = C / (C.sum(axis=2, keepdims=True) + eps)            # rows
        C = C / (C.sum(axis=1, keepdims=True) + eps)            # columns
    return pre, post, C
