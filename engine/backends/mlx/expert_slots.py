"""The expert cache's slots as MLX arrays: what the mlx backend's expert kernels read (issue 39).

Under `--expert-cache` the routed experts are never bound whole (bind_mlx leaves them on the
map, `MlxOps.unbound`). Each of a layer's three expert matrices becomes a `SlotWeight`: an
MxWeight whose array is the cache's slots for that matrix, uint8 [n_slots, n_out, row_bytes],
shared by every layer, in the GGUF's own block bytes (the IQ2_XXS / Q2_K raw layout the kernels
already read: quant.repack binds these types as they are stored). The cache's reads land in the
arrays' memory (a writable NumPy view of each: on Apple Silicon the memory is unified, so the
Metal kernels read the same bytes), and the kernels index slots where they indexed experts
(`SlotWeight.slot_rows`): the same bytes, so the same products.

Two rules keep the bytes right under MLX's lazy graphs:
* a layer's result is evaluated while its experts are held (`settle`, called by
  ExpertCache.moe), so no graph still to run reads a slot that a later read refills;
* the slots are read with buffered preads straight into the arrays: O_DIRECT would need each
  expert's bytes to start on a disk block, and GGUF aligns tensors to 32 bytes (macOS has no
  O_DIRECT either).

The arrays are allocated (and zeroed, so resident) at open: a budget must fit the memory, which
`auto` sizes it to. Other expert types (Q4_K, Q8_0, MXFP4 experts are repacked into MLX's own
layouts at bind) are refused with one line.
"""
from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np

from ...gguf import quants as Q
from ...gguf.expert_reader import Span
from .quant import MxWeight

RAW = {Q.IQ2_XXS: "iq2_xxs", Q.Q2_K: "q2_k"}


@dataclasses.dataclass
class SlotWeight(MxWeight):
    """One expert matrix of layer `il`, its experts in the cache's slots: `w` is [n_slots, n_out,
    row_bytes]; n_expert stays the file's count (the kernels' checks are on expert ids)."""
    cache: object = None
    il: int = 0

    def slot_rows(self, sel) -> mx.array:
        """The slots holding layer il's experts `sel` (int [T, k]) -> int32, same shape. The
        experts must be held (ExpertCache.moe holds a layer's for its call)."""
        h = np.array(sel)
        uniq, inv = np.unique(h, return_inverse=True)
        c = self.cache
        keys = [(self.il, int(e)) for e in uniq]
        if any(k not in c.held or k in c.pending for k in keys):
            raise RuntimeError(f"layer {self.il}: experts {uniq.tolist()} are not all held in the "
                               f"expert cache (the mlx kernels read them through ExpertCache.moe)")
        slots = np.array([c.where[k] for k in keys], dtype=np.int32)
        return mx.array(slots[inv].reshape(h.shape))


class MlxSlots:
    """The slot arrays of one model (ExpertCache's `store`)."""
    direct = False

    def __init__(self, tensors: list):
        """tensors: each layer's [gate, up, down] QTensors (host: left unbound)."""
        first = tensors[0]
        for ts in tensors:
            for m, t in enumerate(ts):
                if t.type_id not in RAW:
                    raise ValueError(f"--expert-cache with the mlx backend reads IQ2_XXS and Q2_K experts "
                                     f"(the q2 files), and {t.name} is {Q.type_name(t.type_id)}; use the "
                                     f"cpu backend for this file")
                if (t.type_id, tuple(t.dims)) != (first[m].type_id, tuple(first[m].dims)):
                    raise ValueError(f"--expert-cache with the mlx backend needs every layer's experts "
                                     f"alike: {t.name} is not shaped as {first[m].name}")
        self.kinds = [t.type_id for t in first]
        self.shapes = [(int(t.dims[1]), Q.row_bytes(t.type_id, int(t.dims[0]))) for t in first]
        self.per = [n * rb for n, rb in self.shapes]
        self.slot_bytes = sum(self.per)
        self.arrays: list = []
        self.n_slots = 0

    def allocate(self, n_slots: int) -> list:
        """The arrays, and writable views of their memory for the reader (one per matrix)."""
        self.n_slots = n_slots
        self.arrays = [mx.zeros((n_slots, n, rb), dtype=mx.uint8) for n, rb in self.shapes]
        mx.eval(*self.arrays)
        views = [np.array(a, copy=False).reshape(-1) for a in self.arrays]
        if not all(v.flags.writeable for v in views):
            raise RuntimeError("mlx did not hand out writable slot memory")    # pragma: no cover
        return [memoryview(v) for v in views]

    def reads(self, layer, e: int, s: int) -> list:
        """Expert e of `layer` (ExpertCache's _Layer: where it lies in the file) into slot s:
        matrix m's bytes at [s] of array m (a buffered read lands at dst + skip)."""
        out = []
        for m, (off, per, _) in enumerate(layer.spans):
            src = off + e * per
            out.append(Span(src, per, s * per - Span(src, 0, 0).skip, m))
        return out

    def weight(self, cache, il: int, m: int, t) -> SlotWeight:
        n_out, _ = self.shapes[m]
        return SlotWeight(type_id=int(t.type_id), kind=RAW[t.type_id], n_in=int(t.dims[0]), n_out=n_out,
                          n_expert=int(t.dims[2]), w=self.arrays[m], scales=None, biases=None,
                          group_size=None, bits=None, mode=None, cache=cache, il=il)

    @staticmethod
    def settle(y) -> None:
        mx.eval(y)

    def close(self) -> None:
        self.arrays = []
