"""Binding a DeepSeek V4 file's weights into device memory, once at open.

The host binding (engine/model/weights.bind: QTensors over the map, small vectors decoded) is
walked and uploaded: every matrix's raw GGUF blocks as they lie in the map (quant.DevTensor: the
kernels read them in place), the small vectors as float32. The bytes go through a pinned
(page-locked) staging buffer in large chunks, the map's pages let go tensor by tensor. Two things
stay on the host, because the glue indexes them with host positions and token ids: the
compressors' position biases (`ape`) and the hash layers' token -> expert tables (`tid2eid`).
"""
from __future__ import annotations

import numpy as np

from ...gguf.model_file import QTensor
from ...model.weights import bind, map_weights
from .quant import DevTensor

HOST_FIELDS = frozenset({"ape", "tid2eid"})
STAGING_BYTES = 256 << 20          # one pinned buffer; copies of this size reach full PCIe speed


class Uploader:
    """Host -> device copies through one pinned buffer, counting bytes for the progress callback."""

    def __init__(self, xp, total: int, progress=None):
        self.xp, self.total, self.done, self.progress = xp, total, 0, progress
        self._pinned = None
        self._stream = xp.cuda.Stream(non_blocking=True)

    def _staging(self, n: int) -> np.ndarray:
        if self._pinned is None:
            size = min(STAGING_BYTES, max(n, 1 << 20))
            self._pinned = np.frombuffer(self.xp.cuda.alloc_pinned_memory(size), np.uint8, size)
        return self._pinned

    def upload(self, host: np.ndarray):
        """A device copy of a host array (any dtype), chunk by chunk through the pinned buffer."""
        xp = self.xp
        host = np.ascontiguousarray(host)
        dev = xp.empty(host.shape, dtype=host.dtype)
        flat_h = host.reshape(-1).view(np.uint8)
        flat_d = dev.reshape(-1).view(xp.uint8)
        stage = self._staging(flat_h.size)
        for a in range(0, flat_h.size, stage.size):
            b = min(flat_h.size, a + stage.size)
            stage[:b - a] = flat_h[a:b]
            flat_d[a:b].set(stage[:b - a], stream=self._stream)
            self._stream.synchronize()          # (the staging buffer is reused by the next chunk)
            self.done += b - a
            if self.progress is not None:
                self.progress(self.done, self.total)
        return dev


def _sizes(host) -> int:
    total = [0]

    def count(name, v):
        if isinstance(v, QTensor):
            total[0] += v.data.nbytes
        elif name not in HOST_FIELDS:
            total[0] += v.size * 4
        return v
    map_weights(host, count)
    return total[0]


def bind_device(xp, model_file, progress=None) -> tuple:
    """(ModelWeights with DevTensors and device vectors, bytes uploaded)."""
    host = bind(model_file)
    up = Uploader(xp, _sizes(host), progress)

    def conv(name, v):
        if isinstance(v, QTensor):
            t = DevTensor(v.name, v.type_id, tuple(v.dims), up.upload(np.asarray(v.data)))
            model_file.gguf.dontneed([v.data])      # copied: the map's pages need not stay ours
            return t
        if name in HOST_FIELDS:
            return v
        return up.upload(np.asarray(v, np.float32) if v.dtype.kind == "f" else v)

    return map_weights(host, conv), up.done
