"""The model cut into contiguous runs of layers, one run per rank (pipeline parallel, issue 38).

What is here is the arithmetic side of a split, with no transport: which layers each rank takes
(`--layers a:b,c:d,...` or `auto`), a KV state that holds only some layers (`PartialKVState`),
and `LayerRunner`, which runs a rank's layers on the HC state it is handed with the unchanged
`Model` code (the same attention and FFN calls, in the same order, as a single process: a split
run's logits are a single process's bit for bit). engine/runtime/distributed.py moves the HC
state between ranks.

Which rank maps what: rank 0 the embedding and its layers, each worker its layers, the last
rank the output head as well. `weights.bind` reads `ModelFile.keep` (a `Keep`) and leaves the
other layers None, so a device backend uploads only these.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ..gguf.config import ModelConfig
from .kv_state import KVState, LayerState
from .model import Model, Segment

_RANGE = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")


class SplitError(ValueError):
    """A --layers value that does not fit the model or the ranks; the message is one line."""


def check_spec(spec: str) -> None:
    """The syntax alone (no model yet): 'auto' or 'a:b,c:d,...' of whole numbers, a < b."""
    parse_ranges(spec)


def parse_ranges(spec: str) -> list[tuple[int, int]] | None:
    """None for 'auto', else the ranges as given (each a < b), or a SplitError."""
    if not isinstance(spec, str) or not spec.strip():
        raise SplitError(f"--layers takes 'auto' or ranges a:b,c:d,..., not {spec!r}")
    if spec.strip() == "auto":
        return None
    out = []
    for part in spec.split(","):
        m = _RANGE.match(part)
        if not m:
            raise SplitError(f"--layers: {part.strip()!r} is not a range a:b (e.g. --layers 0:22,22:43)")
        a, b = int(m.group(1)), int(m.group(2))
        if a >= b:
            raise SplitError(f"--layers: the range {a}:{b} is empty (a layer range is a:b with a < b)")
        out.append((a, b))
    return out


def plan(spec: str, n_layer: int, n_ranks: int, free: list[int] | None = None,
         layer_bytes: list[int] | None = None, edge_bytes: tuple[int, int] = (0, 0)) -> list[tuple[int, int]]:
    """One contiguous range per rank, rank 0 first, covering layers 0..n_layer-1.
    auto: by each rank's free memory (`free`, bytes), weighing each layer by its bytes and
    counting the embedding on rank 0 and the head on the last (`edge_bytes`)."""
    ranges = parse_ranges(spec)
    if ranges is None:
        return auto_plan(n_layer, n_ranks, free, layer_bytes, edge_bytes)
    if len(ranges) != n_ranks:
        raise SplitError(f"--layers names {len(ranges)} range(s) but {n_ranks} rank(s) run "
                         f"(one range per rank, rank 0 first)")
    at = 0
    for a, b in ranges:
        if a != at:
            raise SplitError(f"--layers: the ranges must follow each other from layer 0 "
                             f"(expected one starting at {at}, got {a}:{b})")
        at = b
    if at != n_layer:
        raise SplitError(f"--layers covers layers 0..{at - 1} but the model has {n_layer} (0..{n_layer - 1})")
    return ranges


def auto_plan(n_layer: int, n_ranks: int, free=None, layer_bytes=None, edge_bytes=(0, 0)):
    if n_ranks > n_layer:
        raise SplitError(f"{n_ranks} ranks cannot share {n_layer} layers (each rank takes at least one)")
    free = [max(1, int(f)) for f in (free or [1] * n_ranks)]
    lb = [max(1, int(b)) for b in (layer_bytes or [1] * n_layer)]
    total = sum(lb) + sum(edge_bytes)
    share = np.cumsum(free) / sum(free) * total          # where each rank's share of the bytes ends
    out, a, used = [], 0, edge_bytes[0]
    for r in range(n_ranks - 1):
        b = a + 1                                         # at least one layer each
        used += lb[a]
        # take layers while this rank's share holds them and enough are left for the rest
        while b < n_layer - (n_ranks - 1 - r) and used + lb[b] / 2 <= share[r]:
            used += lb[b]
            b += 1
        out.append((a, b))
        a = b
    out.append((a, n_layer))
    return out


@dataclass(frozen=True)
class Keep:
    """What one rank binds: its layers, and whether it holds the embedding and the head."""
    layers: tuple[int, int]
    embed: bool
    head: bool

    def has(self, il: int) -> bool:
        return self.layers[0] <= il < self.layers[1]


class LayerMap:
    """A state's layers by model index; iterating yields the held layers only (what KVState's
    truncate, reset, nbytes and a backend's state walk visit)."""

    def __init__(self, layers: dict):
        self._d = dict(layers)

    def __getitem__(self, il: int):
        return self._d[il]

    def __iter__(self):
        return iter(self._d.values())

    def __len__(self):
        return len(self._d)

    def items(self):
        return self._d.items()

    def get(self, il: int):
        return self._d.get(il)


class PartialKVState(KVState):
    """A KVState holding only layers a..b-1 (the rest live on other ranks)."""

    def __init__(self, c: ModelConfig, ctx: int, rewind_cap: int, layers: tuple[int, int], xp=np):
        self.config, self.ctx, self.rewind_cap = c, ctx, rewind_cap
        self.span = tuple(layers)
        self.layers = LayerMap({il: LayerState(c, il, ctx, rewind_cap, xp) for il in range(*layers)})

    def copy_to(self, xp, convert) -> "PartialKVState":
        out = PartialKVState.__new__(PartialKVState)
        out.__dict__.update(self.__dict__)
        out.layers = LayerMap({il: ls.copy_to(xp, convert) for il, ls in self.layers.items()})
        return out


class LayerRunner:
    """Runs one rank's part of a pass with the `Model`'s own sublayer code."""

    def __init__(self, model: Model, keep: Keep):
        self.m, self.keep = model, keep

    def embed(self, tokens: np.ndarray):
        m = self.m
        e = m.ops.embed(m.w.embd, tokens)
        return m.xp.repeat(m.xp.asarray(e, dtype=m.xp.float32)[:, None, :], m.c.n_hc, axis=1)

    def layers(self, X, tokens: np.ndarray, pos0: int, state):
        """This rank's layers over X [T, n_hc, E] at positions pos0.. on `state`."""
        m = self.m
        m._theta_cache = {}
        T = len(tokens)
        segs = [Segment(0, T, int(pos0), state)]
        pos = np.arange(pos0, pos0 + T)
        if m.experts is not None:           # (--expert-cache: this rank's hash layers read ahead)
            m.experts.begin_step(m.w.layers, tokens)
        for il in range(*self.keep.layers):
            lw = m.w.layers[il]
            X = m._attention(lw, il, X, segs, pos)
            X = m._ffn(lw, X, tokens)
        return X

    def head(self, X, all_logits: bool):
        return self.m._head(X if all_logits else X[-1:])
