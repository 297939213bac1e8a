"""The MLX-ops twin for IQ2_XXS and Q2_K: decode GGUF blocks with mx ops, then matmul in float32.

MLX has no kernel for these formats (Q2_K's 16-value sub-blocks are smaller than MLX's smallest
quantization group, 32; IQ2_XXS is a codebook format), so the weights stay as the raw GGUF block
bytes (an mx.uint8 array, the same size as in the file) and are decoded on the fly, ONLY for the rows
or experts a product uses. This twin is the reference for the Metal kernels (engine/backends/mlx/
metal.py has the same call signature) and the path used off Apple.

Both decoders repeat the float32 steps of engine.gguf.quants (``_dec_iq2_xxs``, ``_dec_q2_k``) in the
same order, so the decoded values are bit-identical to the NumPy decoder (the test compares bits).
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from engine.gguf import quants as Q

# Decoded float32 bytes one decode step may hold at a time: bounds the twin's scratch memory
# (a routed expert of DeepSeek V4 Flash decodes to 2048 x 4096 x 4 B = 32 MiB).
_DECODE_BUDGET = 256 << 20

# IQ2_XXS: one table row per (grid index, sign pattern) = grid[g] with the signs of ksigns[s]
# applied, 8 int8 values packed in one uint64 [256 * 128]: one mx.take moves a group's 8 signed
# values (8 bytes, the table stays in cache: 256 KiB), about twice as fast as a float32 row table.
_SIGN_BITS = (Q.KSIGNS_IQ2XS[:, None] >> np.arange(8, dtype=np.uint8)) & np.uint8(1)   # [128, 8]
_SIGNED_GRID_NP = (Q.IQ2XXS_GRID_BYTES.astype(np.int8)[:, None, :]                      # values <= 43
                   * (1 - 2 * _SIGN_BITS.astype(np.int8))[None, :, :]).reshape(256 * 128, 8)
_SIGNED_GRID: mx.array | None = None   # built on first use (import stays free of mx allocations)


def _signed_grid() -> mx.array:
    global _SIGNED_GRID
    if _SIGNED_GRID is None:
        _SIGNED_GRID = mx.array(np.ascontiguousarray(_SIGNED_GRID_NP).view(np.uint64).reshape(-1))
    return _SIGNED_GRID


def _f16_field(blocks: mx.array, lo: int) -> mx.array:
    """Bytes lo, lo+1 of each block (a little-endian f16) -> float32 [n, 1] (exact)."""
    return blocks[:, lo:lo + 2].view(mx.float16).astype(mx.float32)


def _u32_words(b: mx.array) -> mx.array:
    """uint8 [..., 4k] -> uint32 [..., k], little endian (built from bytes: slices need no alignment)."""
    b = b.astype(mx.uint32)
    return b[..., 0::4] | (b[..., 1::4] << 8) | (b[..., 2::4] << 16) | (b[..., 3::4] << 24)


def decode_iq2_xxs(blocks: mx.array) -> mx.array:
    """uint8 [n, 66] IQ2_XXS blocks -> float32 [n, 256].

    Block: f16 d, then 8 groups of (4 grid-index bytes a0, u32 a1). a1's top 4 bits s scale the group:
    db = (d * (0.5 + s)) * 0.25; its bits 7l..7l+6 pick the sign pattern of the l-th 8 values.
    """
    n = blocks.shape[0]
    d = _f16_field(blocks, 0)                                       # [n, 1]
    groups = blocks[:, 2:66].reshape(n, 8, 8)                       # 8 groups x (a0 bytes, a1 bytes)
    a1 = _u32_words(groups[:, :, 4:8])[:, :, 0]                     # [n, 8]
    db = d * (mx.array(0.5, mx.float32) + (a1 >> 28).astype(mx.float32)) * mx.array(0.25, mx.float32)
    sign_idx = (a1[:, :, None] >> (mx.arange(4, dtype=mx.uint32) * 7)) & 127    # [n, 8, 4]
    row = (groups[:, :, 0:4].astype(mx.uint32) << 7) | sign_idx                 # grid * 128 + sign
    vals = mx.take(_signed_grid(), row.reshape(-1)).view(mx.int8).reshape(n, 8, 32)
    return (db[:, :, None] * vals.astype(mx.float32)).reshape(n, 256)


def decode_q2_k(blocks: mx.array) -> mx.array:
    """uint8 [n, 84] Q2_K blocks -> float32 [n, 256].

    Block: u8 scales[16] (low 4 bits scale, high 4 bits min of each 16-value sub-block), u8 qs[64],
    f16 d, f16 dmin. Element 128h + 32j + l is (qs[32h + l] >> 2j) & 3; y = (d*sc) * q - dmin*m.
    """
    n = blocks.shape[0]
    sc = blocks[:, 0:16]
    d = _f16_field(blocks, 80)
    dmin = _f16_field(blocks, 82)
    dl = d * (sc & 15).astype(mx.float32)                             # [n, 16]
    ml = dmin * (sc >> 4).astype(mx.float32)
    qs = blocks[:, 16:80].reshape(n, 2, 1, 32)
    q = (qs >> (mx.arange(4, dtype=mx.uint8) * 2).reshape(1, 1, 4, 1)) & 3    # [n, h, j, l]
    q = q.reshape(n, 16, 16).astype(mx.float32)
    return (dl[:, :, None] * q - ml[:, :, None]).reshape(n, 256)


_DECODERS = {Q.IQ2_XXS: decode_iq2_xxs, Q.Q2_K: decode_q2_k}


def decode_rows(type_id: int, raw: mx.array, n_in: int) -> mx.array:
    """Raw rows uint8 [..., row_bytes] -> float32 [..., n_in]."""
    f = Q.FORMATS[type_id]
    lead = raw.shape[:-1]
    blocks = raw.reshape(-1, f.block_bytes)
    return _DECODERS[type_id](blocks).reshape(*lead, n_in)


def _rows_per_step(n_in: int) -> int:
    return max(1, _DECODE_BUDGET // (4 * n_in))


def twin_matmul(type_id: int, raw: mx.array, n_in: int, x: mx.array) -> mx.array:
    """x [T, n_in] float32 @ decode(raw [n_out, row_bytes]).T -> [T, n_out] float32.

    Rows are decoded a bounded slab at a time (see _DECODE_BUDGET), each slab evaluated before the
    next is built so the scratch never exceeds one slab.
    """
    n_out = raw.shape[0]
    step = _rows_per_step(n_in)
    if n_out <= step:
        return x @ decode_rows(type_id, raw, n_in).T
    parts = []
    for r0 in range(0, n_out, step):
        y = x @ decode_rows(type_id, raw[r0:r0 + step], n_in).T
        mx.eval(y)
        parts.append(y)
    return mx.concatenate(parts, axis=1)


def twin_gather_matmul(type_id: int, raw: mx.array, n_in: int, x: mx.array,
                       experts: np.ndarray, toks: mx.array, slots=None) -> mx.array:
    """out[p] = decode(raw[experts[p]]) @ x[toks[p]] -> [P, n_out] float32.

    raw: uint8 [n_expert, n_out, row_bytes]; experts: host int array [P], sorted (the caller checked).
    Only the experts that occur are gathered and decoded, a bounded number of them per step.
    slots: experts -> the rows of raw that hold them (the expert cache's slots), else the ids.
    """
    rows = (lambda sel: sel) if slots is None else slots      # noqa: E731
    decode = lambda sel: decode_rows(type_id, raw[rows(sel)], n_in)   # noqa: E731 (one use, two call sites)
    return gather_by_expert(decode, raw.shape[1], n_in, x, experts, toks)


def gather_by_expert(decode, n_out: int, n_in: int, x: mx.array, experts: np.ndarray,
                     toks: mx.array) -> mx.array:
    """Shared by the twin and dense 16-bit experts: ``decode(uint32 ids [U]) -> float32 [U, n_out, n_in]``.

    The pairs are sorted by expert, so the unique experts split them into contiguous runs; a step
    decodes up to _DECODE_BUDGET bytes of experts and multiplies their runs with one gather_mm.
    """
    uniq, first, counts = np.unique(experts, return_index=True, return_counts=True)
    per_step = max(1, _DECODE_BUDGET // (4 * n_out * n_in))
    xt = x[:, None, :]                                               # [T, 1, n_in]: gather_mm's M = 1
    parts = []
    for u0 in range(0, len(uniq), per_step):
        u1 = min(len(uniq), u0 + per_step)
        p0, p1 = int(first[u0]), int(first[u1 - 1] + counts[u1 - 1])
        wd = decode(mx.array(uniq[u0:u1].astype(np.uint32)))          # [U, n_out, n_in]
        local = np.repeat(np.arange(u1 - u0, dtype=np.uint32), counts[u0:u1])   # run -> decoded slot
        y = mx.gather_mm(xt, wd.swapaxes(1, 2), lhs_indices=toks[p0:p1],
                         rhs_indices=mx.array(local), sorted_indices=True)
        if u1 < len(uniq):
            mx.eval(y)   # free this step's decoded experts before decoding the next ones
        parts.append(y.reshape(p1 - p0, n_out))
    if not parts:
        return mx.zeros((0, n_out), dtype=mx.float32)
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
