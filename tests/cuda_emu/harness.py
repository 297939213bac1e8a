"""Launch helpers for the CUDA kernels under the host emulation (engine/backends/cupy/emu.py):
each builds the arguments and the grid that cuda_kernels/README.md gives, on NumPy arrays, with
outputs filled with NaN (an element the kernel never writes shows up in the comparison).

`Kernels(patch)` loads the .cu files; patch = {file name: (old, new)} edits a kernel file's text
(or common.cuh's) before the build: the tests that prove the comparisons can fail.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from engine.backends.cupy import emu
from engine.backends.kernel_sources import kernel_dir
from engine.backends.mlx.metal import batch_plan
from engine.gguf import quants

KDIR = Path(str(kernel_dir("cuda_kernels")))
FORMATS = {"q8_0": quants.Q8_0, "f16": quants.F16, "iq2_xxs": quants.IQ2_XXS, "q2_k": quants.Q2_K,
           "q4_k": quants.Q4_K, "mxfp4": quants.MXFP4}
i32, f32 = np.int32, np.float32


def _nan(shape, dtype=np.float32):
    return np.full(shape, np.nan if np.dtype(dtype).kind == "f" else -1, dtype=dtype)


def cupy_device() -> bool:
    """A CUDA device that real CuPy can use (then the same comparisons run on it too)."""
    try:
        import cupy
        return bool(cupy.is_available())
    except Exception:               # not installed, no driver, no device
        return False


class _OnDevice:
    """A cupy.RawModule kernel called like the emulation's: NumPy arguments go to the device and
    every array comes back into its NumPy original (the kernels write in place)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, grid, block, args):
        import cupy
        dev = [cupy.asarray(a) if isinstance(a, np.ndarray) else a for a in args]
        self.fn(tuple(grid), tuple(block), tuple(dev))
        cupy.cuda.Device().synchronize()
        for a, d in zip(args, dev):
            if isinstance(a, np.ndarray):
                a[...] = cupy.asnumpy(d)


class Kernels:
    def __init__(self, patch: dict | None = None, runner: str = "emu"):
        """runner "emu": the host emulation (skips the test without g++); "cupy": real CuPy on a
        CUDA device (NVRTC)."""
        if runner == "emu" and emu.compiler() is None:
            import pytest
            pytest.skip("g++ is not installed: the CUDA emulation needs it")
        self.runner = runner
        self.patch = patch or {}
        self._mods = {}
        self._hdr = None
        if "common.cuh" in self.patch:      # a patched header shadows the real one (-I first)
            self._hdr = Path(tempfile.mkdtemp(prefix="cuda_emu_hdr_"))
            (self._hdr / "common.cuh").write_text(self._text("common.cuh"))

    def _text(self, name: str) -> str:
        text = (KDIR / name).read_text()
        if name in self.patch:
            old, new = self.patch[name]
            assert text.count(old) == 1, f"{old!r} is not once in {name}"
            text = text.replace(old, new)
        return text

    def fn(self, file: str, name: str):
        if file not in self._mods:
            if self.runner == "cupy":
                import cupy
                inc = [f"-I{self._hdr}"] if self._hdr else []
                self._mods[file] = cupy.RawModule(code=self._text(file), options=(*inc, f"-I{KDIR}", "--std=c++17"))
            else:
                opts = ("-I", str(self._hdr)) if self._hdr else ()
                # -O0 for the one-off builds of deliberately broken kernels: they compile faster
                self._mods[file] = emu.load_module(code=self._text(file), options=opts,
                                                   opt="-O0" if self.patch else "-O1")
        fn = self._mods[file].get_function(name)
        return _OnDevice(fn) if self.runner == "cupy" else fn

    # -- matvec.cu ---------------------------------------------------------------------------
    def matvec_experts(self, fmt, raw, x, experts, toks):
        E, n_out, _ = raw.shape
        P = len(experts)
        out = _nan((P, n_out))
        self.fn("matvec.cu", f"matvec_experts_{fmt}")((-(-n_out // 4), P, 1), (128, 1, 1),
                                                      (raw, x, experts, toks, out, i32(n_out), i32(x.shape[1]), i32(P)))
        return out

    def matvec_dense(self, fmt, raw, x):
        n_out = raw.shape[0]
        out = _nan((x.shape[0], n_out))
        self.fn("matvec.cu", f"matvec_dense_{fmt}")((-(-n_out // 4), x.shape[0], 1), (128, 1, 1),
                                                    (raw, x, out, i32(n_out), i32(x.shape[1]), i32(x.shape[0])))
        return out

    # -- ds4_dot.cu --------------------------------------------------------------------------
    def ds4_matvec(self, fmt, raw, xq, xd, experts, toks):
        """ds4's dot products: xq int8 [T, n_in] and xd float32 [T, n_in / block] (Q8_0 or Q8_K)."""
        E, n_out, _ = raw.shape
        P = len(experts)
        out = _nan((P, n_out))
        self.fn("ds4_dot.cu", f"ds4_matvec_{fmt}")(
            (-(-n_out // 4), P, 1), (128, 1, 1),
            (raw, np.ascontiguousarray(xq, dtype=np.int8), np.ascontiguousarray(xd, dtype=f32), experts, toks, out,
             i32(n_out), i32(xq.shape[1]), i32(P)))
        return out

    def ds4_gemm(self, fmt, raw, xq, xd, experts, toks):
        """ds4_mma.cu: ds4's dot products of the pairs grouped by expert (int8 mma), as ds4_matvec."""
        E, n_out, _ = raw.shape
        perm, chunks = batch_plan(experts, tile_pairs=32)
        out = _nan((len(experts), n_out))
        self.fn("ds4_mma.cu", f"ds4_gemm_{fmt}")(
            (-(-n_out // 64), len(chunks), 1), (128, 1, 1),
            (raw, np.ascontiguousarray(xq, dtype=np.int8), np.ascontiguousarray(xd, dtype=f32), experts, toks,
             perm, np.ascontiguousarray(chunks), out, i32(n_out), i32(xq.shape[1]), i32(len(chunks))))
        return out

    def quantize(self, block, x):
        """quantize.cu: ds4's activation codes (q int8 [T, n], d [T, n / block])."""
        T, n = x.shape
        q, d = np.full((T, n), 99, np.int8), _nan((T, n // block))
        self.fn("quantize.cu", "q8_0_quantize" if block == 32 else "q8_k_quantize")(
            (-(-(n // block) // 8), T, 1), (256, 1, 1), (np.ascontiguousarray(x, dtype=f32), q, d, i32(T), i32(n)))
        return q, d

    def kv_store(self, x, n_nope):
        """kv.cu: ds4's KV-row rounding of x [rows, n] (FP8 on the first n_nope values, then F16)."""
        out = _nan(x.shape)
        self.fn("kv.cu", "kv_store_ds4")((x.shape[0], 1, 1), (64, 1, 1),
                                         (np.ascontiguousarray(x, dtype=f32), out, i32(x.shape[0]), i32(x.shape[1]),
                                          i32(n_nope)))
        return out

    def compress_pool(self, kv, sc, first, has_prev, r, hd, overlap):
        """compress.cu: the compressor's closed windows pooled [n, hd] (Model._pool_arrays)."""
        n = len(first)
        win = np.ascontiguousarray(np.stack([first, has_prev], axis=1), dtype=i32)
        out = _nan((n, hd))
        self.fn("compress.cu", "compress_pool")((n, -(-hd // 128), 1), (128, 1, 1),
                                                (np.ascontiguousarray(kv, dtype=f32), np.ascontiguousarray(sc, dtype=f32),
                                                 win, out, i32(n), i32(kv.shape[1]), i32(r), i32(hd), i32(bool(overlap))))
        return out

    def dequant_rows(self, fmt, raw2d, rows, n_in):
        out = _nan((len(rows), n_in))
        self.fn("matvec.cu", f"dequant_rows_{fmt}")((-(-(n_in // 32) // 128), len(rows), 1), (128, 1, 1),
                                                    (raw2d, rows, out, i32(len(rows)), i32(n_in)))
        return out

    # -- gemm.cu -----------------------------------------------------------------------------
    def gemm_experts(self, fmt, raw, x, experts, toks):
        E, n_out, _ = raw.shape
        perm, chunks = batch_plan(experts, tile_pairs=16)
        out = _nan((len(experts), n_out))
        self.fn("gemm.cu", f"gemm_experts_{fmt}")(
            (-(-n_out // 64), len(chunks), 1), (128, 1, 1),
            (raw, x, experts, toks, perm, np.ascontiguousarray(chunks), out, i32(n_out), i32(x.shape[1]),
             i32(len(chunks))))
        return out

    # -- attention.cu ------------------------------------------------------------------------
    def attention(self, q, segments, sinks, scale, warps=4):
        """NumpyOps.attention's arguments: segments of (keys, mask) or (keys, mask, idx)."""
        T, H, D = q.shape
        m, l, acc = _nan((T, H)), _nan((T, H)), _nan((T, H, D))
        seg = self.fn("attention.cu", "attn_segment")
        for n, s in enumerate(segments):
            keys, mask = s[0], s[1]
            K = mask.shape[1]
            if len(s) > 2:
                mode, idx = 2, np.ascontiguousarray(s[2], dtype=i32)
            else:
                mode, idx = (1 if keys.ndim == 3 else 0), np.zeros(1, i32)
            seg((T * H, 1, 1), (32 * warps, 1, 1), (q, np.ascontiguousarray(keys, dtype=f32), mask.astype(np.uint8), idx,
                                             m, l, acc, i32(T), i32(H), i32(D), i32(K), i32(mode), f32(scale),
                                             i32(n == 0)))
        out = _nan((T, H, D))
        self.fn("attention.cu", "attn_finish")((T * H, 1, 1), (128, 1, 1),
                                               (m, l, acc, sinks, out, i32(T), i32(H), i32(D)))
        return out

    # -- norm_rope.cu ------------------------------------------------------------------------
    def rmsnorm(self, x, w, eps, ds4=False):
        rows, n = x.shape
        out = _nan(x.shape)
        self.fn("norm_rope.cu", "rmsnorm_ds4" if ds4 else "rmsnorm")((rows, 1, 1), (256, 1, 1),
                                           (x, w if w is not None else np.zeros(1, f32), out, i32(rows), i32(n),
                                            np.float64(eps), i32(w is not None)))
        return out

    def rope(self, x, thetas, inverse=False):
        """apply_rope for x [rows, W] or [rows, H, W] and thetas [rows, n_pairs] or [n_pairs]."""
        y = np.array(x, dtype=f32, copy=True)
        rows = y.shape[0]
        heads, width = (y.shape[1], y.shape[2]) if y.ndim == 3 else (1, y.shape[1])
        npair = thetas.shape[-1]
        stride = 0 if thetas.ndim == 1 else npair
        self.fn("norm_rope.cu", "rope")((-(-(heads * npair) // 128), rows, 1), (128, 1, 1),
                                        (y, np.ascontiguousarray(thetas, dtype=f32), i32(rows), i32(heads), i32(width),
                                         i32(npair), i32(stride), i32(inverse)))
        return y

    # -- hc_topk.cu --------------------------------------------------------------------------
    def hc_split(self, mix, n, scale, base, eps, iters):
        T = mix.shape[0]
        pre, post, C = _nan((T, n)), _nan((T, n)), _nan((T, n, n))
        self.fn("hc_topk.cu", "hc_split")((-(-T // 128), 1, 1), (128, 1, 1),
                                          (mix, scale, base, pre, post, C, i32(T), i32(n), f32(eps), i32(iters)))
        return pre, post, C

    def topk(self, scores, k):
        T, C = scores.shape
        out = _nan((T, k), np.int32)
        self.fn("hc_topk.cu", "topk")((T, 1, 1), (512, 1, 1), (scores, out, i32(T), i32(C), i32(k)))
        return out

    def indexer_scores(self, qi, keys, wts):
        T, H, D = qi.shape
        C = keys.shape[0]
        out = _nan((T, C))
        self.fn("hc_topk.cu", "indexer_scores")((-(-C // 4), T, 1), (128, 1, 1),
                                                (qi, keys, wts, out, i32(T), i32(H), i32(D), i32(C)))
        return out


# the bytes of a block that hold its f16 scales (kept from random_blocks: random bits there could
# be NaN); all other bytes may be anything
F16_FIELDS = {"q8_0": (0, 2), "iq2_xxs": (0, 2), "q2_k": (80, 84), "q4_k": (0, 4)}


def weights(fmt, rng, E, n_out, n_in, std=0.05, any_bytes=False):
    """raw uint8 [E, n_out, row_bytes] of random GGUF blocks and their NumPy decoding.
    any_bytes: every byte but the f16 scales uniformly random (every scale, sign and grid bit
    set somewhere), not only the values random_blocks draws."""
    t = FORMATS[fmt]
    f = quants.FORMATS[t]
    nb = E * n_out * n_in // f.block_elems
    raw = quants.random_blocks(t, rng, nb, std)
    if any_bytes and fmt == "f16":         # any half but inf/NaN: subnormals, zeros of both signs
        h = raw.view(np.uint16)
        h[:] = rng.integers(0, 1 << 16, h.shape, dtype=np.uint16)
        h[(h & 0x7C00) == 0x7C00] &= 0xBFFF
    elif any_bytes:
        blocks = raw.reshape(-1, f.block_bytes)
        keep = blocks.copy()
        blocks[:] = rng.integers(0, 256, blocks.shape, dtype=np.uint8)
        if fmt in F16_FIELDS:
            a, b = F16_FIELDS[fmt]
            blocks[:, a:b] = keep[:, a:b]
        if fmt == "mxfp4":                  # E8M0 scales up to 2**71: no overflow to inf
            blocks[:, 0] %= 200
    raw = raw.reshape(E, n_out, -1)
    return raw, quants.dequantize(t, raw.reshape(E * n_out, -1)).reshape(E, n_out, n_in)


def rel_err(got, ref) -> float:
    ref = np.asarray(ref, dtype=np.float64)
    return float(np.abs(got.astype(np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30))
