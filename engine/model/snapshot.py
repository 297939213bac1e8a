"""The DSV4 session payload (spec/kvcache.md §3): a timeline's tokens, logits and KV state as bytes.

Layout (little endian, no padding): 13 u32 header; u32 tokens[T]; f32 logits[vocab];
u32 n_comp[n_layer]; u32 n_index[n_layer]; then per layer the last R raw rows in position order,
and for compressed layers the compressed rows and the compressor frontier (kv, then score) in
ds4's slot layout — [ratio, hd] for ratio 128, [8, 2*hd] for ratio 4 (rows 0-3 the previous
window, 4-7 the current one) — plus, on ratio-4 layers, the indexer rows and indexer frontier.
Frontier slots that hold no live token are written as ds4 leaves them after a prefill (kv 0,
score -1e30), so the bytes are a function of the logical state alone.
"""
from __future__ import annotations

import struct

import numpy as np

from ..gguf.config import CSA_RATIO, ModelConfig
from .kv_state import NEG_INF_SCORE, KVState, PosRing

MAGIC, VERSION = 0x34565344, 1
HEADER = struct.Struct("<13I")


class SnapshotError(ValueError):
    """A payload that does not fit this model or session; the message names the field."""


def prefill_cap(ctx: int, chunk: int) -> int:
    return min(ctx, chunk)


def raw_window(c: ModelConfig, ctx: int) -> int:
    return min(c.n_swa, ctx)


def _frontier(ring: PosRing, n_tokens: int, ratio: int, fill=0.0) -> np.ndarray:
    """The ds4 slot layout of a compressor frontier, from the per-position ring."""
    coff = 2 if ratio == CSA_RATIO else 1
    out = np.full((coff * ratio, ring.width), fill, np.float32)
    ws = n_tokens // ratio * ratio
    if ratio == CSA_RATIO and ws >= ratio:
        out[:ratio] = ring.read(ws - ratio, ws)
    cur = ring.read(ws, n_tokens)
    out[(coff - 1) * ratio:(coff - 1) * ratio + len(cur)] = cur
    return out


def _load_frontier(ring: PosRing, data: np.ndarray, n_tokens: int, ratio: int):
    coff = 2 if ratio == CSA_RATIO else 1
    ws = n_tokens // ratio * ratio
    lo = ws
    if ratio == CSA_RATIO and ws >= ratio:
        ring.write(ws - ratio, data[:ratio])
        lo = ws - ratio
    n_cur = n_tokens - ws
    if n_cur:
        ring.write(ws, data[(coff - 1) * ratio:(coff - 1) * ratio + n_cur])
    ring.avail_lo = lo


def save(c: ModelConfig, state: KVState, tokens: list[int], logits: np.ndarray, chunk: int) -> bytes:
    T, ctx = len(tokens), state.ctx
    R = min(raw_window(c, ctx), T)
    return pack(c, ctx, chunk, tokens, logits, [ls.n_comp for ls in state.layers],
                [ls.n_index for ls in state.layers], [layer_block(ls, T, R) for ls in state.layers])


def pack(c: ModelConfig, ctx: int, chunk: int, tokens, logits, n_comp, n_index, blocks) -> bytes:
    """The payload from its parts: every layer's row counts and block (layer_block), in layer
    order (a split run gathers them from its ranks: engine/runtime/split_engine.py)."""
    T = len(tokens)
    R = min(raw_window(c, ctx), T)
    parts = [HEADER.pack(MAGIC, VERSION, ctx, prefill_cap(ctx, chunk), raw_window(c, ctx), raw_window(c, ctx),
                         ctx // 4 + 2, T, c.n_layer, c.head_dim, c.idx_head_dim, c.n_vocab, R),
             np.asarray(tokens, dtype="<u4").tobytes(),
             np.asarray(logits, dtype="<f4").tobytes(),
             np.asarray(n_comp, "<u4").tobytes(),
             np.asarray(n_index, "<u4").tobytes()]
    return b"".join(parts + list(blocks))


def layer_block(ls, T: int, R: int) -> bytes:
    """One layer's part of the payload: its last R raw rows, compressed rows and frontiers."""
    parts = [ls.raw.read(T - R, T).astype("<f4").tobytes()]
    if ls.ratio:
        parts.append(ls.comp[:ls.n_comp].astype("<f4").tobytes())
        parts.append(_frontier(ls.proj_kv, T, ls.ratio).tobytes())
        parts.append(_frontier(ls.proj_sc, T, ls.ratio, NEG_INF_SCORE).tobytes())
    if ls.ratio == CSA_RATIO:
        parts.append(ls.index[:ls.n_index].astype("<f4").tobytes())
        parts.append(_frontier(ls.iproj_kv, T, ls.ratio).tobytes())
        parts.append(_frontier(ls.iproj_sc, T, ls.ratio, NEG_INF_SCORE).tobytes())
    return b"".join(parts)


def _block_bytes(c: ModelConfig, il: int, R: int, n_comp: int, n_index: int) -> int:
    """The length of layer il's block (layer_block) with these row counts."""
    r, n = c.ratio(il), R * c.head_dim
    if r:
        n += n_comp * c.head_dim + 2 * (2 if r == CSA_RATIO else 1) * r * c.compressor_width(il)
    if r == CSA_RATIO:
        n += n_index * c.idx_head_dim + 2 * 2 * r * 2 * c.idx_head_dim
    return 4 * n


def load(c: ModelConfig, state: KVState, data: bytes) -> tuple[list[int], np.ndarray]:
    """Fill `state` from a payload; returns (tokens, logits). Raises SnapshotError on any mismatch."""
    buf = memoryview(data)
    if len(buf) < HEADER.size:
        raise SnapshotError(f"payload is {len(buf)} bytes, shorter than its {HEADER.size}-byte header")
    (magic, version, s_ctx, _pcap, raw_cap, s_raw_window, comp_cap, T, n_layer, hd, ihd, vocab,
     R) = HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise SnapshotError(f"not a DSV4 session payload (magic {magic:#x})")
    if version != VERSION:
        raise SnapshotError(f"unsupported payload version {version}")
    ctx = state.ctx
    for name, got, want in (("layer count", n_layer, c.n_layer), ("head dim", hd, c.head_dim),
                            ("indexer head dim", ihd, c.idx_head_dim), ("vocab", vocab, c.n_vocab),
                            ("raw window", s_raw_window, raw_window(c, ctx))):
        if got != want:
            raise SnapshotError(f"payload {name} is {got}, this model/session has {want}")
    if s_ctx > ctx or T >= ctx:
        raise SnapshotError(f"payload was made with context {s_ctx} and holds {T} tokens; this session's "
                            f"context is {ctx}")
    if R != min(T, s_raw_window) or raw_cap == 0 or R > raw_cap:
        raise SnapshotError(f"payload raw row count {R} does not match its {T} tokens")
    off = HEADER.size

    def take(n_bytes, what):
        nonlocal off
        if off + n_bytes > len(buf):
            raise SnapshotError(f"payload truncated in {what} (needs {off + n_bytes} bytes, has {len(buf)})")
        out = buf[off:off + n_bytes]
        off += n_bytes
        return out

    def f32(rows, width, what):
        return np.frombuffer(take(4 * rows * width, what), dtype="<f4").reshape(rows, width).astype(np.float32)

    tokens = np.frombuffer(take(4 * T, "tokens"), dtype="<u4").astype(np.int64).tolist()
    if any(t >= c.n_vocab for t in tokens):
        raise SnapshotError("payload holds token ids outside the vocabulary")
    logits = np.frombuffer(take(4 * c.n_vocab, "logits"), dtype="<f4").astype(np.float32)
    n_comp = np.frombuffer(take(4 * n_layer, "row counts"), dtype="<u4")
    n_index = np.frombuffer(take(4 * n_layer, "indexer row counts"), dtype="<u4")
    state.reset()
    held = getattr(state.layers, "get", None)   # a split rank's state holds some layers (layer_split.py)
    for il in range(n_layer):
        ls = state.layers[il] if held is None else held(il)
        r = c.ratio(il)
        want_comp = T // r if r else 0
        if (n_comp[il] != want_comp) or (n_comp[il] > comp_cap) or (n_index[il] != (want_comp if r == CSA_RATIO else 0)):
            raise SnapshotError(f"layer {il}: payload row counts {n_comp[il]}/{n_index[il]} do not match "
                                f"{T} tokens at ratio {r}")
        if ls is None:                          # another rank's layer: its bytes are passed over
            take(_block_bytes(c, il, R, int(n_comp[il]), int(n_index[il])), f"layer {il}")
            continue
        ls.raw.write(T - R, f32(R, hd, f"layer {il} raw rows"))
        ls.raw.avail_lo = T - R
        if r:
            coff = 2 if r == CSA_RATIO else 1
            ls.comp[:n_comp[il]] = f32(int(n_comp[il]), hd, f"layer {il} compressed rows")
            ls.n_comp = int(n_comp[il])
            w = ls.proj_kv.width
            _load_frontier(ls.proj_kv, f32(coff * r, w, f"layer {il} frontier"), T, r)
            _load_frontier(ls.proj_sc, f32(coff * r, w, f"layer {il} frontier"), T, r)
        if r == CSA_RATIO:
            ls.index[:n_index[il]] = f32(int(n_index[il]), ihd, f"layer {il} indexer rows")
            ls.n_index = int(n_index[il])
            w = ls.iproj_kv.width
            _load_frontier(ls.iproj_kv, f32(2 * r, w, f"layer {il} indexer frontier"), T, r)
            _load_frontier(ls.iproj_sc, f32(2 * r, w, f"layer {il} indexer frontier"), T, r)
    if off != len(buf):
        raise SnapshotError(f"payload has {len(buf) - off} trailing bytes")
    return tokens, logits
