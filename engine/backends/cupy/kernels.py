"""The CUDA kernels of cuda_kernels/*.cu, loaded with RawModule and launched with the grids and
argument types cuda_kernels/README.md documents (real CuPy and the host emulation alike).

Every module is built at open (`load`; a source that does not compile fails the open) and kept
for the process. A kernel that is missing (not in the sources, or its module absent) is simply not there:
the op keeps its array-op form (ops.py). DS4_CUDA_KERNELS=0 turns every kernel off (the array-op
forms only: how the tests hold both paths to the reference).
"""
from __future__ import annotations

import os
import threading

import numpy as np

from .quant import DevTensor

_I32, _F32 = np.int32, np.float32
BLOCK = (128, 1, 1)
ROWS_PER_BLOCK = 4            # matvec: one warp per output row, 4 rows a block
GEMM_ROWS, GEMM_TILE_PAIRS = 64, 16
TOPK_MAX = 1024
DS4_DOT_BLOCK = {"q8_0": 32, "iq2_xxs": 256, "q2_k": 256}    # ds4's integer dots: activation block
MMA_MIN_CC = 80               # ds4_gemm_* (int8 mma.sync m16n8k32) needs sm_80
MMA_TILE_PAIRS = 32           # ds4_gemm_*: pairs a chunk (its tile: 64 rows x 32 pairs)
# which file holds a kernel, by name prefix (cuda_kernels/README.md)
FILES = (("matvec_", "matvec.cu"), ("dequant_rows_", "matvec.cu"), ("gemm_experts_", "gemm.cu"),
         ("ds4_matvec_", "ds4_dot.cu"), ("ds4_gemm_", "ds4_mma.cu"), ("q8_", "quantize.cu"),
         ("kv_store_ds4", "kv.cu"), ("compress_pool", "compress.cu"),
         ("attn_", "attention.cu"), ("rmsnorm", "norm_rope.cu"), ("rope", "norm_rope.cu"),
         ("hc_split", "hc_topk.cu"), ("topk", "hc_topk.cu"), ("indexer_scores", "hc_topk.cu"))
_MODULES: dict = {}           # (id(xp), file) -> module or None: built once a process
_LOCK = threading.Lock()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def load(xp):
    """The kernels for namespace `xp`, or None where they are off (DS4_CUDA_KERNELS=0) or the
    sources are not installed."""
    if os.environ.get("DS4_CUDA_KERNELS", "").strip() == "0":
        return None
    from ..kernel_sources import kernel_dir
    k = Kernels(xp, kernel_dir("cuda_kernels"))
    for file in sorted({f for _, f in FILES}):      # built at open: a source that does not
        k._module(file)                              # compile is an error there, not mid-pass
    return k


def batch_plan(experts: np.ndarray, tile_pairs: int = GEMM_TILE_PAIRS) -> tuple[np.ndarray, np.ndarray]:
    """The prefill GEMM's schedule: perm (pair indices sorted by expert, stable) and chunks
    [n, 2] = (start in perm, count <= tile_pairs), each chunk of one expert."""
    experts = np.asarray(experts).reshape(-1)
    perm = np.argsort(experts, kind="stable").astype(np.int32)
    e = experts[perm]
    starts = np.flatnonzero(np.r_[True, e[1:] != e[:-1]]) if len(perm) else np.zeros(0, int)
    ends = np.r_[starts[1:], len(perm)]
    chunks = [(s, min(tile_pairs, b - s)) for s0, b in zip(starts, ends) for s in range(s0, b, tile_pairs)]
    return perm, np.array(chunks, dtype=np.int32).reshape(-1, 2)


class Kernels:
    def __init__(self, xp, src):
        """src: the folder of the .cu sources (kernel_sources.kernel_dir("cuda_kernels"))."""
        self.xp, self.src = xp, src
        self._fns: dict = {}
        self.launches: dict = {}          # name -> count (tests: which kernels a pass ran)
        # the tensor-core GEMM where the device has int8 mma (the emulation runs it as sm_90)
        self.mma = int(xp.cuda.Device().compute_capability) >= MMA_MIN_CC

    # -- loading -----------------------------------------------------------------------------
    def _module(self, file: str):
        key = (id(self.xp), file)
        with _LOCK:
            if key not in _MODULES:
                _MODULES[key] = self._build(file)
            return _MODULES[key]

    def _build(self, file: str):
        f = self.src.joinpath(file)
        if not f.is_file():
            return None
        if getattr(self.xp.cuda, "emulated", False):          # the stand-in: emu.load_module
            return self.xp.RawModule(path=str(f))
        # NVRTC: includes relative to the sources' folder (common.cuh), C++17; compiled now (CuPy
        # compiles lazily at the first get_function, which would hide a build error in `has`)
        mod = self.xp.RawModule(code=f.read_text(), options=(f"-I{self.src}", "--std=c++17"))
        mod.compile()
        return mod

    def fn(self, name: str):
        if name not in self._fns:
            file = next((f for p, f in FILES if name.startswith(p)), None)
            mod = None if file is None else self._module(file)
            try:
                self._fns[name] = None if mod is None else mod.get_function(name)
            except Exception:                    # not in this module: the array-op form serves
                self._fns[name] = None
        return self._fns[name]

    def has(self, name: str) -> bool:
        return self.fn(name) is not None

    def _launch(self, name, grid, block, args):
        self.launches[name] = self.launches.get(name, 0) + 1
        self.fn(name)(tuple(int(g) for g in grid), block, tuple(args))

    def _c(self, a, dtype=None):
        return self.xp.ascontiguousarray(a if dtype is None else a.astype(dtype))

    # -- matvecs -----------------------------------------------------------------------------
    def has_dense(self, w: DevTensor) -> bool:
        return w.kind in ("q8_0", "f16") and w.n_in % 32 == 0 and self.has(f"matvec_dense_{w.kind}")

    def has_experts(self, w: DevTensor) -> bool:
        if w.kind is None or len(w.dims) != 3:
            return False
        blk = 256 if w.kind in ("iq2_xxs", "q2_k", "q4_k") else 32
        return w.n_in % blk == 0 and self.has(f"matvec_experts_{w.kind}")

    def has_dequant(self, w: DevTensor) -> bool:
        return w.kind is not None and self.has(f"dequant_rows_{w.kind}")

    def matvec_dense(self, w: DevTensor, x, rows=None):
        """x [T, n_in] float32 -> [T, n_sel] = x @ W[rows].T."""
        raw = self._c(w.data if rows is None else w.data[rows])
        x = self._c(x, self.xp.float32)
        T, n = x.shape[0], raw.shape[0]
        out = self.xp.empty((T, n), dtype=self.xp.float32)
        self._launch(f"matvec_dense_{w.kind}", (_cdiv(n, ROWS_PER_BLOCK), T, 1), BLOCK,
                     (raw, x, out, _I32(n), _I32(w.n_in), _I32(T)))
        return out

    def gemm_dense(self, w: DevTensor, x, rows=None, chunk_elems: int = 1 << 26):
        """x [T, n_in] float32 -> [T, n_sel] = x @ W[rows].T for a prefill chunk: a block of rows
        decoded by dequant_rows (bit for bit the reference's values), then a float32 GEMM."""
        xp = self.xp
        data = w.data if rows is None else w.data[rows]
        step = max(1, chunk_elems // max(1, w.n_in))
        x = self._c(x, xp.float32)
        outs = []
        for r0 in range(0, data.shape[0], step):
            part = DevTensor(w.name, w.type_id, w.dims, data[r0:r0 + step])
            wd = self.dequant_rows(part, xp.arange(part.data.shape[0], dtype=xp.int32))
            outs.append(x @ wd.T)
        return outs[0] if len(outs) == 1 else xp.concatenate(outs, axis=1)

    def experts(self, w: DevTensor, x, experts, toks):
        """out [P, n_out]: out[p] = dequant(expert experts[p]) @ x[toks[p]]: the decode matvec,
        or for a batch whose pairs share experts the grouped GEMM."""
        xp = self.xp
        raw, x = self._c(w.experts3()), self._c(x, xp.float32)
        experts, toks = self._c(experts, xp.int32), self._c(toks, xp.int32)
        P, n_out = experts.shape[0], w.dims[1]
        out = xp.empty((P, n_out), dtype=xp.float32)
        name = f"gemm_experts_{w.kind}"
        if P >= GEMM_TILE_PAIRS and self.has(name):
            e_h = xp.asnumpy(experts)
            if P >= 2 * len(np.unique(e_h)):             # pairs share experts: a tile serves several
                perm, chunks = batch_plan(e_h)
                self._launch(name, (_cdiv(n_out, GEMM_ROWS), len(chunks), 1), BLOCK,
                             (raw, x, experts, toks, xp.asarray(perm), xp.asarray(chunks), out,
                              _I32(n_out), _I32(w.n_in), _I32(len(chunks))))
                return out
        self._launch(f"matvec_experts_{w.kind}", (_cdiv(n_out, ROWS_PER_BLOCK), P, 1), BLOCK,
                     (raw, x, experts, toks, out, _I32(n_out), _I32(w.n_in), _I32(P)))
        return out

    # -- ds4's dot products (`ds4` numerics) ------------------------------------------------------
    def has_ds4(self, w: DevTensor) -> bool:
        """ds4's integer dot product serves w (Q8_0, IQ2_XXS, Q2_K, n_in whole blocks)."""
        blk = DS4_DOT_BLOCK.get(w.kind)
        return blk is not None and w.n_in % blk == 0 and self.has(f"ds4_matvec_{w.kind}")

    def ds4_experts(self, w: DevTensor, xq, xd, experts, toks, raw=None):
        """out [P, n_out] = ds4_matmul's product of expert experts[p] with token toks[p]'s Q8
        activation (xq int8 [T, n_in], xd float32 [T, n_in / block]): ds4_matvec_FMT, or where
        the pairs share experts (a prefill) the tensor-core ds4_gemm_FMT; bit for bit either way."""
        xp = self.xp
        raw = self._c(w.experts3() if raw is None else raw)
        xq, xd = self._c(xq, xp.int8), self._c(xd, xp.float32)
        experts, toks = self._c(experts, xp.int32), self._c(toks, xp.int32)
        P, n_out, n_in = experts.shape[0], raw.shape[1], xq.shape[1]
        out = xp.empty((P, n_out), dtype=xp.float32)
        name = f"ds4_gemm_{w.kind}"
        if P >= GEMM_TILE_PAIRS and self.mma and self.has(name):
            e_h = xp.asnumpy(experts)
            if P >= 2 * len(np.unique(e_h)):
                perm, chunks = batch_plan(e_h, MMA_TILE_PAIRS)
                self._launch(name, (_cdiv(n_out, GEMM_ROWS), len(chunks), 1), BLOCK,
                             (raw, xq, xd, experts, toks, xp.asarray(perm), xp.asarray(chunks), out,
                              _I32(n_out), _I32(n_in), _I32(len(chunks))))
                return out
        self._launch(f"ds4_matvec_{w.kind}", (_cdiv(n_out, ROWS_PER_BLOCK), P, 1), BLOCK,
                     (raw, xq, xd, experts, toks, out, _I32(n_out), _I32(n_in), _I32(P)))
        return out

    def quantize(self, x, block: int):
        """ds4's activation codes of x [T, n] float32 (numerics.q8_0_quantize for block 32,
        q8_k_quantize for 256; n a multiple of block): (q int8 [T, n], d float32 [T, n / block]),
        or None where the kernel is missing or n does not divide."""
        xp = self.xp
        name = "q8_0_quantize" if block == 32 else "q8_k_quantize"
        T, n = x.shape
        if n % block or not self.has(name):
            return None
        q, d = xp.empty((T, n), dtype=xp.int8), xp.empty((T, n // block), dtype=xp.float32)
        self._launch(name, (_cdiv(n // block, 8), T, 1), (256, 1, 1), (self._c(x, xp.float32), q, d, _I32(T), _I32(n)))
        return q, d

    def kv_store(self, rows, n_nope: int):
        """ds4's KV-row rounding (FP8 on the first n_nope of the last axis, then F16) of float32
        rows [..., n], or None where the kernel is missing or n_nope is not whole 64-blocks."""
        xp = self.xp
        if n_nope % 64 or n_nope > rows.shape[-1] or not self.has("kv_store_ds4"):
            return None
        x2 = self._c(rows, xp.float32).reshape(-1, rows.shape[-1])
        out = xp.empty(x2.shape, dtype=xp.float32)
        self._launch("kv_store_ds4", (x2.shape[0], 1, 1), (64, 1, 1),
                     (x2, out, _I32(x2.shape[0]), _I32(x2.shape[1]), _I32(n_nope)))
        return out.reshape(rows.shape)

    def compress_pool(self, kv, sc, first, has_prev, r: int, hd: int, overlap: bool):
        """The compressor's closed windows pooled [n, hd] (compress.cu); kv, sc [rows, w] the
        frontier's projections, first [n] (host) each window's first row in them, has_prev [n]
        (host) whether a previous window exists (overlap only). None where the kernel is missing."""
        xp = self.xp
        if not self.has("compress_pool"):
            return None
        n = len(first)
        win = xp.asarray(np.stack([np.asarray(first), np.asarray(has_prev)], axis=1).astype(np.int32))
        kv, sc = self._c(kv, xp.float32), self._c(sc, xp.float32)
        out = xp.empty((n, hd), dtype=xp.float32)
        self._launch("compress_pool", (n, _cdiv(hd, 128), 1), BLOCK,
                     (kv, sc, win, out, _I32(n), _I32(kv.shape[1]), _I32(r), _I32(hd), _I32(bool(overlap))))
        return out

    def ds4_dense(self, w: DevTensor, xq, xd, rows=None):
        """A dense Q8_0 weight's ds4 product [T, n_sel]: one expert, the tokens as its pairs."""
        xp = self.xp
        data = w.data if rows is None else w.data[rows]
        T = xq.shape[0]
        raw = self._c(data).reshape(1, data.shape[0], data.shape[1])
        return self.ds4_experts(w, xq, xd, xp.zeros(T, dtype=xp.int32), xp.arange(T, dtype=xp.int32), raw=raw)

    def dequant_rows(self, w: DevTensor, idx):
        xp = self.xp
        rows = self._c(idx, xp.int32)
        out = xp.empty((rows.shape[0], w.n_in), dtype=xp.float32)
        self._launch(f"dequant_rows_{w.kind}", (_cdiv(w.n_in, 32 * 128), rows.shape[0], 1), BLOCK,
                     (self._c(w.data), rows, out, _I32(rows.shape[0]), _I32(w.n_in)))
        return out

    # -- attention, norms, RoPE ------------------------------------------------------------------
    def attention(self, q, segments, sinks, scale):
        """The online softmax over each segment in turn (attn_segment), then attn_finish."""
        xp = self.xp
        q = self._c(q, xp.float32)
        T, H, D = q.shape
        m, l = xp.empty((T, H), dtype=xp.float32), xp.empty((T, H), dtype=xp.float32)
        acc = xp.empty((T, H, D), dtype=xp.float32)
        dummy = xp.zeros(1, dtype=xp.int32)
        first = 1
        for seg in segments:
            keys, mask = seg[0], seg[1]
            K = mask.shape[-1]
            if K == 0:
                continue
            mode = 2 if len(seg) > 2 else (1 if keys.ndim == 3 else 0)
            idx = self._c(seg[2], xp.int32) if mode == 2 else dummy
            mask = self._c(xp.broadcast_to(mask.astype(xp.uint8), (T, K)))
            self._launch("attn_segment", (T * H, 1, 1), BLOCK,
                         (q, self._c(keys, xp.float32), mask, idx, m, l, acc, _I32(T), _I32(H), _I32(D),
                          _I32(K), _I32(mode), _F32(scale), _I32(first)))
            first = 0
        out = xp.empty((T, H, D), dtype=xp.float32)
        if first:                               # no key at all: the reference's 0 (only the sink)
            return xp.zeros((T, H, D), dtype=xp.float32)
        self._launch("attn_finish", (T * H, 1, 1), BLOCK,
                     (m, l, acc, self._c(sinks, xp.float32), out, _I32(T), _I32(H), _I32(D)))
        return out

    def rmsnorm(self, x, w, eps, name: str = "rmsnorm"):
        """`rmsnorm` (exact numerics) or `rmsnorm_ds4` (ds4's float32 scale) over the last axis."""
        xp = self.xp
        n = x.shape[-1]
        x2 = self._c(x).reshape(-1, n)
        out = xp.empty(x2.shape, dtype=xp.float32)
        wt = self._c(w, xp.float32) if w is not None else xp.zeros(1, dtype=xp.float32)
        self._launch(name, (x2.shape[0], 1, 1), (256, 1, 1),
                     (x2, wt, out, _I32(x2.shape[0]), _I32(n), np.float64(eps), _I32(w is not None)))
        return out.reshape(x.shape)

    def rope(self, x, thetas, inverse: bool, inplace: bool):
        """numerics.apply_rope in place on x [rows, (heads,) width] (a copy unless `inplace` and
        x is contiguous); thetas: one row of angles per row of x, or one row for all."""
        xp = self.xp
        y = x if inplace and x.flags.c_contiguous else x.copy()
        rows, width = y.shape[0], y.shape[-1]
        heads = y.size // max(1, rows * width)
        th = self._c(thetas, xp.float32)
        npair = th.shape[-1]
        stride = npair if th.size == rows * npair and rows > 1 else 0
        if th.size not in (npair, rows * npair):
            raise ValueError(f"rope: angles {thetas.shape} do not line up with x {x.shape}")
        self._launch("rope", (_cdiv(heads * npair, 128), rows, 1), BLOCK,
                     (y, th, _I32(rows), _I32(heads), _I32(width), _I32(npair), _I32(stride), _I32(bool(inverse))))
        return y

    # -- hyper-connections, indexer ----------------------------------------------------------------
    def hc_split(self, mix, n, scale, base, eps, iters):
        xp = self.xp
        mix = self._c(mix, xp.float32)
        T = mix.shape[0]
        pre, post = xp.empty((T, n), dtype=xp.float32), xp.empty((T, n), dtype=xp.float32)
        C = xp.empty((T, n, n), dtype=xp.float32)
        self._launch("hc_split", (_cdiv(T, 128), 1, 1), BLOCK,
                     (mix, self._c(scale, xp.float32), self._c(base, xp.float32), pre, post, C,
                      _I32(T), _I32(n), _F32(eps), _I32(iters)))
        return pre, post, C

    def topk(self, scores, k: int):
        xp = self.xp
        s = self._c(scores, xp.float32)
        T, C = s.shape
        out = xp.empty((T, k), dtype=xp.int32)
        self._launch("topk", (T, 1, 1), (512, 1, 1), (s, out, _I32(T), _I32(C), _I32(k)))
        return out

    def indexer_scores(self, qi, keys, wts):
        xp = self.xp
        qi = self._c(qi, xp.float32)
        T, H, D = qi.shape
        C = keys.shape[0]
        if C == 0 or T == 0:
            return xp.zeros((T, C), dtype=xp.float32)
        out = xp.empty((T, C), dtype=xp.float32)
        self._launch("indexer_scores", (_cdiv(C, 4), T, 1), BLOCK,
                     (qi, self._c(keys, xp.float32), self._c(wts, xp.float32), out, _I32(T), _I32(H),
                      _I32(D), _I32(C)))
        return out
