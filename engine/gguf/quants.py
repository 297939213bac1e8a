"""GGML block formats used by ds4 GGUF files: layouts, dequantization, reference matvec.

Everything here is plain vectorized NumPy.  The dequantizers are bit-exact with
``gguf.quants.dequantize`` (gguf 0.19.0): every value is computed in float32 with
the same sequence of roundings as gguf-py does (see the per-format notes).

Layouts (model.md section 5, all little endian):

* F32 / F16 / BF16: plain arrays (BF16 = upper 16 bits of an IEEE float32).
* Q8_0    (32 values,  34 bytes): f16 d, int8 qs[32];            y = d * q
* Q2_K    (256 values, 84 bytes): u8 scales[16], u8 qs[64], f16 d, f16 dmin
* Q4_K    (256 values, 144 bytes): f16 d, f16 dmin, u8 scales[12], u8 qs[128]
* IQ2_XXS (256 values, 66 bytes): f16 d, 8 x (u32 a0, u32 a1)
* MXFP4   (32 values,  17 bytes): u8 E8M0 exponent e, u8 qs[16] (low nibbles = 0..15)
* I32: plain int32 (not a float format; dequantize refuses it).

Large inputs (np.memmap views) are decoded in chunks of blocks; only the chunk
being decoded is made contiguous, so memory use beyond the output is small.
"""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass

import numpy as np

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

__all__ = [
    "F32", "F16", "BF16", "Q8_0", "Q2_K", "Q4_K", "IQ2_XXS", "MXFP4", "I32",
    "BlockFormat", "FORMATS", "type_name", "row_bytes",
    "dequantize", "dequantize_rows", "matvec", "random_blocks",
    "IQ2XXS_GRID", "IQ2XXS_GRID_BYTES", "KSIGNS_IQ2XS", "MXFP4_KVALUES",
]

# ---------------------------------------------------------------------------
# type ids and formats

F32 = 0
F16 = 1
Q8_0 = 8
Q2_K = 10
Q4_K = 12
IQ2_XXS = 16
I32 = 26
BF16 = 30
MXFP4 = 39


@dataclass(frozen=True)
class BlockFormat:
    type_id: int
    name: str
    block_elems: int
    block_bytes: int


FORMATS: dict[int, BlockFormat] = {
    F32: BlockFormat(F32, "F32", 1, 4),
    F16: BlockFormat(F16, "F16", 1, 2),
    BF16: BlockFormat(BF16, "BF16", 1, 2),
    Q8_0: BlockFormat(Q8_0, "Q8_0", 32, 34),
    Q2_K: BlockFormat(Q2_K, "Q2_K", 256, 84),
    Q4_K: BlockFormat(Q4_K, "Q4_K", 256, 144),
    IQ2_XXS: BlockFormat(IQ2_XXS, "IQ2_XXS", 256, 66),
    MXFP4: BlockFormat(MXFP4, "MXFP4", 32, 17),
    I32: BlockFormat(I32, "I32", 1, 4),
}

# Sanity: our table agrees with gguf's ids and sizes (cheap, import time).
for _f in FORMATS.values():
    _gt = GGMLQuantizationType(_f.type_id)
    assert _gt.name == _f.name, (_gt.name, _f)
    assert tuple(GGML_QUANT_SIZES[_gt]) == (_f.block_elems, _f.block_bytes), _f
del _f, _gt


def type_name(type_id: int) -> str:
    f = FORMATS.get(int(type_id))
    return f.name if f is not None else f"type {int(type_id)}"


def _format(type_id: int) -> BlockFormat:
    f = FORMATS.get(int(type_id))
    if f is None:
        raise ValueError(f"unsupported ggml type {type_name(type_id)}")
    return f


def row_bytes(type_id: int, n_elems: int) -> int:
    """Bytes taken by ``n_elems`` consecutive values of a type (one row)."""
    f = _format(type_id)
    n_elems = int(n_elems)
    if n_elems < 0 or n_elems % f.block_elems:
        raise ValueError(
            f"{f.name}: row of {n_elems} elements is not a multiple of the block size {f.block_elems}")
    return n_elems // f.block_elems * f.block_bytes


# ---------------------------------------------------------------------------
# tables

# iq2xxs_grid (ggml-common.h): 256 entries x 8 bytes, each byte one of
# 0x08, 0x19, 0x2b.  Stored compactly as in gguf-py: every entry is 16 bits of
# 2-bit indices into (0x08, 0x19, 0x2b), element 0 in the lowest bits, written
# as hex bytes (two bytes = one entry).
_IQ2XXS_GRID_MAP = (0x08, 0x19, 0x2B)
_IQ2XXS_GRID_HEX = (
    "00000200050008000a00110014002000220028002a0041004400500058006100"
    "6400800082008a00a20001010401100115014001840198010002020222028202"
    "010404041004210424044004420448046004810484049004a404000502050805"
    "200546056905800591050906100640068406a406000805080808140828084108"
    "440850085208880804094009020a140a01100410101021104010601084109010"
    "951000110811201150115a118011241245120014081420142514491480141815"
    "6215001616160118041810184018811800190519a019511a002002200a204420"
    "6120802082202921482100220222012404241024402456240025412564259026"
    "082820289428442a014004401040184021402440404048405640604081408440"
    "9040004120416141804185410142104248425642684200440844204480449944"
    "124524450046014804481048404845480049584961498249454a904a00500850"
    "1150195020508050885004514251a4519152905492540a550156545600581158"
    "195864584059085a046010604060686000615561186260620064056410651265"
    "84654268008002800a8041808280048118814081118201840484108415844084"
    "608400854685948509864086608602880489118a0490109024904090a1901691"
    "8091459200942294449451958198209902a050a085a009a100a218a450a804a9"
)


def _build_iq2xxs_grid() -> np.ndarray:
    packed = np.frombuffer(bytes.fromhex(_IQ2XXS_GRID_HEX), dtype=np.uint8)
    idx = (packed[:, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)) & np.uint8(3)
    gmap = np.array(_IQ2XXS_GRID_MAP, dtype=np.uint8)
    return gmap[idx].reshape(256, 8)


#: uint8 [256, 8]: byte j of iq2xxs_grid[i]
IQ2XXS_GRID_BYTES: np.ndarray = _build_iq2xxs_grid()
IQ2XXS_GRID_BYTES.flags.writeable = False
#: uint64 [256]: iq2xxs_grid as in ggml-common.h (little endian, byte j = element j)
IQ2XXS_GRID: np.ndarray = IQ2XXS_GRID_BYTES.copy().view("<u8").reshape(256)
IQ2XXS_GRID.flags.writeable = False


def _build_ksigns() -> np.ndarray:
    i = np.arange(128, dtype=np.uint8)
    parity = np.zeros(128, dtype=np.uint8)
    for b in range(7):
        parity ^= (i >> np.uint8(b)) & np.uint8(1)
    return i | (parity << np.uint8(7))


#: uint8 [128]: ksigns_iq2xs[i] = i with bit 7 set so the byte has even parity
KSIGNS_IQ2XS: np.ndarray = _build_ksigns()
KSIGNS_IQ2XS.flags.writeable = False


def _build_iq2xxs_signed_table() -> np.ndarray:
    """int8 [256*128, 8]: row g*128+s = grid[g] with the signs of ksigns[s] applied."""
    sign_bits = (KSIGNS_IQ2XS[:, None] >> np.arange(8, dtype=np.uint8)) & np.uint8(1)  # [128, 8]
    signs = (1 - 2 * sign_bits.astype(np.int8)).astype(np.int8)
    grid = IQ2XXS_GRID_BYTES.astype(np.int8)  # values <= 43, fit in int8
    return (grid[:, None, :] * signs[None, :, :]).reshape(256 * 128, 8)


# viewed as uint64 so one gather moves the 8 signed values of a group at once
_IQ2XXS_SIGNED_U64 = _build_iq2xxs_signed_table().view(np.uint64).reshape(-1)

#: MXFP4 E2M1 values, doubled (the 0.5 is folded into the E8M0 scale), by nibble
MXFP4_KVALUES: np.ndarray = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)
MXFP4_KVALUES.flags.writeable = False

_SH_4BIT = np.array([0, 4], dtype=np.uint8)


def _f16(col: np.ndarray, dtype=np.float32) -> np.ndarray:
    """(n, 2) uint8 column slice -> (n, 1) float32 (or `dtype`; exact)."""
    return col.view(np.float16).astype(dtype)


# ---------------------------------------------------------------------------
# block decoders: blocks uint8 (n, block_bytes) C-contiguous -> out float32 (n, block_elems)


def _dec_f32(blocks: np.ndarray, out: np.ndarray) -> None:
    out[...] = blocks.view(np.float32)


def _dec_f16(blocks: np.ndarray, out: np.ndarray) -> None:
    out[...] = blocks.view(np.float16)


def _dec_bf16(blocks: np.ndarray, out: np.ndarray) -> None:
    np.left_shift(blocks.view(np.uint16), np.uint32(16), out=out.view(np.uint32), dtype=np.uint32)


def _dec_q8_0(blocks: np.ndarray, out: np.ndarray) -> None:
    # gguf: int8 -> f32, times f32(d)
    d = _f16(blocks[:, 0:2])
    np.multiply(blocks[:, 2:].view(np.int8), d, out=out)


def _dec_q2_k(blocks: np.ndarray, out: np.ndarray) -> None:
    # gguf: dl = f32(d) * f32(sc & 15); ml = f32(dmin) * f32(sc >> 4); y = dl * f32(q) - ml
    # (in out's dtype: float64 makes every step exact, see dequantize)
    n = blocks.shape[0]
    scales = blocks[:, 0:16]
    d = _f16(blocks[:, 80:82], out.dtype)
    dmin = _f16(blocks[:, 82:84], out.dtype)
    dl = (d * (scales & np.uint8(15))).reshape(n, 16, 1)
    ml = (dmin * (scales >> np.uint8(4))).reshape(n, 16, 1)
    # element 128h + 32j + l  <-  (qs[32h + l] >> 2j) & 3 ; sub-block of 16 = consecutive 16.
    # Work on 4 bytes at a time (uint32 words of qs; numpy copes if the buffer is unaligned).
    w = blocks[:, 16:80].view(np.uint32).reshape(n, 2, 8)
    q = np.empty((n, 2, 4, 8), dtype=np.uint32)
    for j in range(4):
        np.bitwise_and(w >> np.uint32(2 * j), np.uint32(0x03030303), out=q[:, :, j])
    o = out.reshape(n, 16, 16)
    np.multiply(dl, q.view(np.uint8).reshape(n, 16, 16), out=o)
    np.subtract(o, ml, out=o)


def _q4_k_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """scales uint8 (n, 12) -> (sc, mn) uint8 (n, 8) each (6-bit values)."""
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.empty((s.shape[0], 8), dtype=np.uint8)
    mn = np.empty((s.shape[0], 8), dtype=np.uint8)
    sc[:, :4] = lo & np.uint8(63)
    mn[:, :4] = mid & np.uint8(63)
    sc[:, 4:] = (hi & np.uint8(15)) | ((lo >> np.uint8(6)) << np.uint8(4))
    mn[:, 4:] = (hi >> np.uint8(4)) | ((mid >> np.uint8(6)) << np.uint8(4))
    return sc, mn


def _dec_q4_k(blocks: np.ndarray, out: np.ndarray) -> None:
    # gguf: dl = f32(d) * f32(sc); ml = f32(dmin) * f32(m); y = dl * f32(q) - ml (in out's dtype)
    n = blocks.shape[0]
    d = _f16(blocks[:, 0:2], out.dtype)
    dmin = _f16(blocks[:, 2:4], out.dtype)
    sc, mn = _q4_k_scale_min(blocks[:, 4:16])
    dl = (d * sc).reshape(n, 8, 1)
    ml = (dmin * mn).reshape(n, 8, 1)
    # element 64p + 32h + l  <-  (qs[32p + l] >> 4h) & 15   (4 bytes at a time, as uint32 words)
    w = blocks[:, 16:144].view(np.uint32).reshape(n, 4, 8)
    q = np.empty((n, 4, 2, 8), dtype=np.uint32)
    np.bitwise_and(w, np.uint32(0x0F0F0F0F), out=q[:, :, 0])
    np.bitwise_and(w >> np.uint32(4), np.uint32(0x0F0F0F0F), out=q[:, :, 1])
    o = out.reshape(n, 8, 32)
    np.multiply(dl, q.view(np.uint8).reshape(n, 8, 32), out=o)
    np.subtract(o, ml, out=o)


def _dec_iq2_xxs(blocks: np.ndarray, out: np.ndarray) -> None:
    # gguf: db = f32(d) * (0.5f + f32(a1 >> 28)) * 0.25f ; y = (db * f32(grid)) * (+-1)
    # Here y = db * f32(+-grid), identical since IEEE rounding is sign symmetric.
    n = blocks.shape[0]
    d = _f16(blocks[:, 0:2])  # (n, 1)
    qs = blocks[:, 2:66]
    a1 = qs.view(np.uint32)[:, 1::2]  # (n, 8)
    db = d * (np.float32(0.5) + (a1 >> np.uint32(28)).astype(np.float32)) * np.float32(0.25)
    a0b = qs.reshape(n, 8, 8)  # bytes 0..3 of each group: a0 = one grid index per 8 values
    # combined table row: grid_idx * 128 + sign_idx, sign_idx = (a1 >> 7l) & 127
    idx = np.empty((n, 8, 4), dtype=np.intp)
    for l in range(4):
        idx[:, :, l] = ((a1 >> np.uint32(7 * l)) & np.uint32(127)) | (a0b[:, :, l].astype(np.uint32) << np.uint32(7))
    vals = np.take(_IQ2XXS_SIGNED_U64, idx).view(np.int8)  # (n, 8, 32)
    np.multiply(db[:, :, None], vals, out=out.reshape(n, 8, 32))


def _e8m0_half(e: np.ndarray) -> np.ndarray:
    """E8M0 byte -> float32 2**(e-128) (ggml_e8m0_to_fp32_half), exact incl. e < 2 (subnormal)."""
    e32 = e.astype(np.uint32)
    bits = np.where(e32 < 2, np.uint32(0x00200000) << e32, (e32 - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def _dec_mxfp4(blocks: np.ndarray, out: np.ndarray) -> None:
    # gguf: y = f32(2**(e-128)) * f32(kvalues[nibble])
    n = blocks.shape[0]
    d = _e8m0_half(blocks[:, 0:1])  # (n, 1)
    nib = (blocks[:, 1:17].reshape(n, 1, 16) >> _SH_4BIT.reshape(1, 2, 1)) & np.uint8(15)
    vals = MXFP4_KVALUES[nib].reshape(n, 32)
    np.multiply(d, vals, out=out)


_DECODERS = {
    F32: _dec_f32,
    F16: _dec_f16,
    BF16: _dec_bf16,
    Q8_0: _dec_q8_0,
    Q2_K: _dec_q2_k,
    Q4_K: _dec_q4_k,
    IQ2_XXS: _dec_iq2_xxs,
    MXFP4: _dec_mxfp4,
}

# output values per decode chunk (float32): 256K values = 1 MiB, stays in L2
_CHUNK_ELEMS = 1 << 18

# Formats whose float32 decode is exact (every value is a product of at most 24 significant bits:
# Q8_0 8 x 11, IQ2_XXS 11 x 5 x 6, MXFP4 a power of two x 4): their float64 decode is the float32
# one, widened. Q2_K and Q4_K subtract a minimum (d * sc * q - dmin * m) from a product with
# another exponent, which float32 may round; their float64 decode computes every step in float64,
# which is exact (up to exponent gaps that no real scale pair has).
_DEC_F64 = frozenset({Q2_K, Q4_K})


def _as_bytes(raw: np.ndarray) -> np.ndarray:
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        if raw.ndim == 0:
            raw = raw.reshape(1)
        raw = raw.view(np.uint8)  # last axis must be contiguous; numpy raises otherwise
    return raw


def dequantize(type_id: int, raw: np.ndarray, dtype=np.float32) -> np.ndarray:
    """Decode packed blocks: uint8 (..., k*block_bytes) -> float32 (..., k*block_elems).

    ``raw`` may be a (non-contiguous) view into an np.memmap; it is decoded in
    chunks, making only the chunk being decoded contiguous.  The result is a new
    C-contiguous float32 array.  I32 raises ValueError (view it as int32 instead).
    dtype=np.float64 gives the exact values of the blocks (gguf-py's float32 roundings are
    skipped: they only ever round Q2_K / Q4_K's minimum subtraction; see _DEC_F64).
    """
    type_id = int(type_id)
    f = _format(type_id)
    if type_id == I32:
        raise ValueError("I32 is not a float format; view the bytes as int32 instead")
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        raise ValueError(f"dequantize: dtype must be float32 or float64, got {dtype}")
    if dtype == np.float64 and type_id not in _DEC_F64:
        return dequantize(type_id, raw).astype(np.float64)
    raw = _as_bytes(raw)
    if raw.ndim == 0:
        raise ValueError("dequantize needs at least a 1-D byte array")
    nb_row = raw.shape[-1]
    bb, be = f.block_bytes, f.block_elems
    if nb_row % bb:
        raise ValueError(f"{f.name}: last axis of {nb_row} bytes is not a multiple of the block size {bb}")
    bpr = nb_row // bb  # blocks per row
    lead = raw.shape[:-1]
    out = np.empty(lead + (bpr * be,), dtype=dtype)
    if out.size == 0:
        return out
    rows = raw.reshape(-1, nb_row)  # a view for 1-D/2-D input (and any mergeable leading dims)
    nrows = rows.shape[0]
    out_rows = out.reshape(nrows, bpr, be)
    dec = _DECODERS[type_id]
    chunk_blocks = max(1, _CHUNK_ELEMS // be)
    if bpr >= chunk_blocks:
        # long rows: split each row into chunks of blocks
        for r in range(nrows):
            row = rows[r]
            orow = out_rows[r]
            for b0 in range(0, bpr, chunk_blocks):
                b1 = min(bpr, b0 + chunk_blocks)
                src = np.ascontiguousarray(row[b0 * bb:b1 * bb]).reshape(b1 - b0, bb)
                dec(src, orow[b0:b1])
    else:
        rows_per = max(1, chunk_blocks // bpr)
        for r0 in range(0, nrows, rows_per):
            r1 = min(nrows, r0 + rows_per)
            src = np.ascontiguousarray(rows[r0:r1]).reshape((r1 - r0) * bpr, bb)
            dec(src, out_rows[r0:r1].reshape((r1 - r0) * bpr, be))
    return out


def dequantize_rows(type_id: int, data2d: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) of a 2-D packed tensor (uint8 [n_rows, row_bytes]) -> float32 [stop-start, n_elems].

    Only the bytes of the requested rows are read.
    """
    data2d = _as_bytes(data2d)
    if data2d.ndim != 2:
        raise ValueError(f"dequantize_rows needs a 2-D byte array, got shape {data2d.shape}")
    n = data2d.shape[0]
    start, stop = int(start), int(stop)
    if not (0 <= start <= stop <= n):
        raise ValueError(f"row range [{start}, {stop}) outside [0, {n})")
    return dequantize(type_id, data2d[start:stop])


def matvec(type_id: int, data2d: np.ndarray, x: np.ndarray, rows: slice | None = None,
           chunk_rows: int = 256, accumulate=np.float32) -> np.ndarray:
    """Reference y = W[rows] @ x for a packed 2-D weight (uint8 [n_rows, row_bytes]).

    x: float32 [n_elems] or [n_elems, T].  Streams ``chunk_rows`` rows at a time
    (dequantize -> matmul); the whole float matrix is never built.
    accumulate=np.float64 does the products and sums in float64 and rounds once: the result
    then no longer depends on BLAS's summation order (gemv vs gemm, batch size).  With it x may
    be float64 (ds4's exact Q8 activations, numerics.q8_*_exact): then the weights are decoded
    exactly too (dequantize(..., np.float64)), and the result is the exact sum of the exact
    products rounded once to float32, but for the float64 rounding inside the sum (it changes the
    float32 result only near a tie: ~2^-29 of values), whatever the order -- the cpu backend's
    integer kernels compute the same function.  Otherwise x is converted to float32 and the
    weights are gguf-py's float32 values.  Returns float32 [n_sel] or [n_sel, T].
    """
    acc = np.dtype(accumulate)
    f = _format(type_id)
    data2d = _as_bytes(data2d)
    if data2d.ndim != 2:
        raise ValueError(f"matvec needs a 2-D byte array, got shape {data2d.shape}")
    if data2d.shape[1] % f.block_bytes:
        raise ValueError(f"{f.name}: row of {data2d.shape[1]} bytes is not a multiple of {f.block_bytes}")
    n_elems = data2d.shape[1] // f.block_bytes * f.block_elems
    x = np.asarray(x)
    exact = acc == np.float64 and x.dtype == np.float64
    x = x if exact else x.astype(np.float32, copy=False)
    if x.ndim not in (1, 2) or x.shape[0] != n_elems:
        raise ValueError(f"x of shape {x.shape} does not match rows of {n_elems} elements")
    if rows is not None:
        if not isinstance(rows, slice):
            raise TypeError("rows must be a slice or None")
        data2d = data2d[rows]
    chunk_rows = max(1, int(chunk_rows))
    n_sel = data2d.shape[0]
    y = np.empty((n_sel,) + x.shape[1:], dtype=np.float32)
    if acc != np.float32:
        x = x.astype(acc, copy=False)
    for r0 in range(0, n_sel, chunk_rows):
        r1 = min(n_sel, r0 + chunk_rows)
        if acc == np.float32:
            np.matmul(dequantize(type_id, data2d[r0:r1]), x, out=y[r0:r1])
        elif exact:
            y[r0:r1] = np.matmul(dequantize(type_id, data2d[r0:r1], np.float64), x)
        else:
            y[r0:r1] = np.matmul(dequantize(type_id, data2d[r0:r1]).astype(acc), x)
    return y


# ---------------------------------------------------------------------------
# synthetic data


def _random_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    """n uniformly random bytes (writable), via 64-bit draws (fast)."""
    words = rng.integers(0, 2**64, size=(n + 7) // 8, dtype=np.uint64, endpoint=False)
    return words.view(np.uint8)[:n]


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    """float values (n,) -> (n, 2) uint8 of finite f16."""
    h = np.asarray(v, dtype=np.float32).astype(np.float16)
    if not np.all(np.isfinite(h)):
        raise ValueError("scale does not fit in f16 (std too large)")
    return h.view(np.uint8).reshape(-1, 2)


@functools.lru_cache(maxsize=1)
def _normal_quantiles() -> np.ndarray:
    """float32 [65536]: standard normal quantiles at (k + 0.5) / 65536 (read-only)."""
    nd = statistics.NormalDist()
    z = np.array([nd.inv_cdf((k + 0.5) / 65536.0) for k in range(32768, 65536)], dtype=np.float64)
    z = np.concatenate([-z[::-1], z]).astype(np.float32)  # exactly symmetric
    z.flags.writeable = False
    return z


def _f32_to_bf16_bits(v: np.ndarray) -> np.ndarray:
    """finite float32 -> bf16 bits, round to nearest even (as ggml_compute_fp32_to_bf16)."""
    u = np.ascontiguousarray(v, dtype=np.float32).view(np.uint32)
    r = (u >> np.uint32(16)) & np.uint32(1)
    r += np.uint32(0x7FFF)
    r += u
    r >>= np.uint32(16)
    return r.astype(np.uint16)


# E[g^2] over the iq2xxs grid values (grid indices uniform)
_IQ2XXS_MEAN_G2 = float(np.mean(IQ2XXS_GRID_BYTES.astype(np.float64) ** 2))


def random_blocks(type_id: int, rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
    """uint8 [n_blocks * block_bytes] of valid random blocks whose values have mean ~0, std ~``std``.

    Quant codes are uniform random; scale fields are finite (f16) and chosen so
    that the expected second moment equals std**2.  Per-block scales vary
    (uniform factor in [0.5, 1.5]) so kernels that mix up blocks are caught.
    F32/F16/BF16: normal(0, std) in that dtype.  I32: ValueError.
    """
    type_id = int(type_id)
    f = _format(type_id)
    n = int(n_blocks)
    std = float(std)
    if n < 0:
        raise ValueError("n_blocks must be >= 0")
    if not (std >= 0 and math.isfinite(std)):
        raise ValueError("std must be finite and >= 0")
    if type_id == I32:
        raise ValueError("I32 is not a float format")
    if type_id == F32:
        v = rng.standard_normal(n, dtype=np.float32)
        v *= np.float32(std)
        return v.view(np.uint8)
    if type_id in (F16, BF16):
        # 16-bit outputs: sample 65536 equiprobable normal quantiles (|z| <= 4.3), already
        # rounded to the output type; a table lookup is ~10x faster than standard_normal.
        table = _normal_quantiles() * np.float32(std)
        if type_id == F16:
            tbits = table.astype(np.float16).view(np.uint16)
        else:
            tbits = _f32_to_bf16_bits(table)
        idx = _random_bytes(rng, 2 * n).view(np.uint16)
        return np.take(tbits, idx).view(np.uint8)

    raw = _random_bytes(rng, n * f.block_bytes)
    blocks = raw.reshape(n, f.block_bytes)
    if n == 0:
        return raw
    # per-block scale factor u ~ U[0.5, 1.5]: E[u^2] = 13/12
    u = rng.uniform(0.5, 1.5, size=n) / math.sqrt(13.0 / 12.0)

    _set_block_scales(type_id, blocks, u, std, rng)
    return raw


def _set_block_scales(type_id: int, blocks: np.ndarray, u: np.ndarray, std: float, rng: np.random.Generator) -> None:
    """random_blocks' scale fields, in place, over the random codes: each block's scale set so
    that the values' second moment is std**2, times the block's factor u."""
    n = len(blocks)
    if type_id == Q8_0:
        # q uniform int8: E[q] = -0.5, E[q^2] = 5461.5
        blocks[:, 0:2] = _f16_bytes(u * (std / math.sqrt(5461.5)))
    elif type_id == Q2_K:
        # scale = min = s in [8, 15] and dmin = 1.5 d, so y = d*s*(q - 1.5): mean 0,
        # E[(q-1.5)^2] = 1.25, E[s^2] = 137.5
        # s = 8 + 3 random bits of the (already random) scale bytes; byte = s | s << 4
        sc = blocks[:, 0:16]
        sc &= np.uint8(7)
        sc |= np.uint8(8)
        sc *= np.uint8(17)
        d = (u * (std / math.sqrt(1.25 * 137.5))).astype(np.float32)
        blocks[:, 80:82] = _f16_bytes(d)
        blocks[:, 82:84] = _f16_bytes(d * np.float32(1.5))
    elif type_id == Q4_K:
        # scale = min = s in [32, 63] and dmin = 7.5 d, so y = d*s*(q - 7.5): mean 0,
        # E[(q-7.5)^2] = 21.25, E[s^2] = 47.5^2 + 85.25 = 2341.5
        S = blocks[:, 4:16]
        s = (S[:, 0:8] & np.uint8(31)) | np.uint8(32)  # 5 random bits of the random scale bytes
        sc = mn = s
        S[:, 0:4] = (sc[:, 0:4] & np.uint8(63)) | ((sc[:, 4:8] >> np.uint8(4)) << np.uint8(6))
        S[:, 4:8] = (mn[:, 0:4] & np.uint8(63)) | ((mn[:, 4:8] >> np.uint8(4)) << np.uint8(6))
        S[:, 8:12] = (sc[:, 4:8] & np.uint8(15)) | ((mn[:, 4:8] & np.uint8(15)) << np.uint8(4))
        d = (u * (std / math.sqrt(21.25 * 2341.5))).astype(np.float32)
        blocks[:, 0:2] = _f16_bytes(d)
        blocks[:, 2:4] = _f16_bytes(d * np.float32(7.5))
    elif type_id == IQ2_XXS:
        # all codes random; signs are symmetric so mean 0.
        # E[y^2] = d^2 * 0.0625 * E[(0.5+s)^2] * E[g^2], E[(0.5+s)^2] = 85.25
        blocks[:, 0:2] = _f16_bytes(u * (std / math.sqrt(0.0625 * 85.25 * _IQ2XXS_MEAN_G2)))
    elif type_id == MXFP4:
        # y = 2^(e-128) * k, k uniform over kvalues: E[k] = 0, E[k^2] = 34.25.
        # Pick e in {e0, e0+1} per block with P(e0+1) = p so E[scale^2] = target^2 exactly.
        target = std / math.sqrt(34.25)
        if target <= 0:
            e0, p = 1, 0.0
        else:
            e0 = math.floor(math.log2(target)) + 128
            r2 = (target / 2.0 ** (e0 - 128)) ** 2  # in [1, 4)
            p = (r2 - 1.0) / 3.0
            if e0 < 1:
                e0, p = 1, 0.0
            elif e0 > 253:
                e0, p = 253, 1.0
        e = (e0 + (rng.random(n) < p)).astype(np.uint8)
        blocks[:, 0] = e
    else:  # pragma: no cover
        raise ValueError(f"random_blocks: unsupported type {_format(type_id).name}")
