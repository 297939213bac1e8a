"""GGUF weights on the device: the raw blocks as the map holds them (uploaded once), and the
array-op forms of their decoders and products, written against `xp` (cupy or the stand-in).

The decoders are engine/gguf/quants.py's, step for step: in float32 they give gguf-py's values bit
for bit, in float64 the exact ones. `matmul` is NumpyOps.linear's product (float64 sums rounded
once to float32), a chunk of rows decoded at a time. These forms are correct everywhere and are
what runs where a kernel is missing (kernels.py); the kernels read the same raw blocks.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ...gguf import quants as Q

# decoded values per chunk of a product (float64: 128 MiB)
CHUNK_ELEMS = 1 << 24
KIND = {Q.Q8_0: "q8_0", Q.F16: "f16", Q.IQ2_XXS: "iq2_xxs", Q.Q2_K: "q2_k", Q.Q4_K: "q4_k",
        Q.MXFP4: "mxfp4"}


@dataclass(frozen=True)
class DevTensor:
    """A weight on the device: `data` uint8 [n_rows, row_bytes] (rows = output units), the GGUF
    blocks unchanged; an expert tensor [in, out, n_expert] is n_expert consecutive [out, in]."""
    name: str
    type_id: int
    dims: tuple
    data: object

    @property
    def n_in(self) -> int:
        return self.dims[0]

    @property
    def n_rows(self) -> int:
        return self.data.shape[0]

    @property
    def n_out(self) -> int:
        return self.dims[1] if len(self.dims) > 1 else 1

    @property
    def kind(self) -> str | None:
        return KIND.get(self.type_id)

    def expert(self, e: int) -> "DevTensor":
        n_out = self.dims[1]
        return DevTensor(f"{self.name}[{e}]", self.type_id, self.dims[:2], self.data[e * n_out:(e + 1) * n_out])

    def experts3(self):
        """The expert tensor as [n_expert, n_out, row_bytes] (a view)."""
        return self.data.reshape(self.dims[2], self.dims[1], self.data.shape[1])


def _c(xp, a):
    return xp.ascontiguousarray(a)


def _f16(xp, col, dtype):
    return _c(xp, col).view(xp.float16).astype(dtype)


@functools.lru_cache(maxsize=4)
def _tables(xp):
    """The decoders' tables, uploaded once per namespace."""
    return {"iq2": xp.asarray(Q._build_iq2xxs_signed_table()), "mx": xp.asarray(Q.MXFP4_KVALUES)}


def _dec_q8_0(xp, b, dtype):
    return _c(xp, b[:, 2:]).view(xp.int8).astype(dtype) * _f16(xp, b[:, 0:2], xp.float32).astype(dtype)


def _dec_q2_k(xp, b, dtype):
    n = b.shape[0]
    sc = b[:, 0:16]
    d, dmin = _f16(xp, b[:, 80:82], dtype), _f16(xp, b[:, 82:84], dtype)
    dl = (d * (sc & 15).astype(dtype)).reshape(n, 16, 1)
    ml = (dmin * (sc >> 4).astype(dtype)).reshape(n, 16, 1)
    # element 128h + 32j + l <- (qs[32h + l] >> 2j) & 3
    qs = b[:, 16:80].reshape(n, 2, 1, 32)
    sh = xp.asarray(np.array([0, 2, 4, 6], np.uint8)).reshape(1, 1, 4, 1)
    q = ((qs >> sh) & 3).reshape(n, 16, 16).astype(dtype)
    return (dl * q - ml).reshape(n, 256)


def _q4_k_scale_min(xp, s):
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = xp.concatenate([lo & 63, (hi & 15) | ((lo >> 6) << 4)], axis=1)
    mn = xp.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return sc, mn


def _dec_q4_k(xp, b, dtype):
    n = b.shape[0]
    d, dmin = _f16(xp, b[:, 0:2], dtype), _f16(xp, b[:, 2:4], dtype)
    sc, mn = _q4_k_scale_min(xp, b[:, 4:16])
    dl = (d * sc.astype(dtype)).reshape(n, 8, 1)
    ml = (dmin * mn.astype(dtype)).reshape(n, 8, 1)
    # element 64p + 32h + l <- (qs[32p + l] >> 4h) & 15
    qs = b[:, 16:144].reshape(n, 4, 1, 32)
    sh = xp.asarray(np.array([0, 4], np.uint8)).reshape(1, 1, 2, 1)
    q = ((qs >> sh) & 15).reshape(n, 8, 32).astype(dtype)
    return (dl * q - ml).reshape(n, 256)


def _dec_iq2_xxs(xp, b, dtype):
    n = b.shape[0]
    d = _f16(xp, b[:, 0:2], xp.float32)
    qs = _c(xp, b[:, 2:66])
    a1 = qs.view(xp.uint32)[:, 1::2]                                           # [n, 8]
    db = d * (np.float32(0.5) + (a1 >> 28).astype(xp.float32)) * np.float32(0.25)
    a0 = qs.reshape(n, 8, 8)[:, :, 0:4].astype(xp.uint32)                     # grid index per 8 values
    sh = xp.asarray(np.array([0, 7, 14, 21], np.uint32)).reshape(1, 1, 4)
    idx = ((a1[:, :, None] >> sh) & 127) | (a0 << 7)                          # [n, 8, 4]
    vals = xp.take(_tables(xp)["iq2"], idx.astype(xp.int64).reshape(-1), axis=0).reshape(n, 8, 32)
    return (db.astype(dtype)[:, :, None] * vals.astype(dtype)).reshape(n, 256)


def _dec_mxfp4(xp, b, dtype):
    n = b.shape[0]
    e = b[:, 0:1].astype(xp.uint32)
    bits = xp.where(e < 2, xp.left_shift(xp.asarray(np.uint32(0x00200000)), e), (e - 1) << 23)
    d = _c(xp, bits.astype(xp.uint32)).view(xp.float32)
    sh = xp.asarray(np.array([0, 4], np.uint8)).reshape(1, 2, 1)
    nib = (b[:, 1:17].reshape(n, 1, 16) >> sh) & 15
    vals = xp.take(_tables(xp)["mx"], nib.astype(xp.int64).reshape(-1)).reshape(n, 32)
    return d.astype(dtype) * vals.astype(dtype)


def _dec_float(xp, b, dtype, t):
    if t == Q.F32:
        return _c(xp, b).view(xp.float32).astype(dtype)
    if t == Q.F16:
        return _c(xp, b).view(xp.float16).astype(dtype)
    return (_c(xp, b).view(xp.uint16).astype(xp.uint32) << 16).view(xp.float32).astype(dtype)   # BF16


_DECODERS = {Q.Q8_0: _dec_q8_0, Q.Q2_K: _dec_q2_k, Q.Q4_K: _dec_q4_k, Q.IQ2_XXS: _dec_iq2_xxs,
             Q.MXFP4: _dec_mxfp4}


def dequantize(xp, type_id: int, data, dtype=np.float32):
    """float [n_rows, n_in] of uint8 rows `data` [n_rows, row_bytes] (quants.dequantize's values)."""
    f = Q.FORMATS[type_id]
    n_rows = data.shape[0]
    blocks = _c(xp, data).reshape(-1, f.block_bytes)
    dec = _DECODERS.get(type_id)
    out = dec(xp, blocks, dtype) if dec is not None else _dec_float(xp, blocks, dtype, type_id)
    return out.reshape(n_rows, -1)


def matmul(xp, w: DevTensor, x, rows: slice | None = None):
    """x [T, n_in] (float32, or float64: ds4's exact Q8 activations) -> float32 [T, n_sel] =
    x @ W[rows].T, float64 products and sums rounded once (NumpyOps.linear)."""
    data = w.data if rows is None else w.data[rows]
    exact = x.dtype == np.float64
    x64 = x.astype(xp.float64)
    step = max(1, CHUNK_ELEMS // max(1, w.n_in))
    outs = []
    for r0 in range(0, data.shape[0], step):
        wd = dequantize(xp, w.type_id, data[r0:r0 + step], xp.float64 if exact else xp.float32)
        outs.append((x64 @ wd.astype(xp.float64).T).astype(xp.float32))
    return outs[0] if len(outs) == 1 else xp.concatenate(outs, axis=1)
