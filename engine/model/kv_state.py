"""Per-layer KV state of one timeline, sized from the context.

What a layer keeps (spec/model.md §3.4-3.8, kvcache.md §1):
* raw rows: the last n_swa KV rows (K = V), in a ring indexed by position;
* compressed rows (ratio 4 and 128 layers): append-only, one per closed window;
* indexer rows (ratio 4 layers): append-only, one per closed window;
* the compressor frontier: the per-token projections (kv and gate score) of the window being
  filled — and, for the overlapping ratio-4 compressor, of the previous window too.

Rings hold `rewind_cap` positions more than the math needs, so the timeline can be cut back by up
to that many tokens in place (ds4 can only extend its state; we rewind without re-prefilling).
`avail_lo` is the lowest position each ring can still produce; a rewind below what the rings hold
falls back to a rebuild.

The arrays live where the backend computes: `xp` is the backend's array namespace (NumPy for the
host backends; a device backend passes its own, with `full`, `zeros` and `concatenate`). A device
array there has value semantics (a slice is a new array, not a view into the ring), so only the
NumPy rings hand out read-only views. `to_host` / `from_host` copy a whole state across, what a
device backend's state_to_host / state_from_host are made of.
"""
from __future__ import annotations

import numpy as np

from ..gguf.config import CSA_RATIO, ModelConfig

NEG_INF_SCORE = np.float32(-1e30)  # ds4's "no contribution" gate score for an empty frontier row


class PosRing:
    """Rows addressed by absolute position, in a ring of `cap` slots.

    `mirror` more rows repeat slots 0..mirror-1 after the last slot, so any `mirror + 1` rows in a
    row are one slice of the storage: `window` hands a decode step its attention window (the last
    n_swa raw rows) or its compressor frontier as a view instead of a copy (two copies of 256 KB a
    layer a token for the raw rows, each from memory the previous kernel call had evicted)."""

    def __init__(self, cap: int, width: int, fill=0.0, mirror: int = 0, xp=np):
        self.cap, self.width, self.mirror = cap, width, min(mirror, cap)
        self.xp, self._host = xp, xp is np
        self.rows = xp.full((cap + self.mirror, width), fill, dtype=xp.float32)
        self.avail_lo = 0  # positions >= avail_lo (and >= written_hi - cap) are readable

    # (read and write as at most two slices: at decode these run several times a layer, and each
    # NumPy call there runs cold -- an index array, its modulo and a gather cost 3 calls)
    def write(self, p0: int, rows: np.ndarray):
        n = rows.shape[0]
        if n > self.cap:  # only the newest cap rows survive
            rows, p0, n = rows[-self.cap:], p0 + n - self.cap, self.cap
        a = p0 % self.cap
        k = min(n, self.cap - a)              # rows up to the end of the ring, the rest from slot 0
        self._put(a, rows[:k])
        if k < n:
            self._put(0, rows[k:])

    def _put(self, a: int, rows: np.ndarray):
        self.rows[a:a + len(rows)] = rows
        m = min(a + len(rows), self.mirror)   # the mirrored slots among them
        if m > a:
            self.rows[self.cap + a:self.cap + m] = rows[:m - a]

    def _check(self, p0: int, p1: int):
        if p0 < self.avail_lo or p1 - p0 > self.cap:
            # a caller asked for rows the ring no longer holds: stale data must never be used
            raise RuntimeError(f"KV ring holds positions from {self.avail_lo} (cap {self.cap}), asked {p0}..{p1}")

    def read(self, p0: int, p1: int) -> np.ndarray:
        """A copy of the rows of positions [p0, p1)."""
        if p1 <= p0:
            return self.xp.zeros((0, self.width), dtype=self.xp.float32)
        self._check(p0, p1)
        a, n = p0 % self.cap, p1 - p0
        if a + n <= self.cap:
            v = self.rows[a:a + n]
            return v.copy() if self._host else v
        return self.xp.concatenate((self.rows[a:self.cap], self.rows[:a + n - self.cap]))

    def window(self, p0: int, p1: int) -> np.ndarray:
        """The rows of positions [p0, p1), read-only: a view of the storage where they lie in one
        slice (always, for at most mirror + 1 rows), else a copy. Valid until the next write."""
        if p1 <= p0:
            return self.xp.zeros((0, self.width), dtype=self.xp.float32)
        self._check(p0, p1)
        a, n = p0 % self.cap, p1 - p0
        if a + n > self.cap + self.mirror:
            return self.read(p0, p1)
        v = self.rows[a:a + n]
        if self._host:
            v.flags.writeable = False
        return v

    def write_window(self, lo: int, p0: int, rows: np.ndarray) -> np.ndarray:
        """Write rows at positions p0.. and return the rows of positions [lo, p0 + len(rows)), the
        new ones included (what an attention or compressor step reads): a read-only view where the
        ring holds them all in one slice, else a copy."""
        p1 = p0 + rows.shape[0]
        if p1 - lo <= self.cap:               # the older rows survive the write
            self.write(p0, rows)
            return self.window(lo, p1)
        out = self.xp.concatenate([self.read(lo, p0), rows])
        self.write(p0, rows)
        return out

    def holds(self, p0: int, end: int) -> bool:
        """Whether positions [p0, end) are all still in the ring when the timeline ends at `end`."""
        return p0 >= self.avail_lo and p0 >= end - self.cap

    def nbytes(self) -> int:
        return self.rows.nbytes

    def copy_to(self, xp, convert) -> "PosRing":
        """This ring with its rows converted by `convert` into a ring of namespace `xp`."""
        out = PosRing.__new__(PosRing)
        out.__dict__.update(self.__dict__)
        out.xp, out._host, out.rows = xp, xp is np, convert(self.rows)
        return out


def frontier_start(n_tokens: int, ratio: int) -> int:
    """First position whose projection the compressor still needs when n_tokens are in."""
    ws = n_tokens // ratio * ratio
    return max(0, ws - ratio) if ratio == CSA_RATIO else ws


class LayerState:
    RINGS = ("raw", "proj_kv", "proj_sc", "iproj_kv", "iproj_sc")
    ROWS = ("comp", "index")

    def __init__(self, c: ModelConfig, il: int, ctx: int, rewind_cap: int, xp=np):
        self.ratio = r = c.ratio(il)
        # mirrors: a decode step's window (n_swa raw rows; a frontier of up to coff * r rows) is one slice
        self.raw = PosRing(min(c.n_swa, ctx) + rewind_cap, c.head_dim, mirror=c.n_swa, xp=xp)
        self.n_comp = 0
        self.n_index = 0
        if r:
            w = c.compressor_width(il)
            coff = 2 if r == CSA_RATIO else 1
            self.comp_cap = ctx // r + 2
            self.comp = xp.zeros((self.comp_cap, c.head_dim), dtype=xp.float32)
            self.proj_kv = PosRing(coff * r + rewind_cap, w, mirror=coff * r, xp=xp)
            self.proj_sc = PosRing(coff * r + rewind_cap, w, NEG_INF_SCORE, mirror=coff * r, xp=xp)
        if r == CSA_RATIO:
            self.index = xp.zeros((self.comp_cap, c.idx_head_dim), dtype=xp.float32)
            self.iproj_kv = PosRing(2 * r + rewind_cap, 2 * c.idx_head_dim, mirror=2 * r, xp=xp)
            self.iproj_sc = PosRing(2 * r + rewind_cap, 2 * c.idx_head_dim, NEG_INF_SCORE, mirror=2 * r, xp=xp)

    def copy_to(self, xp, convert) -> "LayerState":
        """This layer's state with every array converted by `convert` (host <-> device)."""
        out = LayerState.__new__(LayerState)
        out.__dict__.update(self.__dict__)
        for k in self.RINGS:
            if k in self.__dict__:
                setattr(out, k, getattr(self, k).copy_to(xp, convert))
        for k in self.ROWS:
            if k in self.__dict__:
                setattr(out, k, convert(getattr(self, k)))
        return out

    def rings(self):
        out = [self.raw]
        if self.ratio:
            out += [self.proj_kv, self.proj_sc]
        if self.ratio == CSA_RATIO:
            out += [self.iproj_kv, self.iproj_sc]
        return out

    def nbytes(self) -> int:
        n = sum(r.nbytes() for r in self.rings())
        if self.ratio:
            n += self.comp.nbytes
        if self.ratio == CSA_RATIO:
            n += self.index.nbytes
        return n

    def used_bytes(self, n_tokens: int) -> int:
        """Bytes the logical state needs (what a snapshot stores for this layer, without headers)."""
        c_rows = self.n_comp * self.comp.shape[1] if self.ratio else 0
        i_rows = self.n_index * self.index.shape[1] if self.ratio == CSA_RATIO else 0
        raw = min(n_tokens, self.raw.cap) * self.raw.width
        return 4 * (c_rows + i_rows + raw)


class KVState:
    def __init__(self, c: ModelConfig, ctx: int, rewind_cap: int, xp=np):
        self.config, self.ctx, self.rewind_cap = c, ctx, rewind_cap
        self.layers = [LayerState(c, il, ctx, rewind_cap, xp) for il in range(c.n_layer)]

    def copy_to(self, xp, convert) -> "KVState":
        """The same logical state in namespace `xp`, every array converted by `convert`: a device
        backend's state_to_host (convert = to NumPy) and state_from_host (convert = upload)."""
        out = KVState.__new__(KVState)
        out.__dict__.update(self.__dict__)
        out.layers = [layer.copy_to(xp, convert) for layer in self.layers]
        return out

    def nbytes(self) -> int:
        """Bytes allocated for this context (capacity, not use)."""
        return sum(layer.nbytes() for layer in self.layers)

    def can_truncate(self, n_tokens: int, new_len: int) -> bool:
        """Whether the state of n_tokens can be cut back to new_len in place."""
        c = self.config
        for layer in self.layers:
            if not layer.raw.holds(max(0, new_len - c.n_swa + 1), n_tokens):
                return False
            if layer.ratio:
                lo = frontier_start(new_len, layer.ratio)
                if not (layer.proj_kv.holds(lo, n_tokens) and layer.proj_sc.holds(lo, n_tokens)):
                    return False
            if layer.ratio == CSA_RATIO:
                lo = frontier_start(new_len, layer.ratio)
                if not (layer.iproj_kv.holds(lo, n_tokens) and layer.iproj_sc.holds(lo, n_tokens)):
                    return False
        return True

    def truncate(self, n_tokens: int, new_len: int):
        for layer in self.layers:
            for ring in layer.rings():
                # slots of positions below n_tokens - cap were reused by later positions
                ring.avail_lo = max(ring.avail_lo, n_tokens - ring.cap)
            if layer.ratio:
                layer.n_comp = min(layer.n_comp, new_len // layer.ratio)
            if layer.ratio == CSA_RATIO:
                layer.n_index = min(layer.n_index, new_len // layer.ratio)

    def reset(self):
        for layer in self.layers:
            layer.n_comp = layer.n_index = 0
            for ring in layer.rings():
                ring.avail_lo = 0
