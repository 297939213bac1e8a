"""The fast CPU backend: the NumPy reference's ops with every weight matmul on the C kernels
(engine/backends/cpu/kernels.py: fused decode-and-multiply straight from the map, multi-threaded).

The matmuls change, and a few float32 ops (FastOps; rmsnorm and the hyper-connection weights and
post mix in C). In ds4 mode the inputs ds4 quantizes (Q8_0 weights: Q8_0 blocks; the routed
experts' Q2_K / IQ2_XXS weights: Q8_K blocks) go to the integer kernels, which quantize them
exactly as engine/model/numerics.py does and take exact integer dot products (ds4's own arithmetic):
row kernels for a few tokens, the GEMM form for many (AVX-512 VNNI, AVX2; the portable build runs
its row kernels at every T). They sum the blocks in float64 and round once, which is the reference's
function (float64 over the exact activations code * scale): bit-identical to it but for ~2^-29 of
values (tests/test_kernels_q8_exact.py). The float kernels and attention sum in float64 and round
once too, as the reference does, so they give its float32 results bit for bit (tests/test_cpu_f64.py).
"""
from __future__ import annotations

import numpy as np

from . import ds4_ops as D4
from . import kernels as K
from ...gguf import quants as Q
from ...gguf.model_file import QTensor
from ...model import ds4_float as F
from ...model import numerics as N
from .fast import FastOps, _own
from ..numpy.ops import NumpyOps

#: queries per attention call where the C kernel runs it (the model's QUERY_BLOCK bounds the
#: reference's [T, H, keys] scores; the kernel's per-call memory is the masks, [T, keys] bytes)
QUERY_BLOCK_C = 2048

#: the most rows the few-rows expert path takes (a batched decode step's sessions); a prefill
#: chunk's experts take the general path
ROWS_MAX = 16
#: from this many rows on (a prefill chunk) the experts take _experts_rows' stacked form too: every
#: (row, expert) pair's products in the rows of one buffer, a few NumPy calls a layer instead of
#: several per expert (a gather, a scatter-add and two copies each); between ROWS_MAX and this
#: (none unless a test moves ROWS_MAX) the expert-by-expert form, which stays the definition
STACK_MIN = ROWS_MAX + 1
#: rows of a chunk's expert sums at a time (the k terms of 16 rows: 256 KB a term at width 4096)
SUM_ROWS = 16

_KERNEL_TYPES = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q2_K, Q.Q4_K, Q.IQ2_XXS, Q.MXFP4})


def _rmsnorm_c(x, w, eps, *mode):
    """The extension's rmsnorm over x's last axis (mode: its trailing flags; (0, 1) is ds4's form)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    shape = x.shape
    x2 = x if x.ndim == 2 else x.reshape(-1, shape[-1])
    out = np.empty(x2.shape, np.float32)
    if x2.size:
        K._K.rmsnorm(x2, None if w is None else _norm_row(w), float(eps), out, *mode)
    return out if x.ndim == 2 else out.reshape(shape)


class CpuOps(FastOps, NumpyOps):
    name = "cpu"

    def __init__(self, numerics: str = N.DS4, q8_dot: str = "ds4"):
        super().__init__(numerics, q8_dot)
        if self._ds4 and D4.available():
            # ds4 numerics: the reference's forms of ds4's float32 loops (NumpyOps installs them as
            # instance attributes), in C (ds4_ops.py): the HC sums and post, the head's collapse,
            # RoPE on the C kernel with the C library's cosf / sinf (tables this backend owns)
            self.hc_pre_mix, self.hc_post, self.hc_head = D4.hc_sum4, D4.hc_post, D4.hc_head
            self.rope, self.rope_thetas = self._rope_libm, self._rope_thetas_owned

    def _mm(self, w: QTensor, x: np.ndarray, rows: slice | None = None) -> np.ndarray:
        data = w.data if rows is None else w.data[rows]
        if w.type_id not in _KERNEL_TYPES:
            return Q.matvec(w.type_id, data, np.asarray(x, np.float32).T, accumulate=np.float64).T
        x = np.ascontiguousarray(x, dtype=np.float32)
        squeeze = x.ndim == 1
        if K._K is not None and K.BLAS_MIN_T is None and x.ndim == 2:
            # K.matmul's "auto" path without its Python checks of w and x (a dozen calls, ~20
            # products a decode step): the extension checks both again (ValueError naming them)
            y = np.empty((x.shape[0], data.shape[0]), dtype=np.float32)
            K._K.matmul(w.type_id, data, x, y, 0, 0)
            return y
        # F32 / F16 / BF16 sum in float64 and round once on every path, as the reference. A quant
        # format reaches here in ds4 numerics only without an integer kernel (Q4_K, MXFP4 experts),
        # over activations rounded to float32, which the reference no longer uses (it takes them
        # exact): its T = 1 kernel stays the factored float32 one ("f64" would cost 2.9-3.4x from
        # cache there and still not give the reference's function)
        y = K.matmul(w.type_id, data, x[None] if squeeze else x)
        return y[0] if squeeze else y

    def _int_path(self, type_id: int, T: int) -> bool:
        """ds4 numerics and an integer kernel for the weight type, at every T (row kernels for a
        few tokens, the GEMM form for many where the build has one): the float kernels over the
        rounded activations would compute another function (float32 products of fl(q * d) and
        float32 sums), even where they are faster (builds without a GEMM form, 9+ tokens)."""
        return self._ds4 and type_id in _q8_types()

    def _mm_act(self, w: QTensor, x: np.ndarray, rows: slice | None = None) -> np.ndarray:
        """ds4 mode, a weight whose input ds4 quantizes (Q8_0 / Q8_K): the integer kernels (x
        quantized inside, exact integer dots, float64 block sums); without a kernel for the
        type (or the extension), the reference rounding and the float kernels."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        squeeze = x.ndim == 1
        x2 = x[None] if squeeze else x
        if self._int_path(w.type_id, x2.shape[0]):
            data = w.data if rows is None else w.data[rows]
            y = np.empty((x2.shape[0], data.shape[0]), dtype=np.float32)
            K.matmul_q8_into([w.type_id], [data], [x2], [y])
            return y[0] if squeeze else y
        y = self._mm(w, K.round_q8(x2, K.Q8_ACT_BLOCK[w.type_id]), rows)   # Q8_0: q8_0, experts: q8_k
        return y[0] if squeeze else y

    @staticmethod
    def rmsnorm(x, w, eps):
        # in C: float64 sums like the reference (so nearly always bit-identical to it), no
        # float64 copy of x, both threads; the NumPy form's fixed cost a call adds up at decode (30 a
        # token), and so did kernels.rmsnorm's conversions: the weight's [1, n] row is kept (_norm_row)
        if K._K is None:
            return FastOps.rmsnorm(x, w, eps)
        return _rmsnorm_c(x, w, eps)

    @staticmethod
    def rmsnorm_ds4(x, w, eps):
        """ds4 numerics' rmsnorm (numerics.rmsnorm_ds4) in C, bit for bit with the reference."""
        if K._K is None:
            return N.rmsnorm_ds4(x, w, eps)
        return _rmsnorm_c(x, w, eps, 0, 1)

    #: segments (keys [N, D], mask, idx [T, k]) are read in place by the C kernel (a pointer per
    #: attended key): the model hands the indexer's picks over without a [block, k, D] gather
    attention_index = True

    @property
    def query_block(self) -> int | None:
        # the C kernel keeps no [T, H, keys] scores (a query's keys are a pointer list), so a whole
        # prefill chunk goes in one call and its output needs no concatenation; the reference's
        # float64 form (portable build) keeps the model's blocks (None)
        return QUERY_BLOCK_C if K._K is not None and K._K.has_attention() else None

    @staticmethod
    def attention(q, segments, sinks, scale):
        # in C (per query and up to 16 heads, register tiles, units over the threads): a decode step's
        # attention beats FastOps' (one query: 64-head BLAS calls on one thread); a prefill block about
        # as fast as FastOps' threaded queries. A query's result depends on its keys alone. Where the
        # build has no attention kernel (the portable one), the reference's own float64 form: FastOps'
        # float32 sums would differ from it by an ulp now and then, and the passes would drift
        got = _attention_c(q, segments, sinks, scale)
        return got if got is not None else NumpyOps.attention(q, segments, sinks, scale)

    def attention_ds4(self, q, segments, sinks, scale):
        """ds4 numerics' attention (ds4_float.attention, head dim 128) in C; other widths and
        builds without the extension: the reference's (NumpyOps.attention_ds4)."""
        got = _attention_c(q, segments, sinks, scale, ds4=True) if q.shape[-1] == 128 and D4.available() else None
        return got if got is not None else NumpyOps.attention_ds4(self, q, segments, sinks, scale)

    @staticmethod
    def _rope_libm(x, thetas, inverse=False, inplace=False):
        """ds4 numerics' RoPE (NumpyOps.rope_ds4): the C kernel with cosf / sinf tables."""
        return FastOps.rope(x, thetas, inverse, inplace, libm=True)

    def _rope_thetas_owned(self, pos, n_rot, base, yarn, query=False):
        """NumpyOps.rope_thetas_ds4's angles as a table this backend owns (its rotations are kept)."""
        return _own(NumpyOps.rope_thetas_ds4(pos, n_rot, base, yarn, query))

    def swiglu(self, g, v, limit):
        if self._ds4:     # ds4.c swiglu as compiled (ds4_float.swiglu), in C where built
            return D4.swiglu(g, v, limit) if D4.available() else NumpyOps.swiglu(self, g, v, limit)
        return FastOps.swiglu(g, v, limit)

    def store_kv(self, rows, n_nope):
        # in C, bit-identical to numerics' FP8 + F16 emulation (~15 NumPy calls a cached row,
        # four times a token at decode)
        if not self._ds4:
            return rows
        got = K.store_kv(rows, n_nope)
        return got if got is not None else super().store_kv(rows, n_nope)

    @staticmethod
    def hc_post(y, X, post, C):
        # in C with the reference's float64 sums: FastOps' form is a batched 4 x 5 x 4096 float32
        # matmul per token at prefill, this one pass over X
        # (kernels.hc_post's work, without its copies of arrays that are right already: a decode
        # step's operands are fresh C-contiguous float32 arrays, and the extension checks them)
        ext = K._K
        if ext is None:
            return FastOps.hc_post(y, X, post, C)
        X = np.ascontiguousarray(X, dtype=np.float32)
        T, n, E = X.shape
        out = np.empty((T, n, E), np.float32)
        c32 = np.ascontiguousarray
        ext.hc_post(c32(y, dtype=np.float32).reshape(T, E), X.reshape(T * n, E),
                    c32(post, dtype=np.float32).reshape(T, n), c32(C, dtype=np.float32).reshape(T, n * n),
                    out.reshape(T * n, E))
        return out

    @staticmethod
    def hc_pre_mix(pre, X):
        # in C with the reference's float64 sums (bit-identical to it): the C pre mix avoids
        # BLAS set-up for a 1 x 4 x 4096 product, 9 calls a token
        ext = K._K
        if ext is None:
            return FastOps.hc_pre_mix(pre, X)
        X = np.ascontiguousarray(X, dtype=np.float32)
        T, n, E = X.shape
        out = np.empty((T, E), np.float32)
        ext.hc_pre_mix(np.ascontiguousarray(pre, dtype=np.float32).reshape(T, n), X.reshape(T * n, E), out)
        return out

    def hc_split(self, mix, n, scale, base, eps, iters):
        # in C: at decode the NumPy form is ~90 calls on 4 x 4 arrays, twice a layer
        # (kernels.hc_split's work with the scale and base rows made once a weight: _hc_rows)
        ext = K._K
        if self._ds4:    # ds4 numerics: ds4's compiled split (model/ds4_float.py), in C for 4 streams
            if n != 4 or not D4.available():
                return NumpyOps.hc_split(self, mix, n, scale, base, eps, iters)
            return D4.hc_split(mix, *_hc_rows(self, scale, base), eps, iters)
        if ext is None:
            return NumpyOps.hc_split(self, mix, n, scale, base, eps, iters)
        mix = np.ascontiguousarray(mix, dtype=np.float32)
        T = mix.shape[0]
        s_row, b_row = _hc_rows(self, scale, base)
        pre, post = np.empty((T, n), np.float32), np.empty((T, n), np.float32)
        c = np.empty((T, n, n), np.float32)
        ext.hc_split(mix, int(n), s_row, b_row, float(eps), int(iters), pre, post, c.reshape(T, n * n),
                     np.empty((T, 2 * n + n * n), np.float32), np.exp)
        return pre, post, c

    def linear(self, w: QTensor, x: np.ndarray, rows: slice | None = None) -> np.ndarray:
        if self._ds4 and w.type_id == Q.Q8_0:
            return self._mm_act(w, x, rows)
        if self._ds4 and w.type_id == Q.F16:  # ds4's matvec_f16: float32 sums in index order (the reference's)
            return K.matmul_f16_seq(w.data if rows is None else w.data[rows], x)
        return self._mm(w, x, rows)

    def linears(self, ws: list, x: np.ndarray) -> list:
        # ds4 mode, few tokens, Q8_0 weights: one batched integer-kernel call for all of them
        if not (all(w.type_id == Q.Q8_0 for w in ws) and self._int_path(Q.Q8_0, x.shape[0])):
            return super().linears(ws, x)
        x = np.ascontiguousarray(x, dtype=np.float32)
        ys = [np.empty((x.shape[0], w.data.shape[0]), dtype=np.float32) for w in ws]
        K.matmul_q8_into([Q.Q8_0] * len(ws), [w.data for w in ws], [x] * len(ws), ys)
        return ys

    def grouped_linear(self, w: QTensor, x: np.ndarray, groups: int) -> np.ndarray:
        # ds4 mode, few tokens: all groups in one batched integer-kernel call (one parallel region
        # instead of one per group)
        if not (w.type_id == Q.Q8_0 and self._int_path(Q.Q8_0, x.shape[0])):
            return super().grouped_linear(w, x, groups)
        gi, gr = x.shape[1] // groups, w.data.shape[0] // groups
        x = np.asarray(x, dtype=np.float32)
        ws = [w.data[g * gr:(g + 1) * gr] for g in range(groups)]
        xs = [np.ascontiguousarray(x[:, g * gi:(g + 1) * gi]) for g in range(groups)]
        if x.shape[0] == 1:                   # one token: the groups' outputs are slices of one row
            y = np.empty((1, groups * gr), dtype=np.float32)
            K.matmul_q8_into([w.type_id] * groups, ws, xs, [y[:, g * gr:(g + 1) * gr] for g in range(groups)])
            return y
        return np.concatenate(K.matmul_q8_batch(w.type_id, ws, xs), axis=1)

    def expert_act(self, w: QTensor, x: np.ndarray) -> np.ndarray:
        # the rounding of weights with an integer kernel is done by expert_linear (per expert,
        # on its own rows: rounding is per token, so that is the same rounding)
        if self._ds4 and w.type_id == Q.Q4_K and w.type_id not in K.Q8_ACT_BLOCK:
            # the reference's Q4_K dot is the q4 oracles' block form in NumPy (ds4_matmul); the
            # cpu kernels keep the exact activation and the exact sum (the rule before issue 33)
            return N.q8_k_exact(x)
        return x if self._ds4 and w.type_id in K.Q8_ACT_BLOCK else super().expert_act(w, x)

    def expert_linear(self, w: QTensor, x_act: np.ndarray) -> np.ndarray:
        if self._ds4 and w.type_id in K.Q8_ACT_BLOCK:
            return self._mm_act(w, x_act)
        return self._mm(w, x_act)

    def _batched_experts(self, lw) -> bool:
        ge, ue, de = lw.gate_exps, lw.up_exps, lw.down_exps
        return self._ds4 and ge.type_id == ue.type_id and K.has_q8(ge.type_id) and K.has_q8(de.type_id)

    def routed(self, lw, u, sel, wsel, limit):
        """ds4 mode with integer kernels for the expert weights: every expert, run as two batched
        calls, gate+up of all of them, then down of all of them, each one parallel region (one
        fork/join for a layer's experts; the integer kernels compute the reference's function at
        every token count, the float panel kernels would not)."""
        if not self._batched_experts(lw):
            return super().routed(lw, u, sel, wsel, limit)
        return self._experts(lw, u, sel, wsel, limit, shared=False)

    def moe(self, lw, u, sel, wsel, limit):
        """routed + shared expert; where the shared expert's Q8_0 matrices take the integer kernels
        too, they join the routed experts' two batched calls (one parallel region per stage: the
        threads stream the memory-bound shared matrices while decoding the compute-bound experts,
        and a decode step has two fork/joins fewer per layer)."""
        sh = (lw.sh_gate, lw.sh_up, lw.sh_down)
        if not (self._batched_experts(lw) and all(w.type_id == Q.Q8_0 for w in sh)
                and self._int_path(Q.Q8_0, u.shape[0])):
            return super().moe(lw, u, sel, wsel, limit)
        return self._experts(lw, u, sel, wsel, limit, shared=True)

    def _experts(self, lw, u, sel, wsel, limit, shared: bool):
        """routed (and with `shared` the shared expert too) as two mixed-type batched calls:
        gate+up of every batched expert, then down of all of them; the shared expert's matrices
        go first in each call."""
        ge, ue, de = lw.gate_exps, lw.up_exps, lw.down_exps
        u = np.ascontiguousarray(u, dtype=np.float32)
        if u.shape[0] == 1 and len(set(sel[0].tolist())) == sel.shape[1]:
            got = self._experts_one(lw, u, sel, wsel, limit, shared)
            if got is not None:
                return got
        elif (u.shape[0] <= ROWS_MAX or u.shape[0] >= STACK_MIN) and \
                (np.diff(np.sort(sel, axis=1), axis=1) != 0).all():
            got = self._experts_rows(lw, u, sel, wsel, limit, shared)
            if got is not None:
                return got
        out = np.zeros_like(u)
        picked = []
        for e in np.unique(sel):
            rows, slot = np.nonzero(sel == e)
            picked.append((int(e), rows, slot))
        gate_up = [(w.type_id, w.data, u) for w in (lw.sh_gate, lw.sh_up)] if shared else []
        for e, rows, _ in picked:
            x = u[rows]
            gate_up += [(ge.type_id, ge.expert_data(e), x), (ue.type_id, ue.expert_data(e), x)]
        if not gate_up:
            return out
        gv = K.matmul_q8_mixed(*zip(*gate_up))
        down = []
        if shared:
            down.append((lw.sh_down.type_id, lw.sh_down.data, self.swiglu(gv[0], gv[1], limit)))
            gv = gv[2:]
        if picked:
            # ds4's weighted SwiGLU (routed_mid) for all batched experts at once (rows stacked)
            m = _routed_mid(np.concatenate(gv[0::2]), np.concatenate(gv[1::2]), limit,
                            np.concatenate([wsel[rows, slot] for _, rows, slot in picked]))
            cuts = np.cumsum([len(rows) for _, rows, _ in picked])[:-1]
            down += [(de.type_id, de.expert_data(e), np.ascontiguousarray(p))
                     for (e, _, _), p in zip(picked, np.split(m, cuts))]
        ds = K.matmul_q8_mixed(*zip(*down))
        if shared:
            y_sh, ds = ds[0], ds[1:]
        # each row's experts added in slot order, as ds4 (NumpyOps.routed)
        ys = np.zeros((u.shape[0], sel.shape[1], u.shape[1]), dtype=np.float32)
        for (_, rows, slot), d in zip(picked, ds):
            ys[rows, slot] = d
        out = np.add.accumulate(ys, axis=1, dtype=np.float32)[:, -1] if picked else out
        return out + y_sh if shared else out

    def _experts_rows(self, lw, u, sel, wsel, limit, shared: bool):
        """_experts for a few rows (a batched decode step: B sessions, k experts each), bit for
        bit: the same products (an expert picked by several rows takes them as one product), the
        same SwiGLU, routing weights and each row's sum in ascending expert order, with NumPy calls
        a step rather than a few per expert (between kernel calls that stream the weights every
        NumPy call runs from DRAM). A row picked by one expert goes in as a view of u, so the
        products of one row share one quantization (the kernels quantize an input once a call);
        outputs land in the rows of one buffer, the shared expert's B rows first. None where the
        shared expert's width differs from the routed experts' (the general path handles it)."""
        ge, ue, de = lw.gate_exps, lw.up_exps, lw.down_exps
        n_ff, n_out = ge.dims[1], de.dims[1]
        sh = (lw.sh_gate, lw.sh_up, lw.sh_down) if shared else ()
        if sh and (sh[0].data.shape[0] != n_ff or sh[2].data.shape[0] != n_out):
            return None
        B, k = sel.shape
        flat = sel.reshape(-1)
        order = np.argsort(flat, kind="stable")          # pairs by expert, then row (as np.nonzero)
        es, rows = flat[order], order // k
        cuts = np.flatnonzero(np.diff(es)) + 1
        spans = list(zip([0] + cuts.tolist(), cuts.tolist() + [len(es)]))
        h = B if shared else 0
        # many rows: every pair's row gathered once, in pair order (an expert's rows are a slice)
        U = u[rows] if B > ROWS_MAX else None
        G = np.empty((h + len(es), n_ff), dtype=np.float32)
        V = np.empty_like(G)
        gt, gw, gx, gy = [w.type_id for w in sh[:2]], [w.data for w in sh[:2]], [u] * len(sh[:2]), []
        if shared:
            gy += [G[:h], V[:h]]
        experts = []
        for a, b in spans:
            e = int(es[a])
            r = int(rows[a])
            x = u[r:r + 1] if b - a == 1 else U[a:b] if U is not None else np.ascontiguousarray(u[rows[a:b]])
            experts.append(e)
            gt += (ge.type_id, ue.type_id)
            gw += (ge.expert_data(e), ue.expert_data(e))
            gx += (x, x)
            gy += (G[h + a:h + b], V[h + a:h + b])
        K.matmul_q8_into(gt, gw, gx, gy)
        m = _routed_mid(G, V, limit, wsel.reshape(-1)[order], h, out=G)
        D = np.empty((h + len(es), n_out), dtype=np.float32)
        K.matmul_q8_into([w.type_id for w in sh[2:]] + [de.type_id] * len(spans),
                         [w.data for w in sh[2:]] + [de.expert_data(e) for e in experts],
                         ([m[:h]] if shared else []) + [m[h + a:h + b] for a, b in spans],
                         ([D[:h]] if shared else []) + [D[h + a:h + b] for a, b in spans])
        # row i's pairs in slot order (ds4's sum, NumpyOps.routed): their places in the sorted pairs
        at = np.empty(len(es), dtype=np.int64)
        at[order] = np.arange(len(es))
        at = at.reshape(B, k) + h
        out = np.zeros_like(u)
        if B > ROWS_MAX:
            # SUM_ROWS rows at a time, each row's k terms and then its shared-expert row added
            # while in the cache (the same additions in the same order as below)
            d = np.empty((min(SUM_ROWS, B), u.shape[1]), dtype=np.float32)
            for r0 in range(0, B, SUM_ROWS):
                o, a = out[r0:r0 + SUM_ROWS], at[r0:r0 + SUM_ROWS]
                for j in range(k):
                    o += np.take(D, a[:, j], axis=0, out=d[:len(o)])
                if shared:
                    o += D[r0:r0 + len(o)]
            return out
        for j in range(k):                                # slot by slot
            out += D[at[:, j]]
        return out + D[:h] if shared else out

    def _experts_one(self, lw, u, sel, wsel, limit, shared: bool):
        """_experts for one token (decode), bit for bit: the same products, SwiGLU, routing weights
        and sums in the same order, with a few NumPy calls instead of a few per expert. Between
        two kernel calls that streamed the weights through the caches every NumPy call runs from
        DRAM (several times its warm time), so at decode per-expert bookkeeping is not cheap.
        The gate/up products land in the rows of one buffer pair and the SwiGLU runs once on all
        of them (elementwise: the same values as separate calls); None where the shared expert's
        width differs from the routed experts' (the general path handles it)."""
        ge, ue, de = lw.gate_exps, lw.up_exps, lw.down_exps
        n_ff, n_out = ge.dims[1], de.dims[1]
        sh = (lw.sh_gate, lw.sh_up, lw.sh_down) if shared else ()
        if sh and (sh[0].data.shape[0] != n_ff or sh[2].data.shape[0] != n_out):
            return None
        order = np.argsort(sel[0], kind="stable")            # ascending expert ids, as np.unique
        experts = sel[0][order].tolist()
        h = 1 if shared else 0
        k = h + len(experts)
        ev = _expert_views(self, lw, experts)
        gu_t = [w.type_id for w in sh[:2]]
        gu_w = [w.data for w in sh[:2]]
        for v in ev:
            gu_t += (ge.type_id, ue.type_id)
            gu_w += v[:2]
        # the one-token forms of the batch: u is every product's input (quantized once a format),
        # product i's output is row i of GV (gate, up, gate, up, ...): no row views to build. (The
        # gates' rows first, then the ups', gives contiguous halves, but the kernel's threads split
        # the products in batch order, and with that order decode measured no faster in ds4-bench.)
        GV = np.empty((2 * k, n_ff), dtype=np.float32)
        K.matmul_q8_into(gu_t, gu_w, u, GV)
        m = _routed_mid(GV[0::2], GV[1::2], limit, wsel[0][order], h)
        D = np.empty((k, n_out), dtype=np.float32)
        K.matmul_q8_into([w.type_id for w in sh[2:]] + [de.type_id] * len(experts),
                         [w.data for w in sh[2:]] + [v[2] for v in ev], m, D)
        # slot by slot, as ds4 (NumpyOps.routed): slot j's product is row h + (its place in order)
        out = np.add.reduce(D[h + np.argsort(order)], axis=0, keepdims=True)
        return out + D[:1] if shared else out


_Q8_TYPES: frozenset | None = None


def _q8_types() -> frozenset:
    """The weight types with an integer kernel in this build (K.has_q8 of each, asked once: the
    decode step asked ~30 times)."""
    global _Q8_TYPES
    if _Q8_TYPES is None:
        _Q8_TYPES = frozenset(t for t in K.Q8_ACT_BLOCK if K.has_q8(t))
    return _Q8_TYPES


def _hc_rows(ops, scale, base):
    """The [1, 3] scale and [1, w] base rows kernels.hc_split hands the extension, made once per
    pair of weights and kept by the ops object (one an engine), the weights held (ids not reused)."""
    kept = ops.__dict__.setdefault("_hc_rows", {})
    got = kept.get((id(scale), id(base)))
    if got is not None and got[0] is scale and got[1] is base:
        return got[2]
    rows = (np.ascontiguousarray(np.ascontiguousarray(scale, dtype=np.float32).reshape(1, -1)[:, :3]),
            np.ascontiguousarray(base, dtype=np.float32).reshape(1, -1))
    if isinstance(scale, np.ndarray) and isinstance(base, np.ndarray) and \
            np.shares_memory(rows[0], scale) and np.shares_memory(rows[1], base):
        kept[(id(scale), id(base))] = (scale, base, rows)     # views: the rows are the weights' values
    return rows


def _norm_row(w):
    """w as the [1, n] float32 row the extension takes (a view where w is one already)."""
    if type(w) is np.ndarray and w.dtype == np.float32 and w.flags.c_contiguous:
        return w.reshape(1, -1)
    return np.ascontiguousarray(w, dtype=np.float32).reshape(1, -1)


def _expert_views(ops, lw, experts) -> list:
    """(gate, up, down) map views of each of these routed experts of layer lw, each view made once
    (a decode step asked expert_data 18-24 times a layer). Kept by the ops object (one an engine:
    the views go with it), by the layer's id with the layer held (the id is not reused)."""
    if getattr(lw.gate_exps, "streamed", False):
        # experts in the expert cache's slots (engine/gguf/expert_cache.py): a slot holds
        # another expert after eviction, so its views are asked for each call, never kept
        return [(lw.gate_exps.expert_data(e), lw.up_exps.expert_data(e), lw.down_exps.expert_data(e))
                for e in experts]
    kept = ops.__dict__.setdefault("_expert_views", {})
    got = kept.get(id(lw))
    if got is None or got[0] is not lw:
        got = kept[id(lw)] = (lw, {})
    cache, out = got[1], []
    for e in experts:
        v = cache.get(e)
        if v is None:
            v = cache[e] = (lw.gate_exps.expert_data(e), lw.up_exps.expert_data(e), lw.down_exps.expert_data(e))
        out.append(v)
    return out


def _routed_mid(g, v, limit, w, w0: int = 0, out=None) -> np.ndarray:
    """ds4 numerics' SwiGLU of stacked expert rows: the shared expert's form (ds4_float.swiglu) on
    rows < w0, the routed experts' weighted one (ds4_float.routed_mid) with routing weight
    w[r - w0] on the rest; in C where built (out may be g), else the reference's forms."""
    if D4.available():
        return D4.swiglu(g, v, limit, w, w0, out)
    w = np.asarray(w, dtype=np.float32)[:, None]
    return np.concatenate([F.swiglu(g[:w0], v[:w0], limit), F.routed_mid(g[w0:], v[w0:], w, limit)])


def _attention_c(q, segments, sinks, scale, ds4: bool = False):
    """kernels.attention with (keys, mask, idx) segments too (the kernel reads row idx[t, k] of
    keys for query t's key k); None without the kernel. ds4: ds4 numerics' float32 form (head dim
    128, ops_ds4.c; scale rounded to float32 as ds4's kq_scale)."""
    if K._K is None or not (ds4 or K._K.has_attention()):
        return None
    q = np.asarray(q, dtype=np.float32)
    T, H, D = q.shape
    segs = []
    for seg in segments:
        keys, mask = seg[0], np.ascontiguousarray(seg[1], dtype=bool)
        if mask.shape[1] == 0:
            continue                            # no rows yet (e.g. compressed rows before the first)
        keys = np.ascontiguousarray(keys, dtype=np.float32)
        if len(seg) > 2:
            segs.append((keys, mask.view(np.uint8), False, np.ascontiguousarray(seg[2], dtype=np.int64)))
        else:
            segs.append((keys.reshape(-1, D), mask.view(np.uint8), keys.ndim == 3))
    out = np.empty((T, H, D), np.float32)
    K._K.attention(np.ascontiguousarray(q).reshape(T * H, D), np.ascontiguousarray(sinks, dtype=np.float32).reshape(1, H),
                   out.reshape(T * H, D), segs, float(scale), 0, ds4)
    return out


def available() -> bool:
    return K.available()
