"""Binding a DeepSeek V4 file's weights into MLX memory, tensor by tensor.

The host binding (engine/model/weights.bind: QTensors over the map, small vectors decoded) is
walked and converted: every matrix is repacked (quant.repack) and evaluated at once, so the
file's pages it read can go back to the page cache and no second copy of the file builds up;
the small vectors are uploaded. Two things stay on the host, because the glue indexes them with
host positions and token ids: the compressors' position biases (`ape`) and the hash layers'
token -> expert tables (`tid2eid`).
"""
from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np

from ...gguf.model_file import QTensor
from ...model.weights import bind, map_weights
from . import quant

HOST_FIELDS = frozenset({"ape", "tid2eid"})


def bind_mlx(model_file, skip: frozenset = frozenset()) -> tuple:
    """(ModelWeights with mx arrays and MxWeights, bytes held in MLX memory). `skip`: tensor
    names left as host QTensors (the routed experts under the expert cache: never read whole)."""
    total = [0]

    def conv(name, v):
        if isinstance(v, QTensor) and v.name in skip:
            return v
        if skip and name in HOST_FIELDS and isinstance(v, np.ndarray):
            # a copy: under the expert cache the file may be cut short under the engine, and a
            # map view would fault (SIGBUS) where the experts' preads return short
            return np.array(v)
        if isinstance(v, QTensor):
            w = quant.repack(v)
            mx.eval(*[a for a in (w.w, w.scales, w.biases) if a is not None])
            model_file.gguf.dontneed([v.data])          # copied: the map's pages need not stay ours
            total[0] += w.nbytes()
            return w
        if name not in HOST_FIELDS:
            a = mx.array(np.ascontiguousarray(v, dtype=np.float32) if v.dtype.kind == "f" else v)
            mx.eval(a)
            total[0] += a.nbytes
            return a
        return v

    weights = map_weights(bind(model_file), conv)
    return weights, total[0]


def take_rows(w, idx) -> mx.array:
    """float32 [len(idx), n_in]: rows `idx` (int32 mx [n]) of a 2-D MxWeight, decoding only those."""
    sub = dataclasses.replace(
        w, w=w.w[idx], n_out=int(idx.size),
        scales=None if w.scales is None else w.scales[idx],
        biases=None if w.biases is None else w.biases[idx])
    return quant.dequantize(sub)
