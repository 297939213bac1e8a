"""GGUF weights bound to MLX (repacks), and the products with them.

One GGUF tensor (engine.gguf.model_file.QTensor) becomes one MxWeight:

* Q8_0  -> "affine8", group 32: code q + 128 (MLX's codes are unsigned), scale d, bias -128*d.
* Q4_K  -> "affine4", group 32 (one Q4_K sub-block): scale d*sc, bias -dmin*m.
* MXFP4 -> "mxfp4": ggml's E8M0 byte is MLX's scale byte as is (ggml's kvalues are the E2M1 values
  doubled and its "half" scale is 2^(e-128), so both read 2^(e-127) * e2m1); only the nibble order
  differs: ggml puts element j in the low and j+16 in the high nibble of byte j, MLX packs element
  2i in the low and 2i+1 in the high nibble of byte i. Code 8 (-0 in MLX, +0 in ggml) becomes code 0.
  E8M0 255 is NaN/inf for MLX but 2^127 for ggml: a tensor that uses it is bound "dense" float32.
* F32 / F16 / BF16 -> "dense", in their own dtype (16-bit stays 16-bit: half the memory).
* IQ2_XXS / Q2_K -> the raw block bytes; quant_twin decodes them with mx ops.

Scales and biases are float16 when every one of a tensor's values is exactly a float16 (computed in
float32, cast, compared), else float32, so ``dequantize`` is bit-exact with engine.gguf.quants in both
cases. Q8_0: d is an f16 and -128*d only shifts the exponent, so float16 unless |d| > 511.75 (the
bias would overflow). Q4_K: d*sc has up to 17 significant bits, so nearly always float32.
One known difference: a Q8_0 code 0 in a block with a negative d is -0.0 in ggml (d * 0) and +0.0
here (128d - 128d); no product can tell them apart.

Shapes: [n_out, ...] for a matrix, [n_expert, n_out, ...] for an expert tensor.
Only engine/ code touches these arrays (layering rule of the project).
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from engine.gguf import quants as Q

from .quant_twin import decode_rows, gather_by_expert, twin_gather_matmul, twin_matmul

# GGUF bytes converted per step while binding: the extra host memory of a repack is O(slab) per
# worker thread (NumPy releases the GIL in the bit shuffles, so slabs convert in parallel).
_SLAB_BYTES = 16 << 20
_WORKERS = max(1, min(8, os.cpu_count() or 1))
_TWIN = (Q.IQ2_XXS, Q.Q2_K)
_DENSE_DTYPES = {Q.F32: (np.float32, mx.float32), Q.F16: (np.float16, mx.float16),
                 Q.BF16: (np.uint16, mx.bfloat16)}   # bf16 bits travel as uint16, then a view


@dataclass
class MxWeight:
    type_id: int          # the GGUF type it came from
    kind: str             # "affine8" | "affine4" | "mxfp4" | "dense" | "iq2_xxs" | "q2_k"
    n_in: int
    n_out: int
    n_expert: int         # 0 for a 2-D matrix
    w: mx.array           # MLX quantize() layout; dense: the matrix; iq2_xxs/q2_k: GGUF block bytes
    scales: mx.array | None
    biases: mx.array | None
    group_size: int | None
    bits: int | None
    mode: str | None
    # Q4_K only: each 256-block's F16 d and dmin, float32 [..., n_out, n_in / 256] (the scales and
    # biases above are their products with the 6-bit sc and m; ds4's integer dot needs them apart)
    dmins: tuple | None = None

    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (self.w, self.scales, self.biases, *(self.dmins or ())) if a is not None)

    def _qargs(self) -> dict:
        return dict(group_size=self.group_size, bits=self.bits, mode=self.mode)


# ---------------------------------------------------------------------------
# slab converters: GGUF rows uint8 [r, row_bytes] -> header (scale f32 [r, groups], bias f32 or None)
# and codes (uint8 [r, n_in * bits / 8], MLX's order). Headers alone decide the scale dtype (pass 1).


def _hdr_q8_0(rows: np.ndarray):
    d = rows.reshape(rows.shape[0], -1, 34)[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    return d, d * np.float32(-128.0)


def _codes_q8_0(rows: np.ndarray) -> np.ndarray:
    # int8 q -> q + 128 = flip the top bit; 4 codes per uint32 word, element 0 in the lowest byte
    return (rows.reshape(rows.shape[0], -1, 34)[:, :, 2:] ^ np.uint8(0x80)).reshape(rows.shape[0], -1)


def _hdr_q4_k(rows: np.ndarray):
    b = rows.reshape(-1, 144)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)                # [n, 1]
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = Q._q4_k_scale_min(b[:, 4:16])
    # the same float32 products as _dec_q4_k; group k of 32 = sub-block k
    return (d * sc).reshape(rows.shape[0], -1), (-(dmin * mn)).reshape(rows.shape[0], -1)


def _pair_nibbles(qs: np.ndarray) -> np.ndarray:
    """GGUF's split nibbles -> MLX's consecutive pairs, per run of m bytes qs [..., m] holding 2m
    values (byte i: value i in the low, i + m in the high nibble); MLX byte k holds values 2k (low)
    and 2k + 1 (high). For k < m/2 both are low nibbles of bytes 2k, 2k+1; after, high nibbles.
    Done on little-endian uint16 words w = byte 2k | byte 2k+1 << 8 (contiguous: ~3x faster)."""
    w = np.ascontiguousarray(qs).view(np.uint16)
    first = (w & np.uint16(0x000F)) | ((w >> np.uint16(4)) & np.uint16(0x00F0))
    second = ((w >> np.uint16(4)) & np.uint16(0x000F)) | ((w >> np.uint16(8)) & np.uint16(0x00F0))
    return np.concatenate([first.astype(np.uint8), second.astype(np.uint8)], axis=-1)


def _codes_q4_k(rows: np.ndarray) -> np.ndarray:
    # element 64p + 32h + l is nibble h of qs[32p + l]: runs of 32 bytes per 64 values
    qs = rows.reshape(-1, 144)[:, 16:144].reshape(-1, 4, 32)
    return _pair_nibbles(qs).reshape(rows.shape[0], -1)


def _hdr_mxfp4(rows: np.ndarray):
    return rows.reshape(-1, 17)[:, 0].reshape(rows.shape[0], -1).copy(), None


def _codes_mxfp4(rows: np.ndarray) -> np.ndarray:
    c = _pair_nibbles(rows.reshape(-1, 17)[:, 1:17])            # element i low, i + 16 high nibble
    # code 8 (-0 for MLX, kvalues[8] = +0 for ggml) -> code 0, in either nibble
    c ^= ((c & np.uint8(0x0F)) == 8).view(np.uint8) << np.uint8(3)
    c ^= ((c & np.uint8(0xF0)) == 0x80).view(np.uint8) << np.uint8(7)
    return c.reshape(rows.shape[0], -1)


_CONVERTERS = {Q.Q8_0: ("affine8", 8, _hdr_q8_0, _codes_q8_0),
               Q.Q4_K: ("affine4", 4, _hdr_q4_k, _codes_q4_k),
               Q.MXFP4: ("mxfp4", 4, _hdr_mxfp4, _codes_mxfp4)}


def _fits_f16(v: np.ndarray) -> bool:
    with np.errstate(over="ignore"):
        h = v.astype(np.float16).astype(np.float32)
    return bool(np.array_equal(h.view(np.uint32), v.view(np.uint32)))   # bits: keeps -0.0 apart


def _host_array(shape: tuple[int, ...], dtype) -> tuple[mx.array, np.ndarray]:
    """A new mx array and a writable NumPy view of its memory (filled slab by slab, no second copy)."""
    a = mx.zeros(shape, dtype=dtype)
    mx.eval(a)
    v = np.array(a, copy=False)
    if not (v.flags.writeable and v.flags.c_contiguous and v.shape == tuple(shape)):
        raise RuntimeError("mlx did not hand out a writable contiguous buffer")  # pragma: no cover
    return a, v


def _slabs(data: np.ndarray):
    step = max(1, _SLAB_BYTES // max(1, data.shape[1]))
    for r0 in range(0, data.shape[0], step):
        yield r0, min(data.shape[0], r0 + step)


def _lead(t) -> tuple[int, ...]:
    """The leading shape of the bound arrays: (n_out,) or (n_expert, n_out)."""
    return (t.dims[2], t.dims[1]) if len(t.dims) == 3 else (t.dims[1],)


def repack(t) -> MxWeight:
    """Bind a GGUF QTensor (2-D matrix or 3-D experts) to MLX arrays; see the module notes."""
    tid = int(t.type_id)
    if len(t.dims) not in (2, 3):
        raise ValueError(f"{t.name}: repack takes matrices and expert tensors, got dims {t.dims}")
    n_in, n_out = int(t.dims[0]), int(t.dims[1])
    n_exp = int(t.dims[2]) if len(t.dims) == 3 else 0
    data = Q._as_bytes(t.data)
    if data.shape != (n_out * max(1, n_exp), Q.row_bytes(tid, n_in)):
        raise ValueError(f"{t.name}: data {data.shape} does not match dims {t.dims} of {Q.type_name(tid)}")
    lead = _lead(t)
    base = dict(type_id=tid, n_in=n_in, n_out=n_out, n_expert=n_exp)
    if tid in _TWIN:
        w = mx.array(data).reshape(*lead, data.shape[1])   # one copy of the file's bytes
        return MxWeight(kind=Q.type_name(tid).lower(), w=w, scales=None, biases=None,
                        group_size=None, bits=None, mode=None, **base)
    if tid in _DENSE_DTYPES:
        np_dt, mx_dt = _DENSE_DTYPES[tid]
        w = mx.array(data.view(np_dt)).reshape(*lead, n_in)
        if tid == Q.BF16:
            w = w.view(mx.bfloat16)
        return MxWeight(kind="dense", w=w, scales=None, biases=None,
                        group_size=None, bits=None, mode=None, **base)
    if tid not in _CONVERTERS:
        raise ValueError(f"{t.name}: no MLX binding for {Q.type_name(tid)}")
    kind, bits, header, codes_of = _CONVERTERS[tid]
    # pass 1 (headers only): can scales and biases be float16, and can MLX read every E8M0 byte?
    f16 = True
    for r0, r1 in _slabs(data):
        s, b = header(data[r0:r1])
        if tid == Q.MXFP4 and np.any(s == 255):
            return _dense_f32(data, lead, n_in, base)
        f16 = f16 and b is not None and _fits_f16(s) and _fits_f16(b)
        if not f16 and tid != Q.MXFP4:
            break   # float32 it is; only MXFP4 has to see every header
    # pass 2: fill the arrays slab by slab
    n_rows, groups = data.shape[0], n_in // 32
    w, wv = _host_array((n_rows, n_in * bits // 32), mx.uint32)
    sdt = mx.uint8 if tid == Q.MXFP4 else (mx.float16 if f16 else mx.float32)
    scales, sv = _host_array((n_rows, groups), sdt)
    biases, bv = (None, None) if tid == Q.MXFP4 else _host_array((n_rows, groups), sdt)
    q4k = [_host_array((n_rows, n_in // 256), mx.float32) for _ in range(2)] if tid == Q.Q4_K else None
    def fill(span: tuple[int, int]) -> None:   # each slab writes its own rows: no locking needed
        r0, r1 = span
        slab = np.ascontiguousarray(data[r0:r1])
        s, b = header(slab)
        wv[r0:r1] = codes_of(slab).view(np.uint32)   # little endian: byte k = bits 8k..8k+7 of a word
        sv[r0:r1] = s
        if bv is not None:
            bv[r0:r1] = b
        if q4k is not None:
            blk = slab.reshape(-1, 144)
            for (_, v), off in zip(q4k, (0, 2)):
                v[r0:r1] = blk[:, off:off + 2].copy().view(np.float16).astype(np.float32).reshape(r1 - r0, -1)

    with ThreadPoolExecutor(_WORKERS) as pool:
        list(pool.map(fill, _slabs(data)))
    del wv, sv, bv
    shape = lambda a: a.reshape(*lead, a.shape[-1])   # noqa: E731
    return MxWeight(kind=kind, w=shape(w), scales=shape(scales),
                    biases=None if biases is None else shape(biases), group_size=32, bits=bits,
                    mode="mxfp4" if tid == Q.MXFP4 else "affine",
                    dmins=None if q4k is None else tuple(shape(a) for a, _ in q4k), **base)


def _dense_f32(data: np.ndarray, lead: tuple[int, ...], n_in: int, base: dict) -> MxWeight:
    """Fallback: the GGUF decode as float32 (MXFP4 with E8M0 255, which MLX reads as NaN/inf)."""
    w, wv = _host_array((data.shape[0], n_in), mx.float32)
    for r0, r1 in _slabs(data):
        wv[r0:r1] = Q.dequantize(base["type_id"], data[r0:r1])
    del wv
    return MxWeight(kind="dense", w=w.reshape(*lead, n_in), scales=None, biases=None,
                    group_size=None, bits=None, mode=None, **base)


# ---------------------------------------------------------------------------
# decode and products


def _f32(a: mx.array | None) -> mx.array | None:
    if a is None or a.dtype in (mx.uint8, mx.float32):   # uint8: E8M0 bytes, read by MLX as they are
        return a
    return a.astype(mx.float32)


def dequantize(w: MxWeight, expert: int | None = None) -> mx.array:
    """float32 [n_out, n_in]; for an expert tensor with expert None: [n_expert, n_out, n_in].

    Bit-exact with engine.gguf.quants.dequantize (Q8_0: up to the sign of zero, see the module notes).
    """
    if expert is not None and not w.n_expert:
        raise ValueError("expert= given for a 2-D weight")
    sel = (lambda a: a) if expert is None else (lambda a: None if a is None else a[int(expert)])
    wq = sel(w.w)
    if w.kind == "dense":
        return wq.astype(mx.float32)
    if w.kind in ("iq2_xxs", "q2_k"):
        return decode_rows(w.type_id, wq, w.n_in)
    # float16 scales are exact in float32: upcast, so the products are float32 as in the GGUF decode
    return mx.dequantize(wq, _f32(sel(w.scales)), _f32(sel(w.biases)), dtype=mx.float32, **w._qargs())


def matmul(w: MxWeight, x: mx.array, rows: slice | None = None) -> mx.array:
    """x [T, n_in] float32 -> x @ W[rows].T, float32 [T, n_out or len(rows)] (2-D weights)."""
    if w.n_expert:
        raise ValueError("matmul takes a 2-D weight; use gather_matmul for experts")
    if x.ndim != 2 or x.shape[1] != w.n_in:
        raise ValueError(f"x of shape {x.shape} does not match n_in {w.n_in}")
    if rows is not None and not isinstance(rows, slice):
        raise TypeError("rows must be a slice or None")
    cut = (lambda a: a) if rows is None else (lambda a: None if a is None else a[rows])
    x = x.astype(mx.float32)
    if w.kind == "dense":
        return x @ cut(w.w).astype(mx.float32).T
    if w.kind in ("iq2_xxs", "q2_k"):
        return twin_matmul(w.type_id, cut(w.w), w.n_in, x)
    return mx.quantized_matmul(x, cut(w.w), cut(w.scales), cut(w.biases), transpose=True, **w._qargs())


def gather_matmul(w: MxWeight, x: mx.array, experts: mx.array, toks: mx.array,
                  check_sorted: bool = True) -> mx.array:
    """Routed experts: out[p] = W[experts[p]] @ x[toks[p]] -> float32 [P, n_out].

    x: float32 [T, n_in]; experts, toks: integer [P], toks in [0, T) (not checked). The pairs MUST be
    sorted by expert (the caller sorts; MLX's gather kernels and the twin's per-expert runs rely on it). check_sorted reads
    ``experts`` on the host and raises ValueError when they are not sorted or out of range; pass False
    to skip that sync when the caller sorted them itself (the twin and the 16-bit dense experts read
    ``experts`` on the host anyway).
    """
    if not w.n_expert:
        raise ValueError("gather_matmul takes an expert (3-D) weight")
    if x.ndim != 2 or x.shape[1] != w.n_in:
        raise ValueError(f"x of shape {x.shape} does not match n_in {w.n_in}")
    if experts.ndim != 1 or toks.ndim != 1 or experts.shape != toks.shape:
        raise ValueError(f"experts {experts.shape} and toks {toks.shape} must be 1-D of the same length")
    x = x.astype(mx.float32)
    toks = toks.astype(mx.uint32)
    host = w.kind in ("iq2_xxs", "q2_k") or (w.kind == "dense" and w.w.dtype != mx.float32)
    if check_sorted or host:
        e_np = np.array(experts).astype(np.int64)
        if e_np.size and (np.any(np.diff(e_np) < 0) or e_np[0] < 0 or e_np[-1] >= w.n_expert):
            raise ValueError("gather_matmul: experts must be sorted and within [0, n_expert)")
    if experts.shape[0] == 0:
        return mx.zeros((0, w.n_out), dtype=mx.float32)
    if w.kind in ("iq2_xxs", "q2_k"):
        # (the expert cache's slot weights: the experts' bytes are the rows of their slots)
        return twin_gather_matmul(w.type_id, w.w, w.n_in, x, e_np, toks, getattr(w, "slot_rows", None))
    if host:   # float16 / bfloat16 experts: upcast only the experts that occur
        return gather_by_expert(lambda sel: w.w[sel].astype(mx.float32), w.n_out, w.n_in, x, e_np, toks)
    e = experts.astype(mx.uint32)
    xt = x[:, None, :]
    if w.kind == "dense":
        y = mx.gather_mm(xt, w.w.swapaxes(1, 2), lhs_indices=toks, rhs_indices=e, sorted_indices=True)
    else:
        y = mx.gather_qmm(xt, w.w, w.scales, w.biases, lhs_indices=toks, rhs_indices=e,
                          transpose=True, sorted_indices=True, **w._qargs())
    return y.reshape(experts.shape[0], w.n_out)
