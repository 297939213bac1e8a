"""CUDA graphs of the decode step's position-independent part: each layer's experts (ops.moe).

A decode step launches a few dozen kernels and elementwise ops per layer; on a GPU each launch
costs a few microseconds of CPU and driver time, which at 43 layers is a large share of a token.
The MoE block of a layer (the routed experts' gathered products, SwiGLU, ds4's activation codes,
the shared expert) has the same launches, grids and buffer sizes at every position: its inputs
(u, the selected experts and their weights) are device data. So it is captured once per (layer,
input shapes) into a CUDA graph and replayed per token:

* the first call runs eagerly (a warm-up: every kernel fetched and every CuPy elementwise kernel
  compiled before a capture, which must not load modules), from the graph's private memory pool;
* the second copies its inputs into static buffers, captures fn on those on a side stream with a
  private memory pool (the graph's intermediates never share blocks with eager arrays), then
  replays it;
* every later call copies its inputs into the static buffers, replays, and copies the output out
  (the next replay overwrites the static output).

What depends on the position (attention over a growing key range, the compressors' windows, the
KV writes, RoPE angles) stays eager: its shapes and indices change per token. A new shape (a batch
of several sessions) gets its own graph. DS4_CUDA_GRAPHS=0 turns graphs off. On the CuPy stand-in
(DS4_CUDA_EMULATE=1) capture and replay are modelled step for step (standin.Graph), including the
errors a capture raises on a device for a host transfer.
"""
from __future__ import annotations

import os

ENV = "DS4_CUDA_GRAPHS"


def enabled() -> bool:
    return os.environ.get(ENV, "").strip() != "0"


class _Captured:
    __slots__ = ("owner", "graph", "inputs", "out", "pool")

    def __init__(self, owner, graph, inputs, out, pool):
        self.owner, self.graph, self.inputs, self.out, self.pool = owner, graph, inputs, out, pool


class DecodeGraphs:
    def __init__(self, xp):
        self.xp = xp
        self._g: dict = {}                  # key -> (owner, None) after the warm-up, or _Captured
        self._stream = None
        self._inside = False        # a warm-up or capture of an outer block is running
        self.captures = self.replays = 0

    def run(self, owner, fn, inputs: tuple):
        """fn(*inputs) (device arrays -> a device array or a tuple of them), from a graph keyed by owner (kept,
        and checked by identity) and the inputs' shapes and dtypes."""
        if self._inside:            # a block inside one being warmed up or captured: part of it
            return fn(*inputs)
        key = (id(owner),) + tuple((a.shape, str(a.dtype)) for a in inputs)
        hit = self._g.get(key)
        if hit is None or (hit[0] if isinstance(hit, tuple) else hit.owner) is not owner:
            # warm-up, eager, from the graph's private pool: its blocks, freed, serve the capture's
            # allocations of the same sizes (no cudaMalloc while capturing)
            pool = self.xp.cuda.MemoryPool()
            self._g[key] = (owner, pool)
            self._inside = True
            try:
                with self.xp.cuda.using_allocator(pool.malloc):
                    return fn(*inputs)
            finally:
                self._inside = False
        if isinstance(hit, tuple):
            self._inside = True
            try:
                hit = self._g[key] = self._capture(owner, fn, inputs, hit[1])
            finally:
                self._inside = False
        for s, a in zip(hit.inputs, inputs):
            s[...] = a                              # device -> device, in stream order
        hit.graph.launch()
        self.replays += 1
        # (the next replay overwrites the static outputs)
        return tuple(o.copy() for o in hit.out) if isinstance(hit.out, tuple) else hit.out.copy()

    def _capture(self, owner, fn, inputs, pool) -> _Captured:
        xp = self.xp
        if self._stream is None:
            self._stream = xp.cuda.Stream(non_blocking=True)
        static = tuple(a.copy() for a in inputs)
        xp.cuda.Device().synchronize()          # the static inputs are written before the side stream reads
        # relaxed: a pool that must still grow may call cudaMalloc while capturing
        mode = getattr(xp.cuda.runtime, "streamCaptureModeRelaxed", None)
        with xp.cuda.using_allocator(pool.malloc), self._stream:
            self._stream.begin_capture(mode)
            try:
                out = fn(*static)
            finally:
                graph = self._stream.end_capture()
        self.captures += 1
        return _Captured(owner, graph, static, out, pool)
